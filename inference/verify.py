"""Verification: ONE forward of the unmodified target over every node of a draft tree."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specheads.inference.tree import TreeBuffers


def tree_attention_mask(tree: TreeBuffers, prefix_length: int) -> torch.Tensor:
    """(1, 1, N, prefix_length + N) additive mask: every node sees the whole prefix, then its ancestors."""
    n = tree.num_nodes
    mask = torch.zeros(1, 1, n, prefix_length + n, dtype=tree.attention_bias.dtype, device=tree.attention_bias.device)
    mask[0, 0, :, prefix_length:] = tree.attention_bias
    return mask


@torch.no_grad()
def verify_tree(
    target: PreTrainedModel,
    cache: DynamicCache,
    tokens: torch.Tensor,
    tree: TreeBuffers,
    prefix_length: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run the target once over all tree nodes, appended to its cache.

    The tree enters as an explicit 4-D additive attention mask plus position ids (prefix length + depth);
    the target's code is not modified. Afterwards the cache holds prefix_length + N positions; compact it
    with `kv_cache.compact_cache` once the accepted path is known.

    Args:
        target: any causal LM accepting a 4-D float `attention_mask` and `position_ids` (transformers 5.x).
        cache: the target's cache, holding exactly `prefix_length` positions.
        tokens: (N,) node tokens, node 0 the root.
        tree: the tree's buffers.
        prefix_length: cached positions before the tree.

    Returns:
        logits (N, V) and the hidden states tuple, each (N, h).
    """
    out = target(
        input_ids=tokens[None],
        attention_mask=tree_attention_mask(tree, prefix_length),
        position_ids=(tree.depth + prefix_length)[None],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    return out.logits[0], tuple(h[0] for h in out.hidden_states)
