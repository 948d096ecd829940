"""The KV cache goes to transformers under the keyword each forward declares (`cache` from 5.24 on)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from specheads import SpeculativeLM, create_heads
from specheads.heads.cache_keyword import cache_keyword, cache_kwargs


class NewStyle(nn.Module):
    def forward(self, x, cache=None, use_cache=False):
        return x


class OldStyle(nn.Module):
    def forward(self, x, past_key_values=None, use_cache=False):
        return x


class KwargsWrapper(nn.Module):
    """Like a peft model: forward takes **kwargs, the wrapped model declares the keyword."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base

    def get_base_model(self) -> nn.Module:
        return self.base

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)


def test_cache_keyword_follows_the_declared_name():
    assert cache_keyword(NewStyle()) == "cache"
    assert cache_keyword(OldStyle()) == "past_key_values"
    assert cache_keyword(KwargsWrapper(NewStyle())) == "cache"
    assert cache_keyword(KwargsWrapper(OldStyle())) == "past_key_values"
    assert cache_kwargs(NewStyle(), "kv") == {"cache": "kv"}


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_decoding_passes_no_deprecated_cache_keyword(tiny_llama, head_type):
    """Speculative decoding (target verification and the heads' own layer) raises no deprecation of the cache
    argument on the installed transformers (it would become a TypeError where the old name is removed)."""
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, head_type))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(past_key_values|cache_params).*deprecated")
        lm.generate(torch.tensor([[3, 5, 7, 11]]), max_new_tokens=8)
        lm.generate(torch.tensor([[3, 5, 7, 11]]), max_new_tokens=8, fast_path=True)
    assert cache_keyword(tiny_llama) in {"cache", "past_key_values"}
