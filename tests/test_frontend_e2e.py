"""The whole graph as real processes on loopback: Dynamo runtime (file discovery + TCP), an encode
worker (`tiny`, HTTP + Dynamo RPC), an nginx cluster tier in front of it, two reference engines
and the frontend. One graph per module (startup is ~10 s); the encoder-stop test runs last.
Nothing is mocked; the LLM has random weights, so only structure and counts are asserted."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from media_factory import image_bytes, natural_image, video_bytes
from nginx_fixtures import dynamo_system_port, free_port, require_nginx

from mm_encoder.core.dynamo import PLANES
from mm_encoder.core.prompt import ChatTokenizer
from mm_encoder.core.registry import get_spec
from mm_encoder.engines.model_dir import make_model_dir

pytest.importorskip("dynamo.llm")
pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it

IMG_A = image_bytes(natural_image(112, 84, seed=1))  # 8 x 6 patches -> 4 x 3 grid of merged tokens
IMG_B = image_bytes(natural_image(112, 84, seed=2))
CONTEXT = 512  # the test LM's context length: small, so overflow and capped generations stay cheap


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Graph:
    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_lines: dict[str, str] = {}
        self.env = {**os.environ, "DYN_FILE_KV": str(root / "kv"), "DYN_TCP_RPC_HOST": "127.0.0.1",
                    "DYN_LOG": "warn", "DYN_SELF_HOST_METADATA": "0"}
        self.model_dir = make_model_dir(root / "tiny-chat", "tiny", name="tiny-chat", context_length=CONTEXT)
        self.worker_port, self.tier_port, self.frontend_port = free_port(), free_port(), free_port()
        self.system_port = dynamo_system_port()

    def start(self, name: str, *args: str, ready: str | None = None, timeout: float = 120,
              env: dict | None = None) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("w")
        proc = subprocess.Popen([sys.executable, *args], env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        self.procs[name] = proc
        if ready:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if ready in line:
                    self.ready_lines[name] = line
                    return proc
                if not line and proc.poll() is not None:
                    break
            raise AssertionError(f"{name} did not start: {(self.root / f'{name}.log').read_text()[-2000:]}")
        return proc

    def stop(self, name: str, sig=signal.SIGTERM) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    require_nginx()
    g = Graph(tmp_path_factory.mktemp("graph"))
    try:
        g.start("worker", "-m", "mm_encoder.worker", "--model", "tiny", "--dynamo", "--http-port", str(g.worker_port),
                ready="worker ready")
        g.start("tier", "-m", "mm_encoder.deploy.cache_tiers", "up", "--tier", "cluster", "--listen",
                f"127.0.0.1:{g.tier_port}", "--next", f"127.0.0.1:{g.worker_port}", "--run-dir",
                str(g.root / "tier"), "--cache-dir", str(g.root / "tier-cache"), "--workers", "1")
        for i in (1, 2):
            g.start(f"engine{i}", "-m", "mm_encoder.engines.reference", "--model-dir", str(g.model_dir),
                    "--encoder-chain", f"http://127.0.0.1:{g.tier_port}", ready="engine ready")
        g.start("frontend", "-m", "mm_encoder.frontend", "--model-dir", str(g.model_dir), "--http-port",
                str(g.frontend_port), "--encoder-http", f"http://127.0.0.1:{g.tier_port}", "--encoder-route",
                "cluster", ready="frontend ready", env={"DYN_SYSTEM_PORT": str(g.system_port)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the frontend serves the model once an engine is discovered
            try:
                if g.get_json(g.url("/v1/models"))["data"]:
                    break
            except (urllib.error.URLError, KeyError, ConnectionError):
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("the frontend never listed the model")
        yield g
    finally:
        for name in list(g.procs)[::-1]:
            g.stop(name, signal.SIGQUIT if name == "tier" else signal.SIGTERM)


def chat(g: Graph, content, *, stream: bool = False, max_tokens: int = 4, timeout: float = 60, **fields):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **fields}
    req = urllib.request.Request(g.url("/v1/chat/completions"), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(raw: str) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def expected_prompt_tokens(g: Graph, text: str, images: list[bytes]) -> int:
    """Independent count: template text tokens + per image its prompt with N = h*w/4 placeholders."""
    tok = ChatTokenizer(g.model_dir)
    spec = get_spec("tiny")
    text_tokens = len(tok.encode(tok.render([{"role": "user", "content": text}])))
    pre, _, post = spec.prompt.image.partition(spec.prompt.placeholder)
    per_image = len(tok.encode(pre)) + len(tok.encode(post))
    n = sum((natural_image_tokens(img)) for img in images)
    return text_tokens + per_image * len(images) + n


def natural_image_tokens(data: bytes) -> int:
    import io

    from PIL import Image

    w, h = Image.open(io.BytesIO(data)).size
    return -(-h // 28) * -(-w // 28)


def test_two_images_one_repeated_then_the_same_request_costs_no_encode(graph):
    content = [{"type": "text", "text": "Compare these:"}, {"type": "image_url", "image_url": {"url": data_url(IMG_A)}},
               {"type": "image_url", "image_url": {"url": data_url(IMG_B)}},
               {"type": "image_url", "image_url": {"url": data_url(IMG_A)}}]
    status, raw = chat(graph, content)
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens"] == expected_prompt_tokens(graph, "Compare these:", [IMG_A, IMG_B, IMG_A])
    forwards = graph.worker_metric("mm_encoder_forward_items_total")
    assert forwards == 2  # A and B; the repeated A is a cache hit
    first = graph.stats()["recent"][-1]

    status, raw = chat(graph, content, stream=True)
    events = sse_events(raw)
    assert status == 200 and events[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert graph.worker_metric("mm_encoder_forward_items_total") == forwards  # zero encodes
    assert graph.stats()["encoder_body_bytes"] == 0  # headers only: the engines fetched the bodies
    again = graph.stats()["recent"][-1]
    assert again["worker_id"] == first["worker_id"] and again["overlap_blocks"] > 0
    assert again["media"] == first["media"] and len(set(first["media"])) == 2


def test_same_text_with_another_image_has_no_false_overlap_on_the_image_blocks(graph):
    text = "Describe this picture in detail please " * 4

    def ask(img: bytes) -> dict:
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(img)}}]
        status, raw = chat(graph, parts)
        assert status == 200, raw
        return graph.stats()["recent"][-1]

    ask(IMG_A)
    warm = ask(IMG_A)
    assert warm["overlap_blocks"] == warm["prompt_tokens"] // 16  # every full block, image blocks included
    other = ask(image_bytes(natural_image(112, 84, seed=3)))
    text_blocks = expected_prompt_tokens(graph, text, []) // 16  # an upper bound on the blocks before the image
    assert other["overlap_blocks"] <= text_blocks < warm["overlap_blocks"]


def test_text_only_never_calls_the_encoder_and_routes_on_tokens(graph):
    calls = graph.stats()["encoder_calls"]
    for _ in range(2):
        status, raw = chat(graph, "hello there, a text only question " * 3)
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
    stats = graph.stats()
    assert stats["encoder_calls"] == calls
    assert stats["recent"][-1]["media"] == [] and stats["recent"][-1]["overlap_blocks"] > 0


def test_overflowing_prompt_is_refused_before_any_engine_work(graph):
    before = graph.stats()
    big = image_bytes(natural_image(672, 672, seed=9))  # 24 x 24 = 576 tokens > the 512 context
    status, _ = chat(graph, [{"type": "image_url", "image_url": {"url": data_url(big)}}])
    after = graph.stats()
    assert status == 400
    assert after["errors"].get("context_length_exceeded", 0) == before["errors"].get("context_length_exceeded", 0) + 1
    assert sum(after["routed"].values()) == sum(before["routed"].values())  # never reached an engine
    # max_tokens is capped to what fits: a prompt asking for the whole context still works
    status, raw = chat(graph, "short", max_tokens=CONTEXT, timeout=300)
    assert status == 200
    usage = json.loads(raw)["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT


def test_bad_image_url_gets_the_encoders_4xx(graph):
    before = graph.stats()["errors"]
    status, _ = chat(graph, [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/x.png"}}])
    assert 400 <= status < 500
    status2, _ = chat(graph, [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40}}])
    assert 400 <= status2 < 500
    errors = graph.stats()["errors"]
    assert errors.get("forbidden_address", 0) == before.get("forbidden_address", 0) + 1
    assert sum(errors.values()) == sum(before.values()) + 2


def test_video_chunks_are_spliced_with_their_timestamps(graph):
    clip = video_bytes(width=112, height=84, frames=40, fps=10)  # 4 s at 2 fps: 2 chunks of 4 frames
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    parts = [{"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": {"url": url}}]
    status, raw = chat(graph, parts)
    assert status == 200, raw
    tok = ChatTokenizer(graph.model_dir)
    spec = get_spec("tiny")
    text = len(tok.encode(tok.render([{"role": "user", "content": "What happens?"}])))
    chunks = sum(len(tok.encode(spec.prompt.video.format(timestamp=ts).replace(spec.prompt.placeholder, "")))
                 for ts in ("00:00:00.000", "00:00:02.000"))
    assert json.loads(raw)["usage"]["prompt_tokens"] == text + chunks + 2 * 12  # 2 chunks x (6 x 8 patches / 4)


def test_sampling_is_honoured_or_refused_by_name(graph):
    """Seeded sampling is reproducible, seeds differ, stop strings end the text, and fields the engine
    cannot honour are refused with a 400 that names them (never silently dropped)."""
    image = {"type": "image_url", "image_url": {"url": data_url(IMG_A)}}

    def text(**fields) -> tuple[str, str]:
        status, raw = chat(graph, [image, {"type": "text", "text": "Tell a story."}], max_tokens=16, **fields)
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    a, b, c = text(temperature=1.0, seed=7), text(temperature=1.0, seed=7), text(temperature=1.0, seed=8)
    assert a == b and a[0] != c[0]
    greedy, _ = text()
    assert len(greedy) > 4
    cut = greedy[len(greedy) // 2 :][:3]
    stopped, finish = text(stop=[cut])
    assert finish == "stop" and stopped == greedy[: greedy.index(cut)]
    for field, value in (("n", 2), ("logprobs", True), ("tools", [{"type": "function",
                                                                     "function": {"name": "f", "parameters": {}}}])):
        status, raw = chat(graph, "hi", **{field: value})
        assert status == 400 and f"`{field}`" in raw, raw


def test_one_url_sent_as_video_then_as_image_is_not_answered_from_the_video_entry(graph):
    """Issue 13, 6: the tiers' key includes the modality; a video cached as `video_url` used to be
    served to `image_url` from the cluster tier (200) where a fresh one gets 4xx."""
    clip = video_bytes(width=112, height=84, frames=20, fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    status, raw = chat(graph, [{"type": "video_url", "video_url": {"url": url}}])
    assert status == 200, raw
    status, raw = chat(graph, [{"type": "image_url", "image_url": {"url": url}}])
    assert 400 <= status < 500, raw


def test_openai_client_with_a_data_url_image(graph):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=graph.url("/v1"), api_key="unused")
    out = client.chat.completions.create(
        model="tiny-chat", max_tokens=3,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": data_url(IMG_B)}}]}],
    )
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 3
    assert out.usage.prompt_tokens == expected_prompt_tokens(graph, "What is this?", [IMG_B])
    stream = client.chat.completions.create(
        model="tiny-chat", max_tokens=3, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG_B)}}]}],
    )
    chunks = list(stream)
    assert chunks and any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_a_stock_dynamo_frontend_in_the_same_namespace_serves_text_and_refuses_media_cleanly(graph):
    """The engines take Dynamo's preprocessed requests too: a stock `python -m dynamo.frontend` that
    discovers them answers text, and media (no Encode worker registered for it) get a 400 saying so."""
    pytest.importorskip("dynamo.frontend")
    port = free_port()
    graph.start("stock", "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                "--namespace", "mm", env=PLANES)  # ours default to these; Dynamo's frontend to etcd
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if graph.get_json(f"{url}/v1/models")["data"]:
                    break
            except (urllib.error.URLError, KeyError, ConnectionError):
                pass
            assert time.monotonic() < deadline, (graph.root / "stock.log").read_text()[-2000:]
            time.sleep(0.1)

        def ask(content):
            body = {"model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": content}]}
            req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        status, out = ask("a text question")
        assert status == 200 and out["usage"]["completion_tokens"] == 3
        status, out = ask([{"type": "image_url", "image_url": {"url": data_url(IMG_A)}}])
        assert status == 400 and "no encoder_result" in out["message"], out
    finally:
        graph.stop("stock")


def test_a_10_mb_prompt_is_refused_at_once_and_blocks_no_one(graph):
    """Issue 13, 7: the prompt is measured before it is tokenized (on the event loop it took 9-12 s
    and stalled every other client)."""
    import threading

    results: dict[str, tuple] = {}

    def big():
        t0 = time.monotonic()
        results["big"] = (*chat(graph, "x" * (10 << 20), timeout=60), time.monotonic() - t0)

    thread = threading.Thread(target=big)
    thread.start()
    t0 = time.monotonic()
    status, _ = chat(graph, "a small question")
    small_s = time.monotonic() - t0
    thread.join(60)
    big_status, big_body, big_s = results["big"]
    assert big_status == 400 and "context_length_exceeded" in big_body, big_body
    assert status == 200 and small_s < 5 and big_s < 5


def test_a_compressed_body_is_not_inflated_by_the_frontend(graph):
    """Beyond issue 13: a gzip body that inflates to 300 MB. Dynamo's HTTP server does not inflate
    request bodies, so it is a clean 400 (not JSON) and costs nothing."""
    import gzip

    bomb = gzip.compress(b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "' + b"a" * 300_000_000
                         + b'"}]}', 6)
    req = urllib.request.Request(graph.url("/v1/chat/completions"), data=bomb, headers={
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "deserialize the JSON body" in json.loads(e.value.read())["message"]
    assert chat(graph, "still fine?")[0] == 200


def test_an_engine_killed_mid_stream_gives_a_5xx_and_later_requests_work(graph):
    """Issue 13, 8: the client used to get "Invalid request" (400), and a follow-up a 500."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", graph.frontend_port, timeout=60)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "tell"}], "max_tokens": 480,
            "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")  # the first chunk: routed and generating
    worker = graph.stats()["recent"][-1]["worker_id"]
    name = next(n for n in ("engine1", "engine2") if graph.ready_lines[n].split("instance=")[1].strip() == str(worker))
    graph.procs[name].kill()
    rest = resp.read().decode()
    conn.close()
    errors = [e for e in sse_events(rest) if "error" in e]
    assert errors and errors[-1]["error"]["code"] >= 500, rest[-500:]
    for _ in range(3):  # the survivor serves every later request
        status, raw = chat(graph, "after the engine died")
        assert status == 200, raw
    graph.procs.pop(name).wait(10)


def test_stopping_the_encoder_fails_media_fast_and_text_still_works(graph):
    """Last in the module: it stops the encode worker (and the tier's upstream with it)."""
    graph.stop("worker")
    img = image_bytes(natural_image(112, 84, seed=77))  # not cached anywhere
    t0 = time.monotonic()
    status, body = chat(graph, [{"type": "image_url", "image_url": {"url": data_url(img)}}], timeout=30)
    assert status == 503 and time.monotonic() - t0 < 10, body
    assert "Internal server error" not in body  # issue 13, 10: a 503 reads as one
    assert graph.stats()["encoder_fallbacks"] >= 1  # the chain failed; direct RPC had no worker
    with urllib.request.urlopen(f"http://127.0.0.1:{graph.system_port}/metrics", timeout=30) as r:
        metrics = r.read().decode()  # the processor's counters on Dynamo's own /metrics
    assert 'mm_frontend_encoder_fallbacks_total{model="tiny-chat"}' in metrics
    assert "mm_frontend_errors_total" in metrics and "dynamo_" in metrics
    status, _ = chat(graph, "text still works")
    assert status == 200
