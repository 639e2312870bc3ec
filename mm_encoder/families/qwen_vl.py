"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and its MoE): served by the vLLM adapter only.

vLLM takes their per-modality embeddings dict (`image_embeds` + `image_grid_thw`, one placeholder
per item, expanded and M-RoPE-positioned by vLLM itself). The embeddings come from an encoder that
runs Qwen's own ViT; this project's encoder is MoonViT, so no registry spec, config mapping,
preprocessing or prompt is stated here, and vLLM's Qwen processor writes the prompt. Known by
their vLLM architectures only (no `model_type` is served as Qwen elsewhere).
"""

from __future__ import annotations

from .base import Family, NotServed, VllmInput

_QWEN_IDS = {"image": 151655, "video": 151656}  # <|image_pad|>, <|video_pad|>
_NO_ENCODER = "this project's encoder is MoonViT; Qwen-VL's embeddings come from Qwen's own ViT"

FAMILY = Family(
    name="qwen_vl",
    title="Qwen2-VL / Qwen2.5-VL / Qwen3-VL",
    model_types=(),
    spec=NotServed(_NO_ENCODER + " (no registry model)"),
    vision_config=NotServed(_NO_ENCODER + " (no vision_config is read)"),
    preprocess=NotServed(_NO_ENCODER + " (Qwen's image processor is not implemented)"),
    prompt=NotServed("vLLM's own Qwen processor writes and expands the placeholders (token ids in `vllm`)"),
    transformers=NotServed("the transformers engine serves the families whose vision tower is this project's "
                           "MoonViT; serve Qwen-VL with vLLM"),
    vllm=(
        VllmInput("qwen2_vl", ("Qwen2VLForConditionalGeneration",), token_ids=_QWEN_IDS),
        VllmInput("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), token_ids=_QWEN_IDS),
        # Video left out: vLLM's Qwen3-VL expands a video into per-frame timestamped runs, which needs
        # frame metadata a wire body does not carry (not verified, so refused).
        VllmInput("qwen3_vl", ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
                  token_ids={"image": 151655}, deepstack=True),
    ),
    checkpoint=NotServed("no Qwen-VL checkpoint is generated here: the adapter's Qwen inputs are unit-tested "
                         "(tests/test_vllm.py), not served"),
)
