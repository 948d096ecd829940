"""The target's sampling distribution, processed exactly as `transformers.generate` processes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding options; `do_sample=False` means greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # the other sampling warpers transformers applies after top-p, in its order; these values turn them off
    min_p: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    # processors that read the sequence so far (inference/sequence_processors.py); these values turn them off
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    min_new_tokens: int = 0
    # run through transformers' own processors, with each tree node's own sequence
    sequence_bias: Any = None  # {(token ids): bias} or [[ids, bias], ...], as transformers takes it
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    # the caller's own processors, as `generate` takes them: functions of each row's sequence (see
    # inference/sequence_processors.py), so they also run once per tree depth with each node's own sequence
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None
    logits_processor: LogitsProcessorList | None = None
    # where sampling's random numbers come from (a seeded request among others in a batch); None: torch's global
    generator: torch.Generator | None = None
    # transformers' LogitNormalization, last: returned scores are log-probabilities (tokens and sampling unchanged)
    renormalize_logits: bool = False

    @classmethod
    def resolve(
        cls,
        generation_config: Any,
        do_sample: bool,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        min_new_tokens: int | None = None,
        min_p: float | None = None,
        typical_p: float | None = None,
        bad_words_ids: list[list[int]] | None = None,
        suppress_tokens: list[int] | None = None,
        sequence_bias: Any = None,
        prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
        logits_processor: LogitsProcessorList | list | None = None,
    ) -> SamplingParams:
        """Fill unset options as `generate` does: the model's generation config, then transformers' defaults.

        `prefix_allowed_tokens_fn` and `logits_processor` are the caller's alone (transformers takes them as
        arguments only)."""

        def pick(value: Any, name: str, default: Any) -> Any:
            if value is not None:
                return value
            configured = getattr(generation_config, name, None)
            return default if configured is None else configured

        return cls(
            do_sample=do_sample,
            temperature=pick(temperature, "temperature", 1.0),
            top_p=pick(top_p, "top_p", 1.0),
            top_k=pick(top_k, "top_k", 50),
            min_p=pick(min_p, "min_p", None),
            typical_p=float(pick(typical_p, "typical_p", 1.0)),
            epsilon_cutoff=float(pick(None, "epsilon_cutoff", 0.0)),
            eta_cutoff=float(pick(None, "eta_cutoff", 0.0)),
            repetition_penalty=float(pick(repetition_penalty, "repetition_penalty", 1.0)),
            no_repeat_ngram_size=int(pick(no_repeat_ngram_size, "no_repeat_ngram_size", 0)),
            min_length=int(pick(None, "min_length", 0)),
            min_new_tokens=int(pick(min_new_tokens, "min_new_tokens", 0)),
            bad_words_ids=as_tuples(pick(bad_words_ids, "bad_words_ids", None)),
            suppress_tokens=as_tuple(pick(suppress_tokens, "suppress_tokens", None)),
            sequence_bias=pick(sequence_bias, "sequence_bias", None),
            begin_suppress_tokens=as_tuple(pick(None, "begin_suppress_tokens", None)),
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            logits_processor=LogitsProcessorList(logits_processor) if logits_processor else None,
            renormalize_logits=bool(pick(None, "renormalize_logits", False)),
        )

    def validate(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 when do_sample=True (use do_sample=False)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p={self.typical_p} must be in (0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 = no penalty)")
        for name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 = off)")
        if self.prefix_allowed_tokens_fn is not None and not callable(self.prefix_allowed_tokens_fn):
            raise TypeError(f"prefix_allowed_tokens_fn must be callable (batch_id, input_ids) -> list of token ids, "
                            f"got {type(self.prefix_allowed_tokens_fn).__name__}")
        for processor in self.logits_processor or ():
            if not callable(processor):
                raise TypeError(f"logits_processor holds {processor!r}, which is not callable (input_ids, scores) -> "
                                "scores; expected transformers LogitsProcessor objects")

    def sequence_settings(self) -> list[str]:
        """'name=value' of each active processor that reads the sequence so far."""
        neutral = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0,
                   "sequence_bias": None, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None}
        settings = [f"{name}={getattr(self, name)!r}" for name, off in neutral.items() if getattr(self, name) != off]
        if self.prefix_allowed_tokens_fn is not None:
            settings.append("prefix_allowed_tokens_fn")
        if self.logits_processor:
            settings.append(f"logits_processor=[{', '.join(type(p).__name__ for p in self.logits_processor)}]")
        return settings

    @property
    def reads_sequence(self) -> bool:
        """Whether each position's logits depend on the tokens before it (`sequence_settings`): then every tree node
        is processed with its own path (inference/sequence_processors.py)."""
        return bool(self.sequence_settings())

    def warpers(self) -> LogitsProcessorList:
        """The same warpers, in the same order, that `generate(do_sample=True, ...)` builds."""
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p is not None:
            warpers.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        if self.typical_p < 1.0:
            warpers.append(TypicalLogitsWarper(mass=self.typical_p, min_tokens_to_keep=1))
        if 0.0 < self.epsilon_cutoff < 1.0:
            warpers.append(EpsilonLogitsWarper(epsilon=self.epsilon_cutoff, min_tokens_to_keep=1))
        if 0.0 < self.eta_cutoff < 1.0:
            warpers.append(EtaLogitsWarper(epsilon=self.eta_cutoff, min_tokens_to_keep=1))
        return warpers


def as_tuple(tokens: list[int] | None) -> tuple[int, ...] | None:
    """[1, 2] -> (1, 2) (hashable, for the frozen `SamplingParams`); None and [] -> None (off)."""
    if not tokens:
        return None
    return tuple(int(t) for t in tokens)


def as_tuples(sequences: list[list[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    """[[1, 2], [3]] -> ((1, 2), (3,)); None stays None."""
    return None if sequences is None else tuple(tuple(int(t) for t in sequence) for sequence in sequences)


def unapplied_generation_settings(generation_config: Any, do_sample: bool) -> dict[str, Any]:
    """{field: value} of the settings in the target's generation config that `transformers.generate` would apply
    (as logits processors) and speculative decoding here does not; empty when there are none.

    Temperature, top-k, top-p, min-p, typical-p, the epsilon and eta cutoffs, the repetition penalty, n-gram
    blocking, minimum lengths, sequence biases, bad words and suppressed tokens are applied (`SamplingParams`);
    forced tokens, length penalties, guidance, watermarking, top-h, the prompt ("encoder") repetition penalty and
    n-gram ban and token healing are not, nor are the decoding modes other than greedy and sampling (beam search,
    contrastive search, DoLa), so an output would silently differ from the target's own `generate`; nor are
    attentions and hidden states returned.
    """

    def value(name: str) -> Any:
        return getattr(generation_config, name, None)

    checks = {  # field -> whether its value makes transformers add a logits processor (as _get_logits_processor)
        "forced_bos_token_id": lambda v: v is not None,
        "forced_eos_token_id": lambda v: v is not None,
        "exponential_decay_length_penalty": lambda v: v is not None,
        "guidance_scale": lambda v: v is not None and v != 1,
        "watermarking_config": lambda v: v is not None,
        # decoding modes (transformers' GenerationMode): beam searches, contrastive search (greedy only), DoLa
        "num_beams": lambda v: v is not None and v > 1,
        "num_beam_groups": lambda v: v is not None and v > 1,
        "constraints": lambda v: v is not None,
        "force_words_ids": lambda v: v is not None,
        "penalty_alpha": lambda v: v is not None and v > 0 and not do_sample and (value("top_k") or 0) > 1,
        "dola_layers": lambda v: v is not None,
        # on a decoder-only model transformers takes the prompt as the "encoder input" of these two
        "encoder_repetition_penalty": lambda v: v is not None and v != 1,
        "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
        "token_healing": lambda v: bool(v),  # rewrites the prompt's tail
        # outputs the result would lack (GenerateDecoderOnlyOutput's attentions / hidden_states)
        "output_attentions": lambda v: bool(v),
        "output_hidden_states": lambda v: bool(v),
    }
    if do_sample:
        checks["top_h"] = lambda v: v is not None
    return {name: value(name) for name, applies in checks.items() if applies(value(name))}


def check_generation_config(generation_config: Any, do_sample: bool) -> None:
    """Raise a ValueError naming the target's generation settings that speculative decoding would not apply."""
    unapplied = unapplied_generation_settings(generation_config, do_sample)
    if unapplied:
        listed = ", ".join(f"{name}={value!r}" for name, value in unapplied.items())
        first = next(iter(unapplied))
        raise ValueError(
            f"the generation config sets {listed}, which transformers' generate applies and speculative decoding "
            f"here does not, so outputs would differ from the target's own: set them to their neutral values in the "
            f"target's config or generate's keywords (e.g. `target.generation_config.{first} = None`; "
            f"`target.generate` then agrees)"
        )


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities after temperature / top-k / top-p. (N, V) logits -> (N, V) float32 probs."""
    scores = params.warpers()(None, logits.float())
    return torch.softmax(scores, dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id from (V,) probabilities (a 0-d long tensor); `generator`: None takes torch's global one."""
    return torch.multinomial(probs, 1, generator=generator)[0]


def choose_token(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's own next token from (1, V) logits, (1,): argmax, or a sample of the processed distribution."""
    if not params.do_sample:
        return logits.argmax(dim=-1)
    return sample_token(target_probs(logits, params)[0], params.generator)[None]
