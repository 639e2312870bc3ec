"""nginx for a tier: the config rendered from the templates in the repository's `configs/nginx/`
(shipped in the wheel), the install checked, the run directory written, nginx run in place of this
process. The caching is nginx's (proxy_cache with its lock), the key and route logic a short Lua
file (`configs/nginx/cache_key.lua`); why each directive is set the way it is: docs/cache-tiers.md.
"""

from __future__ import annotations

import os
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

from ..core.errors import CacheTierError
from ..core.registry import config_dir
from .config import TierConfig
from .metrics import lua_families
from .supervise import WATCH_S, supervise

PACKAGES = "nginx libnginx-mod-http-lua lua-nginx-string"
MODULE_DIRS = ("/usr/lib/nginx/modules", "/usr/lib64/nginx/modules", "/usr/share/nginx/modules")
LUA_DIRS = ("/usr/share/lua/5.1", "/usr/local/share/lua/5.1")


class _Template(string.Template):
    delimiter = "@"  # nginx and Lua use `$` themselves


def _servers(addresses: tuple[str, ...], extra: str = "") -> str:
    return "\n".join(f"        server {a}{extra};" for a in addresses)


def _next_servers(addresses: tuple[str, ...], breaker_s: int | None = None, zone: str = "") -> str:
    """A tier's next level (or its encoders) as nginx's upstream servers. `max_fails=0`: a server that
    answers 503 is retried on another (`proxy_next_upstream http_503`), and nginx would otherwise count
    that 503 as a failure and, with every server overloaded at once, answer 502 "no live upstreams" to
    everything for `fail_timeout` (measured: 10 s). A lone server (a Kubernetes Service) is listed
    twice, so that a retry has somewhere to go: a new connection, which the Service may send to
    another pod (a draining worker closes the connection it answered 503 on).

    `breaker_s` (an encoder site across the network): `max_fails=1 fail_timeout=breaker_s`, nginx's
    passive health check as a circuit breaker. One failed connect or timeout marks a server down, and
    with each listed down (twice: a lone server's max_fails is ignored) a miss is answered at once
    (502, made a typed 503: `_SITE_ERRORS`) until `breaker_s` has passed; then one request per worker
    probes, and its success closes the breaker. 503s do not count here: they are not retried on this
    hop (`next_upstream`), so they never reach nginx's failure count. The servers' state lives in the
    shared `zone`, one breaker for all workers: each worker on its own state probed once per worker, and
    a probe over a cut link costs its request the connect timeout."""
    servers = addresses if len(addresses) > 1 else addresses * 2
    if breaker_s is None:
        return _servers(servers, " max_fails=0")
    return f"        zone {zone} 64k;\n" + _servers(servers, f" max_fails=1 fail_timeout={breaker_s}s")


# nginx's own 502/504 for the encoder site's hop (no live upstream while the breaker is open, a refused
# or timed-out connect, a read timeout): a typed 503 the chain knows, with Retry-After; a 502 or 504 that
# the site itself answered passes on unchanged (no proxy_intercept_errors).
_SITE_ERRORS = "            error_page 502 504 = @mm_site_unreachable;"
_SITE_LOCATION = """        location @@mm_site_unreachable {
            access_log /dev/stderr mm_request;
            default_type application/json;
            add_header Retry-After @retry always;
            add_header X-MM-Error-Code encoder_site_unreachable always;
            add_header X-MM-Error "@message" always;
            add_header X-Cache-Status "cluster=$upstream_cache_status" always;
            return 503 '{"error": {"code": "encoder_site_unreachable", "message": "@message"}}';
            # counted as /v1/encode's answers are: a 503 upstream error of the calling cluster
            log_by_lua_block {
                require("tier_metrics").record()
            }
        }
"""


def _site_fields(cfg: TierConfig) -> dict[str, str]:
    """The template's fields that differ for a model cluster's tier (`--site-breaker`)."""
    if not cfg.site_breaker:
        return {"next_upstream": "error http_503 non_idempotent", "site_errors": "", "site_location": ""}
    retry = str(cfg.site_retry_s)
    message = (f"the encoder site is unreachable (it is asked again at most every {retry} s); "
               "cached items are still served")
    return {"next_upstream": "error non_idempotent", "site_errors": _SITE_ERRORS,
            "site_location": _Template(_SITE_LOCATION).substitute(retry=retry, message=message)}


def _snippet(name: str, fields: dict[str, str]) -> str:
    return _Template((config_dir() / "nginx" / name).read_text()).substitute(fields)


def snippets(cfg: TierConfig) -> dict[str, str]:
    """The files nginx.conf includes from the run directory: the status locations, the calling cluster's
    maps, the metric families' Lua table, and with TLS the handshake, the callers' roles, the next
    level's TLS and the plaintext ops server."""
    run_dir = str(cfg.resolved_run_dir().resolve())
    out = {"ops.conf": _snippet("ops.conf", {"tier": cfg.tier}),
           "cluster.conf": (config_dir() / "nginx" / "cluster.conf").read_text(),
           "tier_metrics_families.lua": lua_families()}
    if cfg.tls:
        own = cfg.identity  # the tier's trust domain and graph are its callers', and those it admits besides
        graphs = list(dict.fromkeys((own.graph, *cfg.tls_allow_graphs)))
        fields = {"tier": cfg.tier, "run_dir": run_dir, "tls_cert": str(cfg.tls_cert), "tls_key": str(cfg.tls_key),
                  "tls_ca": str(cfg.tls_ca), "server_name": cfg.tls_server_name,
                  "direct_server_name": cfg.tls_direct_server_name or cfg.tls_server_name,
                  "peer_prefix": " ".join(f"spiffe://{own.trust_domain}/{g}/" for g in graphs),
                  "peer_graphs": graphs[0] if len(graphs) == 1 else "{" + ",".join(graphs) + "}",
                  "trust_domain": own.trust_domain,
                  "allowed_roles": " ".join(cfg.callers), "allowed_list": ",".join(cfg.callers),
                  "ops_listen": cfg.ops_listen or ""}
        out["tls-http.conf"] = _snippet("tls-http.conf", fields)
        out["tls-server.conf"] = _snippet("tls-server.conf", fields)
        if cfg.ops_listen is not None:
            out["ops-server.conf"] = _snippet("ops-server.conf", fields)
    return out


def _model_routes(cfg: TierConfig) -> dict[str, str]:
    """One upstream per model of --next-model, and the map from a request's X-MM-Model to it (a name
    matched whole and without case, as the encoders match it)."""
    upstreams, entries = [], []
    for i, (model, addresses) in enumerate(sorted(cfg.models.items())):
        upstreams.append(f"    upstream mm_model_{i} {{\n{_next_servers(addresses)}\n        keepalive 64;\n"
                         "        keepalive_timeout 10s;\n    }")
        entries.append(f'        "~*^{re.escape(model)}$"  "mm_model_{i}";')
    return {"model_upstreams": "\n".join(upstreams), "model_map": "\n".join(entries)}


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
        "connect_timeout": cfg.connect,
        "read_timeout": cfg.timeout,
        "drop_client_key": "1" if cfg.drop_client_key else "0",
        "cluster_name": cfg.cluster,
        # nginx warns about `user` unless it starts as root; only then is it meaningful
        "user_directive": f"user {cfg.user};" if os.geteuid() == 0 else "",
    }
    breaker = cfg.site_retry_s if cfg.site_breaker else None
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
            next_servers=_next_servers(cfg.next, breaker, "mm_next_peers"),
            direct_servers=_next_servers(cfg.direct or cfg.next, breaker, "mm_direct_peers"),
            **_site_fields(cfg),
            **_model_routes(cfg),
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
    for lua in ("cache_key.lua", "peer_id.lua", "tier_metrics.lua"):
        shutil.copyfile(config_dir() / "nginx" / lua, run_dir / lua)
    for name, text in snippets(cfg).items():
        (run_dir / name).write_text(text)
    conf = run_dir / "nginx.conf"
    conf.write_text(render(cfg, modules))
    return [nginx, "-p", f"{run_dir}/", "-c", str(conf), "-e", "stderr"], conf


def up(cfg: TierConfig, watch_s: float = WATCH_S) -> int:
    """Run nginx in the foreground (signals reach it as they would nginx itself: QUIT stops gracefully, HUP
    reloads, TERM stops): in place of this process, or with TLS as its child, reloaded whenever its
    certificate files change (every `watch_s`: `supervise`); nginx's exit status."""
    cmd, conf = prepare(cfg)
    test = subprocess.run([*cmd, "-t", "-q"], capture_output=True, text=True)
    if test.returncode != 0:
        raise CacheTierError(f"nginx rejected {conf}:\n{test.stderr.strip()}")
    print(f"mm-encoder cache {cfg.tier} on {cfg.listen} (config {conf})", file=sys.stderr, flush=True)
    if cfg.tls_cert is not None and cfg.tls_key is not None and cfg.tls_ca is not None:
        return supervise(cmd, [cfg.tls_cert, cfg.tls_key, cfg.tls_ca], watch_s)
    os.execv(cmd[0], cmd)
    return 0  # not reached
