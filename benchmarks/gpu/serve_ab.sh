#!/usr/bin/env bash
# The served A/B on one GPU (README.md, "The served A/B"): `vllm serve` stock and/or with
# --attention-backend CUSTOM on the Llama-3-8B shape (dummy bf16 weights), then `vllm bench serve`
# over the workloads below, KV usage and load sampled from /metrics and NVML meanwhile.
#   bash benchmarks/gpu/serve_ab.sh stock|custom [WORKLOAD ...]   # one system, round ROUND
#   bash benchmarks/gpu/serve_ab.sh pair [WORKLOAD ...]           # both, ABBA, in one run
# WORKLOADs default to all, in this order: random prefix1x2k prefix1x2k_c128 prefix1x2k_c256
# prefix4x2k n8x1k tree. `pair` starts both servers at once (each with a fixed KV pool,
# PAIR_KV_BYTES, so both fit on one GPU), then runs each workload stock, custom, custom, stock:
# rounds ROUND and ROUND+1 of each system, the second with --seed 1 (other prompts, so no prefix
# cached by the first round serves it). One server start per system instead of one per round:
# a start takes 95-145 s on an H100.
# Needs vLLM for CUDA (pip install "vllm-chunkattn[cuda]"), or the offline bundle installed
# (offline/README.md). $OUT gets, per round, summary_<tag>.md, server_<tag>.log and
# results_<tag>.tar.gz (bench JSONs, bench logs, load samples); tag = <system>-r<round> (ROUND=1
# by default). A pair's rounds share their server: server_<system>.log once (the report reads it
# for each round) and one summary.md, so a pair writes 7 files (a log and a summary a round
# would make 12).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
MODE=${1:?stock, custom or pair}; shift
case $MODE in
  stock|custom) SYSTEMS=("$MODE") ;;
  pair) SYSTEMS=(stock custom) ;;
  *) echo "system: stock, custom or pair" >&2; exit 2 ;;
esac
WORKLOADS=("$@"); [ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(random prefix1x2k prefix1x2k_c128 prefix1x2k_c256 prefix4x2k n8x1k tree)
TIME_LIMIT_S=${TIME_LIMIT_S:-540}            # the whole script ends within it (9 minutes)
STOP_S=45                                    # kept for stopping the servers (<= 30 s) and the report
[ "$MODE" = pair ] && STOP_S=60              # (four rounds' reports)
# A server takes 95-145 s to start on an H100, a workload 30-60 s: under MIN_TIME_LIMIT_S no
# workload would run (a 200 s limit spent 158 s on a start and ran nothing), so none is started.
# A pair runs a workload 4 times.
[ "$MODE" = pair ] && MIN_DEFAULT=360 || MIN_DEFAULT=240
MIN_TIME_LIMIT_S=${MIN_TIME_LIMIT_S:-$MIN_DEFAULT}
[ "$TIME_LIMIT_S" -ge "$MIN_TIME_LIMIT_S" ] || {
  echo "TIME_LIMIT_S=$TIME_LIMIT_S is under MIN_TIME_LIMIT_S=$MIN_TIME_LIMIT_S (server start ~150 s" \
       "+ a workload + stop): $MODE not started" >&2; exit 3; }
R=${ROUND:-1}
OUT=${OUT:-/tmp/serve_ab_out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/models/llama-3-8b}
VLLM=${VLLM:-vllm}                           # the CLI (a wrapper for a CPU dry run)
N=${NUM_PROMPTS:-64}; OUT_LEN=${OUTPUT_LEN:-256}   # smaller for a dry run
# A pair's KV pools: 18 GiB each (147,456 tokens of the 8B shape; prefix1x2k_c256 holds at most
# 108,544): two servers of 15 GiB weights + ~3 GiB activations and graphs + that fit an H100's
# 79 GiB. --gpu-memory-utilization is then only vLLM's start-up check that this much is free,
# which the second server must pass beside the first.
PAIR_KV_BYTES=${PAIR_KV_BYTES:-$((18 << 30))}
PAIR_GPU_UTIL=${PAIR_GPU_UTIL:-0.40}
# vLLM's front end, the same for both systems. One API server process streams every token of
# every request: at 256 concurrent on an H100 it ran at 92-102 % of a core for the whole decode
# (GIL-bound), at ~10K tokens/s, so the front end, not the engine, may set the throughput. A
# stream message every 8th token (the first at once; the default here) sends 8 times fewer
# messages to the client; TPOT and output tok/s are measured the same way. One API server still
# ran at 100-107 % so on an H200 (prefix1x2k_c256: 1.01x at the client for an engine 1.35x
# faster, gpu_h200.md): FRONTEND_ARGS="--stream-interval 8 --api-server-count 4" spreads it over
# 4 processes. vLLM 0.32 then turns its logging stat loggers off, and with them the per-step log
# the report's engine steps come from (the engine ITL stays; the sampler reads the busiest API
# server). FRONTEND_ARGS= (empty): a stream message per token.
FRONTEND_ARGS=${FRONTEND_ARGS---stream-interval 8}
# The checkout's plugin is what runs; vLLM installed from the offline bundle: its site first.
if bash benchmarks/gpu/offline/install_bundle.sh installed; then
  eval "$(bash benchmarks/gpu/offline/install_bundle.sh env)"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# Knobs run_on_device.sh's GPU tests settled on this host (CHUNKATTN_OVERLAP_FINAL=0).
# shellcheck disable=SC1090
[ -f "${KNOBS_ENV:-/tmp/chunkattn_knobs.env}" ] && . "${KNOBS_ENV:-/tmp/chunkattn_knobs.env}"
# Dummy weights: nothing to fetch. Both systems sample with vLLM's PyTorch sampler (its V2 model
# runner would otherwise import FlashInfer's, where installed, for one of them alike).
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
bash benchmarks/gpu/detached_bench.sh wait   # vLLM reserves most of the GPU: not beside a bench
export PYTHONUNBUFFERED=1

PY=${PYTHON:-python3}                        # the image's python (torch, transformers)
[ -f "$MODEL/config.json" ] || $PY -m vllm_chunkattn.bench.model_shapes --out /tmp/models llama-3-8b
TREE=/tmp/models/tree_1024_4x512_16.jsonl    # system 1024 -> 4 documents of 512 -> 16 questions
mkdir -p /tmp/models
[ -f $TREE ] || $PY -c "
from pathlib import Path
from vllm_chunkattn.bench.ab_workloads import tree, write_tree_jsonl
from vllm_chunkattn.tiny_model import SPECIAL, vocabulary
words = [w for w in vocabulary() if w not in SPECIAL]       # one token each
write_tree_jsonl(tree(1024, 4, 512, 16), Path('$TREE'), words)"

# 64 requests, 32 at a time (the goal's "2K shared x >= 32 concurrent"), 256 output tokens each
# (--ignore-eos: dummy weights would otherwise stop at random); the tree's outputs are 128-512.
# prefix1x2k_c128: the same prompts, 4x as many, 128 at a time. At 32 the 8B shape's decode step
# reads 15 GB of weights beside ~10 GB of KV, so even free attention gives at most ~1.5x
# there; at 128 an H100 measured 1.24x, the rest of
# the step being ~9-10 ms for both; prefix1x2k_c256: 8x the prompts, 256 at a time.
# JSON without spaces: the flags are word-split.
COMMON=(--num-prompts "$N" --max-concurrency 32 --ignore-eos)
prefix_repetition() {   # number of 2048-token prefixes, then the load's flags
  local k=$1; shift
  echo --dataset-name prefix_repetition --prefix-repetition-prefix-len 2048 \
       --prefix-repetition-suffix-len 160 --prefix-repetition-num-prefixes "$k" \
       --prefix-repetition-output-len "$OUT_LEN" "$@"
}
workload() {
  case $1 in
    random)     echo --dataset-name random --random-input-len 2208 --random-output-len "$OUT_LEN" \
                     --random-range-ratio 0 "${COMMON[@]}" ;;
    prefix1x2k) prefix_repetition 1 "${COMMON[@]}" ;;
    prefix1x2k_c128)
                prefix_repetition 1 --num-prompts $((4 * N)) --max-concurrency 128 --ignore-eos ;;
    prefix1x2k_c256)
                prefix_repetition 1 --num-prompts $((8 * N)) --max-concurrency 256 --ignore-eos ;;
    prefix4x2k) prefix_repetition 4 "${COMMON[@]}" ;;
    n8x1k)      echo --dataset-name random --random-input-len 1024 --random-output-len "$OUT_LEN" \
                     --random-range-ratio 0 --num-prompts $((N / 4)) --max-concurrency 4 \
                     --ignore-eos \
                     --extra-body '{"n":8,"temperature":1.0}' ;;
    tree)       echo --dataset-name custom --dataset-path $TREE --skip-chat-template \
                     --custom-output-len "${OUTPUT_LEN:--1}" "${COMMON[@]}" ;;
    *) echo "unknown workload $1" >&2; return 1 ;;
  esac
}

up() { $PY -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
       "$1" 2> /dev/null; }                  # no curl needed on the image
# A run's edges in its server's log (its access log line, in order with the step lines).
mark() { up "$1/health?serve_ab=$2.$3" || true; }   # URL, run, start|end
free_port() {   # a fresh port per server: one left by an earlier run can never answer for this
  $PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
stop() {   # $1: our server's pid: SIGINT (vLLM's clean shutdown), then SIGKILL after 30 s for
           # what is left of its process tree (the engine core too); "leftover": an earlier
           # run's server or client, killed at once (a server still starting ignores SIGINT)
  $PY - "$1" "$MODEL" <<'PY'
import contextlib, psutil, signal, sys
what, model = sys.argv[1:3]
grace = 0 if what == "leftover" else 30
if what == "leftover":
    roots = [p for p in psutil.process_iter(["cmdline"]) if model in (p.info["cmdline"] or [])
             and any(a.endswith("serve") for a in p.info["cmdline"])]
    if roots:
        print("stopping what an earlier run left running:", [r.pid for r in roots])
else:
    roots = [p for p in psutil.process_iter() if p.pid == int(what)]
procs = list(roots)
for r in roots:
    with contextlib.suppress(psutil.NoSuchProcess):
        procs += r.children(recursive=True)
        if grace:
            r.send_signal(signal.SIGINT)
for q in psutil.wait_procs(procs, timeout=grace)[1]:
    with contextlib.suppress(psutil.NoSuchProcess):
        q.kill()
        if grace:
            print(f"killed {q.pid} (still there {grace} s after SIGINT)")
psutil.wait_procs(procs, timeout=10)
PY
}
# A server (or client) left by an earlier run cut at its time limit would hold GPU memory.
stop leftover

# Per system: its server's URL, pid, log, and a folder for what is the server's, not a round's
# (the sampler's kv.tsv, `current`: the mark of the run in flight, sharing counters' JSON).
declare -A URL SERVER LOG HOME_DIR
# --enable-logging-iteration-details: vLLM logs every step's batch, KV usage and wait for the
# GPU (bench/serve_steps.py reads them between bench()'s marks), for both systems alike.
start_server() {
  local s=$1 port args
  port=${PORT:-$(free_port)}; unset PORT     # PORT: the first server's only
  args=(--load-format dummy --dtype bfloat16 --max-model-len 4096 --port "$port"
        --enable-logging-iteration-details)
  if [ "$MODE" = pair ]; then
    args+=(--gpu-memory-utilization "$PAIR_GPU_UTIL" --kv-cache-memory-bytes "$PAIR_KV_BYTES")
    LOG[$s]=$OUT/server_$s.log               # both rounds'
  else
    args+=(--gpu-memory-utilization 0.90)
    LOG[$s]=$OUT/server_$s-r$R.log
  fi
  [ "$s" = custom ] && args+=(--attention-backend CUSTOM)
  # shellcheck disable=SC2206   # flags, word-split
  args+=($FRONTEND_ARGS)
  # e.g. EXTRA_SERVER_ARGS='--compilation-config {"cudagraph_mode":"PIECEWISE"}' to take attention
  # out of the decode graphs if FULL graphs misbehave (word-split: no spaces inside the JSON).
  # shellcheck disable=SC2206
  args+=(${EXTRA_SERVER_ARGS:-})
  URL[$s]=http://127.0.0.1:$port
  HOME_DIR[$s]=/tmp/serve_ab/$s-server; rm -rf "${HOME_DIR[$s]}"; mkdir -p "${HOME_DIR[$s]}"
  echo "== $s: vllm serve $MODEL ${args[*]}"
  # For the report (python -m vllm_chunkattn.bench.serve_ab_report): the command and the GPU.
  echo "vllm serve $MODEL ${args[*]}" > "${HOME_DIR[$s]}/server_cmd.txt"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "${HOME_DIR[$s]}/gpu.txt" 2> /dev/null
  echo idle > "${HOME_DIR[$s]}/current"
  CHUNKATTN_STATS_FILE=${HOME_DIR[$s]}/chunkattn_stats.json "$VLLM" serve "$MODEL" "${args[@]}" \
    > "${LOG[$s]}" 2>&1 &
  SERVER[$s]=$!
}
t0=$SECONDS
for s in "${SYSTEMS[@]}"; do start_server "$s"; done   # a pair starts at once: one wait for both
# A pair whose one server dies at start goes on with the other (its rounds are worth the time
# its start took), and the script then exits 1.
ALIVE=()
for s in "${SYSTEMS[@]}"; do
  until up "${URL[$s]}/health"; do
    kill -0 "${SERVER[$s]}" 2> /dev/null || {
      echo "$s server died:"; tail -40 "${LOG[$s]}"; continue 2; }
    [ $((SECONDS + STOP_S)) -lt "$TIME_LIMIT_S" ] || {
      echo "$s server not up after $((SECONDS - t0)) s (TIME_LIMIT_S $TIME_LIMIT_S)"
      for q in "${SYSTEMS[@]}"; do stop "${SERVER[$q]}"; done; exit 1; }
    sleep 2
  done
  echo "$s server up in $((SECONDS - t0)) s"
  grep -m3 -iE "chunkattn|attention backend" "${LOG[$s]}"
  ALIVE+=("$s")
done
DIED=$(( ${#SYSTEMS[@]} - ${#ALIVE[@]} ))
[ ${#ALIVE[@]} -gt 0 ] || exit 1
SYSTEMS=("${ALIVE[@]}")

# KV usage, running requests, the API server's and engine core's CPU and the GPU's busy share
# every 0.25 s, tagged with the run in flight (serve_sampler.py).
SAMPLERS=()
for s in "${SYSTEMS[@]}"; do
  $PY benchmarks/gpu/serve_sampler.py "${URL[$s]}/metrics" "${HOME_DIR[$s]}" "${SERVER[$s]}" &
  SAMPLERS+=($!)
done

# A workload starts only if the time left covers its runs at the longest run measured so far
# (GUESS_S before the first), and a run is cut where the time runs out: however long the servers
# took to start, the script ends inside TIME_LIMIT_S, and a short limit still runs what fits.
longest=0
time_left() { echo $((TIME_LIMIT_S - STOP_S - SECONDS)); }
counters() {   # on /metrics, one line: CUSTOM's decode KV counters (chunkattn:decode_*_total) and
  # the sums and counts of vLLM's inter-token latency, queue time and prefill time histograms
  # (engine-side timestamps: the report's engine ITL and TTFT parts), each summed over label
  # sets (bench/server_client.scrape's sum, inline:
  # importing vllm_chunkattn loads torch, ~2 s each time, twice a workload)
  $PY - "$1/metrics" <<'PY' || true
import sys, urllib.request
try:
    text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
except OSError:
    sys.exit()
total = {}
for line in text.splitlines():
    if line.startswith(("chunkattn:decode_", *(f"vllm:{h}_seconds_{p}" for p in ("sum", "count")
                        for h in ("inter_token_latency", "request_queue_time",
                                  "request_prefill_time")))):   # name{labels} value
        name = line.split("{")[0].split()[0]
        total[name] = total.get(name, 0.0) + float(line.split()[-1])
print(" ".join(f"{k}={v!r}" for k, v in sorted(total.items())))
PY
}
# A run's name in its server's log marks and samples: the workload's, with the round where two
# rounds share a server (bench/serve_ab_report.py reads either).
run_name() { [ "$MODE" = pair ] && echo "$2-r$1" || echo "$2"; }
bench() {   # system, round, workload name, then `vllm bench serve` flags
  local s=$1 rnd=$2 name=$3; shift 3
  local work=/tmp/serve_ab/$s-r$rnd run left start=$SECONDS seed=$((rnd - R))
  run=$(run_name "$rnd" "$name")
  # The warm-up's random prompts are its own: with `random`'s seed they were that workload's
  # first 8, served from the prefix cache (TTFT and throughput flattered alike).
  [ "$name" != warmup ] || seed=99
  left=$(time_left)
  [ "$left" -ge 10 ] || { echo "$s-r$rnd $name: skipped (time limit: $left s left)"; return; }
  echo "$run" > "${HOME_DIR[$s]}/current"
  echo "$*" > "$work/$name.flags"
  echo "before $(counters "${URL[$s]}")" > "$work/$name.counters"   # shared KV reads, engine ITL
  mark "${URL[$s]}" "$run" start
  # --save-detailed: per-request latencies, so TPOT is per sequence for n > 1 (ab.latency_metrics)
  timeout $((left < 200 ? left : 200)) "$VLLM" bench serve --backend vllm --base-url "${URL[$s]}" \
    --model "$MODEL" --seed "$seed" --save-result --save-detailed --result-dir "$work" \
    --result-filename "$name.json" "$@" > "$work/$name.log" 2>&1
  local rc=$?; echo idle > "${HOME_DIR[$s]}/current"
  mark "${URL[$s]}" "$run" end
  echo "after $(counters "${URL[$s]}")" >> "$work/$name.counters"
  [ "$name" = warmup ] || [ $((SECONDS - start)) -le $longest ] || longest=$((SECONDS - start))
  echo "$s-r$rnd $name: rc=$rc in $((SECONDS - start)) s, $(grep -E 'Output token throughput' \
    "$work/$name.log" | tr -s ' ')"
}
# The runs of one workload: system:round, in order (a pair's ABBA).
if [ "$MODE" = pair ]; then RUNS=("stock:$R" "custom:$R" "custom:$((R + 1))" "stock:$((R + 1))")
else RUNS=("$MODE:$R"); fi
live=()                                      # the runs of the servers that came up
for run in "${RUNS[@]}"; do
  for s in "${SYSTEMS[@]}"; do [ "${run%:*}" != "$s" ] || live+=("$run"); done
done
RUNS=("${live[@]}")
for run in "${RUNS[@]}"; do rm -rf "/tmp/serve_ab/${run/:/-r}"; mkdir -p "/tmp/serve_ab/${run/:/-r}"; done
WARMUPS=()                                   # a pair's at once: they time nothing (~25 s saved)
# 8 prompts, never more than a workload's: a dry run's (N=4, bf16 on a CPU without AVX-512 BF16)
# spent 156 s warming up on 8 prompts of 2208 tokens, more than its workloads took.
WARM_N=$((N < 8 ? N : 8))
for s in "${SYSTEMS[@]}"; do
  # shellcheck disable=SC2046   # workload flags are single words by construction
  bench "$s" "$R" warmup $(workload random | sed "s/--num-prompts $N/--num-prompts $WARM_N/") &
  WARMUPS+=($!)
done
wait "${WARMUPS[@]}"
for w in "${WORKLOADS[@]}"; do
  need=$(( ${#RUNS[@]} * (longest > 0 ? longest : ${GUESS_S:-45}) ))   # H100: runs of 30-45 s
  left=$(time_left)
  [ "$left" -ge "$need" ] || { echo "$w: skipped (time limit: $left s left, need ~$need s)"; continue; }
  for run in "${RUNS[@]}"; do
    # shellcheck disable=SC2046
    bench "${run%:*}" "${run#*:}" "$w" $(workload "$w")
  done
done
kill "${SAMPLERS[@]}" 2> /dev/null
for s in "${SYSTEMS[@]}"; do stop "${SERVER[$s]}" & done
wait 2> /dev/null                            # the stops, the servers, the samplers
echo "servers stopped; $((SECONDS - t0)) s since the start, $SECONDS s in all"

for run in "${RUNS[@]}"; do
  s=${run%:*}; tag=${run/:/-r}; work=/tmp/serve_ab/$tag
  cp "${HOME_DIR[$s]}"/* "$work/" 2> /dev/null   # the server's: each round reads its own runs
  rm -f "$work/current"
  slog=${LOG[$s]} sec=$work/summary.md
  # The same rows as the A/B report (python -m vllm_chunkattn.bench.serve_ab_report), per round.
  $PY -m vllm_chunkattn.bench.serve_ab_report --summary "$work" "$slog" "$tag" > "$sec"
  grep -m1 "kernel=" "$slog" >> "$sec"
  # Which CUDA graphs were captured (FULL decode graphs include CUSTOM's attention) and whether
  # async scheduling stayed on (vLLM's GPU default; the flag must leave it alone): vLLM 0.32 logs
  # neither that nor the model runner unless V2, so CUSTOM's tree scheduler says it.
  { grep -oE "Capturing CUDA graphs \([^)]*\)" "$slog" | sort -u
    grep -oE "cudagraph_mode[^,]*|async scheduling (on|off)|Using V2 Model Runner" "$slog" | sort -u
  } >> "$sec"
  grep -m1 "KV cache size" "$slog" >> "$sec"
  tar -czf "$OUT/results_$tag.tar.gz" -C "$work" .
  if [ "$MODE" = pair ]; then cat "$sec" >> "$OUT/summary.md"; else cp "$sec" "$OUT/summary_$tag.md"; fi
  cat "$sec"
done
[ "$DIED" = 0 ] || { echo "$DIED server(s) died at start: see server_<system>.log"; exit 1; }
