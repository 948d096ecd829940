"""Drafters produce valid trees of the configured shape: EAGLE dynamic trees and Medusa static trees."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from specheads import create_heads
from specheads.inference.drafting import EagleDrafter, MedusaDrafter
from specheads.inference.tree import build_tree_buffers, chain_tree, load_static_tree


@pytest.mark.parametrize(("depth", "top_k", "num_nodes"), [(4, 3, 10), (3, 2, 20), (1, 4, 4), (5, 4, 7)])
def test_eagle_dynamic_tree_shape(tiny_llama, depth, top_k, num_nodes):
    """Root + min(num_nodes, pool) nodes, depth <= tree_depth, a valid topological tree, over several rounds."""
    torch.manual_seed(0)
    heads = create_heads(tiny_llama, "eagle")
    drafter = EagleDrafter(heads, depth=depth, top_k=top_k, num_nodes=num_nodes, dtype=torch.float32)
    drafter.reset()
    hidden = tiny_llama.config.hidden_size
    pool = top_k + (depth - 1) * top_k * top_k
    generator = torch.Generator().manual_seed(0)
    committed = 0
    for length in (6, 1, 3, 2):  # the prefill, then rounds accepting 0, 2 and 1 drafted tokens
        next_tokens = torch.randint(0, 97, (length,), generator=generator)
        tokens, tree = drafter.propose(torch.randn(length, hidden, generator=generator), next_tokens)
        committed += length
        assert drafter.committed == committed
        assert drafter.cache.get_seq_length() >= committed
        assert tokens.shape == (1 + min(num_nodes, pool),) == (tree.num_nodes,)
        assert int(tokens[0]) == int(next_tokens[-1])  # the root is the token the target chose
        assert int(tree.depth.max()) <= depth
        rebuilt = build_tree_buffers(tree.parents)  # raises unless topologically ordered and rooted at 0
        assert torch.equal(rebuilt.ancestors, tree.ancestors)
        assert bool(((tokens >= 0) & (tokens < 97)).all())
        siblings = {}
        for node in range(1, tree.num_nodes):
            siblings.setdefault(int(tree.parents[node]), []).append(int(tokens[node]))
        assert all(len(set(s)) == len(s) for s in siblings.values()), "siblings are distinct top-k tokens"


def test_eagle_head_cache_across_rounds_equals_one_pass_over_the_committed_sequence(tiny_llama):
    """After each round the head's cache (committed part) equals one causal pass over everything committed.

    This checks that last round's draft entries are cropped and the new positions are fed at the right
    positions; the root's children are then the head's top-k tokens at the last committed position.
    """
    torch.manual_seed(0)
    heads = create_heads(tiny_llama, "eagle")
    top_k = 3
    drafter = EagleDrafter(heads, depth=3, top_k=top_k, num_nodes=8, dtype=torch.float32)
    drafter.reset()
    generator = torch.Generator().manual_seed(1)
    features, next_tokens = [], []
    for length in (5, 3, 1, 4):
        features.append(torch.randn(length, tiny_llama.config.hidden_size, generator=generator))
        next_tokens.append(torch.randint(0, 97, (length,), generator=generator))
        tokens, tree = drafter.propose(features[-1], next_tokens[-1])
        f, t = torch.cat(features), torch.cat(next_tokens)
        n = f.shape[0]
        causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        fresh = DynamicCache()
        with torch.no_grad():
            predicted = heads(f[None], t[None], torch.arange(n)[None], causal, fresh)[0]
            top = set(heads.logits(predicted[-1]).topk(top_k).indices.tolist())
        for drafted, reference in zip(drafter.cache.layers, fresh.layers):
            torch.testing.assert_close(drafted.keys[:, :, :n], reference.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(drafted.values[:, :, :n], reference.values, atol=1e-5, rtol=0)
        assert set(tokens[tree.parents == 0].tolist()) <= top


def test_eagle_drafter_rejects_zero_sizes(tiny_llama):
    heads = create_heads(tiny_llama, "eagle")
    with pytest.raises(ValueError, match="tree_top_k=0"):
        EagleDrafter(heads, depth=3, top_k=0, num_nodes=5, dtype=torch.float32)


@pytest.mark.parametrize("tree_name", ["medusa_default", "medusa_small"])
def test_medusa_fills_the_static_tree_with_each_heads_top_choices(tiny_llama, tree_name):
    """Node at depth d with rank r holds head (d-1)'s r-th most likely token; the shape is the static tree's."""
    torch.manual_seed(0)
    heads = create_heads(tiny_llama, "medusa")
    with torch.no_grad():  # distinct heads, so a mix-up of head indices would show
        for head in heads.heads:
            head[-1].weight.normal_()
    static = load_static_tree(tree_name)
    drafter = MedusaDrafter(heads, static, dtype=torch.float32)
    features = torch.randn(4, tiny_llama.config.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens, tree = drafter.propose(features, torch.tensor([5, 6, 7, 8]))
    assert tokens.shape == static.parents.shape
    assert torch.equal(tree.parents, static.parents)
    assert int(tokens[0]) == 8
    with torch.no_grad():
        logits = heads(features[-1:][None])[:, 0, 0]  # (K, V)
    ranked = logits.argsort(dim=-1, descending=True)
    for node in range(1, tokens.shape[0]):
        assert int(tokens[node]) == int(ranked[int(static.depth[node]) - 1, int(static.choices[node])])


def test_medusa_drafter_refuses_a_tree_deeper_than_its_heads(tiny_llama):
    heads = create_heads(tiny_llama, "medusa", num_heads=2)
    with pytest.raises(ValueError, match="depth 3.*2 heads"):
        MedusaDrafter(heads, chain_tree(3), dtype=torch.float32)


def test_best_subtree_with_min_prob_keeps_exactly_the_likely_nodes():
    """A hand-made pool: with a threshold, exactly the nodes whose path log-probability reaches it are kept (in
    pool order, a valid tree); with a threshold above every node, the best one alone."""
    from specheads.inference.drafting import DraftPool

    log = torch.log
    pool = DraftPool(log(torch.tensor([0.6, 0.3])), torch.tensor([10, 11]), torch.zeros(4))  # depth 1
    pool.feed()
    # Frontier (10, 11) each proposes 2 children: conditional probabilities below, cumulative 0.6*0.5 = 0.3 ...
    pool.expand(torch.zeros(2, 4), log(torch.tensor([[0.5, 0.1], [0.9, 0.05]])), torch.tensor([[20, 21], [22, 23]]))
    path_probs = {10: 0.6, 11: 0.3, 20: 0.3, 21: 0.06, 22: 0.27, 23: 0.015}
    root = torch.tensor([1])
    for threshold in (0.25, 0.05, 0.01):
        tokens, parents = pool.best_subtree(6, root, math.log(threshold))
        expected = {t for t, p in path_probs.items() if p >= threshold}
        assert set(tokens[1:].tolist()) == expected
        build_tree_buffers(parents)  # a valid topological tree rooted at 0
        for node in range(1, tokens.shape[0]):  # every kept child hangs under its real parent
            parent_token = int(tokens[int(parents[node])])
            assert parent_token == {20: 10, 21: 10, 22: 11, 23: 11}.get(int(tokens[node]), 1)
    tokens, _ = pool.best_subtree(3, root, math.log(0.05))  # num_nodes still caps the tree
    assert tokens.tolist() == [1, 10, 11, 20]
    tokens, parents = pool.best_subtree(6, root, math.log(0.9))
    assert tokens.tolist() == [1, 10] and parents.tolist() == [-1, 0]


def test_eagle_drafter_with_min_prob_drafts_a_pruned_version_of_the_same_tree(tiny_llama):
    """Same heads and inputs: the pruned tree is the unpruned one's most likely nodes, at least one, and smaller."""
    torch.manual_seed(0)
    heads = create_heads(tiny_llama, "eagle")
    full = EagleDrafter(heads, depth=4, top_k=3, num_nodes=20, dtype=torch.float32)
    pruned = EagleDrafter(heads, depth=4, top_k=3, num_nodes=20, dtype=torch.float32, min_prob=0.002)
    generator = torch.Generator().manual_seed(2)
    sizes = []
    for length in (6, 2, 1, 3):
        features = torch.randn(length, tiny_llama.config.hidden_size, generator=generator)
        next_tokens = torch.randint(0, 97, (length,), generator=generator)
        full_tokens, full_tree = full.propose(features, next_tokens)
        tokens, tree = pruned.propose(features, next_tokens)

        def paths(tokens, tree):  # every node as its token path from the root
            out = []
            for node in range(tree.num_nodes):
                path, n = [], node
                while n >= 0:
                    path.append(int(tokens[n]))
                    n = int(tree.parents[n])
                out.append(tuple(reversed(path)))
            return out

        assert 2 <= tree.num_nodes <= full_tree.num_nodes
        assert set(paths(tokens, tree)) <= set(paths(full_tokens, full_tree))
        sizes.append(tree.num_nodes)
    assert min(sizes) < 21, "untrained heads are unsure: some round drops nodes"


@pytest.mark.parametrize("min_prob", [-0.1, 1.0])
def test_eagle_drafter_rejects_a_min_prob_outside_0_1(tiny_llama, min_prob):
    heads = create_heads(tiny_llama, "eagle")
    with pytest.raises(ValueError, match=f"tree_min_prob={min_prob}"):
        EagleDrafter(heads, depth=3, top_k=2, num_nodes=5, dtype=torch.float32, min_prob=min_prob)
