"""Model registry: one YAML file per model in `configs/models/`, shared towers in `configs/towers/`.

A model file names its tower (`tower: moonvit`) or gives one inline, plus projector, prompt and
aliases. Lookups accept the model name or any served alias, case-insensitively.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import yaml

from .errors import UnknownModelError
from .spec import ModelSpec

DEFAULT_MODEL = "tiny"
_PKG = Path(__file__).resolve().parents[1]  # the mm_encoder package


def config_dir() -> Path:
    """`$MM_ENCODER_CONFIGS`, else the copy inside an installed wheel, else the source tree's."""
    for candidate in (os.environ.get("MM_ENCODER_CONFIGS"), _PKG / "_configs", _PKG.parent / "configs"):
        if candidate and (Path(candidate) / "models").is_dir():
            return Path(candidate)
    raise FileNotFoundError("no model configs found (set MM_ENCODER_CONFIGS to a configs/ directory)")


def _load_yaml(path: Path) -> dict[str, Any]:
    with path.open() as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping")
    return doc


def load_spec_file(path: Path, towers_dir: Path | None = None) -> ModelSpec:
    doc = _load_yaml(path)
    tower = doc.get("tower")
    if isinstance(tower, str):
        tower_file = (towers_dir or path.parent.parent / "towers") / f"{tower}.yaml"
        doc["tower"] = _load_yaml(tower_file)
    return ModelSpec.model_validate(doc)


@functools.lru_cache(maxsize=8)
def _registry(root: Path) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for path in sorted((root / "models").glob("*.yaml")):
        spec = load_spec_file(path, root / "towers")
        for served in spec.served_names:
            key = served.lower()
            if key in specs:
                raise ValueError(f"{path}: served name {served!r} already used by {specs[key].name}")
            specs[key] = spec
    return specs


def get_spec(name: str) -> ModelSpec:
    """The spec served under `name` (model name or alias)."""
    specs = _registry(config_dir())
    try:
        return specs[name.lower()]
    except KeyError:
        raise UnknownModelError(name, served_names()) from None


def list_models() -> list[ModelSpec]:
    seen: dict[str, ModelSpec] = {}
    for spec in _registry(config_dir()).values():
        seen.setdefault(spec.name, spec)
    return list(seen.values())


def served_names() -> list[str]:
    return sorted(n for spec in list_models() for n in spec.served_names)
