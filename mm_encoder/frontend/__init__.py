"""OpenAI-compatible multimodal frontend inside Dynamo's HTTP frontend (imports no torch).

    python -m mm_encoder.frontend --http-port 8000 --model-dir DIR [--encoder-http URL] [--namespace mm]

Dynamo serves `/v1/chat/completions` and `/v1/models` (streaming, usage, metrics); for each
model an engine registers, `MultimodalProcessor` turns the OpenAI request into token ids + media
embeddings and routes it on (tokens, [mm_hash]). Extra route: `GET /mm/stats`.
"""

from ..client.encoder import EncoderClient
from .processor import Limits, MultimodalProcessor
from .settings import FrontendSettings

__all__ = ["EncoderClient", "FrontendSettings", "Limits", "MultimodalProcessor"]
