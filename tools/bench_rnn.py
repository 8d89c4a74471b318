#!/usr/bin/env python3
"""Performance benchmark: one BPTT training step of an Elman RNN, vgraph vs hand-written numpy.

Model (float32)::

    h_0 = 0,  h_t = tanh(x_t W_x + h_{t-1} W_h + b)   t = 1..T
    loss = mean((h_T W_o - y)^2)                       W_o: (H, 4), no output bias
    SGD:   p -= 0.01 * dloss/dp                        for p in (W_x, W_h, b, W_o)

vgraph's model is written the natural way, ``tanh(x_t @ W_x + h @ W_h + b)`` inside the loop.
vgraph step, mode "rebuild": ``g.build(feed, loss)`` (unrolls and computes the forward) +
``cg.backward`` + ``p.value = p.value - lr * p.grad`` for each parameter + ``g.params.zero_grad()``, every
step with a sequence of length T (the same structure every step).
Mode "rebuild-new": the same, but the sequence length changes every step within T ± 10% (every
length of the range in turn, shuffled: a new structure every step). Mode "rebuild-nocache": those
lengths, each build with ``cache=False`` (every step unrolled as a structure never seen before);
mode "per-node-nocache": the same with the loop unrolled node by node (``programs=False``, the
reference path; every other mode runs it as a body program, the default).
Mode "reuse": the UnrolledGraph is built once; each step ``cg.feed(new data)``, ``cg.forward()``
(dirty-checked; everything is recomputed since inputs and parameters changed), backward and the
same update.

The numpy reference ("floor ms", what the ratios and targets use) is the tightest numpy a careful
person writes for this model: the input projections ``x @ W_x + b`` of all steps as one
``(T*B, I) @ (I, H)`` matmul before the recurrence; preallocated ``(T+1, B, H)`` state and
``(T, B, H)`` gradient buffers (kept across steps); in-place ``np.matmul(..., out=)``, ``+=`` and
``np.tanh(..., out=)``; after the backward sweep, the gradients of ``W_x``, ``W_h`` and ``b`` each
as one ``(T*B)``-row matmul or sum. The previous reference ("per-step ms": the same matrix
products vgraph executes, ``x_t W_x`` and the weight gradients per step) is a second column.

All three run in the same process, interleaved (the order alternates every repeat), on the same
weights and the same sequence of data batches; each keeps its own copy of the parameters. Before
timing, gradients and loss of both vgraph modes and of the per-step reference are checked equal
to the floor's (rtol 1e-4, atol 1e-5); after timing, the parameters of all implementations,
trained on the same batches, are checked equal again. A mismatch aborts with exit status 2.

PyTorch eager columns (when torch is installed; ``--no-torch`` leaves them out), interleaved with the
others and on one thread: "torch loop", the step as a careful PyTorch user writes it by hand (the
input projections of all steps as one product, ``tanh`` in a Python loop over time) and
"nn.RNN", ``torch.nn.RNN`` itself; both ``torch.optim.SGD``. Their loss and gradients are checked
against the floor's in float64 (1e-10 relative) before timing, their parameters after timing.

Also measured: unrolling throughput (len(cg) / build time for a 10,000-step loop), incremental
re-forward (1 of 100 independent input paths changed) vs a full forward, and the peak memory
(tracemalloc) of one build+backward at T=1000 vs the bytes of the values the graph keeps.

Linearity (issue 10 §2): time and peak memory (tracemalloc) of the backward pass through (a) a loop
stepping through a sequence that needs a gradient (``loop.step(x @ W_x)``) and (b) an N-D @ 2-D
product (``nn.Linear`` on a ``(T, B, H)`` stack), each at T and 2T: linear code gives ratios of
about 2, quadratic code about 4.

Table columns: "ratio" is vgraph ms / floor ms (medians; what the targets use); "paired" is the
median of per-repeat ratios of back-to-back runs and "cpu" the ratio of thread-CPU-time medians,
two cross-checks that move less when other processes load the machine. BLAS runs single-threaded
unless ``--blas-threads N`` (or OPENBLAS_NUM_THREADS / OMP_NUM_THREADS) says otherwise.

Usage::

    PYTHONPATH=. python3 tools/bench_rnn.py [--quick] [--json out.json] [--repeats N] [--warmup N]
                                            [--sizes I,H,B,T ...]
                                            [--modes reuse rebuild rebuild-new rebuild-nocache per-node-nocache]
                                            [--no-extras] [--strict] [--blas-threads N] [--no-torch]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchcommon import TORCH_MISSING, load_torch, pin_blas_threads

if __name__ == "__main__":
    pin_blas_threads()

import numpy as np

try:
    import vgraph as vg
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vgraph as vg

# ---------------------------------------------------------------------------- configuration

SIZES: list[tuple[int, int, int, int]] = [
    (8, 32, 16, 50),
    (32, 128, 32, 50),
    (64, 256, 64, 100),
    (8, 32, 1, 1000),
]
MODES = ("reuse", "rebuild", "rebuild-new", "rebuild-nocache", "per-node-nocache")
#: Targets of issue 10: vgraph ms / tight-floor ms (medians) must be at most this.
TARGETS: dict[str, dict[tuple[int, int, int, int], float]] = {
    "reuse": {(8, 32, 16, 50): 2.0, (32, 128, 32, 50): 1.1, (64, 256, 64, 100): 1.05, (8, 32, 1, 1000): 3.0},
    "rebuild": {(8, 32, 16, 50): 2.5, (32, 128, 32, 50): 1.2, (64, 256, 64, 100): 1.1, (8, 32, 1, 1000): 3.5},
    "rebuild-new": {
        (8, 32, 16, 50): 4.0,
        (32, 128, 32, 50): 1.6,
        (64, 256, 64, 100): 1.3,
        (8, 32, 1, 1000): 6.0,
    },
}
#: Mode "rebuild-new": sequence lengths vary by up to this fraction around T.
LENGTH_SPREAD = 0.10
UNROLL_TARGET_NODES_PER_S = 100_000.0
MEMORY_TARGET_RATIO = 1.5

OUT = 4
LR = 0.01
DTYPE = np.float32
RTOL, ATOL = 1e-4, 1e-5
PARAM_NAMES = ("Wx", "Wh", "b", "Wo")
N_BATCHES = 4  # distinct data batches, cycled through step after step
WARMUP, REPEATS = 3, 25
QUICK_WARMUP, QUICK_REPEATS = 1, 3


class BenchmarkMismatch(AssertionError):
    """vgraph and the numpy reference disagree: the timings would be meaningless."""


# ---------------------------------------------------------------------------- the model


def make_model(I: int, H: int, B: int, seed: int = 0) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The Elman RNN as a VirtualGraph; returns ``(g, loss)``."""
    g = vg.VirtualGraph(dtype=DTYPE, seed=seed, name="elman")
    x = g.input("x", shape=(None, B, I))
    y = g.input("y", shape=(B, OUT))
    Wx = g.parameter("Wx", (I, H))
    Wh = g.parameter("Wh", (H, H), init="orthogonal")
    b = g.parameter("b", (H,), init="normal")
    Wo = g.parameter("Wo", (H, OUT))
    h0 = g.constant(np.zeros((B, H), dtype=DTYPE), name="h0")
    with g.loop(name="time") as L:
        xt = L.step(x, name="x_t")
        h = L.carry(h0, name="h")
        L.update(h, vg.tanh(xt @ Wx + h @ Wh + b))
    out = L.final(h) @ Wo
    loss = ((out - y) ** 2).mean()
    return g, loss


def make_data(
    I: int, B: int, T: int, n: int = N_BATCHES, seed: int = 1234
) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((T, B, I)).astype(DTYPE), rng.standard_normal((B, OUT)).astype(DTYPE))
        for _ in range(n)
    ]


def length_schedule(T: int, n: int, seed: int = 4321) -> list[int]:
    """``n`` sequence lengths for mode "rebuild-new": every length in ``T ± 10%`` in turn.

    The lengths of the range are cycled through in a shuffled order, so no two consecutive steps
    share a length and a length comes back only after all the others: a structure cache that
    holds fewer structures than the range has lengths misses at every step.
    """
    lo = max(1, round(T * (1 - LENGTH_SPREAD)))
    hi = max(lo + 1, round(T * (1 + LENGTH_SPREAD)))
    order = [int(v) for v in np.random.default_rng(seed).permutation(np.arange(lo, hi + 1))]
    return [order[i % len(order)] for i in range(n)]


# ---------------------------------------------------------------------------- numpy references


#: Reusable buffers of the tight reference, keyed by (B, H, dtype); grown to the longest T seen
#: (a careful user allocates the state and gradient buffers once, not per step).
_WORKSPACE: dict[tuple[int, int, str], dict[str, np.ndarray]] = {}


def _workspace(T: int, B: int, H: int, dtype: Any) -> dict[str, np.ndarray]:
    key = (B, H, np.dtype(dtype).str)
    ws = _WORKSPACE.get(key)
    if ws is None or ws["hs"].shape[0] < T + 1:
        ws = _WORKSPACE[key] = {
            "hs": np.empty((T + 1, B, H), dtype=dtype),  # hs[0] = h_0, hs[t] = h_t
            "ga": np.empty((T, B, H), dtype=dtype),  # dloss/da_t for every step
            "tmp": np.empty((B, H), dtype=dtype),  # h_{t-1} W_h
            "gh": np.empty((B, H), dtype=dtype),  # dloss/dh_t
            "ones": np.ones(T * B, dtype=dtype),  # column sums as products: BLAS beats np.sum over rows
        }
    return ws


def numpy_grads(
    P: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, marks: list[float] | None = None
) -> tuple[float, dict[str, np.ndarray]]:
    """The tight floor: forward + BPTT as a careful person writes it; returns ``(loss, grads)``.

    The input projections ``x_t W_x + b`` of all steps are one ``(T*B, I) @ (I, H)`` product written
    straight into the preallocated state buffer; the recurrence then only adds ``h_{t-1} W_h``
    (``np.matmul(..., out=)``, ``+=``, ``np.tanh(..., out=)``: no temporaries); the backward sweep
    only computes ``dloss/da_t`` into a preallocated ``(T, B, H)`` buffer (multiplying by a
    C-contiguous copy of ``W_h^T``, made once per step: BLAS is slower with a transposed operand),
    and the gradients of ``W_x``, ``W_h`` and ``b`` are each one ``(T*B)``-row product after the
    sweep (``b``'s with a vector of ones: BLAS sums columns faster than ``np.sum`` over rows).

    ``marks``: if given, ``time.perf_counter()`` is appended to it when the forward ends (after
    the loss), for tools/bench_gap.py's split by phase.
    """
    Wx, Wh, b, Wo = P["Wx"], P["Wh"], P["b"], P["Wo"]
    T, B, I = x.shape
    H = Wh.shape[0]
    ws = _workspace(T, B, H, Wh.dtype)
    hs, gas, tmp, gh = ws["hs"][: T + 1], ws["ga"][:T], ws["tmp"], ws["gh"]
    hs[0] = 0
    x2 = x.reshape(T * B, I)
    np.matmul(x2, Wx, out=hs[1:].reshape(T * B, H))  # pre-activations, in place of h_1..h_T
    hs[1:] += b
    for t in range(T):
        a = hs[t + 1]
        np.matmul(hs[t], Wh, out=tmp)
        a += tmp
        np.tanh(a, out=a)
    hT = hs[T]
    diff = hT @ Wo
    diff -= y
    loss = float(np.vdot(diff, diff)) / diff.size
    if marks is not None:
        marks.append(time.perf_counter())
    diff *= 2.0 / diff.size  # dloss/dout
    gWo = hT.T @ diff
    np.matmul(diff, Wo.T, out=gh)
    WhT = np.ascontiguousarray(Wh.T)  # BLAS is slower with a transposed operand (docs/performance.md)
    for t in range(T - 1, -1, -1):
        ga = gas[t]
        ht = hs[t + 1]
        np.multiply(ht, ht, out=ga)
        np.subtract(1, ga, out=ga)
        ga *= gh  # dloss/da_t, a_t the pre-activation
        if t:  # h_0 is a constant: no gradient needed
            np.matmul(ga, WhT, out=gh)
    ga2 = gas.reshape(T * B, H)
    gWx = x2.T @ ga2
    gWh = hs[:T].reshape(T * B, H).T @ ga2
    gb = ws["ones"][: T * B] @ ga2
    return loss, {"Wx": gWx, "Wh": gWh, "b": gb, "Wo": gWo}


def numpy_grads_perstep(
    P: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """The previous reference, kept as a second column: the same model with ``x_t W_x`` and the
    weight-gradient products computed per step (what vgraph's node-by-node unroll executes)."""
    Wx, Wh, b, Wo = P["Wx"], P["Wh"], P["b"], P["Wo"]
    T, B, _ = x.shape
    H = Wh.shape[0]
    hs = np.empty((T + 1, B, H), dtype=Wh.dtype)  # hs[0] = h_0 = 0, hs[t] = h_t
    hs[0] = 0
    for t in range(T):
        a = x[t] @ Wx
        a += hs[t] @ Wh
        a += b
        np.tanh(a, out=hs[t + 1])
    hT = hs[T]
    out = hT @ Wo
    diff = out - y
    loss = float(np.mean(diff * diff))
    go = diff * (2.0 / diff.size)
    gWo = hT.T @ go
    gh = go @ Wo.T
    gWx = np.zeros_like(Wx)
    gWh = np.zeros_like(Wh)
    gb = np.zeros_like(b)
    for t in range(T - 1, -1, -1):
        ht = hs[t + 1]
        ga = ht * ht
        np.subtract(1, ga, out=ga)
        ga *= gh  # dloss/da_t, a_t the pre-activation
        gWx += x[t].T @ ga
        gWh += hs[t].T @ ga
        gb += ga.sum(axis=0)
        if t:  # h_0 is a constant: no gradient needed
            gh = ga @ Wh.T
    return loss, {"Wx": gWx, "Wh": gWh, "b": gb, "Wo": gWo}


class NumpyTrainer:
    """A hand-written SGD step on its own copy of the parameters."""

    def __init__(self, params: dict[str, np.ndarray], grads_fn: Callable[..., Any]) -> None:
        self.P = {k: np.array(v, dtype=DTYPE) for k, v in params.items()}
        self.grads_fn = grads_fn

    def step(self, x: np.ndarray, y: np.ndarray, marks: list[float] | None = None) -> float:
        """One SGD step; ``marks``: if given, ``time.perf_counter()`` is appended to it when the
        forward and the backward end (``grads_fn`` must then take it: :func:`numpy_grads`)."""
        if marks is None:
            loss, G = self.grads_fn(self.P, x, y)
        else:
            loss, G = self.grads_fn(self.P, x, y, marks)
            marks.append(time.perf_counter())
        for k, p in self.P.items():
            p -= LR * G[k]
        return loss


# ---------------------------------------------------------------------------- vgraph steps


class VgraphRebuild:
    """Mode "rebuild": a new UnrolledGraph from the VirtualGraph every step (``cache=False``: mode
    "rebuild-nocache", every build unrolled as a structure never seen before)."""

    def __init__(
        self, g: vg.VirtualGraph, loss: vg.VirtualNode, cache: bool = True, programs: bool | None = None
    ) -> None:
        self.g, self.loss, self.cache, self.programs = g, loss, cache, programs
        self.params = g.params.parameters()
        self.nodes: list[int] = []  # len(cg) of every build

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        cg = self.g.build({"x": x, "y": y}, self.loss, cache=self.cache, programs=self.programs)
        self.nodes.append(len(cg))
        value = cg.backward(cg.outputs[0])
        for p in self.params:
            p.value = p.value - LR * p.grad
        self.g.params.zero_grad()
        return value


class VgraphReuse:
    """Mode "reuse": one UnrolledGraph; each step feeds new data and runs forward again."""

    def __init__(
        self,
        g: vg.VirtualGraph,
        loss: vg.VirtualNode,
        x0: np.ndarray,
        y0: np.ndarray,
        programs: bool | None = None,
    ) -> None:
        self.g = g
        self.cg = g.build({"x": x0, "y": y0}, loss, programs=programs)
        self.loss_node = self.cg.outputs[0]
        self.params = g.params.parameters()

    def step(self, x: np.ndarray, y: np.ndarray, marks: list[float] | None = None) -> float:
        """One step; ``marks``: as for :meth:`NumpyTrainer.step`."""
        cg = self.cg
        cg.feed({"x": x, "y": y})
        cg.forward()
        if marks is not None:
            marks.append(time.perf_counter())
        value = cg.backward(self.loss_node)
        if marks is not None:
            marks.append(time.perf_counter())
        for p in self.params:
            p.value = p.value - LR * p.grad
        self.g.params.zero_grad()
        return value


def vgraph_param_values(g: vg.VirtualGraph) -> dict[str, np.ndarray]:
    return {k: g.params.value(k) for k in PARAM_NAMES}


# ---------------------------------------------------------------------------- correctness


def _compare(what: str, got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    errs = {}
    for k in PARAM_NAMES:
        a, r = np.asarray(got[k]), np.asarray(ref[k])
        if a is None or a.shape != r.shape:
            raise BenchmarkMismatch(
                f"{what}: {k} has shape {None if a is None else a.shape}, reference {r.shape}"
            )
        err = float(np.max(np.abs(a - r))) if a.size else 0.0
        errs[k] = err
        if not np.allclose(a, r, rtol=RTOL, atol=ATOL):
            rel = err / max(float(np.max(np.abs(r))), 1e-30)
            raise BenchmarkMismatch(
                f"{what}: {k} differs from the numpy reference: max |diff| = {err:.3e} "
                f"(max |ref| = {float(np.max(np.abs(r))):.3e}, relative {rel:.3e}; rtol={RTOL}, atol={ATOL})"
            )
    return errs


def _check_loss(what: str, got: float, ref: float) -> None:
    if not np.isclose(got, ref, rtol=RTOL, atol=ATOL):
        raise BenchmarkMismatch(f"{what}: loss {got!r} differs from the numpy reference {ref!r}")


def check_correctness(size: tuple[int, int, int, int], seed: int = 0) -> dict[str, Any]:
    """Gradients and loss of both vgraph modes equal the numpy references (else BenchmarkMismatch).

    Rebuild: build + backward on batch 0. Reuse: the graph built on batch 0, parameters changed by
    an SGD step, batch 1 fed, forward, backward. Both numpy references are checked too.
    """
    I, H, B, T = size
    g, loss = make_model(I, H, B, seed)
    data = make_data(I, B, T, n=2, seed=seed + 99)
    report: dict[str, Any] = {}
    (x0, y0), (x1, y1) = data

    P = vgraph_param_values(g)
    ref_loss, ref = numpy_grads(P, x0, y0)
    pl, pref = numpy_grads_perstep(P, x0, y0)
    _check_loss("numpy per-step reference", pl, ref_loss)
    report["numpy_perstep_max_abs_err"] = _compare("numpy per-step reference", pref, ref)

    cg = g.build({"x": x0, "y": y0}, loss)
    got_loss = cg.backward(cg.outputs[0])
    _check_loss(f"vgraph rebuild {size}", got_loss, ref_loss)
    report["rebuild_max_abs_err"] = _compare(
        f"vgraph rebuild {size}", {k: g.params[k].grad for k in PARAM_NAMES}, ref
    )
    report["loss"] = ref_loss

    # Reuse: same graph, new parameters (one SGD step) and new data.
    for p in g.params.parameters():
        p.value = p.value - LR * p.grad
    g.params.zero_grad()
    P = vgraph_param_values(g)
    ref_loss1, ref1 = numpy_grads(P, x1, y1)
    cg.feed({"x": x1, "y": y1})
    fwd = float(np.reshape(cg.forward(), ()))
    _check_loss(f"vgraph reuse forward {size}", fwd, ref_loss1)
    got_loss1 = cg.backward(cg.outputs[0])
    _check_loss(f"vgraph reuse {size}", got_loss1, ref_loss1)
    report["reuse_max_abs_err"] = _compare(
        f"vgraph reuse {size}", {k: g.params[k].grad for k in PARAM_NAMES}, ref1
    )
    report["reuse_recomputed"] = cg.last_forward.recomputed
    report["reuse_visited"] = cg.last_forward.visited
    report["nodes"] = len(cg)
    return report


# ---------------------------------------------------------------------------- PyTorch eager


class TorchTrainer:
    """The same SGD step in PyTorch eager mode (one thread), on its own copy of the parameters.

    ``kind="loop"``: what a careful user writes by hand, the input projections ``x W_x + b`` of
    all steps as one product, then ``h = tanh(a_t + h W_h)`` in a Python loop over time.
    ``kind="rnn"``: ``torch.nn.RNN(tanh)`` (its ``bias_hh`` held at zero without a gradient:
    vgraph's model has one bias). Both then ``loss = mean((h_T W_o - y)^2)``, ``loss.backward()``
    and ``torch.optim.SGD``.
    """

    def __init__(self, params: dict[str, np.ndarray], kind: str) -> None:
        torch = load_torch()
        if torch is None:
            raise RuntimeError(TORCH_MISSING)
        self.torch, self.kind = torch, kind
        Wh = params["Wh"]
        dt = torch.float64 if Wh.dtype == np.float64 else torch.float32
        self.Wo = torch.nn.Parameter(torch.tensor(params["Wo"], dtype=dt))
        if kind == "loop":
            self.Wx, self.Wh, self.b = (
                torch.nn.Parameter(torch.tensor(params[k], dtype=dt)) for k in ("Wx", "Wh", "b")
            )
            self.tensors = {"Wx": (self.Wx, False), "Wh": (self.Wh, False), "b": (self.b, False)}
        else:
            self.rnn = torch.nn.RNN(params["Wx"].shape[0], Wh.shape[0], nonlinearity="tanh", dtype=dt)
            with torch.no_grad():
                self.rnn.weight_ih_l0.copy_(torch.tensor(params["Wx"].T))
                self.rnn.weight_hh_l0.copy_(torch.tensor(Wh.T))
                self.rnn.bias_ih_l0.copy_(torch.tensor(params["b"]))
                self.rnn.bias_hh_l0.zero_()
            self.rnn.bias_hh_l0.requires_grad_(False)
            self.tensors = {
                "Wx": (self.rnn.weight_ih_l0, True), "Wh": (self.rnn.weight_hh_l0, True), "b": (self.rnn.bias_ih_l0, False),
            }  # fmt: skip
        self.tensors["Wo"] = (self.Wo, False)
        self.opt = torch.optim.SGD([t for t, _ in self.tensors.values()], lr=LR)

    def loss(self, x: np.ndarray, y: np.ndarray) -> Any:
        torch = self.torch
        xt = torch.from_numpy(x)
        if self.kind == "loop":
            T, B, I = x.shape
            a = (xt.reshape(T * B, I) @ self.Wx + self.b).reshape(T, B, -1)
            # unbind, not a[t]: the backward of each a[t] would write a full (T, B, H) zero tensor
            steps = a.unbind(0)
            h = torch.tanh(steps[0])  # h_0 = 0
            for a_t in steps[1:]:
                h = torch.tanh(a_t + h @ self.Wh)
        else:
            _, hn = self.rnn(xt)
            h = hn[0]
        return ((h @ self.Wo - torch.from_numpy(y)) ** 2).mean()

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        loss = self.loss(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.item())

    def _export(self, grads: bool) -> dict[str, np.ndarray]:
        out = {}
        for k, (t, transposed) in self.tensors.items():
            a = (t.grad if grads else t).detach().numpy().copy()
            out[k] = a.T if transposed else a
        return out

    def grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and gradients (parameters untouched)."""
        loss = self.loss(x, y)
        loss.backward()
        grads = self._export(grads=True)
        self.opt.zero_grad(set_to_none=True)
        return float(loss.item()), grads

    @property
    def P(self) -> dict[str, np.ndarray]:
        """The current parameter values, in vgraph's layout."""
        return self._export(grads=False)


TORCH_KINDS = ("loop", "rnn")


def check_torch(size: tuple[int, int, int, int], seed: int = 0, tol: float = 1e-10) -> dict[str, float]:
    """Both PyTorch steps compute the floor's loss and gradients, in float64 to ``tol`` relative
    (else BenchmarkMismatch); returns the largest relative error of each."""
    I, H, B, T = size
    rng = np.random.default_rng(seed + 5)
    g, _ = make_model(I, H, B, seed)
    P = {k: v.astype(np.float64) for k, v in vgraph_param_values(g).items()}
    x, y = rng.standard_normal((T, B, I)), rng.standard_normal((B, OUT))
    ref_loss, ref = numpy_grads(P, x, y)
    ref = {k: np.array(v) for k, v in ref.items()}
    out = {}
    for kind in TORCH_KINDS:
        loss, grads = TorchTrainer(P, kind).grads(x, y)
        errs = [abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)]
        errs += [
            float(np.max(np.abs(grads[k] - ref[k]))) / max(float(np.max(np.abs(ref[k]))), 1e-30)
            for k in PARAM_NAMES
        ]
        if not max(errs) <= tol:
            raise BenchmarkMismatch(
                f"PyTorch {kind} {size}: differs from the numpy floor (relative error {max(errs):.2e})"
            )
        out[kind] = max(errs)
    return out


# ---------------------------------------------------------------------------- timing


class _GcTimer:
    """Wall time spent in the cyclic garbage collector, attributed to the running label."""

    def __init__(self) -> None:
        self.label: str | None = None
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.label is not None:
            self.totals[self.label] = self.totals.get(self.label, 0.0) + time.perf_counter() - self._t0
            if info.get("generation") == 2:
                self.counts[self.label] = self.counts.get(self.label, 0) + 1

    def __enter__(self) -> _GcTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


def _stats(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "q1_ms": q[0],
        "q3_ms": q[2],
        "max_ms": ms[-1],
    }


def time_training(
    size: tuple[int, int, int, int], mode: str, repeats: int, warmup: int, seed: int = 0, torch: bool = False
) -> dict[str, Any]:
    """Interleaved timings of one training step: vgraph (``mode``), the tight floor, per-step numpy
    and, with ``torch``, the two PyTorch eager steps (:class:`TorchTrainer`).

    Modes: "reuse" (one built graph, new data fed), "rebuild" (a build per step, always length T),
    "rebuild-new" (a build per step, the length changing every step within T ± 10%, see
    :func:`length_schedule`), "rebuild-nocache" (the lengths of "rebuild-new", each build with
    ``cache=False``: unrolled as a structure never seen before).
    """
    I, H, B, T = size
    g, loss = make_model(I, H, B, seed)
    varying = mode in ("rebuild-new", "rebuild-nocache", "per-node-nocache")
    lengths = length_schedule(T, warmup + repeats) if varying else [T] * (warmup + repeats)
    data = make_data(I, B, max(lengths), seed=seed + 7)
    P0 = vgraph_param_values(g)
    runners: dict[str, Any] = {
        "vgraph": VgraphReuse(g, loss, *data[0])
        if mode == "reuse"
        else VgraphRebuild(
            g,
            loss,
            cache=not mode.endswith("nocache"),
            programs=False if mode.startswith("per-node") else None,
        ),
        "numpy": NumpyTrainer(P0, numpy_grads),
        "numpy_perstep": NumpyTrainer(P0, numpy_grads_perstep),
    }
    if torch:
        runners.update({f"torch_{kind}": TorchTrainer(P0, kind) for kind in TORCH_KINDS})
    names = list(runners)
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu_times: dict[str, list[float]] = {k: [] for k in names}  # thread CPU time: robust to other load
    losses: dict[str, list[float]] = {k: [] for k in names}
    gc.collect()
    with _GcTimer() as gct:
        for i in range(warmup + repeats):
            x, y = data[i % len(data)]
            x = x[: lengths[i]]
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                gct.label = name
                c0 = time.thread_time()
                t0 = time.perf_counter()
                value = runners[name].step(x, y)
                dt = time.perf_counter() - t0
                dc = time.thread_time() - c0
                gct.label = None
                losses[name].append(value)
                if i >= warmup:
                    times[name].append(dt)
                    cpu_times[name].append(dc)
    # Same batches, same updates: the three copies of the parameters must still agree.
    final_vg = vgraph_param_values(g)
    _compare(f"parameters after {warmup + repeats} steps, vgraph {mode} {size}", final_vg, runners["numpy"].P)
    _compare(
        f"parameters after {warmup + repeats} steps, numpy per-step {size}",
        runners["numpy_perstep"].P,
        runners["numpy"].P,
    )
    for name in names:
        if name.startswith("torch"):
            _compare(
                f"parameters after {warmup + repeats} steps, {name} {size}",
                runners[name].P,
                runners["numpy"].P,
            )
    for a, b in zip(losses["vgraph"], losses["numpy"]):
        _check_loss(f"loss during timing, vgraph {mode} {size}", a, b)
    res: dict[str, Any] = {"size": list(size), "mode": mode, "repeats": repeats, "warmup": warmup}
    if varying:
        res["lengths"] = lengths
    for name in names:
        res[name] = _stats(times[name])
        res[name]["times_ms"] = [t * 1e3 for t in times[name]]
        res[name]["cpu_median_ms"] = statistics.median(cpu_times[name]) * 1e3
        res[name]["gc_ms_per_step"] = gct.totals.get(name, 0.0) * 1e3 / (warmup + repeats)
        res[name]["gc_gen2_collections"] = gct.counts.get(name, 0)
    res["ratio"] = res["vgraph"]["median_ms"] / res["numpy"]["median_ms"]
    res["ratio_vs_perstep"] = res["vgraph"]["median_ms"] / res["numpy_perstep"]["median_ms"]
    res["floor_vs_perstep"] = res["numpy"]["median_ms"] / res["numpy_perstep"]["median_ms"]
    # Cross-check robust to load drifting during the run: the median of the ratios of runs made
    # back to back (same repeat). The targets use "ratio" (ratio of the medians).
    res["ratio_paired"] = statistics.median(v / n for v, n in zip(times["vgraph"], times["numpy"]))
    # And in thread CPU time (time.thread_time), which excludes time the process was not running.
    res["ratio_cpu"] = res["vgraph"]["cpu_median_ms"] / res["numpy"]["cpu_median_ms"]
    for kind in TORCH_KINDS:  # vgraph over PyTorch eager: < 1 means vgraph is faster
        if f"torch_{kind}" in res:
            ref = res[f"torch_{kind}"]
            res[f"ratio_vs_torch_{kind}"] = res["vgraph"]["median_ms"] / ref["median_ms"]
            res[f"ratio_vs_torch_{kind}_cpu"] = res["vgraph"]["cpu_median_ms"] / ref["cpu_median_ms"]
    res["target"] = TARGETS.get(mode, {}).get(tuple(size))
    res["pass"] = None if res["target"] is None else bool(res["ratio"] <= res["target"])
    vg_runner = runners["vgraph"]
    res["nodes"] = len(vg_runner.cg) if mode == "reuse" else int(statistics.median(vg_runner.nodes))
    res["vgraph_us_per_node"] = res["vgraph"]["median_ms"] * 1e3 / res["nodes"]
    return res


# ---------------------------------------------------------------------------- extras


def bench_unroll(
    steps: int = 10_000, repeats: int = 3, size: tuple[int, int, int] = (8, 32, 1)
) -> dict[str, Any]:
    """Unrolling throughput: len(cg) / build time for a ``steps``-step loop (forward included)."""
    I, H, B = size
    g, loss = make_model(I, H, B)
    x, y = make_data(I, B, steps, n=1)[0]
    g.build({"x": x[:10], "y": y}, loss)  # warm-up
    times, cpu, n = [], [], 0
    for _ in range(repeats):
        g.latest_build = None  # earlier graphs are not this build's garbage to collect
        gc.collect()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        # unrolling node by node (nodes a second), not a cached replay nor a body program
        cg = g.build({"x": x, "y": y}, loss, cache=False, programs=False)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        n = len(cg)
        del cg
    t = statistics.median(times)
    return {
        "steps": steps, "size": [I, H, B], "nodes": n, "build_ms": t * 1e3, "build_ms_all": [s * 1e3 for s in times],
        "nodes_per_s": n / t, "nodes_per_s_cpu": n / statistics.median(cpu), "us_per_node": t / n * 1e6, "target_nodes_per_s": UNROLL_TARGET_NODES_PER_S,
        "pass": bool(n / t >= UNROLL_TARGET_NODES_PER_S),
    }  # fmt: skip


def make_paths_model(n_paths: int = 100, B: int = 16, D: int = 32) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """``n_paths`` independent paths ``sum(tanh(tanh(x_i W1 + b1) W2))``, stacked and summed."""
    g = vg.VirtualGraph(dtype=DTYPE, seed=3)
    W1 = g.parameter("W1", (D, D))
    b1 = g.parameter("b1", (D,), init="normal")
    W2 = g.parameter("W2", (D, D))
    parts = []
    for i in range(n_paths):
        xi = g.input(f"x{i}", shape=(B, D))
        parts.append(vg.tanh(vg.tanh(xi @ W1 + b1) @ W2).sum())
    return g, vg.stack(parts).sum()


def bench_incremental(n_paths: int = 100, repeats: int = 50, B: int = 16, D: int = 32) -> dict[str, Any]:
    """Re-forward after changing 1 of ``n_paths`` inputs vs after changing all of them."""
    g, total = make_paths_model(n_paths, B, D)
    rng = np.random.default_rng(5)
    feed = {f"x{i}": rng.standard_normal((B, D)).astype(DTYPE) for i in range(n_paths)}
    cg = g.build(feed, total)
    alt = {k: rng.standard_normal((B, D)).astype(DTYPE) for k in feed}
    one = f"x{n_paths // 2}"

    def run(new: dict[str, np.ndarray]) -> tuple[float, Any]:
        cg.feed(new)  # outside the timed region: only the forward is compared
        t0 = time.perf_counter()
        cg.forward()
        return time.perf_counter() - t0, cg.last_forward

    t_one, t_all, t_none = [], [], []
    rep_one = rep_all = rep_none = None
    for i in range(repeats + 2):
        src = alt if i % 2 else feed
        dt1, rep_one = run({one: src[one]})
        dta, rep_all = run(src)
        t0 = time.perf_counter()
        cg.forward()  # nothing changed
        dtn = time.perf_counter() - t0
        rep_none = cg.last_forward
        if i >= 2:
            t_one.append(dt1)
            t_all.append(dta)
            t_none.append(dtn)
    # The incremental result must equal a full recomputation.
    cg.feed({one: feed[one]})
    inc = float(cg.forward())
    full = float(
        g.build({**(alt if (repeats + 1) % 2 else feed), one: feed[one]}, total, cache=False).outputs[0].value
    )
    if not np.isclose(inc, full, rtol=RTOL, atol=ATOL):
        raise BenchmarkMismatch(f"incremental forward gave {inc}, a fresh build {full}")
    m1, ma, mn = (statistics.median(t) * 1e3 for t in (t_one, t_all, t_none))
    return {
        "paths": n_paths, "batch": B, "width": D, "nodes": len(cg),
        "one_changed_ms": m1, "all_changed_ms": ma, "none_changed_ms": mn, "speedup": ma / m1,
        "one_changed": {"visited": rep_one.visited, "recomputed": rep_one.recomputed},
        "all_changed": {"visited": rep_all.visited, "recomputed": rep_all.recomputed},
        "none_changed": {"visited": rep_none.visited, "recomputed": rep_none.recomputed},
    }  # fmt: skip


def _graph_value_bytes(cg: Any, extra: list[Any]) -> int:
    """Bytes of the distinct memory blocks behind the nodes' values: a view (``x[t]`` of an
    input, a read-only view handed out by ``.value``, an identity op's result) counts once, as the
    array that owns the memory. Nodes computed when read keep no value: they count nothing."""
    roots: dict[int, np.ndarray] = {}
    for n in [*cg.nodes(), *extra]:
        if n.graph is cg and cg.computed_when_read(n):
            continue
        a = np.asarray(n.value)
        while isinstance(a.base, np.ndarray):
            a = a.base
        roots[id(a)] = a  # the owner stays alive (a node holds it), so ids cannot be reused here
    return sum(a.nbytes for a in roots.values())


def bench_memory(size: tuple[int, int, int, int] = (8, 32, 1, 1000)) -> dict[str, Any]:
    """Peak traced memory of one build + backward vs the bytes of the values the graph keeps.

    Tracing starts before the feed arrays are copied (so they count on both sides); parameters
    exist before tracing and are added to the peak explicitly. ``kept`` is the sum of nbytes over
    the distinct value arrays of all graph nodes (inputs, constants, parameters, op results).
    """
    I, H, B, T = size
    g, loss = make_model(I, H, B)
    x, y = make_data(I, B, T, n=1)[0]
    g.build({"x": x[:5], "y": y}, loss).backward(g.latest_build.outputs[0])  # warm-up (imports, caches)
    g.params.zero_grad()
    g.latest_build = None
    params = g.params.parameters()
    param_bytes = sum(p.value.nbytes for p in params)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        xf, yf = x.copy(), y.copy()
        cg = g.build({"x": xf, "y": yf}, loss, cache=False, programs=False)  # (values per node)
        after_build = tracemalloc.get_traced_memory()[0] - base
        cg.backward(cg.outputs[0])
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = _graph_value_bytes(cg, params)
    grad_bytes = sum(p.grad.nbytes for p in params)
    peak_total = peak - base + param_bytes
    # The numpy reference, for comparison (same accounting: feed copies inside, params outside).
    P = vgraph_param_values(g)
    _WORKSPACE.clear()  # the floor's buffers count in its peak
    gc.collect()
    tracemalloc.start()
    try:
        base_np = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        xf2, yf2 = x.copy(), y.copy()
        numpy_grads(P, xf2, yf2)
        peak_np = tracemalloc.get_traced_memory()[1] - base_np + param_bytes
    finally:
        tracemalloc.stop()
    return {
        "size": list(size), "nodes": len(cg), "kept_value_bytes": kept, "param_bytes": param_bytes,
        "grad_bytes": grad_bytes, "peak_bytes": peak_total, "after_build_bytes": after_build + param_bytes,
        "retained_after_backward_bytes": current - base + param_bytes,
        "ratio": peak_total / kept, "bytes_per_node_overhead": (peak_total - kept) / len(cg),
        "numpy_peak_bytes": peak_np, "target_ratio": MEMORY_TARGET_RATIO,
        "pass": bool(peak_total / kept <= MEMORY_TARGET_RATIO),
    }  # fmt: skip


def make_stepped_model(I: int, H: int, B: int) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """§2 (a): a loop stepping through a sequence that needs a gradient, ``loop.step(x @ W_x)``."""
    g = vg.VirtualGraph(dtype=DTYPE, seed=0, name="stepped")
    x = g.input("x", shape=(None, B, I))
    Wx = g.parameter("Wx", (I, H))
    Wh = g.parameter("Wh", (H, H), init="orthogonal")
    h0 = g.constant(np.zeros((B, H), dtype=DTYPE), name="h0")
    xW = x @ Wx  # (T, B, H), declared outside the loop (a stepped sequence must be)
    with g.loop(name="time") as L:
        xw = L.step(xW, name="xW_t")
        h = L.carry(h0, name="h")
        L.update(h, vg.tanh(xw + h @ Wh))
    return g, (L.final(h) ** 2).mean()


def make_nd_matmul_model(H: int, V: int, B: int) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """§2 (b): an N-D @ 2-D product, ``nn.Linear`` on a ``(T, B, H)`` stack."""
    g = vg.VirtualGraph(dtype=DTYPE, seed=0, name="nd_matmul")
    x = g.input("x", shape=(None, B, H))
    out = vg.nn.Linear(g, H, V, "out")
    return g, (out(x) ** 2).mean()


#: §2 cases: the model, the input's (B, width), and T (measured at T and 2T; smaller when quick).
LINEARITY_CASES: dict[str, dict[str, Any]] = {
    "stepped sequence with gradient: loop.step(x @ W_x)": {
        "make": lambda: make_stepped_model(8, 32, 16), "input": (16, 8),
        "sizes": {"I": 8, "H": 32, "B": 16}, "T": 1000, "T_quick": 40,
    },
    "N-D @ 2-D product: nn.Linear(H, V) on (T, B, H)": {
        "make": lambda: make_nd_matmul_model(64, 1000, 1), "input": (1, 64),
        "sizes": {"H": 64, "V": 1000, "B": 1}, "T": 200, "T_quick": 20,
    },
}  # fmt: skip


def _backward_cost(g: vg.VirtualGraph, loss: vg.VirtualNode, x: np.ndarray, repeats: int) -> dict[str, float]:
    """Median wall time of ``cg.backward`` (a fresh build each repeat, not timed), its peak traced
    memory above what the built graph already holds, and the bytes of the graph's values."""
    times = []
    for _ in range(repeats):
        cg = g.build({"x": x}, loss)
        gc.collect()
        t0 = time.perf_counter()
        cg.backward(cg.outputs[0])
        times.append(time.perf_counter() - t0)
        g.params.zero_grad()
        del cg
    cg = g.build({"x": x}, loss)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cg.backward(cg.outputs[0])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    kept = _graph_value_bytes(cg, g.params.parameters())
    g.params.zero_grad()
    return {
        "backward_ms": statistics.median(times) * 1e3,
        "peak_bytes": float(peak),
        "kept_bytes": float(kept),
    }


def bench_linearity(quick: bool = False, repeats: int = 5) -> dict[str, Any]:
    """Issue 10 §2: backward time and peak memory at T and 2T for each trap; ratios near 2 are
    linear, near 4 quadratic. Memory is the backward's peak above the built graph (tracemalloc)."""
    rows = []
    for name, case in LINEARITY_CASES.items():
        T = case["T_quick"] if quick else case["T"]
        g, loss = case["make"]()
        rng = np.random.default_rng(11)
        x2 = rng.standard_normal((2 * T, *case["input"])).astype(DTYPE)
        warm = g.build({"x": x2[:3]}, loss)  # warm-up
        warm.backward(warm.outputs[0])
        del warm
        g.params.zero_grad()
        at = {t: _backward_cost(g, loss, x2[:t], repeats) for t in (T, 2 * T)}
        rows.append({
            "case": name, "sizes": case["sizes"], "T": T,
            "backward_ms": [at[T]["backward_ms"], at[2 * T]["backward_ms"]],
            "peak_bytes": [at[T]["peak_bytes"], at[2 * T]["peak_bytes"]],
            "kept_value_bytes": [at[T]["kept_bytes"], at[2 * T]["kept_bytes"]],
            "peak_over_values": at[2 * T]["peak_bytes"] / at[2 * T]["kept_bytes"],
            "time_ratio": at[2 * T]["backward_ms"] / at[T]["backward_ms"],
            "memory_ratio": at[2 * T]["peak_bytes"] / max(at[T]["peak_bytes"], 1.0),
        })  # fmt: skip
    return {"rows": rows, "repeats": repeats, "informational": True}


# ---------------------------------------------------------------------------- reporting


def machine_info() -> dict[str, Any]:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = None
    try:
        cfg = np.show_config(mode="dicts")
        b = cfg.get("Build Dependencies", {}).get("blas", {})
        blas = f"{b.get('name')} {b.get('version')}"
    except Exception:
        pass
    commit = dirty = None
    try:
        root = Path(__file__).resolve().parents[1]
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "vgraph"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        )
    except Exception:
        pass
    src_hash = None
    try:  # which engine sources were measured (the working tree may differ from the commit)
        import hashlib

        h = hashlib.sha256()
        for f in sorted(Path(vg.__file__).parent.rglob("*.py")):
            h.update(str(f.relative_to(Path(vg.__file__).parent)).encode() + b"\0" + f.read_bytes())
        src_hash = h.hexdigest()[:16]
    except OSError:
        pass
    threads = {
        k: os.environ[k]
        for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
        if k in os.environ
    }
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "platform": platform.platform(), "machine": platform.machine(), "processor": cpu,
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "python_impl": platform.python_implementation(),
        "numpy": np.__version__, "blas": blas, "thread_env": threads, "loadavg_at_start": load, "vgraph": getattr(vg, "__version__", None),
        "git_commit": commit, "vgraph_dirty": dirty, "vgraph_path": str(Path(vg.__file__).parent),
        "vgraph_sources_sha256": src_hash,
    }  # fmt: skip


def _fmt_size(size: Any) -> str:
    return "(" + ",".join(map(str, size)) + ")"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'size (I,H,B,T)':<18} {'mode':<15} {'nodes':>6} {'vgraph ms':>10} {'floor ms':>9} {'ratio':>6} "
        f"{'target':>7} {'':<4}  {'paired':>6} {'cpu':>5}  {'per-step ms':>11} {'ratio':>6}  {'vg us/node':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        status = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        target = "" if r["target"] is None else f"<={r['target']:.2f}"
        print(
            f"{_fmt_size(r['size']):<18} {r['mode']:<15} {r['nodes']:>6} {r['vgraph']['median_ms']:>10.2f} "
            f"{r['numpy']['median_ms']:>9.2f} {r['ratio']:>6.2f} {target:>7} {status:<4}  {r['ratio_paired']:>6.2f} {r['ratio_cpu']:>5.2f}  "
            f"{r['numpy_perstep']['median_ms']:>11.2f} {r['ratio_vs_perstep']:>6.2f}  {r['vgraph_us_per_node']:>10.1f}"
        )
    torch_rows = [r for r in rows if "torch_loop" in r]
    if torch_rows:
        print(
            "\nPyTorch eager (1 thread): 'vs' is vgraph ms / PyTorch ms (medians; < 1: vgraph faster), 'cpu' in thread CPU time"
        )
        head = f"{'size (I,H,B,T)':<18} {'mode':<15} {'vgraph ms':>10} {'loop ms':>8} {'vs':>5} {'cpu':>5}  {'nn.RNN ms':>9} {'vs':>5} {'cpu':>5}"
        print(head)
        print("-" * len(head))
        for r in torch_rows:
            print(
                f"{_fmt_size(r['size']):<18} {r['mode']:<15} {r['vgraph']['median_ms']:>10.2f} "
                f"{r['torch_loop']['median_ms']:>8.2f} {r['ratio_vs_torch_loop']:>5.2f} {r['ratio_vs_torch_loop_cpu']:>5.2f}  "
                f"{r['torch_rnn']['median_ms']:>9.2f} {r['ratio_vs_torch_rnn']:>5.2f} {r['ratio_vs_torch_rnn_cpu']:>5.2f}"
            )


def print_extras(extras: dict[str, Any]) -> None:
    u = extras.get("unroll")
    if u:
        status = "PASS" if u["pass"] else "FAIL"
        print(
            f"\nunrolling: {u['steps']}-step loop {tuple(u['size'])}: {u['nodes']} nodes in {u['build_ms']:.1f} ms "
            f"= {u['nodes_per_s']:,.0f} nodes/s ({u['us_per_node']:.1f} us/node; "
            f"{u['nodes_per_s_cpu']:,.0f} nodes/s in CPU time); target >= "
            f"{u['target_nodes_per_s']:,.0f}  {status}"
        )
    inc = extras.get("incremental")
    if inc:
        o, a, n = inc["one_changed"], inc["all_changed"], inc["none_changed"]
        print(
            f"incremental forward ({inc['paths']} paths, {inc['nodes']} nodes): 1 input changed "
            f"{inc['one_changed_ms']:.3f} ms (recomputed {o['recomputed']} of {o['visited']}), all changed "
            f"{inc['all_changed_ms']:.3f} ms (recomputed {a['recomputed']} of {a['visited']}), none changed "
            f"{inc['none_changed_ms']:.3f} ms (recomputed {n['recomputed']}); speed-up {inc['speedup']:.1f}x"
        )
    lin = extras.get("linearity")
    if lin:
        print("\nlinearity of backward (time and peak memory at T and 2T; ~2x linear, ~4x quadratic):")
        for r in lin["rows"]:
            t1, t2 = r["backward_ms"]
            m1, m2 = (b / 2**20 for b in r["peak_bytes"])
            print(
                f"  {r['case']:<52} T={r['T']:<5} {t1:8.2f} ms {m1:8.2f} MiB | 2T: {t2:8.2f} ms {m2:8.2f} MiB"
                f" | x{r['time_ratio']:.2f} time, x{r['memory_ratio']:.2f} memory;"
                f" peak {r['peak_over_values']:.1f}x the graph's values at 2T"
            )
    for key in ("memory", "memory_large"):
        m = extras.get(key)
        if not m:
            continue
        status = "(info)" if m.get("informational") else ("PASS" if m["pass"] else "FAIL")
        print(
            f"memory: build+backward {_fmt_size(m['size'])}, {m['nodes']} nodes: peak {m['peak_bytes'] / 2**20:.2f} MiB vs "
            f"kept values {m['kept_value_bytes'] / 2**20:.2f} MiB = {m['ratio']:.2f}x "
            f"({m['bytes_per_node_overhead']:.0f} B/node above the values); numpy reference peak "
            f"{m['numpy_peak_bytes'] / 2**20:.2f} MiB; target <= {m['target_ratio']}x  {status}"
        )


def _parse_size(text: str) -> tuple[int, int, int, int]:
    parts = tuple(int(p) for p in text.replace("(", "").replace(")", "").split(","))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"a size is I,H,B,T (four ints), got {text!r}")
    return parts  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny repeats, small extras")
    ap.add_argument("--json", metavar="PATH", help="write all numbers and machine info as JSON")
    ap.add_argument(
        "--repeats",
        type=int,
        help=f"timed repeats per size and mode (default {REPEATS}, quick {QUICK_REPEATS})",
    )
    ap.add_argument(
        "--warmup", type=int, help=f"untimed warm-up steps (default {WARMUP}, quick {QUICK_WARMUP})"
    )
    ap.add_argument(
        "--sizes", type=_parse_size, nargs="+", metavar="I,H,B,T", help="sizes to run (default: all four)"
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--no-extras", action="store_true", help="skip unrolling, incremental and memory measurements"
    )
    ap.add_argument("--strict", action="store_true", help="exit with status 1 if any target fails")
    ap.add_argument("--no-torch", action="store_true", help="leave out the PyTorch eager columns")
    ap.add_argument(
        "--no-tapes",
        action="store_true",
        help="interpret every sweep (vgraph.tape.set_tapes(False)): what compiled sweeps gain",
    )
    ap.add_argument(
        "--blas-threads", metavar="N",
        help="BLAS threads (default 1, or OPENBLAS_NUM_THREADS/OMP_NUM_THREADS if set); read before numpy is imported",
    )  # fmt: skip
    args = ap.parse_args(argv)

    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if args.quick else REPEATS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    if repeats < 1 or warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if not args.quick and repeats < 20:
        print(f"note: {repeats} repeats (the benchmark's standard is at least 20)", file=sys.stderr)
    sizes = args.sizes or SIZES
    vg.tape.set_tapes(not args.no_tapes)
    info = machine_info()
    started = _dt.datetime.now(_dt.timezone.utc)
    print(
        f"vgraph RNN benchmark  {started:%Y-%m-%d %H:%M UTC}  python {info['python']}  numpy {info['numpy']}  "
        f"{info['cpu_count']} CPUs ({info['processor']})  BLAS threads "
        f"{info['thread_env'].get('OPENBLAS_NUM_THREADS', 'default')}  repeats {repeats} (+{warmup} warm-up)"
        f"{'  tapes off' if args.no_tapes else ''}\n"
    )

    torch = load_torch(not args.no_torch)
    if torch is None:
        print(TORCH_MISSING if not args.no_torch else "PyTorch columns skipped: --no-torch")
    else:
        print(f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} thread(s)")
        info["torch"], info["torch_threads"] = torch.__version__, torch.get_num_threads()
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = list(os.getloadavg())
    try:
        checks = {_fmt_size(s): check_correctness(s) for s in sizes}
        print(
            f"correctness: gradients and loss match the numpy reference for {len(checks)} size(s), both modes"
        )
        if torch is not None:
            for s in sizes:
                checks[_fmt_size(s)]["torch_max_rel_err"] = check_torch(s)
            worst = max(max(c["torch_max_rel_err"].values()) for c in checks.values())
            print(
                f"correctness: PyTorch loop and nn.RNN = the numpy floor (float64 loss and gradients, max relative "
                f"error {worst:.1e})"
            )
        print()
        rows = []
        for s in sizes:
            for mode in args.modes:
                rows.append(time_training(s, mode, repeats, warmup, torch=torch is not None))
                print(f"  measured {_fmt_size(s)} {mode}", file=sys.stderr)
        print()
        print_table(rows)
        extras: dict[str, Any] = {}
        if not args.no_extras:
            extras["unroll"] = bench_unroll(
                steps=2_000 if args.quick else 10_000, repeats=1 if args.quick else 3
            )
            extras["incremental"] = bench_incremental(repeats=5 if args.quick else 50)
            extras["linearity"] = bench_linearity(quick=args.quick, repeats=1 if args.quick else 5)
            extras["memory"] = bench_memory()
            if not args.quick:  # the same step with 16 KiB values instead of 128 B (information only)
                extras["memory_large"] = {**bench_memory((32, 128, 32, 1000)), "informational": True}
            print_extras(extras)
    except BenchmarkMismatch as e:
        print(f"\nBENCHMARK ABORTED: vgraph and the numpy reference disagree\n  {e}", file=sys.stderr)
        return 2

    results = {
        "benchmark": "vgraph Elman RNN training step vs hand-written numpy BPTT",
        "date": started.isoformat(timespec="seconds"),
        "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
        "machine": info,
        "config": {
            "dtype": np.dtype(DTYPE).name,
            "lr": LR,
            "out": OUT,
            "repeats": repeats,
            "warmup": warmup,
            "quick": args.quick,
            "rtol": RTOL,
            "atol": ATOL,
            "sizes": [list(s) for s in sizes],
            "modes": args.modes,
            "statistic": "median of interleaved repeats (time.perf_counter)",
            "tapes": not args.no_tapes,
        },
        "correctness": checks,
        "training": rows,
        "extras": extras,
    }
    failed = [r for r in rows if r["pass"] is False]
    failed += [k for k, v in extras.items() if v.get("pass") is False and not v.get("informational")]
    results["all_pass"] = not failed
    with contextlib.suppress(OSError):
        results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    print(f"\n{'all targets met' if not failed else f'{len(failed)} target(s) not met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {args.json}")
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
