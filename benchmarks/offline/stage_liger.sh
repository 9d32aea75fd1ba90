#!/usr/bin/env bash
# Stage liger-kernel (model.use_liger) for a GPU machine without network access: the pinned wheel into .stage_liger/
# (git-ignored), checked against benchmarks/offline/liger.sha256. Copy .stage_liger/ to the GPU machine, then:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .stage_liger/liger_kernel-*.whl
# (pure Python, 0.9 MB; Triton comes with the machine's torch).
#   bash benchmarks/offline/stage_liger.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p .stage_liger
python3 -m pip download -q --no-deps --only-binary=:all: liger-kernel==0.8.5 -d .stage_liger
(cd .stage_liger && sha256sum -c ../benchmarks/offline/liger.sha256)
grep -qx "/.stage_liger/" .git/info/exclude 2>/dev/null || echo "/.stage_liger/" >> .git/info/exclude
