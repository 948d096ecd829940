"""MTP drafting with the layers transformers ships but does not load (heads/checkpoint_mtp.py): Qwen3-Next's and
Qwen3.5's `mtp.*` layer and GLM-4.7-Flash's `model.layers.N.*` one, read from the checkpoint; on Qwen's hybrids they
draft the chains the DeltaNet layers are verified by.

Tiny targets in the checkpoints' layouts (tests/mtp_targets.py): Qwen: a Gated DeltaNet layer, a full-attention
layer, then the MTP layer under `mtp.*` (dense, mixture of experts stored expert by expert), and a Qwen3.5
vision-language model; GLM-4.7-Flash: two MLA layers, then the MTP layer. The heads are checked against the MTP formula
written out here over the checkpoint's tensors (the projection, the norms, the decoder layer as transformers loads
it), and decode the target's own greedy output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.cli import main
from specheads.heads.describe import describe_heads
from specheads.heads.mtp import MtpHeads, mtp_layer_count

from ..conftest import build_tiny_vlm
from ..mtp_targets import (
    CHECKPOINT_MTP_FAMILIES,
    cycle_of,
    load_mtp_target,
    mtp_layer_inputs,
    write_mtp_target,
)
from .conftest import hf_greedy

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9, 79]])
STORIES = Path(__file__).resolve().parents[2] / "specheads" / "assets" / "stories260K"


@pytest.fixture(scope="module")
def mtp_folders(tmp_path_factory) -> dict[str, Path]:
    """family -> a folder holding a tiny random target of it with one MTP layer transformers does not load."""
    return {family: write_mtp_target(tmp_path_factory.mktemp(family), family) for family in CHECKPOINT_MTP_FAMILIES}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm; Qwen3-Next's checkpoints store w for the scale 1 + w (`zero_centred`), GLM's the scale itself."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight if zero_centred else weight)


def reference_mtp_logits(folder: Path, target, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits from the checkpoint's tensors, as vLLM's qwen3_next_mtp / glm4_moe_lite_mtp compute them:
    norm(proj([norm_e(embed(x_{t+1})); norm_h(f_t)])) through the decoder layer, its norm, the lm_head. The decoder
    layer is loaded by transformers itself, as layer N of a copy of the target whose config has N + 1 layers."""
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    layers, qwen = config["num_hidden_layers"], "mtp.fc.weight" in tensors
    prefix = f"model.layers.{layers}."
    enorm, hnorm, proj, norm = (["mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.fc", "mtp.norm"] if qwen
                                else [prefix + n for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")])
    copy = folder.parent / f"{folder.name}_as_layer"
    if not copy.exists():
        copy.mkdir()
        config["num_hidden_layers"] = layers + 1
        field, kind = ("layer_types", "full_attention") if qwen else ("mlp_layer_types", "sparse")
        config[field] = [*config[field], kind]
        (copy / "config.json").write_text(json.dumps(config))
        renamed = {name.replace("mtp.layers.0.", prefix): tensor for name, tensor in tensors.items()}
        save_file(renamed, copy / "model.safetensors", metadata={"format": "pt"})
    whole = AutoModelForCausalLM.from_pretrained(copy).eval()
    eps, n = whole.config.rms_norm_eps, features.shape[1]
    embeds = target.get_input_embeddings()(next_ids)
    joined = torch.cat([rms_norm(embeds, tensors[f"{enorm}.weight"], eps, qwen),
                        rms_norm(features, tensors[f"{hnorm}.weight"], eps, qwen)], dim=-1)
    hidden = joined @ tensors[f"{proj}.weight"].T
    positions = torch.arange(1, n + 1)[None]  # x_{t+1}'s positions (a shift: rotary attention reads differences)
    mask = torch.full((1, 1, n, n), torch.finfo(torch.float32).min).triu(1)
    hidden = whole.model.layers[layers](hidden, position_embeddings=whole.model.rotary_emb(hidden, positions),
                                        attention_mask=mask, position_ids=positions)
    return target.lm_head(rms_norm(hidden, tensors[f"{norm}.weight"], eps, qwen))


@pytest.mark.parametrize("family", list(CHECKPOINT_MTP_FAMILIES))
def test_the_mtp_heads_are_the_checkpoints_mtp_layer_and_decode_exactly(mtp_folders, family):
    """At every position the heads' logits are the formula's over the checkpoint's MTP tensors (experts stacked as
    transformers stacks the target's), and greedy decoding with its chains (trees on GLM) is the target's own."""
    folder = mtp_folders[family]
    target = load_mtp_target(folder)
    assert mtp_layer_count(target) == 1
    heads = MtpHeads.from_target(target)
    features, next_ids, mask = mtp_layer_inputs(target, PROMPT)  # f_t, x_{t+1}, causal
    n = PROMPT.shape[1]
    with torch.no_grad():
        ours = heads.logits(heads(features, next_ids, torch.arange(n)[None], mask))
        reference = reference_mtp_logits(folder, target, features, next_ids)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    lm, hybrid = SpeculativeLM(target, heads), family != "glm4_moe_lite"
    assert lm.verifies_chains == hybrid == lm.tree_description().get("chain", False) and lm.tree_description()["mtp"]
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=40), hf_greedy(target, PROMPT, 40))
    lm.configure_tree(tree_depth=3, tree_top_k=2, tree_num_nodes=6)  # several paths (a hybrid's: rows of one forward)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=24), hf_greedy(target, PROMPT, 24))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next", "glm4_moe_lite"])
def test_a_right_mtp_layer_has_its_drafts_accepted_whole(tmp_path, family):
    """Where the MTP layer is right (a cycling target: it predicts x_{t+2} exactly), every level of every chain (tree
    on GLM) is accepted: it reads (f_t, x_{t+1}) where it should, on hybrids whose chains run pending tokens again."""
    folder = write_mtp_target(tmp_path / family, family, cycling=True)
    target, cycle = load_mtp_target(folder), cycle_of(folder)
    lm = SpeculativeLM(target, MtpHeads.from_target(target))
    expected = [int(PROMPT[0, -1])]
    for _ in range(30):
        expected.append(cycle[expected[-1]])
    assert lm.generate(PROMPT, max_new_tokens=30)[0, PROMPT.shape[1]:].tolist() == expected[1:]
    assert lm.last_stats["accepted_per_depth"] == [1.0, 1.0, 1.0, 1.0]  # the CPU tree's 4 levels, every round


def test_a_sharded_checkpoint_from_the_hub_cache(mtp_folders, tmp_path, offline_hub_cache):
    """Real checkpoints are sharded with an index, the MTP layer in a shard of its own, and loaded by Hub id: the
    layer is read through the index from the offline HF cache, the same layer as from the single file."""
    folder = mtp_folders["qwen3_next"]
    tensors = load_file(folder / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(folder / "config.json", sharded / "config.json")
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith("mtp.")},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("mtp.")}}
    for name, part in shards.items():
        save_file(part, sharded / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    snapshot = offline_hub_cache.publish(sharded, "Qwen/Qwen3-Next-tiny")
    target = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-Next-tiny").eval().requires_grad_(False)
    (snapshot / "model-00001-of-00002.safetensors").unlink()  # only the index and the MTP layer's shard are read
    heads, single = MtpHeads.from_target(target), MtpHeads.from_target(load_mtp_target(folder))
    assert all(torch.equal(heads.state_dict()[name], value) for name, value in single.state_dict().items())
    assert torch.equal(SpeculativeLM(target, heads).generate(PROMPT, max_new_tokens=16), hf_greedy(target, PROMPT, 16))


def test_a_qwen3_5_vision_language_model_drafts_with_its_mtp_layer(tmp_path):
    """Qwen3.5 as released (a vision-language model; `mtp.*` beside `model.language_model.*`), reading an image:
    its MTP layer is found under the text config and the output is the target's greedy one."""
    model, ids, inputs = build_tiny_vlm("qwen3_5")
    folder = tmp_path / "qwen3_5"
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    hidden, generator = model.config.text_config.hidden_size, torch.Generator().manual_seed(3)
    layer = "model.language_model.layers.1."  # the full-attention layer's tensors stand in for the MTP layer's
    tensors.update({"mtp.layers.0." + k.removeprefix(layer): v.clone() for k, v in tensors.items() if k.startswith(layer)})
    tensors.update({f"mtp.{name}.weight": 0.1 * torch.randn(hidden, generator=generator)
                    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    target = AutoModelForImageTextToText.from_pretrained(folder).eval().requires_grad_(False)
    heads = MtpHeads.from_target(target)
    assert torch.equal(heads.layer.eh_proj.weight, tensors["mtp.fc.weight"])
    reference = target.generate(ids, max_new_tokens=30, do_sample=False, **inputs)
    assert torch.equal(SpeculativeLM(target, heads).generate(ids, max_new_tokens=30, **inputs), reference)


def test_qwen_mtp_heads_save_load_and_serve_from_the_command_line(tmp_path, capfd):
    """The layer saved as a specheads checkpoint is the same layer when loaded (rebuilt from its Qwen3-Next config);
    `generate --mtp` decodes with it (a cycling target: 5 tokens a round) and `info` on the folder points at --mtp."""
    folder = write_mtp_target(tmp_path / "target", "qwen3_next", vocab_size=512, cycling=True, tokenizer_from=STORIES)
    target = load_mtp_target(folder)
    heads = create_heads(target, "mtp")
    heads.save_pretrained(tmp_path / "heads")
    reloaded = load_heads(tmp_path / "heads", target=target)
    assert reloaded.config.draft_layer_config["layer_types"] == ["full_attention"]
    saved, loaded = heads.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[name], loaded[name]) for name in saved)
    assert main(["generate", "--target", str(folder), "--mtp", "--prompt", "Once upon a time",
                 "--max-new-tokens", "20"]) == 0
    err = capfd.readouterr().err
    assert "20 tokens" in err and float(err.split("tau=")[1].split(",")[0]) >= 3.5, err
    summary = describe_heads(folder)
    assert summary["mtp_layers"] == 1 and f"--target {folder} --mtp" in summary["mtp_usage"]


def test_what_cannot_be_read_is_refused_by_name(mtp_folders, tmp_path):
    for family, prefix in (("qwen3_5_text", r"mtp\.layers\.0\."), ("glm4_moe_lite", r"model\.layers\.2\.")):
        load_mtp_target(mtp_folders[family]).save_pretrained(tmp_path / family)  # transformers drops what it skipped
        with pytest.raises(ValueError, match=rf"has no {prefix}\* tensors: no MTP layer .*the original checkpoint"):
            MtpHeads.from_target(load_mtp_target(tmp_path / family))
    folder = mtp_folders["qwen3_5_text"]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["mtp.fc.weight"], tensors["mtp.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\) .*'mtp.fc.weight', 'mtp.layers.0.self_attn.q_proj.weight'"):
        MtpHeads.from_target(load_mtp_target(broken))
    tensors["mtp.fc.weight_scale_inv"] = torch.ones(1)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is quantized \(mtp.fc.weight_scale_inv.*BF16 checkpoint"):
        MtpHeads.from_target(load_mtp_target(broken))
    config = json.loads((folder / "config.json").read_text())
    none = tmp_path / "none"
    shutil.copytree(folder, none)
    (none / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 0}))
    with pytest.raises(ValueError, match=r"model_type='qwen3_5_text'\) declares no MTP layer"):
        MtpHeads.from_target(load_mtp_target(none))


def test_sampling_with_a_qwen_mtp_layer_and_a_draft_vocabulary_follows_the_exact_law(tiny_target_factory, chi_square):
    """A six-token Qwen3.5 (DeltaNet states put back, pending tokens) drafted by a random MTP layer of its family over
    a draft vocabulary of four tokens (two never drafted, only sampled from the target): the first three sampled
    tokens follow the target's exact joint law, over chains and over 2-wide trees (paths as rows)."""
    from .test_generate_sampling import PROMPT as LAW_PROMPT
    from .test_generate_sampling import ExactLaw, sample_first_three

    target = tiny_target_factory("qwen3_5_text", seed=1, vocab_size=6, initializer_range=0.2, mtp_num_hidden_layers=1)
    torch.manual_seed(3)
    heads = MtpHeads(MtpHeads.config_for(target, eagle_draft_vocab_size=4))
    heads.set_draft_vocab(torch.tensor([0, 1, 3, 4]))
    lm = SpeculativeLM(target, heads)
    law = ExactLaw(target, LAW_PROMPT, temperature=0.8)
    for tree in (dict(tree_depth=3, tree_top_k=1, tree_num_nodes=3), dict(tree_depth=2, tree_top_k=2, tree_num_nodes=4)):
        lm.configure_tree(**tree)
        samples = sample_first_three(lm, 1500, seed=2, prompt=LAW_PROMPT, temperature=0.8)
        result = chi_square(samples, law.joint())
        assert result.passed and result.dof >= 10, (tree, result)
        assert lm.accepted_drafts > 0.2 * len(samples), tree


def test_the_qwen_mtp_bench_script_runs_and_checks_identity(tmp_path, monkeypatch):
    """scripts/qwen_mtp_bench.py --tiny: a cycling Qwen3.5 and its MTP layer, chains with the whole and a reduced draft
    vocabulary beside plain `generate` (the script checks outputs identical), every draft accepted."""
    import runpy
    import sys

    scripts = Path(__file__).parents[2] / "scripts"
    out = tmp_path / "mtp.json"
    monkeypatch.syspath_prepend(str(scripts))  # it imports hybrid_chain_bench's shapes, as `python scripts/...` does
    monkeypatch.setattr(sys, "argv", ["qwen_mtp_bench.py", "--tiny", "--prompts", "1", "--max-new-tokens", "24",
                                      "--depth", "1,3", "--draft-vocab", "0,512", "--threads", "1", "--out", str(out)])
    runpy.run_path(str(scripts / "qwen_mtp_bench.py"), run_name="__main__")
    report = json.loads(out.read_text())
    assert [(row["depth"], row["draft_vocab"]) for row in report["settings"]] == [(1, 30000), (1, 512), (3, 30000),
                                                                                 (3, 512)]
    assert all(row["tau"] > 0.8 * (row["depth"] + 1) for row in report["settings"]), report["settings"]
