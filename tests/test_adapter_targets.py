"""`load_target` on a peft adapter (a LoRA fine-tune): the base model with the adapter merged, and speculation on it."""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads import SpeculativeLM, create_heads, load_target
from specheads.targets import ASSETS

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A LoRA adapter on stories260K with non-zero weights (peft's default init would be a no-op), as peft saves it."""
    base, _ = load_target("stories260K")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    folder = tmp_path_factory.mktemp("lora")
    peft.get_peft_model(base, config).save_pretrained(folder)
    return folder


def _reference_logits(adapter_dir, ids: torch.Tensor) -> torch.Tensor:
    """The fine-tuned model's logits as peft computes them: base + adapter, NOT merged."""
    base, _ = load_target("stories260K")
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(base, str(adapter_dir))(ids).logits


def test_adapter_folder_loads_the_merged_fine_tune(adapter_dir, stories260k):
    """The recorded base ("stories260K": load_target names its aliases) gets the adapter merged: a plain, frozen model."""
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == "stories260K"
    model, tokenizer = load_target(adapter_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert not [name for name, module in model.named_modules() if "lora" in type(module).__name__.lower()]
    assert not model.training and not [p for p in model.parameters() if p.requires_grad]
    assert model.config.name_or_path == str(adapter_dir)  # heads built for it record the fine-tune, not the base
    assert create_heads(model, "eagle").config.target_name_or_path == str(adapter_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        base_logits = stories260k[0](ids).logits
    torch.testing.assert_close(logits, _reference_logits(adapter_dir, ids), rtol=1e-5, atol=1e-5)
    assert (logits - base_logits).abs().max() > 1e-2  # the adapter changed the model (the test can fail)


def test_speculation_on_an_adapter_target_is_exact(adapter_dir):
    """SpeculativeLM.from_pretrained(target=ADAPTER) gives the fine-tuned target's own greedy tokens."""
    target, tokenizer = load_target(adapter_dir)
    torch.manual_seed(0)
    heads = create_heads(target, "eagle")
    lm = SpeculativeLM(target, heads, tokenizer=tokenizer)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    torch.testing.assert_close(lm.generate(ids, max_new_tokens=40), expected, rtol=0, atol=0)
    base, _ = load_target("stories260K")
    assert not torch.equal(base.generate(ids, max_new_tokens=40, do_sample=False), expected)


def test_adapter_from_the_offline_hub_cache(adapter_dir, offline_hub_cache):
    """A Hub id holding an adapter resolves through the offline cache like any target."""
    offline_hub_cache.publish(adapter_dir, "test-org/stories-lora")
    model, tokenizer = load_target("test-org/stories-lora", local_files_only=True)
    assert model.config.name_or_path == "test-org/stories-lora"
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, _reference_logits(adapter_dir, ids), rtol=1e-5, atol=1e-5)


def test_tokenizer_comes_from_the_adapter_when_it_ships_one(adapter_dir, tmp_path, stories260k):
    """A fine-tune that saved its tokenizer (here: with a chat template the base lacks) gets that tokenizer."""
    folder = tmp_path / "lora-with-tokenizer"
    shutil.copytree(adapter_dir, folder)
    tokenizer = stories260k[1]
    assert not tokenizer.chat_template
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": template}))
    assert load_target(folder)[1].chat_template == template
    assert not load_target(adapter_dir)[1].chat_template


def _edited_adapter(adapter_dir, tmp_path, **changes):
    folder = tmp_path / "edited"
    shutil.copytree(adapter_dir, folder)
    settings = json.loads((folder / "adapter_config.json").read_text())
    settings.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    return folder


def test_missing_base_names_it_and_the_config_key(adapter_dir, tmp_path):
    """A base that is not on this machine: the error names it and says which config key to fix."""
    missing = str(tmp_path / "gone-base")
    folder = _edited_adapter(adapter_dir, tmp_path, base_model_name_or_path=missing)
    with pytest.raises(OSError, match="gone-base(.|\n)*base_model_name_or_path in .*adapter_config.json"):
        load_target(folder)


def test_adapter_without_base_is_refused(adapter_dir, tmp_path):
    folder = _edited_adapter(adapter_dir, tmp_path, base_model_name_or_path=None)
    with pytest.raises(ValueError, match="names no base_model_name_or_path"):
        load_target(folder)


def test_adapter_of_another_base_is_refused(adapter_dir, tmp_path):
    """LoRA weights of another shape than the base's layers: named, instead of peft's bare size mismatch."""
    other = tmp_path / "other-base"  # stories260K's tokenizer, layers half as wide
    shutil.copytree(ASSETS / "stories260K", other, ignore=shutil.ignore_patterns("*.safetensors", "*.json"))
    config = LlamaConfig.from_pretrained(ASSETS / "stories260K")
    config.update(dict(hidden_size=32, intermediate_size=96))
    LlamaForCausalLM(config).save_pretrained(other)
    folder = _edited_adapter(adapter_dir, tmp_path, base_model_name_or_path=str(other))
    with pytest.raises(ValueError, match="does not fit its base model"):
        load_target(folder)


def test_prompt_tuning_adapter_is_refused(tmp_path, stories260k):
    """Virtual-token adapters cannot be merged into the weights: refused by name."""
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    peft.get_peft_model(load_target("stories260K")[0], config).save_pretrained(tmp_path / "prompt")
    with pytest.raises(ValueError, match="PROMPT_TUNING adapter .*cannot be merged"):
        load_target(tmp_path / "prompt")


def test_adapter_over_an_adapter_is_refused(adapter_dir, tmp_path):
    folder = _edited_adapter(adapter_dir, tmp_path, base_model_name_or_path=str(adapter_dir))
    with pytest.raises(ValueError, match="itself a peft adapter"):
        load_target(folder)
