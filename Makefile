# Every target runs in the project-local virtual environment .venv, made (and kept up to date) by
# scripts/setup.sh: the machine's own Python is never touched. Set VENV to use another one.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# As if activated: a script or test that runs `python` (examples/torchrun_replica.sh) gets the same one.
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup demo test test-c test-unit test-integration test-chaos test-fast lint format bench

# Fast when nothing changed (a stamp in $(VENV)); fails with what to install when it cannot set up.
setup:
	VENV=$(VENV) bash scripts/setup.sh

# The main job: resilient training with injected failures.
demo: setup
	$(PYTHON) -m lightning_recover.cli demo
	@echo "Next: the tools are in $(VENV), not on your PATH: source $(VENV)/bin/activate, then lightning-recover --help"
	@echo "      and python examples/fabric_gpt.py --replicas 2 (or, without activating: $(VENV)/bin/lightning-recover,"
	@echo "      $(VENV)/bin/python examples/...). README.md, 'Four ways in', has the examples."

# The whole test suite (what CI runs), tier by tier, stopping at the first tier that fails: the C tests, the unit
# tier (logic only, no process, under a minute), the integration tier (processes, etcd) and the chaos tier
# (network namespaces, partitions, a Slurm cluster). Two pytest-xdist workers take a file each at a time.
test: setup test-c test-unit test-integration test-chaos

test-unit: setup
	$(PYTHON) -m pytest -q -n 2 --durations=10 tests/unit

test-integration: setup
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=25 tests/integration

test-chaos: setup
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=15 tests/chaos

# native_io's C tests: small programs against the engine's C core, under AddressSanitizer and UBSan.
test-c:
	$(MAKE) -j$$(nproc) -C native_io/tests

# Style: ruff (lint + format check) over the whole tree, mypy over the public Lightning-facing API (the files
# [tool.mypy] in pyproject.toml lists), clang-format over native_io's C.
lint: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
	$(VENV)/bin/clang-format --dry-run --Werror native_io/src/*.c native_io/src/*.h native_io/tests/*.c native_io/tests/*.h

format: setup
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	$(VENV)/bin/clang-format -i native_io/src/*.c native_io/src/*.h native_io/tests/*.c native_io/tests/*.h

# The fast tests (no multi-process job, nothing > 5 s): what to run while editing.
test-fast: setup
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

bench: setup
	$(PYTHON) -m lightning_recover.cli bench checkpoint --size-gb 2 --json benchmarks/results/bench_checkpoint.json
