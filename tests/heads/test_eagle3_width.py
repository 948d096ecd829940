"""EAGLE-3 drafts of another width than the target's (`create_heads(..., draft_hidden_size=)`; vLLM's and SGLang's
`target_hidden_size`): their shapes and init, exact decoding on several families (eager and static drafting),
training through the TTT unroll, the checkpoint, and the errors (a training run: tests/training/test_eagle3_width_run.py)."""

from __future__ import annotations

import pytest
import torch

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads import HeadsConfig
from specheads.heads.eagle3 import layer_config_of_width, principal_directions

from .drafts import PROMPT, causal, perturbed, ttt_loss


def test_a_narrow_draft_has_the_shapes_of_its_width(stories260k):
    target, _ = stories260k  # hidden 64, 8 heads of 8, 4 key/value heads
    heads = create_heads(target, "eagle3", draft_hidden_size=32, draft_vocab_size=128)
    layer = heads.config.draft_layer_config
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == \
        (32, 4, 2, 8)
    assert layer["intermediate_size"] == round(target.config.intermediate_size / 2)
    assert heads.config.hidden_size == 64 and heads.config.draft_hidden_size == 32
    assert heads.fc.weight.shape == (32, 3 * 64)
    assert heads.layer.self_attn.q_proj.weight.shape == (32, 64)  # reads cat(embedding, feature): 2 x 32
    assert heads.embed_tokens.weight.shape == (512, 32) and heads.lm_head.weight.shape == (128, 32)
    assert "embed_tokens.weight" in heads.state_dict()  # saved: the target's embedding is 64 wide
    full = create_heads(target, "eagle3")
    assert full.embed_tokens is None and "embed_tokens.weight" not in full.state_dict()
    assert full.config.draft_hidden_size == 64


def test_a_narrow_draft_starts_from_the_targets_projected_embedding_and_lm_head(stories260k):
    target, _ = stories260k
    heads = create_heads(target, "eagle3", draft_hidden_size=32, draft_vocab_size=128)
    embedding = target.get_input_embeddings().weight
    directions = principal_directions(embedding, 32)  # (64, 32), orthonormal columns
    torch.testing.assert_close(directions.T @ directions, torch.eye(32), atol=1e-4, rtol=0)
    torch.testing.assert_close(heads.embed_tokens.weight, embedding @ directions)
    lm_head = target.get_output_embeddings().weight
    torch.testing.assert_close(heads.lm_head.weight, lm_head[heads.d2t] @ principal_directions(lm_head, 32))
    # the 32 directions keep more of the embedding than 32 of its coordinates do (they are its top singular vectors)
    kept = (embedding @ directions).norm()
    assert kept > embedding[:, :32].norm() and kept > embedding[:, 32:].norm()
    assert torch.equal(principal_directions(embedding, 32), directions)  # the same matrix every call
    # a wider draft starts from the target's coordinates, then zeros
    wide = create_heads(target, "eagle3", draft_hidden_size=96)
    torch.testing.assert_close(wide.embed_tokens.weight[:, :64], embedding)
    assert not wide.embed_tokens.weight[:, 64:].any()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
@pytest.mark.parametrize("width", [32, 96])
def test_drafts_of_another_width_give_the_target_greedy_output(tiny_target_factory, family, width):
    target = tiny_target_factory(family, **({"head_dim": 16} if family == "gemma" else {}))
    torch.manual_seed(0)
    heads = perturbed(create_heads(target, "eagle3", draft_hidden_size=width, tree_depth=3, tree_top_k=3,
                                   tree_num_nodes=6))
    lm = SpeculativeLM(target, heads)
    expected = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30), expected)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30, fast_path=True), expected)  # static drafting


def test_the_draft_really_drafts_at_its_width(stories260k):
    """The head's outputs are d wide, the next step reads them, and features of any other width are refused."""
    target, _ = stories260k
    torch.manual_seed(0)
    heads = perturbed(create_heads(target, "eagle3", draft_hidden_size=32, draft_vocab_size=128))
    features = torch.randn(1, 5, 192)
    ids, positions = torch.tensor([[1, 40, 47, 26, 37]]), torch.arange(5)[None]
    mask = causal(5)
    with torch.no_grad():
        out = heads(features, ids, positions, mask)
        assert out.shape == (1, 5, 32) and heads.logits(out).shape == (1, 5, 128)
        assert heads(out, ids, positions, mask).shape == (1, 5, 32)  # the next step reads the head's own output
        with pytest.raises(ValueError, match=r"features of width 64; expected 3\*hidden_size=192 \(target features\) "
                                             r"or the draft's width 32"):
            heads(torch.randn(1, 5, 64), ids, positions, mask)


def test_every_narrow_weight_trains_through_the_ttt_unroll(stories260k):
    target, _ = stories260k
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_hidden_size=32, draft_vocab_size=64, eagle3_fc_norm=True).train()
    ttt_loss(heads, target).loss.backward()
    assert heads.fc_norm[0].weight.shape == (64,)  # one norm per fused target layer: the target's width
    for name, parameter in heads.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in target.parameters())


def test_the_checkpoint_keeps_the_width(stories260k, tmp_path):
    target, _ = stories260k
    torch.manual_seed(0)
    heads = perturbed(create_heads(target, "eagle3", draft_hidden_size=32, draft_vocab_size=128))
    heads.save_pretrained(tmp_path)
    reloaded = load_heads(tmp_path, target=target).eval()
    torch.testing.assert_close(reloaded.embed_tokens.weight, heads.embed_tokens.weight)
    features, ids = torch.randn(1, 4, 192), torch.tensor([[1, 40, 47, 26]])
    mask = causal(4)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(features, ids, torch.arange(4)[None], mask),
                                   heads(features, ids, torch.arange(4)[None], mask))


def test_widths_that_cannot_work_are_refused_by_name(stories260k):
    target, _ = stories260k
    with pytest.raises(ValueError, match=r"draft_hidden_size=30 is invalid; expected a positive multiple of the draft "
                                         r"layer's head_dim=8 \(the target's hidden_size is 64\)"):
        create_heads(target, "eagle3", draft_hidden_size=30)
    with pytest.raises(ValueError, match="draft_hidden_size=32 applies to eagle3 heads; eagle heads predict"):
        create_heads(target, "eagle", draft_hidden_size=32)
    with pytest.raises(ValueError, match="draft_hidden_size=32 applies to eagle3 heads; medusa heads own no"):
        create_heads(target, "medusa", draft_hidden_size=32)
    with pytest.raises(ValueError, match=r"draft_layer_config.hidden_size=192 equals the fused target features' width "
                                         r"\(3 layers x hidden_size=64\)"):
        create_heads(target, "eagle3", draft_hidden_size=192)
    layer = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="draft_layer_config.hidden_size=32 differs from hidden_size=64; EAGLE heads "
                                         "predict the target's features"):
        HeadsConfig(head_type="eagle", hidden_size=64, draft_layer_config=layer)
    with pytest.raises(ValueError, match="draft_layer_config.hidden_size=0 is invalid; expected a positive integer"):
        HeadsConfig(head_type="eagle3", hidden_size=64, feature_layers=[1, 2], draft_layer_config=dict(layer, hidden_size=0))


def test_principal_directions_of_a_large_vocabulary_are_its_top_singular_vectors():
    """Summed a chunk of rows at a time (no float32 copy of a large weight): the same directions as an SVD."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40000, 12, generator=generator) * torch.linspace(3, 0.5, 12)  # distinct singular values
    directions = principal_directions(weight.to(torch.bfloat16), 5)
    top = torch.linalg.svd(weight.to(torch.bfloat16).float(), full_matrices=False).Vh[:5].T  # (12, 5)
    torch.testing.assert_close((directions.T @ top).abs(), torch.eye(5), atol=1e-3, rtol=0)


def test_key_value_heads_keep_their_group_where_they_can():
    layer = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 100}
    assert layer_config_of_width(layer, 32)["num_key_value_heads"] == 1  # groups of 4
    assert layer_config_of_width(layer, 128)["num_key_value_heads"] == 4
    odd = layer_config_of_width({**layer, "num_key_value_heads": 8}, 24)  # 3 heads, one per group
    assert (odd["num_attention_heads"], odd["num_key_value_heads"], odd["intermediate_size"]) == (3, 3, 38)
