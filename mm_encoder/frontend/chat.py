"""OpenAI chat messages -> the checkpoint's chat template input, and streamed text deltas back
(`item_text`: an engine item's tokens as text, with exact stop-string semantics over batched items).

Messages reach the chat template as the client sent them (content as a string or as a list of
parts: text, `image_url`, `video_url`), as the model's own template expects; the template writes
each image's prompt with one placeholder and one placeholder per video, which `core.prompt.Splicer`
expands to each item's rows. A client's text may not contain those placeholder tokens: they would
claim media rows nothing fills.
"""

from __future__ import annotations

from typing import Any

from ..core.errors import BadRequest
from ..core.prompt import ChatTokenizer
from ..core.requests import MediaRef

MEDIA_PARTS = {"image_url": "image", "video_url": "video"}


def parse_messages(messages: Any, max_media: int, reserved: tuple[str, ...] = ()
                   ) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """OpenAI messages, checked, for the chat template (unchanged but for validation), and their
    media items in order. Each part's type is one the template renders or a 400 that names it."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list")
    media: list[MediaRef] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a `role`")
        content = m.get("content")
        if content is None or isinstance(content, str):
            _check_text(content or "", f"messages[{i}].content", reserved)
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"{where}.text must be a string")
                _check_text(part["text"], f"{where}.text", reserved)
            elif kind in MEDIA_PARTS:
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise BadRequest(f"{where}.{kind} needs a `url`")
                media.append(MediaRef(MEDIA_PARTS[kind], url))
                if len(media) > max_media:
                    raise BadRequest(f"at most {max_media} media items per request")
            else:
                raise BadRequest(f"{where}: unsupported content part type {kind!r} (text, image_url and video_url "
                                 "are)")
    return messages, media


def _check_text(text: str, where: str, reserved: tuple[str, ...]) -> None:
    for token in reserved:
        if token in text:
            raise BadRequest(f"{where} contains {token!r}, a token reserved for media the chat template places")


def text_bytes(messages: list[dict[str, Any]]) -> int:
    """The UTF-8 size of every text the client sent: a bound on the prompt's text tokens."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content.encode())
        elif isinstance(content, list):
            total += sum(len(p["text"].encode()) for p in content if p.get("type") == "text")
    return total


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


def item_text(detok: IncrementalDetokenizer, stops: StopStrings, tokens: list[int],
              final: bool) -> tuple[str, int, bool]:
    """(text, tokens used, whether a stop string ended it) for one engine item. With stop strings,
    token by token, so generation ends at the token that completed one, as if each token had come
    alone (usage and logprobs count no token after it); without, the whole item at once."""
    if not stops.stops or len(tokens) <= 1:
        delta = detok.push(tokens) + (detok.flush() if final else "")
        delta, matched = stops.push(delta, final=final)
        return delta, len(tokens), matched
    parts = []
    for i, token in enumerate(tokens):
        last = final and i == len(tokens) - 1
        delta = detok.push([token]) + (detok.flush() if last else "")
        delta, matched = stops.push(delta, final=last)
        parts.append(delta)
        if matched:
            return "".join(parts), i + 1, True
    return "".join(parts), len(tokens), False
