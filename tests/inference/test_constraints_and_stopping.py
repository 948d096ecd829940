"""A caller's constraints and stopping rules, as `transformers.generate` takes them, give the target's own output.

`logits_processor` / `prefix_allowed_tokens_fn` (constrained decoding) run on every tree node with its own sequence;
`stopping_criteria` / `stop_strings` / `max_time` are checked after every emitted token, so a row ends inside an
accepted path exactly where `generate` ends it. Drafts come from an oracle (long accepted paths, a rejection at every
depth) and from real heads, per row, batched and on the static-shape fast path. (`SumModuloBan` and the greedy and
chi-square tests of the processors are in test_generate_greedy.py / test_generate_sampling.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from specheads import SpeculativeLM, create_heads

from .conftest import SumModuloBan, hf_greedy, left_pad, make_heads

PROMPT = [3, 14, 15, 92, 65, 35]


class PrefixCachedGrammar(LogitsProcessor):
    """A grammar processor built the way outlines builds its transformers processors: the first call fixes where
    generation starts, and each row's state is looked up from its parent sequence's, cached by the sequence. Raises
    when a row's parent was never processed (so it checks that tree depths are processed parents first).

    Grammar: a state in 0..4; token t is allowed in state s when t % 5 != s, and moves to state (s + t) % 5."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.states: dict[tuple[int, ...], int] = {(): 0}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.start is None:
            self.start = input_ids.shape[1]
        mask = torch.zeros_like(scores, dtype=torch.bool)
        tokens = torch.arange(scores.shape[1])
        for row, sequence in enumerate(input_ids[:, self.start :].tolist()):
            key = tuple(sequence)
            if key not in self.states:
                parent = key[:-1]
                if parent not in self.states:
                    raise AssertionError(f"the parent of {key} was never processed")
                self.states[key] = (self.states[parent] + key[-1]) % 5
            mask[row] = tokens % 5 == self.states[key]
        return scores.masked_fill(mask, -float("inf"))


class RepeatedToken(StoppingCriteria):
    """Stop once the newest token already occurs earlier in the sequence, prompt included (a caller's criterion)."""

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return (input_ids[:, :-1] == input_ids[:, -1:]).any(dim=1)


def oracle_lm(target, reference: list[int], oracle_drafter) -> SpeculativeLM:
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = oracle_drafter(reference + [1] * 8, target.config.vocab_size, depth=5, corruption_rate=0.15,
                                cycle_rejections=True, seed=3)
    return lm


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefix_cached_grammar_equals_generate(tiny_target_factory, oracle_drafter, family):
    """An outlines-style processor (state cached per sequence prefix) sees each node's parent before the node."""
    target = tiny_target_factory(family)
    ids = torch.tensor([PROMPT])
    expected = hf_greedy(target, ids, 50, logits_processor=LogitsProcessorList([PrefixCachedGrammar()]))
    assert not torch.equal(expected, hf_greedy(target, ids, 50)), "the grammar changes the output"
    lm = oracle_lm(target, expected[0].tolist(), oracle_drafter)
    out = lm.generate(ids, max_new_tokens=50, logits_processor=LogitsProcessorList([PrefixCachedGrammar()]))
    assert torch.equal(out, expected)
    assert lm.last_stats["mean_accepted"] > 2
    # real (untrained) heads, sampling too: the grammar holds on every sampled token
    lm = SpeculativeLM(target, make_heads(target, "eagle"), lookup_tokens=4)
    assert torch.equal(lm.generate(ids, max_new_tokens=50, logits_processor=[PrefixCachedGrammar()]), expected)
    torch.manual_seed(0)
    sampled = lm.generate(ids, max_new_tokens=40, do_sample=True, logits_processor=[PrefixCachedGrammar()])
    state = 0
    for token in sampled[0, len(PROMPT) :].tolist():
        assert token % 5 != state
        state = (state + token) % 5


def test_a_callers_processor_replaces_the_built_one_of_its_type(tiny_target_factory):
    """transformers' merge rule: a caller's RepetitionPenaltyLogitsProcessor takes the place of the one the
    generation config would build (not both)."""
    target = copy.deepcopy(tiny_target_factory("llama"))
    target.generation_config.repetition_penalty = 1.5
    ids = torch.tensor([PROMPT])
    custom = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(0.7)])
    expected = hf_greedy(target, ids, 40, logits_processor=custom)
    assert not torch.equal(expected, hf_greedy(target, ids, 40))
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    assert torch.equal(lm.generate(ids, max_new_tokens=40, logits_processor=custom), expected)


def test_prefix_allowed_tokens_fn_gets_the_callers_row_in_batches(tiny_target_factory):
    """batch_id is the caller's row for every node of that row's trees (transformers' processor would pass the
    node's index), batched and row by row; the constraint holds on every row."""
    target = tiny_target_factory("llama")
    prompts = [PROMPT, [27, 18], [4, 40, 41, 42, 40]]
    ids, mask = left_pad(prompts)
    seen: dict[int, set[tuple[int, ...]]] = {0: set(), 1: set(), 2: set()}

    def only_tokens_of_the_row_parity(batch_id: int, sequence: torch.Tensor) -> list[int]:
        prompt = prompts[batch_id]
        seen[batch_id].add(tuple(sequence[: len(prompt)].tolist()))
        return [t for t in range(97) if t % 3 == batch_id]

    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    for batched in (True, False):
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=20, batched=batched,
                          prefix_allowed_tokens_fn=only_tokens_of_the_row_parity)
        for row, prompt in enumerate(prompts):
            assert seen[row] == {tuple(prompt)}, (batched, row)  # row `row`'s sequences only, never padding
            assert all(t % 3 == row for t in out[row, ids.shape[1] :].tolist())
            alone = hf_greedy(target, torch.tensor([prompt]), 20,
                              prefix_allowed_tokens_fn=lambda _, s, r=row: [t for t in range(97) if t % 3 == r])
            assert torch.equal(out[row, ids.shape[1] :], alone[0, len(prompt) :]), (batched, row)


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_processors_on_the_fast_path(tiny_target_factory, head_type):
    """The static-shape fast path (per-phase rounds; eager on the CPU) applies processors too, with prompt lookup,
    greedy and sampled."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, head_type), lookup_tokens=6)
    ids = torch.tensor([PROMPT])
    grammar = dict(logits_processor=[PrefixCachedGrammar()])
    expected = hf_greedy(target, ids, 40, **grammar)
    out = lm.generate(ids, max_new_tokens=40, fast_path=True, logits_processor=[PrefixCachedGrammar()])
    assert lm.last_stats["fast_path"] and torch.equal(out, expected)
    out = lm.generate(ids, max_new_tokens=40, fast_path=True, repetition_penalty=1.3, logits_processor=[SumModuloBan()])
    assert torch.equal(out, hf_greedy(target, ids, 40, repetition_penalty=1.3, logits_processor=[SumModuloBan()]))
    torch.manual_seed(0)
    sampled = lm.generate(ids, max_new_tokens=40, do_sample=True, fast_path=True, logits_processor=[PrefixCachedGrammar()])
    assert lm.last_stats["fast_path"]
    state = 0
    for token in sampled[0, len(PROMPT) :].tolist():
        assert token % 5 != state
        state = (state + token) % 5


def test_processors_refuse_bad_values(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    ids = torch.tensor([PROMPT])
    with pytest.raises(TypeError, match="logits_processor holds 3, which is not callable"):
        lm.generate(ids, max_new_tokens=4, logits_processor=[3])
    with pytest.raises(TypeError, match="prefix_allowed_tokens_fn must be callable"):
        lm.generate(ids, max_new_tokens=4, prefix_allowed_tokens_fn=[1, 2])


# --- stopping ------------------------------------------------------------------------------------------------
def stop_string_inside(tokenizer, ids, continuation: list[int]) -> str:
    """A stop string that ends inside the continuation (after its 15th token), spanning a token boundary."""
    text = tokenizer.decode(continuation[:16])
    return text[-6:]


def test_stop_strings_end_inside_accepted_paths(stories260k, oracle_drafter):
    """Stop strings (given or from the generation config) end the output right after the token completing them,
    also when the round that emitted it accepted more: as `generate(stop_strings=..., tokenizer=...)`."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    plain = hf_greedy(target, ids, 60)
    stop = stop_string_inside(tokenizer, ids, plain[0, ids.shape[1] :].tolist())
    expected = hf_greedy(target, ids, 60, stop_strings=[stop, "never there"], tokenizer=tokenizer)
    assert ids.shape[1] + 10 < expected.shape[1] < plain.shape[1]
    lm = oracle_lm(target, plain[0].tolist(), oracle_drafter)
    out = lm.generate(ids, max_new_tokens=60, stop_strings=[stop, "never there"], tokenizer=tokenizer)
    assert torch.equal(out, expected)
    assert lm.last_stats["mean_accepted"] > 2
    # from the generation config, with the SpeculativeLM's tokenizer, on real heads, also on the fast path
    target = copy.deepcopy(target)
    target.generation_config.stop_strings = stop
    for head_type in ("medusa", "eagle3"):
        lm = SpeculativeLM(target, create_heads(target, head_type), tokenizer=tokenizer, lookup_tokens=8)
        for fast_path in (False, True):
            assert torch.equal(lm.generate(ids, max_new_tokens=60, fast_path=fast_path), expected), (head_type, fast_path)


def test_stopping_criteria_per_row_in_batches(tiny_target_factory):
    """A caller's criterion ends each row where `generate` alone ends it (the other rows go on; the ended one is
    padded), batched and row by row. Like processors, criteria see each row's own sequence, without padding."""
    target = tiny_target_factory("qwen2")
    prompts = [[3, 14, 15, 92, 65], [27, 18], [4, 40, 41, 42, 43]]
    ids, mask = left_pad(prompts)
    criteria = StoppingCriteriaList([RepeatedToken()])
    alone = [hf_greedy(target, torch.tensor([p]), 30, stopping_criteria=criteria)[0, len(p) :] for p in prompts]
    assert len({a.shape[0] for a in alone}) > 1 and max(a.shape[0] for a in alone) < 30
    lm = SpeculativeLM(target, make_heads(target, "eagle"), lookup_tokens=4)
    for batched in (True, False):
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=30, batched=batched, stopping_criteria=criteria,
                          pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + max(a.shape[0] for a in alone)
        for row, new in enumerate(alone):
            assert torch.equal(out[row, ids.shape[1] : ids.shape[1] + new.shape[0]], new), (row, batched)
            assert (out[row, ids.shape[1] + new.shape[0] :] == 0).all()  # padded after the stop


def test_max_time_and_missing_tokenizer(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    ids = torch.tensor([PROMPT])
    out = lm.generate(ids, max_new_tokens=30, max_time=1e-9)  # spent before the first token: it alone is kept
    assert out.shape[1] == len(PROMPT) + 1
    assert torch.equal(out, hf_greedy(target, ids, 30, max_time=1e-9))
    with pytest.raises(ValueError, match="stop_strings=\\['x'\\] need the target's tokenizer"):
        lm.generate(ids, max_new_tokens=4, stop_strings=["x"])
    with pytest.raises(ValueError, match="max_time=0 must be > 0"):
        lm.generate(ids, max_new_tokens=4, max_time=0)
    with pytest.raises(TypeError, match="stopping_criteria holds 'x', which is not callable"):
        lm.generate(ids, max_new_tokens=4, stopping_criteria=["x"])
