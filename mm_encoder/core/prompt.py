"""The model's prompt: its tokenizer and chat template, and the expansion of media placeholders.

Shared by the frontend (which expands the encoder's row counts into the prompt), the engines
(Dynamo's stock frontend sends them one placeholder per item) and the aggregated baseline (which
encodes media itself and expands the same way). The checkpoint's chat template writes each image's
prompt with one placeholder and one placeholder per video; `Splicer` repeats an image's placeholder
to its row count and replaces a video's with one prompt per chunk (`spec.prompt.video`, its
timestamp, its rows), as the model's own processor does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BadRequest, MMEncoderError, ModelDirError
from .kimi_tokenizer import TIKTOKEN_FILE, kimi_tokenizer
from .spec import PromptConfig


class ChatTokenizer:
    """The model directory's tokenizer and chat template.

    `tokenizer.json` via the `tokenizers` library when present; else Kimi's released tiktoken
    vocabulary (`tiktoken.model`, `core.kimi_tokenizer`: its remote code's rules, without running
    it); otherwise transformers' AutoTokenizer, with the model's own code only when
    `allow_remote_code`. The template (tokenizer_config.json's `chat_template`, or
    `chat_template.jinja`) renders in a sandboxed Jinja environment.
    """

    def __init__(self, model_dir: str | Path, allow_remote_code: bool = False):
        self.model_dir = Path(model_dir)
        tok_config = _read_json(self.model_dir / "tokenizer_config.json")
        template = tok_config.get("chat_template")
        if not template and (self.model_dir / "chat_template.jinja").is_file():
            template = (self.model_dir / "chat_template.jinja").read_text()
        self._hf = None
        if (self.model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        elif (self.model_dir / TIKTOKEN_FILE).is_file():
            self._tok = kimi_tokenizer(self.model_dir, tok_config)
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
            return str(self._hf.decode(ids, skip_special_tokens=True))
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def token_text(self, tid: int) -> str:
        """One token as text, special tokens included (a byte-level piece of a character shows as U+FFFD)."""
        if self._hf is not None:
            return str(self._hf.decode([tid], skip_special_tokens=False))
        return str(self._tok.decode([tid], skip_special_tokens=False))

    def token_bytes(self, tid: int) -> bytes:
        """One token's own bytes (OpenAI's `logprobs[].bytes`): a byte-level BPE piece maps back
        byte for byte; an added or special token is its text."""
        piece = self._hf.convert_ids_to_tokens(tid) if self._hf is not None else self._tok.id_to_token(tid)
        if not isinstance(piece, str):
            return b""
        return piece.encode() if piece in self._added else self.piece_bytes(piece)

    @staticmethod
    def piece_bytes(piece: str) -> bytes:
        """A byte-level BPE vocabulary entry's bytes (its characters stand for bytes)."""
        table = _byte_decoder()
        return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()

    @functools.cached_property
    def _added(self) -> frozenset[str]:
        if self._hf is not None:
            return frozenset(self._hf.get_added_vocab())
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())

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
        if not isinstance(tid, int):
            raise ModelDirError(f"the tokenizer has no token {token!r}")
        return tid


MediaItem = tuple[str, list[int], "Sequence[str] | None"]  # (modality, rows per image or chunk, chunk timestamps)


@dataclass
class Spliced:
    token_ids: list[int]
    spans: list[list[tuple[int, int]]]  # per media item: (offset, length) per image or chunk


class Splicer:
    """The prompt with each media item's placeholder expanded to its rows, as the model's own
    processor builds it: an image's one `placeholder` becomes N of them; a video's one
    `video_placeholder` becomes, per chunk, the chunk prompt (its timestamp) with its N rows.

    Two ways in, one result: `expand_text` from the rendered chat template (this project's
    frontend: the chunk prompts are spliced into the text before tokenizing it whole, as the
    processor does), `expand_ids` from token ids (Dynamo's stock frontend tokenized the prompt:
    each chunk prompt is tokenized on its own).
    """

    def __init__(self, tokenizer: ChatTokenizer, prompt: PromptConfig):
        self.tok = tokenizer
        self.prompt = prompt
        # the tokenizer's ids, not the spec's placeholder_id: a small test vocabulary differs from the real one
        self.placeholder_id = tokenizer.token_id(prompt.placeholder)
        self.video_id = tokenizer.token_id(prompt.video_placeholder) if prompt.video_placeholder else None
        # run token id -> the modality its rows belong to (an image's placeholder, a video chunk's)
        self._kinds = {self.placeholder_id: "image", **({self.video_id: "video"} if self.video_id is not None else {})}
        self._around: dict[str, tuple[list[int], list[int]]] = {}

    @property
    def reserved(self) -> tuple[str, ...]:
        """Tokens only the template may write: in a client's text they would claim media rows."""
        return tuple(t for t in (self.prompt.placeholder, self.prompt.video_placeholder) if t)

    def media_order(self, token_ids: list[int]) -> list[str]:
        """The modality of each media item a one-placeholder-per-item prompt holds, in order."""
        return [self._kinds[t] for t in token_ids if t in self._kinds]

    def expand_text(self, text: str, media: Sequence[MediaItem]) -> Spliced:
        """The rendered template (one placeholder per item) -> token ids with every item's rows."""
        videos = [m for m in media if m[0] == "video"]
        if videos:
            parts = text.split(self._video_token(len(videos)))
            if len(parts) != len(videos) + 1:
                raise ModelDirError(f"the chat template wrote {len(parts) - 1} video placeholders for "
                                    f"{len(videos)} videos")
            chunks = [self._chunk_prompts(counts, stamps) for _, counts, stamps in videos]
            text = parts[0] + "".join(c + p for c, p in zip(chunks, parts[1:], strict=True))
        return self._expand(self.tok.encode(text), media, ModelDirError)

    def expand_ids(self, token_ids: list[int], media: Sequence[MediaItem]) -> Spliced:
        """The same from token ids with one placeholder per item (each chunk prompt tokenized alone)."""
        out: list[int] = []
        videos = iter([m for m in media if m[0] == "video"])
        for tid in token_ids:
            if tid != self.video_id or self.video_id is None:
                out.append(tid)
                continue
            video = next(videos, None)
            if video is None:
                raise BadRequest("the prompt has more video placeholders than the request has videos")
            _, counts, stamps = video
            for c in range(len(counts)):
                pre, post = self._pre_post(self.prompt.video.format(timestamp=_stamp(stamps, c)))
                out += [*pre, tid, *post]
        return self._expand(out, media, BadRequest)

    def _video_token(self, n: int) -> str:
        if self.prompt.video_placeholder is None:
            raise BadRequest(f"this model takes no video in a chat prompt ({n} given)", "unsupported_modality")
        return self.prompt.video_placeholder

    def _chunk_prompts(self, counts: list[int], stamps: Sequence[str] | None) -> str:
        return "".join(self.prompt.video.format(timestamp=_stamp(stamps, c)) for c in range(len(counts)))

    def _expand(self, ids: list[int], media: Sequence[MediaItem], error: type[MMEncoderError]) -> Spliced:
        """Each run token (one per image, one per video chunk) -> its rows; the runs must be the items'."""
        runs = [(m, n) for m, counts, _ in media for n in counts]

        def mismatch() -> MMEncoderError:
            return error(f"the prompt's media placeholders ({self._describe(ids)}) do not match its media items "
                         f"({', '.join(m for m, _, _ in media) or 'none'})")

        out: list[int] = []
        offsets: list[int] = []
        for tid in ids:
            kind = self._kinds.get(tid)
            if kind is None:
                out.append(tid)
                continue
            i = len(offsets)
            if i >= len(runs) or runs[i][0] != kind:
                raise mismatch()
            offsets.append(len(out))
            out.extend([tid] * runs[i][1])
        if len(offsets) != len(runs):
            raise mismatch()
        spans, k = [], 0
        for _, counts, _ in media:
            spans.append([(offsets[k + j], n) for j, n in enumerate(counts)])
            k += len(counts)
        return Spliced(out, spans)
    def _describe(self, ids: list[int]) -> str:
        order = [self._kinds[t].replace("video", "video chunk") for t in ids if t in self._kinds]
        return ", ".join(order) or "none"

    def _pre_post(self, text: str) -> tuple[list[int], list[int]]:
        if text not in self._around:
            pre, _, post = text.partition(self.prompt.video_placeholder or self.prompt.placeholder)
            self._around[text] = (self.tok.encode(pre), self.tok.encode(post))
        return self._around[text]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet -> byte: printable bytes stand for themselves, the others (controls,
    space, a few Latin-1 ones) for the code points from 256 on, in byte order (GPT-2's scheme)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _stamp(stamps: Sequence[str] | None, i: int) -> str:
    return stamps[i] if stamps and i < len(stamps) else ""


def check_model_dir(path: Path | None, flag: str = "--model-dir") -> Path | None:
    """A checkpoint directory as the frontend and engines read it: refused early, by what is missing."""
    if path is None:
        return None
    if not path.is_dir():
        raise ValueError(f"{flag} {path} is not a directory (a model checkpoint directory; `mm-encoder "
                         "make-checkpoint DIR` writes a small random Kimi-K2.5 one)")
    missing = [f for f in ("config.json", "tokenizer_config.json") if not (path / f).is_file()]
    if missing:
        raise ValueError(f"{flag} {path} has no {' or '.join(missing)}: not a model checkpoint directory")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except FileNotFoundError:
        return {}
