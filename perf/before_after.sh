#!/usr/bin/env bash
# Before/after of two builds' kvwire-perf on loopback, alternated case by case in one run so
# both see the same machine (report `uptime` with the figures; a loaded box proves nothing).
#   perf/before_after.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR [REPETITIONS]
# Cases: tcp and shm, 64 KiB (4000 ops) and 1 MiB (1000 ops), WRITE and READ, then the
# dsv4-pro 8k kv workload (40 requests). One line per run: label | options | perftest row.
set -euo pipefail
before="$1/perf/kvwire-perf"
after="$2/perf/kvwire-perf"
reps="${3:-2}"
port=$((19000 + RANDOM % 1000))
run() {
  local label=$1 bin=$2
  shift 2
  port=$((port + 1))
  "$bin" "$@" -p "$port" >/dev/null 2>&1 &
  local target=$!
  sleep 0.5
  local row
  row=$(timeout 120 "$bin" "$@" -p "$port" 127.0.0.1 2>/dev/null | grep -E '^\s*[0-9]' | tail -1 || true)
  wait "$target" 2>/dev/null || true
  echo "$label | $* | $row"
}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((rep = 1; rep <= reps; rep++)); do
  for t in tcp shm; do
    for s in 64K 1M; do
      n=$([ "$s" = 64K ] && echo 4000 || echo 1000)
      for op in write read; do
        run before "$before" --transport "$t" -s "$s" -n "$n" --op "$op"
        run after "$after" --transport "$t" -s "$s" -n "$n" --op "$op"
      done
    done
    for op in write read; do
      run before "$before" --transport "$t" --workload kv --layout dsv4-pro --op "$op" -n 40
      run after "$after" --transport "$t" --workload kv --layout dsv4-pro --op "$op" -n 40
    done
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
