"""DFlash drafting: a block drafter (heads/dflash.py) scores every depth of a tree in ONE forward.

Each round feeds the drafter the target features of the positions committed since the last round (the context:
their keys / values join the drafter's cache, the block's are cropped next round) and one block at the positions after
them, [root, mask, ..., mask]:

    cache: context c_0 .. c_{p-1}    block: x_p (the root) at p, mask at p+1 .. p+B-1
    output at p+d -> logits of the token at depth d

Those distributions do not depend on the tokens drafted above them, so the tree is built as P-EAGLE's
(`parallel_drafting.tree_of_depths`): a depth's top-k are every parent's children and the best `num_nodes` paths
are kept (`stop_prob`, `min_prob`, `node_probs` and constrained drafting work alike). z-lab's DFlash drafts a
chain of the block's argmaxes; a tree of a few nodes per depth accepts more for the same forward.
"""

from __future__ import annotations

from typing import Any

import torch

from specheads.heads.dflash import DFlashHeads
from specheads.inference.drafting import EagleDrafter
from specheads.inference.kv_cache import crop_cache
from specheads.inference.parallel_drafting import tree_of_depths
from specheads.inference.tree import TreeBuffers


class DFlashDrafter(EagleDrafter):
    """Dynamic trees of DFlash heads: one drafter forward per round (see the module docstring).

    Args are `EagleDrafter`'s (whose `fork` makes another of this class); `depth` may not exceed the heads'
    `block_size` - 1.
    """

    def __init__(self, heads: DFlashHeads, depth: int, *args: Any, **kwargs: Any) -> None:
        if not isinstance(heads, DFlashHeads):
            raise ValueError(f"DFlashDrafter needs DFlash heads; got {heads.config.head_type} heads")
        if depth > heads.block_size - 1:
            raise ValueError(f"tree_depth={depth} exceeds what the heads' block of {heads.block_size} drafts "
                             f"({heads.block_size - 1} depths); use tree_depth <= {heads.block_size - 1}")
        super().__init__(heads, depth, *args, **kwargs)
        device = heads.fc.weight.device
        # (B,): the root's slot (filled each round), then the mask token
        self.block = torch.full((heads.block_size,), heads.config.block_mask_token, dtype=torch.long, device=device)

    @torch.no_grad()
    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        crop_cache(self.cache, self.committed)  # drops last round's block (and anything a caller rolled back)
        start, length = self.committed, features.shape[0]
        self.block[:1] = next_tokens[-1:]  # (B,): the root, then masks
        positions = torch.arange(start, start + length + self.block.shape[0], device=features.device)[None]
        out = self.heads(features[None], self.block[None], positions[:, :length], positions[:, length:], None,
                         self.cache)[0]  # (B, h)
        self.committed = start + length
        return tree_of_depths(self, out[1 : self.depth + 1], next_tokens)  # row d-1 scores depth d
