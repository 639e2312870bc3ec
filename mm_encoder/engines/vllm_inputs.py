"""An `EngineRequest` and its fetched bodies -> the input vLLM 0.31's engine takes; no vLLM import.

Two routes, one per model family (docs/vllm.md has the table and the vLLM files behind it):

- **mixed prompt embeddings** (`route="embeds"`: Kimi-K2.5, Kimi-VL's text backbone): the prompt as
  the frontend expanded it, every media row's embedding in a dense `[seq, hidden]` tensor and a mask
  saying which positions are token ids (vLLM's `EmbedsInput`, `--enable-prompt-embeds`). vLLM's
  own multimodal code for these models takes pixels only; this route needs none of it, so the
  engine is started with the vision tower left out (`limit_mm_per_prompt` 0).
- **per-modality embeddings dict** (`route="mm"`: Qwen2/2.5/3-VL, GLM-4.xV with this package's
  vLLM plugin): one placeholder per item and `{"image": {"image_embeds", "image_grid_thw"}}`; vLLM
  expands each placeholder itself (in 0.31 `BaseMultiModalProcessor.apply` always runs
  `_maybe_apply_prompt_updates` -> `_apply_prompt_updates` on the token prompt; there is no
  "already applied" flag any more, so an expanded run would be expanded twice) and computes M-RoPE
  positions from the grids.

Every body is checked against the model before vLLM sees it (width, grid rows, placeholder token):
vLLM's own checks come later, some only in the engine core, where a wrong width crashes the core.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ..core import wire
from ..core.engine_request import EngineRequest
from ..core.errors import BadRequest


@dataclass(frozen=True)
class Family:
    """How one vLLM model family takes embeddings.

    `route="mm"`: the placeholder token vLLM expands per item, the keys of its per-modality dict
    and the merge size (rows per grid = t*h*w // merge**2, the slicing its field config applies).
    `route="embeds"`: the modalities the prompt may hold (any token ids; vLLM reads the rows) and
    what `limit_mm_per_prompt` leaves the vision tower out with."""

    name: str
    architectures: tuple[str, ...]
    route: Literal["mm", "embeds"] = "mm"
    token_ids: Mapping[str, int] = field(default_factory=dict)  # modality -> placeholder id ("mm")
    merge: int = 2
    width: int | None = None  # the embeddings' width the model takes, from the checkpoint's config
    no_tower: Mapping[str, int] = field(default_factory=dict)  # limit_mm_per_prompt that skips the tower
    deepstack: bool = False  # Qwen3-VL: rows carry the main and every deepstack level, side by side
    vllm_architecture: str | None = None  # the name vLLM registers, when the config states another
    deepseek: bool = False  # the text model is vLLM's DeepseekV2/V3 (MLA + MoE): `engines.vllm` completes its config

    def rows(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def with_config(self, hf_config: Any) -> Family:
        """The ids, merge size and embeddings width a checkpoint's config states."""
        ids = dict(self.token_ids)
        for m in ids:
            value = _get(hf_config, f"{m}_token_id")
            if isinstance(value, int):
                ids[m] = value
        vision = _get(hf_config, "vision_config")
        merge = _get(vision, "spatial_merge_size")
        return replace(self, token_ids=ids, merge=merge if isinstance(merge, int) else self.merge,
                       width=embeds_width(hf_config, deepstack=self.deepstack))


def _get(obj: Any, key: str) -> Any:
    """A config field from a transformers config object or a config.json dict."""
    if obj is None:
        return None
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def embeds_width(hf_config: Any, *, deepstack: bool = False) -> int | None:
    """The width vLLM's model takes an item's rows in: the text model's hidden size, except
    Qwen3-VL, which splits its rows into the main embedding and one per deepstack level
    (`out_hidden_size x (1 + len(deepstack_visual_indexes))`, `_compute_deepstack_embeds`)."""
    vision = _get(hf_config, "vision_config")
    if deepstack and _get(vision, "out_hidden_size"):
        return int(_get(vision, "out_hidden_size")) * (1 + len(_get(vision, "deepstack_visual_indexes") or ()))
    text = _get(hf_config, "text_config")
    width = _get(text, "hidden_size") or _get(hf_config, "hidden_size")
    return int(width) if width else None


_QWEN_IDS = {"image": 151655, "video": 151656}  # <|image_pad|>, <|video_pad|>
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2_vl", ("Qwen2VLForConditionalGeneration",), token_ids=_QWEN_IDS),
    Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), token_ids=_QWEN_IDS),
    # Video left out: vLLM's Qwen3-VL expands a video into per-frame timestamped runs, which needs
    # frame metadata a wire body does not carry (not verified, so refused).
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
           token_ids={"image": 151655}, deepstack=True),
    # GLM-4.xV: vLLM's model and field config take image embeddings; its data parser does only with
    # this package's plugin (engines/vllm_glm.py, loaded by vLLM through its entry point). Images only.
    Family("glm4v", ("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
                     "Glm5NextForConditionalGeneration"), token_ids={"image": 151343}),
    Family("kimi_k25", ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"), route="embeds",
           no_tower={"vision_chunk": 0}, vllm_architecture="KimiK25ForConditionalGeneration", deepseek=True),
    Family("kimi_vl", ("KimiVLForConditionalGeneration",), route="embeds", no_tower={"image": 0}, deepseek=True),
)}


def family_for(architectures: list[str] | tuple[str, ...], hf_config: Any = None) -> Family:
    """The embeddings family of a checkpoint's architectures (its config's own ids and width when
    given); an architecture no route serves is refused, naming the ones that are served."""
    for arch in architectures:
        for fam in FAMILIES.values():
            if arch in fam.architectures:
                return fam.with_config(hf_config) if hf_config is not None else fam
    raise ValueError(f"no known embeddings input in vLLM for {list(architectures)}; supported: "
                     f"{sorted(a for f in FAMILIES.values() for a in f.architectures)}")


@dataclass
class Item:
    """One span's rows in prompt order: an image, or one video chunk."""

    mm_hash: str
    modality: str
    offset: int
    grid: tuple[int, int, int]
    rows: torch.Tensor
    uuid: str


def items(req: EngineRequest, bodies: list[bytes], family: Family) -> list[Item]:
    """Each span of each item with its rows, in prompt order, checked against the model (the spans
    against their handles were checked before the fetch, `inputs.fetch_bodies`): the width the
    model takes (before vLLM, whose engine core would crash on it), and for the "mm" route the
    family's token and row count per grid."""
    out = []
    for media, body in zip(req.media, bodies, strict=True):
        msg = wire.decode(body)
        if family.width is not None and msg.shape[1] != family.width:
            raise BadRequest(f"media {media.mm_hash[:12]}: embeddings are {msg.shape[1]} wide; vLLM's "
                             f"{family.name} takes {family.width}")
        start = 0
        for i, ((offset, n), grid) in enumerate(zip(media.spans, msg.grid_thws, strict=True)):
            grid = tuple(int(g) for g in grid)
            if family.route == "mm":
                token = family.token_ids.get(msg.modality)
                if token is None:
                    raise BadRequest(f"media {media.mm_hash[:12]}: vLLM's {family.name} takes no {msg.modality} "
                                     "embeddings")
                if req.token_ids[offset] != token:
                    raise BadRequest(f"media {media.mm_hash[:12]}: its run is token {req.token_ids[offset]}, "
                                     f"{family.name}'s {msg.modality} placeholder is {token}")
                if family.rows(grid) != n:
                    raise BadRequest(f"media {media.mm_hash[:12]}: grid {list(grid)} has {n} rows; vLLM's "
                                     f"{family.name} slices {family.rows(grid)} rows for it "
                                     f"(t*h*w/{family.merge ** 2})")
            uuid = media.mm_hash if len(media.spans) == 1 else f"{media.mm_hash}:{i}"
            out.append(Item(media.mm_hash, msg.modality, offset, grid, msg.embeds[start : start + n], uuid))
            start += n
    out.sort(key=lambda it: it.offset)  # vLLM pairs a modality's items with its placeholders in order
    for a, b in itertools.pairwise(out):
        if b.offset < a.offset + len(a.rows):
            raise BadRequest(f"media spans overlap at token {b.offset}")
    return out


@dataclass
class MixedPrompt:
    """What `vllm.inputs.embeds_input` takes: every position's token id (any id on media rows;
    vLLM zeroes them), the mask of token positions, and the dense embeddings (zeros on tokens)."""

    token_ids: list[int]
    is_token_ids: list[bool]
    embeds: torch.Tensor  # [len(token_ids), hidden], the model's dtype


def mixed_prompt(req: EngineRequest, spans: list[Item], dtype: torch.dtype) -> MixedPrompt:
    """The "embeds" route: the expanded prompt as it is, its media rows written into a dense tensor."""
    width = spans[0].rows.shape[1]
    embeds = torch.zeros(len(req.token_ids), width, dtype=dtype)
    mask = [True] * len(req.token_ids)
    for it in spans:
        embeds[it.offset : it.offset + len(it.rows)] = it.rows.to(dtype)
        mask[it.offset : it.offset + len(it.rows)] = [False] * len(it.rows)
    return MixedPrompt(list(req.token_ids), mask, embeds)


def mm_prompt(req: EngineRequest, spans: list[Item], family: Family) -> dict[str, Any]:
    """The "mm" route: a TokensPrompt dict with each run collapsed to its placeholder, the items'
    rows concatenated per modality, their grids stacked and their mm_hashes as vLLM's uuids."""
    parts: dict[str, tuple[list[torch.Tensor], list[tuple[int, int, int]], list[str]]] = {}
    for it in spans:
        embeds, grids, uuids = parts.setdefault(it.modality, ([], [], []))
        embeds.append(it.rows)
        grids.append(it.grid)
        uuids.append(it.uuid)
    prompt: dict[str, Any] = {"prompt_token_ids": collapse_runs(req.token_ids, [(it.offset, len(it.rows))
                                                                                for it in spans])}
    if parts:
        prompt["multi_modal_data"] = {m: {f"{m}_embeds": torch.cat(e), f"{m}_grid_thw": torch.tensor(g)}
                                      for m, (e, g, _) in parts.items()}
        prompt["multi_modal_uuids"] = {m: u for m, (_, _, u) in parts.items()}
    return prompt


def collapse_runs(token_ids: list[int], runs: list[tuple[int, int]]) -> list[int]:
    """Each (offset, length) placeholder run replaced by its first token: the prompt vLLM's
    processor expects before it applies its own replacement."""
    out: list[int] = []
    pos = 0
    for offset, n in sorted(runs):
        if offset < pos:
            raise BadRequest(f"media spans overlap at token {offset}")
        out += token_ids[pos : offset + 1]
        pos = offset + n
    return out + token_ids[pos:]


def block_digests(embeds: torch.Tensor, block_size: int) -> list[bytes]:
    """sha256 of each full block's rows, as vLLM keys a prompt-embeds block (`kv_cache_utils.
    _gen_prompt_embeds_extra_hash_keys`: the bytes of `prompt_embeds[start:end]`), which its KV
    events carry: how `vllm_kv.KvRelay` tells which blocks of which prompt an event stores. The
    last entry covers the prompt's partial last block, which vLLM hashes once generated tokens fill it."""
    flat = embeds.contiguous()
    return [hashlib.sha256(flat[i : i + block_size].reshape(-1).view(torch.uint8).numpy()).digest()
            for i in range(0, len(flat), block_size)]
