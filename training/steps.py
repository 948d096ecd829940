"""One optimizer step, the cross-process reductions a training loop decides by, and what follows a periodic held-out
evaluation: shared by the heads' loop (training/train.py) and the draft models' (training/distill.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from specheads.atomic_files import write_atomically
from specheads.training.best_heads import BEST_DIR, BEST_METRIC, BestHeads, Saver
from specheads.training.checkpoints import STATE_FILE, latest_checkpoint
from specheads.training.config import RunConfig, config_to_dict


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


def step_metrics(accelerator: Accelerator, config: RunConfig, step: int, sums: dict[str, float], scheduler: Any,
                 bar: Any) -> dict[str, float]:
    """The finished optimizer `step`'s metrics (this process's micro-batch means `sums`, averaged over the processes,
    plus the learning rate), shown on the progress `bar` and logged every `log_steps`."""
    last = {**mean_over_processes(accelerator, sums), "lr": scheduler.get_last_lr()[0]}
    bar.update(1)
    bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['acc']:.3f}", tau=f"{last['sim_tau']:.2f}")
    if config.trackers and (step % config.log_steps == 0 or step == config.max_steps):
        accelerator.log({f"train/{k}": v for k, v in last.items()}, step=step)
    return last


def any_process(accelerator: Accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process: decisions to stop are taken together, at the same step everywhere."""
    return float(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum")) > 0


def out_of_time(accelerator: Accelerator, config: RunConfig, started: float) -> bool:
    """Whether `time_limit_minutes` has passed since `started` on any process (all stop at the same step; without a
    limit, the same on every process, no collective call)."""
    if config.time_limit_minutes is None:
        return False
    return any_process(accelerator, time.time() - started > 60 * config.time_limit_minutes)


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


def resume_state(accelerator: Accelerator, config: RunConfig) -> tuple[Path | None, int, dict[str, Any] | None]:
    """Load the latest checkpoint in output_dir into the prepared objects, if there is one: (its folder or None, the
    step to start from, the metrics.json of a run that is done there, or None). A run is done when it reached
    max_steps, or stopped early and `early_stopping_patience` was not raised since (the caller returns its metrics)."""
    resume = latest_checkpoint(config.output_dir)
    if resume is None:
        return None, 0, None
    accelerator.load_state(str(resume))
    start_step = json.loads((resume / STATE_FILE).read_text())["step"]
    accelerator.print(f"[specheads] resuming from {resume} (step {start_step})")
    done_metrics = Path(config.output_dir) / "metrics.json"
    recorded = json.loads(done_metrics.read_text()) if done_metrics.is_file() else None
    if recorded is not None and start_step >= config.max_steps:
        accelerator.print(f"[specheads] {config.output_dir} is already trained to max_steps={config.max_steps}")
        return resume, start_step, recorded
    if (recorded is not None and recorded.get("early_stopped") and recorded.get("steps") == start_step
            and 0 < config.early_stopping_patience <= recorded["early_stopping_patience"]):
        accelerator.print(f"[specheads] {config.output_dir} stopped early at step {start_step} "
                          f"(early_stopping_patience={recorded['early_stopping_patience']}); raise the patience, "
                          "or set it to 0, to train on")
        return resume, start_step, recorded
    return resume, start_step, None


def flat_hparams(config: RunConfig) -> dict[str, Any]:
    """The config flattened to scalar values (TensorBoard hparams take no lists or dicts)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and prefix != "head.options":
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat[prefix] = node if isinstance(node, (int, float, str, bool)) else json.dumps(node)

    walk("", config_to_dict(config))
    return flat


def init_trackers(accelerator: Accelerator, config: RunConfig) -> None:
    """Start the run's trackers (TensorBoard, W&B offline unless WANDB_MODE says otherwise) with its flat config."""
    if config.trackers:
        init_kwargs = {"wandb": {"mode": os.environ.get("WANDB_MODE", "offline")}} if "wandb" in config.trackers else {}
        accelerator.init_trackers(config.project_name, config=flat_hparams(config), init_kwargs=init_kwargs)


def save_final(accelerator: Accelerator, config: RunConfig, model: torch.nn.Module, step: int, metrics: dict[str, Any],
               best: BestHeads | None, save: Saver) -> None:
    """The end of a run, on the main process: the final model offered to `best` (its step and score added to
    `metrics`), saved to output_dir/final by `save`, and metrics.json and run_config.json written (all atomically)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        if best is not None:
            best.offer(final, step, metrics)
            metrics.update({"best_step": best.record["step"], f"best_{BEST_METRIC}": best.record[BEST_METRIC]})
            accelerator.print(f"[specheads] best held-out sim_tau {best.record[BEST_METRIC]:.3f} at step "
                              f"{best.record['step']}: {Path(config.output_dir) / BEST_DIR}")
        save(final, Path(config.output_dir) / "final", metrics, {})
        write_atomically(Path(config.output_dir) / "metrics.json", json.dumps(metrics, indent=2))
        write_atomically(Path(config.output_dir) / "run_config.json", json.dumps(config_to_dict(config), indent=2))
    accelerator.wait_for_everyone()
