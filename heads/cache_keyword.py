"""Passing a KV cache to a transformers module under the keyword its `forward` declares.

transformers 5.24 renamed the argument from `past_key_values` to `cache` (models, decoder layers and attention
modules alike); the old name warns there and is removed in 5.40. specheads runs on 5.23 (before the rename)
and later 5.x releases, so every call that hands a cache to a target or to a head's layer goes through
`cache_kwargs`.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def cache_keyword(module: nn.Module) -> str:
    """'cache' when `module.forward` declares it (transformers >= 5.24), else 'past_key_values'.

    A wrapper whose forward declares neither (a peft model takes **kwargs) is looked through to its base model.
    """
    parameters = inspect.signature(module.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" not in parameters and hasattr(module, "get_base_model"):
        return cache_keyword(module.get_base_model())
    return "past_key_values"


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """{keyword: cache} for `module(..., **cache_kwargs(module, cache))`."""
    return {cache_keyword(module): cache}
