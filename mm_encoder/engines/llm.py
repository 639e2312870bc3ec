"""The checkpoint's own language model, run through transformers' model classes.

`LanguageModel.load(checkpoint)` reads `config.json` and opens only the shards that hold the
language model (a real Kimi-K2.5 keeps its vision tower apart: the encode worker loads that part).
Per family (the checkpoint's `model_type`):
- `kimi_k25`: the text model is transformers' DeepseekV3 (MLA attention, MoE; plain RoPE). Tensor
  names are the release's (`language_model.model.*`, `language_model.lm_head.*`, per-expert MoE
  weights, which transformers' own conversion fuses), what transformers' `save_pretrained` writes
  (`language_model.model.blocks.*`), or transformers' in-memory names (`model.language_model.*`,
  `lm_head.*`, experts already fused).
- `glm4v`: GLM-4.1V's text model with M-RoPE (`model.language_model.*`, `lm_head.*`): positions are
  3-D, from each image's grid, computed by transformers' own `Glm4vModel.get_rope_index`.
- `kimi_vl` and anything else: refused at start-up with what would serve it.
Each family's classes, tensor-name rules and M-RoPE flag are its module's `TransformersFacts`
(`families/`); this module holds what runs them.

`load(..., monolithic=True)` loads the whole transformers model instead (vision tower included):
the aggregated baseline, which is also what the equality tests compare against. Either way the engine
sees one interface: `embed`, `forward` (a prefill or a step, with a transformers KV cache) and
`positions`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.errors import CheckpointError
from ..families import Family, NotServed, TransformersFacts, all_families, by_model_type, read_config

if TYPE_CHECKING:  # transformers is not analysed (pyproject's [tool.mypy]): these are Any to mypy
    from transformers import Cache, PreTrainedConfig

# transformers' M-RoPE index: (input ids [1, T], token types [1, T], grids [n, 3]) -> (position ids [3, 1, T], deltas)
RopeIndex = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


def family_of(config: dict[str, Any], checkpoint: Path) -> Family:
    """The checkpoint's family, where the transformers engine serves it; else refused with the reason."""
    family = by_model_type(config.get("model_type"))
    if family is not None and isinstance(family.transformers, NotServed):
        raise CheckpointError(f"{checkpoint}: {family.transformers.reason}")
    if family is None:
        served = sorted(t for f in all_families() if isinstance(f.transformers, TransformersFacts)
                        for t in f.model_types)
        raise CheckpointError(f"{checkpoint}: model_type {config.get('model_type')!r} has no engine here; this "
                              f"engine serves {served} through transformers")
    return family


def facts(family: Family) -> TransformersFacts:
    """The family's transformers facts (`family_of` refused the families without)."""
    assert isinstance(family.transformers, TransformersFacts), family.name
    return family.transformers


def hf_config(config: dict[str, Any], family: Family) -> PreTrainedConfig:
    """transformers' config object for the whole model (it reads both Kimi-K2.5 formats)."""
    import transformers

    cls = getattr(transformers, facts(family).config_class)
    return cls.from_dict({k: v for k, v in config.items() if k != "transformers_version"})


class _CausalLM(nn.Module):
    """A text model and its LM head: logits for the last position only, as `generate` computes them."""

    def __init__(self, base: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.base, self.lm_head = base, lm_head

    def forward(self, inputs_embeds: torch.Tensor, cache: Cache | None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Cache]:
        out = self.base(inputs_embeds=inputs_embeds, cache=cache, use_cache=True, position_ids=position_ids)
        return self.lm_head(out.last_hidden_state[:, -1:, :])[0, -1], out.cache


class LanguageModel:
    """One checkpoint's language model on one device; not thread-safe (the engine runs it on one thread)."""

    def __init__(self, family: Family, config: dict[str, Any], lm: _CausalLM, *, device: torch.device,
                 dtype: torch.dtype, monolithic: nn.Module | None = None) -> None:
        self.family, self.config, self.lm = family, config, lm
        self.device, self.dtype = device, dtype
        self.monolithic = monolithic  # the whole transformers model (vision tower too): the aggregated baseline
        self.hf_config = hf_config(config, family)
        text = self.hf_config.text_config
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = text.vocab_size
        self.context_length: int = text.max_position_embeddings
        self._rope_index: RopeIndex | None = None

    # --- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, checkpoint: str | Path, *, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, monolithic: bool = False) -> LanguageModel:
        """The language model alone, from the shards that hold it; or, `monolithic`, the whole
        model as transformers loads it (its own vision tower on pixel values), where transformers
        has the checkpoint's vision tower (else the language model alone: the aggregated engine
        then runs this project's encoder in-process)."""
        import transformers

        checkpoint = Path(checkpoint)
        config = read_config(checkpoint)
        family = family_of(config, checkpoint)
        _quiet_transformers()
        whole = None
        if monolithic and (whole_class := facts(family).monolithic):
            whole = getattr(transformers, whole_class).from_pretrained(str(checkpoint), dtype=dtype)
            whole = whole.to(device).eval()
            lm = _CausalLM(whole.model.language_model, whole.lm_head)
        else:
            cfg = hf_config(config, family)
            text_cfg = cfg.text_config
            text_cfg.tie_word_embeddings = cfg.tie_word_embeddings  # what transformers' whole model does
            model = _from_state_dict(family, text_cfg, _language_model_tensors(checkpoint, family), dtype, checkpoint)
            lm = model if isinstance(model, _CausalLM) else _CausalLM(model.model, model.lm_head)
            lm = lm.to(device).eval()
        return cls(family, config, lm, device=torch.device(device), dtype=dtype, monolithic=whole)

    # --- running -----------------------------------------------------------------------------

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """[T, hidden] token embeddings (the rows a media item overwrites included)."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.lm.base.get_input_embeddings()(ids)

    def forward(self, inputs_embeds: torch.Tensor, cache: Cache | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Cache]:
        """A prefill ([T, hidden] after `cache`'s positions) or a step: (last position's logits [V], cache)."""
        pos = None if position_ids is None else position_ids.to(self.device)[:, None, :]
        logits, cache = self.lm(inputs_embeds.to(self.dtype)[None], cache, pos)
        return logits, cache

    def positions(self, token_ids: list[int], media: list[tuple[str, list[tuple[int, int]], list[list[int]]]]
                  ) -> torch.Tensor | None:
        """M-RoPE position ids [3, T] for a prompt (None for plain RoPE: positions follow the cache).
        `media`: per item its modality, its (offset, rows) spans and its grids (t, h, w) in patches."""
        if not facts(self.family).mrope:
            return None
        ids = torch.tensor([token_ids], dtype=torch.long)
        types = torch.zeros_like(ids, dtype=torch.int32)
        grids = []
        for modality, spans, item_grids in media:
            for (offset, n), grid in zip(spans, item_grids, strict=True):
                types[0, offset : offset + n] = 1 if modality == "image" else 2
                grids.append(grid)
        position_ids, _ = self._get_rope_index()(ids, types, torch.tensor(grids or [[1, 1, 1]], dtype=torch.long))
        return position_ids[:, 0, :]

    def _get_rope_index(self) -> RopeIndex:
        """transformers' own M-RoPE index (a method of the whole GLM model; it reads only the merge size)."""
        if self._rope_index is None:
            from types import SimpleNamespace

            from transformers.models.glm4v.modeling_glm4v import Glm4vModel

            owner = SimpleNamespace(config=self.hf_config)
            owner.get_vision_position_ids = Glm4vModel.get_vision_position_ids.__get__(owner)
            self._rope_index = lambda ids, types, grids: Glm4vModel.get_rope_index(
                owner, ids, types, image_grid_thw=grids)
        return self._rope_index


def _quiet_transformers() -> None:
    """transformers prints a load report table to stdout; the engine reports problems itself."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _language_model_tensors(checkpoint: Path, family: Family) -> dict[str, torch.Tensor]:
    """The text model's tensors, renamed to transformers' names, from only the shards that hold them."""
    from safetensors import safe_open

    if (checkpoint / INDEX_FILE).is_file():
        weight_map = json.loads((checkpoint / INDEX_FILE).read_text())["weight_map"]
    elif (checkpoint / SINGLE_FILE).is_file():
        with safe_open(checkpoint / SINGLE_FILE, framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
    else:
        raise CheckpointError(f"{checkpoint}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    renames = facts(family).renames
    rules = [(re.compile(p), r) for p, r in renames]
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for name, shard in weight_map.items():
        for pattern, repl in rules:
            if pattern.match(name):
                by_shard.setdefault(shard, []).append((name, pattern.sub(repl, name, count=1)))
                break
    if not by_shard:
        raise CheckpointError(f"{checkpoint}: no language-model tensors (expected names like "
                              f"{renames[-1][0].lstrip('^').replace(chr(92), '')}...)")
    out: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        if not (checkpoint / shard).is_file():
            raise CheckpointError(f"{checkpoint}: shard {shard} (holds {len(names)} language-model tensors) is missing")
        with safe_open(checkpoint / shard, framework="pt") as f:
            for theirs, ours in names:
                out[ours] = f.get_tensor(theirs)
    log.info("language model: %d tensors from %d shards of %s", len(out), len(by_shard), checkpoint)
    return out


def _from_state_dict(family: Family, text_cfg: PreTrainedConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     checkpoint: Path) -> nn.Module:
    """transformers' text model filled from `state` by its own loader (it fuses MoE experts); any
    missing, unexpected or mis-shaped tensor is an error that names it."""
    import transformers

    text_model = getattr(transformers, facts(family).text_model)
    if not facts(family).head_apart:
        model, info = text_model.from_pretrained(
            None, config=text_cfg, state_dict=state, dtype=dtype, output_loading_info=True)
    else:  # GLM: the text model, then its head
        head = state.pop("lm_head.weight", None)
        base_state = {k.removeprefix("model."): v for k, v in state.items()}
        base, info = text_model.from_pretrained(
            None, config=text_cfg, state_dict=base_state, dtype=dtype, output_loading_info=True)
        if head is None and not text_cfg.tie_word_embeddings:
            info["missing_keys"] = {*info["missing_keys"], "lm_head.weight"}
        lm_head = nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False, dtype=dtype)
        with torch.no_grad():
            lm_head.weight.copy_(head if head is not None else base.embed_tokens.weight)
        model = _CausalLM(base, lm_head)
    problems = [f"missing tensor {k}" for k in sorted(info["missing_keys"])]
    problems += [f"unexpected tensor {k}" for k in sorted(info["unexpected_keys"])]
    problems += [f"tensor {k[0] if isinstance(k, tuple) else k} has the wrong shape"
                 for k in sorted(info["mismatched_keys"], key=str)]
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint} does not match its language model "
                              f"({family.name}):\n  " + "\n  ".join(problems))
    return model.eval()
