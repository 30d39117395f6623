#!/usr/bin/python3
"""qkv's fused attention against PyTorch and the machine's roofs, measured in one run.

The machine's speed drifts (on the project's VM by up to 1.5x within minutes), so no ratio here
divides a figure by another measured minutes apart: each is the median of per-round ratios, every
round's parts measured back to back, and it is printed with its spread (min-max over the rounds).

What it runs:
  - PyTorch (Debian's python3-torch), in one child process started once, warmed up once, that
    answers requests on its stdin and stdout (one JSON line each way). Its environment sets
    OMP_NUM_THREADS, and it calls torch.set_num_threads, to qkv's threads. OPENBLAS_CORETYPE is set
    to SkylakeX only where /proc/cpuinfo lists AVX-512 (F, BW, VL, DQ, CD): on the AVX-512 machine
    the project measures on, Debian's OpenBLAS 0.3.21 otherwise picked a generic core, about 4x
    slower GEMM; elsewhere it is left unset (OpenBLAS's own choice, right on e.g. Zen 3, where
    SkylakeX would die of SIGILL); a value already in the environment is kept. The child reports
    the core OpenBLAS actually runs (openblas_get_corename).
  - --repeats rounds (default 5; 2 with --quick) for forward, then as many for forward + backward.
    A round is: one torch.matmul SGEMM 2048^3 sample; one qkv sample (`qkv bench --repeats 1
    --baselines none --json`, a fresh process); one sample of each PyTorch attention,
    softmax(q @ k^T * s) @ v and torch.nn.functional._scaled_dot_product_attention; another SGEMM
    sample. The round's roof is the mean of its two SGEMM rates; its ratios are qkv over that roof
    and qkv over PyTorch (of the two variants, the one with the lower median over all rounds).
  - Then, the child closed, `qkv bench --json` alone for the ratios it measures itself, alternating
    its baseline with the kernel round by round (--repeats rounds): 2 threads over 1 (forward, and
    forward + backward), causal over non-causal, decode over a streaming triad (the memory
    bandwidth roof) and over a read stream; and forward + backward at T = 65536, H = 1 once, for
    its peak memory against the size of its tensors.
Then it prints a table: each of the project's performance targets, the median, the spread, and
met or MISSED.

A sample is one call, or as many calls as fill 20 ms (then the time per call), as `qkv bench`
does. FLOPs are counted as `qkv bench` counts them: forward 4*B*H*Tq*Tk*d, forward + backward 3.5x
that.

  /usr/bin/python3 bench/compare_torch.py --qkv build/bench/apps/qkv            # full, a few minutes
  /usr/bin/python3 bench/compare_torch.py --qkv build/bench/apps/qkv --quick    # tiny shapes, a smoke test
"""

import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

BACKWARD_OVER_FORWARD = 2.5
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")
AVX512_CORETYPE = "SkylakeX"
MODES = ("forward", "forward+backward")
MIN_SAMPLE_MS = 20.0  # a shorter call is repeated within its sample, as `qkv bench` does
# After a call, OpenBLAS's worker threads spin for about 2^28 cycles (~0.1 s) before they sleep;
# the qkv process that follows a PyTorch request starts this much later, so that they do not
# take its cores.
SETTLE_S = 0.25

# The project's performance targets: (name, threshold, how the figure is read).
TARGETS = [
    ("forward >= 80% of the SGEMM roof", 0.80, "fraction"),
    ("forward >= 3x PyTorch forward", 3.0, "ratio"),
    ("forward+backward >= 75% of the SGEMM roof", 0.75, "fraction"),
    ("forward+backward >= 2x PyTorch forward+backward", 2.0, "ratio"),
    ("causal forward >= 1.8x non-causal", 1.8, "ratio"),
    ("2 threads >= 1.85x 1 thread (forward)", 1.85, "ratio"),
    ("2 threads >= 1.85x 1 thread (forward+backward)", 1.85, "ratio"),
    ("decode >= 85% of the triad bandwidth", 0.85, "fraction"),
    ("memory: fwd+bwd peak RSS < 2x inputs+outputs+grads", 2.0, "below"),
]


def shapes(quick):
    """The shapes of one run: the project's, or tiny ones that finish in seconds."""
    if quick:
        return {"T": 128, "heads": 2, "d": 16, "repeats": 2, "sgemm": 256,
                "decode": ["--T", "1024", "--heads", "2", "--d", "16"], "memory_T": 2048}
    return {"T": 4096, "heads": 8, "d": 64, "repeats": 5, "sgemm": 2048, "decode": [], "memory_T": 65536}


def attention_flops(heads, t, d, backward):
    return 4.0 * heads * t * t * d * (1.0 + BACKWARD_OVER_FORWARD if backward else 1.0)


# ---------------------------------------------------------------------------------------------
# The CPU


def cpu_info():
    """The model name and the flags of the first processor in /proc/cpuinfo (empty if unreadable)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip() or "unknown"
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model != "unknown" and flags:
                    break
    except OSError:
        pass
    return model, flags


def torch_environment(flags, threads):
    """The child's environment, and a phrase saying where its OPENBLAS_CORETYPE comes from."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    avx512 = all(flag in flags for flag in AVX512_FLAGS)
    if "OPENBLAS_CORETYPE" in os.environ:
        kept = os.environ["OPENBLAS_CORETYPE"]
        why = f"OPENBLAS_CORETYPE={kept} from your environment, kept"
        if avx512 and kept.lower() != AVX512_CORETYPE.lower():
            # A core without AVX-512 on a CPU that has it halves the SGEMM roof, and every ratio to it
            # then reads about twice too high.
            why += (f"; the CPU has AVX-512, so the SGEMM roof may be understated: unset it (or set "
                    f"{AVX512_CORETYPE}) for a roof of this CPU")
    elif avx512:
        env["OPENBLAS_CORETYPE"] = AVX512_CORETYPE
        why = f"OPENBLAS_CORETYPE={AVX512_CORETYPE}, set as the CPU has AVX-512"
    else:
        why = "OPENBLAS_CORETYPE unset: OpenBLAS's own choice"
    return env, why


# ---------------------------------------------------------------------------------------------
# The PyTorch child process


def openblas_core():
    """Which core the OpenBLAS loaded into this process runs: {"core", "config", "library"} or
    {"core": "unknown", "reason"}. Call after `import torch` and a first matmul."""
    try:
        candidates = []
        blas_like = []
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                path = parts[5].strip()
                name = os.path.basename(path)
                if ".so" not in name or path in candidates:
                    continue
                if "openblas" in name.lower():
                    candidates.insert(0, path)  # the OpenBLAS library itself first
                elif name.startswith(("libblas.so", "libcblas.so", "liblapack.so")):
                    candidates.append(path)
                if "blas" in name.lower() and name not in blas_like:
                    blas_like.append(name)
        if not candidates:
            found = ", ".join(blas_like) if blas_like else "none"
            return {"core": "unknown", "reason": f"no OpenBLAS or libblas among the loaded libraries (BLAS "
                                                 f"libraries loaded: {found})"}
        tried = []
        for path in candidates:
            try:
                library = ctypes.CDLL(path)
                corename = library.openblas_get_corename
            except (OSError, AttributeError) as e:
                tried.append(f"{os.path.basename(path)}: {e}")
                continue
            corename.restype = ctypes.c_char_p
            core = (corename() or b"").decode(errors="replace").strip() or "unknown"
            config = None
            if hasattr(library, "openblas_get_config"):
                get_config = library.openblas_get_config
                get_config.restype = ctypes.c_char_p
                config = (get_config() or b"").decode(errors="replace").strip() or None
            return {"core": core, "config": config, "library": path}
        return {"core": "unknown", "reason": "no loaded BLAS library exports openblas_get_corename (" +
                                             "; ".join(tried) + ")"}
    except Exception as e:  # the report must never crash the run
        return {"core": "unknown", "reason": f"{type(e).__name__}: {e}"}


def sample_ms(fn):
    """One sample: one call, or as many as fill MIN_SAMPLE_MS; the time per call in ms."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = (time.perf_counter() - start) * 1e3
        if elapsed >= MIN_SAMPLE_MS:
            return elapsed / calls


def torch_attention_variants(torch, d):
    """PyTorch's own attention, as the comparisons take it: {name: fn(q, k, v)}, the textbook
    formula and, where this torch has it, its fused F._scaled_dot_product_attention."""
    import torch.nn.functional as F

    scale = d ** -0.5
    variants = {"softmax(q@k^T*s)@v": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v}
    if hasattr(F, "_scaled_dot_product_attention"):
        variants["_scaled_dot_product_attention"] = lambda q, k, v: F._scaled_dot_product_attention(
            q, k, v, None, 0.0, False, False)[0]
    return variants


def attention_step(torch, mode, fn, inputs, dout):
    """One call of fn(q, k, v) in `mode`: "forward" without autograd, or "forward+backward" of
    dout through leaf copies of the inputs (their gradients cleared each time)."""
    if mode == "forward":
        def forward():
            with torch.no_grad():
                fn(*inputs)
        return forward
    leaves = [x.clone().requires_grad_(True) for x in inputs]

    def forward_backward():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(dout)
    return forward_backward


def torch_worker(config):
    """Runs inside the child process: warms up, says it is ready, then answers requests, one JSON
    line in and one out, until "quit" or the end of its stdin."""
    protocol = sys.stdout
    sys.stdout = sys.stderr  # nothing else may reach the parent's pipe
    import torch

    torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    n, t, heads, d = config["sgemm"], config["T"], config["heads"], config["d"]
    a, b = torch.randn(n, n), torch.randn(n, n)

    def sgemm():
        torch.matmul(a, b)

    variants = torch_attention_variants(torch, d)
    q, k, v, dout = (torch.randn(1, heads, t, d) for _ in range(4))
    steps = {mode: {name: attention_step(torch, mode, fn, (q, k, v), dout) for name, fn in variants.items()}
             for mode in MODES}

    sgemm()  # warm-ups, once: allocator, thread pools, BLAS buffers
    core = openblas_core()
    for mode in MODES:
        for fn in steps[mode].values():
            fn()

    def answer(message):
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    answer({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"), "openblas": core,
            "sgemm_n": n, "sgemm_flops": 2.0 * n ** 3, "variants": list(variants)})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        repeats = int(request.get("repeats", 1))
        op = request.get("op")
        if op == "quit":
            break
        if op == "sgemm":
            answer({"ms": [sample_ms(sgemm) for _ in range(repeats)]})
        elif op == "attention" and request.get("mode") in steps:
            answer({"variants": {name: [sample_ms(fn) for _ in range(repeats)]
                                 for name, fn in steps[request["mode"]].items()}})
        else:
            answer({"error": f"unknown request {request}"})


class TorchChild:
    """The parent's side of the PyTorch child process."""

    def __init__(self, config, env, why):
        self.env, self.why = env, why
        self.command = [sys.executable, os.path.abspath(__file__), "--torch-worker", json.dumps(config)]
        print(f"[compare] PyTorch in a child process ({why}; OMP_NUM_THREADS={env['OMP_NUM_THREADS']}); "
              f"warming up", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=env)
        self.info = self._read("starting and warming up")
        if not self.info.get("ready"):
            sys.exit(f"compare_torch: the PyTorch child process answered {self.info} instead of being ready")

    def request(self, message, what):
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died(what)
        reply = self._read(what)
        if "error" in reply:
            sys.exit(f"compare_torch: the PyTorch child process refused {message}: {reply['error']}")
        return reply

    def close(self):
        try:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _read(self, what):
        line = self.process.stdout.readline()
        if not line:
            self._died(what)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            sys.exit(f"compare_torch: the PyTorch child process printed {line[:200]!r} instead of JSON ({what})")

    def _died(self, what):
        try:
            rc = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            rc = self.process.wait()
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            description = signal.strsignal(-rc) or ""
            how = f"was killed by {name}" + (f" ({description})" if description else "")
        else:
            how = f"exited with code {rc}" + (" (its error is above, on stderr)" if rc else " unasked")
        hint = ""
        if rc == -signal.SIGILL:
            hint = ("; an illegal instruction: OpenBLAS runs a core this CPU cannot execute; unset "
                    "OPENBLAS_CORETYPE or set it to a core the CPU supports")
        sys.exit(f"compare_torch: the PyTorch child process {how} while {what}, with "
                 f"OMP_NUM_THREADS={self.env['OMP_NUM_THREADS']} and {self.why}{hint}")


# ---------------------------------------------------------------------------------------------
# qkv


def run_qkv(qkv, args, label):
    """Runs `qkv bench ARGS --json` (progress passes through to stderr) and returns its JSON."""
    command = [qkv, "bench", *args, "--json"]
    print(f"[compare] qkv {label}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"compare_torch: `{' '.join(command)}` exited {done.returncode}")
    return json.loads(done.stdout)


def find_qkv(given):
    for path in (given, os.environ.get("QKV_BIN"), "build/bench/apps/qkv", "build/release/apps/qkv"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
    sys.exit("compare_torch: no qkv binary: pass --qkv PATH or set QKV_BIN")


def attention_rounds(child, qkv, qkv_args, mode, rounds, flops):
    """The rounds of one mode: SGEMM, qkv, PyTorch, SGEMM each. Returns the per-round samples."""
    sgemm_flops = child.info["sgemm_flops"]
    samples = []
    for i in range(rounds):
        label = f"{mode} round {i + 1}/{rounds}"
        before = child.request({"op": "sgemm", "repeats": 1}, f"timing the SGEMM ({label})")["ms"][0]
        time.sleep(SETTLE_S)
        result = run_qkv(qkv, [*qkv_args, "--repeats", "1", "--baselines", "none"], label)
        qkv_result = result["results"][0]
        torch_ms = {name: ms[0] for name, ms in child.request(
            {"op": "attention", "mode": mode, "repeats": 1}, f"timing PyTorch's {label}")["variants"].items()}
        after = child.request({"op": "sgemm", "repeats": 1}, f"timing the SGEMM ({label})")["ms"][0]
        roof = statistics.mean([sgemm_flops * 1e-9 / (ms * 1e-3) for ms in (before, after)])
        samples.append({"sgemm_ms": [before, after], "roof": roof, "qkv_ms": qkv_result["median_ms"],
                        "qkv_gflops": qkv_result["gflops"], "torch_ms": torch_ms, "report": result})
        print(f"[compare] {label}: roof {roof:.1f} GFLOP/s, qkv {qkv_result['gflops']:.1f}, PyTorch "
              f"{max(flops * 1e-9 / (ms * 1e-3) for ms in torch_ms.values()):.1f}", file=sys.stderr, flush=True)
    # PyTorch's figure: the variant with the lower median over the rounds, in every round
    best = min(samples[0]["torch_ms"], key=lambda name: statistics.median(s["torch_ms"][name] for s in samples))
    for s in samples:
        s["torch_gflops"] = flops * 1e-9 / (s["torch_ms"][best] * 1e-3)
        s["of_roof"] = s["qkv_gflops"] / s["roof"]
        s["over_torch"] = s["qkv_gflops"] / s["torch_gflops"]
    return {"samples": samples, "best": best}


# ---------------------------------------------------------------------------------------------
# The report


class Figure:
    """A graded figure: its median and, where it has rounds, their min and max."""

    def __init__(self, median, low=None, high=None):
        self.median, self.low, self.high = median, low, high

    @staticmethod
    def of(values):
        return Figure(statistics.median(values), min(values), max(values))

    @staticmethod
    def from_json(entry, key):
        """entry[key] with entry[key + "_min"/"_max"] where `qkv bench` reports them."""
        if not entry or entry.get(key) is None:
            return Figure(float("nan"))
        return Figure(entry[key], entry.get(f"{key}_min"), entry.get(f"{key}_max"))


def show(value, kind):
    if value is None or value != value:
        return "n/a"
    return f"{100 * value:.0f}%" if kind == "fraction" else f"{value:.2f}x"


def show_spread(figure, kind, absent="n/a"):
    if figure.low is None or figure.high is None:
        return absent
    if kind == "fraction":
        return f"{100 * figure.low:.0f}-{100 * figure.high:.0f}%"
    return f"{figure.low:.2f}-{figure.high:.2f}x"


def verdict(figure, threshold, kind):
    value = figure.median
    met = value == value and (value < threshold if kind == "below" else value >= threshold)
    return "met" if met else "MISSED"


def show_bytes(n):
    for unit, size in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if (n >= size and n % size == 0) or n >= 4 * size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qkv", help="the qkv binary (default: $QKV_BIN, then build/bench/apps/qkv)")
    parser.add_argument("--threads", type=int, default=2, help="threads for qkv and PyTorch (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of a few seconds")
    parser.add_argument("--repeats", type=int, help="rounds per measurement (default 5; 2 with --quick)")
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
    rounds = s["repeats"]
    model, flags = cpu_info()
    env, why = torch_environment(flags, args.threads)
    shape = ["--T", str(s["T"]), "--heads", str(s["heads"]), "--d", str(s["d"]), "--threads", str(args.threads)]
    common = [*shape, "--repeats", str(rounds)]

    # PyTorch and qkv, round by round
    child = TorchChild({"T": s["T"], "heads": s["heads"], "d": s["d"], "threads": args.threads,
                        "sgemm": s["sgemm"]}, env, why)
    paired = {}
    for mode in MODES:
        backward = mode == "forward+backward"
        paired[mode] = attention_rounds(child, qkv, [*shape, *(["--backward"] if backward else [])], mode, rounds,
                                        attention_flops(s["heads"], s["T"], s["d"], backward))
    info = child.info
    child.close()

    # qkv alone, against its own baselines
    fwd = run_qkv(qkv, [*common, "--baselines", "threads"], "forward, 2 threads over 1")["results"][0]
    fwdbwd = run_qkv(qkv, [*common, "--backward", "--baselines", "threads"],
                     "forward+backward, 2 threads over 1")["results"][0]
    causal = run_qkv(qkv, [*common, "--causal", "--baselines", "causal"], "causal")["results"][0]
    decode_run = run_qkv(qkv, [*s["decode"], "--decode", "--threads", str(args.threads), "--repeats", str(rounds)],
                         "decode")
    memory = run_qkv(qkv, ["--T", str(s["memory_T"]), "--heads", "1", "--d", "64", "--backward", "--repeats", "1",
                           "--threads", str(args.threads), "--baselines", "none"], "memory")["results"][0]
    decode = decode_run["results"][0]
    one_thread = fwd.get("baselines", {}).get("one_thread")
    fwdbwd_one = fwdbwd.get("baselines", {}).get("one_thread")
    non_causal = causal.get("baselines", {}).get("non_causal")

    f, fb = paired["forward"]["samples"], paired["forward+backward"]["samples"]
    figures = [
        Figure.of([r["of_roof"] for r in f]),
        Figure.of([r["over_torch"] for r in f]),
        Figure.of([r["of_roof"] for r in fb]),
        Figure.of([r["over_torch"] for r in fb]),
        Figure.from_json(non_causal, "speedup"),
        Figure.from_json(one_thread, "speedup"),
        Figure.from_json(fwdbwd_one, "speedup"),
        Figure.from_json(decode, "triad_fraction"),
        Figure(memory["peak_rss_bytes"] / memory["tensor_bytes"]),
    ]

    # the header
    gib = 2.0 ** 30
    report = f[0]["report"]
    simd = report.get("simd", decode_run.get("simd", "unknown"))
    print(f"qkv against PyTorch {info['torch']} and the roofs, one run of {rounds} rounds, {args.threads} threads, "
          f"fp32{' (--quick: tiny shapes, figures meaningless)' if args.quick else ''}")
    cpu = report.get("cpu") or decode_run.get("cpu")
    caches = ""
    if isinstance(cpu, dict) and all(isinstance(cpu.get(k), int) for k in ("l1d_bytes", "l2_bytes", "l3_bytes")):
        caches = (f"; qkv sees L1d {show_bytes(cpu['l1d_bytes'])}, L2 {show_bytes(cpu['l2_bytes'])}, "
                  f"L3 {show_bytes(cpu['l3_bytes'])}")
    print(f"CPU: {model} ({'AVX-512' if all(x in flags for x in AVX512_FLAGS) else 'no AVX-512'}){caches}")
    blas = info.get("openblas") or {}
    core = blas.get("core", "unknown")
    core_text = core if core != "unknown" else f"unknown ({blas.get('reason', 'not reported')})"
    print(f"PyTorch ran with OpenBLAS core {core_text} ({why}) and torch.set_num_threads({info['threads']}); "
          f"qkv SIMD target {simd}")
    if blas.get("config"):
        print(f"OpenBLAS: {blas['config']} ({blas.get('library')})")
    print(f"shapes: B=1 H={s['heads']} d={s['d']} Tq=Tk={s['T']}; decode Tq=1 Tk={decode['Tk']} "
          f"H={decode_run['heads']} d={decode_run['d']}; memory T={s['memory_T']} H=1 d=64\n")

    # the rounds
    print("rounds: SGEMM, qkv, PyTorch, SGEMM; the roof is the mean of the round's two SGEMM rates (GFLOP/s)")
    print(f"{'mode':<18} {'round':>5} {'roof':>8} {'qkv':>8} {'PyTorch':>8} {'qkv/roof':>9} {'qkv/PyTorch':>12}")
    for mode in MODES:
        for i, r in enumerate(paired[mode]["samples"]):
            print(f"{mode:<18} {i + 1:>5} {r['roof']:8.1f} {r['qkv_gflops']:8.1f} {r['torch_gflops']:8.1f} "
                  f"{100 * r['of_roof']:8.0f}% {r['over_torch']:11.2f}x")
    print()

    # the measurements
    sgemm_ms = [ms for mode in MODES for r in paired[mode]["samples"] for ms in r["sgemm_ms"]]
    print(f"{'measurement':<58} {'median ms':>10} {'min-max ms':>19} {'GFLOP/s':>9}")
    rows = [(f"SGEMM roof: torch.matmul {info['sgemm_n']}^3", sgemm_ms, info["sgemm_flops"])]
    for mode, samples in (("forward", f), ("forward+backward", fb)):
        flops = attention_flops(s["heads"], s["T"], s["d"], mode != "forward")
        rows.append((f"qkv {mode}", [r["qkv_ms"] for r in samples], flops))
        one = one_thread if mode == "forward" else fwdbwd_one
        rows.append((f"qkv {mode}, 1 thread", one["median_ms"] if one else None, flops))
        if mode == "forward":
            rows.append(("qkv forward causal", causal["median_ms"], flops))
    for mode, samples in (("forward", f), ("forward+backward", fb)):
        flops = attention_flops(s["heads"], s["T"], s["d"], mode != "forward")
        best = paired[mode]["best"]
        rows.append((f"PyTorch {mode} ({best})", [r["torch_ms"][best] for r in samples], flops))
    for label, ms, flops in rows:
        spread = ""
        if isinstance(ms, list):
            spread = f"{min(ms):.2f}-{max(ms):.2f}"
            ms = statistics.median(ms)
        ms_text = f"{ms:10.2f}" if ms is not None else f"{'':>10}"
        gflops_text = f"{flops * 1e-9 / (ms * 1e-3):9.1f}" if ms else f"{'':>9}"
        print(f"{label:<58} {ms_text} {spread:>19} {gflops_text}")
    for mode, samples in (("forward", f), ("forward+backward", fb)):
        for name in sorted(samples[0]["torch_ms"]):
            ms = [r["torch_ms"][name] for r in samples]
            print(f"  PyTorch {mode} {name}: {statistics.median(ms):.2f} ms ({min(ms):.2f}-{max(ms):.2f})")
    triad, read = figures[7], Figure.from_json(decode, "read_fraction")
    print(f"decode: {decode['median_ms']:.2f} ms, {decode['gbs']:.1f} GB/s of K and V; "
          f"triad {decode_run['triad_gbs']:.1f} GB/s ({show(triad.median, 'fraction')}, "
          f"{show_spread(triad, 'fraction', 'spread not reported')}), read stream alone {decode_run['read_gbs']:.1f} "
          f"GB/s ({show(read.median, 'fraction')}, {show_spread(read, 'fraction', 'spread not reported')})")
    print(f"memory: peak RSS {memory['peak_rss_bytes'] / gib:.3f} GiB, peak extra {memory['peak_extra_bytes'] / gib:.3f}"
          f" GiB, inputs+outputs+grads {memory['tensor_bytes'] / gib:.3f} GiB, {memory['median_ms'] / 1e3:.1f} s\n")

    print(f"{'target':<52} {'median':>8} {'min-max':>13}  verdict")
    for (name, threshold, kind), figure in zip(TARGETS, figures):
        absent = "one run" if kind == "below" else "n/a"
        print(f"{name:<52} {show(figure.median, kind):>8} {show_spread(figure, kind, absent):>13}  "
              f"{verdict(figure, threshold, kind)}")


if __name__ == "__main__":
    main()
