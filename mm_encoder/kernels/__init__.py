"""Fast ops for the tower: 2D RoPE and block-diagonal (per-item) attention."""

from .attention import block_diagonal_attention
from .rope import apply_rope_2d, rope_2d_angles

__all__ = ["apply_rope_2d", "block_diagonal_attention", "rope_2d_angles"]
