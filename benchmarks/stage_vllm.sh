#!/usr/bin/env bash
# Stage vLLM 0.26 for the GPU machines in carries that leave room for this tree: ../shared/device/vllm-stage/prepare.sh
# writes .stage/c1..c6 with 59 MiB wheel parts, and a call carries the whole tracked tree too (64 MiB in all; the tree
# passed 5 MiB in stop 31, so c1..c4 were refused). This re-cuts the wheel into 45 MiB pieces: .stage/v1..v7, where
# v7 also holds the datasets wheels and the dependency wheels but the largest, which v8 holds with the scripts. On the machine, one call per
# carry in a row (`mkdir -p /tmp/vs && cp -r .stage/vK/. /tmp/vs/`), then benchmarks/gpu_session.sh joins the
# pieces (/tmp/vs/join_vllm.sh, checked against the pinned sha256) before install_remote.sh installs the set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d .stage/c6 ] || bash ../shared/device/vllm-stage/prepare.sh .stage
W=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
rm -rf .stage/v* && T=$(mktemp -d .stage/tmp.XXXX)
cat .stage/c1/$W.part00 .stage/c2/$W.part01 .stage/c3/$W.part02 .stage/c4/$W.part03 .stage/c5/$W.part04 > $T/$W
echo "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de  $W" | (cd $T && sha256sum -c -)
(cd $T && split -b 45m -d -a 1 $W $W.s && rm $W)
i=1; for p in $T/$W.s*; do mkdir -p .stage/v$i && mv $p .stage/v$i/; i=$((i + 1)); done   # v1..v7: 45 MiB each, v7 less
# the last piece (~20 MiB) takes the datasets wheels (c5) and the dependency wheels (c6) but the largest, which
# goes into one more carry with the install scripts
n=$((i - 1)); L=.stage/v$((n + 1)); mkdir -p .stage/v$n/datasets $L
cp -r .stage/c5/datasets/. .stage/v$n/datasets/
big=$(ls -S .stage/c6/*.whl | head -1)
cp .stage/c6/*.whl .stage/v$n/ && mv .stage/v$n/$(basename $big) $L/
cp .stage/c6/install_remote.sh .stage/c6/chunk6.sha256 $L/
cat > $L/join_vllm.sh <<EOS
#!/usr/bin/env bash
set -euo pipefail
cd /tmp/vs
[ -f $W ] || cat $W.s* > $W
echo "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de  $W" | sha256sum -c -
sha256sum -c chunk6.sha256
EOS
rmdir $T; du -sh .stage/v*
