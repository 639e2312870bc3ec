"""OpenTelemetry traces from the encode worker, exported over OTLP/HTTP (the SDK's exporter, as the
standard environment configures it) to a real receiver decoding `ExportTraceServiceRequest`: a
caller's `traceparent` is continued (its span the parent of the worker's), the stages are child
spans in time order with the mm_hash, patches and device timings, a repeat shows the cache level
that answered and no device span, and a request without `traceparent` starts a trace of its own.
Off (no endpoint named), nothing is set up."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import urllib.request

import pytest

from harness.media_factory import image_bytes, natural_image
from harness.otlp import Receiver
from harness.serve_fixtures import data_url
from harness.topology import start_worker
from mm_encoder.runtime import tracing

PNG = image_bytes(natural_image(120, 90, seed=11))
STAGES = ["plan", "decode+preprocess", "device"]


def _encode(port: int, traceparent: str | None) -> None:
    headers = {"Content-Type": "application/json", **({"traceparent": traceparent} if traceparent else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/encode", headers=headers,
                                 data=json.dumps({"model": "tiny", "url": data_url(PNG)}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_tracing_is_off_unless_an_endpoint_is_named():
    assert not tracing.enabled({})
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"})
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"})
    assert tracing.enabled({"OTEL_EXPORT_ENABLED": "true"})  # Dynamo's switch
    assert not tracing.enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"})
    assert tracing.setup("x", {}) is None
    with tracing.span("nothing") as span:  # the API's non-recording span: no trace id to log
        assert not span.is_recording() and tracing.trace_id() is None


def test_the_worker_continues_the_callers_trace_over_otlp(tmp_path):
    with Receiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        with start_worker(env=env, log=tmp_path / "worker.log", timeout=120) as worker:
            port = worker.http_port
            trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
            _encode(port, f"00-{trace_id}-{caller}-01")
            spans = receiver.wait(trace_id, {"mm_encoder.encode", *STAGES})
            by_name = {s.name: s for s in spans}
            root = by_name["mm_encoder.encode"]
            assert root.service == "mm-encoder-worker" and root.parent_span_id == caller
            assert root.attributes["mm_encoder.source"] == "forward"
            assert root.attributes["mm_encoder.transport"] == "http"
            mm_hash = root.attributes["mm_encoder.mm_hash"]
            stages = [by_name[n] for n in STAGES]
            assert all(s.parent_span_id == root.span_id for s in stages)
            assert [s.start_ns for s in stages] == sorted(s.start_ns for s in stages)
            assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(stages))
            assert root.start_ns <= stages[0].start_ns and stages[-1].end_ns <= root.end_ns
            assert by_name["plan"].attributes["mm_encoder.mm_hash"] == mm_hash
            device = by_name["device"].attributes
            assert device["mm_encoder.patches"] > 0 and device["mm_encoder.forward_ms"] > 0

            # the same image again: the body cache answers, and the trace says so (no stage below it)
            again = secrets.token_hex(16)
            _encode(port, f"00-{again}-{secrets.token_hex(8)}-01")
            (hit,) = receiver.wait(again, {"mm_encoder.encode"})
            assert hit.attributes["mm_encoder.source"] == "mm_hash" and hit.attributes["mm_encoder.mm_hash"] == mm_hash

            # no traceparent: a trace of its own, with no parent
            before = {s.trace_id for s in receiver.spans}
            _encode(port, None)
            worker.stop()  # SIGTERM: what is still batched is flushed on the way out
            new = [s for s in receiver.spans if s.trace_id not in before and s.name == "mm_encoder.encode"]
            assert len(new) == 1 and new[0].parent_span_id == ""


def test_serve_turns_on_dynamos_tracing_beside_ours():
    """Tracing on: each component gets its service and replica names, Dynamo's own switch (its
    runtime continues the client's traceparent into the request context) and one protocol for
    both exporters; what the environment already says is kept. Off: nothing."""
    assert tracing.component_env({}, "epd/engine", "engine-1") == {}
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert tracing.component_env(on, "epd/engine", "engine-1") == {
        "OTEL_EXPORT_ENABLED": "true", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "epd/engine", "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=engine-1"}
    given = {**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORT_ENABLED": "false",
             "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"}
    kept = tracing.component_env(given, "epd/frontend", "frontend")
    assert kept == {"OTEL_SERVICE_NAME": "epd/frontend",
                    "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.instance.id=frontend"}


def test_an_engine_request_carries_the_frontends_trace():
    """`EngineRequest.trace`: the W3C headers, sent only when traced, kept; anything else refused by name."""
    from mm_encoder.core.engine_request import EngineRequest
    from mm_encoder.core.errors import BadRequest

    tp = f"00-{'a' * 32}-{'b' * 16}-01"
    req = EngineRequest("r", [1, 2], 3, trace={"traceparent": tp})
    assert EngineRequest.from_dict(req.to_dict()).trace == {"traceparent": tp}
    assert "trace" not in EngineRequest("r", [1], 1).to_dict()
    for bad in ({"cookie": "x"}, {"traceparent": 5}, {"traceparent": "x" * 600}, ["traceparent"]):
        with pytest.raises(BadRequest, match="trace is a map of"):
            EngineRequest.from_dict({**req.to_dict(), "trace": bad})


def test_log_lines_carry_the_trace_id():
    """Inside a recorded span each line names its trace and span: appended to the text format, as
    fields of the JSONL one (DYN_LOGGING_JSONL, Dynamo's switch); outside, neither."""
    import io
    import logging

    from opentelemetry.sdk.trace import TracerProvider

    from mm_encoder.runtime import logs

    assert logs.jsonl({"DYN_LOGGING_JSONL": "true"}) and not logs.jsonl({})
    tracer = TracerProvider().get_tracer("test")  # a recording tracer of its own: no global provider set
    out, ids = {}, {}
    for name, formatter in (("text", logs.TextFormatter()), ("jsonl", logs.JsonlFormatter())):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.addFilter(logs._TraceIds())
        handler.setFormatter(formatter)
        logger = logging.getLogger(f"test.logs.{name}")
        logger.addHandler(handler)
        logger.propagate = False
        with tracer.start_as_current_span("request") as span:
            logger.warning("inside %s", 1)
            ctx = span.get_span_context()
            ids[name] = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
        logger.warning("outside")
        out[name] = stream.getvalue().splitlines()
    inside, outside = out["text"]
    assert inside.endswith(f"test.logs.text: inside 1 trace_id={ids['text'][0]} span_id={ids['text'][1]}")
    assert outside.endswith("test.logs.text: outside")
    inside, outside = (json.loads(line) for line in out["jsonl"])
    assert {"level": "WARNING", "target": "test.logs.jsonl", "message": "inside 1", "trace_id": ids["jsonl"][0],
            "span_id": ids["jsonl"][1]}.items() <= inside.items()
    assert "trace_id" not in outside and outside["message"] == "outside"


def test_a_stretch_ends_its_span_once_with_the_error_that_ended_it(monkeypatch):
    """`tracing.Stretch`, every span that is not a block's: a `with` records an escaping exception
    and ends the span; `on_error` ends it only if its block raises; `then` hands over to the next
    span of a sequence; a closed stream (GeneratorExit) is no error; a span is ended once."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    with pytest.raises(ValueError), tracing.Stretch("failed", kind="server", attributes={"a": 1}):
        raise ValueError("bad")
    call = tracing.Stretch("call", kind="client")
    with call.on_error():
        pass
    assert call.span.is_recording()  # the block went well: the span goes on
    with pytest.raises(KeyError), call.on_error():
        raise KeyError("k")
    call.end()  # already ended, with the error
    steps = tracing.Stretch("prefill")
    with steps:
        steps.then("decode")

    def stream():
        with tracing.Stretch("stream"):
            yield 1

    closed = stream()
    next(closed)
    closed.close()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["failed", "call", "prefill", "decode", "stream"]
    failed, call_span, prefill, decode, streamed = spans
    assert (failed.status.status_code, failed.status.description) == (StatusCode.ERROR, "ValueError: bad")
    assert [e.name for e in failed.events] == ["exception"] and failed.attributes["a"] == 1
    assert (call_span.status.status_code, call_span.status.description) == (StatusCode.ERROR, "KeyError: 'k'")
    assert all(s.status.status_code == StatusCode.UNSET for s in (prefill, decode, streamed))
    assert prefill.end_time <= decode.start_time and decode.parent is None
    with tracing.Stretch("root") as root:
        assert tracing.trace_id(root) == format(root.get_span_context().trace_id, "032x")
        assert tracing.trace_id() is None  # not made current
    monkeypatch.setattr(tracing, "_tracer", None)
    off = tracing.Stretch("off")
    assert not off.span.is_recording() and tracing.trace_id(off.span) is None
    off.end()
