"""Cross-entropy against label distributions, `-(p . log_softmax(z))` per row, computed in chunks of rows.

The plain expression `-(p * F.log_softmax(z.float(), -1)).sum(-1)` makes several (M, V) float32 temporaries
(the float copy, log_softmax, the product; as many again in backward). For an EAGLE-3 batch of 16 x 333 tokens
and a draft vocabulary of 8,192 each is ~85 MB (Medusa's 49,152-token heads: ~500 MB), and on the CPU glibc hands
out blocks over 32 MB as fresh pages from the OS and returns them when freed: page faults, not arithmetic, were
most of the loss's time (a bf16 CPU step of the SmolLM2 EAGLE-3 recipe spent ~4 s of ~11 in them). Here the rows
go through in chunks of at most CHUNK_ELEMENTS logits, so every temporary is small and reused; backward
recomputes a chunk's softmax from the saved logits and the forward's log-sum-exp.

Labels are constants (the frozen target's distributions): they get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

# logits a chunk holds: 2^21 float32 = 8 MiB on the CPU (under glibc's mmap threshold, so its blocks are reused);
# on accelerators the caching allocator reuses blocks anyway and fewer, larger chunks launch fewer kernels
CHUNK_ELEMENTS = {"cpu": 1 << 21}
ACCELERATOR_CHUNK_ELEMENTS = 1 << 26


def rows_per_chunk(logits: torch.Tensor) -> int:
    """Rows of (M, V) `logits` one chunk takes on their device."""
    elements = CHUNK_ELEMENTS.get(logits.device.type, ACCELERATOR_CHUNK_ELEMENTS)
    return max(1, elements // max(1, logits.shape[-1]))


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, label_probs: torch.Tensor, label_rows: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, compute = logits.shape[0], label_probs.dtype  # float32 (float64 for float64 logits)
        loss = torch.empty(rows, dtype=compute, device=logits.device)  # (M,)
        log_sum_exp = torch.empty_like(loss)  # (M,)
        argmax = torch.empty(rows, dtype=torch.long, device=logits.device)  # (M,)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            z = logits[part].to(compute)  # (c, V)
            p = label_probs.index_select(0, label_rows[part])  # (c, V)
            top, argmax[part] = z.max(dim=-1)  # (c,): the first index of a row's maximum, as argmax picks
            lse = top + (z - top[:, None]).exp_().sum(dim=-1).log_()  # (c,)
            # -(p . (z - lse)) = lse * sum(p) - p . z  (sum(p) is 1 up to rounding; kept exact)
            loss[part] = lse * p.sum(dim=-1) - (p * z).sum(dim=-1)
            log_sum_exp[part] = lse
        ctx.save_for_backward(logits, label_probs, label_rows, log_sum_exp)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, grad_argmax: torch.Tensor | None) -> tuple[Any, ...]:
        logits, label_probs, label_rows, log_sum_exp = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (M, V) in the logits' dtype
        for start in range(0, logits.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            p = label_probs.index_select(0, label_rows[part])  # (c, V)
            # d/dz_j of lse * sum(p) - p . z  is  softmax_j * sum(p) - p_j; a new tensor, the saved logits stay
            soft = torch.sub(logits[part].to(log_sum_exp.dtype), log_sum_exp[part, None]).exp_()  # (c, V) softmax
            soft.mul_(p.sum(dim=-1, keepdim=True)).sub_(p).mul_(grad_loss[part, None])
            grad[part] = soft
        return grad, None, None, None


def soft_cross_entropy(
    logits: torch.Tensor, label_probs: torch.Tensor, label_rows: torch.Tensor, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of `logits` against label distributions, and each row's argmax.

    Args:
        logits: (M, V) any float dtype (bf16 under autocast); computed in float32 (float64 logits: in float64).
        label_probs: (R, V) label distributions (rows summing to 1), shared by the rows that name them.
        label_rows: (M,) long: row i's label is `label_probs[label_rows[i]]`.
        chunk_rows: rows a chunk takes (default: `rows_per_chunk(logits)`).

    Returns:
        (M,) `-(label . log_softmax(logits))` in the compute dtype (differentiable in `logits`), and (M,) long
        argmax of the logits (the first index of a row's maximum).

    Raises:
        ValueError: shapes that do not match, or labels that require a gradient.
    """
    if logits.dim() != 2 or label_probs.dim() != 2 or logits.shape[1] != label_probs.shape[1]:
        raise ValueError(
            f"soft_cross_entropy: logits {tuple(logits.shape)} and label_probs {tuple(label_probs.shape)}; expected "
            "(M, V) and (R, V) with the same V"
        )
    if label_rows.shape != (logits.shape[0],):
        raise ValueError(f"soft_cross_entropy: label_rows {tuple(label_rows.shape)}; expected ({logits.shape[0]},)")
    if label_probs.requires_grad:
        raise ValueError("soft_cross_entropy: label_probs require a gradient; labels are constants (detach them)")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"soft_cross_entropy: chunk_rows={chunk_rows}; expected at least 1")
    compute = torch.promote_types(logits.dtype, torch.float32)
    chunk = chunk_rows or rows_per_chunk(logits)
    return _SoftCrossEntropy.apply(logits, label_probs.to(compute), label_rows, chunk)
