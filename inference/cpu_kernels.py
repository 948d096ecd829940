"""The CPU kernels a `SpeculativeLM` runs on, chosen the way the command line's options say (`use_cpu_kernels`).

Each kernel is a `SpeculativeLM.use_*` method that swaps layers in place (oneDNN linear layers, int8 draft layers,
grouped SDPA attention, the certified bf16 argmax); they must be applied in a fixed order, and 'auto' decides each
from the target, the heads and this CPU.
"""

from __future__ import annotations

from typing import Any

from specheads.inference.certified_argmax import wants_certified_argmax
from specheads.inference.gqa_attention import wants_gqa_attention
from specheads.inference.int8_linear import wants_int8_drafting
from specheads.inference.onednn import wants_onednn


def use_cpu_kernels(
    lm: Any, cpu_linear: str = "auto", draft_linear: str = "auto", cpu_attention: str = "auto", cpu_argmax: str = "auto"
) -> dict[str, str]:
    """Apply the chosen kernels to `lm` (a `SpeculativeLM`; see `SpeculativeLM.use_cpu_kernels` for the choices), in
    the order they must be applied; returns what is in use."""
    int8 = wants_int8_drafting(draft_linear, lm.heads)
    onednn = wants_onednn(cpu_linear, lm.target)  # every choice is checked before anything is swapped
    gqa = wants_gqa_attention(cpu_attention, lm.target)
    argmax = wants_certified_argmax(cpu_argmax, lm.target)
    if int8:
        lm.use_int8_draft_linears()  # first: oneDNN's prepacked weights could not be quantized afterwards
    if argmax:  # before oneDNN, which hides the lm_head's weight
        try:
            lm.use_certified_argmax()
        except ValueError:
            if cpu_argmax != "auto":
                raise
            argmax = False  # 'auto' on a target whose logits are not lm_head(hidden): the full logits
    if onednn:
        lm.use_onednn_linears()
    if gqa:
        lm.use_gqa_attention()
    return {
        "cpu_linear": "onednn" if onednn else "default",
        "draft_linear": "int8" if int8 else "default",
        "cpu_attention": "gqa" if gqa else "default",
        "cpu_argmax": "bf16" if argmax else "default",
    }
