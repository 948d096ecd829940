"""Held-out evaluation: the split, the weighted averages, evaluation during training, and `specheads eval`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specheads import load_heads
from specheads.cli import main
from specheads.training.config import RunConfig, load_run_config
from specheads.training.data import BatchOrder, build_dataset, collate
from specheads.training.evaluate import evaluate, split_eval_indices
from specheads.training.train import compute_loss, held_out_examples

from .conftest import CONFIGS, overrides


@pytest.mark.parametrize(("n", "fraction", "count"), [(100, 0.1, 10), (64, 0.25, 16), (5, 0.01, 1), (7, 0.0, 0)])
def test_split_is_seeded_disjoint_and_complete(n, fraction, count):
    train, held_out = split_eval_indices(n, fraction, seed=3)
    assert len(held_out) == count and sorted(train + held_out) == list(range(n))
    assert (train, held_out) == split_eval_indices(n, fraction, seed=3)
    if count > 1:
        assert split_eval_indices(n, fraction, seed=4)[1] != held_out


@pytest.mark.parametrize(("fraction", "match"), [(1.0, r"in \[0, 1\)"), (-0.2, r"in \[0, 1\)"), (0.9, "leaves no training")])
def test_split_refuses_bad_fractions(fraction, match):
    with pytest.raises(ValueError, match=match):
        split_eval_indices(2, fraction, seed=0)


def test_evaluate_weights_each_batch_by_its_trained_tokens():
    """Batch metrics are masked means: the overall value is their mean weighted by trained tokens."""
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5, 6, 7], "loss_mask": [0, 1, 1, 1]},
            {"input_ids": [8, 9], "loss_mask": [0, 1]}]

    def loss_fn(batch):  # "acc" = mean of the trained tokens' ids
        mask = batch["loss_mask"].bool()
        return SimpleNamespace(metrics={"acc": float(batch["input_ids"][mask].float().mean())})

    metrics = evaluate(loss_fn, rows, collate, batch_size=2, device="cpu", progress=False)
    assert metrics["tokens"] == 6
    assert metrics["acc"] == pytest.approx((2 + 3 + 5 + 6 + 7 + 9) / 6)
    with pytest.raises(ValueError, match="no examples"):
        evaluate(loss_fn, [], collate, batch_size=2, device="cpu", progress=False)
    with pytest.raises(ValueError, match="no trained"):
        evaluate(loss_fn, [{"input_ids": [1, 2], "loss_mask": [0, 0]}], collate, 2, "cpu", progress=False)


def test_held_out_examples_never_enter_a_training_batch(stories_file, target_and_tokenizer):
    _, tok = target_and_tokenizer
    config = load_run_config(CONFIGS / "eagle_stories260k.yaml", overrides(stories_file, "unused", **{"data.eval_fraction": 0.25}))
    examples = build_dataset(stories_file, tok, "auto", 64)
    train_indices, held_out, _ = held_out_examples(config, examples, tok, collate)
    assert len(held_out) == 16 and len(train_indices) == 48
    order = BatchOrder([examples["length"][i] for i in train_indices], 8, config.seed)
    trained = {train_indices[j] for step in range(12) for j in order.global_batch(step)}
    assert trained == set(train_indices)  # every training example, over two epochs, and no held-out one
    assert not trained & set(held_out.indices)


@pytest.mark.slow
def test_training_reports_held_out_metrics_of_the_final_heads(tmp_path, stories_file, target_and_tokenizer, capsys):
    target, tok = target_and_tokenizer
    out = tmp_path / "run"
    extra = {"max_steps": 12, "save_steps": 6, "eval_steps": 6, "data.eval_fraction": 0.25, "optim.learning_rate": 0.01}
    assert main(["train", str(CONFIGS / "eagle_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    assert "step 6 held-out: acc" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"eval_acc", "eval_sim_tau", "eval_loss", "eval_acc_depth1", "eval_tokens"} <= set(metrics)
    # the numbers are the saved heads' scores on the held-out stories (recomputed here)
    config = load_run_config(CONFIGS / "eagle_stories260k.yaml", overrides(stories_file, out, **extra))
    config.loss.input_noise = 0.0
    examples = build_dataset(stories_file, tok, "auto", 64)
    _, held_out, _ = held_out_examples(config, examples, tok, collate)
    heads = load_heads(out / "final", target=target).eval()
    again = evaluate(lambda b: compute_loss(config, heads, heads, target, b, []), held_out, collate,
                     config.micro_batch_size, "cpu", progress=False)
    assert metrics["eval_tokens"] == again["tokens"] > 0
    assert metrics["eval_acc"] == pytest.approx(again["acc"], abs=1e-5)
    assert "eval_acc" in (out / "final" / "README.md").read_text()
    # save_best (default): output_dir/best holds the heads of the best of the step-6 and final evaluations
    record = json.loads((out / "best" / "best.json").read_text())
    assert record["step"] in (6, 12) and (metrics["best_step"], metrics["best_eval_sim_tau"]) == (
        record["step"], record["eval_sim_tau"])
    assert record["eval_sim_tau"] >= metrics["eval_sim_tau"]
    best_heads = load_heads(out / "best", target=target).eval()
    rescored = evaluate(lambda b: compute_loss(config, best_heads, best_heads, target, b, []), held_out, collate,
                        config.micro_batch_size, "cpu", progress=False)
    assert rescored["sim_tau"] == pytest.approx(record["eval_sim_tau"], abs=1e-5)
    if record["step"] == 12:
        assert rescored["sim_tau"] == pytest.approx(again["sim_tau"], abs=1e-6)
    else:  # the step-6 heads won: the final ones scored lower
        assert again["sim_tau"] < record["eval_sim_tau"]


def test_held_out_data_without_answers_fails_before_training(tmp_path, stories_file, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."}]}) + "\n")
    out = tmp_path / "run"
    extra = {"max_steps": 2, "save_steps": 2, "data.eval_source": str(questions)}
    assert main(["train", str(CONFIGS / "eagle_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 2
    assert "has no assistant tokens to train on" in capsys.readouterr().err  # named by build_dataset
    assert not (out / "checkpoints").exists()


def test_eval_source_and_eval_fraction_are_exclusive():
    config = RunConfig(target="stories260K")
    config.data.source, config.data.eval_source, config.data.eval_fraction = "a.jsonl", "b.jsonl", 0.1
    with pytest.raises(ValueError, match="both set"):
        config.validate()
    config.data.eval_source, config.eval_steps = "", -1
    with pytest.raises(ValueError, match="eval_steps=-1"):
        config.validate()


def test_eval_cli_scores_heads_on_a_file_and_on_the_targets_answers(tmp_path, stories_file, target_and_tokenizer, eagle_heads):
    """`specheads eval --data` matches the training loss's metrics on the same rows; `--prompts` scores the target's
    greedy answers to the prompts (answer tokens only)."""
    target, tok = target_and_tokenizer
    out = tmp_path / "eval.json"
    assert main(["eval", "--heads", str(eagle_heads), "--data", str(stories_file), "--limit", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["examples"] == 8 and 0 <= report["acc_depth1"] <= 1 and report["sim_tau"] >= 1
    heads = load_heads(eagle_heads, target=target).eval()
    config = RunConfig(target="stories260K")
    config.head.type, config.loss.input_noise = "eagle", 0.0
    rows = build_dataset(stories_file, tok, "auto", 768).select(range(8))
    direct = evaluate(lambda b: compute_loss(config, heads, heads, target, b, []), rows, collate, 4, "cpu", progress=False)
    assert report["acc_depth1"] == pytest.approx(direct["acc_depth1"], abs=1e-4)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out2 = tmp_path / "eval2.json"
    assert main(["eval", "--heads", str(eagle_heads), "--prompts", str(prompts), "--max-new-tokens", "20",
                 "--max-length", "4", "--out", str(out2)]) == 0  # --max-length cuts --data only: whole answers here
    report = json.loads(out2.read_text())
    assert report["examples"] == 2 and 2 <= report["tokens"] <= 40


def test_eval_cli_scores_a_comma_list_of_heads_on_one_set_of_answers(tmp_path, eagle_heads, capsys):
    """`--heads A,B` answers the prompts once and gives each heads the report a run of its own would give."""
    from specheads import create_heads, load_target

    target, _ = load_target("stories260K")
    torch.manual_seed(1)
    other = tmp_path / "other"
    create_heads(target, "eagle").save_pretrained(other)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    args = ["--prompts", str(prompts), "--max-new-tokens", "16"]
    singles = []
    for heads in (eagle_heads, other):
        assert main(["eval", "--heads", str(heads), *args, "--out", str(tmp_path / "one.json")]) == 0
        singles.append(json.loads((tmp_path / "one.json").read_text()))
    capsys.readouterr()
    assert main(["eval", "--heads", f"{eagle_heads},{other}", *args, "--out", str(tmp_path / "both.json")]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    assert both == singles and singles[0]["loss"] != singles[1]["loss"]  # untrained: the losses tell them apart
    table = capsys.readouterr().err
    assert f"| {other} |" in table and "simulated tau" in table
    assert main(["eval", "--heads", f"{eagle_heads},", *args]) == 2
    assert "an empty name" in capsys.readouterr().err


@pytest.mark.parametrize("head_type", ["medusa", "eagle3"])
def test_eval_cli_scores_every_head_type(tmp_path, stories_file, target_and_tokenizer, head_type):
    from specheads import create_heads

    target, _ = target_and_tokenizer
    torch.manual_seed(0)
    create_heads(target, head_type).save_pretrained(tmp_path / head_type)
    out = tmp_path / "eval.json"
    assert main(["eval", "--heads", str(tmp_path / head_type), "--data", str(stories_file), "--limit", "4",
                 "--ttt-steps", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["examples"] == 4 and report["tokens"] > 0 and "acc_depth1" in report
    if head_type == "eagle3":
        assert "acc_depth3" in report and "acc_depth4" not in report and 0 < report["draft_vocab_coverage"] <= 1


def test_eval_cli_errors_are_one_line(tmp_path, capsys, eagle_heads):
    assert main(["eval", "--heads", str(eagle_heads), "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", "--heads", str(eagle_heads), "--prompts", "x", "--batch-size", "0"]) == 2
    assert "--batch-size=0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory, target_and_tokenizer):
    """Untrained (seeded) EAGLE heads for stories260K, saved as a checkpoint folder."""
    from specheads import create_heads

    target, _ = target_and_tokenizer
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("heads") / "eagle"
    create_heads(target, "eagle").save_pretrained(folder)
    return folder


def test_best_heads_keeps_only_improvements_whole(tmp_path, target_and_tokenizer):
    """BestHeads saves on a strictly better eval_sim_tau only; the folder holds the heads and record of the best."""
    from specheads import create_heads
    from specheads.training.best_heads import BEST_FILE, BestHeads

    eagle_heads = create_heads(target_and_tokenizer[0], "eagle")
    best = BestHeads(tmp_path, fresh_run=True)
    saved = []
    for step, score in [(2, 1.5), (4, 1.4), (6, 1.8), (8, 1.8), (10, 1.1)]:
        with torch.no_grad():  # each offer's heads differ, so the folder shows which one was kept
            next(eagle_heads.parameters()).fill_(step)
        if best.offer(eagle_heads, step, {"eval_sim_tau": score, "eval_acc": 0.5}):
            saved.append(step)
    assert saved == [2, 6]
    assert json.loads((tmp_path / "best" / BEST_FILE).read_text()) == {"step": 6, "eval_sim_tau": 1.8}
    kept = load_heads(tmp_path / "best")
    assert torch.all(next(kept.parameters()) == 6)
    assert "eval_sim_tau" in (tmp_path / "best" / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # no temp or old folders left
    # a resumed run must beat the recorded score; a fresh run in the same folder starts over
    assert not BestHeads(tmp_path, fresh_run=False).offer(eagle_heads, 12, {"eval_sim_tau": 1.7})
    assert BestHeads(tmp_path, fresh_run=True).record is None and not (tmp_path / "best").exists()
