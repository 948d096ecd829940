"""MTP layers that transformers ships in the checkpoint but does not load, read from the checkpoint here: Qwen3-Next's,
Qwen3.5's / Qwen3.6's (dense, MoE, vision-language) and GLM-4.7-Flash's.

Each is one multi-token-prediction layer trained with the model to predict the token after next, transformers'
`MtpLayer` (enorm, hnorm, eh_proj, mtp_block, post_norm) under the checkpoint's names:

    Qwen3-Next, Qwen3.5 / 3.6 (`mtp_num_hidden_layers: 1`)    GLM-4.7-Flash (`num_nextn_predict_layers: 1`, N layers)
    mtp.pre_fc_norm_embedding    enorm: embed(x_{t+1})          model.layers.N.enorm
    mtp.pre_fc_norm_hidden       hnorm: f_t (final, post-norm)  model.layers.N.hnorm
    mtp.fc                       eh_proj: (h, 2h)               model.layers.N.eh_proj
    mtp.layers.0.*               a full-attention decoder layer of the family (MoE on MoE models)   model.layers.N.*
    mtp.norm                     post_norm, before the lm_head  model.layers.N.shared_head.norm

(the Qwen names are Mellum's too, the GLM ones DeepSeek-V3's; GLM's own copies of the embedding and lm_head,
`shared_head.head` and `embed_tokens`, are the target's and not read). transformers 5.x skips these tensors when it
loads the model (the configs of these families declare no `num_mtp_layers`, so its `MtpModel` cannot be built), so
here: the layer's config is the text config with one full-attention, mixture-of-experts decoder layer, and the
tensors are read from the checkpoint the target was loaded from, the decoder layer's converted by the family's own
weight conversions (experts stored one by one are stacked as transformers stacks the target's). vLLM
(`qwen3_next_mtp`, `qwen3_5_mtp`, `glm4_moe_lite_mtp`) and SGLang draft with the same tensors and inputs.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import cached_file

# text model type -> the config field counting its MTP layers; its checkpoint's layout: "mtp" (`mtp.*`) or
# "after_layers" (`model.layers.N.*`, N = num_hidden_layers)
CHECKPOINT_MTP_FAMILIES = {"qwen3_next": ("mtp_num_hidden_layers", "mtp"),
                           "qwen3_5_text": ("mtp_num_hidden_layers", "mtp"),
                           "qwen3_5_moe_text": ("mtp_num_hidden_layers", "mtp"),
                           "glm4_moe_lite": ("num_nextn_predict_layers", "after_layers")}
# the MTP module's own tensors in the `mtp.*` layout -> transformers' MtpLayer names
QWEN_MTP_NAMES = {"mtp.pre_fc_norm_embedding.weight": "enorm.weight", "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
                  "mtp.fc.weight": "eh_proj.weight", "mtp.norm.weight": "post_norm.weight"}
BLOCK_PREFIX = "mtp.layers.0."  # the first MTP layer's decoder block in the `mtp.*` layout
# in the layout after the decoder layers (DeepSeek-V3's names): the module's tensors, and copies of the target's
AFTER_LAYERS_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                      "shared_head.norm.weight": "post_norm.weight"}
TARGETS_OWN = ("shared_head.head.weight", "embed_tokens.weight")


def checkpoint_mtp_layer_count(text_config: PretrainedConfig) -> int:
    """How many MTP layers the checkpoint of a family in `CHECKPOINT_MTP_FAMILIES` ships, by its config; 0 for other
    families."""
    field, _ = CHECKPOINT_MTP_FAMILIES.get(text_config.model_type, (None, None))
    count = getattr(text_config, field, None) if field else None
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def checkpoint_mtp_layer_config(text_config: PretrainedConfig) -> PretrainedConfig:
    """The config the MTP layer is built from: the target's text config with one full-attention decoder layer, a
    mixture of experts wherever the family has experts (as transformers' `get_mtp_config` makes MTP layers)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:  # Qwen3-Next / Qwen3.5: DeltaNet or attention per layer
        config.layer_types = ["full_attention"]
    if getattr(config, "mlp_layer_types", None) is not None:  # GLM-4.7-Flash: dense or sparse per layer
        config.mlp_layer_types = ["sparse"]
    if hasattr(config, "mlp_only_layers"):  # Qwen3-Next: layer indices that stay dense
        config.mlp_only_layers = []
    return config


def mtp_tensor_names(text_config: PretrainedConfig) -> tuple[str, dict[str, str], tuple[str, ...]]:
    """(the decoder block's checkpoint prefix, {checkpoint name: MtpLayer name} of the module's own tensors, the
    checkpoint names to leave unread) of the first MTP layer of a `CHECKPOINT_MTP_FAMILIES` family."""
    _, layout = CHECKPOINT_MTP_FAMILIES[text_config.model_type]
    if layout == "mtp":
        return BLOCK_PREFIX, dict(QWEN_MTP_NAMES), ()
    prefix = f"model.layers.{text_config.num_hidden_layers}."
    return prefix, {prefix + theirs: ours for theirs, ours in AFTER_LAYERS_NAMES.items()}, tuple(
        prefix + name for name in TARGETS_OWN)


def checkpoint_file(name_or_path: str, filename: str) -> str | None:
    """The local path of one file of the checkpoint a target was loaded from (a folder, or a Hub id: from the HF
    cache, downloaded when online and not there); None when the checkpoint has no such file."""
    return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)


def checkpoint_weight_map(name_or_path: str) -> dict[str, str]:
    """{tensor name: safetensors file name} of the checkpoint a target was loaded from: its shard index, else its one
    `model.safetensors` (only the index is fetched for a sharded one).

    Raises:
        ValueError: no safetensors weights found there.
    """
    index = checkpoint_file(name_or_path, "model.safetensors.index.json")
    if index is not None:
        return dict(json.loads(Path(index).read_text())["weight_map"])
    single = checkpoint_file(name_or_path, "model.safetensors")
    if single is None:
        raise ValueError(f"no safetensors weights (model.safetensors or its index) found for {name_or_path!r}: MTP "
                         "layers are read from, and exported into, a model's safetensors checkpoint")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def read_mtp_tensors(name_or_path: str, block_prefix: str, module_names: dict[str, str],
                     unread: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The first MTP layer's tensors in the checkpoint (those under `block_prefix` and the `module_names`, not the
    `unread` ones), by their checkpoint names, opening (and fetching) only the files that hold them.

    Raises:
        ValueError: none there (e.g. a copy saved by transformers, which drops them), quantized ones, or a file of
            the index missing.
    """
    weight_map = checkpoint_weight_map(name_or_path)
    wanted = [name for name in weight_map
              if (name in module_names or name.startswith(block_prefix)) and name not in unread]
    if not wanted:
        raise ValueError(f"{name_or_path!r} has no {block_prefix}* tensors: no MTP layer (a copy saved by transformers' "
                         "save_pretrained has none: transformers drops them when it loads the model; point at the "
                         "original checkpoint)")
    scope = os.path.commonprefix([block_prefix, *module_names])  # "mtp." or "model.layers.N."
    quantized = [name for name in weight_map
                 if name.startswith(scope) and name.endswith(("_scale_inv", "weight_scale", ".qweight", ".scales"))]
    if quantized:
        raise ValueError(f"the MTP layer of {name_or_path!r} is quantized ({quantized[0]}, ...): MTP drafting reads "
                         "floating-point MTP tensors; use the BF16 checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for filename in sorted(set(weight_map[name] for name in wanted)):
        path = checkpoint_file(name_or_path, filename)
        if path is None:
            raise ValueError(f"{name_or_path!r}: {filename}, which its index names for the MTP layer, is missing")
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in wanted if weight_map[name] == filename})
    return tensors


def load_checkpoint_mtp_layer(layer: nn.Module, layer_config: PretrainedConfig, target: PreTrainedModel) -> None:
    """Fill `layer` (transformers' `MtpLayer` of `layer_config`, e.g. built on the meta device) with the first MTP layer
    of the checkpoint `target` (a `CHECKPOINT_MTP_FAMILIES` family) was loaded from, on the device of the target's last
    decoder layer, in its dtype.

    Raises:
        ValueError: `read_mtp_tensors`' errors, or tensors of the layer missing from the checkpoint (named).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    name_or_path = str(target.config.name_or_path)
    block_prefix, module_names, unread = mtp_tensor_names(target.config.get_text_config())
    tensors = read_mtp_tensors(name_or_path, block_prefix, module_names, unread)
    device = next(target.get_decoder().layers[-1].parameters()).device
    dtype = target.dtype
    # The decoder block goes through a one-layer model of the family, where the family's weight conversions (names
    # and expert stacking, as transformers loads the target's own layers) apply to `model.layers.0.*`.
    with torch.device("meta"):
        family = AutoModelForCausalLM.from_config(layer_config)
    block_tensors = {"model.layers.0." + name.removeprefix(block_prefix): tensor for name, tensor in tensors.items()
                     if name.startswith(block_prefix) and name not in module_names}
    load_config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(family), device_map={"": device},
                                      dtype=dtype)
    convert_and_load_state_dict_in_model(family, block_tensors, load_config)
    block = family.get_decoder().layers[0]
    state = {f"mtp_block.{name}": value for name, value in block.state_dict().items()}
    state.update({ours: tensors[theirs].to(device=device, dtype=dtype)
                  for theirs, ours in module_names.items() if theirs in tensors})
    expected = layer.state_dict()
    missing = sorted(name for name in expected if name not in state or state[name].is_meta)
    if missing:
        shown = [next((theirs for theirs, ours in module_names.items() if ours == name),
                      block_prefix + name.removeprefix("mtp_block.")) for name in missing]
        raise ValueError(f"the MTP layer of {name_or_path!r} lacks {len(missing)} tensor(s) the "
                         f"{layer_config.model_type} MTP layer needs: {shown[:6]}")
    layer.load_state_dict({name: state[name] for name in expected}, assign=True)
