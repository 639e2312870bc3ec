"""GPU benchmark and checks (issue 14): one run on one GPU, one results folder. Start it with
bench/gpu.sh, which finds or makes a Python environment with CUDA torch first.

    bash bench/gpu.sh                    # results.json + results.md in $OUT or bench/gpu-results/<date>
    bash bench/gpu.sh --cpu-logic        # the same logic on the CPU, a tiny tower and small images

Stages, in order; each is bounded by its own time budget (repeats stop being added once it is spent)
and by the run's global budget; a stage that fails records its error and the others still run:

- `full_hd`, `4k` (parity + forward): the full 27-layer kimi-k2.5-vision tower + projector, seeded
  random weights. Parity: the bf16 fast forward against the fp32 eager reference (harness/reference.py)
  on the same weights and pixels: per-token cosine mean/min, rel L2, max abs error; the reference
  itself in bf16 is scored too, as the control. Forward time: fast bf16, reference bf16 and reference
  fp32, each timed with CUDA events around the forward (GPU timeline, gaps included).
- `syncs`: host-blocking device syncs in one fast forward. Counted with PyTorch's sync debug mode
  (`torch.cuda.set_sync_debug_mode("warn")`): every synchronising CUDA call made through PyTorch
  (stream/device synchronize, blocking copies, .item(), nonzero, ...) raises a warning, recorded with
  the Python line that made it. Cross-check: the profiler's count of synchronising CUDA runtime calls
  and of device-to-host copies in the same forward. Target 0.
- `attention`: a pack of several images in one batch. Which path ran (calls of `varlen_attn` and of
  SDPA counted around a forward; varlen is taken when there is one call per layer), the attention op
  alone (varlen vs the module's per-item SDPA fallback, same q/k/v), and the whole forward either way.
- `copy`: the encoder's output copy (pinned buffer, non_blocking copy on a side stream, an event)
  against a plain `.cpu()` of the same 4K output; and two 4K items through `Encoder.forward` (the
  copy of the first overlaps the second forward) against forward + `.cpu()` one after the other.
- `before_after`: one 4K JPEG, wall time per stage, all on one thread. before = PIL decode + PIL
  BICUBIC resize on the CPU + pad/patchify/normalise on the CPU + the eager reference forward (bf16
  on the GPU; fp32 as a second row) + `.cpu()` + json+base64 body. after = today's path: mm_hash,
  decode, torch resize on the device (Encoder.preprocess_file), the fast model + pinned async copy
  (Encoder.forward), wire v1 (msgpack + raw + zstd, the worker's defaults).
- `engine`: the language model the engines serve, on the device. The generated random-weight
  Kimi-K2.5 checkpoints (`engines.tiny_checkpoint`, presets `tiny` and `small`, written into a
  temporary directory), loaded with `LanguageModel.load(..., device="cuda", dtype=bf16 | fp32)` and
  run with the engine's own calls (`embed`, then `forward` with a transformers KV cache, as
  `Engine.prefill` and `Engine.step` make them; no prefix store). Per preset, dtype and prompt
  length (seeded token ids): prefill ms (wall, device synchronised before and after) and decode
  tokens/s (32 greedy steps after a prefill, wall). Then the greedy check: 32 greedy tokens for one
  prompt, fp32 on the device against fp32 on the CPU (same checkpoint); equal, or the first step
  where they differ with the CPU's top-2 logit margin there (a near tie is rounding, a wide margin
  a bug). Needs transformers >= 5.24 (the `engine` extra).

Exit status: 0 all stages ran (the checks in results.json say what was met); 1 a stage failed;
2 no CUDA device (and not --cpu-logic).
"""


from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import stats
from bench.gpu_engine import EngineStage
from bench.gpu_report import render_md
from bench.gpu_stages import Stages
from bench.gpu_tools import (
    MODEL,
    MODES,
    PARITY_GATE,
    SCHEMA,
    Bench,
    log,
    now,
    worker_wire,
)
from harness.media_factory import image_bytes, natural_image
from harness.models import random_model, ref_cfg
from mm_encoder import Encoder, get_spec
from mm_encoder.kernels import attention as attn_mod
from mm_encoder.kernels.attention import block_diagonal_attention
from mm_encoder.model import media
from mm_encoder.model.preprocess import preprocess_frames


class Run(Stages, EngineStage):
    """One run: its set-up, each stage bounded and recorded (results.json after every stage), the checks."""

    def __init__(self, mode: str, out: Path, device: torch.device):
        self.mode, self.out, self.device = mode, out, device
        self.m = MODES[mode]
        self.cuda = device.type == "cuda"
        self.bench = Bench(device, self.m["global_s"], self.m["max_n"])
        self.t_start = time.perf_counter()
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "mode": mode, "started": now(), "finished": None, "elapsed_s": None,
            "machine": self.machine(), "config": {}, "parity": {}, "forward": {}, "syncs": {}, "attention": {},
            "copy": {}, "before_after": {}, "engine": {}, "checks": {}, "stage_s": {}, "errors": {},
        }

    def machine(self) -> dict:
        m = stats.machine()
        m["torch_cuda"] = torch.version.cuda
        m["platform"] = platform.platform()
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                     sms=p.multi_processor_count)
        return m

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.perf_counter() - self.t_start, 1)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.out / "results.json")

    def stage(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        if self.bench.over():
            self.results["errors"][name] = "skipped: the run's time budget was spent"
            log(f"[{name}] skipped: the run's time budget was spent")
        else:
            log(f"[{name}] ...")
            try:
                fn()
            except Exception as e:
                self.results["errors"][name] = f"{type(e).__name__}: {e}"
                log(f"[{name}] FAILED: {type(e).__name__}: {e}")
                traceback.print_exc()
        self.results["stage_s"][name] = round(time.perf_counter() - t0, 1)
        if self.cuda:
            torch.cuda.empty_cache()
        self.save()

    def setup(self) -> None:
        m, dev = self.m, self.device
        spec = get_spec(MODEL)
        if m["tower"]:
            spec = spec.model_copy(update={"tower": spec.tower.model_copy(update=m["tower"])})
        if m["projector"]:
            spec = spec.model_copy(update={"projector": spec.projector.model_copy(update=m["projector"])})
        self.spec, self.patch = spec, spec.tower.patch_size
        t0 = time.perf_counter()
        model = random_model(spec, seed=0)  # fp32 on the CPU, as the tests make it
        self.sd32 = {k: v.detach().to(dev, copy=True) for k, v in model.state_dict().items()}
        self.sd16 = {k: v.to(torch.bfloat16) for k, v in self.sd32.items()}
        self.model = model.to(device=dev, dtype=torch.bfloat16).eval()
        self.enc = Encoder(spec, self.model, device=dev, dtype=torch.bfloat16)
        self.rcfg = ref_cfg(spec)
        init_s = time.perf_counter() - t0
        self.varlen_error = self.probe_varlen()
        t0 = time.perf_counter()
        self.images = {k: image_bytes(natural_image(w, h, seed=1), "JPEG", quality=90)
                       for k, (w, h) in m["sizes"].items()}
        self.pack_images = [image_bytes(natural_image(w, h, seed=10 + i), "JPEG", quality=90)
                            for i, (w, h) in enumerate(m["pack"])]
        t = spec.tower
        self.results["config"] = {
            "model": spec.name, "layers": t.num_layers, "hidden": t.hidden_size, "heads": t.num_heads,
            "head_dim": t.head_dim, "out_dim": spec.projector.out_dim,
            "params": sum(v.numel() for v in self.sd32.values()), "seed": 0,
            "weights": "random (init_random, std 0.02)",
            "fast_dtype": "bfloat16", "reference": "harness/reference.py", "device": str(dev),
            "sizes": {k: list(v) for k, v in m["sizes"].items()}, "pack_sizes": [list(s) for s in m["pack"]],
            "jpeg_bytes": {k: len(v) for k, v in self.images.items()}, "budgets_s": m["budget"],
            "global_budget_s": m["global_s"], "min_repeats": m["min_n"], "max_repeats": m["max_n"],
            "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "threads": torch.get_num_threads(),
            "wire": worker_wire(), "model_init_s": round(init_s, 1), "images_s": round(time.perf_counter() - t0, 1),
        }
        log(f"model {spec.name}: {t.num_layers} layers x {t.hidden_size}, "
            f"{self.results['config']['params'] / 1e6:.1f} M params, on {dev} in {init_s:.1f} s")

    @torch.inference_mode()
    def probe_varlen(self) -> str | None:
        """One small varlen call as the model makes it. If it raises (an API this torch lacks), the run
        goes on with the module's per-item SDPA path, and the attention stage reports the error."""
        if not (self.cuda and attn_mod._varlen_attn is not None):
            return None
        t = self.spec.tower
        q = torch.randn(96, t.num_heads, t.head_dim, device=self.device, dtype=torch.bfloat16)
        cu = torch.tensor([0, 32, 96], dtype=torch.int32, device=self.device)
        try:
            block_diagonal_attention(q, q, q, [32, 64], cu, 64)
            self.bench.sync()
        except Exception as e:
            attn_mod._use_varlen = lambda q: False
            log(f"varlen attention failed ({type(e).__name__}: {e}); the run uses per-item SDPA")
            return f"{type(e).__name__}: {e}"
        return None

    def pixels(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """fp32 pixel_values on the device, as Encoder.preprocess makes them before its dtype cast."""
        rgb = media.decode_image(data, self.enc.steps.limits)
        return preprocess_frames(rgb, self.spec.preprocess, self.patch, device=self.device, dtype=torch.float32)

    def checks(self) -> None:
        r, c = self.results, {}
        for size, p in r["parity"].items():
            c[f"parity_{size}_cos_mean"] = {"ok": p["met"], "value": p["cos_mean"], "target": f">= {PARITY_GATE}"}
        if r["syncs"]:
            c["syncs_fast_forward"] = {"ok": r["syncs"]["met"], "value": r["syncs"]["fast_forward"]["syncs"],
                                       "target": "0"}
        if r["attention"]:
            a = r["attention"]
            c["varlen_taken"] = {"ok": a["varlen_taken"], "value": f"{a['varlen_calls']}/{a['expected_varlen_calls']}",
                                 "target": "one varlen call per layer"}
            c["varlen_faster_than_per_item_sdpa"] = {"ok": a["op_sdpa_over_default"] > 1.0,
                                                     "value": a["op_sdpa_over_default"], "target": "> 1"}
        if r["copy"]:
            c["pinned_copy_faster"] = {"ok": r["copy"]["plain_over_pinned"] > 1.0,
                                       "value": r["copy"]["plain_over_pinned"], "target": "> 1"}
        if r["before_after"]:
            c["after_faster_than_before"] = {"ok": r["before_after"]["speedup"] > 1.0,
                                             "value": r["before_after"]["speedup"], "target": "> 1"}
        if r["engine"].get("presets"):
            greedy = {k: p["greedy"] for k, p in r["engine"]["presets"].items() if p.get("greedy")}
            c["engine_greedy_device_fp32_equals_cpu_fp32"] = {
                "ok": bool(greedy) and all(g["equal"] for g in greedy.values()),
                "value": ", ".join(f"{k}: " + ("equal" if g["equal"] else f"differ at step {g['first_divergence']}")
                                   for k, g in greedy.items()) or "not run",
                "target": "the same greedy tokens"}
        if self.mode != "gpu":
            for v in c.values():
                v["note"] = "cpu-logic: not a measurement"
        r["checks"] = c

    def finish(self) -> int:
        self.checks()
        self.results["finished"] = now()
        self.save()
        (self.out / "results.md").write_text(render_md(self.results))
        log(f"results: {self.out / 'results.json'} and results.md ({self.results['elapsed_s']} s)")
        return 1 if self.results["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (results.json, results.md)")
    p.add_argument("--cpu-logic", "--dry-run", dest="cpu_logic", action="store_true",
                   help="run the whole logic on the CPU with a tiny tower and small images")
    p.add_argument("--budget-s", type=float, help="the run's global time budget (default: the mode's)")
    args = p.parse_args(argv)
    mode = "cpu-logic" if args.cpu_logic else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        print(f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none"
              + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""), file=sys.stderr)
        return 2
    device = torch.device("cuda" if mode == "gpu" else "cpu")
    if args.budget_s:
        MODES[mode]["global_s"] = args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", module="PIL")
    torch.manual_seed(0)
    run = Run(mode, args.out, device)
    log(f"bench/gpu.py {mode} on {run.results['machine'].get('gpu', device)}, torch {torch.__version__}; "
        f"results in {args.out}")
    run.stage("setup", run.setup)
    if "setup" in run.results["errors"]:
        return run.finish()
    for size in MODES[mode]["sizes"]:
        run.stage(size, lambda s=size: run.parity_forward(s))
    run.stage("syncs", run.syncs)
    run.stage("attention", run.attention)
    run.stage("copy", run.copy)
    run.stage("before_after", run.before_after)
    run.stage("engine", run.engine)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
