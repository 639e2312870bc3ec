"""The vLLM adapter's request building, checked against what vLLM's source expects. vLLM is not
installable here (no CPU build), so these tests encode what its code does rather than run it.

Source read: vLLM 0.31.0, the version ai-dynamo 1.6.1 pins (`ai-dynamo[vllm]` requires
`vllm==0.31.0`), files in vllm-project/vllm:
- vllm/model_executor/models/qwen2_vl.py: `Qwen2VLMultiModalDataParser` turns a dict per modality
  into `DictEmbeddingItems` (required fields `image_embeds`+`image_grid_thw`, `video_embeds`+
  `video_grid_thw`); its field factory slices `*_embeds` with `flat_from_sizes` by
  `grid.prod(-1) // merge_size**2` rows and takes `*_grid_thw` `batched` (one row per item).
  Qwen2.5-VL (qwen2_5_vl.py) reuses that processor.
- vllm/multimodal/processing/processor.py: `_apply_hf_processor_main` returns
  `is_update_applied=False` for a `list[int]` prompt, so `_maybe_apply_prompt_updates` always runs
  `_apply_prompt_updates` (PromptReplacement of the single placeholder token) on token prompts.
- vllm/multimodal/processing/context.py `parse_mm_data`: embeddings items are refused unless
  `enable_mm_embeds`.
- vllm/model_executor/models/kimi_vl.py, kimi_k25.py: pixel-value input schemas only.
- vllm/sampling_params.py: top_k 0 disables ("quietly accept -1 ... prefer 0").
- vllm/config/kv_events.py `KVEventsConfig` (enable_kv_cache_events, publisher, endpoint, topic).
Dynamo 1.6.1's own vLLM backend (dynamo/vllm/main.py `setup_kv_event_publisher`, args.py, and
custom_encoder/adapter/qwen3_vl.py, which builds the same one-dict Qwen3-VL prompt) is installed
in this venv and was read too.
"""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from mm_encoder import wire
from mm_encoder.core.errors import BadRequest
from mm_encoder.core.handle import MediaHandle, Source
from mm_encoder.core.requests import EngineRequest, MediaInput
from mm_encoder.engines import vllm as adapter
from mm_encoder.engines.vllm import (
    FAMILIES,
    build_inputs,
    collapse_runs,
    family_for,
    kv_events,
    parse_engine_args,
    sampling_kwargs,
)

H1, H2, H3 = "ab" * 32, "cd" * 32, "ef" * 32
# Qwen2.5-VL <|image_pad|> <|video_pad|> <|vision_start|> <|vision_end|>
IMG, VID, VS, VE = 151655, 151656, 151652, 151653
QWEN25 = FAMILIES["qwen2_5_vl"]


def _handle(body: bytes, url: str = "https://media.test/a.png") -> dict:
    return MediaHandle.build(wire.peek(body), Source(model="tiny", url=url), chain=None, route="cluster",
                             rpc=None).to_dict()


def _image(mm_hash: str, grid=(1, 4, 6), hidden: int = 8) -> bytes:
    n = grid[0] * grid[1] * grid[2] // 4
    return wire.encode(mm_hash=mm_hash, model="tiny", modality="image", embeds=torch.randn(n, hidden),
                       grid_thws=[list(grid)])


def _two_images():
    """Prompt `1 <vs><pad>*6<ve> 2 <vs><pad>*4<ve> 3`, as our frontend expands it."""
    a, b = _image(H1, (1, 4, 6)), _image(H2, (1, 4, 4))
    tokens = [1, VS] + [IMG] * 6 + [VE, 2, VS] + [IMG] * 4 + [VE, 3]
    media = [MediaInput(_handle(a), [(2, 6)]), MediaInput(_handle(b, "https://media.test/b.png"), [(11, 4)])]
    return EngineRequest("r", tokens, 5, [7], media), [a, b]


def test_images_are_one_dict_per_modality_embeds_concatenated_in_prompt_order_grids_stacked():
    """qwen2_vl.py: one `{"image_embeds": [sum rows, hidden], "image_grid_thw": [n, 3]}` for all
    images of a prompt (DictEmbeddingItems), not a list of per-item dicts; vLLM slices it back by
    each grid's rows, so the order must be the prompt's."""
    req, bodies = _two_images()
    req.media.reverse()  # arrival order must not matter: vLLM pairs items with placeholders in prompt order
    bodies.reverse()
    prompt = build_inputs(req, bodies, QWEN25)
    data = prompt["multi_modal_data"]
    assert list(data) == ["image"] and isinstance(data["image"], dict)
    first, second = wire.decode(bodies[1]).embeds, wire.decode(bodies[0]).embeds
    assert torch.equal(data["image"]["image_embeds"], torch.cat([first, second]))
    assert data["image"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4]]
    assert data["image"]["image_grid_thw"].dtype == torch.long
    assert prompt["multi_modal_uuids"] == {"image": [H1, H2]}


def test_placeholder_runs_collapse_to_one_placeholder_per_item():
    """processor.py: a token prompt is never taken as already updated, so vLLM replaces each
    `<|image_pad|>` with the item's run itself; the expanded run must arrive as one token, giving
    `<|vision_start|><|image_pad|><|vision_end|>` per image, the form Qwen2.5-VL's processor expects."""
    req, bodies = _two_images()
    assert build_inputs(req, bodies, QWEN25)["prompt_token_ids"] == [1, VS, IMG, VE, 2, VS, IMG, VE, 3]
    assert collapse_runs([5, 9, 9, 9, 6], [(1, 3)]) == [5, 9, 6]
    with pytest.raises(BadRequest, match="overlap"):
        collapse_runs([9] * 6, [(0, 4), (2, 2)])


def test_video_chunks_become_video_items_and_rows_must_match_vllm_slicing():
    """Each chunk (one grid, one span) is one vLLM video item: `video_grid_thw` one row per chunk,
    uuid `mm_hash:chunk`. vLLM slices `grid.prod() // 4` rows per item, so a MoonViT chunk whose
    t frames were averaged into h*w/4 rows (t > 1) would be cut wrongly: refused by name."""
    vid = wire.encode(mm_hash=H3, model="tiny", modality="video", embeds=torch.randn(8, 8),
                      grid_thws=[[1, 4, 4], [1, 4, 4]], timestamps=["00:00:00.000", "00:00:02.000"])
    tokens = [1, VS] + [VID] * 4 + [VE, 2, VS] + [VID] * 4 + [VE]
    req = EngineRequest("r", tokens, 5, [], [MediaInput(_handle(vid, "https://media.test/v.mp4"), [(2, 4), (9, 4)])])
    prompt = build_inputs(req, [vid], QWEN25)
    assert prompt["prompt_token_ids"] == [1, VS, VID, VE, 2, VS, VID, VE]
    assert prompt["multi_modal_data"]["video"]["video_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert torch.equal(prompt["multi_modal_data"]["video"]["video_embeds"], wire.decode(vid).embeds)
    assert prompt["multi_modal_uuids"] == {"video": [f"{H3}:0", f"{H3}:1"]}

    pooled = wire.encode(mm_hash=H3, model="tiny", modality="video", embeds=torch.randn(4, 8), grid_thws=[[4, 4, 4]],
                         timestamps=["00:00:00.000"])
    item = MediaInput(_handle(pooled, "https://media.test/v.mp4"), [(1, 4)])
    req = EngineRequest("r", [1] + [VID] * 4, 5, [], [item])
    with pytest.raises(BadRequest, match="slices 16 rows"):
        build_inputs(req, [pooled], QWEN25)
    with pytest.raises(BadRequest, match="no video embeddings"):  # Qwen3-VL video: not verified, refused
        build_inputs(req, [pooled], FAMILIES["qwen3_vl"])


def test_wrong_placeholder_token_or_span_is_refused_and_text_passes_through():
    req, bodies = _two_images()
    req.token_ids[2:8] = [9] * 6  # a run, but not <|image_pad|>
    with pytest.raises(BadRequest, match="placeholder is 151655"):
        build_inputs(req, bodies, QWEN25)
    img = _image(H1)
    bad = EngineRequest("r", [1] + [IMG] * 6, 5, [], [MediaInput(_handle(img), [(0, 6)])])  # not a placeholder run
    with pytest.raises(BadRequest):
        build_inputs(bad, [img], QWEN25)
    assert build_inputs(EngineRequest("t", [1, 2], 3), [], QWEN25) == {"prompt_token_ids": [1, 2]}


def test_family_table_takes_qwen_and_refuses_kimi_with_what_vllm_lacks():
    """kimi_vl.py / kimi_k25.py parse pixel values only (Kimi-K2.5: the `vision_chunk` modality),
    so the adapter refuses them at start-up, saying so; ids and merge size come from hf_config."""
    assert family_for(["Qwen2_5_VLForConditionalGeneration"]).name == "qwen2_5_vl"
    assert family_for(["Qwen3VLMoeForConditionalGeneration"]).token_ids == {"image": IMG}
    vision = argparse.Namespace(spatial_merge_size=4)
    cfg = argparse.Namespace(image_token_id=11, video_token_id=12, vision_config=vision)
    fam = family_for(["Qwen2VLForConditionalGeneration"], cfg)
    assert fam.token_ids == {"image": 11, "video": 12} and fam.rows((1, 8, 8)) == 4
    with pytest.raises(ValueError, match=r"pixel_values.*vision_chunk"):
        family_for(["KimiK25ForConditionalGeneration"])
    with pytest.raises(ValueError, match="Kimi-VL"):
        family_for(["KimiVLForConditionalGeneration"])
    with pytest.raises(ValueError, match="no known embeddings input"):
        family_for(["LlamaForCausalLM"])


def test_sampling_maps_every_field_to_vllm_keywords():
    """vllm/sampling_params.py keywords; greedy is temperature 0, top-k off is 0; token ids only
    (detokenize=False: the frontend detokenizes and matches stop strings)."""
    req, _ = _two_images()
    assert sampling_kwargs(req) == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False,
        "max_tokens": 5, "stop_token_ids": [7], "detokenize": False}
    req.sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
                    "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                    "stop_token_ids": [9, 7], "stop": ["\n\n"], "max_tokens": 99}
    kw = sampling_kwargs(req)
    assert {k: kw[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True}
    assert kw["stop_token_ids"] == [7, 9] and kw["max_tokens"] == 5 and "stop" not in kw


def test_a_sampling_field_the_adapter_does_not_map_is_refused_by_name(monkeypatch):
    monkeypatch.delitem(adapter._SAMPLING_MAP, "min_p")  # stands in for a field core.sampling gains later
    req, _ = _two_images()
    req.sampling = {"min_p": 0.1}
    with pytest.raises(BadRequest, match=r"\['min_p'\]") as e:
        sampling_kwargs(req)
    assert e.value.code == "unsupported_field"


def test_kv_events_publish_on_zmq_and_dynamo_subscribes_locally():
    """vLLM binds `tcp://*:port`; Dynamo's KvEventPublisher connects to it with `*` replaced by
    127.0.0.1 and topic "" (dynamo/vllm/main.py setup_kv_event_publisher)."""
    cfg, listen = kv_events(6001)
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6001", "topic": ""}
    assert listen == "tcp://127.0.0.1:6001"


class _FakeEngineArgs:
    """Stands in for vLLM's AsyncEngineArgs (absent here). It mimics only the two class methods
    the adapter calls, `add_cli_args(parser)` and `from_cli_args(namespace)`, with a few real vLLM
    flag names; what is tested is that parsing is delegated to them (types come from the parser,
    not guessed) and what the adapter sets afterwards, not vLLM's own flag definitions."""

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--max-model-len", type=int)
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        parser.add_argument("--enforce-eager", action="store_true")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
        parser.add_argument("--kv-events-config", type=lambda s: ("parsed", s), default=None)
        parser.add_argument("--trust-remote-code", action="store_true")
        return parser

    @classmethod
    def from_cli_args(cls, ns):
        return dict(vars(ns))


def _parse(rest):
    return parse_engine_args(rest, model="/models/q", block_size=16, kv_events_port=6001,
                             engine_args_cls=_FakeEngineArgs, parser_cls=argparse.ArgumentParser, kv_events_cls=dict)


def test_engine_args_go_through_vllms_parser_then_the_adapters_settings():
    args = _parse(["--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.8"])
    assert args["max_model_len"] == 8192 and args["enforce_eager"] is True and args["gpu_memory_utilization"] == 0.8
    assert args["model"] == "/models/q" and args["block_size"] == 16 and args["enable_mm_embeds"] is True
    assert args["enable_prefix_caching"] is True
    assert args["kv_events_config"] == kv_events(6001)[0]
    own = _parse(["--kv-events-config", '{"enable_kv_cache_events": false}'])
    assert own["kv_events_config"] == ("parsed", '{"enable_kv_cache_events": false}')  # the operator's, untouched
    off = _parse(["--no-enable-prefix-caching"])
    assert off["enable_prefix_caching"] is False and off["kv_events_config"] is None
    with pytest.raises(SystemExit):  # an unknown flag is vLLM's parser's error, not a guess
        _parse(["--max-model-lenn", "1"])
    with pytest.raises(ValueError, match="--model"):
        _parse(["--model", "other"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (no CPU build)")
def test_engine_args_with_the_real_vllm_parser():  # pragma: no cover - runs only where vLLM is installed
    args = parse_engine_args(["--max-model-len", "8192"], model="Qwen/Qwen2.5-VL-3B-Instruct", block_size=16)
    assert args.max_model_len == 8192 and args.enable_mm_embeds and args.block_size == 16
    assert args.kv_events_config.enable_kv_cache_events and args.kv_events_config.endpoint == "tcp://*:5557"
