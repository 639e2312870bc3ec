"""`mm-encoder serve` in a subprocess for the tests that run whole graphs, the request they send,
and prompt sizes computed independently of the code under test.

Every graph serves one checkpoint: the tiny random Kimi-K2.5 (`engines.tiny_checkpoint`), served
as `kimi-k2.5-tiny`. Expected prompt sizes come from transformers' own tokenizer and chat-template
rendering over the checkpoint's files, and from the image's size under the K2.5 resize policy
(`media_factory.k25_image_tokens`): never from the frontend, the engine or the encoder."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import ssl
import sys
import urllib.request
from pathlib import Path

from harness.media_factory import k25_image_tokens
from harness.processes import Process
from harness.topology import TierProcess, WorkerProcess, dynamo_system_port, free_port, start_tier, start_worker
from mm_encoder.runtime.procfs import leftover_pids

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "mm_encoder" / "samples" / "sample.jpg"
MODEL = "kimi-k2.5-tiny"  # the generated checkpoint's directory name: the served model name
QUESTION = "What is in this image?"
IMAGE_PAD, VIDEO_PAD = "<|media_pad|>", "<|kimi_k25_video_placeholder|>"
CHUNK_PROMPT = "{}<|media_begin|>video<|media_content|>{}<|media_end|>"  # Kimi-K2.5's processor, per chunk


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def sample_content() -> list[dict]:
    return [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_url(
        SAMPLE.read_bytes(), "image/jpeg")}}]


def chat(port: int, content=None, *, ca: str | None = None, **fields) -> dict:
    """The README's request (the sample photo and its question) or `content`; a 200 or HTTPError.
    With `ca` (a `serve --tls` graph's CA file), over HTTPS."""
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": content or sample_content()}],
            **fields}
    req = urllib.request.Request(f"{'https' if ca else 'http'}://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    context = ssl.create_default_context(cafile=ca) if ca else None
    with urllib.request.urlopen(req, timeout=120, context=context) as r:
        assert r.status == 200
        return json.loads(r.read())


def chat_stream(port: int, content, **fields) -> dict:
    """`chat`, streamed (SSE, usage included), put back together in the non-streamed answer's shape:
    the text joined, every chunk's logprobs entries in order, the usage of the last chunk."""
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": content}], **fields,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, entries, usage = [], [], None
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event.get("choices") or []:
                text.append(c.get("delta", {}).get("content") or "")
                entries += (c.get("logprobs") or {}).get("content") or []
    return {"choices": [{"message": {"content": "".join(text)}, "logprobs": {"content": entries}}], "usage": usage}


def frontend_stats(port: int) -> dict:
    """The frontend's processor stats (GET /mm/stats): counters and the recent routing decisions."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/mm/stats", timeout=30) as r:
        return json.loads(r.read())["processors"][0]


def image_rows(data: bytes) -> int:
    """An encoded image's rows from its size alone (K2.5 policy)."""
    from PIL import Image

    return k25_image_tokens(*Image.open(io.BytesIO(data)).size)


class PromptCount:
    """Expected prompt tokens for a checkpoint, computed with transformers (its tokenizer and its
    own chat-template rendering), not with this project's `ChatTokenizer` or `Splicer`."""

    def __init__(self, checkpoint: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(checkpoint))

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def render(self, content) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                            add_generation_prompt=True)

    def __call__(self, content, media: list, stock: bool = False) -> int:
        """`media`, in order: an image's rows (int) or a video's chunks [(timestamp, rows)]. The
        template writes one placeholder per image (expanded to its rows) and one per video
        (replaced by each chunk's prompt with its rows, as Kimi-K2.5's processor does). Our
        frontend tokenizes the expanded text whole; with `stock`, Dynamo's frontend tokenized the
        template and the engine each chunk prompt on its own."""
        text = self.render(content)
        images = iter(m for m in media if isinstance(m, int))
        videos = [m for m in media if not isinstance(m, int)]
        pieces = text.split(IMAGE_PAD)
        text = pieces[0] + "".join(IMAGE_PAD * next(images) + p for p in pieces[1:])
        pieces = text.split(VIDEO_PAD)
        assert len(pieces) == len(videos) + 1 and next(images, None) is None, (text, media)
        chunks = [[CHUNK_PROMPT.format(ts, VIDEO_PAD * rows) for ts, rows in v] for v in videos]
        if not stock:
            return len(self.ids(pieces[0] + "".join("".join(c) + p for c, p in zip(chunks, pieces[1:], strict=True))))
        return len(self.ids(VIDEO_PAD.join(pieces))) - len(videos) + sum(len(self.ids(c)) for v in chunks for c in v)


def sample_tokens(checkpoint: Path) -> int:
    """The README request's prompt tokens: 1196 image rows (1280x720) + the template and question."""
    return PromptCount(checkpoint)([{"type": "text", "text": QUESTION}, {"type": "image_url"}],
                                   [image_rows(SAMPLE.read_bytes())])


def checkpoint_copy(src: Path, parent: Path, context: int) -> Path:
    """`src` under `parent` with the same directory name (the served name), its weights linked and
    its config.json's context (`text_config.max_position_embeddings`) set to `context`: what the
    frontend and engines read it from. Small, so overflowing and capped generations stay cheap."""
    dst = parent / src.name
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json":
            config = json.loads(f.read_text())
            config["text_config"]["max_position_embeddings"] = context
            (dst / f.name).write_text(json.dumps(config, indent=2))
        elif f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f.resolve())
        else:
            shutil.copy(f, dst / f.name)
    return dst


class Served:
    """`mm-encoder serve` (GraphRunner) as one `Process`: the one launcher of whole graphs."""

    def __init__(self, graph: str, run_dir: Path, port: int, *extra: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None, cwd: Path | None = None, unset: tuple[str, ...] = ()):
        """`graph`: a path under the repository (or an absolute one); `env` added to this process's, less
        `unset`; with `command` (another install's `mm-encoder`), whatever that command takes (a shipped
        graph's name), run from `cwd` with exactly `env`."""
        self.run_dir = run_dir
        self.port = port
        argv = [*command, "serve", graph] if command else [sys.executable, "-m", "mm_encoder.cli", "serve",
                                                           str(ROOT / graph)]
        if not command:
            env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
        self.proc = Process([*argv, "--run-dir", str(run_dir), "--port", str(port), "--status-interval", "0", *extra],
                            name=f"mm-encoder serve {graph}", env=env, cwd=cwd)

    @property
    def text(self) -> str:
        return self.proc.text

    @property
    def state(self) -> dict:
        return json.loads((self.run_dir / "state.json").read_text())

    def component(self, name: str) -> dict:
        return next(c for c in self.state["components"] if c["name"] == name)

    def wait_for(self, needle: str, timeout: float) -> str:
        self.proc.wait_for(needle, timeout)
        return self.text

    def stop(self, check: bool = True) -> str:
        """SIGTERM to serve; it exits 0 having stopped every process of every session it started
        (`check`: asserted; without, it is stopped all the same)."""
        groups = {c["pid"] for c in self.state["components"]} if (self.run_dir / "state.json").is_file() else set()
        rc = self.proc.stop(signal.SIGTERM, grace_s=120)  # serve itself hung: its session goes, so none is left
        if check:
            assert rc == 0, self.text
            assert "no processes left" in self.text, self.text
            assert leftover_pids(groups) == []
        return self.text

    def __enter__(self) -> Served:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        """Stopped; checked unless an error is already on its way out."""
        self.stop(check=exc_type is None)


@contextlib.contextmanager
def serving(graphs: dict[str, str], tmp_path_factory, *extra: str, timeout: float = 300):
    """Each graph (name -> YAML path) under `mm-encoder serve ... *extra` on its own free port, all
    started at once and ready; every one stopped at the end. Yields name -> port."""
    served: dict[str, Served] = {}
    try:
        for name, graph in graphs.items():
            served[name] = Served(graph, tmp_path_factory.mktemp(name), free_port(), *extra)
        for s in served.values():
            s.wait_for("ready: OpenAI base URL", timeout)
        yield {name: s.port for name, s in served.items()}
    finally:
        for s in served.values():
            s.stop()


class Graph:
    """Components started one by one (test_frontend_e2e): the encode worker and its cache tier through
    `topology` (`worker`, `tier`), the others as a `Process` ready when it prints its ready line
    (`start`); each stopped by PID and then its process group."""

    def __init__(self, root: Path, checkpoint: Path):
        self.root, self.checkpoint = root, checkpoint
        self.procs: dict[str, Process | WorkerProcess | TierProcess] = {}
        self.ready_lines: dict[str, str] = {}
        self.env = {**os.environ, "DYN_FILE_KV": str(root / "kv"), "DYN_TCP_RPC_HOST": "127.0.0.1",
                    "DYN_LOG": "warn", "DYN_SELF_HOST_METADATA": "0"}
        self.count = PromptCount(checkpoint)
        self.worker_port = self.tier_port = 0  # known once started
        self.frontend_port = free_port()
        self.system_port = dynamo_system_port()

    def worker(self, *args: str, timeout: float = 120) -> WorkerProcess:
        """The encode worker on the checkpoint (`start_worker`), on this graph's Dynamo runtime."""
        w = start_worker(*args, model=str(self.checkpoint), env=self.env, log=self.root / "worker.log",
                         timeout=timeout)
        self.procs["worker"], self.ready_lines["worker"], self.worker_port = w, w.ready_line, w.http_port
        return w

    def tier(self, *args: str) -> TierProcess:
        """The cluster tier in front of the worker (`start_tier`), once healthy."""
        t = start_tier(self.root, "tier", "cluster", "--next", f"127.0.0.1:{self.worker_port}", *args, env=self.env)
        self.procs["tier"], self.tier_port = t, t.port
        return t

    def start(self, name: str, *args: str, ready: str | None = None, timeout: float = 120,
              env: dict | None = None) -> Process:
        proc = Process([sys.executable, *args], name=name, env={**self.env, **(env or {})},
                       log=self.root / f"{name}.log")
        self.procs[name] = proc
        if ready:
            self.ready_lines[name] = proc.wait_for(ready, timeout)
        return proc

    def stop(self, name: str, sig: int | None = None) -> None:
        """The process by PID (`sig`, default SIGTERM); then its process group (its own session), so
        nothing it started stays."""
        proc = self.procs.pop(name, None)
        if proc is not None and sig is None:
            proc.stop()
        elif proc is not None:
            proc.stop(sig)

    def stop_all(self) -> None:
        """Every process, the last started first."""
        for name in list(self.procs)[::-1]:
            self.stop(name)

    def instance(self, name: str) -> str:
        """An engine's Dynamo instance id, from its ready line (`... instance=<id> inline=False`)."""
        return self.ready_lines[name].split("instance=")[1].split()[0]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.frontend_port}{path}"

    def get_json(self, url: str) -> dict:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    def stats(self) -> dict:
        return self.get_json(self.url("/mm/stats"))["processors"][0]

    def worker_metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.worker_port}/metrics", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0
