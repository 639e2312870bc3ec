"""Kimi-VL (`model_type: kimi_vl`, Kimi-VL-A3B): MoonViT + patchmerger into a DeepseekV3 text model.

- config: MoonViT's unprefixed `vision_config` keys; the projector (LayerNorm eps 1e-5, GELU) is
  not configurable.
- preprocessing, policy "kimi-vl" (KimiVLImageProcessor): only when (W//P) * (H//P) > limit,
  s = sqrt(limit / that) and the new size is int(W*s) x int(H*s); no side cap, but a side of
  patch_limit_on_one_side patches or more is refused ("Exceed pos emb"); zero-padded (`pad_input`)
  or center-cropped to whole patches. Video frames are images under the same rule (the processor
  has no video path of its own).
- transformers: not served (no model class); vLLM: its text backbone takes mixed prompt embeddings.
"""

from __future__ import annotations

import math
from typing import Any

from ..core.errors import CheckpointError, MediaError
from ..core.spec import PreprocessConfig, PromptConfig, TowerConfig
from . import moonvit
from .base import Family, NotServed, PreprocessRule, VisionConfig, VisionFormat, VllmInput

# unprefixed MoonViT keys; the projector (LayerNorm eps 1e-5, GELU) is not configurable
RELEASE = VisionFormat("kimi_vl", {**moonvit.PLAIN, **moonvit.COMMON}, projector="patchmerger")


def target(width: int, height: int, patch_limit: int, cfg: PreprocessConfig, patch: int) -> tuple[int, int]:
    patches = (width // patch) * (height // patch)
    if patches <= patch_limit:
        return width, height
    s = math.sqrt(patch_limit / patches)
    return max(1, int(width * s)), max(1, int(height * s))


def check(width: int, height: int, gh: int, gw: int, cfg: PreprocessConfig) -> None:
    """KimiVLImageProcessor's own refusals, as typed 4xx errors instead of its ValueError."""
    if gh == 0 or gw == 0:
        raise MediaError("empty", f"a {width}x{height} image has no whole patch after center-cropping")
    if max(gh, gw) >= cfg.patch_limit_on_one_side:
        raise MediaError("bad_aspect_ratio", f"a {width}x{height} image is {gw}x{gh} patches after Kimi-VL "
                         f"preprocessing; a side must be under {cfg.patch_limit_on_one_side} (its position embedding)")
    if gh % 2 or gw % 2:  # center-crop (pad_input false) leaves whole patches, not whole 2x2 merge units
        raise MediaError("bad_input", f"a {width}x{height} image crops to {gw}x{gh} patches, which the 2x2 "
                         "merger cannot pool (pad_input is false)")


# KimiVLImageProcessor's constructor defaults: what a key left out means.
_DEFAULTS: dict[str, Any] = {
    "in_token_limit": 4096, "patch_size": 14, "merge_kernel_size": [2, 2], "pad_input": False,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def read_processor(doc: dict[str, Any], base: PreprocessConfig, tower: TowerConfig) -> dict[str, Any]:
    """KimiVLImageProcessor's preprocessor_config.json."""
    unknown = sorted(set(doc) - set(_DEFAULTS) - moonvit.PROCESSOR_INFO_KEYS)
    if unknown:
        raise CheckpointError(f"preprocessor_config.json (KimiVLImageProcessor): keys {', '.join(unknown)} "
                              "are not implemented")
    cfg = {**_DEFAULTS, **doc}
    moonvit.check_geometry(cfg["patch_size"], cfg["merge_kernel_size"], tower, "preprocessor_config.json")
    limit = cfg["in_token_limit"]
    return {"policy": "kimi-vl", "in_patch_limit": limit, "in_patch_limit_each_frame": limit,
            "pad_input": cfg["pad_input"], "image_mean": cfg["image_mean"], "image_std": cfg["image_std"],
            "patch_limit_on_one_side": tower.rope_max_positions}


FAMILY = Family(
    name="kimi_vl",
    title="Kimi-VL",
    model_types=("kimi_vl",),
    spec="kimi-vl-a3b",
    vision_config=VisionConfig(RELEASE),
    preprocess=PreprocessRule("kimi-vl", target, check, processor="KimiVLImageProcessor", reader=read_processor),
    prompt=PromptConfig(image="<|media_start|>image<|media_content|><|media_pad|><|media_end|>",
                        video="{timestamp}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>",
                        placeholder="<|media_pad|>", placeholder_id=163605),
    transformers=NotServed("Kimi-VL has no transformers model class (its modeling code is Hub remote code, which "
                           "this engine does not run): serve it with vLLM behind this project's encoder"),
    vllm=(VllmInput("kimi_vl", ("KimiVLForConditionalGeneration",), route="embeds", no_tower={"image": 0},
                    deepseek=True),),
    checkpoint=NotServed("no Kimi-VL checkpoint is generated here: its text model runs only in vLLM, on the same "
                         "DeepseekV2 code path as Kimi-K2.5's, which the generated Kimi-K2.5 exercises"),
)
