"""EAGLE-3 drafts of several decoder layers (`num_layers`; vLLM's several-layer EAGLE-3): the math, the head's own
KV cache across layers, exact decoding (eager and static drafting), training through the TTT unroll (dense and
chain attention alike), the checkpoint, and vLLM speculators' layout both ways."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads import HeadsConfig
from specheads.heads.describe import describe_heads
from specheads.heads.interop import export_heads, import_heads
from specheads.training.chain_attention import use_ttt_chain_attention

from .drafts import PROMPT, causal, perturbed, ttt_loss


def test_the_layers_after_the_first_are_plain_decoder_layers_on_its_output(tiny_llama):
    torch.manual_seed(0)
    deep = perturbed(create_heads(tiny_llama, "eagle3", num_layers=3, draft_vocab_size=40))
    one = create_heads(tiny_llama, "eagle3", draft_vocab_size=40).eval()
    one.load_state_dict({k: v for k, v in deep.state_dict().items() if not k.startswith("extra_layers.")})
    assert len(deep.extra_layers) == 2 and deep.extra_layers[0].self_attn.q_proj.in_features == 64
    features, ids, positions = torch.randn(1, 6, 192), torch.randint(3, 97, (1, 6)), torch.arange(6)[None]
    with torch.no_grad():
        hidden = one(features, ids, positions, causal(6))
        rotary = deep.rotary_emb(hidden, positions)
        for layer in deep.extra_layers:
            hidden = layer(hidden, attention_mask=causal(6), position_ids=positions, position_embeddings=rotary)
        torch.testing.assert_close(deep(features, ids, positions, causal(6)), hidden)
        assert not torch.allclose(deep(features, ids, positions, causal(6)), one(features, ids, positions, causal(6)))


def test_each_layer_keeps_its_keys_in_the_heads_cache(tiny_llama):
    """Feeding positions a few at a time through the head's cache gives what one forward over all of them gives."""
    torch.manual_seed(0)
    heads = perturbed(create_heads(tiny_llama, "eagle3", num_layers=3, draft_vocab_size=40))
    features, ids, positions = torch.randn(1, 7, 192), torch.randint(3, 97, (1, 7)), torch.arange(7)[None]
    cache, parts = DynamicCache(), []
    with torch.no_grad():
        whole = heads(features, ids, positions, causal(7))
        for start, end in ((0, 3), (3, 4), (4, 7)):
            mask = torch.zeros(1, 1, end - start, end)
            mask[..., start:] = causal(end - start)
            parts.append(heads(features[:, start:end], ids[:, start:end], positions[:, start:end], mask, cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), whole)
    assert len(cache.layers) == 3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
@pytest.mark.parametrize("layers_and_width", [(2, None), (3, 32)])
def test_several_layer_drafts_give_the_target_greedy_output(tiny_target_factory, family, layers_and_width):
    num_layers, width = layers_and_width
    target = tiny_target_factory(family, **({"head_dim": 16} if family == "qwen3" else {}))
    torch.manual_seed(0)
    heads = perturbed(create_heads(target, "eagle3", num_layers=num_layers, draft_hidden_size=width, tree_depth=3,
                                   tree_top_k=3, tree_num_nodes=6))
    lm = SpeculativeLM(target, heads)
    expected = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30), expected)
    eager_tau = lm.last_stats["mean_accepted"]
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30, fast_path=True), expected)  # static drafting
    assert lm.last_stats["mean_accepted"] == pytest.approx(eager_tau)  # the static cache holds every layer alike


def test_every_layer_trains_through_the_ttt_unroll_with_dense_and_chain_attention(tiny_llama):
    torch.manual_seed(0)
    dense = create_heads(tiny_llama, "eagle3", num_layers=2, draft_vocab_size=40).train()
    chain = copy.deepcopy(dense)
    use_ttt_chain_attention(chain)
    losses = [ttt_loss(h, tiny_llama) for h in (dense, chain)]
    assert float(losses[1].loss) == pytest.approx(float(losses[0].loss), rel=1e-5)
    for loss in losses:
        loss.loss.backward()
    for (name, a), b in zip(dense.named_parameters(), chain.parameters()):
        assert a.grad is not None and a.grad.abs().sum() > 0, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_checkpoint_and_speculators_keep_the_layers_and_the_other_formats_refuse(stories260k, tmp_path):
    target, _ = stories260k
    torch.manual_seed(0)
    heads = perturbed(create_heads(target, "eagle3", num_layers=2, draft_vocab_size=128))
    heads.save_pretrained(tmp_path / "heads")
    reloaded = load_heads(tmp_path / "heads", target=target)
    assert reloaded.config.num_layers == 2 and describe_heads(tmp_path / "heads")["draft_layers"] == 2
    torch.testing.assert_close(reloaded.extra_layers[0].mlp.up_proj.weight, heads.extra_layers[0].mlp.up_proj.weight)
    export_heads(tmp_path / "heads", "speculators", tmp_path / "vllm")
    written = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert written["transformer_layer_config"]["num_hidden_layers"] == 2
    tensors = load_file(tmp_path / "vllm" / "model.safetensors")
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.input_layernorm.weight"} <= set(tensors)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (64, 64)  # the stream alone, not [embedding; stream]
    # vLLM builds a hidden_norm in every layer and reads only the first's: a file holding the others imports
    tensors["layers.1.hidden_norm.weight"] = torch.ones(64)
    save_file(tensors, str(tmp_path / "vllm" / "model.safetensors"))
    back = import_heads(tmp_path / "vllm", target=target, out_dir=tmp_path / "back")
    assert back.config.num_layers == 2
    features, ids = torch.randn(1, 5, 192), torch.tensor([[1, 40, 47, 26, 37]])
    with torch.no_grad():
        torch.testing.assert_close(back(features, ids, torch.arange(5)[None], causal(5)),
                                   heads(features, ids, torch.arange(5)[None], causal(5)))
    for fmt in ("eagle3", "eagle3-sglang"):
        with pytest.raises(ValueError, match=f"format '{fmt}' holds one decoder layer, but these heads have num_layers=2"):
            export_heads(tmp_path / "heads", fmt, tmp_path / fmt)


def test_eagle_heads_hold_one_layer():
    with pytest.raises(ValueError, match="num_layers=2 is set for head_type='eagle'; EAGLE heads hold one decoder layer"):
        HeadsConfig(head_type="eagle", hidden_size=64, num_layers=2,
                    draft_layer_config={"model_type": "llama", "hidden_size": 64})

