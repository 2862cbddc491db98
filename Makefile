# Quickstart: `make demo` (a real training run under a memory cap) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch and torchvision pinned to the builds this project is developed and tested with;
# the package itself accepts any torch >= 2.3.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: install demo test test-quick docs docs-serve wheel-check bench gpu-check gpu-wheels clean

$(VENV)/.installed: pyproject.toml examples/custom_policy/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH_PINS)
	$(PIP) install --quiet -e '.[test,tensorboard,docs]'
	$(PIP) install --quiet --no-deps -e examples/custom_policy  # the example plug-in, tested by the suite
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/autotune demo

# The suite in JOBS pytest-xdist workers (one core each: tests/conftest.py), a file's tests on one worker,
# the files with slow tests handed out first, in the order tests/conftest.py puts them. xdist's own order
# (the files with the most tests first) left files of one or two long tests to the end: one worker busy,
# the other idle. `make test JOBS=0` runs it in this process, one test at a time.
JOBS ?= 2
XDIST = $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PY) -m pytest -q $(XDIST)

# The tests not marked slow: no torchrun jobs, no subprocesses under RLIMIT_AS (about 80 s).
test-quick: install
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# The documentation site (docs/, mkdocs.yml), built into site/; the tests build it too.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

# The wheel, installed in a fresh virtual environment, runs `autotune demo`.
wheel-check: install
	$(PIP) install --quiet build
	bash .ci/wheel-check

bench: install
	$(PIP) install --quiet -e '.[bench]'
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/recovery.py
	$(PY) benchmarks/monitor.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/fsdp.py
	$(PY) benchmarks/batch_efficiency.py
	$(PY) benchmarks/growing_memory.py --trials 5
	$(PY) benchmarks/input_cache.py --trials 3
	$(PY) benchmarks/input_cache.py --trials 3 --size 384
	$(PY) benchmarks/relief_ladder.py
	$(PY) benchmarks/integrations.py

# On a CUDA machine: the GPU check (benchmarks/gpu_check.py: each step in its own interpreter, results
# in $$OUT or benchmarks/results/gpu_check.md). Runs with the machine's own python (GPU machines bring
# torch with CUDA), not the venv; what that python lacks comes from .whl/ (make gpu-wheels).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

# Here, where the package registry is reachable: the pure-Python wheels a lent GPU machine lacks, at the
# versions the venv tests with, into .whl/ (ignored; carry it to the GPU machine).
gpu-wheels: install
	rm -rf .whl
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
		--platform any -d .whl $$($(PY) benchmarks/gpu_check.py --wheel-specs)
	ls .whl

clean:
	rm -rf $(VENV) runs .pytest_cache site dist build .whl
