"""DFlash block drafting (heads/dflash.py, inference/dflash_drafting.py): one drafter forward scores every depth, the
cached context equals a full recompute, trained heads get long drafts accepted, and outputs stay the target's own
(greedy identity on several families, batched, with prompt lookup and constraints; the sampling law is tested in
test_generate_sampling.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads.describe import describe_heads
from specheads.heads.interop import export_heads
from specheads.inference.dflash_drafting import DFlashDrafter
from specheads.inference.kv_cache import tree_cache
from specheads.inference.tree import tree_spec
from specheads.training.config import LossSection
from specheads.training.data import collate
from specheads.training.dflash_loss import block_anchors, block_attention_mask, dflash_loss
from specheads.training.draft_vocab import eagle_heads_with_draft_vocab
from specheads.training.train import _HeadsView

from .conftest import TINY_PROMPT, hf_greedy

STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends.",
    "Tom had a big red ball. He liked to throw the ball to his dog. The dog ran fast and brought the ball back.",
    "One day, a cat saw a bird in the tree. The cat wanted to catch the bird, but the bird flew away.",
    "Sam and his mom went to the store. They bought apples and milk. Sam was happy and said thank you to his mom.",
]


def dflash_heads(target, seed: int = 0, **options):
    """Fresh (untrained) DFlash heads with a small tree."""
    torch.manual_seed(seed)
    tree = dict(tree_depth=4, tree_top_k=3, tree_num_nodes=10)
    return create_heads(target, "dflash", **{**tree, **options})


@pytest.fixture(scope="module")
def trained_dflash(stories260k):
    """DFlash heads (block of 6) trained until they know these stories, which are the target's own greedy text (each
    story's first words make the prompt, the target writes the rest); ~10 s."""
    target, tokenizer = stories260k
    heads = dflash_heads(target, block_size=6, feature_layers=[1, 3, 4], tree_depth=5, tree_top_k=2, tree_num_nodes=8)
    prompts = [tokenizer(text, return_tensors="pt").input_ids[:, :8] for text in STORIES]
    rows = [hf_greedy(target, ids, 56)[0].tolist() for ids in prompts]
    batch = collate([{"input_ids": row, "loss_mask": [0] * 8 + [1] * (len(row) - 8)} for row in rows])
    with torch.no_grad():
        out = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    features = heads.select_features(out.hidden_states)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2, betas=(0.9, 0.95))
    heads.train()
    for _ in range(220):
        loss = dflash_loss(_HeadsView(heads, heads), features, out.logits, batch["input_ids"], batch["attention_mask"],
                           batch["loss_mask"], LossSection(dflash_blocks=0))
        optimizer.zero_grad()
        loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 0.5)
        optimizer.step()
    heads.eval()
    assert loss.metrics["acc_depth1"] > 0.8 and loss.metrics["sim_tau"] > 3, loss.metrics
    return heads, prompts


def test_create_heads_sizes_the_block_and_caps_the_trees(stories260k):
    target, _ = stories260k
    heads = create_heads(target, "dflash")
    config = heads.config
    assert (config.block_size, config.num_layers, config.tree_depth) == (8, 1, 7)
    assert config.draft_layer_config["model_type"] == "qwen3" and len(heads.layers) == 1
    assert config.feature_layers and all(0 < i <= 5 for i in config.feature_layers)
    assert config.tree_defaults("cpu")["tree_num_nodes"] == 8  # a small tree on CPUs by default
    small = create_heads(target, "dflash", block_size=4, tree_top_k=3)
    assert small.config.tree_depth == 3 and small.config.tree_defaults("cpu")["tree_top_k"] == 3  # a given tree wins
    lm = SpeculativeLM(target, dflash_heads(target))
    assert type(lm.drafter) is DFlashDrafter and type(lm.drafter.fork()) is DFlashDrafter
    assert tree_spec(lm.tree_description()).endswith("(block drafting)")
    with pytest.raises(ValueError, match="tree_depth=8 exceeds what the heads' block of 8 drafts"):
        lm.configure_tree(tree_depth=8)
    with pytest.raises(ValueError, match="HeadsConfig.block_size=1 is invalid; expected an integer >= 2"):
        create_heads(target, "dflash", block_size=1)
    with pytest.raises(ValueError, match="HeadsConfig.block_mask_token=512 is invalid"):
        create_heads(target, "dflash", block_mask_token=512)
    with pytest.raises(ValueError, match="HeadsConfig.block_size=8 is invalid; expected 0 .block drafting is DFlash's"):
        create_heads(target, "eagle3", block_size=8)
    with pytest.raises(ValueError, match="draft_layer='llama' applies to EAGLE heads; dflash heads hold Qwen3 layers"):
        create_heads(target, "dflash", draft_layer="llama")


def test_the_cached_context_equals_a_full_recompute(stories260k):
    """Two rounds of the drafter (context keys / values cached, the first round's block cropped) score the same depths as one forward
    over the whole context and the block with no cache; the tree holds each depth's top-k of that forward."""
    target, tokenizer = stories260k
    heads = dflash_heads(target).eval()
    ids = tokenizer("Lily saw a big red ball and she", return_tensors="pt").input_ids
    with torch.no_grad():
        features = heads.select_features(target(ids, output_hidden_states=True).hidden_states)[0]  # (T, n*h)
    drafter = DFlashDrafter(heads, depth=4, top_k=3, num_nodes=40, dtype=torch.float32)
    length = features.shape[0]
    drafter.propose(features[: length - 3], ids[0, 1 : length - 2])
    drafter.propose(features[length - 3 :], torch.cat([ids[0, length - 2 :], torch.tensor([7])]))  # 7 plays the root
    assert drafter.committed == length
    block = torch.tensor([[7] + [heads.config.block_mask_token] * 7])
    with torch.no_grad():
        out = heads(features[None], block, torch.arange(length)[None], (length + torch.arange(8))[None], None, None)[0]
        top = torch.topk(torch.log_softmax(heads.logits(out[1:5]), dim=-1), 3, dim=-1)
    pool = drafter.last_pool  # (untrained heads: near ties, so compared as sets and scores within float error)
    torch.testing.assert_close(pool.scores[0], top.values[0], atol=1e-5, rtol=0)
    for depth in range(1, 5):
        children = pool.tokens[depth - 1].view(-1, 3)  # every parent has the same children: its depth's top-3
        assert all(set(row.tolist()) == set(top.indices[depth - 1].tolist()) for row in children), depth
        steps = pool.scores[depth - 1].view(-1, 3) - (pool.scores[depth - 2].max() if depth > 1 else 0)
        torch.testing.assert_close(steps.sort(dim=-1, descending=True).values[0], top.values[depth - 1], atol=1e-5,
                                   rtol=0)
    # the cache holds the context and this round's block, at their positions; a fresh cache gives the same keys
    cache = tree_cache()
    with torch.no_grad():
        heads(features[None], block, torch.arange(length)[None], (length + torch.arange(8))[None], None, cache)
    torch.testing.assert_close(drafter.cache.layers[0].keys, cache.layers[0].keys, atol=1e-5, rtol=0)


def test_training_anchors_and_masks():
    """Anchors sit where a block predicts trained tokens (never at 0 or in padding), at most `max_blocks` a row,
    and the same for the same batch; each block sees the context before its anchor and itself."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
    ids = torch.arange(14).view(2, 7)
    anchors = block_anchors(loss_mask, attention, 3, 0, ids)
    assert anchors.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1]]  # 5 predicts x_6, x_7: untrained
    few = block_anchors(loss_mask, attention, 3, 2, ids)
    assert torch.equal(few, block_anchors(loss_mask, attention, 3, 2, ids)) and (few[0] >= 1).all()
    assert set(few[0].tolist()) <= {1, 2, 3, 4} and few[0, 0] < few[0, 1]
    mask = block_attention_mask(torch.tensor([[2, -1]]), torch.ones(1, 4, dtype=torch.long), 2)[0, 0]  # (4, 4 + 4)
    assert mask.int().tolist() == [[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0],
                                   [0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]


def test_trained_heads_get_long_drafts_accepted_and_stay_exact(stories260k, trained_dflash):
    """What training taught (teacher-forced) is what drafting reads: the stories' continuations are accepted several
    tokens a round, alone, batched and resumed from a chat's kept cache; outputs are the target's own."""
    target, _ = stories260k
    heads, prompts = trained_dflash
    lm = SpeculativeLM(target, heads)
    accepted = []
    for ids in prompts:
        assert torch.equal(lm.generate(ids, max_new_tokens=48), hf_greedy(target, ids, 48))
        accepted.append(lm.last_stats["mean_accepted"])
    assert sum(accepted) / len(accepted) > 2.5, accepted
    batch = torch.cat(prompts)  # the four prompts have 8 tokens each
    out = lm.generate(batch, max_new_tokens=32)
    for row, ids in enumerate(prompts):
        assert torch.equal(out[row : row + 1], hf_greedy(target, ids, 32)), row


def test_untrained_heads_give_the_target_greedy_output(target_and_prompt):
    """stories260K and tiny Llama, Qwen2 and Mistral targets."""
    target, ids = target_and_prompt
    lm = SpeculativeLM(target, dflash_heads(target))
    assert torch.equal(lm.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert lm.last_stats["target_forwards"] == lm.last_stats["rounds"] + 1


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])
def test_untrained_heads_on_other_families(tiny_target_factory, family):
    target, ids = tiny_target_factory(family), torch.tensor([TINY_PROMPT])
    assert torch.equal(SpeculativeLM(target, dflash_heads(target)).generate(ids, max_new_tokens=30),
                       hf_greedy(target, ids, 30))


def test_prompt_lookup_constraints_and_the_fast_path_stay_exact(stories260k):
    target, tokenizer = stories260k
    ids = tokenizer("Tom had a red ball. Tom had a red ball. Tom", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, dflash_heads(target, tree_min_prob=0.02, tree_stop_prob=0.05))
    lm.configure_lookup(6)
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))
    banned = [[int(t)] for t in hf_greedy(target, ids, 6)[0, -3:]]  # tokens the target would emit
    out = lm.generate(ids, max_new_tokens=25, bad_words_ids=banned)
    assert torch.equal(out, hf_greedy(target, ids, 25, bad_words_ids=banned))
    assert torch.equal(lm.generate(ids, max_new_tokens=30, fast_path=True), hf_greedy(target, ids, 30))


def test_save_load_round_trip(stories260k, trained_dflash, tmp_path):
    target, _ = stories260k
    heads, prompts = trained_dflash
    heads.save_pretrained(tmp_path / "dflash")
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert config["head_type"] == "dflash" and config["block_size"] == 6
    summary = describe_heads(tmp_path / "dflash")  # `specheads info`
    assert summary["block_drafting"] == {"block_size": 6, "mask_token": heads.config.block_mask_token,
                                         "feature_layers": [1, 3, 4]} and summary["draft_layers"] == 1
    loaded = load_heads(tmp_path / "dflash", target=target)
    ids = prompts[0]
    with torch.no_grad():
        features = heads.select_features(target(ids, output_hidden_states=True).hidden_states)
        args = (features, torch.tensor([[5, 3, 3, 3, 3, 3]]), torch.arange(8)[None], (8 + torch.arange(6))[None])
        assert torch.equal(heads.logits(heads(*args)), loaded.logits(loaded(*args)))
    lm = SpeculativeLM.from_pretrained(target="stories260K", heads=tmp_path / "dflash")
    assert torch.equal(lm.generate(ids, max_new_tokens=24), hf_greedy(target, ids, 24))
    assert lm.last_stats["mean_accepted"] > 2


def test_a_draft_vocabulary_drafts_over_its_rows_only_and_stays_exact(stories260k, trained_dflash, tmp_path):
    """`eagle_draft_vocab_size` on DFlash heads (heads/target_rows_vocab.py): the drafter scores only the d2t rows of
    the target's lm_head (the same logits there), trees hold those tokens only, outputs stay the target's, and the
    vocabulary is saved with the heads and left out of the z-lab export."""
    target, _ = stories260k
    heads, prompts = trained_dflash
    rows = torch.arange(0, 512, 2)  # every other token: the stories' next tokens are often outside
    reduced = eagle_heads_with_draft_vocab(heads, rows)
    reduced.attach_target(target)
    assert reduced.draft_vocab_size == 256 and torch.equal(reduced.d2t, rows)
    hidden = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(reduced.draft_logits(hidden), heads.logits(hidden)[:, rows])
    lm = SpeculativeLM(target, reduced.eval())
    for ids in prompts[:2]:
        assert torch.equal(lm.generate(ids, max_new_tokens=32), hf_greedy(target, ids, 32))
        assert all(int(t) % 2 == 0 for t in lm.drafter.last_pool.tokens[0])  # drafted from the vocabulary only
    reduced.save_pretrained(tmp_path / "reduced")
    assert torch.equal(load_heads(tmp_path / "reduced", target=target).d2t, rows)
    export_heads(reduced, "dflash", tmp_path / "zlab")  # z-lab drafters score the whole vocabulary: d2t left out
    assert "d2t" not in load_file(tmp_path / "zlab" / "model.safetensors")


class _ScriptedBlocks:
    """A stand-in for DFlash heads whose block outputs are logits written in advance: depth 1 always drafts token 3,
    depth 2 token 2 (`logits` is the identity), to test the loss's bookkeeping alone."""

    config = type("Config", (), {"block_size": 3, "block_mask_token": 0})()

    def __call__(self, features, block_ids, context_positions, block_positions, mask):
        batch, width = block_ids.shape
        out = torch.zeros(batch, width, 4)
        out[:, 1::3, 3] = 5.0  # block position 1 (depth 1) -> token 3
        out[:, 2::3, 2] = 5.0  # block position 2 (depth 2) -> token 2
        return out.requires_grad_()

    def logits(self, hidden):
        return hidden


def test_accept_until_fail_trains_a_depth_only_after_right_drafts():
    """`loss.dflash_accept_until_fail`: depth 2 trains only in the blocks whose depth-1 draft was right. Blocks anchor
    at 1..5; depth 1 (token 3) is right at anchors 2 and 4, where depth 2 (token 2) is right too, and wrong at 1 and 3."""
    ids = torch.tensor([[3, 3, 2, 3, 2, 3, 2]])
    target_logits = torch.nn.functional.one_hot(torch.cat([ids[:, 1:], ids[:, :1]], 1), 4).float() * 9  # argmax: next
    mask = torch.ones_like(ids)
    args = (_ScriptedBlocks(), torch.zeros(1, 7, 4), target_logits, ids, mask, mask)
    plain = dflash_loss(*args, LossSection(dflash_blocks=0, labels="tokens"))
    auf = dflash_loss(*args, LossSection(dflash_blocks=0, labels="tokens", dflash_accept_until_fail=True))
    right, wrong = math.log(math.exp(5) + 3) - 5, math.log(math.exp(5) + 3)  # cross-entropies of the two cases
    assert plain.metrics["loss_depth2"] == pytest.approx((2 * right + 2 * wrong) / 4)  # anchors 1-4 (5: past the end)
    assert auf.metrics["loss_depth2"] == pytest.approx(right)  # anchors 2 and 4 only
    assert auf.metrics["loss_depth1"] == plain.metrics["loss_depth1"] and plain.metrics["acc_depth2"] == 0.5
