"""The certified bf16 argmax (`--cpu-argmax`): its bound holds, it equals the float32 argmax (ties, flat rows, non-finite
rows, odd vocabularies), greedy decoding through it equals the target's, and targets it cannot serve are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specheads import SpeculativeLM, create_heads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference import certified_argmax
from specheads.inference.bench import bench_main
from specheads.inference.certified_argmax import (
    MAX_CANDIDATES,
    CertifiedArgmax,
    certified_argmax_for,
    has_native_bf16_products,
    wants_certified_argmax,
)
from specheads.inference.kv_cache import tree_cache
from specheads.inference.tree import build_tree_buffers
from specheads.inference.verify import DynamicTreeVerifier, verify_tree

from .conftest import TINY_PROMPT, hf_greedy, left_pad, make_heads

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def reference_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """argmax of the logits in float64: the float32 lm_head's argmax wherever its rounding cannot reorder them."""
    return (hidden.double() @ weight.double().T).argmax(dim=1)


def peaked_rows(weight: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Hidden states pointing at random vocabulary rows plus noise: logits with a clear top, as a trained model's."""
    picks = torch.randint(0, weight.shape[0], (rows,), generator=generator)
    return 3 * weight[picks] + torch.randn(rows, weight.shape[1], generator=generator)


@settings(max_examples=25, deadline=None)
@given(
    vocab=st.sampled_from([50, 64, 97, 513, 2048]),
    hidden_size=st.sampled_from([8, 64, 576, 2048]),
    rows=st.integers(1, 17),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_the_bound_holds_and_the_argmax_is_exact(vocab, hidden_size, rows, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) * scale
    weight[:, 0] *= 20  # an outlier dimension, as real residual streams have
    scorer = CertifiedArgmax(weight)
    hidden = torch.cat([torch.randn(rows, hidden_size, generator=generator), peaked_rows(weight / scale, 3, generator)])
    approx = scorer.approximate_logits(hidden).double()
    bound = scorer.error_bound(hidden, approx.amax(dim=1).float()).double()
    exact = hidden.double() @ weight.double().T
    assert bool(((exact - approx).abs() <= bound[:, None]).all())  # for every token, not only the candidates
    top2 = exact.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-5 * top2[:, 0].abs() + 1e-30  # rows float32 itself cannot tie
    assert torch.equal(scorer(hidden)[clear], reference_argmax(hidden, weight)[clear])


def test_peaked_rows_score_few_candidates_in_float32():
    """The bound narrows real-looking rows to a handful of tokens: the cheap path is the one taken."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 256, generator=generator) / 16
    scorer = CertifiedArgmax(weight)
    hidden = peaked_rows(weight * 16, 12, generator)
    approx = scorer.approximate_logits(hidden).float()
    best = approx.amax(dim=1)
    rows, ids = scorer.candidates(approx, best - 2 * scorer.error_bound(hidden, best))
    assert 12 <= rows.numel() <= 4 * 12
    assert torch.equal(torch.unique(rows), torch.arange(12))
    assert torch.equal(scorer(hidden), reference_argmax(hidden, weight))


def test_ties_go_to_the_lowest_id_and_flat_or_non_finite_rows_to_the_full_product():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 32, generator=generator)
    weight[200] = weight[17]  # token 200 always ties with token 17
    weight[250] = weight[17]
    scorer = CertifiedArgmax(weight)
    towards_17 = 5 * weight[17:18]
    assert scorer(towards_17).tolist() == [17]
    # a row of zeros ties every token (all candidates: more than MAX_CANDIDATES with enough rows): token 0
    flat = torch.zeros(MAX_CANDIDATES // 300 + 1, 32)
    assert scorer(flat).tolist() == [0] * flat.shape[0]
    nan_row = torch.cat([towards_17, torch.full((1, 32), float("nan"))])
    assert torch.equal(scorer(nan_row), (nan_row @ weight.T).argmax(dim=1))


def test_candidates_are_ordered_by_row_then_id_whatever_the_vocabulary_size():
    approx = torch.tensor([[0.0, 5.0, 4.9, 1.0, 5.0], [3.0, -1.0, 2.95, 3.0, 0.0]])
    for width in (5, 64, 65, 130):
        padded = torch.nn.functional.pad(approx, (0, width - 5), value=-10.0)
        rows, ids = CertifiedArgmax.candidates(padded, torch.tensor([4.95, 2.9]))
        assert rows.tolist() == [0, 0, 1, 1, 1] and ids.tolist() == [1, 4, 0, 2, 3]


def test_verify_tree_without_logits_gives_the_same_hidden_states(tiny_llama):
    tokens = torch.tensor([5, 9, 12, 40])
    tree = build_tree_buffers(torch.tensor([-1, 0, 0, 1]))
    outputs = []
    for with_logits in (True, False):
        cache = tree_cache()
        tiny_llama(input_ids=torch.tensor([TINY_PROMPT]), **cache_kwargs(tiny_llama, cache), use_cache=True)
        outputs.append(verify_tree(tiny_llama, cache, tokens, tree, len(TINY_PROMPT), with_logits=with_logits))
    (logits, hidden), (no_logits, hidden_again) = outputs
    assert no_logits is None and logits.shape == (4, tiny_llama.config.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden_again))
    assert torch.equal(CertifiedArgmax(tiny_llama.lm_head.weight)(hidden[-1]), logits.argmax(dim=-1))


@pytest.mark.parametrize("head_type", ["medusa", "eagle3"])
def test_greedy_decoding_through_it_equals_the_targets_own(target_and_prompt, head_type):
    """stories260K (a trained model: peaked logits, few candidates) and tiny random Llama, Qwen2, Mistral."""
    target, ids = target_and_prompt
    expected = hf_greedy(target, ids, 30)
    target = copy.deepcopy(target)
    lm = SpeculativeLM(target, make_heads(target, head_type))
    kernels = lm.use_cpu_kernels(cpu_linear="onednn", draft_linear="default", cpu_attention="auto", cpu_argmax="bf16")
    assert kernels["cpu_argmax"] == "bf16"
    calls = []
    scorer = lm.certified_argmax
    lm.certified_argmax = lambda hidden: calls.append(hidden.shape[0]) or scorer(hidden)
    assert torch.equal(lm.generate(ids, max_new_tokens=30), expected)
    assert calls and sum(calls) > len(calls)  # every round scored through it, trees of several nodes
    lm.certified_argmax = scorer
    torch.manual_seed(0)
    sampled = lm.generate(ids, max_new_tokens=8, do_sample=True)  # sampling keeps the full logits
    assert sampled.shape == (1, ids.shape[1] + 8)


@pytest.mark.parametrize("head_type", ["medusa", "eagle"])
def test_batched_greedy_through_it_equals_each_row_alone(tiny_target_factory, head_type):
    target = tiny_target_factory("llama", seed=3)
    prompts = [[1, 5, 9], [1, 7, 3, 8, 2, 11, 4], [1, 40]]
    ids, mask = left_pad(prompts)
    lm = SpeculativeLM(copy.deepcopy(target), make_heads(target, head_type))
    lm.use_certified_argmax()
    scorer, rows_scored = lm.certified_argmax, []
    lm.certified_argmax = lambda hidden: rows_scored.append(hidden.shape[0]) or scorer(hidden)
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=20, batched=True)
    assert lm.last_stats["batched_forwards"] < lm.last_stats["target_forwards"] and max(rows_scored) > 3
    for i, prompt in enumerate(prompts):
        alone = hf_greedy(target, torch.tensor([prompt]), 20, pad_token_id=0)
        assert torch.equal(out[i, ids.shape[1] :], alone[0, len(prompt) :]), f"row {i}"


@pytest.mark.parametrize(("family", "transform"), [("gemma2", "final_logit_softcapping=30.0"),
                                                   ("cohere", "logit_scale=0.0625")])
def test_targets_whose_config_caps_or_scales_logits_are_refused(tiny_target_factory, family, transform):
    """Refused from the config, not only by the numeric probe: a tiny model's logits are so small that Gemma 2's
    soft-capping (30 tanh(x / 30)) stays within the probe's tolerance, while on a real model a capped logit can tie
    where the lm_head's product does not."""
    target = tiny_target_factory(family)
    assert not wants_certified_argmax("auto", target)
    with pytest.raises(ValueError, match=rf"config transforms them \({transform}\)"):
        certified_argmax_for(target)


def test_targets_it_cannot_serve_are_refused_and_auto_leaves_them(tiny_llama, monkeypatch):
    scaled = copy.deepcopy(tiny_llama)
    scaled.lm_head.register_forward_hook(lambda module, args, out: out * 0.5 + 1.0)  # logits not lm_head(hidden) alone
    with pytest.raises(ValueError, match="logits are not lm_head"):
        certified_argmax_for(scaled)
    lm = SpeculativeLM(scaled, create_heads(scaled, "medusa"))
    monkeypatch.setattr(certified_argmax, "has_native_bf16_products", lambda: True)  # 'auto' tries it on any CPU
    assert lm.use_cpu_kernels("default", "default", "default", "auto")["cpu_argmax"] == "default"
    assert lm.certified_argmax is None
    biased = copy.deepcopy(tiny_llama)
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(biased.config.vocab_size))
    assert not wants_certified_argmax("auto", biased)
    with pytest.raises(ValueError, match="bias-free nn.Linear, got Linear with a bias"):
        certified_argmax_for(biased)
    with pytest.raises(ValueError, match="float32 CPU targets; the lm_head is torch.bfloat16"):
        certified_argmax_for(copy.deepcopy(tiny_llama).to(torch.bfloat16))
    onednn = SpeculativeLM(copy.deepcopy(tiny_llama), create_heads(tiny_llama, "medusa"))
    onednn.use_onednn_linears()
    with pytest.raises(ValueError, match=r"got OneDNNLinear .*after use_certified_argmax"):
        onednn.use_certified_argmax()
    with pytest.raises(ValueError, match=r"--cpu-argmax 'fp16'; expected one of \('default', 'bf16', 'auto'\)"):
        wants_certified_argmax("fp16", tiny_llama)
    assert wants_certified_argmax("auto", tiny_llama)  # (has_native_bf16_products patched above)
    assert wants_certified_argmax("bf16", tiny_llama) and not wants_certified_argmax("default", tiny_llama)


def test_a_verifier_without_it_takes_the_full_argmax(tiny_llama):
    verifier = DynamicTreeVerifier(tiny_llama, lambda hidden_states: hidden_states[-1])
    verifier.prefill(torch.tensor(TINY_PROMPT), 4)
    tokens, tree = torch.tensor([3, 4]), build_tree_buffers(torch.tensor([-1, 0]))
    argmax, features = verifier.verify_argmax(tokens, tree, len(TINY_PROMPT))
    assert argmax.shape == (2,) and features.shape == (2, tiny_llama.config.hidden_size)


def test_bench_records_it(tmp_path):
    from specheads import load_target

    target, _ = load_target("stories260K")
    heads = tmp_path / "heads"
    create_heads(target, "eagle3", draft_vocab_size=64, tree_depth=3, tree_top_k=2, tree_num_nodes=4).save_pretrained(heads)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    out = tmp_path / "results.json"
    argv = ["--target", "stories260K", "--heads", str(heads), "--prompts", str(prompts), "--max-new-tokens", "10",
            "--prompt-lookup", "0", "--threads", "1", "--cpu-argmax", "auto", "--out", str(out)]
    assert bench_main(argv) == 0
    results = json.loads(out.read_text())
    expected = "bf16" if has_native_bf16_products() else "default"
    assert results["environment"]["cpu_argmax"] == expected and results["greedy_identical"] is True
