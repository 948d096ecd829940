"""Draft models (heads/draft_model.py, inference/draft_model_drafting.py): a small LM of the target's tokenizer, or
the target's own first layers, drafts the trees; outputs stay the target's (greedy identical, sampling exact)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import LogitsProcessorList

from specheads import SpeculativeLM
from specheads.heads.draft_model import DraftModelHeads, early_exit_model
from specheads.inference.draft_model_drafting import DraftModelDrafter
from specheads.inference.prompt_cache import PromptCache

from .conftest import TINY_PROMPT, SumModuloBan, hf_greedy, left_pad, load_sampling_harness

STORY = "Once upon a time"


def early_exit_lm(target, num_layers: int, **tree) -> SpeculativeLM:
    return SpeculativeLM(target, DraftModelHeads.around(early_exit_model(target, num_layers), target), **tree)


@pytest.mark.parametrize(("family", "draft"), [
    ("llama", "qwen2"), ("qwen2", "llama"), ("mistral", "early-exit"), ("gemma3_text", "early-exit"),
    ("phi3", "early-exit"), ("gemma2", "llama"),
])
def test_greedy_output_is_the_target_s_on_several_families(tiny_target_factory, family, draft):
    """Another family's random model of the same vocabulary, or the target's first layer, drafts: same tokens as the
    target's own greedy generate (Gemma 2 / 3: past their sliding window of 8)."""
    target = tiny_target_factory(family)
    model = early_exit_model(target, 1) if draft == "early-exit" else tiny_target_factory(draft, seed=3)
    lm = SpeculativeLM(target, DraftModelHeads.around(model, target), tree_depth=4, tree_top_k=3, tree_num_nodes=9)
    assert isinstance(lm.drafter, DraftModelDrafter)
    ids = torch.tensor([TINY_PROMPT])
    assert torch.equal(lm.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert lm.last_stats["rounds"] < 40 or lm.last_stats["mean_accepted"] == 1.0


def test_early_exit_on_stories260k_accepts_more_with_more_layers(stories260k):
    """The real stories260K: every early exit gives the target's text; 4 of its 5 layers guess far better than 1."""
    target, tokenizer = stories260k
    ids = tokenizer(STORY, return_tensors="pt").input_ids
    reference = hf_greedy(target, ids, 60)
    tau = {}
    for layers in (1, 4):
        lm = early_exit_lm(target, layers)
        assert torch.equal(lm.generate(ids, max_new_tokens=60), reference), layers
        tau[layers] = lm.last_stats["mean_accepted"]
    assert tau[4] > tau[1] + 0.8, tau
    assert lm.tree_description()["draft_model"] == "early-exit:4"
    assert not any(p.is_meta for p in lm.heads.parameters())
    assert lm.heads.draft_model.model.layers[0] is target.model.layers[0]  # shared, not copied


def test_a_draft_model_equal_to_the_target_accepts_every_drafted_token(stories260k):
    """A copy of the target as draft model, greedy, a chain of 4: each round but the last accepts all 4 tokens (so
    the draft cache, positions and masks are right: one wrong position would cost acceptance)."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, DraftModelHeads.around(copy.deepcopy(target), target, name="copy"), tree_depth=4,
                       tree_top_k=1, tree_num_nodes=4)
    ids = tokenizer("The little dog", return_tensors="pt").input_ids
    assert torch.equal(lm.generate(ids, max_new_tokens=61), hf_greedy(target, ids, 61))
    stats = lm.last_stats  # 1 + 12 rounds x (4 drafted + 1) = 61 tokens
    assert stats["rounds"] == 12 and stats["accepted_per_depth"] == [1.0] * 4, stats
    # a wide tree too (1 + 10 rounds x 6 = 61 at best; the 20 best-scored nodes may leave a deep one out)
    lm.configure_tree(tree_depth=5, tree_top_k=4, tree_num_nodes=20)
    assert torch.equal(lm.generate(ids, max_new_tokens=61), hf_greedy(target, ids, 61))
    assert lm.last_stats["rounds"] <= 11 and lm.last_stats["accepted_per_depth"][0] == 1.0, lm.last_stats


def test_batches_lookup_pruning_constraints_fast_path_and_prompt_cache(stories260k):
    """Left-padded batches (each row as alone), prompt lookup, pruned and early-stopped trees, a caller's logits
    processor, the CPU fast path and a conversation through a PromptCache: all the target's greedy output."""
    target, tokenizer = stories260k
    lm = early_exit_lm(target, 3, tree_stop_prob=0.05, tree_min_prob=0.02)
    lm.configure_lookup(5)
    encoded = [tokenizer(text, return_tensors="pt").input_ids[0].tolist() for text in
               (STORY, "Tom had a red ball. Tom had a red ball. Tom")]
    input_ids, attention_mask = left_pad(encoded)
    out = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24)
    for row, prompt in enumerate(encoded):
        alone = hf_greedy(target, torch.tensor([prompt]), 24)[0, len(prompt):]
        assert torch.equal(out[row, input_ids.shape[1]:], alone), row
    ids = torch.tensor([encoded[0]])
    processors = LogitsProcessorList([SumModuloBan(7)])
    assert torch.equal(lm.generate(ids, max_new_tokens=30, logits_processor=processors),
                       hf_greedy(target, ids, 30, logits_processor=processors))
    assert torch.equal(lm.generate(ids, max_new_tokens=30, fast_path=True), hf_greedy(target, ids, 30))
    cache = PromptCache()
    first = lm.generate(ids, max_new_tokens=20, prompt_cache=cache)
    follow = torch.cat([first, tokenizer(" The end.", return_tensors="pt").input_ids[:, 1:]], dim=1)
    assert torch.equal(lm.generate(follow, max_new_tokens=20, prompt_cache=cache), hf_greedy(target, follow, 20))
    assert lm.last_stats["reused_prompt_tokens"] > 0


def test_sampling_follows_the_exact_joint_law(tiny_target_factory, chi_square):
    """A 6-token target and another random 6-token model as draft model: the first 3 sampled tokens follow the exact
    law (chi-square at p = 0.001), at T = 1 and at T = 0.7, top-p 0.9."""
    harness = load_sampling_harness("sampling_harness_draft_model")
    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=6, num_hidden_layers=1))
    draft = copy.deepcopy(tiny_target_factory("llama", seed=2, vocab_size=6, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
        draft.lm_head.weight.copy_(target.lm_head.weight)  # a draft that is often right, never exactly the target
    for sampling in (dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)):
        law = harness.ExactLaw(target, **sampling)
        lm = SpeculativeLM(target, DraftModelHeads.around(draft, target), tree_depth=3, tree_top_k=3, tree_num_nodes=8)
        samples = harness.sample_first_three(lm, 1200, seed=4, **sampling)
        result = chi_square(samples, law.joint())
        assert result.passed and result.dof >= 10, (sampling, result)
        assert lm.accepted_drafts > 0.3 * len(samples), sampling


def test_from_pretrained_loads_a_draft_model_or_an_early_exit(tmp_path):
    """`from_pretrained(draft_model=...)` loads the draft as a target (path or alias) in the target's dtype;
    `early_exit_layers=N` builds it from the target; exactly one way of drafting is accepted."""
    lm = SpeculativeLM.from_pretrained("stories260K", draft_model="stories260K")
    assert lm.heads.config.draft_model_name_or_path == "stories260K" and not lm.heads.shares_target_weights
    ids = lm.tokenizer(STORY, return_tensors="pt").input_ids
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(lm.target, ids, 30))
    assert lm.last_stats["mean_accepted"] > 3  # the target itself drafts: nearly everything is accepted
    lm = SpeculativeLM.from_pretrained("stories260K", early_exit_layers=2)
    assert lm.heads.shares_target_weights and lm.tree_description()["draft_model"] == "early-exit:2"
    with pytest.raises(ValueError, match="exactly one of heads, draft_model, early_exit_layers and mtp=True.*none"):
        SpeculativeLM.from_pretrained("stories260K")
    with pytest.raises(ValueError, match=r"exactly one of .*\['draft_model', 'early_exit_layers'\]"):
        SpeculativeLM.from_pretrained("stories260K", draft_model="stories260K", early_exit_layers=2)


def test_bad_draft_models_are_refused_by_name(stories260k):
    target, tokenizer = stories260k
    for layers in (0, 5, True):
        with pytest.raises(ValueError, match=f"early-exit draft of {layers!r} layers: expected 1 to 4"):
            early_exit_model(target, layers)
    other = copy.deepcopy(target)  # the same shapes and weights, but not these modules
    heads = DraftModelHeads.around(early_exit_model(other, 1), other)
    with pytest.raises(ValueError, match="made of another target's layers"):
        SpeculativeLM(target, heads)
    lm = early_exit_lm(target, 2)
    with pytest.raises(ValueError, match="made of the target's own layers"):
        lm.use_int8_draft_linears()
    assert lm.use_cpu_kernels(draft_linear="auto", cpu_linear="default")["draft_linear"] == "default"
    with pytest.raises(NotImplementedError, match="used as it is"):
        lm.heads.save_pretrained("anywhere")
    with pytest.raises(ValueError, match="draft_model drafting makes dynamic trees"):
        lm.configure_tree(tree="medusa_default")


@pytest.mark.parametrize(("family", "reason"), [("mamba", "keeps a recurrent state"),
                                               ("mpt", "forward takes no position_ids")])
def test_draft_models_that_cannot_draft_trees_are_refused(tiny_target_factory, family, reason):
    """A recurrent draft model (its state cannot be cut back after a tree) or an ALiBi one is refused by name."""
    target, draft = tiny_target_factory("llama"), tiny_target_factory(family)
    with pytest.raises(ValueError, match=f"this draft model cannot draft token trees: .*{reason}"):
        DraftModelHeads.around(draft, target)


def test_a_padded_draft_vocabulary_drafts_only_target_ids(tiny_target_factory):
    """A draft model whose vocabulary is padded past the target's drafts target ids only; one smaller than the
    target's reads the ids it lacks as 0. Both: the target's output."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([TINY_PROMPT + [96, 95]])
    for vocab in (120, 90):
        draft = tiny_target_factory("qwen2", seed=5, vocab_size=vocab)
        heads = DraftModelHeads.around(draft, target)
        assert heads.draft_vocab_size == min(vocab, 97)
        lm = SpeculativeLM(target, heads, tree_depth=3, tree_top_k=4, tree_num_nodes=10)
        assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30)), vocab


def test_generate_and_bench_commands_draft_with_a_draft_model(tmp_path, capfd):
    """`specheads generate --early-exit-layers N` / `--draft-model M` print the target's story; `bench --draft-model`
    records what drafted and stays identical; `--heads` with `--draft-model` is a usage error."""
    from specheads.cli import main
    from specheads.inference.bench import bench_main

    assert main(["generate", "--early-exit-layers", "3", "--prompt", STORY, "--max-new-tokens", "20", "--threads", "1",
                 "--tree", "3,2,4"]) == 0
    out, err = capfd.readouterr()
    assert "Once upon a time, there was a little girl named Lily" in out and "(tree 3,2,4,0,0;" in err
    assert main(["generate", "--draft-model", "stories260K", "--prompt", STORY, "--max-new-tokens", "20",
                 "--threads", "1"]) == 0
    assert "there was a little girl named Lily" in capfd.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--heads", "h", "--draft-model", "stories260K", "--prompt", STORY])
    assert exit_info.value.code == 2 and "not allowed with argument --heads" in capfd.readouterr().err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out_file = tmp_path / "bench" / "results.json"
    base = ["--target", "stories260K", "--prompts", str(prompts), "--max-new-tokens", "12", "--threads", "1"]
    assert bench_main([*base, "--early-exit-layers", "4", "--out", str(out_file)]) == 0
    results = json.loads(out_file.read_text())
    assert results["greedy_identical"] is True and results["heads"] == "early-exit:4"
    assert results["head_type"] == "draft_model" and results["tree"]["draft_model"] == "early-exit:4"
    assert results["greedy"]["overall"]["assisted_speedup"] > 0  # the peer: transformers' assistant_early_exit=4
    assert "draft model `early-exit:4`" in (out_file.parent / "results.md").read_text()
    with pytest.raises(ValueError, match="--save-tree writes a copy of the heads"):
        bench_main([*base, "--draft-model", "stories260K", "--tree", "auto", "--save-tree", str(tmp_path / "t")])


def test_a_draft_model_from_a_hub_id(offline_hub_cache):
    """A Hub id resolves through the (offline) Hub cache."""
    from specheads.targets import resolve_target_path

    stories = resolve_target_path("stories260K")
    offline_hub_cache.publish(stories, "test-org/stories-draft")
    lm = SpeculativeLM.from_pretrained("stories260K", draft_model="test-org/stories-draft")
    ids = lm.tokenizer(STORY, return_tensors="pt").input_ids
    assert torch.equal(lm.generate(ids, max_new_tokens=20), hf_greedy(lm.target, ids, 20))


def test_the_server_batches_requests_drafted_by_an_early_exit(stories260k):
    """`specheads serve --early-exit-layers`: concurrent requests share the continuous batch (each row its own draft
    cache, forked) and each answer is its prompt's greedy text."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from urllib.request import Request, urlopen

    from specheads.inference.server import CompletionService, make_server

    target, tokenizer = stories260k
    lm = SpeculativeLM(target, DraftModelHeads.around(early_exit_model(target, 3), target), tokenizer=tokenizer)
    service = CompletionService(lm, "stories", {"max_new_tokens": 12}, cache_slots=2)
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"

    def complete(prompt: str) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": 12}).encode()
        with urlopen(Request(url, data=body, headers={"Content-Type": "application/json"}), timeout=120) as response:
            return json.loads(response.read())

    prompts = [STORY, "Tom had a big red ball", "Lily saw a cat"]
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
    finally:
        httpd.shutdown()
        httpd.server_close()
        service.close()
    for prompt, body in zip(prompts, answers):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = tokenizer.decode(hf_greedy(target, ids, 12)[0, ids.shape[1]:], skip_special_tokens=True)
        assert body["choices"][0]["text"] == expected, prompt


def test_a_short_context_draft_stops_drafting_and_a_draft_in_another_dtype_drafts(tiny_target_factory):
    """A draft model of 16 positions (GPT-2: learned positions, which cannot run past them) drafts until the sequence
    would outgrow it, then the target goes on alone; a bfloat16 draft model drafts for a float32 target (its masks
    are cast). Both: the target's output."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([TINY_PROMPT])
    short = tiny_target_factory("gpt2", seed=4, max_position_embeddings=16)
    lm = SpeculativeLM(target, DraftModelHeads.around(short, target), tree_depth=3, tree_top_k=2, tree_num_nodes=4)
    assert torch.equal(lm.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert 20 < lm.last_stats["rounds"] < 40  # drafted at first (some accepted), then one token a round
    assert lm.drafter.out_of_context
    half = copy.deepcopy(tiny_target_factory("qwen2", seed=3)).to(torch.bfloat16)
    lm = SpeculativeLM(target, DraftModelHeads.around(half, target), tree_depth=3, tree_top_k=3, tree_num_nodes=8)
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))


def test_tree_sweep_compares_heads_and_draft_models_side_by_side(tmp_path, monkeypatch):
    """scripts/tree_sweep.py --heads early-exit:3,draft:stories260K: draft models are compared on the one target."""
    import runpy
    import sys
    from pathlib import Path

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "sweep.json"
    script = Path(__file__).parents[2] / "scripts" / "tree_sweep.py"
    monkeypatch.setattr(sys, "argv", [
        str(script), "--target", "stories260K", "--heads", "early-exit:3,draft:stories260K", "--prompts", str(prompts),
        "--per-category", "2", "--max-new-tokens", "10", "--threads", "1", "--out", str(out), "3,2,4",
    ])
    runpy.run_path(str(script), run_name="__main__")
    results = json.loads(out.read_text())["trees"]
    assert set(results) == {"3,2,4 (heads early-exit:3)", "3,2,4 (heads draft:stories260K)"}
    assert all(r["prompts"] == 2 and r["greedy_identical"] for r in results.values())
    assert results["3,2,4 (heads draft:stories260K)"]["tau"] > results["3,2,4 (heads early-exit:3)"]["tau"]
