"""`specheads info HEADS [--target T]`: what a heads checkpoint is, and whether it fits a target.

For someone who found heads on the Hub (or in a run folder): the head type, the target they were built for, their
size, draft vocabulary and tree defaults, the metrics on their card, whether they carry a Medusa-2 adapter or the
transformers `custom_generate` entry; with a target, the same checks `load_heads(..., target=)` makes, reported
instead of raised.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from specheads.heads.config import EAGLE3_NORM_FIELDS
from specheads.heads.loading import WEIGHTS_NAME, _resolve_folder, load_heads

METRICS_BLOCK = re.compile(r"## Metrics[^\n]*\n\s*```json\s*(\{.*?\})\s*```", re.DOTALL)  # "## Metrics (...)" too


def card_metrics(folder: str | os.PathLike) -> dict[str, Any]:
    """The metrics block of the folder's specheads model card (README.md); {} when it has none."""
    card = Path(folder) / "README.md"
    match = METRICS_BLOCK.search(card.read_text()) if card.is_file() else None
    return json.loads(match.group(1)) if match else {}


def describe_heads(path_or_hub_id: str | os.PathLike) -> dict[str, Any]:
    """A JSON-ready summary of the heads checkpoint at `path_or_hub_id` (a folder or Hub id).

    Raises:
        FileNotFoundError / ValueError: not a loadable specheads checkpoint (as `load_heads`).
    """
    folder = _resolve_folder(path_or_hub_id, None, None, False)
    heads = load_heads(folder)
    config = heads.config
    summary: dict[str, Any] = {
        "folder": str(folder),
        "head_type": config.head_type,
        "target": config.target_name_or_path,
        "target_model_type": config.target_model_type,
        "hidden_size": config.hidden_size,
        "draft_hidden_size": config.draft_hidden_size,  # the heads' own layer: the target's width unless narrowed
        "vocab_size": config.vocab_size,
        "draft_vocab_size": heads.draft_vocab_size,
        "feature_layers": list(config.feature_layers),
        "parameters": sum(p.numel() for p in heads.parameters()),
        "weights_mb": round((folder / WEIGHTS_NAME).stat().st_size / 2**20, 2),
        "specheads_version": config.specheads_version,
    }
    if config.head_type == "medusa":
        summary.update(num_heads=config.num_heads, static_tree=config.static_tree)
    else:
        summary["draft_layers"] = config.num_layers  # the heads' decoder layers (several: EAGLE-3 only)
        summary["tree"] = {name: getattr(config, name) for name in
                           ("tree_depth", "tree_top_k", "tree_num_nodes", "tree_stop_prob", "tree_min_prob")}
    if getattr(config, "parallel_depth", 0):  # P-EAGLE: every depth in one head forward
        summary["parallel_drafting"] = {"depth": config.parallel_depth, "slot_token": config.parallel_slot_token}
    norms = [name for name in EAGLE3_NORM_FIELDS if getattr(config, name, False)]
    if norms:  # EAGLE-3.1's and other EAGLE-3 variants' norms
        summary["eagle3_norms"] = norms
    if config.cpu_tree:
        summary["cpu_tree"] = dict(config.cpu_tree)  # what replaces those on a CPU target
    summary["target_adapter"] = config.target_adapter or None  # Medusa-2: merged into the target when loading
    summary["custom_generate"] = has_custom_generate(path_or_hub_id, folder)
    summary["metrics"] = card_metrics(folder)
    return summary


def has_custom_generate(path_or_hub_id: str | os.PathLike, folder: Path) -> bool | None:
    """Whether the checkpoint holds transformers' `custom_generate/generate.py`; None when unknown (a Hub id whose
    repository cannot be asked: offline; its snapshot here holds no code files)."""
    if (folder / "custom_generate" / "generate.py").is_file():
        return True
    if Path(path_or_hub_id).expanduser().is_dir():
        return False
    from huggingface_hub import file_exists

    try:
        return file_exists(str(path_or_hub_id), "custom_generate/generate.py")
    except Exception:  # offline, or the Hub unreachable: many error types
        return None


def check_heads_on_target(path_or_hub_id: str | os.PathLike, target: str) -> dict[str, Any]:
    """{"target", "compatible": bool, "reason": the mismatch (when not)}: loads `target` (its Medusa-2 adapter
    merged first, as `SpeculativeLM.from_pretrained` does) and attaches the heads to it."""
    from specheads import load_target
    from specheads.heads.adapter import apply_target_adapter

    model, _ = load_target(target)
    try:
        load_heads(path_or_hub_id, target=apply_target_adapter(model, path_or_hub_id))
    except ValueError as err:
        return {"target": target, "compatible": False, "reason": str(err)}
    return {"target": target, "compatible": True}
