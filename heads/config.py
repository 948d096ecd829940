"""`HeadsConfig`: everything saved with a draft-head checkpoint (config.json)."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1

# One line of help per field; also used by `specheads` docs and error messages.
FIELD_HELP: dict[str, str] = {
    "head_type": "Which draft architecture: one of specheads.HEAD_TYPES (medusa, eagle).",
    "format_version": "Checkpoint layout version; bumped when tensor names or semantics change.",
    "specheads_version": "The specheads version that wrote the checkpoint.",
    "target_name_or_path": "Path or Hub id of the target model the heads were built for.",
    "target_architectures": "The target's `architectures` (e.g. ['LlamaForCausalLM']).",
    "target_model_type": "The target's `model_type` (e.g. 'llama'); selects the decoder layer class.",
    "hidden_size": "The target's hidden size; the heads read and predict features of this width.",
    "vocab_size": "The target's vocabulary size; drafts are token ids below it.",
    "feature_layers": "Indices into the target's `hidden_states` tuple that the heads read "
    "(num_hidden_layers = the final, post-norm state).",
    "num_heads": "Medusa: number of heads, i.e. tokens drafted ahead in one shot (t+2 .. t+K+1).",
    "num_layers": "Medusa: residual SiLU blocks per head.",
    "draft_layer_config": "EAGLE: the target family's config (as a dict) for the one decoder layer the head owns.",
    "eagle_input_norm": "EAGLE: keep the decoder layer's input RMSNorm (original EAGLE-1/2 drops it on its one layer).",
    "tree_depth": "Default draft tree depth (EAGLE dynamic trees).",
    "tree_top_k": "Default children expanded per node (EAGLE dynamic trees).",
    "tree_num_nodes": "Default number of draft nodes kept after global reranking (EAGLE dynamic trees).",
    "tree_stop_prob": "Default early stop of EAGLE drafting: no deeper level once the best path's draft probability is below it.",
    "static_tree": "Default static tree (a name under configs/trees/ or a path) for Medusa heads.",
    "initializer_range": "Std of the normal init of fresh weights.",
    "target_embedding_sample": "16 values of the target's input embedding at fixed positions; refuses heads on a "
    "same-shaped but different target (empty = unknown, no check).",
}


@cache
def _standard_config_keys() -> frozenset[str]:
    """Keys every PretrainedConfig writes (transformers_version, architectures, dtype, ...)."""
    return frozenset(PretrainedConfig().to_dict()) | {
        "transformers_version",
        "architectures",
        "_name_or_path",
        "model_type",
        "torch_dtype",
        "dtype",
    }


class HeadsConfig(PretrainedConfig):
    """Configuration of a set of draft heads and of the target they draft for.

    Every field has one line of help in `FIELD_HELP`. Unknown keys (from a newer specheads) are dropped
    with a warning; invalid values raise a `ValueError` naming the field.
    """

    model_type = "specheads"

    def __init__(
        self,
        head_type: str = "medusa",
        format_version: int = FORMAT_VERSION,
        specheads_version: str | None = None,
        target_name_or_path: str = "",
        target_architectures: list[str] | None = None,
        target_model_type: str = "llama",
        hidden_size: int = 64,
        vocab_size: int = 512,
        feature_layers: list[int] | None = None,
        num_heads: int = 5,
        num_layers: int = 1,
        draft_layer_config: dict[str, Any] | None = None,
        eagle_input_norm: bool = False,
        tree_depth: int = 6,
        tree_top_k: int = 8,
        tree_num_nodes: int = 32,
        tree_stop_prob: float = 0.0,
        static_tree: str = "medusa_default",
        initializer_range: float = 0.02,
        target_embedding_sample: list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        if specheads_version is None:
            from specheads import __version__

            specheads_version = __version__
        unknown = sorted(k for k in kwargs if k not in _standard_config_keys())
        if unknown:
            logger.warning("HeadsConfig: dropping unknown keys %s (written by a newer specheads?)", unknown)
            for key in unknown:
                kwargs.pop(key)
        self.head_type = head_type
        self.format_version = format_version
        self.specheads_version = specheads_version
        self.target_name_or_path = target_name_or_path
        self.target_architectures = list(target_architectures or [])
        self.target_model_type = target_model_type
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.feature_layers = list(feature_layers) if feature_layers is not None else []
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.draft_layer_config = dict(draft_layer_config or {})
        self.eagle_input_norm = eagle_input_norm
        self.tree_depth = tree_depth
        self.tree_top_k = tree_top_k
        self.tree_num_nodes = tree_num_nodes
        self.tree_stop_prob = tree_stop_prob
        self.static_tree = static_tree
        self.initializer_range = initializer_range
        self.target_embedding_sample = (
            list(target_embedding_sample) if isinstance(target_embedding_sample, (list, tuple)) else target_embedding_sample or []
        )
        super().__init__(**kwargs)
        self.validate_values()

    def validate_values(self) -> None:
        """Raise a ValueError naming the first invalid field."""
        from specheads.heads import HEAD_TYPES  # the registry lives in heads/__init__.py

        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"HeadsConfig.head_type={self.head_type!r} is unknown; expected one of {HEAD_TYPES}")
        if not isinstance(self.format_version, int) or self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"HeadsConfig.format_version={self.format_version!r}: this specheads reads versions <= {FORMAT_VERSION}; "
                "upgrade specheads to load this checkpoint"
            )
        positive = ("hidden_size", "vocab_size", "num_heads", "num_layers", "tree_depth", "tree_top_k", "tree_num_nodes")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"HeadsConfig.{name}={value!r} is invalid; expected a positive integer ({FIELD_HELP[name]})")
        if not isinstance(self.tree_stop_prob, (int, float)) or not 0 <= self.tree_stop_prob < 1:
            raise ValueError(f"HeadsConfig.tree_stop_prob={self.tree_stop_prob!r}; expected a probability in [0, 1)")
        if not all(isinstance(i, int) and i >= 0 for i in self.feature_layers):
            raise ValueError(f"HeadsConfig.feature_layers={self.feature_layers!r}; expected non-negative layer indices")
        sample = self.target_embedding_sample
        if not isinstance(sample, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sample):
            raise ValueError(
                f"HeadsConfig.target_embedding_sample={sample!r} is invalid; expected a list of floats "
                f"({FIELD_HELP['target_embedding_sample']})"
            )
        if self.head_type == "eagle" and not self.draft_layer_config:
            raise ValueError("HeadsConfig.draft_layer_config is empty; EAGLE heads need the target family's layer config")
