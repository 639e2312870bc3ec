"""Quantiles, the two ways the package takes them: of a sample (nearest rank), and of a
Prometheus-style histogram given as sorted (upper bound, cumulative count) pairs, either
interpolated inside the bucket (as Prometheus' histogram_quantile) or as the bucket's upper bound
(all a histogram can say without assuming a spread)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The q-quantile of a sample, nearest rank (no interpolation); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def from_buckets(cumulative: Sequence[tuple[float, float]], q: float, *, interpolate: bool = True) -> float | None:
    """The q-quantile of a histogram; None without observations. Interpolated: linear inside the
    bucket holding it, and a rank past the last finite bound is that bound. Not: that bucket's upper
    bound (+Inf past the last finite one)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_le, lower_n = 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if not interpolate:
                return le
            if math.isinf(le):
                return lower_le
            width = n - lower_n
            return lower_le + (le - lower_le) * ((rank - lower_n) / width if width > 0 else 1.0)
        lower_le, lower_n = le, n
    return lower_le
