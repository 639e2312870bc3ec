"""A small causal LM for the reference engine: plain PyTorch (pre-norm attention + MLP blocks,
learned positions, tied embeddings) with deterministic random weights derived from a seed. It
exists so the whole graph (frontend -> encoder -> engine) runs and is tested end to end on a CPU.
Its directory is written by `model_dir.make_model_dir`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 0
    context_length: int = 1024
    seed: int = 0

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


def load_config(model_dir: str | Path) -> tuple[LMConfig, dict]:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = LMConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"], intermediate_size=raw.get("intermediate_size", 0),
        context_length=raw["max_position_embeddings"], seed=raw.get("seed", 0),
    )
    return cfg, raw


class Block(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm2 = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.mlp_size)
        self.fc2 = nn.Linear(cfg.mlp_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x [T, H] (new positions); cache [k, v] each [heads, T_past, d] or None."""
        t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
        past = k.shape[1] - t
        # causal over new positions, full view of the past
        mask = torch.ones(t, k.shape[1], dtype=torch.bool).tril(diagonal=past)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(0, 1).reshape(t, h))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x, [k, v]


class ReferenceLM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.context_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ReferenceLM:
        cfg, _ = load_config(model_dir)
        model = cls(cfg)
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():  # every parameter from the seed: two engines must hold the same model
            for name, p in model.named_parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                    p.fill_(1.0)
                else:
                    p.zero_()
        return model.eval()

    def embed_tokens(self, token_ids: list[int], media: list[tuple[int, torch.Tensor]] = ()) -> torch.Tensor:
        """Token embeddings with each media span's rows written over its placeholder positions."""
        x = self.embed(torch.tensor(token_ids, dtype=torch.long))
        for offset, rows in media:
            x[offset : offset + rows.shape[0]] = rows.to(x.dtype)
        return x

    def forward(self, inputs_embeds: torch.Tensor, start: int = 0, cache: list | None = None) -> tuple:
        """inputs_embeds [T, H] at positions start.. -> (logits [T, V], new cache)."""
        t = inputs_embeds.shape[0]
        x = inputs_embeds + self.pos(torch.arange(start, start + t))
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, cache[i] if cache else None)
            new_cache.append(kv)
        return self.norm(x) @ self.embed.weight.T, new_cache
