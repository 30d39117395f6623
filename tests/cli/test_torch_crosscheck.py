#!/usr/bin/env python3
"""`qkv attend` and `qkv attend-backward` against an independent PyTorch implementation.

Each case is drawn in float64 with a seeded torch generator. qkv runs on float32 copies of the
inputs (as .npy files); its outputs are compared with torch's float64 result on the original values.
The tolerance of each output is derived, not chosen: twice the max error of the same computation
done naively in float32 torch (on the same float32 copies) against float64, with a floor of a few
float32 ulps of the magnitude of the terms summed (see term_magnitudes) for outputs that float32
gets exactly or nearly by cancellation (T = 1, for one).

torch is qkv's reference here, written out from the definition, not through
scaled_dot_product_attention: the bottom-right causal mask is built explicitly, and a row in which
every key is masked (where torch's softmax gives NaN) is given qkv's definition — output 0, weights
0, lse −inf, zero gradients — by guarding it before the softmax.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_torch_crosscheck.py
"""

import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

QKV = os.path.abspath(os.environ["QKV_BIN"]) if os.environ.get("QKV_BIN") else None
# Outputs that float32 gets exactly still round once when stored: allow a few ulps of the magnitude.
FLOOR_ULPS = 4
EPS32 = float(np.finfo(np.float32).eps)
NAIVE_FACTOR = 2.0


def attention(q, k, v, *, scale=None, causal=False, allowed=None, bias=None, additive=None):
    """qkv's attention in torch, in the dtype of q. Returns (out, weights, lse).

    q [..., Tq, Dk], k [..., Tk, Dk], v [..., Tk, Dv]; allowed (bool) and bias broadcast to the
    scores [..., Tq, Tk]; additive = (w_q [A, Dq], w_k [A, Dk], w [A]) replaces the dot product by
    e_ij = wᵀ tanh(W_q q_i + W_k k_j).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    if additive is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = scale * (q @ k.transpose(-1, -2))
    else:
        w_q, w_k, w = additive
        hidden = (q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)  # [..., Tq, Tk, A]
        scores = torch.tanh(hidden) @ w
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        # Bottom-right aligned: query i sees key j <= i + Tk - Tq.
        i = torch.arange(tq).unsqueeze(1)
        j = torch.arange(tk).unsqueeze(0)
        visible = j <= i + (tk - tq)
    if allowed is not None:
        visible = visible & allowed
    if bias is not None:
        scores = scores + bias
        visible = visible & (bias.detach() > -math.inf)
    visible = torch.broadcast_to(visible, scores.shape)
    # torch.where, not masked_fill on a sum with −inf: its backward sends exactly 0 to the masked
    # branch, so a −inf bias never turns a gradient into NaN.
    scores = torch.where(visible, scores, torch.tensor(-math.inf, dtype=q.dtype))
    any_visible = visible.any(dim=-1, keepdim=True)
    # A row that sees no key: softmax would give NaN; give it finite scores, then zero its output.
    scores = torch.where(any_visible, scores, torch.zeros((), dtype=q.dtype))
    weights = torch.where(any_visible, torch.softmax(scores, dim=-1), torch.zeros((), dtype=q.dtype))
    lse = torch.where(any_visible.squeeze(-1), torch.logsumexp(scores, dim=-1),
                      torch.tensor(-math.inf, dtype=q.dtype))
    return weights @ v, weights, lse


class Case:
    """One problem: its float64 inputs, the qkv options that describe it and the torch call."""

    def __init__(self, name, seed, *, lead=(), tq, tk, dk, dv, dq=None, scale=None, causal=False, mask=None,
                 hidden=None, magnitude=1.0, offset=None):
        self.name = name
        g = torch.Generator().manual_seed(seed)

        def randn(*shape, std=1.0):
            return std * torch.randn(*shape, generator=g, dtype=torch.float64)

        self.additive = hidden is not None
        dq = dk if dq is None else dq
        self.inputs = {"q": randn(*lead, tq, dq, std=magnitude), "k": randn(*lead, tk, dk, std=magnitude),
                       "v": randn(*lead, tk, dv), "dout": randn(*lead, tq, dv)}
        if offset is not None:
            # Feature 0 adds ±offset² to every score of a query: logits of 1e4 that differ by O(1), which
            # only a max-subtracted (shift-invariant) softmax gets right, with gradients that are not 0.
            sign = torch.where(torch.rand(*lead, tq, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
            self.inputs["q"][..., 0] += sign * offset
            self.inputs["k"][..., 0] = offset
        self.scale, self.causal = scale, causal
        self.allowed = None
        if mask is not None:
            kind, shape, rule = mask
            if kind == "bool":
                self.allowed = torch.rand(*shape, generator=g, dtype=torch.float64) < 0.7
                rule(self.allowed)
            else:
                bias = randn(*shape)
                bias[torch.rand(*shape, generator=g, dtype=torch.float64) < 0.2] = -math.inf
                rule(bias)
                self.inputs["bias"] = bias
        if self.additive:
            # PyTorch's nn.Linear initialisation: tanh's argument stays O(1), neither linear nor saturated.
            self.inputs["w_q"] = randn(hidden, dq, std=1 / math.sqrt(dq))
            self.inputs["w_k"] = randn(hidden, dk, std=1 / math.sqrt(dk))
            self.inputs["w"] = randn(hidden, std=1 / math.sqrt(hidden))

    def run_torch(self, dtype):
        """Outputs and gradients of torch's attention on the inputs cast to dtype (through float32 first
        for float32, so that it sees exactly what qkv sees)."""
        x = {name: t.to(dtype).detach().requires_grad_() for name, t in self.inputs.items() if name != "dout"}
        additive = (x["w_q"], x["w_k"], x["w"]) if self.additive else None
        out, weights, lse = attention(x["q"], x["k"], x["v"], scale=self.scale, causal=self.causal,
                                      allowed=self.allowed, bias=x.get("bias"), additive=additive)
        out.backward(self.inputs["dout"].to(dtype))
        result = {"out": out, "weights": weights, "lse": lse}
        result.update({"d" + name: t.grad for name, t in x.items()})
        return {name: t.detach().to(torch.float64).numpy() for name, t in result.items()}

    def run_qkv(self, workdir, impl):
        """The same outputs and gradients from the qkv binary, on float32 copies of the inputs."""
        paths = {}
        for name, t in self.inputs.items():
            paths[name] = os.path.join(workdir, f"{name}.npy")
            np.save(paths[name], t.numpy().astype(np.float32))
        common = ["--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--impl", impl]
        if self.scale is not None:
            common += ["--scale", repr(self.scale)]
        if self.causal:
            common.append("--causal")
        if self.allowed is not None:
            paths["allowed"] = os.path.join(workdir, "allowed.npy")
            np.save(paths["allowed"], self.allowed.numpy())
            common += ["--mask", paths["allowed"]]
        if "bias" in self.inputs:
            common += ["--mask", paths["bias"]]
        if self.additive:
            common += ["--score", "additive", "--wq", paths["w_q"], "--wk", paths["w_k"], "--ww", paths["w"]]

        def out(name):
            return os.path.join(workdir, f"got_{name}.npy")

        forward = ["attend", *common, "-o", out("out"), "--lse", out("lse")]
        # Asking for the weights makes --impl auto pick the reference (the one implementation that
        # materialises them), so only the reference run asks: auto then runs the fast kernel.
        outputs = ["out", "lse"]
        if impl == "reference":
            forward += ["--weights", out("weights")]
            outputs.append("weights")
        grads = [name for name in ("dq", "dk", "dv", "dbias", "dw_q", "dw_k", "dw") if name[1:] in self.inputs]
        flags = {"dq": "--dq", "dk": "--dk", "dv": "--dv", "dbias": "--dbias", "dw_q": "--dwq", "dw_k": "--dwk",
                 "dw": "--dww"}
        backward = ["attend-backward", *common, "--dout", paths["dout"]]
        for name in grads:
            backward += [flags[name], out(name)]
        for args in (forward, backward):
            result = subprocess.run([QKV, *args], capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"qkv {args[0]} exited {result.returncode}: {result.stderr.strip()}")
        got = {}
        for name in [*outputs, *grads]:
            array = np.load(out(name))
            if array.dtype != np.float32:
                raise RuntimeError(f"{name}: qkv wrote {array.dtype}, expected float32")
            got[name] = array.astype(np.float64)
            os.remove(out(name))
        return got


def term_magnitudes(case, expected):
    """For dot-product cases: per output, the largest Σ|term| of the sums that compute it, in float64.

    One float32 rounding of it (ε32 times it) is an error no float32 algorithm can promise to beat:
    it bounds the rounding error of any summation order, so it is the floor of the
    tolerance where the naive float32 error is not a fair measure: where the exact result is 0 or
    tiny because terms cancel (T = 1 gives dS = P(dP − D) = 0 exactly; one-hot rows nearly so),
    naive float32 may cancel exactly by luck while a correct kernel that forms D = rowsum(dO∘O)
    rounds once per term. Additive cases keep the output-magnitude floor."""
    if case.additive:
        return {}
    x = case.inputs
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    scale = 1.0 / math.sqrt(q.shape[-1]) if case.scale is None else case.scale
    p = torch.from_numpy(expected["weights"])
    out = torch.from_numpy(expected["out"])
    dp = dout @ v.transpose(-1, -2)
    d = (dout * out).sum(-1, keepdim=True)
    # dS = P ∘ (dP − D): the terms P·|dP| and P·|D| may cancel; their sum is what rounds.
    ds_terms = p * (dp.abs() + d.abs())
    terms = {"out": p @ v.abs(), "dv": p.transpose(-1, -2) @ dout.abs(), "dq": scale * ds_terms @ k.abs(),
             "dk": scale * ds_terms.transpose(-1, -2) @ q.abs()}
    if "bias" in x:
        terms["dbias"] = ds_terms
    return {name: float(t.abs().max()) if t.numel() else 0.0 for name, t in terms.items()}


def max_error(actual, expected):
    """max |actual − expected|, with equal infinities (a masked row's lse) counting as exact."""
    if actual.shape != expected.shape:
        return math.inf
    with np.errstate(invalid="ignore"):
        diff = np.where(actual == expected, 0.0, np.abs(actual - expected))
    return float(np.max(diff, initial=0.0)) if np.isfinite(diff).all() else math.inf


def magnitude(expected):
    finite = expected[np.isfinite(expected)]
    return float(np.max(np.abs(finite), initial=0.0))


def make_cases():
    def no_change(_):
        pass

    def mask_row(row):
        def rule(mask):
            # Every key of this query is masked: False in a bool mask, −inf in a bias.
            mask[..., row, :] = False if mask.dtype == torch.bool else -math.inf
        return rule

    cases = [
        Case("plain", 1, tq=16, tk=16, dk=8, dv=8),
        Case("Tq != Tk", 2, tq=5, tk=11, dk=8, dv=8),
        Case("Dv != Dk", 3, tq=9, tk=9, dk=4, dv=12),
        Case("batch+heads [2,3]", 4, lead=(2, 3), tq=6, tk=10, dk=8, dv=5),
        Case("heads [3]", 5, lead=(3,), tq=7, tk=4, dk=5, dv=6, scale=0.37),
        Case("causal Tq < Tk", 6, lead=(2, 3), tq=4, tk=9, dk=8, dv=8, causal=True),
        Case("causal Tq > Tk", 7, lead=(2,), tq=9, tk=4, dk=8, dv=8, causal=True),  # first 5 rows see nothing
        Case("causal Tq == Tk", 8, tq=12, tk=12, dk=6, dv=6, causal=True),
        Case("bool mask [H,1,Tk]", 9, lead=(2, 3), tq=6, tk=10, dk=8, dv=8, mask=("bool", (3, 1, 10), no_change)),
        Case("bool mask, masked row", 10, lead=(2, 3), tq=6, tk=10, dk=8, dv=8,
             mask=("bool", (2, 1, 6, 10), mask_row(4))),
        Case("float bias [1,H,Tq,Tk]", 11, lead=(2, 3), tq=6, tk=10, dk=8, dv=8,
             mask=("float", (1, 3, 6, 10), no_change)),
        Case("float bias [Tq,Tk] causal", 12, lead=(2, 2), tq=7, tk=7, dk=4, dv=4, causal=True,
             mask=("float", (7, 7), no_change)),
        Case("float bias, masked row", 13, tq=8, tk=8, dk=4, dv=4, mask=("float", (8, 8), mask_row(2))),
        Case("T=1, d=1", 14, tq=1, tk=1, dk=1, dv=1),
        Case("d=1", 15, lead=(2,), tq=7, tk=9, dk=1, dv=1),
        Case("huge logits |q.k|~1e4", 16, lead=(2,), tq=8, tk=8, dk=8, dv=8, scale=1.0, magnitude=40.0),
        Case("huge common offset ±1e4", 24, lead=(3,), tq=10, tk=12, dk=4, dv=4, scale=1.0, offset=100.0),
        Case("size 113", 17, lead=(1, 2), tq=113, tk=113, dk=64, dv=64, causal=True),
        Case("size 113 x 127, d 113", 18, tq=113, tk=127, dk=113, dv=17),
        # More than two leading dims run as one batch and come back in their shape; a mask whose batch
        # dims mix 1 and full is copied to every entry, and its gradient summed back.
        Case("batch [2,2] + heads 3", 25, lead=(2, 2, 3), tq=6, tk=10, dk=8, dv=5, causal=True),
        Case("batch [2,1,2], bias [2,1,1,1,Tq,Tk]", 26, lead=(2, 1, 2, 3), tq=5, tk=7, dk=4, dv=4,
             mask=("float", (2, 1, 1, 1, 5, 7), mask_row(1))),
        Case("batch [2,2], bias [1,2,3,Tq,Tk]", 27, lead=(2, 2, 3), tq=5, tk=7, dk=4, dv=4,
             mask=("float", (1, 2, 3, 5, 7), no_change)),
        Case("batch [2,3], bool [2,3,1,Tq,Tk]", 28, lead=(2, 3, 2), tq=6, tk=6, dk=4, dv=4,
             mask=("bool", (2, 3, 1, 6, 6), no_change)),
        Case("additive", 19, lead=(2, 2), tq=5, tk=7, dq=6, dk=4, dv=3, hidden=8),
        Case("additive causal+bias+row", 20, lead=(2,), tq=6, tk=5, dk=4, dv=4, hidden=5, causal=True,
             mask=("float", (6, 5), mask_row(5))),
        Case("additive bool mask", 21, tq=9, tk=9, dk=3, dv=5, hidden=16, mask=("bool", (9, 9), mask_row(0))),
        Case("additive T=1, d=1, A=1", 22, tq=1, tk=1, dk=1, dv=1, hidden=1),
        Case("additive size 113", 23, tq=113, tk=113, dq=16, dk=9, dv=8, hidden=32),
    ]
    return cases


def main():
    if not QKV or not os.access(QKV, os.X_OK):
        print(f"QKV_BIN must name the qkv binary, got {QKV!r}")
        return 1
    torch.set_num_threads(1)
    failures = []
    checks = 0
    print(f"{'case':28} {'impl':9} {'output':7} {'max error':>10} {'tolerance':>10} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="qkv_torch_crosscheck_") as workdir:
        for case in make_cases():
            expected = case.run_torch(torch.float64)
            naive = case.run_torch(torch.float32)
            terms = term_magnitudes(case, expected)
            for impl in ["reference"] if case.additive else ["auto", "reference"]:
                try:
                    got = case.run_qkv(workdir, impl)
                except RuntimeError as e:
                    failures.append(f"{case.name} [{impl}]: {e}")
                    print(f"{case.name:28} {impl:9} FAIL {e}")
                    continue
                for name, want in expected.items():
                    if name not in got:
                        continue
                    checks += 1
                    err = max_error(got[name], want)
                    floor = max(FLOOR_ULPS * EPS32 * magnitude(want), EPS32 * terms.get(name, 0.0))
                    tol = max(NAIVE_FACTOR * max_error(naive[name], want), floor)
                    ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
                    ok = err <= tol
                    if not ok:
                        failures.append(f"{case.name} [{impl}] {name}")
                    print(f"{case.name:28} {impl:9} {name:7} {err:10.3e} {tol:10.3e} {ratio:6.2f}"
                          f"{'' if ok else '  FAIL'}")
    print(f"{checks - len(failures)} of {checks} comparisons within tolerance")
    if failures:
        print("failed: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
