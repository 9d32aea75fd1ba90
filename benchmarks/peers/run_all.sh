#!/usr/bin/env bash
# On a GPU machine without network access: one framework per invocation, all on one machine, then the combined report.
#   bash benchmarks/peers/run_all.sh PART [GPUS] [--workload grpo|grpo_long|ppo] [--profile tuned|baseline]
#     PART: hybrid_rl | trl | verl       run in the foreground (up to the workload's time limit)
#           queue FW:WORKLOAD ...        run several, one after the other, detached (each writes its result and
#                                        report as it finishes; 'wait' follows the queue), e.g.
#                                        queue 1 hybrid_rl:ppo verl:ppo hybrid_rl:grpo_long trl:grpo_long
#                                        (FW hybrid_rl+NAME: run_hybrid_rl.py --variant NAME)
#           hybrid_rl_bg | trl_bg | verl_bg   start detached (survives the shell), then
#           wait                         wait up to ~9 minutes for the detached run, then report what is finished
#           report                       rebuild the combined report only
#     GPUS default: every visible GPU. The workload and profile also come from PEERS_WORKLOAD / PEERS_PROFILE
#     (defaults grpo / tuned); PEERS_RES names the results folder (default /tmp/peers_res); FW_ARGS (HYBRID_RL_ARGS,
#     TRL_ARGS, VERL_ARGS) add arguments, e.g. "--set liger=off".
# Expects: vLLM 0.26's pieces (benchmarks/offline/stage.sh: .stage/pN/bundle.tar.partNN + bundle.sha256) copied into
# /tmp/vs (PEERS_VS names another folder), installed by benchmarks/offline/install.sh on first use; the peers' staged
# pieces copied into /tmp/ps (benchmarks/peers/stage.sh; trl_c1 before 'trl', every verl_cK before 'verl'; Liger's and
# datasets' wheels are in both). The
# prompts are the GSM8K rows the benchmarks ship (benchmarks/data/gsm8k_train_1k.jsonl; PEERS_DATA names another GSM8K
# jsonl, fields question/answer). Each part installs what it needs once per machine, writes
# /tmp/peers_res/<framework>_<workload>.json, and rebuilds the combined report peers_<device>_<workload>.json + .png in
# $OUT (default /tmp/peers_out) from every framework finished so far, beside copies of the results and log tails
# (benchmarks/publish.py is what copies a report into benchmarks/results/).
# Time: a foreground part must end within one 600 s command, install included, so PEERS_TIMEOUT defaults to 420 s for
# the run (the first part on a fresh machine installs vLLM for ~1-2 minutes first); workloads that take longer run
# detached (PART_bg, then 'wait' until done), with their own longer limit.
set -u
PART=${1:?usage: run_all.sh hybrid_rl|trl|verl|hybrid_rl_bg|trl_bg|verl_bg|queue|wait|report [GPUS] [--workload W] [--profile P] [FW:WORKLOAD ...]}
shift
GPUS=""
QUEUE=()
WORKLOAD=${PEERS_WORKLOAD:-grpo}
PROFILE=${PEERS_PROFILE:-tuned}
while [ $# -gt 0 ]; do
  case $1 in
  --workload) WORKLOAD=$2; shift 2 ;;
  --workload=*) WORKLOAD=${1#*=}; shift ;;
  --profile) PROFILE=$2; shift 2 ;;
  --profile=*) PROFILE=${1#*=}; shift ;;
  *:*) QUEUE+=("$1"); shift ;;
  *) GPUS=$1; shift ;;
  esac
done
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
case $WORKLOAD in
grpo) LIMIT=${PEERS_TIMEOUT:-420} ;;        # foreground: 420 s + install + report fits 600 s; verl needs _bg + wait
grpo_long) LIMIT=${PEERS_TIMEOUT:-2100} ;;  # 6 steps of ~2k-token responses with a 6k tail: run the parts detached (_bg)
ppo) LIMIT=${PEERS_TIMEOUT:-1500} ;;        # 12 steps of 512 prompts x 1 with a critic: detached (_bg)
*) echo "unknown workload $WORKLOAD (grpo | grpo_long | ppo)"; exit 2 ;;
esac
# a detached part is not bound by one 600 s command: grpo gets room for verl's start-up (421 s in all on 1×H200)
case $PART in *_bg|queue*) [ "$WORKLOAD" = grpo ] && LIMIT=${PEERS_TIMEOUT:-900} ;; esac
[ -n "${PEERS_QUEUED:-}" ] && [ "$WORKLOAD" = grpo ] && LIMIT=${PEERS_TIMEOUT:-900}
export PEERS_WORKLOAD=$WORKLOAD
OUT=${OUT:-/tmp/peers_out}
RES=${PEERS_RES:-/tmp/peers_res}
VS=${PEERS_VS:-/tmp/vs}
MODEL_DIR=/tmp/peers_model
DATA=${PEERS_DATA:-$PWD/benchmarks/data/gsm8k_train_1k.jsonl}
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$OUT/peers_${PART}_${WORKLOAD}.log") 2>&1
[ -f "$DATA" ] || { echo "no GSM8K prompts at $DATA: run from the checkout's root or set PEERS_DATA"; exit 2; }
export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
  HYBRID_RL_CACHE=/tmp/hrc TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
ROOT=$PWD
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
need_vllm026() {
  if [ ! -d /tmp/site/vllm ]; then
    stamp "install vLLM 0.26 into /tmp/site (benchmarks/offline/install.sh $VS)"
    bash "$ROOT/benchmarks/offline/install.sh" "$VS" /tmp/site >/dev/null || { echo "vllm 0.26 install failed"; exit 3; }
  fi
}
need_liger() {  # Liger's kernels (tuned profiles) in the site folder $1, from the staged wheel, checked
  [ -d "$1/liger_kernel" ] && return 0
  W=$(ls /tmp/ps/liger_kernel-*.whl 2>/dev/null | head -1)
  if [ -z "$W" ] || ! (cd "$(dirname "$W")" && sha256sum -c --quiet "$ROOT/benchmarks/offline/liger.sha256"); then
    echo "Liger's wheel is not staged in /tmp/ps (benchmarks/peers/stage.sh puts it in trl_c1 and a verl_cK):"
    echo "copy it there, or run with --profile baseline / FW_ARGS='--set liger=off'"; exit 3
  fi
  stamp "install liger-kernel into $1"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "$W" || { echo "liger install failed"; exit 3; }
}
make_model() {  # the shared bf16 copy of the built-in model, made with the image's transformers + hybrid_rl
  if [ ! -f "$MODEL_DIR/.peers_model" ]; then
    stamp "model → $MODEL_DIR"
    PYTHONPATH=/tmp/site:$ROOT python3 -c "
import sys; sys.path.insert(0, 'benchmarks/peers')
from workload import WORKLOADS, prepare_model; from pathlib import Path
print(prepare_model(WORKLOADS['$WORKLOAD']['model'], Path('$MODEL_DIR')))" || { echo "model preparation failed"; exit 4; }
  fi
}
need_verl() {
  [ -d /tmp/site/vllm ] || need_vllm026  # for make_model (hybrid_rl + the image's transformers) and VS/wheels
  [ -d "$VS/wheels" ] || { echo "no $VS/wheels: vLLM 0.26 was installed from another folder; set PEERS_VS"; exit 3; }
  make_model
  if [ ! -d /tmp/site_verl/verl ]; then
    stamp "install verl (vLLM 0.24, transformers 5.9, ray 2.60, liger-kernel)"
    bash benchmarks/peers/install_remote.sh verl /tmp/ps /tmp/site_verl "$VS" || { echo "verl install failed"; exit 3; }
  fi
  [ "$PROFILE" = baseline ] || need_liger /tmp/site_verl
}
need_trl() {
  need_vllm026; make_model
  if [ ! -d /tmp/site_trl/trl ]; then
    stamp "install trl"; bash benchmarks/peers/install_remote.sh trl /tmp/ps /tmp/site_trl || { echo "trl install failed"; exit 3; }
  fi
  [ "$PROFILE" = baseline ] || need_liger /tmp/site_trl
}
need_hybrid_rl() {
  need_vllm026; make_model
  [ "$PROFILE" = baseline ] || need_liger /tmp/site
}
ARGS=(--gpus "$GPUS" --workload "$WORKLOAD" --profile "$PROFILE" --model-dir "$MODEL_DIR" --data "$DATA" --out "$RES")
# the run's own directory holds each framework's outputs; PYTHONPATH reaches verl's ray workers through their environment
run_hybrid_rl() { PYTHONPATH=/tmp/site:$ROOT VLLM_ENABLE_V1_MULTIPROCESSING=0 "$@" python3 benchmarks/peers/run_hybrid_rl.py \
  "${ARGS[@]}" --timeout $((LIMIT - 30)) ${HYBRID_RL_ARGS:-}; }
run_trl() { PYTHONPATH=/tmp/site_trl:/tmp/site:$ROOT VLLM_ENABLE_V1_MULTIPROCESSING=0 "$@" python3 benchmarks/peers/run_trl.py \
  "${ARGS[@]}" --timeout $((LIMIT - 30)) ${TRL_ARGS:-}; }
run_verl() { PYTHONPATH=/tmp/site_verl "$@" python3 benchmarks/peers/run_verl.py "${ARGS[@]}" --timeout $((LIMIT - 30)) \
  ${VERL_ARGS:-}; }
report() {
  stamp "report ($WORKLOAD)"
  PYTHONPATH=$ROOT python3 benchmarks/peers/plot.py --res "$RES" --workload "$WORKLOAD" --out-dir "$OUT" \
    || echo "report failed"
  cp "$RES"/*_"$WORKLOAD".json "$OUT/" 2>/dev/null
  for f in "$RES"/*_"$WORKLOAD"_stdout.log "$RES"/run_hybrid_rl*_"$WORKLOAD"/stdout.log; do
    [ -f "$f" ] && tail -c 200000 "$f" > "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
  done
}
nvidia-smi -L
case $PART in
hybrid_rl|trl|verl)
  "need_$PART"
  stamp "$PART x$GPUS, $WORKLOAD ($PROFILE)"
  "run_$PART" timeout "$LIMIT" || echo "$PART failed"
  ;;
hybrid_rl_bg|trl_bg|verl_bg)  # start detached (the run goes on after this command returns), then run 'wait' until
  # it is done
  FW=${PART%_bg}
  "need_$FW"
  stamp "$FW x$GPUS, $WORKLOAD ($PROFILE), detached"
  "run_$FW" setsid nohup timeout "$LIMIT" > "/tmp/peers_${FW}_bg.log" 2>&1 < /dev/null &
  echo "started pid $!; poll with: bash benchmarks/peers/run_all.sh wait $GPUS --workload $WORKLOAD"
  exit 0
  ;;
queue)  # check every FW:WORKLOAD, then run them one after the other, detached; 'wait' follows the queue
  [ ${#QUEUE[@]} -gt 0 ] || { echo "queue: name the runs, e.g. run_all.sh queue $GPUS hybrid_rl:ppo verl:ppo"; exit 2; }
  for item in "${QUEUE[@]}"; do
    case ${item%%:*} in hybrid_rl|trl|verl) ;;
    hybrid_rl+*) V=${item%%:*}; grep -q "^    \"${V#hybrid_rl+}\": (" "$ROOT/benchmarks/peers/run_hybrid_rl.py" \
      || { echo "queue: unknown hybrid_rl variant in '$item' (hybrid_rl+NAME, NAME a key of VARIANTS in run_hybrid_rl.py)"; exit 2; } ;;
    *) echo "queue: unknown framework in '$item' (hybrid_rl | hybrid_rl+VARIANT | trl | verl)"; exit 2 ;; esac
    case ${item#*:} in grpo|grpo_long|ppo) ;; *) echo "queue: unknown workload in '$item' (grpo | grpo_long | ppo)"; exit 2 ;; esac
    [ "$item" != trl:ppo ] || { echo "queue: trl:ppo cannot run (TRL's GRPO trainer has no critic): leave it out"; exit 2; }
  done
  if [ -f "$RES/queue.pid" ] && kill -0 "$(cat "$RES/queue.pid")" 2>/dev/null; then
    echo "queue: one is running already (pid $(cat "$RES/queue.pid")): follow it with 'run_all.sh wait'"; exit 2
  fi
  : > "$RES/queue.log"
  setsid nohup bash "$ROOT/benchmarks/peers/run_all.sh" queue_run "$GPUS" --profile "$PROFILE" "${QUEUE[@]}" \
    > "$RES/queue_stdout.log" 2>&1 < /dev/null &
  echo $! > "$RES/queue.pid"
  echo "queued ${QUEUE[*]} (pid $!); each writes $RES/<framework>_<workload>.json and its report into $OUT"
  echo "as it finishes; follow with: bash benchmarks/peers/run_all.sh wait $GPUS"
  exit 0
  ;;
queue_run)  # the queue itself: one foreground part after the other (each with its workload's limit)
  for item in "${QUEUE[@]}"; do
    echo "start $item $(date -u +%FT%TZ)" >> "$RES/queue.log"
    FW=${item%%:*}
    VARIANT_ARGS=""
    case $FW in hybrid_rl+*) VARIANT_ARGS="--variant ${FW#hybrid_rl+}"; FW=hybrid_rl ;; esac
    HYBRID_RL_ARGS="${HYBRID_RL_ARGS:-} $VARIANT_ARGS" PEERS_QUEUED=1 bash "$ROOT/benchmarks/peers/run_all.sh" "$FW" \
      "$GPUS" --workload "${item#*:}" --profile "$PROFILE" > /dev/null 2>&1 < /dev/null
    echo "end $item exit $? $(date -u +%FT%TZ)" >> "$RES/queue.log"
  done
  echo "queue done $(date -u +%FT%TZ)" >> "$RES/queue.log"
  exit 0
  ;;
verl_wait|wait)  # wait (up to 560 s) for the detached run or queue, then report what it finished
  busy() { pgrep -f 'benchmarks/peers/run_(hybrid_rl|trl|verl)[.]py' > /dev/null \
           || { [ -f "$RES/queue.pid" ] && kill -0 "$(cat "$RES/queue.pid")" 2>/dev/null; }; }
  for _ in $(seq 56); do busy || break; sleep 10; done
  W=$WORKLOAD
  if [ -f "$RES/queue.log" ]; then
    echo "queue:"; cat "$RES/queue.log"
    CUR=$(awk '/^start /{c=$2} /^end /{c=""} END{print c}' "$RES/queue.log")  # the item running now, if any
    [ -n "$CUR" ] && W=${CUR#*:}
  fi
  if busy; then
    echo "still running:"; tail -c 600 "$RES"/*_"$W"_stdout.log "$RES"/run_hybrid_rl_"$W"/stdout.log 2>/dev/null
  fi
  ;;
report) ;;
*) echo "unknown part $PART (hybrid_rl | trl | verl | hybrid_rl_bg | trl_bg | verl_bg | queue | wait | report)"; exit 2 ;;
esac
report
stamp "done"
