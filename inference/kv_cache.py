"""The one place that touches `transformers` cache internals: keep the accepted path, drop the rest.

Cache APIs moved between transformers 5.x releases (5.23's `DynamicCache.crop` takes a negative count
of tokens to drop; 5.17 took a length). This helper works on `cache.layers[i].keys / .values`
(B, kv_heads, S, head_dim), which every 5.x `DynamicCache` has.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def cache_length(cache: DynamicCache) -> int:
    """Number of cached positions."""
    return cache.get_seq_length()


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def compact_cache(cache: DynamicCache, prefix_length: int, keep: torch.Tensor) -> None:
    """After verifying a tree appended at `prefix_length`, keep only the accepted nodes, in order.

    Args:
        cache: holds prefix_length + N positions (the prefix, then the N tree nodes).
        prefix_length: number of positions before the tree.
        keep: (L,) tree-node indices of the accepted path (ascending), moved to prefix_length .. +L.
    """
    total = prefix_length + keep.shape[0]
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        if layer.keys.shape[-2] < total:
            raise RuntimeError(
                f"cache layer holds {layer.keys.shape[-2]} positions, expected at least {total} "
                "(sliding-window caches past their window are not supported)"
            )
        source = keep + prefix_length
        # Gather first (a copy), then write: source and destination ranges may overlap.
        layer.keys[:, :, prefix_length:total] = layer.keys.index_select(2, source)
        layer.values[:, :, prefix_length:total] = layer.values.index_select(2, source)
        layer.keys = layer.keys[:, :, :total]
        layer.values = layer.values[:, :, :total]
