"""Regular-expression and JSON-schema constraints, as logits processors that token trees can use.

outlines-core (the `constraints` extra) compiles a regex, or a JSON schema through a regex, against the tokenizer's
vocabulary into an `Index`: states, the tokens allowed in each and the state each token leads to. `IndexConstraint`
applies one as a transformers `LogitsProcessor` whose output depends only on each row's token sequence: a sequence's
state is its parent sequence's state advanced by its last token, cached by the sequence. So the same processor
serves `SpeculativeLM.generate` (whose rows are tree nodes, parents processed before children) and
`target.generate`, and the two give the same tokens. outlines' own processors advance one state per call and batch
row, which neither tree verification nor transformers' assisted generation can use.

    constraint = json_schema_constraint(tokenizer, {"type": "object", "properties": {...}})
    out = lm.generate(input_ids, max_new_tokens=256, logits_processor=[constraint])

The output is the target's own greedy (or sampled) text under the constraint, never a repaired one: generation that
hits `max_new_tokens` first stops inside the structure, as with transformers.
"""

from __future__ import annotations

import array
import json
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor

SPIECE_UNDERLINE = "\u2581"  # sentencepiece's word-start mark: the token's text begins with a space


def require_outlines_core() -> Any:
    """The `outlines_core` module, or an ImportError that says how to install it."""
    try:
        import outlines_core
    except ImportError as err:
        raise ImportError(
            "regex / JSON-schema constraints need outlines-core: pip install 'specheads[constraints]' "
            "(or pip install 'outlines-core>=0.2')"
        ) from err
    return outlines_core


class IndexConstraint(LogitsProcessor):
    """Allow, in each row, only the tokens an outlines-core `Index` allows after the row's generated tokens.

    A row whose sequence's parent (the sequence without its last token) was never processed is a new prompt, in the
    index's initial state; every later row's state follows from its parent's. Use one per `generate` call (or call
    `reset`): a later prompt that extends a sequence seen before would continue that sequence's state.

    Rows that the constraint could never lead to (a drafted token the parent's state does not allow) and rows after
    EOS are left unconstrained: no acceptance rule keeps such a row, and transformers keeps processing finished rows
    of a batch.

    Args:
        index: an `outlines_core.Index`.
        eos_token_id: the EOS the index allows in its final states (also its vocabulary's).
    """

    def __init__(self, index: Any, eos_token_id: int) -> None:
        self.index = index
        self.eos_token_id = int(eos_token_id)
        self.reset()

    def fresh(self) -> IndexConstraint:
        """A new processor over the same compiled index (compiling is the slow part: seconds for a JSON schema on a
        49k vocabulary), for the next `generate` call."""
        return IndexConstraint(self.index, self.eos_token_id)

    def reset(self) -> None:
        """Forget every sequence seen (before reusing the processor for other prompts)."""
        # hash of a sequence -> its state (None: unconstrained). Hashes, not the sequences: a long generation
        # would otherwise keep every processed sequence whole (outlines keys its states the same way)
        self.states: dict[int, int | None] = {}
        self.masks: dict[int, torch.Tensor] = {}  # state -> (V,) bool, the allowed tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids (R, L), scores (R, V) -> scores with the disallowed tokens at -inf."""
        banned = torch.zeros_like(scores, dtype=torch.bool)
        for row, sequence in enumerate(input_ids.tolist()):
            state = self.state_of(tuple(sequence))
            if state is not None:
                banned[row] = ~self.allowed_mask(state, scores.shape[1], scores.device)
        return scores.masked_fill(banned, -float("inf"))

    def state_of(self, sequence: tuple[int, ...]) -> int | None:
        """The index state after `sequence` (None: unconstrained), cached."""
        key = hash(sequence)
        if key in self.states:
            return self.states[key]
        parent = hash(sequence[:-1])
        if parent not in self.states:
            state = self.index.get_initial_state()  # a prompt
        elif self.states[parent] is None or sequence[-1] == self.eos_token_id:
            state = None  # below a token the constraint does not allow, or after EOS
        else:
            state = self.index.get_next_state(self.states[parent], sequence[-1])
        self.states[key] = state
        return state

    def allowed_mask(self, state: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        """(V,) bool: the tokens allowed in `state`, cached per state."""
        if state not in self.masks:
            # inside a JSON string nearly every token is allowed: a list of ~V ints, turned into a tensor through
            # a typed buffer (0.6 ms for 49k ids; torch.tensor(list) takes 5 ms)
            ids = self.index.get_allowed_tokens(state)
            tokens = torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.zeros(0, dtype=torch.long)
            tokens = tokens[tokens < vocab_size]
            if tokens.numel() == 0:
                raise ValueError(f"the constraint allows no token of this vocabulary ({vocab_size}) in state {state}")
            allowed = torch.zeros(vocab_size, dtype=torch.bool)
            allowed[tokens] = True
            self.masks[state] = allowed.to(device)
        return self.masks[state]


def token_text(tokenizer: PreTrainedTokenizerBase, token: str) -> str:
    """The text a vocabulary token stands for (sentencepiece's word-start mark as the space it is)."""
    text = tokenizer.convert_tokens_to_string([token])
    if token.startswith(SPIECE_UNDERLINE) or token == "<0x20>":
        return " " + text  # sentencepiece decoding drops a leading space
    return text


def outlines_vocabulary(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The tokenizer's vocabulary as an `outlines_core.Vocabulary`: text -> token ids, special tokens left out
    (they never stand for constrained text), EOS the vocabulary's end token.

    Raises:
        ValueError: a tokenizer without an EOS token.
    """
    outlines_core = require_outlines_core()
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("constraints need a tokenizer with an EOS token (eos_token_id is None): the constraint "
                         "ends generation with it")
    special = set(tokenizer.all_special_ids)
    texts: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id not in special:
            texts.setdefault(token_text(tokenizer, token), []).append(token_id)
    return outlines_core.Vocabulary(eos, texts)


def regex_constraint(tokenizer: PreTrainedTokenizerBase, regex: str) -> IndexConstraint:
    """Generated text must match `regex` (then only EOS may follow)."""
    outlines_core = require_outlines_core()
    return IndexConstraint(outlines_core.Index(regex, outlines_vocabulary(tokenizer)), tokenizer.eos_token_id)


def json_schema_constraint(
    tokenizer: PreTrainedTokenizerBase, schema: dict[str, Any] | str, whitespace_pattern: str | None = None
) -> IndexConstraint:
    """Generated text must be a JSON value valid under `schema` (a dict or its JSON text).

    `whitespace_pattern`: the regex allowed between JSON tokens (outlines-core's default: at most one space);
    e.g. `CHAT_JSON_WHITESPACE` lets chat models write the indented JSON they were tuned to write.

    The schema `{"type": "object"}` (any object) is recognised directly, without outlines-core
    (`json_object.json_object_constraint`, up to 8 spaces or newlines between tokens): its regex is too large to
    compile in useful time.
    """
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if json.loads(text) == {"type": "object"}:
        from .json_object import json_object_constraint

        return json_object_constraint(tokenizer)
    outlines_core = require_outlines_core()
    regex = outlines_core.json_schema.build_regex_from_schema(text, whitespace_pattern)
    return regex_constraint(tokenizer, regex)


CHAT_JSON_WHITESPACE = r"[\n ]{0,8}"  # newlines and indentation of up to 8 spaces between JSON tokens


def constraint_from_options(
    tokenizer: PreTrainedTokenizerBase, json_schema: str | None = None, regex: str | None = None
) -> IndexConstraint | None:
    """The command line's `--json-schema FILE_OR_JSON` (chat-style whitespace; `{"type": "object"}`: any JSON object,
    inference/json_object.py) or `--regex REGEX` (None: neither).

    Raises:
        ValueError: a --json-schema that is neither a file nor valid JSON.
    """
    if regex:
        return regex_constraint(tokenizer, regex)
    if not json_schema:
        return None
    text = Path(json_schema).read_text(encoding="utf-8") if Path(json_schema).is_file() else json_schema
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--json-schema {json_schema!r} is neither a file nor valid JSON: {err}") from err
    return json_schema_constraint(tokenizer, schema, whitespace_pattern=CHAT_JSON_WHITESPACE)
