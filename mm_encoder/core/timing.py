"""Elapsed time as every stage reports it (timings at /mm/stats, `timings_ms` on the wire, logs):
milliseconds from a `time.perf_counter()` reading."""

from __future__ import annotations

import time

DRAIN_TIMEOUT_S = 30.0  # the encode worker's and the frontend's default drain on SIGTERM (k8s sizes grace on it)


def ms_since(t0: float) -> float:
    """Milliseconds since `t0`, a `time.perf_counter()` reading."""
    return (time.perf_counter() - t0) * 1e3
