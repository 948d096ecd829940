"""`TreeVerifier`: one target forward over a draft tree padded to a FIXED node count on a `StaticTreeCache`, captured
as a CUDA graph on CUDA and replayed: the GPU fast path's verification (inference/fast_path.py), which the whole-round
graph (inference/graphed_round.py), the padded prompt forward (inference/graphed_prefill.py) and the verification-cost
calibration (inference/autotune.py) run too. On the CPU the same forward runs eagerly: that is how it is tested."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.cuda_graphs import try_capture
from specheads.inference.static_cache import StaticTreeCache, padding_block, write_tree_mask
from specheads.inference.tree import TreeBuffers

FeatureFn = Callable[[tuple[torch.Tensor, ...]], torch.Tensor]  # hidden_states tuple -> (1, T, h) features


class TreeVerifier:
    """One target forward over a tree padded to `num_slots` nodes on a `StaticTreeCache`; a CUDA graph on CUDA.

    `load(tokens, tree, prefix)` fills the static input buffers; `run()` returns (logits (N, V), features
    (N, h) or None), which a graph replay overwrites: consume or copy them before the next `run()`.

    Args:
        target: the target model.
        cache: the static cache it writes to.
        num_slots: N, the padded node count (fixed for the verifier's lifetime).
        select_features: hidden_states tuple -> (1, N, h) features the heads read (None: no hidden states).
        use_graph: capture and replay a CUDA graph (default: when the target is on CUDA).
        one_logits_row: project only the row at `logits_row` (a device scalar the caller sets before `run()`; the
            forward's `logits_to_keep`): logits (1, V) instead of (N, V). A prompt's forward needs its last row only.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        cache: StaticTreeCache,
        num_slots: int,
        select_features: FeatureFn | None = None,
        use_graph: bool | None = None,
        one_logits_row: bool = False,
    ) -> None:
        device, dtype = target.device, target.dtype
        self.target, self.cache, self.num_slots, self.select_features = (
            target,
            cache,
            num_slots,
            select_features,
        )
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.ids = torch.zeros(1, num_slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, num_slots, dtype=torch.long, device=device)
        self.write = torch.zeros(num_slots, dtype=torch.long, device=device)  # cache slots of the N nodes
        self.mask = torch.full(
            (1, 1, num_slots, cache.capacity), torch.finfo(dtype).min, dtype=dtype, device=device
        )
        self.pad_block = padding_block(num_slots, dtype, device)
        self.slot_offsets = torch.arange(num_slots, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_outputs: Any = None
        self.capture_failed = False
        # (1,) index of the one row the lm_head projects (`one_logits_row`), else None: every row
        self.logits_row = torch.zeros(1, dtype=torch.long, device=device) if one_logits_row else None

    def reset(self) -> None:
        """Hide every slot again (call once per new sequence: the tree mask only ever unmasks upwards)."""
        self.mask.fill_(torch.finfo(self.mask.dtype).min)

    def load(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int, position_offset: int = 0) -> None:
        """Fill the static inputs for a tree of n <= N nodes written at slots [prefix, prefix + N), at text positions
        `position_offset` from the slots (nonzero after an M-RoPE image)."""
        n = tokens.shape[0]
        if n > self.num_slots:
            raise ValueError(f"a tree of {n} nodes does not fit a verifier padded to {self.num_slots} nodes")
        self.cache.check_room(prefix_length + self.num_slots)
        self.ids[0, :n] = tokens
        self.ids[0, n:] = 0  # padding tokens: any valid id (they only see themselves)
        start = prefix_length + position_offset  # an int: one tensor add per round, as before the offset
        self.positions[0, :n] = tree.depth + start
        self.positions[0, n:] = start
        torch.add(self.slot_offsets, prefix_length, out=self.write)
        write_tree_mask(self.mask, tree.ancestors, prefix_length, self.pad_block)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward on the current buffers: logits (N, V), features (N, h) or None."""
        self.cache.set_write_positions(self.write)
        out = self.target(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            **cache_kwargs(self.target, self.cache),
            use_cache=True,
            output_hidden_states=self.select_features is not None,
            **({} if self.logits_row is None else {"logits_to_keep": self.logits_row}),
        )
        features = None if self.select_features is None else self.select_features(out.hidden_states)[0]
        return out.logits[0], features

    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Verify the loaded tree: replay the CUDA graph (captured on the first call), or run eagerly."""
        if self.use_graph and self.graph is None and not self.capture_failed:
            # Warm-up runs write the same slots [prefix, prefix + N) that the replay below rewrites: harmless.
            self.graph, self.graph_outputs = try_capture(
                self.forward, f"{self.num_slots}-node tree verification"
            )
            self.capture_failed = self.graph is None
        if self.graph is not None:
            self.graph.replay()
            return self.graph_outputs
        return self.forward()
