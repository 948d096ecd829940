"""`ChatSession(tools=...)`: the answer's calls read out as the server reads them, tool results added, the model going
on after them exactly as the chat endpoint answers the same conversation."""

from __future__ import annotations

import json

import pytest

from specheads import ChatSession, SpeculativeLM

from .conftest import make_heads
from .test_server import post
from .test_tool_calls import PLAIN_TEMPLATE, QUESTION, TOOL_TEMPLATE, WEATHER, tool_server  # noqa: F401 (a fixture)


def test_a_session_with_tools_reads_calls_and_goes_on_after_their_results(tool_server):  # noqa: F811
    url, target, tokenizer = tool_server
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    session = ChatSession(lm, chat_template=TOOL_TEMPLATE, tools=[WEATHER], max_new_tokens=80)
    assert session.tool_parser.name == "hermes"  # read off the template
    answer = session.ask(QUESTION[0]["content"])
    _, whole = post(url, {"messages": QUESTION, "tools": [WEATHER], "max_tokens": 80})
    message = whole["choices"][0]["message"]
    assert answer == message["content"] == "Let me look."
    assert [(c.name, c.arguments) for c in session.last_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    call = session.last_calls[0]
    session.add_tool_result(call.id, "rain")
    after = session.reply()
    # the chat endpoint, given the same conversation, answers the same
    history = QUESTION + [{"role": "assistant", "content": "Let me look.", "tool_calls": [call.body()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
    _, chat = post(url, {"messages": history, "tools": [WEATHER], "max_tokens": 80})
    assert after == (chat["choices"][0]["message"]["content"] or "")
    assert session.messages[-1]["role"] == "assistant" and json.loads(call.arguments) == {"city": "Paris"}
    with pytest.raises(ValueError, match="call_id='call_x' is not a call of the last answer"):
        session.add_tool_result("call_x", "sun")
    with pytest.raises(ValueError, match=r"reply\(\) goes on after tool results"):
        session.reply()


def test_tools_a_template_cannot_show_are_refused(stories260k):
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="shows no tool-call format known here"):
        ChatSession(lm, chat_template=PLAIN_TEMPLATE, tools=[WEATHER])
    with pytest.raises(ValueError, match="leaves the tools out of the prompt"):
        ChatSession(lm, chat_template=PLAIN_TEMPLATE, tools=[WEATHER], tool_parser="hermes")
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        ChatSession(lm, chat_template=TOOL_TEMPLATE, tools=[{"type": "function"}])


def test_chat_command_with_tools_asks_each_result_then_goes_on(tool_server, monkeypatch, capsys):  # noqa: F811
    """`specheads chat --tools`: a call is printed on stderr, the next input line is its result, the model goes on."""
    import io
    import sys

    from specheads.cli import _chat_loop

    _, target, tokenizer = tool_server
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    session = ChatSession(lm, chat_template=TOOL_TEMPLATE, tools=[WEATHER], max_new_tokens=80)
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION[0]["content"] + "\nrain\n/exit\n"))
    _chat_loop(session, [], "raw")
    _, err = capsys.readouterr()
    assert 'tool call weather({"city": "Paris"}) [call_' in err and "its result?" in err
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[2]["content"] == "rain"


def test_chat_command_reads_tools_from_json_or_a_file(tmp_path):
    from specheads.cli import _read_tools

    assert _read_tools(json.dumps([WEATHER])) == [WEATHER]
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    assert _read_tools(str(tmp_path / "tools.json")) == [WEATHER]
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ValueError, match="expected a JSON list of tools"):
        _read_tools(str(tmp_path / "bad.json"))
    with pytest.raises(FileNotFoundError):
        _read_tools(str(tmp_path / "missing.json"))
