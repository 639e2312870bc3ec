"""The whole graph as real processes on loopback: Dynamo runtime (file discovery + TCP), an encode
worker (the checkpoint's vision tower, HTTP + Dynamo RPC), an nginx cluster tier in front of it,
two engines (the checkpoint's DeepseekV3 language model through transformers) and the frontend,
all reading one tiny random Kimi-K2.5 checkpoint whose context is cut to 512 (so overflow and
capped generations stay cheap). One graph per module; the encoder-stop test runs last. Nothing is
mocked; the weights are random, so structure and counts are asserted, and text only where it must
repeat. Expected prompt sizes are computed independently (`serve_fixtures.PromptCount`)."""

from __future__ import annotations

import base64
import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from harness.media_factory import image_bytes, natural_image, sampled_video_chunks, video_bytes
from harness.serve_fixtures import MODEL, Graph, checkpoint_copy, data_url, image_rows
from harness.topology import free_port, require_nginx
from mm_encoder.runtime.dynamo import PLANES

pytest.importorskip("dynamo.llm")
pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it

IMG_A = image_bytes(natural_image(112, 84, seed=1))  # 8 x 6 patches -> 4 x 3 grid of merged rows
IMG_B = image_bytes(natural_image(112, 84, seed=2))
CONTEXT = 512  # the checkpoint copy's text_config.max_position_embeddings


@pytest.fixture(scope="module")
def graph(tmp_path_factory, checkpoint):
    require_nginx()
    g = Graph(tmp_path_factory.mktemp("graph"), checkpoint_copy(checkpoint, tmp_path_factory.mktemp("model"), CONTEXT))
    ckpt = str(g.checkpoint)
    try:
        g.worker("--dtype", "fp32", "--dynamo")
        g.tier()
        for i in (1, 2):
            g.start(f"engine{i}", "-m", "mm_encoder.engines", "--checkpoint", ckpt, "--dtype", "fp32",
                    "--encoder-chain", f"http://127.0.0.1:{g.tier_port}", ready="engine ready")
        frontend = g.start("frontend", "-m", "mm_encoder.frontend", "--model-dir", ckpt, "--http-port",
                           str(g.frontend_port), "--encoder-http", f"http://127.0.0.1:{g.tier_port}",
                           "--encoder-route", "cluster", ready="frontend ready",
                           env={"DYN_SYSTEM_PORT": str(g.system_port)})
        # the frontend serves the model once an engine is discovered
        frontend.wait_url(g.url("/v1/models"), 60, lambda body: [m["id"] for m in json.loads(body)["data"]] == [MODEL])
        yield g
    finally:
        g.stop_all()


def chat(g: Graph, content, *, stream: bool = False, max_tokens: int = 4, timeout: float = 60, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
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


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def test_two_images_one_repeated_then_the_same_request_costs_no_encode(graph):
    """Three image parts (A, B, A): the prompt is the template with each placeholder expanded to its
    image's rows; A is encoded once, and the repeated request (streamed) encodes nothing, carries
    no body through the frontend and is routed to the engine holding its blocks."""
    content = [{"type": "text", "text": "Compare these:"}, image_part(IMG_A), image_part(IMG_B), image_part(IMG_A)]
    status, raw = chat(graph, content)
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens"] == graph.count(content, [image_rows(IMG_A), image_rows(IMG_B), image_rows(IMG_A)])
    forwards = graph.worker_metric("dynamo_component_encode_forward_items_total")
    assert forwards == 2  # A and B; the repeated A is a cache hit
    first = graph.stats()["recent"][-1]

    status, raw = chat(graph, content, stream=True)
    events = sse_events(raw)
    assert status == 200 and events[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert graph.worker_metric("dynamo_component_encode_forward_items_total") == forwards  # zero encodes
    assert graph.stats()["encoder_body_bytes"] == 0  # headers only: the engines fetched the bodies
    again = graph.stats()["recent"][-1]
    assert again["worker_id"] == first["worker_id"] and again["overlap_blocks"] > 0
    assert again["media"] == first["media"] and len(set(first["media"])) == 2


def test_a_repeated_image_request_reuses_the_engines_prompt_kv(graph):
    """The repeat of a request goes to the engine that prefilled it, which takes every full block of
    the prompt but the one holding the last token from its prefix store (reported in /mm/stats)."""
    img = image_bytes(natural_image(224, 140, seed=21))  # 16 x 10 patches -> 40 rows
    content = [{"type": "text", "text": "Describe the picture."}, image_part(img)]
    prompt = graph.count(content, [image_rows(img)])
    assert image_rows(img) == 40 and prompt > 32
    runs = []
    for _ in range(2):
        status, raw = chat(graph, content)
        assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == prompt, raw
        runs.append(graph.stats()["recent"][-1])
    assert runs[0]["timings"]["reused_tokens"] == 0  # a new image: nothing of it was held anywhere
    assert runs[1]["worker_id"] == runs[0]["worker_id"]
    assert runs[1]["timings"]["reused_tokens"] == (prompt - 1) // 16 * 16 > 0


def test_logprobs_come_back_in_openais_shape_streamed_and_not(graph):
    """logprobs with top_logprobs 2: `choices[0].logprobs.content` has one entry per generated token
    with its text, bytes, logprob and 2 alternatives, best first; greedy, the chosen token is the
    best. Streamed, each chunk carries its own token's entry; both ways give the same numbers."""
    content = [image_part(IMG_A), {"type": "text", "text": "Tell a story."}]
    status, raw = chat(graph, content, max_tokens=6, logprobs=True, top_logprobs=2, ignore_eos=True)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    whole = choice["logprobs"]["content"]
    assert len(whole) == 6
    # each token's own bytes (random weights pick stray pieces of characters too): together, the answer
    assert b"".join(bytes(t["bytes"]) for t in whole).decode("utf-8", "replace") == choice["message"]["content"]
    for t in whole:
        assert set(t) == {"token", "logprob", "bytes", "top_logprobs"} and t["logprob"] <= 0
        assert t["token"] == bytes(t["bytes"]).decode("utf-8", "replace")
        assert len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"]
        assert t["logprob"] == pytest.approx(t["top_logprobs"][0]["logprob"])
        assert t["token"] == t["top_logprobs"][0]["token"]
    status, raw = chat(graph, content, max_tokens=6, logprobs=True, top_logprobs=2, ignore_eos=True, stream=True)
    assert status == 200, raw
    streamed = [t for e in sse_events(raw) for c in e["choices"] if c.get("logprobs")
                for t in c["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == [t["token"] for t in whole]
    assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in whole], abs=1e-4)
    assert all(len(t["top_logprobs"]) == 2 for t in streamed)
    status, raw = chat(graph, "hi", max_tokens=2)  # without logprobs, none are sent
    assert status == 200 and json.loads(raw)["choices"][0].get("logprobs") is None, raw


def test_same_text_with_another_image_has_no_false_overlap_on_the_image_blocks(graph):
    """Blocks are hashed with their media: the same text with another image overlaps at most on the
    blocks before the image, where the same image overlaps on every full block."""
    text = "Describe this picture in detail please " * 4

    def ask(img: bytes) -> dict:
        status, raw = chat(graph, [{"type": "text", "text": text}, image_part(img)])
        assert status == 200, raw
        return graph.stats()["recent"][-1]

    ask(IMG_A)
    warm = ask(IMG_A)
    assert warm["overlap_blocks"] == warm["prompt_tokens"] // 16  # every full block, image blocks included
    other = ask(image_bytes(natural_image(112, 84, seed=3)))
    text_blocks = graph.count([{"type": "text", "text": text}], []) // 16  # a bound on the blocks before the image
    assert other["overlap_blocks"] <= text_blocks < warm["overlap_blocks"]


def test_text_only_never_calls_the_encoder_and_routes_on_tokens(graph):
    """Text only: the exact usage, no encoder call, and the repeat overlaps on its token blocks."""
    calls = graph.stats()["encoder_calls"]
    for _ in range(2):
        content = "hello there, a text only question " * 3
        status, raw = chat(graph, content)
        assert status == 200 and json.loads(raw)["usage"] == {
            "prompt_tokens": graph.count(content, []), "completion_tokens": 4,
            "total_tokens": graph.count(content, []) + 4}
    stats = graph.stats()
    assert stats["encoder_calls"] == calls
    assert stats["recent"][-1]["media"] == [] and stats["recent"][-1]["overlap_blocks"] > 0


def test_overflowing_prompt_is_refused_before_any_engine_work(graph):
    """The context comes from the checkpoint's config.json (512 here): a 576-row image is refused
    before routing; max_tokens asking for the whole context is capped to what fits."""
    before = graph.stats()
    big = image_bytes(natural_image(672, 672, seed=9))
    assert image_rows(big) == 24 * 24 > CONTEXT
    status, body = chat(graph, [image_part(big)])
    after = graph.stats()
    assert status == 400 and str(CONTEXT) in body, body
    assert after["errors"].get("context_length_exceeded", 0) == before["errors"].get("context_length_exceeded", 0) + 1
    assert sum(after["routed"].values()) == sum(before["routed"].values())  # never reached an engine
    status, raw = chat(graph, "short", max_tokens=CONTEXT, timeout=300, ignore_eos=True)
    assert status == 200
    usage = json.loads(raw)["usage"]
    assert usage["prompt_tokens"] == graph.count("short", [])
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT  # ignore_eos: it fills the context


def test_bad_image_url_gets_the_encoders_4xx(graph):
    """A link-local URL and undecodable bytes: the encoder's 4xx reaches the client, counted by code."""
    before = graph.stats()["errors"]
    status, _ = chat(graph, [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/x.png"}}])
    assert 400 <= status < 500
    status2, _ = chat(graph, [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40}}])
    assert 400 <= status2 < 500
    errors = graph.stats()["errors"]
    assert errors.get("forbidden_address", 0) == before.get("forbidden_address", 0) + 1
    assert sum(errors.values()) == sum(before.values()) + 2


def test_video_chunks_are_spliced_with_their_timestamps(graph):
    """4 s at 10 fps, 2 fps sampled: two chunks of 4 frames of 12 rows, each its chunk prompt with
    its first frame's time; 5 s: 10 frames, the last chunk keeps its 2 real frames (same rows)."""
    for frames, stamps in ((40, ["00:00:00.000", "00:00:02.200"]),
                           (50, ["00:00:00.000", "00:00:02.200", "00:00:04.400"])):
        clip = video_bytes(width=112, height=84, frames=frames, fps=10)
        content = [{"type": "text", "text": "What happens?"},
                   {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}]
        chunks = sampled_video_chunks(frames, 10, rows=12)
        assert [ts for ts, _ in chunks] == stamps
        status, raw = chat(graph, content)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] == graph.count(content, [chunks])


def test_sampling_is_honoured_or_refused_by_name(graph):
    """Seeded sampling is reproducible, seeds differ, stop strings end the text, and fields the engine
    cannot honour are refused with a 400 that names them (never silently dropped)."""
    image = image_part(IMG_A)

    def text(**fields) -> tuple[str, str]:
        status, raw = chat(graph, [image, {"type": "text", "text": "Tell a story."}], max_tokens=16, **fields)
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    a, b, c = text(temperature=1.0, seed=7), text(temperature=1.0, seed=7), text(temperature=1.0, seed=8)
    assert a == b and a != c
    greedy, _ = text(ignore_eos=True)
    assert len(greedy) > 4
    cut = greedy[len(greedy) // 2 :][:3]
    stopped, finish = text(stop=[cut], ignore_eos=True)
    assert finish == "stop" and stopped == greedy[: greedy.index(cut)]
    for field, value in (("n", 2), ("logit_bias", {"5": 10}), ("prompt_logprobs", 1),
                         ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}])):
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
    """The official client, plain and streamed with usage: the same exact prompt count."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=graph.url("/v1"), api_key="unused")
    content = [{"type": "text", "text": "What is this?"}, image_part(IMG_B)]
    out = client.chat.completions.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": content}])
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 3
    assert out.usage.prompt_tokens == graph.count(content, [image_rows(IMG_B)])
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=3, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG_B)}}]}],
    )
    chunks = list(stream)
    assert chunks and any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert chunks[-1].usage.prompt_tokens == graph.count([image_part(IMG_B)], [image_rows(IMG_B)])


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
            body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": content}]}
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

    bomb = gzip.compress(b'{"model": "kimi-k2.5-tiny", "messages": [{"role": "user", "content": "' + b"a" * 300_000_000
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
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell"}], "max_tokens": 480,
            "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")  # the first chunk: routed and generating
    in_flight = graph.stats()["in_flight"]  # this request, routed and answering (`recent` lists ended ones)
    assert len(in_flight) == 1 and in_flight[0]["prompt_tokens"] > 0
    worker = in_flight[0]["worker_id"]
    name = next(n for n in ("engine1", "engine2") if graph.instance(n) == str(worker))
    graph.procs[name].kill()
    rest = resp.read().decode()
    conn.close()
    errors = [e for e in sse_events(rest) if "error" in e]
    assert errors and errors[-1]["error"]["code"] >= 500, rest[-500:]
    for _ in range(3):  # the survivor serves every later request
        status, raw = chat(graph, "after the engine died")
        assert status == 200, raw
    graph.stop(name, signal.SIGKILL)


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
    assert 'dynamo_frontend_multimodal_encoder_fallbacks_total{model="kimi-k2.5-tiny"}' in metrics
    assert "dynamo_frontend_multimodal_errors_total" in metrics
    assert "dynamo_" in metrics.replace("dynamo_frontend_multimodal_", "")  # beside Dynamo's own
    status, _ = chat(graph, "text still works")
    assert status == 200
