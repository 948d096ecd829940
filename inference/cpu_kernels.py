"""The CPU kernels a `SpeculativeLM` runs on, chosen the way the command line's options say (`use_cpu_kernels`).

Each kernel is a `use_*` method (`CpuKernels`, which `SpeculativeLM` inherits) that swaps layers in place (oneDNN linear layers, int8 draft layers,
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


class CpuKernels:
    """`SpeculativeLM`'s kernel methods: each swaps the target's and / or the heads' layers in place (it reads
    `self.target`, `self.heads` and sets `self.certified_argmax`)."""

    def use_onednn_linears(self) -> int:
        """CPU, float32: run the target's and the heads' linear layers on oneDNN with prepacked weights, in place.

        Faster few-row products (tree verification, draft levels) on CPUs where the default BLAS is slow at them
        (inference/onednn.py). Inference only: afterwards neither model can be trained, moved or saved, and the
        target's own `generate` uses the same layers. Returns the number of layers swapped.
        """
        from specheads.inference.onednn import use_onednn_linears

        return use_onednn_linears(self.target) + use_onednn_linears(self.heads)

    def use_int8_draft_linears(self) -> int:
        """CPU, float32: run the HEADS' linear layers in int8 (int8 weights, dynamically quantized inputs), in place.

        Drafting reads a quarter of the weight bytes (inference/int8_linear.py); the target stays float32 and
        verifies every drafted token, so outputs are unchanged (greedy identical, sampling exact) and only the
        acceptance rate can move. Call it before `use_onednn_linears` (which then leaves the int8 layers alone).
        Inference only: the heads can no longer be trained or saved. Returns the number of layers swapped.
        """
        from specheads.inference.int8_linear import use_int8_linears

        if getattr(self.heads, "shares_target_weights", False):
            raise ValueError(f"int8 draft layers: this draft model ({self.heads.config.draft_model_name_or_path}) is "
                             "made of the target's own layers, which int8 would change for verification too; draft "
                             "with the default layers (--draft-linear default)")
        return use_int8_linears(self.heads, keep=self.heads.float32_linears)

    def use_certified_argmax(self) -> None:
        """CPU, float32: greedy verification takes the target's argmax from a bf16 lm_head product whose error is
        bounded, rescoring in float32 the few tokens the bound cannot separate (inference/certified_argmax.py).

        Outputs are unchanged (the target's own argmax); the lm_head costs about half. Greedy decoding uses it row
        by row and batched; sampling and the GPU fast path keep the full logits. Call it before `use_onednn_linears`
        (which hides the weight).

        Raises:
            ValueError: a target this does not apply to (see `certified_argmax_for`).
        """
        from specheads.inference.certified_argmax import certified_argmax_for

        self.certified_argmax = certified_argmax_for(self.target)

    def use_gqa_attention(self) -> int:
        """Run the target's and the heads' grouped-query SDPA attention without repeating keys and values, in place.

        Tree verification and drafting are forwards of several tokens with a mask, for which transformers' SDPA
        attention copies every layer's cached keys and values once per query group; this hands them to PyTorch's
        SDPA grouped instead (inference/gqa_attention.py; CPU, torch >= 2.5). Outputs are unchanged; the target's own
        `generate` (one token a step) is unaffected. Returns the number of attention layers switched.
        """
        from specheads.inference.gqa_attention import use_gqa_attention

        return use_gqa_attention(self.target) + use_gqa_attention(self.heads)

    def use_cpu_kernels(
        self, cpu_linear: str = "auto", draft_linear: str = "auto", cpu_attention: str = "auto", cpu_argmax: str = "auto"
    ) -> dict[str, str]:
        """Pick the CPU kernels by the CLI's choices, in the order they must be applied; returns what is in use.

        Args:
            cpu_linear: 'onednn' | 'default' | 'auto' (onednn for a float32 CPU target): `use_onednn_linears`.
            draft_linear: 'int8' | 'default' | 'auto' (int8 for float32 CPU heads): `use_int8_draft_linears`.
            cpu_attention: 'gqa' | 'default' | 'auto' (gqa for a CPU target with grouped key/value heads on SDPA
                attention): `use_gqa_attention`.
            cpu_argmax: 'bf16' | 'default' | 'auto' (bf16 for a float32 CPU target with a plain linear lm_head on a
                CPU with bf16 in hardware; left off where the target's logits are not that product):
                `use_certified_argmax`.

        Returns:
            {"cpu_linear": "onednn" or "default", "draft_linear": "int8" or "default", "cpu_attention": "gqa" or
            "default", "cpu_argmax": "bf16" or "default"}.
        """
        return use_cpu_kernels(self, cpu_linear, draft_linear, cpu_attention, cpu_argmax)
