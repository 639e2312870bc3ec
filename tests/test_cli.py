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
from media_factory import image_bytes, natural_image

from mm_encoder.cli import main

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
    root, base = http_dir
    (root / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    rc = main(["encode", f"{base}/bad.png", f"{base}/missing.png", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    codes = [r["error"]["code"] for r in out["results"]]
    assert codes[0] in {"corrupt", "unsupported_format"} and codes[1] == "io_error"


def test_demo_subprocess_prints_summary():
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
    assert main(["worker", "--http-port", "-1"]) == 2
    assert "nothing to serve" in capsys.readouterr().err
