#!/usr/bin/env python3
"""How qkv answers a command line it cannot run as given: no arguments at all, a misspelt
subcommand or experiment name, a seed outside 0 to 2^64 - 1.

Bare `qkv` prints the help and exits 0; a misspelt name is refused with the names qkv knows and the
closest one; a seed that uint64 cannot hold is refused with the range instead of wrapping.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_usage.py
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite  # noqa: E402  (the harness sits beside this script)

UINT64_MAX = str(2**64 - 1)


def main():
    if not QKV or not os.access(QKV, os.X_OK):
        print(f"QKV_BIN must name the qkv binary, got {QKV!r}")
        return 1
    with tempfile.TemporaryDirectory(prefix="qkv_usage_") as workdir:
        t = Suite(workdir)

        def prints_help(result):
            if "Usage:" not in result.stdout or "attend" not in result.stdout:
                return "stdout is not the help with its subcommands"
            return f"stderr is not empty: {result.stderr.strip()!r}" if result.stderr.strip() else None

        t.succeed("bare qkv prints the help", [], prints_help)

        t.refuse("misspelt subcommand", ["atend", "--q", "q.npy"], "SUBCOMMAND", '"atend"', "did you mean attend?")
        t.refuse("misspelt subcommand after a global option", ["--simd-target", "scalar", "hetmap", "a.npy"],
                 '"hetmap"', "did you mean heatmap?")
        t.refuse("unknown subcommand, nothing close", ["frobnicate"], '"frobnicate"', "demo, attend")
        t.refuse("only a global option", ["--simd-target", "scalar"], "SUBCOMMAND", "got none")
        t.refuse("option of a subcommand still missing", ["attend", "--k", "k.npy"], "--q")

        t.refuse("misspelt experiment", ["experiment", "scalling", "--quick"], '"scalling"', "did you mean scaling?")
        t.refuse("unknown experiment, nothing close", ["experiment", "zzz", "--quick"], "NAME", '"zzz"')

        for name, args in [("demo", ["demo", "--no-files"]), ("experiment", ["experiment", "scaling", "--quick"])]:
            for seed in ["-1", "99999999999999999999", "1.5", "abc"]:
                t.refuse(f"{name} --seed {seed}", [*args, "--seed", seed], "--seed", f"0 to {UINT64_MAX}", seed)
        t.succeed("demo --seed 2^64 - 1", ["demo", "--no-files", "--seed", UINT64_MAX])

        return t.report()


if __name__ == "__main__":
    sys.exit(main())
