"""`HeadsConfig`: everything saved with a draft-head checkpoint (config.json)."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from transformers import PretrainedConfig

from specheads.heads.target_rows_vocab import TargetRowsDraftVocab

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# `DraftModelHeads` (heads/draft_model.py): a draft model wrapped to stand where heads stand; never a checkpoint
DRAFT_MODEL_HEAD_TYPE = "draft_model"
# `MtpHeads` (heads/mtp.py): a multi-token-prediction layer of the target's, as the target ships it or fine-tuned
MTP_HEAD_TYPE = "mtp"
# head types that read several tapped target layers (`feature_layers`, fused by their `fc`) rather than the final state
TAPPING_HEADS = ("eagle3", "dflash")
# EAGLE-3 variants' norms (heads/eagle3.py): EAGLE-3.1's two, and two of vLLM speculators' drafters
EAGLE3_NORM_FIELDS = ("eagle3_fc_norm", "eagle3_norm_output", "eagle3_norm_before_fc", "eagle3_norm_before_residual")
# the fields of the default draft tree (`HeadsConfig.cpu_tree` may replace any of them on CPUs)
TREE_FIELDS = ("tree_depth", "tree_top_k", "tree_num_nodes", "tree_stop_prob", "tree_min_prob", "static_tree")

# One line of help per field; also used by `specheads` docs and error messages.
FIELD_HELP: dict[str, str] = {
    "head_type": "Which draft architecture: one of specheads.HEAD_TYPES (medusa, eagle, eagle3, dflash), or 'mtp' (the target's own "
    "multi-token-prediction layer, heads/mtp.py); 'draft_model' for a draft model wrapped as heads at run time "
    "(heads/draft_model.py; never saved).",
    "draft_model_name_or_path": "draft_model: the draft model's path or Hub id ('early-exit:N' for the target's first N "
    "layers).",
    "format_version": "Checkpoint layout version; bumped when tensor names or semantics change.",
    "specheads_version": "The specheads version that wrote the checkpoint.",
    "target_name_or_path": "Path or Hub id of the target model the heads were built for.",
    "target_architectures": "The target's `architectures` (e.g. ['LlamaForCausalLM']).",
    "target_model_type": "The target's `model_type` (e.g. 'llama'); heads are refused on a target of another one.",
    "hidden_size": "The target's hidden size; the heads read and predict features of this width.",
    "vocab_size": "The target's vocabulary size; drafts are token ids below it.",
    "feature_layers": "Indices into the target's `hidden_states` tuple that the heads read "
    "(num_hidden_layers = the final, post-norm state); EAGLE-3 fuses 2 or more (default 3); DFlash fuses 1 or more "
    "(default 3).",
    "num_heads": "Medusa: number of heads, i.e. tokens drafted ahead in one shot (t+2 .. t+K+1).",
    "num_layers": "Medusa: residual SiLU blocks per head. EAGLE-3: decoder layers of the draft (default 1): the first "
    "reads [embedding; feature], the others are plain layers of the same family on its output (vLLM's and SpecForge's "
    "`num_hidden_layers`). DFlash: the drafter's decoder layers (default 1; z-lab's 8B drafters: 5). EAGLE: 1.",
    "draft_layer_config": "EAGLE: the config (as a dict) of the one decoder layer the head owns; its `model_type` "
    "picks the layer class (the target's family when that layer has Llama's shape, else 'llama'). Its `hidden_size` is "
    "the draft's width: the target's for EAGLE heads (they predict target features); EAGLE-3 heads may be narrower "
    "or wider (`create_heads(..., draft_hidden_size=)`; vLLM's and SGLang's `target_hidden_size` drafters).",
    "eagle_input_norm": "EAGLE: keep the decoder layer's input RMSNorm (original EAGLE-1/2 drops it on its one layer).",
    "eagle_draft_vocab_size": "EAGLE, DFlash and MTP: draft over only this many target tokens (the most frequent in the "
    "training data; the d2t buffer lists them) through those rows of the target's lm_head: cheaper drafting, same exact "
    "verification. 0 = the whole vocabulary.",
    "draft_vocab_size": "EAGLE-3: size of the reduced draft vocabulary its lm_head predicts (<= vocab_size; "
    "default min(vocab_size, 32000)); the d2t buffer maps draft ids to target ids.",
    "parallel_depth": "EAGLE-3: draft this many depths in ONE head forward (P-EAGLE parallel drafting: the depths past "
    "the first read the root's features plus a learned offset per depth (`mask_hidden`) and the embedding of "
    "`parallel_slot_token` instead of the head's own outputs); 0 = autoregressive drafting, one head forward per depth. Training runs these depths (not `loss.ttt_steps`).",
    "eagle3_fc_norm": "EAGLE-3.1: each fused target layer passes its own RMSNorm (`fc_norm.<i>`) before `fc`, so "
    "layers of any scale weigh alike (vLLM's and SGLang's `fc_norm`).",
    "eagle3_norm_output": "EAGLE-3.1: the head's output passes its final norm before it is the next draft step's "
    "feature (and the lm_head's input), against the feature scale drifting over the depths (vLLM's `norm_output`).",
    "eagle3_norm_before_fc": "EAGLE-3 variant (gpt-oss drafters, speculators' default): one RMSNorm (`input_norm`) over "
    "the concatenated target layers before `fc` (vLLM's `norm_before_fc`; not with eagle3_fc_norm).",
    "eagle3_norm_before_residual": "EAGLE-3 variant (vLLM's `norm_before_residual`): the decoder layer's residual is the "
    "normalised feature (hidden_norm's output) instead of the feature itself.",
    "parallel_slot_token": "EAGLE-3 with parallel_depth: the target token whose embedding the parallel slots read "
    "(vLLM's `ptd_token_id`).",
    "block_size": "DFlash: positions of the drafted block, the root and block_size-1 depths scored in ONE forward "
    "(z-lab's `block_size`); trees draft at most block_size-1 deep. 0 for other head types.",
    "block_mask_token": "DFlash: the target token whose embedding fills the block's positions after the root (z-lab's "
    "`dflash_config.mask_token_id`).",
    "tree_depth": "Default draft tree depth (EAGLE dynamic trees).",
    "tree_top_k": "Default children expanded per node (EAGLE dynamic trees).",
    "tree_num_nodes": "Default number of draft nodes kept after global reranking (EAGLE dynamic trees).",
    "tree_stop_prob": "Default early stop of EAGLE drafting: no deeper level once the best path's draft probability is below it.",
    "tree_min_prob": "Default pruning of EAGLE trees: only nodes whose path's draft probability is at least this are verified "
    "(the best node always is); fewer nodes when the heads are unsure, for targets whose verification cost grows with "
    "the node count (CPUs).",
    "static_tree": "Default static tree (a name under configs/trees/ or a path) for Medusa heads.",
    "cpu_tree": "The default tree on a CPU target where it differs: any of tree_depth, tree_top_k, tree_num_nodes, "
    "tree_stop_prob, tree_min_prob and static_tree, each replacing that field on CPUs ({} = the same tree everywhere). "
    "A CPU pays for every verified node, so the tree that is fastest there is smaller than a GPU's "
    "(`bench --tree auto --save-tree DIR` on a CPU writes its choice here).",
    "initializer_range": "Std of the normal init of fresh weights.",
    "target_embedding_sample": "16 values of the target's input embedding at fixed positions; refuses heads on a "
    "same-shaped but different target (empty = unknown, no check).",
    "target_adapter": "Medusa-2: subfolder holding the peft LoRA adapter these heads need merged into the target "
    "(SpeculativeLM.from_pretrained applies it); empty = the plain target.",
    "target_adapter_sample": "Medusa-2: {weight, rows, cols, base, adapted}: values of the adapted weight the adapter "
    "changed most, before and after merging; refuses an un-adapted target (empty = no check).",
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
        draft_vocab_size: int | None = None,
        eagle_draft_vocab_size: int = 0,
        parallel_depth: int = 0,
        parallel_slot_token: int = 0,
        block_size: int = 0,
        block_mask_token: int = 0,
        eagle3_fc_norm: bool = False,
        eagle3_norm_output: bool = False,
        eagle3_norm_before_fc: bool = False,
        eagle3_norm_before_residual: bool = False,
        tree_depth: int = 6,
        tree_top_k: int = 8,
        tree_num_nodes: int = 32,
        tree_stop_prob: float = 0.0,
        tree_min_prob: float = 0.0,
        static_tree: str = "medusa_default",
        cpu_tree: dict[str, Any] | None = None,
        initializer_range: float = 0.02,
        target_embedding_sample: list[float] | None = None,
        target_adapter: str = "",
        target_adapter_sample: dict[str, Any] | None = None,
        draft_model_name_or_path: str = "",
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
        if draft_vocab_size is None:  # a bad vocab_size is reported by validate_values, before this field
            draft_vocab_size = min(vocab_size, 32000) if isinstance(vocab_size, int) else vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.eagle_draft_vocab_size = eagle_draft_vocab_size
        self.parallel_depth = parallel_depth
        self.parallel_slot_token = parallel_slot_token
        self.block_size = block_size
        self.block_mask_token = block_mask_token
        self.eagle3_fc_norm = eagle3_fc_norm
        self.eagle3_norm_output = eagle3_norm_output
        self.eagle3_norm_before_fc = eagle3_norm_before_fc
        self.eagle3_norm_before_residual = eagle3_norm_before_residual
        self.tree_depth = tree_depth
        self.tree_top_k = tree_top_k
        self.tree_num_nodes = tree_num_nodes
        self.tree_stop_prob = tree_stop_prob
        self.tree_min_prob = tree_min_prob
        self.static_tree = static_tree
        self.cpu_tree = {} if cpu_tree is None else dict(cpu_tree) if isinstance(cpu_tree, dict) else cpu_tree
        self.initializer_range = initializer_range
        self.target_embedding_sample = (
            list(target_embedding_sample) if isinstance(target_embedding_sample, (list, tuple)) else target_embedding_sample or []
        )
        self.target_adapter = target_adapter
        self.target_adapter_sample = target_adapter_sample or {}
        self.draft_model_name_or_path = draft_model_name_or_path
        super().__init__(**kwargs)
        self.validate_values()

    @property
    def draft_hidden_size(self) -> int:
        """The width of the heads' own decoder layer (`draft_layer_config["hidden_size"]`): `hidden_size` (the
        target's) unless an EAGLE-3 drafter of another width was asked for. Medusa heads: `hidden_size`."""
        return self.draft_layer_config.get("hidden_size", self.hidden_size) if self.draft_layer_config else self.hidden_size

    def tree_defaults(self, device_type: str) -> dict[str, Any]:
        """The default tree's fields (`TREE_FIELDS` -> value) for a target on `device_type` ("cpu", "cuda", ...):
        the `tree_*` / `static_tree` fields, with `cpu_tree`'s in their place on a CPU."""
        fields = {name: getattr(self, name) for name in TREE_FIELDS}
        return {**fields, **self.cpu_tree} if device_type == "cpu" else fields

    def validate_values(self) -> None:
        """Raise a ValueError naming the first invalid field."""
        from specheads.heads import HEAD_CLASSES  # the registry lives in heads/__init__.py

        if self.head_type not in HEAD_CLASSES and self.head_type != DRAFT_MODEL_HEAD_TYPE:
            raise ValueError(f"HeadsConfig.head_type={self.head_type!r} is unknown; expected one of "
                             f"{tuple(HEAD_CLASSES)}")
        if not isinstance(self.format_version, int) or self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"HeadsConfig.format_version={self.format_version!r}: this specheads reads versions <= {FORMAT_VERSION}; "
                "upgrade specheads to load this checkpoint"
            )
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "num_heads", "num_layers"):
            _check_positive(name, getattr(self, name))
        for name in TREE_FIELDS:
            _check_tree_field(name, getattr(self, name))
        if not isinstance(self.cpu_tree, dict) or set(self.cpu_tree) - set(TREE_FIELDS):
            unknown = sorted(set(self.cpu_tree) - set(TREE_FIELDS)) if isinstance(self.cpu_tree, dict) else None
            raise ValueError(f"HeadsConfig.cpu_tree={self.cpu_tree!r} is invalid"
                             f"{f' (unknown keys {unknown})' if unknown else ''}; expected a dict of some of "
                             f"{', '.join(TREE_FIELDS)} ({FIELD_HELP['cpu_tree']})")
        for name, value in self.cpu_tree.items():
            _check_tree_field(name, value, f"HeadsConfig.cpu_tree[{name!r}]")
        if not all(isinstance(i, int) and i >= 0 for i in self.feature_layers):
            raise ValueError(f"HeadsConfig.feature_layers={self.feature_layers!r}; expected non-negative layer indices")
        sample = self.target_embedding_sample
        if not isinstance(sample, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sample):
            raise ValueError(
                f"HeadsConfig.target_embedding_sample={sample!r} is invalid; expected a list of floats "
                f"({FIELD_HELP['target_embedding_sample']})"
            )
        if not isinstance(self.target_adapter, str):
            raise ValueError(f"HeadsConfig.target_adapter={self.target_adapter!r}; expected a subfolder name or ''")
        adapter_sample, lists = self.target_adapter_sample, ("rows", "cols", "base", "adapted")
        if not isinstance(adapter_sample, dict) or adapter_sample and (
            set(adapter_sample) != {"weight", *lists} or len({len(adapter_sample[k]) for k in lists}) != 1
        ):
            raise ValueError(
                f"HeadsConfig.target_adapter_sample={adapter_sample!r} is invalid; expected {{}} or a dict with keys "
                f"weight, {', '.join(lists)} (lists of one length) ({FIELD_HELP['target_adapter_sample']})"
            )
        if self.head_type in ("eagle", "eagle3", "dflash") and not self.draft_layer_config:
            raise ValueError(f"HeadsConfig.draft_layer_config is empty; {self.head_type} heads need their decoder "
                             "layers' config")
        if self.head_type in ("eagle", "eagle3"):
            self.validate_draft_width()
        if self.head_type == "eagle" and self.num_layers != 1:
            raise ValueError(f"HeadsConfig.num_layers={self.num_layers} is set for head_type='eagle'; EAGLE heads hold "
                             "one decoder layer (several: eagle3 heads)")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"HeadsConfig.draft_vocab_size={self.draft_vocab_size} is larger than vocab_size={self.vocab_size}; "
                f"expected at most vocab_size ({FIELD_HELP['draft_vocab_size']})"
            )
        subset = self.eagle_draft_vocab_size
        if not isinstance(subset, int) or isinstance(subset, bool) or not 0 <= subset <= self.vocab_size:
            raise ValueError(
                f"HeadsConfig.eagle_draft_vocab_size={subset!r} is invalid; expected an integer in [0, vocab_size="
                f"{self.vocab_size}] ({FIELD_HELP['eagle_draft_vocab_size']})"
            )
        if subset and not issubclass(HEAD_CLASSES.get(self.head_type, object), TargetRowsDraftVocab):
            raise ValueError(
                f"HeadsConfig.eagle_draft_vocab_size={subset} is set for head_type={self.head_type!r}; it applies to "
                "eagle, dflash and mtp heads only (eagle3 heads use draft_vocab_size)"
            )
        self.validate_parallel_drafting()
        self.validate_block_drafting()
        for name in EAGLE3_NORM_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"HeadsConfig.{name}={value!r} is invalid; expected true or false ({FIELD_HELP[name]})")
            if value and self.head_type != "eagle3":
                raise ValueError(f"HeadsConfig.{name}=True is set for head_type={self.head_type!r}; these norms "
                                 "apply to eagle3 heads only")
        if self.eagle3_fc_norm and self.eagle3_norm_before_fc:
            raise ValueError("HeadsConfig.eagle3_fc_norm and eagle3_norm_before_fc are both set; expected one: a norm "
                             "per fused layer (EAGLE-3.1) or one over their concatenation")
        if self.head_type == "eagle3" and len(self.feature_layers) < 2:
            raise ValueError(
                f"HeadsConfig.feature_layers={self.feature_layers!r}; EAGLE-3 heads fuse at least 2 target layers "
                "(default: 3, [2, L//2, L-3])"
            )

    def validate_draft_width(self) -> None:
        """Raise a ValueError naming `draft_layer_config.hidden_size` when EAGLE heads could not run at that width."""
        width, target = self.draft_layer_config.get("hidden_size", self.hidden_size), self.hidden_size
        _check_positive("hidden_size", width, "HeadsConfig.draft_layer_config.hidden_size")
        if self.head_type == "eagle" and width != target:
            raise ValueError(f"HeadsConfig.draft_layer_config.hidden_size={width} differs from hidden_size={target}; "
                             "EAGLE heads predict the target's features, so their layer has the target's width (a "
                             "draft of another width is an eagle3 head)")
        fused = len(self.feature_layers) * target
        if self.head_type == "eagle3" and len(self.feature_layers) >= 2 and width == fused:
            raise ValueError(f"HeadsConfig.draft_layer_config.hidden_size={width} equals the fused target features' "
                             f"width ({len(self.feature_layers)} layers x hidden_size={target}), so the head could not "
                             "tell its own outputs from target features; expected another width")

    def fit_trees_to_parallel_depth(self) -> None:
        """Cap the default trees' depth (`tree_depth`, and `cpu_tree`'s when it sets one) at `parallel_depth`: parallel
        heads draft no deeper than their slots."""
        self.tree_depth = min(self.tree_depth, self.parallel_depth)
        if "tree_depth" in self.cpu_tree:
            self.cpu_tree["tree_depth"] = min(self.cpu_tree["tree_depth"], self.parallel_depth)

    def validate_block_drafting(self) -> None:
        """Raise a ValueError naming `block_size` / `block_mask_token` when they are invalid (DFlash heads)."""
        size, token, dflash = self.block_size, self.block_mask_token, self.head_type == "dflash"
        if not isinstance(size, int) or isinstance(size, bool) or (size < 2 if dflash else size != 0):
            expected = "an integer >= 2" if dflash else f"0 (block drafting is DFlash's; head_type={self.head_type!r})"
            raise ValueError(f"HeadsConfig.block_size={size!r} is invalid; expected {expected} ({FIELD_HELP['block_size']})")
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
            raise ValueError(f"HeadsConfig.block_mask_token={token!r} is invalid; expected a token id in [0, "
                             f"vocab_size={self.vocab_size}) ({FIELD_HELP['block_mask_token']})")
        if dflash and self.draft_layer_config.get("num_hidden_layers", self.num_layers) != self.num_layers:
            raise ValueError(f"HeadsConfig.num_layers={self.num_layers} but draft_layer_config.num_hidden_layers="
                             f"{self.draft_layer_config['num_hidden_layers']}; expected them equal (the draft's layers)")

    def validate_parallel_drafting(self) -> None:
        """Raise a ValueError naming `parallel_depth` / `parallel_slot_token` when they are invalid."""
        depth, token = self.parallel_depth, self.parallel_slot_token
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0 or depth == 1:
            raise ValueError(f"HeadsConfig.parallel_depth={depth!r} is invalid; expected 0 (off) or an integer >= 2 "
                             f"({FIELD_HELP['parallel_depth']})")
        if depth and self.head_type != "eagle3":
            raise ValueError(f"HeadsConfig.parallel_depth={depth} is set for head_type={self.head_type!r}; parallel "
                             "drafting (P-EAGLE) applies to eagle3 heads only")
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
            raise ValueError(f"HeadsConfig.parallel_slot_token={token!r} is invalid; expected a token id in [0, "
                             f"vocab_size={self.vocab_size}) ({FIELD_HELP['parallel_slot_token']})")


def _check_positive(name: str, value: Any, where: str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where or 'HeadsConfig.' + name}={value!r} is invalid; expected a positive integer "
                         f"({FIELD_HELP[name]})")


def _check_tree_field(name: str, value: Any, where: str | None = None) -> None:
    """Raise a ValueError naming `where` (default: the field) when `value` is not valid for the tree field `name`."""
    where = where or f"HeadsConfig.{name}"
    if name == "static_tree":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}={value!r} is invalid; expected a tree name or path ({FIELD_HELP[name]})")
    elif name in ("tree_stop_prob", "tree_min_prob"):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
            raise ValueError(f"{where}={value!r}; expected a probability in [0, 1) ({FIELD_HELP[name]})")
    else:
        _check_positive(name, value, where)
