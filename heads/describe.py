"""`specheads info HEADS [--target T]`: what a heads checkpoint is, and whether it fits a target.

For someone who found heads on the Hub (or in a run folder): the head type, the target they were built for, their
size, draft vocabulary and tree defaults, the metrics on their card, whether they carry a Medusa-2 adapter or the
transformers `custom_generate` entry; with a target, the same checks `load_heads(..., target=)` makes, reported
instead of raised. A draft model folder (a plain transformers causal LM, e.g. one `head.type=draft_model` distilled)
is described too: its shape, the target its card names, its metrics; with a target, whether it drafts for it (the
same tokenizer, or how many tokens the two vocabularies share); a model shipped with MTP layers is told to draft for
itself (`--mtp`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from specheads.heads.config import EAGLE3_NORM_FIELDS
from specheads.heads.loading import WEIGHTS_NAME, _resolve_folder, is_heads_config, load_heads

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
    kind = folder_kind(folder)
    if kind == "draft_model":
        return describe_draft_model(folder)
    if kind == "foreign":
        return describe_foreign_heads(folder)
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
    if getattr(config, "block_size", 0):  # DFlash: a block of positions drafted in one forward
        summary["block_drafting"] = {"block_size": config.block_size, "mask_token": config.block_mask_token,
                                     "feature_layers": list(config.feature_layers)}
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


def folder_kind(folder: Path) -> str:
    """"draft_model" for a plain transformers model folder (a `model_type`, no specheads `head_type`, no other
    project's heads layout), "foreign" for another project's heads (EAGLE, Medusa, speculators, DFlash, ...), else
    "heads" (`load_heads` then names anything wrong)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "heads"
    if not isinstance(config, dict) or is_heads_config(config):
        return "heads"
    from specheads.heads.interop import detect_format

    try:
        detect_format(folder)
    except ValueError:  # no heads layout: a model, or (without a model_type) nothing `load_heads` reads
        return "draft_model" if "model_type" in config else "heads"
    return "foreign"


def describe_foreign_heads(folder: Path) -> dict[str, Any]:
    """What another project's heads folder holds, read as `load_heads` converts it (no target needed): its format, the
    head type and fields it gives, its tensors' size, the target it records (if any) and how to use it."""
    from specheads.heads.interop import detect_format, format_module

    fmt = detect_format(folder)
    module = format_module(fmt)
    foreign = module.read(folder, False)  # safetensors only, as load_heads
    fields = {k: v for k, v in foreign.fields.items() if k != "draft_layer_config"}
    return {
        "folder": str(folder),
        "kind": "foreign",
        "format": fmt,
        "head_type": foreign.head_type or module.HEAD_TYPES[0],
        "target": foreign.target_hint or None,
        **fields,
        "parameters": sum(t.numel() for t in foreign.tensors.values()),
        "weights_mb": round(foreign.source.stat().st_size / 2**20, 2),
        "use": f"--heads {folder} (converted in memory; `specheads import {folder} --format {fmt} --target TARGET --out "
               "DIR` saves a specheads copy)",
    }


def card_base_model(folder: Path) -> str | None:
    """The `base_model` of the folder's model card front matter (a distilled draft's target), or None."""
    card = folder / "README.md"
    match = re.search(r"^---\n.*?^base_model:\s*(\S+)\s*$.*?^---", card.read_text(), re.DOTALL | re.MULTILINE) \
        if card.is_file() else None
    return match.group(1) if match else None


def describe_draft_model(folder: Path) -> dict[str, Any]:
    """A JSON-ready summary of a draft model folder, read from its config, weight headers and card (nothing loaded)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder).get_text_config()
    weights = sorted(folder.glob("*.safetensors"))
    parameters = 0
    for path in weights:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                parameters += math.prod(f.get_slice(name).get_shape())
    target = card_base_model(folder)
    from specheads.heads.mtp import declared_mtp_layers

    mtp_layers = declared_mtp_layers(config)  # a model shipped with MTP layers drafts for itself: --mtp
    mtp = {"mtp_layers": mtp_layers, "mtp_usage": f"specheads generate --target {folder} --mtp --prompt ..."} \
        if isinstance(mtp_layers, int) and mtp_layers > 0 else {}
    return {
        "folder": str(folder),
        "kind": "draft_model",
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "parameters": parameters,
        "weights_mb": round(sum(p.stat().st_size for p in weights) / 2**20, 2),
        "target": target,  # as its card names it (a distilled draft's); None: unknown
        "usage": f"specheads generate --target {target or 'TARGET'} --draft-model {folder} --prompt ...",
        "metrics": card_metrics(folder),
        **mtp,
    }


def check_draft_model_on_target(folder: str | os.PathLike, target: str) -> dict[str, Any]:
    """{"target", "compatible": bool, "vocabulary": "same" | "N shared of M" (when compatible), "reason" (when not)}:
    loads `target` and the draft model as `--draft-model` does."""
    from specheads import load_target
    from specheads.heads.draft_model import draft_model_heads

    model, tokenizer = load_target(target)
    try:
        heads = draft_model_heads(model, tokenizer, str(folder))
    except ValueError as err:
        return {"target": target, "compatible": False, "reason": str(err)}
    mapping = heads.vocab_mapping
    shared = "same" if mapping is None else f"{mapping.num_shared} shared of {len(tokenizer)}"
    return {"target": target, "compatible": True, "vocabulary": shared}


def check_on_target(summary: dict[str, Any], target: str) -> dict[str, Any]:
    """The check of `specheads info --target` for what `describe_heads` described: heads or a draft model."""
    check = check_draft_model_on_target if summary.get("kind") == "draft_model" else check_heads_on_target
    return check(summary["folder"], target)
