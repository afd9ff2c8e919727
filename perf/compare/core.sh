#!/usr/bin/env bash
# The core issue's performance bar, measured in one session with the tools alternating:
#   tcp: kvwire-demo over tcp vs `ucx_perftest -t tag_bw` over UCX_TLS=tcp (loopback),
#        at 64 KiB and 1 MiB, one buffer reused on each side (what ucx_perftest does);
#   shm: kvwire-demo over shm vs memcpy of the same size and cache state (the demo measures
#        both, alternating, and prints the ratio).
# Prints medians of RUNS runs in decimal GB/s (ucx_perftest prints MiB/s: converted here).
#
#   perf/compare/core.sh            (after `make demo` or `ninja -C build kvwire-demo`)
#   RUNS=5 TCP_CONNECTIONS=1 perf/compare/core.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DEMO=${DEMO:-build/perf/kvwire-demo}
RUNS=${RUNS:-3}
TCP_CONNECTIONS=${TCP_CONNECTIONS:-4}
command -v ucx_perftest >/dev/null || scripts/install-deps.sh ucx-utils
[[ -x $DEMO ]] || { echo "build $DEMO first (make demo)" >&2; exit 1; }

median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

# ucx_perftest tag_bw over tcp; prints decimal GB/s of the "Final:" line (overall MiB/s).
ucx_tag_bw() {
  local size=$1 iters=$2 port=$((20000 + RANDOM % 20000))
  UCX_TLS=tcp timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  UCX_TLS=tcp timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t tag_bw -s "$size" -n "$iters" 2>/dev/null |
    awk '/^Final:/ {printf "%.3f\n", $7 * 1048576 / 1e9}'
  wait "$server" || true
}

# kvwire-demo over one transport; prints GB/s of the "<op> <size> hot" row.
kvwire_gbs() {
  local transport=$1 op=$2 size=$3 column=$4
  KVWIRE_TCP_CONNECTIONS=$TCP_CONNECTIONS KVWIRE_LOG_LEVEL=error \
    "$DEMO" --transports="$transport" --sizes="$size" --total_mb=1024 --pool_mb=256 --reps=1 \
      2>/dev/null | awk -v t="$transport" -v op="$op" -v kib="$((size / 1024))" -v c="$column" \
      '$1 == t && $2 == op && $3 == kib && $5 == "hot" {print $c}'
}

echo "kvwire core comparison, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $RUNS runs each, decimal GB/s"
echo "kvwire tcp uses $TCP_CONNECTIONS connection(s) per peer; ucx_perftest runs 1 thread per side"
printf '%-34s %10s %10s %8s\n' "measurement" "kvwire" "peer" "ratio"
for size in 65536 1048576; do
  iters=$((2147483648 / size))
  for op in WRITE READ; do
    ours=() theirs=()
    for _ in $(seq "$RUNS"); do
      theirs+=("$(ucx_tag_bw "$size" "$iters")")
      ours+=("$(kvwire_gbs tcp "$op" "$size" 6)")
    done
    k=$(printf '%s\n' "${ours[@]}" | median)
    u=$(printf '%s\n' "${theirs[@]}" | median)
    printf '%-34s %10.2f %10.2f %8.2f\n' "tcp $op $((size / 1024)) KiB vs ucx tag_bw" "$k" "$u" \
      "$(awk -v a="$k" -v b="$u" 'BEGIN {print a / b}')"
  done
done
for size in 1048576; do
  for op in WRITE READ; do
    for pattern in hot pool; do
      ours=() floor=()
      for _ in $(seq "$RUNS"); do
        row=$(KVWIRE_LOG_LEVEL=error "$DEMO" --transports=shm --sizes="$size" --total_mb=1024 \
                --pool_mb=1024 --reps=1 2>/dev/null |
              awk -v op="$op" -v p="$pattern" '$1 == "shm" && $2 == op && $5 == p {print $6, $7}')
        ours+=("${row% *}")
        floor+=("${row#* }")
      done
      k=$(printf '%s\n' "${ours[@]}" | median)
      f=$(printf '%s\n' "${floor[@]}" | median)
      printf '%-34s %10.2f %10.2f %8.2f\n' "shm $op 1 MiB $pattern vs memcpy" "$k" "$f" \
        "$(awk -v a="$k" -v b="$f" 'BEGIN {print a / b}')"
    done
  done
done
