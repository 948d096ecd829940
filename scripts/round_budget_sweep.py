"""Node budgets for batched decoding side by side: `--max-round-nodes` values on the same batches, in one process.

    python scripts/round_budget_sweep.py --batch-sizes 2,4,8 --budgets auto,16,full,plain --prompts 16 \
        --max-new-tokens 128 --threads 2 --out docs/bench/round_budget_smollm2.json

Consecutive MT-bench first turns (chat template applied) in batches of B; each batch is decoded by a `BatchEngine`
once per budget, the budgets in turn and in reverse order on every other batch (a machine that drifts affects them
alike). Budgets: an integer (tree nodes a round verifies, all rows together), `auto` (chosen each round:
inference/round_budget.py; its chooser is kept across batches, as a server keeps it), `full` (every row's full
tree) and `plain` (one node a row: plain continuous batching, drafting nothing, the honest baseline). Reported per
batch size: new tokens per second and tau of each budget, and each one's speed over `plain`; greedy answers must be
the same under every budget, or else each the target's own answer alone (the run fails if not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mt_bench_setup import add_model_options, load_lm_and_prompts, write_report  # a sibling module

from specheads.inference.batched import BatchEngine
from specheads.inference.round_budget import parse_max_round_nodes


def budget_value(name: str, rows: int) -> int | str | None:
    """A budget's `max_round_nodes` for a batch of `rows`."""
    if name == "full":
        return None
    if name == "plain":
        return rows  # one node a row: plain steps
    return parse_max_round_nodes(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--batch-sizes", default="2,4,8")
    parser.add_argument("--budgets", default="auto,16,full,plain")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    for name in budgets:  # a bad name fails now, not after the model loaded
        budget_value(name, 1)
    lm, kernels, prompts = load_lm_and_prompts(args)
    if "auto" in budgets:
        lm.verification_ms_by_tokens()  # measured before anything is timed
    lm.generate(prompts[0][None], max_new_tokens=8)  # warm-up: first-call allocations, kernel setup
    report = {"command": "python scripts/round_budget_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "target": args.target, "heads": args.heads, "tree": lm.tree_description(), "kernels": kernels,
              "threads": args.threads, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "verification_ms_by_tokens": lm.verification_ms_by_tokens() if "auto" in budgets else None,
              "batch_sizes": {}}
    for size in [int(b) for b in args.batch_sizes.split(",")]:
        totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "rounds": 0, "batches_tokens_per_second": []}
                  for name in budgets}
        chosen: dict[str, int] = {}
        batches = [prompts[i:i + size] for i in range(0, len(prompts), size)]
        for index, batch in enumerate(batches):
            answers = {}
            for name in budgets if index % 2 == 0 else budgets[::-1]:
                requests = [lm.batch_request(ids[None], max_new_tokens=args.max_new_tokens) for ids in batch]
                engine = BatchEngine(lm, max_round_nodes=budget_value(name, len(batch)))
                start = time.perf_counter()
                engine.add(requests)
                while engine.rows:
                    engine.step()
                seconds, tokens = time.perf_counter() - start, sum(len(r.new_tokens) for r in requests)
                totals[name]["seconds"] += seconds
                totals[name]["tokens"] += tokens
                totals[name]["batches_tokens_per_second"].append(tokens / seconds)
                totals[name]["forwards"] += sum(r.target_forwards for r in requests)
                totals[name]["rounds"] += engine.stats["rounds"]
                for key, count in engine.stats.get("rounds_by_nodes_per_row", {}).items():
                    chosen[key] = chosen.get(key, 0) + count
                answers[name] = [r.new_tokens for r in requests]
            for row, ids in enumerate(batch):  # where budgets differ (a near-tie rounded apart), the target decides
                if len({tuple(answers[name][row]) for name in budgets}) > 1:
                    alone = lm.target.generate(ids[None], max_new_tokens=args.max_new_tokens, do_sample=False)
                    alone = alone[0, ids.shape[0]:].tolist()
                    wrong = [name for name in budgets if answers[name][row] != alone[: len(answers[name][row])]]
                    if wrong:
                        raise RuntimeError(f"batch {index} of {size}, row {row}: the greedy answer under budgets "
                                           f"{wrong} is not the target's: batched speculative decoding must be lossless")
        result = {name: {"tokens_per_second": t["tokens"] / t["seconds"], "tau": t["tokens"] / t["forwards"],
                         "ms_per_round": 1000 * t["seconds"] / t["rounds"], **t} for name, t in totals.items()}
        if "plain" in result:
            for entry in result.values():
                entry["over_plain"] = entry["tokens_per_second"] / result["plain"]["tokens_per_second"]
        if chosen:
            result["auto"]["rounds_by_nodes_per_row"] = chosen
        report["batch_sizes"][str(size)] = result
        print(f"batch size {size}: " + ", ".join(
            f"{name} {r['tokens_per_second']:.1f} tokens/s (tau {r['tau']:.2f}"
            + (f", {r['over_plain']:.2f}x plain)" if "over_plain" in r else ")") for name, r in result.items()),
            flush=True)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
