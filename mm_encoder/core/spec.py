"""Model specifications: a model is (tower, projector, preprocessing, prompt).

Specs are plain data validated by pydantic; `configs/` holds one small YAML file per model and per
shared tower. A checkpoint overrides them with its own files: `spec_from_hf_config` reads the tower
and projector from `config.json` (a table of `vision_config` keys per model_type: Kimi-K2.5's `vt_*`,
Kimi-VL's unprefixed ones, GLM-4.xV's merger keys), and `preprocess_from_hf` the preprocessing from
`preprocessor_config.json`. What does not map is refused by name, never defaulted.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import CheckpointError

Grid = tuple[int, int, int]  # (t, h, w): frames and patches per side, before the 2x2 merge


def tokens_for_grid(grid: Grid) -> int:
    """LLM tokens for one image or video chunk: the 2x2 merger pools h*w patches into h*w/4
    tokens, and a video chunk's frames are averaged over time first, so t does not count."""
    _, h, w = grid
    return h * w // 4


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TowerConfig(_Frozen):
    """MoonViT tower hyper-parameters (names follow the architecture, not a checkpoint)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    num_layers: int = 27
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    rope_max_positions: int = 512  # the 2D RoPE table covers 512 x 512 patches
    ln_eps: float = 1e-5

    @model_validator(mode="after")
    def _check(self) -> TowerConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.head_dim % 4:
            raise ValueError("head_dim must be divisible by 4 (2D RoPE: column and row slots)")
        if self.merge_kernel != (2, 2):
            raise ValueError("only the 2x2 sd2_tpool merger is implemented")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]


class ProjectorConfig(_Frozen):
    """Projector from merged tower features (4 * hidden) to the language model's width."""

    type: Literal["patchmerger", "patchmergerv2", "glm"] = "patchmerger"
    out_dim: int
    ln_eps: float = 1e-5
    context_dim: int | None = None  # glm: SwiGLU width

    @model_validator(mode="after")
    def _check(self) -> ProjectorConfig:
        if self.type == "glm" and not self.context_dim:
            raise ValueError("the glm projector needs context_dim")
        return self


PreprocessPolicy = Literal["kimi-k2.5", "kimi-vl"]


class PreprocessConfig(_Frozen):
    """What decides the pixels the model sees; part of mm_hash (see model/hashing.py).

    `policy` is the model's own resize rule (model/preprocess.py has both):
    - "kimi-k2.5": scale down to at most `in_patch_limit` patches (`in_patch_limit_each_frame` for a
      video frame) and `patch_limit_on_one_side` per side; zero-pad to a multiple of patch*merge.
    - "kimi-vl" (KimiVLImageProcessor): scale down to at most `in_patch_limit` patches (its
      `in_token_limit`, counted before the 2x2 merge) with no side cap; zero-pad (`pad_input`) or
      center-crop to whole patches; a side of `patch_limit_on_one_side` patches or more is refused.
      A video frame is an image under the same rule, so both limits are the same number.
    """

    policy: PreprocessPolicy = "kimi-k2.5"
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    in_patch_limit_each_frame: int = 4096
    pad_input: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    video_fps: float = 2.0
    video_chunk_frames: int = 4

    @model_validator(mode="after")
    def _check(self) -> PreprocessConfig:
        if self.policy == "kimi-k2.5" and not self.pad_input:
            raise ValueError("the kimi-k2.5 policy always pads (pad_input must be true)")
        if self.policy == "kimi-vl" and self.in_patch_limit_each_frame != self.in_patch_limit:
            raise ValueError("kimi-vl treats a video frame as an image: in_patch_limit_each_frame must equal "
                             "in_patch_limit")
        return self


class MediaLimits(_Frozen):
    """What input is refused before any work; not part of mm_hash (it changes no output)."""

    max_bytes: int = 64 * 1024 * 1024
    max_pixels: int = 8192 * 8192  # checked from the header, before decoding (bomb guard)
    max_aspect_ratio: float = 200.0
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000  # decoded frames, sampled or not
    # Sampled frames x patches per frame, checked before decoding: what a
    # video costs to decode, hold and encode. 2**21 = 131,072 LLM tokens: ~4 min of HD (4,096-patch
    # frames) or ~8 min of 480p at 2 fps.
    max_video_patches: int = 1 << 21
    # Pixels being decoded at once in the process (None: 4 * max_pixels), and how long a request
    # waits for room before a 503 `overloaded`.
    max_decoding_pixels: int | None = None
    decode_wait_s: float = 30.0
    # Patches prepared for the forward and held at once in the process, all requests together (None:
    # max_video_patches, so the largest video fits alone): what a queue of long videos would otherwise
    # multiply. A request waits decode_wait_s for room, then gets a 503 `overloaded`.
    max_prepared_patches: int | None = None

    @property
    def decoding_capacity(self) -> int:
        return self.max_decoding_pixels or 4 * self.max_pixels

    @property
    def prepared_capacity(self) -> int:
        return self.max_prepared_patches or self.max_video_patches


class PromptConfig(_Frozen):
    """How a media item appears in the prompt; one placeholder token expands to N embeddings.

    The chat template writes `image` (with one `placeholder`) for each image, and one
    `video_placeholder` token for each video; the frontend then replaces that token with one
    `video` prompt per chunk (its timestamp, and one `video_placeholder` that expands to the
    chunk's rows), as the model's own processor does. A model without `video_placeholder` takes
    no video through a chat template.
    """

    image: str
    video: str  # one video chunk's prompt; may contain {timestamp} (hh:mm:ss.fff of its first frame)
    placeholder: str
    placeholder_id: int | None = None
    video_placeholder: str | None = None


class WeightNames(_Frozen):
    """Checkpoint prefixes of the two parts that the encoder loads."""

    tower: str = "vision_tower."
    projector: str = "mm_projector."


class ModelSpec(_Frozen):
    name: str
    aliases: tuple[str, ...] = ()
    revision: str = "random"
    description: str = ""
    tower: TowerConfig
    projector: ProjectorConfig
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    prompt: PromptConfig
    weights: WeightNames = Field(default_factory=WeightNames)
    seed: int = 0  # for deterministic random weights when no checkpoint is given

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def identity(self, preprocess: PreprocessConfig | None = None) -> bytes:
        """Bytes that pin what the model sees and computes: name, revision, processor settings, and
        the version of this project's media pipeline (2: a video's short last chunk keeps its frames)."""
        doc = {
            "pipeline": 2,
            "model": self.name,
            "revision": self.revision,
            "patch_size": self.tower.patch_size,
            "merge_kernel": list(self.tower.merge_kernel),
            "preprocess": (preprocess or self.preprocess).model_dump(mode="json"),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# --- Hugging Face config.json ------------------------------------------------------------------

# model_type -> registry name that supplies what config.json does not say (preprocessing, prompt).
HF_MODEL_TYPES = {"kimi_k25": "kimi-k2.5-vision", "kimi_vl": "kimi-vl-a3b", "glm4v": "glm-5.2-vision"}

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


def file_revision(*blobs: bytes) -> str:
    """A short content id for a checkpoint (its config and index), used as the spec revision."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
    return "ckpt-" + h.hexdigest()[:16]
