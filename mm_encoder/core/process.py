"""What every mm-encoder process does around its async main: read its settings (command line, then
`<PREFIX>_*` environment), log in one format, stop on SIGTERM/SIGINT, run on uvloop when it is
installed (Dynamo's runtime expects it), and turn failures into a message and an exit status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from .errors import MMEncoderError

S = TypeVar("S", bound=BaseSettings)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_settings(cls: type[S], argv: list[str] | None) -> S | None:
    """The settings, or None after printing why they are invalid (exit status 2)."""
    try:
        return cls(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, in the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(main: Coroutine[Any, Any, Any], log_level: str = "INFO") -> int:
    """Run `main` to its end; 0, or 1 with the error on stderr."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    runner = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    try:
        runner(main)
    except MMEncoderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"error: {e}; install the `dynamo` extra (pip install 'mm-encoder[dynamo]')", file=sys.stderr)
        return 1
    except OSError as e:  # most often: a port is taken, or a directory is missing
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
