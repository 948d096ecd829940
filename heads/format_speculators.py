"""The vLLM speculators format, algorithm ``eagle`` (``EagleSpeculator``) <-> specheads EAGLE heads.

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
specheads equivalent and is refused; ``speculators_model_type`` "eagle3" is refused until EAGLE-3 heads exist;
``speculative_tokens`` of the default proposal method maps to ``tree_depth`` both ways.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specheads.heads.config import HeadsConfig
from specheads.heads.eagle import build_layer_config, decoder_classes
from specheads.heads.format_eagle import (
    check_exportable,
    fill_fc_bias,
    layer_config_for_export,
    layer_config_from_foreign,
    model_type_of,
)
from specheads.heads.interop import ForeignHeads, eagle3_unavailable, read_config, read_tensors, require_field

HEAD_TYPE = "eagle"
WEIGHTS_FILE = "model.safetensors"
WEIGHT_CANDIDATES = (WEIGHTS_FILE, "pytorch_model.bin")
IGNORED_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # verifier parts, never part of the speculator
SPECULATORS_VERSION = "0.1.0"  # the speculators config layout these files follow
RENAMES = (("fc.", "fusion_fc."), ("layer.", "transformer."))  # specheads prefix -> speculators prefix


def foreign_name(name: str, config: HeadsConfig) -> str:
    """Speculators' name of a specheads tensor: ``fc.*`` -> ``fusion_fc.*``, ``layer.*`` -> ``transformer.*``."""
    for ours, theirs in RENAMES:
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    return name


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """The speculators config.json for these heads."""
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
        "speculators_config": {
            "algorithm": "eagle",
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
        },
    }


def _speculative_tokens(spec: dict[str, Any]) -> int | None:
    """``speculative_tokens`` of the default proposal method (or the first one), if the config gives it."""
    methods = [m for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    default = spec.get("default_proposal_method")
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
    value = chosen.get("speculative_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of a speculators ``eagle`` folder.

    Raises:
        ValueError: another speculators algorithm (``eagle3`` among them), ``layernorms=True``, a missing
            ``transformer_layer_config`` or size field, a reduced ``draft_vocab_size``, or a pickle without
            `allow_pickle`.
    """
    config = read_config(folder)
    where = str(folder / "config.json")
    spec = config.get("speculators_config") or {}
    model_type = config.get("speculators_model_type")
    if "eagle3" in (model_type, spec.get("algorithm")):
        raise eagle3_unavailable(where)
    if model_type != "eagle":
        raise ValueError(f"{where}: speculators_model_type={model_type!r} is not supported; expected 'eagle'")
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
            "a reduced draft vocabulary needs eagle3 heads, which are not available yet"
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
        "target_model_type": layer_type,
        "draft_layer_config": layer_config_from_foreign(layer_raw, layer_type),
        "eagle_input_norm": False,  # layernorms=false: the layer's input_layernorm is an Identity
    }
    depth = _speculative_tokens(spec)
    if depth is not None:
        fields["tree_depth"] = depth
    verifier = spec.get("verifier") or {}
    return ForeignHeads(fields, tensors, source, target_hint=str(verifier.get("name_or_path") or ""))
