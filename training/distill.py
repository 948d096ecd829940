"""Distil a draft model for the target (DistillSpec): `specheads train head.type=draft_model distill.draft_model=M`.

Heads read the target's features; a draft model reads tokens and drafts on its own (heads/draft_model.py). Any small
model with the target's tokenizer drafts untrained, but how often the target accepts its guesses depends on how
closely it follows the target; DistillSpec (Zhou et al., ICLR 2024) aligns it by training on text the target wrote
(`specheads data regenerate`) with a divergence between both next-token distributions (training/distill_loss.py).
Where no smaller sibling exists, `distill.draft_model=early-exit:N` starts from a standalone copy of the target's own
first N layers, its norm and lm_head (self-speculation's draft, LayerSkip-style, but trained and with weights of its
own, so the target is left exactly as it was). `distill.lora_r=R` trains a LoRA adapter of the draft model instead of
all its weights (a 1B draft for a 70B target), merged into the folders it saves.

    specheads train configs/train/distill_stories260k.yaml
    specheads generate --target stories260K --draft-model runs/distill_stories260k/final --prompt "Once"

The run is the heads' run (training/train.py) in everything else: one Accelerate loop (DDP, DeepSpeed, mixed
precision), batches a pure function of (seed, step), atomic checkpoints with exact resume, held-out evaluation with
`output_dir/best` and early stopping, trackers, a time limit. `output_dir/final` (and `best`) is a plain transformers
model folder (weights, config, tokenizer, a model card with the metrics) that `--draft-model` takes.
`distill.on_policy=λ` trains a share λ of the steps on the draft's own sampled answers (training/on_policy.py).
"""

from __future__ import annotations

import copy
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specheads.heads.draft_model import early_exit_layers_of, early_exit_model, same_vocabulary
from specheads.inference.target_support import tree_verification_problem
from specheads.targets import load_target
from specheads.training.best_heads import BEST_DIR, BestHeads, replace_folder_atomically
from specheads.training.checkpoints import save_checkpoint
from specheads.training.config import RunConfig
from specheads.training.data import BatchOrder, batch_to, build_dataset, collate, micro_batches_for_process
from specheads.training.distill_loss import distill_loss
from specheads.training.evaluate import evaluate
from specheads.training.joint_lora import keep_trainable_weights_only, wrap_with_lora
from specheads.training.on_policy import draft_answers, is_on_policy_step
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
from specheads.training.train import fill_deepspeed_config, held_out_examples, lr_lambda, make_accelerator

MODEL_CARD = """---
library_name: transformers
tags: [speculative-decoding, draft-model, specheads]
base_model: {target}
---

# Draft model for `{target}`, distilled with specheads

A causal LM trained to follow `{target}`'s next-token distributions ({how}), so that it drafts tokens the target
accepts. Outputs stay exactly the target's whatever the draft (greedy identical, sampling exact); the draft only sets
the speed.

```bash
specheads generate --target {target} --draft-model path/to/this/folder --prompt "..."
```

## Metrics

```json
{metrics}
```

`acc`: the draft's argmax is the target's (a greedy draft accepted); `accept`: sum min(p, q), the chance one sampled
draft is accepted (at temperature {temperature}); `sim_tau`: the accepted length of a greedy chain of drafts; `eval_*`:
the same on held-out data.
"""


def initial_draft_model(config: RunConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The model `distill.draft_model` names, in float32 on the target's device, ready to train.

    Raises:
        ValueError: early-exit:N out of range, a draft model with another tokenizer (distributions are compared token
            by token), or one that could not draft token trees.
    """
    name = config.distill.draft_model
    try:
        layers = early_exit_layers_of(name)
    except ValueError as err:
        raise ValueError(f"distill.draft_model={err}") from err
    if layers is not None:
        # deepcopy of the shared-module early exit: the same layers with weights of their own (ties kept)
        draft = copy.deepcopy(early_exit_model(target, layers)).float()
        draft.config.name_or_path = ""
    else:
        draft, draft_tokenizer = load_target(name, dtype=torch.float32, device=target.device)
        if not same_vocabulary(tokenizer, draft_tokenizer):
            raise ValueError(f"distill.draft_model={name!r} has another tokenizer than the target {config.target!r}: "
                             "distillation compares both next-token distributions token by token, so it needs the "
                             "target's tokenizer (pick a model of the target's family, or early-exit:N)")
    problem = tree_verification_problem(draft)
    if problem is not None:
        raise ValueError(f"distill.draft_model={name!r} could not draft token trees: {problem}")
    draft.train().requires_grad_(True)
    if config.distill.lora_r:  # only a LoRA adapter trains (merged into the saved folders)
        lora = config.distill
        return wrap_with_lora(draft, lora.lora_r, lora.lora_alpha, lora.target_modules, section="distill").train()
    if config.distill.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    return draft


def plain_model(model: PreTrainedModel) -> PreTrainedModel:
    """`model`, or for a peft-wrapped one a copy with its adapter merged in (what a saved draft folder holds)."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def save_draft_model(model: PreTrainedModel, folder: Path, metrics: dict[str, Any], extra_files: dict[str, str],
                     tokenizer: PreTrainedTokenizerBase, config: RunConfig) -> None:
    """Write the draft model, its tokenizer and a model card with `metrics` to `folder`, atomically."""
    how = f"{config.distill.divergence} on the target's distributions at temperature {config.distill.temperature}" \
        if config.loss.labels == "target" else "next tokens of text the target wrote"
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}

    def write(tmp: Path) -> None:
        plain_model(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        card = MODEL_CARD.format(target=config.target, how=how, metrics=json.dumps(shown, indent=2),
                                 temperature=config.distill.temperature)
        (tmp / "README.md").write_text(card)
        for file_name, text in extra_files.items():
            (tmp / file_name).write_text(text)

    replace_folder_atomically(folder, write)


def push_draft_model(folder: Path, repo_id: str, private: bool) -> str:
    """Upload the draft model folder to the Hub repository `repo_id` (created if needed); the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Upload a specheads draft model")
    except Exception as err:  # no network, no token, no write access: many error types, one message
        raise OSError(f"pushing {folder} to the Hub repository {repo_id!r} failed: {err}\nThe draft model is saved in "
                      f"{folder}; upload it with `huggingface-cli upload {repo_id} {folder}`") from err
    return str(getattr(commit, "commit_url", commit))


def distill(config: RunConfig) -> dict[str, Any]:
    """Train the draft model as `config` says; resume from the latest checkpoint in output_dir if there is one.

    Returns:
        Final metrics (also in output_dir/metrics.json and the model card of output_dir/final); with periodic held-out
        evaluation and `save_best`, the best draft model is in output_dir/best.
    """
    check_writable_dir(config.output_dir, "output_dir")
    accelerator = make_accelerator(config)
    world, rank = accelerator.num_processes, accelerator.process_index
    accelerator.gradient_accumulation_steps = config.gradient_accumulation_steps(world)
    set_seed(config.seed)
    target, tokenizer = load_target(config.target, device=accelerator.device)
    if target.config.get_text_config() is not target.config:
        raise ValueError(f"distilling a draft model takes a text-only target; {config.target!r} is multimodal")
    draft = initial_draft_model(config, target, tokenizer)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    accelerator.print(f"[specheads] distilling {config.distill.draft_model} ({trainable / 1e6:.2f}M trained parameters) "
                      f"on {config.target} ({config.distill.divergence if config.loss.labels == 'target' else 'tokens'})")
    check_free_disk(config.output_dir, training_disk_bytes(trainable, config.save_total_limit),
                    f"training {trainable} parameters (save_total_limit={config.save_total_limit})")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    exclude = benchmark_prompts(config.data.exclude_prompts) if config.data.exclude_prompts else None
    examples = build_dataset(config.data.source, tokenizer, config.data.format, config.data.max_length,
                             progress=accelerator.is_local_main_process, exclude=exclude,
                             chat_template_kwargs=config.data.chat_template_kwargs)
    train_indices, eval_examples, _ = held_out_examples(config, examples, tokenizer, collate,
                                                        progress=accelerator.is_local_main_process)
    lengths = list(examples["length"])
    order = BatchOrder([lengths[i] for i in train_indices], config.global_batch_size, config.seed,
                       config.data.bucket_by_length)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=config.optim.learning_rate,
                                  betas=tuple(config.optim.betas), weight_decay=config.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    fill_deepspeed_config(accelerator, config)
    model, optimizer, scheduler = accelerator.prepare(draft, optimizer, scheduler)
    if config.distill.lora_r:
        keep_trainable_weights_only(accelerator)  # checkpoints: the adapter, not the frozen draft weights
    resume, start_step, finished = resume_state(accelerator, config)
    if finished is not None:  # trained to max_steps, or stopped early: nothing to do
        return finished
    save = partial(save_draft_model, tokenizer=tokenizer, config=config)
    keep_best = config.save_best and eval_examples is not None and config.eval_steps > 0
    best = BestHeads(config.output_dir, resume is None, save) if keep_best and accelerator.is_main_process else None
    init_trackers(accelerator, config)

    def held_out() -> dict[str, float]:
        model.eval()
        try:
            metrics = evaluate(lambda batch: distill_loss(model, draft, target, batch, config.distill, config.loss),
                               eval_examples, lambda rows: collate(rows, pad_id), config.micro_batch_size,
                               accelerator.device, progress=False)
        finally:
            model.train()
        return {f"eval_{k}": v for k, v in metrics.items()}

    bar = tqdm(total=config.max_steps, initial=start_step, desc="distill draft model",
               disable=not accelerator.is_local_main_process)
    started, tokens_seen, done = time.time(), 0, start_step
    last: dict[str, float] = {}
    early_stopped = False
    for step in range(start_step, config.max_steps):
        micro_batches = micro_batches_for_process(order.global_batch(step), config.micro_batch_size, rank, world)
        on_policy = is_on_policy_step(config.seed, step, config.distill.on_policy)
        sums: dict[str, float] = {"on_policy": float(on_policy)}
        for m, indices in enumerate(micro_batches):
            batch = batch_to(collate([examples[train_indices[j]] for j in indices], pad_id), accelerator.device)
            if on_policy:  # the draft's own answers to these prompts (seeded by run, step, process, micro batch)
                seed = (((config.seed * 1_000_003 + step) * 4099 + rank) * 8191 + m) % 2**63
                batch = draft_answers(draft, batch, pad_id, config.distill.temperature, seed)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    out = distill_loss(model, draft, target, batch, config.distill, config.loss)
                optimizer_step(accelerator, model, optimizer, scheduler, out.loss, config.optim.max_grad_norm)
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + value / len(micro_batches)
            tokens_seen += int(batch["attention_mask"].sum()) * world
        done = step + 1
        last = step_metrics(accelerator, config, done, sums, scheduler, bar)
        if eval_examples is not None and config.eval_steps and done % config.eval_steps == 0 and done < config.max_steps:
            early_stopped = after_evaluation(accelerator, config, done, held_out(), model, best, last)
        timed_out = out_of_time(accelerator, config, started)
        if done % config.save_steps == 0 or done == config.max_steps or timed_out or early_stopped:
            save_checkpoint(accelerator, config.output_dir, done, config.save_total_limit)
        if early_stopped or (timed_out and done < config.max_steps):
            accelerator.print(f"[specheads] {'early stop' if early_stopped else 'time limit'} at step {done}: saving the "
                              "final draft model now")
            break
        if config.stop_after_steps is not None and config.stop_after_steps <= done < config.max_steps:
            bar.close()
            accelerator.end_training()
            return {"stopped_at_step": done, **last}
    bar.close()

    metrics: dict[str, Any] = {**last, "steps": done, "world_size": world, "draft_model": config.distill.draft_model,
                               "training_seconds": round(time.time() - started, 2),
                               "tokens_seen_this_session": tokens_seen, "mixed_precision": accelerator.mixed_precision}
    if early_stopped:
        metrics.update(early_stopped=True, early_stopping_patience=config.early_stopping_patience)
    if eval_examples is not None:
        metrics.update(held_out())
        accelerator.print(f"[specheads] held-out: acc {metrics['eval_acc']:.3f}, accept {metrics['eval_accept']:.3f}, "
                          f"sim_tau {metrics['eval_sim_tau']:.2f}")
        if config.trackers:
            accelerator.log({f"eval/{k[5:]}": v for k, v in metrics.items() if k.startswith("eval_")}, step=done)
    save_final(accelerator, config, model, done, metrics, best, save)
    accelerator.end_training()
    if config.push_to_hub and accelerator.is_main_process:
        pushed = Path(config.output_dir) / (BEST_DIR if best is not None else "final")
        url = push_draft_model(pushed, config.push_to_hub, config.hub_private)
        accelerator.print(f"[specheads] pushed {pushed} to {config.push_to_hub}: {url}")
    return metrics
