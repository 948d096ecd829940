"""The corpus gate: what grafted corpus nodes earn, the two tallies (the request's, the traffic's by match length),
probing while closed, and decoding with a corpus that never pays (left out, outputs unchanged)."""

from __future__ import annotations

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.corpus_gate import PROBE_EVERY, CorpusGate, GainTally
from specheads.inference.corpus_lookup import CorpusLookup

from .conftest import TINY_PROMPT, hf_greedy, make_heads, record_tree_sizes
from .test_corpus_lookup import heads_tree_nodes


def zeroed(tally: GainTally) -> GainTally:
    tally.gained, tally.grafted = 0.0, 0.0
    return tally


def test_the_corpus_own_nodes_on_the_accepted_path_are_what_it_earned():
    traffic: dict[int, GainTally] = {}
    gate = CorpusGate(0.05, traffic)
    # chain [5, 6, 7]: 5 is a heads' node (2), 6 and 7 the corpus' own (9, 10); a second chain [5, 8] (2, 11)
    for path, earned in [([5, 6, 7, 8], 2), ([5, 6], 1), ([5, 8], 1), ([5], 0), ([4, 6], 0)]:
        gate.admits(match_length=5)  # picks the round's traffic tally (whether it admits does not matter here)
        zeroed(gate.request), zeroed(traffic[3])  # 5 = 0b101: the tally of matches of 4-7 tokens
        gate.grafted_round([[5, 6, 7], [5, 8]], [[2, 9, 10], [2, 11]], first_node=9, num_nodes=12)
        gate.observe(path)
        for tally in (gate.request, traffic[3]):
            assert (tally.gained, tally.grafted) == (earned, 3), path
    gate.observe([5, 6, 7])  # nothing pending: no change
    assert (gate.request.gained, gate.request.grafted) == (0, 3)
    gate.admits(5)
    gate.grafted_round([], [], first_node=9, num_nodes=9)  # a round that grafted nothing earns and costs nothing
    gate.observe([5, 6])
    assert (gate.request.gained, gate.request.grafted) == (0, 3) and set(traffic) == {3}


def test_a_tally_closes_when_nothing_is_accepted_probes_and_reopens():
    tally = GainTally(min_gain=0.1, decay=0.8)
    assert tally.admits()  # the prior: open
    rounds = 0
    while tally.admits() and rounds < 100:  # rounds that graft 8 nodes and earn nothing
        tally.add(8, 0)
        rounds += 1
    assert 1 <= rounds <= 3 and not tally.is_open
    admitted = [tally.admits() for _ in range(4 * PROBE_EVERY - 1)]  # (the closed round above was the first)
    assert sum(admitted) == 4 and admitted[PROBE_EVERY - 2]  # one round in PROBE_EVERY is let through
    tally.add(8, 8)  # that round's nodes were all accepted
    assert tally.is_open and tally.admits()
    always = GainTally(min_gain=0, decay=0.8)
    always.add(100, 0)
    assert always.is_open


def test_either_tally_admits_a_round():
    """A request guessed well grafts after any match; a match length that pays in the traffic grafts in any request."""
    traffic: dict[int, GainTally] = {}
    first = CorpusGate(0.1, traffic)
    assert first.admits(2)  # both tallies start open
    zeroed(first.request).add(10, 0)
    zeroed(traffic[2]).add(10, 0)  # nothing earned, in this request or after matches of 2-3 tokens
    assert not first.admits(2)  # both closed (their first closed round: no probe)
    assert first.admits(12)  # a length not seen yet: its tally starts open
    zeroed(traffic[4]).add(10, 5)  # matches of 8-15 tokens pay in the traffic
    second = CorpusGate(0.1, traffic)
    zeroed(second.request).add(10, 0)
    assert second.admits(9) and not second.admits(3)
    zeroed(second.request).add(10, 5)
    assert second.admits(3)  # the request's own tally is open


def test_a_corpus_that_guesses_wrong_is_soon_left_out(tiny_target_factory):
    """A corpus whose every match is followed by a wrong token: ungated, it is grafted every round for nothing; gated,
    in few rounds (the prior's, then one in `PROBE_EVERY`). Both outputs are the target's."""
    target, ids = tiny_target_factory("llama"), torch.tensor([TINY_PROMPT])
    expected = hf_greedy(target, ids, 40)
    answer = expected[0].tolist()
    vocab = target.config.vocab_size
    # after each of the answer's bigrams, a wrong next token (and more after it)
    wrong = [[answer[i - 1], answer[i], (answer[i + 1] + 1) % vocab, 3, 4] for i in range(1, len(answer) - 1)]
    grafted = {}
    for min_gain in (0.0, 0.03):
        corpus = CorpusLookup(wrong, min_gain=min_gain)
        lm = SpeculativeLM(target, make_heads(target, "eagle"), lookup_corpus=corpus, corpus_tokens=4)
        sizes = record_tree_sizes(lm)
        assert torch.equal(lm.generate(ids, max_new_tokens=40), expected)
        grafted[min_gain] = sum(size > heads_tree_nodes(lm) for size in sizes)
        if min_gain:
            assert not any(tally.is_open for tally in corpus.gain_by_match.values())
    assert grafted[0.0] > 30 and grafted[0.03] <= 6, grafted


def test_bad_gate_setting_is_refused():
    for bad in (-0.1, float("inf"), "0.1"):
        with pytest.raises(ValueError, match="min_gain=.* must be a number >= 0"):
            CorpusLookup([[1, 2]], min_gain=bad)
