"""What a checkpoint directory says about serving it, read without torch: which registry model
places its media in prompts, its context length, the tokens that end a turn.

The frontend reads this from the same directory the engines load their weights from (one
checkpoint, one truth): `config.json` (`model_type`, the text model's `max_position_embeddings`)
and `generation_config.json` (`eos_token_id`, what transformers' `generate` stops on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelDirError
from .spec import HF_MODEL_TYPES


@dataclass(frozen=True)
class ModelCard:
    path: Path
    model_type: str
    spec_name: str  # the registry model: preprocessing and media prompts
    context_length: int
    eos_token_ids: list[int]

    @classmethod
    def read(cls, path: str | Path) -> ModelCard:
        path = Path(path)
        config = _json(path / "config.json", required=True)
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ModelDirError(f"{path}/config.json: model_type {model_type!r} is not one this project serves "
                                f"({', '.join(sorted(HF_MODEL_TYPES))})")
        text = config.get("text_config") or {}
        context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
        if not isinstance(context, int) or context < 1:
            raise ModelDirError(f"{path}/config.json: no max_position_embeddings (the context length)")
        eos = _json(path / "generation_config.json").get("eos_token_id", text.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        return cls(path, model_type, HF_MODEL_TYPES[model_type], context, [int(t) for t in eos_ids])


def _json(path: Path, required: bool = False) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ModelDirError(f"{path} is missing (not a model checkpoint directory)") from None
        return {}
    except ValueError as e:
        raise ModelDirError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ModelDirError(f"{path}: expected a JSON object")
    return doc
