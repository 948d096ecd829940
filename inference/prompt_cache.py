"""A conversation's target cache kept between `generate` calls, so each turn runs only its new tokens.

A chat re-sends the whole conversation every turn: the system prompt, every earlier question and answer, then the
new question. Without a cache the target runs all of it again before the first new token (its prefill), which on a
CPU grows to seconds as a conversation lengthens (SmolLM2-135M on 2 threads: ~400 tokens/s). `PromptCache` keeps
what the last call left: the target's keys / values of the sequence it committed (prompt + emitted tokens, the last
one excepted: it was never run through the target) and the heads' input features of the same positions. The next
call that starts with a prefix of that sequence crops the cache to the shared prefix and runs only the rest.

Outputs stay the target's: the kept entries are the ones the target computed for exactly those tokens at exactly
those positions (tree verification computes an accepted node's keys and values with its path as context, which is
the sequence), so the continuation is what a fresh prefill would give, up to floating-point summation order, the
same margin as tree verification itself (tested: identical to `target.generate` on the whole conversation).

Batch size 1 (not batched verification). On the dynamic-cache path the cache object is the conversation's own. On
the static-shape fast path (GPU) the entries live in the `FastPathRunner`'s static cache, which every call on that
`SpeculativeLM` writes: the `PromptCache` records which sequence the static cache held when it was stored
(`StaticTreeCache.sequence_number`) and keeps a copy of its entries (`StaticTreeCache.snapshot`, a device copy of
the held positions). While no other prompt has been written there the entries are used in place; after another
conversation (the server answers its requests in turn on a GPU), or when the runner grew (a longer conversation than
its cache holds), the shared entries are copied back into the runner's cache from the kept copy.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from .kv_cache import (
    LayerStates,
    cache_length,
    crop_cache,
    cut_back,
    restore_states,
    snapshot_states,
    state_layers,
)
from .multimodal import image_token_ids, inputs_fingerprint
from .static_cache import StaticTreeCache

# A hybrid target's states cannot be cut back to an earlier position, so its cache keeps copies of them where recent
# calls started (what they reused): a regenerated answer or an edited last message reuses the history before it.
STATE_CHECKPOINTS = 4


def shared_prefix_length(held: torch.Tensor, prompt: torch.Tensor) -> int:
    """How many leading tokens of `prompt` (n,) equal those of `held` (S,), at most n - 1: the target must still run
    the prompt's last token to give the first new token's logits."""
    limit = min(held.shape[0], prompt.shape[0] - 1)
    if limit <= 0:
        return 0
    differs = (prompt[:limit].to(held.device) != held[:limit]).nonzero()
    return limit if differs.numel() == 0 else int(differs[0, 0])


class PromptCache:
    """The target's KV cache and the heads' features of one conversation, reused by the next `generate` call.

    Usage: `cache = PromptCache()`, then `lm.generate(ids, prompt_cache=cache)` for each turn with the whole
    conversation so far as `ids`; `lm.last_stats["reused_prompt_tokens"]` says how many prompt tokens were not run
    again. One cache per conversation and per `SpeculativeLM` (a cache filled by other models is refused); an edited
    history reuses the part before the first changed token (a hybrid target's, whose states cannot be cut back: the
    part before the latest `checkpoints` entry within it, where one of its last STATE_CHECKPOINTS calls started). A
    call that fails leaves the cache empty (the next one runs its whole prompt), never half-updated.
    """

    def __init__(self) -> None:
        self.tokens: torch.Tensor | None = None  # (S,) the ids whose entries are held
        # hybrids: (k, the state layers' states after the first k held tokens), k ascending, at most STATE_CHECKPOINTS
        self.checkpoints: list[tuple[int, list[LayerStates]]] = []
        self.cache: Cache | None = None  # the target's keys / values of those S positions (dynamic, or a runner's static)
        self.sequence_number: int | None = None  # a static cache's sequence_number when stored
        self.snapshot: torch.Tensor | None = None  # a static cache's: a copy of the held positions' entries
        self.features: torch.Tensor | None = None  # (S, h) the heads' input features of those positions
        self._models: tuple[PreTrainedModel, PreTrainedModel] | None = None  # (target, heads) that filled it
        self.inputs_key: str | None = None  # `multimodal.inputs_fingerprint` of the images it holds (None: text)
        self.position_offset = 0  # the held text positions' offset from cache indices (M-RoPE after an image)
        self.last_call_start = 0  # how many held tokens the last call reused: where its new part (its turn) began

    def __len__(self) -> int:
        return 0 if self.tokens is None else int(self.tokens.shape[0])

    def reset(self) -> None:
        """Forget everything held (a new conversation)."""
        self.tokens = self.cache = self.features = self.sequence_number = self.snapshot = None
        self._models = self.inputs_key = None
        self.position_offset = self.last_call_start = 0
        self.checkpoints = []

    def shared_length(self, prompt: torch.Tensor) -> int:
        """How many leading tokens of `prompt` (n,) the cache holds, at most n - 1 (the target must run the last
        prompt token to give the first new token's logits)."""
        return 0 if self.tokens is None else shared_prefix_length(self.tokens, prompt)

    def prefill(
        self, verifier: Any, prompt: torch.Tensor, max_new_tokens: int, target: PreTrainedModel, heads: PreTrainedModel,
        inputs: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`verifier.prefill` of the (n,) prompt from the entries this cache holds (a `DynamicTreeVerifier` or the
        fast path's `FastPathRunner`, whose static cache the entries must still be in). Returns the last logits
        (1, V), the features (n, h) and how many prompt tokens were reused.

        `inputs`: the prompt's images (a chat about an image: each call gives the conversation's images again, as
        transformers' generate takes them). The held entries are reused only for the very same images and only when
        the tokens after them hold no image token (the rest runs as text, at the held text positions); otherwise the
        whole prompt runs with its images."""
        static = verifier.cache if isinstance(verifier.cache, StaticTreeCache) else None
        key = images_key(inputs, prompt.shape[0])
        offset = self.position_offset
        cache, held_features, reused = self.take(prompt, target, heads, static, key)
        if cache is None:  # the whole prompt, with its images
            last_logits, features = verifier.prefill(prompt, max_new_tokens, inputs=inputs)
        else:  # the held entries hold the images: the rest runs as text, at their text positions
            last_logits, features = verifier.prefill(prompt, max_new_tokens, (cache, held_features), held_offset=offset)
        return last_logits, features, reused

    def take(
        self,
        prompt: torch.Tensor,
        target: PreTrainedModel,
        heads: PreTrainedModel,
        static_cache: StaticTreeCache | None = None,
        inputs_key: str | None = None,
    ) -> tuple[Cache | None, torch.Tensor | None, int]:
        """Hand over the cache cropped to the prefix `prompt` shares with it: (cache, (m, h) features, m), or
        (None, None, 0) when nothing is shared or usable. `static_cache`: the fast path's cache this call writes to
        (the held entries are used only if they are in it, untouched since). `inputs_key`: the fingerprint of the
        call's images (None: a text prompt); entries held for other images, or a prompt whose tokens after the shared
        prefix include image tokens, are not used. The `PromptCache` is emptied: `store` refills it when the call
        completes."""
        if self._models is not None and (self._models[0] is not target or self._models[1] is not heads):
            raise ValueError(
                "this PromptCache was filled by another target or other heads; use one PromptCache per SpeculativeLM "
                "and conversation (or call reset())"
            )
        shared = self.shared_length(prompt)
        if inputs_key != self.inputs_key:  # other images (or none) than those the entries were computed with
            shared = 0
        elif inputs_key is not None:  # the rest runs without pixel inputs: it must hold no image token
            image_tokens = image_token_ids(target)
            if not image_tokens or any(int(t) in image_tokens for t in prompt[shared:].tolist()):
                shared = 0
        cache, features, sequence_number, checkpoints = self.cache, self.features, self.sequence_number, self.checkpoints
        snapshot = self.snapshot
        self.reset()
        if static_cache is not None:  # the entries in place if untouched since, else from the kept copy
            if not isinstance(cache, StaticTreeCache):
                shared = 0
            elif cache is not static_cache or sequence_number != cache.sequence_number:
                # another sequence was written there since, or the fast path grew into a new cache
                if snapshot is None or (snapshot.dtype, snapshot.device) != (target.dtype, target.device):
                    shared = 0
                else:
                    static_cache.copy_prefix(snapshot, shared)
                    cache = static_cache
        elif isinstance(cache, StaticTreeCache):  # stored by the fast path, taken by the dynamic path
            shared = 0
        if shared == 0:
            return None, None, 0
        if cache is not None and state_layers(cache):  # a hybrid's: its states are those after all it holds
            kept = rewind_states(cache, shared, checkpoints)
            if kept == 0:
                return None, None, 0
            # the held checkpoints before this point stay valid; one more at it (where this call starts)
            self.checkpoints = [c for c in checkpoints if c[0] < kept][1 - STATE_CHECKPOINTS:] + [
                (kept, snapshot_states(cache))]
            self.last_call_start = kept
            return cache, features[:kept], kept
        if not isinstance(cache, StaticTreeCache):  # a static cache's prefill writes from the shared length on
            crop_cache(cache, shared)
        self.last_call_start = shared
        return cache, features[:shared], shared

    def store(
        self,
        tokens: torch.Tensor,
        cache: Cache,
        features: torch.Tensor,
        target: PreTrainedModel,
        heads: PreTrainedModel,
        inputs_key: str | None = None,
        position_offset: int = 0,
    ) -> None:
        """Keep a completed call's state: `tokens` (S,) whose entries `cache` holds and their (S, h) `features`.
        The cache may hold more positions (accepted tokens after a stop); they are cropped away (a static cache's
        are left in place and never read: the next prefill writes from the shared length on). `inputs_key`,
        `position_offset`: the images the entries were computed with (`images_key`) and the text positions' offset."""
        length = tokens.shape[0]
        if state_layers(cache):  # a hybrid's: its pending tokens never ran into it, and its states cannot go past
            length = min(length, cache_length(cache))
            tokens = tokens[:length]
            if not cut_back(cache, length):  # states past what is kept, not recorded: keep none
                self.reset()
                return
        if features.shape[0] < length or cache_length(cache) < length:
            raise ValueError(
                f"PromptCache.store: {length} tokens but {features.shape[0]} features and {cache_length(cache)} "
                "cached positions (expected at least as many)"
            )
        if isinstance(cache, StaticTreeCache):
            self.sequence_number, self.snapshot = cache.sequence_number, cache.snapshot(length)
        else:
            crop_cache(cache, length)
        self.checkpoints = [c for c in self.checkpoints if c[0] <= length]  # `take` made them, for these tokens
        self.tokens, self.cache, self.features = tokens, cache, features[:length]
        self._models = (target, heads)
        self.inputs_key, self.position_offset = inputs_key, position_offset

    def store_call(
        self, prompt: torch.Tensor, new_tokens: list[int], committed: int, cache: Cache, features: torch.Tensor,
        target: PreTrainedModel, heads: PreTrainedModel, inputs: dict[str, torch.Tensor] | None = None,
        position_offset: int = 0,
    ) -> None:
        """`store` a completed `generate` call: the (n,) prompt, its emitted `new_tokens`, and the `committed`
        positions `cache` and the (committed, h) `features` hold. The last emitted token was never run through the
        target, and a stop inside the last round leaves accepted tokens past the emitted ones: neither is kept.
        `inputs`, `position_offset`: the call's images and its text positions' offset (`multimodal.position_offset`)."""
        held = min(committed, prompt.shape[0] + len(new_tokens))
        sequence = torch.cat([prompt, torch.tensor(new_tokens, dtype=prompt.dtype, device=prompt.device)])
        self.store(sequence[:held], cache, features, target, heads, images_key(inputs, prompt.shape[0]), position_offset)


def rewind_states(cache: Cache, shared: int, checkpoints: list[tuple[int, list[LayerStates]]]) -> int:
    """Bring a hybrid target's `cache` back to at most its first `shared` positions: all of them where its states allow
    (`kv_cache.cut_back`), else the latest checkpoint within them (its states put back, keys / values cropped).
    Returns the positions kept (0: none usable)."""
    if cut_back(cache, shared):
        return shared
    usable = [checkpoint for checkpoint in checkpoints if 0 < checkpoint[0] <= shared]
    if not usable:
        return 0
    kept, states = usable[-1]
    restore_states(cache, states, in_place=False)
    crop_cache(cache, kept)
    return kept


def images_key(inputs: dict[str, torch.Tensor] | None, prompt_length: int) -> str | None:
    """The fingerprint of a prompt's images (None for a text prompt): its extra inputs but those with one value per
    prompt token (`token_type_ids`, `mm_token_type_ids`: they grow with the conversation, and over a shared prefix of
    the same tokens they agree)."""
    if not inputs:
        return None
    return inputs_fingerprint({name: value for name, value in inputs.items()
                               if not (value.dim() == 2 and value.shape[-1] == prompt_length)})


def check_prompt_cache_call(prompt_cache: object, rows: int, batched: bool | None) -> None:
    """Refuse, naming the value, a `generate(prompt_cache=...)` call the cache cannot serve."""
    if not isinstance(prompt_cache, PromptCache):
        raise TypeError(f"prompt_cache must be a specheads PromptCache, got {type(prompt_cache).__name__}")
    if rows != 1:
        raise ValueError(f"prompt_cache serves one conversation: batch size 1 (num_return_sequences 1), got {rows} rows")
    if batched:
        raise ValueError("prompt_cache serves one row; batched=True cannot take it")


class PromptCachePool:
    """Prompt caches for several interleaved conversations (a server's clients).

    A call takes the slot its prompt continues (the prompt starts with the slot's held sequence, up to its last
    `tail` tokens: a client re-tokenizing an answer may differ at its end), lies within (the prompt is a prefix of
    what the slot holds: an answer regenerated) or edits the last turn of (the prompt keeps the slot's conversation up
    to where its last call began, `PromptCache.last_call_start`, then differs: the last message edited), the longest
    such; else the least recently used slot, whose conversation is then forgotten. Only those cases reuse a slot, so
    conversations that share just a system prompt do not take over each other's slots (each runs the system prompt
    once, in its own slot).

    Args:
        slots: how many conversations are kept at once; 0 keeps none (`take` returns None: every prompt runs whole).
            Each slot holds up to one conversation's keys / values (SmolLM2-135M, float32: ~46 KB per token).
    """

    def __init__(self, slots: int, tail: int = 8) -> None:
        if not isinstance(slots, int) or slots < 0:
            raise ValueError(f"slots={slots!r}: expected an integer >= 0")
        self.caches = [PromptCache() for _ in range(slots)]  # least recently used first
        self.tail = tail

    def take(self, prompt: torch.Tensor) -> PromptCache | None:
        """The slot for `prompt` (n,), now the most recently used; None when the pool has no slots."""
        if not self.caches:
            return None
        shared = [cache.shared_length(prompt) for cache in self.caches]
        fits = [i for i, cache in enumerate(self.caches)
                if len(cache) - shared[i] <= self.tail or shared[i] == prompt.shape[0] - 1
                or 0 < cache.last_call_start <= shared[i]]
        best = max(fits, key=lambda i: shared[i]) if fits else 0  # max: the least recently used of equals
        cache = self.caches.pop(best)
        self.caches.append(cache)
        return cache
