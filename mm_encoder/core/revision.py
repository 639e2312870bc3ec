"""A checkpoint directory's revision, read without torch: a content id of its config and tensor
index (and the readers of those files it is made of). The encode worker computes it for the
checkpoint it serves, the frontend reads the same one (`families.model_card.ModelCard`, what the
directory says about serving it), and the encode requests and cache keys carry it, so a cache never
answers for another checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import MMEncoderError
from .spec import file_revision

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


def json_object(path: Path, error: type[MMEncoderError]) -> dict[str, Any]:
    """One of a checkpoint's JSON files (config.json, generation_config.json,
    preprocessor_config.json), which must hold an object; `error` names what is wrong with it.
    A missing file is the caller's to handle (FileNotFoundError)."""
    try:
        doc = json.loads(path.read_bytes())
    except ValueError as e:
        raise error(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: expected a JSON object")
    return doc


def index_bytes(ckpt: Path) -> bytes:
    """The tensor index: `model.safetensors.index.json`, or a single file's safetensors header
    (names, dtypes, shapes, offsets); b"" without either."""
    if (ckpt / INDEX_FILE).is_file():
        return (ckpt / INDEX_FILE).read_bytes()
    single = ckpt / SINGLE_FILE
    if single.is_file():
        with single.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return f.read(min(n, 100_000_000))
    return b""


def checkpoint_revision(ckpt: Path) -> str:
    """A checkpoint's content id: its config.json and tensor index (not the weights: hashing 500 GB
    at start-up is not an option; a checkpoint whose weights change keeps its names and shapes)."""
    config = ckpt / "config.json"
    if not config.is_file():
        return file_revision(index_bytes(ckpt))
    return file_revision(config.read_bytes(), index_bytes(ckpt))
