"""Hybrid targets (recurrent / convolution layers beside attention: Qwen3.5, Qwen3-Next, LFM2, Granite 4, Bamba,
Nemotron-H, Falcon-H1, Zamba2, OLMo-Hybrid) verify each path of a round's tree as a chain (inference/chain_verify.py).

Tiny random targets of each family (`tests/conftest.py` HYBRID_FAMILIES). What the chain verifier relies on is
checked per family (a cached state continues over several tokens exactly; copied states put back give the same
logits again), then its output: the target's own greedy tokens with every rejection depth hit, the pending tokens
committed by shortened rounds, sampling's exact law (chi-square), heads trained on a hybrid target's features, and
what it cannot serve refused by name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from specheads import HEAD_TYPES, SpeculativeLM, create_heads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference import chain_verify
from specheads.inference.batched import BatchEngine
from specheads.inference.chain_verify import ChainVerifier
from specheads.inference.kv_cache import crop_cache, restore_states, snapshot_states
from specheads.inference.prompt_cache import PromptCache
from specheads.inference.target_support import CHAIN_FAMILIES, verifies_chains
from specheads.inference.tree import build_tree_buffers, chain_tree

from ..conftest import HYBRID_FAMILIES, build_tiny_target
from .conftest import hf_greedy, make_heads

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9, 79]])
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "train"


def test_the_tested_families_are_the_served_ones():
    assert set(HYBRID_FAMILIES) == CHAIN_FAMILIES


def continuation_error(target, split: int = 12, rollback: bool = False) -> float:
    """Largest logit difference, relative to the largest logit, between one forward over 18 tokens and a forward over
    the last 18 - `split` that continues the cache of the first `split`; with `rollback`, that continuation runs
    after another one was undone (states put back, attention cut)."""
    ids = torch.randint(2, 90, (1, 18), generator=torch.Generator().manual_seed(0))
    full = target(ids).logits
    cache = DynamicCache(config=target.config)
    target(ids[:, :split], past_key_values=cache, use_cache=True)
    positions = torch.arange(split, ids.shape[1])[None]
    if rollback:
        saved = snapshot_states(cache)
        target(ids[:, split:].flip(1), past_key_values=cache, use_cache=True, position_ids=positions)
        restore_states(cache, saved)
        crop_cache(cache, split)
    part = target(ids[:, split:], past_key_values=cache, use_cache=True, position_ids=positions).logits
    return float((part - full[:, split:]).abs().max() / full.abs().max())


@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_each_served_family_continues_a_cached_state_exactly(tiny_target_factory, family):
    """What chain verification rests on: several new tokens continue a cached state as one forward over all would,
    and states copied before a forward and put back after it undo that forward."""
    target = tiny_target_factory(family, initializer_range=0.2)  # sharp weights: a state lost would show
    assert verifies_chains(target)
    assert continuation_error(target) < 1e-5
    assert continuation_error(target, rollback=True) < 1e-5


@pytest.mark.parametrize(("family", "overrides"), [("mamba2", dict(num_heads=4, head_dim=32, state_size=8, n_groups=1,
                                                                    chunk_size=8)),
                                                   ("jamba", dict(attn_layer_period=2, attn_layer_offset=1,
                                                                  expert_layer_period=2, num_experts=2))])
def test_families_whose_scan_restarts_from_zero_stay_refused(tiny_target_factory, family, overrides):
    """Mamba-2 and Jamba continue a cached state over one new token only: over several their scan starts from zero
    (the check above fails for them), so a chain would be verified wrongly: refused, naming what is served."""
    target = tiny_target_factory(family, initializer_range=0.2, **overrides)
    assert continuation_error(target) > 1e-2
    with pytest.raises(ValueError, match="keeps a recurrent state .* paths verified as chains: .*qwen3_5"):
        SpeculativeLM(target, create_heads(target, "eagle3"))


@pytest.mark.parametrize(("family", "croppable"), [("lfm2", True), ("qwen3_5_text", False)])
def test_a_cache_is_cut_back_only_where_its_states_allow(tiny_target_factory, family, croppable):
    """`kv_cache.cut_back`: convolution states recorded whole (LFM2) are cut back within the last forward's tokens,
    and a run from there equals one forward over the whole; once cut (and trimmed) no further; recurrent states
    (Gated DeltaNet) only ever stay where they are."""
    from specheads.inference.kv_cache import cut_back

    target = tiny_target_factory(family, initializer_range=0.2)
    ids = torch.randint(2, 90, (1, 18), generator=torch.Generator().manual_seed(0))
    full = target(ids).logits
    cache = DynamicCache(config=target.config)
    target(ids[:, :6], past_key_values=cache, use_cache=True)
    cache.activate_past_recording()
    target(ids[:, 6:12], past_key_values=cache, use_cache=True, position_ids=torch.arange(6, 12)[None])
    assert cut_back(cache, 8) == croppable and cut_back(cache, 13) is False
    if croppable:
        assert cut_back(cache, 7) is False and cut_back(cache, 8)  # trimmed: only where it is now
        part = target(ids[:, 8:], past_key_values=cache, use_cache=True, position_ids=torch.arange(8, 18)[None]).logits
        assert (part - full[:, 8:]).abs().max() / full.abs().max() < 1e-5
    else:
        assert cut_back(cache, 12)


@pytest.mark.parametrize(("family", "croppable"), [("lfm2", True), ("qwen3_5_text", False), ("bamba", False)])
def test_a_chain_stopped_short_leaves_the_target_as_if_only_its_kept_part_ran(tiny_target_factory, family, croppable):
    """After a verification keeps 2 of a chain's 4 tokens, the next one's logits are those of one forward over the
    whole kept sequence: convolution-only states (LFM2) cut back in place, nothing pending; recurrent ones (Gated
    DeltaNet, Mamba-2) put back, the kept tokens pending."""
    target = tiny_target_factory(family, initializer_range=0.2)
    verifier = ChainVerifier(target, lambda hidden_states: hidden_states[-1])
    prompt = PROMPT[0]
    verifier.prefill(prompt, 16)
    chain = build_tree_buffers(torch.arange(-1, 3))
    verifier.verify(torch.tensor([5, 6, 7, 8]), chain, prompt.shape[0])
    verifier.compact(prompt.shape[0], torch.arange(2))
    assert verifier.croppable == croppable and (verifier.pending.numel() == 0) == croppable
    logits, _ = verifier.verify(torch.tensor([9, 10, 11, 12]), chain, prompt.shape[0] + 2)
    whole = target(torch.cat([prompt, torch.tensor([5, 6, 9, 10, 11, 12])])[None]).logits[0, -4:]
    assert (logits - whole).abs().max() / whole.abs().max() < 1e-5


TREE_FAMILIES = ("qwen3_5_text", "lfm2", "bamba", "falcon_h1")  # trees too: paths as rows, each with its own states


@pytest.mark.parametrize(("family", "tree"), [*((family, False) for family in sorted(HYBRID_FAMILIES)),
                                              *((family, True) for family in TREE_FAMILIES)])
def test_chains_and_trees_give_the_targets_greedy_output(tiny_target_factory, oracle_drafter, family, tree,
                                                         monkeypatch):
    """An oracle chain that breaks at every depth in turn, or a tree whose right path runs through later siblings
    (wrong decoy leaves beside it: each root-to-leaf path a row with a copy of the states): the target's greedy
    tokens, and each round keeps exactly the drafts that were right, whether the accepted row's tokens were kept in
    the cache or run again as pending."""
    monkeypatch.setattr(chain_verify, "MAX_PENDING", 10_000)  # never a shortened round (the next test has them)
    target = tiny_target_factory(family, initializer_range=0.2)  # sharp weights: a state left wrong changes tokens
    reference = hf_greedy(target, PROMPT, 60)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    siblings = dict(corruption_rate=0.3, rescue_rate=0.6, decoy_rate=0.5) if tree else dict(
        corruption_rate=0.05, rescue_rate=0.0, decoy_rate=0.0)
    drafter = oracle_drafter(reference[0].tolist() + [0] * 8, 97, depth=4, cycle_rejections=True, **siblings)
    lm.use_drafter(drafter)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=60), reference)
    drafter.check_accepted()
    assert set(drafter.accepted) == set(range(5))  # every depth was where a chain broke, and whole chains were kept
    assert (drafter.rescued_rounds > 0) == tree


def test_every_head_type_drafts_a_chain_and_stays_exact(tiny_target_factory):
    """The heads' own drafters draft chains on these targets (top-k 1, the checkpoint's depth), Medusa's default
    tree becomes the chain as deep; the output is the target's."""
    target = tiny_target_factory("qwen3_5_text")
    reference = hf_greedy(target, PROMPT, 30)
    for head_type in sorted(HEAD_TYPES, key=lambda name: name == "medusa"):  # Medusa last: given a static tree below
        lm = SpeculativeLM(target, make_heads(target, head_type))
        described = lm.tree_description()
        assert described["chain"] and described.get("top_k", 1) == 1, described
        assert described["nodes"] == described["depth"], described
        assert torch.equal(lm.generate(PROMPT, max_new_tokens=30), reference), head_type
    lm.configure_tree(chain_tree(3))  # a chain given by the caller is taken as it is
    assert lm.tree_description()["name"] == "chain3"


@pytest.mark.parametrize("cut_depth", [0, 1])
def test_pending_tokens_are_committed_by_a_shortened_round(tiny_target_factory, oracle_drafter, monkeypatch, cut_depth):
    """Rounds that stop short pile their accepted tokens up as pending; at `max_pending` a round verifies its root and
    first `cut_depth` drafts only, which commits them when accepted whole: exact, and those rounds are there (the
    only ones to keep fewer drafts than were right, at most `cut_depth`)."""
    monkeypatch.setattr(chain_verify, "MAX_PENDING", 4)
    monkeypatch.setattr(chain_verify, "CUT_DEPTH", cut_depth)
    target = tiny_target_factory("qwen3_next", initializer_range=0.2)
    reference = hf_greedy(target, PROMPT, 50)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    drafter = oracle_drafter(reference[0].tolist() + [0] * 8, 97, depth=5, corruption_rate=0.15, rescue_rate=0.0,
                             decoy_rate=0.0, seed=3)
    lm.use_drafter(drafter)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=50), reference)
    cut = [i for i, (kept, right) in enumerate(zip(drafter.accepted, drafter.expected_accepts)) if kept != right]
    assert cut and all(drafter.accepted[i] == min(cut_depth, drafter.expected_accepts[i]) for i in cut)


@pytest.mark.parametrize("drafts", ["chain", "tree"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_sampling_follows_the_exact_law(tiny_target_factory, chi_square, family, drafts):
    """A six-token Qwen3.5 (one Gated DeltaNet layer, one attention layer: states put back, pending tokens) and LFM2
    (a short convolution: cut in place): the first three sampled tokens, over chains drafted from the exact law (right
    about half the time) or trees with siblings, a duplicate and an unlikely token (paths as rows), follow the
    target's exact joint law."""
    from .test_generate_sampling import PROMPT as LAW_PROMPT
    from .test_generate_sampling import ArgmaxTreeDrafter, ExactLaw, sample_first_three

    class LawChainDrafter(ArgmaxTreeDrafter):
        """The exact law's likeliest token, then its likeliest successor: a chain right about half the time."""

        def build(self, g):
            nexts = [self.law.p2[g[0]]] + [self.law.p3[g[0], b] for b in range(6)] if len(g) == 1 else (
                [self.law.p3[g[0], g[1]]] + [torch.ones(6)] * 6)
            first = int(nexts[0].argmax())
            return torch.tensor([g[-1], first, int(nexts[1 + first].argmax())]), build_tree_buffers(
                torch.tensor([-1, 0, 1]))

    target = tiny_target_factory(family, seed=1, vocab_size=6, initializer_range=0.2)  # next-token p ~0.3-0.6
    law = ExactLaw(target, LAW_PROMPT, temperature=0.8)
    lm = SpeculativeLM(target, create_heads(target, "eagle3"))
    lm.use_drafter(LawChainDrafter(law) if drafts == "chain" else ArgmaxTreeDrafter(law))
    samples = sample_first_three(lm, 2000, seed=2, prompt=LAW_PROMPT, temperature=0.8)
    result = chi_square(samples, law.joint())
    assert result.passed, result
    assert result.dof >= 10, result
    assert lm.accepted_drafts > 0.5 * len(samples)


def test_heads_trained_on_a_hybrid_target_get_drafts_accepted(tiny_target_factory):
    """Training reads a hybrid target's features as any other's: EAGLE-3 heads trained (~5 s) on the target's own
    greedy text get more than two tokens a round accepted on it, and the output stays the target's."""
    from specheads.training.config import load_run_config
    from specheads.training.data import collate
    from specheads.training.train import compute_loss

    target = tiny_target_factory("qwen3_5_text")
    config = load_run_config(CONFIGS / "eagle3_stories260k.yaml")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (1, 6), generator=g) for _ in range(4)]
    rows = [hf_greedy(target, ids, 40)[0].tolist() for ids in prompts]
    batch = collate([{"input_ids": row, "loss_mask": [0] * 6 + [1] * 40} for row in rows])
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", tree_depth=5).train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    for _ in range(120):
        loss = compute_loss(config, heads, heads, target, batch, [0, 1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    lm = SpeculativeLM(target, heads.eval())
    accepted = []
    for ids in prompts:
        assert torch.equal(lm.generate(ids, max_new_tokens=32), hf_greedy(target, ids, 32))
        accepted.append(lm.last_stats["mean_accepted"])
    assert sum(accepted) / len(accepted) > 2.0, accepted


def test_what_hybrids_cannot_serve_is_refused_by_name(tiny_target_factory):
    target = tiny_target_factory("lfm2")
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    with pytest.raises(ValueError, match="as the rows of a forward of their own: a batch's sequences run one after another"):
        lm.generate(torch.cat([PROMPT, PROMPT]), max_new_tokens=4, batched=True)
    with pytest.raises(ValueError, match="fast_path=True is not available: .*path by path on the eager path"):
        lm.generate(PROMPT, max_new_tokens=4, fast_path=True)
    with pytest.raises(ValueError, match="BatchEngine cannot batch its requests; the server and generate --prompts"):
        BatchEngine(lm)
    out = lm.generate(torch.cat([PROMPT, PROMPT]), max_new_tokens=10)  # a batch runs row by row
    assert torch.equal(out[1:], hf_greedy(target, PROMPT, 10))


def test_heads_trees_prompt_lookup_and_static_trees_on_a_hybrid(tiny_target_factory):
    """A `tree_top_k` the caller gives, prompt lookup's branch, predicted outputs and a Medusa static tree are
    verified path by path (rows); the checkpoint's default stays a chain. Outputs are the target's."""
    target = tiny_target_factory("qwen3_5_text", initializer_range=0.2)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 3, 14, 15, 92, 65, 3, 14]])
    reference = hf_greedy(target, prompt, 30)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    lm.configure_tree(tree_depth=4, tree_top_k=3, tree_num_nodes=9)
    assert lm.tree_description()["top_k"] == 3
    assert torch.equal(lm.generate(prompt, max_new_tokens=30), reference)
    lm.configure_lookup(6)
    assert torch.equal(lm.generate(prompt, max_new_tokens=30), reference)
    assert torch.equal(lm.generate(prompt, max_new_tokens=30, prediction=reference[0, 12:].tolist()), reference)
    assert lm.last_stats["mean_accepted"] > 4  # the prediction is the answer: long rows accepted whole
    medusa = SpeculativeLM(target, make_heads(target, "medusa"))
    assert medusa.tree_description()["name"].startswith("chain")  # the default
    medusa.configure_tree("medusa_small")
    assert torch.equal(medusa.generate(prompt, max_new_tokens=30), reference)


def test_tree_auto_tries_chains(tiny_target_factory):
    """`--tree auto` on a hybrid target times chains of several depths (and the chain verifier's forward per length)."""
    from specheads.inference.autotune import CHAIN_DEPTHS, autotune_tree

    target = tiny_target_factory("lfm2")
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    report = autotune_tree(lm, [PROMPT], max_new_tokens=8)
    assert [trial["tree"]["depth"] for trial in report["trials"]] == CHAIN_DEPTHS
    assert all(trial["tree"]["top_k"] == 1 and trial["tree"]["chain"] for trial in report["trials"])
    assert set(report["verification_ms_by_nodes"]) >= {depth + 1 for depth in CHAIN_DEPTHS}  # with the root
    assert all(ms > 0 for ms in report["verification_ms_by_nodes"].values())
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=20), hf_greedy(target, PROMPT, 20))


def test_bench_runs_a_hybrid_target_from_its_folder(tmp_path, stories260k):
    """`specheads bench --tree auto` on a Qwen3.5 folder (stories260K's tokenizer, random weights): chains chosen,
    greedy outputs identical, and transformers' prompt-lookup peer (which refuses stateful models) left out."""
    from specheads.inference.bench import bench_main

    _, tokenizer = stories260k
    target = build_tiny_target("qwen3_5_text", vocab_size=512, eos_token_id=None)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    create_heads(target, "eagle3").save_pretrained(tmp_path / "heads")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "bench" / "results.json"
    argv = ["--target", str(tmp_path / "target"), "--heads", str(tmp_path / "heads"), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--threads", "1", "--tree", "auto", "--out", str(out)]
    assert bench_main(argv) == 0
    results = json.loads(out.read_text())
    assert results["greedy_identical"] is True
    assert results["tree"]["chain"] and results["tree"]["top_k"] == 1, results["tree"]
    assert all("prompt_lookup_tokens_per_second" not in row for row in results["per_prompt"])


def test_a_qwen3_5_reading_an_image_gives_its_greedy_output(tiny_vlm_factory, oracle_drafter, monkeypatch):
    """Qwen3.5 as its checkpoints are (a vision-language model, M-RoPE): with an image in the prompt, heads' chains and
    an oracle's chains broken at every depth (pending tokens run again at their text positions, which carry the
    image grid's offset) give the target's own greedy tokens."""
    monkeypatch.setattr(chain_verify, "MAX_PENDING", 4)
    target, ids, inputs = tiny_vlm_factory("qwen3_5")
    reference = target.generate(ids, max_new_tokens=40, do_sample=False, **inputs)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    assert lm.verifies_chains
    assert torch.equal(lm.generate(ids, max_new_tokens=40, **inputs), reference)
    vocab = target.config.get_text_config().vocab_size
    drafter = oracle_drafter(reference[0].tolist() + [0] * 8, vocab, depth=4, corruption_rate=0.1, rescue_rate=0.0,
                             decoy_rate=0.0, cycle_rejections=True)
    lm.use_drafter(drafter)
    assert torch.equal(lm.generate(ids, max_new_tokens=40, **inputs), reference)
    assert max(drafter.accepted) >= 3  # long chains were kept, and short ones left tokens pending


def test_the_serving_loop_answers_a_hybrids_requests_one_after_another(tiny_target_factory):
    """The server's loop (and generate --prompts) take a `SerialEngine` for a hybrid target: requests from several
    threads are answered whole, in turn, exactly and streamed; a request given up while it waits is not run, and one
    given up while it runs stops after its round in progress."""
    import threading

    from specheads.inference.serial_engine import SerialEngine
    from specheads.inference.serving_loop import ServingLoop

    target = tiny_target_factory("qwen3_5_text")
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    loop = ServingLoop(lm, max_batch=4)
    assert isinstance(loop.engine, SerialEngine)
    prompts = [PROMPT, PROMPT[:, :5], PROMPT[:, 2:]]

    class Collect:
        def __init__(self) -> None:
            self.parts: list[list[int]] = []
            self.ended = False

        def put(self, tokens: torch.Tensor) -> None:
            self.parts.append(tokens.tolist())

        def end(self) -> None:
            self.ended = True

    streamers = [Collect() for _ in prompts]
    requests = [lm.batch_request(ids, max_new_tokens=30, streamer=s) for ids, s in zip(prompts, streamers)]
    threads = [threading.Thread(target=loop.run, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for request, ids, streamer in zip(requests, prompts, streamers):
        assert request.new_tokens == hf_greedy(target, ids, 30)[0, ids.shape[1]:].tolist()
        assert streamer.parts[0] == ids[0].tolist() and sum(streamer.parts[1:], []) == request.new_tokens
        assert streamer.ended and request.target_forwards > 0
    metrics = loop.metrics()
    assert metrics["requests_finished"] == 3 and metrics["generated_tokens"] == 90

    class CancelAfterFirstTokens(Collect):
        def put(self, tokens: torch.Tensor) -> None:
            super().put(tokens)
            if len(self.parts) > 1:
                request.cancelled = True  # the client is gone after the first emitted tokens

    request = lm.batch_request(PROMPT, max_new_tokens=30, streamer=CancelAfterFirstTokens())
    loop.run(request)
    assert 0 < len(request.new_tokens) < 30
    engine = SerialEngine(lm)
    waiting = lm.batch_request(PROMPT, max_new_tokens=30)
    waiting.cancelled = True
    engine.add([waiting])
    assert engine.step() == [waiting] and waiting.new_tokens == [] and engine.stats["target_forwards"] == 0
    loop.close()


def test_generate_prompts_answers_a_hybrids_file_in_turn(tmp_path, stories260k):
    """`generate --prompts FILE` (inference/batch_file.py) on a hybrid target: every prompt answered exactly."""
    from specheads.inference.batch_file import generate_file
    from specheads.inference.prompts import Prompt

    _, tokenizer = stories260k
    target = build_tiny_target("qwen3_5_text", vocab_size=512, eos_token_id=None)
    lm = SpeculativeLM(target, create_heads(target, "eagle3"), tokenizer=tokenizer)
    texts = ["Once upon a time", "The cat sat", "A dog ran home"]
    prompts = [Prompt(prompt_id=str(i), category="story", text=text, input_ids=tokenizer(text, return_tensors="pt").input_ids)
               for i, text in enumerate(texts)]
    summary = generate_file(lm, prompts, tmp_path / "answers.jsonl", max_batch=3, max_new_tokens=12, show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert summary["answered"] == 3 and len(records) == 3
    for record, prompt in zip(sorted(records, key=lambda r: r["id"]), prompts):
        expected = hf_greedy(target, prompt.input_ids, 12)[0, prompt.input_ids.shape[1]:]
        assert record["answer"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_server_answers_a_hybrid_target_over_http(stories260k):
    """`specheads serve` on a hybrid (Qwen3.5 of stories260K's vocabulary): chat answers are the target's greedy ones,
    a later turn continues the states the first one left (the server's kept caches), and completions stream."""
    import threading

    from specheads.inference.server import CompletionService, make_server

    from .test_server import TEMPLATE, chat_ids, greedy_text, post

    _, tokenizer = stories260k
    target = build_tiny_target("qwen3_5_text", vocab_size=512, eos_token_id=None)
    lm = SpeculativeLM(target, create_heads(target, "eagle3"), tokenizer=tokenizer)
    service = CompletionService(lm, "hybrid", {"max_new_tokens": 16}, cache_slots=2, chat_template=TEMPLATE)
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        messages = [{"role": "user", "content": "Tom had a big red ball"}]
        status, body = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 16})
        assert status == 200, body
        answer = body["choices"][0]["message"]["content"]
        assert answer == greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 16)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Where did it go"}]
        status, body = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 16})
        assert body["choices"][0]["message"]["content"] == greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 16)
        assert body["specheads"]["reused_prompt_tokens"] > 10  # the first turn's states, kept in the server's pool
        request = {"prompt": "Once upon a time", "max_tokens": 12, "stream": True,
                   "stream_options": {"include_usage": True}}
        status, events = post(url + "/v1/completions", request)  # (random weights: text pieces of broken UTF-8)
        assert status == 200 and events[-1]["usage"]["completion_tokens"] == 12
        assert len([e for e in events if e["choices"] and e["choices"][0]["text"]]) > 1
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_the_cpu_kernels_serve_hybrids_exactly(tiny_target_factory, family):
    """oneDNN linear layers, int8 heads, grouped attention and the certified bf16 argmax (what `make bench` runs) on
    a hybrid target: the output of its own `generate` on the same layers."""
    target = copy.deepcopy(tiny_target_factory(family, initializer_range=0.2))
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    used = lm.use_cpu_kernels(cpu_linear="onednn", draft_linear="int8", cpu_attention="auto", cpu_argmax="bf16")
    assert used["cpu_argmax"] == "bf16" and used["cpu_linear"] == "onednn"
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30), hf_greedy(target, PROMPT, 30))


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_a_prompt_cache_carries_a_hybrids_conversation(tiny_target_factory, oracle_drafter, family):
    """Multi-turn chat on a hybrid: a prompt that continues all the cache holds runs only its new tokens (the states
    are those after the held positions; a turn's last pending tokens were never held, the next turn runs them); an
    edited history runs whole (the states after its unchanged start are gone). Every answer is the target's."""
    target = tiny_target_factory(family, initializer_range=0.2)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    cache = PromptCache()

    def turn(ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        reference = hf_greedy(target, ids, max_new_tokens)
        lm.use_drafter(oracle_drafter(reference[0].tolist() + [0] * 8, 97, depth=4, corruption_rate=0.3,
                                      rescue_rate=0.0, decoy_rate=0.0))  # chains kept whole and cut short
        out = lm.generate(ids, max_new_tokens=max_new_tokens, prompt_cache=cache)
        assert torch.equal(out, reference)
        return out

    first = turn(PROMPT, 24)
    second = turn(torch.cat([first, torch.tensor([[5, 6, 7]])], dim=1), 24)
    assert lm.last_stats["reused_prompt_tokens"] > PROMPT.shape[1]
    edited = second.clone()
    edited[0, 4] = 50
    edited = turn(edited, 16)
    assert lm.last_stats["reused_prompt_tokens"] == 0
    turn(torch.cat([edited, torch.tensor([[8, 9]])], dim=1), 16)
    assert lm.last_stats["reused_prompt_tokens"] > second.shape[1]


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5_text"])
def test_a_regenerated_answer_or_edited_last_message_reuses_the_history_before_it(tiny_target_factory, oracle_drafter,
                                                                                   family):
    """A hybrid's cache keeps its states where each turn started (`PromptCache.checkpoints`): asking the last question
    again, or another one in its place, reuses the conversation before it; an edit before every checkpoint runs whole.
    Every answer is the target's."""
    target = tiny_target_factory(family, initializer_range=0.2)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    cache = PromptCache()

    def turn(ids: torch.Tensor, max_new_tokens: int = 12) -> torch.Tensor:
        reference = hf_greedy(target, ids, max_new_tokens)
        lm.use_drafter(oracle_drafter(reference[0].tolist() + [0] * 8, 97, depth=4, corruption_rate=0.3,
                                      rescue_rate=0.0, decoy_rate=0.0))
        out = lm.generate(ids, max_new_tokens=max_new_tokens, prompt_cache=cache)
        assert torch.equal(out, reference)
        return out

    first = turn(PROMPT)
    second = turn(torch.cat([first, torch.tensor([[5, 6, 7]])], dim=1))
    history = lm.last_stats["reused_prompt_tokens"]  # where the second turn started: its checkpoint
    assert history > PROMPT.shape[1] and [k for k, _ in cache.checkpoints] == [history]
    assert cache.last_call_start == history  # what a server's pool reads to give an edited last message this slot
    third = turn(torch.cat([second, torch.tensor([[8, 9]])], dim=1))
    later = lm.last_stats["reused_prompt_tokens"]
    assert later > history and [k for k, _ in cache.checkpoints] == [history, later]
    turn(torch.cat([second, torch.tensor([[8, 9]])], dim=1))  # the third answer regenerated
    assert lm.last_stats["reused_prompt_tokens"] == later
    turn(torch.cat([first, torch.tensor([[11, 12, 13, 14]])], dim=1))  # the second question edited
    assert lm.last_stats["reused_prompt_tokens"] == history
    assert [k for k, _ in cache.checkpoints] == [history]  # the later one held other tokens
    # what `take` hands over for another edit: a cache that continues as a fresh run of the history would
    prompt = torch.cat([first, torch.tensor([[21, 22]])], dim=1)[0]
    held, _, kept = cache.take(prompt, target, lm.heads)
    assert kept == history
    with torch.no_grad():
        continued = target(prompt[None, kept:], **cache_kwargs(target, held), use_cache=True).logits
        torch.testing.assert_close(continued, target(prompt[None]).logits[:, kept:], atol=1e-4, rtol=1e-4)
    edited = third[:, :6].clone()
    edited[0, 2] = 50  # before every checkpoint
    turn(edited)
    assert lm.last_stats["reused_prompt_tokens"] == 0 and cache.checkpoints == []


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5_text"])
def test_the_chain_bench_script_runs_and_checks_identity(tmp_path, monkeypatch, family):
    """scripts/hybrid_chain_bench.py --tiny: oracle chains beside plain `generate`, outputs identical, a JSON report
    with the verification cost by tokens (threads left as the suite set them)."""
    import runpy
    import sys

    out = tmp_path / "chains.json"
    script = Path(__file__).parents[2] / "scripts" / "hybrid_chain_bench.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--family", family, "--tiny", "--prompts", "2", "--max-new-tokens",
                                      "12", "--max-pending", "2,16", "--threads", "1", "--out", str(out)])
    monkeypatch.setattr(chain_verify, "MAX_PENDING", chain_verify.MAX_PENDING)  # the script sets it: put back after
    monkeypatch.setattr(chain_verify, "CUT_DEPTH", chain_verify.CUT_DEPTH)
    runpy.run_path(str(script), run_name="__main__")
    report = json.loads(out.read_text())
    assert [row["max_pending"] for row in report["settings"]] == [2, 16]
    assert all(row["tau"] > 1 for row in report["settings"]) and report["runs_differing_from_generate"] == 0
    assert set(report["verification_ms_by_tokens"]) == {"1", "2", "4", "6", "8", "12", "16", "24"}


def test_the_regenerate_bench_script_runs_and_checks_identity(tmp_path, monkeypatch):
    """scripts/hybrid_regenerate_bench.py --tiny: a regeneration from the checkpoint runs fewer prompt tokens than from
    an empty cache, the same answer (the script checks it)."""
    import runpy
    import sys

    scripts = Path(__file__).parents[2] / "scripts"
    out = tmp_path / "regenerate.json"
    monkeypatch.syspath_prepend(str(scripts))  # it imports hybrid_chain_bench's shapes, as `python scripts/...` does
    monkeypatch.setattr(sys, "argv", ["hybrid_regenerate_bench.py", "--tiny", "--history", "48", "--repeats", "1",
                                      "--threads", "1", "--out", str(out)])
    runpy.run_path(str(scripts / "hybrid_regenerate_bench.py"), run_name="__main__")
    results = json.loads(out.read_text())["results"]
    assert 0 < results["checkpoint"]["prompt_tokens_run"] < results["empty cache"]["prompt_tokens_run"]
