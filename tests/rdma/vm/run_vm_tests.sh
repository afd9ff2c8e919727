#!/usr/bin/env bash
# ctest entry point of the rdma VM stage (and of other stages that run in the same VM):
#   run_vm_tests.sh [options] <cache dir> <rdma test binary> <test peer binary> [more files...]
# Builds (or reuses) the VM image in <cache dir>, packs the test binaries and their shared
# libraries (at their host paths) into an overlay initramfs, boots Debian's kernel under qemu
# TCG, runs the tests inside against soft-RoCE (rdma_rxe) and fails unless they pass. Every
# reason the VM cannot start is a failure, never a skip. The console log is printed and kept
# in <cache dir>/vm.log (or --work).
# Options, for another stage in the same image (tests/netfault/ uses them):
#   --stage NAME   its name in messages (default rdma)
#   --run SCRIPT   the VM's /opt/run.sh (default run_in_vm.sh beside this script); it must
#                  print "KVWIRE_VM_TESTS end rc=N" like run_in_vm.sh
#   --work DIR     where the overlay, the initrd and vm.log go (default <cache dir>), so that
#                  stages sharing the image keep their own console logs
#   --env K=V      one more line of /opt/tests.env (repeatable)
set -uo pipefail
stage=rdma
run_script=$(cd "$(dirname "$0")" && pwd)/run_in_vm.sh
work=
extra_env=()
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --stage) stage=${2:?}; shift 2 ;;
    --run) run_script=$(readlink -f "${2:?}"); shift 2 ;;
    --work) work=${2:?}; shift 2 ;;
    --env) extra_env+=("${2:?}"); shift 2 ;;
    *) echo "run_vm_tests.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
cache=${1:?usage: run_vm_tests.sh [options] <cache dir> <test binary> <peer binary>}
test_bin=$(readlink -f "${2:?}")
peer_bin=$(readlink -f "${3:?}")
here=$(cd "$(dirname "$0")" && pwd)
vm_timeout=${KVWIRE_VM_TIMEOUT:-600}
fail() { echo "$stage VM stage FAILED: $*" >&2; exit 1; }
start=$(date +%s)

for tool in qemu-system-x86_64 cpio gzip busybox apt-cache dpkg-deb ldd; do
  command -v "$tool" >/dev/null || fail "$tool not found (run scripts/install-deps.sh)"
done
mkdir -p "$cache"
"$here/build_image.sh" "$cache" || fail "building the VM image (see above)"
work=${work:-$cache}
mkdir -p "$work"

overlay=$(mktemp -d)
trap 'rm -rf "$overlay"' EXIT
mkdir -p "$overlay/opt"
extra=()
for f in "${@:4}"; do extra+=("$(readlink -f "$f")"); done
"$here/copy_with_libs.sh" "$overlay" "$test_bin" "$peer_bin" "${extra[@]}" || fail "packing the test binaries"
cp "$run_script" "$overlay/opt/run.sh"
chmod +x "$overlay/opt/run.sh"
# The leak check (valgrind, in run_in_vm.sh) runs its tests alone; KVWIRE_VM_LEAKCHECK=0 skips
# it, KVWIRE_VM_LEAK_FILTER picks a subset of them.
leak_filter=${KVWIRE_VM_LEAK_FILTER:-RdmaLeakCheck.*}
[[ ${KVWIRE_VM_LEAKCHECK:-1} == 0 ]] && leak_filter=
{
  echo "TEST_BIN=$test_bin"
  # The slow rdma fault cases (loss 10%, delay 50 ms with jitter) and the 32-phase check of
  # rxe's retry race run under make rdma-faults only (tests/rdma/README.md).
  echo "GTEST_FILTER='${KVWIRE_VM_GTEST_FILTER:-*:-RdmaLeakCheck.*:RdmaNetemSlowTest.*:RdmaRxeRetryRaceTest.*}'"
  echo "LEAK_FILTER='$leak_filter'"
  for kv in "${extra_env[@]}"; do echo "${kv%%=*}='${kv#*=}'"; done
} > "$overlay/opt/tests.env"
(cd "$overlay" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$work/overlay.cpio.gz" ||
  fail "packing the overlay"
cat "$cache/base.cpio.gz" "$work/overlay.cpio.gz" > "$work/initrd.cpio.gz"

echo "$stage VM: booting $(cat "$cache/stamp" | cut -d' ' -f1) under qemu TCG (timeout ${vm_timeout}s)"
vm_start=$(date +%s)
# no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer check can miss its
# ticks and panic at boot ("IO-APIC + timer doesn't work!"), seen with a load of 10 on 2 cores.
timeout --kill-after=10 "$vm_timeout" qemu-system-x86_64 \
  -accel tcg,thread=multi -cpu max -smp 2 -m 3072 -nic none -nographic -no-reboot \
  -kernel "$cache/vmlinuz" -initrd "$work/initrd.cpio.gz" \
  -append "console=ttyS0 rdinit=/init panic=-1 loglevel=4 no_timer_check" </dev/null >"$work/vm.log" 2>&1
qemu_rc=$?
end=$(date +%s)
cat "$work/vm.log"
echo "$stage VM: qemu exit $qemu_rc, VM wall $((end - vm_start)) s, stage total $((end - start)) s"
grep -q KVWIRE_VM_BOOTED "$work/vm.log" ||
  fail "the VM did not boot (qemu exit $qemu_rc; see the console log above)"
grep -q KVWIRE_VM_READY "$work/vm.log" ||
  fail "the VM booted but soft-RoCE did not come up: $(grep -a KVWIRE_VM_NOT_READY "$work/vm.log")"
result=$(grep -a -o 'KVWIRE_VM_RESULT rc=[0-9]*' "$work/vm.log" | tail -1)
[[ -n "$result" ]] || fail "no test result from the VM (qemu exit $qemu_rc: timeout or crash)"
# Skips and empty runs inside the VM are failures of the stage, named here for ctest's log.
if grep -a -q 'KVWIRE_VM_SKIPPED\|KVWIRE_VM_ZERO_TESTS' "$work/vm.log"; then
  grep -a 'KVWIRE_VM_SKIPPED\|KVWIRE_VM_ZERO_TESTS' "$work/vm.log" >&2
  fail "tests skipped or none ran in the VM ($result; listed above)"
fi
[[ "$result" == "KVWIRE_VM_RESULT rc=0" ]] || fail "$stage tests failed in the VM ($result)"
ran=$(grep -a -o 'KVWIRE_VM_TESTS end rc=0' "$work/vm.log" | head -1)
[[ -n "$ran" ]] || fail "the VM reported success without a test run (no 'KVWIRE_VM_TESTS end rc=0')"
echo "$stage VM stage passed"
