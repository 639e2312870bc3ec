"""The frontend's options: every one from the command line or `MM_FRONTEND_<OPTION>` (the command
line wins); the README lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from ..core.timing import DRAIN_TIMEOUT_S
from ..core.wire_schema import WireDtype
from ..runtime.dynamo import ENGINE_COMPONENT, KvOptions
from ..security.tls import PATH, TlsOptions
from .processor import Limits


class FrontendSettings(KvOptions, TlsOptions):
    """Every option from the command line or `MM_FRONTEND_<OPTION>`."""

    model_config = SettingsConfigDict(env_prefix="MM_FRONTEND_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m mm_encoder.frontend", extra="ignore", frozen=True)

    model_dir: Path = Field(description="the served LLM's directory: config.json, tokenizer, chat template")
    http_host: str = Field("127.0.0.1")
    http_port: int = Field(8000, ge=1, le=65535)
    https: bool = Field(False, description="serve the OpenAI port over HTTPS with --tls-cert/--tls-key")
    https_client_auth: bool = Field(False, description="with --https: clients need a certificate from --tls-ca")
    https_cert: PATH | None = Field(None, description="with --https: the OpenAI port's certificate, read once at "
                                    "start (unset: --tls-cert; serve gives the longer-lived one it renews by restart)")
    https_key: PATH | None = Field(None, description="with --https-cert: its key")
    engine_component: str = Field(ENGINE_COMPONENT, description="engines serve <namespace>.<component>.generate")
    encoder_http: str | None = Field(None, description="cache chain URL (the cluster tier); unset: RPC only")
    encoder_route: str = Field("cluster,shared", description="X-Cache-Route for the chain")
    encoder_rpc: bool = Field(True, description="Dynamo RPC to <namespace>.mm_encoder.encode (direct, and fallback)")
    encoder_timeout_s: float = Field(600.0, gt=0)
    wire_dtype: WireDtype | None = Field(
        None, description="the rows' dtype the engines take (a graph sets llm.wire_dtype, else llm.dtype): sent "
                          "in every encode request and part of the tiers' key; an encoder packing another answers 409")
    media_transport: Literal["handle", "body"] = Field(
        "handle", description="handle: engines fetch embeddings themselves; body: through this process "
                              "(the old way, for comparison: needs DYN_TCP_MAX_MESSAGE_SIZE raised for big images)")
    max_media: int = Field(Limits.max_media, ge=1, description="media items per request")
    max_inflight_media: int = Field(
        Limits.max_inflight_media, ge=1,
        description="requests with media between encoding and the engine's first item; others wait",
    )
    max_inflight_requests: int = Field(
        Limits.max_inflight_requests, ge=1, description="requests in flight at once; beyond it: 503 at once")
    default_max_tokens: int = Field(
        Limits.default_max_tokens, ge=1, description="completion budget when the request names none"
    )
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, ge=0, description="on SIGTERM: how long the drain may last: "
                                   "requests in flight finish, new ones get 503, then clients' open connections are "
                                   "closed once idle for 1 s")
    router_assume_kv_reuse: bool = Field(
        False, description="let Dynamo's KV router count identical in-flight prompts as sharing KV blocks; the "
                           "engines here share a prefix only once its prefill is done, so off: identical "
                           "concurrent prompts then load (and spread over) engines like any others")
    runtime_threads: int | None = Field(
        None, ge=1, description="worker threads of Dynamo's runtime in this process (it sets "
                                "DYN_RUNTIME_NUM_WORKER_THREADS); unset: that variable, else 1. The processor "
                                "runs on one Python thread, and each more Rust worker only adds thread "
                                "wake-ups per request (BENCHMARKS.md: our frontend vs Dynamo's stock frontend)")
    trust_client_trace: bool = Field(
        False, description="continue a client's traceparent (its trace id and sampling decision); off: each "
                           "request starts a trace of its own that links the client's (the OpenAI port is the edge)")
    tenant_header: str | None = Field(
        None, description="serve tenants: each request names its tenant in this header (set by the gateway; a "
                          "request without it gets 400 missing_tenant), and every cache entry below the frontend "
                          "is the tenant's own (docs/tenants.md)")
    tenant_key: PATH | None = Field(
        None, description="with --tenant-header: a file of at least 32 random bytes the tenants' cache scopes are "
                          "keyed by (the same file on every frontend whose tenants share entries)")
    allow_remote_code: bool = Field(False, description="let transformers run the model's tokenizer code")
    inline_media: bool = Field(False, description="aggregated baseline: engines fetch and encode media themselves")

    @model_validator(mode="after")
    def _https(self) -> FrontendSettings:
        if (self.https or self.https_client_auth) and not self.tls:
            raise ValueError("--https serves this frontend's certificate: it needs --tls-cert, --tls-key, --tls-ca")
        if self.https_client_auth and not self.https:
            raise ValueError("--https-client-auth goes with --https")
        if (self.https_cert is None) != (self.https_key is None) or (self.https_cert and not self.https):
            raise ValueError("--https-cert and --https-key go together, with --https")
        if self.tenant_header and self.inline_media:
            raise ValueError("--tenant-header scopes the encoders' caches; the aggregated baseline (--inline-media) "
                             "has its engines encode, with no cache to scope")
        if (self.tenant_header is None) != (self.tenant_key is None):
            raise ValueError("--tenant-header and --tenant-key go together")
        return self


