"""The training loop: setup, train, save. One Accelerate loop for Medusa and EAGLE heads on a frozen target.

    specheads train configs/train/eagle_stories260k.yaml max_steps=200
    accelerate launch --config_file configs/accelerate/multi_cpu.yaml -m specheads train CONFIG.yaml

Exactness: the examples of every optimizer step are a pure function of (seed, step) (`BatchOrder`), the global
batch is cut into the same micro-batches whatever the number of processes, and the EAGLE input noise is seeded
per example. So a resumed run ends with the same weights as an uninterrupted one, and N processes end with the
same weights as one (up to float summation order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import Subset
from tqdm.auto import tqdm

from specheads import create_heads, load_heads, load_target
from specheads.heads.base import DraftHeads
from specheads.heads.config import TAPPING_HEADS
from specheads.heads.eagle3 import Eagle3Heads
from specheads.heads.hub import push_heads_folder
from specheads.inference.multimodal import image_processor_for, takes_images
from specheads.targets import logit_transforms
from specheads.training.best_heads import BEST_DIR, BestHeads, save_heads
from specheads.training.chain_attention import use_ttt_chain_attention, wants_ttt_chain_attention
from specheads.training.checkpoints import latest_checkpoint, save_checkpoint
from specheads.training.config import DRAFT_MODEL_HEAD_TYPE, RunConfig, load_run_config
from specheads.training.data import BatchOrder, batch_to, build_dataset, micro_batches_for_process
from specheads.training.dflash_loss import dflash_loss
from specheads.training.draft_vocab import (
    build_draft_vocab,
    count_trained_tokens,
    special_token_ids,
    vocab_coverage,
)
from specheads.training.evaluate import evaluate, split_eval_indices
from specheads.training.features import (
    OfflineFeatures,
    can_skip_logits,
    collate_offline,
    logits_are_lm_head_of_final_state,
    offline_target_labels,
    online_features,
    online_stored_features,
)
from specheads.training.image_records import collate_for, has_image_rows
from specheads.training.joint_lora import JointMedusa, joint_loss, keep_trainable_weights_only
from specheads.training.losses import (
    LossOutput,
    eagle3_loss,
    eagle_loss,
    medusa_loss,
    medusa_rows,
    uniform_noise,
)
from specheads.training.preflight import check_free_disk, check_writable_dir, training_disk_bytes
from specheads.training.sharegpt import benchmark_prompts
from specheads.training.steps import (
    after_evaluation,
    init_trackers,
    optimizer_step,
    out_of_time,
    resume_state,
    save_final,
    step_metrics,
)
from specheads.training.target_labels import TargetLabels


# --- setup ----------------------------------------------------------------------------------------------
def check_world_size(accelerator: Accelerator) -> None:
    """Fail loudly when the launcher started N processes but each one trains alone ("rank 0 of 1").

    Raises:
        RuntimeError: WORLD_SIZE in the environment disagrees with the Accelerator's number of processes.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world != accelerator.num_processes:
        raise RuntimeError(
            f"the launcher started WORLD_SIZE={env_world} processes but this Accelerator sees "
            f"num_processes={accelerator.num_processes}: every process would train alone on the full batch. "
            "On a machine without GPUs the Accelerator must be built with cpu=True (specheads does this); "
            "check the accelerate config (distributed_type MULTI_CPU, num_processes)"
        )


def make_accelerator(config: RunConfig) -> Accelerator:
    """An Accelerator (CPU when there is no GPU) with the run's trackers, checked against the launcher."""
    trackers = list(config.trackers)
    if "wandb" in trackers:
        try:
            import wandb  # noqa: F401
        except ImportError as err:
            raise ValueError("trackers contains 'wandb' but wandb is not installed (pip install specheads[wandb])") from err
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        log_with=trackers or None,
        project_dir=config.output_dir,
        step_scheduler_with_optimizer=False,  # one scheduler step per optimizer step, whatever the world size
    )
    check_world_size(accelerator)
    if accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        # several torch processes sharing a few cores thrash; OMP_NUM_THREADS (default 1) threads each
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return accelerator


def fill_deepspeed_config(accelerator: Accelerator, config: RunConfig) -> None:
    """Under DeepSpeed, fill the "auto" values accelerate cannot infer here: it reads the micro batch size from a
    DataLoader, and we batch ourselves. Micro batch size and gradient clipping come from the run config (no-op
    without DeepSpeed)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    values = plugin.deepspeed_config
    if values.get("train_micro_batch_size_per_gpu") == "auto":
        values["train_micro_batch_size_per_gpu"] = config.micro_batch_size
    if values.get("gradient_clipping") == "auto":
        values["gradient_clipping"] = config.optim.max_grad_norm  # 0: no clipping, as without DeepSpeed


def lr_lambda(config: RunConfig) -> Any:
    """Multiplier of the learning rate at step s: linear warmup, then cosine (to min_lr_ratio) or constant."""
    warmup, total, floor = config.optim.warmup_steps, config.max_steps, config.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# --- one step -------------------------------------------------------------------------------------------
def loss_config_at(config: RunConfig, step: int) -> RunConfig:
    """`config` with the training-time-test depth of optimizer step `step`: under `loss.ttt_steps_warmup` = W, 1 + (K-1)
    step // W unrolled steps (K = `loss.ttt_steps`) until step W; `config` itself from then on, or without a warmup.
    A function of the step alone, so resumed and multi-process runs unroll alike."""
    warmup = config.loss.ttt_steps_warmup
    if not warmup or step >= warmup:
        return config
    steps = 1 + (config.loss.ttt_steps - 1) * step // warmup
    return dataclasses.replace(config, loss=dataclasses.replace(config.loss, ttt_steps=steps))


def compute_loss(
    config: RunConfig,
    model: torch.nn.Module,
    heads: torch.nn.Module,
    target: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    noise_seeds: list[int],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> LossOutput:
    """Target features (online or from the batch) -> head forward -> loss.

    Args:
        model: the prepared (possibly DDP-wrapped) heads, used for the forward that gets gradients.
        heads: the same heads unwrapped (config, lm_head access, gradient-free unrolls).
        autocast: context for the draft logits, which run outside the prepared model's forward
            (`accelerator.autocast`: bf16 autocast under native mixed precision, a no-op otherwise).
    """
    if config.joint.enabled:  # Medusa-2: `model` is the adapted target + heads; features get gradients
        return joint_loss(model, batch, config)
    hidden = heads.config.hidden_size
    if "features" in batch or can_skip_logits(target):
        if "features" in batch:  # offline: [tapped layers (EAGLE-3, DFlash) | final post-norm state] (others: final)
            stored, top1 = batch["features"], batch.get("target_top1")
            features = stored[..., :-hidden] if heads.config.head_type in TAPPING_HEADS else stored[..., -hidden:]
        else:  # online, the same layout: [the heads' features | final], and no (B, T, V) logits from the forward
            stored = online_stored_features(target, batch["input_ids"], batch["attention_mask"], heads.select_features,
                                            batch.get("row_inputs"))
            features, top1 = stored[..., :-hidden], None
        # lm_head(final) = the target's logits: its labels, made only where a loss reads them
        label_vocab = heads.d2t if heads.config.head_type == "eagle3" else None
        target_logits: torch.Tensor | TargetLabels = offline_target_labels(
            target.get_output_embeddings(), stored[..., -hidden:], batch["loss_mask"], label_vocab,
            config.loss.labels == "target", top1,
        )
    else:  # a target forward without logits_to_keep, or scaled / capped logits: the forward's dense logits
        features, target_logits = online_features(target, batch["input_ids"], batch["attention_mask"],
                                                   heads.select_features, batch.get("row_inputs"))
    if heads.config.head_type == "medusa":
        rows = medusa_rows(batch["loss_mask"], heads.config.num_heads)  # (M,), (M,): the positions a head trains at
        medusa_logits = _HeadsView(model, heads, autocast).forward_in_heads_dtype(features[rows])  # (K, M, V)
        return medusa_loss(medusa_logits, target_logits, batch["input_ids"], batch["loss_mask"], config.loss, rows)
    if heads.config.head_type == "dflash":  # blocks of the data's tokens and masks: no input noise
        return dflash_loss(_HeadsView(model, heads, autocast), features, target_logits, batch["input_ids"],
                           batch["attention_mask"], batch["loss_mask"], config.loss)
    noise = None
    if config.loss.input_noise > 0:
        batch_size, seq_len, hidden = features.shape
        noise = uniform_noise((batch_size, seq_len - 1, hidden), config.loss.input_noise, noise_seeds).to(features.device)
    if heads.config.head_type == "eagle3":
        return eagle3_loss(
            _HeadsView(model, heads, autocast), features, target_logits, batch["input_ids"], batch["attention_mask"],
            batch["loss_mask"], config.loss, noise,
        )
    return eagle_loss(
        _HeadsView(model, heads, autocast), features, target_logits, batch["input_ids"], batch["attention_mask"],
        batch["loss_mask"], config.loss, noise,
    )


class _HeadsView:
    """Calls go through the prepared (DDP) model when gradients are on, else through the plain heads.

    Float tensors go in at the heads' parameter dtype and hidden states come out as float32: DeepSpeed with bf16
    turns the prepared heads' weights into bf16 (no autocast), while the frozen target's features and the next
    TTT step's input stay float32. Everywhere else the heads are float32 and the casts do nothing. Logits come
    out as they are (bf16 under mixed precision): the losses compute in float32 a chunk of rows at a time, and a
    float32 copy of a (rows, vocabulary) tensor costs more than its loss. The draft logits run outside the
    prepared model's forward, so they get the run's `autocast` context themselves (bf16 under native mixed precision).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        heads: torch.nn.Module,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.model, self.heads, self.autocast = model, heads, autocast
        self.dtype = next(heads.parameters()).dtype

    def _inputs(self, args: tuple[Any, ...]) -> list[Any]:
        return [a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The heads' forward, float32 out (EAGLE's and EAGLE-3's hidden states)."""
        return self.forward_in_heads_dtype(*args, **kwargs).float()

    def forward_in_heads_dtype(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The heads' forward, out in the heads' (or autocast's) dtype (Medusa's (K, M, V) logits)."""
        return (self.model if torch.is_grad_enabled() else self.heads)(*self._inputs(args), **kwargs)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """The draft logits under the run's autocast, in their own dtype."""
        with self.autocast():
            return self.heads.logits(*self._inputs((predicted,)))

    @property
    def d2t(self) -> torch.Tensor:
        """EAGLE-3: the target id of each draft id."""
        return self.heads.d2t


def initial_heads(config: RunConfig, target: torch.nn.Module) -> DraftHeads:
    """Fresh heads of `head.type` / `head.options`, or the trained heads of `init_heads` to train on.

    Heads from `init_heads` keep their architecture and draft vocabulary (more training on new data, a longer
    schedule); `head.type` and any `head.options` given must agree with them, except `parallel_depth` (and
    `parallel_slot_token`) on autoregressive EAGLE-3 heads: those become parallel-drafting heads (P-EAGLE) to train.
    """
    if config.init_heads is None:
        return create_heads(target, config.head.type, **config.head.options)
    heads = load_heads(config.init_heads, target=target)  # checked against the target, on its device and dtype
    if heads.config.head_type != config.head.type:
        raise ValueError(f"init_heads={config.init_heads!r} holds {heads.config.head_type} heads but head.type="
                         f"{config.head.type!r}: set head.type={heads.config.head_type}")
    options = config.head.options
    if options.get("parallel_depth") and isinstance(heads, Eagle3Heads) and not heads.config.parallel_depth:
        heads.enable_parallel_drafting(options["parallel_depth"], options.get("parallel_slot_token"))  # then they agree
    for key, value in options.items():
        if getattr(heads.config, key, value) != value:
            raise ValueError(f"head.options.{key}={value!r} but init_heads={config.init_heads!r} has {key}="
                             f"{getattr(heads.config, key)!r}: drop the option or make it agree")
    return heads


def trained_token_counts(examples: Any, vocab_size: int, indices: list[int] | None = None) -> torch.Tensor:
    """(V,) counts of the trained tokens of the training examples (a tokenized dataset or an offline dump), or
    of those at `indices` (the examples left after the held-out split)."""
    if isinstance(examples, OfflineFeatures):
        ids, masks = examples.token_columns()
    else:
        ids, masks = examples["input_ids"], examples["loss_mask"]
    if indices is not None:
        ids, masks = [ids[i] for i in indices], [masks[i] for i in indices]
    return count_trained_tokens(ids, masks, vocab_size)


def held_out_examples(
    config: RunConfig, examples: Any, tokenizer: Any, make_batch: Callable[..., dict[str, torch.Tensor]],
    progress: bool = True, processor: Any = None,
) -> tuple[list[int], Any, Callable[..., dict[str, torch.Tensor]]]:
    """(training indices into `examples`, eval examples or None, the eval batches' collate function).

    `data.eval_fraction` holds out a seeded share of the training examples (offline features included);
    `data.eval_source` names another file (format detected), tokenized like the training data, whose features
    the target computes online (a vision-language target's `processor` reads its images). Neither: every example
    trains and nothing is evaluated.
    """
    if config.data.eval_source:
        # its own format, detected: a held-out file need not be written like the training data
        eval_examples: Any = build_dataset(config.data.eval_source, tokenizer, "auto", config.data.max_length,
                                           progress=progress, processor=processor, image_folder=config.data.image_folder,
                                           chat_template_kwargs=config.data.chat_template_kwargs)
        train_indices, make_eval_batch = list(range(len(examples))), collate_for(eval_examples, processor)
    else:
        train_indices, eval_indices = split_eval_indices(len(examples), config.data.eval_fraction, config.seed)
        eval_examples, make_eval_batch = (Subset(examples, eval_indices) if eval_indices else None), make_batch
    if eval_examples is not None:  # fail now rather than after training: evaluate() needs trained tokens
        masks = (eval_examples[i]["loss_mask"] for i in range(len(eval_examples)))
        if not any(int(torch.as_tensor(mask).sum()) for mask in masks):
            where = config.data.eval_source or f"the data.eval_fraction={config.data.eval_fraction} split"
            raise ValueError(f"the held-out examples ({where}) have no trained (assistant) tokens to evaluate on")
    return train_indices, eval_examples, make_eval_batch


def evaluate_during_training(
    config: RunConfig, model: torch.nn.Module, heads: DraftHeads, target: torch.nn.Module, eval_examples: Any,
    make_batch: Callable[..., dict[str, torch.Tensor]], pad_id: int, device: torch.device,
) -> dict[str, float]:
    """The held-out metrics, with the trained module in eval mode and no input noise (each process scores all of
    them: the same numbers everywhere, no collective calls)."""
    # every root scores every depth (no COD sampling of P-EAGLE slots): the held-out metrics of all of them
    quiet = dataclasses.replace(config, loss=dataclasses.replace(config.loss, input_noise=0.0, parallel_slot_ratio=1.0))
    model.eval()
    try:
        metrics = evaluate(
            lambda batch: compute_loss(quiet, model, heads, target, batch, []),
            eval_examples, lambda rows: make_batch(rows, pad_id), config.micro_batch_size, device, progress=False,
        )
    finally:
        model.train()
    return {f"eval_{k}": v for k, v in metrics.items()}


# --- the run --------------------------------------------------------------------------------------------
def train(config: RunConfig) -> dict[str, Any]:
    """Train heads as `config` says; resume from the latest checkpoint in output_dir if there is one.

    Returns:
        Final metrics (also written to output_dir/final/README.md and output_dir/metrics.json); with periodic
        held-out evaluation and `save_best`, the best heads are in output_dir/best (best_step, best_eval_sim_tau).
    """
    if config.head.type == DRAFT_MODEL_HEAD_TYPE:  # a draft model, not heads: training/distill.py
        from specheads.training.distill import distill

        return distill(config)
    # setup (output_dir is checked first: an unwritable folder fails now, not at the first save)
    check_writable_dir(config.output_dir, "output_dir")
    accelerator = make_accelerator(config)
    world, rank = accelerator.num_processes, accelerator.process_index
    accelerator.gradient_accumulation_steps = config.gradient_accumulation_steps(world)
    set_seed(config.seed)
    target, tokenizer = load_target(config.target, device=accelerator.device)
    heads = initial_heads(config, target)
    heads.train()
    if config.head.type == "eagle3":
        chain = wants_ttt_chain_attention(config.loss.ttt_attention, accelerator.device)
        if chain:
            use_ttt_chain_attention(heads)  # this run's TTT unroll: each query scores its own chain (no dense masks)
        accelerator.print(f"[specheads] TTT attention: {'chain' if chain else 'dense'} "
                          f"(loss.ttt_attention={config.loss.ttt_attention} on {accelerator.device.type})")
    # Medusa-2 (joint.enabled): the heads plus a LoRA adapter on the target, trained as one module
    joint = JointMedusa(target, heads, config.joint) if config.joint.enabled else None
    trained: torch.nn.Module = heads if joint is None else joint
    trainable = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    check_free_disk(config.output_dir, training_disk_bytes(trainable, config.save_total_limit),
                    f"training {trainable} parameters (save_total_limit={config.save_total_limit})")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if config.feature_mode == "offline":
        if not logits_are_lm_head_of_final_state(target):
            transforms = ", ".join(f"{name}={value}" for name, value in logit_transforms(target).items())
            raise ValueError(
                f"feature_mode=offline makes the labels as lm_head(final state), but {config.target}'s config scales "
                f"or caps its logits ({transforms}): train with feature_mode=online"
            )
        examples: Any = OfflineFeatures(config.data.features_dir)
        lengths, make_batch = examples.lengths(), collate_offline
    # a vision-language target reads the records' images while making features (image_records.py)
    processor = image_processor_for(config.target) if takes_images(target) else None
    if config.feature_mode != "offline":
        exclude = benchmark_prompts(config.data.exclude_prompts) if config.data.exclude_prompts else None
        examples = build_dataset(config.data.source, tokenizer, config.data.format, config.data.max_length,
                                 progress=accelerator.is_local_main_process, exclude=exclude, processor=processor,
                                 image_folder=config.data.image_folder,
                                 chat_template_kwargs=config.data.chat_template_kwargs)
        lengths, make_batch = list(examples["length"]), collate_for(examples, processor)
        if joint is not None and has_image_rows(examples):
            raise ValueError("joint.enabled=true (Medusa-2) trains on text records only; the data holds records with "
                             "images (train the heads alone: joint.enabled=false)")
    train_indices, eval_examples, eval_collate = held_out_examples(config, examples, tokenizer, make_batch,
                                                                   progress=accelerator.is_local_main_process,
                                                                   processor=processor)
    if eval_examples is not None:
        accelerator.print(f"[specheads] evaluating on {len(eval_examples)} held-out examples "
                          f"({'data.eval_source' if config.data.eval_source else 'data.eval_fraction'}), "
                          f"training on {len(train_indices)}")
    token_counts = None
    if config.head.type in TAPPING_HEADS:
        if config.feature_mode == "offline" and examples.tapped_layers != heads.config.feature_layers:
            raise ValueError(
                f"the feature dump {config.data.features_dir} holds tapped_layers={examples.tapped_layers} but these "
                f"{config.head.type} heads read feature_layers={heads.config.feature_layers}: dump again with `specheads "
                f"data dump-features --head-type {config.head.type} --feature-layers {','.join(map(str, heads.config.feature_layers))}` "
                "or train with feature_mode=online"
            )
    if config.head.type == "eagle3" or heads.draft_vocab_size < heads.config.vocab_size:
        # the reduced draft vocabulary: a pure function of the data (EAGLE-3's lm_head predicts it; EAGLE heads
        # with eagle_draft_vocab_size draft over it), so every process computes the same one
        token_counts = trained_token_counts(examples, heads.config.vocab_size, train_indices)
        # a resumed run gets its vocabulary back with the checkpoint, heads from init_heads keep theirs
        if latest_checkpoint(config.output_dir) is None and config.init_heads is None:
            vocab = build_draft_vocab(token_counts, heads.draft_vocab_size, special_token_ids(tokenizer, target))
            if config.head.type == "eagle3":
                heads.set_draft_vocab(vocab.draft_to_target, init_lm_head_from_target=True)
            else:
                heads.set_draft_vocab(vocab.draft_to_target)
    order = BatchOrder([lengths[i] for i in train_indices], config.global_batch_size, config.seed,
                       config.data.bucket_by_length)
    params = heads.parameters() if joint is None else joint.param_groups(config.optim.learning_rate,
                                                                         config.joint.head_lr_multiplier)
    optimizer = torch.optim.AdamW(
        params, lr=config.optim.learning_rate, betas=tuple(config.optim.betas),
        weight_decay=config.optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    fill_deepspeed_config(accelerator, config)
    model, optimizer, scheduler = accelerator.prepare(trained, optimizer, scheduler)
    if joint is not None:
        keep_trainable_weights_only(accelerator)  # checkpoints: heads + adapter, not the frozen target
    resume, start_step, finished = resume_state(accelerator, config)
    if finished is not None:  # trained to max_steps, or stopped early: nothing to do
        return finished
    # output_dir/best: heads of the best periodic held-out evaluation (the main process writes it)
    keep_best = config.save_best and eval_examples is not None and config.eval_steps > 0
    best = BestHeads(config.output_dir, fresh_run=resume is None) if keep_best and accelerator.is_main_process else None
    init_trackers(accelerator, config)
    coverage = None if token_counts is None else vocab_coverage(token_counts, heads.d2t.cpu())
    if coverage is not None:
        accelerator.print(f"[specheads] draft vocabulary: {heads.draft_vocab_size} of {heads.config.vocab_size} "
                          f"tokens, covering {coverage:.2%} of the trained tokens")
        if config.trackers:
            accelerator.log({"train/draft_vocab_coverage": coverage}, step=start_step)

    # train
    bar = tqdm(total=config.max_steps, initial=start_step, desc=f"train {config.head.type}",
               disable=not accelerator.is_local_main_process)
    started, tokens_seen = time.time(), 0
    last: dict[str, float] = {}
    early_stopped = False
    for step in range(start_step, config.max_steps):
        step_config = loss_config_at(config, step)  # progressive TTT depth (loss.ttt_steps_warmup), else config
        micro_batches = micro_batches_for_process(order.global_batch(step), config.micro_batch_size, rank, world)
        sums: dict[str, float] = {}
        for indices in micro_batches:
            rows = [examples[train_indices[j]] for j in indices]
            batch = batch_to(make_batch(rows, pad_id), accelerator.device)
            seeds = [(config.seed * 1_000_003 + step * 100_003 + j) % 2**62 for j in indices]
            # accumulate: gradients are all-reduced and the optimizer steps only on the last micro-batch,
            # and backward divides the loss by the accumulation steps (DeepSpeed handles it the same way)
            with accelerator.accumulate(model):
                out = compute_loss(step_config, model, heads, target, batch, seeds, accelerator.autocast)
                optimizer_step(accelerator, model, optimizer, scheduler, out.loss, config.optim.max_grad_norm)
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + value / len(micro_batches)
            tokens_seen += int(batch["attention_mask"].sum()) * world
        done = step + 1
        last = step_metrics(accelerator, config, done, sums, scheduler, bar)
        evaluating = eval_examples is not None and config.eval_steps and done % config.eval_steps == 0
        if evaluating and done < config.max_steps:
            held_out = evaluate_during_training(config, model, heads, target, eval_examples, eval_collate, pad_id,
                                                accelerator.device)
            early_stopped = after_evaluation(accelerator, config, done, held_out, model, best, last)
        timed_out = out_of_time(accelerator, config, started)
        if done % config.save_steps == 0 or done == config.max_steps or timed_out or early_stopped:
            save_checkpoint(accelerator, config.output_dir, done, config.save_total_limit)
        if early_stopped:
            accelerator.print(f"[specheads] early stop at step {done}: {config.early_stopping_patience} held-out "
                              "evaluations in a row without a better sim_tau (the best heads are in "
                              f"{Path(config.output_dir) / BEST_DIR})")
            break
        if timed_out and done < config.max_steps:
            accelerator.print(f"[specheads] time_limit_minutes={config.time_limit_minutes} reached at step {done}: "
                              "saving final heads now (run the same command again to continue to max_steps)")
            break
        if config.stop_after_steps is not None and done >= config.stop_after_steps and done < config.max_steps:
            bar.close()
            accelerator.end_training()
            return {"stopped_at_step": done, **last}
    bar.close()

    # save
    metrics = {**last, **({"init_heads": config.init_heads} if config.init_heads else {}), "steps": done if config.max_steps > start_step else config.max_steps, "world_size": world, "training_seconds": round(time.time() - started, 2),
               "tokens_seen_this_session": tokens_seen,
               "mixed_precision": accelerator.mixed_precision}  # "no" | "bf16" (CPU autocast too) | "fp16"
    if early_stopped:
        metrics.update(early_stopped=True, early_stopping_patience=config.early_stopping_patience)
    if coverage is not None:  # over the whole training data (the logged per-step value is the batch's)
        metrics["draft_vocab_coverage"] = coverage
    if eval_examples is not None:  # the held-out scores of the final heads (checked to be scorable at the start)
        metrics.update(evaluate_during_training(config, model, heads, target, eval_examples, eval_collate, pad_id,
                                                accelerator.device))
        accelerator.print(f"[specheads] held-out: acc {metrics['eval_acc']:.3f}, sim_tau {metrics['eval_sim_tau']:.2f} "
                          f"(last training batch: acc {last.get('acc', float('nan')):.3f})")
        if config.trackers:
            accelerator.log({f"eval/{k[5:]}": v for k, v in metrics.items() if k.startswith("eval_")}, step=done)
    save_final(accelerator, config, model, done, metrics, best, save_heads)
    accelerator.end_training()
    if config.push_to_hub and accelerator.is_main_process:  # after the other processes are done: none waits on it
        pushed = Path(config.output_dir) / (BEST_DIR if best is not None else "final")
        try:
            url = push_heads_folder(pushed, config.push_to_hub, private=config.hub_private)
        except OSError as err:
            raise OSError(f"{err}\nThe heads are saved in {pushed}; push them again with `specheads push {pushed} "
                          f"--repo-id {config.push_to_hub}`") from err
        accelerator.print(f"[specheads] pushed {pushed} to {config.push_to_hub}: {url}")
    return metrics


def train_from_config_file(config_path: str | None, overrides: list[str]) -> None:
    """Entry point of `specheads train [CONFIG.yaml] [key=value ...]`: without a YAML (its place taken by the first
    `key=value`), the run starts from RunConfig's defaults."""
    if config_path is not None and "=" in config_path and not Path(config_path).is_file():
        config_path, overrides = None, [config_path, *overrides]
    train(load_run_config(config_path, overrides))
