"""Fuzzing generate: random left-padded batches, EOS positions and lengths against a slow reference.

The reference is each prompt decoded alone by `target.generate` (greedy), cut right after the first EOS. A third
test joins rows to a running `BatchEngine` at random rounds (continuous batching) and cancels one.
Both batch schemes (one batched verification per round, and rows one after another) must equal it, with the
target's argmax from its full logits or from the certified bf16 argmax (`--cpu-argmax`). A second test adds a
caller's logits processor, a repetition penalty and a stopping criterion, drawn at random, on both sides.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import StoppingCriteria

from specheads import SpeculativeLM, create_heads
from specheads.inference.certified_argmax import certified_argmax_for

from ..conftest import build_tiny_target
from .conftest import left_pad

VOCAB = 97


@pytest.fixture(scope="module")
def models():
    target = build_tiny_target("llama", seed=11)
    eagle = SpeculativeLM(target, create_heads(target, "eagle", tree_depth=3, tree_top_k=3, tree_num_nodes=7))
    medusa = SpeculativeLM(target, create_heads(target, "medusa", num_heads=3))
    scorer = certified_argmax_for(target)
    return target, {"eagle": eagle, "medusa": medusa}, scorer


def reference(target, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Slow reference: greedy decoding of the prompt alone, stopped right after EOS."""
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos) + 1]
    return new


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=8), min_size=1, max_size=3),
    max_new_tokens=st.integers(1, 16),
    eos_choice=st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 15))),
    head_type=st.sampled_from(["eagle", "medusa"]),
    batched=st.booleans(),
    certified=st.booleans(),
)
def test_generate_matches_the_reference(models, prompts, max_new_tokens, eos_choice, head_type, batched, certified):
    """Every row equals its own greedy decode alone, with EOS anywhere (or nowhere), for both schemes."""
    target, lms, scorer = models
    lm = lms[head_type]
    lm.certified_argmax = scorer if certified else None
    eos = None
    if eos_choice is not None:  # an EOS that really occurs inside some row's continuation
        row, position = eos_choice
        continuation = reference(target, prompts[row % len(prompts)], 16, None)
        eos = continuation[position % len(continuation)]
    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                      eos_token_id=[] if eos is None else eos, pad_token_id=0, batched=batched and len(prompts) > 1)
    for i, p in enumerate(prompts):
        expected = reference(target, p, max_new_tokens, eos)
        row = out[i, width:].tolist()
        assert row[: len(expected)] == expected, f"row {i}"
        assert all(t == 0 for t in row[len(expected):]), f"row {i} is not padded after it stopped"


class BanSumModulo(LogitsProcessor):
    """Ban token t where (t + sum(sequence)) % modulus == 0: a processor that reads each row's whole sequence."""

    def __init__(self, modulus: int) -> None:
        self.modulus = modulus

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        state = input_ids.sum(dim=1, keepdim=True) % self.modulus
        tokens = torch.arange(scores.shape[1])
        return scores.masked_fill((tokens[None] + state) % self.modulus == 0, -float("inf"))


class LastTwoSumStop(StoppingCriteria):
    """Stop once the last two tokens sum to a multiple of `modulus`."""

    def __init__(self, modulus: int) -> None:
        self.modulus = modulus

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return input_ids[:, -2:].sum(dim=1) % self.modulus == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.lists(st.integers(2, VOCAB - 1), min_size=2, max_size=8), min_size=1, max_size=3),
    max_new_tokens=st.integers(1, 16),
    ban_modulus=st.one_of(st.none(), st.integers(2, 7)),
    penalty=st.sampled_from([None, 1.3, 0.8]),
    stop_modulus=st.one_of(st.none(), st.integers(5, 17)),
    head_type=st.sampled_from(["eagle", "medusa"]),
    batched=st.booleans(),
)
def test_processors_and_stopping_match_the_reference(
    models, prompts, max_new_tokens, ban_modulus, penalty, stop_modulus, head_type, batched
):
    """Every row equals its own `target.generate` alone with the same processors and criteria, cut at the same
    token, for both batch schemes."""
    target, lms, _ = models
    lm = lms[head_type]
    lm.certified_argmax = None
    options = {}
    if ban_modulus is not None:
        options["logits_processor"] = [BanSumModulo(ban_modulus)]
    if penalty is not None:
        options["repetition_penalty"] = penalty
    if stop_modulus is not None:
        options["stopping_criteria"] = [LastTwoSumStop(stop_modulus)]
    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0,
                      batched=batched and len(prompts) > 1, **options)
    for i, p in enumerate(prompts):
        alone = target.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                **options)
        expected = alone[0, len(p):].tolist()
        row = out[i, width:].tolist()
        assert row[: len(expected)] == expected, f"row {i}"
        assert all(t == 0 for t in row[len(expected):]), f"row {i} is not padded after it stopped"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(
        st.tuples(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=10), st.integers(0, 6), st.integers(1, 14)),
        min_size=1, max_size=5,
    ),
    cancel=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 6))),
    head_type=st.sampled_from(["eagle", "medusa"]),
    round_nodes=st.sampled_from([None, 1, 2, 5, 12]),
)
def test_continuous_batching_matches_the_reference(models, arrivals, cancel, head_type, round_nodes):
    """Rows joining a `BatchEngine` at random rounds (prompts of any length, any budget), one maybe cancelled at a
    random round, under a random node budget per round: every row that was not cancelled equals its own greedy
    decode alone."""
    from specheads.inference.batched import BatchEngine

    target, lms, _ = models
    lm = lms[head_type]
    lm.certified_argmax = None
    requests = [lm.batch_request(torch.tensor([prompt]), max_new_tokens=budget) for prompt, _, budget in arrivals]
    engine, step, last_arrival = BatchEngine(lm, max_round_nodes=round_nodes), 0, max(at for _, at, _ in arrivals)
    while engine.rows or step <= last_arrival:
        engine.add([r for r, (_, at, _) in zip(requests, arrivals) if at == step])
        if cancel is not None and cancel[1] == step and cancel[0] < len(requests):
            requests[cancel[0]].cancelled = True
        if engine.rows:
            engine.step()
        step += 1
    assert engine.cache is None and all(r.finished for r in requests)
    for index, (request, (prompt, _, budget)) in enumerate(zip(requests, arrivals)):
        if cancel is not None and cancel[0] == index:
            continue
        assert request.finished and request.new_tokens == reference(target, prompt, budget, None), index
