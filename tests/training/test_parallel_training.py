"""P-EAGLE training (parallel slots in the training-time test): the loss equals drafting's one-forward reference,
slots see nothing past the root's token, `mask_hidden` learns, trained EAGLE-3 heads convert (`init_heads` +
`parallel_depth`), and a real CLI run on stories260K gives parallel heads whose greedy output is the target's."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.cli import main
from specheads.training.chain_attention import use_ttt_chain_attention
from specheads.training.config import LossSection, load_run_config
from specheads.training.features import online_features
from specheads.training.losses import cod_roots, eagle3_loss
from specheads.training.train import initial_heads
from specheads.training.ttt import cod_slot_roots, unroll_ttt

from .conftest import CONFIGS, depth1_accuracy, overrides
from .test_eagle3_training import random_batch

NEG = torch.finfo(torch.float32).min


def tiny_parallel(tiny_target_factory, depth: int = 4):
    """Tiny llama target + fresh parallel-drafting EAGLE-3 heads (scattered draft vocabulary, parallel token 3)."""
    target = tiny_target_factory("llama")
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=40, parallel_depth=depth, parallel_slot_token=3).eval()
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(1))[:40]
    heads.set_draft_vocab(vocab.sort().values, init_lm_head_from_target=True)
    return target, heads


def reference_parallel_loss(heads, features, target_logits, ids, attention_mask, loss_mask) -> list[float]:
    """Per-depth mean loss, one explicit draft per (row, root t) run as `ParallelDrafter` runs it: the prefix
    (f_0..f_t, x_1..x_{t+1}) then the K-1 parallel slots, in ONE causal forward into a fresh cache."""
    depth, d2t = heads.config.parallel_depth, heads.d2t
    sums, counts = [0.0] * depth, [0] * depth
    for b in range(ids.shape[0]):
        length = int(attention_mask[b].sum())
        for t in range(length - 2):
            slots = depth - 1
            tokens = torch.cat([ids[b, 1 : t + 2], torch.full((slots,), heads.config.parallel_slot_token)])
            mask = torch.full((t + 1 + slots, t + 1 + slots), NEG).triu(1)[None, None]
            anchors = features[b : b + 1, t : t + 1].expand(1, slots, -1)  # the root's features, each slot
            out = heads(features[b : b + 1, : t + 1], tokens[None], torch.arange(t + 1 + slots)[None], mask,
                        DynamicCache(), parallel_slots=(anchors, torch.arange(2, slots + 2)))[0, t:]  # (K, h)
            for i in range(depth):
                if t + 2 + i >= length or not loss_mask[b, t + 2 + i]:
                    continue
                log_probs = F.log_softmax(heads.logits(out[i]), dim=-1)
                label = F.softmax(target_logits[b, t + 1 + i, d2t], dim=-1)
                sums[i] += float(-(label * log_probs).sum())
                counts[i] += 1
    return [s / max(c, 1) for s, c in zip(sums, counts)]


@pytest.mark.parametrize("attention", ["dense", "chain"])
def test_loss_equals_the_one_forward_drafting_reference(tiny_target_factory, attention):
    """Dense masks and chain attention (what CPU runs use) alike."""
    target, reference_heads = tiny_parallel(tiny_target_factory)
    heads = copy.deepcopy(reference_heads)
    if attention == "chain":
        use_ttt_chain_attention(heads)
    batch = random_batch(target.config.vocab_size, [11, 8], seed=3)
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    with torch.no_grad():
        out = eagle3_loss(heads, features, target_logits, ids, mask, loss_mask, LossSection(ttt_steps=7, ttt_decay=0.7))
        expected = reference_parallel_loss(reference_heads, features, target_logits, ids, mask, loss_mask)
    assert len(expected) == 4 and "loss_depth5" not in out.metrics  # the heads' depths, not loss.ttt_steps
    for i, value in enumerate(expected):
        assert out.metrics[f"loss_depth{i + 1}"] == pytest.approx(value, rel=1e-5, abs=1e-5), i
    assert float(out.loss) == pytest.approx(sum(0.7**i * v for i, v in enumerate(expected)), rel=1e-5)


def test_slots_see_nothing_past_the_roots_token_and_mask_hidden_learns(tiny_target_factory):
    """Every depth of the root at t reads f_0..f_t and x_1..x_{t+1} only (a TTT step also reads x_{t+1+i})."""
    target, heads = tiny_parallel(tiny_target_factory)
    h = target.config.hidden_size
    batch = random_batch(target.config.vocab_size, [12], seed=5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    features = torch.randn(1, 12, 3 * h, generator=torch.Generator().manual_seed(2))
    token = heads.config.parallel_slot_token
    with torch.no_grad():
        base = unroll_ttt(heads, features, ids, mask, 4, parallel_slot_token=token)
        for t in (0, 4, 8):
            later_features, later_ids = features.clone(), ids.clone()
            later_features[:, t + 1 :] += 1.0
            later_ids[:, t + 2 :] = (later_ids[:, t + 2 :] + 5) % target.config.vocab_size
            changed = unroll_ttt(heads, later_features, later_ids, mask, 4, parallel_slot_token=token)
            for step in range(4):
                torch.testing.assert_close(changed[step][:, : t + 1], base[step][:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(changed[1][:, t + 1], base[1][:, t + 1])  # the test has teeth
    heads.train()
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    eagle3_loss(heads, features, target_logits, ids, mask, batch["loss_mask"], LossSection()).loss.backward()
    assert heads.mask_hidden.grad is not None and heads.mask_hidden.grad.abs().sum() > 0


def test_cod_roots_are_nested_shrinking_and_drawn_from_the_batch():
    roots = cod_slot_roots(40, 5, 0.5, torch.Generator().manual_seed(0))
    assert [r.shape[0] for r in roots] == [20, 10, 5, 3]
    for shallower, deeper in zip(roots, roots[1:]):
        assert set(deeper.tolist()) <= set(shallower.tolist()) and torch.equal(deeper, deeper.sort().values)
    assert [r.shape[0] for r in cod_slot_roots(3, 4, 0.1, torch.Generator().manual_seed(0))] == [1, 1, 1]  # >= 1
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    same = [torch.equal(a, b) for a, b in zip(cod_roots(ids, 4, 0.5), cod_roots(ids.clone(), 4, 0.5))]
    assert all(same) and cod_roots(ids, 4, 1.0) is None and cod_roots(ids, 0, 0.5) is None


def test_cod_slots_equal_the_full_unroll_at_their_roots(tiny_target_factory):
    """COD runs the sampled roots' slots only, each seeing the same keys as in the full unroll (its prefix and its own
    chain's earlier slots, which nesting keeps): their outputs are the full unroll's at those roots."""
    target, heads = tiny_parallel(tiny_target_factory, depth=4)
    batch = random_batch(target.config.vocab_size, [14, 9], seed=6)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    features = torch.randn(2, 14, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(3))
    token = heads.config.parallel_slot_token
    roots = cod_slot_roots(13, 4, 0.6, torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = unroll_ttt(heads, features, ids, mask, 4, parallel_slot_token=token)
        sampled = unroll_ttt(heads, features, ids, mask, 4, parallel_slot_token=token, slot_roots=roots)
    torch.testing.assert_close(sampled[0], full[0])
    for step in range(1, 4):
        assert sampled[step].shape[1] == roots[step - 1].shape[0] < 13
        torch.testing.assert_close(sampled[step], full[step][:, roots[step - 1]], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="slot_roots .COD sampling. need parallel slots, dense masks"):
        unroll_ttt(heads, features, ids, mask, 4, parallel_slot_token=token, slot_roots=roots[:2])


def test_cod_loss_scores_the_sampled_roots_and_trains(tiny_target_factory):
    """With loss.parallel_slot_ratio < 1 each depth's metrics are the full loss's over the sampled roots (chain
    attention heads fall back to dense masks for it), and the slots get gradients; the ratio is validated."""
    target, heads = tiny_parallel(tiny_target_factory, depth=4)
    use_ttt_chain_attention(heads)
    batch = random_batch(target.config.vocab_size, [16, 12], seed=8)
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    full = eagle3_loss(heads, features, target_logits, ids, mask, loss_mask, LossSection())
    sampled = eagle3_loss(heads, features, target_logits, ids, mask, loss_mask, LossSection(parallel_slot_ratio=0.5))
    assert sampled.metrics["loss_depth1"] == pytest.approx(full.metrics["loss_depth1"], rel=1e-5)
    assert sampled.metrics["loss_depth4"] != pytest.approx(full.metrics["loss_depth4"], rel=1e-6)  # a subset
    heads.train()
    sampled.loss.backward()
    assert heads.mask_hidden.grad is not None and heads.mask_hidden.grad[2].abs().sum() > 0  # the deepest slot too
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"loss.parallel_slot_ratio={bad!r} is invalid"):
            load_run_config(CONFIGS / "eagle3_stories260k.yaml", [f"loss.parallel_slot_ratio={bad}"])


def test_init_heads_become_parallel_heads_to_train(tmp_path, stories_file, target_and_tokenizer):
    target, _ = target_and_tokenizer
    torch.manual_seed(0)
    create_heads(target, "eagle3", draft_vocab_size=128, tree_depth=6).save_pretrained(tmp_path / "ar")
    config = load_run_config(CONFIGS / "eagle3_stories260k.yaml", [
        f"init_heads={tmp_path / 'ar'}", "head.options={draft_vocab_size: 128, parallel_depth: 4}"])
    heads = initial_heads(config, target)
    assert heads.config.parallel_depth == 4 and heads.config.tree_depth == 4 and heads.mask_hidden.shape == (3, 3 * 64)
    heads.save_pretrained(tmp_path / "parallel")
    config.init_heads, config.head.options = str(tmp_path / "parallel"), {"parallel_depth": 5}
    with pytest.raises(ValueError, match="parallel_depth=5 but init_heads=.* has parallel_depth=4"):
        initial_heads(config, target)
    with pytest.raises(ValueError, match="already draft in parallel"):
        heads.enable_parallel_drafting(3)
    with pytest.raises(ValueError, match="parallel_depth=1 is invalid"):
        create_heads(target, "eagle3").enable_parallel_drafting(1)


def test_short_parallel_run_learns_and_decodes_exactly(tmp_path, stories_file, target_and_tokenizer):
    target, tok = target_and_tokenizer
    out = tmp_path / "peagle"
    extra = {"max_steps": 60, "save_steps": 60, "head.options.draft_vocab_size": 128, "head.options.parallel_depth": 4}
    assert main(["train", str(CONFIGS / "eagle3_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"acc_depth4", "loss_depth4"} <= set(metrics) and "acc_depth5" not in metrics
    trained = load_heads(out / "final", target=target)
    assert trained.config.parallel_depth == 4
    torch.manual_seed(0)
    fresh = create_heads(target, "eagle3", draft_vocab_size=128, parallel_depth=4,
                         feature_layers=trained.config.feature_layers)
    fresh.set_draft_vocab(trained.d2t, init_lm_head_from_target=True)
    assert depth1_accuracy(trained, target, tok, stories_file) > depth1_accuracy(fresh, target, tok, stories_file) + 0.05
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, trained)
    assert torch.equal(lm.generate(ids, max_new_tokens=40), target.generate(ids, max_new_tokens=40, do_sample=False))
    assert lm.last_stats["mean_accepted"] > 1.5
