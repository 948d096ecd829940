"""Training losses of draft heads, and per-depth top-1 accuracy as a simulated acceptance.

Alignment (x_0 .. x_{T-1} a sequence, f_t the target's feature after reading x_t, and the target's own
lm_head(f_t) predicting x_{t+1}):

    Medusa head k (0-based) at position t predicts x_{t+k+2}; its label is the target's distribution at
        position t+k+1 (labels="target") or the data's token x_{t+k+2} (labels="tokens").
    EAGLE at position t reads (f_t, x_{t+1}) and predicts f_{t+1}: smooth-L1 against the real f_{t+1}, plus
        cross-entropy of lm_head(prediction) against the target's distribution at t+1 (or x_{t+2}).
    EAGLE-3 (training-time test, training/ttt.py) at step i and index t predicts x_{t+2+i} from its own step
        i-1 output; its label is the target's distribution at t+1+i restricted to the draft vocabulary.

A position counts when the token it predicts is trained (`loss_mask`, 1 on assistant tokens).
Accuracy at depth d compares the draft's argmax with the target's own argmax (what greedy decoding accepts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specheads.training.chain_attention import uses_ttt_chain_attention
from specheads.training.config import LossSection
from specheads.training.target_labels import TargetLabels, as_target_labels, label_cross_entropy
from specheads.training.ttt import cod_slot_roots, shift_left, unroll_ttt


@dataclass
class LossOutput:
    """The scalar loss to back-propagate and detached metrics to log."""

    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (0 when the mask is empty). Shapes match, e.g. (B, T)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def rows_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of per-row values (M,), 0 when M == 0 (still in the graph: every parameter gets a gradient)."""
    return masked_mean(values, torch.ones_like(values))


def hits_at(hit_rows: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """Per-row hits (M,) placed at `rows` ((M,) batch, (M,) position) of a (B, n) bool grid; elsewhere misses."""
    hit = torch.zeros(shape, dtype=torch.bool, device=hit_rows.device)
    hit[rows] = hit_rows
    return hit


def chain_acceptance(correct: list[torch.Tensor], valid: torch.Tensor) -> float:
    """Expected accepted length 1 + sum_d P(depths 1..d all correct), from per-depth (B, T) correctness.

    `correct[d][b, t]` says whether the depth-(d+1) draft of the chain starting at position t is right.
    """
    if not correct:
        return 1.0
    chain = torch.ones_like(correct[0], dtype=torch.bool)
    total = 1.0
    for c in correct:
        chain = chain & c
        total += float(masked_mean(chain.float(), valid))
    return total


def medusa_rows(loss_mask: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions t some Medusa head is trained at: x_{t+k+2} trained for a k < num_heads. (B, T) -> (M,), (M,)."""
    batch, seq_len = loss_mask.shape
    needed = torch.zeros(batch, seq_len, dtype=torch.bool, device=loss_mask.device)
    for k in range(num_heads):
        needed[:, : max(seq_len - k - 2, 0)] |= loss_mask[:, k + 2:].bool()
    return needed.nonzero(as_tuple=True)


def medusa_loss(
    logits: torch.Tensor,
    target_logits: torch.Tensor | TargetLabels,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossSection,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LossOutput:
    """Cross-entropy per Medusa head, head k weighted by medusa_decay**k.

    Args:
        logits: (K, B, T, V) head logits; head k at position t predicts x_{t+k+2}. With `rows`: (K, M, V), the
            logits at those positions only (`medusa_rows`: the heads' (h x V) projections skip the others).
        target_logits: (B, T, V) the target's logits (position t predicts x_{t+1}), or the `TargetLabels` made
            from them.
        input_ids: (B, T) tokens.
        loss_mask: (B, T) 1 where predicting that token is trained (0 on prompts and padding).
        config: loss weights.
        rows: (M,) batch and (M,) position indices of `logits`, or None (dense logits).

    Returns:
        The weighted loss; metrics loss_head{k}, acc_depth{k}, acc and sim_tau (a chain stops at an untrained token).
    """
    batch, seq_len = input_ids.shape
    labels = as_target_labels(target_logits, loss_mask, None, config.labels == "target", config.argmax_label_weight)
    if rows is None:
        rows = medusa_rows(loss_mask, logits.shape[0])
        logits = logits[:, rows[0], rows[1]]  # (K, M, V)
    rows_b, rows_t = rows
    total = logits.new_zeros(())
    metrics: dict[str, float] = {}
    correct: list[torch.Tensor] = []
    valid0 = loss_mask[:, 2:].bool()  # (B, T-2): positions whose first draft token is trained
    for k in range(logits.shape[0]):
        if seq_len - k - 2 <= 0:
            break
        label_pos = (rows_t + k + 2).clamp(max=seq_len - 1)  # (M,): x_{t+k+2}
        valid = (rows_t + k + 2 < seq_len) & loss_mask[rows_b, label_pos].bool()  # (M,)
        b, t, head_logits = rows_b[valid], rows_t[valid], logits[k][valid]  # (m,), (m,), (m, V)
        label_rows = labels.row_of[b, t + k + 1]  # (m,): the target at t+k+1
        ce, head_top1 = label_cross_entropy(head_logits, labels, label_rows, input_ids[b, t + k + 2])  # (m,) each
        head_loss = rows_mean(ce)
        total = total + (config.medusa_decay**k) * head_loss
        hit_rows = head_top1 == labels.top1[label_rows]  # (m,)
        metrics[f"loss_head{k + 1}"] = float(head_loss.detach())
        metrics[f"acc_depth{k + 1}"] = float(rows_mean(hit_rows.float()))
        correct.append(hits_at(hit_rows, (b, t), (batch, seq_len - 2)))  # aligned on the chain start t
    metrics["loss"] = float(total.detach())
    metrics["acc"] = metrics.get("acc_depth1", 0.0)
    metrics["sim_tau"] = chain_acceptance(correct, valid0)
    return LossOutput(total, metrics)


def causal_mask(key_padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask with padded keys masked. key_padding: (B, T) 1 = real. Returns (B, 1, T, T)."""
    seq_len = key_padding.shape[1]
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=key_padding.device).tril()  # (T, T)
    allowed = allowed[None] & key_padding.bool()[:, None, :]  # (B, T, T)
    allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=key_padding.device)[None]  # no empty rows
    mask = torch.zeros(allowed.shape, dtype=dtype, device=key_padding.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def eagle_loss(
    heads: torch.nn.Module,
    features: torch.Tensor,
    target_logits: torch.Tensor | TargetLabels,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossSection,
    noise: torch.Tensor | None = None,
) -> LossOutput:
    """Smooth-L1 feature regression + cross-entropy through the target's lm_head, with unrolled accuracy.

    Depth 1 is teacher-forced on the target's real features (plus `noise`). Depth d > 1 feeds the head its own
    depth-(d-1) predictions (with the data's tokens): depths up to `train_depth` add to the loss (weighted
    depth_decay**(d-1)), depths up to `eval_depth` only estimate how far a draft chain would be accepted (sim_tau:
    a chain stops at an untrained token, padding included).

    Args:
        heads: EagleHeads (attached to the target).
        features: (B, T, h) the target's features f_0 .. f_{T-1}.
        target_logits: (B, T, V) lm_head(features), or the `TargetLabels` made from them.
        input_ids: (B, T) tokens x_0 .. x_{T-1}.
        attention_mask: (B, T) 1 on real tokens.
        loss_mask: (B, T) 1 where predicting that token is trained.
        config: loss weights, noise, labels, eval_depth.
        noise: (B, T-1, h) added to the input features (EAGLE's uniform noise), or None.
    """
    batch, seq_len, _ = features.shape
    n = seq_len - 1  # positions t = 0 .. T-2 read (f_t, x_{t+1})
    in_features = features[:, :-1]  # (B, n, h)
    if noise is not None:
        in_features = in_features + noise.to(features.dtype)
    in_ids = input_ids[:, 1:]  # (B, n)
    positions = torch.arange(n, device=features.device).expand(batch, n)  # (B, n)
    mask4d = causal_mask(attention_mask[:, 1:], features.dtype)  # (B, 1, n, n)
    labels_feat = features[:, 1:]  # (B, n, h): f_{t+1}
    labels = as_target_labels(target_logits, loss_mask, None, config.labels == "target", config.argmax_label_weight)
    next_tokens = torch.cat([input_ids[:, 2:], input_ids[:, -1:]], dim=1)  # (B, n): x_{t+2} (last unused)
    valid = torch.cat([loss_mask[:, 2:], torch.zeros_like(loss_mask[:, :1])], dim=1)  # (B, n)
    # The lm_head (h x V) and the softmaxes run on the M trained rows only (prompt tokens and padding, about half
    # of a chat batch, never reach them); the other rows count as misses.
    rows_b, rows_t = valid.bool().nonzero(as_tuple=True)  # (M,), (M,)
    label_rows, row_tokens = labels.row_of[rows_b, rows_t + 1], next_tokens[rows_b, rows_t]  # (M,): the target at t+1
    row_top1 = labels.top1[label_rows]  # (M,)

    def hits(draft_top1: torch.Tensor) -> torch.Tensor:
        """(M,) draft argmax of the trained rows -> (B, n) bool: the draft's argmax is the target's."""
        return hits_at(draft_top1 == row_top1, (rows_b, rows_t), (batch, n))

    def feature_and_token_loss(pred: torch.Tensor, row_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The feature and token losses, and the draft's (M,) argmax."""
        feat = masked_mean(F.smooth_l1_loss(pred.float(), labels_feat.float(), reduction="none").mean(-1), valid)
        ce, draft_top1 = label_cross_entropy(row_logits, labels, label_rows, row_tokens)
        return feat, rows_mean(ce), draft_top1

    pred = heads(in_features, in_ids, positions, mask4d)  # (B, n, h)
    feat_loss, tok_loss, draft_top1 = feature_and_token_loss(pred, heads.logits(pred[rows_b, rows_t]))  # logits (M, V)
    loss = config.feature_weight * feat_loss + config.token_weight * tok_loss

    metrics = {"loss": float(loss.detach()), "loss_feature": float(feat_loss.detach()), "loss_token": float(tok_loss.detach())}
    correct = [hits(draft_top1)]  # depth 1, indexed by the predicting position t
    prev = pred
    for depth in range(2, max(config.eval_depth, config.train_depth) + 1):
        trained = depth <= config.train_depth  # unrolled depths with gradients ("training-time test")
        with torch.enable_grad() if trained else torch.no_grad():
            # position s now reads its own predicted f_s (made at s-1); s = 0 keeps the real f_0
            unrolled = torch.cat([features[:, :1], prev[:, :-1] if trained else prev[:, :-1].detach()], dim=1)
            prev = heads(unrolled, in_ids, positions, mask4d)  # (B, n, h)
            row_logits = heads.logits(prev[rows_b, rows_t])  # (M, V)
            if trained:
                feat_d, tok_d, draft_top1 = feature_and_token_loss(prev, row_logits)
                loss = loss + config.depth_decay ** (depth - 1) * (config.feature_weight * feat_d + config.token_weight * tok_d)
            else:
                draft_top1 = row_logits.argmax(-1)
        correct.append(hits(draft_top1))
    metrics["loss"] = float(loss.detach())
    chains = []
    for d, hit in enumerate(correct):
        metrics[f"acc_depth{d + 1}"] = float(masked_mean(hit.float(), valid))
        # the chain starting at t reaches depth d+1 at position t+d
        shifted = torch.cat([hit[:, d:], torch.zeros_like(hit[:, :d])], dim=1)
        chains.append(shifted)
    metrics["acc"] = metrics["acc_depth1"]
    metrics["sim_tau"] = chain_acceptance(chains, valid)
    return LossOutput(loss, metrics)


def eagle3_loss(
    heads: Any,
    features: torch.Tensor,
    target_logits: torch.Tensor | TargetLabels,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossSection,
    noise: torch.Tensor | None = None,
) -> LossOutput:
    """EAGLE-3 training-time test: `ttt_steps` unrolled steps, soft cross-entropy over the draft vocabulary.

    Heads with `parallel_depth` = K (P-EAGLE) train their K depths instead: step 0 as above, steps 1..K-1 the
    parallel slots (training/ttt.py), each weighted as TTT step i.

    Step i at index t predicts x_{t+2+i} (see training/ttt.py for the inputs, positions and mask). Its label
    is the target's distribution at t+1+i restricted to the draft vocabulary (softmax of the target logits
    gathered at `d2t`), or with labels="tokens" the data token (positions whose token is outside the draft
    vocabulary are then left out). Step i is weighted ttt_decay**i and counts where x_{t+2+i} is trained.

    Args:
        heads: Eagle3Heads (or a view of them: callable like its forward, with `logits`, `d2t` and `config`).
        features: (B, T, 3h) the target's tapped features (`heads.select_features`).
        target_logits: (B, T, V) the target's logits (position t predicts x_{t+1}), or the `TargetLabels` made
            from them with `heads.d2t` as the label vocabulary.
        input_ids: (B, T) tokens.
        attention_mask: (B, T) 1 on real tokens.
        loss_mask: (B, T) 1 where predicting that token is trained.
        config: ttt_steps, ttt_decay, labels.
        noise: (B, T-1, 3h) added to the step-0 features, or None.

    Returns:
        The weighted loss; metrics loss_depth{d} and acc_depth{d} (draft argmax mapped through d2t equals the
        target's argmax) for d = 1 .. ttt_steps, acc, sim_tau (a chain stops at an untrained token), and
        draft_vocab_coverage (share of this batch's trained labels x_{t+2} inside the draft vocabulary).
    """
    batch, n = input_ids.shape[0], input_ids.shape[1] - 1
    d2t = heads.d2t  # (Vd,) target id of each draft id, sorted
    # once for all steps (step i reads position t+1+i): the target's argmax over its whole vocabulary (what greedy
    # decoding accepts) and its distribution over the draft vocabulary
    labels = as_target_labels(target_logits, loss_mask, d2t, config.labels == "target", config.argmax_label_weight)
    in_draft = torch.zeros(labels.vocab_size, dtype=torch.bool, device=d2t.device)
    in_draft[d2t] = True  # (V,)
    plain_heads = getattr(heads, "heads", heads)  # a training run's heads (`_HeadsView.heads`)
    chain = uses_ttt_chain_attention(plain_heads)
    parallel = plain_heads.config.parallel_depth  # P-EAGLE: its depths, each a parallel slot
    steps, token = (parallel, plain_heads.config.parallel_slot_token) if parallel else (config.ttt_steps, None)
    slot_roots = cod_roots(input_ids, parallel, config.parallel_slot_ratio)  # None: every root trains every depth
    outputs = unroll_ttt(heads, features, input_ids, attention_mask, steps, noise, chain and slot_roots is None,
                         token, slot_roots)
    total = features.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    correct: list[torch.Tensor] = []
    every_depth = torch.ones(n, dtype=torch.bool, device=input_ids.device)  # (n,) roots that train every depth
    for step, hidden in enumerate(outputs):
        # Only the M trained rows go through the draft lm_head and the softmaxes (prompt tokens and padding,
        # about half of a batch, never reach them): rows (b, t) where x_{t+2+step} is trained.
        trained = shift_left(loss_mask, 2 + step, n, fill=0).bool()  # (B, n)
        row_of_root = None
        if step and slot_roots is not None:  # COD: only the sampled roots' slots ran; hidden is (B, m, h)
            roots = slot_roots[step - 1].to(input_ids.device)
            every_depth = torch.zeros_like(every_depth).index_fill_(0, roots, True)  # nested: the last is the deepest
            trained = trained & every_depth[None]
            row_of_root = torch.full((n,), -1, dtype=torch.long, device=roots.device).index_copy_(
                0, roots, torch.arange(roots.shape[0], device=roots.device))
        rows_b, rows_t = trained.nonzero(as_tuple=True)  # (M,), (M,)
        label_rows = labels.row_of[rows_b, rows_t + 1 + step]  # (M,): the target at t+1+step
        tokens = input_ids[rows_b, rows_t + 2 + step]  # (M,): x_{t+2+step}
        draft_ids = torch.searchsorted(d2t, tokens).clamp(max=d2t.shape[0] - 1)  # (M,): read with labels="tokens"
        rows = hidden[rows_b, rows_t if row_of_root is None else row_of_root[rows_t]]
        ce, draft_top1 = label_cross_entropy(heads.logits(rows), labels, label_rows, draft_ids)
        # with labels="tokens", labels outside the draft vocabulary are left out
        step_loss = rows_mean(ce) if labels.probs is not None else masked_mean(ce, in_draft[tokens])
        total = total + config.ttt_decay**step * step_loss
        hit_rows = d2t[draft_top1] == labels.top1[label_rows]  # (M,)
        metrics[f"loss_depth{step + 1}"] = float(step_loss.detach())
        metrics[f"acc_depth{step + 1}"] = float(rows_mean(hit_rows.float()))
        # the chain at index t is the draft path rooted at t: no shift; untrained rows count as misses
        correct.append(hits_at(hit_rows, (rows_b, rows_t), (batch, n)))
    # the chains a draft could run: with COD, those of the roots that trained every depth
    first_valid = shift_left(loss_mask, 2, n, fill=0).bool() & every_depth[None]  # (B, n)
    metrics["loss"] = float(total.detach())
    metrics["acc"] = metrics["acc_depth1"]
    metrics["sim_tau"] = chain_acceptance(correct, first_valid)
    metrics["draft_vocab_coverage"] = float(masked_mean(in_draft[shift_left(input_ids, 2, n, fill=0)].float(), first_valid))
    return LossOutput(total, metrics)


def cod_roots(input_ids: torch.Tensor, parallel_depth: int, ratio: float) -> list[torch.Tensor] | None:
    """P-EAGLE COD sampling of this batch's slot roots (training/ttt.py `cod_slot_roots`), or None (autoregressive
    heads, or ratio 1: every root). Drawn from a generator seeded with the batch's tokens, so a resumed run, or any
    number of processes, draws the same roots for the same batch."""
    if not parallel_depth or ratio >= 1:
        return None
    seed = (int(input_ids.long().sum()) * 1_000_003 + input_ids.shape[0] * 1009 + input_ids.shape[1]) % 2**63
    return cod_slot_roots(input_ids.shape[1] - 1, parallel_depth, ratio, torch.Generator().manual_seed(seed))


def uniform_noise(shape: tuple[int, ...], scale: float, seeds: list[int]) -> torch.Tensor:
    """U(-scale, scale) noise of `shape` (B, ...), row b drawn from its own generator seeded with seeds[b].

    Seeding per example (not per process) keeps runs with any number of processes, and resumed runs, identical.
    """
    rows = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        rows.append((torch.rand(shape[1:], generator=g) * 2 - 1) * scale)
    return torch.stack(rows)
