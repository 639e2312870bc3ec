"""Checkpoint loading from generated Hugging Face style directories in the real Kimi naming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harness.media_factory import image_bytes, natural_image
from harness.models import random_model
from mm_encoder import CheckpointError, Encoder, get_spec
from mm_encoder.families import spec_names

VISION = {
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2,
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "mm_hidden_size": 32,
    "text_hidden_size": 48,
    "video_attn_type": "spatial_temporal",
}


def _small_spec():
    spec = get_spec("kimi-k2.5-vision")
    from mm_encoder.model.hf_config import spec_from_hf_config

    tower = spec_from_hf_config({"model_type": "kimi_k25", "vision_config": VISION}, spec, spec.revision).tower
    return spec.model_copy(update={"tower": tower, "projector": spec.projector.model_copy(update={"out_dim": 48})})


def _weights() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in random_model(_small_spec(), seed=11).state_dict().items()}


def write_sharded(root: Path, weights: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """Three shards like the real checkpoint: LLM first (not even valid safetensors), vision last two."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = config or {
        "model_type": "kimi_k25",
        "media_placeholder_token_id": 163605,
        "text_config": {"hidden_size": 48},
        "vision_config": VISION,
    }
    (root / "config.json").write_text(json.dumps(cfg))
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00002-of-00003.safetensors": {n: weights[n] for n in names[:half]},
        "model-00003-of-00003.safetensors": {n: weights[n] for n in names[half:]},
    }
    weight_map = {"language_model.model.embed_tokens.weight": "model-00001-of-00003.safetensors",
                  "language_model.lm_head.weight": "model-00001-of-00003.safetensors"}
    for shard, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (root / "model-00001-of-00003.safetensors").write_bytes(b"this is not a safetensors file" * 100)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_sharded_checkpoint_loads_only_vision_shards(tmp_path):
    weights = _weights()
    ckpt = write_sharded(tmp_path / "ckpt", weights)
    enc = Encoder.from_pretrained(ckpt, dtype="fp32")  # the values as stored (the CPU default may be bf16)
    assert enc.steps.spec.name == spec_names()["kimi_k25"]
    assert enc.steps.spec.tower.hidden_size == 32 and enc.steps.spec.tower.pos_emb_height == 8
    assert enc.steps.spec.projector.out_dim == 48 and enc.steps.spec.prompt.placeholder_id == 163605
    assert enc.load_report.shards_opened == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    assert enc.load_report.tensors == len(weights)
    for k, v in enc.steps.model.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    # The revision comes from the checkpoint, so its mm_hashes differ from random weights'.
    assert enc.steps.spec.revision.startswith("ckpt-")
    out = enc.encode([image_bytes(natural_image(100, 80))])[0]
    assert out.embeds.shape == (out.num_tokens, 48)


def test_dtype_conversion_on_load(tmp_path):
    ckpt = write_sharded(tmp_path / "ckpt", {k: v.bfloat16() for k, v in _weights().items()})
    enc = Encoder.from_pretrained(ckpt, dtype="fp32")
    assert all(p.dtype == torch.float32 for p in enc.steps.model.parameters())


def _load_error(ckpt: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        Encoder.from_pretrained(ckpt)
    assert e.value.code == "bad_checkpoint"
    return str(e.value)


def test_wrong_shape_missing_and_unexpected_are_all_named(tmp_path):
    weights = _weights()
    weights["vision_tower.encoder.blocks.1.wo.weight"] = torch.zeros(32, 31)
    del weights["mm_projector.proj.2.bias"]
    weights["vision_tower.encoder.blocks.7.wo.weight"] = torch.zeros(32, 32)
    msg = _load_error(write_sharded(tmp_path / "ckpt", weights))
    assert "vision_tower.encoder.blocks.1.wo.weight has shape [32, 31], expected [32, 32]" in msg
    assert "missing tensor mm_projector.proj.2.bias" in msg
    assert "unexpected tensor vision_tower.encoder.blocks.7.wo.weight" in msg
    assert "blocks.1.wo.weight" not in msg.split("missing")[-1]  # a mis-shaped tensor is not also 'missing'


def test_missing_shard_file_is_named(tmp_path):
    ckpt = write_sharded(tmp_path / "ckpt", _weights())
    (ckpt / "model-00003-of-00003.safetensors").unlink()
    assert "shard model-00003-of-00003.safetensors" in _load_error(ckpt)


def test_kimi_vl_names_in_single_file(tmp_path):
    """Kimi-VL: unprefixed vision_config keys, projector named multi_modal_projector.{pre_norm,linear_1,linear_2}."""
    weights = _weights()
    renamed = {}
    for k, v in weights.items():
        k = k.replace("mm_projector.proj.0.", "multi_modal_projector.linear_1.")
        k = k.replace("mm_projector.proj.2.", "multi_modal_projector.linear_2.")
        renamed[k.replace("mm_projector.", "multi_modal_projector.")] = v.contiguous()
    renamed["language_model.lm_head.weight"] = torch.zeros(4, 4)
    ckpt = tmp_path / "kimi-vl"
    ckpt.mkdir()
    save_file(renamed, str(ckpt / "model.safetensors"))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
              "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "merge_kernel_size": [2, 2]}
    (ckpt / "config.json").write_text(
        json.dumps({"model_type": "kimi_vl", "vision_config": vision, "text_config": {"hidden_size": 48}})
    )
    enc = Encoder.from_pretrained(ckpt, dtype="fp32")  # the values as stored (the CPU default may be bf16)
    assert enc.steps.spec.name == "kimi-vl-a3b"
    for k, v in enc.steps.model.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)


def test_named_model_with_mismatched_checkpoint_is_refused(tmp_path):
    ckpt = write_sharded(tmp_path / "ckpt", _weights())
    with pytest.raises(CheckpointError, match=r"does not match model kimi-k2\.5-vision"):
        Encoder.from_pretrained("kimi-k2.5-vision", checkpoint=ckpt)


def test_random_weights_are_deterministic_and_logged(caplog):
    a = Encoder.from_pretrained("tiny")
    b = Encoder.from_pretrained("tiny")
    assert "RANDOM weights" in caplog.text
    for (ka, va), (kb, vb) in zip(a.steps.model.state_dict().items(), b.steps.model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    c = Encoder.from_pretrained("tiny", seed=5)
    key = "mm_projector.proj.0.weight"
    assert not torch.equal(c.steps.model.state_dict()[key], a.steps.model.state_dict()[key])
    assert c.identity() != a.identity()


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"model_type 'llama' is not known"):
        Encoder.from_pretrained(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="neither"):
        Encoder.from_pretrained("tiny", checkpoint=empty)
