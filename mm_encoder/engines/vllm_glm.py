"""vLLM general plugin: lets vLLM's GLM-4.xV models take mm-encoder's precomputed image embeddings.

vLLM 0.31's GLM-4.1V / 4.5V / 4.6V (`glm4_1v.py`) and GLM-5-Next model classes and field configs
already accept `image_embeds` + `image_grid_thw`, but their processing info's `get_data_parser`
returns the plain parser, which reads `{"image": {"image_embeds": E, "image_grid_thw": G}}` as a
list of two "images" (its keys). This plugin makes exactly the change vLLM PR #30037 made for
Qwen3-VL, without editing vLLM:

- each built-in GLM vision architecture (`ARCHITECTURES`) is re-registered with
  `ModelRegistry.register_model` to a subclass of vLLM's own model class whose processor
  registration differs only in its processing info;
- that info's `get_data_parser` returns a `Qwen2VLMultiModalDataParser` (with the vision config's
  `spatial_merge_size` and the built-in parser's settings), for images only: a video embeddings
  dict stays refused. It also checks rows and width up front, so a malformed tensor is a request
  error rather than an engine-core crash.

Loaded through the `vllm.general_plugins` entry point `mm_encoder_glm` (pyproject.toml; exclude it
with `VLLM_PLUGINS`). vLLM calls `register()` in every vLLM process, possibly many times, and imports
plugins early, so this module imports vLLM only inside functions, `register()` is idempotent and
never raises, and wherever vLLM's internals differ from 0.31's it logs a warning naming what it
could not find and leaves vLLM's built-in model in place.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ..families import glm4v

if TYPE_CHECKING:  # vLLM 0.31's own names (vLLM is not installed where mypy runs: Any to it)
    import torch
    from vllm.inputs import ModalityData
    from vllm.multimodal.inputs import ImageItem, VideoItem
    from vllm.multimodal.parse import ModalityDataItems, MultiModalDataParser

logger = logging.getLogger(__name__)

#: Built-in architecture -> (vLLM module, class) that vLLM 0.31 registers for it: the GLM family's
#: (`families/glm4v.py`, `VLLM_CLASSES`, which says which GLM models are in and which are not).
ARCHITECTURES: Mapping[str, tuple[str, str]] = glm4v.VLLM.plugin
CLASS_PREFIX = "MmEncoder"
IMAGE_FIELDS = {"image_embeds": "values", "image_grid_thw": "metadata"}

_ARCH_BY_CLASS = {CLASS_PREFIX + arch: arch for arch in ARCHITECTURES}
_classes: dict[str, type] = {}
_lock = threading.RLock()
_warned: set[str] = set()


def class_name(arch: str) -> str:
    """The name of this module's class that replaces `arch` (`module:class` for the registry)."""
    return CLASS_PREFIX + arch


def _warn_once(msg: str, *args: object) -> None:
    key = msg % args
    if key not in _warned:
        _warned.add(key)
        logger.warning("mm_encoder GLM plugin: " + msg, *args)


def register() -> None:
    """`vllm.general_plugins` entry point: point each GLM vision architecture at this module's class.

    Only touches vLLM's model registry (lazily, by `module:class`), so no model code is imported here;
    the classes are built when vLLM first resolves an architecture (`__getattr__`). Never raises: a
    plugin exception would abort whichever vLLM process is loading plugins.
    """
    try:
        _register()
    except Exception:
        logger.warning("mm_encoder GLM plugin: registration failed; vLLM's GLM models left as built in", exc_info=True)


def _register() -> None:
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError as exc:
        _warn_once("cannot import vllm.model_executor.models.registry.ModelRegistry (%s); nothing registered", exc)
        return
    models = getattr(ModelRegistry, "models", None)
    if not isinstance(models, dict) or not callable(getattr(ModelRegistry, "register_model", None)):
        _warn_once("vLLM's ModelRegistry has no `models` dict / `register_model`; nothing registered")
        return
    for arch, expected in ARCHITECTURES.items():
        entry = models.get(arch)
        found = (getattr(entry, "module_name", None), getattr(entry, "class_name", None))
        if found == (__name__, class_name(arch)):
            continue  # already ours: register() runs many times per process
        if entry is None:
            _warn_once("vLLM has no architecture %s; left unregistered", arch)
            continue
        if found != expected:
            _warn_once("architecture %s is registered to %s, not vLLM 0.31's %s:%s; left as is", arch, found, *expected)
            continue
        ModelRegistry.register_model(arch, f"{__name__}:{class_name(arch)}")
        logger.debug("mm_encoder GLM plugin: %s -> %s:%s", arch, __name__, class_name(arch))


def __getattr__(name: str) -> type:
    """Build (once) the class vLLM's registry resolves `MmEncoder<arch>` to; model code is imported here."""
    arch = _ARCH_BY_CLASS.get(name)
    if arch is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in _classes:
            _classes[name] = _build(arch)
        return _classes[name]


def _build(arch: str) -> type:
    """vLLM's model class for `arch`, subclassed with the embeddings-aware processing info.

    An import error of vLLM's own module propagates (the built-in would fail the same way and vLLM
    logs it); if the processor internals are not 0.31's, vLLM's own class is returned unchanged.
    """
    module_name, base_name = ARCHITECTURES[arch]
    base: type = getattr(importlib.import_module(module_name), base_name)
    try:
        return _subclass(arch, base)
    except _Unexpected as exc:
        _warn_once("%s; %s keeps vLLM's built-in data parser (no image embeddings)", exc, arch)
        return base


class _Unexpected(Exception):
    """vLLM's internals are not what this plugin was written against (0.31)."""


def _need(obj: Any, attr: str, where: str) -> Any:
    value = getattr(obj, attr, None)
    if value is None:
        raise _Unexpected(f"cannot find {where}.{attr}")
    return value


def _subclass(arch: str, base: type) -> type:
    try:
        from vllm.multimodal import MULTIMODAL_REGISTRY
    except ImportError as exc:
        raise _Unexpected(f"cannot import vllm.multimodal.MULTIMODAL_REGISTRY ({exc})") from exc
    factories = _need(base, "_processor_factory", base.__name__)
    info_base = _need(factories, "info", f"{base.__name__}._processor_factory")
    processor = _need(factories, "processor", f"{base.__name__}._processor_factory")
    dummy_inputs = _need(factories, "dummy_inputs", f"{base.__name__}._processor_factory")
    if not isinstance(info_base, type):
        raise _Unexpected(f"{base.__name__}'s processing info factory is not a class ({info_base!r})")
    for attr in ("get_data_parser", "get_hf_config", "allow_missing_mm_embeddings"):
        _need(info_base, attr, info_base.__name__)
    parser_cls = _parser_class()

    class Info(info_base):  # type: ignore[misc, valid-type]
        def get_data_parser(self) -> MultiModalDataParser:
            """The built-in parser's settings, but an image embeddings dict parses into embedding items."""
            builtin = super().get_data_parser()
            return parser_cls(
                self.get_hf_config().vision_config.spatial_merge_size,
                video_needs_metadata=builtin.video_needs_metadata,
                expected_hidden_size=builtin.expected_hidden_size,
                allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
            )

    Info.__name__ = Info.__qualname__ = CLASS_PREFIX + info_base.__name__
    Info.__module__ = __name__
    Info.__doc__ = f"{info_base.__name__} whose data parser also takes `image_embeds` + `image_grid_thw`."

    model_cls = type(
        class_name(arch),
        (base,),
        {
            "__module__": __name__,
            "__qualname__": class_name(arch),
            "__doc__": f"vLLM's {base.__name__}, with a processing info that parses image embeddings.",
        },
    )
    MULTIMODAL_REGISTRY.register_processor(processor, info=Info, dummy_inputs=dummy_inputs)(model_cls)
    return model_cls


def _parser_class() -> type:
    """`Qwen2VLMultiModalDataParser` narrowed to images, with up-front shape checks (built once)."""
    with _lock:
        if "parser" in _classes:
            return _classes["parser"]
        try:
            from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser
            from vllm.multimodal.parse import MultiModalDataParser
        except ImportError as exc:
            raise _Unexpected(f"cannot import Qwen2VLMultiModalDataParser / MultiModalDataParser ({exc})") from exc
        fields = getattr(Qwen2VLMultiModalDataParser, "embedding_fields", None)
        if not isinstance(fields, Mapping) or dict(fields.get("image", {})) != IMAGE_FIELDS:
            raise _Unexpected(f"Qwen2VLMultiModalDataParser.embedding_fields['image'] is not {IMAGE_FIELDS}")
        params = inspect.signature(Qwen2VLMultiModalDataParser.__init__).parameters
        if next(iter(list(params)[1:]), None) != "spatial_merge_size":
            raise _Unexpected("Qwen2VLMultiModalDataParser.__init__ does not take spatial_merge_size first")
        base_params = inspect.signature(MultiModalDataParser.__init__).parameters
        for kw in ("video_needs_metadata", "expected_hidden_size", "allow_missing_mm_embeddings"):
            if kw not in base_params:
                raise _Unexpected(f"MultiModalDataParser.__init__ takes no {kw}")
        for meth in ("_parse_image_data", "_parse_video_data"):
            _need(Qwen2VLMultiModalDataParser, meth, "Qwen2VLMultiModalDataParser")

        class GlmImageEmbedsParser(Qwen2VLMultiModalDataParser):
            """Image embeddings dict -> embedding items (sliced per image by its grid); no video embeddings."""

            embedding_fields: ClassVar[Mapping[str, Mapping[str, str]]] = {"image": dict(IMAGE_FIELDS)}

            def __init__(self, spatial_merge_size: int, **kwargs: Any) -> None:
                self.merge_size = int(spatial_merge_size)
                super().__init__(spatial_merge_size, **kwargs)

            def _parse_image_data(self, data: dict[str, torch.Tensor] | ModalityData[ImageItem]
                                  ) -> ModalityDataItems[Any, Any] | None:
                if isinstance(data, Mapping):
                    check_image_embeds(data, self.merge_size, self.expected_hidden_size)
                return super()._parse_image_data(data)

            def _parse_video_data(self, data: dict[str, torch.Tensor] | ModalityData[VideoItem]
                                  ) -> ModalityDataItems[Any, Any] | None:
                if isinstance(data, Mapping):
                    raise ValueError(
                        "video embeddings are not supported for GLM vision models (mm_encoder's vLLM plugin "
                        "enables image embeddings only); send the video itself"
                    )
                return MultiModalDataParser._parse_video_data(self, data)

        GlmImageEmbedsParser.__module__ = __name__
        GlmImageEmbedsParser.__qualname__ = GlmImageEmbedsParser.__name__
        _classes["parser"] = GlmImageEmbedsParser
        return GlmImageEmbedsParser


def check_image_embeds(data: Mapping[str, Any], merge_size: int, hidden_size: int | None) -> None:
    """Refuse an image embeddings dict whose rows or width cannot match its grids.

    vLLM slices `image_embeds` by `t*h*w // merge**2` rows per grid without checking the total, and
    the width is only met inside the model; a mismatch there would crash the engine core for every
    request in the batch, here it is one request's ValueError.
    """
    import torch

    grid = data.get("image_grid_thw")
    embeds = data.get("image_embeds")
    if not isinstance(grid, torch.Tensor) or grid.ndim != 2 or grid.shape[1] != 3 or grid.is_floating_point():
        raise ValueError(f"image_grid_thw must be an integer tensor [n_images, 3], got {_describe(grid)}")
    if bool((grid <= 0).any()):
        raise ValueError(f"image_grid_thw must be positive, got {grid.tolist()}")
    if bool((grid[:, 1:] % merge_size != 0).any()):
        raise ValueError(f"image_grid_thw h and w must be multiples of merge={merge_size}, got {grid.tolist()}")
    sizes = grid.prod(-1)
    if embeds is None:
        return  # allowed only where vLLM makes the values optional (an EC consumer); DictEmbeddingItems decides
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 2:
        raise ValueError(f"image_embeds must be a tensor [sum of rows, hidden], got {_describe(embeds)}")
    rows = int(sizes.sum()) // merge_size**2
    if embeds.shape[0] != rows:
        raise ValueError(
            f"image_embeds has {embeds.shape[0]} rows but image_grid_thw {grid.tolist()} needs {rows} "
            f"(t*h*w // {merge_size}**2 per image)"
        )
    if hidden_size is not None and embeds.shape[1] != hidden_size:
        raise ValueError(f"image_embeds width {embeds.shape[1]} != the model's hidden size {hidden_size}")


def _describe(value: object) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} {tuple(shape)}" if shape is not None else type(value).__name__
