"""Build fresh heads for a target (`create_heads`) and load saved ones safely (`load_heads`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel

from specheads.heads import HEAD_CLASSES, HEAD_TYPES
from specheads.heads.base import DraftHeads, target_embedding_sample
from specheads.heads.config import FIELD_HELP, MTP_HEAD_TYPE, HeadsConfig
from specheads.heads.dflash import (
    DEFAULT_BLOCK_SIZE,
    default_dflash_feature_layers,
    default_trees,
    dflash_layer_config,
)
from specheads.heads.eagle import draft_layer_config_from_target
from specheads.heads.eagle3 import default_eagle3_feature_layers, layer_config_of_width

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def create_heads(
    target: PreTrainedModel,
    head_type: str = "eagle",
    draft_layer: str = "auto",
    draft_hidden_size: int | None = None,
    **options: Any,
) -> DraftHeads:
    """Fresh, untrained heads sized for `target` and attached to it.

    Args:
        target: the frozen target, any decoder-only `AutoModelForCausalLM` (EAGLE heads own a decoder layer of its
            family when that layer has Llama's shape, else a Llama layer of its sizes: `draft_layer_config_from_target`).
        head_type: one of `HEAD_TYPES`, or "mtp": the target's own MTP layer as it ships (`MtpHeads.from_target`;
            `options` only the tree fields), for a target shipped with one.
        draft_layer: EAGLE / EAGLE-3: "auto" (the target family's decoder layer when it has Llama's shape, else a
            Llama one) or "llama" (always Llama: the layout SGLang / SpecForge EAGLE-3 exports need, e.g. for Qwen2).
        draft_hidden_size: EAGLE-3: the width of the draft's decoder layer when it should differ from the target's
            hidden size (a multiple of the layer's head_dim; heads and MLP scale with it: `layer_config_of_width`).
            The heads then embed tokens themselves and their embedding and lm_head start from the target's,
            projected (`Eagle3Heads.target_rows_at_draft_width`). None: the target's width.
        **options: any `HeadsConfig` field (e.g. `num_heads=4` for Medusa, `tree_depth=6` for EAGLE).

    Returns:
        Heads on the target's device and dtype, initialised as their architecture prescribes.
    """
    if head_type == MTP_HEAD_TYPE:  # the target's own MTP layer, as shipped (needs a target with one)
        return HEAD_CLASSES[head_type].from_target(target, **options)
    if head_type not in HEAD_TYPES:
        raise ValueError(f"unknown head_type {head_type!r}; expected one of {HEAD_TYPES} (or {MTP_HEAD_TYPE!r} for a "
                         "target shipped with an MTP layer)")
    if head_type in ("medusa", "dflash") and draft_layer != "auto":
        raise ValueError(f"draft_layer={draft_layer!r} applies to EAGLE heads; {head_type} heads "
                         f"{'own no decoder layer' if head_type == 'medusa' else 'hold Qwen3 layers for any target'}")
    if draft_hidden_size is not None and head_type != "eagle3":
        raise ValueError(f"draft_hidden_size={draft_hidden_size!r} applies to eagle3 heads; {head_type} heads "
                         f"{'own no decoder layer' if head_type == 'medusa' else 'predict the target features, at its width'}")
    text_config = target.config.get_text_config()
    fields = dict(
        head_type=head_type,
        target_name_or_path=str(text_config.name_or_path or ""),
        target_architectures=list(getattr(target.config, "architectures", None) or [type(target).__name__]),
        target_model_type=text_config.model_type,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        feature_layers=[text_config.num_hidden_layers],  # the final, post-norm hidden state
        # refuses these heads later on a same-shaped target with other weights or another tokenizer
        target_embedding_sample=target_embedding_sample(target.get_input_embeddings().weight),
    )
    if head_type in ("eagle", "eagle3"):
        fields["draft_layer_config"] = draft_layer_config_from_target(text_config, draft_layer)
        if draft_hidden_size is not None and draft_hidden_size != text_config.hidden_size:
            fields["draft_layer_config"] = layer_config_of_width(fields["draft_layer_config"], draft_hidden_size)
    if head_type == "eagle3":  # three pre-norm layers, fused by the head
        fields["feature_layers"] = default_eagle3_feature_layers(text_config.num_hidden_layers)
    if head_type == "dflash":  # a block drafter: its layers, taps, block and mask token (options may replace them)
        pad = getattr(text_config, "pad_token_id", None)
        trees = default_trees(options.get("block_size", DEFAULT_BLOCK_SIZE))
        trees["cpu_tree"] = {k: v for k, v in trees["cpu_tree"].items() if k not in options}  # a given tree wins
        fields.update(trees, block_size=DEFAULT_BLOCK_SIZE, block_mask_token=text_config.vocab_size - 1 if pad is None else pad,
                      feature_layers=default_dflash_feature_layers(text_config.num_hidden_layers, 3),
                      draft_layer_config=dflash_layer_config(text_config, options.get("num_layers", 1)))
    unknown = set(options) - set(FIELD_HELP)
    if unknown:
        raise ValueError(f"create_heads: unknown options {sorted(unknown)}; expected HeadsConfig fields")
    fields.update(options)
    config = HeadsConfig(**fields)
    if config.parallel_depth and "tree_depth" not in options:  # P-EAGLE drafts no deeper than its slots
        config.fit_trees_to_parallel_depth()
    heads = HEAD_CLASSES[head_type](config)
    heads.to(device=target.device, dtype=target.dtype)
    heads.init_from_target(target)
    heads.attach_target(target)
    return heads


def check_safetensors(path: Path) -> None:
    """Raise a ValueError naming the file if it is not a complete, readable safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                f.get_slice(name)[:]  # touches the bytes: a truncated file fails here
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{path} is corrupt or truncated (not a valid safetensors file): {err}") from err


def _resolve_folder(
    path_or_hub_id: str | os.PathLike, revision: str | None, cache_dir: str | os.PathLike | None, local_files_only: bool
) -> Path:
    """A local folder, or the snapshot folder of a Hub id (downloaded, or from the offline HF cache)."""
    local = Path(path_or_hub_id).expanduser()
    if local.is_dir():
        return local
    text = str(path_or_hub_id)
    if local.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise FileNotFoundError(f"heads checkpoint folder {text!r} does not exist (expected a folder with {CONFIG_NAME})")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                text,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                allow_patterns=["*.json", "*.safetensors", "*.md"],
            )
        )
    except Exception as err:  # hub errors are many types; name what was asked
        raise FileNotFoundError(
            f"heads {text!r} is neither a local folder nor a Hub repo that could be loaded "
            f"(offline mode: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {err}"
        ) from err


def load_heads(
    path_or_hub_id: str | os.PathLike,
    target: PreTrainedModel | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> DraftHeads:
    """Load heads saved with `save_pretrained`, from a folder or a Hub id (the offline cache works).

    Args:
        path_or_hub_id: a checkpoint folder or a Hub repo id.
        target: if given, the heads are checked against it, moved to its device/dtype and attached.
        revision: Hub revision.
        cache_dir: HF cache folder for Hub ids (default: the HF_HUB_CACHE of this process).
        local_files_only: never contact the Hub; use the cache only.

    specheads checkpoints are safetensors only (nothing is ever unpickled). A folder or repo in another project's
    format (EAGLE-1/2/3, SGLang, Medusa, vLLM speculators, z-lab DFlash: `specheads.heads.interop.detect_format`) with
    safetensors weights is converted in memory as `import_heads` converts it (checked tensor by tensor; the target is
    `target`, else the one the folder records); `specheads import` saves such a conversion, and is the way for pickled
    weights.

    Raises:
        FileNotFoundError: no such folder / repo, or it lacks config.json or model.safetensors.
        ValueError: invalid config values, corrupt weights, missing or unexpected tensors, or a target mismatch.
    """
    folder = _resolve_folder(path_or_hub_id, revision, cache_dir, local_files_only)
    config_file, weights_file = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}; is it a specheads checkpoint?")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from err
    if isinstance(raw, dict) and not is_heads_config(raw):
        return load_foreign_heads(folder, target)  # another project's checkpoint: converted in memory
    if not weights_file.is_file():
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found pickled {pickled}: specheads loads safetensors only)" if pickled else ""
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME}{hint}")
    head_type = raw.get("head_type")
    if head_type not in HEAD_CLASSES:
        raise ValueError(f"{config_file}: head_type={head_type!r} is unknown; expected one of {tuple(HEAD_CLASSES)}")
    config = HeadsConfig.from_pretrained(folder)
    check_safetensors(weights_file)
    heads, info = HEAD_CLASSES[head_type].from_pretrained(
        folder, config=config, output_loading_info=True, use_safetensors=True, ignore_mismatched_sizes=True
    )
    missing, unexpected = info.get("missing_keys") or [], info.get("unexpected_keys") or []
    if missing or unexpected:
        raise ValueError(
            f"{weights_file} does not match a {head_type} head of this config: "
            f"missing tensors {sorted(missing)}, unexpected tensors {sorted(unexpected)}"
        )
    if info.get("mismatched_keys"):
        raise ValueError(f"{weights_file}: tensors with the wrong shape: {info['mismatched_keys']}")
    heads.check_draft_vocab_buffers(str(weights_file))
    heads.eval()
    if target is not None:
        heads.to(device=target.device, dtype=target.dtype)
        heads.attach_target(target)
    return heads


def is_heads_config(raw: Any) -> bool:
    """Whether a parsed config.json is a specheads heads config (else: another project's, or a model's)."""
    return isinstance(raw, dict) and ("head_type" in raw or "format_version" in raw)


def is_specheads_checkpoint(folder: Path) -> bool:
    """Whether `folder`'s config.json is a specheads heads config (False: none, unreadable, or another project's)."""
    try:
        return is_heads_config(json.loads((folder / CONFIG_NAME).read_text()))
    except (OSError, json.JSONDecodeError):
        return False


def load_foreign_heads(folder: Path, target: PreTrainedModel | None) -> DraftHeads:
    """Heads from a folder in another project's format, converted in memory (`import_heads`), in eval mode and
    attached to `target` when given.

    Raises:
        ValueError: the folder matches no known format (naming what `load_heads` expects), or the conversion fails.
    """
    from specheads.heads.interop import FORMATS, detect_format, import_heads

    try:
        fmt = detect_format(folder)
    except ValueError as err:
        raise ValueError(f"{folder / CONFIG_NAME} has no head_type: it is neither a specheads checkpoint nor one of the "
                         f"formats {FORMATS} ({err})") from err
    logger.info("%s is a %s checkpoint: converting it in memory (`specheads import` saves the conversion)", folder, fmt)
    return import_heads(folder, format=fmt, target=target)
