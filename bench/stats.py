"""What every benchmark reports, in one shape: a figure is the median of its repeats with their
min and max (`summary`), formatted the same way everywhere (`fmt`); `machine()` is the report
header's facts. Benchmarks in one run share this module so BENCHMARKS.md reads uniformly."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterable


def summary(values: Iterable[float]) -> dict:
    """{"median", "min", "max", "n"} of repeated measurements of one figure."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("no measurements")
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def fmt(s: dict | float | None, digits: int = 1, spread: bool = True) -> str:
    """`12.3 (11.9-13.0)`: median (min-max); a plain number as is; `-` for nothing."""
    if s is None:
        return "-"
    if not isinstance(s, dict):
        return f"{s:,.{digits}f}"
    text = f"{s['median']:,.{digits}f}"
    if spread and s.get("n", 1) > 1:
        text += f" ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"
    return text


def ratio(a: dict, b: dict) -> float:
    """Median over median: the ratio of two figures measured side by side."""
    return a["median"] / b["median"]


def machine() -> dict:
    """Cores, the CPU flags that matter here, torch, and the device."""
    flags: list[str] = []
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
                elif line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    out = {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
           "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_threads"] = torch.get_num_threads()
        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        out["torch"] = None
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use so a
    benchmark run needs no matplotlib; None when it is not installed (sections then skip plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_png(fig, plots, name: str) -> str:
    """Write `fig` as plots/<name> and close it; returns the link BENCHMARKS.md uses (docs/bench/<name>)."""
    from pathlib import Path

    plots = Path(plots)
    plots.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(plots / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"docs/bench/{name}"


def emit(result: dict, json_path, name: str) -> None:
    """A module's last step: its JSON first (so a failing `section()` loses no measurement), then its
    markdown on stdout (`bench.sections.<name>`), with the plots in a throwaway folder (bench/report.py
    writes the real ones)."""
    import importlib
    import json
    import tempfile
    from pathlib import Path

    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    section = importlib.import_module(f"bench.sections.{name}").section
    with tempfile.TemporaryDirectory() as plots:
        print(section(result, Path(plots)))


def cli(doc: str | None, name: str, run) -> None:
    """The command line of a module whose only options are `--quick` and `--json`: run, then `emit`."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    emit(run(args), args.json, name)
