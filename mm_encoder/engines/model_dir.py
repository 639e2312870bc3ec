"""The text side of a generated Kimi-K2.5 checkpoint directory, written without torch or downloads.

`write_text_files` writes what the frontend, Dynamo's stock frontend and the engines read besides
weights: a byte-level BPE `tokenizer.json` trained on a fixed corpus with the family's special
tokens, `tokenizer_config.json` with a chat template shaped like the family's own (both from the
family module's `CheckpointWriter.chat`, e.g. `families.kimi_k25.CHAT`; OpenAI content parts as
given; Kimi-K2.5: an image part writes the image prompt with one `<|media_pad|>`, a video part one
`<|kimi_k25_video_placeholder|>`; GLM-4.xV: `<|begin_of_image|><|image|><|end_of_image|>`), and
`generation_config.json`. The same call writes the same files everywhere, so a frontend and its
engines always agree. The weights are `engines.tiny_checkpoint`'s.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from ..core.kimi_tokenizer import KIMI_PATTERN, TIKTOKEN_FILE
from ..core.prompt import ChatTokenizer
from ..families import CheckpointWriter, by_name

_CORPUS = """The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe the image in detail. What is in this picture? Compare the two images and the video.
Large language models read tokens; a vision encoder turns pixels into embeddings first.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; times 00:00:00.000 00:00:02.000.
Punctuation: , . ; : ! ? ' " ( ) [ ] { } - _ / = + * % # @ & |
"""


def write_text_files(path: str | Path, *, family: str = "kimi_k25", vocab_size: int = 1024,
                     context_length: int = 32768) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `path`; returns
    the special tokens' ids and `vocab_size` (the caller's config.json names the media tokens by id)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    writer = by_name(family).checkpoint
    if not isinstance(writer, CheckpointWriter):
        raise ValueError(f"no generated checkpoint for family {family}: {writer.reason}")
    fmt = writer.chat
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    if fmt.tiktoken:  # Kimi's split, then bytes as characters: what its tiktoken tokenizer does
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(fmt.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.add_special_tokens(list(fmt.specials))  # after the trained vocabulary, as in the real ones
    tok.save(str(path / "tokenizer.json"))
    ids: dict[str, int] = {}
    for t in fmt.specials:
        tid = tok.token_to_id(t)
        assert tid is not None, t  # added just above
        ids[t] = tid
    if fmt.tiktoken:  # the same vocabulary as Kimi releases it: base64(token bytes) and rank per line
        bytes_of = ChatTokenizer.piece_bytes
        ranks = sorted((i, t) for t, i in tok.get_vocab(with_added_tokens=False).items())
        (path / TIKTOKEN_FILE).write_text("".join(f"{base64.b64encode(bytes_of(t)).decode()} {i}\n" for i, t in ranks))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[fmt.bos], "eos_token_id": ids[fmt.eos], "pad_token_id": ids[fmt.pad]}, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": fmt.bos, "eos_token": fmt.eos, "pad_token": fmt.pad, "chat_template": fmt.template,
        "model_max_length": context_length, "tokenizer_class": "PreTrainedTokenizerFast",
        # every AddedToken field: Dynamo's Rust tokenizer loader refuses entries with fewer
        "added_tokens_decoder": {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for t in fmt.specials},
    }, indent=2))
    return {**ids, "vocab_size": tok.get_vocab_size()}
