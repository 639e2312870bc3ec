"""The engine process: a checkpoint's own language model behind Dynamo, through transformers.

    python -m mm_encoder.engines --checkpoint DIR [--dtype fp32|bf16] [--device cpu|cuda]
    python -m mm_encoder.engines --checkpoint DIR --encode-inline     # the aggregated baseline

It registers `<namespace>.engine.generate` as a chat model (the checkpoint directory is its model
card: config, tokenizer, chat template) and takes either frontend's request: ours
(`core.requests.EngineRequest`, media by handle) or Dynamo's preprocessed request from the stock
`python -m dynamo.frontend` (`--frontend stock` registers the card that makes the stock frontend
call the Encode worker first). It loads only the language-model shards; with `--encode-inline`
it loads the whole model and runs the model's own vision tower (`engines.inline`). KV events
for what its prefix store holds go to Dynamo's router (`engines.engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ..client import HandleResolver
from ..core.card import ModelCard
from ..core.prompt import ChatTokenizer, Splicer, check_model_dir
from ..core.registry import get_spec
from ..runtime.dynamo import (
    ENGINE_COMPONENT,
    GENERATE_ENDPOINT,
    endpoint_path,
    kv_event_publisher,
    load_publisher,
    make_runtime,
    register_engine,
    serve_endpoint,
)
from ..runtime.process import parse_settings, run, stop_on_signals
from .options import EngineOptions

log = logging.getLogger(__name__)
READY = "mm-encoder engine ready"


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


def build_engine(s: EngineSettings, publisher=None, rpc=None):
    """The engine for `s` (loads the model): importable, so tests run it in-process."""
    import torch

    from .engine import Engine
    from .inline import InlineMedia
    from .llm import LanguageModel

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[s.dtype]
    device = s.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = LanguageModel.load(s.checkpoint, device=device, dtype=dtype, monolithic=s.encode_inline)
    # the registry model that says how this checkpoint's prompts place media, as the frontend reads it
    splicer = Splicer(ChatTokenizer(s.checkpoint), get_spec(ModelCard.read(s.checkpoint).spec_name).prompt)
    inline = InlineMedia(s.checkpoint, lm) if s.encode_inline else None
    return Engine(lm, splicer=splicer, block_size=s.block_size, publisher=publisher, inline=inline,
                  resolver=HandleResolver(s.encoder_chain, rpc), prefix_tokens=s.prefix_cache_tokens,
                  stream_interval_s=s.stream_interval_ms / 1e3)


async def serve(s: EngineSettings) -> None:
    stop = stop_on_signals()
    runtime = make_runtime(asyncio.get_running_loop())
    path = endpoint_path(s.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT)
    endpoint = runtime.endpoint(path)
    rpc = None if s.encode_inline else await runtime.endpoint(endpoint_path(s.namespace)).client()
    engine = await asyncio.to_thread(build_engine, s, None, rpc)
    engine.publisher = kv_event_publisher(endpoint, s.block_size)
    engine.metrics = await load_publisher(endpoint)
    name = s.name or s.checkpoint.resolve().name
    serving = serve_endpoint(endpoint, engine.respond)
    # stock: Dynamo's frontend calls the Encode worker first and forwards its result here
    await register_engine(endpoint, str(s.checkpoint), name, s.block_size, after_encode=s.frontend == "stock")
    lm = engine.lm
    print(f"{READY}: model={name} family={lm.family.name} dtype={s.dtype} device={lm.device} "
          f"endpoint={path} instance={endpoint.connection_id()} inline={s.encode_inline} "
          f"stream_interval_ms={s.stream_interval_ms:g}", flush=True)
    await stop.wait()
    runtime.shutdown()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 30)


def main(argv: list[str] | None = None) -> int:
    s = parse_settings(EngineSettings, argv, check=lambda s: check_model_dir(s.checkpoint, "--checkpoint"))
    if s is None:
        return 2
    return run(serve(s), s.log_level)

