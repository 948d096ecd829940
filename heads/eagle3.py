"""EAGLE-3 head: fc(n fused target layers, 3 by default) -> one decoder layer reading [embed(x_{t+1}); feature] -> norm
-> draft lm_head. EAGLE-3.1 (arXiv 2605.09992) adds two opt-in norms: `eagle3_fc_norm` (one RMSNorm per fused layer
before fc) and `eagle3_norm_output` (the next step reads the final norm's output, not the raw residual stream)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specheads.heads.base import DraftHeads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.heads.config import HeadsConfig
from specheads.heads.eagle import build_layer_config, decoder_classes
from specheads.heads.target_rows_vocab import check_draft_vocab


def default_eagle3_feature_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's tapped layers: indices [2, L//2, L-3] into the target's `hidden_states` tuple.

    `hidden_states[i]` is the output of decoder layer i-1 (pre-norm for i < L). On shallow targets the
    indices are clamped into [0, L-1], so every tap stays a pre-norm state (a 2-layer target reads [1, 1, 0]).
    """
    last = max(num_hidden_layers - 1, 0)
    return [min(max(i, 0), last) for i in (2, num_hidden_layers // 2, num_hidden_layers - 3)]


def layer_config_of_width(layer_config: dict[str, Any], width: int) -> dict[str, Any]:
    """The draft layer's config at another `width` (`create_heads(..., draft_hidden_size=)`): the same head_dim, the
    attention heads and the MLP scaled with the width, the key/value heads keeping their group size where they can.

    Raises:
        ValueError: `width` is not a positive multiple of the layer's head_dim.
    """
    hidden, heads = layer_config["hidden_size"], layer_config["num_attention_heads"]
    head_dim = layer_config.get("head_dim") or hidden // heads
    if not isinstance(width, int) or isinstance(width, bool) or width <= 0 or width % head_dim:
        raise ValueError(f"draft_hidden_size={width!r} is invalid; expected a positive multiple of the draft layer's "
                         f"head_dim={head_dim} (the target's hidden_size is {hidden})")
    new_heads = width // head_dim
    kv_heads = layer_config.get("num_key_value_heads") or heads
    group = heads // kv_heads if heads % kv_heads == 0 else 1  # query heads per key/value head
    new_kv = max(1, new_heads // group)
    while new_heads % new_kv:  # attention needs whole groups
        new_kv -= 1
    out = dict(layer_config, hidden_size=width, num_attention_heads=new_heads, num_key_value_heads=new_kv,
               head_dim=head_dim)
    if isinstance(layer_config.get("intermediate_size"), int):
        out["intermediate_size"] = max(1, round(layer_config["intermediate_size"] * width / hidden))
    return out


def principal_directions(weight: torch.Tensor, width: int) -> torch.Tensor:
    """(h, width): the top `width` right singular vectors of a (V, h) embedding or lm_head (the eigenvectors of
    weight.T @ weight), signs fixed so that each column's largest entry is positive: the same matrix every call.

    A draft narrower than the target starts its embedding and lm_head as the target's projected on these
    directions, the `width` along which the target's rows differ most, instead of from noise. A wider draft (width
    >= h) gets the identity padded with zero columns: the target's coordinates first.
    """
    rows = weight.detach()
    if width >= rows.shape[-1]:  # a wider draft: the target's coordinates, then zeros (the training fills them)
        return torch.eye(rows.shape[-1], width, device=rows.device)
    gram = torch.zeros(rows.shape[-1], rows.shape[-1], device=rows.device)  # (h, h) float32
    for chunk in rows.split(16384):  # float32 a chunk at a time: no float32 copy of a large (V, h) weight
        gram += chunk.float().T @ chunk.float()
    _, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues
    top = vectors[:, -width:].flip(-1)  # (h, width), largest first
    signs = torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))  # (1, width)
    return top * signs


def widen_attention_inputs(attention: nn.Module, in_features: int) -> None:
    """Replace q/k/v projections of an HF attention module by fresh ones reading `in_features` inputs.

    Output sizes and biases stay those of the family (e.g. Qwen2 keeps its q/k/v biases); the module's own
    forward is untouched, it just receives a wider input.
    """
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name)
        setattr(attention, name, nn.Linear(in_features, old.out_features, bias=old.bias is not None))


class Eagle3Heads(DraftHeads):
    """EAGLE-3: fc(concat of n target layers, `feature_layers`: n*h -> h; n = 3 in the paper, any n >= 2 here), one
    target-family decoder layer whose attention reads
    concat(embed_norm(embed(x_{t+1})), hidden_norm(feature)) (2h wide), final norm, lm_head over a reduced draft vocab.

    Position t reads (g_t, x_{t+1}): the fused target feature at t (or the head's own previous output) and the
    token that followed, and returns the pre-norm hidden state a_{t+1}; `logits(a_{t+1})` scores x_{t+2} over the
    draft vocabulary, and `draft_to_target_ids` maps those ids back to target ids. a_{t+1} is also the next
    step's input feature.

    Buffers (saved in the checkpoint): `d2t` (draft_vocab_size,) long, the target id of each draft id (sorted,
    unique); `t2d` (vocab_size,) bool, which target ids are in the draft vocabulary.

    With `config.parallel_depth` = K >= 2 (P-EAGLE parallel drafting) the heads also hold `mask_hidden` (K-1, n*h),
    one learned offset per drafted depth past the first: a draft round feeds the committed positions as usual plus
    K-1 "parallel slots" after them, the slot of depth d reading (the root's target features + mask_hidden[d-2],
    `parallel_slot_token`), and the one forward returns the logits of all K depths (`forward(..., parallel_slots=)`;
    inference/parallel_drafting.py).

    With `config.num_layers` = L > 1 the first layer's output goes through L-1 more decoder layers of the family
    (`extra_layers`, plain: d-wide inputs, the usual residuals), as vLLM's several-layer EAGLE-3 drafters do.

    The draft's width d (`config.draft_hidden_size`, its layer's hidden_size) is the target's h unless asked
    otherwise (`create_heads(..., draft_hidden_size=)`, vLLM's and SGLang's `target_hidden_size`): then `fc` maps n*h
    to d, and the heads embed tokens themselves (`embed_tokens`, (V, d), saved) instead of borrowing the target's.

    EAGLE-3.1 options (config, default off): `eagle3_fc_norm` gives each of the n fused target layers its own RMSNorm
    (`fc_norm[i]`, the family's norm class) before `fc`; `eagle3_norm_output` makes `forward` return norm(a_{t+1}) (the
    next step's feature, and `logits` applies no second norm), so deeper draft steps read features of one scale.
    Two more variants of vLLM speculators' drafters: `eagle3_norm_before_fc` (one norm, `input_norm`, over the n*h
    concatenation before `fc`) and `eagle3_norm_before_residual` (the layer's residual is hidden_norm(feature)).
    """

    float32_linears = ("fc",)  # fuses the target features (outlier dimensions): float32 under int8 drafting

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        h, d = config.hidden_size, config.draft_hidden_size  # the target's width, the draft's (usually equal)
        layer_config = build_layer_config(config)
        layer_class, rotary_class = decoder_classes(layer_config)
        self.fc = nn.Linear(len(config.feature_layers) * h, d, bias=False)  # n*h != d (HeadsConfig checks)
        # The layer's input_layernorm normalises the token embedding; hidden_norm the feature (residual stream).
        self.layer = layer_class(layer_config, layer_idx=0)
        widen_attention_inputs(self.layer.self_attn, 2 * d)
        # num_layers > 1: plain decoder layers of the family after the first, on its (B, T, d) output (vLLM's layers 1..)
        self.extra_layers = nn.ModuleList([layer_class(layer_config, layer_idx=i) for i in range(1, config.num_layers)])
        self.hidden_norm = copy.deepcopy(self.layer.input_layernorm)
        self.norm = copy.deepcopy(self.layer.input_layernorm)
        norm_class, eps = type(self.layer.input_layernorm), getattr(layer_config, "rms_norm_eps", 1e-6)
        # EAGLE-3.1: one norm per fused target layer (vLLM's fc_norm.<i>), each h wide, or None
        self.fc_norm = nn.ModuleList([norm_class(h, eps=eps) for _ in config.feature_layers]) \
            if config.eagle3_fc_norm else None
        # norm_before_fc drafters: one norm over the n*h concatenation (the family's norm class, n*h wide), or None
        self.input_norm = norm_class(self.fc.in_features, eps=eps) if config.eagle3_norm_before_fc else None
        # a draft of another width than the target's embeds tokens itself (saved); else it borrows the target's
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if d != h else None
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.rotary_emb = rotary_class(config=layer_config)
        draft_vocab = torch.arange(config.draft_vocab_size)
        self.register_buffer("d2t", draft_vocab, persistent=True)
        self.register_buffer(
            "t2d", torch.arange(config.vocab_size) < config.draft_vocab_size, persistent=True
        )
        self.register_parameter("mask_hidden", self._new_mask_hidden() if config.parallel_depth else None)
        self.post_init()

    def _new_mask_hidden(self) -> nn.Parameter:
        """Fresh (K-1, n*h) per-depth offsets of the parallel slots, N(0, initializer_range) like other fresh weights."""
        shape = (self.config.parallel_depth - 1, self.fc.in_features)
        values = torch.empty(shape, device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        return nn.Parameter(values.normal_(std=self.config.initializer_range))

    @torch.no_grad()
    def enable_parallel_drafting(self, depth: int, token_id: int | None = None) -> None:
        """Turn these (trained, autoregressive) heads into parallel-drafting ones of `depth` depths: add a fresh
        `mask_hidden` and cap the default trees at that depth. Train them afterwards (`init_heads` with
        `head.options.parallel_depth`): the parallel slots start untrained.

        Raises:
            ValueError: the heads already draft in parallel, or `depth` / `token_id` are invalid.
        """
        if self.config.parallel_depth:
            raise ValueError(f"these heads already draft in parallel (parallel_depth={self.config.parallel_depth})")
        old = (self.config.parallel_depth, self.config.parallel_slot_token)
        self.config.parallel_depth = depth
        if token_id is not None:
            self.config.parallel_slot_token = token_id
        try:
            self.config.validate_parallel_drafting()
        except ValueError:
            self.config.parallel_depth, self.config.parallel_slot_token = old
            raise
        self.config.fit_trees_to_parallel_depth()
        self.mask_hidden = self._new_mask_hidden()

    def target_rows_at_draft_width(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of a (V, h) target embedding or lm_head (all, or `rows`) as this draft's width d: unchanged when d = h,
        else projected on the weight's `principal_directions`. (R, d), on the weight's device and dtype."""
        picked = weight if rows is None else weight[rows.to(weight.device)]
        width = self.config.draft_hidden_size
        if width == weight.shape[-1]:
            return picked
        directions = principal_directions(weight, width).to(weight.device)  # (h, d)
        return (picked.float() @ directions).to(weight.dtype)

    def init_from_target(self, target: PreTrainedModel) -> None:
        """Start the draft lm_head from the target's lm_head rows of the draft vocabulary, and the final norm
        from the target's final norm (when it has one of the same shape). A draft of another width starts its
        embedding and lm_head from the target's, projected on their principal directions (`target_rows_at_draft_width`)."""
        weight = target.get_output_embeddings().weight  # (V, h)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target_rows_at_draft_width(weight, self.d2t))
            if self.embed_tokens is not None:
                self.embed_tokens.weight.copy_(self.target_rows_at_draft_width(target.get_input_embeddings().weight))
            self.copy_target_final_norm(self.norm, target)

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_values: Any | None = None,
        parallel_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """One decoder step of the head.

        Args:
            features: (B, T, n*h) target features from `select_features` (fused here by `fc`), or (B, T, d) the
                head's own previous outputs. With S `parallel_slots`: (B, T-S, n*h), the first T-S positions'.
            input_ids: (B, T) the tokens x_{t+1} that followed each feature (`parallel_slot_token` at parallel slots).
            position_ids: (B, T) positions t.
            attention_mask: (B or 1, 1, T, S) additive float mask over the S = cached + T keys.
            past_key_values: the head's own `DynamicCache` (drafting, and the TTT unroll), or None.
            parallel_slots: (anchors (B, S, n*h), depths (S,) long in [2, K]): the last S positions are P-EAGLE
                parallel slots, slot j drafting depth depths[j] of the root whose target features are anchors[:, j]; it
                reads anchors[:, j] + mask_hidden[depths[j] - 2].
            attention_kwargs: passed on to the attention function (the TTT unroll's `ttt_chain`).

        Returns:
            (B, T, d) the hidden state `logits` reads (d: the draft's width, usually the target's h), also the next
            step's input feature: pre-norm, or with
            `eagle3_norm_output` (EAGLE-3.1) the final norm's output.
        """
        h, d, fused = self.config.hidden_size, self.fc.out_features, self.fc.in_features  # d: the draft's width
        if parallel_slots is not None:
            if self.mask_hidden is None:
                raise ValueError("Eagle3Heads.forward: parallel_slots given but these heads draft autoregressively "
                                 "(parallel_depth=0, no mask_hidden)")
            anchors, depths = parallel_slots
            if features.shape[-1] != fused or anchors.shape[-1] != fused:
                raise ValueError(f"Eagle3Heads.forward: parallel slots follow target features ({fused} wide), not "
                                 f"features of width {features.shape[-1]} / anchors of width {anchors.shape[-1]}")
            slots = anchors + self.mask_hidden[depths - 2].to(anchors.dtype)  # (B, S, n*h)
            features = torch.cat([features, slots.to(features.dtype)], dim=1)  # (B, T, n*h)
        if features.shape[-1] == fused:
            if self.fc_norm is not None:  # EAGLE-3.1: each fused layer's (B, T, h) slice normalised on its own
                features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, features.split(h, dim=-1))], -1)
            elif self.input_norm is not None:  # norm_before_fc: the (B, T, n*h) concatenation normalised whole
                features = self.input_norm(features)
            features = self.fc(features)  # (B, T, d)
        elif features.shape[-1] != d:
            raise ValueError(
                f"Eagle3Heads.forward: features of width {features.shape[-1]}; expected {fused // h}*hidden_size={fused} "
                f"(target features) or the draft's width {d} (the head's own outputs)"
            )
        layer = self.layer
        embed = self.embed_tokens if self.embed_tokens is not None else self.target_parts.embed_tokens
        embeds = embed(input_ids).to(features.dtype)  # (B, T, d)
        normalised = self.hidden_norm(features)
        residual = normalised if self.config.eagle3_norm_before_residual else features
        attn_input = torch.cat([layer.input_layernorm(embeds), normalised], dim=-1)  # (B, T, 2d)
        position_embeddings = self.rotary_emb(features, position_ids)
        attn_out, _ = layer.self_attn(
            hidden_states=attn_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=past_key_values is not None,
            **cache_kwargs(layer.self_attn, past_key_values),
            position_embeddings=position_embeddings,
            **attention_kwargs,
        )
        hidden = residual + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))  # (B, T, d)
        for extra in self.extra_layers:  # each caches its keys under its own layer_idx
            out = extra(hidden, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=past_key_values is not None, **cache_kwargs(extra, past_key_values),
                        position_embeddings=position_embeddings, **attention_kwargs)
            hidden = out[0] if isinstance(out, tuple) else out  # (B, T, d)
        return self.norm(hidden) if self.config.eagle3_norm_output else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the head's output (`forward`'s, normalised here unless it already is). (..., d)
        -> (..., draft_vocab_size)"""
        return self.lm_head(hidden if self.config.eagle3_norm_output else self.norm(hidden))

    draft_logits = logits  # drafting scores the draft vocabulary, as training does

    @torch.no_grad()
    def set_draft_vocab(
        self, draft_to_target: torch.LongTensor, *, init_lm_head_from_target: bool = False
    ) -> None:
        """Set the draft vocabulary: `draft_to_target[d]` is the target id of draft id d.

        Args:
            draft_to_target: (draft_vocab_size,) integer target ids, sorted ascending, unique, in [0, vocab_size).
            init_lm_head_from_target: also copy the attached target's lm_head rows of these ids into the draft
                lm_head (for fresh heads; trained heads keep their weights by default).

        Raises:
            ValueError: wrong length, dtype, order, duplicates or ids out of range.
        """
        self.d2t.copy_(
            check_draft_vocab(draft_to_target, self.config.draft_vocab_size, self.config.vocab_size)
        )
        self.t2d.zero_()
        self.t2d[self.d2t] = True
        if init_lm_head_from_target:
            self.lm_head.weight.copy_(self.target_rows_at_draft_width(self.target_parts.lm_head.weight, self.d2t))

    @property
    def draft_vocab_size(self) -> int:
        """Width of `logits`: the reduced draft vocabulary."""
        return self.config.draft_vocab_size

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (any shape)."""
        return self.d2t[draft_ids]

    def check_draft_vocab_buffers(self, source: str) -> None:
        """Raise a ValueError naming `source` when the loaded d2t is not a valid draft vocabulary or t2d disagrees."""
        try:
            d2t = check_draft_vocab(self.d2t, self.config.draft_vocab_size, self.config.vocab_size)
        except ValueError as err:
            raise ValueError(f"{source}: tensor d2t is invalid: {err}") from err
        expected = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        expected[d2t] = True
        if self.t2d.dtype != torch.bool or not torch.equal(self.t2d.cpu(), expected):
            raise ValueError(
                f"{source}: tensor t2d ({self.t2d.dtype}) must be a bool mask of exactly the d2t target ids"
            )

