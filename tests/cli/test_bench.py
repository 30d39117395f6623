#!/usr/bin/env python3
"""`qkv bench` on tiny shapes, its refusals, and bench/compare_torch.py --quick.

Benchmarks are not tests: nothing here asserts a time. It checks that --json is valid JSON with the
fields compare_torch.py reads, that each baseline appears when it applies, that the text table has
a row per size, that bad input exits 2 with one line naming the option and nothing on stdout, and
that --kv-dtype times float32 K and V beside the stored ones, and
that compare_torch.py --quick runs qkv and PyTorch end to end, says which OpenBLAS core PyTorch ran and
grades every target with its median and spread.

Run: QKV_BIN=build/bench/apps/qkv /usr/bin/python3 tests/cli/test_bench.py
"""

import json
import os
import re
import subprocess
import sys

QKV = os.path.abspath(os.environ["QKV_BIN"]) if os.environ.get("QKV_BIN") else None
COMPARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "compare_torch.py")
EXIT_BAD_INPUT = 2
TINY = ["--d", "8", "--heads", "2", "--repeats", "1"]

failures = []


def check(condition, what):
    if not condition:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def bench(*args):
    return subprocess.run([QKV, "bench", *args], capture_output=True, text=True, check=False)


def check_json_run():
    done = bench("--T", "16,33", "--threads", "2", "--causal", "--backward", *TINY, "--json")
    check(done.returncode == 0, f"bench --json exits 0, got {done.returncode}: {done.stderr}")
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        check(False, f"bench --json prints JSON: {e}: {done.stdout[:200]}")
        return
    check(report["mode"] == "forward+backward" and report["causal"] is True, f"mode and causal: {report}")
    results = report["results"]
    check([r["Tq"] for r in results] == [16, 33], f"one result per --T, got {[r['Tq'] for r in results]}")
    for r in results:
        check(r["median_ms"] > 0 and r["gflops"] > 0, f"positive time and rate: {r}")
        # forward 4·B·H·T²·d, forward + backward 3.5× that
        check(abs(r["flops"] - 3.5 * 4 * 2 * r["Tq"] * r["Tk"] * 8) < 1e-6 * r["flops"], f"flop count: {r}")
        check(r["peak_rss_bytes"] > 0 and r["peak_extra_bytes"] >= 0, f"memory figures: {r}")
        check(set(r["baselines"]) == {"reference", "one_thread", "non_causal"}, f"baselines: {r['baselines']}")
        for b in r["baselines"].values():
            check(b["speedup"] > 0, f"baseline speedup: {b}")
            check_spread(b, "speedup")
    cpu = report.get("cpu")  # reported by newer binaries only
    if cpu is not None:
        check(isinstance(cpu.get("model"), str) and
              all(isinstance(cpu.get(k), int) for k in ("l1d_bytes", "l2_bytes", "l3_bytes")), f"cpu: {cpu}")
    # A busy machine is said, not asserted on: whether this one is busy depends on the suite.
    check(isinstance(report.get("warnings"), list) and all(isinstance(w, str) for w in report["warnings"]),
          f"warnings: {report.get('warnings')}")


def check_spread(entry, key):
    """Where `qkv bench` reports a ratio's spread over its rounds, the median lies within it."""
    low, high = entry.get(f"{key}_min"), entry.get(f"{key}_max")
    if low is None and high is None:
        return
    check(low is not None and high is not None and 0 < low <= entry[key] <= high,
          f"{key} within {key}_min..{key}_max: {entry}")


def check_text_and_baselines():
    done = bench("--T", "8,24", "--threads", "1", *TINY)
    check(done.returncode == 0, f"bench exits 0, got {done.returncode}: {done.stderr}")
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    check([row[0] for row in rows] == ["8", "24"], f"a table row per size: {done.stdout}")
    check("reference" in done.stdout and "one_thread" not in done.stdout, f"1 thread has no thread baseline: "
          f"{done.stdout}")
    done = bench("--T", "8", "--threads", "2", "--baselines", "none", *TINY, "--json")
    check(done.returncode == 0 and json.loads(done.stdout)["results"][0]["baselines"] == {},
          f"--baselines none measures none: {done.stdout}")


def check_decode():
    done = bench("--decode", "--T", "256", *TINY, "--json")
    check(done.returncode == 0, f"bench --decode exits 0, got {done.returncode}: {done.stderr}")
    report = json.loads(done.stdout)
    r = report["results"][0]
    check(report["mode"] == "decode" and report["triad_gbs"] > 0 and report["read_gbs"] > 0, f"decode report: {report}")
    check(r["Tq"] == 1 and r["Tk"] == 256 and r["gbs"] > 0 and r["triad_fraction"] > 0 and r["read_fraction"] > 0,
          f"decode result: {r}")
    check_spread(r, "triad_fraction")
    check_spread(r, "read_fraction")
    # K and V of a tiny decode sit in the cache: the report says its GB/s are the cache's.
    if report["cpu"]["l3_bytes"] > 0:
        cached = [w for w in report["warnings"] if "fits in the last-level cache" in w]
        check(len(cached) == 1, f"decode at Tk = 256 warns that it fits in the cache, warnings: {report['warnings']}")
        check("fits in the last-level cache" in done.stderr, f"the warning is on stderr too: {done.stderr!r}")


def check_kv_dtype():
    """Every --kv-dtype times float32 K and V as its baseline, in decode and in the forward."""
    for dtype, name in (("f16", "float16"), ("bf16", "bfloat16"), ("int8", "int8")):
        done = bench("--decode", "--T", "300", "--kv-dtype", dtype, *TINY, "--json")
        check(done.returncode == 0, f"bench --decode --kv-dtype {dtype} exits 0, got {done.returncode}: {done.stderr}")
        report = json.loads(done.stdout)
        r = report["results"][0]
        check(report["kv_dtype"] == name, f"kv_dtype {name}: {report['kv_dtype']}")
        check(r["over_float32"] > 0 and r["gbs"] > 0, f"decode --kv-dtype {dtype}: {r}")
        check_spread(r, "over_float32")
    done = bench("--T", "40", "--kv-dtype", "bf16", "--causal", "--backward", *TINY, "--json")
    check(done.returncode == 0, f"bench --kv-dtype bf16 --backward exits 0: {done.stderr}")
    baselines = json.loads(done.stdout)["results"][0]["baselines"]
    check("float32" in baselines and baselines["float32"]["speedup"] > 0, f"float32 baseline: {baselines}")
    done = bench("--decode", "--T", "300", "--kv-dtype", "int8", "--kv-cache", *TINY, "--json")
    check(done.returncode == 0, f"bench --decode --kv-cache exits 0: {done.stderr}")
    r = json.loads(done.stdout)["results"][0]
    check(r["paged_over_contiguous"] > 0 and r["append_fraction"] > 0, f"--kv-cache ratios: {r}")
    check_spread(r, "paged_over_contiguous")
    done = bench("--T", "40", "--kv-dtype", "bf16", "--q-dtype", "bf16", *TINY, "--json")
    check(done.returncode == 0, f"bench --q-dtype bf16 exits 0: {done.stderr}")
    report = json.loads(done.stdout)
    check(report["q_dtype"] == "bfloat16" and report["kv_dtype"] == "bfloat16", f"the report's dtypes: {report}")
    check("float32" in report["results"][0]["baselines"], f"float32 baseline: {report['results'][0]}")
    done = bench("--decode", "--T", "300", "--kv-dtype", "f16", *TINY)
    check(done.returncode == 0 and "fp32 Q, float16 K and V" in done.stdout and "over fp32" in done.stdout,
          f"the text report names the storage and the ratio: {done.stdout}")


def check_refusals():
    cases = [
        (["--T", "0"], "--T"),
        (["--T", "16,-3"], "--T"),
        (["--T", "abc"], "--T"),
        (["--d", "0"], "--d"),
        (["--heads", "-1"], "--heads"),
        (["--batch", "0"], "--batch"),
        (["--threads", "0"], "--threads"),
        (["--repeats", "0"], "--repeats"),
        (["--impl", "bogus"], "--impl"),
        (["--baselines", "bogus"], "--baselines"),
        (["--decode", "--backward"], "--backward"),
        (["--decode", "--causal"], "--causal"),
        (["--kv-dtype", "fp8"], "--kv-dtype"),
        (["--kv-dtype", "f16", "--varlen", "8,8"], "--varlen"),
        (["--kv-dtype", "int8", "--dropout", "0.1"], "--dropout"),
        (["--kv-cache"], "--kv-cache"),
        (["--q-dtype", "bf16"], "--q-dtype"),
        (["--kv-dtype", "int8", "--q-dtype", "int8"], "--q-dtype"),
        (["--decode", "--kv-cache", "--kv-dtype", "f16", "--q-dtype", "f16"], "--kv-cache"),
        (["--decode", "--kv-cache", "--batch", "2"], "--kv-cache"),
    ]
    for args, option in cases:
        done = bench(*args)
        lines = done.stderr.strip().splitlines()
        check(done.returncode == EXIT_BAD_INPUT, f"bench {' '.join(args)} exits 2, got {done.returncode}")
        check(len(lines) == 1 and option in lines[0], f"bench {' '.join(args)}: one line naming {option}, got "
              f"{done.stderr!r}")
        check(done.stdout == "", f"bench {' '.join(args)}: nothing on stdout, got {done.stdout!r}")


def check_compare_torch():
    done = subprocess.run([sys.executable, COMPARE, "--qkv", QKV, "--quick"], capture_output=True, text=True,
                          check=False)
    check(done.returncode == 0, f"compare_torch.py --quick exits 0, got {done.returncode}: {done.stderr[-2000:]}")
    graded = [line for line in done.stdout.splitlines() if line.endswith((" met", " MISSED"))]
    check(len(graded) == 9, f"compare_torch.py grades the 9 targets, got {len(graded)}: {done.stdout}")
    check(all(re.search(r"\S+ +\S+ +(met|MISSED)$", line) for line in graded),
          f"each graded line shows a median, a spread and a verdict: {graded}")
    check(re.search(r"PyTorch ran with OpenBLAS core \S+", done.stdout) is not None,
          f"compare_torch.py says which OpenBLAS core PyTorch ran: {done.stdout}")


def main():
    if QKV is None:
        sys.exit("QKV_BIN must name the qkv binary")
    check_json_run()
    check_text_and_baselines()
    check_decode()
    check_kv_dtype()
    check_refusals()
    check_compare_torch()
    if failures:
        sys.exit(f"{len(failures)} failure(s)")
    print("ok")


if __name__ == "__main__":
    main()
