"""A request for continuous batching (`BatchEngine`): what to generate and, filled in as it runs, what was generated;
built and checked from `generate`'s options (`build_batch_request`, behind `SpeculativeLM.batch_request`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from specheads.inference.generate_inputs import decoding_settings, eos_ids, new_token_budget, split_prompts
from specheads.inference.multimodal import check_prompt_inputs_call, prompt_inputs
from specheads.inference.prompt_cache import PromptCache, check_prompt_cache_call
from specheads.inference.sampling import SamplingParams
from specheads.inference.step_scores import StepRecorder
from specheads.inference.stopping import StopChecker


@dataclass(eq=False)
class BatchRequest:
    """One sequence for a `BatchEngine`: what to generate, and (filled in by the engine) what was generated.

    `SpeculativeLM.batch_request(input_ids, **generate_options)` builds one from `generate`'s options.

    Args:
        prompt: (n,) token ids on the target's device.
        max_new_tokens: new tokens at most.
        params: decoding options (greedy, sampling, processors); rows of one batch may differ.
        eos: EOS ids; the row ends right after one.
        acceptance: "exact" or "typical" (sampling only).
        stop: the caller's stopping criteria on this row (inference/stopping.py).
        streamer: gets `put(prompt)` when the row joins, `put(tokens)` after each emission and `end()` when it ends.
        recorder: collects each emitted token's logits and scores (inference/step_scores.py).
        prompt_cache: runs only the prompt's tokens after those it holds; holds this row's sequence at the end.
        row: the caller's batch index, given to a `prefix_allowed_tokens_fn` as its batch_id.
        learn: an online corpus lookup learns the answer once it finishes (a server's warm-up request: False).
        inputs: the prompt's extra model inputs (a vision-language target's images: inference/multimodal.py), given
            to its prefill only, which then runs alone and in one piece.
        prediction: token ids the answer is expected to resemble (OpenAI's Predicted Outputs): drafted from like the
            context by prompt lookup (inference/lookup.py: `with_prediction`); the answer stays the target's own.
    """

    prompt: torch.Tensor
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos: set[int] = field(default_factory=set)
    acceptance: str = "exact"
    stop: StopChecker | None = None
    streamer: Any | None = None
    recorder: StepRecorder | None = None
    prompt_cache: PromptCache | None = None
    row: int = 0
    learn: bool = True
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    position_offset: int = 0  # set by its prefill: the text positions' offset from cache indices (M-RoPE images)
    prediction: list[int] = field(default_factory=list)
    # filled in by the engine
    new_tokens: list[int] = field(default_factory=list)
    target_forwards: int = 0  # forwards this row took part in (its prefill counts one)
    accepted_counts: list[int] = field(default_factory=list)  # drafted tokens accepted per round
    reused_prompt_tokens: int = 0
    finished: bool = False
    cancelled: bool = False  # set by the caller (a client gone): the row leaves before the next round
    error: Exception | None = None  # what ended the row, when an engine that isolates errors caught one

    @property
    def mean_accepted(self) -> float:
        """tau of this row: new tokens per target forward it took part in."""
        return len(self.new_tokens) / max(self.target_forwards, 1)


def build_batch_request(
    lm: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    *,
    max_length: int | None = None,
    eos_token_id: int | list[int] | None = None,
    streamer: Any | None = None,
    prompt_cache: PromptCache | None = None,
    record_logits: bool = False,
    seed: int | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
    prediction: list[int] | None = None,
    **options: Any,
) -> BatchRequest:
    """One prompt as a request for a `BatchEngine`, checked as `lm.generate` checks it (`SpeculativeLM.batch_request`).

    Args:
        input_ids: the (n,) or (1, n) prompt, without padding.
        max_new_tokens, max_length, eos_token_id, streamer, prompt_cache: as `generate` takes them.
        record_logits: keep the target's logits of every emitted token (`request.recorder.logits`).
        seed: sampling draws from a generator of its own seeded with this (reproducible whatever else runs in the
            batch); None: torch's global generator.
        inputs: the prompt's extra model inputs (`pixel_values`, ... as the target's processor returns them).
        prediction: token ids the answer is expected to resemble (`BatchRequest.prediction`).
        **options: `generate`'s decoding options (do_sample, temperature, top_p, top_k, logits_processor,
            stop_strings, generation_config, acceptance, ...).
    """
    config = options.pop("generation_config", None) or lm.target.generation_config
    params, criteria = decoding_settings(config, lm.tokenizer, **options)
    if seed is not None:
        params = dataclasses.replace(params, generator=torch.Generator(lm.target.device).manual_seed(seed))
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"batch_request takes one prompt, got input_ids of shape {tuple(input_ids.shape)}")
    budget = new_token_budget(input_ids, max_new_tokens, max_length)
    (prompt,) = split_prompts(input_ids, None, budget, lm.target, lm.heads.config.vocab_size)
    if prompt_cache is not None:
        check_prompt_cache_call(prompt_cache, 1, None)
    checked = prompt_inputs(lm.target, inputs or {})
    check_prompt_inputs_call(checked, input_ids, None, None)
    check_prediction(prediction, lm.heads.config.vocab_size)
    return BatchRequest(
        prompt, budget, params, set(eos_ids(eos_token_id, config)), options.get("acceptance", "exact"),
        None if criteria is None else StopChecker(criteria, prompt), streamer,
        StepRecorder(params) if record_logits else None, prompt_cache, inputs=checked,
        prediction=list(prediction or []),
    )


def check_prediction(prediction: list[int] | None, vocab_size: int) -> None:
    """Refuse a `prediction` (`BatchRequest.prediction`) that is not a list of token ids, naming it."""
    if prediction is not None and not all(isinstance(t, int) and 0 <= t < vocab_size for t in prediction):
        raise ValueError(f"prediction: expected token ids in [0, {vocab_size}), got {list(prediction)[:8]!r}...")


def check_batching_options(max_round_nodes: Any, prefill_chunk: Any) -> None:
    """Refuse, by name, a `max_round_nodes` other than None, "auto" or an integer >= 1, and a `prefill_chunk` other
    than None or an integer >= 1."""
    if max_round_nodes is not None and max_round_nodes != "auto" and (
            not isinstance(max_round_nodes, int) or max_round_nodes < 1):
        raise ValueError(f"max_round_nodes={max_round_nodes!r}: expected None, 'auto' or an integer >= 1")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk={prefill_chunk!r}: expected None or an integer >= 1")
