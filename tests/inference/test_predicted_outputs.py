"""OpenAI's Predicted Outputs (`prediction`): the answer stays the target's own whatever the prediction; a prediction
the answer follows is drafted from (fewer target forwards); usage counts the prediction's kept and rejected tokens."""

from __future__ import annotations

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.batched import BatchEngine
from specheads.inference.openai_errors import ApiError
from specheads.inference.predicted_outputs import prediction_tokens, prediction_usage

from .conftest import left_pad, make_heads
from .test_server import MODEL, chat_ids, greedy_text, post, server  # noqa: F401 (a fixture)


def run(lm: SpeculativeLM, ids: torch.Tensor, max_new_tokens: int, prediction: list[int] | None):
    engine = BatchEngine(lm)
    request = lm.batch_request(ids, max_new_tokens=max_new_tokens, prediction=prediction)
    engine.add([request])
    while engine.occupied:
        engine.step()
    return request


@pytest.mark.parametrize("lookup_tokens", [0, 4])
def test_a_prediction_is_drafted_from_and_never_changes_the_answer(stories260k, lookup_tokens):
    target, tokenizer = stories260k
    torch.manual_seed(0)
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer, lookup_tokens=lookup_tokens)
    ids = tokenizer("Lily saw a big dog", return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
    plain = run(lm, ids, 48, None)
    right = run(lm, ids, 48, expected[5:])  # what the answer will be (past its first tokens)
    wrong = run(lm, ids, 48, list(reversed(expected)))
    assert plain.new_tokens == right.new_tokens == wrong.new_tokens == expected
    # the untrained heads rarely guess right; the prediction makes most rounds accept many tokens
    assert right.target_forwards < plain.target_forwards / 2, (right.target_forwards, plain.target_forwards)
    with pytest.raises(ValueError, match=r"prediction: expected token ids in \[0, 512\)"):
        lm.batch_request(ids, max_new_tokens=4, prediction=[1, 9999])
    # `generate` takes it too, one row or batched (left-padded rows), and refuses it on the fast path
    out = lm.generate(ids, max_new_tokens=48, prediction=expected[5:])
    assert out[0, ids.shape[1]:].tolist() == expected and lm.last_stats["target_forwards"] == right.target_forwards
    two, mask = left_pad([ids[0].tolist(), tokenizer("Tom had a red ball").input_ids])
    batched = lm.generate(two, attention_mask=mask, max_new_tokens=24, prediction=expected)
    assert torch.equal(batched, lm.generate(two, attention_mask=mask, max_new_tokens=24))
    with pytest.raises(ValueError, match="pass fast_path=False"):
        lm.generate(ids, max_new_tokens=4, prediction=expected, fast_path=True)


def test_prediction_is_read_from_text_or_parts_and_counted(stories260k):
    _, tokenizer = stories260k
    text = tokenizer("Tom had a ball", add_special_tokens=False).input_ids
    assert prediction_tokens({"prediction": {"type": "content", "content": "Tom had a ball"}}, tokenizer) == text
    parts = {"type": "content", "content": [{"type": "text", "text": "Tom had"}, {"type": "text", "text": " a ball"}]}
    assert prediction_tokens({"prediction": parts}, tokenizer) == text and prediction_tokens({}, tokenizer) == []
    for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": 3}, "x"):
        with pytest.raises(ApiError, match="prediction=") as err:
            prediction_tokens({"prediction": bad}, tokenizer)
        assert err.value.param == "prediction"
    assert prediction_usage([1, 2, 3, 4], [1, 2, 9, 4, 5]) == {"accepted_prediction_tokens": 3,
                                                               "rejected_prediction_tokens": 1}


def test_the_server_drafts_from_a_prediction(server):  # noqa: F811
    url, _, target, tokenizer = server
    messages = [{"role": "user", "content": "Tom had a big red ball"}]
    answer = greedy_text(target, tokenizer, chat_ids(tokenizer, messages), 40)
    request = {"model": MODEL, "messages": messages, "max_tokens": 40}
    _, plain = post(url + "/v1/chat/completions", request)
    _, predicted = post(url + "/v1/chat/completions", {**request, "prediction": {"type": "content", "content": answer}})
    assert plain["choices"][0]["message"]["content"] == predicted["choices"][0]["message"]["content"] == answer
    assert predicted["specheads"]["target_forwards"] < plain["specheads"]["target_forwards"]
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 30 and details["rejected_prediction_tokens"] >= 0
    assert "accepted_prediction_tokens" not in plain["usage"]["completion_tokens_details"]
    status, refused = post(url + "/v1/chat/completions", {**request, "prediction": {"type": "content"}})
    assert status == 400 and refused["error"]["param"] == "prediction"
