#!/usr/bin/env bash
# Issue #10 on the lent GPU, one system per device call (README.md, "vLLM serve A/B"): `vllm serve`
# stock or with --attention-backend CUSTOM on the Llama-3-8B shape (dummy bf16 weights), then
# `vllm bench serve` over the issue's workloads, KV usage sampled from /metrics meanwhile.
#   bash benchmarks/gpu/serve_ab.sh stock|custom [WORKLOAD ...]   # default: all, in this order:
#     random prefix1x2k prefix1x2k_c128 prefix1x2k_c256 prefix4x2k n8x1k tree
# Needs `install_bundle.sh install` done on this warm machine. $OUT gets summary_<tag>.md,
# server_<tag>.log and results_<tag>.tar.gz (bench JSONs, bench logs, KV samples); tag =
# <system>-r<ROUND> (ROUND=1 by default; ABBA: stock r1, custom r1, custom r2, stock r2).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
SYSTEM=${1:?stock or custom}; shift
[ "$SYSTEM" = stock ] || [ "$SYSTEM" = custom ] || { echo "system: stock or custom" >&2; exit 2; }
WORKLOADS=("$@"); [ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(random prefix1x2k prefix1x2k_c128 prefix1x2k_c256 prefix4x2k n8x1k tree)
BUDGET_S=${BUDGET_S:-540}                    # the whole call ends inside the tool's 600 s
STOP_S=45                                    # kept for stopping the server (<= 30 s) and the report
# A server takes 95-145 s to start on an H100 (2026-11-26), a workload 30-60 s: under MIN_BUDGET_S
# no workload would run (stock's round 2 spent 158 device seconds so), so none is started.
MIN_BUDGET_S=${MIN_BUDGET_S:-240}
[ "$BUDGET_S" -ge "$MIN_BUDGET_S" ] || {
  echo "BUDGET_S=$BUDGET_S is under MIN_BUDGET_S=$MIN_BUDGET_S (server start ~150 s + a workload + stop):" \
       "$SYSTEM not started" >&2; exit 3; }
TAG=$SYSTEM-r${ROUND:-1}
OUT=${OUT:-/tmp/serve_ab_out}; mkdir -p "$OUT"
WORK=/tmp/serve_ab/$TAG; rm -rf "$WORK"; mkdir -p "$WORK"
MODEL=${MODEL:-/tmp/models/llama-3-8b}
VLLM=${VLLM:-vllm}                           # the CLI (a wrapper for a CPU dry run)
N=${NUM_PROMPTS:-64}; OUT_LEN=${OUTPUT_LEN:-256}   # smaller for a dry run
eval "$(bash benchmarks/gpu/install_bundle.sh env)"
bash benchmarks/gpu/detached_bench.sh wait   # vLLM reserves most of the GPU: not beside a bench
export PYTHONUNBUFFERED=1

PY=${PYTHON:-python3}                        # the image's python (torch, transformers)
# A fresh port per call: a server left by an earlier call can never answer for this one.
PORT=${PORT:-$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')}
URL=http://127.0.0.1:$PORT
[ -f "$MODEL/config.json" ] || $PY -m vllm_chunkattn.model_shapes --out /tmp/models llama-3-8b
TREE=/tmp/models/tree_1024_4x512_16.jsonl    # system 1024 -> 4 documents of 512 -> 16 questions
mkdir -p /tmp/models
[ -f $TREE ] || $PY -c "
from pathlib import Path
from vllm_chunkattn.bench.ab_workloads import tree, write_tree_jsonl
from vllm_chunkattn.tiny_model import SPECIAL, vocabulary
words = [w for w in vocabulary() if w not in SPECIAL]       # one token each
write_tree_jsonl(tree(1024, 4, 512, 16), Path('$TREE'), words)"

# 64 requests, 32 at a time (the issue's "2K shared x >= 32 concurrent"), 256 output tokens each
# (--ignore-eos: dummy weights would otherwise stop at random); the tree's outputs are 128-512.
# prefix1x2k_c128: the same prompts, 4x as many, 128 at a time. At 32 the 8B shape's decode step
# reads 15 GB of weights beside ~10 GB of KV, so even free attention gives at most ~1.5x there
# (README.md, "Where the serving goal can show"); at 128 the H100 measured 1.24x, the rest of
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

# --enable-logging-iteration-details: vLLM logs every step's batch, KV usage and wait for the
# GPU (bench/serve_steps.py reads them between bench()'s marks), for both systems alike.
server_args=(--load-format dummy --dtype bfloat16 --max-model-len 4096 --port "$PORT"
             --gpu-memory-utilization 0.90 --enable-logging-iteration-details)
[ "$SYSTEM" = custom ] && server_args+=(--attention-backend CUSTOM)
# e.g. EXTRA_SERVER_ARGS='--compilation-config {"cudagraph_mode":"PIECEWISE"}' to take attention
# out of the decode graphs if FULL graphs misbehave (word-split: no spaces inside the JSON).
# shellcheck disable=SC2206
server_args+=(${EXTRA_SERVER_ARGS:-})
echo "== $TAG: vllm serve $MODEL ${server_args[*]}"
# For the report (python -m vllm_chunkattn.bench.serve_ab_report): the command and the GPU.
echo "vllm serve $MODEL ${server_args[*]}" > "$WORK/server_cmd.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$WORK/gpu.txt" 2> /dev/null
up() { $PY -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
       "${1:-$URL/health}" 2> /dev/null; }      # no curl needed on the image
# A workload's edges in the server log (its access log line, in order with the step lines).
mark() { up "$URL/health?serve_ab=$1.$2" || true; }
stop() {   # $1: our server's pid: SIGINT (vLLM's clean shutdown), then SIGKILL after 30 s for
           # what is left of its process tree (the engine core too); "leftover": an earlier
           # call's server or client, killed at once (a server still starting ignores SIGINT)
  $PY - "$1" "$MODEL" <<'PY'
import contextlib, psutil, signal, sys
what, model = sys.argv[1:3]
grace = 0 if what == "leftover" else 30
if what == "leftover":
    roots = [p for p in psutil.process_iter(["cmdline"]) if model in (p.info["cmdline"] or [])
             and any(a.endswith("serve") for a in p.info["cmdline"])]
    if roots:
        print("stopping what an earlier call left running:", [r.pid for r in roots])
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
# A server (or client) left by an earlier call cut at its time limit would hold GPU memory.
stop leftover
t0=$SECONDS
CHUNKATTN_STATS_FILE=$WORK/chunkattn_stats.json "$VLLM" serve "$MODEL" "${server_args[@]}" \
  > "$OUT/server_$TAG.log" 2>&1 &
SERVER=$!
until up; do
  kill -0 $SERVER 2> /dev/null || { echo "server died:"; tail -40 "$OUT/server_$TAG.log"; exit 1; }
  [ $((SECONDS + STOP_S)) -lt "$BUDGET_S" ] || {
    echo "server not up after $((SECONDS - t0)) s (BUDGET_S $BUDGET_S)"; stop $SERVER; exit 1; }
  sleep 2
done
echo "server up in $((SECONDS - t0)) s"
grep -m3 -iE "chunkattn|attention backend" "$OUT/server_$TAG.log"

echo idle > "$WORK/current"
# KV usage, running requests, the API server's and engine core's CPU and the GPU's busy share
# every 0.25 s, tagged with the workload in flight (serve_sampler.py).
$PY benchmarks/gpu/serve_sampler.py "$URL/metrics" "$WORK" "$SERVER" &
SAMPLER=$!

# A workload starts only if the budget left covers the longest one measured so far (GUESS_S
# before the first), and is cut where the budget ends: however long the server took to start,
# the call ends inside BUDGET_S, and a short budget still runs every workload that fits.
longest=0
budget_left() { echo $((BUDGET_S - STOP_S - SECONDS)); }
counters() {   # CUSTOM's decode KV counters on /metrics (chunkattn:decode_*_total), one line
  # (bench/server_client.scrape's sum over label sets, inline: importing vllm_chunkattn loads
  # torch, ~2 s a call, twice a workload, in device time)
  $PY - "$URL/metrics" <<'PY' || true
import sys, urllib.request
try:
    text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
except OSError:
    sys.exit()
total = {}
for line in text.splitlines():
    if line.startswith("chunkattn:decode_"):        # name{labels} value, a line per engine
        name = line.split("{")[0].split()[0]
        total[name] = total.get(name, 0.0) + float(line.split()[-1])
print(" ".join(f"{k}={v:.0f}" for k, v in sorted(total.items())))
PY
}
bench() {   # name, then `vllm bench serve` flags
  local name=$1; shift
  local left start=$SECONDS
  left=$(budget_left)
  [ "$left" -ge 10 ] || { echo "$name: skipped (budget: $left s left)"; return; }
  echo "$name" > "$WORK/current"
  echo "$*" > "$WORK/$name.flags"
  echo "before $(counters)" > "$WORK/$name.counters"   # its share of decode KV reads from shared chunks
  mark "$name" start
  # --save-detailed: per-request latencies, so TPOT is per sequence for n > 1 (ab.latency_metrics)
  timeout $((left < 200 ? left : 200)) "$VLLM" bench serve --backend vllm --base-url "$URL" \
    --model "$MODEL" --seed 0 --save-result --save-detailed --result-dir "$WORK" \
    --result-filename "$name.json" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?; echo idle > "$WORK/current"
  mark "$name" end
  echo "after $(counters)" >> "$WORK/$name.counters"
  [ "$name" = warmup ] || [ $((SECONDS - start)) -le $longest ] || longest=$((SECONDS - start))
  echo "$name: rc=$rc in $((SECONDS - start)) s, $(grep -E 'Output token throughput' \
    "$WORK/$name.log" | tr -s ' ')"
}
# shellcheck disable=SC2046   # workload flags are single words by construction
bench warmup $(workload random | sed "s/--num-prompts $N/--num-prompts 8/")
for w in "${WORKLOADS[@]}"; do
  need=$((longest > 0 ? longest : ${GUESS_S:-60}))
  left=$(budget_left)
  [ "$left" -ge "$need" ] || { echo "$w: skipped (budget: $left s left, need ~$need s)"; continue; }
  # shellcheck disable=SC2046
  bench "$w" $(workload "$w")
done
kill $SAMPLER 2> /dev/null
stop $SERVER; wait $SERVER 2> /dev/null
echo "server stopped; $((SECONDS - t0)) s since its start, $SECONDS s in all"

# The same rows as the A/B report (python -m vllm_chunkattn.bench.serve_ab_report), for this run.
$PY -m vllm_chunkattn.bench.serve_ab_report --summary "$WORK" "$OUT/server_$TAG.log" "$TAG" \
  > "$OUT/summary_$TAG.md"
grep -m1 "kernel=" "$OUT/server_$TAG.log" >> "$OUT/summary_$TAG.md"
# Which CUDA graphs were captured (FULL decode graphs include CUSTOM's attention) and whether
# async scheduling stayed on (vLLM's GPU default; the flag must leave it alone): vLLM 0.32 logs
# neither that nor the model runner unless V2, so CUSTOM's tree scheduler says it.
{ grep -oE "Capturing CUDA graphs \([^)]*\)" "$OUT/server_$TAG.log" | sort -u
  grep -oE "cudagraph_mode[^,]*|async scheduling (on|off)|Using V2 Model Runner" \
    "$OUT/server_$TAG.log" | sort -u
} >> "$OUT/summary_$TAG.md"
grep -m1 "KV cache size" "$OUT/server_$TAG.log" >> "$OUT/summary_$TAG.md"
tar -czf "$OUT/results_$TAG.tar.gz" -C "$WORK" .
cat "$OUT/summary_$TAG.md"
