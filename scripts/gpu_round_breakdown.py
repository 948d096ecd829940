"""Where a speculative round's time goes on a GPU, for a target of SmolLM2-135M's shape (random weights).

    python scripts/gpu_round_breakdown.py --out round_breakdown.json

Timing only (random weights: nothing is accepted, but every graph does the same work as with trained heads),
bf16, CUDA events, median of repeats after warm-up. For each tree (depth, top-k, nodes) of EAGLE-3 heads with an
8,192-token draft vocabulary (as the committed SmolLM2 heads):
  - plain: our plain greedy decoding (`StaticGreedyDecoder`): wall ms per token of `generate` (prefill included),
    ms of one replay of its captured 1-token step, kernels of that step;
  - verify_ms: one replay of the tree-verification graph (N = nodes + 1 padded slots);
  - draft_ms: one replay of the drafting graph (commit the path, draft `depth` levels, build the tree);
  - round_ms: one replay of the whole-round graph (verify + accept + compact + draft, graphed_round.py);
  - generate_ms_per_round: `SpeculativeLM.generate` wall time per round with that graph (host work included);
  - kernels: GPU kernels (and memsets / copies) one eager call of each launches: a graph replay of a 135M model
    is launch-bound, so this count, not FLOPs, sets its time;
  - break_even_tau: the acceptance length at which speculation matches plain decoding, generate_ms_per_round /
    plain ms_per_token, and tau_for_2x, twice that.
Needs no SmolLM2 download: `LlamaConfig` of its shape. Runs in about a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from gpu_fast_path_check import build_random_llama, cuda_median_ms, wall_seconds  # this folder: the GPU check
from torch.profiler import ProfilerActivity, profile

from specheads import SpeculativeLM, create_heads
from specheads.inference.fast_path import StaticGreedyDecoder

SMOLLM2_135M = dict(  # SmolLM2-135M-Instruct's config.json
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TREES = [(4, 4, 8), (5, 8, 24), (6, 8, 32), (8, 10, 60)]  # (depth, top-k, nodes): --tree auto's range
PROMPT_TOKENS, NEW_TOKENS = 128, 128


def kernel_count(fn: Callable[[], Any]) -> int:
    """GPU operations (kernels, memsets, copies) that one eager call of `fn` launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


@torch.no_grad()
def plain_section(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Our plain greedy decoding: wall ms per token of `StaticGreedyDecoder.generate` (best of 3), and one replay
    of its captured 1-token step (each replay advances one position: the cache has 64 slots spare for them)."""
    decoder = StaticGreedyDecoder(model, -(-(ids.shape[1] + NEW_TOKENS + 64) // 64) * 64)
    decoder.generate(ids, 8, eos_token_id=[])  # warm-up + capture
    best = min(wall_seconds(lambda: decoder.generate(ids, NEW_TOKENS, eos_token_id=[]))[1] for _ in range(3))
    return {
        "ms_per_token": 1000 * best / NEW_TOKENS,
        "step_ms": cuda_median_ms(decoder.graph.replay) if decoder.graph is not None else None,
        "step_kernels": kernel_count(decoder.step),
    }


@torch.no_grad()
def tree_section(model: torch.nn.Module, ids: torch.Tensor, depth: int, top_k: int, nodes: int) -> dict[str, Any]:
    torch.manual_seed(0)
    heads = create_heads(model, "eagle3", tree_depth=depth, tree_top_k=top_k, tree_num_nodes=nodes,
                         draft_vocab_size=8192)
    lm = SpeculativeLM(model, heads, graphed_rounds=True)
    lm.generate(ids, max_new_tokens=NEW_TOKENS, fast_path=True, eos_token_id=[])  # sizes the cache, captures
    best = float("inf")
    for _ in range(3):
        lm.generate(ids, max_new_tokens=NEW_TOKENS, fast_path=True, eos_token_id=[])
        best = min(best, lm.last_stats["seconds"] / max(lm.last_stats["rounds"], 1))
    runner = lm._fast_runner
    verifier, drafter, whole = runner.verifier(runner.fixed_slots), runner.static_drafter, runner.greedy_round
    if verifier.graph is None:  # the whole-round path never replays the verifier's own graph: capture it here
        verifier.run()
    saved = [t.clone() for t in whole._state()]

    def restore() -> None:  # replaying the round advances the prefix: start every timed replay from one state
        for tensor, value in zip(whole._state(), saved):
            tensor.copy_(value)

    result = {
        "tree": lm.tree_description(),
        "graphs_captured": {"verify": verifier.graph is not None, "draft": drafter.graph is not None,
                            "round": whole.graph is not None},
        "verify_ms": cuda_median_ms(verifier.graph.replay) if verifier.graph is not None else None,
        "draft_ms": cuda_median_ms(drafter.graph.replay) if drafter.graph is not None else None,
        "round_ms": cuda_median_ms(whole.graph.replay, before=restore) if whole.graph is not None else None,
        "generate_ms_per_round": 1000 * best,
    }
    result["kernels"] = {
        "verify": kernel_count(verifier.forward),
        "draft": kernel_count(drafter.draft_round),
        "round": kernel_count(whole.round),
    }
    restore()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="round_breakdown.json")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[PROMPT_TOKENS],
                        help="prompt lengths to time (each gets its own table)")
    parser.add_argument("--trees", nargs="+", default=[",".join(map(str, t)) for t in TREES],
                        help="trees as depth,top_k,nodes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this script times CUDA graphs")
        return 2
    model = build_random_llama(SMOLLM2_135M)
    trees = [tuple(int(x) for x in tree.split(",")) for tree in args.trees]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "shape": SMOLLM2_135M, "new_tokens": NEW_TOKENS, "runs": []}
    for prompt_tokens in args.prompt_tokens:
        ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (1, prompt_tokens), device="cuda")
        run: dict[str, Any] = {"prompt_tokens": prompt_tokens, "plain": plain_section(model, ids), "trees": []}
        plain = run["plain"]["ms_per_token"]
        print(f"prompt {prompt_tokens} tokens, plain greedy (static cache, graphed step): {json.dumps(run['plain'])}")
        for depth, top_k, nodes in trees:
            row = tree_section(model, ids, depth, top_k, nodes)
            row["break_even_tau"] = row["generate_ms_per_round"] / plain
            row["tau_for_2x"] = 2 * row["break_even_tau"]
            run["trees"].append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
        report["runs"].append(run)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
