#!/usr/bin/env bash
# GPU run 4 (after chain3.sh on the same warm machine; carry checkpoints/smollm2-135m-instruct-eagle when it is not
# tracked): `specheads bench` on CUDA (bf16 fast path: static caches, graphed verification and drafting) with the
# committed EAGLE heads and the EAGLE-3 heads of run 3 (3 MT-bench prompts per category), then the EAGLE recipe's
# training throughput with DeepSpeed ZeRO-2 against plain single-GPU training (fp32 both: PRECISION=no; the bf16
# DeepSpeed check is deepspeed_check.sh). Results -> $OUT.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
P=configs/prompts/mt_bench_questions.jsonl
bench() {  # $1 heads, $2 output name
  date; timeout ${BENCH_TIMEOUT:-170} python3 -m specheads bench --target smollm2-135m-instruct --heads $1 --prompts $P \
    --per-category ${PER_CATEGORY:-3} --max-new-tokens 128 --modes greedy --prompt-lookup 0 --device cuda \
    --out $OUT/$2.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -14
}
bench checkpoints/smollm2-135m-instruct-eagle bench_gpu_eagle
[ -d $W/eagle3/final ] && bench $W/eagle3/final bench_gpu_eagle3
train() {  # $1 name, $2... launcher arguments
  local name=$1; shift
  date; timeout 100 accelerate launch --num_processes 1 --num_machines 1 --mixed_precision ${PRECISION:-no} --dynamo_backend no "$@" \
    -m specheads train configs/train/eagle_smollm2.yaml output_dir=$W/$name data.source=$W/sharegpt_smollm2.jsonl \
    feature_mode=online data.features_dir=null micro_batch_size=16 max_steps=${DS_STEPS:-300} save_steps=100000 \
    trackers=[] 2>&1 | tr '\r' '\n' | grep -v "it/s" | tail -4
  cp $W/$name/metrics.json $OUT/${name}_metrics.json 2>/dev/null
  python3 -c "import json; m=json.load(open('$W/$name/metrics.json')); print('$name', m['steps'], 'steps', m['tokens_seen_this_session'], 'tokens', m['training_seconds'], 's', round(m['tokens_seen_this_session']/m['training_seconds']), 'tokens/s')"
}
train plain
train deepspeed_zero2 --config_file configs/accelerate/deepspeed_zero2.yaml
date
