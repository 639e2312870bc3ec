"""Every process's log lines, one format, each with the trace id of the request it is about.

Text by default (`LOG_FORMAT`, then ` trace_id=... span_id=...` inside a recorded trace); one JSON
object per line when `DYN_LOGGING_JSONL` is true, as Dynamo's own processes write them (`time`,
`level`, `target`, `message`, and `trace_id`/`span_id` inside a trace), so one query over a
collector's logs finds every component's lines for a request."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import Mapping

from . import tracing

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def jsonl(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("DYN_LOGGING_JSONL", "").lower() in ("1", "true")


class _TraceIds(logging.Filter):
    """The current span's ids on every record (empty outside a recorded trace)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.trace_id, record.span_id = tracing.ids() or ("", "")
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tid = getattr(record, "trace_id", "")
        return f"{line} trace_id={tid} span_id={getattr(record, 'span_id', '')}" if tid else line


class JsonlFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        out = {"time": when.isoformat(timespec="microseconds"),
               "level": record.levelname, "target": record.name, "message": record.getMessage()}
        if tid := getattr(record, "trace_id", ""):
            out["trace_id"], out["span_id"] = tid, getattr(record, "span_id", "")
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(level: str | int, environ: Mapping[str, str] = os.environ, *, force: bool = False) -> None:
    """The root logger writes to stderr in this process's one format (`force`: replacing the
    handlers a library installed)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_TraceIds())
    handler.setFormatter(JsonlFormatter() if jsonl(environ) else TextFormatter())
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=force)
