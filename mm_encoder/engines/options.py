"""The options both engine processes take, the transformers engine (`engines.process`) and the
vLLM adapter (`engines.vllm`), on top of every Dynamo process's (`runtime.dynamo.KvOptions`)."""

from __future__ import annotations

from pydantic import Field

from ..runtime.dynamo import KvOptions
from .stream import STREAM_INTERVAL_MS


class EngineOptions(KvOptions):
    name: str | None = Field(None, description="served model name (default: the checkpoint directory's name)")
    encoder_chain: tuple[str, ...] = Field((), description="cache chain URLs media handles may be fetched from "
                                           "(none: Dynamo RPC to the encode workers only)")
    stream_interval_ms: float = Field(
        STREAM_INTERVAL_MS, ge=0,
        description="our frontend's requests: tokens generated within this many ms of the last item go out in one "
                    "item (0: one item per token); the first two are never held; a non-streamed request's wait "
                    "for the finish after the first")
