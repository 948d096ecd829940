"""Corpus lookup on SmolLM2, side by side: plain `target.generate`, the heads' trees (+ prompt lookup), and the same
with the corpus' branches grafted, gated per request (`--corpus-min-gain`, default the library's) and ungated (every
round), alternating prompt by prompt in one process; greedy answers checked identical.

Two workloads:
- `--workload mt-bench` with `--corpus PATH`: MT-bench first turns and a fixed corpus of SmolLM2's answers to other
  prompts (`specheads data lookup-corpus`; never answers to MT-bench).
- `--workload task`: one task over varied inputs (`--task email`: appointment confirmations; `extract`: a sentence's
  fields as JSON; the shape of a batch job), answered one after another; the corpus starts empty and learns every answer (`--corpus-learn`), as
  `specheads serve --corpus-learn N` does.

    python scripts/corpus_lookup_bench.py --workload task --task email --prompts 24 --out docs/bench/corpus_lookup_email.json
    python scripts/corpus_lookup_bench.py --workload mt-bench --corpus CORPUS_DIR --prompts 16
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from mt_bench_setup import add_model_options, load_lm_and_prompts, write_report

from specheads.inference.corpus_gate import MIN_GAIN
from specheads.inference.corpus_lookup import CorpusLookup

NAMES = ["Maria", "John", "Aiko", "Pierre", "Fatima", "Liam", "Chen", "Olga", "Diego", "Amara", "Noah", "Priya"]
CITIES = ["Lisbon", "Toronto", "Osaka", "Lyon", "Cairo", "Dublin", "Shanghai", "Kyiv", "Lima", "Accra", "Oslo", "Pune"]
JOBS = ["teacher", "nurse", "engineer", "baker", "pilot", "lawyer", "painter", "farmer"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
PLACES = ["dental clinic", "hair salon", "bank branch", "car repair shop", "yoga studio", "law office"]


def task_prompts(task: str, count: int, seed: int = 0) -> list[str]:
    """`count` requests of one task over varied (seeded) inputs: `extract` (fields of a sentence as JSON) or `email`
    (an appointment confirmation)."""
    rng = random.Random(seed)
    if task == "extract":
        return [
            f"Extract the name, age, job and city of the person below. Answer in JSON with the keys name, age, job "
            f"and city.\n\n{rng.choice(NAMES)} is a {rng.randint(19, 80)}-year-old {rng.choice(JOBS)} who lives in "
            f"{rng.choice(CITIES)}."
            for _ in range(count)
        ]
    return [
        f"Write a short, friendly email to {rng.choice(NAMES)} confirming their appointment at our "
        f"{rng.choice(PLACES)} on {rng.choice(DAYS)} at {rng.randint(8, 17)}:{rng.choice(['00', '15', '30', '45'])}."
        for _ in range(count)
    ]


def count_tree_nodes(lm) -> list[int]:
    """A counter ([total]) of the nodes of the trees `lm`'s drafter proposes from now on (what verification costs:
    deterministic, where times are noisy)."""
    total, propose = [0], lm.drafter.propose

    def counting(*args):
        tokens, tree = propose(*args)
        total[0] += tree.num_nodes
        return tokens, tree

    lm.drafter.propose = counting  # this configuration's drafter only: configure_lookup builds a new one
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--workload", choices=("task", "mt-bench"), default="task")
    parser.add_argument("--task", choices=("extract", "email"), default="email", help="task: which one")
    parser.add_argument("--corpus", default=None, help="mt-bench: the fixed corpus (a lookup_corpus.npy or its folder)")
    parser.add_argument("--corpus-learn", type=int, default=20000, help="task: tokens of answers the corpus keeps")
    parser.add_argument("--corpus-tokens", type=int, default=8)
    parser.add_argument("--corpus-min-gain", type=float, default=MIN_GAIN, help="the gated run's gate (the other: 0)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm, kernels, prompts = load_lm_and_prompts(args)
    if args.workload == "task":
        rows = [[{"role": "user", "content": text}] for text in task_prompts(args.task, args.prompts)]
        prompts = [lm.tokenizer.apply_chat_template(r, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"][0] for r in rows]

        def make_corpus(min_gain: float) -> CorpusLookup:  # each learns the answers on its own
            return CorpusLookup(online_tokens=args.corpus_learn, min_gain=min_gain)
    else:
        if args.corpus is None:
            parser.error("--workload mt-bench needs --corpus PATH")

        def make_corpus(min_gain: float) -> CorpusLookup:
            return CorpusLookup.load(args.corpus, min_gain=min_gain)
    lookup = dict(lookup_max_tokens=args.lookup_max_tokens or None)
    setups = {"heads": None, "heads+corpus": make_corpus(0.0), "heads+corpus gated": make_corpus(args.corpus_min_gain)}
    totals = {name: {"seconds": 0.0, "new_tokens": 0, "rounds": 0, "tree_nodes": 0} for name in ["plain", *setups]}
    per_prompt = []
    for i, ids in enumerate(prompts):
        ids = ids[None]
        start = time.perf_counter()
        reference = lm.target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        totals["plain"]["seconds"] += time.perf_counter() - start
        totals["plain"]["new_tokens"] += reference.shape[1] - ids.shape[1]
        row = {"prompt": i, "new_tokens": reference.shape[1] - ids.shape[1]}
        for name in (list(setups) if i % 2 == 0 else reversed(setups)):  # alternate which speculative run goes first
            lm.configure_lookup(args.lookup_tokens, lookup_corpus=setups[name], corpus_tokens=args.corpus_tokens, **lookup)
            tree_nodes = count_tree_nodes(lm)
            start = time.perf_counter()
            out = lm.generate(ids, max_new_tokens=args.max_new_tokens)
            totals[name]["seconds"] += time.perf_counter() - start
            totals[name]["tree_nodes"] += tree_nodes[0]
            if not torch.equal(out, reference):
                raise SystemExit(f"prompt {i}: {name} differs from target.generate")
            totals[name]["new_tokens"] += out.shape[1] - ids.shape[1]
            totals[name]["rounds"] += lm.last_stats["rounds"]
            row[f"{name}_tau"] = round(lm.last_stats["mean_accepted"], 3)
        per_prompt.append(row)
        print(row, flush=True)
    plain_speed = totals["plain"]["new_tokens"] / totals["plain"]["seconds"]
    summary = {}
    for name, t in totals.items():
        speed = t["new_tokens"] / t["seconds"]
        summary[name] = {"tokens_per_second": round(speed, 2), "speedup_vs_plain": round(speed / plain_speed, 3)}
        if t["rounds"]:  # tau counts the prefill as a forward, as lm.last_stats does
            summary[name]["tau"] = round(t["new_tokens"] / (t["rounds"] + len(prompts)), 3)
            summary[name]["nodes_per_round"] = round(t["tree_nodes"] / t["rounds"], 2)  # verified, the root included
    for name in ("heads+corpus", "heads+corpus gated"):
        summary[name]["speedup_vs_heads"] = round(summary[name]["tokens_per_second"] / summary["heads"]["tokens_per_second"], 3)
    report = {"workload": args.workload, "task": args.task if args.workload == "task" else None, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "tree": args.tree, "lookup_tokens": args.lookup_tokens,
              "lookup_max_tokens": args.lookup_max_tokens, "corpus_tokens": args.corpus_tokens,
              "corpus_min_gain": args.corpus_min_gain, "corpus_size_at_end": setups["heads+corpus"].num_tokens, "kernels": kernels, "identical": True,
              "summary": summary, "per_prompt": per_prompt}
    print(summary)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
