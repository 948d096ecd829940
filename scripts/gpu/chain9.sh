#!/usr/bin/env bash
# GPU run 9 (after a call that carried .gpu/part1 and .gpu/whl1; carry .gpu/part2 .gpu/whl2 .gpu/data):
# SmolLM2 writes new user prompts (Magpie: `specheads data synth-prompts`) for SYNTH_SECONDS, then answers them
# greedily (`regenerate`) for REGEN_SECONDS. /tmp/work/train.jsonl (for chain6.sh in the next call) = those answers
# + OLD answers drawn at random from $DATA/$ANSWERS (earlier data, so the heads do not drift to the new kind alone).
# Prompts and answers come back gzipped through $OUT.
# OPENINGS=FILE (one opening a line, e.g. configs/prompts/synth_openings.txt): the new prompts start with those
# openings (`synth-prompts --opening`), which steers them to kinds of task the unsteered ones lack.
# PREVIOUS=DIR (a folder holding an earlier run's synth_prompts.jsonl.gz and synth_answers.jsonl.gz): both runs go on
# from those files (new prompts only, none repeating an earlier one; earlier answers kept), so COUNT counts them too.
set -u -o pipefail
source scripts/gpu/setup.sh
W=/tmp/work; mkdir -p $W
if [ -n "${PREVIOUS:-}" ] && [ ! -f $W/synth.jsonl ]; then
  gunzip -c $PREVIOUS/synth_prompts.jsonl.gz > $W/synth.jsonl; gunzip -c $PREVIOUS/synth_answers.jsonl.gz > $W/synth_answers.jsonl
  echo "earlier prompts: $(wc -l < $W/synth.jsonl), answers: $(wc -l < $W/synth_answers.jsonl)"
fi
python3 -c "from specheads.smollm2 import smollm2_folder; print(smollm2_folder())" 2>&1 | tail -1
drop_torn() { python3 -c "import sys; from pathlib import Path; from specheads.training.data_cli import drop_torn_line; drop_torn_line(Path(sys.argv[1]))" "$1"; }
openings=(); if [ -n "${OPENINGS:-}" ]; then while IFS= read -r o; do [ -n "$o" ] && openings+=(--opening "$o"); done < $OPENINGS; fi
date; timeout ${SYNTH_SECONDS:-80} python3 -m specheads data synth-prompts --target smollm2-135m-instruct \
  --count ${COUNT:-50000} --output $W/synth.jsonl --exclude configs/prompts/mt_bench_questions.jsonl \
  --batch-size ${BATCH:-512} --seed ${SEED:-1} --device cuda ${openings[@]+"${openings[@]}"} 2>&1 | tr '\r' '\n' | grep -v "/s]$" | tail -3
drop_torn $W/synth.jsonl; echo "synthesized prompts: $(wc -l < $W/synth.jsonl)"
date; timeout ${REGEN_SECONDS:-200} python3 -m specheads data regenerate --target smollm2-135m-instruct \
  --input $W/synth.jsonl --output $W/synth_answers.jsonl --max-new-tokens 256 --batch-size ${BATCH:-512} \
  --temperature 0 --device cuda 2>&1 | tr '\r' '\n' | grep -v "/s]$" | tail -3
drop_torn $W/synth_answers.jsonl; echo "answers: $(wc -l < $W/synth_answers.jsonl)"
gzip -c $W/synth.jsonl > $OUT/synth_prompts.jsonl.gz; gzip -c $W/synth_answers.jsonl > $OUT/synth_answers.jsonl.gz
gunzip -c ${DATA:-.gpu/data}/${ANSWERS:-sharegpt_smollm2_turns.jsonl.gz} | shuf -n ${OLD:-9000} --random-source=<(yes) > $W/old.jsonl
cat $W/synth_answers.jsonl $W/old.jsonl > $W/train.jsonl; echo "training conversations: $(wc -l < $W/train.jsonl)"
date
