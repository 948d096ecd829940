"""OpenAI's Responses API (`POST /v1/responses`): a request is the chat request it asks for, so the answer is the chat
endpoint's (the target's own), returned as reasoning, message and function_call items, whole or as typed events whose
deltas join to the whole; server-side state and built-in tools are refused by name."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from specheads.inference.openai_api import ApiError
from specheads.inference.responses_api import chat_body

from .test_server import post
from .test_tool_calls import (  # noqa: F401 (tool_server is a fixture)
    CALL_ANSWER,
    QUESTION,
    THINKING_ANSWER,
    THINKING_QUESTION,
    WEATHER,
    tool_server,
)

FUNCTION_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


def responses_url(server: tuple) -> str:
    return server[0].replace("/v1/chat/completions", "/v1/responses")


def events_of(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event type, payload) of a streamed response, in order."""
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers.get("Content-Type") == "text/event-stream"
        raw = response.read().decode()
    events = []
    for block in raw.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            events.append((kind[len("event: "):], json.loads(data[len("data: "):])))
    return events


def test_chat_body_reads_a_responses_request():
    body = chat_body({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "store": True,
        "metadata": {"k": "v"}, "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}, "tools": [FUNCTION_WEATHER], "tool_choice": {"type": "function", "name": "weather"},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                         "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"type": "function_call_output", "call_id": "call_2", "output": {"sky": "clear"}},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]},
            {"role": "user", "content": "Thanks"}]})
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][1]["content"][1] == {"type": "text", "text": "Paris?"}
    calls = body["messages"][2]
    assert calls["role"] == "assistant" and calls["reasoning_content"] == "Ask." and [
        c["function"]["arguments"] for c in calls["tool_calls"]] == ['{"city": "Paris"}', '{"city": "Lyon"}']
    assert body["messages"][3:5] == [{"role": "tool", "tool_call_id": "call_1", "content": "rain"},
                                     {"role": "tool", "tool_call_id": "call_2", "content": '{"sky": "clear"}'}]
    assert [m["role"] for m in body["messages"][5:]] == ["assistant", "user"]
    assert body["max_tokens"] == 7 and body["temperature"] == 0 and body["reasoning_effort"] == "low"
    assert body["tools"] == [WEATHER] and body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert chat_body({"input": "Hi", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    assert chat_body({"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"input": "Hi", "conversation": "conv_1"}, "conversation", "not stored"),
    ({"input": "Hi", "background": True}, "background", "background"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"input": "Hi", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": ""}, "input", "non-empty"),
    ({"input": [{"type": "file_search_call"}]}, "input", "expected a message"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_image"),
])
def test_requests_it_cannot_answer_are_refused_by_name(body, param, needle):
    with pytest.raises(ApiError, match=needle) as err:
        chat_body(body)
    assert err.value.param == param


def test_a_response_is_the_chat_answer_as_items_whole_or_streamed(tool_server):  # noqa: F811
    """Plain text, reasoning and a tool call (the fine-tune's answers): the items hold what the chat endpoint returns
    for the same request; streamed, the deltas join to the items and the events follow the Responses API's order."""
    url = responses_url(tool_server)
    for question, tools in ((THINKING_QUESTION, None), (QUESTION, [WEATHER]), ([{"role": "user", "content": "Hi"}],
                                                                             None)):
        chat_request = {"messages": question, **({"tools": tools} if tools else {})}
        _, chat = post(tool_server[0], chat_request)
        message = chat["choices"][0]["message"]
        request = {"input": question[0]["content"], **({"tools": [FUNCTION_WEATHER]} if tools else {})}
        status, body = post(url, request)
        assert status == 200 and body["object"] == "response" and body["status"] == "completed", body
        items = {item["type"]: item for item in body["output"]}
        assert items.get("reasoning", {}).get("content", [{}])[0].get("text") == message.get("reasoning_content")
        if message["content"] or not message.get("tool_calls"):
            assert items["message"]["content"][0]["text"] == (message["content"] or "")
        calls = [(i["name"], json.loads(i["arguments"])) for i in body["output"] if i["type"] == "function_call"]
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in message.get("tool_calls", [])]
        assert body["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] and body["usage"]["input_tokens"] > 0
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == chat["usage"]["completion_tokens_details"][
            "reasoning_tokens"] and (chat["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0) == (
            "reasoning_content" in message)

        events = events_of(url, request)
        kinds = [kind for kind, _ in events]
        assert "error" not in kinds, events
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
        final = events[-1][1]["response"]
        assert [i["type"] for i in final["output"]] == [i["type"] for i in body["output"]]
        for item in final["output"]:
            if item["type"] == "message":
                deltas = [p["delta"] for k, p in events if k == "response.output_text.delta" and p["item_id"] == item["id"]]
                assert "".join(deltas) == item["content"][0]["text"] == items["message"]["content"][0]["text"]
            if item["type"] == "reasoning":
                deltas = [p["delta"] for k, p in events if k == "response.reasoning_text.delta"]
                assert "".join(deltas) == item["content"][0]["text"] == message["reasoning_content"]
            if item["type"] == "function_call":
                done = [p for k, p in events if k == "response.function_call_arguments.done"]
                assert [p["arguments"] for p in done] == [item["arguments"]]
                # sent while written: the arguments in several pieces that join to the call's
                deltas = [p["delta"] for k, p in events if k == "response.function_call_arguments.delta"]
                assert len(deltas) > 1 and "".join(deltas) == item["arguments"]
                assert kinds.index("response.output_item.added", kinds.index("response.output_item.done")) < kinds.index(
                    "response.function_call_arguments.delta")  # the call's item opened after the message closed
        added = [p["item"]["id"] for k, p in events if k == "response.output_item.added"]
        finished = [p["item"]["id"] for k, p in events if k == "response.output_item.done"]
        assert added == finished == [i["id"] for i in final["output"]]  # each item opened, then closed, in order
    assert "<tool_call>" in CALL_ANSWER and "<think>" in THINKING_ANSWER  # what the fine-tune answers


def test_an_agent_turn_with_calls_and_outputs_is_the_chat_conversation(tool_server):  # noqa: F811
    """A follow-up request holding the call and its output as items renders the prompt the chat messages render; a
    response cut by max_output_tokens is "incomplete"; an unknown route names the three."""
    service_url = tool_server[0]
    url = responses_url(tool_server)
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    _, chat = post(service_url, {"messages": messages, "tools": [WEATHER], "max_tokens": 12})
    status, body = post(url, {"tools": [FUNCTION_WEATHER], "max_output_tokens": 12, "input": [
        {"role": "user", "content": QUESTION[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]})
    assert status == 200 and body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    text = next(i for i in body["output"] if i["type"] == "message")["content"][0]["text"]
    assert text == (chat["choices"][0]["message"]["content"] or "")
    if chat["choices"][0]["finish_reason"] == "length":
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    status, body = post(url, {"input": "Hi", "max_output_tokens": 1})
    assert status == 200 and body["status"] == "incomplete" and body["usage"]["output_tokens"] == 1
    status, body = post(url, {"input": "Hi", "previous_response_id": "resp_x"})
    assert status == 400 and body["error"]["param"] == "previous_response_id"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(url.replace("responses", "nothing"), data=b"{}"), timeout=30)
    assert "/v1/responses" in json.loads(err.value.read())["error"]["message"]
