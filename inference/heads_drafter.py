"""`heads_drafter`: the drafter a `SpeculativeLM` drafts with for its heads and chosen tree (`configure_tree`).

Medusa heads draft a static tree (the checkpoint's `static_tree` by default, cut to the heads there are); every other
head type drafts dynamic trees of a shape (depth, top-k, nodes, stop / min probability), each field left out taken
from the checkpoint's default for the target's device (`HeadsConfig.tree_defaults`: `cpu_tree` in place on a CPU). A
hybrid target verifies chains, so its trees become chains (inference/chain_verify.py).
"""

from __future__ import annotations

import torch

from specheads.heads.base import DraftHeads
from specheads.heads.dflash import DFlashHeads
from specheads.heads.draft_model import DraftModelHeads
from specheads.heads.eagle import EagleHeads
from specheads.heads.eagle3 import Eagle3Heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.mtp import MtpHeads
from specheads.inference.chain_verify import chain_shape, chain_static_tree
from specheads.inference.dflash_drafting import DFlashDrafter
from specheads.inference.draft_model_drafting import DraftModelDrafter
from specheads.inference.drafting import Drafter, EagleDrafter, MedusaDrafter
from specheads.inference.parallel_drafting import ParallelDrafter
from specheads.inference.tree import StaticTree, load_static_tree, truncate_static_tree


def heads_drafter(
    heads: DraftHeads,
    device_type: str,
    dtype: torch.dtype,
    chains: bool,
    tree: StaticTree | str | None = None,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    tree_num_nodes: int | None = None,
    tree_stop_prob: float | None = None,
    tree_min_prob: float | None = None,
) -> Drafter:
    """The drafter of `heads` for the target's `device_type` and `dtype`; `chains`: the target verifies chains (a
    hybrid). The tree arguments are `SpeculativeLM.configure_tree`'s (None: the checkpoint's default)."""
    defaults = heads.config.tree_defaults(device_type)  # `cpu_tree` in place on a CPU target
    if isinstance(heads, MedusaHeads):
        static = tree if isinstance(tree, StaticTree) else load_static_tree(tree or defaults["static_tree"])
        if tree is None and static.max_depth > heads.config.num_heads:
            static = truncate_static_tree(static, heads.config.num_heads)  # the default tree, cut to the heads we have
        static = chain_static_tree(static, tree is None) if chains else static
        return MedusaDrafter(heads, static, dtype=dtype)
    if isinstance(heads, (EagleHeads, Eagle3Heads, DraftModelHeads, MtpHeads, DFlashHeads)):
        if tree is not None:
            raise ValueError(f"{heads.config.head_type} drafting makes dynamic trees: use tree_depth / tree_top_k / "
                             "tree_num_nodes (/ tree_stop_prob / tree_min_prob), not tree")
        parallel = isinstance(heads, Eagle3Heads) and heads.config.parallel_depth  # P-EAGLE: one forward a round
        drafter_class = (DraftModelDrafter if isinstance(heads, DraftModelHeads) else ParallelDrafter if parallel
                         else DFlashDrafter if isinstance(heads, DFlashHeads) else EagleDrafter)
        given = dict(depth=tree_depth, top_k=tree_top_k, num_nodes=tree_num_nodes, stop_prob=tree_stop_prob,
                     min_prob=tree_min_prob)  # None: the default's `tree_<name>`
        shape = {name: defaults[f"tree_{name}"] if value is None else value for name, value in given.items()}
        shape = chain_shape(shape, tree_top_k) if chains else shape
        return drafter_class(heads, **shape, dtype=dtype)
    raise TypeError(f"no drafter for head type {heads.config.head_type!r}")
