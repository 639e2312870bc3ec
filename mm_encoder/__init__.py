"""mm-encoder: pixels -> LLM-space embeddings (MoonViT + projectors), as a library and a service."""

from .encoder import EncodedMedia, Encoder
from .errors import CheckpointError, MediaError, MMEncoderError, UnknownModelError
from .media import VideoChunk
from .registry import get_spec, list_models
from .spec import MediaLimits, ModelSpec, PreprocessConfig

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "EncodedMedia",
    "Encoder",
    "MMEncoderError",
    "MediaError",
    "MediaLimits",
    "ModelSpec",
    "PreprocessConfig",
    "UnknownModelError",
    "VideoChunk",
    "__version__",
    "get_spec",
    "list_models",
]
