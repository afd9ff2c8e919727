#!/usr/bin/env bash
# Installs the Debian packages kvwire needs to build and test. Idempotent and quiet when
# everything is present; run as root (or via sudo) on Debian 12. Extra package names given
# as arguments are installed too; `--compare` adds the side-by-side comparison's tools.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config make git
  libboost-dev libboost-system-dev
  libprotobuf-dev protobuf-compiler
  libabsl-dev
  libgtest-dev libgmock-dev
  libibverbs-dev librdmacm-dev rdma-core
  liburing-dev
  # rdma transport tests: soft-RoCE (rdma_rxe) in a qemu VM booting Debian's kernel
  # (tests/rdma/vm/), the rxe provider and tools it packs, and the post-path benchmark.
  qemu-system-x86 busybox-static cpio ibverbs-providers ibverbs-utils iproute2
  libbenchmark-dev
  libssl-dev
  # Connector: JSON (layouts, kv_transfer_params) and the Python binding.
  nlohmann-json3-dev pybind11-dev python3-dev python3-venv
  # vLLM connector plugin tests (python/): real torch CPU tensors; the vLLM-style P/D proxy
  # in the serving tests speaks HTTP through httpx/aiohttp.
  python3-torch python3-numpy python3-httpx python3-aiohttp
  # Discovery (issue 16): tests start a real etcd (v3 API) on loopback; etcdctl for checks;
  # openssl makes the certificates of the TLS etcd tests.
  etcd-server etcd-client openssl
  # Metrics (issue 14): tests check the Prometheus output with `promtool check metrics`.
  prometheus
  # Sanitizer builds (make test-asan / test-tsan): clang, its runtimes, and the symbolizer
  # that turns sanitizer stack traces into file:line. libclang-rt-14-dev also holds libFuzzer
  # (libclang_rt.fuzzer*.a) for `make fuzz`.
  clang libclang-rt-14-dev llvm
  clang-format
  # Compiler cache: CI builds three trees from a fresh clone each run; ccache makes the
  # second and later runs on one machine mostly cache hits.
  ccache
  # setarch (util-linux) disables ASLR for TSan on kernels whose mmap layout it rejects.
  util-linux
  # GPU shim (src/gpu, cmake/gpu.cmake): the HIP backend and its kernels compile for
  # gfx90a/gfx940 in every build, so that they never rot (about 66 MB download, 350 MB on
  # disk, ~20 s to install). The CUDA backend uses nvcc from /usr/local/cuda when present.
  hipcc libamdhip64-dev
)
# `--compare`: what `make compare` (perf/compare/) runs besides kvwire; not needed by `make test`.
# valgrind: perf/cpu/callgrind.sh (make cpu-bench), instructions per Transfer. python3-venv: the
# peers' virtual environment (scripts/compare-venv.sh: NIXL, Mooncake, UCX from PyPI).
compare_packages=(ucx-utils iperf3 gnuplot-nox python3 python3-venv valgrind)
if [[ ${1:-} == --compare ]]; then
  shift
  packages+=("${compare_packages[@]}")
fi
if [[ $# -gt 0 ]]; then packages+=("$@"); fi

# One dpkg-query for all packages; a package dpkg has never heard of prints nothing (and
# makes dpkg-query exit non-zero), so it counts as missing.
installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${packages[@]}" 2>/dev/null || true)
missing=()
for p in "${packages[@]}"; do
  if ! grep -qx "${p%%:*} install ok installed" <<<"$installed"; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
