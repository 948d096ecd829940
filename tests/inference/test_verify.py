"""Tree verification: ONE target forward over a tree gives, at every node, the logits of its path run alone."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.kv_cache import cache_length
from specheads.inference.tree import build_tree_buffers
from specheads.inference.verify import DynamicTreeVerifier, last_logits_only, tree_attention_mask, verify_tree

#           0
#        /  |  \
#       1   2   3
#      / \      |
#     4   5     6
#     |         |
#     7         8
#     |
#     9
PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4, 6, 7]


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]


@torch.no_grad()
def check_tree_logits_match_sequential(
    target, prefix: list[int], parents: list[int], tokens: list[int]
) -> None:
    cache = DynamicCache()
    target(input_ids=torch.tensor([prefix]), **cache_kwargs(target, cache), use_cache=True)
    tree = build_tree_buffers(torch.tensor(parents), dtype=target.dtype)
    logits, hidden_states = verify_tree(target, cache, torch.tensor(tokens), tree, len(prefix))
    num_states = target.config.num_hidden_layers + 1
    assert logits.shape == (len(parents), target.config.vocab_size)
    assert len(hidden_states) == num_states
    assert all(h.shape == (len(parents), target.config.hidden_size) for h in hidden_states)
    for node in range(len(parents)):
        sequence = prefix + [tokens[i] for i in path_to(parents, node)]
        out = target(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        torch.testing.assert_close(
            logits[node], out.logits[0, -1], atol=1e-4, rtol=0, msg=f"logits of node {node}"
        )
        for layer in range(num_states):
            torch.testing.assert_close(
                hidden_states[layer][node],
                out.hidden_states[layer][0, -1],
                atol=1e-4,
                rtol=0,
                msg=f"hidden state {layer} of node {node}",
            )


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_tree_logits_equal_sequential_logits_tiny_targets(tiny_target_factory, family):
    """Tiny Llama / Qwen2 / Mistral: logits and hidden states of every node match its path run alone."""
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 97, (7,), generator=generator).tolist()
    tokens = torch.randint(0, 97, (len(PARENTS),), generator=generator).tolist()
    check_tree_logits_match_sequential(tiny_target_factory(family), prefix, PARENTS, tokens)


def test_tree_logits_equal_sequential_logits_stories260k(stories260k):
    """The embedded real target: the same, with duplicate sibling tokens and a one-token prefix."""
    target, _ = stories260k
    tokens = [403, 407, 407, 261, 378, 261, 42, 42, 99, 7]  # siblings 1 and 2 share a token
    check_tree_logits_match_sequential(target, [1], PARENTS, tokens)
    check_tree_logits_match_sequential(target, [1, 403, 407, 261, 378, 260], PARENTS, tokens)


def test_verify_appends_the_whole_tree_to_the_cache(tiny_llama):
    """After verification the cache holds prefix + N positions (compaction happens later)."""
    cache = DynamicCache()
    tiny_llama(input_ids=torch.tensor([[5, 6, 7]]), **cache_kwargs(tiny_llama, cache), use_cache=True)
    tree = build_tree_buffers(torch.tensor(PARENTS))
    verify_tree(tiny_llama, cache, torch.arange(len(PARENTS)), tree, 3)
    assert cache.get_seq_length() == 3 + len(PARENTS)


def test_tree_attention_mask_layout():
    """Every node sees the whole prefix, then exactly its ancestors and itself."""
    tree = build_tree_buffers(torch.tensor([-1, 0, 0, 1]))
    mask = tree_attention_mask(tree, prefix_length=2)
    assert mask.shape == (1, 1, 4, 6)
    assert bool((mask[0, 0, :, :2] == 0).all())
    assert torch.equal(mask[0, 0, :, 2:] == 0, tree.ancestors)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@torch.no_grad()
def test_prefill_keeps_only_the_last_logits_and_every_feature(tiny_target_factory, family):
    """`DynamicTreeVerifier.prefill` asks the target for the last position's logits only (`logits_to_keep=1`) and
    returns exactly a full forward's last logits and all positions' features, on a growing cache of the prompt."""
    target = tiny_target_factory(family)
    assert last_logits_only(target) == {"logits_to_keep": 1}
    prompt = torch.tensor([1, 17, 5, 60, 33, 8])
    verifier = DynamicTreeVerifier(target, lambda hidden_states: hidden_states[-1])
    last, features = verifier.prefill(prompt, max_new_tokens=4)
    full = target(input_ids=prompt[None], output_hidden_states=True)
    torch.testing.assert_close(last, full.logits[0, -1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(features, full.hidden_states[-1][0], atol=1e-5, rtol=0)
    assert cache_length(verifier.cache) == prompt.shape[0]


def test_last_logits_only_is_empty_for_a_forward_without_logits_to_keep():
    """A model whose forward does not declare `logits_to_keep` is called as before (all logits)."""

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False, output_hidden_states=False):
            raise AssertionError("not called")

    assert last_logits_only(NoKeep()) == {}
