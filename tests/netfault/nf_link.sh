#!/bin/sh
# nf_link.sh: the link of the network fault matrix, inside the test VM (tests/netfault/).
# A veth pair joins network namespace nfa (end nfa, 10.9.0.1) and nfb (end nfb, 10.9.0.2);
# faults are netem qdiscs on the egress of BOTH ends, so both directions see them (a delay of
# 10 ms is 10 ms each way, a loss of 1% is 1% of the packets each way).
#   nf_link.sh up                  create the namespaces and the pair (once, at the start)
#   nf_link.sh set <netem args>    replace the fault, e.g. `set loss 1%`, `set loss 100%`
#   nf_link.sh clear               remove the fault
#   nf_link.sh show                netem's counters on both ends (sent, dropped, ...)
#   nf_link.sh tcpstats            the kernel's counters of both namespaces, summed:
#                                  "retrans=N csum_errors=N ip_hdr_errors=N" (TCP segments
#                                  retransmitted; segments TCP dropped for a bad checksum;
#                                  packets IP dropped for a bad header)
# Exits non-zero when a command fails (the driver then fails the scenario).
# Absolute paths: busybox (the VM's nsenter and shell) prefers its own applets of these names.
TC=/usr/sbin/tc
IP=/usr/bin/ip
in_ns() { ns=$1; shift; nsenter --net=/run/netns/$ns "$@"; }
cmd=$1
[ $# -gt 0 ] && shift
rc=0
case $cmd in
  up)
    mkdir -p /run/netns
    $IP netns add nfa && $IP netns add nfb || exit 1
    # One packet per skb (no TSO/GSO super-packets): netem then drops, delays, duplicates and
    # corrupts wire-sized packets, as a switch would.
    $IP link add nfa gso_max_segs 1 type veth peer name nfb gso_max_segs 1 ||
      { echo "nf_link: veth with gso_max_segs 1 refused; default offloads" >&2
        $IP link add nfa type veth peer name nfb || exit 1; }
    $IP link set nfa netns nfa && $IP link set nfb netns nfb || exit 1
    in_ns nfa $IP addr add 10.9.0.1/24 dev nfa && in_ns nfa $IP link set nfa up &&
      in_ns nfa $IP link set lo up || exit 1
    in_ns nfb $IP addr add 10.9.0.2/24 dev nfb && in_ns nfb $IP link set nfb up &&
      in_ns nfb $IP link set lo up || exit 1
    in_ns nfa $IP -d link show nfa | grep -o 'gso_max_segs [0-9]*' | head -1
    ;;
  set)
    for end in nfa nfb; do
      # limit: netem's queue (1000 packets by default) must not add tail drops of its own.
      in_ns $end $TC qdisc replace dev $end root netem limit 100000 "$@" || rc=1
    done
    ;;
  clear)
    for end in nfa nfb; do
      if in_ns $end $TC qdisc show dev $end | grep -q netem; then
        in_ns $end $TC qdisc del dev $end root || rc=1
      fi
    done
    ;;
  show)
    for end in nfa nfb; do
      echo "nf_link: $end: $(in_ns $end $TC -s qdisc show dev $end | tr '\n' ' ')"
    done
    ;;
  tcpstats)
    for end in nfa nfb; do
      # /proc/net is the reading process's namespace.
      in_ns $end cat /proc/net/snmp
    done | awk '
      $1 == "Tcp:" || $1 == "Ip:" {
        if ($2 ~ /^[A-Za-z]/) { for (i = 2; i <= NF; i++) col[$1 $i] = i; next }
        if ($1 == "Tcp:") { r += $col["Tcp:RetransSegs"]; c += $col["Tcp:InCsumErrors"] }
        else { h += $col["Ip:InHdrErrors"] }
      }
      END { printf "retrans=%d csum_errors=%d ip_hdr_errors=%d\n", r, c, h }'
    ;;
  *)
    echo "usage: nf_link.sh up | set <netem args> | clear | show | tcpstats" >&2
    exit 2
    ;;
esac
exit $rc
