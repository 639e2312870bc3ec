"""Reference engine worker: a CPU chat model that prefills token ids + spliced embeddings.

    python -m mm_encoder.engines.reference --model-dir DIR [--namespace mm] [--block-size 16]
    python -m mm_encoder.engines.reference --make-model-dir DIR [--model tiny]

It serves `<namespace>.engine.generate` and takes either frontend's request: ours
(`core.requests.EngineRequest`, media by handle) or Dynamo's preprocessed request from the stock
`python -m dynamo.frontend` (media placeholders expanded here from the Encode worker's
`encoder_result`; `--frontend stock` registers the model card that makes the stock frontend call
the Encode worker first). It fetches each media body by handle, samples (`engines.sampling`),
streams one token per item, and publishes KV events for the prompt's full blocks with the same
media info the router hashes (`mm_encoder.routing.block_mm_infos`). One request runs at a time on
one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..core.dynamo import (
    BLOCK_SIZE,
    ENGINE_COMPONENT,
    GENERATE_ENDPOINT,
    NAMESPACE,
    endpoint_path,
    make_runtime,
    worker_error,
)
from ..core.errors import BadRequest, ContextOverflow, MMEncoderError
from ..core.handle import HandleResolver
from ..core.process import parse_settings, run, stop_on_signals
from ..core.prompt import ChatTokenizer, Splicer, check_model_dir
from ..core.registry import DEFAULT_MODEL
from ..core.requests import EngineRequest
from ..core.sampling import SamplingParams
from ..fetch import Fetcher
from ..routing import MediaSpan, block_mm_infos, to_signed64
from .dynamo_request import chunk as dynamo_chunk
from .dynamo_request import from_preprocessed
from .inputs import fetch_bodies, media_rows
from .lm import ReferenceLM, load_config
from .model_dir import make_model_dir
from .sampling import Sampler

log = logging.getLogger("mm_encoder.engine")


class EngineSettings(BaseSettings):
    """Every option from the command line or `MM_ENGINE_<OPTION>`."""

    model_config = SettingsConfigDict(env_prefix="MM_ENGINE_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m mm_encoder.engines.reference", extra="ignore",
                                      frozen=True)

    model_dir: Path | None = Field(None, description="a directory written by --make-model-dir")
    make_model_dir: Path | None = Field(None, description="write a model directory and exit")
    context_length: int = Field(4096, ge=64, description="with --make-model-dir: the model's context length")
    model: str = Field(DEFAULT_MODEL, description="vision model the LM serves (its width and prompt)")
    name: str | None = Field(None, description="served model name (default: from config.json)")
    namespace: str = Field(NAMESPACE, description="Dynamo namespace")
    block_size: int = Field(BLOCK_SIZE, ge=1, description="KV block size (the router hashes by it)")
    encoder_model: str | None = Field(None, description="encode media in this process (no encode worker)")
    encoder_checkpoint: str | None = Field(None, description="checkpoint directory for --encoder-model")
    encoder_chain: tuple[str, ...] = Field((), description="cache chain URLs media handles may be fetched from "
                                           "(none: Dynamo RPC to the encode workers only)")

    frontend: Literal["mm", "stock"] = Field(
        "mm", description="mm: serve this project's frontend (EngineRequest); stock: Dynamo's own frontend "
                          "(preprocessed requests, media via its Encode worker)")


class ReferenceEngine:
    """The model plus its KV-event bookkeeping; `generate` is the Dynamo handler."""

    def __init__(self, model_dir: str | Path, block_size: int = BLOCK_SIZE, publisher=None,
                 max_stored_blocks: int = 65536, encoder=None, resolver: HandleResolver | None = None):
        self.model = ReferenceLM.from_dir(model_dir)
        self.model_dir = Path(model_dir)
        self.encoder = encoder  # set: this engine also encodes media itself (the aggregated baseline)
        self.resolver = resolver or HandleResolver()  # fetches media bodies by handle
        self._splicer: Splicer | None = None
        self._inline = None
        self.cfg, self.raw_config = load_config(model_dir)
        self.block_size = block_size
        self.publisher = publisher
        self.max_stored_blocks = max_stored_blocks
        self._stored: OrderedDict[int, None] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mm-engine")
        self.requests = 0

    # --- model work (engine thread) ----------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], rows: list) -> tuple[torch.Tensor, list]:
        """Logits of the prompt's last position, and the KV cache."""
        x = self.model.embed_tokens(token_ids, rows)
        logits, cache = self.model(x)
        return logits[-1], cache

    @torch.inference_mode()
    def step(self, token: int, position: int, cache: list) -> tuple[torch.Tensor, list]:
        x = self.model.embed_tokens([token])
        logits, cache = self.model(x, start=position, cache=cache)
        return logits[-1], cache

    # --- the aggregated baseline: encode inline, on the engine thread ------------------------

    def _inline_tools(self):
        if self._inline is None:
            self._inline = (Fetcher(), Splicer(ChatTokenizer(self.model_dir), self.encoder.spec.prompt))
        return self._inline

    @torch.inference_mode()
    def encode_inline(self, data: bytes) -> tuple[str, list[int], list[str] | None, list[torch.Tensor]]:
        prepared = self.encoder.prepare_media(data)
        outputs, _ = self.encoder.forward(prepared)
        stamps = [p.timestamp for p in prepared] if prepared[0].modality == "video" else None
        return prepared[0].modality, [p.num_tokens for p in prepared], stamps, list(outputs)

    async def splice_inline(self, req: EngineRequest, loop) -> list:
        """Fetch and encode every media ref, then build token ids; returns the rows to write."""
        if self.encoder is None:
            raise BadRequest("this engine does not encode media; start it with --encoder-model")
        fetcher, splicer = self._inline_tools()
        items, tensors = [], []
        for ref in req.media_refs:
            fetched = await fetcher.fetch(ref["url"])
            modality, counts, stamps, outs = await loop.run_in_executor(self._pool, self.encode_inline, fetched.data)
            items.append((modality, counts, stamps))
            tensors.append(outs)
        spliced = splicer.splice_ids(req.segments, items)
        req.token_ids = spliced.token_ids
        room = self.cfg.context_length - len(req.token_ids)
        if room < 1:
            raise ContextOverflow(f"the prompt is {len(req.token_ids)} tokens after expanding its media; the context "
                                  f"length is {self.cfg.context_length}")
        req.max_tokens = min(req.max_tokens, room)
        return [(off, t) for spans, outs in zip(spliced.spans, tensors, strict=True)
                for (off, _), t in zip(spans, outs, strict=True)]

    # --- KV events ---------------------------------------------------------------------------

    def publish_prompt_blocks(self, token_ids: list[int], media: list) -> None:
        """KV 'stored' events for the prompt's full blocks, hashed like the router hashes them."""
        if self.publisher is None:
            return
        from dynamo.llm import compute_block_hash_for_seq

        n_full = len(token_ids) // self.block_size
        if n_full == 0:
            return
        tokens = token_ids[: n_full * self.block_size]
        spans = [MediaSpan(m.mm_hash, tuple(tuple(s) for s in m.spans)) for m in media]
        infos = block_mm_infos(len(tokens), self.block_size, [_clip(s, len(tokens)) for s in spans])
        hashes = [to_signed64(h) for h in compute_block_hash_for_seq(tokens, self.block_size, infos)]
        if all(h in self._stored for h in hashes):
            return
        self.publisher.publish_stored(tokens, [self.block_size] * n_full, hashes, None, infos)
        for h in hashes:
            self._stored[h] = None
            self._stored.move_to_end(h)
        evicted = []
        while len(self._stored) > self.max_stored_blocks:
            evicted.append(self._stored.popitem(last=False)[0])
        if evicted:
            self.publisher.publish_removed(evicted)

    # --- the handler -------------------------------------------------------------------------

    def handle(self, request: Any, context=None) -> AsyncIterator[dict[str, Any]]:
        """The Dynamo handler: Dynamo's preprocessed request (it has `stop_conditions`; from the stock
        frontend) or ours (`EngineRequest`), told apart by shape, so either frontend can serve it."""
        if isinstance(request, dict) and "stop_conditions" in request:
            return self.generate_dynamo(request, context)
        return self.generate(request, context)

    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        """Our frontend's `EngineRequest`: media by handle (fetched here) or, for the aggregated
        baseline, by URL (fetched and encoded here). A refusal before the first token is one
        `{"error": ...}` item with the error's code and status."""
        loop = asyncio.get_running_loop()
        timings: dict[str, float] = {}
        try:
            req = EngineRequest.from_dict(request)
            params = SamplingParams.from_dict(req.sampling)
            if req.segments is not None:
                rows = await self.splice_inline(req, loop)
                self.check_fits(len(req.token_ids), req.max_tokens)
            else:
                self.check_fits(len(req.token_ids), req.max_tokens)  # before any fetch
                rows = await self.media(req, timings)
        except MMEncoderError as e:
            yield e.to_dict(status=True)
            return
        first = True
        t0 = time.perf_counter()
        async for token, finish in self.decode(req.token_ids, rows, req.media, req.max_tokens, params,
                                               req.eos_token_ids, context):
            item = {"token_ids": [token], "finish_reason": finish}
            if first:  # how long this engine took to get the media and prefill: the frontend's /mm/stats
                item["prompt_tokens"] = len(req.token_ids)
                item["timings_ms"] = {**timings, "prefill": (time.perf_counter() - t0) * 1e3}
                first = False
            yield item

    async def media(self, req: EngineRequest, timings: dict[str, float]) -> list:
        """Every item's body fetched by handle and checked, then its rows decoded (engine thread)."""
        t0 = time.perf_counter()
        bodies = await fetch_bodies(req, self.resolver)
        t1 = time.perf_counter()
        rows = await asyncio.get_running_loop().run_in_executor(self._pool, media_rows, req, bodies,
                                                                self.cfg.hidden_size)
        timings["fetch"], timings["decode"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        return rows

    async def generate_dynamo(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's preprocessed request from the stock frontend: media placeholders expanded here
        from the Encode worker's handles, bodies fetched here; Dynamo's output chunks, the last with
        the expanded prompt's length as `completion_usage.prompt_tokens`."""
        try:
            req = from_preprocessed(request, self._stock_splicer(), self.cfg.context_length,
                                    context.id() if context is not None else None)
            self.check_fits(len(req.token_ids), req.max_tokens)
            rows = await self.media(req, {})
        except MMEncoderError as e:
            raise worker_error(e) from None
        params = SamplingParams.from_dict(req.sampling)
        n = 0
        async for token, finish in self.decode(req.token_ids, rows, req.media, req.max_tokens, params,
                                               req.eos_token_ids, context):
            n += 1
            yield dynamo_chunk(token, finish, len(req.token_ids), n)

    def _stock_splicer(self) -> Splicer:
        if self._splicer is None:
            from ..core.registry import get_spec

            self._splicer = Splicer(ChatTokenizer(self.model_dir), get_spec(self.raw_config["mm_encoder_model"]).prompt)
        return self._splicer

    def check_fits(self, prompt: int, max_tokens: int) -> None:
        if prompt + max_tokens > self.cfg.context_length:
            raise ContextOverflow(f"prompt {prompt} + max_tokens {max_tokens} exceeds the context length "
                                  f"{self.cfg.context_length}")

    async def decode(self, token_ids: list[int], rows: list, media: list, max_tokens: int, params: SamplingParams,
                     eos_token_ids: list[int], context=None) -> AsyncIterator[tuple[int, str | None]]:
        """Prefill, then one (token, finish_reason) per step until a stop, max_tokens or the caller stops."""
        loop = asyncio.get_running_loop()
        self.requests += 1
        logits, cache = await loop.run_in_executor(self._pool, self.prefill, token_ids, rows)
        rows = None
        self.publish_prompt_blocks(token_ids, media)
        sampler = Sampler(params, eos_token_ids)
        position = len(token_ids)
        for i in range(max_tokens):
            token = sampler.next(logits)
            finish = sampler.stop_reason(token) or ("length" if i == max_tokens - 1 else None)
            yield token, finish
            if finish is not None or (context is not None and context.is_stopped()):
                return
            logits, cache = await loop.run_in_executor(self._pool, self.step, token, position, cache)
            position += 1


def _clip(span: MediaSpan, n: int) -> MediaSpan:
    """Media spans limited to the first n tokens (the full blocks)."""
    kept = tuple((o, min(l_, n - o)) for o, l_ in span.spans if o < n)
    return MediaSpan(span.mm_hash, kept) if kept else MediaSpan(span.mm_hash, ())


async def serve(s: EngineSettings) -> None:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    stop = stop_on_signals()
    runtime = make_runtime(asyncio.get_running_loop())
    path = endpoint_path(s.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT)
    endpoint = runtime.endpoint(path)
    _, raw = load_config(s.model_dir)
    name = s.name or raw.get("served_model_name") or s.model_dir.name
    encoder = None
    if s.encoder_model:  # the aggregated baseline: this engine encodes media itself
        from ..model.encoder import Encoder

        encoder = Encoder.from_pretrained(s.encoder_model, checkpoint=s.encoder_checkpoint)
    rpc = await runtime.endpoint(endpoint_path(s.namespace)).client() if not encoder else None
    engine = ReferenceEngine(s.model_dir, s.block_size, encoder=encoder, resolver=HandleResolver(s.encoder_chain, rpc))
    engine.publisher = KvEventPublisher(endpoint, kv_block_size=s.block_size)
    serving = asyncio.ensure_future(endpoint.serve_endpoint(engine.handle, graceful_shutdown=True))
    stock: dict[str, Any] = {}
    if s.frontend == "stock":  # Dynamo's frontend calls the Encode worker first and forwards its result here
        rc = ModelRuntimeConfig()
        rc.set_engine_specific("encoder_result_handoff", "true")
        stock = {"runtime_config": rc, "needs": [[WorkerType.Encode]]}
    await register_model(
        ModelInput.Tokens, ModelType.Chat, endpoint, str(s.model_dir), name,
        worker_type=WorkerType.Aggregated, kv_cache_block_size=s.block_size, **stock,
    )
    print(f"mm-encoder reference engine ready: model={name} endpoint={path} instance={endpoint.connection_id()}",
          flush=True)
    await stop.wait()
    runtime.shutdown()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 30)


def main(argv: list[str] | None = None) -> int:
    s = parse_settings(EngineSettings, argv, check=_check)
    if s is None:
        return 2
    if s.make_model_dir:
        print(make_model_dir(s.make_model_dir, s.model, name=s.name, context_length=s.context_length))
        return 0
    return run(serve(s))


def _check(s: EngineSettings) -> None:
    if s.make_model_dir:
        return
    if not s.model_dir:
        raise ValueError("--model-dir (or --make-model-dir) is required")
    check_model_dir(s.model_dir)


if __name__ == "__main__":
    sys.exit(main())
