"""Time one tree-verification forward of the target with transformers' SDPA attention (keys and values repeated
per query group) and with grouped SDPA (`--cpu-attention gqa`, inference/gqa_attention.py), alternating, at a
few cache lengths. Prints the median of each.

    python scripts/attention_cost.py                       # SmolLM2-135M, 12 nodes, 250 and 800 cached tokens
    python scripts/attention_cost.py --cached 100,400,1600 --nodes 9 --reps 50

A chain mask over the new tokens stands in for a tree's: the attention reads the same cache either way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specheads import load_target
from specheads.inference.gqa_attention import use_gqa_attention, use_sdpa_attention
from specheads.inference.onednn import use_onednn_linears, wants_onednn


def verification_forward_ms(target, cache: DynamicCache, cached: int, nodes: int) -> float:
    """One forward of `nodes` new tokens over `cached` cached ones with a 4-D additive mask; the cache is cropped back."""
    ids = torch.randint(100, target.config.vocab_size - 1, (1, nodes))
    blocked = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, nodes, cached + nodes)  # (B, 1, new, cached + new)
    mask[0, 0, :, cached:] = torch.full((nodes, nodes), blocked).triu(1)
    positions = torch.arange(cached, cached + nodes)[None]
    start = time.perf_counter()
    with torch.no_grad():
        target(ids, cache=cache, attention_mask=mask, position_ids=positions, use_cache=True)
    elapsed = time.perf_counter() - start
    cache.crop(-nodes)
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
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(torch.randint(100, target.config.vocab_size - 1, (1, cached)), cache=cache, use_cache=True)
        times: dict[str, list[float]] = {name: [] for name in switch}
        for rep in range(args.reps):
            for name in list(switch)[:: 1 if rep % 2 else -1]:  # alternating order
                switch[name](target)
                times[name].append(verification_forward_ms(target, cache, cached, args.nodes))
        sdpa, gqa = (statistics.median(times[name]) for name in switch)
        print(f"| {cached} | {sdpa:.1f} | {gqa:.1f} | {100 * (gqa / sdpa - 1):+.1f}% |")


if __name__ == "__main__":
    main()
