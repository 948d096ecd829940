"""Fixtures for the heads tests: tiny targets of each supported family, built in code (no downloads).

Helpers are handed out as fixtures (not imported from here) so the suite works in any pytest import mode.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedModel, Qwen2Config

TINY_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


def build_tiny_target(
    family: str, hidden_size: int = 64, vocab_size: int = 97, seed: int = 0
) -> PreTrainedModel:
    """A seeded, randomly initialised 2-layer causal LM of `family`, frozen and in eval mode."""
    config = TINY_CONFIGS[family](
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.config.name_or_path = f"tiny-org/tiny-{family}"  # what a Hub-loaded target would carry
    return model.eval().requires_grad_(False)


def build_causal_mask(batch: int, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive causal attention mask (B, 1, T, T): 0 on and below the diagonal, dtype-min above."""
    mask = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask.expand(batch, 1, length, length).clone()


def build_eagle_inputs(
    target: PreTrainedModel, batch: int = 2, length: int = 7, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random features (B, T, h), tokens (B, T), positions (B, T) and a causal mask: `EagleHeads.forward`'s inputs."""
    config = target.config.get_text_config()
    generator = torch.Generator().manual_seed(seed)
    return {
        "features": torch.randn(batch, length, config.hidden_size, generator=generator),
        "input_ids": torch.randint(0, config.vocab_size, (batch, length), generator=generator),
        "position_ids": torch.arange(length).expand(batch, length).clone(),
        "attention_mask": build_causal_mask(batch, length),
    }


@pytest.fixture(scope="session")
def make_tiny_target() -> Callable[..., PreTrainedModel]:
    """`make_tiny_target(family, hidden_size=64, vocab_size=97, seed=0)` -> a fresh tiny target."""
    return build_tiny_target


@pytest.fixture(scope="session")
def causal_mask() -> Callable[..., torch.Tensor]:
    """`causal_mask(batch, length)` -> additive (B, 1, T, T) causal mask."""
    return build_causal_mask


@pytest.fixture(scope="session")
def eagle_inputs() -> Callable[..., dict[str, torch.Tensor]]:
    """`eagle_inputs(target, batch=2, length=7, seed=0)` -> keyword arguments for `EagleHeads.forward`."""
    return build_eagle_inputs


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_target(request: pytest.FixtureRequest) -> PreTrainedModel:
    """One tiny target per family (llama, mistral, qwen2); shared, so tests must not modify it."""
    return build_tiny_target(request.param)


@pytest.fixture(scope="session", params=[*sorted(TINY_CONFIGS), "stories260K"])
def any_target(request: pytest.FixtureRequest, stories260k) -> PreTrainedModel:
    """Each tiny family, then the embedded real target (stories260K); shared, so tests must not modify it."""
    if request.param == "stories260K":
        return stories260k[0]
    return build_tiny_target(request.param)


@pytest.fixture(scope="module")
def stories(stories260k):
    """The embedded stories260K target (model only)."""
    return stories260k[0]


def default_feature_layers(head_type: str, num_hidden_layers: int) -> list[int]:
    """The hidden states `create_heads` has heads of `head_type` read by default."""
    from specheads.heads.dflash import default_dflash_feature_layers
    from specheads.heads.eagle3 import default_eagle3_feature_layers

    if head_type == "eagle3":
        return default_eagle3_feature_layers(num_hidden_layers)
    if head_type == "dflash":
        return default_dflash_feature_layers(num_hidden_layers, 3)
    return [num_hidden_layers]


@pytest.fixture(scope="session")
def expected_feature_layers() -> Callable[[str, int], list[int]]:
    """`expected_feature_layers(head_type, num_hidden_layers)` -> the default `feature_layers` of fresh heads."""
    return default_feature_layers
