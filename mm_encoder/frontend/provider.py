"""The multimodal processor as Dynamo's frontend loads it: one chat engine factory, two ways in.

- `python -m mm_encoder.frontend` (Dynamo 1.6.1, whose `--dyn-chat-processor` takes only
  dynamo, vllm or sglang): our launcher builds the factory and hands it to Dynamo's
  `make_engine` as `chat_engine_factory`.
- Dynamo after 1.6.1: `python -m dynamo.frontend --dyn-chat-processor mm-encoder
  --dyn-chat-processor-config '{"model_dir": "/models/llm", ...}'` resolves the entry point
  `dynamo.frontend.chat_processors: mm-encoder` to `chat_processor`, which Dynamo calls once, in its
  event loop, with its parsed frontend config and that JSON object. The JSON holds this
  processor's own options (`FrontendSettings` names); the namespace and block size default to
  Dynamo's config.

Dynamo calls the factory per served model when its first worker registers; the shared parts
(tokenizer, encoder client, KV router, engine client) are built on the first call, on a Dynamo
runtime from the process's environment (the launcher passes its own).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..client.encoder import EncoderClient
from ..core.prompt import ChatTokenizer
from ..core.registry import get_spec
from ..core.spec import ModelSpec
from ..families.model_card import ModelCard
from ..runtime.dynamo import GENERATE_ENDPOINT, chat_engine, endpoint_path, kv_router, make_runtime
from ..security.tenants import Tenants, check_forwarded
from .processor import EngineClient, Limits, MultimodalProcessor, Router
from .settings import FrontendSettings

if TYPE_CHECKING:
    from ..runtime.dynamo import (
        DistributedRuntime,
        ModelCardInstanceId,
        ModelDeploymentCard,
        PythonAsyncEngine,
        RoutedEngine,
    )


@dataclass(frozen=True)
class SharedParts:
    """What every served model's processor shares: built once per frontend process."""

    card: ModelCard
    spec: ModelSpec
    tokenizer: ChatTokenizer
    engine_client: EngineClient  # Dynamo's client of the engines' generate endpoint
    router: Router  # Dynamo's KvRouter over the same endpoint
    limits: Limits
    tenants: Tenants  # the scope of each request's cache entries


class ProcessorFactory:
    """`factory(instance_id, card, routed_engine)` -> a PythonAsyncEngine over one processor per model."""

    def __init__(self, settings: FrontendSettings, runtime: DistributedRuntime | None = None) -> None:
        self.s = settings
        self.runtime = runtime  # None: the process's own (Dynamo's frontend made it)
        self.processors: dict[str, MultimodalProcessor] = {}
        self.encoder: EncoderClient | None = None
        self.tls = settings.client_tls()  # its calls to https:// chains (`reload_tls` on SIGHUP)
        self._parts: SharedParts | None = None
        self._lock = asyncio.Lock()

    async def parts(self) -> SharedParts:
        """What every model's processor shares; built once."""
        async with self._lock:
            if self._parts is None:
                self._parts = await self._build()
        return self._parts

    async def _build(self) -> SharedParts:
        s = self.s
        # Dynamo hands a provider no runtime: one from the same environment (DYN_DISCOVERY_BACKEND, ...)
        runtime = self.runtime = self.runtime or make_runtime(asyncio.get_running_loop())
        card = ModelCard.read(s.model_dir)
        engine_path = endpoint_path(s.namespace, s.engine_component, GENERATE_ENDPOINT)
        use_rpc = s.encoder_rpc and not s.inline_media
        rpc = await runtime.endpoint(endpoint_path(s.namespace)).client() if use_rpc else None
        spec = get_spec(card.spec_name)
        if not s.inline_media:
            self.encoder = EncoderClient(spec.name, http_url=s.encoder_http, route=s.encoder_route, rpc_client=rpc,
                                         timeout_s=s.encoder_timeout_s, namespace=s.namespace if use_rpc else None,
                                         send_bodies=s.media_transport == "body", revision=card.revision,
                                         dtype=s.wire_dtype, tls=self.tls)
        return SharedParts(
            card=card, spec=spec, tokenizer=ChatTokenizer(s.model_dir, s.allow_remote_code),
            engine_client=await runtime.endpoint(engine_path).client(),
            router=kv_router(runtime.endpoint(engine_path), s.block_size, assume_kv_reuse=s.router_assume_kv_reuse),
            tenants=Tenants.from_files(s.tenant_header, s.tenant_key),
            limits=Limits(context_length=card.context_length, default_max_tokens=s.default_max_tokens,
                          max_media=s.max_media, max_inflight_media=s.max_inflight_media,
                          max_inflight_requests=s.max_inflight_requests))

    async def processor(self, name: str | None = None) -> MultimodalProcessor:
        p = await self.parts()
        name = str(name or self.s.model_dir.resolve().name)
        if name not in self.processors:
            self.processors[name] = MultimodalProcessor(
                served_name=name, spec=p.spec, tokenizer=p.tokenizer, encoder=self.encoder,
                router=p.router, engine_client=p.engine_client, block_size=self.s.block_size,
                eos_token_ids=p.card.eos_token_ids, limits=p.limits, inline_media=self.s.inline_media,
                trust_client_trace=self.s.trust_client_trace, tenants=p.tenants)
        return self.processors[name]

    async def __call__(self, instance_id: ModelCardInstanceId, card: ModelDeploymentCard,
                       routed_engine: RoutedEngine) -> PythonAsyncEngine:
        proc = await self.processor(getattr(instance_id, "name", None))
        return chat_engine(proc.generate, asyncio.get_running_loop())

    def reload_tls(self) -> None:
        """Rotation: this frontend's client certificate read again (new connections present it)."""
        if self.tls is not None:
            self.s.reload(self.tls)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (503 draining) and wait, up to `timeout_s`, for those in flight."""
        for p in self.processors.values():
            p.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(p.inflight for p in self.processors.values()):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)  # polling the processors' counters; they have no event to wait on
        return True

    def last_request(self) -> float:
        """time.monotonic() of the latest request any processor saw (0 if none)."""
        return max((p.last_request for p in self.processors.values()), default=0.0)

    def snapshots(self) -> list[dict[str, Any]]:
        return [p.snapshot() for p in self.processors.values()]

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.close()


# What only our launcher acts on: the HTTP server, the runtime it starts and the shutdown drain.
_LAUNCHER_ONLY = ("runtime_threads", "http_host", "http_port", "drain_timeout_s")


def chat_processor(frontend_config: object, processor_config: dict[str, Any] | None = None) -> ProcessorFactory:
    """The `dynamo.frontend.chat_processors` provider: Dynamo's frontend config (its namespace and
    KV block size are the defaults) plus this processor's options as JSON (`model_dir` required,
    else Dynamo's `--model-path`)."""
    options = dict(processor_config or {})
    for name in _LAUNCHER_ONLY:
        if name in options:  # Dynamo's own frontend made its runtime and HTTP server before calling us
            raise ValueError(f"{name!r} is an option of `python -m mm_encoder.frontend` only; under Dynamo's "
                             "frontend set its own equivalent (DYN_RUNTIME_NUM_WORKER_THREADS, --http-port, ...)")
    namespace = getattr(frontend_config, "namespace", None)
    block_size = getattr(frontend_config, "kv_cache_block_size", None)
    model_path = getattr(frontend_config, "model_path", None)
    defaults = {k: v for k, v in (("namespace", namespace), ("block_size", block_size), ("model_dir", model_path))
                if v is not None}
    settings = FrontendSettings(_cli_parse_args=[], **{**defaults, **options})
    check_forwarded(settings.tenant_header)
    return ProcessorFactory(settings)
