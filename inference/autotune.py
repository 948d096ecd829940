"""`--tree auto`: pick the draft tree that gives the most tokens per second on THIS device.

Two measurements, both on the device at hand: the target's verification cost against the number of tree
nodes (reported; on the path `generate` took: the graphed static-cache verifier on the GPU fast path), and,
for a few candidate trees, the tokens/s the heads actually reach on calibration prompts (which folds in their
measured acceptance and the drafting cost). The best candidate wins.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specheads.atomic_files import write_atomically
from specheads.heads.cache_keyword import cache_kwargs
from specheads.heads.medusa import MedusaHeads
from specheads.inference.chain_verify import ChainVerifier
from specheads.inference.generate import SpeculativeLM
from specheads.inference.kv_cache import crop_cache, tree_cache
from specheads.inference.static_cache import StaticTreeCache, prefill_static
from specheads.inference.tree import TreeBuffers, build_tree_buffers
from specheads.inference.tree_verifier import TreeVerifier
from specheads.inference.verify import verify_tree

EAGLE_CANDIDATES = [
    {"tree_depth": 4, "tree_top_k": 4, "tree_num_nodes": 8},
    {"tree_depth": 5, "tree_top_k": 6, "tree_num_nodes": 16},
    {"tree_depth": 6, "tree_top_k": 8, "tree_num_nodes": 24},
    {"tree_depth": 7, "tree_top_k": 8, "tree_num_nodes": 32},
    {"tree_depth": 8, "tree_top_k": 10, "tree_num_nodes": 60},
    # pruned to the nodes the heads find likely (a tree of varying size): pays where each node costs (CPUs)
    {"tree_depth": 5, "tree_top_k": 8, "tree_num_nodes": 24, "tree_stop_prob": 0.05, "tree_min_prob": 0.05},
    # small trees that also stop drafting where the best path is unlikely (saves draft levels on CPUs): SmolLM2 on
    # 2 threads, 32 MT-bench prompts side by side (scripts/tree_sweep.py), 4,4,8 77.2 tokens/s, these 81.1 and 80.5
    {"tree_depth": 4, "tree_top_k": 4, "tree_num_nodes": 8, "tree_stop_prob": 0.2, "tree_min_prob": 0.03},
    {"tree_depth": 5, "tree_top_k": 4, "tree_num_nodes": 10, "tree_stop_prob": 0.2, "tree_min_prob": 0.03},
]
MEDUSA_CANDIDATES = ["medusa_small", "medusa_default"]
CHAIN_DEPTHS = [2, 3, 4, 5, 6, 8]  # the candidates for a hybrid target (one chain: each further path costs a row)


def tree_candidates(lm: SpeculativeLM) -> list[Any]:
    """The trees `autotune_tree` tries for these heads: static tree names (Medusa) or dynamic tree shapes."""
    if isinstance(lm.heads, MedusaHeads):
        if lm.verifies_chains:
            return [f"chain{depth}" for depth in CHAIN_DEPTHS if depth <= lm.heads.config.num_heads]
        return list(MEDUSA_CANDIDATES)
    # children per node come from the heads' draft vocabulary (EAGLE-3, or EAGLE with a d2t)
    vocab = lm.heads.draft_vocab_size
    candidates = [c for c in EAGLE_CANDIDATES if c["tree_top_k"] <= vocab]
    if lm.verifies_chains:
        candidates = [{"tree_depth": depth, "tree_top_k": 1, "tree_num_nodes": depth} for depth in CHAIN_DEPTHS]
    config = lm.heads.config
    parallel = getattr(config, "parallel_depth", 0) or max(getattr(config, "block_size", 0) - 1, 0)
    if parallel:  # P-EAGLE / DFlash heads draft at most their parallel depth / block: deeper candidates are capped there
        capped = [{**c, "tree_depth": min(c["tree_depth"], parallel)} for c in candidates]
        candidates = [c for i, c in enumerate(capped) if c not in capped[:i]]
    if not candidates:
        raise ValueError(
            f"--tree auto: the heads' draft vocabulary of {vocab} is smaller than every candidate's "
            f"tree_top_k {[c['tree_top_k'] for c in EAGLE_CANDIDATES]}; give a tree explicitly"
        )
    return candidates


def _use_tree(lm: SpeculativeLM, candidate: Any) -> None:
    """Configure one candidate (a static tree name or dynamic tree keyword arguments). A candidate without
    pruning is unpruned: the heads' default pruning (a CPU tree's) would otherwise fill it in, and the candidates
    would not be the trees they name."""
    if isinstance(candidate, str):
        lm.configure_tree(tree=candidate)
    else:
        lm.configure_tree(**{"tree_stop_prob": 0.0, "tree_min_prob": 0.0, **candidate})


@torch.no_grad()
def verification_cost_ms(
    lm: SpeculativeLM, input_ids: torch.Tensor, node_counts: list[int], repeats: int = 5, fast_path: bool = False
) -> dict[int, float]:
    """Median milliseconds of one verification forward over N tree nodes, after the given prompt.

    `fast_path`: time what the fast path runs (a static cache, N padded slots, the CUDA-graph replay on CUDA),
    else the normal path's forward on its growing cache (`kv_cache.tree_cache`), scored by `lm.certified_argmax`
    when set, as greedy rounds are. `autotune_tree` times the one that `generate` used.
    """
    if fast_path:
        return _fast_path_verification_ms(lm, input_ids, node_counts, repeats)
    if lm.verifies_chains:
        return _chain_verification_ms(lm, input_ids, node_counts, repeats)
    target = lm.target
    cache = tree_cache()
    target(input_ids=input_ids.to(target.device), **cache_kwargs(target, cache), use_cache=True)
    prefix = input_ids.shape[1]
    costs = {}
    for n in node_counts:
        tree = build_tree_buffers(_chain(n, target.device), dtype=target.dtype)
        tokens = input_ids[0, -1:].repeat(n).to(target.device)

        def verify(tokens: torch.Tensor = tokens, tree: TreeBuffers = tree) -> None:
            if lm.certified_argmax is None:
                verify_tree(target, cache, tokens, tree, prefix)
            else:  # as greedy rounds verify: no lm_head in the forward, the certified argmax after it
                lm.certified_argmax(verify_tree(target, cache, tokens, tree, prefix, with_logits=False)[1][-1])
            crop_cache(cache, prefix)

        costs[n] = _median_ms(verify, repeats)
    return costs


def _fast_path_verification_ms(
    lm: SpeculativeLM, input_ids: torch.Tensor, node_counts: list[int], repeats: int
) -> dict[int, float]:
    """`verification_cost_ms` on a static cache: one `TreeVerifier` per N, captured (on CUDA) before timing."""
    target, prompt = lm.target, input_ids[0].to(lm.target.device)
    prefix = prompt.shape[0]
    cache = StaticTreeCache(target, prefix + max(node_counts))
    prefill_static(target, cache, prompt)
    cache.committed_length = prefix
    costs = {}
    for n in node_counts:
        verifier = TreeVerifier(target, cache, n, lm.heads.select_features)
        verifier.load(prompt[-1:].repeat(n), build_tree_buffers(_chain(n, target.device), dtype=target.dtype), prefix)
        costs[n] = _median_ms(verifier.run, repeats)  # the warm-up run captures the graph
    return costs


def _chain_verification_ms(
    lm: SpeculativeLM, input_ids: torch.Tensor, node_counts: list[int], repeats: int
) -> dict[int, float]:
    """`verification_cost_ms` for a hybrid target: a `ChainVerifier`'s forward over an N-token chain, undone after
    each run (its states put back, its attention caches cut)."""
    target, prompt = lm.target, input_ids[0].to(lm.target.device)
    verifier = ChainVerifier(target, lm.heads.select_features, argmax=lm.certified_argmax)
    verifier.prefill(prompt, 0)
    costs = {}
    for n in node_counts:
        tree = build_tree_buffers(_chain(n, target.device), dtype=target.dtype)
        tokens = prompt[-1:].repeat(n)

        def verify(tokens: torch.Tensor = tokens, tree: TreeBuffers = tree) -> None:
            verifier.verify_argmax(tokens, tree, prompt.shape[0])
            verifier.undo()

        costs[n] = _median_ms(verify, repeats)
    return costs


def _chain(n: int, device: torch.device) -> torch.Tensor:
    """Parents of an n-node chain (the root alone for n = 1)."""
    return torch.arange(-1, n - 1, device=device)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall milliseconds of `fn` over `repeats` runs after one warm-up run (synchronised on CUDA)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2] * 1000


def autotune_tree(
    lm: SpeculativeLM, calibration: list[torch.Tensor], max_new_tokens: int = 64, progress: bool = False
) -> dict[str, Any]:
    """Try candidate trees on calibration prompts, keep the fastest, and return what was measured.

    On the normal path (CPU) the candidates run interleaved: each calibration prompt through every candidate,
    in reverse order on every other prompt, so a machine that slows down or speeds up mid-calibration
    (a shared CPU drifts by 10-15%) affects all candidates alike instead of whichever ran last. On the fast
    path (CUDA) switching trees re-captures graphs, so each candidate is warmed up (captured) and then timed
    on all prompts before the next. `progress`: a progress bar of the timed runs on stderr (the calibration of
    SmolLM2 on 2 CPU threads, 8 trees x 8 prompts x 128 tokens, takes 5-11 minutes).
    """
    candidates = tree_candidates(lm)
    totals = [{"tokens": 0, "forwards": 0, "seconds": 0.0} for _ in candidates]
    bar = tqdm(total=len(candidates) * len(calibration), desc=f"tree auto ({len(candidates)} trees)", unit="run",
               disable=not progress)

    def timed_run(index: int, ids: torch.Tensor) -> None:
        lm.generate(ids, max_new_tokens=max_new_tokens)
        totals[index]["tokens"] += lm.last_stats["new_tokens"]
        totals[index]["forwards"] += lm.last_stats["target_forwards"]
        totals[index]["seconds"] += lm.last_stats["seconds"]
        bar.update()

    # Warm-up at the timed length: the GPU fast path sizes its cache and captures its graphs here, not below.
    _use_tree(lm, candidates[0])
    lm.generate(calibration[0], max_new_tokens=max_new_tokens)
    fast_path = lm.last_stats["fast_path"]  # the path the trials take (a runner kept from older calls may exist)
    if fast_path:
        for index, candidate in enumerate(candidates):
            if index:  # the first candidate was warmed up above
                _use_tree(lm, candidate)
                lm.generate(calibration[0], max_new_tokens=max_new_tokens)
            for ids in calibration:
                timed_run(index, ids)
    else:
        for position, ids in enumerate(calibration):
            order = range(len(candidates)) if position % 2 == 0 else reversed(range(len(candidates)))
            for index in order:
                _use_tree(lm, candidates[index])
                timed_run(index, ids)
    bar.close()
    trials = []
    for candidate, total in zip(candidates, totals):
        _use_tree(lm, candidate)
        trials.append({"tree": lm.tree_description(), "candidate": candidate,
                       "tau": total["tokens"] / total["forwards"],
                       "tokens_per_second": total["tokens"] / total["seconds"]})
    best = max(trials, key=lambda t: t["tokens_per_second"])
    _use_tree(lm, best["candidate"])
    node_counts = sorted({4, 8, 16, 32, 48, 64} | {t["tree"]["nodes"] + 1 for t in trials})
    return {
        "chosen": best["tree"],
        "trials": trials,
        "verification_path": "fast" if fast_path else "normal",
        "schedule": "one candidate after another" if fast_path else "interleaved per prompt",
        "calibration_prompts": len(calibration),
        "calibration_max_new_tokens": max_new_tokens,
        "verification_ms_by_nodes": verification_cost_ms(lm, calibration[0], node_counts, fast_path=fast_path),
    }


def save_tuned_heads(lm: SpeculativeLM, heads: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy the heads checkpoint `heads` (folder or Hub id) to `out_dir` with the tree `lm` runs now as its default
    on `lm`'s device.

    EAGLE / EAGLE-3: the `tree_*` fields of config.json; Medusa: `static_tree`; on a CPU target they go to
    `cpu_tree` (the default on CPUs only; other devices keep theirs). Everything else in the folder (weights,
    card, a Medusa-2 adapter) is copied as it is; config.json is replaced atomically. Returns `out_dir`.
    """
    from specheads.heads.loading import CONFIG_NAME, _resolve_folder, load_heads

    source, out = _resolve_folder(heads, None, None, False), Path(out_dir)
    if out.resolve() != source.resolve():
        shutil.copytree(source, out, dirs_exist_ok=True)
    config = json.loads((out / CONFIG_NAME).read_text())
    tree = lm.tree_description()
    if tree["kind"] == "static":
        fields = {"static_tree": tree["name"]}
    else:
        fields = dict(tree_depth=tree["depth"], tree_top_k=tree["top_k"], tree_num_nodes=tree["nodes"],
                      tree_stop_prob=tree["stop_prob"], tree_min_prob=tree["min_prob"])
    if lm.target.device.type == "cpu":  # the CPU default only: a GPU's best tree is larger
        config["cpu_tree"] = fields
    else:
        config.update(fields)
    write_atomically(out / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    load_heads(out)  # still a valid checkpoint
    return out
