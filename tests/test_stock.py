"""Dynamo's own frontend serving mm-encoder: `mm-encoder serve graphs/epd-stock.yaml --checkpoint DIR`
runs the stock `python -m dynamo.frontend` (ai-dynamo 1.6.1), our encode worker registered as its
Encode worker, the nginx tiers and two engines (the checkpoint's language model) taking Dynamo's
preprocessed requests, all on one tiny Kimi-K2.5 checkpoint whose context is cut to 4096 (so an
overflow costs one 4K photo). The client is the official `openai` package. Nothing is mocked; the
weights are random, so structure and counts are asserted, and text only where it must repeat."""

from __future__ import annotations

import io
import json
import urllib.request

import pytest

from harness.media_factory import sampled_video_chunks, video_bytes
from harness.serve_fixtures import MODEL, QUESTION, SAMPLE, PromptCount, Served, checkpoint_copy, data_url, image_rows
from harness.topology import free_port, require_nginx

pytest.importorskip("dynamo.frontend")
pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
openai = pytest.importorskip("openai")
CONTEXT = 4096


@pytest.fixture(scope="module")
def stock(tmp_path_factory, checkpoint):
    require_nginx()
    root = tmp_path_factory.mktemp("stock")
    ckpt = checkpoint_copy(checkpoint, root / "model", CONTEXT)
    port = free_port()
    served = Served("graphs/epd-stock.yaml", root / "run", port, "--checkpoint", str(ckpt))
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        served.encoder_url = next(c["url"] for c in served.state["components"] if c["kind"] == "encoder")
        served.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        served.count = PromptCount(ckpt)
        served.checkpoint = ckpt
        yield served
    finally:
        if served.proc.poll() is None:
            served.stop()


def encoder_metric(s: Served, name: str) -> float:
    with urllib.request.urlopen(f"{s.encoder_url}/metrics", timeout=30) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith((name + " ", name + "{")))


def image_part(data: bytes, mime: str = "image/jpeg") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def ask(s: Served, content, **fields):
    return s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            **{"max_tokens": 5, **fields})


def test_the_named_checkpoint_is_served_and_nothing_is_generated(stock):
    """--checkpoint: every component reads the given directory; serve writes no checkpoint of its own."""
    assert stock.state["model"] == MODEL and [m.id for m in stock.client.models.list().data] == [MODEL]
    assert not (stock.run_dir / "checkpoint").exists()


def test_an_image_request_counts_the_expanded_prompt_and_the_repeat_costs_no_encode(stock):
    """The stock frontend's one placeholder becomes the image's 1196 rows in the engine: the same
    count this project's frontend gives the same request (test_serve)."""
    content = [{"type": "text", "text": QUESTION}, image_part(SAMPLE.read_bytes())]
    out = ask(stock, content)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == stock.count(content, [image_rows(SAMPLE.read_bytes())]) == 1223
    forwards = encoder_metric(stock, "dynamo_component_encode_forward_items_total")
    assert forwards == 1
    again = ask(stock, content)
    assert again.usage.prompt_tokens == out.usage.prompt_tokens
    assert again.choices[0].message.content == out.choices[0].message.content
    assert encoder_metric(stock, "dynamo_component_encode_forward_items_total") == forwards  # 0 new forwards


def test_a_video_request_is_spliced_per_chunk(stock):
    """4 s at 10 fps sampled at 2 fps: 8 frames, two chunks of 4 frames (6 x 8 patches -> 12 rows
    each), each chunk prompt with its first frame's time, tokenized on its own by the engine."""
    clip = video_bytes(width=112, height=84, frames=40, fps=10)
    content = [{"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": {"url": data_url(
        clip, "video/mp4")}}]
    chunks = sampled_video_chunks(40, 10, rows=12)
    assert [ts for ts, _ in chunks] == ["00:00:00.000", "00:00:02.200"]
    out = ask(stock, content)
    assert out.usage.prompt_tokens == stock.count(content, [chunks], stock=True)


def test_text_only_requests_never_call_the_encoder(stock):
    """Text without media: Dynamo's frontend sends it straight to an engine; the encoder sees nothing."""
    before = encoder_metric(stock, "dynamo_component_encode_requests_total")
    for _ in range(2):
        assert ask(stock, "hello there, a text only question").usage.completion_tokens == 5
    assert encoder_metric(stock, "dynamo_component_encode_requests_total") == before


def test_an_overflowing_image_is_refused_with_a_4xx_naming_the_context(stock):
    """A 4K photo is 4214 rows (K2.5 policy) > the checkpoint's 4096: refused with the context named."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (3840, 2160), (120, 80, 40)).save(buf, "JPEG")
    assert image_rows(buf.getvalue()) == 4214
    with pytest.raises(openai.BadRequestError) as e:
        ask(stock, [image_part(buf.getvalue())])
    assert "context_length_exceeded" in str(e.value) and str(CONTEXT) in str(e.value)


def test_sampling_is_honoured_or_refused_by_name(stock):
    """Seeded sampling repeats and seeds differ, stop strings end the text, logprobs come back in
    OpenAI's shape (the chosen token and 2 alternatives per token), several choices are refused."""
    content = [image_part(SAMPLE.read_bytes()), {"type": "text", "text": "Tell a story."}]

    def text(**fields) -> tuple[str, str]:
        c = ask(stock, content, max_tokens=16, **fields).choices[0]
        return c.message.content, c.finish_reason

    a, b, c = text(temperature=1.0, seed=7), text(temperature=1.0, seed=7), text(temperature=1.0, seed=8)
    assert a == b and a != c
    greedy, _ = text()
    cut = greedy[len(greedy) // 2 :][:3]
    stopped, finish = text(stop=[cut])
    assert finish == "stop" and stopped == greedy[: greedy.index(cut)]
    with pytest.raises(openai.BadRequestError) as e:
        ask(stock, "hi", n=2)
    assert "`n`" in str(e.value)


def test_logprobs_come_back_in_openais_shape(stock):
    """logprobs with top_logprobs 2 through Dynamo's frontend: per generated token its logprob and
    the 2 most likely alternatives, best first (greedy: the chosen token is the best); streamed,
    the same tokens and numbers chunk by chunk."""
    content = [image_part(SAMPLE.read_bytes()), {"type": "text", "text": "Tell a story."}]
    out = ask(stock, content, logprobs=True, top_logprobs=2)
    lp = out.choices[0].logprobs.content
    assert len(lp) == out.usage.completion_tokens == 5
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.token == t.top_logprobs[0].token
    streamed = [t for c in ask(stock, content, logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in lp]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in lp], abs=1e-4)


def test_no_process_of_the_graph_listens_on_a_wildcard_address(stock):
    """Every socket any process of the graph listens on (nats-server, run by serve, included) binds
    127.0.0.1."""
    from harness.procfs import listeners

    state = json.loads((stock.run_dir / "state.json").read_text())
    groups = {c["pid"] for c in state["components"]} | {s["pid"] for s in state["runtime"]["servers"]}
    sockets = listeners(groups)
    assert [s["name"] for s in state["runtime"]["servers"]] == ["nats"]  # the graph's event plane, run by serve
    assert sockets and {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
