"""The checkpoint a graph without `llm.checkpoint` serves: a small random Kimi-K2.5 written by
`engines.tiny_checkpoint`, with the same arguments on every site (serve runs it into the run
directory, render-k8s in an init container), so every component reads the same model."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import GraphError
from .schema import Graph


@dataclass(frozen=True)
class GeneratedCheckpoint:
    """It loads torch, so it runs as its own process."""

    preset: str

    MODULE = "mm_encoder.engines.tiny_checkpoint"

    @classmethod
    def of(cls, graph: Graph) -> GeneratedCheckpoint | None:
        return None if graph.llm.checkpoint else cls(graph.llm.preset)

    def argv(self, target: str) -> list[str]:
        """`python -m <MODULE>` arguments that write it into `target`."""
        return [target, "--preset", self.preset]

    def write(self, target: str | Path, python: str = sys.executable) -> None:
        done = subprocess.run([python, "-m", self.MODULE, *self.argv(str(target))], capture_output=True, text=True)
        if done.returncode != 0:
            raise GraphError(f"writing the generated {self.preset} checkpoint into {target} failed:\n"
                             f"{done.stderr[-2000:]}")
