"""The target's greedy choice without its full-precision lm_head: a bf16 product, certified by error bounds.

Greedy verification needs one number per tree node: the argmax of the target's logits. On the CPU the lm_head
product behind them is a large share of a verification forward (SmolLM2-135M, 2 threads, 12 nodes: 576 x 49,152
in float32 on oneDNN, 3.1 ms of ~29). The same product in bf16 takes about half the time, but its logits are
off by up to ~1% and a near tie could then pick another token. `CertifiedArgmax` keeps the output exact:

1. approximate logits  L~ = bf16(x) @ bf16(W)^T  (oneDNN, float32 accumulation, bf16 output), per row x;
2. a per-row bound E on |L - L~|, where L are the logits the float32 lm_head would give (below);
3. every token whose approximate logit is within 2E of the row's best could be the true argmax; those few
   (a median of 3, a mean of 5.6 a row on MT-bench answers) are scored again in float32, x . w_j, and the best
   of them wins (the lowest id among equal logits, as `torch.argmax` does).

The bound, for a row x and token j (w_j the float32 weight row, ~ marking bf16 rounding, d the hidden size):
    x.w_j - x~.w~_j = (x - x~).w~_j + x.(w_j - w~_j)           <= |x - x~| |w~_j| + |x| |w_j - w~_j|
    float32 sums of d products (any order), ours and the target's own, each <= d 2^-24 |x| |w_j| (+ a flushed
    subnormal or two): `gamma` = max(1e-4, 2 d 2^-24) covers each with 2-3x to spare;
    rounding the float32 accumulator to the bf16 output                  <= 2^-9 |accumulator| (2^-7 taken)
Taking the maxima over the vocabulary of |w~_j| and |w_j - w~_j| + gamma |w_j| (computed once) makes E one number
per row. The candidates' approximate logits lie within 2E of the best one, so the output term is bounded
through |L~_best| + 2E (solved for E below). The bound is worst-case (Cauchy-Schwarz); on real hidden states
the errors are a few percent of it (tests/inference/test_certified_argmax.py checks both).

What stays the same: the float32 rescoring sums in another order than the target's lm_head, exactly as a 1-row
and a 12-row product of the same layer do (plain `generate` against tree verification); only logits equal to
the last bits could order differently. Sampling needs the whole distribution and keeps the full lm_head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specheads.heads.cache_keyword import declared_parameters
from specheads.inference.onednn import OneDNNLinear, has_prepacked_linear
from specheads.targets import logit_transforms

FLOAT32_UNIT_ROUNDING = 2.0**-24
# relative error of rounding a float32 accumulator to the bf16 output: 2^-9 to nearest (oneDNN), 2^-8 in any
# direction; twice that here so that the rounding of the bound's own terms is covered too
BF16_OUTPUT_ROUNDING = 2.0**-7
BLOCK = 64  # vocabulary ids per block when selecting candidates
MAX_CANDIDATES = 4096  # more (row, id) candidates than this: the full float32 product is cheaper
CPU_ARGMAX_CHOICES = ("default", "bf16", "auto")  # the CLI's --cpu-argmax


class CertifiedArgmax:
    """`argmax(hidden @ weight.T)` over the whole vocabulary, computed mostly in bf16 and certified exact.

    Args:
        weight: (V, h) the target's float32 lm_head weight, kept (not copied) for the exact rescoring.
        output_layer: returns the target's output layer as it is when called (the oneDNN layer once the CPU
            kernels are swapped): it scores the rare batches the bound cannot narrow. None: `hidden @ weight.T`.
    """

    def __init__(self, weight: torch.Tensor, output_layer: Callable[[], torch.nn.Module] | None = None) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"CertifiedArgmax needs a (vocab, hidden) float32 CPU weight, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        self.weight = weight.detach()  # (V, h) float32
        self.output_layer = output_layer
        rounded = self.weight.to(torch.bfloat16)  # (V, h)
        # oneDNN's prepacked bf16 product where it has one for this CPU, else PyTorch's own bf16 linear
        bf16_check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        self.prepacked = has_prepacked_linear() and bf16_check is not None and bool(bf16_check())
        self.bf16_weight = torch.ops.mkldnn._reorder_linear_weight(rounded, None) if self.prepacked else rounded
        # the relative error of a float32 dot product of this length, summed in any order, with margin
        self.gamma = max(1e-4, 2 * self.weight.shape[1] * FLOAT32_UNIT_ROUNDING)
        # The vocabulary-wide maxima of the bound's weight terms, in float64, rounded up.
        exact, approx = self.weight.double(), rounded.double()
        self.max_rounded_norm = float(approx.norm(dim=1).max()) * (1 + 1e-6)  # max_j |w~_j|
        rounding = (exact - approx).norm(dim=1) + self.gamma * exact.norm(dim=1)
        self.max_rounding_norm = float(rounding.max()) * (1 + 1e-6)  # max_j |w_j - w~_j| + gamma |w_j|

    def approximate_logits(self, hidden: torch.Tensor, rounded: torch.Tensor | None = None) -> torch.Tensor:
        """(N, h) float32 -> (N, V) bf16 logits of the bf16-rounded hidden states (`rounded`, if already made) and
        weight."""
        rounded = hidden.to(torch.bfloat16) if rounded is None else rounded
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(rounded, self.bf16_weight, None, "none", [], "")
        return torch.nn.functional.linear(rounded, self.bf16_weight)

    def error_bound(self, hidden: torch.Tensor, best: torch.Tensor, rounded: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) bound E on |float32 logit - approximate logit| over tokens whose approximate logit is >= best - 2E.

        Args:
            hidden: (N, h) float32; best: (N,) float32, each row's largest approximate logit; rounded: `hidden` in
                bf16, if already made.
        """
        rounded = hidden.to(torch.bfloat16) if rounded is None else rounded
        x_norm = hidden.norm(dim=1)  # (N,) |x|
        rounding = (hidden - rounded.float()).norm(dim=1)  # (N,) |x - x~|
        products = (rounding + self.gamma * (x_norm + rounding)) * self.max_rounded_norm + x_norm * self.max_rounding_norm
        products = products + 1e-30  # subnormal products a bf16 kernel may flush to zero
        # E = products (1 + c) + c (|best| + 2E) covers the output rounding of every token whose approximate logit
        # is >= best - 2E, and of the true argmax whatever its approximate logit (rounding is monotone)
        c = BF16_OUTPUT_ROUNDING
        return (products * (1 + c) + c * best.abs()) / (1 - 2 * c) * (1 + 1e-3)  # margin: this arithmetic's rounding

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, h) float32 final hidden states -> (N,) long: the argmax of the float32 lm_head's logits."""
        n, vocab = hidden.shape[0], self.weight.shape[0]
        rounded = hidden.to(torch.bfloat16)  # (N, h) x~
        approx = self.approximate_logits(hidden, rounded).float()  # (N, V)
        best = approx.amax(dim=1)  # (N,)
        floor = best - 2 * self.error_bound(hidden, best, rounded)  # (N,) a token below its row's floor is not its argmax
        if not bool(torch.isfinite(floor).all()):  # inf / nan hidden states: no bound holds
            return self.full_argmax(hidden)
        rows, ids = self.candidates(approx, floor)  # (k,) each, by row then id
        if rows.numel() > MAX_CANDIDATES:  # rows too flat for the bound to narrow (not seen on real text)
            return self.full_argmax(hidden)
        exact = (hidden[rows] * self.weight[ids]).sum(dim=1)  # (k,) float32 logits of the candidates
        row_best = exact.new_full((n,), float("-inf")).scatter_reduce(0, rows, exact, "amax")  # (N,)
        winning = exact == row_best[rows]  # (k,)
        # the lowest id among a row's equal maxima, as a full argmax picks
        return ids.new_full((n,), vocab).scatter_reduce(0, rows[winning], ids[winning], "amin")

    @staticmethod
    def candidates(approx: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, id) pairs of (N, V) `approx` at or above their row's `floor` (N,), ordered by row, then id.

        Blocks of BLOCK ids first: only blocks whose maximum clears the floor are compared element by element
        (one pass over the logits and a few blocks, instead of a full comparison and a full nonzero: 0.06 against
        0.27 ms for 12 x 49,152).
        """
        n, vocab = approx.shape
        if vocab % BLOCK:  # pad the last block with logits no floor reaches
            approx = torch.nn.functional.pad(approx, (0, BLOCK - vocab % BLOCK), value=float("-inf"))
        blocks = approx.view(n, -1, BLOCK)  # (N, V / BLOCK, BLOCK)
        block_rows, block_ids = (blocks.amax(dim=2) >= floor[:, None]).nonzero(as_tuple=True)  # (b,) each
        hits = blocks[block_rows, block_ids] >= floor[block_rows, None]  # (b, BLOCK)
        which, offset = hits.nonzero(as_tuple=True)  # (k,) each
        return block_rows[which], block_ids[which] * BLOCK + offset

    def full_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, h) -> (N,): the argmax of the full float32 product, by the target's output layer when it has one."""
        if self.output_layer is not None:
            return self.output_layer()(hidden).argmax(dim=-1)
        return (hidden @ self.weight.T).argmax(dim=-1)


def certified_argmax_for(target: PreTrainedModel) -> CertifiedArgmax:
    """A `CertifiedArgmax` for this target's lm_head, after checking that its logits are exactly
    `lm_head(last hidden state)` (no bias, scaling or capping) and that its forward can skip them.

    Call it before the target's linear layers are swapped for oneDNN's (which no longer expose the weight).

    Raises:
        ValueError: the target is not float32 on the CPU; its output layer is not a bias-free `nn.Linear`; its
            forward has no `logits_to_keep`; or its logits are not the product of its last hidden state with the
            lm_head weight (each named in the message).
    """
    reason = unsupported_reason(target)
    if reason is not None:
        raise ValueError(f"--cpu-argmax bf16 {reason}")
    weight = target.get_output_embeddings().weight
    with torch.no_grad():  # a model whose logits are scaled, biased or capped after the lm_head is not supported
        probe = torch.arange(1, 9, device=weight.device)[None] % target.config.get_text_config().vocab_size
        out = target(input_ids=probe, output_hidden_states=True, use_cache=False)
        recomputed = out.hidden_states[-1] @ weight.T
        if not torch.allclose(out.logits.float(), recomputed, rtol=1e-4, atol=1e-4 * float(recomputed.abs().max()) + 1e-6):
            raise ValueError(
                f"--cpu-argmax bf16: {type(target).__name__}'s logits are not lm_head(last hidden state) (scaled or "
                "capped logits?); use --cpu-argmax default"
            )
    return CertifiedArgmax(weight, output_layer=target.get_output_embeddings)


def unsupported_reason(target: PreTrainedModel) -> str | None:
    """Why `CertifiedArgmax` cannot serve this target (its output layer, dtype, device or forward), or None."""
    head = target.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return (
            f"needs the target's output layer to be a bias-free nn.Linear, got {type(head).__name__}"
            + (" with a bias" if isinstance(head, torch.nn.Linear) else "")
            + (" (swap the CPU kernels after use_certified_argmax, not before)" if isinstance(head, OneDNNLinear) else "")
        )
    transforms = logit_transforms(target)
    if transforms:  # a capped or scaled logit can tie where the lm_head's product does not (and vice versa)
        listed = ", ".join(f"{name}={value}" for name, value in transforms.items())
        return f"needs logits that are lm_head(last hidden state); {type(target).__name__}'s config transforms them ({listed})"
    if head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return f"is for float32 CPU targets; the lm_head is {head.weight.dtype} on {head.weight.device}"
    if "logits_to_keep" not in declared_parameters(type(target).forward):
        return f"needs a target forward with logits_to_keep; {type(target).__name__} has none"
    return None


def has_native_bf16_products() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and this PyTorch has oneDNN's prepacked
    product: elsewhere oneDNN emulates bf16 and the approximate product may cost as much as the float32 one."""
    cpu = torch.cpu
    native = any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return native and torch.backends.mkldnn.is_available() and has_prepacked_linear()


def wants_certified_argmax(choice: str, target: PreTrainedModel) -> bool:
    """Whether `--cpu-argmax CHOICE` means `certified_argmax_for(target)`: 'bf16' yes, 'default' no, 'auto' for a
    float32 CPU target whose output layer is a bias-free linear, on a CPU with bf16 in hardware."""
    if choice not in CPU_ARGMAX_CHOICES:
        raise ValueError(f"--cpu-argmax {choice!r}; expected one of {CPU_ARGMAX_CHOICES}")
    if choice != "auto":
        return choice == "bf16"
    return has_native_bf16_products() and unsupported_reason(target) is None
