"""OpenAI's Predicted Outputs: a request's `prediction`, text the answer is expected to resemble, drafted from.

`{"prediction": {"type": "content", "content": "..."}}` (a string, or a list of text parts) gives what most of the
answer will probably be: a file being edited, a document being revised. Speculative decoding is what makes this
pay: the prediction's tokens are a guess the target verifies like any other, so the answer is the target's own
(greedy: `target.generate`'s) and only its speed changes. The row's drafter looks the context's last tokens up in
the prediction and grafts what follows there onto its tree (`lookup.with_prediction`), growing the guess while the
target copies it. `usage.completion_tokens_details` counts, as OpenAI's, the prediction's tokens the answer kept
(`accepted_prediction_tokens`) and those it did not (`rejected_prediction_tokens`).
"""

from __future__ import annotations

from difflib import SequenceMatcher
from typing import Any

from transformers import PreTrainedTokenizerBase

from .openai_errors import ApiError


def prediction_tokens(body: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids of a request's `prediction` ([] without one); an `ApiError` names a malformed one."""
    prediction = body.get("prediction")
    if prediction is None:
        return []
    content = prediction.get("content") if isinstance(prediction, dict) else None
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or not isinstance(content, str):
        raise ApiError(f"prediction={prediction!r}: expected {{'type': 'content', 'content': TEXT}} (a string or a "
                       "list of text parts)", param="prediction")
    return tokenizer(content, add_special_tokens=False).input_ids


def prediction_usage(prediction: list[int], answer: list[int]) -> dict[str, int]:
    """The prediction's tokens the `answer` kept (in the answer's order: the matching blocks of the two sequences)
    and those it did not."""
    matcher = SequenceMatcher(None, prediction, answer, autojunk=False)
    kept = sum(block.size for block in matcher.get_matching_blocks())
    return {"accepted_prediction_tokens": kept, "rejected_prediction_tokens": len(prediction) - kept}
