"""The encode worker's load signals: what an encode planner reads to size the fleet.

What a request costs is its patches, not its count (a 4K image is ~16x a 448x448 one), so demand,
throughput and capacity are counted in patches (the metrics in `metrics.py`):

- `dynamo_component_encode_forward_seconds_total`: device seconds in forward passes; its rate
  is the device's busy fraction;
- `dynamo_component_encode_patches_admitted_total` / `..._patches_encoded_total`: demand (items
  admitted past the caches, before their decode) and throughput;
- `dynamo_component_encode_queue_wait_seconds`: per item, from the device queue to its forward;
- `dynamo_component_encode_rejected_total{reason}`: the 503s, by reason;
- `dynamo_component_encode_capacity_patches_per_second`: what the device gets through per busy
  second, measured (`CapacityMeter`): one probe forward at start-up, then the live forwards.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import torch

from ..model.steps import EncodeSteps

log = logging.getLogger(__name__)
WINDOW = 32  # live forwards the estimate covers: recent enough to follow the mix, long enough to be steady
PROBE_SIDE = 448  # the probe image's side in pixels: a common size, one small forward


class CapacityMeter:
    """Patches per second of forward time, over the last `window` forwards (weighted by their
    patches, so a burst of small batches does not outvote one full batch); before any forward, the
    start-up probe's figure; NaN when neither is known."""

    def __init__(self, window: int = WINDOW):
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)
        self.probed: float | None = None

    def observe(self, patches: int, seconds: float) -> None:
        if patches > 0 and seconds > 0:
            self._recent.append((patches, seconds))

    @property
    def patches_per_second(self) -> float:
        if self._recent:
            return sum(p for p, _ in self._recent) / sum(s for _, s in self._recent)
        return self.probed if self.probed is not None else math.nan


def probe(steps: EncodeSteps, side: int = PROBE_SIDE) -> tuple[int, float]:
    """(patches, seconds) of one forward of a `side` x `side` image on the loaded model, as the
    worker runs it (its preprocessing, device and dtype); a first forward, so it includes what a
    cold start costs. Runs on the device thread."""
    rgb = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    prepared = steps.preprocess_rgb(rgb, steps.spec.preprocess, "capacity-probe", "image", None, 0.0)
    t0 = time.perf_counter()
    steps.forward([prepared])
    return prepared.num_patches, time.perf_counter() - t0
