"""Multi-turn chat on MT-bench (both turns of each question), with and without the target cache kept between turns.

For every question one `ChatSession` keeps the cache (`PromptCache`) and one runs the whole conversation every turn,
and plain greedy `target.generate` answers the same conversation reusing its own cache between turns (transformers'
prefix caching: `past_key_values` cropped to the prefix the next prompt shares), the honest plain peer of a chat
server. The three alternate in rotating order from question to question, on one target (so machine noise hits them
alike). Greedy answers are checked identical (all are the target's own). Reports, per turn, the prompt length, the
tokens reused, the prompt's forward time (up to the first new token) and the whole turn's time, summed.

    python scripts/multi_turn.py --per-category 2 --out multi_turn.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.chat import ChatSession
from specheads.inference.generate import SpeculativeLM
from specheads.inference.kv_cache import crop_cache
from specheads.inference.prompt_cache import shared_prefix_length
from specheads.inference.tree import parse_eagle_tree


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


def run_plain_conversation(lm: SpeculativeLM, turns: list[str], max_new_tokens: int) -> list[dict]:
    """The same conversation with plain greedy `target.generate`, its cache kept and cropped to the shared prefix."""
    tokenizer, target = lm.tokenizer, lm.target
    cache, held = DynamicCache(), torch.zeros(0, dtype=torch.long)  # held: the tokens whose keys / values it holds
    messages: list[dict[str, str]] = []
    rows = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        start = time.perf_counter()
        shared = shared_prefix_length(held, ids[0])
        crop_cache(cache, shared)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(target, cache),
                              max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
        held = out[0, :-1]  # generate never runs its last token through the model
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        rows.append({"answer": answer, "prompt_tokens": ids.shape[1], "new_tokens": out.shape[1] - ids.shape[1],
                     "reused_prompt_tokens": shared, "prefill_seconds": 0.0, "seconds": seconds})
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

    variants = ("cache", "no_cache", "plain_cache")
    run = {"cache": lambda turns: run_conversation(lm, turns, True, args.max_new_tokens),
           "no_cache": lambda turns: run_conversation(lm, turns, False, args.max_new_tokens),
           "plain_cache": lambda turns: run_plain_conversation(lm, turns, args.max_new_tokens)}
    totals = {variant: defaultdict(lambda: defaultdict(float)) for variant in variants}
    per_question = []
    for i, question in enumerate(questions):
        order = variants[i % 3:] + variants[: i % 3]
        results = {variant: run[variant](question["turns"]) for variant in order}
        for turn in range(len(question["turns"])):
            answers = {variant: results[variant][turn]["answer"] for variant in variants}
            if len(set(answers.values())) > 1:
                raise SystemExit(f"question {question['question_id']} turn {turn + 1}: answers differ: {answers}")
            for variant in variants:
                for key in ("prompt_tokens", "reused_prompt_tokens", "new_tokens", "prefill_seconds", "seconds"):
                    totals[variant][turn + 1][key] += results[variant][turn][key]
        per_question.append({"question_id": question["question_id"], "category": question["category"],
                             **{variant: [{k: v for k, v in r.items() if k != "answer"} for r in results[variant]]
                                for variant in variants}})
        print(f"[{i + 1}/{len(questions)}] {question['category']}: turn 2 prompt {results['cache'][1]['prompt_tokens']} "
              f"tokens, {results['cache'][1]['reused_prompt_tokens']} reused; prefill "
              f"{results['cache'][1]['prefill_seconds']:.2f} s vs {results['no_cache'][1]['prefill_seconds']:.2f} s; "
              f"turn {results['cache'][1]['seconds']:.2f} s vs plain with cache {results['plain_cache'][1]['seconds']:.2f} s",
              flush=True)

    summary = {}
    for turn in (1, 2):
        kept, fresh, plain = totals["cache"][turn], totals["no_cache"][turn], totals["plain_cache"][turn]
        summary[f"turn{turn}"] = {
            "prompt_tokens": kept["prompt_tokens"], "reused_prompt_tokens": kept["reused_prompt_tokens"],
            "plain_reused_prompt_tokens": plain["reused_prompt_tokens"], "new_tokens": kept["new_tokens"],
            "prefill_seconds": {"cache": kept["prefill_seconds"], "no_cache": fresh["prefill_seconds"]},
            "seconds": {"cache": kept["seconds"], "no_cache": fresh["seconds"], "plain_cache": plain["seconds"]},
            "prefill_speedup": fresh["prefill_seconds"] / max(kept["prefill_seconds"], 1e-9),
            "turn_speedup": fresh["seconds"] / max(kept["seconds"], 1e-9),
            "speedup_over_plain_with_cache": plain["seconds"] / max(kept["seconds"], 1e-9),
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
