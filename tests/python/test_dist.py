"""qkv.dist: ring attention from Python over mpi4py, on 2 and 3 ranks (more ranks than cores:
--oversubscribe). Each launch runs every case of dist_worker.py beside this file (both layouts,
causal and not, uneven shards, Tq != Tk, grouped heads, sinks with dsinks, a mask, empty shards,
against the one-process qkv.attention and its backward and, for one case, a float64 numpy
reference), the refused options and bad input on one rank only. The launch on 3 ranks then ends
with an uncaught bad input on rank 1: mpirun must exit non-zero, within its timeout, with the
argument named. Two launches in all: each costs seconds, and far more under AddressSanitizer.

Skipped, saying why, where qkv._dist was not built or mpirun is missing. Everywhere: a package
without qkv._dist imports, and its qkv.dist raises ImportError saying why.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

MPIRUN = shutil.which("mpirun")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
# CI runs as root, which Open MPI refuses unless told; its shared-memory transport copies through
# a buffer (containers may forbid the kernel-assisted copy); waiting ranks yield their core.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "passive",
}
# Seconds a launch may take: a few on a quiet machine, many more under AddressSanitizer.
TIMEOUT = 600


def needs_mpi(test):
    test = pytest.mark.skipif(importlib.util.find_spec("qkv._dist") is None,
                              reason="qkv._dist was not built (no Open MPI or no mpi4py C headers at build time)")(test)
    return pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (Debian: openmpi-bin)")(test)


def launch(ranks, *args):
    """mpirun -np ranks python3 dist_worker.py args: (CompletedProcess, seconds). The ranks get this
    process's environment (PYTHONPATH; under the sanitizers LD_PRELOAD and ASAN_OPTIONS, which
    mpirun itself, not built with them, is not given: -x hands them to the ranks alone)."""
    env = dict(os.environ, **MPI_ENV)
    forwarded = []
    for name in ("LD_PRELOAD", "ASAN_OPTIONS", "PYTHONPATH"):
        value = env.pop(name, None) if name != "PYTHONPATH" else env.get(name)
        if value is not None:
            forwarded += ["-x", f"{name}={value}"]
    command = [MPIRUN, "--oversubscribe", "-np", str(ranks), *forwarded, sys.executable, WORKER, *args]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    return result, time.monotonic() - start


# mpirun forwards each rank's output in pieces, which may interleave mid-line: what the ranks print
# is found by pattern, not by line.
DONE = re.compile(r"rank (\d+) done: (\d+) cases\.")
PRELOAD = re.compile(r"rank \d+ LD_PRELOAD=\[([^]]*)\]")
RAISED = re.compile(r"qkv\._qkv\.ShapeError: (rank \d+: q: [^\n]*?got shape \[[\d, ]*\])")


def assert_every_rank_passed(result, ranks):
    done = DONE.findall(result.stdout)
    assert sorted(int(rank) for rank, _ in done) == list(range(ranks)), (
        f"expected 'done' from {ranks} ranks, got {done}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    assert len({cases for _, cases in done}) == 1, f"the ranks ran different numbers of cases: {done}"
    seen = PRELOAD.findall(result.stdout)
    preload = os.environ.get("LD_PRELOAD", "")
    assert len(seen) == ranks and set(seen) == {preload}, f"the ranks saw LD_PRELOAD {seen}, expected {preload!r}"


@needs_mpi
def test_two_ranks():
    result, _ = launch(2)
    assert result.returncode == 0, f"mpirun exited {result.returncode}\nstdout:\n{result.stdout}\n" \
                                   f"stderr:\n{result.stderr}"
    assert_every_rank_passed(result, 2)


@needs_mpi
def test_three_ranks_then_an_uncaught_bad_input():
    result, seconds = launch(3, "--end-with-uncaught-error")
    assert_every_rank_passed(result, 3)
    assert result.returncode != 0, f"mpirun exited 0 though rank 1's q was wrong\nstdout:\n{result.stdout}"
    assert "no exception" not in result.stdout, result.stdout
    raised = RAISED.findall(result.stderr)
    assert raised, f"no rank raised qkv.ShapeError\nstderr:\n{result.stderr}"
    # Each rank that printed before mpirun stopped it raised rank 1's error, naming q.
    assert len(set(raised)) == 1 and raised[0].startswith("rank 1: q: expected 5 queries"), raised
    print(f"mpirun exited {result.returncode} after {seconds:.1f} s: {raised[0]}")


def test_import_without_the_dist_module(tmp_path):
    import qkv
    package = tmp_path / "qkv"
    # The package as the build tree holds it (links followed), less qkv._dist.
    shutil.copytree(os.path.dirname(qkv.__file__), package, ignore=shutil.ignore_patterns("_dist*", "__pycache__"))
    probe = ("import qkv\n"
             "try:\n    import qkv.dist\nexcept ImportError as error:\n    print('ImportError:', error)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ImportError: qkv.dist: this qkv was built without its MPI module qkv._dist" in done.stdout, done.stdout
