#!/bin/sh
# /opt/run.sh inside the VM: the rdma tests (gtest), then the leak check: the
# connect-transfer-disconnect cycle under valgrind, failing on a definite or indirect leak or
# an invalid access.
. /opt/tests.env
echo "KVWIRE_VM_TESTS start uptime=$(cut -d' ' -f1 /proc/uptime)"
ibv_devices
export KVWIRE_LOG_LEVEL=${KVWIRE_LOG_LEVEL:-warning}
# The device count the tests expect, asserted inside by RdmaVmEnvironment.HasBothRxeDevices.
export KVWIRE_VM_EXPECT_DEVICES=2
# A run is judged on its own words too: a filter that selects no test, or a test that skips
# (every device the tests need is here by construction), fails the stage; skipped tests are
# named on the console so that ctest's output shows them.
judge() {  # judge <log> <rc> <what>
  ran=$(sed -n 's/^\[==========\] \([0-9]*\) tests* from .* ran\..*/\1/p' "$1" | tail -1)
  if [ -z "$ran" ] || [ "$ran" = 0 ]; then
    echo "KVWIRE_VM_ZERO_TESTS $3: no test ran (filter selects nothing?)"
    return 96
  fi
  if grep -q '^\[  SKIPPED \]' "$1"; then
    grep '^\[  SKIPPED \] [A-Za-z]' "$1" | sed 's/^/KVWIRE_VM_SKIPPED /'
    return 95
  fi
  return "$2"
}
cd /tmp
# The program's own status, kept past tee (whose status would hide it).
{ "$TEST_BIN" --gtest_color=no --gtest_filter="$GTEST_FILTER" 2>&1; echo $? >/tmp/tests.rc; } |
  tee /tmp/tests.log
rc=$(cat /tmp/tests.rc 2>/dev/null || echo 1)
judge /tmp/tests.log "$rc" "rdma tests"
rc=$?
echo "KVWIRE_VM_TESTS end rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
if [ "$rc" = 0 ] && [ -n "$LEAK_FILTER" ]; then
  echo "KVWIRE_VM_LEAKCHECK start uptime=$(cut -d' ' -f1 /proc/uptime)"
  # --undef-value-errors=no: the kernel fills verbs command responses and the rxe queues
  # (mmap'ed) behind valgrind's back, so definedness tracking would only report noise.
  # Leaks and invalid accesses are checked in full; allocation stacks only (valgrind under
  # TCG is slow, and a stack per free would double the cost of every malloc/free pair).
  valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite,indirect \
    --errors-for-leak-kinds=definite,indirect --undef-value-errors=no --error-exitcode=97 \
    --keep-stacktraces=alloc --num-callers=16 \
    "$TEST_BIN" --gtest_color=no --gtest_filter="$LEAK_FILTER" >/tmp/leak.log 2>&1
  rc=$?
  cat /tmp/leak.log
  judge /tmp/leak.log "$rc" "leak check"
  rc=$?
  echo "KVWIRE_VM_LEAKCHECK end rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
fi
exit $rc
