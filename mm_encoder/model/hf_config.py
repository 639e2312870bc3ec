"""A checkpoint's own files over its registry spec, beside the loader that reads them.

`spec_from_hf_config` reads the tower and projector from `config.json` (a table of `vision_config`
keys per model_type: Kimi-K2.5's `vt_*`, Kimi-VL's unprefixed ones, transformers' Kimi-K2.5 format,
GLM-4.xV's merger keys), and `preprocess_from_hf` the preprocessing from `preprocessor_config.json`.
What does not map is refused by name, never defaulted. The tables and the processor readers are the
family modules' (`families/`: `VisionConfig`, `PreprocessRule.reader`); here is what applies them.
"""

from __future__ import annotations

from typing import Any

from ..core.errors import CheckpointError
from ..core.spec import ModelSpec, PreprocessConfig, ProjectorConfig, TowerConfig
from ..families import VisionConfig, VisionFormat, moonvit, processors, vision_configs

# vision_config keys that change neither shapes nor outputs: bookkeeping, storage dtype (we pick our
# own), attention backend, initialisation, the generic fields of transformers' PreTrainedConfig.to_dict().
_INFO_KEYS = frozenset({
    "model_type", "torch_dtype", "dtype", "_attn_implementation", "_attn_implementation_autoset",
    "_name_or_path", "auto_map", "architectures", "transformers_version", "initializer_range",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type",
})


def _layouts() -> dict[str, VisionFormat]:
    """Every vision_config layout by the name `_format` resolves to: config.json's model_types (each
    family's, `families/`), and a family's second layout by its own name (`kimi_k25_vision`)."""
    out = {}
    for model_type, config in vision_configs().items():
        out[model_type] = config.release
        if config.transformers is not None:
            out[config.transformers.name] = config.transformers
    return out


def _second_only(config: VisionConfig) -> set[str]:
    """The keys only the second layout states: what tells it from the release's."""
    assert config.transformers is not None
    return {k.split(".")[0] for k in [*config.transformers.keys, *config.transformers.fixed]} - set(config.release.keys)


def _format(vision: dict[str, Any], model_type: str, hf_top: bool = False) -> str:
    """The layout of a vision_config: a family with two (Kimi-K2.5) has them told apart by the release's
    `vt_*` keys (transformers' top-level projector keys, `hf_top`, decide a vision_config that states neither)."""
    config = vision_configs().get(model_type)
    second = config.transformers if config is not None else None
    if config is None or second is None:
        return model_type
    release = sorted(k for k in vision if k.startswith(config.release_prefix))
    hf = sorted(set(vision) & _second_only(config))
    if release and hf:
        raise CheckpointError(f"vision_config mixes the original release's keys ({', '.join(release)}) with "
                              f"{second.title} keys ({', '.join(hf)})")
    return second.name if hf or (hf_top and not release) else model_type


def _vision_updates(vision: dict[str, Any], model_type: str) -> dict[str, dict[str, Any]]:
    """vision_config -> {"tower": ..., "projector": ..., "check": ...} field updates; unmapped keys
    and unsupported values are one error that names each of them."""
    model_type = _format(vision, model_type)
    if isinstance(rope := vision.get("rope_parameters", ()), dict | None):  # nested: its keys are named flat
        vision = {**{k: v for k, v in vision.items() if k != "rope_parameters"},
                  **{f"rope_parameters.{k}": v for k, v in (rope or {}).items()}}
    layout = _layouts()[model_type]
    table = layout.keys
    fixed = {**moonvit.FIXED, **layout.fixed}
    updates: dict[str, dict[str, Any]] = {"tower": {}, "projector": {}, "check": {}}
    unknown, wrong = [], []
    for key, value in vision.items():
        if key in table:
            part, fld = table[key]
            updates[part][fld] = tuple(value) if fld == "merge_kernel" else value
        elif key in fixed:
            if value != fixed[key]:
                wrong.append(f"{key}={value!r} (only {fixed[key]!r} is implemented)")
        elif key not in _INFO_KEYS:
            unknown.append(key)
    if unknown or wrong:
        problems = ([f"keys {', '.join(sorted(unknown))} do not map onto this model"] if unknown else []) + wrong
        raise CheckpointError(f"vision_config of model_type {model_type!r}: " + "; ".join(problems))
    return updates


def spec_from_hf_config(config: dict[str, Any], base: ModelSpec, revision: str) -> ModelSpec:
    """Overlay the tower/projector facts of a checkpoint's config.json on a registry spec.

    Each model_type has its family's layouts of vision_config keys (`families/`: VisionConfig; Kimi-K2.5
    has two formats); a key it does not map is an error naming it, never a silent default. Keys the config
    leaves out keep the registry's values. `media_placeholder_token_id` (the release) or `image_token_id`
    (transformers) is the prompt's placeholder_id.
    """
    model_type = config.get("model_type")
    known = vision_configs()
    if model_type not in known:
        raise CheckpointError(f"config.json model_type {model_type!r} is not understood; "
                              f"known: {sorted(known)}")
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    tops = {key: layout for layout in _layouts().values() for key in layout.top}
    top = sorted(k for k in tops if k in config)
    fmt = _format(vision, model_type, bool(top))
    if top and fmt != tops[top[0]].name:
        raise CheckpointError(f"config.json keys {', '.join(top)} are {tops[top[0]].title} format, "
                              f"but its vision_config is not (model_type {model_type!r}, keys read as {fmt!r})")
    updates = _vision_updates(vision, fmt)
    for key in top:
        part, fld = tops[key].top[key]
        updates[part][fld] = config[key]
    proj = {**base.projector.model_dump(), **updates["projector"]}
    layout = _layouts()[fmt]
    if layout.projector is not None:
        proj["type"] = layout.projector
    if "out_dim" not in updates["projector"] and text.get("hidden_size"):
        proj["out_dim"] = text["hidden_size"]
    try:
        tower = TowerConfig.model_validate({**base.tower.model_dump(), **updates["tower"]})
        projector = ProjectorConfig.model_validate(proj)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"vision_config of model_type {model_type!r}: {e}") from None
    for fld, value in updates["check"].items():
        if value != getattr(tower, fld):
            raise CheckpointError(f"vision_config: the projector takes width {value}, the tower's {fld} is "
                                  f"{getattr(tower, fld)}")
    ids = {config[k] for k in ("media_placeholder_token_id", "image_token_id") if k in config}
    if len(ids) > 1:
        raise CheckpointError(f"config.json: media_placeholder_token_id and image_token_id differ ({sorted(ids)})")
    prompt = base.prompt.model_copy(update={"placeholder_id": ids.pop()}) if ids else base.prompt
    return base.model_copy(update={"tower": tower, "projector": projector, "prompt": prompt, "revision": revision})


# --- Hugging Face preprocessor_config.json -----------------------------------------------------

def processor_type(doc: dict[str, Any]) -> str | None:
    """`image_processor_type`, else the class that `auto_map.AutoImageProcessor` names, else the
    processor whose layout key the file has (Kimi-K2.5's: everything under `media_proc_cfg`)."""
    named = doc.get("image_processor_type")
    auto_map = doc.get("auto_map")
    auto = auto_map.get("AutoImageProcessor") if isinstance(auto_map, dict) else None
    if named is None and isinstance(auto, str):
        named = auto.rsplit(".", 1)[-1]
    if named is None:
        named = next((name for name, rule in processors().items() if rule.layout_key and rule.layout_key in doc),
                     None)
    return named


def preprocess_from_hf(doc: dict[str, Any], base: PreprocessConfig, tower: TowerConfig) -> PreprocessConfig:
    """A checkpoint's preprocessor_config.json is the authority on its preprocessing: the policy,
    its limits, mean and std. An unknown processor, or a key that would change the pixels and that
    we do not implement, is refused by name."""
    kind = processor_type(doc)
    known = processors()
    reader = known[kind].reader if kind in known else None
    if kind is None or reader is None:
        raise CheckpointError(f"preprocessor_config.json: image processor {kind!r} is not implemented; "
                              f"known: {sorted(known)}")
    update = reader(doc, base, tower)
    try:
        return PreprocessConfig.model_validate({**base.model_dump(), **update})
    except ValueError as e:
        raise CheckpointError(f"preprocessor_config.json ({kind}): {e}") from None
