"""Reference engine worker: a CPU chat model that prefills token ids + spliced embeddings.

    python -m mm_encoder.engines.reference --model-dir DIR [--namespace mm] [--block-size 16]
    python -m mm_encoder.engines.reference --make-model-dir DIR [--model tiny]

It serves `<namespace>.engine.generate` (request: `protocol.EngineRequest`), registers the model
with Dynamo as a chat model (so the frontend discovers it), generates greedily, streams one token
per item, and publishes KV events for the prompt's full blocks with the same media info the
router hashes (`mm_encoder.routing.block_mm_infos`). One request runs at a time on one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..routing import block_mm_infos, to_signed64
from .lm import ReferenceLM, load_config, make_model_dir
from .protocol import EngineRequest, media_rows

log = logging.getLogger("mm_encoder.engine")

COMPONENT = "engine"
ENDPOINT = "generate"


class ReferenceEngine:
    """The model plus its KV-event bookkeeping; `generate` is the Dynamo handler."""

    def __init__(self, model_dir: str | Path, block_size: int = 16, publisher=None, max_stored_blocks: int = 65536,
                 encoder=None):
        self.model = ReferenceLM.from_dir(model_dir)
        self.model_dir = Path(model_dir)
        self.encoder = encoder  # set: this engine also encodes media itself (the aggregated baseline)
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
    def prefill(self, req: EngineRequest, rows: list | None = None) -> tuple[torch.Tensor, list]:
        """Logits of the prompt's last position, and the KV cache."""
        if rows is None:
            rows = [r for item in req.media for r in media_rows(item, self.cfg.hidden_size)]
        x = self.model.embed_tokens(req.token_ids, rows)
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
            from ..fetch import Fetcher
            from ..frontend.chat import ChatTokenizer, Splicer

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
            raise ValueError("this engine does not encode media; start it with --encoder-model")
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
            raise ValueError(f"the prompt is {len(req.token_ids)} tokens after expanding its media; the context "
                             f"length is {self.cfg.context_length}")
        req.max_tokens = min(req.max_tokens, room)
        return [(off, t) for spans, outs in zip(spliced.spans, tensors, strict=True)
                for (off, _), t in zip(spans, outs, strict=True)]

    # --- KV events ---------------------------------------------------------------------------

    def publish_prompt_blocks(self, req: EngineRequest) -> None:
        """KV 'stored' events for the prompt's full blocks, hashed like the router hashes them."""
        if self.publisher is None:
            return
        from dynamo.llm import compute_block_hash_for_seq

        n_full = len(req.token_ids) // self.block_size
        if n_full == 0:
            return
        tokens = req.token_ids[: n_full * self.block_size]
        infos = block_mm_infos(len(tokens), self.block_size, [_clip(s, len(tokens)) for s in req.media_spans()])
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

    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        req = EngineRequest.from_dict(request)
        request = None  # the embeddings live in `req` until prefill, then nowhere
        rows = await self.splice_inline(req, loop) if req.segments is not None else None
        if len(req.token_ids) + req.max_tokens > self.cfg.context_length:
            raise ValueError(f"prompt {len(req.token_ids)} + max_tokens {req.max_tokens} exceeds the context "
                             f"length {self.cfg.context_length}")
        self.requests += 1
        logits, cache = await loop.run_in_executor(self._pool, self.prefill, req, rows)
        rows = None
        self.publish_prompt_blocks(req)
        position = len(req.token_ids)
        eos = set(req.eos_token_ids)
        req.media.clear()
        for i in range(req.max_tokens):
            token = int(logits.argmax())
            last = i == req.max_tokens - 1
            finish = "stop" if (token in eos and not req.ignore_eos) else ("length" if last else None)
            item = {"token_ids": [token], "finish_reason": finish}
            if i == 0:
                item["prompt_tokens"] = len(req.token_ids)
            yield item
            if finish is not None or (context is not None and context.is_stopped()):
                return
            logits, cache = await loop.run_in_executor(self._pool, self.step, token, position, cache)
            position += 1


def _clip(span, n: int):
    """Media spans limited to the first n tokens (the full blocks)."""
    from ..routing import MediaSpan

    kept = tuple((o, min(l_, n - o)) for o, l_ in span.spans if o < n)
    return MediaSpan(span.mm_hash, kept) if kept else MediaSpan(span.mm_hash, ())


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model

    from ..dynamo_rpc import make_runtime

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runtime = make_runtime(loop)
    endpoint = runtime.endpoint(f"{args.namespace}.{COMPONENT}.{ENDPOINT}")
    _, raw = load_config(args.model_dir)
    name = args.name or raw.get("served_model_name") or Path(args.model_dir).name
    encoder = None
    if args.encoder_model:  # the aggregated baseline: this engine encodes media itself
        from ..encoder import Encoder

        encoder = Encoder.from_pretrained(args.encoder_model, checkpoint=args.encoder_checkpoint)
    engine = ReferenceEngine(args.model_dir, args.block_size, encoder=encoder)
    engine.publisher = KvEventPublisher(endpoint, kv_block_size=args.block_size)
    serving = asyncio.ensure_future(endpoint.serve_endpoint(engine.generate, graceful_shutdown=True))
    await register_model(
        ModelInput.Tokens, ModelType.Chat, endpoint, str(args.model_dir), name,
        worker_type=WorkerType.Aggregated, kv_cache_block_size=args.block_size,
    )
    print(f"mm-encoder reference engine ready: model={name} endpoint={args.namespace}.{COMPONENT}.{ENDPOINT} "
          f"instance={endpoint.connection_id()}", flush=True)
    await stop.wait()
    runtime.shutdown()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mm_encoder.engines.reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="a directory written by --make-model-dir")
    p.add_argument("--make-model-dir", type=Path, help="write a model directory and exit")
    p.add_argument("--model", default="tiny", help="vision model the LM serves (its width and prompt)")
    p.add_argument("--name", help="served model name (default: from config.json)")
    p.add_argument("--namespace", default="mm")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--encoder-model", help="encode media in this process with this vision model (no encode worker)")
    p.add_argument("--encoder-checkpoint", help="checkpoint directory for --encoder-model")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.make_model_dir:
        print(make_model_dir(args.make_model_dir, args.model, name=args.name))
        return 0
    if not args.model_dir:
        p.error("--model-dir is required")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
