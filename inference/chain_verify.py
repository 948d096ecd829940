"""Verification for hybrid targets: recurrent or convolution layers beside attention, one chain of drafts a round.

A Gated DeltaNet, Mamba-2 or short-convolution layer (Qwen3.5, Qwen3-Next, LFM2, Granite 4, Falcon-H1, Nemotron-H,
...) folds every token it reads into a fixed-size state. Two things follow for speculative decoding:

- a token TREE cannot be verified in one forward: the layer reads its input as one sequence, so a node would see
  its siblings' tokens, not only its ancestors'. A CHAIN of drafts can: it is a sequence. So these targets verify
  one chain a round (the drafter's best path: `tree_top_k=1`), as vLLM and SGLang serve them.
- the state cannot be cut back to the accepted prefix of the chain as keys / values can: transformers' layers
  return only the state after their last input token. So before each verification the states are copied
  (`snapshot_states`); when the whole chain is accepted the state after it is right and is kept; otherwise the
  states are put back, the attention layers' caches cut to the same length, and the accepted tokens become
  PENDING: the next verification runs them again, in front of its chain, in the same forward. Their keys, values
  and states are then the same as if they had never been rolled back (the target's forward continues a cached
  state over several tokens exactly: `target_support.CHAIN_FAMILIES` lists the families tested for it), and the
  round costs one forward of a few more tokens, not a second forward.

Convolution-only state layers (LFM2's short convolutions) need none of this: their state is the layer's last few
inputs, which transformers keeps whole from one cut to the next while it records the past (`activate_past_recording`),
so a crop after each verification cuts them back exactly, as it cuts keys and values: nothing runs again
(`kv_cache.cut_back`).

Pending tokens pile up while rounds stop short of their chain's end. Once `max_pending` are waiting, a round
verifies the root and the chain's first draft only: accepted, that short chain is whole, so the state after it is
kept and the pending tokens are committed (two tokens emitted); rejected, the root joins the pending tokens and the
next round tries again. Against verifying the root alone (certain, one token): the same taus within 1%, on a
Qwen3.5-like shape with oracle chains (scripts/hybrid_chain_bench.py; README, Results, "Hybrid targets").

Only the eager path verifies chains (`SpeculativeLM.generate`, one row at a time; the server's requests one after
another, inference/serial_engine.py); rows batched into one forward and the GPU fast path refuse these targets by
name. A prompt cache (multi-turn chat) keeps a hybrid's cache when the next prompt continues all it holds: its states
are those after its last position, which a later prompt that differs earlier cannot use (`kv_cache.cut_back`).
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
CHAINS_ONLY = "this target (recurrent / convolution layers beside attention) verifies one chain of drafts a round"


def chain_shape(shape: dict, given_top_k: int | None) -> dict:
    """A dynamic tree `shape` (depth, top_k, num_nodes, ...) made a chain: top-k 1, `depth` drafted nodes at most.
    `given_top_k` (the caller's own `tree_top_k`) above 1 is refused by name; the checkpoint's default is replaced."""
    if given_top_k is not None and given_top_k != 1:
        raise ValueError(f"{CHAINS_ONLY}: tree_top_k must be 1, got {given_top_k}")
    return dict(shape, top_k=1, num_nodes=min(shape["num_nodes"], shape["depth"]))


def chain_static_tree(tree: StaticTree, is_default: bool) -> StaticTree:
    """A Medusa static tree made a chain: the default becomes the chain as deep as it; a tree the caller gave must be
    one (refused by name otherwise)."""
    is_chain = tree.parents.shape[0] == tree.max_depth + 1
    if is_chain:
        return tree
    if not is_default:
        raise ValueError(f"{CHAINS_ONLY}: static tree {tree.name!r} has {tree.parents.shape[0] - 1} nodes over "
                         f"{tree.max_depth} depths; give a chain (`chain_tree(depth)`, or the name 'chain<depth>')")
    return chain_tree(tree.max_depth)


def check_chain(tree: TreeBuffers) -> None:
    """Refuse a tree that is not one chain (node i the child of node i - 1): a state layer cannot verify it."""
    if int(tree.depth[-1]) != tree.num_nodes - 1:
        raise ValueError(f"{CHAINS_ONLY} (its states read tokens as one sequence), got a tree of {tree.num_nodes} "
                         f"nodes and depth {int(tree.depth.max())}; draft with tree_top_k=1 and no lookup branches")


class ChainVerifier(DynamicTreeVerifier):
    """`DynamicTreeVerifier` for targets with state layers: verifies chains, rolls states back through pending
    tokens (module docstring). Same calls: `prefill`, then per round `verify` / `verify_argmax` and `compact`.

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
        self.chain = self.pending  # (N,) the chain the last verification ran
        self.committed = 0  # the cache's positions before the last verification
        self.croppable = False  # convolution states only: cut back by a crop, no pending tokens (set by `prefill`)
        self.cut_chain = build_tree_buffers(torch.arange(-1, self.cut_depth, device=target.device), dtype=target.dtype)

    def new_cache(self) -> Cache:
        """transformers' own cache for the target: it builds the state layers its state layers write."""
        return DynamicCache(config=self.target.config)

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int, held=None, inputs=None, held_offset: int = 0):
        """`DynamicTreeVerifier.prefill`; a `held` cache must hold the states after exactly its features' positions
        (`PromptCache` hands a hybrid's over only when the prompt continues all it holds)."""
        self.pending = self.pending[:0]
        out = super().prefill(prompt, max_new_tokens, held=held, inputs=inputs, held_offset=held_offset)
        layers = state_layers(self.cache)
        # convolution states only (no recurrent ones): recorded whole from here on, cut back (docstring)
        self.croppable = bool(layers) and all(layer.is_croppable for layer in layers)
        if self.croppable:
            self.cache.activate_past_recording()
        return out

    def limit(self, tokens: torch.Tensor, tree: TreeBuffers) -> tuple[torch.Tensor, TreeBuffers]:
        """The round's chain: the drafted one, or its root and first `cut_depth` drafts once `max_pending` tokens wait
        (module docstring)."""
        if self.pending.shape[0] >= self.max_pending and tokens.shape[0] > self.cut_depth + 1:
            return tokens[: self.cut_depth + 1], self.cut_chain
        return tokens, tree

    def _forward(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int, with_logits: bool):
        """Pending tokens + the (N,) chain in one forward from the committed state. Returns the chain's logits
        (N, V) or None, and hidden states (N, h) each."""
        check_chain(tree)
        pending = self.pending.shape[0]
        self.committed = prefix_length - pending  # positions in the cache
        self.snapshot, self.chain = ([] if self.croppable else snapshot_states(self.cache)), tokens
        fed = torch.cat([self.pending, tokens])  # (P + N,)
        start = self.committed + self.position_offset
        out = self.target(
            input_ids=fed[None],
            position_ids=torch.arange(start, start + fed.shape[0], device=fed.device)[None],
            **cache_kwargs(self.target, self.cache),
            use_cache=True,
            output_hidden_states=True,
            **({"logits_to_keep": tokens.shape[0]} if with_logits else no_logits(fed.device)),
        )
        logits = out.logits[0, -tokens.shape[0]:] if with_logits else None
        return logits, tuple(h[0, pending:] for h in out.hidden_states)

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden_states = self._forward(tokens, tree, prefix_length, with_logits=True)
        return logits, self.select_features(hidden_states)

    def verify_argmax(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.argmax is None:
            logits, features = self.verify(tokens, tree, prefix_length)
            return logits.argmax(dim=-1), features
        _, hidden_states = self._forward(tokens, tree, prefix_length, with_logits=False)
        return self.argmax(hidden_states[-1]), self.select_features(hidden_states)

    def compact(self, prefix_length: int, path: torch.Tensor) -> None:
        """Keep the accepted (L,) prefix of the chain: all of it in the cache when L = N, else as pending tokens
        after the states are put back as they were before the verification."""
        accepted = path.shape[0]
        if self.croppable:  # nothing pending: the convolution states are cut back with the keys and values
            cut_back(self.cache, self.committed + accepted)
        elif accepted == self.chain.shape[0]:
            self.pending = self.pending[:0]
        else:
            self.undo()
            self.pending = torch.cat([self.pending, self.chain[:accepted]])

    def undo(self) -> None:
        """Undo the last verification: the states put back as they were before it (or cut back), the attention caches
        cut to the committed positions (pending tokens stay pending)."""
        if self.croppable:
            cut_back(self.cache, self.committed)
            return
        restore_states(self.cache, self.snapshot)
        crop_cache(self.cache, self.committed)
