"""Helpers for tests that run heads directly: perturbed weights and a causal mask."""

from __future__ import annotations

import torch

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9, 79]])  # token ids for the tiny targets (vocabulary 97)


def perturbed(heads):
    """The heads with every weight moved off its init (so that drafting reads each one), in eval mode."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return heads.eval()


def causal(length: int) -> torch.Tensor:
    """(1, 1, length, length) additive causal mask."""
    return torch.full((length, length), float("-inf")).triu(1)[None, None]


def ttt_loss(heads, target, steps: int = 3):
    """The EAGLE-3 TTT loss of `heads` (in train mode) on 2 random rows of 12 tokens of `target`, not yet backed."""
    from specheads.training.config import LossSection
    from specheads.training.losses import eagle3_loss

    ids = torch.randint(3, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return eagle3_loss(heads, heads.select_features(out.hidden_states), out.logits, ids, attention, attention,
                       LossSection(ttt_steps=steps))
