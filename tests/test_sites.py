"""Many model clusters, one encoder site, each on its own host: an encoder site and two model clusters
(`graphs/encoder-site.yaml`, `graphs/model-cluster.yaml`), each `mm-encoder serve` in its own network
namespace (harness/hosts.py), every hop over TLS from one operator CA, the README's request sent from
the root namespace to each cluster's frontend across the bridge.

The same image asked of cluster A, then of cluster B, is encoded once across the fleet: B's cluster
tier misses, the site's shared tier hits. A cluster the site does not name is refused by the site's
router (its certificate's spiffe:// ID is of another graph), and serve refuses to bind off loopback
without TLS unless told so by name. The site serves two models: a GLM cluster's images go to the
site's GLM encoder, the Kimi clusters' to its Kimi encoder. Skipped, with the reason, where namespaces
cannot be made (not root).
"""

from __future__ import annotations

import json
import ssl
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from harness import hosts
from harness.processes import Process
from harness.serve_fixtures import MODEL, ROOT, Served, sample_content
from harness.sites import serve_on
from mm_encoder.security.pki import Authority

pytestmark = [pytest.mark.slow, pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))]
GLM = "glm-tiny"  # the generated GLM checkpoint's directory: its cluster's served model name
TENANT = "X-Tenant"  # the tenant clusters' --tenant-header
TENANT_CLUSTERS = (6, "tenant-a"), (7, "tenant-b")  # (host, graph name): model clusters that serve tenants
READY_S = 240  # a serve start, the engines loading the tiny checkpoint, on 2 shared cores


def chat(address: str, ca: Path, content=None, model: str = MODEL, tenant: str | None = None) -> dict:
    body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": content or sample_content()}]}
    req = urllib.request.Request(f"https://{address}:8000/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **({TENANT: tenant} if tenant else {})})
    with urllib.request.urlopen(req, timeout=120, context=ssl.create_default_context(cafile=str(ca / "ca.pem"))) as r:
        return json.loads(r.read())



def get(url: str, ca: Path) -> dict:
    with urllib.request.urlopen(url, timeout=30, context=ssl.create_default_context(cafile=str(ca / "ca.pem"))) as r:
        return json.loads(r.read())


def status(h: hosts.Hosts, i: int, run_dir: Path) -> dict:
    """`mm-encoder status --json` run on host i (its components listen on that host's loopback)."""
    done = h.run(i, [sys.executable, "-m", "mm_encoder.cli", "status", "--run-dir", str(run_dir), "--json"])
    assert done.returncode == 0, done.stderr
    return {c["name"]: c for c in json.loads(done.stdout)["components"]}


def counts(tier: dict) -> tuple[int, int]:
    """A tier's (misses, hits) from its status row (requests, hit ratio)."""
    hits = round(tier["requests"] * (tier["hit_ratio"] or 0))
    return tier["requests"] - hits, hits


def tenant_cluster_graph(base: Path) -> Path:
    """graphs/model-cluster.yaml serving tenants (`tenants.header`) with one engine: every request of every
    tenant reaches the same engine, so its prefix store, not only the router, is what keeps them apart."""
    doc = yaml.safe_load((ROOT / "graphs" / "model-cluster.yaml").read_text())
    doc["tenants"] = {"header": TENANT}
    doc["components"]["engine"]["replicas"] = 1
    path = base / "tenant-cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def site_graph(base: Path, glm: Path) -> Path:
    """graphs/encoder-site.yaml with a second model: a GLM encoder component beside the Kimi one, each
    naming the models it serves, and a GLM cluster among the clusters it admits."""
    doc = yaml.safe_load((ROOT / "graphs" / "encoder-site.yaml").read_text())
    doc["components"]["encoder"]["serves"] = ["kimi-k2.5-vision", "Kimi-K2.5", "moonshotai/Kimi-K2.5"]
    doc["components"]["glm"] = {"kind": "encoder", "checkpoint": str(glm), "serves": ["glm-5.2-vision"]}
    doc["clusters"] = [*doc["clusters"], "cluster-glm", *(name for _, name in TENANT_CLUSTERS)]
    path = base / "encoder-site.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Host 1: the encoder site, two models (Kimi-K2.5 and GLM towers); hosts 2 and 3: Kimi model clusters
    cluster-a and cluster-b; host 4: cluster-c, which the site does not name; host 5: cluster-glm, a GLM
    model cluster; hosts 6 and 7: Kimi clusters that serve tenants, with one tenant key. One CA, the
    checkpoints in one place (the filesystem is shared)."""
    base = tmp_path_factory.mktemp("sites")
    ca, checkpoint, glm = base / "ca", base / "ck" / MODEL, base / "ck" / GLM
    Authority.create(ca, name="operator CA for the sites test")
    for path, preset in ((checkpoint, "tiny"), (glm, "glm-tiny")):
        made = Process([sys.executable, "-m", "mm_encoder.cli", "make-checkpoint", "--preset", preset, str(path)],
                       name="make-checkpoint")
        assert made.wait(timeout=120) == 0, made.text
    served: list[Served] = []
    tenant_key = base / "tenant.key"
    tenant_key.write_bytes(b"k" * 32)
    tenant_key.chmod(0o600)
    with hosts.Hosts(7) as h:
        try:
            site_url = f"https://{h.addr(1)}:8090"
            served.append(serve_on(h, 1, site_graph(base, glm), base / "site", ca, checkpoint, 8090))
            served[0].wait_for("ready", READY_S)
            for i, name, ck in ((2, "cluster-a", checkpoint), (3, "cluster-b", checkpoint),
                                (4, "cluster-c", checkpoint), (5, "cluster-glm", glm)):
                served.append(serve_on(h, i, ROOT / "graphs" / "model-cluster.yaml", base / name, ca, ck, 8000,
                                       "--name", name, "--encoder-site", site_url))
            for i, name in TENANT_CLUSTERS:
                served.append(serve_on(h, i, tenant_cluster_graph(base), base / name, ca, checkpoint, 8000,
                                       "--name", name, "--encoder-site", site_url, "--tenant-key", str(tenant_key)))
            for s in served[1:]:
                s.wait_for("ready", READY_S)
            yield h, base, ca
        finally:  # the serves stop side by side: each drains and checks its own processes
            with ThreadPoolExecutor(len(served) or 1) as pool:
                list(pool.map(lambda s: s.stop(check=False), served))
    assert all(s.proc.returncode == 0 for s in served), "\n".join(s.proc.tail(20) for s in served)


def test_one_image_asked_of_two_clusters_is_encoded_once_across_the_fleet(fleet):
    h, base, ca = fleet
    first, second = chat(h.addr(2), ca), chat(h.addr(3), ca)
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 1223
    site = status(h, 1, base / "site")
    assert site["encoder"]["encodes"] == 1
    # the key lives on one shard, which missed once (A's HEAD, which the encoder answered) and hit for B;
    # an engine's fetch is its cluster tier's hit unless it came while the HEAD's fill was being written
    shards = [counts(site[n]) for n in ("shared-0", "shared-1")]
    assert sorted(m for m, _ in shards) == [0, 1] and sum(hit for _, hit in shards) >= 1, shards
    misses = {name: counts(status(h, i, base / name)["cluster"])[0] for name, i in (("cluster-a", 2), ("cluster-b", 3))}
    assert all(m >= 1 for m in misses.values()), misses  # each cluster tier missed: B's hit was the site's
    # the site counts each calling cluster by its graph (its certificate's, and the name its tier sends):
    # A's requests missed on the shards at least once, B's only hit; the router saw both
    by_shard = [site[n].get("clusters", {}) for n in ("shared-0", "shared-1")]
    asked = {name: sum(c.get(name, {}).get("requests", 0) for c in by_shard) for name in ("cluster-a", "cluster-b")}
    hits = {name: sum(c.get(name, {}).get("hits", 0) for c in by_shard) for name in ("cluster-a", "cluster-b")}
    assert set().union(*by_shard) == {"cluster-a", "cluster-b"}, by_shard
    assert asked["cluster-a"] > hits["cluster-a"] and asked["cluster-b"] == hits["cluster-b"] >= 1, (asked, hits)
    assert {k: v["requests"] for k, v in site["router"]["clusters"].items()} == asked
    assert chat(h.addr(2), ca)["usage"]["prompt_tokens"] == 1223  # again on A: its own tier's hits only
    assert counts(status(h, 2, base / "cluster-a")["cluster"])[0] == misses["cluster-a"]
    assert status(h, 1, base / "site")["encoder"]["encodes"] == 1


def test_a_cluster_the_site_does_not_name_is_refused_by_its_identity(fleet):
    """cluster-c holds a certificate from the same CA, but its graph is not in the site's `clusters`: the
    router refuses it (403 forbidden_peer) and its frontend answers 403, not an image."""
    h, _, ca = fleet
    with pytest.raises(urllib.error.HTTPError) as refused:
        chat(h.addr(4), ca)
    # Dynamo 1.6.1's HTTP server shows a 403's status, not its message (runtime/dynamo.py `client_error`);
    # the frontend counts it by its code
    assert refused.value.code == 403
    stats = get(f"https://{h.addr(4)}:8000/mm/stats", ca)["processors"][0]
    assert stats["errors"] == {"forbidden_peer": 1}, stats["errors"]
    assert chat(h.addr(4), ca, [{"type": "text", "text": "hello"}])["usage"]["prompt_tokens"] > 0  # text needs no site


def test_binding_off_loopback_without_tls_is_refused_by_name(tmp_path):
    run = Process([sys.executable, "-m", "mm_encoder.cli", "serve", str(ROOT / "graphs" / "encoder-site.yaml"),
                   "--run-dir", str(tmp_path / "run"), "--bind", "198.18.0.1"], name="serve without TLS")
    assert run.wait(timeout=60) == 2
    assert "--bind 198.18.0.1 serves other hosts: with TLS" in run.text and "--plaintext-off-loopback" in run.text


def test_one_site_serves_two_models_each_by_its_own_encoders(fleet):
    """A GLM cluster's image goes to the site's GLM encoder (its shared tier routes by the request's model),
    the Kimi clusters' to the Kimi encoder: one fleet of towers for both models' clusters."""
    h, base, ca = fleet
    before = status(h, 1, base / "site")
    answer = chat(h.addr(5), ca, model=GLM)
    assert answer["usage"]["prompt_tokens"] > 1000  # the image's rows spliced into GLM's prompt
    after = status(h, 1, base / "site")
    assert (after["glm"]["encodes"], before["glm"]["encodes"]) == (1, 0)
    assert after["encoder"]["encodes"] == before["encoder"]["encodes"]  # the Kimi encoder did nothing


def test_two_tenants_share_no_entry_at_any_level(fleet):
    """Clusters tenant-a and tenant-b serve tenants (`--tenant-header X-Tenant`, one key): acme's image on
    tenant-a is encoded; globex's first request for the same image, on tenant-b, misses its cluster tier,
    the site's shared tier and the encoder's mm_hash LRU (a second forward pass). acme on tenant-b then
    misses that cluster's tier but hits the shared tier: its own entry, shared across its clusters. The
    engine's KV too (one engine per tenant cluster): acme's prompt again on tenant-a reuses its KV and the
    router counts the overlap (it hashes the blocks in acme's cache namespace, as the engine published
    them); globex's same prompt on the same engine reuses none of it. A request without the header is
    refused by name."""
    h, base, ca = fleet
    (ha, a), (hb, b) = TENANT_CLUSTERS

    def levels() -> tuple[int, int, int, int, int]:
        """(encodes, shared misses, shared hits, tenant-a's tier misses, tenant-b's tier misses)."""
        site = status(h, 1, base / "site")
        shards = [counts(site[n]) for n in ("shared-0", "shared-1")]
        return (site["encoder"]["encodes"], sum(m for m, _ in shards), sum(x for _, x in shards),
                counts(status(h, ha, base / a)["cluster"])[0], counts(status(h, hb, base / b)["cluster"])[0])

    start = levels()
    assert chat(h.addr(ha), ca, tenant="acme")["usage"]["prompt_tokens"] == 1223
    acme = levels()
    assert acme[0] == start[0] + 1 and acme[1] == start[1] + 1 and acme[3] >= start[3] + 1, (start, acme)
    assert chat(h.addr(hb), ca, tenant="globex")["usage"]["prompt_tokens"] == 1223
    globex = levels()
    # a miss at every level: another forward pass (the mm_hash LRU held acme's body only), a shared miss
    assert globex[0] == acme[0] + 1 and globex[1] == acme[1] + 1 and globex[4] >= acme[4] + 1, (acme, globex)
    assert chat(h.addr(hb), ca, tenant="acme")["usage"]["prompt_tokens"] == 1223
    again = levels()
    # acme's second cluster: its tier misses, the site's shared tier has acme's entry; nothing encoded
    assert again[0] == globex[0] and again[1] == globex[1] and again[2] >= globex[2] + 1, (globex, again)

    def last_route() -> tuple[int, int]:
        record = get(f"https://{h.addr(ha)}:8000/mm/stats", ca)["processors"][0]["recent"][-1]
        return record["overlap_blocks"], record["timings"].get("reused_tokens", 0)

    chat(h.addr(ha), ca, tenant="acme")
    assert last_route()[0] > 70 and last_route()[1] > 1100, last_route()  # 1223 tokens, blocks of 16
    chat(h.addr(ha), ca, tenant="globex")
    assert last_route() == (0, 0)
    with pytest.raises(urllib.error.HTTPError) as refused:
        chat(h.addr(ha), ca)
    assert refused.value.code == 400 and "[missing_tenant]" in refused.value.read().decode()
