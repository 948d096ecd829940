"""oneDNN linear layers for CPU inference: the target's and heads' `nn.Linear`s with prepacked fp32 weights.

On the CPU, `nn.Linear` runs on the BLAS PyTorch was built with (MKL for the x86 wheels). For the few-row
products of speculative decoding (a tree of N nodes verified at once, the heads' draft levels) MKL's small-M
GEMM is slow on some CPUs. On the 2-core AMD EPYC these benchmarks run on, a 9-row product with a 576 x 1536
layer took 0.24 ms with MKL and 0.06 ms with oneDNN on a prepacked weight, with SmolLM2's 576 x 49152 lm_head
12.6 ms and 2.4 ms (one row: 7.2 ms and 1.3 ms). `OneDNNLinear` prepacks the weight once into oneDNN's layout
and multiplies dense inputs with `mkldnn._linear_pointwise` (the op inductor's CPU freezing uses; where this
PyTorch lacks it, `aten.mkldnn_linear` on oneDNN tensors, 2-3x slower), in fp32: the same arithmetic up to
summation order, as between any two GEMM kernels (greedy outputs stay identical in the tests and benchmarks).

The swap is in place and for inference only: afterwards the weights are oneDNN buffers, not parameters, so the
module cannot be trained, moved or saved. The target's own `generate` uses the new layers too, so a benchmark
against it compares like with like. Heads keep the target modules they borrowed before the swap (EAGLE reads the
target's lm_head weight), which stay usable.
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.inference.linear_swap import is_float32_on_cpu, large_enough_for_cpu_kernels, replace_linears


def has_prepacked_linear() -> bool:
    """Whether this PyTorch has oneDNN's dense-input linear on a prepacked weight (what inductor's CPU freezing
    uses): faster than `aten.mkldnn_linear`, which converts every input and output to and from oneDNN tensors."""
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class OneDNNLinear(nn.Module):
    """`nn.Linear`'s product on oneDNN, its weight prepacked in oneDNN's layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.prepacked = has_prepacked_linear()
        weight = linear.weight.detach()
        weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.prepacked else weight.to_mkldnn()
        # Not persistent: a state_dict of oneDNN tensors could not be saved anyway (the module is inference-only).
        self.register_buffer("weight", weight, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if bias is not None and not self.prepacked:
            bias = bias.to_mkldnn()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) float32 -> (..., out_features)."""
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.ops.aten.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_onednn_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` inside `module` (in place) by oneDNN's prepacked fp32 linear; returns how many.

    Raises:
        RuntimeError: PyTorch was built without oneDNN.
        ValueError: a linear layer is not a float32 CPU layer (name, device and dtype in the message).
    """
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("oneDNN linear layers need a PyTorch built with oneDNN (mkldnn); this one has none")
    if isinstance(module, nn.Linear):
        raise ValueError("use_onednn_linears swaps the Linear layers inside a module, not a bare nn.Linear")
    return replace_linears(module, OneDNNLinear, "oneDNN linear layers")


CPU_LINEAR_CHOICES = ("default", "onednn", "auto")  # the CLI's --cpu-linear


def wants_onednn(choice: str, target: nn.Module) -> bool:
    """Whether `--cpu-linear CHOICE` means oneDNN layers for `target`: 'onednn' yes, 'default' no, 'auto' for a
    float32 CPU target whose linear layers are large enough to gain (`large_enough_for_cpu_kernels`:
    SmolLM2 yes, stories260K no) when PyTorch has oneDNN (so one command runs on a GPU machine and on a tiny model too)."""
    if choice not in CPU_LINEAR_CHOICES:
        raise ValueError(f"--cpu-linear {choice!r}; expected one of {CPU_LINEAR_CHOICES}")
    if choice != "auto":
        return choice == "onednn"
    return is_float32_on_cpu(target) and torch.backends.mkldnn.is_available() and large_enough_for_cpu_kernels(target)
