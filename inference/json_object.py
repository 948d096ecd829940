"""Any JSON object, as a constraint: OpenAI's `response_format: {"type": "json_object"}`.

A JSON-schema constraint (inference/constraints.py) compiles a regex against the vocabulary with outlines-core; "any
JSON object" has no useful schema (its regex is too large to compile in reasonable time), so this module recognises
JSON itself: `JsonObjectIndex` is a pushdown recogniser with outlines' `Index` interface (initial state, next state
after a token, tokens allowed in a state), which `IndexConstraint` turns into a logits processor that token trees use
(each tree node's state follows from its parent's). The generated text is one JSON object (RFC 8259: nested objects
and arrays, strings with their escapes, numbers, true / false / null) with at most `MAX_WHITESPACE` spaces or
newlines between its tokens, then EOS. No outlines-core needed.

    constraint = json_object_constraint(tokenizer)
    out = lm.generate(input_ids, max_new_tokens=256, logits_processor=[constraint])

A state is a tuple (stack, mode, detail, whitespace): the open containers ("{" or "[" each, outermost first), what
may come next (the modes below), the mode's own datum (a literal's characters still due, a number's part, whether a
string is a key, the hex digits a \\u escape still needs) and the spaces written since the last token of JSON. The
tokens allowed in a state are computed once per state and kept (a JSON answer passes through tens of states; inside
a string, the tokens free of quotes, backslashes and control characters are allowed without reading them).
"""

from __future__ import annotations

import array
from typing import Any

from transformers import PreTrainedTokenizerBase

from .constraints import IndexConstraint, token_text

MAX_WHITESPACE = 8  # spaces / newlines between two JSON tokens at most (as constraints.CHAT_JSON_WHITESPACE)
MAX_KEPT_STATES = 4096  # states whose allowed tokens are kept at most (a string's: 0.4 MB on a 49k vocabulary)
WHITESPACE = " \n"
ESCAPES = '"\\/bfnrt'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# a number's parts: after "-", after a leading "0", in the integer digits, after ".", in the fraction, after "e",
# after the exponent's sign, in the exponent; those a number may end in
NUMBER_ENDS = ("zero", "int", "frac", "exp")
AFTER_DIGIT_PART = {"dot": "frac", "e": "exp", "sign": "exp"}  # a digit after ".", "e" or the exponent's sign
CLOSERS = {"{": "}", "[": "]"}

State = tuple[str, str, Any, int]
START: State = ("", "start", None, 0)


def _after_value(stack: str) -> State:
    """The state after a whole value: a separator or a closer next, or the end when it closed the outermost object."""
    return (stack, "after", None, 0) if stack else (stack, "done", None, 0)


def _value_start(stack: str, char: str) -> State | None:
    """The state after the first character of a value (None: no value starts with it)."""
    if char == "{":
        return (stack + "{", "key_or_close", None, 0)
    if char == "[":
        return (stack + "[", "value_or_close", None, 0)
    if char == '"':
        return (stack, "string", False, 0)
    if char in LITERALS:
        return (stack, "literal", LITERALS[char], 0)
    if char == "-":
        return (stack, "number", "minus", 0)
    if char == "0":
        return (stack, "number", "zero", 0)
    if char in DIGITS:
        return (stack, "number", "int", 0)
    return None


def _number_step(part: str, char: str) -> str | None:
    """A number's next part after `char` (None: `char` does not continue it)."""
    if char in DIGITS:
        if part == "minus":
            return "zero" if char == "0" else "int"
        if part in ("int", "frac", "exp"):
            return part
        return AFTER_DIGIT_PART.get(part)
    if char == "." and part in ("zero", "int"):
        return "dot"
    if char in "eE" and part in ("zero", "int", "frac"):
        return "e"
    if char in "+-" and part == "e":
        return "sign"
    return None


def step(state: State, char: str) -> State | None:
    """The state after one more character (None: no JSON object's text goes on with it)."""
    stack, mode, detail, spaces = state
    if mode == "string":
        if char == '"':
            return (stack, "colon", None, 0) if detail else _after_value(stack)
        if char == "\\":
            return (stack, "escape", detail, 0)
        return None if char < " " else state  # control characters must be escaped
    if mode == "escape":
        if char == "u":
            return (stack, "unicode", (detail, 4), 0)
        return (stack, "string", detail, 0) if char in ESCAPES else None
    if mode == "unicode":
        is_key, due = detail
        if char not in HEX:
            return None
        return (stack, "string", is_key, 0) if due == 1 else (stack, "unicode", (is_key, due - 1), 0)
    if mode == "literal":
        if char != detail[0]:
            return None
        return (stack, "literal", detail[1:], 0) if len(detail) > 1 else _after_value(stack)
    if mode == "number":
        part = _number_step(detail, char)
        if part is not None:
            return (stack, "number", part, 0)
        if detail not in NUMBER_ENDS:
            return None
        return step(_after_value(stack), char)  # the number ended: `char` is the next token's
    if char in WHITESPACE:  # between tokens
        return (stack, mode, detail, spaces + 1) if spaces < MAX_WHITESPACE else None
    if mode == "start":
        return ("{", "key_or_close", None, 0) if char == "{" else None
    if mode in ("key_or_close", "key"):
        if char == '"':
            return (stack, "string", True, 0)
        return _after_value(stack[:-1]) if char == "}" and mode == "key_or_close" else None
    if mode == "colon":
        return (stack, "value", None, 0) if char == ":" else None
    if mode == "value_or_close" and char == "]":
        return _after_value(stack[:-1])
    if mode in ("value", "value_or_close"):
        return _value_start(stack, char)
    if mode == "after":
        if char == ",":
            return (stack, "key", None, 0) if stack[-1] == "{" else (stack, "value", None, 0)
        if char == CLOSERS[stack[-1]]:
            return _after_value(stack[:-1])
        return None
    return None  # "done": only whitespace, then EOS


def advance(state: State | None, text: str) -> State | None:
    """The state after `text` (None: it leaves JSON)."""
    for char in text:
        if state is None:
            return None
        state = step(state, char)
    return state


class JsonObjectIndex:
    """The tokens of a vocabulary that keep a text one JSON object, per recogniser state; outlines-core's `Index`
    interface (`get_initial_state`, `get_next_state`, `get_allowed_tokens`), so `IndexConstraint` applies it.

    Args:
        texts: token id -> the text it stands for (special tokens left out: they never stand for JSON).
        eos_token_id: allowed once the object is complete, and then only it and whitespace.
    """

    def __init__(self, texts: dict[int, str], eos_token_id: int) -> None:
        self.texts, self.eos_token_id = texts, int(eos_token_id)
        # first character -> the tokens starting with it (those a string does not take whole, for string states)
        self.by_first: dict[str, list[tuple[int, str]]] = {}
        self.by_first_in_string: dict[str, list[tuple[int, str]]] = {}
        self.plain: list[int] = []  # tokens a string takes whole: no quote, backslash or control character
        for token_id, text in texts.items():
            if not text:
                continue
            self.by_first.setdefault(text[0], []).append((token_id, text))
            if '"' not in text and "\\" not in text and min(text) >= " ":
                self.plain.append(token_id)
            else:
                self.by_first_in_string.setdefault(text[0], []).append((token_id, text))
        self.allowed: dict[State, array.array] = {}

    def get_initial_state(self) -> State:
        return START

    def get_next_state(self, state: State, token_id: int) -> State | None:
        text = self.texts.get(int(token_id))
        return None if text is None else advance(state, text)

    def get_allowed_tokens(self, state: State) -> array.array:
        """The ids of the tokens allowed in `state` (computed once per state and kept, as 8-byte ints: a string's
        state allows nearly the whole vocabulary)."""
        if state not in self.allowed:
            if len(self.allowed) >= MAX_KEPT_STATES:  # deep or odd nestings keep making new states: start afresh
                self.allowed.clear()
            self.allowed[state] = array.array("q", self._allowed(state))
        return self.allowed[state]

    def _allowed(self, state: State) -> list[int]:
        in_string = state[1] == "string"
        allowed = list(self.plain) if in_string else []  # a string takes these whole, staying a string
        for first, tokens in (self.by_first_in_string if in_string else self.by_first).items():
            after_first = step(state, first)
            if after_first is None:  # every token of the group leaves JSON at its first character
                continue
            allowed += [token_id for token_id, text in tokens if advance(after_first, text[1:]) is not None]
        if state[1] == "done":
            allowed.append(self.eos_token_id)
        return allowed


def vocabulary_texts(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Token id -> the text it stands for, special tokens left out."""
    special = set(tokenizer.all_special_ids)
    return {token_id: token_text(tokenizer, token) for token, token_id in tokenizer.get_vocab().items()
            if token_id not in special}


def json_object_index(tokenizer: PreTrainedTokenizerBase) -> JsonObjectIndex:
    """A `JsonObjectIndex` over the tokenizer's vocabulary (keep it: the allowed tokens it learns per state are kept
    for every later constraint made from it).

    Raises:
        ValueError: a tokenizer without an EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("a JSON-object constraint needs a tokenizer with an EOS token (eos_token_id is None): the "
                         "constraint ends generation with it")
    return JsonObjectIndex(vocabulary_texts(tokenizer), tokenizer.eos_token_id)


def json_object_constraint(tokenizer: PreTrainedTokenizerBase, index: JsonObjectIndex | None = None) -> IndexConstraint:
    """Generated text must be one JSON object (then only EOS may follow), as OpenAI's `json_object` response format.
    Pass the `index` of an earlier call to reuse what it learned."""
    index = json_object_index(tokenizer) if index is None else index
    return IndexConstraint(index, index.eos_token_id)
