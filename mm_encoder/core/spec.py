"""Model specifications: a model is (tower, projector, preprocessing, prompt).

Specs are plain data validated by pydantic; `configs/` holds one small YAML file per model and per
shared tower. `spec_from_hf_config` reads the same facts from a Hugging Face style `config.json`
(the real Kimi-K2.5 `vision_config` keys, or Kimi-VL's unprefixed ones).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class PreprocessConfig(_Frozen):
    """What decides the pixels the model sees; part of mm_hash (see model/hashing.py)."""

    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    in_patch_limit_each_frame: int = 4096
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    video_fps: float = 2.0
    video_chunk_frames: int = 4


class MediaLimits(_Frozen):
    """What input is refused before any work; not part of mm_hash (it changes no output)."""

    max_bytes: int = 64 * 1024 * 1024
    max_pixels: int = 8192 * 8192  # checked from the header, before decoding (bomb guard)
    max_aspect_ratio: float = 200.0
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000  # decoded frames, sampled or not
    # Sampled frames (padded to whole chunks) x patches per frame, checked before decoding: what a
    # video costs to decode, hold and encode. 2**21 = 131,072 LLM tokens: ~4 min of HD (4,096-patch
    # frames) or ~8 min of 480p at 2 fps.
    max_video_patches: int = 1 << 21
    # Pixels being decoded at once in the process (None: 4 * max_pixels), and how long a request
    # waits for room before a 503 `overloaded`.
    max_decoding_pixels: int | None = None
    decode_wait_s: float = 30.0


class PromptConfig(_Frozen):
    """How a media item appears in the prompt; one placeholder token expands to N embeddings."""

    image: str
    video: str  # may contain {timestamp} (hh:mm:ss.fff of the chunk's first frame)
    placeholder: str
    placeholder_id: int | None = None


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
        """Bytes that pin what the model sees and computes: name, revision, processor settings."""
        doc = {
            "model": self.name,
            "revision": self.revision,
            "patch_size": self.tower.patch_size,
            "merge_kernel": list(self.tower.merge_kernel),
            "preprocess": (preprocess or self.preprocess).model_dump(mode="json"),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# --- Hugging Face config.json ------------------------------------------------------------------

# model_type -> registry name that supplies what config.json does not say (preprocessing, prompt).
HF_MODEL_TYPES = {"kimi_k25": "kimi-k2.5-vision", "kimi_vl": "kimi-vl-a3b"}


def _pick(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in cfg:
            return cfg[key]
    return default


def tower_from_hf(vision: dict[str, Any]) -> TowerConfig:
    """Kimi-K2.5 uses `vt_*` keys; Kimi-VL uses unprefixed ones. Both are accepted."""
    merge = _pick(vision, "merge_kernel_size", default=(2, 2))
    if vision.get("merge_type", "sd2_tpool") != "sd2_tpool":
        raise ValueError(f"unsupported merge_type {vision['merge_type']!r}")
    return TowerConfig(
        hidden_size=_pick(vision, "vt_hidden_size", "hidden_size", default=1152),
        intermediate_size=_pick(vision, "vt_intermediate_size", "intermediate_size", default=4304),
        num_heads=_pick(vision, "vt_num_attention_heads", "num_attention_heads", default=16),
        num_layers=_pick(vision, "vt_num_hidden_layers", "num_hidden_layers", default=27),
        patch_size=_pick(vision, "patch_size", default=14),
        pos_emb_height=_pick(vision, "init_pos_emb_height", default=64),
        pos_emb_width=_pick(vision, "init_pos_emb_width", default=64),
        pos_emb_time=_pick(vision, "init_pos_emb_time", default=4),
        merge_kernel=tuple(merge),
    )


def spec_from_hf_config(config: dict[str, Any], base: ModelSpec, revision: str) -> ModelSpec:
    """Overlay the tower/projector facts of a checkpoint's config.json on a registry spec."""
    vision = config.get("vision_config") or {}
    text = config.get("text_config") or {}
    tower = tower_from_hf(vision)
    out_dim = _pick(vision, "text_hidden_size", default=None) or text.get("hidden_size") or base.projector.out_dim
    projector = base.projector.model_copy(
        update={
            "type": _pick(vision, "mm_projector_type", default=base.projector.type),
            "out_dim": int(out_dim),
            "ln_eps": float(_pick(vision, "projector_ln_eps", default=base.projector.ln_eps)),
        }
    )
    ProjectorConfig.model_validate(projector.model_dump())
    prompt = base.prompt
    if "media_placeholder_token_id" in config:
        prompt = prompt.model_copy(update={"placeholder_id": config["media_placeholder_token_id"]})
    return base.model_copy(
        update={"tower": tower, "projector": projector, "prompt": prompt, "revision": revision}
    )


def file_revision(*blobs: bytes) -> str:
    """A short content id for a checkpoint (its config and index), used as the spec revision."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
    return "ckpt-" + h.hexdigest()[:16]
