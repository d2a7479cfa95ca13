# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Numba's compiled-kernel cache lives inside the clone, so a fresh clone starts empty and a
# stale cache from another checkout can never be picked up; within it, waste/jit.py keeps one
# directory per version of the sources, so an update cannot be served stale kernels either.
export NUMBA_CACHE_DIR := $(CURDIR)/.numba_cache
DEMO_DIR ?= .demo

.PHONY: demo test lint lab bench bench-peer bench-scale clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m ipykernel install --prefix $(VENV) --name waste --display-name "waste (.venv)" > /dev/null
	touch $@

$(VENV): $(VENV)/.installed

demo: $(VENV)
	$(BIN)/waste demo --work-dir $(DEMO_DIR) --force

test: $(VENV)
	$(BIN)/ruff check waste tests bench
	$(BIN)/python -m pytest -q

lint: $(VENV)
	$(BIN)/ruff check waste tests bench

lab: $(VENV)
	$(BIN)/jupyter lab --notebook-dir=notebooks

bench: $(VENV)
	$(BIN)/python bench/kda.py
	$(BIN)/python bench/mla.py
	$(BIN)/python bench/quant.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/streaming.py
	$(BIN)/python bench/memory.py

# waste against llama.cpp built from source (network, ~GBs in ~/.cache/waste-peer; not in test or CI)
bench-peer: $(VENV)
	$(BIN)/python bench/peer.py

# Kimi-Linear-48B-A3B q4 from disk (issue 13): synthesises a 28.7 GB container once into
# $WASTE_SCALE_DIR (default /work/scale), outside the clone; not part of `make bench`.
bench-scale: $(VENV)
	$(BIN)/python bench/scale.py

clean:
	rm -rf $(VENV) .numba_cache $(DEMO_DIR) .pytest_cache
