"""Write a small random Kimi-K2.5 checkpoint in the released Hugging Face layout.

    python -m mm_encoder.engines.tiny_checkpoint DIR [--preset tiny|small|wide|glm-tiny] [--seed 0]
        [--config-format transformers|original]

What `make up` and the tests serve: one directory, as a real Kimi-K2.5 is, that the encode worker
reads its vision shard from and the engines their language-model shards:
- `config.json` in transformers' `Kimi_K25Config` format (or the original release's `vt_*` format);
- `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`: the language model
  (`language_model.model.*`, per-expert MoE tensors, `language_model.lm_head.weight`) in the first
  shards, the vision tower and projector (`vision_tower.*`, `mm_projector.*`) in the last, as the
  real checkpoint keeps them;
- the tokenizer, chat template and generation config (`engines.model_dir`).
Weights are seeded: the same preset and seed write the same tensors on every machine. The
language model is transformers' own DeepseekV3 (MLA attention, MoE), the vision model this
project's MoonViT with its patchmerger projector. `glm-tiny` is the GLM counterpart
(`glm-5.2-vision`: MoonViT under a GLM merger, GLM-4.1V's text model with M-RoPE, `model_type:
glm4v`; its language model in GLM's names, `model.language_model.*` and `lm_head.weight`). What
differs per family (presets, config.json, tensor names, tokenizer) is its module's `CheckpointWriter`
(`families/<family>.py`); this module is the part that needs torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..families import CONTEXT_LENGTH, CheckpointWriter, Preset, TransformersFacts, by_name, presets
from .model_dir import write_text_files

INDEX_FILE = "model.safetensors.index.json"
PRESETS = presets()  # every family's (families/<family>.py), e.g. `tiny` and `glm-tiny`


def _writer(preset: Preset) -> tuple[CheckpointWriter, TransformersFacts]:
    family = by_name(preset.family)
    assert isinstance(family.checkpoint, CheckpointWriter) and isinstance(family.transformers, TransformersFacts)
    return family.checkpoint, family.transformers


def text_config(preset: Preset, ids: dict[str, int]) -> dict[str, Any]:
    """The text model's config: the family's shared keys, the preset's, the vocabulary and its token ids."""
    writer, _ = _writer(preset)
    return {**writer.text_defaults, **preset.text, "vocab_size": ids["vocab_size"],
            **{key: ids[token] for key, token in writer.text_token_ids.items()}}


def config_json(preset: Preset, ids: dict[str, int], fmt: str = "transformers") -> dict[str, Any]:
    """config.json as the family writes it (Kimi-K2.5: transformers' `Kimi_K25Config` format or the
    original release's)."""
    return _writer(preset)[0].config_json(preset, ids, text_config(preset, ids), fmt)


def language_model_tensors(preset: Preset, ids: dict[str, int], seed: int) -> dict[str, Any]:
    """transformers' text model of the family (DeepseekV3, GLM-4.1V's with an LM head beside it) with
    seeded weights, in the release's names (`CheckpointWriter.release_names`)."""
    import torch
    import transformers

    writer, facts = _writer(preset)
    cfg = getattr(transformers, facts.text_config_class)(
        **{k: v for k, v in text_config(preset, ids).items() if k != "model_type"})
    torch.manual_seed(seed)
    model = getattr(transformers, facts.text_model)(cfg)
    state = dict(model.state_dict())
    if facts.head_apart:
        state["lm_head.weight"] = torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0.0, cfg.initializer_range)
    return {k: v.contiguous() for k, v in writer.release_names(state).items()}


def vision_tensors(preset: Preset, out_dim: int, seed: int) -> dict[str, Any]:
    """This project's MoonViT + the family's projector (patchmerger; GLM's merger for GLM) with
    seeded weights; its names are the released ones."""
    import torch

    from ..core.registry import get_spec
    from ..core.spec import ProjectorConfig, TowerConfig
    from ..model.checkpoint import build_empty, init_random

    family = by_name(preset.family)
    assert isinstance(family.spec, str) and isinstance(family.checkpoint, CheckpointWriter)
    projector = ProjectorConfig(**family.checkpoint.projector(out_dim))
    spec = get_spec(family.spec).model_copy(update={"tower": TowerConfig(**preset.vision), "projector": projector})
    model = init_random(build_empty(spec), seed, torch.device("cpu"), torch.float32)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def write_checkpoint(path: str | Path, preset: str = "tiny", *, seed: int = 0,
                     config_format: str = "transformers") -> Path:
    """Write the whole directory (weights, config, tokenizer); returns its path."""
    from safetensors.torch import save_file

    p = PRESETS[preset]
    path = Path(path)
    ids = write_text_files(path, family=p.family, vocab_size=p.vocab_size, context_length=CONTEXT_LENGTH)
    config = config_json(p, ids, config_format)
    lm = language_model_tensors(p, ids, seed)
    vision = vision_tensors(p, p.text["hidden_size"], seed + 1)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in lm.items():  # the language model first, cut at shard_bytes; the vision part last
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > p.shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    shards.append(vision)
    total = len(shards)
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    nbytes = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": nbytes},
                                               "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mm_encoder.engines.tiny_checkpoint",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path, help="directory to write (created)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-format", choices=("transformers", "original"), default="transformers")
    args = ap.parse_args(argv)
    print(write_checkpoint(args.dir, args.preset, seed=args.seed, config_format=args.config_format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
