#!/usr/bin/env bash
# Usage: scripts/sanitizer-prefix.sh SANITIZER WORKDIR [CXX]
#
# Prints the command prefix under which binaries built with -fsanitize=SANITIZER can run on
# this kernel: nothing when they run as they are, or "setarch <arch> -R" when they only run
# with address-space randomisation off. Exits non-zero, with the probe's output, when they
# do not run at all.
#
# Why: the TSan (and ASan) runtimes of clang 14 assume the kernel's mmap layout of their
# day. Kernels with more mmap randomisation (vm.mmap_rnd_bits > 28, the default on many
# newer distributions' kernels) place libraries where the runtime expects its shadow, and
# TSan dies at start-up with "FATAL: ThreadSanitizer: unexpected memory mapping". Disabling
# randomisation for the process tree (setarch -R, inherited by children) avoids it without
# touching system settings. The probe is compiled once per WORKDIR and its verdict cached.
set -euo pipefail

sanitizer=${1:?sanitizer, e.g. thread or address,undefined}
workdir=${2:?work directory, e.g. build-tsan}
cxx=${3:-clang++}

mkdir -p "$workdir"
verdict="$workdir/sanitizer-prefix.txt"
# The verdict depends on the kernel (and its settings), so key the cache on both.
key="$(uname -r) $(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo '?') $sanitizer"
if [[ -f $verdict && $(head -n1 "$verdict") == "$key" ]]; then
  tail -n +2 "$verdict"
  exit 0
fi

probe="$workdir/sanitizer-probe"
# A thread and a mutex, so the runtime sets up everything a real test would use.
"$cxx" -std=c++17 -fsanitize="$sanitizer" -g -pthread -x c++ -o "$probe" - <<'CC'
#include <mutex>
#include <thread>
int main() {
  int x = 0;
  std::mutex mu;
  std::thread t([&] { std::lock_guard<std::mutex> lock(mu); ++x; });
  { std::lock_guard<std::mutex> lock(mu); ++x; }
  t.join();
  return x == 2 ? 0 : 1;
}
CC

# Three runs: with randomisation the clash is a matter of luck for some runtimes (ASan).
runs_ok() {
  local _
  for _ in 1 2 3; do out=$("$@" 2>&1) || return 1; done
}
prefix=""
out=""
if ! runs_ok "$probe"; then
  first=$out
  prefix="setarch $(uname -m) -R"
  # shellcheck disable=SC2086  # the prefix is meant to split into words
  if ! runs_ok $prefix "$probe"; then
    echo "sanitizer-prefix: -fsanitize=$sanitizer binaries do not run here, even with" \
         "ASLR off (vm.mmap_rnd_bits=$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null))." >&2
    printf '%s\n--- with %s:\n%s\n' "$first" "$prefix" "$out" >&2
    exit 1
  fi
  echo "sanitizer-prefix: -fsanitize=$sanitizer needs ASLR off on this kernel" \
       "($(uname -r)); running under '$prefix'. First failure was:" >&2
  head -n 3 <<<"$first" >&2
fi
printf '%s\n%s\n' "$key" "$prefix" >"$verdict"
echo "$prefix"
