"""Dynamo, as every mm-encoder process uses it: its names and defaults, the runtime, serving and
registering endpoints, the KV router and publishers, the HTTP frontend, and how our errors become
its exceptions. The one module that imports Dynamo's runtime (besides `routing.block_hashes`, its
hash function); imported lazily, so nothing here needs the `dynamo` extra until it is called.

Discovery and planes come from Dynamo's own environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE,
DYN_EVENT_PLANE); where they are unset, the defaults here run one machine without etcd or NATS.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

from ..core.errors import MMEncoderError

if TYPE_CHECKING:  # `as`: re-exported, for the rooms that reach Dynamo only through this module
    from dynamo._internal import ModelDeploymentCard as ModelDeploymentCard
    from dynamo.llm import KvEventPublisher as KvEventPublisher
    from dynamo.llm import KvRouter
    from dynamo.llm import ModelCardInstanceId as ModelCardInstanceId
    from dynamo.llm import PythonAsyncEngine as PythonAsyncEngine
    from dynamo.llm import RoutedEngine as RoutedEngine
    from dynamo.llm import WorkerMetricsPublisher as WorkerMetricsPublisher
    from dynamo.runtime import Client as Client
    from dynamo.runtime import Context as Context
    from dynamo.runtime import DistributedRuntime as DistributedRuntime
    from dynamo.runtime import Endpoint

NAMESPACE = "mm"  # Dynamo namespace of every component, unless a graph or option says otherwise
BLOCK_SIZE = 16  # KV block size the engines use and the router hashes by
ENCODER_COMPONENT, ENCODE_ENDPOINT = "mm_encoder", "encode"
LOAD_ENDPOINT = "load"  # an encode worker's load signals, for the encode planner
ENGINE_COMPONENT, GENERATE_ENDPOINT = "engine", "generate"
HEALTH_PAYLOAD = {"health_check": True}
# One machine without etcd or NATS: file discovery, TCP requests, ZMQ events.
PLANES = {"DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq"}
# DYN_TCP_MAX_MESSAGE_SIZE where graphs set it: a 4K image's embeddings make a ~40 MB engine request.
MAX_MESSAGE_SIZE = 256 << 20
TOO_LARGE_HINT = "raise DYN_TCP_MAX_MESSAGE_SIZE (bytes) on both sides of the call"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class DynamoOptions(BaseSettings):
    """The options every process on Dynamo's runtime takes, under each process's own prefix
    (`MM_ENCODER_`, `MM_ENGINE_`, `MM_FRONTEND_`). Where discovery and the planes are, Dynamo's own
    environment says (`PLANES`)."""

    namespace: str = Field(NAMESPACE, min_length=1, description="Dynamo namespace of every component of a graph")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL (the encode worker "
                                               "logs cache hits at DEBUG)")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.upper() not in LOG_LEVELS:
            raise ValueError(f"log level {v!r} is not one of {', '.join(LOG_LEVELS)}")
        return v.upper()


class KvOptions(DynamoOptions):
    """The options of the processes that hash KV blocks: engines and the frontend's router."""

    block_size: int = Field(BLOCK_SIZE, ge=1, description="KV block size: the engines' prefix unit, which the "
                                                          "router hashes by (the same in every process)")


def endpoint_path(namespace: str, component: str = ENCODER_COMPONENT, endpoint: str = ENCODE_ENDPOINT) -> str:
    return f"{namespace}.{component}.{endpoint}"


def make_runtime(loop: asyncio.AbstractEventLoop) -> DistributedRuntime:
    """Dynamo's DistributedRuntime as the environment configures it (defaults: `PLANES`)."""
    from dynamo.runtime import DistributedRuntime  # optional dependency: the `dynamo` extra

    plane = {k: os.environ.get(k, v) for k, v in PLANES.items()}
    return DistributedRuntime(loop, plane["DYN_DISCOVERY_BACKEND"], plane["DYN_REQUEST_PLANE"],
                              event_plane=plane["DYN_EVENT_PLANE"])


def payload(item: Any) -> Any:
    """What a stream item from a Dynamo client carries (its `data()`; a plain value as it is)."""
    return item.data() if hasattr(item, "data") else item


def serve_endpoint(endpoint: Endpoint, handler: Callable[..., Any], *,
                   health_check: bool = False) -> asyncio.Future[Any]:
    """Serve `handler` on `endpoint` until the runtime shuts down; requests in flight then finish.
    With `health_check`, Dynamo's canary sends `HEALTH_PAYLOAD`."""
    kwargs: dict[str, Any] = {"graceful_shutdown": True}
    if health_check:
        kwargs["health_check_payload"] = HEALTH_PAYLOAD
    return asyncio.ensure_future(endpoint.serve_endpoint(handler, **kwargs))


async def register_engine(endpoint: Endpoint, model_dir: str, name: str, block_size: int, *,
                          after_encode: bool = False) -> None:
    """Register an engine as Dynamo's frontends find one: a chat model taking token ids, prefill and
    decode in one worker. `after_encode`: Dynamo's stock frontend calls its Encode worker first and
    forwards that worker's result in the request (`encode_worker.stock_encode`)."""
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    extra: dict[str, Any] = {}
    if after_encode:
        config = ModelRuntimeConfig()
        config.set_engine_specific("encoder_result_handoff", "true")
        extra = {"runtime_config": config, "needs": [[WorkerType.Encode]]}
    await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, model_dir, name,
                         worker_type=WorkerType.Aggregated, kv_cache_block_size=block_size, **extra)


async def register_encode_worker(endpoint: Endpoint, model_dir: str, name: str | None) -> None:
    """Register as Dynamo's own Encode worker for a model: its stock frontend calls it first."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    await register_model(ModelInput.Tokens, ModelType.Empty, endpoint, model_dir, name,
                         worker_type=WorkerType.Encode, needs=[[WorkerType.Aggregated]])


def kv_event_publisher(endpoint: Endpoint, block_size: int) -> KvEventPublisher:
    """What an engine's prefix store holds, told to the KV routers (stored and removed blocks)."""
    from dynamo.llm import KvEventPublisher

    return KvEventPublisher(endpoint, kv_block_size=block_size)


async def load_publisher(endpoint: Endpoint) -> WorkerMetricsPublisher:
    """An engine's load (active requests, KV blocks in use), as the KV router reads it."""
    from dynamo.llm import WorkerMetricsPublisher

    publisher = WorkerMetricsPublisher()
    await publisher.create_endpoint(endpoint)
    return publisher


def kv_router(endpoint: Endpoint, block_size: int, *, assume_kv_reuse: bool) -> KvRouter:
    """Dynamo's KV router over the engines serving `endpoint`."""
    from dynamo.llm import KvRouter, KvRouterConfig

    return KvRouter(endpoint, block_size, KvRouterConfig(router_assume_kv_reuse=assume_kv_reuse))


def chat_engine(generate: Callable[..., Any], loop: asyncio.AbstractEventLoop) -> PythonAsyncEngine:
    """A chat processor's `generate` as the engine Dynamo's HTTP frontend calls per request."""
    from dynamo.llm import PythonAsyncEngine

    return PythonAsyncEngine(generate, loop)


async def http_frontend(runtime: DistributedRuntime, factory: Callable[..., Any], *, host: str, port: int,
                        namespace: str, routes: dict[str, Callable[[Any], Any]],
                        https: tuple[str, str, str | None] | None = None) -> asyncio.Future[Any]:
    """Dynamo's OpenAI HTTP frontend on `host:port`, its chat engines made by `factory` per model
    discovered in `namespace`, plus our GET `routes`; serving until the runtime shuts down. With
    `https` (certificate, key, and the CA clients' certificates must chain to, or None): HTTPS."""
    # EngineType, make_engine, run_input: re-exported by dynamo.llm without `as`, so unseen by mypy
    from dynamo.llm import (  # type: ignore[attr-defined]
        EngineType,
        EntrypointArgs,
        FrontendRoute,
        make_engine,
        run_input,
    )

    cert, key, client_ca = https or (None, None, None)
    args = EntrypointArgs(EngineType.Dynamic, http_host=host, http_port=port, namespace=namespace,
                          chat_engine_factory=factory, migration_limit=0, tls_cert_path=cert, tls_key_path=key,
                          tls_client_ca_cert_path=client_ca)
    engine = await make_engine(runtime, args)
    extra = [FrontendRoute("GET", path, handler) for path, handler in routes.items()]
    return asyncio.ensure_future(run_input(runtime, "http", engine, extra))


def is_too_large(e: BaseException) -> bool:
    """Dynamo's TCP request plane refusing a message above DYN_TCP_MAX_MESSAGE_SIZE."""
    return "payload is too large" in str(e)


def client_error(e: MMEncoderError) -> Exception:
    """The exception a handler inside Dynamo's HTTP frontend raises so the client sees `e`'s status.
    Dynamo 1.6.1 shows a message only for `InvalidArgument` (400); for an `HttpError` it keeps the
    status and replaces the message with the status's name. The code leads the message: `[code] ...`."""
    from dynamo.llm.exceptions import CannotConnect, HttpError, InvalidArgument

    # For 503, HttpError reads "Internal server error"; CannotConnect reads "Service temporarily
    # unavailable". Neither shows our message, and no handler can set headers: no Retry-After here.
    text = f"[{e.code}] {e.message}"
    if e.http_status == 400:
        return InvalidArgument(text)
    return CannotConnect(text) if e.http_status == 503 else HttpError(e.http_status, text)


def internal_error(e: BaseException) -> Exception:
    """What a handler inside Dynamo's HTTP frontend raises for a bug: a 500 that names the
    exception's type and nothing the request sent."""
    from dynamo.llm.exceptions import HttpError

    return HttpError(500, f"internal error: {type(e).__name__}")


def worker_error(e: MMEncoderError) -> Exception:
    """The exception a worker behind Dynamo's stock frontend raises for `e`: the frontend shows the
    message of `InvalidArgument` (as a 400: a 404/413/422 keeps its code in the text) and answers
    503 to `CannotConnect`; anything else is a 500 whose message it hides."""
    from dynamo.llm.exceptions import CannotConnect, InvalidArgument, Unknown

    text = f"[{e.code}] {e.message}"
    if 400 <= e.http_status < 500:
        return InvalidArgument(text)
    return CannotConnect(text) if e.http_status == 503 else Unknown(text)


# --- the encode planner: Dynamo's planner connectors -----------------------------------------------
# Dynamo's planner types know prefill and decode only (`SubComponentType`), and a DGD v1beta1 has no
# encode component type. The encoders are typed `worker` and their replica count travels in the
# prefill slot: the Kubernetes connector looks a target up by type and falls back to its
# `component_name` for a `worker` component when no component of that type exists (so a graph with
# an encode planner types its engines `decode`, never `prefill`; render-k8s checks it); the virtual
# connector carries the count as `num_prefill` in a coordinator namespace of its own
# (`planner_namespace`), so Dynamo's own planner may plan the engines in the graph's namespace.
ENCODER_SLOT = "prefill"
PLANNER_COMPONENT, PLANNER_ENDPOINT = "encode_planner", "status"


def planner_namespace(namespace: str) -> str:
    """Where the encode planner's virtual-connector decisions live: not the graph's own namespace,
    whose prefill/decode slots belong to Dynamo's planner."""
    return f"{namespace}-encoders"


def _planner_package() -> None:
    """ai-dynamo 1.6.1's `dynamo.planner` imports its load predictor in `dynamo/planner/__init__.py`
    and `core/__init__.py` (aisimulate, which no public index serves, and scikit-learn); the
    connectors need neither. Without aisimulate, the two packages are registered bare (their
    submodules load as written; their `__init__` does not run)."""
    import importlib.util
    import sys
    import types
    from pathlib import Path

    if "dynamo.planner" in sys.modules or importlib.util.find_spec("aisimulate_core") is not None:
        return
    import dynamo

    base = Path(next(iter(dynamo.__path__))) / "planner"
    if not (base / "connectors" / "virtual.py").is_file():
        raise ImportError("Dynamo's planner is not installed (the ai-dynamo package: pip install --no-deps "
                          "ai-dynamo==1.6.1 after the `stock` extra)")
    for name, path in (("dynamo.planner", base), ("dynamo.planner.core", base / "core")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package


def encoder_target(component: str, replicas: int) -> Any:
    """Dynamo's `TargetReplica` for the encoder component (`ENCODER_SLOT`, by name)."""
    _planner_package()
    from dynamo.planner.config.defaults import SubComponentType, TargetReplica

    return TargetReplica(sub_component_type=SubComponentType(ENCODER_SLOT), component_name=component,
                         desired_replicas=replicas)


def planner_connector(kind: str, runtime: DistributedRuntime, namespace: str, model_name: str,
                      component: str) -> Any:
    """Dynamo's `VirtualConnector` (decisions through the runtime, for `mm-encoder serve` to carry
    out) or `KubernetesConnector` (the DGD named by DYN_PARENT_DGD_K8S_NAME, through its scaling
    adapter or a replica patch)."""
    _planner_package()
    if kind == "kubernetes":
        from dynamo.planner.connectors.kubernetes import KubernetesConnector

        # not Ready: an error, so the planner knows its decision was not applied (it holds and retries)
        return KubernetesConnector(namespace, model_name=model_name, raise_not_ready=True)
    from dynamo.planner.connectors.virtual import VirtualConnector
    from dynamo.planner.monitoring.worker_info import WorkerInfo

    class _EncoderInfo:  # where the encoders are, for the connector's worker counts
        def get_worker_info(self, sub_component_type: Any, backend: str = "vllm") -> WorkerInfo:
            return WorkerInfo(component_name=ENCODER_COMPONENT, endpoint=ENCODE_ENDPOINT, model_name=model_name)

    return VirtualConnector(runtime, planner_namespace(namespace), _EncoderInfo(), model_name=model_name)


def scaling_client(runtime: DistributedRuntime, namespace: str) -> Any:
    """The executor's side of the virtual connector: Dynamo's `VirtualConnectorClient`
    (`wait`, `get` -> a decision whose `num_prefill_workers` is the encoder count, `complete`)."""
    from dynamo._core import VirtualConnectorClient

    return VirtualConnectorClient(runtime, planner_namespace(namespace))
