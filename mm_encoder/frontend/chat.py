"""OpenAI chat messages -> rendered prompt text around media items, and streamed text deltas back.

Media content parts are cut out before the chat template runs: each becomes a sentinel in the
message text, the template renders plain strings (any model's template works), and the rendered
text is split at the sentinels. The splice by length is `core.prompt.Splicer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..core.errors import BadRequest, ModelDirError
from ..core.prompt import ChatTokenizer

_SENTINEL = "\ue000{}\ue001"  # Unicode private use: never produced by tokenizers for real text
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class MediaRef:
    modality: str  # image | video
    url: str


def parse_messages(messages: Any, max_media: int) -> tuple[list[dict[str, str]], list[MediaRef]]:
    """OpenAI messages -> messages with string content (media as sentinels) + the media items."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list")
    flat, media = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a `role`")
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
                        raise BadRequest(f"messages[{i}].content[{j}].{kind} needs a `url`")
                    media.append(MediaRef("image" if kind == "image_url" else "video", url))
                    if len(media) > max_media:
                        raise BadRequest(f"at most {max_media} media items per request")
                    pieces.append(_SENTINEL.format(len(media) - 1))
                else:
                    raise BadRequest(f"messages[{i}].content[{j}]: unsupported content part type {kind!r} "
                                     "(text, image_url and video_url are)")
            text = "".join(pieces)
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        flat.append({"role": m["role"], "content": text})
    return flat, media


def _strip_sentinels(text: str) -> str:
    return text.replace("\ue000", "").replace("\ue001", "")


def prompt_segments(tok: ChatTokenizer, messages: list[dict[str, str]], n_media: int) -> list[str]:
    """The rendered prompt split at the media sentinels: n_media + 1 text segments, in order."""
    parts = _SENTINEL_RE.split(tok.render(messages))
    texts, order = parts[0::2], [int(x) for x in parts[1::2]]
    if order != list(range(n_media)):
        raise ModelDirError("the chat template dropped or reordered media items")
    return texts


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids, decoding only a short window per step.

    Decoding everything each step is quadratic, and a byte-level BPE can end a step in the middle
    of a UTF-8 character (decoded as U+FFFD) that the next token completes: text is held back
    until it decodes cleanly, and `flush` releases whatever is left at the end. Not
    `tokenizers.decoders.DecodeStream`: that drives only a `tokenizers.Tokenizer`, and Kimi's
    tokenizer is tiktoken behind transformers' remote code; this needs nothing but `decode`.
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


class StopStrings:
    """Cuts streamed text at the first stop string. A tail that could still begin a stop string is
    held back until the next delta tells (at most the longest stop string, less one character)."""

    def __init__(self, stops: list[str]):
        self.stops = [x for x in stops if x]
        self.hold = max((len(x) for x in self.stops), default=1) - 1
        self.pending = ""

    def push(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """(text to emit, whether a stop string ended it)."""
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [i for i in (text.find(x) for x in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], True
        keep = 0 if final else next((k for k in range(min(self.hold, len(text)), 0, -1)
                                     if any(x.startswith(text[-k:]) for x in self.stops)), 0)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False
