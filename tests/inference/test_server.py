"""`specheads serve`: the OpenAI API over HTTP gives the target's own answers (greedy: `target.generate`'s), streamed
or whole, cut before stop strings, with the target's cache kept between a conversation's turns; bad requests get an
OpenAI error naming the field."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.openai_api import ApiError, parse_request
from specheads.inference.prompt_cache import PromptCachePool
from specheads.inference.server import CompletionService, make_server
from specheads.inference.text_deltas import TextDeltas

from .conftest import make_heads

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MODEL = "stories"


@pytest.fixture(scope="module")
def server(stories260k):
    """A live server on a free port: (base URL, the CompletionService, target, tokenizer)."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle3"), tokenizer=tokenizer)
    service = CompletionService(lm, MODEL, {"max_new_tokens": 20}, cache_slots=2, chat_template=TEMPLATE)
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", service, target, tokenizer
    httpd.shutdown()
    httpd.server_close()


def post(url: str, body: dict | list | bytes) -> tuple[int, dict | list]:
    """(status, JSON body) of a POST; a streamed answer comes back as the list of its events."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read().decode()
            status, kind = response.status, response.headers.get("Content-Type")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    if kind == "text/event-stream":
        events = [line[len("data: "):] for line in raw.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(raw)


def greedy_text(target, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> str:
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=TEMPLATE,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def test_chat_turns_are_the_targets_answers_and_reuse_its_cache(server):
    url, _, target, tokenizer = server
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "Tom had a big red ball"}]
    status, body = post(url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 24})
    assert status == 200 and body["object"] == "chat.completion"
    answer = body["choices"][0]["message"]["content"]
    assert answer == greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 24)
    assert body["usage"]["prompt_tokens"] == chat_ids(tokenizer, messages).shape[1]
    assert body["usage"]["completion_tokens"] == 24 and body["choices"][0]["finish_reason"] == "length"
    assert body["specheads"]["mean_accepted"] >= 1

    # the next turn re-sends the conversation: the first turn's cache is reused, the answer is still the target's
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Where did it go"}]
    status, body = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0})
    assert status == 200
    assert body["choices"][0]["message"]["content"] == greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 16)
    assert body["specheads"]["reused_prompt_tokens"] > 20
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["specheads"]["reused_prompt_tokens"]


def test_streamed_answer_is_the_whole_answer_in_pieces(server):
    url, _, target, tokenizer = server
    request = {"messages": [{"role": "user", "content": "Lily saw a cat"}], "max_tokens": 20}
    _, whole = post(url + "/v1/chat/completions", request)
    status, events = post(url + "/v1/chat/completions", {**request, "stream": True,
                                                           "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == whole["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 20

    status, events = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "stream": True})
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert status == 200 and "".join(e["choices"][0]["text"] for e in events) == greedy_text(target, tokenizer, ids, 12)


def test_completion_stops_before_a_stop_string_streamed_or_not(server):
    url, _, target, tokenizer = server
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    full = greedy_text(target, tokenizer, ids, 30)
    stop = full.split()[4]  # a word well inside the answer
    expected = full[: full.index(stop)]
    request = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "stop": [stop, "zzzz"]}
    status, body = post(url + "/v1/completions", request)
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 30
    _, events = post(url + "/v1/completions", {**request, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    for prompt in (["Once upon a time"], ids[0].tolist(), [ids[0].tolist()]):  # a batch of one; token ids
        status, body = post(url + "/v1/completions", {**request, "prompt": prompt})
        assert status == 200 and body["choices"][0]["text"] == expected, prompt


def test_response_format_json_schema_gives_the_constrained_targets_json(server):
    pytest.importorskip("outlines_core")
    from specheads.inference.constraints import CHAT_JSON_WHITESPACE, json_schema_constraint

    url, _, target, tokenizer = server
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "happy": {"type": "boolean"}},
              "required": ["name", "happy"]}
    status, body = post(url + "/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "mood", "schema": schema}}})
    assert status == 200
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    constraint = json_schema_constraint(tokenizer, schema, CHAT_JSON_WHITESPACE)
    expected = target.generate(ids, max_new_tokens=200, do_sample=False, logits_processor=[constraint])
    text = body["choices"][0]["text"]
    assert text == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "happy"} and body["choices"][0]["finish_reason"] == "stop"
    status, body = post(url + "/v1/completions", {"prompt": "Hi", "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}})
    assert status == 400 and "cannot compile the JSON schema" in body["error"]["message"]


def test_penalties_and_logit_biases_give_the_targets_answer_under_the_same_processors(server):
    """OpenAI's presence / frequency penalties (over the answer's tokens, not the prompt's) and logit biases: the
    answer is `target.generate`'s with the same processors, and differs from the unpenalised one."""
    from specheads.inference.openai_penalties import LogitBias, OccurrencePenalties

    url, _, target, tokenizer = server
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    plain = greedy_text(target, tokenizer, ids, 40)
    bias = {tokenizer.convert_tokens_to_ids("."): -100.0, tokenizer.convert_tokens_to_ids("▁dog"): 4.0}
    request = {"prompt": "Once upon a time", "max_tokens": 40, "presence_penalty": 0.6, "frequency_penalty": 1.2,
               "logit_bias": {str(k): v for k, v in bias.items()}}
    status, body = post(url + "/v1/completions", request)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, logits_processor=[
        OccurrencePenalties(ids.shape[1], presence=0.6, frequency=1.2), LogitBias(bias)])
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert status == 200 and body["choices"][0]["text"] == expected
    assert expected != plain and "." in plain and "." not in expected
    _, body = post(url + "/v1/completions", {**request, "logit_bias": None})  # the penalties alone change it too
    assert body["choices"][0]["text"] != plain


def test_occurrence_penalties_count_the_answers_tokens_only():
    from specheads.inference.openai_penalties import OccurrencePenalties

    penalties = OccurrencePenalties(prompt_length=2, presence=0.5, frequency=1.0)
    ids = torch.tensor([[3, 3, 1, 1, 2], [3, 0, 0, 0, 0]])  # the prompt (first 2 tokens) never counts
    got = penalties(ids, torch.zeros(2, 4))
    assert got.tolist() == [[0.0, -2.5, -1.5, 0.0], [-3.5, 0.0, 0.0, 0.0]]


def test_logprobs_are_the_targets_own(server):
    """Each generated token's log-probability and its rivals come from the target's raw logits at that step."""
    url, _, target, tokenizer = server
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    reference = target.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                                output_logits=True)
    expected = torch.log_softmax(torch.cat(reference.logits).float(), dim=-1)  # (10, V)
    tokens = reference.sequences[0, ids.shape[1]:].tolist()
    status, body = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 10, "logprobs": 2})
    assert status == 200
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in tokens]
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"]), expected[range(10), tokens], atol=1e-4, rtol=0)
    for step, rivals in enumerate(logprobs["top_logprobs"]):  # greedy: the chosen token is the likeliest
        assert len(rivals) == 2 and max(rivals.values()) == pytest.approx(logprobs["token_logprobs"][step], abs=1e-5)
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]

    messages = [{"role": "user", "content": "Lily saw a cat"}]
    status, body = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "logprobs": True,
                                                       "top_logprobs": 3})
    content = body["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == body["usage"]["completion_tokens"] == 6
    assert all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)
    assert post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 4})[1]["choices"][0]["logprobs"] is None
    # a stop string: the log-probabilities list the answer's tokens, not the stop string's
    answer = tokenizer.decode(tokens[:3])
    stop = tokenizer.decode(tokens[:5])[len(answer):]  # what tokens 3 and 4 add, in context
    status, body = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 10, "logprobs": 0,
                                                  "stop": stop})
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and choice["text"] == answer
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens[:3]]
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), expected[range(3), tokens[:3]],
                               atol=1e-4, rtol=0)


def test_streamed_logprobs_come_with_their_pieces_and_join_to_the_whole_answers(server):
    """Streamed, each chunk carries the log-probabilities of the tokens its text is made of (the last chunk those no
    piece carried); in order they are the non-streamed answer's, a stop string's tokens left out alike."""
    url, _, _, tokenizer = server
    request = {"messages": [{"role": "user", "content": "Lily saw a cat"}], "max_tokens": 20, "logprobs": True,
               "top_logprobs": 2}
    _, whole = post(url + "/v1/chat/completions", request)
    _, events = post(url + "/v1/chat/completions", {**request, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    streamed = [entry for part in parts for entry in part["content"]]
    expected = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in expected] and len(expected) == 20
    for got, want in zip(streamed, expected):
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4) and len(got["top_logprobs"]) == 2
    assert len(parts) > 1  # not all at the end
    for event in events:  # a chunk's tokens are in the text sent so far, never ahead of it
        choice = event["choices"][0]
        assert choice["logprobs"] is None or choice["delta"].get("content") or choice["finish_reason"]

    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    tokens = tokenizer.decode(server[2].generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:])
    stop = tokens.split()[3]  # a word inside the answer: the tokens after the answer's end are left out
    request = {"prompt": "Once upon a time", "max_tokens": 12, "logprobs": 1, "stop": stop}
    _, whole = post(url + "/v1/completions", request)
    _, events = post(url + "/v1/completions", {**request, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    expected = whole["choices"][0]["logprobs"]
    assert whole["choices"][0]["finish_reason"] == "stop" and 0 < len(expected["tokens"]) < 12
    for key in ("tokens", "text_offset"):  # offsets count from the answer's start in every chunk
        assert [value for part in parts for value in part[key]] == expected[key], key
    assert [v for part in parts for v in part["token_logprobs"]] == pytest.approx(expected["token_logprobs"], abs=1e-4)
    # (a prompt a slot already holds runs fewer positions through the target, so floats may differ in the last bits)
    top = [entry for part in parts for entry in part["top_logprobs"]]
    assert [list(entry) for entry in top] == [list(entry) for entry in expected["top_logprobs"]]
    assert [v for e in top for v in e.values()] == pytest.approx(
        [v for e in expected["top_logprobs"] for v in e.values()], abs=1e-4)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]


def test_answer_tokens_cover_the_text_and_leave_out_stops_and_a_final_eos():
    from specheads.inference.openai_api import answer_tokens

    class Letters:  # ids 0-25 decode as letters, 99 (EOS) as nothing
        def decode(self, ids, skip_special_tokens=True):
            return "".join("" if i == 99 else "abcdefghijklmnopqrstuvwxyz"[i] for i in ids)

    assert answer_tokens(Letters(), [0, 1, 2], "abc") == 3
    assert answer_tokens(Letters(), [0, 1, 2, 99], "abc") == 3  # the final EOS is no part of the answer
    assert answer_tokens(Letters(), [0, 1, 2, 3, 4], "ab") == 2  # "cde" was the stop string
    assert answer_tokens(Letters(), [0, 1, 2, 3], "abc") == 3
    assert answer_tokens(Letters(), [], "") == 0


def test_concurrent_requests_each_get_their_own_answer(server):
    """Clients in parallel: their requests are generated in one batch, and each answer is its own prompt's."""
    from concurrent.futures import ThreadPoolExecutor

    url, _, target, tokenizer = server
    prompts = ["Once upon a time", "Tom had a big red ball", "Lily saw a cat", "The sun was"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: post(url + "/v1/completions", {"prompt": p, "max_tokens": 12}), prompts))
    for prompt, (status, body) in zip(prompts, answers):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert status == 200 and body["choices"][0]["text"] == greedy_text(target, tokenizer, ids, 12)
        assert body["usage"]["completion_tokens"] == 12 and body["specheads"]["target_forwards"] >= 1


def test_a_client_leaving_a_stream_stops_it_and_the_next_answer_is_exact(server):
    import http.client

    url, _, target, tokenizer = server
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"messages": [{"role": "user", "content": "Tom had a big red ball"}], "max_tokens": 400, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()  # gone mid-answer
    messages = [{"role": "user", "content": "Tom had a big red ball"}]
    status, answer = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 16})
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 16)


def test_n_choices_sampled_in_one_batch_and_greedy_ones_alike(server):
    """n sampled choices are rows of one batch, each with its own generator (seed + index): they differ, and the
    same request gives the same choices; greedy choices are all the target's answer; usage counts every choice."""
    url, _, target, tokenizer = server
    sampled = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 5}
    status, first = post(url + "/v1/completions", sampled)
    assert status == 200 and [c["index"] for c in first["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) > 1 and [c["text"] for c in post(url + "/v1/completions", sampled)[1]["choices"]] == texts
    alone = post(url + "/v1/completions", {**sampled, "n": 1, "seed": 6})[1]["choices"][0]["text"]
    assert alone == texts[1]  # choice 1 is the request seeded 5 + 1, alone or among the others
    assert first["usage"]["completion_tokens"] == 48
    messages = [{"role": "user", "content": "Lily saw a cat"}]
    status, greedy = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "n": 2})
    expected = greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 12)
    assert [c["message"]["content"] for c in greedy["choices"]] == [expected, expected]


def test_n_streamed_choices_each_join_to_their_answer(server):
    url, *_ = server
    request = {"messages": [{"role": "user", "content": "Tom had a big red ball"}], "max_tokens": 14,
               "temperature": 0.9, "n": 2, "seed": 3}
    _, events = post(url + "/v1/chat/completions", {**request, "stream": True})
    _, whole = post(url + "/v1/chat/completions", request)
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == index]
        assert deltas[0] == {"role": "assistant"}
        assert "".join(d.get("content", "") for d in deltas) == whole["choices"][index]["message"]["content"]
    assert {e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]} <= {"length", "stop"}


def test_sampling_with_a_seed_repeats(server):
    url, *_ = server
    request = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    first, second = post(url + "/v1/completions", request)[1], post(url + "/v1/completions", request)[1]
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages=[]"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "'robot'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n=17"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 4}, 400, "best_of=4"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "'stories'"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens=0"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature=-1"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400, "logprobs=9"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
         "needs logprobs=true"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty=2.5"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"512": 1}}, 400, "token '512' is not a token id in [0, 512)"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": -101}}, 400, "logit_bias['7']=-101"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo=True"),
        ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos='yes'"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens=-1"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [3, 600]}, 400, "stop_token_ids=[3, 600]"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt=''"),
        ("/v1/completions", {"prompt": "hi " * 600, "max_tokens": 8}, 400, "512"),  # stories260K's context
        ("/v1/embeddings", {"input": "hi"}, 404, "no route"),
        ("/v1/completions", [{"prompt": "hi"}], 400, "must be a JSON object, got list"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", ""]}, 400, "stop=['a', '']"),
        ("/v1/completions", {"prompt": ["hi", "there"]}, 400, "one prompt per request"),
        ("/v1/completions", {"prompt": [3, 99999]}, 400, "[99999] outside the vocabulary [0, 512)"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream='yes'"),
        ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": 3}, 400, "stream_options=3"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content=5"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "image_url parts, but this model takes no images"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
         "only 'text' parts"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, 400,
         "logprobs='yes'"),
    ],
)
def test_bad_requests_get_an_openai_error_naming_the_field(server, path, body, status, needle):
    url, *_ = server
    got, answer = post(url + path, body)
    assert got == status and needle in answer["error"]["message"], answer


def test_a_failing_generation_is_a_server_error_and_the_server_keeps_serving(server, monkeypatch):
    from specheads.inference.batched import BatchEngine

    url, service, *_ = server

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(BatchEngine, "step", broken)
    status, body = post(url + "/v1/completions", {"prompt": "Once upon a time"})
    assert status == 500 and "RuntimeError: out of memory" in body["error"]["message"]
    _, events = post(url + "/v1/completions", {"prompt": "Once upon a time", "stream": True})
    assert "out of memory" in events[-1]["error"]["message"]
    monkeypatch.undo()
    assert post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4})[0] == 200


def test_an_api_key_is_required_when_set(server, monkeypatch):
    url, service, *_ = server
    monkeypatch.setattr(service, "api_key", "sekret")
    status, body = post(url + "/v1/completions", {"prompt": "Once", "max_tokens": 2})
    assert status == 401 and "API key" in body["error"]["message"]
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "Once", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer sekret"})
    with urllib.request.urlopen(request) as response:
        assert response.status == 200
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(url + "/v1/models")
    with urllib.request.urlopen(url + "/health") as response:  # health checks stay open
        assert response.status == 200


def test_models_and_health(server):
    url, *_ = server
    with urllib.request.urlopen(url + "/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == MODEL
    with urllib.request.urlopen(url + "/health") as response:
        assert json.loads(response.read()) == {"status": "ok"}


def test_without_max_tokens_an_answer_may_run_to_the_end_of_the_context(stories260k):
    """No max_tokens in the request or the server's options: the answer runs until EOS or the context (512)."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    service = CompletionService(lm, MODEL, {}, cache_slots=0)
    try:
        request = service.parse({"prompt": "Once upon a time"}, chat=False)
        (choice,), usage, _ = service.complete(request, chat=False)
        ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
        room = target.config.max_position_embeddings - ids.shape[1]
        assert usage["completion_tokens"] > 128  # not the old default's cut
        assert choice.text == greedy_text(target, tokenizer, ids, room)
        full = service.parse({"prompt": "hi " * 600}, chat=False)
        with pytest.raises(ApiError, match="no room to answer"):
            service.complete(full, chat=False)
    finally:
        service.close()


def test_metrics_count_requests_tokens_and_forwards(server):
    """/metrics (Prometheus text) moves by what a request did: one more finished request, its tokens, its forwards."""
    url, service, *_ = server

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(url + "/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            lines = response.read().decode().splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines if not line.startswith("#")}

    before = scrape()
    status, body = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12})
    after = scrape()
    assert status == 200
    delta = {name: after[name] - before.get(name, 0) for name in after if "_total" in name}
    assert delta["specheads_requests_finished_total"] == 1 and delta["specheads_requests_failed_total"] == 0
    assert delta["specheads_generated_tokens_total"] == body["usage"]["completion_tokens"] == 12
    assert delta["specheads_prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert delta["specheads_row_forwards_total"] == body["specheads"]["target_forwards"]
    assert delta["specheads_batched_forwards_total"] >= 1
    accepted = delta["specheads_accepted_draft_tokens_total"]
    # every forward gives one token of its own, the rest are accepted drafts (the last round's may pass max_tokens)
    assert accepted >= 12 - delta["specheads_row_forwards_total"] >= 0
    # acceptance by depth: each round that kept k drafts counts at depths 1..k, so depths sum to the accepted drafts,
    # shrink with depth, and no depth counts more rounds than there were
    # (these fresh heads are rarely right: test_acceptance_by_depth_counts_each_rounds_kept_drafts has a known mix)
    by_depth = [delta.get(f'specheads_accepted_by_depth_total{{depth="{d}"}}', 0) for d in range(1, 12)]
    assert sum(by_depth) == accepted and by_depth == sorted(by_depth, reverse=True)
    assert by_depth[0] <= delta["specheads_draft_rounds_total"] <= delta["specheads_row_forwards_total"]
    assert delta["specheads_draft_rounds_total"] >= 1
    assert after["specheads_running_requests"] == 0 and after["specheads_max_batch"] == service.loop.max_batch
    assert "accepted_counts" not in service.loop.engine.stats  # no per-round list grows in a long-running server


def test_acceptance_by_depth_counts_each_rounds_kept_drafts(server):
    """A round that kept k drafted tokens counts once at each depth 1..k (vLLM's accepted tokens per position)."""
    from specheads.inference.batch_request import BatchRequest
    from specheads.inference.server import prometheus_text
    from specheads.inference.serving_loop import ServingLoop

    _, service, *_ = server
    loop = ServingLoop(service.lm, 2)
    try:
        loop._count(BatchRequest(torch.tensor([1, 2]), 8, accepted_counts=[0, 2, 3, 1], new_tokens=[5] * 10))
        metrics = loop.metrics()
        assert metrics["accepted_by_depth"] == {"1": 3, "2": 2, "3": 1} and metrics["draft_rounds"] == 4
        assert metrics["accepted_draft_tokens"] == 6
        text = prometheus_text(metrics)
        assert 'specheads_accepted_by_depth_total{depth="2"} 2' in text and "specheads_draft_rounds_total 4" in text
    finally:
        loop.close()


def test_pool_keeps_interleaved_conversations_apart():
    """Two conversations sharing a system prompt each keep their own slot; a third evicts the least recent."""
    pool = PromptCachePool(2)
    a, b = pool.take(torch.tensor([1, 2, 3, 10])), pool.take(torch.tensor([1, 2, 3, 20]))
    assert a is not b
    a.tokens, b.tokens = torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]), torch.tensor([1, 2, 3, 20] * 4)
    assert pool.take(torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 5, 6])) is a  # a's next turn
    assert pool.take(torch.tensor([1, 2, 3, 20] * 4 + [9])) is b
    assert pool.take(torch.tensor([1, 2, 3, 10, 11, 12])) is a  # a's answer regenerated: the prompt lies within a
    c = pool.take(torch.tensor([1, 2, 3, 30, 31]))  # shares only the system prompt: b, the least recent, is evicted
    assert c is b and PromptCachePool(0).take(torch.tensor([1, 2])) is None
    with pytest.raises(ValueError, match="slots=-1"):
        PromptCachePool(-1)


def test_pool_gives_an_edited_last_message_its_conversations_slot():
    """A prompt that keeps a slot's conversation up to where its last call began, then differs (the last message
    edited, as chat UIs allow), takes that slot; an edit before it does not (here: the empty slot)."""
    pool = PromptCachePool(2)
    a, b = pool.take(torch.tensor([1, 2, 3, 10])), pool.take(torch.tensor([1, 2, 3, 20]))
    a.tokens = torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22, 23])
    a.last_call_start = 9  # a's last call reused its first 9 tokens: its last turn began there
    assert pool.take(torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 15, 40, 41])) is a
    assert pool.take(torch.tensor([1, 2, 3, 10, 11, 12, 13, 50, 51])) is b


class LetterTokenizer:
    """Decodes ids as letters, a few at once (what a streamer sees)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefghijklmnopqrstuvwxyz"[i] if i < 26 else "\ufffd" for i in ids)


def feed(stop: list[str], rounds: list[list[int]]) -> tuple[list[str], TextDeltas]:
    pieces: list[str] = []
    deltas = TextDeltas(LetterTokenizer(), stop, pieces.append)
    deltas.put(torch.tensor([[0, 0]]))  # the prompt: skipped
    for ids in rounds:
        deltas.put(torch.tensor(ids))
    deltas.end()
    return pieces, deltas


def test_text_deltas_hold_back_what_may_become_a_stop_string():
    pieces, deltas = feed(["cde"], [[0, 1], [2], [3], [4, 5]])  # "ab" "c" "d" "ef": "cde" found
    assert pieces == ["ab"] and deltas.text == "ab" and deltas.stopped
    pieces, deltas = feed(["cdx", "zz"], [[0, 1, 2], [3], [4]])  # "abc" "d" "e": "cd" looked like "cdx", was not
    assert pieces == ["ab", "cde"] and not deltas.stopped
    pieces, deltas = feed([], [[0], [30], [1]])  # an incomplete character is held until the end
    assert pieces == ["a", "\ufffdb"]
    pieces, deltas = feed(["b", "ab"], [[2, 0, 1]])  # the first stop string in the text wins
    assert deltas.text == "c"


def test_text_deltas_count_the_tokens_each_piece_is_made_of():
    seen: list[tuple[str, int]] = []
    deltas = TextDeltas(LetterTokenizer(), ["cdx"], lambda piece: seen.append((piece, deltas.covered)))
    deltas.put(torch.tensor([[0]]))  # the prompt
    for ids in ([0, 1, 2], [3], [4], [5, 30]):  # "abc" "d" "e" "f\ufffd"
        deltas.put(torch.tensor(ids))
    deltas.end()
    # "c" and then "cd" are held back (they may become "cdx"): their tokens are not counted until sent
    assert seen == [("ab", 2), ("cde", 5), ("f", 6), ("\ufffd", 7)]


def test_parse_request_maps_fields_onto_generate(stories260k):
    _, tokenizer = stories260k
    parsed = parse_request({"prompt": "Hi", "max_tokens": 5, "temperature": 0.7, "top_k": -1, "stop": "x",
                            "user": "ignored"}, False, tokenizer, {"max_new_tokens": 9, "stop_strings": ["END"]})
    assert parsed.options["max_new_tokens"] == 5 and parsed.options["do_sample"] is True
    assert parsed.options["temperature"] == 0.7 and parsed.options["top_k"] == 0
    assert parsed.stop == ["END", "x"] and not parsed.stream
    greedy = parse_request({"prompt": [1, 2, 3], "temperature": 0}, False, tokenizer, {"max_new_tokens": 9})
    assert greedy.options == {"max_new_tokens": 9, "do_sample": False, "temperature": None, "stop_strings": None}
    assert greedy.input_ids.tolist() == [[1, 2, 3]]
    developer = parse_request({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}, True, tokenizer, {}, TEMPLATE)
    assert tokenizer.decode(developer.input_ids[0], skip_special_tokens=True).startswith("system: Be brief.\nuser: Hi there")
    with pytest.raises(ApiError, match="no chat template"):
        parse_request({"messages": [{"role": "user", "content": "hi"}]}, True, tokenizer, {})
    with pytest.raises(ApiError, match="response_format"):
        parse_request({"prompt": "Hi", "response_format": {"type": "json"}}, False, tokenizer, {})
    assert parse_request({"prompt": "Hi", "response_format": {"type": "json_object"}}, False, tokenizer, {}).json_object
