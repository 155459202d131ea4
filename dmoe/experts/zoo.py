"""The built-in experts: ``ffn``, ``transformer`` and ``nop``."""
from __future__ import annotations

import torch
from torch import nn

from dmoe.experts.registry import register_expert_class

#: Sequence length of the ``transformer`` expert's schema (its schema, like every expert's, is fixed).
TRANSFORMER_SEQ_LEN = 32


@register_expert_class("ffn", lambda batch, hidden: torch.randn(batch, hidden))
class FeedforwardExpert(nn.Module):
    """Linear h->4h, GELU, Linear 4h->h, then residual + LayerNorm; input ``[batch, hidden]``."""

    def __init__(self, hidden_dim: int, expansion: int = 4, dropout: float = 0.0):
        super().__init__()
        self.ffn = nn.Sequential(
            nn.Linear(hidden_dim, expansion * hidden_dim), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(expansion * hidden_dim, hidden_dim),
        )
        self.norm = nn.LayerNorm(hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.ffn(x))


@register_expert_class("transformer", lambda batch, hidden: torch.randn(batch, TRANSFORMER_SEQ_LEN, hidden))
class TransformerExpert(nn.Module):
    """A pre-norm transformer block (self-attention + FFN); input ``[batch, seq, hidden]``."""

    def __init__(self, hidden_dim: int, num_heads: int = 4, expansion: int = 4, dropout: float = 0.0):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_dim)
        self.attn = nn.MultiheadAttention(hidden_dim, num_heads, dropout=dropout, batch_first=True)
        self.ffn_norm = nn.LayerNorm(hidden_dim)
        self.ffn = nn.Sequential(
            nn.Linear(hidden_dim, expansion * hidden_dim), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(expansion * hidden_dim, hidden_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ffn_norm(x))


@register_expert_class("nop", lambda batch, hidden: torch.randn(batch, hidden))
class NopExpert(nn.Module):
    """Returns its input: measures the cost of everything except compute."""

    def __init__(self, hidden_dim: int):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
