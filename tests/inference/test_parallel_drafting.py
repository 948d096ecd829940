"""P-EAGLE parallel drafting (inference/parallel_drafting.py): one head forward drafts every depth, the trees hold
each depth's top-k, and speculative outputs stay the target's own (greedy identity on several families, batched,
with prompt lookup, pruning, constraints and the fast path; the sampling law is in test_generate_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specheads import SpeculativeLM, create_heads
from specheads.heads.interop import export_heads
from specheads.inference.autotune import EAGLE_CANDIDATES, autotune_tree, tree_candidates
from specheads.inference.drafting import EagleDrafter
from specheads.inference.parallel_drafting import ParallelDrafter
from specheads.inference.tree import tree_spec

from .conftest import TINY_PROMPT, hf_greedy

NEG = torch.finfo(torch.float32).min


def parallel_heads(target, depth: int = 4, seed: int = 0, **options):
    """Fresh (untrained) parallel-drafting EAGLE-3 heads with a small tree."""
    torch.manual_seed(seed)
    tree = dict(tree_depth=depth, tree_top_k=3, tree_num_nodes=10)
    return create_heads(target, "eagle3", parallel_depth=depth, **{**tree, **options})


def test_generate_picks_the_parallel_drafter_and_the_depth_is_capped(stories260k):
    target, _ = stories260k
    lm = SpeculativeLM(target, parallel_heads(target, depth=4))
    assert type(lm.drafter) is ParallelDrafter and lm.tree_description()["depth"] == 4
    assert tree_spec(lm.tree_description()) == "4,3,10,0,0 (parallel drafting)"  # what serve / chat / bench print
    assert type(lm.drafter.fork()) is ParallelDrafter  # a batch's rows draft in parallel too
    with pytest.raises(ValueError, match="tree_depth=5 exceeds the heads' parallel_depth=4"):
        lm.configure_tree(tree_depth=5)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="draft autoregressively"):
        ParallelDrafter(create_heads(target, "eagle3"), 3, 2, 4, torch.float32)
    assert type(SpeculativeLM(target, create_heads(target, "eagle3")).drafter) is EagleDrafter
    assert create_heads(target, "eagle3", parallel_depth=3).config.tree_depth == 3  # the default tree fits


def assert_greedy_identity(target, ids) -> None:
    lm = SpeculativeLM(target, parallel_heads(target))
    out = lm.generate(ids, max_new_tokens=40)
    assert torch.equal(out, hf_greedy(target, ids, 40))
    assert lm.last_stats["target_forwards"] == lm.last_stats["rounds"] + 1


def test_untrained_parallel_heads_give_the_target_greedy_output(target_and_prompt):
    """stories260K and tiny Llama, Qwen2 and Mistral targets."""
    assert_greedy_identity(*target_and_prompt)


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])  # heads with a Llama draft layer
def test_untrained_parallel_heads_on_other_families(tiny_target_factory, family):
    assert_greedy_identity(tiny_target_factory(family), torch.tensor([TINY_PROMPT]))


def test_the_tree_holds_each_depths_top_k_of_one_forward(stories260k):
    """The drafter's pool: depth d's children are the top-k of the head's output at the (d-1)-th parallel slot of
    one forward over the committed positions + the slots (computed here by hand), the same under every parent."""
    target, tokenizer = stories260k
    heads = parallel_heads(target, depth=4, draft_vocab_size=256).eval()
    ids = tokenizer("Lily saw a big red ball", return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    features = heads.select_features(hidden)[0]  # (T, 3h)
    next_tokens = torch.cat([ids[0, 1:], torch.tensor([7])])  # x_{p+1} after each f_p; 7 plays the root
    drafter = ParallelDrafter(heads, depth=4, top_k=3, num_nodes=20, dtype=torch.float32)
    drafter.propose(features, next_tokens)
    pool = drafter.last_pool

    length, slots = features.shape[0], 3
    tokens = torch.cat([next_tokens, torch.full((slots,), heads.config.parallel_slot_token)])
    mask = torch.full((length + slots, length + slots), NEG).triu(1)[None, None]
    with torch.no_grad():
        anchors = features[-1:].expand(slots, -1)[None]  # every slot reads the root's features + its depth's offset
        out = heads(features[None], tokens[None], torch.arange(length + slots)[None], mask, DynamicCache(),
                    parallel_slots=(anchors, torch.arange(2, slots + 2)))[0]
        top = torch.topk(torch.log_softmax(heads.logits(out[length - 1 :]), dim=-1), 3, dim=-1)  # (4, 3)
    expected_tokens = heads.d2t[top.indices]
    assert torch.equal(pool.tokens[0], expected_tokens[0])
    for depth in range(2, 5):
        children = pool.tokens[depth - 1].view(3, 3)
        assert torch.equal(children, expected_tokens[depth - 1].expand(3, 3)), depth
        # scores add up along the path: each child's score is its parent's plus its depth's log-probability
        scores = pool.scores[depth - 1].view(3, 3)
        assert torch.allclose(scores[:, 0] - scores[:, 1], (top.values[depth - 1, 0] - top.values[depth - 1, 1]).expand(3))
    # the next round crops the parallel slots: the cache holds the committed positions only
    drafter.propose(features[-1:], torch.tensor([9]))
    assert drafter.committed == length + 1


def test_batches_prompt_lookup_pruning_and_early_stopping_stay_exact(stories260k):
    target, tokenizer = stories260k
    prompts = ["Once upon a time", "Tom had a red ball. Tom had a red ball. Tom"]
    heads = parallel_heads(target, depth=5, tree_min_prob=0.02, tree_stop_prob=0.05)
    lm = SpeculativeLM(target, heads)
    lm.configure_lookup(6)
    encoded = [tokenizer(text, return_tensors="pt").input_ids for text in prompts]
    for ids in encoded:
        assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))
    width = max(ids.shape[1] for ids in encoded)  # a left-padded batch: each row as it is alone
    input_ids = torch.zeros(len(encoded), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(encoded):
        input_ids[row, width - ids.shape[1] :], attention_mask[row, width - ids.shape[1] :] = ids[0], 1
    out = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20)
    for row, ids in enumerate(encoded):
        assert torch.equal(out[row, width:], hf_greedy(target, ids, 20)[0, ids.shape[1] :]), row


def test_constrained_drafting_and_the_fast_path(stories260k):
    """A banned-token processor (drafts then avoid the banned tokens per path) and the CPU fast path: exact."""
    target, tokenizer = stories260k
    ids = tokenizer("The dog ran to the", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, parallel_heads(target))
    banned = [[int(t)] for t in hf_greedy(target, ids, 6)[0, -3:]]  # tokens the target would emit
    out = lm.generate(ids, max_new_tokens=25, bad_words_ids=banned)
    assert torch.equal(out, hf_greedy(target, ids, 25, bad_words_ids=banned))
    assert torch.equal(lm.generate(ids, max_new_tokens=30, fast_path=True), hf_greedy(target, ids, 30))


@pytest.mark.parametrize("format", ["speculators", "eagle3", "eagle3-sglang"])
def test_parallel_heads_are_not_exported_as_autoregressive_ones(stories260k, tmp_path, format):
    target, _ = stories260k
    with pytest.raises(ValueError, match=f"draft in parallel .parallel_depth=4, P-EAGLE.: format '{format}'"):
        export_heads(parallel_heads(target), format, tmp_path / format)
    assert not (tmp_path / format / "model.safetensors").exists()


def test_tree_auto_caps_the_candidates_at_the_parallel_depth(tiny_target_factory):
    target, ids = tiny_target_factory("llama"), torch.tensor([TINY_PROMPT])
    lm = SpeculativeLM(target, parallel_heads(target, depth=3))
    candidates = tree_candidates(lm)
    assert max(c["tree_depth"] for c in candidates) == 3 and len(candidates) == len({str(c) for c in candidates})
    assert {c["tree_num_nodes"] for c in candidates} == {c["tree_num_nodes"] for c in EAGLE_CANDIDATES}
    report = autotune_tree(lm, [ids], max_new_tokens=8)
    assert report["trials"] and lm.tree_description()["depth"] <= 3 and type(lm.drafter) is ParallelDrafter
    assert torch.equal(lm.generate(ids, max_new_tokens=12), hf_greedy(target, ids, 12))
