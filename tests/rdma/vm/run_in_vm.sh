#!/bin/sh
# /opt/run.sh inside the VM: the rdma tests (gtest), then the leak check: the
# connect-transfer-disconnect cycle under valgrind, failing on a definite or indirect leak or
# an invalid access.
. /opt/tests.env
echo "KVWIRE_VM_TESTS start uptime=$(cut -d' ' -f1 /proc/uptime)"
ibv_devices
export KVWIRE_LOG_LEVEL=${KVWIRE_LOG_LEVEL:-warning}
cd /tmp && "$TEST_BIN" --gtest_color=no --gtest_filter="$GTEST_FILTER"
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
    "$TEST_BIN" --gtest_color=no --gtest_filter="$LEAK_FILTER"
  rc=$?
  echo "KVWIRE_VM_LEAKCHECK end rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
fi
exit $rc
