"""KV cache helpers on a real `DynamicCache` of the installed transformers and on `tree_cache()` (growing buffers):
compaction equals sequential decoding."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.kv_cache import (
    INITIAL_CAPACITY,
    GrowingLayer,
    cache_length,
    compact_cache,
    crop_cache,
    tree_cache,
)
from specheads.inference.tree import build_tree_buffers
from specheads.inference.verify import verify_tree

VOCAB = 97
CACHES = {"dynamic": DynamicCache, "tree": tree_cache}  # transformers' cache, and the one decoding runs on


@torch.no_grad()
def sequential_cache(target, token_ids: list[int], kind: str = "dynamic"):
    """The cache of running `token_ids` through the target as one ordinary causal sequence."""
    cache = CACHES[kind]()
    target(input_ids=torch.tensor([token_ids]), **cache_kwargs(target, cache), use_cache=True)
    return cache


def assert_caches_equal(actual: DynamicCache, expected: DynamicCache, atol: float = 1e-5) -> None:
    assert len(actual.layers) == len(expected.layers)
    for i, (a, e) in enumerate(zip(actual.layers, expected.layers)):
        assert a.keys.shape == e.keys.shape, f"layer {i} keys {tuple(a.keys.shape)} != {tuple(e.keys.shape)}"
        torch.testing.assert_close(a.keys, e.keys, atol=atol, rtol=0, msg=f"layer {i} keys")
        torch.testing.assert_close(a.values, e.values, atol=atol, rtol=0, msg=f"layer {i} values")


def test_installed_transformers_is_5x():
    """The helpers target the 5.x cache layout (`cache.layers[i].keys / .values`)."""
    assert transformers.__version__.split(".")[0] == "5"
    cache = DynamicCache()
    assert hasattr(cache, "layers")


@st.composite
def tree_and_node(draw, max_nodes: int = 16):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(n)]
    prefix = [draw(st.integers(0, VOCAB - 1)) for _ in range(draw(st.integers(1, 8)))]
    return prefix, parents, tokens, draw(st.integers(0, n - 1))


@pytest.mark.parametrize("kind", CACHES)
@given(case=tree_and_node())
@settings(max_examples=25, deadline=None)
def test_compaction_after_tree_verification_equals_sequential_cache(tiny_llama, kind, case):
    """Verify a random tree, keep one root-to-node path: the cache equals running prefix + path sequentially."""
    prefix, parents, tokens, node = case
    cache = sequential_cache(tiny_llama, prefix, kind)
    tree = build_tree_buffers(torch.tensor(parents))
    verify_tree(tiny_llama, cache, torch.tensor(tokens), tree, len(prefix))
    assert cache_length(cache) == len(prefix) + len(parents)
    path = torch.nonzero(tree.ancestors[node]).squeeze(-1)  # root .. node, ascending
    compact_cache(cache, len(prefix), path)
    assert cache_length(cache) == len(prefix) + path.shape[0]
    assert_caches_equal(cache, sequential_cache(tiny_llama, prefix + [tokens[i] for i in path.tolist()]))


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_compacted_cache_keeps_decoding_correctly(tiny_target_factory, family, kind):
    """After compacting to a path that skips nodes, the next forward's logits equal a full uncached forward."""
    target = tiny_target_factory(family)
    prefix = [1, 17, 5, 60, 33]
    #   0 -> 1 -> 3 -> 6          the kept path skips nodes 2, 4, 5 (entries must move, with overlap)
    #     \-> 2   \-> 4 \-> 5
    parents = [-1, 0, 0, 1, 1, 4, 3]
    tokens = [8, 9, 10, 11, 12, 13, 14]
    cache = sequential_cache(target, prefix, kind)
    tree = build_tree_buffers(torch.tensor(parents))
    verify_tree(target, cache, torch.tensor(tokens), tree, len(prefix))
    path = torch.tensor([0, 1, 3, 6])
    compact_cache(cache, len(prefix), path)
    kept = prefix + [tokens[i] for i in path.tolist()]
    assert_caches_equal(cache, sequential_cache(target, kept))
    with torch.no_grad():
        step = target(input_ids=torch.tensor([[42]]), **cache_kwargs(target, cache), use_cache=True).logits[0, -1]
        full = target(input_ids=torch.tensor([kept + [42]])).logits[0, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", CACHES)
def test_compacting_to_the_root_only_and_to_a_contiguous_prefix(tiny_llama, kind):
    """Keeping [0] drops the whole draft; keeping a contiguous prefix of nodes is a plain crop."""
    prefix, tokens = [3, 4, 5], [6, 7, 8, 9]
    tree = build_tree_buffers(torch.tensor([-1, 0, 1, 2]))  # a chain
    for keep in ([0], [0, 1, 2], [0, 1, 2, 3]):
        cache = sequential_cache(tiny_llama, prefix, kind)
        verify_tree(tiny_llama, cache, torch.tensor(tokens), tree, len(prefix))
        compact_cache(cache, len(prefix), torch.tensor(keep))
        assert_caches_equal(cache, sequential_cache(tiny_llama, prefix + [tokens[i] for i in keep]))


@pytest.mark.parametrize("keep", [[0, 1, 2], [0, 2]])
def test_compact_cache_refuses_a_cache_shorter_than_the_tree(tiny_llama, keep):
    """Asking to keep nodes the cache does not hold is an error, not silent garbage (a contiguous path too)."""
    cache = sequential_cache(tiny_llama, [3, 4, 5])
    with pytest.raises(RuntimeError, match="expected at least"):
        compact_cache(cache, 2, torch.tensor(keep))


@pytest.mark.parametrize("length", [0, 1, 6, 11, 50])
def test_crop_cache_equals_the_cache_of_the_shorter_sequence(tiny_llama, length):
    """crop_cache(n) keeps the first n positions of every layer (n >= current length: unchanged)."""
    tokens = [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11]
    cache = sequential_cache(tiny_llama, tokens)
    crop_cache(cache, length)
    kept = min(length, len(tokens))
    assert cache_length(cache) == kept
    if kept:
        assert_caches_equal(cache, sequential_cache(tiny_llama, tokens[:kept]))


def test_helpers_skip_empty_layers():
    """A fresh cache (no layer filled yet) is left alone by both helpers."""
    cache = DynamicCache()
    crop_cache(cache, 3)
    compact_cache(cache, 0, torch.tensor([0]))
    assert cache_length(cache) == 0


@torch.no_grad()
def test_tree_cache_appends_in_place_and_grows_past_its_capacity(tiny_llama):
    """Forwards of a few tokens append into the same buffers (no copy of the cache); past INITIAL_CAPACITY the
    buffers double and keep every entry; cropping in between lets the next forward append after the crop."""
    tokens = [int(t) for t in torch.randint(0, VOCAB, (INITIAL_CAPACITY + 40,), generator=torch.Generator().manual_seed(0))]
    cache = tree_cache()
    tiny_llama(input_ids=torch.tensor([tokens[:10]]), **cache_kwargs(tiny_llama, cache), use_cache=True)
    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer) and layer.key_buffer.shape[-2] == INITIAL_CAPACITY
    buffer_address = layer.key_buffer.data_ptr()
    tiny_llama(input_ids=torch.tensor([tokens[10:13]]), **cache_kwargs(tiny_llama, cache), use_cache=True)
    assert layer.key_buffer.data_ptr() == buffer_address and layer.keys.data_ptr() == buffer_address  # a view
    crop_cache(cache, 11)  # drop two, then append the same two again plus the rest, past the capacity
    for start in range(11, len(tokens), 60):
        chunk = tokens[start : start + 60]
        tiny_llama(input_ids=torch.tensor([chunk]), **cache_kwargs(tiny_llama, cache), use_cache=True)
    assert layer.key_buffer.shape[-2] >= len(tokens) > INITIAL_CAPACITY
    assert cache_length(cache) == len(tokens)
    assert_caches_equal(cache, sequential_cache(tiny_llama, tokens))


@torch.no_grad()
def test_tree_cache_adopts_keys_replaced_by_other_tensors(tiny_llama):
    """Code that swaps a layer's keys / values for new tensors (a gather, as batched decoding's compaction does)
    leaves a correct cache: the next forward appends to those tensors, not to the stale buffers."""
    tokens = [5, 9, 2, 44, 7, 13]
    cache = sequential_cache(tiny_llama, tokens, "tree")
    keep = torch.tensor([0, 1, 3, 5])  # like a compaction, but by replacing the tensors
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(2, keep), layer.values.index_select(2, keep)
    tiny_llama(input_ids=torch.tensor([[30, 31]]), **cache_kwargs(tiny_llama, cache), use_cache=True)
    # the same done to transformers' own cache (which concatenates) is the reference
    reference = sequential_cache(tiny_llama, tokens)
    for layer in reference.layers:
        layer.keys, layer.values = layer.keys.index_select(2, keep), layer.values.index_select(2, keep)
    tiny_llama(input_ids=torch.tensor([[30, 31]]), **cache_kwargs(tiny_llama, reference), use_cache=True)
    assert cache_length(cache) == keep.shape[0] + 2
    assert_caches_equal(cache, reference)
