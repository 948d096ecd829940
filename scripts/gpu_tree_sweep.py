"""On a GPU: EAGLE draft trees and the graphed prompt forward side by side against OUR OWN graphed plain decoding
(`StaticGreedyDecoder`, the honest baseline of #10), in ONE process on one loaded target.

`specheads bench` also times transformers' `generate` for every run (about 45 tokens/s for SmolLM2 on an H200: most
of a GPU bench's minutes), and one bench per tree pays the model load and the captures again. Here each prompt runs
our plain decoding once per `--graphed-prefill` value (its output is the reference every variant must equal), then
every tree with that prefill, the variants in alternating order from prompt to prompt, so machine noise hits all
alike. Each variant (heads x tree x prefill) is its own `SpeculativeLM` (own heads copy, static cache and CUDA
graphs) on the shared target.

    python scripts/gpu_tree_sweep.py --per-category 2 --graphed-prefill off,on 5,8,24 6,8,32 8,10,60
    python scripts/gpu_tree_sweep.py --heads checkpoints/smollm2-135m-instruct-eagle3,/tmp/work/e3/final 5,8,24
    python scripts/gpu_tree_sweep.py --device cpu --target stories260k --heads H --per-category 1 4,4,8   # a smoke test

Trees are `depth,top_k,nodes[,stop_prob[,min_prob]]` as for `specheads bench --tree`. bf16 outputs may differ from
the plain decoding's on near ties (kernels differ by shape): counted per variant, not fatal; fp32 differences are.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch

from specheads import SpeculativeLM, load_heads
from specheads.inference.bench import SWITCH, environment, timed
from specheads.inference.fast_path import StaticGreedyDecoder, aligned_length
from specheads.inference.prompts import read_prompts, tokenize_prompts
from specheads.inference.tree import parse_eagle_tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="depth,top_k,nodes[,stop_prob[,min_prob]]")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3",
                   help="heads folder or Hub id, or a comma list of them (e.g. the committed heads and newly trained "
                   "ones, compared side by side on the one target)")
    p.add_argument("--prompts", default="configs/prompts/mt_bench_questions.jsonl")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--graphed-prefill", default="auto", help="comma list of auto,off,on (auto: prompts up to 512 tokens)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, else fp32")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    prefills = args.graphed_prefill.split(",")
    if not prefills or set(prefills) - set(SWITCH):
        raise SystemExit(f"--graphed-prefill {args.graphed_prefill!r}: expected a comma list of {sorted(SWITCH)}")
    trees = {spec: parse_eagle_tree(spec) for spec in args.trees}  # bad specs fail before any loading
    heads_list = [h for h in args.heads.split(",") if h]
    if not heads_list:
        raise SystemExit(f"--heads {args.heads!r}: expected a heads folder or Hub id, or a comma list of them")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    lm = SpeculativeLM.from_pretrained(args.target, heads=heads_list[0], device=args.device, dtype=dtype)
    target, tokenizer = lm.target, lm.tokenizer
    prompts = tokenize_prompts(read_prompts(args.prompts, per_category=args.per_category), tokenizer)
    longest = max(p.input_ids.shape[-1] for p in prompts)
    capacity = aligned_length(longest + args.max_new_tokens)
    statics = {prefill: StaticGreedyDecoder(target, capacity, graphed_prefill=SWITCH[prefill]) for prefill in prefills}
    variants = {
        (heads, spec, prefill): SpeculativeLM(target, load_heads(heads, target=target), tokenizer=tokenizer,
                                              graphed_prefill=SWITCH[prefill], **tree)
        for heads, (spec, tree), prefill in itertools.product(heads_list, trees.items(), prefills)
    }
    # Warm-up, not timed: the longest prompt sizes every static cache and captures every graph; with the graphed
    # prefill, one prompt of each padded length captures each prompt graph.
    warm = [max(prompts, key=lambda p: p.input_ids.shape[-1])]
    warm += list({aligned_length(p.input_ids.shape[-1]): p for p in prompts}.values())
    for prompt in warm:
        ids = prompt.input_ids.to(target.device)
        for decoder in statics.values():
            decoder.generate(ids, args.max_new_tokens)
        for one in variants.values():
            one.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"[gpu_tree_sweep] warmed up: {len(variants)} variants, {len(prompts)} prompts", flush=True)
    rows: dict[tuple[str, str, str], list[dict]] = {key: [] for key in variants}
    static_rows: dict[str, list[dict]] = {prefill: [] for prefill in prefills}
    for number, prompt in enumerate(prompts, start=1):
        ids = prompt.input_ids.to(target.device)
        for prefill in prefills if number % 2 else prefills[::-1]:  # neither setting always first
            decoder = statics[prefill]
            reference, static_s = timed(partial(decoder.generate, ids, args.max_new_tokens))
            static_tokens = reference.shape[1] - ids.shape[1]
            static_rows[prefill].append({"tokens": static_tokens, "seconds": static_s,
                                         "prefill_seconds": decoder.last_prefill_seconds})
            pairs = list(itertools.product(heads_list, trees))
            for heads, spec in pairs if number % 2 else pairs[::-1]:
                one = variants[(heads, spec, prefill)]
                out, seconds = timed(partial(one.generate, ids, max_new_tokens=args.max_new_tokens, do_sample=False))
                identical = torch.equal(out.cpu(), reference.cpu())
                if not identical and target.dtype == torch.float32:
                    raise RuntimeError(f"tree {spec} of {heads} (graphed prefill {prefill}) differs from our plain "
                                       f"decoding on prompt {prompt.prompt_id}: speculative decoding must be lossless")
                stats = one.last_stats
                rows[(heads, spec, prefill)].append({
                    "tokens": out.shape[1] - ids.shape[1], "seconds": seconds, "static_tokens": static_tokens,
                    "static_seconds": static_s, "forwards": stats["target_forwards"], "rounds": stats["rounds"],
                    "prefill_seconds": stats["prefill_seconds"], "identical": identical,
                })
        print(f"[gpu_tree_sweep] {number}/{len(prompts)} prompts", flush=True)
    results = {}
    for (heads, spec, prefill), variant_rows in rows.items():
        tokens, seconds = sum(r["tokens"] for r in variant_rows), sum(r["seconds"] for r in variant_rows)
        static_tokens = sum(r["static_tokens"] for r in variant_rows)
        static_seconds = sum(r["static_seconds"] for r in variant_rows)
        prefill_seconds = sum(r["prefill_seconds"] for r in variant_rows)
        rounds = sum(r["rounds"] for r in variant_rows) or 1
        name = f"{spec} prefill {prefill}" if len(heads_list) == 1 else f"{spec} prefill {prefill} (heads {heads})"
        results[name] = {
            "heads": heads, "tree": spec, "graphed_prefill": prefill, "prompts": len(variant_rows), "tokens": tokens,
            "tau": tokens / max(sum(r["forwards"] for r in variant_rows), 1),
            "tokens_per_second": tokens / seconds, "static_tokens_per_second": static_tokens / static_seconds,
            "speedup_vs_static": (tokens / seconds) / (static_tokens / static_seconds),
            "prefill_ms_per_prompt": 1000 * prefill_seconds / len(variant_rows),
            "ms_per_round": 1000 * (seconds - prefill_seconds) / rounds,
            "identical": sum(r["identical"] for r in variant_rows),
        }
    static_summary = {
        prefill: {"tokens_per_second": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
                  "prefill_ms_per_prompt": 1000 * sum(r["prefill_seconds"] for r in rs) / len(rs)}
        for prefill, rs in static_rows.items()
    }
    print("| heads | tree | graphed prefill | tau | tokens/s | our plain tokens/s | vs our plain | prefill ms | "
          "ms a round | identical |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['heads']} | {r['tree']} | {r['graphed_prefill']} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | "
              f"{r['static_tokens_per_second']:.1f} | {r['speedup_vs_static']:.2f}x | {r['prefill_ms_per_prompt']:.1f} | "
              f"{r['ms_per_round']:.2f} | {r['identical']}/{r['prompts']} |")
    for prefill, s in static_summary.items():
        print(f"our plain decoding, graphed prefill {prefill}: {s['tokens_per_second']:.1f} tokens/s, "
              f"prefill {s['prefill_ms_per_prompt']:.1f} ms a prompt")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"max_new_tokens": args.max_new_tokens, "environment": environment(next(iter(variants.values()))),
                       "plain": static_summary, "variants": results}, f, indent=2)


if __name__ == "__main__":
    main()
