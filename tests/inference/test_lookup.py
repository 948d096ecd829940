"""Prompt lookup grafted onto the draft tree (inference/lookup.py): the n-gram index, the trie graft, and exactness
of every decoding path with it (greedy identity on several targets, the fast path, batches, the sampling law)."""

from __future__ import annotations

import copy

import pytest
import torch

from specheads import HEAD_TYPES, SpeculativeLM, create_heads
from specheads.inference.lookup import LookupDrafter, NgramIndex, graft_chains
from specheads.inference.tree import append_chain, build_tree_buffers

from ..conftest import build_tiny_target
from .conftest import TINY_PROMPT, hf_greedy, left_pad, load_sampling_harness, make_heads, record_tree_sizes


# --- the n-gram index ---------------------------------------------------------------------------------------
def test_the_latest_occurrence_of_the_longest_suffix_wins():
    index = NgramIndex(max_ngram=3, min_ngram=2)
    index.extend([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3])
    # suffix (1, 2, 3) occurred at 0 (followed by 9 9 2 ...); the shorter (2, 3) more recently at 5 (7 8 ...):
    # the longest match wins
    assert index.continuation(4) == [9, 9, 2, 3]
    index.extend([4, 2, 3])  # now (4, 2, 3) never occurred before: (2, 3) last started at 11, followed by 4 2 3
    assert index.continuation(2) == [4, 2]
    assert index.continuation(10) == [4, 2, 3, 4, 2, 3, 4, 2, 3, 4]  # running into the suffix: a loop, repeated


def test_no_guess_without_a_long_enough_match():
    index = NgramIndex(max_ngram=3, min_ngram=2)
    assert index.continuation(5) == []
    index.extend([1, 2, 3, 4])
    assert index.continuation(5) == []  # (3, 4) and (2, 3, 4) never occurred before
    index.extend([9, 4])
    assert index.continuation(5) == []  # the single token 4 recurs, but min_ngram is 2
    unigrams = NgramIndex(max_ngram=1, min_ngram=1)
    unigrams.extend([1, 2, 3, 4, 9, 4])
    assert unigrams.continuation(3) == [9, 4, 9]  # 4 -> 9 -> 4: the loop goes on


def test_loops_are_followed():
    index = NgramIndex(max_ngram=3, min_ngram=2)
    index.extend([5, 6, 7, 5, 6, 7, 5, 6])
    assert index.continuation(2) == [7, 5]
    assert index.continuation(7) == [7, 5, 6, 7, 5, 6, 7]  # the latest (7, 5, 6) match is one loop back: it repeats


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(2, 3), (3, 0)])
def test_bad_ngram_sizes_are_refused(max_ngram, min_ngram):
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramIndex(max_ngram, min_ngram)


# --- the graft ----------------------------------------------------------------------------------------------
def test_the_guess_reuses_drafted_nodes_and_extends_the_deepest_match():
    # root 10 -> {11 -> {13}, 12}
    tokens, tree = torch.tensor([10, 11, 12, 13]), build_tree_buffers(torch.tensor([-1, 0, 0, 1]))
    new_tokens, new_tree, nodes = graft_chains(tokens, tree, [[11, 13, 14, 15]])
    assert new_tokens.tolist() == [10, 11, 12, 13, 14, 15] and nodes == [[1, 3, 4, 5]]
    assert new_tree.parents.tolist() == [-1, 0, 0, 1, 3, 4]  # 14 hangs under the drafted 13
    build_tree_buffers(new_tree.parents)  # a valid topologically ordered tree (check=True raises otherwise)
    new_tokens, new_tree, nodes = graft_chains(tokens, tree, [[12, 11]])
    assert nodes == [[2, 4]]
    assert new_tokens.tolist() == [10, 11, 12, 13, 11] and new_tree.parents.tolist() == [-1, 0, 0, 1, 2]
    new_tokens, new_tree, _ = graft_chains(tokens, tree, [[16]])
    assert new_tokens.tolist() == [10, 11, 12, 13, 16] and new_tree.parents.tolist() == [-1, 0, 0, 1, 0]


def test_several_chains_share_the_nodes_earlier_ones_added():
    """Prompt lookup's guess and the corpus' chains in one graft: a later chain walks the nodes an earlier one added
    (the trie the tree is, grown), and the buffers equal those built from scratch."""
    tokens, tree = torch.tensor([10, 11, 12, 13]), build_tree_buffers(torch.tensor([-1, 0, 0, 1]))
    new_tokens, new_tree, nodes = graft_chains(tokens, tree, [[12, 20, 21], [12, 20, 22], [11, 13], [30]])
    assert new_tokens.tolist() == [10, 11, 12, 13, 20, 21, 22, 30]
    assert nodes == [[2, 4, 5], [2, 4, 6], [1, 3], [7]]  # where each chain's tokens sit
    assert new_tree.parents.tolist() == [-1, 0, 0, 1, 2, 4, 4, 0]
    rebuilt = build_tree_buffers(new_tree.parents)
    assert torch.equal(new_tree.ancestors, rebuilt.ancestors) and torch.equal(new_tree.depth, rebuilt.depth)


def test_a_guess_the_heads_drafted_adds_nothing():
    tokens, tree = torch.tensor([10, 11, 12, 13]), build_tree_buffers(torch.tensor([-1, 0, 0, 1]))
    new_tokens, new_tree, nodes = graft_chains(tokens, tree, [[11, 13]])
    assert new_tokens is tokens and new_tree is tree and nodes == [[1, 3]]


@pytest.mark.parametrize(("parents", "parent", "length"), [
    ([-1, 0, 0, 1], 3, 3), ([-1, 0, 0, 1], 0, 1), ([-1], 0, 4), ([-1, 0, 1, 1, 0, 4], 2, 2),
])
def test_append_chain_equals_building_the_grafted_tree(parents, parent, length):
    """The chain's buffers derived from the tree's own equal those `build_tree_buffers` computes from scratch."""
    tree = build_tree_buffers(torch.tensor(parents), dtype=torch.float32)
    n = len(parents)
    grafted = append_chain(tree, parent, length)
    reference = build_tree_buffers(torch.tensor(parents + [parent] + list(range(n, n + length - 1))))
    for name in ("parents", "depth", "ancestors", "attention_bias"):
        assert torch.equal(getattr(grafted, name), getattr(reference, name)), name
    assert torch.equal(grafted.retrieve_indices, reference.retrieve_indices)


class FixedTreeDrafter:
    """Always drafts root -> {11, 12}; records nothing (stands in for the heads' drafter)."""

    def reset(self) -> None:
        pass

    def propose(self, features, next_tokens):
        tokens = torch.cat([next_tokens[-1:], torch.tensor([11, 12])])
        return tokens, build_tree_buffers(torch.tensor([-1, 0, 0]))


def test_the_drafter_reads_every_committed_token():
    """The context is what propose is told: prompt[1:] on the first call, then the accepted tokens."""
    drafter = LookupDrafter(FixedTreeDrafter(), num_tokens=4)
    drafter.reset()
    features = torch.zeros(5, 2)
    tokens, tree = drafter.propose(features, torch.tensor([3, 4, 5, 3, 4]))  # context [3, 4, 5, 3, 4]
    assert tokens.tolist() == [4, 11, 12, 5, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 0, 0, 3, 4, 5]  # loop
    tokens, tree = drafter.propose(features[:2], torch.tensor([9, 12]))  # context ... 4, 9, 12: no match
    assert tokens.tolist() == [12, 11, 12] and tree.num_nodes == 3
    drafter.reset()  # a new sequence forgets the old context
    assert drafter.propose(features[:2], torch.tensor([9, 12]))[0].tolist() == [12, 11, 12]


def test_the_guess_grows_while_whole_guesses_are_accepted():
    """lookup_max_tokens: a guess accepted whole doubles the next one's length (up to the cap); a guess accepted in
    part sets it back."""
    drafter = LookupDrafter(FixedTreeDrafter(), num_tokens=2, max_tokens=5)
    drafter.reset()
    loop = [5, 6, 7, 8] * 6  # the context repeats: the guess continues the loop
    features = torch.zeros(len(loop), 2)

    def guess_after(accepted: list[int]) -> list[int]:
        tokens, _ = drafter.propose(features[: len(accepted)], torch.tensor(accepted))
        return drafter.guess

    assert guess_after(loop) == [5, 6] and drafter.length == 2  # the first round: the base length
    assert guess_after([5, 6, 7]) == [8, 5, 6, 7]  # [5, 6] accepted whole (+ bonus 7): twice as long
    assert guess_after([8, 5, 6, 7, 8]) == [5, 6, 7, 8, 5]  # whole again: 8, capped at 5
    assert guess_after([5, 6, 7, 8, 5, 6]) == [7, 8, 5, 6, 7]  # whole again: stays at the cap
    assert guess_after([7, 8, 9]) == []  # accepted in part: back to 2, and 8, 9 never occurred before
    assert drafter.length == 2
    drafter.reset()
    assert guess_after([5, 6, 7, 5, 6]) == [7, 5]  # a fresh sequence starts at the base length again
    assert guess_after([7, 5, 6]) == [7, 5, 6, 7] and drafter.length == 4


def test_a_round_without_a_guess_sets_the_length_back():
    drafter = LookupDrafter(FixedTreeDrafter(), num_tokens=3, max_tokens=12)
    drafter.reset()
    features = torch.zeros(6, 2)
    drafter.propose(features, torch.tensor([4, 5, 6, 4, 5]))  # (4, 5) occurred at 0: guess [6, 4, 5]
    assert drafter.guess == [6, 4, 5]
    drafter.propose(features[:4], torch.tensor([6, 4, 5, 9]))  # accepted whole: 6 next; (5, 9) unseen: no guess
    assert drafter.length == 6 and drafter.guess == []
    drafter.propose(features[:2], torch.tensor([4, 5]))  # no guess last round: back to the base length
    assert drafter.length == 3


# --- exactness ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_greedy_output_is_the_targets_and_the_guess_pays(tiny_target_factory, family, head_type):
    """Tiny random targets loop: prompt lookup guesses right often, so untrained heads accept far more with it,
    and the output stays the target's greedy one token for token."""
    target, ids = tiny_target_factory(family), torch.tensor([TINY_PROMPT])
    heads = make_heads(target, head_type)
    expected = hf_greedy(target, ids, 40)
    plain = SpeculativeLM(target, heads)
    assert torch.equal(plain.generate(ids, max_new_tokens=40), expected)
    lm = SpeculativeLM(target, heads, lookup_tokens=6)
    sizes = record_tree_sizes(lm)
    assert torch.equal(lm.generate(ids, max_new_tokens=40), expected)
    assert max(sizes) > min(sizes)  # guesses were grafted in some rounds, not in others
    assert lm.last_stats["mean_accepted"] > plain.last_stats["mean_accepted"] + 0.2


def test_stories260k_repeating_prompt(stories260k):
    """The embedded target, EAGLE heads with early stopping and pruning: identical output, more accepted."""
    target, tokenizer = stories260k
    ids = tokenizer("Tom had a red ball. Tom had a red ball. Tom had a", return_tensors="pt").input_ids
    torch.manual_seed(0)
    heads = create_heads(target, "eagle", tree_depth=4, tree_top_k=3, tree_num_nodes=10, tree_stop_prob=0.01,
                         tree_min_prob=0.01)
    expected = hf_greedy(target, ids, 60)
    plain = SpeculativeLM(target, heads)
    assert torch.equal(plain.generate(ids, max_new_tokens=60), expected)
    lm = SpeculativeLM(target, heads, lookup_tokens=8)
    assert torch.equal(lm.generate(ids, max_new_tokens=60), expected)
    assert lm.last_stats["mean_accepted"] > plain.last_stats["mean_accepted"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_a_growing_guess_keeps_the_output_and_covers_loops_in_fewer_rounds(tiny_target_factory, family, head_type):
    """lookup_max_tokens: the tiny targets fall into loops, where whole guesses are accepted and the guess grows;
    the output is still the target's greedy one, in fewer rounds than with the fixed length."""
    target, ids = tiny_target_factory(family), torch.tensor([TINY_PROMPT])
    heads = make_heads(target, head_type)
    expected = hf_greedy(target, ids, 80)
    fixed = SpeculativeLM(target, heads, lookup_tokens=2)
    assert torch.equal(fixed.generate(ids, max_new_tokens=80), expected)
    growing = SpeculativeLM(target, heads, lookup_tokens=2, lookup_max_tokens=16)
    sizes = record_tree_sizes(growing)
    assert torch.equal(growing.generate(ids, max_new_tokens=80), expected)
    assert max(sizes) > min(sizes) + 2  # some guess grew beyond the base length
    assert growing.last_stats["rounds"] < fixed.last_stats["rounds"]


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_the_fast_path_with_lookup(tiny_target_factory, head_type):
    """On the static-cache path the heads' drafter goes fixed-shape (EAGLE) and the guess is grafted around it;
    trees are padded to the heads' nodes + lookup_tokens."""
    target, ids = tiny_target_factory("qwen2"), torch.tensor([TINY_PROMPT])
    lm = SpeculativeLM(target, make_heads(target, head_type), lookup_tokens=5)
    out = lm.generate(ids, max_new_tokens=40, fast_path=True)
    assert lm.last_stats["fast_path"]
    assert torch.equal(out, hf_greedy(target, ids, 40))
    runner = lm._fast_runner
    assert isinstance(runner.drafter, LookupDrafter)
    heads_nodes = lm.drafter.drafter.num_nodes + 1 if head_type != "medusa" else lm.drafter.drafter.buffers.num_nodes
    assert runner.fixed_slots == heads_nodes + 5
    assert lm.last_stats["mean_accepted"] > 1.3
    lm.configure_lookup(5, lookup_max_tokens=12)  # a growing guess: padded to the largest one
    assert torch.equal(lm.generate(ids, max_new_tokens=40, fast_path=True), hf_greedy(target, ids, 40))
    assert lm._fast_runner.fixed_slots == heads_nodes + 12


def test_batched_rows_with_lookup():
    """Batched verification (each row's forked drafter keeps its own context) equals the rows alone."""
    target = build_tiny_target("llama", seed=5)
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, "eagle", tree_depth=3, tree_top_k=3, tree_num_nodes=8),
                       lookup_tokens=6)
    prompts = [[1, 5, 9], [1, 7, 3, 8, 2, 11, 4], [1, 6, 6, 6, 21]]
    ids, mask = left_pad(prompts)
    batched = lm.generate(ids, attention_mask=mask, max_new_tokens=30, batched=True)
    assert lm.last_stats["batched_forwards"] < lm.last_stats["target_forwards"]
    for i, prompt in enumerate(prompts):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, ids.shape[1] :], alone[0, len(prompt) :]), f"row {i}"




@pytest.mark.parametrize(("head_type", "max_tokens"), [("eagle", None), ("eagle3", None), ("eagle", 4)])
def test_sampling_with_lookup_follows_the_exact_joint_law(tiny_target_factory, chi_square, head_type, max_tokens):
    """Guessed branches are deterministic candidates like drafted ones: the first 3 sampled tokens still follow the
    target's exact law. Single-token matches (lookup_max_ngram=1) over a 6-token vocabulary graft often. A growing
    guess (max_tokens) depends only on tokens already committed, so it is a deterministic candidate too."""
    harness = load_sampling_harness("sampling_harness_for_lookup")
    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=harness.V, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # harness.six_token_target
    law = harness.ExactLaw(target, temperature=1.0)
    heads = harness.untrained_eagle_heads(target, head_type)
    lm = SpeculativeLM(target, heads, lookup_tokens=3 if max_tokens is None else 1, lookup_max_ngram=1,
                       lookup_max_tokens=max_tokens)
    sizes = record_tree_sizes(lm)
    samples = harness.sample_first_three(lm, 1200, seed=3, temperature=1.0)
    result = chi_square(samples, law.joint())
    assert result.passed, result
    heads_nodes = min(sizes)
    assert sum(size > heads_nodes for size in sizes) > 0.05 * len(sizes), "guesses were rarely grafted"


# --- configuration ------------------------------------------------------------------------------------------
def test_lookup_survives_tree_changes_and_is_reported(stories260k):
    target, _ = stories260k
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, "eagle"), lookup_tokens=7)
    assert isinstance(lm.drafter, LookupDrafter)
    lm.configure_tree(tree_depth=3, tree_top_k=2, tree_num_nodes=5)  # what --tree auto does per candidate
    description = lm.tree_description()
    assert description["nodes"] == 5 and description["lookup_tokens"] == 7 and description["lookup_max_ngram"] == 3
    assert description["lookup_max_tokens"] == 7  # a fixed length unless asked
    lm.configure_lookup(7, lookup_max_tokens=28)
    assert lm.tree_description()["lookup_max_tokens"] == 28
    lm.configure_lookup(0)
    assert not isinstance(lm.drafter, LookupDrafter) and lm.tree_description()["lookup_tokens"] == 0
    assert lm.drafter.num_nodes == 5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lookup_tokens": -1}, "lookup_tokens=-1 must be an integer >= 0"),
    ({"lookup_tokens": 2.5}, "lookup_tokens=2.5 must be an integer >= 0"),
    ({"lookup_tokens": 4, "lookup_max_ngram": 0}, "lookup_max_ngram=0 must be an integer >= 1"),
    ({"lookup_tokens": 4, "lookup_max_tokens": 3}, "lookup_max_tokens=3 must be None or an integer >= lookup_tokens=4"),
    ({"lookup_max_tokens": 8}, "lookup_max_tokens=8 must be None or an integer >= lookup_tokens=0"),
])
def test_bad_lookup_settings_are_refused(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        SpeculativeLM(tiny_llama, make_heads(tiny_llama, "medusa"), **kwargs)
