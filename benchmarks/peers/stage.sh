#!/usr/bin/env bash
# Stage the peers' pinned wheels for a GPU machine without network access (CPython 3.12, manylinux x86_64, torch
# 2.11.0+cu130) as folders of at most 52 MiB (PEERS_FOLDER_MIB) of wheels or wheel pieces each (plus one checksum
# file), beside vLLM 0.26's own pieces (benchmarks/offline/stage.sh → .stage/pN):
#   OUT/trl_c1            trl 1.16.0, liger-kernel 0.8.5 and datasets 5.2.0 with dill 0.4.1 and multiprocess 0.70.19
#                         (TRL and verl need datasets>=4.7; everything else TRL needs is on the GPU machine or in vLLM
#                         0.26's set; Liger's wheel also serves hybrid_rl's model.use_liger)
#   OUT/verl_c1 .. cN     verl 0.9.1, vLLM 0.24.0 (its pin), transformers 5.9.0 (its vllm-extra pin), tokenizers
#                         0.22.2, ray 2.60.0 (core, no dashboard extras), TransferQueue, hydra/omegaconf, tensordict,
#                         torchdata, liger-kernel 0.8.5 (use_liger), datasets 5.2.0 (+ dill, multiprocess), and the
#                         vLLM 0.24 serving deps that 0.26's set leaves out (verl drives vLLM through its OpenAI server
#                         code). vLLM 0.24's and ray's wheels are cut into 52 MiB pieces; the pieces and the other
#                         wheels are packed into as few folders of <= 52 MiB as fit (largest first).
# Every file is checked against benchmarks/peers/{trl,verl}.sha256 (pinned here); antlr4-python3-runtime 4.9.3 (hydra's
# pin) has no wheel on PyPI: its checked sdist is built into a pure-Python wheel here.
# Usage: bash benchmarks/peers/stage.sh [OUT]      (default .stage_peers, git-ignored)
# Then see benchmarks/peers/README.md for the commands on the GPU machine.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-.stage_peers}
MIB=${PEERS_FOLDER_MIB:-52}
[[ $MIB =~ ^[1-9][0-9]*$ ]] \
  || { echo "stage.sh: PEERS_FOLDER_MIB='$MIB' must be a whole number of MiB, e.g. 52" >&2; exit 2; }
DL=$(mktemp -d)
trap 'rm -rf "$DL"' EXIT
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
pins() { awk '{print $2}' "$1" | grep '\.whl$' | sed -E 's/^([A-Za-z0-9_.]+)-([0-9][^-]*)-.*/\1==\2/' | sed 's/_/-/g'; }
mkdir -p "$DL/trl" "$DL/verl"
python3 -m pip download -q "${PLAT[@]}" -d "$DL/trl" $(pins "$HERE/trl.sha256")
python3 -m pip download -q "${PLAT[@]}" -d "$DL/verl" $(pins "$HERE/verl.sha256")
python3 -m pip download -q --no-deps --no-binary=:all: -d "$DL/verl" antlr4-python3-runtime==4.9.3
(cd "$DL/trl" && sha256sum -c --quiet "$HERE/trl.sha256")
(cd "$DL/verl" && sha256sum -c --quiet "$HERE/verl.sha256")
# the sdist → a py3-none-any wheel (pure Python; built here, so its own hash goes into the folder's checksum file)
python3 -m pip wheel -q --no-deps -w "$DL/verl" "$DL/verl/antlr4-python3-runtime-4.9.3.tar.gz"
rm "$DL/verl/antlr4-python3-runtime-4.9.3.tar.gz"

rm -rf "$OUT" && mkdir -p "$OUT/trl_c1"
cp "$DL"/trl/*.whl "$OUT/trl_c1/" && (cd "$OUT/trl_c1" && sha256sum ./*.whl > trl_c1.sha256)

V=vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
R=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
PIECE=$((MIB * 1024 * 1024))  # the most bytes of wheels one folder holds (a folder is one transfer)
(cd "$DL/verl" && split -b "${MIB}m" -d -a 2 "$R" "$R.part" && split -b "${MIB}m" -d -a 2 "$V" "$V.part" && rm "$R" "$V")
# first-fit decreasing into verl_c1, verl_c2, ...: each folder's files sum to at most PIECE bytes
python3 "$HERE/pack.py" "$DL/verl" "$OUT" "$PIECE" verl_c
for d in "$OUT"/verl_c*; do (cd "$d" && sha256sum ./* > "$(basename "$d").sha256"); done
du -sh "$OUT"/*
for d in "$OUT"/*; do  # the wheels and pieces of each folder (its checksum file aside)
  s=$(find "$d" -type f ! -name '*.sha256' -printf '%s\n' | awk '{t += $1} END {print t + 0}')
  [ "$s" -le "$PIECE" ] || { echo "ERROR: $d holds $s bytes of wheels, over $MIB MiB" >&2; exit 1; }
done
echo "Staged: $OUT/trl_c1 and $OUT/verl_c1 .. $(basename "$(ls -d "$OUT"/verl_c* | sort -V | tail -1)") (see benchmarks/peers/README.md for the commands on the GPU machine)."
