"""The loss of a draft model distilled on the target (DistillSpec): a divergence between their next-token distributions.

Speculative sampling accepts a drafted token with probability sum_x min(p(x), q(x)) = 1 - TVD(p, q) (Leviathan et al.,
2023), where p is the target's next-token distribution and q the draft model's; greedy verification accepts it when
both argmaxes agree. DistillSpec (Zhou et al., ICLR 2024) trains q towards p on text the target wrote, and finds the
best divergence depends on the task and decoding: forward KL(p || q) ("fkl", the default: plain distillation, the
draft covers all of p), reverse KL(q || p) ("rkl", mode seeking) and total variation ("tvd", 1 - the acceptance rate
itself). `loss.labels=tokens` trains on the data's next tokens instead (plain fine-tuning on the target's answers).

Both models read the same tokens, so their distributions are compared position by position: only at the positions
whose next token is trained (the assistant's), and only over the ids the draft model can draft (the first V of a
vocabulary padded to another size than the target's; the target's mass past them is mass the draft never proposes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specheads.training.config import DistillSection, LossSection
from specheads.training.features import can_skip_logits
from specheads.training.losses import LossOutput, chain_acceptance
from specheads.training.target_labels import labelled_positions
from specheads.training.ttt import shift_left

# a floor for log p where the target gives a token no mass at all (-inf logits): reverse KL stays finite
LOG_PROB_FLOOR = -1e4


def logits_at(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              positions: tuple[torch.Tensor, torch.Tensor], module: PreTrainedModel | None = None) -> torch.Tensor:
    """(R, V) the causal LM's logits at the R (batch, position) `positions` of the (B, T) batch.

    The forward runs through `model` (the prepared, e.g. DDP-wrapped, module when training; `module` is the plain
    model inside it, default `model`). Its lm_head runs on those rows only (prompt and padding positions, about half
    of a chat batch, never make their (h x V) product) unless the model scales or caps its logits after the lm_head
    (Gemma 2, Cohere) or its forward cannot skip them: then its own forward makes them all.
    """
    module = model if module is None else module
    if not can_skip_logits(module):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[positions]
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True,
                logits_to_keep=1)
    head = module.get_output_embeddings()
    return head(out.hidden_states[-1][positions].to(head.weight.dtype))  # the final (post-norm) states (R, h)


def divergence_per_row(log_p: torch.Tensor, log_q: torch.Tensor, divergence: str) -> torch.Tensor:
    """(R,) the divergence between the target's (R, V) log-probabilities `log_p` and the draft's `log_q` (float32)."""
    p = log_p.exp()
    if divergence == "fkl":  # KL(p || q) = sum p (log p - log q), 0 where p is 0
        return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    q = log_q.exp()
    if divergence == "rkl":  # KL(q || p)
        return (q * (log_q - log_p.clamp_min(LOG_PROB_FLOOR))).sum(-1)
    if divergence == "tvd":  # 1/2 sum |p - q| = 1 - sum min(p, q)
        return 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"distill.divergence={divergence!r} is unknown; expected fkl, rkl or tvd")


def distill_loss(
    model: torch.nn.Module, draft: PreTrainedModel, target: PreTrainedModel, batch: dict[str, torch.Tensor],
    distill: DistillSection, loss: LossSection,
) -> LossOutput:
    """The draft model's loss against the frozen target on one batch.

    Args:
        model: the draft model as training runs it (prepared by Accelerate: DDP, DeepSpeed), or `draft` itself.
        draft: the draft model being trained (its first V output rows are the ids it drafts).
        target: the frozen target (no gradients).
        batch: input_ids, attention_mask, loss_mask (B, T): the data the target wrote (or any text).
        distill: which divergence, at which temperature (`accept` is then the acceptance of a draft sampled at it).
        loss: `labels` (target: distil the distributions | tokens: the data's next tokens) and `eval_depth` (the
            greedy chain length sim_tau counts).

    Returns:
        The loss to minimise and metrics: loss, acc (the draft's argmax is the target's: a greedy draft is accepted),
        accept (sum min(p, q): the chance one sampled draft is accepted, at `distill.temperature`), sim_tau
        (accepted length of a greedy draft chain of `eval_depth` tokens, as heads report it; exact when the data is
        the target's own greedy text).
    """
    ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    positions = labelled_positions(loss_mask)  # (R,), (R,): position p predicts the trained token x_{p+1}
    with torch.no_grad():
        target_logits = logits_at(target, ids, attention, positions).float()  # (R, V_target)
    draft_logits = logits_at(model, ids, attention, positions, draft)
    vocab = min(draft_logits.shape[-1], target_logits.shape[-1])
    temperature = distill.temperature  # both distributions as they are sampled (argmaxes are unchanged)
    log_q = F.log_softmax(draft_logits[:, :vocab].float() / temperature, dim=-1)  # (R, V)
    # the target's whole distribution, cut to the draft's ids
    log_p = F.log_softmax(target_logits / temperature, dim=-1)[:, :vocab]
    if loss.labels == "tokens":
        per_row = F.nll_loss(log_q, ids[positions[0], positions[1] + 1], reduction="none")
    else:
        per_row = divergence_per_row(log_p, log_q, distill.divergence)
    value = per_row.mean() if per_row.numel() else draft_logits.sum() * 0.0  # no trained rows: a zero in the graph
    with torch.no_grad():
        hits = log_q.argmax(-1) == target_logits.argmax(-1)  # (R,)
        accept = torch.minimum(log_p.exp(), log_q.exp()).sum(-1)  # (R,)
        hit_at = torch.zeros_like(loss_mask, dtype=torch.bool)  # (B, T): the greedy draft at p is accepted
        hit_at[positions] = hits
        valid = torch.zeros_like(hit_at)
        valid[positions] = True
        # the chain drafted at p: depth d+1 is right when the drafts at p .. p+d all are (each reads the accepted text)
        seq_len = hit_at.shape[1]
        correct = [shift_left(hit_at, d, seq_len, False) & shift_left(valid, d, seq_len, False)
                   for d in range(loss.eval_depth)]
        rows = max(hits.numel(), 1)
        metrics = {"loss": float(value), "acc": float(hits.sum()) / rows, "accept": float(accept.sum()) / rows,
                   "sim_tau": chain_acceptance(correct, valid)}
    return LossOutput(value, metrics)
