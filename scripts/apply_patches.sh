#!/bin/sh
# Apply EdgeKV's llama.cpp patch series (patches/llama.cpp/NNNN-*.patch, in order) to an
# extracted llama-cpp-python source tree: scripts/apply_patches.sh SRC_ROOT [PATCH_DIR]
#
# Every patch is checked first (`patch --dry-run`); one that does not apply stops the build with
# patch's own reason: a build that silently lacks a patch would lose exactness without saying
# so. The applied series is recorded in SRC_ROOT/.edgekv-patches (name + sha256), so running
# this again on the same tree is a no-op, and a tree patched with another series is refused.
set -eu
src=${1:?usage: apply_patches.sh SRC_ROOT [PATCH_DIR]}
pdir=${2:-patches/llama.cpp}
tree="$src/vendor/llama.cpp"
stamp="$src/.edgekv-patches"
[ -d "$tree/ggml" ] || { echo "apply_patches: $tree is not a llama.cpp tree" >&2; exit 1; }
want=$(cd "$pdir" && for p in [0-9][0-9][0-9][0-9]-*.patch; do [ -f "$p" ] && sha256sum "$p"; done)
[ -n "$want" ] || { echo "apply_patches: no patches in $pdir" >&2; exit 1; }
if [ -f "$stamp" ]; then
    if [ "$(cat "$stamp")" = "$want" ]; then
        echo "apply_patches: $tree already carries this series"; exit 0
    fi
    echo "apply_patches: $tree carries another patch series ($stamp); extract the sdist afresh" >&2
    exit 1
fi
for p in "$pdir"/[0-9][0-9][0-9][0-9]-*.patch; do
    if ! out=$(patch -p1 --forward --dry-run -d "$tree" < "$p" 2>&1); then
        echo "apply_patches: $(basename "$p") does not apply to $tree:" >&2
        echo "$out" >&2
        echo "apply_patches: refusing to build without it (the build would not be batch-invariant)" >&2
        exit 1
    fi
    patch -p1 --forward --silent -d "$tree" < "$p"
    echo "apply_patches: applied $(basename "$p")"
done
echo "$want" > "$stamp"
