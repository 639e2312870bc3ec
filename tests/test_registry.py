"""Model registry: every served name resolves; GLM-5.2 is one small file; errors list names."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_encoder import Encoder, UnknownModelError, get_spec, list_models
from mm_encoder.core.registry import config_dir
from mm_encoder.model.checkpoint import build_empty

GLM_NAMES = ["glm-5.2-vision", "zai-org/GLM-5.2", "GLM-5.2-Fast", "GLM-5.2-1M"]


def test_required_models_registered():
    names = {s.name for s in list_models()}
    assert {"tiny", "kimi-k2.5-vision", "glm-5.2-vision"} <= names
    assert get_spec("kimi-k2.5-vision").projector.out_dim == 7168
    assert get_spec("kimi-k2.5-vision").projector.type == "patchmerger"


@pytest.mark.parametrize("name", GLM_NAMES)
def test_glm_loads_by_every_alias(name):
    spec = get_spec(name)
    assert spec.name == "glm-5.2-vision" and spec.projector.type == "glm" and spec.projector.out_dim == 6144
    assert spec.tower == get_spec("kimi-k2.5-vision").tower  # the same frozen MoonViT
    model = build_empty(spec)  # shapes only; the real widths would take GBs to materialise
    assert model.mm_projector.down_proj.weight.shape == (6144, spec.projector.context_dim)
    assert model.mm_projector.proj.weight.shape == (6144, 4 * 1152)


def test_glm_is_one_small_file():
    path = config_dir() / "models" / "glm-5.2-vision.yaml"
    assert len(path.read_text().splitlines()) <= 40


def test_aliases_case_insensitive_and_unknown_lists_names():
    assert get_spec("glm-5.2-fast").name == "glm-5.2-vision"
    with pytest.raises(UnknownModelError) as e:
        Encoder.from_pretrained("no-such-model")
    assert e.value.code == "unknown_model"
    for served in ("tiny", "kimi-k2.5-vision", "zai-org/GLM-5.2"):
        assert served in str(e.value)


def test_identity_differs_between_models_and_processor_settings():
    tiny, kimi = get_spec("tiny"), get_spec("kimi-k2.5-vision")
    assert tiny.identity() != kimi.identity()
    other = tiny.preprocess.model_copy(update={"in_patch_limit": 4096})
    assert tiny.identity(other) != tiny.identity()


def test_configs_dir_env_override(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    src = Path(config_dir())
    (models / "tiny.yaml").write_text((src / "models" / "tiny.yaml").read_text().replace("name: tiny", "name: tiny2"))
    (tmp_path / "towers").mkdir()
    (tmp_path / "towers" / "moonvit-tiny.yaml").write_text((src / "towers" / "moonvit-tiny.yaml").read_text())
    monkeypatch.setenv("MM_ENCODER_CONFIGS", str(tmp_path))
    assert get_spec("tiny2").name == "tiny2"
