"""Continuous batching on a device: exactness, and how a round's cost grows with the batch. For a lent GPU.

    python scripts/gpu_batch_check.py --out batch_check.json            # CUDA when available, else the CPU
    python scripts/gpu_batch_check.py --device cpu --rows 1,2 --out x.json   # a dry run here

Sections (each runs even if an earlier one failed; failures are printed and recorded):
  1. identity, stories260K in float32 on the device: rows joining a `BatchEngine` at rounds 0, 2 and 5 (Medusa,
     EAGLE, EAGLE-3 heads, untrained) against `target.generate` of each prompt alone. A difference is a FAILURE.
  2. the same in bfloat16: differences are reported, not failures (batched kernels round differently).
  3. timing, a random Llama of 1B shape (bfloat16 on CUDA, float32 on the CPU): for each batch size B, one round
     of the engine (B rows, untrained EAGLE heads drafting 8-node trees) against one plain decoding step of the
     same B rows (`target` forward of one token each over the same cache length), medians of repeats. Speculation
     keeps its gain with the batch while a round costs less than tau plain steps. Then the verification cost by
     tokens that `--max-round-nodes auto` weighs tree sizes with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from gpu_fast_path_check import run_section  # the sibling script: python puts this folder first on sys.path
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from specheads import SpeculativeLM, create_heads, load_target
from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.batched import BatchEngine
from specheads.inference.kv_cache import crop_cache

PROMPTS = ["Once upon a time", "The little dog", "Lily saw a bird in the sky and", "Tom", "A big red ball was"]
ONE_B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def identity_section(device: str, dtype: torch.dtype, max_new_tokens: int = 48) -> dict[str, Any]:
    target, tokenizer = load_target("stories260K", dtype=dtype, device=device)
    prompts = [tokenizer(p, return_tensors="pt").input_ids.to(target.device) for p in PROMPTS]
    result = {}
    for head_type in ("medusa", "eagle", "eagle3"):
        torch.manual_seed(0)
        lm = SpeculativeLM(target, create_heads(target, head_type).to(device=target.device, dtype=dtype))
        requests = [lm.batch_request(p, max_new_tokens=max_new_tokens) for p in prompts]
        engine, joins, step = BatchEngine(lm), {0: requests[:1], 2: requests[1:3], 5: requests[3:]}, 0
        while engine.rows or step <= max(joins):
            engine.add(joins.get(step, []))
            if engine.rows:
                engine.step()
            step += 1
        differing = []
        for index, (request, ids) in enumerate(zip(requests, prompts)):
            alone = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
            if request.new_tokens != alone:
                differing.append(index)
        result[head_type] = {"identical": not differing, "differing_rows": differing,
                             "shared_forwards": 1 - engine.stats["batched_forwards"] / engine.stats["target_forwards"]}
    return result


def timing_section(device: str, rows: list[int], context: int = 256) -> dict[str, Any]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(LlamaConfig(**ONE_B), dtype=dtype).eval().requires_grad_(False)
    target.generation_config.eos_token_id = None
    heads = create_heads(target, "eagle", tree_depth=4, tree_top_k=4, tree_num_nodes=8).to(device=device, dtype=dtype)
    lm = SpeculativeLM(target, heads)
    out = []
    for batch in rows:
        prompts = [torch.randint(3, ONE_B["vocab_size"], (context,), device=device) for _ in range(batch)]
        engine = BatchEngine(lm)
        engine.add([lm.batch_request(p, max_new_tokens=1024) for p in prompts])
        round_ms = median_ms(engine.step, torch.device(device))
        step_ms = plain_step_ms(target, torch.stack(prompts))
        out.append({"rows": batch, "round_ms": round_ms, "plain_step_ms": step_ms,
                    "round_in_plain_steps": round_ms / step_ms})
        print(f"        rows {batch:>3}: round {round_ms:8.2f} ms, plain step {step_ms:8.2f} ms, "
              f"round = {round_ms / step_ms:.2f} plain steps")
    costs = lm.verification_ms_by_tokens()  # what --max-round-nodes auto weighs tree sizes with on this device
    print("        verification ms by tokens: " + ", ".join(f"{t}: {ms:.2f}" for t, ms in costs.items()))
    return {"rounds": out, "verification_ms_by_tokens": costs}


@torch.no_grad()
def plain_step_ms(target: torch.nn.Module, prompts: torch.Tensor) -> float:
    """One plain decoding step of the (B, n) prompts' rows: a one-token forward each over their n cached positions."""
    cache = DynamicCache()
    target(input_ids=prompts, **cache_kwargs(target, cache), use_cache=True)

    def step() -> None:
        target(input_ids=prompts[:, -1:], **cache_kwargs(target, cache), use_cache=True)
        crop_cache(cache, prompts.shape[1])  # the same length every repeat

    return median_ms(step, prompts.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", default="1,2,4,8,16", help="batch sizes timed (comma list)")
    parser.add_argument("--out", default="batch_check.json")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "environment": {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": sys.version.split()[0]},
        "failures": [],
    }
    fp32 = run_section(report, "identity_stories260K_fp32", lambda: identity_section(args.device, torch.float32))
    if isinstance(fp32, dict) and "error" not in fp32:
        report["failures"] += [f"identity_fp32.{k}" for k, v in fp32.items() if not v["identical"]]
        print(f"        fp32: {json.dumps(fp32)}")
    bf16 = run_section(report, "identity_stories260K_bf16", lambda: identity_section(args.device, torch.bfloat16))
    if isinstance(bf16, dict) and "error" not in bf16:
        print(f"        bf16 (reported, not asserted): {json.dumps(bf16)}")
    run_section(report, "round_vs_rows_1b", lambda: timing_section(args.device, [int(r) for r in args.rows.split(",")]))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"failures: {report['failures'] or 'none'}; results in {args.out}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
