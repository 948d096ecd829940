"""`BatchEngine`'s interface for targets whose rows cannot share a forward: hybrids (paths verified as chains).

A hybrid target's recurrent / convolution states are verified one sequence at a time (inference/chain_verify.py),
so the server (`ServingLoop`) and `generate --prompts` (inference/batch_file.py) serve
them through this engine: requests queue in arrival order and each `step` answers the oldest one whole, with
`SpeculativeLM`'s own row loop (streamed as it goes; a request's prompt cache, or the server's pool's, is used when
its prompt continues all the cache holds). A request cancelled while it runs stops after the round in progress.
`engine_for` picks this engine or `BatchEngine` for a `SpeculativeLM`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from specheads.inference.batch_request import BatchRequest
from specheads.inference.batched import BatchEngine
from specheads.inference.chain_verify import ChainVerifier


class StopWhenCancelled:
    """A row's stop check that also ends it once its caller gave up (`request.cancelled`)."""

    def __init__(self, request: BatchRequest) -> None:
        self.request, self.inner = request, request.stop

    def first_stop(self, tokens: list[int]) -> int | None:
        if self.request.cancelled:
            return 0
        return None if self.inner is None else self.inner.first_stop(tokens)


class SerialEngine:
    """One request at a time, each answered whole by `step` (module docstring). Same calls as `BatchEngine`: `add`,
    `step`, `occupied`, `stats`.

    Args:
        lm: the `SpeculativeLM`.
        stats: totals to add to (default: new ones): new_tokens, target_forwards, rounds, reused_prompt_tokens,
            batched_forwards (= target forwards: each runs one row).
        isolate_errors: an error in one request ends that request alone (`request.error`), else it is raised.
    """

    def __init__(self, lm: Any, stats: dict[str, Any] | None = None, isolate_errors: bool = False) -> None:
        self.lm, self.isolate_errors = lm, isolate_errors
        self.auto = None  # no node budget: one row
        self.queue: deque[BatchRequest] = deque()
        self.stats = stats if stats is not None else {
            "new_tokens": 0, "target_forwards": 0, "rounds": 0, "reused_prompt_tokens": 0}
        self.stats.setdefault("batched_forwards", 0)

    @property
    def occupied(self) -> int:
        """Requests queued or running."""
        return len(self.queue)

    def add(self, requests: list[BatchRequest]) -> list[BatchRequest]:
        """Queue `requests`; none ends here."""
        self.queue.extend(requests)
        return []

    def step(self) -> list[BatchRequest]:
        """Answer the oldest queued request whole; returns it (ended: finished, cancelled or failed)."""
        if not self.queue:
            return []
        request = self.queue.popleft()
        if not request.cancelled:
            try:
                self._answer(request)
            except Exception as err:
                if not self.isolate_errors:
                    raise
                request.error = err
        request.finished = True
        if request.streamer is not None:
            request.streamer.end()
        return [request]

    def _answer(self, request: BatchRequest) -> None:
        lm = self.lm
        row_stats = {"new_tokens": 0, "target_forwards": 0, "rounds": 0, "accepted_counts": [], "prefill_seconds": 0.0,
                     "reused_prompt_tokens": 0}
        argmax = None if request.params.reads_sequence else lm.certified_argmax
        verifier = ChainVerifier(lm.target, lm.heads.select_features, argmax=argmax)
        if request.streamer is not None:
            request.streamer.put(request.prompt.cpu())
        stop: Any = StopWhenCancelled(request)
        request.new_tokens = lm._generate_row(
            request.prompt, request.max_new_tokens, request.params, request.eos, request.streamer, request.acceptance,
            row_stats, verifier, lm.drafter, request.row, stop, request.recorder, request.prompt_cache,
            request.inputs or None, request.prediction or None)
        request.target_forwards = row_stats["target_forwards"]
        request.reused_prompt_tokens = row_stats["reused_prompt_tokens"]
        request.accepted_counts = row_stats["accepted_counts"]
        for name in ("new_tokens", "target_forwards", "rounds", "reused_prompt_tokens"):
            self.stats[name] += row_stats[name]
        self.stats["batched_forwards"] += row_stats["target_forwards"]


def engine_for(lm: Any, **options: Any) -> BatchEngine | SerialEngine:
    """`BatchEngine(lm, **options)`, or for a hybrid target (`lm.verifies_chains`) a `SerialEngine` (its `stats` and
    `isolate_errors` options; the batch's node budget and prefill chunks do not apply to one row)."""
    if getattr(lm, "verifies_chains", False):
        return SerialEngine(lm, options.get("stats"), options.get("isolate_errors", False))
    return BatchEngine(lm, **options)

