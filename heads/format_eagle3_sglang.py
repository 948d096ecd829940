"""EAGLE-3 checkpoints in SGLang's layer naming (``layers.0.*``) <-> specheads EAGLE-3 heads.

The same model and config.json as the original format (`specheads.heads.format_eagle3`: ``LlamaForCausalLMEagle3``,
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` offsets, ``t2d``), with the decoder layer's tensors
named ``layers.0.*`` instead of ``midlayer.*`` (``layers.0.hidden_norm.weight`` included). An
``embed_tokens.weight`` copy of the target's embedding is ignored on import and never exported.

Tapped layers follow SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids``: SGLang captures the output of layer
i, i.e. the target's ``hidden_states[i + 1]``. Exports write it (ids = feature_layers - 1) unless a tapped state
is the embedding output (``hidden_states[0]``, which SGLang cannot tap; it then uses its default taps, which equal
specheads' default on targets of 5 layers or more); imports read it back (+1), else use the default taps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from specheads.heads import format_eagle3
from specheads.heads.config import HeadsConfig
from specheads.heads.interop import ForeignHeads, read_config

logger = logging.getLogger(__name__)

HEAD_TYPES = ("eagle3",)
WEIGHTS_FILE = format_eagle3.WEIGHTS_FILE
LAYER_PREFIX = "layers.0."


def foreign_name(name: str, config: HeadsConfig) -> str:
    """SGLang's name of a specheads tensor: ``layer.X`` / ``hidden_norm.*`` -> ``layers.0.X``."""
    return format_eagle3.eagle3_tensor_name(name, LAYER_PREFIX)


def convert_for_export(tensors: dict[str, torch.Tensor], config: HeadsConfig) -> None:
    """``d2t`` as offsets, as in the original format."""
    format_eagle3.convert_for_export(tensors, config)


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """The config.json SGLang reads for these heads."""
    format_eagle3.check_three_layers(config, "eagle3-sglang")
    out = format_eagle3.eagle3_config(config, "eagle3-sglang")
    if min(config.feature_layers) >= 1:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [
                i - 1 for i in config.feature_layers
            ],  # SGLang: output of layer i
            "use_aux_hidden_state": True,
        }
    else:
        logger.warning(
            "feature_layers=%s taps the embedding output, which SGLang cannot; the export records no tapped layers",
            config.feature_layers,
        )
    return out


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of an SGLang-layout EAGLE-3 folder (``layers.0.*``)."""
    config = read_config(folder)
    where = str(folder / "config.json")
    eagle_config = config.get("eagle_config")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    feature_layers = [i + 1 for i in format_eagle3.layer_ids(ids, where, field)] if ids is not None else None
    return format_eagle3.read_eagle3(folder, allow_pickle, LAYER_PREFIX, feature_layers)
