#!/usr/bin/env bash
# DeepSpeed ZeRO-2 in bf16 on one GPU with the stories260K recipes (no GGUF needed; carry .gpu/whl1 .gpu/whl3):
# every head type trains a few steps under `accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml
# --mixed_precision bf16`, then the same steps without DeepSpeed (fp32). Results -> $OUT.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
date; timeout 60 python3 -m specheads data regenerate --target stories260K --stories 512 --output $W/stories.jsonl \
  --device cuda 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -2
for head in ${HEADS:-eagle eagle3 medusa}; do
  for mode in deepspeed_bf16 plain_fp32; do
    args="--mixed_precision no"
    [ $mode = deepspeed_bf16 ] && args="--config_file configs/accelerate/deepspeed_zero2.yaml --mixed_precision bf16"
    timeout 120 accelerate launch $args --num_processes 1 --num_machines 1 --dynamo_backend no -m specheads train \
      configs/train/${head}_stories260k.yaml output_dir=$W/${head}_$mode data.source=$W/stories.jsonl \
      max_steps=${STEPS:-60} save_steps=100000 trackers=[] > $OUT/${head}_$mode.log 2>&1
    echo "$head $mode rc=$?"; tr '\r' '\n' < $OUT/${head}_$mode.log | grep -i "error" | tail -3
    python3 -c "import json; m=json.load(open('$W/${head}_$mode/metrics.json')); print('   ', {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items() if k in ('loss', 'acc_depth1', 'sim_tau', 'steps', 'training_seconds', 'tokens_seen_this_session')})" 2>&1 | tail -1
  done
done
date
