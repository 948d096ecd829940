"""The fast path (static KV cache, trees padded to a fixed node count) is exact, on the CPU.

On CPU the same code runs without CUDA-graph capture: `generate(fast_path=True)` must be token-identical to
`target.generate` (untrained heads, and the oracle drafter with long accepted paths and rejections at every
depth), sampling must follow the target's exact law (the chi-square harness of test_generate_sampling.py),
static-cache compaction must equal DynamicCache compaction, and `plain_greedy_static` must equal
`target.generate`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from specheads import HEAD_TYPES, SpeculativeLM
from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.fast_path import (
    FastPathRunner,
    StaticGreedyDecoder,
    padded_slots,
    plain_greedy_static,
    use_fast_path,
)
from specheads.inference.graphed_prefill import GRAPHED_PREFILL_MAX_TOKENS, GraphedPrefill, pads_prompt
from specheads.inference.kv_cache import compact_cache
from specheads.inference.static_cache import StaticTreeCache, prefill_mask
from specheads.inference.tree import build_tree_buffers
from specheads.inference.tree_verifier import TreeVerifier
from specheads.inference.verify import verify_tree

from .conftest import TINY_PROMPT, hf_greedy, load_sampling_harness, make_heads

sampling_harness = load_sampling_harness("sampling_harness_for_fast_path")


def oracle_lm(target, ids, greedy_reference, oracle_drafter, max_new_tokens: int, depth: int = 5, **options):
    """A SpeculativeLM whose drafter knows the greedy continuation (the Medusa heads only satisfy the API)."""
    prompt = ids[0].tolist()
    reference = prompt + greedy_reference(target, prompt, max_new_tokens + depth + 2)
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = oracle_drafter(reference, target.config.vocab_size, depth=depth, **options)
    return lm, reference


def ran_fast_path(lm: SpeculativeLM) -> bool:
    runner = getattr(lm, "_fast_runner", None)
    return isinstance(runner, FastPathRunner) and bool(runner.verifiers)


# --- greedy identity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_untrained_heads_on_the_fast_path_give_the_target_greedy_output(target_and_prompt, head_type):
    target, ids = target_and_prompt
    lm = SpeculativeLM(target, make_heads(target, head_type))
    out = lm.generate(ids, max_new_tokens=40, fast_path=True)
    assert torch.equal(out, hf_greedy(target, ids, 40))
    assert ran_fast_path(lm)
    stats = lm.last_stats
    assert stats["new_tokens"] == 40 and stats["target_forwards"] == stats["rounds"] + 1


@pytest.mark.parametrize("family", ["stories260K", "llama", "qwen2"])
def test_oracle_drafts_on_the_fast_path(
    family, stories260k, tiny_target_factory, greedy_reference, oracle_drafter
):
    """Long accepted paths, rejections at every depth, paths through later siblings: still the greedy output."""
    if family == "stories260K":
        target, tokenizer = stories260k
        ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    else:
        target, ids = tiny_target_factory(family), torch.tensor([[3, 14, 15, 92, 65, 35]])
    depth, n = 5, 100
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
    out = lm.generate(ids, max_new_tokens=n, eos_token_id=[], fast_path=True)
    assert out[0].tolist() == reference[: ids.shape[1] + n]  # the target's own greedy continuation
    drafter = lm.drafter
    drafter.check_accepted()
    assert set(drafter.accepted) == set(range(depth + 1)), "every depth 0..5 should end a round"
    assert drafter.rescued_rounds > 1
    assert lm.last_stats["mean_accepted"] > 2
    assert ran_fast_path(lm)


def test_eos_inside_an_accepted_path_on_the_fast_path(tiny_llama, greedy_reference, oracle_drafter):
    ids = torch.tensor([TINY_PROMPT])
    lm, reference = oracle_lm(tiny_llama, ids, greedy_reference, oracle_drafter, 40, corruption_rate=0.0)
    continuation = reference[len(TINY_PROMPT) :]
    offset = next(
        i for i, t in enumerate(continuation) if i >= 8 and i % 6 != 0 and t not in continuation[:i]
    )
    eos = continuation[offset]
    out = lm.generate(ids, max_new_tokens=40, eos_token_id=eos, fast_path=True)
    assert torch.equal(out, hf_greedy(tiny_llama, ids, 40, eos_token_id=eos))
    assert out.shape[1] == len(TINY_PROMPT) + offset + 1


def test_a_batch_runs_row_by_row_on_the_fast_path(stories260k):
    target, tokenizer = stories260k
    rows = [
        tokenizer(p, return_tensors="pt").input_ids[0] for p in ("Once upon a time", "The little dog ran far")
    ]
    width = max(r.shape[0] for r in rows)
    input_ids = torch.stack([torch.cat([torch.zeros(width - r.shape[0], dtype=torch.long), r]) for r in rows])
    attention_mask = torch.stack([torch.arange(width) >= width - r.shape[0] for r in rows]).long()
    lm = SpeculativeLM(target, make_heads(target, "eagle"))
    out = lm.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=20, eos_token_id=[], fast_path=True
    )
    assert ran_fast_path(lm)
    for i, row in enumerate(rows):
        expected = hf_greedy(target, row[None], 20)[0, row.shape[0] :]
        assert torch.equal(out[i, width : width + expected.shape[0]], expected)


def test_the_runner_is_reused_and_grows_when_needed(stories260k):
    """A second call reuses the cache (stale slots of a longer earlier prompt stay hidden); a longer one grows it."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    long_ids = tokenizer("Once upon a time there was a little girl named Lily", return_tensors="pt").input_ids
    short_ids = tokenizer("The dog", return_tensors="pt").input_ids
    assert torch.equal(
        lm.generate(long_ids, max_new_tokens=30, fast_path=True), hf_greedy(target, long_ids, 30)
    )
    runner = lm._fast_runner
    assert torch.equal(
        lm.generate(short_ids, max_new_tokens=30, fast_path=True), hf_greedy(target, short_ids, 30)
    )
    assert lm._fast_runner is runner
    assert torch.equal(
        lm.generate(short_ids, max_new_tokens=200, fast_path=True), hf_greedy(target, short_ids, 200)
    )
    assert lm._fast_runner is not runner and lm._fast_runner.capacity >= short_ids.shape[1] + 200


# --- sampling --------------------------------------------------------------------------------------------------
def test_fast_path_sampling_follows_the_exact_joint_law(tiny_target_factory, chi_square):
    """The harness of test_generate_sampling.py, run through the fast path (T=0.7, top_p=0.9)."""
    import copy

    target = copy.deepcopy(
        tiny_target_factory("llama", seed=1, vocab_size=sampling_harness.V, num_hidden_layers=1)
    )
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    sampling = sampling_harness.SETTINGS["T=0.7,top_p=0.9"]
    law = sampling_harness.ExactLaw(target, **sampling)
    lm = sampling_harness.oracle_lm(target, law)
    torch.manual_seed(0)
    ids = torch.tensor([sampling_harness.PROMPT])
    samples, accepted = [], 0
    num_samples = 1200
    for _ in range(num_samples):
        out = lm.generate(ids, max_new_tokens=3, do_sample=True, fast_path=True, **sampling)
        samples.append(tuple(out[0, ids.shape[1] :].tolist()))
        stats = lm.last_stats
        accepted += round(sum(stats["accepted_per_depth"]) * stats["rounds"])
    assert ran_fast_path(lm)
    result = chi_square(samples, law.joint())
    assert result.passed, result
    assert result.dof >= 10, result
    assert accepted > 0.5 * num_samples  # the drafts were exercised


# --- padding -----------------------------------------------------------------------------------------------------
class RootOnlyDrafter:
    """Proposes just the root: every verification is 1 real node + 7 padding nodes."""

    def reset(self) -> None:
        pass

    def propose(self, features, next_tokens):
        return next_tokens[-1:], build_tree_buffers(torch.tensor([-1]))


def test_padding_nodes_are_never_accepted(stories260k):
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = RootOnlyDrafter()
    out = lm.generate(ids, max_new_tokens=25, fast_path=True)
    assert torch.equal(out, hf_greedy(target, ids, 25))
    assert list(lm._fast_runner.verifiers) == [padded_slots(1, None)] == [8]
    stats = lm.last_stats
    assert (
        stats["accepted_per_depth"] == [] and stats["rounds"] == 24
    )  # one bonus token per round, nothing else


def test_padded_verification_equals_dynamic_verification(tiny_llama):
    """Real nodes' logits and KV equal verify_tree's on a DynamicCache; padding rows see only themselves."""
    prefix = [1, 17, 5, 60, 33]
    parents, tokens = [-1, 0, 0, 1, 1, 4, 3], torch.tensor([8, 9, 10, 11, 12, 13, 14])
    tree = build_tree_buffers(torch.tensor(parents))
    dynamic = DynamicCache()
    with torch.no_grad():
        tiny_llama(input_ids=torch.tensor([prefix]), **cache_kwargs(tiny_llama, dynamic), use_cache=True)
    expected_logits, _ = verify_tree(tiny_llama, dynamic, tokens, tree, len(prefix))

    runner = FastPathRunner(tiny_llama, lambda hidden: hidden[-1], capacity=64)
    runner.prefill(torch.tensor(prefix))
    verifier = runner.verifier(16)
    verifier.load(tokens, tree, len(prefix))
    logits, features = verifier.run()
    assert logits.shape == (16, tiny_llama.config.vocab_size) and features.shape == (16, 64)
    torch.testing.assert_close(logits[:7], expected_logits, atol=1e-5, rtol=0)
    rows = verifier.mask[0, 0]  # (16, 64)
    visible = rows == 0
    assert visible[:7, : len(prefix)].all() and not visible[:, len(prefix) + 16 :].any()
    torch.testing.assert_close(visible[:7, len(prefix) : len(prefix) + 7], tree.ancestors)
    pad_rows = visible[7:]
    assert (pad_rows.sum(-1) == 1).all()
    assert torch.equal(pad_rows.nonzero()[:, 1], torch.arange(len(prefix) + 7, len(prefix) + 16))


# --- static cache compaction ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_static_compaction_equals_dynamic_compaction(tiny_target_factory, family, seed):
    """Random tree, random accepted path: the static cache's first prefix + L + 1 slots equal the DynamicCache."""
    target = tiny_target_factory(family)
    rng = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 14, (1,), generator=rng))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=rng)) for i in range(1, n)]
    tokens = torch.randint(0, 97, (n,), generator=rng)
    prefix = torch.randint(0, 97, (int(torch.randint(1, 9, (1,), generator=rng)),), generator=rng)
    tree = build_tree_buffers(torch.tensor(parents))
    node = int(torch.randint(0, n, (1,), generator=rng))
    path = torch.nonzero(tree.ancestors[node]).squeeze(-1)

    dynamic = DynamicCache()
    with torch.no_grad():
        target(input_ids=prefix[None], **cache_kwargs(target, dynamic), use_cache=True)
    verify_tree(target, dynamic, tokens, tree, prefix.shape[0])
    compact_cache(dynamic, prefix.shape[0], path)

    runner = FastPathRunner(target, lambda hidden: hidden[-1], capacity=64)
    runner.prefill(prefix)
    verifier = runner.verifier(padded_slots(n, None))
    verifier.load(tokens, tree, prefix.shape[0])
    verifier.run()
    runner.cache.compact(prefix.shape[0], path)
    kept = prefix.shape[0] + path.shape[0]
    assert runner.cache.committed_length == kept
    for i, layer in enumerate(dynamic.layers):
        static = runner.cache.layers[i]
        torch.testing.assert_close(static.keys[:, :, :kept], layer.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(static.values[:, :, :kept], layer.values, atol=1e-5, rtol=0)


def test_static_cache_rejects_bad_writes(tiny_llama):
    cache = StaticTreeCache(tiny_llama, capacity=8)
    with pytest.raises(ValueError, match="capacity 8 cannot hold 9"):
        cache.check_room(9)
    with pytest.raises(ValueError, match="capacity"):
        cache.compact(6, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="set_write_positions"):
        with torch.no_grad():
            tiny_llama(
                input_ids=torch.tensor([[1, 2]]),
                attention_mask=prefill_mask(2, 8, torch.float32, "cpu"),
                position_ids=torch.tensor([[0, 1]]),
                **cache_kwargs(tiny_llama, cache),
                use_cache=True,
            )
    with pytest.raises(ValueError, match="positive integer"):
        StaticTreeCache(tiny_llama, capacity=0)


# --- plain greedy on the static cache ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["stories260K", "llama", "qwen2"])
def test_plain_greedy_static_equals_generate(family, stories260k, tiny_target_factory):
    if family == "stories260K":
        target, tokenizer = stories260k
        ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    else:
        target, ids = tiny_target_factory(family), torch.tensor([TINY_PROMPT])
    assert torch.equal(plain_greedy_static(target, ids, 50), hf_greedy(target, ids, 50))
    assert torch.equal(plain_greedy_static(target, ids, 1), hf_greedy(target, ids, 1))
    assert torch.equal(plain_greedy_static(target, ids, 0), ids)


def test_static_greedy_decoder_reuse_and_eos(stories260k, greedy_reference):
    """One decoder across prompts (long, then short: stale slots hidden) and EOS anywhere in a checked chunk."""
    target, tokenizer = stories260k
    decoder = StaticGreedyDecoder(target, capacity=128, eos_check_every=4)
    long_ids = tokenizer("Once upon a time there was a little girl named Lily", return_tensors="pt").input_ids
    short_ids = tokenizer("The dog", return_tensors="pt").input_ids
    free = greedy_reference(target, short_ids[0].tolist(), 40)  # ignoring EOS
    assert torch.equal(decoder.generate(long_ids, 40), hf_greedy(target, long_ids, 40))
    assert decoder.generate(short_ids, 40, eos_token_id=[])[0, short_ids.shape[1] :].tolist() == free
    for offset in (0, 5, 6, 13):  # EOS as the first token, inside a chunk, at a chunk boundary
        eos = free[offset]
        if eos in free[:offset]:
            continue
        out = decoder.generate(short_ids[0], 40, eos_token_id=[eos, 10_000])
        assert torch.equal(out, hf_greedy(target, short_ids, 40, eos_token_id=eos))
        assert out.shape[1] == short_ids.shape[1] + offset + 1


# --- the padded prompt forward (GraphedPrefill) -----------------------------------------------------------------
PROMPT_LENGTHS = (130, 5, 64, 70)  # 192, 64, 64 and 128 slots (longest first: the runner keeps its size)


def random_prompt(target, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "family, head_type, graphed_rounds",
    [("stories260K", "eagle", None), ("stories260K", "eagle3", True), ("llama", "eagle3", None),
     ("qwen2", "eagle", True), ("llama", "medusa", None)],
)
def test_padded_prefill_gives_the_target_greedy_output(family, head_type, graphed_rounds, stories260k, tiny_target_factory):
    """Prompts of several padded lengths one after another through one SpeculativeLM (each leaves padding entries
    beyond its prompt in the cache, stale for the next): the target's greedy output, with the prompt forwards padded."""
    target = stories260k[0] if family == "stories260K" else tiny_target_factory(family)
    lm = SpeculativeLM(target, make_heads(target, head_type), graphed_rounds=graphed_rounds, graphed_prefill=True)
    for seed, length in enumerate(PROMPT_LENGTHS):
        ids = random_prompt(target, length, seed)
        assert torch.equal(lm.generate(ids, max_new_tokens=24, fast_path=True), hf_greedy(target, ids, 24))
    assert sorted(lm._fast_runner.prompt_graphs.verifiers) == [64, 128, 192]


def test_padded_prefill_by_default_only_where_graphs_are_captured_and_prompts_are_short():
    """auto (None): CUDA graphs captured, padded length within GRAPHED_PREFILL_MAX_TOKENS and the cache; True: always."""
    assert GRAPHED_PREFILL_MAX_TOKENS == 512
    assert pads_prompt(None, True, 5, 1024) and pads_prompt(None, True, 512, 1024)
    assert not pads_prompt(None, True, 513, 2048)  # 576 padded slots: eager
    assert not pads_prompt(None, True, 200, 192)  # 256 padded slots do not fit the cache: eager, not an error
    assert not pads_prompt(None, False, 5, 1024)  # the CPU: eager
    assert pads_prompt(True, False, 5000, 64) and not pads_prompt(False, True, 5, 1024)


@pytest.mark.parametrize("family", ["stories260K", "qwen2"])
def test_padded_prefill_projects_the_last_prompt_token_only(family, stories260k, tiny_target_factory):
    """The prompt graph's lm_head projects one row (`logits_to_keep` at the last real token), whose logits and the
    features of every prompt token are the eager forward's."""
    target = stories260k[0] if family == "stories260K" else tiny_target_factory(family)
    prefill = GraphedPrefill(target, StaticTreeCache(target, 256), select_features=lambda hidden: hidden[-1])
    for seed, length in enumerate((70, 5, 64)):
        ids = random_prompt(target, length, seed)
        logits, features = prefill(ids[0])
        out = target(ids, output_hidden_states=True)
        assert logits.shape == (1, target.config.vocab_size) and features.shape == (length, target.config.hidden_size)
        torch.testing.assert_close(logits, out.logits[0, -1:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features, out.hidden_states[-1][0], rtol=1e-4, atol=1e-4)
    verifiers = prefill.verifiers
    assert sorted(verifiers) == [64, 128] and all(v.logits_row is not None for v in verifiers.values())
    assert verifiers[128].forward()[0].shape == (1, target.config.vocab_size)  # one row, not 128


def test_padded_prefill_after_kept_entries(stories260k):
    """A turn's new tokens after a kept conversation (`start` > 0): the graphed chain sees the slots before it, and
    one prompt's graph at an earlier start sees none of what a later start left unmasked."""
    from specheads.inference.static_cache import prefill_static

    target = stories260k[0]
    cache = StaticTreeCache(target, 256)
    prefill = GraphedPrefill(target, cache, select_features=lambda hidden: hidden[-1])
    ids = random_prompt(target, 150, 3)
    full = target(ids, output_hidden_states=True)
    for start, end in ((100, 150), (40, 90), (0, 30), (120, 140)):  # starts going down and up, one padded length
        if start:
            prefill_static(target, cache, ids[0, :start])  # the kept part, in place
        logits, features = prefill(ids[0, start:end], start)
        torch.testing.assert_close(logits, full.logits[0, end - 1 : end], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features, full.hidden_states[-1][0, start:end], rtol=1e-4, atol=1e-4)
    assert sorted(prefill.verifiers) == [64]
    with pytest.raises(ValueError, match="pads the 50-token prompt to 64 slots from slot 200, past the cache's 256"):
        prefill(ids[0, :50], 200)


def test_default_prefill_on_the_cpu_stays_eager(stories260k):
    target = stories260k[0]
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    decoder = StaticGreedyDecoder(target, capacity=256)
    assert lm.graphed_prefill is None and decoder.graphed_prefill is None
    ids = random_prompt(target, 70, 0)
    assert torch.equal(lm.generate(ids, max_new_tokens=12, fast_path=True), hf_greedy(target, ids, 12))
    assert torch.equal(decoder.generate(ids, 12), hf_greedy(target, ids, 12))
    assert lm._fast_runner.prompt_graphs is None and decoder.prompt_graphs.verifiers == {}


@pytest.mark.parametrize("family", ["stories260K", "llama"])
def test_padded_prefill_in_our_plain_decoding(family, stories260k, tiny_target_factory):
    target = stories260k[0] if family == "stories260K" else tiny_target_factory(family)
    decoder = StaticGreedyDecoder(target, capacity=256, graphed_prefill=True)
    for seed, length in enumerate(PROMPT_LENGTHS):
        ids = random_prompt(target, length, seed)
        assert torch.equal(decoder.generate(ids, 30), hf_greedy(target, ids, 30))
    assert sorted(decoder.prompt_graphs.verifiers) == [64, 128, 192]
    with pytest.raises(ValueError, match="pads the 70-token prompt to 128 slots from slot 0, past the cache's 100"):
        StaticGreedyDecoder(target, capacity=100, graphed_prefill=True).generate(random_prompt(target, 70, 0), 20)


# --- errors and the switch -------------------------------------------------------------------------------------
def test_clear_errors_when_the_allocation_is_too_small(stories260k):
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids  # 5 tokens
    with pytest.raises(ValueError, match="capacity 16 cannot hold 25 positions"):
        StaticGreedyDecoder(target, capacity=16).generate(ids, max_new_tokens=20)
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    runner = FastPathRunner(target, lm.heads.select_features, capacity=32)
    drafter = runner.use_drafter(lm.drafter)
    stats = {"new_tokens": 0, "target_forwards": 0, "rounds": 0, "accepted_counts": []}
    from specheads.inference.sampling import SamplingParams

    with pytest.raises(ValueError, match="capacity 32 cannot hold"):
        lm._generate_row(ids[0], 20, SamplingParams(), set(), None, "exact", stats, runner, drafter)
    with pytest.raises(ValueError, match="max_new_tokens"):
        StaticGreedyDecoder(target, capacity=16).generate(ids, max_new_tokens=-1)


def test_the_fast_path_switch(tiny_target_factory):
    """None: on only for CUDA, for any number of prompts unless batched=True; True on a reachable sliding window or
    with batched=True: clear error."""
    llama = tiny_target_factory("llama")
    assert use_fast_path(None, llama, None, 100) is False  # CPU
    on_cuda = SimpleNamespace(config=llama.config, device=torch.device("cuda"))  # the decision only, nothing runs
    assert use_fast_path(None, on_cuda, None, 100) is True
    assert use_fast_path(None, on_cuda, True, 100) is False  # batched rows share forwards: the normal path
    assert use_fast_path(True, llama, None, 100) is True
    assert use_fast_path(False, llama, None, 100) is False
    with pytest.raises(ValueError, match="batched=True"):
        use_fast_path(True, llama, True, 100)
    with pytest.raises(ValueError, match="fast_path='yes'"):
        use_fast_path("yes", llama, None, 100)
    windowed = tiny_target_factory("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        use_fast_path(True, windowed, None, 40)
    lm = SpeculativeLM(windowed, make_heads(windowed, "medusa"))
    with pytest.raises(ValueError, match="sliding window"):
        lm.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=10, fast_path=True)
    assert (
        use_fast_path(True, tiny_target_factory("mistral"), None, 100) is True
    )  # window 4096: never reached


def test_from_pretrained_keeps_fp32_on_cpu(stories260k_eagle_dir):
    lm = SpeculativeLM.from_pretrained(target="stories260K", heads=stories260k_eagle_dir)
    assert lm.target.dtype == torch.float32 and next(lm.heads.parameters()).dtype == torch.float32


def test_verifier_refuses_a_tree_larger_than_its_slots(tiny_llama):
    runner = FastPathRunner(tiny_llama, lambda hidden: hidden[-1], capacity=64)
    runner.prefill(torch.tensor([1, 2, 3]))
    verifier: TreeVerifier = runner.verifier(8)
    tree = build_tree_buffers(torch.tensor([-1] + list(range(9))))
    with pytest.raises(ValueError, match="does not fit a verifier padded to 8"):
        verifier.load(torch.arange(10), tree, 3)
