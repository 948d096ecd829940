"""`specheads eval`: score trained heads on held-out text with the training metrics (no timing, no tree).

    specheads eval --target smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle3 \\
        --prompts configs/prompts/mt_bench_questions.jsonl --max-new-tokens 128 --limit 16

With `--prompts`, the target first answers each prompt greedily (chat template applied), and the heads are scored
on those answers: what greedy speculative decoding of those prompts will accept, minutes faster than a benchmark.
With `--data`, conversations (the training formats) are scored as they are: e.g. a held-out file of the target's
own answers. Per-depth top-1 accuracy (the head's argmax equals the target's), simulated tau, loss, and the share of
answer tokens inside the draft vocabulary (EAGLE-3).

`--heads A,B,...` scores several heads (of one target) on the same rows, answered once: the output is then a JSON
list of reports in that order, and a table of the main figures goes to stderr. Draft models score beside heads as
`draft:MODEL` or `early-exit:N` items (their tokenizer the target's): `acc_depth1` (their argmax is the target's),
`accept` (sum min(p, q): a sampled draft accepted at temperature 1) and `sim_tau` over chains of `--ttt-steps` drafts
(default 4), the metrics a distillation run logs (training/distill_loss.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from tqdm.auto import tqdm

from specheads.atomic_files import write_atomically
from specheads.inference.prompts import add_chat_template_kwargs
from specheads.training.config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specheads eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="stories260K", help="target path, Hub id, alias or peft adapter (default: stories260K)")
    p.add_argument("--heads", required=True,
                   help="heads checkpoint folder or Hub id, or a draft model as draft:MODEL or early-exit:N; a comma "
                   "list scores each on the same rows")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="conversations in the training formats (JSON/JSONL/Parquet, a dataset folder, or a Hub dataset id[:split])")
    source.add_argument("--prompts", help="prompts (MT-bench JSONL or text lines): the target answers them first")
    p.add_argument("--max-new-tokens", type=int, default=128, help="--prompts: length of the target's greedy answers")
    p.add_argument("--category", action="append", default=None, help="--prompts: only these categories (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="score the first N examples / prompts only")
    p.add_argument("--max-length", type=int, default=768, help="--data: tokens per example (longer ones are cut)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ttt-steps", type=int, default=None, help="EAGLE-3 and draft models: depths scored (default: the "
                   "training default; 4 for draft models)")
    p.add_argument("--temperature", type=float, default=1.0, help="draft models: the temperature `accept` (sum "
                   "min(p, q)) is measured at, both distributions tempered (the one you will sample at)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default=None, help="cpu or cuda (default: where load_target puts the target)")
    p.add_argument("--out", default=None, help="also write the metrics as JSON here")
    p.add_argument("--image-folder", default=None, help="--data on a vision-language target: where records' relative "
                   "image paths are read from (default: the data file's folder)")
    add_chat_template_kwargs(p)
    return p


def answer_prompts(target: Any, tokenizer: Any, path: str, args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """The target's greedy answers to the prompts, as rows {input_ids, loss_mask} scored on the answer only."""
    from specheads.inference.prompts import read_prompts, tokenize_prompts

    prompts = tokenize_prompts(read_prompts(path, categories=args.category, limit=args.limit), tokenizer,
                               template_kwargs=args.chat_template_kwargs)
    rows = []
    for prompt in tqdm(prompts, desc="target answers", unit="prompt"):
        ids = prompt.input_ids.to(target.device)
        # not cut to --max-length: the heads are scored on the whole answer in the context the target answered in
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                              do_sample=False)[0].tolist()
        n = ids.shape[1]
        rows.append({"input_ids": out, "loss_mask": [0] * n + [1] * (len(out) - n)})
    return rows


def score_heads(
    heads: Any, target: Any, rows: Any, pad_id: int, args: argparse.Namespace, processor: Any = None
) -> dict[str, float]:
    """The training loss's metrics of `heads` on `rows` (eval mode, no input noise), floats rounded to 4 places; rows
    with images (a vision-language target's data) are read with the target's `processor`."""
    from specheads.heads.draft_model import DraftModelHeads
    from specheads.training.distill_loss import distill_loss
    from specheads.training.evaluate import evaluate
    from specheads.training.image_records import collate_for
    from specheads.training.train import compute_loss

    config = RunConfig(target=args.target)
    if isinstance(heads, DraftModelHeads):  # scored as distillation scores it: the two next-token distributions
        if heads.vocab_mapping is not None:
            raise ValueError(f"eval scores draft models of the target's tokenizer; {heads.config.draft_model_name_or_path} "
                             "has another one (benchmark it instead: specheads bench --draft-model)")
        if args.ttt_steps is not None:
            config.loss.eval_depth = args.ttt_steps
        config.distill.temperature = args.temperature
        draft = heads.draft_model
        metrics = evaluate(lambda batch: distill_loss(draft, draft, target, batch, config.distill, config.loss),
                           rows, lambda batch_rows: collate_for(rows, processor)(batch_rows, pad_id), args.batch_size,
                           target.device)
        metrics["acc_depth1"] = metrics["acc"]
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
    config.head.type = heads.config.head_type
    config.loss.input_noise = 0.0
    config.loss.dflash_blocks = 0  # DFlash: a block at every position that predicts answer tokens
    if args.ttt_steps is not None:
        config.loss.ttt_steps = args.ttt_steps
    metrics = evaluate(
        lambda batch: compute_loss(config, heads, heads, target, batch, []),
        rows, lambda batch_rows: collate_for(rows, processor)(batch_rows, pad_id), args.batch_size, target.device,
    )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}


def comparison_table(reports: list[dict[str, Any]]) -> str:
    """A markdown table of each report's depth-1 accuracy, simulated tau and draft-vocabulary coverage."""
    lines = ["| heads | depth-1 accuracy | simulated tau | draft-vocab coverage |", "|---|---|---|---|"]
    for r in reports:
        coverage = r.get("draft_vocab_coverage")
        lines.append(f"| {r['heads']} | {r.get('acc_depth1', float('nan')):.4f} | {r.get('sim_tau', float('nan')):.3f} | "
                     f"{'-' if coverage is None else f'{coverage:.3f}'} |")
    return "\n".join(lines)


def eval_main(argv: list[str] | None = None) -> int:
    """Entry point of `specheads eval`: prints (and with --out writes) the held-out metrics as JSON."""
    from specheads import load_target
    from specheads.drafting_options import drafting_heads
    from specheads.inference.multimodal import image_processor_for, takes_images
    from specheads.training.data import build_dataset

    args = build_parser().parse_args(argv)
    for name in ("max_new_tokens", "max_length", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}; expected a positive integer")
    if not args.temperature > 0:
        raise ValueError(f"--temperature={args.temperature}; expected a temperature > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    heads_list = [name.strip() for name in args.heads.split(",")]
    if not all(heads_list):
        raise ValueError(f"--heads {args.heads!r}: an empty name in the comma list; expected folders or Hub ids")
    target, tokenizer = load_target(args.target, device=args.device)
    # all loaded (and checked against the target) before the minutes the target's answers may take
    heads_models = [drafting_heads(name, target, tokenizer) for name in heads_list]
    processor = None
    if args.prompts:
        rows: Any = answer_prompts(target, tokenizer, args.prompts, args)
    else:
        processor = image_processor_for(args.target) if takes_images(target) else None  # records' images read
        rows = build_dataset(args.data, tokenizer, "auto", args.max_length, processor=processor,
                             image_folder=args.image_folder, chat_template_kwargs=args.chat_template_kwargs)
        if args.limit:
            rows = rows.select(range(min(args.limit, len(rows))))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reports = [
        {"heads": name, "target": str(args.target), "source": args.prompts or args.data, "examples": len(rows),
         **score_heads(heads, target, rows, pad_id, args, processor)}
        for name, heads in zip(heads_list, heads_models, strict=True)
    ]
    result: Any = reports[0] if len(reports) == 1 else reports
    print(json.dumps(result, indent=2))
    if len(reports) > 1:
        print(comparison_table(reports), file=sys.stderr)
    if args.out:
        write_atomically(args.out, json.dumps(result, indent=2))
    return 0
