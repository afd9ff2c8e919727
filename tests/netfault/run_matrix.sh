#!/usr/bin/env bash
# The network fault matrix over tcp (tests/netfault/README.md), run inside the soft-RoCE test
# VM of tests/rdma/vm/ (this host's kernel has no sch_netem; Debian's, booted there, does):
#   run_matrix.sh <build dir> <kvwire_netfault binary> ci            (ctest netfault_vm)
#   run_matrix.sh <build dir> <kvwire_netfault binary> full [table]  (make netfault)
# ci: clean, delay 10 ms, loss 1% and a 3 s partition that heals, small transfers (about two
# minutes under TCG). full: every scenario of kvwire_netfault, larger transfers; with [table],
# regenerates that markdown file (docs/NETFAULT.md) from the VM's console, also when a row
# fails (the stage still fails then). Fails, never skips, when the VM cannot run.
set -uo pipefail
build=$(readlink -f "${1:?usage: run_matrix.sh <build dir> <driver> ci|full [table]}")
driver=$(readlink -f "${2:?}")
mode=${3:?}
table=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
case $mode in
  ci)
    scenarios=clean,delay10,loss1,partition3
    args="--transfers=32 --after=4 --window=4 --ops=8 --op_bytes=65536"
    timeout=${KVWIRE_VM_TIMEOUT:-330}
    ;;
  full)
    scenarios=clean,delay10,delay50,loss1,loss10,reorder25,duplicate1,corrupt0.1,corrupt0.1+verify,partition3,partition-forever
    args="--transfers=64 --after=8 --window=4 --ops=8 --op_bytes=65536"
    timeout=${KVWIRE_VM_TIMEOUT:-1800}
    ;;
  *) echo "run_matrix.sh: mode must be ci or full" >&2; exit 2 ;;
esac
scenarios=${KVWIRE_NF_SCENARIOS:-$scenarios}
work=$build/netfault-vm
KVWIRE_VM_TIMEOUT=$timeout "$here/../rdma/vm/run_vm_tests.sh" --stage netfault \
  --run "$here/netfault_in_vm.sh" --work "$work" \
  --env "NF_LINK=$here/nf_link.sh" --env "NF_SCENARIOS=$scenarios" --env "NF_ARGS=$args" \
  "$build/rdma-vm" "$driver" "$here/nf_link.sh"
rc=$?
grep -a '^KVWIRE_NF_ROW' "$work/vm.log" 2>/dev/null
if [[ -n "$table" ]]; then
  python3 "$here/make_table.py" "$work/vm.log" "$table" --args="$args" || rc=1
fi
exit $rc
