"""mm-encoder: pixels -> LLM-space embeddings (MoonViT + projectors), as a library and a service.

Exports resolve lazily (PEP 562): `mm-encoder cache up` and other torch-free entry points start
without importing torch (~2 s here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "EncodedMedia": ".encoder",
    "Encoder": ".encoder",
    "CheckpointError": ".errors",
    "MediaError": ".errors",
    "MMEncoderError": ".errors",
    "UnknownModelError": ".errors",
    "VideoChunk": ".media",
    "get_spec": ".registry",
    "list_models": ".registry",
    "MediaLimits": ".spec",
    "ModelSpec": ".spec",
    "PreprocessConfig": ".spec",
}

__all__ = [  # noqa: RUF022 (kept in the order of _EXPORTS)
    "EncodedMedia", "Encoder", "CheckpointError", "MediaError", "MMEncoderError", "UnknownModelError",
    "VideoChunk", "get_spec", "list_models", "MediaLimits", "ModelSpec", "PreprocessConfig", "__version__",
]

if TYPE_CHECKING:
    from .encoder import EncodedMedia, Encoder
    from .errors import CheckpointError, MediaError, MMEncoderError, UnknownModelError
    from .media import VideoChunk
    from .registry import get_spec, list_models
    from .spec import MediaLimits, ModelSpec, PreprocessConfig


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mm_encoder' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
