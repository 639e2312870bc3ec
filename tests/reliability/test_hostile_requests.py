"""Hostile requests against a real encode worker (aiohttp on loopback, serving the tiny Kimi-K2.5
checkpoint's vision tower as `kimi-k2.5-vision`): what a stranger can send besides media. Each
test names the defect it keeps fixed (issue 13's numbering)."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import msgpack
import pytest

from harness.media_factory import image_bytes, natural_image
from harness.worker_fixtures import SPEC, post_json, run_origin, run_worker, url_for

PNG = image_bytes(natural_image(112, 84, seed=41))


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def test_5_the_url_alias_answers_a_wrong_modality_as_a_miss_would(ckpt_encoder, session):
    async with run_origin() as origin, run_worker(ckpt_encoder, fetch_allow_hosts=[origin.allow]) as w:
        origin.files["a.png"] = PNG
        url = origin.url("a.png")
        status, _, body = await post_json(session, w, {"model": SPEC, "url": url, "modality": "video"})
        assert status == 422 and json.loads(body)["error"]["code"] == "bad_input"  # uncached
        status, headers, _ = await post_json(session, w, {"model": SPEC, "url": url})
        assert status == 200 and headers["X-MM-Cache"] == "forward"
        status, _, body = await post_json(session, w, {"model": SPEC, "url": url, "modality": "video"})
        assert status == 422 and json.loads(body)["error"]["code"] == "bad_input"  # cached: the same answer
        status, headers, _ = await post_json(session, w, {"model": SPEC, "url": url, "modality": "image"})
        assert status == 200 and headers["X-MM-Cache"] == "alias"


async def test_10_json_bodies_refuse_data_and_msgpack_refuses_bytes_for_names(ckpt_encoder, session):
    async with run_worker(ckpt_encoder) as w:
        status, _, body = await post_json(session, w, {"model": SPEC, "data": "aGVsbG8="})
        assert status == 400 and "`data` is for msgpack" in json.loads(body)["error"]["message"]
        packed = msgpack.packb({"model": SPEC.encode(), "data": PNG}, use_bin_type=True)
        async with session.post(url_for(w), data=packed, headers={"Content-Type": "application/msgpack"}) as r:
            err = json.loads(await r.read())["error"]
        assert r.status == 400 and "model" in err["message"] and "string" in err["message"]
        packed = msgpack.packb({"model": SPEC, "data": PNG}, use_bin_type=True)
        async with session.post(url_for(w), data=packed, headers={"Content-Type": "application/msgpack"}) as r:
            assert r.status == 200


async def test_10_a_half_sent_request_is_closed_after_the_idle_timeout(ckpt_encoder):
    async with run_worker(ckpt_encoder, idle_timeout_s=1.0) as w:
        held = []
        for _ in range(20):  # many slow clients, each with an incomplete header
            reader, writer = await asyncio.open_connection("127.0.0.1", w.http_port)
            writer.write(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            await writer.drain()
            held.append((reader, writer))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for reader, writer in held:
            assert await asyncio.wait_for(reader.read(100), 10) == b""  # the worker closed it
            writer.close()
        assert loop.time() - t0 < 5


async def test_3_bodies_are_admitted_by_bytes_before_they_are_read(ckpt_encoder, session):
    """Two bodies of 1.5 MB against a 2 MB receiving budget: the second gets 503 `overloaded`
    with Retry-After from its headers alone, while the first is still arriving."""
    async with run_worker(ckpt_encoder, max_receiving_bytes=2_000_000, max_body_bytes=1_600_000) as w:
        _, writer = await asyncio.open_connection("127.0.0.1", w.http_port)
        writer.write(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                     b"Content-Length: 1500000\r\n\r\n" + b"\x80" * 1000)  # a slow body: 1,000 of 1.5 M bytes
        await writer.drain()
        big = b"\x80" * 1_500_000
        for _ in range(50):  # until the first request's reservation is in place (its headers were parsed)
            async with session.post(url_for(w), data=big, headers={"Content-Type": "application/msgpack"}) as r:
                status, headers, body = r.status, r.headers, await r.read()
            if status == 503:
                break
        assert status == 503 and json.loads(body)["error"]["code"] == "overloaded" and "Retry-After" in headers
        writer.close()
        await writer.wait_closed()
        for _ in range(50):  # the first connection's reservation is released when it goes away
            async with session.post(url_for(w), data=msgpack.packb({"model": SPEC, "data": PNG}),
                                    headers={"Content-Type": "application/msgpack"}) as r:
                if r.status == 200:
                    break
        assert r.status == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP "])
async def test_compressed_bodies_are_refused_before_they_are_inflated(ckpt_encoder, session, encoding):
    """Beyond issue 13: aiohttp inflates a gzip/deflate request body as it reads it, so a 200 KB
    body holding 200 MB of zeros passed the bytes admitted from its Content-Length."""
    bomb = gzip.compress(bytes(200 * 1024 * 1024), 9)
    assert len(bomb) < 300_000
    async with run_worker(ckpt_encoder) as w:
        async with session.post(url_for(w), data=bomb, headers={"Content-Type": "application/msgpack",
                                                                "Content-Encoding": encoding}) as r:
            err = json.loads(await r.read())["error"]
        assert (r.status, err["code"]) == (415, "unsupported_encoding")


@pytest.mark.parametrize("name, body, ctype, status, message", [
    ("nested msgpack", b"\x91" * 200_000 + b"\xc0", "application/msgpack", 400, "does not decode"),
    ("nested JSON", b"[" * 200_000 + b"]" * 200_000, "application/json", 400, "recursion limit"),
    ("a 100,000-digit number", b'{"model": "kimi-k2.5-vision", "url": "data:,", "scope": ' + b"9" * 100_000 + b"}",
     "application/json", 400, "number out of range"),
    ("a key twice, JSON", b'{"model": "kimi-k2.5-vision", "model": "x", "url": "data:,"}', "application/json", 400,
     "names 'model' more than once"),
    ("a key twice, msgpack", b"\x83\xa5model\xa4tiny\xa5model\xa1x\xa3url\xa5data:", "application/msgpack", 400,
     "names 'model' more than once"),
    ("a msgpack ext type for bytes", msgpack.packb({"model": SPEC, "data": msgpack.ExtType(5, b"x")}),
     "application/msgpack", 400, "data"),
    ("an integer map key", msgpack.packb({1: 2}), "application/msgpack", 400, "not allowed for map key"),
    ("a 2 MB URL", json.dumps({"model": SPEC, "url": "http://example.com/" + "a" * 2_000_000}).encode(),
     "application/json", 400, "URL"),
    ("an empty body", b"", "application/json", 400, "EOF"),
    ("text/plain", b"abc", "text/plain", 400, "Content-Type must be"),
    ("a negative processor setting", json.dumps({"model": SPEC, "url": "data:,",
                                                 "processor": {"video_fps": -1}}).encode(),
     "application/json", 400, "processor.video_fps"),
])
async def test_hostile_bodies_get_a_typed_4xx(ckpt_encoder, session, name, body, ctype, status, message):
    async with run_worker(ckpt_encoder) as w:
        async with session.post(url_for(w), data=body, headers={"Content-Type": ctype}) as r:
            err = json.loads(await r.read())["error"]
        assert r.status == status and message in err["message"], (name, err)
