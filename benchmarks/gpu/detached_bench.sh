#!/usr/bin/env bash
# Issue #9's benchmarks (run_on_device.sh, STAGES=bench) detached on the warm machine, so that
# they run while issue #10's bundle travels: the part calls only copy files, and a device minute
# spent on both is spent once (README.md, "A GPU session's 15 device minutes").
#   bash benchmarks/gpu/detached_bench.sh start     # snapshot of the tree, the bench under setsid
#   bash benchmarks/gpu/detached_bench.sh status    # one line: running (its stage) / ended / none
#   bash benchmarks/gpu/detached_bench.sh wait      # until it ends; at once if none runs
#   bash benchmarks/gpu/detached_bench.sh collect   # wait, then its result files into $OUT
# Whatever else needs the GPU or the host's cores for long (install_bundle.sh install / gputests,
# serve_ab.sh) calls `wait` first: the timings are the bench's alone, and vLLM's memory
# reservation never meets it. A process in its own session outlives the call that started it
# (the device tool ends the others when a call returns) until the machine is given back.
# Knobs: BENCH_BUDGET_S (480: the detached run's BUDGET_S), BENCH_STATE (/tmp/chunkattn_bench),
# BENCH_GRACE_S (90: past its budget `wait` ends it, so a hang cannot hold the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
STATE=${BENCH_STATE:-/tmp/chunkattn_bench}
MARKER=${VLLM_MARKER:-/tmp/vllm_bundle.marker}   # install_bundle.sh collect: a line per part call

# Its session's processes, from /proc (field 6 of stat is the session id; the image may lack
# procps): its stages run under `timeout`, each in a process group of its own.
session_pids() {
  awk -v sid="$(cat "$STATE/pid")" '$6 == sid { split(FILENAME, p, "/"); print p[3] }' \
    /proc/[0-9]*/stat 2> /dev/null
}
end_session() { local pids; mapfile -t pids < <(session_pids); kill "-$1" "${pids[@]}" 2> /dev/null; }
# Alive: its pid still leads a session (a recycled pid almost never does).
alive() {
  [ -f "$STATE/pid" ] && [ "$(cut -d' ' -f6 "/proc/$(cat "$STATE/pid")/stat" 2> /dev/null)" = "$(cat "$STATE/pid")" ]
}
since() { echo $(( $(date +%s) - $(cat "$STATE/started") )); }
part_calls() { [ -f "$MARKER" ] && wc -l < "$MARKER" || echo 0; }

start() {
  if alive; then echo "detached bench: already running ($(since) s)"; return 0; fi
  rm -rf "$STATE"; mkdir -p "$STATE/src"
  # A snapshot of what the bench runs: the next call replaces the tree under a running script
  # (bash reads its script as it goes). The JIT build stages its sources by content, so the
  # snapshot reuses the kernel the tree built.
  local wheels
  mapfile -t wheels < <(compgen -G "benchmarks/gpu/wheels/*.whl")
  tar -c --exclude=__pycache__ vllm_chunkattn csrc benchmarks/gpu/*.sh benchmarks/gpu/*.py \
    "${wheels[@]}" | tar -x -C "$STATE/src" || return 1
  date +%s > "$STATE/started"; part_calls > "$STATE/parts_before"
  local budget=${BENCH_BUDGET_S:-480}
  echo "$budget" > "$STATE/budget"
  (
    cd "$STATE/src" || exit 1
    unset PYTHONPATH                     # the snapshot's own tree goes first (run_on_device.sh)
    # shellcheck disable=SC2016  # expanded by the inner bash
    env OUT="$STATE/out" WORK="$STATE/work" STAGES=bench BUDGET_S="$budget" setsid nohup bash -c \
      'bash benchmarks/gpu/run_on_device.sh; echo $? > "$0/rc"; date +%s > "$0/ended"' "$STATE" \
      > "$STATE/log" 2>&1 < /dev/null &
    echo $! > "$STATE/pid"
  )
  echo "detached bench: started (pid $(cat "$STATE/pid"), BUDGET_S $budget, log $STATE/log)"
}

status() {
  if [ ! -f "$STATE/started" ]; then echo "detached bench: none"
  elif alive; then
    echo "detached bench: running $(since) s, at '$(grep -a '^== ' "$STATE/log" | tail -1)'"
  else echo "detached bench: ended (rc $(cat "$STATE/rc" 2> /dev/null || echo '?'))"; fi
}

wait_() {
  alive || return 0
  local limit=$(( $(cat "$STATE/budget") + ${BENCH_GRACE_S:-90} )) t0
  t0=$(date +%s)
  echo "detached bench: waiting for it to end ($(since) s of its $(cat "$STATE/budget") s in)"
  while alive && (( $(since) < limit )); do sleep 2; done
  if alive; then   # its own deadline has passed: a hang; free the GPU for what comes next
    echo "detached bench: still running after $(since) s: ended (its session killed)"
    end_session TERM; sleep 3; end_session KILL
    echo 137 > "$STATE/rc"
  fi
  echo "detached bench: waited $(( $(date +%s) - t0 )) s; $(status | cut -d: -f2-)"
}

collect() {
  if [ ! -f "$STATE/started" ]; then echo "detached bench: none to collect"; return 0; fi
  wait_
  local out=${OUT:-/tmp/chunkattn_out}
  mkdir -p "$out"
  # Its summary says what ran beside it: the part calls of the bundle (file copies).
  [ -f "$STATE/out/summary.md" ] && ! grep -q '^== detached:' "$STATE/out/summary.md" && printf '%s\n' \
    "== detached: $(cat "$STATE/budget") s budget, ended after $(( $(cat "$STATE/ended" 2> /dev/null || date +%s) - $(cat "$STATE/started") )) s, rc $(cat "$STATE/rc" 2> /dev/null || echo '?');" \
    "   beside it: $(( $(part_calls) - $(cat "$STATE/parts_before") )) part calls of the vLLM bundle (file copies, no GPU)" \
    >> "$STATE/out/summary.md"
  cp "$STATE"/out/* "$out/" 2> /dev/null
  cp "$STATE/log" "$out/detached_bench.log"
  ls -l "$out"
  cat "$STATE/out/summary.md" 2> /dev/null || { echo "no summary: the log's end:"; tail -30 "$STATE/log"; }
}

case "${1:-}" in
  start) start ;;
  status) status ;;
  wait) wait_ ;;
  collect) collect ;;
  *) echo "usage: $0 start|status|wait|collect" >&2; exit 2 ;;
esac
