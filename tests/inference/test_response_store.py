"""Stored responses (inference/response_store.py): `previous_response_id` continues the conversation a response
ended, as the chat endpoint answers the whole conversation; responses are read back, listed and deleted by id."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from specheads.inference.openai_errors import ApiError
from specheads.inference.response_store import ResponseStore

from .test_responses_api import events_of, responses_url
from .test_server import post
from .test_tool_calls import tool_server  # noqa: F401 (a fixture)


def call(url: str, method: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET or DELETE."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def text_of(response: dict) -> str:
    return next(i for i in response["output"] if i["type"] == "message")["content"][0]["text"]


def test_previous_response_id_continues_the_conversation(tool_server):  # noqa: F811
    """A second turn naming the first is the chat answer to the whole conversation (its reasoning included);
    stored responses are read back, their input items listed, deleted; `store: false` keeps nothing; a streamed
    response is stored as its last event gives it."""
    url, chat_url = responses_url(tool_server), tool_server[0]
    status, first = post(url, {"input": "Tom had a dog", "max_output_tokens": 10})
    assert status == 200 and first["store"] is True and first["previous_response_id"] is None
    status, second = post(url, {"input": "The dog ran", "previous_response_id": first["id"], "max_output_tokens": 10})
    assert status == 200, second
    answer = {"role": "assistant", "content": text_of(first)}
    for item in first["output"]:  # the first answer's reasoning goes back with it (the template renders it)
        if item["type"] == "reasoning":
            answer["reasoning_content"] = item["content"][0]["text"]
    messages = [{"role": "user", "content": "Tom had a dog"}, answer, {"role": "user", "content": "The dog ran"}]
    _, chat = post(chat_url, {"messages": messages, "max_tokens": 10})
    assert text_of(second) == chat["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert second["previous_response_id"] == first["id"]

    assert call(f"{url}/{first['id']}", "GET") == (200, first)
    status, items = call(f"{url}/{second['id']}/input_items", "GET")
    assert status == 200 and [(i.get("role"), i["type"]) for i in items["data"]] == [("user", "message")] + [
        ("assistant" if i["type"] == "message" else None, i["type"]) for i in first["output"]] + [("user", "message")]
    assert call(f"{url}/{first['id']}", "DELETE") == (200, {"id": first["id"], "object": "response.deleted",
                                                            "deleted": True})
    status, gone = call(f"{url}/{first['id']}", "GET")
    assert status == 404 and first["id"] in gone["error"]["message"]
    status, refused = post(url, {"input": "Again", "previous_response_id": first["id"]})
    assert status == 400 and refused["error"]["param"] == "previous_response_id"

    status, unstored = post(url, {"input": "Hi", "store": False, "max_output_tokens": 2})
    assert status == 200 and unstored["store"] is False and call(f"{url}/{unstored['id']}", "GET")[0] == 404
    events = events_of(url, {"input": "And then?", "previous_response_id": second["id"], "max_output_tokens": 4})
    final = events[-1][1]["response"]
    assert call(f"{url}/{final['id']}", "GET") == (200, final) and final["previous_response_id"] == second["id"]


def test_the_store_forgets_the_least_recently_used_past_its_capacity():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.keep({"input": name}, {"id": name, "output": []})
    store.get("a")  # used: "b" is now the least recently used
    store.keep({"input": "c", "store": True}, {"id": "c", "output": []})
    assert len(store) == 2 and store.get("a")["id"] == "a" and store.input_items("c")["data"][0]["content"] == "c"
    with pytest.raises(ApiError, match="no stored response 'b'") as err:
        store.get("b")
    assert err.value.status == 404
    continued = store.continued({"input": [{"role": "user", "content": "d"}], "previous_response_id": "a"})
    assert "previous_response_id" not in continued and [i["content"] for i in continued["input"]] == ["a", "d"]
    with pytest.raises(ApiError, match="--responses-store 0") as err:
        ResponseStore(0).continued({"input": "x", "previous_response_id": "a"})
    assert err.value.param == "previous_response_id"
    assert store.stores({}) and not store.stores({"store": False}) and not ResponseStore(0).stores({})
    with pytest.raises(ValueError, match="capacity=-1"):
        ResponseStore(-1)


def test_a_responses_folder_keeps_the_store_across_restarts(tmp_path, caplog):
    """--responses-dir: stored responses come back in a new store (a restarted server), least recently used first
    past its capacity; forgotten, deleted and store:false responses leave no file; an unreadable file is skipped."""
    import os
    import time

    folder = tmp_path / "responses"
    store = ResponseStore(capacity=2, folder=folder)
    for name in ("a", "b"):
        store.keep({"input": name}, {"id": name, "output": [{"type": "message", "role": "assistant",
                                                             "content": [{"type": "output_text", "text": name}]}]})
        time.sleep(0.01)  # distinct file times
    store.keep({"input": "x", "store": False}, {"id": "x", "output": []})
    assert len(list(folder.glob("*.json"))) == 2
    time.sleep(0.01)
    store.get("a")  # used: "b" is now the least recently used, on disk too
    restarted = ResponseStore(capacity=2, folder=folder)
    assert len(restarted) == 2 and restarted.get("b")["id"] == "b" and restarted.input_items("a")["data"][0]["content"] == "a"
    continued = restarted.continued({"input": "more", "previous_response_id": "a"})
    assert [item.get("content") for item in continued["input"]][0] == "a"
    time.sleep(0.01)
    restarted.get("a")
    restarted.keep({"input": "c"}, {"id": "c", "output": []})  # forgets "b" (least recently used): its file goes
    assert len(list(folder.glob("*.json"))) == 2
    with pytest.raises(ApiError, match="no stored response 'b'"):
        ResponseStore(capacity=2, folder=folder).get("b")
    restarted.delete("c")
    assert len(list(folder.glob("*.json"))) == 1
    # a smaller capacity on restart keeps the newest; an unreadable file is skipped with a warning
    (folder / "broken.json").write_text("{not json")
    os.utime(folder / "broken.json", (0, 0))
    with caplog.at_level("WARNING"):
        small = ResponseStore(capacity=1, folder=folder)
    assert len(small) == 1 and small.get("a")["id"] == "a" and "skipping unreadable broken.json" in caplog.text
