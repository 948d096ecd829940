"""EAGLE heads that draft over a reduced vocabulary (`eagle_draft_vocab_size`, a `d2t` buffer of target ids).

The heads' weights are unchanged (they score drafts through rows of the target's lm_head), so the tests check
that drafting only ever proposes listed tokens, that those scores are exactly the full projection's columns,
that generation stays token-identical to the target's greedy output, and that checkpoints keep the vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads.config import HeadsConfig
from specheads.training.draft_vocab import eagle_heads_with_draft_vocab

from .conftest import EAGLE_SMALL_TREE, hf_greedy


def subset_heads(target, size: int, seed: int = 0, **options):
    """Untrained EAGLE heads drafting over a random `size`-token subset of the target's vocabulary."""
    torch.manual_seed(seed)
    heads = create_heads(target, "eagle", eagle_draft_vocab_size=size, **{**EAGLE_SMALL_TREE, **options})
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    heads.set_draft_vocab(vocab[:size].sort().values)
    return heads


def test_draft_logits_are_the_full_projection_at_the_listed_ids(tiny_llama):
    heads = subset_heads(tiny_llama, 40)
    features = torch.randn(2, 3, heads.config.hidden_size)
    assert heads.draft_vocab_size == 40
    assert torch.allclose(heads.draft_logits(features), heads.logits(features)[..., heads.d2t], atol=1e-6)
    ids = torch.tensor([[0, 39], [5, 7]])
    assert torch.equal(heads.draft_to_target_ids(ids), heads.d2t[ids])
    # a new vocabulary is picked up (the gathered lm_head rows are not stale)
    heads.set_draft_vocab(torch.arange(40) * 2)
    assert torch.allclose(heads.draft_logits(features), heads.logits(features)[..., ::2][..., :40], atol=1e-6)


def test_full_vocabulary_heads_are_unchanged(tiny_llama):
    torch.manual_seed(0)
    heads = create_heads(tiny_llama, "eagle")
    features = torch.randn(1, 2, heads.config.hidden_size)
    assert heads.d2t is None and heads.draft_vocab_size == heads.config.vocab_size
    assert torch.equal(heads.draft_logits(features), heads.logits(features))
    with pytest.raises(ValueError, match="eagle_draft_vocab_size=0"):
        heads.set_draft_vocab(torch.arange(8))


def test_drafts_come_from_the_draft_vocabulary_only(tiny_llama):
    heads = subset_heads(tiny_llama, 24)
    lm = SpeculativeLM(tiny_llama, heads)
    features = torch.randn(4, heads.config.hidden_size)
    tokens, tree = lm.drafter.propose(features, torch.tensor([3, 9, 4, 11]))
    assert tree.num_nodes == tokens.shape[0] > 1
    assert torch.isin(tokens[1:], heads.d2t).all()


def test_greedy_output_is_the_targets(target_and_prompt):
    target, ids = target_and_prompt
    heads = subset_heads(target, target.config.vocab_size // 4)
    lm = SpeculativeLM(target, heads)
    assert torch.equal(lm.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert lm.last_stats["new_tokens"] == 40


def test_a_draft_vocabulary_of_the_continuation_accepts_two_tokens_per_round(target_and_prompt):
    """Only a correct d2t mapping gets drafts accepted: with the continuation's tokens as the vocabulary and a tree
    holding every pair of them, each round keeps two drafted tokens."""
    target, ids = target_and_prompt
    n = 30
    expected = hf_greedy(target, ids, n + 4)
    vocab = torch.unique(expected[0, ids.shape[1] :])
    k = vocab.shape[0]
    assert 1 < k < target.config.vocab_size // 2
    torch.manual_seed(0)
    heads = create_heads(target, "eagle", eagle_draft_vocab_size=k)
    heads.set_draft_vocab(vocab)
    lm = SpeculativeLM(target, heads, tree_depth=2, tree_top_k=k, tree_num_nodes=k + k * k)
    assert torch.equal(lm.generate(ids, max_new_tokens=n), expected[:, : ids.shape[1] + n])
    assert lm.last_stats["accepted_per_depth"][:2] == [1.0, 1.0]


def test_checkpoint_round_trip_keeps_the_vocabulary(tiny_llama, tmp_path):
    heads = subset_heads(tiny_llama, 32)
    heads.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_draft_vocab_size"] == 32
    loaded = load_heads(tmp_path, target=tiny_llama)
    assert torch.equal(loaded.d2t, heads.d2t)
    ids = torch.tensor([[1, 5, 9, 33]])
    assert torch.equal(
        SpeculativeLM(tiny_llama, loaded).generate(ids, max_new_tokens=20), hf_greedy(tiny_llama, ids, 20)
    )


@pytest.mark.parametrize(
    ("d2t", "message"),
    [
        (torch.arange(32).flip(0), "sorted ascending"),
        (torch.arange(32) + 10_000, "expected ids in"),
    ],
)
def test_a_corrupt_d2t_is_refused_by_name(tiny_llama, tmp_path, d2t, message):
    subset_heads(tiny_llama, 32).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["d2t"] = d2t
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"d2t is invalid.*{message}"):
        load_heads(tmp_path, target=tiny_llama)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(head_type="eagle", eagle_draft_vocab_size=-1), "eagle_draft_vocab_size=-1"),
        (dict(head_type="eagle", eagle_draft_vocab_size=513), "eagle_draft_vocab_size=513"),
        (dict(head_type="medusa", eagle_draft_vocab_size=8), "eagle, dflash and mtp heads only"),
    ],
)
def test_bad_config_values_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        HeadsConfig(vocab_size=512, draft_layer_config={"model_type": "llama"}, **fields)


def test_trained_heads_get_a_vocabulary_without_changing_their_weights(tiny_llama):
    torch.manual_seed(0)
    full = create_heads(tiny_llama, "eagle", **EAGLE_SMALL_TREE)
    vocab = torch.tensor([0, 2, 3, 17, 40, 41, 90])
    reduced = eagle_heads_with_draft_vocab(full, vocab)
    assert reduced.config.eagle_draft_vocab_size == 7 and torch.equal(reduced.d2t, vocab)
    full_weights = full.state_dict()
    for name, tensor in reduced.state_dict().items():
        if name != "d2t":
            assert torch.equal(tensor, full_weights[name]), name
    ids = torch.tensor([[1, 5, 9, 33]])
    assert torch.equal(
        SpeculativeLM(tiny_llama, reduced).generate(ids, max_new_tokens=16), hf_greedy(tiny_llama, ids, 16)
    )
    with pytest.raises(ValueError, match="eagle, dflash and mtp heads only"):
        eagle_heads_with_draft_vocab(create_heads(tiny_llama, "medusa"), vocab)


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_export_leaves_the_draft_vocabulary_out(tiny_llama, tmp_path, fmt):
    """Other formats draft over the whole vocabulary: the weights go out, d2t does not, and they import back."""
    from specheads.heads.interop import export_heads, import_heads

    heads = subset_heads(tiny_llama, 32)
    export_heads(heads, fmt, tmp_path / "out")
    assert "d2t" not in load_file(tmp_path / "out" / "model.safetensors")
    back = import_heads(tmp_path / "out", target=tiny_llama)
    assert back.d2t is None
    weights = heads.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in back.state_dict().items())
