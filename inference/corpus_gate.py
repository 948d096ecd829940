"""The corpus gate: graft corpus lookup's guesses only where they pay for their verification.

A grafted node costs verification: on 2 CPU threads SmolLM2's verification grows by 0.7-2.4 ms per node in trees of
8-32 tokens, while a token costs ~37 ms at tau 2.7, so a corpus node must be accepted 2-6% of the time to pay (on a
GPU, nodes are nearly free up to the device's width). Where the corpus predicts the text (one task over new inputs), its
nodes earn far more (0.2 accepted tokens per node on session 30's email task); where it does not (MT-bench with a
corpus of ShareGPT answers) they earn ~0.01 and slow decoding down. So what they earn is measured, in two tallies
of accepted tokens per grafted node (only the corpus' own nodes: those the heads and prompt lookup had not drafted):

- the request's own (`CorpusGate.request`, fresh per request and batch row, a short memory): a request that is
  being guessed well keeps grafting;
- the traffic's, by the length of the context's match in the corpus (`CorpusLookup.gain_by_match`, shared by every
  request, a long memory): a long match is followed by what followed it before far more often than a 2-token one,
  and how much more depends on the traffic (on MT-bench, matches of 2-3 tokens earned 0.004 per node and matches of
  8 or more 0.6; on the email task, 0.07 and 0.6).

A round grafts the guesses when either tally is open (at least `min_gain`); a closed tally still lets one round in
`PROBE_EVERY` through, so it notices when the corpus starts paying. Which candidates are verified never changes what
is accepted: outputs stay exact. (A row whose tree a batch's node budget cut still counts what its guesses would
have got: the tallies measure whether the corpus predicts the text.) Replaying session 31's traces of corpus nodes
(16 MT-bench prompts, 24-prompt email and extract tasks), this grafts 16% of the nodes on MT-bench and all of them on
the two tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_GAIN = 0.03  # accepted tokens per grafted node the corpus' guesses must earn (about a CPU's break-even)
REQUEST_DECAY = 0.8  # per grafting round: a request's tally weighs about its last five grafting rounds
TRAFFIC_DECAY = 0.97  # the traffic's tallies weigh about the last 30 grafting rounds of their match length
PRIOR_NODES = 8.0  # a tally starts open: a prior of break-even over this many nodes
PROBE_EVERY = 16  # while closed, one round in this many is let through anyway


class GainTally:
    """Accepted tokens per grafted node, decayed sums from an open prior, against `min_gain` (0: always open)."""

    def __init__(self, min_gain: float, decay: float) -> None:
        self.min_gain, self.decay = min_gain, decay
        self.gained, self.grafted = min_gain * PRIOR_NODES, PRIOR_NODES
        self.closed_rounds = 0

    @property
    def is_open(self) -> bool:
        return self.min_gain <= 0 or self.gained >= self.min_gain * self.grafted

    def admits(self) -> bool:
        """Graft this round? While open; when closed, one round in `PROBE_EVERY`."""
        if self.is_open:
            self.closed_rounds = 0
            return True
        self.closed_rounds += 1
        return self.closed_rounds % PROBE_EVERY == 0

    def add(self, grafted: int, gained: int) -> None:
        """A round that grafted `grafted` nodes, `gained` of them accepted."""
        self.gained = self.decay * self.gained + gained
        self.grafted = self.decay * self.grafted + grafted


class CorpusGate:
    """One request's gate (a `LookupDrafter` keeps it): its own tally, and the corpus' tallies by match length.

    Args:
        min_gain: the tallies' threshold, accepted tokens per grafted node.
        gain_by_match: the traffic's tallies, by the match length's bit length (2-3, 4-7, 8-15, 16 tokens), shared by
            every request of the corpus (`CorpusLookup.gain_by_match`); filled in as lengths occur.
    """

    def __init__(self, min_gain: float, gain_by_match: dict[int, GainTally]) -> None:
        self.min_gain = min_gain
        self.request = GainTally(min_gain, REQUEST_DECAY)
        self.gain_by_match = gain_by_match
        # last round's graft: its chains, the tree nodes holding their tokens, the first corpus-own node, its nodes
        # and the traffic tally of its match length
        self.pending: tuple[list[list[int]], list[list[int]], int, int, GainTally] | None = None
        self.match_tally: GainTally | None = None  # this round's, set by `admits`

    def admits(self, match_length: int) -> bool:
        """Graft this round's guesses, found by a match of `match_length` tokens? When either tally admits them."""
        key = match_length.bit_length()
        if key not in self.gain_by_match:
            self.gain_by_match[key] = GainTally(self.min_gain, TRAFFIC_DECAY)
        self.match_tally = self.gain_by_match[key]
        request_admits, traffic_admits = self.request.admits(), self.match_tally.admits()  # both count closed rounds
        return request_admits or traffic_admits

    def grafted_round(self, chains: list[list[int]], chain_nodes: list[list[int]], first_node: int,
                      num_nodes: int) -> None:
        """This round's grafted corpus `chains`, the tree nodes holding their tokens (`graft_chains`' chain_nodes) and
        the tree's node count: nodes from `first_node` on are the corpus' own (the heads' and prompt lookup's come
        first)."""
        if num_nodes > first_node and self.match_tally is not None:
            self.pending = (chains, chain_nodes, first_node, num_nodes - first_node, self.match_tally)
        else:
            self.pending = None
        self.match_tally = None

    def observe(self, path: Sequence[int]) -> None:
        """Last round's accepted tokens after the root (without the bonus): the corpus' own nodes among them are what
        its grafted nodes earned, for both tallies."""
        if self.pending is None:
            return
        chains, chain_nodes, first_node, cost, match_tally = self.pending
        earned = 0
        for chain, nodes in zip(chains, chain_nodes):
            agreed = 0
            while agreed < min(len(chain), len(path)) and chain[agreed] == path[agreed]:
                agreed += 1
            earned = max(earned, sum(node >= first_node for node in nodes[:agreed]))
        self.request.add(cost, earned)
        match_tally.add(cost, earned)
        self.pending = None
