"""The MTP layers of Qwen3-Next and Qwen3.5 / Qwen3.6 (dense, MoE, vision-language), which transformers does not load.

These checkpoints ship one multi-token-prediction layer under `mtp.*` (`mtp_num_hidden_layers: 1` in the text config),
trained with the model to predict the token after next:

    mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden   norms of embed(x_{t+1}) and of f_t (the final, post-norm state)
    mtp.fc                                              (h, 2h) projection of [embedding; feature]
    mtp.layers.0.*                                      a full-attention decoder layer of the family (MoE on MoE models)
    mtp.norm                                            the norm before the shared lm_head

That is transformers' `MtpLayer` (enorm, hnorm, eh_proj, mtp_block, post_norm) under other names, the layout Mellum
also uses. transformers 5.x ignores `mtp.*` when it loads these families (their configs declare no `num_mtp_layers`,
so `MtpModel` cannot be built), so here: the layer's config is the text config with one full-attention layer, and the
tensors are read from the target's checkpoint files, the decoder layer's converted by the family's own weight
conversions (experts stored one by one are stacked as transformers stacks the target's). vLLM (`qwen3_next_mtp`,
`qwen3_5_mtp`) and SGLang draft with the same tensors and the same inputs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import cached_file

# text model types whose checkpoints keep MTP layers under `mtp.*`, counted by `mtp_num_hidden_layers`
QWEN_MTP_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# the MTP module's own tensors -> transformers' MtpLayer names
QWEN_MTP_NAMES = {"mtp.pre_fc_norm_embedding.weight": "enorm.weight", "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
                  "mtp.fc.weight": "eh_proj.weight", "mtp.norm.weight": "post_norm.weight"}
BLOCK_PREFIX = "mtp.layers.0."  # the first MTP layer's decoder block (the only one Qwen ships)


def qwen_mtp_layer_count(text_config: PretrainedConfig) -> int:
    """How many MTP layers a Qwen3-Next / Qwen3.5 text config says its checkpoint ships (`mtp_num_hidden_layers`);
    0 for other families."""
    count = getattr(text_config, "mtp_num_hidden_layers", None)
    valid = isinstance(count, int) and not isinstance(count, bool)
    return count if text_config.model_type in QWEN_MTP_FAMILIES and valid else 0


def qwen_mtp_layer_config(text_config: PretrainedConfig) -> PretrainedConfig:
    """The config the MTP layer is built from: the target's text config with one full-attention decoder layer (a
    mixture of experts wherever the family's layers are one)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    if hasattr(config, "mlp_only_layers"):  # Qwen3-Next: layer indices that stay dense; the MTP layer is sparse
        config.mlp_only_layers = []
    return config


def checkpoint_weight_map(name_or_path: str) -> dict[str, Path]:
    """{tensor name: safetensors file} of the checkpoint a target was loaded from (a folder, or a Hub id in the HF
    cache): its index, else its one `model.safetensors`.

    Raises:
        ValueError: no safetensors weights found there.
    """
    def resolve(filename: str) -> str | None:
        return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)

    index = resolve("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = {name: resolve(name) for name in set(weight_map.values())}
        return {tensor: Path(files[name]) for tensor, name in weight_map.items() if files[name] is not None}
    single = resolve("model.safetensors")
    if single is None:
        raise ValueError(f"no safetensors weights found for {name_or_path!r}: the MTP layer is read from the "
                         "checkpoint the target was loaded from")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), Path(single))


def read_mtp_tensors(name_or_path: str) -> dict[str, torch.Tensor]:
    """The first MTP layer's tensors in the checkpoint, by their checkpoint names (`mtp.fc.weight`, ...).

    Raises:
        ValueError: none there (e.g. a copy saved by transformers, which drops them), or quantized ones.
    """
    weight_map = checkpoint_weight_map(name_or_path)
    wanted = [name for name in weight_map if name in QWEN_MTP_NAMES or name.startswith(BLOCK_PREFIX)]
    if not wanted:
        raise ValueError(f"{name_or_path!r} has no mtp.* tensors (a copy saved by transformers' save_pretrained has "
                         "none: transformers drops them when it loads the model; point at the original checkpoint)")
    quantized = [name for name in weight_map
                 if name.startswith("mtp.") and name.endswith(("_scale_inv", "weight_scale", ".qweight", ".scales"))]
    if quantized:
        raise ValueError(f"the MTP layer of {name_or_path!r} is quantized ({quantized[0]}, ...): MTP drafting reads "
                         "floating-point MTP tensors; use the BF16 checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map[name] for name in wanted)):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in wanted if weight_map[name] == file})
    return tensors


def load_qwen_mtp_layer(layer: nn.Module, layer_config: PretrainedConfig, target: PreTrainedModel) -> None:
    """Fill `layer` (transformers' `MtpLayer` of `layer_config`, e.g. built on the meta device) with the first MTP layer
    of the checkpoint `target` was loaded from, on the device of the target's last decoder layer, in its dtype.

    Raises:
        ValueError: `read_mtp_tensors`' errors, or tensors of the layer missing from the checkpoint (named).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    name_or_path = str(target.config.name_or_path)
    tensors = read_mtp_tensors(name_or_path)
    device = next(target.get_decoder().layers[-1].parameters()).device
    dtype = target.dtype
    # The decoder block goes through a one-layer model of the family, where the family's weight conversions (names
    # and expert stacking, as transformers loads the target's own layers) apply to `model.layers.0.*`.
    with torch.device("meta"):
        family = AutoModelForCausalLM.from_config(layer_config)
    block_tensors = {"model.layers.0." + name.removeprefix(BLOCK_PREFIX): tensor
                     for name, tensor in tensors.items() if name.startswith(BLOCK_PREFIX)}
    load_config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(family), device_map={"": device},
                                      dtype=dtype)
    convert_and_load_state_dict_in_model(family, block_tensors, load_config)
    block = family.get_decoder().layers[0]
    state = {f"mtp_block.{name}": value for name, value in block.state_dict().items()}
    state.update({ours: tensors[theirs].to(device=device, dtype=dtype)
                  for theirs, ours in QWEN_MTP_NAMES.items() if theirs in tensors})
    expected = layer.state_dict()
    missing = sorted(name for name in expected if name not in state or state[name].is_meta)
    if missing:
        shown = [next((theirs for theirs, ours in QWEN_MTP_NAMES.items() if ours == name),
                      BLOCK_PREFIX + name.removeprefix("mtp_block.")) for name in missing]
        raise ValueError(f"the MTP layer of {name_or_path!r} lacks {len(missing)} tensor(s) the "
                         f"{layer_config.model_type} MTP layer needs: {shown[:6]}")
    layer.load_state_dict({name: state[name] for name in expected}, assign=True)
