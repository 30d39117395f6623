"""qkv experiment coref and encoder-lm: a --quick run of each writes well-formed outputs (results.md
with its settings and command, CSVs with the expected columns, finite numbers in range, valid PNGs:
coref's heatmaps of three examples, encoder-lm's loss curves; each one's attention.npy, tokens and
explorer page, which `qkv explore` opens), prints its tables and progress,
finishes well under the limit, and repeats exactly for a seed. coref reports accuracy, the pronoun
row's attention mass per layer and head, and how often attention and value ablation agree;
encoder-lm reports bits per character, training tokens/s and a sample from each of its two models,
whose parameter counts are within 2x, and trains on --corpus FILE when given one.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_coref_lm.py
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import ExperimentSuite, run_suite  # noqa: E402  (the harness sits beside this script)


def check_explore(t, directory, name):
    """The run's saved attention opens in `qkv explore`, and its own page is there."""
    page = directory / "attention.html"
    if not page.is_file() or not page.read_bytes().startswith(b"<!DOCTYPE html>"):
        t.fail(f"{name}: attention.html", "missing or not a page")
    t.succeed(f"{name}: qkv explore opens the saved attention",
              ["explore", str(directory / "attention.npy"), "--tokens-file", str(directory / "attention_tokens.txt"),
               "-o", t.path(f"{name}-explore.png")])


def check_coref(t, out):
    directory = t.quick_run("coref", out=out, pngs=["heatmap_1.png", "heatmap_2.png", "heatmap_3.png"],
                            csvs=["results.csv", "attention.csv", "ablation.csv", "training.csv"],
                            tables=["Test accuracy", "Attention mass", "Value ablation"])
    if directory is None:
        return None
    problems = []
    rows = t.read_csv(directory / "results.csv", ["split", "sentences", "accuracy"], problems, rows=6)
    t.shares("results.csv", rows, ["accuracy"], problems)
    if rows and (rows[0]["split"] != "all" or sum(int(r["sentences"]) for r in rows[1:3]) != int(rows[0]["sentences"])):
        problems.append("results.csv: the two cues do not add up to all the test sentences")
    rows = t.read_csv(directory / "attention.csv", ["layer", "head", "alpha_referent", "alpha_other_candidate",
                                                    "referent_is_argmax"], problems, rows=4)
    t.shares("attention.csv", rows, ["alpha_referent", "alpha_other_candidate", "referent_is_argmax"], problems)
    if sorted((r["layer"], r["head"]) for r in rows) != [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]:
        problems.append(f"attention.csv: (layer, head) rows {[(r['layer'], r['head']) for r in rows]}")
    for r in rows:
        if float(r["alpha_referent"]) + float(r["alpha_other_candidate"]) > 1.0 + 1e-6:
            problems.append(f"attention.csv: the two candidates get more than the whole row in layer {r['layer']}")
    rows = t.read_csv(directory / "ablation.csv", ["layer", "drop_referent_value", "drop_most_attended_other_value",
                                                   "referent_more_attended", "attention_and_ablation_agree"],
                      problems, rows=2)
    t.shares("ablation.csv", rows, ["referent_more_attended", "attention_and_ablation_agree"], problems)
    for r in rows:
        for column in ["drop_referent_value", "drop_most_attended_other_value"]:
            if not -1.0 <= float(r[column]) <= 1.0:
                problems.append(f"ablation.csv: {column} = {r[column]} is not a change of a probability")
    t.read_csv(directory / "training.csv", ["step", "loss"], problems, rows=80)
    t.check(f"coref ({out}): accuracy, attention mass, ablation agreement", problems)

    # The heatmaps frame the pronoun's row in magenta and the referent's column in cyan, and say so.
    problems = []
    colours = t.png_colours(directory / "heatmap_1.png")
    for name, colour in (("pronoun row (magenta)", (255, 0, 255)), ("referent column (cyan)", (0, 255, 255))):
        if colour not in colours:
            problems.append(f"heatmap_1.png: no {name} frame")
    if "magenta" not in (directory / "results.md").read_text():
        problems.append("results.md does not say how the pronoun's row is marked")
    t.check(f"coref ({out}): the heatmaps mark the pronoun's row and the referent's column", problems)
    check_explore(t, directory, f"coref ({out})")
    return (directory / "results.csv").read_bytes()


def check_lm(t, out, corpus=None):
    directory = t.quick_run("encoder-lm", out=out, pngs=["training.png"], csvs=["results.csv", "training.csv"],
                            corpus=corpus, tables=["Validation bits per character"])
    if directory is None:
        return
    problems = []
    rows = t.read_csv(directory / "results.csv", ["model", "parameters", "validation_bits_per_char",
                                                  "train_tokens_per_s", "train_seconds"], problems, rows=2)
    if len(rows) == 2:
        p = [int(r["parameters"]) for r in rows]
        if max(p) > 2 * min(p):
            problems.append(f"parameter counts {p} differ by more than 2x")
        for r in rows:
            if not 0.0 < float(r["validation_bits_per_char"]) < 9.0:
                problems.append(f"bits per character {r['validation_bits_per_char']} out of range")
            if float(r["train_tokens_per_s"]) <= 0:
                problems.append("tokens/s not positive")
    t.read_csv(directory / "training.csv", ["step", "gru_bits", "attention_bits"], problems, rows=40)
    # A sample from each model: its name in bold, then a code block of generated text after the prompt.
    md = (directory / "results.md").read_text()
    for r in rows:
        sample = re.search(r"\*\*" + re.escape(r["model"]) + r"\*\*\n\n```\n(.+?)\n```", md, re.S)
        if not sample or len(sample.group(1)) < 20:
            problems.append(f"no sample from {r['model']} in results.md")
    if corpus and corpus not in t.settings(md).get("corpus", ""):
        problems.append("results.md does not name the corpus")
    t.check(f"encoder-lm ({out}): bits per character, tokens/s, samples, parameter budget", problems)
    check_explore(t, directory, f"encoder-lm ({out})")


def checks(t):
    first = check_coref(t, "a")
    second = check_coref(t, "b")
    t.check("coref: the same seed gives the same results.csv", [] if first == second else ["they differ"])
    check_lm(t, "lm")
    with open(t.path("corpus.txt"), "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 200)
    check_lm(t, "lm_file", corpus="corpus.txt")


if __name__ == "__main__":
    sys.exit(run_suite(ExperimentSuite, "qkv_coref_lm_", checks))
