"""The vLLM speculators format, algorithms ``eagle`` and ``eagle3`` <-> specheads EAGLE and EAGLE-3 heads.

Layout, as vllm-project/speculators' ``EagleSpeculatorConfig`` / ``EagleSpeculator`` define it (and vLLM serves it):

- ``config.json``: ``speculators_model_type`` "eagle", ``architectures`` ["EagleSpeculator", <layer class>],
  ``transformer_layer_architecture`` (e.g. "LlamaDecoderLayer"), ``transformer_layer_config`` (the layer's
  family config as a dict, with ``model_type``), ``layernorms`` (False for EAGLE-1/2/HASS), ``fusion_bias``,
  ``speculators_version``, and ``speculators_config`` {``algorithm`` "eagle", ``proposal_methods`` [{
  ``proposal_type`` "greedy", ``speculative_tokens``, ``verifier_accept_k``, ``accept_tolerance``}],
  ``default_proposal_method`` "greedy", ``verifier`` {``name_or_path``, ``architectures``}}. Exports add
  ``draft_vocab_size`` (= the target vocabulary: EAGLE-1/2 drafts over the full vocabulary).
- ``model.safetensors``: ``fusion_fc.weight`` (h, 2h), ``fusion_fc.bias`` (only when ``fusion_bias``), and
  ``transformer.*``: the decoder layer's parameters under their HF names. With ``layernorms`` False the layer's
  ``input_layernorm`` is an Identity and has no tensor. No verifier embedding or lm_head (``embed_tokens.weight`` /
  ``lm_head.weight``, if a file carries them anyway, are ignored on import).

``EagleSpeculator.forward`` computes ``fusion_fc(cat([embed_tokens(ids), hidden_states], -1))`` then the layer:
the same math as specheads' EAGLE head, so ``fc.*`` <-> ``fusion_fc.*`` and ``layer.*`` <-> ``transformer.*``.

Assumptions: ``layernorms=True`` (the TTT variant with ``embedding_layernorm`` / ``pre_lm_head_layernorm``) has no
specheads equivalent and is refused; ``speculative_tokens`` of the default proposal method maps to ``tree_depth``
both ways.

Algorithm ``eagle3`` (``Eagle3DraftModel``, served by vLLM as ``Eagle3LlamaForCausalLM``):

- ``config.json``: ``speculators_model_type`` "eagle3", ``architectures`` ["Eagle3Speculator"],
  ``transformer_layer_config`` (the layer's family config, ``vocab_size`` = the verifier's), ``draft_vocab_size``,
  ``norm_before_residual``, ``target_hidden_size`` (null = hidden_size; else the verifier's width, the layer's being
  the draft's, which then keeps its own ``embed_tokens.weight``), ``eagle_aux_hidden_state_layer_ids`` (the
  verifier's tapped ``hidden_states`` indices: id j is the output of layer j-1, as specheads' ``feature_layers``),
  and ``speculators_config`` with ``algorithm`` "eagle3" (as above otherwise).
- ``model.safetensors``: ``fc.weight`` (h, 3h), ``layers.0.*`` (the first layer: ``input_layernorm`` for the
  embedding, ``hidden_norm`` for the feature, q/k/v reading 2h inputs, ``o_proj``, ``post_attention_layernorm``,
  ``mlp``), ``norm.weight``, ``lm_head.weight`` (draft_vocab_size, h), ``d2t`` (offsets: target id = draft id +
  d2t[draft id]) and ``t2d``. ``embed_tokens.weight`` and ``verifier_*`` tensors are ignored on import.

The variants' norms map both ways to specheads' EAGLE-3 options: ``fc_norm`` (EAGLE-3.1, tensors
``fc_norm.<i>.weight``), ``norm_output`` (EAGLE-3.1), ``norm_before_fc`` (tensor ``input_norm.weight``, one norm over the
concatenation) and ``norm_before_residual`` (the residual is the normalised feature).

Several decoder layers (``transformer_layer_config.num_hidden_layers`` L, tensors ``layers.<i>.*``, vLLM's
several-layer EAGLE-3): the first as above, the others plain layers on its output (specheads' ``num_layers`` and
``extra_layers.<i-1>.*``; a ``layers.<i>.hidden_norm.weight`` past the first, which vLLM builds and never reads, is
dropped on import).

Refused on import, as specheads' heads compute otherwise: ``norm_before_residual`` missing (speculators reads false,
vLLM true), and a non-zero ``fc.bias`` (older speculators releases; a zero one is dropped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specheads.heads import format_eagle3
from specheads.heads.config import HeadsConfig
from specheads.heads.eagle import build_layer_config, decoder_classes
from specheads.heads.format_eagle import (
    check_exportable,
    fill_fc_bias,
    layer_config_for_export,
    layer_config_from_foreign,
    model_type_of,
)
from specheads.heads.interop import ForeignHeads, read_config, read_tensors, require_field

HEAD_TYPES = ("eagle", "eagle3")
WEIGHTS_FILE = "model.safetensors"
WEIGHT_CANDIDATES = (WEIGHTS_FILE, "pytorch_model.bin")
IGNORED_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # verifier parts, never part of the speculator
EAGLE3_IGNORED_TENSORS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
EAGLE3_LAYER_PREFIX = "layers.0."
SPECULATORS_VERSION = "0.1.0"  # the speculators config layout these files follow
RENAMES = (("fc.", "fusion_fc."), ("layer.", "transformer."))  # specheads prefix -> speculators prefix
# eagle3 variants: specheads field <-> speculators / vLLM config field (tensors fc_norm.<i>.*, input_norm.*)
NORM_FIELDS = (("eagle3_fc_norm", "fc_norm"), ("eagle3_norm_output", "norm_output"),
               ("eagle3_norm_before_fc", "norm_before_fc"), ("eagle3_norm_before_residual", "norm_before_residual"))


def foreign_name(name: str, config: HeadsConfig) -> str:
    """Speculators' name of a specheads tensor: ``fc.*`` -> ``fusion_fc.*``, ``layer.*`` -> ``transformer.*``
    (eagle); ``layer.*`` / ``hidden_norm.*`` -> ``layers.0.*`` (eagle3)."""
    if config.head_type == "eagle3":
        return format_eagle3.eagle3_tensor_name(name, EAGLE3_LAYER_PREFIX)
    for ours, theirs in RENAMES:
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    return name


def convert_for_export(tensors: dict[str, Any], config: HeadsConfig) -> None:
    """eagle3: ``d2t`` as offsets (speculators adds them to draft ids); eagle: nothing to change."""
    if config.head_type == "eagle3":
        format_eagle3.convert_for_export(tensors, config)


def _speculators_config(config: HeadsConfig, algorithm: str) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": config.tree_depth,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": config.target_name_or_path,
            "architectures": list(config.target_architectures),
        },
    }


def _eagle3_config(config: HeadsConfig) -> dict[str, Any]:
    layer = {k: v for k, v in layer_config_for_export(config).items() if k not in format_eagle3.EAGLE3_KEYS}
    layer["tie_word_embeddings"] = False  # the draft lm_head is its own (draft vocabulary), not the embedding
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size if config.draft_hidden_size != config.hidden_size else None,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        # the variants' norms, always explicit (vLLM reads a missing norm_before_residual as true)
        **{theirs: getattr(config, ours) for ours, theirs in NORM_FIELDS},
        "speculators_config": _speculators_config(config, "eagle3"),
    }


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """The speculators config.json for these heads."""
    if config.head_type == "eagle3":
        return _eagle3_config(config)
    check_exportable(config, "speculators")
    layer_class, _ = decoder_classes(build_layer_config(config))
    return {
        "architectures": ["EagleSpeculator", layer_class.__name__],
        "speculators_model_type": "eagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_architecture": layer_class.__name__,
        "transformer_layer_config": layer_config_for_export(config),
        "layernorms": False,
        "fusion_bias": True,  # specheads' fc always has a bias
        "draft_vocab_size": config.vocab_size,
        "speculators_config": _speculators_config(config, "eagle"),
    }


def _speculative_tokens(spec: dict[str, Any]) -> int | None:
    """``speculative_tokens`` of the default proposal method (or the first one), if the config gives it."""
    methods = [m for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    default = spec.get("default_proposal_method")
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
    value = chosen.get("speculative_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of a speculators ``eagle`` or ``eagle3`` folder.

    Raises:
        ValueError: another speculators algorithm, ``layernorms=True``, a missing ``transformer_layer_config`` or
            size field, a reduced ``draft_vocab_size`` for ``eagle``, an eagle3 variant specheads does not compute
            (see the module docstring), or a pickle without `allow_pickle`.
    """
    config = read_config(folder)
    where = str(folder / "config.json")
    spec = config.get("speculators_config") or {}
    model_type = config.get("speculators_model_type")
    if model_type == "eagle3":
        return _read_eagle3(folder, config, allow_pickle)
    if model_type != "eagle":
        raise ValueError(
            f"{where}: speculators_model_type={model_type!r} is not supported; expected 'eagle' or 'eagle3'"
        )
    if config.get("layernorms"):
        raise ValueError(
            f"{where}: layernorms=true (extra embedding_layernorm / pre_lm_head_layernorm) has no specheads "
            "equivalent; only layernorms=false (EAGLE-1/2, HASS) imports"
        )
    layer_raw = require_field(config, "transformer_layer_config", dict, where)
    hidden_size = require_field(layer_raw, "hidden_size", int, f"{where} transformer_layer_config")
    vocab_size = require_field(layer_raw, "vocab_size", int, f"{where} transformer_layer_config")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != vocab_size:
        raise ValueError(
            f"{where}: draft_vocab_size={draft_vocab} differs from transformer_layer_config.vocab_size={vocab_size}; "
            "speculators 'eagle' drafts over the full vocabulary (a reduced one is speculators_model_type 'eagle3')"
        )
    tensors, source = read_tensors(folder, WEIGHT_CANDIDATES, allow_pickle)
    for name in IGNORED_TENSORS:
        tensors.pop(name, None)
    if not config.get("fusion_bias", False):
        fill_fc_bias(tensors, "fusion_fc.bias", hidden_size, source)
    layer_type = model_type_of(layer_raw, config.get("transformer_layer_architecture", "LlamaDecoderLayer"))
    fields: dict[str, Any] = {
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        # the target's family comes from the target itself: the draft layer's may differ (a Llama layer serves any)
        "draft_layer_config": layer_config_from_foreign(layer_raw, layer_type),
        "eagle_input_norm": False,  # layernorms=false: the layer's input_layernorm is an Identity
    }
    depth = _speculative_tokens(spec)
    if depth is not None:
        fields["tree_depth"] = depth
    verifier = spec.get("verifier") or {}
    return ForeignHeads(fields, tensors, source, target_hint=str(verifier.get("name_or_path") or ""))


def _read_eagle3(folder: Path, config: dict[str, Any], allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of a speculators ``eagle3`` folder."""
    where = str(folder / "config.json")
    if "norm_before_residual" not in config:
        raise ValueError(
            f"{where}: missing field 'norm_before_residual' (speculators reads a missing value as false, vLLM as "
            "true); add the value the heads were trained with"
        )
    layer_raw = require_field(config, "transformer_layer_config", dict, where)
    hidden_size = require_field(layer_raw, "hidden_size", int, f"{where} transformer_layer_config")
    vocab_size = require_field(layer_raw, "vocab_size", int, f"{where} transformer_layer_config")
    draft_vocab_size = require_field(config, "draft_vocab_size", int, where)
    tensors, source = read_tensors(folder, WEIGHT_CANDIDATES, allow_pickle)
    format_eagle3.drop_zero_fc_bias(tensors, "fc.bias", source)
    format_eagle3.d2t_offsets_to_ids(tensors)
    layer_type = model_type_of(layer_raw, config.get("transformer_layer_architecture", "LlamaDecoderLayer"))
    layer_raw = {k: v for k, v in layer_raw.items() if k not in format_eagle3.EAGLE3_KEYS}
    fields: dict[str, Any] = {
        "hidden_size": format_eagle3.target_width(config, hidden_size, where),  # the target's; the layer's: the draft's
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "draft_layer_config": layer_config_from_foreign(layer_raw, layer_type),
    }
    format_eagle3.drop_target_embedding(tensors, fields, EAGLE3_IGNORED_TENSORS)
    num_layers = require_field({"num_hidden_layers": layer_raw.get("num_hidden_layers", 1)}, "num_hidden_layers", int,
                               f"{where} transformer_layer_config")
    if num_layers != 1:  # vLLM: layers after the first read the stream alone (their hidden_norm, if saved, is unused)
        fields["num_layers"] = num_layers
        for i in range(1, num_layers):
            tensors.pop(f"layers.{i}.hidden_norm.weight", None)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        fields["feature_layers"] = format_eagle3.layer_ids(ids, where, "eagle_aux_hidden_state_layer_ids")
    for ours, theirs in NORM_FIELDS:  # the variants' norms (missing: off, but norm_before_residual is required)
        value = config.get(theirs, False)
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {theirs}={value!r}; expected true or false")
        fields[ours] = value
    spec = config.get("speculators_config") or {}
    depth = _speculative_tokens(spec)
    if depth is not None:
        fields["tree_depth"] = depth
    verifier = spec.get("verifier") or {}
    target = str(verifier.get("name_or_path") or "")
    return ForeignHeads(fields, tensors, source, target_hint=target, head_type="eagle3")
