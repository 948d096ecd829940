#!/usr/bin/env bash
# GPU run 5 (after a call that carried .gpu/part1 and .gpu/whl1; carry .gpu/part2 .gpu/whl2 .gpu/data3):
# SmolLM2 answers more ShareGPT prompts (every distinct human turn, `specheads data sharegpt --turns all`, minus
# the 8,555 first turns answered in session 2) for REGEN_SECONDS, appended to those 8,555 answers. The training
# file stays in /tmp/work for the next call (chain6.sh) and comes back gzipped. Results -> $OUT.
# Session 6: DATA=.gpu/data4 TURNS=turns_left.jsonl.gz ANSWERS=sharegpt_smollm2_turns.jsonl.gz (the turns session 5
# left unanswered, appended to its 21,867 answers).
# Next session (sampled second answers, see README "Session 7 plan"): DATA=.gpu/data5 TURNS=prompts.jsonl.gz
# ANSWERS=none TEMPERATURE=0.7 SEED=7 (a fresh answer file, no answers before it).
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
date; python3 -c "from specheads.smollm2 import smollm2_folder; print(smollm2_folder())" 2>&1 | tail -1
DATA=${DATA:-.gpu/data3}
if [ "${ANSWERS:-sharegpt_smollm2.jsonl.gz}" = none ]; then : > $W/regen.jsonl; else
  gunzip -c $DATA/${ANSWERS:-sharegpt_smollm2.jsonl.gz} > $W/regen.jsonl; fi
gunzip -c $DATA/${TURNS:-turns_new.jsonl.gz} > $W/turns_new.jsonl
date; timeout ${REGEN_SECONDS:-360} python3 -m specheads data regenerate --target smollm2-135m-instruct \
  --input $W/turns_new.jsonl --output $W/regen.jsonl --max-new-tokens 256 --batch-size ${BATCH:-512} \
  --temperature ${TEMPERATURE:-0} --seed ${SEED:-0} 2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -3
python3 -c "from pathlib import Path; from specheads.training.data_cli import drop_torn_line; drop_torn_line(Path('/tmp/work/regen.jsonl'))"  # a run stopped by timeout may leave a torn last line
cp /tmp/work/regen.jsonl /tmp/work/train.jsonl; echo "training conversations: $(wc -l < /tmp/work/train.jsonl)"
gzip -c $W/train.jsonl > $OUT/sharegpt_smollm2_turns.jsonl.gz
date
