#!/usr/bin/env bash
# GPU run 6 (after chain5.sh on the same warm machine; carry checkpoints/smollm2-135m-instruct-eagle3 when it is
# not tracked, and .gpu/whl3): the committed EAGLE-3 heads train on, on the larger data of run 5, under DeepSpeed
# ZeRO-2 (one GPU, fp32: bf16 autocast was slower on this model) with `init_heads=`; plain single-GPU training if
# DeepSpeed fails to start. The heads stay in /tmp/work/e3 for chain7.sh and come back as tar parts.
# DEEPSPEED=0: plain single-GPU training only (no .gpu/whl3 needed).
# EXTRA: more overrides, e.g. EXTRA="data.eval_fraction=0.01 eval_steps=500" (held-out scores in metrics.json).
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work
START=$(date +%s)
run() {  # $1 minutes, $2... launcher arguments
  local minutes=$1; shift
  accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no "$@" \
    -m specheads train configs/train/eagle3_smollm2.yaml output_dir=$W/e3 data.source=$W/train.jsonl \
    feature_mode=online data.features_dir=null micro_batch_size=16 init_heads=checkpoints/smollm2-135m-instruct-eagle3 \
    max_steps=${STEPS:-3400} save_steps=500 optim.learning_rate=${LR:-5e-4} optim.warmup_steps=50 \
    time_limit_minutes=$minutes trackers=[] ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "it/s" | tail -6
}
date; [ "${DEEPSPEED:-1}" = 1 ] && run ${MINUTES:-8.4} --config_file configs/accelerate/deepspeed_zero2.yaml
if [ ! -f $W/e3/metrics.json ]; then
  LEFT=$(( ${BUDGET:-560} - ($(date +%s) - START) ))
  echo "DeepSpeed run left no metrics; plain training for the remaining ${LEFT}s"
  [ $LEFT -gt 120 ] && run $(python3 -c "print(round(($LEFT - 60) / 60, 2))")
fi
cp $W/e3/metrics.json $OUT/e3_metrics.json 2>/dev/null; tail -c 1200 $W/e3/metrics.json; echo
tar cf - -C $W/e3 final | split -b 15M - $OUT/e3_heads.tar.
date
