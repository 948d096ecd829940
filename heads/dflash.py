"""DFlash heads: a block drafter that proposes every depth of a draft in ONE forward (block diffusion drafting).

DFlash (arXiv 2602.06036, z-lab) drafts a block of `block_size` positions at once: the block's first position holds
the root (the token the target just chose) and the others a fixed `block_mask_token`; a few decoder layers attend
bidirectionally inside the block and over the target's context, and position d of the block scores the token at
depth d. The context is the target's own hidden states: the tapped layers (`feature_layers`, as EAGLE-3's) are
fused by `fc` + `hidden_norm` and injected as extra keys / values into EVERY draft layer (KV injection), so the
context never runs through the draft's MLPs and only its keys / values are kept between rounds:

    context c_0 .. c_{p-1} (fused target features)   ->  keys / values of every layer (cached)
    block   [x_p, mask, mask, ..., mask] at p .. p+B-1  ->  queries (and keys / values, dropped after the round)
    output at block position p+d                      ->  lm_head -> the token at depth d (d = 1 .. B-1)

The tokens are embedded with the target's embedding and scored with its lm_head (borrowed, never saved). The decoder
layers are Qwen3's (q / k norms), whatever the target's family, as z-lab's released drafters are, so their
checkpoints load as they are (heads/format_dflash.py). Trained with training/dflash_loss.py; drafted by
inference/dflash_drafting.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from specheads.heads.base import DraftHeads
from specheads.heads.config import HeadsConfig
from specheads.heads.eagle import llama_layer_config_for
from specheads.heads.target_rows_vocab import TargetRowsDraftVocab

# create_heads' default block: z-lab's released drafters use 16; a CPU pays for every drafted row's lm_head
DEFAULT_BLOCK_SIZE = 8
# The DFlash paper's loss decay per block size (w_d = exp(-(d-1)/gamma)); others use block_size / 2
PAPER_LOSS_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def dflash_layer_config(target_config: PretrainedConfig, num_layers: int) -> dict[str, Any]:
    """The config (as a dict) of the draft's `num_layers` Qwen3 decoder layers at the target's sizes (and rotary
    base): a Llama layer config of the target (`llama_layer_config_for`) with q / k norms, as z-lab's drafters."""
    config = llama_layer_config_for(target_config.get_text_config())
    config.update(model_type="qwen3", num_hidden_layers=num_layers, layer_types=["full_attention"] * num_layers,
                  use_sliding_window=False, sliding_window=None)
    return config


def default_dflash_feature_layers(num_hidden_layers: int, num_taps: int) -> list[int]:
    """`num_taps` hidden-state indices (1-based: the output of decoder layer i is hidden_states[i + 1]) spread from the
    second layer to the fourth from last, as z-lab picks its target layers (fewer on shallow targets); one tap: the
    middle layer."""
    if num_taps == 1:
        return [min(num_hidden_layers // 2 + 1, num_hidden_layers)]
    start, end = 1, max(num_hidden_layers - 3, 1)
    spread = (round(start + i * (end - start) / (num_taps - 1)) + 1 for i in range(num_taps))
    return sorted({min(index, num_hidden_layers) for index in spread})  # a 1-layer target: its final state


def default_trees(block_size: int) -> dict[str, Any]:
    """The default trees (`HeadsConfig` tree fields) of DFlash heads drafting blocks of `block_size`: at most 7 deep
    (on CPUs 4 deep, 8 nodes, as the other heads' CPU trees), never deeper than the block."""
    deepest = max(1, block_size - 1)  # (a block_size < 2 is refused by HeadsConfig, naming it)
    return dict(tree_depth=min(7, deepest), tree_top_k=8, tree_num_nodes=24,
                cpu_tree={"tree_depth": min(4, deepest), "tree_top_k": 4, "tree_num_nodes": 8})


def loss_gamma(block_size: int) -> float:
    """The default decay of DFlash's per-depth loss weights for blocks of `block_size`."""
    return PAPER_LOSS_GAMMA.get(block_size, block_size / 2)


class DFlashHeads(TargetRowsDraftVocab, DraftHeads):
    """A DFlash block drafter reading a frozen target (see the module docstring).

    Modules: `fc` (n*h -> h, fuses the n tapped target layers), `hidden_norm` (on the fused context), `layers`
    (`num_layers` Qwen3 decoder layers, h wide), `norm` (final), `rotary_emb`. Names follow z-lab's checkpoints.
    With `eagle_draft_vocab_size` > 0 drafting scores only the `d2t` rows of the target's lm_head
    (heads/target_rows_vocab.py).
    """

    float32_linears = ("fc",)  # fuses the target's raw residual-stream features: float32 under int8 drafting
    static_drafting = False  # the GPU fast path's graphed drafter is EAGLE's; DFlash drafts eagerly

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.layer_config = Qwen3Config(**config.draft_layer_config)
        self.fc = nn.Linear(len(config.feature_layers) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=self.layer_config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(self.layer_config, layer_idx=i) for i in range(config.num_layers)])
        self.norm = Qwen3RMSNorm(h, eps=self.layer_config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=self.layer_config)
        self.init_draft_vocab()  # d2t: (Vd,) target id of each draft id; None = draft over the whole vocabulary
        self.post_init()

    def init_from_target(self, target: Any) -> None:
        """Start the final norm from the target's final norm (the lm_head it feeds is the target's)."""
        self.copy_target_final_norm(self.norm, target)

    @property
    def block_size(self) -> int:
        """B: the root and B-1 drafted depths per forward."""
        return self.config.block_size

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
    ) -> torch.Tensor:
        """One forward of the drafter over a context and a block.

        Args:
            features: (B, C, n*h) target features of C context positions (C may be 0): the new ones when
                `past_key_values` holds the earlier ones' keys / values.
            input_ids: (B, S) the block's tokens: the root, then `block_mask_token`s (several blocks in training).
            context_positions: (B, C) and block_positions: (B, S) positions (rotary).
            attention_mask: None (every query sees every key: drafting one block) or (B or 1, 1, S, K) bool or
                additive over the K = cached + C + S keys, in that order.
            past_key_values: a cache holding earlier context keys / values; the C new context positions and the S
                block positions are appended to it (crop the block's before the next call: it is another block then).

        Returns:
            (B, S, h) the final norm's output at each block position (`logits` scores it).
        """
        context = self.hidden_norm(self.fc(features))  # (B, C, h)
        hidden = self.target_parts.embed_tokens(input_ids).to(context.dtype)  # (B, S, h)
        num_context = context.shape[1]
        positions = torch.cat([context_positions, block_positions], dim=1)  # (B, C+S)
        cos, sin = self.rotary_emb(hidden, positions)  # (B, C+S, head_dim) each
        rotary = cos[:, None], sin[:, None]  # broadcast over heads
        for index, layer in enumerate(self.layers):
            residual = hidden
            normed = layer.input_layernorm(hidden)
            hidden = residual + self._attend(layer.self_attn, index, normed, context, rotary, num_context,
                                             attention_mask, past_key_values)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    @staticmethod
    def _attend(attention: nn.Module, index: int, block: torch.Tensor, context: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor], num_context: int, attention_mask: torch.Tensor | None,
                cache: Any | None) -> torch.Tensor:
        """The block's queries over [cached context, new context, block] keys / values, through the Qwen3 attention
        module's own projections and norms. block: (B, S, h), context: (B, C, h) -> (B, S, h)."""
        batch, length, head_dim = block.shape[0], block.shape[1], attention.head_dim
        both = torch.cat([context, block], dim=1)  # (B, C+S, h): keys / values of context and block alike
        query = attention.q_norm(attention.q_proj(block).view(batch, length, -1, head_dim)).transpose(1, 2)
        key = attention.k_norm(attention.k_proj(both).view(batch, both.shape[1], -1, head_dim)).transpose(1, 2)
        value = attention.v_proj(both).view(batch, both.shape[1], -1, head_dim).transpose(1, 2)
        cos, sin = rotary  # (B, 1, C+S, head_dim)
        query = rotate(query, cos[:, :, num_context:], sin[:, :, num_context:])  # (B, heads, S, head_dim)
        key = rotate(key, cos, sin)  # (B, kv_heads, C+S, head_dim)
        if cache is not None:  # appended in place; the caller crops the block's entries before the next round
            key, value = cache.update(key, value, index)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=attention.scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])  # (B, heads, S, head_dim)
        return attention.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token logits of block outputs through the target's lm_head. (..., h) -> (..., V)"""
        lm_head = self.target_parts.lm_head
        return lm_head(hidden.to(lm_head.weight.dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (B, heads, T, head_dim) `x` with (B, 1, T, head_dim) cos / sin (halves rotated)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
