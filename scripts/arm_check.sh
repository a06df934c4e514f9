#!/usr/bin/env bash
# The ARM64 check (issue 33): EdgeKV's engine cross-built for aarch64 from the same patched tree
# `make setup` builds, at the two feature levels edge devices have, and run on it under qemu-user:
# the kernel check (probe/edgekv_kernels.cpp: every weight type's mul_mat, a column alone against
# the same column in batches of 2-64, plain and repacked) and the batch-invariance probe
# (probe/edgekv_probe.cpp, the schedules of src/edgekv/engines/probe.py) on the stand-in models.
#
#   dotprod  -march=armv8.2-a+dotprod+fp16        qemu -cpu cortex-a76 (a Raspberry Pi 5's core)
#   i8mm     -march=armv8.6-a+dotprod+fp16+i8mm   qemu -cpu max (recent phones)
#
# Usage: scripts/arm_check.sh build [LEVEL...]   the cross builds and the probe binaries
#                                                (build/arm/<level>/edgekv_probe, edgekv_kernels)
#        scripts/arm_check.sh kernels             build, then the kernel check at both levels
#                                                (build/arm/kernel-check.json)
#        scripts/arm_check.sh check               the kernel check, then `edgekv bench kernels
#                                                --arch aarch64-dotprod,aarch64-i8mm --runs 1`
#                                                on the CI stand-in models: fails unless every
#                                                column and every schedule of every row is
#                                                bit-identical
#        scripts/arm_check.sh tools               only install what is missing
#
# Debian's qemu-user and g++-aarch64-linux-gnu are installed only where missing, and only as
# root. Elsewhere the check is skipped with a message (make test stays root-free), unless
# ARM_CHECK_REQUIRE=1 (.ci/run sets it): then a missing tool is a failure.
# ARM_BUILDS=edgekv,stock also runs the stock kernels (the same build with the switch off: the
# verdicts before the series); ARM_JSON=PATH writes the rows there (build/arm/kernels-arm.json).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
PATCHED_TREE=build/patched/llama_cpp_python-$VERSION/vendor/llama.cpp
PY=${PYTHON:-.venv/bin/python}

march() {
    case "$1" in
    dotprod) echo "armv8.2-a+dotprod+fp16" ;;
    i8mm) echo "armv8.6-a+dotprod+fp16+i8mm" ;;
    *) echo "arm_check.sh: unknown level $1 (dotprod, i8mm)" >&2; exit 2 ;;
    esac
}

# the qemu CPU of a level (as edgekv_bench.emulated's arch rows)
qemu_cpu() {
    case "$1" in
    dotprod) echo "cortex-a76" ;;
    i8mm) echo "max" ;;
    esac
}

have_tools() {
    command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-g++ >/dev/null \
        && command -v cmake >/dev/null && command -v ninja >/dev/null
}

skip_or_fail() {
    if [ "${ARM_CHECK_REQUIRE:-0}" = 1 ]; then
        echo "arm_check.sh: $1 (ARM_CHECK_REQUIRE=1: a failure)" >&2
        exit 1
    fi
    echo "arm_check.sh: SKIPPED: $1" >&2
    exit 0
}

tools() {
    have_tools && return 0
    if [ "$(id -u)" -ne 0 ]; then
        skip_or_fail "qemu-user, g++-aarch64-linux-gnu, cmake or ninja is missing and this is not root: apt-get install qemu-user g++-aarch64-linux-gnu cmake ninja-build"
    fi
    command -v apt-get >/dev/null || skip_or_fail "the ARM tools are missing and there is no apt-get"
    apt-get update -q || skip_or_fail "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user g++-aarch64-linux-gnu cmake ninja-build \
        || skip_or_fail "apt-get install qemu-user g++-aarch64-linux-gnu failed"
    have_tools || skip_or_fail "the ARM tools are still missing after apt-get install"
}

# cross_build TREE OUT ARCH [FIRST]: llama.cpp's static libraries (the same options as EdgeKV's
# x86 engine: llamafile on, GGML_NATIVE off, no KleidiAI), rebuilt where the tree's patch series
# or the level changed, and the programs of probe/ linked against them (every time: seconds).
# The level's -march reaches ggml-cpu only: libllama and libggml come out byte-identical at
# every level, so a later level (FIRST: the first level's build) builds ggml-cpu and ggml and
# takes the first level's libllama.a (the bulk of a build: about 230 of 315 CPU seconds).
cross_build() {
    local tree=$1 out=$2 arch=$3 first=${4:-}
    local want
    want=$(signature "$tree" "$arch"; [ -z "$first" ] || cat "$first/.built")
    if [ "$(cat "$out/.built" 2>/dev/null)" = "$want" ]; then
        echo "arm_check.sh: $out is up to date"
    else
        local took="about 5 minutes on 2 cores"
        [ -z "$first" ] || took="about 1 minute on 2 cores, libllama from $first"
        echo "arm_check.sh: cross-building $tree for $arch into $out ($took)"
        rm -rf "$out" && mkdir -p "$(dirname "$out")"
        nice -n 10 cmake -S "$tree" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -DCMAKE_TOOLCHAIN_FILE="$PWD/probe/aarch64-linux-gnu.cmake" \
            -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$arch" \
            -DGGML_LLAMAFILE=ON -DGGML_CPU_KLEIDIAI=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF >"$out.cmake.log" 2>&1 \
            || { tail -30 "$out.cmake.log" >&2; exit 1; }
        local targets=(llama)
        [ -z "$first" ] || targets=(ggml-cpu ggml)
        nice -n 10 cmake --build "$out" -j"$(nproc)" --target "${targets[@]}" >"$out.build.log" 2>&1 \
            || { tail -30 "$out.build.log" >&2; exit 1; }
        # ggml-base is built at both levels (ggml-cpu needs it): were the level's flags to
        # reach it (a later llama.cpp), libllama is no longer shared but built here too
        if [ -n "$first" ] && cmp -s "$first/ggml/src/libggml-base.a" "$out/ggml/src/libggml-base.a"; then
            mkdir -p "$out/src" && cp "$first/src/libllama.a" "$out/src/libllama.a"
        elif [ -n "$first" ]; then
            echo "arm_check.sh: libggml-base differs between the levels: building libllama for $arch"
            nice -n 10 cmake --build "$out" -j"$(nproc)" --target llama >>"$out.build.log" 2>&1 \
                || { tail -30 "$out.build.log" >&2; exit 1; }
        fi
        echo "$want" >"$out/.built"
    fi
    sh probe/build.sh cross "$out/edgekv_probe" "$out" "$tree"
    sh probe/build.sh cross "$out/edgekv_kernels" "$out" "$tree" edgekv_kernels
}

# what the libraries depend on: the tree's patches (its marker), the level, the toolchain
signature() {
    { echo "$2"; cat "$1/../../.edgekv-patches" 2>/dev/null || echo stock;
      cat probe/aarch64-linux-gnu.cmake; } | sha256sum | cut -c1-16
}

build() {
    tools
    [ -f "$PATCHED_TREE/CMakeLists.txt" ] || make patched-src
    local levels=("$@")
    [ ${#levels[@]} -gt 0 ] || levels=(dotprod i8mm)
    local first=""
    for level in "${levels[@]}"; do
        cross_build "$PATCHED_TREE" "build/arm/$level" "$(march "$level")" "$first"
        first=${first:-build/arm/$level}
    done
}

# kernels: the kernel check under qemu at both levels at once (each level's 1-thread rows
# leave a core free), 1 and 2 threads, the switch on; the levels' JSON side by side in
# build/arm/kernel-check.json. Fails where a column differs.
kernels() {
    local level pids=()
    for level in dotprod i8mm; do
        echo "arm_check.sh: kernel check at $level (qemu -cpu $(qemu_cpu "$level"))"
        rm -f "build/arm/$level/kernel-check.json"
        # exit 3 (a column differs) is reported below, from the JSON
        (qemu-aarch64 -cpu "$(qemu_cpu "$level")" -L /usr/aarch64-linux-gnu \
            "build/arm/$level/edgekv_kernels" --invariant 1 --threads 1,2 \
            --json "build/arm/$level/kernel-check.json" | tail -1 || [ $? -eq 3 ]) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || { echo "arm_check.sh: the kernel check failed to run" >&2; exit 1; }
    done
    "$PY" - build/arm/kernel-check.json <<'EOF'
import json, sys
levels = {lv: json.load(open(f"build/arm/{lv}/kernel-check.json")) for lv in ("dotprod", "i8mm")}
json.dump({"machine": "aarch64 under qemu-user (dotprod: -cpu cortex-a76, i8mm: -cpu max)",
           "emulated": True, "qemu_cpu": {"dotprod": "cortex-a76", "i8mm": "max"},
           "command": "scripts/arm_check.sh kernels", "levels": levels},
          open(sys.argv[1], "w"), indent=1)
bad = [(lv, r["type"], r["buffer"], r["k"], r["threads"], r["first"])
       for lv, d in levels.items() for r in d["rows"] if r["differ"]]
for b in bad:
    print("arm_check.sh: differs: %s %s %s k %d threads %d, first %s" % b, file=sys.stderr)
if bad:
    sys.exit(f"arm_check.sh: {len(bad)} kernel row(s) not batch-invariant on ARM")
n = sum(len(d["rows"]) for d in levels.values())
print(f"arm_check.sh: kernel check, {n} rows at both levels, every column bit-identical")
EOF
}

check() {
    build
    kernels
    local json=${ARM_JSON:-build/arm/kernels-arm.json}
    mkdir -p "$(dirname "$json")"
    HF_HUB_OFFLINE=1 .venv/bin/edgekv bench kernels --arch aarch64-dotprod,aarch64-i8mm \
        --runs 1 --builds "${ARM_BUILDS:-edgekv}" --json "$json"
    "$PY" - "$json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
bad = [r for r in rows if r["build"] == "edgekv"
       and (r.get("error") or r["probe_identical"] != r["probe_total"])]
for r in rows:
    print(f"{r['arch']:16} {r['model']:32} {r['build']:8} {r['probe_identical']}/{r['probe_total']}"
          + (f"  failed: {', '.join(r['probe_failed'])}" if r["probe_failed"] else "")
          + (f"  error: {r['error']}" if r.get("error") else ""))
if not rows or bad:
    sys.exit(f"arm_check.sh: {len(bad)} edgekv row(s) not exact on ARM" if rows else "no rows")
print(f"arm_check.sh: {len(rows)} rows, every edgekv schedule bit-identical under qemu")
EOF
}

case "${1:-check}" in
tools) tools ;;
build) shift; build "$@" ;;
kernels) build; kernels ;;
check) check ;;
*) echo "usage: scripts/arm_check.sh build [dotprod|i8mm ...] | kernels | check | tools" >&2; exit 2 ;;
esac
