"""vLLM adapter for GPU deployments: the same `EngineRequest` as the reference engine (media by
handle, fetched here), handed to vLLM as prompt token ids plus precomputed embeddings, so vLLM
never runs a vision tower.

    python -m mm_encoder.engines.vllm --model /models/Kimi-K2.5 [--namespace mm] [vLLM engine args]

- `multi_modal_data`: per modality a list of `{"<m>_embeds": [n, hidden], "<m>_grid_thw": [k, 3]}`
  (the Kimi-VL/Qwen2-VL embedding-input convention); the prompt ids already hold each item's
  placeholder run at full length (the frontend spliced them), which vLLM matches in place.
- `multi_modal_uuids`: the item's mm_hash, so vLLM's prefix cache keys on content, the same key
  the router uses.
vLLM is imported only when the worker starts; `build_inputs` needs only torch (unit-tested in CI).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import torch

from ..core import wire
from ..core.dynamo import BLOCK_SIZE, ENGINE_COMPONENT, GENERATE_ENDPOINT, NAMESPACE, endpoint_path, make_runtime
from ..core.handle import HandleResolver
from ..core.requests import EngineRequest
from ..core.sampling import SamplingParams
from .inputs import check_spans, fetch_bodies


def build_inputs(req: EngineRequest, bodies: list[bytes]) -> dict[str, Any]:
    """EngineRequest + its fetched bodies -> the `prompt` dict for vLLM's `generate` (TokensPrompt
    with embeddings)."""
    data: dict[str, list[dict[str, torch.Tensor]]] = {}
    uuids: dict[str, list[str]] = {}
    for item, body in zip(req.media, bodies, strict=True):
        check_spans(item, req.token_ids)
        msg = wire.decode(body)
        m = msg.modality
        data.setdefault(m, []).append({
            f"{m}_embeds": msg.embeds,
            f"{m}_grid_thw": torch.tensor(msg.grid_thws, dtype=torch.long),
        })
        uuids.setdefault(m, []).append(item.mm_hash)
    prompt: dict[str, Any] = {"prompt_token_ids": list(req.token_ids)}
    if data:
        prompt["multi_modal_data"] = data
        prompt["multi_modal_uuids"] = uuids
    return prompt


def sampling_kwargs(req: EngineRequest) -> dict[str, Any]:
    """vLLM's SamplingParams keywords for the request's sampling (stop strings are the frontend's:
    it detokenizes); the frontend owns max_tokens."""
    p = SamplingParams.from_dict(req.sampling)
    kw: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": p.temperature or 0.0, "top_p": p.top_p,
                          "top_k": p.top_k or -1, "min_p": p.min_p, "seed": p.seed,
                          "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
                          "repetition_penalty": p.repetition_penalty, "min_tokens": p.min_tokens,
                          "stop_token_ids": sorted({*req.eos_token_ids, *p.stop_token_ids}),
                          "ignore_eos": p.ignore_eos}
    return kw


class VllmEngine:
    """Dynamo handler around vLLM's AsyncLLM (created on first use, in the worker process)."""

    def __init__(self, engine, resolver: HandleResolver):
        self.engine = engine
        self.resolver = resolver

    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        from vllm import SamplingParams as VllmSampling

        req = EngineRequest.from_dict(request)
        prompt = build_inputs(req, await fetch_bodies(req, self.resolver))
        request = None
        req.media.clear()
        sent = 0
        async for out in self.engine.generate(prompt, VllmSampling(**sampling_kwargs(req)), req.request_id):
            prompt = None  # vLLM holds the embeddings now
            comp = out.outputs[0]
            new = list(comp.token_ids[sent:])
            sent = len(comp.token_ids)
            if new or comp.finish_reason:
                yield {"token_ids": new, "finish_reason": comp.finish_reason}
            if context is not None and context.is_stopped():
                await self.engine.abort(req.request_id)
                return


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - needs vLLM and a GPU
    p = argparse.ArgumentParser(prog="python -m mm_encoder.engines.vllm")
    p.add_argument("--model", required=True)
    p.add_argument("--namespace", default=NAMESPACE)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--encoder-chain", action="append", default=[], help="cache chain URL handles may name")
    args, rest = p.parse_known_args(argv)
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        print("error: vLLM is not installed (pip install 'mm-encoder[vllm]')", file=sys.stderr)
        return 1

    async def serve() -> None:
        from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

        runtime = make_runtime(asyncio.get_running_loop())
        endpoint = runtime.endpoint(endpoint_path(args.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT))
        engine_args = AsyncEngineArgs(model=args.model, block_size=args.block_size, enable_prefix_caching=True,
                                      **_parse_rest(rest))
        rpc = await runtime.endpoint(endpoint_path(args.namespace)).client()
        handler = VllmEngine(AsyncLLM.from_engine_args(engine_args), HandleResolver(args.encoder_chain, rpc))
        serving = asyncio.ensure_future(endpoint.serve_endpoint(handler.generate, graceful_shutdown=True))
        await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, args.model,
                             worker_type=WorkerType.Aggregated, kv_cache_block_size=args.block_size)
        await serving

    asyncio.run(serve())
    return 0


def _parse_rest(rest: list[str]) -> dict[str, Any]:
    """`--max-model-len 8192 --enforce-eager` -> {"max_model_len": 8192, "enforce_eager": True}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        key = rest[i].lstrip("-").replace("-", "_")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value: Any = rest[i + 1]
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            out[key] = value
            i += 2
        else:
            out[key] = True
            i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
