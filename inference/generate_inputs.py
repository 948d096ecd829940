"""`SpeculativeLM.generate`'s input checks and output assembly, as transformers' `generate` takes and returns them:
the new-token budget (`max_new_tokens` / `max_length`), `num_return_sequences`, left-padded prompts split into rows,
EOS ids, extra keywords (generation settings or the prompt forward's inputs), and the padded output batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from specheads.inference.multimodal import prompt_inputs
from specheads.inference.sampling import SamplingParams, check_generation_config
from specheads.inference.stopping import stopping_criteria_for
from specheads.inference.target_support import context_limit

ACCEPTANCE_RULES = ("exact", "typical")


def settings_and_inputs(
    config: GenerationConfig, target: PreTrainedModel, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, torch.Tensor]]:
    """`generate`'s extra keywords, as transformers splits them: (the generation config, a copy updated with the
    keywords that are its fields; the rest checked as the prompt forward's inputs, `multimodal.prompt_inputs`)."""
    settings = {name: value for name, value in kwargs.items()
                if hasattr(config, name) and not callable(getattr(config, name))}
    if settings:
        config = copy.deepcopy(config)
        config.update(**settings)
    return config, prompt_inputs(target, {name: value for name, value in kwargs.items() if name not in settings})


def new_token_budget(input_ids: torch.Tensor, max_new_tokens: int | None, max_length: int | None) -> int:
    """max_new_tokens as given, else what max_length leaves after the (padded) prompt, else 128."""
    if max_new_tokens is not None or max_length is None:
        return 128 if max_new_tokens is None else max_new_tokens
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r} must be an integer >= 1")
    width = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0
    if max_length <= width:
        raise ValueError(f"max_length={max_length} leaves no room after the prompt of {width} tokens: use "
                         "max_new_tokens (transformers counts the prompt in max_length)")
    return max_length - width


def expand_for_return_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, count: int, do_sample: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each prompt row repeated `count` times in place (transformers' order), for num_return_sequences."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"num_return_sequences={count!r} must be an integer >= 1")
    if count == 1 or not isinstance(input_ids, torch.Tensor):
        return input_ids, attention_mask
    if not do_sample:
        raise ValueError(f"num_return_sequences={count} needs do_sample=True: greedy decoding has one answer per "
                         "prompt (transformers refuses it too without beam search)")
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if attention_mask is not None:
        attention_mask = (attention_mask[None] if attention_mask.dim() == 1 else attention_mask)
        attention_mask = attention_mask.repeat_interleave(count, dim=0)
    return input_ids.repeat_interleave(count, dim=0), attention_mask


def split_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    target: PreTrainedModel,
    vocab_size: int,
) -> list[torch.Tensor]:
    """The batch's prompts without their padding, (n_i,) each on the target's device, after checking the input
    (types, shapes, left padding, token ids within `vocab_size`, prompt + max_new_tokens within the target's
    context)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    context, limit_name = context_limit(target)
    device = target.device
    prompts = []
    for row, (ids, mask) in enumerate(zip(input_ids, attention_mask)):
        keep = mask.bool()
        n = int(keep.sum())
        if n == 0:
            raise ValueError(f"prompt {row} is empty: generation needs at least one token")
        if not bool(keep[-n:].all()):
            raise ValueError(f"prompt {row} is not left-padded: padding must come before the tokens")
        prompt = ids[-n:].long()
        bad = prompt[(prompt < 0) | (prompt >= vocab_size)]
        if bad.numel():
            raise ValueError(f"prompt {row} has token ids {bad.tolist()[:5]} outside the vocabulary [0, {vocab_size})")
        if context is not None and n + max_new_tokens > context:
            raise ValueError(
                f"prompt {row} length {n} + max_new_tokens {max_new_tokens} = {n + max_new_tokens} exceeds "
                f"{limit_name} of {context} positions"
            )
        prompts.append(prompt.to(device))
    return prompts



def eos_ids(eos_token_id: int | list[int] | None, config: GenerationConfig) -> list[int]:
    """EOS ids in the caller's order (the first one pads, as in transformers)."""
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)]



def assemble(
    input_ids: torch.Tensor, rows: list[list[int]], pad_token_id: int | None, eos: list[int],
    config: GenerationConfig,
) -> torch.Tensor:
    """Prompt (with its padding) + new tokens; rows that stopped early are right-padded."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    width = max(len(r) for r in rows)
    new = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return torch.cat([input_ids.long().cpu(), new], dim=1).to(input_ids.device)


def decoding_settings(
    generation_config: GenerationConfig,
    default_tokenizer: PreTrainedTokenizerBase | None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    *,
    min_p: float | None = None,
    typical_p: float | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    min_new_tokens: int | None = None,
    bad_words_ids: list[list[int]] | None = None,
    suppress_tokens: list[int] | None = None,
    sequence_bias: Any = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    stop_strings: str | list[str] | None = None,
    max_time: float | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    acceptance: str = "exact",
) -> tuple[SamplingParams, StoppingCriteriaList | None]:
    """`generate`'s decoding options, checked and resolved against `generation_config`: (sampling parameters,
    stopping criteria or None). Stop strings are read with `tokenizer`, else `default_tokenizer`."""
    params = SamplingParams.resolve(
        generation_config, do_sample, temperature, top_p, top_k,
        repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens, min_p=min_p, typical_p=typical_p, bad_words_ids=bad_words_ids,
        suppress_tokens=suppress_tokens, sequence_bias=sequence_bias,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, logits_processor=logits_processor,
    )
    params.validate()
    check_generation_config(generation_config, do_sample)
    criteria = stopping_criteria_for(generation_config, stopping_criteria, stop_strings, max_time,
                                     tokenizer if tokenizer is not None else default_tokenizer)
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance={acceptance!r}; expected one of {ACCEPTANCE_RULES}")
    if acceptance == "typical" and not do_sample:
        raise ValueError("acceptance='typical' only applies to sampling (do_sample=True)")
    return params, criteria


def finish_stats(stats: dict[str, Any], seconds: float) -> dict[str, Any]:
    """`generate`'s `last_stats` from the counts a call gathered (its per-round `accepted_counts` become tau and the
    acceptance rate by depth) and its wall seconds."""
    counts = stats.pop("accepted_counts")
    rounds = max(len(counts), 1)
    max_depth = max(counts, default=0)
    return {
        **stats,
        "mean_accepted": stats["new_tokens"] / max(stats["target_forwards"], 1),
        "accepted_per_depth": [sum(c >= d for c in counts) / rounds for d in range(1, max_depth + 1)],
        "seconds": seconds,
        "tokens_per_second": stats["new_tokens"] / seconds if seconds > 0 else 0.0,
        "ms_per_round": 1000 * (seconds - stats["prefill_seconds"]) / rounds,
    }
