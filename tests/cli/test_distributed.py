#!/usr/bin/env python3
"""`mpirun -np P qkv attend --distributed ring` and `attend-backward --distributed ring`: ring
attention over P = 2 and 3 ranks (more ranks than cores: --oversubscribe) against the one-process
`qkv attend` and a float64 numpy reference, whole files (rank 0 reads, scatters and gathers) and
files per rank ({rank} in the path), contiguous and zigzag shards, causal, Tq != Tk, a window,
ALiBi and sinks; and the failures: one rank's bad file makes every rank exit 2 with that rank's
message and no output file, options ring attention cannot take are refused, and a rank killed in
the middle of a run makes mpirun fail within seconds instead of hanging.

Skips (exit 0, saying why) where qkv was built without MPI or mpirun is missing.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_distributed.py
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite, run_suite  # noqa: E402  (the harness sits beside this script)

MPIRUN = shutil.which("mpirun")
# CI runs as root, which Open MPI refuses unless told; its shared-memory transport copies through
# a buffer (containers may forbid the kernel-assisted copy); waiting ranks yield their core.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "passive",
}
TOL = 2e-5


def attention(q, k, v, causal=False, window=None, alibi=None, sinks=None):
    """float64 attention of [H, T, D] arrays, bottom-right aligned, as qkv defines it."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    h, tq, d = q.shape
    tk = k.shape[1]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(d)
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    o = tk - tq
    visible = np.ones((tq, tk), bool)
    if causal:
        visible &= j <= i + o
    if window:
        visible &= (j >= i + o - window[0]) & (j <= i + o + window[1])
    if alibi is not None:
        s = s - alibi[:, None, None] * np.abs(i + o - j)[None]
    s = np.where(visible[None], s, -np.inf)
    m = s.max(axis=2, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    z = e.sum(axis=2, keepdims=True)
    if sinks is not None:
        z = z + np.exp(sinks[:, None, None] - m)
    return (e / z) @ v, (m + np.log(z))[..., 0]


def shard_ranges(tokens, ranks, rank, layout):
    def chunk(c, n):
        return (c * tokens // n, (c + 1) * tokens // n)
    if layout == "contiguous":
        return [chunk(rank, ranks)]
    return [chunk(rank, 2 * ranks), chunk(2 * ranks - 1 - rank, 2 * ranks)]


def take(a, ranges):
    return np.concatenate([a[..., s:e, :] for s, e in ranges], axis=-2)


class MpiSuite(Suite):
    timeout = 60
    env = MPI_ENV
    ranks = 2

    def launcher(self):
        return [MPIRUN, "--oversubscribe", "-np", str(self.ranks)]

    def run(self, args, env=None, preexec=None):
        environment = dict(os.environ, **self.env)
        environment.update(env or {})
        return subprocess.run([*self.launcher(), QKV, *args], cwd=self.workdir, capture_output=True, text=True,
                              timeout=self.timeout, env=environment, preexec_fn=preexec)

    def rank_to_kill(self, pids):
        return pids[-1]

    def kill_one_rank(self, name, rng):
        """SIGKILL one rank (rank_to_kill's choice) a few seconds into a long forward: the launcher
        must exit non-zero within 20 s, with no output written."""
        self.count += 1
        big = rng.standard_normal((8, 32768, 64)).astype(np.float32)
        for array in ("bq", "bk", "bv"):
            self.save(f"{array}.npy", big)
        job = subprocess.Popen([*self.launcher(), QKV, "attend", "--distributed", "ring", "--q", "bq.npy", "--k",
                                "bk.npy", "--v", "bv.npy", "-o", "bout.npy"], cwd=self.workdir,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, **self.env),
                               start_new_session=True)
        time.sleep(3.0)
        ranks = subprocess.run(["pgrep", "-f", f"^{QKV} attend .*--q bq.npy"], capture_output=True, text=True)
        pids = [int(p) for p in ranks.stdout.split()]
        target = self.rank_to_kill(pids) if pids else None
        killed_at = time.monotonic()
        if target:
            os.kill(target, signal.SIGKILL)
        try:
            code = job.wait(timeout=20)
            waited = time.monotonic() - killed_at
            if not target:
                self.fail(name, f"found no rank to kill among {pids} (the run ended first?)")
            elif code == 0:
                self.fail(name, "the launcher exited 0")
            elif os.path.exists(self.path("bout.npy")):
                self.fail(name, "an output was written")
            else:
                print(f"ok   {name}: the launcher exited {code} {waited:.1f} s after the kill")
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            self.fail(name, "the launcher still running 20 s after one rank was killed")

    def refuse_everywhere(self, name, args, *must_mention):
        """Exit 2 from mpirun, no file written, and every error line the same, mentioning must_mention
        (each rank prints it, unless mpirun stopped that rank first, once another had exited 2)."""
        self.count += 1
        before = self.files()
        result = self.run(args)
        after = self.files()
        for extra in set(after) - set(before):
            os.remove(self.path(extra))
        errors = [line for line in result.stderr.splitlines() if line.startswith("qkv: error: ")]
        if result.returncode != 2:
            return self.fail(name, f"exit code {result.returncode}, expected 2", result)
        if not errors or len(set(errors)) != 1:
            return self.fail(name, f"expected one error, the same from every rank that printed, got {errors}", result)
        missing = [text for text in must_mention if text not in errors[0]]
        if missing:
            return self.fail(name, f"the error does not mention {missing}", result)
        if set(after) != set(before):
            return self.fail(name, f"files appeared: {sorted(set(after) - set(before))}", result)
        print(f"ok   {name}: {errors[0]}")


def close(name, got, want, tol=TOL):
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, expected {want.shape}"
    return None if err <= tol * scale else f"{name}: max error {err:.3g} > {tol * scale:.3g}"


def checks(s):
    rng = np.random.default_rng(5)
    h, t, d = 2, 37, 16
    q = s.save("q.npy", rng.standard_normal((h, t, d)).astype(np.float32))
    k = s.save("k.npy", rng.standard_normal((h, t, d)).astype(np.float32))
    v = s.save("v.npy", rng.standard_normal((h, t, 8)).astype(np.float32))
    dout = s.save("dout.npy", rng.standard_normal((h, t, 8)).astype(np.float32))
    qa, ka, va, da = (np.load(s.path(n)) for n in ("q.npy", "k.npy", "v.npy", "dout.npy"))

    # Every layout and mask on 2 ranks; on 3, the case with the most blocks (the C++ tests cover
    # every case on 1 to 4 ranks; each launch here costs seconds under the sanitizers).
    cases = [(2, layout, causal) for layout in ("contiguous", "zigzag") for causal in (False, True)]
    cases.append((3, "zigzag", True))
    for ranks, layout, causal in cases:
        s.ranks = ranks
        label = f"P={ranks} {layout}{' causal' if causal else ''}"
        flags = ["--causal"] if causal else []
        s.succeed(f"forward, {label}",
                  ["attend", "--distributed", "ring", "--shards", layout, "--q", q, "--k", k, "--v", v,
                   *flags, "-o", "out.npy", "--lse", "lse.npy"])
        one = subprocess.run([QKV, "attend", "--q", q, "--k", k, "--v", v, *flags, "-o", "out1.npy",
                              "--lse", "lse1.npy"], cwd=s.workdir, capture_output=True, timeout=60)
        want_out, want_lse = attention(qa, ka, va, causal=causal)

        def forward_check(_):
            out, lse = np.load(s.path("out.npy")), np.load(s.path("lse.npy"))
            return (one.returncode and "the one-process run failed") or \
                close("out", out, want_out) or close("lse", lse, want_lse) or \
                close("out against one process", out, np.load(s.path("out1.npy")))
        s.count += 1
        problem = forward_check(None)
        if problem:
            s.fail(f"forward values, {label}", problem)
        else:
            print(f"ok   forward values, {label}")

        s.succeed(f"backward, {label}",
                  ["attend-backward", "--distributed", "ring", "--shards", layout, "--q", q, "--k", k,
                   "--v", v, *flags, "--dout", dout, "--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy"])
        subprocess.run([QKV, "attend-backward", "--q", q, "--k", k, "--v", v, *flags, "--dout", dout,
                        "--dq", "dq1.npy", "--dk", "dk1.npy", "--dv", "dv1.npy"], cwd=s.workdir,
                       capture_output=True, timeout=60, check=True)
        s.count += 1
        problem = None
        for g in ("dq", "dk", "dv"):
            problem = problem or close(g, np.load(s.path(f"{g}.npy")), np.load(s.path(f"{g}1.npy")))
        if problem:
            s.fail(f"backward values, {label}", problem)
        else:
            print(f"ok   backward values, {label}")

    # One file per rank: each rank reads its shard and writes its shard of the outputs.
    s.ranks = 3
    layout = "zigzag"
    for r in range(3):
        for name, a in (("q", qa), ("k", ka), ("v", va), ("dout", da)):
            s.save(f"{name}.{r}.npy", take(a, shard_ranges(t, 3, r, layout)))
    window, slopes = (4, 1), None
    s.succeed("forward, files per rank, window and ALiBi",
              ["attend", "--distributed", "ring", "--shards", layout, "--q", "q.{rank}.npy", "--k", "k.{rank}.npy",
               "--v", "v.{rank}.npy", "--window", "4,1", "--alibi", "auto", "-o", "out.{rank}.npy"])
    slopes = np.array([2.0 ** -4, 2.0 ** -8])
    want_out, _ = attention(qa, ka, va, window=window, alibi=slopes)
    s.count += 1
    got = [np.load(s.path(f"out.{r}.npy")) for r in range(3)]
    problem = None
    for r in range(3):
        problem = problem or close(f"out.{r}", got[r], take(want_out, shard_ranges(t, 3, r, layout)))
    if problem:
        s.fail("forward values, files per rank", problem)
    else:
        print("ok   forward values, files per rank")

    sinks = s.save("sinks.npy", np.array([0.5, -1.0], np.float32))
    s.succeed("backward with sinks, files per rank",
              ["attend-backward", "--distributed", "ring", "--q", "q.{rank}.npy", "--k", "k.{rank}.npy",
               "--v", "v.{rank}.npy", "--dout", "dout.{rank}.npy", "--shards", layout, "--causal",
               "--sinks", sinks, "--dsinks", "dsinks.npy", "--dq", "dq.{rank}.npy"])
    subprocess.run([QKV, "attend-backward", "--q", q, "--k", k, "--v", v, "--dout", dout, "--causal", "--sinks",
                    sinks, "--dsinks", "dsinks1.npy", "--dq", "dq1.npy"], cwd=s.workdir, capture_output=True,
                   timeout=60, check=True)
    s.count += 1
    want_dq = np.load(s.path("dq1.npy"))
    problem = close("dsinks", np.load(s.path("dsinks.npy")), np.load(s.path("dsinks1.npy")))
    for r in range(3):
        problem = problem or close(f"dq.{r}", np.load(s.path(f"dq.{r}.npy")), take(want_dq, shard_ranges(t, 3, r, layout)))
    if problem:
        s.fail("backward values with sinks", problem)
    else:
        print("ok   backward values with sinks")

    # Tq != Tk: 13 queries over the 37 keys, bottom-right aligned.
    s.ranks = 2
    q13 = s.save("q13.npy", rng.standard_normal((h, 13, d)).astype(np.float32))
    s.succeed("forward, Tq != Tk", ["attend", "--distributed", "ring", "--q", q13, "--k", k, "--v", v, "--causal",
                                    "-o", "out13.npy"])
    s.count += 1
    problem = close("out13", np.load(s.path("out13.npy")), attention(np.load(s.path(q13)), ka, va, causal=True)[0])
    if problem:
        s.fail("forward values, Tq != Tk", problem)
    else:
        print("ok   forward values, Tq != Tk")

    # Failures: every rank stops with the same message, and nothing is written.
    for f in list(os.listdir(s.workdir)):
        if f.startswith(("out", "dq", "dk", "dv", "lse", "dsinks")):
            os.remove(s.path(f))
    s.ranks = 3
    s.save("bad.1.npy", take(qa, shard_ranges(t, 3, 1, layout))[..., :5])
    for r in (0, 2):
        shutil.copy(s.path(f"q.{r}.npy"), s.path(f"bad.{r}.npy"))
    s.refuse_everywhere("one rank's Q of another width",
                        ["attend", "--distributed", "ring", "--shards", layout, "--q", "bad.{rank}.npy", "--k",
                         "k.{rank}.npy", "--v", "v.{rank}.npy", "-o", "out.{rank}.npy"], "rank 1:")
    s.refuse_everywhere("a missing K on rank 0",
                        ["attend", "--distributed", "ring", "--q", q, "--k", "missing.npy", "--v", v, "-o", "out.npy"],
                        "rank 0:", "--k", "missing.npy")
    s.refuse_everywhere("a K of the wrong length",
                        ["attend", "--distributed", "ring", "--q", q, "--k", q13, "--v", v, "-o", "out.npy"],
                        "--v", "Tk")
    s.refuse_everywhere("K per rank, Q whole",
                        ["attend", "--distributed", "ring", "--q", q, "--k", "k.{rank}.npy", "--v", v, "-o", "out.npy"],
                        "--k", "{rank}")
    s.refuse_everywhere("a mask", ["attend", "--distributed", "ring", "--q", q, "--k", k, "--v", v, "--mask", q,
                                   "-o", "out.npy"], "--mask")
    s.refuse_everywhere("weights", ["attend", "--distributed", "ring", "--q", q, "--k", k, "--v", v,
                                    "--weights", "w.npy", "-o", "out.npy"], "--weights")

    # A rank killed in the middle of a run: mpirun fails within seconds.
    s.ranks = 2
    s.kill_one_rank("a killed rank", rng)


def why_skip():
    """Why the MPI tests cannot run here, or None."""
    if not MPIRUN:
        return "no mpirun (Open MPI's openmpi-bin)"
    probe = subprocess.run([QKV, "attend", "--distributed", "ring", "--q", "none.npy", "--k", "none.npy", "--v",
                            "none.npy", "-o", "none.npy"], capture_output=True, text=True, env=dict(os.environ, **MPI_ENV))
    if "built without MPI" in probe.stderr:
        return "this qkv was built without MPI"
    return None


def main():
    reason = why_skip()
    if reason:
        print(f"skipped: {reason}")
        return 0
    return run_suite(MpiSuite, "qkv-distributed-", checks)


if __name__ == "__main__":
    sys.exit(main())
