"""The engine alone (not a test): prefill time (TTFT at the engine), decode speed and prefix reuse
per prompt length, on the real model, in this process (no Dynamo, no frontend).

    python -m bench.engine [--quick | --smoke] [--presets tiny,small] [--repeats N] [--json PATH]

The model: the generated random-weight Kimi-K2.5 checkpoints (`engines.tiny_checkpoint`, presets
`tiny` and `small`, written into a temporary directory), whose language model (transformers'
DeepseekV3: MLA attention, MoE) `engines.llm.LanguageModel.load` runs in fp32 and in bf16, behind the
package's `engines.engine.Engine` exactly as the engine worker runs it (its prefix store, its
sampler, its engine thread). Prompts, per preset:
- text: the checkpoint's chat template around filler text, cut to exactly 128, 512, 2048 and 8192
  tokens (the template's head and tail kept);
- image: "What is in this image?" and one 1280x720 JPEG, its 1,196 rows from the checkpoint's own
  vision tower (encoded once, beforehand: the engine's cost only) written over the placeholders.
Per prompt and dtype, in each repeat:
- cold: the engine's prefix store emptied, then `Engine.decode` with greedy sampling for 33 tokens:
  prefill ms = the time to the first token (TTFT at the engine: prefill + the first sample);
  decode tokens/s = the 32 tokens after the first over the time they took;
- again: the same prompt right after, 1 token: the prefix store supplies its full blocks (all but the
  last partial one, and never the last token), the rest is prefilled. Reused tokens, prefill ms, and
  cold / again.
Figures are median (min-max) over the repeats; fp32 and bf16, and every prompt, alternate repeat by
repeat. Every loop is bounded in count; after the first repeat (which always runs), no prompt is
started once the mode's time budget is spent (full: 30 min), so `n` can differ by row.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

from bench import stats
from harness.media_factory import image_bytes, natural_image
from mm_encoder.core.prompt import ChatTokenizer, Splicer
from mm_encoder.core.registry import get_spec
from mm_encoder.core.sampling import SamplingParams
from mm_encoder.engines.engine import Engine, Placed, Prompt
from mm_encoder.engines.llm import LanguageModel
from mm_encoder.engines.prefix_cache import PrefixCache
from mm_encoder.engines.tiny_checkpoint import PRESETS, write_checkpoint

SPEC = "kimi-k2.5-vision"  # the registry entry whose prompt config the generated Kimi-K2.5 uses
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DECODE_TOKENS = 32  # greedy tokens timed after the first
IMAGE = (1280, 720)
FILLER = ("The fox ran along the river bank at dawn, looking for a place to cross before the ice "
          "melted; the heron watched it from the reeds and said nothing. ")
MARK = "\u2063BODY\u2063"  # where the filler goes in the rendered template
# The longest text prompt per preset: `small` at 8,192 tokens prefills for minutes on 2 cores.
MAX_PROMPT = {"small": 2048}
# Per mode: presets, prompts (token counts, "image"), repeats, the time budget after the first repeat.
MODES = {
    "full": {"presets": ["tiny", "small"], "prompts": [128, 512, 2048, 8192, "image"], "repeats": 3,
             "budget_s": 1800.0},
    "quick": {"presets": ["tiny"], "prompts": [128, 512, 2048, "image"], "repeats": 2, "budget_s": 240.0},
    # For a check that the module runs end to end (seconds).
    "smoke": {"presets": ["tiny"], "prompts": [128, "image"], "repeats": 1, "budget_s": 30.0},
}


# --- prompts --------------------------------------------------------------------------------------


def text_prompt(tok: ChatTokenizer, n: int) -> Prompt:
    """The chat template around filler text, exactly `n` tokens: the template's head, the filler cut
    to fit, the template's tail (the assistant's turn)."""
    pre, post = tok.render([{"role": "user", "content": MARK}]).split(MARK)
    head, tail = tok.encode(pre), tok.encode(post)
    unit = tok.encode(FILLER)
    room = n - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"a {n}-token prompt leaves no room for text after the template's {len(head) + len(tail)}")
    body = (unit * (room // len(unit) + 1))[:room]
    return Prompt(head + body + tail, [])


def image_prompt(ckpt: Path, tok: ChatTokenizer, splicer: Splicer) -> tuple[Prompt, dict]:
    """One 1280x720 JPEG after a question, its rows from the checkpoint's own vision tower (fp32)."""
    from mm_encoder.model.encoder import Encoder

    encoder = Encoder.from_pretrained(ckpt, device="cpu", dtype="fp32")
    data = image_bytes(natural_image(*IMAGE, seed=7), "JPEG", quality=90)
    t0 = time.perf_counter()
    enc = encoder.encode_file(data)[0]
    encode_ms = (time.perf_counter() - t0) * 1e3
    text = tok.render([{"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                                    {"type": "image_url", "image_url": {"url": "x"}}]}])
    spliced = splicer.expand_text(text, [("image", [enc.num_tokens], None)])
    (offset, rows), = spliced.spans[0]
    prompt = Prompt(spliced.token_ids, [(offset, enc.embeds)],
                    [Placed(enc.mm_hash, "image", list(spliced.spans[0]), [list(enc.grid_thw)])])
    return prompt, {"image": f"{IMAGE[0]}x{IMAGE[1]} JPEG", "rows": rows, "encode_ms_fp32_cpu": encode_ms}


def fresh(p: Prompt) -> Prompt:
    """A copy to hand to `Engine.decode` (it drops the prompt's rows once they are in the cache)."""
    return Prompt(list(p.token_ids), list(p.rows), p.media)


# --- measuring ------------------------------------------------------------------------------------


async def _run(engine: Engine, prompt: Prompt, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    reused = []
    async for _step, n in engine.decode(fresh(prompt), max_tokens, SamplingParams(), []):
        stamps.append(time.perf_counter())
        reused.append(n)
    out = {"ttft_ms": (stamps[0] - t0) * 1e3, "reused": reused[0], "tokens": len(stamps)}
    if len(stamps) > 1:
        out["decode_tok_s"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return out


def once(engine: Engine, prompt: Prompt, decode_tokens: int) -> dict:
    """Cold (empty prefix store) with `decode_tokens` after the first, then the same prompt again."""
    engine.prefix = PrefixCache(engine.block_size, engine.prefix.max_tokens)
    cold = asyncio.run(_run(engine, prompt, decode_tokens + 1))
    if cold["tokens"] != decode_tokens + 1 or cold["reused"]:
        raise RuntimeError(f"the cold run gave {cold['tokens']} tokens, reused {cold['reused']}")
    again = asyncio.run(_run(engine, prompt, 1))
    return {"cold_ms": cold["ttft_ms"], "decode_tok_s": cold["decode_tok_s"], "again_ms": again["ttft_ms"],
            "reused": again["reused"]}


def model_facts(lm: LanguageModel) -> dict:
    text = lm.lm.base.config
    params = sum(p.numel() for p in lm.lm.parameters())
    return {"hidden": text.hidden_size, "layers": text.num_hidden_layers, "experts": text.n_routed_experts,
            "experts_per_token": text.num_experts_per_tok, "vocab": text.vocab_size,
            "attention": text._attn_implementation, "language_model_params": params}


def run_preset(preset: str, mode: dict, repeats: int, deadline: float, workdir: Path) -> dict:
    t0 = time.perf_counter()
    ckpt = write_checkpoint(workdir / f"kimi-k2.5-{preset}", preset)
    write_s = time.perf_counter() - t0
    tok = ChatTokenizer(ckpt)
    splicer = Splicer(tok, get_spec(SPEC).prompt)
    engines, load_s = {}, {}
    for name, dtype in DTYPES.items():
        t0 = time.perf_counter()
        engines[name] = Engine(LanguageModel.load(ckpt, device="cpu", dtype=dtype), splicer=splicer)
        load_s[name] = time.perf_counter() - t0
    prompts: dict[str, Prompt] = {}
    image = None
    for p in mode["prompts"]:
        if p != "image" and int(p) > MAX_PROMPT.get(preset, int(p)):
            continue  # a prefill of minutes on 2 cores (transformers' MoE and MLA paths on CPU)
        if p == "image":
            prompts["image"], image = image_prompt(ckpt, tok, splicer)
        else:
            prompts[str(p)] = text_prompt(tok, int(p))
    warm = text_prompt(tok, 64)
    for engine in engines.values():  # first-call work (allocator, thread pool) is not a measurement's
        once(engine, warm, 2)
    samples: dict[tuple[str, str], list[dict]] = {(p, d): [] for p in prompts for d in engines}
    done = 0
    for r in range(repeats):
        if r > 0 and time.perf_counter() > deadline:
            print(f"  {preset}: the time budget is spent after {r} repeat(s)", flush=True)
            break
        for p, prompt in prompts.items():
            if r > 0 and time.perf_counter() > deadline:  # a repeat of the small model is minutes
                print(f"  {preset}: the time budget is spent in repeat {r + 1}, before the {p} prompt", flush=True)
                break
            for d, engine in engines.items():
                s = once(engine, prompt, DECODE_TOKENS)
                samples[(p, d)].append(s)
                print(f"  {preset} {d} {p} ({len(prompt.token_ids)} tokens) repeat {r + 1}: prefill "
                      f"{s['cold_ms']:.0f} ms, decode {s['decode_tok_s']:.1f} tok/s, again {s['again_ms']:.0f} ms "
                      f"({s['reused']} reused)", flush=True)
        done = r + 1
    rows = []
    for (p, d), ss in samples.items():
        cold, again = stats.summary(s["cold_ms"] for s in ss), stats.summary(s["again_ms"] for s in ss)
        rows.append({"prompt": p, "dtype": d, "prompt_tokens": len(prompts[p].token_ids), "prefill_ms": cold,
                     "decode_tok_s": stats.summary(s["decode_tok_s"] for s in ss), "again_ms": again,
                     "reused_tokens": ss[0]["reused"], "cold_over_again": stats.ratio(cold, again)})
    return {"checkpoint": ckpt.name, "write_s": write_s, "load_s": load_s, "repeats": done,
            "model": model_facts(engines["fp32"].lm), "image": image, "rows": rows}


def run(mode_name: str, presets: list[str] | None, repeats: int | None) -> dict:
    mode = MODES[mode_name]
    presets = presets or mode["presets"]
    t_start = time.perf_counter()
    deadline = t_start + mode["budget_s"]
    out: dict = {"machine": stats.machine(), "mode": mode_name,
                 "config": {"presets": presets, "dtypes": list(DTYPES), "prompts": mode["prompts"],
                            "repeats": repeats or mode["repeats"], "budget_s": mode["budget_s"],
                            "decode_tokens": DECODE_TOKENS, "block_size": 16, "sampling": "greedy",
                            "threads": torch.get_num_threads()},
                 "presets": {}}
    with tempfile.TemporaryDirectory(prefix="mm-bench-engine-") as tmp:
        for preset in presets:
            print(f"preset {preset}", flush=True)
            out["presets"][preset] = run_preset(preset, mode, repeats or mode["repeats"], deadline, Path(tmp))
    out["seconds"] = time.perf_counter() - t_start
    return out


# --- the command ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny only, up to 2048 tokens and the image, 2 repeats")
    p.add_argument("--smoke", action="store_true", help="tiny only, 128 tokens and the image, 1 repeat (seconds)")
    p.add_argument("--presets", help=f"comma-separated, of {', '.join(k for k in PRESETS if k != 'glm-tiny')} "
                                     "(default: the mode's)")
    p.add_argument("--repeats", type=int, help="override the mode's repeats")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    presets = [x.strip() for x in args.presets.split(",") if x.strip()] if args.presets else None
    for x in presets or []:
        if x not in ("tiny", "small"):
            p.error(f"--presets: {x!r} is not tiny or small")
    result = run(mode, presets, args.repeats)
    stats.emit(result, args.json, "engine")
    print(f"done in {result['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
