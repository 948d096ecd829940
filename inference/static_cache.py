"""A preallocated target KV cache for tree verification: fixed addresses, fixed shapes, no reallocation.

`StaticTreeCache` is a small `transformers.Cache` subclass (not transformers' `StaticCache`: since 5.2x its
layers append at an internal counter and ignore where the caller wants to write, which tree verification
needs). Every layer's keys and values are views into ONE tensor (layers, 2, 1, kv_heads, capacity, head_dim),
allocated on the first forward, so

- a forward writes its T new keys / values at the positions the caller chose with `set_write_positions`
  (a (T,) tensor, e.g. [prefix, prefix + N) for the N nodes of a tree), with `index_copy_`;
- attention always sees all `capacity` key slots; the explicit 4-D mask (1, 1, T, capacity) decides what is
  visible (`prefill_mask`, `write_tree_mask`): committed positions [0, prefix), then the tree's ancestors;
  stale entries beyond are masked;
- `compact(prefix, path)` moves the accepted path's entries to [prefix, prefix + L + 1) for all layers at
  once (one gather, one `index_copy_`), without reallocation: the addresses a CUDA graph captured stay valid.

Batch size 1 only; every layer must have the same KV shape (true for Llama, Qwen2, Mistral, ...).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.verify import last_logits_only

CAPACITY_ALIGN = 64  # cache slots are allocated in multiples of this (aligned masks, fewer reallocations)


def aligned_length(length: int) -> int:
    """`length` rounded up to a multiple of `CAPACITY_ALIGN`: cache capacities and padded prompt lengths."""
    return -(-length // CAPACITY_ALIGN) * CAPACITY_ALIGN


class _SharedStorage:
    """What all layers of one cache share: the backing tensor and where the current forward writes."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None  # (layers, 2, 1, kv_heads, capacity, head_dim)
        self.write_positions: torch.Tensor | None = None  # (T,) long: cache slots of the T new tokens


class StaticTreeLayer(CacheLayerMixin):
    """One layer of a `StaticTreeCache`: keys / values are views of the shared storage, written in place."""

    def __init__(self, layer_idx: int, num_layers: int, capacity: int, shared: _SharedStorage) -> None:
        super().__init__()
        self.layer_idx, self.num_layers, self.capacity, self.shared = layer_idx, num_layers, capacity, shared

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        if batch != 1:
            raise ValueError(f"StaticTreeCache holds one sequence (batch size 1), got batch size {batch}")
        if value_states.shape[-1] != head_dim:
            raise ValueError(
                f"StaticTreeCache needs keys and values of one head_dim, got {head_dim} and {value_states.shape[-1]}"
            )
        shape = (self.num_layers, 2, 1, kv_heads, self.capacity, head_dim)
        if self.shared.kv is None:
            self.shared.kv = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        elif self.shared.kv.shape != shape:
            raise ValueError(
                f"StaticTreeCache needs the same KV shape in every layer: layer {self.layer_idx} has "
                f"(kv_heads={kv_heads}, head_dim={head_dim}), the storage {tuple(self.shared.kv.shape)}"
            )
        self.keys = self.shared.kv[self.layer_idx, 0]  # (1, kv_heads, capacity, head_dim) views
        self.values = self.shared.kv[self.layer_idx, 1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the (1, kv_heads, T, head_dim) new states at the cache's write positions; return all slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = self.shared.write_positions
        if positions is None or positions.shape[0] != key_states.shape[-2]:
            got = None if positions is None else positions.shape[0]
            raise RuntimeError(
                f"StaticTreeCache: call set_write_positions with {key_states.shape[-2]} positions before the forward "
                f"(got {got})"
            )
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0  # the mask always spans every slot

    def get_seq_length(self) -> int:
        raise NotImplementedError("StaticTreeCache tracks its length itself (committed_length)")

    def get_max_length(self) -> int:
        return self.capacity


class StaticTreeCache(Cache):
    """A preallocated cache of `capacity` positions for one sequence of `target` (see the module docstring).

    The caller owns the bookkeeping: `committed_length` positions [0, committed_length) hold the sequence;
    before each forward it calls `set_write_positions` and passes a 4-D mask over all `capacity` slots plus
    explicit `position_ids` (the model then never asks the cache for its length).

    Args:
        target: the model this cache serves (its config gives the number of layers), or None with `num_layers`.
        capacity: slots per layer: at least prompt + max_new_tokens + tree nodes.
        num_layers: layers to hold when there is no `target` (e.g. 1 for an EAGLE head's own cache).
    """

    def __init__(self, target: PreTrainedModel | None, capacity: int, num_layers: int | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be a positive integer")
        if num_layers is None:
            if target is None:
                raise ValueError("StaticTreeCache needs a target or num_layers")
            num_layers = target.config.get_text_config().num_hidden_layers
        self.shared = _SharedStorage()
        super().__init__(
            layers=[StaticTreeLayer(i, num_layers, capacity, self.shared) for i in range(num_layers)]
        )
        self.capacity = capacity
        self.committed_length = 0
        # bumped by every prompt written into the cache (`prefill_static`, `GraphedPrefill`): which sequence it holds,
        # so a `PromptCache` can tell whether another sequence has overwritten its entries since
        self.sequence_number = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Committed positions (what transformers calls the cached length)."""
        return self.committed_length

    @property
    def storage(self) -> torch.Tensor | None:
        """(layers, 2, 1, kv_heads, capacity, head_dim) backing tensor, None before the first forward."""
        return self.shared.kv

    def check_room(self, end: int) -> None:
        """Raise a clear error if slots up to `end` (exclusive) do not fit in the allocation."""
        if end > self.capacity:
            raise ValueError(
                f"StaticTreeCache of capacity {self.capacity} cannot hold {end} positions (prompt + max_new_tokens + "
                "tree nodes): allocate a larger cache"
            )

    def snapshot(self, length: int) -> torch.Tensor | None:
        """A copy of slots [0, length) of every layer, (layers, 2, 1, kv_heads, length, head_dim) (None before the
        first forward): a conversation's entries kept past the next sequence written here (`PromptCache`)."""
        kv = self.storage
        return None if kv is None else kv[..., :length, :].clone()

    def copy_prefix(self, source: StaticTreeCache | torch.Tensor, length: int) -> None:
        """Copy slots [0, length) of every layer from `source` (a smaller cache of the same model, replaced by this
        one, or a `snapshot`): a sequence's entries survive the fast path's growth and other sequences written here.
        Allocates the storage if needed."""
        kv = source if isinstance(source, torch.Tensor) else source.storage
        if kv is None or length == 0:
            return
        self.check_room(length)
        shape = (*kv.shape[:4], self.capacity, kv.shape[5])
        if self.shared.kv is None:
            self.shared.kv = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
        elif self.shared.kv.shape != shape or self.shared.kv.dtype != kv.dtype:
            raise ValueError(
                f"StaticTreeCache.copy_prefix: storage {tuple(self.shared.kv.shape)} {self.shared.kv.dtype} cannot take "
                f"{tuple(kv.shape)} {kv.dtype}"
            )
        self.shared.kv[..., :length, :].copy_(kv[..., :length, :])

    def load_prefix(self, source: Cache, length: int) -> None:
        """Copy the first `length` positions of every layer of `source` (a `DynamicCache` of the same model) into
        slots [0, length), as the next sequence: a prompt prefilled on the dynamic path (one with images, which the
        target places and embeds itself) continues on this cache."""
        self.check_room(length)
        if len(source.layers) != len(self.layers):
            raise ValueError(f"StaticTreeCache.load_prefix: {len(source.layers)} layers given, this cache holds "
                             f"{len(self.layers)}")
        for layer, given in zip(self.layers, source.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(given.keys, given.values)
            layer.keys[:, :, :length].copy_(given.keys[:, :, :length])
            layer.values[:, :, :length].copy_(given.values[:, :, :length])
        self.sequence_number += 1

    def set_write_positions(self, positions: torch.Tensor) -> None:
        """Where the next forward writes its T tokens: a (T,) long tensor on the model's device.

        For CUDA-graph replay this must be the same tensor (updated in place) as at capture time.
        """
        self.shared.write_positions = positions

    def compact(self, prefix_length: int, path: torch.Tensor) -> None:
        """After verifying a tree written at `prefix_length`, move the accepted nodes to prefix_length .. +L.

        Args:
            prefix_length: committed positions before the tree.
            path: (L+1,) ascending tree-node indices of the accepted path (node 0, the root, first).
        """
        keep = path.shape[0]
        self.check_room(prefix_length + keep)
        self.move_path(prefix_length, path)
        self.committed_length = prefix_length + keep

    def move_path(self, prefix: int | torch.Tensor, path: torch.Tensor) -> None:
        """Copy slots prefix + path to prefix + arange(P), all layers at once (one gather + one `index_copy_`).

        The data movement of `compact`, without its bookkeeping: `prefix` may be a 0-d device tensor (no host
        sync, so a CUDA graph can record it) and `path` (P,) may be padded. The caller keeps prefix + P in range.
        """
        kv = self.shared.kv
        if kv is None:
            return
        path = path.to(kv.device)
        destination = prefix + torch.arange(path.shape[0], device=kv.device)
        # Gather first (a copy), then write: the source and destination ranges may overlap.
        kv.index_copy_(4, destination, kv.index_select(4, prefix + path))


def prefill_mask(
    length: int, capacity: int, dtype: torch.dtype, device: torch.device | str, start: int = 0
) -> torch.Tensor:
    """(1, 1, length, capacity) additive mask for prompt tokens written at slots [start, start + length): each sees
    the slots up to its own (the `start` before it hold the prompt's first tokens), the rest hidden."""
    query = start + torch.arange(length, device=device)[:, None]
    key = torch.arange(capacity, device=device)[None, :]
    mask = torch.zeros(length, capacity, dtype=dtype, device=device)
    return mask.masked_fill_(key > query, torch.finfo(dtype).min)[None, None]


def prefill_static(
    target: PreTrainedModel,
    cache: StaticTreeCache,
    prompt: torch.Tensor,
    output_hidden_states: bool = False,
    start: int = 0,
    position_offset: int = 0,
):
    """Run the (n,) prompt through `target` into slots [start, start + n) of `cache` (eager: prompt lengths vary);
    with `start` > 0 the slots before it must hold the sequence's first `start` tokens (`PromptCache` reuse), and
    `position_offset` is their text positions' offset from the slots (M-RoPE, after an image).

    Returns the model output (the last position's logits (1, 1, V), and hidden states when asked). The caller sets
    its own bookkeeping (`committed_length`, masks) afterwards.
    """
    n, device = prompt.shape[0], target.device
    positions = torch.arange(start, start + n, device=device)
    cache.set_write_positions(positions)
    cache.sequence_number += 1
    return target(
        input_ids=prompt[None],
        attention_mask=prefill_mask(n, cache.capacity, target.dtype, device, start),
        position_ids=positions[None] + position_offset,
        **cache_kwargs(target, cache),
        use_cache=True,
        output_hidden_states=output_hidden_states,
        **last_logits_only(target),
    )


def write_tree_mask(
    mask: torch.Tensor, ancestors: torch.Tensor, prefix_length: int, pad_block: torch.Tensor | None = None
) -> None:
    """Fill a (1, 1, N, capacity) mask in place for a tree of n <= N nodes written at slots [prefix, prefix + N).

    Every node sees the committed prefix and exactly its ancestors; padding nodes (n .. N-1) see only
    themselves (their outputs are never used); everything else (stale entries beyond, earlier trees) is hidden. Slots from prefix + N on
    are left as they are: the caller keeps them hidden (fill the mask with the minimum once per sequence;
    the prefix only grows, so later trees overwrite every slot an earlier tree unmasked).

    Args:
        mask: (1, 1, N, capacity) additive float mask, modified in place.
        ancestors: (n, n) bool, the tree's `TreeBuffers.ancestors`.
        prefix_length: committed positions before the tree.
        pad_block: optional (N, N) precomputed `padding_block(N)` of the mask's dtype (saves a kernel).
    """
    num_slots = mask.shape[-2]
    n = ancestors.shape[0]
    if n > num_slots:
        raise ValueError(f"a tree of {n} nodes does not fit a mask padded to {num_slots} nodes")
    if prefix_length + num_slots > mask.shape[-1]:
        raise ValueError(
            f"tree slots [{prefix_length}, {prefix_length + num_slots}) exceed the mask's {mask.shape[-1]} slots"
        )
    rows = mask[0, 0]  # (N, capacity)
    rows[:n, :prefix_length] = 0
    rows[n:, :prefix_length] = torch.finfo(mask.dtype).min  # padding: not even the prefix
    region = rows[:, prefix_length : prefix_length + num_slots]  # (N, N)
    region.copy_(padding_block(num_slots, mask.dtype, mask.device) if pad_block is None else pad_block)
    region[:n, :n].masked_fill_(ancestors, 0)


def padding_block(num_slots: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """(N, N) additive block: hidden everywhere except the diagonal (every node, padding included, sees itself)."""
    block = torch.full((num_slots, num_slots), torch.finfo(dtype).min, dtype=dtype, device=device)
    return block.fill_diagonal_(0)
