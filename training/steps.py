"""One optimizer step, and the cross-process reductions a training loop decides by: shared by the heads' loop
(training/train.py) and the draft models' (training/distill.py)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator


def optimizer_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                   loss: torch.Tensor, max_grad_norm: float) -> None:
    """Inside `accelerator.accumulate`: backward `loss`; on the micro-batch that ends an accumulation (gradients
    all-reduced) also clip, step and schedule (backward divides the loss by the accumulation steps; DeepSpeed alike)."""
    accelerator.backward(loss)
    if accelerator.sync_gradients and max_grad_norm > 0:
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if accelerator.sync_gradients:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def mean_over_processes(accelerator: Accelerator, values: dict[str, float]) -> dict[str, float]:
    """{name: value} averaged over the processes (every process passes the same names)."""
    keys = sorted(values)
    averaged = accelerator.reduce(torch.tensor([values[k] for k in keys], device=accelerator.device), "mean")
    return {k: float(v) for k, v in zip(keys, averaged.tolist())}


def any_process(accelerator: Accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process: decisions to stop are taken together, at the same step everywhere."""
    return float(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum")) > 0
