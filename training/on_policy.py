"""On-policy distillation: some batches hold the draft model's own answers (DistillSpec's on-policy data, GKD).

A draft model is trained on text the target wrote, but at inference it drafts from its own guesses: DistillSpec (Zhou
et al., ICLR 2024) and GKD (Agarwal et al., ICLR 2024) find distillation gains most when the draft is also trained on
sequences it generates itself, scored token by token by the target. With `distill.on_policy=λ`, each step's batch is,
with probability λ, replaced by the draft's answers to the same prompts: each row keeps its tokens up to its first
trained one (the prompt), and the draft samples the rest, as many tokens as the row's answer had (fewer where it ends
with EOS), at `distill.temperature`. The loss then compares both models' distributions on those tokens, as on any
batch (the target is run online on them).

Which steps are on-policy, and what the draft samples, are pure functions of (seed, step, row): a resumed run draws
the same batches (its draft is the checkpoint's, so the samples are the same too).
"""

from __future__ import annotations

import random

import torch
from transformers import GenerationConfig, PreTrainedModel

from specheads.training.data import collate


def is_on_policy_step(seed: int, step: int, fraction: float) -> bool:
    """Whether `step`'s batch is the draft's own answers (probability `fraction`, the same in every process)."""
    return fraction > 0 and random.Random(f"on-policy:{seed}:{step}").random() < fraction


@torch.no_grad()
def draft_answers(
    draft: PreTrainedModel, batch: dict[str, torch.Tensor], pad_token_id: int, temperature: float, seed: int
) -> dict[str, torch.Tensor]:
    """`batch` with each row's answer replaced by one the draft model samples (see the module docstring).

    Args:
        draft: the draft model (eval mode is set while it samples, then put back).
        batch: input_ids, attention_mask, loss_mask (B, T), right-padded (`collate`).
        pad_token_id: the padding id of the new batch.
        temperature: the sampling temperature (the run's `distill.temperature`).
        seed: the seed of the samples (CPU and CUDA generators forked: the run's own random state is untouched).

    Returns:
        A right-padded batch on the same device: per row the prompt (loss 0) and the draft's answer (loss 1), which
        ends at its first EOS; a row without trained tokens, or without a prompt before them, is kept as it was.
    """
    device, was_training = batch["input_ids"].device, draft.training
    eos = draft.generation_config.eos_token_id if draft.generation_config is not None else None
    eos_ids = set([eos] if isinstance(eos, int) else eos or [])
    rows: list[dict[str, list[int]]] = []
    answered: list[tuple[int, list[int], int]] = []  # (row, prompt ids, answer length) of the rows the draft answers
    for b in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][b].sum())
        ids, loss_mask = batch["input_ids"][b, :length].tolist(), batch["loss_mask"][b, :length].tolist()
        start = loss_mask.index(1) if 1 in loss_mask else 0
        rows.append({"input_ids": ids, "loss_mask": loss_mask})
        if start > 0:
            answered.append((b, ids[:start], length - start))
    if answered:
        width = max(len(prompt) for _, prompt, _ in answered)  # left-padded prompts, one generate call
        prompts = torch.tensor([[pad_token_id] * (width - len(p)) + p for _, p, _ in answered], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in answered], device=device)
        settings = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                    max_new_tokens=max(n for _, _, n in answered), pad_token_id=pad_token_id,
                                    eos_token_id=eos)
        draft.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                out = draft.generate(prompts, attention_mask=mask, generation_config=settings)[:, width:].tolist()
        finally:
            draft.train(was_training)
        for (b, prompt, answer_length), sampled in zip(answered, out, strict=True):
            answer = sampled[:answer_length]
            ends = [i for i, token in enumerate(answer) if token in eos_ids]
            answer = answer[: ends[0] + 1] if ends else answer
            rows[b] = {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    return {k: v.to(device) for k, v in collate(rows, pad_token_id).items()}
