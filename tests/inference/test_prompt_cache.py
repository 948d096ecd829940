"""`generate(prompt_cache=...)`: each turn of a conversation runs only its new tokens, and outputs stay the target's.

Every turn is compared with `target.generate` on the whole conversation (no cache), and the target's forwards are
watched to see that the prompt's shared prefix was not run again.
"""

from __future__ import annotations

import pytest
import torch

from specheads import HEAD_TYPES, SpeculativeLM
from specheads.inference.kv_cache import cache_length
from specheads.inference.prompt_cache import PromptCache

from .conftest import TINY_PROMPT, hf_greedy, make_heads

FOLLOW_UPS = ([7, 21, 4], [40, 2], [9, 9, 9, 13, 5])  # tokens a "user" appends after each answer


class PrefillWatch:
    """Records the length of every target forward's input_ids (a forward pre-hook on the target)."""

    def __init__(self, target) -> None:
        self.lengths: list[int] = []
        self.handle = target.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[-1]))

    def close(self) -> None:
        self.handle.remove()


def conversation(lm, target, first: torch.Tensor, turns: int, max_new_tokens: int, fast_path=None, **options):
    """Run `turns` turns through one PromptCache, each prompt = the last output + a follow-up; every output is
    checked against plain greedy `generate` on the whole sequence. Yields (output, cache, stats) per turn."""
    cache, ids = PromptCache(), first
    for turn in range(turns):
        held_before = len(cache)
        watch = PrefillWatch(target)
        try:
            out = lm.generate(ids, max_new_tokens=max_new_tokens, prompt_cache=cache, fast_path=fast_path, **options)
        finally:
            watch.close()
        assert torch.equal(out, hf_greedy(target, ids, max_new_tokens, **options)), f"turn {turn}"
        stats = lm.last_stats
        assert stats["reused_prompt_tokens"] == min(held_before, ids.shape[1] - 1)
        assert stats["fast_path"] == bool(fast_path)
        # the prefill ran exactly the tokens after the reused prefix
        assert watch.lengths[0] == ids.shape[1] - stats["reused_prompt_tokens"]
        yield out, cache, stats
        ids = torch.cat([out, torch.tensor([FOLLOW_UPS[turn % len(FOLLOW_UPS)]])], dim=1)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_turns_reuse_the_conversation_and_equal_generate(target_and_prompt, head_type):
    """Three turns per family and head type: identical to `generate`; turn t reuses all of turn t-1's sequence."""
    target, ids = target_and_prompt
    lm = SpeculativeLM(target, make_heads(target, head_type))
    held = 0
    for turn, (out, cache, stats) in enumerate(conversation(lm, target, ids, 3, 24)):
        if turn:
            assert stats["reused_prompt_tokens"] == held  # all the previous call kept
        # the cache holds the output but its last token when that was the round's bonus token (never run through
        # the target), all of it when a stop fell on a drafted token; one feature each
        assert len(cache) in (out.shape[1] - 1, out.shape[1])
        assert len(cache) == cache_length(cache.cache) == cache.features.shape[0]
        assert torch.equal(cache.tokens, out[0, : len(cache)])
        held = len(cache)


def test_stops_inside_accepted_paths_keep_only_emitted_tokens(tiny_target_factory, greedy_reference, oracle_drafter):
    """Long accepted paths cut by max_new_tokens and by an EOS inside a path: the cache keeps the emitted sequence
    only (accepted tokens past the stop are dropped), and the next turn still equals `generate`."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    ids = torch.tensor([TINY_PROMPT])
    plain = hf_greedy(target, ids, 30)[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(plain) if i >= 9 and t not in plain[:i])  # first emitted at index >= 9
    cache = PromptCache()
    for turn, (max_new, options) in enumerate([(23, {}), (30, {"eos_token_id": eos}), (17, {})]):
        prompt = ids[0].tolist()
        reference = prompt + greedy_reference(target, prompt, max_new + 8)
        lm.drafter = oracle_drafter(reference, target.config.vocab_size, depth=6, corruption_rate=0.05, seed=turn)
        out = lm.generate(ids, max_new_tokens=max_new, prompt_cache=cache, **options)
        assert torch.equal(out, hf_greedy(target, ids, max_new, **options)), f"turn {turn}"
        assert max(lm.drafter.accepted, default=0) >= 4  # long paths, so the stop fell inside one
        assert len(cache) in (out.shape[1] - 1, out.shape[1]) and len(cache) == cache_length(cache.cache)
        ids = torch.cat([out, torch.tensor([[11, 3]])], dim=1)


def test_an_edited_history_reuses_the_part_before_the_edit(tiny_target_factory):
    """A prompt that departs from the cached sequence at position k reuses exactly k tokens; the same prompt sent
    again reuses all but its last token."""
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    cache = PromptCache()
    out = lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=20, prompt_cache=cache)
    edited = out.clone()
    edited[0, 12] = (edited[0, 12] + 1) % target.config.vocab_size
    again = lm.generate(edited, max_new_tokens=10, prompt_cache=cache)
    assert lm.last_stats["reused_prompt_tokens"] == 12
    assert torch.equal(again, hf_greedy(target, edited, 10))
    same = lm.generate(edited, max_new_tokens=10, prompt_cache=cache)
    assert lm.last_stats["reused_prompt_tokens"] == edited.shape[1] - 1
    assert torch.equal(same, again)


def test_sliding_window_target_past_its_window(tiny_target_factory):
    """A target whose window (8) is far shorter than the conversation: the reused entries are masked as a fresh
    prefill's would be."""
    target = tiny_target_factory("mistral", sliding_window=8)
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    for _ in conversation(lm, target, torch.tensor([TINY_PROMPT]), 3, 20):
        pass


def test_sampling_with_a_cache_draws_what_it_draws_without(tiny_target_factory):
    """The cache changes no probability: with the same seed, sampling with a filled cache gives the tokens that
    sampling the whole prompt again gives (sampling's exactness itself: the chi-square tests)."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    cache = PromptCache()
    first = lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=16, do_sample=True, prompt_cache=cache)
    ids = torch.cat([first, torch.tensor([[5, 6]])], dim=1)
    held = len(cache)
    assert held >= first.shape[1] - 1
    options = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20)
    torch.manual_seed(3)
    with_cache = lm.generate(ids, prompt_cache=cache, **options)
    assert lm.last_stats["reused_prompt_tokens"] == held
    torch.manual_seed(3)
    assert torch.equal(with_cache, lm.generate(ids, **options))


class FailAfter:
    """A logits processor that raises on its n-th call (a generation interrupted half way)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def __call__(self, input_ids, scores):
        self.calls -= 1
        if self.calls < 0:
            raise KeyboardInterrupt
        return scores


def test_an_interrupted_call_leaves_the_cache_empty_not_half_updated(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    cache = PromptCache()
    out = lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=12, prompt_cache=cache)
    ids = torch.cat([out, torch.tensor([[4, 4]])], dim=1)
    with pytest.raises(KeyboardInterrupt):
        lm.generate(ids, max_new_tokens=20, prompt_cache=cache, logits_processor=[FailAfter(3)])
    assert len(cache) == 0 and cache.cache is None
    assert torch.equal(lm.generate(ids, max_new_tokens=20, prompt_cache=cache), hf_greedy(target, ids, 20))
    assert lm.last_stats["reused_prompt_tokens"] == 0


def test_calls_a_cache_cannot_serve_are_refused(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    ids = torch.tensor([TINY_PROMPT])
    cache = PromptCache()
    with pytest.raises(ValueError, match="batch size 1"):
        lm.generate(torch.cat([ids, ids]), max_new_tokens=4, prompt_cache=cache)
    with pytest.raises(TypeError, match="PromptCache"):
        lm.generate(ids, max_new_tokens=4, prompt_cache={})
    lm.generate(ids, max_new_tokens=4, prompt_cache=cache)
    other = SpeculativeLM(target, make_heads(target, "eagle"))  # other heads: other features
    with pytest.raises(ValueError, match="another target or other heads"):
        other.generate(ids, max_new_tokens=4, prompt_cache=cache)
    cache.reset()
    assert torch.equal(other.generate(ids, max_new_tokens=4, prompt_cache=cache), hf_greedy(target, ids, 4))


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_static_fast_path_reuses_its_own_cache(tiny_target_factory, family, head_type):
    """On the static-shape fast path (run eagerly on the CPU) the entries stay in the runner's static cache: three
    turns identical to `generate`, each reusing the previous one (EAGLE: the fixed-shape graphed drafter)."""
    target = tiny_target_factory(family)
    lm = SpeculativeLM(target, make_heads(target, head_type))
    held = 0
    for turn, (_, cache, stats) in enumerate(conversation(lm, target, torch.tensor([TINY_PROMPT]), 3, 24, True)):
        assert cache.cache is lm._fast_runner.cache
        if turn:
            assert stats["reused_prompt_tokens"] == held > 0
        held = len(cache)


def test_the_fast_path_restores_its_kept_copy_once_another_prompt_was_written(tiny_target_factory):
    """Another call on the same SpeculativeLM writes its prompt into the runner's static cache: the conversation's
    next turn reads its entries from the copy its PromptCache kept (reused, identical), two conversations taking
    turns (as the server answers them on a GPU) each reuse their own; the dynamic path never reads static entries."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    cache, other = PromptCache(), PromptCache()
    out = lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=16, prompt_cache=cache, fast_path=True)
    held = len(cache)
    other_out = lm.generate(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), max_new_tokens=16, prompt_cache=other,
                            fast_path=True)  # another conversation, written over the first one's entries
    ids = torch.cat([out, torch.tensor([[8, 8]])], dim=1)
    again = lm.generate(ids, max_new_tokens=16, prompt_cache=cache, fast_path=True)
    assert lm.last_stats["reused_prompt_tokens"] == held > 0
    assert torch.equal(again, hf_greedy(target, ids, 16))
    other_ids = torch.cat([other_out, torch.tensor([[5, 5]])], dim=1)
    other_again = lm.generate(other_ids, max_new_tokens=16, prompt_cache=other, fast_path=True)
    assert lm.last_stats["reused_prompt_tokens"] > 0 and torch.equal(other_again, hf_greedy(target, other_ids, 16))
    ids = torch.cat([again, torch.tensor([[6, 6]])], dim=1)
    assert torch.equal(lm.generate(ids, max_new_tokens=8, prompt_cache=cache, fast_path=False), hf_greedy(target, ids, 8))
    assert lm.last_stats["reused_prompt_tokens"] == 0  # static entries are not handed to the dynamic path


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_the_whole_round_graph_keeps_the_conversation(tiny_target_factory, head_type):
    """The whole-round graph (run eagerly here) hands each round's path features to the cache: three turns identical
    to `generate`, each reusing the previous one, and the rounds ran as whole rounds."""
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, make_heads(target, head_type), graphed_rounds=True)
    held = 0
    for turn, (_, cache, stats) in enumerate(conversation(lm, target, torch.tensor([TINY_PROMPT]), 3, 24, True)):
        if turn:
            assert stats["reused_prompt_tokens"] == held > 0
        held = len(cache)
        round_ = lm._fast_runner.greedy_round
        assert round_ is not None and round_.prefix_length == cache.cache.committed_length  # it ran this turn
        assert cache.features.shape[0] == held


@pytest.mark.parametrize("head_type", ["eagle3", "medusa"])
def test_each_turns_new_tokens_run_through_the_padded_prompt_graph(tiny_target_factory, head_type):
    """With the graphed prompt forward (the CUDA default, forced here) a turn's new tokens after the kept conversation
    run as a padded chain too: three turns identical to `generate`, each reusing the previous one."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, head_type), graphed_prefill=True)
    cache, ids = PromptCache(), torch.tensor([TINY_PROMPT])
    for turn in range(3):
        held = len(cache)
        out = lm.generate(ids, max_new_tokens=16, prompt_cache=cache, fast_path=True)
        assert torch.equal(out, hf_greedy(target, ids, 16)), f"turn {turn}"
        assert lm.last_stats["reused_prompt_tokens"] == held and (held > 0) == (turn > 0)
        ids = torch.cat([out, torch.tensor([FOLLOW_UPS[turn % len(FOLLOW_UPS)]])], dim=1)
    assert sorted(lm._fast_runner.prompt_graphs.verifiers) == [64]  # the first prompt and both turns' new tokens


def test_new_tokens_whose_padding_would_not_fit_run_eagerly(tiny_target_factory):
    """With every prompt padded (graphed_prefill=True), a turn whose few new tokens, padded to 64 slots after the
    kept conversation, would pass the end of the runner's cache runs them eagerly instead of failing."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, make_heads(target, "eagle"), graphed_prefill=True)  # a small tree: little reserve
    cache = PromptCache()
    out = lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=40, prompt_cache=cache, fast_path=True)
    runner, held = lm._fast_runner, len(cache)
    ids = torch.cat([out, torch.tensor([[8]])], dim=1)
    assert held + 64 > runner.capacity >= ids.shape[1] + 4 + runner.reserve  # the same runner, no room for padding
    again = lm.generate(ids, max_new_tokens=4, prompt_cache=cache, fast_path=True)
    assert lm._fast_runner is runner and lm.last_stats["reused_prompt_tokens"] == held
    assert torch.equal(again, hf_greedy(target, ids, 4))


def test_the_fast_path_carries_the_conversation_into_a_larger_cache(tiny_target_factory):
    """A turn that needs more slots than the runner's static cache holds gets a new, larger runner: the shared
    entries are copied over (reused, identical), and the old cache's copy is checked like any other."""
    target = tiny_target_factory("qwen2")
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    cache = PromptCache()
    out = lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=12, prompt_cache=cache, fast_path=True)
    runner, held = lm._fast_runner, len(cache)
    ids = torch.cat([out, torch.tensor([[7, 7]])], dim=1)
    longer = lm.generate(ids, max_new_tokens=2 * runner.capacity, prompt_cache=cache, fast_path=True)
    assert lm._fast_runner is not runner and lm.last_stats["reused_prompt_tokens"] == held > 0
    assert torch.equal(longer, hf_greedy(target, ids, 2 * runner.capacity))
