"""What a checkpoint directory says about serving it, read without torch: which model family and
registry model it is (the registry model places its media in prompts), its context length, the
tokens that end a turn, and its revision (a content id of its config and tensor index,
`core.revision.checkpoint_revision`: the encode worker computes the same one, and the encode requests
and cache keys carry it, so a cache never answers for another checkpoint).

The frontend reads this from the same directory the engines load their weights from (one
checkpoint, one truth): `config.json` (`model_type`, the text model's `max_position_embeddings`)
and `generation_config.json` (`eos_token_id`, what transformers' `generate` stops on).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ModelDirError
from ..core.revision import checkpoint_revision, json_object
from . import spec_names


@dataclass(frozen=True)
class ModelCard:
    path: Path
    model_type: str
    spec_name: str  # the registry model: preprocessing and media prompts
    context_length: int
    eos_token_ids: list[int]
    revision: str  # `checkpoint_revision`: what the encode worker serving this checkpoint calls its revision

    @classmethod
    def read(cls, path: str | Path) -> ModelCard:
        path = Path(path)
        config = _json(path / "config.json", required=True)
        model_type = config.get("model_type")
        served = spec_names()
        if model_type not in served:
            raise ModelDirError(f"{path}/config.json: model_type {model_type!r} is not one this project serves "
                                f"({', '.join(sorted(served))})")
        text = config.get("text_config") or {}
        context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
        if not isinstance(context, int) or context < 1:
            raise ModelDirError(f"{path}/config.json: no max_position_embeddings (the context length)")
        eos = _json(path / "generation_config.json").get("eos_token_id", text.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        return cls(path, model_type, served[model_type], context, [int(t) for t in eos_ids],
                   checkpoint_revision(path))


def _json(path: Path, required: bool = False) -> dict[str, Any]:
    try:
        return json_object(path, ModelDirError)
    except FileNotFoundError:
        if required:
            raise ModelDirError(f"{path} is missing (not a model checkpoint directory)") from None
        return {}
