"""`SamplingParams`: the target's sampling settings resolved as `generate` resolves them, its warpers the ones
`generate` builds (so a drafted token is accepted against the distribution `generate` would sample), bad values
named."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList

from specheads.inference.sampling import SamplingParams

GENERATION_CONFIGS = {
    "every warper": dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, typical_p=0.95, epsilon_cutoff=3e-4,
                         eta_cutoff=1e-3),
    "epsilon": dict(epsilon_cutoff=0.02, top_k=0),
    "eta": dict(eta_cutoff=0.05, temperature=1.3),
    "defaults": dict(),
}


@pytest.mark.parametrize("name", sorted(GENERATION_CONFIGS))
def test_warpers_are_the_ones_generate_builds_in_its_order(tiny_llama, name):
    """From a target's generation config (where epsilon / eta cutoffs come from), the same warpers as transformers'
    `_get_logits_processor` builds for `generate(do_sample=True)` (its unset values filled with transformers'
    defaults, top_k=50 among them), giving the same warped logits."""
    config = GenerationConfig(**GENERATION_CONFIGS[name])  # a target's own generation_config.json
    ids = torch.tensor([[1, 2, 3, 4]])
    prepared, _ = tiny_llama._prepare_generation_config(config, do_sample=True)  # transformers' defaults filled in
    theirs = tiny_llama._get_logits_processor(
        generation_config=prepared, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
    )
    ours = SamplingParams.resolve(config, True, None, None, None).warpers()
    assert [type(w).__name__ for w in ours] == [type(p).__name__ for p in theirs]
    logits = torch.randn(3, tiny_llama.config.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(ours(ids.expand(3, -1), logits.clone()), theirs(ids.expand(3, -1), logits.clone()))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(do_sample=True, temperature=0.0), r"temperature=0\.0 must be > 0 when do_sample=True"),
        (dict(top_p=0.0), r"top_p=0\.0 must be in \(0, 1\]"),
        (dict(top_k=-1), r"top_k=-1 must be >= 0"),
        (dict(min_p=1.5), r"min_p=1\.5 must be in \[0, 1\]"),
        (dict(typical_p=0.0), r"typical_p=0\.0 must be in \(0, 1\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty=0\.0 must be > 0"),
        (dict(no_repeat_ngram_size=-2), r"no_repeat_ngram_size=-2 must be >= 0"),
        (dict(min_new_tokens=-1), r"min_new_tokens=-1 must be >= 0"),
    ],
)
def test_bad_sampling_values_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings).validate()


def test_processors_that_are_not_callable_are_named():
    with pytest.raises(TypeError, match="prefix_allowed_tokens_fn must be callable"):
        SamplingParams(prefix_allowed_tokens_fn=3).validate()
    with pytest.raises(TypeError, match="logits_processor holds 'top_k', which is not callable"):
        SamplingParams(logits_processor=LogitsProcessorList(["top_k"])).validate()
