"""Grouped-query SDPA for tree forwards (inference/gqa_attention.py): the same attention without repeating keys and
values, the same tokens on every decoding path, plain decoding untouched, and the CLI choice."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as transformers_sdpa

from specheads.inference import gqa_attention
from specheads.inference.gqa_attention import (
    GQA_ATTENTION,
    use_gqa_attention,
    use_sdpa_attention,
    wants_gqa_attention,
)
from specheads.inference.tree import build_tree_buffers
from specheads.inference.verify import DynamicTreeVerifier

from .conftest import TINY_PROMPT, hf_greedy, speculative_on_a_copy

pytestmark = pytest.mark.skipif(not gqa_attention.has_masked_gqa(), reason="SDPA's enable_gqa needs torch >= 2.5")


def attention_inputs(tiny_llama, query_tokens: int, cached: int = 11):
    """An attention layer of the tiny target (4 query heads, 2 key/value heads) and inputs for it, with a tree mask."""
    module = tiny_llama.model.layers[0].self_attn
    torch.manual_seed(0)
    query = torch.randn(1, 4, query_tokens, 16)
    key, value = torch.randn(1, 2, cached + query_tokens, 16), torch.randn(1, 2, cached + query_tokens, 16)
    mask = torch.zeros(1, 1, query_tokens, cached + query_tokens)
    mask[0, 0, :, cached:] = torch.full((query_tokens, query_tokens), torch.finfo(torch.float32).min).triu(1)
    if query_tokens > 2:
        mask[0, 0, -1, cached + 1] = torch.finfo(torch.float32).min  # a tree: the last node does not see node 1
    return module, query, key, value, mask


def test_masked_multi_token_attention_equals_transformers_sdpa_without_repeating_keys(tiny_llama, monkeypatch):
    module, query, key, value, mask = attention_inputs(tiny_llama, query_tokens=5)
    expected, _ = transformers_sdpa.sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)

    def no_repeat(*args):
        raise AssertionError("repeat_kv called: the keys and values were copied per query head")

    monkeypatch.setattr(transformers_sdpa, "repeat_kv", no_repeat)
    out, weights = gqa_attention.sdpa_gqa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    assert weights is None and out.shape == expected.shape == (1, 5, 4, 16)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(AssertionError, match="repeat_kv called"):  # transformers' own route does copy them here
        transformers_sdpa.sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)


@pytest.mark.parametrize("case", ["one query token", "no mask", "no key/value groups"])
def test_every_other_call_is_transformers_sdpa(tiny_llama, monkeypatch, case):
    """Plain decoding (one token), prefill (causal, no mask) and non-GQA layers take transformers' function as is."""
    module, query, key, value, mask = attention_inputs(tiny_llama, query_tokens=1 if case == "one query token" else 5)
    if case == "no mask":
        mask = None
    if case == "no key/value groups":
        module = copy.copy(module)
        module.num_key_value_groups = 1
        key, value = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    calls = []
    monkeypatch.setattr(gqa_attention, "sdpa_attention_forward", lambda *args, **kwargs: calls.append(args) or ("out", None))
    assert gqa_attention.sdpa_gqa_attention_forward(module, query, key, value, mask) == ("out", None)
    assert len(calls) == 1


def count_grouped_sdpa_calls(monkeypatch) -> list[int]:
    """Record the query length of every SDPA call made with grouped keys and values AND a mask (transformers passes
    grouped ones only without a mask)."""
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        if kwargs.get("enable_gqa") and kwargs.get("attn_mask") is not None:
            calls.append(query.shape[2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_greedy_decoding_on_grouped_attention_equals_the_targets(tiny_target_factory, family, head_type, monkeypatch):
    target = tiny_target_factory(family)
    ids = torch.tensor([TINY_PROMPT])
    expected = hf_greedy(target, ids, 24)
    lm = speculative_on_a_copy(target, head_type)
    target = lm.target
    switched = lm.use_gqa_attention()
    assert switched == 2 + (head_type != "medusa")  # the target's two layers, the EAGLE heads' decoder layer
    assert target.config._attn_implementation == GQA_ATTENTION
    grouped = count_grouped_sdpa_calls(monkeypatch)
    assert torch.equal(lm.generate(ids, max_new_tokens=24), expected)
    assert grouped and min(grouped) > 1  # the tree forwards took the grouped route
    assert torch.equal(lm.generate(ids, max_new_tokens=24, fast_path=True), expected)
    calls_before = len(grouped)
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False), expected)  # the baseline too
    assert len(grouped) == calls_before  # ... which never takes it (one token a step, causal prefill)
    assert use_sdpa_attention(target) + use_sdpa_attention(lm.heads) == switched  # undone (scripts/tree_sweep.py)
    assert target.config._attn_implementation == "sdpa"
    assert torch.equal(lm.generate(ids, max_new_tokens=24), expected)
    assert len(grouped) == calls_before  # transformers' SDPA again


def test_verification_logits_are_unchanged(tiny_llama):
    """One tree verification on grouped attention gives the logits of transformers' SDPA."""
    tokens = torch.tensor([7, 3, 11, 5, 2])
    tree = build_tree_buffers(torch.tensor([-1, 0, 0, 1, 1]))
    prompt = torch.tensor(TINY_PROMPT)
    logits = []
    for grouped in (False, True):
        target = copy.deepcopy(tiny_llama)
        if grouped:
            use_gqa_attention(target)
        verifier = DynamicTreeVerifier(target, lambda hidden_states: hidden_states[-1])
        verifier.prefill(prompt, max_new_tokens=8)
        logits.append(verifier.verify(tokens, tree, prompt.shape[0])[0])
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-6, atol=1e-6)


def test_cpu_attention_choices(tiny_llama, tiny_target_factory):
    assert wants_gqa_attention("auto", tiny_llama) and wants_gqa_attention("gqa", tiny_llama)
    assert not wants_gqa_attention("default", tiny_llama)
    assert not wants_gqa_attention("auto", tiny_target_factory("llama", num_key_value_heads=4))  # nothing to group
    eager = tiny_target_factory("llama", attn_implementation="eager")
    assert not wants_gqa_attention("auto", eager)
    assert use_gqa_attention(copy.deepcopy(eager)) == 0  # layers on another implementation are left alone
    with pytest.raises(ValueError, match=r"--cpu-attention 'flash'; expected one of \('default', 'gqa', 'auto'\)"):
        wants_gqa_attention("flash", tiny_llama)


def test_old_torch_gets_a_clear_error(tiny_llama, monkeypatch):
    monkeypatch.setattr(gqa_attention, "has_masked_gqa", lambda: False)
    assert not wants_gqa_attention("auto", tiny_llama)
    with pytest.raises(RuntimeError, match=r"grouped-query SDPA needs torch >= 2.5 \(enable_gqa\), this is torch"):
        use_gqa_attention(copy.deepcopy(tiny_llama))
