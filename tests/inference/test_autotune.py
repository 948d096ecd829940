"""`--tree auto`'s measurements: verification cost on the path `generate` takes, trials timed after warm-up."""

from __future__ import annotations

import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference import autotune
from specheads.inference.tree_verifier import TreeVerifier

from .conftest import TINY_PROMPT


def counting(monkeypatch, cls, name):
    calls = []
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


def test_fast_path_verification_cost_times_the_static_verifier(tiny_llama, monkeypatch):
    """fast_path=True times `TreeVerifier.run` (the graph replay on CUDA) for each N; the normal path does not."""
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "eagle"))
    ids = torch.tensor([TINY_PROMPT])
    runs = counting(monkeypatch, TreeVerifier, "run")
    costs = autotune.verification_cost_ms(lm, ids, [1, 4, 9], repeats=3, fast_path=True)
    assert sorted(costs) == [1, 4, 9] and all(ms > 0 for ms in costs.values())
    assert [v.num_slots for v in runs] == [1] * 4 + [4] * 4 + [9] * 4  # a warm-up run + 3 timed ones per N
    runs.clear()
    normal = autotune.verification_cost_ms(lm, ids, [1, 4], repeats=2)
    assert sorted(normal) == [1, 4] and not runs


def test_autotune_reports_the_fast_path_cost_and_warms_up_at_the_timed_length(tiny_llama, monkeypatch):
    """With the fast path (as on CUDA), every candidate's warm-up call already has the timed length, so no timed
    call resizes the runner (a new runner re-captures every graph on a GPU: that time is not the tree's)."""
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "eagle"))
    original_generate = lm.generate
    runners = []

    def generate_on_the_fast_path(ids, **kwargs):
        out = original_generate(ids, fast_path=True, **kwargs)
        runners.append(lm._fast_runner)
        return out

    monkeypatch.setattr(lm, "generate", generate_on_the_fast_path)
    calibration = [torch.tensor([TINY_PROMPT]), torch.tensor([TINY_PROMPT[:3]])]
    report = autotune.autotune_tree(lm, calibration, max_new_tokens=60)  # 5 + 60 + tree > one 64-slot block
    assert report["verification_path"] == "fast"
    calls_per_candidate = 1 + len(calibration)
    assert len(runners) == calls_per_candidate * len(report["trials"])
    for start in range(0, len(runners), calls_per_candidate):  # the timed calls reuse the warm-up's runner
        assert len({id(r) for r in runners[start : start + calls_per_candidate]}) == 1
    assert set(report["verification_ms_by_nodes"]) >= {4, 8, 16, 32, 48, 64}


def test_autotune_reports_the_path_its_trials_took_not_an_older_runner(tiny_llama):
    """A runner kept from an earlier fast-path call does not make the CPU trials' report claim the fast path."""
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "eagle"))
    ids = torch.tensor([TINY_PROMPT])
    lm.generate(ids, max_new_tokens=4, fast_path=True)
    assert lm._fast_runner is not None and lm.last_stats["fast_path"] is True
    report = autotune.autotune_tree(lm, [ids], max_new_tokens=6)  # default fast_path: the normal path on the CPU
    assert lm.last_stats["fast_path"] is False and report["verification_path"] == "normal"


def test_autotune_interleaves_candidates_per_prompt_on_the_normal_path(tiny_llama, monkeypatch):
    """On the CPU every calibration prompt runs through all candidates back to back (reversed on every other
    prompt), so a machine drifting in speed hits every candidate alike; the fastest measured candidate wins."""
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "eagle"))
    calibration = [torch.tensor([TINY_PROMPT]), torch.tensor([TINY_PROMPT[:3]]), torch.tensor([TINY_PROMPT[1:]])]
    original_generate = lm.generate
    calls = []  # (tree nodes, prompt length) of every call

    def recording_generate(ids, **kwargs):
        out = original_generate(ids, **kwargs)
        calls.append((lm.tree_description()["nodes"], ids.shape[1]))
        # a fake clock: time grows with the tree, so the smallest tree is the fastest per token
        lm.last_stats["seconds"] = lm.last_stats["target_forwards"] * (1 + lm.tree_description()["nodes"])
        return out

    monkeypatch.setattr(lm, "generate", recording_generate)
    report = autotune.autotune_tree(lm, calibration, max_new_tokens=6)
    assert report["verification_path"] == "normal" and report["schedule"] == "interleaved per prompt"
    nodes = [c["tree_num_nodes"] for c in autotune.tree_candidates(lm)]
    assert calls[0] == (nodes[0], len(TINY_PROMPT))  # the one warm-up call
    timed = calls[1:]
    expected = [(n, len(TINY_PROMPT)) for n in nodes] + [(n, 3) for n in reversed(nodes)]
    expected += [(n, len(TINY_PROMPT) - 1) for n in nodes]
    assert timed == expected
    fake = {t["tree"]["nodes"]: t for t in report["trials"]}
    assert report["chosen"]["nodes"] == min(nodes) == min(fake, key=lambda n: 1 / fake[n]["tokens_per_second"])
    assert lm.tree_description() == report["chosen"]


def test_autotune_shows_its_progress_when_asked(tiny_llama, capsys):
    """`progress=True` (what `bench --tree auto` passes: the calibration takes minutes on a CPU) counts the timed runs,
    trees x prompts, on stderr; the default stays quiet (tests, library calls)."""
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "eagle"))
    calibration = [torch.tensor([TINY_PROMPT]), torch.tensor([TINY_PROMPT[:3]])]
    autotune.autotune_tree(lm, calibration, max_new_tokens=4)
    assert "tree auto" not in capsys.readouterr().err
    report = autotune.autotune_tree(lm, calibration, max_new_tokens=4, progress=True)
    runs = len(report["trials"]) * len(calibration)
    last_line = capsys.readouterr().err.split("\r")[-1]  # the bar's final state
    assert f"tree auto ({len(report['trials'])} trees)" in last_line and f"{runs}/{runs}" in last_line


def test_candidates_are_the_trees_they_name_whatever_the_heads_default_pruning(tiny_llama):
    """Heads whose CPU default prunes (`cpu_tree`'s stop / min probabilities, as the committed SmolLM2 heads') do not
    lend that pruning to the candidates that give none: each trial's tree is its candidate, unpruned where it names
    no pruning (before, every CPU candidate of those heads ran pruned at 0.2 / 0.03)."""
    heads = create_heads(tiny_llama, "eagle", cpu_tree={"tree_depth": 3, "tree_top_k": 2, "tree_num_nodes": 4,
                                                        "tree_stop_prob": 0.2, "tree_min_prob": 0.03})
    lm = SpeculativeLM(tiny_llama, heads)
    assert lm.tree_description()["stop_prob"] == 0.2  # the CPU default
    report = autotune.autotune_tree(lm, [torch.tensor([TINY_PROMPT])], max_new_tokens=4)
    for trial in report["trials"]:
        candidate, tree = trial["candidate"], trial["tree"]
        assert (tree["depth"], tree["top_k"], tree["nodes"]) == (
            candidate["tree_depth"], candidate["tree_top_k"], candidate["tree_num_nodes"])
        assert (tree["stop_prob"], tree["min_prob"]) == (
            candidate.get("tree_stop_prob", 0.0), candidate.get("tree_min_prob", 0.0)), trial
    assert any("tree_stop_prob" not in t["candidate"] for t in report["trials"])
