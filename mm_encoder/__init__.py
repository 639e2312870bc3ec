"""mm-encoder: pixels -> LLM-space embeddings (MoonViT + projectors), as a library and a service.

The public facade: `from mm_encoder import Encoder, wire, ...`. Exports resolve lazily (PEP 562),
so torch-free entry points (the frontend, `mm-encoder cache up`, `serve`) never import torch.
The package's rooms: README's "Layout", docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

_EXPORTS = {
    "EncodedMedia": ".model.encoder",
    "Encoder": ".model.encoder",
    "CheckpointError": ".core.errors",
    "MediaError": ".core.errors",
    "MMEncoderError": ".core.errors",
    "UnknownModelError": ".core.errors",
    "VideoChunk": ".model.media",
    "get_spec": ".core.registry",
    "list_models": ".core.registry",
    "MediaLimits": ".core.spec",
    "ModelSpec": ".core.spec",
    "PreprocessConfig": ".core.spec",
}
_MODULES = {"wire": ".core.wire"}  # modules of the facade: mm_encoder.wire.decode(body)

__all__ = [  # noqa: RUF022 (kept in the order of _EXPORTS)
    "EncodedMedia", "Encoder", "CheckpointError", "MediaError", "MMEncoderError", "UnknownModelError",
    "VideoChunk", "get_spec", "list_models", "MediaLimits", "ModelSpec", "PreprocessConfig", "wire",
    "__version__",
]

if TYPE_CHECKING:
    from .core import wire
    from .core.errors import CheckpointError, MediaError, MMEncoderError, UnknownModelError
    from .core.registry import get_spec, list_models
    from .core.spec import MediaLimits, ModelSpec, PreprocessConfig
    from .model.encoder import EncodedMedia, Encoder
    from .model.media import VideoChunk


def __getattr__(name: str) -> object:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name], __name__)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:
        raise AttributeError(f"module 'mm_encoder' has no attribute {name!r}")
    globals()[name] = value
    return value
