"""What every mm-encoder process does around its async main: read its settings (command line, then
`<PREFIX>_*` environment), log in one format, stop on SIGTERM/SIGINT, run on uvloop when it is
installed (Dynamo's runtime expects it), and turn failures into a message and an exit status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource

from ..core.errors import MMEncoderError

S = TypeVar("S", bound=BaseSettings)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_settings(cls: type[S], argv: list[str] | None, check: Callable[[S], Any] | None = None) -> S | None:
    """The settings, or None after printing why they are invalid (exit status 2). `check` may
    refuse them further (a ValueError, e.g. a model directory that is not one) before any start-up."""
    parsed = _parse(cls, argv, known_only=False, check=check)
    return parsed[0] if parsed is not None else None


def parse_known_settings(cls: type[S], argv: list[str] | None, epilog: str) -> tuple[S, list[str]] | None:
    """`parse_settings` for a process that hands the flags it does not know to another parser (the
    vLLM adapter: vLLM's own engine flags): the settings and those flags, or None (exit status 2)."""
    return _parse(cls, argv, known_only=True, epilog=epilog)


def _parse(cls: type[S], argv: list[str] | None, *, known_only: bool, epilog: str | None = None,
           check: Callable[[S], Any] | None = None) -> tuple[S, list[str]] | None:
    parser = argparse.ArgumentParser(prog=cls.model_config.get("cli_prog_name"), description=cls.__doc__,
                                     epilog=epilog, allow_abbrev=not known_only)  # another's flag is never ours
    source: CliSettingsSource[argparse.ArgumentParser] = CliSettingsSource(
        cls, root_parser=parser, add_argument_method=_add_argument)
    args = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    try:
        if known_only:
            known, rest = parser.parse_known_args(args)
            settings = cls(_cli_settings_source=source(parsed_args=known))
        else:
            settings = cls(_cli_settings_source=source(args=args))
    except ValidationError as e:
        prefix = cls.model_config.get("env_prefix", "")
        for err in e.errors(include_url=False, include_input=False):
            name = str(err["loc"][0]) if err["loc"] else ""
            where = f"--{name.replace('_', '-')} (or {prefix}{name.upper()})" if name else "settings"
            print(f"error: {where}: {err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return None
    try:
        if check is not None:
            check(settings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return settings, rest


def _add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> argparse.Action:
    """pydantic-settings' arguments, tidied for --help: argparse's own metavar (`--model MODEL`,
    not `--model str` or `{str,null}`), and a default said once when the description says it."""
    if isinstance(kwargs.get("metavar"), str):
        kwargs.pop("metavar")
    text = kwargs.get("help")
    if isinstance(text, str) and text.count("(default:") > 1:
        kwargs["help"] = text[: text.rindex("(default:")].rstrip()
    return parser.add_argument(*names, **kwargs)


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
