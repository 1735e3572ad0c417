#!/usr/bin/env bash
# The server load benchmark (issue 18) in one go, for a machine with no network: `llaisys serve` against the
# offline llaisys.Engine (same requests, same arrival times) and against `transformers serve` (HF's
# OpenAI-compatible server, in its continuous-batching mode) on the same checkpoint.
#
#   bash bench/serve_check.sh [WHEELS]     WHEELS: folder of the wheels to install offline (default .devdeps/serve)
#
# Steps (STEPS, default all, in this order; a run cut short keeps what the earlier steps wrote):
#   install      pip install --no-index --find-links WHEELS fastapi uvicorn openai httpx (whatever is missing)
#   build        on CUDA without LLAISYS_BUILD_DIR or build/gpu: build the extension in build/gpu (target _core,
#                sm_$CUDA_ARCHS [90]), as bench/gpu_check.sh does
#   llaisys      start `llaisys serve`, wait for /health, run bench/serve_load.py: N requests all at once and
#                N_RATE at RATE requests/s, with token-id prompts (exact lengths) and again with text prompts
#                (what transformers serve takes); then stop it (SIGINT)
#   offline      the token-id runs through llaisys.Engine in one process, once no server holds the device
#   transformers start `transformers serve MODEL --continuous-batching`, run the text runs, stop it
# Environment (defaults in brackets):
#   MODEL [qwen2-0.5b]  a shape (qwen2-0.5b, qwen2-1.5b: random bf16 weights of the real shape and vocabulary;
#                       tiny: for a CPU check), written once to CKPT [/tmp/llaisys-serve-$MODEL]; or an HF
#                       checkpoint directory, which both servers load
#   DEVICE [cuda]  N [256]  N_RATE [32]  RATE [1]  MAX_INPUT_LEN [1024]  MAX_OUTPUT_LEN [1024]
#   TEMPERATURE [0.6]  OUT [./serve-out]  PY [python3]  T_START [300] s to wait for /health  T_RUN [300] s per load run
#   PROCS [8]  client processes of serve_load (--procs: half of the H100 box's 16 cores; the table's client
#              columns say whether the client came near a full core: us of client CPU per token, busiest share)
#   LLAISYS_ARGS, HF_ARGS: more arguments for `llaisys serve` / `transformers serve` (LLAISYS_ARGS=--no-engine-process:
#                       the engine in the server's process, the A/B of the engine process)
#   LLAISYS_BUILD_DIR [build/gpu if it holds a build]: the llaisys extension to use (bench/gpu_check.sh build makes one)
# Writes to $OUT: summary.txt (the table and the targets), results.json (every run), bench.log (serve_load's
# output), llaisys_serve.log, transformers_serve.log, pip.log, build.log.
# On a lent H100 (10 minutes a command): carry .devdeps; if one call cannot hold it all, split the steps, e.g.
# STEPS="install build llaisys offline", then STEPS="install transformers" (a bare machine rewrites the checkpoint).
# The text runs send random common words, about 3 tokens each with the random checkpoints' small tokenizer:
# compare them with each other, not with the token-id runs.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.devdeps/serve}
MODEL=${MODEL:-qwen2-0.5b} DEVICE=${DEVICE:-cuda} N=${N:-256} N_RATE=${N_RATE:-32} RATE=${RATE:-1}
MAX_INPUT_LEN=${MAX_INPUT_LEN:-1024} MAX_OUTPUT_LEN=${MAX_OUTPUT_LEN:-1024} TEMPERATURE=${TEMPERATURE:-0.6}
OUT=${OUT:-$PWD/serve-out} PY=${PY:-python3} T_START=${T_START:-300} T_RUN=${T_RUN:-300} PROCS=${PROCS:-8}
steps=${STEPS:-install build llaisys offline transformers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1
export PYTHONPATH=$PWD/python:${PYTHONPATH:-}
if [ -z "${LLAISYS_BUILD_DIR:-}" ] && ls build/gpu/_core*.so >/dev/null 2>&1; then
  export LLAISYS_BUILD_DIR=$PWD/build/gpu
fi
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
has() { [[ " $steps " == *" $1 "* ]]; }
# One JSON per run, merged into $OUT/results.json after each step (8 files come back at most). Kept in /tmp so
# that a second call on the still-warm machine (STEPS split) reports with the first's runs; the llaisys step
# starts a new set.
RUNS=${RUNS:-/tmp/serve-check-runs-$(basename "$MODEL")}
if has llaisys; then rm -rf "$RUNS"; fi
mkdir -p "$RUNS"
SERVER_PID=""

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# start_server NAME PORT CMD...: runs CMD in the background (its output in $OUT/NAME.log) and waits for /health
start_server() {
  local name=$1 port=$2; shift 2
  log "start $name: $*"
  "$@" >"$OUT/$name.log" 2>&1 &
  SERVER_PID=$!
  local t0=$SECONDS
  until "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)" \
      "http://127.0.0.1:$port/health" >/dev/null 2>&1; do  # python, not curl: the image may lack curl
    if ! kill -0 "$SERVER_PID" 2>/dev/null || ((SECONDS - t0 > T_START)); then
      log "$name did not come up (exited or no /health after ${T_START}s); its log ends:"
      tail -30 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
      stop_server
      return 1
    fi
    sleep 1
  done
  log "$name is up after $((SECONDS - t0)) s"
}

# stop_server: SIGINT (both servers end their requests and exit), then SIGTERM, then SIGKILL. transformers
# serve 5.x does not exit on SIGINT alone: its continuous-batching thread outlives uvicorn's shutdown.
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  local pid=$SERVER_PID sig
  SERVER_PID=""
  for sig in INT TERM KILL; do
    kill -"$sig" "$pid" 2>/dev/null || break
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break 2; sleep 0.5; done
    [ "$sig" = KILL ] || log "pid $pid still running 10 s after SIG$sig"
  done
  wait "$pid" 2>/dev/null
  return 0
}
trap stop_server EXIT

# load NAME ARGS...: one bench/serve_load.py run, its JSON kept as $RUNS/NAME.json
load() {
  local name=$1; shift
  log "serve_load $name: $*"
  timeout "$T_RUN" "$PY" bench/serve_load.py --max-input-len "$MAX_INPUT_LEN" --max-output-len "$MAX_OUTPUT_LEN" \
    --temperature "$TEMPERATURE" --device "$DEVICE" --procs "$PROCS" --json "$RUNS/$name.json" "$@" 2>&1 |
    grep -v Warning | tee -a "$OUT/bench.log" |
    grep -E "^==|output_throughput|ttft_p50|itl_p50|failed|client_cpu_us|client_busiest|/ offline|rror" |
    tee -a "$OUT/summary.txt"
}

# every run so far into results.json (after each step, so a run cut short keeps them); prints the table
report() {
  "$PY" - "$RUNS" "$OUT/results.json" <<'EOF'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))}
json.dump(runs, open(sys.argv[2], "w"), indent=2)
keys = ("output_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "client_cpu_us_per_token",
        "client_busiest_cpu_share")
print(f"{'run':<24} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'failed':>6}"
      f" {'client us/tok':>13} {'busiest':>7}  (times in ms)")
for name, r in runs.items():
    for s in (r[part] for part in ("server", "offline engine") if part in r):
        c = [s.get(k, float("nan")) for k in keys]
        print(f"{name:<24} {c[0]:>10.0f} {c[1]:>9.1f} {c[2]:>9.1f} {c[3]:>8.2f} {c[4]:>8.2f} {s.get('failed', 0):>6}"
              f" {c[5]:>13.1f} {c[6]:>7.2f}")


def get(run, part, key):
    return runs.get(run, {}).get(part, {}).get(key)


http = get("llaisys_ids_all", "server", "output_throughput")
off = get("offline_all", "offline engine", "output_throughput")
if http and off:
    print(f"target 1: llaisys serve output throughput / offline engine's, all at once: {http / off:.1%} (>= 90%)")
http, off = get("llaisys_ids_rate", "server", "ttft_p50_ms"), get("offline_rate", "offline engine", "ttft_p50_ms")
if http is not None and off is not None:
    print(f"target 2: TTFT p50 at the request rate, llaisys serve - offline engine: {http - off:+.1f} ms (<= +5 ms)")
for kind in ("all", "rate"):
    ours = get(f"llaisys_text_{kind}", "server", "output_throughput")
    theirs = get(f"transformers_text_{kind}", "server", "output_throughput")
    if ours and theirs:
        print(f"llaisys serve / transformers serve output throughput, text prompts, {kind}: {ours / theirs:.2f}x")
EOF
}

log "serve_check: MODEL=$MODEL DEVICE=$DEVICE N=$N N_RATE=$N_RATE RATE=$RATE" \
  "lengths<=$MAX_INPUT_LEN/$MAX_OUTPUT_LEN steps: $steps"
command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"

if has install; then
  log "install from $WHEELS (offline)"
  # only what is missing: packages already there that satisfy the requirements stay as they are
  "$PY" -m pip install --no-index --find-links "$WHEELS" fastapi uvicorn openai httpx >"$OUT/pip.log" 2>&1 ||
    { log "pip install failed:"; tail -20 "$OUT/pip.log" | tee -a "$OUT/summary.txt"; exit 1; }
fi
if has build && [[ $DEVICE == cuda* ]] && [ -z "${LLAISYS_BUILD_DIR:-}" ]; then
  log "build the CUDA extension in build/gpu (log: $OUT/build.log)"
  { cmake -S . -B build/gpu -G Ninja -DLLAISYS_CUDA=ON -DLLAISYS_CUDA_ARCHS="${CUDA_ARCHS:-90}" &&
    cmake --build build/gpu -j"$(nproc)" --target _core; } >"$OUT/build.log" 2>&1 ||
    { log "BUILD FAILED"; grep -E "error" -A3 "$OUT/build.log" | head -40 | tee -a "$OUT/summary.txt"; exit 1; }
  export LLAISYS_BUILD_DIR=$PWD/build/gpu
fi
"$PY" -c "import sys, fastapi, uvicorn, transformers, torch; import llaisys
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__,
      'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__); print('llaisys', llaisys.build_info())" 2>&1 |
  tee -a "$OUT/summary.txt"

case $MODEL in
  qwen2-0.5b | qwen2-1.5b | tiny)
    CKPT=${CKPT:-/tmp/llaisys-serve-$MODEL}
    if [ ! -f "$CKPT/config.json" ]; then
      log "write a random $MODEL checkpoint to $CKPT"
      "$PY" bench/serve_load.py --write-checkpoint "$CKPT" --shape "$MODEL" >/dev/null 2>&1 ||
        { log "could not write the checkpoint"; exit 1; }
    fi
    MODEL_PATH=$CKPT ;;
  *) MODEL_PATH=$MODEL ;;
esac
ALL=(-n "$N") AT_RATE=(-n "$N_RATE" --request-rate "$RATE")

if has llaisys; then
  port=$(free_port)
  # shellcheck disable=SC2086  # LLAISYS_ARGS is a list of arguments
  if start_server llaisys_serve "$port" "$PY" -m llaisys.server --model "$MODEL_PATH" --device "$DEVICE" \
      --port "$port" ${LLAISYS_ARGS:-}; then
    url=http://127.0.0.1:$port
    load llaisys_ids_all --url "$url" --model "$MODEL_PATH" "${ALL[@]}"
    load llaisys_ids_rate --url "$url" --model "$MODEL_PATH" "${AT_RATE[@]}"
    load llaisys_text_all --url "$url" --model "$MODEL_PATH" --prompt-format text "${ALL[@]}"
    load llaisys_text_rate --url "$url" --model "$MODEL_PATH" --prompt-format text "${AT_RATE[@]}"
    stop_server
    echo "llaisys serve requests answered 200: $(grep -c " 200 ok " "$OUT/llaisys_serve.log")" |
      tee -a "$OUT/summary.txt"
  fi
  report >/dev/null
fi

if has offline; then
  load offline_all --offline-only --model "$MODEL_PATH" "${ALL[@]}"
  load offline_rate --offline-only --model "$MODEL_PATH" "${AT_RATE[@]}"
  report >/dev/null
fi

if has transformers; then
  port=$(free_port)
  # transformers serve pins the model it is given: requests must name it exactly (the path)
  # shellcheck disable=SC2086
  if start_server transformers_serve "$port" "$PY" -m transformers.cli.transformers serve "$MODEL_PATH" \
      --continuous-batching --device "$DEVICE" --host 127.0.0.1 --port "$port" ${HF_ARGS:-}; then
    url=http://127.0.0.1:$port
    load transformers_text_all --url "$url" --model "$MODEL_PATH" --api transformers "${ALL[@]}"
    load transformers_text_rate --url "$url" --model "$MODEL_PATH" --api transformers "${AT_RATE[@]}"
    stop_server
  fi
fi

log "results"
report | tee -a "$OUT/summary.txt"
log "done"
