"""`python -m mm_encoder.frontend`: Dynamo's HTTP frontend with the multimodal chat processor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys

from ..core.dynamo import GENERATE_ENDPOINT, endpoint_path, make_runtime
from ..core.process import parse_settings, run, stop_on_signals
from ..core.prompt import ChatTokenizer
from ..core.registry import DEFAULT_MODEL, get_spec
from .encoder_client import EncoderClient
from .metrics import exposition
from .processor import Limits, MultimodalProcessor
from .settings import FrontendSettings

log = logging.getLogger("mm_encoder.frontend")


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

    loop = asyncio.get_running_loop()
    runtime = make_runtime(loop)
    config = json.loads((s.model_dir / "config.json").read_text())
    spec = get_spec(config.get("mm_encoder_model", DEFAULT_MODEL))
    tokenizer = ChatTokenizer(s.model_dir, s.allow_remote_code)
    engine_path = endpoint_path(s.namespace, s.engine_component, GENERATE_ENDPOINT)
    use_rpc = s.encoder_rpc and not s.inline_media
    rpc_client = await runtime.endpoint(endpoint_path(s.namespace)).client() if use_rpc else None
    encoder = EncoderClient(spec.name, http_url=s.encoder_http, route=s.encoder_route, rpc_client=rpc_client,
                            timeout_s=s.encoder_timeout_s, namespace=s.namespace if use_rpc else None,
                            send_bodies=s.media_transport == "body") if not s.inline_media else None
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
                served_name=name, spec=spec, tokenizer=tokenizer, encoder=encoder, router=router,
                engine_client=engine_client, block_size=s.block_size,
                eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [], limits=limits,
                inline_media=s.inline_media)
            processors[name] = proc
        return PythonAsyncEngine(proc.generate, loop)

    def stats(_ctx):
        return {"processors": [p.snapshot() for p in processors.values()]}

    # appended to Dynamo's system server /metrics (DYN_SYSTEM_PORT); no endpoint needs serving for it
    runtime.endpoint(f"{s.namespace}.frontend.mm_processor").metrics.register_prometheus_expfmt_callback(
        exposition(lambda: [p.snapshot() for p in processors.values()]))

    args = EntrypointArgs(EngineType.Dynamic, http_host=s.http_host, http_port=s.http_port, namespace=s.namespace,
                          chat_engine_factory=factory, migration_limit=0)
    engine = await make_engine(runtime, args)
    stop = stop_on_signals()
    serving = asyncio.ensure_future(run_input(runtime, "http", engine, [FrontendRoute("GET", "/mm/stats", stats)]))
    print(f"mm-encoder frontend ready: http://{s.http_host}:{s.http_port} model_dir={s.model_dir}", flush=True)
    await asyncio.wait({serving, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    runtime.shutdown()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 30)
    if encoder is not None:
        await encoder.close()


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(FrontendSettings, argv)
    return 2 if settings is None else run(serve(settings), settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
