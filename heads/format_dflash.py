"""z-lab's DFlash drafter format (z-lab/dflash, the `DFlashDraftModel` checkpoints on the Hub; SGLang, vLLM and
SpecForge read the same) <-> specheads DFlash heads.

Layout:

- ``config.json``: a Qwen3Config (``model_type`` "qwen3", ``architectures`` ["DFlashDraftModel"]) of the drafter's
  layers (``num_hidden_layers`` of them, the target's hidden size), ``block_size`` and ``dflash_config``:
  ``{"mask_token_id": m, "target_layer_ids": [...]}``; ``num_target_layers`` the target's depth.
- ``model.safetensors``: ``fc.weight`` (h, n*h), ``hidden_norm.weight``, ``layers.<i>.*`` (Qwen3 decoder layers:
  ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``mlp.*``, ``input_layernorm``,
  ``post_attention_layernorm``), ``norm.weight`` -- the names specheads uses, one to one.

``target_layer_ids`` count decoder layers (the output of layer i is ``hidden_states[i + 1]``), specheads'
``feature_layers`` index the ``hidden_states`` tuple: feature_layers = target_layer_ids + 1. DFlash-2 drafters
(``DFlash2DraftModel``: convolutions and a candidate selector), sliding-window or causal drafter layers and
DFlash's logit transforms (``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``) are
refused by name: these heads do not run them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specheads.heads.config import HeadsConfig
from specheads.heads.dflash import default_trees
from specheads.heads.format_eagle import layer_config_for_export, layer_config_from_foreign
from specheads.heads.interop import ForeignHeads, read_config, read_tensors, require_field

HEAD_TYPES = ("dflash",)
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
# dflash_config entries with a value these heads run; any other value is refused by name
NEUTRAL_OPTIONS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
DFLASH_KEYS = ("block_size", "dflash_config", "num_target_layers", "is_causal", "use_sliding_window", "sliding_window",
               "max_window_layers", "layer_types")


def foreign_name(name: str, config: HeadsConfig) -> str:
    """z-lab's name of a specheads tensor: the same."""
    return name


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """z-lab's config.json for these heads."""
    out = layer_config_for_export(config)
    out.update(
        model_type="qwen3",
        architectures=[ARCHITECTURE],
        block_size=config.block_size,
        dflash_config={"mask_token_id": config.block_mask_token, "target_layer_ids": [i - 1 for i in config.feature_layers]},
        layer_types=["full_attention"] * config.num_layers,
        use_sliding_window=False,
        tie_word_embeddings=False,
        base_model_name_or_path=config.target_name_or_path,
    )
    return out


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of a DFlash drafter folder.

    Raises:
        ValueError: a DFlash-2 drafter, drafter layers or logit transforms these heads do not run, missing or invalid
            ``hidden_size`` / ``vocab_size`` / ``block_size`` / ``dflash_config`` fields.
    """
    config = read_config(folder)
    where = str(folder / "config.json")
    architectures = config.get("architectures") or []
    if any(name != ARCHITECTURE and name.startswith("DFlash") for name in architectures):
        raise ValueError(f"{where}: architectures={architectures} is a DFlash variant these heads do not run (DFlash-2's "
                         f"convolutions and candidate selector); expected {[ARCHITECTURE]}")
    options = config.get("dflash_config")
    if not isinstance(options, dict):
        raise ValueError(f"{where}: missing field 'dflash_config' (a dict with mask_token_id and target_layer_ids)")
    for name, neutral in NEUTRAL_OPTIONS.items():
        value = options.get(name, config.get(name, neutral))
        if value != neutral and not (neutral is None and not value):
            raise ValueError(f"{where}: {name}={value!r} is not run by specheads' DFlash heads (expected "
                             f"{neutral!r}); this drafter cannot be imported")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types) or config.get("is_causal"):
        raise ValueError(f"{where}: layer_types={layer_types}, is_causal={config.get('is_causal')!r}: the drafter's "
                         "layers see the whole block and context here (full, bidirectional attention); sliding-window "
                         "or causal drafter layers are not run")
    hidden_size = require_field(config, "hidden_size", int, where)
    vocab_size = require_field(config, "vocab_size", int, where)
    num_layers = require_field(config, "num_hidden_layers", int, where)
    block_size = options.get("block_size", config.get("block_size"))
    mask_token = options.get("mask_token_id")
    layer_ids = options.get("target_layer_ids")
    for name, value in (("block_size", block_size), ("dflash_config.mask_token_id", mask_token)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: field {name}={value!r} should be an int")
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) and i >= 0 for i in layer_ids):
        raise ValueError(f"{where}: field dflash_config.target_layer_ids={layer_ids!r} should be a list of layer indices")
    tensors, source = read_tensors(folder, (WEIGHTS_FILE,), allow_pickle)
    raw = {k: v for k, v in config.items() if k not in DFLASH_KEYS}
    layer = layer_config_from_foreign(raw, "qwen3")
    layer.update(num_hidden_layers=num_layers, layer_types=["full_attention"] * num_layers, use_sliding_window=False,
                 sliding_window=None)
    fields = {
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "num_layers": num_layers,
        "block_size": block_size,
        "block_mask_token": mask_token,
        "feature_layers": [i + 1 for i in layer_ids],
        "draft_layer_config": layer,
        **default_trees(block_size),
    }
    return ForeignHeads(fields, tensors, source, target_hint=str(config.get("base_model_name_or_path") or ""),
                        head_type="dflash")
