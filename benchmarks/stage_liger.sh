#!/usr/bin/env bash
# Stage liger-kernel (model.use_liger) for the GPU machines, which have no network: the pinned wheel into .stage_liger/
# (git-ignored), checked against benchmarks/liger.sha256. Copy .stage_liger into the clean export beside .devdata;
# benchmarks/gpu_session.sh installs it into /tmp/site (pure Python, 0.9 MB; Triton comes with the machines' torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .stage_liger
python3 -m pip download -q --no-deps --only-binary=:all: liger-kernel==0.8.5 -d .stage_liger
(cd .stage_liger && sha256sum -c ../benchmarks/liger.sha256)
grep -qx "/.stage_liger/" .git/info/exclude 2>/dev/null || echo "/.stage_liger/" >> .git/info/exclude
