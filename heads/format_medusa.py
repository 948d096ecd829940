"""The original Medusa checkpoint format (FasterDecoding/Medusa) <-> specheads Medusa heads.

Layout, as Medusa's `MedusaModel` saves and loads it:

- ``config.json``: ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path`` (Medusa-2 folders also
  carry the base model's own fields; ``hidden_size`` / ``vocab_size`` are used when present, else read from the
  tensors, else taken from the target).
- ``medusa_lm_head.safetensors`` (older releases: pickled ``medusa_lm_head.pt``): the ``medusa_head`` ModuleList's
  state dict, keys ``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` for the residual blocks ``j <
  medusa_num_layers`` and ``{i}.{medusa_num_layers}.weight`` for head i's (V, h) vocabulary projection. Some
  checkpoints prefix every key with ``medusa_head.``; both spellings are accepted, and exports use the bare one.

The math is identical: Medusa's ``ResBlock`` is ``x + SiLU(Linear(x))`` and its projection has no bias, as ours.
(Medusa builds a head as ``[ResBlock(h)] * medusa_num_layers``, which shares one block; its state dict still
lists every index, so each index is read as its own block here.)

Export also writes ``hidden_size`` and ``vocab_size`` (extra keys that Medusa's PretrainedConfig keeps as
attributes) so the folder is self-describing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specheads.heads.config import HeadsConfig
from specheads.heads.interop import ForeignHeads, read_config, read_tensors, require_field

HEAD_TYPES = ("medusa",)
WEIGHTS_FILE = "medusa_lm_head.safetensors"
WEIGHT_CANDIDATES = (WEIGHTS_FILE, "medusa_lm_head.pt")  # safetensors first; the pickle only if allowed
KEY_PREFIX = "medusa_head."  # written by some Medusa versions in front of every key


def foreign_name(name: str, config: HeadsConfig) -> str:
    """Medusa's name of a specheads tensor: ``heads.{i}.{j}.linear.weight`` -> ``{i}.{j}.linear.weight``."""
    return name.removeprefix("heads.")


def foreign_config(config: HeadsConfig) -> dict[str, Any]:
    """Medusa's config.json for these heads."""
    return {
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        "base_model_name_or_path": config.target_name_or_path,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


def read(folder: Path, allow_pickle: bool) -> ForeignHeads:
    """The HeadsConfig fields and tensors of a Medusa folder.

    Raises:
        ValueError: a missing or invalid ``medusa_num_heads`` / ``medusa_num_layers``, sizes that disagree with the
            tensors, or a pickle without `allow_pickle`.
    """
    config = read_config(folder)
    where = str(folder / "config.json")
    num_heads = require_field(config, "medusa_num_heads", int, where)
    num_layers = require_field(config, "medusa_num_layers", int, where)
    tensors, source = read_tensors(folder, WEIGHT_CANDIDATES, allow_pickle)
    tensors = {name.removeprefix(KEY_PREFIX): tensor for name, tensor in tensors.items()}
    fields: dict[str, Any] = {"num_heads": num_heads, "num_layers": num_layers}
    projection = tensors.get(f"0.{num_layers}.weight")  # (V, h): head 0's vocabulary projection
    for name, axis in (("vocab_size", 0), ("hidden_size", 1)):
        value = config.get(name)
        if projection is not None and projection.dim() == 2:
            found = int(projection.shape[axis])
            if value is not None and value != found:
                raise ValueError(
                    f"{where}: {name}={value} but tensor '0.{num_layers}.weight' in {source} has shape "
                    f"{tuple(projection.shape)}"
                )
            value = found
        if value is not None:
            fields[name] = value
    return ForeignHeads(fields, tensors, source, target_hint=str(config.get("base_model_name_or_path") or ""))
