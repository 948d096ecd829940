"""Distilling a draft model on the target (training/distill.py, training/distill_loss.py): the divergences, the
metrics, real runs on stories260K (learns, exact resume, frozen embeddings, push), and the draft it makes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specheads import SpeculativeLM
from specheads.cli import main
from specheads.training.config import DistillSection, LossSection, load_run_config
from specheads.training.data import build_dataset, collate
from specheads.training.distill import initial_draft_model
from specheads.training.distill_loss import distill_loss, divergence_per_row, logits_at
from specheads.training.target_labels import labelled_positions

from .conftest import CONFIGS, assert_two_processes_train_like_one, overrides

RECIPE = str(CONFIGS / "distill_stories260k.yaml")


def stories_batch(tokenizer, stories_file: Path, rows: int = 16) -> dict[str, torch.Tensor]:
    examples = build_dataset(stories_file, tokenizer, "text", 64)
    return collate([examples[i] for i in range(rows)])


def held_out_acc(draft, target, tokenizer, stories_file: Path) -> float:
    with torch.no_grad():
        out = distill_loss(draft, draft, target, stories_batch(tokenizer, stories_file), DistillSection(), LossSection())
    return out.metrics["acc"]


def test_divergences_match_their_definitions():
    torch.manual_seed(0)
    log_p, log_q = F.log_softmax(torch.randn(5, 7), -1), F.log_softmax(torch.randn(5, 7), -1)
    p, q = log_p.exp(), log_q.exp()
    torch.testing.assert_close(divergence_per_row(log_p, log_q, "fkl"), (p * (log_p - log_q)).sum(-1))
    torch.testing.assert_close(divergence_per_row(log_p, log_q, "rkl"), (q * (log_q - log_p)).sum(-1))
    torch.testing.assert_close(divergence_per_row(log_p, log_q, "tvd"), 1 - torch.minimum(p, q).sum(-1))
    for name in ("fkl", "rkl", "tvd"):
        assert divergence_per_row(log_p, log_p, name).abs().max() < 1e-6
    # a target giving some tokens no mass at all (-inf logits): every divergence stays finite
    masked = F.log_softmax(torch.tensor([[0.0, 1.0, float("-inf")]]), -1)
    for name in ("fkl", "rkl", "tvd"):
        assert torch.isfinite(divergence_per_row(masked, F.log_softmax(torch.zeros(1, 3), -1), name)).all(), name
    with pytest.raises(ValueError, match="distill.divergence='js'"):
        divergence_per_row(log_p, log_q, "js")


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2 soft-caps its logits: the forward makes them all
def test_logits_at_the_trained_positions_are_the_forwards(family, tiny_target_factory):
    model = tiny_target_factory(family)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    positions = (torch.tensor([0, 0, 1]), torch.tensor([2, 11, 8]))
    expected = model(input_ids=ids, attention_mask=mask).logits[positions]
    torch.testing.assert_close(logits_at(model, ids, mask, positions), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draft_vocab", [128, 64])
def test_a_draft_vocabulary_of_another_size_is_compared_on_the_ids_both_have(draft_vocab, tiny_target_factory):
    """A draft padded past the target's 97 ids (128) or short of them (64): both distributions over the ids both have;
    the target's mass past the draft's ids is mass the draft never proposes (accept counts it as lost)."""
    target = tiny_target_factory("llama")
    draft = tiny_target_factory("llama", vocab_size=draft_vocab)
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    out = distill_loss(draft, draft, target, batch, DistillSection(divergence="tvd"), LossSection())
    positions = labelled_positions(batch["loss_mask"])
    with torch.no_grad():
        p = F.softmax(target(input_ids=ids).logits[positions], -1)[:, :min(97, draft_vocab)]
        q = F.softmax(draft(input_ids=ids).logits[positions][:, :min(97, draft_vocab)], -1)
    accept = float(torch.minimum(p, q).sum(-1).mean())
    assert out.metrics["accept"] == pytest.approx(accept, rel=1e-5) and 0 < accept < 1
    assert out.metrics["loss"] == pytest.approx(float((0.5 * (p - q).abs().sum(-1)).mean()), rel=1e-5)


def test_a_copy_of_the_target_scores_perfectly_and_a_fresh_model_does_not(target_and_tokenizer, stories_file):
    target, tokenizer = target_and_tokenizer
    batch = stories_batch(tokenizer, stories_file)
    twin = copy.deepcopy(target)
    for divergence in ("fkl", "rkl", "tvd"):
        out = distill_loss(twin, twin, target, batch, DistillSection(divergence=divergence), LossSection(eval_depth=4))
        assert out.metrics["acc"] == 1.0 and out.metrics["accept"] > 0.9999 and out.metrics["loss"] < 1e-5, divergence
    # sim_tau of a draft always right: 1 + the mean over chain starts of its run of trained positions (at most 4)
    valid = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    valid[labelled_positions(batch["loss_mask"])] = True
    runs = [next((d for d in range(4) if t + d >= len(row) or not row[t + d]), 4)
            for row in valid.tolist() for t in range(len(row)) if row[t]]
    expected = 1 + sum(runs) / len(runs)
    assert out.metrics["sim_tau"] == pytest.approx(expected)
    fresh = copy.deepcopy(target)
    torch.manual_seed(0)
    fresh.apply(fresh._init_weights)
    scored = distill_loss(fresh, fresh, target, batch, DistillSection(), LossSection()).metrics
    assert scored["acc"] < 0.3 and scored["sim_tau"] < 1.5 and scored["loss"] > 1.0
    # labels=tokens: cross-entropy on the data's next tokens (the target's own text: the twin predicts it well)
    tokens = distill_loss(twin, twin, target, batch, DistillSection(), LossSection(labels="tokens")).metrics
    assert 0 < tokens["loss"] < scored["loss"]


def test_a_temperature_tempers_both_distributions(target_and_tokenizer, stories_file):
    """distill.temperature=T: the loss and `accept` are those of softmax(logits / T) on both sides; argmaxes (acc,
    sim_tau) are unchanged."""
    target, tokenizer = target_and_tokenizer
    batch = stories_batch(tokenizer, stories_file, rows=4)
    draft = copy.deepcopy(target)
    # another distribution with the same ranking in each row (a new weight: the embedding may be tied to it)
    draft.lm_head.weight = torch.nn.Parameter(draft.lm_head.weight.detach() * 1.5)
    cold, warm = (distill_loss(draft, draft, target, batch, DistillSection(divergence="tvd", temperature=t),
                               LossSection()).metrics for t in (0.5, 1.0))
    positions = labelled_positions(batch["loss_mask"])
    with torch.no_grad():
        p_logits = logits_at(target, batch["input_ids"], batch["attention_mask"], positions)
        q_logits = logits_at(draft, batch["input_ids"], batch["attention_mask"], positions)
    expected = (1 - torch.minimum(F.softmax(p_logits / 0.5, -1), F.softmax(q_logits / 0.5, -1)).sum(-1)).mean()
    assert cold["loss"] == pytest.approx(float(expected), rel=1e-4) and cold["loss"] != pytest.approx(warm["loss"])
    assert cold["acc"] == warm["acc"] == 1.0 and cold["sim_tau"] == warm["sim_tau"]
    with pytest.raises(ValueError, match="distill.temperature=0"):
        load_run_config(None, ["data.source=x", "head.type=draft_model", "distill.draft_model=early-exit:2",
                               "distill.temperature=0"])


def test_config_errors_name_the_value():
    base = ["data.source=x.jsonl"]
    with pytest.raises(ValueError, match="needs distill.draft_model"):
        load_run_config(None, [*base, "head.type=draft_model"])
    with pytest.raises(ValueError, match="distill.divergence='kl'"):
        load_run_config(None, [*base, "head.type=draft_model", "distill.draft_model=early-exit:2", "distill.divergence=kl"])
    with pytest.raises(ValueError, match="head.type='eagle'"):
        load_run_config(None, [*base, "distill.draft_model=early-exit:2"])
    with pytest.raises(ValueError, match="takes no head.options"):
        load_run_config(None, [*base, "head.type=draft_model", "distill.draft_model=early-exit:2",
                               "head.options={num_heads: 2}"])
    config = load_run_config(RECIPE, ["data.source=x.jsonl"])
    assert config.head.type == "draft_model" and config.distill.draft_model == "early-exit:2"


def test_initial_draft_models_and_their_errors(target_and_tokenizer, tmp_path):
    target, tokenizer = target_and_tokenizer
    config = load_run_config(RECIPE, ["data.source=x.jsonl"])
    draft = initial_draft_model(config, target, tokenizer)
    assert draft.config.num_hidden_layers == 2 and draft.training
    assert all(p.requires_grad for p in draft.parameters()) and not any(p.requires_grad for p in target.parameters())
    # its own weights: a step on the draft leaves the target as it was
    assert draft.get_input_embeddings().weight.data_ptr() != target.get_input_embeddings().weight.data_ptr()
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    frozen = load_run_config(RECIPE, ["data.source=x.jsonl", "distill.freeze_embeddings=true"])
    draft = initial_draft_model(frozen, target, tokenizer)
    assert not draft.get_input_embeddings().weight.requires_grad and draft.model.layers[0].mlp.up_proj.weight.requires_grad
    for bad, message in (("early-exit:two", "early-exit:N with N a number"), ("early-exit:5", "expected 1 to 4")):
        with pytest.raises(ValueError, match=message):
            initial_draft_model(load_run_config(RECIPE, ["data.source=x", f"distill.draft_model={bad}"]), target, tokenizer)
    # a model with another tokenizer (two ids swapped) is refused by name
    folder = tmp_path / "other-tokenizer"
    tokenizer.save_pretrained(folder)
    target.save_pretrained(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = [token for token, i in vocab.items() if i in (10, 11)]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        initial_draft_model(load_run_config(RECIPE, ["data.source=x", f"distill.draft_model={folder}"]), target, tokenizer)


@pytest.mark.slow
def test_a_short_distillation_drafts_far_better_and_exactly(tmp_path, stories_file, target_and_tokenizer, capsys):
    """40 steps on the target's own stories: the copy of its first 2 layers goes from rarely to mostly agreeing with
    it; the saved folder is a plain model folder that `--draft-model` takes (and `specheads info` describes), and
    decoding with it stays exact."""
    target, tokenizer = target_and_tokenizer
    out = tmp_path / "distill"
    extra = {"max_steps": 40, "save_steps": 20, "eval_steps": 20, "data.eval_fraction": 0.1, "trackers": "[tensorboard]"}
    untrained = initial_draft_model(load_run_config(RECIPE, ["data.source=x"]), target, tokenizer).eval()
    assert main(["train", RECIPE, *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 40 and metrics["draft_model"] == "early-exit:2"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in (out / "final").iterdir()}
    assert (out / "best" / "best.json").is_file() and "eval_sim_tau" in (out / "final" / "README.md").read_text()
    assert list(out.rglob("events.out.tfevents*"))
    capsys.readouterr()
    assert main(["info", str(out / "final"), "--target", "stories260K"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["num_hidden_layers"], info["target"], info["metrics"]["steps"]) == \
        ("draft_model", 2, "stories260K", 40)
    assert info["parameters"] == sum(t.numel() for t in load_file(out / "final" / "model.safetensors").values())
    assert info["check"] == {"target": "stories260K", "compatible": True, "vocabulary": "same"}
    assert f"--draft-model {out / 'final'}" in info["usage"]
    lm = SpeculativeLM.from_pretrained(target="stories260K", draft_model=str(out / "final"))
    before, after = held_out_acc(untrained, target, tokenizer, stories_file), \
        held_out_acc(lm.heads.draft_model, target, tokenizer, stories_file)
    assert after > before + 0.25, (before, after)
    prompt = tokenizer("Once upon a time, a little dog", return_tensors="pt").input_ids
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(lm.generate(prompt, max_new_tokens=40), expected)
    assert lm.last_stats["mean_accepted"] > 1.5


@pytest.mark.slow
def test_stop_then_resume_equals_uninterrupted_with_frozen_embeddings(tmp_path, stories_file, target_and_tokenizer):
    target, _ = target_and_tokenizer
    steps = {"max_steps": 8, "save_steps": 4, "distill.freeze_embeddings": "true", "distill.divergence": "tvd"}
    assert main(["train", RECIPE, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    out = tmp_path / "stopped"
    assert main(["train", RECIPE, *overrides(stories_file, out, stop_after_steps=4, **steps)]) == 0
    assert not (out / "final").exists()
    assert main(["train", RECIPE, *overrides(stories_file, out, **steps)]) == 0
    ref, got = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # frozen: the embedding is the target's; the layers moved
    assert torch.equal(ref["model.embed_tokens.weight"], target.model.embed_tokens.weight)
    assert not torch.equal(ref["model.layers.0.mlp.up_proj.weight"], target.model.layers[0].mlp.up_proj.weight)


@pytest.mark.slow
def test_distillation_pushes_its_draft_model(tmp_path, stories_file, fake_hub_api, capsys):
    hub = fake_hub_api()
    out = tmp_path / "run"
    extra = {"max_steps": 2, "save_steps": 2, "push_to_hub": "test-org/draft"}
    assert main(["train", RECIPE, *overrides(stories_file, out, **extra)]) == 0
    assert hub.repos == [("test-org/draft", False)] and {"config.json", "tokenizer.json"} <= set(hub.files)
    fake_hub_api(fail=True)
    capsys.readouterr()
    assert main(["train", RECIPE, *overrides(stories_file, tmp_path / "again", **extra)]) == 2
    assert "huggingface-cli upload test-org/draft" in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_distil_like_one(tmp_path, stories_file):
    """DDP: the draft model's forward runs through the prepared model (its lm_head on the trained rows outside it),
    and two processes end where one does."""
    common = {"max_steps": 4, "save_steps": 4, "global_batch_size": 8, "micro_batch_size": 2}
    assert_two_processes_train_like_one(RECIPE, stories_file, tmp_path, port=29549, common=common)


def test_eval_scores_draft_models_beside_heads(tmp_path, stories_file, target_and_tokenizer, capsys):
    """`specheads eval --heads early-exit:N,draft:M`: a saved copy of the target agrees everywhere, its first 2
    layers rarely; the figures are distillation's own."""
    target, tokenizer = target_and_tokenizer
    twin = tmp_path / "twin"
    target.save_pretrained(twin)
    tokenizer.save_pretrained(twin)
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", "stories260K", "--heads", f"early-exit:2,draft:{twin}", "--data", str(stories_file),
                 "--limit", "8", "--out", str(out)]) == 0
    early, copy_ = json.loads(out.read_text())
    assert copy_["acc_depth1"] == 1.0 and copy_["accept"] > 0.9999 and copy_["sim_tau"] > 4.5
    assert early["heads"] == "early-exit:2" and early["acc_depth1"] < 0.3 and early["sim_tau"] < copy_["sim_tau"] - 2
    assert "| early-exit:2 |" in capsys.readouterr().err
    # --temperature: accept at that temperature (the copy stays perfect; the early exit's changes)
    assert main(["eval", "--target", "stories260K", "--heads", f"early-exit:2,draft:{twin}", "--data", str(stories_file),
                 "--limit", "8", "--temperature", "0.5", "--out", str(out)]) == 0
    cold_early, cold_copy = json.loads(out.read_text())
    assert cold_copy["accept"] > 0.9999 and cold_early["accept"] != pytest.approx(early["accept"])
    assert cold_early["acc_depth1"] == early["acc_depth1"]
    assert main(["eval", "--heads", "early-exit:2", "--data", str(stories_file), "--temperature", "0"]) == 2


@pytest.mark.slow
def test_a_lora_distillation_resumes_exactly_and_saves_a_merged_plain_model(tmp_path, stories_file,
                                                                             target_and_tokenizer):
    """distill.lora_r: only the adapter trains and is checkpointed; a stop and a rerun end where an uninterrupted run
    does; the saved folder is a plain model (the adapter merged in) that drafts exactly."""
    target, tokenizer = target_and_tokenizer
    steps = {"max_steps": 8, "save_steps": 4, "distill.lora_r": 4, "optim.learning_rate": 0.01}
    assert main(["train", RECIPE, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    out = tmp_path / "stopped"
    assert main(["train", RECIPE, *overrides(stories_file, out, stop_after_steps=4, **steps)]) == 0
    checkpoint = load_file(next((out / "checkpoints").glob("step-*")) / "model.safetensors")
    assert checkpoint and all("lora_" in name for name in checkpoint)  # the adapter only
    assert main(["train", RECIPE, *overrides(stories_file, out, **steps)]) == 0
    ref, got = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert ref.keys() == got.keys() and not any("lora_" in name for name in ref)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert not (out / "final" / "adapter_config.json").exists()
    # merged: the adapted projections moved, the embedding (no adapter) is the target's
    assert not torch.equal(ref["model.layers.0.self_attn.q_proj.weight"], target.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(ref["model.embed_tokens.weight"], target.model.embed_tokens.weight)
    lm = SpeculativeLM.from_pretrained(target="stories260K", draft_model=str(out / "final"))
    prompt = tokenizer("Tom had a red ball", return_tensors="pt").input_ids
    assert torch.equal(lm.generate(prompt, max_new_tokens=24), target.generate(prompt, max_new_tokens=24, do_sample=False))
    with pytest.raises(ValueError, match="distill.lora_r=-1"):
        load_run_config(RECIPE, ["data.source=x", "distill.lora_r=-1"])


def test_a_distillation_that_stopped_early_is_done_until_the_patience_is_raised(tmp_path, stories_file, capsys):
    """As the heads' loop (shared `resume_state`): learning_rate=0 stops at the third evaluation; the same command
    again trains nothing, and patience 0 trains on to max_steps."""
    out = tmp_path / "run"
    steps = {"max_steps": 8, "save_steps": 8, "eval_steps": 2, "data.eval_fraction": 0.25, "optim.learning_rate": 0}
    assert main(["train", RECIPE, *overrides(stories_file, out, early_stopping_patience=2, **steps)]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    capsys.readouterr()
    assert main(["train", RECIPE, *overrides(stories_file, out, early_stopping_patience=2, **steps)]) == 0
    assert "stopped early at step 6" in capsys.readouterr().out
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    assert main(["train", RECIPE, *overrides(stories_file, out, early_stopping_patience=0, **steps)]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 8
