"""Tool calls and reasoning in `specheads serve`: the request's tools reach the chat template, the calls are read out
of the target's own answer (parsed for tool_choice "auto", constrained to the calls' JSON for "required" / a named
function), a think block is split off as `reasoning_content`, streamed answers hold back what may still become a call
or the block's end, and bad tool requests get an error naming the field."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.answer_parts import AnswerParts
from specheads.inference.openai_api import ApiError, parse_request
from specheads.inference.server import CompletionService, make_server
from specheads.inference.tool_calls import ToolRequest, template_message, tool_request
from specheads.inference.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    detect_parser,
    parameter_value,
)

from .conftest import join_streamed_calls, make_heads
from .test_server import post

# a Hermes-style tool-calling template written for these tests: the tools' names in the prompt, earlier calls written
# as <tool_call> blocks (their arguments as the template gets them), tool results as "tool:" turns, an earlier
# answer's reasoning in a think block (as Qwen3's), and a generation prompt that opens one when asked (as DeepSeek-R1's)
TOOL_TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{%- if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}"
    "{%- else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if open_think %}<think>\n{% endif %}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}"
)
# the call formats of Qwen3-Coder / Qwen3.5 and of the pythonic templates (Llama 4, Gemma 3), taught as those
# templates teach them (shortened)
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>\nReply with "
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call>\n{% endif %}" + PLAIN_TEMPLATE)
PYTHONIC_TEMPLATE = (
    "{%- if tools %}Call as [func_name1(params_name1=params_value1), func_name2(params)]: "
    "{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}" + PLAIN_TEMPLATE)
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}  # no parameters
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL_ANSWER = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINKING_QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
THINKING_ANSWER = "<think>\nThe sky is blue on a sunny day.\n</think>\n\nYes, it is blue."


def template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=TOOL_TEMPLATE,
                                         tools=tools, return_dict=True, **kwargs)["input_ids"]


def tuned_to_answer(target, tokenizer, pairs: list[tuple[list[int], str]], steps: int = 600):
    """A copy of `target` fine-tuned until its greedy answer to each prompt of `pairs` is that pair's answer then
    EOS: a real model whose own output holds a tool call or a think block (stories260K writes neither by itself)."""
    torch.manual_seed(0)
    model = copy.deepcopy(target).train().requires_grad_(True)  # the loaded target is frozen
    examples = []
    for prompt, answer in pairs:
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + answer_ids])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        examples.append((ids, labels))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = sum(model(ids, labels=labels).loss for ids, labels in examples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3 * len(examples):
            break
    model.eval()
    for (prompt, answer), (ids, _) in zip(pairs, examples):
        prompt_ids = torch.tensor([prompt])
        out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                             max_new_tokens=ids.shape[1] - len(prompt) + 4, do_sample=False)
        assert out[0].tolist() == ids[0].tolist(), f"the fine-tune did not learn to answer {answer!r}"
    return model


@pytest.fixture(scope="module")
def tool_server(stories260k):
    """A live server over a stories260K fine-tuned to answer QUESTION (with the weather tool) with CALL_ANSWER and
    THINKING_QUESTION with THINKING_ANSWER: (base URL, target, tokenizer)."""
    target, tokenizer = stories260k
    target = tuned_to_answer(target, tokenizer, [(template_ids(tokenizer, QUESTION, [WEATHER]), CALL_ANSWER),
                                                 (template_ids(tokenizer, THINKING_QUESTION), THINKING_ANSWER)])
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    service = CompletionService(lm, "stories", {"max_new_tokens": 80}, cache_slots=2, chat_template=TOOL_TEMPLATE)
    assert service.tool_parser.name == "hermes" and service.reasoning_parser.name == "think"  # read off the template
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions", target, tokenizer
    httpd.shutdown()
    httpd.server_close()
    service.close()


def greedy_answer(target, tokenizer, prompt: list[int], max_new_tokens: int = 80, **kwargs) -> str:
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_auto_tool_choice_returns_the_call_the_target_wrote(tool_server):
    url, target, tokenizer = tool_server
    text = greedy_answer(target, tokenizer, template_ids(tokenizer, QUESTION, [WEATHER]))
    assert "<tool_call>" in text  # the target's own answer holds the call
    status, body = post(url, {"messages": QUESTION, "tools": [WEATHER, CLOCK]})
    assert status == 200, body
    # the prompt showed both tools: the model answered after another prompt than the fine-tune's, so compare with
    # the target's greedy answer to that one
    expected = greedy_answer(target, tokenizer, template_ids(tokenizer, QUESTION, [WEATHER, CLOCK]))
    content, calls = HermesParser().parse(expected)
    message, choice = body["choices"][0]["message"], body["choices"][0]
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == [c.name for c in calls]
    if calls:
        assert choice["finish_reason"] == "tool_calls" and message["content"] == (content or None)
    else:  # (torch 2.13: the fine-tune writes a malformed call after this prompt) returned as text, never repaired
        assert message == {"role": "assistant", "content": expected} and choice["finish_reason"] != "tool_calls"

    # the fine-tune's own prompt: the call, its arguments as a JSON string, the text before it as the content
    status, body = post(url, {"messages": QUESTION, "tools": [WEATHER]})
    message = body["choices"][0]["message"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == text[:text.index("<tool_call>")].rstrip() and "Let me look." in message["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("weather", {"city": "Paris"})]
    assert message["tool_calls"][0]["id"].startswith("call_") and message["tool_calls"][0]["type"] == "function"

    # tool_choice "none": the same answer, as text
    status, body = post(url, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"})
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_streamed_tool_call_is_sent_as_it_is_written(tool_server):
    """Streamed, the content goes before the call, never the call's text; the call goes as it is written (its name
    first, then its arguments in pieces) and its pieces join to the whole answer's call."""
    url, _, _ = tool_server
    request = {"messages": QUESTION, "tools": [WEATHER]}
    _, whole = post(url, request)
    status, events = post(url, {**request, "stream": True})
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == whole["choices"][0]["message"]["content"]
    assert not any("<tool" in d.get("content", "") for d in deltas)  # no piece of the call went out as content
    pieces = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(name, arguments) for _, name, arguments in join_streamed_calls(pieces)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["choices"][0]["message"]["tool_calls"]]
    assert len(pieces) > 2  # the arguments went in pieces while written, not whole at the end
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len([d for d in deltas if d.get("content")]) > 1  # the content streamed in pieces before the call


def test_a_conversation_with_calls_and_results_renders_as_the_template_renders_it(tool_server):
    url, target, tokenizer = tool_server
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    parsed = parse_request({"messages": messages, "tools": [WEATHER]}, True, tokenizer, {}, TOOL_TEMPLATE,
                           tool_parser="hermes")
    # the template gets the arguments as an object (templates write them with tojson), the result as a tool turn
    as_template_takes_them = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"}]
    assert parsed.input_ids[0].tolist() == template_ids(tokenizer, as_template_takes_them, [WEATHER])
    text = tokenizer.decode(parsed.input_ids[0])
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "tool:rain" in text
    status, body = post(url, {"messages": messages, "tools": [WEATHER], "max_tokens": 12})
    answer = greedy_answer(target, tokenizer, parsed.input_ids[0].tolist(), 12)
    assert status == 200 and body["choices"][0]["message"]["content"] == HermesParser().parse(answer)[0]


def test_reasoning_is_split_off_as_reasoning_content_streamed_or_not(tool_server):
    url, target, tokenizer = tool_server
    assert greedy_answer(target, tokenizer, template_ids(tokenizer, THINKING_QUESTION)) == THINKING_ANSWER
    status, body = post(url, {"messages": THINKING_QUESTION})
    message = body["choices"][0]["message"]
    assert status == 200 and message == {"role": "assistant", "content": "Yes, it is blue.",
                                         "reasoning_content": "The sky is blue on a sunny day."}
    # the reasoning tokens: the fewest of the answer's tokens that spell its block, through </think>
    ids = torch.tensor([template_ids(tokenizer, THINKING_QUESTION)])
    new = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=80, do_sample=False)[0, ids.shape[1]:]
    thought = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < thought < body["usage"]["completion_tokens"]
    assert tokenizer.decode(new[:thought]).endswith("</think>") and "</think>" not in tokenizer.decode(new[:thought - 1])
    status, events = post(url, {"messages": THINKING_QUESTION, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if "content" in d]
    assert "".join(reasoning) == message["reasoning_content"] and "".join(content) == message["content"]
    assert len(reasoning) > 1 and len(content) > 1  # both streamed in pieces
    assert not any("think>" in piece for piece in reasoning + content)
    assert all("content" not in d for d in deltas[:deltas.index(next(d for d in deltas if "content" in d))])

    # a cut answer: the block never closed is all reasoning
    status, body = post(url, {"messages": THINKING_QUESTION, "max_tokens": 14})
    cut = greedy_answer(target, tokenizer, template_ids(tokenizer, THINKING_QUESTION), 14)
    message = body["choices"][0]["message"]
    assert cut.startswith("<think>") and "</think>" not in cut
    assert message == {"role": "assistant", "content": "", "reasoning_content": cut.replace("<think>", "").strip()}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 14  # all of a block never closed

    # a prompt that opens the block (DeepSeek-R1's generation prompt): the answer starts as reasoning
    ids = template_ids(tokenizer, QUESTION, open_think=True)
    expected = greedy_answer(target, tokenizer, ids, 10)
    status, body = post(url, {"messages": QUESTION, "max_tokens": 10, "chat_template_kwargs": {"open_think": True}})
    message = body["choices"][0]["message"]
    assert "</think>" not in expected and message == {"role": "assistant", "content": "",
                                                      "reasoning_content": expected.strip()}

    # an earlier answer's reasoning reaches the template
    turns = THINKING_QUESTION + [{"role": "assistant", "content": "Yes.", "reasoning_content": "Sky."},
                                 {"role": "user", "content": "Why?"}]
    parsed = parse_request({"messages": turns}, True, tokenizer, {}, TOOL_TEMPLATE)
    assert "assistant:<think>Sky.</think>Yes." in tokenizer.decode(parsed.input_ids[0])


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("text", [
    THINKING_ANSWER, "  <think>a</think>b", "<think>unclosed thoughts <", "no block", "<thi", "", " \n",
    "<think>\nWhich tool?\n</think>\n" + CALL_ANSWER, "thinking </think> answer", "a </thin",
])
def test_streamed_reasoning_and_content_are_the_parts_whatever_the_pieces(opened, text):
    """Streamed piece by piece (every split), the reasoning and content sent, plus what is sent at the end, are the
    whole answer's parts, with the tool call read out of the content only."""
    from specheads.inference.reasoning import ThinkParser

    tools = ToolRequest([WEATHER])
    whole = AnswerParts(tools, HermesParser(), ThinkParser(), opened).finish(text)
    for size in (1, 2, 5):
        stream = AnswerParts(tools, HermesParser(), ThinkParser(), opened)
        pieces = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)]
        parts = stream.finish(text)
        assert "".join(r for r, _ in pieces) + parts.unsent_reasoning == (whole.reasoning or "")
        assert "".join(c for _, c in pieces) + parts.unsent_content == whole.content
        assert not any("think>" in r + c for r, c in pieces)
    assert ThinkParser().split(THINKING_ANSWER, opened=False) == ("The sky is blue on a sunny day.", "Yes, it is blue.")
    if "Which tool" in text:
        assert whole.reasoning == "Which tool?" and [c.name for c in whole.calls] == ["weather"]
        assert whole.content == "Let me look."
    if not opened and not text.lstrip().startswith("<think>"):
        assert whole.reasoning is None and whole.content == text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_tool_choice_constrains_the_answer_to_the_calls_json(tool_server, choice):
    pytest.importorskip("outlines_core")
    from specheads.inference.constraints import CHAT_JSON_WHITESPACE, json_schema_constraint

    url, target, tokenizer = tool_server
    messages = [{"role": "user", "content": "Tom had a ball"}]  # not the fine-tune's question: no call of its own
    tools = tool_request({"tools": [WEATHER, CLOCK], "tool_choice": choice})
    constraint = json_schema_constraint(tokenizer, tools.schema(), CHAT_JSON_WHITESPACE)
    expected = greedy_answer(target, tokenizer, template_ids(tokenizer, messages, [WEATHER, CLOCK]), 60,
                             logits_processor=[constraint])
    for stream in (False, True):
        status, body = post(url, {"messages": messages, "tools": [WEATHER, CLOCK], "tool_choice": choice,
                                  "max_tokens": 60, "stream": stream})
        assert status == 200, body
        if stream:
            deltas = [e["choices"][0]["delta"] for e in body]
            assert "".join(d.get("content", "") for d in deltas) == ""
            reason = body[-1]["choices"][0]["finish_reason"]
            calls = [{"id": id_, "function": {"name": name, "arguments": arguments}}
                     for id_, name, arguments in join_streamed_calls([c for d in deltas for c in d.get("tool_calls", [])])]
        else:
            assert body["choices"][0]["message"]["content"] is None
            calls, reason = body["choices"][0]["message"]["tool_calls"], body["choices"][0]["finish_reason"]
        assert reason == "tool_calls"
        value = json.loads(expected)
        if isinstance(choice, dict):  # the answer is the named function's arguments
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("weather", value)]
        else:  # a list of {"name", "parameters"}
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
                (v["name"], v["parameters"]) for v in value]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "clock"}}}, "tool_choice",
         "naming one of the tools (weather)"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "function.name=None"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]="),
        ({"tools": {"weather": 1}}, "tools", "expected a list"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "'yes'"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "response_format", "send one"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "send one"),
        ({"functions": [{"name": "weather"}]}, "functions", "use tools"),
    ],
)
def test_bad_tool_requests_name_the_field(stories260k, body, param, needle):
    _, tokenizer = stories260k
    with pytest.raises(ApiError, match=None) as err:
        parse_request({"messages": QUESTION, **body}, True, tokenizer, {}, TOOL_TEMPLATE, tool_parser="hermes")
    assert err.value.param == param and needle in str(err.value), str(err.value)


def test_tools_need_a_template_that_shows_them_and_a_parser_for_auto(stories260k):
    _, tokenizer = stories260k
    strict = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns here') }}{% endif %}" \
             "{{ m['content'] }}{% endfor %}"
    with pytest.raises(ApiError, match="the chat template refused the messages: no tool turns here") as err:
        parse_request({"messages": QUESTION + [{"role": "tool", "content": "rain"}]}, True, tokenizer, {}, strict)
    assert err.value.param == "messages" and err.value.status == 400
    with pytest.raises(ApiError, match="does not show tools") as err:  # the model could not know the tools
        parse_request({"messages": QUESTION, "tools": [WEATHER]}, True, tokenizer, {}, PLAIN_TEMPLATE,
                      tool_parser="hermes")
    assert err.value.param == "tools"
    # tool_choice "none" asks nothing of them
    parse_request({"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"}, True, tokenizer, {},
                  PLAIN_TEMPLATE)
    with pytest.raises(ApiError, match="--tool-call-parser") as err:
        parse_request({"messages": QUESTION, "tools": [WEATHER]}, True, tokenizer, {}, TOOL_TEMPLATE)
    assert err.value.param == "tool_choice"
    with pytest.raises(ApiError, match="chat field") as err:
        parse_request({"prompt": "hi", "tools": [WEATHER]}, False, tokenizer, {})
    assert err.value.param == "tools"


def test_hermes_parser_reads_calls_and_leaves_anything_else_as_text():
    parser = HermesParser()
    two = ('Sure. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
           '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>')
    content, calls = parser.parse(two)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert len({c.id for c in calls}) == 2
    assert parser.parse('<tool_call>{"name": "a", "arguments": {}}')[1][0].name == "a"  # EOS before the closing tag
    for text in ("no call here", 'x <tool_call>{"name": "a", "arg', "<tool_call>[1, 2]</tool_call>",
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>'):
        assert parser.parse(text) == (text, []), text
    one = ToolRequest([WEATHER], parallel=False)
    assert [c.name for c in one.read_calls(two, parser)[1]] == ["a"]  # parallel_tool_calls false: the first


def test_llama3_json_parser_reads_whole_answers_of_calls():
    parser = Llama3JsonParser()
    content, calls = parser.parse('<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "arguments": {}}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"q": "x;y"}), ("b", {})]
    for text in ('The answer is {"name": "a", "parameters": {}}', '{"city": "Paris"}', '{"name": "a", "parameters": {',
                 "plain text"):
        assert parser.parse(text) == (text, []), text


def test_mistral_parser_reads_both_call_layouts():
    parser = MistralParser()
    for text in ('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',  # v3, marker skipped
                 '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',  # marker kept
                 'a{"x": 1} b{}', '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'):  # v11+, skipped and kept
        content, calls = parser.parse(text)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})], text
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # Mistral's templates refuse other ids
    for text in ("Paris is sunny.", '[1, 2]', 'a{"x": 1} and more', '[{"name": "a", "arguments": {', "Call a{"):
        assert parser.parse(text) == (text, []), text
    assert detect_parser("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"


def test_qwen3_coder_parser_reads_values_as_their_schemas_types():
    parser = Qwen3CoderParser()
    tools = [{"type": "function", "function": {"name": "write", "parameters": {"properties": {
        "path": {"type": "string"}, "body": {"type": "string"}, "lines": {"type": "integer"}, "force": {"type": "boolean"},
        "tags": {"type": "array"}, "mode": {"type": ["string", "null"]}, "size": {"type": "number"}}}}}]
    text = ("I'll write it.\n\n<tool_call>\n<function=write>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
            "<parameter=body>\ndef f():\n    return 1\n\n</parameter>\n<parameter=lines>\n2\n</parameter>\n"
            "<parameter=force>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=mode>\n12\n</parameter>\n<parameter=size>\nbig\n</parameter>\n<parameter=extra>\n{\"k\": null}\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=clock>\n</function>\n</tool_call>")
    content, calls = parser.parse(text, tools)
    assert content == "I'll write it." and [c.name for c in calls] == ["write", "clock"]
    assert json.loads(calls[0].arguments) == {
        "path": "/tmp/a.py", "body": "def f():\n    return 1\n",  # one newline trimmed each side: indentation kept
        "lines": 2, "force": True, "tags": ["a", 1], "mode": "12",  # a schema allowing a string keeps the text
        "size": "big",  # not a number: the string it is, never repaired
        "extra": {"k": None}}  # no schema: JSON when it is JSON
    assert json.loads(calls[1].arguments) == {}
    assert parameter_value("-4", {"type": "integer"}) == -4 and parameter_value("1.5", {"type": "integer"}) == "1.5"
    assert parameter_value("True", {"type": "boolean"}) == "True" and parameter_value("null", {"type": "null"}) is None
    assert parser.parse("<function=clock></function>")[1][0].name == "clock"  # without the <tool_call> wrapper
    assert parser.parse("<tool_call><function=clock></function>")[1][0].name == "clock"  # EOS before </tool_call>
    for bad in ("no call", "<tool_call>\n<function=write>\n<parameter=path>\n/tmp", "<tool_call>{\"name\": \"a\"}</tool_call>",
                "<function=a>stray<parameter=x>1</parameter></function>", "<function=a></function> and after"):
        assert parser.parse(bad, tools) == (bad, []), bad
    # read through a request: its tools give the types, parallel_tool_calls false keeps the first call
    request = ToolRequest(tools, parallel=False)
    assert [json.loads(c.arguments)["lines"] for c in request.read_calls(text, parser)[1]] == [2]


def test_pythonic_parser_reads_a_python_list_of_calls():
    parser = PythonicParser()
    for text in ('[weather(city="Paris", days=3, units=None), clock()]',
                 '<|python_start|>[weather(city="Paris", days=3, units=None), clock()]<|python_end|>'):  # tags kept
        content, calls = parser.parse(text)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("weather", {"city": "Paris", "days": 3, "units": None}), ("clock", {})], text
    assert json.loads(parser.parse("[a.b(x=[1, {'k': True}], y=(2, 3))]")[1][0].arguments) == {"x": [1, {"k": True}],
                                                                                                "y": [2, 3]}
    for text in ("[weather(city=paris)]",  # a variable: never evaluated
                 '[weather("Paris")]', "[weather(**kw)]", "[weather(x={1, 2})]", "[1, 2]", "[]", '[weather(city="P',
                 'Sure: [weather(city="Paris")]', "__import__('os').system('x')", "[f(x=__import__('os'))]"):
        assert parser.parse(text) == (text, []), text


def test_detect_parser_reads_the_format_off_the_template():
    assert detect_parser(TOOL_TEMPLATE) == "hermes"
    assert detect_parser(QWEN3_CODER_TEMPLATE) == "qwen3_coder"  # it holds <tool_call> too
    assert detect_parser(PYTHONIC_TEMPLATE) == "pythonic"
    assert detect_parser('Respond in the format {"name": function name, "parameters": dictionary}') == "llama3_json"
    assert detect_parser(PLAIN_TEMPLATE) is None and detect_parser(None) is None


def test_forced_schemas_and_template_messages():
    required = tool_request({"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False})
    schema = required.schema()
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    clock = schema["items"]["anyOf"][1]["properties"]
    assert clock["name"] == {"type": "string", "enum": ["clock"]} and clock["parameters"]["properties"] == {}
    named = tool_request({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    assert named.schema() == WEATHER["function"]["parameters"] and named.forced
    assert tool_request({"tools": [WEATHER]}).schema() is None
    assert template_message({"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{bad"}}]}) == {
        "tool_calls": [{"function": {"name": "a", "arguments": "{bad"}}]}  # left as the string it is


def test_min_tokens_ignore_eos_and_stop_token_ids_move_the_answers_end(tool_server):
    """vLLM's `min_tokens`: the fine-tune's answer ends (EOS) after its call; with min_tokens past that point it goes
    on, as `target.generate(min_new_tokens=...)` does."""
    url, target, tokenizer = tool_server
    prompt = template_ids(tokenizer, QUESTION, [WEATHER])
    ended = len(tokenizer(CALL_ANSWER, add_special_tokens=False).input_ids) + 1  # with its EOS
    expected = greedy_answer(target, tokenizer, prompt, ended + 6, min_new_tokens=ended + 4)
    status, body = post(url, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none",
                              "min_tokens": ended + 4, "max_tokens": ended + 6})
    assert status == 200 and body["choices"][0]["message"]["content"] == expected
    assert len(expected) > len(CALL_ANSWER) and body["usage"]["completion_tokens"] >= ended + 4

    # vLLM's ignore_eos: EOS is an ordinary token (left out of the text) and the answer runs to max_tokens
    ids = torch.tensor([prompt])
    out = target.generate(ids, max_new_tokens=ended + 6, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert tokenizer.eos_token_id in out[0, len(prompt):].tolist()  # it went through an EOS
    status, body = post(url, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none", "ignore_eos": True,
                              "max_tokens": ended + 6})
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == ended + 6 and body["choices"][0]["finish_reason"] == "length"

    # vLLM's stop_token_ids: a token of the answer ends it there (kept in it, as EOS is), EOS still ends it too
    stop = tokenizer(" Paris", add_special_tokens=False).input_ids[-1]
    out = target.generate(ids, max_new_tokens=ended + 6, do_sample=False, eos_token_id=[tokenizer.eos_token_id, stop])
    assert out.shape[1] - len(prompt) < ended and out[0, -1] == stop
    status, body = post(url, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none", "stop_token_ids": [stop],
                              "max_tokens": ended + 6})
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == out.shape[1] - len(prompt)


def test_sampled_choices_each_get_their_calls_streamed(tool_server):
    pytest.importorskip("outlines_core")
    url, _, _ = tool_server
    status, events = post(url, {"messages": [{"role": "user", "content": "Tom had a ball"}], "tools": [WEATHER, CLOCK],
                                "tool_choice": "required", "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 60,
                                "stream": True})
    assert status == 200
    for index in (0, 1):
        choices = [c for e in events for c in e["choices"] if c["index"] == index]
        calls = join_streamed_calls([call for c in choices for call in c["delta"].get("tool_calls", [])])
        assert calls and all(name in ("weather", "clock") for _, name, _ in calls), choices
        assert all(isinstance(json.loads(arguments), dict) for _, _, arguments in calls)
        assert choices[-1]["finish_reason"] == "tool_calls"


FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}
XML_ANSWER = "<tool_call>\n<function=forecast>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
PYTHONIC_ANSWER = '[forecast(city="Paris", days=3)]'


def test_qwen3_coder_and_pythonic_calls_come_from_the_targets_answer(stories260k):
    """A target fine-tuned to answer in Qwen3-Coder's XML under one template and in a pythonic list under another: each
    server picks its parser off its template, and the call (typed by the tool's schema) comes from the target's greedy
    answer, streamed and not."""
    target, tokenizer = stories260k

    def prompt(template: str) -> list[int]:
        return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, chat_template=template,
                                             tools=[FORECAST], return_dict=True)["input_ids"]

    target = tuned_to_answer(target, tokenizer, [(prompt(QWEN3_CODER_TEMPLATE), XML_ANSWER),
                                                 (prompt(PYTHONIC_TEMPLATE), PYTHONIC_ANSWER)])
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    for template, answer, parser in ((QWEN3_CODER_TEMPLATE, XML_ANSWER, "qwen3_coder"),
                                     (PYTHONIC_TEMPLATE, PYTHONIC_ANSWER, "pythonic")):
        assert greedy_answer(target, tokenizer, prompt(template)) == answer  # the target's own text holds the call
        service = CompletionService(lm, "stories", {"max_new_tokens": 80}, cache_slots=1, chat_template=template)
        try:
            assert service.tool_parser.name == parser
            request = service.parse({"messages": QUESTION, "tools": [FORECAST]}, chat=True)
            (choice,), _, _ = service.complete(request)
            expected = {"days": 3} if parser == "qwen3_coder" else {"city": "Paris", "days": 3}
            assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == [("forecast", expected)], repr(choice.text)
            assert choice.finish_reason == "tool_calls" and choice.text == ""
            sent: list[str] = []
            pieces: list = []
            (streamed,), _, _ = service.complete(request, on_text=lambda index, piece, logprobs, reasoning=None,
                                                 tool_calls=None, sent=sent, pieces=pieces: (
                                                     sent.append(piece), pieces.extend(tool_calls or [])))
            assert "".join(sent) == "" and streamed.unsent == ""  # no piece of the call went out as content
            assert [json.loads(c.arguments) for c in streamed.tool_calls] == [expected]
            # the call's pieces, with those that finish it, join to the answer's call (its id, name and arguments)
            joined = join_streamed_calls(pieces + streamed.unsent_calls)
            assert joined == [(c.id, c.name, c.arguments) for c in streamed.tool_calls]
            if parser == "qwen3_coder":  # sent while written (its name first), not at the end
                assert len(pieces) >= 2 and pieces[0].name == "forecast"
        finally:
            service.close()


def test_chat_prints_the_reasoning_apart_hides_it_or_prints_it_raw(tool_server, monkeypatch, capsys):
    """`specheads chat --reasoning show|hide|raw` over the fine-tune that thinks before it answers: the think block
    printed without its tags then a blank line and the answer, left out (its length on stderr), or as written."""
    import io
    import sys

    from specheads.cli import _chat_loop
    from specheads.inference.chat import ChatSession

    _, target, tokenizer = tool_server
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    assert greedy_answer(target, tokenizer, template_ids(tokenizer, THINKING_QUESTION)) == THINKING_ANSWER
    expected = {"show": "The sky is blue on a sunny day.\n\nYes, it is blue.\n", "hide": "Yes, it is blue.\n",
                "raw": THINKING_ANSWER + "\n"}
    for mode, printed in expected.items():
        session = ChatSession(lm, chat_template=TOOL_TEMPLATE, max_new_tokens=60)
        monkeypatch.setattr(sys, "stdin", io.StringIO(THINKING_QUESTION[0]["content"] + "\n"))
        _chat_loop(session, [], mode)
        out, err = capsys.readouterr()
        assert out == printed, mode
        assert ("reasoning hidden (31 characters" in err) == (mode == "hide"), err
        assert session.messages[-1]["content"] == THINKING_ANSWER  # the history keeps the answer as written


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_by_one_that_does_not(stories260k):
    """OpenAI's `reasoning_effort` is a chat-template keyword (gpt-oss's templates read it); a template that ignores
    it would change nothing, so the request is refused naming the field, as OpenAI refuses it for models without
    reasoning."""
    _, tokenizer = stories260k
    effort_template = "{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}" + PLAIN_TEMPLATE
    request = parse_request({"messages": QUESTION, "reasoning_effort": "low"}, True, tokenizer, {}, effort_template)
    assert tokenizer.decode(request.input_ids[0], skip_special_tokens=True).startswith("Reasoning: low\nuser:")
    kwargs = parse_request({"messages": QUESTION, "reasoning_effort": "low",
                            "chat_template_kwargs": {"reasoning_effort": "high"}}, True, tokenizer, {}, effort_template)
    assert "Reasoning: high" in tokenizer.decode(kwargs.input_ids[0])  # the explicit keyword wins
    for body, needle in (({"reasoning_effort": "low"}, "does not read it"),
                         ({"reasoning_effort": "max"}, "expected one of none, minimal, low, medium, high")):
        with pytest.raises(ApiError, match=needle) as err:
            parse_request({"messages": QUESTION, **body}, True, tokenizer, {}, PLAIN_TEMPLATE)
        assert err.value.param == "reasoning_effort"
