"""Multi-turn chat on MT-bench (both turns of each question), with and without the target cache kept between turns.

For every question one `ChatSession` keeps the cache (`PromptCache`) and one runs the whole conversation every turn,
in alternating order from question to question, on one `SpeculativeLM` (so machine noise hits both alike). Greedy
answers are checked identical (both are the target's own). Reports, per turn, the prompt length, the tokens reused,
the prompt's forward time (up to the first new token) and the whole turn's time, summed over the questions.

    python scripts/multi_turn.py --per-category 2 --out multi_turn.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from specheads.inference.bench import parse_eagle_tree
from specheads.inference.chat import ChatSession
from specheads.inference.generate import SpeculativeLM


def read_questions(path: str, per_category: int | None) -> list[dict]:
    """MT-bench records with at least two turns, the first `per_category` of each category."""
    seen: dict[str, int] = defaultdict(int)
    kept = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if len(record.get("turns", [])) < 2:
                continue
            seen[record["category"]] += 1
            if per_category is None or seen[record["category"]] <= per_category:
                kept.append(record)
    return kept


def run_conversation(lm: SpeculativeLM, turns: list[str], reuse_cache: bool, max_new_tokens: int) -> list[dict]:
    """One conversation; per turn: answer, prompt_tokens, reused_prompt_tokens, prefill_seconds, seconds."""
    chat = ChatSession(lm, reuse_cache=reuse_cache, max_new_tokens=max_new_tokens)
    rows = []
    for text in turns:
        start = time.perf_counter()
        answer = chat.ask(text)
        seconds = time.perf_counter() - start
        stats = chat.last_stats
        rows.append({"answer": answer, "prompt_tokens": stats["prompt_tokens"], "new_tokens": stats["new_tokens"],
                     "reused_prompt_tokens": stats["reused_prompt_tokens"],
                     "prefill_seconds": stats["prefill_seconds"], "seconds": seconds})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3")
    p.add_argument("--prompts", default="configs/prompts/mt_bench_questions.jsonl")
    p.add_argument("--per-category", type=int, default=2, help="questions per category (default 2; 0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tree", default="4,4,8,0.2,0.03", help="depth,top_k,nodes[,stop_prob[,min_prob]]")
    p.add_argument("--lookup-tokens", default="10:40", help="N or N:M (prompt lookup grafted onto the trees)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    lookup, _, grow = args.lookup_tokens.partition(":")
    lm = SpeculativeLM.from_pretrained(target=args.target, heads=args.heads, lookup_tokens=int(lookup),
                                      lookup_max_tokens=int(grow) if grow else None)
    kernels = lm.use_cpu_kernels()
    lm.configure_tree(**parse_eagle_tree(args.tree))
    questions = read_questions(args.prompts, args.per_category or None)
    print(f"{len(questions)} questions, kernels {kernels}, tree {lm.tree_description()}", flush=True)
    run_conversation(lm, questions[0]["turns"][:1], True, 16)  # warm-up (first-call allocations)

    totals = {variant: defaultdict(lambda: defaultdict(float)) for variant in ("cache", "no_cache")}
    per_question = []
    for i, question in enumerate(questions):
        order = [True, False] if i % 2 == 0 else [False, True]
        results = {reuse: run_conversation(lm, question["turns"], reuse, args.max_new_tokens) for reuse in order}
        for turn, (kept, fresh) in enumerate(zip(results[True], results[False])):
            if kept["answer"] != fresh["answer"]:
                raise SystemExit(f"question {question['question_id']} turn {turn + 1}: answers differ with the cache")
            for variant, row in (("cache", kept), ("no_cache", fresh)):
                for key in ("prompt_tokens", "reused_prompt_tokens", "new_tokens", "prefill_seconds", "seconds"):
                    totals[variant][turn + 1][key] += row[key]
        per_question.append({"question_id": question["question_id"], "category": question["category"],
                             "cache": [{k: v for k, v in r.items() if k != "answer"} for r in results[True]],
                             "no_cache": [{k: v for k, v in r.items() if k != "answer"} for r in results[False]]})
        print(f"[{i + 1}/{len(questions)}] {question['category']}: turn 2 prompt {results[True][1]['prompt_tokens']} "
              f"tokens, {results[True][1]['reused_prompt_tokens']} reused; prefill "
              f"{results[True][1]['prefill_seconds']:.2f} s vs {results[False][1]['prefill_seconds']:.2f} s", flush=True)

    summary = {}
    for turn in (1, 2):
        kept, fresh = totals["cache"][turn], totals["no_cache"][turn]
        summary[f"turn{turn}"] = {
            "prompt_tokens": kept["prompt_tokens"], "reused_prompt_tokens": kept["reused_prompt_tokens"],
            "new_tokens": kept["new_tokens"],
            "prefill_seconds": {"cache": kept["prefill_seconds"], "no_cache": fresh["prefill_seconds"]},
            "seconds": {"cache": kept["seconds"], "no_cache": fresh["seconds"]},
            "prefill_speedup": fresh["prefill_seconds"] / max(kept["prefill_seconds"], 1e-9),
            "turn_speedup": fresh["seconds"] / max(kept["seconds"], 1e-9),
        }
    result = {"questions": len(questions), "identical": True, "kernels": kernels, "tree": lm.tree_description(),
              "threads": args.threads, "max_new_tokens": args.max_new_tokens, "summary": summary,
              "per_question": per_question}
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
