"""Model families: one module each (mm_encoder/families/). What each family provides, listed, and
every fact checked against the part of the project that reads it: a family cannot half-exist."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import get_args

import pytest

from mm_encoder import families
from mm_encoder.core.errors import CheckpointError, NotACheckpoint
from mm_encoder.core.registry import get_spec
from mm_encoder.core.spec import PreprocessConfig, PreprocessPolicy, ProjectorConfig, PromptConfig, TowerConfig
from mm_encoder.engines.vllm_inputs import family_for
from mm_encoder.families import (
    CheckpointWriter,
    Family,
    NotServed,
    PreprocessRule,
    TransformersFacts,
    VisionConfig,
)

# What each family provides (the facets it does not are `NotServed`, each with its reason).
PROVIDES = {
    "kimi_k25": {"spec", "vision_config", "preprocess", "prompt", "transformers", "vllm", "checkpoint"},
    "kimi_vl": {"spec", "vision_config", "preprocess", "prompt", "vllm"},  # no transformers class; not generated
    "glm4v": {"spec", "vision_config", "preprocess", "prompt", "transformers", "vllm", "checkpoint"},
    "qwen_vl": {"vllm"},  # vLLM only: its embeddings are Qwen's own ViT's, not this project's encoder's
}
FAMILY_MODULES = Path(families.__file__).parent
NOT_FAMILIES = {"__init__", "base", "moonvit", "model_card"}  # registry, facets, MoonViT's shared parts, the card


# Family's facets: every field but what names it
FACETS = tuple(f.name for f in dataclasses.fields(Family) if f.name not in ("name", "title", "model_types"))


def _facets(family: Family) -> tuple[set[str], dict[str, str]]:
    facets = {f: getattr(family, f) for f in FACETS}  # each its facts, or NotServed
    provided = {k for k, v in facets.items() if not isinstance(v, NotServed)}
    reasons = {k: v.reason for k, v in facets.items() if isinstance(v, NotServed)}
    return provided, reasons


def test_what_each_family_provides():
    listed = {f.name: _facets(f)[0] for f in families.all_families()}
    assert listed == PROVIDES
    for family in families.all_families():
        _, reasons = _facets(family)
        assert all(len(r) > 20 for r in reasons.values()), (family.name, reasons)  # a reason, not a placeholder


def test_each_family_is_one_module_registered_once():
    modules = {p.stem for p in FAMILY_MODULES.glob("*.py")} - NOT_FAMILIES
    registered = {f.name: f for f in families.all_families()}
    for stem in modules:
        module = importlib.import_module(f"mm_encoder.families.{stem}")
        assert registered.get(module.FAMILY.name) is module.FAMILY, stem
    assert len(modules) == len(registered)


@pytest.mark.parametrize("name", sorted(PROVIDES))
def test_a_registered_family_cannot_be_registered_again(name):
    family = families.by_name(name)
    with pytest.raises(ValueError, match="is another family's"):
        families.register(family)
    assert families.all_families().count(family) == 1


def _served(facet: str) -> list[Family]:
    return [f for f in families.all_families() if facet in PROVIDES[f.name]]


@pytest.mark.parametrize("family", _served("spec"), ids=lambda f: f.name)
def test_spec_prompt_and_preprocessing_agree_with_the_registry(family):
    spec = get_spec(family.spec)
    assert all(families.spec_names()[t] == family.spec for t in family.model_types) and family.model_types
    assert families.by_model_type(family.model_types[0]) is family
    assert spec.prompt == family.prompt  # configs/models/<spec>.yaml states the family's strings
    assert isinstance(family.prompt, PromptConfig) and family.prompt.placeholder in family.prompt.image
    if family.prompt.video_placeholder:
        assert family.prompt.video_placeholder in family.prompt.video
    assert spec.preprocess.policy == family.preprocess.policy


@pytest.mark.parametrize("family", _served("vision_config"), ids=lambda f: f.name)
def test_vision_config_maps_onto_the_tower_and_projector(family):
    from mm_encoder.model.hf_config import spec_from_hf_config

    config: VisionConfig = family.vision_config
    fields = {"tower": set(TowerConfig.model_fields), "projector": set(ProjectorConfig.model_fields),
              "check": set(TowerConfig.model_fields)}
    projectors = set(get_args(ProjectorConfig.model_fields["type"].annotation))
    for layout in filter(None, (config.release, config.transformers)):
        for key, (part, fld) in {**layout.keys, **layout.top}.items():
            assert fld in fields[part], (layout.name, key)
        assert layout.projector is None or layout.projector in projectors
    for model_type in (*family.model_types, *config.also):
        assert families.vision_configs()[model_type] is config
        spec = spec_from_hf_config({"model_type": model_type, "text_config": {"hidden_size": 64}},
                                   get_spec(family.spec), "r")
        assert spec.projector.out_dim == 64 and spec.tower == get_spec(family.spec).tower


@pytest.mark.parametrize("family", _served("preprocess"), ids=lambda f: f.name)
def test_preprocessing_policy_is_a_rule_with_its_processor_reader(family):
    rule: PreprocessRule = family.preprocess
    assert rule.policy in get_args(PreprocessPolicy) and families.preprocess_rule(rule.policy) is rule
    assert (rule.processor is None) == (rule.reader is None)
    if rule.processor:
        assert families.processors()[rule.processor] is rule
    cfg = get_spec(family.spec).preprocess
    w, h = rule.target(4000, 3000, cfg.in_patch_limit, cfg, 14)
    assert 0 < w < 4000 and 0 < h < 3000 and abs(w / h - 4 / 3) < 0.01  # scaled down, the aspect kept


def test_every_policy_and_processor_has_one_rule():
    rules = {f.preprocess.policy: f.preprocess for f in _served("preprocess")}
    assert set(rules) == set(get_args(PreprocessPolicy))
    assert sorted(families.processors()) == ["KimiK25VisionProcessor", "KimiVLImageProcessor"]
    with pytest.raises(KeyError, match="no preprocessing policy"):
        families.preprocess_rule("qwen")


@pytest.mark.parametrize("family", _served("transformers"), ids=lambda f: f.name)
def test_transformers_facts_name_real_classes(family):
    transformers = pytest.importorskip("transformers")
    facts: TransformersFacts = family.transformers
    for name in (facts.config_class, facts.text_model, facts.text_config_class, facts.monolithic):
        assert name is None or hasattr(transformers, name), name
    assert all(re.compile(pattern) for pattern, _ in facts.renames)


def test_families_the_transformers_engine_does_not_serve_are_refused_with_the_reason(tmp_path):
    from mm_encoder.engines.llm import family_of

    for family in families.all_families():
        if isinstance(family.transformers, NotServed) and family.model_types:
            with pytest.raises(CheckpointError, match=re.escape(family.transformers.reason)):
                family_of({"model_type": family.model_types[0]}, tmp_path)
    with pytest.raises(CheckpointError, match=r"serves \['glm4v', 'kimi_k25'\] through transformers"):
        family_of({"model_type": "qwen2_vl"}, tmp_path)


@pytest.mark.parametrize("family", _served("vllm"), ids=lambda f: f.name)
def test_vllm_facts_resolve_each_architecture(family):
    for inp in family.vllm:
        assert inp.architectures and families.vllm_inputs()[inp.name] is inp
        assert inp.route == "embeds" or inp.token_ids  # the "mm" route expands a placeholder token
        assert set(inp.plugin) <= set(inp.architectures)
        for arch in inp.architectures:
            assert family_for([arch]) is inp


@pytest.mark.parametrize("family", _served("checkpoint"), ids=lambda f: f.name)
def test_checkpoint_writer_writes_the_familys_prompt(family):
    jinja2 = pytest.importorskip("jinja2.sandbox")
    from mm_encoder.engines.tiny_checkpoint import PRESETS, text_config

    writer: CheckpointWriter = family.checkpoint
    assert writer.presets and all(PRESETS[k] is p and p.family == family.name for k, p in writer.presets.items())
    chat = writer.chat
    assert {chat.bos, chat.eos, chat.pad, family.prompt.placeholder} <= set(chat.specials)
    ids = {t: i for i, t in enumerate(chat.specials)} | {"vocab_size": 1024}
    for preset in writer.presets.values():
        text = text_config(preset, ids)
        assert text["vocab_size"] == 1024 and preset.text.items() <= text.items()
        config = writer.config_json(preset, ids, text, "original")
        assert config["model_type"] in family.model_types
        assert config["text_config"]["hidden_size"] == text["hidden_size"]
        ProjectorConfig(**writer.projector(text["hidden_size"]))
    template = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(chat.template)
    message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
    rendered = template.render(messages=[message], add_generation_prompt=True)
    assert family.prompt.image in rendered


def test_read_config_is_the_one_reader(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "glm4v"}')
    assert families.read_config(tmp_path) == families.read_config(str(tmp_path)) == {"model_type": "glm4v"}
    for body, words in ((None, r"no config\.json"), ("{", "not JSON"), ("[1]", "expected a JSON object")):
        d = tmp_path / str(len(words))
        d.mkdir()
        if body is not None:
            (d / "config.json").write_text(body)
        with pytest.raises(NotACheckpoint, match=words) as e:
            families.read_config(d)
        assert isinstance(e.value, ValueError) and isinstance(e.value, CheckpointError)  # both engines' refusals


def test_lookups_name_what_is_registered():
    with pytest.raises(KeyError, match="registered"):
        families.by_name("llava")
    assert families.by_model_type("llava") is None and families.by_model_type(None) is None
    assert families.spec_names() == {"kimi_k25": "kimi-k2.5-vision", "kimi_vl": "kimi-vl-a3b",
                                     "glm4v": "glm-5.2-vision"}
    assert PreprocessConfig().policy == families.by_name("kimi_k25").preprocess.policy  # the default policy
