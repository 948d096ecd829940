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
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specheads import SpeculativeLM, create_heads, load_heads
from specheads.heads import DraftHeads
from specheads.heads.interop import FORMATS, detect_format, export_heads, import_heads
from specheads.inference.drafting import EagleDrafter

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


@pytest.fixture(scope="module")
def stories(stories260k):
    return stories260k[0]


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


def _eagle3_inputs(target, eagle_inputs, seed: int) -> dict[str, torch.Tensor]:
    """`eagle_inputs` with (B, T, 3h) fused-target features, as EAGLE-3 heads read them."""
    inputs = eagle_inputs(target, batch=2, length=6, seed=seed)
    b, t, h = inputs["features"].shape
    inputs["features"] = torch.randn(b, t, 3 * h, generator=torch.Generator().manual_seed(seed))
    return inputs


def _outputs(heads: DraftHeads, target, eagle_inputs) -> torch.Tensor:
    """Medusa logits, EAGLE predicted features, or EAGLE-3 draft-vocabulary logits, on fixed random inputs."""
    if heads.config.head_type == "eagle3":
        with torch.no_grad():
            return heads.logits(heads(**_eagle3_inputs(target, eagle_inputs, seed=3)))
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
def _random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.1 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor], weights: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file(tensors, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    return folder


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
    tensors = _random_tensors(shapes)
    return _write(folder, config, tensors, weights), {k.removeprefix(prefix): t for k, t in tensors.items()}


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


def _eagle_layer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "post_attention_layernorm.weight": (h,),
    }


def _llama_style_config(target) -> dict:
    """The config.json of an original EAGLE-1 checkpoint for `target` (LlamaConfig fields, "bias": true)."""
    c = target.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "bias": True,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "vocab_size": c.vocab_size,
    }


def _eagle_folder(folder: Path, target, weights: str = "model.safetensors", drop: str | None = None):
    config = _llama_style_config(target)
    h = config["hidden_size"]
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
    shapes.update({f"layers.0.{k}": s for k, s in _eagle_layer_shapes(config).items()})
    tensors = _random_tensors(shapes, seed=1)
    tensors["layers.0.post_attention_layernorm.weight"] += 1.0
    written = dict(tensors, **{"embed_tokens.weight": target.get_input_embeddings().weight.clone()})
    if drop:
        written.pop(drop)
    return _write(folder, config, written, weights), config, tensors


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
    layer_config = _llama_style_config(target)
    for key in ("architectures", "bias", "torch_dtype"):
        layer_config.pop(key)
    h = layer_config["hidden_size"]
    shapes = {"fusion_fc.weight": (h, 2 * h)} | ({"fusion_fc.bias": (h,)} if fusion_bias else {})
    shapes.update({f"transformer.{k}": s for k, s in _eagle_layer_shapes(layer_config).items()})
    tensors = _random_tensors(shapes, seed=2)
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
    return _write(folder, config, tensors, "model.safetensors"), layer_config, tensors


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


# --- synthetic EAGLE-3 folders ---------------------------------------------------------------------------------------
def _eagle3_tensors(config: dict, prefix: str, draft_vocab: torch.Tensor, seed: int = 4) -> dict[str, torch.Tensor]:
    """EAGLE-3 tensors as the public definitions name and shape them: fc (h, 3h), the layer under `prefix` with
    2h-wide q/k/v and a hidden_norm, norm, lm_head (draft vocab, h), d2t OFFSETS and t2d."""
    h, v = config["hidden_size"], config["vocab_size"]
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (draft_vocab.shape[0], h)}
    for name, shape in _eagle_layer_shapes(config).items():
        shapes[prefix + name] = (shape[0], 2 * h) if name.split(".")[1] in ("q_proj", "k_proj", "v_proj") else shape
    shapes[prefix + "input_layernorm.weight"] = (h,)
    shapes[prefix + "hidden_norm.weight"] = (h,)
    tensors = _random_tensors(shapes, seed=seed)
    for name in ("norm.weight", prefix + "input_layernorm.weight", prefix + "hidden_norm.weight",
                 prefix + "post_attention_layernorm.weight"):
        tensors[name] += 1.0
    tensors["d2t"] = draft_vocab - torch.arange(draft_vocab.shape[0])  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_vocab] = True
    tensors["t2d"] = t2d
    return tensors


def _eagle3_reference(config: dict, tensors: dict, prefix: str, target, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's draft step from the raw tensors, as the public definitions write it: fc on the 3 fused layers;
    attention over cat(input_layernorm(embed), hidden_norm(fc_out)) with 2h-wide q/k/v; the residual is the
    un-normalised fc output; MLP block; then norm -> lm_head. Returns (hidden (B, T, h), logits (B, T, V_draft))."""
    from transformers import LlamaConfig

    skip = ("architectures", "bias", "torch_dtype", "draft_vocab_size", "eagle_config")
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
    with torch.no_grad():
        embeds = target.get_input_embeddings()(inputs["input_ids"])
        fused = F.linear(inputs["features"], tensors["fc.weight"])
        attn_input = torch.cat([layer.input_layernorm(embeds), hidden_norm(fused)], dim=-1)
        attn, _ = layer.self_attn(
            hidden_states=attn_input,
            attention_mask=inputs["attention_mask"],
            position_embeddings=rotary(fused, inputs["position_ids"]),
        )
        hidden = fused + attn
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, F.linear(norm(hidden), tensors["lm_head.weight"])


def _eagle3_folder(folder: Path, target, fmt: str, weights: str = "model.safetensors", drop: str | None = None):
    """A synthetic EAGLE-3 folder in `fmt` for `target`, with a shuffled 40-token draft vocabulary."""
    base = _llama_style_config(target)
    for key in ("bias", "torch_dtype"):
        base.pop(key)
    base["architectures"] = ["LlamaForCausalLMEagle3"]
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(8))[:40].sort().values
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    tensors = _eagle3_tensors(base, prefix, vocab)
    written = dict(tensors)
    if fmt == "eagle3":
        config = dict(base, draft_vocab_size=40)
    elif fmt == "eagle3-sglang":  # SGLang: tapped layers as outputs of layers 1, 1, 0 = hidden_states 2, 2, 1
        config = dict(base, draft_vocab_size=40, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 0]})
        written["embed_tokens.weight"] = target.get_input_embeddings().weight.clone()
    else:
        layer_config = {k: v for k, v in base.items() if k != "architectures"}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "transformer_layer_config": layer_config,
            "draft_vocab_size": 40,
            "norm_before_residual": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": "stories260K", "architectures": ["LlamaForCausalLM"]},
            },
        }
        written["embed_tokens.weight"] = target.get_input_embeddings().weight.clone()
    if drop:
        written.pop(drop)
    return _write(folder, config, written, weights), base, tensors, vocab


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3-sglang", "speculators"])
def test_eagle3_folders_import_and_draft_as_their_tensors_say(fmt, stories, tmp_path, eagle_inputs):
    folder, config, tensors, vocab = _eagle3_folder(tmp_path / fmt, stories, fmt)
    assert detect_format(folder) == fmt
    heads = import_heads(folder, target=stories, out_dir=tmp_path / "ours")
    assert heads.config.head_type == "eagle3" and heads.config.draft_vocab_size == 40
    taps = {"eagle3": [2, 2, 2], "eagle3-sglang": [2, 2, 1], "speculators": [2, 3, 4]}  # default / SGLang + 1 / given
    assert heads.config.feature_layers == taps[fmt]
    assert torch.equal(heads.d2t, vocab) and torch.equal(heads.t2d.nonzero().squeeze(-1), vocab)
    inputs = _eagle3_inputs(stories, eagle_inputs, seed=12)
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    hidden, logits = _eagle3_reference(config, tensors, prefix, stories, inputs)
    with torch.no_grad():
        ours = heads(**inputs)
        torch.testing.assert_close(ours, hidden)
        torch.testing.assert_close(heads.logits(ours), logits)
    # drafting: the root's children are the target ids (draft id + offset) of the reference's top draft ids
    drafter = EagleDrafter(heads, depth=2, top_k=4, num_nodes=6, dtype=torch.float32)
    drafter.reset()
    tokens, tree = drafter.propose(inputs["features"][0], inputs["input_ids"][0])
    top = logits[0, -1].topk(4).indices
    assert set(tokens[tree.parents == 0].tolist()) == set((top + tensors["d2t"][top]).tolist())
    assert set(tokens[1:].tolist()) <= set(vocab.tolist())


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
        ("eagle3", "two_layers", "num_hidden_layers=2; specheads EAGLE-3 heads hold one decoder layer"),
        ("eagle3", "target_hidden_size", "target_hidden_size=128 differs from hidden_size=64"),
        ("speculators", "norm_before_residual", "norm_before_residual=true"),
        ("speculators", "no_norm_before_residual", "missing field 'norm_before_residual'"),
        ("eagle3", "big_draft_vocab", "draft_vocab_size=600 is larger than vocab_size=512"),
    ],
)
def test_broken_eagle3_folders_fail_naming_what_is_wrong(fmt, edit, match, stories, tmp_path):
    folder, _, _, _ = _eagle3_folder(tmp_path / fmt, stories, fmt, drop=edit.split(":")[1] if ":" in edit else None)
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
    elif edit == "norm_before_residual":
        config["norm_before_residual"] = True
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


# --- broken folders --------------------------------------------------------------------------------------------------
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
    eagle3_config = dict(_llama_style_config(stories), architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=32)
    _write(tmp_path / "e3", eagle3_config, midlayer, "model.safetensors")
    assert detect_format(tmp_path / "e3") == "eagle3"
    _write(tmp_path / "sglang", eagle3_config, layers0, "model.safetensors")
    assert detect_format(tmp_path / "sglang") == "eagle3-sglang"
    _write(tmp_path / "d2t_only", _llama_style_config(stories), dict(layers0, d2t=torch.zeros(32, dtype=torch.long)),
           "model.safetensors")
    assert detect_format(tmp_path / "d2t_only") == "eagle3-sglang"
    _write(tmp_path / "pickled", eagle3_config, midlayer, "pytorch_model.bin")  # SafeAILab releases are pickled
    assert detect_format(tmp_path / "pickled") == "eagle3"
    _write(tmp_path / "spec3", {"speculators_model_type": "eagle3"}, layers0, "model.safetensors")
    assert detect_format(tmp_path / "spec3") == "speculators"
    with pytest.raises(ValueError, match="EAGLE-3 checkpoint: import it with format 'eagle3' or 'eagle3-sglang'"):
        import_heads(tmp_path / "e3", format="eagle", target=stories)
    assert {"eagle3", "eagle3-sglang"} <= set(FORMATS)

    _write(tmp_path / "other", {"model_type": "bert", "num_hidden_layers": 12}, {"x": torch.zeros(1)}, "model.safetensors")
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
