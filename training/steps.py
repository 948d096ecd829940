"""One optimizer step, the cross-process reductions a training loop decides by, and what follows a periodic held-out
evaluation: shared by the heads' loop (training/train.py) and the draft models' (training/distill.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from specheads.training.best_heads import BEST_DIR, BestHeads
from specheads.training.config import RunConfig


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


def out_of_time(accelerator: Accelerator, config: RunConfig, started: float) -> bool:
    """Whether `time_limit_minutes` has passed since `started` on any process (all stop at the same step)."""
    late = config.time_limit_minutes is not None and time.time() - started > 60 * config.time_limit_minutes
    return any_process(accelerator, late)


def after_evaluation(accelerator: Accelerator, config: RunConfig, step: int, scores: dict[str, float],
                     model: torch.nn.Module, best: BestHeads | None, last: dict[str, float]) -> bool:
    """Report the held-out `scores` (eval_*) of `step`, offer the model to `best` (main process only: else None), and
    say whether the run stops early (`early_stopping_patience`; decided by the main process, applied by all)."""
    accelerator.print(f"[specheads] step {step} held-out: acc {scores['eval_acc']:.3f}, "
                      f"sim_tau {scores['eval_sim_tau']:.2f}")
    if config.trackers:
        accelerator.log({f"eval/{k[5:]}": v for k, v in scores.items()}, step=step)
    if best is not None and best.offer(accelerator.unwrap_model(model), step, {**last, **scores}):
        accelerator.print(f"[specheads] best held-out sim_tau so far: saved to {Path(config.output_dir) / BEST_DIR}")
    if not config.early_stopping_patience:
        return False
    return any_process(accelerator, best is not None and best.evaluations_since_best(
        step, config.eval_steps) >= config.early_stopping_patience)
