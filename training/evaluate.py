"""Held-out evaluation of draft heads: the training metrics (per-depth accuracy, simulated tau, loss) on data the
heads did not train on, with no gradients, no input noise and no dropout.

Training metrics are measured on the batch just trained on, so they say how well heads fit their data, not how
well they draft elsewhere: SmolLM2's EAGLE-3 heads score acc_depth1 0.80 on their training answers but 0.66 on
ShareGPT prompts they never saw and 0.56 on MT-bench answers. `train` evaluates a held-out split
(`data.eval_fraction`) or file (`data.eval_source`) every `eval_steps`; `specheads eval` scores trained heads on a
conversation file or on the target's own greedy answers to benchmark prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from specheads.training.data import batch_to
from specheads.training.losses import LossOutput


def split_eval_indices(num_examples: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded split of example indices into (train, eval): round(fraction * n) eval examples (at least one when
    fraction > 0), both lists sorted. The same (n, fraction, seed) always gives the same split, so resumed runs
    train on the same examples."""
    if not 0 <= fraction < 1:
        raise ValueError(f"data.eval_fraction={fraction!r} is invalid; expected a fraction in [0, 1)")
    if fraction == 0:
        return list(range(num_examples)), []
    count = max(1, round(fraction * num_examples))
    if count >= num_examples:
        raise ValueError(f"data.eval_fraction={fraction} leaves no training examples out of {num_examples}")
    eval_indices = sorted(random.Random(seed).sample(range(num_examples), count))
    held_out = set(eval_indices)
    return [i for i in range(num_examples) if i not in held_out], eval_indices


@torch.no_grad()
def evaluate(
    loss_fn: Callable[[dict[str, torch.Tensor]], LossOutput],
    examples: Sequence[Any],
    make_batch: Callable[[list[Any]], dict[str, torch.Tensor]],
    batch_size: int,
    device: torch.device | str,
    progress: bool = True,
) -> dict[str, float]:
    """Average the loss function's metrics over `examples`, each batch weighted by its trained tokens.

    Args:
        loss_fn: batch -> LossOutput (the heads' training loss, run without gradients or noise).
        examples: rows `make_batch` accepts (tokenized conversations or offline feature rows).
        make_batch: list of rows -> batch dict with input_ids, attention_mask, loss_mask (B, T) tensors.
        batch_size: rows per forward.
        device: where the batches go.

    Returns:
        {metric: weighted mean} plus `tokens` (trained tokens scored). Keys are the loss's own metric names.
    """
    if len(examples) == 0:
        raise ValueError("evaluate: no examples to evaluate on")
    sums: dict[str, float] = {}
    weight_total = 0
    batches = range(0, len(examples), batch_size)
    for start in tqdm(batches, desc="eval", disable=not progress, leave=False):
        batch = batch_to(make_batch([examples[i] for i in range(start, min(start + batch_size, len(examples)))]), device)
        weight = int(batch["loss_mask"].sum())
        if weight == 0:
            continue
        for key, value in loss_fn(batch).metrics.items():
            sums[key] = sums.get(key, 0.0) + value * weight
        weight_total += weight
    if weight_total == 0:
        raise ValueError("evaluate: the examples have no trained (assistant) tokens to score")
    return {**{k: v / weight_total for k, v in sums.items()}, "tokens": weight_total}
