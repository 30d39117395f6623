"""qkv experiment alignment --quick and qkv translate: the run writes well-formed outputs (results.md
with its settings, CSVs with the expected columns and values in [0, 1], accuracy by length bucket for
all three models, valid PNGs, SVG heatmaps of three test sentences with the gold cells outlined,
three model files in the documented layout) and prints its tables and progress; Ctrl-C in training
leaves the earlier outputs, models included, as they were; `qkv translate` loads each saved model and
prints a translation and an alignment grid whose columns are the source words; a corrupt, truncated,
foreign or other-version model file, one of another kind or whose tensors do not fit its
configuration, an unknown word and a missing file are refused with exit code 2 and one line naming
the problem.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_alignment.py
"""

import math
import os
import re
import struct
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import ExperimentSuite, run_suite  # noqa: E402  (the harness sits beside this script)

SCORES = ["additive", "dot", "none"]
HEATMAPS = [f"heatmap_{s}_{k}.png" for s in ("additive", "dot") for k in (1, 2, 3)]
SENTENCE = "the big dog sees a small cat near the house"


# ---- The model file layout of include/qkv/io/model_file.hpp, read and written independently of qkv.

def parse_model(data):
    """(kind, [(key, value)], [(name, dims, float32 bytes)]) of a model file's payload."""
    (length,) = struct.unpack("<Q", data[12:20])
    payload, pos = data[20 : 20 + length], 0

    def take(count):
        nonlocal pos
        pos += count
        return payload[pos - count : pos]

    def string():
        (n,) = struct.unpack("<I", take(4))
        return take(n).decode()

    kind = string()
    entries = [(string(), string()) for _ in range(struct.unpack("<I", take(4))[0])]
    tensors = []
    for _ in range(struct.unpack("<I", take(4))[0]):
        name = string()
        dtype, rank = take(2)
        if dtype != 1:
            raise ValueError(f"tensor {name}: dtype {dtype}")
        dims = struct.unpack(f"<{rank}Q", take(8 * rank))
        tensors.append((name, dims, take(4 * math.prod(dims))))
    if pos != len(payload):
        raise ValueError(f"{len(payload) - pos} bytes after the last tensor")
    return kind, entries, tensors


def build_model(kind, entries, tensors):
    def string(text):
        return struct.pack("<I", len(text.encode())) + text.encode()

    payload = string(kind) + struct.pack("<I", len(entries))
    payload += b"".join(string(k) + string(v) for k, v in entries)
    payload += struct.pack("<I", len(tensors))
    for name, dims, values in tensors:
        payload += string(name) + bytes([1, len(dims)]) + struct.pack(f"<{len(dims)}Q", *dims) + values
    head = b"QKVMODEL" + struct.pack("<IQ", 1, len(payload)) + payload
    return head + struct.pack("<I", zlib.crc32(head))


def model_file_problems(path):
    """The documented layout: magic, version 1, payload length matching the size, zlib's CRC-32 at the end,
    and a payload that this script's own reader parses and writes back byte for byte."""
    data = path.read_bytes()
    if data[:8] != b"QKVMODEL":
        return [f"{path.name}: magic {data[:8]!r}"]
    version, length = struct.unpack("<IQ", data[8:20])
    if version != 1 or len(data) != 20 + length + 4:
        return [f"{path.name}: version {version}, payload {length}, size {len(data)}"]
    (stored,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != stored:
        return [f"{path.name}: stored checksum {stored:#x} differs from zlib's {zlib.crc32(data[:-4]):#x}"]
    try:
        parsed = parse_model(data)
    except (ValueError, struct.error) as e:
        return [f"{path.name}: the payload does not parse: {e}"]
    if parsed[0] != "seq2seq" or build_model(*parsed) != data:
        return [f"{path.name}: kind {parsed[0]!r}, or the payload does not round-trip"]
    return []


def check_experiment(t):
    directory = t.quick_run("alignment", pngs=["accuracy_by_length.png", "loss.png", *HEATMAPS],
                            csvs=["results.csv", "by_length.csv", "alignment_by_class.csv", "training.csv",
                                  "validation.csv"],
                            tables=["Results on the test split", "Accuracy by source length"])
    if directory is None:
        return None
    problems = []
    results = t.read_csv(directory / "results.csv", ["model", "parameters", "exact_match", "token_accuracy",
                                                     "alignment_accuracy", "train_seconds", "train_cpu_seconds",
                                                     "validation_loss"], problems, rows=3)
    if [r.get("model") for r in results] != SCORES:
        problems.append(f"results.csv models {[r.get('model') for r in results]}")
    t.shares("results.csv", results, ["exact_match", "token_accuracy"], problems)
    t.shares("results.csv", [r for r in results if r["model"] != "none"], ["alignment_accuracy"], problems)
    for r in results:
        if r["model"] == "none" and r["alignment_accuracy"] != "n/a":
            problems.append(f"the no-attention model has an alignment accuracy: {r['alignment_accuracy']}")
        if not (float(r["train_seconds"]) > 0 and float(r["train_cpu_seconds"]) > 0):
            problems.append(f"results.csv {r['model']}: training time {r['train_seconds']} s")
    t.check("alignment: results on the test split, all three models", problems)

    # A quick run is short, but long enough to show what the experiment is about: attention learns the
    # alignment and translates far better than the model without it. Its results.md says what it is.
    problems = []
    by_model = {r.get("model"): r for r in results}
    if set(by_model) == set(SCORES):
        for model in ("additive", "dot"):
            exact, alignment = float(by_model[model]["exact_match"]), float(by_model[model]["alignment_accuracy"])
            if exact < float(by_model["none"]["exact_match"]) + 0.2:
                problems.append(f"{model}: exact match {exact}, not 0.2 above none's {by_model['none']['exact_match']}")
            if alignment < 0.4:
                problems.append(f"{model}: alignment accuracy {alignment} < 0.4")
    if "A --quick run: 400 steps" not in (directory / "results.md").read_text():
        problems.append("results.md does not say that the run was a --quick one and how it compares")
    t.check("alignment --quick learns visibly and says it is a quick run", problems)

    problems = []
    by_length = t.read_csv(directory / "by_length.csv",
                           ["source_length", "sentences", "additive_exact", "additive_token", "additive_alignment",
                            "dot_exact", "dot_token", "dot_alignment", "none_exact", "none_token"], problems, rows=4)
    if [r.get("source_length") for r in by_length] != ["4–6", "7–9", "10–12", "13–15"]:
        problems.append(f"by_length.csv buckets {[r.get('source_length') for r in by_length]}")
    if by_length and sum(int(r["sentences"]) for r in by_length) != 96:
        problems.append("by_length.csv: the buckets do not add up to the 96 test sentences of --quick")
    t.shares("by_length.csv", by_length, [c for c in by_length[0] if c not in ("source_length", "sentences")]
             if by_length else [], problems)
    by_class = t.read_csv(directory / "alignment_by_class.csv", ["word_class", "words", "additive_alignment",
                                                                 "dot_alignment"], problems, rows=6)
    t.shares("alignment_by_class.csv", [r for r in by_class if int(r["words"]) > 0], ["additive_alignment"], problems)
    t.check("alignment: accuracy by length bucket for all three models, alignment by word class", problems)

    problems = []
    for k in (1, 2, 3):
        svg = directory / f"heatmap_additive_{k}.svg"
        if not svg.is_file():
            problems.append(f"{svg.name} was not written")
            continue
        text = svg.read_text()
        marks = re.findall(r'<rect x="(\d+)" y="(\d+)" width="\d+" height="\d+" fill="none" stroke="#ff0000" '
                           r'stroke-width="2"><title>marked: ', text)
        if not text.rstrip().endswith("</svg>") or 'class="marks"' not in text or len(marks) < 4:
            problems.append(f"{svg.name}: no gold-alignment outlines ({len(marks)} marks)")
        # The red outlines are named by a key under the matrix: a red-framed swatch and its text.
        if ">gold alignment (each target word&apos;s source word)<" not in text and \
                ">gold alignment (each target word's source word)<" not in text:
            problems.append(f"{svg.name}: no key says what the red outlines are")
        # Each outline's 2 px stroke is centred one pixel inside a cell that the renderer drew.
        cells = set(re.findall(r'<rect x="(\d+)" y="(\d+)" width="\d+" height="\d+" fill="#', text))
        for x, y in marks:
            if (str(int(x) - 1), str(int(y) - 1)) not in cells:
                problems.append(f"{svg.name}: the gold outline at ({x}, {y}) is not on a cell")
    md = (directory / "results.md").read_text()
    for part in ["heatmap_additive_1.svg", "model_additive.qkvm", "```"]:
        if part not in md:
            problems.append(f"results.md lacks {part!r}")
    for score in SCORES:
        problems += model_file_problems(directory / f"model_{score}.qkvm")
    t.check("alignment: heatmaps with the gold alignment marked, model files in the documented layout", problems)
    return directory


def check_translate(t, directory):
    words = SENTENCE.split()
    for score in ["additive", "dot"]:
        result, seconds = t.timed(["translate", "--model", str(directory / f"model_{score}.qkvm"), SENTENCE])
        problems = []
        lines = result.stdout.splitlines()
        translation = [line for line in lines if line.startswith("translation: ")]
        if len(translation) != 1 or len(translation[0].split()) < 2:
            problems.append("no translation printed")
        # The grid: a header naming every source word, then a row per output word, then the scale.
        if not any(all(w in line.split() for w in set(words)) for line in lines):
            problems.append("no grid header with the source words")
        if not any(line.startswith("scale: ") for line in lines):
            problems.append("no legend line")
        if "\x1b[" in result.stdout:
            problems.append("coloured output under NO_COLOR")
        if result.returncode != 0:
            problems = [f"exit code {result.returncode}"]
        t.check(f"translate with the {score} model ({seconds:.2f} s)", problems, result)
    t.succeed("translate with the no-attention model", ["translate", "--model", str(directory / "model_none.qkvm"),
                                                        SENTENCE],
              lambda r: None if "translation: " in r.stdout and "no attention" in r.stdout else "no translation")

    good = (directory / "model_additive.qkvm").read_bytes()
    kind, entries, tensors = parse_model(good)
    corrupt = bytearray(good)
    corrupt[len(good) // 2] ^= 0x40
    forged_version = bytearray(good)
    forged_version[8:12] = struct.pack("<I", 9)
    forged_version[-4:] = struct.pack("<I", zlib.crc32(bytes(forged_version[:-4])))
    wider = [(k, str(int(v) + 1) if k == "embedding" else v) for k, v in entries]
    cases = [
        ("corrupt.qkvm", bytes(corrupt), ["checksum mismatch"]),
        ("truncated.qkvm", good[: len(good) - 100], ["truncated"]),
        ("foreign.qkvm", b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'}", ["not a qkv model file"]),
        ("version.qkvm", bytes(forged_version), ["format version 9"]),
        ("empty.qkvm", b"", ["not a qkv model file"]),
        # Whole, checksummed files that do not fit: another kind, a configuration its tensors do not
        # match, a tensor missing, a tensor too many.
        ("kind.qkvm", build_model("language-model", entries, tensors), ["expected a seq2seq model"]),
        ("config.qkvm", build_model(kind, wider, tensors), ["expected shape"]),
        ("missing.qkvm", build_model(kind, entries, tensors[1:]), [f'no tensor "{tensors[0][0]}"']),
        ("extra.qkvm", build_model(kind, entries, [*tensors, ("stray", (1,), b"\0\0\0\0")]), ['"stray"']),
    ]
    for name, data, mentions in cases:
        with open(t.path(name), "wb") as f:
            f.write(data)
        t.refuse(f"translate refuses {name}", ["translate", "--model", name, SENTENCE], name, *mentions)
    model = str(directory / "model_additive.qkvm")
    t.refuse("translate refuses a missing file", ["translate", "--model", "nowhere.qkvm", SENTENCE], "nowhere.qkvm")
    t.refuse("translate refuses an unknown word", ["translate", "--model", model, "the dog barks"],
             'unknown word "barks"')
    t.refuse("translate refuses an empty sentence", ["translate", "--model", model, "   "], "SENTENCE")
    t.refuse("translate refuses a CSV as a model", ["translate", "--model", str(directory / "results.csv"), SENTENCE],
             "not a qkv model file")


def checks(t):
    directory = check_experiment(t)
    if directory is not None:
        check_translate(t, directory)
        t.interrupt("Ctrl-C during alignment's training",
                    ["experiment", "alignment", "--quick", "--steps", "100000", "--out", "out"], "out/alignment",
                    "[alignment]")


if __name__ == "__main__":
    sys.exit(run_suite(ExperimentSuite, "qkv_alignment_", checks))
