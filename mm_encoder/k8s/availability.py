"""What keeps a graph serving while Kubernetes moves its pods (docs/kubernetes.md "Drains and availability"):

- a pod that stops finishes what it holds. The encoders and the frontend drain on SIGTERM (new requests
  503, those in flight finish, within their `--drain-timeout-s`); nginx finishes its requests on QUIT.
  Each gets a preStop hook that first waits `ENDPOINT_DELAY_S`, while the pod keeps serving and the
  Services and Dynamo's discovery stop sending it new work (a stopping pod's removal and its SIGTERM
  happen at once otherwise), and a `terminationGracePeriodSeconds` above that wait plus its drain;
- the router and the cluster tier, which every request passes, run at least `MIN_TIER_REPLICAS`;
- every component has a PodDisruptionBudget (a drained node or an eviction takes one pod of it at a
  time) and spreads its pods over nodes."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

from ..core.timing import DRAIN_TIMEOUT_S
from ..core.topology import CACHE_TIERS
from ..graph.planned import ComponentPlan
from ..graph.schema import Graph
from .names import K8sNames, labels, selector

ENDPOINT_DELAY_S = 5  # how long a stopping pod keeps serving while Services and discovery drop it
SLACK_S = 10  # beyond a drain: closing the transports, the process's exit
MIN_TIER_REPLICAS = 2  # the router and the cluster tier: one pod lost (a node, a rollout) is not an outage
HOSTNAME = "kubernetes.io/hostname"
_PREFIX = {"encoder": "MM_ENCODER_", "frontend": "MM_FRONTEND_"}  # their settings' env_prefix


class _Drain(BaseSettings):
    """The one option of an encoder's or our frontend's command line that sizes its pod's grace (read
    here without importing either component: this room renders, it does not run them)."""

    model_config = SettingsConfigDict(extra="ignore")
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, ge=0)
_NGINX_TIME = re.compile(r"^([0-9]+)(ms|s|m|h|d)?$")


def drain_timeout_s(cp: ComponentPlan) -> float:
    """An encoder's or our frontend's `--drain-timeout-s` as its own parser reads the command line, else its
    environment's (`<PREFIX>DRAIN_TIMEOUT_S` in the graph's `env`), else its default; Dynamo's stock frontend
    drains Dynamo's way: our default bounds it."""
    if cp.component.stock:
        return DRAIN_TIMEOUT_S
    args = {r.argv for r in cp.replicas}.pop()
    given = CliSettingsSource(_Drain, cli_parse_args=list(args), cli_exit_on_error=False,
                              cli_ignore_unknown_args=True, cli_kebab_case=True)().get("drain_timeout_s")
    return float(given if given is not None else cp.component.env.get(f"{_PREFIX[cp.kind]}DRAIN_TIMEOUT_S",
                                                                          DRAIN_TIMEOUT_S))


def nginx_seconds(value: str) -> float:
    """An nginx time (500ms, 30s, 10m, 24h; a bare number is seconds) in seconds."""
    m = _NGINX_TIME.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not an nginx time")
    return int(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def tier_drain_s(cp: ComponentPlan) -> float:
    """The longest a tier's request may last, which a graceful stop (QUIT) waits for: a cache miss waits for
    the cache lock (another request filling the same key), then on its next level; the router only on its
    shard."""
    cfg = cp.replicas[0].tier
    assert cfg is not None
    lock = nginx_seconds(cfg.lock_timeout) if cfg.tier != "router" else 0.0
    return lock + nginx_seconds(cfg.timeout)


def stop(cp: ComponentPlan) -> tuple[dict[str, Any], int] | None:
    """The container's preStop hook and the pod's grace period, for the components that drain."""
    if cp.kind in CACHE_TIERS:
        # nginx's graceful stop is QUIT (TERM, which the kubelet sends after the hook, cuts requests off): the
        # hook sends it to PID 1 (nginx, or the tier that supervises it and passes it on) and waits for the end
        hook = ["sh", "-c", f"sleep {ENDPOINT_DELAY_S}; kill -QUIT 1; while kill -0 1 2>/dev/null; do sleep 1; done"]
        drain = tier_drain_s(cp)
    elif cp.kind in _PREFIX:
        hook, drain = ["sleep", str(ENDPOINT_DELAY_S)], drain_timeout_s(cp)
    else:
        return None
    return {"preStop": {"exec": {"command": hook}}}, ENDPOINT_DELAY_S + math.ceil(drain) + SLACK_S


def add_to_pod(g: Graph, cp: ComponentPlan, container: dict[str, Any], spec: dict[str, Any]) -> None:
    """The drain (preStop and grace period) where the component has one, and the spread over nodes."""
    stopping = stop(cp)
    if stopping is not None:
        container["lifecycle"], spec["terminationGracePeriodSeconds"] = stopping
    spec["topologySpreadConstraints"] = [spread(g, cp.name)]


def spread(g: Graph, component: str) -> dict[str, Any]:
    """A component's pods on as many nodes as the scheduler can: preferred, not required, so that a pod that
    fits one node only (a GPU's) still starts."""
    return {"maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector(g, component)}}


def tier_replicas(cp: ComponentPlan) -> int:
    """The graph's replicas, raised to MIN_TIER_REPLICAS for the router and the cluster tier."""
    n = cp.component.replicas
    return max(n, MIN_TIER_REPLICAS) if cp.kind in ("cache-router", "cache-cluster") else n


def budgets(names: K8sNames, plans: list[ComponentPlan]) -> list[dict[str, Any]]:
    """Per component, a PodDisruptionBudget: voluntary disruptions (node drains, evictions) take at most one
    of its pods at a time. `maxUnavailable`, not `minAvailable`: a one-replica component still lets a node
    drain (it is down meanwhile; run two where that matters)."""
    g = names.g
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
             "metadata": {"name": names.budgets[cp.name], "labels": labels(g, cp.name, cp.kind)},
             "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(g, cp.name)}}}
            for cp in plans]


def note(names: K8sNames, plans: list[ComponentPlan]) -> str:
    """What the DynamoGraphDeployment's note says: the raised replica counts, the budgets."""
    raised = [f"{cp.name} {cp.component.replicas} -> {tier_replicas(cp)}" for cp in plans
              if tier_replicas(cp) != cp.component.replicas]
    out = f" PodDisruptionBudgets {', '.join(names.budgets.values())} (one pod of a component at a time)."
    if raised:
        out += (f" Replicas raised to {MIN_TIER_REPLICAS} for the tiers every request passes: {', '.join(raised)}.")
    return out
