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

from specheads.heads.config import HeadsConfig


@dataclass
class TargetParts:
    """Modules borrowed from the target at run time; never saved with the heads (a plain attribute, not a submodule)."""

    embed_tokens: nn.Module  # (V, h) input embedding
    lm_head: nn.Module  # h -> V output projection (reads post-norm features)


def check_heads_match_target(config: HeadsConfig, target_config: PretrainedConfig) -> None:
    """Raise a ValueError when heads were built for a target of another shape."""
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
    if config.head_type == "eagle" and config.target_model_type != target_config.model_type:
        raise ValueError(
            f"EAGLE heads hold a {config.target_model_type!r} decoder layer but the target is "
            f"model_type={target_config.model_type!r}"
        )


class DraftHeads(PreTrainedModel):
    """Base class of all draft heads: a small trainable module reading a frozen target's hidden states.

    Subclasses implement `forward` (training and drafting). Call `attach_target(target)` before use:
    it checks the shapes and borrows the target's embedding and lm_head without storing them.
    """

    config_class = HeadsConfig
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
        check_heads_match_target(self.config, target.config)
        self._target_parts = TargetParts(target.get_input_embeddings(), target.get_output_embeddings())

    @property
    def target_parts(self) -> TargetParts:
        if self._target_parts is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a target: call heads.attach_target(target)")
        return self._target_parts

    def select_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target features the heads read, from the target's `hidden_states` tuple. (B, T, h)"""
        return hidden_states[self.config.feature_layers[0]]

    def init_from_target(self, target: PreTrainedModel) -> None:
        """Initialise fresh weights from the target where the architecture does so (Medusa: lm_head copies)."""

    # --- checkpoints ------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """`PreTrainedModel.save_pretrained` (config.json + model.safetensors, head weights only) plus a model card."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        write_model_card(Path(save_directory), self.config, self.model_card_metrics)
        return result

    def _upload_modified_files(self, working_dir: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        # `push_to_hub` saves with save_pretrained, then replaces README.md with transformers' generic card
        # just before this upload step: put the specheads card (target, usage, metrics) back.
        write_model_card(Path(working_dir), self.config, self.model_card_metrics)
        return super()._upload_modified_files(working_dir, *args, **kwargs)


def write_model_card(folder: Path, config: HeadsConfig, metrics: dict[str, Any]) -> None:
    """Write README.md: what target the heads draft for, how to load them, and metrics when known."""
    metrics_block = (
        "\n## Metrics\n\n```json\n" + json.dumps(metrics, indent=2, sort_keys=True) + "\n```\n" if metrics else ""
    )
    card = f"""---
library_name: specheads
tags: [speculative-decoding, draft-heads, {config.head_type}]
base_model: {config.target_name_or_path or "unknown"}
---

# {config.head_type} draft heads for `{config.target_name_or_path}`

Draft heads trained with [specheads](https://pypi.org/project/specheads/) for speculative decoding of
`{config.target_name_or_path}` ({", ".join(config.target_architectures) or config.target_model_type},
hidden size {config.hidden_size}, vocabulary {config.vocab_size}). Outputs are exactly the target's own:
greedy decoding gives identical tokens, sampling follows the target's distribution.

The checkpoint holds head weights only (never the target's embedding or lm_head).

```python
from specheads import SpeculativeLM
lm = SpeculativeLM.from_pretrained(target="{config.target_name_or_path}", heads="path/to/this/folder")
out = lm.generate(input_ids, max_new_tokens=128)
print(lm.last_stats)
```
{metrics_block}"""
    (folder / "README.md").write_text(card)
