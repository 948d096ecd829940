"""Import and export draft heads in other projects' checkpoint formats (specheads is the hub between them).

Formats (one module each, registered in `FORMAT_MODULES`, one line per format):

- ``medusa``      FasterDecoding/Medusa: ``medusa_lm_head.safetensors`` (or pickled ``medusa_lm_head.pt``),
                  see `specheads.heads.format_medusa`.
- ``eagle``       SafeAILab/EAGLE 1/2: LlamaConfig-style config.json + ``model.safetensors`` (or pickled
                  ``pytorch_model.bin``) with ``fc.*`` and ``layers.0.*``, see `specheads.heads.format_eagle`.
- ``speculators`` vllm-project/speculators, algorithms ``eagle`` (``EagleSpeculator``) and ``eagle3``: served by
                  vLLM, see `specheads.heads.format_speculators`.
- ``eagle3``      SafeAILab/EAGLE-3: ``LlamaForCausalLMEagle3`` config.json + ``fc``, ``midlayer.*``, ``norm``,
                  ``lm_head``, ``d2t`` (offsets), ``t2d``, see `specheads.heads.format_eagle3`.
- ``eagle3-sglang`` the same tensors under ``layers.0.*`` (SGLang's layer naming), see
                  `specheads.heads.format_eagle3_sglang`.
- ``dflash``      z-lab/dflash block drafters (``DFlashDraftModel``, ``dflash_config``), see
                  `specheads.heads.format_dflash`.

A format module is a plain module with:

- ``HEAD_TYPES``: the specheads head types it holds (``("medusa",)``, ``("eagle",)``, ...);
- ``WEIGHTS_FILE``: the safetensors file name it exports;
- ``foreign_name(name, config) -> str``: the format's name for a specheads tensor name (export renames with it;
  import checks every expected tensor through it, so a missing or unknown tensor is named as the file names it);
- ``foreign_config(config) -> dict``: the format's config.json for a `HeadsConfig`;
- ``read(folder, allow_pickle) -> ForeignHeads``: the HeadsConfig fields and tensors found in a folder;
- optionally ``convert_for_export(tensors, config)``: change exported values in place (EAGLE-3 formats store
  ``d2t`` as offsets, specheads as target ids; their ``read`` converts back).

Everything that does not depend on the format lives here: detection, the pickle policy, resolving the target
whose shape the imported heads must match, the tensor-by-tensor checks, and writing the results.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from specheads.heads import HEAD_CLASSES
from specheads.heads.base import DraftHeads, check_heads_match_target
from specheads.heads.config import HeadsConfig
from specheads.heads.eagle3 import Eagle3Heads, default_eagle3_feature_layers
from specheads.heads.loading import load_heads
from specheads.heads.target_rows_vocab import TargetRowsDraftVocab

logger = logging.getLogger(__name__)

# One explicit registration line per format (module path, imported on first use).
FORMAT_MODULES: dict[str, str] = {
    "medusa": "specheads.heads.format_medusa",
    "eagle": "specheads.heads.format_eagle",
    "speculators": "specheads.heads.format_speculators",
    "eagle3": "specheads.heads.format_eagle3",
    "eagle3-sglang": "specheads.heads.format_eagle3_sglang",
    "dflash": "specheads.heads.format_dflash",
}
FORMATS: tuple[str, ...] = tuple(FORMAT_MODULES)
NATIVE_FORMAT = "specheads"  # what `detect_format` calls a folder written by `save_pretrained`

PICKLE_SUFFIXES = (".pt", ".bin", ".pth")


@dataclass
class ForeignHeads:
    """What a format's `read` returns.

    Attributes:
        fields: `HeadsConfig` fields the folder determines (sizes, layer config, ...); target fields come later.
        tensors: the folder's tensors under the format's own names (already without ignored extras such as a
            copy of the target's embedding).
        source: the weights file they came from (for error messages).
        target_hint: the target the folder says it was trained for ("" if it does not say).
        head_type: the specheads head type the folder holds ("": the format module's only one).
    """

    fields: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    source: Path
    target_hint: str = ""
    head_type: str = ""


def format_module(name: str) -> ModuleType:
    """The module implementing format `name`; a ValueError for unknown names."""
    if name not in FORMAT_MODULES:
        raise ValueError(f"unknown checkpoint format {name!r}; expected one of {FORMATS}")
    return importlib.import_module(FORMAT_MODULES[name])


# --- files --------------------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict (FileNotFoundError / ValueError naming the file)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def require_field(config: dict[str, Any], name: str, kind: type, where: str) -> Any:
    """config[name], checked to be of `kind`; a ValueError naming the field otherwise."""
    value = config.get(name)
    if value is None:
        raise ValueError(f"{where}: missing field {name!r}")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: field {name}={value!r} should be a {kind.__name__}")
    return value


def read_tensors(folder: Path, candidates: tuple[str, ...], allow_pickle: bool) -> tuple[dict[str, torch.Tensor], Path]:
    """Load the first existing file of `candidates` (safetensors preferred; pickles only if allowed).

    Pickled files (.pt/.bin/.pth) can run code when unpickled: they are refused unless `allow_pickle`, and then
    read with `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers.
    """
    for name in candidates:
        path = folder / name
        if not path.is_file():
            continue
        if path.suffix in PICKLE_SUFFIXES:
            return _read_pickle(path, allow_pickle), path
        try:
            return load_file(str(path), device="cpu"), path
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ValueError(f"{path} is corrupt or not a safetensors file: {err}") from err
    raise FileNotFoundError(f"{folder} has none of the weight files {list(candidates)}")


def _read_pickle(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    if not allow_pickle:
        raise ValueError(
            f"{path} is a pickled checkpoint, and unpickling can run arbitrary code; it is refused by default. "
            "If you trust it, pass --allow-pickle (allow_pickle=True): it is then read with "
            "torch.load(weights_only=True)"
        )
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, ... for bad or unsafe files
        raise ValueError(f"{path} could not be read with torch.load(weights_only=True): {err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a flat state dict (name -> tensor)")
    return state


def tensor_names(path: Path) -> set[str]:
    """Tensor names of a safetensors file without loading it; empty when there is no such file (a ValueError naming
    the file when it is unreadable: a truncated download must not pass for a folder of unknown format)."""
    if not path.is_file():
        return set()
    try:
        with safe_open(str(path), framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{path} is corrupt or not a safetensors file: {err}") from err


# --- detection ----------------------------------------------------------------------------------------------
def detect_format(folder: str | os.PathLike) -> str:
    """Name the checkpoint format of a folder: one of `FORMATS`, or "specheads" for our own checkpoints.

    Rules, first match wins: ``head_type`` in config.json -> specheads; ``speculators_model_type`` ->
    speculators; ``medusa_num_heads`` or a ``medusa_lm_head.*`` file -> medusa; ``dflash_config`` or a ``DFlash*``
    architecture -> dflash; an EAGLE-3 folder (architecture
    ``LlamaForCausalLMEagle3``, ``draft_vocab_size``, or ``d2t``/``t2d``/``midlayer.*`` tensors) -> eagle3-sglang
    when its layer tensors are ``layers.0.*``, else eagle3 (also for pickled weights, as SafeAILab releases ship);
    ``fc.weight`` + ``layers.0.*`` tensors, or a one-layer LlamaConfig-style config with pickled weights -> eagle.

    Raises:
        FileNotFoundError: the folder or its config.json is missing.
        ValueError: the folder matches no known format.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    medusa_files = list(folder.glob("medusa_lm_head.*"))
    try:
        config = read_config(folder)
    except FileNotFoundError:
        if medusa_files:
            return "medusa"
        raise
    if "head_type" in config and "format_version" in config:
        return NATIVE_FORMAT
    if "speculators_model_type" in config:
        return "speculators"
    if "medusa_num_heads" in config or medusa_files:
        return "medusa"
    if "dflash_config" in config or any(str(a).startswith("DFlash") for a in config.get("architectures") or []):
        return "dflash"
    names = tensor_names(folder / "model.safetensors")
    eagle3_arch = "LlamaForCausalLMEagle3" in (config.get("architectures") or [])
    if eagle3_arch or "draft_vocab_size" in config or {"d2t", "t2d"} & names:
        midlayer = any(n.startswith("midlayer.") for n in names)
        return "eagle3-sglang" if not midlayer and any(n.startswith("layers.0.") for n in names) else "eagle3"
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    if not names and (folder / "pytorch_model.bin").is_file() and config.get("num_hidden_layers") == 1:
        return "eagle"
    raise ValueError(
        f"{folder}: cannot tell the checkpoint format (config keys {sorted(config)[:12]}, tensors "
        f"{sorted(names)[:6]}); pass the format explicitly, one of {FORMATS}"
    )


# --- export -------------------------------------------------------------------------------------------------
def export_heads(heads_or_path: DraftHeads | str | os.PathLike, format: str, out_dir: str | os.PathLike) -> Path:
    """Write heads as a checkpoint folder of another project (config.json + safetensors weights).

    Args:
        heads_or_path: loaded heads, or a specheads checkpoint folder / Hub id.
        format: one of `FORMATS` ("medusa", "eagle", "speculators", "eagle3", "eagle3-sglang", "dflash").
        out_dir: the folder to write (created if needed; files of the same names are overwritten).

    Returns:
        The output folder.

    Raises:
        ValueError: unknown format, or heads of a type (or variant) the format cannot hold.
    """
    module = format_module(format)
    heads = heads_or_path if isinstance(heads_or_path, DraftHeads) else load_heads(heads_or_path)
    config = heads.config
    if config.head_type not in module.HEAD_TYPES:
        raise ValueError(
            f"format {format!r} holds {' or '.join(module.HEAD_TYPES)} heads but these heads are "
            f"head_type={config.head_type!r}"
        )
    if getattr(config, "parallel_depth", 0):
        raise ValueError(
            f"these EAGLE-3 heads draft in parallel (parallel_depth={config.parallel_depth}, P-EAGLE): format "
            f"{format!r} holds autoregressive heads only, which would run their untrained deeper steps; use them "
            "with specheads (SpeculativeLM, serve)"
        )
    foreign_config = module.foreign_config(config)  # raises for variants the format cannot express
    # An EAGLE or DFlash head's draft vocabulary (d2t, `eagle_draft_vocab_size`) is a specheads drafting option over
    # unchanged weights: the other formats draft over the whole vocabulary, so it is left out.
    dropped = {"d2t"} if isinstance(heads, TargetRowsDraftVocab) else set()
    tensors = {
        module.foreign_name(name, config): tensor.detach().to("cpu").contiguous().clone()
        for name, tensor in heads.state_dict().items()
        if name not in dropped
    }
    if dropped & set(heads.state_dict()):
        logger.warning("export: the %s heads' %d-token draft vocabulary is not exported (%s drafts over the whole "
                       "vocabulary)", config.head_type, config.eagle_draft_vocab_size, format)
    convert = getattr(module, "convert_for_export", None)  # optional: value changes (EAGLE-3 d2t offsets)
    if convert is not None:
        convert(tensors, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(foreign_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / module.WEIGHTS_FILE), metadata={"format": "pt"})
    logger.info("exported %s heads as %s to %s (%d tensors)", config.head_type, format, out, len(tensors))
    return out


# --- import -------------------------------------------------------------------------------------------------
def import_heads(
    src: str | os.PathLike,
    format: str | None = None,
    target: PreTrainedModel | PretrainedConfig | str | os.PathLike | None = None,
    out_dir: str | os.PathLike | None = None,
    allow_pickle: bool = False,
) -> DraftHeads:
    """Read another project's checkpoint folder as specheads heads (and save them as a specheads checkpoint).

    Args:
        src: the foreign checkpoint folder.
        format: one of `FORMATS`, "specheads", or None to detect it (`detect_format`).
        target: the target the heads draft for: a loaded model (the heads come back attached to it), its config,
            or a path / Hub id / alias ("stories260K") whose config is read (weights are not loaded). None: use
            the target the folder records (Medusa ``base_model_name_or_path``, speculators verifier).
        out_dir: where to write the specheads checkpoint (`save_pretrained`); None keeps it in memory only.
        allow_pickle: accept pickled .pt/.bin weights (read with `torch.load(weights_only=True)`).

    Returns:
        The heads, in eval mode; attached to `target` when a model was given.

    Raises:
        ValueError: unknown or unavailable format, a pickle without `allow_pickle`, a missing / unknown / wrongly
            shaped tensor (named as in the file), or a field that does not match the target (named).
    """
    folder = Path(src)
    fmt = format or detect_format(folder)
    if fmt == NATIVE_FORMAT:
        return _import_native(folder, target, out_dir)
    module = format_module(fmt)
    foreign = module.read(folder, allow_pickle)
    target_model, target_config, target_name = resolve_target(target, foreign.target_hint, folder)
    head_type = foreign.head_type or module.HEAD_TYPES[0]
    fields = target_fields(target_config, target_name, head_type)
    fields.update(head_type=head_type, **foreign.fields)
    config = HeadsConfig(**fields)
    check_heads_match_target(config, target_config)
    heads = HEAD_CLASSES[config.head_type](config)
    load_foreign_tensors(heads, foreign, module.foreign_name)
    if isinstance(heads, Eagle3Heads):
        heads.check_draft_vocab_buffers(str(foreign.source))
    heads.eval()
    if out_dir is None:
        if target_model is not None:
            heads.to(device=target_model.device, dtype=target_model.dtype)
            heads.attach_target(target_model)
        return heads
    heads.save_pretrained(out_dir)
    logger.info("imported %s checkpoint %s as %s heads into %s", fmt, folder, config.head_type, out_dir)
    return load_heads(out_dir, target=target_model)  # re-read: proves the written checkpoint loads


def _import_native(folder: Path, target: Any, out_dir: str | os.PathLike | None) -> DraftHeads:
    """A specheads checkpoint: load (checked against the target when it is a model) and copy."""
    target_model = target if isinstance(target, PreTrainedModel) else None
    heads = load_heads(folder, target=target_model)
    if target is not None and target_model is None:
        _, target_config, _ = resolve_target(target, "", folder)
        check_heads_match_target(heads.config, target_config)
    if out_dir is not None:
        heads.save_pretrained(out_dir)
    return heads


def resolve_target(
    target: PreTrainedModel | PretrainedConfig | str | os.PathLike | None, hint: str, folder: Path
) -> tuple[PreTrainedModel | None, PretrainedConfig, str]:
    """(model or None, the target's config, the name to record) from whatever identifies the target."""
    if isinstance(target, PreTrainedModel):
        return target, target.config, str(target.config.get_text_config().name_or_path or "")
    if isinstance(target, PretrainedConfig):
        return None, target, str(target.name_or_path or "")
    name = str(target) if target is not None else hint
    if not name:
        raise ValueError(f"{folder} does not record its target model; pass target= (CLI: --target)")
    from specheads.targets import resolve_target_path

    try:
        config = AutoConfig.from_pretrained(resolve_target_path(name))
    except (OSError, ValueError) as err:
        origin = "the target" if target is not None else f"the target recorded in {folder}"
        raise ValueError(f"cannot read the config of {origin}, {name!r}: {err}; pass target= (CLI: --target)") from err
    return None, config, name


def target_fields(target_config: PretrainedConfig, name: str, head_type: str = "eagle") -> dict[str, Any]:
    """The `HeadsConfig` fields that describe the target (as `create_heads` fills them for `head_type`)."""
    text_config = target_config.get_text_config()
    layers = text_config.num_hidden_layers
    return dict(
        target_name_or_path=name,
        target_architectures=list(getattr(target_config, "architectures", None) or []),
        target_model_type=text_config.model_type,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        # the final, post-norm hidden state; EAGLE-3: its three default taps (a folder may record others)
        feature_layers=default_eagle3_feature_layers(layers) if head_type == "eagle3" else [layers],
    )


def load_foreign_tensors(heads: DraftHeads, foreign: ForeignHeads, foreign_name: Any) -> None:
    """Load `foreign.tensors` into `heads`, every tensor checked by its foreign name.

    Raises:
        ValueError: a tensor the heads need is missing, the file holds a tensor the heads have no place for,
            or a tensor has the wrong shape; each names the tensor as the file does.
    """
    expected = {foreign_name(name, heads.config): name for name in heads.state_dict()}
    where = f"{foreign.source} ({heads.config.head_type} heads, hidden_size={heads.config.hidden_size})"
    missing = [name for name in expected if name not in foreign.tensors]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r}" + (f" (and {missing[1:]})" if missing[1:] else ""))
    unknown = sorted(name for name in foreign.tensors if name not in expected)
    if unknown:
        raise ValueError(f"{where}: unknown tensor {unknown[0]!r}" + (f" (and {unknown[1:]})" if unknown[1:] else ""))
    own = heads.state_dict()
    state = {}
    for theirs, ours in expected.items():
        tensor = foreign.tensors[theirs]
        if tuple(tensor.shape) != tuple(own[ours].shape):
            raise ValueError(
                f"{where}: tensor {theirs!r} has shape {tuple(tensor.shape)}, expected {tuple(own[ours].shape)}"
            )
        state[ours] = tensor
    dtype = next((t.dtype for t in state.values() if t.dtype.is_floating_point), None)
    if dtype is not None:
        heads.to(dtype)  # keep the checkpoint's precision (e.g. fp16 stays fp16 when saved)
    heads.load_state_dict(state, strict=True)
