"""One trace per request across the whole EPD graph: `mm-encoder serve graphs/epd.yaml` with the
standard OpenTelemetry environment pointed at a real OTLP/HTTP receiver (`harness.otlp`, decoding
`ExportTraceServiceRequest` with opentelemetry-proto). A chat with the client's `traceparent` is
one trace with that id: Dynamo's own frontend span continues the client's, our frontend's steps
are children of it, the encode worker's span is a child of the frontend's encode call (through two
nginx tiers, which forward the header and log the trace id with their cache result), the engine's
a child of the frontend's engine call, each component's steps in time order. The same image again
is a cache hit: no encode-worker span, no forward. The trace id is in the components' JSONL log
lines for the request. A chat without `traceparent` gets a trace of its own. The frontend trusts
the client's trace here (`--trust-client-trace`; tests/test_frontend_request.py has both modes). Real processes
throughout (Dynamo, nginx, the encode worker, the checkpoint's language model in two engines)."""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import urllib.request

import pytest

from harness.otlp import Receiver, Span
from harness.serve_fixtures import MODEL, Served, sample_content
from harness.topology import free_port, require_nginx
from mm_encoder.serve.status import collect

FRONTEND = ["template", "admission", "encode", "splice+tokenize", "route", "engine"]
WORKER = ["plan", "decode+preprocess", "device"]
ENGINE = ["handle_fetch", "handle_decode", "prefill", "decode"]


def _chat(port: int, traceparent: str | None) -> dict:
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": sample_content()}]}
    headers = {"Content-Type": "application/json", **({"traceparent": traceparent} if traceparent else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return sorted((s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns)


def _in_order(steps: list[Span], names: list[str]) -> None:
    """The steps are `names`, started in that order, each ending before the next starts."""
    assert [s.name for s in steps] == names
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(steps)), [(s.name, s.start_ns, s.end_ns)
                                                                               for s in steps]


def _log_records(path) -> list[dict]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):  # a line of another format that starts with a brace
                records.append(json.loads(line))
    return records


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
def test_one_trace_per_request_across_the_epd_graph(tmp_path):
    require_nginx()
    port = free_port()
    run = tmp_path / "run"
    with Receiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "DYN_LOGGING_JSONL": "true", "MM_FRONTEND_TRUST_CLIENT_TRACE": "true",
               **{f"MM_{c}_LOG_LEVEL": "debug" for c in ("FRONTEND", "ENCODER", "ENGINE")}}
        with Served("graphs/epd.yaml", run, port, env=env) as served:
            served.wait_for("ready: OpenAI base URL", 240)
            trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
            assert _chat(port, f"00-{trace_id}-{caller}-01")["usage"]["prompt_tokens"] == 1223
            spans = receiver.wait(trace_id, {"mm_frontend.request", *FRONTEND, "mm_encoder.encode", *WORKER,
                                             "mm_engine.generate", *ENGINE}, parent=caller)
            by_id = {s.span_id: s for s in spans}
            # one tree: the only span whose parent is not in the trace is the first, the client's child
            (top,) = [s for s in spans if s.parent_span_id not in by_id]
            assert top.parent_span_id == caller and top.service == "epd/frontend"  # Dynamo's http-request
            (request,) = [s for s in spans if s.name == "mm_frontend.request"]
            assert request.parent_span_id == top.span_id and request.service == "epd/frontend"
            steps = _children(spans, request)
            _in_order(steps, FRONTEND)
            encode, route, engine = steps[2], steps[4], steps[5]
            assert "MISS" in encode.attributes["mm_encoder.cache"] and encode.attributes["mm_encoder.tokens"] == 1196
            assert route.attributes["mm_frontend.overlap_blocks"] == 0
            assert engine.attributes["mm_frontend.finish_reason"] == "length"
            assert engine.attributes["mm_frontend.completion_tokens"] == 3

            # the encode worker, through the cluster tier, the router and a shard: the encode call's child
            (worker,) = _children(spans, encode)
            assert (worker.name, worker.service, worker.instance) == ("mm_encoder.encode", "epd/encoder", "encoder")
            assert worker.attributes["mm_encoder.source"] == "forward"
            mm_hash = worker.attributes["mm_encoder.mm_hash"]
            assert encode.attributes["mm_encoder.mm_hash"] == mm_hash
            _in_order(_children(spans, worker), WORKER)
            assert encode.start_ns <= worker.start_ns and worker.end_ns <= encode.end_ns

            # the engine: the engine call's child, Dynamo's own spans of the call linked
            (generate,) = _children(spans, engine)
            assert generate.name == "mm_engine.generate" and generate.service == "epd/engine"
            assert generate.instance in ("engine-0", "engine-1")
            assert generate.attributes["mm_engine.prompt_tokens"] == 1223 and len(generate.links) == 1
            engine_steps = _children(spans, generate)
            _in_order(engine_steps, ENGINE)
            assert engine_steps[2].attributes["mm_engine.reused_tokens"] == 0
            assert engine_steps[3].attributes["mm_engine.completion_tokens"] == 3

            # the same image again, a new trace: the cluster tier answers; no encode worker, no forward
            again = secrets.token_hex(16)
            _chat(port, f"00-{again}-{secrets.token_hex(8)}-01")
            receiver.wait(again, {"mm_frontend.request", "encode", "mm_engine.generate", "decode"})
            # `mm-encoder status` names the slowest recent request (the first: it encoded) by its trace
            frontend = next(c for c in collect(run)["components"] if c["name"] == "frontend")
            assert frontend["slowest"]["trace_id"] == trace_id
            _chat(port, None)  # no traceparent: a trace of its own
        # stopped: every process has flushed what it had batched
        hit = receiver.trace(again)
        (encode2,) = [s for s in hit if s.name == "encode"]
        assert encode2.attributes["mm_encoder.cache"] == "http:cluster=HIT"
        assert encode2.attributes["mm_encoder.mm_hash"] == mm_hash
        assert not {"mm_encoder.encode", "device"} & {s.name for s in hit}
        assert next(s for s in hit if s.name == "prefill").attributes["mm_engine.reused_tokens"] == 1216
        (own,) = {s.trace_id for s in receiver.spans if s.name == "mm_frontend.request"} - {trace_id, again}
        spans = receiver.trace(own)
        assert [s.parent_span_id for s in spans if s.parent_span_id not in {x.span_id for x in spans}] == [""]
        assert {"mm_frontend.request", "encode", "mm_engine.generate"} <= {s.name for s in spans}

    # the trace id in each component's log lines for the request (JSONL, as Dynamo's DYN_LOGGING_JSONL)
    logs = run  # serve's run directory: one log per process
    for name in ("frontend", "encoder"):
        assert any(r.get("trace_id") == trace_id for r in _log_records(logs / f"{name}.log")), name
    assert any(r.get("trace_id") == trace_id for e in ("engine-0", "engine-1") for r in _log_records(logs / f"{e}.log"))
    # the tiers: one JSON line per request with the trace id and the cache result (a MISS, then a HIT)
    cluster = [r for r in _log_records(logs / "cluster.log") if r.get("tier") == "cluster"]
    assert {"trace_id": trace_id, "cache": "MISS", "method": "HEAD"}.items() <= next(
        r for r in cluster if r["trace_id"] == trace_id).items()
    assert any(r["trace_id"] == again and r["cache"] == "HIT" for r in cluster)
