#!/usr/bin/env python3
"""Where the RNN benchmark's gap to the floor goes: vgraph's own operations, without vgraph.

``tools/bench_rnn.py`` compares a vgraph training step with the tightest numpy a careful person
writes (the *floor*). The difference has two parts, and they call for different work:

- **layout**: vgraph executes other numpy operations on other arrays than the floor — every value
  a new array kept by its node (the floor writes the states into one preallocated buffer, in
  place), the weight gradients' inputs stacked from separate arrays, the loss's ops as declared;
- **bookkeeping**: the Python around those operations — nodes, dirty checks, gradient accumulation,
  sweeps, argument checks.

This benchmark separates them. It runs, in one process, interleaved, on the same weights and
batches, one SGD step of the Elman RNN of ``bench_rnn`` three ways (mode "reuse": one unrolled
graph, new data fed every step):

- **floor**: ``bench_rnn.numpy_grads`` and an in-place update;
- **operations**: the numpy calls vgraph's reuse step makes, in its order, on its layout (a new
  array per value, kept until the next step replaces it — the loop's sum ``rows[t] + h @ W_h``
  and its ``tanh`` two per step; from 1,024 elements a row the loop's ``tanh`` gradients written
  into one ``(T, B, H)`` buffer, below that new arrays then stacked; the states stacked for ``W_h``'s one product; the
  transposed ``W_h`` copied from its second use in a sweep when the product is large enough; the
  update's new arrays) — written as a plain numpy loop with no graph: what vgraph would cost if
  its bookkeeping were free;
- **vgraph**: ``bench_rnn.VgraphReuse``'s step, timed by phase, with the loop unrolled node by node
  (``vg.body_programs(False)``: the per-node engine these operations describe).

So ``operations / floor`` is what only a change of what vgraph computes and keeps can remove, and
``vgraph - operations`` (per phase, and per loop step) what only less Python per node can. The
operations' loss and gradients are checked against the floor's (``bench_rnn``'s tolerances) and
against vgraph's (the largest difference is printed: the same operations in the same order give
the same bits) before timing; a mismatch aborts with exit status 2.

Usage::

    PYTHONPATH=. python3 tools/bench_gap.py [--sizes I,H,B,T ...] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other tools: bench_rnn, benchcommon
if __name__ == "__main__":
    from benchcommon import pin_blas_threads

    pin_blas_threads()

import bench_rnn as br  # (after pinning BLAS threads; it makes vgraph importable)
import numpy as np

from vgraph import ops, workspace

WARMUP, REPEATS = 3, 25


class OperationsTrainer:
    """vgraph's reuse step as plain numpy: its operations, its arrays, no graph (module docstring).

    ``values`` plays the unrolled graph: one slot per node value, each replaced by a new array at
    every step, as a forward replaces a node's value.
    """

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        self.P = {k: np.array(v, dtype=br.DTYPE) for k, v in params.items()}
        self.values: dict[Any, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    # The phases, each under vgraph's own scope (no huge-page advice; see vgraph.workspace).
    @workspace.computing
    def forward(self, x: np.ndarray, y: np.ndarray) -> float:
        P, v = self.P, self.values
        T, B, _ = x.shape
        v["x"], v["y"] = x, y
        v["proj"] = ops._matmul(x, P["Wx"])  # the hoisted group <MatMul*>: one (T*B, I) @ (I, H)
        rows = v["rows"] = v["proj"] + P["b"]  # the reassociated group <Add*>: the bias added once
        h = v["h", 0] = np.zeros((B, P["Wh"].shape[0]), dtype=br.DTYPE)  # the constant h0
        Wh = P["Wh"]
        for t in range(T):  # MatMulAddRow (the row plus the product), then Tanh: two new arrays
            s = v["s", t] = rows[t] + ops._matmul(h, Wh)
            h = v["h", t + 1] = np.tanh(s)
        out = v["out"] = ops._matmul(h, P["Wo"])
        d = v["d"] = np.subtract(out, y)
        sq = v["sq"] = np.power(d, 2)
        loss = v["loss"] = np.mean(sq)
        return float(loss)

    @workspace.computing
    def backward(self) -> None:
        P, v = self.P, self.values
        x, d, sq = v["x"], v["d"], v["sq"]
        T, B, I = x.shape
        H = P["Wh"].shape[0]
        g = np.ones((), dtype=br.DTYPE)  # the seed
        g = np.broadcast_to(np.reshape(g, (1,) * sq.ndim) / sq.size, sq.shape)  # Mean
        g = g * (2 * np.power(d, 1))  # Pow (p = 2); Sub passes it on
        hT = v["h", T]
        grads = {"Wo": hT.T @ g}  # one use of W_o: its product
        gh = g @ P["Wo"].T
        Wh = P["Wh"]
        transposed = B * Wh.size >= ops.TRANSPOSED_MIN_WORK  # (ops._transposed: from the 2nd use)
        WhT = Wh.T
        rowbuf = workspace.empty((T, B, H), Wh.dtype) if B * H >= ops.ROW_VJP_MIN else None
        gs: list[np.ndarray] = []
        for t in range(T - 1, -1, -1):
            ans = v["h", t + 1]
            if rowbuf is not None:  # ops._tanh_vjp_row: into row t of the sweep's buffer
                gt = rowbuf[t]
                np.multiply(ans, ans, out=gt)
                np.subtract(1, gt, out=gt)
                np.multiply(gt, gh, out=gt)
            else:  # ops._tanh_vjp: new arrays
                gt = gh * (1 - ans * ans)
            gs.append(gt)
            if t:  # h0 is a constant: no gradient
                gh = gt @ WhT
                if transposed and t == T - 1:
                    WhT = np.ascontiguousarray(Wh.T)
        gs.reverse()
        if rowbuf is None:  # the rows stacked once for every collector (ops._rows_stack)
            G = workspace.empty((T, B, H), Wh.dtype)
            np.stack(gs, out=G)
        else:
            G = rowbuf
        G2 = G.reshape(T * B, H)
        states = [v["h", t] for t in range(T)]
        stack = workspace.empty((T * B, H), Wh.dtype)
        np.concatenate(states, out=stack)  # ops._stacked: W_h's inputs, one product
        grads["Wh"] = stack.T @ G2
        del stack
        grads["b"] = (ops._ones(T * B, G2.dtype) @ G2).reshape(H)  # ops._sum_leading
        grads["Wx"] = x.reshape(T * B, I).T @ G2  # the group's product
        self.grads = grads

    def update(self) -> None:
        for k, p in self.P.items():  # as the benchmark updates vgraph's parameters: new arrays
            self.P[k] = p - br.LR * self.grads[k]

    def step(self, x: np.ndarray, y: np.ndarray, marks: list[float] | None = None) -> float:
        """One step; ``marks``: as for ``bench_rnn.NumpyTrainer.step``."""
        loss = self.forward(x, y)
        if marks is not None:
            marks.append(time.perf_counter())
        self.backward()
        if marks is not None:
            marks.append(time.perf_counter())
        self.update()
        return loss


def _phases(step: Any, x: np.ndarray, y: np.ndarray) -> list[float]:
    """The seconds of ``step(x, y, marks)``'s forward, backward and update."""
    marks = [time.perf_counter()]
    step(x, y, marks)
    marks.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(marks)]


def check(size: tuple[int, int, int, int]) -> float:
    """Check the operations against the floor (tolerances of bench_rnn) and return their largest
    gradient difference from vgraph's, on one batch; raises bench_rnn.BenchmarkMismatch."""
    I, H, B, T = size
    g, loss = br.make_model(I, H, B)
    x, y = br.make_data(I, B, T, n=1)[0]
    P = br.vgraph_param_values(g)
    ops_trainer = OperationsTrainer(P)
    value = ops_trainer.forward(x, y)
    ops_trainer.backward()
    ref_loss, ref = br.numpy_grads({k: np.array(p) for k, p in P.items()}, x, y)
    br._check_loss(f"loss, operations {size}", value, ref_loss)
    br._compare(f"gradients, operations {size}", ops_trainer.grads, ref)
    cg = g.build({"x": x, "y": y}, loss, programs=False)  # (the per-node engine's operations)
    cg.backward(cg.outputs[0])
    return max(float(np.max(np.abs(g.params[k].grad - ops_trainer.grads[k]))) for k in br.PARAM_NAMES)


def measure(size: tuple[int, int, int, int], repeats: int = REPEATS, warmup: int = WARMUP) -> dict[str, Any]:
    """Interleaved medians (ms) of the floor's step, the operations' and vgraph's steps and phases."""
    I, H, B, T = size
    g, loss = br.make_model(I, H, B)
    data = br.make_data(I, B, T, seed=7)
    P0 = br.vgraph_param_values(g)
    floor, operations = br.NumpyTrainer(P0, br.numpy_grads), OperationsTrainer(P0)
    steps = {
        "floor": floor.step,
        "operations": operations.step,
        "vgraph": br.VgraphReuse(g, loss, *data[0], programs=False).step,
    }
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    gc.collect()
    for i in range(warmup + repeats):
        x, y = data[i % len(data)]
        for name in list(steps)[:: -1 if i % 2 else 1]:
            phases = _phases(steps[name], x, y)
            if i >= warmup:
                times[name].append(phases)
    br._compare(f"parameters after training, operations {size}", operations.P, floor.P)

    def med(name: str, phase: int | None = None) -> float:
        return statistics.median((sum(t) if phase is None else t[phase]) * 1e3 for t in times[name])

    res: dict[str, Any] = {"size": list(size), "repeats": repeats}
    for name in steps:
        res[f"{name}_ms"] = med(name)
        for phase, label in enumerate(("forward", "backward", "update")):
            res[f"{name}_{label}_ms"] = med(name, phase)
    res["layout_ratio"] = res["operations_ms"] / res["floor_ms"]
    res["ratio"] = res["vgraph_ms"] / res["floor_ms"]
    for label in ("forward", "backward", "update"):  # bookkeeping per loop step, µs
        extra = res[f"vgraph_{label}_ms"] - res[f"operations_{label}_ms"]
        res[f"bookkeeping_{label}_us_per_step"] = extra * 1e3 / T
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=br._parse_size, default=br.SIZES, metavar="I,H,B,T")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--blas-threads", help="BLAS threads (default 1; read before numpy is imported)")
    args = ap.parse_args(argv)
    rows = []
    try:
        for size in args.sizes:
            diff = check(size)
            res = measure(size, args.repeats, args.warmup)
            res["max_grad_diff_vs_vgraph"] = diff
            rows.append(res)
    except br.BenchmarkMismatch as e:
        print(f"MISMATCH: {e}", file=sys.stderr)
        return 2
    print("One SGD step, mode reuse: medians in ms (forward / backward / update), ratios to the floor.")
    print("bookkeeping = vgraph - operations, per loop step (µs). grad diff: operations vs vgraph.")
    names = ("floor", "operations", "vgraph")
    print(
        f"{'size (I,H,B,T)':18s}"
        + "".join(f" {n:>23s}" for n in names)
        + f" {'ops/floor':>9s} {'vg/floor':>8s} {'bookkeeping fwd/bwd':>20s} {'grad diff':>9s}"
    )
    for r in rows:
        cells = "".join(
            f" {r[f'{n}_ms']:6.3g} ({'/'.join(format(r[f'{n}_{p}_ms'], '.3g') for p in ('forward', 'backward', 'update'))})".rjust(
                24
            )
            for n in names
        )
        book = "/".join(f"{r[f'bookkeeping_{p}_us_per_step']:.2f}" for p in ("forward", "backward"))
        print(
            f"{br._fmt_size(r['size']):18s}{cells} {r['layout_ratio']:9.2f} {r['ratio']:8.2f}"
            f" {book:>20s} {r['max_grad_diff_vs_vgraph']:9.1e}"
        )
    if args.json:
        args.json.write_text(json.dumps({"machine": br.machine_info(), "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
