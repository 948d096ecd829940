"""`specheads data regenerate --server URL`: an OpenAI-compatible server answers the prompts (a fake one records what
it is asked; our own server answers as the target would), in order, resumable, with clear errors."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specheads.cli import main
from specheads.training.server_answers import ServerClient, regenerate_with_server

from ..inference.test_server import post, server  # noqa: F401 (server is a fixture)

CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                                  {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "later turn"}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is 2+2?"}],
     "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "an opening answer"}, {"from": "human", "value": "Tell a story"}]},
    {"id": "d", "conversations": [{"from": "gpt", "value": "no user turn"}]},
    {"id": "e", "conversations": [{"from": "human", "value": "A benchmark question"}]},
]


class FakeServer:
    """An OpenAI-compatible stand-in: answers "echo: <last user message>" (with reasoning and, for requests with
    tools, a tool call), records every body, serves `models`, and fails the first `fail_first` requests with
    `fail_status`."""

    def __init__(self, models=("fake-model",), fail_first: int = 0, fail_status: int = 503) -> None:
        self.bodies: list[dict] = []
        self.models, self.fail_first, self.fail_status = list(models), fail_first, fail_status
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply(200, {"object": "list", "data": [{"id": m} for m in fake.models]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append({**body, "authorization": self.headers.get("Authorization")})
                    failing = fake.fail_first > 0
                    fake.fail_first -= failing
                if failing:
                    return self.reply(fake.fail_status, {"error": {"message": "model 'x' does not exist"}})
                message = {"role": "assistant", "content": "echo: " + body["messages"][-1]["content"],
                           "reasoning_content": "thinking"}
                if body.get("tools"):
                    message["tool_calls"] = [{"id": "call_0", "type": "function",
                                              "function": {"name": "add", "arguments": "{}"}}]
                self.reply(200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    made: list[FakeServer] = []

    def make(**kwargs) -> FakeServer:
        made.append(FakeServer(**kwargs))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


@pytest.fixture
def conversations(tmp_path) -> Path:
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    return path


def test_the_server_answers_each_prompt_in_order_and_a_rerun_resumes(fake_server, conversations, tmp_path):
    fake = fake_server(fail_first=1)  # one 503 first: retried
    out = tmp_path / "answers.jsonl"
    written = regenerate_with_server(ServerClient(fake.url, api_key="sk-test", retries=2), out, conversations,
                                     max_new_tokens=32, temperature=0.7, seed=3, concurrency=3,
                                     exclude={"A benchmark question"}, chat_template_kwargs={"enable_thinking": False},
                                     show_progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == 3 and [r["id"] for r in records] == ["a", "b", "c"]
    assert records[0]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "echo: Hi there", "reasoning_content": "thinking"}]
    assert records[1]["tools"] == CONVERSATIONS[1]["tools"] and records[1]["messages"][-1]["tool_calls"][0]["id"] == "call_0"
    assert records[2]["messages"][0] == {"role": "user", "content": "Tell a story"}  # the opening answer left out
    asked = {b["messages"][-1]["content"]: b for b in fake.bodies}
    assert len(fake.bodies) == 4 and set(asked) == {"Hi there", "What is 2+2?", "Tell a story"}
    body = asked["What is 2+2?"]
    assert body["model"] == "fake-model" and body["max_tokens"] == 32 and body["temperature"] == 0.7
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["tools"] == CONVERSATIONS[1]["tools"]
    assert body["authorization"] == "Bearer sk-test"
    assert sorted(b["seed"] for b in asked.values()) == [3 * 1_000_003 + i for i in range(3)]
    # the same command again: nothing left to ask; a torn last line (a kill mid-write) is asked again
    assert regenerate_with_server(ServerClient(fake.url), out, conversations, show_progress=False,
                                  exclude={"A benchmark question"}) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    assert regenerate_with_server(ServerClient(fake.url), out, conversations, limit=3, show_progress=False) == 1
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b", "c"]


def test_several_answers_per_prompt_are_several_requests_with_their_own_seeds(fake_server, conversations, tmp_path):
    fake = fake_server()
    out = tmp_path / "answers.jsonl"
    assert regenerate_with_server(ServerClient(fake.url), out, conversations, seed=1, answers_per_prompt=2, limit=1,
                                  show_progress=False) == 2
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "a#1"]
    assert sorted(b["seed"] for b in fake.bodies if "seed" in b) == [1_000_003, 1_000_004]
    with pytest.raises(ValueError, match="--answers 2 needs --temperature > 0"):
        regenerate_with_server(ServerClient(fake.url), out, conversations, temperature=0.0, answers_per_prompt=2)


def test_server_errors_name_the_record_and_the_servers_answer(fake_server, conversations, tmp_path):
    fake = fake_server(fail_first=1, fail_status=404)  # not worth a retry
    out = tmp_path / "answers.jsonl"
    with pytest.raises(RuntimeError, match=r"record 'a'.*HTTP 404.*model 'x' does not exist"):
        regenerate_with_server(ServerClient(fake.url), out, conversations, concurrency=1, show_progress=False)
    # the failure ended the run: of 4 prompts, at most the one the single worker took meanwhile was also sent
    assert len(fake.bodies) <= 2 and out.read_text() == ""
    several = fake_server(models=("a", "b"))
    with pytest.raises(ValueError, match=r"serves \['a', 'b'\]: name the one to ask with --model"):
        regenerate_with_server(ServerClient(several.url), out, conversations, show_progress=False)
    with pytest.raises(RuntimeError, match="(?s)could not be reached after 2 tries.*name it with --model"):
        ServerClient("http://127.0.0.1:9", retries=1).model_name()
    images = tmp_path / "images.jsonl"
    images.write_text(json.dumps({"id": "i", "image": "cat.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?"}]}) + "\n")
    with pytest.raises(ValueError, match="holds images"):
        regenerate_with_server(ServerClient(fake.url), out, images, model="m", show_progress=False)


def test_regenerate_cli_asks_our_own_server_which_answers_as_the_target(server, tmp_path, capsys):  # noqa: F811
    """End to end through `specheads data regenerate --server`: greedy answers from `specheads serve` are the ones a
    chat request gets (the target's own), with no target loaded by the command."""
    url, *_ = server
    prompts = tmp_path / "no_tools.jsonl"  # (this server has no tool-call parser for the stories model)
    prompts.write_text("".join(json.dumps(CONVERSATIONS[i]) + "\n" for i in (0, 2)))
    out = tmp_path / "answers.jsonl"
    assert main(["data", "regenerate", "--server", url, "--input", str(prompts), "--output", str(out),
                 "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["written"] == 2
    record = json.loads(out.read_text().splitlines()[0])
    status, direct = post(f"{url}/v1/chat/completions", {"messages": record["messages"][:-1], "max_tokens": 12,
                                                         "temperature": 0})
    assert status == 200 and record["messages"][-1]["content"] == direct["choices"][0]["message"]["content"]
    assert main(["data", "regenerate", "--server", url, "--stories", "4", "--output", str(out)]) == 2
    assert "give --input FILE" in capsys.readouterr().err
