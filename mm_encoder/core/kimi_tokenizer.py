"""Kimi's released tokenizer (a tiktoken vocabulary) as a `tokenizers.Tokenizer`, without its remote code.

A Kimi checkpoint ships `tiktoken.model` (one `base64(token bytes) rank` line per token) and its
tokenizer as Hub remote code (`tokenization_kimi.py`, `TikTokenTokenizer`), which this project
does not run. What that code fixes is data, stated here: the pre-tokenizer's split pattern (Han
runs, cased words, 1-3 digit numbers, punctuation, newlines, spaces), and 256 special-token ids
after the ranks, named by `tokenizer_config.json`'s `added_tokens_decoder` (the unnamed ones
`<|reserved_token_N|>`). transformers' `TikTokenConverter` turns ranks into BPE merges; the file is
read here, so the `tiktoken` package is not needed.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ModelDirError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TIKTOKEN_FILE = "tiktoken.model"
KIMI_CLASSES = ("TikTokenTokenizer", "tokenization_kimi.TikTokenTokenizer")
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_SPECIAL = 256


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ModelDirError(f"{path}:{n}: not a `base64 rank` line") from None
    return ranks


def is_kimi(tok_config: dict[str, Any]) -> bool:
    named = tok_config.get("tokenizer_class")
    auto = (tok_config.get("auto_map") or {}).get("AutoTokenizer")
    auto = auto[0] if isinstance(auto, list) and auto else auto
    return named in KIMI_CLASSES or (isinstance(auto, str) and auto.endswith("TikTokenTokenizer"))


def kimi_tokenizer(model_dir: Path, tok_config: dict[str, Any]) -> Tokenizer:
    """`tiktoken.model` + the special tokens of `tokenizer_config.json` -> a `tokenizers.Tokenizer`
    that splits and ids text as Kimi's own tokenizer does."""
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise ModelDirError(f"{model_dir} ships a tiktoken vocabulary: reading it needs transformers "
                            "(pip install transformers), or add a tokenizer.json") from None
    if not is_kimi(tok_config):
        raise ModelDirError(f"{model_dir}/{TIKTOKEN_FILE}: a tiktoken vocabulary of tokenizer class "
                            f"{tok_config.get('tokenizer_class')!r}, whose split pattern is unknown here (Kimi's is "
                            "known); add a tokenizer.json")
    ranks = read_ranks(model_dir / TIKTOKEN_FILE)

    class _FromFile(TikTokenConverter):  # type: ignore[misc]  # transformers is not analysed (pyproject)
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    named = {int(k): v["content"] if isinstance(v, dict) else str(v)
             for k, v in (tok_config.get("added_tokens_decoder") or {}).items()}
    base = len(ranks)
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + NUM_SPECIAL)]
    tok: Tokenizer = _FromFile(str(model_dir / TIKTOKEN_FILE), pattern=KIMI_PATTERN,
                               extra_special_tokens=specials).converted()
    tok.post_processor = None  # ids as they are: no special tokens added around them
    wrong = [t for i, t in enumerate(specials, base) if tok.token_to_id(t) != i]
    if wrong or set(named) - set(range(base, base + NUM_SPECIAL)):
        raise ModelDirError(f"{model_dir}: tokenizer_config.json's special tokens do not follow the {base} ranks of "
                            f"{TIKTOKEN_FILE} (Kimi's layout: ids {base}..{base + NUM_SPECIAL - 1})")
    return tok
