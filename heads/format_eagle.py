"""The original EAGLE-1/2 checkpoint format (SafeAILab/EAGLE) <-> specheads EAGLE heads.

Layout, as EAGLE's ``cnets.Model`` saves and loads it:

- ``config.json``: a LlamaConfig-style dict (``architectures`` ["LlamaForCausalLM"], ``hidden_size``,
  ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``vocab_size``,
  ``max_position_embeddings``, ``rope_theta``, ``num_hidden_layers`` 1, and ``"bias": true`` for the fc bias).
- ``model.safetensors`` (older releases: pickled ``pytorch_model.bin``): ``fc.weight`` (h, 2h), ``fc.bias``,
  ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (+ q/k/v biases for Qwen2-family layers),
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``. Layer 0 has no
  ``input_layernorm`` (EAGLE drops it; specheads' ``eagle_input_norm=False``). Some releases also ship
  ``embed_tokens.weight``, a copy of the target's embedding: ignored on import, never exported.

The fc input is ``concat(embed(token), feature)`` in that order, in both projects, so the weights map one to one:
``fc.*`` -> ``fc.*`` and ``layers.0.*`` -> ``layer.*``.

Specheads additions on export (extra config keys that EAGLE's config loader keeps as plain attributes):
``model_type`` (selects the decoder layer family on import), ``base_model_name_or_path`` (the target), and
``rope_theta`` / ``rope_scaling`` next to transformers-5 ``rope_parameters`` for readers that predate it.
A file that does hold ``layers.0.input_layernorm.weight`` imports as ``eagle_input_norm=True``; heads with that
norm cannot be exported to this format (EAGLE's layer 0 has no slot for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specheads.heads.config import HeadsConfig
from specheads.heads.interop import ForeignHeads, read_config, read_tensors, require_field

HEAD_TYPES = ("eagle",)
WEIGHTS_FILE = "model.safetensors"
WEIGHT_CANDIDATES = (WEIGHTS_FILE, "pytorch_model.bin")
IGNORED_TENSORS = ("embed_tokens.weight",)  # the target's embedding copy: the heads borrow the target's own
INPUT_NORM = "layers.0.input_layernorm.weight"

# Config keys that describe a whole checkpoint or a runtime choice, not the decoder layer.
_NOT_LAYER_KEYS = (
    "architectures",
    "bias",
    "base_model_name_or_path",
    "_name_or_path",
    "transformers_version",
    "auto_map",
    "torch_dtype",
    "quantization_config",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
)


def foreign_name(name: str, config: HeadsConfig) -> str:
    """EAGLE's name of a specheads tensor: ``layer.X`` -> ``layers.0.X``; ``fc.*`` is the same."""
    return "layers.0." + name.removeprefix("layer.") if name.startswith("layer.") else name


def model_type_of(layer_config: dict[str, Any], architecture: str | None, default: str = "llama") -> str:
    """The decoder family of a foreign layer config: its ``model_type``, else from a class name, else `default`.

    ``LlamaForCausalLM`` / ``LlamaDecoderLayer`` -> ``llama``; ``Qwen2ForCausalLM`` -> ``qwen2``.
    """
    if layer_config.get("model_type"):
        return str(layer_config["model_type"])
    for suffix in ("ForCausalLM", "DecoderLayer"):
        if architecture and architecture.endswith(suffix):
            return architecture.removesuffix(suffix).lower()
    return default


def layer_config_for_export(config: HeadsConfig) -> dict[str, Any]:
    """The heads' decoder layer config as a plain LlamaConfig-style dict that older readers understand too."""
    layer = {k: v for k, v in config.draft_layer_config.items() if k not in _NOT_LAYER_KEYS}
    layer.setdefault("model_type", config.target_model_type)
    layer.update(num_hidden_layers=config.num_layers, hidden_size=config.draft_hidden_size, vocab_size=config.vocab_size)
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        layer.setdefault("rope_theta", rope["rope_theta"])  # transformers < 5 read only this key
        if rope.get("rope_type", "default") != "default":
            layer.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return layer


def layer_config_from_foreign(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A foreign layer config cut to what `HeadsConfig.draft_layer_config` holds (one layer, its family)."""
    layer = {k: v for k, v in raw.items() if k not in _NOT_LAYER_KEYS}
    layer.update(num_hidden_layers=1, model_type=model_type)
    if layer.get("layer_types"):
        layer["layer_types"] = ["full_attention"]
    return layer


def check_exportable(config: HeadsConfig, format_name: str) -> None:
    """EAGLE-1/2-style formats cannot hold the decoder layer's input norm."""
    if config.eagle_input_norm:
        raise ValueError(
            f"format {format_name!r} cannot hold heads with eagle_input_norm=True: its decoder layer has no "
            "input_layernorm (as original EAGLE-1/2); these heads stay in the specheads format"
        )


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """EAGLE's config.json for these heads."""
    check_exportable(config, "eagle")
    out = layer_config_for_export(config)
    out.update(
        architectures=list(config.target_architectures) or ["LlamaForCausalLM"],
        bias=True,  # specheads' fc always has a bias
        base_model_name_or_path=config.target_name_or_path,
    )
    return out


def fill_fc_bias(tensors: dict[str, torch.Tensor], name: str, hidden_size: int, source: Path) -> None:
    """A bias-free fc is our fc with a zero bias (EAGLE ``"bias": false``, speculators ``fusion_bias=false``)."""
    if name in tensors:
        raise ValueError(f"{source}: tensor {name!r} is present but the config says the fc layer has no bias")
    weight = tensors.get(name.replace(".bias", ".weight"))
    dtype = weight.dtype if weight is not None else torch.float32
    tensors[name] = torch.zeros(hidden_size, dtype=dtype)


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of an EAGLE-1/2 folder.

    Raises:
        ValueError: an EAGLE-3 folder (pointed to its formats), missing or invalid ``hidden_size`` /
            ``vocab_size``, or a pickle without `allow_pickle`.
    """
    config = read_config(folder)
    where = str(folder / "config.json")
    if "draft_vocab_size" in config or "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        raise ValueError(f"{where} describes an EAGLE-3 checkpoint: import it with format 'eagle3' or 'eagle3-sglang'")
    hidden_size = require_field(config, "hidden_size", int, where)
    vocab_size = require_field(config, "vocab_size", int, where)
    tensors, source = read_tensors(folder, WEIGHT_CANDIDATES, allow_pickle)
    for name in IGNORED_TENSORS:
        tensors.pop(name, None)
    if not config.get("bias", True):
        fill_fc_bias(tensors, "fc.bias", hidden_size, source)
    architectures = config.get("architectures") or [None]
    model_type = model_type_of(config, architectures[0])
    fields = {
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        # the target's family comes from the target itself: the draft layer's may differ (a Llama layer serves any)
        "draft_layer_config": layer_config_from_foreign(config, model_type),
        "eagle_input_norm": INPUT_NORM in tensors,
    }
    return ForeignHeads(fields, tensors, source, target_hint=str(config.get("base_model_name_or_path") or ""))
