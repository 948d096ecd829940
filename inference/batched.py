"""Batched speculative decoding: one target forward verifies the trees of all rows at once.

Rows accept different lengths, so each row b keeps its own count of committed cache entries
`valid[b]` inside one rectangular target cache (B, kv_heads, S, head_dim): entries at or past valid[b]
are garbage that the attention mask hides. Each round:

    draft    each row's drafter proposes its tree (per row: drafting is cheap)
    verify   ONE target forward over (B, N_max) tree tokens, padded; the 4-D mask gives every row its own
             prefix (its left padding and garbage hidden) and its own tree
    accept   per row (greedy / exact sampling / typical)
    update   one gather per cache layer moves each row's accepted path to valid[b] and crops to
             max(valid); finished rows leave the batch

Exactness does not depend on batching: every row sees exactly its own prefix and tree, as when alone.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.accept import accept_greedy, accept_tree
from specheads.inference.drafting import Drafter, constrain_drafts
from specheads.inference.sampling import SamplingParams
from specheads.inference.sequence_processors import SequenceContext
from specheads.inference.step_scores import StepRecorder
from specheads.inference.stopping import StopChecker
from specheads.inference.tree import TreeBuffers
from specheads.inference.verify import last_logits_only, no_logits


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


def gather_cache(cache: DynamicCache, index: torch.Tensor, rows: list[int] | None = None) -> None:
    """Keep batch `rows` (all if None), then rebuild each as keys[row, :, index[row, j]] for the (R, S_new) index."""
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        keys, values = (layer.keys, layer.values) if rows is None else (layer.keys[rows], layer.values[rows])
        _, heads, _, dim = keys.shape
        expanded = index[:, None, :, None].expand(index.shape[0], heads, index.shape[1], dim)
        layer.keys = keys.gather(2, expanded)
        layer.values = values.gather(2, expanded)


def compaction_index(valid: torch.Tensor, paths: list[torch.Tensor], cache_length: int) -> torch.Tensor:
    """(B, S_new) source positions: row b keeps 0..valid[b]-1, then its path's tree entries (at cache_length + node)."""
    new_valid = valid + torch.tensor([p.shape[0] for p in paths], device=valid.device)
    width = int(new_valid.max())
    index = torch.arange(width, device=valid.device).repeat(valid.shape[0], 1)  # garbage beyond: any valid source
    index = index.clamp(max=cache_length - 1)
    for b, path in enumerate(paths):
        start = int(valid[b])
        index[b, start : start + path.shape[0]] = cache_length + path
    return index


@torch.no_grad()
def generate_batched(
    lm: Any,
    prompts: list[torch.Tensor],
    drafters: list[Drafter],
    max_new_tokens: int,
    params: SamplingParams,
    eos: set[int],
    acceptance: str,
    stats: dict[str, Any],
    stops: list[StopChecker | None] | None = None,
    recorders: list[StepRecorder] | None = None,
) -> list[list[int]]:
    """Speculative decoding of several prompts with batched verification; returns each row's new tokens.

    `stops`: per prompt, the stopping criteria to check on its emitted tokens (inference/stopping.py);
    `recorders`: per prompt, where each emitted token's logits and scores go (inference/step_scores.py)."""
    target, heads, device, dtype = lm.target, lm.heads, lm.target.device, lm.target.dtype
    rows = len(prompts)
    lengths = torch.tensor([p.shape[0] for p in prompts], device=device)
    width = int(lengths.max())
    pad = width - lengths  # (B,) left padding of each row
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        ids[b, pad[b] :] = prompt
    cache = DynamicCache()
    positions = (torch.arange(width, device=device)[None, :] - pad[:, None]).clamp(min=0)
    out = target(
        input_ids=ids, attention_mask=prefill_mask(lengths, width, dtype), position_ids=positions,
        **cache_kwargs(target, cache), use_cache=True, output_hidden_states=True, **last_logits_only(target),
    )  # left padding: every row's last prompt token is in the last column, the only one given logits
    stats["target_forwards"] += rows
    stats["batched_forwards"] = stats.get("batched_forwards", 0) + 1
    features_all = heads.select_features(out.hidden_states)  # (B, T, h)
    new_tokens: list[list[int]] = [[] for _ in range(rows)]
    active = list(range(rows))  # original row index of each batch row
    features: list[torch.Tensor] = []  # per row: true target features of its newly committed positions
    next_tokens: list[torch.Tensor] = []  # per row: the token that followed each of those features
    done = []
    # per row, for processors that read the sequence (repetition penalty, ...): its tokens so far
    contexts = [SequenceContext(p, params, sorted(eos), b) if params.reads_sequence else None
                for b, p in enumerate(prompts)]
    stops = stops or [None] * rows
    for b, prompt in enumerate(prompts):
        last_logits = out.logits[b, -1:] if contexts[b] is None else contexts[b].last(out.logits[b, -1:])
        root = lm._choose(last_logits, params)[0]
        done.append(lm._emit([int(root)], new_tokens[b], max_new_tokens, eos, None, stops[b]))
        if recorders is not None:
            recorders[b].add(out.logits[b, -1:], recorders[b].warped(last_logits.float()), len(new_tokens[b]))
        if contexts[b] is not None:
            contexts[b].commit(root)
        features.append(features_all[b, pad[b] :])
        next_tokens.append(torch.cat([prompt[1:], root[None]]))
        drafters[b].reset()
        constrain_drafts(drafters[b], contexts[b], heads.config.vocab_size)  # processors that ban: allowed drafts only
    valid = torch.full((rows,), width, device=device)  # committed cache entries per row (padding included)
    keep = [i for i in range(rows) if not done[i]]
    if len(keep) < rows:  # rows that ended on their first token leave the batch
        gather_cache(cache, torch.arange(width, device=device).repeat(len(keep), 1), rows=keep)
        active, pad, valid = [active[i] for i in keep], pad[keep], valid[keep]
        features, next_tokens = [features[i] for i in keep], [next_tokens[i] for i in keep]
        contexts = [contexts[i] for i in keep]
    # greedy with a certified argmax (CPU): the forward skips the lm_head, the argmax comes from the hidden states
    argmax = None if params.do_sample or params.reads_sequence or recorders is not None else lm.certified_argmax
    while active:
        # draft
        proposals = [drafters[row].propose(features[i], next_tokens[i]) for i, row in enumerate(active)]
        trees = [tree for _, tree in proposals]
        nodes = max(tree.num_nodes for tree in trees)
        tokens = torch.zeros(len(active), nodes, dtype=torch.long, device=device)
        position_ids = torch.zeros(len(active), nodes, dtype=torch.long, device=device)
        for i, (tree_tokens, tree) in enumerate(proposals):
            tokens[i, : tree.num_nodes] = tree_tokens
            position_ids[i, : tree.num_nodes] = (valid[i] - pad[i]) + tree.depth
        # verify: one forward for every row
        cache_length = cache.get_seq_length()
        out = target(
            input_ids=tokens, attention_mask=verify_mask(trees, pad, valid, cache_length, nodes, dtype),
            position_ids=position_ids, **cache_kwargs(target, cache), use_cache=True, output_hidden_states=True,
            **({} if argmax is None else no_logits(device)),
        )
        stats["target_forwards"] += len(active)
        stats["batched_forwards"] += 1
        row_features = heads.select_features(out.hidden_states)  # (A, N_max, h)
        if argmax is not None:
            last_hidden = out.hidden_states[-1]  # (A, N_max, h)
            target_argmax = argmax(last_hidden.reshape(-1, last_hidden.shape[-1])).view(len(active), nodes)
        # accept, per row
        paths, finished = [], []
        for i, (tree_tokens, tree) in enumerate(proposals):
            if argmax is not None:
                path, bonus = accept_greedy(tree_tokens, tree, target_argmax[i, : tree.num_nodes])
            else:
                logits = out.logits[i, : tree.num_nodes]  # (N, V)
                path, bonus = accept_tree(tree_tokens, tree, logits, params, acceptance, contexts[i])
            accepted = torch.cat([tree_tokens[path[1:]], bonus[None]])
            stats["accepted_counts"].append(path.shape[0] - 1)
            paths.append(path)
            features[i] = row_features[i, path]
            next_tokens[i] = accepted
            row_tokens = new_tokens[active[i]]
            emitted = len(row_tokens)
            finished.append(lm._emit(accepted.tolist(), row_tokens, max_new_tokens, eos, None, stops[active[i]]))
            if recorders is not None:  # before the commit: each path node's sequence ends at the committed one
                recorders[active[i]].add_path(logits, tree_tokens, tree, path, contexts[i], len(row_tokens) - emitted)
            if contexts[i] is not None:
                contexts[i].commit(accepted)
        stats["rounds"] += 1
        # update: compact every row's cache to its path, then drop finished rows
        index = compaction_index(valid, paths, cache_length)
        valid = valid + torch.tensor([p.shape[0] for p in paths], device=device)
        keep = [i for i in range(len(active)) if not finished[i]]
        if not keep:
            break
        gather_cache(cache, index[keep], rows=keep)
        active, pad, valid = [active[i] for i in keep], pad[keep], valid[keep]
        features, next_tokens = [features[i] for i in keep], [next_tokens[i] for i in keep]
        contexts = [contexts[i] for i in keep]
    stats["new_tokens"] += sum(len(t) for t in new_tokens)
    return new_tokens
