"""Medusa-2: Medusa heads trained jointly with a LoRA adapter on the target, through the real CLI on stories260K.

The checkpoint holds heads + adapter, loading merges the adapter, speculative greedy output equals the ADAPTED
target's own greedy output (and differs from the base target's), an un-adapted target is refused, a stopped
run resumes exactly, and joint training with offline features or EAGLE heads is a config error.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads import SpeculativeLM, create_heads, load_heads, load_target
from specheads.cli import main
from specheads.heads.adapter import ADAPTER_DIRNAME, apply_target_adapter
from specheads.heads.config import HeadsConfig
from specheads.training.config import load_run_config
from specheads.training.data import build_dataset, collate
from specheads.training.joint_lora import JointMedusa, joint_loss, lm_cross_entropy
from specheads.training.train import latest_checkpoint, train

from ..conftest import build_tiny_target
from .conftest import CONFIGS, overrides

RECIPE = str(CONFIGS / "medusa2_stories260k.yaml")
PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily", "One day, a girl"]


@pytest.fixture(scope="module")
def joint_run(tmp_path_factory, stories_file) -> Path:
    """output_dir of a 30-step Medusa-2 run; the adapter LR is high enough to change the target's greedy output."""
    out = tmp_path_factory.mktemp("medusa2")
    extra = {"max_steps": 30, "save_steps": 15, "trackers": "[tensorboard]", "optim.learning_rate": 5e-3}
    assert main(["train", RECIPE, *overrides(stories_file, out, **extra)]) == 0
    return out


@pytest.mark.slow
def test_joint_run_learns_and_saves_heads_and_adapter(joint_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(joint_run.rglob("events.out.tfevents*")).parent))
    events.Reload()
    for tag in ("train/loss", "train/loss_heads", "train/loss_lm"):
        values = [e.value for e in events.Scalars(tag)]
        assert len(values) >= 2 and values[-1] < values[0], (tag, values)

    final = joint_run / "final"
    assert {"config.json", "model.safetensors", "README.md", ADAPTER_DIRNAME} <= {p.name for p in final.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (final / ADAPTER_DIRNAME).iterdir()}
    assert all(name.startswith("heads.") for name in load_file(final / "model.safetensors"))  # head weights only
    adapter = load_file(final / ADAPTER_DIRNAME / "adapter_model.safetensors")
    assert adapter and all("lora_A" in name or "lora_B" in name for name in adapter)
    config = HeadsConfig.from_pretrained(final)
    assert config.target_adapter == ADAPTER_DIRNAME and len(config.target_adapter_sample["rows"]) == 16

    # checkpoints hold the trainable weights only (heads + adapter), with optimizer state for each of them
    checkpoint = latest_checkpoint(joint_run)
    saved = load_file(checkpoint / "model.safetensors")
    assert any("lora_" in name for name in saved) and any(name.startswith("heads.") for name in saved)
    assert all(name.startswith("heads.") or "lora_" in name for name in saved)
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert len(optimizer["state"]) == len(saved)
    adapter_group, heads_group = optimizer["param_groups"]
    assert heads_group["initial_lr"] == pytest.approx(adapter_group["initial_lr"] * 5.0)  # head_lr_multiplier


@pytest.mark.slow
def test_speculative_greedy_equals_the_adapted_target(joint_run):
    final = joint_run / "final"
    lm = SpeculativeLM.from_pretrained(target="stories260K", heads=final)  # merges the adapter
    base, tokenizer = load_target("stories260K")
    adapted = apply_target_adapter(load_target("stories260K")[0], final)
    differs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = lm.generate(ids, max_new_tokens=40)
        expected = adapted.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(out, expected), prompt
        differs.append(not torch.equal(expected, base.generate(ids, max_new_tokens=40, do_sample=False)))
    assert any(differs)  # the adapter is really applied
    assert lm.last_stats["mean_accepted"] > 1.2  # the heads draft for the adapted target


@pytest.mark.slow
def test_unadapted_target_is_refused(joint_run, target_and_tokenizer):
    final = joint_run / "final"
    base, _ = target_and_tokenizer
    with pytest.raises(ValueError, match="un-adapted.*apply_target_adapter"):
        load_heads(final, target=base)
    with pytest.raises(ValueError, match="un-adapted"):
        SpeculativeLM(base, load_heads(final))
    with pytest.raises(ValueError, match="another target"):  # 2 layers: no model.layers.4
        load_heads(final, target=build_tiny_target("llama", vocab_size=512, hidden_size=64))
    twice = apply_target_adapter(load_target("stories260K")[0], final)
    with pytest.raises(ValueError, match="merged twice"):
        apply_target_adapter(twice, final)
    # plain heads: apply_target_adapter leaves the target alone
    plain = joint_run / "plain_heads"
    torch.manual_seed(0)
    create_heads(base, "medusa", num_heads=2).save_pretrained(plain)
    assert apply_target_adapter(base, plain) is base
    # a copy of the heads without the adapter their config names, and a folder that is no checkpoint, are named
    partial = joint_run / "partial_copy"
    shutil.copytree(final, partial, ignore=shutil.ignore_patterns("adapter_config.json"))
    with pytest.raises(FileNotFoundError, match=r"target_adapter=.* has no adapter_config\.json"):
        apply_target_adapter(load_target("stories260K")[0], partial)
    with pytest.raises(FileNotFoundError, match="has no config.json; is it a specheads checkpoint"):
        apply_target_adapter(base, partial / ADAPTER_DIRNAME)


@pytest.mark.slow
def test_joint_stop_then_resume_is_exact(tmp_path, stories_file):
    steps = {"max_steps": 8, "save_steps": 4, "optim.learning_rate": 5e-3}
    assert main(["train", RECIPE, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    out = tmp_path / "stopped"
    assert main(["train", RECIPE, *overrides(stories_file, out, stop_after_steps=4, **steps)]) == 0
    assert not (out / "final").exists() and latest_checkpoint(out).name == "step-00000004"
    assert main(["train", RECIPE, *overrides(stories_file, out, **steps)]) == 0
    for name in ("model.safetensors", f"{ADAPTER_DIRNAME}/adapter_model.safetensors"):
        ref, got = load_file(tmp_path / "ref" / "final" / name), load_file(out / "final" / name)
        assert ref.keys() == got.keys()
        for key in ref:
            assert torch.equal(ref[key], got[key]), (name, key)
    # resuming with another LoRA shape is refused with a clear error, not a stack trace from deep in torch
    with pytest.raises(ValueError, match="trainable weights"):
        train(load_run_config(RECIPE, overrides(stories_file, out, **{**steps, "max_steps": 12, "joint.lora_r": 4})))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["head.type=eagle"], "head.type='eagle', expected 'medusa'"),
        (["head.type=eagle3"], "head.type='eagle3', expected 'medusa'"),
        (["feature_mode=offline", "data.features_dir=features"], "needs feature_mode=online"),
        (["joint.lora_r=0"], "joint.lora_r=0"),
        (["joint.target_modules=[]"], "joint.target_modules is empty"),
        (["joint.target_modules=all"], "joint.target_modules='all'; expected a list of module names"),
    ],
)
def test_invalid_joint_configs_are_errors(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_run_config(RECIPE, ["head.options={}", *extra])


def test_recipes_enable_joint_medusa():
    for name in ("medusa2_stories260k.yaml", "medusa2_smollm2.yaml"):
        config = load_run_config(CONFIGS / name)
        assert config.joint.enabled and config.head.type == "medusa" and config.feature_mode == "online"
    assert not load_run_config(CONFIGS / "medusa_stories260k.yaml").joint.enabled


def test_unknown_target_modules_name_the_real_ones():
    target, _ = load_target("stories260K")  # JointMedusa injects the adapter in place: never the shared fixture
    heads = create_heads(target, "medusa", num_heads=2)
    joint = load_run_config(RECIPE, ["joint.target_modules=[qkv_proj]"]).joint
    with pytest.raises(ValueError, match="qkv_proj.*q_proj"):
        JointMedusa(target, heads, joint)
    target, _ = load_target("stories260K")  # ties its lm_head to the input embedding
    joint = load_run_config(RECIPE, ["joint.target_modules=[q_proj,embed_tokens]"]).joint
    with pytest.raises(ValueError, match="shares that weight"):
        JointMedusa(target, create_heads(target, "medusa", num_heads=2), joint)


def test_lm_cross_entropy_counts_trained_tokens_only():
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    expected = [
        torch.nn.functional.cross_entropy(logits[b, t - 1], ids[b, t], reduction="sum")
        for b in range(2)
        for t in range(1, 5)
        if mask[b, t]
    ]
    assert lm_cross_entropy(logits, ids, mask).item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)


def test_heads_config_checks_the_adapter_sample():
    sample = {
        "weight": "model.layers.0.mlp.up_proj.weight",
        "rows": [0, 1],
        "cols": [2, 3],
        "base": [0.1, 0.2],
        "adapted": [0.3, 0.4],
    }
    config = HeadsConfig(target_adapter=ADAPTER_DIRNAME, target_adapter_sample=sample)
    assert HeadsConfig.from_dict(json.loads(config.to_json_string())).target_adapter_sample == sample
    with pytest.raises(ValueError, match="target_adapter_sample"):
        HeadsConfig(target_adapter_sample={**sample, "rows": [0]})
    with pytest.raises(ValueError, match="target_adapter_sample"):
        HeadsConfig(target_adapter_sample={"weight": "x"})
    with pytest.raises(ValueError, match="target_adapter="):
        HeadsConfig(target_adapter=3)


def test_head_loss_reaches_the_adapter(stories_file):
    """Online features carry gradients: with the LM loss off, the heads' loss alone trains the adapter."""
    target, tokenizer = load_target("stories260K")
    config = load_run_config(RECIPE, ["joint.lm_loss_weight=0", f"data.source={stories_file}"])
    model = JointMedusa(target, create_heads(target, "medusa", **config.head.options), config.joint)
    dataset = build_dataset(stories_file, tokenizer, "text", 64)
    joint_loss(model, collate([dataset[i] for i in range(4)]), config).loss.backward()
    lora_b = [p.grad for name, p in model.target.named_parameters() if "lora_B" in name]
    assert lora_b and all(g is not None and g.abs().sum() > 0 for g in lora_b)
    assert all(p.grad is None for name, p in model.target.named_parameters() if "lora_" not in name)  # frozen


@pytest.mark.slow
def test_heads_from_the_hub_cache_bring_their_adapter(joint_run, offline_hub_cache):
    offline_hub_cache.publish(joint_run / "final", "someone/stories260k-medusa2")
    lm = SpeculativeLM.from_pretrained(target="stories260K", heads="someone/stories260k-medusa2")
    adapted = apply_target_adapter(load_target("stories260K")[0], joint_run / "final")
    ids = torch.tensor([[1, 403, 407, 261]])
    assert torch.equal(lm.generate(ids, max_new_tokens=24), adapted.generate(ids, max_new_tokens=24, do_sample=False))


@pytest.mark.parametrize(
    ("family", "modules"),
    [("llama", "[q_proj,down_proj,embed_tokens]"), ("qwen2", "[q_proj,down_proj,embed_tokens]"),
     ("phi3", "all-linear"), ("gpt2", "all-linear"), ("gpt_neox", "all-linear")],  # fused qkv; Conv1D; no *_proj
)
def test_fingerprints_follow_the_merged_target(family, modules, tmp_path):
    """An adapter on an untied embedding too, or on every linear layer whatever the family names them: saved
    fingerprints match what apply_target_adapter builds."""
    target = build_tiny_target(family)
    config = load_run_config(RECIPE, [f"joint.target_modules={modules}"])
    torch.manual_seed(0)
    model = JointMedusa(target, create_heads(target, "medusa", num_heads=2), config.joint)
    with torch.no_grad():  # a trained adapter: lora_B is no longer zero
        for name, p in model.target.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(std=0.05)
    model.save_pretrained(tmp_path)
    adapted = apply_target_adapter(build_tiny_target(family), tmp_path)
    assert load_heads(tmp_path, target=adapted).config.target_adapter == ADAPTER_DIRNAME
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    model.eval()  # GPT-2 and GPT-NeoX have dropout of their own
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, model.target(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="un-adapted.*apply_target_adapter"):
        load_heads(tmp_path, target=build_tiny_target(family))
