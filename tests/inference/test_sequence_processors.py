"""`SequenceContext` processes every tree node's logits exactly as transformers' own processors, in transformers'
order, process the logits after that node's sequence (the committed tokens plus the node's path)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from specheads.inference.sampling import SamplingParams
from specheads.inference.sequence_processors import SequenceContext
from specheads.inference.tree import build_tree_buffers

V, EOS = 12, 11
PROMPT = [3, 4, 5, 3, 4]
SETTINGS = dict(
    repetition_penalty=1.7, no_repeat_ngram_size=2, min_length=9, min_new_tokens=3,
    sequence_bias={(4, 3): 2.5, (5,): -1.5}, bad_words_ids=((6, 8), (9,)), suppress_tokens=(10,),  # 3, 5: penalized too
    begin_suppress_tokens=(2,),
)


def transformers_processors() -> LogitsProcessorList:
    """The same settings as transformers' `_get_logits_processor` orders them."""
    return LogitsProcessorList([
        SequenceBiasLogitsProcessor(SETTINGS["sequence_bias"]),
        RepetitionPenaltyLogitsProcessor(SETTINGS["repetition_penalty"]),
        NoRepeatNGramLogitsProcessor(SETTINGS["no_repeat_ngram_size"]),
        NoBadWordsLogitsProcessor([list(w) for w in SETTINGS["bad_words_ids"]], [EOS]),
        MinLengthLogitsProcessor(SETTINGS["min_length"], [EOS]),
        MinNewTokensLengthLogitsProcessor(len(PROMPT), SETTINGS["min_new_tokens"], [EOS]),
        SuppressTokensLogitsProcessor(list(SETTINGS["suppress_tokens"])),
        SuppressTokensAtBeginLogitsProcessor(list(SETTINGS["begin_suppress_tokens"]), len(PROMPT)),
    ])


def test_every_node_is_processed_like_transformers_processes_its_sequence():
    torch.manual_seed(0)
    context = SequenceContext(torch.tensor(PROMPT), SamplingParams(**SETTINGS), [EOS])
    hf = transformers_processors()
    first = torch.randn(1, V) * 3
    assert torch.equal(context.last(first), hf(torch.tensor([PROMPT]), first.clone()))
    context.commit(torch.tensor([6]))  # the first new token: the root of the tree below
    # root 6; children 8 and 3; 3 -> 4 -> 6 (a bigram already in the sequence), 8 -> 9
    tokens = torch.tensor([6, 8, 3, 4, 9, 6])
    tree = build_tree_buffers(torch.tensor([-1, 0, 0, 2, 1, 3]))
    logits = torch.randn(tokens.shape[0], V) * 3
    processed = context.tree(logits, tokens, tree)
    for node in range(tokens.shape[0]):
        path = [int(tokens[j]) for j in range(1, node + 1) if tree.ancestors[node, j]]
        sequence = torch.tensor([PROMPT + [6] + path])
        expected = hf(sequence, logits[node : node + 1].clone())
        assert torch.equal(processed[node : node + 1], expected), (node, path)


def test_may_ban_tells_processors_that_can_ban_from_those_that_only_move_scores():
    """Drafting is constrained only where a processor can ban (-inf): a repetition penalty and finite sequence
    biases cannot; bad words, n-gram blocking, a -inf bias and a caller's processor can."""
    prompt, eos = torch.tensor(PROMPT), [EOS]

    def may_ban(**settings) -> bool:
        return SequenceContext(prompt, SamplingParams(**settings), eos).may_ban

    assert not may_ban(repetition_penalty=1.05)
    assert not may_ban(repetition_penalty=1.2, sequence_bias={(3,): -2.0, (4, 5): 1.5})
    assert may_ban(sequence_bias=[[[3], float("-inf")]])
    assert may_ban(bad_words_ids=((3, 4),))
    assert may_ban(no_repeat_ngram_size=2)
    assert may_ban(logits_processor=[lambda input_ids, scores: scores])
