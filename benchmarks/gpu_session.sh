#!/usr/bin/env bash
# Everything that needs GPUs, in one lease (the device tool's machines start bare).
# Expects vLLM 0.26 staged at /tmp/vs (../shared/device/README.md) and GSM8K in .devdata/.
#   bash benchmarks/gpu_session.sh            # writes $OUT/results.tgz and $OUT/session.log
set -u
OUT=${OUT:-/tmp/gpu_out}
RES=/tmp/res
mkdir -p "$OUT" "$RES"
exec > >(tee "$OUT/session.log") 2>&1
if [ -d /tmp/vs ]; then
  bash /tmp/vs/install_remote.sh /tmp/vs /tmp/site --with-datasets >/dev/null || echo "vllm install failed"
  export PYTHONPATH=/tmp/site:$PWD
fi
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export PYTHONUNBUFFERED=1 HYBRID_RL_CACHE=/tmp/hrc TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" || true
python -c "from hybrid_rl.models import resolve_model_path as r; r('builtin:qwen2.5-0.5b-random'); r('builtin:qwen2.5-1.5b-random')"
T0=$(date +%s)
# pack after every part, so a run cut short by the call's time limit still returns what finished
stamp() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; tar czf "$OUT/results.tgz" --exclude=checkpoints --exclude=tensorboard -C "$RES" . 2>/dev/null; }

# 1. weight sync into the engine vs its all-gather bound (2 ranks), both sizes
for m in qwen2.5-0.5b qwen2.5-1.5b; do
  stamp "weight_sync $m x2"
  timeout 80 torchrun --standalone --nproc_per_node=2 benchmarks/weight_sync.py --model $m --switches 50 --out-dir "$RES" || echo "weight_sync $m failed"
done

# 2. the real trainer with vLLM: 20 GRPO steps on 2 GPUs (0.5B shape, random init, GSM8K prompts)
stamp "train vllm x2"
BENCH="data.train_path=.devdata/train.jsonl rollout.name=vllm data.max_response_length=512 rollout.forced_lengths=lognormal:200:0.8 trainer.logger=[jsonl]"
timeout 150 torchrun --standalone --nproc_per_node=2 -m hybrid_rl train recipes/bench_modes.yaml $BENCH \
  rollout.enforce_eager=true trainer.total_steps=20 data.train_batch_size=32 trainer.output_dir=$RES/train_vllm_x2 || echo "train vllm x2 failed"

# 3. sync vs one-step overlap on 1 GPU (same recipe, seed, steps)
stamp "modes x1"
CUDA_VISIBLE_DEVICES=0 timeout 240 python benchmarks/modes.py --gpus 1 --steps 8 --warmup 2 --prompts 32 --n 8 --out "$RES" \
  $BENCH || echo "modes failed"
stamp "done"
ls -R "$RES" | head -50
