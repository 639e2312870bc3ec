"""Shared fixtures. Everything here runs on CPU with deterministic random weights."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from harness.venvs import BuildFailed, wait_for_vllm_build
from mm_encoder import Encoder

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# `make test` runs two workers (pytest-xdist): each picks its processes' ports from a range of its own
# (`mm_encoder.serve.site.port_range`, which serve reads too), so two graphs starting at once on the two
# workers never choose one port.
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _worker.startswith("gw") and "MM_ENCODER_PORTS" not in os.environ:
    _span = (32000 - 10000) // _workers
    _low = 10000 + int(_worker[2:]) * _span
    os.environ["MM_ENCODER_PORTS"] = f"{_low}-{_low + _span - 1}"

# tests/vllm/ runs on vLLM's code, in vLLM's own virtualenv (`make test-vllm`); the project's venv has no vLLM.
# (tests/ is on sys.path, pytest's rootdir-relative import of this conftest: tests/vllm/ itself would be found as a
# namespace package, which has no origin)
_vllm = importlib.util.find_spec("vllm")
collect_ignore = [] if _vllm is not None and _vllm.origin is not None else ["vllm"]


@pytest.fixture(scope="session")
def tiny() -> Encoder:
    """The registry's tiny model (random weights) loaded with no dtype, as a worker without `--dtype` loads
    it: bf16 on CPUs with native bf16, fp32 on others (loading.default_dtype). A test that asserts its
    rows' dtype expects that default or loads an encoder of the dtype it needs."""
    return Encoder.from_pretrained("tiny")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The tiny random Kimi-K2.5 checkpoint the package generates (`make up` serves the same one):
    transformers' config format, sharded safetensors in the released layout, tokenizer, chat template."""
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "kimi-k2.5-tiny", "tiny")


@pytest.fixture(scope="session")
def ckpt_encoder(checkpoint) -> Encoder:
    """The checkpoint's vision tower and projector, as the encode worker loads them (fp32)."""
    return Encoder.from_pretrained(checkpoint, dtype="fp32")


@pytest.fixture(scope="session")
def vllm_venv():
    """.venv-vllm's python, for the tests that run vLLM's engine in it: `make test` builds that
    virtualenv in the background while the suite runs; this waits for the build (harness.venvs),
    and fails with the end of its log if it failed."""
    try:
        return wait_for_vllm_build()
    except BuildFailed as e:
        pytest.fail(str(e), pytrace=False)


def pytest_collection_modifyitems(config, items):
    """The modules that start whole graphs (a `slow` test) first, the longest of them (vLLM's graphs, whose
    virtualenv `make test` builds first) at the head, each module's tests kept together and in order: with
    two workers (`make test`: pytest-xdist, a module at a time) the long modules are spread over both from
    the start and the short ones fill the gaps at the end, instead of one worker running the last long
    module alone."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    vllm = {item.module for item in items if "vllm_venv" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: (item.module not in slow, item.module not in vllm))  # stable within each group
