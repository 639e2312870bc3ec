"""The Dynamo RPC transport on the real Dynamo runtime (file discovery + TCP request plane, one
machine, a fresh DYN_FILE_KV per test): same bytes as HTTP, typed errors, health, metrics,
cancellation-safe draining, and a real worker process that deregisters on SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import os
import signal

import aiohttp
import pytest

from harness.media_factory import image_bytes, natural_image
from harness.topology import dynamo_system_port, start_worker
from harness.worker_fixtures import ForwardGate, metric, post_json, run_worker, wait_for
from mm_encoder import wire
from mm_encoder.client import call_encode
from mm_encoder.core.errors import RemoteError
from mm_encoder.runtime.dynamo import endpoint_path, make_runtime

pytest.importorskip("dynamo.runtime")

PNG = image_bytes(natural_image(120, 90, seed=1))


@pytest.fixture(autouse=True)
def dynamo_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "dyn-kv"))
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "file")
    monkeypatch.setenv("DYN_REQUEST_PLANE", "tcp")
    monkeypatch.setenv("DYN_EVENT_PLANE", "zmq")
    monkeypatch.setenv("DYN_LOG", "warn")


async def client_for(runtime, namespace: str = "mm"):
    client = await runtime.endpoint(endpoint_path(namespace)).client()
    await asyncio.wait_for(client.wait_for_instances(), 30)
    return client


async def test_dynamo_and_http_return_identical_bytes(tiny):
    async with run_worker(tiny, dynamo=True, cache_bytes=0, alias_cache_entries=0) as w, aiohttp.ClientSession() as s:
        client = await client_for(w.dynamo.runtime)
        url = "data:image/png;base64," + base64.b64encode(PNG).decode()
        reply = await call_encode(client, {"model": "tiny", "url": url})
        by_bytes = await call_encode(client, {"model": "tiny", "data": PNG})
        status, headers, body = await post_json(s, w, {"model": "tiny", "url": url})
        assert status == 200
        assert reply.body == by_bytes.body == body  # three separate encodes, one byte string
        assert reply.mm_hash == headers["X-MM-Hash"] == wire.decode(body).mm_hash
        assert set(reply.timings_ms) >= {"decode", "preprocess", "forward", "pack", "total"}
        ok = {"transport": "dynamo", "outcome": "ok"}
        assert metric(w, "dynamo_component_encode_requests_total", ok) == 2


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"model": "nope", "data": PNG}, "unknown_model"),
        ({"model": "tiny"}, "bad_request"),
        ("not a map", "bad_request"),
        ({"model": "tiny", "data": PNG[:300]}, "corrupt"),
        ({"model": "tiny", "url": "http://10.0.0.1/x.png"}, "forbidden_address"),
    ],
)
async def test_dynamo_errors_are_typed(tiny, request_, code):
    async with run_worker(tiny, dynamo=True) as w:
        client = await client_for(w.dynamo.runtime)
        with pytest.raises(RemoteError) as e:
            await call_encode(client, request_)
        assert e.value.code == code
        assert (await call_encode(client, {"model": "tiny", "data": PNG})).body  # still serving


async def test_dynamo_graceful_shutdown_finishes_inflight(tiny):
    async with run_worker(tiny, dynamo=True) as w:
        client = await client_for(w.dynamo.runtime)
        gate = ForwardGate(w.service)
        call = asyncio.create_task(call_encode(client, {"model": "tiny", "data": PNG}))
        await wait_for(lambda: gate.entered == 1, what="the forward to start")
        stopping = asyncio.create_task(w.stop())
        await wait_for(lambda: w.service.draining, what="drain to begin")
        gate.release()
        reply = await call
        await stopping
        assert wire.decode(reply.body).mm_hash == reply.mm_hash


async def test_worker_process_serves_both_transports_and_deregisters_on_sigterm(tmp_path):
    system_port = dynamo_system_port()
    env = {**os.environ, "DYN_SYSTEM_PORT": str(system_port)}
    worker = await asyncio.to_thread(start_worker, "--dynamo", "--namespace", "t1", env=env,
                                     log=tmp_path / "worker.log", timeout=120)
    proc = worker.proc
    runtime = None
    try:
        http_port = worker.http_port
        runtime = make_runtime(asyncio.get_running_loop())
        client = await client_for(runtime, "t1")
        reply = await call_encode(client, {"model": "tiny", "data": PNG})
        async with aiohttp.ClientSession() as s:
            url = "data:image/png;base64," + base64.b64encode(PNG).decode()
            async with s.post(f"http://127.0.0.1:{http_port}/v1/encode", json={"model": "tiny", "url": url}) as r:
                assert r.status == 200 and await r.read() == reply.body
            async with s.get(f"http://127.0.0.1:{system_port}/metrics") as r:
                text = await r.text()
            labels = ('dynamo_component="mm_encoder",dynamo_endpoint="encode",dynamo_namespace="t1",outcome="ok",'
                      'transport="dynamo",worker_type="encode"')
            assert r.status == 200 and f"dynamo_component_encode_requests_total{{{labels}}} 1.0" in text
            async with s.get(f"http://127.0.0.1:{system_port}/health") as r:
                assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
        await wait_for(lambda: not client.instance_ids(), timeout=30, what="the instance to deregister")
    finally:
        proc.stop(signal.SIGKILL, group=True)
        if runtime is not None:
            runtime.shutdown()


async def test_dynamo_caller_stopping_drops_queued_work(tiny):
    """A Dynamo caller that stops its stream while the item is queued: the forward never runs."""
    from dynamo.runtime import Context

    async with run_worker(tiny, dynamo=True) as w:
        client = await client_for(w.dynamo.runtime)
        gate = ForwardGate(w.service)
        first = asyncio.create_task(call_encode(client, {"model": "tiny", "data": PNG}))
        await wait_for(lambda: gate.entered == 1, what="the first forward")
        other = image_bytes(natural_image(64, 48, seed=5))
        ctx = Context()

        async def second():
            async for _ in await client.round_robin({"model": "tiny", "data": other}, context=ctx):
                pass

        task = asyncio.create_task(second())
        await wait_for(lambda: metric(w, "dynamo_component_encode_queue_depth") == 1,
                       what="the second item to be queued")
        ctx.stop_generating()
        cancelled = {"transport": "dynamo", "outcome": "cancelled"}
        await wait_for(lambda: metric(w, "dynamo_component_encode_requests_total", cancelled) == 1,
                       what="the queued request to be cancelled")
        gate.release()
        assert (await first).body
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
        await wait_for(lambda: metric(w, "dynamo_component_encode_queue_depth") == 0,
                       what="the queue to empty")
        assert metric(w, "dynamo_component_encode_forward_items_total") == 1
