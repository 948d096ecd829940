"""`DraftHeads`: the PreTrainedModel base every head type shares (target binding, features, checks, model card)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from specheads.heads.adapter import check_target_adapter
from specheads.heads.config import HeadsConfig


@dataclass
class TargetParts:
    """Modules borrowed from the target at run time; never saved with the heads (a plain attribute, not a submodule)."""

    embed_tokens: nn.Module  # (V, h) input embedding
    lm_head: nn.Module  # h -> V output projection (reads post-norm features)


EMBEDDING_SAMPLE_SIZE = 16


def embedding_sample_positions(vocab_size: int, hidden_size: int) -> tuple[list[int], list[int]]:
    """The fixed (row, col) positions of `target_embedding_sample`, spread over a (V, h) matrix.

    Rows run evenly from the first to the last token; columns step across the width (wrapping), so the
    sample sits in neither one row nor one column. A pure function of the shape: every process picks the
    same positions.
    """
    n = EMBEDDING_SAMPLE_SIZE
    rows = [(i * (vocab_size - 1)) // (n - 1) for i in range(n)]
    cols = [(i * (hidden_size // n + 1) + i // 2) % hidden_size for i in range(n)]
    return rows, cols


def target_embedding_sample(embedding_weight: torch.Tensor) -> list[float]:
    """`EMBEDDING_SAMPLE_SIZE` values of a (V, h) input embedding at fixed positions, as Python floats.

    Returns an empty list (unknown) when the weights are not materialised (meta device, e.g. offloaded).
    """
    if embedding_weight.is_meta or embedding_weight.dim() != 2:
        return []
    rows, cols = embedding_sample_positions(*embedding_weight.shape)
    with torch.no_grad():
        values = embedding_weight[torch.tensor(rows, device=embedding_weight.device),
                                  torch.tensor(cols, device=embedding_weight.device)]
    return [float(v) for v in values.float().cpu().tolist()]


def check_heads_match_target(
    config: HeadsConfig, target_config: PretrainedConfig, target_embedding: torch.Tensor | None = None
) -> None:
    """Raise a ValueError when heads were built for a target of another shape (or other weights).

    Args:
        config: the heads' config.
        target_config: the target's config (hidden size, vocabulary, layers, family are compared).
        target_embedding: the target's (V, h) input embedding weight; when given and the heads recorded
            `target_embedding_sample`, the sampled values must agree (a same-shaped target with another
            tokenizer or other weights is refused). The tolerance survives bf16/fp16 copies of one target.
    """
    target_config = target_config.get_text_config()
    expected = {
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
    }
    for field, target_value in expected.items():
        if getattr(config, field) != target_value:
            raise ValueError(
                f"heads and target do not match: heads {field}={getattr(config, field)} but target "
                f"{target_config.name_or_path or target_config.model_type!r} has {field}={target_value}; "
                f"these heads were built for {config.target_name_or_path!r}"
            )
    num_states = target_config.num_hidden_layers + 1
    bad = [i for i in config.feature_layers if i >= num_states]
    if bad:
        raise ValueError(
            f"heads read feature_layers={config.feature_layers} but the target has only {num_states} hidden states "
            f"(num_hidden_layers={target_config.num_hidden_layers})"
        )
    if config.head_type in ("eagle", "eagle3") and config.target_model_type != target_config.model_type:
        raise ValueError(
            f"heads and target do not match: these EAGLE heads were trained on a target of "
            f"model_type={config.target_model_type!r} ({config.target_name_or_path!r}) but the target is "
            f"model_type={target_config.model_type!r}"
        )
    if target_embedding is not None and config.target_embedding_sample:
        recorded = torch.tensor(config.target_embedding_sample, dtype=torch.float32)
        actual = torch.tensor(target_embedding_sample(target_embedding), dtype=torch.float32)
        # an empty `actual` means the embedding is not materialised (meta): nothing to compare.
        # bf16/fp16 rounding is relative (<= 0.4%); atol stays well below LLM embedding magnitudes (~1e-2)
        same = actual.shape == recorded.shape and torch.allclose(actual, recorded, rtol=2e-2, atol=1e-3)
        if actual.numel() and not same:
            gap = f"max difference {(actual - recorded).abs().max().item():.4g}" if actual.shape == recorded.shape else (
                f"{actual.numel()} values vs {recorded.numel()} recorded")
            raise ValueError(
                f"heads and target do not match: the target's input embedding differs from the heads' "
                f"target_embedding_sample ({gap}): target "
                f"{target_config.name_or_path or target_config.model_type!r} has the same shape but other weights "
                f"or another tokenizer; these heads were built for {config.target_name_or_path!r}"
            )


class DraftHeads(PreTrainedModel):
    """Base class of all draft heads: a small trainable module reading a frozen target's hidden states.

    Subclasses implement `forward` (training and drafting). Call `attach_target(target)` before use:
    it checks the shapes and borrows the target's embedding and lm_head without storing them.
    """

    config_class = HeadsConfig
    # Linear layers (names as in `named_modules`) that stay float32 when drafting in int8
    # (`SpeculativeLM.use_int8_draft_linears`): those reading the target's raw residual-stream features, whose
    # outlier dimensions would make a per-tensor int8 input scale flatten everything else.
    float32_linears: tuple[str, ...] = ()
    # Whether the GPU fast path may draft with these heads at fixed shapes in a CUDA graph (`StaticEagleDrafter`);
    # False for a layer whose routing picks shapes from the data (an MTP layer's mixture of experts).
    static_drafting: bool = True
    config: HeadsConfig
    base_model_prefix = "heads"
    main_input_name = "features"
    _supports_sdpa = True

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        self._target_parts: TargetParts | None = None
        self.model_card_metrics: dict[str, Any] = {}

    # --- target binding -------------------------------------------------------------------------------
    def attach_target(self, target: PreTrainedModel) -> None:
        """Borrow the target's embedding and output projection (after checking that shapes match)."""
        embedding = target.get_input_embeddings()
        check_target_adapter(self.config, target)  # first: Medusa-2 heads on an un-adapted target say to load it
        check_heads_match_target(self.config, target.config, getattr(embedding, "weight", None))
        self._target_parts = TargetParts(embedding, target.get_output_embeddings())

    @property
    def target_parts(self) -> TargetParts:
        if self._target_parts is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a target: call heads.attach_target(target)")
        return self._target_parts

    @property
    def draft_vocab_size(self) -> int:
        """How many target tokens the heads can draft: the whole vocabulary unless a subclass reduces it."""
        return self.config.vocab_size

    def check_draft_vocab_buffers(self, source: str) -> None:
        """Raise a ValueError naming `source` when loaded draft-vocabulary buffers are invalid (none here)."""

    def select_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target features the heads read, from the target's `hidden_states` tuple: the one tapped layer (B, T, h),
        or the n tapped layers concatenated (B, T, n*h) (EAGLE-3, DFlash)."""
        layers = self.config.feature_layers
        return hidden_states[layers[0]] if len(layers) == 1 else torch.cat([hidden_states[i] for i in layers], dim=-1)

    @torch.no_grad()
    def copy_target_final_norm(self, norm: nn.Module, target: PreTrainedModel) -> None:
        """Start `norm` (the heads' final norm, which feeds the target's lm_head) from the target's final norm when the
        target has one of the same shape."""
        weight = getattr(getattr(getattr(target, "model", None), "norm", None), "weight", None)
        if weight is not None and weight.shape == norm.weight.shape:
            norm.weight.copy_(weight)

    def init_from_target(self, target: PreTrainedModel) -> None:
        """Initialise fresh weights from the target where the architecture does so (Medusa: lm_head copies)."""

    # --- checkpoints ------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """`PreTrainedModel.save_pretrained` (config.json + model.safetensors, head weights only) plus a model card."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        write_model_card(Path(save_directory), self.config, self.model_card_metrics)
        return result

    def _upload_modified_files(self, working_dir: str | os.PathLike, repo_id: str, *args: Any, **kwargs: Any) -> Any:
        # `push_to_hub` saves with save_pretrained, then replaces README.md with transformers' generic card
        # just before this upload step: put the specheads card (target, usage, metrics) back. The repository also
        # gets transformers' `custom_generate` entry naming it (inference/custom_generate.py), so that
        # `target.generate(..., custom_generate=repo_id, trust_remote_code=True)` decodes with these heads.
        from specheads.inference.custom_generate import write_custom_generate

        write_model_card(Path(working_dir), self.config, self.model_card_metrics, repo_id=repo_id)
        write_custom_generate(working_dir, heads_location=repo_id)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)


LOCAL_HEADS_PLACEHOLDER = "path/to/this/folder"  # where a card written by save_pretrained says the heads are


def custom_generate_usage(repo_id: str) -> str:
    """The model card's paragraph on using the repository from plain transformers (`custom_generate`)."""
    return f"""
With transformers alone (specheads installed), this repository's `custom_generate` runs the same decoding:

```python
out = model.generate(input_ids, max_new_tokens=128, custom_generate="{repo_id}", trust_remote_code=True)
```
"""


def point_card_at(folder: Path, repo_id: str) -> None:
    """The folder's model card, kept as written (hand-edited notes too), told that the heads live at `repo_id`: its
    usage example names the repository and the `custom_generate` paragraph is added; no card: a fresh one."""
    card = folder / "README.md"
    if not card.is_file():
        write_model_card(folder, HeadsConfig.from_pretrained(folder), {}, repo_id=repo_id)
        return
    text = card.read_text().replace(f'heads="{LOCAL_HEADS_PLACEHOLDER}"', f'heads="{repo_id}"')
    card.write_text(text if "custom_generate=" in text else text + custom_generate_usage(repo_id))


def hub_base_model(target_name_or_path: str) -> str | None:
    """The card's `base_model`: the Hub id of the target (an alias mapped to its repository); None for a local
    path or an unknown target, which the Hub would not link."""
    from specheads.targets import ALIAS_HUB_IDS

    name = target_name_or_path.strip()
    if name.lower() in ALIAS_HUB_IDS:
        return ALIAS_HUB_IDS[name.lower()]
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~")) and ":" not in name
    return name if looks_like_hub_id else None


def write_model_card(folder: Path, config: HeadsConfig, metrics: dict[str, Any], repo_id: str | None = None) -> None:
    """Write README.md: what target the heads draft for, how to load them, and metrics when known.

    `repo_id` (when pushing to the Hub) names the heads in the usage examples, including plain transformers'
    `custom_generate`, which the pushed repository supports.
    """
    metrics_block = (
        "\n## Metrics\n\n```json\n" + json.dumps(metrics, indent=2, sort_keys=True) + "\n```\n" if metrics else ""
    )
    heads_location = repo_id or LOCAL_HEADS_PLACEHOLDER
    transformers_block = custom_generate_usage(repo_id) if repo_id else ""
    base_model = hub_base_model(config.target_name_or_path)
    card = f"""---
library_name: specheads
tags: [speculative-decoding, draft-heads, {config.head_type}]
{f"base_model: {base_model}" + chr(10) if base_model else ""}---

# {config.head_type} draft heads for `{config.target_name_or_path}`

Draft heads trained with [specheads](https://pypi.org/project/specheads/) for speculative decoding of
`{config.target_name_or_path}` ({", ".join(config.target_architectures) or config.target_model_type},
hidden size {config.hidden_size}, vocabulary {config.vocab_size}). Outputs are exactly the target's own:
greedy decoding gives identical tokens, sampling follows the target's distribution.

The checkpoint holds head weights only (never the target's embedding or lm_head).

```python
from specheads import SpeculativeLM
lm = SpeculativeLM.from_pretrained(target="{config.target_name_or_path}", heads="{heads_location}")
out = lm.generate(input_ids, max_new_tokens=128)
print(lm.last_stats)
```
{transformers_block}{metrics_block}"""
    (folder / "README.md").write_text(card)
