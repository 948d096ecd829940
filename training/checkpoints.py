"""Training checkpoints: model, optimizer, scheduler, RNG and the data position, written atomically.

A checkpoint is `output_dir/checkpoints/step-NNNNNNNN/`, complete once it holds `train_state.json`: it is written to a
temporary folder and renamed into place, so a run killed mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accelerate import Accelerator

CHECKPOINTS = "checkpoints"
STATE_FILE = "train_state.json"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder (one with train_state.json), or None."""
    root = Path(output_dir) / CHECKPOINTS
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, step: int, keep: int) -> Path:
    """Save model, optimizer, scheduler, RNG and the data position atomically: temp folder, then rename.

    Keeps the newest `keep` checkpoints. Every process calls this (each writes its own RNG state).
    """
    root = Path(output_dir) / CHECKPOINTS
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        complete = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
        for old in complete[: max(0, len(complete) - keep)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
