"""qkv experiment coref and encoder-lm: a --quick run of each writes well-formed outputs (results.md
with its settings, CSVs with the expected columns, finite numbers in range, valid PNG heatmaps),
finishes well under the limit, and repeats exactly for a seed; encoder-lm trains on --corpus FILE
and refuses a missing one with exit code 2 and one line."""

import csv
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

QKV = os.environ.get("QKV_BIN")
# --quick must stay under a minute on 2 cores; twice that is a regression, not noise.
QUICK_LIMIT_S = 120

failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL: {message}", file=sys.stderr)


def run(*args):
    start = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([QKV, *args], capture_output=True, text=True, timeout=300, env=env)
    return proc, time.monotonic() - start


def check_png(path):
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return fail(f"{path.name}: not a PNG")
    pos, kinds = 8, []
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        if zlib.crc32(kind + body) != crc:
            return fail(f"{path.name}: chunk {kind!r} has a bad CRC")
        kinds.append(kind)
        pos += 12 + length
    if not kinds or kinds[0] != b"IHDR" or kinds[-1] != b"IEND" or pos != len(data):
        fail(f"{path.name}: truncated or malformed")


def read_csv(path, columns, rows=None):
    """The rows as dicts; header `columns`, every numeric cell finite, `rows` rows when given."""
    if not path.exists():
        fail(f"{path} missing")
        return []
    with path.open(newline="") as f:
        table = list(csv.reader(f))
    if not table or table[0] != columns:
        fail(f"{path.name}: header {table[0] if table else None}, expected {columns}")
        return []
    if rows is not None and len(table) - 1 != rows:
        fail(f"{path.name}: {len(table) - 1} rows, expected {rows}")
    for row in table[1:]:
        for cell in row:
            try:
                if not math.isfinite(float(cell)):
                    fail(f"{path.name}: non-finite value {cell}")
            except ValueError:
                pass
    return [dict(zip(columns, row)) for row in table[1:]]


def in_unit(path, rows, columns):
    for row in rows:
        for c in columns:
            if not 0.0 <= float(row[c]) <= 1.0:
                fail(f"{path.name}: {c} = {row[c]} outside [0, 1]")


def check_coref(out):
    proc, seconds = run("experiment", "coref", "--quick", "--out", str(out))
    if proc.returncode != 0:
        return fail(f"coref --quick exited {proc.returncode}: {proc.stderr[-2000:]}")
    if seconds > QUICK_LIMIT_S:
        fail(f"coref --quick took {seconds:.0f} s")
    d = out / "coref"
    md = (d / "results.md").read_text()
    for part in ("## Settings", "Test accuracy", "Attention mass", "Value ablation", "heatmap_1.png"):
        if part not in md:
            fail(f"coref results.md lacks {part!r}")
    rows = read_csv(d / "results.csv", ["split", "sentences", "accuracy"], 6)
    in_unit(d / "results.csv", rows, ["accuracy"])
    rows = read_csv(d / "attention.csv", ["layer", "head", "alpha_referent", "alpha_other_candidate",
                                          "referent_is_argmax"], 4)
    in_unit(d / "attention.csv", rows, ["alpha_referent", "alpha_other_candidate", "referent_is_argmax"])
    rows = read_csv(d / "ablation.csv", ["layer", "drop_referent_value", "drop_most_attended_other_value",
                                         "referent_more_attended", "attention_and_ablation_agree"], 2)
    in_unit(d / "ablation.csv", rows, ["referent_more_attended", "attention_and_ablation_agree"])
    read_csv(d / "training.csv", ["step", "loss"], 80)
    for k in (1, 2, 3):
        check_png(d / f"heatmap_{k}.png")
    if "Value ablation" not in proc.stdout:
        fail("coref did not print its tables")
    return (d / "results.csv").read_text()


def check_lm(out, *extra):
    proc, seconds = run("experiment", "encoder-lm", "--quick", "--out", str(out), *extra)
    if proc.returncode != 0:
        return fail(f"encoder-lm --quick exited {proc.returncode}: {proc.stderr[-2000:]}")
    if seconds > QUICK_LIMIT_S:
        fail(f"encoder-lm --quick took {seconds:.0f} s")
    d = out / "encoder-lm"
    md = (d / "results.md").read_text()
    for part in ("## Settings", "Validation bits per character", "Samples"):
        if part not in md:
            fail(f"encoder-lm results.md lacks {part!r}")
    rows = read_csv(d / "results.csv", ["model", "parameters", "validation_bits_per_char", "train_tokens_per_s",
                                        "train_seconds"], 2)
    if len(rows) == 2:
        p = [int(r["parameters"]) for r in rows]
        if max(p) > 2 * min(p):
            fail(f"encoder-lm: parameter counts {p} differ by more than 2x")
        for r in rows:
            if not 0.0 < float(r["validation_bits_per_char"]) < 9.0:
                fail(f"encoder-lm: bits per character {r['validation_bits_per_char']} out of range")
            if float(r["train_tokens_per_s"]) <= 0:
                fail("encoder-lm: tokens/s not positive")
    read_csv(d / "training.csv", ["step", "gru_bits", "attention_bits"], 40)
    return rows


def main():
    if not QKV:
        print("QKV_BIN is not set", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        first = check_coref(tmp / "a")
        second = check_coref(tmp / "b")
        if first is not None and first != second:
            fail("coref: the same seed gave different results.csv")
        check_lm(tmp / "lm")
        corpus = tmp / "corpus.txt"
        corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
        rows = check_lm(tmp / "lm_file", "--corpus", str(corpus))
        if rows and "corpus.txt" not in (tmp / "lm_file" / "encoder-lm" / "results.md").read_text():
            fail("encoder-lm --corpus: results.md does not name the corpus")
        proc, _ = run("experiment", "encoder-lm", "--quick", "--out", str(tmp / "x"), "--corpus", str(tmp / "none"))
        if proc.returncode != 2 or len(proc.stderr.strip().splitlines()) != 1 or "--corpus" not in proc.stderr:
            fail(f"missing --corpus: exit {proc.returncode}, stderr {proc.stderr!r}")
    if failures:
        print(f"{len(failures)} failure(s)", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
