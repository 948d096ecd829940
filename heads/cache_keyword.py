"""Passing a KV cache to a transformers module under the keyword its `forward` declares.

transformers 5.24 renamed the argument from `past_key_values` to `cache` (models, decoder layers and attention
modules alike); the old name warns there and is removed in 5.40. specheads runs on 5.23 (before the rename)
and later 5.x releases, so every call that hands a cache to a target or to a head's layer goes through
`cache_kwargs`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn


@functools.cache
def declared_parameters(forward: Callable[..., Any]) -> frozenset[str]:
    """The parameter names a `forward` function declares (no **kwargs expansion).

    Memoized per function: `inspect.signature` costs ~60 us, and the decode loop passes a cache several times a
    round (each verification, each draft level).
    """
    return frozenset(inspect.signature(forward).parameters)


def _declared_keyword(forward: Callable[..., Any]) -> str | None:
    """'cache' or 'past_key_values' as a class's `forward` declares it, None for neither (**kwargs)."""
    parameters = declared_parameters(forward)
    for keyword in ("cache", "past_key_values"):
        if keyword in parameters:
            return keyword
    return None


def cache_keyword(module: nn.Module) -> str:
    """'cache' when `module`'s forward declares it (transformers >= 5.24), else 'past_key_values'.

    A wrapper whose forward declares neither (a peft model takes **kwargs) is looked through to its base model.
    """
    declared = _declared_keyword(type(module).forward)
    if declared is None and hasattr(module, "get_base_model"):
        return cache_keyword(module.get_base_model())
    return declared or "past_key_values"


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """{keyword: cache} for `module(..., **cache_kwargs(module, cache))`."""
    return {cache_keyword(module): cache}
