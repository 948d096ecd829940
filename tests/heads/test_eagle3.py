"""EAGLE-3 heads: shapes, n-layer fusion inside forward (3 by default, any n >= 2), the draft vocabulary (d2t / t2d) and its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads import create_heads, load_heads
from specheads.heads import Eagle3Heads, HeadsConfig
from specheads.heads.eagle3 import default_eagle3_feature_layers
from specheads.inference.drafting import EagleDrafter


def _random_vocab(vocab_size: int, size: int, seed: int = 0) -> torch.Tensor:
    """`size` distinct target ids, sorted (a valid draft vocabulary)."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def _perturbed(heads: Eagle3Heads, seed: int = 0) -> Eagle3Heads:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return heads.eval()


def _target_features(target, batch: int = 2, length: int = 6, seed: int = 0):
    """(hidden_states tuple of a real target forward, input ids) on random tokens."""
    ids = torch.randint(
        0, target.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True).hidden_states, ids


def test_default_feature_layers():
    """EAGLE-3's taps [2, L//2, L-3], clamped into the pre-norm states [0, L-1] on shallow targets."""
    assert default_eagle3_feature_layers(32) == [2, 16, 29]
    assert default_eagle3_feature_layers(5) == [2, 2, 2]
    assert default_eagle3_feature_layers(2) == [1, 1, 0]
    assert default_eagle3_feature_layers(1) == [0, 0, 0]


def test_shapes_and_defaults(any_target, causal_mask):
    """select_features (B, T, 3h) -> forward (B, T, h) -> logits (B, T, V_draft); own outputs feed back (B, T, h)."""
    torch.manual_seed(0)
    config = any_target.config
    h, v = config.hidden_size, config.vocab_size
    heads = create_heads(any_target, "eagle3", draft_vocab_size=v // 2).eval()
    assert heads.config.feature_layers == default_eagle3_feature_layers(config.num_hidden_layers)
    assert torch.equal(heads.d2t, torch.arange(v // 2))  # default: the first draft_vocab_size target ids
    assert (
        heads.t2d.dtype == torch.bool and int(heads.t2d.sum()) == v // 2 and bool(heads.t2d[: v // 2].all())
    )
    hidden_states, ids = _target_features(any_target)
    features = heads.select_features(hidden_states)
    assert features.shape == (2, 6, 3 * h)
    a, b, c = heads.config.feature_layers
    assert torch.equal(features, torch.cat([hidden_states[a], hidden_states[b], hidden_states[c]], dim=-1))
    positions = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        first = heads(features, ids, positions, causal_mask(2, 6))
        second = heads(first, ids, positions, causal_mask(2, 6))
        logits = heads.logits(second)
    assert first.shape == second.shape == (2, 6, h)
    assert logits.shape == (2, 6, v // 2) and torch.isfinite(logits).all()
    assert torch.equal(heads.draft_to_target_ids(torch.tensor([[0, 3]])), torch.tensor([[0, 3]]))


def test_fusion_happens_inside_forward_and_every_parameter_trains(tiny_llama, causal_mask):
    """forward(3h features) == forward(fc(features)); one forward + logits reaches every parameter (DDP)."""
    torch.manual_seed(0)
    heads = _perturbed(create_heads(tiny_llama, "eagle3", draft_vocab_size=40))
    hidden_states, ids = _target_features(tiny_llama)
    features = heads.select_features(hidden_states)
    positions, mask = torch.arange(6).expand(2, 6), causal_mask(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(
            heads(features, ids, positions, mask), heads(heads.fc(features), ids, positions, mask)
        )
    heads.train()
    heads.logits(heads(features, ids, positions, mask)).square().mean().backward()
    untouched = [name for name, p in heads.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not untouched
    with pytest.raises(ValueError, match="width 10; expected 3\\*hidden_size=192"):
        heads(torch.zeros(2, 6, 10), ids, positions, mask)


def test_attention_reads_embedding_and_feature_and_is_causal(tiny_qwen2, causal_mask):
    """Qwen2 family (q/k/v biases kept, 2h wide): the token matters, and later positions never leak backwards."""
    torch.manual_seed(0)
    heads = _perturbed(create_heads(tiny_qwen2, "eagle3"))
    attn = heads.layer.self_attn
    assert attn.q_proj.in_features == attn.k_proj.in_features == attn.v_proj.in_features == 128
    assert attn.q_proj.bias is not None  # Qwen2's q/k/v biases
    features = torch.randn(1, 5, 192, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[3, 9, 27, 81, 4]])
    positions, mask = torch.arange(5)[None], causal_mask(1, 5)
    with torch.no_grad():
        out = heads(features, ids, positions, mask)
        other_token = heads(features, ids.clone().index_fill_(1, torch.tensor([2]), 50), positions, mask)
        changed = features.clone()
        changed[:, -1] += 3.0
        later = heads(changed, ids, positions, mask)
    assert not torch.allclose(other_token[:, 2], out[:, 2])
    torch.testing.assert_close(other_token[:, :2], out[:, :2])
    torch.testing.assert_close(later[:, :-1], out[:, :-1])


def test_set_draft_vocab_fills_both_buffers_and_can_copy_lm_head_rows(stories260k):
    target, _ = stories260k
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=64)
    weight = target.get_output_embeddings().weight
    torch.testing.assert_close(heads.lm_head.weight, weight[:64], rtol=0, atol=0)  # fresh: the target's rows
    vocab = _random_vocab(512, 64)
    before = heads.lm_head.weight.detach().clone()
    heads.set_draft_vocab(vocab)
    assert torch.equal(heads.d2t, vocab) and torch.equal(heads.t2d.nonzero().squeeze(-1), vocab)
    assert torch.equal(heads.lm_head.weight, before)  # trained weights are kept unless asked
    heads.set_draft_vocab(vocab.int(), init_lm_head_from_target=True)
    torch.testing.assert_close(heads.lm_head.weight, weight[vocab], rtol=0, atol=0)
    assert torch.equal(heads.draft_to_target_ids(torch.tensor([0, 63])), vocab[[0, 63]])


@pytest.mark.parametrize(
    ("vocab", "match"),
    [
        (torch.arange(8), r"shape \(8,\); expected \(16,\)"),
        (torch.arange(16).flip(0), r"sorted ascending.*ids\[0\]=15 is followed by ids\[1\]=14"),
        (torch.cat([torch.arange(15), torch.tensor([14])]), "unique"),
        (torch.arange(90, 106), r"\[90, 105\]; expected ids in \[0, 97\)"),
        (torch.arange(16).float(), "integer tensor"),
    ],
)
def test_set_draft_vocab_rejects_bad_vocabularies(tiny_llama, vocab, match):
    heads = create_heads(tiny_llama, "eagle3", draft_vocab_size=16)
    with pytest.raises(ValueError, match=match):
        heads.set_draft_vocab(vocab)
    assert torch.equal(heads.d2t, torch.arange(16))  # unchanged


def test_d2t_and_t2d_round_trip_through_save_pretrained(tiny_llama, tmp_path, causal_mask):
    torch.manual_seed(0)
    heads = _perturbed(create_heads(tiny_llama, "eagle3", draft_vocab_size=30))
    heads.set_draft_vocab(_random_vocab(97, 30, seed=3))
    heads.save_pretrained(tmp_path / "e3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert (config["head_type"], config["draft_vocab_size"], config["feature_layers"]) == (
        "eagle3",
        30,
        [1, 1, 0],
    )
    tensors = load_file(tmp_path / "e3" / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    loaded = load_heads(tmp_path / "e3", target=tiny_llama)
    assert isinstance(loaded, Eagle3Heads)
    assert torch.equal(loaded.d2t, heads.d2t) and torch.equal(loaded.t2d, heads.t2d)
    assert loaded.t2d.dtype == torch.bool and loaded.d2t.dtype == torch.long
    hidden_states, ids = _target_features(tiny_llama)
    features = heads.select_features(hidden_states)
    args = (ids, torch.arange(6).expand(2, 6), causal_mask(2, 6))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.logits(loaded(features, *args)), heads.logits(heads(features, *args)), rtol=0, atol=0
        )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("unsorted", "tensor d2t is invalid: .*sorted ascending"),
        ("out_of_range", r"tensor d2t is invalid: .*expected ids in \[0, 97\)"),
        ("t2d", "tensor t2d .* exactly the d2t target ids"),
        ("missing", "missing tensors \\['d2t'\\]"),
    ],
)
def test_load_heads_refuses_a_bad_draft_vocabulary(tiny_llama, tmp_path, edit, match):
    create_heads(tiny_llama, "eagle3", draft_vocab_size=10).save_pretrained(tmp_path / "e3")
    path = tmp_path / "e3" / "model.safetensors"
    tensors = load_file(path)
    if edit == "unsorted":
        tensors["d2t"] = tensors["d2t"].flip(0).contiguous()
    elif edit == "out_of_range":
        tensors["d2t"][-1] = 200
    elif edit == "t2d":
        tensors["t2d"][50] = True
    else:
        del tensors["d2t"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=match):
        load_heads(tmp_path / "e3")


def test_config_validation(tiny_llama):
    layer = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="draft_vocab_size=98 is larger than vocab_size=97"):
        HeadsConfig(
            head_type="eagle3",
            vocab_size=97,
            draft_vocab_size=98,
            feature_layers=[1, 1, 0],
            draft_layer_config=layer,
        )
    with pytest.raises(ValueError, match="at least 2 target layers"):
        HeadsConfig(head_type="eagle3", vocab_size=97, feature_layers=[2], draft_layer_config=layer)
    with pytest.raises(ValueError, match="draft_layer_config is empty"):
        HeadsConfig(head_type="eagle3", vocab_size=97, feature_layers=[1, 1, 0])
    assert HeadsConfig(vocab_size=50000).draft_vocab_size == 32000  # default: min(vocab_size, 32000)
    assert HeadsConfig(vocab_size=97).draft_vocab_size == 97
    with pytest.raises(ValueError, match="feature_layers"):
        create_heads(tiny_llama, "eagle3", feature_layers=[1, 2, 3])  # the target has 3 hidden states


def test_a_draft_vocabulary_smaller_than_top_k_is_refused(tiny_llama):
    heads = create_heads(tiny_llama, "eagle3", draft_vocab_size=4)
    with pytest.raises(ValueError, match="tree_top_k=5 exceeds the heads' draft vocabulary of 4"):
        EagleDrafter(heads, depth=3, top_k=5, num_nodes=8, dtype=torch.float32)


def test_drafts_only_hold_target_ids_of_the_draft_vocabulary(tiny_mistral, causal_mask):
    """Every drafted token is a target id in d2t; the root's children are d2t of the head's top draft ids."""
    torch.manual_seed(0)
    heads = _perturbed(create_heads(tiny_mistral, "eagle3", draft_vocab_size=12))
    vocab = _random_vocab(97, 12, seed=5)
    assert not torch.equal(vocab, torch.arange(12))
    heads.set_draft_vocab(vocab)
    drafter = EagleDrafter(heads, depth=4, top_k=3, num_nodes=12, dtype=torch.float32)
    drafter.reset()
    generator = torch.Generator().manual_seed(2)
    allowed = set(vocab.tolist())
    features, next_tokens = [], []
    for length in (5, 2, 1, 3):  # the prefill, then rounds committing 2, 1 and 3 positions
        features.append(torch.randn(length, 192, generator=generator))
        next_tokens.append(torch.randint(0, 97, (length,), generator=generator))
        tokens, tree = drafter.propose(features[-1], next_tokens[-1])
        assert int(tokens[0]) == int(next_tokens[-1][-1]) and tokens.shape == (13,)
        assert set(tokens[1:].tolist()) <= allowed
        f, t = torch.cat(features), torch.cat(next_tokens)
        n = f.shape[0]
        with torch.no_grad():  # one causal pass over everything committed: the head's prediction at the root
            root = heads(f[None], t[None], torch.arange(n)[None], causal_mask(1, n))[0, -1]
            top = heads.logits(root).topk(3).indices
        assert set(tokens[tree.parents == 0].tolist()) == set(vocab[top].tolist())


@pytest.mark.parametrize("feature_layers", [[1, 4], [0, 1, 3, 4]])
def test_other_numbers_of_tapped_layers_decode_exactly_and_round_trip(stories260k, tmp_path, feature_layers):
    """EAGLE-3 heads fusing 2 or 4 target layers: fc reads n*h, greedy output is the target's, the checkpoint and
    the speculators format (vLLM reads any number) keep the taps, and the 3-layer formats refuse them by name."""
    from specheads import SpeculativeLM
    from specheads.heads.interop import export_heads, import_heads

    target, tokenizer = stories260k
    torch.manual_seed(0)
    heads = _perturbed(create_heads(target, "eagle3", feature_layers=feature_layers, draft_vocab_size=256))
    h, n = target.config.hidden_size, len(feature_layers)
    assert heads.fc.in_features == n * h
    hidden_states, _ = _target_features(target)
    assert heads.select_features(hidden_states).shape[-1] == n * h
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, heads)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(lm.generate(ids, max_new_tokens=40), expected)
    assert torch.equal(lm.generate(ids, max_new_tokens=40, fast_path=True), expected)  # static-shape drafting too

    heads.save_pretrained(tmp_path / "heads")
    reloaded = load_heads(tmp_path / "heads", target=target)
    assert reloaded.config.feature_layers == feature_layers
    torch.testing.assert_close(reloaded.fc.weight, heads.fc.weight)
    export_heads(tmp_path / "heads", "speculators", tmp_path / "vllm")
    back = import_heads(tmp_path / "vllm", target=target, out_dir=tmp_path / "back")
    assert back.config.feature_layers == feature_layers
    torch.testing.assert_close(back.fc.weight, heads.fc.weight)
    for fmt in ("eagle3", "eagle3-sglang"):
        with pytest.raises(ValueError, match=f"format '{fmt}' fuses exactly 3 target layers"):
            export_heads(tmp_path / "heads", fmt, tmp_path / fmt)
