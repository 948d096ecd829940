"""transformers' logits processors that read the sequence so far, applied to every node of a token tree.

`generate` applies, before temperature / top-k / top-p, processors whose effect depends on the tokens before the
position being scored: sequence biases, the repetition penalty, n-gram blocking (`no_repeat_ngram_size`), bad words,
minimum lengths (`min_length`, `min_new_tokens`: EOS is banned until the sequence is long enough) and suppressed
tokens. In a token tree each node has its own sequence: what was emitted so far plus the node's own path from the
root. So each node's logits are processed by transformers' own processors with that sequence as input_ids (nodes of
one depth share a length: one call per depth), and greedy outputs and sampled laws stay the target's.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from specheads.inference.sampling import SamplingParams
from specheads.inference.tree import TreeBuffers


def transformers_processors(params: SamplingParams, prompt_length: int, eos_ids: list[int], device: torch.device
                            ) -> LogitsProcessorList:
    """transformers' processors for `params`, in the order `generate` builds them, n-gram blocking left out (see
    `SequenceContext`: a ban to -inf, which commutes with the bans after it)."""
    processors = LogitsProcessorList()
    if params.sequence_bias:
        processors.append(SequenceBiasLogitsProcessor(params.sequence_bias))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.bad_words_ids:
        processors.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], eos_ids or None))
    if eos_ids and params.min_length > 0:  # transformers adds the length processors only with an EOS
        processors.append(MinLengthLogitsProcessor(params.min_length, eos_ids, device=device))
    if eos_ids and params.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_new_tokens, eos_ids, device))
    if params.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(list(params.suppress_tokens), device=device))
    if params.begin_suppress_tokens:  # at the first new token only: transformers' begin_index is the prompt length
        processors.append(SuppressTokensAtBeginLogitsProcessor(list(params.begin_suppress_tokens), prompt_length,
                                                               device=device))
    return processors


class SequenceContext:
    """One row's sequence so far (prompt + emitted tokens) and the processors that read it.

    `last` processes the logits after the committed sequence (the prefill's), `tree` those of a drafted tree's
    nodes (each with its own path), `commit` appends emitted tokens. Padding is never part of a row's sequence.

    n-gram blocking is the one processor done here rather than by transformers: its processor collects every
    n-gram of input_ids in Python at each call (the whole sequence, for every node, every round), while an index of
    the committed sequence's n-grams grows with `commit` and only the n-grams that end inside a path are new.
    """

    def __init__(self, prompt: torch.Tensor, params: SamplingParams, eos_ids: list[int]) -> None:
        self.params = params
        self.sequence = prompt.long()  # (L,) committed tokens, on the target's device
        self.processors = transformers_processors(params, prompt.shape[0], eos_ids, prompt.device)
        self.tokens: list[int] = []  # the same tokens on the host, for n-gram blocking
        self.ngrams: dict[tuple[int, ...], set[int]] = {}  # (n-1) tokens -> the tokens that followed them
        if params.no_repeat_ngram_size > 0:
            self._index_ngrams(prompt.tolist())

    def commit(self, tokens: torch.Tensor) -> None:
        """Append emitted tokens (any shape: a 0-d root too) to the sequence."""
        new = tokens.reshape(-1).to(self.sequence.device)
        self.sequence = torch.cat([self.sequence, new])
        if self.params.no_repeat_ngram_size > 0:
            self._index_ngrams(new.tolist())

    def last(self, logits: torch.Tensor) -> torch.Tensor:
        """(1, V) logits after the committed sequence -> processed (1, V) float32."""
        scores = self.processors(self.sequence[None], logits.float().clone())  # generate scores in float32
        return self._ban_ngrams(scores, [0], [[]])

    def tree(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
        """(N, V) logits at a tree's nodes -> processed (N, V) float32.

        Args:
            tokens: (N,) the tree's tokens; node 0, the root, is the last committed token.
            tree: its buffers (nodes in topological order: a node's ancestors have smaller indices).
        """
        scores = logits.float().clone()
        depths = tree.depth.tolist()
        for depth in sorted(set(depths)):
            nodes = [node for node, d in enumerate(depths) if d == depth]
            rows = torch.tensor(nodes, device=scores.device)
            # each node's ancestors, root first and itself last: depth + 1 per row, in index (= depth) order
            ancestors = tree.ancestors[rows].nonzero()[:, 1].view(len(nodes), depth + 1)
            paths = tokens[ancestors[:, 1:]]  # (n, depth): the path below the root
            input_ids = torch.cat([self.sequence.expand(len(nodes), -1), paths], dim=1)  # (n, L + depth)
            processed = self.processors(input_ids, scores[rows])
            if self.params.no_repeat_ngram_size > 0:
                processed = self._ban_ngrams(processed, range(len(nodes)), paths.tolist())
            scores[rows] = processed
        return scores

    def _index_ngrams(self, new: list[int]) -> None:
        n = self.params.no_repeat_ngram_size
        for token in new:
            self.tokens.append(token)
            if len(self.tokens) >= n:
                self.ngrams.setdefault(tuple(self.tokens[-n:-1]), set()).add(self.tokens[-1])

    def _ban_ngrams(self, scores: torch.Tensor, rows: range | list[int], paths: list[list[int]]) -> torch.Tensor:
        """Set to -inf, in each row, the tokens that would complete an n-gram already in `self.tokens + path`."""
        n = self.params.no_repeat_ngram_size
        if n == 0:
            return scores
        for row, path in zip(rows, paths):
            if len(self.tokens) + len(path) < n - 1:
                continue
            window = (self.tokens[-(n - 1):] if n > 1 else []) + path  # every n-gram in it holds a path token
            suffix = tuple(window[len(window) - (n - 1):])  # the sequence's last n - 1 tokens
            banned = set(self.ngrams.get(suffix, ()))
            banned.update(window[start + n - 1] for start in range(len(window) - n + 1)
                          if tuple(window[start : start + n - 1]) == suffix)
            if banned:
                scores[row, list(banned)] = -float("inf")
        return scores
