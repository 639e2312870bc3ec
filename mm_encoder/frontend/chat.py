"""OpenAI chat messages -> token segments around media items, and the splice by length.

Media content parts are cut out before the chat template runs: each becomes a sentinel in the
message text, the template renders plain strings (any model's template works), and the rendered
text is split at the sentinels. After encoding, each item's place gets the model's own prompt
for it (`spec.prompt.image`, or `spec.prompt.video` per chunk with its timestamp) with the one
placeholder token repeated N times, N = the encoder's `length` for that image or chunk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MMEncoderError
from ..spec import PromptConfig

_SENTINEL = "\ue000{}\ue001"  # Unicode private use: never produced by tokenizers for real text
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


class ChatError(MMEncoderError):
    code = "bad_request"
    http_status = 400


@dataclass(frozen=True)
class MediaRef:
    modality: str  # image | video
    url: str


@dataclass
class ParsedChat:
    text_segments: list[str]  # len(media) + 1 pieces of rendered template text
    media: list[MediaRef] = field(default_factory=list)


def parse_messages(messages: Any, max_media: int) -> tuple[list[dict[str, str]], list[MediaRef]]:
    """OpenAI messages -> messages with string content (media as sentinels) + the media items."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("`messages` must be a non-empty list")
    flat, media = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"messages[{i}] must be an object with a `role`")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = _strip_sentinels(content)
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    pieces.append(_strip_sentinels(str(part.get("text", ""))))
                elif kind in ("image_url", "video_url"):
                    ref = part.get(kind)
                    url = ref.get("url") if isinstance(ref, dict) else ref
                    if not isinstance(url, str) or not url:
                        raise ChatError(f"messages[{i}].content[{j}].{kind} needs a `url`")
                    media.append(MediaRef("image" if kind == "image_url" else "video", url))
                    if len(media) > max_media:
                        raise ChatError(f"at most {max_media} media items per request")
                    pieces.append(_SENTINEL.format(len(media) - 1))
                else:
                    raise ChatError(f"messages[{i}].content[{j}]: unsupported content part type {kind!r} "
                                    "(text, image_url and video_url are)")
            text = "".join(pieces)
        else:
            raise ChatError(f"messages[{i}].content must be a string or a list of parts")
        flat.append({"role": m["role"], "content": text})
    return flat, media


def _strip_sentinels(text: str) -> str:
    return text.replace("\ue000", "").replace("\ue001", "")


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
                raise ChatError(f"{self.model_dir} has no tokenizer.json and transformers is not installed",
                                http_status=500) from None
            self._hf = AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=allow_remote_code)
            template = template or self._hf.chat_template
        if not template:
            raise ChatError(f"{self.model_dir}: no chat_template in tokenizer_config.json", http_status=500)
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

    def token_id(self, token: str) -> int:
        tid = self._hf.convert_tokens_to_ids(token) if self._hf is not None else self._tok.token_to_id(token)
        if tid is None:
            raise ChatError(f"the tokenizer has no token {token!r}", http_status=500)
        return tid

    def prompt_text(self, messages: list[dict[str, str]], n_media: int) -> list[str]:
        """Rendered prompt split at the media sentinels: n_media + 1 text segments, in order."""
        rendered = self.render(messages)
        parts = _SENTINEL_RE.split(rendered)
        texts, order = parts[0::2], [int(x) for x in parts[1::2]]
        if order != list(range(n_media)):
            raise ChatError("the chat template dropped or reordered media items", http_status=500)
        return texts


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids, decoding only a short window per step.

    Decoding everything each step is quadratic, and a byte-level BPE can end a step in the middle
    of a UTF-8 character (decoded as U+FFFD) that the next token completes: text is held back
    until it decodes cleanly, and `flush` releases whatever is left at the end.
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window whose text was already emitted up to `read`
        self.read = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        done = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        done = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]


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

    def splice(self, texts: list[str], media: list[tuple[str, list[int], list[str] | None]]) -> Spliced:
        """texts: n+1 segments; media: per item (modality, tokens per image/chunk, timestamps)."""
        return self.splice_ids([self.tok.encode(t) if t else [] for t in texts], media)

    def splice_ids(self, segments: list[list[int]], media: list[tuple[str, list[int], list[str] | None]]) -> Spliced:
        """The same from already tokenized text segments (the engine's inline-encoding path)."""
        if len(segments) != len(media) + 1:
            raise ChatError(f"{len(segments)} text segments for {len(media)} media items", http_status=500)
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
