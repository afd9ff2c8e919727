#!/bin/sh
# nf_serve_net.sh: the network of the serving fault test, inside the test VM (tests/netfault/,
# README.md "The reference servers under faults"). Three network namespaces, each with one
# address on its loopback that every process there binds to:
#   nfp  prefill  10.9.1.1        nfd  decode  10.9.1.2        nfr  routers and client  10.9.1.3
# joined by three veth pairs, one per pair of namespaces (a triangle), with a host route to
# each other namespace's address over its own pair. So every packet between prefill and decode
# (KV transfers, the connectors' control connections, the decode's hand-off releases) crosses
# the pair pd (in nfp) - dp (in nfd), and only that pair gets netem; the router's and client's
# HTTP calls cross the clean pairs.
#   nf_serve_net.sh up               create the namespaces, the pairs and the routes
#   nf_serve_net.sh set <netem args> replace the fault on the prefill-decode pair (both ends)
#   nf_serve_net.sh clear            remove it
#   nf_serve_net.sh show             netem's counters on both ends
# Exits non-zero when a command fails. Absolute paths: busybox's applets of these names would
# win otherwise.
TC=/usr/sbin/tc
IP=/usr/bin/ip
in_ns() { ns=$1; shift; nsenter --net=/run/netns/$ns "$@"; }
addr() { case $1 in nfp) echo 10.9.1.1 ;; nfd) echo 10.9.1.2 ;; nfr) echo 10.9.1.3 ;; esac; }
# pair <ns a> <end a> <ns b> <end b>: a veth pair, one end in each, and the routes over it.
pair() {
  # One packet per skb (no TSO/GSO super-packets): netem sees wire-sized packets.
  $IP link add "$2" gso_max_segs 1 type veth peer name "$4" gso_max_segs 1 ||
    $IP link add "$2" type veth peer name "$4" || return 1
  $IP link set "$2" netns "$1" && $IP link set "$4" netns "$3" || return 1
  in_ns "$1" $IP link set "$2" up && in_ns "$3" $IP link set "$4" up || return 1
  in_ns "$1" $IP route add "$(addr "$3")/32" dev "$2" src "$(addr "$1")" &&
    in_ns "$3" $IP route add "$(addr "$1")/32" dev "$4" src "$(addr "$3")"
}
cmd=$1
[ $# -gt 0 ] && shift
rc=0
case $cmd in
  up)
    mkdir -p /run/netns
    for ns in nfp nfd nfr; do
      $IP netns add $ns || exit 1
      in_ns $ns $IP link set lo up && in_ns $ns $IP addr add "$(addr $ns)/32" dev lo || exit 1
    done
    pair nfp pd nfd dp && pair nfp pr nfr rp && pair nfd dr nfr rd || exit 1
    ;;
  set)
    in_ns nfp $TC qdisc replace dev pd root netem limit 100000 "$@" || rc=1
    in_ns nfd $TC qdisc replace dev dp root netem limit 100000 "$@" || rc=1
    ;;
  clear)
    for e in nfp:pd nfd:dp; do
      ns=${e%%:*} dev=${e#*:}
      if in_ns $ns $TC qdisc show dev $dev | grep -q netem; then
        in_ns $ns $TC qdisc del dev $dev root || rc=1
      fi
    done
    ;;
  show)
    for e in nfp:pd nfd:dp; do
      ns=${e%%:*} dev=${e#*:}
      echo "nf_serve_net: $dev: $(in_ns $ns $TC -s qdisc show dev $dev | tr '\n' ' ')"
    done
    ;;
  *)
    echo "usage: nf_serve_net.sh up | set <netem args> | clear | show" >&2
    exit 2
    ;;
esac
exit $rc
