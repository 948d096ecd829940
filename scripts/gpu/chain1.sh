#!/usr/bin/env bash
# GPU run 1 (after a call that carried .gpu/part1): SmolLM2 writes its own answers to ShareGPT prompts, EAGLE heads
# train on them with online features, and a greedy-identity check runs on CUDA. Results -> $OUT.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
date; python3 -c "from specheads.smollm2 import smollm2_folder; print(smollm2_folder())"
date; timeout 200 python3 -m specheads data regenerate --target smollm2-135m-instruct --input .gpu/data/prompts.jsonl \
  --output $W/regen.jsonl --max-new-tokens 256 --batch-size 512 --temperature 0 2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -5
python3 -c "from pathlib import Path; from specheads.training.data_cli import drop_torn_line; drop_torn_line(Path('/tmp/work/regen.jsonl'))"  # a run stopped by timeout may leave a torn last line
cp /tmp/work/regen.jsonl /tmp/work/sharegpt_smollm2.jsonl; echo "training conversations: $(wc -l < /tmp/work/sharegpt_smollm2.jsonl)"
gzip -c $W/sharegpt_smollm2.jsonl > $OUT/sharegpt_smollm2.jsonl.gz
date; timeout 330 python3 -m specheads train configs/train/eagle_smollm2.yaml output_dir=$W/eagle \
  data.source=$W/sharegpt_smollm2.jsonl feature_mode=online data.features_dir=null max_steps=${STEPS:-1500} \
  micro_batch_size=16 save_steps=500 time_limit_minutes=4.3 trackers=[] 2>&1 | tr '\r' '\n' | grep -v "^train eagle:.*it/s" | tail -8
tail -c 400 $W/eagle/metrics.json; cp $W/eagle/metrics.json $OUT/eagle_metrics.json
tar cf - -C $W/eagle final | split -b 15M - $OUT/eagle_heads.tar.
date; timeout 100 python3 scripts/gpu/check_smollm2.py --heads $W/eagle/final --out $OUT/check.json
date
