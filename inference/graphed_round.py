"""A whole greedy EAGLE round as ONE CUDA graph: verify, accept, compact, draft; the host reads the tokens once.

On the fast path a round is two graph replays (the drafter's, the verifier's) joined by eager glue: loading
the tree into the verifier's buffers, acceptance (`accept_greedy` reads the path with `nonzero`, a host
sync), cache compaction and the next drafter inputs, all driven by host integers. Here that glue has fixed
shapes and reads the committed length (the prefix) as a 0-d DEVICE tensor, so that one function does the
whole round and is captured once:

    load     tree -> verifier buffers: ids, positions = depth + prefix, write slots, the (N, capacity) mask
    verify   the target's forward over the N tree slots (the verifier's eager body, recorded in this graph)
    accept   greedy, with the path padded to P = min(depth, nodes) + 1 rows and its length L + 1 on the device
    update   compact the target cache; the path's features and tokens become the drafter's commit rows
    draft    the drafter's round (`StaticEagleDrafter.draft_round`): the next tree, into static buffers

The host reads one small tensor per round, [L + 1, accepted tokens (padded to P)], to emit tokens and check
EOS / max_new_tokens, and tracks the prefix from those counts (for its capacity checks). On the CPU the same
function runs eagerly; that is how it is tested against the per-phase fast path and `target.generate`.

Greedy decoding with a `StaticEagleDrafter` only: sampling (random numbers and host decisions per level),
Medusa and other drafters keep the per-phase loop of `SpeculativeLM._generate_row`, which stays the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specheads.inference.cuda_graphs import try_capture
from specheads.inference.static_drafting import StaticEagleDrafter

if TYPE_CHECKING:
    from specheads.inference.tree_verifier import TreeVerifier

CAPTURE_WARMUP = 3  # warm-up rounds before capture (each one really runs: the host checks there is room)


# --- the glue, on the device ------------------------------------------------------------------------------
def tree_mask_on_device(
    ancestors: torch.Tensor, num_slots: int, prefix: torch.Tensor, key_index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The (N, capacity) additive mask of `write_tree_mask` for a tree written at slots [prefix, prefix + N).

    Real nodes see the committed prefix [0, prefix) and exactly their ancestors at slots prefix + j; padding
    nodes (n .. N-1) see only themselves; everything else is hidden. Unlike `write_tree_mask` every slot is
    rewritten (no state from earlier rounds), and the prefix is a 0-d device tensor: no host sync.

    Args:
        ancestors: (n, n) bool, n <= N: the tree's ancestors (node j is node i or one of its ancestors).
        num_slots: N, the padded node count.
        prefix: 0-d long device tensor, committed positions before the tree.
        key_index: (capacity,) long, arange(capacity) on the device.
        dtype: the mask's dtype.
    """
    n, device = ancestors.shape[0], ancestors.device
    sees = torch.eye(num_slots, dtype=torch.bool, device=device)  # (N, N): padding nodes see themselves
    sees[:n, :n] = ancestors
    offset = key_index - prefix  # (C,) slot index relative to the tree
    in_tree = (offset >= 0) & (offset < num_slots)
    tree_part = sees.index_select(1, offset.clamp(0, num_slots - 1)) & in_tree  # (N, C)
    is_real = torch.arange(num_slots, device=device) < n  # (N,)
    visible = tree_part | ((offset < 0)[None, :] & is_real[:, None])  # (N, C)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def load_tree_on_device(
    verifier: TreeVerifier,
    tokens: torch.Tensor,
    depth: torch.Tensor,
    ancestors: torch.Tensor,
    prefix: torch.Tensor,
    key_index: torch.Tensor,
) -> None:
    """`TreeVerifier.load` with the prefix as a 0-d device tensor: ids, positions, write slots and mask.

    Args:
        verifier: its static buffers are filled (N = verifier.num_slots).
        tokens, depth: (n,) the tree's tokens and depths, n <= N; ancestors: (n, n) bool.
        prefix: 0-d long device tensor; key_index: (capacity,) arange on the device.
    """
    n = tokens.shape[0]
    verifier.ids[0, :n] = tokens
    verifier.ids[0, n:] = 0  # padding tokens: any valid id (they only see themselves)
    verifier.positions[0, :n] = depth + prefix
    verifier.positions[0, n:] = prefix
    torch.add(verifier.slot_offsets, prefix, out=verifier.write)  # (N,) slots prefix + arange(N)
    mask = tree_mask_on_device(ancestors, verifier.num_slots, prefix, key_index, verifier.mask.dtype)
    verifier.mask[0, 0].copy_(mask)


def accept_greedy_padded(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    ancestors: torch.Tensor,
    target_argmax: torch.Tensor,
    path_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_greedy` with fixed shapes and no host sync: the path padded to `path_rows` node indices.

    Args:
        tokens: (n,) drafted tokens (tokens[0] is the root); parents, depth: (n,); ancestors: (n, n) bool.
        target_argmax: (n,) the target's argmax next token at each node.
        path_rows: P, at least the tree's depth + 1.

    Returns:
        (path (P,): the accepted path's nodes in depth order, then `best` repeated; count: 0-d, L + 1 (real
        rows of `path`); bonus: 0-d, the target's token after the path). path[:count] and bonus equal
        `accept_greedy`'s (path, bonus).
    """
    # correct[i]: node i's token is what the target predicts after its parent (the root is always correct).
    # (`| node_index == 0`, not `correct[0] = True`: that copies a host scalar, which CUDA graph capture refuses)
    node_index = torch.arange(tokens.shape[0], device=tokens.device)
    correct = (tokens == target_argmax[parents.clamp(min=0)]) | (node_index == 0)
    # A node is accepted when it and all its ancestors are correct; best = the deepest one (siblings differ).
    accepted = ~(ancestors & ~correct[None, :]).any(dim=-1)  # (n,)
    best = torch.argmax(torch.where(accepted, depth, -1)).view(1)  # (1,)
    length = depth.index_select(0, best)  # (1,) L, accepted drafted tokens
    # Row r of the path is best's ancestor at depth min(r, L): exactly one node matches (rows past L: best).
    rows = torch.arange(path_rows, device=tokens.device)
    wanted = torch.minimum(rows, length)  # (P,)
    on_path = ancestors.index_select(0, best) & (depth[None, :] == wanted[:, None])  # (P, n), one True per row
    path = (on_path.long() * node_index).sum(dim=-1)  # (P,)
    return path, (length + 1)[0], target_argmax.index_select(0, best)[0]


# --- the round and its driver -------------------------------------------------------------------------------
class GraphedGreedyRound:
    """Greedy speculative rounds of a `StaticEagleDrafter` on a `TreeVerifier`, each one graph replay on CUDA.

    Use: `start(features, next_tokens, prefix_length)` after the prompt's prefill (the first tree is drafted
    by `drafter.propose`, outside this graph), then `step()` per round, which returns the accepted tokens
    (the drafted path's tokens, then the bonus token). Between calls the state lives in static device
    buffers: the current tree, the prefix, the drafter's commit rows. The host mirrors the prefix
    (`prefix_length`) and the drafter's `committed` from the counts it reads.

    Args:
        verifier: the fast path's verifier whose buffers and forward this round uses (trees of n <= N nodes).
        drafter: the static drafter (its graph, if any, stays for `propose`; this graph records its body).
        use_graph: capture the round as a CUDA graph (default: when the verifier's target is on CUDA).
    """

    def __init__(self, verifier: TreeVerifier, drafter: StaticEagleDrafter, use_graph: bool | None = None) -> None:
        self.verifier, self.drafter, self.cache = verifier, drafter, verifier.cache
        device = verifier.ids.device
        self.device = device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.key_index = torch.arange(self.cache.capacity, device=device)  # (C,)
        self.prefix = torch.zeros((), dtype=torch.long, device=device)  # committed target positions
        self.prefix_length = 0  # host copy of `prefix`
        # The current tree (n nodes, fixed for the drafter's shape): allocated by the first `start`.
        self.tree: tuple[torch.Tensor, ...] | None = None  # tokens (n,), parents (n,), depth (n,), ancestors (n, n)
        self.path_rows = 0  # P = min(depth, n - 1) + 1: the longest accepted path, root included
        self.out: torch.Tensor | None = None  # (1 + P,) [L + 1, accepted tokens padded]: the one host read
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capture_failed = False

    # --- the body of the graph ---------------------------------------------------------------------------------
    def round(self) -> None:
        """Verify the current tree, accept greedily, compact, feed the path to the drafter, draft the next tree.

        Fixed shapes, no host sync, no Python decision on tensor values.
        """
        verifier, drafter, rows = self.verifier, self.drafter, self.path_rows
        tokens, parents, depth, ancestors = self.tree
        n = tokens.shape[0]

        # verify
        load_tree_on_device(verifier, tokens, depth, ancestors, self.prefix, self.key_index)
        logits, node_features = verifier.forward()  # (N, V), (N, w)
        target_argmax = logits[:n].argmax(dim=-1)  # (n,)

        # accept
        path, count, bonus = accept_greedy_padded(tokens, parents, depth, ancestors, target_argmax, rows)
        # accepted[r]: the token after path row r: the next path node's token for r < L, the bonus at r = L
        # (rows past L: the bonus again, padding).
        after = tokens.index_select(0, torch.cat([path[1:], path[-1:]]))  # (P,) token of the next path row
        accepted = torch.where(torch.arange(rows, device=self.device) < count - 1, after, bonus)

        # update: the target cache, the drafter's commit rows (base advances by the previous round's count)
        # Padding rows (r > L) copy `best` again into slots prefix + L + 1 .. prefix + P - 1, past the new committed
        # length: harmless, the next tree (N >= P nodes) is written at prefix + L + 1 onward before any read, and
        # every mask hides slots past the committed prefix except the tree's own.
        self.cache.move_path(self.prefix, path)
        drafter.features[:rows].copy_(node_features.index_select(0, path))  # (P, w) true features of the path
        drafter.tokens[:rows].copy_(accepted)
        drafter.base.add_(drafter.count)
        drafter.count.copy_(count)
        self.prefix.add_(count)
        self.out[0] = count
        self.out[1:].copy_(accepted)

        # draft the next tree
        for buffer, value in zip(self.tree, drafter.draft_round()[:4]):
            buffer.copy_(value)

    # --- the host side ----------------------------------------------------------------------------------------
    def _state(self) -> list[torch.Tensor]:
        """The tensors a round advances (saved around the capture's warm-up rounds)."""
        drafter = self.drafter
        return [self.prefix, *self.tree, self.out, drafter.features, drafter.tokens, drafter.count, drafter.base]

    def _room_for(self, rounds: int) -> bool:
        """Whether `rounds` more rounds keep every write inside the target's and the head's caches."""
        # Each round moves the prefix (and the head's committed positions: the same number) by at most P. The
        # last one writes N tree slots (target) and commits at most P rows (head: `propose`'s own check; its
        # cache has room for the padded commit rows and the draft levels beyond its sequence capacity).
        end = self.prefix_length + (rounds - 1) * self.path_rows
        return (
            end + self.verifier.num_slots <= self.cache.capacity
            and end + self.path_rows <= self.drafter.sequence_capacity
        )

    def _capture(self) -> None:
        """Capture `round` (CUDA). The warm-up rounds really run, so `try_capture` restores the round's buffers:
        they wrote only at target slots >= prefix and head slots >= the head's committed positions (the next
        round's base), which the next round rewrites or its masks hide, so that restores the state."""
        self.graph, _ = try_capture(self.round, "greedy speculative round", warmup=CAPTURE_WARMUP, restore=self._state())
        self.capture_failed = self.graph is None

    def _replay(self) -> None:
        if self.use_graph and self.graph is None and not self.capture_failed and self._room_for(CAPTURE_WARMUP + 1):
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.round()  # eager: the CPU, a failed capture, or too little room left for the warm-up rounds

    def start(self, features: torch.Tensor, next_tokens: torch.Tensor, prefix_length: int) -> None:
        """Draft the first tree after the prompt (`drafter.propose`, outside this graph) and load the state.

        Args:
            features: (n, w) the target's features of the prompt; next_tokens: (n,) the token after each.
            prefix_length: committed target positions (the prompt's length).
        """
        tokens, tree = self.drafter.propose(features, next_tokens)
        first = (tokens, tree.parents, tree.depth, tree.ancestors)
        n = tokens.shape[0]
        if n > self.verifier.num_slots:
            raise ValueError(f"a tree of {n} nodes does not fit a verifier padded to {self.verifier.num_slots} nodes")
        if self.tree is None:
            self.tree = tuple(torch.empty_like(t) for t in first)
            self.path_rows = min(self.drafter.depth, n - 1) + 1
            self.out = torch.zeros(1 + self.path_rows, dtype=torch.long, device=self.device)
        elif self.tree[0].shape[0] != n:
            raise ValueError(f"the drafter's trees have {n} nodes, this round was built for {self.tree[0].shape[0]}")
        for buffer, value in zip(self.tree, first):
            buffer.copy_(value)
        self.prefix.fill_(prefix_length)
        self.prefix_length = prefix_length

    def path_features(self, count: int) -> torch.Tensor:
        """(count, w) copy of the last round's accepted path's features (its root and accepted nodes; `count` = the
        tokens `step` returned): what a `PromptCache` keeps of the round. No host sync."""
        return self.drafter.features[:count].clone()

    @torch.no_grad()
    def step(self) -> list[int]:
        """One round (a graph replay on CUDA); returns the accepted tokens (L drafted + the bonus): one host read."""
        if not self._room_for(1):
            raise ValueError(
                f"the fast path's caches ({self.cache.capacity} target slots, {self.drafter.sequence_capacity} head "
                f"positions) cannot hold another round at {self.prefix_length} committed positions"
            )
        self._replay()
        values = self.out.tolist()  # the round's only host sync
        count = values[0]
        self.prefix_length += count
        self.cache.committed_length = self.prefix_length
        self.drafter.committed += count
        return values[1 : 1 + count]
