#!/usr/bin/env python3
"""`qkv attend` under an address-space limit (`ulimit -v`, RLIMIT_AS).

With room for the problem it runs; with too little it refuses before allocating what does not fit:
exit code 2, one error line saying what needed how much and how much was left, and no output file
(never a crash, a signal or a half-written file). float16 inputs are read as they are stored, with
no float32 copy: they need half the room of float32 ones. The limit is set relative to what a tiny run of
the same binary needs, found by bisection, so that nothing here depends on the machine.

A build with AddressSanitizer reserves terabytes of address space for its shadow memory, which no
such limit allows: there the test says so and passes.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_resource_limits.py
"""

import os
import resource
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite, run_suite  # noqa: E402  (the harness sits beside this script)

MIB = 1 << 20
# One OpenMP thread and one malloc arena: each further thread would reserve address space of its
# own (a stack and a 64 MiB arena) that a tiny run does not, and the bisection would not see it.
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}
SHAPE = (2, 4096, 1024)  # 32 MiB of float32 per array


def limit_to(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


class LimitSuite(Suite):
    env = ENV

    def attend_ok_under(self, nbytes, args):
        result = self.run(args, preexec=limit_to(nbytes))
        return result.returncode == 0


def smallest_limit(suite, args):
    """The least RLIMIT_AS (to 1 MiB) under which `qkv args` succeeds."""
    low, high = 16 * MIB, 16384 * MIB
    if not suite.attend_ok_under(high, args):
        raise RuntimeError(f"qkv {' '.join(args)} fails even under a limit of {high // MIB} MiB")
    while high - low > MIB:
        middle = (low + high) // 2
        if suite.attend_ok_under(middle, args):
            high = middle
        else:
            low = middle
    return high


def checks(suite):
    rng = np.random.default_rng(0)
    tiny = rng.standard_normal((1, 4, 8)).astype(np.float32)
    for name in ("tq.npy", "tk.npy", "tv.npy"):
        suite.save(name, tiny)
    base = smallest_limit(suite, ["attend", "--q", "tq.npy", "--k", "tk.npy", "--v", "tv.npy", "-o", "tout.npy"])
    os.remove(suite.path("tout.npy"))
    print(f"a tiny attend runs under {base // MIB} MiB of address space")

    arrays = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("q.npy", "k.npy", "v.npy")}
    for name, array in arrays.items():
        suite.save(name, array)
    big = ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "-o", "out.npy"]
    array_bytes = arrays["q.npy"].nbytes

    # Just above what it needs (found by bisection as for the tiny run) it runs and writes the right
    # result. What it needs beyond the tiny run is five arrays: the three inputs, the output and the
    # file image written from it (an input's file bytes, held while they are decoded, fit in that).
    need = smallest_limit(suite, big)
    print(f"attend of three {array_bytes // MIB} MiB arrays runs under {need // MIB} MiB, "
          f"{(need - base) / array_bytes:.2f} arrays above the tiny run")
    suite.count += 1
    result = suite.run(big, preexec=limit_to(need))
    if result.returncode != 0:
        suite.fail("attend just above its need", f"exit code {result.returncode}, expected 0", result)
    else:
        got = np.load(suite.path("out.npy"))
        if got.shape != SHAPE or not np.all(np.isfinite(got)):
            suite.fail("attend just above its need", f"out.npy has shape {got.shape} or a non-finite value")
        elif need - base > 8 * array_bytes:
            suite.fail("attend just above its need", f"it needs {(need - base) / array_bytes:.1f} arrays of room")
        else:
            print(f"ok   attend just above its need, under {need // MIB} MiB")
        os.remove(suite.path("out.npy"))

    # Just below, and with room for less: refused with the size, before anything is written.
    suite.refuse("attend 1 MiB below its need", big, "needs", "available", preexec=limit_to(need - MIB))
    for room in (array_bytes // 2, 3 * array_bytes // 2, 3 * array_bytes):
        suite.refuse(f"attend with {room // MIB} MiB of room", big, "needs", "available",
                     preexec=limit_to(base + room))

    # The same run on float16 files: the three inputs in their own bytes (1.5 float32 arrays), the
    # output and its file image (2), and 0.5 more measured here; a float32 copy of the inputs would
    # add 3 (7.0 measured when qkv made them).
    for name, array in arrays.items():
        suite.save("h" + name, array.astype(np.float16))
    half = ["attend", "--q", "hq.npy", "--k", "hk.npy", "--v", "hv.npy", "-o", "out.npy"]
    half_need = smallest_limit(suite, half)
    suite.count += 1
    arrays_above = (half_need - base) / array_bytes
    if arrays_above > 4.5:
        suite.fail("float16 attend without float32 copies", f"it needs {arrays_above:.2f} float32 arrays of room")
    else:
        print(f"ok   float16 attend without float32 copies: under {half_need // MIB} MiB, "
              f"{arrays_above:.2f} float32 arrays above the tiny run (float32 files: {(need - base) / array_bytes:.2f})")
    os.remove(suite.path("out.npy"))


def main():
    if QKV and "libasan" in subprocess.run(["ldd", QKV], capture_output=True, text=True).stdout:
        print("skipped: this qkv is built with AddressSanitizer, whose shadow memory no ulimit -v allows")
        return 0
    return run_suite(LimitSuite, "qkv-limits-", checks)


if __name__ == "__main__":
    sys.exit(main())
