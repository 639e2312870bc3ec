"""OpenTelemetry traces, configured by the standard environment, the same in every process.

Off unless an OTLP endpoint is named (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) or Dynamo's own switch is on (`OTEL_EXPORT_ENABLED=true`),
and never when `OTEL_SDK_DISABLED=true`. Off, spans are the OpenTelemetry API's non-recording ones:
no SDK is loaded and nothing is exported. On (`setup`), the SDK batches spans to the OTLP
exporter the protocol names (`OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`: `http/protobuf`, the default,
or `grpc`), as `OTEL_SERVICE_NAME` or the process's own name; the exporter reads the rest of its
`OTEL_*` settings itself. Context crosses processes as W3C `traceparent`/`tracestate` headers
(`extract`, `inject`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from types import TracebackType
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context as Context  # re-exported: the rooms' annotation of a parent

log = logging.getLogger(__name__)
TRACER = "mm_encoder"
_KINDS = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT, "internal": trace.SpanKind.INTERNAL}
# This process's tracer once `setup` has turned tracing on; None (off): every function below takes
# its shortest way (the API's invalid span, no context work), so off costs next to nothing.
_tracer: trace.Tracer | None = None


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORT_ENABLED", "").lower() == "true")


def setup(service_name: str, environ: Mapping[str, str] = os.environ) -> Any | None:
    """Export this process's spans, if the environment asks for it: the SDK's TracerProvider (its
    `shutdown()` flushes what is still batched), or None when tracing is off."""
    if not enabled(environ):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    exporter: Any
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ImportError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc "
                              "(pip install opentelemetry-exporter-otlp-proto-grpc), or use http/protobuf") from None
        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    name = environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    global _tracer
    _tracer = provider.get_tracer(TRACER)
    log.info("tracing: spans go over OTLP (%s) as service %s", protocol or "http/protobuf", name)
    return provider


def component_env(environ: Mapping[str, str], service: str, instance: str | None = None) -> dict[str, str]:
    """What a launcher sets in one component's environment when tracing is on (else nothing): its
    service name and replica (`service.instance.id`), Dynamo's own switch (its runtime then continues a client's
    `traceparent` into the request context, `Context.trace_headers`, and exports its own spans, the
    parents of ours) and one protocol for both exporters (Dynamo's default is grpc, the SDK's
    http/protobuf)."""
    if not enabled(environ):
        return {}
    defaults = {"OTEL_EXPORT_ENABLED": "true", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    out = {**{k: v for k, v in defaults.items() if k not in environ}, "OTEL_SERVICE_NAME": service}
    attributes = environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if instance and "service.instance.id=" not in attributes:
        out["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(filter(None, (attributes, f"service.instance.id={instance}")))
    return out


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The caller's trace context from its headers (`traceparent`, `tracestate`); empty without them."""
    return propagate.extract(carrier or {})


def from_dynamo(context: Any) -> Context:
    """The trace a Dynamo request context carries (`Context.trace_headers()`: set when Dynamo's
    runtime traces, OTEL_EXPORT_ENABLED); empty for none or a context without it."""
    if _tracer is None:
        return Context()
    headers = getattr(context, "trace_headers", None)
    return extract(headers() if callable(headers) else None)


def from_client(context: Any, *, trust: bool) -> tuple[Context, tuple[Context, ...]]:
    """The parent and the links of the span that serves a client's request (the frontend's, at the
    edge): with `trust`, the trace Dynamo's request context carries (`from_dynamo`: the client's
    `traceparent`, continued), else a new trace of this process's own, sampled by its own sampler,
    that links to it: an untrusted client neither picks the trace id nor forces sampling."""
    carried = from_dynamo(context)
    return (carried, ()) if trust else (Context(), (carried,))


def inject(carrier: MutableMapping[str, str], context: Context | None = None) -> None:
    """The current span's context (or `context`'s) into outgoing headers, so the next process
    continues the trace; nothing when there is no recorded trace."""
    if _tracer is not None:
        propagate.inject(carrier, context=context)


@contextlib.contextmanager
def span(name: str, parent: Context | None = None, *, kind: str = "internal",
         attributes: Mapping[str, str | int | float | bool] | None = None) -> Iterator[trace.Span]:
    """A span around a block, a child of `parent` (else of the current span); an exception escaping
    the block is recorded on it and marks it as an error."""
    if _tracer is None:
        yield trace.INVALID_SPAN
        return
    with _tracer.start_as_current_span(name, context=parent, kind=_KINDS[kind], attributes=attributes) as s:
        yield s


class Stretch:
    """A span that is not made current, for a stretch that crosses `yield`s (a stream) or steps:
    one place that starts it and ends it once, an error recorded (a cancelled stream is not one).
    `with` ends it as the block ends; `on_error` only if a block raises (the stretch goes on in a
    later step, which ends it); `then` hands over to the next span of a sequence. `within(s.span)`
    makes it the parent of what a block starts. `links`: other traces' spans it relates to (e.g.
    Dynamo's own spans of the same call)."""

    __slots__ = ("_open", "span")

    def __init__(self, name: str, parent: Context | None = None, *, kind: str = "internal",
                 attributes: Mapping[str, str | int | float | bool] | None = None,
                 links: tuple[Context, ...] = ()) -> None:
        self.span = _start(name, parent, kind, attributes, links)
        self._open = True

    def __enter__(self) -> trace.Span:
        return self.span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.end(error)

    @contextlib.contextmanager
    def on_error(self) -> Iterator[trace.Span]:
        """The span over a block that it outlives: ended here only if the block raises."""
        try:
            yield self.span
        except BaseException as e:
            self.end(e)
            raise

    def then(self, name: str, parent: Context | None = None) -> trace.Span:
        """End this span (no error) and go on with the next of a sequence (prefill, then decode)."""
        self.end()
        self.span, self._open = _start(name, parent, "internal", None, ()), True
        return self.span

    def end(self, error: BaseException | None = None) -> None:
        """End the span once, marked as an error if `error` (a GeneratorExit, a closed stream, is not one)."""
        if not self._open:
            return
        self._open = False
        s = self.span
        if not s.is_recording():
            return
        if error is not None and not isinstance(error, GeneratorExit):
            s.record_exception(error)
            s.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        s.end()


def _start(name: str, parent: Context | None, kind: str, attributes: Mapping[str, str | int | float | bool] | None,
           links: tuple[Context, ...]) -> trace.Span:
    """A span not made current (`Stretch`'s); the API's invalid span when tracing is off."""
    if _tracer is None:
        return trace.INVALID_SPAN
    linked = [trace.Link(c) for c in (trace.get_current_span(ctx).get_span_context() for ctx in links) if c.is_valid]
    return _tracer.start_span(name, context=parent, kind=_KINDS[kind], attributes=attributes, links=linked)


def within(s: trace.Span) -> contextlib.AbstractContextManager[trace.Span]:
    """`s` as the current span inside a block (no `yield` of an async generator inside it), not ended after."""
    if _tracer is None:
        return contextlib.nullcontext(s)
    return trace.use_span(s, end_on_exit=False)


def context_of(s: trace.Span) -> Context:
    """A context whose current span is `s`: the explicit parent of spans under it."""
    return trace.set_span_in_context(s)


def ids(s: trace.Span | None = None) -> tuple[str, str] | None:
    """`s`'s (else the current span's) trace and span ids as hex (32 and 16 digits), or None outside
    a recorded trace."""
    ctx = (trace.get_current_span() if s is None else s).get_span_context()
    return (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")) if ctx.is_valid else None


def trace_id(s: trace.Span | None = None) -> str | None:
    """`s`'s (else the current span's) trace id (32 hex digits), or None outside a recorded trace."""
    current = ids(s)
    return current[0] if current else None
