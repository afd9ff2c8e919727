#!/bin/sh
# /opt/run.sh of the serving fault test inside the test VM (tests/netfault/README.md, "The
# reference servers under faults"): three network namespaces (nf_serve_net.sh up): prefill
# in nfp, decode in nfd, the aggregated server, the read and write routers and the client
# (kvwire_netfault_serve) in nfr; netem only on the prefill-decode link. Every process is
# stopped with SIGTERM at the end and must exit 0. Prints the markers the host harness
# (tests/rdma/vm/run_vm_tests.sh) judges: KVWIRE_VM_TESTS start/end rc=N.
. /opt/tests.env
up() { cut -d' ' -f1 /proc/uptime; }
echo "KVWIRE_VM_TESTS start uptime=$(up)"
names="router-read router-write aggregated prefill decode"
finish() {
  for name in $names; do
    pid=$(cat "/tmp/nfs/$name.pid" 2>/dev/null) && kill -TERM "$pid" 2>/dev/null
  done
  for name in $names; do
    pid=$(cat "/tmp/nfs/$name.pid" 2>/dev/null) || continue
    i=0
    while kill -0 "$pid" 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
      echo "KVWIRE_NFS_FATAL $name did not stop within 30 s of SIGTERM"
      kill -KILL "$pid"
      set -- 1
    fi
    wait "$pid"
    code=$?
    echo "--- $name log (exit $code)"
    tail -n 40 "/tmp/nfs/$name.log"
    [ "$code" = 0 ] || { echo "KVWIRE_NFS_FATAL $name exited $code"; set -- 1; }
  done
  echo "KVWIRE_VM_TESTS end rc=$1 uptime=$(up)"
  exit "$1"
}
fatal() { echo "KVWIRE_NFS_FATAL $*"; finish 1; }
export KVWIRE_LOG_LEVEL=${KVWIRE_LOG_LEVEL:-warning}
# The KV peers authenticate (their engines listen beyond loopback), as on a real network.
export KVWIRE_SECRET=netfault-serve-shared-secret
for m in veth sch_netem; do
  grep -q "^$m " /proc/modules || fatal "module $m not loaded"
done
"$NF_NET" up || fatal "could not create the namespaces and veth pairs"
"$NF_NET" set delay 1ms && "$NF_NET" clear || fatal "netem unusable in the VM (see above)"
for hop in nfp:10.9.1.2 nfp:10.9.1.3 nfd:10.9.1.3; do
  nsenter --net=/run/netns/${hop%%:*} ping -c 1 -W 5 ${hop#*:} >/dev/null ||
    fatal "${hop%%:*} cannot reach ${hop#*:}"
done
w=/tmp/nfs
mkdir -p $w
cd $w
"$DSV4" weights --config "$DSV4_CONFIG" --out $w/tiny.safetensors >/dev/null ||
  fatal "kvwire-dsv4 weights failed"
# start <name> <namespace> <kvwire-dsv4 args...>: in the background, its pid in <name>.pid.
start() {
  name=$1 ns=$2
  shift 2
  nsenter --net=/run/netns/$ns "$DSV4" "$@" --ready-file $w/$name.ready >$w/$name.log 2>&1 &
  echo $! >$w/$name.pid
}
# wait_ready <name>...: each one's ready file, within 180 s (model loads under TCG are slow).
wait_ready() {
  for name in "$@"; do
    i=0
    until [ -s $w/$name.ready ]; do
      kill -0 "$(cat $w/$name.pid)" 2>/dev/null || { cat $w/$name.log; fatal "$name exited"; }
      [ $i -lt 1800 ] || { cat $w/$name.log; fatal "$name not ready in 180 s"; }
      sleep 0.1
      i=$((i + 1))
    done
  done
}
common="--config $DSV4_CONFIG --weights $w/tiny.safetensors --transport tcp --mode auto
  --threads 1 --request-timeout-s ${NFS_REQUEST_TIMEOUT_S:-60}"
# shellcheck disable=SC2086  # $common is a list of flags
start aggregated nfr serve --role both --host 127.0.0.1 --port 8000 $common
start prefill nfp serve --role prefill --host 10.9.1.1 --port 8001 $common
# NFS_DECODE_ARGS: more decode flags, to plant a defect (run_serve.sh, README.md).
start decode nfd serve --role decode --host 10.9.1.2 --port 8002 $common $NFS_DECODE_ARGS
wait_ready aggregated prefill decode
for mode in read write; do
  port=8003
  [ $mode = write ] && port=8004
  start router-$mode nfr router --prefill 10.9.1.1:8001 --decode 10.9.1.2:8002 --mode $mode \
    --host 10.9.1.3 --port $port --timeout-s ${NFS_ROUTER_TIMEOUT_S:-120}
done
wait_ready router-read router-write
echo "KVWIRE_NFS_SERVERS_READY uptime=$(up)"
# shellcheck disable=SC2086  # NFS_ARGS is a list of flags
nsenter --net=/run/netns/nfr "$TEST_BIN" --aggregated=127.0.0.1:8000 --prefill=10.9.1.1:8001 \
  --decode=10.9.1.2:8002 --read_router=10.9.1.3:8003 --write_router=10.9.1.3:8004 \
  --link="$NF_NET" --scenarios="$NFS_SCENARIOS" $NFS_ARGS
finish $?
