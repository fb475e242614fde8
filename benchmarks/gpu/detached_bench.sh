#!/usr/bin/env bash
# The kernel benchmarks (run_on_device.sh, STAGES=bench) detached from the shell that starts
# them, so that they run on while the host does light work, such as collecting the offline
# bundle's parts (offline/install_bundle.sh collect: file copies).
#   bash benchmarks/gpu/detached_bench.sh start     # snapshot of the tree, the bench under setsid
#   bash benchmarks/gpu/detached_bench.sh status    # one line: running (its stage) / ended / none
#   bash benchmarks/gpu/detached_bench.sh wait      # until it ends; at once if none runs
#   bash benchmarks/gpu/detached_bench.sh collect   # wait, then its result files into $OUT
# Whatever else needs the GPU or the host's cores for long (serve_ab.sh, offline/install_bundle.sh
# install / gputests) calls `wait` first: the timings are the bench's alone, and vLLM's memory
# reservation never meets it. It runs in a POSIX session of its own (setsid), so it outlives the
# shell, and the process group, that started it.
# Knobs: BENCH_TIME_LIMIT_S (480: the detached run's TIME_LIMIT_S), BENCH_STATE
# (/tmp/chunkattn_bench), BENCH_GRACE_S (90: past its time limit `wait` ends it, so a hang cannot
# hold the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
STATE=${BENCH_STATE:-/tmp/chunkattn_bench}
MARKER=${VLLM_MARKER:-/tmp/vllm_bundle.marker}   # offline/install_bundle.sh: a line per collect

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
collects() { [ -f "$MARKER" ] && wc -l < "$MARKER" || echo 0; }

start() {
  if alive; then echo "detached bench: already running ($(since) s)"; return 0; fi
  rm -rf "$STATE"; mkdir -p "$STATE/src"
  # A snapshot of what the bench runs: a checkout updated meanwhile would change the script
  # under a running bash (it reads its script as it goes). The JIT build stages its sources by
  # content, so the snapshot reuses the kernel the tree built.
  local wheels
  mapfile -t wheels < <(compgen -G "benchmarks/gpu/offline/wheels/*.whl")
  tar -c --exclude=__pycache__ vllm_chunkattn csrc benchmarks/gpu/*.sh benchmarks/gpu/*.py \
    benchmarks/gpu/offline/*.py "${wheels[@]}" | tar -x -C "$STATE/src" || return 1
  date +%s > "$STATE/started"; collects > "$STATE/collects_before"
  local limit=${BENCH_TIME_LIMIT_S:-480}
  echo "$limit" > "$STATE/time_limit"
  (
    cd "$STATE/src" || exit 1
    unset PYTHONPATH                     # the snapshot's own tree goes first (run_on_device.sh)
    # shellcheck disable=SC2016  # expanded by the inner bash
    env OUT="$STATE/out" WORK="$STATE/work" STAGES=bench TIME_LIMIT_S="$limit" setsid nohup bash -c \
      'bash benchmarks/gpu/run_on_device.sh; echo $? > "$0/rc"; date +%s > "$0/ended"' "$STATE" \
      > "$STATE/log" 2>&1 < /dev/null &
    echo $! > "$STATE/pid"
  )
  echo "detached bench: started (pid $(cat "$STATE/pid"), TIME_LIMIT_S $limit, log $STATE/log)"
}

status() {
  if [ ! -f "$STATE/started" ]; then echo "detached bench: none"
  elif alive; then
    echo "detached bench: running $(since) s, at '$(grep -a '^== ' "$STATE/log" | tail -1)'"
  else echo "detached bench: ended (rc $(cat "$STATE/rc" 2> /dev/null || echo '?'))"; fi
}

wait_() {
  alive || return 0
  local limit=$(( $(cat "$STATE/time_limit") + ${BENCH_GRACE_S:-90} )) t0
  t0=$(date +%s)
  echo "detached bench: waiting for it to end ($(since) s of its $(cat "$STATE/time_limit") s in)"
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
  # Its summary says what ran beside it: the offline bundle's collects (file copies).
  [ -f "$STATE/out/summary.md" ] && ! grep -q '^== detached:' "$STATE/out/summary.md" && printf '%s\n' \
    "== detached: $(cat "$STATE/time_limit") s time limit, ended after $(( $(cat "$STATE/ended" 2> /dev/null || date +%s) - $(cat "$STATE/started") )) s, rc $(cat "$STATE/rc" 2> /dev/null || echo '?');" \
    "   beside it: $(( $(collects) - $(cat "$STATE/collects_before") )) collects of the offline vLLM bundle (file copies, no GPU)" \
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
