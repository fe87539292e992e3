#!/usr/bin/env bash
# Whether a change to the CUDA sources changes any machine code: compiles every .cu file under
# csrc/cuda at REV (git archive, in a temporary folder) and in this work tree to cubins, for sm_90a
# (the Hopper kernels) and sm_80 (the portable ones), with setup.py's release flags less -lineinfo
# (line tables move with any edit; the machine code is what is compared), and compares them byte
# for byte. nvcc's cubins are deterministic for the same source, so a refactor that prints "same"
# everywhere needs no GPU run to keep its kernels' speed and results.
#
#   bash scripts/same_cubins.sh [REV]          (default REV: HEAD; needs nvcc; exit 1 on a difference)
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "same_cubins: no nvcc" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/out"

# Both sources are built from the same folder: a cubin holds names (anonymous namespaces) hashed
# from its source's absolute path.
build() {  # build <tag>: the sources in $TMP/src
  local f
  while IFS= read -r f; do
    for arch in 90a 80; do
      local defs=""
      [ "$arch" = 90a ] && defs="-DNCP_SM90A_BUILD=1"
      (cd "$TMP/src" && "$NVCC" -std=c++17 --expt-relaxed-constexpr -Icsrc/include -Icsrc/core -O3 -DNDEBUG \
        $defs -diag-suppress 177 -arch=sm_$arch -cubin "$f" -o "$TMP/out/$1.${f//\//_}.$arch.cubin")
    done
  done < <(cd "$TMP/src" && find csrc/cuda -name '*.cu' | sort)
}
mkdir -p "$TMP/src" && git archive "$REV" csrc | tar -x -C "$TMP/src"
build rev
rm -rf "$TMP/src" && mkdir -p "$TMP/src" && cp -r csrc "$TMP/src/"
build tree

status=0
for f in "$TMP"/out/tree.*.cubin; do
  name=${f#"$TMP"/out/tree.}
  if [ ! -e "$TMP/out/rev.$name" ]; then echo "new   $name"; status=1
  elif cmp -s "$f" "$TMP/out/rev.$name"; then echo "same  $name"
  else echo "DIFF  $name"; status=1; fi
done
for f in "$TMP"/out/rev.*.cubin; do
  [ -e "$TMP/out/tree.${f#"$TMP"/out/rev.}" ] || { echo "gone  ${f#"$TMP"/out/rev.}"; status=1; }
done
exit $status
