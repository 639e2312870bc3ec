"""The graphs shipped with the package (the repository's `graphs/`, `mm_encoder/_graphs/` in a wheel):
`serve` and `render-k8s` take a graph file or a shipped graph's name (`epd` is `graphs/epd.yaml`),
and `mm-encoder graphs` lists them."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import GraphError

_PKG = Path(__file__).resolve().parents[1]  # the mm_encoder package


def graphs_dir() -> Path:
    """`$MM_ENCODER_GRAPHS`, else the copy inside an installed wheel, else the source tree's `graphs/`."""
    for candidate in (os.environ.get("MM_ENCODER_GRAPHS"), _PKG / "_graphs", _PKG.parent / "graphs"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise GraphError("no shipped graphs found (set MM_ENCODER_GRAPHS to a graphs/ directory)")


def shipped_graphs() -> dict[str, str]:
    """Each shipped graph's name (its file's stem), sorted -> its file's first comment line."""
    out = {}
    for path in sorted(graphs_dir().glob("*.yaml"), key=lambda p: p.stem):
        lines = path.read_text(encoding="utf-8").splitlines()
        out[path.stem] = next((line.lstrip("#").strip() for line in lines if line.startswith("#")), "")
    return out


def find_graph(ref: str | Path) -> Path:
    """A graph file: `ref` itself where it is a file, else the shipped graph a bare name (`epd`,
    `epd.yaml`) names; anything else is a GraphError that lists the shipped names."""
    path = Path(ref)
    if path.is_file():
        return path
    bare = path.name == str(ref) and path.name not in ("", ".", "..")  # no directory part
    if bare:
        try:
            shipped = graphs_dir() / f"{path.name.removesuffix('.yaml')}.yaml"
        except GraphError as e:
            raise GraphError(f"{ref}: no such graph file, and {e.message}") from None
        if shipped.is_file():
            return shipped
    try:
        names = ", ".join(shipped_graphs()) or "none"
    except GraphError:
        names = "none found"
    what = "no such graph file, nor a shipped graph's name" if bare else "no such graph file"
    raise GraphError(f"{ref}: {what} (shipped graphs, by name: {names}; mm-encoder graphs lists them)")
