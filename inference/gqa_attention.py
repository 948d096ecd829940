"""Grouped-query attention without copying the KV cache: SDPA's `enable_gqa` for tree forwards on the CPU.

A target with fewer key/value heads than query heads (GQA: SmolLM2, Llama 3, Qwen2, Mistral, ...) shares each
key/value head among a group of query heads. For a one-token forward transformers' SDPA attention folds the group
into the query; for a forward of several tokens WITH a mask, which tree verification and drafting always are, it
repeats every key/value head for its group (`repeat_kv`): a copy of the layer's whole cached keys and values, in
every layer, every round, growing with the context. PyTorch's CPU SDPA kernel takes the grouped keys and values
with a mask directly (`enable_gqa=True`, torch >= 2.5) and computes the same products without the copy.

`sdpa_gqa_attention_forward` does exactly that for the case where transformers would copy (a CPU forward of
several query tokens with a mask tensor, more query heads than key/value heads) and hands every other call to
transformers' own SDPA function unchanged: plain decoding (one token), prefill (no mask), GPUs. It is registered
with transformers' `AttentionInterface` (the documented way to add an attention implementation; registering adds
the name `GQA_ATTENTION`, nothing else changes) together with SDPA's mask function, and `use_gqa_attention` points a
model's SDPA attention at it. Measured on SmolLM2-135M (2 CPU threads, `python scripts/attention_cost.py`): a 12-node
verification 110.2 instead of 127.1 ms with 250 cached tokens, 154.6 instead of 175.1 ms with 800 on a slow phase of
the machine; 74.6 instead of 78.4 and 83.1 instead of 91.6 ms on a fast one.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_ATTENTION = "specheads_sdpa_gqa"  # the attention implementation's name in transformers' registries
CPU_ATTENTION_CHOICES = ("default", "gqa", "auto")  # the CLI's --cpu-attention


def has_masked_gqa() -> bool:
    """Whether this PyTorch's SDPA takes grouped keys / values (`enable_gqa`, added in torch 2.5)."""
    return tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa_gqa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, T, d), key / value (B, H_kv, S, d), mask
    (B or 1, 1, T, S). Returns the attention output (B, T, H, d) and no weights.

    Grouped keys and values go to SDPA as they are where transformers would repeat them; every other call is
    transformers' `sdpa_attention_forward`.
    """
    # ordered so that a one-token decoding step (every step of plain `generate`) leaves after the first test
    if (
        query.shape[2] == 1
        or not isinstance(attention_mask, torch.Tensor)
        or getattr(module, "num_key_value_groups", 1) == 1
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (B, H, T, d)
    return out.transpose(1, 2).contiguous(), None


def register_gqa_attention() -> None:
    """Add `GQA_ATTENTION` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa_attention_forward)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # its masks are SDPA's


def use_gqa_attention(model: nn.Module) -> int:
    """Point every SDPA attention layer inside `model` (a target, or EAGLE heads' decoder layer) at
    `sdpa_gqa_attention_forward`, in place; returns how many attention layers now use it.

    Outputs are unchanged (the same products, without the copy); only forwards of several tokens with a mask on
    the CPU take the new route. Layers on another attention implementation (eager, flash) are left alone.

    Raises:
        RuntimeError: PyTorch older than 2.5 (no `enable_gqa`).
    """
    if not has_masked_gqa():
        raise RuntimeError(f"grouped-query SDPA needs torch >= 2.5 (enable_gqa), this is torch {torch.__version__}")
    register_gqa_attention()
    return _switch_attention(model, "sdpa", GQA_ATTENTION)


def use_sdpa_attention(model: nn.Module) -> int:
    """Undo `use_gqa_attention`: its layers back on transformers' SDPA attention; returns how many were switched."""
    return _switch_attention(model, GQA_ATTENTION, "sdpa")


def _switch_attention(model: nn.Module, old: str, new: str) -> int:
    """Move the attention layers inside `model` whose implementation is `old` to `new`; returns how many use `new`."""
    attention = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "config")]
    configs = {id(m.config): m.config for m in attention if m.config._attn_implementation == old}
    if hasattr(model, "set_attn_implementation") and id(getattr(model, "config", None)) in configs:
        model.set_attn_implementation(new)  # a transformers model: its own API, sub-configs included
    for config in configs.values():
        if config._attn_implementation == old:  # what is left: configs of layers the model holds (EAGLE heads' layer)
            config._attn_implementation = new
    return sum(m.config._attn_implementation == new for m in attention)


def wants_gqa_attention(choice: str, target: nn.Module) -> bool:
    """Whether `--cpu-attention CHOICE` means `use_gqa_attention`: 'gqa' yes, 'default' no, 'auto' for a CPU
    target with grouped key/value heads on SDPA attention when this PyTorch supports it."""
    if choice not in CPU_ATTENTION_CHOICES:
        raise ValueError(f"--cpu-attention {choice!r}; expected one of {CPU_ATTENTION_CHOICES}")
    if choice != "auto":
        return choice == "gqa"
    grouped_sdpa = any(
        getattr(m, "num_key_value_groups", 1) > 1 and m.config._attn_implementation == "sdpa"
        for m in target.modules()
        if hasattr(m, "config")
    )
    on_cpu = next(target.parameters()).device.type == "cpu"
    return on_cpu and grouped_sdpa and has_masked_gqa()
