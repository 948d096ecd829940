"""`max_round_nodes="auto"`: each batched round's tree size per row, chosen for the most tokens per second.

A batched round costs its drafting (per row) and ONE verification forward over rows x nodes tokens, padded. Where
that forward's cost grows with its tokens (a CPU: SmolLM2 on 2 threads took 40 ms for 1 token, 56 for 16, 160 for 128),
speculation pays less as the batch grows, and past some batch size plain decoding steps win; where it is flat up
to hundreds of tokens (a GPU), full trees pay at every batch size. A fixed node budget is right for one device and
one batch size; this picks the nodes per row before every round, for the batch at hand (the goodput idea of
SmartSpec, Liu et al. 2024, for trees):

    tokens/s(m) = R (1 + A(m)) / (R d [m > 1] + beta f(R w(m)))       R rows, m nodes per row (the root included)

- f(T): the target's verification milliseconds for T tokens, measured once per `SpeculativeLM` on a dummy prompt
  (`autotune.verification_cost_ms`), interpolated linearly; beta: measured rounds' verification time over f's, per
  size (a moving average: the batched forward's own overheads, a longer cache, the rows' acceptance work).
- d: a row's drafting time (moving average over drafted rounds).
- A(m): drafted tokens a row accepts with m nodes. Capped trees: alpha P(m), where P(m) sums the path
  probabilities the heads gave their m - 1 best nodes (EAGLE-2's observation: the draft's confidence predicts
  acceptance; averaged over rows) and alpha is accepted over predicted in the rounds verified, from a prior of 1,
  for capped and full trees apart (a full tree's prompt-lookup branch carries no probability, but is accepted).
  Drafters without node probabilities (Medusa's static trees) choose between full trees, measured as they ran, and
  plain steps.
- w(m): min(m, the full trees' measured width), the padded nodes per row.

The sizes weighed: 1, then 2 ... 16, 17, 33, 65 below the drafter's whole tree, that tree alone (its best nodes,
without a prompt-lookup branch), and the full tree as drafted (None).

m = 1 is a plain decoding step (no drafting; the drafter gets the skipped positions when it drafts again). The
first round drafts full trees (nothing is measured yet), and one round in `explore_every` runs a neighbour of the
best size (the one tried least recently), so that the estimates near the best follow the text and the batch (after
plain steps, drafting refreshes what the heads predict) at little cost.
"""

from __future__ import annotations

import argparse
import bisect
from itertools import accumulate
from typing import Any

import torch

from specheads.inference.drafting import Drafter, eagle_drafter_in

FULL = None  # nodes per row: the drafter's own full tree (with any prompt-lookup branch)
PRIOR_TOKENS = 4.0  # how much the prior alpha = 1 weighs, in predicted tokens (a few rows' rounds)


def calibrate_verification_ms(lm: Any, max_tokens: int = 128, repeats: int = 3) -> dict[int, float]:
    """Median milliseconds of the target's verification forward over T tree tokens (T = 1, 2, 4, ... up to
    `max_tokens`, within the target's positions), after a 32-token dummy prompt."""
    # autotune imports generate, which imports this module
    from specheads.inference.autotune import verification_cost_ms

    target = lm.target
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 4096
    prompt_length = min(32, max(1, limit // 4))
    vocab = target.config.get_text_config().vocab_size
    prompt = (torch.arange(prompt_length) * 7 + 3)[None] % vocab  # any tokens: the cost does not depend on them
    counts, t = [], 1
    while t <= min(max_tokens, limit - prompt_length):
        counts.append(t)
        t *= 2
    return verification_cost_ms(lm, prompt, counts, repeats=repeats)


def selectable_nodes(drafter: Drafter) -> int | None:
    """The full tree, root included, whose best nodes the drafter can select (EAGLE: tree_num_nodes + 1), else None."""
    eagle = eagle_drafter_in(drafter)
    return None if eagle is None else eagle.num_nodes + 1


def node_probs_of(drafter: Drafter) -> list[float] | None:
    """The drafter's last proposal's path probabilities, best first (EAGLE), else None."""
    eagle = eagle_drafter_in(drafter)
    return None if eagle is None else eagle.node_probs()


class AutoRoundBudget:
    """Chooses each round's nodes per row (`nodes_per_row`) from what the engine records of earlier rounds.

    Args:
        verification_ms: {T: milliseconds} the target's verification forward over T tokens (`calibrate_verification_ms`).
        full_nodes: the drafter's full tree in nodes with its root (EAGLE: tree_num_nodes + 1), whose best nodes the
            drafter can select; None where the drafter gives no node probabilities (full trees or plain steps only).
        smoothing: the weight of the newest measurement in each moving average.
        explore_every: one round in this many runs a neighbour of the best size instead (the next smaller or
            larger, whichever ran longer ago), so that the estimates near the best stay current.
    """

    def __init__(self, verification_ms: dict[int, float], full_nodes: int | None, smoothing: float = 0.05,
                 explore_every: int = 16) -> None:
        if not verification_ms or any(t < 1 or ms <= 0 for t, ms in verification_ms.items()):
            raise ValueError(f"verification_ms={verification_ms!r}: expected {{tokens >= 1: milliseconds > 0}}")
        if full_nodes is not None and full_nodes < 2:
            raise ValueError(f"full_nodes={full_nodes}: expected None or >= 2 (a root and a drafted node)")
        if not 0 < smoothing <= 1 or explore_every < 2:
            raise ValueError(f"smoothing={smoothing} must be in (0, 1] and explore_every={explore_every} >= 2")
        self.tokens = sorted(verification_ms)
        self.ms = [verification_ms[t] for t in self.tokens]
        self.full_nodes, self.smoothing, self.explore_every = full_nodes, smoothing, explore_every
        # sizes the drafter can select (the root included): each of 2 ... 16, then 17, 33, 65, below its full tree,
        # and that tree without the prompt-lookup branch a full-tree round also verifies (where there is one)
        ladder = [*range(2, 17), 17, 33, 65]
        self.capped = [] if full_nodes is None else [m for m in ladder if m < full_nodes]
        if full_nodes is not None:
            self.capped.append(full_nodes)
        self.sizes: list[int | None] = [1, *self.capped, FULL]
        self.draft_ms: float | None = None  # per row
        self.verify_ratio: dict[int | None, float] = {}  # beta by size (its rows' acceptance work differs)
        self.full_width: float | None = None  # padded nodes per row of full-tree rounds
        self.full_accepted: float | None = None  # drafted tokens accepted per row in full-tree rounds (no probabilities)
        self.predicted: list[float] | None = None  # P(m) for m in self.capped, then the full tree's
        # alpha, capped and full trees apart (a prompt-lookup branch adds to the full trees' acceptance): accepted
        # over predicted as moving sums, from a prior of 1 (the heads' own probabilities) worth PRIOR_TOKENS
        self.capped_ratio, self.full_ratio = [PRIOR_TOKENS, PRIOR_TOKENS], [PRIOR_TOKENS, PRIOR_TOKENS]
        self.round = 0
        self.last_tried: dict[int | None, int] = {}  # size -> the round it last ran
        self.rounds: dict[str, int] = {}  # rounds by choice, for stats: "1" (plain), "5", ..., "full"

    # --- the model ----------------------------------------------------------------------------------------------
    def verification_ms(self, tokens: float) -> float:
        """f(T): linear between the measured token counts, extended along the last segment's slope past them."""
        ts, ms = self.tokens, self.ms
        if len(ts) == 1:
            return ms[0] * max(tokens, 1) / ts[0]
        i = min(max(bisect.bisect_left(ts, tokens), 1), len(ts) - 1)
        slope = (ms[i] - ms[i - 1]) / (ts[i] - ts[i - 1])
        return max(ms[i - 1] + slope * (tokens - ts[i - 1]), min(ms))

    def accepted(self, size: int | None) -> float | None:
        """A(m): drafted tokens accepted per row at `size` nodes (None: full trees); None when nothing tells yet."""
        if self.full_nodes is None:
            return self.full_accepted if size is FULL else None
        if self.predicted is None:
            return None
        accepted, predicted = self.full_ratio if size is FULL else self.capped_ratio
        return accepted / predicted * self.predicted[len(self.capped) if size is FULL else self.capped.index(size)]

    def tokens_per_ms(self, rows: int, size: int | None) -> float | None:
        """The predicted rate of a round of `rows` rows at `size` nodes per row (1: plain steps; None: full trees),
        or None when not yet measured."""
        beta = self.verify_ratio.get(size, self.verify_ratio.get(FULL, 1.0))  # unmeasured: as the full trees
        if size == 1:
            return rows / (beta * self.verification_ms(rows))
        accepted = self.accepted(size)
        if accepted is None or self.draft_ms is None or self.full_width is None:
            return None
        width = self.full_width if size is FULL else min(size, self.full_width)
        return rows * (1 + accepted) / (rows * self.draft_ms + beta * self.verification_ms(rows * width))

    def nodes_per_row(self, rows: int) -> int | None:
        """This round's nodes per row for `rows` rows: 1 (a plain step), a capped size, or None (full trees)."""
        self.round += 1
        rates = {size: self.tokens_per_ms(rows, size) for size in self.sizes}
        rates = {size: rate for size, rate in rates.items() if rate is not None}
        if len(rates) == 1:  # only plain steps can be predicted: full trees measure the rest
            choice = FULL
        else:
            choice = max(rates, key=rates.get)
            if self.round % self.explore_every == 0:  # the best size's neighbour tried least recently
                i = self.sizes.index(choice)
                choice = min(self.sizes[max(i - 1, 0): i] + self.sizes[i + 1: i + 2],
                             key=lambda size: self.last_tried.get(size, 0))
        self.last_tried[choice] = self.round
        key = "full" if choice is FULL else str(choice)
        self.rounds[key] = self.rounds.get(key, 0) + 1
        return choice

    # --- what the engine measured -------------------------------------------------------------------------------
    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def record_draft(self, rows: int, seconds: float) -> None:
        """A drafted round's drafting time, all `rows` rows."""
        self.draft_ms = self._average(self.draft_ms, 1000 * seconds / rows)

    def record_verify(self, rows: int, width: int, size: int | None, seconds: float) -> None:
        """A round's verification (forward and acceptance) over `rows` x `width` padded nodes at `size` nodes."""
        ratio = 1000 * seconds / self.verification_ms(rows * width)
        self.verify_ratio[size] = self._average(self.verify_ratio.get(size), ratio)
        if size is FULL:
            self.full_width = self._average(self.full_width, width)

    def record_row(self, size: int | None, node_probs: list[float] | None, accepted: int) -> None:
        """A drafted row's round at `size` nodes per row: its pool's path probabilities, best first (None: the
        drafter gives none), and the drafted tokens it accepted."""
        if self.full_nodes is None or node_probs is None:
            if size is FULL:
                self.full_accepted = self._average(self.full_accepted, accepted)
            return
        prefix = list(accumulate(node_probs, initial=0.0))  # prefix[k]: the k best nodes' probabilities summed
        sums = [prefix[min(m - 1, len(node_probs))] for m in [*self.capped, self.full_nodes]]
        self.predicted = sums if self.predicted is None else [
            old + self.smoothing * (new - old) for old, new in zip(self.predicted, sums)]
        ratio = self.full_ratio if size is FULL else self.capped_ratio
        decay = 1 - self.smoothing  # moving sums, so that alpha follows the text as the averages do
        ratio[0] = decay * ratio[0] + accepted
        ratio[1] = decay * ratio[1] + sums[len(self.capped) if size is FULL else self.capped.index(size)]

    def summary(self) -> dict[str, Any]:
        """What the budget measured and chose (for stats and benchmark JSON)."""
        return {"rounds_by_nodes_per_row": dict(self.rounds), "draft_ms_per_row": self.draft_ms,
                "verification_ratio": {("full" if size is FULL else str(size)): ratio
                                       for size, ratio in self.verify_ratio.items()},
                "full_width": self.full_width,
                "accepted_by_nodes_per_row": {("full" if size is FULL else str(size)): self.accepted(size)
                                              for size in self.sizes[1:]},
                "verification_ms_by_tokens": dict(zip(self.tokens, self.ms))}


def parse_max_round_nodes(text: str) -> int | str | None:
    """The `--max-round-nodes` argument: an integer >= 1, 'auto', or 'full' (None: every row's full tree)."""
    if text == "auto":
        return text
    if text == "full":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto', 'full' or an integer >= 1")
    return value
