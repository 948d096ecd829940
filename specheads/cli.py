"""The `specheads` command line: demo, train, data, generate, bench."""

from __future__ import annotations

import argparse
import json
import sys


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="speculative generation: streams text, prints tau and tokens/s")
    p.add_argument("--target", default="stories260K", help="target path, Hub id or alias (default: stories260K)")
    p.add_argument("--heads", required=True, help="heads checkpoint folder or Hub id")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    p.add_argument("--seed", type=int, default=0)


def run_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from specheads.inference.generate import SpeculativeLM

    torch.manual_seed(args.seed)
    lm = SpeculativeLM.from_pretrained(target=args.target, heads=args.heads)
    tokenizer = lm.tokenizer
    if args.chat:
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    streamer = TextStreamer(tokenizer, skip_prompt=False)
    lm.generate(
        input_ids,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        streamer=streamer,
    )
    stats = lm.last_stats
    print(
        f"\n[specheads] {stats['new_tokens']} tokens, tau={stats['mean_accepted']:.2f}, "
        f"{stats['tokens_per_second']:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specheads", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="main job on the embedded target: data -> train -> benchmark")
    demo.add_argument("--out", default="demo_out", help="output folder (heads/ and results.json)")
    demo.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")

    train = sub.add_parser("train", help="train heads: specheads train CONFIG.yaml [key=value ...]")
    train.add_argument("config", help="run config YAML (see configs/train/)")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=100")

    # These subcommands parse their own arguments (their modules own the options).
    sub.add_parser("data", help="data tools: regenerate responses, dump target features", add_help=False)

    _add_generate(sub)

    sub.add_parser("bench", help="benchmark speculative vs plain decoding (JSON out)", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("data", "bench"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from specheads.training.demo import run_demo

        results = run_demo(args.out, quick=args.quick)
        print(json.dumps(results, indent=2))
        return 0
    if args.command == "train":
        from specheads.training.train import train_from_config_file

        train_from_config_file(args.config, args.overrides)
        return 0
    if args.command == "data":
        from specheads.training.data_cli import data_main

        return data_main(rest)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "bench":
        from specheads.inference.bench import bench_main

        return bench_main(rest)
    parser.error(f"unknown command {args.command}")
    return 2
