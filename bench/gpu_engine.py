"""bench/gpu.py's engine stage: the checkpoint's language model on the device, prefill and decode, and
its greedy tokens against the CPU's. Mixed into `bench.gpu.Run`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from bench import stats
from bench.gpu_tools import (
    engine_prompt,
    greedy,
    greedy_check,
    log,
)


class EngineStage:
    """The engine's stage; `Run` provides `self.bench`, `self.m`, `self.device`, `self.results`, ..."""

    def engine(self) -> None:
        import tempfile

        import transformers

        from mm_encoder.engines.llm import LanguageModel
        from mm_encoder.engines.tiny_checkpoint import write_checkpoint

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        if (major, minor) < (5, 24):
            raise RuntimeError(f"transformers {transformers.__version__} is too old for the engine (>= 5.24 needed: "
                               "Kimi-K2.5's classes)")
        b, e = self.bench, self.m["engine"]
        out: dict[str, Any] = {"decode_tokens": e["decode"], "lengths": e["lengths"], "check_len": e["check_len"],
                               "timer": "wall, device synchronised", "transformers": transformers.__version__,
                               "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "presets": {}}
        self.results["engine"] = out
        with tempfile.TemporaryDirectory(prefix="mm-gpu-engine-") as tmp:
            for preset in e["presets"]:
                if b.over():
                    out["skipped"] = f"{preset} and after: the run's time budget was spent"
                    log(f"  {out['skipped']}")
                    break
                t0 = time.perf_counter()
                ckpt = write_checkpoint(Path(tmp) / f"kimi-k2.5-{preset}", preset)
                p: dict[str, Any] = {"checkpoint": ckpt.name, "write_s": round(time.perf_counter() - t0, 1),
                                     "rows": [], "greedy": None}
                out["presets"][preset] = p
                for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                    lm = LanguageModel.load(ckpt, device=self.device, dtype=dtype)
                    p["params"] = sum(t.numel() for t in lm.lm.parameters())
                    for n in e["lengths"]:
                        ids = engine_prompt(lm.vocab_size, n, seed=n)
                        row = {"dtype": dname, "prompt_tokens": n, **self.prefill_decode(lm, ids, e["decode"])}
                        p["rows"].append(row)
                        log(f"  {preset} {dname} {n} tokens: prefill {stats.fmt(row['prefill_ms'])} ms, decode "
                            f"{stats.fmt(row['decode_tok_s'])} tok/s")
                    if dname == "fp32":
                        ids = engine_prompt(lm.vocab_size, e["check_len"], seed=1)
                        cpu = LanguageModel.load(ckpt, device="cpu", dtype=torch.float32)
                        p["greedy"] = greedy_check(greedy(cpu, ids, e["decode"]), greedy(lm, ids, e["decode"]))
                        p["greedy"]["prompt_tokens"] = e["check_len"]
                        g = p["greedy"]
                        log(f"  {preset} greedy, {self.device.type} fp32 vs cpu fp32: "
                            + ("equal" if g["equal"] else f"differ from step {g['first_divergence']} (cpu margin "
                               f"{g['cpu_margin']:.3g})") + f" over {g['tokens']} tokens")
                        del cpu
                    del lm
                    if self.cuda:
                        torch.cuda.empty_cache()

    @torch.inference_mode()
    def prefill_decode(self, lm, ids: list[int], steps: int) -> dict:
        """Prefill ms of `ids`; decode tokens/s over `steps` greedy steps after it (the prefill untimed)."""
        b, m = self.bench, self.m

        def prefill():
            return lm.forward(lm.embed(ids))

        def decode() -> float:
            logits, cache = prefill()
            b.sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                logits, cache = lm.forward(lm.embed([int(logits.argmax())]), cache)
            b.sync()
            return steps / (time.perf_counter() - t0)

        kw = {"budget_s": m["budget"]["engine"], "min_n": m["min_n"]["engine"]}
        return {"prefill_ms": b.repeat(lambda: b.wall_ms(prefill), **kw), "decode_tok_s": b.repeat(decode, **kw)}
