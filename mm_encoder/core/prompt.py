"""The model's prompt: its tokenizer and chat template, and the splice of media placeholders.

Shared by the frontend (which splices the encoder's token counts into the prompt) and the
reference engine's aggregated baseline (which encodes media itself and splices the same way).
Each media item's place gets the model's own prompt for it (`spec.prompt.image`, or
`spec.prompt.video` per chunk with its timestamp) with the one placeholder token repeated N
times, N = the encoder's token count for that image or chunk.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BadRequest, MMEncoderError, ModelDirError
from .spec import PromptConfig


class ChatTokenizer:
    """The model directory's tokenizer and chat template.

    `tokenizer.json` via the `tokenizers` library when present; otherwise transformers'
    AutoTokenizer, with the model's own code only when `allow_remote_code` (Kimi's tiktoken
    tokenizer ships as remote code). The template renders in a sandboxed Jinja environment.
    """

    def __init__(self, model_dir: str | Path, allow_remote_code: bool = False):
        self.model_dir = Path(model_dir)
        tok_config = _read_json(self.model_dir / "tokenizer_config.json")
        template = tok_config.get("chat_template")
        self._hf = None
        if (self.model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                msg = f"{self.model_dir} has no tokenizer.json and transformers is not installed"
                raise ModelDirError(msg) from None
            self._hf = AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=allow_remote_code)
            template = template or self._hf.chat_template
        if not template:
            raise ModelDirError(f"{self.model_dir}: no chat_template in tokenizer_config.json")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template)
        self.special = {k: tok_config.get(k) for k in ("bos_token", "eos_token")}

    def render(self, messages: list[dict[str, str]]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, **self.special)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._tok.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token in bytes: a bound from text size to token count, known without tokenizing."""
        if self._hf is not None:
            vocab = self._hf.get_vocab()
            return max(len(t.encode()) for t in vocab) if vocab else 1
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(t.encode()) for t in vocab), default=1)

    def token_id(self, token: str) -> int:
        tid = self._hf.convert_tokens_to_ids(token) if self._hf is not None else self._tok.token_to_id(token)
        if tid is None:
            raise ModelDirError(f"the tokenizer has no token {token!r}")
        return tid


@dataclass
class Spliced:
    token_ids: list[int]
    spans: list[list[tuple[int, int]]]  # per media item: (offset, length) per image or chunk


class Splicer:
    """Builds the final token ids: text segments and, per media item, the model's prompt for it
    with its placeholder repeated to the encoder's token count."""

    def __init__(self, tokenizer: ChatTokenizer, prompt: PromptConfig):
        self.tok = tokenizer
        self.prompt = prompt
        # the tokenizer's id, not the spec's placeholder_id: a test LLM's vocabulary differs from the real one
        self.placeholder_id = tokenizer.token_id(prompt.placeholder)
        self._around: dict[str, tuple[list[int], list[int]]] = {}

    def _pre_post(self, text: str) -> tuple[list[int], list[int]]:
        if text not in self._around:
            pre, _, post = text.partition(self.prompt.placeholder)
            self._around[text] = (self.tok.encode(pre), self.tok.encode(post))
        return self._around[text]

    def split_markers(self, token_ids: list[int]) -> tuple[list[list[int]], list[str]]:
        """The inverse of a chat template that renders each media item as its prompt with one
        placeholder (Dynamo's stock frontend, our model directories' template): the text segments
        around the items and each item's modality, ready for `splice_ids`. A placeholder outside
        a media prompt is refused: nothing could fill it."""
        markers = {m: self._pre_post(t) for m, t in (("image", self.prompt.image),
                                                      ("video", self.prompt.video.format(timestamp="")))}
        segments: list[list[int]] = []
        modalities: list[str] = []
        start = 0
        for i, tid in enumerate(token_ids):
            if tid != self.placeholder_id or i < start:
                continue
            for modality, (pre, post) in markers.items():
                lo, hi = i - len(pre), i + 1 + len(post)
                if lo >= start and token_ids[lo:i] == pre and token_ids[i + 1 : hi] == post:
                    segments.append(token_ids[start:lo])
                    modalities.append(modality)
                    start = hi
                    break
            else:
                raise BadRequest(f"the prompt has a media placeholder at token {i} outside any media item's prompt")
        segments.append(token_ids[start:])
        return segments, modalities

    def splice(self, texts: list[str], media: list[tuple[str, list[int], list[str] | None]]) -> Spliced:
        """texts: n+1 segments; media: per item (modality, tokens per image/chunk, timestamps)."""
        return self.splice_ids([self.tok.encode(t) if t else [] for t in texts], media)

    def splice_ids(self, segments: list[list[int]], media: list[tuple[str, list[int], list[str] | None]]) -> Spliced:
        """The same from already tokenized text segments (the engine's inline-encoding path)."""
        if len(segments) != len(media) + 1:
            raise MMEncoderError(f"{len(segments)} text segments for {len(media)} media items", "internal", 500)
        ids: list[int] = []
        spans: list[list[tuple[int, int]]] = []
        for i, seg in enumerate(segments):
            ids.extend(seg)
            if i == len(media):
                break
            modality, counts, stamps = media[i]
            item = []
            for c, n in enumerate(counts):
                tmpl = self.prompt.image if modality == "image" else self.prompt.video.format(
                    timestamp=(stamps or [""] * len(counts))[c])
                pre, post = self._pre_post(tmpl)
                ids.extend(pre)
                item.append((len(ids), n))
                ids.extend([self.placeholder_id] * n)
                ids.extend(post)
            spans.append(item)
        return Spliced(ids, spans)


def check_model_dir(path: Path | None) -> Path | None:
    """An LLM directory as the frontend and engines read it: refused early, by what is missing."""
    if path is None:
        return None
    if not path.is_dir():
        raise ValueError(f"--model-dir {path} is not a directory (an LLM directory, or write one with "
                         "--make-model-dir)")
    missing = [f for f in ("config.json", "tokenizer_config.json") if not (path / f).is_file()]
    if missing:
        raise ValueError(f"--model-dir {path} has no {' or '.join(missing)}: not an LLM directory")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
