"""A real OTLP/HTTP trace receiver on loopback, for tests: `POST /v1/traces` bodies decoded as
`ExportTraceServiceRequest` (opentelemetry-proto, the protocol's own definitions), every span kept
with its service, ids and attributes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    instance: str = ""  # the resource's service.instance.id
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each linked span


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """`with Receiver() as r:` ... `r.endpoint` (for OTEL_EXPORTER_OTLP_ENDPOINT), `r.wait(...)`."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name for it
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path not in ("/v1/traces", "/v1/logs", "/v1/metrics"):
                    self.send_error(404)
                    return
                if self.path == "/v1/traces":
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                out = b""  # an empty Export*ServiceResponse, the same for the three signals (logs, metrics: not kept)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _add(self, req: ExportTraceServiceRequest) -> None:
        found = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(Span(resource.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                                      s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano,
                                      {a.key: _value(a.value) for a in s.attributes},
                                      resource.get("service.instance.id", ""),
                                      tuple((k.trace_id.hex(), k.span_id.hex()) for k in s.links)))
        with self._changed:
            self.spans.extend(found)
            self._changed.notify_all()

    def trace(self, trace_id: str) -> list[Span]:
        with self._changed:
            return sorted((s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)

    def wait(self, trace_id: str, names: set[str], timeout: float = 30.0, parent: str | None = None) -> list[Span]:
        """The trace's spans once every name in `names` is among them (and, with `parent`, a span
        whose parent is that span id); AssertionError after `timeout`."""
        def arrived() -> bool:
            spans = [s for s in self.spans if s.trace_id == trace_id]
            return names <= {s.name for s in spans} and (parent is None or any(s.parent_span_id == parent
                                                                                for s in spans))

        deadline = time.monotonic() + timeout
        with self._changed:
            while not arrived():
                left = deadline - time.monotonic()
                if left <= 0:
                    got = sorted({s.name for s in self.spans if s.trace_id == trace_id})
                    raise AssertionError(f"trace {trace_id}: spans {got}, waiting for {sorted(names)} "
                                         f"and a child of {parent}")
                self._changed.wait(left)
        return self.trace(trace_id)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
