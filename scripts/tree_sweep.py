"""Compare EAGLE draft trees side by side in ONE process: for every prompt, each tree runs right after its own
plain `generate` baseline, the trees in alternating order from prompt to prompt, so machine noise hits all trees
alike (separate `specheads bench` runs drift by 10-15% in absolute speed on a shared 2-core machine). Greedy
outputs are checked identical.

    python scripts/tree_sweep.py --per-category 2 4,4,8 6,6,16 6,6,16,0.05,0.03 5,8,24,0.05,0.05
    python scripts/tree_sweep.py --per-category 5 --lookup-tokens 0,10,16 4,4,8
    python scripts/tree_sweep.py --per-category 3 --lookup-tokens 10 --draft-linear default,int8 4,4,8 5,4,10
    python scripts/tree_sweep.py --per-category 2 --lookup-tokens 10 --draft-linear int8 --cpu-attention default,gqa 4,4,8
    python scripts/tree_sweep.py --per-category 2 --lookup-tokens 10,10:40 --draft-linear int8 4,4,8
    python scripts/tree_sweep.py --per-category 4 --lookup-tokens 10:40 --draft-linear int8 --cpu-argmax default,bf16 4,4,8,0.2,0.03
    python scripts/tree_sweep.py --per-category 4 --lookup-tokens 10:40 --draft-linear int8 --heads OLD,NEW 4,4,8,0.2,0.03

Trees are `depth,top_k,nodes[,stop_prob[,min_prob]]` as for `specheads bench --tree`; with several
`--lookup-tokens` values (a comma list; `N:M` grows the guess from N up to M tokens while whole guesses are
accepted, `lookup_max_tokens`) every tree runs with each (prompt lookup grafted onto it, 0 = off), and
likewise with several `--draft-linear` values (float32 or int8 heads; each its own copy of the heads, one target)
and `--cpu-attention` values (transformers' SDPA or grouped SDPA, switched on the one target before each run) and
`--cpu-argmax` values (greedy verification from the full float32 logits, or the certified bf16 argmax), and
several `--heads` (two versions of a checkpoint, say: each loaded onto the one target).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from specheads.drafting_options import drafting_heads, parse_drafting_source
from specheads.inference.bench import aggregate, run_prompt
from specheads.inference.certified_argmax import CPU_ARGMAX_CHOICES, wants_certified_argmax
from specheads.inference.generate import SpeculativeLM
from specheads.inference.gqa_attention import (
    CPU_ATTENTION_CHOICES,
    use_gqa_attention,
    use_sdpa_attention,
    wants_gqa_attention,
)
from specheads.inference.int8_linear import DRAFT_LINEAR_CHOICES
from specheads.inference.lookup import check_lookup_settings
from specheads.inference.onednn import CPU_LINEAR_CHOICES
from specheads.inference.prompts import read_prompts, tokenize_prompts
from specheads.inference.tree import parse_eagle_tree


def comma_list(value: str, option: str, choices: tuple[str, ...]) -> list[str]:
    """`a,b` -> ['a', 'b'], each one of `choices`."""
    values = value.split(",")
    for choice in values:
        if choice not in choices:
            raise SystemExit(f"{option} {choice!r}: expected a comma list of {choices}")
    return values


def parse_lookup(value: str) -> tuple[int, int | None]:
    """`10` -> (10, None): a fixed guess length; `10:40` -> (10, 40): growing from 10 up to 40 tokens."""
    base, _, most = value.partition(":")
    try:
        lookup = int(base), int(most) if most else None
        check_lookup_settings(lookup[0], lookup_max_tokens=lookup[1])
    except ValueError as err:
        raise SystemExit(f"--lookup-tokens {value!r}: expected N (0 = off) or N:M with M >= N >= 1 ({err})") from None
    return lookup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="depth,top_k,nodes[,stop_prob[,min_prob]]")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3",
                   help="heads folder or Hub id, or a comma list of them (compared side by side on the one target); "
                   "an item 'draft:MODEL' drafts with a draft model, 'early-exit:N' with the target's first N layers")
    p.add_argument("--prompts", default="configs/prompts/mt_bench_questions.jsonl")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu-linear", choices=CPU_LINEAR_CHOICES, default="auto")
    p.add_argument("--cpu-attention", default="auto",
                   help=f"comma list of {CPU_ATTENTION_CHOICES} for the attention of tree forwards, e.g. default,gqa")
    p.add_argument("--lookup-tokens", default="0",
                   help="comma list of prompt-lookup tokens (0 = off; N:M grows from N up to M), e.g. 0,10,10:40")
    p.add_argument("--draft-linear", default="default",
                   help=f"comma list of {DRAFT_LINEAR_CHOICES} for the heads' linear layers, e.g. default,int8")
    p.add_argument("--cpu-argmax", default="default",
                   help=f"comma list of {CPU_ARGMAX_CHOICES} for greedy verification's argmax, e.g. default,bf16")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    draft_linears = comma_list(args.draft_linear, "--draft-linear", DRAFT_LINEAR_CHOICES)
    attentions = comma_list(args.cpu_attention, "--cpu-attention", CPU_ATTENTION_CHOICES)
    argmaxes = comma_list(args.cpu_argmax, "--cpu-argmax", CPU_ARGMAX_CHOICES)
    heads_list = [h for h in args.heads.split(",") if h]
    if not heads_list:
        raise SystemExit(f"--heads {args.heads!r}: expected a heads folder or Hub id, or a comma list of them")
    trees = {}  # bad specs fail before any loading
    for spec, lookup, heads, draft_linear, attention, argmax in itertools.product(
        args.trees, args.lookup_tokens.split(","), heads_list, draft_linears, attentions, argmaxes
    ):
        name = spec if lookup == "0" else f"{spec} +lookup {lookup}"
        name = name if len(heads_list) == 1 else f"{name} (heads {heads})"
        name = name if len(draft_linears) == 1 else f"{name} ({draft_linear} heads)"
        name = name if len(attentions) == 1 else f"{name} ({attention} attention)"
        name = name if len(argmaxes) == 1 else f"{name} ({argmax} argmax)"
        trees[name] = (parse_eagle_tree(spec), parse_lookup(lookup), (heads, draft_linear), attention, argmax)
    torch.set_num_threads(args.threads)
    lm = SpeculativeLM.from_pretrained(args.target, **parse_drafting_source(heads_list[0]))
    # what each --cpu-attention choice means, decided before any switch ('auto' reads the target's attention)
    grouped = {choice: wants_gqa_attention(choice, lm.target) for choice in attentions}
    certified = {choice: wants_certified_argmax(choice, lm.target) for choice in argmaxes}
    # one SpeculativeLM per (heads, draft-linear choice) on the one target, each with its own copy of the heads (the
    # first one's swaps the target's layers to oneDNN; the others find them swapped already)
    lms = {variant: lm if i == 0 else SpeculativeLM(lm.target, drafting_heads(variant[0], lm.target, lm.tokenizer),
                                                    tokenizer=lm.tokenizer)
           for i, variant in enumerate(itertools.product(heads_list, draft_linears))}
    scorer = None  # greedy verification's certified argmax, built before the target's layers go to oneDNN
    if any(certified.values()):
        lm.use_certified_argmax()
        scorer = lm.certified_argmax
    for (_, draft_linear), one in lms.items():
        one.use_cpu_kernels(args.cpu_linear, draft_linear, "default", "default")  # attention and argmax: set before each run
    prompts = tokenize_prompts(read_prompts(args.prompts, per_category=args.per_category), lm.tokenizer)
    for one in lms.values():
        one.generate(prompts[0].input_ids, max_new_tokens=16)  # warm-up
    # each tree's run of a prompt is `specheads bench`'s: the baseline, then speculation, checked identical
    bench_args = argparse.Namespace(max_new_tokens=args.max_new_tokens, prompt_lookup=0)
    rows: dict[str, list[dict]] = {spec: [] for spec in trees}
    for number, prompt in enumerate(prompts, start=1):
        order = list(trees.items()) if number % 2 else list(trees.items())[::-1]  # neither variant always first
        for spec, (tree, lookup, variant, attention, argmax) in order:
            one = lms[variant]
            one.certified_argmax = scorer if certified[argmax] else None
            switch = use_gqa_attention if grouped[attention] else use_sdpa_attention  # same output, other cost
            switch(one.target)
            switch(one.heads)
            one.configure_tree(**tree)
            one.configure_lookup(lookup[0], lookup_max_tokens=lookup[1])
            rows[spec].append(run_prompt(one, prompt, "greedy", bench_args, assistant=None))
        print(f"[tree_sweep] {number}/{len(prompts)} prompts", flush=True)
    results = {spec: aggregate(spec_rows) for spec, spec_rows in rows.items()}
    print("| tree | tau | tokens/s | baseline tokens/s | speedup |\n|---|---|---|---|---|")
    for spec, r in results.items():
        print(f"| {spec} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | {r['baseline_tokens_per_second']:.1f} | "
              f"{r['speedup']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"max_new_tokens": args.max_new_tokens, "trees": results}, f, indent=2)


if __name__ == "__main__":
    main()
