"""Chunked prefill: a long prompt joins a running batch a chunk per round instead of in one forward.

Continuous batching runs a joining request's prompt in a forward of its own before the next round
(`BatchEngine.add`), so every running row waits for it: on 2 CPU threads SmolLM2 reads prompts at roughly 400-700
tokens/s, and a 2,000-token prompt stalls every stream for seconds. With `prefill_chunk=C` such a prompt runs C
tokens per round instead (`BatchEngine.step` advances one prefill by one chunk, then runs the round for the rows
already decoding), so a stream waits at most one chunk's forward per round; the prompt's own first token comes a
little later. The prompt's entries go into a cache of its own (from its `PromptCache` where it has one: only the
tokens after those it holds run), which joins the batch's once the last chunk is done, as a one-shot prefill's would.

Each chunk is one row without padding, so the target builds its own causal mask over the cache and the chunk
(sliding windows included), as `DynamicTreeVerifier.prefill` does after a held cache.

A request with images (`BatchRequest.inputs`, inference/multimodal.py) runs here too, alone and in one forward that
gets them, so that the target places and embeds the images itself; it records the text positions' offset. When its
prompt cache holds the same images (a conversation's next turn, `PromptCache.take`), only the new text runs, in
chunks like any text, at the held text positions.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.kv_cache import tree_cache
from specheads.inference.multimodal import position_offset
from specheads.inference.prompt_cache import images_key
from specheads.inference.verify import last_logits_only, prompt_positions


class ChunkedPrefill:
    """One request's prompt, run `chunk` tokens at a time (`advance`) into its own cache.

    Args:
        request: the `BatchRequest` whose (n,) prompt runs; its `prompt_cache`, if any, gives the first entries.
        lm: the `SpeculativeLM` (its target, and its heads' feature selection).
        chunk: prompt tokens per `advance`; None: the whole rest in one (how a prompt-cache join runs unchunked).
    """

    def __init__(self, request: Any, lm: Any, chunk: int | None) -> None:
        self.request, self.lm = request, lm
        self.cache: Cache = tree_cache()
        self.features: list[torch.Tensor] = []  # (c, h) per chunk run (the held prefix's first)
        self.done = self.reused = self.forwards = 0  # prompt tokens the cache holds; of those, reused; forwards run
        self.held_offset = 0  # the held entries' text position offset (M-RoPE, after an image)
        if request.prompt_cache is not None:
            offset = request.prompt_cache.position_offset  # (take empties the cache)
            held, features, reused = request.prompt_cache.take(
                request.prompt, lm.target, lm.heads, inputs_key=images_key(request.inputs, request.prompt.shape[0]))
            if held is not None:
                self.cache, self.done, self.reused, self.held_offset = held, reused, reused, offset
                self.features.append(features)
                request.reused_prompt_tokens += reused
        if request.inputs and not self.reused:  # images: the whole prompt in one forward (a chunk could cut one)
            chunk = None
        self.chunk = self.remaining if chunk is None else chunk  # None: the rest in one forward
        self.last_logits: torch.Tensor | None = None  # (1, V) at the prompt's last position, once finished

    @staticmethod
    def wanted(request: Any, chunk: int | None) -> bool:
        """Whether `request` should prefill in chunks: more than `chunk` prompt tokens to run (not counting those its
        prompt cache may hold, which are known only when it is taken)."""
        return chunk is not None and request.prompt.shape[0] > chunk

    @property
    def remaining(self) -> int:
        """Prompt tokens still to run."""
        return self.request.prompt.shape[0] - self.done

    @property
    def finished(self) -> bool:
        return self.last_logits is not None

    @torch.no_grad()
    def advance(self) -> None:
        """Run the next chunk (the last one also gives the last position's logits)."""
        target, prompt = self.lm.target, self.request.prompt
        end = min(self.done + self.chunk, prompt.shape[0])
        out = target(
            input_ids=prompt[None, self.done:end], **cache_kwargs(target, self.cache), use_cache=True,
            output_hidden_states=True, **last_logits_only(target),
            **prompt_positions(prompt[:end], self.done, self.images, self.held_offset),
        )
        self.features.append(self.lm.heads.select_features(out.hidden_states)[0])  # (end - done, h)
        self.done, self.forwards = end, self.forwards + 1
        if end == prompt.shape[0]:
            self.last_logits = out.logits[0, -1:]
            self.request.position_offset = self.held_offset if self.reused else position_offset(target, self.images)

    @property
    def images(self) -> dict[str, torch.Tensor]:
        """The extra inputs this prompt's forward gets: its images unless the held entries hold them."""
        return {} if self.reused else self.request.inputs

    def leave(self) -> Any:
        """The request leaves before its prompt is done (cancelled): it ends, and its prompt cache, if any, keeps the
        prompt tokens run so far (the held ones included), so that the conversation's next request need not run
        them. Returns the request."""
        if self.request.prompt_cache is not None and self.done > 0:
            prompt = self.request.prompt
            self.request.prompt_cache.store(prompt[: self.done], self.cache, torch.cat(self.features), self.lm.target,
                                            self.lm.heads, images_key(self.request.inputs, prompt.shape[0]),
                                            self.held_offset if self.reused else position_offset(self.lm.target, self.images))
        self.request.finished = True
        return self.request

    def result(self) -> tuple[Cache, torch.Tensor, torch.Tensor]:
        """Once finished: (its cache, the (1, V) last logits, the (n, h) features of the whole prompt)."""
        return self.cache, self.last_logits, torch.cat(self.features)
