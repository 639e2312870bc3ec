"""What the MoonViT families share: the tower's `vision_config` keys in each spelling, the values we
implement where a config may only state them, and the helpers of the preprocessor_config.json readers."""

from __future__ import annotations

from typing import Any

from ..core.errors import CheckpointError
from ..core.spec import TowerConfig
from .base import KeyTarget

# The MoonViT tower's keys: unprefixed (Kimi-VL, transformers) or `vt_*` (Kimi-K2.5's release, GLM);
# the position table's `init_pos_emb_*` (the releases) or `pos_emb_*` (transformers).
PLAIN: dict[str, KeyTarget] = {"hidden_size": ("tower", "hidden_size"),
                               "intermediate_size": ("tower", "intermediate_size"),
                               "num_attention_heads": ("tower", "num_heads"),
                               "num_hidden_layers": ("tower", "num_layers")}
VT: dict[str, KeyTarget] = {"vt_" + k: v for k, v in PLAIN.items()}
GEOMETRY: dict[str, KeyTarget] = {"patch_size": ("tower", "patch_size"), "merge_kernel_size": ("tower", "merge_kernel")}
POS_EMB: dict[str, KeyTarget] = {f"pos_emb_{s}": ("tower", f"pos_emb_{s}") for s in ("height", "width", "time")}
COMMON: dict[str, KeyTarget] = {**GEOMETRY, **{"init_" + k: v for k, v in POS_EMB.items()}}
# What we implement, where a config may only state it: key -> the one value accepted.
FIXED: dict[str, Any] = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool",
                         "video_attn_type": "spatial_temporal", "num_channels": 3}

# preprocessor_config.json keys with no effect on the pixels: loader bookkeeping, and
# KimiVLImageProcessor's `num_pooled_tokens`, which it stores but no step reads.
PROCESSOR_INFO_KEYS = frozenset({"auto_map", "image_processor_type", "processor_class", "num_pooled_tokens"})


def check_geometry(patch: Any, merge: Any, tower: TowerConfig, where: str) -> None:
    """A processor's patch and merge sizes must be the tower's."""
    merge = list(merge) if isinstance(merge, (list, tuple)) else [merge, merge]
    if patch != tower.patch_size or merge != list(tower.merge_kernel):
        raise CheckpointError(f"{where}: patch_size {patch} / merge_kernel_size {merge} differ from the tower's "
                              f"{tower.patch_size} / {list(tower.merge_kernel)}")


def vt_keys(v: dict[str, Any]) -> dict[str, Any]:
    """A generated checkpoint's MoonViT tower in the release's `vt_*` keys (Kimi-K2.5's original
    format, glm-5.2-vision's), from TowerConfig fields."""
    return {"vt_hidden_size": v["hidden_size"], "vt_intermediate_size": v["intermediate_size"],
            "vt_num_attention_heads": v["num_heads"], "vt_num_hidden_layers": v["num_layers"], "patch_size": 14,
            "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4, "merge_kernel_size": [2, 2]}
