"""Greedy identity and speed of SmolLM2 + heads on the device it runs on (a GPU check; no assertions).

    python scripts/gpu/check_smollm2.py --heads DIR [--limit 8] [--dtype float32] --out check.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specheads import SpeculativeLM, load_heads, load_target
from specheads.inference.prompts import read_prompts, tokenize_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", default=".gpu/data/mt_bench_questions.jsonl")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype), device=device)
    heads = load_heads(args.heads, target=target).to(device=device, dtype=target.dtype)
    lm = SpeculativeLM(target, heads, tokenizer=tokenizer)
    parser_prompts = read_prompts(args.prompts, limit=args.limit)
    rows = []
    for prompt in tokenize_prompts(parser_prompts, tokenizer):
        ids = prompt.input_ids.to(device)
        for _ in range(2):  # the first of each is a warm-up
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            base = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            torch.cuda.synchronize() if device == "cuda" else None
            t1 = time.perf_counter()
            spec = lm.generate(ids, max_new_tokens=args.max_new_tokens)
            torch.cuda.synchronize() if device == "cuda" else None
            t2 = time.perf_counter()
        n = base.shape[1] - ids.shape[1]
        same = torch.equal(base.cpu(), spec.cpu())
        first_diff = None if same else int((base[0, : spec.shape[1]] != spec[0, : base.shape[1]]).nonzero()[0])
        rows.append({"identical": same, "first_diff": first_diff, "tau": lm.last_stats["mean_accepted"],
                     "base_tps": n / (t1 - t0), "spec_tps": lm.last_stats["new_tokens"] / (t2 - t1)})
        print(json.dumps(rows[-1]))
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": args.dtype,
               "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
               "tau": sum(r["tau"] for r in rows) / len(rows),
               "speedup": sum(r["spec_tps"] for r in rows) / sum(r["base_tps"] for r in rows), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
