"""A checkpoint's tokenizer as Kimi releases it: `tiktoken.model` (with its tokenizer as Hub remote
code, which is not run) reads to exactly the ids of the same vocabulary as `tokenizer.json`.

The generated checkpoint ships both spellings of one vocabulary (Kimi's split pattern, byte-level
BPE); the tiktoken copy is read with transformers' `TikTokenConverter` and the rules Kimi's remote
code states (its pattern, 256 special ids after the ranks).
"""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from mm_encoder.core.errors import ModelDirError
from mm_encoder.core.prompt import ChatTokenizer

TEXTS = [
    "What is in this image? The quick brown fox jumps over the lazy dog.",
    "café ☕ 中文字符 and 日本語 123456789 x\n\n  y\t\tz",
    "I'll DON'T it's WE'RE you've 00:00:02.000 (a) [b] {c}",
    "Hello<|im_end|>world <|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "   \r\n.!!! ... ---",
]


@pytest.fixture(scope="module")
def tiktoken_only(checkpoint, tmp_path_factory):
    """The checkpoint as Kimi ships it: tiktoken.model, no tokenizer.json, Kimi's tokenizer class."""
    d = tmp_path_factory.mktemp("tiktoken") / "kimi"
    shutil.copytree(checkpoint, d)
    (d / "tokenizer.json").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "TikTokenTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    template = cfg.pop("chat_template")  # and the template in its own file, as newer checkpoints keep it
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(template)
    return d


def test_kimis_tiktoken_vocabulary_gives_the_same_ids_as_tokenizer_json(checkpoint, tiktoken_only):
    ours, kimi = ChatTokenizer(checkpoint), ChatTokenizer(tiktoken_only)
    for text in TEXTS:
        assert kimi.encode(text) == ours.encode(text), text
        assert kimi.decode(kimi.encode(text)) == ours.decode(ours.encode(text))
    for token in ("<|media_pad|>", "<|kimi_k25_video_placeholder|>", "<|im_end|>"):
        assert kimi.token_id(token) == ours.token_id(token)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}]
    assert kimi.render(messages) == ours.render(messages)


def test_a_tiktoken_vocabulary_of_another_family_is_refused(tiktoken_only, tmp_path):
    d = tmp_path / "other"
    shutil.copytree(tiktoken_only, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"], cfg["auto_map"] = "SomeOtherTokenizer", {}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="split pattern is unknown"):
        ChatTokenizer(d)


def test_special_ids_that_do_not_follow_the_ranks_are_refused(tiktoken_only, tmp_path):
    d = tmp_path / "shifted"
    shutil.copytree(tiktoken_only, d)
    text = (d / "tiktoken.model").read_text()
    n = len(text.splitlines())  # one rank more: the first special id is now an ordinary token's
    (d / "tiktoken.model").write_text(text + f"{base64.b64encode(b'zzzzzz').decode()} {n}\n")
    with pytest.raises(ModelDirError, match="do not follow the"):
        ChatTokenizer(d)
