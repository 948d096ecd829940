"""`BatchEngine`'s interface, one request at a time: for targets whose rows cannot share a forward (hybrids: paths
verified as chains) and for targets on CUDA, whose rows run on the fast path.

A hybrid target's recurrent / convolution states are verified one sequence at a time (inference/chain_verify.py). On
a GPU a batched round runs eagerly, all launch overhead for a small model: 76-185 ms for 1-16 rows of a 1B-shape Llama
on an H200, against 4.8 ms for a fast-path round, whose CUDA graphs take one row (session 48), so even 16 rows decode
faster one after another. The server (`ServingLoop`) and `generate --prompts` (inference/batch_file.py) serve both
through this engine: requests queue in arrival order and each `step` answers the oldest one whole, with
`SpeculativeLM`'s own row loop, on the fast path wherever `generate` would take it (streamed as it goes; a request's
prompt cache, or the server's pool's, is used when its prompt continues all the cache holds). A request cancelled
while it runs stops after the round in progress. `engine_for` picks this engine or `BatchEngine` for a
`SpeculativeLM`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from specheads.inference.batch_request import BatchRequest
from specheads.inference.batched import BatchEngine
from specheads.inference.chain_verify import CHAINS_ONLY


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
        fast_path: `generate`'s: None (auto: on CUDA for targets it serves), True (also on the CPU, eagerly: how it is
            tested) or False.
    """

    def __init__(self, lm: Any, stats: dict[str, Any] | None = None, isolate_errors: bool = False,
                 fast_path: bool | None = None) -> None:
        self.lm, self.isolate_errors, self.fast_path = lm, isolate_errors, fast_path
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
        # the fast path where `generate` would take it (CUDA; predictions are drafted from on the eager path only)
        fast_path = False if request.prediction else self.fast_path
        runner, drafter = lm.fast_path_for(fast_path, [request.prompt], request.max_new_tokens)
        verifier = runner if runner is not None else lm.eager_verifier(request.params)
        if request.streamer is not None:
            request.streamer.put(request.prompt.cpu())
        stop: Any = StopWhenCancelled(request)
        request.new_tokens = lm._generate_row(
            request.prompt, request.max_new_tokens, request.params, request.eos, request.streamer, request.acceptance,
            row_stats, verifier, drafter, request.row, stop, request.recorder, request.prompt_cache,
            request.inputs or None, request.prediction or None)
        request.target_forwards = row_stats["target_forwards"]
        request.reused_prompt_tokens = row_stats["reused_prompt_tokens"]
        request.accepted_counts = row_stats["accepted_counts"]
        for name in ("new_tokens", "target_forwards", "rounds", "reused_prompt_tokens"):
            self.stats[name] += row_stats[name]
        self.stats["batched_forwards"] += row_stats["target_forwards"]


def engine_for(lm: Any, batching: bool | None = None, **options: Any) -> BatchEngine | SerialEngine:
    """`BatchEngine(lm, **options)` or a `SerialEngine` (its `stats` and `isolate_errors` options; the batch's node budget
    and prefill chunks do not apply to one row). `batching`: None (auto): one request at a time for a hybrid target
    (`lm.verifies_chains`) and on CUDA (the fast path; module docstring), else batched; True: batched (refused for a
    hybrid); False: one at a time."""
    if batching not in (None, True, False):
        raise ValueError(f"batching={batching!r}: expected None (auto), True or False")
    hybrid = getattr(lm, "verifies_chains", False)
    if batching and hybrid:
        raise ValueError(f"{CHAINS_ONLY}: its requests run one at a time (batching off or auto)")
    if batching is None:
        batching = not hybrid and lm.target.device.type != "cuda"
    if not batching:
        return SerialEngine(lm, options.get("stats"), options.get("isolate_errors", False))
    return BatchEngine(lm, **options)
