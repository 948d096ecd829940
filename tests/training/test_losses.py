"""Loss alignment: perfect drafts score accuracy 1, untrained ones do not; masks are respected."""

from __future__ import annotations

import copy

import pytest
import torch

from specheads import create_heads
from specheads.training.config import LossSection
from specheads.training.features import (
    can_skip_logits,
    logits_are_lm_head_of_final_state,
    offline_target_labels,
    online_features,
    online_stored_features,
)
from specheads.training.losses import (
    causal_mask,
    eagle3_loss,
    eagle_loss,
    medusa_loss,
    medusa_rows,
    uniform_noise,
)
from specheads.training.target_labels import mix_in_argmax, target_labels


def _batch(target_and_tokenizer):
    target, tok = target_and_tokenizer
    ids = tok(["Once upon a time, there was a little girl named Lily. She liked to play outside."],
              return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, 0] = 0
    return target, ids, mask, loss_mask


def test_medusa_alignment_with_perfect_logits(target_and_tokenizer):
    target, ids, mask, loss_mask = _batch(target_and_tokenizer)
    heads = create_heads(target, "medusa", num_heads=3)
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    # head k at t predicts x_{t+k+2}: the target's logits at t+k+1 are a perfect head
    T = ids.shape[1]
    perfect = torch.stack([torch.cat([target_logits[:, k + 1:], target_logits[:, : k + 1]], dim=1) for k in range(3)])
    out = medusa_loss(perfect, target_logits, ids, loss_mask, LossSection())
    assert out.metrics["acc_depth1"] == 1.0 and out.metrics["acc_depth3"] == 1.0
    assert out.metrics["sim_tau"] > 3.5
    fresh = medusa_loss(heads(features), target_logits, ids, loss_mask, LossSection())
    assert fresh.metrics["acc_depth1"] < 0.6
    assert fresh.loss.requires_grad and T > 5


def test_eagle_loss_runs_and_masks(target_and_tokenizer):
    target, ids, mask, loss_mask = _batch(target_and_tokenizer)
    torch.manual_seed(0)
    heads = create_heads(target, "eagle")
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    out = eagle_loss(heads, features, target_logits, ids, mask, loss_mask, LossSection(eval_depth=3))
    assert out.loss.requires_grad and torch.isfinite(out.loss)
    assert {"acc_depth1", "acc_depth3", "sim_tau", "loss_feature", "loss_token"} <= set(out.metrics)
    out.loss.backward()
    assert heads.fc.weight.grad is not None and target.lm_head.weight.grad is None
    empty = eagle_loss(heads, features, target_logits, ids, mask, torch.zeros_like(loss_mask), LossSection())
    assert float(empty.loss.detach()) == 0.0


def test_causal_mask_and_noise():
    m = causal_mask(torch.tensor([[1, 1, 0]]), torch.float32)
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0, 0, 1] < -1e30 and m[0, 0, 1, 0] == 0 and m[0, 0, 2, 2] == 0 and m[0, 0, 2, 1] == 0
    a = uniform_noise((2, 4, 3), 0.1, [5, 6])
    assert torch.equal(a, uniform_noise((2, 4, 3), 0.1, [5, 6]))
    assert torch.equal(a[1], uniform_noise((1, 4, 3), 0.1, [6])[0])
    assert a.abs().max() <= 0.1


def test_offline_target_labels_only_where_a_loss_reads_them(target_and_tokenizer):
    """Labels made from the lm_head at the positions a loss reads (offline features; with the dump's argmax only
    the label vocabulary's rows), or from dense logits, give the same loss and per-depth accuracies as the dense
    logits themselves, for every head type."""
    target, tok = target_and_tokenizer
    ids = tok(["Once upon a time, there was a little girl named Lily. She liked to play."], return_tensors="pt").input_ids
    ids = torch.cat([ids, ids.flip(1)])  # (2, T)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding on the second row
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0  # a "prompt"
    loss_mask[0, 9] = 0  # a hole
    final = online_features(target, ids, mask, lambda hs: hs[-1])[0]  # (B, T, h) post-norm
    dense = target.get_output_embeddings()(final)
    offline = offline_target_labels(target.get_output_embeddings(), final, loss_mask)
    needed = torch.zeros_like(loss_mask, dtype=torch.bool)
    needed[:, :-1] = loss_mask[:, 1:].bool()
    assert offline.row_of[needed].tolist() == list(range(int(needed.sum()))) and (offline.row_of[~needed] == -1).all()
    torch.testing.assert_close(offline.probs, torch.softmax(dense[needed], -1))
    assert torch.equal(offline.top1, dense[needed].argmax(-1))
    assert (~needed).sum() > 4  # the test has teeth: rows were skipped
    torch.manual_seed(0)
    for head_type in ("medusa", "eagle", "eagle3"):
        heads = create_heads(target, head_type, **({"draft_vocab_size": 64} if head_type == "eagle3" else {}))
        features = online_features(target, ids, mask, heads.select_features)[0]
        vocab = heads.d2t if head_type == "eagle3" else None
        for labels in ("target", "tokens"):
            config = LossSection(labels=labels, ttt_steps=3, eval_depth=3)
            with torch.no_grad():
                outs = []
                sources = (
                    dense,
                    target_labels(dense, loss_mask, vocab, labels == "target"),
                    offline_target_labels(target.get_output_embeddings(), final, loss_mask, vocab, labels == "target"),
                    offline_target_labels(target.get_output_embeddings(), final, loss_mask, vocab, labels == "target",
                                          dense.argmax(-1)),
                )
                for source in sources:
                    if head_type == "medusa":
                        outs.append(medusa_loss(heads(features), source, ids, loss_mask, config))
                        rows = medusa_rows(loss_mask, heads.config.num_heads)  # the training path: trained rows only
                        outs.append(medusa_loss(heads(features[rows]), source, ids, loss_mask, config, rows))
                        assert rows[0].numel() < ids.numel() - 4  # the test has teeth: positions were skipped
                    elif head_type == "eagle":
                        outs.append(eagle_loss(heads, features, source, ids, mask, loss_mask, config))
                    else:
                        outs.append(eagle3_loss(heads, features, source, ids, mask, loss_mask, config))
            for other in outs[1:]:
                assert float(other.loss) == pytest.approx(float(outs[0].loss), rel=1e-5), (head_type, labels)
                for key, value in outs[0].metrics.items():
                    if key.startswith(("loss", "acc")):
                        assert other.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (head_type, labels, key)


def test_target_labels_reject_a_mismatched_batch_or_vocabulary(target_and_tokenizer):
    target, ids, mask, loss_mask = _batch(target_and_tokenizer)
    heads = create_heads(target, "eagle3", draft_vocab_size=64)
    features, logits = online_features(target, ids, mask, heads.select_features)
    full = target_labels(logits, loss_mask)  # over the whole vocabulary: not EAGLE-3's draft vocabulary
    with pytest.raises(ValueError, match="over 512 tokens; this loss needs 64"):
        eagle3_loss(heads, features, full, ids, mask, loss_mask, LossSection(ttt_steps=1))
    with pytest.raises(ValueError, match="batch"):
        eagle3_loss(heads, features[:, :-1], target_labels(logits, loss_mask, heads.d2t), ids[:, :-1], mask[:, :-1],
                    loss_mask[:, :-1], LossSection(ttt_steps=1))
    tokens_only = target_labels(logits, loss_mask, heads.d2t, with_probs=False)
    with pytest.raises(ValueError, match="over None tokens"):
        eagle3_loss(heads, features, tokens_only, ids, mask, loss_mask, LossSection(ttt_steps=1))


def test_argmax_label_weight_mixes_a_one_hot_on_the_target_argmax(target_and_tokenizer):
    """loss.argmax_label_weight w: labels (1 - w) p + w onehot(argmax) inside the label vocabulary (rows whose argmax
    is outside keep p), so the soft cross-entropy is (1 - w) CE(p) + w CE(argmax) there; w = 0 changes nothing."""
    target, ids, mask, loss_mask = _batch(target_and_tokenizer)
    heads = create_heads(target, "eagle3", draft_vocab_size=64)
    features, logits = online_features(target, ids, mask, heads.select_features)
    # a draft vocabulary holding some of the target's argmaxes at the labelled positions, not all
    top1 = target_labels(logits, loss_mask).top1.unique()
    others = torch.tensor([i for i in range(512) if i not in set(top1.tolist())])
    heads.d2t.copy_(torch.cat([top1[::2], others[: 64 - top1[::2].numel()]]).sort().values)
    torch.manual_seed(0)
    with torch.no_grad():  # confident draft logits, so that what the labels weigh matters
        for parameter in heads.parameters():
            parameter.add_(torch.randn_like(parameter))
    labels = target_labels(logits, loss_mask, heads.d2t)
    inside = torch.isin(labels.top1, heads.d2t)
    assert inside.any() and (~inside).any()  # the test has teeth: both kinds of rows occur
    mixed = mix_in_argmax(labels, heads.d2t, 0.25)
    ids_in_draft = torch.searchsorted(heads.d2t, labels.top1[inside])
    expected = labels.probs.clone()
    expected[inside] *= 0.75
    expected[inside.nonzero()[:, 0], ids_in_draft] += 0.25
    torch.testing.assert_close(mixed.probs, expected)
    torch.testing.assert_close(mixed.probs.sum(-1), torch.ones(mixed.probs.shape[0]))
    assert mix_in_argmax(labels, heads.d2t, 0.0) is labels
    full = mix_in_argmax(target_labels(logits, loss_mask), None, 1.0)  # the whole vocabulary: pure one-hot labels
    assert torch.equal(full.probs.argmax(-1), full.top1) and torch.equal(full.probs.amax(-1), torch.ones(full.top1.numel()))
    # through the loss: step 0 of EAGLE-3 is the mixture of the two cross-entropies on rows whose argmax is drafted
    with torch.no_grad():
        soft, hard, half = (
            eagle3_loss(heads, features, logits, ids, mask, loss_mask, LossSection(ttt_steps=1, argmax_label_weight=w))
            for w in (0.0, 1.0, 0.5)
        )
    assert float(half.loss) == pytest.approx((float(soft.loss) + float(hard.loss)) / 2, rel=1e-5)
    assert float(hard.loss) != pytest.approx(float(soft.loss), rel=1e-3)


def test_online_stored_features_are_the_dump_layout_without_dense_logits(target_and_tokenizer):
    """The online step reads what a dump stores ([the heads' features | final state]); a forward without
    `logits_to_keep` is refused by name (the step then takes the target's dense logits)."""
    target, ids, mask, _ = _batch(target_and_tokenizer)
    heads = create_heads(target, "eagle3", draft_vocab_size=64)
    stored = online_stored_features(target, ids, mask, heads.select_features)
    features, _ = online_features(target, ids, mask, lambda hs: torch.cat([heads.select_features(hs), hs[-1]], -1))
    torch.testing.assert_close(stored, features)
    assert can_skip_logits(target)

    class NoLogitsToKeep(torch.nn.Module):
        config = target.config

        def forward(self, input_ids, attention_mask=None, output_hidden_states=False, use_cache=False):
            return target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=output_hidden_states)

    class CappedLogits(torch.nn.Module):  # Gemma 2-like: its logits are not lm_head(final state)
        config = copy.deepcopy(target.config)
        config.final_logit_softcapping = 30.0
        forward = type(target).forward

    assert not can_skip_logits(NoLogitsToKeep()) and not can_skip_logits(CappedLogits())
    assert logits_are_lm_head_of_final_state(target) and not logits_are_lm_head_of_final_state(CappedLogits())
    with pytest.raises(ValueError, match="NoLogitsToKeep is not one"):
        online_stored_features(NoLogitsToKeep(), ids, mask, heads.select_features)
