"""What the capacity model takes (`Traffic`, validated, every field bounded) and the synthetic trace
it runs: media items drawn by popularity from a catalogue, each image's size fixed by the mix.

- Popularity: Zipf over the catalogue's ranks 1..n, P(k) proportional to k^-s (s = 0: uniform),
  sampled exactly by rejection-inversion (Hörmann and Derflinger, "Rejection-inversion to generate
  variates from monotone discrete distributions", 1996), vectorised with numpy: O(1) per draw for any
  catalogue size, so a billion-image catalogue costs what a small one does.
- An image's size is a property of the image: a catalogue item's class in the mix is fixed by a hash
  of its rank (splitmix64), not drawn per request, so every request for it costs the same.
- An item's patches are what the encoder runs: the model's own resize rule (`families/`, the same
  function the encoder calls), then the zero padding to whole 2x2 merge blocks. Its body is
  rows (patches / 4) x the projector's width x the dtype's bytes, times `compression`, plus the
  wire header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..core import dtypes
from ..core.registry import get_spec
from ..core.spec import ModelSpec, PreprocessConfig
from ..families import preprocess_rule

MAX_REQUESTS = 50_000_000
MAX_CATALOGUE = 1_000_000_000
WIRE_HEADER_BYTES = 256  # the wire-v1 header: msgpack fields around the rows (grids, mm_hash, model, dtype)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: object) -> int:
    """Bytes from an int or an nginx-style size ("512k", "64m", "2g", "1t")."""
    if isinstance(value, bool):
        raise ValueError("a size is bytes or a string like 512m, 2g")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
        number = text[: len(text) - len(unit)]
        if number.isdigit():
            return int(number) * _UNITS[unit]
    raise ValueError(f"{value!r} is not a size (bytes, or like 512m, 2g)")


Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0, le=1 << 50)]  # bytes, or "512m", "2g"


def parse_mix(value: object) -> object:
    """"1280x720:0.5,3840x2160:0.2" (weight 1 when left out), or a list of such strings or mappings."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        return value
    out: list[object] = []
    for part in value:
        if isinstance(part, str):
            size, _, weight = part.strip().partition(":")
            width, x, height = size.lower().partition("x")
            if not (x and width.isdigit() and height.isdigit()):
                raise ValueError(f"{part!r} is not WIDTHxHEIGHT[:WEIGHT]")
            try:
                share = float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"{part!r}: the weight is not a number") from None
            out.append({"width": int(width), "height": int(height), "weight": share})
        else:
            out.append(part)
    return out


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ImageSize(_Frozen):
    """One class of the image size mix: width x height pixels, its share of the catalogue."""

    width: int = Field(ge=1, le=16384)
    height: int = Field(ge=1, le=16384)
    weight: float = Field(1.0, gt=0, le=1e6)


class Popularity(_Frozen):
    """Which catalogue item a request names: Zipf with `exponent` over `catalogue` items."""

    law: Literal["zipf"] = "zipf"
    exponent: float = Field(1.0, ge=0, le=5)
    catalogue: int = Field(1_000_000, ge=1, le=MAX_CATALOGUE)


DEFAULT_MIX = (ImageSize(width=1280, height=720, weight=0.5), ImageSize(width=1920, height=1080, weight=0.3),
               ImageSize(width=3840, height=2160, weight=0.2))


class Traffic(_Frozen):
    """The traffic, the hierarchy's sizes and the encoders' capacity (docs/capacity.md)."""

    requests_per_second: float = Field(100.0, gt=0, le=1e7)
    media_per_request: float = Field(1.0, gt=0, le=64)
    image_mix: Annotated[tuple[ImageSize, ...], BeforeValidator(parse_mix)] = Field(DEFAULT_MIX, min_length=1,
                                                                                    max_length=64)
    popularity: Popularity = Popularity()
    requests: int = Field(1_000_000, ge=1, le=MAX_REQUESTS, description="requests in the synthetic trace")
    clusters: int = Field(1, ge=1, le=1024, description="LLM clusters, each with its own cluster tier")
    cluster_tier_bytes: Size = Field(1 << 30, description="each cluster tier's --max-size")
    shards: int = Field(2, ge=1, le=1024, description="shared-tier shards behind the router")
    shard_bytes: Size = Field(2 << 30, description="each shard's --max-size")
    shard_name: str = Field("epd-shared-{i}.epd-shared:8080", min_length=4, max_length=200,
                            description="the shards' names as the router's config writes them; {i} is 0, 1, ...")
    shard_names: tuple[str, ...] | None = Field(None, min_length=1, max_length=1024,
                                                description="the shards' names, one by one (overrides shards)")
    encoder_cache_bytes: Size = Field(1 << 30, description="each encode worker's mm_hash body LRU (--cache-bytes)")
    encoders: int | None = Field(None, ge=1, le=100_000, description="encode workers; default: as many as needed")
    capacity_pps: float | None = Field(None, gt=0, le=1e9, description="one worker's patches per second")
    target_utilization: float = Field(0.7, gt=0, le=1)
    model: str = Field("kimi-k2.5-vision", min_length=1, max_length=200, description="a registry model")
    dtype: dtypes.ShortName = "bf16"
    compression: float = Field(1.0, gt=0, le=1, description="body bytes per raw row byte (zstd on the wire)")
    seed: int = Field(0, ge=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _check(self) -> Traffic:
        if "{i}" not in self.shard_name and self.shard_names is None and self.shards > 1:
            raise ValueError("shard_name must contain {i} when there are several shards")
        names = self.ring_names()
        if len(set(names)) != len(names):
            raise ValueError("shard names must differ")
        if round(self.requests * self.media_per_request) > MAX_REQUESTS:
            raise ValueError(f"at most {MAX_REQUESTS} media items in the trace (requests x media_per_request)")
        if round(self.requests * self.media_per_request) < 1:
            raise ValueError("the trace has no media item: raise requests or media_per_request")
        try:
            spec = get_spec(self.model)
        except Exception as e:  # UnknownModelError names the known models
            raise ValueError(f"model: {e}") from None
        for size in self.image_mix:
            try:
                image_patches(size.width, size.height, spec)
            except Exception as e:  # the model's own refusal (kimi-vl: a side too long)
                raise ValueError(f"image {size.width}x{size.height}: {e}") from None
        return self

    def ring_names(self) -> list[str]:
        if self.shard_names is not None:
            return list(self.shard_names)
        return [self.shard_name.replace("{i}", str(i)) for i in range(self.shards)]

    @property
    def items(self) -> int:
        """Media items in the trace."""
        return max(1, round(self.requests * self.media_per_request))

    @property
    def duration_s(self) -> float:
        """The trace's span at the request rate."""
        return self.requests / self.requests_per_second


# --- an image's cost -----------------------------------------------------------------------------


def image_patches(width: int, height: int, spec: ModelSpec) -> int:
    """Patches the encoder runs for one image of this size: the family's resize rule (its own
    function, `families/`), then whole 2x2 merge blocks (padding) or whole patches (kimi-vl's crop),
    as `model.preprocess.frame_grid` does; tests/test_capacity.py compares the two."""
    cfg: PreprocessConfig = spec.preprocess
    patch = spec.tower.patch_size
    rule = preprocess_rule(cfg.policy)
    w, h = rule.target(width, height, cfg.in_patch_limit, cfg, patch)
    if cfg.pad_input:
        unit = patch * spec.tower.merge_kernel[0]
        gh, gw = math.ceil(h / unit) * 2, math.ceil(w / unit) * 2
    else:
        gh, gw = h // patch, w // patch
    if rule.check is not None:
        rule.check(width, height, gh, gw, cfg)
    return gh * gw


@dataclass(frozen=True)
class SizeClass:
    width: int
    height: int
    share: float  # of the catalogue
    patches: int
    rows: int
    body_bytes: int


def size_classes(traffic: Traffic) -> list[SizeClass]:
    spec = get_spec(traffic.model)
    total = sum(s.weight for s in traffic.image_mix)
    row_bytes = spec.projector.out_dim * dtypes.size(traffic.dtype)
    out = []
    for s in traffic.image_mix:
        patches = image_patches(s.width, s.height, spec)
        rows = patches // 4
        body = math.ceil(rows * row_bytes * traffic.compression) + WIRE_HEADER_BYTES
        out.append(SizeClass(s.width, s.height, s.weight / total, patches, rows, body))
    return out


# --- the trace ---------------------------------------------------------------------------------


def _h(x: npt.NDArray[np.float64], s: float) -> npt.NDArray[np.float64]:
    """H(x) = integral of t^-s from 1 to x (log x at s = 1), the hat function's integral."""
    lx = np.log(x)
    if abs(1 - s) < 1e-12:
        return lx
    return np.expm1((1 - s) * lx) / (1 - s)


def _h_inv(y: npt.NDArray[np.float64], s: float) -> npt.NDArray[np.float64]:
    if abs(1 - s) < 1e-12:
        return np.exp(y)
    return np.exp(np.log1p((1 - s) * y) / (1 - s))


def zipf_ranks(n: int, s: float, size: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """`size` ranks in 1..n with P(k) proportional to k^-s, exactly (rejection-inversion)."""
    if n == 1:
        return np.ones(size, dtype=np.int64)
    if s == 0:
        return rng.integers(1, n + 1, size=size, dtype=np.int64)
    h_lo, h_hi = _h(np.array([1.5, n + 0.5]), s)
    h_lo -= 1.0  # H(1.5) - h(1): rank 1's bar ends at 1.5 and holds exactly h(1) = 1
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        u = h_hi + rng.random(todo.size) * (h_lo - h_hi)
        x = _h_inv(u, s)
        k = np.clip(np.floor(x + 0.5), 1, n)
        ok = u >= _h(k + 0.5, s) - k ** -s  # in the last h(k) of rank k's bar: exactly P(k)
        out[todo[ok]] = k[ok].astype(np.int64)
        todo = todo[~ok]
    return out


def mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: a well-spread 64-bit hash of each value."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


def class_of(ranks: npt.NDArray[np.int64], shares: list[float], seed: int) -> npt.NDArray[np.int64]:
    """Each catalogue item's size class, fixed by a hash of its rank (and the seed)."""
    u = (mix64(ranks.astype(np.uint64) ^ np.uint64(seed)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    edges = np.cumsum(shares)
    edges[-1] = 1.0
    cls: npt.NDArray[np.int64] = np.minimum(np.searchsorted(edges, u, side="right"), len(shares) - 1).astype(np.int64)
    return cls


@dataclass
class Trace:
    """The items in arrival order: catalogue rank, size class, cluster tier."""

    ranks: npt.NDArray[np.int64]
    classes: npt.NDArray[np.int64]
    clusters: npt.NDArray[np.int64]


def make_trace(traffic: Traffic, classes: list[SizeClass]) -> Trace:
    """The synthetic trace: `traffic.items` items, each request's items on one cluster (uniform)."""
    rng = np.random.default_rng(traffic.seed)
    pop = traffic.popularity
    ranks = zipf_ranks(pop.catalogue, pop.exponent, traffic.items, rng)
    request_of = (np.arange(traffic.items, dtype=np.float64) / traffic.media_per_request).astype(np.int64)
    per_request = rng.integers(0, traffic.clusters, size=int(request_of[-1]) + 1, dtype=np.int64)
    return Trace(ranks, class_of(ranks, [c.share for c in classes], traffic.seed), per_request[request_of])
