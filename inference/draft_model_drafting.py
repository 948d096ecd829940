"""Dynamic trees drafted by a draft model (heads/draft_model.py): EAGLE-2's expansion over tokens instead of features.

`DraftModelDrafter` is `EagleDrafter` with the head forward replaced by the draft model's: each round it feeds the
tokens committed since the last round into the draft model's own KV cache (the first round: the whole prompt, from
its first token on, which `begin` hands it), ranks the root's children from the last position's logits, then feeds
each level's k best nodes in one forward under a tree mask, exactly as EAGLE heads are fed. The best `num_nodes` of
the pool make the tree (`stop_prob`, `min_prob`, constrained drafting, `node_probs`: all as `EagleDrafter`).

The draft model never sees the target's features, so the verifier's features (the target's last hidden state)
are not read.
"""

from __future__ import annotations

from typing import Any

import torch

from specheads.heads.draft_model import DraftModelHeads
from specheads.inference.drafting import DraftPool, EagleDrafter
from specheads.inference.kv_cache import crop_cache
from specheads.inference.tree import TreeBuffers, build_tree_buffers


class DraftModelDrafter(EagleDrafter):
    """EAGLE-2 dynamic trees from a draft model's next-token distributions (see the module docstring).

    Args are `EagleDrafter`'s, with `DraftModelHeads` as the heads (`dtype`: the target's, for the trees; the draft
    model's masks are cast to its own dtype). Once the sequence would run past the draft model's context
    (`max_position_embeddings`), rounds propose the root alone: the target decodes on by itself.
    """

    def __init__(self, heads: DraftModelHeads, *args: Any, **kwargs: Any) -> None:
        if not isinstance(heads, DraftModelHeads):
            raise TypeError(f"DraftModelDrafter drafts with a draft model (DraftModelHeads), got {type(heads).__name__}")
        super().__init__(heads, *args, **kwargs)
        self.context = getattr(heads.draft_model.config.get_text_config(), "max_position_embeddings", None)
        self.root_only = build_tree_buffers(torch.tensor([-1], device=heads.draft_model.device), dtype=self.dtype)
        self.first_token: torch.Tensor | None = None
        self.root_hidden: torch.Tensor | None = None  # the draft model's last committed state (h_draft,)
        self.pending: torch.Tensor | None = None  # the draft ids `commit` feeds this round
        self.out_of_context = False

    def reset(self) -> None:
        super().reset()
        self.first_token = self.root_hidden = self.pending = None
        self.out_of_context = False

    @torch.no_grad()
    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        tokens = next_tokens
        if self.committed == 0:
            if self.first_token is None:
                raise RuntimeError("DraftModelDrafter: call begin(prompt[:1]) after reset() (drafting.start_sequence does both)")
            tokens = torch.cat([self.first_token.to(next_tokens.device), next_tokens])
        self.pending = self.heads.to_draft_ids(tokens)  # (m,): another tokenizer's ids may be more or fewer
        if self.context is not None and self.committed + self.pending.shape[0] + self.depth > self.context:
            self.out_of_context = True  # the draft model's context is full: no drafts for the rest of the sequence
        if self.out_of_context:
            return next_tokens[-1:], self.root_only
        return super().propose(features, next_tokens)

    def begin(self, first_token: torch.Tensor) -> None:
        """The (1,) first token of the new sequence (after `reset`): no feature precedes it, so the first `propose`
        carries the prompt from its second token on, but a language model reads the first one too."""
        self.first_token = first_token

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Feed the committed tokens since the last round (the first round: the first token, then `next_tokens`; as
        draft ids, `propose` made them), causal over the draft cache; returns the draft model's hidden state at the
        root (h_draft,)."""
        crop_cache(self.cache, self.committed)  # drops last round's draft entries
        tokens = self.pending
        if tokens.shape[0] == 0:  # nothing the draft model reads (tokens with no text for it): its last state
            if self.root_hidden is not None:
                return self.root_hidden
            tokens = tokens.new_zeros(1)  # a prompt of such tokens alone: any start will do
        start, length = self.committed, tokens.shape[0]
        positions = torch.arange(start, start + length, device=tokens.device)[None]
        hidden = self.heads(tokens[None], positions, self.causal_mask(start, length, tokens.device), self.cache)
        self.committed = start + length
        self.root_hidden = hidden[0, -1]
        return self.root_hidden

    def feed_frontier(self, pool: DraftPool, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The draft model over the k frontier tokens (each below its own path under `mask`): (k, h_draft)."""
        tokens = self.heads.drafted_to_draft_ids(pool.frontier_tokens)
        return self.heads(tokens[None], positions, mask, self.cache)[0]

