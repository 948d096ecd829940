"""Tool calls streamed as they are written (inference/tool_call_stream.py, inference/partial_json.py): whatever the
pieces, what is sent joins to the answer's parts; every partial reading is the start of the final arguments."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specheads.inference.answer_parts import AnswerParts
from specheads.inference.partial_json import (
    PartialCall,
    json_members,
    partial_json_call,
    partial_json_list,
    value_end,
)
from specheads.inference.tool_call_stream import CallDelta, CallStream
from specheads.inference.tool_calls import ToolCall, ToolRequest
from specheads.inference.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    python_value_end,
)

from .conftest import join_streamed_calls
from .test_tool_calls import CALL_ANSWER, CLOCK, WEATHER

NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array"}}}}}
XML_NOTE = ("Saving it.\n<tool_call>\n<function=note>\n<parameter=text>\ndef f():\n    return \"a<b\"\n</parameter>\n"
            "<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>")


def stream_answer(tools: ToolRequest, parser, text: str, size: int):
    """Feed `text` in pieces of `size` characters: (content sent, call pieces sent, the final parts)."""
    answer = AnswerParts(tools, parser)
    content, pieces = "", []
    for i in range(0, len(text), size):
        content += answer.feed(text[i:i + size])[1]
        pieces += answer.take_calls()
    return content, pieces, answer.finish(text)


@pytest.mark.parametrize("parser", [HermesParser(), Qwen3CoderParser(), Llama3JsonParser(), PythonicParser(),
                                    MistralParser()])
@pytest.mark.parametrize("text", [
    CALL_ANSWER, "Just text, no call.", "Text with < and <tool in it <tool_", '  {"name": "a", "parameters": {}}',
    'A <tool_call>{"broken"</tool_call> tail', "Hi   \n", "<tool_call>", "{ not json",
    '[{"name": "a", "arguments": {"x": 1}}]', 'get_weather{"city": "Paris"}', "Paris", "[TOOL_CALLS]a[ARGS]{}",
    "Well [x] and {y}", "One sec.\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
    "\n</tool_call>", "Use <function=weather> <func", '[weather(city="Paris"), clock()]', "[weather(city=", "[x] marks it",
    XML_NOTE, 'Two.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "clock", "arguments": {}}\n</tool_call>', 'Cut <tool_call>\n{"name": "weather", "arguments": {"city": "Pa',
    '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
    '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "clock", "parameters": {}}',
    '{"name": "weather", "parameters": {"city": "Os',
    '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "clock", "arguments": {}}]',
    '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"} clock[ARGS]{}', 'weather{"city": "Os',
    "[weather(city='Rome, \"Italy\"', days=[1, (2, 3)]), clock()]", "[weather(city='Ro",
])
def test_streamed_parts_join_to_the_answer_whatever_the_pieces(parser, text):
    """Streamed piece by piece (every split): the content sent plus what is sent at the end is the answer's content,
    no piece of a call goes out as content, and the call pieces join to the answer's calls. Where the whole text reads
    as calls (or no call was begun) those are the unstreamed answer's; a call begun that the whole text does not read
    as (cut, malformed) stays as it was written."""
    tools = ToolRequest([WEATHER, CLOCK, NOTE])
    whole_content, whole_calls = tools.read_calls(text, parser)
    partial = tools.partial_calls(text, parser)
    for size in (1, 2, 3, 7):
        sent, pieces, parts = stream_answer(tools, parser, text, size)
        assert sent + parts.unsent_content == parts.content
        if parts.calls:  # no piece of a call went out as content
            assert "<tool_call>" not in sent and "<function=" not in sent and "{" not in sent[len(parts.content):]
        assert join_streamed_calls(pieces + parts.unsent_calls) == [(c.id, c.name, c.arguments) for c in parts.calls]
        if whole_calls or not partial:  # the text reads as calls, or none was begun: the unstreamed answer
            assert (parts.content, [(c.name, c.arguments) for c in parts.calls]) == (
                whole_content, [(c.name, c.arguments) for c in whole_calls]), (size, parts)
        else:  # streamed while written, and the whole text did not read as calls after all: kept as written
            assert [(c.name, c.arguments) for c in parts.calls] == [(c.name, c.arguments) for c in partial]
            assert text.startswith(parts.content)
    if whole_calls:  # every parser reads calls before the answer ends
        assert partial and [c.name for c in partial] == [c.name for c in whole_calls]


def test_calls_go_out_while_written_and_end_with_the_answers_arguments():
    """A hermes call's name goes out once whole, its arguments in pieces as they are written, and the last piece
    (the closing brace) once the whole answer reads as the call; the arguments are the JSON as written."""
    tools = ToolRequest([WEATHER])
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city":  "Paris"}}\n</tool_call>'
    answer, seen = AnswerParts(tools, HermesParser()), []
    for i in range(len(text)):
        answer.feed(text[i])
        seen += [(i, delta) for delta in answer.take_calls()]
    first_index, first = seen[0]
    assert (first.id is not None, first.name, first.arguments) == (True, "weather", "")
    assert text[:first_index + 1].endswith('"weather"')  # the name went out as soon as it was whole
    parts = answer.finish(text)
    assert parts.calls[0].arguments == '{"city":  "Paris"}'  # as written (two spaces), as the unstreamed answer
    assert tools.read_calls(text, HermesParser())[1][0].arguments == '{"city":  "Paris"}'
    assert len(seen) > 5 and parts.calls[0].id == first.id


@pytest.mark.parametrize("choice, text", [
    ("function", '{"city": "Paris", "days": [1, 2]}'),
    ("required", '[{"name": "weather", "parameters": {"city": "Lyon"}}, {"name": "clock", "parameters": {}}]'),
    ("required", '[{"name": "weather", "parameters": {"city": "Ly'),  # cut by max_tokens
])
def test_forced_calls_stream_their_json(choice, text):
    """tool_choice named or "required": the answer is the calls' JSON, streamed as written; cut by max_tokens, the
    stream's call keeps what was written (as OpenAI's streams), the unstreamed answer gives the text."""
    tools = ToolRequest([WEATHER, CLOCK], choice, "weather" if choice == "function" else None)
    for size in (1, 4):
        sent, pieces, parts = stream_answer(tools, None, text, size)
        joined = join_streamed_calls(pieces + parts.unsent_calls)
        assert sent == "" and joined == [(c.id, c.name, c.arguments) for c in parts.calls]
        whole = tools.read_calls(text, None)[1]
        if whole:
            assert [(c.name, c.arguments) for c in whole] == [(name, arguments) for _, name, arguments in joined]
        else:
            assert joined[0][1:] == ("weather", '{"city": "Ly')
    if choice == "function":
        content, (call,) = tools.read_calls(text, None)
        assert (content, call.name, call.arguments) == ("", "weather", text)  # the arguments as written


def test_call_stream_finishes_agreeing_calls_and_keeps_disagreeing_ones():
    stream = CallStream()
    first = stream.update([PartialCall("a", '{"x": 1')])
    assert [(d.index, d.name, d.arguments) for d in first] == [(0, "a", '{"x": 1')] and first[0].id.startswith("call_")
    assert stream.update([PartialCall("a", '{"x": 12')])[0] == CallDelta(0, "2")
    calls = [ToolCall("a", '{"x": 12}'), ToolCall("b", "{}")]
    assert stream.agrees(calls) and not stream.agrees([ToolCall("a", '{"y": 1}')]) and not stream.agrees([])
    rest = stream.complete(calls)
    assert rest[0] == CallDelta(0, "}") and (rest[1].name, rest[1].arguments) == ("b", "{}")
    assert calls[0].id == first[0].id  # the streamed call's id is the answer's
    assert CallDelta(1, "}").body() == {"index": 1, "function": {"arguments": "}"}}


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False,
                         allow_infinity=False, width=32), st.text(alphabet=st.sampled_from('ab{}[]",:\\ \n\té<'),
                                                                 max_size=6))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(alphabet='xy{"\\', max_size=3), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(arguments=st.dictionaries(st.text(alphabet='kq"}\\', max_size=3), JSON_VALUES, max_size=4),
       indent=st.sampled_from([None, 1]), name_last=st.booleans())
def test_partial_json_call_reads_every_prefix_as_the_start_of_the_arguments(arguments, indent, name_last):
    """For every prefix of a JSON call object, the arguments read are the start of the arguments' text as written,
    and the whole object gives exactly that text (any JSON inside: braces and quotes in strings, escapes, nesting)."""
    members = [("name", "w"), ("arguments", arguments)]
    text = "{" + ", ".join(json.dumps(k) + ": " + json.dumps(v, indent=indent) for k, v in
                           (members[::-1] if name_last else members)) + "}"
    written = json.dumps(arguments, indent=indent)
    for cut in range(len(text) + 1):
        call, end = partial_json_call(text[:cut], 0, ("arguments",))
        if call is not None:
            assert call.name == "w" and written.startswith(call.arguments), (cut, call)
        assert end is None or cut == len(text)
    call, end = partial_json_call(text, 0, ("arguments",))
    assert (call.arguments, end) == (written, len(text)) and json.loads(written) == arguments


def test_json_members_and_value_end_read_as_far_as_the_text_goes():
    assert value_end('"a\\"b" x', 0) == 6 and value_end('{"}": [1, "]"]} ,', 0) == 15 and value_end("12", 0) is None
    assert value_end("12,", 0) == 2 and value_end('{"a": [1', 0) is None and value_end('"ab', 0) is None
    assert value_end('["a\\"]", 1] x', 0) == 11 and value_end('["a]', 0) is None  # a bracket inside an open string
    # Python literals (pythonic calls): triple quotes, escapes, nesting; None while a string is open
    assert python_value_end("'''a'b'', c)''', d=1)", 0) == 15 and python_value_end("'a\\'b', x", 0) == 6
    assert python_value_end("(1, [2, 3]))", 0) == 11 and python_value_end("'ab", 0) is None
    assert python_value_end('"""x', 0) is None and python_value_end(", x", 0) is None
    members, end = json_members('{"a": 1, "b": {"c": "}"}, "d"', 0)
    assert [(m.key, m.end is not None) for m in members] == [("a", True), ("b", True)] and end is None
    assert json_members("{ }", 0) == ([], 3) and json_members("[1]", 0) == ([], None)
    assert partial_json_call('{"name": "a"}', 0, ("arguments",))[0].arguments == "{}"  # closed without arguments
    assert [c.name for c in partial_json_list('[{"name": "a", "parameters": {}}, {"name": "b', ("parameters",))] == ["a"]


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.one_of(st.text(alphabet='ab<>/\n "\\éparm=', max_size=12), st.integers(-99, 99),
                                 st.lists(st.integers(0, 9), max_size=3)), min_size=0, max_size=3))
def test_qwen3_coder_partial_arguments_are_the_start_of_the_final_json(values):
    """For every prefix of a Qwen3-Coder call (string values with newlines, tags' pieces, quotes; typed values), the
    arguments read are the start of `json.dumps` of what `parse` reads from the whole call."""
    kinds = {str: "string", int: "integer", list: "array"}
    properties = {f"p{i}": {"type": kinds[type(v)]} for i, v in enumerate(values)}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties}}}]
    body = "".join(f"<parameter=p{i}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for i, v in enumerate(values))
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    parser = Qwen3CoderParser()
    content, calls = parser.parse(text, tools)
    if "</parameter>" in "".join(v for v in values if isinstance(v, str)):
        return  # a value holding its own closing tag is not one value
    assert len(calls) == 1 and json.loads(calls[0].arguments) == dict(zip(properties, values))
    for cut in range(len(text) + 1):
        for call in parser.partial_calls(text[:cut], tools):
            assert call.name == "f" and calls[0].arguments.startswith(call.arguments), (cut, call)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_calls_get_the_parsers_ids(choice):
    """A parser with its own call ids (Mistral's templates demand 9 characters of the ids a client sends back) gives
    them to streamed calls and to forced ones; the others' are `call_...`."""
    text = ('[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}' if choice == "auto"
            else '[{"name": "weather", "parameters": {"city": "Oslo"}}]')
    for parser, length in ((MistralParser(), 9), (HermesParser(), len("call_") + 24)):
        tools = ToolRequest([WEATHER], choice)
        if choice == "auto" and parser.name == "hermes":
            continue
        for size in (None, 3):  # whole, then streamed
            if size is None:
                parts = AnswerParts(tools, parser).finish(text)
            else:
                parts = stream_answer(tools, parser, text, size)[2]
            assert [(c.name, len(c.id)) for c in parts.calls] == [("weather", length)]


PYTHON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-999, 999), st.text(alphabet="ab,()[]'\"\\ \né=", max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(alphabet="k,)'", max_size=2), inner,
                                                                            max_size=2)), max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.dictionaries(st.sampled_from(["city", "days", "q", "x_1"]), PYTHON_VALUES, max_size=3),
                      min_size=1, max_size=2))
def test_pythonic_partial_arguments_are_the_start_of_the_final_json(calls):
    """For every prefix of a pythonic list of calls (string values with commas, parentheses, quotes and escapes;
    nested lists and dicts), the arguments read are the start of those `parse` reads from the whole list."""
    text = "[" + ", ".join(f"f{i}(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"
                           for i, kw in enumerate(calls)) + "]"
    parser = PythonicParser()
    content, whole = parser.parse(text)
    assert content == "" and [json.loads(c.arguments) for c in whole] == calls
    for cut in range(len(text) + 1):
        for index, call in enumerate(parser.partial_calls(text[:cut])):
            assert call.name == f"f{index}" and whole[index].arguments.startswith(call.arguments), (cut, call)
    assert [c.arguments + "}" for c in parser.partial_calls(text)] == [c.arguments for c in whole]
