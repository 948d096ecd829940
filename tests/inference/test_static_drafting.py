"""`StaticEagleDrafter` (fixed shapes, static head cache: one CUDA graph per round on the GPU) drafts exactly
the trees of `EagleDrafter`, on the CPU where the same round runs eagerly.

Both drafters are fed the same rounds: the target's own features along its greedy continuation, the prompt
first, then paths of every length 1 .. depth + 1 (as acceptance produces them). After each round the trees
must be identical and the static head cache must hold, at every committed position, the keys and values of
the reference's `DynamicCache`. The heads' attention is sharpened so that a wrong position, mask or cache
slot changes the drafts.
"""

from __future__ import annotations

import random

import pytest
import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference.drafting import EagleDrafter
from specheads.inference.static_drafting import StaticEagleDrafter

from .conftest import greedy_continuation, hf_greedy, sharpen_attention

DEPTH, TOP_K, NODES = 4, 3, 10


def sharpened_heads(target, head_type: str, seed: int = 0):
    """Untrained heads whose attention is far from uniform (so positions and masks matter)."""
    torch.manual_seed(seed)
    heads = create_heads(target, head_type)
    return sharpen_attention(heads)


def committed_keys_values(drafter, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_heads, length, head_dim) keys and values of the first `length` head positions."""
    if isinstance(drafter, StaticEagleDrafter):
        storage = drafter.cache.storage  # (1, 2, 1, kv_heads, capacity, head_dim)
        return storage[0, 0, 0, :, :length], storage[0, 1, 0, :, :length]
    layer = drafter.cache.layers[0]
    return layer.keys[0, :, :length], layer.values[0, :, :length]


@pytest.mark.parametrize("family", ["stories260K", "llama", "qwen2"])
@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_static_drafter_drafts_the_trees_of_the_eager_drafter(family, head_type, stories260k, tiny_target_factory):
    if family == "stories260K":
        target, tokenizer = stories260k
        prompt = tokenizer("Once upon a time there was", return_tensors="pt").input_ids[0].tolist()
    else:
        target = tiny_target_factory(family)
        prompt = [1, 5, 9, 33, 7, 2, 11]
    heads = sharpened_heads(target, head_type)
    sequence = prompt + greedy_continuation(target, prompt, 60)
    with torch.no_grad():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = heads.select_features(hidden)[0]  # (T, w): the target's features along the sequence
    tokens = torch.tensor(sequence)

    eager = EagleDrafter(heads, DEPTH, TOP_K, NODES, dtype=target.dtype)
    static = StaticEagleDrafter(eager, capacity=len(sequence), use_graph=False)
    rng = random.Random(f"{family}-{head_type}")
    for repeat in range(2):  # a second sequence on the same drafter: reset() must start over
        eager.reset()
        static.reset()
        lengths = [len(prompt) - repeat] + [rng.randint(1, DEPTH + 1) for _ in range(12)]
        lengths += list(range(1, DEPTH + 2))  # every path length, including the longest
        start = 0
        for length in lengths:
            rows = slice(start, start + length)
            next_tokens = tokens[start + 1 : start + length + 1]
            want_tokens, want_tree = eager.propose(features[rows], next_tokens)
            got_tokens, got_tree = static.propose(features[rows], next_tokens)
            start += length
            assert torch.equal(got_tokens, want_tokens), (repeat, start)
            assert torch.equal(got_tree.parents, want_tree.parents)
            assert torch.equal(got_tree.ancestors, want_tree.ancestors)
            assert torch.equal(got_tree.depth, want_tree.depth)
            assert torch.equal(got_tree.attention_bias, want_tree.attention_bias)
            assert static.committed == eager.committed == start
            for got, want in zip(committed_keys_values(static, start), committed_keys_values(eager, start)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # row counts differ: BLAS rounding
        assert start < len(sequence)


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_the_fast_path_drafts_with_the_static_drafter_and_stays_exact(target_and_prompt, head_type):
    """Greedy identity on every test architecture; the runner keeps one static drafter across calls."""
    target, ids = target_and_prompt
    lm = SpeculativeLM(target, sharpened_heads(target, head_type), tree_depth=DEPTH, tree_top_k=TOP_K, tree_num_nodes=NODES)
    out = lm.generate(ids, max_new_tokens=40, fast_path=True)
    assert torch.equal(out, hf_greedy(target, ids, 40))
    drafter = lm._fast_runner.drafter
    assert isinstance(drafter, StaticEagleDrafter) and drafter.source is lm.drafter
    lm.generate(ids, max_new_tokens=20, fast_path=True)
    assert lm._fast_runner.drafter is drafter


@pytest.mark.parametrize(("head_type", "option", "value"), [("eagle", "tree_stop_prob", 0.2), ("eagle3", "tree_min_prob", 0.05)])
def test_early_stopping_and_pruning_keep_the_eager_drafter_on_the_fast_path(stories260k, head_type, option, value):
    """Trees whose depth (stop_prob) or size (min_prob) is decided on the host cannot be drafted in fixed shapes."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, sharpened_heads(target, head_type), **{option: value})
    assert torch.equal(lm.generate(ids, max_new_tokens=30, fast_path=True), hf_greedy(target, ids, 30))
    assert lm._fast_runner.drafter is lm.drafter
    with pytest.raises(ValueError, match=f"{option}={value}"):
        StaticEagleDrafter(lm.drafter, capacity=64)


def test_a_sequence_longer_than_the_static_drafter_was_sized_for_is_refused(stories260k):
    target, _ = stories260k
    heads = sharpened_heads(target, "eagle")
    static = StaticEagleDrafter(EagleDrafter(heads, DEPTH, TOP_K, NODES, dtype=target.dtype), capacity=8, use_graph=False)
    features, tokens = torch.randn(8, heads.config.hidden_size), torch.arange(8)
    static.propose(features, tokens)
    with pytest.raises(ValueError, match="head cache of .* slots cannot hold"):
        static.propose(features[:5], tokens[:5])
    static.reset()
    with pytest.raises(ValueError, match="cannot hold 9 positions"):  # a prompt too long: refused before any work
        static.propose(torch.randn(9, heads.config.hidden_size), torch.arange(9))
