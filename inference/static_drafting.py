"""EAGLE drafting with fixed shapes on a static head cache: one CUDA graph per round on the GPU fast path.

`EagleDrafter` (drafting.py) is the reference: its head cache is a `DynamicCache` that grows and is cropped
every round, and each tree level builds masks of a new width, so every level is a dozen small kernel launches
plus Python. On a GPU that eager loop costs far more than the graphed tree verification it feeds. This drafter
computes the same trees with shapes that never change, so that the whole round (commit the accepted path,
draft `depth` levels, pick the best `num_nodes`, build the tree buffers) is captured once as a CUDA graph and
replayed:

- the head's keys / values live in a one-layer `StaticTreeCache` of fixed capacity: committed positions at
  slots [0, committed); this round's commit rows at [committed, committed + P); draft level d's k entries at
  committed + L + (d - 2) k + [0, k) (L = real commit rows). Stale slots are hidden by the masks, never cleared;
- the accepted path (L <= P = depth + 1 rows: at most `depth` drafted tokens and the bonus token) is padded to
  P rows; padding rows sit after the real ones, so no real row sees them, and later levels overwrite or hide
  their slots. L and committed are device scalars read inside the graph;
- every mask is (rows, capacity), computed on the device from those scalars;
- the tree buffers come from `build_tree_buffers(..., max_depth=depth)`: fixed passes, no host sync.

Outside the graph: the prompt's first positions (a prompt is longer than P) are committed eagerly, once per
sequence. Early stopping (`tree_stop_prob`) needs a host decision per level and pruning (`tree_min_prob`) varies
the tree's size, so such drafters stay eager.
On the CPU the same round runs eagerly; that is how it is tested against `EagleDrafter`.
"""

from __future__ import annotations

from typing import Any

import torch

from specheads.inference.cuda_graphs import try_capture
from specheads.inference.drafting import DraftPool, EagleDrafter
from specheads.inference.static_cache import StaticTreeCache
from specheads.inference.tree import TreeBuffers, build_tree_buffers


class StaticEagleDrafter:
    """The trees of an `EagleDrafter` (same heads, depth, top-k, node count), drafted with fixed shapes.

    Same interface as the drafters: `reset()` before a sequence, `propose(features, next_tokens)` per round.
    The returned tokens and tree tensors are static buffers that the next `propose` overwrites: consume them
    (verification and acceptance do) before proposing again.

    Args:
        drafter: the reference drafter whose trees to reproduce (its `stop_prob` must be 0).
        capacity: positions the sequence can reach (prompt + max_new_tokens at most); the head cache adds
            room for one round's commit rows and draft levels.
        use_graph: capture the round as a CUDA graph (default: when the heads are on CUDA).
    """

    def __init__(self, drafter: EagleDrafter, capacity: int, use_graph: bool | None = None) -> None:
        if drafter.stop_prob > 0:
            raise ValueError(
                f"tree_stop_prob={drafter.stop_prob} decides on the host at every level; fixed-shape drafting needs 0"
            )
        if drafter.min_prob > 0:
            raise ValueError(
                f"tree_min_prob={drafter.min_prob} gives trees of varying size; fixed-shape drafting needs 0"
            )
        self.source = drafter
        self.heads = drafter.heads
        self.depth, self.top_k, self.num_nodes = drafter.depth, drafter.top_k, drafter.num_nodes
        self.dtype, self.neg = drafter.dtype, drafter.neg
        device = next(self.heads.parameters()).device
        self.device = device
        self.commit_rows = self.depth + 1  # P
        self.draft_slots = (self.depth - 1) * self.top_k
        self.sequence_capacity = capacity
        self.cache = StaticTreeCache(None, capacity + self.commit_rows + self.draft_slots,
                                     num_layers=self.heads.config.num_layers)  # the heads' decoder layers
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        # Static inputs of a round (features allocated on first use: their width is the heads' input width).
        self.features: torch.Tensor | None = None  # (P, w) the path's true target features, padded
        self.tokens = torch.zeros(self.commit_rows, dtype=torch.long, device=device)  # (P,) the tokens after them
        self.count = torch.ones((), dtype=torch.long, device=device)  # L, real rows in `features`
        self.base = torch.zeros((), dtype=torch.long, device=device)  # committed head positions before the round
        self.key_index = torch.arange(self.cache.capacity, device=device)  # (C,) slot numbers
        self.row_index = torch.arange(self.commit_rows, device=device)  # (P,)
        self.committed = 0  # host copy of `base` after the round
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_outputs: Any = None
        self.capture_failed = False

    def reset(self) -> None:
        self.committed = 0

    # --- the round ---------------------------------------------------------------------------------------
    def _visible(self, visible: torch.Tensor) -> torch.Tensor:
        """Bool (rows, C) -> additive (1, 1, rows, C) mask of the drafter's dtype."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, self.neg)[None, None]

    def draft_round(self) -> tuple[torch.Tensor, ...]:
        """Commit the padded path and draft a whole tree; fixed shapes, no host sync (the body of the graph).

        Reads the static inputs (`features`, `tokens`, `count`, `base`); `propose` fills them, and
        `GraphedGreedyRound` (graphed_round.py) fills them on the device and records this body in its own graph.

        Returns (tree tokens (N+1,), parents (N+1,), depth (N+1,), ancestors (N+1, N+1), attention bias).
        """
        heads, k, device = self.heads, self.top_k, self.device
        source = self.source

        # 1. Commit rows: row i at position/slot base + i sees every slot up to its own (padding rows come last).
        positions = self.base + self.row_index  # (P,)
        self.cache.set_write_positions(positions)
        mask = self._visible(self.key_index[None, :] <= positions[:, None])
        predicted = heads(self.features[None], self.tokens[None], positions[None], mask, self.cache)[0]  # (P, h)
        last = predicted.index_select(0, (self.count - 1).view(1))[0]  # (h,) f^ at the root's position
        committed = self.base + self.count  # head positions with true features after this round

        # 2. Depth 1: the top-k children of the root.
        pool = DraftPool(*source.top_children(last), last)
        prefix_visible = self.key_index[None, :] < committed  # (1, C)

        # 3. Deeper levels, as EagleDrafter: the k frontier nodes at position committed + level - 2, written at
        #    slots committed + fed + [0, k); each sees the committed prefix and its fed ancestors.
        for level in range(2, self.depth + 1):
            fed, rows = pool.feed()
            visible = prefix_visible.expand(k, -1).clone()  # (k, C)
            visible.index_copy_(1, committed + torch.arange(fed + k, device=device), rows)
            self.cache.set_write_positions(committed + fed + torch.arange(k, device=device))
            level_positions = (committed + level - 2).expand(1, k)
            mask = self._visible(visible)
            out = heads(pool.frontier_features[None], pool.frontier_tokens[None], level_positions, mask, self.cache)[0]
            pool.expand(out, *source.top_children(out))

        # 4. Keep the best num_nodes of the pool (as EagleDrafter), then the tree buffers in fixed passes.
        root_token = self.tokens.index_select(0, (self.count - 1).view(1))
        tree_tokens, parents = pool.best_subtree(self.num_nodes, root_token)
        tree = build_tree_buffers(parents, dtype=self.dtype, check=False, max_depth=self.depth)
        return tree_tokens, tree.parents, tree.depth, tree.ancestors, tree.attention_bias

    def _run_round(self) -> tuple[torch.Tensor, ...]:
        if self.use_graph and self.graph is None and not self.capture_failed:
            # Warm-up rounds rewrite this round's commit slots with the same values and draft into slots the
            # masks hide: harmless.
            self.graph, self.graph_outputs = try_capture(self.draft_round, "EAGLE drafting round")
            self.capture_failed = self.graph is None
        if self.graph is not None:
            self.graph.replay()
            return self.graph_outputs
        return self.draft_round()

    # --- the drafter interface -------------------------------------------------------------------------------
    def _commit_eagerly(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Commit (m, w) features (a prompt's first positions) into the head cache, causally; eager."""
        m, start = features.shape[0], self.committed
        positions = torch.arange(start, start + m, device=self.device)
        self.cache.set_write_positions(positions)
        mask = self._visible(self.key_index[None, :] <= positions[:, None])
        self.heads(features[None], next_tokens[None], positions[None], mask, self.cache)
        self.committed += m

    @torch.no_grad()
    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        """Draft a tree after committing (L, w) true features and the (L,) tokens that followed them.

        Returns (tokens (N+1,), tree buffers), views of static buffers valid until the next `propose`.
        """
        length = features.shape[0]
        end = self.committed + length
        if end > self.sequence_capacity:  # then commit rows and draft levels fit the cache too
            raise ValueError(
                f"the EAGLE head cache of {self.cache.capacity} slots cannot hold {end} positions: the sequence grew "
                f"past the {self.sequence_capacity} positions it was sized for"
            )
        extra = max(0, length - self.commit_rows)
        if extra:
            self._commit_eagerly(features[:extra], next_tokens[:extra])
            features, next_tokens, length = features[extra:], next_tokens[extra:], length - extra
        if self.features is None:
            self.features = torch.zeros(
                self.commit_rows, features.shape[-1], dtype=features.dtype, device=self.device
            )
        self.features[:length] = features
        self.tokens[:length] = next_tokens
        self.count.fill_(length)
        self.base.fill_(self.committed)
        tokens, parents, depth, ancestors, attention_bias = self._run_round()
        self.committed += length
        return tokens, TreeBuffers(parents, depth, ancestors, attention_bias)
