"""A model cluster whose encoder site goes away: real `mm-encoder serve`s of graphs/encoder-site.yaml
and graphs/model-cluster.yaml on two hosts (network namespaces, TLS), the site's link cut under a
small bounded load and restored. The cluster tier's breaker (`--site-breaker`, docs/cache-tiers.md
"An encoder site's faults") keeps hits and text-only chats at 200, answers new images with a typed
503 within its bounds, and lets the site back in by itself. The longer variants (the site's host
killed and restarted, the cluster tier restarted warm) are `make soak`'s: bench/site_faults.py."""

from __future__ import annotations

import json
import time

import pytest

from harness import hosts
from harness.sites import Load, Sites, cluster_graph, image, summary, tier_answer, violations
from harness.topology import require_nginx

pytestmark = pytest.mark.slow

READ_S = 8  # this test's tier: --read-timeout 8s (the default, 60 s, is what a request on a dead kept-alive waits)
CONNECT_S = 2  # a site hop's connect timeout (the default)
RETRY_S = 5  # --site-retry-s (the default): the 503's Retry-After, and how often the site is probed
KEEPALIVE_S = 10  # the tier's idle upstream connections live this long: a request may be sent on one until then
MARGIN_S = 3  # two shared cores run both sites and this client
CODE = "encoder_site_unreachable"


@pytest.fixture(scope="module")
def sites(tmp_path_factory, checkpoint):
    why = hosts.available()
    if why:
        pytest.skip(why)
    require_nginx()
    root = tmp_path_factory.mktemp("sites")
    with hosts.Hosts(2) as h:
        s = Sites(h, root, checkpoint, cluster_graph(root / "cluster.yaml", ("--read-timeout", f"{READ_S}s")))
        try:
            s.start_site()
            s.start_cluster()
            yield s
        finally:
            s.stop()


def test_a_cut_link_to_the_encoder_site_fails_new_images_fast_and_heals_by_itself(sites):
    cached = [1, 2]
    for seed in cached:  # in the cluster tier from now on
        first = sites.chat(image(seed))
        assert first.ok, first.body
    assert sites.chat("Say something.").ok
    before = sites.errors()

    sites.hosts.cut(1)
    try:
        records = Load(sites, cached, seed0=1000).run(seconds=20, max_requests=90)
        status, headers = tier_answer(sites, '{"probe": "a miss while the site is cut"}')
        streamed = sites.chat(image(900), timeout=60, stream=True)  # the breaker is open: refused before a token
    finally:
        sites.hosts.restore(1)
    restored = time.monotonic()

    counted = summary(records)
    print(counted)
    assert not violations(records, bound_s=CONNECT_S + MARGIN_S, first_bound_s=READ_S + MARGIN_S,
                          first_s=KEEPALIVE_S), counted
    refused = sum(r.outcome.status == 503 for r in records)
    assert counted["new"]["statuses"].get("503", 0) >= 3 and counted["text"]["statuses"] == {
        "200": counted["text"]["statuses"].get("200", 0)}
    after = sites.errors()  # each 503 the frontend answered (and the streamed refusal) was the site's, typed
    assert after.get(CODE, 0) - before.get(CODE, 0) == refused + 1 and set(after) - set(before) <= {CODE}, after
    assert status == 503 and headers.get("X-Mm-Error-Code") == CODE and headers.get("Retry-After") == str(RETRY_S)
    # A streamed chat is not left half-written: Dynamo answers 200 and one error event (a 503), then ends.
    events = [json.loads(line[6:]) for line in streamed.body.splitlines() if line.startswith("data: {")]
    assert streamed.ok and streamed.seconds < CONNECT_S + MARGIN_S, streamed
    assert [e["error"]["code"] for e in events if "error" in e] == [503] and not any(
        e.get("choices") for e in events), streamed.body

    # Back by itself, nothing restarted: within one breaker period and a probe's connect.
    seed, outcome = 5000, None
    while time.monotonic() - restored < RETRY_S + CONNECT_S + 2 * MARGIN_S:
        outcome = sites.chat(image(seed), timeout=60)
        if outcome.ok:
            break
        seed += 1
        time.sleep(0.5)
    assert outcome is not None and outcome.ok, outcome
    print(f"recovered {time.monotonic() - restored:.1f} s after the link came back")
