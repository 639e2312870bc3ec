"""Model families, one module each: what a family is, in one place, read by every part that serves it.

A family module (`kimi_k25`, `kimi_vl`, `glm4v`, `qwen_vl`) states, as data and small pure
functions, every facet `base.Family` names: its registry spec, its `vision_config` mapping, its
preprocessing policy, its prompt strings, its transformers facts, its vLLM facts and its generated
checkpoint's preset, or `NotServed` with the reason. The code that needs torch, transformers or
vLLM stays in `model/` and `engines/` and looks the facts up here (by `model_type`, by name, by
vLLM architecture, by preprocessing policy). Torch-free; imports only `core`.

Adding a family: one module beside these, and its line in `_register` below (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import NotACheckpoint
from ..core.revision import json_object
from .base import (
    CONTEXT_LENGTH,
    ChatFormat,
    CheckpointWriter,
    Family,
    NotServed,
    PreprocessRule,
    Preset,
    TransformersFacts,
    VisionConfig,
    VisionFormat,
    VllmInput,
    embeds_width,
)

__all__ = [
    "CONTEXT_LENGTH", "ChatFormat", "CheckpointWriter", "Family", "NotServed", "PreprocessRule", "Preset",
    "TransformersFacts", "VisionConfig", "VisionFormat", "VllmInput", "all_families", "by_model_type", "by_name",
    "embeds_width", "preprocess_rule", "presets", "processors", "read_config", "register", "spec_names",
    "vision_configs", "vllm_inputs",
]

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family; its name, model_types, vLLM architectures and presets must be new."""
    taken = {
        "name": set(_FAMILIES),
        "model_type": {t for f in _FAMILIES.values() for t in f.model_types},
        "vLLM architecture": {a for v in vllm_inputs().values() for a in v.architectures},
        "preset": set(presets()),
    }
    mine = {
        "name": {family.name},
        "model_type": set(family.model_types),
        "vLLM architecture": set() if isinstance(family.vllm, NotServed) else {
            a for v in family.vllm for a in v.architectures},
        "preset": set() if isinstance(family.checkpoint, NotServed) else set(family.checkpoint.presets),
    }
    for what, names in mine.items():
        if names & taken[what]:
            raise ValueError(f"family {family.name}: {what} {sorted(names & taken[what])} is another family's")
    _FAMILIES[family.name] = family
    return family


def all_families() -> list[Family]:
    """Every registered family, in registration order."""
    return list(_FAMILIES.values())


def by_name(name: str) -> Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"no model family {name!r}; registered: {sorted(_FAMILIES)}") from None


def by_model_type(model_type: Any) -> Family | None:
    """The family a config.json's `model_type` is served as, if any."""
    return next((f for f in _FAMILIES.values() if model_type in f.model_types), None)


def spec_names() -> dict[str, str]:
    """config.json `model_type` -> the registry model that supplies what config.json does not say
    (preprocessing, prompt)."""
    return {t: f.spec for f in _FAMILIES.values() if isinstance(f.spec, str) for t in f.model_types}


def vision_configs() -> dict[str, VisionConfig]:
    """config.json `model_type` -> how its `vision_config` reads (model_types served elsewhere too)."""
    return {t: f.vision_config for f in _FAMILIES.values() if isinstance(f.vision_config, VisionConfig)
            for t in (*f.model_types, *f.vision_config.also)}


def preprocess_rule(policy: str) -> PreprocessRule:
    """The rule of a `PreprocessConfig.policy`."""
    for f in _FAMILIES.values():
        if isinstance(f.preprocess, PreprocessRule) and f.preprocess.policy == policy:
            return f.preprocess
    raise KeyError(f"no preprocessing policy {policy!r}")


def processors() -> dict[str, PreprocessRule]:
    """Image processor class (preprocessor_config.json) -> the rule whose reader takes it."""
    return {f.preprocess.processor: f.preprocess for f in _FAMILIES.values()
            if isinstance(f.preprocess, PreprocessRule) and f.preprocess.processor}


def vllm_inputs() -> dict[str, VllmInput]:
    """vLLM family name -> how it takes embeddings, over every family."""
    return {v.name: v for f in _FAMILIES.values() if not isinstance(f.vllm, NotServed) for v in f.vllm}


def presets() -> dict[str, Preset]:
    """The generated checkpoint's presets, over every family (`engines.tiny_checkpoint --preset`)."""
    return {k: p for f in _FAMILIES.values() if isinstance(f.checkpoint, CheckpointWriter)
            for k, p in f.checkpoint.presets.items()}


def read_config(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint directory's config.json (what every engine reads first, to pick its family);
    `NotACheckpoint`, a ValueError too, when there is none or it is not a JSON object."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise NotACheckpoint(f"{checkpoint}: no config.json (not a model checkpoint directory)")
    return json_object(path, NotACheckpoint)


def _register() -> None:
    from . import glm4v, kimi_k25, kimi_vl, qwen_vl

    for module in (kimi_k25, kimi_vl, glm4v, qwen_vl):
        register(module.FAMILY)


_register()
