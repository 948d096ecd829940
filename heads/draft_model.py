"""Draft models: a small causal LM sharing the target's tokenizer, or the target's own first layers, drafts the trees.

Trained heads read the target's features; a draft model reads tokens only. It needs no training: any model of the
target's family with the target's tokenizer (Qwen3-0.6B for Qwen3-8B, Llama-3.2-1B for Llama-3.1-8B) drafts, as in
vLLM's and SGLang's draft-model speculation and transformers' assisted generation. Here it drafts the same dynamic
trees as EAGLE heads (top-k children per level, the best nodes kept; inference/draft_model_drafting.py), which the
target verifies in one forward, so the output is the target's whatever the draft model (greedy identical, sampling
exact); only the speed depends on how often it guesses right.

A draft model of ANOTHER tokenizer drafts too, from the tokens both vocabularies share (Token-Level Intersection,
heads/vocab_mapping.py); `from_pretrained` sets that up when the tokenizers differ.

`DraftModelHeads` wraps the draft model as a `DraftHeads`, so that `SpeculativeLM` and everything built on it
(batches, the server, `bench`, constraints, prompt lookup) takes it where it takes heads. It is not a checkpoint:
it is not trained, saved or exported (the draft model is used as it is).

`early_exit_model(target, num_layers)` is self-speculation (Draft & Verify, LayerSkip): the target's first
`num_layers` decoder layers, its final norm and lm_head make the draft model, sharing the target's weights (no
memory). Targets not trained to exit early guess poorly from few layers; LayerSkip-trained checkpoints guess well.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from specheads.heads.base import DraftHeads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.heads.config import DRAFT_MODEL_HEAD_TYPE, HeadsConfig
from specheads.heads.vocab_mapping import VocabMapping

logger = logging.getLogger(__name__)

EARLY_EXIT_PREFIX = "early-exit:"  # `draft_model_name_or_path` of an early-exit draft: "early-exit:N"
# Default trees: a draft model's level costs a forward of a whole (small) LM, far more than a head's, so its trees
# are shallower than the heads' defaults; on CPUs, where every verified node costs time too, also narrower.
DRAFT_MODEL_TREE = dict(tree_depth=5, tree_top_k=4, tree_num_nodes=16)
DRAFT_MODEL_CPU_TREE = dict(tree_depth=4, tree_top_k=4, tree_num_nodes=8)


class DraftModelHeads(DraftHeads):
    """A draft model in the place of heads (see the module docstring).

    Args:
        config: from `DraftModelHeads.config_for(target, name)`: the target's sizes, `head_type="draft_model"`.
        draft_model: a causal LM whose token ids are the target's, or with `vocab_mapping` another tokenizer's.
            Without a mapping its vocabulary may be padded to another size than the target's (only ids both have
            are drafted; target ids it lacks are fed to it as id 0, which can only cost acceptance).
        shares_target_weights: it is made of the target's own modules (`early_exit_model`): then only that target
            is accepted, and nothing may change its layers (int8 drafting is refused).
        vocab_mapping: for a draft model of another tokenizer: the tokens both share (heads/vocab_mapping.py); it
            drafts only those, and reads the committed text through it.
    """

    def __init__(self, config: HeadsConfig, draft_model: PreTrainedModel, shares_target_weights: bool = False,
                 vocab_mapping: VocabMapping | None = None) -> None:
        if config.head_type != DRAFT_MODEL_HEAD_TYPE:
            raise ValueError(f"DraftModelHeads needs head_type={DRAFT_MODEL_HEAD_TYPE!r}, got {config.head_type!r}")
        from specheads.inference.target_support import tree_verification_problem

        problem = tree_verification_problem(draft_model)  # a tree of drafts needs what a tree forward needs
        if problem is not None:
            raise ValueError(f"this draft model cannot draft token trees: {problem}")
        super().__init__(config)  # no post_init: it would re-initialise the draft model's weights
        self.draft_model = draft_model.eval().requires_grad_(False)
        self.shares_target_weights = shares_target_weights
        self.input_rows = draft_model.get_input_embeddings().num_embeddings
        # ids it can draft: its output rows, and only target ids (a vocabulary padded past the target's drafts none)
        self.output_rows = min(draft_model.get_output_embeddings().weight.shape[0], config.vocab_size)
        self.vocab_mapping = None if vocab_mapping is None else vocab_mapping.to(draft_model.device)

    @staticmethod
    def config_for(target: PreTrainedModel, draft_model_name_or_path: str) -> HeadsConfig:
        """The config of a draft model for `target`: its sizes and final hidden state as the `features` the verifier
        returns (unused: the draft model reads tokens), and the draft-model default trees."""
        text = target.config.get_text_config()
        return HeadsConfig(
            head_type=DRAFT_MODEL_HEAD_TYPE, target_name_or_path=str(text.name_or_path or ""),
            target_architectures=list(target.config.architectures or []), target_model_type=text.model_type,
            hidden_size=text.hidden_size, vocab_size=text.vocab_size, feature_layers=[text.num_hidden_layers],
            draft_model_name_or_path=str(draft_model_name_or_path), **DRAFT_MODEL_TREE, cpu_tree=DRAFT_MODEL_CPU_TREE,
        )

    @classmethod
    def around(cls, draft_model: PreTrainedModel, target: PreTrainedModel, name: str | None = None,
               vocab_mapping: VocabMapping | None = None) -> DraftModelHeads:
        """`draft_model` as heads for `target` (named `name` in logs; default: its own name or path; `vocab_mapping`:
        see the class). A draft model built from `target`'s modules (`early_exit_model`) is recognised as such."""
        shares = draft_model.get_input_embeddings() is target.get_input_embeddings()
        if name is None:
            name = str(draft_model.config.name_or_path or type(draft_model).__name__)
            if shares:
                name = f"{EARLY_EXIT_PREFIX}{draft_model.config.get_text_config().num_hidden_layers}"
        return cls(cls.config_for(target, name), draft_model, shares_target_weights=shares, vocab_mapping=vocab_mapping)

    @property
    def draft_vocab_size(self) -> int:
        return self.output_rows if self.vocab_mapping is None else self.vocab_mapping.num_shared

    def draft_to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of drafted ids: the same ids (one tokenizer), or the shared tokens' (a vocabulary mapping)."""
        return ids if self.vocab_mapping is None else self.vocab_mapping.target_ids[ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The draft model's input ids (m,) for committed target ids (n,): the same ids (those past its vocabulary read
        as 0), or through the vocabulary mapping (m may differ from n)."""
        if self.vocab_mapping is not None:
            return self.vocab_mapping.to_draft(target_ids)
        return target_ids.masked_fill(target_ids >= self.input_rows, 0) if self.input_rows < self.config.vocab_size \
            else target_ids

    def drafted_to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """`to_draft_ids` for drafted tokens (always shared ones): one for one, no host sync."""
        if self.vocab_mapping is None:
            return self.to_draft_ids(target_ids)
        return self.vocab_mapping.target_to_draft[target_ids]

    def attach_target(self, target: PreTrainedModel) -> None:
        """Check that this draft model fits `target` (an early-exit draft: that it is made of this very target)."""
        super().attach_target(target)
        if self.shares_target_weights and self.draft_model.get_input_embeddings() is not target.get_input_embeddings():
            raise ValueError(f"this early-exit draft model ({self.config.draft_model_name_or_path}) is made of another "
                             "target's layers; build it from this target: early_exit_model(target, num_layers)")

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        """The draft model's final (post-norm) hidden states (1, T, h_draft) for its (1, T) `input_ids` (draft ids:
        `to_draft_ids`) at `position_ids`, under the 4-D additive `attention_mask` over `cache` + these tokens;
        appends to `cache`."""
        decoder = self.draft_model.base_model
        attention_mask = attention_mask.to(self.draft_model.dtype)  # masks come in the target's dtype
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      **cache_kwargs(decoder, cache), use_cache=True)
        return out.last_hidden_state

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., V') logits over the tokens it drafts (the ids both vocabularies have, or the shared tokens of a
        mapping, by draft id), from the draft model's (..., h_draft) hidden states. Its own logit scaling or
        soft-capping (Gemma 2, Cohere) is not applied: it keeps the order."""
        logits = self.draft_model.get_output_embeddings()(hidden)
        if self.vocab_mapping is not None:
            return logits[..., self.vocab_mapping.draft_ids]
        return logits[..., : self.output_rows]

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"a draft model ({self.config.draft_model_name_or_path}) is used as it is: it has no heads checkpoint to "
            "save; save or share the draft model itself")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"a draft model ({self.config.draft_model_name_or_path}) is used as it is: push the draft model itself")


def early_exit_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM of `target`'s class made of its embedding, its first `num_layers` decoder layers, its final norm and
    its lm_head: the modules themselves, shared (no copy, no memory). Its KV cache is its own.

    Raises:
        ValueError: `num_layers` out of [1, layers - 1], or a target whose decoder does not keep its layers in a
            `layers` list (Llama, Qwen, Mistral, Gemma, Phi-3 and most current families do).
    """
    decoder = target.base_model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or decoder is target:
        raise ValueError(f"early-exit drafting needs a target whose decoder keeps its layers in `layers` (Llama, Qwen, "
                         f"Mistral, Gemma, Phi-3, ...); {type(target).__name__} does not")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers < len(layers):
        raise ValueError(f"early-exit draft of {num_layers!r} layers: expected 1 to {len(layers) - 1} (the target has "
                         f"{len(layers)} decoder layers)")
    if target.config.get_text_config() is not target.config:
        raise ValueError(f"early-exit drafting takes a text-only target; {type(target).__name__} is multimodal")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):  # the skeleton only: every module is replaced by the target's own below
        draft = type(target)(config)
    for name, _ in list(draft.base_model.named_children()):
        setattr(draft.base_model, name, layers[:num_layers] if name == "layers" else getattr(decoder, name))
    for name, child in list(draft.named_children()):
        if child is not draft.base_model:
            setattr(draft, name, getattr(target, name))
    left = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"early-exit drafting could not share {left[:3]} of {type(target).__name__} with the target")
    return draft.eval()


def early_exit_layers_of(name: str) -> int | None:
    """N of an 'early-exit:N' drafting string, or None for any other string.

    Raises:
        ValueError: 'early-exit:' followed by something else than a number of layers.
    """
    if not name.startswith(EARLY_EXIT_PREFIX):
        return None
    layers = name.removeprefix(EARLY_EXIT_PREFIX)
    if not layers.isdigit():
        raise ValueError(f"{name!r}: expected {EARLY_EXIT_PREFIX}N with N a number of layers")
    return int(layers)


def check_drafting_source(heads: Any, draft_model: Any, early_exit_layers: Any, mtp: bool = False) -> None:
    """Raise a ValueError unless exactly one of heads, draft_model, early_exit_layers (not None) and mtp (True) is
    given."""
    given = [name for name, value in (("heads", heads), ("draft_model", draft_model),
                                      ("early_exit_layers", early_exit_layers), ("mtp", mtp or None))
             if value is not None]
    if len(given) != 1:
        raise ValueError("SpeculativeLM.from_pretrained: give exactly one of heads, draft_model, early_exit_layers and "
                         f"mtp=True (what drafts for the target); got {given or 'none'}")


def same_vocabulary(target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether both tokenizers map every token to the same id."""
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def draft_model_heads(
    target: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None,
    draft_model: str | os.PathLike | None = None,
    early_exit_layers: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> DraftModelHeads:
    """`DraftModelHeads` for `target`: the `draft_model` (a path, Hub id or alias, loaded as targets are, in the
    target's dtype and device; its tokenizer checked against `target_tokenizer`), or the target's first
    `early_exit_layers` layers (one of the two). A draft model of another tokenizer drafts the tokens both
    vocabularies share (`VocabMapping`; a warning says how many)."""
    from specheads.targets import load_target

    if (draft_model is None) == (early_exit_layers is None):
        raise ValueError("give either draft_model (a small causal LM) or early_exit_layers (the target's first N "
                         "layers draft)")
    if early_exit_layers is not None:
        return DraftModelHeads.around(early_exit_model(target, early_exit_layers), target)
    model, tokenizer = load_target(draft_model, dtype=dtype or target.dtype, device=device or target.device)
    mapping = None
    if target_tokenizer is not None and not same_vocabulary(target_tokenizer, tokenizer):
        rows = model.get_output_embeddings().weight.shape[0]
        mapping = VocabMapping(target_tokenizer, tokenizer, target.config.get_text_config().vocab_size, rows)
        logger.warning("draft model %r has another tokenizer than the target: it drafts the %d tokens both "
                       "vocabularies share (of the target's %d)", str(draft_model), mapping.num_shared,
                       len(target_tokenizer))
    return DraftModelHeads.around(model, target, name=str(draft_model), vocab_mapping=mapping)
