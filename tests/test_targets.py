"""`load_target`: the embedded stories260K alias, local paths, missing paths, and Hub ids from an offline cache."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from specheads import load_target
from specheads.targets import ASSETS

STORIES = ASSETS / "stories260K"
PROMPT = "Once upon a time"
# From the model's README: HF greedy continuation of the prompt in fp32.
EXPECTED_START = "Once upon a time, there was a little girl named Lily"


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits


def test_alias_loads_a_frozen_llama(stories260k):
    """The alias gives a LlamaForCausalLM in eval mode with no trainable parameters, plus its tokenizer."""
    model, tokenizer = stories260k
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert not [name for name, p in model.named_parameters() if p.requires_grad]
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    assert model.config.vocab_size == 512 and model.config.hidden_size == 64
    assert model.dtype == torch.float32
    assert model.config.name_or_path == "stories260K"  # portable: the alias, not this machine's path


def test_alias_is_case_insensitive(stories260k):
    """`stories260k` and `stories260K` name the same embedded model."""
    model, tokenizer = load_target("stories260k")
    torch.testing.assert_close(_logits(model, tokenizer), _logits(*stories260k), rtol=0, atol=0)


def test_greedy_continuation_matches_the_readme(stories260k):
    """The embedded weights are the real stories260K: greedy decoding writes the README's story."""
    model, tokenizer = stories260k
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 20
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith(EXPECTED_START)


def test_load_by_local_path(stories260k, tmp_path):
    """A local folder (the asset folder, or a copy of it) loads the same weights as the alias."""
    copy = tmp_path / "my-target"
    shutil.copytree(STORIES, copy)
    reference = _logits(*stories260k)
    for path in (str(STORIES), copy):
        model, tokenizer = load_target(path)
        assert not model.training
        torch.testing.assert_close(_logits(model, tokenizer), reference, rtol=0, atol=0)


def test_dtype_argument(tmp_path):
    """`dtype` selects the model's dtype."""
    model, _ = load_target("stories260K", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("relative", [False, True])
def test_missing_path_is_file_not_found(tmp_path, monkeypatch, relative):
    """A folder that does not exist raises FileNotFoundError naming it (absolute or ./relative)."""
    monkeypatch.chdir(tmp_path)
    path = "./no-such-target" if relative else str(tmp_path / "no-such-target")
    with pytest.raises(FileNotFoundError, match="no-such-target"):
        load_target(path)


def test_load_by_hub_id_from_offline_cache(stories260k, offline_hub_cache):
    """A Hub id resolves through the HF cache (refs/main -> snapshots/<hash>) with the Hub offline."""
    snapshot = offline_hub_cache.publish(STORIES, "test-org/stories260K")
    model, tokenizer = load_target("test-org/stories260K")
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert model.config.name_or_path in ("test-org/stories260K", str(snapshot))
    torch.testing.assert_close(_logits(model, tokenizer), _logits(*stories260k), rtol=0, atol=0)
