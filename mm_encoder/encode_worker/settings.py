"""Worker configuration: every option from the command line (`--http-port 8090`) or the
environment (`MM_ENCODER_HTTP_PORT=8090`); the command line wins. pydantic-settings does the
parsing, so the two spellings cannot drift apart. The README lists the options.

Dynamo's own settings stay Dynamo's: DYN_DISCOVERY_BACKEND (default here: file), DYN_REQUEST_PLANE
(tcp), DYN_EVENT_PLANE (zmq), DYN_FILE_KV, ETCD_ENDPOINTS, NATS_SERVER, DYN_SYSTEM_PORT.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from ..core.registry import DEFAULT_MODEL
from ..core.spec import MediaLimits
from ..core.timing import DRAIN_TIMEOUT_S
from ..core.topology import callers
from ..core.wire_schema import WireDtype
from ..fetch import FetchPolicy
from ..model.steps import BATCH_MAX_PATCHES
from ..runtime.dynamo import DynamoOptions
from ..security.tls import TlsOptions


class WorkerSettings(DynamoOptions, TlsOptions):
    model_config = SettingsConfigDict(
        env_prefix="MM_ENCODER_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m mm_encoder.encode_worker",
        extra="ignore",
        frozen=True,
    )

    # --- model -------------------------------------------------------------------------------
    model: str = Field(DEFAULT_MODEL, description="registry name or alias, or a checkpoint directory")
    checkpoint: str | None = Field(None, description="checkpoint directory (default: deterministic random weights)")
    device: str | None = Field(None, description="cpu, cuda, cuda:1 ... (default: cuda if available)")
    dtype: str | None = Field(None, description="bf16, fp16 or fp32 (default: bf16 where native, else fp32)")

    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: torch's); fewer leaves cores for decode and pack"
    )

    # --- transports --------------------------------------------------------------------------
    http_host: str = Field("127.0.0.1", description="HTTP bind address")
    http_port: int = Field(8090, ge=-1, le=65535, description="HTTP port; 0 picks a free one, -1 disables HTTP")
    dynamo: bool = Field(False, description="also serve <namespace>.mm_encoder.encode on the Dynamo runtime")
    stock_model_dir: str | None = Field(
        None, description="also register as Dynamo's Encode worker for this LLM directory, so the stock "
                          "`python -m dynamo.frontend` calls this worker for requests with media (needs --dynamo)")
    stock_name: str | None = Field(None, description="with --stock-model-dir: the served model name")
    handle_chain: str | None = Field(
        None, description="the cache chain URL that handles name (engines fetch bodies there; unset: RPC only)")
    handle_route: str = Field("cluster,shared", description="X-Cache-Route handles name with --handle-chain")
    # with --tls-cert/--tls-key/--tls-ca (security/tls.py) the HTTP port serves HTTPS to callers with a
    # certificate from the CA whose role is listed; health and metrics move to --ops-port, plaintext
    tls_allow: list[str] = Field(sorted(callers("encoder")),
                                 description="with TLS: the roles (their certificates' OU) that may call this worker")
    ops_port: int = Field(-1, ge=-1, le=65535, description="with TLS: a plaintext port on --http-host for /health, "
                                                           "/ready and /metrics only (0 picks one; -1: none)")

    # --- wire format -------------------------------------------------------------------------
    wire_dtype: WireDtype | None = Field(
        None, description="embedding dtype on the wire (default: the dtype the model runs in, so --dtype fp32 is "
                          "fp32 rows to the engine and bf16 stays bf16); requests that name another get 409")
    wire_byte_planes: bool = Field(True, description="byte-plane split before zstd (smaller bodies; see BENCHMARKS)")
    zstd_level: int = Field(
        1, ge=1, le=19, description="zstd level of bodies (1: smallest and fastest with byte planes; BENCHMARKS.md)"
    )

    # --- pipeline ----------------------------------------------------------------------------
    max_pending: int = Field(64, ge=1, description="items past the caches at once; beyond it: 503 + Retry-After")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds on 503")
    cpu_workers: int = Field(2, ge=1, description="threads that decode and preprocess")
    post_workers: int = Field(
        1, ge=0, description="threads that copy, pack and compress; 0 packs on the device thread (no overlap)"
    )
    batch_max_patches: int = Field(
        BATCH_MAX_PATCHES, ge=1,
        description="pack queued items into one forward up to this many patches; bigger items go alone",
    )
    capacity_probe: bool = Field(
        True, description="time one forward of a 448x448 image when the worker starts: the capacity estimate "
                          "(dynamo_component_encode_capacity_patches_per_second) before live forwards refine it")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest request body accepted")
    max_receiving_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="request bodies held at once (announced sizes; a chunked body counts as --max-body-bytes); "
                    "beyond it: 503 overloaded before the body is read")
    idle_timeout_s: float = Field(
        15.0, gt=0, description="close a connection idle, or with a request's headers still incomplete, this long "
                                "(slow clients); above the tiers' upstream keep-alive (10 s)")
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, ge=0,
                                   description="graceful shutdown: how long in-flight work may finish")

    # --- caches ------------------------------------------------------------------------------
    alias_cache_entries: int = Field(100_000, ge=0, description="URL-alias LRU size (0 disables)")
    alias_ttl_s: float = Field(300.0, ge=0, description="URL-alias TTL: URLs are mutable")
    cache_bytes: int = Field(1 << 30, ge=0, description="mm_hash LRU capacity in bytes of bodies (0 disables)")

    # --- media fetching ----------------------------------------------------------------------
    fetch_max_bytes: int = Field(64 * 1024 * 1024, ge=1, description="media download cap (streamed)")
    fetch_timeout_s: float = Field(30.0, gt=0, description="whole download, redirects included")
    fetch_max_redirects: int = Field(3, ge=0, description="each hop is re-checked")
    fetch_allow_hosts: tuple[str, ...] = Field(
        (), description='internal hosts exempt from the address rules: "host", "host:port", "10.0.0.0/8" (JSON list)'
    )
    fetch_allow_file_dirs: tuple[str, ...] = Field((), description="directories file:// URLs may read (JSON list)")
    max_pixels: int = Field(MediaLimits().max_pixels, ge=1, description="refused from the header, before decoding")
    max_video_patches: int = Field(
        MediaLimits().max_video_patches, ge=1,
        description="a video's sampled frames x patches per frame, checked from its header before decoding")
    max_decoding_pixels: int | None = Field(
        None, ge=1, description="pixels decoded at once in this worker, all requests together (default: 4 x "
                                "--max-pixels); a request waits --decode-wait-s for room, then gets 503")
    decode_wait_s: float = Field(MediaLimits().decode_wait_s, gt=0)
    max_prepared_patches: int | None = Field(
        None, ge=1, description="patches prepared for the forward and held at once, all requests together "
                                "(default: --max-video-patches); a request waits --decode-wait-s for room, "
                                "then gets 503")


    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.http_port < 0 and not self.dynamo:
            raise ValueError("nothing to serve: HTTP is disabled (--http-port -1) and --dynamo is off")
        if self.stock_model_dir and not self.dynamo:
            raise ValueError("--stock-model-dir registers a Dynamo Encode worker: it needs --dynamo")
        if self.ops_port >= 0 and not self.tls:
            raise ValueError("--ops-port is the plaintext port beside an HTTPS one: it needs --tls-cert")
        return self

    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy(
            max_bytes=self.fetch_max_bytes,
            timeout_s=self.fetch_timeout_s,
            max_redirects=self.fetch_max_redirects,
            allow_hosts=self.fetch_allow_hosts,
            allow_file_dirs=self.fetch_allow_file_dirs,
        )

    def media_limits(self) -> MediaLimits:
        return MediaLimits(max_bytes=self.fetch_max_bytes, max_pixels=self.max_pixels,
                           max_video_patches=self.max_video_patches, max_decoding_pixels=self.max_decoding_pixels,
                           decode_wait_s=self.decode_wait_s, max_prepared_patches=self.max_prepared_patches)
