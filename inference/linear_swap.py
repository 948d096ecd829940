"""Swapping a module's `nn.Linear` layers, in place, for inference-only CPU kernels (oneDNN fp32, int8)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# 'auto' swaps a model's layers only when they hold this many weights (4 MiB of float32): below it the products are
# bound by per-call overhead and PyTorch's default kernels, cheaper to call, are faster than oneDNN's prepacked or
# FBGEMM's int8 ones. Session 23, 2-core AMD EPYC of the README: stories260K (0.26M linear weights; its EAGLE heads
# 0.05M) ran slower swapped (speculative 781 against 958 tokens/s on oneDNN, 844 with int8 heads); a random 12-layer
# Llama 128 wide with SmolLM2's 49,152-token vocabulary (7M, most in its lm_head) ran plain `generate` at 176-184
# against 137-140 tokens/s on oneDNN; SmolLM2 (134M; heads 4-10M) gains from both.
AUTO_MIN_LINEAR_WEIGHTS = 2**20


def is_float32_on_cpu(module: nn.Module) -> bool:
    """Whether `module`'s first parameter (or buffer, for a module without parameters) is float32 on the CPU."""
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor is not None and tensor.device.type == "cpu" and tensor.dtype == torch.float32


def linear_weights(module: nn.Module) -> int:
    """How many weights `module`'s `nn.Linear` layers hold in all."""
    return sum(child.weight.numel() for child in module.modules() if isinstance(child, nn.Linear))


def large_enough_for_cpu_kernels(module: nn.Module) -> bool:
    """Whether 'auto' should give `module` the swapped CPU kernels: its linear layers hold at least
    `AUTO_MIN_LINEAR_WEIGHTS` weights."""
    return linear_weights(module) >= AUTO_MIN_LINEAR_WEIGHTS


def replace_linears(
    module: nn.Module, make: Callable[[nn.Linear], nn.Module], kernels: str, keep: tuple[str, ...] = ()
) -> int:
    """Replace every `nn.Linear` inside `module` (names as in `named_modules`, except those in `keep`) by
    `make(linear)`, in place; returns how many. All are checked before any is replaced.

    Raises:
        ValueError: a layer to replace is not a float32 CPU layer (its name, dtype and device, and `kernels`,
            the kernels' name, in the message).
    """
    linears = [(name, child) for name, child in module.named_modules() if isinstance(child, nn.Linear) and name not in keep]
    for name, linear in linears:
        weight = linear.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"{kernels} are for float32 CPU inference; {name} is {weight.dtype} on {weight.device}")
    with torch.no_grad():
        for name, linear in linears:
            parent_name, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent_name), attribute, make(linear))
    return len(linears)
