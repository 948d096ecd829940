"""Chain verification on a hybrid target of a real model's shape: what the engine makes of drafts that are right a
given fraction of the time, side by side with plain `generate` (timing only: random weights, so no trained heads
exist for it; an oracle that knows the greedy answer drafts each round's chain and gets each token right with
probability `--accept`, so everything after its first wrong token is rejected).

For every prompt the plain greedy baseline runs first (its output is the oracle's answer key), then each
`--max-pending` and `--cut-depth` setting (inference/chain_verify.py: pending tokens before a round verifies only its
first `cut-depth` drafts) in alternating order,
so machine noise hits all alike; outputs are checked identical. Prints and writes JSON: tokens/s ratios, tau.

    python scripts/hybrid_chain_bench.py --family lfm2 --accept 0.7 --depth 4 --max-pending 1,4,8,16,32
    python scripts/hybrid_chain_bench.py --family lfm2 --accept 0.6,0.8 --depth 3,5 --max-pending 16 --cut-depth 0,1,2
    python scripts/hybrid_chain_bench.py --family qwen3_5_text --accept 0.6,0.8 --depth 3,5 --cpu-linear onednn
    python scripts/hybrid_chain_bench.py --family qwen3_5_text --device cuda --dtype bfloat16   # a lent GPU

The shapes: LFM2-350M (hidden 1024, 16 layers: 10 short-convolution, 6 attention, vocabulary 65,536) and a
Qwen3.5-0.8B-like text model (hidden 1024, 24 layers: Gated DeltaNet and attention 3 : 1; vocabulary cut to 65,536
so the lm_head weighs as LFM2's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specheads import SpeculativeLM, create_heads
from specheads.inference import chain_verify
from specheads.inference.autotune import verification_cost_ms
from specheads.inference.chain_verify import ChainVerifier
from specheads.inference.tree import TreeBuffers, build_tree_buffers

SHAPES = {
    "lfm2": dict(hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=65536,
                 layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                              "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                              "full_attention", "conv"]),
    "qwen3_5_text": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, linear_num_value_heads=16, linear_num_key_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=65536,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6),
}

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, vocab_size=30000)
TINY_LAYERS = {"lfm2": ["conv", "full_attention"], "qwen3_5_text": ["linear_attention", "full_attention"]}


class ChainOracle:
    """Drafts the next `depth` tokens of the known greedy answer, each right with probability `accept` (seeded)."""

    def __init__(self, answer: list[int], depth: int, accept: float, seed: int = 0, vocab_size: int = 65536) -> None:
        self.answer, self.depth, self.accept, self.seed, self.vocab_size = answer, depth, accept, seed, vocab_size
        self.buffers = None  # built on the features' device at the first call

    def reset(self) -> None:
        self.rng, self.committed = random.Random(self.seed), 0

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        if self.buffers is None:
            self.buffers = build_tree_buffers(torch.arange(-1, self.depth, device=features.device))
        self.committed += next_tokens.shape[0]
        root = self.committed
        chain = [self.answer[root]]
        for d in range(1, self.depth + 1):
            true = self.answer[root + d] if root + d < len(self.answer) else 0
            chain.append(true if self.rng.random() < self.accept else (true + 1) % self.vocab_size)
        return torch.tensor(chain, device=features.device), self.buffers


def rows_cost_ms(lm: SpeculativeLM, prompt: torch.Tensor, depth: int = 5, repeats: int = 5) -> dict[int, float]:
    """Median ms of a verification whose tree is 1-4 paths of `depth` drafts from one root (rows of one forward, each
    on its own copy of the cache), undone after each run."""
    verifier = ChainVerifier(lm.target, lm.heads.select_features)
    verifier.prefill(prompt, 0)
    costs = {}
    for rows in (1, 2, 3, 4):
        parents = [-1] + [0 if d == 0 else 1 + r * depth + d - 1 for r in range(rows) for d in range(depth)]
        tree = build_tree_buffers(torch.tensor(parents, device=prompt.device))
        tokens = prompt[-1:].repeat(len(parents))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            verifier.verify(tokens, tree, prompt.shape[0])
            verifier.undo()
            if prompt.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        costs[rows] = statistics.median(times[1:]) * 1000
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(SHAPES), default="lfm2")
    parser.add_argument("--accept", default="0.7", help="comma list: each drafted token's chance to be right")
    parser.add_argument("--depth", default="4", help="comma list: drafted tokens per chain")
    parser.add_argument("--max-pending", default="16", help="comma list of chain_verify.MAX_PENDING values")
    parser.add_argument("--cut-depth", default="1", help="comma list of chain_verify.CUT_DEPTH values")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-linear", choices=["default", "onednn"], default="default")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a lent GPU; the verification's own eager path)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model of the family (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = dict(SHAPES[args.family], **(dict(TINY, layer_types=TINY_LAYERS[args.family]) if args.tiny else {}))
    config = AutoConfig.for_model(args.family, **shape)
    target = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    target.generation_config.eos_token_id = None  # every answer runs its full length
    lm = SpeculativeLM(target, create_heads(target, "eagle3"))
    if args.cpu_linear == "onednn":
        lm.use_onednn_linears()  # the target's linear layers, which plain `generate` runs too
    settings = list(itertools.product([float(a) for a in args.accept.split(",")],
                                      [int(d) for d in args.depth.split(",")],
                                      [int(p) for p in args.max_pending.split(",")],
                                      [int(c) for c in args.cut_depth.split(",")]))
    generator = torch.Generator().manual_seed(1)
    # what a verification forward costs by tokens fed (pending + chain), after a prompt
    cost_ms = verification_cost_ms(
        lm, torch.randint(5, 30000, (1, args.prompt_tokens), generator=generator).to(args.device),
        [1, 2, 4, 6, 8, 12, 16, 24], repeats=5)
    print("verification ms by tokens: " + ", ".join(f"{n}: {ms:.0f}" for n, ms in cost_ms.items()), flush=True)
    rows_ms = rows_cost_ms(lm, torch.randint(5, 30000, (args.prompt_tokens,), generator=generator).to(args.device))
    print("verification ms by rows (paths of 5 drafts): " + ", ".join(f"{n}: {ms:.0f}" for n, ms in rows_ms.items()),
          flush=True)
    results = {setting: {"ratios": [], "taus": []} for setting in settings}
    baseline_tps, differing = [], 0
    with torch.no_grad():
        target.generate(torch.randint(5, 30000, (1, 8)).to(args.device), max_new_tokens=4, do_sample=False)  # warm-up
        for index in range(args.prompts):
            ids = torch.randint(5, 30000, (1, args.prompt_tokens), generator=generator).to(args.device)
            start = time.perf_counter()
            reference = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            plain_tps = args.max_new_tokens / (time.perf_counter() - start)
            baseline_tps.append(plain_tps)
            answer = reference[0].tolist()
            order = settings if index % 2 == 0 else settings[::-1]
            for accept, depth, max_pending, cut_depth in order:
                chain_verify.MAX_PENDING, chain_verify.CUT_DEPTH = max_pending, cut_depth
                lm.use_drafter(ChainOracle(answer, depth, accept, seed=index))
                out = lm.generate(ids, max_new_tokens=args.max_new_tokens)
                if not torch.equal(out, reference):
                    if args.dtype == "float32":
                        raise SystemExit(f"prompt {index}: output differs from plain generate ({accept}, {depth}, "
                                         f"{max_pending}, {cut_depth})")
                    differing += 1  # bf16 kernels round by shape: near-tied argmaxes may flip (reported)
                stats = lm.last_stats
                results[(accept, depth, max_pending, cut_depth)]["ratios"].append(stats["tokens_per_second"] / plain_tps)
                results[(accept, depth, max_pending, cut_depth)]["taus"].append(stats["mean_accepted"])
            print(f"prompt {index + 1}/{args.prompts}: plain {plain_tps:.1f} tokens/s", flush=True)
    rows = []
    for (accept, depth, max_pending, cut_depth), result in results.items():
        rows.append({"accept": accept, "depth": depth, "max_pending": max_pending, "cut_depth": cut_depth,
                     "speedup_median": statistics.median(result["ratios"]), "tau": statistics.mean(result["taus"])})
        print(f"accept {accept:.2f} depth {depth} max_pending {max_pending:>5} cut_depth {cut_depth}: "
              f"tau {rows[-1]['tau']:.2f}, "
              f"{rows[-1]['speedup_median']:.2f}x plain generate")
    report = {"family": args.family, "shape": shape, "threads": args.threads, "device": args.device,
              "dtype": args.dtype,
              "cpu_linear": args.cpu_linear, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "plain_tokens_per_second_median": statistics.median(baseline_tps), "settings": rows,
              "verification_ms_by_tokens": cost_ms, "verification_ms_by_rows": rows_ms,
              "runs_differing_from_generate": differing,
              "torch": torch.__version__}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
