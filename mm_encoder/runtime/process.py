"""What every mm-encoder process does around its async main: read its settings (command line, then
`<PREFIX>_*` environment), log in one format, stop on SIGTERM/SIGINT, run on uvloop when it is
installed (Dynamo's runtime expects it), and turn failures into a message and an exit status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource

from ..core.errors import MMEncoderError
from . import logs, tracing

if TYPE_CHECKING:
    from .dynamo import DistributedRuntime

log = logging.getLogger(__name__)
S = TypeVar("S", bound=BaseSettings)


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
    logs.configure(log_level)
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


WATCH_S = float(os.environ.get("MM_TLS_WATCH_S", "5"))  # how often watched certificate files are compared


def _digest(path: Path) -> bytes:
    """The file's content digest (empty: unreadable for now, e.g. mid-swap)."""
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return b""


class Lifecycle:
    """One component process's life, the same in all four (encode worker, engine, vLLM adapter,
    frontend): a stop event set by SIGTERM/SIGINT, Dynamo's runtime made on first use, the tasks
    it serves, the one ready line the launcher waits for, and the shutdown: the process's own
    steps (`on_stop`, last registered first), then the runtime, then the served tasks (each given
    `grace_s` to finish), then what must outlive them (`on_exit`), the trace exporter's flush last
    (tracing from the standard OpenTelemetry environment, `runtime.tracing`).

        async with Lifecycle("mm-encoder engine") as life:
            endpoint = life.runtime.endpoint(path)
            life.serve(serve_endpoint(endpoint, handler))
            life.ready(model=name, endpoint=path)
            await life.wait()
    """

    def __init__(self, name: str, grace_s: float = 30.0):
        self.name = name
        self.grace_s = grace_s
        self._runtime: DistributedRuntime | None = None
        self._served: list[asyncio.Future[Any]] = []
        self._on_stop: list[Callable[[], Any]] = []
        self._on_exit: list[Callable[[], Any]] = []
        self._on_reload: list[Callable[[], Any]] = []
        self._watched: dict[Path, bytes] = {}  # files whose new content triggers the reload steps
        self._watcher: asyncio.Task[None] | None = None
        self.stop = asyncio.Event()

    async def __aenter__(self) -> Lifecycle:
        self.stop = stop_on_signals()
        # SIGHUP: the process's reload steps (its TLS files read again: rotation), never a stop
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload)
        provider = tracing.setup(self.name.replace(" ", "-"))  # None unless the environment asks (tracing.py)
        if provider is not None:  # last of all: what is still batched goes out once the process is done
            self._on_exit.insert(0, provider.shutdown)
        return self

    @property
    def runtime(self) -> DistributedRuntime:
        """Dynamo's runtime for this process, made on first use (a process that never asks needs no Dynamo)."""
        if self._runtime is None:
            from .dynamo import make_runtime

            self._runtime = make_runtime(asyncio.get_running_loop())
        return self._runtime

    def serve(self, task: Awaitable[Any]) -> asyncio.Future[Any]:
        """A task the process serves (an endpoint, an HTTP server): `wait` returns if it ends, and
        the shutdown gives it `grace_s` to finish."""
        future: asyncio.Future[Any] = asyncio.ensure_future(task)
        self._served.append(future)
        return future

    def on_stop(self, step: Callable[[], Any]) -> None:
        """A shutdown step (sync or async), run before the runtime shuts down."""
        self._on_stop.append(step)

    def on_reload(self, step: Callable[[], Any], files: Iterable[str | Path | None] = ()) -> None:
        """A step run on SIGHUP (sync: e.g. `TlsOptions.reload` of a live SSL context), and whenever one of
        `files` changes: a Kubernetes Secret the kubelet updated in place (it swaps a symlink, so the
        content is compared, every WATCH_S seconds), with no signal from anyone."""
        self._on_reload.append(step)
        for path in files:
            if path is not None:
                self._watched[Path(path)] = _digest(Path(path))
        if self._watched and self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(WATCH_S)
            now = {path: _digest(path) for path in self._watched}
            if now != self._watched and b"" not in now.values():  # mid-swap: the next look
                self._watched = now
                log.info("%s: its certificate files changed: reading them again", self.name)
                self._reload()

    def _reload(self) -> None:
        for step in self._on_reload:
            try:
                step()
            except Exception:  # a failed reload keeps what the process had: it stays up, and says so
                log.exception("%s: reload failed; serving with what it had", self.name)
                return
        log.info("%s: reloaded (%d steps)", self.name, len(self._on_reload))

    def on_exit(self, step: Callable[[], Any]) -> None:
        """A shutdown step run last, once the runtime is down and the served tasks have ended."""
        self._on_exit.append(step)

    def ready(self, *words: str, **fields: Any) -> None:
        """The ready line (`<name> ready: [words] key=value ...`): what launchers and tests wait for."""
        print(f"{self.name} ready: " + " ".join([*words, *(f"{k}={v}" for k, v in fields.items())]), flush=True)

    async def wait(self) -> None:
        """Until a signal, or until a served task ends."""
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({stopped, *self._served}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await _run_steps(self._on_stop)
        if self._runtime is not None:
            self._runtime.shutdown()
        for future in self._served:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(future, self.grace_s)
        await _run_steps(self._on_exit)


async def _run_steps(steps: list[Callable[[], Any]]) -> None:
    """Shutdown steps, the last registered first; a coroutine step is awaited."""
    for step in reversed(steps):
        result = step()
        if asyncio.iscoroutine(result):
            await result
