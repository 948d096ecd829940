"""`max_round_nodes="auto"` (inference/round_budget.py): the nodes per row each batched round verifies, chosen from
the target's measured verification cost and the rows' measured drafting cost and acceptance.

The chooser is tested on synthetic measurements (its choices follow the cost model); the engine is tested to apply
each round's choice (every verified tree fits it; plain steps draft nothing) and to stay exact whatever it chose.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.batched import BatchEngine
from specheads.inference.drafting import EagleDrafter
from specheads.inference.round_budget import FULL, AutoRoundBudget, parse_max_round_nodes

from ..conftest import build_tiny_target
from .conftest import hf_greedy
from .test_batch_engine import PROMPTS, drive
from .test_generate_batched import batched_test_heads

FLAT = {t: 10.0 for t in (1, 2, 4, 8, 16, 32, 64, 128)}  # a GPU-like forward: the same cost up to 128 tokens
STEEP = {t: 10.0 * t for t in (1, 2, 4, 8, 16, 32, 64, 128)}  # every token costs as much as a whole plain step
PROBS = [0.9, 0.8, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1]  # a confident draft's node probabilities, best first


def measured(costs: dict[int, float], draft_ms: float, accepted: int, rows: int = 2,
             probs: list[float] | None = PROBS, full_nodes: int | None = 9) -> AutoRoundBudget:
    """A budget that has seen one full-tree round of `rows` rows (verified as fast as `costs` says, 9 nodes wide)
    and one capped round at 5 nodes, each row accepting `accepted` drafted tokens."""
    budget = AutoRoundBudget(costs, full_nodes)
    for size, width in ((FULL, 9), (5, 5)):
        budget.record_draft(rows, rows * draft_ms / 1000)
        budget.record_verify(rows, width, size, budget.verification_ms(rows * width) / 1000)
        for _ in range(rows):
            budget.record_row(size, probs, accepted)
    return budget


def test_verification_cost_is_interpolated_between_measurements_and_extended_past_them():
    budget = AutoRoundBudget({1: 10.0, 4: 16.0, 8: 40.0}, full_nodes=9)
    assert [budget.verification_ms(t) for t in (1, 2, 4, 6, 8)] == [10.0, 12.0, 16.0, 28.0, 40.0]
    assert budget.verification_ms(16) == 88.0  # the last segment's slope, 6 ms a token
    assert budget.capped == [2, 3, 4, 5, 6, 7, 8, 9]  # the sizes the drafter can select; 9: its whole tree, without
    assert AutoRoundBudget(FLAT, full_nodes=40).capped == [*range(2, 18), 33, 40]  # a lookup branch


def test_nothing_measured_drafts_full_trees():
    budget = AutoRoundBudget(STEEP, full_nodes=9)
    assert budget.tokens_per_ms(4, 5) is None and budget.tokens_per_ms(4, 1) == 4 / 40
    assert budget.nodes_per_row(4) is FULL


def test_a_flat_forward_and_good_drafts_verify_full_trees_at_every_batch_size():
    budget = measured(FLAT, draft_ms=0.5, accepted=3)
    # the whole tree, as drafted (FULL) or selected (9 nodes: what a full round verifies but a lookup branch)
    assert {budget.nodes_per_row(rows) for rows in (1, 2, 4, 8)} <= {9, FULL}


def test_a_steep_forward_takes_plain_steps_and_still_drafts_now_and_then():
    budget = measured(STEEP, draft_ms=5.0, accepted=1)
    choices = [budget.nodes_per_row(8) for _ in range(80)]
    explored = [choice for i, choice in enumerate(choices, start=1) if i % budget.explore_every == 0]
    assert all(choice == 1 for i, choice in enumerate(choices, start=1) if i % budget.explore_every)
    assert set(explored) == {2}  # one round in 16: the next size up (plain steps have no smaller neighbour)


def test_exploring_rounds_try_the_best_sizes_neighbours_in_turn():
    class Fixed(AutoRoundBudget):
        def tokens_per_ms(self, rows, size):
            return 10.0 if size == 5 else 1.0

    budget = Fixed(FLAT, full_nodes=9)
    choices = [budget.nodes_per_row(4) for _ in range(64)]
    assert [c for i, c in enumerate(choices, start=1) if i % 16 == 0] == [4, 6, 4, 6]
    assert all(c == 5 for i, c in enumerate(choices, start=1) if i % 16)


def test_trees_shrink_as_the_batch_grows_where_tokens_cost():
    """Cheap up to 8 tokens, then 5 ms a token: one row verifies its full tree, many rows take plain steps."""
    costs = {1: 20.0, 8: 20.0, 16: 60.0, 32: 140.0, 64: 300.0}
    budget = measured(costs, draft_ms=1.0, accepted=2, probs=[0.95, 0.9, 0.85, 0.8, 0.6, 0.5, 0.4, 0.3])
    sizes = [budget.nodes_per_row(rows) for rows in (1, 2, 4, 8, 16)]
    widths = [9 if size is FULL else size for size in sizes]
    assert widths == sorted(widths, reverse=True) and widths[0] > 1 and widths[-1] == 1, sizes


def test_alpha_starts_at_the_heads_own_probabilities_and_follows_what_is_accepted():
    budget = AutoRoundBudget(FLAT, full_nodes=9)
    budget.record_row(FULL, PROBS, 0)  # the full trees' alpha moves; the capped trees' is still the prior 1
    assert budget.accepted(5) == pytest.approx(sum(PROBS[:4]))
    for _ in range(200):
        budget.record_row(5, PROBS, 1)  # half of what the probabilities predict (2.9)
    assert budget.accepted(5) == pytest.approx(1.0, rel=0.01)
    assert budget.accepted(3) == pytest.approx(1.0 * sum(PROBS[:2]) / sum(PROBS[:4]), rel=0.01)


def test_drafters_without_node_probabilities_choose_full_trees_or_plain_steps():
    budget = measured(STEEP, draft_ms=5.0, accepted=1, probs=None, full_nodes=None)
    assert budget.capped == [] and budget.accepted(FULL) == 1
    assert {budget.nodes_per_row(rows) for rows in (1, 2, 4, 8) for _ in range(20)} <= {1, FULL}


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="verification_ms"):
        AutoRoundBudget({}, full_nodes=9)
    with pytest.raises(ValueError, match="full_nodes=1"):
        AutoRoundBudget(FLAT, full_nodes=1)
    with pytest.raises(ValueError, match="explore_every=1"):
        AutoRoundBudget(FLAT, full_nodes=9, explore_every=1)
    assert parse_max_round_nodes("auto") == "auto" and parse_max_round_nodes("16") == 16
    assert parse_max_round_nodes("full") is None
    for bad in ("0", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            parse_max_round_nodes(bad)
    with pytest.raises(ValueError, match="max_round_nodes='big'"):
        SpeculativeLM(build_tiny_target(), batched_test_heads(build_tiny_target(), "eagle"), max_round_nodes="big")


def test_node_probs_are_the_pools_path_probabilities_best_first(tiny_target_factory):
    target = tiny_target_factory("llama")
    heads = batched_test_heads(target, "eagle")
    drafter = EagleDrafter(heads, depth=3, top_k=3, num_nodes=5, dtype=torch.float32, min_prob=0.01)
    assert drafter.node_probs() == []
    features = torch.randn(4, target.config.hidden_size)
    tokens, tree = drafter.propose(features, torch.tensor([5, 9, 11, 3]))
    probs = drafter.node_probs()
    assert probs == sorted(probs, reverse=True) and all(p >= 0.01 for p in probs)
    assert 1 <= len(probs) <= 3 + 3 * 3 * 2  # the pool: 3 children, then 9 a level for 2 more levels
    assert tree.num_nodes - 1 == min(5, len(probs))  # the tree kept the best of them
    assert probs[0] <= 1.0


class Scripted(AutoRoundBudget):
    """A budget whose choices follow a script (then full trees), recording what the engine reports."""

    def __init__(self, script: list[int | None]) -> None:
        super().__init__(FLAT, full_nodes=11)
        self.script, self.reports, self.chosen, self.drafts = list(script), [], [], []

    def nodes_per_row(self, rows: int) -> int | None:
        self.chosen.append(self.script.pop(0) if self.script else FULL)
        return self.chosen[-1]

    def record_draft(self, rows: int, seconds: float) -> None:
        self.drafts.append(len(self.chosen) - 1)  # the round
        super().record_draft(rows, seconds)

    def record_row(self, size, node_probs, accepted) -> None:
        self.reports.append((size, node_probs is not None, accepted))
        super().record_row(size, node_probs, accepted)


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_the_engine_verifies_each_rounds_chosen_size_and_stays_exact(tiny_target_factory, head_type):
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, batched_test_heads(target, head_type), lookup_tokens=3)
    script = [FULL, 1, 1, 3, 5, 2, 1, FULL, 2, 1, 1, 1, 5] * 3
    budget = Scripted(script)
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=30) for p in PROMPTS]
    engine = BatchEngine(lm, max_round_nodes=budget)
    widths: list[tuple[int | None, int]] = []
    original = engine._draft

    def draft(row, size):
        tokens, tree = original(row, size)
        widths.append((size, tree.num_nodes))
        return tokens, tree

    engine._draft = draft
    drive(engine, {0: requests[:2], 3: requests[2:]})
    for request, prompt in zip(requests, PROMPTS):
        assert request.new_tokens == hf_greedy(target, torch.tensor([prompt]), 30)[0, len(prompt):].tolist(), prompt
    assert all(width <= size for size, width in widths if size is not FULL)
    assert any(width > 5 for size, width in widths if size is FULL)  # full trees, lookup branches included
    assert all(width == 1 for size, width in widths if size == 1)
    reported_sizes = {size for size, _, _ in budget.reports}
    assert 1 not in reported_sizes and {3, 5, 2, FULL} <= reported_sizes  # plain rows report no acceptance
    assert all(has_probs == (head_type != "medusa") for _, has_probs, _ in budget.reports)
    assert engine.stats["round_budget"]["draft_ms_per_row"] > 0
    # drafting is timed in drafted rounds, but not in those where a row drafts for the first time (round 0, and round
    # 3 where three rows joined): a first draft also reads the whole prompt
    drafted = [r for r, size in enumerate(budget.chosen) if size != 1]
    assert budget.drafts == [r for r in drafted if r not in (0, 3)] and 3 in drafted


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_auto_rows_joining_a_batch_get_the_targets_tokens(head_type):
    """The real chooser on a tiny target (its verification measured): rows join at rounds 0, 2 and 5, each equal to
    target.generate; the chooser is the model's, kept across calls, and a new tree shape gets a new one."""
    target = build_tiny_target("llama", seed=5)
    lm = SpeculativeLM(target, batched_test_heads(target, head_type), lookup_tokens=3, max_round_nodes="auto")
    for call in range(2):
        requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=24 + 3 * i) for i, p in enumerate(PROMPTS)]
        engine = BatchEngine(lm)
        drive(engine, {0: requests[:1], 2: requests[1:3], 5: requests[3:]})
        for request, prompt in zip(requests, PROMPTS):
            alone = hf_greedy(target, torch.tensor([prompt]), request.max_new_tokens, pad_token_id=0)
            assert request.new_tokens == alone[0, len(prompt):].tolist(), (call, prompt)
        assert engine.auto is lm.auto_round_budget()
    rounds = engine.stats["round_budget"]["rounds_by_nodes_per_row"]
    assert rounds["full"] >= 1 and sum(rounds.values()) == lm.auto_round_budget().round
    assert sorted(lm.auto_round_budget().tokens) == [1, 2, 4, 8, 16, 32, 64, 128]
    if head_type != "medusa":
        kept = lm.auto_round_budget()
        lm.configure_tree(tree_depth=3, tree_top_k=2, tree_num_nodes=4)
        assert lm.auto_round_budget() is not kept and lm.auto_round_budget().full_nodes == 5
        assert lm.auto_round_budget().tokens == kept.tokens  # the verification cost is measured once


def test_the_servers_metrics_count_rounds_by_the_size_chosen(tiny_target_factory):
    from specheads.inference.server import prometheus_text
    from specheads.inference.serving_loop import ServingLoop

    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"), max_round_nodes="auto")
    loop = ServingLoop(lm, max_batch=4)
    try:
        tickets = [loop.submit(lm.batch_request(torch.tensor([p]), max_new_tokens=12)) for p in PROMPTS[:3]]
        for ticket, prompt in zip(tickets, PROMPTS):
            assert ticket.wait().new_tokens == hf_greedy(target, torch.tensor([prompt]), 12)[0, len(prompt):].tolist()
        counts = loop.metrics()["rounds_by_nodes_per_row"]
    finally:
        loop.close()
    assert counts["full"] >= 1 and sum(counts.values()) == lm.auto_round_budget().round
    lines = prometheus_text(loop.metrics()).splitlines()
    assert "# TYPE specheads_rounds_by_nodes_per_row_total counter" in lines
    assert f'specheads_rounds_by_nodes_per_row_total{{nodes_per_row="full"}} {counts["full"]}' in lines
    fixed = ServingLoop(SpeculativeLM(target, lm.heads), max_batch=1)  # full trees: nothing chosen, nothing counted
    assert "rounds_by_nodes_per_row" not in fixed.metrics()
    fixed.close()
