"""vLLM adapter for GPU deployments: the same `EngineRequest` as the transformers engine (media by
handle, fetched here), handed to vLLM as prompt token ids plus precomputed embeddings, so vLLM
never runs a vision tower.

    python -m mm_encoder.engines.vllm --model Qwen/Qwen2.5-VL-7B-Instruct [--namespace mm] [vLLM engine args]

Checked against vLLM 0.31.0 (the version ai-dynamo 1.6.1's `vllm` extra pins); docs/vllm.md has
the details and the models that work. What vLLM's source fixes, and so what this module does:

- Only some model families accept embeddings (`FAMILIES`); Kimi-VL and Kimi-K2.5 take pixels only
  and are refused at start-up (`PIXEL_ONLY`), not mid-request.
- `multi_modal_data` is ONE dict per modality: the items' embeddings concatenated in prompt order,
  their grids stacked (`Qwen2VLMultiModalDataParser` -> `DictEmbeddingItems`, sliced back per item
  by `grid.prod() // merge**2` rows). vLLM refuses it unless `enable_mm_embeds` is set.
- Token prompts are never treated as already expanded (`_apply_hf_processor_main` returns
  `is_update_applied=False` for `list[int]` prompts), so vLLM expands each placeholder itself. Our
  frontend already expanded them: each item's run is collapsed back to one placeholder here, or
  vLLM would expand the expanded run a second time.
- `multi_modal_uuids` carry the item's mm_hash, so vLLM's prefix cache keys on content.
vLLM is imported only when the worker starts; everything above `main` is unit-tested without it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core import wire
from ..core.dynamo import BLOCK_SIZE, ENGINE_COMPONENT, GENERATE_ENDPOINT, NAMESPACE, endpoint_path, make_runtime
from ..core.errors import BadRequest
from ..core.handle import HandleResolver
from ..core.requests import EngineRequest
from ..core.sampling import UNSUPPORTED, SamplingParams
from .inputs import check_spans, fetch_bodies

KV_EVENTS_PORT = 5557  # vLLM's own KVEventsConfig default (tcp://*:5557)


@dataclass(frozen=True)
class Family:
    """How one vLLM model family takes embeddings: the placeholder token vLLM expands per item
    (one per item in the prompt), the keys of its per-modality dict, and its merge size (rows per
    grid = t*h*w // merge**2, the slicing its field config applies)."""

    name: str
    architectures: tuple[str, ...]
    token_ids: Mapping[str, int]  # modality -> placeholder id; hf_config image/video_token_id override
    merge: int = 2
    grid_key: str = "{m}_grid_thw"
    embeds_key: str = "{m}_embeds"

    def rows(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def with_config(self, hf_config: Any) -> Family:
        """The ids and merge size a checkpoint's config states, over the family's defaults."""
        ids = dict(self.token_ids)
        for m in ids:
            value = getattr(hf_config, f"{m}_token_id", None)
            if isinstance(value, int):
                ids[m] = value
        merge = getattr(getattr(hf_config, "vision_config", None), "spatial_merge_size", None)
        return Family(self.name, self.architectures, ids, merge if isinstance(merge, int) else self.merge,
                      self.grid_key, self.embeds_key)


_QWEN_IDS = {"image": 151655, "video": 151656}  # <|image_pad|>, <|video_pad|>
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2_vl", ("Qwen2VLForConditionalGeneration",), _QWEN_IDS),
    Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), _QWEN_IDS),
    # Video left out: vLLM's Qwen3-VL expands a video into per-frame timestamped runs, which needs
    # frame metadata a wire body does not carry (not verified, so refused).
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
           {"image": 151655}),
)}
PIXEL_ONLY = {
    "KimiVLForConditionalGeneration": "vLLM's Kimi-VL (kimi_vl.py) parses `pixel_values` + `image_grid_hws` only",
    "KimiK25ForConditionalGeneration": "vLLM's Kimi-K2.5 (kimi_k25.py) parses `pixel_values` + `grid_thws` only for "
                                       "its `vision_chunk` modality, and counts prompt tokens from the raw media",
}


def family_for(architectures: list[str] | tuple[str, ...], hf_config: Any = None) -> Family:
    """The embeddings family of a checkpoint's architectures; a model vLLM can only feed pixels is
    refused with what it lacks (docs/vllm.md)."""
    for arch in architectures:
        if arch in PIXEL_ONLY:
            raise ValueError(f"{arch}: {PIXEL_ONLY[arch]}; it has no embeddings input, so this adapter cannot "
                             "serve it (docs/vllm.md says what is missing). Use the transformers engine "
                             "(python -m mm_encoder.engines.worker).")
        for fam in FAMILIES.values():
            if arch in fam.architectures:
                return fam.with_config(hf_config) if hf_config is not None else fam
    raise ValueError(f"no known embeddings input in vLLM for {list(architectures)}; supported: "
                     f"{sorted(a for f in FAMILIES.values() for a in f.architectures)}")


def build_inputs(req: EngineRequest, bodies: list[bytes], family: Family) -> dict[str, Any]:
    """EngineRequest + its fetched bodies -> the TokensPrompt dict for vLLM's `generate`.

    Each span (an image, or one video chunk) becomes one vLLM item: its placeholder run collapses
    to one token, its rows join the modality's concatenated embeddings, its grid the stacked grids.
    A run of the wrong token or a grid whose rows vLLM would slice differently is refused."""
    runs: list[tuple[int, int]] = []
    parts: dict[str, tuple[list[torch.Tensor], list[tuple[int, int, int]], list[str]]] = {}
    items = []
    for item, body in zip(req.media, bodies, strict=True):
        check_spans(item, req.token_ids)
        msg = wire.decode(body)
        items.append((item.spans[0][0], item, msg))
    for _, item, msg in sorted(items, key=lambda x: x[0]):  # vLLM pairs a modality's items with placeholders in order
        m = msg.modality
        token = family.token_ids.get(m)
        if token is None:
            raise BadRequest(f"media {item.mm_hash[:12]}: vLLM's {family.name} takes no {m} embeddings")
        embeds, grids, uuids = parts.setdefault(m, ([], [], []))
        start = 0
        for i, ((offset, n), grid) in enumerate(zip(item.spans, msg.grid_thws, strict=True)):
            if req.token_ids[offset] != token:
                raise BadRequest(f"media {item.mm_hash[:12]}: its run is token {req.token_ids[offset]}, "
                                 f"{family.name}'s {m} placeholder is {token}")
            if family.rows(grid) != n:
                raise BadRequest(f"media {item.mm_hash[:12]}: grid {list(grid)} has {n} rows; vLLM's {family.name} "
                                 f"slices {family.rows(grid)} rows for it (t*h*w/{family.merge ** 2})")
            embeds.append(msg.embeds[start : start + n])
            grids.append(grid)
            uuids.append(item.mm_hash if len(item.spans) == 1 else f"{item.mm_hash}:{i}")
            runs.append((offset, n))
            start += n
    prompt: dict[str, Any] = {"prompt_token_ids": collapse_runs(req.token_ids, runs)}
    if parts:
        prompt["multi_modal_data"] = {
            m: {family.embeds_key.format(m=m): torch.cat(e), family.grid_key.format(m=m): torch.tensor(g)}
            for m, (e, g, _) in parts.items()}
        prompt["multi_modal_uuids"] = {m: u for m, (_, _, u) in parts.items()}
    return prompt


def collapse_runs(token_ids: list[int], runs: list[tuple[int, int]]) -> list[int]:
    """Each (offset, length) placeholder run replaced by its first token: the prompt vLLM's
    processor expects before it applies its own replacement."""
    out: list[int] = []
    pos = 0
    for offset, n in sorted(runs):
        if offset < pos:
            raise BadRequest(f"media spans overlap at token {offset}")
        out += token_ids[pos : offset + 1]
        pos = offset + n
    return out + token_ids[pos:]


# Our SamplingParams field -> vLLM SamplingParams keyword (vllm/sampling_params.py, 0.31.0). Fields
# absent here are handled elsewhere (`_OURS`); a new field that is neither is refused by name.
_SAMPLING_MAP = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
_OURS = {"stop": "matched by the detokenizing frontend", "stop_token_ids": "merged with eos_token_ids",
         "max_tokens": "the frontend's, sent as EngineRequest.max_tokens"}


def sampling_kwargs(req: EngineRequest) -> dict[str, Any]:
    """vLLM's SamplingParams keywords for the request: greedy stays greedy (temperature 0), top-k
    off is 0 (vLLM's preferred "disabled"), token ids out and no detokenizing (the frontend does
    it, so vLLM matches no stop strings)."""
    p = SamplingParams.from_dict(req.sampling)
    unknown = sorted(set(p.to_dict()) - set(_SAMPLING_MAP) - set(_OURS))
    if unknown:  # a field core.sampling gained that this adapter does not map: never dropped silently
        raise BadRequest(f"the vLLM engine cannot apply sampling field(s) {unknown}", code=UNSUPPORTED)
    kw: dict[str, Any] = {theirs: getattr(p, ours) for ours, theirs in _SAMPLING_MAP.items()}
    kw.update(temperature=p.temperature or 0.0, top_k=p.top_k or 0, max_tokens=req.max_tokens,
              stop_token_ids=sorted({*req.eos_token_ids, *p.stop_token_ids}), detokenize=False)
    return kw


def kv_events(port: int = KV_EVENTS_PORT) -> tuple[dict[str, Any], str]:
    """(vLLM's KVEventsConfig fields, the endpoint Dynamo's KvEventPublisher subscribes to): vLLM
    binds a ZMQ PUB on every interface, the publisher connects locally with topic "" and relays
    the events to the router (as dynamo/vllm/main.py `setup_kv_event_publisher` does)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": ""}
    return cfg, cfg["endpoint"].replace("*", "127.0.0.1")


def parse_engine_args(rest: list[str], *, model: str, block_size: int, kv_events_port: int = KV_EVENTS_PORT,
                      engine_args_cls: Any = None, parser_cls: Callable[..., argparse.ArgumentParser] | None = None,
                      kv_events_cls: Callable[..., Any] | None = None) -> Any:
    """`[vLLM engine args]` -> AsyncEngineArgs through vLLM's own parser (`add_cli_args` then
    `from_cli_args`), so every flag keeps vLLM's types, choices and JSON configs. Then what this
    adapter needs: the model, the router's block size, embeddings on, prefix caching on unless
    turned off, and KV events published unless the flags configured them."""
    if engine_args_cls is None:
        from vllm.engine.arg_utils import AsyncEngineArgs as engine_args_cls
    if parser_cls is None:
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser as parser_cls
        except ImportError:  # older layout
            from vllm.utils import FlexibleArgumentParser as parser_cls
    if kv_events_cls is None:
        from vllm.config import KVEventsConfig as kv_events_cls
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise ValueError("give the model once, as this command's --model")
    parser = parser_cls(prog="python -m mm_encoder.engines.vllm", add_help=False)
    engine_args_cls.add_cli_args(parser)
    ns = parser.parse_args(rest)
    ns.model, ns.block_size, ns.enable_mm_embeds = model, block_size, True
    if getattr(ns, "enable_prefix_caching", None) is None:
        ns.enable_prefix_caching = True
    if ns.enable_prefix_caching and getattr(ns, "kv_events_config", None) is None:
        ns.kv_events_config = kv_events_cls(**kv_events(kv_events_port)[0])
    return engine_args_cls.from_cli_args(ns)


class VllmEngine:
    """Dynamo handler around vLLM's AsyncLLM (created on first use, in the worker process)."""

    def __init__(self, engine, resolver: HandleResolver, family: Family):
        self.engine = engine
        self.resolver = resolver
        self.family = family
        self.publisher = None  # Dynamo's KvEventPublisher relaying vLLM's ZMQ KV events, when on

    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        from vllm import SamplingParams as VllmSampling

        req = EngineRequest.from_dict(request)
        prompt = build_inputs(req, await fetch_bodies(req, self.resolver), self.family)
        params = VllmSampling(**sampling_kwargs(req))
        request = None
        req.media.clear()
        sent = 0
        async for out in self.engine.generate(prompt, params, req.request_id):
            prompt = None  # vLLM holds the embeddings now
            comp = out.outputs[0]  # cumulative output (vLLM's default RequestOutputKind)
            new = list(comp.token_ids[sent:])
            sent = len(comp.token_ids)
            if new or comp.finish_reason:
                yield {"token_ids": new, "finish_reason": comp.finish_reason}
            if context is not None and context.is_stopped():
                await self.engine.abort(req.request_id)
                return


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - needs vLLM and a GPU
    p = argparse.ArgumentParser(prog="python -m mm_encoder.engines.vllm",
                                epilog="every other flag is vLLM's own (AsyncEngineArgs.add_cli_args)")
    p.add_argument("--model", required=True)
    p.add_argument("--namespace", default=NAMESPACE)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--kv-events-port", type=int, default=KV_EVENTS_PORT)
    p.add_argument("--encoder-chain", action="append", default=[], help="cache chain URL handles may name")
    args, rest = p.parse_known_args(argv)
    try:
        from transformers import AutoConfig
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        print("error: vLLM is not installed (pip install 'mm-encoder[vllm]')", file=sys.stderr)
        return 1
    try:
        engine_args = parse_engine_args(rest, model=args.model, block_size=args.block_size,
                                        kv_events_port=args.kv_events_port)
        hf_config = AutoConfig.from_pretrained(args.model, trust_remote_code=engine_args.trust_remote_code)
        family = family_for(getattr(hf_config, "architectures", None) or [], hf_config)
    except ValueError as e:  # refused before any weights load
        print(f"error: {e}", file=sys.stderr)
        return 2

    async def serve() -> None:
        from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model

        runtime = make_runtime(asyncio.get_running_loop())
        endpoint = runtime.endpoint(endpoint_path(args.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT))
        rpc = await runtime.endpoint(endpoint_path(args.namespace)).client()
        handler = VllmEngine(AsyncLLM.from_engine_args(engine_args), HandleResolver(args.encoder_chain, rpc), family)
        events = engine_args.kv_events_config
        if engine_args.enable_prefix_caching and events is not None and events.enable_kv_cache_events:
            # held by the handler: the relay lives as long as the publisher object
            handler.publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=args.block_size,
                                                 zmq_endpoint=events.endpoint.replace("*", "127.0.0.1"),
                                                 zmq_topic=events.topic)
        serving = asyncio.ensure_future(endpoint.serve_endpoint(handler.generate, graceful_shutdown=True))
        await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, args.model,
                             worker_type=WorkerType.Aggregated, kv_cache_block_size=args.block_size)
        await serving

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
