#!/usr/bin/env bash
# Instructions per Transfer outside the copy (issue 15): runs kvwire-transfer-driver-plain (two
# engines in one process, one-op transfers one at a time, over shm by default) under callgrind,
# counting only the measured loop (kvwire_cpu_measured_loop, warm-up excluded), and prints
# instructions per transfer: in all, in the copy (memcpy/memmove's own instructions), outside
# the copy, then the top functions by inclusive and by self cost, per transfer. Instruction
# counts do not depend on the machine's load.
#
#   perf/cpu/callgrind.sh [BUILD_DIR] [driver options: --n 2000 --size 4096 --op write ...]
# BUILD_DIR defaults to build. Needs valgrind (scripts/install-deps.sh --compare installs it).
set -euo pipefail
build=build
if [[ $# -gt 0 && $1 != --* ]]; then build=$1; shift; fi
driver=$build/perf/kvwire-transfer-driver-plain
[[ -x $driver ]] || { echo "callgrind.sh: $driver not built (ninja -C $build kvwire-transfer-driver-plain)" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is not installed" >&2; exit 2; }
args=("$@")
n=2000
warmup=200  # the driver's default
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ ${args[i]} == --n ]] && n=${args[i+1]}
  [[ ${args[i]} == --warmup ]] && warmup=${args[i+1]}
done
[[ " ${args[*]} " == *" --n "* ]] || args+=(--n "$n")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=kvwire_cpu_measured_loop \
  --callgrind-out-file="$out/cg.out" "$driver" "${args[@]}" >"$out/driver.txt" 2>"$out/valgrind.txt" ||
  { cat "$out/valgrind.txt" >&2; exit 1; }
head -1 "$out/driver.txt"
callgrind_annotate --auto=no --inclusive=yes --threshold=100 "$out/cg.out" >"$out/incl.txt"
callgrind_annotate --auto=no --inclusive=no --threshold=100 "$out/cg.out" >"$out/self.txt"
# The warm-up runs through the same loop function, so callgrind counts n + warmup transfers.
python3 - "$n" "$warmup" "$out/incl.txt" "$out/self.txt" <<'PY'
import re, sys
n = int(sys.argv[1]) + int(sys.argv[2])
row = re.compile(r'^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$')

def rows(path):
    out = []
    for line in open(path):
        m = row.match(line)
        if m and 'PROGRAM TOTALS' not in m.group(2):
            out.append((int(m.group(1).replace(',', '')), m.group(2)))
    return out

def short(name):
    # "file:function [object]" -> "function", without argument lists, templates abridged.
    name = re.sub(r'\s*\[[^\]]*\]$', '', name)
    name = name.split(':', 1)[1] if re.match(r'^[^:]*\.(cc|h|c|S|hpp)?:|^\?\?\?:|^\./', name) else name
    name = re.sub(r'\(.*', '', name) if not name.startswith('std::_Function_handler') else name[:90]
    name = name.replace('absl::debian3::', 'absl::')
    return name[:100]

incl, self_ = rows(sys.argv[3]), rows(sys.argv[4])
total = sum(c for c, _ in self_)
copy = sum(c for c, f in self_ if re.search(r'__mem(cpy|move)|:memcpy|:memmove', f))
print(f"instructions per transfer: {total / n:,.0f} in all, {copy / n:,.0f} in memcpy/memmove, "
      f"{(total - copy) / n:,.0f} outside the copy ({n} transfers)")
print("\ntop functions, inclusive (instructions per transfer; a function's callees included):")
seen = set()
shown = 0
for c, f in incl:
    s = short(f)
    if c >= total * 0.999 or not s or s.startswith("0x") or s in seen or 'kvwire_cpu_measured_loop' in s:
        continue  # the loop, main and libc's start: 100% by construction
    seen.add(s)
    print(f"  {c / n:9,.0f}  {s}")
    shown += 1
    if shown == 30:
        break
print("\ntop functions, self (their own instructions per transfer):")
merged = {}
for c, f in self_:
    merged[short(f)] = merged.get(short(f), 0) + c
for s, c in sorted(merged.items(), key=lambda x: -x[1])[:25]:
    print(f"  {c / n:9,.0f}  {s}")
PY
