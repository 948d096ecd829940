"""OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias` as logits processors a token tree can use.

OpenAI (and vLLM) subtract from each token's logit `frequency_penalty * count + presence_penalty * (count > 0)`,
`count` being how often the token occurs in the answer so far (the prompt's tokens do not count), and add
`logit_bias[token]` to the listed tokens, before temperature and the top-p / top-k cuts. Both processors are functions
of a row's token sequence only, so `SpeculativeLM.generate` applies them to every tree node with the node's own
path (inference/sequence_processors.py) and its output stays the target's under the same processors: greedy tokens
identical to `target.generate(..., logits_processor=[...])`, sampling from the same law.

    processors = [OccurrencePenalties(prompt_length=ids.shape[1], presence=0.5, frequency=0.3),
                  LogitBias({50256: -100.0})]
    out = lm.generate(ids, logits_processor=processors, max_new_tokens=128)
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessor


class OccurrencePenalties(LogitsProcessor):
    """Presence and frequency penalties over the tokens after the first `prompt_length` of each row.

    Args:
        prompt_length: tokens of the prompt (not counted); every row's sequence starts with the same prompt.
        presence: subtracted once from the logit of every token the answer holds (OpenAI's range: -2 to 2).
        frequency: subtracted per occurrence (OpenAI's range: -2 to 2).
    """

    never_bans = True  # finite shifts: drafting needs no per-node check of banned tokens

    def __init__(self, prompt_length: int, presence: float = 0.0, frequency: float = 0.0) -> None:
        self.prompt_length, self.presence, self.frequency = int(prompt_length), float(presence), float(frequency)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids (R, L), scores (R, V) -> penalised scores (R, V)."""
        answer = input_ids[:, self.prompt_length:]  # (R, L - prompt_length)
        ones = scores.new_ones(()).expand(answer.shape)  # a view: no (R, L) allocation
        counts = torch.zeros_like(scores).scatter_add_(1, answer, ones)  # (R, V) occurrences in the answer
        penalty = counts.clamp(max=1).mul_(self.presence).add_(counts, alpha=self.frequency)
        return scores - penalty


class LogitBias(LogitsProcessor):
    """Adds `bias[token]` to the listed tokens' logits at every step (OpenAI's `logit_bias`: -100 to 100)."""

    never_bans = True

    def __init__(self, bias: dict[int, float]) -> None:
        self.tokens = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """scores (R, V) -> biased scores (R, V)."""
        biased = scores.clone()
        biased[:, self.tokens.to(scores.device)] += self.values.to(scores.device, scores.dtype)
        return biased
