"""transformers' logits processors that read the sequence so far, applied to every node of a token tree.

`generate` applies, before temperature / top-k / top-p, processors whose effect depends on the tokens before the
position being scored: the repetition penalty (every token anywhere in the sequence), n-gram blocking
(`no_repeat_ngram_size`: a token that would repeat an n-gram is banned) and minimum lengths (`min_length`,
`min_new_tokens`: EOS is banned until the sequence is long enough). In a token tree each node has its own sequence:
what was emitted so far plus the node's own path from the root, so each node's logits get their own processing.
Applied in transformers' order; the exact same arithmetic, so greedy outputs and sampled laws stay the target's.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from specheads.inference.sampling import SamplingParams


def context_token_mask(seen: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Which tokens each tree node's sequence holds: the committed ones and the node's path in the tree.

    Args:
        seen: (V,) bool, the tokens of the prompt and of everything emitted so far.
        tokens: (N,) the tree's tokens; ancestors: (N, N) bool, ancestors[i, j] = node j is node i or above it.

    Returns:
        (N, V) bool: row i marks the tokens of the sequence whose last token is node i.
    """
    mask = seen[None].repeat(tokens.shape[0], 1)  # (N, V)
    rows, cols = ancestors.nonzero(as_tuple=True)  # every (node, ancestor-or-self) pair
    mask[rows, tokens[cols]] = True
    return mask


def penalize_repetitions(logits: torch.Tensor, in_context: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: logits of tokens already in the sequence are divided by `penalty` when
    positive and multiplied by it when negative. (N, V) float32 logits, (N, V) bool -> (N, V) float32."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(in_context, penalized, logits)


class SequenceContext:
    """One row's sequence so far (prompt + emitted tokens) and the processors that read it.

    `last` processes the logits after the committed sequence (the prefill's), `tree` those of a drafted tree's
    nodes (each with its own path), `commit` appends emitted tokens. Padding is never part of a row's sequence.
    """

    def __init__(self, prompt: torch.Tensor, vocab_size: int, params: SamplingParams, eos_ids: list[int]) -> None:
        self.params = params
        self.tokens: list[int] = []
        self.prompt_length = int(prompt.shape[0])
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=prompt.device)  # (V,) for the penalty
        self.ngrams: dict[tuple[int, ...], set[int]] = {}  # (n-1) tokens -> the tokens that followed them
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=prompt.device)
        # transformers' own processors, called with each node's own sequence as input_ids: the sequence bias comes
        # first in its order (before the repetition penalty), the token bans after the minimum lengths
        self.biases = LogitsProcessorList()
        if params.sequence_bias:
            self.biases.append(SequenceBiasLogitsProcessor(params.sequence_bias))
        self.bans = LogitsProcessorList()
        if params.bad_words_ids:
            self.bans.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], eos_ids or None))
        if params.suppress_tokens:
            self.bans.append(SuppressTokensLogitsProcessor(list(params.suppress_tokens), device=prompt.device))
        if params.begin_suppress_tokens:  # at the first new token only: transformers' begin_index
            self.bans.append(SuppressTokensAtBeginLogitsProcessor(
                list(params.begin_suppress_tokens), self.prompt_length, device=prompt.device))
        self.commit(prompt.tolist())

    def commit(self, tokens: list[int] | torch.Tensor) -> None:
        """Append emitted tokens to the sequence."""
        new = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)  # a 0-d root too
        n = self.params.no_repeat_ngram_size
        for token in new:
            self.tokens.append(token)
            if n > 0 and len(self.tokens) >= n:
                self.ngrams.setdefault(tuple(self.tokens[-n:-1]), set()).add(self.tokens[-1])
        if new:
            self.seen[torch.tensor(new, device=self.seen.device)] = True

    def last(self, logits: torch.Tensor) -> torch.Tensor:
        """(1, V) logits after the committed sequence -> processed (1, V) float32."""
        return self._process(logits, None, None, [[]])

    def tree(self, logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """(N, V) logits at a tree's nodes -> processed (N, V) float32.

        Args:
            tokens: (N,) the tree's tokens; node 0, the root, is the last committed token.
            ancestors: (N, N) bool, ancestors[i, j] = node j is node i or above it (nodes in topological order).
        """
        paths = []  # per node: its path's tokens after the root (ancestor indices rise with depth)
        if self.params.no_repeat_ngram_size > 0 or self.bans or self.biases:
            listed = tokens.tolist()
            paths = [[listed[j] for j in row.nonzero().flatten().tolist() if j > 0] for row in ancestors.cpu()]
        return self._process(logits, tokens, ancestors, paths)

    def _process(
        self, logits: torch.Tensor, tokens: torch.Tensor | None, ancestors: torch.Tensor | None, paths: list[list[int]]
    ) -> torch.Tensor:
        """Processors in transformers' order; `tokens` / `ancestors` None: one row after the committed sequence."""
        params = self.params
        scores = logits.float()  # generate scores in float32
        if self.biases:
            scores = self._per_depth(self.biases, scores, paths)
        if params.repetition_penalty != 1.0:
            in_context = self.seen[None] if tokens is None else context_token_mask(self.seen, tokens, ancestors)
            scores = penalize_repetitions(scores, in_context, params.repetition_penalty)
        if params.no_repeat_ngram_size > 0:
            scores = scores.clone()
            for node, path in enumerate(paths):
                banned = self._banned_by_ngrams(path)
                if banned:
                    scores[node, list(banned)] = -float("inf")
        if (params.min_length > 0 or params.min_new_tokens > 0) and self.eos.numel():
            depth = 0 if ancestors is None else ancestors.sum(dim=1) - 1  # tokens each path adds after the root
            length = len(self.tokens) + torch.as_tensor(depth, device=scores.device).reshape(-1)  # (N,) or (1,)
            short = (length < params.min_length) | (length - self.prompt_length < params.min_new_tokens)
            if bool(short.any()):
                scores = scores.clone()
                rows = short.nonzero().flatten()
                scores[rows[:, None], self.eos[None, :]] = -float("inf")
        if self.bans:
            scores = self._per_depth(self.bans, scores, paths)
        return scores

    def _per_depth(self, processors: LogitsProcessorList, scores: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """Run transformers' `processors` on every node with its own sequence as input_ids; nodes of one depth have
        sequences of one length, so one call per depth. (N, V) -> (N, V)."""
        scores = scores.clone()
        by_length: dict[int, list[int]] = {}
        for node, path in enumerate(paths):
            by_length.setdefault(len(path), []).append(node)
        for nodes in by_length.values():
            input_ids = torch.tensor([self.tokens + paths[node] for node in nodes], device=scores.device)
            rows = torch.tensor(nodes, device=scores.device)
            scores[rows] = processors(input_ids, scores[rows])
        return scores

    def _banned_by_ngrams(self, path: list[int]) -> set[int]:
        """Tokens that would complete an n-gram already in the sequence `self.tokens + path`."""
        n = self.params.no_repeat_ngram_size
        if len(self.tokens) + len(path) < n - 1:
            return set()
        window = (self.tokens[-(n - 1):] if n > 1 else []) + path  # every n-gram in it holds a path token
        suffix = tuple(window[len(window) - (n - 1):])  # the sequence's last n - 1 tokens
        banned = set(self.ngrams.get(suffix, ()))
        for start in range(len(window) - n + 1):
            if tuple(window[start : start + n - 1]) == suffix:
                banned.add(window[start + n - 1])
        return banned
