"""The constraints a request's fields ask for over HTTP: OpenAI's `response_format` json_object (no outlines-core
needed) and vLLM's `guided_*` / `structured_outputs`; each answer is `target.generate`'s under the same constraint, and
conflicting or unreadable fields are refused naming the field."""

from __future__ import annotations

import pytest

from .test_server import post, server  # noqa: F401 (server is a fixture)


def test_vllms_guided_fields_constrain_the_answer_as_the_same_regex_does(server):  # noqa: F811
    """vLLM's `guided_choice` / `guided_regex` / `guided_json` and `structured_outputs` (its newer name): the answer is
    `target.generate`'s under the same constraint; two of them, a grammar, a bad value are refused naming the field."""
    pytest.importorskip("outlines_core")
    from specheads.inference.constraints import regex_constraint
    from specheads.inference.json_object import json_object_constraint

    url, _, target, tokenizer = server
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids

    def answer_under(processor) -> str:
        out = target.generate(ids, max_new_tokens=16, do_sample=False, logits_processor=[processor])
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    choices = ["happy", "sad (very)", "a.b"]
    previous = ""
    for body, expected in (
            ({"guided_choice": choices}, answer_under(regex_constraint(tokenizer, r"(happy|sad \(very\)|a\.b)"))),
            ({"structured_outputs": {"choice": choices}}, None),  # the same answer
            ({"guided_regex": "[a-z]{2,5} [a-z]{2,5}"}, answer_under(regex_constraint(tokenizer, "[a-z]{2,5} [a-z]{2,5}"))),
            ({"structured_outputs": {"regex": "[a-z]{2,5} [a-z]{2,5}"}}, None),
            ({"guided_json": '{"type": "object"}'}, answer_under(json_object_constraint(tokenizer))),
            ({"structured_outputs": {"json_object": True}}, None)):
        status, body_out = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16, **body})
        assert status == 200, body_out
        text = body_out["choices"][0]["text"]
        expected = previous if expected is None else expected  # None: the newer name of the case before it
        assert text == expected, body
        previous = expected
        if "choice" in str(body):
            assert text in choices
    for body, param, needle in (
            ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "both constrain"),
            ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "both constrain"),
            ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "grammars are not supported"),
            ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
            ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark", "one of json, regex"),
            ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
            ({"guided_regex": "(unclosed"}, "guided_regex", "cannot compile the regex")):
        status, body_out = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **body})
        assert status == 400 and body_out["error"]["param"] == param and needle in body_out["error"]["message"], body_out


def test_response_format_json_object_gives_the_constrained_targets_json(server):  # noqa: F811
    """`json_object` (and the schema `{"type": "object"}`, the same request) needs no outlines-core: the answer is
    `target.generate`'s under the JSON-object constraint, streamed or not."""
    from specheads.inference.json_object import json_object_constraint

    url, _, target, tokenizer = server
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=50, do_sample=False,
                               logits_processor=[json_object_constraint(tokenizer)])
    expected = tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.lstrip().startswith("{")
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {
            "type": "object"}}}):
        request = {"prompt": "Once upon a time", "max_tokens": 50, "response_format": response_format}
        status, body = post(url + "/v1/completions", request)
        assert status == 200 and body["choices"][0]["text"] == expected, response_format
        status, events = post(url + "/v1/completions", {**request, "stream": True})
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
