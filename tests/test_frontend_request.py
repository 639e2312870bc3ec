"""One chat request's state in the frontend (`frontend.request.FrontendRequest`), through the
processor with a stand-in router and engine: its /mm/stats record is written once, complete, before
the client has its last chunk (and, for a request that ends otherwise after routing, as it ends);
none for a request never routed; its hold given back however it ends; the engine request carries
the engine call's trace in its typed `trace`; the spans keep their names, parents and errors."""

from __future__ import annotations

import asyncio
import copy

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from harness.worker_fixtures import SPEC
from mm_encoder.core.engine_reply import TokenBatch, Usage, refusal
from mm_encoder.core.errors import BadRequest
from mm_encoder.core.prompt import ChatTokenizer
from mm_encoder.core.registry import get_spec
from mm_encoder.frontend.processor import Limits, MultimodalProcessor
from mm_encoder.runtime import tracing

WORKER = 7
HI = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def tok(checkpoint) -> ChatTokenizer:
    return ChatTokenizer(checkpoint)


class Router:
    """Dynamo's KvRouter as the processor sees it: every request to one engine, its books recorded."""

    def __init__(self) -> None:
        self.freed: list[str] = []

    async def best_worker(self, token_ids, *, block_mm_infos=None, request_id=None, cache_namespace=None):
        return WORKER, 0, 3

    async def mark_prefill_complete(self, rid: str) -> None:
        pass

    async def free(self, rid: str) -> None:
        self.freed.append(rid)


class Engine:
    """An engine client answering each request with `items` (then, with `broken`, a broken stream)."""

    def __init__(self, items: list[dict], broken: bool = False) -> None:
        self.items, self.broken, self.payloads = items, broken, []

    def instance_ids(self) -> list[int]:
        return [WORKER]

    async def direct(self, payload: dict, worker: int):
        self.payloads.append(payload)

        async def stream():
            for item in self.items:
                yield item
            if self.broken:
                raise ValueError("Stream ended before generation completed")
        return stream()


def first(prompt_tokens: int = 5) -> dict:
    return TokenBatch([11], None, usage=Usage(prompt_tokens, 3, {"fetch": 1.0, "prefill": 2.0})).to_dict()


def processor(tok, engine: Engine, inline: bool = False) -> MultimodalProcessor:
    return MultimodalProcessor(served_name="m", spec=get_spec(SPEC), tokenizer=tok, encoder=None, router=Router(),
                               engine_client=engine, block_size=16, eos_token_ids=[1],
                               limits=Limits(context_length=200), inline_media=inline)


async def test_the_record_is_written_once_complete_before_the_last_chunk(tok):
    engine = Engine([first(), TokenBatch([12], "length").to_dict()])
    proc = processor(tok, engine)
    gen = proc.generate(HI)
    await gen.__anext__()
    assert not proc.stats.recent  # the answer is not done: no record yet
    (live,) = proc.snapshot()["in_flight"]  # listed in flight instead: where it went
    assert (live["worker_id"], live["media"], live["trace_id"]) == (WORKER, [], None) and live["ms"] >= 0
    assert set(live) == {"request_id", "trace_id", "worker_id", "prompt_tokens", "media", "ms"}
    last = await gen.__anext__()
    assert last["choices"][0]["finish_reason"] == "length"
    (record,) = proc.stats.recent  # there before the client has read past the last chunk
    assert set(record) == {"request_id", "trace_id", "worker_id", "overlap_blocks", "prompt_tokens", "media",
                           "timings"}
    assert (record["worker_id"], record["overlap_blocks"], record["media"], record["trace_id"]) == (WORKER, 3, [], None)
    assert record["prompt_tokens"] == last["usage"]["prompt_tokens"]
    assert set(record["timings"]) == {"encode_ms", "route_ms", "first_token_ms", "engine_fetch_ms",
                                      "engine_prefill_ms", "reused_tokens"}
    assert record["timings"]["reused_tokens"] == 3 and record["timings"]["engine_prefill_ms"] == 2.0
    seen = copy.deepcopy(record)
    with pytest.raises(StopAsyncIteration):
        await gen.__anext__()
    assert list(proc.stats.recent) == [seen] and proc.snapshot()["recent"] == [seen]  # never changed after
    assert live["request_id"] == seen["request_id"] and live["prompt_tokens"] == seen["prompt_tokens"]
    assert proc.snapshot()["in_flight"] == []  # ended: no longer in flight
    await asyncio.sleep(0)  # the router's bookkeeping is not waited for (`_router_note`)
    assert proc.capacity.inflight == 0 and proc.router.freed == [record["request_id"]]
    assert "trace" not in engine.payloads[0]  # tracing off: the engine request carries none


async def test_the_baseline_records_the_engines_prompt_count(tok):
    proc = processor(tok, Engine([first(prompt_tokens=9), TokenBatch([12], "stop").to_dict()]), inline=True)
    chunks = [c async for c in proc.generate(HI)]
    (record,) = proc.stats.recent
    assert chunks[-1]["usage"]["prompt_tokens"] == 9
    assert record["prompt_tokens"] is None and record["timings"]["prompt_tokens"] == 9
    assert set(record["timings"]) == {"first_token_ms", "engine_fetch_ms", "engine_prefill_ms", "reused_tokens",
                                      "prompt_tokens"}


async def test_a_request_that_ends_otherwise_after_routing_is_recorded_as_it_ends(tok):
    """Refused by the engine, or cancelled by its client: recorded with what was known, once."""
    from dynamo.llm.exceptions import InvalidArgument

    proc = processor(tok, Engine([refusal(BadRequest("no"))]))
    with pytest.raises(InvalidArgument, match="no"):
        [c async for c in proc.generate(HI)]
    (refused,) = proc.stats.recent
    assert set(refused["timings"]) == {"encode_ms", "route_ms"} and proc.stats.errors == {"bad_request": 1}

    proc = processor(tok, Engine([first(), TokenBatch([12]).to_dict(), TokenBatch([13], "length").to_dict()]))
    gen = proc.generate(HI)
    await gen.__anext__()
    await gen.aclose()  # the client went away after its first chunk
    (cancelled,) = proc.stats.recent
    assert "first_token_ms" in cancelled["timings"] and proc.capacity.inflight == 0
    assert proc.snapshot()["in_flight"] == []


async def test_a_request_never_routed_has_no_record(tok):
    from dynamo.llm.exceptions import InvalidArgument

    proc = processor(tok, Engine([]))
    with pytest.raises(InvalidArgument):
        await proc.generate({"messages": [{"role": "user", "content": "<|media_pad|>"}]}).__anext__()
    assert not proc.stats.recent and proc.capacity.inflight == 0


async def test_the_engine_call_is_traced_under_the_request_and_its_request_carries_it(tok, monkeypatch):
    """The engine request's `trace` is the engine call's span; a stream that breaks off marks that
    span with the engine's failure as it came (the client gets a 503); the record names the trace."""
    from dynamo.llm.exceptions import CannotConnect

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    engine = Engine([first()], broken=True)
    proc = processor(tok, engine)
    with pytest.raises(CannotConnect):
        [c async for c in proc.generate(HI)]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, call = spans["mm_frontend.request"], spans["engine"]
    assert [s.parent.span_id for s in (spans["template"], spans["route"], call)] == [root.context.span_id] * 3
    trace_id = format(root.context.trace_id, "032x")
    (traceparent,) = engine.payloads[0]["trace"].values()  # W3C: version-trace-span-flags
    assert traceparent.startswith(f"00-{trace_id}-{call.context.span_id:016x}-")
    assert call.status.status_code == StatusCode.ERROR and call.status.description.startswith("EngineUnavailable")
    assert root.status.status_code == StatusCode.ERROR and call.attributes["mm_frontend.completion_tokens"] == 1
    assert [e.name for e in call.events][:1] == ["first_item"]
    (record,) = proc.stats.recent
    assert record["trace_id"] == trace_id and "first_token_ms" in record["timings"]


class Context:
    """Dynamo's request context as the processor reads it: its id, whether the client went away, and
    the W3C headers of the trace it carries (the client's `traceparent`, as Dynamo's runtime passes it)."""

    def __init__(self, traceparent: str) -> None:
        self.traceparent = traceparent

    def id(self) -> str:
        return "dynamo-request-1"

    def is_stopped(self) -> bool:
        return False

    def trace_headers(self) -> dict[str, str]:
        return {"traceparent": self.traceparent}


@pytest.mark.parametrize("trust", [False, True], ids=["edge", "trusted"])
async def test_a_clients_trace_is_continued_only_when_trusted(tok, monkeypatch, trust):
    """The OpenAI port is the edge: by default a request's span starts a trace of the frontend's own,
    sampled by its own sampler, and links the client's; with `--trust-client-trace` it continues the
    client's trace. Under a sampler that records no new trace (parent-based, root off), a client's
    sampled traceparent forces recording only when trusted."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    client_trace, client_span = "c" * 32, "d" * 16
    ctx = Context(f"00-{client_trace}-{client_span}-01")
    recorded: dict[str, list] = {}
    for sampler in ("default", "root off"):
        exporter = InMemorySpanExporter()
        provider = TracerProvider() if sampler == "default" else TracerProvider(sampler=ParentBased(ALWAYS_OFF))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
        proc = MultimodalProcessor(served_name="m", spec=get_spec(SPEC), tokenizer=tok, encoder=None, router=Router(),
                                   engine_client=Engine([first(), TokenBatch([12], "stop").to_dict()]), block_size=16,
                                   eos_token_ids=[1], limits=Limits(context_length=200), trust_client_trace=trust)
        assert [c async for c in proc.generate(HI, ctx)][-1]["choices"][0]["finish_reason"] == "stop"
        recorded[sampler] = [s for s in exporter.get_finished_spans() if s.name == "mm_frontend.request"]
    (root,) = recorded["default"]
    assert root.attributes["dynamo.request_id"] == "dynamo-request-1"
    linked = [(format(link.context.trace_id, "032x"), format(link.context.span_id, "016x")) for link in root.links]
    if trust:
        assert format(root.context.trace_id, "032x") == client_trace
        assert format(root.parent.span_id, "016x") == client_span and linked == []
        assert len(recorded["root off"]) == 1  # the client's sampled flag decides
    else:
        assert format(root.context.trace_id, "032x") != client_trace and root.parent is None
        assert linked == [(client_trace, client_span)]
        assert recorded["root off"] == []  # the frontend's sampler decides, not the client
