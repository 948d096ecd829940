"""`specheads bench`: speculative decoding against plain decoding (and peers), side by side, JSON out.

For every prompt the plain `target.generate` baseline and the speculative run alternate in the same
process, so their ratio survives machine noise. Greedy outputs must be identical: the run stops loudly
if they are not.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from specheads.atomic_files import write_atomically
from specheads.drafting_options import add_drafting_options, drafting_kwargs, drafting_name
from specheads.inference.autotune import autotune_tree, save_tuned_heads
from specheads.inference.certified_argmax import CPU_ARGMAX_CHOICES
from specheads.inference.constraints import IndexConstraint, constraint_from_options
from specheads.inference.corpus_gate import MIN_GAIN
from specheads.inference.corpus_lookup import corpus_from_options
from specheads.inference.fast_path import StaticGreedyDecoder, aligned_length
from specheads.inference.generate import SpeculativeLM
from specheads.inference.generate_inputs import eos_ids
from specheads.inference.gqa_attention import CPU_ATTENTION_CHOICES, GQA_ATTENTION
from specheads.inference.graphed_prefill import pads_prompt
from specheads.inference.int8_linear import DRAFT_LINEAR_CHOICES, Int8Linear
from specheads.inference.json_object import JsonObjectIndex
from specheads.inference.lookup import check_lookup_settings
from specheads.inference.multimodal import image_processor_when_asked
from specheads.inference.onednn import CPU_LINEAR_CHOICES, OneDNNLinear
from specheads.inference.prompts import (
    Prompt,
    add_chat_template_kwargs,
    calibration_prompts,
    follow_up,
    read_prompts,
    tokenize_prompts,
)
from specheads.inference.round_budget import parse_max_round_nodes
from specheads.inference.target_support import unwrapped
from specheads.inference.tree import tree_options

# --graphed-rounds / --graphed-prefill / --fast-path -> graphed_rounds= / graphed_prefill= / fast_path=
SWITCH = {"auto": None, "on": True, "off": False}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specheads bench", description=__doc__)
    p.add_argument("--target", default="stories260K", help="target path, Hub id, alias or peft adapter")
    add_drafting_options(p)  # --heads | --draft-model | --early-exit-layers | --mtp
    p.add_argument("--prompts", required=True, help="MT-bench style JSONL (first turn) or a text file, one prompt a line")
    p.add_argument("--turns", type=int, default=1,
                   help="turns of each multi-turn record to run (MT-bench: 2): turn k+1 is the chat template over the "
                   "earlier turns with plain generate's answers between them, run like any prompt (default: 1)")
    p.add_argument("--category", action="append", help="only these categories (repeatable)")
    p.add_argument("--per-category", type=int, default=None, help="the first N prompts of each category")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default="greedy", help="comma list of greedy,sample")
    p.add_argument("--temperature", type=float, default=None, help="default: the target's generation config")
    p.add_argument("--top-p", type=float, default=None, help="default: the target's generation config")
    p.add_argument("--top-k", type=int, default=None, help="default: the target's generation config (0 disables)")
    p.add_argument("--tree", default=None, help="'auto', a static tree name/path (Medusa), or depth,top_k,nodes[,stop_prob[,min_prob]] (EAGLE)")
    p.add_argument("--save-tree", default=None, metavar="DIR",
                   help="write a copy of --heads to DIR with the tree this run uses (--tree auto: the one it chose) as "
                   "the heads' default, so generate / serve / chat use it without --tree")
    p.add_argument("--lookup-tokens", type=int, default=0,
                   help="graft a prompt-lookup guess of up to N tokens (the context's continuation after its last "
                   "3-gram, down to 2-gram) onto each draft tree (0: off); --tree auto chooses with it on")
    p.add_argument("--lookup-max-tokens", type=int, default=None,
                   help="let the guess double, up to N tokens, while whole guesses are accepted (copied passages take "
                   "fewer rounds); default: --lookup-tokens, a fixed length")
    p.add_argument("--lookup-corpus", default=None, metavar="PATH",
                   help="graft the continuations of the context's longest match in a corpus of the target's answers "
                   "(`specheads data lookup-corpus`; never answers to the prompts benchmarked) onto each draft tree")
    p.add_argument("--corpus-tokens", type=int, default=8, help="the corpus' guessed nodes per round, at most")
    p.add_argument("--corpus-min-gain", type=float, default=MIN_GAIN,
                   help="graft the corpus' guesses only while they earn this many accepted tokens per node, in the "
                   "prompt or after matches of the same length (0: always)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_chat_template_kwargs(p)
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts decoded together: consecutive prompts in left-padded batches of N, plain "
                   "`target.generate` on each batch against batched speculative decoding (one target forward verifies "
                   "every row's tree); greedy rows checked identical (default: 1, one prompt at a time)")
    p.add_argument("--max-round-nodes", type=parse_max_round_nodes, default=None,
                   help="with --batch-size: tree nodes one round verifies at most, all rows together (each row's tree "
                   "shrinks to this // rows nodes, at 1 a plain step; 'auto': chosen each round from measured costs "
                   "and acceptance; default: 'full', every row's full tree)")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                            help="constrain every run (baseline, speculative, peers) to JSON valid under this schema "
                            "(inference/constraints.py; needs specheads[constraints]; '{\"type\": \"object\"}': any "
                            "JSON object, inference/json_object.py, without it)")
    constraint.add_argument("--regex", default=None, help="constrain every run to text matching this regex")
    p.add_argument("--prompt-lookup", type=int, default=10, help="peer: transformers prompt-lookup tokens (0: skip)")
    p.add_argument("--assistant", default=None, help="peer: a draft model for transformers assisted generation (with "
                   "--early-exit-layers N and no --assistant: transformers' assistant_early_exit=N is the peer; with "
                   "--mtp: transformers' generate(use_mtp=True), a chain drafted by the same MTP layer)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="target and heads dtype (default: bfloat16 on CUDA, float32 on CPU). Greedy outputs must be "
                   "identical in float32 (else the run fails); in 16-bit a difference is recorded and warned about")
    p.add_argument("--fast-path", choices=["auto", "on", "off"], default="auto",
                   help="static KV cache + CUDA-graph verification (auto: on for CUDA)")
    p.add_argument("--graphed-rounds", choices=["auto", "on", "off"], default="auto",
                   help="fast path, greedy, EAGLE/EAGLE-3 heads: each round as one CUDA graph (auto: on CUDA; off: "
                   "the per-phase loop, two graphs a round)")
    p.add_argument("--graphed-prefill", choices=["auto", "on", "off"], default="auto",
                   help="fast path: prompts padded to a multiple of 64 tokens, one CUDA graph per padded length, for "
                   "the speculative path and our plain decoding alike (auto: on CUDA, prompts up to 512 tokens; on: "
                   "every prompt; off: eager prompt forwards)")
    p.add_argument("--cpu-linear", choices=CPU_LINEAR_CHOICES, default="auto",
                   help="CPU, float32: 'onednn' runs the target's and heads' linear layers on oneDNN (faster few-row "
                   "products); the plain `generate` baseline then uses them too. 'auto' (default): onednn for a float32 "
                   "CPU target whose linear layers hold >= 1M weights (smaller ones are faster on the default kernels)")
    p.add_argument("--draft-linear", choices=DRAFT_LINEAR_CHOICES, default="auto",
                   help="CPU, float32: 'int8' runs the heads' linear layers in int8 (cheaper drafting; the target stays "
                   "float32, so outputs are unchanged and only acceptance can move). 'auto' (default): int8 for float32 "
                   "CPU heads whose linear layers hold >= 1M weights")
    p.add_argument("--cpu-attention", choices=CPU_ATTENTION_CHOICES, default="auto",
                   help="CPU: 'gqa' hands grouped keys/values to SDPA without copying them in tree forwards (same "
                   "output; plain decoding is unaffected). 'auto' (default): gqa for a CPU target with grouped key/value heads")
    p.add_argument("--cpu-argmax", choices=CPU_ARGMAX_CHOICES, default="auto",
                   help="CPU, float32, greedy: 'bf16' takes the target's argmax in tree verification from a bf16 "
                   "lm_head product whose error is bounded, rescoring in float32 the few tokens the bound cannot "
                   "separate (same output, cheaper lm_head; the baseline is unaffected). 'auto' (default): bf16 for a "
                   "float32 CPU target with a plain linear lm_head, on a CPU with bf16 in hardware")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/results.json", help="JSON results; .md table and PNG plots go beside it")
    return p


def timed(fn) -> tuple[Any, float]:
    """(fn(), seconds), the device synchronised before the clock is read."""
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


CALIBRATION_PROMPTS = 8  # --tree auto: the first prompt of up to 8 categories (MT-bench has 8), then the rest
CALIBRATION_MAX_TOKENS = 128  # ... each answered up to the benchmark's length, at most this many tokens


def _configure_tree(
    lm: SpeculativeLM, tree: str | None, calibration: list[torch.Tensor], max_new_tokens: int
) -> dict[str, Any] | None:
    if tree is None:
        return None
    if tree == "auto":
        # Tuned at the measured length: small trees that stop drafting early win at 128 tokens by ~5%
        # (docs/RESULTS_HISTORY.md, session 14), a gap that shorter or fewer calibration answers could not tell
        # from noise.
        report = autotune_tree(lm, calibration, max_new_tokens=max(1, min(max_new_tokens, CALIBRATION_MAX_TOKENS)),
                               progress=True)
        print(f"[specheads bench] --tree auto chose {report['chosen']}")
        return report
    lm.configure_tree(**tree_options(tree))
    return None


def run_prompt(
    lm: SpeculativeLM, prompt: Prompt, mode: str, args: argparse.Namespace, assistant: Any,
    static_decoder: StaticGreedyDecoder | None = None, constraint: IndexConstraint | None = None,
    outputs: dict[str, torch.Tensor] | None = None, static_first: bool = False,
) -> dict[str, Any]:
    """Baseline, speculative and peer runs of one prompt, alternating in this process.

    With `static_decoder` (CUDA, greedy) our own static-cache CUDA-graph plain decoding is timed too: the
    honest baseline beside `target.generate`, right before the speculative run with `static_first` (the caller
    alternates it from prompt to prompt: on an H200 the speculative rounds, always right after `target.generate`,
    ran 7% slower than in a sweep without it, session 48). With `constraint` every run gets a fresh copy of it as its logits
    processor (our static plain decoding has none: it is skipped); a constraint whose index learns its states as it
    meets them (the JSON-object one) first runs the baseline once untimed, so that no timed run pays for states
    another run learned (the first run would, and a running server has them learned). `outputs` (a dict) receives
    the baseline's sequence as "baseline" (a later turn's history).
    """

    def constrained() -> dict[str, Any]:
        return {} if constraint is None else {"logits_processor": [constraint.fresh()]}

    target, ids = lm.target, prompt.input_ids.to(lm.target.device)
    images = prompt.inputs  # a vision-language target's images: given to every run of this prompt
    sample = mode == "sample"
    gen_kwargs: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, do_sample=sample,
                                      pad_token_id=target.generation_config.pad_token_id or target.generation_config.eos_token_id)
    if sample:
        options = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        gen_kwargs.update({k: v for k, v in options.items() if v is not None})  # unset: the generation config
    if constraint is not None and isinstance(constraint.index, JsonObjectIndex):  # its states learned beforehand
        target.generate(ids, attention_mask=torch.ones_like(ids), **gen_kwargs, **constrained(), **images)
    baseline, base_s = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), **gen_kwargs,
                                                      **constrained(), **images))
    fast_path = SWITCH[getattr(args, "fast_path", "auto")]
    if images and fast_path is True:
        fast_path = None  # the fast path takes text prompts only
    runs = {"spec": lambda: lm.generate(ids, fast_path=fast_path, **constrained(), **images,
                                        **{k: v for k, v in gen_kwargs.items() if k != "pad_token_id"})}
    if static_decoder is not None and not sample and constraint is None and not images:
        runs["static"] = lambda: static_decoder.generate(ids, args.max_new_tokens)
    order = ["static", "spec"] if static_first else ["spec", "static"]
    measured = {name: timed(runs[name]) for name in order if name in runs}
    spec, spec_s = measured["spec"]
    stats = lm.last_stats
    if outputs is not None:
        outputs["baseline"] = baseline
    base_new, spec_new = baseline.shape[1] - ids.shape[1], spec.shape[1] - ids.shape[1]
    row = {
        "prompt_id": prompt.prompt_id, "category": prompt.category, "mode": mode,
        "baseline_tokens": base_new, "baseline_seconds": base_s,
        "tokens": spec_new, "seconds": spec_s, "target_forwards": stats["target_forwards"],
        "rounds": stats["rounds"], "tau": stats["mean_accepted"], "accepted_per_depth": stats["accepted_per_depth"],
        "prefill_seconds": stats["prefill_seconds"], "ms_per_round": stats["ms_per_round"],
        "tokens_per_second": spec_new / spec_s, "baseline_tokens_per_second": base_new / base_s,
    }
    row["speedup"] = row["tokens_per_second"] / row["baseline_tokens_per_second"]
    if "static" in measured:
        static, static_s = measured["static"]
        row["static_baseline_tokens"] = static.shape[1] - ids.shape[1]
        row["static_baseline_seconds"] = static_s
        row["static_baseline_prefill_seconds"] = static_decoder.last_prefill_seconds
        row["static_baseline_tokens_per_second"] = row["static_baseline_tokens"] / static_s
        row["speedup_vs_static"] = row["tokens_per_second"] / row["static_baseline_tokens_per_second"]
        row["static_identical"] = torch.equal(static.cpu(), baseline.cpu())  # bf16 kernels may differ: recorded
    if not sample:
        identical = torch.equal(spec.cpu(), baseline.cpu())
        row["greedy_identical"] = identical
        if not identical:
            n = min(spec.shape[1], baseline.shape[1])
            diff = (spec[0, :n] != baseline[0, :n]).nonzero()
            first = int(diff[0]) - ids.shape[1] if diff.numel() else n - ids.shape[1]
            row["first_difference"] = first
            if target.dtype == torch.float32:
                raise RuntimeError(
                    f"greedy output differs from target.generate on prompt {prompt.prompt_id} at new token {first}: "
                    "speculative decoding must be lossless; please report this bug"
                )
            # bf16/fp16: the tree forward and generate's one-token forward use different kernels (matrix shapes),
            # whose roundings differ, so near-tied argmaxes can flip; recorded and reported, not fatal.
            warnings.warn(
                f"{target.dtype} greedy output differs from target.generate on prompt {prompt.prompt_id} at new token "
                f"{first} (reduced-precision kernels differ by shape; use --dtype float32 for a bit-exact check)",
                stacklevel=1,
            )
    # transformers refuses assisted generation (prompt lookup included) on stateful targets (Qwen3.5, Mamba-2 hybrids)
    assists = not getattr(type(unwrapped(target)), "_is_stateful", False)
    if args.prompt_lookup and not sample and assists:
        out, s = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), **images,
                                                prompt_lookup_num_tokens=args.prompt_lookup, **gen_kwargs, **constrained()))
        row["prompt_lookup_tokens_per_second"] = (out.shape[1] - ids.shape[1]) / s
    # transformers' assisted generation: with --assistant's draft model, else with --early-exit-layers' own layers, or
    # --mtp's MTP layer (a chain of drafts: `use_mtp`)
    early_exit = getattr(args, "early_exit_layers", None)
    assisted = ({"assistant_model": assistant} if assistant is not None
                else {"assistant_early_exit": early_exit} if early_exit is not None
                else {"use_mtp": True} if getattr(args, "mtp", None) else None)
    if assisted is not None and not images and assists:  # (a text draft model cannot read the images)
        out, s = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), **assisted, **gen_kwargs,
                                                **constrained()))
        row["assisted_tokens_per_second"] = (out.shape[1] - ids.shape[1]) / s
    return row


def answer_lengths(new: torch.Tensor, eos: set[int]) -> list[int]:
    """Per row of (B, T) new tokens, how many were generated: up to and including the first EOS (the rest pads)."""
    lengths = []
    for row in new.tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        lengths.append(ends[0] + 1 if ends else len(row))
    return lengths


def run_batch(lm: SpeculativeLM, prompts: list[Prompt], mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plain `target.generate` and batched speculative decoding of one left-padded batch of prompts, alternating.

    Greedy rows must be the target's own: each equal to its row of the plain batch or, where a padded batch's
    rounding tipped a near-tie, to the target's answer to that prompt alone (else the run fails loudly)."""
    target, device = lm.target, lm.target.device
    width = max(p.input_ids.shape[-1] for p in prompts)
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.generation_config.eos_token_id
    pad = int(pad[0] if isinstance(pad, list) else (pad or 0))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        n = prompt.input_ids.shape[-1]
        ids[b, width - n:], mask[b, width - n:] = prompt.input_ids[0].to(device), 1
    sample = mode == "sample"
    options: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, pad_token_id=pad)
    if sample:
        chosen = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        options.update({k: v for k, v in chosen.items() if v is not None})
    baseline, base_s = timed(lambda: target.generate(ids, attention_mask=mask, **options))
    spec, spec_s = timed(lambda: lm.generate(ids, attention_mask=mask, batched=True, **options))
    stats = lm.last_stats
    eos = set(eos_ids(None, target.generation_config))
    base_new = sum(answer_lengths(baseline[:, width:], eos))
    spec_new = sum(answer_lengths(spec[:, width:], eos))
    row = {
        "prompt_id": "+".join(p.prompt_id for p in prompts), "mode": mode, "batch_size": len(prompts),
        "category": prompts[0].category if len({p.category for p in prompts}) == 1 else "mixed",
        "baseline_tokens": base_new, "baseline_seconds": base_s, "tokens": spec_new, "seconds": spec_s,
        "target_forwards": stats["target_forwards"], "rounds": stats["rounds"], "tau": stats["mean_accepted"],
        "accepted_per_depth": stats["accepted_per_depth"], "prefill_seconds": stats["prefill_seconds"],
        "ms_per_round": stats["ms_per_round"], "tokens_per_second": spec_new / spec_s,
        "baseline_tokens_per_second": base_new / base_s,
    }
    row["speedup"] = row["tokens_per_second"] / row["baseline_tokens_per_second"]
    if "rounds_by_nodes_per_row" in stats:  # max_round_nodes "auto": this batch's rounds at each size it chose
        row["rounds_by_nodes_per_row"] = stats["rounds_by_nodes_per_row"]
    if not sample:
        same = [torch.equal(spec[b].cpu(), baseline[b].cpu()) for b in range(len(prompts))]
        for b, prompt in enumerate(prompts):
            if same[b]:
                continue
            alone = target.generate(prompt.input_ids.to(device), max_new_tokens=args.max_new_tokens, do_sample=False,
                                    pad_token_id=pad)[0, prompt.input_ids.shape[-1]:]
            mine = spec[b, width:][: answer_lengths(spec[b:b + 1, width:], eos)[0]]
            if not torch.equal(mine.cpu(), alone.cpu()) and target.dtype == torch.float32:
                raise RuntimeError(
                    f"greedy output of prompt {prompt.prompt_id} in a batch of {len(prompts)} differs from "
                    "target.generate, in the batch and alone: speculative decoding must be lossless; please report this"
                )
        row["greedy_identical"] = True
        row["identical_to_plain_batch"] = sum(same)
    return row


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over rows: tokens/s from summed tokens and seconds, tau from summed tokens and forwards."""
    tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
    base_tokens, base_seconds = sum(r["baseline_tokens"] for r in rows), sum(r["baseline_seconds"] for r in rows)
    depth = max((len(r["accepted_per_depth"]) for r in rows), default=0)
    rounds = sum(r["rounds"] for r in rows) or 1
    per_depth = [sum(r["accepted_per_depth"][d] * r["rounds"] for r in rows if d < len(r["accepted_per_depth"])) / rounds
                 for d in range(depth)]
    result = {
        "prompts": len(rows), "tokens": tokens,
        "tau": tokens / max(sum(r["target_forwards"] for r in rows), 1),
        "tokens_per_second": tokens / seconds, "baseline_tokens_per_second": base_tokens / base_seconds,
        "accepted_per_depth": per_depth,
    }
    result["speedup"] = result["tokens_per_second"] / result["baseline_tokens_per_second"]
    # Where the speculative time went: prompt forwards, then per round (drafting, verification, acceptance).
    prefill = sum(r.get("prefill_seconds", 0.0) for r in rows)
    result["prefill_seconds"] = prefill
    result["ms_per_round"] = 1000 * (seconds - prefill) / rounds
    if rows and all("static_baseline_tokens" in r for r in rows):
        static_tokens = sum(r["static_baseline_tokens"] for r in rows)
        result["static_baseline_tokens_per_second"] = static_tokens / sum(r["static_baseline_seconds"] for r in rows)
        result["speedup_vs_static"] = result["tokens_per_second"] / result["static_baseline_tokens_per_second"]
        result["static_baseline_prefill_seconds"] = sum(r.get("static_baseline_prefill_seconds", 0.0) for r in rows)
        result["static_identical"] = all(r["static_identical"] for r in rows)
    for peer in ("prompt_lookup", "assisted"):
        key = f"{peer}_tokens_per_second"
        if all(key in r for r in rows) and rows:
            # Each peer's time over the same prompts: its tokens are the baseline's (greedy), timed by its runs.
            peer_seconds = sum(r["baseline_tokens"] / r[key] for r in rows)
            result[key] = base_tokens / peer_seconds
            result[f"{peer}_speedup"] = result[key] / result["baseline_tokens_per_second"]
    if rows and "greedy_identical" in rows[0]:
        result["greedy_identical"] = all(r["greedy_identical"] for r in rows)
    return result


def environment(lm: SpeculativeLM) -> dict[str, Any]:
    """Device, dtype, versions, and whether the whole-round CUDA graph was in use (captured)."""
    device, runner = lm.target.device, lm._fast_runner
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "dtype": str(lm.target.dtype).replace("torch.", ""),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "python": platform.python_version(),
        "graphed_rounds": {None: "auto", True: "on", False: "off"}[lm.graphed_rounds],
        "graphed_prefill": {None: "auto", True: "on", False: "off"}[lm.graphed_prefill],
        "cpu_linear": "onednn" if any(isinstance(m, OneDNNLinear) for m in lm.target.modules()) else "default",
        "draft_linear": "int8" if any(isinstance(m, Int8Linear) for m in lm.heads.modules()) else "default",
        "cpu_attention": "gqa" if lm.target.config.get_text_config()._attn_implementation == GQA_ATTENTION else "default",
        "cpu_argmax": "default" if lm.certified_argmax is None else "bf16",
        "round_graph_captured": runner is not None and getattr(runner.greedy_round, "graph", None) is not None,
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    lookup_tokens, lookup_max_tokens = getattr(args, "lookup_tokens", 0), getattr(args, "lookup_max_tokens", None)
    corpus_tokens = getattr(args, "corpus_tokens", 8)
    check_lookup_settings(lookup_tokens, lookup_max_tokens=lookup_max_tokens, corpus_tokens=corpus_tokens)  # before loading any model
    corpus = corpus_from_options(getattr(args, "lookup_corpus", None), 0, getattr(args, "corpus_min_gain", MIN_GAIN))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    if getattr(args, "save_tree", None) and not getattr(args, "heads", None):
        raise ValueError("--save-tree writes a copy of the heads with the chosen tree; a draft model has no heads "
                         "checkpoint: give the chosen tree as --tree instead")
    lm = SpeculativeLM.from_pretrained(target=args.target, **drafting_kwargs(args), device=device, dtype=dtype,
                                       graphed_rounds=SWITCH[getattr(args, "graphed_rounds", "auto")],
                                       graphed_prefill=SWITCH[getattr(args, "graphed_prefill", "auto")],
                                       max_round_nodes=getattr(args, "max_round_nodes", None))
    lm.use_cpu_kernels(getattr(args, "cpu_linear", "default"), getattr(args, "draft_linear", "default"),
                       getattr(args, "cpu_attention", "default"), getattr(args, "cpu_argmax", "default"))
    if lm.max_round_nodes == "auto":  # measured once, before anything is timed (the first batch would pay for it)
        lm.verification_ms_by_tokens()
    rows = read_prompts(args.prompts, args.category, args.limit, getattr(args, "per_category", None))
    template_kwargs = getattr(args, "chat_template_kwargs", None)
    prompts = tokenize_prompts(rows, lm.tokenizer, chat=False if args.no_chat else None,
                               processor=image_processor_when_asked(rows, args.target), template_kwargs=template_kwargs)
    if not prompts:
        raise ValueError(f"no prompts selected from {args.prompts}")
    turns = getattr(args, "turns", 1)
    if turns < 1:
        raise ValueError(f"--turns {turns}: expected at least 1")
    with_images = [p.prompt_id for p in prompts if p.inputs]
    if with_images and (turns > 1 or getattr(args, "batch_size", 1) > 1):
        raise ValueError(f"prompts {with_images[:5]} hold images, which run one prompt at a time and one turn (got "
                         f"--turns {turns}, --batch-size {getattr(args, 'batch_size', 1)})")
    if turns > 1 and (args.no_chat or not getattr(lm.tokenizer, "chat_template", None)):
        raise ValueError(f"--turns {turns} needs the target's chat template (a later turn holds the earlier ones); "
                         f"{'--no-chat was given' if args.no_chat else 'the tokenizer has none'}")
    constraint = constraint_from_options(lm.tokenizer, getattr(args, "json_schema", None), getattr(args, "regex", None))
    assistant = None
    if args.assistant:
        from specheads.targets import load_target

        assistant, _ = load_target(args.assistant, dtype=lm.target.dtype, device=lm.target.device)
    torch.manual_seed(args.seed)
    lm.configure_lookup(lookup_tokens, lookup_max_tokens=lookup_max_tokens, lookup_corpus=corpus,
                        corpus_tokens=corpus_tokens)
    calibration = [p.input_ids for p in calibration_prompts(prompts, CALIBRATION_PROMPTS)]
    tree_report = _configure_tree(lm, args.tree, calibration, args.max_new_tokens)
    if args.save_tree:
        print(f"[specheads bench] heads with this tree as their default: {save_tuned_heads(lm, args.heads, args.save_tree)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(modes) - {"greedy", "sample"}
    if bad:
        raise ValueError(f"--modes {sorted(bad)} unknown; expected greedy and/or sample")
    static_decoder = None
    # our own compiled plain decoding, sized for the longest prompt (its static cache holds attention layers only)
    if lm.target.device.type == "cuda" and not lm.verifies_chains:
        longest = max(p.input_ids.shape[-1] for p in prompts)
        # a later turn also holds the earlier questions and answers (re-tokenized answers: a margin per answer)
        longest += (turns - 1) * (longest + args.max_new_tokens + 64)
        static_decoder = StaticGreedyDecoder(lm.target, aligned_length(longest + args.max_new_tokens),
                                             graphed_prefill=lm.graphed_prefill)
    # Warm-up, not recorded: the longest prompt, so the fast path sizes its static cache and captures once.
    run_prompt(lm, max(prompts, key=lambda p: p.input_ids.shape[-1]), "greedy", args, None, static_decoder, constraint)
    # and one prompt of each padded length the prompt graphs take (`pads_prompt`): every one captured before timing
    on_cuda, lengths = lm.target.device.type == "cuda", [p.input_ids.shape[-1] for p in prompts]
    padded = {aligned_length(n): p for n, p in zip(lengths, prompts)
              if pads_prompt(lm.graphed_prefill, on_cuda, n, aligned_length(n + args.max_new_tokens))}
    for prompt in padded.values():
        lm.generate(prompt.input_ids.to(lm.target.device), max_new_tokens=2,
                    fast_path=SWITCH[getattr(args, "fast_path", "auto")])
        if static_decoder is not None:
            static_decoder.generate(prompt.input_ids.to(lm.target.device), 2)
    rows = []
    batch_size = getattr(args, "batch_size", 1)
    if batch_size > 1:
        if turns > 1 or constraint is not None:
            raise ValueError(f"--batch-size {batch_size} runs first turns without constraints (got --turns {turns}"
                             f"{' and a constraint' if constraint is not None else ''})")
        batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
        for mode in modes:
            for batch in tqdm(batches, desc=f"bench {mode} (batches of {batch_size})", unit="batch"):
                rows.append({**run_batch(lm, batch, mode, args), "turn": 1})
    elif batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: expected at least 1")
    for mode in modes if batch_size == 1 else []:
        for prompt in tqdm(prompts, desc=f"bench {mode}", unit="prompt"):
            answers: list[str] = []
            for turn in range(1, min(turns, len(prompt.turns)) + 1):  # a record with fewer turns runs those it has
                asked = prompt if turn == 1 else follow_up(prompt, answers, lm.tokenizer, template_kwargs)
                outputs: dict[str, torch.Tensor] = {}
                row = run_prompt(lm, asked, mode, args, assistant, static_decoder, constraint, outputs,
                                 static_first=len(rows) % 2 == 1)  # neither right after `generate` every time
                rows.append({**row, "turn": turn, "prompt_tokens": asked.input_ids.shape[-1]})
                new = outputs["baseline"][0, asked.input_ids.shape[-1]:]
                answers.append(lm.tokenizer.decode(new, skip_special_tokens=True))
    results: dict[str, Any] = {
        "target": args.target, "heads": drafting_name(args), "head_type": lm.heads.config.head_type,
        "prompts_file": str(args.prompts), "max_new_tokens": args.max_new_tokens, "turns": turns,
        "batch_size": batch_size, "max_round_nodes": lm.max_round_nodes,
        **({"verification_ms_by_tokens": lm.verification_ms_by_tokens()} if lm.max_round_nodes == "auto" else {}),
        "tree": lm.tree_description(), "environment": environment(lm), "fast_path": getattr(args, "fast_path", "auto"),
        "command": "specheads bench " + " ".join(getattr(args, "argv", [])),
    }
    if template_kwargs:  # how the prompts were rendered: heads trained on another rendering accept less
        results["chat_template_kwargs"] = template_kwargs
    if constraint is not None:
        results["constraint"] = {"json_schema": getattr(args, "json_schema", None), "regex": getattr(args, "regex", None)}
    if tree_report:
        results["tree_autotune"] = tree_report
    for mode in modes:
        mode_rows = [r for r in rows if r["mode"] == mode]
        by_category = defaultdict(list)
        for r in mode_rows:
            by_category[r["category"]].append(r)
        results[mode] = {"overall": aggregate(mode_rows),
                         "by_category": {c: aggregate(rs) for c, rs in sorted(by_category.items())}}
        if turns > 1:
            results[mode]["by_turn"] = {str(t): aggregate([r for r in mode_rows if r["turn"] == t])
                                        for t in sorted({r["turn"] for r in mode_rows})}
    if "greedy" in modes:  # the headline check, also at the top level
        results["greedy_identical"] = results["greedy"]["overall"]["greedy_identical"]
    results["per_prompt"] = rows
    return results


def bench_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.save_tree and args.tree is None:
        parser.error("--save-tree saves the tree given by --tree (auto, or a tree): give --tree too")
    args.argv = argv
    results = run_benchmark(args)
    out = write_atomically(args.out, json.dumps(results, indent=2))
    from specheads.inference.bench_report import write_report

    table = write_report(results, out)
    print(table)
    print(f"[specheads bench] results: {out}")
    return 0
