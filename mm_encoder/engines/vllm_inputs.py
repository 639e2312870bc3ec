"""An `EngineRequest` and its fetched bodies -> the input vLLM 0.31's engine takes; no vLLM import.

Two routes, one per model family (which family takes which: its module's `VllmInput`, `families/`;
docs/vllm.md has the table and the vLLM files behind it):

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
from dataclasses import dataclass
from typing import Any

import torch

from ..core.engine_request import EngineRequest
from ..core.errors import BadRequest
from ..families import VllmInput, vllm_inputs
from .inputs import Media


def family_for(architectures: list[str] | tuple[str, ...], hf_config: Any = None) -> VllmInput:
    """The embeddings family of a checkpoint's architectures (its config's own ids and width when
    given; every family's `vllm` facts, `families/`); an architecture no route serves is refused,
    naming the ones that are served."""
    inputs = vllm_inputs().values()
    for arch in architectures:
        for fam in inputs:
            if arch in fam.architectures:
                return fam.with_config(hf_config) if hf_config is not None else fam
    raise ValueError(f"no known embeddings input in vLLM for {list(architectures)}; supported: "
                     f"{sorted(a for f in inputs for a in f.architectures)}")


@dataclass
class Item:
    """One span's rows in prompt order: an image, or one video chunk."""

    mm_hash: str
    modality: str
    offset: int
    grid: tuple[int, int, int]
    rows: torch.Tensor
    uuid: str


def items(req: EngineRequest, media: list[Media], family: VllmInput) -> list[Item]:
    """Each span of each item with its rows, in prompt order, checked against the model (the spans
    against their handles were checked before the fetch, `inputs.fetch_bodies`, each body decoded
    once, `inputs.decode_media`): the width the model takes (before vLLM, whose engine core would
    crash on it), and for the "mm" route the family's token and row count per grid."""
    out = []
    for m in media:
        msg = m.message
        if family.width is not None and msg.shape[1] != family.width:
            raise BadRequest(f"media {m.mm_hash[:12]}: embeddings are {msg.shape[1]} wide; vLLM's "
                             f"{family.name} takes {family.width}")
        start = 0
        for i, ((offset, n), (t, h, w)) in enumerate(zip(m.spans, msg.grid_thws, strict=True)):
            grid = (int(t), int(h), int(w))
            if family.route == "mm":
                token = family.token_ids.get(msg.modality)
                if token is None:
                    raise BadRequest(f"media {m.mm_hash[:12]}: vLLM's {family.name} takes no {msg.modality} "
                                     "embeddings")
                if req.token_ids[offset] != token:
                    raise BadRequest(f"media {m.mm_hash[:12]}: its run is token {req.token_ids[offset]}, "
                                     f"{family.name}'s {msg.modality} placeholder is {token}")
                if family.rows(grid) != n:
                    raise BadRequest(f"media {m.mm_hash[:12]}: grid {list(grid)} has {n} rows; vLLM's "
                                     f"{family.name} slices {family.rows(grid)} rows for it "
                                     f"(t*h*w/{family.merge ** 2})")
            uuid = m.mm_hash if len(m.spans) == 1 else f"{m.mm_hash}:{i}"
            out.append(Item(m.mm_hash, msg.modality, offset, grid, msg.embeds[start : start + n], uuid))
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


def mm_prompt(req: EngineRequest, spans: list[Item], family: VllmInput) -> dict[str, Any]:
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
    if req.cache_salt:  # a tenant's: vLLM's prefix cache shares no block across tenants
        prompt["cache_salt"] = req.cache_salt
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
