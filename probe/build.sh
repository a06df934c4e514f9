#!/bin/sh
# Build edgekv_probe (probe/edgekv_probe.cpp) or another program of probe/ against a llama.cpp
# build: probe/build.sh native|cross OUT LIB_OR_BUILD_DIR TREE [PROGRAM]
#   PROGRAM: edgekv_probe (default; the model probe) or edgekv_kernels (mul_mat, kernel by kernel)
#   probe/build.sh native OUT LIB_DIR TREE   x86 (or any host): the shared libllama.so in
#                                            LIB_DIR (e.g. .venv's llama_cpp/lib), rpath'd
#   probe/build.sh cross OUT BUILD_DIR TREE  aarch64: the static libraries of a cross build
#                                            (scripts/arm_check.sh), Debian's aarch64-linux-gnu-g++
# TREE: the (patched) llama.cpp source tree whose include/ and ggml/include/ match the libraries.
set -eu
mode=${1:?usage: build.sh native|cross OUT LIB_OR_BUILD_DIR TREE}
out=${2:?}
dir=${3:?}
tree=${4:?}
program=${5:-edgekv_probe}
here=$(cd "$(dirname "$0")" && pwd)
src="$here/$program.cpp"
[ -f "$src" ] || { echo "build.sh: no program $program in $here" >&2; exit 2; }
flags="-O2 -std=c++17 -Wall -Wextra -I$tree/include -I$tree/ggml/include"
mkdir -p "$(dirname "$out")"
case "$mode" in
native)
    dir=$(cd "$dir" && pwd)
    ${CXX:-g++} $flags "$src" -o "$out" -L"$dir" -lllama -lggml -lggml-cpu -lggml-base \
        -Wl,-rpath,"$dir" -lpthread ;;
cross)
    ${CROSS_CXX:-aarch64-linux-gnu-g++} $flags "$src" -o "$out" \
        "$dir/src/libllama.a" "$dir/ggml/src/libggml.a" "$dir/ggml/src/libggml-cpu.a" \
        "$dir/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -lm ;;
*)
    echo "build.sh: mode native or cross, not $mode" >&2; exit 2 ;;
esac
