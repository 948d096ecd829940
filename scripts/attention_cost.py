"""Time one tree-verification forward of the target with transformers' SDPA attention (keys and values repeated
per query group) and with grouped SDPA (`--cpu-attention gqa`, inference/gqa_attention.py), alternating, at a
few cache lengths. Prints the median of each.

    python scripts/attention_cost.py                       # SmolLM2-135M, 12 nodes, 250 and 800 cached tokens
    python scripts/attention_cost.py --cached 100,400,1600 --nodes 9 --reps 50

A chain stands in for a tree (`verify_tree`, the forward a round runs): the attention reads the same cache either way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.cache_utils import Cache

from specheads import load_target
from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.gqa_attention import use_gqa_attention, use_sdpa_attention
from specheads.inference.kv_cache import crop_cache, tree_cache
from specheads.inference.onednn import use_onednn_linears, wants_onednn
from specheads.inference.tree import build_tree_buffers
from specheads.inference.verify import verify_tree


def verification_forward_ms(target, cache: Cache, cached: int, nodes: int) -> float:
    """`verify_tree` of a `nodes`-node chain over `cached` cached tokens, as a round runs it; the cache is cropped back."""
    tokens = torch.randint(100, target.config.vocab_size - 1, (nodes,))
    tree = build_tree_buffers(torch.arange(-1, nodes - 1))  # parents of a chain
    start = time.perf_counter()
    verify_tree(target, cache, tokens, tree, cached)
    elapsed = time.perf_counter() - start
    crop_cache(cache, cached)
    return 1000 * elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--cached", default="250,800", help="comma list of cache lengths")
    p.add_argument("--nodes", type=int, default=12, help="new tokens verified in one forward")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, _ = load_target(args.target)
    if wants_onednn("auto", target):
        use_onednn_linears(target)  # as `specheads bench --cpu-linear auto` runs it
    switch = {"sdpa": use_sdpa_attention, "gqa": use_gqa_attention}
    print("| cached tokens | transformers' SDPA ms | grouped SDPA ms | change |\n|---|---|---|---|")
    for cached in (int(n) for n in args.cached.split(",")):
        cache = tree_cache()
        with torch.no_grad():
            prompt = torch.randint(100, target.config.vocab_size - 1, (1, cached))
            target(input_ids=prompt, **cache_kwargs(target, cache), use_cache=True)
        times: dict[str, list[float]] = {name: [] for name in switch}
        for rep in range(args.reps):
            for name in list(switch)[:: 1 if rep % 2 else -1]:  # alternating order
                switch[name](target)
                times[name].append(verification_forward_ms(target, cache, cached, args.nodes))
        sdpa, gqa = (statistics.median(times[name]) for name in switch)
        print(f"| {cached} | {sdpa:.1f} | {gqa:.1f} | {100 * (gqa / sdpa - 1):+.1f}% |")


if __name__ == "__main__":
    main()
