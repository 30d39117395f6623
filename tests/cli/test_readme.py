#!/usr/bin/env python3
"""README.md's CLI tour works as written for a reader who follows it: its Python block makes the
Q.npy, K.npy and V.npy that its first `qkv attend` lines read, those lines run, the README says
where the qkv binary is (it is not on PATH) and what "the seed" it speaks of is.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_readme.py
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite  # noqa: E402  (the harness sits beside this script)

class ReadmeSuite(Suite):
    def check(self, name, problems):
        """One named check: ok when `problems` (what is wrong, in words) is empty."""
        self.count += 1
        for problem in problems:
            self.fail(name, problem)
        if not problems:
            print(f"ok   {name}")


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def main():
    if not QKV or not os.access(QKV, os.X_OK):
        print(f"QKV_BIN must name the qkv binary, got {QKV!r}")
        return 1
    with open(README, encoding="utf-8") as f:
        text = f.read()
    with tempfile.TemporaryDirectory(prefix="qkv_readme_") as workdir:
        t = ReadmeSuite(workdir)
        t.check("README says where the binary is", [] if "build/release/apps/qkv" in text and "PATH" in text
                else ["no build/release/apps/qkv and PATH"])
        t.check("README says what the seed is", [] if re.search(r"called \*\*the seed\*\*", text)
                else ["'the seed' is never introduced"])

        blocks = re.findall(r"```python\n(.*?)```", text, re.S)
        if not blocks:
            t.check("README has the Python that makes Q, K and V", ["no ```python block"])
            return t.report()
        made = subprocess.run([sys.executable, "-c", blocks[0]], cwd=workdir, capture_output=True, text=True)
        t.check("README's Python block runs", [] if made.returncode == 0 else [made.stderr.strip()])
        missing = [name for name in ("Q.npy", "K.npy", "V.npy") if not os.path.exists(t.path(name))]
        t.check("it writes Q.npy, K.npy and V.npy", [f"missing {missing}"] if missing else [])

        commands = [line.split("#")[0].strip() for line in text.splitlines() if line.startswith("qkv attend --q Q.npy")]
        runnable = [c for c in commands if "--mask" not in c]
        t.check("README has attend lines on Q, K and V alone", [] if runnable else ["none"])
        for command in runnable:
            t.succeed(command, shlex.split(command)[1:])
        return t.report()


if __name__ == "__main__":
    sys.exit(main())
