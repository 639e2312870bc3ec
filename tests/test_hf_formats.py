"""transformers' Kimi-K2.5 formats load into the same encoder, checked against transformers' own classes.

A tiny random `Kimi_K25ForConditionalGeneration` (seeded) is written three ways: what its
`save_pretrained` writes (sharded), its in-memory state_dict as is (`save_file`), and the original
release's layout with the original `vt_*` config. Each loads into bit-identical weights, and the
encoder's embeddings equal `Kimi_K25Model.get_image_features` on the same pixels (our own
preprocessing: transformers' processors need torchvision) for an image and video chunks of 4, 3 and
1 frames. Everything is generated in tmp_path; CPU, fp32, a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from harness.media_factory import image_bytes, natural_image
from mm_encoder import CheckpointError, Encoder, get_spec
from mm_encoder.model.checkpoint import spec_for_checkpoint, unpermute_rope
from mm_encoder.model.hf_config import spec_from_hf_config
from mm_encoder.model.media import VideoChunk

transformers = pytest.importorskip("transformers")
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402

HIDDEN, HEADS = 64, 4
VISION = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": HEADS, "num_hidden_layers": 2,
          "patch_size": 14, "pos_emb_height": 16, "pos_emb_width": 16, "pos_emb_time": 4, "merge_kernel_size": [2, 2]}
# q_lora_rank set, as in the real model (1536): with None, transformers 5.24's save_pretrained renames the
# language model's q_proj and cannot load its own checkpoint back.
TEXT = {"model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 1000,
        "n_group": 1, "topk_group": 1}
# The original release's config.json for the same model (Kimi-K2.5's own format).
ORIGINAL_VISION = {
    "vt_hidden_size": HIDDEN, "vt_intermediate_size": 128, "vt_num_attention_heads": HEADS, "vt_num_hidden_layers": 2,
    "patch_size": 14, "init_pos_emb_height": 16, "init_pos_emb_width": 16, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
    "mm_hidden_size": HIDDEN, "text_hidden_size": 256, "video_attn_type": "spatial_temporal",
}
# save_pretrained's spelling -> the release's (transformers 5.24; see mm_encoder/model/checkpoint.py HF_SAVED)
SAVED_QUIRKS = {"vision_tower.encoder.patch_embed.proj.": "vision_tower.patch_embed.proj.",
                "model.mm_projector.pre_norm.": "mm_projector.pre_norm."}
VISION_HEADS = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def _config() -> Kimi_K25Config:
    return Kimi_K25Config(vision_config=VISION, text_config=TEXT, projection_hidden_size=HIDDEN)


@pytest.fixture(scope="module")
def hf_model() -> Kimi_K25ForConditionalGeneration:
    """Seeded weights everywhere, biases included (transformers initialises those to 0, which would hide
    a wrong q/k/v permutation of the bias)."""
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(_config()).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * (0.2 if "pos_emb" in name else 0.05)
            p.copy_(noise + 1.0 if "norm" in name and name.endswith("weight") else noise)
    return model


@pytest.fixture(scope="module")
def dirs(hf_model, tmp_path_factory) -> dict[str, Path]:
    """The three layouts of the same weights."""
    root = tmp_path_factory.mktemp("hf")
    saved = root / "saved"
    hf_model.save_pretrained(saved, max_shard_size="300KB")
    native, original = _native(hf_model, root / "native"), _original(saved, root / "original")
    return {"saved": saved, "native": native, "original": original}


def _native(model, root: Path) -> Path:
    """model.state_dict() as is, vision in one shard; the language-model shard is not even safetensors."""
    root.mkdir()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    vision = {k: v for k, v in sd.items() if k.startswith(VISION_HEADS)}
    save_file(vision, str(root / "model-00002-of-00002.safetensors"))
    (root / "model-00001-of-00002.safetensors").write_bytes(b"not safetensors" * 64)
    weight_map = {k: f"model-0000{2 if k in vision else 1}-of-00002.safetensors" for k in sd}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(model.config.to_dict()))  # to_dict(): every generic key too
    return root


def _original(saved: Path, root: Path) -> Path:
    """The release's layout: save_pretrained's tensors with its two spelling quirks renamed (names only,
    the tensors are copied as they are), in one file, with the original `vt_*` config."""
    root.mkdir()
    tensors = {}
    for shard in sorted(saved.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                new = next((v + name[len(k):] for k, v in SAVED_QUIRKS.items() if name.startswith(k)), name)
                tensors[new] = f.get_tensor(name)
    save_file(tensors, str(root / "model.safetensors"))
    config = {"model_type": "kimi_k25", "media_placeholder_token_id": 163605, "text_config": TEXT,
              "vision_config": ORIGINAL_VISION}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _vision_shards(ckpt: Path) -> tuple[set[str], set[str]]:
    """(shards holding vision/projector tensors, every shard) from the index."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return {s for n, s in weight_map.items() if n.startswith(VISION_HEADS)}, set(weight_map.values())


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=-1)
    rel = (ours.double() - theirs.double()).norm() / theirs.double().norm()
    assert ours.shape == theirs.shape and cos.min() >= 0.999999 and rel <= 1e-5, (cos.min().item(), rel.item())


def _items() -> list:
    """An image, and video chunks of 4, 3 and 1 frames (a short last chunk keeps its real t)."""
    frames = torch.stack([torch.from_numpy(np.array(natural_image(100, 70, seed=s))) for s in range(4)])
    return [image_bytes(natural_image(150, 110, seed=9)), VideoChunk(frames, 0.0, 0),
            VideoChunk(frames[:3].clone(), 2.0, 1), VideoChunk(frames[:1].clone(), 4.0, 2)]


@pytest.mark.parametrize("layout", ["saved", "native", "original"])
def test_each_layout_equals_transformers_get_image_features(hf_model, dirs, layout):
    """Our embeddings from each layout equal transformers' own forward on the same pixels, for an
    image and video chunks with t = 4, 3 and 1 (cos >= 0.999999, relative L2 <= 1e-5)."""
    enc = Encoder.from_pretrained(dirs[layout], dtype="fp32")
    items = _items()
    prepared = [enc.preprocess_item(item) for item in items]
    assert [p.grid[0] for p in prepared] == [1, 4, 3, 1]
    results = enc.encode(items)
    with torch.no_grad():
        for p, r in zip(prepared, results, strict=True):
            theirs = hf_model.model.get_image_features(p.pixel_values, torch.tensor([p.grid])).pooler_output[0]
            assert r.grid_thw == p.grid and r.num_tokens == theirs.shape[0]
            _close(r.embeds, theirs)
    # t = 1 adds no time embedding in either implementation: the chunk is its frame as an image
    frame = items[3].frames[0]
    _close(results[3].embeds, enc.encode([image_bytes(Image.fromarray(frame.numpy()))])[0].embeds)


def test_layouts_load_bit_identical_weights_and_open_only_vision_shards(dirs):
    """The three spellings give the same weights bit for bit; only shards with vision tensors are opened
    (save_pretrained's language-model-only shards and the native layout's non-safetensors LM shard are not)."""
    encoders = {k: Encoder.from_pretrained(d, dtype="fp32") for k, d in dirs.items()}
    ref = encoders["original"].steps.model.state_dict()
    for enc in encoders.values():
        sd = enc.steps.model.state_dict()
        assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    for layout in ("saved", "native"):
        vision, every = _vision_shards(dirs[layout])
        opened = encoders[layout].load_report.shards_opened
        assert set(opened) == vision and len(every - vision) >= 1, (opened, every)
    assert len(_vision_shards(dirs["saved"])[1]) >= 4  # really sharded
    assert encoders["native"].load_report.shards_opened == ["model-00002-of-00002.safetensors"]


def test_original_layout_is_what_transformers_itself_loads(hf_model, dirs):
    """The release-layout file our test writes loads in transformers (its own conversion: renames,
    wqkv split and PermuteForRope) into exactly the model's weights, so it is the release's format."""
    loaded = Kimi_K25ForConditionalGeneration.from_pretrained(dirs["original"], config=_config())
    ours, theirs = loaded.state_dict(), hf_model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_unpermute_rope_inverts_transformers_permute_for_rope():
    """Our inverse of transformers' PermuteForRope (applied to q/k weights and biases) restores the rows."""
    from transformers.core_model_loading import PermuteForRope

    config = _config()
    for shape in [(HIDDEN, HIDDEN), (HIDDEN,)]:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        permuted = PermuteForRope(subconfig_key="vision_config")._permute_for_rope(t, config)
        assert not torch.equal(permuted, t) and torch.equal(unpermute_rope(permuted, HEADS), t)


def test_native_layout_mismatches_are_reported_together_in_its_names(hf_model, tmp_path):
    """A missing k_proj, a mis-shaped v_proj and an unknown vision tensor: one error, checkpoint names."""
    sd = {k: v.detach().clone().contiguous() for k, v in hf_model.state_dict().items()
          if k.startswith(VISION_HEADS)}
    del sd["model.vision_tower.layers.1.attn.k_proj.bias"]
    sd["model.vision_tower.layers.0.attn.v_proj.weight"] = torch.zeros(HIDDEN, HIDDEN + 1)
    sd["model.vision_tower.layers.0.attn.extra.weight"] = torch.zeros(2)
    del sd["model.mm_projector.out_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    with pytest.raises(CheckpointError) as e:
        Encoder.from_pretrained(tmp_path, dtype="fp32")
    msg = e.value.message
    assert "missing tensor model.vision_tower.layers.1.attn.k_proj.bias" in msg
    assert "tensor model.vision_tower.layers.0.attn.v_proj.weight has shape [64, 65], expected [64, 64]" in msg
    assert "unexpected tensor model.vision_tower.layers.0.attn.extra.weight" in msg
    assert "missing tensor model.mm_projector.out_proj.weight" in msg
    assert msg.count("missing tensor") == 2 and "wqkv" not in msg


def test_both_config_formats_give_the_same_spec(dirs, hf_model):
    """transformers' config (save_pretrained's and to_dict()'s) and the release's give one tower and
    projector; image_token_id sets the placeholder id like media_placeholder_token_id."""
    specs = {k: spec_for_checkpoint(d, None) for k, d in dirs.items()}
    ref = specs["original"]
    assert ref.tower.hidden_size == HIDDEN and ref.tower.pos_emb_height == 16 and ref.projector.out_dim == 256
    for spec in specs.values():
        assert (spec.tower, spec.projector) == (ref.tower, ref.projector)
    base = get_spec("kimi-k2.5-vision")
    doc = {**hf_model.config.to_dict(), "image_token_id": 7,
           "vision_config": {**hf_model.config.vision_config.to_dict(),
                             "rope_parameters": {"rope_type": "axial", "rope_theta": 500.0}}}
    spec = spec_from_hf_config(doc, base, "r")
    assert spec.prompt.placeholder_id == 7 and spec.tower.rope_theta == 500.0
    assert spec_from_hf_config({**doc, "projection_layer_norm_eps": 1e-6}, base, "r").projector.ln_eps == 1e-6
    # a transformers config whose vision_config states nothing of its own: the top-level keys decide
    bare = spec_from_hf_config({"model_type": "kimi_k25", "projection_hidden_size": 1152, "vision_config": {},
                                "projection_layer_norm_eps": 1e-6, "text_config": {"hidden_size": 7168}}, base, "r")
    assert bare.tower == base.tower and bare.projector == base.projector.model_copy(update={"ln_eps": 1e-6})


@pytest.mark.parametrize(("vision", "top", "named"), [
    ({"mystery": 1, "hidden_act": "gelu_pytorch_tanh"}, {}, ["mystery"]),
    ({"hidden_size": HIDDEN, "rope_parameters": {"rope_theta": 1e4, "factor": 2}}, {}, ["rope_parameters.factor"]),
    ({"hidden_size": HIDDEN, "rope_parameters": {"rope_type": "default"}}, {}, ["rope_parameters.rope_type='default'"]),
    ({"hidden_size": HIDDEN, "hidden_act": "gelu"}, {}, ["hidden_act='gelu'"]),
    ({"hidden_size": HIDDEN, "vt_num_hidden_layers": 2}, {}, ["vt_num_hidden_layers", "hidden_size"]),
    ({"hidden_size": HIDDEN, "init_pos_emb_height": 16}, {}, ["init_pos_emb_height"]),
    (ORIGINAL_VISION, {"projection_hidden_size": HIDDEN}, ["projection_hidden_size"]),
    ({"hidden_size": HIDDEN}, {"projection_hidden_size": 32}, ["width 32", "hidden_size is 64"]),
    ({"hidden_size": HIDDEN}, {"image_token_id": 5, "media_placeholder_token_id": 6}, ["image_token_id"]),
])
def test_unknown_mixed_or_inconsistent_config_keys_are_refused_by_name(vision, top, named):
    """What maps onto nothing, a mix of the two formats, and disagreeing facts are refused, each named."""
    config = {"model_type": "kimi_k25", "text_config": {"hidden_size": 256}, "vision_config": vision, **top}
    with pytest.raises(CheckpointError) as e:
        spec_from_hf_config(config, get_spec("kimi-k2.5-vision"), "r")
    assert all(n in e.value.message for n in named), e.value.message


def test_save_pretrained_layout_names_what_it_lacks_in_its_own_spelling(dirs, tmp_path):
    """Tensors left out of a save_pretrained index are named as save_pretrained spells them."""
    index = json.loads((dirs["saved"] / "model.safetensors.index.json").read_text())
    for name in ("vision_tower.encoder.patch_embed.proj.bias", "model.mm_projector.pre_norm.bias",
                 "vision_tower.encoder.blocks.1.wqkv.weight"):
        del index["weight_map"][name]
    for shard in dirs["saved"].glob("*.safetensors"):
        (tmp_path / shard.name).symlink_to(shard)
    (tmp_path / "config.json").write_text((dirs["saved"] / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        Encoder.from_pretrained(tmp_path, dtype="fp32")
    msg = e.value.message
    assert "missing tensor vision_tower.encoder.patch_embed.proj.bias" in msg
    assert "missing tensor vision_tower.encoder.blocks.1.wqkv.weight" in msg
    assert "missing tensor model.mm_projector.pre_norm.bias" in msg
    assert msg.count("missing tensor") == 3
