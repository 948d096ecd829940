"""A draft vocabulary over rows of the target's lm_head, for heads that draft through the target's own lm_head.

EAGLE heads and DFlash heads score their drafts with the target's lm_head: on a large vocabulary that projection is
most of a draft step's cost (SmolLM2: 49,152 rows of 576). With `config.eagle_draft_vocab_size` = N > 0 they draft
over only the N target tokens listed in the `d2t` buffer (the most frequent in the training data; saved in the
checkpoint), through those rows of the lm_head. The weights are unchanged, training and verification use the whole
vocabulary, so outputs stay exact.
"""

from __future__ import annotations

import torch
from torch import nn


class TargetRowsDraftVocab:
    """Mixin of `DraftHeads` subclasses whose `logits` run the target's lm_head: call `init_draft_vocab()` in
    `__init__` (registers `d2t`, None without a draft vocabulary); `draft_logits` / `draft_to_target_ids` then draft
    over it."""

    d2t: torch.Tensor | None

    def init_draft_vocab(self) -> None:
        """Register the `d2t` buffer: (eagle_draft_vocab_size,) target ids, or None (the whole vocabulary)."""
        subset = self.config.eagle_draft_vocab_size
        self.register_buffer("d2t", torch.arange(subset) if subset else None, persistent=True)
        self._draft_rows: tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None] | None = None

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the whole one unless `d2t` is set). (..., h) -> (..., draft_vocab_size)"""
        if self.d2t is None:
            return self.logits(hidden)
        weight, bias = self._draft_projection()
        return nn.functional.linear(hidden.to(weight.dtype), weight, bias)

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
                f"these {self.config.head_type} heads draft over the whole vocabulary (eagle_draft_vocab_size=0); build "
                "them with eagle_draft_vocab_size=N (or use `specheads data draft-vocab`) to set a draft vocabulary"
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
