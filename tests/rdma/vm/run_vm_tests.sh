#!/usr/bin/env bash
# ctest entry point of the rdma VM stage:
#   run_vm_tests.sh <cache dir> <rdma test binary> <test peer binary> [more binaries...]
# Builds (or reuses) the VM image in <cache dir>, packs the test binaries and their shared
# libraries (at their host paths) into an overlay initramfs, boots Debian's kernel under qemu
# TCG, runs the tests inside against soft-RoCE (rdma_rxe) and fails unless they pass. Every
# reason the VM cannot start is a failure, never a skip. The console log is printed and kept
# in <cache dir>/vm.log.
set -uo pipefail
cache=${1:?usage: run_vm_tests.sh <cache dir> <test binary> <peer binary>}
test_bin=$(readlink -f "${2:?}")
peer_bin=$(readlink -f "${3:?}")
here=$(cd "$(dirname "$0")" && pwd)
vm_timeout=${KVWIRE_VM_TIMEOUT:-600}
fail() { echo "rdma VM stage FAILED: $*" >&2; exit 1; }
start=$(date +%s)

for tool in qemu-system-x86_64 cpio gzip busybox apt-cache dpkg-deb ldd; do
  command -v "$tool" >/dev/null || fail "$tool not found (run scripts/install-deps.sh)"
done
mkdir -p "$cache"
"$here/build_image.sh" "$cache" || fail "building the VM image (see above)"

overlay=$(mktemp -d)
trap 'rm -rf "$overlay"' EXIT
mkdir -p "$overlay/opt"
extra=()
for f in "${@:4}"; do extra+=("$(readlink -f "$f")"); done
"$here/copy_with_libs.sh" "$overlay" "$test_bin" "$peer_bin" "${extra[@]}" || fail "packing the test binaries"
cp "$here/run_in_vm.sh" "$overlay/opt/run.sh"
chmod +x "$overlay/opt/run.sh"
# The leak check (valgrind, in run_in_vm.sh) runs its tests alone; KVWIRE_VM_LEAKCHECK=0 skips
# it, KVWIRE_VM_LEAK_FILTER picks a subset of them.
leak_filter=${KVWIRE_VM_LEAK_FILTER:-RdmaLeakCheck.*}
[[ ${KVWIRE_VM_LEAKCHECK:-1} == 0 ]] && leak_filter=
{
  echo "TEST_BIN=$test_bin"
  echo "GTEST_FILTER='${KVWIRE_VM_GTEST_FILTER:-*:-RdmaLeakCheck.*}'"
  echo "LEAK_FILTER='$leak_filter'"
} > "$overlay/opt/tests.env"
(cd "$overlay" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$cache/overlay.cpio.gz" ||
  fail "packing the overlay"
cat "$cache/base.cpio.gz" "$cache/overlay.cpio.gz" > "$cache/initrd.cpio.gz"

echo "rdma VM: booting $(cat "$cache/stamp" | cut -d' ' -f1) under qemu TCG (timeout ${vm_timeout}s)"
vm_start=$(date +%s)
timeout --kill-after=10 "$vm_timeout" qemu-system-x86_64 \
  -accel tcg,thread=multi -cpu max -smp 2 -m 3072 -nic none -nographic -no-reboot \
  -kernel "$cache/vmlinuz" -initrd "$cache/initrd.cpio.gz" \
  -append "console=ttyS0 rdinit=/init panic=-1 loglevel=4" </dev/null >"$cache/vm.log" 2>&1
qemu_rc=$?
end=$(date +%s)
cat "$cache/vm.log"
echo "rdma VM: qemu exit $qemu_rc, VM wall $((end - vm_start)) s, stage total $((end - start)) s"
grep -q KVWIRE_VM_BOOTED "$cache/vm.log" ||
  fail "the VM did not boot (qemu exit $qemu_rc; see the console log above)"
grep -q KVWIRE_VM_READY "$cache/vm.log" ||
  fail "the VM booted but soft-RoCE did not come up: $(grep -a KVWIRE_VM_NOT_READY "$cache/vm.log")"
result=$(grep -a -o 'KVWIRE_VM_RESULT rc=[0-9]*' "$cache/vm.log" | tail -1)
[[ -n "$result" ]] || fail "no test result from the VM (qemu exit $qemu_rc: timeout or crash)"
# Skips and empty runs inside the VM are failures of the stage, named here for ctest's log.
if grep -a -q 'KVWIRE_VM_SKIPPED\|KVWIRE_VM_ZERO_TESTS' "$cache/vm.log"; then
  grep -a 'KVWIRE_VM_SKIPPED\|KVWIRE_VM_ZERO_TESTS' "$cache/vm.log" >&2
  fail "tests skipped or none ran in the VM ($result; listed above)"
fi
[[ "$result" == "KVWIRE_VM_RESULT rc=0" ]] || fail "rdma tests failed in the VM ($result)"
ran=$(grep -a -o 'KVWIRE_VM_TESTS end rc=0' "$cache/vm.log" | head -1)
[[ -n "$ran" ]] || fail "the VM reported success without a test run (no 'KVWIRE_VM_TESTS end rc=0')"
echo "rdma VM stage passed"
