"""A checkpoint's own files over its registry spec, beside the loader that reads them.

`spec_from_hf_config` reads the tower and projector from `config.json` (a table of `vision_config`
keys per model_type: Kimi-K2.5's `vt_*`, Kimi-VL's unprefixed ones, transformers' Kimi-K2.5 format,
GLM-4.xV's merger keys), and `preprocess_from_hf` the preprocessing from `preprocessor_config.json`.
What does not map is refused by name, never defaulted.
"""

from __future__ import annotations

from typing import Any

from ..core.errors import CheckpointError
from ..core.spec import ModelSpec, PreprocessConfig, ProjectorConfig, TowerConfig

# vision_config keys that change neither shapes nor outputs: bookkeeping, storage dtype (we pick our
# own), attention backend, initialisation, the generic fields of transformers' PreTrainedConfig.to_dict().
_INFO_KEYS = frozenset({
    "model_type", "torch_dtype", "dtype", "_attn_implementation", "_attn_implementation_autoset",
    "_name_or_path", "auto_map", "architectures", "transformers_version", "initializer_range",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type",
})

# The MoonViT tower's keys: unprefixed (Kimi-VL, transformers) or `vt_*` (Kimi-K2.5's release, GLM);
# the position table's `init_pos_emb_*` (the releases) or `pos_emb_*` (transformers).
_MOONVIT_PLAIN = {"hidden_size": ("tower", "hidden_size"), "intermediate_size": ("tower", "intermediate_size"),
                  "num_attention_heads": ("tower", "num_heads"), "num_hidden_layers": ("tower", "num_layers")}
_MOONVIT_VT = {"vt_" + k: v for k, v in _MOONVIT_PLAIN.items()}
_GEOMETRY = {"patch_size": ("tower", "patch_size"), "merge_kernel_size": ("tower", "merge_kernel")}
_POS_EMB = {f"pos_emb_{s}": ("tower", f"pos_emb_{s}") for s in ("height", "width", "time")}
_MOONVIT_COMMON = {**_GEOMETRY, **{"init_" + k: v for k, v in _POS_EMB.items()}}
# What we implement, where a config may only state it: key -> the one value accepted.
_MOONVIT_FIXED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
                  "num_channels": 3}

_K25_HF = "kimi_k25_vision"  # transformers' vision_config model_type
# Per model_type: vision_config key -> ("tower" | "projector", field). Every other key that is not
# informational or fixed is refused by name: a key we do not read is a fact we would get wrong.
HF_VISION_KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "kimi_k25": {
        **_MOONVIT_VT, **_MOONVIT_COMMON,
        "mm_projector_type": ("projector", "type"),
        "projector_ln_eps": ("projector", "ln_eps"),
        "text_hidden_size": ("projector", "out_dim"),
        "mm_hidden_size": ("check", "hidden_size"),  # the projector's input width: must be the tower's
    },
    # unprefixed MoonViT keys; the projector (LayerNorm eps 1e-5, GELU) is not configurable
    "kimi_vl": {**_MOONVIT_PLAIN, **_MOONVIT_COMMON},
    # transformers' Kimi_K25Config (its save_pretrained; vLLM 0.33 reads it), Kimi-K2.5's second format, told
    # from the release's by the `vt_*` keys: RoPE nested (flattened here), the projector's keys top-level.
    _K25_HF: {**_MOONVIT_PLAIN, **_GEOMETRY, **_POS_EMB, "rope_parameters.rope_theta": ("tower", "rope_theta")},
    # GLM-4.xV: its `hidden_size`/`depth`/`num_heads` describe GLM's own ViT, not MoonViT, so they are
    # refused; `intermediate_size` is the merger's SwiGLU width and `out_hidden_size` its output.
    # A MoonViT tower under a GLM merger states the tower with the `vt_*` keys.
    "glm4v": {
        **_MOONVIT_VT, **_MOONVIT_COMMON,
        "out_hidden_size": ("projector", "out_dim"),
        "intermediate_size": ("projector", "context_dim"),
    },
}
HF_VISION_KEYS["glm4v_moe"] = HF_VISION_KEYS["glm4v"]
_FIXED_BY_TYPE = {"kimi_k25": {"projector_hidden_act": "gelu"}, "glm4v": {"hidden_act": "silu"},
                  "glm4v_moe": {"hidden_act": "silu"},
                  _K25_HF: {"hidden_act": "gelu_pytorch_tanh", "rope_parameters.rope_type": "axial"}}
# Projectors a model_type fixes: Kimi-VL's and transformers' Kimi-K2.5 are the patchmerger, a GLM merger our `glm`.
_PROJECTOR_BY_TYPE = {"kimi_vl": "patchmerger", _K25_HF: "patchmerger", "glm4v": "glm", "glm4v_moe": "glm"}
_K25_HF_TOP = {"projection_hidden_size": ("check", "hidden_size"), "projection_layer_norm_eps": ("projector", "ln_eps")}
_K25_HF_ONLY = {k.split(".")[0] for k in [*HF_VISION_KEYS[_K25_HF], *_FIXED_BY_TYPE[_K25_HF]]}
_K25_HF_ONLY -= set(HF_VISION_KEYS["kimi_k25"])  # what tells transformers' format from the release's


def _format(vision: dict[str, Any], model_type: str, hf_top: bool = False) -> str:
    """The key table of a vision_config: Kimi-K2.5's two formats are told apart by the release's `vt_*`
    keys (transformers' top-level projector keys, `hf_top`, decide a vision_config that states neither)."""
    release, hf = sorted(k for k in vision if k.startswith("vt_")), sorted(set(vision) & _K25_HF_ONLY)
    if model_type == "kimi_k25" and release and hf:
        raise CheckpointError(f"vision_config mixes the original release's keys ({', '.join(release)}) with "
                              f"transformers' Kimi_K25Config keys ({', '.join(hf)})")
    return _K25_HF if model_type == "kimi_k25" and (hf or (hf_top and not release)) else model_type


def _vision_updates(vision: dict[str, Any], model_type: str) -> dict[str, dict[str, Any]]:
    """vision_config -> {"tower": ..., "projector": ..., "check": ...} field updates; unmapped keys
    and unsupported values are one error that names each of them."""
    model_type = _format(vision, model_type)
    if isinstance(rope := vision.get("rope_parameters", ()), dict | None):  # nested: its keys are named flat
        vision = {**{k: v for k, v in vision.items() if k != "rope_parameters"},
                  **{f"rope_parameters.{k}": v for k, v in (rope or {}).items()}}
    table = HF_VISION_KEYS[model_type]
    fixed = {**_MOONVIT_FIXED, **_FIXED_BY_TYPE.get(model_type, {})}
    updates: dict[str, dict[str, Any]] = {"tower": {}, "projector": {}, "check": {}}
    unknown, wrong = [], []
    for key, value in vision.items():
        if key in table:
            part, fld = table[key]
            updates[part][fld] = tuple(value) if fld == "merge_kernel" else value
        elif key in fixed:
            if value != fixed[key]:
                wrong.append(f"{key}={value!r} (only {fixed[key]!r} is implemented)")
        elif key not in _INFO_KEYS:
            unknown.append(key)
    if unknown or wrong:
        problems = ([f"keys {', '.join(sorted(unknown))} do not map onto this model"] if unknown else []) + wrong
        raise CheckpointError(f"vision_config of model_type {model_type!r}: " + "; ".join(problems))
    return updates


def tower_from_hf(vision: dict[str, Any], base: TowerConfig | None = None, model_type: str = "kimi_k25") -> TowerConfig:
    """The tower a vision_config states; keys it does not state keep `base`'s values."""
    update = _vision_updates(vision, model_type)["tower"]
    return TowerConfig.model_validate({**(base or TowerConfig()).model_dump(), **update})


def spec_from_hf_config(config: dict[str, Any], base: ModelSpec, revision: str) -> ModelSpec:
    """Overlay the tower/projector facts of a checkpoint's config.json on a registry spec.

    Each model_type has its table of vision_config keys (HF_VISION_KEYS; Kimi-K2.5 has two formats); a
    key it does not map is an error naming it, never a silent default. Keys the config leaves out keep the
    registry's values. `media_placeholder_token_id` (the release) or `image_token_id` (transformers) is the
    prompt's placeholder_id.
    """
    model_type = config.get("model_type")
    if model_type not in HF_VISION_KEYS or model_type == _K25_HF:
        raise CheckpointError(f"config.json model_type {model_type!r} is not understood; "
                              f"known: {sorted(set(HF_VISION_KEYS) - {_K25_HF})}")
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    top = sorted(k for k in _K25_HF_TOP if k in config)
    fmt = _format(vision, model_type, bool(top))
    if top and fmt != _K25_HF:
        raise CheckpointError(f"config.json keys {', '.join(top)} are transformers' Kimi_K25Config format, "
                              f"but its vision_config is not (model_type {model_type!r}, keys read as {fmt!r})")
    updates = _vision_updates(vision, fmt)
    for key in top:
        updates[_K25_HF_TOP[key][0]][_K25_HF_TOP[key][1]] = config[key]
    proj = {**base.projector.model_dump(), **updates["projector"]}
    if fmt in _PROJECTOR_BY_TYPE:
        proj["type"] = _PROJECTOR_BY_TYPE[fmt]
    if "out_dim" not in updates["projector"] and text.get("hidden_size"):
        proj["out_dim"] = text["hidden_size"]
    try:
        tower = TowerConfig.model_validate({**base.tower.model_dump(), **updates["tower"]})
        projector = ProjectorConfig.model_validate(proj)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"vision_config of model_type {model_type!r}: {e}") from None
    for fld, value in updates["check"].items():
        if value != getattr(tower, fld):
            raise CheckpointError(f"vision_config: the projector takes width {value}, the tower's {fld} is "
                                  f"{getattr(tower, fld)}")
    ids = {config[k] for k in ("media_placeholder_token_id", "image_token_id") if k in config}
    if len(ids) > 1:
        raise CheckpointError(f"config.json: media_placeholder_token_id and image_token_id differ ({sorted(ids)})")
    prompt = base.prompt.model_copy(update={"placeholder_id": ids.pop()}) if ids else base.prompt
    return base.model_copy(update={"tower": tower, "projector": projector, "prompt": prompt, "revision": revision})


# --- Hugging Face preprocessor_config.json -----------------------------------------------------

# Keys with no effect on the pixels: loader bookkeeping, and KimiVLImageProcessor's
# `num_pooled_tokens`, which it stores but no step reads.
_PROCESSOR_INFO_KEYS = frozenset({"auto_map", "image_processor_type", "processor_class", "num_pooled_tokens"})
# KimiVLImageProcessor's constructor defaults: what a key left out means.
_KIMI_VL_DEFAULTS: dict[str, Any] = {
    "in_token_limit": 4096, "patch_size": 14, "merge_kernel_size": [2, 2], "pad_input": False,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# Kimi-K2.5's `media_proc_cfg`: key -> our field; and the keys whose only implemented value is fixed.
_K25_FIELDS = {"in_patch_limit": "in_patch_limit", "patch_limit_on_one_side": "patch_limit_on_one_side",
               "in_patch_limit_each_frame": "in_patch_limit_each_frame", "image_mean": "image_mean",
               "image_std": "image_std", "sample_fps": "video_fps"}
_K25_FIXED = {"fixed_output_tokens": None, "in_patch_limit_video": None, "max_num_frames_each_video": None,
              "timestamp_mode": "hh:mm:ss.fff"}
_K25_INFO = frozenset({"config_type"})


def processor_type(doc: dict[str, Any]) -> str | None:
    """`image_processor_type`, else the class that `auto_map.AutoImageProcessor` names."""
    named = doc.get("image_processor_type")
    auto_map = doc.get("auto_map")
    auto = auto_map.get("AutoImageProcessor") if isinstance(auto_map, dict) else None
    if named is None and isinstance(auto, str):
        named = auto.rsplit(".", 1)[-1]
    if named is None and "media_proc_cfg" in doc:
        named = "KimiK25VisionProcessor"  # the K2.5 layout: everything under media_proc_cfg
    return named


def _check_geometry(patch: Any, merge: Any, tower: TowerConfig, where: str) -> None:
    merge = list(merge) if isinstance(merge, (list, tuple)) else [merge, merge]
    if patch != tower.patch_size or merge != list(tower.merge_kernel):
        raise CheckpointError(f"{where}: patch_size {patch} / merge_kernel_size {merge} differ from the tower's "
                              f"{tower.patch_size} / {list(tower.merge_kernel)}")


def _kimi_vl_processor(doc: dict[str, Any], base: PreprocessConfig, tower: TowerConfig) -> dict[str, Any]:
    unknown = sorted(set(doc) - set(_KIMI_VL_DEFAULTS) - _PROCESSOR_INFO_KEYS)
    if unknown:
        raise CheckpointError(f"preprocessor_config.json (KimiVLImageProcessor): keys {', '.join(unknown)} "
                              "are not implemented")
    cfg = {**_KIMI_VL_DEFAULTS, **doc}
    _check_geometry(cfg["patch_size"], cfg["merge_kernel_size"], tower, "preprocessor_config.json")
    limit = cfg["in_token_limit"]
    return {"policy": "kimi-vl", "in_patch_limit": limit, "in_patch_limit_each_frame": limit,
            "pad_input": cfg["pad_input"], "image_mean": cfg["image_mean"], "image_std": cfg["image_std"],
            "patch_limit_on_one_side": tower.rope_max_positions}


def _kimi_k25_processor(doc: dict[str, Any], base: PreprocessConfig, tower: TowerConfig) -> dict[str, Any]:
    if base.policy != "kimi-k2.5":  # keys left out mean K2.5's defaults, not another policy's values
        base = PreprocessConfig(video_fps=base.video_fps, video_chunk_frames=base.video_chunk_frames)
    unknown = sorted(set(doc) - {"media_proc_cfg"} - _PROCESSOR_INFO_KEYS)
    media = doc.get("media_proc_cfg") or {}
    fixed = {"patch_size": tower.patch_size, "merge_kernel_size": tower.merge_kernel[0],
             "temporal_merge_kernel_size": base.video_chunk_frames, **_K25_FIXED}
    unknown += sorted(set(media) - set(_K25_FIELDS) - set(fixed) - _K25_INFO)
    wrong = [f"{k}={media[k]!r} (only {v!r} is implemented)" for k, v in fixed.items() if k in media and media[k] != v]
    problems = ([f"keys {', '.join(unknown)} are not implemented"] if unknown else []) + wrong
    if problems:
        raise CheckpointError("preprocessor_config.json (Kimi-K2.5 media_proc_cfg): " + "; ".join(problems))
    update = {ours: media[theirs] for theirs, ours in _K25_FIELDS.items() if media.get(theirs) is not None}
    if media.get("in_patch_limit_each_frame", 0) is None:  # upstream: no per-frame limit means the image one
        update["in_patch_limit_each_frame"] = update.get("in_patch_limit", base.in_patch_limit)
    return {**base.model_dump(), "policy": "kimi-k2.5", "pad_input": True, **update}


PROCESSORS = {"KimiVLImageProcessor": _kimi_vl_processor, "KimiK25VisionProcessor": _kimi_k25_processor}


def preprocess_from_hf(doc: dict[str, Any], base: PreprocessConfig, tower: TowerConfig) -> PreprocessConfig:
    """A checkpoint's preprocessor_config.json is the authority on its preprocessing: the policy,
    its limits, mean and std. An unknown processor, or a key that would change the pixels and that
    we do not implement, is refused by name."""
    kind = processor_type(doc)
    if kind not in PROCESSORS:
        raise CheckpointError(f"preprocessor_config.json: image processor {kind!r} is not implemented; "
                              f"known: {sorted(PROCESSORS)}")
    update = PROCESSORS[kind](doc, base, tower)
    try:
        return PreprocessConfig.model_validate({**base.model_dump(), **update})
    except ValueError as e:
        raise CheckpointError(f"preprocessor_config.json ({kind}): {e}") from None
