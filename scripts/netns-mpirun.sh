#!/usr/bin/env bash
# Runs an MPI program with one rank on each of P separate hosts, on one machine: every host is a
# network namespace with its own address (10.213.0.1, .2, ...) and host name, and the hosts are
# joined by a bridge in one more namespace, as machines are by a switch. Open MPI starts the remote
# ranks through this script (its plm_rsh_agent, in place of ssh) and, told to use only TCP on
# that network, sends every byte between ranks through the hosts' links, never through shared
# memory. --rate caps each host's link in both directions (tc's htb on the host's end and on the
# switch's end); the ranks and Open MPI's own traffic share it, as they would share a real link.
#   scripts/netns-mpirun.sh [--rate RATE] -np P PROGRAM [ARGS...]
#     RATE as tc writes it (1gbit, 10gbit, 500mbit); without --rate the links run at the kernel's
#     pace. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and unshare. Removes every
#     namespace it made when it exits, however it exits. Last, prints to stderr the bytes each host
#     sent on its link. Exit status: the program's (mpirun's); 77 where namespaces cannot be made
#     here (a container without the capability, for example).
set -euo pipefail

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

# Open MPI calls the agent as `AGENT HOST COMMAND...`, and COMMAND is a line for a remote shell,
# already quoted for one, as ssh would pass it.
if [[ ${1:-} == --as-agent ]]; then
  host=$2
  shift 2
  [[ $host =~ ^10\.213\.0\.([0-9]+)$ ]] || { echo "netns-mpirun: agent: unknown host $host" >&2; exit 1; }
  index=$((BASH_REMATCH[1] - 1))
  exec ip netns exec "${QKV_NETNS_PREFIX:?}-h$index" unshare --uts sh -c "hostname host$index && $*"
fi

usage="usage: scripts/netns-mpirun.sh [--rate RATE] -np P PROGRAM [ARGS...]"
rate=""
ranks=""
while (($# > 0)); do
  case $1 in
    --rate)
      [[ ${2:-} =~ ^[0-9]+(\.[0-9]+)?[kmg]?bit$ ]] ||
        { echo "netns-mpirun: --rate expects a rate such as 1gbit or 500mbit, got '${2:-}'" >&2; echo "$usage" >&2; exit 2; }
      rate=$2
      shift 2
      ;;
    -np)
      [[ ${2:-} =~ ^[1-9][0-9]?$ ]] && ((${2} <= 32)) ||
        { echo "netns-mpirun: -np expects a number of ranks from 1 to 32, got '${2:-}'" >&2; echo "$usage" >&2; exit 2; }
      ranks=$2
      shift 2
      ;;
    *) break ;;
  esac
done
[[ -n $ranks && $# -gt 0 ]] || { echo "netns-mpirun: expected -np P and a program" >&2; echo "$usage" >&2; exit 2; }

prefix="qkv$$"
export QKV_NETNS_PREFIX=$prefix
switch="$prefix-sw"
made=()
cleanup() {
  local ns
  for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT

if ! ip netns add "$switch" 2>/dev/null; then
  echo "netns-mpirun: cannot make network namespaces here (needs root with CAP_SYS_ADMIN and iproute2)" >&2
  exit 77
fi
made+=("$switch")
ip -n "$switch" link add name bridge0 type bridge
ip -n "$switch" link set bridge0 up

cap() {
  local ns=$1 device=$2
  tc -n "$ns" qdisc add dev "$device" root handle 1: htb default 1
  tc -n "$ns" class add dev "$device" parent 1: classid 1:1 htb rate "$rate" ceil "$rate" burst 256k cburst 256k quantum 60000
}

hosts=()
for ((i = 0; i < ranks; ++i)); do
  ns="$prefix-h$i"
  ip netns add "$ns"
  made+=("$ns")
  # Made in this namespace, then each end moved where it belongs: names are unique only per namespace.
  ip link add "${prefix}a$i" type veth peer name "${prefix}b$i"
  ip link set "${prefix}a$i" netns "$ns"
  ip link set "${prefix}b$i" netns "$switch"
  ip -n "$ns" link set "${prefix}a$i" name eth0
  ip -n "$ns" addr add "10.213.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$switch" link set "${prefix}b$i" master bridge0
  ip -n "$switch" link set "${prefix}b$i" up
  if [[ -n $rate ]]; then
    cap "$ns" eth0
    cap "$switch" "${prefix}b$i"
  fi
  hosts+=("10.213.0.$((i + 1))")
done

# mpirun itself runs on the first host; it starts the rank there itself and the others through
# the agent. Only TCP on the hosts' network: no shared memory (vader) and no UCX, which would find
# the other ranks on the same machine and bypass the links. No binding: each host's daemon
# believes it has the machine to itself and would bind its rank to the first core, the same core
# on every host.
host_list=$(IFS=,; echo "${hosts[*]}")
set +e
ip netns exec "$prefix-h0" unshare --uts sh -c 'hostname host0 && exec "$@"' sh \
  mpirun -np "$ranks" --host "$host_list" \
  --bind-to none --mca plm_rsh_agent "$self --as-agent" --mca plm_rsh_no_tree_spawn 1 \
  --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include 10.213.0.0/24 --mca oob_tcp_if_include 10.213.0.0/24 \
  "$@"
status=$?
set -e
# What crossed each host's link, so a caller can see the ranks' traffic took the links.
sent=()
for ((i = 0; i < ranks; ++i)); do
  sent+=("host$i $(ip netns exec "$prefix-h$i" cat /sys/class/net/eth0/statistics/tx_bytes)")
done
echo "netns-mpirun: bytes sent on each host's link: $(IFS=,; echo "${sent[*]}" | sed 's/,/, /g')" >&2
exit $status
