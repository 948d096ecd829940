"""Target features for training: online (the frozen target runs inside the step) or offline (dumped shards).

Features are what the heads read: `heads.select_features(hidden_states)`, by default the target's final,
post-norm hidden state, so `lm_head(features)` are exactly the target's logits. Offline dumps therefore store
features only and the target logits are recomputed with the lm_head at training time. EAGLE-3 heads read
three earlier (pre-norm) layers: a dump for them (`--head-type eagle3`) stores those `tapped_layers` in front
of the final state, features.{i} = [tapped layers | final state] (T_i, (len(tapped_layers) + 1) * h).

Offline layout (`specheads data dump-features`):

    DIR/index.json             {"format": "specheads-features", "version": 1, "target", "feature_layer",
                                "tapped_layers",
                                "hidden_size", "dtype", "num_examples", "examples_per_shard", "data_sha256",
                                "shards": [{"file", "sha256", "start", "stop"}]}
    DIR/progress.json          the same, listing the shards finished so far, while a dump runs (resume point)
    DIR/shard-00000.safetensors  tensors "features.{i}" (T_i, h), "input_ids.{i}" (T_i,), "loss_mask.{i}" (T_i,)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset, Image, List
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specheads.atomic_files import staged_file, write_atomically
from specheads.heads.cache_keyword import declared_parameters
from specheads.targets import logit_transforms
from specheads.training.data import batch_to, collate
from specheads.training.image_records import collate_for, has_image_rows
from specheads.training.preflight import check_free_disk, check_writable_dir
from specheads.training.target_labels import TargetLabels, labelled_positions, labels_at

INDEX_NAME = "index.json"
PROGRESS_NAME = "progress.json"  # the finished shards of a dump still running (or killed)
FORMAT_NAME = "specheads-features"


@torch.no_grad()
def online_features(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
    row_inputs: list[dict[str, torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the frozen target (eval mode, no gradients) on a batch.

    Args:
        target: the frozen target.
        input_ids: (B, T) right-padded tokens.
        attention_mask: (B, T) 1 on real tokens.
        select: picks the features from the `hidden_states` tuple (`heads.select_features`).
        row_inputs: per row, its images' extra forward inputs or None (`ImageCollate`; `target_states`).

    Returns:
        features (B, T, h) and target logits (B, T, V).
    """
    states, logits = target_states(target, input_ids, attention_mask, row_inputs)
    return select(states), logits


@torch.no_grad()
def target_states(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row_inputs: list[dict[str, torch.Tensor] | None] | None = None,
    with_logits: bool = True,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The frozen target's hidden states (each (B, T, h)) and logits ((B, T, V), or None without `with_logits`).

    Rows with images (`row_inputs[i]` holds their pixel inputs) run one at a time, unpadded, each with its own
    inputs (every vision-language family batches images its own way); text rows run together. Padding positions
    of an image row hold zeros (the losses never read them).
    """
    if target.training:
        target.eval()
    keep = {} if with_logits else {"logits_to_keep": 1}  # 1: the losses never read the forward's logits
    image_rows = [i for i, inputs in enumerate(row_inputs or []) if inputs is not None]
    if not image_rows:
        out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                     **keep)
        return out.hidden_states, out.logits if with_logits else None
    text_rows = [i for i in range(input_ids.shape[0]) if i not in image_rows]
    states: list[torch.Tensor] | None = None
    logits = None
    dtype = next(target.parameters()).dtype

    def place(rows: list[int], out: Any, width: int) -> None:
        nonlocal states, logits
        if states is None:  # (B, T, h) per layer, zeros where a row was not run (padding)
            states = [s.new_zeros(input_ids.shape[0], input_ids.shape[1], s.shape[-1]) for s in out.hidden_states]
            if with_logits:
                logits = out.logits.new_zeros(input_ids.shape[0], input_ids.shape[1], out.logits.shape[-1])
        for layer, s in zip(states, out.hidden_states):
            layer[rows, :width] = s
        if with_logits:
            logits[rows, :width] = out.logits

    if text_rows:
        out = target(input_ids=input_ids[text_rows], attention_mask=attention_mask[text_rows],
                     output_hidden_states=True, use_cache=False, **keep)
        place(text_rows, out, input_ids.shape[1])
    for i in image_rows:
        n = int(attention_mask[i].sum())
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in row_inputs[i].items()}
        out = target(input_ids=input_ids[i: i + 1, :n], attention_mask=attention_mask[i: i + 1, :n],
                     output_hidden_states=True, use_cache=False, **inputs, **keep)
        place([i], out, n)
    return tuple(states), logits


def logits_are_lm_head_of_final_state(target: PreTrainedModel) -> bool:
    """Whether the target's config scales or caps no logits (offline features rely on it: their labels are
    lm_head(final state); otherwise they must come from the forward's own logits)."""
    return not logit_transforms(target)


def can_skip_logits(target: PreTrainedModel) -> bool:
    """Whether the target's labels can come from its final hidden state instead of its forward's logits: the
    forward takes `logits_to_keep` (transformers' causal LMs do) and its config scales or caps no logits."""
    forward_keeps = "logits_to_keep" in declared_parameters(type(target).forward)
    return forward_keeps and logits_are_lm_head_of_final_state(target)


@torch.no_grad()
def online_stored_features(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
    row_inputs: list[dict[str, torch.Tensor] | None] | None = None,
) -> torch.Tensor:
    """What a feature dump stores, computed in the step: [select(hidden states) | final post-norm state], without
    the target's (B, T, V) logits (`offline_target_labels` makes the labels from the final state where a loss
    reads them, as for dumped features). `row_inputs`: as in `online_features`.

    Returns:
        (B, T, w + h): the selected features (w wide) then the final state (h).

    Raises:
        ValueError: the target's logits cannot be skipped (`can_skip_logits`; use `online_features`).
    """
    if not can_skip_logits(target):
        raise ValueError(
            f"online_stored_features needs a target forward with logits_to_keep whose logits are lm_head(final state); "
            f"{type(target).__name__} is not one"
        )
    states, _ = target_states(target, input_ids, attention_mask, row_inputs, with_logits=False)
    return torch.cat([select(states), states[-1]], dim=-1)


@torch.no_grad()
def offline_target_labels(
    lm_head: torch.nn.Module,
    final: torch.Tensor,
    loss_mask: torch.Tensor,
    label_vocab: torch.Tensor | None = None,
    with_probs: bool = True,
    target_top1: torch.Tensor | None = None,
) -> TargetLabels:
    """The target's labels from dumped final states: `lm_head` runs only where a loss reads the target.

    Every loss reads the target's logits at position p (its prediction of x_{p+1}) only as the label of a trained
    token x_{p+1} (training/target_labels.py); prompt tokens and padding (about half of a chat batch) skip the
    (h x V) product, and no (B, T, V) tensor is made. With the target's argmax from the dump (`target_top1`) and a
    label vocabulary (EAGLE-3's draft vocabulary), only the lm_head rows of that vocabulary run (8,192 of SmolLM2's
    49,152), and none with labels="tokens".

    Args:
        lm_head: the target's output layer.
        final: (B, T, h) the dumped final, post-norm states.
        loss_mask: (B, T) 1 where predicting that token is trained.
        label_vocab, with_probs: as in `target_labels` (EAGLE-3: the heads' `d2t`).
        target_top1: (B, T) the target's argmax over its whole vocabulary, stored by the dump (dumps made before
            session 22 have none: it is then computed here).
    """
    positions = labelled_positions(loss_mask)
    rows = final[positions]  # (R, h)
    label_logits = None
    if target_top1 is not None and label_vocab is not None and isinstance(lm_head, torch.nn.Linear):
        top1, vocab_size = target_top1[positions], lm_head.out_features  # (R,): the dump's argmax
        if with_probs:  # the label vocabulary's rows of the lm_head only
            bias = None if lm_head.bias is None else lm_head.bias[label_vocab]
            label_logits = F.linear(rows, lm_head.weight[label_vocab], bias)  # (R, V')
    else:
        row_logits = lm_head(rows)  # (R, V)
        top1, vocab_size = row_logits.argmax(-1), row_logits.shape[-1]
        if with_probs:
            label_logits = row_logits if label_vocab is None else row_logits.index_select(1, label_vocab)
    return labels_at(positions, loss_mask.shape, top1, label_logits, vocab_size)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def estimate_dump_bytes(dataset: Dataset, hidden_size: int, dtype: torch.dtype, num_layers: int = 1) -> int:
    """Disk a feature dump of `dataset` needs: features (`num_layers` states per token) + token ids + masks + the
    target's argmax (safetensors headers excluded)."""
    tokens = sum(dataset["length"])
    return tokens * (num_layers * hidden_size * torch.finfo(dtype).bits // 8 + 8 + 1 + 4)


def dataset_sha256(dataset: Dataset) -> str:
    """Hex sha256 of every example's tokens and loss mask (and, in a dataset with image rows, its images' bytes): a
    resumed dump only keeps shards of the same data."""
    digest = hashlib.sha256()
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        digest.update(json.dumps([ids, mask]).encode())
    if has_image_rows(dataset):
        stored = dataset.cast_column("images", List(Image(decode=False)))["images"]  # [{"bytes", "path"}, ...] per row
        for images in stored:
            for image in images:
                digest.update(image["bytes"] if image["bytes"] is not None else Path(image["path"]).read_bytes())
    return digest.hexdigest()


def _reusable_shards(out: Path, layout: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shards of an earlier (possibly killed) dump of the same data and layout whose sha256 still checks out."""
    for name in (INDEX_NAME, PROGRESS_NAME):
        try:
            earlier = json.loads((out / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if any(earlier.get(key) != value for key, value in layout.items()):
            continue
        return {
            shard["file"]: shard
            for shard in earlier.get("shards", [])
            if (out / shard["file"]).is_file() and file_sha256(out / shard["file"]) == shard["sha256"]
        }
    return {}


def dump_features(
    target: PreTrainedModel,
    dataset: Dataset,
    out_dir: str | Path,
    feature_layer: int,
    batch_size: int = 8,
    examples_per_shard: int = 1024,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int = 0,
    show_progress: bool = True,
    tapped_layers: list[int] | None = None,
    processor: Any = None,
) -> dict[str, Any]:
    """Write the target's features of every example as safetensors shards plus an index with sha256 sums.

    `feature_layer` is the hidden state whose lm_head gives the target's logits (the final, post-norm one);
    `tapped_layers` (EAGLE-3) are hidden-state indices stored in front of it, in that order. A dataset with image
    rows (`build_dataset` with a processor) needs the target's `processor`: the target reads each row's images, so
    the stored features are those the heads read after an image at inference.

    Prints the disk it will need first and fails at once when the disk has less free. Every file is written
    to a temporary name and renamed into place; after each shard a progress file lists the finished shards
    with their sha256, so a killed dump, run again with the same arguments, keeps the intact shards and
    writes only the rest. The index is written last: a folder with index.json is a complete dump.

    Returns:
        The index (also written to out_dir/index.json).

    Raises:
        OSError: out_dir is not writable or its disk has less free space than the dump needs.
    """
    out = check_writable_dir(out_dir, "feature dump folder")
    if has_image_rows(dataset) and processor is None:
        raise ValueError("the dataset holds rows with images: dump_features needs the target's processor to read them")
    make_batch = collate_for(dataset, processor)
    hidden = target.config.get_text_config().hidden_size
    tapped_layers = list(tapped_layers or [])
    stored_layers = [*tapped_layers, feature_layer]  # concatenated along the feature dimension
    need = estimate_dump_bytes(dataset, hidden, dtype, len(stored_layers))
    free = shutil.disk_usage(out).free
    print(f"[specheads] feature dump of {len(dataset)} examples needs about {need / 2**20:.1f} MiB "
          f"({free / 2**30:.1f} GiB free in {out})")
    check_free_disk(out, need, "the feature dump")
    layout = {
        "format": FORMAT_NAME,
        "version": 1,
        "target": str(target.config.name_or_path),
        "feature_layer": feature_layer,
        "tapped_layers": tapped_layers,
        "hidden_size": hidden,
        "dtype": str(dtype).replace("torch.", ""),
        "num_examples": len(dataset),
        "examples_per_shard": examples_per_shard,
        "data_sha256": dataset_sha256(dataset),
        "stores_target_top1": True,  # target_top1.{i}: the target's argmax at every token (session 22)
    }
    reusable = _reusable_shards(out, layout)
    starts = range(0, len(dataset), examples_per_shard)
    if reusable:
        print(f"[specheads] resuming: {len(reusable)} of {len(starts)} shards already written and verified")
    shards: list[dict[str, Any]] = []
    bar = tqdm(total=len(dataset), desc="dump features", disable=not show_progress)
    for shard_no, start in enumerate(starts):
        stop = min(start + examples_per_shard, len(dataset))
        name = f"shard-{shard_no:05d}.safetensors"
        done = reusable.get(name)
        if done is not None and (done["start"], done["stop"]) == (start, stop):
            shards.append(done)
            bar.update(stop - start)
            continue
        tensors: dict[str, torch.Tensor] = {}
        for b in range(start, stop, batch_size):
            rows = [dataset[i] for i in range(b, min(b + batch_size, stop))]
            batch = batch_to(make_batch(rows, pad_token_id), target.device)
            feats, logits = online_features(
                target, batch["input_ids"], batch["attention_mask"],
                lambda states: torch.cat([states[k] for k in stored_layers], dim=-1), batch.get("row_inputs"),
            )
            top1 = logits.argmax(-1)  # (B, T): the exact labels of greedy acceptance, whatever `dtype` rounds away
            for j, row in enumerate(rows):
                n, i = len(row["input_ids"]), b + j
                tensors[f"features.{i}"] = feats[j, :n].to("cpu", dtype).contiguous()
                tensors[f"target_top1.{i}"] = top1[j, :n].to("cpu", torch.int32).contiguous()
                tensors[f"input_ids.{i}"] = torch.as_tensor(row["input_ids"], dtype=torch.long)
                tensors[f"loss_mask.{i}"] = torch.as_tensor(row["loss_mask"], dtype=torch.uint8)
            bar.update(len(rows))
        with staged_file(out / name) as staged:
            save_file(tensors, str(staged))
        shards.append({"file": name, "sha256": file_sha256(out / name), "start": start, "stop": stop})
        write_atomically(out / PROGRESS_NAME, json.dumps({**layout, "shards": shards}, indent=2))
    bar.close()
    index = {**layout, "shards": shards}
    write_atomically(out / INDEX_NAME, json.dumps(index, indent=2))
    (out / PROGRESS_NAME).unlink(missing_ok=True)
    return index


class OfflineFeatures:
    """Reads a feature dump lazily: a shard is opened (and its sha256 checked) the first time it is needed."""

    def __init__(self, folder: str | Path, verify: bool = True) -> None:
        self.folder = Path(folder)
        index_file = self.folder / INDEX_NAME
        if not index_file.is_file():
            raise FileNotFoundError(f"{self.folder} has no {INDEX_NAME}; write one with `specheads data dump-features`")
        try:
            self.index = json.loads(index_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{index_file} is not valid JSON ({err}); dump the features again") from err
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT_NAME:
            found = self.index.get("format") if isinstance(self.index, dict) else type(self.index).__name__
            raise ValueError(f"{index_file} is not a specheads feature index (format={found!r})")
        self.verify = verify
        self._open: dict[str, Any] = {}
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return int(self.index["num_examples"])

    def _shard_of(self, i: int) -> dict[str, Any]:
        for shard in self.index["shards"]:
            if shard["start"] <= i < shard["stop"]:
                return shard
        raise IndexError(f"example {i} is outside the feature dump ({len(self)} examples)")

    def _handle(self, shard: dict[str, Any]) -> Any:
        name = shard["file"]
        if name not in self._open:
            path = self.folder / name
            if self.verify and file_sha256(path) != shard["sha256"]:
                raise ValueError(f"{path} does not match the sha256 in {INDEX_NAME}: the shard is corrupt or was changed")
            self._open[name] = safe_open(str(path), framework="pt")
        return self._open[name]

    def __getitem__(self, i: int) -> dict[str, Any]:
        f = self._handle(self._shard_of(i))
        example = {
            "features": f.get_tensor(f"features.{i}"),  # (T_i, (len(tapped_layers) + 1) * h)
            "input_ids": f.get_tensor(f"input_ids.{i}").tolist(),
            "loss_mask": f.get_tensor(f"loss_mask.{i}").long().tolist(),
        }
        if self.index.get("stores_target_top1"):
            example["target_top1"] = f.get_tensor(f"target_top1.{i}").long()  # (T_i,)
        return example

    @property
    def tapped_layers(self) -> list[int]:
        """Hidden-state indices stored in front of the final state (EAGLE-3 dumps; [] otherwise)."""
        return list(self.index.get("tapped_layers") or [])

    def token_columns(self) -> tuple[list[list[int]], list[list[int]]]:
        """input_ids and loss_mask of every example, without reading the features."""
        ids: list[list[int]] = []
        masks: list[list[int]] = []
        for shard in self.index["shards"]:
            f = self._handle(shard)
            for i in range(shard["start"], shard["stop"]):
                ids.append(f.get_tensor(f"input_ids.{i}").tolist())
                masks.append(f.get_tensor(f"loss_mask.{i}").long().tolist())
        return ids, masks

    def lengths(self) -> list[int]:
        """Token count of every example (reads only tensor headers)."""
        if self._lengths is None:
            self._lengths = []
            for shard in self.index["shards"]:
                f = self._handle(shard)
                self._lengths += [f.get_slice(f"input_ids.{i}").get_shape()[0] for i in range(shard["start"], shard["stop"])]
        return self._lengths


def collate_offline(rows: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Like `collate`, plus right-padded features (B, T, h) and, from dumps that store it, the target's argmax
    `target_top1` (B, T) (0 on padding)."""
    batch = collate(rows, pad_token_id)
    width, hidden = batch["input_ids"].shape[1], rows[0]["features"].shape[-1]
    feats = torch.zeros(len(rows), width, hidden, dtype=rows[0]["features"].dtype)
    for i, r in enumerate(rows):
        feats[i, : r["features"].shape[0]] = r["features"]
    batch["features"] = feats
    if all("target_top1" in r for r in rows):
        top1 = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            top1[i, : r["target_top1"].shape[0]] = r["target_top1"]
        batch["target_top1"] = top1
    return batch
