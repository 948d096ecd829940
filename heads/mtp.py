"""MTP heads: the target's own multi-token-prediction layer drafts the trees (no training needed; it can be fine-tuned).

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
target), so any family transformers knows the MTP layout of works; the layers transformers ships but does not load
(Qwen3-Next's, Qwen3.5's, GLM-4.7-Flash's) are read by heads/checkpoint_mtp.py into the same `MtpLayer`. With several MTP layers (e.g. Step-3.5) only the
first drafts, at every depth. A sliding-window MTP layer (Mellum's) sees the last `sliding_window` positions, as
transformers runs it.

`MtpHeads` is a head type like the others once built: its weights are its own copy of the MTP layer (the target's
embedding and lm_head borrowed, never saved), so it trains (`specheads train head.type=mtp`: fine-tuning the MTP layer
on the target's post-training answers, which it never saw), saves and loads as a specheads checkpoint. Its config's
`draft_layer_config` is the target's MTP config (transformers' `get_mtp_config()`), from which the layer is rebuilt.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from specheads.heads.base import DraftHeads, target_embedding_sample
from specheads.heads.cache_keyword import cache_kwargs
from specheads.heads.checkpoint_mtp import (
    checkpoint_mtp_layer_config,
    checkpoint_mtp_layer_count,
    load_checkpoint_mtp_layer,
)
from specheads.heads.config import MTP_HEAD_TYPE, HeadsConfig
from specheads.heads.eagle import CHECKPOINT_CONFIG_FIELDS, decoder_classes
from specheads.heads.target_rows_vocab import TargetRowsDraftVocab

# Default trees (not measured on a real MTP model here): an MTP level costs one decoder layer of the target's family
# (a mixture of experts on DeepSeek and GLM), about an EAGLE head's; on CPUs, where every verified node costs, smaller.
MTP_TREE = dict(tree_depth=5, tree_top_k=8, tree_num_nodes=24)
MTP_CPU_TREE = dict(tree_depth=4, tree_top_k=4, tree_num_nodes=8)


def mtp_layer_count(target: PreTrainedModel) -> int:
    """How many MTP layers `target`'s config declares (`num_mtp_layers`, DeepSeek's `num_nextn_predict_layers`, Qwen's
    `mtp_num_hidden_layers`); 0 for none."""
    return declared_mtp_layers(target.config.get_text_config())


def declared_mtp_layers(text_config: PretrainedConfig) -> int:
    """`mtp_layer_count` of a text config (a model folder's, nothing loaded)."""
    count = getattr(text_config, "num_mtp_layers", None)
    valid = isinstance(count, int) and not isinstance(count, bool)
    return count if valid else checkpoint_mtp_layer_count(text_config)


def reads_checkpoint_mtp(config: PretrainedConfig) -> bool:
    """Whether a target's MTP layer is read by heads/checkpoint_mtp.py (Qwen3-Next's, Qwen3.5's, GLM-4.7-Flash's,
    which this transformers does not load) rather than by transformers' `MtpModel`."""
    text = config.get_text_config()
    return getattr(text, "num_mtp_layers", None) is None and checkpoint_mtp_layer_count(text) > 0


def mtp_classes() -> tuple[type[nn.Module], type[nn.Module]]:
    """transformers' (MtpModel, MtpLayer).

    Raises:
        ValueError: a transformers without them (before 5.24).
    """
    try:
        from transformers.modeling_layers import MtpLayer, MtpModel
    except ImportError as err:
        raise ValueError("MTP heads need transformers >= 5.24 (transformers.modeling_layers.MtpModel); "
                         "pip install -U 'transformers>=5.24'") from err
    return MtpModel, MtpLayer


def mtp_layer_config(target_config: PretrainedConfig) -> dict[str, Any]:
    """The config (as a dict) of the target's MTP layers: transformers' `get_mtp_config()` (the target's text config
    with the MTP layers' counts and types; for the families heads/checkpoint_mtp.py reads, `checkpoint_mtp_layer_config`),
    without the fields that name the checkpoint."""
    if reads_checkpoint_mtp(target_config):
        layer_config = checkpoint_mtp_layer_config(target_config.get_text_config()).to_dict()
    else:
        layer_config = target_config.get_mtp_config().to_dict()
    for key in CHECKPOINT_CONFIG_FIELDS:
        layer_config.pop(key, None)
    return layer_config


def check_mtp_target(target: PreTrainedModel) -> None:
    """Raise a ValueError unless `target` declares an MTP layer that can be loaded and was loaded from a checkpoint
    (where the MTP tensors are read): naming its family when it declares none or this transformers cannot build it."""
    text = target.config.get_text_config()
    shipped = getattr(text, "num_nextn_predict_layers", None) or getattr(text, "mtp_num_hidden_layers", None)
    declared = mtp_layer_count(target)
    if declared < 1 and shipped:  # in the checkpoint, but this transformers builds no MTP layer for it
        raise ValueError(
            f"target {text.name_or_path or text.model_type!r} ships {shipped} MTP layer(s) but transformers "
            f"{transformers.__version__} does not load MTP layers for model_type={text.model_type!r} (no num_mtp_layers "
            "in its config class); MTP drafting needs a transformers release that does")
    if declared < 1:
        raise ValueError(
            f"target {text.name_or_path or text.model_type!r} (model_type={text.model_type!r}) declares no MTP layer "
            f"(num_mtp_layers={getattr(text, 'num_mtp_layers', None)!r}); MTP drafting needs a model shipped with one "
            "(DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7 / 4.7-Flash, Qwen3-Next, Qwen3.5, ...): use --heads, --draft-model or "
            "--early-exit-layers instead")
    if not target.config.name_or_path:
        raise ValueError("MTP drafting reads the MTP layers from the folder the target was loaded from; this target "
                         "was built from a config (config.name_or_path is empty): load it with from_pretrained")


def load_mtp_model(target: PreTrainedModel) -> nn.Module:
    """transformers' `MtpModel` of `target`: its MTP layers loaded from the checkpoint folder `target` was loaded from,
    on the device of its last decoder layer, in its dtype, the embedding and lm_head shared with it.

    Raises:
        ValueError: transformers without MTP support, `check_mtp_target`'s errors, or a checkpoint without the MTP
            tensors (e.g. a re-saved copy: transformers drops them when it loads the target).
    """
    MtpModel = mtp_classes()[0]  # noqa: N806 (a class)
    check_mtp_target(target)
    layers = target.get_decoder().layers
    device = next(layers[-1].parameters()).device
    try:
        return MtpModel.from_pretrained(target, device_map={"": device}).eval().requires_grad_(False)
    except (RuntimeError, ValueError, OSError) as err:
        raise ValueError(f"could not load the MTP layers of {target.config.name_or_path!r}: {err} (a copy saved by "
                         "transformers' save_pretrained has none: transformers drops them when it loads the "
                         "model; point at the original checkpoint)") from err


class MtpHeads(TargetRowsDraftVocab, DraftHeads):
    """An MTP layer of the target's family as heads (see the module docstring): its `layer` (transformers'
    `MtpLayer`: enorm, hnorm, eh_proj, the decoder block, post_norm) reads (f_t, x_{t+1}) and predicts f_{t+1}, whose
    logits through the target's lm_head rank x_{t+2}.

    `MtpHeads(config)` builds the layer with fresh weights; `MtpHeads.from_target(target)` (and `create_heads(target,
    "mtp")`) holds the target's own MTP layer, as shipped. The GPU fast path drafts with it eagerly
    (`static_drafting = False`): its layer may be a mixture of experts, whose routing a CUDA graph cannot hold.
    """

    static_drafting = False

    def __init__(self, config: HeadsConfig) -> None:
        if config.head_type != MTP_HEAD_TYPE or not config.draft_layer_config:
            raise ValueError(f"MtpHeads needs head_type={MTP_HEAD_TYPE!r} and the target's MTP config in "
                             f"draft_layer_config; got head_type={config.head_type!r}")
        super().__init__(config)
        _, mtp_layer_class = mtp_classes()
        layer_config = self.layer_config
        layer_class, rotary_class = decoder_classes(layer_config)
        with torch.device("meta"):  # only to find the family's norm class, as transformers' MtpModel does
            probe = layer_class(layer_config, layer_idx=0)
        norm_class = next(type(module) for name, module in probe.named_modules() if "norm" in name)
        # MtpModel's rule: with `chain_hidden_post_norm` in the config, no norm per layer but maybe one shared
        chained = hasattr(layer_config, "chain_hidden_post_norm")
        self.layer = mtp_layer_class(layer_config, layer_class, norm_class, 0, use_post_norm=not chained)
        shared = chained and layer_config.chain_hidden_post_norm
        self.shared_post_norm = norm_class(layer_config.hidden_size, eps=layer_config.rms_norm_eps) if shared else None
        self.rotary_emb = rotary_class(config=layer_config)
        # families with rotary parameters per layer type (Mellum) are asked for the MTP layer's type, as MtpModel does
        nested = getattr(layer_config, "nested_rope_parameter_keys", None)
        per_type = nested is not None and bool(getattr(layer_config, "rope_parameters", None)) and bool(
            nested(layer_config.rope_parameters))
        self.rope_kwargs = {"layer_type": layer_config.layer_types[0]} if per_type else {}
        # a sliding-window MTP layer (Mellum's) sees only the last `sliding_window` positions, as it was trained
        types = getattr(layer_config, "layer_types", None) or []
        self.sliding_window = layer_config.sliding_window if types[:1] == ["sliding_attention"] else None
        # muP models scale the lm_head's input (transformers' MtpModel divides by this); None for the others
        self.logits_divisor = getattr(layer_config, "logits_mup_width_multiplier", None)
        self.init_draft_vocab()  # `eagle_draft_vocab_size`: draft over those rows of the lm_head only (d2t)
        self.post_init()

    @property
    def layer_config(self) -> PretrainedConfig:
        """The MTP layer's transformers config, rebuilt from `config.draft_layer_config` (SDPA attention)."""
        kwargs = dict(self.config.draft_layer_config)
        built = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        built._attn_implementation = "sdpa"
        return built

    @staticmethod
    def config_for(target: PreTrainedModel, **options: Any) -> HeadsConfig:
        """The heads config of `target`'s MTP layer: its sizes, its final (post-norm) hidden state as the feature the
        layer reads, its MTP config, the MTP default trees (`options`: any HeadsConfig field over those)."""
        text = target.config.get_text_config()
        return HeadsConfig(
            head_type=MTP_HEAD_TYPE, target_name_or_path=str(text.name_or_path or ""),
            target_architectures=list(target.config.architectures or []), target_model_type=text.model_type,
            hidden_size=text.hidden_size, vocab_size=text.vocab_size, feature_layers=[text.num_hidden_layers],
            draft_layer_config=mtp_layer_config(target.config),
            target_embedding_sample=target_embedding_sample(target.get_input_embeddings().weight),
            **{**MTP_TREE, "cpu_tree": MTP_CPU_TREE, **options},
        )

    @classmethod
    def from_target(cls, target: PreTrainedModel, **options: Any) -> MtpHeads:
        """`target`'s own (first) MTP layer as heads, attached to it (`load_mtp_model`'s or `load_checkpoint_mtp_layer`'s
        errors; `options`: HeadsConfig fields, e.g. the tree or `eagle_draft_vocab_size`)."""
        check_mtp_target(target)
        # Qwen3-Next, Qwen3.5, GLM-4.7-Flash: read by heads/checkpoint_mtp.py; the others: transformers' MtpModel
        mtp = None if reads_checkpoint_mtp(target.config) else load_mtp_model(target)
        with torch.device("meta"):  # a skeleton: no memory spent on fresh weights
            heads = cls(cls.config_for(target, **options))
        if mtp is None:  # the checkpoint's tensors assigned to the skeleton's layer
            load_checkpoint_mtp_layer(heads.layer, heads.layer_config, target)
        else:  # the loaded layer takes the skeleton's place
            heads.layer = mtp.layers[0]
            heads.shared_post_norm = mtp.shared_post_norm if mtp.use_shared_post_norm else None
        if heads.d2t is not None:  # a draft vocabulary asked for (options): the first ids until set_draft_vocab
            heads.d2t = torch.arange(heads.config.eagle_draft_vocab_size, device=target.device)
        heads.layer.requires_grad_(True)  # the heads' own copy: trainable (fine-tuning), as heads are
        if heads.shared_post_norm is not None:
            heads.shared_post_norm.requires_grad_(True)
        with torch.device(target.device):  # its buffers (inverse frequencies) computed, on the target's device
            heads.rotary_emb = type(heads.rotary_emb)(config=heads.layer_config)
        heads.attach_target(target)
        return heads.eval()

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
        under the 4-D additive `attention_mask` over the cached + T keys; appends to `past_key_values` (the heads' own
        cache, layer 0), or None (training)."""
        embeds = self.target_parts.embed_tokens(input_ids).to(features.dtype)  # (B, T, h)
        position_embeddings = self.rotary_emb(embeds, position_ids, **self.rope_kwargs)
        mask = attention_mask.to(features.dtype)
        if self.sliding_window:
            mask = self.outside_window_masked(mask, position_ids)
        hidden = self.layer(embeds, features, position_embeddings=position_embeddings, attention_mask=mask,
                            position_ids=position_ids, **cache_kwargs(self.layer, past_key_values))
        return hidden if self.shared_post_norm is None else self.shared_post_norm(hidden)

    def outside_window_masked(self, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The (B or 1, 1, T, S) additive `mask` with the keys `sliding_window` or more positions behind each query
        masked too. Key j sits at position j: true of every committed entry of the drafting cache (and of training's
        keys); drafted entries sit after them, within a tree's depth of their queries, so never masked."""
        keys = torch.arange(mask.shape[-1], device=mask.device)
        far = position_ids[:, None, :, None] - keys >= self.sliding_window  # (B, 1, T, S)
        return mask.masked_fill(far, torch.finfo(mask.dtype).min)

    def logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """(..., V) logits of the MTP layer's outputs through the target's lm_head (with its muP scaling when it has
        one, as transformers' MtpModel applies it)."""
        lm_head = self.target_parts.lm_head
        return lm_head(self.lm_head_input(predicted_features).to(lm_head.weight.dtype))[..., : self.config.vocab_size]

    def lm_head_input(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads: the MTP layer's outputs, divided by the muP width multiplier where there is one."""
        return predicted_features if self.logits_divisor is None else predicted_features / self.logits_divisor

    def draft_logits(self, predicted_features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary: the whole one (`logits`), or with `eagle_draft_vocab_size` the lm_head's
        rows of the `d2t` ids only (a 248K-token vocabulary's projection is most of a Qwen3.5 MTP step's cost)."""
        if self.d2t is None:
            return self.logits(predicted_features)
        return super().draft_logits(self.lm_head_input(predicted_features))
