#!/usr/bin/env bash
# On the GPU machine: install one peer from its staged pieces (benchmarks/peers/stage.sh) into its own --target dir.
#   bash benchmarks/peers/install_remote.sh trl  PS_DIR [SITE]      (SITE default /tmp/site_trl)
#        → use with PYTHONPATH=/tmp/site_trl:/tmp/site   (TRL and Liger's kernels on top of the vLLM 0.26 set in /tmp/site)
#   bash benchmarks/peers/install_remote.sh verl PS_DIR [SITE] [VS_DIR]   (SITE default /tmp/site_verl, VS /tmp/vs)
#        → use with PYTHONPATH=/tmp/site_verl alone: vLLM 0.24 + transformers 5.9 + verl's deps + Liger, plus vLLM 0.26's
#          small dependency wheels and datasets taken from VS_DIR (the unpacked .stage/c1..c6), so nothing of
#          /tmp/site (vLLM 0.26, transformers 5.17 from the image) is mixed in except what the image itself has
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
  "${PIP[@]}" --target "$SITE" trl-1.16.0-py3-none-any.whl liger_kernel-0.8.5-py3-none-any.whl
  ;;
verl)
  SITE=${3:-/tmp/site_verl}
  VS=${4:-/tmp/vs}
  V=vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
  R=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  for k in 1 2 3 4 5 6 7; do sha256sum -c --quiet "verl_c$k.sha256"; done
  [ -f "$V" ] || cat "$V".part0* > "$V"
  [ -f "$R" ] || cat "$R".part0* > "$R"
  grep -E " ($V|$R)\$" "$HERE/verl.sha256" | sha256sum -c --quiet -
  # vLLM 0.26's small deps (same requirement set as 0.24) except the ones verl's set pins itself
  OURS=$(ls ./*.whl | sed -E 's|^\./||; s/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort -u)
  VSW=()
  for w in "$VS"/*.whl "$VS"/datasets/*.whl; do
    b=$(basename "$w")
    n=$(echo "$b" | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_')
    case $b in vllm-*) continue ;; esac
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
