"""Int8 linear layers for the draft heads on the CPU: weights stored as int8 (one scale per output row),
activations quantized on the fly, products in integer arithmetic (PyTorch's quantized CPU engine, FBGEMM on x86).

Why only the heads: drafting only PROPOSES tokens. The target verifies every proposal in full precision and
acceptance is decided by the target's own logits, so an approximate draft can lower the acceptance rate but
can never change the output (greedy stays token-identical, sampling keeps the target's distribution: the
rejection rule uses the draft probabilities the int8 heads actually drafted with). The target itself is never
quantized.

Why it pays: a draft level of the SmolLM2 EAGLE-3 head reads ~35 MB of fp32 weights (one decoder layer and
an 8,192-row draft lm_head) for 1-4 rows of input; at a few rows per product the CPU time goes into reading
weights, and int8 reads a quarter of the bytes (~9 MB, which also fits in a 32 MB L3 cache across the draft
levels of a round, where the fp32 weights do not). On the 2-core AMD EPYC these benchmarks run on, the draft
lm_head (576 x 8192) at 4 rows took 1.5 ms with oneDNN fp32 and 0.33 ms in int8.

Accuracy: per-row symmetric int8 weights and per-tensor dynamic activations give a relative error of ~1-2%
on a product; the README's benchmarks measure what that does to acceptance (tau) side by side.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specheads.inference.linear_swap import is_float32_on_cpu, large_enough_for_cpu_kernels, replace_linears
from specheads.inference.onednn import OneDNNLinear

DRAFT_LINEAR_CHOICES = ("default", "int8", "auto")  # the CLI's --draft-linear


def int8_engine() -> str | None:
    """The quantized CPU engine int8 linears run on ('fbgemm' / 'x86' on x86, 'qnnpack' on ARM), or None."""
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    # quantized tensors are deprecated in PyTorch: a build without them (or without the op) gets None, and 'auto'
    # then keeps float32 heads
    if not engines or not hasattr(torch, "quantize_per_channel") or not hasattr(torch.ops.quantized, "linear_dynamic"):
        return None
    current = torch.backends.quantized.engine
    return current if current in engines else engines[0]


class Int8Linear(nn.Module):
    """`nn.Linear`'s product with int8 weights (per output row scales) and dynamically quantized inputs (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        # symmetric per-row scales: row r is stored as round(w_r / s_r) in [-127, 127], s_r = max|w_r| / 127
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        bias = None if bias is None else bias.detach().float().clone()
        with warnings.catch_warnings():  # PyTorch warns that quantized tensor constructors are deprecated
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zero_points, axis=0, dtype=torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.has_bias = bias is not None
        # FBGEMM's AVX2 kernels can saturate 16-bit intermediates with full-range activations: 7-bit inputs avoid
        # it (what torch.ao's dynamic Linear does on x86); QNNPACK has no such limit.
        self.reduce_range = torch.backends.quantized.engine in ("fbgemm", "x86")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) float32 -> (..., out_features) float32."""
        rows = x.reshape(-1, self.in_features)  # the quantized op wants at least 2-D inputs
        out = torch.ops.quantized.linear_dynamic(rows, self._packed, self.reduce_range)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, int8"


def use_int8_linears(module: nn.Module, keep: tuple[str, ...] = ()) -> int:
    """Replace every `nn.Linear` inside `module` by an `Int8Linear`, in place; returns how many. Meant for draft
    heads (see the module docstring), never a target.

    Args:
        module: the heads (any module holding linear layers).
        keep: names of linear layers (as in `named_modules`) that stay float32: for draft heads,
            `heads.float32_linears`, the layers whose input is the target's raw residual stream (its outlier
            dimensions would make a per-tensor int8 input scale flatten everything else).

    Raises:
        RuntimeError: this PyTorch has no quantized CPU engine.
        ValueError: `module` is a bare linear layer; a layer is not a float32 CPU layer (name, device and dtype in
            the message); or the layers were already swapped for oneDNN's (whose prepacked weights cannot be read
            back: swap to int8 first).
    """
    if int8_engine() is None:
        raise RuntimeError(
            "int8 draft linears need a PyTorch with a quantized CPU engine (fbgemm/x86/qnnpack); "
            f"this one has {torch.backends.quantized.supported_engines}"
        )
    if isinstance(module, (nn.Linear, OneDNNLinear)):
        raise ValueError("use_int8_linears swaps the linear layers inside a module, not a bare linear layer")
    for name, child in module.named_modules():
        if isinstance(child, OneDNNLinear):
            raise ValueError(
                f"{name} is already a oneDNN linear layer: make the heads int8 before swapping the rest for oneDNN "
                "(SpeculativeLM.use_int8_draft_linears() before use_onednn_linears())"
            )
    return replace_linears(module, lambda linear: Int8Linear(linear.weight, linear.bias), "int8 draft linears", keep)


def wants_int8_drafting(choice: str, heads: nn.Module) -> bool:
    """Whether `--draft-linear CHOICE` means int8 draft heads: 'int8' yes, 'default' no, 'auto' when the heads
    run in float32 on the CPU, their linear layers are large enough to gain (`large_enough_for_cpu_kernels`) and PyTorch
    has a quantized engine (so one command runs on a GPU machine and on a tiny model too)."""
    if choice not in DRAFT_LINEAR_CHOICES:
        raise ValueError(f"--draft-linear {choice!r}; expected one of {DRAFT_LINEAR_CHOICES}")
    if choice != "auto":
        return choice == "int8"
    if getattr(heads, "shares_target_weights", False):  # an early-exit draft: its layers are the target's
        return False
    return is_float32_on_cpu(heads) and large_enough_for_cpu_kernels(heads) and int8_engine() is not None
