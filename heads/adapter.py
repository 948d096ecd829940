"""The LoRA adapter that Medusa-2 heads need on their target: fingerprint, check, and loading.

Medusa-2 trains the heads jointly with a peft LoRA adapter on the target (training/joint_lora.py), so the
heads draft for the ADAPTED target and verification must use it too. The checkpoint is then

    heads/config.json            HeadsConfig with target_adapter="target_adapter" and target_adapter_sample
    heads/model.safetensors      head weights only
    heads/target_adapter/        the adapter (peft save_pretrained: adapter_config.json + adapter_model.safetensors)

`apply_target_adapter(target, heads_path)` merges the adapter into the target (what `SpeculativeLM.from_pretrained`
does), and `check_target_adapter` (called by `attach_target`) refuses a target without it: the fingerprint
`target_adapter_sample` holds, for the adapted weight matrix that the adapter changed most, its base and merged
values at the positions of the largest changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specheads.heads.config import HeadsConfig

ADAPTER_DIRNAME = "target_adapter"
ADAPTER_SAMPLE_SIZE = 16
# same tolerance as the embedding fingerprint: survives bf16/fp16 copies of one target
SAMPLE_RTOL, SAMPLE_ATOL = 2e-2, 1e-3


def merged_weight(module: nn.Module) -> torch.Tensor:
    """The weight of `module` as peft's merge_and_unload leaves it: base + the active LoRA deltas (no copy of the model).

    A module without an adapter returns its own weight.
    """
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        return module.weight.detach()
    weight = module.get_base_layer().weight.detach()
    for adapter in module.active_adapters:
        weight = weight + module.get_delta_weight(adapter).detach()
    return weight


def adapter_fingerprint(peft_target: Any) -> dict[str, Any]:
    """`HeadsConfig.target_adapter_sample` of a LoRA-wrapped target: where its adapter changes a weight most.

    Args:
        peft_target: the target wrapped by peft (`get_peft_model`), adapter not merged.

    Returns:
        {"weight": the parameter's name in the merged target, "rows", "cols": the positions of the
        `ADAPTER_SAMPLE_SIZE` largest changes in that matrix, "base", "adapted": its values there before and
        after merging}; {} when the target has no LoRA layer.
    """
    from peft.tuners.lora import LoraLayer

    best: tuple[float, str, torch.Tensor, torch.Tensor] | None = None
    with torch.no_grad():
        for name, module in peft_target.get_base_model().named_modules():
            if not isinstance(module, LoraLayer):
                continue
            base, adapted = module.get_base_layer().weight.detach().float(), merged_weight(module).float()
            if base.shape != adapted.shape or base.dim() != 2:
                continue
            change = (adapted - base).abs().max().item()
            if best is None or change > best[0]:
                best = (change, f"{name}.weight", base, adapted)
    if best is None:
        return {}
    _, weight_name, base, adapted = best
    flat = (adapted - base).abs().flatten().topk(min(ADAPTER_SAMPLE_SIZE, base.numel())).indices
    rows, cols = (flat // base.shape[1]).tolist(), (flat % base.shape[1]).tolist()
    return {
        "weight": weight_name,
        "rows": rows,
        "cols": cols,
        "base": [float(v) for v in base[rows, cols].tolist()],
        "adapted": [float(v) for v in adapted[rows, cols].tolist()],
    }


def _load_hint(config: HeadsConfig) -> str:
    return (
        f"these heads were trained jointly with a LoRA adapter on the target (HeadsConfig.target_adapter="
        f"{config.target_adapter!r}) and draft for the adapted target: load the target with "
        "SpeculativeLM.from_pretrained(target, heads), which applies the adapter, or merge it first with "
        "`target = specheads.heads.adapter.apply_target_adapter(target, heads_path)`"
    )


def check_target_adapter(config: HeadsConfig, target: PreTrainedModel) -> None:
    """Raise a ValueError when heads that need a target adapter meet a target without it (merged).

    Compares the target's weights at the positions of `config.target_adapter_sample` with the recorded
    base and adapted values. Heads without an adapter (`target_adapter == ""`) accept any target here.

    Raises:
        ValueError: the target is the un-adapted one (the message says how to load the adapter), still holds
            unmerged LoRA layers, or has other weights.
    """
    sample = config.target_adapter_sample
    if not config.target_adapter or not sample or not sample["rows"]:
        return
    try:
        weight = target.get_parameter(sample["weight"])
    except AttributeError as err:
        raise ValueError(
            f"the target has no parameter {sample['weight']!r} (recorded in target_adapter_sample): another target "
            f"(these heads were built for {config.target_name_or_path!r}), or a peft model whose adapter is not "
            f"merged (merge_and_unload() it); {_load_hint(config)}"
        ) from err
    if weight.is_meta:  # not materialised (offloaded): nothing to compare
        return
    if weight.dim() != 2 or max(sample["rows"]) >= weight.shape[0] or max(sample["cols"]) >= weight.shape[1]:
        raise ValueError(
            f"the target's {sample['weight']} has shape {tuple(weight.shape)}, too small for the positions in "
            f"target_adapter_sample: another target; these heads were built for {config.target_name_or_path!r}"
        )
    rows = torch.tensor(sample["rows"], device=weight.device)
    cols = torch.tensor(sample["cols"], device=weight.device)
    with torch.no_grad():
        actual = weight[rows, cols].float().cpu()
    base, adapted = torch.tensor(sample["base"]), torch.tensor(sample["adapted"])
    # an adapter whose change is below the tolerance cannot be told apart from none: accept either
    visible = not torch.allclose(adapted, base, rtol=SAMPLE_RTOL, atol=SAMPLE_ATOL)
    if visible and (actual - base).abs().max() < (actual - adapted).abs().max():
        raise ValueError(f"the target's {sample['weight']} is the un-adapted one; {_load_hint(config)}")
    if not torch.allclose(actual, adapted, rtol=SAMPLE_RTOL, atol=SAMPLE_ATOL):
        raise ValueError(
            f"the target's {sample['weight']} matches neither the adapted nor the base target of these heads "
            f"(max difference {(actual - adapted).abs().max().item():.4g} to the adapted values): another "
            f"target, or the adapter merged twice; these heads were built for {config.target_name_or_path!r}"
        )


def apply_target_adapter(
    target: PreTrainedModel,
    heads_path: str | os.PathLike,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> PreTrainedModel:
    """Merge the LoRA adapter that the heads at `heads_path` need into `target` (in place) and return it.

    Heads without an adapter (`HeadsConfig.target_adapter == ""`) return `target` unchanged, so this is safe to
    call for any heads. Pass the base target (as `load_target` returns it), not one already adapted.

    Args:
        target: the base target.
        heads_path: a heads checkpoint folder or Hub id (the adapter is its `target_adapter` subfolder).
        revision, cache_dir, local_files_only: as in `load_heads`, for Hub ids.

    Returns:
        The target with the adapter merged (eval mode, no gradients): verification uses the adapted target.

    Raises:
        FileNotFoundError: the checkpoint lacks the adapter folder its config names.
        ValueError: the merged target does not match the heads' fingerprint (another or an already adapted target).
    """
    from specheads.heads.loading import CONFIG_NAME, _resolve_folder, is_specheads_checkpoint

    folder = _resolve_folder(heads_path, revision, cache_dir, local_files_only)
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}; is it a specheads checkpoint?")
    if not is_specheads_checkpoint(folder):  # another project's heads have no adapter (load_heads converts them)
        return target
    config = HeadsConfig.from_pretrained(folder)
    if not config.target_adapter:
        return target
    adapter_dir = Path(folder) / config.target_adapter
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{folder}: HeadsConfig.target_adapter={config.target_adapter!r} but {adapter_dir} has no adapter_config.json "
            "(the checkpoint is incomplete: copy the whole folder, adapter subfolder included)"
        )
    from peft import PeftModel

    merged = PeftModel.from_pretrained(target, str(adapter_dir)).merge_and_unload()
    merged.eval().requires_grad_(False)
    check_target_adapter(config, merged)
    return merged
