#!/usr/bin/python3
"""qkv's fused attention against PyTorch and the machine's roofs, measured in one run (issue 3).

What it runs, all on the same machine in the same minutes so that load affects every figure alike:
  - qkv, through `qkv bench --json`: forward, forward + backward (each also on 1 thread), causal
    (with the non-causal run as its baseline), decode (against a streaming triad, the memory
    bandwidth roof) and forward + backward at T = 65536, H = 1 for peak memory;
  - PyTorch (Debian's python3-torch 1.13), in a child process whose environment sets
    OPENBLAS_CORETYPE=SkylakeX (Debian's OpenBLAS 0.3.21 otherwise falls back to a generic core,
    about 4x slower GEMM here) and whose torch.set_num_threads matches qkv's threads:
    softmax(q @ k^T * s) @ v and torch.nn.functional._scaled_dot_product_attention, forward and
    forward + backward, keeping the faster of the two; and a torch.matmul SGEMM 2048^3 as the
    arithmetic roof.
Then it prints a table: each target of issue 3, the measured ratio, and met or missed.

FLOPs are counted as `qkv bench` counts them: forward 4*B*H*Tq*Tk*d, forward + backward 3.5x that.

  /usr/bin/python3 bench/compare_torch.py --qkv build/bench/apps/qkv            # full, a few minutes
  /usr/bin/python3 bench/compare_torch.py --qkv build/bench/apps/qkv --quick    # tiny shapes, a smoke test
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TORCH_ENV = {"OPENBLAS_CORETYPE": "SkylakeX"}
BACKWARD_OVER_FORWARD = 2.5

# Issue 3's targets: (name, threshold, how the figure is read).
TARGETS = [
    ("forward >= 70% of the SGEMM roof", 0.70, "fraction"),
    ("forward >= 3x PyTorch forward", 3.0, "ratio"),
    ("forward+backward >= 50% of the SGEMM roof", 0.50, "fraction"),
    ("forward+backward >= 2x PyTorch forward+backward", 2.0, "ratio"),
    ("causal forward >= 1.8x non-causal", 1.8, "ratio"),
    ("2 threads >= 1.85x 1 thread (forward)", 1.85, "ratio"),
    ("decode >= 90% of the triad bandwidth", 0.90, "fraction"),
    ("memory: fwd+bwd peak RSS < 2x inputs+outputs+grads", 2.0, "below"),
]


def shapes(quick):
    """The shapes of one run: issue 3's, or tiny ones that finish in seconds."""
    if quick:
        return {"T": 128, "heads": 2, "d": 16, "repeats": 2, "sgemm": 256,
                "decode": ["--T", "1024", "--heads", "2", "--d", "16"], "memory_T": 2048}
    return {"T": 4096, "heads": 8, "d": 64, "repeats": 5, "sgemm": 2048, "decode": [], "memory_T": 65536}


def attention_flops(heads, t, d, backward):
    return 4.0 * heads * t * t * d * (1.0 + BACKWARD_OVER_FORWARD if backward else 1.0)


def run_qkv(qkv, args, label):
    """Runs `qkv bench ARGS --json` (progress passes through to stderr) and returns its JSON."""
    command = [qkv, "bench", *args, "--json"]
    print(f"[compare] qkv {label}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"compare_torch: `{' '.join(command)}` exited {done.returncode}")
    return json.loads(done.stdout)


def median_ms(fn, repeats):
    fn()  # warm-up: allocator, thread pool, BLAS buffers
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def torch_worker(config):
    """Runs inside the child process that has TORCH_ENV; prints one JSON object on stdout."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    n, t, heads, d, repeats = config["sgemm"], config["T"], config["heads"], config["d"], config["repeats"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    sgemm_ms = median_ms(lambda: torch.matmul(a, b), repeats)
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
              "sgemm_gflops": 2.0 * n ** 3 * 1e-9 / (sgemm_ms * 1e-3), "sgemm_n": n}

    scale = d ** -0.5

    def naive(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v

    variants = {"softmax(q@k^T*s)@v": naive}
    if hasattr(F, "_scaled_dot_product_attention"):
        variants["_scaled_dot_product_attention"] = lambda q, k, v: F._scaled_dot_product_attention(
            q, k, v, None, 0.0, False, False)[0]

    q, k, v, dout = (torch.randn(1, heads, t, d) for _ in range(4))
    for mode, backward in (("forward", False), ("forward+backward", True)):
        flops = attention_flops(heads, t, d, backward)
        best = None
        for name, fn in variants.items():
            if backward:
                qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

                def step(fn=fn, qg=qg, kg=kg, vg=vg):
                    fn(qg, kg, vg).backward(dout)
            else:
                def step(fn=fn):
                    with torch.no_grad():
                        fn(q, k, v)
            ms = median_ms(step, repeats)
            result.setdefault("variants", {})[f"{mode} {name}"] = ms
            if best is None or ms < best[1]:
                best = (name, ms)
        result[mode] = {"variant": best[0], "median_ms": best[1], "gflops": flops * 1e-9 / (best[1] * 1e-3)}
    print(json.dumps(result))


def run_torch(config):
    env = dict(os.environ, **TORCH_ENV)
    env["OMP_NUM_THREADS"] = str(config["threads"])
    print(f"[compare] PyTorch in a child process with {' '.join(f'{k}={v}' for k, v in TORCH_ENV.items())}",
          file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker", json.dumps(config)],
                          stdout=subprocess.PIPE, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"compare_torch: the PyTorch child process exited {done.returncode}")
    return json.loads(done.stdout)


def find_qkv(given):
    for path in (given, os.environ.get("QKV_BIN"), "build/bench/apps/qkv", "build/release/apps/qkv"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
    sys.exit("compare_torch: no qkv binary: pass --qkv PATH or set QKV_BIN")


def verdict(figure, threshold, kind):
    met = figure < threshold if kind == "below" else figure >= threshold
    return "met" if met else "MISSED"


def show(figure, kind):
    return f"{100 * figure:.0f}%" if kind == "fraction" else f"{figure:.2f}x"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qkv", help="the qkv binary (default: $QKV_BIN, then build/bench/apps/qkv)")
    parser.add_argument("--threads", type=int, default=2, help="threads for qkv and PyTorch (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of a few seconds")
    parser.add_argument("--repeats", type=int, help="timed samples per measurement (default 5; 2 with --quick)")
    parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        torch_worker(json.loads(args.torch_worker))
        return
    if args.threads < 1:
        parser.error(f"--threads: expected >= 1, got {args.threads}")

    qkv = find_qkv(args.qkv)
    s = shapes(args.quick)
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error(f"--repeats: expected >= 1, got {args.repeats}")
        s["repeats"] = args.repeats
    common = ["--T", str(s["T"]), "--heads", str(s["heads"]), "--d", str(s["d"]), "--threads", str(args.threads),
              "--repeats", str(s["repeats"])]
    fwd = run_qkv(qkv, [*common, "--baselines", "threads"], "forward")["results"][0]
    fwdbwd = run_qkv(qkv, [*common, "--backward", "--baselines", "threads"], "forward+backward")["results"][0]
    causal = run_qkv(qkv, [*common, "--causal", "--baselines", "causal"], "causal")["results"][0]
    decode_run = run_qkv(qkv, [*s["decode"], "--decode", "--threads", str(args.threads),
                               "--repeats", str(s["repeats"])], "decode")
    memory = run_qkv(qkv, ["--T", str(s["memory_T"]), "--heads", "1", "--d", "64", "--backward", "--repeats", "1",
                           "--threads", str(args.threads), "--baselines", "none"], "memory")["results"][0]
    torch_result = run_torch({"T": s["T"], "heads": s["heads"], "d": s["d"], "threads": args.threads,
                              "repeats": s["repeats"], "sgemm": s["sgemm"]})

    roof = torch_result["sgemm_gflops"]
    decode = decode_run["results"][0]
    one_thread = fwd["baselines"].get("one_thread")
    figures = [
        fwd["gflops"] / roof,
        fwd["gflops"] / torch_result["forward"]["gflops"],
        fwdbwd["gflops"] / roof,
        fwdbwd["gflops"] / torch_result["forward+backward"]["gflops"],
        causal["baselines"]["non_causal"]["speedup"] if "non_causal" in causal["baselines"] else float("nan"),
        one_thread["speedup"] if one_thread else float("nan"),
        decode["triad_fraction"],
        memory["peak_rss_bytes"] / memory["tensor_bytes"],
    ]

    gib = 2.0 ** 30
    print(f"qkv against PyTorch {torch_result['torch']} and the roofs, one run, {args.threads} threads, fp32"
          f"{' (--quick: tiny shapes, figures meaningless)' if args.quick else ''}")
    print(f"PyTorch ran with OPENBLAS_CORETYPE={torch_result['openblas_coretype']} and "
          f"torch.set_num_threads({torch_result['threads']}); qkv SIMD target {decode_run['simd']}")
    print(f"shapes: B=1 H={s['heads']} d={s['d']} Tq=Tk={s['T']}; decode Tq=1 Tk={decode['Tk']} "
          f"H={decode_run['heads']} d={decode_run['d']}; memory T={s['memory_T']} H=1 d=64\n")
    print(f"{'measurement':<58} {'median ms':>10} {'GFLOP/s':>9}")
    rows = [
        (f"SGEMM roof: torch.matmul {torch_result['sgemm_n']}^3", None, roof),
        ("qkv forward", fwd["median_ms"], fwd["gflops"]),
        ("qkv forward, 1 thread", one_thread["median_ms"] if one_thread else None,
         one_thread["gflops"] if one_thread else None),
        ("qkv forward causal", causal["median_ms"], causal["gflops"]),
        ("qkv forward+backward", fwdbwd["median_ms"], fwdbwd["gflops"]),
    ]
    for mode in ("forward", "forward+backward"):
        best = torch_result[mode]
        rows.append((f"PyTorch {mode} ({best['variant']})", best["median_ms"], best["gflops"]))
    for label, ms, gflops in rows:
        ms_text = f"{ms:10.2f}" if ms is not None else f"{'':>10}"
        gflops_text = f"{gflops:9.1f}" if gflops is not None else f"{'':>9}"
        print(f"{label:<58} {ms_text} {gflops_text}")
    for name, ms in sorted(torch_result["variants"].items()):
        print(f"  PyTorch {name}: {ms:.2f} ms")
    fwdbwd_one = fwdbwd["baselines"].get("one_thread")
    if fwdbwd_one:
        print(f"  qkv forward+backward {args.threads} threads vs 1: {fwdbwd_one['speedup']:.2f}x")
    print(f"decode: {decode['median_ms']:.2f} ms, {decode['gbs']:.1f} GB/s of K and V; "
          f"triad {decode_run['triad_gbs']:.1f} GB/s ({100 * decode['triad_fraction']:.0f}%), "
          f"read stream alone {decode_run['read_gbs']:.1f} GB/s ({100 * decode['read_fraction']:.0f}%)")
    print(f"memory: peak RSS {memory['peak_rss_bytes'] / gib:.3f} GiB, peak extra {memory['peak_extra_bytes'] / gib:.3f}"
          f" GiB, inputs+outputs+grads {memory['tensor_bytes'] / gib:.3f} GiB, {memory['median_ms'] / 1e3:.1f} s\n")

    print(f"{'target (issue 3)':<52} {'figure':>8}  verdict")
    for (name, threshold, kind), figure in zip(TARGETS, figures):
        print(f"{name:<52} {show(figure, kind):>8}  {verdict(figure, threshold, kind)}")


if __name__ == "__main__":
    main()
