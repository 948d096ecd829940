"""Speculative generation with EAGLE-3 heads is token-identical to the target's greedy generate.

Untrained heads with a reduced, shuffled draft vocabulary (drafts mostly rejected), and an oracle-ish setup: the
draft vocabulary holds exactly the tokens of the target's greedy continuation and the tree is wide enough to hold
every pair of them, so each round accepts two drafted tokens whatever the untrained head ranks first. Only a
correct draft-id -> target-id mapping (d2t) gets those drafts accepted.
"""

from __future__ import annotations

import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference.autotune import autotune_tree

from .conftest import TINY_PROMPT, hf_greedy


def shuffled_vocab_heads(target, draft_vocab_size: int, seed: int = 0, **options):
    """Untrained EAGLE-3 heads whose draft vocabulary is a random subset of the target's (d2t is not the identity)."""
    torch.manual_seed(seed)
    heads = create_heads(target, "eagle3", draft_vocab_size=draft_vocab_size, **options)
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    heads.set_draft_vocab(vocab[:draft_vocab_size].sort().values, init_lm_head_from_target=True)
    return heads


def test_untrained_heads_give_the_target_greedy_output(target_and_prompt):
    target, ids = target_and_prompt
    heads = shuffled_vocab_heads(
        target, target.config.vocab_size // 2, tree_depth=4, tree_top_k=4, tree_num_nodes=12
    )
    lm = SpeculativeLM(target, heads)
    out = lm.generate(ids, max_new_tokens=40)
    assert torch.equal(out, hf_greedy(target, ids, 40))
    stats = lm.last_stats
    assert stats["new_tokens"] == 40 and stats["target_forwards"] == stats["rounds"] + 1


def test_full_draft_vocabulary_and_default_tree(stories260k):
    """draft_vocab_size = vocab_size (d2t the identity) with the checkpoint's default dynamic tree."""
    target, tokenizer = stories260k
    ids = tokenizer("Lily saw a bird", return_tensors="pt").input_ids
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3")
    assert heads.config.draft_vocab_size == 512
    assert torch.equal(
        SpeculativeLM(target, heads).generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30)
    )


def test_a_draft_vocabulary_of_the_continuation_accepts_two_tokens_per_round(target_and_prompt):
    """Oracle-ish: every round accepts 2 drafted tokens (tau = 3), and the output is still the greedy one."""
    target, ids = target_and_prompt
    n = 30
    expected = hf_greedy(target, ids, n + 4)  # a few more: the last round may draft past n
    vocab = torch.unique(expected[0, ids.shape[1] :])  # sorted, distinct target ids
    k = vocab.shape[0]
    assert 1 < k < target.config.vocab_size // 2, "a small, non-trivial draft vocabulary"
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=k)
    heads.set_draft_vocab(vocab, init_lm_head_from_target=True)
    # depth 1 holds all k draft tokens, depth 2 all k*k pairs: the right two are always in the tree
    lm = SpeculativeLM(target, heads, tree_depth=2, tree_top_k=k, tree_num_nodes=k + k * k)
    out = lm.generate(ids, max_new_tokens=n)
    assert torch.equal(out, expected[:, : ids.shape[1] + n])
    stats = lm.last_stats
    assert stats["accepted_per_depth"][:2] == [1.0, 1.0]
    assert stats["target_forwards"] == 1 + -(-(n - 1) // 3)  # prefill + ceil((n - 1) / 3) rounds
    assert stats["mean_accepted"] > 2.5


def test_autotune_skips_trees_wider_than_the_draft_vocabulary(tiny_llama):
    """`--tree auto` with EAGLE-3 heads: candidates whose top_k exceeds the draft vocabulary are not tried."""
    heads = shuffled_vocab_heads(tiny_llama, 6)
    lm = SpeculativeLM(tiny_llama, heads, tree_top_k=4)
    report = autotune_tree(lm, [torch.tensor([TINY_PROMPT])], max_new_tokens=8)
    assert report["trials"] and all(t["candidate"]["tree_top_k"] <= 6 for t in report["trials"])
    assert lm.tree_description() == report["chosen"] and lm.drafter.top_k <= 6
    ids = torch.tensor([TINY_PROMPT])
    assert torch.equal(lm.generate(ids, max_new_tokens=12), hf_greedy(tiny_llama, ids, 12))
