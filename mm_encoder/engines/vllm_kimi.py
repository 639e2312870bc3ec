"""vLLM general plugin: vLLM's Kimi-K2.5 loads a checkpoint as transformers' `save_pretrained` writes it.

transformers 5's `Kimi_K25ForConditionalGeneration.save_pretrained` reverses its load-time renames
over every tensor: the language model comes out as `language_model.model.blocks.*` and the
projector's norm under `model.mm_projector.*` (`families/kimi_k25.py` `SAVE_PRETRAINED_RENAMES`). vLLM 0.31's
`KimiK25ForConditionalGeneration` maps only the released names, so such a checkpoint (a fine-tune
saved with transformers) stops in vLLM's loader on a KeyError. This plugin re-registers the
architecture to a subclass of vLLM's own class whose weight-name mapper first turns those two
prefixes into the released ones, then applies vLLM's own mapping. No released name starts with
either prefix, so a released checkpoint loads exactly as before.

Loaded through the `vllm.general_plugins` entry point `mm_encoder_kimi` (pyproject.toml; exclude it
with `VLLM_PLUGINS`). As `vllm_glm` does: vLLM is imported only inside functions, `register()` is
idempotent and never raises, and where vLLM's registry is not 0.31's it logs a warning and leaves
vLLM's built-in model in place.
"""

from __future__ import annotations

import logging
import threading

from ..families import kimi_k25

logger = logging.getLogger(__name__)

((ARCHITECTURE, BUILTIN),) = kimi_k25.VLLM.plugin.items()  # the architecture and vLLM 0.31's (module, class)
CLASS = "MmEncoderKimiK25ForConditionalGeneration"
_lock = threading.Lock()
_built: dict[str, type] = {}


def register() -> None:
    """`vllm.general_plugins` entry point: point Kimi-K2.5's architecture at this module's class.
    Touches only vLLM's model registry (lazily, by `module:class`); the class is built when vLLM
    first resolves the architecture (`__getattr__`)."""
    try:
        _register()
    except Exception:
        logger.warning("mm_encoder Kimi plugin: registration failed; vLLM's Kimi-K2.5 left as built in",
                       exc_info=True)


def _register() -> None:
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(ARCHITECTURE)
    found = (getattr(entry, "module_name", None), getattr(entry, "class_name", None))
    if found == (__name__, CLASS):
        return  # already ours: vLLM calls register() many times per process
    if found != BUILTIN:
        logger.warning("mm_encoder Kimi plugin: %s is registered to %s, not vLLM 0.31's %s:%s; left as is",
                       ARCHITECTURE, found, *BUILTIN)
        return
    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{CLASS}")


def __getattr__(name: str) -> type:
    """The class vLLM's registry resolves `CLASS` to, built once (model code is imported here)."""
    if name != CLASS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in _built:
            from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration as base
            from vllm.model_executor.models.utils import WeightsMapper

            mapper = WeightsMapper(orig_to_new_prefix=dict(kimi_k25.VLLM.weight_renames)) | base.hf_to_vllm_mapper
            _built[name] = type(CLASS, (base,), {
                "__module__": __name__, "__qualname__": CLASS, "hf_to_vllm_mapper": mapper,
                "__doc__": f"vLLM's {base.__name__}, which also loads transformers' save_pretrained tensor names."})
        return _built[name]
