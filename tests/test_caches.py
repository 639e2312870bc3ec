"""The in-process cache levels, single-flight, and worker settings from env and command line."""

from __future__ import annotations

import asyncio

import pytest

from mm_encoder.core.wire import Packed, WireHeader
from mm_encoder.encode_worker.caches import AliasCache, BodyCache, SingleFlight
from mm_encoder.encode_worker.settings import WorkerSettings
from mm_encoder.worker import main


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_alias_ttl_scope_and_lru():
    clock = Clock()
    c = AliasCache(max_entries=2, ttl_s=10, clock=clock)
    c.put("t1", "http://x/a", b"id", "h1")
    assert c.get("t1", "http://x/a", b"id") == "h1"
    assert c.get("t2", "http://x/a", b"id") is None  # never across scopes
    assert c.get("t1", "http://x/a", b"other-processor") is None
    clock.now = 9.99
    assert c.get("t1", "http://x/a", b"id") == "h1"
    clock.now = 10.0
    assert c.get("t1", "http://x/a", b"id") is None and len(c) == 0  # expired, dropped
    assert (c.stats.hits, c.stats.expirations) == (2, 1)
    for i in range(3):
        c.put("", f"u{i}", b"id", f"h{i}")
    assert len(c) == 2 and c.get("", "u0", b"id") is None and c.stats.evictions == 1
    assert AliasCache(0, 10).put("", "u", b"", "h") is None  # disabled: stores nothing


def _entry(n: int, fill: bytes = b"x") -> Packed:
    header = WireHeader(mm_hash="h", model="m", modality="image", dtype="bfloat16", shape=(4, 8),
                        grid_thws=((1, 4, 4),), length=4, timestamps=None)
    return Packed(fill * n, header)


def test_body_cache_caps_bytes_and_evicts_lru():
    """Entries are a body with its header; the cap counts body bytes."""
    c = BodyCache(max_bytes=100)
    c.put("a", _entry(40))
    c.put("b", _entry(40))
    assert c.get("a") is not None  # a is now most recent
    c.put("c", _entry(40))
    assert c.get("b") is None and c.get("a") and c.get("c")
    assert c.bytes == 80 and c.stats.evictions == 1
    c.put("huge", _entry(101))  # larger than the whole cache: not stored, nothing evicted
    assert c.get("huge") is None and len(c) == 2
    c.put("a", _entry(10, b"y"))  # replacing an entry fixes the byte count
    assert c.bytes == 50 and c.get("a").header.grid_thws == ((1, 4, 4),)



def test_body_cache_counts_refills_of_what_it_dropped():
    """A body put back for an mm_hash the cache had dropped (evicted, too big to keep, cleared) is a
    refill, a re-encode: forwards minus refills are the unique images (the fleet dashboard's)."""
    c = BodyCache(max_bytes=100)
    c.put("a", _entry(60))
    c.put("b", _entry(60))  # evicts a
    assert c.stats.refills == 0
    c.put("a", _entry(60))  # a again, evicting b
    c.put("huge", _entry(101))  # never kept
    c.put("huge", _entry(101))
    assert c.stats.refills == 2
    c.put("c", _entry(10))  # new: no refill
    c.clear()
    c.put("c", _entry(10))
    assert c.stats.refills == 3
    small = BodyCache(max_bytes=100)
    small._forgotten.size = 2  # remembers the last two drops only
    for key in "wxyz":
        small.put(key, _entry(101))
    small.put("w", _entry(101))
    small.put("z", _entry(101))
    assert small.stats.refills == 1

async def test_single_flight_shares_results_and_never_replays_errors():
    sf = SingleFlight()
    release = asyncio.Event()
    calls = 0

    async def work():
        nonlocal calls
        calls += 1
        await release.wait()
        if calls == 1:
            raise ValueError("boom")
        return calls

    waiters = [asyncio.create_task(sf.run("k", work)) for _ in range(4)]
    await asyncio.sleep(0)  # let them all join (no timing involved: one loop turn)
    release.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results) and calls == 1 and sf.joined == 3
    assert "k" not in sf
    assert await sf.run("k", work) == (2, False)  # the error was not cached


async def test_single_flight_cancels_work_only_when_every_waiter_left():
    sf = SingleFlight()
    started, release = asyncio.Event(), asyncio.Event()
    cancelled = False

    async def work():
        nonlocal cancelled
        started.set()
        try:
            await release.wait()
            return "done"
        except asyncio.CancelledError:
            cancelled = True
            raise

    a = asyncio.create_task(sf.run("k", work))
    b = asyncio.create_task(sf.run("k", work))
    await started.wait()
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert not cancelled  # b still waits
    release.set()
    assert await b == ("done", True)

    release.clear()
    started.clear()
    c = asyncio.create_task(sf.run("k2", work))
    await started.wait()
    c.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c
    await asyncio.sleep(0)
    assert cancelled and "k2" not in sf


def test_settings_from_env_and_command_line(monkeypatch):
    monkeypatch.setenv("MM_ENCODER_HTTP_PORT", "9001")
    monkeypatch.setenv("MM_ENCODER_FETCH_ALLOW_HOSTS", '["10.0.0.0/8", "images.internal:8080"]')
    s = WorkerSettings(_cli_parse_args=["--model", "kimi-k2.5-vision", "--dynamo", "--max-pending", "3"])
    assert (s.http_port, s.model, s.dynamo, s.max_pending) == (9001, "kimi-k2.5-vision", True, 3)
    assert s.fetch_policy().allow_hosts == ("10.0.0.0/8", "images.internal:8080")
    assert WorkerSettings(_cli_parse_args=["--http-port", "7"]).http_port == 7  # the command line wins


def test_bad_settings_exit_2_with_a_message(capsys):
    assert main(["--http-port", "-1"]) == 2  # nothing to serve
    assert "nothing to serve" in capsys.readouterr().err
    assert main(["--max-pending", "0"]) == 2
