"""`mm-encoder status` without a graph: quantiles from a real prometheus-client histogram's
exposition and from a sample, the frontend's recent requests, `--watch` bounded by `--count`, and
each certificate's time left."""

from __future__ import annotations

import json
import os

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from mm_encoder.core.quantiles import nearest_rank as quantile
from mm_encoder.serve.status import _recent, histogram_quantile, main, samples


def test_histogram_quantiles_are_the_upper_bounds_of_their_buckets():
    r = CollectorRegistry()
    h = Histogram("stage_seconds", "x", ["stage"], buckets=(0.01, 0.1, 1.0), registry=r)
    for v in [0.005] * 10 + [0.05] * 8 + [0.5] * 2:
        h.labels("total").observe(v)
    found = samples(generate_latest(r).decode())
    assert histogram_quantile(found, "stage_seconds", 0.5, stage="total") == 0.01
    assert histogram_quantile(found, "stage_seconds", 0.9, stage="total") == 0.1
    assert histogram_quantile(found, "stage_seconds", 0.95, stage="total") == 1.0
    assert histogram_quantile(found, "stage_seconds", 0.5, stage="other") is None


def test_sample_quantiles_take_the_nearest_rank():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.95) == 95.0
    assert quantile([7.0], 0.95) == 7.0


def test_the_frontends_slowest_recent_request_is_named():
    procs = [{"recent": [{"request_id": "a", "timings": {"encode_ms": 30.0, "route_ms": 1.0}},
                         {"request_id": "b", "timings": {"encode_ms": 2.0, "route_ms": 1.0, "other": 99.0}}]},
             {"recent": [{"request_id": "c", "timings": {"encode_ms": 10.0, "route_ms": 0.5}}]}]
    got = _recent(procs)
    assert got["slowest"]["request_id"] == "a" and got["slowest"]["ms"] == 31.0
    assert got["p50_ms"] == 10.5 and got["p95_ms"] == 31.0
    assert _recent([{"recent": []}]) == {}


def test_watch_repeats_until_its_count(tmp_path, capsys):
    dead = os.getpid() + 4_000_000  # above any pid: not running
    (tmp_path / "state.json").write_text(json.dumps({
        "graph": "g", "base_url": "http://127.0.0.1:1/v1",
        "components": [{"name": "encoder", "kind": "encoder", "pid": dead, "url": "http://127.0.0.1:1"}]}))
    assert main(["--run-dir", str(tmp_path), "--watch", "0.01", "--count", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("graph g: http://127.0.0.1:1/v1 at ") == 3 and out.count(" DOWN") == 3
    assert main(["--run-dir", str(tmp_path), "--json", "--watch", "0.01", "--count", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and [json.loads(x)["components"][0]["up"] for x in lines] == [False, False]


def test_each_certificates_time_left_is_shown(tmp_path, capsys):
    """state.json's `cert_not_after` (serve writes it at each start and renewal): the time left, by unit."""
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    dead = os.getpid() + 4_000_000
    (tmp_path / "state.json").write_text(json.dumps({
        "graph": "g", "base_url": "https://127.0.0.1:1/v1",
        "components": [
            {"name": "encoder-0", "kind": "encoder", "pid": dead, "url": None,
             "cert_not_after": (now + timedelta(hours=16, minutes=10)).isoformat(),
             "plane_cert_not_after": (now + timedelta(days=4, hours=2)).isoformat()},
            {"name": "shared-0", "kind": "cache-shared", "pid": dead, "url": None,
             "cert_not_after": (now - timedelta(seconds=5)).isoformat()}]}))
    assert main(["--run-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("cert ends in 16h  dynamo cert ends in 4d") and lines[2].endswith("cert EXPIRED")
    assert main(["--run-dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["components"]
    assert 16 * 3600 < rows[0]["cert_expires_in_s"] <= 16 * 3600 + 600 and rows[1]["cert_expires_in_s"] < 0


def test_each_tier_shows_requests_and_hits_per_calling_cluster(tmp_path, capsys):
    """A tier's /_cache/stats (the JSON a real tier writes: tests/test_cache_tiers.py) served by a stand-in:
    the tier's row, then one line per calling cluster, hits where the tier caches (the router does not)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stats = {"/shared/_cache/stats": {"HIT": 3, "MISS": 1, "BYPASS": 1, "requests": 5, "clusters": {
                 "model-b": {"requests": 2, "bytes": 10, "errors": 0, "HIT": 2},
                 "model-a": {"requests": 3, "bytes": 10, "errors": 0, "HIT": 1, "MISS": 1, "BYPASS": 1}}},
             "/router/_cache/stats": {"clusters": {"model-a": {"requests": 4, "bytes": 1, "errors": 1}}}}

    class Stats(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(stats[self.path]).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stats)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (tmp_path / "state.json").write_text(json.dumps({
            "graph": "site", "base_url": "http://127.0.0.1:1/v1", "components": [
                {"name": "shared-0", "kind": "cache-shared", "pid": os.getpid(), "url": url + "/shared"},
                {"name": "router", "kind": "cache-router", "pid": os.getpid(), "url": url + "/router"}]}))
        assert main(["--run-dir", str(tmp_path)]) == 0
        lines = capsys.readouterr().out.splitlines()[1:]
        assert "requests=5" in lines[0] and "hit=75%" in lines[0]
        assert lines[1:3] == ["      from model-a: requests=3  hits=1 (50%)",
                              "      from model-b: requests=2  hits=2 (100%)"]
        assert "requests=4" in lines[3] and "hit=" not in lines[3]
        assert lines[4:] == ["      from model-a: requests=4"]
        assert main(["--run-dir", str(tmp_path), "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["components"]
        assert rows[0]["clusters"]["model-b"] == {"requests": 2, "hits": 2, "hit_ratio": 1.0}
    finally:
        server.shutdown()
        server.server_close()
