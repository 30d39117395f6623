#!/usr/bin/env python3
"""`qkv bench` with the attention variants and its --compare modes, on tiny shapes.

Benchmarks are not tests: nothing here asserts a time or a ratio's size. It checks that each
variant option runs and is named in the report (JSON "variant", the text's "variant:" line), that
FLOPs are counted as documented (dense over every pair as before, and over the visible pairs in
"visible_flops" and in --compare), that each --compare mode reports its baselines with positive
ratios, and that bad input exits 2 with one line naming the option and nothing on stdout.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_bench_variants.py
"""

import json
import os
import subprocess
import sys

QKV = os.path.abspath(os.environ["QKV_BIN"]) if os.environ.get("QKV_BIN") else None
EXIT_BAD_INPUT = 2
D, HEADS = 8, 4
TINY = ["--d", str(D), "--heads", str(HEADS), "--repeats", "1", "--threads", "1"]

failures = []


def check(condition, what):
    if not condition:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def bench(*args):
    return subprocess.run([QKV, "bench", *args], capture_output=True, text=True, check=False, timeout=120)


def bench_json(*args):
    done = bench(*args, "--json")
    check(done.returncode == 0, f"bench {' '.join(args)} exits 0, got {done.returncode}: {done.stderr[-500:]}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as e:
        check(False, f"bench {' '.join(args)} prints JSON: {e}: {done.stdout[:200]}")
        return None


def causal_window_pairs(t, left):
    """(q, k) pairs of a T×T causal problem whose queries see at most `left` keys back (-1: all)."""
    return sum(i + 1 if left < 0 else min(i, left) + 1 for i in range(t))


def check_variants_run():
    plain = {"kv_heads": HEADS, "window": None, "softcap": None, "alibi": False, "sinks": False, "dropout": None,
             "seed": None, "varlen": None}
    cases = [
        (["--kv-heads", "2"], {"kv_heads": 2}),
        (["--kv-heads", "1", "--backward"], {"kv_heads": 1}),
        (["--window", "4,0", "--causal"], {"window": [4, 0]}),
        (["--window=-1,2"], {"window": [-1, 2]}),
        (["--softcap", "5"], {"softcap": 5}),
        (["--alibi"], {"alibi": True}),
        (["--sinks", "--backward"], {"sinks": True}),
        (["--dropout", "0.1", "--seed", "4"], {"dropout": 0.1, "seed": 4}),
        (["--kv-heads", "2", "--window", "3,0", "--causal", "--softcap", "5", "--alibi", "--sinks", "--backward"],
         {"kv_heads": 2, "window": [3, 0], "softcap": 5, "alibi": True, "sinks": True}),
    ]
    for args, variant in cases:
        report = bench_json("--T", "16,24", *TINY, *args)
        if report is None:
            continue
        check(report["variant"] == {**plain, **variant}, f"bench {args}: variant {report['variant']}")
        check([r["Tq"] for r in report["results"]] == [16, 24], f"bench {args}: one row per --T")
        for r in report["results"]:
            check(r["median_ms"] > 0 and r["visible_gflops"] > 0, f"bench {args}: positive time and rate: {r}")
            check(0 < r["visible_flops"] <= r["flops"], f"bench {args}: visible FLOPs within the dense ones: {r}")
    # Counted over the visible pairs: a causal window of 4 keys back.
    report = bench_json("--T", "16", *TINY, "--window", "4,0", "--causal")
    if report is not None:
        r = report["results"][0]
        check(abs(r["flops"] - 4 * HEADS * D * 16 * 16) < 1e-6 * r["flops"], f"dense FLOPs as before: {r}")
        check(abs(r["visible_flops"] - 4 * HEADS * D * causal_window_pairs(16, 4)) < 1e-6 * r["flops"],
              f"visible FLOPs of the causal window: {r}")
    # Packed: one row, T the sum of the lengths, FLOPs per sequence.
    report = bench_json(*TINY, "--varlen", "5,9,3", "--causal")
    if report is not None:
        r = report["results"][0]
        check(report["variant"]["varlen"] == [5, 9, 3] and r["Tq"] == 17, f"--varlen: one packed row: {report}")
        check(abs(r["flops"] - 4 * HEADS * D * (25 + 81 + 9)) < 1e-6 * r["flops"], f"--varlen dense FLOPs: {r}")
        check(abs(r["visible_flops"] - 4 * HEADS * D * sum(causal_window_pairs(n, -1) for n in (5, 9, 3)))
              < 1e-6 * r["flops"], f"--varlen visible FLOPs: {r}")
    # --varlen random: 16 lengths from 100 to 4000, the same for the same --seed.
    drawn = []
    for _ in range(2):
        report = bench_json("--varlen", "random", "--seed", "3", "--d", "1", "--heads", "1", "--repeats", "1",
                            "--threads", "1", "--baselines", "none")
        drawn.append(report["variant"]["varlen"] if report else None)
    check(drawn[0] is not None and len(drawn[0]) == 16 and all(100 <= n <= 4000 for n in drawn[0]),
          f"--varlen random: 16 lengths from 100 to 4000, got {drawn[0]}")
    check(drawn[0] == drawn[1], f"--varlen random --seed 3 draws the same lengths twice, got {drawn}")
    # Decode takes grouped K and V (and reads only their bytes).
    report = bench_json("--decode", "--T", "256", *TINY, "--kv-heads", "2", "--sinks", "--alibi")
    if report is not None:
        check(report["mode"] == "decode" and report["variant"]["kv_heads"] == 2, f"decode with --kv-heads: {report}")
    done = bench("--T", "16", *TINY, "--kv-heads", "2", "--alibi")
    check(done.returncode == 0 and "variant: K and V with 2 heads (grouped-query), ALiBi" in done.stdout,
          f"the text report names the variant: {done.stdout}")
    done = bench("--T", "16", *TINY)
    check(done.returncode == 0 and "variant: none" in done.stdout, f"the text report says no variant: {done.stdout}")


def check_compare():
    report = bench_json("--compare", "gqa", "--T", "32,48", *TINY, "--kv-heads", "1", "--causal")
    if report is not None:
        check(report["compare"] == "gqa" and report["variant"]["kv_heads"] == 1, f"compare gqa: {report}")
        check([r["Tq"] for r in report["results"]] == [32, 48], "compare gqa: one row per --T")
        for r in report["results"]:
            base = r["baselines"].get("multi_head")
            check(base is not None and base["flops"] == r["flops"], f"compare gqa: multi_head, the same FLOPs: {r}")
            check(base is not None and 0 < base["gflops_ratio_min"] <= base["gflops_ratio"] <= base["gflops_ratio_max"],
                  f"compare gqa: a ratio with its spread: {r}")
    report = bench_json("--compare", "window", "--T", "64", *TINY, "--window", "8,0", "--causal", "--backward")
    if report is not None:
        r = report["results"][0]
        base = r["baselines"].get("no_window")
        check(report["compare"] == "window" and report["mode"] == "forward+backward" and base is not None,
              f"compare window: {report}")
        if base is not None:
            check(abs(r["flops"] - 3.5 * 4 * HEADS * D * causal_window_pairs(64, 8)) < 1e-6 * r["flops"],
                  f"compare window: the window's visible FLOPs: {r}")
            check(abs(base["flops"] - 3.5 * 4 * HEADS * D * causal_window_pairs(64, -1)) < 1e-6 * base["flops"],
                  f"compare window: the full causal call's visible FLOPs: {base}")
            # Each ratio is of GFLOP/s: the time ratio scaled by the FLOPs ratio, round by round.
            check(base["gflops_ratio"] > 0, f"compare window: a positive ratio: {base}")
    report = bench_json("--compare", "varlen", *TINY, "--varlen", "7,12,3", "--causal")
    if report is not None:
        r = report["results"][0]
        check(report["compare"] == "varlen" and r["Tq"] == 22 and set(r["baselines"]) == {"separate", "padded"},
              f"compare varlen: {report}")
        for name, base in r["baselines"].items():
            check(base["flops"] == r["flops"] and base["gflops_ratio"] > 0,
                  f"compare varlen: {name} credited with the packed FLOPs: {base}")
    done = bench("--compare", "window", "--T", "64", *TINY, "--window", "8,0", "--causal")
    check(done.returncode == 0 and "no_window" in done.stdout and "variant: window (8, 0)" in done.stdout,
          f"compare window's text report: {done.stdout}")


def check_refusals():
    cases = [
        (["--kv-heads", "3"], "--kv-heads"),
        (["--kv-heads", "0"], "--kv-heads"),
        (["--window", "5"], "--window"),
        (["--window=-2,0"], "--window"),
        (["--softcap", "0"], "--softcap"),
        (["--softcap", "nan"], "--softcap"),
        (["--dropout", "1"], "--dropout"),
        (["--dropout", "-0.1"], "--dropout"),
        (["--seed", "3"], "--seed"),
        (["--seed", "-1", "--dropout", "0.1"], "--seed"),
        (["--varlen", "0,5"], "--varlen"),
        (["--varlen", "abc"], "--varlen"),
        (["--varlen", "5,"], "--varlen"),
        (["--varlen", "5,6", "--batch", "2"], "--batch"),
        (["--varlen", "5,6", "--T", "16"], "--T"),
        (["--compare", "gqa"], "--compare"),
        (["--compare", "gqa", "--kv-heads", str(HEADS)], "--compare"),
        (["--compare", "window"], "--compare"),
        (["--compare", "varlen"], "--compare"),
        (["--compare", "bogus"], "--compare"),
        (["--compare", "window", "--window", "4,0", "--baselines", "none"], "--baselines"),
        (["--decode", "--window", "4,0"], "--window"),
        (["--decode", "--varlen", "5,6"], "--varlen"),
        (["--decode", "--compare", "gqa", "--kv-heads", "2"], "--compare"),
    ]
    for args, option in cases:
        done = bench(*TINY, *args)
        lines = done.stderr.strip().splitlines()
        check(done.returncode == EXIT_BAD_INPUT, f"bench {' '.join(args)} exits 2, got {done.returncode}")
        check(len(lines) == 1 and option in lines[0], f"bench {' '.join(args)}: one line naming {option}, got "
              f"{done.stderr!r}")
        check(done.stdout == "", f"bench {' '.join(args)}: nothing on stdout, got {done.stdout!r}")


def main():
    if QKV is None:
        sys.exit("QKV_BIN must name the qkv binary")
    check_variants_run()
    check_compare()
    check_refusals()
    if failures:
        sys.exit(f"{len(failures)} failure(s)")
    print("ok")


if __name__ == "__main__":
    main()
