"""EAGLE (1/2) head: fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer (the target's family, else Llama) -> f_{t+1}."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from specheads.heads.base import DraftHeads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.heads.config import HeadsConfig
from specheads.heads.target_rows_vocab import TargetRowsDraftVocab

DRAFT_LAYER_CHOICES = ("auto", "llama")
# fields of a target's config that name its checkpoint, not its layers: left out of the layer configs heads keep
CHECKPOINT_CONFIG_FIELDS = ("architectures", "_name_or_path", "transformers_version", "auto_map", "quantization_config")


def draft_layer_config_from_target(target_config: PretrainedConfig, draft_layer: str = "auto") -> dict[str, Any]:
    """The config (as a dict) of the one decoder layer an EAGLE head owns.

    Args:
        target_config: the target's config.
        draft_layer: "auto": the target's family when its decoder layer has the shape the heads drive (see
            `fits_draft_layer`), else a Llama layer of the target's sizes; "llama": a Llama layer always (what
            SGLang / SpecForge EAGLE-3 checkpoints hold, so Qwen2 heads export to those formats).
    """
    if draft_layer not in DRAFT_LAYER_CHOICES:
        raise ValueError(f"draft_layer={draft_layer!r}; expected one of {DRAFT_LAYER_CHOICES}")
    target_config = target_config.get_text_config()
    if draft_layer == "llama":
        return llama_layer_config_for(target_config)
    layer_config = target_config.to_dict()
    for key in CHECKPOINT_CONFIG_FIELDS:
        layer_config.pop(key, None)
    layer_config["num_hidden_layers"] = 1
    if layer_config.get("layer_types"):
        layer_config["layer_types"] = ["full_attention"]
    try:
        fits = fits_draft_layer(build_layer_config_from_dict(layer_config, target_config.model_type))
    except Exception:  # noqa: BLE001 -- a family transformers cannot rebuild from its own dict: use a Llama layer
        fits = False
    return layer_config if fits else llama_layer_config_for(target_config)


def llama_layer_config_for(target_config: PretrainedConfig) -> dict[str, Any]:
    """A Llama decoder layer config of the target's sizes, for targets whose own layer does not fit.

    What SafeAILab EAGLE and vLLM speculators do for every target: the draft layer is trained from scratch, so
    its family need not be the target's; only the widths (and the rotary base, when the target has one) carry over.
    """
    heads = target_config.num_attention_heads
    hidden = target_config.hidden_size
    intermediate = getattr(target_config, "intermediate_size", None) or getattr(target_config, "n_inner", None)
    act = getattr(target_config, "hidden_act", None)
    eps = next((getattr(target_config, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                if isinstance(getattr(target_config, k, None), float)), 1e-6)
    config = dict(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        hidden_act=act if isinstance(act, str) and act in ACT2FN else "silu",
        rms_norm_eps=eps,
        max_position_embeddings=getattr(target_config, "max_position_embeddings", None) or 2048,
        vocab_size=target_config.vocab_size,
        attention_bias=False,
        mlp_bias=False,
    )
    rope = getattr(target_config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope) if isinstance(rope, dict) else {}  # Gemma 3: one set per layer type
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if isinstance(theta, (int, float)):
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    return config


def fits_draft_layer(layer_config: PretrainedConfig) -> bool:
    """Whether the family's decoder layer has the shape EAGLE heads drive.

    That is Llama's: `self_attn` with q/k/v/o projections (EAGLE-3 widens q/k/v), `input_layernorm`, a dense
    `mlp` (no experts), `post_attention_layernorm` and nothing else (no post-norms, no parallel blocks), a rotary
    embedding called with (x, position_ids), and attention that SDPA can run (no logit soft-capping). The layer
    is built on the meta device: no memory, whatever the target's size.
    """
    if getattr(layer_config, "attn_logit_softcapping", None):
        return False
    try:
        layer_class, rotary_class = decoder_classes(layer_config)
        with torch.device("meta"):
            layer = layer_class(layer_config, layer_idx=0)
    except Exception:  # noqa: BLE001 -- whatever stops the family's layer from being built, it does not fit
        return False
    children = {name for name, _ in layer.named_children()}
    attention = getattr(layer, "self_attn", None)
    rotary_parameters = list(inspect.signature(rotary_class.forward).parameters)[1:]
    return (
        children == {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        and all(isinstance(getattr(attention, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and not hasattr(layer.mlp, "experts")
        and len(rotary_parameters) == 2
    )


def build_layer_config(config: HeadsConfig) -> PretrainedConfig:
    """Rebuild the config of the head's decoder layers (`num_layers` of them: one for EAGLE, SDPA attention)."""
    return build_layer_config_from_dict(config.draft_layer_config, config.target_model_type, config.num_layers)


def build_layer_config_from_dict(
    layer_config: dict[str, Any], default_model_type: str, num_layers: int = 1
) -> PretrainedConfig:
    """A config of `num_layers` full-attention layers of the family `layer_config["model_type"]` (else
    `default_model_type`), SDPA attention."""
    kwargs = dict(layer_config)
    model_type = kwargs.pop("model_type", default_model_type)
    kwargs.update(num_hidden_layers=num_layers, use_cache=True)
    if kwargs.get("layer_types"):  # families that index it by layer_idx
        kwargs["layer_types"] = ["full_attention"] * num_layers
    built = AutoConfig.for_model(model_type, **kwargs)
    built._attn_implementation = "sdpa"
    return built


def decoder_classes(layer_config: PretrainedConfig) -> tuple[type[nn.Module], type[nn.Module]]:
    """The decoder layer and rotary embedding classes of a family (e.g. LlamaDecoderLayer, LlamaRotaryEmbedding).

    Found from the family's own modeling module through `_no_split_modules`, so no modeling file is copied.

    Raises:
        ValueError: the family has no `...DecoderLayer` class with a matching `...RotaryEmbedding`.
    """
    base_model_class = MODEL_MAPPING.get(type(layer_config), None)
    if base_model_class is None or not getattr(base_model_class, "_no_split_modules", None):
        raise ValueError(f"EAGLE heads do not support target model_type={layer_config.model_type!r} (no decoder layer found)")
    module = importlib.import_module(base_model_class.__module__)
    layer_name = base_model_class._no_split_modules[0]
    rotary_name = layer_name.replace("DecoderLayer", "RotaryEmbedding")
    if not hasattr(module, rotary_name):  # vision-language families name it after the text model (Qwen3.5)
        rotary_name = layer_name.replace("DecoderLayer", "TextRotaryEmbedding")
    if "DecoderLayer" not in layer_name or not hasattr(module, layer_name) or not hasattr(module, rotary_name):
        raise ValueError(
            f"EAGLE heads need {layer_name} and {rotary_name} in {module.__name__}; "
            f"target model_type={layer_config.model_type!r} is not a supported decoder-only family"
        )
    return getattr(module, layer_name), getattr(module, rotary_name)


class EagleHeads(TargetRowsDraftVocab, DraftHeads):
    """One EAGLE head, applied autoregressively over features.

    Position t reads (f_t, x_{t+1}): the target's feature at t and the token that followed, and predicts
    f_{t+1}; the target's lm_head on that prediction gives the distribution of x_{t+2}. Features are the
    target's final post-norm hidden states, so predictions go straight into the lm_head.

    With `config.eagle_draft_vocab_size` > 0, drafting scores only the target tokens listed in the `d2t`
    buffer through those rows of the target's lm_head (heads/target_rows_vocab.py).
    """

    float32_linears = ("fc",)  # fuses the target features (outlier dimensions): float32 under int8 drafting

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
        self.init_draft_vocab()  # d2t: (Vd,) target id of each draft id; None = draft over the whole vocabulary
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
            use_cache=past_key_values is not None,
            **cache_kwargs(self.layer, past_key_values),
            position_embeddings=position_embeddings,
        )
        return out[0] if isinstance(out, tuple) else out

    def logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """Token logits of predicted features through the target's lm_head. (..., h) -> (..., V)

        The features are cast to the lm_head's dtype (heads trained in bf16 under DeepSpeed, frozen target in fp32).
        """
        lm_head = self.target_parts.lm_head
        return lm_head(predicted_features.to(lm_head.weight.dtype))
