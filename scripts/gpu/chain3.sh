#!/usr/bin/env bash
# GPU run 3 (after a call that carried .gpu/part1 and .gpu/whl1; carry .gpu/part2 .gpu/whl2 .gpu/whl3 .gpu/data2):
# EAGLE-3 heads for SmolLM2 at the EAGLE recipe's budget (3000 steps x 16 sequences, fp32, online features),
# kept in /tmp/work/eagle3 for the next call and returned as tar parts. Results -> $OUT.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
date; python3 -c "from specheads.smollm2 import smollm2_folder; print(smollm2_folder())" 2>&1 | tail -1
gunzip -c .gpu/data2/sharegpt_smollm2.jsonl.gz > $W/sharegpt_smollm2.jsonl
date; timeout 520 python3 -m specheads train configs/train/eagle3_smollm2.yaml output_dir=$W/eagle3 \
  data.source=$W/sharegpt_smollm2.jsonl feature_mode=online data.features_dir=null micro_batch_size=16 \
  save_steps=1000 time_limit_minutes=${E3_MINUTES:-7.6} trackers=[] 2>&1 | tr '\r' '\n' | grep -v "it/s" | tail -6
cp $W/eagle3/metrics.json $OUT/eagle3_metrics.json; tail -c 900 $W/eagle3/metrics.json; echo
tar cf - -C $W/eagle3 final | split -b 15M - $OUT/eagle3_heads.tar.
date
