"""Int8 draft heads (CPU): the layer's product, the swap, exact greedy and sampled decoding with them, the errors.
The bench flag is tested with the other CPU kernels in test_onednn.py, the CLI flag in test_cli.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specheads import SpeculativeLM
from specheads.inference.certified_argmax import wants_certified_argmax
from specheads.inference.int8_linear import Int8Linear, int8_engine, use_int8_linears, wants_int8_drafting
from specheads.inference.linear_swap import AUTO_MIN_LINEAR_WEIGHTS, linear_weights
from specheads.inference.onednn import OneDNNLinear

from .conftest import TINY_PROMPT, hf_greedy, load_sampling_harness, make_heads, speculative_on_a_copy

pytestmark = pytest.mark.skipif(int8_engine() is None, reason="PyTorch without a quantized CPU engine")


def count_layers(module: nn.Module) -> dict[str, int]:
    modules = list(module.modules())
    return {kind.__name__: sum(isinstance(m, kind) for m in modules) for kind in (nn.Linear, Int8Linear, OneDNNLinear)}


@pytest.mark.parametrize("bias", [True, False])
def test_the_int8_product_is_close_to_the_linear_layers(bias):
    """Per-row int8 weights and dynamically quantized inputs: within a few percent of the fp32 product on 1-D, 2-D and
    3-D inputs (and not the same numbers: it is an approximation)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    layer = Int8Linear(linear.weight, linear.bias)
    for x in (torch.randn(64), torch.randn(5, 64), torch.randn(2, 7, 64)):
        expected, got = linear(x).detach(), layer(x)
        assert got.shape == expected.shape and got.dtype == torch.float32
        error = (got - expected).abs().max() / expected.abs().max()
        assert 0 < error < 0.05, error


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_every_head_linear_but_the_feature_fusion_is_swapped(tiny_llama, head_type):
    heads = make_heads(tiny_llama, head_type)
    before = count_layers(heads)["Linear"]
    kept = heads.float32_linears
    assert use_int8_linears(heads, keep=kept) == before - len(kept)
    assert count_layers(heads)["Int8Linear"] == before - len(kept)
    for name in kept:  # EAGLE / EAGLE-3: fc reads the target's raw features and stays float32
        assert isinstance(heads.get_submodule(name), nn.Linear)
    assert kept == (() if head_type == "medusa" else ("fc",))


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_greedy_with_int8_heads_is_the_targets_output(tiny_target_factory, head_type):
    """The drafts change (the heads' logits move), the output does not: the float32 target verifies every token. On
    both the normal and the fast path, and with the target's layers on oneDNN as `make bench` runs them."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([TINY_PROMPT])
    expected = hf_greedy(target, ids, 24)
    heads = make_heads(target, head_type)
    reference = SpeculativeLM(target, copy.deepcopy(heads))
    lm = SpeculativeLM(target, heads)
    assert lm.use_int8_draft_linears() > 0
    assert torch.equal(lm.generate(ids, max_new_tokens=24), expected)
    assert torch.equal(lm.generate(ids, max_new_tokens=24, fast_path=True), expected)
    with torch.no_grad():
        outputs = target(ids, output_hidden_states=True)
        features = heads.select_features(outputs.hidden_states)
        fp32_logits, int8_logits = (_draft_scores(one.heads, features, ids) for one in (reference, lm))
    assert not torch.equal(fp32_logits, int8_logits)
    torch.testing.assert_close(int8_logits, fp32_logits, rtol=0.1, atol=0.1 * fp32_logits.abs().max().item())

    both = speculative_on_a_copy(target, head_type)
    onednn_target = both.target
    argmax = "bf16" if wants_certified_argmax("auto", onednn_target) else "default"  # needs oneDNN bf16 products
    chosen = both.use_cpu_kernels("onednn", "int8", "default", "auto")
    assert chosen == {"cpu_linear": "onednn", "draft_linear": "int8", "cpu_attention": "default", "cpu_argmax": argmax}
    layers = count_layers(both.heads)  # the float32 fusion layer goes to oneDNN, the rest stays int8
    assert count_layers(onednn_target)["Linear"] == 0 and layers["Linear"] == 0
    assert layers["OneDNNLinear"] == len(both.heads.float32_linears) and layers["Int8Linear"] > 0
    assert torch.equal(both.generate(ids, max_new_tokens=24), expected)


def _draft_scores(heads, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The heads' draft logits at the prompt's positions: Medusa's heads on the features; EAGLE heads' first level."""
    if not hasattr(heads, "layer"):
        return heads(features)  # (K, B, T, V)
    n = ids.shape[1] - 1
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    return heads.draft_logits(heads(features[:, :n], ids[:, 1:], torch.arange(n)[None], mask))


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_sampling_with_int8_heads_follows_the_exact_joint_law(tiny_target_factory, chi_square, head_type):
    """Rejection sampling uses the draft probabilities the int8 heads drafted with: the first 3 sampled tokens still
    follow the target's exact law."""
    harness = load_sampling_harness("sampling_harness_for_int8")
    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=harness.V, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # harness.six_token_target
    law = harness.ExactLaw(target, temperature=1.0)
    lm = SpeculativeLM(target, harness.untrained_eagle_heads(target, head_type))
    lm.use_int8_draft_linears()
    samples = harness.sample_first_three(lm, 1200, seed=3, temperature=1.0)
    result = chi_square(samples, law.joint())
    assert result.passed, result


def test_bad_layers_and_orders_are_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"float32 CPU inference; fc is torch.bfloat16 on cpu"):
        use_int8_linears(make_heads(tiny_llama, "eagle3").to(torch.bfloat16))
    with pytest.raises(ValueError, match="not a bare linear layer"):
        use_int8_linears(nn.Linear(4, 4))
    lm = speculative_on_a_copy(tiny_llama, "eagle3")
    lm.use_onednn_linears()
    with pytest.raises(ValueError, match=r"already a oneDNN linear layer: make the heads int8 before"):
        lm.use_int8_draft_linears()
    with pytest.raises(ValueError, match=r"--draft-linear 'int4'; expected one of \('default', 'int8', 'auto'\)"):
        lm.use_cpu_kernels("default", "int4")


def test_draft_linear_auto_means_int8_only_for_large_float32_cpu_heads(tiny_llama, tiny_target_factory):
    heads = make_heads(tiny_target_factory("llama", hidden_size=256, intermediate_size=1024), "eagle3")
    small = make_heads(tiny_llama, "eagle3")
    assert linear_weights(heads) >= AUTO_MIN_LINEAR_WEIGHTS > linear_weights(small)
    assert wants_int8_drafting("auto", heads) and wants_int8_drafting("int8", small)
    assert not wants_int8_drafting("auto", small)  # small layers: the default kernels are faster
    assert not wants_int8_drafting("auto", copy.deepcopy(heads).to(torch.bfloat16))
    assert not wants_int8_drafting("default", heads)
