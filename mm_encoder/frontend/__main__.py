"""`python -m mm_encoder.frontend`: Dynamo's HTTP frontend with the multimodal chat processor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("mm_encoder.frontend")


class FrontendSettings(BaseSettings):
    """Every option from the command line or `MM_FRONTEND_<OPTION>`."""

    model_config = SettingsConfigDict(env_prefix="MM_FRONTEND_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m mm_encoder.frontend", extra="ignore", frozen=True)

    model_dir: Path = Field(description="the served LLM's directory: config.json, tokenizer, chat template")
    http_host: str = Field("127.0.0.1")
    http_port: int = Field(8000, ge=1, le=65535)
    namespace: str = Field("mm", description="Dynamo namespace of the engines and encode workers")
    engine_component: str = Field("engine", description="engines serve <namespace>.<component>.generate")
    block_size: int = Field(16, ge=1, description="KV block size the engines use (routing hashes per block)")
    encoder_http: str | None = Field(None, description="cache chain URL (the cluster tier); unset: RPC only")
    encoder_route: str = Field("cluster,shared", description="X-Cache-Route for the chain")
    encoder_rpc: bool = Field(True, description="Dynamo RPC to <namespace>.mm_encoder.encode (direct, and fallback)")
    encoder_timeout_s: float = Field(600.0, gt=0)
    max_media: int = Field(16, ge=1, description="media items per request")
    max_inflight_media: int = Field(
        8, ge=1, description="requests holding embeddings at once (encode -> engine's first item); others wait"
    )
    default_max_tokens: int = Field(256, ge=1, description="completion budget when the request names none")
    allow_remote_code: bool = Field(False, description="let transformers run the model's tokenizer code")
    inline_media: bool = Field(False, description="aggregated baseline: engines fetch and encode media themselves")
    log_level: str = Field("INFO")


async def serve(s: FrontendSettings) -> None:
    from dynamo.llm import (
        EngineType,
        EntrypointArgs,
        FrontendRoute,
        KvRouter,
        KvRouterConfig,
        PythonAsyncEngine,
        make_engine,
        run_input,
    )

    from ..dynamo_rpc import endpoint_path, make_runtime
    from ..registry import get_spec
    from .chat import ChatTokenizer
    from .encoder_client import MultiModalCaller
    from .processor import Limits, MultimodalProcessor

    loop = asyncio.get_running_loop()
    runtime = make_runtime(loop)
    config = json.loads((s.model_dir / "config.json").read_text())
    spec = get_spec(config.get("mm_encoder_model", "tiny"))
    tokenizer = ChatTokenizer(s.model_dir, s.allow_remote_code)
    engine_path = f"{s.namespace}.{s.engine_component}.generate"
    use_rpc = s.encoder_rpc and not s.inline_media
    rpc_client = await runtime.endpoint(endpoint_path(s.namespace)).client() if use_rpc else None
    caller = MultiModalCaller(spec.name, http_url=s.encoder_http, route=s.encoder_route, rpc_client=rpc_client,
                              timeout_s=s.encoder_timeout_s) if not s.inline_media else None
    engine_client = await runtime.endpoint(engine_path).client()
    router = KvRouter(runtime.endpoint(engine_path), s.block_size, KvRouterConfig())
    eos = config.get("eos_token_id")
    limits = Limits(context_length=int(config.get("max_position_embeddings", 4096)),
                    default_max_tokens=s.default_max_tokens, max_media=s.max_media,
                    max_inflight_media=s.max_inflight_media)
    processors: dict[str, MultimodalProcessor] = {}

    async def factory(instance_id, card, routed_engine):
        name = str(getattr(instance_id, "name", None) or config.get("served_model_name") or s.model_dir.name)
        proc = processors.get(name)
        if proc is None:
            proc = MultimodalProcessor(
                served_name=name, spec=spec, tokenizer=tokenizer, caller=caller, router=router,
                engine_client=engine_client, block_size=s.block_size,
                eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [], limits=limits,
                inline_media=s.inline_media)
            processors[name] = proc
        return PythonAsyncEngine(proc.generate, loop)

    def stats(_ctx):
        return {"processors": [p.snapshot() for p in processors.values()]}

    from .metrics import exposition

    # appended to Dynamo's system server /metrics (DYN_SYSTEM_PORT); no endpoint needs serving for it
    runtime.endpoint(f"{s.namespace}.frontend.mm_processor").metrics.register_prometheus_expfmt_callback(
        exposition(lambda: [p.snapshot() for p in processors.values()]))

    args = EntrypointArgs(EngineType.Dynamic, http_host=s.http_host, http_port=s.http_port, namespace=s.namespace,
                          chat_engine_factory=factory, migration_limit=0)
    engine = await make_engine(runtime, args)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(run_input(runtime, "http", engine, [FrontendRoute("GET", "/mm/stats", stats)]))
    print(f"mm-encoder frontend ready: http://{s.http_host}:{s.http_port} model_dir={s.model_dir}", flush=True)
    await asyncio.wait({serving, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    runtime.shutdown()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 30)
    if caller is not None:
        await caller.close()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = FrontendSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
