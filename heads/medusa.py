"""Medusa heads: K one-shot heads on the target's last hidden state, head k predicting token t+k+1."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from specheads.heads.base import DraftHeads
from specheads.heads.config import HeadsConfig


class ZeroInitLinear(nn.Linear):
    """A Linear that fresh heads initialise to zero (the residual branch starts as the identity)."""


class ResidualBlock(nn.Module):
    """x + SiLU(Wx + b), zero-initialised so a fresh head starts as the target's own lm_head (as Medusa does)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = ZeroInitLinear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(DraftHeads):
    """K heads; each is `num_layers` residual SiLU blocks and its own vocabulary projection.

    The target's lm_head on feature f_t predicts token t+1; Medusa head k (0-based) predicts token t+k+2.
    """

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        h, v = config.hidden_size, config.vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(h) for _ in range(config.num_layers)], nn.Linear(h, v, bias=False))
            for _ in range(config.num_heads)
        )
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ZeroInitLinear):
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    def init_from_target(self, target: PreTrainedModel) -> None:
        """Copy the target's lm_head into every head's projection (Medusa's initialisation)."""
        weight = target.get_output_embeddings().weight
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(weight)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of every head.

        Args:
            features: the target's final (post-norm) hidden states, (B, T, h).

        Returns:
            (K, B, T, V): logits of head k for token t+k+2 at each position t.
        """
        return torch.stack([head(features) for head in self.heads])
