#!/usr/bin/env bash
# GPU run 7 (after chain6.sh on the same warm machine): `specheads bench` on CUDA (bf16 fast path) of the heads of
# run 6 with the checkpoint's tree and with `--tree auto` (which measures SmolLM2's verification cost against the
# tree size on the H100 and prints it). BENCH_ARGS: more bench arguments for both (e.g. --graphed-rounds off).
# Results -> $OUT.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work
P=configs/prompts/mt_bench_questions.jsonl
bench() {  # $1 output name, $2... extra bench arguments
  local name=$1; shift
  date; timeout ${BENCH_TIMEOUT:-200} python3 -m specheads bench --target smollm2-135m-instruct --heads $W/e3/final \
    --prompts $P --per-category ${PER_CATEGORY:-3} --max-new-tokens 128 --modes greedy --prompt-lookup 0 \
    --device cuda --out $OUT/$name.json ${BENCH_ARGS:-} "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -16
}
bench bench_gpu_e3_turns
bench bench_gpu_e3_turns_auto --tree auto
date
