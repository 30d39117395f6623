#!/usr/bin/env python3
"""When does ring attention's communication hide behind its compute, on links of a given speed?

Runs bench/mpi_ring_attention with one rank per host (scripts/netns-mpirun.sh: network namespaces
joined by veth links, all traffic over TCP, each link capped with tc) for each link rate and shard
length asked for, and prints one table: the link's measured rate, the kernel's measured FLOP/s,
the ring forward's time over its compute alone (median over rounds, and its range), how much of
the ring's time it spent blocked waiting for a shard, the ring's own kernel and merge time over
the compute alone (above 1 when the transfers slow the kernel down: they take the same cores), and
the shard length the model c >= 2F/B says communication needs to hide, and the ratio the model
predicts: a ring of P steps overlaps each of its P - 1 transfers with one step's compute, so it
takes (P - 1) max(t_compute, t_transfer) + t_compute, and t_transfer / t_compute = 2F / (B c).

    sudo bench/ring_links.py --bench build/release/bench/mpi_ring_attention \\
        --rates 1gbit,10gbit,none --tokens 512,1024,2048,4096,8192 [--ranks 2] [--heads 8] [--dim 64]

Every host is a namespace on this one machine: the ranks share its cores with each other and with
the kernel's TCP work, which on real hosts would have cores of its own. Needs root; exits 77,
saying why, where network namespaces cannot be made.
"""

import argparse
import os
import re
import subprocess
import sys

NETNS_MPIRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "netns-mpirun.sh")
CANNOT_MAKE_NAMESPACES = 77
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "passive",
}


def whole_list(text, what):
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        sys.exit(f"ring_links: {what} expects whole numbers separated by commas, got '{text}'")
    if not values or min(values) < 1:
        sys.exit(f"ring_links: {what} expects positive whole numbers, got '{text}'")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", required=True, help="the mpi_ring_attention binary")
    parser.add_argument("--rates", default="1gbit,10gbit,none", help="link rates as tc writes them; none: uncapped")
    parser.add_argument("--tokens", default="512,1024,2048,4096,8192", help="shard lengths c (T = P c)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.access(args.bench, os.X_OK):
        sys.exit(f"ring_links: --bench must name the mpi_ring_attention binary, got '{args.bench}'")
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        if r != "none" and not re.fullmatch(r"[0-9]+(\.[0-9]+)?[kmg]?bit", r):
            sys.exit(f"ring_links: --rates expects rates such as 1gbit or 500mbit (or none), got '{r}'")
    tokens = whole_list(args.tokens, "--tokens")
    if args.ranks < 2:
        sys.exit(f"ring_links: --ranks must be at least 2 (a ring of one sends nothing), got {args.ranks}")

    print(f"ring forward, P = {args.ranks} hosts, H = {args.heads}, d = {args.dim}, fp32, 1 thread per rank, "
          f"{args.rounds} rounds per row")
    print("| link cap | shard c | link measured (Gbit/s) | kernel (GFLOP/s) | ring / compute alone (range) "
          "| waiting | ring's kernel / alone | model: hides from c = | model: ring / compute alone |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for rate in rates:
        for c in tokens:
            command = [NETNS_MPIRUN, *([] if rate == "none" else ["--rate", rate]), "-np", str(args.ranks),
                       args.bench, str(c * args.ranks), str(args.heads), str(args.dim), str(args.rounds)]
            result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV),
                                    timeout=1200)
            if result.returncode == CANNOT_MAKE_NAMESPACES:
                print(f"skipped: {result.stderr.strip()}")
                return CANNOT_MAKE_NAMESPACES
            if result.returncode != 0:
                sys.exit(f"ring_links: {' '.join(command)} failed ({result.returncode}):\n{result.stderr}")
            ratio = re.search(r"ring forward / its compute alone.*?([0-9.]+)\s+\(rounds ([0-9.]+) to ([0-9.]+)\)",
                              result.stdout)
            waiting = re.search(r"blocked waiting for a shard\s+([0-9.]+)", result.stdout)
            kernel = re.search(r"kernel and merge time / the compute alone\s+([0-9.]+)", result.stdout)
            model = re.search(r"F = ([0-9.]+) GFLOP/s.*B = ([0-9.]+) Gbit/s.*2F/B = ([0-9]+) tokens", result.stdout)
            if not ratio or not model or not waiting or not kernel:
                sys.exit(f"ring_links: could not read the bench's output:\n{result.stdout}")
            threshold = float(model.group(3))
            predicted = 1 + (args.ranks - 1) / args.ranks * max(0.0, threshold / c - 1)
            print(f"| {rate} | {c} | {model.group(2)} | {model.group(1)} | {ratio.group(1)} "
                  f"({ratio.group(2)}–{ratio.group(3)}) | {float(waiting.group(1)):.0%} | {kernel.group(1)} | {model.group(3)} "
                  f"| {predicted:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
