"""`load_target`: the frozen target LLM and its tokenizer, from a path, a Hub id, or a built-in alias."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.utils import cached_file, find_adapter_config_file

ASSETS = Path(__file__).parent / "assets"
ALIASES = {"stories260k": ASSETS / "stories260K"}
SMOLLM2_ALIASES = ("smollm2-135m-instruct", "smollm2")
# the Hub repositories the aliases' weights come from (a model card's `base_model` must name a Hub model)
ALIAS_HUB_IDS = {"stories260k": "karpathy/tinyllamas", **dict.fromkeys(SMOLLM2_ALIASES, "HuggingFaceTB/SmolLM2-135M-Instruct")}
# config fields of families whose logits are not plain lm_head(last hidden state) (Gemma 2's soft-capping,
# Cohere's and Granite's scaling): training labels and the certified argmax must not assume they are
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logit_transforms(target: PreTrainedModel) -> dict[str, float]:
    """{config field: value} of the target's transforms of its logits after the lm_head; empty when there are none."""
    config = target.config.get_text_config()
    return {name: getattr(config, name) for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)}


def _missing_folder(path: str) -> bool:
    """True for a path (absolute or ./relative, so not a Hub id) that is not an existing folder."""
    local = Path(path).expanduser().is_absolute() or str(path).startswith(".")
    return local and not Path(path).expanduser().is_dir()


def resolve_target_path(name_or_path: str | os.PathLike) -> str:
    """Map a built-in alias to its folder; anything else is passed through to transformers."""
    text = str(name_or_path)
    if text.lower() in ALIASES:
        return str(ALIASES[text.lower()])
    if text.lower() in SMOLLM2_ALIASES:
        from specheads.smollm2 import smollm2_folder

        return str(smollm2_folder())
    return text


def _from_pretrained(path: str, dtype: torch.dtype, hub: dict[str, Any]) -> PreTrainedModel:
    """The model at `path`: a causal LM, or for a vision-language checkpoint (its config has a `vision_config`)
    the image-text-to-text model, whose forward takes the prompt's images (inference/multimodal.py)."""
    config = AutoConfig.from_pretrained(path, **hub)
    if hasattr(config, "vision_config") and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **hub)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hub)


def load_target(
    name_or_path: str | os.PathLike = "stories260K",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen target model (eval mode, no gradients) and its tokenizer.

    Args:
        name_or_path: a local folder, a Hub id (resolved by transformers; the offline cache works), or an
            alias: "stories260K" (embedded, 1 MB) or "smollm2-135m-instruct" (needs the `smollm2` extra).
            A peft adapter (a folder or Hub id holding adapter_config.json, e.g. a LoRA fine-tune) is loaded
            onto the base model its config names and merged in: the target is the fine-tuned model, with no
            adapter layers left to run; the tokenizer is the adapter's when it ships one, else the base's.
            A vision-language checkpoint (LLaVA, Qwen2-VL, Gemma 3, Idefics3, ...) loads as its image-text-to-text
            model: `generate` then takes the prompt's images (`pixel_values`, ...; inference/multimodal.py).
        dtype: e.g. torch.float32 (default: float32 on CPU).
        device: where to put the model (default: CPU).
        cache_dir: HF cache folder for Hub ids.
        local_files_only: never contact the Hub; use the cache only.

    Returns:
        (model, tokenizer)
    """
    path = resolve_target_path(name_or_path)
    if _missing_folder(path):
        raise FileNotFoundError(f"target folder {path!r} does not exist")
    hub = {"cache_dir": cache_dir, "local_files_only": local_files_only}
    adapter_config = find_adapter_config_file(path, **hub)
    if adapter_config is None:
        model = _from_pretrained(path, dtype or torch.float32, hub)
        tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    else:
        model, tokenizer = _load_adapted_target(path, adapter_config, dtype or torch.float32, hub)
    if device is not None:
        model.to(device)
    model.eval().requires_grad_(False)
    aliased = str(name_or_path).lower() in ALIASES or str(name_or_path).lower() in SMOLLM2_ALIASES
    if aliased or adapter_config is not None:
        # heads record config.name_or_path, peft adapters the model's: an alias (portable, not this machine's
        # path) or the adapter (the fine-tuned target, not its base)
        model.config.name_or_path = model.name_or_path = str(name_or_path)
    return model, tokenizer


def _load_adapted_target(
    adapter: str, adapter_config_file: str, dtype: torch.dtype, hub: dict[str, Any]
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model named by a peft adapter's config, with the adapter merged in, and the tokenizer to use.

    Merging (peft's merge_and_unload) makes the target a plain model again: verification runs no LoRA layers,
    and its hidden states, which the heads read, are the fine-tuned model's.
    """
    from peft import PeftConfig, PeftModel

    where = f"adapter {adapter!r} ({adapter_config_file})"
    try:
        peft_config = PeftConfig.from_pretrained(adapter, **hub)
    except (OSError, ValueError, TypeError, KeyError) as err:  # unreadable JSON, an unknown peft_type, ...
        raise ValueError(f"{where}: cannot read adapter_config.json: {err}") from err
    base_name = peft_config.base_model_name_or_path
    if not base_name:
        raise ValueError(
            f"{where} names no base_model_name_or_path; expected the path or Hub id of the model it adapts"
        )
    if peft_config.is_prompt_learning:
        raise ValueError(
            f"{where} is a {peft_config.peft_type} adapter (virtual prompt tokens), which cannot be merged into the "
            "model; expected a weight adapter such as LoRA"
        )
    base = resolve_target_path(base_name)
    fix = f"Set base_model_name_or_path in {adapter_config_file} to where that model is on this machine."
    if _missing_folder(base):
        raise FileNotFoundError(f"{where} adapts base_model_name_or_path={base_name!r}, which does not exist. {fix}")
    if find_adapter_config_file(base, **hub) is not None:
        raise ValueError(
            f"{where} adapts {base_name!r}, itself a peft adapter; merge that one into its base first "
            "(peft: PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(folder))"
        )
    try:
        model = _from_pretrained(base, dtype, hub)
    except OSError as err:
        raise OSError(
            f"{where} adapts base_model_name_or_path={base_name!r}, which cannot be loaded: {err}\n{fix}"
        ) from err
    try:
        merged = PeftModel.from_pretrained(model, adapter, **hub).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"{where} does not fit its base model {base_name!r}: {err}") from err
    ships_tokenizer = cached_file(
        adapter, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False, **hub,
    )
    tokenizer = AutoTokenizer.from_pretrained(adapter if ships_tokenizer else base, **hub)
    return merged, tokenizer
