"""BENCHMARKS.md, generated: runs every benchmark module and writes the document from their JSON.

    python -m bench.report [--quick] [--only a,b] [--render-only] [--out BENCHMARKS.md]
                           [--data docs/bench/data] [--plots docs/bench] [--module NAME=PATH] [--timeout S]

`make bench` runs it, `make bench-quick` runs it with --quick (a smoke run of minutes).

1. Runs each module, in the fixed order of MODULES, as its own process from the repository root:
   `python -m bench.<name> --json <data>/<name>.json [--quick]` (a --module PATH: `python PATH ...`).
   The JSON is written to a side file and moved into place only when the module succeeds, so a failed
   run never leaves half a result behind.
   What each run did (exit status, when, --quick or not, seconds, its last output lines) goes to
   <data>/_runs.json.
2. Calls each module's `section(result, plots)` (bench/sections/<name>.py: the renderer, apart from
   the modules, which measure), which returns the module's markdown
   (starting with `## Title (`python -m bench.<name>`)`, the command that runs it alone from the
   repository root) and writes its PNGs into --plots.
3. Writes the document from scratch: a header (date, command, machine), how to read the figures, a
   contents list, then one section per module, in order.

--only a,b runs just those modules; the others' stored JSON is rendered again, so the document stays
whole (each section says when and how it was measured). --render-only runs nothing. A module that
fails (non-zero exit, no JSON, a timeout, or a section() that raises) is named in its section, with
the tail of its output, and makes this script exit 1 at the end. A module without section() yet, or
without stored data, gets a placeholder line. --module NAME=PATH runs another script as NAME (tests).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench import stats
from harness.processes import Process

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# The document's order. Paths are relative to the repository root.
MODULES: dict[str, str] = {
    "encoder": "bench/encoder.py",
    "parity": "bench/parity.py",
    "wire": "bench/wire.py",
    "worker": "bench/worker.py",
    "cache": "bench/cache.py",
    "frontend": "bench/frontend.py",
    "frontends": "bench/frontends.py",
    "engine": "bench/engine.py",
    "graphs": "bench/graphs.py",
    "aiperf": "bench/aiperf.py",
    "discovery": "bench/discovery.py",
    "hostile_memory": "bench/hostile_memory.py",
    "soak": "bench/soak.py",
    "autoscale": "bench/autoscale.py",
    "tracing": "bench/tracing.py",
    "tls": "bench/tls.py",
    "wan": "bench/wan.py",
    "clusters": "bench/clusters.py",
    "tenants": "bench/tenants.py",
}
RUNS = "_runs.json"
TAIL_LINES = 25


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --- running ------------------------------------------------------------------------------------


def run_module(name: str, script: Path, data: Path, quick: bool, timeout_s: float, previous: dict | None) -> dict:
    """One module as a subprocess, its output streamed with a `[name]` prefix; returns its run record."""
    final = data / f"{name}.json"
    side = data / f".{name}.running.json"
    side.unlink(missing_ok=True)
    module, flags = _module_name(script), ["--quick"] if quick else []
    cmd = [sys.executable, *(["-m", module] if module else [str(script)]), "--json", str(side), *flags]
    shown = " ".join(shlex.quote(x) for x in ["python", *(["-m", module] if module else [_rel(script)]), "--json",
                                             _rel(final), *flags])
    print(f"== {name}: {shown}", flush=True)
    record = {"name": name, "command": shown, "quick": quick, "started": _now()}
    if not script.is_file():
        record.update(ok=False, rc=None, seconds=0.0, error=f"{_rel(script)} does not exist", tail=[],
                      json_written=False, data_from=previous.get("data_from") if previous else None)
        print(f"== {name}: FAILED ({record['error']})", flush=True)
        return record
    t0 = time.perf_counter()
    rc, timed_out, tail = _run(name, cmd, timeout_s)
    seconds = time.perf_counter() - t0
    error = _run_error(rc, timed_out, side, timeout_s)
    record.update(ok=error is None, rc=rc, seconds=round(seconds, 1), error=error, tail=tail,
                  json_written=side.is_file())
    if record["json_written"] and (error is None or rc != 0):  # a module that fails after writing (a gate)
        side.replace(final)  # still shows its figures
    else:
        side.unlink(missing_ok=True)
        record["json_written"] = False
    if not record["json_written"] and final.is_file():  # the figures shown are an earlier run's
        record["data_from"] = previous.get("data_from") or previous.get("started") if previous else None
    elif record["json_written"]:
        record["data_from"] = record["started"]
    print(f"== {name}: {'ok' if error is None else 'FAILED (' + error + ')'} in {seconds:.0f} s", flush=True)
    return record


def _run(name: str, cmd: list[str], timeout_s: float) -> tuple[int, bool, list[str]]:
    """The module as a harness Process from the root, in its own session; stopped (SIGTERM to its
    session, SIGKILL after 10 s) past `timeout_s`. (exit status, timed out, its last lines)."""
    proc = Process(cmd, name=name, cwd=ROOT, on_line=lambda line: print(f"[{name}] {line.rstrip()}", flush=True))
    timed_out = False
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        rc = proc.stop(signal.SIGTERM, grace_s=10, group=True)
    except KeyboardInterrupt:
        proc.stop(signal.SIGTERM, grace_s=0, group=True)
        raise
    proc.stop(grace_s=10)  # what it left in its session; and the rest of its output
    return rc, timed_out, [line.rstrip("\n") for line in proc.lines[-TAIL_LINES:]]


def _run_error(rc: int, timed_out: bool, side: Path, timeout_s: float) -> str | None:
    if timed_out:
        return f"timed out after {timeout_s:.0f} s (killed)"
    if rc != 0:
        return f"exit status {rc}"
    if not side.is_file():
        return "exited 0 but wrote no JSON"
    try:
        json.loads(side.read_text())
    except ValueError as e:
        return f"wrote JSON that does not parse: {e}"
    return None


# --- rendering ----------------------------------------------------------------------------------


def _module_name(script: Path) -> str | None:
    """`bench.<name>` for a module of this package (run with -m from the root); None for another file."""
    return f"bench.{script.stem}" if script.resolve().parent == BENCH else None


def load_section(name: str, script: Path):
    """`section(result, plots)` for the module: a module of this package has it in `bench.sections.<name>`
    (the renderer; the module itself measures); another file (--module) is imported from its path and
    has its own. None: it has none yet."""
    if _module_name(script):
        try:
            return importlib.import_module(f"bench.sections.{script.stem}").section
        except ModuleNotFoundError as e:
            if e.name != f"bench.sections.{script.stem}":
                raise
            return None
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "section", None)


def _heading(name: str, command: str) -> str:
    return f"## {name.replace('_', ' ').capitalize()} (`python {command}`)"


def _fenced(lines: list[str]) -> list[str]:
    return ["", "```", *[line.replace("```", "'''") for line in lines], "```"] if lines else []


def render_section(name: str, script: Path, data: Path, plots: Path, record: dict | None) -> tuple[str, str]:
    """(markdown, status): the module's section, or a placeholder or failure note under its heading.
    status: "ok", "placeholder", "run_failed" (its last run failed) or "render_failed"."""
    shown = _rel(script)
    path = data / f"{name}.json"
    heading = _heading(name, f"-m bench.{name}" if name in MODULES else shown)
    run_failed = record is not None and not record.get("ok", False)
    notes: list[str] = []
    if run_failed:
        notes += [f"**FAILED in the run of {record.get('started', '?')}**: `{record.get('command', shown)}`: "
                  f"{record.get('error', 'failed')}. The last lines of its output:", *_fenced(record.get("tail", []))]
        if path.is_file():
            notes += ["", "The figures below are what it wrote before failing." if record.get("json_written") else
                      f"The figures below are from an earlier run ({record.get('data_from') or 'date unknown'}), "
                      "not from this one."]
    status = "run_failed" if run_failed else "ok"
    if not path.is_file():
        if not run_failed:
            notes.append(f"_Placeholder: not measured yet (no {_rel(path)}); run "
                         f"`python -m bench.report --only {name}`._")
            status = "placeholder"
        return "\n".join([heading, "", *notes]) + "\n", status
    try:
        result = json.loads(path.read_text())
        section = load_section(name, script)
        if section is None:
            body = (f"{heading}\n\n_Placeholder: {shown} has no `section()` yet; its figures are in "
                    f"[{_rel(path)}]({_rel(path)})._\n")
            status = "placeholder" if status == "ok" else status
        else:
            body = section(result, plots)
            if not isinstance(body, str):
                raise TypeError(f"section() returned {type(body).__name__}, not markdown text")
    except (Exception, SystemExit):  # a module that exits at import is a failure of its own, not ours
        tb = traceback.format_exc().strip().splitlines()[-TAIL_LINES:]
        text = "\n".join([heading, "", *notes, "", f"**FAILED**: rendering its section from {_rel(path)} raised:",
                          *_fenced(tb)])
        return text + "\n", "render_failed"
    first, _, rest = body.strip("\n").partition("\n")
    if not first.startswith("## "):
        first, rest = heading, body.strip("\n")
    parts = [first, ""]
    if record is not None and record.get("data_from"):
        how = " with `--quick`" if record.get("quick") and record.get("json_written", True) else ""
        parts += [f"_Measured {record['data_from']}{how}._", ""]
    if notes:
        parts += [*notes, ""]
    return "\n".join([*parts, rest.lstrip("\n")]) + "\n", status


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = heading.lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def header(command: str, quick: bool) -> str:
    m = stats.machine()
    flags = set(m.get("flags", []))
    yes = lambda f: "yes" if f in flags else "no"  # noqa: E731
    lines = [
        "# Benchmarks",
        "",
        "_Generated by `python -m bench.report` (`make bench`); do not edit by hand: edit a module's section "
        "(`bench/sections/<module>.py`) and run `python -m bench.report --render-only`._",
        "",
        f"- Generated: {_now()}, by `{command}`{' (a quick smoke run: fewer sizes and repeats)' if quick else ''}.",
        f"- Machine: {m.get('cores')} cores, {m.get('cpu')}; avx512_bf16: {yes('avx512_bf16')}, "
        f"AMX (amx_bf16): {yes('amx_bf16')}; torch {m.get('torch')} ({m.get('torch_threads')} threads), "
        f"device: {m.get('device')}; Python {m.get('python')}.",
        "- How to read a figure: `median (min-max)` over the repeats of one run; a figure is compared only "
        "with figures measured in the same run, alternating repeat by repeat (ratios are median over median). "
        "Each section says when it was measured: with `--only`, the other sections keep their earlier run's "
        "figures.",
        "- Raw figures: `docs/bench/data/<module>.json`; plots: `docs/bench/<module>-*.png`.",
    ]
    return "\n".join(lines) + "\n"


def render(modules: dict[str, Path], data: Path, plots: Path, out: Path, command: str, quick: bool) -> dict:
    """Writes `out`; returns each module's status (see render_section)."""
    runs = _load_runs(data)
    sections, status = [], {}
    for name, script in modules.items():
        text, status[name] = render_section(name, script, data, plots, runs.get(name))
        sections.append(text)
    contents = ["## Contents", ""]
    marks = {"ok": "", "placeholder": " (placeholder)", "run_failed": " **(failed)**", "render_failed": " **(failed)**"}
    for name, text in zip(modules, sections, strict=True):
        title = text.split("\n", 1)[0]
        contents.append(f"- [{title.lstrip('#').strip()}](#{slug(title)}){marks[status[name]]}")
    doc = "\n".join([header(command, quick), "\n".join(contents) + "\n", *sections])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(re.sub(r"\n{3,}", "\n\n", doc))
    return status


def _load_runs(data: Path) -> dict:
    try:
        return json.loads((data / RUNS).read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="pass --quick to every module (make bench-quick)")
    p.add_argument("--only", help="comma-separated modules to run; the others' stored JSON is reused")
    p.add_argument("--render-only", action="store_true", help="run nothing; re-render from --data")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--data", type=Path, default=ROOT / "docs" / "bench" / "data")
    p.add_argument("--plots", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--module", action="append", default=[], metavar="NAME=PATH",
                   help="run and render PATH as module NAME (replacing or adding to the list)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per module before it is killed (default 3600; with --quick 900)")
    args = p.parse_args(argv)
    modules = {name: ROOT / path for name, path in MODULES.items()}
    for item in args.module:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--module takes NAME=PATH, got {item!r}")
        modules[name] = Path(path).resolve()
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else list(modules)
    unknown = [x for x in only if x not in modules]
    if unknown:
        p.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(modules)}")
    timeout_s = args.timeout or (900.0 if args.quick else 3600.0)
    data, plots = args.data.resolve(), args.plots.resolve()
    data.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m bench.report", *(shlex.quote(a) for a in argv)])
    ran, run_failed = [], []
    if not args.render_only:
        runs = _load_runs(data)
        for name in (n for n in modules if n in only):
            record = run_module(name, modules[name], data, args.quick, timeout_s, runs.get(name))
            runs[name] = record
            (data / RUNS).write_text(json.dumps(runs, indent=1))
            ran.append(name)
            if not record["ok"]:
                run_failed.append(name)
    status = render(modules, data, plots, args.out.resolve(), command, args.quick)
    print(f"wrote {_rel(args.out.resolve())}", flush=True)
    earlier = [n for n, s in status.items() if s == "run_failed" and n not in ran]
    if earlier:
        print(f"note: sections showing a failure of an earlier run (not rerun now): {', '.join(earlier)}", flush=True)
    broken = run_failed + [n for n, s in status.items() if s == "render_failed" and n not in run_failed]
    if broken:
        print(f"FAILED: {', '.join(broken)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
