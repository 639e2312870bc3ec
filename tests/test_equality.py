"""The disaggregated answer is the monolithic model's answer.

A tiny Kimi-K2.5 is written by transformers' own classes (`Kimi_K25ForConditionalGeneration`,
`save_pretrained`: config.json in transformers' format, sharded tensors in its spelling of the
released layout), with every parameter random. `mm-encoder serve graphs/epd.yaml --checkpoint DIR
--dtype fp32` (encode worker, cache tiers, two engines, frontend; real processes) and
`graphs/agg.yaml` on the same directory answer chat requests; the reference is transformers'
`generate` on the whole model from pixels, in this process, with nothing of this project's in its
path: the pixels, frames, chunks and timestamps come from `released_processor` (Kimi-K2.5's released
processor's rules written in the tests, PyAV and Pillow decoding, transformers' own `rescale` and
`normalize`; transformers' image processors need torchvision, which does not install here, and its
video processor samples other frames than the released code), the chat template rendering is
transformers' `apply_chat_template`, the tokenizer is transformers'.
For images of several sizes, two images in one prompt and four clips whose every frame differs (25
frames at 10 fps, 90 at 30, 7 at 2, 61 at 24: chunks stamped `00:00:02.399`, `00:00:02.366`, ...;
short last chunks), streamed and not: the greedy tokens are equal (each token's bytes, from the
response's logprobs), each token's log-probability is within 1e-4 of transformers' (fp32 rows from
the tower to the engine), and `usage.prompt_tokens` is the expanded prompt's length.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter

import pytest
import torch

from harness import released_processor as released
from harness.hf_reference import Reference, content, write_hf_checkpoint
from harness.serve_fixtures import chat_stream, frontend_stats, serving
from harness.topology import require_nginx

pytest.importorskip("dynamo.llm")
pytestmark = pytest.mark.slow  # two whole graphs of subprocesses

MAX_TOKENS = 8
IMAGES = {"small": (112, 84), "medium": (300, 200), "large": (640, 480)}
VIDEO_PROMPT = "Describe the clip."
CLIPS = {"25@10": (25, 10), "90@30": (90, 30), "7@2": (7, 2), "61@24": (61, 24)}  # frames, fps
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A checkpoint directory written by transformers' own classes, plus the tokenizer and chat template."""
    from mm_encoder.families.kimi_k25 import PRESETS, TEXT_DEFAULTS

    text = {**TEXT_DEFAULTS, **PRESETS["tiny"].text}
    path = write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "kimi-k2.5-hf", text)
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("language_model.model.blocks.") for n in names)  # transformers' spelling, not ours
    assert any(n.startswith("vision_tower.encoder.blocks.") and n.endswith("wqkv.weight") for n in names)
    return path


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    return Reference(hf_checkpoint)


@pytest.fixture(scope="module")
def graphs(hf_checkpoint, tmp_path_factory):
    require_nginx()
    with serving({name: f"graphs/{name}.yaml" for name in ("epd", "agg")}, tmp_path_factory, "--checkpoint",
                 str(hf_checkpoint), "--dtype", "fp32") as ports:
        yield ports


def _chat(port: int, parts: list[dict], stream: bool = False) -> dict:
    fields = {"model": "kimi-k2.5-hf", "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 1}
    if stream:
        return chat_stream(port, parts, **fields)
    body = {**fields, "messages": [{"role": "user", "content": parts}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _answer_bytes(reply: dict) -> list[bytes]:
    return [bytes(e["bytes"]) for e in reply["choices"][0]["logprobs"]["content"]]


def _check(reply: dict, reference: Reference, expected: tuple[list[int], list[float], int]) -> None:
    tokens, logprobs, prompt_len = expected
    assert reply["usage"]["prompt_tokens"] == prompt_len
    assert reply["usage"]["completion_tokens"] == len(tokens) == MAX_TOKENS
    assert _answer_bytes(reply) == reference.token_bytes(tokens)
    assert reply["choices"][0]["message"]["content"] == reference.tok.decode(tokens, skip_special_tokens=True)
    got = [e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]]
    assert got == pytest.approx(logprobs, abs=LOGPROB_TOL)


CASES = {
    **{f"image-{k}": ([("text", "What is in this image?"), ("image", v)]) for k, v in IMAGES.items()},
    "two-images": [("text", "Compare"), ("image", IMAGES["small"]), ("text", "with"), ("image", IMAGES["medium"])],
    **{f"video-{k}": [("text", VIDEO_PROMPT), ("video", v)] for k, v in CLIPS.items()},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_epd_and_agg_answer_what_transformers_generate_answers(case, graphs, reference):
    parts, media = content(CASES[case])
    expected = reference.expected(parts, media, MAX_TOKENS)
    for name in ("epd", "agg"):
        for stream in (False, True):
            _check(_chat(graphs[name], parts, stream), reference, expected)


def test_the_clips_are_the_released_processors_cases():
    """What the reference makes of the four clips: the released frame choice, short last chunks,
    and the timestamps a rounding clock would get wrong (2.399 and 2.366, not 2.400 and 2.367)."""
    want = {"25@10": (["00:00:00.000", "00:00:02.399"], [4, 1]),
            "90@30": (["00:00:00.000", "00:00:02.366"], [4, 2]),
            "7@2": (["00:00:00.000", "00:00:02.000"], [4, 3]),
            "61@24": (["00:00:00.000", "00:00:02.500"], [4, 1])}
    assert released.kept_frames(25, 10) == [0, 6, 12, 18, 24]
    for name, (stamps, ts) in want.items():
        _, media = content(CASES[f"video-{name}"])
        chunks = released.video(media[0])
        assert ([c.stamp for c in chunks], [c.grid[0] for c in chunks]) == (stamps, ts), name
        frames = torch.cat([c.pixel_values.view(c.grid[0], -1) for c in chunks])
        assert len({f.numpy().tobytes() for f in frames}) == len(frames)  # every kept frame differs


def test_a_repeated_image_reuses_its_prefix_on_the_engine_that_holds_it(graphs):
    parts, _ = content([("text", "Again:"), ("image", (200, 150))])
    first, second = _chat(graphs["epd"], parts), _chat(graphs["epd"], parts)
    assert _answer_bytes(first) == _answer_bytes(second)
    recent = frontend_stats(graphs["epd"])["recent"][-2:]
    assert recent[0]["worker_id"] == recent[1]["worker_id"]
    assert recent[0]["timings"]["reused_tokens"] == 0
    full_blocks = (first["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert recent[1]["timings"]["reused_tokens"] == full_blocks > 0
    assert recent[1]["overlap_blocks"] >= full_blocks // 16


def test_identical_concurrent_prompts_spread_over_the_engines(graphs):
    """Eight identical prompts at once (no prefix cached yet): the router counts each in-flight copy
    as load (`router_assume_kv_reuse` off: an engine shares a prefix only once its prefill is done),
    and the engines publish their load, so both engines take some instead of one taking all."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "kimi-k2.5-hf", "max_tokens": 16, "ignore_eos": True,
            "messages": [{"role": "user", "content": "the same words, eight times at once"}]}

    def one(_):
        req = urllib.request.Request(f"http://127.0.0.1:{graphs['epd']}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["usage"]["completion_tokens"]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [16] * 8
    recent = frontend_stats(graphs["epd"])["recent"][-8:]
    per_engine = sorted(Counter(x["worker_id"] for x in recent).values())
    assert len(per_engine) == 2 and per_engine[0] >= 2, per_engine
