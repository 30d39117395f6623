"""The harness of the CLI tests: run qkv in a scratch directory and check a refusal (exit code 2,
one 'qkv: error:' line that mentions the argument at fault, nothing printed to stdout and no file
written or changed) or a success. Imported by the tests/cli/test_*.py scripts that share it.
"""

import os
import subprocess

import numpy as np

QKV = os.path.abspath(os.environ["QKV_BIN"]) if os.environ.get("QKV_BIN") else None
EXIT_BAD_INPUT = 2


class Suite:
    # Every run is small or refused up front: a run that takes longer is a failure, not a wait.
    timeout = 30
    # Variables set for every run, on top of the caller's environment.
    env = {}

    def __init__(self, workdir):
        self.workdir = workdir
        self.failures = []
        self.count = 0

    def path(self, name):
        return os.path.join(self.workdir, name)

    def save(self, name, array):
        np.save(self.path(name), array)
        return name

    def files(self):
        found = {}
        for root, _, names in os.walk(self.workdir):
            for name in names:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    found[os.path.relpath(full, self.workdir)] = f.read()
        return found

    def run(self, args, env=None):
        environment = dict(os.environ, **self.env)
        environment.update(env or {})
        return subprocess.run([QKV, *args], cwd=self.workdir, capture_output=True, text=True, timeout=self.timeout,
                              env=environment)

    def fail(self, name, problem, result=None):
        self.failures.append(name)
        print(f"FAIL {name}: {problem}")
        if result is not None:
            print(f"     stdout: {result.stdout.strip()[:2000]!r}\n     stderr: {result.stderr.strip()!r}")

    def refuse(self, name, args, *must_mention):
        """Exit 2, one error line mentioning every string of must_mention, and no file changed."""
        self.count += 1
        before = self.files()
        result = self.run(args)
        after = self.files()
        changed = sorted(f for f in after if before.get(f) != after[f])
        for extra in set(after) - set(before):
            os.remove(self.path(extra))
        lines = result.stderr.strip().splitlines()
        first = lines[0] if lines else ""
        if result.returncode != EXIT_BAD_INPUT:
            return self.fail(name, f"exit code {result.returncode}, expected {EXIT_BAD_INPUT}", result)
        if not first.startswith("qkv: error: "):
            return self.fail(name, "the first stderr line is not 'qkv: error: ...'", result)
        if len(lines) != 1:
            return self.fail(name, f"expected a one-line error, got {len(lines)} lines", result)
        missing = [text for text in must_mention if text not in first]
        if missing:
            return self.fail(name, f"the error does not mention {missing}", result)
        if changed:
            return self.fail(name, f"files appeared or changed: {changed}", result)
        if result.stdout:
            return self.fail(name, "a refused run printed to stdout", result)
        print(f"ok   {name}: {first}")

    def succeed(self, name, args, check=None, env=None):
        """Exit 0, then check(result) (if given) returns None or what is wrong."""
        self.count += 1
        result = self.run(args, env)
        if result.returncode != 0:
            return self.fail(name, f"exit code {result.returncode}, expected 0", result)
        problem = check(result) if check else None
        if problem:
            return self.fail(name, problem, result)
        print(f"ok   {name}")

    def report(self):
        """Prints the tally; the script's exit status: 1 when a check failed."""
        print(f"{self.count - len(self.failures)} of {self.count} checks passed")
        if self.failures:
            print("failed: " + "; ".join(self.failures))
            return 1
        return 0
