"""What the SmolLM2 scripts share: the model and tree options, the `SpeculativeLM` they build, MT-bench first turns.

    parser = argparse.ArgumentParser(); add_model_options(parser); args = parser.parse_args()
    lm, kernels, prompts = load_lm_and_prompts(args)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from specheads import SpeculativeLM
from specheads.inference.prompts import read_prompts, tokenize_prompts
from specheads.inference.tree import parse_eagle_tree


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Target, heads, prompts, threads, tree and prompt-lookup options (defaults: SmolLM2 as `make bench` runs it)."""
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3")
    parser.add_argument("--prompt-file", default="configs/prompts/mt_bench_questions.jsonl")
    parser.add_argument("--prompts", type=int, default=16, help="MT-bench first turns used (2 per category for 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--tree", default="4,4,8,0.2,0.03",
                        help="EAGLE tree: depth,top_k,nodes[,stop_prob,min_prob] (default: what `bench --tree auto` "
                             "chose for SmolLM2 on 2 threads)")
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--lookup-max-tokens", type=int, default=40)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a lent GPU: bf16 and the fast path; give "
                        "--tree 5,8,24 --lookup-tokens 0 there, the trees its CUDA graphs take)")


def load_lm_and_prompts(args: argparse.Namespace, **lm_options: Any) -> tuple[SpeculativeLM, dict[str, str],
                                                                                 list[torch.Tensor]]:
    """(the SpeculativeLM on its default CPU kernels, the kernels, the (n,) prompt ids on its device), threads set."""
    torch.set_num_threads(args.threads)
    lm = SpeculativeLM.from_pretrained(target=args.target, heads=args.heads, lookup_tokens=args.lookup_tokens,
                                      lookup_max_tokens=args.lookup_max_tokens or None,
                                      device=getattr(args, "device", "cpu"), **lm_options)
    lm.configure_tree(**parse_eagle_tree(args.tree))
    kernels = lm.use_cpu_kernels()
    rows = read_prompts(args.prompt_file, per_category=max(args.prompts // 8, 1), limit=args.prompts)
    prompts = [p.input_ids[0].to(lm.target.device) for p in tokenize_prompts(rows, lm.tokenizer)]
    return lm, kernels, prompts


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    """Write the JSON report to `path` (its folder made), if one was given."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
