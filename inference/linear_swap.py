"""Swapping a module's `nn.Linear` layers, in place, for inference-only CPU kernels (oneDNN fp32, int8)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# 'auto' swaps a model's layers only when they are this wide (the median input width of its linear layers). Below
# it PyTorch's default small-matrix products are faster than oneDNN's prepacked or FBGEMM's int8 ones: on the
# 2-core AMD EPYC of the README, an h -> 3h layer at 1 / 9 rows took 4.7 / 8.2 us by default against 15.9 / 15.9
# (oneDNN) and 14.2 / 14.6 (int8) at h = 64, and 58 / 252 us against 42 / 61 and 19 / 29 at h = 576 (session 23).
AUTO_MIN_IN_FEATURES = 256


def is_float32_on_cpu(module: nn.Module) -> bool:
    """Whether `module`'s first parameter (or buffer, for a module without parameters) is float32 on the CPU."""
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor is not None and tensor.device.type == "cpu" and tensor.dtype == torch.float32


def typical_in_features(module: nn.Module) -> int:
    """The median input width of `module`'s `nn.Linear` layers (0 without any)."""
    widths = sorted(child.in_features for child in module.modules() if isinstance(child, nn.Linear))
    return widths[len(widths) // 2] if widths else 0


def wide_enough_for_cpu_kernels(module: nn.Module) -> bool:
    """Whether 'auto' should give `module` the swapped CPU kernels: its layers are `AUTO_MIN_IN_FEATURES` wide."""
    return typical_in_features(module) >= AUTO_MIN_IN_FEATURES


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
