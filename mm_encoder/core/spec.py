"""Model specifications: a model is (tower, projector, preprocessing, prompt).

Specs are plain data validated by pydantic; `configs/` holds one small YAML file per model and per
shared tower. A checkpoint overrides them with its own files (`model/hf_config.py`, beside the
loader); here only what every process reads of a checkpoint: its revision. Which registry model a
`model_type` is, is its model family's (`families/`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

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


PreprocessPolicy = Literal["kimi-k2.5", "kimi-vl"]


class PreprocessConfig(_Frozen):
    """What decides the pixels the model sees; part of mm_hash (see model/hashing.py).

    `policy` is the model's own resize rule (its family module states it, `families/`; model/preprocess.py
    applies it):
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
# Which registry model a config.json `model_type` is: its family's (`families.spec_names`).


def file_revision(*blobs: bytes) -> str:
    """A short content id for a checkpoint (its config and index), used as the spec revision."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
    return "ckpt-" + h.hexdigest()[:16]
