"""Stopping criteria (stop strings, a time budget, the caller's own), checked token by token on what rounds accept.

A round can accept several tokens at once, while `generate` checks its criteria after every single token. So each
accepted token is appended and the criteria checked in turn, and the row ends right after the first token at which
any criterion fires (that token kept, as `generate` keeps it): the output is the target's own, cut where
`generate` would cut it. EOS and `max_new_tokens` stay with the decoding loop.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import (
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from specheads.inference.sequence_processors import merge_processors


def stopping_criteria_for(
    generation_config: Any,
    stopping_criteria: StoppingCriteriaList | list[StoppingCriteria] | None = None,
    stop_strings: str | list[str] | None = None,
    max_time: float | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> StoppingCriteriaList | None:
    """The criteria `generate` would build besides EOS and the length (None when there are none).

    `stop_strings` and `max_time` default to the target's generation config, as in transformers; the caller's
    `stopping_criteria` are merged by transformers' rule (one of the same type as a built one replaces it).

    Raises:
        ValueError: stop strings without a tokenizer (transformers raises the same), or a max_time <= 0.
        TypeError: a stopping criterion that is not callable.
    """
    if stop_strings is None:
        stop_strings = getattr(generation_config, "stop_strings", None)
    if max_time is None:
        max_time = getattr(generation_config, "max_time", None)
    criteria = StoppingCriteriaList()
    if max_time is not None:
        if not max_time > 0:
            raise ValueError(f"max_time={max_time!r} must be > 0 seconds")
        criteria.append(MaxTimeCriteria(max_time=float(max_time)))
    if stop_strings:
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={stop_strings!r} need the target's tokenizer: pass tokenizer= to generate (or build the "
                "SpeculativeLM with tokenizer=, as from_pretrained does)"
            )
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    for criterion in stopping_criteria or ():
        if not callable(criterion):
            raise TypeError(f"stopping_criteria holds {criterion!r}, which is not callable (input_ids, scores) -> "
                            "bool tensor; expected transformers StoppingCriteria objects")
    criteria = merge_processors(criteria, StoppingCriteriaList(stopping_criteria or ()))
    return criteria or None


class StopChecker:
    """One row's sequence and the criteria to check on it as tokens are emitted."""

    def __init__(self, criteria: StoppingCriteriaList, prompt: torch.Tensor) -> None:
        self.criteria = criteria
        self.sequence = prompt.detach().long().reshape(1, -1)  # (1, L): prompt + emitted, on the target's device

    def first_stop(self, tokens: list[int]) -> int | None:
        """Append `tokens` one at a time; the index of the first after which a criterion fires (None: none did).

        The criteria see (1, L) input_ids and scores=None: speculative rounds score whole trees, not one
        distribution per emitted token, so criteria that read scores are not supported."""
        for index, token in enumerate(tokens):
            new = torch.tensor([[token]], dtype=torch.long, device=self.sequence.device)
            self.sequence = torch.cat([self.sequence, new], dim=1)
            if bool(self.criteria(self.sequence, None).any()):
                return index
        return None


def emit_tokens(
    tokens: list[int], out: list[int], max_new_tokens: int, eos: set[int], streamer: Any | None,
    stop: StopChecker | None = None,
) -> bool:
    """Append a round's accepted `tokens` to a row's `out`, stopping right after EOS, right after the token at which a
    stopping criterion fires, or at max_new_tokens; the appended ones go to `streamer`. Returns True when done."""
    room = max_new_tokens - len(out)
    taken = tokens[:room]
    for i, token in enumerate(taken):
        if token in eos:
            taken = taken[: i + 1]
            break
    stopped = False
    if stop is not None:
        first = stop.first_stop(taken)
        if first is not None:
            taken, stopped = taken[: first + 1], True
    out.extend(taken)
    if streamer is not None and taken:
        streamer.put(torch.tensor(taken))
    return stopped or len(out) >= max_new_tokens or (bool(taken) and taken[-1] in eos)
