"""`mm-encoder` command line: encode media here, or run a component or a whole graph.

`encode`, `demo`, `models` and `graphs` are this module's; every other subcommand is a component's
own entry point (its `main(argv)`), handed the rest of the command line untouched, so its options
and `--help` are its own: `mm-encoder worker ...` is `python -m mm_encoder.encode_worker ...`.
`serve` and `render-k8s` take a graph file or a shipped graph's name (`mm-encoder serve epd`);
`graphs` lists the shipped graphs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .core.errors import MMEncoderError
from .core.registry import DEFAULT_MODEL, list_models
from .core.timing import ms_since

if TYPE_CHECKING:  # the model (torch) loads only for encode and demo, not for the components' commands
    from .model.encoder import EncodedMedia, Encoder

SAMPLES = Path(__file__).resolve().parent / "samples"
FETCH_TIMEOUT_S = 30
# subcommand -> (module whose main(argv) runs it, help)
COMPONENTS = {
    "worker": ("mm_encoder.encode_worker.process", "run the encode worker (mm-encoder worker --help)"),
    "engine": ("mm_encoder.engines.process",
               "run an engine: the checkpoint's language model (mm-encoder engine --help)"),
    "make-checkpoint": ("mm_encoder.engines.tiny_checkpoint", "write a small random Kimi-K2.5 checkpoint directory"),
    "make-ca": ("mm_encoder.security.make_ca", "write an operator CA (ca.pem, ca.key) that several sites share"),
    "cache": ("mm_encoder.cache_tiers.cli", "run an nginx cache tier or the shard router (mm-encoder cache --help)"),
    "serve": ("mm_encoder.serve.cli", "run a whole graph on this machine: mm-encoder serve epd (or a graph file)"),
    "status": ("mm_encoder.serve.status", "per-component status of a running graph"),
    "render-k8s": ("mm_encoder.k8s.render",
                   "Kubernetes resources for a graph: mm-encoder render-k8s epd (or a graph file)"),
    "capacity": ("mm_encoder.capacity.cli",
                 "the cache tiers and encoders a traffic needs, simulated (mm-encoder capacity --help)"),
}


def read_media(ref: str, max_bytes: int) -> bytes:
    """A path, an http(s) URL or a data: URL -> bytes (read capped at max_bytes + 1)."""
    if ref.startswith(("http://", "https://", "data:")):
        with urllib.request.urlopen(ref, timeout=FETCH_TIMEOUT_S) as resp:
            data: bytes = resp.read(max_bytes + 1)
    else:
        if "://" in ref:
            raise MMEncoderError(f"unsupported URL scheme in {ref[:40]!r}: use a path, http(s):// or data:", "bad_url")
        data = Path(ref).read_bytes()
    return data


def _summary(ref: str, r: EncodedMedia, model: str) -> dict[str, Any]:
    return {
        "media": ref if len(ref) < 80 else ref[:77] + "...",
        "model": model,
        "modality": r.modality,
        "timestamp": r.timestamp,
        "mm_hash": r.mm_hash,
        "grid_thw": list(r.grid_thw),
        "tokens": r.num_tokens,
        "embeds_shape": list(r.embeds.shape),
        "embeds_dtype": str(r.embeds.dtype).removeprefix("torch."),
        "timings_ms": {k: round(v, 2) for k, v in r.timings_ms.items()},
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        label = row["media"] + (f" @{row['timestamp']}" if row["timestamp"] else "")
        t = row["timings_ms"]
        print(
            f"{label}\n  model={row['model']} modality={row['modality']} mm_hash={row['mm_hash'][:16]}..."
            f" grid(t,h,w)={tuple(row['grid_thw'])} tokens={row['tokens']}"
            f" embeds={tuple(row['embeds_shape'])} {row['embeds_dtype']}\n"
            "  ms: " + " ".join(f"{k}={v:.1f}" for k, v in t.items())
        )


def load(args: argparse.Namespace) -> Encoder:
    from .model.encoder import Encoder

    return Encoder.from_pretrained(args.model, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype)


def cmd_encode(args: argparse.Namespace, refs: list[str], enc: Encoder | None = None) -> int:
    t0 = time.perf_counter()
    if enc is None:
        enc = load(args)
    load_ms = ms_since(t0)
    steps = enc.steps  # what the encoder is: its spec, device, dtype, limits
    rows, failed = [], 0
    for ref in refs:
        try:
            data = read_media(ref, steps.limits.max_bytes)
            rows += [_summary(ref, r, steps.spec.name) for r in enc.encode_file(data)]
        except (MMEncoderError, OSError) as e:
            failed += 1
            code = e.code if isinstance(e, MMEncoderError) else "io_error"  # HTTPError.code is a status
            msg = e.message if isinstance(e, MMEncoderError) else str(e)
            rows.append({"media": ref, "error": {"code": code, "message": msg}})
            print(f"{ref}: error [{code}] {msg}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": steps.spec.name, "load_ms": round(load_ms, 1), "results": rows}, indent=2))
    else:
        dtype = str(steps.dtype).removeprefix("torch.")
        print(f"model {steps.spec.name} ({steps.device}, {dtype}), loaded in {load_ms:.0f} ms")
        _print_table([r for r in rows if "error" not in r])
    return 1 if failed else 0


async def _demo_service(enc: Encoder, refs: list[str]) -> None:
    """The same samples through the encode worker over loopback HTTP: cold, then from cache."""
    import aiohttp

    from .core import wire
    from .encode_worker.process import Worker
    from .encode_worker.settings import WorkerSettings

    worker = Worker(WorkerSettings(_cli_parse_args=[], http_port=0), encoder=enc)
    await worker.start()
    url = f"http://127.0.0.1:{worker.http_port}/v1/encode"
    name = enc.steps.spec.name
    print(f"\nencode worker on {url} (model {name}):")
    try:
        async with aiohttp.ClientSession() as session:
            for ref in refs:
                data = Path(ref).read_bytes()
                body = msgpack_request(name, data)
                for attempt in ("cold", "again"):
                    async with session.post(url, data=body, headers={"Content-Type": "application/msgpack"}) as r:
                        payload = await r.read()
                        if r.status != 200:
                            raise MMEncoderError(f"worker answered {r.status}: {payload[:200]!r}", "demo_failed")
                        msg = wire.decode(payload)
                        timing = r.headers["Server-Timing"]
                        total = next(p.split("dur=")[1] for p in timing.split(", ") if p.startswith("total"))
                        print(f"  {Path(ref).name} ({attempt}): {r.headers['X-MM-Cache']:8s} {len(payload):7d} B "
                              f"wire v1 ({msg.length} tokens x {msg.shape[1]} {msg.dtype}, "
                              f"{len(msg.grid_thws)} grid(s)) in {float(total):.1f} ms  [{timing}]")
    finally:
        await worker.stop()


def msgpack_request(model: str, data: bytes) -> bytes:
    import msgpack

    return msgpack.packb({"model": model, "data": data})


def cmd_graphs() -> int:
    """The shipped graphs: name and the first line of each file's header, then where they are read."""
    from .graph.shipped import graphs_dir, shipped_graphs

    graphs = shipped_graphs()
    width = max(map(len, graphs), default=0)
    for name, description in graphs.items():
        print(f"{name:{width}s}  {description}")
    print(f"read from {graphs_dir()} (MM_ENCODER_GRAPHS overrides); run one: mm-encoder serve NAME")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("encode", "encode media: paths, http(s) URLs, data: URLs"),
                        ("demo", "encode the bundled sample image and video")):
        s = sub.add_parser(name, help=help_)
        if name == "encode":
            s.add_argument("media", nargs="+")
        s.add_argument("--model", default=DEFAULT_MODEL, help="registry name/alias or checkpoint dir")
        s.add_argument("--checkpoint", default=None, help="checkpoint directory (HF style)")
        s.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
        s.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 where native, else fp32)")
        s.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("models", help="list registered models")
    sub.add_parser("graphs", help="list the shipped graphs (for serve and render-k8s)")
    for name, (_, help_) in COMPONENTS.items():
        # no option of its own (prefix_chars that nothing starts with): every word goes to the component
        s = sub.add_parser(name, help=help_, add_help=False, prefix_chars="\0")
        s.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd in COMPONENTS:
        rc: int = importlib.import_module(COMPONENTS[args.cmd][0]).main(args.args)
        return rc
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "models":
            for spec in list_models():
                print(f"{spec.name:20s} -> {spec.projector.out_dim:5d}  aliases: {', '.join(spec.aliases) or '-'}")
            return 0
        if args.cmd == "graphs":
            return cmd_graphs()
        if args.cmd == "encode":
            return cmd_encode(args, args.media)
        refs = [str(SAMPLES / "sample.jpg"), str(SAMPLES / "sample.mp4")]
        enc = load(args)
        rc = cmd_encode(args, refs, enc)
        if rc == 0 and not args.json:
            asyncio.run(_demo_service(enc, refs))
        return rc
    except MMEncoderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
