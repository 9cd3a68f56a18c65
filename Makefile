# The README's two commands: `make main` (set up, run the main job) and `make test`
# (set up, run every test). Both create .venv on first use and are safe to repeat.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: main test lint setup
setup: $(STAMP)

# Reinstall when the package metadata changes. torch is installed first and pinned so that
# the CPU wheel is used here and no CUDA build is ever pulled in by a dependency.
$(STAMP): setup.py pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test]" "$(TORCH_SPEC)"
	# Compile the numba kernels (compressors and the planner's simulator) into their caches
	# once, so that jobs and tests start without compiling (about 30 s on 2 cores).
	$(VENV)/bin/espresso compressors --warm-up
	touch $(STAMP)

main: $(STAMP)
	$(VENV)/bin/python -m byteps_espresso.deploy.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest
