#!/usr/bin/env python3
"""Benchmark: the cost of a Hessian-vector product of an RNN loss against one gradient.

Model (float64 by default)::

    h_0 = 0,  h_t = tanh(x_t W_x + h_{t-1} W_h + b)   t = 1..T
    loss = mean((h_T W_o - y)^2)

built with ``g.build(feed, loss, programs=False)`` (second order needs the node-by-node unroll).
Measured, medians over the repeats (the data change every repeat):

- ``build``: ``g.build`` (unroll and forward);
- ``gradient``: ``cg.backward(loss)`` on the built graph (the first-order sweep);
- ``record``: ``vg.hvp_operator(loss, params)``: the gradient recorded as graph nodes with its
  inner product with ``v`` (once per graph);
- ``product``: one call of that operator, ``H v``: one ordinary backward from the recorded
  gradient, seeded with ``v``, through the recorded nodes and the model — what conjugate gradient
  repeats;
- ``hvp``: ``vg.hvp(loss, params, v)`` (record + product) on a fresh build.

Ratios: ``product / gradient`` (the repeated cost in a truncated-Newton step), ``hvp / gradient``
and ``(build + hvp) / (build + gradient)`` (one product from scratch against one gradient from
scratch). Before timing, one product is checked against central differences of the gradient.

Usage::

    PYTHONPATH=. python3 tools/bench_hvp.py [--sizes I,H,B,T ...] [--repeats N] [--float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchcommon import pin_blas_threads

if __name__ == "__main__":
    pin_blas_threads()  # (before numpy is imported)

import numpy as np

import vgraph as vg


def model(I: int, H: int, dtype: type) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    g = vg.VirtualGraph(dtype=dtype, seed=0)
    x = g.input("x", shape=(None, None, I))
    y = g.input("y", shape=(None, 4))
    h0 = g.input("h0", shape=(None, H))
    W_x = g.parameter("W_x", (I, H))
    W_h = g.parameter("W_h", (H, H), init=vg.nn.init.normal(1.0 / np.sqrt(H)))
    b = g.parameter("b", (H,))
    W_o = g.parameter("W_o", (H, 4))
    with g.loop(name="time") as loop:
        h = loop.carry(h0, name="h")
        loop.update(h, vg.tanh(loop.step(x) @ W_x + h @ W_h + b))
    return g, vg.mean((loop.final(h) @ W_o - y) ** 2)


def feed(rng: np.random.Generator, I: int, H: int, B: int, T: int) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((T, B, I)), "y": rng.standard_normal((B, 4)), "h0": np.zeros((B, H))}


def check(
    g: vg.VirtualGraph, loss: vg.VirtualNode, data: dict[str, np.ndarray], rng: np.random.Generator
) -> float:
    """Max relative error of one product against central differences of the gradient."""
    cg = g.build(data, loss, programs=False, cache=False)
    params = cg.parameters()
    v = [rng.standard_normal(p.shape) for p in params]
    hv = vg.hvp(cg.outputs[0], params, v)
    eps = 1e-5
    original = [p.value.copy() for p in params]
    grads = []
    for sign in (1, -1):
        for p, o, d in zip(params, original, v):
            p.value = o + sign * eps * d
        cg.forward()
        grads.append(cg.grad(cg.outputs[0], params, retain_graph=True))
    for p, o in zip(params, original):
        p.value = o
    fd = [(a - b) / (2 * eps) for a, b in zip(*grads)]
    return max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)) for a, b in zip(hv, fd))


def run(I: int, H: int, B: int, T: int, repeats: int, dtype: type) -> dict[str, float]:
    rng = np.random.default_rng(0)
    g, loss = model(I, H, dtype)
    if dtype is np.float64:
        err = check(g, loss, feed(rng, I, H, B, T), rng)
        if err > 1e-5:
            print(f"HVP disagrees with finite differences of the gradient: rel error {err:.3g}")
            sys.exit(2)
    times: dict[str, list[float]] = {k: [] for k in ("build", "gradient", "record", "product", "hvp")}
    clock = time.perf_counter
    for _ in range(repeats + 1):  # the first round warms up
        data = feed(rng, I, H, B, T)
        t0 = clock()
        cg = g.build(data, loss, programs=False, cache=False)
        t1 = clock()
        cg.backward_ex(cg.outputs[0], retain_graph=True)
        t2 = clock()
        params = cg.parameters()
        op = vg.hvp_operator(cg.outputs[0], params)
        t3 = clock()
        v = [rng.standard_normal(p.shape) for p in params]
        t4 = clock()
        op(v)
        t5 = clock()
        cg2 = g.build(data, loss, programs=False, cache=False)
        t6 = clock()
        vg.hvp(cg2.outputs[0], cg2.parameters(), v)
        t7 = clock()
        g.params.zero_grad()
        for k, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t7 - t6)):
            times[k].append(t * 1e3)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the benchmark; the medians (ms) by size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="*", default=["32,128,32,50"], help="I,H,B,T (default 32,128,32,50)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--float32", action="store_true", help="float32 instead of float64 (no FD check)")
    args = parser.parse_args(argv)
    dtype = np.float32 if args.float32 else np.float64
    print(f"{'I,H,B,T':>14} {'build':>8} {'gradient':>9} {'record':>8} {'product':>8} {'hvp':>8}"
          f" {'prod/grad':>10} {'hvp/grad':>9} {'(b+hvp)/(b+grad)':>17}   (ms, medians)")  # fmt: skip
    results = {}
    for size in args.sizes:
        I, H, B, T = (int(s) for s in size.split(","))
        m = results[size] = run(I, H, B, T, args.repeats, dtype)
        print(
            f"{size:>14} {m['build']:8.2f} {m['gradient']:9.2f} {m['record']:8.2f} {m['product']:8.2f} "
            f"{m['hvp']:8.2f} {m['product'] / m['gradient']:10.2f} {m['hvp'] / m['gradient']:9.2f} "
            f"{(m['build'] + m['hvp']) / (m['build'] + m['gradient']):17.2f}"
        )
    return results


if __name__ == "__main__":
    main()
