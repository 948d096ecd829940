"""Concurrent clients: continuous batching (`ServingLoop`) against answering one request at a time.

    python scripts/serve_throughput.py --target smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle3 \
        --clients 4 --prompts 16 --max-new-tokens 128 --threads 2 --out docs/bench/serve_throughput_smollm2.json

`--clients` threads each send MT-bench first turns (chat template applied) one after another, as chat users of a
server do; every side answers the same prompts in the same process, one after the other:
- `one_at_a_time`: `lm.generate` per request under a lock (the server before continuous batching);
- `target_generate`: plain `target.generate` per request under a lock (on the same CPU kernels): no speculation;
- `loop_batch_1`: the serving loop with `max_batch=1` (the batching machinery, one row at a time);
- `loop_batch_N`: the serving loop with `max_batch=clients`: requests join the running batch between rounds;
- `plain_loop_batch_N`: the same loop drafting nothing (each round one plain step of every row): plain continuous
  batching on the same machinery, the honest baseline for concurrent clients;
- with `--device cuda`, `loop_auto_N`: the loop as `serve` runs it there by default (`batching=None`: one request at
  a time on the fast path), against the batching sides above (`batching=True`).
Reported: total new tokens per second over the run, the mean and longest seconds per request (queueing included), and the tau of each side;
greedy answers are checked identical across the sides (the run fails if not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from mt_bench_setup import add_model_options, load_lm_and_prompts  # a sibling module

from specheads import SpeculativeLM
from specheads.inference.round_budget import parse_max_round_nodes
from specheads.inference.serving_loop import ServingLoop
from specheads.inference.tree import TreeBuffers, build_tree_buffers


class PlainDrafter:
    """Drafts nothing: each tree is its root alone, so every round is one plain decoding step of every row. The
    serving loop with it is plain continuous batching on the same machinery: the honest baseline for concurrency."""

    def __init__(self, device: torch.device) -> None:
        self.tree = build_tree_buffers(torch.tensor([-1], device=device))

    def reset(self) -> None:
        pass

    def fork(self) -> PlainDrafter:
        return self

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        return next_tokens[-1:], self.tree


def run_clients(prompts: list[torch.Tensor], clients: int, answer) -> tuple[dict, list[list[int]]]:
    """`clients` threads take the prompts in turn and call `answer(ids) -> (new tokens, tau)`."""
    answers: list[list[int] | None] = [None] * len(prompts)
    latencies, taus = [], []
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            start = time.perf_counter()
            tokens, tau = answer(prompts[index])
            latencies.append(time.perf_counter() - start)
            answers[index] = tokens
            taus.append(tau)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    new_tokens = sum(len(a) for a in answers)
    return {"seconds": seconds, "new_tokens": new_tokens, "tokens_per_second": new_tokens / seconds,
            "mean_request_seconds": statistics.mean(latencies), "max_request_seconds": max(latencies), "mean_tau": statistics.mean(taus)}, answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-round-nodes", type=parse_max_round_nodes, default=None,
                        help="the speculative loops' node budget per round, all rows together (default: full trees)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm, kernels, prompts = load_lm_and_prompts(args, max_round_nodes=args.max_round_nodes)
    for ids in prompts[:2]:  # warm-up: first-call allocations, kernel setup
        lm.generate(ids[None], max_new_tokens=8)

    generate_lock = threading.Lock()

    def one_at_a_time(ids: torch.Tensor) -> tuple[list[int], float]:
        with generate_lock:
            out = lm.generate(ids[None], max_new_tokens=args.max_new_tokens)
            return out[0, ids.shape[0]:].tolist(), lm.last_stats["mean_accepted"]

    def plain_generate(ids: torch.Tensor) -> tuple[list[int], float]:
        with generate_lock:
            out = lm.target.generate(ids[None], max_new_tokens=args.max_new_tokens, do_sample=False)
            return out[0, ids.shape[0]:].tolist(), 1.0

    def through(loop: ServingLoop):
        def answer(ids: torch.Tensor) -> tuple[list[int], float]:
            request = loop.run(loop.lm.batch_request(ids, max_new_tokens=args.max_new_tokens))
            return request.new_tokens, request.mean_accepted
        return answer

    plain = SpeculativeLM(lm.target, lm.heads)  # the same target, its CPU kernels included; no drafting
    plain.drafter, plain.certified_argmax = PlainDrafter(lm.target.device), lm.certified_argmax
    results, reference = {}, None
    sides = [("one_at_a_time", None, lm, None), ("target_generate", None, None, None), ("loop_batch_1", 1, lm, True),
             (f"loop_batch_{args.clients}", args.clients, lm, True),
             (f"plain_loop_batch_{args.clients}", args.clients, plain, True)]
    if lm.target.device.type == "cuda":  # what serve does there by default (on the CPU: loop_batch_N's batching)
        sides.append((f"loop_auto_{args.clients}", args.clients, lm, None))
    for name, max_batch, model, batching in sides:
        loop = None if max_batch is None else ServingLoop(model, max_batch, batching=batching)
        answer = through(loop) if loop is not None else one_at_a_time if model is not None else plain_generate
        results[name], answers = run_clients(prompts, args.clients, answer)
        if loop is not None:
            results[name]["shared_forwards"] = 1 - loop.engine.stats["batched_forwards"] / max(
                loop.engine.stats["target_forwards"], 1)
            loop.close()
        reference = reference or answers
        identical = sum(a == b for a, b in zip(answers, reference))
        results[name]["identical"] = f"{identical}/{len(prompts)}"
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
        if identical != len(prompts):
            print(f"FAILED: {name} answers differ from one_at_a_time's", file=sys.stderr)
            return 1
    base = results["one_at_a_time"]["tokens_per_second"]
    for values in results.values():
        values["throughput_ratio"] = values["tokens_per_second"] / base
    report = {"target": args.target, "heads": args.heads, "tree": args.tree, "max_round_nodes": args.max_round_nodes,
              "clients": args.clients, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "kernels": kernels,
              "torch": torch.__version__, "results": results}
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
