#!/usr/bin/env bash
# GPU device check: runs kvwire's GPU unit tests on a machine with an NVIDIA GPU and prints one
# table (test, result, time). Meant for a lent GPU machine (e.g. one H200) that has the NVIDIA
# driver but none of the Debian packages kvwire builds against; finishes in well under 5 min.
#
# Two ways to get the test programs there:
#
#  1. A bundle built on a build machine (the usual way; nothing needs compiling on the GPU box):
#       perf/gpu-check.sh --bundle            # here: builds build-cuda/ (KVWIRE_GPU=cuda, only
#                                              # the CUDA backend) and packs build-cuda/gpu-bundle/
#     What must travel: the repository (for this script) plus build-cuda/gpu-bundle/ (about
#     20-30 MB): bin/ holds the stripped test programs, lib/ every shared library they load
#     except the NVIDIA driver's libcuda.so.1 (taken from the GPU machine, as it must match its
#     kernel module) -- including Debian 12's glibc and its loader, so that the bundle runs on a
#     host with another (older) glibc: each program is started as
#     `lib/ld-linux-x86-64.so.2 --library-path lib bin/PROGRAM`. With the device tool:
#       run(command="perf/gpu-check.sh", carry=["build-cuda/gpu-bundle"])
#  2. Building on the GPU machine itself, when it has CMake, Ninja, nvcc and kvwire's
#     dependencies (abseil, protobuf, rdma-core, GoogleTest, ...):
#       perf/gpu-check.sh --build [BUILD_DIR]
#
# With no argument the script runs build-cuda/gpu-bundle/ when it is there, else --build.
# Exit status: 0 when no test failed (tests skipped for a missing device count as skipped, and
# the table says so), 1 otherwise.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUNDLE=build-cuda/gpu-bundle
# gpu_config_test checks the build machine's toolchains against configure: not for this run.
PROGRAMS=(gpu_kv_record_test gpu_runtime_test gpu_shm_transfer_test dsv4_gpu_attention_test
          tcp_gpu_test)
HELPERS=(gpu_ipc_peer)
# The reference engine's kernel-vs-CPU checks read the tiny config from the repository here.
export DSV4_CONFIG_DIR=$PWD/examples/dsv4/configs

# Where a program lies in a build tree (PROGRAM_DIRS overrides tests/unit/gpu).
declare -A PROGRAM_DIRS=([dsv4_gpu_attention_test]=tests/dsv4/model
                        [tcp_gpu_test]=tests/integration)
program_dir() { echo "${PROGRAM_DIRS[$1]:-tests/unit/gpu}"; }
# A program's path under $1: the bundle's bin/, or a build tree.
program_bin() {
  if [[ $1 == "$BUNDLE/bin" ]]; then echo "$1/$2"; else echo "$1/$(program_dir "$2")/$2"; fi
}
PER_PROGRAM_TIMEOUT=${PER_PROGRAM_TIMEOUT:-120}

build() {
  local dir=$1
  scripts/configure.sh "$dir" -DKVWIRE_GPU=cuda -DKVWIRE_GPU_BUILD_ALL=OFF
  ninja -C "$dir" -j"$(nproc)" "${PROGRAMS[@]}" "${HELPERS[@]}"
}

# Copies the programs and every shared library they load (as ldd resolves it here) into
# $BUNDLE; libcuda is left out on purpose (see the header).
make_bundle() {
  local dir=build-cuda
  build "$dir"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
  local p lib
  for p in "${PROGRAMS[@]}" "${HELPERS[@]}"; do
    cp "$(program_bin "$dir" "$p")" "$BUNDLE/bin/"
    strip --strip-debug "$BUNDLE/bin/$p"
    ldd "$(program_bin "$dir" "$p")" | awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}'
  done | sort -u | while read -r lib; do
    case $(basename "$lib") in libcuda.so*) continue ;; esac
    cp -L "$lib" "$BUNDLE/lib/$(basename "$lib")"
    strip --strip-debug "$BUNDLE/lib/$(basename "$lib")" 2>/dev/null || true
  done
  du -sh "$BUNDLE"
}

# Runs one program (bundled or built) with a deadline; its gtest output goes to $out.
run_program() {
  local bin=$1 out=$2
  shift 2
  if [[ -x $BUNDLE/lib/ld-linux-x86-64.so.2 && $bin == "$BUNDLE"/* ]]; then
    # The bundle's libraries first; LD_LIBRARY_PATH after them, for a libcuda.so.1 that the
    # loader cache does not list (containers often mount the driver's libraries that way).
    local libs="$PWD/$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local loader="$PWD/$BUNDLE/lib/ld-linux-x86-64.so.2"
    KVWIRE_GPU_IPC_PEER="$loader --library-path $libs $PWD/$BUNDLE/bin/gpu_ipc_peer" \
      KVWIRE_GPU_SHM_SELF="$loader --library-path $libs $PWD/$BUNDLE/bin/gpu_shm_transfer_test" \
      timeout "$PER_PROGRAM_TIMEOUT" "$loader" --library-path "$libs" "$bin" "$@" >"$out" 2>&1
  else
    timeout "$PER_PROGRAM_TIMEOUT" "$bin" "$@" >"$out" 2>&1
  fi
}

run_all() {
  local bindir=$1
  local log
  log=$(mktemp -d)
  local start=$SECONDS status=0 p
  echo "kvwire gpu-check: $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv,noheader |
      sed 's/^/  gpu: /' || true
  else
    echo "  gpu: nvidia-smi not found"
  fi
  for p in "${PROGRAMS[@]}"; do
    if ! run_program "$(program_bin "$bindir" "$p")" "$log/$p.txt" --gtest_color=no; then
      status=1
    fi
  done
  printf '\n%-72s %-8s %8s\n' "test" "result" "ms"
  printf '%.0s-' {1..90}
  echo
  local passed=0 failed=0 skipped=0
  for p in "${PROGRAMS[@]}"; do
    # gtest prints "[       OK ] Suite.Test (12 ms)", "[  SKIPPED ] ...", "[  FAILED  ] ...".
    while IFS='|' read -r result name ms; do
      printf '%-72s %-8s %8s\n' "$name" "$result" "$ms"
      case $result in PASS) passed=$((passed + 1)) ;; SKIP) skipped=$((skipped + 1)) ;;
        *) failed=$((failed + 1)) ;; esac
    done < <(sed -nE 's/^\[ +(OK|SKIPPED|FAILED) +\] ([^ ]+) \(([0-9]+) ms\)$/\1|\2|\3/p' \
               "$log/$p.txt" | sed -E 's/^OK\|/PASS|/; s/^SKIPPED\|/SKIP|/; s/^FAILED\|/FAIL|/')
    if ! grep -qE '^\[  PASSED  \]' "$log/$p.txt"; then
      printf '%-72s %-8s %8s\n' "$p (whole program)" "FAIL" "-"
      failed=$((failed + 1))
      status=1
    fi
  done
  printf '%.0s-' {1..90}
  echo
  echo "passed $passed, skipped $skipped, failed $failed, in $((SECONDS - start)) s"
  # What the tests saw of the device, the reason a device test skipped (one line per
  # runtime), and any failure in full.
  grep -h -E '^(device [0-9]+: |kvwire gpu: )' "$log"/*.txt | sort -u | sed 's/^/  /' || true
  # GPU -> GPU over shm (IPC) vs a device-to-device copy, one row per size, in printed order.
  grep -h -E '^gpu shm: ' "$log"/*.txt | sed 's/^/  /' || true
  if [[ $status -ne 0 || $failed -ne 0 ]]; then
    for p in "${PROGRAMS[@]}"; do
      if grep -qE 'FAILED|Failure' "$log/$p.txt"; then
        echo "=== $p"
        grep -E -B2 -A12 'Failure|FAILED  \]|terminate|Sanitizer' "$log/$p.txt" | head -80
      fi
    done
    status=1
  fi
  rm -rf "$log"
  return $status
}

case ${1:-} in
  --bundle)
    make_bundle
    ;;
  --build)
    dir=${2:-build-cuda}
    build "$dir"
    run_all "$dir"
    ;;
  "")
    if [[ -x $BUNDLE/bin/gpu_runtime_test ]]; then
      run_all "$BUNDLE/bin"
    else
      build build-cuda
      run_all build-cuda
    fi
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'
    exit 2
    ;;
esac
