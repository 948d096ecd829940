"""Long runs: one 2,000-token generation, and 200 calls in a row on one SpeculativeLM, without memory growth.

Memory is the process's resident set size (RSS) read from /proc; caches are rebuilt per call, so after a
warm-up RSS must stay flat. The figures are printed (pytest -s) for the record.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from specheads import create_heads
from specheads.inference.generate import SpeculativeLM

from ..conftest import build_tiny_target


def rss_mb() -> float:
    """Current resident set size of this process, in MB (Linux /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")


def test_two_thousand_tokens_in_one_call_are_exact():
    """A 2,000-token greedy generation equals the target's own, and the caches stay the right length."""
    target = build_tiny_target("llama", seed=3, max_position_embeddings=4096)
    heads = create_heads(target, "eagle", tree_depth=4, tree_top_k=3, tree_num_nodes=8)
    lm = SpeculativeLM(target, heads)
    prompt = torch.tensor([[1, 5, 9, 14]])
    out = lm.generate(prompt, max_new_tokens=2000)
    reference = target.generate(prompt, max_new_tokens=2000, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 2004)
    assert torch.equal(out, reference)
    assert lm.last_stats["new_tokens"] == 2000
    # The draft cache holds the committed positions (all but the last few tokens) plus at most one
    # round's frontier entries ((depth - 1) * top_k): it never accumulates old draft nodes.
    drafter = lm.drafter
    assert 2004 - 4 <= drafter.committed <= 2004
    assert drafter.cache.get_seq_length() <= drafter.committed + (4 - 1) * 3


def test_two_hundred_calls_do_not_grow_memory(stories260k):
    """200 generate calls in a row on one SpeculativeLM (about 3,000 rounds: untrained heads accept few drafts): RSS
    grows by less than 15 MB after warm-up, so a leak of 75 KB a call or 5 KB a round fails."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, create_heads(target, "eagle", tree_depth=4, tree_top_k=4, tree_num_nodes=12))
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    for _ in range(20):  # warm-up: allocator pools and lazy inits settle
        lm.generate(prompt, max_new_tokens=16)
    gc.collect()
    before = rss_mb()
    rounds = 0
    for _ in range(200):
        out = lm.generate(prompt, max_new_tokens=16)
        rounds += lm.last_stats["rounds"]
    gc.collect()
    after = rss_mb()
    print(f"\n200 calls x 16 tokens, {rounds} rounds: RSS {before:.1f} MB -> {after:.1f} MB ({after - before:+.1f} MB)")
    assert out.shape[1] == prompt.shape[1] + 16
    assert rounds > 2500  # the rounds a per-round leak would accumulate over
    assert after - before < 15, f"RSS grew by {after - before:.1f} MB over 200 calls ({rounds} rounds)"
