#!/usr/bin/env bash
# The reference servers under faults (tests/netfault/README.md), run inside the soft-RoCE test
# VM of tests/rdma/vm/ (this host's kernel has no sch_netem):
#   run_serve.sh <build dir> ci                 (ctest netfault_serve_vm)
#   run_serve.sh <build dir> full [table]       (make netfault-serve)
# full runs every scenario (clean, delay 20 ms + loss 1%, a 3 s partition), each in read and
# write mode; ci only the partition, with fewer requests. With [table], the section "The reference servers under
# faults" of that markdown file (docs/NETFAULT.md) is regenerated from the VM's console, also
# when a row fails (the stage still fails then). Fails, never skips, when the VM cannot run.
# KVWIRE_NFS_DECODE_ARGS: more flags for the decode server (--corrupt-kv-page plants a defect
# the rows must catch: README.md).
set -uo pipefail
build=$(readlink -f "${1:?usage: run_serve.sh <build dir> ci|full [table]}")
mode=${2:?}
table=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
case $mode in
  ci)
    args="--requests=4 --window=2 --after=1 --max_tokens=8"
    timeout=${KVWIRE_VM_TIMEOUT:-600}
    ;;
  full)
    args="--requests=8 --window=2 --after=2 --max_tokens=8"
    timeout=${KVWIRE_VM_TIMEOUT:-1200}
    ;;
  *) echo "run_serve.sh: mode must be ci or full" >&2; exit 2 ;;
esac
# ci: the partition only (read and write), the scenario that fails requests; the full run
# has the others.
default=clean,delay20loss1,partition3
[[ $mode == ci ]] && default=partition3
scenarios=${KVWIRE_NFS_SCENARIOS:-$default}
work=$build/netfault-serve-vm
driver=$build/tests/netfault/kvwire_netfault_serve
dsv4=$build/examples/dsv4/serve/kvwire-dsv4
config=$(readlink -f "$here/../../examples/dsv4/configs/tiny.json")
for f in "$driver" "$dsv4"; do
  [[ -x $f ]] || { echo "run_serve.sh: $f not built" >&2; exit 1; }
done
mkdir -p "$work"
# Without its debug information: the VM unpacks it from its initramfs under TCG.
strip -o "$work/kvwire-dsv4" "$dsv4" || { echo "run_serve.sh: strip failed" >&2; exit 1; }
KVWIRE_VM_TIMEOUT=$timeout "$here/../rdma/vm/run_vm_tests.sh" --stage netfault-serve \
  --run "$here/netfault_serve_in_vm.sh" --work "$work" \
  --env "NF_NET=$here/nf_serve_net.sh" --env "DSV4=$work/kvwire-dsv4" \
  --env "DSV4_CONFIG=$config" --env "NFS_SCENARIOS=$scenarios" --env "NFS_ARGS=$args" \
  --env "NFS_DECODE_ARGS=${KVWIRE_NFS_DECODE_ARGS:-}" \
  "$build/rdma-vm" "$driver" "$work/kvwire-dsv4" "$here/nf_serve_net.sh" "$config"
rc=$?
grep -a '^KVWIRE_NFS_ROW' "$work/vm.log" 2>/dev/null
if [[ -n "$table" ]]; then
  python3 "$here/make_serve_table.py" "$work/vm.log" "$table" --args="$args" || rc=1
fi
exit $rc
