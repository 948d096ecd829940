"""The reduced draft vocabulary of EAGLE-3 heads: the target tokens the heads will most often have to predict.

    counts = count_trained_tokens(dataset["input_ids"], dataset["loss_mask"], vocab_size=512)
    vocab = build_draft_vocab(counts, draft_vocab_size=256, always_include=tokenizer.all_special_ids)
    heads.set_draft_vocab(vocab.draft_to_target)     # vocab.coverage: share of training tokens it covers

Counted are the tokens the heads are trained to predict (`loss_mask == 1`, assistant tokens). The vocabulary
keeps the `draft_vocab_size` most frequent ones, ties broken by the lower id, plus the tokenizer's special
tokens (EOS must always be draftable). It is a pure function of the data, so every process of a
multi-process run computes the same vocabulary without any communication.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DraftVocab:
    """A draft vocabulary and how much of the training data it covers."""

    draft_to_target: torch.Tensor  # (Vd,) long: the target id of each draft id, sorted ascending
    coverage: float  # fraction of the counted training tokens whose id is in the vocabulary


def count_trained_tokens(
    input_ids: Iterable[Sequence[int]], loss_masks: Iterable[Sequence[int]], vocab_size: int
) -> torch.Tensor:
    """How often each target token is a trained label (`loss_mask == 1`) in the data.

    Args:
        input_ids: one token-id sequence per example.
        loss_masks: one 0/1 sequence per example, aligned with `input_ids` (1 = predicting this token is trained).
        vocab_size: the target's vocabulary size.

    Returns:
        (vocab_size,) long counts.

    Raises:
        ValueError: an example whose mask length differs from its token count, or a token id outside [0, vocab_size).
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for n, (ids, mask) in enumerate(zip(input_ids, loss_masks, strict=True)):
        ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask).bool()
        if ids_t.shape != mask_t.shape:
            raise ValueError(
                f"example {n}: {ids_t.numel()} tokens but a loss mask of {mask_t.numel()} values"
            )
        trained = ids_t[mask_t]
        if trained.numel() and (trained.min() < 0 or trained.max() >= vocab_size):
            bad = trained[(trained < 0) | (trained >= vocab_size)][0].item()
            raise ValueError(
                f"example {n} holds token id {bad}; expected ids in [0, {vocab_size}) (the target's vocab_size)"
            )
        counts += torch.bincount(trained, minlength=vocab_size)
    return counts


def select_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> torch.Tensor:
    """The `draft_vocab_size` target ids to draft: `always_include` first, then the most frequent (ties: lower id).

    Args:
        counts: (V,) token counts (`count_trained_tokens`).
        draft_vocab_size: how many ids to keep (<= V). Unseen tokens fill the rest in id order when the data
            holds fewer distinct tokens.
        always_include: ids kept whatever their count (the tokenizer's special tokens); ids >= V are ignored
            (some tokenizers list special tokens beyond the model's embedding).

    Returns:
        (draft_vocab_size,) long target ids, sorted ascending.

    Raises:
        ValueError: draft_vocab_size outside [1, V], or more special ids than draft_vocab_size.
    """
    vocab_size = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} is invalid; expected 1 <= draft_vocab_size <= {vocab_size}"
        )
    forced = sorted({int(i) for i in always_include if 0 <= int(i) < vocab_size})
    if len(forced) > draft_vocab_size:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} cannot hold the tokenizer's {len(forced)} special tokens {forced}"
        )
    # rank by count, descending; a stable sort keeps ids ascending among equal counts
    ranked = torch.sort(-counts, stable=True).indices  # (V,)
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[forced] = True
    free = ranked[~keep[ranked]][: draft_vocab_size - len(forced)]
    keep[free] = True
    return keep.nonzero().squeeze(1)  # sorted ascending


def vocab_coverage(counts: torch.Tensor, draft_to_target: torch.Tensor) -> float:
    """Fraction of the counted tokens whose id is in the draft vocabulary (0.0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[draft_to_target.to(counts.device)].sum()) / total if total else 0.0


def build_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> DraftVocab:
    """`select_draft_vocab` plus its coverage of the counted tokens."""
    ids = select_draft_vocab(counts, draft_vocab_size, always_include)
    return DraftVocab(ids, vocab_coverage(counts, ids))


def special_token_ids(tokenizer: Any, target: Any = None) -> list[int]:
    """The tokenizer's special ids plus the target's EOS ids (generation config), which drafts must be able to end on."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for config in (getattr(target, "generation_config", None), getattr(target, "config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(int(i) for i in ids)


def eagle_heads_with_draft_vocab(heads: Any, draft_to_target: torch.Tensor) -> Any:
    """A copy of trained EAGLE (or DFlash, or MTP) heads that drafts over `draft_to_target` only (`eagle_draft_vocab_size` =
    its length).

    These heads score drafts through the target's lm_head, so the weights are unchanged: only the config and the
    `d2t` buffer differ. The copy is not attached to a target (`SpeculativeLM` / `attach_target` do that).

    Raises:
        ValueError: `heads` are not EAGLE or DFlash heads, or the ids are not a valid vocabulary (sorted, unique,
            < vocab_size).
    """
    from specheads.heads.target_rows_vocab import TargetRowsDraftVocab

    if not isinstance(heads, TargetRowsDraftVocab):
        raise ValueError(
            f"a draft vocabulary can be added to eagle, dflash and mtp heads only, not {heads.config.head_type} heads "
            "(eagle3 heads get theirs when they are trained: head.options.draft_vocab_size)"
        )
    config = copy.deepcopy(heads.config)
    config.eagle_draft_vocab_size = int(draft_to_target.numel())
    config.validate_values()
    reduced = type(heads)(config)
    weights = {k: v for k, v in heads.state_dict().items() if k != "d2t"}
    missing, unexpected = reduced.load_state_dict(weights, strict=False)
    if set(missing) != {"d2t"} or unexpected:  # the same architecture: only d2t may differ
        raise RuntimeError(f"copying {config.head_type} heads: missing {missing}, unexpected {unexpected}")
    param = next(heads.parameters())
    reduced.to(device=param.device, dtype=param.dtype)
    reduced.set_draft_vocab(draft_to_target)
    reduced.model_card_metrics = dict(heads.model_card_metrics)
    return reduced.train(heads.training)


def eagle3_heads_with_wider_vocab(heads: Any, target: Any, draft_to_target: torch.Tensor) -> Any:
    """A copy of trained EAGLE-3 heads whose draft vocabulary is widened to `draft_to_target`, to train on.

    The heads' own draft tokens keep their trained lm_head rows; each new token's row starts from the target's
    lm_head row, as fresh heads' rows do (`init_lm_head_from_target`). Those rows are not yet in the trained rows'
    scale, so the widened heads draft worse until they are trained (with `init_heads=` and
    `head.options.draft_vocab_size=` the new size): session 22 saw 96 CPU steps repair such heads (docs/training.md).

    Raises:
        ValueError: `heads` are not EAGLE-3 heads, or `draft_to_target` does not hold all of their draft tokens, or
            is not a valid vocabulary (sorted, unique, < vocab_size).
    """
    from specheads.heads.eagle3 import Eagle3Heads

    if type(heads) is not Eagle3Heads:
        raise ValueError(f"widening a draft vocabulary applies to eagle3 heads, not {heads.config.head_type} heads")
    old = heads.d2t.cpu()
    new = draft_to_target.cpu().long()
    missing = old[~torch.isin(old, new)]
    if missing.numel():
        raise ValueError(
            f"the widened draft vocabulary lacks {missing.numel()} of the heads' {old.numel()} draft tokens "
            f"(e.g. {missing[:5].tolist()}): it must hold all of them"
        )
    config = copy.deepcopy(heads.config)
    config.draft_vocab_size = int(new.numel())
    config.validate_values()
    wider = Eagle3Heads(config)
    weights = {k: v for k, v in heads.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing_keys, unexpected = wider.load_state_dict(weights, strict=False)
    if set(missing_keys) != {"lm_head.weight", "d2t", "t2d"} or unexpected:
        raise RuntimeError(f"copying EAGLE-3 heads: missing {missing_keys}, unexpected {unexpected}")
    param = next(heads.parameters())
    wider.to(device=param.device, dtype=param.dtype)
    wider.set_draft_vocab(new.to(param.device))  # validates the ids
    target_rows = target.get_output_embeddings().weight.detach()  # (V, h)
    with torch.no_grad():  # (Vd', d): at the draft's width (projected when it is not the target's)
        rows = heads.target_rows_at_draft_width(target_rows, new).to(device=param.device, dtype=param.dtype)
        rows[torch.searchsorted(new, old).to(param.device)] = heads.lm_head.weight.detach()  # the trained rows
        wider.lm_head.weight.copy_(rows)
    wider.model_card_metrics = dict(heads.model_card_metrics)
    return wider.train(heads.training)
