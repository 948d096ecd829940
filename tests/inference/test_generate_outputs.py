"""`generate(return_dict_in_generate=True, output_scores=True, output_logits=True)` and `generation_config=`, as
transformers has them: the same sequences, and per generated token the target's logits and the scores it chose
from (equal to `target.generate`'s up to floating-point noise: one tree forward instead of one per token).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

from specheads import SpeculativeLM

from .conftest import hf_greedy, left_pad, make_heads

PROMPT = [3, 14, 15, 92, 65, 35]
OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


def assert_steps_close(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...], rows=slice(None)) -> None:
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        a = a[rows]  # theirs: one row per call
        assert a.dtype == torch.float32 and a.shape == b.shape, step
        assert torch.equal(a.isinf(), b.isinf()), step  # the same tokens banned / cut
        finite = a.isfinite()
        assert torch.allclose(a[finite], b[finite], atol=1e-4, rtol=1e-4), step


@pytest.mark.parametrize("options", [{}, dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2)],
                         ids=["plain", "penalty", "ngrams"])
def test_greedy_scores_and_logits_equal_generate(tiny_target_factory, oracle_drafter, options):
    """Oracle drafts (rounds of up to 6 tokens, rejections at every depth): every step's logits and scores."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([PROMPT])
    expected = hf_greedy(target, ids, 40, **options, **OUTPUTS)
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = oracle_drafter(expected.sequences[0].tolist() + [1] * 8, 97, depth=5, corruption_rate=0.15,
                                cycle_rejections=True, seed=3)
    out = lm.generate(ids, max_new_tokens=40, **options, **OUTPUTS)
    assert torch.equal(out.sequences, expected.sequences)
    assert lm.last_stats["mean_accepted"] > 2
    assert_steps_close(out.logits, expected.logits)
    assert_steps_close(out.scores, expected.scores)
    if options:
        assert not all(torch.equal(a, b) for a, b in zip(out.scores, out.logits)), "scores are processed"


def test_outputs_on_the_fast_path_and_with_real_heads(tiny_target_factory):
    target = tiny_target_factory("qwen2")
    ids = torch.tensor([PROMPT])
    expected = hf_greedy(target, ids, 30, **OUTPUTS)
    for head_type in ("eagle", "eagle3"):
        lm = SpeculativeLM(target, make_heads(target, head_type), lookup_tokens=6)
        for fast_path in (False, True):
            out = lm.generate(ids, max_new_tokens=30, fast_path=fast_path, **OUTPUTS)
            assert torch.equal(out.sequences, expected.sequences), (head_type, fast_path)
            assert_steps_close(out.scores, expected.scores)
            log_probs = target.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            expected_log_probs = target.compute_transition_scores(expected.sequences, expected.scores, normalize_logits=True)
            assert torch.allclose(log_probs, expected_log_probs, atol=1e-4)  # per-token log-probabilities
    only_scores = lm.generate(ids, max_new_tokens=30, return_dict_in_generate=True, output_scores=True)
    assert only_scores.logits is None and len(only_scores.scores) == 30
    assert torch.equal(lm.generate(ids, max_new_tokens=30, output_scores=True), expected.sequences)  # no dict asked


def test_sampled_scores_are_the_warped_distribution_of_each_step(tiny_target_factory):
    """Sampling: step k's scores are transformers' processed and warped scores after the sampled prefix (top-k
    leaves exactly k finite), computed here by `target.generate` one step at a time on that prefix."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([PROMPT])
    settings = dict(do_sample=True, temperature=0.8, top_k=7, repetition_penalty=1.2)
    lm = SpeculativeLM(target, make_heads(target, "eagle"), lookup_tokens=4)
    torch.manual_seed(0)
    out = lm.generate(ids, max_new_tokens=12, **settings, **OUTPUTS)
    assert len(out.scores) == 12
    for step, scores in enumerate(out.scores):
        assert int(scores.isfinite().sum()) == 7
        prefix = out.sequences[:, : ids.shape[1] + step]
        theirs = target.generate(prefix, max_new_tokens=1, **settings, **OUTPUTS)
        assert_steps_close((scores,), theirs.scores)
        assert_steps_close((out.logits[step],), theirs.logits)
        assert scores[0, out.sequences[0, ids.shape[1] + step]].isfinite()  # the sampled token was allowed


@pytest.mark.parametrize("settings", [{}, dict(do_sample=True, temperature=0.8, top_k=7)], ids=["greedy", "sample"])
def test_renormalized_scores_are_log_probabilities_as_in_generate(tiny_target_factory, settings):
    """A generation config with renormalize_logits=True: transformers returns log-softmaxed scores; so does this."""
    target = copy.deepcopy(tiny_target_factory("llama"))
    target.generation_config.renormalize_logits = True
    ids = torch.tensor([PROMPT])
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    torch.manual_seed(0)
    out = lm.generate(ids, max_new_tokens=8, **settings, **OUTPUTS)
    for step, scores in enumerate(out.scores):
        prefix = out.sequences[:, : ids.shape[1] + step]
        theirs = target.generate(prefix, max_new_tokens=1, **{"do_sample": False, **settings}, **OUTPUTS)
        assert_steps_close((scores,), theirs.scores)
        assert torch.allclose(scores.exp().sum(), torch.tensor(1.0), atol=1e-4)  # log-probabilities


@pytest.mark.parametrize("batched", [True, False])
def test_batch_outputs_per_row_with_early_ends(tiny_target_factory, batched):
    """Rows that stop early (their own EOS) get -inf steps after their end; every row's real steps equal its own
    `generate` alone."""
    target = tiny_target_factory("llama")
    prompts = [PROMPT, [27, 18], [4, 40, 41, 42, 40]]
    ids, mask = left_pad(prompts)
    plain = hf_greedy(target, torch.tensor([prompts[1]]), 10)[0, 2:].tolist()
    eos = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i])  # row 1 stops there (others: later
    # or never)
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, batched=batched, **OUTPUTS)
    assert len(out.scores) == out.sequences.shape[1] - ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone = hf_greedy(target, torch.tensor([prompt]), 20, eos_token_id=eos, **OUTPUTS)
        steps = len(alone.scores)
        assert torch.equal(out.sequences[row, ids.shape[1] : ids.shape[1] + steps], alone.sequences[0, len(prompt) :])
        assert_steps_close(out.scores[:steps], alone.scores, rows=slice(row, row + 1))
        assert all(s[row].isneginf().all() for s in out.scores[steps:])
    lengths = [len(hf_greedy(target, torch.tensor([p]), 20, eos_token_id=eos, **OUTPUTS).scores) for p in prompts]
    assert lengths[1] < max(lengths), "a row ended early"


def test_generation_config_argument(tiny_target_factory):
    """A GenerationConfig given to generate replaces the target's own for every default, as in transformers
    (processors, EOS, pad, and return_dict_in_generate / output_scores)."""
    target = copy.deepcopy(tiny_target_factory("llama"))
    target.generation_config.repetition_penalty = 0.5  # ignored: the argument's config wins
    ids = torch.tensor([PROMPT])
    eos = hf_greedy(target, ids, 12, repetition_penalty=1.4)[0, -1].item()
    config = GenerationConfig(repetition_penalty=1.4, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
                              output_scores=True)
    expected = target.generate(ids, generation_config=config, max_new_tokens=30, do_sample=False)
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    out = lm.generate(ids, generation_config=config, max_new_tokens=30)
    assert torch.equal(out.sequences, expected.sequences) and out.sequences[0, -1] == eos
    assert_steps_close(out.scores, expected.scores)
    assert out.logits is None


def test_num_return_sequences(tiny_target_factory):
    """Sampling: n continuations per prompt, prompt i's in rows i * n ... i * n + n - 1 (transformers' order), each an
    allowed sample; greedy refuses n > 1 as transformers does."""
    target = tiny_target_factory("llama")
    prompts = [PROMPT, [27, 18]]
    ids, mask = left_pad(prompts)
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    torch.manual_seed(0)
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=5, num_return_sequences=3,
                      **OUTPUTS)
    assert out.sequences.shape == (6, ids.shape[1] + 8)
    for row in range(6):
        assert torch.equal(out.sequences[row, : ids.shape[1]], ids[row // 3])
        for step in range(8):  # every sampled token was among that step's 5 finite scores
            assert out.scores[step][row, out.sequences[row, ids.shape[1] + step]].isfinite()
    assert len({tuple(r) for r in out.sequences[:3].tolist()}) > 1, "independent samples"
    with pytest.raises(ValueError, match="num_return_sequences=2 needs do_sample=True"):
        lm.generate(ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences=0 must be an integer >= 1"):
        lm.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, num_return_sequences=0)


def test_max_length_counts_the_prompt(tiny_target_factory):
    """max_length as in transformers: prompt + new tokens; max_new_tokens wins when both are given."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([PROMPT])
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    out = lm.generate(ids, max_length=20)
    assert out.shape[1] == 20 and torch.equal(out, target.generate(ids, max_length=20, do_sample=False))
    assert lm.generate(ids, max_length=20, max_new_tokens=5).shape[1] == len(PROMPT) + 5
    assert lm.generate(ids).shape[1] == len(PROMPT) + 128  # the default budget
    with pytest.raises(ValueError, match="max_length=6 leaves no room after the prompt of 6 tokens"):
        lm.generate(ids, max_length=6)
