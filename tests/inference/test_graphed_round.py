"""The whole-round graph (graphed_round.py) is exact, on the CPU where the same round runs eagerly.

Its pieces equal the per-phase fast path's: the device-side tree mask equals `write_tree_mask`, the padded
greedy acceptance equals `accept_greedy` on random trees (every path length), the device compaction equals
`StaticTreeCache.compact`. End to end, greedy generation through it is token-identical to `target.generate`
and to the per-phase fast path, round by round (same accepted counts, same stats), on every test
architecture with EAGLE and EAGLE-3 heads, for prompts shorter and longer than the commit rows, with EOS and
max_new_tokens cutting a round. The heads draft from the target's own continuation (a draft vocabulary of
its tokens) so that drafts really get accepted.
"""

from __future__ import annotations

import random

import pytest
import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference import cuda_graphs, graphed_round
from specheads.inference.accept import accept_greedy
from specheads.inference.fast_path import FastPathRunner
from specheads.inference.graphed_round import (
    GraphedGreedyRound,
    accept_greedy_padded,
    load_tree_on_device,
    tree_mask_on_device,
)
from specheads.inference.static_cache import StaticTreeCache, write_tree_mask
from specheads.inference.tree import build_tree_buffers
from specheads.inference.tree_verifier import TreeVerifier

from .conftest import TINY_PROMPT, greedy_continuation, hf_greedy, sharpen_attention

LONG_PROMPT = [1, 5, 9, 33, 7, 2, 11, 40, 3, 8, 60, 12]  # longer than the commit rows (depth + 1)


def random_parents(rng: random.Random, n: int, max_depth: int) -> torch.Tensor:
    """(n,) parents of a random tree (topological order) no deeper than `max_depth`."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        parent = rng.choice([j for j in range(i) if depth[j] < max_depth])
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return torch.tensor(parents)


# --- the pieces ---------------------------------------------------------------------------------------------
def test_padded_acceptance_equals_accept_greedy_for_every_path_length():
    rng = random.Random(0)
    torch.manual_seed(0)
    max_depth, seen = 5, set()
    for trial in range(400):
        n = rng.randint(1, 16)
        tree = build_tree_buffers(random_parents(rng, n, max_depth))
        tokens = torch.randint(0, 4, (n,))
        argmax = torch.randint(0, 4, (n,))
        # Make the path to a random node correct, so that long paths are accepted too.
        node = rng.randrange(n)
        while node > 0:
            argmax[tree.parents[node]] = tokens[node]
            node = int(tree.parents[node])
        want_path, want_bonus = accept_greedy(tokens, tree, argmax)
        rows = max_depth + 1
        path, count, bonus = accept_greedy_padded(tokens, tree.parents, tree.depth, tree.ancestors, argmax, rows)
        length = want_path.shape[0]
        assert path.shape == (rows,) and count.dim() == 0 and bonus.dim() == 0
        assert int(count) == length
        assert torch.equal(path[:length], want_path), trial
        assert (path[length:] == want_path[-1]).all()  # padding repeats the deepest accepted node
        assert int(bonus) == int(want_bonus)
        seen.add(length - 1)
    assert seen == set(range(max_depth + 1)), seen  # every path length, the root-only one included


def test_device_tree_mask_and_buffers_equal_the_verifiers_load(tiny_llama):
    """Round after round with growing prefixes (trees of n <= N nodes, padding included): the device-side load
    writes exactly what `TreeVerifier.load` (`write_tree_mask`) writes, the whole mask included."""
    rng = random.Random(1)
    capacity, slots = 96, 12
    cache = StaticTreeCache(tiny_llama, capacity)
    reference, device_side = TreeVerifier(tiny_llama, cache, slots), TreeVerifier(tiny_llama, cache, slots)
    device_side.mask.zero_()  # stale: every slot must be rewritten
    key_index = torch.arange(capacity)
    prefix = 3
    while prefix + slots <= capacity:
        n = rng.randint(1, slots)
        tree = build_tree_buffers(random_parents(rng, n, 6))
        tokens = torch.randint(1, 97, (n,))
        reference.load(tokens, tree, prefix)
        load_tree_on_device(device_side, tokens, tree.depth, tree.ancestors, torch.tensor(prefix), key_index)
        for name in ("ids", "positions", "write", "mask"):
            assert torch.equal(getattr(device_side, name), getattr(reference, name)), (name, prefix, n)
        assert (reference.mask[0, 0, :n, :prefix] == 0).all()  # the real nodes see the prefix: a real check
        prefix += rng.randint(1, 7)


def test_tree_mask_on_device_for_the_real_nodes():
    """Against `write_tree_mask` on a fresh mask: real nodes see [0, prefix) and exactly their ancestors."""
    rng = random.Random(2)
    n, slots, capacity, prefix = 7, 10, 40, 9
    tree = build_tree_buffers(random_parents(rng, n, 4))
    mask = torch.full((1, 1, slots, capacity), torch.finfo(torch.float32).min)
    write_tree_mask(mask, tree.ancestors, prefix)
    got = tree_mask_on_device(tree.ancestors, slots, torch.tensor(prefix), torch.arange(capacity), torch.float32)
    assert torch.equal(got, mask[0, 0])
    visible = got[:n] == 0
    assert visible[:, :prefix].all() and torch.equal(visible[:, prefix : prefix + n], tree.ancestors)
    assert not visible[:, prefix + n :].any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_compaction_equals_static_compaction(tiny_llama, seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    capacity, prefix, rows = 48, 11, 5
    reference, device_side = StaticTreeCache(tiny_llama, capacity), StaticTreeCache(tiny_llama, capacity)
    for cache in (reference, device_side):
        cache.set_write_positions(torch.arange(capacity))
        for layer in cache.layers:  # allocate the shared storage
            layer.lazy_initialization(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    device_side.storage.copy_(torch.randn_like(reference.storage))
    reference.storage.copy_(device_side.storage)
    before = reference.storage.clone()
    tree = build_tree_buffers(random_parents(rng, 12, rows - 1))
    best = rng.choice([i for i in range(12) if int(tree.depth[i]) == int(tree.depth.max())])
    path = torch.nonzero(tree.ancestors[best]).squeeze(-1)
    padded = torch.cat([path, path[-1:].expand(rows - path.shape[0])])
    reference.compact(prefix, path)
    device_side.move_path(torch.tensor(prefix), padded)
    end = prefix + path.shape[0]
    assert torch.equal(device_side.storage[..., :end, :], reference.storage[..., :end, :])
    assert torch.equal(device_side.storage[..., :prefix, :], before[..., :prefix, :])
    if not torch.equal(path, torch.arange(path.shape[0])):  # the path skips nodes: entries really moved
        assert not torch.equal(reference.storage[..., prefix:end, :], before[..., prefix:end, :])


# --- end to end ---------------------------------------------------------------------------------------------
class RecordingStreamer:
    """Records every chunk `generate` emits: the prompt, the root, then one chunk per round."""

    def __init__(self) -> None:
        self.chunks: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def continuation_heads(target, head_type: str, ids: torch.Tensor, num_tokens: int, seed: int = 0):
    """Untrained heads whose draft vocabulary is the tokens of the target's greedy continuation (so drafts get
    accepted), with sharpened attention (so positions, masks and cache slots matter)."""
    vocab = torch.unique(torch.tensor(greedy_continuation(target, ids[0].tolist(), num_tokens)))
    torch.manual_seed(seed)
    if head_type == "eagle":
        heads = create_heads(target, "eagle", eagle_draft_vocab_size=vocab.shape[0])
        heads.set_draft_vocab(vocab)
    else:
        heads = create_heads(target, "eagle3", draft_vocab_size=vocab.shape[0])
        heads.set_draft_vocab(vocab, init_lm_head_from_target=True)
    return sharpen_attention(heads)


def run_both(lm: SpeculativeLM, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> dict[str, tuple]:
    """Generate with the graphed rounds, then with the per-phase fast path (same runner, same static drafter).

    Returns {mode: (output, rounds' chunks, stats)}.
    """
    results = {}
    for mode in ("graphed", "per_phase"):
        lm.graphed_rounds = mode == "graphed"
        if lm._fast_runner is not None and mode == "per_phase":
            lm._fast_runner.greedy_round = None
        streamer = RecordingStreamer()
        out = lm.generate(ids, max_new_tokens=max_new_tokens, fast_path=True, streamer=streamer, **kwargs)
        timings = ("seconds", "tokens_per_second", "prefill_seconds", "ms_per_round")
        stats = {k: v for k, v in lm.last_stats.items() if k not in timings}
        results[mode] = (out, streamer.chunks[2:], stats)  # chunks after the prompt and the root
        runner = lm._fast_runner
        assert isinstance(runner, FastPathRunner)
        assert (runner.greedy_round is not None) == (mode == "graphed")  # the mode really ran
    return results


def check_identical(results: dict[str, tuple], expected: torch.Tensor) -> list[int]:
    """Both modes give `expected`, the same rounds and stats; returns the accepted drafted tokens per round."""
    (out, chunks, stats), (ref_out, ref_chunks, ref_stats) = results["graphed"], results["per_phase"]
    assert torch.equal(ref_out, expected)
    assert torch.equal(out, expected)
    assert chunks == ref_chunks  # round by round: the same accepted tokens
    assert stats == ref_stats
    assert stats["rounds"] == len(chunks) and stats["target_forwards"] == stats["rounds"] + 1
    return [len(c) - 1 for c in chunks]


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_graphed_rounds_equal_generate_and_the_per_phase_fast_path(target_and_prompt, head_type):
    target, ids = target_and_prompt
    heads = continuation_heads(target, head_type, ids, 48)
    lm = SpeculativeLM(target, heads, tree_depth=4, tree_top_k=min(3, heads.draft_vocab_size), tree_num_nodes=8)
    results = run_both(lm, ids, 40)
    accepted = check_identical(results, hf_greedy(target, ids, 40))
    assert sum(accepted) > 0, accepted  # drafts were accepted: the path, compaction and commit rows mattered
    # A second call reuses the runner's round (and on CUDA its graph).
    lm.graphed_rounds = True
    assert torch.equal(lm.generate(ids, max_new_tokens=20, fast_path=True), hf_greedy(target, ids, 20))
    graphed = lm._fast_runner.greedy_round
    assert isinstance(graphed, GraphedGreedyRound) and graphed.drafter is lm._fast_runner.drafter


@pytest.mark.parametrize(
    ("family", "prompt", "tree"),
    [
        ("llama", LONG_PROMPT, dict(tree_depth=4, tree_top_k=6, tree_num_nodes=24)),
        ("qwen2", LONG_PROMPT, dict(tree_depth=3, tree_top_k=4, tree_num_nodes=2)),  # nodes < depth: P = 3
        ("qwen2", [1] + [92] * 6, dict(tree_depth=4, tree_top_k=2, tree_num_nodes=30)),  # every pair: full paths
        ("mistral", [7], dict(tree_depth=5, tree_top_k=3, tree_num_nodes=12)),  # a 1-token prompt
        ("llama", TINY_PROMPT, dict(tree_depth=2, tree_top_k=2, tree_num_nodes=10)),  # 7 nodes: 4 padding slots
    ],
)
@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_prompt_lengths_and_tree_shapes(tiny_target_factory, family, prompt, tree, head_type):
    target = tiny_target_factory(family)
    ids = torch.tensor([prompt])
    heads = continuation_heads(target, head_type, ids, 48)
    if tree["tree_top_k"] > heads.draft_vocab_size:
        pytest.skip("the continuation has fewer distinct tokens than top_k")
    lm = SpeculativeLM(target, heads, **tree)
    accepted = check_identical(run_both(lm, ids, 40), hf_greedy(target, ids, 40))
    assert sum(accepted) > 0, accepted
    if prompt == [1] + [92] * 6:  # a 2-token continuation and a full binary tree of depth 4: whole paths accepted
        assert max(accepted) == tree["tree_depth"], accepted


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_max_new_tokens_and_eos_cut_a_round(tiny_target_factory, head_type):
    target = tiny_target_factory("qwen2")
    ids = torch.tensor([LONG_PROMPT])
    heads = continuation_heads(target, head_type, ids, 48)
    lm = SpeculativeLM(target, heads, tree_depth=4, tree_top_k=6, tree_num_nodes=24)
    prompt_length = ids.shape[1]

    def overshoot(new_tokens: int) -> int:
        """Tokens the last graphed round accepted beyond those emitted (> 0: the round was cut)."""
        return lm._fast_runner.greedy_round.prefix_length - prompt_length - (new_tokens - 1)

    cut = 0
    for max_new_tokens in range(1, 16):
        check_identical(run_both(lm, ids, max_new_tokens), hf_greedy(target, ids, max_new_tokens))
        lm.graphed_rounds = True
        lm.generate(ids, max_new_tokens=max_new_tokens, fast_path=True)
        if max_new_tokens > 1:
            cut += overshoot(max_new_tokens) > 0
    assert cut > 0  # some max_new_tokens fell inside a round

    continuation = greedy_continuation(target, LONG_PROMPT, 40)
    cut = 0
    for offset in range(4, 30):
        eos = continuation[offset]
        if eos in continuation[:offset]:
            continue  # EOS would stop earlier
        expected = hf_greedy(target, ids, 40, eos_token_id=eos)
        assert expected.shape[1] == prompt_length + offset + 1
        check_identical(run_both(lm, ids, 40, eos_token_id=eos), expected)
        lm.graphed_rounds = True
        lm.generate(ids, max_new_tokens=40, fast_path=True, eos_token_id=eos)
        cut += overshoot(offset + 1) > 0
    assert cut > 0  # EOS fell inside a round at least once


class EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: `replay()` runs the function."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def test_capture_warm_up_rounds_are_undone(tiny_target_factory, monkeypatch):
    """The capture path on the CPU: a stand-in `try_capture` runs the warm-up rounds (and one more for the
    capture) for real; the state restored after them must give the same rounds as the per-phase path. With too
    little room left for the warm-up rounds, the rounds run eagerly and no capture is tried."""
    captures = []

    def fake_capture_cuda_graph(fn, warmup=3):  # inside the real try_capture, which restores the state after
        for _ in range(warmup + 1):
            fn()
        captures.append(fn)
        return EagerGraph(fn), None

    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", fake_capture_cuda_graph)
    target = tiny_target_factory("llama")
    short = torch.tensor([LONG_PROMPT])
    long = torch.tensor([LONG_PROMPT + greedy_continuation(target, LONG_PROMPT, 18)])  # 30 tokens
    heads = continuation_heads(target, "eagle", short, 60)
    lm = SpeculativeLM(target, heads, tree_depth=4, tree_top_k=6, tree_num_nodes=24)  # N = 25, P = 5
    runner = FastPathRunner(target, heads.select_features, capacity=64, use_graphs=False)
    lm._fast_runner = runner  # reused by every call below (each one fits in 64 slots)
    runner.use_drafter(lm.drafter)
    runner.greedy_round = GraphedGreedyRound(runner.verifier(25), runner.drafter, use_graph=True)
    graphed = runner.greedy_round
    # 30 + 6 + 25 <= 64, but the warm-up rounds need 30 + 3 * 5 + 25 > 64 slots: eager rounds, no capture;
    # then 12 + 3 * 5 + 25 <= 64: captured on the first round of the short prompt.
    for ids, max_new_tokens, captured in ((long, 6, False), (short, 25, True)):
        lm.graphed_rounds = True
        streamer = RecordingStreamer()
        out = lm.generate(ids, max_new_tokens=max_new_tokens, fast_path=True, streamer=streamer)
        assert lm._fast_runner is runner and runner.greedy_round is graphed
        assert torch.equal(out, hf_greedy(target, ids, max_new_tokens))
        assert (graphed.graph is not None) == captured and len(captures) == captured
        lm.graphed_rounds = False
        per_phase = RecordingStreamer()
        lm.generate(ids, max_new_tokens=max_new_tokens, fast_path=True, streamer=per_phase)
        assert streamer.chunks == per_phase.chunks
        assert sum(len(c) - 1 for c in streamer.chunks[2:]) > 0


def test_sampling_and_medusa_keep_the_per_phase_loop(tiny_llama):
    ids = torch.tensor([TINY_PROMPT])
    torch.manual_seed(0)
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "eagle", tree_depth=3, tree_top_k=2, tree_num_nodes=5))
    lm.generate(ids, max_new_tokens=10, do_sample=True, fast_path=True)
    assert lm._fast_runner.greedy_round is None
    torch.manual_seed(0)
    medusa = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "medusa"))
    assert torch.equal(medusa.generate(ids, max_new_tokens=10, fast_path=True), hf_greedy(tiny_llama, ids, 10))
    assert medusa._fast_runner.graphed_round(medusa._fast_runner.drafter) is None


def test_a_failed_capture_falls_back_to_the_per_phase_loop(tiny_target_factory, monkeypatch):
    """When capturing the round fails (warned by try_capture), that call finishes with eager rounds and later
    calls take the per-phase loop, whose two graphs are captured separately; outputs stay exact."""
    monkeypatch.setattr(graphed_round, "try_capture", lambda fn, what, **options: (None, None))
    target = tiny_target_factory("llama")
    ids = torch.tensor([LONG_PROMPT])
    heads = continuation_heads(target, "eagle", ids, 48)
    lm = SpeculativeLM(target, heads, tree_depth=4, tree_top_k=6, tree_num_nodes=24, graphed_rounds=True)
    lm.generate(ids, max_new_tokens=30, fast_path=True)  # creates the runner, sized for the calls below
    runner = lm._fast_runner
    runner.greedy_round.use_graph = True  # as on CUDA: the next round tries to capture
    assert torch.equal(lm.generate(ids, max_new_tokens=30, fast_path=True), hf_greedy(target, ids, 30))
    assert runner.greedy_round.capture_failed
    assert runner.graphed_round(runner.drafter) is None
    assert torch.equal(lm.generate(ids, max_new_tokens=30, fast_path=True), hf_greedy(target, ids, 30))
    assert lm._fast_runner is runner


def test_a_failed_capture_warns_with_the_failing_line_and_restores_the_state(monkeypatch):
    """try_capture: the warning names the line of specheads code that broke the capture (CUDA's own message names
    no operation), and the state tensors get their values back although the warm-up ran."""
    state = torch.zeros(3)

    def advance():
        state.add_(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    def fake_capture_cuda_graph(fn, warmup=3):
        fn()

    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", fake_capture_cuda_graph)
    with pytest.warns(UserWarning, match=r"capture of the toy round failed .* at test_graphed_round.py:\d+ \(raise Run"):
        assert cuda_graphs.try_capture(advance, "toy round", restore=[state]) == (None, None)
    assert torch.equal(state, torch.zeros(3))


def test_graphed_rounds_default_follows_the_fast_paths_graphs(tiny_llama, monkeypatch):
    """graphed_rounds=None (the default) asks for the whole-round graph exactly when the fast path captures graphs
    (CUDA); True asks for it on the CPU too, False never."""
    asked = []
    monkeypatch.setattr(FastPathRunner, "graphed_round", lambda self, drafter: asked.append(self.use_graphs))
    ids = torch.tensor([TINY_PROMPT])
    heads = create_heads(tiny_llama, "eagle", tree_depth=3, tree_top_k=2, tree_num_nodes=5)
    for setting, use_graphs, expected in ((None, False, []), (None, True, [True]), (True, False, [False]), (False, True, [])):
        asked.clear()
        lm = SpeculativeLM(tiny_llama, heads, graphed_rounds=setting)
        lm._fast_runner = FastPathRunner(tiny_llama, heads.select_features, capacity=64, use_graphs=False)
        lm._fast_runner.use_graphs = use_graphs  # only the decision reads it: the graphed_round stand-in returns None
        assert torch.equal(lm.generate(ids, max_new_tokens=6, fast_path=True), hf_greedy(tiny_llama, ids, 6))
        assert asked == expected, setting
