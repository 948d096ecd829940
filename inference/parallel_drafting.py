"""P-EAGLE parallel drafting: EAGLE-3 heads with `parallel_depth` draft every depth of a tree in ONE head forward.

An autoregressive EAGLE drafter runs the head once per depth (each level reads the features the level above
predicted). Parallel heads (`HeadsConfig.parallel_depth` = K, trained so: training/ttt.py) append K-1 "parallel
slots" after the committed positions instead, slot s reading the root's features plus a learned offset of its depth
(f_p + mask_hidden[s-1]) and a fixed token (`parallel_slot_token`); it sits at position p+s (p the root's position),
sees the committed prefix and the slots before it, and scores the token at depth s+1. One forward therefore returns
a distribution per depth:

    committed entries ... (f_p, root) -> depth 1    slot 1 (f_p + m_0, ptd) -> depth 2  ...  slot K-1 -> depth K

Those distributions do not depend on the tokens drafted above them (a slot never sees them), so a depth's top-k
are every parent's children, and a path's score is the sum of its depths' log-probabilities: the tree is the best
`num_nodes` of those paths (`DraftPool`, as `EagleDrafter`, so `stop_prob`, `min_prob`, `node_probs` and constrained
drafting work alike). On a CPU, where each head forward costs fixed overhead, one forward instead of K is what makes
deep trees cheap to draft (vLLM ships the same scheme as P-EAGLE, arXiv 2602.01469).
"""

from __future__ import annotations

from typing import Any

import torch

from specheads.heads.eagle3 import Eagle3Heads
from specheads.inference.drafting import DraftPool, EagleDrafter
from specheads.inference.kv_cache import crop_cache
from specheads.inference.tree import TreeBuffers, build_tree_buffers


class ParallelDrafter(EagleDrafter):
    """Dynamic trees of parallel-drafting EAGLE-3 heads: one head forward per round (see the module docstring).

    Args are `EagleDrafter`'s (whose `fork` makes another of this class); `depth` may not exceed the heads'
    `parallel_depth`.
    """

    def __init__(self, heads: Eagle3Heads, depth: int, *args: Any, **kwargs: Any) -> None:
        parallel = getattr(heads.config, "parallel_depth", 0)
        if not parallel:
            raise ValueError("ParallelDrafter needs EAGLE-3 heads trained for parallel drafting (parallel_depth >= 2); "
                             "these draft autoregressively: use EagleDrafter")
        if depth > parallel:
            raise ValueError(f"tree_depth={depth} exceeds the heads' parallel_depth={parallel}: they draft at most "
                             f"{parallel} depths; use tree_depth <= {parallel}")
        super().__init__(heads, depth, *args, **kwargs)
        device = heads.mask_hidden.device
        self.slot_depths = torch.arange(2, depth + 1, device=device)  # (S,): the depth each slot drafts
        self.slot_tokens = torch.full((depth - 1,), heads.config.parallel_slot_token, device=device)  # (S,)

    @torch.no_grad()
    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        heads, device = self.heads, features.device
        crop_cache(self.cache, self.committed)  # drops last round's parallel slots
        start, length, slots = self.committed, features.shape[0], self.depth - 1

        # One forward: the L new committed positions, then the parallel slots, causal over the cache and all of them.
        total = length + slots
        tokens = torch.cat([next_tokens, self.slot_tokens])  # (L+S,)
        mask = self.causal_mask(start, total, device)
        positions = torch.arange(start, start + total, device=device)[None]
        anchors = features[-1:].expand(slots, -1)[None]  # (1, S, n*h): every slot drafts for the root at the last one
        out = heads(features[None], tokens[None], positions, mask, self.cache, parallel_slots=(anchors, self.slot_depths))[0]
        self.committed = start + length
        by_depth = out[length - 1 :]  # (D, h) of the (L+S, h): row d scores depth d+1 (row 0: the root's own position)
        return tree_of_depths(self, by_depth, next_tokens)


def tree_of_depths(drafter: EagleDrafter, by_depth: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
    """The tree of a drafter that scores every depth at once: `by_depth` (D, h) holds the heads' output whose logits
    rank depth d+1 at row d, for any parent. Builds `drafter`'s `DraftPool` from them (top-k per depth, constrained
    per path when `allowed_after` is set, early stop, best `num_nodes` kept) and returns (tree tokens, buffers) with
    the root `next_tokens[-1]` first. Used by P-EAGLE's and DFlash's drafters."""
    k = drafter.top_k
    # 1. Depth 1: the top-k children of the root. Unconstrained, every depth's top-k at once.
    constrained = drafter.allowed_after is not None
    allowed = drafter.allowed_after(next_tokens.new_zeros(1, 0))[0] if constrained else None
    if constrained:
        scores, children = drafter.top_children(by_depth[0], allowed)  # (k,)
    else:
        all_scores, all_children = drafter.top_children(by_depth)  # (D, k) each
        scores, children = all_scores[0], all_children[0]
    pool = DraftPool(scores, children, by_depth[0])

    # 2. Deeper levels: each frontier node's children are its depth's top-k (the same for every parent unless a
    #    constraint filters them per path); stop early as EagleDrafter does.
    for level in range(2, drafter.depth + 1):
        if drafter.stop_prob > 0 and float(pool.frontier_scores[0]) < drafter.log_stop:
            break
        row = by_depth[level - 1].expand(k, -1)  # (k, h)
        if constrained:
            level_scores, level_children = drafter.top_children(row, drafter.allowed_after(pool.frontier_paths()))
        else:
            level_scores = all_scores[level - 1].expand(k, k)
            level_children = all_children[level - 1].expand(k, k)
        pool.expand(row, level_scores, level_children)

    # 3. Keep the best num_nodes of the pool (those likely enough, with min_prob).
    drafter.last_pool = pool
    tree_tokens, parents = pool.best_subtree(drafter.num_nodes, next_tokens[-1:], drafter.log_min)
    return tree_tokens, build_tree_buffers(parents, dtype=drafter.dtype, check=False)  # valid by construction
