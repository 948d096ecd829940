"""The original EAGLE-3 checkpoint format (SafeAILab/EAGLE) <-> specheads EAGLE-3 heads.

Layout, as EAGLE-3's ``cnets.Model`` saves and loads it (and SGLang's ``LlamaForCausalLMEagle3`` serves it):

- ``config.json``: a LlamaConfig-style dict (``architectures`` ["LlamaForCausalLMEagle3"], ``hidden_size``,
  ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``vocab_size`` (the
  target's), ``draft_vocab_size``, ``max_position_embeddings``, ``rope_theta``, ``num_hidden_layers`` 1, ...).
- ``model.safetensors`` (SafeAILab releases: pickled ``pytorch_model.bin``): ``fc.weight`` (h, 3h, no bias),
  ``midlayer.input_layernorm.weight`` (normalises the token embedding), ``midlayer.hidden_norm.weight``
  (normalises the feature), ``midlayer.self_attn.{q,k,v}_proj.weight`` (each reading 2h inputs),
  ``midlayer.self_attn.o_proj.weight``, ``midlayer.post_attention_layernorm.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` (draft_vocab_size, h),
  ``d2t`` (draft_vocab_size,) int64 OFFSETS: target id = draft id + d2t[draft id], and ``t2d`` (vocab_size,) bool.
  ``embed_tokens.weight``, a copy of the target's embedding that some releases carry, is ignored on import and
  never exported, except for a draft of another width than the target's: its config's ``target_hidden_size`` (SGLang
  reads it) is the target's width, ``hidden_size`` the draft's, ``fc.weight`` is (h_draft, 3 h_target) and
  ``embed_tokens.weight`` (vocab_size, h_draft) is the draft's own embedding, exported and imported.

The math is specheads' `Eagle3Heads` (attention reads ``cat(input_layernorm(embed), hidden_norm(feature))``, the
residual is the un-normalised feature), so tensors map one to one: ``midlayer.X`` <-> ``layer.X``,
``midlayer.hidden_norm.weight`` <-> ``hidden_norm.weight``, the rest keep their names. Only ``d2t`` changes value:
specheads stores target ids, this format offsets (converted both ways).

The format holds a Llama decoder layer without attention biases: heads whose layer is of another family (Qwen2's
q/k/v biases) are refused on export. A Llama-layer draft for a target of another family (EAGLE-3 releases for Qwen
targets) imports fine: the layer keeps its own family, the heads record the target's.

Tapped layers: EAGLE-3 hard-codes hidden states [2, L//2, L-3] of the target (`default_eagle3_feature_layers`).
Exports add ``eagle_aux_hidden_state_layer_ids`` (the tapped `hidden_states` indices, vLLM's convention), and
``base_model_name_or_path`` (the target); imports read them when present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specheads.heads.config import EAGLE3_NORM_FIELDS, HeadsConfig
from specheads.heads.format_eagle import layer_config_for_export, layer_config_from_foreign, model_type_of
from specheads.heads.interop import ForeignHeads, read_config, read_tensors, require_field

HEAD_TYPES = ("eagle3",)
WEIGHTS_FILE = "model.safetensors"
WEIGHT_CANDIDATES = (WEIGHTS_FILE, "pytorch_model.bin")
IGNORED_TENSORS = ("embed_tokens.weight",)  # the target's embedding copy: the heads borrow the target's own
ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_PREFIX = "midlayer."
LLAMA_LAYER_FAMILIES = (
    "llama",
    "mistral",
)  # decoder layers that are exactly a Llama layer (no attention biases)
# EAGLE-3 config keys that describe the draft model, not its decoder layer
EAGLE3_KEYS = ("draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids", "target_hidden_size")


def eagle3_tensor_name(name: str, layer_prefix: str) -> str:
    """A specheads EAGLE-3 tensor name in a format whose decoder layer lives under `layer_prefix`; the layers after
    the first (``extra_layers.<i>.X``, several-layer drafts) are ``layers.<i+1>.X``."""
    if name.startswith("extra_layers."):
        index, rest = name.removeprefix("extra_layers.").split(".", 1)
        return f"layers.{int(index) + 1}.{rest}"
    if name.startswith("layer."):
        return layer_prefix + name.removeprefix("layer.")
    if name == "hidden_norm.weight":  # specheads keeps it beside the HF layer; the formats put it inside
        return layer_prefix + name
    return name  # fc.weight, norm.weight, lm_head.weight, d2t, t2d


def foreign_name(name: str, config: HeadsConfig) -> str:
    """EAGLE-3's name of a specheads tensor: ``layer.X`` / ``hidden_norm.*`` -> ``midlayer.X``."""
    return eagle3_tensor_name(name, LAYER_PREFIX)


def convert_for_export(tensors: dict[str, torch.Tensor], config: HeadsConfig) -> None:
    """``d2t`` as the formats store it: offsets (target id - draft id) instead of target ids."""
    tensors["d2t"] = tensors["d2t"] - torch.arange(tensors["d2t"].shape[0], dtype=tensors["d2t"].dtype)


def d2t_offsets_to_ids(tensors: dict[str, torch.Tensor]) -> None:
    """The formats' ``d2t`` offsets (target id - draft id) -> specheads' target ids, in place (1-D d2t only)."""
    if "d2t" in tensors and tensors["d2t"].dim() == 1:
        d2t = tensors["d2t"].long()
        tensors["d2t"] = d2t + torch.arange(d2t.shape[0])


def target_width(config: dict[str, Any], hidden_size: int, where: str) -> int:
    """The target's hidden size an EAGLE-3 draft of width `hidden_size` reads: ``target_hidden_size`` (null or
    missing: the draft's own width); a ValueError naming the field when it is not a positive integer."""
    value = config.get("target_hidden_size")
    if value is None:
        return hidden_size
    return require_field({"target_hidden_size": value}, "target_hidden_size", int, where)


def drop_target_embedding(tensors: dict[str, torch.Tensor], fields: dict[str, Any], ignored: tuple[str, ...]) -> None:
    """Drop the `ignored` copies of target parts a file may carry; a draft of another width than the target's keeps
    its ``embed_tokens.weight`` (its own embedding, which the heads need)."""
    narrow = fields["draft_layer_config"].get("hidden_size", fields["hidden_size"]) != fields["hidden_size"]
    for name in ignored:
        if not (narrow and name == "embed_tokens.weight"):
            tensors.pop(name, None)


def target_hidden_size_field(config: HeadsConfig) -> dict[str, Any]:
    """``target_hidden_size`` for an exported config: the target's width when the draft's differs, else nothing."""
    return {"target_hidden_size": config.hidden_size} if config.draft_hidden_size != config.hidden_size else {}


def layer_family(config: HeadsConfig) -> str:
    """The model_type of the heads' decoder layer."""
    return str(config.draft_layer_config.get("model_type") or config.target_model_type)


def eagle3_config(config: HeadsConfig, format_name: str) -> dict[str, Any]:
    """The LlamaForCausalLMEagle3 config.json both EAGLE-3 layouts share (without tapped-layer fields)."""
    family = layer_family(config)
    if family not in LLAMA_LAYER_FAMILIES:
        raise ValueError(
            f"format {format_name!r} holds a Llama decoder layer without attention biases, but these heads have a "
            f"{family!r} layer; keep them in the specheads format or export to 'speculators'"
        )
    out = {k: v for k, v in layer_config_for_export(config).items() if k not in EAGLE3_KEYS}
    out.update(
        architectures=[ARCHITECTURE],
        draft_vocab_size=config.draft_vocab_size,
        tie_word_embeddings=False,  # SGLang would otherwise use the target's embedding as the (full) lm_head
        bias=False,  # the fc has no bias
        base_model_name_or_path=config.target_name_or_path,
        **target_hidden_size_field(config),  # SGLang's and vLLM's field for a draft narrower than the target
    )
    return out


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """EAGLE-3's config.json for these heads."""
    check_three_layers(config, "eagle3")
    out = eagle3_config(config, "eagle3")
    out["eagle_aux_hidden_state_layer_ids"] = list(config.feature_layers)
    return out


def read_eagle3(
    folder: Path, allow_pickle: bool, layer_prefix: str, feature_layers: list[int] | None
) -> ForeignHeads:
    """The HeadsConfig fields and tensors of an EAGLE-3 folder whose decoder layer lives under `layer_prefix`.

    Args:
        folder: the checkpoint folder.
        allow_pickle: accept pickled ``pytorch_model.bin`` weights.
        layer_prefix: ``midlayer.`` (SafeAILab) or ``layers.0.`` (SGLang).
        feature_layers: tapped `hidden_states` indices the caller read from the config, or None (default taps).

    Raises:
        ValueError: a missing or invalid size field, several decoder layers, an fc bias, or a pickle without
            `allow_pickle`.
    """
    config = read_config(folder)
    where = str(folder / "config.json")
    hidden_size = require_field(config, "hidden_size", int, where)
    vocab_size = require_field(config, "vocab_size", int, where)
    draft_vocab_size = config.get("draft_vocab_size")
    if draft_vocab_size is None:  # SGLang: no reduced vocabulary, the draft predicts the target's
        draft_vocab_size = vocab_size
    draft_vocab_size = require_field({"draft_vocab_size": draft_vocab_size}, "draft_vocab_size", int, where)
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{where}: num_hidden_layers={config['num_hidden_layers']}; this EAGLE-3 layout holds one decoder layer "
            "(drafts of several layers import from vLLM speculators' format)"
        )
    tensors, source = read_tensors(folder, WEIGHT_CANDIDATES, allow_pickle)
    drop_zero_fc_bias(tensors, "fc.bias", source)
    d2t_offsets_to_ids(tensors)
    model_type = model_type_of(config, None)  # "llama" unless the config names another family
    raw_layer = {k: v for k, v in config.items() if k not in EAGLE3_KEYS + ("tie_word_embeddings",)}
    fields: dict[str, Any] = {
        "hidden_size": target_width(config, hidden_size, where),  # the target's; the layer's is the draft's
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "draft_layer_config": layer_config_from_foreign(raw_layer, model_type),
    }
    drop_target_embedding(tensors, fields, IGNORED_TENSORS)
    if feature_layers is not None:
        fields["feature_layers"] = feature_layers
    return ForeignHeads(fields, tensors, source, target_hint=str(config.get("base_model_name_or_path") or ""))


def drop_zero_fc_bias(tensors: dict[str, torch.Tensor], name: str, source: Path) -> None:
    """An all-zero fc bias (some writers keep one) is dropped; any other bias has no place in the heads."""
    bias = tensors.get(name)
    if bias is None:
        return
    if bool((bias == 0).all()):
        del tensors[name]
        return
    raise ValueError(
        f"{source}: tensor {name!r} is a non-zero fc bias; specheads EAGLE-3 heads have a bias-free fc"
    )


def layer_ids(value: Any, where: str, field: str) -> list[int]:
    """A list of 2 or more (EAGLE-3: 3) non-negative ints from a config field; a ValueError naming it otherwise."""
    if not (
        isinstance(value, list) and len(value) >= 2 and all(isinstance(i, int) and i >= 0 for i in value)
    ):
        raise ValueError(f"{where}: {field}={value!r}; expected 2 or more (EAGLE-3: 3) non-negative layer indices")
    return list(value)


def check_three_layers(config: HeadsConfig, format_name: str) -> None:
    """SafeAILab's and SGLang's EAGLE-3 code builds one decoder layer, its fc for exactly 3 tapped layers and none of
    the variants' norms (`EAGLE3_NORM_FIELDS`): refuse other heads by name."""
    if config.num_layers != 1:
        raise ValueError(f"format {format_name!r} holds one decoder layer, but these heads have num_layers="
                         f"{config.num_layers}; export to 'speculators' (vLLM reads several) or keep the specheads format")
    variants = [name for name in EAGLE3_NORM_FIELDS if getattr(config, name)]
    if variants:
        raise ValueError(f"format {format_name!r} holds EAGLE-3 heads without the variants' norms, but these heads set "
                         f"{', '.join(variants)}; export to 'speculators' (vLLM reads fc_norm, norm_output, "
                         "norm_before_fc, norm_before_residual) or keep the specheads format")
    if len(config.feature_layers) != 3:
        raise ValueError(
            f"format {format_name!r} fuses exactly 3 target layers, but these heads read feature_layers="
            f"{config.feature_layers}; export to 'speculators' (vLLM reads any number) or keep the specheads format"
        )


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of a SafeAILab EAGLE-3 folder (``midlayer.*``)."""
    config = read_config(folder)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    where = str(folder / "config.json")
    feature_layers = layer_ids(ids, where, "eagle_aux_hidden_state_layer_ids") if ids is not None else None
    return read_eagle3(folder, allow_pickle, LAYER_PREFIX, feature_layers)
