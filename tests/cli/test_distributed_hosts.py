#!/usr/bin/env python3
"""Ring attention across hosts for real: `qkv attend --distributed ring` and `attend-backward` with
each rank on its own host, a network namespace with its own address and host name, joined to the
others by veth links through a bridge (scripts/netns-mpirun.sh), so that every byte between ranks
goes through Open MPI's TCP transport and the links (the test checks the bytes each host sent).
Checked against the one-process `qkv attend`: two hosts, forward and backward, zigzag and causal,
T not a multiple of 2P; three hosts whose links tc caps at 1 Gbit/s, each reading its own shard
files; one host's bad input, which makes every rank exit 2 with its message; and the rank on
another host killed in the middle of a run, which makes mpirun fail within seconds.

Skips (exit 0, saying why) where qkv was built without MPI, mpirun is missing, or network
namespaces cannot be made here (not root, or a container without CAP_SYS_ADMIN / CAP_NET_ADMIN).

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_distributed_hosts.py
"""

import os
import re
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, run_suite  # noqa: E402  (the harness sits beside this script)
from test_distributed import MPI_ENV, MpiSuite, close, shard_ranges, take, why_skip  # noqa: E402

NETNS_MPIRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "netns-mpirun.sh")
CANNOT_MAKE_NAMESPACES = 77


class HostsSuite(MpiSuite):
    # Launching ranks through TCP and the agent takes a few seconds more than on one host.
    timeout = 120
    rate = None

    def launcher(self):
        return [NETNS_MPIRUN, *(["--rate", self.rate] if self.rate else []), "-np", str(self.ranks)]

    def rank_to_kill(self, pids):
        """A rank that is not on host 0, where mpirun runs: its death reaches mpirun over the link."""
        for pid in pids:
            where = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout
            if where.strip() and not where.strip().endswith("-h0"):
                return pid
        return None

    def succeed_across(self, name, args, at_least):
        """Exit 0, and every host sent at least at_least bytes on its link."""
        def crossed(result):
            found = re.search(r"bytes sent on each host's link: (.*)", result.stderr)
            if not found:
                return "netns-mpirun did not report the links' bytes"
            sent = [int(part.split()[1]) for part in found.group(1).split(", ")]
            if len(sent) != self.ranks or min(sent) < at_least:
                return f"bytes sent per host {sent}, expected {self.ranks} hosts with at least {at_least} each"
            return None
        self.succeed(name, args, check=crossed)


def one_process(s, args):
    subprocess.run([QKV, *args], cwd=s.workdir, capture_output=True, timeout=60, check=True)


def compare(s, name, pairs):
    s.count += 1
    problem = None
    for label, got, want in pairs:
        problem = problem or close(label, got, want)
    if problem:
        s.fail(name, problem)
    else:
        print(f"ok   {name}")


def checks(s):
    rng = np.random.default_rng(11)
    h, t, d = 4, 301, 32
    for name in ("q", "k", "v", "dout"):
        s.save(f"{name}.npy", rng.standard_normal((h, t, d)).astype(np.float32))
    a = {name: np.load(s.path(f"{name}.npy")) for name in ("q", "k", "v", "dout")}
    # Each host sends at least the K and V of its shard once.
    kv_bytes = 2 * 4 * h * d * (t // 3)

    s.ranks = 2
    common = ["--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--causal"]
    s.succeed_across("forward on 2 hosts, zigzag, causal",
                     ["attend", "--distributed", "ring", "--shards", "zigzag", *common, "-o", "out.npy",
                      "--lse", "lse.npy"], kv_bytes)
    one_process(s, ["attend", *common, "-o", "out1.npy", "--lse", "lse1.npy"])
    compare(s, "forward values on 2 hosts", [(n, np.load(s.path(f"{n}.npy")), np.load(s.path(f"{n}1.npy")))
                                             for n in ("out", "lse")])

    s.succeed_across("backward on 2 hosts, zigzag, causal",
                     ["attend-backward", "--distributed", "ring", "--shards", "zigzag", *common, "--dout", "dout.npy",
                      "--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy"], kv_bytes)
    one_process(s, ["attend-backward", *common, "--dout", "dout.npy", "--dq", "dq1.npy", "--dk", "dk1.npy",
                    "--dv", "dv1.npy"])
    compare(s, "backward values on 2 hosts", [(n, np.load(s.path(f"{n}.npy")), np.load(s.path(f"{n}1.npy")))
                                              for n in ("dq", "dk", "dv")])

    # Three hosts on links capped at 1 Gbit/s, each reading and writing its own shard files.
    s.ranks, s.rate = 3, "1gbit"
    for r in range(3):
        for name in ("q", "k", "v"):
            s.save(f"{name}.{r}.npy", take(a[name], shard_ranges(t, 3, r, "contiguous")))
    s.succeed_across("forward on 3 hosts at 1 Gbit/s, files per host",
                     ["attend", "--distributed", "ring", "--q", "q.{rank}.npy", "--k", "k.{rank}.npy",
                      "--v", "v.{rank}.npy", "--window", "40,0", "-o", "out.{rank}.npy"], kv_bytes)
    one_process(s, ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--window", "40,0", "-o", "outw.npy"])
    want = np.load(s.path("outw.npy"))
    compare(s, "forward values on 3 hosts", [(f"out.{r}", np.load(s.path(f"out.{r}.npy")),
                                              take(want, shard_ranges(t, 3, r, "contiguous"))) for r in range(3)])

    # Host 1's Q is of another width: every rank stops with host 1's message, and nothing is written.
    for f in list(os.listdir(s.workdir)):
        if f.startswith("out"):
            os.remove(s.path(f))
    s.save("bad.1.npy", take(a["q"], shard_ranges(t, 3, 1, "contiguous"))[..., :5])
    for r in (0, 2):
        os.link(s.path(f"q.{r}.npy"), s.path(f"bad.{r}.npy"))
    s.refuse_everywhere("one host's Q of another width",
                        ["attend", "--distributed", "ring", "--q", "bad.{rank}.npy", "--k", "k.{rank}.npy",
                         "--v", "v.{rank}.npy", "-o", "out.{rank}.npy"], "rank 1:")

    # The rank on host 1 killed in the middle of a run: mpirun, on host 0, fails within seconds.
    s.ranks, s.rate = 2, None
    s.kill_one_rank("a killed rank on another host", rng)


def main():
    reason = why_skip()
    if reason:
        print(f"skipped: {reason}")
        return 0
    hosts = subprocess.run([NETNS_MPIRUN, "-np", "1", "true"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, **MPI_ENV))
    if hosts.returncode == CANNOT_MAKE_NAMESPACES:
        print(f"skipped: {hosts.stderr.strip()}")
        return 0
    return run_suite(HostsSuite, "qkv-distributed-hosts-", checks)


if __name__ == "__main__":
    sys.exit(main())
