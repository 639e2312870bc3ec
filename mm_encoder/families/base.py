"""What a model family provides, as plain data (no torch): the facets each family module fills in.

A facet is its facts, or `NotServed` saying why that part of the project does not serve the family
(and what does). The code that needs torch, transformers or vLLM stays in `model/` and `engines/`
and reads its facts here:
- `spec`: the registry model (configs/models/) a checkpoint of the family starts from: its
  preprocessing and prompt, before the checkpoint's own files (`families.model_card`, `model.checkpoint`);
- `vision_config`: config.json's `vision_config` keys -> the tower's and projector's fields
  (`model.hf_config`);
- `preprocess`: the resize rule (`model.preprocess`) and the reader of the checkpoint's
  preprocessor_config.json (`model.hf_config`);
- `prompt`: the strings a media item is written with in the prompt (the spec states the same);
- `transformers`: the classes and tensor names the transformers engine loads (`engines.llm`);
- `vllm`: how vLLM 0.31 takes the family's embeddings (`engines.vllm_inputs`, the GLM plugin);
- `checkpoint`: what `engines.tiny_checkpoint` writes for the family (presets, config.json, the
  tokenizer's special tokens and chat template).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..core.spec import PreprocessConfig, PromptConfig, TowerConfig

CONTEXT_LENGTH = 32768  # a generated checkpoint's: a 4K photo is 4,214 tokens under the K2.5 policy; several fit


@dataclass(frozen=True)
class NotServed:
    """A facet a family does not have here, and why."""

    reason: str


# --- config mapping ----------------------------------------------------------------------------

KeyTarget = tuple[str, str]  # ("tower" | "projector" | "check", field): where a config key goes


@dataclass(frozen=True)
class VisionFormat:
    """One layout of config.json's `vision_config`: each key it may state, the keys whose only
    implemented value it fixes, and the projector it implies. Any other key is refused by name."""

    name: str  # the layout's model_type, as errors name it
    keys: Mapping[str, KeyTarget]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    projector: str | None = None  # the projector type the layout implies (else a key states it)
    top: Mapping[str, KeyTarget] = field(default_factory=dict)  # config.json's own keys this layout reads
    title: str = ""  # how errors name the layout


@dataclass(frozen=True)
class VisionConfig:
    """A family's `vision_config` layouts: the release's and, where transformers' class saves
    another, that one, told apart by the release's `release_prefix` keys and the second layout's own."""

    release: VisionFormat
    transformers: VisionFormat | None = None
    release_prefix: str = "vt_"
    also: tuple[str, ...] = ()  # further model_types whose vision_config reads as `release`


# --- preprocessing policy ----------------------------------------------------------------------

Target = Callable[[int, int, int, PreprocessConfig, int], tuple[int, int]]
Check = Callable[[int, int, int, int, PreprocessConfig], None]
ProcessorReader = Callable[[dict[str, Any], PreprocessConfig, TowerConfig], dict[str, Any]]


@dataclass(frozen=True)
class PreprocessRule:
    """A `PreprocessConfig.policy`: the resize rule (width, height, patch limit, config, patch) ->
    the new (width, height); `check` refuses a resized grid (h, w patches) the model cannot take;
    `reader` turns the released image processor's preprocessor_config.json into PreprocessConfig
    fields (`processor`: its class name; `layout_key`: a key that names it where no class does)."""

    policy: str
    target: Target
    check: Check | None = None
    processor: str | None = None
    reader: ProcessorReader | None = None
    layout_key: str | None = None


# --- engines -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformersFacts:
    """How the checkpoint's language model maps onto transformers' classes (names, not imports)."""

    config_class: str  # the whole model's config class (it reads the checkpoint's config.json)
    text_model: str  # the text model's class; with its LM head unless `head_apart`
    text_config_class: str  # the text model's config class (what a generated checkpoint is built from)
    renames: tuple[tuple[str, str], ...]  # checkpoint name pattern -> the text model's own name
    head_apart: bool = False  # `text_model` has no LM head: `lm_head.weight` is loaded beside it
    mrope: bool = False  # M-RoPE positions from each image's grid (transformers' GLM `get_rope_index`)
    monolithic: str | None = None  # the whole model's class, where its vision tower is the checkpoint's


@dataclass(frozen=True)
class VllmInput:
    """How one vLLM model family takes embeddings.

    `route="mm"`: the placeholder token vLLM expands per item, the keys of its per-modality dict
    and the merge size (rows per grid = t*h*w // merge**2, the slicing its field config applies).
    `route="embeds"`: the modalities the prompt may hold (any token ids; vLLM reads the rows) and
    what `limit_mm_per_prompt` leaves the vision tower out with."""

    name: str
    architectures: tuple[str, ...]
    route: Literal["mm", "embeds"] = "mm"
    token_ids: Mapping[str, int] = field(default_factory=dict)  # modality -> placeholder id ("mm")
    merge: int = 2
    width: int | None = None  # the embeddings' width the model takes, from the checkpoint's config
    no_tower: Mapping[str, int] = field(default_factory=dict)  # limit_mm_per_prompt that skips the tower
    deepstack: bool = False  # Qwen3-VL: rows carry the main and every deepstack level, side by side
    vllm_architecture: str | None = None  # the name vLLM registers, when the config states another
    deepseek: bool = False  # the text model is vLLM's DeepseekV2/V3 (MLA + MoE): `engines.vllm` completes its config
    plugin: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # arch -> vLLM 0.31's (module, class)
    # that this package's vLLM plugin re-registers (engines/vllm_glm.py, engines/vllm_kimi.py)
    weight_renames: Mapping[str, str] = field(default_factory=dict)  # tensor-name prefixes the plugin maps
    # before vLLM's own mapping (checkpoints written by transformers' save_pretrained)

    def rows(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def with_config(self, hf_config: Any) -> VllmInput:
        """The ids, merge size and embeddings width a checkpoint's config states."""
        ids = dict(self.token_ids)
        for m in ids:
            value = _get(hf_config, f"{m}_token_id")
            if isinstance(value, int):
                ids[m] = value
        vision = _get(hf_config, "vision_config")
        merge = _get(vision, "spatial_merge_size")
        return replace(self, token_ids=ids, merge=merge if isinstance(merge, int) else self.merge,
                       width=embeds_width(hf_config, deepstack=self.deepstack))


def _get(obj: Any, key: str) -> Any:
    """A config field from a transformers config object or a config.json dict."""
    if obj is None:
        return None
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def embeds_width(hf_config: Any, *, deepstack: bool = False) -> int | None:
    """The width vLLM's model takes an item's rows in: the text model's hidden size, except
    Qwen3-VL, which splits its rows into the main embedding and one per deepstack level
    (`out_hidden_size x (1 + len(deepstack_visual_indexes))`, `_compute_deepstack_embeds`)."""
    vision = _get(hf_config, "vision_config")
    if deepstack and _get(vision, "out_hidden_size"):
        return int(_get(vision, "out_hidden_size")) * (1 + len(_get(vision, "deepstack_visual_indexes") or ()))
    text = _get(hf_config, "text_config")
    width = _get(text, "hidden_size") or _get(hf_config, "hidden_size")
    return int(width) if width else None


# --- the generated checkpoint ------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Sizes of a generated checkpoint: `tiny` for the demo and the tests (written in about a
    second), `small` for benchmarks that should cost like a model, still on 2 CPU cores."""

    vision: dict[str, Any]  # TowerConfig fields
    text: dict[str, Any]  # the text model's config fields (DeepseekV3Config, Glm4vTextConfig)
    family: str = "kimi_k25"
    vocab_size: int = 1024
    shard_bytes: int = 16 << 20
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatFormat:
    """A family's special tokens and chat template (the real vocabularies have the specials after
    ~160k ordinary tokens; here they follow a small trained vocabulary)."""

    template: str
    specials: tuple[str, ...]
    bos: str
    eos: str  # what ends an assistant turn: generation_config's eos
    pad: str
    tiktoken: bool = False  # Kimi's tokenizer: its split pattern, and its tiktoken vocabulary file beside


ConfigWriter = Callable[[Preset, dict[str, int], dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class CheckpointWriter:
    """What `engines.tiny_checkpoint` writes for the family: its presets, the text config every
    preset shares (`text_defaults`, its token ids by special token: `text_token_ids`), config.json
    (`config_json(preset, ids, text_config, format)`), the projector's fields for a text width, the
    language model's tensors renamed from transformers' in-memory names to the release's
    (`release_names`, on the state dict with the LM head as `lm_head.weight`), and the tokenizer."""

    presets: Mapping[str, Preset]
    text_defaults: Mapping[str, Any]
    text_token_ids: Mapping[str, str]
    config_json: ConfigWriter
    projector: Callable[[int], dict[str, Any]]
    release_names: Callable[[dict[str, Any]], dict[str, Any]]
    chat: ChatFormat


# --- the family --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One model family: every facet, each its facts or `NotServed` with the reason."""

    name: str  # what the engines print (`family=`); the checkpoint presets' `family`
    title: str
    model_types: tuple[str, ...]  # config.json's `model_type`s served as this family (not the vLLM-only ones)
    spec: str | NotServed
    vision_config: VisionConfig | NotServed
    preprocess: PreprocessRule | NotServed
    prompt: PromptConfig | NotServed
    transformers: TransformersFacts | NotServed
    vllm: tuple[VllmInput, ...] | NotServed
    checkpoint: CheckpointWriter | NotServed
