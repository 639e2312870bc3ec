"""The frontend's parts one by one: routing info, chat parsing and splicing, max_tokens, cache keys,
wire headers, the reference engine's parity, and that the frontend handles no embeddings."""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import json
import sys
from contextlib import asynccontextmanager

import pytest
import torch
from media_factory import image_bytes, natural_image
from worker_fixtures import run_worker

from mm_encoder import wire
from mm_encoder.core.errors import BadRequest, ContextOverflow
from mm_encoder.core.handle import MediaHandle, Source, cache_key
from mm_encoder.core.prompt import ChatTokenizer, Splicer
from mm_encoder.core.registry import get_spec
from mm_encoder.core.requests import EngineRequest, MediaInput
from mm_encoder.core.sampling import SamplingParams
from mm_encoder.engines.lm import ReferenceLM
from mm_encoder.engines.model_dir import make_model_dir
from mm_encoder.engines.reference import ReferenceEngine
from mm_encoder.frontend.chat import MediaRef, parse_messages, prompt_segments
from mm_encoder.frontend.encoder_client import EncoderClient
from mm_encoder.frontend.processor import Limits, MultimodalProcessor
from mm_encoder.routing import MediaSpan, block_mm_infos, pad_routing_tokens, to_signed64

H1, H2 = "ab" * 32, "cd" * 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("lm") / "tiny-chat", "tiny", context_length=256)


# --- routing --------------------------------------------------------------------------------------


def test_block_mm_infos_marks_exactly_the_blocks_an_item_covers():
    assert block_mm_infos(40, 16, []) is None  # text only: routes as before
    infos = block_mm_infos(40, 16, [MediaSpan(H1, ((10, 12),)), MediaSpan(H2, ((30, 5),))])
    assert len(infos) == 3
    assert infos[0] == {"mm_objects": [{"mm_hash": int(H1[:16], 16), "offsets": [[10, 16]]}]}
    assert infos[1]["mm_objects"] == [{"mm_hash": int(H1[:16], 16), "offsets": [[16, 22]]},
                                      {"mm_hash": int(H2[:16], 16), "offsets": [[30, 32]]}]
    assert infos[2] == {"mm_objects": [{"mm_hash": int(H2[:16], 16), "offsets": [[32, 35]]}]}
    with pytest.raises(ValueError):
        block_mm_infos(40, 16, [MediaSpan(H1, ((35, 10),))])
    pad = 1_000_000 + (int(H1[:16], 16) & (2**30 - 1))
    assert pad_routing_tokens([1, 2, 3, 4], [MediaSpan(H1, ((1, 2),))]) == [1, pad, pad, 4]
    assert to_signed64(2**64 - 1) == -1 and to_signed64(5) == 5


def test_dynamo_block_hashes_change_only_where_the_image_is():
    from dynamo.llm import compute_block_hash_for_seq

    tokens = list(range(64))
    a = compute_block_hash_for_seq(tokens, 16, block_mm_infos(64, 16, [MediaSpan(H1, ((36, 20),))]))
    b = compute_block_hash_for_seq(tokens, 16, block_mm_infos(64, 16, [MediaSpan(H2, ((36, 20),))]))
    plain = compute_block_hash_for_seq(tokens, 16)
    assert a[:2] == b[:2] == plain[:2]  # blocks before the image: the same KV
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # image blocks: never a false hit


# --- chat parsing and splicing -----------------------------------------------------------------------


def test_parse_messages_cuts_media_out_and_refuses_bad_parts():
    msgs, media = parse_messages([{"role": "user", "content": [
        {"type": "text", "text": "look \ue0007\ue001"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
        {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]}], max_media=4)
    assert media == [MediaRef("image", "http://x/a.png"), MediaRef("video", "http://x/v.mp4")]
    assert msgs[0]["content"] == "look 7\ue0000\ue001\ue0001\ue001"  # user text cannot forge a sentinel
    for bad in ([], [{"role": "user", "content": [{"type": "audio_url"}]}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], [{"content": "x"}]):
        with pytest.raises(BadRequest):
            parse_messages(bad, max_media=4)
    with pytest.raises(BadRequest):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}] * 3}], max_media=2)


def test_splice_expands_each_placeholder_by_length(model_dir):
    tok = ChatTokenizer(model_dir)
    spec = get_spec("tiny")
    splicer = Splicer(tok, spec.prompt)
    msgs, media = parse_messages([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": "u1"}, {"type": "text", "text": "b"},
        {"type": "video_url", "video_url": "u2"}]}], max_media=4)
    texts = prompt_segments(tok, msgs, len(media))
    out = splicer.splice(texts, [("image", [6], None), ("video", [4, 4], ["00:00:00.000", "00:00:02.000"])])
    ph = splicer.placeholder_id
    assert out.token_ids.count(ph) == 14 and [len(s) for s in out.spans] == [1, 2]
    for item in out.spans:
        for offset, n in item:
            assert out.token_ids[offset : offset + n] == [ph] * n
            assert out.token_ids[offset - 1] != ph and out.token_ids[offset + n] != ph
    # the same prompt built as a string from the spec's templates: the splice is exactly that, in tokens
    ph, image, video = spec.prompt.placeholder, spec.prompt.image, spec.prompt.video
    expected = (texts[0] + image.replace(ph, ph * 6) + texts[1]
                + "".join(video.format(timestamp=t).replace(ph, ph * 4) for t in ("00:00:00.000", "00:00:02.000"))
                + texts[2])
    assert texts == ["<|im_user|>user<|im_middle|>a", "b", "<|im_end|><|im_assistant|>assistant<|im_middle|>"]
    assert tok._tok.decode(out.token_ids, skip_special_tokens=False) == expected
    assert tok.decode(out.token_ids) == "useraimageb00:00:00.000video00:00:02.000videoassistant"


def test_incremental_detokenizer_equals_decoding_everything(model_dir):
    from mm_encoder.frontend.chat import IncrementalDetokenizer

    tok = ChatTokenizer(model_dir)
    ids = tok.encode("Describe the image: a picture is worth a thousand words, café ☕ 100%!")
    for step in (1, 2, 3):
        d = IncrementalDetokenizer(tok)
        out = "".join(d.push(ids[i : i + step]) for i in range(0, len(ids), step)) + d.flush()
        assert out == tok.decode(ids)
        assert "\ufffd" not in out


def test_max_tokens_is_capped_to_the_context_and_overflow_refused(model_dir):
    proc = MultimodalProcessor(served_name="m", spec=get_spec("tiny"), tokenizer=ChatTokenizer(model_dir),
                               encoder=EncoderClient("tiny", rpc_client=object()), router=None, engine_client=None,
                               block_size=16, eos_token_ids=[1], limits=Limits(context_length=100,
                                                                                default_max_tokens=30))
    def cap(request, prompt):
        return proc.max_tokens_for(SamplingParams.from_openai(request), prompt)

    assert cap({}, 50) == 30
    assert cap({"max_tokens": 500}, 50) == 50
    assert cap({"max_completion_tokens": 10, "max_tokens": 500}, 50) == 10
    with pytest.raises(ContextOverflow, match=r"context length is 100"):
        cap({}, 100)
    with pytest.raises(BadRequest, match="max_tokens"):
        cap({"max_tokens": 0}, 10)


def test_cache_key_names_what_the_answer_depends_on():
    def documented(model, processor, ref, scope, modality=None):  # sha256 of canonical JSON
        doc = json.dumps([model, processor or {}, ref, scope, modality], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()

    k = cache_key("tiny", None, "https://x/a.png", "")
    assert k == documented("tiny", None, "https://x/a.png", "")
    assert len({k, cache_key("tiny", None, "https://x/a.png", "t2"), cache_key("other", None, "https://x/a.png", ""),
                cache_key("tiny", {"in_patch_limit": 64}, "https://x/a.png", ""),
                cache_key("tiny", None, "https://x/a.png", "", "image"),
                cache_key("tiny", None, "https://x/a.png", "", "video")}) == 6  # modality is part of the answer
    # a data: URL is keyed by the hash of its text, not the text (which may be megabytes)
    url = "data:image/png;base64,AAAA"
    assert cache_key("tiny", None, url, "") == documented("tiny", None, "sha256:" + hashlib.sha256(url.encode())
                                                          .hexdigest(), "")
    assert cache_key("tiny", None, url, "") != cache_key("tiny", None, "data:image/png;base64,AAAB", "")


def test_wire_peek_reads_the_header_without_the_tensor():
    body = wire.encode(mm_hash=H1, model="tiny", modality="video", embeds=torch.randn(32, 8),
                       grid_thws=[[4, 8, 8], [4, 8, 8]], timestamps=["00:00:00.000", "00:00:02.000"])
    h = wire.peek(body)
    m = wire.decode(body)
    assert (h.mm_hash, h.length, h.grid_thws, h.timestamps, h.shape) == (m.mm_hash, m.length, m.grid_thws,
                                                                          m.timestamps, m.shape)
    for bad in (b"", b"xx", body[:8], b"\x28\xb5\x2f\xfd" + b"\0" * 20):
        with pytest.raises(wire.WireError):
            wire.peek(bad)


@pytest.mark.parametrize("chunks", [1, 300, 1200])
def test_wire_peek_reads_a_header_longer_than_its_read_size(chunks):
    """Found by bench/hostile_memory.py: a 600 s video's header (300 chunks: grids and timestamps
    over 4 KB) was cut by peek's 4 KB reads, and a value split across two reads lost its key."""
    body = wire.encode(mm_hash=H1, model="tiny", modality="video", embeds=torch.randn(4 * chunks, 8),
                       grid_thws=[[4, 4, 4]] * chunks, timestamps=[f"00:{i // 60:02d}:{i % 60:02d}.000"
                                                                   for i in range(chunks)])
    h, m = wire.peek(body), wire.decode(body)
    assert (h.grid_thws, h.timestamps, h.shape) == (m.grid_thws, m.timestamps, m.shape)
    assert len(h.timestamps) == chunks


# --- the reference engine ---------------------------------------------------------------------------


class _Bodies:
    """Stands in for the engine's HandleResolver in the parity test (the chain has its own tests)."""

    def __init__(self, *bodies: bytes):
        self.by_hash = {wire.peek(b).mm_hash: b for b in bodies}

    async def body(self, handle: MediaHandle) -> bytes:
        return self.by_hash[handle.mm_hash]


def _handle(body: bytes, url: str = "https://media.test/a.png") -> dict:
    return MediaHandle.build(wire.peek(body), Source(model="tiny", url=url), chain=None, route="cluster",
                             rpc=None).to_dict()


async def test_engine_first_step_logits_equal_a_direct_forward_on_spliced_embeddings(model_dir):
    hidden = ReferenceEngine(model_dir).cfg.hidden_size
    emb = torch.randn(10, hidden)
    body = wire.encode(mm_hash=H1, model="tiny", modality="image", embeds=emb, grid_thws=[[1, 4, 10]],
                       dtype="float32")
    engine = ReferenceEngine(model_dir, resolver=_Bodies(body))
    tokens = [3, 5, 7] + [10] * 10 + [6, 4]
    req = EngineRequest("r", tokens, 2, [1], [MediaInput(_handle(body), [(3, 10)])])
    out = [item async for item in engine.generate(req.to_dict())]
    # independent splice: token embeddings with rows 3..12 replaced, then the same weights
    model = ReferenceLM.from_dir(model_dir)
    with torch.no_grad():
        x = model.embed.weight[torch.tensor(tokens)].clone()
        x[3:13] = emb
        ref, _ = model(x)
    logits, _ = engine.prefill(tokens, [(3, emb)])
    torch.testing.assert_close(logits, ref[-1], rtol=0, atol=0)
    # and greedy decoding with the KV cache equals recomputing the whole sequence
    first = int(ref[-1].argmax())
    with torch.no_grad():
        x2 = torch.cat([x, model.embed.weight[first][None]])
        ref2, _ = model(x2)
    assert [o["token_ids"][0] for o in out] == [first, int(ref2[-1].argmax())]
    # a span that does not match the handle's token count is refused before any fetch, as an error item
    bad = EngineRequest("r", tokens, 2, [1], [MediaInput(_handle(body), [(3, 9)])])
    (err,) = [item async for item in engine.generate(bad.to_dict())]
    assert err["error"]["code"] == "bad_request" and "do not match" in err["error"]["message"]


@asynccontextmanager
async def engine_beside_worker(tiny, model_dir, tmp_path, monkeypatch):
    """A real encode worker (Dynamo RPC) and a reference engine fetching bodies from it by handle,
    registered as `tiny-chat`, on one Dynamo runtime in this process. Yields (runtime, rpc, engine)."""
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model

    from mm_encoder.core.handle import HandleResolver

    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "kv"))
    monkeypatch.setenv("DYN_TCP_RPC_HOST", "127.0.0.1")
    async with run_worker(tiny, dynamo=True) as w:
        rt = w.dynamo.runtime
        endpoint = rt.endpoint("mm.engine.generate")
        rpc = await rt.endpoint("mm.mm_encoder.encode").client()
        await asyncio.wait_for(rpc.wait_for_instances(), 30)
        engine = ReferenceEngine(model_dir, publisher=KvEventPublisher(endpoint, kv_block_size=16),
                                 resolver=HandleResolver((), rpc))
        serving = asyncio.ensure_future(endpoint.serve_endpoint(engine.handle))
        try:
            await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, str(model_dir), "tiny-chat",
                                 worker_type=WorkerType.Aggregated, kv_cache_block_size=16)
            yield rt, rpc, engine
        finally:
            serving.cancel()


async def test_frontend_holds_no_embeddings(tiny, model_dir, tmp_path, monkeypatch):
    """In one process on the real Dynamo runtime: encode worker, reference engine (fetching bodies
    by handle over RPC), KvRouter and the processor. The processor's encoder client receives headers
    only (0 body bytes) and the engine request is kilobytes."""
    from dynamo.llm import KvRouter, KvRouterConfig

    async with engine_beside_worker(tiny, model_dir, tmp_path, monkeypatch) as (rt, rpc, engine):
        endpoint = rt.endpoint("mm.engine.generate")
        sent: list[int] = []

        class Measured:  # the engine client, recording each request's size on the wire
            def __init__(self, client):
                self.client = client

            def instance_ids(self):
                return self.client.instance_ids()

            async def direct(self, payload, worker):
                import msgpack

                sent.append(len(msgpack.packb(payload)))
                return await self.client.direct(payload, worker)

        engine_client = await endpoint.client()
        await asyncio.wait_for(engine_client.wait_for_instances(), 30)
        router = KvRouter(endpoint, 16, KvRouterConfig())
        await _until_routable(router)
        encoder = EncoderClient("tiny", rpc_client=rpc, namespace="mm")
        proc = MultimodalProcessor(
            served_name="tiny-chat", spec=get_spec("tiny"), tokenizer=ChatTokenizer(model_dir),
            encoder=encoder, router=router, engine_client=Measured(engine_client), block_size=16,
            eos_token_ids=[], limits=Limits(context_length=256))
        url = "data:image/png;base64," + base64.b64encode(image_bytes(natural_image(112, 84, seed=5))).decode()
        request = {"model": "tiny-chat", "max_tokens": 40,
                   "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        chunks = [c async for c in proc.generate(request)]
        assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert encoder.body_bytes == 0 and encoder.calls == 1
        assert engine.resolver.fetches == 1
        assert len(sent) == 1 and sent[0] < len(url) + 4096  # the data URL travels once, no embeddings
        assert proc.stats.media_requests_in_flight == 0


async def test_the_entry_point_provider_returns_a_working_factory(tiny, model_dir, tmp_path, monkeypatch):
    """What Dynamo's frontend (after 1.6.1) does with `--dyn-chat-processor mm-encoder`: resolve the
    entry point, call the provider with its parsed FrontendConfig (Dynamo 1.6.1's own parser) and
    the processor's JSON config, then call the factory for a discovered model. The returned engine
    is Dynamo's PythonAsyncEngine; the processor behind it answers a request end to end (real
    worker and reference engine on the Dynamo runtime in this process)."""
    import argparse
    import importlib.metadata
    from types import SimpleNamespace

    from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig
    from dynamo.llm import PythonAsyncEngine

    (ep,) = [e for e in importlib.metadata.entry_points(group="dynamo.frontend.chat_processors")
             if e.name == "mm-encoder"]
    parser = argparse.ArgumentParser()
    FrontendArgGroup().add_arguments(parser)
    config = FrontendConfig.from_cli_args(parser.parse_args(["--namespace", "mm"]))
    factory = ep.load()(config, {"model_dir": str(model_dir), "max_media": 4})
    assert factory.s.namespace == "mm" and factory.s.max_media == 4
    async with engine_beside_worker(tiny, model_dir, tmp_path, monkeypatch):
        try:
            made = await factory(SimpleNamespace(name="tiny-chat"), None, None)  # the process's own runtime
            assert isinstance(made, PythonAsyncEngine)
            proc = factory.processors["tiny-chat"]
            await _until_routable(proc.router)
            url = "data:image/png;base64," + base64.b64encode(image_bytes(natural_image(112, 84, seed=6))).decode()
            chunks = [c async for c in proc.generate({"model": "tiny-chat", "max_tokens": 3, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})]
            assert chunks[-1]["usage"]["completion_tokens"] == 3 and factory.encoder.calls == 1
        finally:
            await factory.close()


async def _until_routable(router, timeout: float = 30.0) -> None:
    """The router learns about engines asynchronously: poll a query-only best_worker."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await router.best_worker([1, 2, 3])
            return
        except Exception:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.02)


def _referrers(obj, depth: int = 3) -> list[str]:
    """Who still holds `obj` (for the failure message): referrer types, a few levels up."""
    out, frontier = [], [obj]
    for level in range(depth):
        nxt = []
        for o in frontier:
            for r in gc.get_referrers(o):
                if r is frontier or r is out or isinstance(r, type(sys._getframe())):
                    continue
                keys = list(r.keys())[:6] if isinstance(r, dict) else getattr(r, "__qualname__", "")
                out.append(f"{level}:{type(r).__name__}{keys}")
                nxt.append(r)
        frontier = nxt[:5]
    return out



async def test_requests_beyond_max_inflight_get_a_503_at_once(model_dir):
    """At twice its capacity the frontend used to queue without bound, until 1,484 of 11,160
    requests hung past their deadline (tests/reliability/soak.py); now the excess is refused."""
    from dynamo.llm.exceptions import CannotConnect

    proc = MultimodalProcessor(served_name="m", spec=get_spec("tiny"), tokenizer=ChatTokenizer(model_dir),
                               encoder=None, router=None, engine_client=None, block_size=16, eos_token_ids=[1],
                               limits=Limits(context_length=100, max_inflight_requests=2))
    proc._inflight = 2  # two requests being served
    with pytest.raises(CannotConnect, match="overloaded"):
        await proc.generate({"messages": [{"role": "user", "content": "hi"}]}).__anext__()
    assert proc.stats.errors == {"overloaded": 1} and proc._inflight == 2
