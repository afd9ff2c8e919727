#!/usr/bin/env bash
# Usage: scripts/fuzz.sh SECONDS [TARGET...]
#
# Builds the libFuzzer targets of tests/fuzz/ in $FUZZ_DIR (default build-fuzz: clang,
# ASan+UBSan, -fsanitize=fuzzer; only the libraries the targets link) and runs each for
# SECONDS, starting from its seed corpus tests/fuzz/corpus/<target>/ (never written to: new
# inputs go to $FUZZ_DIR/corpus/<target>/, kept between runs). Every target runs even when an
# earlier one crashed; the script fails if any did, after listing the reproducers (in
# $FUZZ_DIR/crashes/<target>/, emptied when the target runs again). A reproducer belongs in
# tests/fuzz/corpus/<target>/ once fixed (the ctest replay then keeps it fixed), in
# tests/fuzz/open/<target>/ until then.
# Without TARGETs: every target, in the order of tests/fuzz/CMakeLists.txt. FUZZ_SEED=N fixes
# libFuzzer's seed (CI does, so that a finding there can be replayed; 0: a random seed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds=${1:?seconds per target}
shift
dir=${FUZZ_DIR:-build-fuzz}
san=address,undefined

scripts/configure.sh "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DKVWIRE_SANITIZE=$san -DKVWIRE_FUZZ=ON -DKVWIRE_BUILD_TESTS=OFF >/dev/null
pfx=$(scripts/sanitizer-prefix.sh $san "$dir")

targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  mapfile -t targets < <(sed -n 's/^kvwire_fuzz_target(\([a-z0-9_]*\).*/\1/p' tests/fuzz/CMakeLists.txt)
fi
build=()
for t in "${targets[@]}"; do build+=("fuzz_$t"); done
ninja -C "$dir" -j"${JOBS:-$(nproc)}" "${build[@]}"

# Leaks are reported by the replay under ASan (make test-asan); here they would stop a
# target at its first input that leaves a static fixture behind.
export ASAN_OPTIONS=${FUZZ_ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:symbolize=1}
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
failed=()
for t in "${targets[@]}"; do
  work="$dir/corpus/$t"
  crashes="$dir/crashes/$t"
  # Reproducers of this run only: a listing of older ones would point at fixed bugs.
  rm -rf "$crashes"
  mkdir -p "$work" "$crashes"
  echo "=== fuzz: $t for ${seconds}s"
  # -timeout: an input that takes 10 s is a hang; -rss_limit_mb: a bounded parser stays far
  # below 2 GiB; -max_len: the targets' largest seeds are 6 KiB.
  # shellcheck disable=SC2086  # the prefix is meant to split into words
  if ! $pfx "$dir/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 \
      -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 -seed="${FUZZ_SEED:-0}" \
      -artifact_prefix="$crashes/" "$work" "tests/fuzz/corpus/$t" \
      >"$dir/fuzz-$t.log" 2>&1; then
    failed+=("$t")
    echo "=== fuzz: $t FAILED; log $dir/fuzz-$t.log, reproducers:"
    ls -1 "$crashes" | sed "s|^|    $crashes/|"
    grep -m1 -E "ERROR: |runtime error|fuzz check failed|terminate called|deadly signal" \
      "$dir/fuzz-$t.log" | sed 's/^/    /' || true
  else
    { grep -E "^stat::number_of_executed_units|^stat::new_units_added" "$dir/fuzz-$t.log" ||
      true; } | tr '\n' ' ' | sed 's/^/    /'
    echo
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "=== fuzz: ${#failed[@]} of ${#targets[@]} targets failed: ${failed[*]}"
  exit 1
fi
echo "=== fuzz: all ${#targets[@]} targets ran ${seconds}s without a finding"
