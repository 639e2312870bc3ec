"""bench/gpu.sh, the one-command GPU benchmark, as real subprocesses: it refuses cleanly without a GPU,
and its --cpu-logic mode runs every stage's code on the CPU and writes results.json + results.md."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.sh"

SUMMARY = {"median", "min", "max", "n"}
TOP = {"schema", "mode", "started", "finished", "elapsed_s", "machine", "config", "parity", "forward", "syncs",
       "attention", "copy", "before_after", "engine", "checks", "stage_s", "errors"}
SIZES = {"full_hd", "4k"}
PARITY = {"image", "grid", "patches", "tokens", "cos_mean", "cos_min", "rel_l2", "max_abs", "reference_bf16", "gate",
          "met"}
FORWARD = {"image", "patches", "tokens", "timer", "fast_bf16_ms", "reference_bf16_ms", "reference_fp32_ms",
           "fp32_reference_over_fast", "bf16_reference_over_fast", "peak_memory_gib"}
SYNCS = {"image", "method", "fast_forward", "encoder_forward", "profiler", "target", "met"}
ATTENTION = {"varlen_available", "varlen_error", "varlen_taken", "varlen_calls", "sdpa_calls", "expected_varlen_calls",
             "items", "seqlens", "tokens", "max_seqlen", "op_default_ms", "op_per_item_sdpa_ms", "op_sdpa_over_default",
             "forward_default_ms", "forward_per_item_sdpa_ms", "forward_sdpa_over_default", "default_vs_sdpa"}
COPY = {"image", "shape", "dtype", "bytes", "pinned", "equal", "plain_cpu_ms", "pinned_side_stream_ms", "plain_gb_s",
        "pinned_gb_s", "plain_over_pinned", "batches_per_forward", "two_items_sequential_ms",
        "two_items_encoder_forward_ms", "two_items_sequential_over_encoder"}
BEFORE_AFTER = {"image", "tokens", "stages", "before", "before_fp32", "after", "speedup", "speedup_vs_fp32_before",
                "reference_stack", "before_what", "before_fp32_what", "after_what"}
STAGES = {"hash", "decode", "preprocess", "forward", "pack", "total", "wall"}
CHECKS = {"parity_full_hd_cos_mean", "parity_4k_cos_mean", "syncs_fast_forward", "varlen_taken",
          "varlen_faster_than_per_item_sdpa", "pinned_copy_faster", "after_faster_than_before",
          "engine_greedy_device_fp32_equals_cpu_fp32"}
ENGINE_ROW = {"dtype", "prompt_tokens", "prefill_ms", "decode_tok_s"}
GREEDY = {"tokens", "equal", "first_divergence", "cpu_margin", "cpu_tokens", "device_tokens", "min_cpu_margin",
          "prompt_tokens"}


def _has_gpu() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/proc/driver/nvidia/gpus/*"))


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTHON", "OUT")}
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def _refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("no CUDA device: "), lines[0]
    return lines[0]


def test_syntax():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run([exe, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_refuses_without_gpu(tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    line = _refusal(_run(env={"OUT": str(out)}))
    assert time.perf_counter() - t0 < 10  # before any heavy work: no Python started, nothing installed
    assert "no NVIDIA GPU" in line
    assert not out.exists()


def test_refuses_when_cuda_visible_devices_hides_all(tmp_path):
    out = tmp_path / "out"
    line = _refusal(_run(env={"OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}))
    assert "CUDA_VISIBLE_DEVICES" in line
    assert not out.exists()


def test_python_part_refuses_without_cuda(tmp_path):
    """bench/gpu.py refuses on its own too (a run that bypasses the shell script)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--out", str(tmp_path / "o")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1].startswith("no CUDA device: ")
    assert not (tmp_path / "o").exists()


def test_cpu_logic_writes_every_result(tmp_path):
    out = tmp_path / "results"
    proc = _run("--cpu-logic", env={"OUT": str(out), "PYTHON": sys.executable}, timeout=240)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "mode cpu-logic" in proc.stdout
    r = json.loads((out / "results.json").read_text())
    assert set(r) >= TOP, TOP - set(r)
    assert r["mode"] == "cpu-logic" and r["errors"] == {}, r["errors"]
    assert r["finished"] and r["elapsed_s"] > 0
    assert set(r["parity"]) == set(r["forward"]) == SIZES
    for size in SIZES:
        p, f = r["parity"][size], r["forward"][size]
        assert set(p) >= PARITY, PARITY - set(p)
        assert set(f) >= FORWARD, FORWARD - set(f)
        assert p["cos_mean"] > 0.999 and p["cos_min"] <= p["cos_mean"] and 0 <= p["rel_l2"] < 0.05
        for k in ("fast_bf16_ms", "reference_bf16_ms", "reference_fp32_ms"):
            assert set(f[k]) >= SUMMARY and f[k]["min"] <= f[k]["median"] <= f[k]["max"]
    s = r["syncs"]
    assert set(s) >= SYNCS, SYNCS - set(s)
    assert {"syncs", "sites"} <= set(s["fast_forward"])
    assert {"sync_calls", "sync_calls_total", "memcpy", "dtoh_copies"} <= set(s["profiler"]), s["profiler"]
    a = r["attention"]
    assert set(a) >= ATTENTION, ATTENTION - set(a)
    layers = r["config"]["layers"]
    # On the CPU the module's per-item SDPA path runs: the counters see every call of it, and no varlen.
    assert a["varlen_calls"] == 0 and a["varlen_taken"] is False
    assert a["sdpa_calls"] == layers * a["items"] and a["expected_varlen_calls"] == layers
    assert a["default_vs_sdpa"]["cos_min"] > 0.9999
    c = r["copy"]
    assert set(c) >= COPY, COPY - set(c)
    assert c["equal"] is True and c["bytes"] > 0
    ba = r["before_after"]
    assert set(ba) >= BEFORE_AFTER, BEFORE_AFTER - set(ba)
    for row in ("before", "before_fp32", "after"):
        assert set(ba[row]) >= STAGES, (row, STAGES - set(ba[row]))
        assert ba[row]["body_bytes"] > 0
    assert ba["before"]["body_bytes"] > ba["after"]["body_bytes"]  # json+base64 vs msgpack+zstd
    assert ba["reference_stack"] == {"before_ms": 1040, "after_ms": 510, "speedup": 2.0,
                                     "what": ba["reference_stack"]["what"]}
    e = r["engine"]
    # cpu-logic: the tiny checkpoint's language model in bf16 and fp32 at each length; the greedy check
    # runs its code with the CPU on both sides, so the tokens must be equal
    assert list(e["presets"]) == ["tiny"] and e["presets"]["tiny"]["checkpoint"] == "kimi-k2.5-tiny"
    rows = e["presets"]["tiny"]["rows"]
    assert [(x["dtype"], x["prompt_tokens"]) for x in rows] == [(d, n) for d in ("bf16", "fp32") for n in e["lengths"]]
    for x in rows:
        assert set(x) >= ENGINE_ROW and x["prefill_ms"]["median"] > 0 and x["decode_tok_s"]["median"] > 0
    g = e["presets"]["tiny"]["greedy"]
    assert set(g) >= GREEDY, GREEDY - set(g)
    assert g["equal"] and g["first_divergence"] is None and len(g["cpu_tokens"]) == g["tokens"] == e["decode_tokens"]
    assert set(r["checks"]) == CHECKS
    assert all({"ok", "value", "target"} <= set(v) for v in r["checks"].values())
    md = (out / "results.md").read_text()
    for heading in ("## Parity", "## Forward time", "## Device syncs", "## Attention", "## Output copy",
                    "## Before vs after", "## Engine", "## Checks", "cpu-logic mode"):
        assert heading in md, heading
    assert "reference stack (GPU)" in md and "1040 -> 510" in md
    assert (out / "run.log").read_text().count("[") >= 8  # one line per stage
