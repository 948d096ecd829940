"""The batched scheme (one target forward verifies every row's tree) against the row-by-row reference.

Rows accept different lengths each round, finish at different times (EOS, including on their first
token) and keep separate committed lengths inside one rectangular cache; every row must still get
exactly what it gets alone.
"""

from __future__ import annotations

import pytest
import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference.batched import prefill_mask
from specheads.inference.kv_cache import compact_rows, tree_cache

from ..conftest import build_tiny_target
from .conftest import left_pad

PROMPTS = [[1, 5, 9], [1, 7, 3, 8, 2, 11, 4], [1, 40], [1, 6, 6, 6, 21]]


def batched_test_heads(target, head_type: str):
    """Fresh heads with a small tree; EAGLE-3 ones draft over a random 48-token vocabulary (d2t not the identity)."""
    torch.manual_seed(0)
    if head_type == "medusa":
        return create_heads(target, "medusa")
    tree = dict(tree_depth=4, tree_top_k=3, tree_num_nodes=10)
    if head_type == "eagle":
        return create_heads(target, "eagle", **tree)
    heads = create_heads(target, "eagle3", draft_vocab_size=48, **tree)
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))
    heads.set_draft_vocab(vocab[:48].sort().values, init_lm_head_from_target=True)
    return heads


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_batched_equals_rows_and_solo(family, head_type):
    """batched=True (forked drafters), batched=False and each prompt alone give the same tokens (greedy)."""
    target = build_tiny_target(family, seed=5)
    lm = SpeculativeLM(target, batched_test_heads(target, head_type))
    ids, mask = left_pad(PROMPTS)
    batched = lm.generate(ids, attention_mask=mask, max_new_tokens=30, batched=True)
    assert lm.last_stats["batched_forwards"] < lm.last_stats["target_forwards"]  # rows really shared forwards
    rows = lm.generate(ids, attention_mask=mask, max_new_tokens=30, batched=False)
    assert torch.equal(batched, rows)
    for i, prompt in enumerate(PROMPTS):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, ids.shape[1] :], alone[0, len(prompt) :]), f"row {i}"


def test_rows_finishing_at_different_times(stories260k):
    """With an EOS that rows reach at different rounds (one on its first token), rows match rows-mode output."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, create_heads(target, "eagle", tree_depth=4, tree_top_k=3, tree_num_nodes=10))
    texts = ["Once upon a time", "The dog", "Lily and Tom went to the park to play with"]
    prompts = [tokenizer(t).input_ids for t in texts]
    reference = [target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0, len(p):] for p in prompts]
    eos_first = int(reference[1][0])  # row 1 ends on its very first token
    eos_mid = int(reference[0][12])  # row 0 ends after 13 tokens (others may end wherever it appears)
    ids, mask = left_pad(prompts)
    eos = [eos_mid, eos_first]
    batched = lm.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, batched=True)
    rows = lm.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, batched=False)
    assert torch.equal(batched, rows)
    assert int(batched[1, ids.shape[1]]) == eos_first
    assert int(batched[1, ids.shape[1] + 1]) == eos_mid  # padded with the first EOS id after finishing


def test_batched_sampling_runs_and_respects_lengths(stories260k):
    """Sampling in batched mode returns the right shape and each row stops at max_new_tokens."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, create_heads(target, "medusa"))
    ids, mask = left_pad([tokenizer("Once upon a time").input_ids, tokenizer("Tom").input_ids])
    torch.manual_seed(0)
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=True, temperature=0.8, eos_token_id=[])
    assert out.shape == (2, ids.shape[1] + 25)
    assert lm.last_stats["new_tokens"] == 50


@pytest.mark.parametrize(
    ("family", "window_options"),
    [("mistral", dict(sliding_window=8)), ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))],
)
def test_sliding_window_targets_batch_past_their_window(family, window_options):
    """Rows far past a window of 8 (every layer windowed; a full layer, then a sliding one): each row's window is
    applied from its own positions, and every row equals its plain greedy answer."""
    target = build_tiny_target(family, seed=1, **window_options)
    lm = SpeculativeLM(target, create_heads(target, "medusa"))
    ids, mask = left_pad(PROMPTS)
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=24)
    assert lm.last_stats["batched_forwards"] < lm.last_stats["target_forwards"]
    for i, prompt in enumerate(PROMPTS):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(out[i, ids.shape[1] :], alone[0, len(prompt) :]), f"row {i}"


def test_prefill_mask_and_compact_rows():
    """Padding keys are hidden, padding queries see themselves; accepted paths land right after each row's prefix."""
    mask = prefill_mask(torch.tensor([3, 1]), 3, torch.float32)  # row 1 has two padding positions
    visible = mask[:, 0] == 0
    assert visible[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert visible[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    cache = tree_cache()  # 2 rows, 6 committed slots + a 5-node tree; each entry holds its own position
    positions = torch.arange(11.0)[None, None, :, None].expand(2, 1, 11, 2).contiguous()
    cache.update(positions, positions + 100, 0)
    compact_rows(cache, torch.tensor([5, 3]), [torch.tensor([0, 2]), torch.tensor([0, 1, 4])], cache_width=6)
    keys, values = cache.layers[0].keys[:, 0, :, 0], cache.layers[0].values[:, 0, :, 0]
    assert keys.shape[1] == 7  # the longest row: 5 + 2
    assert keys[0].tolist() == [0, 1, 2, 3, 4, 6, 8]  # row 0 keeps 5, then tree nodes 0 and 2
    assert keys[1, :6].tolist() == [0, 1, 2, 6, 7, 10]  # row 1 keeps 3, then nodes 0, 1 and 4
    assert torch.equal(values, keys + 100)
