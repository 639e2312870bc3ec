"""bench/gpu.py's measuring stages on the vision tower: parity and forward time per size, device syncs,
varlen attention, the output copy, before vs after. Mixed into `bench.gpu.Run`, whose set-up they use."""

from __future__ import annotations

import io
import time

import torch
from PIL import Image

from bench import stats
from bench.gpu_tools import (
    PARITY_GATE,
    REFERENCE_STACK,
    STAGE_KEYS,
    attention_calls,
    compare,
    count_syncs,
    cpu_pixels,
    log,
    per_item_sdpa,
    profile_syncs,
    reference_on,
)
from harness import reference  # the independent fp32 eager reference
from mm_encoder import wire
from mm_encoder.kernels import attention as attn_mod
from mm_encoder.kernels.attention import block_diagonal_attention
from mm_encoder.model.preprocess import resize_target


class Stages:
    """The tower's stages; `Run` provides `self.bench`, `self.m`, `self.enc`, `self.results`, ..."""

    @torch.inference_mode()
    def parity_forward(self, size: str) -> None:
        b, m = self.bench, self.m
        px32, grid = self.pixels(self.images[size])
        px16, grids = px32.to(torch.bfloat16), [grid]
        fast = self.model(px16, grids)  # also the warm-up
        fast_ms = b.repeat(lambda: b.device_ms(lambda: self.model(px16, grids)), budget_s=m["budget"]["fast"],
                           min_n=m["min_n"]["fast"])

        def ref32_fwd():
            return reference.reference_forward(self.sd32, self.rcfg, px32, grids)[0]

        def ref16_fwd():
            return reference.reference_forward(self.sd16, self.rcfg, px16, grids)[0]

        with reference_on(self.device):
            ref32 = ref32_fwd()  # the parity output, and the reference's warm-up
            ref32_ms = b.repeat(lambda: b.device_ms(ref32_fwd), budget_s=m["budget"]["ref_fp32"],
                                min_n=m["min_n"]["ref"], warmup=0)
            ref16 = ref16_fwd()
            ref16_ms = b.repeat(lambda: b.device_ms(ref16_fwd), budget_s=m["budget"]["ref_bf16"],
                                min_n=m["min_n"]["ref"], warmup=0)
        w, h = m["sizes"][size]
        parity = compare(fast, ref32)
        parity.update(image=f"{w}x{h}", grid=list(grid), patches=grid[1] * grid[2],
                      reference_bf16=compare(ref16, ref32), gate=PARITY_GATE, met=parity["cos_mean"] >= PARITY_GATE)
        self.results["parity"][size] = parity
        self.results["forward"][size] = {
            "image": f"{w}x{h}", "patches": grid[1] * grid[2], "tokens": parity["tokens"], "timer": "cuda events"
            if self.cuda else "perf_counter", "fast_bf16_ms": fast_ms, "reference_bf16_ms": ref16_ms,
            "reference_fp32_ms": ref32_ms, "fp32_reference_over_fast": stats.ratio(ref32_ms, fast_ms),
            "bf16_reference_over_fast": stats.ratio(ref16_ms, fast_ms),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 1) if self.cuda else None,
        }
        log(f"  {size} {w}x{h}: {parity['tokens']} tokens, cos mean {parity['cos_mean']:.6f} "
            f"min {parity['cos_min']:.6f} "
            f"rel L2 {parity['rel_l2']:.2e}; fast {stats.fmt(fast_ms)} ms, ref bf16 {stats.fmt(ref16_ms)} ms, "
            f"ref fp32 {stats.fmt(ref32_ms)} ms")

    @torch.inference_mode()
    def syncs(self) -> None:
        size = "4k"
        px32, grid = self.pixels(self.images[size])
        px16, grids = px32.to(torch.bfloat16), [grid]
        self.model(px16, grids)  # warm: first-call work (allocator, kernel choice) is not the forward's
        self.bench.sync()
        fwd = count_syncs(lambda: self.model(px16, grids), self.cuda)
        self.bench.sync()
        prepared = self.enc.preprocess_item(self.images[size])
        self.bench.sync()
        enc_fwd = count_syncs(lambda: self.enc.forward([prepared]), self.cuda)
        self.bench.sync()
        try:
            prof = profile_syncs(lambda: self.model(px16, grids), self.cuda)
        except Exception as e:  # the profiler is a cross-check; its absence is not the stage's failure
            prof = {"error": f"{type(e).__name__}: {e}"}
        self.bench.sync()
        self.results["syncs"] = {
            "image": size, "method": "torch.cuda.set_sync_debug_mode('warn') around one warm fast forward "
            "(model(pixels, grids): batch plan, 27 layers, merger, projector); each synchronising call "
            "PyTorch makes is a warning, recorded with the Python line that made it"
            if self.cuda else "not measurable on the CPU (no CUDA sync debug mode): the code path only",
            "fast_forward": fwd, "encoder_forward": {**enc_fwd, "note": "Encoder.forward: the fast forward, the "
                                                      "pinned side-stream copy and its final event wait"},
            "profiler": prof, "target": 0, "met": fwd["syncs"] == 0,
        }
        log(f"  fast forward: {fwd['syncs']} syncs {fwd['sites']}; Encoder.forward: {enc_fwd['syncs']}; "
            f"profiler: {prof.get('sync_calls', prof.get('error'))}")

    @torch.inference_mode()
    def attention(self) -> None:
        b, m = self.bench, self.m
        prepared = [self.enc.preprocess_item(d) for d in self.pack_images]
        pixels = torch.cat([p.pixel_values for p in prepared])
        grids = [p.grid for p in prepared]
        plan = self.model.plan(grids, self.device)
        self.model(pixels, grids)
        with attention_calls() as calls:
            self.model(pixels, grids)
        layers = self.spec.tower.num_layers
        t = self.spec.tower
        q, k, v = (torch.randn(sum(plan.seqlens), t.num_heads, t.head_dim, device=self.device, dtype=torch.bfloat16)
                   for _ in range(3))

        def op():
            return block_diagonal_attention(q, k, v, plan.seqlens, plan.cu_seqlens, plan.max_seqlen)

        budget, min_n = m["budget"]["attention"], m["min_n"]["attention"]
        out_default = op()
        op_default = b.repeat(lambda: b.device_ms(op), budget_s=budget, min_n=min_n)
        fwd_default = b.repeat(lambda: b.device_ms(lambda: self.model(pixels, grids)), budget_s=budget, min_n=min_n)
        with per_item_sdpa():
            out_sdpa = op()
            op_sdpa = b.repeat(lambda: b.device_ms(op), budget_s=budget, min_n=min_n)
            fwd_sdpa = b.repeat(lambda: b.device_ms(lambda: self.model(pixels, grids)), budget_s=budget, min_n=min_n)
        agree = compare(out_default.flatten(1).float(), out_sdpa.flatten(1).float())
        self.results["attention"] = {
            "varlen_available": attn_mod._varlen_attn is not None, "varlen_error": self.varlen_error,
            "varlen_taken": calls["varlen"] == layers,
            "varlen_calls": calls["varlen"], "sdpa_calls": calls["sdpa"], "expected_varlen_calls": layers,
            "items": len(grids), "seqlens": plan.seqlens, "tokens": sum(plan.seqlens), "max_seqlen": plan.max_seqlen,
            "op_default_ms": op_default, "op_per_item_sdpa_ms": op_sdpa,
            "op_sdpa_over_default": stats.ratio(op_sdpa, op_default),
            "forward_default_ms": fwd_default, "forward_per_item_sdpa_ms": fwd_sdpa,
            "forward_sdpa_over_default": stats.ratio(fwd_sdpa, fwd_default),
            "default_vs_sdpa": {"cos_min": agree["cos_min"], "max_abs": agree["max_abs"]},
        }
        log(f"  {len(grids)} items, {sum(plan.seqlens)} tokens: varlen calls {calls['varlen']}/{layers}, sdpa calls "
            f"{calls['sdpa']}; op {stats.fmt(op_default, 3)} vs per-item SDPA {stats.fmt(op_sdpa, 3)} ms; forward "
            f"{stats.fmt(fwd_default)} vs {stats.fmt(fwd_sdpa)} ms")

    @torch.inference_mode()
    def copy(self) -> None:
        b, m, enc = self.bench, self.m, self.enc
        budget, min_n = m["budget"]["copy"], m["min_n"]["copy"]
        item = enc.preprocess_item(self.images["4k"])
        out = self.model(item.pixel_values, [item.grid])
        b.sync()

        def side_stream_copy():
            host, event = enc.steps._to_host(out)  # the encoder's own copy path
            if event is not None:
                event.synchronize()
            return host

        pinned = side_stream_copy()
        plain = out.cpu()
        plain_ms = b.repeat(lambda: b.wall_ms(out.cpu), budget_s=budget, min_n=min_n)
        pinned_ms = b.repeat(lambda: b.wall_ms(side_stream_copy), budget_s=budget, min_n=min_n)

        def sequential():
            for p in (item, item):
                self.model(p.pixel_values, [p.grid]).cpu()

        two_seq = b.repeat(lambda: b.wall_ms(sequential), budget_s=budget, min_n=min_n)
        two_enc = b.repeat(lambda: b.wall_ms(lambda: enc.forward([item, item])), budget_s=budget, min_n=min_n)
        nbytes = out.numel() * out.element_size()
        self.results["copy"] = {
            "image": "4k", "shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."), "bytes": nbytes,
            "pinned": bool(pinned.is_pinned()) if self.cuda else False, "equal": bool(torch.equal(pinned, plain)),
            "plain_cpu_ms": plain_ms, "pinned_side_stream_ms": pinned_ms,
            "plain_gb_s": nbytes / plain_ms["median"] / 1e6, "pinned_gb_s": nbytes / pinned_ms["median"] / 1e6,
            "plain_over_pinned": stats.ratio(plain_ms, pinned_ms),
            "batches_per_forward": len(enc.steps._batches([item, item])),
            "two_items_sequential_ms": two_seq, "two_items_encoder_forward_ms": two_enc,
            "two_items_sequential_over_encoder": stats.ratio(two_seq, two_enc),
        }
        log(f"  {nbytes / 1e6:.1f} MB: .cpu() {stats.fmt(plain_ms, 2)} ms, "
            f"pinned side stream {stats.fmt(pinned_ms, 2)} ms; "
            f"two items sequential {stats.fmt(two_seq)} vs Encoder.forward {stats.fmt(two_enc)} ms")

    @torch.inference_mode()
    def before_pass(self, data: bytes, sd: dict) -> tuple[dict[str, float], int]:
        enc, cfg, dev = self.enc, self.spec.preprocess, self.device
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        _, h = enc.identify(data)
        times["hash"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        times["decode"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        new = resize_target(*img.size, cfg.in_patch_limit, cfg, self.patch)
        if new != img.size:
            img = img.resize(new, Image.BICUBIC)
        pixels, grid = cpu_pixels(img, cfg, self.patch)
        dtype = next(iter(sd.values())).dtype
        pixels = pixels.to(dev).to(dtype)
        times["preprocess"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        out = reference.reference_forward(sd, self.rcfg, pixels, [grid])[0].cpu()
        times["forward"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        body = wire.encode_json(mm_hash=h, model=self.spec.name, modality="image", embeds=out, grid_thws=[grid],
                                dtype=self.results["config"]["wire"]["dtype"])
        times["pack"] = (time.perf_counter() - t0) * 1e3
        return times, len(body)

    @torch.inference_mode()
    def after_pass(self, data: bytes) -> tuple[dict[str, float], int]:
        enc, w = self.enc, self.results["config"]["wire"]
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        identified = enc.identify(data)
        times["hash"] = (time.perf_counter() - t0) * 1e3
        prepared = enc.preprocess_file(data, identified=identified)
        t0 = time.perf_counter()
        self.bench.sync()  # the device resize it enqueued counts as preprocess, not as forward
        times["decode"] = prepared[0].timings_ms["decode"]
        times["preprocess"] = prepared[0].timings_ms["preprocess"] + (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        outputs, _ = enc.forward(prepared)  # until the output is in (pinned) host memory
        times["forward"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        body = wire.encode(mm_hash=identified[1], model=self.spec.name, modality="image", embeds=outputs[0],
                           grid_thws=[prepared[0].grid], dtype=w["dtype"], byte_planes=w["byte_planes"],
                           level=w["level"])
        times["pack"] = (time.perf_counter() - t0) * 1e3
        return times, len(body)

    def before_after(self) -> None:
        b, m = self.bench, self.m
        data = self.images["4k"]
        budget = m["budget"]["e2e"]
        rows: dict[str, dict] = {}
        with reference_on(self.device):
            paths = (("after", lambda: self.after_pass(data)), ("before", lambda: self.before_pass(data, self.sd16)),
                     ("before_fp32", lambda: self.before_pass(data, self.sd32)))
            for name, fn in paths:
                samples: list[dict[str, float]] = []
                body = [0]

                def once(fn=fn, samples=samples, body=body) -> float:
                    b.sync()
                    t0 = time.perf_counter()
                    times, body[0] = fn()
                    wall = (time.perf_counter() - t0) * 1e3
                    samples.append({**times, "wall": wall})
                    return wall

                once()  # warm-up
                samples.clear()
                b.repeat(once, budget_s=budget, min_n=m["min_n"]["e2e"], warmup=0)
                row = {k: stats.summary(s[k] for s in samples) for k in STAGE_KEYS}
                row["total"] = stats.summary(sum(s[k] for k in STAGE_KEYS) for s in samples)
                row["wall"] = stats.summary(s["wall"] for s in samples)
                row["body_bytes"] = body[0]
                rows[name] = row
                log(f"  {name}: {stats.fmt(row['total'])} ms (" + ", ".join(
                    f"{k} {stats.fmt(row[k], spread=False)}" for k in STAGE_KEYS) + ")")
        w, h = m["sizes"]["4k"]
        px_grid = self.pixels(data)[1]
        self.results["before_after"] = {
            "image": f"{w}x{h} JPEG q90", "tokens": px_grid[1] * px_grid[2] // 4, "stages": list(STAGE_KEYS),
            "before_what": "PIL decode + PIL BICUBIC resize + pad/patchify/normalise on the CPU, eager reference "
                           "forward in bf16 on the device, .cpu(), json+base64 body; one thread",
            "before_fp32_what": "the same with the reference forward in fp32",
            "after_what": "mm_hash, decode, torch resize on the device (Encoder.preprocess_file), fast bf16 model + "
                          "pinned side-stream copy (Encoder.forward), wire v1 msgpack+raw+zstd "
                          f"(byte planes {self.results['config']['wire']['byte_planes']}, level "
                          f"{self.results['config']['wire']['level']})",
            **rows, "speedup": stats.ratio(rows["before"]["total"], rows["after"]["total"]),
            "speedup_vs_fp32_before": stats.ratio(rows["before_fp32"]["total"], rows["after"]["total"]),
            "reference_stack": REFERENCE_STACK,
        }
        log(f"  before/after: {self.results['before_after']['speedup']:.2f}x (reference stack "
            f"{REFERENCE_STACK['before_ms']} -> {REFERENCE_STACK['after_ms']} ms, {REFERENCE_STACK['speedup']}x)")
