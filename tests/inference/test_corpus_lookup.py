"""Corpus lookup: the suffix store against brute force, the guesses' trie, saving, learning online, and decoding with
its branches grafted (greedy identical, sampling exact, fewer rounds once an answer is known)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from specheads import HEAD_TYPES, SpeculativeLM
from specheads.inference.corpus_lookup import (
    CORPUS_FILE,
    SETTLE_TOKENS,
    CorpusLookup,
    SuffixStore,
    answer_spans,
    corpus_from_options,
    read_corpus_file,
    sorted_prefix_order,
)
from specheads.inference.lookup import LookupDrafter

from .conftest import TINY_PROMPT, hf_greedy, left_pad, load_sampling_harness, make_heads, record_tree_sizes


# --- the store ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 2, 3, 8])
def test_suffixes_are_sorted_by_their_first_tokens(length):
    rng = np.random.default_rng(length)
    tokens = rng.integers(0, 4, size=300)  # a small alphabet: long ties, so every doubling round matters
    order = sorted_prefix_order(tokens, length)
    assert sorted(order.tolist()) == list(range(300))
    keys = [tuple(tokens[i : i + length].tolist()) for i in order]
    assert keys == sorted(keys)  # a suffix cut short by the end sorts before its extensions, as tuples do


def test_the_longest_match_is_every_occurrence_of_the_longest_suffix_found():
    rng = random.Random(0)
    documents = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    store = SuffixStore(documents, max_match=6)
    for _ in range(200):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        lo, hi, matched = store.match(context)
        # brute force: where each suffix of the context ends inside one document
        ends = {m: [(d, i) for d, doc in enumerate(documents) for i in range(m, len(doc) + 1)
                    if doc[i - m : i] == context[len(context) - m :]] for m in range(1, min(6, len(context)) + 1)}
        longest = max((m for m, found in ends.items() if found), default=0)
        assert matched == longest
        if longest:
            assert hi - lo == len(ends[longest])
            follow = sorted(tuple(documents[d][i : i + 3]) for d, i in ends[longest])
            assert sorted(tuple(c) for c in store.continuations(lo, hi, hi - lo, 3)) == follow


def test_guesses_are_the_agreed_continuations_as_a_trie():
    corpus = CorpusLookup([[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8], [2, 3, 4, 5, 6, 10]], min_probability=0.5)
    # [2, 3] occurs 3 times; 4 follows all three, then 5 6 two of them: 7 8 (1 of 3) and 10 (1 of 3) are left out
    assert corpus.guesses([0, 2, 3], max_tokens=8) == [[4, 5, 6]]
    assert corpus.guesses([0, 2, 3], max_tokens=2) == [[4, 5]]  # the likeliest nodes first
    low = CorpusLookup(corpus_documents := [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8]], min_probability=0.5)
    assert sorted(low.guesses([2, 3], 8)) == [[4, 5, 6], [4, 7, 8]]  # two branches of 1 in 2 each
    assert corpus.guesses([7, 7], 8) == []  # no match at all
    assert corpus.guesses([5, 6], 8) == [[10]]  # the other occurrence ends its document
    strict = CorpusLookup(corpus_documents, min_match=3)
    assert strict.guesses([2, 3], 8) == [] and strict.guesses([1, 2, 3], 8) == [[4, 5, 6]]


def test_save_and_load_keep_the_documents(tmp_path):
    documents = [[5, 1, 2], [7], [3, 3, 3, 3]]
    corpus = CorpusLookup(documents)
    path = corpus.save(tmp_path)
    assert path == tmp_path / CORPUS_FILE and np.load(path).dtype == np.uint32
    assert [p.name for p in tmp_path.iterdir()] == [CORPUS_FILE]  # written to a partial file, then renamed
    loaded = CorpusLookup.load(tmp_path, min_probability=0.9)
    assert np.array_equal(loaded.base.tokens, corpus.base.tokens) and loaded.min_probability == 0.9
    assert loaded.num_tokens == 8 and loaded.guesses([5, 1], 4) == [[2]]


def test_learned_answers_are_saved_and_learned_again(tmp_path):
    """`save_learned` / `load_learned` (the CLI's --corpus-learned): a restarted corpus guesses what the first had
    learned, oldest evicted first as before; the fixed corpus is not part of the file."""
    corpus = CorpusLookup([[7, 7, 7]], online_tokens=8)
    for answer in ([1, 2, 3], [4, 5, 6], [1, 2, 9]):
        corpus.remember(answer)
    path = corpus.save_learned(tmp_path / "learned.npy")
    assert not (tmp_path / ".learned.npy.partial").exists()
    again = CorpusLookup(online_tokens=8)
    again.load_learned(path)
    assert again.recent == [[4, 5, 6], [1, 2, 9]] == corpus.recent  # [1, 2, 3] had been evicted
    assert again.guesses([0, 1, 2], 2) == [[9]]
    smaller = CorpusLookup(online_tokens=3)
    smaller.load_learned(path)
    assert smaller.recent == [[1, 2, 9]]  # the newest that fit
    assert corpus_from_options(None, 8, learned_file=path).recent == corpus.recent
    assert corpus_from_options(None, 8, learned_file=tmp_path / "new.npy").recent == []  # not there yet: empty
    with pytest.raises(ValueError, match="does not learn"):
        CorpusLookup().load_learned(path)
    with pytest.raises(ValueError, match="--corpus-learned .* needs --corpus-learn N"):
        corpus_from_options(None, 0, learned_file=path)
    with pytest.raises(ValueError, match="is a folder: expected a file"):
        corpus_from_options(None, 8, learned_file=tmp_path)
    assert again.max_token_id == 9  # learned answers count: a file of another tokenizer's answers is refused
    CorpusLookup(online_tokens=8).save_learned(path)  # nothing learned: an empty file
    assert read_corpus_file(path) == []


def test_learned_answers_are_written_every_k_answers(tmp_path):
    """`keep_learned_in(FILE, every=K)` (the CLI's --corpus-learned FILE --corpus-save-every K): `remember` writes
    FILE after every K answers, so a process killed without a clean end loses fewer than K; 0 leaves it to the end."""
    path = tmp_path / "learned.npy"
    corpus = corpus_from_options(None, 100, learned_file=path, save_every=2)
    corpus.remember([1, 2, 3])
    assert not path.exists()
    corpus.remember([4, 5, 6])
    assert read_corpus_file(path) and [a.tolist() for a in read_corpus_file(path)] == [[1, 2, 3], [4, 5, 6]]
    corpus.remember([7, 8])
    assert len(read_corpus_file(path)) == 2  # the third waits for the fourth
    corpus.save_learned(path)  # the command's end writes it, and the count starts again
    corpus.remember([9])
    assert len(read_corpus_file(path)) == 3
    corpus.remember([10])
    assert [a.tolist() for a in read_corpus_file(path)][-2:] == [[9], [10]]
    at_the_end = corpus_from_options(None, 100, learned_file=tmp_path / "end.npy", save_every=0)
    for answer in ([1], [2], [3]):
        at_the_end.remember(answer)
    assert not (tmp_path / "end.npy").exists()
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match=f"--corpus-save-every {bad}: expected 0 .*or a number of answers"):
            corpus_from_options(None, 100, save_every=bad)
    with pytest.raises(ValueError, match="--corpus-save-every True"):
        CorpusLookup(online_tokens=8).keep_learned_in(path, True)


def test_bad_corpus_files_and_settings_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no lookup corpus at .*specheads data lookup-corpus"):
        CorpusLookup.load(tmp_path)
    np.save(tmp_path / "floats.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="float32 array of shape \\(4,\\), expected 1-D uint32 token ids"):
        CorpusLookup.load(tmp_path / "floats.npy")
    (tmp_path / CORPUS_FILE).write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="is not a lookup corpus"):
        CorpusLookup.load(tmp_path)
    with pytest.raises(ValueError, match="min_match=5, max_match=4"):
        CorpusLookup([[1]], max_match=4, min_match=5)
    with pytest.raises(ValueError, match="min_probability=0 must be in"):
        CorpusLookup([[1]], min_probability=0)
    with pytest.raises(ValueError, match="online_tokens=-1 must be an integer >= 0"):
        CorpusLookup(online_tokens=-1)
    with pytest.raises(ValueError, match="corpus token ids must be >= 0, got -3"):
        CorpusLookup([[1, -3]])
    with pytest.raises(ValueError, match="--corpus-learn -2: expected 0"):
        corpus_from_options(None, -2)
    assert corpus_from_options(None, 0) is None and corpus_from_options(None, 50).online_tokens == 50


def test_online_lookup_learns_answers_and_forgets_the_oldest():
    corpus = CorpusLookup(online_tokens=10)
    assert corpus.guesses([1, 2], 4) == []
    corpus.remember([1, 2, 3, 4])
    assert corpus.guesses([1, 2], 4) == [[3, 4]]
    corpus.remember([5, 6, 7, 1, 2, 9])  # 10 tokens held: both kept
    assert corpus.guesses([1, 2], 4) == [[3, 4], [9]] or corpus.guesses([1, 2], 4) == [[9], [3, 4]]
    corpus.remember([8, 8])  # 12 > 10: the oldest answer goes
    assert corpus.guesses([1, 2], 4) == [[9]] and corpus.num_tokens == 8
    fixed = CorpusLookup([[1, 2, 3]])
    fixed.remember([1, 2, 4])  # not online: nothing learned
    assert fixed.guesses([1, 2], 4) == [[3]]


def test_learned_answers_settle_into_one_store_now_and_then():
    """A busy server: new answers wait in a small store rebuilt per answer; every SETTLE_TOKENS tokens (an eighth of
    online_tokens when smaller) the large store is rebuilt with all learned answers, and evicted ones leave it then.
    The newest answer is guessable at once, every kept one always, an evicted one not after the next rebuild."""
    rng = random.Random(1)
    answers = [[1000 + i, *(rng.randrange(900) for _ in range(99))] for i in range(200)]  # distinct first tokens
    corpus = CorpusLookup(online_tokens=16000)  # 160 answers; settles every 2,000 new tokens (20 answers)
    settled = []  # the large store after each answer
    for answer in answers:
        corpus.remember(answer)
        assert corpus.guesses(answer[:2], 3) == [answer[2:5]]
        settled.append(corpus._settled_store)
    assert corpus.num_tokens == 16000 and len(corpus.recent) == 160
    rebuilds = sum(1 for before, after in zip([None, *settled], settled) if after is not before)
    assert rebuilds == 200 // 20  # not once per answer
    assert max(store.num_tokens for store in settled if store is not None) <= 16000 + SETTLE_TOKENS
    assert all(corpus.guesses(answer[:2], 3) == [answer[2:5]] for answer in answers[-160:])
    assert corpus.guesses(answers[0][:2], 3) == []  # evicted, and the large store was rebuilt since


def test_answer_spans_carry_the_assistant_header():
    ids = [10, 11, 12, 13, 14, 20, 21, 30, 31, 32, 40]
    mask = [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert answer_spans(ids, mask, lead=2) == [[13, 14, 20, 21], [31, 32, 40]]


def heads_tree_nodes(lm: SpeculativeLM) -> int:
    """Nodes of the heads' own trees (EAGLE's: its node budget and the root; Medusa's: its static tree)."""
    heads = lm.drafter.drafter
    return heads.buffers.num_nodes if hasattr(heads, "buffers") else heads.num_nodes + 1


# --- decoding -------------------------------------------------------------------------------------------------
def other_answers(target, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """The target's greedy answers to other prompts: a corpus that shares its habits, not the answer asked for."""
    return [hf_greedy(target, torch.tensor([p]), num_tokens)[0, len(p) :].tolist() for p in prompts]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_greedy_output_is_the_targets_and_the_corpus_pays(tiny_target_factory, family, head_type):
    """Tiny random targets say the same things after different prompts: the corpus of their answers to other
    prompts is grafted in some rounds, accepts more, and the output stays the target's greedy one (ungated: on some
    of these targets it earns less than the default gain per node, so the gate would close)."""
    target, ids = tiny_target_factory(family), torch.tensor([TINY_PROMPT])
    heads = make_heads(target, head_type)
    expected = hf_greedy(target, ids, 40)
    plain = SpeculativeLM(target, heads)
    assert torch.equal(plain.generate(ids, max_new_tokens=40), expected)
    corpus = CorpusLookup(other_answers(target, [[1, 8, 2], [1, 40, 41, 42], [1, 3], [1, 17, 5, 60]], 60), min_gain=0)
    lm = SpeculativeLM(target, heads, lookup_corpus=corpus, corpus_tokens=8)
    sizes = record_tree_sizes(lm)
    assert torch.equal(lm.generate(ids, max_new_tokens=40), expected)
    assert max(sizes) > min(sizes)  # guesses were grafted in some rounds
    assert lm.last_stats["mean_accepted"] > plain.last_stats["mean_accepted"]
    description = lm.tree_description()
    assert description["corpus_tokens"] == 8 and description["corpus_size"] == corpus.num_tokens
    assert description["corpus_min_gain"] == 0


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_an_online_corpus_learns_each_answer(tiny_target_factory, head_type):
    """With corpus_learn, the second request for a known answer is guessed whole: far fewer rounds, same tokens;
    alone (`generate`), batched, and on the fast path."""
    target = tiny_target_factory("llama", seed=3)
    prompts = [[1, 5, 9, 33, 7], [1, 12, 70, 4]]
    expected = [hf_greedy(target, torch.tensor([p]), 48)[0] for p in prompts]
    for mode in ("alone", "batched", "fast_path"):
        lm = SpeculativeLM(target, make_heads(target, head_type), lookup_corpus=CorpusLookup(online_tokens=1000),
                           corpus_tokens=16)
        rounds = []
        for _ in range(2):
            if mode == "batched":
                ids, mask = left_pad(prompts)
                out = lm.generate(ids, attention_mask=mask, max_new_tokens=48, batched=True)
                for row, (prompt, reference) in enumerate(zip(prompts, expected)):
                    assert out[row, ids.shape[1] :].tolist() == reference[len(prompt) :].tolist()
            else:
                out = lm.generate(torch.tensor([prompts[0]]), max_new_tokens=48, fast_path=mode == "fast_path")
                assert torch.equal(out[0], expected[0])
            rounds.append(lm.last_stats["rounds"])
        assert rounds[1] * 2 < rounds[0], (mode, rounds)
        assert lm.drafter.corpus.num_tokens > 48
        if mode == "fast_path":  # trees padded to the heads' nodes + the corpus' (no prompt lookup here)
            assert lm._fast_runner.fixed_slots == heads_tree_nodes(lm) + 16


@pytest.mark.parametrize("head_type", ["eagle", "medusa"])
def test_sampling_with_a_corpus_follows_the_exact_joint_law(tiny_target_factory, chi_square, head_type):
    """Corpus guesses are deterministic candidates (a function of the committed tokens): the first 3 sampled tokens
    still follow the target's exact law. A corpus over the 6-token vocabulary with single-token matches grafts in
    many rounds; it also learns every sampled answer, so its guesses change from sample to sample, and the gate opens
    and closes with what each sample accepted (the trees stay a function of the committed tokens)."""
    harness = load_sampling_harness("sampling_harness_for_corpus")
    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=harness.V, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # harness.six_token_target
    law = harness.ExactLaw(target, temperature=1.0)
    heads = harness.untrained_eagle_heads(target, "eagle") if head_type == "eagle" else make_heads(target, "medusa")
    rng = random.Random(7)
    corpus = CorpusLookup([[rng.randrange(harness.V) for _ in range(30)] for _ in range(20)], min_match=1,
                          min_probability=0.2, online_tokens=400)
    lm = SpeculativeLM(target, heads, lookup_corpus=corpus, corpus_tokens=4)
    sizes = record_tree_sizes(lm)
    samples = harness.sample_first_three(lm, 1200, seed=3, temperature=1.0)
    result = chi_square(samples, law.joint())
    assert result.passed, result
    grafted = sum(size > heads_tree_nodes(lm) for size in sizes)
    assert 0.2 * len(sizes) < grafted < len(sizes), "guesses were rarely grafted, or the gate never closed"


def test_corpus_settings_survive_tree_changes_and_are_checked(stories260k, tmp_path):
    target, _ = stories260k
    CorpusLookup([[1, 2, 3]]).save(tmp_path)
    lm = SpeculativeLM(target, make_heads(target, "eagle"), lookup_corpus=tmp_path, corpus_tokens=5)
    assert isinstance(lm.drafter, LookupDrafter) and lm.drafter.num_tokens == 0 and lm.drafter.corpus_tokens == 5
    lm.configure_tree(tree_depth=3, tree_top_k=2, tree_num_nodes=5)
    assert lm.drafter.corpus is not None and lm.drafter.max_grafted_nodes == 5
    lm.configure_lookup(4, lookup_corpus=lm.drafter.corpus, corpus_tokens=6)
    assert lm.drafter.max_grafted_nodes == 4 + 6
    with pytest.raises(ValueError, match="corpus_tokens=0 must be an integer >= 1"):
        SpeculativeLM(target, make_heads(target, "eagle"), lookup_corpus=tmp_path, corpus_tokens=0)
    vocab = target.get_input_embeddings().num_embeddings  # 512
    with pytest.raises(ValueError, match=f"holds token id {vocab}, but the target's vocabulary has {vocab} tokens"):
        SpeculativeLM(target, make_heads(target, "eagle"), lookup_corpus=CorpusLookup([[1, vocab, 2]]))


def test_the_serving_loop_learns_finished_answers_only(tiny_target_factory):
    """Through the server's loop: a finished answer is learned (the corpus' size is a /metrics gauge) and makes the
    same request cheaper; one cancelled half-way is not learned (the engine's rows, stepped by hand)."""
    from specheads.inference.batched import BatchEngine
    from specheads.inference.serving_loop import ServingLoop

    target = tiny_target_factory("qwen2", seed=4)
    lm = SpeculativeLM(target, make_heads(target, "eagle"), lookup_corpus=CorpusLookup(online_tokens=500),
                       corpus_tokens=16)
    prompt = torch.tensor([[1, 9, 27, 3]])
    expected = hf_greedy(target, prompt, 40)[0, 4:].tolist()
    engine = BatchEngine(lm)
    cancelled = lm.batch_request(prompt, max_new_tokens=40)
    engine.add([cancelled])
    engine.step()
    assert cancelled.new_tokens  # it had begun
    cancelled.cancelled = True
    while engine.occupied:
        engine.step()
    assert lm.drafter.corpus.num_tokens == 0
    loop = ServingLoop(lm, max_batch=2)
    try:
        assert loop.metrics()["lookup_corpus_tokens"] == 0
        first = loop.run(lm.batch_request(prompt, max_new_tokens=40))
        assert loop.metrics()["lookup_corpus_tokens"] == 3 + 40  # the answer and its 3-token lead
        forwards = loop.metrics()["row_forwards"]
        second = loop.run(lm.batch_request(prompt, max_new_tokens=40))
        assert first.new_tokens == second.new_tokens == expected
        assert (loop.metrics()["row_forwards"] - forwards) * 2 < forwards
    finally:
        loop.close()
