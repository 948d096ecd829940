"""The GPU fast path: batch-1 speculative decoding on a static KV cache with fixed verification shapes.

Every verification forward has the same shapes: the drafted tree is padded to a FIXED node count
(padding nodes attend only to themselves and are never accepted: acceptance only sees the real nodes),
written at cache slots [prefix, prefix + N) of a `StaticTreeCache`, under a (1, 1, N, capacity) mask. On
CUDA that forward is captured once as a CUDA graph (static input buffers: input_ids (1, N), position_ids
(1, N), the cache write positions (N,), the mask; static outputs: logits and the heads' features) and
replayed every round. `SpeculativeLM._generate_row` drives the rounds through `FastPathRunner`'s
`prefill` / `verify` / `compact`, the same three calls as `verify.DynamicTreeVerifier` (the reference path):

    draft    drafter.propose(features, next_tokens)            (the drafter is unchanged)
    verify   load the static buffers, replay the graph          (eager forward on CPU: that is how it is tested)
    accept   accept_tree on the real nodes' logits              (the host reads the accepted path here)
    update   StaticTreeCache.compact: one gather + one index_copy_ for all layers, no reallocation

With `SpeculativeLM(graphed_rounds=True)` (experimental), greedy rounds of a `StaticEagleDrafter` skip that
per-phase loop: the four phases run as ONE graph with the prefix on the device, and the host reads only the
accepted tokens (inference/graphed_round.py).

`StaticGreedyDecoder` / `plain_greedy_static` is the matching plain (non-speculative) greedy decoder: the
same static cache, a captured 1-token step (its position, write slot and mask advance inside the graph),
a host sync only every few tokens to look for EOS. It is the honest "our own compiled plain decoding"
baseline for speedups.

Sliding-window targets whose window could be reached fall back to the normal path (`use_fast_path`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.cuda_graphs import try_capture
from specheads.inference.drafting import Drafter, EagleDrafter, MedusaDrafter
from specheads.inference.graphed_prefill import GraphedPrefill, pads_prompt
from specheads.inference.graphed_round import GraphedGreedyRound
from specheads.inference.lookup import LookupDrafter
from specheads.inference.static_cache import StaticTreeCache, aligned_length, prefill_static
from specheads.inference.static_drafting import StaticEagleDrafter
from specheads.inference.target_support import verifies_chains
from specheads.inference.tree import TreeBuffers
from specheads.inference.tree_verifier import FeatureFn, TreeVerifier
from specheads.inference.verify import DynamicTreeVerifier, sliding_window_of

if TYPE_CHECKING:
    from specheads.inference.generate import SpeculativeLM

# Drafters of unknown tree size (not Medusa / EAGLE) get trees padded to a power of two (at least
# MIN_BUCKET nodes) and this many cache slots reserved for them.
MIN_BUCKET = 8
UNKNOWN_TREE_RESERVE = 64


# --- tree sizes --------------------------------------------------------------------------------------------
def fixed_tree_slots(drafter: Drafter) -> int | None:
    """The node count every tree of this drafter fits in (root included), or None when unknown."""
    if isinstance(drafter, MedusaDrafter):
        return drafter.buffers.num_nodes
    if isinstance(drafter, EagleDrafter):
        return drafter.num_nodes + 1
    if isinstance(drafter, LookupDrafter):
        heads_slots = fixed_tree_slots(drafter.drafter)
        return None if heads_slots is None else heads_slots + drafter.max_grafted_nodes
    return None


def padded_slots(num_nodes: int, fixed: int | None) -> int:
    """Verification slots for a tree of `num_nodes`: the drafter's fixed count, else a power-of-two bucket."""
    if fixed is not None and num_nodes <= fixed:
        return fixed
    return max(MIN_BUCKET, 1 << (num_nodes - 1).bit_length())


def tree_reserve(drafter: Drafter) -> int:
    """Cache slots to reserve beyond prompt + max_new_tokens for this drafter's trees."""
    fixed = fixed_tree_slots(drafter)
    return fixed if fixed is not None else UNKNOWN_TREE_RESERVE



class FastPathRunner:
    """Batch-1 speculative decoding on a static cache (one `TreeVerifier` per padded tree size).

    Kept by `SpeculativeLM` across `generate` calls, so the cache and the captured graphs are reused.

    Args:
        target: the target model.
        select_features: the heads' `select_features` (hidden_states tuple -> (1, T, h)).
        capacity: cache slots: at least the longest prompt + max_new_tokens + tree nodes.
        use_graphs: capture CUDA graphs (default: when the target is on CUDA).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        select_features: FeatureFn,
        capacity: int,
        use_graphs: bool | None = None,
    ) -> None:
        self.target, self.select_features = target, select_features
        self.cache = StaticTreeCache(target, capacity)
        self.use_graphs = target.device.type == "cuda" if use_graphs is None else use_graphs
        self.verifiers: dict[int, TreeVerifier] = {}
        self.device, self.dtype = target.device, target.dtype
        self.fixed_slots: int | None = None  # set by use_drafter
        self.reserve = 0  # tree slots checked at prefill; set by use_drafter (each tree is checked when loaded)
        self.static_drafting = True  # EAGLE drafters run as StaticEagleDrafter (one CUDA graph per round)
        self.drafter: Drafter | None = None  # what drafts on this path; set by use_drafter
        self.static_drafter: StaticEagleDrafter | None = None  # kept with its graph while the EAGLE drafter stays
        self.greedy_round: GraphedGreedyRound | None = None  # kept with its graph while the static drafter stays
        self.graphed_prefill: bool | None = None  # `pads_prompt`'s setting (set by `generate` from the SpeculativeLM)
        self.prompt_graphs: GraphedPrefill | None = None  # created on first use
        self.position_offset = 0  # the sequence's text positions' offset from its slots (M-RoPE, after an image)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def verifier(self, num_slots: int) -> TreeVerifier:
        """The verifier for trees padded to `num_slots` nodes (created, and on CUDA captured, on first use)."""
        if num_slots not in self.verifiers:
            self.verifiers[num_slots] = TreeVerifier(
                self.target, self.cache, num_slots, self.select_features, self.use_graphs
            )
        return self.verifiers[num_slots]

    def use_drafter(self, drafter: Drafter) -> Drafter:
        """Size verification for this drafter's trees and return the drafter to use on this path (`generate`
        calls it before each call's rows): an (autoregressive) EAGLE drafter without early stopping or pruning becomes its fixed-shape,
        graphed `StaticEagleDrafter` (same trees, kept across calls with its graph); others are used as they are.
        Prompt lookup (`LookupDrafter`) wraps what its heads' drafter becomes; its graft runs eagerly.
        """
        if isinstance(drafter, LookupDrafter):
            heads_drafter = self.use_drafter(drafter.drafter)
            self.fixed_slots, self.reserve = fixed_tree_slots(drafter), tree_reserve(drafter)
            self.drafter = drafter if heads_drafter is drafter.drafter else drafter.around(heads_drafter)
            return self.drafter
        self.fixed_slots, self.reserve = fixed_tree_slots(drafter), tree_reserve(drafter)
        # `type(...) is`: a parallel drafter (a subclass) drafts in one forward already and runs as it is
        static = type(drafter) is EagleDrafter and drafter.heads.static_drafting
        if self.static_drafting and static and drafter.stop_prob == drafter.min_prob == 0:
            if self.static_drafter is None or self.static_drafter.source is not drafter:
                self.static_drafter = StaticEagleDrafter(drafter, self.capacity, use_graph=self.use_graphs)
            self.drafter = self.static_drafter
        else:
            self.drafter = drafter
        return self.drafter

    def graphed_round(self, drafter: Drafter) -> GraphedGreedyRound | None:
        """The whole-round graph for greedy decoding with this drafter (None: the per-phase loop instead).

        Only a `StaticEagleDrafter` (from `use_drafter`) has one (`SpeculativeLM(graphed_rounds=True)` asks for it).
        """
        if not isinstance(drafter, StaticEagleDrafter) or self.fixed_slots is None:
            return None
        if self.greedy_round is not None and self.greedy_round.capture_failed:
            return None  # its capture failed once (warned): the per-phase loop keeps its two graphs
        if self.greedy_round is None or self.greedy_round.drafter is not drafter:
            self.greedy_round = GraphedGreedyRound(self.verifier(self.fixed_slots), drafter, self.use_graphs)
        return self.greedy_round

    def prefill(
        self, prompt: torch.Tensor, max_new_tokens: int = 0, held: tuple[StaticTreeCache, torch.Tensor] | None = None,
        inputs: dict[str, torch.Tensor] | None = None, held_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the (n,) prompt into slots [0, n) (eagerly, or padded with a CUDA graph per padded length where
        `pads_prompt` says so). Returns last logits (1, V), features (n, h).

        `held`: (this runner's cache, (m, h) features) when its slots [0, m) still hold the prompt's first m tokens
        (`prompt_cache.PromptCache.take`); only the tokens after them are run (eagerly), into slots [m, n), at
        `held_offset` from them (the held part's text position offset). `inputs`: the prompt's images: the prompt runs
        as the dynamic path runs it (the target places and embeds the images itself, with its own masks) and its
        entries are copied into the static cache; the rounds then verify at the text positions after the image.
        Raises a ValueError first when prompt + max_new_tokens + the drafter's trees do not fit the cache.
        """
        self.cache.check_room(prompt.shape[0] + max_new_tokens + self.reserve)
        self.position_offset = held_offset if held is not None else 0
        if inputs:
            if held is not None:
                raise ValueError("FastPathRunner.prefill: a held cache already holds the prompt's images")
            dynamic = DynamicTreeVerifier(self.target, self.select_features)
            last_logits, features = dynamic.prefill(prompt, max_new_tokens, inputs=inputs)
            self.cache.load_prefix(dynamic.cache, prompt.shape[0])
            self.position_offset = dynamic.position_offset
        elif held is not None:
            if held[0] is not self.cache:
                raise ValueError("FastPathRunner.prefill: the held entries are not in this runner's cache")
            start = held[1].shape[0]
            # a turn's new tokens after the kept conversation: padded and graphed as a prompt would be, where the
            # padding fits the cache (else eagerly)
            suffix, room = prompt.shape[0] - start, self.capacity - start
            if pads_prompt(self.graphed_prefill, self.use_graphs, suffix, room) and aligned_length(suffix) <= room:
                last_logits, new_features = self.graphed_prompts()(prompt[start:], start, held_offset)
            else:
                out = prefill_static(self.target, self.cache, prompt[start:], output_hidden_states=True, start=start,
                                     position_offset=held_offset)
                last_logits, new_features = out.logits[0, -1:], self.select_features(out.hidden_states)[0]
            features = torch.cat([held[1], new_features])
        elif pads_prompt(self.graphed_prefill, self.use_graphs, prompt.shape[0], self.capacity):
            last_logits, features = self.graphed_prompts()(prompt)
        else:
            out = prefill_static(self.target, self.cache, prompt, output_hidden_states=True)
            last_logits, features = out.logits[0, -1:], self.select_features(out.hidden_states)[0]
        self.cache.committed_length = prompt.shape[0]
        for verifier in self.verifiers.values():
            verifier.reset()
        return last_logits, features

    def graphed_prompts(self) -> GraphedPrefill:
        """The runner's `GraphedPrefill` (created on first use; its graphs captured per padded length)."""
        if self.prompt_graphs is None:
            self.prompt_graphs = GraphedPrefill(self.target, self.cache, self.select_features, self.use_graphs)
        return self.prompt_graphs

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify the (n,) tree padded to a fixed node count (a graph replay on CUDA).

        Returns logits (n, V) and features (n, h) of the real nodes: views of the static outputs, valid until the
        next `verify` (acceptance reads them first; the features of the path are gathered, i.e. copied).
        """
        num_nodes = tokens.shape[0]
        verifier = self.verifier(padded_slots(num_nodes, self.fixed_slots))
        verifier.load(tokens, tree, prefix_length, self.position_offset)
        logits, features = verifier.run()
        return logits[:num_nodes], features[:num_nodes]

    def compact(self, prefix_length: int, path: torch.Tensor) -> None:
        """Move the accepted path's entries to [prefix, prefix + L + 1) (one gather + index_copy_, all layers)."""
        self.cache.compact(prefix_length, path)


def use_fast_path(
    requested: bool | None,
    target: PreTrainedModel,
    batched: bool | None,
    needed_positions: int,
) -> bool:
    """Whether `generate` takes the fast path: None = when the target is on CUDA (several prompts: one after another,
    unless `batched=True`; a batched round runs eagerly: 76-185 ms for 1-16 rows of a 1B-shape Llama on an H200,
    against 4.8 ms for a fast-path round, session 48).

    Unsupported (raises for `requested=True`, falls back for None): `batched=True`, and sliding-window targets
    whose window could be reached (prompt + max_new_tokens + tree nodes >= window).
    """
    if requested not in (None, True, False):
        raise ValueError(f"fast_path={requested!r}; expected None (auto), True or False")
    reason = None
    window = sliding_window_of(target)[0]
    if window is not None and window <= needed_positions:
        reason = f"the target's sliding window ({window}) <= prompt + max_new_tokens + tree nodes ({needed_positions})"
    elif batched:
        reason = "batched=True verifies several rows in one forward; the fast path runs one row at a time"
    elif verifies_chains(target):
        reason = "the target's recurrent / convolution states are verified path by path on the eager path only"
    if requested is None:
        return reason is None and target.device.type == "cuda"
    if requested and reason is not None:
        raise ValueError(f"fast_path=True is not available: {reason}; pass fast_path=False")
    return bool(requested)


def fast_path_runner(
    lm: SpeculativeLM,
    requested: bool | None,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    batched: bool | None,
    previous: FastPathRunner | None,
) -> FastPathRunner | None:
    """The runner for this `generate` call, or None for the normal path. Reuses `previous` when it fits."""
    needed = max(p.shape[0] for p in prompts) + max_new_tokens + tree_reserve(lm.drafter)
    if not use_fast_path(requested, lm.target, batched, needed):
        return None
    target = lm.target
    if (
        previous is not None
        and previous.target is target
        and (previous.device, previous.dtype)
        == (
            target.device,
            target.dtype,
        )
    ):
        if previous.capacity >= needed:
            return previous
        needed = max(needed, 2 * previous.capacity)  # grow geometrically: few reallocations and recaptures
    return FastPathRunner(target, lm.heads.select_features, aligned_length(needed))


# --- plain greedy decoding on the static cache ------------------------------------------------------------
class StaticGreedyDecoder:
    """Plain greedy decoding (no drafts) on a `StaticTreeCache` with a captured 1-token step on CUDA.

    Outputs equal `target.generate(do_sample=False)`. Each step unmasks its own slot, runs the target on one
    token, writes the argmax to an on-device buffer and advances position, slot and step counter, all inside
    the graph; the host looks for EOS every `eos_check_every` steps (one sync), then cuts after the first EOS.

    Args:
        target: the model.
        capacity: cache slots: at least prompt + max_new_tokens.
        use_graph: capture the step as a CUDA graph (default: when the target is on CUDA).
        eos_check_every: steps between EOS checks (more = fewer syncs, more wasted steps after EOS).
        graphed_prefill: run prompts through `GraphedPrefill` (padded; CUDA graphs where `use_graph`): None (auto)
            where graphs are captured, for prompts up to `GRAPHED_PREFILL_MAX_TOKENS`; True: every prompt.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        capacity: int,
        use_graph: bool | None = None,
        eos_check_every: int = 8,
        graphed_prefill: bool | None = None,
    ) -> None:
        device, dtype = target.device, target.dtype
        self.target, self.device, self.dtype = target, device, dtype
        self.cache = StaticTreeCache(target, capacity)
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.eos_check_every = max(1, eos_check_every)
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # the token fed this step
        self.positions = torch.zeros(1, 1, dtype=torch.long, device=device)  # its position ...
        self.write = torch.zeros(1, dtype=torch.long, device=device)  # ... and cache slot (the same number)
        # where this step's token goes in `tokens`
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)  # generated tokens
        self.mask = torch.full((1, 1, 1, capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capture_failed = False
        self.last_prefill_seconds = 0.0  # the last `generate`'s prompt forward, up to its first token on the host
        self.graphed_prefill = graphed_prefill
        # its graphs are captured on first use, one per padded length (`pads_prompt` says which prompts use it)
        self.prompt_graphs = GraphedPrefill(target, self.cache, None, self.use_graph)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def step(self) -> None:
        """One decoding step on the static buffers (the body of the graph)."""
        self.mask[0, 0, 0].index_fill_(0, self.write, 0)  # the fed token sees itself from now on
        self.cache.set_write_positions(self.write)
        logits = self.target(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            **cache_kwargs(self.target, self.cache),
            use_cache=True,
        ).logits  # (1, 1, V)
        next_token = logits[0, -1].argmax()[None]  # (1,)
        self.tokens.index_copy_(0, self.step_index, next_token)
        self.ids.copy_(next_token[None])
        self.positions.add_(1)
        self.write.add_(1)
        self.step_index.add_(1)

    def _run_step(self) -> None:
        if self.use_graph and self.graph is None and not self.capture_failed:
            state = (self.ids, self.positions, self.write, self.step_index, self.mask)  # undo the warm-up advances
            self.graph, _ = try_capture(self.step, "1-token decoding step", restore=state)
            self.capture_failed = self.graph is None
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None
    ) -> torch.Tensor:
        """Greedy continuation: prompt + new tokens, (1, n + new), like `target.generate(do_sample=False)`.

        Args:
            input_ids: (1, n) or (n,) prompt.
            max_new_tokens: new tokens at most.
            eos_token_id: stop right after it (default: the target's generation config); [] never stops.
        """
        if input_ids.dim() not in (1, 2) or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(
                f"input_ids must be (1, n) or (n,) (batch size 1), got shape {tuple(input_ids.shape)}"
            )
        prompt = input_ids[0] if input_ids.dim() == 2 else input_ids
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        n = prompt.shape[0]
        if n == 0:
            raise ValueError("the prompt is empty: generation needs at least one token")
        self.cache.check_room(n + max_new_tokens)
        if eos_token_id is None:
            eos_token_id = getattr(self.target.generation_config, "eos_token_id", None)
        eos = (
            []
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else list(eos_token_id)
        )
        prompt = prompt.long().to(self.device)
        if max_new_tokens == 0:
            return prompt[None].to(input_ids.device)

        # Prefill (eager: prompt lengths vary), then the first token comes from its last logits. Reading it waits
        # for the prefill (as the speculative path's first token does), so `last_prefill_seconds` is its real time.
        prefill_start = time.perf_counter()
        if pads_prompt(self.graphed_prefill, self.use_graph, n, self.cache.capacity):
            last_logits = self.prompt_graphs(prompt)[0]  # (1, V)
        else:
            last_logits = prefill_static(self.target, self.cache, prompt).logits[0, -1:]
        first = last_logits[0].argmax()
        first.item()  # one host sync a call
        self.last_prefill_seconds = time.perf_counter() - prefill_start
        self.tokens[0] = first
        self.ids.copy_(first.view(1, 1))
        self.positions.fill_(n)
        self.write.fill_(n)
        self.step_index.fill_(1)
        self.mask.fill_(torch.finfo(self.dtype).min)
        self.mask[..., :n] = 0

        eos_ids = torch.tensor(eos, dtype=torch.long, device=self.device)
        produced = 1
        while produced < max_new_tokens:
            if eos and bool(torch.isin(self.tokens[:produced], eos_ids).any()):  # one sync per chunk
                break
            chunk = min(self.eos_check_every, max_new_tokens - produced)
            for _ in range(chunk):
                self._run_step()
            produced += chunk
        new = self.tokens[:produced].tolist()
        for i, token in enumerate(new):
            if token in eos:
                new = new[: i + 1]
                break
        out = torch.cat([prompt, torch.tensor(new, dtype=torch.long, device=self.device)])
        return out[None].to(input_ids.device)


def plain_greedy_static(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    use_graph: bool | None = None,
) -> torch.Tensor:
    """Greedy decoding with a static cache (and a CUDA-graph step on CUDA): equals `target.generate(do_sample=False)`.

    A one-off `StaticGreedyDecoder` sized for this call; keep a decoder yourself to reuse its graph across calls.
    """
    length = input_ids.shape[-1] + max_new_tokens
    return StaticGreedyDecoder(target, aligned_length(length), use_graph=use_graph).generate(
        input_ids, max_new_tokens, eos_token_id
    )
