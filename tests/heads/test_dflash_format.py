"""z-lab's DFlash drafter format (heads/format_dflash.py): a folder laid out as z-lab's released drafters imports as
DFlash heads whose block outputs equal DFlash's equations computed here from the raw tensors; export and import
round-trip; variants these heads do not run are refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specheads import SpeculativeLM, create_heads
from specheads.heads.describe import describe_heads
from specheads.heads.interop import detect_format, export_heads, import_heads

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 8  # stories260K's attention shape, kept by the drafter


def zlab_folder(folder, target, layers: int = 2, **config_extra):
    """A DFlash drafter for stories260K (hidden 64, 5 layers) as z-lab writes one: config.json + random weights."""
    h, inter = target.config.hidden_size, 96
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "vocab_size": 512,
        "max_position_embeddings": 512, "hidden_act": "silu", "attention_bias": False, "block_size": 4,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2, 3]}, "num_target_layers": 5,
        "layer_types": ["full_attention"] * layers, "tie_word_embeddings": False, "dtype": "float32", **config_extra,
    }
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=generator) * scale

    tensors = {"fc.weight": rand(h, 3 * h), "hidden_norm.weight": 1 + rand(h), "norm.weight": 1 + rand(h)}
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, h), p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, h),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, h), p + "self_attn.o_proj.weight": rand(h, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM), p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
        })
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions):  # (T, n, d), interleaving-free halves as Qwen3
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = positions[:, None].float() * inv[None]  # (T, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin


def reference_block(t, target_hidden, embeddings, context_positions, block_positions):
    """DFlash's drafter forward, from the raw tensors: the context is fused once (fc, hidden_norm) and enters every
    layer as keys / values only; the block's queries see the context and the whole block."""
    context = rms(target_hidden @ t["fc.weight"].T, t["hidden_norm.weight"])  # (C, h)
    x, layer = embeddings, 0
    positions = torch.cat([context_positions, block_positions])
    while f"layers.{layer}.input_layernorm.weight" in t:
        p = f"layers.{layer}."
        normed = rms(x, t[p + "input_layernorm.weight"])
        both = torch.cat([context, normed])
        q = rms((normed @ t[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, HEAD_DIM), t[p + "self_attn.q_norm.weight"], 1e-5)
        k = rms((both @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM), t[p + "self_attn.k_norm.weight"], 1e-5)
        v = (both @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = rope(q, block_positions), rope(k, positions)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        weights = torch.softmax(torch.einsum("qnd,knd->nqk", q, k) / math.sqrt(HEAD_DIM), -1)
        attended = torch.einsum("nqk,knd->qnd", weights, v).reshape(x.shape[0], -1)
        x = x + attended @ t[p + "self_attn.o_proj.weight"].T
        m = rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        layer += 1
    return rms(x, t["norm.weight"])


def test_a_zlab_drafter_imports_and_computes_dflash_equations(stories260k, tmp_path):
    target, tokenizer = stories260k
    tensors = zlab_folder(tmp_path / "zlab", target)
    assert detect_format(tmp_path / "zlab") == "dflash"
    heads = import_heads(tmp_path / "zlab", target=target, out_dir=tmp_path / "ours")
    config = heads.config
    assert (config.head_type, config.block_size, config.block_mask_token, config.num_layers) == ("dflash", 4, 3, 2)
    assert config.feature_layers == [1, 3, 4] and config.tree_depth == 3  # target_layer_ids + 1; a block of 4
    ids = tokenizer("Lily saw a big red ball", return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        features = heads.select_features(hidden)  # (1, T, 3h): hidden_states[1], [3], [4]
        torch.testing.assert_close(features, torch.cat([hidden[i + 1] for i in (0, 2, 3)], -1))
        length = ids.shape[1]
        block = torch.tensor([[int(ids[0, -1]), 3, 3, 3]])
        block_positions = length + torch.arange(4)
        ours = heads(features, block, torch.arange(length)[None], block_positions[None])[0]
        expected = reference_block(tensors, features[0], target.get_input_embeddings()(block)[0], torch.arange(length),
                                   block_positions)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
    lm = SpeculativeLM(target, heads)
    assert torch.equal(lm.generate(ids, max_new_tokens=20), target.generate(ids, max_new_tokens=20, do_sample=False))


def test_a_zlab_repo_loads_by_hub_id_as_it_is(stories260k, tmp_path, offline_hub_cache):
    """`--heads z-lab/...` works as vLLM's `--speculative-config` model does: the repository's own files, converted
    in memory (an offline Hub cache built by the test)."""
    target, tokenizer = stories260k
    tensors = zlab_folder(tmp_path / "zlab", target)
    offline_hub_cache.publish(tmp_path / "zlab", "z-lab/stories260K-DFlash-b4")
    lm = SpeculativeLM.from_pretrained(target="stories260K", heads="z-lab/stories260K-DFlash-b4")
    assert lm.heads.config.head_type == "dflash" and lm.heads.config.feature_layers == [1, 3, 4]
    assert torch.equal(lm.heads.fc.weight, tensors["fc.weight"])
    summary = describe_heads("z-lab/stories260K-DFlash-b4")  # `specheads info`: what --heads will read, no target needed
    assert (summary["kind"], summary["format"], summary["head_type"], summary["block_size"]) == ("foreign", "dflash",
                                                                                                "dflash", 4)
    ids = tokenizer("Tom had a ball", return_tensors="pt").input_ids
    assert torch.equal(lm.generate(ids, max_new_tokens=16), target.generate(ids, max_new_tokens=16, do_sample=False))


def test_export_then_import_round_trips(stories260k, tmp_path):
    target, _ = stories260k
    torch.manual_seed(0)
    heads = create_heads(target, "dflash", num_layers=2, block_size=6, feature_layers=[1, 3, 4])
    export_heads(heads, "dflash", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": heads.config.block_mask_token, "target_layer_ids": [0, 2, 3]}
    assert config["block_size"] == 6 and config["num_hidden_layers"] == 2
    back = import_heads(tmp_path / "out", target=target)
    assert back.config.feature_layers == [1, 3, 4] and back.config.block_size == 6
    for name, tensor in heads.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize(("extra", "message"), [
    ({"architectures": ["DFlash2DraftModel"]}, "a DFlash variant these heads do not run"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [0], "final_logit_softcapping": 20.0}},
     "final_logit_softcapping=20.0 is not run"),
    ({"layer_types": ["sliding_attention", "sliding_attention"]}, "sliding-window or causal drafter layers"),
    ({"dflash_config": {"mask_token_id": 3}}, "target_layer_ids=None should be a list"),
])
def test_variants_it_cannot_run_are_refused_by_name(stories260k, tmp_path, extra, message):
    target, _ = stories260k
    zlab_folder(tmp_path / "zlab", target, **extra)
    with pytest.raises(ValueError, match=message):
        import_heads(tmp_path / "zlab", target=target)
