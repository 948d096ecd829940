"""The target's labels, kept only at the positions a loss reads them.

Every training loss reads the target at position p (its prediction of x_{p+1}) only as the label of a trained token
x_{p+1}: Medusa head k at t reads p = t+k+1, EAGLE at t reads p = t+1, EAGLE-3 step i at index t reads p = t+1+i,
each only where the token it predicts, x_{p+1}, is trained. So the labels are computed once per batch at those R
positions (prompt tokens and padding, about half of a chat batch, have none): the target's argmax over its whole
vocabulary, and with labels="target" its softmax over the vocabulary the heads draft from. A loss row (b, p) finds
its label at `row_of[b, p]`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specheads.training.soft_cross_entropy import soft_cross_entropy
from specheads.training.ttt import shift_left


@dataclass
class TargetLabels:
    """The target's labels at the R positions p whose next token x_{p+1} is trained.

    Attributes:
        top1: (R,) the target's argmax over its whole vocabulary (what greedy decoding accepts).
        probs: (R, V') float32 softmax of the target's logits over the label vocabulary (EAGLE-3's draft
            vocabulary, else the whole one); None when the loss trains on the data's tokens (labels="tokens").
        row_of: (B, T) long: the row of position (b, p), -1 where x_{p+1} is not trained.
        vocab_size: V, the target's vocabulary size.
    """

    top1: torch.Tensor
    probs: torch.Tensor | None
    row_of: torch.Tensor
    vocab_size: int


def labelled_positions(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R,) batch and (R,) position indices p where x_{p+1} is trained, by row then position. loss_mask: (B, T)."""
    return shift_left(loss_mask, 1, loss_mask.shape[1], fill=0).bool().nonzero(as_tuple=True)


def labels_at(
    positions: tuple[torch.Tensor, torch.Tensor],
    shape: torch.Size,
    top1: torch.Tensor,
    label_logits: torch.Tensor | None,
    vocab_size: int,
) -> TargetLabels:
    """`TargetLabels` at `positions` (`labelled_positions` of a (B, T) = `shape` batch) from the target's argmax
    there (R,) and its logits over the label vocabulary (R, V'), or None (labels="tokens")."""
    row_of = torch.full(tuple(shape), -1, dtype=torch.long, device=top1.device)  # (B, T)
    row_of[positions] = torch.arange(top1.numel(), device=top1.device)
    probs = None if label_logits is None else F.softmax(label_logits.float(), dim=-1)
    return TargetLabels(top1, probs, row_of, vocab_size)


def target_labels(
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    label_vocab: torch.Tensor | None = None,
    with_probs: bool = True,
) -> TargetLabels:
    """Labels from the target's dense logits (an online run's forward makes them at every position).

    Args:
        target_logits: (B, T, V) the target's logits (position p predicts x_{p+1}).
        loss_mask: (B, T) 1 where predicting that token is trained.
        label_vocab: (V',) the target ids the label distributions range over (EAGLE-3's `d2t`), or None: all.
        with_probs: compute the label distributions (labels="target").
    """
    if target_logits.dim() != 3 or target_logits.shape[:2] != loss_mask.shape:
        raise ValueError(
            f"target_labels: target_logits {tuple(target_logits.shape)} and loss_mask {tuple(loss_mask.shape)}; "
            "expected (B, T, V) and (B, T)"
        )
    rows_b, rows_p = positions = labelled_positions(loss_mask)
    top1 = target_logits.argmax(-1)[positions]  # (R,): an argmax reads the logits in place, no (R, V) copy
    label_logits = None
    if with_probs:
        if label_vocab is None:
            label_logits = target_logits[positions]  # (R, V)
        else:  # one gather straight to (R, V'), never (R, V)
            label_logits = target_logits[rows_b[:, None], rows_p[:, None], label_vocab[None, :]]
    return labels_at(positions, loss_mask.shape, top1, label_logits, target_logits.shape[-1])


def as_target_labels(
    target: torch.Tensor | TargetLabels,
    loss_mask: torch.Tensor,
    label_vocab: torch.Tensor | None,
    with_probs: bool,
    argmax_weight: float = 0.0,
) -> TargetLabels:
    """`target` as labels: dense (B, T, V) logits go through `target_labels`; labels are checked (their distributions
    dropped when the loss trains on the data's tokens) and, with `argmax_weight`, sharpened (`mix_in_argmax`)."""
    if isinstance(target, torch.Tensor):
        return mix_in_argmax(target_labels(target, loss_mask, label_vocab, with_probs), label_vocab, argmax_weight)
    if target.row_of.shape != loss_mask.shape:
        raise ValueError(f"TargetLabels for a {tuple(target.row_of.shape)} batch; this batch is {tuple(loss_mask.shape)}")
    if not with_probs:  # the loss trains on the data's tokens
        return replace(target, probs=None)
    expected = target.vocab_size if label_vocab is None else label_vocab.numel()
    if target.probs is None or target.probs.shape[-1] != expected:
        got = None if target.probs is None else target.probs.shape[-1]
        raise ValueError(
            f"TargetLabels hold label distributions over {got} tokens; this loss needs {expected} "
            "(make them with the heads' label vocabulary and with_probs=True)"
        )
    return mix_in_argmax(target, label_vocab, argmax_weight)


def mix_in_argmax(labels: TargetLabels, label_vocab: torch.Tensor | None, weight: float) -> TargetLabels:
    """Label distributions (1 - weight) p + weight onehot(argmax): `loss.argmax_label_weight`.

    Greedy verification accepts exactly the target's argmax, so a head that ranks it first is what a small draft
    tree needs; the soft label alone spends the head's capacity on the whole distribution. A row whose argmax lies
    outside the label vocabulary (EAGLE-3's draft vocabulary, `label_vocab`, sorted target ids) keeps p.
    """
    if weight == 0 or labels.probs is None:
        return labels
    top1 = labels.top1  # (R,) target ids
    if label_vocab is None:
        ids, inside = top1, torch.ones_like(top1, dtype=torch.bool)
    else:
        ids = torch.searchsorted(label_vocab, top1).clamp(max=label_vocab.numel() - 1)  # (R,) label-vocabulary ids
        inside = label_vocab[ids] == top1  # (R,)
    probs = labels.probs * (1 - weight * inside.to(labels.probs.dtype))[:, None]  # (R, V')
    rows = inside.nonzero(as_tuple=True)[0]
    probs[rows, ids[rows]] += weight
    return replace(labels, probs=probs)


def label_cross_entropy(
    logits: torch.Tensor, labels: TargetLabels, label_rows: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy and argmax of (M, V') `logits`: against the target's distributions at `label_rows` (M,)
    when `labels` hold them, else against the data's `tokens` (M,) (ids of the logits' vocabulary)."""
    if labels.probs is not None:
        return soft_cross_entropy(logits, labels.probs, label_rows)
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (M, V')
    return -log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logits.argmax(-1)
