"""Training-time test (EAGLE-3): unroll the head on its own outputs, exactly as drafting will run it.

Sequence x_0 .. x_{T-1}, target features f_t (read after x_t), n = T-1 chains, one per index t = 0 .. n-1:

    step 0 at index t reads (f_t, x_{t+1}) at position t            -> a^0_t, predicts x_{t+2}
    step i at index t reads (a^{i-1}_t, x_{t+1+i}) at position t+i  -> a^i_t, predicts x_{t+2+i}

The chain at index t is a draft path rooted at t: in inference (`EagleDrafter`) the depth-(i+1) node of a
root at t sits at position t+i and sees the committed prefix (the step-0 entries 0..t) plus its own
ancestors. So step i's query t attends to the step-0 keys at indices <= t (causal, padding masked) and to
the keys of steps 1..i at index t only (its own chain), never to anything later. All steps share one
`DynamicCache`: the keys of step j are appended to it, gradients flow through them.

    mask of step i (B, 1, n, (i+1)*n), one n x n block per step, 0 = attend:
        [ causal(step 0) | diag(step 1) | ... | diag(step i) ]

P-EAGLE (parallel drafting, `parallel_slot_token` given): step i >= 1 at index t reads (f_t + mask_hidden[i-1], the
parallel token) at position t+i instead of the head's own output and the data's token: the parallel slot that drafts
depth i+1 of the root at t in one forward with the others (inference/parallel_drafting.py). Same positions, same mask.

COD sampling (P-EAGLE's scalable training, `slot_roots`): the slot of depth i+1 is trained for a subset of the roots
only, nested (each depth's roots are some of the previous depth's) and shrinking with depth, so the deep steps cost a
fraction of step 0. Step i then runs m_i queries (its roots' slots) over the step-0 keys and the m_1 .. m_i keys of
the steps before it; `cod_attention_mask` lets each see the step-0 keys up to its root and its own root's entry of
each earlier step (dense masks only).

With `chain=True` the steps pass only the step-0 block's mask and `ttt_chain=True`: the heads' attention must be
training/chain_attention.py's, which scores each query's own chain keys directly instead of the diagonal blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import DynamicCache


def ttt_attention_mask(key_padding: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of TTT step `step` over the keys of steps 0..step.

    Args:
        key_padding: (B, n) 1 on real step-0 entries, 0 on padding.
        step: the step i >= 0 being computed.
        dtype: float dtype of the mask (masked entries are its most negative value).

    Returns:
        (B, 1, n, (step+1)*n) float mask: block 0 causal with padded keys masked (the diagonal always open, so
        no row is empty), blocks 1..step the identity.
    """
    if step < 0:
        raise ValueError(f"ttt_attention_mask: step={step}; expected a step >= 0")
    batch, n = key_padding.shape
    device = key_padding.device
    eye = torch.eye(n, dtype=torch.bool, device=device)  # (n, n)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None] & key_padding.bool()[:, None, :]
    allowed = torch.cat([causal | eye[None], eye[None].expand(batch, n, n).repeat(1, 1, step)], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)  # (B, n, (step+1)*n)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def cod_slot_roots(n: int, depth: int, ratio: float, generator: torch.Generator) -> list[torch.Tensor]:
    """P-EAGLE COD sampling: for each parallel depth 2 .. `depth`, the sorted root indices (m_d,) whose slot trains
    it, out of n roots: the first ceil(n * ratio^(d-1)) of one random order, so each depth's roots are some of the
    previous depth's (a slot sees its own chain's earlier slots) and at least one root trains every depth."""
    order = torch.randperm(n, generator=generator)
    return [order[: max(1, math.ceil(n * ratio**d))].sort().values for d in range(1, depth)]


def cod_attention_mask(key_padding: torch.Tensor, roots: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of step i = len(roots) of a COD-sampled unroll: its slot q (root r = roots[-1][q]) sees the
    step-0 keys up to r (padded keys masked; its own always) and, in the block of each step j = 1..i (roots[j-1]),
    the entry of root r only.

    Args:
        key_padding: (B, n) 1 on real step-0 entries.
        roots: the root indices of steps 1..i, each (m_j,), nested.
        dtype: float dtype of the mask.

    Returns:
        (B, 1, m_i, n + m_1 + ... + m_i) float mask.
    """
    batch, n = key_padding.shape
    own = roots[-1].to(key_padding.device)  # (m,)
    keys = torch.arange(n, device=own.device)
    causal = (keys[None, :] <= own[:, None])[None] & key_padding.bool()[:, None, :]  # (B, m, n)
    causal |= (keys[None, :] == own[:, None])[None]
    blocks = [causal] + [(step_roots.to(own.device)[None, :] == own[:, None])[None].expand(batch, -1, -1)
                         for step_roots in roots]
    allowed = torch.cat(blocks, dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=own.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def shift_left(values: torch.Tensor, shift: int, length: int, fill: float | int) -> torch.Tensor:
    """values[:, shift : shift+length] along dim 1, right-filled with `fill` past the end. (B, T, ...) -> (B, length, ...)"""
    part = values[:, shift : shift + length]
    missing = length - part.shape[1]
    if missing <= 0:
        return part
    pad = torch.full(
        (values.shape[0], missing, *values.shape[2:]), fill, dtype=values.dtype, device=values.device
    )
    return torch.cat([part, pad], dim=1)


def unroll_ttt(
    heads: Callable[..., torch.Tensor],
    features: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int,
    noise: torch.Tensor | None = None,
    chain: bool = False,
    parallel_slot_token: int | None = None,
    slot_roots: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Run `steps` TTT steps of an EAGLE-3 head over a batch; keep the graph for back-propagation.

    Args:
        heads: callable as `Eagle3Heads.forward(features, input_ids, position_ids, attention_mask, cache)`.
        features: (B, T, 3h) the target's tapped features f_0 .. f_{T-1}.
        input_ids: (B, T) tokens x_0 .. x_{T-1} (right-padded).
        attention_mask: (B, T) 1 on real tokens.
        steps: number of steps (>= 1).
        noise: (B, T-1, 3h) added to the step-0 features, or None.
        chain: the heads attend through TTT chain attention (`use_ttt_chain_attention`): no dense masks.
        parallel_slot_token: P-EAGLE: steps >= 1 are parallel slots reading this token (and f_t + `mask_hidden`).
        slot_roots: P-EAGLE with COD sampling (`cod_slot_roots`): step i >= 1 runs the slots of the roots
            slot_roots[i-1] only (dense masks; not with `chain`).

    Returns:
        `steps` tensors (B, n, h), n = T-1: step i's output a^i_t at index t (its logits predict x_{t+2+i}); with
        `slot_roots`, step i >= 1's is (B, m_i, h), row q for root slot_roots[i-1][q].
        Chains running past the sequence read filler tokens; their outputs are meaningless and must be masked
        by the caller (only their own chain sees them).
    """
    if steps < 1:
        raise ValueError(f"unroll_ttt: steps={steps}; expected at least 1")
    if slot_roots is not None and (parallel_slot_token is None or chain or len(slot_roots) != steps - 1):
        raise ValueError("unroll_ttt: slot_roots (COD sampling) need parallel slots, dense masks and one root set per "
                         f"step after the first ({steps - 1}); got {None if slot_roots is None else len(slot_roots)}")
    batch, seq_len = input_ids.shape
    n = seq_len - 1
    hidden = features[:, :-1]  # (B, n, 3h): f_t
    if noise is not None:
        hidden = hidden + noise.to(hidden.dtype)
    key_padding = attention_mask[:, 1:]  # (B, n): entry t is real when x_{t+1} is
    base_positions = torch.arange(n, device=input_ids.device).expand(batch, n)  # (B, n)
    cache = DynamicCache()
    anchors = hidden  # (B, n, 3h): the root features the parallel slots read
    outputs = []
    block_mask = ttt_attention_mask(key_padding, 0, features.dtype) if chain else None  # (B, 1, n, n)
    chain_kwargs = {"ttt_chain": True} if chain else {}  # what routes the attention function to the chain
    for step in range(steps):
        # chain: the step-0 block's mask for every step; dense: (B, 1, n, (step+1)*n)
        mask = block_mask if chain else ttt_attention_mask(key_padding, step, features.dtype)
        if step and slot_roots is not None:  # COD: the slots of some roots only
            roots = slot_roots[step - 1].to(input_ids.device)  # (m,)
            mask = cod_attention_mask(key_padding, slot_roots[:step], features.dtype)  # (B, 1, m, n + m_1 + .. + m_i)
            slot_tokens = torch.full((batch, roots.shape[0]), parallel_slot_token, device=input_ids.device)
            slots = (anchors[:, roots], torch.full(roots.shape, step + 1, device=input_ids.device))
            out = heads(features[:, :0], slot_tokens, (roots + step).expand(batch, -1), mask, cache, parallel_slots=slots)
        elif step and parallel_slot_token is not None:  # parallel slots: their root's features, the parallel token
            slot_tokens = torch.full_like(base_positions, parallel_slot_token)  # (B, n)
            slots = (anchors, torch.full((n,), step + 1, device=input_ids.device))  # depth step+1 of each root
            out = heads(features[:, :0], slot_tokens, base_positions + step, mask, cache, parallel_slots=slots, **chain_kwargs)
        else:
            tokens = shift_left(input_ids, 1 + step, n, fill=0)  # (B, n): x_{t+1+step}
            hidden = out = heads(hidden, tokens, base_positions + step, mask, cache, **chain_kwargs)  # (B, n, h)
        outputs.append(out)
    return outputs
