"""Drafting: heads propose a token tree from the target's features.

A drafter has two methods (the proposer interface of transformers' candidate generators):
`reset()` before a new sequence, and `propose(features, next_tokens)`, which receives the target's
features at the positions committed since the last call and the token that followed each (the last one
is the new root, already chosen by the target), and returns the tree's tokens and buffers.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from specheads.heads.eagle import EagleHeads
from specheads.heads.eagle3 import Eagle3Heads
from specheads.heads.medusa import MedusaHeads
from specheads.inference.kv_cache import crop_cache, tree_cache
from specheads.inference.tree import StaticTree, TreeBuffers, build_tree_buffers

if TYPE_CHECKING:
    from specheads.inference.sequence_processors import SequenceContext


class Drafter(Protocol):
    """The proposer interface. Optionally, `fork()` returns an independent drafter for another row of a
    batch (sharing the heads); drafters without it make batches run row by row. Optionally, `begin(first_token)`
    receives the (1,) first token of each new sequence after `reset()` (no feature precedes it, so `propose` never
    sees it; a draft model reads it: `start_sequence`)."""

    def reset(self) -> None: ...

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]: ...


class MedusaDrafter:
    """Medusa heads fill a static tree in one shot from the last committed feature.

    `allowed_after` (set by `SpeculativeLM.generate` while a call's processors may ban tokens; see `EagleDrafter`):
    then each node's token is the choice-th likeliest of its head among the tokens allowed after its parent's path
    (one call per depth, for that depth's parents).
    """

    def __init__(self, heads: MedusaHeads, tree: StaticTree, dtype: torch.dtype) -> None:
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(
                f"static tree {tree.name!r} has depth {tree.max_depth} but the Medusa checkpoint has only "
                f"{heads.config.num_heads} heads"
            )
        if tree.max_choice > heads.config.vocab_size:
            raise ValueError(f"static tree {tree.name!r} asks for top-{tree.max_choice} of a {heads.config.vocab_size} vocabulary")
        self.heads = heads
        self.tree = tree
        device = next(heads.parameters()).device
        self.buffers = build_tree_buffers(tree.parents.to(device), dtype=dtype)  # built once: the shape is fixed
        self.head_index = (tree.depth[1:] - 1).to(device)  # (N-1,) head drafting each non-root node
        self.choice = tree.choices[1:].to(device)  # (N-1,) rank of its token in that head's distribution
        self.allowed_after: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reset(self) -> None:
        pass

    def fork(self) -> MedusaDrafter:
        return copy.copy(self)  # no state but `allowed_after`, which is per row: share the heads and buffers

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        logits = self.heads(features[-1:][None])[:, 0, 0]  # (K, V): head k's logits for depth k+1
        if self.allowed_after is not None:
            return self._propose_allowed(logits, next_tokens[-1:]), self.buffers
        top = torch.topk(logits, self.tree.max_choice, dim=-1).indices  # (K, C)
        tokens = torch.cat([next_tokens[-1:], top[self.head_index, self.choice]])
        return tokens, self.buffers

    def _propose_allowed(self, logits: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """The tree's (N,) tokens, each node's the `choice`-th likeliest of its head among the tokens allowed after
        its parent's path (all of the head's when none is); depth by depth, since paths need the depths above."""
        buffers, max_choice = self.buffers, self.tree.max_choice
        tokens = torch.zeros(buffers.num_nodes, dtype=torch.long, device=logits.device)
        tokens[0] = root[0]
        choice = torch.cat([self.choice.new_zeros(1), self.choice])  # (N,) the root's is unused
        for depth in range(1, self.tree.max_depth + 1):
            nodes = (buffers.depth == depth).nonzero().flatten()
            parents, of_parent = torch.unique(buffers.parents[nodes], return_inverse=True)
            # each parent's ancestors, root first: depth of them; its path below the root is the last depth - 1
            ancestors = buffers.ancestors[parents].nonzero()[:, 1].view(parents.shape[0], depth)
            allowed = self.allowed_after(tokens[ancestors[:, 1:]])  # (P, V)
            keep = allowed | ~allowed.any(dim=-1, keepdim=True)
            head = logits[depth - 1].expand(parents.shape[0], -1).masked_fill(~keep, -math.inf)
            ranked = torch.topk(head, max_choice, dim=-1).indices  # (P, C)
            tokens[nodes] = ranked[of_parent, choice[nodes]]
        return tokens


class EagleDrafter:
    """EAGLE-2 dynamic trees: expand the best nodes depth by depth, then keep the globally best N.

    The head keeps its own KV cache across rounds. Each `propose` first crops the cache back to the
    committed positions (dropping last round's draft nodes), feeds the newly committed positions with the
    target's true features, then drafts `depth` levels: at each level the `top_k` frontier nodes (best by
    cumulative log-probability) are fed in one head forward under a tree mask, each proposing `top_k`
    children. Finally the best `num_nodes` nodes of the whole pool are kept (a node's score never exceeds
    its parent's, so the kept set is a tree). With `min_prob`, nodes whose path probability under the head is below
    it are dropped too (the best node is always kept): a tree as large as the heads' confidence, for devices where
    each verified node costs time (CPUs).

    EAGLE-3 heads (`Eagle3Heads`) go through the same loop: their first forward fuses the target's 3-layer
    features, deeper levels read their own outputs, and they score a reduced draft vocabulary whose ids are
    mapped to target ids (`d2t`) before they enter the tree or the next head forward.

    `allowed_after` (set by `SpeculativeLM.generate` while a call's logits processors may ban tokens: a grammar, a
    JSON schema, bad words): a function from the (n, d) token paths below the root to the (n, V) bool tokens the
    processors allow after each. Each level then drafts among the allowed tokens only (renormalised), so drafts obey
    the constraint and its forced tokens (JSON punctuation and keys) are drafted with certainty. It changes the
    proposals only: verification decides, and the output is the target's either way.
    """

    def __init__(
        self,
        heads: EagleHeads | Eagle3Heads,
        depth: int,
        top_k: int,
        num_nodes: int,
        dtype: torch.dtype,
        stop_prob: float = 0.0,
        min_prob: float = 0.0,
    ) -> None:
        for name, value in (("tree_depth", depth), ("tree_top_k", top_k), ("tree_num_nodes", num_nodes)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        for name, value in (("tree_stop_prob", stop_prob), ("tree_min_prob", min_prob)):
            if not 0 <= value < 1:
                raise ValueError(f"{name}={value} must be in [0, 1)")
        if top_k > heads.draft_vocab_size:
            raise ValueError(f"tree_top_k={top_k} exceeds the heads' draft vocabulary of {heads.draft_vocab_size}")
        self.heads = heads
        self.depth, self.top_k, self.num_nodes = depth, top_k, num_nodes
        self.stop_prob = stop_prob
        self.log_stop = math.log(stop_prob) if stop_prob > 0 else -math.inf
        self.min_prob = min_prob
        self.log_min = math.log(min_prob) if min_prob > 0 else None
        self.dtype = dtype
        self.neg = torch.finfo(dtype).min
        self.cache = tree_cache()
        self.committed = 0  # head positions with true target features in the cache
        self.allowed_after: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._draft_targets: torch.Tensor | None = None  # (V_draft,) target id of each draft id, for the filter
        self.last_pool: DraftPool | None = None  # the last `propose`'s pool, for `node_probs`

    def reset(self) -> None:
        self.cache = tree_cache()
        self.committed = 0
        self.last_pool = None

    def fork(self) -> EagleDrafter:
        """A drafter with the same heads and tree shape and its own (empty) draft cache."""
        return type(self)(self.heads, self.depth, self.top_k, self.num_nodes, self.dtype, self.stop_prob, self.min_prob)

    def top_children(
        self, predicted: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `top_k` likeliest next tokens after predicted features (..., h).

        Returns (log-probs, target ids), each (..., k); draft ids of a reduced draft vocabulary (EAGLE-3, or EAGLE
        with `eagle_draft_vocab_size`) are mapped to target ids through d2t. With `allowed` ((..., V) bool over
        target ids) only those are drafted, renormalised; a row allowing none of the draft vocabulary stays as it
        is (verification rejects what the constraint bans).
        """
        logits = self.heads.draft_logits(predicted).float()  # (..., V_draft)
        if allowed is not None:
            if self._draft_targets is None:
                draft_ids = torch.arange(self.heads.draft_vocab_size, device=logits.device)
                self._draft_targets = self.heads.draft_to_target_ids(draft_ids)
            keep = allowed[..., self._draft_targets]  # (..., V_draft)
            keep |= ~keep.any(dim=-1, keepdim=True)
            logits = logits.masked_fill(~keep, -math.inf)
        log_probs = torch.log_softmax(logits, dim=-1)
        scores, ids = torch.topk(log_probs, self.top_k, dim=-1)
        return scores, self.heads.draft_to_target_ids(ids)

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Feed the L newly committed positions into the head's cache (position p reads (f_p, x_{p+1}); causal over
        the cache and the chain). Returns f^ at the root's position (h,): its logits rank the depth-1 tokens."""
        crop_cache(self.cache, self.committed)  # drops last round's draft entries
        start, length = self.committed, features.shape[0]
        mask = self.causal_mask(start, length, features.device)
        positions = torch.arange(start, start + length, device=features.device)[None]
        predicted = self.heads(features[None], next_tokens[None], positions, mask, self.cache)[0]  # (L, h)
        self.committed = start + length
        return predicted[-1]

    def causal_mask(self, start: int, length: int, device: torch.device) -> torch.Tensor:
        """(1, 1, length, start + length) additive mask: `length` new entries after `start` cached ones, causal."""
        mask = torch.zeros(1, 1, length, start + length, dtype=self.dtype, device=device)
        mask[0, 0, :, start:] = torch.full((length, length), self.neg, dtype=self.dtype, device=device).triu(1)
        return mask

    def feed_frontier(self, pool: DraftPool, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One head forward over the pool's k frontier nodes (each reading its parent's predicted feature and its own
        token) at (1, k) `positions` under `mask`; returns their predicted features (k, h)."""
        return self.heads(pool.frontier_features[None], pool.frontier_tokens[None], positions, mask, self.cache)[0]

    @torch.no_grad()
    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        k, device = self.top_k, next_tokens.device
        # 1. Commit the new positions.
        last = self.commit(features, next_tokens)

        # 2. Depth 1: the top-k children of the root.
        allowed = None if self.allowed_after is None else self.allowed_after(next_tokens.new_zeros(1, 0))[0]
        scores, tokens = self.top_children(last, allowed)  # (k,)
        pool = DraftPool(scores, tokens, last)

        # 3. Deeper levels: feed the frontier (k nodes) at position committed + d - 2, expand, rerank.
        #    Stop early when even the best frontier path is unlikely: deeper drafts would be wasted work.
        for level in range(2, self.depth + 1):
            if self.stop_prob > 0 and float(pool.frontier_scores[0]) < self.log_stop:
                break
            fed, rows = pool.feed()
            mask = torch.zeros(1, 1, k, self.committed + fed + k, dtype=self.dtype, device=device)
            mask[0, 0, :, self.committed :].masked_fill_(~rows, self.neg)
            positions = torch.full((1, k), self.committed + level - 2, device=device)
            out = self.feed_frontier(pool, positions, mask)  # (k, h)
            allowed = None if self.allowed_after is None else self.allowed_after(pool.frontier_paths())  # (k, V)
            pool.expand(out, *self.top_children(out, allowed))

        # 4. Keep the best num_nodes of the pool (those likely enough, with min_prob).
        self.last_pool = pool
        tree_tokens, parents = pool.best_subtree(self.num_nodes, next_tokens[-1:], self.log_min)
        return tree_tokens, build_tree_buffers(parents, dtype=self.dtype, check=False)  # valid by construction

    def node_probs(self) -> list[float]:
        """The last proposal's pool: each drafted node's path probability under the heads, best first (only those
        `min_prob` keeps), whatever `num_nodes` kept; the heads' own prediction of how often each is accepted
        (`round_budget.AutoRoundBudget` sums them). One host sync."""
        if self.last_pool is None:
            return []
        scores = torch.sort(torch.cat(self.last_pool.scores), descending=True).values
        if self.log_min is not None:  # as `best_subtree`: the best node always
            scores = scores[: max(1, int((scores >= self.log_min).sum()))]
        return scores.exp().tolist()


def start_sequence(drafter: Drafter, prompt: torch.Tensor) -> None:
    """Reset `drafter` for a new sequence with the (n,) `prompt`; a drafter with `begin` (itself, or the one prompt
    lookup wraps) is also handed the prompt's first token."""
    drafter.reset()
    begin = getattr(getattr(drafter, "drafter", drafter), "begin", None)
    if begin is not None:
        begin(prompt[:1])


def eagle_drafter_in(drafter: Drafter) -> EagleDrafter | None:
    """The EAGLE drafter `drafter` is or wraps (prompt lookup's `LookupDrafter`), else None."""
    inner = getattr(drafter, "drafter", drafter)
    return inner if isinstance(inner, EagleDrafter) else None


def constrain_drafts(drafter: Drafter, context: SequenceContext | None, vocab_size: int) -> None:
    """Let the heads' drafter inside `drafter` (itself, or the one a prompt-lookup drafter wraps) draft among the
    tokens `context`'s processors allow, when they can ban any; clear it with context=None. Other drafters (the fast
    path's static one) draft as they are."""
    inner = getattr(drafter, "drafter", drafter)
    if isinstance(inner, (EagleDrafter, MedusaDrafter)):
        constrained = context is not None and context.may_ban
        inner.allowed_after = (lambda paths: context.allowed_after(paths, vocab_size)) if constrained else None


class DraftPool:
    """The drafted nodes of one EAGLE round and the frontier fed at the next level (both EAGLE drafters use it).

    Node i of the pool has a token, a cumulative log-probability and its parent's pool index (-1 = the root),
    kept per level in pool order (parents before children). The frontier is the best `k` nodes of the last
    level: the head is fed them next, each reading the feature its parent predicted. Fed entries (the head's
    cache beyond the committed positions) follow pool levels; `fed_ancestors` says which of them each one sees.
    Fixed shapes throughout and no host sync, so a CUDA graph can capture it.

    Args:
        scores: (k,) log-probabilities of the root's top-k children; tokens: (k,) their target ids;
        root_feature: (h,) the predicted feature at the root's position (what depth-1 nodes read).
    """

    def __init__(self, scores: torch.Tensor, tokens: torch.Tensor, root_feature: torch.Tensor) -> None:
        k, device = tokens.shape[0], tokens.device
        self.k = k
        self.tokens, self.scores = [tokens], [scores]
        self.parents = [torch.full((k,), -1, device=device)]
        self.size = k
        self.frontier = torch.arange(k, device=device)  # pool indices of the nodes fed next
        self.frontier_tokens, self.frontier_scores = tokens, scores
        self.frontier_features = root_feature.expand(k, -1)  # (k, h)
        self.fed_ancestors = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (F, F) over fed entries
        self.parent_fed = torch.full((k,), -1, device=device)  # fed-entry index of each frontier node's parent

    def frontier_paths(self) -> torch.Tensor:
        """(k, d) the frontier nodes' tokens from depth 1 down to themselves (d = their depth; one host sync)."""
        tokens, parents = torch.cat(self.tokens), torch.cat(self.parents)
        node, path = self.frontier, []
        while True:
            path.append(tokens[node])
            node = parents[node]
            if bool((node < 0).all()):  # every frontier node has the same depth: they reach the root together
                return torch.stack(path[::-1], dim=1)

    def feed(self) -> tuple[int, torch.Tensor]:
        """Append the frontier to the fed entries. Returns (F = entries fed before, rows (k, F + k) bool: what
        each frontier node sees among the fed entries, i.e. its parent's ancestors and itself)."""
        fed, k, device = self.fed_ancestors.shape[0], self.k, self.parent_fed.device
        rows = torch.zeros(k, fed + k, dtype=torch.bool, device=device)
        if fed:
            parent_rows = self.fed_ancestors[self.parent_fed.clamp(min=0)]
            rows[:, :fed] = torch.where(self.parent_fed[:, None] >= 0, parent_rows, False)
        rows[:, fed:] = torch.eye(k, dtype=torch.bool, device=device)
        widened = torch.cat([self.fed_ancestors, torch.zeros(fed, k, dtype=torch.bool, device=device)], 1)
        self.fed_ancestors = torch.cat([widened, rows], 0)
        return fed, rows

    def expand(self, out: torch.Tensor, child_scores: torch.Tensor, child_tokens: torch.Tensor) -> None:
        """Add the k x k children of the fed frontier and pick the next frontier (the best k of them).

        Args:
            out: (k, h) the head's predicted features for the frontier just fed.
            child_scores, child_tokens: (k, k) each frontier node's top-k children (log-probs, target ids).
        """
        k = self.k
        fed = self.fed_ancestors.shape[0] - k  # the frontier's first fed-entry index
        child_scores = (child_scores + self.frontier_scores[:, None]).flatten()  # cumulative, (k*k,)
        child_tokens = child_tokens.flatten()
        self.tokens.append(child_tokens)
        self.scores.append(child_scores)
        self.parents.append(self.frontier[:, None].expand(k, k).reshape(-1))
        self.frontier_scores, best = torch.topk(child_scores, k)
        self.frontier_tokens = child_tokens[best]
        self.frontier = self.size + best
        self.frontier_features = out[best // k]
        self.parent_fed = fed + best // k
        self.size += k * k

    def best_subtree(
        self, num_nodes: int, root_token: torch.Tensor, min_log_prob: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `num_nodes` best-scored nodes as a tree under the root: (tokens, parents), each (M + 1,), the root
        first (`root_token`, (1,)), then the kept nodes in pool order. M = num_nodes, or with `min_log_prob` the
        number of those scoring at least it (at least 1; one host sync)."""
        all_scores, all_tokens = torch.cat(self.scores), torch.cat(self.tokens)
        all_parents, device = torch.cat(self.parents), all_tokens.device
        ranked = torch.sort(all_scores, descending=True, stable=True)
        order = ranked.indices[:num_nodes]
        if min_log_prob is not None:  # scores fall along `order`, so the likely nodes are a prefix of it
            order = order[: max(1, int((ranked.values[:num_nodes] >= min_log_prob).sum()))]
        keep = torch.sort(order).values  # pool order = topological order
        remap = torch.full((self.size,), -1, dtype=torch.long, device=device)
        remap[keep] = torch.arange(1, keep.shape[0] + 1, device=device)
        kept_parents = all_parents[keep]
        # A kept node's parent is always kept: its score is >= the child's, and the stable sort breaks ties by pool
        # index (parents first), so remap never yields -1 here.
        tree_parents = torch.where(kept_parents < 0, 0, remap[kept_parents.clamp(min=0)])
        parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), tree_parents])
        return torch.cat([root_token, all_tokens[keep]]), parents
