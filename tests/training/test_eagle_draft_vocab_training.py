"""EAGLE heads with a reduced draft vocabulary: chosen from the training data by `specheads train` (option
`eagle_draft_vocab_size`) or added to trained heads by `specheads data draft-vocab`; EAGLE-3 heads' vocabulary
widened by the same command, then trained on."""

from __future__ import annotations

import json

import torch

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.cli import main
from specheads.training.data import build_dataset
from specheads.training.draft_vocab import build_draft_vocab, count_trained_tokens, special_token_ids

from .conftest import CONFIGS, overrides


def expected_vocab(stories_file, target, tok, size: int):
    dataset = build_dataset(stories_file, tok, "text", 64)
    counts = count_trained_tokens(dataset["input_ids"], dataset["loss_mask"], 512)
    return build_draft_vocab(counts, size, special_token_ids(tok, target))


def test_training_picks_the_datas_most_frequent_tokens(tmp_path, stories_file, target_and_tokenizer):
    target, tok = target_and_tokenizer
    out = tmp_path / "eagle"
    extra = {"max_steps": 4, "save_steps": 4, "head.options.eagle_draft_vocab_size": 64}
    assert main(["train", str(CONFIGS / "eagle_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    expected = expected_vocab(stories_file, target, tok, 64)
    trained = load_heads(out / "final", target=target)
    assert trained.config.eagle_draft_vocab_size == 64
    assert torch.equal(trained.d2t.cpu(), expected.draft_to_target) and bool(torch.isin(2, trained.d2t))  # EOS
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["draft_vocab_coverage"] == expected.coverage > 0.5  # 64 of 512 ids cover most stories


def test_draft_vocab_command_adds_a_vocabulary_to_trained_heads(tmp_path, stories_file, target_and_tokenizer, capsys):
    target, tok = target_and_tokenizer
    torch.manual_seed(0)
    heads = create_heads(target, "eagle", tree_depth=4, tree_top_k=4, tree_num_nodes=12)
    heads.save_pretrained(tmp_path / "full")
    out = tmp_path / "reduced"
    assert main(["data", "draft-vocab", "--heads", str(tmp_path / "full"), "--data", str(stories_file),
                 "--size", "96", "--out", str(out), "--max-length", "64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = expected_vocab(stories_file, target, tok, 96)
    assert summary["draft_vocab_size"] == 96 and summary["coverage"] == round(expected.coverage, 4)
    reduced = load_heads(out, target=target)
    assert torch.equal(reduced.d2t.cpu(), expected.draft_to_target)
    assert all(torch.equal(v, heads.state_dict()[k]) for k, v in reduced.state_dict().items() if k != "d2t")
    ids = tok("Lily saw a big", return_tensors="pt").input_ids
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(SpeculativeLM(target, reduced).generate(ids, max_new_tokens=40), plain)


def test_draft_vocab_command_refuses_other_head_types(tmp_path, stories_file, target_and_tokenizer, capsys):
    target, _ = target_and_tokenizer
    create_heads(target, "medusa").save_pretrained(tmp_path / "medusa")
    code = main(["data", "draft-vocab", "--heads", str(tmp_path / "medusa"), "--data", str(stories_file),
                 "--size", "96", "--out", str(tmp_path / "out")])
    assert code == 2
    assert "holds medusa heads; draft-vocab applies to eagle, eagle3, dflash and mtp heads" in capsys.readouterr().err


def test_draft_vocab_command_widens_eagle3_heads_which_then_train(tmp_path, stories_file, target_and_tokenizer,
                                                                   capsys):
    """The widened heads keep every trained weight and row of their own tokens, add the data's next most frequent
    tokens with the target's rows, draft exactly, and train on with `init_heads`."""
    target, tok = target_and_tokenizer
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=64, feature_layers=[1, 3, 4])  # the recipe's taps
    narrow = expected_vocab(stories_file, target, tok, 64).draft_to_target
    heads.set_draft_vocab(narrow, init_lm_head_from_target=True)
    with torch.no_grad():
        heads.lm_head.weight.mul_(0.5)  # "trained" rows, unlike the target's
    heads.save_pretrained(tmp_path / "narrow")
    out = tmp_path / "wide"
    assert main(["data", "draft-vocab", "--heads", str(tmp_path / "narrow"), "--data", str(stories_file),
                 "--size", "128", "--out", str(out), "--max-length", "64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = expected_vocab(stories_file, target, tok, 128)  # the 64 are the most frequent: a superset of them
    assert summary["draft_vocab_size"] == 128 and summary["coverage"] == round(expected.coverage, 4)
    wide = load_heads(out, target=target)
    assert torch.equal(wide.d2t.cpu(), expected.draft_to_target) and bool(torch.isin(narrow, wide.d2t).all())
    kept = torch.searchsorted(wide.d2t.cpu(), narrow)
    new = ~torch.isin(wide.d2t.cpu(), narrow)
    assert torch.equal(wide.lm_head.weight[kept], heads.lm_head.weight)
    assert torch.equal(wide.lm_head.weight[new], target.lm_head.weight[wide.d2t.cpu()[new]])
    assert all(torch.equal(v, heads.state_dict()[k]) for k, v in wide.state_dict().items()
               if not k.startswith(("lm_head", "d2t", "t2d")))
    ids = tok("Lily saw a big", return_tensors="pt").input_ids
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(SpeculativeLM(target, wide).generate(ids, max_new_tokens=40), plain)
    trained = tmp_path / "trained"
    extra = {"max_steps": 2, "save_steps": 2, "loss.ttt_steps": 2, "init_heads": str(out),
             "head.options.draft_vocab_size": 128}
    assert main(["train", str(CONFIGS / "eagle3_stories260k.yaml"), *overrides(stories_file, trained, **extra)]) == 0
    assert torch.equal(load_heads(trained / "final", target=target).d2t.cpu(), wide.d2t.cpu())
    code = main(["data", "draft-vocab", "--heads", str(out), "--data", str(stories_file), "--size", "100",
                 "--out", str(tmp_path / "narrower")])
    assert code == 2 and "already draft over 128 tokens" in capsys.readouterr().err
