# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= 2.13.0

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: its CPU build; an open range would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==$(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/memshard models
	$(VENV)/bin/memshard plan --model llama3-8b --mesh 8x8 --batch 64 --seq 4096 --json plan.json
	OMP_NUM_THREADS=1 $(VENV)/bin/memshard run --model tiny-gpt --mesh 2x2 --steps 3

# One pytest worker per core (at most 4); a test file's tests on one worker (its fixtures built once)
# but for a few whose tests are independent, the costliest files first (tests/conftest.py);
# the 15 slowest tests are printed at the end.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest -n auto --maxprocesses 4 --dist loadgroup --durations=15

# tests/unit alone: records, parsers, pricing, the code's shape; no real-model search
test-fast: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest -n auto --maxprocesses 4 --dist loadgroup -m unit

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) plan.json .pytest_cache .ruff_cache .hypothesis
