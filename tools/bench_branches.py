"""Benchmark: a batched loop whose iterations branch, as one program over rows and op by op.

An RNN over sequences of different lengths whose step chooses between two cells by its input
(``h' = tanh(z)/2 + h/2`` or ``[sigmoid(z[:H/2]), tanh(z[H/2:])]``, ``z = x_t W + h U``), so the
inputs of one iteration choose differently. Three ways to train on a group of sequences, each
timed as build + backward (BLAS on one thread, medians of ``--repeats`` after a warm-up):

* ``rows``: ``g.build_batch(..., programs=True)`` — the loop is one body program over the
  group's rows, each iteration's rows split by choice where they differ;
* ``op_by_op``: ``g.build_batch(..., programs=False)`` — each input's builder runs the loop, the
  scheduler grouping the copies of each op across inputs;
* ``alone``: ``g.build`` one sequence after another (``cache=False``: a new structure each).

Before timing, the three give the same losses and parameter gradients (float64, 1e-12).

Usage::

    PYTHONPATH=. python tools/bench_branches.py [--batch 32] [--hidden 64] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchcommon import pin_blas_threads  # (tools/, this script's directory, is on sys.path)

if __name__ == "__main__":
    pin_blas_threads()  # (before numpy is imported)

import numpy as np

import vgraph as vg

INPUT = 32


def make_model(hidden: int, dtype: Any) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The branching RNN of the module docstring; returns ``(g, loss)``."""
    g = vg.VirtualGraph(seed=6, dtype=dtype)
    xs = g.input("xs", (None, INPUT))
    W, U = g.parameter("W", (INPUT, hidden)), g.parameter("U", (hidden, hidden))
    with g.loop(name="rnn") as L:
        h = L.carry(np.zeros(hidden, dtype=dtype), name="h")
        x = L.step(xs, name="x")
        z = x @ W + h @ U
        calm = vg.tanh(z) * 0.5 + h * 0.5
        hot = vg.concat([vg.sigmoid(z[: hidden // 2]), vg.tanh(z[hidden // 2 :])], axis=0)
        h_new = g.branch(lambda v: int(v[0] > 0), [calm, hot], keys=[x], name="cell")
        L.update(h, h_new)
    return g, vg.sum(L.final(h) ** 2)


def feeds_for(batch: int, dtype: Any, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"xs": rng.normal(size=(int(n), INPUT)).astype(dtype)} for n in rng.integers(10, 30, batch)]


def step(g: vg.VirtualGraph, loss: vg.VirtualNode, feeds: list[dict[str, Any]], how: str) -> list[float]:
    """One build + backward of ``feeds`` the way ``how`` names; returns the losses."""
    g.params.zero_grad()
    if how == "alone":
        out = []
        for f in feeds:
            cg = g.build(f, loss, cache=False)
            out.append(float(cg.backward(loss)))
        return out
    batch = g.build_batch(feeds, loss, programs=how == "rows")
    if how == "rows" and not batch.rows_programs:
        raise SystemExit(f"the loop did not run as a program over rows: {batch.inputs[0].interpreted}")
    batch.backward("sum")
    return [float(x) for x in batch.outputs()]


def check(hidden: int) -> None:
    """The three ways agree (float64): losses and every parameter gradient, to 1e-12."""
    feeds = feeds_for(8, np.float64, seed=1)
    ref: dict[str, Any] = {}
    for how in ("alone", "op_by_op", "rows"):
        g, loss = make_model(hidden, np.float64)
        losses = step(g, loss, feeds, how)
        grads = {k: np.array(p.grad) for k, p in g.params.items()}
        if not ref:
            ref = {"losses": losses, "grads": grads}
            continue
        np.testing.assert_allclose(losses, ref["losses"], rtol=1e-12, atol=1e-12, err_msg=how)
        for k, gk in grads.items():
            np.testing.assert_allclose(gk, ref["grads"][k], rtol=1e-12, atol=1e-12, err_msg=f"{how} {k}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="sequences per group (default 32)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per way (default 5)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    check(args.hidden)
    print("correctness: rows = op by op = one at a time (float64; losses, gradients, 1e-12)")
    feeds = feeds_for(args.batch, np.float32)
    g, loss = make_model(args.hidden, np.float32)
    results: dict[str, float] = {}
    for how in ("rows", "op_by_op", "alone"):
        step(g, loss, feeds, how)  # (warm-up)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step(g, loss, feeds, how)
            times.append(time.perf_counter() - t)
        results[how] = statistics.median(times) * 1e3
        print(f"{how:>9}: {results[how]:8.1f} ms per group of {args.batch}")
    print(
        f"rows is {results['op_by_op'] / results['rows']:.1f}x op by op, {results['alone'] / results['rows']:.1f}x one at a time"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"batch": args.batch, "hidden": args.hidden, "ms_per_group": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
