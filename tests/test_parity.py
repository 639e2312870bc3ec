"""Fast path vs the independent eager reference (harness/reference.py), same random weights, CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.media_factory import image_bytes, natural_image
from harness.models import random_model, ref_cfg
from harness.reference import reference_forward
from mm_encoder import Encoder, VideoChunk, get_spec
from mm_encoder.core.spec import ProjectorConfig, TowerConfig
from mm_encoder.model.checkpoint import build_empty


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def _items() -> list:
    """Images of several sizes (one whose grid equals the 64x64 table) and a two-chunk video."""
    sizes = [(200, 130), (896, 896), (97, 333), (500, 300)]
    items = [image_bytes(natural_image(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    gen = torch.Generator().manual_seed(1)
    video = torch.randint(0, 256, (8, 70, 98, 3), dtype=torch.uint8, generator=gen)
    items += [VideoChunk(video[i : i + 4], timestamp=i / 2, index=i // 4, source_hash=f"v{i}") for i in (0, 4)]
    return items


def _spec(tower: TowerConfig, projector: ProjectorConfig):
    return get_spec("tiny").model_copy(update={"tower": tower, "projector": projector})


TOWERS = {
    "tiny": get_spec("tiny").tower,
    # head_dim 72 as in the real tower: 18 column + 18 row RoPE slots
    "hd72": TowerConfig(hidden_size=144, intermediate_size=256, num_heads=2, num_layers=2),
}
PROJECTORS = {
    "patchmerger": ProjectorConfig(type="patchmerger", out_dim=96),
    "patchmergerv2": ProjectorConfig(type="patchmergerv2", out_dim=96),
    "glm": ProjectorConfig(type="glm", out_dim=96, context_dim=160),
}


def _run_both(spec, items, dtype=torch.float32):
    model = random_model(spec, seed=3, dtype=dtype)
    enc = Encoder(spec, model, device=torch.device("cpu"), dtype=dtype, batch_max_patches=1 << 20)
    fast = enc.encode(items)
    pixels, grids = [], []
    for item in items:  # the same preprocessing, then the reference forward on fp32 weights
        pre = enc.preprocess_item(item, spec.preprocess)
        pixels.append(pre.pixel_values.float())
        grids.append(pre.grid)
    sd = {k: v.float() for k, v in model.state_dict().items()}
    ref = reference_forward(sd, ref_cfg(spec), torch.cat(pixels), grids)
    return fast, ref


@pytest.mark.parametrize("tower", TOWERS)
@pytest.mark.parametrize("projector", PROJECTORS)
def test_fast_matches_reference_fp32(tower, projector):
    spec = _spec(TOWERS[tower], PROJECTORS[projector])
    fast, ref = _run_both(spec, _items())
    assert len(fast) == len(ref) == 6
    assert len({r.mm_hash for r in fast}) == 6
    for f, r in zip(fast, ref, strict=True):
        assert f.embeds.shape == r.shape == (f.num_tokens, 96)
        cos = _cos(f.embeds, r)
        assert cos.mean() >= 0.99999 and cos.min() >= 0.9999, (tower, projector, f.grid_thw, cos.min())
        rel = (f.embeds - r).norm() / r.norm()
        assert rel < 1e-4


def test_fast_bf16_close_to_reference_fp32():
    """bf16 is slow on CPU: two small images only, on the head_dim-72 tower."""
    spec = _spec(TOWERS["hd72"], PROJECTORS["patchmerger"])
    items = [image_bytes(natural_image(w, h, seed=w)) for w, h in ((150, 100), (120, 200))]
    fast, ref = _run_both(spec, items, dtype=torch.bfloat16)
    cos = torch.cat([_cos(f.embeds, r) for f, r in zip(fast, ref, strict=True)])
    assert fast[0].embeds.dtype == torch.bfloat16
    assert cos.mean() >= 0.9994, cos.mean()


def test_packing_does_not_mix_items(tiny):
    """Block-diagonal attention: an item's embeddings do not depend on what it is packed with."""
    items = _items()
    packed = tiny.encode(items)
    for item, p in zip(items, packed, strict=True):
        alone = tiny.encode([item])[0]
        torch.testing.assert_close(alone.embeds, p.embeds, rtol=1e-4, atol=1e-5)
        assert alone.mm_hash == p.mm_hash


def test_output_order_and_batches_split_by_cap():
    spec = get_spec("tiny")
    enc = Encoder(spec, random_model(spec), device=torch.device("cpu"), dtype=torch.float32, batch_max_patches=300)
    items = [image_bytes(natural_image(w, 140, seed=w)) for w in (140, 280, 420, 140)]
    out = enc.encode(items)
    assert [o.grid_thw for o in out] == [(1, 10, 10), (1, 10, 20), (1, 10, 30), (1, 10, 10)]
    ref = Encoder(spec, enc.steps.model, device=enc.steps.device, dtype=enc.steps.dtype).encode(items)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a.embeds, b.embeds, rtol=1e-4, atol=1e-5)


def test_real_moonvit_parameter_counts():
    """The full-size tower and Kimi projector have exactly the checkpoint's parameter counts."""
    model = build_empty(get_spec("kimi-k2.5-vision"))
    assert sum(p.numel() for p in model.vision_tower.parameters()) == 416_866_032
    assert sum(p.numel() for p in model.mm_projector.parameters()) == 54_277_888
    sd = model.state_dict()
    assert tuple(sd["vision_tower.patch_embed.proj.weight"].shape) == (1152, 3, 14, 14)
    assert tuple(sd["vision_tower.patch_embed.pos_emb.weight"].shape) == (64, 64, 1152)
    assert tuple(sd["vision_tower.encoder.blocks.26.wqkv.weight"].shape) == (3456, 1152)
    assert tuple(sd["mm_projector.proj.2.weight"].shape) == (7168, 4608)


@pytest.mark.parametrize("projector", PROJECTORS)
def test_every_weight_module_runs_as_a_module(projector):
    """Each Linear, LayerNorm, RMSNorm and the patch projection is called as a module, so a swap (a
    quantized Linear, a LoRA wrapper) or a forward hook applies: every one of them fires a hook."""
    spec = _spec(TOWERS["tiny"], PROJECTORS[projector])
    model = random_model(spec)
    leaves = {name: m for name, m in model.named_modules() if list(m.parameters(recurse=False))
              and name != "vision_tower.patch_embed.pos_emb"}  # a table, indexed, not called
    called: set[str] = set()
    for name, m in leaves.items():
        m.register_forward_hook(lambda mod, args, out, name=name: called.add(name))
    pixels, grid = Encoder(spec, model, device=torch.device("cpu"), dtype=torch.float32).preprocess(
        image_bytes(natural_image(64, 48, seed=2)))
    with torch.inference_mode():
        before = model(pixels, [grid])
        assert called == set(leaves)
        wo = model.vision_tower.encoder.blocks[0].wo
        model.vision_tower.encoder.blocks[0].wo = torch.nn.Sequential(wo, torch.nn.Identity())  # swapped in place
        torch.testing.assert_close(model(pixels, [grid]), before, rtol=0, atol=0)
        model.vision_tower.encoder.blocks[0].wo = torch.nn.Sequential(wo, torch.nn.Dropout(1.0).train())
        assert not torch.equal(model(pixels, [grid]), before)  # the swap changes what runs
