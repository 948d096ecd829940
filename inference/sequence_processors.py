"""Logits processors that read the sequence so far, applied to every node of a token tree.

`generate` applies, before temperature / top-k / top-p, processors whose effect depends on the tokens before the
position being scored: sequence biases, the repetition penalty, n-gram blocking (`no_repeat_ngram_size`), bad words,
minimum lengths (`min_length`, `min_new_tokens`: EOS is banned until the sequence is long enough), a
`prefix_allowed_tokens_fn` constraint, suppressed tokens, and the caller's own `logits_processor` list (grammars,
JSON schemas, custom bans). In a token tree each node has its own sequence: what was emitted so far plus the node's
own path from the root. So each node's logits are processed by the same processors, in `generate`'s order, with that
sequence as input_ids (nodes of one depth share a length: one call per depth, depths in increasing order, so a
processor that caches per sequence prefix, as outlines' do, has seen every node's parent first), and greedy outputs
and sampled laws stay the target's. Acceptance asks only for the nodes it reaches (`SequenceContext.nodes`, from
inference/accept.py), and EAGLE drafting for the frontier of each draft level (`allowed_after`), parents first too.

A caller's processor must therefore be a function of each row's input_ids and scores: it is called with a tree
depth's nodes as the rows (any number of them, not the caller's batch), and a row's sequence never holds padding.
One that counts its calls or keeps per-batch-row state (xgrammar's transformers processor advances a matcher by
one token per call) would be wrong here, as it would be under transformers' own assisted generation. A processor that
only moves scores by finite amounts may say so (`never_bans = True`, as inference/openai_penalties.py's do): EAGLE
drafting then skips asking it which tokens it bans.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList

from specheads.inference.sampling import SamplingParams
from specheads.inference.tree import TreeBuffers

ProcessorList = TypeVar("ProcessorList", LogitsProcessorList, StoppingCriteriaList)


def transformers_processors(
    params: SamplingParams,
    prompt_length: int,
    eos_ids: list[int],
    device: torch.device,
    row: int = 0,
    ngrams: LogitsProcessor | None = None,
) -> LogitsProcessorList:
    """The processors `generate` builds for `params`, in its order, with the caller's `logits_processor` merged in
    as `generate` merges them (`merge_processors`).

    Args:
        row: the caller's batch row, passed to `prefix_allowed_tokens_fn` as its batch_id (every tree node of the
            row gets it; transformers' processor would pass the node's index).
        ngrams: the n-gram blocking processor, at transformers' place for it (`SequenceContext` gives its index).
    """
    processors = LogitsProcessorList()
    if params.sequence_bias:
        processors.append(SequenceBiasLogitsProcessor(params.sequence_bias))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if ngrams is not None:
        processors.append(ngrams)
    if params.bad_words_ids:
        processors.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], eos_ids or None))
    if eos_ids and params.min_length > 0:  # transformers adds the length processors only with an EOS
        processors.append(MinLengthLogitsProcessor(params.min_length, eos_ids, device=device))
    if eos_ids and params.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_new_tokens, eos_ids, device))
    if params.prefix_allowed_tokens_fn is not None:
        allowed = params.prefix_allowed_tokens_fn
        processors.append(PrefixConstrainedLogitsProcessor(lambda _node, sequence: allowed(row, sequence), 1))
    if params.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(list(params.suppress_tokens), device=device))
    if params.begin_suppress_tokens:  # at the first new token only: transformers' begin_index is the prompt length
        processors.append(SuppressTokensAtBeginLogitsProcessor(list(params.begin_suppress_tokens), prompt_length,
                                                               device=device))
    return merge_processors(processors, params.logits_processor or LogitsProcessorList())


def merge_processors(defaults: ProcessorList, custom: ProcessorList) -> ProcessorList:
    """`generate`'s rule for a caller's `logits_processor` (and `stopping_criteria`): one of the same type as a
    default takes the default's place; the others follow the defaults, in the caller's order."""
    if not custom:
        return defaults

    def kind(processor: object) -> type:
        return NoRepeatNGramLogitsProcessor if isinstance(processor, NGramIndex) else type(processor)

    merged = type(defaults)(next((c for c in custom if type(c) is kind(d)), d) for d in defaults)
    merged.extend(c for c in custom if c not in merged)
    return merged


class NGramIndex(LogitsProcessor):
    """transformers' `NoRepeatNGramLogitsProcessor` for sequences that extend one committed sequence.

    Its processor collects every n-gram of input_ids in Python at each call (the whole sequence, for every node, every
    round); here an index of the committed sequence's n-grams grows with `commit`, and a call only looks at the
    n-grams that end inside each row's part past the committed tokens (a node's path).
    """

    def __init__(self, n: int, committed: list[int]) -> None:
        self.n = n
        self.tokens: list[int] = []  # the committed sequence, on the host
        self.ngrams: dict[tuple[int, ...], set[int]] = {}  # (n-1) tokens -> the tokens that followed them
        self.commit(committed)

    def commit(self, new: list[int]) -> None:
        n = self.n
        for token in new:
            self.tokens.append(token)
            if len(self.tokens) >= n:
                self.ngrams.setdefault(tuple(self.tokens[-n:-1]), set()).add(self.tokens[-1])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Ban, in each row, the tokens that would complete an n-gram already in the row's sequence.

        input_ids: (R, L + d), the committed L tokens then each row's own d; scores: (R, V)."""
        n, scores = self.n, scores.clone()
        for row, path in enumerate(input_ids[:, len(self.tokens) :].tolist()):
            if len(self.tokens) + len(path) < n - 1:
                continue
            window = (self.tokens[-(n - 1) :] if n > 1 else []) + path  # every n-gram in it holds a path token
            suffix = tuple(window[len(window) - (n - 1) :])  # the sequence's last n - 1 tokens
            banned = set(self.ngrams.get(suffix, ()))
            banned.update(window[start + n - 1] for start in range(len(window) - n + 1)
                          if tuple(window[start : start + n - 1]) == suffix)
            if banned:
                scores[row, list(banned)] = -float("inf")
        return scores


def finite_bias(processor: object) -> bool:
    """Whether `processor` is a sequence bias whose biases are all finite (it moves scores, never bans)."""
    return isinstance(processor, SequenceBiasLogitsProcessor) and all(
        math.isfinite(float(value)) for value in processor.sequence_bias.values()  # a dict, however it was given
    )


class SequenceContext:
    """One row's sequence so far (prompt + emitted tokens) and the processors that read it.

    `last` processes the logits after the committed sequence (the prefill's), `tree` those of a drafted tree's
    nodes (each with its own path), `commit` appends emitted tokens. Padding is never part of a row's sequence.
    """

    def __init__(self, prompt: torch.Tensor, params: SamplingParams, eos_ids: list[int], row: int = 0) -> None:
        self.sequence = prompt.long()  # (L,) committed tokens, on the target's device
        n = params.no_repeat_ngram_size
        self.ngrams = NGramIndex(n, prompt.tolist()) if n > 0 else None
        self.processors = transformers_processors(params, prompt.shape[0], eos_ids, prompt.device, row, self.ngrams)
        # whether any processor can ban a token (-inf): only then is drafting worth constraining (`allowed_after`)
        self.may_ban = not all(isinstance(p, RepetitionPenaltyLogitsProcessor) or finite_bias(p)
                               or getattr(p, "never_bans", False) for p in self.processors)

    def commit(self, tokens: torch.Tensor) -> None:
        """Append emitted tokens (any shape: a 0-d root too) to the sequence."""
        new = tokens.reshape(-1).to(self.sequence.device)
        self.sequence = torch.cat([self.sequence, new])
        if self.ngrams is not None:
            self.ngrams.commit(new.tolist())

    def last(self, logits: torch.Tensor) -> torch.Tensor:
        """(1, V) logits after the committed sequence -> processed (1, V) float32."""
        return self.processors(self.sequence[None], logits.float().clone())  # generate scores in float32

    def allowed_after(self, paths: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(n, d) token paths below the root (the last committed token) -> (n, V) bool: the tokens the processors do
        not ban (-inf) after each path; for drafting (`EagleDrafter.allowed_after`)."""
        input_ids = torch.cat([self.sequence.expand(paths.shape[0], -1), paths.to(self.sequence.device)], dim=1)
        scores = torch.zeros(paths.shape[0], vocab_size, device=self.sequence.device)
        return self.processors(input_ids, scores).isfinite()

    def tree(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
        """(N, V) logits at a tree's nodes -> processed (N, V) float32 (every node; acceptance processes only the
        nodes it reaches, through `nodes`).

        Args:
            tokens: (N,) the tree's tokens; node 0, the root, is the last committed token.
            tree: its buffers (nodes in topological order: a node's ancestors have smaller indices).
        """
        scores = logits.float().clone()
        depths = tree.depth.tolist()
        for depth in sorted(set(depths)):
            nodes = [node for node, d in enumerate(depths) if d == depth]
            scores[nodes] = self.nodes(logits, tokens, tree, nodes)
        return scores

    def nodes(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers, nodes: list[int]) -> torch.Tensor:
        """(n, V) processed float32 scores of some nodes of ONE depth, from the tree's (N, V) logits: one call of the
        processors, each node's input_ids the committed sequence plus its own path below the root."""
        rows = torch.tensor(nodes, device=logits.device)
        depth = int(tree.depth[nodes[0]])
        # each node's ancestors, root first and itself last: depth + 1 per row, in index (= depth) order
        ancestors = tree.ancestors[rows].nonzero()[:, 1].view(len(nodes), depth + 1)
        paths = tokens[ancestors[:, 1:]]  # (n, depth): the path below the root
        input_ids = torch.cat([self.sequence.expand(len(nodes), -1), paths], dim=1)  # (n, L + depth)
        return self.processors(input_ids, logits[rows].float())  # generate scores in float32
