"""Medusa-2: Medusa heads trained jointly with a peft LoRA adapter on the target.

The target gets a LoRA adapter; the adapter and the heads are the only trainable weights. One step:

    adapted target forward WITH gradients -> features (B, T, h) and logits (B, T, V)
    loss = lm_loss_weight * CE(target logits at t, data token x_{t+1})       on trained (assistant) tokens
         + sum_k medusa_decay**k * CE(head k, label)                          (`medusa_loss`)

The head labels (the adapted target's own distribution, or the data's tokens) are detached; the heads'
gradient flows back through the features into the adapter, so the target learns features that are easier
to draft from while its LM loss keeps its own predictions on the data.

Checkpoints (accelerate save_state) hold the trainable weights only, heads + adapter, never the frozen
target. The final checkpoint is the heads folder plus `target_adapter/` (peft save_pretrained); its HeadsConfig
names that subfolder and fingerprints the merged target (heads/adapter.py), so loading applies the adapter and
an un-adapted target is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from specheads.heads.adapter import ADAPTER_DIRNAME, adapter_fingerprint, merged_weight
from specheads.heads.base import DraftHeads, target_embedding_sample
from specheads.training.config import JointSection, RunConfig
from specheads.training.losses import LossOutput, masked_mean, medusa_loss

LINEAR_TYPES = (nn.Linear, Conv1D)  # the layers a LoRA adapter can sit on (GPT-2's are Conv1D)


def wrap_with_lora(target: PreTrainedModel, r: int, alpha: float, target_modules: list[str] | str,
                   dropout: float = 0.0, section: str = "joint") -> Any:
    """Inject a fresh LoRA adapter (rank `r`, scale `alpha / r`, on `target_modules` or "all-linear") into `target`
    (in place) and return the peft model; only the adapter trains. `section` is where the run config sets these, for
    error messages (Medusa-2's "joint", a distilled draft model's "distill").

    Raises:
        ValueError: none of the target modules exists in the model, or one is an input embedding tied to the lm_head.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    tied = target.get_output_embeddings().weight is target.get_input_embeddings().weight
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        bias="none",
    )
    try:
        peft_target = get_peft_model(target, config)
    except ValueError as err:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in target.named_modules() if isinstance(m, LINEAR_TYPES)})
        raise ValueError(
            f"{section}.target_modules={target_modules} do not name modules of "
            f"{target.config.name_or_path!r}; its Linear modules are named {linear} ({err})"
        ) from err
    if tied and isinstance(peft_target.get_input_embeddings(), LoraLayer):
        raise ValueError(
            f"{section}.target_modules={target_modules} puts an adapter on the input embedding of "
            f"{target.config.name_or_path!r}, whose lm_head shares that weight: merging it would change the lm_head "
            "too; leave the embedding out of target_modules"
        )
    # the adapter's config names the target portably (an alias or Hub id, not this machine's path)
    peft_target.peft_config["default"].base_model_name_or_path = str(target.config.name_or_path)
    return peft_target


class JointMedusa(nn.Module):
    """The adapted target and its Medusa heads as one trainable module (what Accelerate prepares and saves).

    Args:
        target: the frozen target; it receives the LoRA adapter (in place).
        heads: fresh Medusa heads attached to `target`.
        joint: the run's `joint` section (LoRA shape).
    """

    def __init__(self, target: PreTrainedModel, heads: DraftHeads, joint: JointSection) -> None:
        super().__init__()
        if heads.config.head_type != "medusa":
            raise ValueError(f"joint (Medusa-2) training needs Medusa heads, got head_type={heads.config.head_type!r}")
        self.target = wrap_with_lora(target, joint.lora_r, joint.lora_alpha, joint.target_modules, joint.lora_dropout)
        self.heads = heads
        self.model_card_metrics: dict[str, Any] = {}
        self.train()  # the adapter's dropout (lora_dropout) acts while training

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapted target forward (with gradients) then the heads.

        Args:
            input_ids: (B, T) right-padded tokens.
            attention_mask: (B, T) 1 on real tokens.

        Returns:
            head logits (K, B, T, V) and the adapted target's logits (B, T, V).
        """
        out = self.target(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        return self.heads(self.heads.select_features(out.hidden_states)), out.logits

    def param_groups(self, learning_rate: float, head_lr_multiplier: float) -> list[dict[str, Any]]:
        """Optimizer groups: the adapter at `learning_rate` (group 0, the logged lr), the heads at lr * multiplier."""
        adapter = [p for p in self.target.parameters() if p.requires_grad]
        heads = [p for p in self.heads.parameters() if p.requires_grad]
        return [{"params": adapter, "lr": learning_rate}, {"params": heads, "lr": learning_rate * head_lr_multiplier}]

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the heads (HeadsConfig naming the adapter, with fingerprints of the merged target) and the adapter.

        folder/ gets config.json, model.safetensors, README.md; folder/target_adapter/ the peft adapter.
        """
        folder = Path(folder)
        config = self.heads.config
        config.target_adapter = ADAPTER_DIRNAME
        config.target_adapter_sample = adapter_fingerprint(self.target)
        # an adapter on the embedding (target_modules with embed_tokens) changes it: record the merged one
        config.target_embedding_sample = target_embedding_sample(merged_weight(self.target.get_input_embeddings()))
        self.heads.model_card_metrics = self.model_card_metrics
        self.heads.save_pretrained(folder)
        # the vocabulary is never resized: no full embedding copy (peft would otherwise look the target up online)
        self.target.save_pretrained(folder / ADAPTER_DIRNAME, save_embedding_layers=False)


def lm_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The target's next-token cross-entropy on trained tokens.

    Args:
        logits: (B, T, V) the target's logits (position t predicts x_{t+1}).
        input_ids: (B, T) tokens.
        loss_mask: (B, T) 1 where predicting that token is trained.
    """
    batch, seq_len, vocab = logits.shape
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), input_ids[:, 1:].reshape(-1), reduction="none")
    return masked_mean(ce.view(batch, seq_len - 1), loss_mask[:, 1:])


def joint_loss(model: nn.Module, batch: dict[str, torch.Tensor], config: RunConfig) -> LossOutput:
    """One micro-batch of Medusa-2: lm_loss_weight * LM loss + the decayed Medusa head losses.

    Args:
        model: the prepared (possibly DDP-wrapped) `JointMedusa`.
        batch: input_ids, attention_mask, loss_mask, each (B, T).
        config: the run config (`loss` and `joint` sections).

    Metrics: the Medusa ones (acc, acc_depthK, loss_headK, sim_tau) plus loss_lm, loss_heads and the total loss.
    """
    head_logits, target_logits = model(batch["input_ids"], batch["attention_mask"])
    heads = medusa_loss(head_logits, target_logits.detach(), batch["input_ids"], batch["loss_mask"], config.loss)
    lm = lm_cross_entropy(target_logits, batch["input_ids"], batch["loss_mask"])
    loss = config.joint.lm_loss_weight * lm + heads.loss
    metrics = {
        **heads.metrics,
        "loss_heads": heads.metrics["loss"],
        "loss_lm": float(lm.detach()),
        "loss": float(loss.detach()),
    }
    return LossOutput(loss, metrics)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def keep_trainable_weights_only(accelerator: Accelerator) -> None:
    """Make `save_state` / `load_state` of this accelerator write and read trainable weights only.

    A joint run's model holds the whole frozen target, rebuilt from its config at every start: checkpoints keep
    the heads and the adapter (plus optimizer, scheduler and RNG states as usual). Loading checks that the file
    holds exactly this run's trainable tensors. DeepSpeed / FSDP engines save their own way and are left alone.
    """

    def on_save(models: list[nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
        if len(weights) != len(models):  # sharded engines wrote their own checkpoints
            return
        for i, model in enumerate(models):
            names = _trainable(model)
            weights[i] = {k: v for k, v in weights[i].items() if k in names}

    def on_load(models: list[nn.Module], input_dir: str) -> None:
        for i, model in enumerate(models):
            path = Path(input_dir) / f"model{f'_{i}' if i else ''}.safetensors"
            state, expected = load_file(str(path)), _trainable(model)
            missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            wrong = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
            if missing or unexpected or wrong:
                raise ValueError(
                    f"{path} does not hold this joint run's trainable weights (missing {missing[:4]}, unexpected "
                    f"{unexpected[:4]}, wrong shape {wrong[:4]}): was it written with other head or joint settings?"
                )
            model.load_state_dict(state, strict=False)
        models.clear()  # loaded here: accelerate would load them strictly and miss the frozen target's tensors

    accelerator.register_save_state_pre_hook(on_save)
    accelerator.register_load_state_pre_hook(on_load)
