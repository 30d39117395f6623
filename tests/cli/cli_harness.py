"""The harness of the CLI tests: run qkv in a scratch directory and check a refusal (exit code 2,
one 'qkv: error:' line that mentions the argument at fault, nothing printed to stdout and no file
written or changed) or a success. Imported by the tests/cli/test_*.py scripts that share it.

ExperimentSuite adds what the `qkv experiment` tests share: a --quick run checked for its time, its
printed tables, progress and files (results.md with its settings and command, CSVs, valid PNGs, no
temporaries left), readers of those files, and a Ctrl-C in the middle of a run.
"""

import csv
import math
import os
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

QKV = os.path.abspath(os.environ["QKV_BIN"]) if os.environ.get("QKV_BIN") else None
EXIT_BAD_INPUT = 2
# How much slower than a release build on the machine's best SIMD target these runs may be (a
# sanitizer build, or a slower target forced with QKV_SIMD_TARGET): every time limit is scaled by it.
TIME_SCALE = float(os.environ.get("QKV_TEST_TIME_SCALE", "1"))


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

    def quantized(self, source, to, out, group="per-channel"):
        """Runs `qkv quantize SOURCE --to TO -o OUT` (int8: its scales in OUT's name + "s", e.g. k8s.npy, grouped
        by `group`) and returns the float32 values the new file stands for."""
        scales = out.replace(".npy", "s.npy")
        extra = ["--scales", scales, "--group", group] if to == "int8" else []
        subprocess.run([QKV, "quantize", source, "--to", to, "-o", out, *extra], cwd=self.workdir, check=True,
                       capture_output=True, timeout=30 * TIME_SCALE)
        stored = np.load(self.path(out))
        if to == "int8":
            return stored.astype(np.float32) * np.load(self.path(scales))
        if to == "bf16":
            return (stored.astype(np.uint32) << 16).view(np.float32)
        return stored.astype(np.float32)

    def files(self):
        found = {}
        for root, _, names in os.walk(self.workdir):
            for name in names:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    found[os.path.relpath(full, self.workdir)] = f.read()
        return found

    def run(self, args, env=None, preexec=None):
        environment = dict(os.environ, **self.env)
        environment.update(env or {})
        return subprocess.run([QKV, *args], cwd=self.workdir, capture_output=True, text=True,
                              timeout=self.timeout * TIME_SCALE, env=environment, preexec_fn=preexec)

    def fail(self, name, problem, result=None):
        self.failures.append(name)
        print(f"FAIL {name}: {problem}")
        if result is not None:
            print(f"     stdout: {result.stdout.strip()[:2000]!r}\n     stderr: {result.stderr.strip()!r}")

    def refuse(self, name, args, *must_mention, preexec=None):
        """Exit 2, one error line mentioning every string of must_mention, and no file changed.
        preexec runs in the child before qkv starts (to set a resource limit)."""
        self.count += 1
        before = self.files()
        result = self.run(args, preexec=preexec)
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


def run_suite(suite_class, prefix, checks):
    """A test script's main(): checks(suite) on a suite_class in a fresh scratch directory (named from
    `prefix`, removed afterwards); returns the script's exit status."""
    if not QKV or not os.access(QKV, os.X_OK):
        print(f"QKV_BIN must name the qkv binary, got {QKV!r}")
        return 1
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        suite = suite_class(workdir)
        checks(suite)
        return suite.report()


class ExperimentSuite(Suite):
    """Runs `qkv experiment` in the scratch directory, on one OpenMP thread (tests run side by side
    on 2 cores; the results do not depend on the thread count)."""

    timeout = 300
    env = {"OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    # The promise of --quick: under a minute on 2 cores in a release build; the asan test preset
    # says how much slower its build is.
    quick_limit_s = 60 * TIME_SCALE

    def timed(self, args, env=None):
        """(the finished process, its wall time in seconds)."""
        start = time.monotonic()
        result = self.run(args, env)
        return result, time.monotonic() - start

    def check(self, name, problems, result=None):
        """One named check: ok when `problems` (what is wrong, in words) is empty."""
        self.count += 1
        for problem in problems:
            self.fail(name, problem, result)
            result = None  # the output once is enough
        if not problems:
            print(f"ok   {name}")
        return not problems

    # ---- Readers: each returns what it read and appends what is wrong to `problems`.

    @staticmethod
    def png_problems(path, min_side=1):
        """The PNG signature, chunks whose CRCs match, an IHDR of at least min_side pixels a side first, IEND last."""
        data = Path(path).read_bytes()
        name = Path(path).name
        if not data.startswith(b"\x89PNG\r\n\x1a\n"):
            return [f"{name}: not a PNG"]
        pos, kinds = 8, []
        while pos + 12 <= len(data):
            (length,) = struct.unpack(">I", data[pos : pos + 4])
            kind = data[pos + 4 : pos + 8]
            body = data[pos + 8 : pos + 8 + length]
            if pos + 12 + length > len(data):
                return [f"{name}: chunk {kind!r} runs past the end of the file"]
            (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
            if zlib.crc32(kind + body) != crc:
                return [f"{name}: chunk {kind!r} has a bad CRC"]
            if kind == b"IHDR":
                width, height = struct.unpack(">II", body[:8])
                if width < min_side or height < min_side:
                    return [f"{name}: image is only {width}x{height}"]
            kinds.append(kind)
            pos += 12 + length
        if not kinds or kinds[0] != b"IHDR" or kinds[-1] != b"IEND" or pos != len(data):
            return [f"{name}: truncated or malformed chunk list {kinds[:3]}...{kinds[-2:]}"]
        return []

    @staticmethod
    def png_colours(path):
        """The set of (r, g, b) colours of an 8-bit RGB or RGBA, non-interlaced PNG (what cairo writes)."""
        data = Path(path).read_bytes()
        pos, idat, width, height, kind = 8, b"", 0, 0, 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack(">I", data[pos : pos + 4])
            chunk, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
            if chunk == b"IHDR":
                width, height, depth, kind = struct.unpack(">IIBB", body[:10])
                if depth != 8 or kind not in (2, 6) or body[12] != 0:
                    raise ValueError(f"{Path(path).name}: not an 8-bit RGB(A) non-interlaced PNG")
            elif chunk == b"IDAT":
                idat += body
            pos += 12 + length
        raw = zlib.decompress(idat)
        bpp = 3 if kind == 2 else 4
        stride = width * bpp
        previous, colours = bytearray(stride), set()
        for y in range(height):
            start = y * (stride + 1)
            mode, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = previous[i]
                c = previous[i - bpp] if i >= bpp else 0
                if mode == 1:
                    line[i] = (line[i] + a) & 0xFF
                elif mode == 2:
                    line[i] = (line[i] + b) & 0xFF
                elif mode == 3:
                    line[i] = (line[i] + (a + b) // 2) & 0xFF
                elif mode == 4:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
            # cairo writes premultiplied-free RGB(A); the heatmap's background is opaque.
            colours.update(zip(line[0::bpp], line[1::bpp], line[2::bpp]))
            previous = line
        return colours

    @staticmethod
    def read_csv(path, columns, problems, rows=None):
        """The rows as dicts. The header must be `columns`, every row as wide, every numeric cell finite
        (text cells such as "start" or "n/a" pass), and there must be `rows` rows when given."""
        path = Path(path)
        if not path.is_file():
            problems.append(f"{path.name} is missing")
            return []
        with path.open(newline="") as f:
            table = list(csv.reader(f))
        if not table or table[0] != columns:
            problems.append(f"{path.name}: header {table[0] if table else None}, expected {columns}")
            return []
        if rows is not None and len(table) - 1 != rows:
            problems.append(f"{path.name}: {len(table) - 1} rows, expected {rows}")
        for row in table[1:]:
            if len(row) != len(columns):
                problems.append(f"{path.name}: a row has {len(row)} fields, expected {len(columns)}")
            for cell in row:
                try:
                    if not math.isfinite(float(cell)):
                        problems.append(f"{path.name}: non-finite value {cell}")
                except ValueError:
                    pass
        return [dict(zip(columns, row)) for row in table[1:]]

    @staticmethod
    def shares(where, rows, columns, problems):
        """Every `columns` cell of `rows` is a share in [0, 1]."""
        for row in rows:
            for column in columns:
                if not 0.0 <= float(row[column]) <= 1.0:
                    problems.append(f"{where}: {column} = {row[column]} is not a share in [0, 1]")

    @staticmethod
    def settings(markdown):
        """The rows of results.md's settings table, as {name: value}."""
        found, inside = {}, False
        for line in markdown.splitlines():
            if line.startswith("## "):
                inside = line.strip() == "## Settings"
            elif inside and line.startswith("|") and not line.startswith("| ---"):
                cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
                if len(cells) == 2 and cells != ["setting", "value"]:
                    found[cells[0]] = cells[1]
        return found

    # ---- Whole runs.

    def quick_run(self, experiment, out="out", pngs=(), csvs=("results.csv",), seed=None, sizes=None, steps=None,
                  corpus=None, tables=()):
        """`qkv experiment EXPERIMENT --quick` into OUT, checked as a whole: exit 0 within the time limit, progress
        on stderr, the main table (and every title of `tables`) on stdout, results.md with a settings table whose
        command repeats the run and a link to every PNG, every named file written and reported, every PNG valid,
        every CSV headed and finite, no temporary left. Returns the output directory, or None when the run failed."""
        args = ["experiment", experiment, "--quick", "--out", out]
        command = f"qkv experiment {experiment} --quick --seed {seed or 0}"
        if seed is not None:
            args += ["--seed", str(seed)]
        if sizes is not None:
            args += ["--sizes", ",".join(map(str, sizes))]
            command += f" --sizes {','.join(map(str, sizes))}"
        if steps is not None:
            args += ["--steps", str(steps)]
            command += f" --steps {steps}"
        if corpus is not None:
            args += ["--corpus", str(corpus)]
            command += f" --corpus {corpus}"
        name = f"{experiment} --quick --out {out}"
        result, seconds = self.timed(args)
        print(f"     {name}: {seconds:.1f} s")
        if result.returncode != 0:
            self.check(name, [f"exit code {result.returncode}, expected 0"], result)
            return None
        problems = []
        if seconds > self.quick_limit_s:
            problems.append(f"took {seconds:.0f} s (limit {self.quick_limit_s:.0f} s)")
        if f"[{experiment}]" not in result.stderr:
            problems.append("no progress lines on stderr")
        directory = Path(self.path(out)) / experiment
        for file in ["results.md", *pngs, *csvs]:
            if not (directory / file).is_file():
                problems.append(f"{file} is missing")
            elif f"wrote {os.path.join(out, experiment, file)}" not in result.stdout:
                problems.append(f"stdout does not report writing {file}")
        if not directory.is_dir():
            self.check(name, problems or ["no output directory"], result)
            return None
        leftovers = [p.name for p in directory.iterdir() if ".tmp." in p.name]
        if leftovers:
            problems.append(f"temporary files left behind: {leftovers}")
        for png in pngs:
            if (directory / png).is_file():
                problems += self.png_problems(directory / png, min_side=100)
        for table in csvs:
            if (directory / table).is_file():
                header = next(csv.reader((directory / table).read_text().splitlines()[:1]), [])
                self.read_csv(directory / table, header, problems)
        if (directory / "results.md").is_file():
            md = (directory / "results.md").read_text()
            settings = self.settings(md)
            if settings.get("command") != command:
                problems.append(f"results.md's command is {settings.get('command')!r}, expected {command!r}")
            if settings.get("seed") != str(seed or 0):
                problems.append(f"results.md's seed is {settings.get('seed')!r}")
            for png in pngs:
                if f"]({png})" not in md:
                    problems.append(f"results.md does not show {png}")
        if (directory / "results.csv").is_file():
            header = next(csv.reader((directory / "results.csv").read_text().splitlines()[:1]), [])
            printed = [[cell.strip() for cell in line.strip().strip("|").split("|")]
                       for line in result.stdout.splitlines() if line.startswith("|")]
            if header not in printed:
                problems.append(f"the main table (columns {header}) is not printed on stdout")
        for title in tables:
            if title not in result.stdout:
                problems.append(f"stdout lacks the table {title!r}")
        self.check(name, problems, result)
        return directory

    def interrupt(self, name, args, directory, wait_for):
        """Ctrl-C once stderr shows `wait_for` (a progress line of a long phase): the process must die of SIGINT
        saying that nothing was written, and `directory` (DIR/NAME) must be exactly as it was."""
        directory = Path(self.path(directory))
        before = {p.name: p.read_bytes() for p in directory.iterdir()} if directory.is_dir() else {}
        proc = subprocess.Popen([QKV, *args], cwd=self.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, **self.env))
        deadline = time.monotonic() + 60
        seen = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen += line
            if wait_for in line or not line:
                break
        proc.send_signal(signal.SIGINT)
        try:
            _, rest = proc.communicate(timeout=30 * TIME_SCALE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return self.check(name, ["the run did not stop within 30 s of SIGINT"])
        problems = []
        if wait_for not in seen:
            problems.append(f"stderr never showed {wait_for!r} before the interrupt: {seen[-300:]!r}")
        if proc.returncode != -signal.SIGINT:
            problems.append(f"exit status {proc.returncode}, expected death by SIGINT; stderr: {(seen + rest)[-300:]!r}")
        if "nothing was written" not in rest:
            problems.append(f"no message saying nothing was written: {rest[-300:]!r}")
        after = {p.name: p.read_bytes() for p in directory.iterdir()} if directory.is_dir() else {}
        if after != before:
            changed = sorted(set(after) ^ set(before) | {k for k in before if after.get(k) != before[k]})
            problems.append(f"the results directory changed: {changed}")
        return self.check(name, problems)
