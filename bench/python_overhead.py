#!/usr/bin/python3
"""What the Python binding costs, and whether qkv's speed over PyTorch survives it: ratios measured in one run.

  PYTHONPATH=build/release/python /usr/bin/python3 bench/python_overhead.py --qkv build/release/apps/qkv
  ... --quick     tiny shapes: a smoke test of a few seconds

1. Call overhead: qkv.attention (float32, the fused kernel) against the same kernel timed in C++
   in this process (qkv._time_fused_forward: the calls `qkv bench` times, into outputs allocated
   once), H = 8, d = 64, T = 128 and 4096. Each of 3 x --repeats rounds takes one sample of each
   back to back; the overhead is the median of the rounds' (Python / C++ - 1). `qkv bench`'s own figure
   for the shape is printed beside them: it runs in another process, minutes away, so it is shown
   but not divided by. Targets: at most 10% at T = 128 and 2% at T = 4096.
2. qkv.torch.scaled_dot_product_attention against PyTorch's own attention in this process (the
   faster of softmax(q @ k^T * s) @ v and F._scaled_dot_product_attention where this torch has
   it), forward and forward + backward, H = 8, T = 4096, d = 64, round by round; for the forward
   the C++ kernel alone (qkv._time_fused_forward) in the same rounds, the ratio the binding must
   keep. Targets: 3x and 2x.
3. The GIL is released: two Python threads each calling qkv.attention with one kernel thread,
   against one such call alone (1.0x when the two calls run side by side on two cores; 2.0x when
   they take turns).

A sample is one call, or as many as fill 20 ms (the time per call), as `qkv bench` and
bench/compare_torch.py take it. OPENBLAS_CORETYPE is chosen for PyTorch as compare_torch.py does
(set to SkylakeX only on a CPU with AVX-512, kept when already set) before torch is imported.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_torch import (MIN_SAMPLE_MS, SETTLE_S, Figure, attention_step, cpu_info, find_qkv,  # noqa: E402
                           openblas_core, sample_ms, show, show_spread, torch_attention_variants, torch_environment,
                           verdict)

TARGETS = {
    "overhead_small": ("Python call overhead at T = 128 <= 10%", 0.10),
    "overhead_large": ("Python call overhead at T = 4096 <= 2%", 0.02),
    "forward": ("qkv.torch forward >= 3x PyTorch forward", 3.0),
    "forward+backward": ("qkv.torch forward+backward >= 2x PyTorch forward+backward", 2.0),
}


def shapes(quick):
    if quick:
        return {"overhead_T": (32, 256), "heads": 2, "d": 16, "torch_T": 256, "repeats": 2, "gil_T": 512}
    return {"overhead_T": (128, 4096), "heads": 8, "d": 64, "torch_T": 4096, "repeats": 5, "gil_T": 2048}


# The overhead sought (a few percent) is smaller than the machine's drift between two samples, and
# its rounds are cheap: it takes this many rounds per --repeats.
OVERHEAD_ROUNDS_PER_REPEAT = 3


def cli_ms(qkv_bin, t, heads, d, threads):
    """`qkv bench`'s median time for the shape (its own process, 3 samples)."""
    command = [qkv_bin, "bench", "--T", str(t), "--heads", str(heads), "--d", str(d), "--threads", str(threads),
               "--repeats", "3", "--baselines", "none", "--json"]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"python_overhead: `{' '.join(command)}` exited {done.returncode}")
    return json.loads(done.stdout)["results"][0]["median_ms"]


def kernel_sample_ms(qkv, q, k, v):
    """One sample of the fused forward timed in C++ (qkv._time_fused_forward): as many calls as
    fill MIN_SAMPLE_MS, as sample_ms takes them."""
    once = qkv._time_fused_forward(q, k, v, 1) * 1e3
    calls = max(1, int(MIN_SAMPLE_MS / max(once, 1e-3)))
    return qkv._time_fused_forward(q, k, v, calls) * 1e3


def overhead(qkv, np, qkv_bin, s, threads, t):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s["heads"], t, s["d"]), dtype=np.float32) for _ in range(3))
    # Warm-ups, after PyTorch's OpenBLAS threads (spinning after its warm-up) have gone to sleep.
    time.sleep(SETTLE_S)
    kernel_sample_ms(qkv, q, k, v)
    sample_ms(lambda: qkv.attention(q, k, v))
    ratios, python_ms, kernel_ms = [], [], []
    rounds = OVERHEAD_ROUNDS_PER_REPEAT * s["repeats"]
    for i in range(rounds):
        kernel = kernel_sample_ms(qkv, q, k, v)
        py = sample_ms(lambda: qkv.attention(q, k, v))
        kernel_ms.append(kernel)
        python_ms.append(py)
        ratios.append(py / kernel - 1.0)
        print(f"[python_overhead] T = {t} round {i + 1}/{rounds}: kernel {kernel:.4f} ms, Python {py:.4f} ms",
              file=sys.stderr, flush=True)
    return {"T": t, "overhead": Figure.of(ratios), "python_ms": statistics.median(python_ms),
            "kernel_ms": statistics.median(kernel_ms), "cli_ms": cli_ms(qkv_bin, t, s["heads"], s["d"], threads)}


KERNEL = "C++ kernel"


def against_torch(qkv, torch, s):
    import qkv.torch as qkv_torch

    t, heads, d = s["torch_T"], s["heads"], s["d"]
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, t, d) for _ in range(4))
    variants = {"qkv.torch": qkv_torch.scaled_dot_product_attention, **torch_attention_variants(torch, d)}

    results = {}
    for mode in ("forward", "forward+backward"):
        steps = {name: attention_step(torch, mode, fn, (q, k, v), dout) for name, fn in variants.items()}
        if mode == "forward":
            # The C++ kernel's own ratio to PyTorch, in the same rounds: what the binding must keep.
            arrays = [x.numpy() for x in (q, k, v)]
            steps[KERNEL] = lambda: qkv._time_fused_forward(*arrays, 1)
        for fn in steps.values():
            fn()
        rounds = []
        for i in range(s["repeats"]):
            times = {}
            for name, fn in steps.items():
                time.sleep(SETTLE_S)
                times[name] = sample_ms(fn)
            rounds.append(times)
            print(f"[python_overhead] {mode} round {i + 1}/{s['repeats']}: " +
                  ", ".join(f"{name} {ms:.1f} ms" for name, ms in times.items()), file=sys.stderr, flush=True)
        torch_names = [name for name in variants if name != "qkv.torch"]
        best = min(torch_names, key=lambda name: statistics.median(r[name] for r in rounds))
        results[mode] = {"speedup": Figure.of([r[best] / r["qkv.torch"] for r in rounds]), "torch_variant": best,
                         "qkv_ms": statistics.median(r["qkv.torch"] for r in rounds),
                         "torch_ms": statistics.median(r[best] for r in rounds)}
        if KERNEL in steps:
            results[mode]["kernel_speedup"] = Figure.of([r[best] / r[KERNEL] for r in rounds])
    return results


def gil(qkv, np, s):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, s["heads"], s["gil_T"], s["d"]), dtype=np.float32) for _ in range(3))

    def call():
        qkv.set_num_threads(1)
        qkv.attention(q, k, v)

    call()
    ratios = []
    for _ in range(s["repeats"]):
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        call()
        alone = time.perf_counter() - start
        time.sleep(SETTLE_S)
        threads = [threading.Thread(target=call) for _ in range(2)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ratios.append((time.perf_counter() - start) / alone)
    return Figure.of(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qkv", help="the qkv binary (default: $QKV_BIN, then build/bench/apps/qkv, "
                                      "build/release/apps/qkv)")
    parser.add_argument("--threads", type=int, default=2, help="kernel threads for qkv and PyTorch (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of a few seconds")
    parser.add_argument("--repeats", type=int, help="rounds per measurement (default 5; 2 with --quick)")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads: expected >= 1, got {args.threads}")
    s = shapes(args.quick)
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error(f"--repeats: expected >= 1, got {args.repeats}")
        s["repeats"] = args.repeats
    qkv_bin = find_qkv(args.qkv)

    model, flags = cpu_info()
    env, why = torch_environment(flags, args.threads)
    os.environ.update(env)  # before torch and its OpenBLAS load
    import numpy as np
    import torch

    import qkv
    torch.set_num_threads(args.threads)
    qkv.set_num_threads(args.threads)
    torch.matmul(torch.randn(256, 256), torch.randn(256, 256))
    core = openblas_core()

    print(f"CPU: {qkv.cpu_summary()}; SIMD target {qkv.simd_target()}; {args.threads} threads", flush=True)
    print(f"PyTorch {torch.__version__}, OpenBLAS core {core.get('core')} ({why}); qkv {qkv.__version__}", flush=True)
    calls = [overhead(qkv, np, qkv_bin, s, args.threads, t) for t in s["overhead_T"]]
    versus = against_torch(qkv, torch, s)
    qkv.set_num_threads(args.threads)
    two_threads = gil(qkv, np, s)

    print(f"\n1. Call overhead (H = {s['heads']}, d = {s['d']}, {args.threads} threads; sample >= {MIN_SAMPLE_MS:g} ms)")
    print(f"   {'T':>6}  {'C++ kernel':>12}  {'Python':>11}  {'overhead':>9}  {'spread':<17} qkv bench")
    for c in calls:
        o = c["overhead"]
        print(f"   {c['T']:>6}  {c['kernel_ms']:>9.4f} ms  {c['python_ms']:>8.4f} ms  {100 * o.median:>8.1f}%  "
              f"{f'{100 * o.low:.1f}% to {100 * o.high:.1f}%':<17} {c['cli_ms']:.4f} ms")
    print(f"\n2. qkv.torch against PyTorch {torch.__version__} (H = {s['heads']}, T = {s['torch_T']}, d = {s['d']})")
    for mode, r in versus.items():
        kernel = (f"; the C++ kernel alone {show(r['kernel_speedup'].median, 'ratio')} "
                  f"({show_spread(r['kernel_speedup'], 'ratio')})" if "kernel_speedup" in r else "")
        print(f"   {mode:<17} qkv.torch {r['qkv_ms']:.1f} ms, {r['torch_variant']} {r['torch_ms']:.1f} ms: "
              f"{show(r['speedup'].median, 'ratio')} ({show_spread(r['speedup'], 'ratio')}){kernel}")
    print(f"\n3. Two Python threads (1 kernel thread each, T = {s['gil_T']}) over one call: "
          f"{show(two_threads.median, 'ratio')} ({show_spread(two_threads, 'ratio')}); 1.0x = fully parallel")

    figures = {"overhead_small": calls[0]["overhead"], "overhead_large": calls[-1]["overhead"],
               "forward": versus["forward"]["speedup"], "forward+backward": versus["forward+backward"]["speedup"]}
    print("\nTargets" + (" (--quick: shapes too small for the verdicts to mean much)" if args.quick else ""))
    for key, (name, threshold) in TARGETS.items():
        figure = figures[key]
        if key.startswith("overhead"):
            met = "met" if figure.median <= threshold else "MISSED"
            print(f"   {name:<62} {100 * figure.median:6.1f}%  {met}")
        else:
            print(f"   {name:<62} {show(figure.median, 'ratio'):>7}  {verdict(figure, threshold, 'ratio')}")


if __name__ == "__main__":
    main()
