"""EAGLE (1/2) head: fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer of the target's family -> f_{t+1}."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from specheads.heads.base import DraftHeads
from specheads.heads.cache_keyword import cache_kwargs
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

    With `config.eagle_draft_vocab_size` > 0, drafting scores only the target tokens listed in the `d2t`
    buffer (the most frequent in the training data; saved in the checkpoint) through those rows of the
    target's lm_head: on a large vocabulary that projection is most of a draft step's cost. Training and
    verification still use the whole vocabulary, so outputs stay exact.
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
        subset = config.eagle_draft_vocab_size
        # (Vd,) target id of each draft id; None = draft over the whole vocabulary
        self.register_buffer("d2t", torch.arange(subset) if subset else None, persistent=True)
        self._draft_rows: tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None] | None = None
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

    def draft_logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the whole one unless `d2t` is set). (..., h) -> (..., draft_vocab_size)"""
        if self.d2t is None:
            return self.logits(predicted_features)
        weight, bias = self._draft_projection()
        return nn.functional.linear(predicted_features, weight, bias)

    def _draft_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target lm_head's rows of the draft vocabulary, (Vd, h) (+ bias), gathered once and reused until
        the lm_head weight or d2t change (moved, reloaded or edited in place)."""
        lm_head = self.target_parts.lm_head
        weight = lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, self.d2t.data_ptr(), self.d2t._version)
        if self._draft_rows is None or self._draft_rows[0] != key:
            rows = self.d2t.to(weight.device)
            bias = getattr(lm_head, "bias", None)
            self._draft_rows = (key, weight.detach()[rows], None if bias is None else bias.detach()[rows])
        return self._draft_rows[1], self._draft_rows[2]

    @property
    def draft_vocab_size(self) -> int:
        """Width of `draft_logits`: `eagle_draft_vocab_size` when set, else the target's whole vocabulary."""
        return self.config.eagle_draft_vocab_size or self.config.vocab_size

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of `draft_logits` indices (mapped through d2t when the draft vocabulary is reduced)."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    @torch.no_grad()
    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Draft over these target ids only: (eagle_draft_vocab_size,) ids, sorted ascending, unique, < vocab_size.

        Raises:
            ValueError: the heads were built without `eagle_draft_vocab_size`, or the ids are not a valid vocabulary.
        """
        if self.d2t is None:
            raise ValueError(
                "these EAGLE heads draft over the whole vocabulary (eagle_draft_vocab_size=0); build them with "
                "eagle_draft_vocab_size=N (or use `specheads data draft-vocab`) to set a draft vocabulary"
            )
        size = self.config.eagle_draft_vocab_size
        self.d2t.copy_(check_draft_vocab(draft_to_target, size, self.config.vocab_size).to(self.d2t.device))

    def check_draft_vocab_buffers(self, source: str) -> None:
        """Raise a ValueError naming `source` when a loaded d2t is not a valid draft vocabulary."""
        if self.d2t is None:
            return
        try:
            check_draft_vocab(self.d2t, self.config.eagle_draft_vocab_size, self.config.vocab_size)
        except ValueError as err:
            raise ValueError(f"{source}: tensor d2t is invalid: {err}") from err


def check_draft_vocab(draft_to_target: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """Return `draft_to_target` as a (draft_vocab_size,) long tensor after checking it; raise a ValueError if bad.

    A valid draft vocabulary lists `draft_vocab_size` target ids, sorted ascending (hence unique), each in
    [0, vocab_size).
    """
    integer = isinstance(draft_to_target, torch.Tensor) and not (
        draft_to_target.dtype.is_floating_point
        or draft_to_target.dtype.is_complex
        or draft_to_target.dtype == torch.bool
    )
    if not integer:
        raise ValueError(
            f"draft vocabulary must be an integer tensor of target ids, got {str(draft_to_target)[:80]}"
        )
    ids = draft_to_target.detach().long().cpu()
    if ids.shape != (draft_vocab_size,):
        raise ValueError(
            f"draft vocabulary has shape {tuple(ids.shape)}; expected ({draft_vocab_size},) (draft_vocab_size)"
        )
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"draft vocabulary holds target ids in [{ids.min().item()}, {ids.max().item()}]; "
            f"expected ids in [0, {vocab_size}) (vocab_size)"
        )
    steps = ids[1:] - ids[:-1]
    if (steps <= 0).any():
        at = int((steps <= 0).nonzero()[0])
        raise ValueError(
            f"draft vocabulary must be sorted ascending with unique ids; ids[{at}]={ids[at].item()} is followed by "
            f"ids[{at + 1}]={ids[at + 1].item()}"
        )
    return ids
