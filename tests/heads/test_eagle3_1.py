"""EAGLE-3.1's norms on EAGLE-3 heads (`eagle3_fc_norm`, `eagle3_norm_output`): the math, exact decoding on two
families, training through the TTT unroll, the checkpoint, and vLLM speculators' fields both ways."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads import HeadsConfig
from specheads.heads.describe import describe_heads
from specheads.heads.interop import export_heads, import_heads
from specheads.training.config import LossSection
from specheads.training.losses import eagle3_loss

BOTH = {"eagle3_fc_norm": True, "eagle3_norm_output": True}


def perturbed_pair(target, **options):
    """(plain EAGLE-3 heads, EAGLE-3.1 heads with `options`) sharing every weight they both have, all perturbed
    away from their init (norm weights too), in eval mode."""
    torch.manual_seed(0)
    plain = create_heads(target, "eagle3", draft_vocab_size=64)
    torch.manual_seed(0)
    v31 = create_heads(target, "eagle3", draft_vocab_size=64, **options)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in v31.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
        plain.load_state_dict({k: v for k, v in v31.state_dict().items() if not k.startswith("fc_norm.")})
    return plain.eval(), v31.eval()


def head_inputs(target, length: int = 6):
    ids = torch.randint(0, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    return states, ids, torch.arange(length)[None], mask


def test_fc_norm_normalises_each_fused_layer_before_fc(stories260k):
    target, _ = stories260k
    plain, v31 = perturbed_pair(target, eagle3_fc_norm=True)
    states, ids, positions, mask = head_inputs(target)
    features = v31.select_features(states)
    h = target.config.hidden_size
    normalised = torch.cat([norm(part) for norm, part in zip(v31.fc_norm, features.split(h, -1))], -1)
    with torch.no_grad():
        torch.testing.assert_close(v31(features, ids, positions, mask), plain(normalised, ids, positions, mask))
        assert not torch.allclose(v31(features, ids, positions, mask), plain(features, ids, positions, mask))
        # the head's own outputs (h wide) skip fc and its norms
        own = torch.randn(1, 6, h)
        torch.testing.assert_close(v31(own, ids, positions, mask), plain(own, ids, positions, mask))
    assert len(v31.fc_norm) == len(v31.config.feature_layers) and plain.fc_norm is None


def test_norm_output_feeds_the_next_step_the_final_norms_output(stories260k):
    target, _ = stories260k
    plain, v31 = perturbed_pair(target, eagle3_norm_output=True)
    states, ids, positions, mask = head_inputs(target)
    features = plain.select_features(states)
    with torch.no_grad():
        raw = plain(features, ids, positions, mask)
        out = v31(features, ids, positions, mask)
        torch.testing.assert_close(out, plain.norm(raw))
        torch.testing.assert_close(v31.logits(out), plain.logits(raw))  # no second norm before the lm_head
        # the next step reads the normalised output: it differs from reading the raw one
        assert not torch.allclose(v31(out, ids, positions, mask), plain(raw, ids, positions, mask))


@pytest.mark.parametrize("family", ["stories260K", "qwen2"])
def test_eagle3_1_heads_decode_exactly(family, stories260k, tiny_target_factory):
    target, tokenizer = stories260k if family == "stories260K" else (tiny_target_factory(family), None)
    _, heads = perturbed_pair(target, **BOTH)
    ids = torch.tensor([[1, 40, 47, 26, 37]]) if tokenizer is None else \
        tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, heads)
    expected = target.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(lm.generate(ids, max_new_tokens=32), expected)
    assert torch.equal(lm.generate(ids, max_new_tokens=32, fast_path=True), expected)


def test_every_eagle3_1_weight_trains_through_the_ttt_unroll(stories260k):
    target, _ = stories260k
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=64, **BOTH).train()
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    loss = eagle3_loss(heads, heads.select_features(out.hidden_states), out.logits, ids, attention, attention,
                       LossSection(ttt_steps=3))
    loss.loss.backward()
    for name in ("fc_norm.0.weight", "fc_norm.2.weight", "norm.weight"):
        grad = dict(heads.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_the_checkpoint_and_speculators_keep_the_norms_and_the_other_formats_refuse(stories260k, tmp_path):
    target, _ = stories260k
    _, heads = perturbed_pair(target, **BOTH)
    heads.save_pretrained(tmp_path / "heads")
    reloaded = load_heads(tmp_path / "heads", target=target)
    assert reloaded.config.eagle3_fc_norm and reloaded.config.eagle3_norm_output
    assert describe_heads(tmp_path / "heads")["eagle3_norms"] == ["eagle3_fc_norm", "eagle3_norm_output"]
    torch.testing.assert_close(reloaded.fc_norm[1].weight, heads.fc_norm[1].weight)
    export_heads(tmp_path / "heads", "speculators", tmp_path / "vllm")
    written = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert written["fc_norm"] is True and written["norm_output"] is True
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(load_file(tmp_path / "vllm" / "model.safetensors"))
    back = import_heads(tmp_path / "vllm", target=target, out_dir=tmp_path / "back")
    assert back.config.eagle3_fc_norm and back.config.eagle3_norm_output
    torch.testing.assert_close(back.fc_norm[2].weight, heads.fc_norm[2].weight)
    for fmt in ("eagle3", "eagle3-sglang"):
        with pytest.raises(ValueError, match="without the variants' norms.*eagle3_fc_norm, eagle3_norm_output"):
            export_heads(tmp_path / "heads", fmt, tmp_path / fmt)
    # plain heads export fc_norm / norm_output false, and a speculators file without the fields imports as plain
    plain, _ = perturbed_pair(target)
    plain.save_pretrained(tmp_path / "plain")
    assert "eagle3_norms" not in describe_heads(tmp_path / "plain")
    export_heads(tmp_path / "plain", "speculators", tmp_path / "plain-vllm")
    written = json.loads((tmp_path / "plain-vllm" / "config.json").read_text())
    assert written["fc_norm"] is False and written["norm_output"] is False and written["norm_before_residual"] is False
    del written["fc_norm"], written["norm_output"], written["norm_before_fc"]
    (tmp_path / "plain-vllm" / "config.json").write_text(json.dumps(written))
    assert not import_heads(tmp_path / "plain-vllm", target=target, out_dir=tmp_path / "b2").config.eagle3_fc_norm
    written["norm_output"] = "yes"
    (tmp_path / "plain-vllm" / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match="norm_output='yes'; expected true or false"):
        import_heads(tmp_path / "plain-vllm", target=target, out_dir=tmp_path / "b3")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="eagle3_fc_norm and eagle3_norm_before_fc are both set"):
        HeadsConfig(head_type="eagle3", draft_layer_config={"model_type": "llama"}, feature_layers=[1, 2],
                    eagle3_fc_norm=True, eagle3_norm_before_fc=True)
    with pytest.raises(ValueError, match="eagle3_fc_norm=True is set for head_type='eagle'"):
        HeadsConfig(head_type="eagle", draft_layer_config={"model_type": "llama"}, eagle3_fc_norm=True)
    with pytest.raises(ValueError, match="eagle3_norm_output=1 is invalid; expected true or false"):
        HeadsConfig(head_type="eagle3", draft_layer_config={"model_type": "llama"}, feature_layers=[1, 2],
                    eagle3_norm_output=1)
