"""The one place that touches `transformers` cache internals: keep the accepted path, drop the rest (and a hybrid
target's convolution / recurrent states: copied, put back, cut back).

Cache APIs moved between transformers 5.x releases (5.23's `DynamicCache.crop` takes a negative count
of tokens to drop; 5.17 took a length). These helpers work on `cache.layers[i].keys / .values`
(B, kv_heads, S, head_dim), which every 5.x `DynamicCache` has, and so does `tree_cache()`'s.

`tree_cache()` is the cache speculative decoding runs on (the target's in `DynamicTreeVerifier`, the heads' in the
EAGLE drafters): a `DynamicCache`-like cache whose layers append into preallocated buffers. transformers'
`DynamicLayer` appends with `torch.cat`, i.e. copies the layer's whole cache into a new tensor at every forward;
plain decoding pays that once per token, a speculative round once per verification and once per draft level.
`GrowingLayer` writes only the new entries, into spare room it keeps (doubling when full), and exposes the filled
part as views, so cropping and compaction below work on it unchanged. Measured on SmolLM2 (2 CPU threads, all 80
MT-bench first turns, 128 new tokens, interleaved; together with last-position-only prefill logits and the in-place
path below): +2.4% tokens/s.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin

INITIAL_CAPACITY = 256  # positions a layer's buffers hold at first; they double when a forward needs more


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends into preallocated buffers instead of concatenating.

    `keys` / `values` are views of the first S slots of the buffers (B, kv_heads, capacity, head_dim), so anything
    that crops them by slicing (`crop_cache`, `compact_cache`, transformers' own `crop`) keeps working: the next
    `update` appends after whatever length they have then. Code that replaces them by other tensors (a gather, a
    batch selection) is fine too: the next `update` copies them into new buffers first.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the (B, kv_heads, T, head_dim) new keys / values; returns all cached ones (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        new = key_states.shape[-2]
        if not self._holds_keys() or self.key_buffer.shape[-2] < length + new:
            self._grow(max(INITIAL_CAPACITY, 2 * (length + new)), key_states, value_states, length)
        self.key_buffer[:, :, length : length + new] = key_states
        self.value_buffer[:, :, length : length + new] = value_states
        self.keys = self.key_buffer[:, :, : length + new]
        self.values = self.value_buffer[:, :, : length + new]
        return self.keys, self.values

    def _holds_keys(self) -> bool:
        """Whether `keys` / `values` are still views of the buffers (prefix slices: all that cropping makes), not
        tensors other code put there. Two attribute reads: `update` runs per layer, forward and draft level."""
        return (
            self.key_buffer is not None and self.keys._base is self.key_buffer and self.values._base is self.value_buffer
        )

    def _grow(self, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor, length: int) -> None:
        """New buffers of `capacity` slots holding the `length` cached entries (copied from `keys` / `values`)."""
        batch, heads, _, key_dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, key_dim)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if length:
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
        self.key_buffer, self.value_buffer = keys, values

    def reset(self) -> None:
        super().reset()
        self.key_buffer = self.value_buffer = None


def tree_cache() -> Cache:
    """An empty cache of `GrowingLayer`s (created lazily, one per model layer, as transformers' `DynamicCache()`)."""
    return Cache(layer_class_to_replicate=GrowingLayer)


def cache_length(cache: Cache) -> int:
    """Number of cached positions."""
    return cache.get_seq_length()


def layers_with_entries(cache: Cache) -> list:
    """The layers that hold keys / values (transformers creates them lazily, at the first forward; a hybrid target's
    state-only layers have none)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0]


def crop_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    for layer in layers_with_entries(cache):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def compact_cache(cache: Cache, prefix_length: int, keep: torch.Tensor) -> None:
    """After verifying a tree appended at `prefix_length`, keep only the accepted nodes, in order.

    Args:
        cache: holds prefix_length + N positions (the prefix, then the N tree nodes).
        prefix_length: number of positions before the tree.
        keep: (L,) tree-node indices of the accepted path (ascending), moved to prefix_length .. +L.
    """
    total = prefix_length + keep.shape[0]
    layers = layers_with_entries(cache)
    for layer in layers:
        if layer.keys.shape[-2] < total:
            raise RuntimeError(
                f"cache layer holds {layer.keys.shape[-2]} positions, expected at least {total} "
                "(sliding-window caches past their window are not supported)"
            )
    if keep.device.type == "cpu" and int(keep[-1]) == keep.shape[0] - 1:
        # Ascending indices ending at L-1 are 0..L-1: the path is already in place (the root alone, or the root and
        # its first child: the rounds that accept least), and dropping the rest is enough. CPU only: a host read.
        crop_cache(cache, total)
        return
    source = keep + prefix_length
    for layer in layers:
        # Gather first (a copy), then write: source and destination ranges may overlap.
        layer.keys[:, :, prefix_length:total] = layer.keys.index_select(2, source)
        layer.values[:, :, prefix_length:total] = layer.values.index_select(2, source)
        layer.keys = layer.keys[:, :, :total]
        layer.values = layer.values[:, :, :total]


# --- batches of rows in one rectangular cache (inference/batched.py) -------------------------------------------
def select_rows(cache: Cache, rows: list[int]) -> None:
    """Keep the batch rows `rows` (in that order) of every layer."""
    for layer in layers_with_entries(cache):
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]


def compact_rows(cache: Cache, valid: torch.Tensor, paths: list[torch.Tensor], cache_width: int) -> torch.Tensor:
    """`compact_cache` for a batch: row b's accepted tree entries (at cache_width + paths[b]) move to valid[b] on, in
    place (the layers stay views of their buffers); the cache is then cropped to the longest row. Shorter paths are
    padded with their last node: those copies land past the row's new length, where nothing is read. Returns the
    rows' new committed lengths (B,)."""
    lengths = [p.shape[0] for p in paths]
    longest = max(lengths)
    source = torch.stack([torch.cat([p, p[-1:].expand(longest - p.shape[0])]) for p in paths]) + cache_width  # (B, L)
    destination = valid[:, None] + torch.arange(longest, device=valid.device)  # (B, L)
    new_valid = valid + torch.tensor(lengths, device=valid.device)
    width = int(new_valid.max())
    for layer in layers_with_entries(cache):
        batch, heads, _, dim = layer.keys.shape
        expand = (batch, heads, longest, dim)
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            moved = tensor.gather(2, source[:, None, :, None].expand(expand))  # a copy: sources and targets may overlap
            tensor.scatter_(2, destination[:, None, :, None].expand(expand), moved)
            setattr(layer, name, tensor[:, :, :width])
    return new_valid


def join_caches(first: Cache, second: Cache) -> tuple[int, int]:
    """Append `second`'s rows to `first`'s (batch dimension), the shorter of the two left-padded with zeros to the
    other's length. Returns how many positions were prepended to (first, second): their rows' entries moved by that."""
    width_first, width_second = cache_length(first), cache_length(second)
    width = max(width_first, width_second)
    for layer, other in zip(layers_with_entries(first), layers_with_entries(second), strict=True):
        pairs = [(layer.keys, other.keys), (layer.values, other.values)]
        keys, values = (
            torch.cat([torch.nn.functional.pad(a, (0, 0, width - width_first, 0)),
                       torch.nn.functional.pad(b, (0, 0, width - width_second, 0))])
            for a, b in pairs
        )
        layer.keys, layer.values = keys, values
    return width - width_first, width - width_second


def row_cache(cache: Cache, row: int, positions: torch.Tensor) -> Cache:
    """A new one-row `tree_cache()` holding batch row `row`'s entries at the (S,) `positions`, in that order."""
    single = tree_cache()
    for index, layer in enumerate(cache.layers):
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        single.update(layer.keys[row : row + 1, :, positions], layer.values[row : row + 1, :, positions], index)
    return single


# --- hybrid targets' states (inference/chain_verify.py): convolution / recurrent states beside keys and values ---
# one linear-attention layer's states: ({index: conv state}, {index: recurrent state}), None where not yet created
LayerStates = tuple[dict[int, torch.Tensor | None], dict[int, torch.Tensor | None]]


def state_layers(cache: Cache) -> list[LinearAttentionCacheLayerMixin]:
    """The cache's layers that keep convolution / recurrent states (transformers' `LinearAttention*` layers)."""
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def snapshot_states(cache: Cache) -> list[LayerStates]:
    """Copies of every state layer's convolution and recurrent states (small: no sequence dimension)."""
    def copies(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
        return {index: None if state is None else state.clone() for index, state in states.items()}

    return [(copies(layer.conv_states), copies(layer.recurrent_states)) for layer in state_layers(cache)]


def restore_states(cache: Cache, snapshot: list[LayerStates], in_place: bool = True) -> None:
    """Put the states `snapshot_states` copied back: in place (the tensors keep their addresses, nothing allocated: a
    round's undo), or with `in_place=False` as new copies (the snapshot stays reusable, and the states may have changed
    shape since it was taken, as a recording convolution's grow: a prompt cache's checkpoint)."""
    for layer, (conv, recurrent) in zip(state_layers(cache), snapshot, strict=True):
        for saved, current in ((conv, layer.conv_states), (recurrent, layer.recurrent_states)):
            for index, state in saved.items():
                if state is None:
                    continue
                if in_place:
                    current[index].copy_(state)
                else:
                    current[index] = state.clone()


def cut_back(cache: Cache, length: int) -> bool:
    """Cut a hybrid target's cache back to its first `length` positions if its states allow it: always when it holds
    exactly that many; fewer only for convolution-only states recorded whole (LFM2) since they were last cut back,
    i.e. within the last forward's tokens; False when it cannot be. Recorded convolution inputs are trimmed back to a
    kernel's width either way (they grow with every forward until then), so a cut is possible once per forward."""
    held = cache.get_seq_length()
    drop = held - length
    layers = state_layers(cache)
    recorded = all(layer.is_croppable and getattr(layer, "record_past", False) for layer in layers)
    if drop < 0 or (drop > 0 and not (recorded and all(recorded_inputs(layer) >= drop for layer in layers))):
        return False
    if layers and recorded:
        for layer in layers:
            layer.crop(-drop)  # drop == 0: only the trim
    crop_cache(cache, length)
    return True


def recorded_inputs(layer: LinearAttentionCacheLayerMixin) -> int:
    """How many positions a recording convolution layer can still be cut back by: its inputs past a kernel's width."""
    return min(layer.conv_states[i].shape[-1] - layer.conv_kernel_size[i]
               for i in range(layer.number_of_states) if layer.is_conv_states_initialized[i])
