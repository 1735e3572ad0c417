#!/usr/bin/env bash
# One GPU round: build with CUDA, run the CUDA tests, the sanitizers on the op tests, and the benchmarks.
# Every log lands in $OUT (default ./gpu-out). Meant for a lent H100/H200 with torch, transformers, nanobind,
# cmake and nvcc installed but no network: wheels/debs the image lacks are carried in .devdeps/
# (gguf wheel; googletest and google-benchmark .debs, unpacked under /tmp).
#   bash bench/gpu_check.sh [build] [test] [quant] [serving] [model] [steady] [stream] [structured] [tp] [nodes] [families] [ab] [breakdown] [opsab] [ncu] [bench] [sanitize] [pack]
#   (default: all but steady, structured, tp, nodes, ab and families, in this order:
#   most important first, so a run cut short still returns the tests and model numbers)
# Per-step time limits (seconds) come from T_TEST, T_MODEL, T_BENCH, T_SAN.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
steps=${*:-build test quant serving model stream breakdown bench sanitize}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # never NVLink multicast on the lent machines
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
has() { [[ " $steps " == *" $1 "* ]]; }
# watch NAME SECONDS CMD...: CMD's output goes to $OUT/NAME.log; past SECONDS it counts as hung: every
# thread's native stack (cuda-gdb) goes to $OUT/NAME_hang.txt and the process is killed.
watch() {
  local name=$1 secs=$2; shift 2
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$! i
  for i in $(seq "$secs"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
  if kill -0 $pid 2>/dev/null; then
    log "$name HUNG after $secs s: native stacks in ${name}_hang.txt"
    timeout 90 cuda-gdb -p $pid -batch -ex "thread apply all bt 25" >"$OUT/${name}_hang.txt" 2>&1
    kill -9 $pid 2>/dev/null
  fi
  wait $pid
}

if [ -d .devdeps ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .devdeps/*.whl 2>/dev/null
  export LLAISYS_TOKENIZER_GGUF=$PWD/.devdeps/tokenizer.gguf  # random GGUFs take their tokenizer from it
  export PYTHONPATH=/tmp/site
  # the server's and jsonschema's wheels, only what is missing (as serve_check.sh installs them): without them the
  # CUDA server tests (the openai client at TP 2) and tests/test_structured_output.py skip on the device
  python3 -m pip install -q --no-index --find-links .devdeps/serve --find-links .devdeps/js fastapi uvicorn openai \
    httpx jsonschema >"$OUT/pip.log" 2>&1 || log "pip install of .devdeps/serve and .devdeps/js failed (pip.log)"
  for f in .devdeps/*.deb; do dpkg -x "$f" /tmp/dd; done
  export LD_LIBRARY_PATH=/tmp/dd/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
export LLAISYS_BUILD_DIR=$PWD/build/gpu
export PYTHONPATH=$PWD/python:${PYTHONPATH:-}

if has build; then
  log "device"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/summary.txt"
  log "build"
  cmake -S . -B build/gpu -G Ninja -DLLAISYS_CUDA=ON -DLLAISYS_CUDA_ARCHS=90 -DLLAISYS_BUILD_TESTS=ON \
    -DLLAISYS_BUILD_BENCH=ON -DCMAKE_PREFIX_PATH=/tmp/dd/usr >"$OUT/build.log" 2>&1 &&
    cmake --build build/gpu -j$(nproc) --target _core bench_ops >>"$OUT/build.log" 2>&1 ||
    { log "BUILD FAILED"; grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
  python3 -c "import llaisys; print(llaisys.build_info(), llaisys.cuda_device_count())" | tee -a "$OUT/summary.txt"
fi
# GGUF_PREP="SHAPE:PRESET": write that random GGUF (bench/random_gguf.py's cache in /tmp, kept while the machine
# stays warm) in the background while the steps run; TP_BIG_GGUF's runs wait for it
prep_pid=
if [ -n "${GGUF_PREP:-}" ]; then
  log "random GGUF ${GGUF_PREP} in the background"
  python3 -c "import sys; sys.path.insert(0, 'bench'); import random_gguf as r; print(r.cached_random_gguf(*sys.argv[1].split(':')))" \
    "$GGUF_PREP" >"$OUT/gguf_prep.log" 2>&1 &
  prep_pid=$!
fi

if has test; then
  log "pytest -m cuda"
  # TESTS narrows the files (default: all of tests/)
  # SIGINT at the limit: pytest still prints its summary (which tests failed) before it stops
  timeout -s INT -k 30 ${T_TEST:-300} python3 -m pytest -q -rfEs -m cuda ${TESTS:-tests} -p no:cacheprovider \
    >"$OUT/pytest_cuda.log" 2>&1
  grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/pytest_cuda.log" | tee -a "$OUT/summary.txt"
  tail -15 "$OUT/pytest_cuda.log" | tee -a "$OUT/summary.txt"
fi

if has structured; then # issue 31: constrained vs free decode, overlap off and on (needs llguidance)
  # STRUCT_BASE=DIR: also run the bench, first, on an older tree's python/ in DIR (e.g. `git archive REV python |
  # tar -x -C .devdeps/base`; same _core and bench/) for a same-call A/B. STRUCT_AB="VAR=value ...": also run this
  # tree's with these variables, before its plain run (e.g. LLAISYS_MASK_LANES=0: the lanes off). STRUCT_OVERLAP
  # (default both), STRUCT_BATCH (default "1 64"), STRUCT_ARGS (e.g. "--profile 25"), MASK_FILL=0 skips
  # bench/mask_fill.py; HOST_PATH=1 adds
  # bench/host_path.py, with --lanes ${HOST_LANES:-4 8 12} (the loop's consumes + the pool against the lanes).
  for py in ${STRUCT_BASE:+$STRUCT_BASE/python} ${STRUCT_AB:+ab:$PWD/python} $PWD/python; do
    vars=""
    case $py in ab:*) py=${py#ab:}; vars=$STRUCT_AB ;; esac
    log "bench/structured.py --shape ${STRUCT_SHAPE:-qwen2-0.5b} (python/ of $py${vars:+, with $vars})"
    env $vars PYTHONPATH=$py:$PYTHONPATH timeout ${T_BENCH:-400} python3 bench/structured.py \
      --shape ${STRUCT_SHAPE:-qwen2-0.5b} --device cuda --batch ${STRUCT_BATCH:-1 64} --repeat 3 \
      --overlap ${STRUCT_OVERLAP:-both} ${STRUCT_ARGS:-} \
      --json "$OUT/structured_$(basename "$(dirname "$py")")${vars:+_ab}.json" 2>&1 | grep -v Warning |
      tee -a "$OUT/summary.txt"
  done
  [ "${MASK_FILL:-1}" = 1 ] && timeout 300 python3 bench/mask_fill.py --shape ${STRUCT_SHAPE:-qwen2-0.5b} --batch 1 16 64 2>&1 |
    grep -v Warning | tee -a "$OUT/summary.txt"
  [ "${HOST_PATH:-0}" = 1 ] && timeout 300 python3 bench/host_path.py --shape ${STRUCT_SHAPE:-qwen2-0.5b} \
    --batch 16 64 --lanes ${HOST_LANES:-4 8 12} 2>&1 | grep -v Warning | tee -a "$OUT/summary.txt"
fi

if has serving; then # the batched engine: one request's decode, then nano-vllm's throughput protocol
  for shape in ${SERVE_SHAPES:-qwen2-0.5b qwen2-1.5b}; do
    log "batched engine, one request, $shape (compare: llaisys bench --shape $shape in 'model')"
    [ -z "${SERVE_SINGLE-1}" ] || timeout 240 python3 bench/throughput.py --shape $shape --device cuda --single 128 256 2>&1 | grep -v Warning |
      grep -E "^(llaisys|one)" | tee -a "$OUT/summary.txt"
    # SERVE_AB: the same protocol first under each setting (space-separated; VAR=v,VAR2=w sets two; e.g.
    # LLAISYS_CHAIN_DROP=0): an A/B in one call against the default run below
    for setting in ${SERVE_AB:-}; do
      vars=$(echo "$setting" | tr ',' ' ')
      log "batched engine throughput, $shape, ${N_REQ:-256} requests, with $vars"
      env $vars timeout ${T_SERVE:-400} python3 bench/throughput.py --shape $shape --device cuda -n ${N_REQ:-256} \
        2>&1 | tee "$OUT/throughput_${shape}_ab_$(echo $setting | tr -cd 'A-Za-z0-9').log" | grep -v Warning |
        grep -E "^(llaisys|batched|fixed|one)|Error|error" | tee -a "$OUT/summary.txt"
    done
    log "batched engine throughput, $shape, ${N_REQ:-256} requests ${PEERS:+(with HF generate_batch)}"
    timeout ${T_SERVE:-400} python3 bench/throughput.py --shape $shape --device cuda -n ${N_REQ:-256} ${PEERS:+--peers} \
      ${SERVE_ARGS:-} 2>&1 | tee "$OUT/throughput_$shape.log" | grep -v Warning | grep -E "^(llaisys|batched|fixed|one)|Error|error" |
      tee -a "$OUT/summary.txt"
  done
fi

if has quant; then # GGUF blocks kept quantized (random Q4_K/Q6_K weights of the 1.5B shape) vs the same shape in bf16
  # QUANT_AB: space-separated VAR=value settings (VAR=v,VAR2=w sets two), each running the protocol first (an A/B
  # in one call, e.g. LLAISYS_QUANT_TC_MAX_ROWS=0 for the dense-copy path); QUANT_SINGLE= skips batch 1
  for types in q4_k_m q8_0; do
    log "quantized ($types) vs bf16, qwen2-1.5b: one request (batch 1), then ${N_REQ:-256} requests"
    [ -z "${QUANT_SINGLE-1}" ] || timeout 300 python3 bench/throughput.py --shape qwen2-1.5b --gguf-types $types --device cuda --single 128 256 2>&1 |
      grep -v Warning | grep -E "^(llaisys|one)|Error|error" | tee -a "$OUT/summary.txt"
    for setting in ${QUANT_AB:-}; do
      log "quantized ($types) protocol with $setting"
      env $(echo "$setting" | tr ',' ' ') timeout ${T_SERVE:-400} python3 bench/throughput.py --shape qwen2-1.5b \
        --gguf-types $types --device cuda -n ${N_REQ:-256} 2>&1 | grep -v Warning |
        grep -E "^(llaisys|batched|fixed|one)|Error|error" | tee -a "$OUT/summary.txt"
    done
    timeout ${T_SERVE:-400} python3 bench/throughput.py --shape qwen2-1.5b --gguf-types $types --device cuda \
      -n ${N_REQ:-256} 2>&1 | grep -v Warning | grep -E "^(llaisys|batched|fixed|one)|Error|error" | tee -a "$OUT/summary.txt"
    [ -n "${QUANT_ONLY_FIRST:-}" ] && break
  done
fi

if has model; then
  for shape in qwen2-0.5b qwen2-1.5b; do
    log "llaisys bench --shape $shape --peers"
    timeout ${T_MODEL:-240} python3 -m llaisys bench --shape $shape --device cuda --prompt-len 128 --new-tokens 256 --peers \
      --json "$OUT/bench_$shape.json" 2>&1 | grep -v Warning | tail -6 | tee -a "$OUT/summary.txt"
  done
  for shape in ${FAMILY_SHAPES:-qwen3-0.6b llama-3.2-1b}; do # the other families' real shapes (no peer builds them)
    log "llaisys bench --shape $shape"
    timeout ${T_MODEL:-240} python3 -m llaisys bench --shape $shape --device cuda --prompt-len 128 --new-tokens 256 \
      --json "$OUT/bench_$shape.json" 2>&1 | grep -v Warning | tail -4 | tee -a "$OUT/summary.txt"
  done
  log "llaisys bench --shape qwen2-1.5b --prompt-len 1024 (TTFT of a 1024-token prompt)"
  timeout 120 python3 -m llaisys bench --shape qwen2-1.5b --device cuda --prompt-len 1024 --new-tokens 16 2>&1 |
    grep -v Warning | grep -E "^llaisys" | tee -a "$OUT/summary.txt"
  log "llaisys bench --shape qwen2-0.5b, LLAISYS_FUSED=0 (A/B of the fused projections)"
  LLAISYS_FUSED=0 timeout ${T_MODEL:-240} python3 -m llaisys bench --shape qwen2-0.5b --device cuda --prompt-len 128 \
    --new-tokens 256 --json "$OUT/bench_unfused.json" 2>&1 | grep -v Warning | tail -4 | tee -a "$OUT/summary.txt"
fi
if has steady; then # issue 33: steady decode of B rows x 600 cached tokens against a static-batch torch.compile model
  for shape in ${STEADY_SHAPES:-qwen2-0.5b qwen2-1.5b}; do
    log "bench/steady_decode.py --shape $shape --batch ${STEADY_BATCH:-64 256}"
    timeout ${T_STEADY:-300} python3 bench/steady_decode.py --shape $shape --device cuda --batch ${STEADY_BATCH:-64 256} --peer-timeout ${T_PEER:-600} ${STEADY_ARGS:-} \
      --json "$OUT/steady_$shape.json" 2>&1 | tee "$OUT/steady_$shape.log" | grep -v Warning |
      grep -E "^\||Error|error|failed|Segmentation" | tee -a "$OUT/summary.txt"
  done
fi
if has stream; then # StreamingLLM (issue 32): decode after 32k tokens with a 4k window vs at 4k context (>= 0.95x)
  if [ "${STREAM_SPEED:-1}" = 1 ]; then
  log "bench/streaming_speed.py --shape qwen2-0.5b --window 4096 --generated 32768"
  timeout ${T_STREAM:-400} python3 bench/streaming_speed.py --shape qwen2-0.5b --device cuda --window 4096 \
    --generated 32768 --measure 256 2>&1 | grep -v Warning | tail -4 | tee -a "$OUT/summary.txt"
  fi
  log "bench/streaming_rotation_cost.py (K-shift per evicted block vs keys rotated inside attention)"
  timeout 60 python3 bench/streaming_rotation_cost.py --device cuda --window 1024 4096 2>&1 | grep -v Warning |
    tail -5 | tee -a "$OUT/summary.txt"
fi
if has nodes; then # issue 30 across hosts, as 2 processes of NODE_GPUS GPUs each on one host (default: half the GPUs)
  log "pytest -m cuda tests/test_nodes.py (a hang records every thread's stack)"
  watch pytest_nodes ${T_TP:-240} python3 -m pytest -v -x -rs -m cuda -o faulthandler_timeout=120 tests/test_nodes.py \
    -p no:cacheprovider
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" "$OUT/pytest_nodes.log" | tail -20 | tee -a "$OUT/summary.txt"
  shape=${TP_SHAPE:-qwen2-7b}
  per=${NODE_GPUS:-$(( $(nvidia-smi -L | wc -l) / 2 ))}; tp=$((2 * per))
  # the 2-process runs plain and chained (LLAISYS_OVERLAP=1: launches not answered before node 0 goes on), then
  # one process
  for env in LLAISYS_OVERLAP=0 LLAISYS_OVERLAP=1; do
    log "llaisys bench --shape $shape -tp $tp --nnodes 2 (2 processes of $per GPUs), $env"
    common="--shape $shape --prompt-len 128 --new-tokens 256 -tp $tp --nnodes 2 --master-port 29517"
    env $env timeout ${T_MODEL:-240} python3 -m llaisys bench $common --device cuda:$per --node-rank 1 \
      >"$OUT/bench_nodes_1.log" 2>&1 &
    node1=$!  # (a bare wait would also wait for GGUF_PREP's writer)
    env $env timeout ${T_MODEL:-240} python3 -m llaisys bench $common --device cuda:0 --node-rank 0 \
      --json "$OUT/bench_nodes_${env#*=}.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/summary.txt"
    wait $node1
    tail -3 "$OUT/bench_nodes_1.log" | tee -a "$OUT/summary.txt"
  done
  timeout ${T_MODEL:-240} python3 -m llaisys bench --shape $shape --device cuda --prompt-len 128 --new-tokens 256 \
    -tp $tp --json "$OUT/bench_tp$tp.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/summary.txt"
fi
if has tp; then # tensor parallelism (issue 30): the CUDA tests, then batch-1 decode and the throughput protocol
  # of the 7B shape at 1 and TP_SIZES ranks on this machine (same call: compare within it)
  if [ "${TP_SMOKE:-2}" != 0 ]; then # TP_SMOKE=0 leaves it out
    log "tp_smoke (stage by stage, f32: tokens must equal one GPU's; a hang records every thread's stack)"
    watch tp_smoke 120 python3 bench/tp_smoke.py --tp ${TP_SMOKE:-2}
    grep -E "tp_smoke|Error|error" "$OUT/tp_smoke.log" | head -10 | tee -a "$OUT/summary.txt"
  fi
  if [ "${TP_TESTS:-1}" = 1 ]; then # TP_TESTS=0 leaves them out
  log "pytest -m cuda tests/test_tensor_parallel.py tests/test_comm.py"
  watch pytest_tp ${T_TP:-420} python3 -m pytest -v -x -m cuda -o faulthandler_timeout=60 \
    tests/test_tensor_parallel.py tests/test_comm.py -p no:cacheprovider
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/pytest_tp.log" | tail -30 | tee -a "$OUT/summary.txt"
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then # the push kernel is opt-in past 2 ranks: the model tests with it
    log "pytest -m cuda tests/test_tensor_parallel.py -k 'gpus and 4', LLAISYS_PEER_ALLREDUCE_PUSH=1"
    watch pytest_tp_push4 ${T_TP:-420} env LLAISYS_PEER_ALLREDUCE_PUSH=1 python3 -m pytest -v -x -m cuda \
      -o faulthandler_timeout=60 tests/test_tensor_parallel.py -k "gpus and 4" -p no:cacheprovider
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_tp_push4.log" | tail -8 | tee -a "$OUT/summary.txt"
  fi
  fi
  if [ "${TP_BENCH:-1}" = 1 ]; then
  log "all-reduce alone: 2 per layer of a decode step"
  timeout 300 python3 bench/all_reduce.py --shape ${TP_SHAPE:-qwen2-7b} --world ${TP_SIZES:-2} --batch ${AR_BATCH:-1 16 64 256} 2>&1 |
    tail -9 | tee -a "$OUT/summary.txt"
  for tp in 1 ${TP_SIZES:-2}; do
    log "llaisys bench --shape ${TP_SHAPE:-qwen2-7b} --tensor-parallel-size $tp"
    timeout ${T_MODEL:-240} python3 -m llaisys bench --shape ${TP_SHAPE:-qwen2-7b} --device cuda \
      --prompt-len 128 --new-tokens 256 -tp $tp --json "$OUT/bench_tp$tp.json" 2>&1 | grep -v Warning | tail -3 |
      tee -a "$OUT/summary.txt"
  done
  for tp in ${TP_SIZES:-2}; do # A/B against the default: the other peer kernel (push is the default at 2 ranks
    # only), NCCL alone (no peer path); steps not chained
    other=$([ "$tp" = 2 ] && echo LLAISYS_PEER_ALLREDUCE_PUSH=0 || echo LLAISYS_PEER_ALLREDUCE_PUSH=1)
    for env in ${TP_AB:-$other LLAISYS_PEER_ALLREDUCE=0 LLAISYS_OVERLAP=0}; do
      log "llaisys bench --shape ${TP_SHAPE:-qwen2-7b} --tensor-parallel-size $tp, $env"
      env $env timeout ${T_MODEL:-240} python3 -m llaisys bench --shape ${TP_SHAPE:-qwen2-7b} --device cuda \
        --prompt-len 128 --new-tokens 256 -tp $tp 2>&1 | grep -v Warning | grep -E "^llaisys" | tee -a "$OUT/summary.txt"
    done
  done
  fi
  for tp in ${TP_BIG:-}; do # the 72B shape (145 GB in bf16: 4 GPUs at least), batch-1 decode
    log "llaisys bench --shape qwen2-72b --tensor-parallel-size $tp"
    timeout ${T_BIG:-420} python3 -m llaisys bench --shape qwen2-72b --device cuda --prompt-len 128 --new-tokens 128 \
      -tp $tp --json "$OUT/bench_72b_tp$tp.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/summary.txt"
  done
  for tp in ${TP_BIG_GGUF:-}; do # the 72B shape in Q4_K_M (51 GB: fits one H200), batch-1 decode
    [ -n "$prep_pid" ] && { wait $prep_pid; tail -2 "$OUT/gguf_prep.log" | tee -a "$OUT/summary.txt"; prep_pid=; }
    log "llaisys bench --shape qwen2-72b --gguf-types q4_k_m --tensor-parallel-size $tp"
    timeout ${T_BIG:-420} python3 -m llaisys bench --shape qwen2-72b --gguf-types q4_k_m --device cuda --prompt-len 128 \
      --new-tokens 128 -tp $tp --json "$OUT/bench_72b_q4km_tp$tp.json" 2>&1 | grep -v Warning | tail -3 |
      tee -a "$OUT/summary.txt"
  done
  for tp in ${TP_THROUGHPUT:-}; do
    log "throughput ${TP_SHAPE:-qwen2-7b}, ${N_REQ:-256} requests, tensor parallel $tp"
    timeout ${T_SERVE:-400} python3 bench/throughput.py --shape ${TP_SHAPE:-qwen2-7b} --device cuda \
      -n ${N_REQ:-256} -tp $tp 2>&1 | grep -v Warning | grep -E "^(llaisys|batched|fixed|one)|Error|error" |
      tee -a "$OUT/summary.txt"
  done
fi
if has families; then # batch-1 decode of every family's real shape, random bf16 weights (share of copy roofline)
  # FAMILY_ENVS: space-separated settings (VAR=value, or - for the default), each run back to back per shape (an A/B);
  # FAMILY_ROUNDS=N repeats them N times, alternating (single runs moved +-5% in session 41: one run settles nothing)
  for shape in ${FAMILY_SHAPES:-qwen2-0.5b qwen2-1.5b qwen3-0.6b llama-3.2-1b pythia-1.4b gemma-3-1b}; do
    for setting in $(for r in $(seq ${FAMILY_ROUNDS:-1}); do echo ${FAMILY_ENVS:--}; done); do
      vars=$setting; [ "$vars" = - ] && vars=
      log "llaisys bench --shape $shape ${vars:-(default)}"
      env $vars timeout ${T_MODEL:-150} python3 -m llaisys bench --shape $shape --device cuda --prompt-len 128 \
        --new-tokens 256 --json "$OUT/bench_${shape}_$(echo ${vars:-default} | tr -d ' =')_$(date +%s).json" 2>&1 | grep -v Warning |
        tail -2 | tee -a "$OUT/summary.txt"
    done
  done
fi
if has ab; then # A/B of the switches, no peers: default, LLAISYS_PDL=0, LLAISYS_FUSED=0
  for shape in qwen2-0.5b qwen2-1.5b; do
    for env in "" LLAISYS_PDL=0 LLAISYS_FUSED=0; do
      log "llaisys bench --shape $shape ${env:-(default)}"
      env $env timeout 120 python3 -m llaisys bench --shape $shape --device cuda --prompt-len 128 --new-tokens 256 \
        2>&1 | grep -v Warning | grep -E "^llaisys" | tee -a "$OUT/summary.txt"
    done
  done
fi
if has breakdown; then # per-kernel time of a decode step of the batched engine (PDL off: durations add up)
  # BREAKDOWNS: the runs, ';'-separated (default: both shapes in bf16, the 1.5B Q4_K_M GGUF, 0.5B at batch 256)
  IFS=';' read -ra runs <<<"${BREAKDOWNS:---shape qwen2-0.5b;--shape qwen2-1.5b;--shape qwen2-1.5b --gguf-types q4_k_m;--shape qwen2-0.5b --batch 256 --steps 8}"
  # BREAKDOWN_ENVS: space-separated VAR=value settings, each run of every BREAKDOWNS entry (an A/B; default: none)
  for args in "${runs[@]}"; do
    for setting in ${BREAKDOWN_ENVS:-LLAISYS_PDL=0}; do
      log "decode breakdown $args ($setting)"
      env LLAISYS_PDL=0 $setting timeout 180 python3 bench/decode_breakdown.py $args \
        --json "$OUT/breakdown_$(echo $args $setting | tr -d ' =-').json" 2>&1 | grep -v Warning | head -${BREAKDOWN_LINES:-24} |
        tee -a "$OUT/summary.txt"
    done
  done
fi
if has opsab; then # bench_ops rows (OPS_FILTER) under each OPS_AB setting (space-separated; VAR=v,VAR2=w sets two;
  # "-" is the default environment): a kernel A/B in one call
  for setting in ${OPS_AB:--}; do
    vars=$(echo "$setting" | tr ',' ' '); [ "$vars" = - ] && vars=
    log "bench_ops --benchmark_filter=${OPS_FILTER:-paged_decode} ${vars:-(default)}"
    env $vars timeout ${T_BENCH:-200} build/gpu/bench_ops --benchmark_filter="${OPS_FILTER:-paged_decode}" \
      --benchmark_min_time=0.05 2>&1 | grep -E "^Attention|^[A-Za-z].*/" | cut -c1-150 | tee -a "$OUT/summary.txt"
  done
fi
if has ncu; then # Nsight Compute's full section set of one launch per NCU_CASES entry "bench_ops filter|kernel regex"
  # (';'-separated), text in ncu_N.txt and its headline rows in the summary; clocks left alone (METHOD.md)
  i=0
  IFS=';' read -ra cases <<<"${NCU_CASES:-Sample/bf16/rows:256/V:151936/t:0.6|sample_kernel}"
  for c in "${cases[@]}"; do
    i=$((i + 1)); filt=${c%%|*}; kern=${c##*|}
    log "ncu $kern in bench_ops $filt"
    timeout ${T_NCU:-180} "${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}" --clock-control none --set full -k "regex:$kern" --launch-skip ${NCU_SKIP:-30} --launch-count 1 \
      build/gpu/bench_ops --benchmark_filter="$filt" --benchmark_min_time=0.01 >"$OUT/ncu_$i.txt" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Waves Per SM|Block Limit|One or More Eligible|Issued Warp|No Eligible|L2 Hit Rate|Executed Ipc A" \
      "$OUT/ncu_$i.txt" | head -40 | tee -a "$OUT/summary.txt"
  done
fi
if has bench; then
  log "bench_ops"
  timeout ${T_BENCH:-200} build/gpu/bench_ops --benchmark_filter="${BENCH_FILTER:-CUDA|Cuda|cuda|Ceiling}" --benchmark_min_time=0.05 \
    --benchmark_out="$OUT/bench_ops.json" --benchmark_out_format=json >"$OUT/bench_ops.txt" 2>&1
  tail -60 "$OUT/bench_ops.txt" | cut -c1-160 >>"$OUT/summary.txt"
fi
if has bench && [ -z "${BENCH_FILTER:-}" ]; then # BENCH_FILTER narrows the step to those bench_ops rows
  log "attention vs SDPA"
  timeout 120 python3 bench/attention_vs_sdpa.py 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
  log "torch F.linear at M = 1 from a CUDA graph (compare with Linear/cuda_graph above)"
  timeout 120 python3 bench/linear_vs_torch.py 2>&1 | tail -14 | tee -a "$OUT/summary.txt"
  log "argmax vs torch.max / torch.argmax"
  timeout 120 python3 bench/argmax_vs_torch.py 2>&1 | tail -7 | tee -a "$OUT/summary.txt"
fi

if has sanitize; then
  # One compute-sanitizer process per (tool, op test file), all at once (SAN_JOBS at most): they share
  # the GPU, and most of their time is host-side. SAN_TESTS narrows the files (default: every op test).
  # racecheck of the sampling tests runs one process per test: its statistical tests draw thousands of
  # samples and take 4-5 minutes each under racecheck (give this step its own call, T_SAN=500).
  log "compute-sanitizer memcheck and racecheck (op tests, one process per file; sampling racecheck per test)"
  export OUT T_SAN=${T_SAN:-240}
  for tool in memcheck racecheck; do
    for f in ${SAN_TESTS:-tests/test_ops_*.py tests/test_tensor.py}; do
      if [ "$tool" = racecheck ] && [ "$f" = tests/test_ops_sampling.py ]; then
        python3 -m pytest -q --collect-only -m cuda "$f" -p no:cacheprovider | grep "::" | sed "s/^/$tool /"
      else echo "$tool $f"; fi
    done
  done | xargs -P "${SAN_JOBS:-32}" -L1 bash -c '
    tool=$0 f=$1 log="$OUT/sanitize_${0}_$(basename "$1" | sed "s/\.py//; s/[^A-Za-z0-9_.-]/_/g").log"
    # memcheck with the caching allocator off: an access past a tensor is then past its cudaMalloc. It
    # also reports failed CUDA API calls, so the test that runs out of device memory on purpose is left out.
    # racecheck leaves out the cases that run cuBLASLt (mark `cublas`): the sm90 kernels of cuBLAS report
    # hazards by themselves (the cublas_racecheck line below: torch alone), and excluding them by kernel
    # name makes the sanitizer fail with an internal error.
    skip=() sel=cuda
    if [ "$tool" = memcheck ]; then export LLAISYS_CUDA_ALLOC=exact; skip=(-k "not out_of_memory"); fi
    if [ "$tool" = racecheck ]; then sel="cuda and not cublas"; fi
    timeout "$T_SAN" compute-sanitizer --tool "$tool" --print-limit 20 python3 -m pytest -q -m "$sel" "$f" \
      "${skip[@]}" -p no:cacheprovider >"$log" 2>&1
    rc=$?
    echo "$tool $(basename "$f"): rc=$rc | $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 | sed "s/=* *//") |" \
      "$(grep -E "passed|failed|error" "$log" | grep -v SUMMARY | tail -1)"' | sort | tee -a "$OUT/summary.txt"
  log "racecheck of cuBLAS alone (torch F.linear on the cublas-marked shapes; no llaisys code)"
  timeout 240 compute-sanitizer --tool racecheck --print-limit 20 python3 bench/cublas_racecheck.py \
    >"$OUT/sanitize_racecheck_cublas_alone.log" 2>&1
  grep -E "RACECHECK SUMMARY|cublas_racecheck:" "$OUT/sanitize_racecheck_cublas_alone.log" | tee -a "$OUT/summary.txt"
fi

log "done"
if has pack; then # last: every file of $OUT into logs.tar.gz beside summary.txt (the device's `run` brings back at most 8
  # files: in session 41 the summary itself was left out behind eight JSON files)
  tar czf /tmp/logs.tar.gz -C "$OUT" --exclude summary.txt . && find "$OUT" -mindepth 1 ! -name summary.txt -delete &&
    mv /tmp/logs.tar.gz "$OUT/logs.tar.gz"
fi
