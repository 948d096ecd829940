"""Head architectures on tiny Llama / Qwen2 / Mistral targets and on the embedded stories260K target.

Proves the shape contracts of DESIGN.md (Medusa: (K, B, T, V); EAGLE: (B, T, h) features and (..., V)
logits), Medusa's initialisation (a fresh head is the target's own lm_head), EAGLE's reuse of the target
family's HF decoder layer, that heads never own the target's embedding or lm_head, and EAGLE causality.
"""

from __future__ import annotations

import pytest
import torch

from specheads import HEAD_TYPES, create_heads
from specheads.heads import DraftHeads, EagleHeads, MedusaHeads

DECODER_LAYER = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "mistral": "MistralDecoderLayer"}


def _features(target, batch: int = 2, length: int = 5, seed: int = 0) -> torch.Tensor:
    """Random target-width features, (B, T, h)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, target.config.hidden_size, generator=generator)


def test_head_types_are_registered():
    """The design's head types are registered under their names (one explicit line each)."""
    assert {"medusa", "eagle"} <= set(HEAD_TYPES)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_create_heads_every_type(any_target, head_type, expected_feature_layers):
    """`create_heads` builds each registered type for each family, sized from the target's config."""
    torch.manual_seed(0)
    heads = create_heads(any_target, head_type)
    config = any_target.config
    assert isinstance(heads, DraftHeads)
    assert heads.config.head_type == head_type
    assert heads.config.hidden_size == config.hidden_size
    assert heads.config.vocab_size == config.vocab_size
    layers = config.num_hidden_layers
    assert heads.config.feature_layers == expected_feature_layers(head_type, layers)
    assert heads.config.target_model_type == config.model_type
    assert heads.config.target_architectures == [type(any_target).__name__]
    assert next(heads.parameters()).dtype == any_target.dtype


def test_medusa_output_shape(any_target):
    """Medusa maps features (B, T, h) to logits (K, B, T, V), one slice per head."""
    torch.manual_seed(0)
    heads = create_heads(any_target, "medusa", num_heads=3, num_layers=2).eval()
    with torch.no_grad():
        logits = heads(_features(any_target, batch=2, length=5))
    assert logits.shape == (3, 2, 5, any_target.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_fresh_medusa_heads_equal_target_lm_head(any_target):
    """A fresh Medusa head is the identity residual + a copy of the target's lm_head: same logits."""
    torch.manual_seed(0)
    heads = create_heads(any_target, "medusa", num_heads=4).eval()
    features = _features(any_target)
    with torch.no_grad():
        logits = heads(features)
        expected = any_target.get_output_embeddings()(features)
    for k in range(4):
        torch.testing.assert_close(logits[k], expected, rtol=0, atol=0)


def test_medusa_heads_are_independent_modules(tiny_target):
    """Each Medusa head owns its parameters (not one module repeated K times)."""
    heads = create_heads(tiny_target, "medusa", num_heads=3)
    pointers = {head[-1].weight.data_ptr() for head in heads.heads}
    assert len(pointers) == 3
    with torch.no_grad():
        heads.heads[0][0].linear.weight.add_(1.0)
    assert heads.heads[1][0].linear.weight.abs().sum() == 0


def test_eagle_output_shapes(any_target, eagle_inputs):
    """EAGLE maps (features, tokens, positions, 4-D mask) to features (B, T, h); `logits` gives (..., V)."""
    torch.manual_seed(0)
    heads = create_heads(any_target, "eagle").eval()
    inputs = eagle_inputs(any_target, batch=2, length=6)
    with torch.no_grad():
        predicted = heads(**inputs, past_key_values=None)
        logits = heads.logits(predicted)
    h, v = any_target.config.hidden_size, any_target.config.vocab_size
    assert predicted.shape == (2, 6, h)
    assert logits.shape == (2, 6, v)
    assert torch.isfinite(logits).all()


def test_eagle_logits_are_the_target_lm_head(any_target):
    """`EagleHeads.logits` is the target's own lm_head applied to predicted features."""
    heads = create_heads(any_target, "eagle").eval()
    features = _features(any_target)
    with torch.no_grad():
        torch.testing.assert_close(heads.logits(features), any_target.get_output_embeddings()(features))


def test_eagle_layer_is_the_target_family_decoder_layer(any_target):
    """The EAGLE head's layer is the HF decoder layer class of the target's family (no copied modeling code)."""
    heads = create_heads(any_target, "eagle")
    layer_class = type(heads.layer)
    assert layer_class.__name__ == DECODER_LAYER[any_target.config.model_type]
    assert layer_class.__module__.startswith(f"transformers.models.{any_target.config.model_type}.")


def test_eagle_state_dict_holds_no_target_embedding_or_lm_head(any_target):
    """EAGLE borrows the target's embedding and lm_head at run time; they are neither submodules nor saved."""
    heads = create_heads(any_target, "eagle")
    v, h = any_target.config.vocab_size, any_target.config.hidden_size
    state = heads.state_dict()
    assert state, "EAGLE heads should have weights of their own"
    assert not [k for k in state if "embed" in k or "lm_head" in k]
    assert not [k for k, t in state.items() if tuple(t.shape) in {(v, h), (h, v)}]
    borrowed = {id(any_target.get_input_embeddings()), id(any_target.get_output_embeddings())}
    assert not [name for name, module in heads.named_modules() if id(module) in borrowed]


def test_medusa_state_dict_holds_only_its_own_projections(any_target):
    """Medusa's per-head vocab projections are its own weights (copies), never the target's modules."""
    heads = create_heads(any_target, "medusa", num_heads=2)
    assert not [k for k in heads.state_dict() if "embed" in k or "lm_head" in k]
    target_weight = any_target.get_output_embeddings().weight
    for head in heads.heads:
        assert head[-1].weight.data_ptr() != target_weight.data_ptr()


def test_eagle_is_causal(any_target, eagle_inputs):
    """Changing the last position's feature and token leaves every earlier EAGLE output unchanged."""
    torch.manual_seed(0)
    heads = create_heads(any_target, "eagle").eval()
    inputs = eagle_inputs(any_target, batch=2, length=6)
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["features"][:, -1] += 5.0
    changed["input_ids"][:, -1] = (changed["input_ids"][:, -1] + 1) % any_target.config.vocab_size
    with torch.no_grad():
        before = heads(**inputs)
        after = heads(**changed)
    torch.testing.assert_close(after[:, :-1], before[:, :-1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after[:, -1], before[:, -1])


def test_eagle_reads_the_token_embedding(tiny_target, eagle_inputs):
    """The token input matters: a different next token at position t changes the prediction at t."""
    torch.manual_seed(0)
    heads = create_heads(tiny_target, "eagle").eval()
    inputs = eagle_inputs(tiny_target, batch=1, length=4)
    changed = dict(inputs, input_ids=(inputs["input_ids"] + 1) % tiny_target.config.vocab_size)
    with torch.no_grad():
        assert not torch.allclose(heads(**inputs), heads(**changed))


def test_unattached_heads_say_so(tiny_target):
    """Heads built from a config alone raise a clear error until `attach_target` is called."""
    heads = create_heads(tiny_target, "eagle")
    fresh = EagleHeads(heads.config)
    with pytest.raises(RuntimeError, match="attach_target"):
        fresh.logits(torch.zeros(1, tiny_target.config.hidden_size))
    fresh.attach_target(tiny_target)
    assert fresh.logits(torch.zeros(1, tiny_target.config.hidden_size)).shape == (
        1,
        tiny_target.config.vocab_size,
    )


def test_medusa_class_is_used(tiny_target):
    """The registry maps each name to its class."""
    assert isinstance(create_heads(tiny_target, "medusa"), MedusaHeads)
    assert isinstance(create_heads(tiny_target, "eagle"), EagleHeads)
