#!/usr/bin/env bash
# GPU run 8 (after a call that carried .gpu/part1 and .gpu/whl1; carry .gpu/part2 .gpu/whl2 and, when checkpoints/ is
# untracked for the calls, checkpoints/smollm2-135m-instruct-eagle3): is the padded, graphed prompt forward
# (`--graphed-prefill on`, inference/fast_path.py GraphedPrefill) worth making the default on CUDA? The fast-path
# self-check (it checks GraphedPrefill's identity in fp32), then the SmolLM2 MT-bench bench with it off and on, one
# after the other on this warm machine (compare prefill_seconds, static_baseline_prefill_seconds, ms_per_round and
# speedup_vs_static in the two JSON files). PER_CATEGORY (default 2), BENCH_TIMEOUT (default 200 s each).
set -u -o pipefail
source scripts/gpu/setup.sh
python3 scripts/gpu_fast_path_check.py --out $OUT/gpu_check.json 2>&1 | tail -30
for prefill in off on; do
  date; timeout ${BENCH_TIMEOUT:-200} python3 -m specheads bench --target smollm2-135m-instruct \
    --heads checkpoints/smollm2-135m-instruct-eagle3 --prompts configs/prompts/mt_bench_questions.jsonl \
    --per-category ${PER_CATEGORY:-2} --max-new-tokens 128 --modes greedy --prompt-lookup 0 --device cuda \
    --graphed-prefill $prefill --out $OUT/bench_prefill_$prefill.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -14
done
date
