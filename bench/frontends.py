"""Our frontend vs Dynamo's stock frontend (not a test): CPU per request, throughput and latency, side by side.

    python -m bench.frontends [--quick] [--rounds 3] [--duration 5] [--warmup 1] [--ttft-n 10] [--json PATH]

Three whole graphs under `mm-encoder serve GRAPH --checkpoint DIR --dtype fp32`, all up at once on
loopback, on one generated tiny Kimi-K2.5 checkpoint (`mm-encoder make-checkpoint DIR --preset tiny`),
each with the same encode worker, cache tiers and 2 transformers engines; they differ in the frontend:
- `ours`: graphs/epd.yaml, our chat processor inside Dynamo's HTTP frontend (`python -m mm_encoder.frontend`,
  KV-routed by our processor);
- `stock`: graphs/epd-stock.yaml, Dynamo's `python -m dynamo.frontend` in its default router mode
  (round-robin);
- `stock-kv`: the same with `--router-mode kv` added to the frontend's args (a temporary copy of the YAML).

Cells: closed loops (`wrk`, one thread, a Lua script for the POST bodies, `--latency`) at a fixed
concurrency for a fixed duration after a short warm-up (another wrk run with the same body): text
prompts (a counter in the first words, so no two share a prefix block) with max_tokens 1, 16, 128,
non-streamed and streamed, at concurrency 4; the same image every time (the bundled sample.jpg as a
data: URL: a cache hit after the first) with max_tokens 16; one identical text prompt at concurrency 8.
Every request sets `ignore_eos` (top level: Dynamo's HTTP layer refuses `nvext.ignore_eos`, checked at
start) and `stream_options.include_usage`; the Lua script counts a response as an error unless it is a
200 with `usage.completion_tokens` equal to max_tokens. The measured wrk run lasts LEAD + duration +
TAIL seconds; the window is [LEAD, LEAD + duration] of it, where the loop is at its concurrency and still
running at the end, so requests in flight at the two edges roughly balance. Per cell and setup:
requests/s and requests completed in the window (the frontend's own `dynamo_frontend_requests_total`,
status success: the same counter in both frontends), p50/p99 latency and errors (wrk, the whole
measured run), and CPU seconds (utime+stime+cutime+cstime from /proc/PID/stat, summed over each
component's process group: every replica runs in its own session) of the frontend, of the two engines
and of the rest (encode worker, nginx tiers, NATS) over the window, divided by the requests completed
in it. TTFT: single streamed requests (16 tokens) at concurrency 1, time to the first chunk with
non-empty content. One setup is measured at a time, setups alternating cell by cell (the order rotated
each round), so the machine's noise falls on all three; --quick: 1 round of 3 s windows, else 3 rounds
of 5 s (twice that in the 128-token cells). Ratios are median over median across the rounds.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from bench import stats
from harness.serve_fixtures import Served
from mm_encoder.serve.site import free_port

ROOT = Path(__file__).resolve().parents[1]

WRK = "/usr/bin/wrk"
SAMPLE = ROOT / "mm_encoder" / "samples" / "sample.jpg"
SETUPS = ("ours", "stock", "stock-kv")
STARTUP_S = 600  # a graph not ready by then is stopped
TEXT = "tell me a story about a fox."
QUESTION = "What is in this image?"
CONCURRENCY = 4
LEAD, TAIL = 1, 1  # seconds of the measured wrk run before and after the window
LONG = 2  # the 128-token cells' window, in windows: they complete ~10x fewer requests per second
# (name, label, prompt, max_tokens, stream, concurrency); prompt: "text" (distinct), "image", "same" (identical)
CELLS: tuple[tuple[str, str, str, int, bool, int], ...] = (
    ("text-1", "text, 1 token", "text", 1, False, CONCURRENCY),
    ("text-16", "text, 16 tokens", "text", 16, False, CONCURRENCY),
    ("text-128", "text, 128 tokens", "text", 128, False, CONCURRENCY),
    ("text-1-stream", "text, 1 token, streamed", "text", 1, True, CONCURRENCY),
    ("text-16-stream", "text, 16 tokens, streamed", "text", 16, True, CONCURRENCY),
    ("text-128-stream", "text, 128 tokens, streamed", "text", 128, True, CONCURRENCY),
    ("image-16", "image (cache hit), 16 tokens", "image", 16, False, CONCURRENCY),
    ("same-16", "identical text prompts, 16 tokens, c=8", "same", 16, False, 8),
)
TTFT_TOKENS = 16

# wrk's script: one body per request (a counter in the text when @@N@@ is there), every response
# checked for status 200 and usage.completion_tokens == max_tokens; done() prints one JSON line.
LUA = r"""
local template = [==[@@BODY@@]==]
local expect = '"completion_tokens":@@TOKENS@@[,}]'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
counter = 0
bad = 0
chunks = 0
first_bad = ""
local threads = {}
function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end
function request()
  counter = counter + 1
  local body = string.gsub(template, "@@N@@", id .. "-" .. counter, 1)
  return wrk.format(nil, nil, nil, body)
end
function response(status, headers, body)
  local _, n = string.gsub(body, "data: {", "")
  chunks = chunks + n
  if status ~= 200 or not string.find(body, expect) then
    bad = bad + 1
    if first_bad == "" then first_bad = status .. " " .. string.sub(body, 1, 300) end
  end
end
function done(summary, latency, requests)
  local b, c, fb = 0, 0, ""
  for _, t in ipairs(threads) do
    b = b + t:get("bad")
    c = c + t:get("chunks")
    if fb == "" then fb = t:get("first_bad") end
  end
  io.write(string.format('WRKJSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"bad":%d,'
    .. '"chunks":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), b, c,
    summary.errors.connect, summary.errors.read, summary.errors.write, summary.errors.status,
    summary.errors.timeout))
  io.write("WRKBAD " .. string.gsub(fb, "\n", " ") .. "\n")
end
"""


# --- requests -----------------------------------------------------------------------------------


def body(model: str, prompt: str, tokens: int, stream: bool, **extra) -> dict:
    """A chat request; prompt "text" carries @@N@@ (wrk's counter), "same" is one fixed text, "image" the sample."""
    if prompt == "image":
        url = "data:image/jpeg;base64," + base64.b64encode(SAMPLE.read_bytes()).decode()
        content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    else:
        content = f"Request {'@@N@@' if prompt == 'text' else 'same'}: {TEXT}"
    out = {"model": model, "max_tokens": tokens, "ignore_eos": True,
           "messages": [{"role": "user", "content": content}], **extra}
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


def post(port: int, payload: dict, timeout: float = 60) -> tuple[int, dict | str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]


def check_ignore_eos(port: int, model: str) -> dict:
    """How the frontend takes `ignore_eos`: top level and under `nvext` (128 tokens asked), and without it."""
    out = {}
    for key, extra in (("top_level", {}), ("nvext", {"nvext": {"ignore_eos": True}}), ("without", {})):
        payload = body(model, "same", 128, False, **extra)
        if key != "top_level":
            payload.pop("ignore_eos")
        status, answer = post(port, payload)
        out[key] = ({"status": status, "completion_tokens": answer["usage"]["completion_tokens"]}
                    if status == 200 else {"status": status, "error": answer})
    return out


def ttft(port: int, model: str, n: int) -> tuple[float, float, bool, float, list[float]] | None:
    """For one streamed request (prompt number `n`): seconds to the first chunk of any kind and to the
    first with content, whether those are one chunk, seconds to the last chunk, and the gaps between
    chunks with content (what batching tokens into items does to inter-token latency); None on failure."""
    payload = json.loads(json.dumps(body(model, "text", TTFT_TOKENS, True)).replace("@@N@@", f"ttft-{n}"))
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    chunk = content = last = None
    texts: list[float] = []
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    last = time.perf_counter() - t0
                    chunk = chunk if chunk is not None else last
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        texts.append(last)
                        content = content if content is not None else last
    except (OSError, ValueError):
        return None
    if content is None:
        return None
    return chunk, content, chunk == content, last, [b - a for a, b in itertools.pairwise(texts)]


def wrk(port: int, script: Path, concurrency: int, seconds: int,
        during: Callable[[float], None] | None = None) -> dict:
    """One closed-loop run; `during(t0)` runs while wrk does (t0: its start, perf_counter)."""
    cmd = [WRK, "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "30s", "--latency", "-s", str(script),
           f"http://127.0.0.1:{port}/v1/chat/completions"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if during is not None:
            during(t0)
        stdout, stderr = proc.communicate(timeout=seconds + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    line = next((x for x in stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {stdout[-1500:]} {stderr[-1500:]}")
    out = json.loads(line[8:])
    out["first_bad"] = next((x[7:] for x in stdout.splitlines() if x.startswith("WRKBAD ")), "").strip()
    return out


def completed(port: int) -> float:
    """Chat requests the frontend finished with success: Dynamo's HTTP layer's counter (both frontends)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_frontend_requests_total{") and 'status="success"' in line
               and 'endpoint="chat_completions"' in line)


# --- processes ----------------------------------------------------------------------------------


def cpu_by_group() -> dict[int, int]:
    """Clock ticks (utime+stime+cutime+cstime) of every live process, summed by process group."""
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pgid = int(fields[2])
        out[pgid] = out.get(pgid, 0) + sum(int(x) for x in fields[11:15])
    return out


TICK = os.sysconf("SC_CLK_TCK")


def switches(pid: int) -> int:
    """Context switches (voluntary + involuntary) so far, summed over the process's threads: each is
    one thread handing another the work of a request, the cost of crossing between threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches:" in line)
    return total


def threads(pid: int) -> dict[str, int]:
    """The process's threads by name (Dynamo's runtime: tokio-rt-worker; the processor: python)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0) + 1
    return out


class Setup:
    """One graph under `mm-encoder serve` (harness.serve_fixtures.Served), with its own etcd and NATS if it
    needs them; its components' process groups from state.json."""

    def __init__(self, name: str, graph: Path, checkpoint: Path, work: Path):
        self.name, self.graph = name, graph
        self.run = work / f"run-{name}"
        self.port = free_port()
        self.served = Served(str(graph), self.run, self.port, "--checkpoint", str(checkpoint), "--dtype", "fp32",
                             unset=("NATS_SERVER", "ETCD_ENDPOINTS"))

    def wait(self) -> str:
        """The served model's name, once serve prints its ready line."""
        proc = self.served.proc
        try:
            line = proc.wait_for("ready: OpenAI base URL", STARTUP_S)
        except AssertionError as e:
            raise RuntimeError(f"{self.name}: {self.graph.name} was not ready: {e}") from None
        self.startup_s = proc.times[proc.lines.index(line)] - proc.started
        state = json.loads((self.run / "state.json").read_text())
        self.groups: dict[str, list[int]] = {"frontend": [], "engines": [], "rest": []}
        for c in state["components"]:
            key = "frontend" if c["kind"] == "frontend" else "engines" if c["kind"] == "engine" else "rest"
            self.groups[key].append(c["pid"])
        self.groups["rest"] += [s["pid"] for s in state.get("runtime", {}).get("servers", [])]
        argv = Path(f"/proc/{self.groups['frontend'][0]}/cmdline").read_text().split("\0")
        self.frontend_cmd = " ".join(["python", *argv[1:3]])
        return line.split("(model ", 1)[1].split(")", 1)[0]

    def cpu(self, snapshot: dict[int, int]) -> dict[str, float]:
        """CPU seconds so far per part (frontend, engines, rest) from a `cpu_by_group()` snapshot."""
        return {k: sum(snapshot.get(g, 0) for g in v) / TICK for k, v in self.groups.items()}

    def stream_interval(self) -> str:
        """The engines' `stream_interval_ms=N` from their ready lines, else tokens go one per item."""
        found = set()
        for log in sorted(self.run.glob("engine*.log")):
            for line in log.read_text(errors="replace").splitlines():
                m = re.search(r"engine ready.*stream_interval_ms=(\S+)", line)
                if m:
                    found.add(m.group(1))
        return f"{'/'.join(sorted(found))} ms" if found else "1 token per item"

    def __enter__(self) -> Setup:
        return self

    def __exit__(self, *exc) -> None:
        self.served.__exit__(*exc)


def stock_kv_graph(work: Path) -> Path:
    """graphs/epd-stock.yaml with `--router-mode kv` added to the frontend's args."""
    g = yaml.safe_load((ROOT / "graphs" / "epd-stock.yaml").read_text())
    fe = next(c for c in g["components"].values() if c["kind"] == "frontend")
    fe["args"] = [*(fe.get("args") or []), "--router-mode", "kv"]
    g["name"] = "epd-stock-kv"
    path = work / "epd-stock-kv.yaml"
    path.write_text(yaml.safe_dump(g, sort_keys=False))
    return path


# --- measuring ----------------------------------------------------------------------------------


def window_s(duration: int, tokens: int) -> int:
    return duration * (LONG if tokens >= 128 else 1)


def measure_cell(setup: Setup, script: Path, concurrency: int, warmup: int, duration: int) -> dict:
    """A warm-up run, then a measured run of LEAD + duration + TAIL s; CPU and completed requests are
    taken over [LEAD, LEAD + duration] of it (the loop already at its concurrency, and still running
    at the end, so requests in flight at either edge roughly balance). Latency and errors: wrk's,
    over the whole measured run; errors of the warm-up run count too."""
    warm = wrk(setup.port, script, concurrency, warmup)
    window: dict = {}

    def sample(t0: float) -> None:
        time.sleep(max(0.0, t0 + LEAD - time.perf_counter()))
        n0, x0 = completed(setup.port), switches(setup.groups["frontend"][0])
        c0, w0 = setup.cpu(cpu_by_group()), time.perf_counter()
        time.sleep(max(0.0, w0 + duration - time.perf_counter()))
        c1, w1 = setup.cpu(cpu_by_group()), time.perf_counter()
        window.update(n=completed(setup.port) - n0, s=w1 - w0, cpu={k: c1[k] - c0[k] for k in c1},
                      switches=switches(setup.groups["frontend"][0]) - x0)

    r = wrk(setup.port, script, concurrency, LEAD + duration + TAIL, during=sample)
    n = window["n"]
    errors = {k: r[k] + warm[k] for k in ("connect", "read", "write", "status", "timeout", "bad") if r[k] + warm[k]}
    return {"requests": int(n), "window_s": round(window["s"], 3), "rps": n / window["s"],
            "wrk_requests": r["requests"], "wrk_rps": r["requests"] / (r["duration_us"] / 1e6),
            "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3, "errors": errors,
            "first_error": r["first_bad"] or warm["first_bad"] or None,
            "chunks_per_response": r["chunks"] / r["requests"] if r["requests"] else None,
            "frontend_switches_per_request": window["switches"] / n if n else None,
            "cpu_ms_per_request": {k: v * 1e3 / n if n else None for k, v in window["cpu"].items()}}


def summarize(rounds: list[dict]) -> dict:
    def s(values):
        v = [x for x in values if x is not None]
        return stats.summary(v) if v else None

    out = {k: s(r.get(k) for r in rounds)
           for k in ("rps", "p50_ms", "p99_ms", "chunks_per_response", "frontend_switches_per_request")}
    out["cpu_ms_per_request"] = {k: s(r["cpu_ms_per_request"][k] for r in rounds)
                                 for k in rounds[0]["cpu_ms_per_request"]}
    out["requests"] = sum(r["requests"] for r in rounds)
    out["errors"] = sum(sum(r["errors"].values()) for r in rounds)
    out["first_error"] = next((r["first_error"] for r in rounds if r["first_error"]), None)
    out["rounds"] = rounds
    return out


def _per_token(one: dict | None, many: dict | None) -> float | None:
    """µs of CPU per generated token: (ms per request at 128 tokens - at 1) / 127."""
    return (many["median"] - one["median"]) / 127 * 1e3 if one and many else None


def _ratio(a: dict | None, b: dict | None) -> float | None:
    return stats.ratio(a, b) if a and b and b["median"] else None


def measure(args, work: Path) -> dict:
    checkpoint = make_checkpoint(work)
    graphs = {"ours": ROOT / "graphs" / "epd.yaml", "stock": ROOT / "graphs" / "epd-stock.yaml",
              "stock-kv": stock_kv_graph(work)}
    with contextlib.ExitStack() as stack:  # all three start at once; each stopped (and checked) at the end
        setups = {name: stack.enter_context(Setup(name, graphs[name], checkpoint, work)) for name in SETUPS}
        out = describe(setups)
        model = out["model"]
        idle_cpu(setups, out, model, args.idle)
        raw, ttfts, ttft_failed = run_rounds(args, setups, model, work)
    cells = cell_results(args, raw)
    return {**out, "cells": cells, "cpu_us_per_token": per_token(cells), **ttft_results(ttfts),
            "ttft_failed": ttft_failed}


def make_checkpoint(work: Path) -> Path:
    checkpoint = work / "kimi-k2.5-tiny"
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mm_encoder.cli", "make-checkpoint", str(checkpoint), "--preset",
                           "tiny"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"make-checkpoint failed: {done.stderr[-2000:]}")
    print(f"checkpoint written in {time.perf_counter() - t:.0f} s", flush=True)
    return checkpoint


def describe(setups: dict[str, Setup]) -> dict:
    """Once every graph is ready: the model they all serve, and per graph what runs and how."""
    models = {name: s.wait() for name, s in setups.items()}
    model = models["ours"]
    if set(models.values()) != {model}:
        raise RuntimeError(f"the graphs serve different models: {models}")
    out: dict = {"model": model, "setups": {}}
    for name, s in setups.items():
        out["setups"][name] = {"graph": str(s.graph.relative_to(ROOT)) if s.graph.is_relative_to(ROOT)
                               else "graphs/epd-stock.yaml + frontend args --router-mode kv",
                               "frontend": s.frontend_cmd, "startup_s": round(s.startup_s, 1),
                               "engines_stream_interval": s.stream_interval(),
                               "frontend_threads": threads(s.groups["frontend"][0]),
                               "ignore_eos": check_ignore_eos(s.port, model)}
        print(f"{name}: up in {s.startup_s:.0f} s ({s.frontend_cmd}); engines' stream interval "
              f"{out['setups'][name]['engines_stream_interval']}; ignore_eos {out['setups'][name]['ignore_eos']}",
              flush=True)
    return out


def idle_cpu(setups: dict[str, Setup], out: dict, model: str, idle_s: float) -> None:
    """One warm request each (the image encoded once per graph), then each part's CPU while idle."""
    for s in setups.values():
        post(s.port, body(model, "image", 1, False))
    before = {n: s.cpu(cpu_by_group()) for n, s in setups.items()}
    time.sleep(idle_s)
    after = {n: s.cpu(cpu_by_group()) for n, s in setups.items()}
    for n in setups:
        out["setups"][n]["idle_cpu_ms_per_s"] = {k: (after[n][k] - before[n][k]) * 1e3 / idle_s for k in after[n]}


def run_rounds(args, setups: dict[str, Setup], model: str, work: Path) -> tuple[dict, dict, dict]:
    """Every cell, then the TTFT requests, per round; the graphs' order rotates round by round."""
    scripts = {}
    for cell, _, prompt, tokens, stream, _ in CELLS:
        scripts[cell] = work / f"{cell}.lua"
        scripts[cell].write_text(LUA.replace("@@BODY@@", json.dumps(body(model, prompt, tokens, stream)))
                                 .replace("@@TOKENS@@", str(tokens)))
    raw: dict[str, dict[str, list[dict]]] = {c[0]: {n: [] for n in SETUPS} for c in CELLS}
    ttfts: dict[str, list[tuple[float, float, bool, float, list[float]]]] = {n: [] for n in SETUPS}
    ttft_failed = dict.fromkeys(SETUPS, 0)
    for rnd in range(args.rounds):
        order = [*SETUPS[rnd % 3:], *SETUPS[:rnd % 3]]
        for cell, _, _, tokens, _, conc in CELLS:
            for n in order:
                r = measure_cell(setups[n], scripts[cell], conc, args.warmup, window_s(args.duration, tokens))
                raw[cell][n].append(r)
                cpu = {k: "-" if v is None else f"{v:.2f}" for k, v in r["cpu_ms_per_request"].items()}
                print(f"round {rnd + 1}/{args.rounds} {cell:16s} {n:9s} {r['rps']:7.1f} req/s  p50 "
                      f"{r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  CPU ms/req frontend "
                      f"{cpu['frontend']:>6s} engines {cpu['engines']:>6s} rest {cpu['rest']:>6s}  "
                      f"errors {sum(r['errors'].values())}", flush=True)
        for i in range(args.ttft_n):
            for n in order:
                v = ttft(setups[n].port, model, rnd * args.ttft_n + i)
                if v is None:
                    ttft_failed[n] += 1
                else:
                    ttfts[n].append(v)
        print(f"round {rnd + 1}/{args.rounds} TTFT c=1 median ms: " + ", ".join(
            f"{n} {stats.summary(x[1] * 1e3 for x in ttfts[n])['median']:.1f}" for n in SETUPS if ttfts[n]),
            flush=True)
    return raw, ttfts, ttft_failed


def cell_results(args, raw: dict[str, dict[str, list[dict]]]) -> dict:
    cells = {}
    for cell, label, prompt, tokens, stream, conc in CELLS:
        per = {n: summarize(raw[cell][n]) for n in SETUPS}
        ours = per["ours"]
        cells[cell] = {"label": label, "prompt": prompt, "max_tokens": tokens, "stream": stream,
                       "concurrency": conc, "window_s": window_s(args.duration, tokens), "setups": per,
                       "ratios": {other: {"frontend_cpu": _ratio(ours["cpu_ms_per_request"]["frontend"],
                                                                 per[other]["cpu_ms_per_request"]["frontend"]),
                                          "engines_cpu": _ratio(ours["cpu_ms_per_request"]["engines"],
                                                                per[other]["cpu_ms_per_request"]["engines"]),
                                          "rps": _ratio(ours["rps"], per[other]["rps"])}
                                  for other in ("stock", "stock-kv")}}
    return cells


def per_token(cells: dict) -> dict:
    out: dict = {}
    for n in SETUPS:
        out[n] = {}
        for suffix in ("", "-stream"):
            one, many = cells[f"text-1{suffix}"]["setups"][n], cells[f"text-128{suffix}"]["setups"][n]
            out[n]["streamed" if suffix else "non_streamed"] = {
                part: _per_token(one["cpu_ms_per_request"][part], many["cpu_ms_per_request"][part])
                for part in ("frontend", "engines")}
    return out


def ttft_results(ttfts: dict[str, list[tuple[float, float, bool, float, list[float]]]]) -> dict:
    return {"ttft_ms": {n: stats.summary(x[1] * 1e3 for x in v) if v else None for n, v in ttfts.items()},
            "first_chunk_ms": {n: stats.summary(x[0] * 1e3 for x in v) if v else None for n, v in ttfts.items()},
            "first_chunk_without_text": {n: sum(1 for x in v if not x[2]) for n, v in ttfts.items()},
            "last_chunk_ms": {n: stats.summary(x[3] * 1e3 for x in v) if v else None for n, v in ttfts.items()},
            "text_chunk_gap_ms": {n: stats.summary(g * 1e3 for x in v for g in x[4]) if any(x[4] for x in v)
                                  else None for n, v in ttfts.items()}}


# --- the command ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 3 s windows, 1 s warm-up, 6 TTFT requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=int, default=5, help="measured seconds per cell (whole seconds: wrk's -d)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up seconds before each cell")
    p.add_argument("--ttft-n", type=int, default=10, help="single TTFT requests per setup per round")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured at start")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup, args.ttft_n, args.idle = 1, 3, 1, 6, 2.0
    if not os.access(WRK, os.X_OK):
        sys.exit(f"{WRK} not found (apt-get install wrk)")
    t0 = time.perf_counter()
    loadavg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    work = Path(tempfile.mkdtemp(prefix="mm-bench-frontends-"))
    try:
        out = measure(args, work)
    finally:
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    result = {"machine": stats.machine(), "loadavg": loadavg, "wall_s": round(time.perf_counter() - t0, 1),
              "config": {"rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
                         "ttft_n": args.ttft_n, "idle_s": args.idle, "concurrency": CONCURRENCY, "lead_s": LEAD,
                         "tail_s": TAIL, "long": LONG, "quick": args.quick,
                         "client": "wrk -t1 (closed loop)", "dtype": "fp32", "preset": "tiny"},
              **out}
    stats.emit(result, args.json, "frontends")
    print(f"wall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
