"""The encode worker's load signals (`encode_worker/load.py`): what an encode planner reads, counted
in patches, read from a real worker's metrics over HTTP on loopback (`tiny`, random weights)."""

from __future__ import annotations

import base64
import math

import aiohttp
import pytest

from harness.media_factory import image_bytes, natural_image
from harness.worker_fixtures import post_json, run_worker, wait_for
from mm_encoder.encode_worker.load import CapacityMeter

SMALL = image_bytes(natural_image(120, 90, seed=1))
LARGE = image_bytes(natural_image(448, 336, seed=2))


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def metric(worker, name: str, **labels) -> float:
    return worker.service.metrics.value(name, labels)


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def test_demand_throughput_and_capacity_are_counted_in_patches(tiny, session):
    """Before any request the capacity is the start-up probe's (one forward of a 448x448 image);
    each item admitted past the caches adds its planned patches to the demand, each forward its
    patches and seconds; the capacity is then the live forwards' patches per forward second. A
    repeat is a cache hit: no demand, no forward."""
    async with run_worker(tiny) as w:
        await wait_for(lambda: w.service.metrics.capacity.probed is not None, timeout=30, what="the capacity probe")
        probed = w.service.metrics.capacity.probed
        assert probed > 0 and metric(w, "mm_encoder_capacity_patches_per_second") == probed
        assert metric(w, "mm_encoder_forwards_total") == 0  # the probe is not a request's forward
        for data in (SMALL, LARGE):
            status, _, body = await post_json(session, w, {"model": "tiny", "url": _url(data)})
            assert status == 200, body
        patches = [tiny.plan(SMALL).patches, tiny.plan(LARGE).patches]
        assert patches[1] > 4 * patches[0]  # what a request costs is its patches, not its count
        assert metric(w, "mm_encoder_patches_admitted_total") == sum(patches)
        assert metric(w, "mm_encoder_patches_encoded_total") == sum(patches)
        assert metric(w, "mm_encoder_queue_wait_seconds_count") == 2
        busy = metric(w, "mm_encoder_forward_seconds_total")
        assert busy > 0
        assert metric(w, "mm_encoder_capacity_patches_per_second") == pytest.approx(sum(patches) / busy)
        status, _, _ = await post_json(session, w, {"model": "tiny", "url": _url(SMALL)})
        assert status == 200
        assert metric(w, "mm_encoder_patches_admitted_total") == sum(patches)
        assert metric(w, "mm_encoder_forwards_total") == 2


async def test_without_the_probe_the_capacity_is_unknown_until_a_forward(tiny, session):
    async with run_worker(tiny, capacity_probe=False) as w:
        assert math.isnan(metric(w, "mm_encoder_capacity_patches_per_second"))
        status, _, body = await post_json(session, w, {"model": "tiny", "url": _url(SMALL)})
        assert status == 200, body
        assert metric(w, "mm_encoder_capacity_patches_per_second") == pytest.approx(
            tiny.plan(SMALL).patches / metric(w, "mm_encoder_forward_seconds_total"))


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
