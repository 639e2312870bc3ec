"""nginx cache tiers and the shard router: render a config, check the install, run nginx.

    mm-encoder cache up --tier cluster --listen 127.0.0.1:8081 --next 127.0.0.1:8082 --direct 127.0.0.1:8090
    mm-encoder cache up --tier router  --listen 127.0.0.1:8082 --shard 127.0.0.1:8083 --shard 127.0.0.1:8084
    mm-encoder cache up --tier shared  --listen 127.0.0.1:8083 --next 127.0.0.1:8090
    mm-encoder cache render ...        # the config on stdout (for a Kubernetes ConfigMap)

The caching is nginx's (proxy_cache with its lock), the key and route logic a short Lua file
(`configs/nginx/cache_key.lua`); this module only fills in the templates in `configs/nginx/` and
starts nginx unprivileged in the foreground with every path under one run directory. Every
option is a `TierConfig` field, from the command line or `MM_CACHE_<OPTION>`; the defaults here
are the only ones (`mm-encoder serve` and `render-k8s` pass addresses and paths, nothing else).
Why each directive is set the way it is: docs/cache-tiers.md.
"""

from __future__ import annotations

import os
import re
import shutil
import string
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import CliPositionalArg, SettingsConfigDict, SettingsError

from ..core.errors import CacheTierError, MMEncoderError
from ..core.registry import config_dir
from ..security.pki import ROLES
from ..security.tls import HOP_CALLERS, TlsOptions

PACKAGES = "nginx libnginx-mod-http-lua lua-nginx-string"
MODULE_DIRS = ("/usr/lib/nginx/modules", "/usr/lib64/nginx/modules", "/usr/share/nginx/modules")
LUA_DIRS = ("/usr/share/lua/5.1", "/usr/local/share/lua/5.1")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")
_SIZE = re.compile(r"^[0-9]+[kmgKMG]?$")
_TIME = re.compile(r"^[0-9]+(ms|s|m|h|d)?$")


# How long a tier waits for the next level: above the slowest encode plus the inner tiers' lock
# waits. The cluster tier waits on the shared tier, which may itself wait a lock age (600 s).
READ_TIMEOUTS = {"cluster": "1500s", "shared": "900s", "router": "900s"}


class _Template(string.Template):
    delimiter = "@"  # nginx and Lua use `$` themselves


class TierConfig(TlsOptions):
    """One nginx process: a cache tier (`cluster` or `shared`) or the stateless `router`; with
    --tls-cert/--tls-key/--tls-ca, HTTPS to callers whose certificate's role is in --tls-allow and
    HTTPS to the next level, the tier's status in plaintext on --ops-listen only."""

    model_config = SettingsConfigDict(
        env_prefix="MM_CACHE_", extra="forbid", frozen=True, populate_by_name=True,
        cli_kebab_case=True, cli_implicit_flags=True, cli_prog_name="mm-encoder cache", cli_exit_on_error=False,
    )

    tier: Literal["cluster", "shared", "router"]
    listen: str = Field("127.0.0.1:8081", description="host:port")
    next: tuple[str, ...] = Field((), description="the next level: the shared tier's router, or the encoders")
    direct: tuple[str, ...] = Field((), description="the encoders, for X-Cache-Route ...,direct (default: next)")
    shards: tuple[str, ...] = Field((), alias="shard", description="router only: a shard tier, by stable name")
    run_dir: Path | None = Field(None, description="config, pid and temp files; default a temp dir per tier and port")
    cache_dir: Path | None = Field(None, description="on tmpfs; default /dev/shm/mm-encoder-cache/<tier>-<port>")
    max_size: str = "1g"
    keys_zone: str = "64m"
    valid: str = "24h"
    lock_timeout: str = Field("600s", description="how long identical misses wait for the first one")
    lock_age: str = Field("600s", description="after this, one more waiter may go to the origin")
    read_timeout: str | None = Field(None, description="waiting for the next level (default: READ_TIMEOUTS)")
    connect_timeout: str = "5s"
    client_max_body_size: str = "96m"
    client_body_buffer_size: str = "1m"
    workers: str = "auto"
    drop_client_key: bool = Field(False, description="ignore a client's X-Cache-Key (the outermost tier)")
    log_level: Literal["debug", "info", "notice", "warn", "error", "crit"] = "warn"
    tls_allow: tuple[str, ...] = Field((), description="with TLS: the roles (certificate OU) that may call this "
                                       "tier (default: security.tls.HOP_CALLERS for the tier)")
    tls_server_name: str = Field("localhost", pattern=r"^[A-Za-z0-9.-]+$",
                                 description="with TLS: the name the next level's certificate must carry")
    ops_listen: str | None = Field(None, description="with TLS: host:port for /_cache/stats, /_cache/health and "
                                                     "/_cache/status in plaintext (loopback or the pod network)")
    user: str = Field(
        "root", pattern=r"^[A-Za-z0-9_.-]+( [A-Za-z0-9_.-]+)?$",
        description="worker user when started as root (nginx `user`); non-root starts ignore it. root by "
        "default so that run directories inside private (0700) temp dirs work; pass e.g. nobody with "
        "directories that user can reach to drop privileges",
    )

    @field_validator("listen")
    @classmethod
    def _address(cls, v: str) -> str:
        if not _ADDRESS.match(v):
            raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("ops_listen")
    @classmethod
    def _ops_address(cls, v: str | None) -> str | None:
        return None if v is None else cls._address(v)

    @field_validator("tls_allow")
    @classmethod
    def _roles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [r for r in v if r not in ROLES]
        if unknown:
            raise ValueError(f"unknown roles {unknown}; roles are {', '.join(ROLES)}")
        return v

    @field_validator("next", "direct", "shards")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            cls._address(a)
        return v

    @field_validator("max_size", "keys_zone", "client_max_body_size", "client_body_buffer_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if not _SIZE.match(v):
            raise ValueError(f"{v!r} is not an nginx size (like 512k, 64m, 1g)")
        return v

    @field_validator("valid", "lock_timeout", "lock_age", "read_timeout", "connect_timeout")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _TIME.match(v):
            raise ValueError(f"{v!r} is not an nginx time (like 500ms, 30s, 10m, 24h)")
        return v

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: str) -> str:
        if v != "auto" and not v.isdigit():
            raise ValueError("workers is a number or auto")
        return v

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if self.tier == "router":
            if not self.shards:
                raise ValueError("a router needs at least one --shard")
            if self.next or self.direct:
                raise ValueError("a router takes --shard, not --next/--direct")
        elif not self.next:
            raise ValueError(f"a {self.tier} tier needs --next (the next level, or the encoders)")
        elif self.shards:
            raise ValueError("--shard is for the router")
        if (self.ops_listen is not None or self.tls_allow) and not self.tls:
            raise ValueError("--ops-listen and --tls-allow go with TLS (--tls-cert, --tls-key, --tls-ca)")
        return self

    @property
    def callers(self) -> tuple[str, ...]:
        """With TLS: the roles that may call this tier."""
        return self.tls_allow or tuple(sorted(HOP_CALLERS[f"cache-{self.tier}"]))

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    def resolved_run_dir(self) -> Path:
        return self.run_dir or Path(tempfile.gettempdir()) / f"mm-encoder-cache-{self.tier}-{self.port}"

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.resolved_run_dir()
        return base / "mm-encoder-cache" / f"{self.tier}-{self.port}"


def _servers(addresses: tuple[str, ...], extra: str = "") -> str:
    return "\n".join(f"        server {a}{extra};" for a in addresses)


def _snippet(name: str, fields: dict[str, str]) -> str:
    return _Template((config_dir() / "nginx" / name).read_text()).substitute(fields)


def snippets(cfg: TierConfig) -> dict[str, str]:
    """The files nginx.conf includes from the run directory: the status locations, and with TLS the
    handshake, the callers' roles, the next level's TLS and the plaintext ops server."""
    run_dir = str(cfg.resolved_run_dir().resolve())
    out = {"ops.conf": _snippet("ops.conf", {"tier": cfg.tier})}
    if cfg.tls:
        fields = {"tier": cfg.tier, "run_dir": run_dir, "tls_cert": str(cfg.tls_cert), "tls_key": str(cfg.tls_key),
                  "tls_ca": str(cfg.tls_ca), "server_name": cfg.tls_server_name,
                  "allowed_roles": "|".join(re.escape(r) for r in cfg.callers),
                  "allowed_list": ", ".join(cfg.callers), "ops_listen": cfg.ops_listen or ""}
        out["tls-http.conf"] = _snippet("tls-http.conf", fields)
        out["tls-server.conf"] = _snippet("tls-server.conf", fields)
        if cfg.ops_listen is not None:
            out["ops-server.conf"] = _snippet("ops-server.conf", fields)
    return out


def render(cfg: TierConfig, modules_dir: str | None = None) -> str:
    """The nginx.conf text for `cfg` (paths as they will be under cfg.run_dir; the files it
    includes from there: `snippets`)."""
    name = "router.conf" if cfg.tier == "router" else "cache-tier.conf"
    template = _Template((config_dir() / "nginx" / name).read_text())
    run_dir = str(cfg.resolved_run_dir().resolve())
    included = snippets(cfg)

    def include(snippet: str, indent: str) -> str:
        return f"{indent}include {run_dir}/{snippet};" if snippet in included else ""

    fields = {
        "modules": modules_dir or find_modules_dir() or MODULE_DIRS[0],
        "run_dir": run_dir,
        "listen_tls": " ssl" if cfg.tls else "",
        "scheme": "https" if cfg.tls else "http",
        "tls_http": include("tls-http.conf", "    "),
        "tls_server": include("tls-server.conf", "        "),
        "ops_server": include("ops-server.conf", "    "),
        "workers": cfg.workers,
        "log_level": cfg.log_level,
        "listen": cfg.listen,
        "client_max_body_size": cfg.client_max_body_size,
        "client_body_buffer_size": cfg.client_body_buffer_size,
        "connect_timeout": cfg.connect_timeout,
        "read_timeout": cfg.read_timeout or READ_TIMEOUTS[cfg.tier],
        "drop_client_key": "1" if cfg.drop_client_key else "0",
        # nginx warns about `user` unless it starts as root; only then is it meaningful
        "user_directive": f"user {cfg.user};" if os.geteuid() == 0 else "",
    }
    if cfg.tier == "router":
        fields["shard_servers"] = _servers(cfg.shards, " max_fails=1 fail_timeout=10s")
    else:
        fields.update(
            tier=cfg.tier,
            cache_dir=str(cfg.resolved_cache_dir()),
            keys_zone=cfg.keys_zone,
            max_size=cfg.max_size,
            valid=cfg.valid,
            lock_timeout=cfg.lock_timeout,
            lock_age=cfg.lock_age,
            next_servers=_servers(cfg.next),
            direct_servers=_servers(cfg.direct or cfg.next),
        )
    return template.substitute(fields)


# --- the nginx install ---------------------------------------------------------------------------


def find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def find_modules_dir() -> str | None:
    for d in MODULE_DIRS:
        if all((Path(d) / m).is_file() for m in ("ndk_http_module.so", "ngx_http_lua_module.so")):
            return d
    return None


def check_install() -> tuple[str, str]:
    """(nginx binary, module directory), or a CacheTierError naming exactly what to install."""
    missing = []
    nginx = find_nginx()
    if nginx is None:
        missing.append("nginx (the nginx binary)")
    modules = find_modules_dir()
    if modules is None:
        missing.append("libnginx-mod-http-lua (ngx_http_lua_module.so and ndk_http_module.so)")
    if not any((Path(d) / "resty" / "core.lua").is_file() for d in LUA_DIRS):
        missing.append("lua-resty-core (resty/core.lua, pulled in by libnginx-mod-http-lua)")
    if not any((Path(d) / "nginx" / "sha256.lua").is_file() for d in LUA_DIRS):
        missing.append("lua-nginx-string (nginx/sha256.lua)")
    if missing or nginx is None or modules is None:  # each None is named in `missing`
        raise CacheTierError(
            "the cache tiers need nginx with its Lua module; missing: " + "; ".join(missing)
            + f". On Debian/Ubuntu: sudo apt-get install -y --no-install-recommends {PACKAGES}"
        )
    return nginx, modules


def prepare(cfg: TierConfig) -> tuple[list[str], Path]:
    """Write the run directory (config, Lua, temp dirs) and return the nginx command line."""
    nginx, modules = check_install()
    run_dir = cfg.resolved_run_dir().resolve()
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    if cfg.tier != "router":
        cfg.resolved_cache_dir().mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_dir() / "nginx" / "cache_key.lua", run_dir / "cache_key.lua")
    for name, text in snippets(cfg).items():
        (run_dir / name).write_text(text)
    conf = run_dir / "nginx.conf"
    conf.write_text(render(cfg, modules))
    return [nginx, "-p", f"{run_dir}/", "-c", str(conf), "-e", "stderr"], conf


def up(cfg: TierConfig) -> int:
    """Run nginx in the foreground, in place of this process (signals go straight to nginx:
    QUIT stops gracefully, HUP reloads, TERM stops)."""
    cmd, conf = prepare(cfg)
    test = subprocess.run([*cmd, "-t", "-q"], capture_output=True, text=True)
    if test.returncode != 0:
        raise CacheTierError(f"nginx rejected {conf}:\n{test.stderr.strip()}")
    print(f"mm-encoder cache {cfg.tier} on {cfg.listen} (config {conf})", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


class _Command(TierConfig):
    action: CliPositionalArg[Literal["up", "render"]] = Field(
        description="up: run nginx in the foreground; render: print the config")


def parse_args(argv: list[str]) -> tuple[str, TierConfig]:
    """`mm-encoder cache` arguments -> (action, config); what `render-k8s` reads tier sizes with."""
    cmd = _Command(_cli_parse_args=argv)
    return cmd.action, TierConfig.model_validate(cmd.model_dump(exclude={"action"}))


def main(argv: list[str] | None = None) -> int:
    """`mm-encoder cache up|render`: an nginx cache tier or the shard router."""
    try:
        action, cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if action == "render":
            print(render(cfg))
            return 0
        return up(cfg)
    except (ValidationError, SettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MMEncoderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
