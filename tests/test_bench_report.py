"""bench/report.py: BENCHMARKS.md generated from the modules' JSON, with real subprocesses (no mocks).
Everything goes to tmp dirs (--out, --data, --plots), never to the repository's files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "bench" / "report.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MODULES = ["encoder", "parity", "wire", "worker", "cache", "frontend", "frontends", "engine", "graphs", "aiperf",
           "discovery", "hostile_memory", "soak", "autoscale", "tracing", "tls", "wan", "clusters", "tenants"]


def _report(tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPORT), "--data", str(tmp / "data"), "--plots", str(tmp / "plots"),
           "--out", str(tmp / "BENCHMARKS.md"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _sections(doc: str) -> dict[str, str]:
    """Top-level sections by the module each names: `## Title (`python -m bench.x`)` (or a stand-in
    script's `python path/x.py`) -> x."""
    out = {}
    for part in doc.split("\n## ")[1:]:
        title = part.split("\n", 1)[0]
        if "`python " in title:
            command = title.split("`python ", 1)[1].split("`", 1)[0]
            out[command.removeprefix("-m bench.") if command.startswith("-m ") else Path(command).stem] = part
    return out


def _valid_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as img:
        img.verify()
        assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100


def test_renders_the_whole_document_from_an_encoder_run(tmp_path):
    """A real (smoke-sized) encoder run's JSON -> every section present or placeholder-marked, PNGs written."""
    data = tmp_path / "data"
    run = subprocess.run([sys.executable, "bench/encoder.py", "--smoke", "--json", str(data / "encoder.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    r = _report(tmp_path, "--render-only")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    assert doc.startswith("# Benchmarks\n")
    assert "median (min-max)" in doc and "avx512_bf16" in doc and "torch " in doc and "## Contents" in doc
    sections = _sections(doc)
    assert list(sections) == MODULES  # every module, in the fixed order, exactly once
    for name, text in sections.items():
        if name != "encoder":
            assert "_Placeholder:" in text, name  # no data in this tmp dir: marked, not dropped
    enc = sections["encoder"]
    assert "_Placeholder" not in enc and "FAILED" not in enc
    for table in ("Where the time goes per image", "Before vs after", "bf16 vs fp32"):
        assert table in enc
    pngs = sorted((tmp_path / "plots").glob("encoder-*.png"))
    assert [p.name for p in pngs] == ["encoder-before-after.png", "encoder-breakdown.png"]
    for p in pngs:
        _valid_png(p)
        assert f"](docs/bench/{p.name})" in enc
    # Contents links each section's anchor.
    assert "- [Encoder (`python -m bench.encoder`)](#encoder-python--m-benchencoder)" in doc


def test_a_failing_module_is_named_and_exits_non_zero(tmp_path):
    """Two stand-in modules run for real: one succeeds (JSON + section with a PNG), one fails."""
    ok = tmp_path / "ok_bench.py"
    ok.write_text(textwrap.dedent('''
        import argparse, json
        from pathlib import Path

        def section(result, plots):
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            plots.mkdir(parents=True, exist_ok=True)
            fig, ax = plt.subplots()
            ax.bar([0], [result["figure"]["median"]])
            fig.savefig(plots / "encoder-standin.png")
            return "## Stand-in (`python bench/encoder.py`)\\n\\nfigure " + str(result["figure"]["median"]) + "\\n"

        if __name__ == "__main__":
            p = argparse.ArgumentParser()
            p.add_argument("--json", type=Path)
            p.add_argument("--quick", action="store_true")
            a = p.parse_args()
            a.json.write_text(json.dumps({"figure": {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}, "quick": a.quick}))
    '''))
    bad = tmp_path / "bad_bench.py"
    bad.write_text("import sys\nprint('measuring...')\nsys.exit('bad_bench: the origin did not start')\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "parity.json").write_text('{"stale": true}')  # an earlier run's figures: must not pass for this run's
    r = _report(tmp_path, "--quick", "--only", "encoder,parity", "--module", f"encoder={ok}",
                "--module", f"parity={bad}")
    assert r.returncode != 0
    assert "FAILED: parity" in r.stderr
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    sections = _sections(doc)
    assert list(sections) == MODULES
    assert "figure 2.0" in sections["encoder"] and "with `--quick`" in sections["encoder"]
    failed = sections["parity"]
    assert "**FAILED" in failed and "exit status 1" in failed and "the origin did not start" in failed
    assert "from an earlier run" in failed
    assert "**(failed)**" in doc.split("## Contents", 1)[1].split("\n## ", 1)[0]
    _valid_png(tmp_path / "plots" / "encoder-standin.png")
    assert json.loads((data / "encoder.json").read_text())["quick"] is True
    runs = json.loads((data / "_runs.json").read_text())
    assert runs["encoder"]["ok"] and not runs["parity"]["ok"] and runs["parity"]["rc"] == 1
    # Re-rendering alone keeps saying so, without rerunning anything.
    again = _report(tmp_path, "--render-only", "--module", f"encoder={ok}", "--module", f"parity={bad}")
    assert "**FAILED" in _sections((tmp_path / "BENCHMARKS.md").read_text())["parity"]
    assert again.returncode != 0 and "parity" in again.stderr and "encoder" not in again.stderr


def test_engine_smoke_run_renders_its_section(tmp_path):
    """bench/engine.py --smoke for real (the tiny checkpoint's language model through the package's
    Engine, fp32 and bf16, a text and an image prompt) -> its section: a row per dtype and prompt, a PNG."""
    pytest.importorskip("dynamo.llm")  # the engine's block hashes are Dynamo's own
    data = tmp_path / "data"
    run = subprocess.run([sys.executable, "bench/engine.py", "--smoke", "--json", str(data / "engine.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((data / "engine.json").read_text())
    rows = result["presets"]["tiny"]["rows"]
    assert {(r["prompt"], r["dtype"]) for r in rows} == {(p, d) for p in ("128", "image") for d in ("fp32", "bf16")}
    for r in rows:
        assert r["reused_tokens"] == (r["prompt_tokens"] - 1) // 16 * 16  # every full block but the last token's
        assert r["prefill_ms"]["median"] > 0 and r["decode_tok_s"]["median"] > 0
    assert next(r for r in rows if r["prompt"] == "128")["prompt_tokens"] == 128
    r = _report(tmp_path, "--render-only")
    assert r.returncode == 0, r.stdout + r.stderr
    section = _sections((tmp_path / "BENCHMARKS.md").read_text())["engine"]
    assert "_Placeholder" not in section and "FAILED" not in section
    assert "| tiny | fp32 | text | 128 |" in section and "| tiny | bf16 | image | 1,2" in section
    _valid_png(tmp_path / "plots" / "engine-prefill-decode.png")
    assert "](docs/bench/engine-prefill-decode.png)" in section
