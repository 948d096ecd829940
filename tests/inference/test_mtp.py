"""MTP drafting (heads/mtp.py): the target's own multi-token-prediction layer drafts EAGLE-style trees.

Tiny DeepSeek-V3, GLM-4.5 and Mellum targets written in their checkpoints' layouts (tests/mtp_targets.py): the MTP layer is
transformers' own (`MtpModel`), read as transformers reads it; outputs are the target's (greedy identical, sampling
chi-square tested); a target whose MTP layer is right drafts trees that are accepted whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.cli import main
from specheads.heads.describe import describe_heads
from specheads.heads.mtp import MtpHeads, load_mtp_model

from ..mtp_targets import MTP_FAMILIES, cycle_of, load_mtp_target, mtp_layer_inputs, write_mtp_target
from .conftest import hf_greedy, left_pad, load_sampling_harness

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9, 79]])
STORIES = Path(__file__).resolve().parents[2] / "specheads" / "assets" / "stories260K"


@pytest.fixture(scope="module")
def mtp_folders(tmp_path_factory) -> dict[str, Path]:
    """family -> a folder holding a tiny random target of it with one MTP layer."""
    return {family: write_mtp_target(tmp_path_factory.mktemp(family), family) for family in MTP_FAMILIES}


@pytest.fixture(scope="module")
def cycling_folder(tmp_path_factory) -> Path:
    """A DeepSeek-V3 target whose MTP layer predicts its next-but-one token exactly (`write_mtp_target(cycling=True)`),
    with stories260K's tokenizer (vocabulary 512) for the command line."""
    return write_mtp_target(tmp_path_factory.mktemp("cycling"), "deepseek_v3", vocab_size=512, cycling=True,
                            tokenizer_from=STORIES)


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_the_mtp_heads_are_the_targets_mtp_layer_and_decode_exactly(mtp_folders, family):
    """At every position the heads' logits are those of transformers' own MTP layer (`MtpModel.forward_layer`, its
    causal mask and positions one ahead), and greedy decoding with its trees is the target's own."""
    target = load_mtp_target(mtp_folders[family])
    heads = MtpHeads.from_target(target)
    features, next_ids, mask = mtp_layer_inputs(target, PROMPT)  # f_t, x_{t+1}, causal
    n = PROMPT.shape[1]
    with torch.no_grad():
        ours = heads.logits(heads(features, next_ids, torch.arange(n)[None], mask))
        mtp = load_mtp_model(target)  # transformers' own, on its own
        reference = mtp.shared_head(mtp.forward_layer(0, features, torch.arange(1, n + 1)[None], None, input_ids=next_ids))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    lm = SpeculativeLM(target, heads)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=40), hf_greedy(target, PROMPT, 40))
    assert lm.tree_description()["mtp"] is True
    assert lm.tree_description()["nodes"] == 8  # the MTP default tree on a CPU


def test_mtp_batches_and_prompt_lookup_decode_exactly(mtp_folders):
    """Left-padded rows decoded together (each as alone) and prompt lookup grafted onto the MTP trees."""
    target = load_mtp_target(mtp_folders["glm4_moe"])
    lm = SpeculativeLM(target, MtpHeads.from_target(target), lookup_tokens=4)
    prompts = [PROMPT[0].tolist(), [5, 6, 7, 5, 6, 7, 5]]
    input_ids, attention_mask = left_pad(prompts)
    for batched in (False, True):
        out = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, batched=batched)
        for row, prompt in enumerate(prompts):
            alone = hf_greedy(target, torch.tensor([prompt]), 20)[0, len(prompt):]
            assert torch.equal(out[row, input_ids.shape[1]:], alone), (batched, row)


def test_right_mtp_drafts_are_accepted_whole(cycling_folder):
    """Where the MTP layer is right, every level of its trees is accepted: reading anything but (f_t, x_{t+1}) at its
    positions would make it wrong."""
    target, cycle = load_mtp_target(cycling_folder), cycle_of(cycling_folder)
    lm = SpeculativeLM(target, MtpHeads.from_target(target))
    out = lm.generate(PROMPT, max_new_tokens=30)
    expected = [int(PROMPT[0, -1])]
    for _ in range(30):
        expected.append(cycle[expected[-1]])
    assert out[0, PROMPT.shape[1]:].tolist() == expected[1:]
    assert lm.last_stats["accepted_per_depth"] == [1.0, 1.0, 1.0, 1.0]  # the CPU tree's 4 levels, every round
    lm.configure_tree(tree_depth=2, tree_top_k=2, tree_num_nodes=4)
    lm.generate(PROMPT, max_new_tokens=30)
    assert lm.last_stats["accepted_per_depth"] == [1.0, 1.0] and lm.last_stats["rounds"] == 10  # 3 tokens a round


def test_mtp_sampling_follows_the_exact_law(chi_square):
    """Sampling with a DeepSeek-V3 MTP layer's trees (fresh random weights, a 6-token target) gives the target's exact
    joint law of the first three tokens."""
    vocab = 6
    _, fields = MTP_FAMILIES["deepseek_v3"]
    config = AutoConfig.for_model("deepseek_v3", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab, bos_token_id=1,
                                  eos_token_id=None, pad_token_id=0, num_nextn_predict_layers=1,
                                  **{**fields, "first_k_dense_replace": 0})
    torch.manual_seed(1)
    target = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # a law far from flat
    heads = MtpHeads(MtpHeads.config_for(target, cpu_tree=dict(tree_depth=3, tree_top_k=3, tree_num_nodes=8)))
    lm = SpeculativeLM(target, heads)
    harness, prompt = load_sampling_harness("sampling_harness_mtp"), [1, 3, 4, 5]
    law = harness.ExactLaw(target, prompt, temperature=0.8)
    samples = harness.sample_first_three(lm, 1200, seed=2, prompt=prompt, temperature=0.8)
    result = chi_square(samples, law.joint())
    assert result.passed, result
    assert lm.accepted_drafts > 0.2 * len(samples)  # top-3 of 6 tokens: drafts often kept


def test_a_target_without_mtp_layers_is_refused_by_name(mtp_folders, tmp_path, tiny_target_factory):
    with pytest.raises(ValueError, match=r"model_type='llama'\) declares no MTP layer.*--heads, --draft-model"):
        load_mtp_model(tiny_target_factory("llama"))
    # Nemotron-H's family: the checkpoint has the layer (attention, then experts), nothing here builds it
    nano = tiny_target_factory("nemotron_h", num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"ships 1 MTP layer\(s\) but transformers .* model_type='nemotron_h'"):
        load_mtp_model(nano)
    target = load_mtp_target(mtp_folders["glm4_moe"])
    config_only = AutoModelForCausalLM.from_config(target.config)
    config_only.config.name_or_path = ""
    with pytest.raises(ValueError, match="built from a config"):
        load_mtp_model(config_only)
    target.save_pretrained(tmp_path / "resaved")  # transformers drops the MTP tensors it did not load
    with pytest.raises(ValueError, match=r"could not load the MTP layers of .*resaved.*original checkpoint"):
        load_mtp_model(load_mtp_target(tmp_path / "resaved"))


def test_mtp_heads_save_load_and_draft_in_int8(mtp_folders, tmp_path):
    """A copy of the MTP layer: saved and loaded as a specheads checkpoint it drafts as before (a target with other
    weights refused), and int8 draft layers keep the output the target's."""
    folder = mtp_folders["deepseek_v3"]
    target = load_mtp_target(folder)
    heads = create_heads(target, "mtp")
    heads.save_pretrained(tmp_path / "heads")
    reloaded = load_heads(tmp_path / "heads", target=target)
    assert isinstance(reloaded, MtpHeads) and reloaded.config.draft_layer_config["model_type"] == "deepseek_v3"
    features, positions = torch.randn(1, 4, 64), torch.arange(4)[None]
    mask = torch.full((1, 1, 4, 4), torch.finfo(torch.float32).min).triu(1)
    saved, loaded = heads.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[name], loaded[name]) for name in saved)
    with torch.no_grad():  # same weights, same inputs: equal up to the BLAS's alignment-dependent rounding
        torch.testing.assert_close(reloaded.logits(reloaded(features, PROMPT[:, :4], positions, mask)),
                                   heads.logits(heads(features, PROMPT[:, :4], positions, mask)), rtol=1e-6, atol=1e-6)
    other = write_mtp_target(tmp_path / "other", "deepseek_v3", seed=5)
    with pytest.raises(ValueError, match="input embedding differs"):
        load_heads(tmp_path / "heads", target=load_mtp_target(other))
    lm = SpeculativeLM(target, reloaded)
    assert lm.use_int8_draft_linears() > 0
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=24), hf_greedy(target, PROMPT, 24))
    with pytest.raises(ValueError, match=r"exactly one of .*\['heads', 'mtp'\]"):
        SpeculativeLM.from_pretrained(str(folder), heads=str(folder), mtp=True)


def test_mtp_from_the_command_line(cycling_folder, capfd, tmp_path):
    """`specheads generate --mtp` streams the target's text with its MTP layer's trees; `specheads eval --heads mtp`
    scores the MTP layer as heads are scored (here always right)."""
    assert main(["generate", "--target", str(cycling_folder), "--mtp", "--prompt", "Once upon a time",
                 "--max-new-tokens", "20"]) == 0
    err = capfd.readouterr().err
    assert "20 tokens" in err and float(err.split("tau=")[1].split(",")[0]) >= 3.5  # 5 tokens a round
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(cycling_folder), "--heads", "mtp", "--prompts", str(prompts),
                 "--max-new-tokens", "16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["heads"] == "mtp" and report["acc_depth1"] == report["acc_depth4"] == 1.0, report
    summary = describe_heads(cycling_folder)  # `specheads info` on the model folder points at --mtp
    assert summary["mtp_layers"] == 1 and f"--target {cycling_folder} --mtp" in summary["mtp_usage"]


def test_mtp_bench_measures_transformers_mtp_chain_beside_the_trees(cycling_folder, tmp_path):
    """`specheads bench --mtp`: the trees against plain `generate`, with transformers' `generate(use_mtp=True)` (a
    chain drafted by the same layer) as the peer, outputs checked identical."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(cycling_folder), "--mtp", "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--modes", "greedy", "--prompt-lookup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["heads"], report["head_type"], report["greedy_identical"]) == ("mtp", "mtp", True)
    row = report["per_prompt"][0]
    assert row["assisted_tokens_per_second"] > 0 and row["accepted_per_depth"][0] == 1.0


def test_saved_mtp_heads_decode_from_plain_transformers(mtp_folders, tmp_path):
    """A saved MTP layer (e.g. fine-tuned) exported for transformers: `target.generate(custom_generate=...)` decodes
    with it, the target's own greedy output."""
    from specheads.inference.custom_generate import export_for_transformers

    target = load_mtp_target(mtp_folders["glm4_moe"])
    create_heads(target, "mtp").save_pretrained(tmp_path / "heads")
    folder = export_for_transformers(tmp_path / "heads", tmp_path / "exported")
    stats: dict = {}
    out = target.generate(PROMPT, max_new_tokens=20, custom_generate=str(folder), trust_remote_code=True, stats=stats)
    assert torch.equal(out, hf_greedy(target, PROMPT, 20)) and stats["new_tokens"] == 20
