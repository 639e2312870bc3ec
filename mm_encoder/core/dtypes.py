"""The dtypes' one vocabulary: the short names users write (`--dtype fp32`, a graph's `llm.dtype`)
and torch's names, which the wire, the encode requests and vLLM's `--dtype` spell. Every component
translates through here, so `fp32` means float32 from the tower to the engine."""

from __future__ import annotations

from typing import Literal

ShortName = Literal["fp32", "bf16", "fp16"]
TorchName = Literal["float32", "bfloat16", "float16"]  # the wire's names (wire-v1 `dtype`)
TORCH_NAMES: dict[str, TorchName] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element, by torch's name


def torch_name(name: str) -> TorchName:
    """`name` in either spelling (any case) -> torch's; a ValueError naming the known ones otherwise."""
    key = name.lower()
    if key in TORCH_NAMES:
        return TORCH_NAMES[key]
    for torch_spelling in TORCH_NAMES.values():
        if key == torch_spelling:
            return torch_spelling
    raise ValueError(f"unknown dtype {name!r}; use one of {', '.join([*TORCH_NAMES, *TORCH_NAMES.values()])}")


def size(name: str) -> int:
    """Bytes per element of the dtype `name` (either spelling)."""
    return SIZES[torch_name(name)]
