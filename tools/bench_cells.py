#!/usr/bin/env python3
"""Benchmark: fused recurrent cells (one ``LSTMCell``/``GRUCell`` node per step) vs the same cells
declared gate by gate (``fused=False``).

Model (float32): ``nn.LSTMCell`` or ``nn.GRUCell`` over a ``(T, B, I)`` sequence, the loss is the
mean of ``sum(h_t * r_t)`` over every step (a fixed random ``r``), so every step's h gets a
gradient. One training step is timed:

* ``rebuild``: ``g.build(feed, loss)`` (unroll + forward) + ``backward``;
* ``reuse``: the graph is built once; each step ``cg.feed(...)`` + ``forward`` + ``backward``.

Fused and unfused run in the same process, interleaved (the order alternates every repeat), on
the same weights and data. Before timing, the loss and every parameter gradient of the two are
checked equal (float32: rtol 1e-4); a mismatch aborts with exit status 2. Reported: median ms per
step of each, the ratio unfused / fused (the speed-up), and the nodes per step of each.

BLAS runs single-threaded (OPENBLAS_NUM_THREADS=1 unless set), as in tools/bench_rnn.py.

Usage::

    PYTHONPATH=. python3 tools/bench_cells.py [--quick] [--repeats N] [--sizes I,H,B,T ...]
                                              [--cells lstm gru] [--modes rebuild reuse]
    PYTHONPATH=. python3 tools/bench_cells.py --micro   # op level: stored vs recomputed gates
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np

try:
    import vgraph as vg
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vgraph as vg
from vgraph import nn

SIZES = [(8, 32, 16, 50), (32, 128, 32, 50), (64, 256, 64, 100), (8, 32, 1, 1000)]
QUICK_SIZES = [(8, 32, 16, 20)]


def make_model(kind: str, fused: bool, I: int, H: int, B: int, T: int, seed: int = 0):
    """A VirtualGraph running ``kind`` over a sequence; returns (graph, loss node, feed)."""
    g = vg.VirtualGraph(dtype=np.float32, seed=seed)
    xs = g.input("xs", (None, None, I))
    h0 = g.constant(np.zeros((B, H), dtype=np.float32))
    r = g.constant(np.random.default_rng(seed + 1).standard_normal((T, B, H)).astype(np.float32) / (T * B))
    cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}[kind](g, I, H, kind, fused=fused)
    with g.loop() as L:
        x_t = L.step(xs)
        h = L.carry(h0, name="h")
        if kind == "lstm":
            c = L.carry(h0, name="c")
            hn, cn = cell(x_t, (h, c))
            L.update(c, cn)
        else:
            hn = cell(x_t, h)
        L.update(h, hn)
    loss = (L.stack(hn) * r).sum()
    feed = {"xs": np.random.default_rng(seed + 2).standard_normal((T, B, I)).astype(np.float32)}
    return g, loss, feed


class Runner:
    """One model and its timed training step."""

    def __init__(self, kind: str, fused: bool, size: tuple[int, int, int, int], mode: str) -> None:
        self.g, self.loss, self.feed = make_model(kind, fused, *size)
        self.mode = mode
        self.cg = self.g.build(self.feed, self.loss)
        T = size[3]
        loop_nodes = sum(1 for n in self.cg.nodes() if n.key.idx)
        self.nodes_per_step = loop_nodes / T

    def step(self) -> float:
        self.g.params.zero_grad()
        if self.mode == "rebuild":
            self.cg = None  # release the previous build first, as training code does
            self.cg = self.g.build(self.feed, self.loss)
        else:
            self.cg.feed(self.feed)
            self.cg.forward()
        return self.cg.backward(self.loss)

    def grads(self) -> dict[str, np.ndarray]:
        return {k: np.array(p.grad) for k, p in self.g.params.items()}


def check_equal(kind: str, size: tuple[int, int, int, int]) -> None:
    runs = {f: Runner(kind, f, size, "rebuild") for f in (True, False)}
    losses = {f: r.step() for f, r in runs.items()}
    grads = {f: r.grads() for f, r in runs.items()}
    ok = np.isclose(losses[True], losses[False], rtol=1e-4)
    for k in grads[True]:
        ok = ok and np.allclose(grads[True][k], grads[False][k], rtol=1e-4, atol=1e-6)
    if not ok:
        print(f"MISMATCH between fused and unfused {kind} at {size}", file=sys.stderr)
        sys.exit(2)


def time_pair(
    kind: str, size: tuple[int, int, int, int], mode: str, repeats: int, warmup: int
) -> dict[str, Any]:
    runs = {f: Runner(kind, f, size, mode) for f in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(warmup + repeats):
        order = (True, False) if rep % 2 == 0 else (False, True)
        for f in order:
            t0 = time.perf_counter()
            runs[f].step()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[f].append(dt)
    fused_ms = statistics.median(times[True]) * 1e3
    unfused_ms = statistics.median(times[False]) * 1e3
    return {
        "fused_ms": fused_ms,
        "unfused_ms": unfused_ms,
        "speedup": unfused_ms / fused_ms,
        "paired": statistics.median(u / f for f, u in zip(times[True], times[False])),
        "fused_nodes_per_step": runs[True].nodes_per_step,
        "unfused_nodes_per_step": runs[False].nodes_per_step,
    }


def micro(B: int, H: int, repeats: int = 30, number: int = 20) -> dict[str, float]:
    """Op-level µs of the fused LSTM cell (float32): its forward, its joint VJP (which reads the
    stored activations), and the VJP of a design that would store only h', c' and recompute the
    activations in the backward (forward + VJP: that design's forward is not cheaper, it computes
    the same activations and drops them)."""
    import timeit

    from vgraph import ops

    r = np.random.default_rng(0)
    xw, hw = (r.standard_normal((B, 4 * H)).astype(np.float32) for _ in range(2))
    b, c = r.standard_normal(4 * H).astype(np.float32), r.standard_normal((B, H)).astype(np.float32)
    s = ops._lstm_cell(xw, hw, b, c)
    gs = np.zeros_like(s)
    gs[:2] = r.standard_normal((2, B, H))

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6

    fwd = best(lambda: ops._lstm_cell(xw, hw, b, c))
    vjp = best(lambda: ops._lstm_cell_grads(gs, s, xw, hw, b, c))
    recompute = best(lambda: ops._lstm_cell_grads(gs, ops._lstm_cell(xw, hw, b, c), xw, hw, b, c))
    return {"forward_us": fwd, "vjp_stored_us": vjp, "vjp_recompute_us": recompute}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small size, few repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sizes", nargs="+", default=None, help="I,H,B,T ...")
    ap.add_argument("--cells", nargs="+", default=["lstm", "gru"], choices=["lstm", "gru"])
    ap.add_argument("--modes", nargs="+", default=["rebuild", "reuse"], choices=["rebuild", "reuse"])
    ap.add_argument("--micro", action="store_true", help="only the op-level store-vs-recompute timing")
    args = ap.parse_args(argv)
    if args.micro:
        print(f"{'B,H':>8} {'forward us':>11} {'VJP (stored) us':>16} {'VJP (recompute) us':>19}")
        out = []
        for B, H in [(16, 32), (32, 128), (64, 256)]:
            m = micro(B, H)
            out.append(m)
            print(
                f"{B:>4},{H:<4} {m['forward_us']:11.1f} {m['vjp_stored_us']:16.1f} {m['vjp_recompute_us']:19.1f}"
            )
        return out
    if args.sizes:
        sizes = [tuple(int(v) for v in s.split(",")) for s in args.sizes]
    else:
        sizes = QUICK_SIZES if args.quick else SIZES
    repeats = args.repeats or (3 if args.quick else 15)
    rows = []
    print(f"{'cell':5} {'I,H,B,T':>16} {'mode':8} {'fused ms':>9} {'unfused ms':>10} {'speed-up':>8} "
          f"{'paired':>7} {'nodes/step':>11}")  # fmt: skip
    for kind in args.cells:
        for size in sizes:
            check_equal(kind, size)
            for mode in args.modes:
                r = time_pair(kind, size, mode, repeats, args.warmup)
                r.update(cell=kind, size=size, mode=mode)
                rows.append(r)
                print(
                    f"{kind:5} {','.join(map(str, size)):>16} {mode:8} {r['fused_ms']:9.2f} "
                    f"{r['unfused_ms']:10.2f} {r['speedup']:7.2f}x {r['paired']:6.2f}x "
                    f"{r['fused_nodes_per_step']:5.1f}/{r['unfused_nodes_per_step']:<5.1f}",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
