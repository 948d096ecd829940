"""MTP drafting: the target's own multi-token-prediction layer drafts the trees (no training).

DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7 and other recent models ship an MTP (NextN) module beside their decoder layers,
trained with the model to predict the token after next:

    h' = block(eh_proj([enorm(embed(x_{t+1})); hnorm(f_t)]))     f_t: the target's final (post-norm) hidden state
    p(x_{t+2}) = softmax(lm_head(post_norm(h')))

That is an EAGLE head in all but name (the same inputs, one decoder layer of the target's family, the target's
lm_head), so here it drafts the same dynamic trees as EAGLE heads (`EagleDrafter`: top-k children per level, the best
nodes kept), read autoregressively over its own outputs as SGLang's and vLLM's MTP drafting does; the target verifies
each tree in one forward, so the output is the target's (greedy identical, sampling exact). transformers'
`generate(use_mtp=True)` drafts a chain with the same layer; a tree accepts more per target forward.

The layer is built and loaded by transformers itself (`transformers.modeling_layers.MtpModel.from_pretrained`: the
target's layer class, the checkpoint's MTP tensors renamed and converted, the embedding and lm_head shared with the
target), so any family transformers knows the MTP layout of works. With several MTP layers (e.g. Step-3.5) only the
first drafts, at every depth.

`MtpHeads` is not a checkpoint: the weights are the target's (`save_pretrained` refuses).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specheads.heads.base import DraftHeads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.heads.config import MTP_HEAD_TYPE, HeadsConfig

# Default trees (not measured on a real MTP model here): an MTP level costs one decoder layer of the target's family
# (a mixture of experts on DeepSeek and GLM), about an EAGLE head's; on CPUs, where every verified node costs, smaller.
MTP_TREE = dict(tree_depth=5, tree_top_k=8, tree_num_nodes=24)
MTP_CPU_TREE = dict(tree_depth=4, tree_top_k=4, tree_num_nodes=8)


def mtp_layer_count(target: PreTrainedModel) -> int:
    """How many MTP layers `target`'s config declares (`num_mtp_layers`, DeepSeek's `num_nextn_predict_layers`); 0 for
    none."""
    count = getattr(target.config.get_text_config(), "num_mtp_layers", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def load_mtp_model(target: PreTrainedModel) -> nn.Module:
    """transformers' `MtpModel` of `target`: its MTP layers loaded from the checkpoint folder `target` was loaded from,
    on the device of its last decoder layer, in its dtype, the embedding and lm_head shared with it.

    Raises:
        ValueError: transformers without MTP support, a target whose config declares no MTP layer (naming its
            family), a target not loaded from a checkpoint (built from a config), or a checkpoint without the MTP
            tensors (e.g. a re-saved copy: transformers drops them when it loads the target).
    """
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError as err:
        raise ValueError("MTP drafting needs transformers >= 5.24 (transformers.modeling_layers.MtpModel); "
                         "pip install -U 'transformers>=5.24'") from err
    text = target.config.get_text_config()
    if mtp_layer_count(target) < 1:
        raise ValueError(
            f"target {text.name_or_path or text.model_type!r} (model_type={text.model_type!r}) declares no MTP layer "
            f"(num_mtp_layers={getattr(text, 'num_mtp_layers', None)!r}); MTP drafting needs a model shipped with one "
            "(DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7, ...): use --heads, --draft-model or --early-exit-layers instead")
    if not target.config.name_or_path:
        raise ValueError("MTP drafting reads the MTP layers from the folder the target was loaded from; this target "
                         "was built from a config (config.name_or_path is empty): load it with from_pretrained")
    layers = target.get_decoder().layers
    device = next(layers[-1].parameters()).device
    try:
        return MtpModel.from_pretrained(target, device_map={"": device}).eval().requires_grad_(False)
    except (RuntimeError, ValueError, OSError) as err:
        raise ValueError(f"could not load the MTP layers of {target.config.name_or_path!r}: {err} (a copy saved by "
                         "transformers' save_pretrained has none: transformers drops them when it loads the "
                         "model; point at the original checkpoint)") from err


class MtpHeads(DraftHeads):
    """The target's MTP layer in the place of heads (see the module docstring).

    The GPU fast path drafts with it eagerly (`static_drafting = False`): its layer may be a mixture of experts,
    whose routing a CUDA graph cannot hold.

    Args:
        config: from `MtpHeads.config_for(target)`: the target's sizes, `head_type="mtp"`, the MTP default trees.
        mtp_model: `load_mtp_model(target)`; its first layer drafts.
    """

    static_drafting = False

    def __init__(self, config: HeadsConfig, mtp_model: nn.Module) -> None:
        if config.head_type != MTP_HEAD_TYPE:
            raise ValueError(f"MtpHeads needs head_type={MTP_HEAD_TYPE!r}, got {config.head_type!r}")
        super().__init__(config)  # no post_init: it would re-initialise the loaded MTP weights
        self.mtp_model = mtp_model
        self.layer = mtp_model.layers[0]
        # it holds the target's embedding and lm_head (shared): int8 drafting, which would change them, is refused
        self.shares_target_weights = True

    @staticmethod
    def config_for(target: PreTrainedModel) -> HeadsConfig:
        """The config of `target`'s MTP drafting: its sizes, its final (post-norm) hidden state as the feature the MTP
        layer reads, the MTP default trees."""
        text = target.config.get_text_config()
        return HeadsConfig(
            head_type=MTP_HEAD_TYPE, target_name_or_path=str(text.name_or_path or ""),
            target_architectures=list(target.config.architectures or []), target_model_type=text.model_type,
            hidden_size=text.hidden_size, vocab_size=text.vocab_size, feature_layers=[text.num_hidden_layers],
            **MTP_TREE, cpu_tree=MTP_CPU_TREE,
        )

    @classmethod
    def from_target(cls, target: PreTrainedModel) -> MtpHeads:
        """`target`'s own MTP layer as heads (`load_mtp_model`'s errors)."""
        return cls(cls.config_for(target), load_mtp_model(target))

    def attach_target(self, target: PreTrainedModel) -> None:
        """Check that these MTP layers are `target`'s own (they share its embedding)."""
        super().attach_target(target)
        if self.mtp_model.embed_tokens is not target.get_input_embeddings():
            raise ValueError(f"these MTP heads are the MTP layers of another target ({self.config.target_name_or_path!r}) "
                             "model instance; build them from this one: MtpHeads.from_target(target)")

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        """The MTP layer's outputs (B, T, h) (after its post-norm: what the lm_head reads and the next depth reads as
        its feature) for (B, T, h) `features` f_t and the (B, T) tokens x_{t+1} that followed them, at `position_ids`,
        under the 4-D additive `attention_mask` over the cached + T keys; appends to `past_key_values` (its own cache,
        layer 0)."""
        mtp = self.mtp_model
        embeds = mtp.embed_tokens(input_ids).to(features.dtype)  # (B, T, h)
        rotary = mtp.rotary_emb
        position_embeddings = None if rotary is None else rotary(embeds, position_ids=position_ids)
        hidden = self.layer(embeds, features, position_embeddings=position_embeddings,
                            attention_mask=attention_mask.to(features.dtype), position_ids=position_ids,
                            **cache_kwargs(self.layer, past_key_values))
        if getattr(mtp, "use_shared_post_norm", False):  # Inkling: one norm after every MTP layer
            hidden = mtp.shared_post_norm(hidden)
        return hidden

    def logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """(..., V) logits of the MTP layer's outputs through the target's lm_head (its muP scaling when it has one)."""
        multiplier = getattr(self.mtp_model.config, "logits_mup_width_multiplier", None)
        hidden = predicted_features if multiplier is None else predicted_features / multiplier
        lm_head = self.mtp_model.shared_head  # the target's own
        return lm_head(hidden.to(lm_head.weight.dtype))[..., : self.config.vocab_size]

    def draft_logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits (`logits`): MTP layers have no reduced draft vocabulary."""
        return self.logits(predicted_features)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("MTP heads are the target's own MTP layers: they live in the target's checkpoint and "
                                  "have no heads checkpoint to save")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("MTP heads are the target's own MTP layers: push the target itself")
