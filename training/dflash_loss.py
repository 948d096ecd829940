"""DFlash training: blocks anchored in the answers, all drafted in one forward, each depth weighted by its decay.

A block anchored at position a (DFlash paper; z-lab / SpecForge sample anchors in the trained text) holds the data's
token x_a and B-1 mask tokens at positions a .. a+B-1; it sees the target's features at positions < a (its context)
and its own B positions (bidirectional), never another block. Its position a+d predicts x_{a+d}: the label is the
target's distribution at a+d-1 (`TargetLabels` row a+d-1), or the data's token with labels="tokens". Every block of
a sequence rides in one forward, all sharing the context's keys / values:

    keys:    context f_0 .. f_{T-1}  |  block 1 (B)  |  block 2 (B)  | ...
    block j: sees f_c for c < a_j    and its own B positions

Depth d weighs exp(-(d-1) / gamma) (`loss.dflash_gamma`, 0: the paper's 7 / 5 / 4 for blocks of 16 / 10 / 8). With
`loss.dflash_accept_until_fail` (AUF, arXiv 2607.01893, as vLLM speculators' `auf`) depth d trains only in the blocks
whose depths 1 .. d-1 the draft got right (what greedy verification would have accepted up to there). Anchors
are drawn per sequence from a generator seeded with the batch's tokens (as P-EAGLE's COD roots), so a resumed run
and any number of processes train the same blocks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specheads.heads.dflash import loss_gamma
from specheads.training.config import LossSection
from specheads.training.losses import LossOutput, chain_acceptance, rows_mean
from specheads.training.target_labels import TargetLabels, as_target_labels, label_cross_entropy


def block_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, block_size: int, max_blocks: int,
                  input_ids: torch.Tensor) -> torch.Tensor:
    """(B, m) anchor positions, -1 where a row has fewer than m blocks: per row up to `max_blocks` (0: all) positions
    a >= 1 inside the sequence whose block predicts some trained token (x_{a+1} .. x_{a+B-1}), drawn at random
    (seeded by the batch's tokens) when there are more, in increasing order."""
    batch, length = loss_mask.shape
    trained_ahead = torch.zeros_like(loss_mask, dtype=torch.bool)  # (B, T): some x_{a+d} trained, 1 <= d < B
    for d in range(1, block_size):
        trained_ahead[:, : length - d] |= loss_mask[:, d:].bool()
    eligible = trained_ahead & attention_mask.bool()
    eligible[:, 0] = False  # a block sees the context before its anchor: none at position 0
    seed = (int(input_ids.long().sum()) * 1_000_003 + batch * 1009 + length) % 2**63
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in eligible.cpu():
        positions = row.nonzero().flatten()
        if max_blocks and positions.numel() > max_blocks:
            positions = positions[torch.randperm(positions.numel(), generator=generator)[:max_blocks]].sort().values
        rows.append(positions)
    width = max(1, max(r.numel() for r in rows))
    anchors = torch.full((batch, width), -1, dtype=torch.long)
    for b, positions in enumerate(rows):
        anchors[b, : positions.numel()] = positions
    return anchors.to(loss_mask.device)


def block_attention_mask(anchors: torch.Tensor, attention_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, 1, m*B, T + m*B) bool: block j's B queries see the real context positions before its anchor and their own
    block. A padding block (anchor -1) sees only itself (its rows are never trained)."""
    batch, length = attention_mask.shape
    blocks = anchors.shape[1]
    anchor_of_query = anchors.repeat_interleave(block_size, dim=1)  # (B, m*B)
    context = torch.arange(length, device=anchors.device)[None, None] < anchor_of_query[..., None]  # (B, m*B, T)
    context &= attention_mask.bool()[:, None, :]
    block_of = torch.arange(blocks * block_size, device=anchors.device) // block_size  # (m*B,)
    own = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # (B, m*B, m*B)
    return torch.cat([context, own], dim=-1)[:, None]


def dflash_loss(
    heads: Any,
    features: torch.Tensor,
    target_logits: torch.Tensor | TargetLabels,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossSection,
) -> LossOutput:
    """The DFlash loss of one batch (see the module docstring) and its metrics: per-depth loss and top-1 agreement
    with the target (`acc_depth<d>`), `acc` (depth 1) and `sim_tau` (the chain acceptance of the trained blocks).

    Args:
        heads: DFlash heads, or a `_HeadsView` of them (forward through the prepared model, `logits`).
        features: (B, T, n*h) the target's tapped layers; target_logits: its labels (dense logits or `TargetLabels`).
        input_ids, attention_mask, loss_mask: (B, T) the batch.
    """
    heads_config = getattr(heads, "heads", heads).config  # a `_HeadsView`'s heads, or the heads themselves
    size, mask_token = heads_config.block_size, heads_config.block_mask_token
    labels = as_target_labels(target_logits, loss_mask, None, config.labels == "target", config.argmax_label_weight)
    anchors = block_anchors(loss_mask, attention_mask, size, config.dflash_blocks, input_ids)  # (B, m)
    batch, length = input_ids.shape
    offsets = torch.arange(size, device=input_ids.device)
    block_positions = (anchors.clamp(min=0)[..., None] + offsets).flatten(1)  # (B, m*B)
    block_ids = torch.full_like(block_positions, mask_token)
    block_ids[:, ::size] = input_ids.gather(1, anchors.clamp(min=0))  # each block's root: the data's token at a
    context_positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
    mask = block_attention_mask(anchors, attention_mask, size)
    hidden = heads(features, block_ids, context_positions, block_positions, mask)  # (B, m*B, h)
    hidden = hidden.view(batch, anchors.shape[1], size, -1)

    gamma = config.dflash_gamma or loss_gamma(size)
    total, metrics, correct = hidden.new_zeros(()), {}, []
    real = anchors >= 0  # (B, m)
    alive = real.clone()  # (B, m): blocks whose drafts were all right so far (accept-until-fail)
    for depth in range(1, size):
        label_position = anchors + depth - 1  # (B, m): the target's prediction of x_{a+d}
        inside = real & (label_position + 1 < length)
        label_rows = labels.row_of.gather(1, label_position.clamp(0, length - 1))  # (B, m), -1 where not trained
        trained = inside & (label_rows >= 0)
        rows = trained.nonzero(as_tuple=True)  # (M,), (M,)
        tokens = input_ids.gather(1, (anchors + depth).clamp(0, length - 1))[rows]  # (M,) x_{a+d}
        ce, top1 = label_cross_entropy(heads.logits(hidden[rows[0], rows[1], depth]), labels, label_rows[rows], tokens)
        hit = top1 == labels.top1[label_rows[rows]]  # (M,): the draft's argmax is the target's
        # accept-until-fail: a depth trains only in blocks whose earlier depths the target would have accepted
        weight = alive[rows].to(ce.dtype) if config.dflash_accept_until_fail else torch.ones_like(ce)
        depth_loss = (ce * weight).sum() / weight.sum().clamp_min(1.0)
        total = total + math.exp(-(depth - 1) / gamma) * depth_loss
        metrics[f"loss_depth{depth}"] = float(depth_loss.detach())
        metrics[f"acc_depth{depth}"] = float(rows_mean(hit.float()))
        grid = torch.zeros_like(real)
        grid[rows] = hit
        alive &= grid
        correct.append(grid)  # untrained depths count as misses
    metrics["loss"] = float(total.detach())
    metrics["acc"] = metrics["acc_depth1"]
    metrics["sim_tau"] = chain_acceptance(correct, real.float())  # a chain per real block
    metrics["blocks"] = float(real.sum())
    return LossOutput(total, metrics)
