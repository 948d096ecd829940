"""What `SpeculativeLM.tree_description` reports: the drafter's tree as a dict, for logs and benchmark JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specheads.heads.mtp import MtpHeads
from specheads.inference.dflash_drafting import DFlashDrafter
from specheads.inference.draft_model_drafting import DraftModelDrafter
from specheads.inference.drafting import EagleDrafter, MedusaDrafter
from specheads.inference.lookup import LookupDrafter
from specheads.inference.parallel_drafting import ParallelDrafter

if TYPE_CHECKING:
    from specheads.inference.generate import SpeculativeLM


def describe_tree(lm: SpeculativeLM) -> dict[str, Any]:
    """`lm`'s current tree: {"kind": "static" | "dynamic" | "custom", its shape, ...}, with `lookup_tokens` (the
    prompt-lookup branch, 0 = none) and its settings, and `chain: True` for a hybrid target verifying one chain a
    round (inference/chain_verify.py)."""
    drafter, lookup = lm.drafter, {"lookup_tokens": 0}
    if isinstance(drafter, LookupDrafter):
        lookup = {"lookup_tokens": drafter.num_tokens, "lookup_max_tokens": drafter.max_tokens,
                  "lookup_max_ngram": drafter.index.max_ngram}
        if drafter.corpus is not None:
            lookup.update(corpus_tokens=drafter.corpus_tokens, corpus_size=drafter.corpus.num_tokens,
                          corpus_online_tokens=drafter.corpus.online_tokens, corpus_min_gain=drafter.corpus.min_gain)
        drafter = drafter.drafter
    lookup |= {"chain": True} if lm.verifies_chains else {}
    if isinstance(drafter, MedusaDrafter):
        return {"kind": "static", "name": drafter.tree.name, "nodes": drafter.tree.parents.shape[0] - 1,
                "depth": drafter.tree.max_depth, **lookup}
    if not isinstance(drafter, EagleDrafter):  # a caller's own (`SpeculativeLM.use_drafter`)
        return {"kind": "custom", "drafter": type(drafter).__name__, **lookup}
    extra = {"parallel": True} if isinstance(drafter, ParallelDrafter) else {}  # P-EAGLE: one forward a round
    extra |= {"block": True} if isinstance(drafter, DFlashDrafter) else {}  # DFlash: one block a round
    extra |= {"mtp": True} if isinstance(lm.heads, MtpHeads) else {}  # the target's own MTP layer drafts
    if isinstance(drafter, DraftModelDrafter):  # and, for another tokenizer, the tokens it can draft
        mapping = lm.heads.vocab_mapping
        extra = {"draft_model": lm.heads.config.draft_model_name_or_path,
                 **({"shared_vocab": mapping.num_shared} if mapping is not None else {})}
    return {"kind": "dynamic", "depth": drafter.depth, "top_k": drafter.top_k, "nodes": drafter.num_nodes,
            "stop_prob": drafter.stop_prob, "min_prob": drafter.min_prob, **extra, **lookup}
