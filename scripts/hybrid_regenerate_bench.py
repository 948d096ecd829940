"""A regenerated answer on a hybrid target, with and without the prompt cache's state checkpoints (timing only:
random weights of a Qwen3.5-0.8B-like shape, scripts/hybrid_chain_bench.py's).

A conversation of `--history` tokens gets an answer, then a second question and its answer (the second call reuses
the first and keeps the states where it started: `PromptCache.checkpoints`), then the second answer is asked for
again: from the cache (only the second question runs before decoding) and from an empty cache (the whole conversation
runs), alternating, outputs checked identical. Prints and writes JSON: seconds and prompt tokens run per regeneration.

    python scripts/hybrid_regenerate_bench.py --history 1024 --question 24 --max-new-tokens 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from hybrid_chain_bench import SHAPES, TINY, TINY_LAYERS
from transformers import AutoConfig, AutoModelForCausalLM

from specheads import SpeculativeLM, create_heads
from specheads.inference.prompt_cache import PromptCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=1024, help="tokens of the conversation's first message")
    parser.add_argument("--question", type=int, default=24, help="tokens of the second question")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = dict(SHAPES["qwen3_5_text"], **(dict(TINY, layer_types=TINY_LAYERS["qwen3_5_text"]) if args.tiny else {}))
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **shape)).eval()
    target.generation_config.eos_token_id = None
    lm = SpeculativeLM(target, create_heads(target, "eagle3"))
    generator = torch.Generator().manual_seed(1)
    history = torch.randint(5, 30000, (1, args.history), generator=generator)
    question = torch.randint(5, 30000, (1, args.question), generator=generator)
    timings: dict[str, list[float]] = {"checkpoint": [], "empty cache": []}
    run_tokens: dict[str, int] = {}
    with torch.no_grad():
        for repeat in range(args.repeats):
            cache = PromptCache()
            first = lm.generate(history, max_new_tokens=args.max_new_tokens, prompt_cache=cache)
            second_prompt = torch.cat([first, question], dim=1)
            second = lm.generate(second_prompt, max_new_tokens=args.max_new_tokens, prompt_cache=cache)
            for name in ("checkpoint", "empty cache") if repeat % 2 == 0 else ("empty cache", "checkpoint"):
                used = cache if name == "checkpoint" else PromptCache()
                start = time.perf_counter()
                again = lm.generate(second_prompt, max_new_tokens=args.max_new_tokens, prompt_cache=used)
                timings[name].append(time.perf_counter() - start)
                if not torch.equal(again, second):
                    raise SystemExit(f"repeat {repeat}: the regenerated answer differs ({name})")
                run_tokens[name] = second_prompt.shape[1] - lm.last_stats["reused_prompt_tokens"]
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                f"{name} {seconds[-1]:.2f} s" for name, seconds in timings.items()), flush=True)
    rows = {name: {"seconds_median": statistics.median(seconds), "prompt_tokens_run": run_tokens[name]}
            for name, seconds in timings.items()}
    for name, row in rows.items():
        print(f"{name}: {row['seconds_median']:.2f} s, {row['prompt_tokens_run']} prompt tokens run")
    print(f"regeneration {rows['empty cache']['seconds_median'] / rows['checkpoint']['seconds_median']:.1f}x faster "
          "from the checkpoint")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"shape": shape, "history": args.history, "question": args.question,
                       "max_new_tokens": args.max_new_tokens, "threads": args.threads, "results": rows,
                       "torch": torch.__version__}, handle, indent=2)


if __name__ == "__main__":
    main()
