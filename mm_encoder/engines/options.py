"""The options both engine processes take, the transformers engine (`engines.process`) and the
vLLM adapter (`engines.vllm`), on top of every Dynamo process's (`runtime.dynamo.KvOptions`), and
this component's TLS files (`security.tls.TlsOptions`)."""

from __future__ import annotations

from pydantic import Field

from ..runtime.dynamo import KvOptions
from ..security.tls import TlsOptions
from .stream import STREAM_INTERVAL_MS


class EngineOptions(KvOptions, TlsOptions):
    """With --tls-cert/--tls-key/--tls-ca (security/tls.py), handle fetches from https:// chains
    present this engine's certificate and check the chain's against the deployment's CA."""

    name: str | None = Field(None, description="served model name (default: the checkpoint directory's name)")
    encoder_chain: tuple[str, ...] = Field((), description="cache chain URLs media handles may be fetched from "
                                           "(none: Dynamo RPC to the encode workers only)")
    stream_interval_ms: float = Field(
        STREAM_INTERVAL_MS, ge=0,
        description="our frontend's requests: tokens generated within this many ms of the last item go out in one "
                    "item (0: one item per token); the first two are never held; a non-streamed request's wait "
                    "for the finish after the first")
