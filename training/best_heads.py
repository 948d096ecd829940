"""Heads folders written whole or not at all, and `output_dir/best`: the heads with the best held-out score so far.

Training evaluates held-out data every `eval_steps`; with `save_best` the heads of the evaluation with the highest
`eval_sim_tau` (the simulated mean accepted length, what decoding speed follows) are kept in `output_dir/best`,
next to `output_dir/final` (the last step's). The folder holds `best.json` ({"step", "eval_sim_tau"}), written
in the same atomic rename as the weights, so a resumed run knows the score to beat.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

BEST_DIR, BEST_FILE = "best", "best.json"
BEST_METRIC = "eval_sim_tau"  # higher is better
# (module, folder, metrics, extra files) -> None: writes the folder atomically (`save_heads`, distill.save_draft_model)
Saver = Callable[[nn.Module, Path, dict[str, Any], dict[str, str]], None]


def replace_folder_atomically(folder: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a hidden folder beside `folder`, which then takes `folder`'s place (the old one moved aside
    first, then removed), so a crash leaves the previous complete folder or the new one, never a mix."""
    folder = Path(folder)
    tmp, old = folder.with_name(f".tmp-{folder.name}"), folder.with_name(f".old-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_heads(module: nn.Module, folder: str | os.PathLike, metrics: dict[str, Any], extra_files: dict[str, str] | None = None) -> None:
    """`module.save_pretrained(folder)` with `metrics` on its model card, atomically.

    The heads are written to a hidden folder beside `folder` and renamed into place (the old folder moved aside
    first, then removed), so a crash leaves the previous complete folder or the new one, never a mix.

    Args:
        module: heads (or Medusa-2's heads + adapter) with `model_card_metrics` and `save_pretrained`.
        folder: where the heads end up.
        metrics: shown on the model card (floats rounded to 4 digits).
        extra_files: {file name: text} written into the folder with the weights.
    """
    module.model_card_metrics = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}

    def write(tmp: Path) -> None:
        module.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    replace_folder_atomically(folder, write)


class BestHeads:
    """Keeps `output_dir/best` holding the heads of the best held-out evaluation offered so far (main process only).

    Args:
        output_dir: the run's folder.
        fresh_run: True when the run starts from step 0: a `best` folder left there is a previous run's and is
            removed. A resumed run keeps it and must beat its score (steps it re-runs score the same: exact resume).
        save: writes the folder (default `save_heads`; a distilled draft model: `distill.save_draft_model`).
    """

    def __init__(self, output_dir: str | os.PathLike, fresh_run: bool, save: Saver | None = None) -> None:
        self.folder = Path(output_dir) / BEST_DIR
        self.save = save or save_heads
        if fresh_run:
            shutil.rmtree(self.folder, ignore_errors=True)
        record = self.folder / BEST_FILE
        self.record: dict[str, Any] | None = json.loads(record.read_text()) if record.is_file() else None

    def evaluations_since_best(self, step: int, eval_steps: int) -> int:
        """How many periodic evaluations (every `eval_steps`) up to `step` came after the best one."""
        return (step - self.record["step"]) // eval_steps if self.record is not None else 0

    def offer(self, module: nn.Module, step: int, metrics: dict[str, Any]) -> bool:
        """Save `module` as the best heads when `metrics[BEST_METRIC]` beats the best so far; True when saved."""
        score = float(metrics[BEST_METRIC])
        if self.record is not None and score <= self.record[BEST_METRIC]:
            return False
        record = {"step": step, BEST_METRIC: score}
        self.save(module, self.folder, {**metrics, "step": step}, {BEST_FILE: json.dumps(record)})
        self.record = record
        return True
