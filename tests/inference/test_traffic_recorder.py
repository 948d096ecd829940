"""`specheads serve --record FILE`: every answered chat request becomes training conversations that `specheads train`
reads (the answer as the assistant's turn, each distinct answer once), and completions prompt-completion records;
images are left out; concurrent requests never interleave their lines."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from specheads import SpeculativeLM
from specheads.inference.server import CompletionService, make_server
from specheads.inference.tool_calls import ToolCall
from specheads.inference.traffic_recorder import TrafficRecorder
from specheads.training.conversations import to_messages
from specheads.training.data import build_dataset

from .conftest import make_heads
from .test_server import MODEL, TEMPLATE, post
from .test_tool_calls import TOOL_TEMPLATE, WEATHER


@pytest.fixture()
def recording_server(stories260k, tmp_path):
    """A live server recording to tmp_path/traffic.jsonl: (base URL, the record file)."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle3"), tokenizer=tokenizer)
    path = tmp_path / "traffic.jsonl"
    service = CompletionService(lm, MODEL, {"max_new_tokens": 16}, cache_slots=2, chat_template=TEMPLATE,
                                record=str(path))
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", path
    httpd.shutdown()
    httpd.server_close()
    service.close()


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_served_chat_answers_are_recorded_as_conversations_that_train(recording_server, stories260k):
    url, path = recording_server
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "Tom had a big red ball"}]
    _, whole = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 12})
    _, events = post(url + "/v1/chat/completions", {"messages": messages[1:], "max_tokens": 12, "stream": True})
    _, sampled = post(url + "/v1/chat/completions", {"messages": messages[1:], "max_tokens": 8, "n": 2,
                                                     "temperature": 1.0, "seed": 3})
    _, greedy_twice = post(url + "/v1/chat/completions", {"messages": messages[1:], "max_tokens": 8, "n": 2})
    _, response = post(url + "/v1/responses", {"input": "Lily saw a cat", "max_output_tokens": 8})
    _, completed = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8})
    kept = records(path)
    # one record per distinct answer: 1 + 1 (streamed) + 2 (sampled) + 1 (greedy n=2: one answer) + 1 (responses)
    # + 1 (completions: a prompt-completion record)
    assert len(kept) == 7 and len({r["id"] for r in kept}) == 7
    assert (kept[6]["prompt"], kept[6]["completion"]) == ("Once upon a time", completed["choices"][0]["text"])
    assert kept[0]["messages"] == [*messages, {"role": "assistant", "content": whole["choices"][0]["message"]["content"]}]
    assert kept[0]["finish_reason"] == "length" and "tools" not in kept[0]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert kept[1]["messages"][-1]["content"] == streamed and kept[1]["messages"][:-1] == messages[1:]
    assert [r["messages"][-1]["content"] for r in kept[2:4]] == [c["message"]["content"] for c in sampled["choices"]]
    assert kept[4]["messages"][-1]["content"] == greedy_twice["choices"][0]["message"]["content"]
    assert kept[5]["messages"] == [{"role": "user", "content": "Lily saw a cat"},
                                   {"role": "assistant", "content": response["output"][0]["content"][0]["text"]}]
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:  # counted for operators
        assert "specheads_recorded_answers_total 7" in response.read().decode()
    # the file is training data: every record tokenizes, and the answers are what the loss reads
    _, tokenizer = stories260k
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = TEMPLATE
    dataset = build_dataset(path, tokenizer, "auto", max_length=128, progress=False)  # both formats, one file
    assert len(dataset) == 7
    trained = tokenizer.decode([t for t, m in zip(dataset[0]["input_ids"], dataset[0]["loss_mask"]) if m])
    assert whole["choices"][0]["message"]["content"].strip() in trained
    completion = tokenizer.decode([t for t, m in zip(dataset[6]["input_ids"], dataset[6]["loss_mask"]) if m])
    assert completion.strip() == completed["choices"][0]["text"].strip()  # the completion, trained after its prompt


def test_tool_calls_and_reasoning_are_kept_as_the_template_renders_them(tmp_path):
    recorder = TrafficRecorder(tmp_path / "sub" / "traffic.jsonl")  # the folder is made
    call = ToolCall("weather", '{"city": "Paris"}')
    question = [{"role": "user", "content": "Weather in Paris?"}]
    recorder.record(question, [WEATHER], [("", "Look it up.", [call.body()], "tool_calls")])
    (record,) = records(tmp_path / "sub" / "traffic.jsonl")
    assert record["tools"] == [WEATHER] and record["finish_reason"] == "tool_calls"
    answer = record["messages"][-1]
    assert answer == {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                      "tool_calls": [call.body()]}
    # training keeps the fields the template renders
    assert to_messages(record, "openai")[-1]["tool_calls"] == [call.body()]
    from jinja2 import Template

    rendered = Template(TOOL_TEMPLATE).render(messages=to_messages(record, "openai"), tools=record["tools"])
    assert '{"arguments": "{\\"city\\": \\"Paris\\"}", "name": "weather"}' in rendered


def test_requests_with_images_are_left_out_and_counted(tmp_path):
    recorder = TrafficRecorder(tmp_path / "traffic.jsonl")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                          {"type": "text", "text": "What is this?"}]}]
    recorder.record(image, None, [("A cat.", None, [], "stop")])
    assert recorder.skipped == 1 and recorder.recorded == 0 and not (tmp_path / "traffic.jsonl").exists()


def test_concurrent_requests_write_whole_lines(tmp_path):
    recorder = TrafficRecorder(tmp_path / "traffic.jsonl")
    long_answer = "once upon a time " * 400  # lines of ~7 kB: a torn write would show

    def answer(i: int) -> None:
        for _ in range(20):
            recorder.record([{"role": "user", "content": f"story {i}"}], None, [(long_answer, None, [], "stop")] * 2)

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept = records(tmp_path / "traffic.jsonl")
    assert len(kept) == recorder.recorded == 8 * 20 * 2
    assert all(r["messages"][-1]["content"] == long_answer for r in kept)
