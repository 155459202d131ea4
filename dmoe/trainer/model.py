"""A gated transformer language model whose feed-forward layers are mixtures of experts.

Everything here runs on the client: embeddings, causal self-attention, layer norms, the output head and
(inside each mixture layer) the gate. The feed-forward layer of block ``i`` is whatever
``moe_factory(i)`` returns; the trainer passes a factory of ``RemoteMixtureOfExperts`` (experts ``ffn{i}.*.*``
on volunteers' servers) or of ``LocalMixtureOfExperts`` (the same maths with in-process experts).

The mixture layer's contract: an ``nn.Module`` mapping [rows, hidden] -> [rows, hidden]. The model flattens
[batch, seq] into rows before calling it, so every token is routed on its own.

Block layout (pre-LN):  h = h + attn(ln1(h));  h = h + moe(ln2(h)).
The server's ``ffn`` expert already computes LayerNorm(x + ffn(x)), so the mixture's output is a convex
combination of normalised vectors; adding it to the residual stream (instead of replacing the stream with it)
keeps the client's representation independent of what the experts do. In particular a token whose experts all
failed (zeros, with ``allow_zero_outputs``) passes through the block unchanged instead of being wiped out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

MoEFactory = Callable[[int], nn.Module]


@dataclass
class ModelConfig:
    vocab_size: int = 256
    seq_len: int = 128  # the longest context; position embeddings are learned for this many positions
    hidden: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    grid: tuple[int, ...] = (4, 4)  # each layer's expert grid, e.g. ffn0.[0:4].[0:4]
    k_best: int = 4  # experts mixed per token
    tie_weights: bool = True  # output head shares the token embedding matrix


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.hidden % config.n_heads == 0, "hidden must be divisible by n_heads"
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, moe: nn.Module):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.moe = moe
        self.drop = nn.Dropout(config.dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.drop(self.attn(self.ln1(h)))
        x = self.ln2(h)
        return h + self.drop(self.moe(x.reshape(-1, x.shape[-1])).view_as(x))


class GatedTransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, moe_factory: MoEFactory):
        super().__init__()
        self.config = config
        self.token_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, moe_factory(i)) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.token_emb.weight
        self._init_client_weights()

    def _init_client_weights(self) -> None:
        # GPT-2 style initialisation for the client's own layers; the mixture layers keep their own.
        moe_params = {id(p) for block in self.blocks for p in block.moe.parameters()}
        for name, p in self.named_parameters():
            if id(p) in moe_params:
                continue
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """tokens: int64 [batch, seq]. Returns logits [batch, seq, vocab] and, given targets, the mean
        cross-entropy in nats per token."""
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        h = self.drop(self.token_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Samples ``new_tokens`` continuations of ``tokens`` [batch, seq] one at a time."""
        for _ in range(new_tokens):
            logits, _ = self(tokens[:, -self.config.seq_len:])
            probs = F.softmax(logits[:, -1] / temperature, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return tokens

    def balance_loss(self) -> torch.Tensor | None:
        """The mean over blocks of their mixture layers' load-balancing loss from the last forward (layers built
        with ``switch=True`` set one); None when no layer has one."""
        losses = [block.moe.balance_loss for block in self.blocks
                  if getattr(block.moe, "balance_loss", None) is not None]
        return torch.stack(losses).mean() if losses else None

    def moe_counters(self) -> tuple[int, int]:
        """(experts chosen, experts dropped), summed over layers since the layers were built; (0, 0) for
        mixture layers that keep no ``stats``."""
        chosen = dropped = 0
        for block in self.blocks:
            stats = getattr(block.moe, "stats", None)
            chosen += int(getattr(stats, "experts_chosen", 0))
            dropped += int(getattr(stats, "experts_dropped", 0))
        return chosen, dropped
