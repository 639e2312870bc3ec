"""The engine process: a checkpoint's own language model behind Dynamo, through transformers.

    python -m mm_encoder.engines --checkpoint DIR [--dtype fp32|bf16] [--device cpu|cuda]
    python -m mm_encoder.engines --checkpoint DIR --encode-inline     # the aggregated baseline

It registers `<namespace>.engine.generate` as a chat model (the checkpoint directory is its model
card: config, tokenizer, chat template) and takes either frontend's request: ours
(`core.engine_request.EngineRequest`, media by handle, which declares its protocol) or Dynamo's
preprocessed request from the stock `python -m dynamo.frontend` (`--frontend stock` registers
the card that makes the stock frontend call the Encode worker first). It loads only the
language-model shards; with `--encode-inline` it loads the whole model and runs the model's own
vision tower (`engines.inline.InlineEngine`, chosen here at start-up). KV events for what its
prefix store holds go to Dynamo's router (`engines.engine`). Its life (signals, runtime, ready
line, shutdown) is `runtime.process.Lifecycle`, as every process's.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ..client import HandleResolver
from ..core.prompt import ChatTokenizer, Splicer, check_model_dir
from ..core.registry import get_spec
from ..families.model_card import ModelCard
from ..runtime.dynamo import (
    ENGINE_COMPONENT,
    GENERATE_ENDPOINT,
    endpoint_path,
    kv_event_publisher,
    load_publisher,
    register_engine,
    serve_endpoint,
)
from ..runtime.process import Lifecycle, parse_settings, run
from .options import EngineOptions

if TYPE_CHECKING:
    from ..runtime.dynamo import Client, KvEventPublisher
    from .engine import Engine

log = logging.getLogger(__name__)
NAME = "mm-encoder engine"  # its ready line contains graph.plan.READY_LINE


class EngineSettings(EngineOptions):
    """Every option from the command line or `MM_ENGINE_<OPTION>`."""

    model_config = SettingsConfigDict(env_prefix="MM_ENGINE_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m mm_encoder.engines", extra="ignore",
                                      frozen=True)

    checkpoint: Path = Field(description="the model's checkpoint directory (config.json, safetensors shards, "
                                         "tokenizer, chat template)")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="the language model's dtype")
    device: str | None = Field(None, description="cpu or cuda[:N] (default: cuda when available)")
    prefix_cache_tokens: int = Field(1 << 16, ge=0, description="prompt KV kept for reuse, in tokens (0: none)")
    encode_inline: bool = Field(False, description="the aggregated baseline: load the whole model and encode "
                                                   "media here with its own vision tower (no encode worker)")
    frontend: Literal["mm", "stock"] = Field(
        "mm", description="mm: serve this project's frontend (EngineRequest); stock: Dynamo's own frontend "
                          "(preprocessed requests, media via its Encode worker)")


class _EngineParts(TypedDict):
    """`Engine`'s keyword arguments, as `build_engine` gives either engine."""

    splicer: Splicer
    block_size: int
    publisher: KvEventPublisher | None
    resolver: HandleResolver
    prefix_tokens: int
    stream_interval_s: float


def build_engine(s: EngineSettings, publisher: KvEventPublisher | None = None, rpc: Client | None = None) -> Engine:
    """The engine for `s` (loads the model): importable, so tests run it in-process."""
    import torch

    from ..model.loading import parse_dtype
    from .engine import Engine
    from .inline import InlineEngine, InlineMedia
    from .llm import LanguageModel

    dtype = parse_dtype(s.dtype)
    device = s.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = LanguageModel.load(s.checkpoint, device=device, dtype=dtype, monolithic=s.encode_inline)
    # the registry model that says how this checkpoint's prompts place media, as the frontend reads it
    splicer = Splicer(ChatTokenizer(s.checkpoint), get_spec(ModelCard.read(s.checkpoint).spec_name).prompt)
    kw = _EngineParts(splicer=splicer, block_size=s.block_size, publisher=publisher,
                      resolver=HandleResolver(s.encoder_chain, rpc, tls=s.client_tls()),
                      prefix_tokens=s.prefix_cache_tokens,
                      stream_interval_s=s.stream_interval_ms / 1e3)
    if s.encode_inline:  # the aggregated baseline: a strategy chosen here, not a branch per request
        return InlineEngine(lm, InlineMedia(s.checkpoint, lm), **kw)
    return Engine(lm, **kw)


async def serve(s: EngineSettings) -> None:
    async with Lifecycle(NAME) as life:
        path = endpoint_path(s.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT)
        endpoint = life.runtime.endpoint(path)
        rpc = None if s.encode_inline else await life.runtime.endpoint(endpoint_path(s.namespace)).client()
        engine = await asyncio.to_thread(build_engine, s, None, rpc)
        engine.publisher = kv_event_publisher(endpoint, s.block_size)
        engine.metrics = await load_publisher(endpoint)
        if (tls := engine.resolver.tls) is not None:  # rotation: its client certificate read again
            life.on_reload(lambda: s.reload(tls), files=(s.tls_cert, s.tls_key))
        name = s.name or s.checkpoint.resolve().name
        life.serve(serve_endpoint(endpoint, engine.respond))
        # stock: Dynamo's frontend calls the Encode worker first and forwards its result here
        await register_engine(endpoint, str(s.checkpoint), name, s.block_size, after_encode=s.frontend == "stock")
        lm = engine.lm
        life.ready(model=name, family=lm.family.name, dtype=s.dtype, device=lm.device, endpoint=path,
                   instance=endpoint.connection_id(), inline=s.encode_inline,
                   stream_interval_ms=f"{s.stream_interval_ms:g}")
        await life.wait()


def main(argv: list[str] | None = None) -> int:
    s = parse_settings(EngineSettings, argv, check=lambda s: check_model_dir(s.checkpoint, "--checkpoint"))
    if s is None:
        return 2
    return run(serve(s), s.log_level)

