"""Interoperability: export to / import from the original Medusa, EAGLE-1/2, EAGLE-3 (SafeAILab and SGLang layouts)
and vLLM speculators (eagle, eagle3) formats.

Round trips (specheads -> format -> specheads) must give identical weights, head outputs and drafts; synthetic
folders written here with each project's exact key names and config fields must import into heads whose outputs
equal a reference computed directly from those tensors; broken folders fail with errors naming what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads import DraftHeads
from specheads.heads.interop import FORMATS, detect_format, export_heads, import_heads
from specheads.inference.drafting import EagleDrafter

from .interop_folders import (
    eagle3_inputs,
    eagle_layer_shapes,
    llama_style_config,
    random_tensors,
    write_folder,
)

OPTIONS = {"medusa": {"num_heads": 3, "num_layers": 2}, "eagle": {}, "eagle3": {"draft_vocab_size": 40}}
FORMAT_HEAD_TYPES = [
    ("medusa", "medusa"),
    ("eagle", "eagle"),
    ("speculators", "eagle"),
    ("eagle3", "eagle3"),
    ("eagle3-sglang", "eagle3"),
    ("speculators", "eagle3"),
]
# (format, head type, target) of each round trip; EAGLE-3's SafeAILab / SGLang layouts hold Llama layers only
ROUND_TRIPS = [
    (fmt, head_type, target)
    for fmt, head_type in FORMAT_HEAD_TYPES
    for target in ("stories260K", "tiny_llama", "tiny_qwen2")
    if not (target == "tiny_qwen2" and fmt in ("eagle3", "eagle3-sglang"))
]


def _randomized(heads: DraftHeads, seed: int = 0) -> DraftHeads:
    """Give every weight a random value so a round trip must carry real numbers (fresh Medusa blocks are zeros);
    EAGLE-3 heads also get a shuffled draft vocabulary (d2t not the identity)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    if heads.config.head_type == "eagle3":
        vocab = torch.randperm(heads.config.vocab_size, generator=generator)[: heads.config.draft_vocab_size]
        heads.set_draft_vocab(vocab.sort().values)
    return heads.eval()


def _outputs(heads: DraftHeads, target, eagle_inputs) -> torch.Tensor:
    """Medusa logits, EAGLE predicted features, or EAGLE-3 draft-vocabulary logits, on fixed random inputs."""
    if heads.config.head_type == "eagle3":
        with torch.no_grad():
            return heads.logits(heads(**eagle3_inputs(target, eagle_inputs, seed=3)))
    inputs = eagle_inputs(target, batch=2, length=6, seed=3)
    with torch.no_grad():
        if heads.config.head_type == "medusa":
            return heads(inputs["features"])
        return heads(**inputs)


def _drafts(heads: DraftHeads, rounds: tuple[int, ...] = (6, 2, 1)) -> list[list[int]]:
    """The token trees an EAGLE drafter proposes over a few rounds of fixed random target features."""
    config = heads.config
    width = 3 * config.hidden_size if config.head_type == "eagle3" else config.hidden_size
    drafter = EagleDrafter(heads, depth=3, top_k=3, num_nodes=8, dtype=torch.float32)
    drafter.reset()
    generator = torch.Generator().manual_seed(11)
    out = []
    for length in rounds:
        features = torch.randn(length, width, generator=generator)
        tokens, tree = drafter.propose(features, torch.randint(0, config.vocab_size, (length,), generator=generator))
        out.append(tokens.tolist() + tree.parents.tolist())
    return out


# --- round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "head_type", "target_name"), ROUND_TRIPS)
def test_round_trip_gives_identical_weights_and_drafts(fmt, head_type, target_name, request, tmp_path, eagle_inputs):
    target = request.getfixturevalue("stories" if target_name == "stories260K" else target_name)
    torch.manual_seed(0)
    heads = _randomized(create_heads(target, head_type, **OPTIONS[head_type]))
    export_heads(heads, fmt, tmp_path / "foreign")
    assert detect_format(tmp_path / "foreign") == fmt
    # stories260K: the folder records its target, so none is passed; tiny targets are not loadable by name.
    imported = import_heads(
        tmp_path / "foreign", target=None if target_name == "stories260K" else target, out_dir=tmp_path / "back"
    )
    if target_name == "stories260K":
        imported.attach_target(target)
    assert detect_format(tmp_path / "back") == "specheads"
    original, back = heads.state_dict(), imported.state_dict()
    assert sorted(original) == sorted(back)
    for name in original:
        assert torch.equal(original[name], back[name]), name
    fields = ("hidden_size", "vocab_size", "draft_vocab_size", "feature_layers", "num_heads", "num_layers")
    for field in (*fields, "target_model_type"):
        assert getattr(imported.config, field) == getattr(heads.config, field), field
    assert imported.config.target_name_or_path == heads.config.target_name_or_path
    torch.testing.assert_close(_outputs(imported, target, eagle_inputs), _outputs(heads, target, eagle_inputs), rtol=0, atol=0)
    reloaded = load_heads(tmp_path / "back", target=target)  # the written checkpoint is a normal one
    torch.testing.assert_close(_outputs(reloaded, target, eagle_inputs), _outputs(heads, target, eagle_inputs), rtol=0, atol=0)
    if head_type != "medusa":
        assert _drafts(reloaded) == _drafts(heads)


def test_exports_hold_no_target_weights_and_use_the_public_names(stories, tmp_path):
    torch.manual_seed(0)
    eagle = create_heads(stories, "eagle")
    export_heads(eagle, "eagle", tmp_path / "eagle")
    names = set(load_file(tmp_path / "eagle" / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "layers.0.input_layernorm")) for n in names)
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is True
    assert config["num_hidden_layers"] == 1 and config["rope_theta"] == 10000.0

    export_heads(eagle, "speculators", tmp_path / "spec")
    names = set(load_file(tmp_path / "spec" / "model.safetensors"))
    assert {"fusion_fc.weight", "fusion_fc.bias", "transformer.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "verifier")) for n in names)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle" and config["architectures"][0] == "EagleSpeculator"
    assert config["speculators_config"]["verifier"] == {"name_or_path": "stories260K", "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["algorithm"] == "eagle" and config["draft_vocab_size"] == 512

    medusa = create_heads(stories, "medusa", num_heads=2)
    export_heads(medusa, "medusa", tmp_path / "medusa")
    assert set(load_file(tmp_path / "medusa" / "medusa_lm_head.safetensors")) == {
        "0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"
    }
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"], config["base_model_name_or_path"]) == (2, 1, "stories260K")


def test_eagle3_exports_use_the_public_names_and_d2t_offsets(stories, tmp_path):
    torch.manual_seed(0)
    heads = _randomized(create_heads(stories, "eagle3", draft_vocab_size=40))
    layer = {
        "input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    }
    top = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    for fmt, prefix in (("eagle3", "midlayer."), ("eagle3-sglang", "layers.0."), ("speculators", "layers.0.")):
        export_heads(heads, fmt, tmp_path / fmt)
        tensors = load_file(tmp_path / fmt / "model.safetensors")
        assert set(tensors) == top | {prefix + name for name in layer}, fmt
        assert tensors["fc.weight"].shape == (64, 192)
        assert tensors[prefix + "self_attn.q_proj.weight"].shape == (64, 128)  # reads cat(embedding, feature)
        assert tensors["lm_head.weight"].shape == (40, 64) and tensors["t2d"].dtype == torch.bool
        assert torch.equal(tensors["d2t"] + torch.arange(40), heads.d2t)  # offsets: target id = draft id + d2t
        assert torch.equal(tensors["t2d"], heads.t2d)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["draft_vocab_size"], config["vocab_size"], config["num_hidden_layers"]) == (40, 512, 1)
    assert config["tie_word_embeddings"] is False and config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 2]
    assert config["base_model_name_or_path"] == "stories260K"
    config = json.loads((tmp_path / "eagle3-sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 1]  # SGLang: output of layer i
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["speculators_config"]["algorithm"] == "eagle3"
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 40
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 2]
    assert config["transformer_layer_config"]["vocab_size"] == 512
    assert config["speculators_config"]["verifier"]["name_or_path"] == "stories260K"


def test_qwen2_layers_cannot_be_exported_to_llama_only_eagle3_layouts(tiny_qwen2, tmp_path):
    heads = create_heads(tiny_qwen2, "eagle3")
    for fmt in ("eagle3", "eagle3-sglang"):
        with pytest.raises(ValueError, match="Llama decoder layer without attention biases.*'qwen2' layer"):
            export_heads(heads, fmt, tmp_path / fmt)
    export_heads(heads, "speculators", tmp_path / "spec")  # speculators names the layer's family
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["transformer_layer_config"]["model_type"] == "qwen2"


def test_qwen2_heads_with_a_llama_layer_export_to_every_eagle3_layout(tiny_qwen2, tmp_path):
    """`draft_layer="llama"` (head.options in a run config): the layer SGLang / SpecForge EAGLE-3 drafts hold for
    Qwen targets, so those formats take the heads, and they come back tensor for tensor."""
    torch.manual_seed(0)
    heads = create_heads(tiny_qwen2, "eagle3", draft_layer="llama")
    assert type(heads.layer).__name__ == "LlamaDecoderLayer" and heads.config.target_model_type == "qwen2"
    for fmt in ("eagle3", "eagle3-sglang", "speculators"):
        export_heads(heads, fmt, tmp_path / fmt)
        back = import_heads(tmp_path / fmt, target=tiny_qwen2, format=fmt)
        assert all(torch.equal(heads.state_dict()[name], t) for name, t in back.state_dict().items()), fmt
    with pytest.raises(ValueError, match=r"draft_layer='qwen2'; expected one of \('auto', 'llama'\)"):
        create_heads(tiny_qwen2, "eagle3", draft_layer="qwen2")
    with pytest.raises(ValueError, match="draft_layer='llama' applies to EAGLE heads"):
        create_heads(tiny_qwen2, "medusa", draft_layer="llama")


def test_export_accepts_a_checkpoint_path_and_refuses_the_wrong_head_type(stories, tmp_path):
    torch.manual_seed(0)
    create_heads(stories, "medusa", num_heads=2).save_pretrained(tmp_path / "ours")
    export_heads(str(tmp_path / "ours"), "medusa", tmp_path / "out")
    assert detect_format(tmp_path / "out") == "medusa"
    with pytest.raises(ValueError, match="holds eagle or eagle3 heads but these heads are head_type='medusa'"):
        export_heads(tmp_path / "ours", "speculators", tmp_path / "bad")
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        export_heads(tmp_path / "ours", "gguf", tmp_path / "bad")


def test_eagle_input_norm_heads_cannot_be_exported_to_eagle1_formats(stories, tmp_path):
    heads = create_heads(stories, "eagle", eagle_input_norm=True)
    for fmt in ("eagle", "speculators"):
        with pytest.raises(ValueError, match="eagle_input_norm=True"):
            export_heads(heads, fmt, tmp_path / fmt)


# --- synthetic public folders ---------------------------------------------------------------------------------------
def _medusa_folder(folder: Path, target, prefix: str = "", weights: str = "medusa_lm_head.safetensors"):
    """An original Medusa folder: 3 heads x 2 residual blocks, keys `{i}.{j}.linear.*` and `{i}.{L}.weight`."""
    h, v = target.config.hidden_size, target.config.vocab_size
    shapes = {}
    for i in range(3):
        for j in range(2):
            shapes[f"{prefix}{i}.{j}.linear.weight"] = (h, h)
            shapes[f"{prefix}{i}.{j}.linear.bias"] = (h,)
        shapes[f"{prefix}{i}.2.weight"] = (v, h)
    config = {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "stories260K"}
    tensors = random_tensors(shapes)
    return write_folder(folder, config, tensors, weights), {k.removeprefix(prefix): t for k, t in tensors.items()}


def _medusa_reference(tensors: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """Medusa's forward written out: x <- x + SiLU(W x + b) per block, then the head's vocab projection."""
    logits = []
    for i in range(3):
        x = features
        for j in range(2):
            x = x + F.silu(F.linear(x, tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"]))
        logits.append(F.linear(x, tensors[f"{i}.2.weight"]))
    return torch.stack(logits)


@pytest.mark.parametrize("prefix", ["", "medusa_head."])
def test_original_medusa_folder_imports_and_drafts_as_its_tensors_say(prefix, stories, tmp_path, eagle_inputs):
    folder, tensors = _medusa_folder(tmp_path / "medusa", stories, prefix)
    assert detect_format(folder) == "medusa"
    heads = import_heads(folder, target=stories, out_dir=tmp_path / "ours")
    assert (heads.config.num_heads, heads.config.num_layers, heads.config.hidden_size) == (3, 2, 64)
    features = eagle_inputs(stories, seed=5)["features"]
    with torch.no_grad():
        torch.testing.assert_close(heads(features), _medusa_reference(tensors, features))


def _eagle_folder(folder: Path, target, weights: str = "model.safetensors", drop: str | None = None):
    config = llama_style_config(target)
    h = config["hidden_size"]
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
    shapes.update({f"layers.0.{k}": s for k, s in eagle_layer_shapes(config).items()})
    tensors = random_tensors(shapes, seed=1)
    tensors["layers.0.post_attention_layernorm.weight"] += 1.0
    written = dict(tensors, **{"embed_tokens.weight": target.get_input_embeddings().weight.clone()})
    if drop:
        written.pop(drop)
    return write_folder(folder, config, written, weights), config, tensors


def _eagle_reference(config: dict, fc: tuple[torch.Tensor, torch.Tensor], layer_tensors: dict, target, inputs) -> torch.Tensor:
    """EAGLE-1's forward from the raw tensors: fc(cat(embed(x), f)) -> LlamaDecoderLayer without input norm."""
    from transformers import LlamaConfig

    layer_config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "bias", "torch_dtype")})
    layer = LlamaDecoderLayer(layer_config, layer_idx=0).eval()
    layer.input_layernorm = nn.Identity()
    layer.load_state_dict(layer_tensors, strict=True)
    rotary = LlamaRotaryEmbedding(config=layer_config)
    with torch.no_grad():
        embeds = target.get_input_embeddings()(inputs["input_ids"])
        hidden = F.linear(torch.cat([embeds, inputs["features"]], dim=-1), *fc)
        out = layer(
            hidden,
            attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"],
            position_embeddings=rotary(hidden, inputs["position_ids"]),
        )
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("target_name", ["stories", "tiny_llama"])
def test_original_eagle_folder_imports_and_drafts_as_its_tensors_say(target_name, request, tmp_path, eagle_inputs):
    target = request.getfixturevalue(target_name)
    folder, config, tensors = _eagle_folder(tmp_path / "eagle", target)
    assert detect_format(folder) == "eagle"
    heads = import_heads(folder, target=target, out_dir=tmp_path / "ours")
    assert heads.config.eagle_input_norm is False and heads.config.head_type == "eagle"
    inputs = eagle_inputs(target, seed=7)
    layer_tensors = {k.removeprefix("layers.0."): t for k, t in tensors.items() if k.startswith("layers.0.")}
    expected = _eagle_reference(config, (tensors["fc.weight"], tensors["fc.bias"]), layer_tensors, target, inputs)
    with torch.no_grad():
        torch.testing.assert_close(heads(**inputs), expected)


def test_eagle_folder_without_fc_bias_imports_with_a_zero_bias(stories, tmp_path):
    folder, config, tensors = _eagle_folder(tmp_path / "eagle", stories, drop="fc.bias")
    (folder / "config.json").write_text(json.dumps(dict(config, bias=False)))
    heads = import_heads(folder, target=stories)
    assert torch.equal(heads.fc.bias, torch.zeros(64)) and torch.equal(heads.fc.weight, tensors["fc.weight"])


def _speculators_folder(folder: Path, target, fusion_bias: bool = False) -> tuple[Path, dict, dict]:
    """A speculators `eagle` folder as EagleSpeculator saves it: fusion_fc.*, transformer.*, no verifier parts."""
    layer_config = llama_style_config(target)
    for key in ("architectures", "bias", "torch_dtype"):
        layer_config.pop(key)
    h = layer_config["hidden_size"]
    shapes = {"fusion_fc.weight": (h, 2 * h)} | ({"fusion_fc.bias": (h,)} if fusion_bias else {})
    shapes.update({f"transformer.{k}": s for k, s in eagle_layer_shapes(layer_config).items()})
    tensors = random_tensors(shapes, seed=2)
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "speculators_version": "0.1.0.dev0",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer_config,
        "layernorms": False,
        "fusion_bias": fusion_bias,
        "draft_vocab_size": layer_config["vocab_size"],
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "stories260K", "architectures": ["LlamaForCausalLM"]},
        },
    }
    return write_folder(folder, config, tensors, "model.safetensors"), layer_config, tensors


@pytest.mark.parametrize("fusion_bias", [False, True])
def test_speculators_folder_imports_and_drafts_as_its_tensors_say(fusion_bias, stories, tmp_path, eagle_inputs):
    folder, layer_config, tensors = _speculators_folder(tmp_path / "spec", stories, fusion_bias)
    assert detect_format(folder) == "speculators"
    heads = import_heads(folder, out_dir=tmp_path / "ours")  # the verifier recorded in the folder is the target
    heads.attach_target(stories)
    assert heads.config.target_name_or_path == "stories260K" and heads.config.tree_depth == 5
    inputs = eagle_inputs(stories, seed=9)
    bias = tensors.get("fusion_fc.bias", torch.zeros(64))
    layer_tensors = {k.removeprefix("transformer."): t for k, t in tensors.items() if k.startswith("transformer.")}
    expected = _eagle_reference(layer_config, (tensors["fusion_fc.weight"], bias), layer_tensors, stories, inputs)
    with torch.no_grad():
        torch.testing.assert_close(heads(**inputs), expected)


# --- broken folders --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"speculators_model_type": "mlp"}, r"speculators_model_type='mlp' is not supported; expected 'eagle' or "
                                            r"'eagle3'"),
        ({"layernorms": True}, r"layernorms=true .* has no specheads equivalent"),
        ({"draft_vocab_size": 100}, r"draft_vocab_size=100 differs from transformer_layer_config\.vocab_size=512"),
        ({"transformer_layer_config": "llama"}, r"field transformer_layer_config='llama' should be a dict"),
        ({"transformer_layer_config": None}, r"missing field 'transformer_layer_config'"),
    ],
)
def test_speculators_variants_without_a_specheads_equivalent_are_refused(stories, tmp_path, change, message):
    """A speculators folder specheads cannot reproduce exactly is refused naming the field, never imported as
    something it is not."""
    folder, _, _ = _speculators_folder(tmp_path / "spec", stories)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        import_heads(folder, format="speculators", target=stories)


def test_a_folder_missing_one_tensor_fails_naming_it(stories, tmp_path):
    folder, _, _ = _eagle_folder(tmp_path / "eagle", stories, drop="layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.0\.mlp\.up_proj\.weight'"):
        import_heads(folder, target=stories)
    folder, _ = _medusa_folder(tmp_path / "medusa", stories)
    tensors = load_file(folder / "medusa_lm_head.safetensors")
    del tensors["1.0.linear.bias"]
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor '1\.0\.linear\.bias'"):
        import_heads(folder, target=stories)
    folder, _, tensors = _speculators_folder(tmp_path / "spec", stories)
    del tensors["transformer.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'transformer\.self_attn\.k_proj\.weight'"):
        import_heads(folder, target=stories)


def test_unknown_tensor_wrong_shape_and_wrong_target_are_named(stories, tiny_llama, tmp_path):
    folder, _, tensors = _eagle_folder(tmp_path / "eagle", stories)
    save_file(dict(tensors, **{"layers.0.extra.weight": torch.zeros(2)}), str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unknown tensor 'layers\.0\.extra\.weight'"):
        import_heads(folder, target=stories)
    save_file(dict(tensors, **{"fc.bias": torch.zeros(3)}), str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'fc\.bias' has shape \(3,\), expected \(64,\)"):
        import_heads(folder, target=stories)
    folder, _, _ = _eagle_folder(tmp_path / "eagle_small", tiny_llama)
    with pytest.raises(ValueError, match="vocab_size"):
        import_heads(folder, target=stories)
    folder, _ = _medusa_folder(tmp_path / "medusa", stories)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, hidden_size=128)))
    with pytest.raises(ValueError, match=r"hidden_size=128 but tensor '0\.2\.weight'"):
        import_heads(folder, target=stories)
    del config["medusa_num_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing field 'medusa_num_layers'"):
        import_heads(folder, target=stories)


def test_hidden_size_mismatch_with_the_target_names_the_field(stories, make_tiny_target, tmp_path):
    wide = make_tiny_target("llama", hidden_size=32, vocab_size=512)
    folder, _, _ = _eagle_folder(tmp_path / "eagle", stories)
    with pytest.raises(ValueError, match="hidden_size=64 but target"):
        import_heads(folder, target=wide)


def test_pickled_weights_are_refused_unless_allowed(stories, tmp_path, eagle_inputs):
    folder, tensors = _medusa_folder(tmp_path / "medusa", stories, weights="medusa_lm_head.pt")
    assert detect_format(folder) == "medusa"
    with pytest.raises(ValueError, match="--allow-pickle"):
        import_heads(folder, target=stories)
    heads = import_heads(folder, target=stories, allow_pickle=True, out_dir=tmp_path / "ours")
    features = eagle_inputs(stories, seed=5)["features"]
    with torch.no_grad():
        torch.testing.assert_close(heads(features), _medusa_reference(tensors, features))
    assert not list((tmp_path / "ours").glob("*.pt")) and (tmp_path / "ours" / "model.safetensors").is_file()

    folder, _, eagle_tensors = _eagle_folder(tmp_path / "eagle", stories, weights="pytorch_model.bin")
    assert detect_format(folder) == "eagle"
    with pytest.raises(ValueError, match="pickled checkpoint.*--allow-pickle"):
        import_heads(folder, target=stories)
    heads = import_heads(folder, target=stories, allow_pickle=True)
    assert torch.equal(heads.fc.weight, eagle_tensors["fc.weight"])


def test_corrupt_files_are_named_with_what_is_wrong(stories, tmp_path):
    """A foreign folder's broken config or weights raise an error naming the file (not a stack trace from deep inside
    json, safetensors or torch.load)."""
    folder, config, tensors = _eagle_folder(tmp_path / "eagle", stories)
    (folder / "config.json").write_text('{"hidden_size": 64,')  # cut off
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        import_heads(folder, format="eagle", target=stories)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object, got list"):
        import_heads(folder, format="eagle", target=stories)
    (folder / "config.json").write_text(json.dumps(config))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated download
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt or not a safetensors file"):
        import_heads(folder, target=stories)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="has none of the weight files"):
        import_heads(folder, format="eagle", target=stories)

    folder, _ = _medusa_folder(tmp_path / "medusa", stories, weights="medusa_lm_head.pt")
    medusa_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(medusa_config, medusa_num_heads="3")))
    with pytest.raises(ValueError, match=r"field medusa_num_heads='3' should be a int"):
        import_heads(folder, target=stories, allow_pickle=True)
    (folder / "config.json").write_text(json.dumps(medusa_config))
    torch.save({"0.0.linear.weight": [1.0, 2.0]}, folder / "medusa_lm_head.pt")  # not name -> tensor
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt does not hold a flat state dict"):
        import_heads(folder, target=stories, allow_pickle=True)
    (folder / "medusa_lm_head.pt").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt could not be read with torch\.load\(weights_only=True\)"):
        import_heads(folder, target=stories, allow_pickle=True)


# --- detection ------------------------------------------------------------------------------------------------------
def test_detection_of_every_format(stories, tmp_path):
    torch.manual_seed(0)
    heads = create_heads(stories, "eagle")
    heads.save_pretrained(tmp_path / "ours")
    assert detect_format(tmp_path / "ours") == "specheads"
    copy = import_heads(tmp_path / "ours", target=stories, out_dir=tmp_path / "copy")
    assert torch.equal(copy.fc.weight, heads.fc.weight)

    h = 64
    midlayer = {"fc.weight": torch.zeros(h, 3 * h), "midlayer.hidden_norm.weight": torch.ones(h)}
    layers0 = {"fc.weight": torch.zeros(h, 3 * h), "layers.0.hidden_norm.weight": torch.ones(h)}
    eagle3_config = dict(llama_style_config(stories), architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=32)
    write_folder(tmp_path / "e3", eagle3_config, midlayer, "model.safetensors")
    assert detect_format(tmp_path / "e3") == "eagle3"
    write_folder(tmp_path / "sglang", eagle3_config, layers0, "model.safetensors")
    assert detect_format(tmp_path / "sglang") == "eagle3-sglang"
    write_folder(tmp_path / "d2t_only", llama_style_config(stories), dict(layers0, d2t=torch.zeros(32, dtype=torch.long)),
           "model.safetensors")
    assert detect_format(tmp_path / "d2t_only") == "eagle3-sglang"
    write_folder(tmp_path / "pickled", eagle3_config, midlayer, "pytorch_model.bin")  # SafeAILab releases are pickled
    assert detect_format(tmp_path / "pickled") == "eagle3"
    write_folder(tmp_path / "spec3", {"speculators_model_type": "eagle3"}, layers0, "model.safetensors")
    assert detect_format(tmp_path / "spec3") == "speculators"
    with pytest.raises(ValueError, match="EAGLE-3 checkpoint: import it with format 'eagle3' or 'eagle3-sglang'"):
        import_heads(tmp_path / "e3", format="eagle", target=stories)
    assert {"eagle3", "eagle3-sglang"} <= set(FORMATS)

    write_folder(tmp_path / "other", {"model_type": "bert", "num_hidden_layers": 12}, {"x": torch.zeros(1)}, "model.safetensors")
    with pytest.raises(ValueError, match="cannot tell the checkpoint format"):
        detect_format(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        detect_format(tmp_path / "nowhere")


def test_a_folder_that_does_not_record_its_target_asks_for_one(stories, tmp_path):
    folder, config, _ = _eagle_folder(tmp_path / "eagle", stories)
    with pytest.raises(ValueError, match="--target"):
        import_heads(folder)
    heads = import_heads(folder, target="stories260K")  # a name: only its config is read
    assert heads.config.target_name_or_path == "stories260K" and heads.config.feature_layers == [5]


def test_load_heads_converts_other_projects_folders_in_memory(stories, tmp_path, eagle_inputs):
    """`load_heads` (and so `SpeculativeLM.from_pretrained`, `--heads` on every command) reads a folder in another
    project's format as `import_heads` does: the same tensors, nothing written; pickled weights stay refused."""
    medusa, _ = _medusa_folder(tmp_path / "medusa", stories)
    eagle, _, _ = _eagle_folder(tmp_path / "eagle", stories)
    for folder in (medusa, eagle):
        loaded = load_heads(folder, target=stories)
        imported = import_heads(folder, target=stories)
        for name, tensor in imported.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (folder.name, name)
        assert not loaded.training and not (folder / "README.md").exists()  # nothing written next to them
    lm = SpeculativeLM.from_pretrained(target="stories260K", heads=str(eagle))
    ids = torch.tensor([[1, 403, 407, 261]])
    assert torch.equal(lm.generate(ids, max_new_tokens=12), stories.generate(ids, max_new_tokens=12, do_sample=False))
    pickled, _, _ = _eagle_folder(tmp_path / "pickled", stories, weights="pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled checkpoint"):
        load_heads(pickled, target=stories)
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="has no head_type: it is neither a specheads checkpoint nor one of the formats"):
        load_heads(tmp_path / "unknown", target=stories)
