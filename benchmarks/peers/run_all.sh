#!/usr/bin/env bash
# On a GPU machine without network access: one framework per invocation, all on one machine, then the combined report.
#   bash benchmarks/peers/run_all.sh hybrid_rl|trl|verl|verl_bg|verl_wait|report [GPUS]   (GPUS default: every visible GPU)
# Expects: vLLM 0.26's wheel set with its install_remote.sh unpacked in /tmp/vs, the peers' staged pieces unpacked in
# /tmp/ps (benchmarks/peers/stage.sh; trl_c1 before 'trl', verl_c1..c7 before 'verl'). The prompts are the GSM8K rows
# the benchmarks ship (benchmarks/data/gsm8k_train_1k.jsonl; PEERS_DATA names another GSM8K jsonl, fields
# question/answer). Each part installs what it needs once per machine, writes /tmp/peers_res/<framework>.json, and
# rebuilds benchmarks/results/peers_<device>_<model>.json + .png from every framework finished so far; all of it is
# copied to $OUT (default /tmp/peers_out).
set -u
PART=${1:?usage: run_all.sh hybrid_rl|trl|verl|verl_bg|verl_wait|report [GPUS]}
GPUS=${2:-$(nvidia-smi -L 2>/dev/null | wc -l)}
OUT=${OUT:-/tmp/peers_out}
# the same work per GPU on any machine: 16 prompts per GPU per step (64 on 4 GPUs), the mini-batch half of it
export PEERS_PROMPTS=${PEERS_PROMPTS:-$((16 * GPUS))}
RES=/tmp/peers_res
MODEL_DIR=/tmp/peers_model
DATA=${PEERS_DATA:-$PWD/benchmarks/data/gsm8k_train_1k.jsonl}
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$OUT/peers_$PART.log") 2>&1
[ -f "$DATA" ] || { echo "no GSM8K prompts at $DATA: run from the checkout's root or set PEERS_DATA"; exit 2; }
export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
  HYBRID_RL_CACHE=/tmp/hrc TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
ROOT=$PWD
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
need_vllm026() {
  if [ ! -d /tmp/site/vllm ]; then
    stamp "install vLLM 0.26 into /tmp/site"
    bash /tmp/vs/install_remote.sh /tmp/vs /tmp/site --with-datasets >/dev/null || { echo "vllm 0.26 install failed"; exit 3; }
  fi
}
make_model() {  # the shared bf16 copy of the built-in model, made with the image's transformers + hybrid_rl
  if [ ! -f "$MODEL_DIR/.peers_model" ]; then
    stamp "model → $MODEL_DIR"
    PYTHONPATH=/tmp/site:$ROOT python3 -c "
import sys; sys.path.insert(0, 'benchmarks/peers')
from workload import WORKLOAD, prepare_model; from pathlib import Path
print(prepare_model(WORKLOAD['model'], Path('$MODEL_DIR')))" || { echo "model preparation failed"; exit 4; }
  fi
}
report() {
  stamp "report"
  PYTHONPATH=$ROOT python3 benchmarks/peers/plot.py --res "$RES" --out-dir "$ROOT/benchmarks/results" || echo "report failed"
  cp "$ROOT"/benchmarks/results/peers_*.json "$ROOT"/benchmarks/results/peers_*.png "$OUT/" 2>/dev/null
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  for f in "$RES"/*stdout.log "$RES"/run_hybrid_rl/stdout.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"; done
}
nvidia-smi -L
case $PART in
hybrid_rl)
  need_vllm026; make_model
  stamp "hybrid_rl x$GPUS"
  PYTHONPATH=/tmp/site:$ROOT VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 480 python3 benchmarks/peers/run_hybrid_rl.py \
    --gpus "$GPUS" --model-dir "$MODEL_DIR" --data "$DATA" --out "$RES" --timeout 450 || echo "hybrid_rl failed"
  ;;
trl)
  need_vllm026; make_model
  if [ ! -d /tmp/site_trl/trl ]; then
    stamp "install trl"; bash benchmarks/peers/install_remote.sh trl /tmp/ps /tmp/site_trl || { echo "trl install failed"; exit 3; }
  fi
  stamp "trl x$GPUS"
  PYTHONPATH=/tmp/site_trl:/tmp/site:$ROOT VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 500 python3 benchmarks/peers/run_trl.py \
    --gpus "$GPUS" --model-dir "$MODEL_DIR" --data "$DATA" --out "$RES" --timeout 470 ${TRL_ARGS:-} || echo "trl failed"
  ;;
verl)
  [ -d /tmp/site/vllm ] || need_vllm026  # only for make_model (the image's transformers + datasets); verl uses /tmp/site_verl
  make_model
  if [ ! -d /tmp/site_verl/verl ]; then
    stamp "install verl (vLLM 0.24, transformers 5.9, ray 2.60)"
    bash benchmarks/peers/install_remote.sh verl /tmp/ps /tmp/site_verl /tmp/vs || { echo "verl install failed"; exit 3; }
  fi
  PYTHONPATH=/tmp/site_verl python3 -c "import verl, vllm, transformers, ray, torch; print('verl', verl.__version__, \
'vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__, 'torch', torch.__version__)"
  stamp "verl x$GPUS"
  # the run's own directory holds verl's outputs; PYTHONPATH reaches the ray workers through their environment
  PYTHONPATH=/tmp/site_verl timeout 520 python3 benchmarks/peers/run_verl.py --gpus "$GPUS" --model-dir "$MODEL_DIR" \
    --data "$DATA" --out "$RES" --timeout 490 ${VERL_ARGS:-} || echo "verl failed"
  ;;
verl_bg)  # verl padded (no flash-attn wheel) needs ~4 min to start and ~130-150 s a step on 1xH100: longer than one
  # 600 s call. Start it detached (it survives the call while the machine stays warm), then call 'verl_wait' until done.
  [ -d /tmp/site/vllm ] || need_vllm026
  make_model
  if [ ! -d /tmp/site_verl/verl ]; then
    stamp "install verl (vLLM 0.24, transformers 5.9, ray 2.60)"
    bash benchmarks/peers/install_remote.sh verl /tmp/ps /tmp/site_verl /tmp/vs || { echo "verl install failed"; exit 3; }
  fi
  stamp "verl x$GPUS, detached"
  PYTHONPATH=/tmp/site_verl setsid nohup python3 benchmarks/peers/run_verl.py --gpus "$GPUS" --model-dir "$MODEL_DIR" \
    --data "$DATA" --out "$RES" --timeout 2400 ${VERL_ARGS:-} > /tmp/peers_verl_bg.log 2>&1 < /dev/null &
  echo "started pid $!; poll with: bash benchmarks/peers/run_all.sh verl_wait"
  exit 0
  ;;
verl_wait)  # wait (up to 560 s) for the detached verl run, then report what it finished
  for _ in $(seq 56); do pgrep -f run_verl.py > /dev/null || break; sleep 10; done
  pgrep -f run_verl.py > /dev/null && { echo "verl still running:"; grep -o "step:[0-9]* " "$RES/verl_stdout.log" 2>/dev/null | tail -1; }
  ;;
report) ;;
*) echo "unknown part $PART (hybrid_rl | trl | verl | verl_bg | verl_wait | report)"; exit 2 ;;
esac
report
stamp "done"
