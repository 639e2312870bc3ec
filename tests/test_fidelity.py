"""Each model's preprocessing and checkpoint naming match what its release does (issue 14, part 1).

Token counts are checked against the processors' documented rules written out again here (not by
calling our functions); checkpoints are written into tmp_path with safetensors and random weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from harness.media_factory import image_bytes, natural_image
from harness.models import random_model
from mm_encoder import CheckpointError, Encoder, get_spec, list_models
from mm_encoder.core.errors import MediaError
from mm_encoder.core.spec import PreprocessConfig, ProjectorConfig
from mm_encoder.model import preprocess as pre
from mm_encoder.model.checkpoint import build_empty, load_checkpoint, spec_for_checkpoint
from mm_encoder.model.hf_config import spec_from_hf_config

CPU = torch.device("cpu")


# --- the processors' rules, written out independently ---------------------------------------


def kimi_k25_reference(w: int, h: int, limit: int = 16384, side: int = 512) -> int:
    """Kimi-K2.5: s = min(1, sqrt(limit / patches), 7168/W, 7168/H); pad to 28; tokens = h*w/4."""
    s = min(1.0, math.sqrt(limit / (max(1, w // 14) * max(1, h // 14))), side * 14 / w, side * 14 / h)
    nw, nh = max(1, int(w * s)), max(1, int(h * s))
    return math.ceil(nh / 28) * math.ceil(nw / 28)


def kimi_vl_reference(w: int, h: int, limit: int = 4096, pad: bool = True) -> int | None:
    """KimiVLImageProcessor.rescale: scale only above the limit, pad to 28 (or crop to 14), then
    refuse >= 512 patches on a side. None when refused."""
    if (w // 14) * (h // 14) > limit:
        s = math.sqrt(limit / ((w // 14) * (h // 14)))
        w, h = int(w * s), int(h * s)
    if pad:
        w, h = w + (28 - w % 28) % 28, h + (28 - h % 28) % 28
    else:
        w, h = w - w % 14, h - h % 14
    if w // 14 >= 512 or h // 14 >= 512:
        return None
    return (h // 14) * (w // 14) // 4


# (W, H) -> (Kimi-VL tokens or None if refused, Kimi-K2.5 tokens)
TOKENS = [
    ((1920, 1080), 1032, 2691),
    ((3840, 2160), 1032, 4214),
    ((8000, 300), 1169, 2560),
    ((1, 1), 1, 1),
    ((448, 448), 256, 256),
    ((896, 896), 1024, 1024),  # exactly 4096 patches: not above the limit, so kept
    ((910, 910), 1024, 1089),
    ((7000, 7000), 1024, 4096),
    ((100, 7000), 1000, 1000),  # 500 patches high, under 512 even once padded
    ((100, 7150), None, 1024),  # padding to 28 makes it 512 patches high: refused
    ((14336, 100), None, 512),  # scaled to 10837 x 75: 774 patches wide
    ((1000, 5), 36, 36),
]


@pytest.mark.parametrize(("size", "vl", "k25"), TOKENS)
def test_token_table_follows_each_models_processor(size, vl, k25):
    w, h = size
    assert kimi_vl_reference(w, h) == vl and kimi_k25_reference(w, h) == k25  # the table is the rules
    for spec in list_models():
        cfg, patch = spec.preprocess, spec.tower.patch_size
        expected = vl if spec.name == "kimi-vl-a3b" else k25
        assert cfg.policy == ("kimi-vl" if spec.name == "kimi-vl-a3b" else "kimi-k2.5")
        if expected is None:
            with pytest.raises(MediaError) as e:
                pre.num_tokens(w, h, cfg, patch)
            assert e.value.code == "bad_aspect_ratio" and e.value.http_status == 422
            assert "position embedding" in e.value.message
        else:
            assert pre.num_tokens(w, h, cfg, patch) == expected, spec.name


def test_random_sizes_match_the_rules():
    vl, k25 = get_spec("kimi-vl-a3b").preprocess, get_spec("kimi-k2.5-vision").preprocess
    rng = np.random.default_rng(14)
    for _ in range(400):
        w, h = (int(x) for x in rng.integers(1, 12000, 2))
        assert pre.num_tokens(w, h, k25, 14) == kimi_k25_reference(w, h)
        expected = kimi_vl_reference(w, h)
        if expected is None:
            with pytest.raises(MediaError):
                pre.num_tokens(w, h, vl, 14)
        else:
            assert pre.num_tokens(w, h, vl, 14) == expected
            assert pre.num_tokens(w, h, vl, 14, video=True) == expected  # a frame is an image


def _tiny_with(preprocess: PreprocessConfig) -> Encoder:
    spec = get_spec("tiny").model_copy(update={"preprocess": preprocess})
    return Encoder(spec, random_model(spec), device=CPU, dtype=torch.float32)


def test_kimi_vl_preprocessing_end_to_end_and_refused_before_decoding():
    enc = _tiny_with(get_spec("kimi-vl-a3b").preprocess)
    out = enc.encode([image_bytes(natural_image(1920, 1080))])[0]
    assert out.num_tokens == 1032 and out.grid_thw == (1, 48, 86)  # 1196x672, padded to 1204x672
    frames = torch.zeros((2, 1080, 1920, 3), dtype=torch.uint8)  # a video frame is an image under the same rule
    assert pre.preprocess_frames(frames, enc.steps.spec.preprocess, 14, video=True)[1] == (2, 48, 86)
    # A PNG whose header says 7200x50 but whose pixel data is cut off: refused for its size (the
    # header), not as corrupt, so nothing was decoded.
    data = image_bytes(Image.new("RGB", (7200, 50)))
    with pytest.raises(MediaError) as e:
        enc.encode([data[: len(data) // 2]])
    assert e.value.code == "bad_aspect_ratio"


def test_kimi_vl_without_pad_input_center_crops():
    cfg = get_spec("kimi-vl-a3b").preprocess.model_copy(update={"pad_input": False})
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (200, 320, 3), dtype=np.uint8)  # -> 196 x 308: offsets round(4/2), round(12/2)
    pv, grid = pre.preprocess_frames(torch.from_numpy(a), cfg, 14)
    assert grid == (1, 14, 22) and pre.num_tokens(320, 200, cfg, 14) == 77
    img = pv.view(14, 22, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 196, 308)
    torch.testing.assert_close(img, torch.from_numpy(a[2:198, 6:314]).permute(2, 0, 1).float() / 127.5 - 1)
    with pytest.raises(MediaError, match="2x2 merger"):  # 15 patches high: the merger cannot pool it
        pre.num_tokens(320, 210, cfg, 14)


def test_policy_is_part_of_the_identity():
    spec = get_spec("tiny")
    vl = spec.preprocess.model_copy(update={"policy": "kimi-vl", "in_patch_limit": 4096})
    assert spec.identity(vl) != spec.identity()
    assert spec.identity(vl) != spec.identity(vl.model_copy(update={"pad_input": False}))
    with pytest.raises(ValueError, match="always pads"):
        PreprocessConfig(pad_input=False)


# --- resize vs Pillow ---------------------------------------------------------------------------

PIL_MAX_DIFF = 2  # the bound `resize_uint8` states against Pillow 13's BICUBIC on uint8 images, measured below
# (source W, H) -> target: the policies' own targets (down-scales, e.g. 8000x300 under both) and up-scales.
RESIZES = [
    ((8000, 300), (7168, 268)), ((8000, 300), (4676, 175)), ((1920, 1080), (1196, 672)),
    ((3840, 2160), (2392, 1345)), ((3840, 2160), (1204, 677)), ((1200, 3000), (1015, 2539)),
    ((594, 16376), (259, 7168)), ((5000, 2500), (1810, 905)), ((2000, 2000), (1792, 1792)),
    ((300, 200), (640, 427)), ((97, 61), (1000, 629)), ((640, 480), (641, 481)),
]


def test_resize_bound_against_pil():
    """The bound `resize_uint8` states: at most PIL_MAX_DIFF levels, and more than 1 level on under
    1 value in 10^5. The measured table is printed (pytest -s)."""
    worst = 0
    images = {(w, h): natural_image(w, h, seed=w) for (w, h), _ in RESIZES}  # each source made once
    for (w, h), (nw, nh) in RESIZES:
        img = images[(w, h)]
        ours = pre.resize_uint8(torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None], nh, nw)
        pil = torch.from_numpy(np.asarray(img.resize((nw, nh), Image.BICUBIC)).copy()).permute(2, 0, 1)[None]
        diff = (ours.int() - pil.int()).abs()
        over = int((diff > 1).sum())
        print(f"{w}x{h} -> {nw}x{nh}: max {int(diff.max())}, {over} of {diff.numel()} values > 1")
        assert over / diff.numel() < 1e-5, (w, h)
        worst = max(worst, int(diff.max()))
    assert worst == PIL_MAX_DIFF


# --- checkpoints ------------------------------------------------------------------------------


def _spec(projector: ProjectorConfig, name: str = "tiny"):
    return get_spec(name).model_copy(update={"tower": get_spec("tiny").tower, "projector": projector})


def _save(root: Path, tensors: dict[str, torch.Tensor], config: dict | None = None,
          processor: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (root / "preprocessor_config.json").write_text(json.dumps(processor))
    return root


def _renamed(sd: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {k.replace(old, new): v for k, v in sd.items()}


def _load(spec, ckpt: Path):
    model = build_empty(spec)
    load_checkpoint(model, ckpt, CPU, torch.float32)
    return model.eval()


def _load_error(spec, ckpt: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        _load(spec, ckpt)
    return e.value.message


def test_patchmergerv2_loads_post_norm_and_norm(tmp_path):
    spec = _spec(ProjectorConfig(type="patchmergerv2", out_dim=48))
    sd = random_model(spec, seed=4).state_dict()
    assert "mm_projector.norm.weight" in sd
    real = _renamed(sd, "mm_projector.norm.", "mm_projector.post_norm.")  # what vLLM's K2.5 loader reads
    for ckpt in (_save(tmp_path / "real", real), _save(tmp_path / "ours", sd)):
        for k, v in _load(spec, ckpt).state_dict().items():
            assert torch.equal(v, sd[k]), k
    both = _save(tmp_path / "both", {**real, "mm_projector.norm.weight": sd["mm_projector.norm.weight"].clone()})
    assert "are the same weight" in _load_error(spec, both)
    missing = {k: v for k, v in real.items() if "post_norm" not in k}
    assert "missing tensor mm_projector.post_norm.weight" in _load_error(spec, _save(tmp_path / "m", missing))


def _glm_reference(sd: dict[str, torch.Tensor], x: torch.Tensor, prefix: str) -> torch.Tensor:
    """GLM-4V's merger: Linear (no bias) -> LayerNorm(eps 1e-5) -> erf GELU -> SiLU(gate) * up -> down."""
    y = F.linear(x.flatten(1), sd[prefix + "proj.weight"])
    y = F.layer_norm(y, y.shape[-1:], sd[prefix + "post_projection_norm.weight"],
                     sd[prefix + "post_projection_norm.bias"], eps=1e-5)
    y = F.gelu(y)
    return F.linear(F.silu(F.linear(y, sd[prefix + "gate_proj.weight"])) * F.linear(y, sd[prefix + "up_proj.weight"]),
                    sd[prefix + "down_proj.weight"])


def test_glm_4v_names_and_stacked_gate_up_give_the_same_output(tmp_path):
    spec = _spec(ProjectorConfig(type="glm", out_dim=48, context_dim=40))
    sd = random_model(spec, seed=5).state_dict()
    glm = _renamed(sd, "mm_projector.", "model.visual.merger.")
    stacked = {k: v for k, v in glm.items() if ".gate_proj." not in k and ".up_proj." not in k}
    stacked["model.visual.merger.gate_up_proj.weight"] = torch.cat(
        [glm["model.visual.merger.gate_proj.weight"], glm["model.visual.merger.up_proj.weight"]])
    x = torch.randn(7, 4, spec.tower.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        outs = [_load(spec, _save(tmp_path / n, t)).mm_projector(x)
                for n, t in (("ours", sd), ("glm", glm), ("stacked", stacked))]
        expected = _glm_reference(glm, x, "model.visual.merger.")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-6)

    bad = {**stacked, "model.visual.merger.gate_up_proj.weight": torch.zeros(79, 48)}
    assert "tensor model.visual.merger.gate_up_proj.weight has shape [79, 48], expected [80, 48]" in _load_error(
        spec, _save(tmp_path / "bad", bad))
    foreign = {**glm, "model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 3)}  # GLM's own ViT: not ours
    msg = _load_error(spec, _save(tmp_path / "f", foreign))
    assert "unexpected tensor model.visual.blocks.0.attn.qkv.weight" in msg
    lacking = {k: v for k, v in glm.items() if "down_proj" not in k}
    assert "missing tensor model.visual.merger.down_proj.weight" in _load_error(spec, _save(tmp_path / "l", lacking))


KIMI_VL_VISION = {"model_type": "moonvit", "hidden_size": 32, "intermediate_size": 128, "num_attention_heads": 2,
                  "num_hidden_layers": 2, "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
                  "merge_kernel_size": [2, 2], "torch_dtype": "bfloat16"}


def _kimi_vl_tensors(seed: int = 6) -> dict[str, torch.Tensor]:
    spec = _spec(ProjectorConfig(type="patchmerger", out_dim=48))
    sd = random_model(spec, seed=seed).state_dict()
    sd = _renamed(_renamed(sd, "mm_projector.proj.0.", "mm_projector.linear_1."), "mm_projector.proj.2.",
                  "mm_projector.linear_2.")
    return _renamed(sd, "mm_projector.", "multi_modal_projector.")


def _kimi_vl_config() -> dict:
    return {"model_type": "kimi_vl", "vision_config": KIMI_VL_VISION, "text_config": {"hidden_size": 48},
            "media_placeholder_token_id": 163605}


def test_missing_tensor_is_named_as_in_the_checkpoint(tmp_path):
    tensors = _kimi_vl_tensors()
    del tensors["multi_modal_projector.linear_1.bias"]
    ckpt = _save(tmp_path / "vl", tensors, _kimi_vl_config())
    with pytest.raises(CheckpointError) as e:
        Encoder.from_pretrained(ckpt, dtype="fp32")
    assert "missing tensor multi_modal_projector.linear_1.bias" in e.value.message
    assert "proj.0" not in e.value.message
    # No projector tensor at all: still named in the model's own (Kimi-VL) scheme.
    bare = {k: v for k, v in _kimi_vl_tensors().items() if k.startswith("vision_tower.")}
    with pytest.raises(CheckpointError, match=r"missing tensor multi_modal_projector\.linear_2\.weight"):
        Encoder.from_pretrained(_save(tmp_path / "bare", bare, _kimi_vl_config()), dtype="fp32")


GLM_41V_VISION = {  # GLM-4.1V-9B's vision_config: its own ViT, not MoonViT
    "hidden_size": 1536, "depth": 24, "num_heads": 12, "attention_bias": False, "intermediate_size": 13696,
    "hidden_act": "silu", "hidden_dropout_prob": 0.0, "initializer_range": 0.02, "image_size": 336,
    "patch_size": 14, "out_hidden_size": 4096, "rms_norm_eps": 1e-05, "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def test_foreign_config_with_unmapped_keys_is_refused_by_name(tmp_path):
    ckpt = _save(tmp_path / "glm41v", {}, {"model_type": "glm4v", "vision_config": GLM_41V_VISION,
                                          "text_config": {"hidden_size": 4096}})
    with pytest.raises(CheckpointError) as e:
        spec_for_checkpoint(ckpt, get_spec("glm-5.2-vision"))
    for key in ("depth", "num_heads", "hidden_size", "spatial_merge_size", "temporal_patch_size", "rms_norm_eps"):
        assert key in e.value.message
    assert "13696" not in e.value.message and "intermediate_size" not in e.value.message  # that one maps
    with pytest.raises(CheckpointError, match="vt_mystery"):
        spec_from_hf_config({"model_type": "kimi_k25", "vision_config": {"vt_mystery": 1}},
                            get_spec("kimi-k2.5-vision"), "r")
    with pytest.raises(CheckpointError, match="merge_type='bilinear'"):
        spec_from_hf_config({"model_type": "kimi_k25", "vision_config": {"merge_type": "bilinear"}},
                            get_spec("kimi-k2.5-vision"), "r")
    with pytest.raises(CheckpointError, match="'llava' is not understood"):
        spec_from_hf_config({"model_type": "llava"}, get_spec("kimi-k2.5-vision"), "r")


def test_glm_config_maps_the_merger_width():
    vision = {"vt_hidden_size": 32, "vt_intermediate_size": 128, "vt_num_attention_heads": 2,
              "vt_num_hidden_layers": 2, "patch_size": 14, "out_hidden_size": 48, "intermediate_size": 40,
              "hidden_act": "silu"}
    spec = spec_from_hf_config({"model_type": "glm4v", "vision_config": vision}, get_spec("glm-5.2-vision"), "r")
    assert spec.projector == ProjectorConfig(type="glm", out_dim=48, context_dim=40)
    assert (spec.tower.hidden_size, spec.tower.intermediate_size, spec.tower.num_layers) == (32, 128, 2)


def _kimi_vl_dir(tmp_path: Path, processor: dict | None) -> Path:
    return _save(tmp_path / "ckpt", _kimi_vl_tensors(), _kimi_vl_config(), processor)


KIMI_VL_PROCESSOR = {  # the released preprocessor_config.json, with another limit and mean/std
    "auto_map": {"AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor"},
    "in_token_limit": 1024, "patch_size": 14, "num_pooled_tokens": 1024, "merge_kernel_size": [2, 2],
    "pad_input": True, "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.4],
    "image_processor_type": "KimiVLImageProcessor", "processor_class": "KimiVLProcessor",
}


def test_preprocessor_config_defines_policy_mean_and_std(tmp_path):
    registry = spec_for_checkpoint(_kimi_vl_dir(tmp_path / "a", None), None).preprocess
    assert registry == get_spec("kimi-vl-a3b").preprocess
    enc = Encoder.from_pretrained(_kimi_vl_dir(tmp_path / "b", KIMI_VL_PROCESSOR), dtype="fp32")
    cfg = enc.steps.spec.preprocess
    assert (cfg.policy, cfg.in_patch_limit, cfg.in_patch_limit_each_frame) == ("kimi-vl", 1024, 1024)
    assert cfg.pad_input is True
    assert cfg.image_mean == (0.4, 0.5, 0.6) and cfg.image_std == (0.2, 0.3, 0.4)
    assert enc.identity() != Encoder.from_pretrained(_kimi_vl_dir(tmp_path / "c", None), dtype="fp32").identity()
    out = enc.encode([image_bytes(natural_image(1920, 1080))])[0]
    assert out.num_tokens == kimi_vl_reference(1920, 1080, limit=1024) == 264
    pv, _ = enc.preprocess(torch.zeros((28, 28, 3), dtype=torch.uint8))  # black -> -mean/std per channel
    torch.testing.assert_close(pv[0, :, 0, 0], torch.tensor([-2.0, -5 / 3, -1.5]))

    # Left-out keys mean the processor's own defaults: pad_input false, CLIP mean/std.
    minimal = {"image_processor_type": "KimiVLImageProcessor"}
    cfg = spec_for_checkpoint(_kimi_vl_dir(tmp_path / "d", minimal), None).preprocess
    assert cfg.pad_input is False and cfg.in_patch_limit == 4096 and cfg.image_mean[0] == pytest.approx(0.4815, 1e-3)

    # The Kimi-K2.5 layout switches a checkpoint to the K2.5 policy.
    k25 = {"media_proc_cfg": {"in_patch_limit": 4096, "patch_limit_on_one_side": 256, "in_patch_limit_each_frame": None,
                              "patch_size": 14, "merge_kernel_size": 2, "image_mean": [0.5, 0.5, 0.5],
                              "image_std": [0.5, 0.5, 0.5], "sample_fps": 1.0, "temporal_merge_kernel_size": 4,
                              "fixed_output_tokens": None, "timestamp_mode": "hh:mm:ss.fff"},
           "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"}}
    cfg = spec_for_checkpoint(_kimi_vl_dir(tmp_path / "e", k25), None).preprocess
    assert (cfg.policy, cfg.in_patch_limit, cfg.in_patch_limit_each_frame, cfg.patch_limit_on_one_side,
            cfg.video_fps) == ("kimi-k2.5", 4096, 4096, 256, 1.0)


@pytest.mark.parametrize(("processor", "named"), [
    ({"image_processor_type": "Glm4vImageProcessor"}, "'Glm4vImageProcessor' is not implemented"),
    ({**KIMI_VL_PROCESSOR, "do_resize": False, "resample": 2}, "keys do_resize, resample are not implemented"),
    ({**KIMI_VL_PROCESSOR, "patch_size": 16}, "patch_size 16"),
    ({"media_proc_cfg": {"fixed_output_tokens": 256}}, "fixed_output_tokens=256"),
    ({"media_proc_cfg": {"in_patch_limit_video": 65536, "zoom": 2}}, "keys zoom are not implemented"),
])
def test_preprocessor_config_we_do_not_implement_is_refused(tmp_path, processor, named):
    with pytest.raises(CheckpointError) as e:
        spec_for_checkpoint(_kimi_vl_dir(tmp_path, processor), None)
    assert named in e.value.message and "preprocessor_config.json" in e.value.message


def test_preprocessor_config_is_read_with_a_named_model_and_no_config(tmp_path):
    tensors = _kimi_vl_tensors()
    ckpt = _save(tmp_path / "ckpt", tensors, None, KIMI_VL_PROCESSOR)
    spec = spec_for_checkpoint(ckpt, get_spec("kimi-vl-a3b"))
    assert spec.preprocess.in_patch_limit == 1024
