"""Tenants and models never see each other's entries, at any cache level: the worker's URL alias
(scope), its mm_hash cache (content + model), the nginx tier (X-Cache-Key: model, processor, URL,
scope, modality). A real worker (the tiny Kimi-K2.5 checkpoint's vision tower, model
`kimi-k2.5-vision`) behind a real cluster tier; the media origin on loopback changes what one URL
serves between requests, as a per-tenant URL behind auth would."""

from __future__ import annotations

import pytest

from harness.media_factory import image_bytes, natural_image
from harness.topology import require_nginx, tiers
from harness.worker_fixtures import SPEC, run_origin, run_worker
from mm_encoder.client import EncoderChain
from mm_encoder.core.errors import RemoteError
from mm_encoder.core.requests import EncodeRequest

A = image_bytes(natural_image(112, 84, seed=51))
B = image_bytes(natural_image(112, 84, seed=52))


@pytest.fixture
async def chain(ckpt_encoder, tmp_path):
    require_nginx()
    async with run_origin() as origin, run_worker(ckpt_encoder, fetch_allow_hosts=[origin.allow]) as w, \
            tiers() as start:
        tier = await start(tmp_path, "cluster", "cluster", "--next", f"127.0.0.1:{w.http_port}")
        c = EncoderChain(http_url=tier.url(""), route="cluster")
        try:
            yield origin, w, c
        finally:
            await c.close()


async def test_one_url_for_two_tenants_is_two_entries_at_every_level(chain):
    """One URL under two scopes: each is fetched and encoded on its own (2 origin hits), and each
    scope's repeat is a tier HIT with its own mm_hash."""
    origin, _, c = chain
    url = origin.url("per-tenant.png")
    origin.files["per-tenant.png"] = A
    a, where = await c.describe(EncodeRequest(model=SPEC, url=url, scope="tenant-a"))
    assert where == "http:cluster=MISS"
    origin.files["per-tenant.png"] = B  # what tenant b is served at the same URL
    b, where = await c.describe(EncodeRequest(model=SPEC, url=url, scope="tenant-b"))
    assert where == "http:cluster=MISS" and b.mm_hash != a.mm_hash  # its own fetch, not a's entry
    again, where = await c.describe(EncodeRequest(model=SPEC, url=url, scope="tenant-a"))
    assert where == "http:cluster=HIT" and again.mm_hash == a.mm_hash
    assert origin.hits["per-tenant.png"] == 2


async def test_an_entry_for_one_model_never_answers_another(chain):
    """A cached entry for the checkpoint's model does not answer a request for another model: the
    worker's 404 `unknown_model` comes through; the first model's entry still HITs."""
    origin, _, c = chain
    origin.files["m.png"] = A
    url = origin.url("m.png")
    mine, _ = await c.describe(EncodeRequest(model=SPEC, url=url))
    with pytest.raises(RemoteError) as e:  # this worker serves the checkpoint's model only: a shared entry would 200
        await c.describe(EncodeRequest(model="tiny", url=url))
    assert e.value.code == "unknown_model" and e.value.http_status == 404
    same, where = await c.describe(EncodeRequest(model=SPEC, url=url))
    assert where == "http:cluster=HIT" and same.mm_hash == mine.mm_hash


async def test_the_same_bytes_under_two_modalities_are_two_entries(chain):
    """Bytes cached as an image are not served as a video: the video request reaches the worker
    and gets its own 422 `bad_input`."""
    origin, _, c = chain
    origin.files["x.png"] = A
    url = origin.url("x.png")
    await c.describe(EncodeRequest(model=SPEC, url=url, modality="image"))
    with pytest.raises(RemoteError) as e:
        await c.describe(EncodeRequest(model=SPEC, url=url, modality="video"))
    assert e.value.code == "bad_input"
