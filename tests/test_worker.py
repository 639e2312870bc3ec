"""The encode worker over real HTTP on loopback: results, caches, single-flight, backpressure, load signals,
cancellation, errors and graceful shutdown. Only the model is small (`tiny`, random weights)."""

from __future__ import annotations

import asyncio
import base64
import json
import math

import aiohttp
import msgpack
import pytest
import torch

from harness.media_factory import image_bytes, natural_image, video_bytes
from harness.worker_fixtures import ForwardGate, post_json, run_canary, run_origin, run_worker, url_for, wait_for
from harness.worker_fixtures import metric as worker_metric
from mm_encoder import wire
from mm_encoder.encode_worker.load import CapacityMeter
from mm_encoder.model.loading import default_device, default_dtype

PNG = image_bytes(natural_image(120, 90, seed=1))
PNG2 = image_bytes(natural_image(96, 64, seed=2))
LARGE_PNG = image_bytes(natural_image(448, 336, seed=2))

# The session's `tiny` is loaded without a dtype, so it runs in this machine's default: bf16 on CUDA and on
# CPUs with native bf16 (avx512_bf16 or amx_bf16), fp32 elsewhere (loading.default_dtype). With no
# --wire-dtype the worker packs its rows in that dtype, so the same test holds on either kind of CPU.
DEFAULT_DTYPE = default_dtype(default_device())
DEFAULT_WIRE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[DEFAULT_DTYPE]


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


REQUESTS = "dynamo_component_encode_requests_total"


def metric(worker, name: str, **labels) -> float:
    return worker_metric(worker, name, labels)


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def test_encode_data_url_matches_direct_encoder(tiny, session):
    async with run_worker(tiny) as w:
        status, headers, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
    assert status == 200, body
    assert headers["Content-Type"] == wire.CONTENT_TYPE
    msg = wire.decode(body)
    direct = tiny.encode([PNG])[0]
    assert tiny.steps.dtype == DEFAULT_DTYPE
    assert msg.mm_hash == headers["X-MM-Hash"] == direct.mm_hash
    assert msg.model == "tiny" and msg.modality == "image" and msg.dtype == DEFAULT_WIRE
    assert msg.grid_thws == (tuple(direct.grid_thw),) and msg.shape == (direct.num_tokens, 256)
    assert msg.embeds.dtype == DEFAULT_DTYPE and torch.equal(msg.embeds, direct.embeds.to(DEFAULT_DTYPE))
    stages = {part.split(";")[0].strip() for part in headers["Server-Timing"].split(",")}
    assert {"decode", "preprocess", "queue", "forward", "pack", "total", "cache"} <= stages


async def test_msgpack_bytes_request_and_video(tiny, session):
    clip = video_bytes(frames=40, fps=10)  # 4 s at 2 fps: 8 frames, 2 chunks
    async with run_worker(tiny) as w:
        req = msgpack.packb({"model": "TINY", "data": clip, "modality": "video"})
        async with session.post(url_for(w), data=req, headers={"Content-Type": "application/msgpack"}) as r:
            assert r.status == 200, await r.text()
            msg = wire.decode(await r.read())
    direct = tiny.encode_file(clip)
    assert msg.modality == "video" and len(msg.grid_thws) == len(direct) == 2
    assert msg.timestamps == tuple(d.timestamp for d in direct)
    assert msg.dtype == DEFAULT_WIRE and msg.embeds.dtype == DEFAULT_DTYPE
    assert torch.equal(msg.embeds, torch.cat([d.embeds for d in direct]).to(DEFAULT_DTYPE))


async def test_same_request_gives_byte_identical_bodies_without_caches(tiny, session):
    async with run_worker(tiny, cache_bytes=0, alias_cache_entries=0) as w:
        urls = [data_url(PNG), data_url(PNG).replace("data:", "DATA:", 1)]  # schemes are case-insensitive
        bodies = [(await post_json(session, w, {"model": "tiny", "url": url}))[2] for url in urls]
        assert metric(w, "dynamo_component_encode_forward_items_total") == 2  # computed twice, not cached
        assert metric(w, "dynamo_component_encode_fetches_total") == 0  # inline data is not a download
    assert bodies[0] == bodies[1]


async def test_legacy_json_base64_on_accept(tiny, session):
    async with run_worker(tiny) as w:
        _, _, v1 = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        status, headers, body = await post_json(
            session, w, {"model": "tiny", "url": data_url(PNG)}, Accept="application/json"
        )
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    legacy, new = wire.decode_json(body), wire.decode(v1)
    assert legacy.mm_hash == new.mm_hash and torch.equal(legacy.embeds, new.embeds)
    assert len(body) > len(v1)


async def test_single_flight_url(tiny, session):
    """16 identical URL requests while the origin is held: 1 download, 1 forward, 15 coalesced."""
    async with run_origin() as origin:
        origin.files["a.png"] = PNG
        origin.gate = asyncio.Event()
        async with run_worker(tiny, fetch_allow_hosts=[origin.allow]) as w:
            payload = {"model": "tiny", "url": origin.url("a.png")}
            tasks = [asyncio.create_task(post_json(session, w, payload)) for _ in range(16)]
            await wait_for(lambda: metric(w, "dynamo_component_encode_inflight_requests") == 16 and origin.waiting == 1,
                           what="16 requests in flight")
            assert origin.hits["a.png"] == 1
            origin.gate.set()
            results = await asyncio.gather(*tasks)
            assert {r[0] for r in results} == {200}
            assert len({r[2] for r in results}) == 1
            assert origin.hits["a.png"] == 1
            assert metric(w, "dynamo_component_encode_fetches_total") == 1
            assert metric(w, "dynamo_component_encode_forward_items_total") == 1
            assert metric(w, "dynamo_component_encode_coalesced_total", stage="fetch") == 15
            assert sorted(r[1]["X-MM-Cache"] for r in results).count("coalesced") == 15


async def test_single_flight_same_content_under_sixteen_urls(tiny, session):
    """Different URLs, same bytes: 16 downloads but one forward (coalesced or cached on mm_hash)."""
    async with run_origin() as origin:
        for i in range(16):
            origin.files[f"{i}.png"] = PNG
        origin.gate = asyncio.Event()
        async with run_worker(tiny, fetch_allow_hosts=[origin.allow]) as w:
            tasks = [
                asyncio.create_task(post_json(session, w, {"model": "tiny", "url": origin.url(f"{i}.png")}))
                for i in range(16)
            ]
            await wait_for(lambda: origin.waiting == 16, what="16 downloads held")
            origin.gate.set()
            results = await asyncio.gather(*tasks)
            assert {r[0] for r in results} == {200} and len({r[2] for r in results}) == 1
            assert metric(w, "dynamo_component_encode_fetches_total") == 16
            assert metric(w, "dynamo_component_encode_forward_items_total") == 1


async def test_alias_and_mm_hash_hits_skip_their_work(tiny, session):
    async with run_origin() as origin:
        origin.files["a.png"] = origin.files["b.png"] = PNG
        async with run_worker(tiny, fetch_allow_hosts=[origin.allow]) as w:
            first = await post_json(session, w, {"model": "tiny", "url": origin.url("a.png")})
            again = await post_json(session, w, {"model": "tiny", "url": origin.url("a.png")})
            assert first[1]["X-MM-Cache"] == "forward" and again[1]["X-MM-Cache"] == "alias"
            assert origin.hits["a.png"] == 1 and first[2] == again[2]  # alias hit: no download

            other_url = await post_json(session, w, {"model": "tiny", "url": origin.url("b.png")})
            assert other_url[1]["X-MM-Cache"] == "mm_hash" and origin.hits["b.png"] == 1
            other_scope = await post_json(session, w, {"model": "tiny", "url": origin.url("a.png"), "scope": "t2"})
            # a scope (a tenant's, `security.tenants`) shares no entry with another: neither the URL's
            # alias nor the body of the same pixels; within the scope, the same pixels are a hit again
            assert other_scope[1]["X-MM-Cache"] == "forward" and origin.hits["a.png"] == 2
            same_scope = await post_json(session, w, {"model": "tiny", "url": origin.url("b.png"), "scope": "t2"})
            assert same_scope[1]["X-MM-Cache"] == "mm_hash" and same_scope[2] == other_scope[2] == first[2]
            smaller = await post_json(
                session, w, {"model": "tiny", "url": origin.url("a.png"), "processor": {"in_patch_limit": 16}}
            )
            assert smaller[1]["X-MM-Cache"] == "forward"  # processor settings are part of the identity
            assert wire.decode(smaller[2]).length < wire.decode(first[2]).length

            assert metric(w, "dynamo_component_encode_forward_items_total") == 3
            assert metric(w, "dynamo_component_embedding_cache_hits_total", level="alias") == 1
            assert metric(w, "dynamo_component_embedding_cache_hits_total", level="mm_hash") == 3
            async with session.get(url_for(w, "/metrics")) as r:
                text = await r.text()
            dynamo = 'dynamo_component="mm_encoder",dynamo_endpoint="encode",dynamo_namespace="mm"'
            assert (f'dynamo_component_embedding_cache_hits_total{{{dynamo},level="alias",'
                    'worker_type="encode"} 1.0') in text
            assert (f'dynamo_component_encode_stage_duration_seconds_count{{{dynamo},stage="forward",'
                    'worker_type="encode"} 3.0') in text
            assert 'mm_encoder_cache_hits_total{level="alias"} 1.0' in text  # 0.2's name, until 0.4


async def test_full_queue_gives_503_and_hits_still_served(tiny, session):
    async with run_origin() as origin:
        origin.files["slow.png"] = PNG
        origin.gate = asyncio.Event()
        async with run_worker(tiny, max_pending=1, retry_after_s=2, fetch_allow_hosts=[origin.allow]) as w:
            cached = await post_json(session, w, {"model": "tiny", "url": data_url(PNG2)})
            held = asyncio.create_task(post_json(session, w, {"model": "tiny", "url": origin.url("slow.png")}))
            await wait_for(lambda: origin.waiting == 1, what="the first download to be held")
            status, headers, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
            assert status == 503 and headers["Retry-After"] == "2"
            assert json.loads(body)["error"]["code"] == "overloaded"
            hit = await post_json(session, w, {"model": "tiny", "url": data_url(PNG2)})
            assert hit[0] == 200 and hit[2] == cached[2]  # cache hits need no queue slot
            origin.gate.set()
            assert (await held)[0] == 200
            assert (await post_json(session, w, {"model": "tiny", "url": data_url(PNG)}))[0] == 200
            assert metric(w, "dynamo_component_encode_rejected_total", reason="overloaded") == 1


async def test_cancelled_request_never_reaches_the_device(tiny):
    async with run_worker(tiny) as w:
        gate = ForwardGate(w.service)
        async with aiohttp.ClientSession() as s1, aiohttp.ClientSession() as s2:
            first = asyncio.create_task(post_json(s1, w, {"model": "tiny", "url": data_url(PNG)}))
            await wait_for(lambda: gate.entered == 1, what="the first forward to start")
            second = asyncio.create_task(post_json(s2, w, {"model": "tiny", "url": data_url(PNG2)}))
            await wait_for(lambda: metric(w, "dynamo_component_encode_queue_depth") == 1,
                           what="the second item to be queued")
            second.cancel()  # the client goes away ...
            await s2.close()
            await wait_for(lambda: metric(w, REQUESTS, transport="http", outcome="cancelled") == 1,
                           what="the queued request to be cancelled")
            gate.release()
            assert (await first)[0] == 200
            await wait_for(lambda: metric(w, "dynamo_component_encode_queue_depth") == 0, what="the queue to empty")
        assert metric(w, "dynamo_component_encode_forward_items_total") == 1  # ... and its forward never ran
        assert metric(w, "dynamo_component_encode_requests_total", transport="http", outcome="cancelled") == 1


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        ({"model": "nope", "url": data_url(PNG)}, 404, "unknown_model"),
        ({"model": "tiny"}, 400, "bad_request"),
        ({"model": "tiny", "url": data_url(PNG), "data": "x"}, 400, "bad_request"),
        ({"model": "tiny", "url": data_url(PNG), "extra": 1}, 400, "bad_request"),
        ({"model": "tiny", "url": data_url(PNG), "processor": {"in_patch_limit": 10**9}}, 400, "bad_request"),
        ({"model": "tiny", "url": data_url(PNG), "modality": "video"}, 422, "bad_input"),
        ({"model": "tiny", "url": data_url(PNG[:300])}, 422, "corrupt"),
        ({"model": "tiny", "url": data_url(b"")}, 422, "empty"),
        ({"model": "tiny", "url": "ftp://example.com/a.png"}, 400, "forbidden_scheme"),
        ({"model": "tiny", "url": "http://127.0.0.1:9/a.png"}, 403, "forbidden_address"),
        ({"model": "tiny", "url": "http://169.254.169.254/latest/meta-data"}, 403, "forbidden_address"),
    ],
)
async def test_bad_requests_get_typed_errors_and_are_not_cached(tiny, session, payload, status, code):
    async with run_worker(tiny) as w:
        for _ in range(2):  # the same error twice: nothing was cached
            got, headers, body = await post_json(session, w, payload)
            err = json.loads(body)["error"]
            assert (got, err["code"]) == (status, code), err
            assert headers["Content-Type"].startswith("application/json") and err["message"]
        if code == "unknown_model":
            assert "tiny" in err["message"]
        assert len(w.service.bodies) == 0 and len(w.service.alias) == 0
        ok = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        assert ok[0] == 200  # and the worker keeps serving


FORBIDDEN_HOSTS = [
    "127.0.0.1", "localhost", "2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::ffff:127.0.0.1]",
    "0.0.0.0", "[::1]", "10.0.0.1", "100.64.0.1", "169.254.169.254", "[fd00:ec2::254]",
]


async def test_forbidden_addresses_refused_and_canary_sees_nothing(tiny, session):
    """Through the worker: every spelling of an internal address, and a redirect from an allowed
    origin to the canary, is refused with 403 before any connection is made."""
    async with run_canary() as canary, run_origin() as origin:
        origin.redirects["hop"] = f"http://127.0.0.1:{canary.port}/x.png"
        async with run_worker(tiny, fetch_allow_hosts=[origin.allow]) as w:
            urls = [f"http://{host}:{canary.port}/x.png" for host in FORBIDDEN_HOSTS] + [origin.url("hop")]
            for url in urls:
                status, _, body = await post_json(session, w, {"model": "tiny", "url": url})
                assert status in (400, 403), (url, body)
                assert json.loads(body)["error"]["code"] in ("forbidden_address", "bad_url"), (url, body)
            assert origin.hits["hop"] == 1
            assert await canary.settled_count() == 0
            assert len(w.service.alias) == 0 and len(w.service.bodies) == 0
            assert (await post_json(session, w, {"model": "tiny", "url": data_url(PNG)}))[0] == 200


async def test_non_json_bodies_and_unknown_routes(tiny, session):
    async with run_worker(tiny, max_body_bytes=4096) as w:
        async with session.post(url_for(w), data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "bad_request"
        async with session.post(url_for(w), data=b"\xc1", headers={"Content-Type": "application/msgpack"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "bad_request"
        async with session.post(url_for(w), data=b"x", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 400
        big = msgpack.packb({"model": "tiny", "data": b"\0" * 10_000})
        async with session.post(url_for(w), data=big, headers={"Content-Type": "application/msgpack"}) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
        async with session.get(url_for(w, "/nope")) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_health_ready_models_metrics(tiny, session):
    async with run_worker(tiny) as w:
        async with session.get(url_for(w, "/health")) as r:
            assert r.status == 200
        async with session.get(url_for(w, "/ready")) as r:
            assert r.status == 200 and (await r.json())["model"] == "tiny"
        async with session.get(url_for(w, "/v1/models")) as r:
            data = (await r.json())["data"]
            assert data[0]["id"] == "tiny" and data[0]["out_dim"] == 256
        async with session.get(url_for(w, "/metrics")) as r:
            text = await r.text()
            assert "dynamo_component_encode_pending_items" in text
            assert "dynamo_component_embedding_cache_current_bytes" in text


async def test_graceful_shutdown_loses_no_inflight_response(tiny, session):
    async with run_worker(tiny) as w:
        gate = ForwardGate(w.service)
        payloads = [{"model": "tiny", "url": data_url(img)} for img in (PNG, PNG2)]
        tasks = [asyncio.create_task(post_json(session, w, p)) for p in payloads]
        await wait_for(lambda: metric(w, "dynamo_component_encode_inflight_requests") == 2,
                       what="two requests in flight")
        stopping = asyncio.create_task(w.stop())
        await wait_for(lambda: w.service.draining, what="drain to begin")
        refused = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        assert refused[0] == 503 and json.loads(refused[2])["error"]["code"] == "draining"
        async with session.get(url_for(w, "/ready")) as r:
            assert r.status == 503
        gate.release()
        results = await asyncio.gather(*tasks)
        await stopping
        assert [r[0] for r in results] == [200, 200]
        for (_, headers, body) in results:
            assert wire.decode(body).mm_hash == headers["X-MM-Hash"]


@pytest.mark.parametrize(("limit", "forwards"), [(8192, 2), (1, 4)])
async def test_queued_items_share_a_forward_up_to_the_patch_limit(tiny, session, limit, forwards):
    """While one forward runs, three more items queue; they go in one forward if they fit under
    `batch_max_patches`, else one forward each (a big item fills the device alone)."""
    async with run_worker(tiny, batch_max_patches=limit) as w:
        gate = ForwardGate(w.service)
        imgs = [image_bytes(natural_image(64 + 8 * i, 48, seed=10 + i)) for i in range(4)]
        first = asyncio.create_task(post_json(session, w, {"model": "tiny", "url": data_url(imgs[0])}))
        await wait_for(lambda: gate.entered == 1, what="the first forward")
        rest = [asyncio.create_task(post_json(session, w, {"model": "tiny", "url": data_url(i)})) for i in imgs[1:]]
        await wait_for(lambda: metric(w, "dynamo_component_encode_queue_depth") == 3, what="three queued items")
        gate.release()
        results = await asyncio.gather(first, *rest)
        assert [r[0] for r in results] == [200] * 4
        assert metric(w, "dynamo_component_encode_forwards_total") == forwards
        assert metric(w, "dynamo_component_encode_forward_items_total") == 4
        for img, (_, _, body) in zip(imgs, results, strict=True):  # batching never mixes items up
            msg = wire.decode(body)
            assert msg.dtype == DEFAULT_WIRE and msg.embeds.dtype == DEFAULT_DTYPE
            assert torch.equal(msg.embeds, tiny.encode([img])[0].embeds.to(DEFAULT_DTYPE))


def test_batch_composition_does_not_change_bits_on_cpu(tiny):
    """An item's embeddings are bit-identical alone or packed with others (CPU), so a body does not
    depend on what else was queued. On CUDA, kernels chosen per batch shape may differ in the last
    bit; there the mm_hash cache, not recomputation, keeps answers stable."""
    items = [tiny.preprocess_item(image_bytes(natural_image(w, h, seed=s)))
             for w, h, s in ((120, 90, 1), (640, 480, 2))]
    alone = tiny.forward(items[:1])[0][0]
    for batch in ([items[1], items[0]], [items[0], items[1]]):
        outputs = tiny.forward(batch)[0]
        assert torch.equal(outputs[[p is items[0] for p in batch].index(True)], alone)


async def test_a_request_for_another_checkpoints_revision_is_refused(checkpoint, ckpt_encoder, session):
    """The frontend reads its checkpoint's revision (`ModelCard`: a content id of config.json and the
    tensor index) exactly as the encode worker computes its own; a request naming another revision
    (a frontend pointed at another checkpoint) is a 409, never another model's embeddings, and the
    tiers' cache key differs with the revision, so a cache never answers for another checkpoint."""
    from mm_encoder.core.requests import EncodeRequest
    from mm_encoder.families.model_card import ModelCard

    revision = ModelCard.read(checkpoint).revision
    assert revision == ckpt_encoder.steps.spec.revision and revision.startswith("ckpt-")
    async with run_worker(ckpt_encoder) as w:
        ok = {"model": "kimi-k2.5-vision", "url": data_url(PNG), "revision": revision}
        status, _, body = await post_json(session, w, ok)
        assert status == 200, body
        status, _, body = await post_json(session, w, {**ok, "revision": "ckpt-0000000000000000"})
    assert status == 409 and json.loads(body)["error"]["code"] == "revision_mismatch"
    a = EncodeRequest(model="kimi-k2.5-vision", url="https://m.test/a.png", revision=revision)
    assert a.key() != a.model_copy(update={"revision": "ckpt-0000000000000000"}).key()
    assert a.model_copy(update={"revision": None}).key() == EncodeRequest(model="kimi-k2.5-vision",
                                                                     url="https://m.test/a.png").key()


async def test_rows_leave_in_the_dtype_the_model_runs_in_unless_the_operator_says_otherwise(session):
    """`--dtype fp32` is fp32 from the tower to the engine: with no `--wire-dtype` the worker packs the
    dtype its model ran in, so the fp32 rows arrive bit for bit (bf16 stays bf16: no extra bytes).
    An explicit `--wire-dtype` still wins; a request naming another dtype is a 409 `dtype_mismatch`."""
    from mm_encoder.model.encoder import Encoder

    fp32 = Encoder.from_pretrained("tiny", dtype="fp32")
    direct = fp32.encode([PNG])[0].embeds
    assert direct.dtype == torch.float32
    async with run_worker(fp32) as w:
        status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        assert status == 200, body
        msg = wire.decode(body)
        assert msg.dtype == "float32" and torch.equal(msg.embeds, direct)
        status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG), "dtype": "float32"})
        assert status == 200 and wire.decode(body).dtype == "float32"
        status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG), "dtype": "bfloat16"})
        assert status == 409 and json.loads(body)["error"]["code"] == "dtype_mismatch"
        status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG), "dtype": "fp32"})
        assert status == 400 and "dtype" in json.loads(body)["error"]["message"]
    async with run_worker(fp32, wire_dtype="bfloat16") as w:
        status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        assert status == 200 and wire.decode(body).dtype == "bfloat16"
        assert torch.equal(wire.decode(body).embeds, direct.to(torch.bfloat16))


# --- load signals (encode_worker/load.py): what an encode planner reads, counted in patches ---


async def test_demand_throughput_and_capacity_are_counted_in_patches(tiny, session):
    """Before any request the capacity is the start-up probe's (one forward of a 448x448 image);
    each item admitted past the caches adds its planned patches to the demand, each forward its
    patches and seconds; the capacity is then the live forwards' patches per forward second. A
    repeat is a cache hit: no demand, no forward."""
    async with run_worker(tiny) as w:
        await wait_for(lambda: w.service.metrics.capacity.probed is not None, timeout=30, what="the capacity probe")
        probed = w.service.metrics.capacity.probed
        assert probed > 0 and metric(w, "dynamo_component_encode_capacity_patches_per_second") == probed
        assert metric(w, "dynamo_component_encode_forwards_total") == 0  # the probe is not a request's forward
        for data in (PNG, LARGE_PNG):
            status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(data)})
            assert status == 200, body
        patches = [tiny.plan(PNG).patches, tiny.plan(LARGE_PNG).patches]
        assert patches[1] > 4 * patches[0]  # what a request costs is its patches, not its count
        assert metric(w, "dynamo_component_encode_patches_admitted_total") == sum(patches)
        assert metric(w, "dynamo_component_encode_patches_encoded_total") == sum(patches)
        assert metric(w, "dynamo_component_encode_queue_wait_seconds_count") == 2
        busy = metric(w, "dynamo_component_encode_forward_seconds_total")
        assert busy > 0
        assert metric(w, "dynamo_component_encode_capacity_patches_per_second") == pytest.approx(sum(patches) / busy)
        status, _, _ = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        assert status == 200
        assert metric(w, "dynamo_component_encode_patches_admitted_total") == sum(patches)
        assert metric(w, "dynamo_component_encode_forwards_total") == 2
        # on /metrics with the labels Dynamo's own component metrics carry
        async with session.get(url_for(w, "/metrics")) as r:
            text = await r.text()
        labels = 'dynamo_component="mm_encoder",dynamo_endpoint="encode",dynamo_namespace="mm",worker_type="encode"'
        assert f"dynamo_component_encode_patches_admitted_total{{{labels}}} {float(sum(patches))}" in text
        # and as one map, what the planner reads over Dynamo (<namespace>.mm_encoder.load)
        load = w.service.metrics.load(draining=False)
        assert load["patches_admitted"] == load["patches_encoded"] == sum(patches)
        assert load["forward_seconds"] == busy and load["queue_depth"] == 0 and not load["draining"]
        assert load["capacity_pps"] == pytest.approx(sum(patches) / busy)
        assert load["queue_wait_buckets"][-1] == [math.inf, 2.0] and load["rejected"] == {"overloaded": 0.0,
                                                                                          "draining": 0.0}


async def test_without_the_probe_the_capacity_is_unknown_until_a_forward(tiny, session):
    async with run_worker(tiny, capacity_probe=False) as w:
        assert math.isnan(metric(w, "dynamo_component_encode_capacity_patches_per_second"))
        status, _, body = await post_json(session, w, {"model": "tiny", "url": data_url(PNG)})
        assert status == 200, body
        assert metric(w, "dynamo_component_encode_capacity_patches_per_second") == pytest.approx(
            tiny.plan(PNG).patches / metric(w, "dynamo_component_encode_forward_seconds_total"))


def test_the_capacity_weighs_forwards_by_their_patches_over_a_window():
    meter = CapacityMeter(window=3)
    assert math.isnan(meter.patches_per_second)
    meter.probed = 500.0
    assert meter.patches_per_second == 500.0
    meter.observe(1000, 1.0)
    meter.observe(10, 1.0)  # a small batch: one of two seconds, not half the vote on the rate
    assert meter.patches_per_second == 505.0
    meter.observe(0, 0.5)  # nothing encoded (or no time): not a measurement
    meter.observe(2000, 1.0)
    meter.observe(3000, 1.0)  # the window keeps the last three
    assert meter.patches_per_second == 5010 / 3
