"""Targets beyond the Llama-shaped families: Gemma 1/2/3, Qwen3, Phi-3, OLMo 2, Cohere, GPT-NeoX, GPT-2,
Mixtral, StarCoder2 (tiny random configs, `tests/conftest.py` OTHER_FAMILIES).

EAGLE heads own a decoder layer of the target's family when that layer has Llama's shape, else a Llama layer of
the target's sizes; every head type then drafts, trains, saves and reloads on each family, and greedy output is
the target's own.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from specheads import HEAD_TYPES, SpeculativeLM, create_heads, load_heads
from specheads.heads.eagle import draft_layer_config_from_target

from ..conftest import OTHER_FAMILIES
from .conftest import hf_greedy, left_pad, make_heads

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "train"
OWN_LAYER = {"llama", "qwen2", "mistral", "qwen3", "gemma", "starcoder2"}  # Llama-shaped decoder layers
PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9, 79]])


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", *OTHER_FAMILIES])
def test_the_draft_layer_is_the_targets_family_when_it_fits_else_llama(tiny_target_factory, family):
    target = tiny_target_factory(family)
    layer_config = draft_layer_config_from_target(target.config)
    expected = family if family in OWN_LAYER else "llama"
    assert layer_config["model_type"] == expected
    heads = create_heads(target, "eagle3")
    assert type(heads.layer).__name__.lower().startswith(expected.replace("_", ""))
    assert heads.config.target_model_type == family  # the heads still belong to this target family
    if expected == "llama":  # the target's widths carry over
        text = target.config.get_text_config()
        assert (layer_config["hidden_size"], layer_config["num_attention_heads"]) == (
            text.hidden_size, text.num_attention_heads)
        assert layer_config["num_key_value_heads"] == (getattr(text, "num_key_value_heads", None)
                                                       or text.num_attention_heads)


def test_the_llama_layer_keeps_the_targets_rotary_base(tiny_target_factory):
    """Gemma 3 lists rotary parameters per layer type: the Llama layer takes the full-attention layers' base."""
    target = tiny_target_factory("gemma3_text")
    rope = target.config.rope_parameters["full_attention"]["rope_theta"]
    layer_config = draft_layer_config_from_target(target.config)
    assert layer_config["rope_parameters"] == {"rope_type": "default", "rope_theta": float(rope)}


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_untrained_heads_give_the_target_greedy_output(tiny_target_factory, family, head_type):
    target = tiny_target_factory(family)
    lm = SpeculativeLM(target, make_heads(target, head_type))
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=40), hf_greedy(target, PROMPT, 40))


@pytest.mark.parametrize("family", ["gpt2", "gemma3_text", "phi3"])
def test_heads_with_a_llama_layer_save_and_reload(tiny_target_factory, tmp_path, family):
    """The checkpoint records the Llama layer: reloaded heads draft exactly as the saved ones."""
    target = tiny_target_factory(family)
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3").eval()
    heads.save_pretrained(tmp_path)
    reloaded = load_heads(tmp_path, target=target).eval()
    assert type(reloaded.layer).__name__ == "LlamaDecoderLayer"
    hidden = target.config.get_text_config().hidden_size
    features = torch.randn(1, 4, 3 * hidden)
    ids, positions = PROMPT[:, :4], torch.arange(4)[None]
    mask = torch.full((1, 1, 4, 4), torch.finfo(torch.float32).min).triu(1)
    with torch.no_grad():
        expected = heads.logits(heads(features, ids, positions, mask))
        assert torch.equal(reloaded.logits(reloaded(features, ids, positions, mask)), expected)


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
@pytest.mark.parametrize("family", ["gpt2", "gemma2", "cohere", "mixtral"])
def test_heads_train_on_other_families(tiny_target_factory, family, head_type):
    """One training loss on each family: finite, and gradients reach every trainable weight of the heads."""
    from specheads.training.config import load_run_config
    from specheads.training.data import collate
    from specheads.training.train import compute_loss

    target = tiny_target_factory(family)
    config = load_run_config(CONFIGS / f"{head_type}_stories260k.yaml")
    torch.manual_seed(0)
    heads = create_heads(target, head_type).train()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 97, (20,), generator=g).tolist(), "loss_mask": [0, 0] + [1] * 18}
            for _ in range(2)]
    loss = compute_loss(config, heads, heads, target, collate(rows), [0, 1]).loss
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in heads.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
@pytest.mark.parametrize("family", ["gpt2", "phi3", "olmo2", "mixtral"])
def test_the_static_fast_path_on_other_families(tiny_target_factory, family, head_type):
    """The fast path (static caches, fixed-shape drafting; CUDA graphs only on a GPU) forced on the CPU."""
    target = tiny_target_factory(family)
    lm = SpeculativeLM(target, make_heads(target, head_type))
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30, fast_path=True), hf_greedy(target, PROMPT, 30))
    assert lm.last_stats["fast_path"]


@pytest.mark.parametrize(("head_type", "fmt"), [("eagle", "eagle"), ("eagle", "speculators"),
                                                ("eagle3", "eagle3"), ("eagle3", "speculators")])
def test_heads_with_a_llama_layer_survive_foreign_formats(tiny_target_factory, tmp_path, head_type, fmt):
    """Exported and imported again for the same Phi-3 target: the Llama layer does not make the target's
    family look like Llama (the target's own config says what family the heads serve)."""
    from specheads.heads.interop import export_heads, import_heads

    target = tiny_target_factory("phi3")
    torch.manual_seed(0)
    heads = create_heads(target, head_type)
    export_heads(heads, fmt, tmp_path / "foreign")
    back = import_heads(tmp_path / "foreign", target=target, format=fmt)
    assert back.config.target_model_type == "phi3" and type(back.layer).__name__ == "LlamaDecoderLayer"
    original = heads.state_dict()
    assert all(torch.equal(original[name], tensor) for name, tensor in back.state_dict().items())


@pytest.mark.parametrize("family", ["gpt2", "phi3", "cohere"])
def test_left_padded_batches_on_other_families(tiny_target_factory, family):
    """Batched verification of left-padded rows (GPT-2's learned positions count from each row's first token):
    every row equals its own greedy decode alone."""
    target = tiny_target_factory(family)
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18], [4, 40, 41, 42]]
    ids, mask = left_pad(prompts)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=20, batched=True)
    assert lm.last_stats["batched_forwards"] > 0
    for i, prompt in enumerate(prompts):
        alone = hf_greedy(target, torch.tensor([prompt]), 20)
        assert torch.equal(out[i, ids.shape[1]:], alone[0, len(prompt):]), f"row {i}"


@pytest.mark.parametrize(
    ("family", "overrides", "reason"),
    [
        ("bloom", {}, "forward takes no position_ids"),  # ALiBi from the padding mask
        ("mpt", {}, "forward takes no position_ids"),  # ALiBi from key indices: emitted other tokens before
        ("falcon", {"alibi": True}, "uses ALiBi position biases"),
        ("mamba", {}, "keeps a recurrent state"),
        ("recurrent_gemma", {}, "keeps a recurrent state"),
        ("minimax", {}, "has linear_attention layers"),
    ],
)
def test_targets_that_cannot_verify_trees_are_refused(tiny_target_factory, family, overrides, reason):
    """Refused by name when the heads meet them, never served with other tokens than the target's own."""
    target = tiny_target_factory(family, **overrides)
    heads = create_heads(target, "medusa")
    with pytest.raises(ValueError, match=f"cannot be served with exact speculative decoding: .*{reason}"):
        SpeculativeLM(target, heads)


def test_a_target_spread_over_several_devices_is_refused(tiny_target_factory):
    """A device_map over several devices (two GPUs, or CPU / disk offload) is refused by name; one device is fine."""
    target = copy.deepcopy(tiny_target_factory("llama"))  # the factory's models are shared: not this attribute
    target.hf_device_map = {"": 0}
    SpeculativeLM(target, make_heads(target, "eagle3"))
    target.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu"}
    with pytest.raises(ValueError, match=r"spread over 3 devices \(0, 1, cpu: its device_map\).*onto one"):
        SpeculativeLM(target, make_heads(target, "eagle3"))


def test_falcon_with_rotary_positions_is_served(tiny_target_factory):
    target = tiny_target_factory("falcon")  # alibi=False: rotary embeddings from position_ids
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=30), hf_greedy(target, PROMPT, 30))


def test_chunked_attention_is_served_inside_one_chunk(tiny_target_factory):
    """Llama 4's chunked layers: the tree mask is full attention, exact while the run stays in one chunk (past it
    every output differed), so a longer run is refused naming the chunk."""
    target = tiny_target_factory("llama4_text", attention_chunk_size=20)
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=11), hf_greedy(target, PROMPT, 11))
    with pytest.raises(ValueError, match="= 21 exceeds the target's attention chunk .* of 20 positions"):
        lm.generate(PROMPT, max_new_tokens=12)


def test_a_run_config_can_ask_for_a_llama_draft_layer(tiny_target_factory):
    """`head.options: {draft_layer: llama}`: the Qwen2 target's EAGLE-3 heads get a Llama layer (exportable to the
    SGLang / SpecForge layouts) and still give the target's greedy output."""
    from specheads.training.config import load_run_config
    from specheads.training.train import initial_heads

    target = tiny_target_factory("qwen2")
    config = load_run_config(CONFIGS / "eagle3_stories260k.yaml", ["head.options={draft_layer: llama}"])
    heads = initial_heads(config, target)
    assert type(heads.layer).__name__ == "LlamaDecoderLayer"
    lm = SpeculativeLM(target, heads)
    assert torch.equal(lm.generate(PROMPT, max_new_tokens=20), hf_greedy(target, PROMPT, 20))


def test_wrapped_targets_are_judged_by_the_model_inside(tiny_target_factory):
    """A peft wrapper or `torch.compile` hides the forward's position_ids behind **kwargs: the check looks inside."""
    import copy

    from peft import LoraConfig, get_peft_model

    from specheads.inference.target_support import tree_verification_problem

    target = copy.deepcopy(tiny_target_factory("llama"))
    assert tree_verification_problem(torch.compile(target)) is None  # compiled lazily: nothing runs here
    assert tree_verification_problem(get_peft_model(target, LoraConfig(r=2, target_modules=["q_proj"]))) is None
    mamba = copy.deepcopy(tiny_target_factory("mamba"))
    wrapped = get_peft_model(mamba, LoraConfig(r=2, target_modules=["in_proj"]))
    assert "keeps a recurrent state" in tree_verification_problem(wrapped)
