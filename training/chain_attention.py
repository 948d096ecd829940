"""EAGLE-3's training-time-test attention without the dense mask: each query scores its own chain only.

Step i of the TTT unroll (training/ttt.py) lets query t see the step-0 keys 0..t (causal, padding masked) and the
keys of steps 1..i at index t only (its own draft chain). As one SDPA call over all (i+1) n keys with an additive
(n, (i+1) n) mask (`ttt_attention_mask`), step i computes (i+1) n scores per query, of which at most t+1+i count:
the recipe's 7 steps cost 28 n x n blocks of products (and as many in backward), and transformers repeats the
grouped keys and values for SDPA. Chain attention scores the n step-0 keys (one n x n block, causal) and the i
own-chain keys (one product per key, elementwise), takes one softmax over the n + i, and sums the values the same
way: 7 blocks for the 7 steps. The probabilities are materialised ((B, H, n, n + i) per step, kept for backward),
which flash-style SDPA kernels avoid; measured on the CPU only (docs/training.md), hence `loss.ttt_attention=auto` picks it on
the CPU and keeps the dense mask elsewhere.

It is an attention function registered with transformers' `AttentionInterface` (the documented way to add one;
as inference/gqa_attention.py does) under `TTT_CHAIN_ATTENTION`: the attention module of the head's decoder layer
still projects, normalises and rotates q / k / v its family's way and appends the keys to the unroll's cache; only
the product with the keys changes. A call carrying `ttt_chain=True` (the unroll's steps) takes the chain route with
the step-0 block's mask as `attention_mask`; every other call (drafting, evaluation) goes to transformers' SDPA
function unchanged. `use_ttt_chain_attention` points EAGLE-3 heads at it for a training run.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specheads.training.config import TTT_ATTENTION_CHOICES

TTT_CHAIN_ATTENTION = "specheads_ttt_chain"  # the attention implementation's name in transformers' registries
# what transformers' SDPA function refuses or does not compute either (a sliding window it leaves to the mask, which
# the unroll's masks do not model in either route)
UNSUPPORTED_OPTIONS = ("softcap", "s_aux", "position_bias", "output_attentions")


def chain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of TTT step i: step-0 keys through `block_mask`, then each query's own-chain keys.

    Args:
        query: (B, H, n, d) step i's queries.
        key, value: (B, H_kv, (i+1) n, d) the keys / values of steps 0..i in order (the unroll's cache); H_kv
            divides H (grouped-query attention: query head h reads key head h // (H / H_kv)).
        block_mask: (B or 1, 1, n, n) additive mask of the step-0 block (causal, padded keys masked).
        scaling: the scores' scale (1 / sqrt(d) for most families).

    Returns:
        (B, n, H, d) the attention output, laid out as transformers' attention functions return it.
    """
    batch, heads, n, dim = query.shape
    kv_heads, steps = key.shape[1], key.shape[2] // n
    if key.shape[2] != steps * n or heads % kv_heads:
        raise ValueError(
            f"chain_attention: query {tuple(query.shape)} and key {tuple(key.shape)}; expected keys of whole steps "
            "((i+1) n) and query heads a multiple of key heads"
        )
    group = heads // kv_heads
    q = query.view(batch, kv_heads, group, n, dim)  # (B, H_kv, g, n, d)
    scores = torch.matmul(q, key[:, :, None, :n].transpose(-1, -2)) * scaling  # (B, H_kv, g, n, n)
    scores = scores + block_mask[:, :, None].to(scores.dtype)  # the mask broadcasts over heads and groups
    if steps > 1:
        chain_keys = key[:, :, n:].view(batch, kv_heads, steps - 1, n, dim)  # (B, H_kv, i, n, d): step j's key at t
        own = torch.einsum("bkgtd,bkjtd->bkgtj", q, chain_keys) * scaling  # (B, H_kv, g, n, i)
        scores = torch.cat([scores, own], dim=-1)  # (B, H_kv, g, n, n + i)
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(query.dtype)
    out = torch.matmul(probs[..., :n], value[:, :, None, :n])  # (B, H_kv, g, n, d)
    if steps > 1:
        chain_values = value[:, :, n:].view(batch, kv_heads, steps - 1, n, dim)
        out = out + torch.einsum("bkgtj,bkjtd->bkgtd", probs[..., n:], chain_values)
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous()


def ttt_chain_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, T, d), key / value (B, H_kv, S, d). With
    `ttt_chain=True`, `chain_attention` (`attention_mask` is the step-0 block's); otherwise transformers' SDPA.

    Raises:
        ValueError: a TTT call with dropout, no block mask, or an option SDPA does not compute either (logit
            soft-capping, sinks, position bias, attention weights).
    """
    if not kwargs.pop("ttt_chain", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    unsupported = [name for name in UNSUPPORTED_OPTIONS if kwargs.get(name) is not None]
    if dropout or unsupported or not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"TTT chain attention: dropout={dropout}, options {unsupported}, mask {type(attention_mask).__name__}; "
            "it computes plain softmax attention with a step-0 block mask, as transformers' SDPA function does"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return chain_attention(query, key, value, attention_mask, scale), None


def _layer_attention(heads: nn.Module) -> nn.Module | None:
    """The attention module of EAGLE-3 heads' decoder layer (None for other heads)."""
    return getattr(getattr(heads, "layer", None), "self_attn", None)


def uses_ttt_chain_attention(heads: nn.Module) -> bool:
    """Whether these EAGLE-3 heads' decoder layer attends through `ttt_chain_attention_forward`."""
    attention = _layer_attention(heads)
    return attention is not None and attention.config._attn_implementation == TTT_CHAIN_ATTENTION


def use_ttt_chain_attention(heads: nn.Module) -> None:
    """Point EAGLE-3 heads' decoder layer (SDPA attention) at `ttt_chain_attention_forward`, in place.

    Only the unroll's calls change (the same outputs up to rounding, tested); drafting with these heads stays on
    transformers' SDPA. Checkpoints do not record it (a loaded head is on SDPA again).

    Raises:
        ValueError: heads without a decoder layer on SDPA attention.
    """
    attention = _layer_attention(heads)
    if attention is None or attention.config._attn_implementation not in ("sdpa", TTT_CHAIN_ATTENTION):
        got = None if attention is None else attention.config._attn_implementation
        raise ValueError(f"TTT chain attention needs EAGLE-3 heads on SDPA attention; got {type(heads).__name__} ({got})")
    AttentionInterface.register(TTT_CHAIN_ATTENTION, ttt_chain_attention_forward)
    AttentionMaskInterface.register(TTT_CHAIN_ATTENTION, sdpa_mask)  # its masks (outside the unroll) are SDPA's
    attention.config._attn_implementation = TTT_CHAIN_ATTENTION


def wants_ttt_chain_attention(choice: str, device: torch.device) -> bool:
    """Whether `loss.ttt_attention=CHOICE` means chain attention: 'chain' yes, 'dense' no, 'auto' on the CPU."""
    if choice not in TTT_ATTENTION_CHOICES:
        raise ValueError(f"loss.ttt_attention={choice!r}; expected one of {TTT_ATTENTION_CHOICES}")
    return choice == "chain" or (choice == "auto" and torch.device(device).type == "cpu")
