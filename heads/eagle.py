"""EAGLE (1/2) head: fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer of the target's family -> f_{t+1}."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from specheads.heads.base import DraftHeads
from specheads.heads.config import HeadsConfig


def draft_layer_config_from_target(target_config: PretrainedConfig) -> dict[str, Any]:
    """The target's config as a dict, cut down to the one decoder layer an EAGLE head owns."""
    layer_config = target_config.get_text_config().to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "auto_map", "quantization_config"):
        layer_config.pop(key, None)
    layer_config["num_hidden_layers"] = 1
    if layer_config.get("layer_types"):
        layer_config["layer_types"] = ["full_attention"]
    return layer_config


def build_layer_config(config: HeadsConfig) -> PretrainedConfig:
    """Rebuild the target-family config for the head's single decoder layer (layer_idx 0, SDPA attention)."""
    kwargs = dict(config.draft_layer_config)
    model_type = kwargs.pop("model_type", config.target_model_type)
    kwargs.update(num_hidden_layers=1, use_cache=True)
    layer_config = AutoConfig.for_model(model_type, **kwargs)
    layer_config._attn_implementation = "sdpa"
    return layer_config


def decoder_classes(layer_config: PretrainedConfig) -> tuple[type[nn.Module], type[nn.Module]]:
    """The decoder layer and rotary embedding classes of the target's family (e.g. LlamaDecoderLayer).

    Found from the family's own modeling module through `_no_split_modules`, so any Llama-like family
    (Llama, Qwen2, Mistral, ...) works without copying a modeling file.
    """
    base_model_class = MODEL_MAPPING.get(type(layer_config), None)
    if base_model_class is None or not getattr(base_model_class, "_no_split_modules", None):
        raise ValueError(f"EAGLE heads do not support target model_type={layer_config.model_type!r} (no decoder layer found)")
    module = importlib.import_module(base_model_class.__module__)
    layer_name = base_model_class._no_split_modules[0]
    rotary_name = layer_name.replace("DecoderLayer", "RotaryEmbedding")
    if not hasattr(module, layer_name) or not hasattr(module, rotary_name):
        raise ValueError(
            f"EAGLE heads need {layer_name} and {rotary_name} in {module.__name__}; "
            f"target model_type={layer_config.model_type!r} is not a supported decoder-only family"
        )
    return getattr(module, layer_name), getattr(module, rotary_name)


class EagleHeads(DraftHeads):
    """One EAGLE head, applied autoregressively over features.

    Position t reads (f_t, x_{t+1}): the target's feature at t and the token that followed, and predicts
    f_{t+1}; the target's lm_head on that prediction gives the distribution of x_{t+2}. Features are the
    target's final post-norm hidden states, so predictions go straight into the lm_head.
    """

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        layer_config = build_layer_config(config)
        layer_class, rotary_class = decoder_classes(layer_config)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = layer_class(layer_config, layer_idx=0)
        if not config.eagle_input_norm:
            # EAGLE-1/2: fc's output enters attention un-normalised (its checkpoints have no such weight).
            self.layer.input_layernorm = nn.Identity()
        self.rotary_emb = rotary_class(config=layer_config)
        self.post_init()

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        """Predict the next features.

        Args:
            features: (B, T, h) target (or previously predicted) features f_t.
            input_ids: (B, T) the tokens x_{t+1} that followed each feature.
            position_ids: (B, T) positions t.
            attention_mask: (B or 1, 1, T, S) additive float mask over the S = cached + T keys.
            past_key_values: the head's own `DynamicCache` (drafting), or None (training).

        Returns:
            (B, T, h) predicted features f_{t+1}.
        """
        embeds = self.target_parts.embed_tokens(input_ids).to(features.dtype)  # (B, T, h)
        hidden = self.fc(torch.cat([embeds, features], dim=-1))  # (B, T, h)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        out = self.layer(
            hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=past_key_values is not None,
            position_embeddings=position_embeddings,
        )
        return out[0] if isinstance(out, tuple) else out

    def logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """Token logits of predicted features through the target's lm_head. (..., h) -> (..., V)"""
        return self.target_parts.lm_head(predicted_features)

    @property
    def draft_vocab_size(self) -> int:
        """Width of `logits`: the target's whole vocabulary (EAGLE-3 heads draft over a reduced one)."""
        return self.config.vocab_size

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of `logits` indices: the same ids here (EAGLE-3 maps them through its d2t)."""
        return draft_ids
