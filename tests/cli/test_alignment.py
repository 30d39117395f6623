"""qkv experiment alignment --quick and qkv translate: the run writes well-formed outputs (results.md
with its settings, CSVs with the expected columns and values in [0, 1], valid PNGs, SVG heatmaps with
the gold cells outlined, three model files with a valid header and checksum) and prints its tables;
`qkv translate` loads each saved model and prints a translation and an alignment grid whose columns
are the source words; a corrupt, truncated, foreign or mismatched model file, an unknown word and a
missing file are refused with exit code 2 and one line naming the problem."""

import csv
import math
import os
import re
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


def run(*args, timeout=300):
    """One OpenMP thread: tests run side by side on 2 cores; results do not depend on it."""
    start = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_COLOR="1")
    proc = subprocess.run([QKV, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - start


def check_png(path):
    """The PNG signature, chunks whose CRCs match, IHDR first and IEND last."""
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
        fail(f"{path.name}: malformed chunk list")


def read_csv(path, columns, rows):
    with path.open(newline="") as f:
        table = list(csv.reader(f))
    if not table or table[0] != columns:
        fail(f"{path.name}: header {table[0] if table else None}, expected {columns}")
        return []
    body = [dict(zip(columns, row)) for row in table[1:]]
    if len(body) != rows:
        fail(f"{path.name}: {len(body)} rows, expected {rows}")
    return body


def check_share(where, text):
    value = float(text)
    if not (0.0 <= value <= 1.0):
        fail(f"{where}: {value} is not a share in [0, 1]")


def check_model_file(path):
    """The documented layout: magic, version 1, payload length matching the size, CRC-32 at the end."""
    data = path.read_bytes()
    if data[:8] != b"QKVMODEL":
        return fail(f"{path.name}: magic {data[:8]!r}")
    version, length = struct.unpack("<IQ", data[8:20])
    if version != 1 or len(data) != 20 + length + 4:
        return fail(f"{path.name}: version {version}, payload {length}, size {len(data)}")
    (stored,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != stored:
        fail(f"{path.name}: stored checksum {stored:#x} differs from zlib's {zlib.crc32(data[:-4]):#x}")


def check_experiment(out):
    proc, elapsed = run("experiment", "alignment", "--quick", "--out", str(out))
    print(f"alignment --quick: {elapsed:.1f} s")
    if proc.returncode != 0:
        fail(f"alignment --quick exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
        return None
    if elapsed > QUICK_LIMIT_S:
        fail(f"alignment --quick took {elapsed:.0f} s (limit {QUICK_LIMIT_S} s)")
    directory = out / "alignment"
    for table in ["Results on the test split", "Accuracy by source length"]:
        if table not in proc.stdout:
            fail(f"stdout lacks the table {table!r}")

    results = read_csv(directory / "results.csv", ["model", "parameters", "exact_match", "token_accuracy",
                                                   "alignment_accuracy", "train_seconds", "train_cpu_seconds",
                                                   "validation_loss"], 3)
    if [r.get("model") for r in results] != ["additive", "dot", "none"]:
        fail(f"results.csv models {[r.get('model') for r in results]}")
    for r in results:
        for column in ["exact_match", "token_accuracy"]:
            check_share(f"results.csv {r['model']} {column}", r[column])
        if r["model"] == "none":
            if r["alignment_accuracy"] != "n/a":
                fail(f"the no-attention model has an alignment accuracy: {r['alignment_accuracy']}")
        else:
            check_share(f"results.csv {r['model']} alignment_accuracy", r["alignment_accuracy"])
        if not (float(r["train_seconds"]) > 0 and float(r["train_cpu_seconds"]) > 0
                and math.isfinite(float(r["validation_loss"]))):
            fail(f"results.csv {r['model']}: time {r['train_seconds']}, loss {r['validation_loss']}")

    by_length = read_csv(directory / "by_length.csv",
                         ["source_length", "sentences", "additive_exact", "additive_token", "additive_alignment",
                          "dot_exact", "dot_token", "dot_alignment", "none_exact", "none_token"], 4)
    if [r.get("source_length") for r in by_length] != ["4–6", "7–9", "10–12", "13–15"]:
        fail(f"by_length.csv buckets {[r.get('source_length') for r in by_length]}")
    if by_length and sum(int(r["sentences"]) for r in by_length) != 96:
        fail("by_length.csv: the buckets do not add up to the 96 test sentences of --quick")
    for r in by_length:
        for column, value in r.items():
            if column not in ("source_length", "sentences"):
                check_share(f"by_length.csv {r['source_length']} {column}", value)

    for name in ["accuracy_by_length.png", "loss.png"] + [f"heatmap_{s}_{k}.png" for s in ("additive", "dot")
                                                          for k in (1, 2, 3)]:
        if not (directory / name).is_file():
            fail(f"{name} was not written")
        else:
            check_png(directory / name)
    for k in (1, 2, 3):
        svg = directory / f"heatmap_additive_{k}.svg"
        if not svg.is_file():
            fail(f"{svg.name} was not written")
            continue
        text = svg.read_text()
        marks = re.findall(r'<rect x="(\d+)" y="(\d+)" width="\d+" height="\d+" fill="none" stroke="#ff0000" '
                           r'stroke-width="2"><title>marked: ', text)
        if not text.rstrip().endswith("</svg>") or 'class="marks"' not in text or len(marks) < 4:
            fail(f"{svg.name}: no gold-alignment outlines ({len(marks)} marks)")
        # Each outline's 2 px stroke is centred one pixel inside a cell that the renderer drew.
        cells = set(re.findall(r'<rect x="(\d+)" y="(\d+)" width="\d+" height="\d+" fill="#', text))
        for x, y in marks:
            if (str(int(x) - 1), str(int(y) - 1)) not in cells:
                fail(f"{svg.name}: the gold outline at ({x}, {y}) is not on a cell")
    by_class = read_csv(directory / "alignment_by_class.csv", ["word_class", "words", "additive_alignment",
                                                               "dot_alignment"], 6)
    for r in by_class:
        if int(r["words"]) > 0:
            check_share(f"alignment_by_class.csv {r['word_class']}", r["additive_alignment"])
    for name in ["training.csv", "validation.csv"]:
        if not (directory / name).is_file():
            fail(f"{name} was not written")
    md = (directory / "results.md").read_text()
    for part in ["## Settings", "qkv experiment alignment --quick --seed 0", "![", "heatmap_additive_1.png",
                 "model_additive.qkvm", "```"]:
        if part not in md:
            fail(f"results.md lacks {part!r}")
    for score in ["additive", "dot", "none"]:
        check_model_file(directory / f"model_{score}.qkvm")
    return directory


def check_translate(directory, scratch):
    sentence = "the big dog sees a small cat near the house"
    words = sentence.split()
    for score in ["additive", "dot"]:
        proc, elapsed = run("translate", "--model", str(directory / f"model_{score}.qkvm"), sentence)
        if proc.returncode != 0:
            fail(f"translate ({score}) exited {proc.returncode}: {proc.stderr.strip()}")
            continue
        lines = proc.stdout.splitlines()
        translation = [line for line in lines if line.startswith("translation: ")]
        if len(translation) != 1 or len(translation[0].split()) < 2:
            fail(f"translate ({score}) printed no translation:\n{proc.stdout}")
        # The grid: a header naming every source word, then a row per output word, then the scale.
        header = next((line for line in lines if all(w in line.split() for w in set(words))), None)
        if header is None:
            fail(f"translate ({score}): no grid header with the source words:\n{proc.stdout}")
        if not any(line.startswith("scale: ") for line in lines):
            fail(f"translate ({score}): no legend line:\n{proc.stdout}")
        if "\x1b[" in proc.stdout:
            fail(f"translate ({score}) coloured its output under NO_COLOR")
        print(f"translate ({score}): {elapsed:.2f} s")
    proc, _ = run("translate", "--model", str(directory / "model_none.qkvm"), sentence)
    if proc.returncode != 0 or "translation: " not in proc.stdout or "no attention" not in proc.stdout:
        fail(f"translate (none) exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")

    good = (directory / "model_additive.qkvm").read_bytes()
    corrupt = bytearray(good)
    corrupt[len(good) // 2] ^= 0x40
    forged_version = bytearray(good)
    forged_version[8:12] = struct.pack("<I", 9)
    forged_version[-4:] = struct.pack("<I", zlib.crc32(bytes(forged_version[:-4])))
    cases = {
        "corrupt.qkvm": (bytes(corrupt), "checksum mismatch"),
        "truncated.qkvm": (good[: len(good) - 100], "truncated"),
        "foreign.qkvm": (b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'}", "not a qkv model file"),
        "version.qkvm": (bytes(forged_version), "format version 9"),
        "empty.qkvm": (b"", "not a qkv model file"),
    }
    for name, (data, message) in cases.items():
        path = scratch / name
        path.write_bytes(data)
        proc, _ = run("translate", "--model", str(path), sentence)
        err = proc.stderr.strip()
        if proc.returncode != 2 or message not in err or name not in err or len(err.splitlines()) != 1:
            fail(f"translate --model {name}: exit {proc.returncode}, stderr {err!r}; expected 2 and {message!r}")
    refusals = [
        (["--model", str(scratch / "missing.qkvm"), sentence], "missing.qkvm"),
        (["--model", str(directory / "model_additive.qkvm"), "the dog barks"], 'unknown word "barks"'),
        (["--model", str(directory / "model_additive.qkvm"), "   "], "SENTENCE"),
        (["--model", str(directory / "results.csv"), sentence], "not a qkv model file"),
    ]
    for args, message in refusals:
        proc, _ = run("translate", *args)
        if proc.returncode != 2 or message not in proc.stderr:
            fail(f"translate {args[1:]}: exit {proc.returncode}, stderr {proc.stderr.strip()!r}; expected {message!r}")
    proc, _ = run("experiment", "alignment", "--sizes", "32,64", "--quick", "--out", str(scratch))
    if proc.returncode != 2 or "--sizes" not in proc.stderr:
        fail(f"alignment with two sizes: exit {proc.returncode}, stderr {proc.stderr.strip()!r}")


def main():
    if not QKV:
        print("QKV_BIN is not set", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        directory = check_experiment(tmp / "out")
        if directory is not None:
            check_translate(directory, tmp)
    if failures:
        print(f"{len(failures)} failure(s)", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
