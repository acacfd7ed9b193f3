# Two commands do all the set-up on a fresh machine (README):
#   make demo   the main job (creates .venv on first use)
#   make test   the test suite, multi-process failure tests included (creates .venv on first use)
#   make test-quick  the quick tier (-m quick): fast unit tests, the C++ backend under mpirun,
#               one kill-and-verify run per feature (tests/unit/test_quick_tier.py)
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXT_STAMP := $(VENV)/.ext-built
CSRC := $(wildcard csrc/*.cpp csrc/*.hpp csrc/*.h)
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv build test test-quick test-unit test-mpi demo bench clean

$(STAMP): pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a floating torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0 setuptools wheel ninja
	RECOVER_HSDP_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

$(EXT_STAMP): $(STAMP) $(CSRC) setup.py
	$(PY) setup.py -q build_ext --inplace
	touch $(EXT_STAMP)

build: $(EXT_STAMP)

test: build
	$(PY) -m pytest -q -ra --durations=50 tests

test-quick: build
	$(PY) -m pytest -q -ra --durations=15 -m quick tests

test-unit: build
	$(PY) -m pytest -q -ra tests/unit

test-mpi: build
	$(PY) -m pytest -q -ra tests/mpi

demo: build
	$(PY) -m recover_hsdp.cli demo

bench: build
	$(PY) -m recover_hsdp.cli bench all

clean:
	rm -rf build recover_hsdp/_C*.so $(EXT_STAMP)
