#!/bin/sh
# /opt/run.sh inside the VM: the rdma tests (gtest), then the devices seen.
. /opt/tests.env
echo "KVWIRE_VM_TESTS start uptime=$(cut -d' ' -f1 /proc/uptime)"
ibv_devices
export KVWIRE_LOG_LEVEL=${KVWIRE_LOG_LEVEL:-warning}
cd /tmp && "$TEST_BIN" --gtest_color=no --gtest_filter="$GTEST_FILTER"
rc=$?
echo "KVWIRE_VM_TESTS end rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
exit $rc
