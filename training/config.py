"""Run configs: a YAML file plus dotted `key=value` overrides, checked into a typed dataclass tree.

    config = load_run_config("configs/train/eagle_stories260k.yaml", ["max_steps=100", "optim.learning_rate=1e-3"])

Unknown keys raise a ValueError naming the key and the valid ones; values of the wrong type raise a
ValueError naming the key, the value and the expected type. Override values are parsed as YAML scalars
(`max_steps=100` is an int, `trackers=[tensorboard]` a list, `data.max_length=null` None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specheads.heads.config import DRAFT_MODEL_HEAD_TYPE  # head.type of a distilled draft model (distill.py)

TTT_ATTENTION_CHOICES = ("auto", "chain", "dense")  # loss.ttt_attention (training/chain_attention.py)
# distill.divergence: forward KL(p || q), reverse KL(q || p), total variation (1 - the acceptance rate, DistillSpec)
DIVERGENCES = ("fkl", "rkl", "tvd")


@dataclass
class HeadSection:
    """Which heads to train: `type` is one of specheads.HEAD_TYPES, "mtp" (the target's own MTP layer, fine-tuned) or
    "draft_model" (a distilled draft model); `options` are HeadsConfig fields, or `create_heads`' `draft_layer` /
    `draft_hidden_size`."""

    type: str = "eagle"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSection:
    """Where the training text comes from and how it is cut into batches."""

    # a JSON/JSONL/Parquet file, a dataset folder, or a Hub dataset id (org/name[:split]); or a list of them (a mixture)
    source: str | list[str] = ""
    format: str = "auto"  # auto | sharegpt | openai | text
    max_length: int = 512  # tokens per example (longer examples are truncated)
    bucket_by_length: bool = True  # group examples of similar length into the same batches
    features_dir: str | None = None  # offline features (`specheads data dump-features`); needs feature_mode=offline
    eval_fraction: float = 0.0  # hold out this seeded share of the examples: evaluated, never trained on
    eval_source: str | list[str] = ""  # or evaluate on this separate source (or list; target features online)
    exclude_prompts: str = ""  # benchmark prompts (e.g. MT-bench JSONL): conversations asking one are not trained on
    # records' relative image paths are read from here (default: the data file's folder); vision-language targets
    image_folder: str | None = None
    # keywords of the chat template, as the target is prompted at inference (`--chat-template-kwargs`), e.g.
    # {enable_thinking: false} for Qwen3-style reasoning switches
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimSection:
    """AdamW with warmup then a cosine or constant schedule."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 0.5
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio


@dataclass
class LossSection:
    """Loss weights. Medusa: CE per head, weight decay**k. EAGLE: smooth-L1 on features + CE via the lm_head."""

    medusa_decay: float = 0.8
    feature_weight: float = 1.0
    token_weight: float = 0.1
    input_noise: float = 0.1  # EAGLE: U(-noise, noise) added to the input features
    labels: str = "target"  # target (the target's own distribution) | tokens (the data's next tokens)
    # labels="target": (1 - w) x the target's distribution + w x a one-hot on its argmax (what greedy decoding accepts)
    argmax_label_weight: float = 0.0
    eval_depth: int = 4  # EAGLE: simulated acceptance logged for depths 1..eval_depth (unrolled drafts)
    train_depth: int = 1  # EAGLE: depths 1..train_depth of the unrolled draft get gradients (1 = plain EAGLE)
    depth_decay: float = 0.8  # EAGLE: loss weight of unrolled depth d is depth_decay**(d-1)
    ttt_steps: int = 7  # EAGLE-3: training-time test steps (draft depths trained on the head's own outputs)
    ttt_decay: float = 0.8  # EAGLE-3: loss weight of TTT step i (0-based) is ttt_decay**i
    # EAGLE-3: progressive depth (EDSD): the unroll runs 1 step at optimizer step 0, growing linearly to ttt_steps at
    # this step (cheaper early steps, a curriculum); 0 = ttt_steps from the start
    ttt_steps_warmup: int = 0
    ttt_attention: str = "auto"  # EAGLE-3: chain (each query scores its own chain) | dense (one masked SDPA) | auto (chain on the CPU)
    # P-EAGLE (parallel_depth heads): share of the roots training depth d that also train depth d+1, drawn per batch
    # (COD sampling: nested subsets, depth d+1 trains ~ n * ratio^d roots; 1 = every root trains every depth)
    parallel_slot_ratio: float = 1.0
    # DFlash: blocks anchored per sequence, drawn among the positions whose block predicts trained tokens (0: all)
    dflash_blocks: int = 16
    # DFlash: depth d of a block weighs exp(-(d-1)/gamma); 0 = the paper's (7, 5, 4 for blocks of 16, 10, 8)
    dflash_gamma: float = 0.0
    # DFlash: accept-until-fail (AUF): depth d trains only in blocks whose depths 1..d-1 the draft got right
    dflash_accept_until_fail: bool = False


@dataclass
class JointSection:
    """Medusa-2: train the Medusa heads jointly with a peft LoRA adapter on the target (training/joint_lora.py).

    loss = lm_loss_weight * the target's own next-token CE on trained tokens + the decayed Medusa head losses.
    """

    enabled: bool = False
    lora_r: int = 8  # LoRA rank
    lora_alpha: float = 16.0  # LoRA scale is lora_alpha / lora_r
    lora_dropout: float = 0.0
    # names of the target's linear modules that get an adapter, or "all-linear" (peft: every linear layer but the
    # output layer, whatever the family calls them; on Llama the same seven as q/k/v/o/gate/up/down_proj)
    target_modules: list[str] | str = "all-linear"
    lm_loss_weight: float = 1.0  # weight of the target's own LM loss (keeps the adapted target's quality)
    head_lr_multiplier: float = 4.0  # heads learn at optim.learning_rate * this; the adapter at optim.learning_rate

    def check(self, head_type: str, feature_mode: str) -> None:
        """Raise a ValueError naming the first invalid value (joint training needs online Medusa heads)."""
        if not self.enabled:
            return
        if head_type != "medusa":
            raise ValueError(f"joint.enabled=true (Medusa-2) trains Medusa heads; head.type={head_type!r}, expected 'medusa'")
        if feature_mode != "online":
            raise ValueError(
                f"joint.enabled=true needs feature_mode=online (the adapter changes the features, so dumped ones are "
                f"stale); got feature_mode={feature_mode!r}"
            )
        if self.lora_r <= 0 or self.lora_alpha <= 0 or self.head_lr_multiplier <= 0:
            raise ValueError(
                f"joint.lora_r={self.lora_r}, joint.lora_alpha={self.lora_alpha}, joint.head_lr_multiplier="
                f"{self.head_lr_multiplier}: expected positive values"
            )
        if not 0 <= self.lora_dropout < 1 or self.lm_loss_weight < 0:
            raise ValueError(
                f"joint.lora_dropout={self.lora_dropout} (expected [0, 1)) or joint.lm_loss_weight="
                f"{self.lm_loss_weight} (expected >= 0) is invalid"
            )
        if not self.target_modules:
            raise ValueError("joint.target_modules is empty; expected module names such as [q_proj, v_proj], or all-linear")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"joint.target_modules={self.target_modules!r}; expected a list of module names such as [q_proj, v_proj], "
                "or all-linear"
            )


@dataclass
class DistillSection:
    """head.type=draft_model: distil a small causal LM into a draft model for the target (training/distill.py)."""

    # the model to train: a folder, Hub id or alias with the target's tokenizer, or "early-exit:N" for a standalone
    # copy of the target's own first N layers (+ its norm and lm_head)
    draft_model: str = ""
    divergence: str = "fkl"  # one of DIVERGENCES, between the target's distribution p and the draft's q
    freeze_embeddings: bool = False  # keep the input embedding and lm_head as they are (train the layers only)
    # both distributions at this temperature (softmax(logits / T)): match the draft to the target as it is sampled
    temperature: float = 1.0
    # > 0: train a peft LoRA adapter of this rank on the draft model instead of all its weights (merged when saved)
    lora_r: int = 0
    lora_alpha: float = 16.0  # LoRA scale is lora_alpha / lora_r
    target_modules: list[str] | str = "all-linear"  # its Linear modules that get an adapter (peft's names)
    # on-policy distillation (training/on_policy.py): the share of steps whose batches are the draft's own sampled
    # answers to the data's prompts, scored by the target (DistillSpec's / GKD's lambda; 0 = the data's text only)
    on_policy: float = 0.0

    def check(self, head_type: str, feature_mode: str, head_options: dict[str, Any], joint: bool) -> None:
        """Raise a ValueError naming the first value a draft-model run cannot take."""
        if head_type != DRAFT_MODEL_HEAD_TYPE:
            for name in ("draft_model", "on_policy"):
                if getattr(self, name):
                    raise ValueError(f"distill.{name}={getattr(self, name)!r} is set but head.type={head_type!r}; "
                                     f"distilling a draft model needs head.type={DRAFT_MODEL_HEAD_TYPE!r}")
            return
        if not 0 <= self.on_policy <= 1:
            raise ValueError(f"distill.on_policy={self.on_policy!r} is invalid; expected the share of steps trained on "
                             "the draft's own answers, in [0, 1]")
        if not self.draft_model:
            raise ValueError(f"head.type={DRAFT_MODEL_HEAD_TYPE!r} needs distill.draft_model: a causal LM with the target's "
                             "tokenizer (folder, Hub id or alias), or early-exit:N (a copy of the target's first N layers)")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"distill.divergence={self.divergence!r} is invalid; expected one of {DIVERGENCES}")
        if self.lora_r < 0 or (self.lora_r and self.lora_alpha <= 0):
            raise ValueError(f"distill.lora_r={self.lora_r!r}, distill.lora_alpha={self.lora_alpha!r}: expected a rank "
                             ">= 0 (0: train every weight) and a positive alpha")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature={self.temperature!r} is invalid; expected a temperature > 0 (the one "
                             "you will sample at; 1 = the distributions as they are)")
        if feature_mode != "online" or head_options or joint:
            raise ValueError(f"head.type={DRAFT_MODEL_HEAD_TYPE!r} runs the target online and takes no head.options or "
                             f"joint training; got feature_mode={feature_mode!r}, head.options={head_options}, "
                             f"joint.enabled={joint}")


@dataclass
class RunConfig:
    """One training run. Every key can be overridden as `key=value` or `section.key=value`."""

    output_dir: str = "runs/heads"
    target: str = "stories260K"
    max_steps: int = 100
    save_steps: int = 50
    save_total_limit: int = 2
    seed: int = 0
    global_batch_size: int = 16  # sequences per optimizer step, whatever the number of processes
    micro_batch_size: int = 8  # sequences per forward on one process; accumulation is derived
    feature_mode: str = "online"  # online (target runs in the step) | offline (read dumped features)
    log_steps: int = 10
    eval_steps: int = 0  # evaluate the held-out data every this many steps (0: once, at the end)
    save_best: bool = True  # with eval_steps > 0: also keep output_dir/best, the heads of the best held-out sim_tau
    early_stopping_patience: int = 0  # end the run after this many evaluations in a row without a better best (0: never)
    trackers: list[str] = field(default_factory=list)  # tensorboard, wandb
    project_name: str = "specheads"
    stop_after_steps: int | None = None  # stop (without a final save) after this step: simulates a crash
    time_limit_minutes: float | None = None  # end the run early (final save included) once this much time has passed
    init_heads: str | None = None  # start from these trained heads (folder or Hub id) instead of a fresh init
    push_to_hub: str | None = None  # at the end, upload the heads (best if kept, else final) to this Hub repo id
    hub_private: bool = False  # push_to_hub creates the repository private
    head: HeadSection = field(default_factory=HeadSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    loss: LossSection = field(default_factory=LossSection)
    joint: JointSection = field(default_factory=JointSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def gradient_accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per process per optimizer step, so that micro * accumulation * world == global."""
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
                f"{self.micro_batch_size} x world_size={world_size}; pick sizes so that it is"
            )
        return self.global_batch_size // per_step

    def validate(self) -> None:
        """Raise a ValueError naming the first invalid value."""
        from specheads.training.data import DATA_FORMATS  # (training.data imports more than a config needs)

        choices = {
            "feature_mode": (self.feature_mode, ("online", "offline")),
            "data.format": (self.data.format, DATA_FORMATS),
            "optim.schedule": (self.optim.schedule, ("cosine", "constant")),
            "loss.labels": (self.loss.labels, ("target", "tokens")),
            "loss.ttt_attention": (self.loss.ttt_attention, TTT_ATTENTION_CHOICES),
        }
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{key}={value!r} is invalid; expected one of {allowed}")
        for tracker in self.trackers:
            if tracker not in ("tensorboard", "wandb"):
                raise ValueError(f"trackers contains {tracker!r}; expected 'tensorboard' and/or 'wandb'")
        positive = {
            "max_steps": self.max_steps,
            "save_steps": self.save_steps,
            "save_total_limit": self.save_total_limit,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "log_steps": self.log_steps,
            "data.max_length": self.data.max_length,
            "loss.eval_depth": self.loss.eval_depth,
            "loss.train_depth": self.loss.train_depth,
            "loss.ttt_steps": self.loss.ttt_steps,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"{key}={value!r} is invalid; expected a positive integer")
        if not 0 <= self.loss.argmax_label_weight <= 1:
            raise ValueError(
                f"loss.argmax_label_weight={self.loss.argmax_label_weight!r} is invalid; expected a weight in [0, 1]"
            )
        if self.loss.argmax_label_weight > 0 and self.loss.labels != "target":
            raise ValueError(
                f"loss.argmax_label_weight={self.loss.argmax_label_weight!r} mixes into the target's distribution; "
                f"it needs loss.labels='target', got {self.loss.labels!r}"
            )
        if not isinstance(self.loss.ttt_steps_warmup, int) or self.loss.ttt_steps_warmup < 0:
            raise ValueError(f"loss.ttt_steps_warmup={self.loss.ttt_steps_warmup!r} is invalid; expected optimizer steps "
                             ">= 0 (0: the whole unroll from the start)")
        if not 0 < self.loss.parallel_slot_ratio <= 1:
            raise ValueError(f"loss.parallel_slot_ratio={self.loss.parallel_slot_ratio!r} is invalid; expected a share "
                             "in (0, 1] of the roots that train each next parallel depth")
        if not isinstance(self.loss.dflash_blocks, int) or self.loss.dflash_blocks < 0:
            raise ValueError(f"loss.dflash_blocks={self.loss.dflash_blocks!r} is invalid; expected blocks per sequence "
                             ">= 0 (0: every eligible anchor)")
        if not isinstance(self.loss.dflash_gamma, (int, float)) or self.loss.dflash_gamma < 0:
            raise ValueError(f"loss.dflash_gamma={self.loss.dflash_gamma!r} is invalid; expected a decay > 0, or 0 for "
                             "the DFlash paper's per block size")
        if self.eval_steps < 0:
            raise ValueError(f"eval_steps={self.eval_steps!r} is invalid; expected steps >= 0 (0: evaluate at the end)")
        if self.early_stopping_patience < 0:
            raise ValueError(f"early_stopping_patience={self.early_stopping_patience!r} is invalid; expected evaluations "
                             ">= 0 (0: never stop early)")
        if self.early_stopping_patience and not (self.eval_steps and self.save_best):
            raise ValueError(
                f"early_stopping_patience={self.early_stopping_patience} counts periodic evaluations against the best "
                f"heads: it needs eval_steps > 0 (got {self.eval_steps}) and save_best=true (got {self.save_best}), and "
                "held-out data (data.eval_fraction or data.eval_source)"
            )
        if self.early_stopping_patience and not (self.data.eval_fraction or self.data.eval_source):
            raise ValueError(
                f"early_stopping_patience={self.early_stopping_patience} needs held-out data to evaluate: set "
                "data.eval_fraction (e.g. 0.01) or data.eval_source"
            )
        if not 0 <= self.data.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction={self.data.eval_fraction!r} is invalid; expected a fraction in [0, 1)")
        if self.data.eval_fraction > 0 and self.data.eval_source:
            raise ValueError("data.eval_fraction and data.eval_source are both set; hold out a fraction OR name a file")
        if self.time_limit_minutes is not None and self.time_limit_minutes <= 0:
            raise ValueError(f"time_limit_minutes={self.time_limit_minutes!r} is invalid; expected minutes > 0 (or null)")
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} is larger than global_batch_size={self.global_batch_size}"
            )
        if self.feature_mode == "offline" and not self.data.features_dir:
            raise ValueError("feature_mode=offline needs data.features_dir (see `specheads data dump-features`)")
        if self.feature_mode == "online" and not self.data.source:
            raise ValueError("data.source is empty; set it to a JSON/JSONL/Parquet file, a dataset folder or a Hub dataset id")
        self.joint.check(self.head.type, self.feature_mode)
        self.distill.check(self.head.type, self.feature_mode, self.head.options, self.joint.enabled)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Return `value` if it fits type `tp` (ints are accepted as floats), else raise a ValueError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check_value(key, value, option)
            except ValueError as err:
                errors.append(err)
        raise ValueError(f"config key {key!r}: value {value!r} has type {type(value).__name__}; expected {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"config key {key!r}: value {value!r} has type {type(value).__name__}; expected {_type_name(tp)}")
        (item_type,) = typing.get_args(tp) or (Any,)
        return [_check_value(f"{key}[{i}]", item, item_type) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"config key {key!r}: value {value!r} has type {type(value).__name__}; expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # PyYAML reads 1e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ValueError(f"config key {key!r}: value {value!r} has type {type(value).__name__}; expected {_type_name(tp)}")
    return value


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, checking every key and type.

    Raises:
        ValueError: an unknown key (naming the valid ones) or a value of the wrong type.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            raise ValueError(f"unknown config key {prefix + str(key)!r}; valid keys here: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value if value is not None else {}, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _check_value(prefix + key, value, tp)
    return cls(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `a.b=value` overrides (values parsed as YAML scalars) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. max_steps=100)")
        key, text = item.split("=", 1)
        value = yaml.safe_load(text) if text != "" else ""
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a run config YAML (or start from defaults when `path` is None) and apply overrides.

    Args:
        path: a YAML file; relative `data.source` / `data.features_dir` stay relative to the working directory.
        overrides: dotted `key=value` strings.

    Returns:
        A validated RunConfig.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"run config {str(path)!r} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"run config {str(path)!r} must be a YAML mapping, got {type(raw).__name__}")
    apply_overrides(raw, list(overrides or []))
    config = build_dataclass(RunConfig, raw)
    config.validate()
    return config


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """The config as a plain nested dict (for trackers and the saved run config)."""
    return dataclasses.asdict(config)
