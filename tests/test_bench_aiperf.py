"""bench/aiperf.py's pure parts, without AIPerf or a graph: reading AIPerf's JSON export (a real one,
trimmed: tests/data/aiperf_profile_export.json), the input file it is given, the command line, and the
frontend's figures the module sets beside AIPerf's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from bench import aiperf
from bench.sections.aiperf import section

DATA = Path(__file__).resolve().parent / "data"
EXPORT = DATA / "aiperf_profile_export.json"


def test_a_real_export_is_read_into_our_figures():
    export = json.loads(EXPORT.read_text())
    got = aiperf.parse_export(export)
    assert got["aiperf_version"] == "0.13.0" and got["was_cancelled"] is False
    assert got["requests"] == got["completed"] == int(export["request_count"]["avg"]) and got["errors"] == 0
    for key in ("request_latency_ms", "ttft_ms", "itl_ms", "prompt_tokens", "request_kb_sent"):
        d = got[key]
        assert set(d) == set(aiperf.STATS), key
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], key
    # a stream ends after its first token: latency at least TTFT, request by request
    assert got["request_latency_ms"]["min"] >= got["ttft_ms"]["min"]
    assert got["request_latency_ms"]["p50"] == export["request_latency"]["p50"]
    # run-wide figures have a value, not a distribution
    assert got["request_throughput"]["avg"] > 0 and got["request_throughput"]["p50"] is None
    assert got["benchmark_duration_s"]["avg"] > 0
    assert got["prompt_tokens"]["p50"] > 200  # the server's count (--use-server-token-count): the image's tokens


def test_an_export_in_other_units_or_with_errors_is_not_misread():
    export = json.loads(EXPORT.read_text())
    export["time_to_first_token"] = {**export["time_to_first_token"], "unit": "sec"}
    with pytest.raises(ValueError, match="time_to_first_token"):
        aiperf.parse_export(export)
    export = json.loads(EXPORT.read_text())
    export["error_summary"] = [{"error_details": {"code": 503, "type": "Service Unavailable"}, "count": 2},
                               {"error_details": {"code": 500}, "count": 1}]
    export["completed_request_count"] = {"unit": "requests", "avg": 1.0}
    del export["inter_token_latency"]  # one token per request: AIPerf gives no ITL
    got = aiperf.parse_export(export)
    assert got["errors"] == 3 and got["completed"] == 1 and got["itl_ms"] is None


def test_the_input_file_is_aiperfs_single_turn_jsonl(tmp_path):
    image = tmp_path / "hit.jpg"
    image.write_bytes(aiperf.noise_jpeg(64, 48, seed=1))
    path = aiperf.write_input_file(tmp_path / "in" / "hit.jsonl", "What is in it?", [image] * 3)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    for line in lines:  # the fields of AIPerf's SingleTurn: text and image (a path it encodes itself)
        assert json.loads(line) == {"text": "What is in it?", "image": str(image)}


def test_noise_images_are_new_per_seed_and_the_same_for_one():
    a, b = aiperf.noise_jpeg(64, 48, seed=1), aiperf.noise_jpeg(64, 48, seed=2)
    assert a == aiperf.noise_jpeg(64, 48, seed=1) and a != b
    with Image.open(io.BytesIO(a)) as img:
        assert (img.format, img.size, img.mode) == ("JPEG", (64, 48), "RGB")


def test_the_command_for_misses_and_for_hits(tmp_path):
    tok, art = tmp_path / "run" / "checkpoint" / aiperf.MODEL, tmp_path / "art"
    shape = dict(concurrency=2, osl=8, width=640, height=480)
    miss = aiperf.aiperf_command("http://127.0.0.1:9", tok, art, requests=12, **shape)
    hit = aiperf.aiperf_command("http://127.0.0.1:9", tok, art, requests=12, input_file=tmp_path / "h.jsonl",
                                **shape)

    def opt(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    for cmd in (miss, hit):
        assert cmd[:2] == [str(aiperf.AIPERF), "profile"] and opt(cmd, "--model") == aiperf.MODEL
        assert opt(cmd, "--tokenizer") == str(tok) and Path(opt(cmd, "--tokenizer")).is_absolute()
        assert opt(cmd, "--request-count") == "12" and opt(cmd, "--concurrency") == "2"
        assert "--streaming" in cmd and "--use-server-token-count" in cmd and opt(cmd, "--ui-type") == "none"
        assert opt(cmd, "--artifact-dir") == str(art)
    # misses: AIPerf's noise, a new image per request (as many dataset entries as requests)
    assert opt(miss, "--image-source") == "noise" and opt(miss, "--conversation-num") == "12"
    assert (opt(miss, "--image-width-mean"), opt(miss, "--image-height-mean")) == ("640", "480")
    # hits: the input file, AIPerf generating no image of its own
    assert opt(hit, "--custom-dataset-type") == "single_turn" and opt(hit, "--input-file") == str(tmp_path / "h.jsonl")
    assert "--image-source" not in hit


METRICS_TEXT = """# HELP dynamo_frontend_request_duration_seconds Duration of LLM requests
# TYPE dynamo_frontend_request_duration_seconds histogram
dynamo_frontend_request_duration_seconds_bucket{model="kimi-k2.5-tiny",le="2"} 6
dynamo_frontend_request_duration_seconds_sum{model="kimi-k2.5-tiny"} 0.9
dynamo_frontend_request_duration_seconds_count{model="kimi-k2.5-tiny"} 6
dynamo_frontend_request_duration_seconds_sum{model="other"} 0.1
dynamo_frontend_request_duration_seconds_count{model="other"} 1
dynamo_frontend_requests_total{endpoint="chat_completions",status="success"} 7
"""


def test_the_frontends_figures_cover_only_the_requests_between_two_snapshots():
    assert aiperf.duration_histogram(METRICS_TEXT) == pytest.approx((1.0, 7.0))
    old = [{"request_id": "a", "timings": {"first_token_ms": 999.0}}]
    new = [{"request_id": f"r{i}", "timings": {"first_token_ms": float(10 * i)}} for i in range(1, 6)]
    before = {"duration": (1.0, 7.0), "recent": old}
    after = {"duration": (1.5, 12.0), "recent": old + new + [{"request_id": "x", "timings": {}}]}
    got = aiperf.frontend_figures(before, after)
    assert got["requests"] == 5 and got["request_mean_ms"] == pytest.approx(100.0) and got["records"] == 6
    assert got["first_token_ms"]["p50"] == 30.0 and got["first_token_ms"]["max"] == 50.0


def test_our_clients_figures_and_the_section():
    results = [{"ok": True, "total_s": 0.2, "ttft_s": 0.1}, {"ok": True, "total_s": 0.4, "ttft_s": 0.3},
               {"ok": False, "total_s": 0.01, "ttft_s": None, "status": 503}]
    ours = aiperf.client_figures(results, wall_s=2.0)
    assert ours["requests"] == 3 and ours["completed"] == 2 and ours["errors"] == 1
    assert ours["request_latency_ms"]["p50"] == pytest.approx(300.0) and ours["request_throughput"]["avg"] == 1.0
    ap = aiperf.parse_export(json.loads(EXPORT.read_text()))
    front = aiperf.frontend_figures({"duration": (0, 0), "recent": []}, {"duration": (1.0, 4.0), "recent": []})
    case = {"aiperf": {**ap, "encodes_per_request": 0.0}, "ours": {**ours, "encodes_per_request": 0.0},
            "frontend": front, "frontend_ours": front, "command": ".venv-aiperf/bin/aiperf profile ..."}
    result = {"aiperf_version": "0.13.0", "config": {"preset": "tiny", "image": "640x480 noise JPEG", "osl": 8,
                                                     "requests": 4, "concurrency": 2},
              "graphs": {"epd": {"cases": {"miss": case, "hit": case}}, "agg": {"cases": {"miss": case}}}}
    md = section(result, Path("/nonexistent"))
    assert md.startswith("## AIPerf beside our own client (`python -m bench.aiperf`)")
    n = ap["requests"]
    assert f"| EPD hit | AIPerf | {n}/{n} |" in md and "| agg (baseline) | ours | 2/3 |" in md
    assert "| EPD miss / EPD hit (what a cache hit saves) | 1.00x |" in md


def test_a_sessions_cpu_is_summed_from_proc(tmp_path):
    tick = __import__("os").sysconf("SC_CLK_TCK")
    rows = {"10": (10, 3 * tick, tick), "11": (10, tick, 0), "12": (99, 50 * tick, 0)}  # 12: another session
    for pid, (sid, utime, stime) in rows.items():
        (tmp_path / pid).mkdir()
        fields = ["S", "1", pid, str(sid)] + ["0"] * 7 + [str(utime), str(stime)] + ["0"] * 10
        (tmp_path / pid / "stat").write_text(f"{pid} (a (tricky) name) " + " ".join(fields) + "\n")
    (tmp_path / "self").mkdir()
    assert aiperf.session_cpu_s(10, proc=tmp_path) == pytest.approx(5.0)
