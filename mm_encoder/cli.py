"""`mm-encoder` command line: encode media files/URLs, list models, run the bundled demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path

from . import __version__
from .encoder import EncodedMedia, Encoder
from .errors import MMEncoderError
from .registry import DEFAULT_MODEL, list_models

SAMPLES = Path(__file__).resolve().parent / "samples"
FETCH_TIMEOUT_S = 30


def read_media(ref: str, max_bytes: int) -> bytes:
    """A path, an http(s) URL or a data: URL -> bytes (read capped at max_bytes + 1)."""
    if ref.startswith(("http://", "https://", "data:")):
        with urllib.request.urlopen(ref, timeout=FETCH_TIMEOUT_S) as resp:
            data = resp.read(max_bytes + 1)
    else:
        if "://" in ref:
            raise MMEncoderError(f"unsupported URL scheme in {ref[:40]!r}: use a path, http(s):// or data:", "bad_url")
        data = Path(ref).read_bytes()
    return data


def _summary(ref: str, r: EncodedMedia, enc: Encoder) -> dict:
    return {
        "media": ref if len(ref) < 80 else ref[:77] + "...",
        "model": enc.name,
        "modality": r.modality,
        "timestamp": r.timestamp,
        "mm_hash": r.mm_hash,
        "grid_thw": list(r.grid_thw),
        "tokens": r.num_tokens,
        "embeds_shape": list(r.embeds.shape),
        "embeds_dtype": str(r.embeds.dtype).removeprefix("torch."),
        "timings_ms": {k: round(v, 2) for k, v in r.timings_ms.items()},
    }


def _print_table(rows: list[dict]) -> None:
    for row in rows:
        label = row["media"] + (f" @{row['timestamp']}" if row["timestamp"] else "")
        t = row["timings_ms"]
        print(
            f"{label}\n  model={row['model']} modality={row['modality']} mm_hash={row['mm_hash'][:16]}..."
            f" grid(t,h,w)={tuple(row['grid_thw'])} tokens={row['tokens']}"
            f" embeds={tuple(row['embeds_shape'])} {row['embeds_dtype']}\n"
            "  ms: " + " ".join(f"{k}={v:.1f}" for k, v in t.items())
        )


def cmd_encode(args: argparse.Namespace, refs: list[str]) -> int:
    t0 = time.perf_counter()
    enc = Encoder.from_pretrained(args.model, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype)
    load_ms = (time.perf_counter() - t0) * 1e3
    rows, failed = [], 0
    for ref in refs:
        try:
            data = read_media(ref, enc.limits.max_bytes)
            rows += [_summary(ref, r, enc) for r in enc.encode_file(data)]
        except (MMEncoderError, OSError) as e:
            failed += 1
            code = e.code if isinstance(e, MMEncoderError) else "io_error"  # HTTPError.code is a status
            msg = e.message if isinstance(e, MMEncoderError) else str(e)
            rows.append({"media": ref, "error": {"code": code, "message": msg}})
            print(f"{ref}: error [{code}] {msg}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": enc.name, "load_ms": round(load_ms, 1), "results": rows}, indent=2))
    else:
        print(f"model {enc.name} ({enc.device}, {str(enc.dtype).removeprefix('torch.')}), loaded in {load_ms:.0f} ms")
        _print_table([r for r in rows if "error" not in r])
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder", description=__doc__)
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
        s.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on CUDA, fp32 on CPU)")
        s.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("models", help="list registered models")
    args = p.parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "models":
            for spec in list_models():
                print(f"{spec.name:20s} -> {spec.projector.out_dim:5d}  aliases: {', '.join(spec.aliases) or '-'}")
            return 0
        refs = args.media if args.cmd == "encode" else [str(SAMPLES / "sample.jpg"), str(SAMPLES / "sample.mp4")]
        return cmd_encode(args, refs)
    except MMEncoderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
