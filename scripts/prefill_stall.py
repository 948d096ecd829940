"""How long a long prompt joining a running batch stalls the streams already decoding, by `prefill_chunk`.

    python scripts/prefill_stall.py --running 3 --long-tokens 1500 --chunks none,512,256 \
        --out docs/bench/prefill_stall_smollm2.json

`--running` MT-bench first turns decode (`BatchEngine`, greedy, 128 new tokens); after 4 rounds a long prompt joins
(MT-bench questions one after another in one user message, cut to `--long-tokens` tokens, chat template applied).
Reported for each `prefill_chunk` (`none`: the whole prompt in one forward as it joins): the longest wait between
two rounds of the running rows (each `add` and `step` timed: what their streams see), the long request's seconds to
its first token, and the new tokens per second of the whole run. Greedy answers must be the same for every setting,
or else each the target's own answer alone (the run fails if not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from mt_bench_setup import add_model_options, load_lm_and_prompts, write_report  # a sibling module

from specheads.inference.batched import BatchEngine
from specheads.inference.prompts import read_prompts


def long_prompt(lm, prompt_file: str, tokens: int) -> torch.Tensor:
    """(n,) ids: MT-bench questions in one user message, the message cut so the prompt has about `tokens` tokens."""
    text = "\n\n".join(p["text"] for p in read_prompts(prompt_file))
    words = lm.tokenizer(text).input_ids[:tokens]
    message = [{"role": "user", "content": lm.tokenizer.decode(words) + "\n\nWhich of these questions is hardest?"}]
    ids = lm.tokenizer.apply_chat_template(message, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"][0].to(lm.target.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--running", type=int, default=3, help="rows decoding when the long prompt joins")
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--chunks", default="none,512,256")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    chunks = [None if c.strip() == "none" else int(c) for c in args.chunks.split(",")]
    lm, kernels, prompts = load_lm_and_prompts(args)
    running, joining = prompts[: args.running], long_prompt(lm, args.prompt_file, args.long_tokens)
    lm.generate(running[0][None], max_new_tokens=8)  # warm-up
    report = {"command": "python scripts/prefill_stall.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "target": args.target, "heads": args.heads, "tree": lm.tree_description(), "kernels": kernels,
              "threads": args.threads, "running_rows": len(running), "long_prompt_tokens": joining.shape[0],
              "max_new_tokens": args.max_new_tokens, "settings": {}}
    answers = {}
    for chunk in chunks:
        engine = BatchEngine(lm, prefill_chunk=chunk)
        rows = [lm.batch_request(ids[None], max_new_tokens=args.max_new_tokens) for ids in running]
        late = lm.batch_request(joining[None], max_new_tokens=args.max_new_tokens)
        start = time.perf_counter()
        engine.add(rows)
        waits, rounds, joined_at, first_token = [], 0, None, None
        while engine.occupied:
            tick = time.perf_counter()
            if rounds == 4:
                joined_at = tick
                engine.add([late])
            engine.step()
            rounds += 1
            if any(not r.finished for r in rows):  # what a running stream waited for its next tokens
                waits.append(time.perf_counter() - tick)
            if first_token is None and late.new_tokens:
                first_token = time.perf_counter() - joined_at
        seconds = time.perf_counter() - start
        answers[chunk] = [r.new_tokens for r in rows + [late]]
        tokens = sum(len(a) for a in answers[chunk])
        name = "none" if chunk is None else str(chunk)
        report["settings"][name] = {"longest_wait_seconds": max(waits), "median_wait_seconds": sorted(waits)[len(waits) // 2],
                                    "long_prompt_first_token_seconds": first_token, "tokens_per_second": tokens / seconds,
                                    "seconds": seconds}
        print(f"prefill_chunk {name}: longest wait of the running rows {max(waits):.2f} s (median "
              f"{sorted(waits)[len(waits) // 2] * 1000:.0f} ms), long prompt's first token after "
              f"{first_token:.2f} s, {tokens / seconds:.1f} tokens/s", flush=True)
    reference = answers[chunks[0]]
    for chunk, got in answers.items():
        report["settings"]["none" if chunk is None else str(chunk)]["identical_to_first_setting"] = got == reference
        for index, (mine, theirs) in enumerate(zip(got, reference)):
            if mine != theirs:
                ids = (running + [joining])[index]
                alone = lm.target.generate(ids[None], max_new_tokens=args.max_new_tokens, do_sample=False)
                if mine != alone[0, ids.shape[0]:].tolist()[: len(mine)]:
                    raise RuntimeError(f"prefill_chunk {chunk}: row {index}'s greedy answer is not the target's")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
