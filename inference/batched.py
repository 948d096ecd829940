"""Batched speculative decoding: one target forward verifies the trees of all rows at once, and rows join and
leave the batch between rounds (continuous batching).

Rows accept different lengths, so each row b keeps its own count of committed cache entries
`valid[b]` inside one rectangular target cache (B, kv_heads, S, head_dim): entries at or past valid[b]
are garbage that the attention mask hides. Each round:

    draft    each row's drafter proposes its tree (per row: drafting is cheap), within the round's node budget
             (`max_round_nodes`: trees shrink as rows join; at 1 node a row takes a plain step, undrafted)
    verify   ONE target forward over (B, N_max) tree tokens, padded; the 4-D mask gives every row its own
             prefix (its left padding and garbage hidden), its own tree and, on sliding-window targets, its window
    accept   per row (greedy / exact sampling / typical)
    update   per cache layer, one gather and one scatter move each row's accepted path to valid[b] in place,
             then a crop to max(valid); finished rows leave the batch

A row that joins (`BatchEngine.add`) runs its prompt in a prefill forward of its own (the newcomers of one call
together, or alone from its `PromptCache`; with `prefill_chunk`, a long one a chunk per round before the round:
inference/chunked_prefill.py); its cache rows are then appended to the running batch's, the shorter
side left-padded with hidden zeros (its rows' pad and valid move by that much). So `generate(batched=True)` and a
server's concurrent requests are one mechanism.

Exactness does not depend on batching: every row sees exactly its own prefix and tree, as when alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.accept import accept_greedy, accept_tree
from specheads.inference.batch_request import BatchRequest, check_batching_options
from specheads.inference.chain_verify import CHAINS_ONLY
from specheads.inference.chunked_prefill import ChunkedPrefill
from specheads.inference.drafting import Drafter, constrain_drafts, eagle_drafter_in, start_sequence
from specheads.inference.kv_cache import (
    cache_length,
    compact_rows,
    join_caches,
    row_cache,
    select_rows,
    tree_cache,
)
from specheads.inference.lookup import LookupDrafter, with_prediction
from specheads.inference.round_budget import AutoRoundBudget, node_probs_of
from specheads.inference.sampling import SamplingParams, choose_token
from specheads.inference.sequence_processors import SequenceContext
from specheads.inference.step_scores import StepRecorder
from specheads.inference.stopping import StopChecker, emit_tokens
from specheads.inference.tree import TreeBuffers, build_tree_buffers, truncate_tree
from specheads.inference.verify import last_logits_only, no_logits, sliding_window_of


def prefill_mask(lengths: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) additive causal mask for left-padded prompts; padding queries see only themselves (no NaN)."""
    neg = torch.finfo(dtype).min
    pad = width - lengths  # (B,)
    index = torch.arange(width, device=lengths.device)
    causal = index[None, :] <= index[:, None]  # (T, T) key <= query
    real_key = index[None, :] >= pad[:, None]  # (B, T)
    allowed = causal[None] & real_key[:, None, :]  # (B, T, T)
    allowed |= torch.eye(width, dtype=torch.bool, device=lengths.device)[None]
    return torch.zeros(allowed.shape, dtype=dtype, device=lengths.device).masked_fill(~allowed, neg)[:, None]


def verify_mask(
    trees: list[TreeBuffers], pad: torch.Tensor, valid: torch.Tensor, cache_length: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """(B, 1, N_max, S + N_max) mask: row b's nodes see keys pad[b] <= k < valid[b] and their tree ancestors.

    Rows with fewer than N_max nodes are padded with nodes that see only themselves (never used, never NaN).
    """
    keys = torch.arange(cache_length, device=pad.device)
    prefix_ok = (keys[None, :] >= pad[:, None]) & (keys[None, :] < valid[:, None])  # (B, S)
    allowed = torch.zeros(len(trees), width, cache_length + width, dtype=torch.bool, device=pad.device)
    allowed[:, :, cache_length:] = torch.eye(width, dtype=torch.bool, device=pad.device)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        allowed[b, :n, :cache_length] = prefix_ok[b]
        allowed[b, :n, cache_length : cache_length + n] = tree.ancestors
    return torch.zeros(allowed.shape, dtype=dtype, device=pad.device).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def windowed(
    mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, window: int, per_layer_types: bool
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The (B, 1, T, K) mask as a sliding-window target takes it (`verify.sliding_window_of`): also hiding keys at
    distance >= `window` from each query (positions (B, T) and (B, K), each row's own), per layer type where its
    layers differ (Qwen2-style); the mask itself when no distance reaches the window."""
    too_far = (query_positions[:, :, None] - key_positions[:, None, :]) >= window  # (B, T, K)
    if not bool(too_far.any()):
        return mask
    limited = mask.masked_fill(too_far[:, None], torch.finfo(mask.dtype).min)
    return {"full_attention": mask, "sliding_attention": limited} if per_layer_types else limited


@dataclass(eq=False)
class _Row:
    """An active row's decoding state between rounds."""

    request: BatchRequest
    drafter: Drafter
    features: torch.Tensor  # (L, h) true target features of the newly committed positions
    next_tokens: torch.Tensor  # (L,) the token that followed each of those features
    context: SequenceContext | None  # the sequence so far, for processors that read it
    committed_features: list[torch.Tensor] | None  # with a prompt cache: the features of every committed position
    drafted: bool = True  # False after a round without drafting (node budget 1): `features` then accumulate
    has_drafted: bool = False  # its drafter has had its first proposal (which also reads the whole prompt)

    @property
    def argmax_only(self) -> bool:
        """Whether the target's argmax per node is all acceptance needs (no logits)."""
        params = self.request.params
        return not params.do_sample and not params.reads_sequence and self.request.recorder is None


class BatchEngine:
    """Continuous batching: rows join (`add`) and leave between rounds; each `step` is one round for all.

    Usage: `engine = BatchEngine(lm)`, `engine.add([lm.batch_request(ids, max_new_tokens=64)])`, then
    `while engine.occupied: engine.step()`; `add` may be called again between steps. Not thread-safe: one thread
    drives it (`inference/serving_loop.py` does, for the server).

    Args:
        lm: the `SpeculativeLM` (its target, heads and drafter settings; each row drafts with its own fork).
        isolate_errors: an exception in one row's own work (its drafting, acceptance, processors, streamer, stopping
            criteria) ends that row with `request.error` set and the others go on; False (default) raises it. An
            exception in the shared forward always raises.
        max_round_nodes: (default: the `SpeculativeLM`'s `max_round_nodes`) tree nodes one round verifies at most, all
            rows together: each row's tree is cut to
            max(1, max_round_nodes // rows) nodes (EAGLE drafters select that many best nodes; other trees keep
            their first ones), and at 1 a row does not draft at all (a plain decoding step). Where a forward's cost
            grows with its tokens (CPUs), speculation stops paying as the batch grows (`bench --batch-size`); this
            shrinks the trees as it does. "auto": the nodes per row are chosen before each round for the most
            tokens per second, from the target's measured verification cost and the rows' measured drafting cost
            and acceptance (inference/round_budget.py; `stats["round_budget"]` says what it measured and chose, each
            time the engine empties).
            None there too: every row drafts its full tree.
        prefill_chunk: (default: the `SpeculativeLM`'s `prefill_chunk`) a joining prompt with more tokens to run than
            this prefills this many per round (inference/chunked_prefill.py), so running rows wait at most one chunk's
            forward per round; None: in one forward when it joins.
        stats: a dict the engine adds its counts to (target_forwards, batched_forwards, rounds, new_tokens,
            reused_prompt_tokens, prefill_seconds: joining rows' prompt forwards up to their first token), as
            `generate`'s `last_stats` are made from; each round's accepted drafts are kept per request
            (`BatchRequest.accepted_counts`).
    """

    def __init__(self, lm: Any, stats: dict[str, Any] | None = None, isolate_errors: bool = False,
                 max_round_nodes: int | str | AutoRoundBudget | None = None, prefill_chunk: int | None = None) -> None:
        if getattr(lm, "verifies_chains", False):
            raise ValueError(f"{CHAINS_ONLY}: BatchEngine cannot batch its requests; the server and generate "
                             "--prompts answer them one after another (serial_engine.engine_for)")
        if not hasattr(lm.drafter, "fork"):
            raise ValueError(f"batched decoding needs a drafter with fork(); {type(lm.drafter).__name__} has none")
        if prefill_chunk is None:
            prefill_chunk = getattr(lm, "prefill_chunk", None)
        if max_round_nodes is None:
            max_round_nodes = getattr(lm, "max_round_nodes", None)
        self.auto: AutoRoundBudget | None = max_round_nodes if isinstance(max_round_nodes, AutoRoundBudget) else None
        if self.auto is None:
            check_batching_options(max_round_nodes, prefill_chunk)
            if max_round_nodes == "auto":
                self.auto = lm.auto_round_budget()
        else:
            check_batching_options(None, prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.prefilling: list[ChunkedPrefill] = []  # long prompts joining a chunk per round, first come first
        self.lm, self.isolate_errors = lm, isolate_errors
        self.max_round_nodes = None if self.auto is not None else max_round_nodes
        self.root_only = build_tree_buffers(torch.tensor([-1], device=lm.target.device), dtype=lm.target.dtype)
        self.window, self.per_layer_types = sliding_window_of(lm.target)  # (None, False) for most targets
        self.stats = stats if stats is not None else {
            "new_tokens": 0, "target_forwards": 0, "rounds": 0, "reused_prompt_tokens": 0}
        self.stats.setdefault("batched_forwards", 0)
        self.rows: list[_Row] = []
        self.cache: Cache | None = None  # (B, kv_heads, S, head_dim) per layer, row b at batch index b
        self.pad = self.valid = torch.zeros(0, dtype=torch.long, device=lm.target.device)  # (B,) each

    @property
    def occupied(self) -> int:
        """Requests in the engine: rows decoding and prompts still prefilling in chunks."""
        return len(self.rows) + len(self.prefilling)

    # --- joining ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, requests: list[BatchRequest]) -> list[BatchRequest]:
        """Prefill `requests` and emit their first tokens; the others join the next `step`. Returns the requests
        that already ended (EOS or a stop on the first token, max_new_tokens 0). With `prefill_chunk`, a prompt
        with more tokens to run than that joins a chunk per `step` instead."""
        start = time.perf_counter()
        # alone: a request with a prompt cache (only its tokens after the held ones run), images, or a prompt to chunk
        alone = [r for r in requests
                 if r.prompt_cache is not None or r.inputs or ChunkedPrefill.wanted(r, self.prefill_chunk)]
        fresh = [r for r in requests if r not in alone]  # (requests compare by identity)
        ended: list[BatchRequest] = []
        if fresh:
            ended += self._join(*self._prefill_together(fresh))
        for request in alone:
            job = ChunkedPrefill(request, self.lm, self.prefill_chunk)  # takes what its prompt cache holds
            if job.remaining > job.chunk:
                self.prefilling.append(job)
            else:  # all in one forward now, as any short prompt
                ended += self._advance(job)
        self.stats["prefill_seconds"] = self.stats.get("prefill_seconds", 0.0) + time.perf_counter() - start
        return ended

    def _advance(self, job: ChunkedPrefill) -> list[BatchRequest]:
        """Run `job`'s next chunk; once its prompt is done its row joins the batch. Returns its request if it ended
        (on its first token, or its own error when errors are isolated)."""
        try:
            job.advance()
        except Exception as err:
            self._fail(job.request, err)
            return [job.request]
        if not job.finished:
            return []
        self.stats["target_forwards"] += 1  # the prompt counts one forward, as a prefill in one piece
        self.stats["batched_forwards"] += job.forwards
        self.stats["reused_prompt_tokens"] = self.stats.get("reused_prompt_tokens", 0) + job.reused
        cache, last_logits, features = job.result()
        pad = torch.zeros(1, dtype=torch.long, device=self.lm.target.device)
        return self._join(cache, pad, [job.request], last_logits[None], [features])

    def _prefill_step(self) -> list[BatchRequest]:
        """One chunk of the first prompt prefilling (cancelled ones leave); returns the requests that ended."""
        ended = [job.leave() for job in self.prefilling if job.request.cancelled]
        self.prefilling = [job for job in self.prefilling if not job.request.finished]
        if self.prefilling:
            start = time.perf_counter()
            job = self.prefilling[0]
            ended += self._advance(job)
            if job.finished or job.request.finished:
                self.prefilling.pop(0)
            self.stats["prefill_seconds"] = self.stats.get("prefill_seconds", 0.0) + time.perf_counter() - start
        return ended

    def _prefill_together(self, requests: list[BatchRequest]) -> tuple[Cache, torch.Tensor, list, torch.Tensor, list]:
        """One forward over the left-padded prompts: (cache, pad, requests, last logits (k, V), features)."""
        target, device = self.lm.target, self.lm.target.device
        lengths = torch.tensor([r.prompt.shape[0] for r in requests], device=device)
        width = int(lengths.max())
        pad = width - lengths  # (k,) left padding of each row
        ids = torch.zeros(len(requests), width, dtype=torch.long, device=device)
        for b, request in enumerate(requests):
            ids[b, pad[b]:] = request.prompt
        cache = tree_cache()
        positions = (torch.arange(width, device=device)[None, :] - pad[:, None]).clamp(min=0)
        mask = prefill_mask(lengths, width, target.dtype)
        if self.window is not None:
            mask = windowed(mask, positions, positions, self.window, self.per_layer_types)
        out = target(
            input_ids=ids, attention_mask=mask, position_ids=positions,
            **cache_kwargs(target, cache), use_cache=True, output_hidden_states=True, **last_logits_only(target),
        )  # left padding: every row's last prompt token is in the last column, the only one given logits
        self.stats["target_forwards"] += len(requests)
        self.stats["batched_forwards"] += 1
        features = self.lm.heads.select_features(out.hidden_states)  # (k, width, h)
        return cache, pad, requests, out.logits[:, -1:], [features[b, pad[b]:] for b in range(len(requests))]

    def _join(self, cache: Cache, pad: torch.Tensor, requests: list[BatchRequest], last_logits: torch.Tensor,
              features: list[torch.Tensor]) -> list[BatchRequest]:
        """Emit each prefilled row's first token, then append the rows that go on to the running batch."""
        valid = torch.full_like(pad, cache_length(cache))
        rows: list[_Row] = []
        for b, request in enumerate(requests):
            try:
                rows.append(self._start(request, last_logits[b], features[b]))
            except Exception as err:
                self._fail(request, err)
                rows.append(_Row(request, None, features[b], request.prompt, None, None))  # keeps row b's place
        keep = []
        for b, row in enumerate(rows):
            if row.request.finished:
                self._finish(row, cache, b, torch.arange(int(pad[b]), int(valid[b]), device=pad.device))
            else:
                keep.append(b)
        ended = [row.request for row in rows if row.request.finished]
        if keep:
            if len(keep) < len(rows):
                select_rows(cache, keep)
            rows, pad, valid = [rows[b] for b in keep], pad[keep], valid[keep]
            if self.cache is None or not self.rows:
                self.cache, self.pad, self.valid = cache, pad, valid
            else:
                shift_running, shift_new = join_caches(self.cache, cache)
                self.pad = torch.cat([self.pad + shift_running, pad + shift_new])
                self.valid = torch.cat([self.valid + shift_running, valid + shift_new])
            self.rows += rows
        return ended

    def _start(self, request: BatchRequest, last_logits: torch.Tensor, features: torch.Tensor) -> _Row:
        """A prefilled row's first token (from its (1, V) last logits) and its decoding state ((n, h) features)."""
        lm, params, prompt = self.lm, request.params, request.prompt
        if request.streamer is not None:
            request.streamer.put(prompt.cpu())
        request.target_forwards += 1
        context = SequenceContext(prompt, params, sorted(request.eos), request.row) if params.reads_sequence else None
        processed = last_logits if context is None else context.last(last_logits)  # (1, V)
        root = choose_token(processed, params)[0]
        self._emit(request, [int(root)])
        if request.recorder is not None:
            request.recorder.add(last_logits, request.recorder.warped(processed.float()), len(request.new_tokens))
        if context is not None:
            context.commit(root)
        drafter = lm.drafter.fork()
        start_sequence(drafter, prompt)
        if request.prediction:  # OpenAI's Predicted Outputs: guessed from like the context
            drafter = with_prediction(drafter, request.prediction)
        constrain_drafts(drafter, context, lm.heads.config.vocab_size)  # processors that ban: allowed drafts only
        return _Row(request, drafter, features, torch.cat([prompt[1:], root[None]]), context,
                    None if request.prompt_cache is None else [features])

    def _fail(self, request: BatchRequest, err: Exception) -> None:
        """A row's own work raised: re-raise it, or (isolating errors) end that row with it."""
        if not self.isolate_errors:
            raise err
        request.error, request.finished = err, True

    # --- one round ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[BatchRequest]:
        """One round for every row (draft, one verification forward, accept, compact); returns the requests that
        ended in it, and those cancelled since the last step."""
        ended = self._drop([b for b, row in enumerate(self.rows) if row.request.cancelled])
        ended += self._prefill_step()
        if not self.rows:
            return ended
        lm, target, device = self.lm, self.lm.target, self.lm.target.device
        # draft
        budget = self._nodes_per_row()
        start = time.perf_counter()
        proposals, failed = [], []
        for b, row in enumerate(self.rows):
            try:
                proposals.append(self._draft(row, budget))
            except Exception as err:
                self._fail(row.request, err)
                failed.append(b)
        ended += self._drop(failed)
        if not self.rows:
            return ended
        if self.auto is not None and budget != 1:
            self._record_draft(start)
        start = time.perf_counter()
        pad, valid, rows = self.pad, self.valid, self.rows
        trees = [tree for _, tree in proposals]
        nodes = max(tree.num_nodes for tree in trees)
        tokens = torch.zeros(len(rows), nodes, dtype=torch.long, device=device)
        position_ids = torch.zeros(len(rows), nodes, dtype=torch.long, device=device)
        for i, (tree_tokens, tree) in enumerate(proposals):
            tokens[i, : tree.num_nodes] = tree_tokens
            position_ids[i, : tree.num_nodes] = (valid[i] - pad[i]) + tree.depth
        # verify: one forward for every row; greedy rows only with a certified argmax (CPU): no lm_head in the forward
        argmax = lm.certified_argmax if all(row.argmax_only for row in rows) else None
        cache_width = cache_length(self.cache)
        mask = verify_mask(trees, pad, valid, cache_width, nodes, target.dtype)
        if self.window is not None:
            cached_positions = torch.arange(cache_width, device=device)[None, :] - pad[:, None]  # (B, S); < 0: padding
            mask = windowed(mask, position_ids, torch.cat([cached_positions, position_ids], dim=1), self.window,
                            self.per_layer_types)
        if any(row.request.position_offset for row in rows):  # text after an M-RoPE image: nothing built otherwise
            offsets = torch.tensor([row.request.position_offset for row in rows], device=device)
            position_ids = position_ids + offsets[:, None]
        out = target(
            input_ids=tokens, attention_mask=mask,
            position_ids=position_ids, **cache_kwargs(target, self.cache), use_cache=True, output_hidden_states=True,
            **({} if argmax is None else no_logits(device)),
        )
        self.stats["target_forwards"] += len(rows)
        self.stats["batched_forwards"] += 1
        self.stats["rounds"] += 1
        row_features = lm.heads.select_features(out.hidden_states)  # (B, N_max, h)
        if argmax is not None:
            last_hidden = out.hidden_states[-1]  # (B, N_max, h)
            target_argmax = argmax(last_hidden.reshape(-1, last_hidden.shape[-1])).view(len(rows), nodes)
        # accept, per row
        paths = []
        for i, ((tree_tokens, tree), row) in enumerate(zip(proposals, rows)):
            try:
                logits = None if argmax is not None else out.logits[i, : tree.num_nodes]  # (N, V)
                paths.append(self._accept(row, tree_tokens, tree, logits,
                                          None if argmax is None else target_argmax[i, : tree.num_nodes], row_features[i]))
            except Exception as err:
                self._fail(row.request, err)
                paths.append(torch.zeros(1, dtype=torch.long, device=device))  # the root: the row leaves anyway
        # update: compact every row's cache to its path (in place), then drop finished rows
        self.valid = compact_rows(self.cache, valid, paths, cache_width)
        if self.auto is not None:  # acceptance read the verdicts back: the forward has finished
            self._record_verify(budget, nodes, paths, _synchronized_since(start, device))
        ended += self._drop([b for b, row in enumerate(rows) if row.request.finished])
        if self.auto is not None and not self.occupied:  # what the budget measured, once the batch has emptied
            self.stats["round_budget"] = self.auto.summary()
        return ended

    def _nodes_per_row(self) -> int | None:
        """This round's node budget per row (None: full trees)."""
        if self.auto is None:
            return None if self.max_round_nodes is None else max(1, self.max_round_nodes // len(self.rows))
        size = self.auto.nodes_per_row(len(self.rows))
        chosen, key = self.stats.setdefault("rounds_by_nodes_per_row", {}), "full" if size is None else str(size)
        chosen[key] = chosen.get(key, 0) + 1  # this engine's rounds by the size chosen
        return size

    def _record_draft(self, start: float) -> None:
        """Tell the automatic budget what this round's drafting (since `start`) cost."""
        seconds = _synchronized_since(start, self.lm.target.device)
        if all(row.has_drafted for row in self.rows):  # a first draft also reads the prompt: not a round's cost
            self.auto.record_draft(len(self.rows), seconds)
        for row in self.rows:
            row.has_drafted = True

    def _record_verify(self, size: int | None, width: int, paths: list[torch.Tensor], seconds: float) -> None:
        """Tell the automatic budget what this round's verification (the forward, acceptance, the cache's
        compaction) cost and what each row accepted."""
        self.auto.record_verify(len(self.rows), width, size, seconds)
        if size != 1:
            for row, path in zip(self.rows, paths):
                self.auto.record_row(size, node_probs_of(row.drafter), path.shape[0] - 1)

    def _draft(self, row: _Row, budget: int | None) -> tuple[torch.Tensor, TreeBuffers]:
        """The row's tree of at most `budget` nodes (None: its drafter's own); at 1, its root alone, undrafted."""
        if budget == 1:
            row.drafted = False
            return row.next_tokens[-1:], self.root_only
        row.drafted = True
        inner = eagle_drafter_in(row.drafter)
        if budget is None or inner is None:
            tokens, tree = row.drafter.propose(row.features, row.next_tokens)
        else:  # its best `budget - 1` nodes under the root, not merely the first ones
            wanted, inner.num_nodes = inner.num_nodes, min(inner.num_nodes, budget - 1)
            try:
                tokens, tree = row.drafter.propose(row.features, row.next_tokens)
            finally:
                inner.num_nodes = wanted
        if budget is not None and tree.num_nodes > budget:  # a static tree, a prompt-lookup branch past the budget
            tokens, tree = tokens[:budget], truncate_tree(tree, budget)
        return tokens, tree

    def _accept(self, row: _Row, tokens: torch.Tensor, tree: TreeBuffers, logits: torch.Tensor | None,
                target_argmax: torch.Tensor | None, node_features: torch.Tensor) -> torch.Tensor:
        """One row's acceptance from its (N, V) tree logits or (N,) target argmax, then its emission and new state
        ((N_max, h) node features); returns its accepted path of tree nodes."""
        request = row.request
        if target_argmax is not None:
            path, bonus = accept_greedy(tokens, tree, target_argmax)
        else:
            path, bonus = accept_tree(tokens, tree, logits, request.params, request.acceptance, row.context)
        accepted = torch.cat([tokens[path[1:]], bonus[None]])
        request.target_forwards += 1
        request.accepted_counts.append(path.shape[0] - 1)
        if row.committed_features is not None:
            row.committed_features.append(node_features[path])
        if row.drafted:
            row.features, row.next_tokens = node_features[path], accepted
        else:  # the drafter has not seen the last round's features yet: it gets them with these
            row.features = torch.cat([row.features, node_features[path]])
            row.next_tokens = torch.cat([row.next_tokens, accepted])
        emitted = len(request.new_tokens)
        self._emit(request, accepted.tolist())
        if request.recorder is not None:  # before the commit: each path node's sequence ends at the committed one
            request.recorder.add_path(logits, tokens, tree, path, row.context, len(request.new_tokens) - emitted)
        if row.context is not None:
            row.context.commit(accepted)
        return path

    def _drop(self, leaving: list[int]) -> list[BatchRequest]:
        """Finish the rows at batch indices `leaving` and take them out of the (compact) cache."""
        if not leaving:
            return []
        for b in leaving:
            self._finish(self.rows[b], self.cache, b, torch.arange(int(self.pad[b]), int(self.valid[b]),
                                                                   device=self.pad.device))
        keep = [b for b in range(len(self.rows)) if b not in leaving]
        ended = [self.rows[b].request for b in leaving]
        self.rows, self.pad, self.valid = [self.rows[b] for b in keep], self.pad[keep], self.valid[keep]
        if keep:
            select_rows(self.cache, keep)
        else:
            self.cache = None
        return ended

    def _finish(self, row: _Row, cache: Cache, b: int, source: torch.Tensor) -> None:
        """A row ends: its prompt cache (if any) keeps its committed positions (the (S,) `source` entries of batch
        row b), its streamer ends, and its tokens count."""
        request = row.request
        request.finished = True
        if row.drafter is not None:
            constrain_drafts(row.drafter, None, 0)
        self.stats["new_tokens"] += len(request.new_tokens)
        if isinstance(row.drafter, LookupDrafter) and request.learn and not request.cancelled and request.error is None:
            row.drafter.remember(request.prompt, request.new_tokens)  # an online corpus learns the answer
        if request.prompt_cache is not None and not request.cancelled and request.error is None:
            request.prompt_cache.store_call(request.prompt, request.new_tokens, source.shape[0],
                                            row_cache(cache, b, source), torch.cat(row.committed_features),
                                            self.lm.target, self.lm.heads, request.inputs, request.position_offset)
        if request.streamer is not None and request.error is None:
            request.streamer.end()

    def _emit(self, request: BatchRequest, tokens: list[int]) -> None:
        if emit_tokens(tokens, request.new_tokens, request.max_new_tokens, request.eos, request.streamer, request.stop):
            request.finished = True


def _synchronized_since(start: float, device: torch.device) -> float:
    """Seconds since `start` once the device has finished the work queued (on CUDA, a synchronize)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def generate_batched(
    lm: Any,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    params: SamplingParams,
    eos: set[int],
    acceptance: str,
    stats: dict[str, Any],
    stops: list[StopChecker | None] | None = None,
    recorders: list[StepRecorder] | None = None,
    prediction: list[int] | None = None,
) -> list[list[int]]:
    """Speculative decoding of several prompts with batched verification; returns each row's new tokens.

    `stops`: per prompt, the stopping criteria to check on its emitted tokens (inference/stopping.py);
    `recorders`: per prompt, where each emitted token's logits and scores go (inference/step_scores.py);
    `prediction`: what every answer is expected to resemble (`BatchRequest.prediction`)."""
    requests = [
        BatchRequest(prompt, max_new_tokens, params, eos, acceptance, None if stops is None else stops[b],
                     recorder=None if recorders is None else recorders[b], row=b, prediction=list(prediction or []))
        for b, prompt in enumerate(prompts)
    ]
    engine = BatchEngine(lm, stats)
    engine.add(requests)
    while engine.occupied:
        engine.step()
    stats["accepted_counts"] += [count for request in requests for count in request.accepted_counts]
    return [request.new_tokens for request in requests]
