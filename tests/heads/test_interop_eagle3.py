"""Interop with EAGLE-3 checkpoints: synthetic SafeAILab, SGLang and speculators folders import and draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specheads import SpeculativeLM
from specheads.heads.interop import detect_format, import_heads
from specheads.inference.drafting import EagleDrafter

from .interop_folders import (
    eagle3_inputs,
    eagle_layer_shapes,
    llama_style_config,
    random_tensors,
    write_folder,
)


# --- synthetic EAGLE-3 folders ---------------------------------------------------------------------------------------
def _eagle3_tensors(config: dict, prefix: str, draft_vocab: torch.Tensor, seed: int = 4) -> dict[str, torch.Tensor]:
    """EAGLE-3 tensors as the public definitions name and shape them: fc (h, 3h), the layer under `prefix` with
    2h-wide q/k/v and a hidden_norm, norm, lm_head (draft vocab, h), d2t OFFSETS and t2d. With a
    ``target_hidden_size`` H != h in `config`: fc (h, 3H) and the draft's own embed_tokens (V, h)."""
    h, v = config["hidden_size"], config["vocab_size"]
    wide = config.get("target_hidden_size") or h
    shapes = {"fc.weight": (h, 3 * wide), "norm.weight": (h,), "lm_head.weight": (draft_vocab.shape[0], h)}
    if wide != h:
        shapes["embed_tokens.weight"] = (v, h)
    for name, shape in eagle_layer_shapes(config).items():
        shapes[prefix + name] = (shape[0], 2 * h) if name.split(".")[1] in ("q_proj", "k_proj", "v_proj") else shape
    shapes[prefix + "input_layernorm.weight"] = (h,)
    shapes[prefix + "hidden_norm.weight"] = (h,)
    tensors = random_tensors(shapes, seed=seed)
    for name in ("norm.weight", prefix + "input_layernorm.weight", prefix + "hidden_norm.weight",
                 prefix + "post_attention_layernorm.weight"):
        tensors[name] += 1.0
    tensors["d2t"] = draft_vocab - torch.arange(draft_vocab.shape[0])  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_vocab] = True
    tensors["t2d"] = t2d
    return tensors


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out: x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _eagle3_reference(config: dict, tensors: dict, prefix: str, target, inputs,
                      variants: frozenset[str] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's draft step from the raw tensors, as the public definitions write it: fc on the 3 fused layers;
    attention over cat(input_layernorm(embed), hidden_norm(fc_out)) with 2h-wide q/k/v; the residual is the
    un-normalised fc output; MLP block; then norm -> lm_head. Returns (hidden (B, T, h), logits (B, T, V_draft)).

    `variants` (vLLM's EAGLE-3 fields): fc_norm (tensors fc_norm.<i>.weight on each fused layer's slice before fc),
    norm_before_fc (input_norm.weight on the whole concatenation), norm_before_residual (the residual is
    hidden_norm(fc_out)), norm_output (the returned hidden state is norm(hidden); the lm_head reads it as it is)."""
    from transformers import LlamaConfig

    skip = ("architectures", "bias", "torch_dtype", "draft_vocab_size", "eagle_config", "target_hidden_size")
    layer_config = LlamaConfig(**{k: v for k, v in config.items() if k not in skip})
    h = config["hidden_size"]
    layer = LlamaDecoderLayer(layer_config, layer_idx=0).eval()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(layer.self_attn, name, nn.Linear(2 * h, getattr(layer.self_attn, name).out_features, bias=False))
    own = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix) and "hidden_norm" not in k}
    layer.load_state_dict(own, strict=True)
    hidden_norm, norm = LlamaRMSNorm(h, eps=config["rms_norm_eps"]), LlamaRMSNorm(h, eps=config["rms_norm_eps"])
    hidden_norm.weight.data.copy_(tensors[prefix + "hidden_norm.weight"])
    norm.weight.data.copy_(tensors["norm.weight"])
    rotary = LlamaRotaryEmbedding(config=layer_config)
    eps = config["rms_norm_eps"]
    with torch.no_grad():
        own_embedding = tensors.get("embed_tokens.weight")  # a draft of another width than the target's
        embeds = target.get_input_embeddings()(inputs["input_ids"]) if own_embedding is None else \
            F.embedding(inputs["input_ids"], own_embedding)
        features = inputs["features"]
        if "fc_norm" in variants:
            width = features.shape[-1] // 3  # the target's hidden size
            features = torch.cat([_rms(part, tensors[f"fc_norm.{i}.weight"], eps)
                                  for i, part in enumerate(features.split(width, dim=-1))], dim=-1)
        if "norm_before_fc" in variants:
            features = _rms(features, tensors["input_norm.weight"], eps)
        fused = F.linear(features, tensors["fc.weight"])
        attn_input = torch.cat([layer.input_layernorm(embeds), hidden_norm(fused)], dim=-1)
        attn, _ = layer.self_attn(
            hidden_states=attn_input,
            attention_mask=inputs["attention_mask"],
            position_embeddings=rotary(fused, inputs["position_ids"]),
        )
        hidden = (hidden_norm(fused) if "norm_before_residual" in variants else fused) + attn
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if "norm_output" in variants:
            hidden = norm(hidden)
            return hidden, F.linear(hidden, tensors["lm_head.weight"])
        return hidden, F.linear(norm(hidden), tensors["lm_head.weight"])


def _eagle3_folder(folder: Path, target, fmt: str, weights: str = "model.safetensors", drop: str | None = None,
                  width: int | None = None):
    """A synthetic EAGLE-3 folder in `fmt` for `target`, with a shuffled 40-token draft vocabulary; with `width`, a
    draft of that width (its heads and MLP scaled, head_dim kept) reading the target's wider features."""
    base = llama_style_config(target)
    for key in ("bias", "torch_dtype"):
        base.pop(key)
    base["architectures"] = ["LlamaForCausalLMEagle3"]
    if width is not None:
        head_dim = base["hidden_size"] // base["num_attention_heads"]
        base.update(target_hidden_size=base["hidden_size"], hidden_size=width, num_attention_heads=width // head_dim,
                    num_key_value_heads=width // head_dim // 2, intermediate_size=2 * width)
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(8))[:40].sort().values
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    tensors = _eagle3_tensors(base, prefix, vocab)
    written = dict(tensors)
    if fmt == "eagle3":
        config = dict(base, draft_vocab_size=40)
    elif fmt == "eagle3-sglang":  # SGLang: tapped layers as outputs of layers 1, 1, 0 = hidden_states 2, 2, 1
        config = dict(base, draft_vocab_size=40, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 0]})
        written.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.clone())
    else:
        layer_config = {k: v for k, v in base.items() if k not in ("architectures", "target_hidden_size")}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "transformer_layer_config": layer_config,
            "draft_vocab_size": 40,
            "norm_before_residual": False,
            "target_hidden_size": base.get("target_hidden_size"),
            "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": "stories260K", "architectures": ["LlamaForCausalLM"]},
            },
        }
        written.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.clone())
    if drop:
        written.pop(drop)
    return write_folder(folder, config, written, weights), base, tensors, vocab


def _computes_as_the_reference(heads, fmt: str, config: dict, tensors: dict, stories, eagle_inputs):
    """Assert that imported heads compute what `_eagle3_reference` computes from the folder's tensors; returns
    (the inputs, the reference's draft logits)."""
    inputs = eagle3_inputs(stories, eagle_inputs, seed=12)
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    hidden, logits = _eagle3_reference(config, tensors, prefix, stories, inputs)
    with torch.no_grad():
        ours = heads(**inputs)
        torch.testing.assert_close(ours, hidden)
        torch.testing.assert_close(heads.logits(ours), logits)
    return inputs, logits


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3-sglang", "speculators"])
def test_eagle3_folders_import_and_draft_as_their_tensors_say(fmt, stories, tmp_path, eagle_inputs):
    folder, config, tensors, vocab = _eagle3_folder(tmp_path / fmt, stories, fmt)
    assert detect_format(folder) == fmt
    heads = import_heads(folder, target=stories, out_dir=tmp_path / "ours")
    assert heads.config.head_type == "eagle3" and heads.config.draft_vocab_size == 40
    taps = {"eagle3": [2, 2, 2], "eagle3-sglang": [2, 2, 1], "speculators": [2, 3, 4]}  # default / SGLang + 1 / given
    assert heads.config.feature_layers == taps[fmt]
    assert torch.equal(heads.d2t, vocab) and torch.equal(heads.t2d.nonzero().squeeze(-1), vocab)
    inputs, logits = _computes_as_the_reference(heads, fmt, config, tensors, stories, eagle_inputs)
    # drafting: the root's children are the target ids (draft id + offset) of the reference's top draft ids
    drafter = EagleDrafter(heads, depth=2, top_k=4, num_nodes=6, dtype=torch.float32)
    drafter.reset()
    tokens, tree = drafter.propose(inputs["features"][0], inputs["input_ids"][0])
    top = logits[0, -1].topk(4).indices
    assert set(tokens[tree.parents == 0].tolist()) == set((top + tensors["d2t"][top]).tolist())
    assert set(tokens[1:].tolist()) <= set(vocab.tolist())


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3-sglang", "speculators"])
def test_drafts_narrower_than_the_target_import_with_their_own_embedding(fmt, stories, tmp_path, eagle_inputs):
    """`target_hidden_size` (SGLang, vLLM): a 32-wide draft for the 64-wide stories260K computes as its tensors say,
    with its own embedding; it decodes exactly and exports back to the same tensors."""
    folder, config, tensors, vocab = _eagle3_folder(tmp_path / fmt, stories, fmt, width=32)
    heads = import_heads(folder, target=stories, out_dir=tmp_path / "ours")
    assert (heads.config.hidden_size, heads.config.draft_hidden_size) == (64, 32)
    assert heads.fc.weight.shape == (32, 192) and heads.embed_tokens.weight.shape == (512, 32)
    _computes_as_the_reference(heads, fmt, config, tensors, stories, eagle_inputs)
    ids = torch.tensor([[1, 40, 47, 26, 37]])
    assert torch.equal(SpeculativeLM(stories, heads).generate(ids, max_new_tokens=24),
                       stories.generate(ids, max_new_tokens=24, do_sample=False))
    from specheads.heads.interop import export_heads

    export_heads(heads, fmt, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    layer = written.get("transformer_layer_config", written)
    assert (written["target_hidden_size"], layer["hidden_size"]) == (64, 32)
    back = load_file(tmp_path / "back" / "model.safetensors")
    torch.testing.assert_close(back["embed_tokens.weight"], tensors["embed_tokens.weight"])
    torch.testing.assert_close(back["fc.weight"], tensors["fc.weight"])


@pytest.mark.parametrize("variants", [
    ("norm_before_fc", "norm_before_residual", "norm_output"),  # speculators' training defaults (gpt-oss style)
    ("norm_before_residual",),
    ("fc_norm", "norm_output"),  # EAGLE-3.1
])
def test_speculators_variants_import_and_compute_as_vllm_does(variants, stories, tmp_path, eagle_inputs):
    """A speculators eagle3 folder with vLLM's norm fields set imports as heads computing its math (the reference
    written out from the tensors), and exports back with the same fields and tensors."""
    from specheads.heads.interop import export_heads

    folder, config, tensors, vocab = _eagle3_folder(tmp_path / "vllm", stories, "speculators")
    written = json.loads((folder / "config.json").read_text())
    extra = dict(tensors)
    h = config["hidden_size"]
    generator = torch.Generator().manual_seed(5)
    if "fc_norm" in variants:
        for i in range(3):
            extra[f"fc_norm.{i}.weight"] = 1 + 0.3 * torch.randn(h, generator=generator)
    if "norm_before_fc" in variants:
        extra["input_norm.weight"] = 1 + 0.3 * torch.randn(3 * h, generator=generator)
    for name in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        written[name] = name in variants
    (folder / "config.json").write_text(json.dumps(written))
    save_file({**load_file(folder / "model.safetensors"), **{k: v for k, v in extra.items() if k not in tensors}},
              str(folder / "model.safetensors"))
    heads = import_heads(folder, target=stories, out_dir=tmp_path / "ours")
    inputs = eagle3_inputs(stories, eagle_inputs, seed=13)
    hidden, logits = _eagle3_reference(config, extra, "layers.0.", stories, inputs, frozenset(variants))
    with torch.no_grad():
        ours = heads(**inputs)
        torch.testing.assert_close(ours, hidden)
        torch.testing.assert_close(heads.logits(ours), logits)
    # plain EAGLE-3 math differs from every variant's (the reference and the heads really apply them)
    plain, _ = _eagle3_reference(config, extra, "layers.0.", stories, inputs)
    assert not torch.allclose(plain, hidden)
    export_heads(tmp_path / "ours", "speculators", tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert all(back[name] == (name in variants) for name in ("fc_norm", "norm_output", "norm_before_fc",
                                                             "norm_before_residual"))
    exported = load_file(tmp_path / "back" / "model.safetensors")
    for name in ("input_norm.weight", "fc_norm.0.weight"):
        if name in extra:
            torch.testing.assert_close(exported[name], extra[name])
    lm = SpeculativeLM(stories, heads)
    ids = torch.tensor([[1, 403, 407, 261, 378]])
    assert torch.equal(lm.generate(ids, max_new_tokens=24), stories.generate(ids, max_new_tokens=24, do_sample=False))


def test_pickled_eagle3_release_imports_with_allow_pickle(stories, tmp_path):
    folder, _, tensors, vocab = _eagle3_folder(tmp_path / "e3", stories, "eagle3", weights="pytorch_model.bin")
    assert detect_format(folder) == "eagle3"
    with pytest.raises(ValueError, match="--allow-pickle"):
        import_heads(folder, target=stories)
    heads = import_heads(folder, target=stories, allow_pickle=True)
    assert torch.equal(heads.fc.weight, tensors["fc.weight"]) and torch.equal(heads.d2t, vocab)


def test_a_llama_layer_eagle3_draft_serves_a_target_of_another_family(tiny_qwen2, tmp_path):
    """EAGLE-3 releases for Qwen targets hold Llama layers: the heads keep the Llama layer, record the Qwen2 target,
    and speculative generation still reproduces the target's greedy output."""
    folder, _, _, _ = _eagle3_folder(tmp_path / "e3", tiny_qwen2, "eagle3")
    heads = import_heads(folder, target=tiny_qwen2)
    assert heads.config.target_model_type == "qwen2" and type(heads.layer).__name__ == "LlamaDecoderLayer"
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    lm = SpeculativeLM(tiny_qwen2, heads, tree_depth=3, tree_top_k=3, tree_num_nodes=8)
    out = lm.generate(ids, max_new_tokens=20)
    assert torch.equal(out, tiny_qwen2.generate(ids, max_new_tokens=20, do_sample=False))


@pytest.mark.parametrize(
    ("fmt", "edit", "match"),
    [
        ("eagle3", "drop:midlayer.hidden_norm.weight", r"missing tensor 'midlayer\.hidden_norm\.weight'"),
        ("eagle3-sglang", "drop:t2d", r"missing tensor 't2d'"),
        ("speculators", "drop:layers.0.self_attn.q_proj.weight", r"missing tensor 'layers\.0\.self_attn\.q_proj"),
        ("eagle3", "d2t_out_of_range", r"tensor d2t is invalid: .*expected ids in \[0, 512\)"),
        ("eagle3", "d2t_unsorted", r"tensor d2t is invalid: .*sorted ascending"),
        ("eagle3-sglang", "fc_bias", r"tensor 'fc\.bias' is a non-zero fc bias"),
        ("eagle3", "two_layers", "num_hidden_layers=2; this EAGLE-3 layout holds one decoder layer"),
        ("eagle3", "target_hidden_size", "heads hidden_size=128 but target 'stories260K' has hidden_size=64"),
        ("speculators", "target_hidden_size_text", "field target_hidden_size='64' should be a int"),
        ("eagle3", "drop:embed_tokens.weight:32", r"missing tensor 'embed_tokens\.weight'"),
        ("speculators", "no_norm_before_residual", "missing field 'norm_before_residual'"),
        ("eagle3", "big_draft_vocab", "draft_vocab_size=600 is larger than vocab_size=512"),
    ],
)
def test_broken_eagle3_folders_fail_naming_what_is_wrong(fmt, edit, match, stories, tmp_path):
    parts = edit.split(":")  # drop:<tensor>[:<draft width>]
    folder, _, _, _ = _eagle3_folder(tmp_path / fmt, stories, fmt, drop=parts[1] if len(parts) > 1 else None,
                                     width=int(parts[2]) if len(parts) > 2 else None)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    if edit == "d2t_out_of_range":
        tensors["d2t"][-1] += 1000
    elif edit == "d2t_unsorted":
        tensors["d2t"][:2] = tensors["d2t"][:2].flip(0) + torch.tensor([1, -1])  # swaps the first two target ids
    elif edit == "fc_bias":
        tensors["fc.bias"] = torch.full((64,), 0.1)
    elif edit == "two_layers":
        config["num_hidden_layers"] = 2
    elif edit == "target_hidden_size":
        config["target_hidden_size"] = 128
    elif edit == "target_hidden_size_text":
        config["target_hidden_size"] = "64"
    elif edit == "no_norm_before_residual":
        del config["norm_before_residual"]
    elif edit == "big_draft_vocab":
        config["draft_vocab_size"] = 600
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        import_heads(folder, target=stories)


def test_a_zero_fc_bias_is_dropped(stories, tmp_path):
    folder, _, tensors, _ = _eagle3_folder(tmp_path / "e3", stories, "eagle3")
    path = folder / "model.safetensors"
    save_file(dict(load_file(path), **{"fc.bias": torch.zeros(64)}), str(path))
    assert torch.equal(import_heads(folder, target=stories).fc.weight, tensors["fc.weight"])
