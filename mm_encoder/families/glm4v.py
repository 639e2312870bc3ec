"""GLM-4.xV / GLM-5.2 vision (`model_type: glm4v`): MoonViT under a GLM merger into GLM-4.1V's text
model, whose positions are M-RoPE (3-D, from each image's grid).

- config: GLM-4.xV's merger keys; its `hidden_size`/`depth`/`num_heads` describe GLM's own ViT, not
  MoonViT, so they are refused; a MoonViT tower under a GLM merger states the tower with the `vt_*`
  keys. GLM-4.5V/4.6V's `glm4v_moe` reads the same.
- preprocessing: Kimi-K2.5's (the tower is the same MoonViT).
- transformers: GLM-4.1V's text model (`model.language_model.*`) and its head (`lm_head.*`), M-RoPE
  positions from transformers' own `Glm4vModel.get_rope_index`; the whole model's vision tower is
  GLM's own ViT, not the checkpoint's MoonViT, so there is no monolithic load.
- vLLM: the per-modality embeddings dict through this package's plugin (engines/vllm_glm.py);
  images only.
- the generated checkpoint: `glm-tiny`.
"""

from __future__ import annotations

from typing import Any

from ..core.spec import PromptConfig
from . import kimi_k25, moonvit
from .base import (
    CONTEXT_LENGTH,
    ChatFormat,
    CheckpointWriter,
    Family,
    Preset,
    TransformersFacts,
    VisionConfig,
    VisionFormat,
    VllmInput,
)

# `intermediate_size` is the merger's SwiGLU width and `out_hidden_size` its output.
RELEASE = VisionFormat("glm4v", {
    **moonvit.VT, **moonvit.COMMON,
    "out_hidden_size": ("projector", "out_dim"),
    "intermediate_size": ("projector", "context_dim"),
}, fixed={"hidden_act": "silu"}, projector="glm")

IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
PROMPT = PromptConfig(image=IMAGE, video="{timestamp}<|begin_of_video|><|image|><|end_of_video|>",
                      placeholder="<|image|>")

#: Built-in architecture -> (vLLM module, class) that vLLM 0.31 registers for it, each of which this
#: package's plugin re-registers (engines/vllm_glm.py). GLM-4.6V ships as
#: `Glm4vMoeForConditionalGeneration` (4.6V-Flash as `Glm4vForConditionalGeneration`). Not here:
#: `GLM4VForCausalLM` (the older GLM-4V-9B, another encoder) and `GlmOcrForConditionalGeneration`
#: (GLM-OCR's own tower, which this project's encoder does not produce).
VLLM_CLASSES = {
    "Glm4vForConditionalGeneration": ("vllm.model_executor.models.glm4_1v", "Glm4vForConditionalGeneration"),
    "Glm4vMoeForConditionalGeneration": ("vllm.model_executor.models.glm4_1v", "Glm4vMoeForConditionalGeneration"),
    "Glm5NextForConditionalGeneration": ("vllm.models.glm5next", "Glm5NextForConditionalGeneration"),
}

# vLLM's model and field config take image embeddings; its data parser does only with this
# package's plugin (engines/vllm_glm.py, loaded by vLLM through its entry point). Images only.
VLLM = VllmInput("glm4v", tuple(VLLM_CLASSES), token_ids={"image": 151343}, plugin=VLLM_CLASSES)

# --- the generated checkpoint ------------------------------------------------------------------

# GLM-4.xV's chat template: `[gMASK]<sop>`, a role tag and a newline per message, images between their markers.
TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}<|{{ m['role'] }}|>\n"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] is not none -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}" + IMAGE +
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{%- endif -%}"
)
CHAT = ChatFormat(TEMPLATE, (
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
    "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>", "<|end_of_video|>"),
    bos="<sop>", eos="<|user|>", pad="<|endoftext|>")

PRESETS = {
    "glm-tiny": Preset(
        vision={"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_layers": 2},
        text={"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5, "mrope_section": [4, 6, 6]}},
        family="glm4v", shard_bytes=1 << 20,
    ),
}


def config_json(preset: Preset, ids: dict[str, int], text: dict[str, Any], fmt: str) -> dict[str, Any]:
    """GLM-4.1V's config.json with a MoonViT tower under its merger (`vt_*` keys, as glm-5.2-vision
    states it); one format."""
    return {
        "model_type": "glm4v", "architectures": ["Glm4vForConditionalGeneration"], "tie_word_embeddings": False,
        "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"], "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"], "video_end_token_id": ids["<|end_of_video|>"],
        "text_config": text,
        "vision_config": {**moonvit.vt_keys(preset.vision), "out_hidden_size": text["hidden_size"],
                          "intermediate_size": 2 * text["hidden_size"], "hidden_act": "silu"},
    }


def release_names(state: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.1V's text model and its head in GLM-4.xV's checkpoint names."""
    return {k if k == "lm_head.weight" else "model.language_model." + k: v for k, v in state.items()}


FAMILY = Family(
    name="glm4v",
    title="GLM-4.xV / GLM-5.2 vision",
    model_types=("glm4v",),
    spec="glm-5.2-vision",
    vision_config=VisionConfig(RELEASE, also=("glm4v_moe",)),
    preprocess=kimi_k25.PREPROCESS,
    prompt=PROMPT,
    transformers=TransformersFacts(
        config_class="Glm4vConfig", text_model="Glm4vTextModel", text_config_class="Glm4vTextConfig",
        renames=((r"^model\.language_model\.", "model."), (r"^lm_head\.", "lm_head.")),
        head_apart=True, mrope=True, monolithic=None),  # its vision tower is MoonViT, not GLM's own ViT
    vllm=(VLLM,),
    checkpoint=CheckpointWriter(
        presets=PRESETS, text_defaults={"model_type": "glm4v_text", "max_position_embeddings": CONTEXT_LENGTH},
        text_token_ids={"eos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>"},
        config_json=config_json,
        projector=lambda width: {"type": "glm", "out_dim": width, "context_dim": 2 * width},
        release_names=release_names, chat=CHAT),
)
