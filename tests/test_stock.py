"""Dynamo's own frontend serving mm-encoder: `mm-encoder serve graphs/epd-stock.yaml` runs the stock
`python -m dynamo.frontend` (ai-dynamo 1.6.1), our encode worker registered as its Encode worker,
the nginx tiers and two reference engines taking Dynamo's preprocessed requests. The client is the
official `openai` package. Nothing is mocked; the LLM has random weights, so structure and counts
are asserted, and text only where it must repeat (seeded sampling)."""

from __future__ import annotations

import base64
import io
import json
import urllib.request

import pytest
from media_factory import video_bytes
from nginx_fixtures import free_port, require_nginx
from serve_fixtures import IMAGE_TOKENS, SAMPLE, TEXT_TOKENS, Served

from mm_encoder.core.prompt import ChatTokenizer
from mm_encoder.core.registry import get_spec

pytest.importorskip("dynamo.frontend")
pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    require_nginx()
    run_dir = tmp_path_factory.mktemp("stock") / "run"
    port = free_port()
    served = Served("graphs/epd-stock.yaml", run_dir, port)
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        state = json.loads((run_dir / "state.json").read_text())
        served.encoder_url = next(c["url"] for c in state["components"] if c["kind"] == "encoder")
        served.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        served.llm_dir = run_dir / "llm" / "mm-chat"
        yield served
    finally:
        if served.proc.poll() is None:
            served.stop()


def encoder_metric(s: Served, name: str) -> float:
    with urllib.request.urlopen(f"{s.encoder_url}/metrics", timeout=30) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith((name + " ", name + "{")))


def image_part(data: bytes, mime: str = "image/jpeg") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def ask(s: Served, content, **fields):
    return s.client.chat.completions.create(model="mm-chat", messages=[{"role": "user", "content": content}],
                                            **{"max_tokens": 5, **fields})


def test_an_image_request_counts_the_expanded_prompt_and_the_repeat_costs_no_encode(stock):
    content = [{"type": "text", "text": "What is in this image?"}, image_part(SAMPLE.read_bytes())]
    out = ask(stock, content)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    # the same count as this project's frontend gives the same request (test_serve): expanded here
    assert out.usage.prompt_tokens == IMAGE_TOKENS + TEXT_TOKENS
    forwards = encoder_metric(stock, "mm_encoder_forward_items_total")
    assert forwards == 1
    again = ask(stock, content)
    assert again.usage.prompt_tokens == out.usage.prompt_tokens
    assert encoder_metric(stock, "mm_encoder_forward_items_total") == forwards  # 0 new forwards


def test_a_video_request_is_spliced_per_chunk(stock):
    clip = video_bytes(width=112, height=84, frames=40, fps=10)  # 4 s at 2 fps: 2 chunks of 4 frames
    out = ask(stock, [{"type": "text", "text": "What happens?"},
                      {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," +
                                                          base64.b64encode(clip).decode()}}])
    tok = ChatTokenizer(stock.llm_dir)
    spec = get_spec("tiny")
    text = len(tok.encode(tok.render([{"role": "user", "content": "What happens?"}])))
    chunks = sum(len(tok.encode(spec.prompt.video.format(timestamp=ts).replace(spec.prompt.placeholder, "")))
                 for ts in ("00:00:00.000", "00:00:02.000"))
    assert out.usage.prompt_tokens == text + chunks + 2 * 12  # 2 chunks x (6 x 8 patches / 4)


def test_text_only_requests_never_call_the_encoder(stock):
    before = encoder_metric(stock, "mm_encoder_requests_total")
    for _ in range(2):
        assert ask(stock, "hello there, a text only question").usage.completion_tokens == 5
    assert encoder_metric(stock, "mm_encoder_requests_total") == before


def test_an_overflowing_image_is_refused_with_a_4xx_naming_the_context(stock):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (3840, 2160), (120, 80, 40)).save(buf, "JPEG")  # 4214 tokens for tiny > 4096
    with pytest.raises(openai.BadRequestError) as e:
        ask(stock, [image_part(buf.getvalue())])
    assert "context_length_exceeded" in str(e.value) and "4096" in str(e.value)


def test_sampling_is_honoured_or_refused_by_name(stock):
    content = [image_part(SAMPLE.read_bytes()), {"type": "text", "text": "Tell a story."}]

    def text(**fields) -> tuple[str, str]:
        c = ask(stock, content, max_tokens=16, **fields).choices[0]
        return c.message.content, c.finish_reason

    a, b, c = text(temperature=1.0, seed=7), text(temperature=1.0, seed=7), text(temperature=1.0, seed=8)
    assert a == b and a[0] != c[0]
    greedy, _ = text()
    cut = greedy[len(greedy) // 2 :][:3]
    stopped, finish = text(stop=[cut])
    assert finish == "stop" and stopped == greedy[: greedy.index(cut)]
    for field, value in (("n", 2), ("logprobs", True)):
        with pytest.raises(openai.BadRequestError) as e:
            ask(stock, "hi", **{field: value})
        assert f"`{field}`" in str(e.value)


def test_no_process_of_the_graph_listens_on_a_wildcard_address(stock):
    from mm_encoder.deploy.local import listeners

    state = json.loads((stock.run_dir / "state.json").read_text())
    groups = {c["pid"] for c in state["components"]} | {s["pid"] for s in state["runtime"]["servers"]}
    sockets = listeners(groups)
    assert [s["name"] for s in state["runtime"]["servers"]] == ["nats"]  # the graph's event plane, run by serve
    assert sockets and {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
