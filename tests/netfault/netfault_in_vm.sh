#!/bin/sh
# /opt/run.sh of the network fault matrix inside the test VM (tests/netfault/README.md):
# two network namespaces joined by a veth pair (nf_link.sh up), kvwire_netfault serve in nfb,
# kvwire_netfault run in nfa through every scenario of NF_SCENARIOS. Prints the markers the
# host harness (tests/rdma/vm/run_vm_tests.sh) judges: KVWIRE_VM_TESTS start/end rc=N.
. /opt/tests.env
up() { cut -d' ' -f1 /proc/uptime; }
echo "KVWIRE_VM_TESTS start uptime=$(up)"
finish() { echo "KVWIRE_VM_TESTS end rc=$1 uptime=$(up)"; exit "$1"; }
export KVWIRE_LOG_LEVEL=${KVWIRE_LOG_LEVEL:-warning}
for m in veth sch_netem; do
  grep -q "^$m " /proc/modules || { echo "KVWIRE_NF_FATAL module $m not loaded"; finish 1; }
done
"$NF_LINK" up || { echo "KVWIRE_NF_FATAL could not create the namespaces and the veth pair"; finish 1; }
# netem itself, before anything depends on it.
if ! "$NF_LINK" set delay 1ms || ! "$NF_LINK" clear; then
  echo "KVWIRE_NF_FATAL netem unusable in the VM (see above)"
  finish 1
fi
nsenter --net=/run/netns/nfa ping -c 1 -W 5 10.9.0.2 >/dev/null ||
  { echo "KVWIRE_NF_FATAL nfa cannot reach nfb over the veth pair"; finish 1; }
cd /tmp
nsenter --net=/run/netns/nfb "$TEST_BIN" serve --listen=10.9.0.2:7700 --max_seconds=3000 \
  >/tmp/server.log 2>&1 &
server=$!
# shellcheck disable=SC2086  # NF_ARGS is a list of flags
nsenter --net=/run/netns/nfa "$TEST_BIN" run --server=10.9.0.2:7700 --listen=10.9.0.1:0 \
  --link="$NF_LINK" --scenarios="$NF_SCENARIOS" $NF_ARGS
rc=$?
# The server exits on the client's quit; it is stopped here when the client could not say it.
i=0
while kill -0 "$server" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
kill "$server" 2>/dev/null
wait "$server"
src=$?
echo "--- server log (exit $src)"
cat /tmp/server.log
[ "$rc" = 0 ] && [ "$src" != 0 ] && { echo "KVWIRE_NF_FATAL the server exited with $src"; rc=1; }
finish "$rc"
