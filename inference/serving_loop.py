"""A `BatchEngine` driven by one background thread, for callers on many threads (the server's clients); for a hybrid
target, whose rows run one at a time, and on CUDA, where they run on the fast path, a `SerialEngine`
(inference/serial_engine.py).

Callers `submit` requests from any thread and wait on the returned `Ticket`. The loop thread lets waiting requests
join the running batch before each round (up to `max_batch` rows), runs the round, and wakes the callers whose
requests ended. A request that arrives while others are generating does not wait for them: it starts at the next
round, and the target verifies every row's tree in one forward.

Streamed tokens reach a request's `streamer` on the loop thread; a streamer must not block (the server's puts text
into a queue its own thread sends from). A caller that gives up sets `request.cancelled`: the row leaves the batch
before the next round. An exception in one request's own work (its drafting, a processor, its streamer, a stopping
criterion) fails that request alone; one in the shared forward fails every request in the batch, and the loop goes
on with a fresh engine.
"""

from __future__ import annotations

import threading
from typing import Any

from .batched import BatchRequest
from .prompt_cache import PromptCachePool
from .serial_engine import engine_for

COUNTERS = {  # name -> what `ServingLoop.metrics` counts under it, over the loop's lifetime
    "requests_finished": "requests that ended normally (EOS, max_new_tokens, a stop)",
    "requests_cancelled": "requests their caller gave up (a client gone)",
    "requests_failed": "requests that ended with an error",
    "prompt_tokens": "prompt tokens of the requests that ended",
    "reused_prompt_tokens": "prompt tokens taken from a kept cache instead of run again",
    "generated_tokens": "tokens generated",
    "row_forwards": "target forwards, counted per request (a request's tau: generated / its forwards)",
    "accepted_draft_tokens": "drafted tokens the target accepted",
    "draft_rounds": "verification rounds, counted per request (acceptance at depth d: accepted_by_depth / this)",
    "batched_forwards": "target forwards run (each verifies every row of the batch)",
}
LABELED_COUNTERS = {  # name -> (label, what it counts): one counter per label value
    "rounds_by_nodes_per_row": ("nodes_per_row", "rounds by the tree nodes per row max_round_nodes='auto' chose "
                                "(1: plain steps; full: whole trees), over the SpeculativeLM's lifetime"),
    "accepted_by_depth": ("depth", "rounds whose drafted token at this depth the target accepted (vLLM's accepted "
                          "tokens per position)"),
}


class Ticket:
    """A submitted request's handle: `wait()` returns it once it ended, or raises the error that ended it."""

    def __init__(self, request: BatchRequest, pooled: bool = True) -> None:
        self.request, self.pooled = request, pooled
        self.error: BaseException | None = None
        self._done = threading.Event()

    def wait(self, timeout: float | None = None) -> BatchRequest:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not end within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.request

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _end(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class ServingLoop:
    """Continuous batching on a background thread.

    Args:
        lm: the `SpeculativeLM` whose target and heads answer.
        max_batch: rows generated together at most; further requests wait for a row to end.
        pool: prompt caches kept between requests (multi-turn chat): a request without its own `prompt_cache` takes
            the pool's slot for its prompt when it joins (on the loop thread, so the pool needs no lock).
        batching: `engine_for`'s: None (auto: batched, but one request at a time on CUDA, on the fast path, and for
            hybrid targets), True or False.
    """

    def __init__(self, lm: Any, max_batch: int = 8, pool: PromptCachePool | None = None,
                 batching: bool | None = None) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r}: expected an integer >= 1")
        self.lm, self.max_batch, self.pool, self.batching = lm, max_batch, pool, batching
        self.engine = engine_for(lm, batching, isolate_errors=True)
        # lifetime totals for monitoring (`metrics`); written by the loop thread only
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.accepted_by_depth: dict[str, int] = {}  # "d" -> rounds whose d-th drafted token was accepted
        self._waiting: list[Ticket] = []
        self._running: dict[int, Ticket] = {}  # id(request) -> ticket, for the rows in the engine
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="specheads-batch-loop", daemon=True)
        self._thread.start()

    def submit(self, request: BatchRequest, pooled: bool = True) -> Ticket:
        """Queue `request`; it joins the batch before the next round. `pooled=False`: it takes no slot of the pool
        (a request without a `prompt_cache` then runs its whole prompt)."""
        ticket = Ticket(request, pooled)
        with self._wake:
            if self._closed:
                raise RuntimeError("the serving loop is closed")
            self._waiting.append(ticket)
            self._wake.notify()
        return ticket

    def run(self, request: BatchRequest) -> BatchRequest:
        """`submit` and wait for the end."""
        return self.submit(request).wait()

    def metrics(self) -> dict[str, int | dict[str, int]]:
        """The lifetime `COUNTERS`, and now: running and waiting requests, the batch limit, the tokens a corpus lookup
        guesses from (if any); with an automatic node budget its `LABELED_COUNTERS` ({label value: count})."""
        metrics: dict[str, int | dict[str, int]] = {
            **self.totals, "running_requests": len(self._running), "waiting_requests": len(self._waiting),
            "max_batch": self.max_batch}
        corpus = getattr(self.engine.lm.drafter, "corpus", None)  # a LookupDrafter's (inference/corpus_lookup.py)
        if corpus is not None:
            metrics["lookup_corpus_tokens"] = corpus.num_tokens  # grows with --corpus-learn
        if self.engine.auto is not None:
            metrics["rounds_by_nodes_per_row"] = dict(self.engine.auto.rounds)  # a copy: the loop thread adds to it
        metrics["accepted_by_depth"] = dict(self.accepted_by_depth)
        return metrics

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread after the current round; requests still waiting or running fail."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self.engine.occupied:
                    self._wake.wait()
                if self._closed:
                    stopped = RuntimeError("the serving loop was closed")
                    for ticket in self._waiting + list(self._running.values()):
                        ticket._end(stopped)
                    self._waiting, self._running = [], {}
                    return
                room = max(self.max_batch - self.engine.occupied, 0)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            self._round(joining)

    def _round(self, joining: list[Ticket]) -> None:
        """Let `joining` in, run one round, wake the callers whose requests ended."""
        forwards_before = self.engine.stats["batched_forwards"]
        try:
            for ticket in joining:
                self._running[id(ticket.request)] = ticket
                if self.pool is not None and ticket.pooled and ticket.request.prompt_cache is None:
                    ticket.request.prompt_cache = self.pool.take(ticket.request.prompt)
            ended = self.engine.add([t.request for t in joining]) if joining else []
            ended += self.engine.step()
        except Exception as err:  # the batch's state is unknown: fail its requests, start afresh
            self.totals["requests_failed"] += len(self._running)
            for ticket in self._running.values():
                ticket._end(err)
            self._running = {}
            self.engine = engine_for(self.lm, self.batching, isolate_errors=True)
            return
        self.totals["batched_forwards"] += self.engine.stats["batched_forwards"] - forwards_before
        for request in ended:
            self._count(request)
            self._running.pop(id(request))._end(request.error)

    def _count(self, request: BatchRequest) -> None:
        outcome = "failed" if request.error is not None else "cancelled" if request.cancelled else "finished"
        self.totals[f"requests_{outcome}"] += 1
        self.totals["prompt_tokens"] += request.prompt.shape[0]
        self.totals["reused_prompt_tokens"] += request.reused_prompt_tokens
        self.totals["generated_tokens"] += len(request.new_tokens)
        self.totals["row_forwards"] += request.target_forwards
        self.totals["accepted_draft_tokens"] += sum(request.accepted_counts)
        self.totals["draft_rounds"] += len(request.accepted_counts)
        for accepted in request.accepted_counts:  # a round that kept k drafted tokens kept those at depths 1..k
            for depth in range(1, accepted + 1):
                self.accepted_by_depth[str(depth)] = self.accepted_by_depth.get(str(depth), 0) + 1
