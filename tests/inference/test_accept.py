"""Acceptance rules: greedy against a slow reference walk, typical thresholds, and exact rejection sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specheads.inference.accept import accept_greedy, accept_greedy_reached, accept_sampling, accept_typical
from specheads.inference.tree import build_tree_buffers


# --- greedy ---------------------------------------------------------------------------------------------
@st.composite
def verified_tree(draw, vocab_size: int = 5, max_nodes: int = 30):
    """(parents, tokens, target_argmax): a random tree whose drafted tokens mostly match the target's argmax."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    argmax = [draw(st.integers(0, vocab_size - 1)) for _ in range(n)]
    tokens = [draw(st.integers(0, vocab_size - 1))]  # the root's token is irrelevant to acceptance
    for i in range(1, n):
        matches = draw(st.integers(0, 9)) < 8  # 80% of drafted tokens equal the target's argmax at the parent
        tokens.append(argmax[parents[i]] if matches else draw(st.integers(0, vocab_size - 1)))
    return parents, tokens, argmax


def reference_accepted_depth(parents: list[int], tokens: list[int], argmax: list[int]) -> int:
    """Slow walk from the root: the deepest node reachable through children that match the argmax."""
    children = {i: [j for j in range(len(parents)) if parents[j] == i] for i in range(len(parents))}
    best, stack = 0, [(0, 0)]
    while stack:
        node, depth = stack.pop()
        best = max(best, depth)
        stack.extend((c, depth + 1) for c in children[node] if tokens[c] == argmax[node])
    return best


@given(verified_tree())
@settings(max_examples=300, deadline=None)
def test_accept_greedy_matches_a_slow_reference_walk(case):
    """The path is a root-to-node chain of correct drafts, as deep as any, and the bonus is the argmax at its end."""
    parents, tokens, argmax = case
    tree = build_tree_buffers(torch.tensor(parents))
    path, bonus = accept_greedy(torch.tensor(tokens), tree, torch.tensor(argmax))
    path = path.tolist()
    assert path[0] == 0
    for parent, child in zip(path, path[1:]):
        assert parents[child] == parent  # a chain down the tree
        assert tokens[child] == argmax[parent]  # of drafts the target agrees with
    assert len(path) - 1 == reference_accepted_depth(parents, tokens, argmax)  # the longest one
    assert bonus.dim() == 0 and int(bonus) == argmax[path[-1]]


@given(verified_tree())
@settings(max_examples=300, deadline=None)
def test_accept_greedy_reached_equals_accept_greedy_scoring_only_accepted_nodes(case):
    """The walk that scores nodes on demand (per-node processing) keeps accept_greedy's path and bonus, asks once
    per depth, for nodes of one depth, and only for accepted nodes (every ancestor's draft right), each once."""
    parents, tokens, argmax = case
    tree = build_tree_buffers(torch.tensor(parents))
    asked: list[list[int]] = []

    def argmax_at(nodes: list[int]) -> torch.Tensor:
        asked.append(list(nodes))
        return torch.tensor([argmax[node] for node in nodes])

    path, bonus = accept_greedy_reached(torch.tensor(tokens), tree, argmax_at)
    expected_path, expected_bonus = accept_greedy(torch.tensor(tokens), tree, torch.tensor(argmax))
    assert path.tolist() == expected_path.tolist() and int(bonus) == int(expected_bonus)
    depth = tree.depth.tolist()
    flat = [node for nodes in asked for node in nodes]
    assert len(flat) == len(set(flat)) and asked[0] == [0]
    for d, nodes in enumerate(asked):
        assert {depth[node] for node in nodes} == {d}
    for node in flat:  # accepted: every node on its chain from the root drafted the parent's argmax
        while node != 0:
            assert tokens[node] == argmax[parents[node]]
            node = parents[node]


def test_accept_greedy_takes_a_later_sibling_and_its_subtree():
    """When the first child is wrong, a later correct sibling's subtree is followed."""
    #        0
    #      / | \
    #     1  2  3        tokens 7, 8, 9   (argmax at 0: 8)
    #     |  |
    #     4  5           tokens 1, 2      (argmax at 2: 2)
    tree = build_tree_buffers(torch.tensor([-1, 0, 0, 0, 1, 2]))
    tokens = torch.tensor([0, 7, 8, 9, 1, 2])
    argmax = torch.tensor([8, 1, 2, 0, 0, 6])
    path, bonus = accept_greedy(tokens, tree, argmax)
    assert path.tolist() == [0, 2, 5]
    assert int(bonus) == 6


def test_accept_greedy_rejecting_everything_returns_the_root_and_its_argmax():
    tree = build_tree_buffers(torch.tensor([-1, 0, 1]))
    path, bonus = accept_greedy(torch.tensor([4, 3, 3]), tree, torch.tensor([1, 3, 2]))
    assert path.tolist() == [0]
    assert int(bonus) == 1


# --- typical ---------------------------------------------------------------------------------------------
def typical_threshold(
    p: torch.Tensor, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3
) -> float:
    entropy = float(-(p * p.clamp_min(1e-10).log()).sum())
    return min(posterior_threshold, posterior_alpha * math.exp(-entropy))


def test_accept_typical_accepts_likely_drafts_and_stops_at_an_unlikely_one():
    """A draft is kept when the target gives it more than min(threshold, alpha * exp(-entropy))."""
    v = 4
    probs = torch.full((4, v), 1.0 / v)
    probs[0] = torch.tensor([0.70, 0.20, 0.05, 0.05])  # node 1 drafts token 1: 0.20 > threshold -> kept
    probs[1] = torch.tensor([0.02, 0.03, 0.90, 0.05])  # node 2 drafts token 0: 0.02 < threshold -> rejected
    assert probs[0, 1] > typical_threshold(probs[0]) and probs[1, 0] < typical_threshold(probs[1])
    tree = build_tree_buffers(torch.tensor([-1, 0, 1, 2]))
    torch.manual_seed(0)
    path, bonus = accept_typical(torch.tensor([3, 1, 0, 2]), tree, probs)
    assert path.tolist() == [0, 1]
    assert 0 <= int(bonus) < v


def test_accept_typical_full_chain_and_bonus_from_the_last_node():
    """Confident drafts along a chain are all kept; the bonus comes from the last node's distribution."""
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    tree = build_tree_buffers(torch.tensor([-1, 0, 1]))
    path, bonus = accept_typical(torch.tensor([2, 1, 2]), tree, probs)
    assert path.tolist() == [0, 1, 2]
    assert int(bonus) == 0


def test_accept_typical_rejects_everything_below_threshold():
    probs = torch.tensor([[0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]])
    tree = build_tree_buffers(torch.tensor([-1, 0, 0]))
    path, bonus = accept_typical(torch.tensor([0, 0, 1]), tree, probs)
    assert path.tolist() == [0]
    assert int(bonus) == 2


# --- exact sampling -----------------------------------------------------------------------------------------
# The fixed tree of the sampling tests (V = 4):
#            0
#        /  |  |  \
#       1   2  3   4      tokens 2, 0, 2 (a duplicate), 3 (probability 0 at the root)
#      / \  |
#     5   6 7             tokens 1, 2, 3
V = 4
PARENTS = [-1, 0, 0, 0, 0, 1, 1, 2]
TOKENS = [0, 2, 0, 2, 3, 1, 2, 3]


def fixed_probs(seed: int = 0) -> torch.Tensor:
    """(N, V) random target distributions; token 3 is impossible at the root (as after top-k / top-p)."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(len(PARENTS), V, generator=generator) + 0.05
    probs[0, 3] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def expected_first_two(probs: torch.Tensor) -> dict[tuple[int, int | None], float]:
    """Exact law of (first emitted token, second emitted token or None when the first is the bonus).

    A lossless rule emits the first token t ~ probs[0]; when t was drafted, the first child holding t is
    accepted (a duplicate later sibling is never preferred) and the second token ~ probs[that child].
    """
    first_child = {}
    for node in range(1, len(PARENTS)):
        if PARENTS[node] == 0:
            first_child.setdefault(TOKENS[node], node)
    law = {}
    for t in range(V):
        if t in first_child:
            for u in range(V):
                law[(t, u)] = float(probs[0, t] * probs[first_child[t], u])
        else:
            law[(t, None)] = float(probs[0, t])
    return law


def emitted_first_two(
    tokens: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor
) -> tuple[int, int | None]:
    emitted = tokens[path[1:]].tolist() + [int(bonus)]
    return emitted[0], (emitted[1] if len(path) > 1 else None)


def test_accept_sampling_first_two_tokens_follow_the_target_exactly(chi_square):
    """Recursive rejection sampling is lossless: (first, second) emitted tokens follow the target's law.

    4000 runs over a fixed tree with sibling candidates, a duplicate sibling and a zero-probability draft;
    Pearson chi-square at p = 0.001 against the exact joint law.
    """
    probs = fixed_probs()
    tree = build_tree_buffers(torch.tensor(PARENTS))
    tokens = torch.tensor(TOKENS)
    torch.manual_seed(1234)
    samples = [emitted_first_two(tokens, *accept_sampling(tokens, tree, probs)) for _ in range(4000)]
    result = chi_square(samples, expected_first_two(probs))
    assert result.bins == 9  # (0|2, u) for 4 u each, (1, None); token 3 is impossible
    assert result.passed, result
    first = [s[0] for s in samples]
    assert chi_square(first, {t: float(probs[0, t]) for t in range(V)}).passed


def test_accept_sampling_chi_square_catches_a_rule_without_the_residual(chi_square):
    """The same test fails a plausible bug: rejecting a candidate without renormalising the residual."""

    def accept_without_residual(tokens, tree, probs):
        children = [i for i in range(1, tree.num_nodes) if int(tree.parents[i]) == 0]
        for child in children:
            if torch.rand(()).item() < float(probs[0, tokens[child]]):
                return torch.tensor([0, child]), torch.multinomial(probs[child], 1)[0]
        return torch.tensor([0]), torch.multinomial(probs[0], 1)[0]  # BUG: not the residual

    probs = fixed_probs()
    tree = build_tree_buffers(torch.tensor(PARENTS))
    tokens = torch.tensor(TOKENS)
    torch.manual_seed(1234)
    samples = [emitted_first_two(tokens, *accept_without_residual(tokens, tree, probs)) for _ in range(4000)]
    assert not chi_square(samples, expected_first_two(probs)).passed


def test_accept_sampling_path_structure():
    """The path starts at the root and follows parent links; a certain draft is always accepted."""
    tree = build_tree_buffers(torch.tensor([-1, 0, 1, 0]))
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    tokens = torch.tensor([0, 1, 2, 0])
    for seed in range(20):
        torch.manual_seed(seed)
        path, bonus = accept_sampling(tokens, tree, probs)
        assert path.tolist() == [0, 1, 2]
        assert int(bonus) == 0


def test_accept_sampling_with_an_impossible_draft_samples_the_bonus_from_the_target():
    """A draft of probability 0 is never accepted; the bonus then follows probs[0] (untouched residual)."""
    tree = build_tree_buffers(torch.tensor([-1, 0]))
    probs = torch.tensor([[0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(20):
        torch.manual_seed(seed)
        path, bonus = accept_sampling(torch.tensor([1, 0]), tree, probs)
        assert path.tolist() == [0]
        assert int(bonus) == 2


@pytest.mark.parametrize("rule", [accept_greedy, accept_sampling, accept_typical])
def test_every_rule_handles_a_root_only_tree(rule):
    """With nothing drafted, every rule returns the root alone and the target's token."""
    tree = build_tree_buffers(torch.tensor([-1]))
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    third = probs.argmax(-1) if rule is accept_greedy else probs
    path, bonus = rule(torch.tensor([2]), tree, third)
    assert path.tolist() == [0]
    assert int(bonus) == 1
