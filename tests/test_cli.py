"""The `mm-encoder` CLI on files, data: URLs and a real HTTP server on loopback."""

from __future__ import annotations

import base64
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness.media_factory import image_bytes, natural_image
from mm_encoder.cli import COMPONENTS, main
from mm_encoder.families.model_card import ModelCard
from mm_encoder.graph.checkpoint import GeneratedCheckpoint
from mm_encoder.graph.plan import MODULES

CLI = [sys.executable, "-m", "mm_encoder.cli"]


@pytest.fixture
def http_dir(tmp_path):
    """A real HTTP server on 127.0.0.1 serving tmp_path; shut down after the test."""
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_encode_path_http_and_data_url_json(http_dir, capsys):
    """`encode` reads a path, an http URL and a data: URL of the same bytes: one mm_hash, the tiny
    model's grid, tokens, embedding shape and timings, as JSON."""
    root, base = http_dir
    data = image_bytes(natural_image(200, 100, seed=4))
    (root / "a.png").write_bytes(data)
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
    rc = main(["encode", str(root / "a.png"), f"{base}/a.png", data_url, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    rows = out["results"]
    assert len(rows) == 3 and len({r["mm_hash"] for r in rows}) == 1  # same bytes, three sources
    assert rows[0]["grid_thw"] == [1, 8, 16] and rows[0]["tokens"] == 32 and rows[0]["embeds_shape"] == [32, 256]
    assert set(rows[0]["timings_ms"]) >= {"decode", "preprocess", "forward", "total"}


def test_bad_media_reports_code_and_exit_status(http_dir, capsys):
    """Corrupt and missing media are reported per item with an error code, and the exit status is 1."""
    root, base = http_dir
    (root / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    rc = main(["encode", f"{base}/bad.png", f"{base}/missing.png", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    codes = [r["error"]["code"] for r in out["results"]]
    assert codes[0] in {"corrupt", "unsupported_format"} and codes[1] == "io_error"


def test_demo_subprocess_prints_summary():
    """`mm-encoder demo` encodes the bundled samples, then serves them through the encode worker on
    loopback: cold, then from its cache."""
    r = subprocess.run([*CLI, "demo"], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stderr
    assert "sample.jpg" in r.stdout and "sample.mp4 @00:00:00.000" in r.stdout
    assert "mm_hash=" in r.stdout and "tokens=" in r.stdout and "forward=" in r.stdout
    assert "RANDOM weights" in r.stderr
    # then the same samples through the encode worker over loopback HTTP: computed, then cached
    assert "encode worker on http://127.0.0.1:" in r.stdout
    assert "sample.jpg (cold): forward" in r.stdout and "sample.jpg (again): mm_hash" in r.stdout
    assert "sample.mp4 (cold): forward" in r.stdout and "2 grid(s)" in r.stdout


def test_worker_subcommand_reports_bad_options(capsys):
    """A worker refusing its options exits 2 with its own message."""
    assert main(["worker", "--http-port", "-1"]) == 2
    assert "nothing to serve" in capsys.readouterr().err


def test_component_subcommands_hand_every_word_to_the_component(capsys):
    """`mm-encoder cache ...` is `python -m mm_encoder.cache_tiers ...`: options and --help are
    the component's own, with nothing of the top-level parser in between."""
    assert main(["cache", "render", "--tier", "router", "--shard", "127.0.0.1:9001", "--listen",
                 "127.0.0.1:9000"]) == 0
    conf = capsys.readouterr().out
    assert "listen 127.0.0.1:9000" in conf and "server 127.0.0.1:9001" in conf
    with pytest.raises(SystemExit) as e:
        main(["worker", "--help"])
    assert e.value.code == 0 and "--batch-max-patches" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    top = capsys.readouterr().out
    assert e.value.code == 0 and all(name in top for name in COMPONENTS)
    assert all(name in top for name in ("worker", "engine", "make-checkpoint", "cache", "serve", "status",
                                        "render-k8s"))
    assert main(["cache", "up", "--tier", "router"]) == 2  # the component's own refusal: no --shard
    assert "needs at least one --shard" in capsys.readouterr().err


def test_torch_free_commands_start_without_torch():
    """`status` never imports torch (the CLI loads the model only for encode and demo)."""
    code = ("import sys; from mm_encoder.cli import main; rc = main(['status', '--run-dir', '/nonexistent']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no running graph" in r.stderr


def test_encode_worker_starts_as_the_other_components_do():
    """`python -m mm_encoder.encode_worker` is the encode worker (`encode_worker.process.main`), as
    `mm-encoder worker` is, and what the graphs plan; `python -m mm_encoder.worker` (the design card's
    entry) is the same `main`."""
    from mm_encoder import worker
    from mm_encoder.encode_worker import process

    assert COMPONENTS["worker"][0] == "mm_encoder.encode_worker.process"
    assert MODULES["encoder"] == "mm_encoder.encode_worker"
    assert (worker.Worker, worker.main) == (process.Worker, process.main)
    for module in ("mm_encoder.encode_worker", "mm_encoder.worker"):
        done = subprocess.run([sys.executable, "-m", module, "--http-port", "-1"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "nothing to serve" in done.stderr, (module, done.stderr[-2000:])


def test_engine_subcommand_is_the_engine_process(capsys):
    """`mm-encoder engine` runs what the graphs plan for engines (`python -m mm_encoder.engines`, whose
    `__main__` calls `engines.process.main`); its --help is the engine's own."""
    assert MODULES["engine"] == "mm_encoder.engines"
    assert COMPONENTS["engine"][0] == "mm_encoder.engines.process"
    with pytest.raises(SystemExit) as e:
        main(["engine", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert all(flag in out for flag in ("--checkpoint", "--dtype", "--encode-inline", "--encoder-chain", "--name"))
    assert main(["engine", "--checkpoint", "/nonexistent/ckpt"]) == 2  # refused before any model loads
    assert "/nonexistent/ckpt" in capsys.readouterr().err


def test_make_checkpoint_writes_what_every_component_reads(tmp_path, capsys):
    """`mm-encoder make-checkpoint`, with the very argv serve and the K8s init container use, writes a
    checkpoint directory that ModelCard accepts (a Kimi-K2.5 the frontend can describe), whose index
    names shards that exist; a second write is byte-identical, so pods that each generate their own
    copy serve the same model."""
    gen = GeneratedCheckpoint("tiny")
    assert COMPONENTS["make-checkpoint"][0] == gen.MODULE
    first, second = tmp_path / "a" / "kimi-k2.5-tiny", tmp_path / "b" / "kimi-k2.5-tiny"
    assert main(["make-checkpoint", *gen.argv(str(first))]) == 0
    assert capsys.readouterr().out == f"{first}\n"
    card = ModelCard.read(first)
    generation = json.loads((first / "generation_config.json").read_text())
    assert (card.model_type, card.spec_name, card.context_length) == ("kimi_k25", "kimi-k2.5-vision", 32768)
    assert card.eos_token_ids == [generation["eos_token_id"]] and card.path == first
    index = json.loads((first / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert shards == {p.name for p in first.glob("*.safetensors")} and len(shards) >= 2
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {p.name for p in first.iterdir()}
    assert main(["make-checkpoint", *gen.argv(str(second))]) == 0
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    assert all((first / p.name).read_bytes() == p.read_bytes() for p in second.iterdir())
    with pytest.raises(SystemExit) as e:
        main(["make-checkpoint", str(tmp_path / "c"), "--preset", "huge"])
    assert e.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err
