"""Verification for hybrid targets: recurrent or convolution layers beside attention, a tree's paths as chains.

A Gated DeltaNet, Mamba-2 or short-convolution layer (Qwen3.5, Qwen3-Next, LFM2, Granite 4, Falcon-H1, Nemotron-H,
...) folds every token it reads into a fixed-size state. Two things follow for speculative decoding:

- a token TREE cannot be verified as one sequence with a tree mask: the layer reads its input as one sequence, so a
  node would see its siblings' tokens, not only its ancestors'. A CHAIN of drafts can: it is a sequence. So these
  targets verify each root-to-leaf path of the round's tree as a chain of its own, the paths as the rows of one
  forward, each row on its own copy of the cache (`Cache.reorder_cache`); a node's logits come from any row that
  holds it. By default the drafters draft a single chain (the checkpoint's tree with top-k 1: one row), as vLLM and
  SGLang serve these models; a `tree_top_k` the caller gives, prompt lookup's branch or a Medusa tree add rows.
- the state cannot be cut back to the accepted prefix of a path as keys / values can: transformers' layers return
  only the state after their last input token. So before each verification the states are copied
  (`snapshot_states`); the accepted path's row is kept, and when that whole row is accepted the state after it is
  right and is kept; otherwise the states are put back, the attention layers' caches cut to the same length, and the
  accepted tokens become PENDING: the next verification runs them again, in front of its paths, in the same forward.
  Their keys, values and states are then the same as if they had never been rolled back (the target's forward
  continues a cached state over several tokens exactly: `target_support.CHAIN_FAMILIES` lists the families tested
  for it), and the round costs one forward of a few more tokens, not a second forward.

Convolution-only state layers (LFM2's short convolutions) need none of this: their state is the layer's last few
inputs, which transformers keeps whole from one cut to the next while it records the past (`activate_past_recording`),
so a crop after each verification cuts them back exactly, as it cuts keys and values: nothing runs again
(`kv_cache.cut_back`).

Pending tokens pile up while rounds stop short of their row's end. Once `max_pending` are waiting, a round
verifies the root and the tree's first draft only (one row): accepted, that short chain is whole, so the state after
it is kept and the pending tokens are committed (two tokens emitted); rejected, the root joins the pending tokens and
the next round tries again. Against verifying the root alone (certain, one token): the same taus within 1%, on a
Qwen3.5-like shape with oracle chains (scripts/hybrid_chain_bench.py; docs/results.md, "Hybrid targets").

Only the eager path verifies them (`SpeculativeLM.generate`, one sequence at a time; the server's requests one after
another, inference/serial_engine.py); several sequences batched into one forward and the GPU fast path refuse these
targets by name. A prompt cache (multi-turn chat) keeps a hybrid's cache when the next prompt continues all it
holds (its states are those after its last position), and copies of its states where its last calls started, from
which a prompt that differs earlier goes on (`prompt_cache.PromptCache.checkpoints`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.kv_cache import (
    LayerStates,
    crop_cache,
    cut_back,
    restore_states,
    snapshot_states,
    state_layers,
)
from specheads.inference.tree import StaticTree, TreeBuffers, build_tree_buffers, chain_tree
from specheads.inference.verify import DynamicTreeVerifier, no_logits

MAX_PENDING = 16  # pending tokens before a round verifies its first draft only (docstring above)
CUT_DEPTH = 1  # the drafts such a round verifies (0: its root alone)
CHAINS_ONLY = ("this target (recurrent / convolution layers beside attention) verifies each round's root-to-leaf paths "
               "as the rows of a forward of their own")


def chain_shape(shape: dict, given_top_k: int | None) -> dict:
    """A dynamic tree `shape` (depth, top_k, num_nodes, ...) for a hybrid target: the checkpoint's default becomes a
    chain (top-k 1, `depth` drafted nodes at most), since every further path costs a row of the verification; a
    `tree_top_k` the caller gives is kept (its tree's paths become the rows)."""
    if given_top_k is not None:
        return shape
    return dict(shape, top_k=1, num_nodes=min(shape["num_nodes"], shape["depth"]))


def chain_static_tree(tree: StaticTree, is_default: bool) -> StaticTree:
    """A Medusa static tree for a hybrid target: the default becomes the chain as deep as it (see `chain_shape`); a tree
    the caller gives is kept."""
    return chain_tree(tree.max_depth) if is_default and tree.parents.shape[0] != tree.max_depth + 1 else tree


def first_chain(tree: TreeBuffers, depth: int) -> torch.Tensor:
    """The node indices of the tree's first chain from the root, `depth` drafts deep at most: each node's first child
    (in the drafters' order, the likeliest)."""
    parents = tree.parents.tolist()
    chain = [0]
    for _ in range(depth):
        child = next((node for node in range(chain[-1] + 1, len(parents)) if parents[node] == chain[-1]), None)
        if child is None:
            break
        chain.append(child)
    return torch.tensor(chain, device=tree.parents.device)


class ChainVerifier(DynamicTreeVerifier):
    """`DynamicTreeVerifier` for targets with state layers: verifies a tree's paths as chains (the rows of one
    forward), rolls states back through pending tokens (module docstring). Same calls: `prefill`, then per round `verify` / `verify_argmax` and `compact`.

    Args:
        target, select_features, argmax: as `DynamicTreeVerifier`'s.
        max_pending: pending tokens at which a round verifies its root and first `cut_depth` drafts only (`limit`).
        cut_depth: how many drafts such a round keeps (0: its root alone).
    """

    def __init__(self, target: PreTrainedModel, select_features, argmax=None, max_pending: int | None = None,
                 cut_depth: int | None = None) -> None:
        super().__init__(target, select_features, argmax=argmax)
        self.max_pending = MAX_PENDING if max_pending is None else max_pending
        self.cut_depth = CUT_DEPTH if cut_depth is None else cut_depth
        self.pending = torch.zeros(0, dtype=torch.long, device=target.device)  # (P,) accepted, not in the cache
        self.snapshot: list[LayerStates] = []
        self.tokens = self.pending  # (N,) the tree the last verification ran
        self.paths = torch.zeros(1, 0, dtype=torch.long, device=target.device)  # (R, W) its root-to-leaf paths (rows)
        self.committed = 0  # the cache's positions before the last verification
        self.croppable = False  # convolution states only: cut back by a crop, no pending tokens (set by `prefill`)
        self.cut_chain = build_tree_buffers(torch.arange(-1, self.cut_depth, device=target.device), dtype=target.dtype)

    def new_cache(self) -> Cache:
        """transformers' own cache for the target: it builds the state layers its state layers write."""
        return DynamicCache(config=self.target.config)

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int, held=None, inputs=None, held_offset: int = 0):
        """`DynamicTreeVerifier.prefill`; a `held` cache must hold the states after exactly its features' positions
        (`PromptCache.take` hands a hybrid's over cut back, or rewound to a checkpoint, to that many)."""
        self.pending = self.pending[:0]
        out = super().prefill(prompt, max_new_tokens, held=held, inputs=inputs, held_offset=held_offset)
        layers = state_layers(self.cache)
        # convolution states only (no recurrent ones): recorded whole from here on, cut back (docstring)
        self.croppable = bool(layers) and all(layer.is_croppable for layer in layers)
        if self.croppable:
            self.cache.activate_past_recording()
        return out

    def limit(self, tokens: torch.Tensor, tree: TreeBuffers) -> tuple[torch.Tensor, TreeBuffers]:
        """The round's tree: the drafted one, or once `max_pending` tokens wait its first chain, `cut_depth` drafts
        deep (module docstring)."""
        if self.pending.shape[0] < self.max_pending or tokens.shape[0] <= 1:
            return tokens, tree
        chain = first_chain(tree, self.cut_depth)
        if chain.shape[0] < self.cut_depth + 1:  # a shallower tree
            return tokens[chain], build_tree_buffers(torch.arange(-1, chain.shape[0] - 1, device=tokens.device),
                                                     dtype=self.target.dtype)
        return tokens[chain], self.cut_chain

    def _forward(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int, with_logits: bool):
        """Pending tokens + the tree's (R, W) root-to-leaf paths as R rows of one forward from the committed state
        (a chain: one row). Returns the forward's output and `at`, which takes each node's entry (N, ...) out of an
        (R, P + W, ...) or (R, W, ...) tensor: the first row holding the node, at its depth (every row holding it gives
        the same: the same tokens before it)."""
        paths = tree.retrieve_indices  # (R, W) node indices by depth, -1 past a shorter path's end
        rows, width = paths.shape
        pending = self.pending.shape[0]
        self.committed = prefix_length - pending  # positions in the cache
        self.snapshot = [] if self.croppable else snapshot_states(self.cache)
        self.tokens, self.paths = tokens, paths
        fed = torch.cat([self.pending.expand(rows, -1), tokens[paths.clamp(min=0)]], dim=1)  # (R, P + W); junk padding
        if rows > 1:  # a copy of the cache per row (states and keys / values alike)
            self.cache.reorder_cache(torch.zeros(rows, dtype=torch.long, device=tokens.device))
        start = self.committed + self.position_offset
        positions = torch.arange(start, start + fed.shape[1], device=fed.device)[None].expand(rows, -1)
        out = self.target(
            input_ids=fed,
            position_ids=positions,
            **cache_kwargs(self.target, self.cache),
            use_cache=True,
            output_hidden_states=True,
            **({"logits_to_keep": width} if with_logits else no_logits(fed.device)),
        )
        if rows == 1:  # a chain, nodes in order: views, no gather
            return out, lambda x: x[0, x.shape[1] - width:]
        holds = (paths[:, :, None] == torch.arange(tokens.shape[0], device=paths.device)).any(dim=1)  # (R, N)
        row_of = holds.int().argmax(dim=0)  # (N,) the first row holding each node
        return out, lambda x: x[row_of, x.shape[1] - width + tree.depth]

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, at = self._forward(tokens, tree, prefix_length, with_logits=True)
        return at(out.logits), at(self.select_features(out.hidden_states))

    def verify_argmax(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.argmax is None:
            logits, features = self.verify(tokens, tree, prefix_length)
            return logits.argmax(dim=-1), features
        out, at = self._forward(tokens, tree, prefix_length, with_logits=False)
        return self.argmax(at(out.hidden_states[-1])), at(self.select_features(out.hidden_states))

    def compact(self, prefix_length: int, path: torch.Tensor) -> None:
        """Keep the accepted (L,) path: the cache of the first row that holds it; all of that row's entries when the
        path is the whole row, else its states put back as they were before the verification (or cut back) and the
        path's tokens pending."""
        accepted = path.shape[0]
        if self.paths.shape[0] > 1:  # keep the first row holding the path: its cache alone
            row = int((self.paths[:, :accepted] == path[None]).all(dim=1).int().argmax())
            self.cache.reorder_cache(torch.tensor([row], device=path.device))
            self.paths = self.paths[row : row + 1]
        if self.croppable:  # nothing pending: the convolution states are cut back with the keys and values
            cut_back(self.cache, self.committed + accepted)
        elif accepted == self.paths.shape[1]:  # the whole row, no padding after it: its states are right
            self.pending = self.pending[:0]
        else:
            self.undo()
            self.pending = torch.cat([self.pending, self.tokens[path]])

    def undo(self) -> None:
        """Undo the last verification: the states put back as they were before it (or cut back), the attention caches
        cut to the committed positions (pending tokens stay pending)."""
        if self.paths.shape[0] > 1:  # one row again
            self.cache.reorder_cache(torch.zeros(1, dtype=torch.long, device=self.paths.device))
            self.paths = self.paths[:1]
        if self.croppable:
            cut_back(self.cache, self.committed)
            return
        restore_states(self.cache, self.snapshot)
        crop_cache(self.cache, self.committed)
