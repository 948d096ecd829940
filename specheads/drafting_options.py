"""The command line's choice of what drafts: trained heads, a draft model, the target's own first layers, or the
target's own MTP layer."""

from __future__ import annotations

import argparse
from typing import Any

from specheads.heads.config import MTP_HEAD_TYPE
from specheads.heads.draft_model import EARLY_EXIT_PREFIX, early_exit_layers_of

DRAFT_PREFIX = "draft:"  # a draft model in a comma list of heads (scripts/tree_sweep.py --heads)


def add_drafting_options(p: argparse.ArgumentParser) -> None:
    """`--heads` | `--draft-model` | `--early-exit-layers` | `--mtp`: exactly one (`SpeculativeLM.from_pretrained`'s
    four)."""
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--heads", help="heads checkpoint folder or Hub id")
    group.add_argument("--draft-model", default=None, metavar="MODEL",
                       help="draft with a small causal LM (path, Hub id or alias; no training), best one sharing the "
                       "target's tokenizer (another one drafts the tokens both share): it drafts the same dynamic "
                       "trees as EAGLE heads (--tree depth,top_k,nodes)")
    group.add_argument("--early-exit-layers", type=int, default=None, metavar="N",
                       help="self-speculation: the target's own first N layers (+ its norm and lm_head) draft")
    group.add_argument("--mtp", action="store_true", default=None,
                       help="the target's own multi-token-prediction layer drafts (DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7 / "
                       "4.7-Flash, Qwen3-Next, Qwen3.5 / 3.6, ...: models shipped with one; no training), the same dynamic trees as EAGLE "
                       "heads (a chain on hybrid targets)")


def drafting_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`SpeculativeLM.from_pretrained` keywords for the drafting option given (`heads=`, `draft_model=`,
    `early_exit_layers=` or `mtp=True`)."""
    chosen = {name: getattr(args, name, None) for name in ("heads", "draft_model", "early_exit_layers", "mtp")}
    return {name: value for name, value in chosen.items() if value is not None}


def drafting_name(args: argparse.Namespace) -> str:
    """What drafts, for logs and reports: the heads' or draft model's name, 'early-exit:N' or 'mtp'."""
    if getattr(args, "early_exit_layers", None) is not None:
        return f"{EARLY_EXIT_PREFIX}{args.early_exit_layers}"
    if getattr(args, "mtp", None):
        return MTP_HEAD_TYPE
    return str(getattr(args, "heads", None) or args.draft_model)


def parse_drafting_source(item: str) -> dict[str, Any]:
    """`SpeculativeLM.from_pretrained` keywords for one drafting string (scripts' comma lists): 'draft:MODEL',
    'early-exit:N', 'mtp' (as `drafting_name` writes them), or a heads folder / Hub id."""
    if item.startswith(DRAFT_PREFIX):
        return {"draft_model": item.removeprefix(DRAFT_PREFIX)}
    if item == MTP_HEAD_TYPE:
        return {"mtp": True}
    layers = early_exit_layers_of(item)
    return {"heads": item} if layers is None else {"early_exit_layers": layers}


def drafting_heads(item: str, target: Any, tokenizer: Any) -> Any:
    """What drafts for `target` for one drafting string (`parse_drafting_source`): loaded heads (on the target's
    device and dtype, eval mode), or a draft model or the target's MTP layer wrapped as heads."""
    from specheads.heads.draft_model import draft_model_heads
    from specheads.heads.loading import load_heads
    from specheads.heads.mtp import MtpHeads

    source = parse_drafting_source(item)
    if "mtp" in source:
        return MtpHeads.from_target(target)
    if "heads" in source:
        return load_heads(source["heads"], target=target).to(device=target.device, dtype=target.dtype).eval()
    return draft_model_heads(target, tokenizer, **source)
