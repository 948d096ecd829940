"""`load_target`: the frozen target LLM and its tokenizer, from a path, a Hub id, or a built-in alias."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

ASSETS = Path(__file__).parent / "assets"
ALIASES = {"stories260k": ASSETS / "stories260K"}
SMOLLM2_ALIASES = ("smollm2-135m-instruct", "smollm2")
# config fields of families whose logits are not plain lm_head(last hidden state) (Gemma 2's soft-capping,
# Cohere's and Granite's scaling): training labels and the certified argmax must not assume they are
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logit_transforms(target: PreTrainedModel) -> dict[str, float]:
    """{config field: value} of the target's transforms of its logits after the lm_head; empty when there are none."""
    config = target.config.get_text_config()
    return {name: getattr(config, name) for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)}


def resolve_target_path(name_or_path: str | os.PathLike) -> str:
    """Map a built-in alias to its folder; anything else is passed through to transformers."""
    text = str(name_or_path)
    if text.lower() in ALIASES:
        return str(ALIASES[text.lower()])
    if text.lower() in SMOLLM2_ALIASES:
        from specheads.smollm2 import smollm2_folder

        return str(smollm2_folder())
    return text


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
        dtype: e.g. torch.float32 (default: float32 on CPU).
        device: where to put the model (default: CPU).
        cache_dir: HF cache folder for Hub ids.
        local_files_only: never contact the Hub; use the cache only.

    Returns:
        (model, tokenizer)
    """
    path = resolve_target_path(name_or_path)
    if Path(path).expanduser().is_absolute() or str(path).startswith("."):
        if not Path(path).expanduser().is_dir():
            raise FileNotFoundError(f"target folder {path!r} does not exist")
    hub = {"cache_dir": cache_dir, "local_files_only": local_files_only}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **hub)
    if device is not None:
        model.to(device)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    if str(name_or_path).lower() in ALIASES or str(name_or_path).lower() in SMOLLM2_ALIASES:
        model.config.name_or_path = str(name_or_path)  # portable: an alias, not this machine's path
    return model, tokenizer
