PYTHON ?= python3

.PHONY: setup demo test test-fast lint format bench

setup:
	bash scripts/setup.sh

# The main job: resilient training with injected failures.
demo: setup
	$(PYTHON) -m lightning_recover.cli demo

# The whole test suite (what CI runs).
test: setup
	$(PYTHON) -m pytest -q --durations=25 tests

# Style: ruff (lint + format check) over the whole tree, clang-format over native_io's C.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	clang-format --dry-run --Werror native_io/src/*.c native_io/src/*.h

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	clang-format -i native_io/src/*.c native_io/src/*.h

# The fast tests (no multi-process job, nothing > 5 s): what to run while editing.
test-fast:
	$(PYTHON) -m pytest -q -m "not slow" tests

bench: setup
	$(PYTHON) -m lightning_recover.cli bench checkpoint --size-gb 2 --json benchmarks/results/bench_checkpoint.json
