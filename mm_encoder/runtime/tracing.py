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
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context as Context  # re-exported: the rooms' annotation of a parent

log = logging.getLogger(__name__)
TRACER = "mm_encoder"
_KINDS = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT, "internal": trace.SpanKind.INTERNAL}


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
    log.info("tracing: spans go over OTLP (%s) as service %s", protocol or "http/protobuf", name)
    return provider


def extract(carrier: Mapping[str, str]) -> Context:
    """The caller's trace context from its headers (`traceparent`, `tracestate`); empty without them."""
    return propagate.extract(carrier)


def inject(carrier: MutableMapping[str, str]) -> None:
    """The current span's context into outgoing headers, so the next process continues the trace."""
    propagate.inject(carrier)


@contextlib.contextmanager
def span(name: str, parent: Context | None = None, *, kind: str = "internal",
         attributes: Mapping[str, str | int | float | bool] | None = None) -> Iterator[trace.Span]:
    """A span around a block, a child of `parent` (else of the current span); an exception escaping
    the block is recorded on it and marks it as an error."""
    tracer = trace.get_tracer(TRACER)
    with tracer.start_as_current_span(name, context=parent, kind=_KINDS[kind], attributes=attributes) as s:
        yield s


def trace_id() -> str | None:
    """The current trace's id as 32 hex digits (for log lines), or None outside a recorded trace."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
