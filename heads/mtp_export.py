"""Write fine-tuned MTP heads back into their target's checkpoint: `specheads export --format mtp`.

A fine-tuned MTP layer (`specheads train head.type=mtp`) drafts in specheads as a heads checkpoint. vLLM, SGLang and
transformers' `generate(use_mtp=True)` read MTP layers from the model folder itself, so this writes a copy of the
target's folder in which the tensors of its first MTP layer are the heads' own, under the checkpoint's names: the
decoder block's tensors renamed back as transformers saves that family (experts split per expert again), and the MTP
module's `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`. Only the safetensors files holding those tensors are
rewritten; every other file of the folder is linked (a symbolic link to the original), so the copy costs the MTP
layer's shard(s), not the model.

Supported: targets that keep their MTP layers as decoder layers after the last one (`model.layers.N.*`, N = the
number of decoder layers: DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7) or under `mtp.*` (`mtp.layers.0.*`, `mtp.fc`,
`mtp.pre_fc_norm_*`, `mtp.norm`: Qwen3-Next, Qwen3.5 / 3.6, Mellum), in a floating-point dtype (an FP8 checkpoint
would need the layer quantized: refused by name).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from specheads.heads.base import DraftHeads
from specheads.heads.checkpoint_mtp import (
    AFTER_LAYERS_NAMES,
    BLOCK_PREFIX,
    QWEN_MTP_NAMES,
    checkpoint_weight_map,
)
from specheads.heads.mtp import MtpHeads


def mtp_checkpoint_tensors(heads: MtpHeads, num_hidden_layers: int, under_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The heads' MTP layer as the target's checkpoint names it: {"model.layers.N.<name>": tensor}, N =
    `num_hidden_layers` (the first MTP layer comes after the decoder layers), or with `under_mtp` Qwen3-Next's /
    Qwen3.5's / Mellum's names (`mtp.layers.0.<name>`, `mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`)."""
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):  # only the family's names and weight conversions are needed: no memory
        family = AutoModelForCausalLM.from_config(heads.layer_config)
    block = {f"model.layers.0.{name}": tensor.detach() for name, tensor in heads.layer.mtp_block.state_dict().items()}
    named = revert_weight_conversion(family, block)  # experts split per expert, as save_pretrained writes them
    prefix = BLOCK_PREFIX if under_mtp else f"model.layers.{num_hidden_layers}."
    # the name inside the decoder layer: what follows `layers.0.` (some families' conversions add a prefix before it)
    tensors = {prefix + name.split("layers.0.", 1)[1]: tensor for name, tensor in named.items()}
    # the MTP module's own tensors (enorm, hnorm, eh_proj, post_norm), under the names heads/checkpoint_mtp.py reads
    names = QWEN_MTP_NAMES if under_mtp else {prefix + theirs: ours for theirs, ours in AFTER_LAYERS_NAMES.items()}
    own = heads.layer.state_dict()
    tensors.update({theirs: own[ours].detach() for theirs, ours in names.items() if ours in own})
    return tensors


def export_mtp_into_target(
    heads_or_path: DraftHeads | str | os.PathLike, out_dir: str | os.PathLike, target: str | os.PathLike | None = None
) -> Path:
    """Write a copy of the target's model folder whose first MTP layer is these heads' (see the module docstring).

    Args:
        heads_or_path: MTP heads (`head_type="mtp"`), or their checkpoint folder / Hub id.
        out_dir: the folder to write (created; must not be the target's own folder).
        target: the target's model folder; default: the one the heads were built for (`target_name_or_path`).

    Raises:
        ValueError: heads of another type, a folder without safetensors weights, a target whose MTP layers are
            neither `model.layers.N.*` nor `mtp.*`, names the target's checkpoint lacks, an FP8 (or other non-float)
            checkpoint, or `out_dir` = the target's folder.
        FileNotFoundError: the target folder is missing.
    """
    from specheads.heads.loading import load_heads

    heads = heads_or_path if isinstance(heads_or_path, DraftHeads) else load_heads(heads_or_path)
    if not isinstance(heads, MtpHeads):
        raise ValueError(f"export --format mtp writes an MTP layer into its target; these heads are "
                         f"head_type={heads.config.head_type!r}, expected 'mtp' (trained with head.type=mtp)")
    source = Path(target if target is not None else heads.config.target_name_or_path).expanduser()
    if not source.is_dir():
        raise FileNotFoundError(f"target folder {str(source)!r} does not exist: pass the target's model folder "
                                "(--target; a Hub id's snapshot folder)")
    out = Path(out_dir).expanduser()
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the target's own folder; write the copy elsewhere")
    layers = AutoConfig.from_pretrained(source).get_text_config().num_hidden_layers
    files = checkpoint_weight_map(str(source))
    under_mtp = any(name.startswith(BLOCK_PREFIX) for name in files)  # Qwen3-Next / Qwen3.5 / Mellum
    tensors = mtp_checkpoint_tensors(heads, layers, under_mtp)
    prefix = BLOCK_PREFIX if under_mtp else f"model.layers.{layers}."
    if not any(name.startswith(prefix) for name in files):
        raise ValueError(f"{source} holds no {prefix}* (nor {BLOCK_PREFIX}*) tensors: export --format mtp supports "
                         "targets whose MTP layers follow their decoder layers (DeepSeek-V3, GLM-4.5) or sit under "
                         "mtp.* (Qwen3-Next, Qwen3.5, Mellum); this one keeps them elsewhere")
    unknown = sorted(set(tensors) - set(files))
    if unknown:
        raise ValueError(f"{source}'s checkpoint has no {unknown[:4]} ({len(unknown)} names the heads' layer would "
                         "write): these heads were not made from this target's MTP layer")
    out.mkdir(parents=True, exist_ok=True)
    rewritten = sorted({files[name] for name in tensors})
    for file_name in rewritten:
        replace_tensors(source / file_name, out / file_name, {n: t for n, t in tensors.items() if files[n] == file_name})
    for entry in source.iterdir():
        if entry.name not in rewritten and not (out / entry.name).exists():
            (out / entry.name).symlink_to(entry.resolve())
    return out


def replace_tensors(source: Path, destination: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the safetensors file `source` to `destination` with `tensors` in place of its tensors of those names, each
    cast to the dtype it replaces (same shape required).

    Raises:
        ValueError: a tensor of another shape, or a replaced tensor that is not floating point (FP8 / quantized).
    """
    with safe_open(str(source), framework="pt") as f:
        metadata: dict[str, Any] = f.metadata() or {}
        kept = {name: f.get_tensor(name) for name in f.keys()}
    for name, tensor in tensors.items():
        old = kept[name]
        if not old.is_floating_point() or old.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{source.name}: {name} is {old.dtype}: a quantized checkpoint; export into a bf16 copy of "
                             "the model (the MTP layer would need quantizing with its scales)")
        if tuple(old.shape) != tuple(tensor.shape):
            raise ValueError(f"{source.name}: {name} has shape {tuple(old.shape)}, the heads' {tuple(tensor.shape)}")
        kept[name] = tensor.to(old.dtype).contiguous()
    save_file(kept, str(destination), metadata=metadata)
