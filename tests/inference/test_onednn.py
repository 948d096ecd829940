"""oneDNN linear layers (CPU, fp32): the swap, exact greedy decoding on them, the errors, and the bench flag."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from specheads import create_heads
from specheads.inference.bench import bench_main
from specheads.inference.linear_swap import AUTO_MIN_LINEAR_WEIGHTS, linear_weights
from specheads.inference.onednn import OneDNNLinear, use_onednn_linears, wants_onednn

from .conftest import TINY_PROMPT, hf_greedy, speculative_on_a_copy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def count_linears(module: nn.Module) -> tuple[int, int]:
    modules = list(module.modules())
    return sum(isinstance(m, nn.Linear) for m in modules), sum(isinstance(m, OneDNNLinear) for m in modules)


def test_every_linear_is_swapped_and_computes_the_same_product(tiny_llama):
    target = copy.deepcopy(tiny_llama)
    ids = torch.tensor([TINY_PROMPT])
    with torch.no_grad():
        before = target(ids).logits
    linears, _ = count_linears(target)
    assert linears > 0 and use_onednn_linears(target) == linears
    assert count_linears(target) == (0, linears)
    with torch.no_grad():
        after = target(ids).logits
    assert not torch.equal(after, torch.zeros_like(after))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)  # the same fp32 product, another kernel


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_speculative_greedy_on_onednn_layers_equals_the_original_targets(tiny_llama, head_type):
    """The heads borrowed the target's modules before the swap (EAGLE reads the lm_head weight): still usable."""
    ids = torch.tensor([TINY_PROMPT])
    expected = hf_greedy(tiny_llama, ids, 24)
    lm = speculative_on_a_copy(tiny_llama, head_type)
    target = lm.target
    swapped = lm.use_onednn_linears()
    assert swapped == count_linears(target)[1] + count_linears(lm.heads)[1] and count_linears(lm.heads)[0] == 0
    assert torch.equal(lm.generate(ids, max_new_tokens=24), expected)
    assert torch.equal(lm.generate(ids, max_new_tokens=24, fast_path=True), expected)
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False), expected)  # the baseline too


def test_layers_that_are_not_float32_cpu_are_refused(tiny_llama):
    bf16 = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"float32 CPU inference; .*q_proj is torch.bfloat16 on cpu"):
        use_onednn_linears(bf16)
    assert count_linears(bf16)[1] == 0  # nothing swapped when one layer is refused
    with pytest.raises(ValueError, match="not a bare nn.Linear"):
        use_onednn_linears(nn.Linear(4, 4))


@pytest.mark.parametrize(("cpu_linear", "draft_linear"), [("onednn", "default"), ("onednn", "int8"), ("auto", "auto")])
def test_bench_cpu_kernels(tmp_path, cpu_linear, draft_linear):
    """`--cpu-linear` / `--draft-linear` (int8 heads: inference/int8_linear.py) reach the run and its JSON; 'auto' (the
    default) leaves stories260K's small layers on the default kernels, which are faster at that size."""
    from specheads import load_target

    target, _ = load_target("stories260K")
    heads = tmp_path / "heads"
    create_heads(target, "eagle3", draft_vocab_size=64, tree_depth=3, tree_top_k=2, tree_num_nodes=4).save_pretrained(heads)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    out = tmp_path / "bench" / "results.json"
    argv = ["--target", "stories260K", "--heads", str(heads), "--prompts", str(prompts), "--max-new-tokens", "10",
            "--prompt-lookup", "0", "--threads", "1", "--cpu-linear", cpu_linear, "--draft-linear", draft_linear,
            "--out", str(out)]
    assert bench_main(argv) == 0
    results = json.loads(out.read_text())
    environment = results["environment"]
    assert environment["cpu_linear"] == ("onednn" if cpu_linear == "onednn" else "default")
    assert environment["draft_linear"] == ("int8" if draft_linear == "int8" else "default")
    assert results["greedy_identical"] is True
    assert environment["cpu_attention"] == "gqa"  # --cpu-attention auto (the default): stories260K has 8 / 4 heads


def test_cpu_linear_auto_means_onednn_only_for_large_float32_cpu_targets(tiny_llama, tiny_target_factory):
    wide = tiny_target_factory("llama", hidden_size=256, intermediate_size=512)
    assert linear_weights(wide) >= AUTO_MIN_LINEAR_WEIGHTS > linear_weights(tiny_llama)
    assert wants_onednn("auto", wide) and wants_onednn("onednn", tiny_llama)
    assert not wants_onednn("auto", tiny_llama)  # small layers: the default kernels are faster
    assert not wants_onednn("auto", copy.deepcopy(wide).to(torch.bfloat16))
    assert not wants_onednn("default", wide)
    with pytest.raises(ValueError, match=r"--cpu-linear 'mkl'; expected one of \('default', 'onednn', 'auto'\)"):
        wants_onednn("mkl", tiny_llama)


@pytest.mark.parametrize("prepacked", [True, False])
def test_both_onednn_products_equal_the_linear_layer(prepacked, monkeypatch):
    """The prepacked dense-input op and the oneDNN-tensor fallback (PyTorch without the former) give nn.Linear's
    product, with and without bias, on 2-D and 3-D inputs."""
    from specheads.inference import onednn

    monkeypatch.setattr(onednn, "has_prepacked_linear", lambda: prepacked)
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(32, 48, bias=bias)
        swapped = OneDNNLinear(linear)
        assert swapped.prepacked is prepacked
        for x in (torch.randn(5, 32), torch.randn(2, 7, 32)):
            torch.testing.assert_close(swapped(x), linear(x), rtol=1e-5, atol=1e-5)
