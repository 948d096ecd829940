"""Verification: ONE forward of the unmodified target over every node of a draft tree."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from specheads.heads.cache_keyword import cache_kwargs, declared_parameters
from specheads.inference.certified_argmax import CertifiedArgmax
from specheads.inference.kv_cache import compact_cache, tree_cache
from specheads.inference.multimodal import position_offset as text_position_offset
from specheads.inference.tree import TreeBuffers


def last_logits_only(target: PreTrainedModel) -> dict[str, int]:
    """`{"logits_to_keep": 1}` for a target whose forward takes it (every transformers 5.x causal LM), else {}.

    A prefill needs the logits of the last prompt position only; without this the target projects every position
    onto its whole vocabulary (SmolLM2, 100-token prompt, 2 CPU threads: 90 instead of 79 ms), as transformers'
    own `generate` does not.
    """
    return {"logits_to_keep": 1} if "logits_to_keep" in declared_parameters(type(target).forward) else {}


def no_logits(device: torch.device) -> dict[str, torch.Tensor]:
    """`{"logits_to_keep": <no positions>}`: the forward skips its lm_head (for `certified_argmax.CertifiedArgmax`,
    which scores the last hidden state itself; the target's forward must take `logits_to_keep`)."""
    return {"logits_to_keep": torch.empty(0, dtype=torch.long, device=device)}


def tree_attention_mask(tree: TreeBuffers, prefix_length: int) -> torch.Tensor:
    """(1, 1, N, prefix_length + N) additive mask: every node sees the whole prefix, then its ancestors."""
    n = tree.num_nodes
    mask = torch.zeros(1, 1, n, prefix_length + n, dtype=tree.attention_bias.dtype, device=tree.attention_bias.device)
    mask[0, 0, :, prefix_length:] = tree.attention_bias
    return mask


def sliding_window_of(target: PreTrainedModel) -> tuple[int | None, bool]:
    """(window, per_layer_types): the target's attention window if any layer uses one, and whether the model
    takes a mask per layer type (Qwen2-style `layer_types`) rather than one mask for all layers (Mistral)."""
    config = target.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None, False
    return int(window), layer_types is not None


def apply_sliding_window(mask: torch.Tensor, tree: TreeBuffers, prefix_length: int, window: int) -> torch.Tensor:
    """Also hide keys at distance >= window from each node (HF keeps key k for query q when q - k < window)."""
    query = prefix_length + tree.depth  # (N,) node positions
    keys = torch.cat([torch.arange(prefix_length, device=query.device), query])  # (prefix + N,) key positions
    too_far = (query[:, None] - keys[None, :]) >= window  # (N, prefix + N)
    return mask.masked_fill(too_far[None, None], torch.finfo(mask.dtype).min)


@torch.no_grad()
def verify_tree(
    target: PreTrainedModel,
    cache: Cache,
    tokens: torch.Tensor,
    tree: TreeBuffers,
    prefix_length: int,
    with_logits: bool = True,
    position_offset: int = 0,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Run the target once over all tree nodes, appended to its cache.

    The tree enters as an explicit 4-D additive attention mask plus position ids (prefix length + depth);
    the target's code is not modified. Sliding-window targets (Mistral, Qwen2 with sliding layers) get the
    window applied to the mask, as their own mask functions would. Afterwards the cache holds prefix_length + N positions; compact it
    with `kv_cache.compact_cache` once the accepted path is known.

    Args:
        target: any causal LM accepting a 4-D float `attention_mask` and `position_ids` (transformers 5.x).
        cache: the target's cache, holding exactly `prefix_length` positions.
        tokens: (N,) node tokens, node 0 the root.
        tree: the tree's buffers.
        prefix_length: cached positions before the tree.
        with_logits: False skips the lm_head (`logits_to_keep` with no positions; the target's forward must take
            it): for a caller that scores the last hidden state itself (`certified_argmax.CertifiedArgmax`).
        position_offset: added to every node's position: the text positions of an M-RoPE target after a prompt
            with images (`multimodal.position_offset`); 0 otherwise.

    Returns:
        logits (N, V), or None without them, and the hidden states tuple, each (N, h).
    """
    attention_mask: torch.Tensor | dict[str, torch.Tensor] = tree_attention_mask(tree, prefix_length)
    window, per_layer_types = sliding_window_of(target)
    if window is not None and prefix_length + tree.num_nodes >= window:  # the window can bite: apply it
        windowed = apply_sliding_window(attention_mask, tree, prefix_length, window)
        attention_mask = {"full_attention": attention_mask, "sliding_attention": windowed} if per_layer_types else windowed
    out = target(
        input_ids=tokens[None],
        attention_mask=attention_mask,
        position_ids=(tree.depth + (prefix_length + position_offset))[None],  # one add: the ints first
        **cache_kwargs(target, cache),
        use_cache=True,
        output_hidden_states=True,
        **({} if with_logits else no_logits(tokens.device)),
    )
    return (out.logits[0] if with_logits else None), tuple(h[0] for h in out.hidden_states)


def prompt_positions(
    prompt: torch.Tensor, start: int, inputs: dict[str, torch.Tensor] | None, offset: int = 0
) -> dict[str, torch.Tensor]:
    """The keywords of a prompt forward over `prompt[start:]`: its extra inputs (images), which the target places
    itself, or else explicit position ids `start + offset ...`: an M-RoPE target keeps its last image prompt's
    position delta (`rope_deltas`) and would apply it to text run after a cache, where transformers' generate resets
    it first. `offset`: the text positions' offset of the cached part (text after a held image prompt)."""
    if inputs:
        return inputs
    return {"position_ids": torch.arange(start + offset, prompt.shape[0] + offset, device=prompt.device)[None]}


class DynamicTreeVerifier:
    """The target's side of a decoding round on a growing cache (`kv_cache.tree_cache`): any target, any device
    (the reference path).

    `SpeculativeLM` drives a sequence through three calls, which the GPU fast path
    (`fast_path.FastPathRunner`, static cache + CUDA graphs) implements too: `prefill` once, then per round
    `verify` the drafted tree and `compact` the cache to the accepted path.

    Args:
        target: the target model.
        select_features: the heads' `select_features` (hidden_states tuple -> features).
        argmax: greedy decoding's scorer of the last hidden state (`certified_argmax.CertifiedArgmax`, CPU), used by
            `verify_argmax`; None: `verify_argmax` takes the argmax of the full logits.
    """

    def __init__(self, target: PreTrainedModel, select_features, argmax: CertifiedArgmax | None = None) -> None:
        self.target, self.select_features, self.argmax = target, select_features, argmax
        self.cache = tree_cache()
        self.position_offset = 0  # the text positions' offset from cache indices (`multimodal.position_offset`)

    def new_cache(self) -> Cache:
        """An empty cache for a new sequence (`kv_cache.tree_cache`)."""
        return tree_cache()

    def prefill(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        held: tuple[Cache, torch.Tensor] | None = None,
        inputs: dict[str, torch.Tensor] | None = None,
        held_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the (n,) prompt into a fresh cache. Returns the last logits (1, V) and the features (n, h).

        `held`: (cache, (m, h) features) of the prompt's first m tokens from an earlier call
        (`prompt_cache.PromptCache.take`); only the n - m tokens after them are run, at their text positions
        (`held_offset`: the held part's `position_offset`, nonzero after an M-RoPE image). `inputs`: the prompt's
        extra model inputs (images: `multimodal.prompt_inputs`), given to this forward only (never with `held`: the
        held part already holds the images)."""
        if held is not None and inputs:
            raise ValueError("prefill: a held cache already holds the prompt's images; give inputs without held")
        self.cache, shared = (self.new_cache(), None) if held is None else held
        start = 0 if shared is None else shared.shape[0]
        out = self.target(
            input_ids=prompt[None, start:], **cache_kwargs(self.target, self.cache), use_cache=True,
            output_hidden_states=True, **last_logits_only(self.target),
            **prompt_positions(prompt, start, inputs, held_offset),
        )
        self.position_offset = held_offset if held is not None else text_position_offset(self.target, inputs or {})
        features = self.select_features(out.hidden_states)[0]  # (n - start, h)
        if shared is not None:
            features = torch.cat([shared, features])
        return out.logits[0, -1:], features

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the (N,) tree tokens. Returns logits (N, V) and features (N, h)."""
        logits, hidden_states = verify_tree(self.target, self.cache, tokens, tree, prefix_length,
                                            position_offset=self.position_offset)
        return logits, self.select_features(hidden_states)

    def verify_argmax(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`verify` for greedy decoding: the target's argmax token at each node (N,) instead of its logits, and the
        features (N, h). With `argmax` set the forward skips the lm_head and the last hidden state is scored by it."""
        if self.argmax is None:
            logits, features = self.verify(tokens, tree, prefix_length)
            return logits.argmax(dim=-1), features
        _, hidden_states = verify_tree(self.target, self.cache, tokens, tree, prefix_length, with_logits=False,
                                       position_offset=self.position_offset)
        return self.argmax(hidden_states[-1]), self.select_features(hidden_states)

    def compact(self, prefix_length: int, path: torch.Tensor) -> None:
        """Keep the prefix plus the accepted path's entries (see `kv_cache.compact_cache`)."""
        compact_cache(self.cache, prefix_length, path)
