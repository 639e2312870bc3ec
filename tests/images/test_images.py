"""The release's images, run: `make images` builds them without a container daemon (tools/images.sh:
rootful podman, a Debian base from Debian's archive), then runs this module with
MM_ENCODER_IMAGE_TESTS=1. Elsewhere (`make test`) it is skipped: the builds take many minutes.

- The CPU image (docker/Dockerfile.cpu) runs its default command, the encode worker, on a generated tiny
  checkpoint mounted read-only, as the image's user (uid 101): /health, /ready, and one encode of the
  sample photo, whose embeddings are the ones this checkout computes.
- The vLLM engine's image (docker/Dockerfile.vllm) runs `python -m mm_encoder.engines.vllm` on a generated
  `vllm-tiny` checkpoint: its Dynamo system server answers /health once the engine registered, and this
  checkout's frontend, on the host, finds it through Dynamo's file discovery (a directory both mount) and
  has it generate.

Every container runs attached (`podman run --rm --name ...`, its output read here), on the host's network
(loopback ports picked here), and is stopped by its name with `podman rm -f`, whatever the test's outcome.
Readiness: a line or a URL, polled with a deadline."""

from __future__ import annotations

import base64
import json
import os
import shlex
import stat
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import mm_encoder
from harness.processes import Process
from harness.topology import dynamo_system_port, free_port

pytestmark = pytest.mark.skipif(
    os.environ.get("MM_ENCODER_IMAGE_TESTS") != "1",
    reason="the images' own tests: `make images` builds the images and runs them (MM_ENCODER_IMAGE_TESTS=1)")

REPO = Path(__file__).resolve().parents[2]
VERSION = mm_encoder.__version__
CPU_IMAGE = os.environ.get("CPU_IMAGE", f"mm-encoder:{VERSION}-cpu")
VLLM_IMAGE = os.environ.get("VLLM_IMAGE", f"mm-encoder-vllm:{VERSION}-cpu")
SAMPLE = REPO / "mm_encoder" / "samples" / "sample.jpg"
MODEL_DIR = "/models/model"
START_S = 300  # a cold start of vLLM on two cores takes minutes


def _podman_args() -> list[str]:
    out = subprocess.run([str(REPO / "tools" / "images.sh"), "podman-args"], check=True, capture_output=True, text=True)
    return shlex.split(out.stdout)


def _readable(path: Path) -> Path:
    """Readable (directories also writable) by the image's user, uid 101: pytest's tmp_path is root's, 0700."""
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH | stat.S_IWOTH if p.is_dir() else 0))
    for parent in path.parents:  # the way in
        if parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | stat.S_IXOTH)
    return path


def _checkpoint(dir: Path, preset: str) -> Path:
    subprocess.run([sys.executable, "-m", "mm_encoder.engines.tiny_checkpoint", str(dir), "--preset", preset],
                   check=True, capture_output=True)
    return _readable(dir)


@contextmanager
def container(image: str, *args: str, podman: tuple[str, ...] = (), name: str = "") -> Iterator[Process]:
    """`podman run` of `image` with `args`, attached; removed by its name on the way out."""
    cname = f"mm-images-test-{name}-{uuid.uuid4().hex[:8]}"
    argv = ["podman", "run", "--rm", "--name", cname, *_podman_args(), *podman, image, *args]
    proc = Process(argv, name=cname)
    try:
        yield proc
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "10", cname], capture_output=True)
        proc.stop(grace_s=60)  # `podman run` itself, once its container is gone


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200, url
        return r.read()


def _post(url: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, dict(r.headers), r.read()


@pytest.mark.parametrize("image", [CPU_IMAGE, VLLM_IMAGE])
def test_the_build_left_no_package_source_of_this_host_in_the_image(image):
    """The build's pip.conf and package directories were bind mounts: pip in the image has no configuration
    (what is left are their empty mount points), and the image runs as uid 101."""
    out = subprocess.run(["podman", "run", "--rm", *_podman_args(), "--entrypoint", "sh", image, "-c",
                          "id -u; python -m pip config list; cat /etc/pip.conf; ls -A /opt/wheels /opt/pypi"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert out.split() == ["101", "/opt/pypi:", "/opt/wheels:"] or out.split() == ["101"], out


def test_the_cpu_image_runs_the_encode_worker_and_encodes(tmp_path):
    from mm_encoder import Encoder, wire

    checkpoint = _checkpoint(tmp_path / "tiny", "tiny")
    port = free_port()
    with container(CPU_IMAGE, "--model", MODEL_DIR, "--dtype", "fp32", "--http-host", "127.0.0.1",
                   "--http-port", str(port), podman=("--volume", f"{checkpoint}:{MODEL_DIR}:ro"), name="worker") as w:
        base = f"http://127.0.0.1:{port}"
        w.wait_url(f"{base}/health", START_S)
        w.wait_url(f"{base}/ready", START_S)
        (model,) = json.loads(_get(f"{base}/v1/models"))["data"]
        data = SAMPLE.read_bytes()
        status, headers, body = _post(f"{base}/v1/encode", {
            "model": model["id"], "url": "data:image/jpeg;base64," + base64.b64encode(data).decode()})
    assert status == 200 and headers["Content-Type"] == wire.CONTENT_TYPE
    msg = wire.decode(body)
    direct = Encoder.from_pretrained(str(checkpoint), dtype="fp32").encode([data])[0]
    assert msg.mm_hash == headers["X-MM-Hash"] == direct.mm_hash
    assert msg.shape == (direct.num_tokens, direct.embeds.shape[-1]) and direct.num_tokens > 0
    assert (msg.embeds.float() - direct.embeds.float()).abs().max().item() < 1e-4


VLLM_NAME = "kimi-k2.5-vllm-tiny"
VLLM_ENV = {  # graphs/epd-vllm.yaml's engine env, Dynamo's on loopback
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "DYN_DISCOVERY_BACKEND": "file", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SELF_HOST_METADATA": "0",
    "DYN_LOG": "warn",
    # what the Dynamo operator sets on a worker: its /health follows the engine's `generate` endpoint
    "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
}


def test_the_vllm_image_runs_the_engine_which_answers_health_and_generates(tmp_path):
    from harness.serve_fixtures import chat

    checkpoint = _checkpoint(tmp_path / "vllm-tiny", "vllm-tiny")
    kv = tmp_path / "kv"  # Dynamo's file discovery, shared with the frontend on the host
    kv.mkdir()
    _readable(kv)
    system, frontend_port, ns = dynamo_system_port(), free_port(), f"images{uuid.uuid4().hex[:6]}"
    env = {**VLLM_ENV, "DYN_FILE_KV": str(kv), "DYN_SYSTEM_PORT": str(system)}
    # The checkpoint at the same path in the container as here: the engine registers its model by that path,
    # and the frontend reads the model's card from it (in Kubernetes every pod mounts it at /models/model).
    # vLLM's engine core takes its message queues from /dev/shm (160 MiB here; podman's default is 64 MiB).
    podman = ["--volume", f"{checkpoint}:{checkpoint}:ro", "--volume", f"{kv}:{kv}", "--shm-size", "1g"]
    for k, v in env.items():
        podman += ["--env", f"{k}={v}"]
    with container(VLLM_IMAGE, "--model", str(checkpoint), "--name", VLLM_NAME, "--namespace", ns, "--block-size", "32",
                   "--dtype", "float32", "--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", "8",
                   podman=tuple(podman), name="vllm") as engine:
        engine.wait_for("engine ready", START_S)
        engine.wait_url(f"http://127.0.0.1:{system}/health", 60)  # Dynamo's system server: 200 once healthy
        health = json.loads(_get(f"http://127.0.0.1:{system}/health"))
        assert health["status"] in ("ready", "healthy"), health
        frontend_env = {**os.environ, **{k: v for k, v in env.items() if k != "DYN_SYSTEM_PORT"}}
        with Process([sys.executable, "-m", "mm_encoder.frontend", "--model-dir", str(checkpoint),
                      "--http-host", "127.0.0.1", "--http-port", str(frontend_port), "--namespace", ns,
                      "--block-size", "32"], name="frontend", env=frontend_env) as frontend:
            frontend.wait_url(f"http://127.0.0.1:{frontend_port}/v1/models", 120,
                              accept=lambda body: VLLM_NAME.encode() in body)
            answer = chat(frontend_port, [{"type": "text", "text": "Say something."}], model=VLLM_NAME, max_tokens=8)
    assert answer["usage"]["completion_tokens"] > 0, answer
    assert answer["choices"][0]["message"]["content"], answer
