"""EAGLE heads with a reduced draft vocabulary: chosen from the training data by `specheads train` (option
`eagle_draft_vocab_size`) or added to trained heads by `specheads data draft-vocab`."""

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
    assert "holds medusa heads; draft-vocab applies to eagle heads" in capsys.readouterr().err
