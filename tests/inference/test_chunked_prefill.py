"""Chunked prefill (inference/chunked_prefill.py): a long prompt joins a running batch a chunk per round, the rows
already decoding go on between its chunks, and every row is still exactly the target's."""

from __future__ import annotations

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.batched import BatchEngine
from specheads.inference.prompt_cache import PromptCache
from specheads.inference.serving_loop import ServingLoop

from .conftest import hf_greedy
from .test_generate_batched import batched_test_heads

SHORT = [[1, 5, 9], [1, 40]]
LONG = [[1, 7, 3, 8, 2, 11, 4, 6, 30, 12, 9, 17, 25, 3, 44], [2, 3, 5, 8, 13, 21, 34, 55, 89, 4, 7, 11, 18]]


class ForwardLog:
    """Wraps a target's forward and keeps the (rows, tokens) of each call's input."""

    def __init__(self, target) -> None:
        self.target, self.original, self.lengths = target, target.forward, []

    def __enter__(self) -> ForwardLog:
        def forward(*args, **kwargs):
            self.lengths.append(tuple(kwargs["input_ids"].shape))
            return self.original(*args, **kwargs)

        self.target.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.target.forward  # the class's forward again


def expected(target, prompt, n):
    return hf_greedy(target, torch.tensor([prompt]), n)[0, len(prompt):].tolist()


def run(engine: BatchEngine, requests: list) -> None:
    """Add `requests` and step until every row and prefill has ended."""
    engine.add(requests)
    while engine.occupied:
        engine.step()


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: a sliding window of 8, prompts longer than it
@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_long_prompts_join_a_chunk_per_round_and_every_row_stays_exact(tiny_target_factory, family, head_type):
    target = tiny_target_factory(family)
    lm = SpeculativeLM(target, batched_test_heads(target, head_type), prefill_chunk=4)
    running = [lm.batch_request(torch.tensor([p]), max_new_tokens=30) for p in SHORT]
    joining = [lm.batch_request(torch.tensor([p]), max_new_tokens=20) for p in LONG]
    engine = BatchEngine(lm)
    engine.add(running)
    engine.step()
    with ForwardLog(target) as log:
        assert engine.add(joining) == [] and len(engine.prefilling) == 2 and engine.occupied == 4
        assert log.lengths == []  # nothing ran yet: each long prompt runs a chunk per step
        emitted_during_prefill = []
        while engine.prefilling:
            before = [len(r.new_tokens) for r in running]
            engine.step()
            emitted_during_prefill.append(sum(len(r.new_tokens) for r in running) - sum(before))
    chunks = [tokens for rows, tokens in log.lengths if rows == 1]  # the rounds' forwards have the 2 running rows
    assert chunks == [4, 4, 4, 3, 4, 4, 4, 1]  # 15 then 13 prompt tokens, 4 at a time, one chunk per step
    assert len(emitted_during_prefill) == len(chunks)
    assert all(count > 0 for count in emitted_during_prefill[:3])  # the running rows went on meanwhile
    while engine.occupied:
        engine.step()
    for request, prompt in zip(running + joining, SHORT + LONG):
        assert request.new_tokens == expected(target, prompt, request.max_new_tokens), prompt
        assert request.target_forwards >= 1 and request.finished


def test_a_prompt_cache_join_runs_only_its_new_tokens_in_chunks(tiny_target_factory):
    """A second turn from its prompt cache: the held tokens are reused, the rest run in chunks, the answer exact."""
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"), prefill_chunk=3)
    cache = PromptCache()
    first = lm.batch_request(torch.tensor([LONG[0]]), max_new_tokens=8, prompt_cache=cache)
    engine = BatchEngine(lm)
    run(engine, [first])
    follow_up = LONG[0] + first.new_tokens + [9, 2, 14, 3, 6, 8, 10]
    second = lm.batch_request(torch.tensor([follow_up]), max_new_tokens=12, prompt_cache=cache)
    with ForwardLog(target) as log:
        run(engine, [second])
    assert second.reused_prompt_tokens >= len(LONG[0])
    assert engine.stats["reused_prompt_tokens"] == second.reused_prompt_tokens  # counted by the engine too
    # the 8 prompt tokens after the held ones (the 7 new, after the last answer token, which the cache never held)
    assert [tokens for _, tokens in log.lengths[:3]] == [3, 3, 2]
    assert second.new_tokens == expected(target, follow_up, 12)


def test_a_prefill_cancelled_midway_leaves_its_prompt_cache_what_it_ran(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"), prefill_chunk=4)
    cache = PromptCache()
    request = lm.batch_request(torch.tensor([LONG[0]]), max_new_tokens=8, prompt_cache=cache)
    engine = BatchEngine(lm)
    engine.add([request])
    engine.step()
    engine.step()  # 8 of its 15 prompt tokens ran
    request.cancelled = True
    assert engine.step() == [request] and not engine.occupied
    assert cache.shared_length(torch.tensor(LONG[0])) == 8  # the next request of the conversation reuses them
    again = lm.batch_request(torch.tensor([LONG[0]]), max_new_tokens=8, prompt_cache=cache)
    run(engine, [again])
    assert again.reused_prompt_tokens == 8 and again.new_tokens == expected(target, LONG[0], 8)


def test_cancelled_and_failing_prefills_leave_alone(tiny_target_factory, monkeypatch):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle"), prefill_chunk=4)
    keep = lm.batch_request(torch.tensor([SHORT[0]]), max_new_tokens=16)
    cancelled, failing = (lm.batch_request(torch.tensor([p]), max_new_tokens=8) for p in LONG)
    engine = BatchEngine(lm, isolate_errors=True)
    engine.add([keep, cancelled, failing])
    cancelled.cancelled = True
    assert cancelled in engine.step() and cancelled.finished and not cancelled.new_tokens
    job = engine.prefilling[0]
    monkeypatch.setattr(job, "advance", lambda: (_ for _ in ()).throw(RuntimeError("chunk failed")))
    assert failing in engine.step() and isinstance(failing.error, RuntimeError) and not engine.prefilling
    while engine.occupied:
        engine.step()
    assert keep.new_tokens == expected(target, SHORT[0], 16)


def test_the_serving_loop_counts_prefilling_requests_against_its_batch(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, batched_test_heads(target, "eagle3"), prefill_chunk=2)
    loop = ServingLoop(lm, max_batch=2)
    occupancy, add = [], loop.engine.add

    def counted_add(requests):
        ended = add(requests)
        occupancy.append(loop.engine.occupied)
        return ended

    loop.engine.add = counted_add
    try:
        tickets = [loop.submit(lm.batch_request(torch.tensor([p]), max_new_tokens=10)) for p in LONG + SHORT]
        for ticket, prompt in zip(tickets, LONG + SHORT):
            assert ticket.wait().new_tokens == expected(target, prompt, 10)
    finally:
        loop.close()
    assert occupancy and max(occupancy) <= 2  # prompts still prefilling hold their place in the batch
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        SpeculativeLM(target, lm.heads, prefill_chunk=0)
