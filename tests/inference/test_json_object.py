"""The JSON-object constraint (OpenAI's `response_format: {"type": "json_object"}`): the recogniser accepts exactly
JSON objects, the tokens it allows in each state are exactly those whose text keeps the answer JSON, and decoding under
it gives `target.generate`'s tokens under the same constraint, heads or not."""

from __future__ import annotations

import json

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.json_object import (
    MAX_WHITESPACE,
    START,
    advance,
    json_object_constraint,
    json_object_index,
    vocabulary_texts,
)

from .conftest import hf_greedy, make_heads

OBJECTS = ['{}', '{"a": 1}', ' {\n "k" : [ ] } ', '{"a":0.0,"b":-0,"c":1E5,"d":2e-3,"e":-12.50}',
           '{"a": [1, -2.5e+3, true, false, null, {"b": "x\\"y\\u00e9\\n\\\\"}], "c": {"d": [[], [{}]]}}',
           '{"ünï": "cödé ✓"}']
NOT_OBJECTS = ['[]', '1', '"a"', '{"a"}', '{"a":}', '{"a":01}', '{"a": tru}', '{,}', '{"a":1,}', '{"a":"\n"}',
               '{"a": [1,]}', '{"a":1}}', '{"a": .5}', '{"a": 1.}', '{"a": 1e}', '{"a":"\\x"}', '{"a":"\\u12G4"}',
               '{' + ' ' * (MAX_WHITESPACE + 1) + '}', '{"a": 1]', '{"a": [1}', "{'a': 1}", '{"a": True}',
               '{"a":1} x', '{a: 1}']


@pytest.mark.parametrize("text", OBJECTS)
def test_json_objects_are_recognised_and_each_prefix_stays_open(text):
    assert json.loads(text) is not None  # the cases are JSON
    for end in range(len(text.rstrip())):  # open until the last closing brace
        state = advance(START, text[:end])
        assert state is not None and state[1] != "done", text[:end]
    assert advance(START, text)[1] == "done"


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_anything_else_is_refused_or_left_open(text):
    state = advance(START, text)
    assert state is None or state[1] != "done", text


def test_allowed_tokens_are_exactly_those_that_keep_the_text_json(stories260k):
    """In every state a JSON answer passes through, the allowed tokens (found through first-character groups and
    the plain tokens a string takes whole) are exactly the tokens whose text keeps the answer JSON, plus EOS once the
    object is complete."""
    _, tokenizer = stories260k
    index = json_object_index(tokenizer)
    texts = vocabulary_texts(tokenizer)
    assert tokenizer.bos_token_id not in texts and texts[tokenizer.convert_tokens_to_ids("\u2581Once")] == " Once"
    answer = '{"name": "Tom \\u00e9", "age": -3.5e2, "toys": [true, null, {"ball": "red"}]} \n'
    for end in range(len(answer) + 1):
        state = advance(START, answer[:end])
        expected = {t for t, text in texts.items() if advance(state, text) is not None}
        if state[1] == "done":
            expected.add(tokenizer.eos_token_id)
        assert set(index.get_allowed_tokens(state)) == expected, (answer[:end], state)


def test_decoding_under_the_constraint_is_the_targets_own(stories260k):
    """Greedy: identical to `target.generate` under the same constraint, for each kind of heads and with prompt
    lookup; the answer is a prefix of a JSON object (an object when it ended). Sampled: every answer is one too."""
    target, tokenizer = stories260k
    index = json_object_index(tokenizer)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    expected = hf_greedy(target, ids, 60, logits_processor=[json_object_constraint(tokenizer, index)])
    text = tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    if expected[0, -1] == tokenizer.eos_token_id:
        assert isinstance(json.loads(text), dict), text
    else:
        assert advance(START, text) is not None, text
    assert text.lstrip().startswith("{")
    for head_type in ("medusa", "eagle", "eagle3"):
        lm = SpeculativeLM(target, make_heads(target, head_type), lookup_tokens=4)
        out = lm.generate(ids, max_new_tokens=60, logits_processor=[json_object_constraint(tokenizer, index)])
        assert torch.equal(out, expected), head_type
    torch.manual_seed(0)
    for _ in range(4):
        sampled = lm.generate(ids, max_new_tokens=40, do_sample=True, temperature=1.3,
                              logits_processor=[json_object_constraint(tokenizer, index)])
        new = sampled[0, ids.shape[1]:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        state = advance(START, text)
        assert state is not None and (state[1] == "done") == (int(new[-1]) == tokenizer.eos_token_id), text


def test_json_object_constraint_needs_an_eos(stories260k):
    _, tokenizer = stories260k
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="needs a tokenizer with an EOS token"):
        json_object_constraint(tokenizer)


def test_the_command_lines_object_schema_is_the_json_object_constraint(stories260k):
    """`--json-schema '{"type": "object"}'` (and a server's schema of that) is any JSON object, without outlines-core."""
    from specheads.inference.constraints import constraint_from_options
    from specheads.inference.json_object import JsonObjectIndex

    _, tokenizer = stories260k
    constraint = constraint_from_options(tokenizer, json_schema='{"type": "object"}')
    assert isinstance(constraint.index, JsonObjectIndex) and constraint.eos_token_id == tokenizer.eos_token_id
