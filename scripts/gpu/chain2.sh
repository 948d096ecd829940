#!/usr/bin/env bash
# GPU run 2 (after a call that carried .gpu/part1 and .gpu/whl1): EAGLE-3 heads train on the SmolLM2 data of run 1,
# then `specheads bench` on CUDA (bf16, fast path: static cache + CUDA-graph verification) with the EAGLE heads,
# and an fp32 identity/speed check. Results -> $OUT.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
date; python3 -c "from specheads.smollm2 import smollm2_folder; print(smollm2_folder())" 2>&1 | tail -1
gunzip -c .gpu/data2/sharegpt_smollm2.jsonl.gz > $W/sharegpt_smollm2.jsonl
date; timeout 270 python3 -m specheads train configs/train/eagle3_smollm2.yaml output_dir=$W/eagle3 \
  data.source=$W/sharegpt_smollm2.jsonl feature_mode=online data.features_dir=null max_steps=3000 \
  micro_batch_size=16 save_steps=1000 time_limit_minutes=${E3_MINUTES:-2.0} optim.learning_rate=1e-3 trackers=[] 2>&1 \
  | tr '\r' '\n' | grep -v "it/s" | tail -4
cp $W/eagle3/metrics.json $OUT/eagle3_metrics.json; tail -c 700 $W/eagle3/metrics.json
tar cf - -C $W/eagle3 final | split -b 15M - $OUT/eagle3_heads.tar.
date; timeout 100 python3 -m specheads bench --target smollm2-135m-instruct --heads $W/eagle3/final \
  --prompts .gpu/data2/mt_bench_questions.jsonl --limit 8 --max-new-tokens 128 --modes greedy --prompt-lookup 0 \
  --device cuda --out $OUT/bench_gpu_eagle.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -12
date; timeout 60 python3 scripts/gpu/check_smollm2.py --heads $W/eagle3/final --limit 4 --prompts .gpu/data2/mt_bench_questions.jsonl --out $OUT/check_eagle3_fp32.json 2>&1 | tail -1
date
