"""EAGLE-3 training: the training-time test unroll sees no future and matches drafting step by step; the draft
vocabulary; real CLI runs on stories260K (online and offline features)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads import create_heads, load_heads
from specheads.cli import main
from specheads.heads import FIELD_HELP
from specheads.training.config import LossSection, load_run_config
from specheads.training.data import build_dataset, collate
from specheads.training.draft_vocab import (
    build_draft_vocab,
    count_trained_tokens,
    select_draft_vocab,
    special_token_ids,
    vocab_coverage,
)
from specheads.training.features import online_features
from specheads.training.losses import eagle3_loss
from specheads.training.ttt import ttt_attention_mask, unroll_ttt

from .conftest import CONFIGS, assert_offline_trains_like_online, depth1_accuracy, dump_features, overrides

NEG = torch.finfo(torch.float32).min


# --- the unrolled training-time test ----------------------------------------------------------------------
def tiny_eagle3(tiny_target_factory, draft_vocab_size: int = 40):
    """Tiny llama target + fresh EAGLE-3 heads with a scattered (non-prefix) draft vocabulary."""
    target = tiny_target_factory("llama")
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=draft_vocab_size).eval()
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(1))[
        :draft_vocab_size
    ]
    heads.set_draft_vocab(vocab.sort().values, init_lm_head_from_target=True)
    return target, heads


def random_batch(vocab_size: int, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded random tokens; the first two tokens of each row are an untrained prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab_size, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0, 0] + [1] * (n - 2)})
    return collate(rows, pad_token_id=0)


def test_ttt_mask_is_causal_prefix_plus_own_chain():
    key_padding = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    for step in range(4):
        mask = ttt_attention_mask(key_padding, step, torch.float32)
        assert mask.shape == (2, 1, 4, 4 * (step + 1))
        for b in range(2):
            for t in range(4):
                for key in range(4 * (step + 1)):
                    block, j = divmod(key, 4)
                    if block == 0:  # step-0 entries: indices <= t that are real (a padded query keeps itself)
                        allowed = j <= t and (bool(key_padding[b, j]) or j == t)
                    else:  # steps 1..step: only the query's own chain
                        allowed = j == t
                    assert (mask[b, 0, t, key] == 0) == allowed, (step, b, t, key)
                    assert mask[b, 0, t, key] in (0.0, NEG)
    with pytest.raises(ValueError, match="step=-1"):
        ttt_attention_mask(key_padding, -1, torch.float32)


def test_no_position_sees_its_future(tiny_target_factory):
    """Step i at index t reads f_0..f_t and x_1..x_{t+1+i}: changing anything later leaves it unchanged."""
    target, heads = tiny_eagle3(tiny_target_factory)
    h, steps = target.config.hidden_size, 4
    batch = random_batch(target.config.vocab_size, [12, 9])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    features = torch.randn(2, 12, 3 * h, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = unroll_ttt(heads, features, ids, mask, steps)
        for t in (0, 3, 7):
            for i in range(steps):
                later_features = features.clone()
                later_features[:, t + 1 :] = torch.randn_like(later_features[:, t + 1 :])
                later_ids = ids.clone()
                later_ids[:, t + 2 + i :] = (later_ids[:, t + 2 + i :] + 5) % target.config.vocab_size
                changed = unroll_ttt(heads, later_features, later_ids, mask, steps)
                for j in range(i + 1):  # every step j <= i reads tokens up to t+1+j <= t+1+i only
                    torch.testing.assert_close(changed[j][:, : t + 1], base[j][:, : t + 1], rtol=0, atol=1e-6)
                # the test has teeth: the deepest step does see x_{t+2+i} at index t+1
                assert not torch.allclose(changed[i][:, t + 1], base[i][:, t + 1])


def reference_eagle3_loss(
    heads, features, target_logits, ids, attention_mask, loss_mask, config: LossSection
):
    """Slow reference: one explicit draft chain per (row, start t), run exactly as EagleDrafter drafts.

    The prefix (f_0..f_t, x_1..x_{t+1}) is committed at positions 0..t with a causal mask into a fresh cache;
    then depth j reads (previous output, x_{t+1+j}) at position t+j and sees the prefix plus its ancestors.
    """
    d2t = heads.d2t
    steps = config.ttt_steps
    sums, counts = [0.0] * steps, [0] * steps
    hits = [0] * steps
    for b in range(ids.shape[0]):
        length = int(attention_mask[b].sum())
        for t in range(length - 2):  # x_{t+2} exists
            cache = DynamicCache()
            causal = torch.full((t + 1, t + 1), NEG).triu(1)[None, None]
            hidden = heads(
                features[b : b + 1, : t + 1],
                ids[b : b + 1, 1 : t + 2],
                torch.arange(t + 1)[None],
                causal,
                cache,
            )
            hidden = hidden[:, -1:]  # (1, 1, h): depth 1 of the chain rooted at t
            for i in range(steps):
                if i > 0:
                    if t + 1 + i >= length:
                        break
                    seen = torch.zeros(1, 1, 1, t + 1 + i)  # the prefix and the ancestors: all visible
                    hidden = heads(
                        hidden, ids[b : b + 1, t + 1 + i : t + 2 + i], torch.tensor([[t + i]]), seen, cache
                    )
                if t + 2 + i >= length or not loss_mask[b, t + 2 + i]:
                    continue
                log_probs = F.log_softmax(heads.logits(hidden)[0, 0], dim=-1)  # (Vd,)
                if config.labels == "target":
                    label = F.softmax(target_logits[b, t + 1 + i, d2t], dim=-1)
                    loss = -(label * log_probs).sum()
                else:
                    token = int(ids[b, t + 2 + i])
                    if token not in d2t.tolist():
                        continue
                    loss = -log_probs[d2t.tolist().index(token)]
                sums[i] += float(loss)
                counts[i] += 1
                hits[i] += int(d2t[log_probs.argmax()] == target_logits[b, t + 1 + i].argmax())
    per_step = [s / max(c, 1) for s, c in zip(sums, counts)]
    accuracy = [h / max(c, 1) for h, c in zip(hits, counts)]
    return sum(config.ttt_decay**i * per_step[i] for i in range(steps)), per_step, accuracy


@pytest.mark.parametrize("labels", ["target", "tokens"])
def test_loss_equals_step_by_step_drafting_reference(tiny_target_factory, labels):
    target, heads = tiny_eagle3(tiny_target_factory)
    batch = random_batch(target.config.vocab_size, [11, 7], seed=3)
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    loss_mask[0, 6] = 0  # a hole inside a row
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    config = LossSection(ttt_steps=4, ttt_decay=0.7, labels=labels)
    with torch.no_grad():
        out = eagle3_loss(heads, features, target_logits, ids, mask, loss_mask, config)
        expected, per_step, accuracy = reference_eagle3_loss(
            heads, features, target_logits, ids, mask, loss_mask, config
        )
    for i, value in enumerate(per_step):
        assert out.metrics[f"loss_depth{i + 1}"] == pytest.approx(value, rel=1e-5, abs=1e-5), i
        if labels == "target":  # "tokens" leaves out-of-vocabulary labels out of the loss, not of the accuracy
            assert out.metrics[f"acc_depth{i + 1}"] == pytest.approx(accuracy[i], abs=1e-6), i
    assert float(out.loss) == pytest.approx(expected, rel=1e-5)


def test_loss_trains_through_every_step_and_reports_metrics(tiny_target_factory):
    target, heads = tiny_eagle3(tiny_target_factory)
    heads.train()
    batch = random_batch(target.config.vocab_size, [10, 8], seed=4)
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    features, target_logits = online_features(target, ids, mask, heads.select_features)
    out = eagle3_loss(heads, features, target_logits, ids, mask, loss_mask, LossSection(ttt_steps=3))
    assert {"loss", "acc", "sim_tau", "draft_vocab_coverage", "acc_depth3", "loss_depth3"} <= set(out.metrics)
    assert 1.0 <= out.metrics["sim_tau"] <= 4.0
    in_vocab = torch.isin(ids[:, 2:], heads.d2t)[loss_mask[:, 2:].bool()]
    assert out.metrics["draft_vocab_coverage"] == pytest.approx(float(in_vocab.float().mean()))
    out.loss.backward()
    assert heads.fc.weight.grad is not None and heads.fc.weight.grad.abs().sum() > 0
    assert heads.lm_head.weight.grad.abs().sum() > 0
    # nothing trained: nothing counted
    empty = eagle3_loss(
        heads, features, target_logits, ids, mask, torch.zeros_like(loss_mask), LossSection(ttt_steps=2)
    )
    assert float(empty.loss.detach()) == 0.0


# --- the draft vocabulary ---------------------------------------------------------------------------------
def test_draft_vocab_counts_only_trained_tokens():
    counts = count_trained_tokens([[5, 6, 6, 7], [7, 7, 1]], [[0, 1, 1, 1], [1, 1, 0]], vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 2, 3, 0, 0]
    with pytest.raises(ValueError, match="token id 12"):
        count_trained_tokens([[1, 12]], [[1, 1]], vocab_size=10)
    with pytest.raises(ValueError, match="3 tokens but a loss mask of 2"):
        count_trained_tokens([[1, 2, 3]], [[1, 1]], vocab_size=10)


def test_draft_vocab_frequency_ties_specials_and_coverage():
    counts = torch.tensor([0, 0, 9, 4, 4, 4, 1, 0, 7, 0])  # V = 10
    # most frequent first: 2 (9), 8 (7), then the tie 3/4/5 (4 each) is broken by the lower id
    assert select_draft_vocab(counts, 3).tolist() == [2, 3, 8]
    assert select_draft_vocab(counts, 4).tolist() == [2, 3, 4, 8]
    # special tokens always kept, even unseen; ids beyond the vocabulary are ignored
    assert select_draft_vocab(counts, 4, always_include=[0, 1, 99]).tolist() == [0, 1, 2, 8]
    # fewer distinct tokens than asked: unseen tokens fill in id order
    assert select_draft_vocab(counts, 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
    assert select_draft_vocab(counts, 10).tolist() == list(range(10))
    vocab = build_draft_vocab(counts, 3, always_include=[1])
    assert vocab.draft_to_target.tolist() == [1, 2, 8]
    assert vocab.coverage == pytest.approx(16 / 29) == vocab_coverage(counts, vocab.draft_to_target)
    with pytest.raises(ValueError, match="draft_vocab_size=11"):
        select_draft_vocab(counts, 11)
    with pytest.raises(ValueError, match="cannot hold the tokenizer's 3 special tokens"):
        select_draft_vocab(counts, 2, always_include=[0, 1, 2])


def test_draft_vocab_is_deterministic_whatever_the_example_order(stories260k):
    _, tok = stories260k
    g = torch.Generator().manual_seed(0)
    ids = [
        torch.randint(0, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 40, (30,), generator=g)
    ]
    masks = [[0] + [1] * (len(row) - 1) for row in ids]
    specials = special_token_ids(tok)
    assert {0, 1, 2} <= set(specials)  # unk, bos, eos of stories260K
    a = build_draft_vocab(count_trained_tokens(ids, masks, 512), 64, specials)
    b = build_draft_vocab(count_trained_tokens(ids[::-1], masks[::-1], 512), 64, specials)
    assert torch.equal(a.draft_to_target, b.draft_to_target) and a.coverage == b.coverage
    assert {0, 1, 2} <= set(a.draft_to_target.tolist())


def test_recipes_mirror_the_eagle_recipes():
    for name in ("stories260k", "smollm2"):
        eagle, eagle3 = (
            load_run_config(CONFIGS / f"eagle_{name}.yaml"),
            load_run_config(CONFIGS / f"eagle3_{name}.yaml"),
        )
        assert eagle3.head.type == "eagle3" and set(eagle3.head.options) <= set(FIELD_HELP)
        same = ("target", "max_steps", "global_batch_size", "seed", "feature_mode")
        assert [getattr(eagle3, k) for k in same] == [getattr(eagle, k) for k in same]
        assert (eagle3.data.source, eagle3.data.max_length) == (eagle.data.source, eagle.data.max_length)
        assert eagle3.head.options["draft_vocab_size"] in (256, 8192)


# --- real runs through the CLI ----------------------------------------------------------------------------
@pytest.mark.slow
def test_short_eagle3_run_learns(tmp_path, stories_file, target_and_tokenizer):
    target, tok = target_and_tokenizer
    out = tmp_path / "eagle3"
    config = CONFIGS / "eagle3_stories260k.yaml"
    extra = {
        "max_steps": 60,
        "save_steps": 60,
        "trackers": "[tensorboard]",
        "head.options.draft_vocab_size": 128,
    }
    assert main(["train", str(config), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    # the draft vocabulary is the data's most frequent trained tokens plus the special tokens
    dataset = build_dataset(stories_file, tok, "text", 64)
    expected = build_draft_vocab(
        count_trained_tokens(dataset["input_ids"], dataset["loss_mask"], 512),
        128,
        special_token_ids(tok, target),
    )
    assert metrics["draft_vocab_coverage"] == pytest.approx(expected.coverage) and expected.coverage > 0.9
    trained = load_heads(out / "final", target=target)
    assert torch.equal(trained.d2t.cpu(), expected.draft_to_target)
    assert int(trained.t2d.sum()) == 128 and bool(trained.t2d[2])  # EOS is draftable
    torch.manual_seed(0)
    fresh = create_heads(target, "eagle3", draft_vocab_size=128, feature_layers=trained.config.feature_layers)
    fresh.set_draft_vocab(expected.draft_to_target, init_lm_head_from_target=True)
    acc_trained, acc_fresh = (
        depth1_accuracy(trained, target, tok, stories_file),
        depth1_accuracy(fresh, target, tok, stories_file),
    )
    assert acc_trained > acc_fresh + 0.05, (acc_trained, acc_fresh)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.rglob("events.out.tfevents*")).parent))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert {"train/acc_depth3", "train/draft_vocab_coverage"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
def test_eagle3_offline_features_train_like_online(tmp_path, stories_file, capsys):
    config = str(CONFIGS / "eagle3_stories260k.yaml")  # taps feature_layers [1, 3, 4]
    steps = {"max_steps": 3, "save_steps": 3, "loss.ttt_steps": 2}

    def dump(out: Path, *extra: str) -> int:
        return dump_features(stories_file, out, *extra)

    def train(out: Path, **extra) -> int:
        return main(["train", config, *overrides(stories_file, out, **steps, **extra)])

    assert "d2t" in assert_offline_trains_like_online(config, "eagle3", stories_file, tmp_path, steps)
    # a dump without the tapped layers (or with others) is refused, naming the way out
    capsys.readouterr()
    for name, extra in (("plain", ()), ("default_taps", ("--head-type", "eagle3"))):
        assert dump(tmp_path / name, *extra) == 0
        assert (
            train(
                tmp_path / f"bad_{name}",
                feature_mode="offline",
                **{"data.features_dir": str(tmp_path / name)},
            )
            == 2
        )
        error = capsys.readouterr().err
        assert "--head-type eagle3 --feature-layers 1,3,4" in error and "feature_mode=online" in error, error


class _AlwaysRightHeads:
    """A stand-in drafter whose argmax is always draft id 0: with target logits whose argmax is d2t[0] everywhere,
    every draft it makes is right, so the simulated chains run exactly as far as the trained tokens go."""

    d2t = torch.tensor([2, 5, 9])
    config = SimpleNamespace(parallel_depth=0)  # drafts autoregressively: the loss unrolls loss.ttt_steps

    def __call__(self, features, input_ids, position_ids, attention_mask, cache=None):
        return features[..., :4]  # (B, n, h=4)

    def logits(self, hidden):
        out = torch.zeros(*hidden.shape[:-1], 3)
        out[..., 0] = 1.0
        return out


def test_simulated_chains_stop_at_untrained_tokens_and_padding():
    lengths, steps = [9, 6], 4
    batch = random_batch(12, lengths, seed=5)
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    features = torch.randn(2, ids.shape[1], 12)
    target_logits = torch.zeros(2, ids.shape[1], 12)
    target_logits[..., 2] = 1.0  # argmax d2t[0] everywhere, the padding too
    heads, config = _AlwaysRightHeads(), LossSection(ttt_steps=steps)

    def expected(rows: list[int]) -> float:  # chain at t: depths while x_{t+1+d} is a trained token of the row
        chains = [min(steps, n - 2 - t) for n in rows for t in range(n - 2)]
        return 1.0 + sum(chains) / len(chains)

    both = eagle3_loss(heads, features, target_logits, ids, mask, loss_mask, config)
    assert both.metrics["sim_tau"] == pytest.approx(expected(lengths))
    assert both.metrics["acc_depth1"] == 1.0
    short = eagle3_loss(heads, features[1:, :6], target_logits[1:, :6], ids[1:, :6], mask[1:, :6], loss_mask[1:, :6], config)
    assert short.metrics["sim_tau"] == pytest.approx(expected(lengths[1:]))  # the same row, unpadded


def test_eagle3_heads_fusing_four_layers_train_online_and_offline(tmp_path, stories_file, target_and_tokenizer):
    """`head.options.feature_layers` with 4 taps: the run learns (depth-1 agreement above fresh heads'), its
    checkpoint keeps the taps, and a feature dump stores those 4 layers; one tap is refused, naming the flag."""
    target, tok = target_and_tokenizer
    out = tmp_path / "four"
    extra = {"max_steps": 40, "save_steps": 40, "head.options.draft_vocab_size": 128,
             "head.options.feature_layers": "[0,1,3,4]"}
    assert main(["train", str(CONFIGS / "eagle3_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    trained = load_heads(out / "final", target=target)
    assert trained.config.feature_layers == [0, 1, 3, 4] and trained.fc.in_features == 4 * target.config.hidden_size
    torch.manual_seed(0)
    fresh = create_heads(target, "eagle3", draft_vocab_size=128, feature_layers=[0, 1, 3, 4])
    fresh.set_draft_vocab(trained.d2t.cpu(), init_lm_head_from_target=True)
    acc_trained = depth1_accuracy(trained, target, tok, stories_file)
    acc_fresh = depth1_accuracy(fresh, target, tok, stories_file)
    assert acc_trained > acc_fresh + 0.05, (acc_trained, acc_fresh)

    dump = ["data", "dump-features", "--target", "stories260K", "--data", str(stories_file), "--max-length", "32",
            "--head-type", "eagle3"]
    assert main([*dump, "--out", str(tmp_path / "f4"), "--feature-layers", "0,1,3,4"]) == 0
    assert json.loads((tmp_path / "f4" / "index.json").read_text())["tapped_layers"] == [0, 1, 3, 4]
    with pytest.raises(SystemExit, match="expected 2 or more"):
        main([*dump, "--out", str(tmp_path / "f1"), "--feature-layers", "2"])


def test_progressive_ttt_depth_grows_with_the_optimizer_step(tmp_path, stories_file, monkeypatch):
    """`loss.ttt_steps_warmup`: 1 unrolled step at step 0, growing linearly to `ttt_steps` at the warmup's end (a
    function of the step: resumes unroll alike); a real run hands each step's depth to the loss."""
    import specheads.training.train as train_module

    config = load_run_config(CONFIGS / "eagle3_stories260k.yaml", ["loss.ttt_steps=7", "loss.ttt_steps_warmup=10"])
    depths = [train_module.loss_config_at(config, step).loss.ttt_steps for step in (0, 1, 5, 9, 10, 500)]
    assert depths == [1, 1, 4, 6, 7, 7]
    assert train_module.loss_config_at(config, 10) is config
    with pytest.raises(ValueError, match="loss.ttt_steps_warmup=-1 is invalid"):
        load_run_config(CONFIGS / "eagle3_stories260k.yaml", ["loss.ttt_steps_warmup=-1"])
    seen: list[int] = []
    compute_loss = train_module.compute_loss

    def recording(run_config, *args, **kwargs):
        seen.append(run_config.loss.ttt_steps)
        return compute_loss(run_config, *args, **kwargs)

    monkeypatch.setattr(train_module, "compute_loss", recording)
    extra = {"max_steps": 8, "save_steps": 8, "head.options.draft_vocab_size": 128, "loss.ttt_steps": 3,
             "loss.ttt_steps_warmup": 4}
    assert main(["train", str(CONFIGS / "eagle3_stories260k.yaml"), *overrides(stories_file, tmp_path / "run", **extra)]) == 0
    assert seen == [1, 1, 1, 1, 2, 2, 2, 2] + [3] * 8  # two micro-batches a step
    assert "acc_depth3" in json.loads((tmp_path / "run" / "metrics.json").read_text())
