"""TTT chain attention computes EAGLE-3's training-time-test attention exactly as the dense masked SDPA does:
outputs, losses and gradients, on several families; drafting with the same heads is unchanged."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

from specheads import create_heads
from specheads.cli import main
from specheads.training import chain_attention as chain_module
from specheads.training.chain_attention import (
    chain_attention,
    ttt_chain_attention_forward,
    use_ttt_chain_attention,
    uses_ttt_chain_attention,
    wants_ttt_chain_attention,
)
from specheads.training.config import LossSection, RunConfig
from specheads.training.features import online_features
from specheads.training.losses import eagle3_loss
from specheads.training.ttt import ttt_attention_mask

from ..conftest import TINY_FAMILIES
from .conftest import CONFIGS, overrides
from .test_eagle3_training import random_batch


def test_chain_attention_equals_the_dense_masked_sdpa():
    """Every step 0..3, grouped keys (4 query heads on 2 key heads), a padded row: same output and gradients."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, n, dim = 2, 4, 2, 5, 8
    key_padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for step in range(4):
        query = torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64, requires_grad=True)
        key = torch.randn(batch, kv_heads, (step + 1) * n, dim, generator=g, dtype=torch.float64, requires_grad=True)
        value = torch.randn(batch, kv_heads, (step + 1) * n, dim, generator=g, dtype=torch.float64, requires_grad=True)
        dense_mask = ttt_attention_mask(key_padding, step, torch.float64)  # (B, 1, n, (step+1) n)
        repeat = heads // kv_heads
        dense = F.scaled_dot_product_attention(
            query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1), attn_mask=dense_mask, scale=0.3
        ).transpose(1, 2)  # (B, n, H, d)
        chain = chain_attention(query, key, value, ttt_attention_mask(key_padding, 0, torch.float64), 0.3)
        torch.testing.assert_close(chain, dense)
        weights = torch.randn(dense.shape, generator=g, dtype=torch.float64)
        grads_dense = torch.autograd.grad((dense * weights).sum(), (query, key, value))
        grads_chain = torch.autograd.grad((chain * weights).sum(), (query, key, value))
        for a, b in zip(grads_chain, grads_dense):
            torch.testing.assert_close(a, b)


def _qwen3_target():
    """A tiny Qwen3 (q / k norms inside its attention): the chain route must keep the family's own projections."""
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


@pytest.mark.parametrize("family", [*TINY_FAMILIES, "qwen3"])
def test_eagle3_loss_and_gradients_are_the_same_with_chain_attention(tiny_target_factory, family):
    target = _qwen3_target() if family == "qwen3" else tiny_target_factory(family)
    torch.manual_seed(0)
    dense_heads = create_heads(target, "eagle3", draft_vocab_size=40).train()
    chain_heads = copy.deepcopy(dense_heads)
    use_ttt_chain_attention(chain_heads)
    assert uses_ttt_chain_attention(chain_heads) and not uses_ttt_chain_attention(dense_heads)
    batch = random_batch(target.config.vocab_size, [12, 7, 9], seed=5)  # padded rows
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    loss_mask[0, 8] = 0  # a hole inside a row
    features, target_logits = online_features(target, ids, mask, chain_heads.select_features)
    config = LossSection(ttt_steps=4)
    outs = [eagle3_loss(h, features, target_logits, ids, mask, loss_mask, config) for h in (dense_heads, chain_heads)]
    assert float(outs[1].loss.detach()) == pytest.approx(float(outs[0].loss.detach()), rel=1e-5)
    for key, value in outs[0].metrics.items():
        assert outs[1].metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for out in outs:
        out.loss.backward()
    for (name, a), b in zip(chain_heads.named_parameters(), dense_heads.parameters()):
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert chain_heads.layer.self_attn.k_proj.weight.grad.abs().sum() > 0  # the test has teeth: keys get gradients


def test_drafting_with_switched_heads_is_unchanged(tiny_llama):
    """Calls without `ttt_chain` (drafting, with a cache and a tree-like mask) go to transformers' SDPA as before."""
    torch.manual_seed(0)
    plain = create_heads(tiny_llama, "eagle3", draft_vocab_size=40).eval()
    switched = copy.deepcopy(plain)
    use_ttt_chain_attention(switched)
    use_ttt_chain_attention(switched)  # idempotent
    features = torch.randn(1, 6, 3 * 64)
    ids, positions = torch.randint(3, 97, (1, 6)), torch.arange(6)[None]
    mask = ttt_attention_mask(torch.ones(1, 6), 0, torch.float32)  # (1, 1, 6, 6) causal
    with torch.no_grad():
        a = plain(features, ids, positions, mask, DynamicCache())
        b = switched(features, ids, positions, mask, DynamicCache())
    assert torch.equal(a, b)


def test_chain_attention_refuses_what_it_does_not_model(tiny_llama):
    torch.manual_seed(0)
    heads = create_heads(tiny_llama, "eagle3", draft_vocab_size=40)
    attention = heads.layer.self_attn
    q, kv = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 6, 16)
    block = torch.zeros(1, 1, 3, 3)
    with pytest.raises(ValueError, match="dropout=0.1"):
        ttt_chain_attention_forward(attention, q, kv, kv, block, dropout=0.1, ttt_chain=True)
    with pytest.raises(ValueError, match="softcap"):
        ttt_chain_attention_forward(attention, q, kv, kv, block, ttt_chain=True, softcap=30.0)
    with pytest.raises(ValueError, match="whole steps"):
        chain_attention(q, kv[:, :, :5], kv[:, :, :5], block, 0.25)
    with pytest.raises(ValueError, match="SDPA attention"):
        use_ttt_chain_attention(create_heads(tiny_llama, "medusa", num_heads=2))
    with pytest.raises(ValueError, match="loss.ttt_attention='bogus'"):
        wants_ttt_chain_attention("bogus", torch.device("cpu"))
    assert wants_ttt_chain_attention("auto", torch.device("cpu")) and not wants_ttt_chain_attention("auto", "cuda")
    assert wants_ttt_chain_attention("chain", "cuda") and not wants_ttt_chain_attention("dense", "cpu")
    config = RunConfig()
    config.loss.ttt_attention = "bogus"
    with pytest.raises(ValueError, match="loss.ttt_attention='bogus' is invalid"):
        config.validate()


@pytest.mark.slow
def test_training_runs_chain_attention_on_the_cpu_like_dense(tmp_path, stories_file, monkeypatch, capsys):
    """`specheads train` on the CPU trains EAGLE-3 through chain attention (loss.ttt_attention=auto), and ends
    where the dense masked attention ends."""
    calls = []
    real = chain_module.chain_attention
    monkeypatch.setattr(chain_module, "chain_attention", lambda *a: calls.append(1) or real(*a))
    config = str(CONFIGS / "eagle3_stories260k.yaml")
    metrics = {}
    for mode in ("dense", "auto"):
        out = tmp_path / mode
        extra = {"max_steps": 3, "save_steps": 3, "loss.ttt_steps": 3, "loss.ttt_attention": mode}
        assert main(["train", config, *overrides(stories_file, out, **extra)]) == 0
        metrics[mode] = json.loads((out / "metrics.json").read_text())
        assert bool(calls) == (mode == "auto"), mode
        said = "chain (loss.ttt_attention=auto on cpu)" if mode == "auto" else "dense (loss.ttt_attention=dense on cpu)"
        assert f"[specheads] TTT attention: {said}" in capsys.readouterr().out
    for key in ("loss", "acc", "sim_tau", "acc_depth3"):
        assert metrics["auto"][key] == pytest.approx(metrics["dense"][key], rel=1e-4), key
