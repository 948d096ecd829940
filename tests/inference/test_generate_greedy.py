"""Greedy speculative generation is token-identical to `target.generate(do_sample=False)`.

With untrained heads of every type (drafts mostly rejected) and with an oracle drafter that proposes the
target's own greedy continuation with corrupted positions, rescue siblings and decoys (long accepted paths,
rejections at every depth, accepted paths that skip nodes, EOS inside an accepted path, KV compaction).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from specheads import HEAD_TYPES, SpeculativeLM, create_heads
from specheads.inference.tree import build_tree_buffers, chain_tree

from ..conftest import OTHER_FAMILIES
from .conftest import TINY_PROMPT, SumModuloBan, hf_greedy, last_token_rule, left_pad, make_heads


def check_stats(stats: dict, new_tokens: int) -> None:
    """last_stats is self-consistent: one prefill + one verification per round; tau = new tokens per forward."""
    assert stats["new_tokens"] == new_tokens
    assert stats["target_forwards"] == stats["rounds"] + 1
    assert stats["mean_accepted"] == pytest.approx(new_tokens / stats["target_forwards"])
    accepted_total = round(sum(stats["accepted_per_depth"]) * stats["rounds"])
    emitted_if_untruncated = (
        1 + stats["rounds"] + accepted_total
    )  # prefill token + (accepted + bonus) per round
    # Only the last round may be cut short (by max_new_tokens or EOS), and it emits at least one token.
    assert 0 <= emitted_if_untruncated - new_tokens <= max(accepted_total, 0)
    fractions = stats["accepted_per_depth"]
    assert all(1 >= a >= b >= 0 for a, b in zip(fractions, fractions[1:]))
    assert stats["seconds"] > 0 and stats["tokens_per_second"] > 0
    # the prompt's forward is timed apart from the rounds (bench reports ms per round from these)
    assert 0 < stats["prefill_seconds"] < stats["seconds"]
    rounds = max(stats["rounds"], 1)
    assert stats["ms_per_round"] == pytest.approx(1000 * (stats["seconds"] - stats["prefill_seconds"]) / rounds)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_untrained_heads_give_the_target_greedy_output(target_and_prompt, head_type):
    """Every head type, untrained: the output equals plain greedy generate token for token."""
    target, ids = target_and_prompt
    lm = SpeculativeLM(target, make_heads(target, head_type))
    out = lm.generate(ids, max_new_tokens=40)
    expected = hf_greedy(target, ids, 40)
    assert torch.equal(out, expected)
    check_stats(lm.last_stats, expected.shape[1] - ids.shape[1])


@pytest.mark.parametrize("tree", ["medusa_small", chain_tree(3)])
def test_medusa_with_other_static_trees(stories260k, tree):
    """Medusa heads with a smaller shipped tree and with a plain chain also reproduce greedy output."""
    target, tokenizer = stories260k
    ids = tokenizer("The little dog", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, make_heads(target, "medusa"), tree=tree)
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


def test_medusa_with_fewer_heads_than_the_default_tree_is_deep(stories260k):
    """3 Medusa heads: the default depth-5 tree is cut to depth 3, and the output is still the greedy one."""
    target, tokenizer = stories260k
    ids = tokenizer("The little dog", return_tensors="pt").input_ids
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, "medusa", num_heads=3))
    assert lm.drafter.tree.max_depth == 3
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


def test_eagle_with_early_stopping(stories260k):
    """EAGLE drafting that stops early (tree_stop_prob) still reproduces greedy output."""
    target, tokenizer = stories260k
    ids = tokenizer("Lily saw a bird", return_tensors="pt").input_ids
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, "eagle"), tree_depth=5, tree_top_k=3, tree_stop_prob=0.3)
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


def test_a_cpu_target_takes_the_checkpoints_cpu_tree(stories260k):
    """Heads whose config holds a `cpu_tree` draft that tree on a CPU target (the tree_* fields elsewhere), a field
    it leaves out from tree_*, and a tree given to `SpeculativeLM` over either; greedy output stays the target's."""
    target, tokenizer = stories260k
    ids = tokenizer("Lily saw a bird", return_tensors="pt").input_ids
    torch.manual_seed(0)
    eagle = create_heads(target, "eagle", tree_depth=6, tree_top_k=8, tree_num_nodes=32,
                         cpu_tree={"tree_depth": 3, "tree_num_nodes": 6, "tree_min_prob": 0.05})
    lm = SpeculativeLM(target, eagle)
    tree = lm.tree_description()
    assert (tree["depth"], tree["top_k"], tree["nodes"], tree["min_prob"]) == (3, 8, 6, 0.05)
    assert torch.equal(lm.generate(ids, max_new_tokens=24), hf_greedy(target, ids, 24))
    assert SpeculativeLM(target, eagle, tree_num_nodes=12).tree_description()["nodes"] == 12  # given: it wins
    medusa = create_heads(target, "medusa", num_heads=3, cpu_tree={"static_tree": "medusa_small"})
    assert SpeculativeLM(target, medusa).tree_description()["name"].startswith("medusa_small")  # cut to 3 heads


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_eagle_with_pruned_trees(stories260k, head_type):
    """Trees pruned to the likely nodes (tree_min_prob: their size changes from round to round) with early
    stopping still reproduce greedy output."""
    target, tokenizer = stories260k
    ids = tokenizer("Lily saw a bird", return_tensors="pt").input_ids
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, head_type), tree_depth=5, tree_top_k=3, tree_num_nodes=12,
                       tree_min_prob=0.01, tree_stop_prob=0.001)
    assert lm.tree_description()["min_prob"] == 0.01
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


def test_eagle_with_its_default_tree(stories260k):
    """EAGLE heads with the checkpoint's default (larger) dynamic tree."""
    target, tokenizer = stories260k
    ids = tokenizer("Lily saw a bird", return_tensors="pt").input_ids
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, "eagle"))
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


# --- the oracle drafter ---------------------------------------------------------------------------------------
def oracle_lm(target, ids, greedy_reference, oracle_drafter, max_new_tokens: int, depth: int = 5, **options):
    """A SpeculativeLM whose drafter knows the greedy continuation (untrained Medusa heads just satisfy the API)."""
    prompt = ids[0].tolist()
    reference = prompt + greedy_reference(target, prompt, max_new_tokens + depth + 2)
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = oracle_drafter(reference, target.config.vocab_size, depth=depth, **options)
    return lm, reference


def test_oracle_drafts_exercise_every_acceptance_depth(target_and_prompt, greedy_reference, oracle_drafter):
    """Mostly-right drafts: identical output, long accepted paths, a rejection at every depth, rescued paths.

    The drafter also checks that each round accepted exactly the longest correct drafted prefix.
    """
    target, ids = target_and_prompt
    depth, n = 5, 120
    lm, reference = oracle_lm(
        target,
        ids,
        greedy_reference,
        oracle_drafter,
        n,
        depth,
        corruption_rate=0.1,
        cycle_rejections=True,
        seed=1,
    )
    out = lm.generate(ids, max_new_tokens=n, eos_token_id=[])
    assert out[0].tolist() == reference[: ids.shape[1] + n]
    drafter = lm.drafter
    drafter.check_accepted()
    assert set(drafter.accepted) == set(range(depth + 1)), "every depth 0..5 should end a round"
    assert drafter.rescued_rounds > 1, "some accepted paths should go through a later sibling"
    stats = lm.last_stats
    check_stats(stats, n)
    assert stats["mean_accepted"] > 1.5
    assert stats["rounds"] == len(drafter.roots)
    assert stats["accepted_per_depth"][0] > 0.5


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", *OTHER_FAMILIES])
def test_oracle_output_equals_hf_generate(tiny_target_factory, greedy_reference, oracle_drafter, family):
    """With the oracle drafter, the speculative output also equals transformers' own greedy generate."""
    target = tiny_target_factory(family)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    lm, _ = oracle_lm(target, ids, greedy_reference, oracle_drafter, 60, corruption_rate=0.2, seed=2)
    assert torch.equal(lm.generate(ids, max_new_tokens=60), hf_greedy(target, ids, 60))
    lm.drafter.check_accepted()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6, 7, 8, 13, 20])
def test_max_new_tokens_cuts_inside_an_accepted_path(
    tiny_llama, greedy_reference, oracle_drafter, max_new_tokens
):
    """Perfect drafts (6 tokens per round): the output still stops at exactly max_new_tokens."""
    ids = torch.tensor([TINY_PROMPT])
    lm, reference = oracle_lm(
        tiny_llama, ids, greedy_reference, oracle_drafter, max_new_tokens, corruption_rate=0.0
    )
    out = lm.generate(ids, max_new_tokens=max_new_tokens)
    assert out[0].tolist() == reference[: len(TINY_PROMPT) + max_new_tokens]
    assert torch.equal(out, hf_greedy(tiny_llama, ids, max_new_tokens))
    check_stats(lm.last_stats, max_new_tokens)
    assert lm.last_stats["target_forwards"] == 1 + -(-(max_new_tokens - 1) // 6)  # ceil((n - 1) / 6) rounds


@pytest.mark.parametrize("target_name", ["stories260K", "llama"])
def test_eos_inside_an_accepted_path(target_name, target_and_prompt_for, greedy_reference, oracle_drafter):
    """EOS drafted (not the bonus) mid-path: generation stops right after it, exactly as transformers does."""
    target, ids = target_and_prompt_for(target_name)
    depth, n = 5, 60
    lm, reference = oracle_lm(target, ids, greedy_reference, oracle_drafter, n, depth, corruption_rate=0.0)
    prompt_length = ids.shape[1]
    continuation = reference[prompt_length : prompt_length + n]
    # Roots sit at continuation offsets 0, 6, 12, ...: pick a token first seen at a drafted offset.
    eos_offset = next(
        i for i, t in enumerate(continuation) if i >= 8 and i % (depth + 1) != 0 and t not in continuation[:i]
    )
    eos = continuation[eos_offset]
    out = lm.generate(ids, max_new_tokens=n, eos_token_id=eos)
    expected = hf_greedy(target, ids, n, eos_token_id=eos)
    assert torch.equal(out, expected)
    assert out[0].tolist() == reference[: prompt_length + eos_offset + 1]  # stops right after EOS
    last_root = lm.drafter.roots[-1]
    assert (
        last_root < prompt_length + eos_offset <= last_root + depth
    )  # EOS was a drafted node, not the bonus
    check_stats(lm.last_stats, eos_offset + 1)


def test_eos_list_and_default_eos(stories260k, greedy_reference, oracle_drafter):
    """eos_token_id may be a list; without it the target's generation config's EOS applies."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm, reference = oracle_lm(target, ids, greedy_reference, oracle_drafter, 40, corruption_rate=0.3)
    continuation = reference[ids.shape[1] :]
    eos = [continuation[15], continuation[25]]
    assert torch.equal(
        lm.generate(ids, max_new_tokens=40, eos_token_id=eos), hf_greedy(target, ids, 40, eos_token_id=eos)
    )
    assert target.generation_config.eos_token_id == 2
    assert torch.equal(lm.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))


def test_eos_as_the_first_new_token(tiny_llama, greedy_reference):
    """When the prefill's own token is EOS, exactly one token is produced."""
    ids = torch.tensor([TINY_PROMPT])
    first = greedy_reference(tiny_llama, TINY_PROMPT, 1)[0]
    lm = SpeculativeLM(tiny_llama, make_heads(tiny_llama, "eagle"))
    out = lm.generate(ids, max_new_tokens=10, eos_token_id=first)
    assert out[0].tolist() == TINY_PROMPT + [first]
    assert lm.last_stats["target_forwards"] == 1


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_zero_and_one_new_tokens(stories260k, head_type):
    """max_new_tokens=0 returns the prompt without running the target; 1 runs the prefill only."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, make_heads(target, head_type))
    assert torch.equal(lm.generate(ids, max_new_tokens=0), ids)
    assert lm.last_stats["new_tokens"] == 0 and lm.last_stats["target_forwards"] == 0
    assert torch.equal(lm.generate(ids, max_new_tokens=1), hf_greedy(target, ids, 1))
    assert lm.last_stats["new_tokens"] == 1 and lm.last_stats["target_forwards"] == 1


def test_one_dimensional_prompt(stories260k):
    """A (n,) prompt is treated as a batch of one, as in the API docstring."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    assert torch.equal(lm.generate(ids[0], max_new_tokens=12), hf_greedy(target, ids, 12))


@pytest.fixture(scope="module")
def target_and_prompt_for(stories260k, tiny_target_factory):
    def get(name: str):
        if name == "stories260K":
            target, tokenizer = stories260k
            return target, tokenizer("Once upon a time", return_tensors="pt").input_ids
        return tiny_target_factory(name), torch.tensor([TINY_PROMPT])

    return get


@pytest.mark.parametrize(
    ("family", "window_options"),
    [
        pytest.param("mistral", dict(sliding_window=8), id="mistral"),  # every layer windowed
        pytest.param(
            "qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), id="qwen2"
        ),  # a full layer, then a sliding one
    ],
)
def test_sliding_window_target_past_its_window(tiny_target_factory, family, window_options):
    """A target whose sliding window (8) is shorter than the sequence must still match greedy generate."""
    target = tiny_target_factory(family, **window_options)
    ids = torch.tensor([TINY_PROMPT])
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


# --- processors that read the sequence so far (repetition penalty, n-gram blocking, minimum lengths) ---------
SEQUENCE_SETTINGS = {
    "repetition_penalty=1.3": dict(repetition_penalty=1.3),
    "repetition_penalty=0.8": dict(repetition_penalty=0.8),  # < 1 favours repeats: long loops, deep paths
    "no_repeat_ngram_size=2": dict(no_repeat_ngram_size=2),
    "no_repeat_ngram_size=3+penalty": dict(no_repeat_ngram_size=3, repetition_penalty=1.1),
    "min_new_tokens=25": dict(min_new_tokens=25),  # with an EOS that plain decoding emits early
    "bad words + suppressed": {},  # a bigram and a token of the plain continuation, chosen in the test
    "sequence bias": {},  # biases on a bigram and a token of the plain continuation, chosen in the test
    "logits_processor": dict(logits_processor=LogitsProcessorList([SumModuloBan(3)])),  # a caller's own processor
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=last_token_rule, repetition_penalty=1.2),
}


def early_eos(target, ids) -> int:
    """A token plain greedy decoding first emits at a new-token index in [4, 12): as EOS it stops decoding there."""
    continuation = hf_greedy(target, ids, 12)[0, ids.shape[1]:].tolist()
    return next(t for i, t in enumerate(continuation) if i >= 4 and t not in continuation[:i])


@pytest.mark.parametrize("setting", list(SEQUENCE_SETTINGS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sequence_processors_with_oracle_drafts_equal_hf_generate(tiny_target_factory, oracle_drafter, family, setting):
    """transformers' processors that read the sequence, applied per tree node to its own path plus everything
    before it: long accepted paths, rejections at every depth, rescued siblings; identical to `generate`."""
    target = tiny_target_factory(family)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    n, options = 60, dict(SEQUENCE_SETTINGS[setting])
    if "min_new_tokens" in options:
        options["eos_token_id"] = early_eos(target, ids)
        assert hf_greedy(target, ids, n, eos_token_id=options["eos_token_id"]).shape[1] <= ids.shape[1] + 12
    if setting == "bad words + suppressed":  # a two-token bad word (banned after its first token only) and a token
        plain = hf_greedy(target, ids, n)[0, ids.shape[1]:].tolist()
        options = dict(bad_words_ids=[plain[3:5]], suppress_tokens=[plain[10]])
    if setting == "sequence bias":  # finite biases: applied before the repetition penalty, as transformers does
        plain = hf_greedy(target, ids, n)[0, ids.shape[1]:].tolist()
        options = dict(sequence_bias={tuple(plain[3:5]): -4.0, (plain[12],): -3.0}, repetition_penalty=1.2)
    expected = hf_greedy(target, ids, n, **options)
    reference = expected[0].tolist() + [1] * 8  # drafts may run past the end (EOS stops the output there)
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = oracle_drafter(reference, target.config.vocab_size, depth=5, corruption_rate=0.15,
                                cycle_rejections=True, seed=3)
    out = lm.generate(ids, max_new_tokens=n, **options)
    assert torch.equal(out, expected)
    assert lm.last_stats["mean_accepted"] > 2
    assert not torch.equal(out, hf_greedy(target, ids, n, eos_token_id=options.get("eos_token_id"))), "no effect"
    if "min_new_tokens" in options:
        assert out.shape[1] >= ids.shape[1] + 25


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_sequence_processors_from_the_generation_config(stories260k, head_type):
    """Set in the target's generation config (Qwen2.5-Instruct ships repetition_penalty=1.05), they apply without
    an argument, like transformers (min_length and begin_suppress_tokens only come from there); prompt lookup's copied runs are processed
    too; also on the static-shape fast path."""
    target, tokenizer = stories260k
    target = copy.deepcopy(target)
    config = target.generation_config
    config.repetition_penalty, config.no_repeat_ngram_size, config.min_length = 1.2, 4, 40
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    config.begin_suppress_tokens = [int(hf_greedy(target, ids, 1)[0, -1])]  # the first token transformers would pick
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, head_type), lookup_tokens=8)
    eos = int(hf_greedy(target, ids, 8, repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0)[0, -1])
    out = lm.generate(ids, max_new_tokens=60, eos_token_id=eos)
    assert torch.equal(out, hf_greedy(target, ids, 60, eos_token_id=eos))
    assert out.shape[1] >= 40  # min_length kept the early EOS out
    fast = lm.generate(ids, max_new_tokens=60, eos_token_id=eos, fast_path=True)  # static cache, per-phase rounds
    assert lm.last_stats["fast_path"] and torch.equal(fast, out)


@pytest.mark.parametrize("penalty", [1.5, 0.7])  # < 1: loops that prompt lookup guesses deep into
@pytest.mark.parametrize("head_type", ["medusa", "eagle3"])
def test_repetition_penalty_in_batched_verification(tiny_target_factory, head_type, penalty):
    """Left-padded rows verified in one forward, each with its own tokens so far: every row equals its own
    `generate(repetition_penalty=...)` alone (padding is not part of any row's sequence, as in transformers)."""
    target = tiny_target_factory("llama")
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18], [4, 40, 41, 42, 40]]
    ids, mask = left_pad(prompts)
    lm = SpeculativeLM(target, make_heads(target, head_type), lookup_tokens=6)
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=30, repetition_penalty=penalty, batched=True)
    assert lm.last_stats["batched_forwards"] > 0
    for i, prompt in enumerate(prompts):
        alone = hf_greedy(target, torch.tensor([prompt]), 30, repetition_penalty=penalty)
        assert torch.equal(out[i, ids.shape[1]:], alone[0, len(prompt):]), f"row {i}"


class PerRowChainOracle:
    """A drafter with `fork()` (so rows verify in one batched forward) that drafts each row's own reference
    continuation as a chain of `depth` tokens, corrupting depth 1 + r % (depth + 1) in round r: deep accepted paths
    of new tokens and a rejection at every depth. A row is recognised by its prompt (the first call's tokens)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, depth: int = 4) -> None:
        self.references, self.vocab_size, self.depth = references, vocab_size, depth

    def fork(self) -> PerRowChainOracle:
        return PerRowChainOracle(self.references, self.vocab_size, self.depth)

    def reset(self) -> None:
        self.reference, self.root, self.round = None, 0, 0

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor):
        tokens = next_tokens.tolist()
        if self.reference is None:  # prompt[1:] + the first token: the reference is prompt + continuation
            self.reference = self.references[tuple(tokens[:-1])]
        self.root += len(tokens)  # index of this round's root in the reference
        chain = list(self.reference[self.root : self.root + self.depth + 1])
        wrong = 1 + self.round % (self.depth + 1)
        if wrong < len(chain):
            chain[wrong] = (chain[wrong] + 1) % self.vocab_size
        self.round += 1
        return torch.tensor(chain), build_tree_buffers(torch.arange(len(chain)) - 1)


@pytest.mark.parametrize("setting", ["repetition_penalty=1.3", "repetition_penalty=0.8", "no_repeat_ngram_size=2",
                                     "logits_processor", "prefix_allowed_tokens_fn"])
def test_sequence_processors_in_batched_verification_with_deep_paths(tiny_target_factory, setting):
    """Batched verification with drafts right up to a corrupted depth: each node is processed with its own path,
    also where its tokens are new to the row (equal to every row's own `generate` alone)."""
    target = tiny_target_factory("qwen2")
    options = SEQUENCE_SETTINGS[setting]
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18], [4, 40, 41, 42, 40]]
    references = {tuple(p[1:]): hf_greedy(target, torch.tensor([p]), 50, **options)[0].tolist() for p in prompts}
    ids, mask = left_pad(prompts)
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = PerRowChainOracle(references, target.config.vocab_size)
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=40, batched=True, **options)
    assert lm.last_stats["batched_forwards"] > 0 and lm.last_stats["mean_accepted"] > 2
    for i, prompt in enumerate(prompts):
        assert out[i, ids.shape[1]:].tolist() == references[tuple(prompt[1:])][len(prompt) : len(prompt) + 40], i
