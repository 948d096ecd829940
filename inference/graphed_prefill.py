"""The prompt's forward at fixed shapes: `GraphedPrefill` pads a prompt to a multiple of `CAPACITY_ALIGN` tokens and
runs it as a chain through a `TreeVerifier` of that many slots, so one CUDA graph per padded length replaces an eager
forward of every prompt length (on a fast GPU an eager forward of a small model is all launch overhead: SmolLM2's
took 60 ms on an H200, its graph 4 ms). `pads_prompt` decides which prompts go through it (`graphed_prefill=None`, the
default: on CUDA, prompts up to `GRAPHED_PREFILL_MAX_TOKENS`). Used by the fast path's `FastPathRunner.prefill` and by
`StaticGreedyDecoder`, our plain decoding (inference/fast_path.py)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specheads.heads.cache_keyword import declared_parameters
from specheads.inference.static_cache import CAPACITY_ALIGN, StaticTreeCache, aligned_length
from specheads.inference.tree import TreeBuffers
from specheads.inference.tree_verifier import FeatureFn, TreeVerifier

# graphed_prefill=None (auto, the default): prompts up to this many tokens are padded and replayed as CUDA graphs.
# Longer prompts run eagerly: their forward is less launch-bound, and each padded length's graph keeps its own
# activation memory (8 graphs at most under this cap).
GRAPHED_PREFILL_MAX_TOKENS = 512


def pads_prompt(graphed_prefill: bool | None, use_graphs: bool, length: int, capacity: int) -> bool:
    """Whether a `length`-token prompt goes through `GraphedPrefill`: always for True, never for False; for None
    (auto) where graphs are captured (CUDA) and its padded length fits both `GRAPHED_PREFILL_MAX_TOKENS` and the
    cache. Measured on an H200 (SmolLM2, 16 MT-bench prompts): 60 ms -> 4 ms a prompt, +28% tokens/s (README)."""
    if graphed_prefill is None:
        return use_graphs and aligned_length(length) <= min(GRAPHED_PREFILL_MAX_TOKENS, capacity)
    return graphed_prefill


def prompt_chain(length: int, device: torch.device, dtype: torch.dtype) -> TreeBuffers:
    """A prompt of `length` tokens as a chain: each token sees itself and the tokens before it (causal)."""
    ancestors = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(length, length, dtype=dtype, device=device).masked_fill_(~ancestors, torch.finfo(dtype).min)
    return TreeBuffers(torch.arange(-1, length - 1, device=device), torch.arange(length, device=device), ancestors, bias)


class GraphedPrefill:
    """The prompt's forward at a fixed shape: padded to a multiple of `CAPACITY_ALIGN` tokens, so that a few CUDA
    graphs (one per padded length, captured on first use) replace an eager forward of every prompt length.

    The prompt is loaded as a chain into a `TreeVerifier` of that many slots at its start slot (0, or after a kept
    conversation's entries): its tokens see the slots before them, padding tokens only themselves, and the padding's
    cache entries (beyond the committed prompt) stay hidden until later tokens overwrite them, as a padded tree's do. On by default on CUDA for prompts
    up to `GRAPHED_PREFILL_MAX_TOKENS` (`graphed_prefill=None`, `pads_prompt`); `graphed_prefill=True` pads every
    prompt, also on the CPU, where it runs eagerly (the same outputs, more rows computed: how it is tested).

    Args:
        target, cache: the target and the static cache the prompt is written to.
        select_features: as `TreeVerifier`'s (None: no hidden states, plain decoding).
        use_graph: capture the forwards as CUDA graphs (default: when the target is on CUDA).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        cache: StaticTreeCache,
        select_features: FeatureFn | None = None,
        use_graph: bool | None = None,
    ) -> None:
        self.target, self.cache, self.select_features, self.use_graph = target, cache, select_features, use_graph
        self.verifiers: dict[int, TreeVerifier] = {}  # padded length -> its verifier (and graph)
        self.chains: dict[int, TreeBuffers] = {}  # padded length -> the chain of that many tokens (sliced per prompt)

    def __call__(
        self, prompt: torch.Tensor, start: int = 0, position_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the (n,) prompt tokens into slots [start, start + n), each seeing the slots before `start` (a kept
        conversation's first tokens, `PromptCache`; text positions `position_offset` from the slots) and the tokens
        before it; returns the last one's logits (1, V) and the n tokens' features (n, h) or None (copies: the
        graph's outputs are overwritten by its next replay)."""
        n = prompt.shape[0]
        slots = aligned_length(n)
        if start + slots > self.cache.capacity:
            raise ValueError(
                f"graphed_prefill pads the {n}-token prompt to {slots} slots from slot {start}, past the cache's "
                f"{self.cache.capacity}: allocate a capacity that is a multiple of {CAPACITY_ALIGN} (or leave "
                "graphed_prefill off)"
            )
        if slots not in self.verifiers:
            # only the last prompt token's logits are read: the lm_head projects that row alone where it can
            one_row = "logits_to_keep" in declared_parameters(type(self.target).forward)
            self.verifiers[slots] = TreeVerifier(self.target, self.cache, slots, self.select_features, self.use_graph,
                                                 one_logits_row=one_row)
            self.chains[slots] = prompt_chain(slots, prompt.device, self.verifiers[slots].mask.dtype)
        verifier, chain = self.verifiers[slots], self.chains[slots]
        # the first n tokens of the padded length's chain (views: no work per prompt). The load unmasks the columns
        # [0, start + n) the tokens see; an earlier prompt at a later start unmasked columns past those: hide all first
        tree = TreeBuffers(chain.parents[:n], chain.depth[:n], chain.ancestors[:n, :n], chain.attention_bias[:n, :n])
        verifier.reset()
        verifier.load(prompt, tree, start, position_offset)
        if verifier.logits_row is not None:
            verifier.logits_row.fill_(n - 1)
        self.cache.sequence_number += 1
        logits, features = verifier.run()  # (1, V) (or (N, V)), (N, h) or None
        last = logits[:1] if verifier.logits_row is not None else logits[n - 1 : n]
        return last.clone(), None if features is None else features[:n].clone()
