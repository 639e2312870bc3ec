"""One EPD deployment whose components come from two installs (tests/test_mixed_release.py): this tree's
(`.venv`) and the previous release's (`.venv-release`, its wheel built from its commit in releases.toml).

Each of the four roles comes from one install, as a rollout upgrades them: the encode worker, the cache
tiers (one shard behind the router, and the cluster tier), the engine and the frontend. Each component is
started as its install's `serve` starts it (the same command line and Dynamo environment; its module named
as that release names it), from the run directory (so an interpreter never imports this checkout), on one
NATS server and one file-discovery store; each is waited on by its health URL or ready line, and stopped
by PID and then its process group."""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.processes import Process
from harness.serve_fixtures import MODEL, QUESTION, SAMPLE, data_url
from harness.topology import free_port
from harness.venvs import RELEASE_PYTHON

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Install:
    """An install's interpreter and how its release names what serve starts."""

    version: str
    python: Path
    engine: str = "mm_encoder.engines"
    tiers: str = "mm_encoder.cache_tiers"
    frontend_args: tuple[str, ...] = ()  # what its serve adds for an fp32 graph
    tier_args: tuple[str, ...] = ()  # added to each of its tiers' command lines


MAIN = Install("main", Path(sys.executable), frontend_args=("--wire-dtype", "float32"))
# A rollout's workarounds (docs/versioning.md): this tree's tiers ignoring a caller's key instead of checking it
# (the previous release's frontends and engines send its key); this tree's frontend naming no rows' dtype (the
# previous release's encoders and engines refuse the field).
MAIN_TIERS_DROP_KEY = replace(MAIN, tier_args=("--drop-client-key",))
MAIN_FRONTEND_NO_DTYPE = replace(MAIN, frontend_args=())
# Each release's own module names (0.2.0's serve: deploy/plan.py MODULES).
_RELEASED = {"0.2.0": {"engine": "mm_encoder.engines.worker", "tiers": "mm_encoder.deploy.cache_tiers"}}


def released(version: str, python: Path = RELEASE_PYTHON) -> Install:
    """A release's install (its module names, where they differ from this tree's)."""
    return Install(version, python, **_RELEASED.get(version, {}))


def previous_release() -> tuple[str, str]:
    """The release before this tree's version (releases.toml's newest entry of another version; a tree
    of the newest release's version before that release is recorded: the newest), the one
    `.venv-release` holds (tools/venv.sh picks alike): (version, commit). A release's promise is with
    the one before it."""
    import mm_encoder

    with (ROOT / "releases.toml").open("rb") as f:
        releases = tomllib.load(f)["release"]
    before = [r for r in releases if r["version"] != mm_encoder.__version__] or releases
    return before[-1]["version"], before[-1]["commit"]


ROLES = ("encoder", "tiers", "engine", "frontend")


def halves(back: Install, front: Install) -> dict[str, Install]:
    """The encoders and tiers from `back`, the engine and frontend from `front`."""
    return {"encoder": back, "tiers": back, "engine": front, "frontend": front}


@dataclass
class Mixed:
    """The deployment in `root` (logs, stores, nginx directories), serving `checkpoint` (a directory named as
    the model it serves); `start` (or `with`) starts it, `chat` asks it, `stop` stops it."""

    root: Path
    checkpoint: Path
    installs: dict[str, Install]  # role (ROLES) -> the install it runs from
    timeout_s: float = 120.0
    procs: list[Process] = field(default_factory=list)
    frontend_port: int = 0
    encoder: str = ""  # host:port, once started

    def _env(self, nats: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "PYTHON", "MM_"))}
        return env | {"PYTHONUNBUFFERED": "1", "NATS_SERVER": nats, "DYN_REQUEST_PLANE": "tcp",
                      "DYN_EVENT_PLANE": "nats", "DYN_DISCOVERY_BACKEND": "file",
                      "DYN_FILE_KV": str(self.root / "dynamo-store"), "DYN_TCP_RPC_HOST": "127.0.0.1",
                      "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
                      "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SELF_HOST_METADATA": "0", "DYN_LOG": "warn",
                      "DYN_TCP_MAX_MESSAGE_SIZE": str(256 << 20)}

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Process:
        proc = Process(argv, name=name, env=env, cwd=self.root, log=self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def _tier(self, env: dict[str, str], name: str, tier: str, *flags: str) -> str:
        port = free_port()
        dirs = ["--run-dir", str(self.root / f"nginx-{name}")]
        if tier != "router":
            dirs += ["--cache-dir", str(self.root / f"cache-{name}")]
        tiers = self.installs["tiers"]
        argv = [str(tiers.python), "-m", tiers.tiers, "up", "--tier", tier, "--listen", f"127.0.0.1:{port}"]
        self._start(name, [*argv, *dirs, *flags, *tiers.tier_args], env).wait_url(
            f"http://127.0.0.1:{port}/_cache/health", self.timeout_s)
        return f"127.0.0.1:{port}"

    def start(self) -> Mixed:
        """Every component, in serve's order, each ready before the next starts."""
        self.root.mkdir(parents=True, exist_ok=True)
        nats_port = free_port()
        shutil.which("nats-server") or sys.exit("nats-server is not installed (make system-deps)")
        self._start("nats", ["nats-server", "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd",
                             str(self.root / "nats")], dict(os.environ)).wait_for("Server is ready", self.timeout_s)
        env = self._env(f"nats://127.0.0.1:{nats_port}")
        ns, ckpt = ["--namespace", "mm"], str(self.checkpoint)
        port = free_port()
        enc, engine, front = (self.installs[role] for role in ("encoder", "engine", "frontend"))
        self._start("encoder", [str(enc.python), "-m", "mm_encoder.worker", "--model", ckpt, "--dtype", "fp32",
                                "--dynamo", *ns, "--http-host", "127.0.0.1", "--http-port", str(port)], env).wait_url(
            f"http://127.0.0.1:{port}/ready", self.timeout_s)
        encoder = self.encoder = f"127.0.0.1:{port}"
        shard = self._tier(env, "shared-0", "shared", "--next", encoder)
        router = self._tier(env, "router", "router", "--shard", shard)
        cluster = self._tier(env, "cluster", "cluster", "--next", router, "--direct", encoder,
                             *(["--cluster-name", "epd"] if self.installs["tiers"].version == "main" else []))
        blocks = ["--block-size", "16"]
        self._start("engine", [str(engine.python), "-m", engine.engine, "--checkpoint", ckpt, "--dtype", "fp32",
                               "--name", MODEL, *ns, *blocks, "--encoder-chain", f"http://{cluster}"], env).wait_for(
            "engine ready", self.timeout_s)
        self.frontend_port = free_port()
        self._start("frontend", [str(front.python), "-m", "mm_encoder.frontend", "--model-dir", ckpt,
                                 "--http-host", "127.0.0.1", "--http-port", str(self.frontend_port), *ns, *blocks,
                                 "--encoder-http", f"http://{cluster}", "--encoder-route", "cluster,shared",
                                 *front.frontend_args, "--max-inflight-media", "8"], env).wait_url(
            f"http://127.0.0.1:{self.frontend_port}/v1/models", self.timeout_s,
            accept=lambda body: MODEL in body.decode())
        return self

    def chat(self) -> tuple[int, dict]:
        """The README's request (the sample image, 20 tokens) with each token's logprob: (status, JSON body)."""
        content = [{"type": "text", "text": QUESTION},
                   {"type": "image_url", "image_url": {"url": data_url(SAMPLE.read_bytes(), "image/jpeg")}}]
        body = {"model": MODEL, "max_tokens": 20, "logprobs": True, "messages": [{"role": "user", "content": content}]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.frontend_port}/v1/chat/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def served_from(self) -> dict[str, float]:
        """The encode worker's successful requests by the level that answered (its /metrics)."""
        with urllib.request.urlopen(f"http://{self.encoder}/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return {line.split('level="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if line.startswith("dynamo_component_encode_served_from_total{")}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in self.procs)

    def stop(self) -> None:
        """Every process by PID, the last started first, then its process group."""
        while self.procs:
            self.procs.pop().stop(grace_s=15)

    def __enter__(self) -> Mixed:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tokens(answer: dict) -> list[str]:
    """The answer's tokens, as its logprobs name them."""
    return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]
