"""Continuous batching (`BatchEngine`): rows join a running batch between rounds and leave when they end, and each
row still gets exactly what it gets alone: greedy rows `target.generate`'s tokens, sampling rows the target's law.

Joining moves the running rows' cache entries (the shorter side is left-padded), so these tests join rows of
other lengths at several rounds, mix greedy with sampling rows, join from a prompt cache, and cancel rows.
"""

from __future__ import annotations

import threading

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.batched import BatchEngine
from specheads.inference.prompt_cache import PromptCache
from specheads.inference.serving_loop import ServingLoop

from ..conftest import build_tiny_target
from .conftest import hf_greedy
from .test_generate_batched import batched_test_heads
from .test_generate_sampling import PROMPT, ExactLaw

PROMPTS = [[1, 5, 9], [1, 7, 3, 8, 2, 11, 4, 6, 30, 12], [1, 40], [1, 6, 6, 6, 21], [2, 3]]


def drive(engine: BatchEngine, joins: dict[int, list]) -> int:
    """Step `engine`, adding joins[r] before round r, until every row ended; returns the rounds run."""
    rounds = 0
    while engine.rows or any(r >= rounds for r in joins):
        if rounds in joins:
            engine.add(joins.pop(rounds))
        if engine.rows:
            engine.step()
        rounds += 1
    return rounds


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_rows_joining_a_running_batch_get_the_targets_tokens(family, head_type):
    """Rows join at rounds 0, 2 and 5 (longer and shorter than the running ones): each equals target.generate."""
    target = build_tiny_target(family, seed=5)
    lm = SpeculativeLM(target, batched_test_heads(target, head_type))
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=24 + 3 * i) for i, p in enumerate(PROMPTS)]
    engine = BatchEngine(lm)
    drive(engine, {0: requests[:1], 2: requests[1:3], 5: requests[3:]})
    assert engine.cache is None and not engine.rows
    for request, prompt in zip(requests, PROMPTS):
        alone = hf_greedy(target, torch.tensor([prompt]), request.max_new_tokens, pad_token_id=0)
        assert request.finished and request.new_tokens == alone[0, len(prompt):].tolist(), prompt
        assert request.mean_accepted == len(request.new_tokens) / request.target_forwards
    stats = engine.stats
    assert stats["batched_forwards"] < stats["target_forwards"]  # rows really shared forwards
    assert stats["new_tokens"] == sum(len(r.new_tokens) for r in requests)


def test_rows_with_prompt_lookup_join_and_match(tiny_target_factory):
    """Prompt lookup grafted onto every row's tree (repetitive prompts: long guesses, trees of different sizes)."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle3"), lookup_tokens=4, lookup_max_tokens=16)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [1, 7, 3, 8, 7, 3, 8, 7, 3], [1, 40], [2, 11, 12, 11, 12, 11]]
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=40) for p in prompts]
    engine = BatchEngine(lm)
    drive(engine, {0: requests[:2], 3: requests[2:]})
    for request, prompt in zip(requests, prompts):
        assert request.new_tokens == hf_greedy(target, torch.tensor([prompt]), 40)[0, len(prompt):].tolist(), prompt
    assert max(request.accepted_counts and max(request.accepted_counts) for request in requests) >= 3


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_a_round_node_budget_shrinks_trees_as_rows_join_and_stays_exact(tiny_target_factory, head_type):
    """max_round_nodes 8: one row drafts 8-node trees, two 4, four 2, five 1 (plain steps, no drafting): every
    verified tree fits the budget, rows that skipped drafting draft again later, and every row stays exact."""
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, batched_test_heads(target, head_type), lookup_tokens=3, max_round_nodes=8)
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=30) for p in PROMPTS]
    engine = BatchEngine(lm)
    widths: list[tuple[int, int]] = []  # (rows, largest tree) per round
    step = engine.step

    def recording_step():
        original = engine._draft
        sizes = []

        def draft(row, budget):
            tokens, tree = original(row, budget)
            sizes.append(tree.num_nodes)
            return tokens, tree

        engine._draft = draft
        try:
            return step()
        finally:
            engine._draft = original
            widths.append((len(sizes), max(sizes, default=0)))

    engine.step = recording_step
    drive(engine, {0: requests[:1], 2: requests[1:2], 4: requests[2:]})
    for request, prompt in zip(requests, PROMPTS):
        assert request.new_tokens == hf_greedy(target, torch.tensor([prompt]), 30)[0, len(prompt):].tolist(), prompt
    assert all(largest <= max(1, 8 // rows) for rows, largest in widths if rows)
    assert {rows for rows, _ in widths} >= {1, 2, 5}  # alone, two rows, five rows (plain steps)
    assert any(largest > 4 for rows, largest in widths if rows == 1)  # alone, the full budget is used
    assert all(largest == 1 for rows, largest in widths if rows == 5)
    with pytest.raises(ValueError, match="max_round_nodes=0"):
        BatchEngine(lm, max_round_nodes=0)


class SeenTokens:
    """Wraps a drafter (and its forks) and keeps every `next_tokens` it is handed, per fork."""

    def __init__(self, drafter, log: list) -> None:
        self.inner, self.log, self.seen = drafter, log, []
        log.append(self.seen)

    def fork(self):
        return SeenTokens(self.inner.fork(), self.log)

    def reset(self):
        self.inner.reset()

    def propose(self, features, next_tokens):
        assert features.shape[0] == next_tokens.shape[0]
        self.seen += next_tokens.tolist()
        return self.inner.propose(features, next_tokens)


def test_rows_that_skip_drafting_hand_their_drafter_every_position_later(tiny_target_factory):
    """Under a budget of 2 nodes, three rows decode plainly (no drafting); when two have ended the last drafts again
    and its drafter gets every position it missed: all it was handed is the row's sequence, in order, none lost."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"), max_round_nodes=2)
    log: list[list[int]] = []
    lm.drafter = SeenTokens(lm.drafter, log)
    lengths = [6, 8, 40]
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    drive(BatchEngine(lm), {0: requests})
    last = requests[2]
    sequence = last.prompt[1:].tolist() + last.new_tokens
    seen = next(s for s in log if s and s[0] == sequence[0] and len(s) > len(last.prompt))
    assert seen == sequence[: len(seen)] and len(seen) > len(last.prompt) + 8  # it drafted after the others ended
    assert last.new_tokens == hf_greedy(target, torch.tensor([PROMPTS[2]]), 40)[0, len(PROMPTS[2]):].tolist()


def test_greedy_and_sampling_rows_share_a_batch(tiny_target_factory):
    """Per-row options: a greedy row next to sampling rows (logits needed) and a row with a repetition penalty."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))
    greedy = lm.batch_request(torch.tensor([PROMPTS[1]]), max_new_tokens=30)
    penalised = lm.batch_request(torch.tensor([PROMPTS[0]]), max_new_tokens=30, repetition_penalty=1.5)
    sampled = [lm.batch_request(torch.tensor([p]), max_new_tokens=30, do_sample=True, seed=s)
               for s, p in enumerate(PROMPTS[2:])]
    drive(BatchEngine(lm), {0: [sampled[0]], 1: [greedy, sampled[1]], 3: [penalised, sampled[2]]})
    assert greedy.new_tokens == hf_greedy(target, torch.tensor([PROMPTS[1]]), 30)[0, len(PROMPTS[1]):].tolist()
    reference = hf_greedy(target, torch.tensor([PROMPTS[0]]), 30, repetition_penalty=1.5)
    assert penalised.new_tokens == reference[0, len(PROMPTS[0]):].tolist()
    assert all(len(r.new_tokens) == 30 for r in sampled)


def test_a_seeded_row_samples_the_same_tokens_alone_and_in_a_batch(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))

    def seeded():
        return lm.batch_request(torch.tensor([PROMPTS[3]]), max_new_tokens=20, do_sample=True, seed=11)

    alone, again, crowded = seeded(), seeded(), seeded()
    drive(BatchEngine(lm), {0: [alone]})
    drive(BatchEngine(lm), {0: [again]})
    others = [lm.batch_request(torch.tensor([p]), max_new_tokens=25, do_sample=True) for p in PROMPTS[:2]]
    drive(BatchEngine(lm), {0: others[:1], 1: [crowded, others[1]]})
    assert alone.new_tokens == again.new_tokens == crowded.new_tokens


def test_sampling_rows_joining_a_batch_follow_the_exact_law(tiny_target_factory, chi_square):
    """Each sample's row joins a batch where a greedy companion row is running: the first 3 tokens ~ the exact law."""
    import copy

    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=6, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))
    law = ExactLaw(target, PROMPT, temperature=0.7, top_p=0.9)
    torch.manual_seed(0)
    engine, samples, companion = BatchEngine(lm), [], None
    for _ in range(1500):
        if companion is None or companion.finished:
            companion = lm.batch_request(torch.tensor([[1, 2, 5]]), max_new_tokens=60)
            engine.add([companion])
            engine.step()
        request = lm.batch_request(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=True, temperature=0.7, top_p=0.9)
        engine.add([request])
        while not request.finished:
            engine.step()
        samples.append(tuple(request.new_tokens))
    assert engine.stats["batched_forwards"] < engine.stats["target_forwards"]
    result = chi_square(samples, law.joint())
    assert result.passed, result


def test_a_row_joins_from_its_prompt_cache_and_keeps_the_conversation(tiny_target_factory):
    """A second turn joins a running batch from its PromptCache: only its new tokens run, and it equals generate."""
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle3"))
    cache = PromptCache()
    first = lm.batch_request(torch.tensor([PROMPTS[1]]), max_new_tokens=16, prompt_cache=cache)
    drive(BatchEngine(lm), {0: [first]})
    assert len(cache) >= len(PROMPTS[1]) + 15  # the answer's last token may not have run through the target
    turn = torch.tensor([PROMPTS[1] + first.new_tokens + [7, 21, 4]])
    second = lm.batch_request(turn, max_new_tokens=20, prompt_cache=cache)
    other = lm.batch_request(torch.tensor([PROMPTS[0]]), max_new_tokens=40)
    drive(BatchEngine(lm), {0: [other], 2: [second]})
    assert second.reused_prompt_tokens == len(PROMPTS[1]) + 15
    assert second.new_tokens == hf_greedy(target, turn, 20)[0, turn.shape[1]:].tolist()
    assert other.new_tokens == hf_greedy(target, torch.tensor([PROMPTS[0]]), 40)[0, len(PROMPTS[0]):].tolist()
    assert torch.equal(cache.tokens, torch.cat([turn[0], torch.tensor(second.new_tokens)])[: len(cache)])


def test_cancelled_rows_leave_and_the_others_go_on_exactly(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=30) for p in PROMPTS[:3]]
    engine = BatchEngine(lm)
    engine.add(requests)
    engine.step()
    requests[1].cancelled = True
    ended = engine.step()
    assert requests[1] in ended and len(engine.rows) == 2
    drive(engine, {})
    for request, prompt in zip(requests[::2], PROMPTS[::2]):
        assert request.new_tokens == hf_greedy(target, torch.tensor([prompt]), 30)[0, len(prompt):].tolist()


def test_the_serving_loop_batches_callers_on_other_threads(tiny_target_factory):
    """Requests submitted from several threads: answered exactly, and they shared the target's forwards."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))
    loop = ServingLoop(lm, max_batch=3)
    requests = [lm.batch_request(torch.tensor([p]), max_new_tokens=40) for p in PROMPTS]
    threads = [threading.Thread(target=loop.run, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for request, prompt in zip(requests, PROMPTS):
        assert request.new_tokens == hf_greedy(target, torch.tensor([prompt]), 40)[0, len(prompt):].tolist()
    assert loop.engine.stats["batched_forwards"] < loop.engine.stats["target_forwards"]
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(requests[0])


def test_a_failing_round_fails_its_requests_and_the_loop_goes_on(tiny_target_factory, monkeypatch):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))
    loop = ServingLoop(lm)
    broken = lm.batch_request(torch.tensor([PROMPTS[0]]), max_new_tokens=8)
    monkeypatch.setattr(BatchEngine, "step", lambda self: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        loop.run(broken)
    monkeypatch.undo()
    fine = loop.run(lm.batch_request(torch.tensor([PROMPTS[0]]), max_new_tokens=8))
    assert fine.new_tokens == hf_greedy(target, torch.tensor([PROMPTS[0]]), 8)[0, len(PROMPTS[0]):].tolist()
    loop.close()


def test_batch_request_checks_its_input(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))
    with pytest.raises(ValueError, match="one prompt"):
        lm.batch_request(torch.tensor([PROMPTS[0], PROMPTS[0]]))
    with pytest.raises(ValueError, match="empty"):
        lm.batch_request(torch.tensor([[]], dtype=torch.long))
    with pytest.raises(ValueError, match="typical"):
        lm.batch_request(torch.tensor([PROMPTS[0]]), acceptance="typical")
    with pytest.raises(ValueError, match="max_batch=0"):
        ServingLoop(lm, max_batch=0)


class FailsAfter:
    """A caller's logits processor that raises on its `calls`-th call (a grammar in a state it cannot leave)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def __call__(self, input_ids, scores):
        self.calls -= 1
        if self.calls <= 0:
            raise RuntimeError("constraint in a dead state")
        return scores


class StreamerFailsAfter:
    """A streamer whose `puts`-th `put` raises (a client gone mid-answer), after acceptance, inside a round."""

    def __init__(self, puts: int) -> None:
        self.puts = puts

    def put(self, value) -> None:
        self.puts -= 1
        if self.puts <= 0:
            raise RuntimeError("client went away")

    def end(self) -> None:
        pass


def test_a_row_whose_own_work_fails_ends_alone_when_errors_are_isolated(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"))

    def requests():
        healthy = [lm.batch_request(torch.tensor([p]), max_new_tokens=20) for p in PROMPTS[:2]]
        failing = lm.batch_request(torch.tensor([PROMPTS[2]]), max_new_tokens=20, logits_processor=[FailsAfter(4)])
        first_token = lm.batch_request(torch.tensor([PROMPTS[3]]), max_new_tokens=20, logits_processor=[FailsAfter(1)])
        return healthy, failing, first_token

    healthy, failing, first_token = requests()
    with pytest.raises(RuntimeError, match="dead state"):  # by default an error is the caller's
        drive(BatchEngine(lm), {0: [healthy[0], failing], 1: [healthy[1]]})
    healthy, failing, first_token = requests()
    # its 3rd put: the prompt, the first token (prefill), then the first round's accepted tokens
    streaming = lm.batch_request(torch.tensor([PROMPTS[1]]), max_new_tokens=20, streamer=StreamerFailsAfter(3))
    engine = BatchEngine(lm, isolate_errors=True)
    drive(engine, {0: [healthy[0], failing, streaming], 1: [healthy[1], first_token]})
    for request in (failing, first_token, streaming):
        assert request.finished and isinstance(request.error, RuntimeError)
    assert first_token.new_tokens == []  # it failed on its first token, in the prefill
    assert str(streaming.error) == "client went away" and len(streaming.new_tokens) > 1  # failed in a round
    for request, prompt in zip(healthy, PROMPTS):
        assert request.error is None
        assert request.new_tokens == hf_greedy(target, torch.tensor([prompt]), 20)[0, len(prompt):].tolist()
    loop = ServingLoop(lm)
    doomed = lm.batch_request(torch.tensor([PROMPTS[2]]), max_new_tokens=20, logits_processor=[FailsAfter(3)])
    fine = lm.batch_request(torch.tensor([PROMPTS[0]]), max_new_tokens=20)
    tickets = [loop.submit(doomed), loop.submit(fine)]
    with pytest.raises(RuntimeError, match="dead state"):
        tickets[0].wait(60)
    assert tickets[1].wait(60).new_tokens == healthy[0].new_tokens
    loop.close()
