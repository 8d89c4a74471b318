"""Benchmark: checkpointing a long loop (issue 15) — peak memory vs time of build + backward.

An Elman RNN (``nn.RNNCell``, tied weights) over ``T`` steps of ``(B, I)`` inputs with a
per-step readout ``h_t @ V`` against a target, the squared errors summed in a carry (a
sequence-regression loss). For each schedule — the plain unroll, ``checkpoint=k``, ``"sqrt"``,
``("binomial", s)`` — it measures:

* peak memory of one build + backward (tracemalloc, which slows Python down, so separately
  from the time), after a warm-up build so that parameters exist;
* time of build + backward (best of ``--repeat`` runs, without tracemalloc; one BLAS thread);
* how many node values backward recomputed.

Usage::

    PYTHONPATH=. python tools/bench_checkpoint.py              # (I, H, B) = (32, 128, 32), T = 10,000
    PYTHONPATH=. python tools/bench_checkpoint.py --T 2000 --repeat 3
    PYTHONPATH=. python tools/bench_checkpoint.py --quick      # a small smoke run (tests)
"""

from __future__ import annotations

import os

# One BLAS thread: on a shared machine, a multi-threaded BLAS oversubscribed by other processes
# made single timings vary by 5x; the comparison is about vgraph's work, not BLAS threading.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import vgraph as vg  # noqa: E402
from vgraph import nn  # noqa: E402


def model(schedule: Any, sizes: tuple[int, int, int]) -> tuple[vg.VirtualGraph, Any]:
    I, H, _ = sizes
    g = vg.VirtualGraph(seed=0)
    xs, ys, h0 = g.input("xs"), g.input("ys"), g.input("h0")
    cell = nn.RNNCell(g, I, H, "rnn", share=True)
    V = g.parameter("V", (H, 1))
    with g.loop(checkpoint=schedule, name="rnn") as loop:
        x, y = loop.step(xs), loop.step(ys)
        h = loop.carry(h0, name="h")
        err = loop.carry(g.constant(0.0), name="err")
        hn = cell(x, h)
        d = hn @ V - y
        loop.update(h, hn)
        loop.update(err, err + vg.mean(d * d))
    return g, loop.final(err)


def feed(T: int, sizes: tuple[int, int, int]) -> dict[str, np.ndarray]:
    I, H, B = sizes
    rng = np.random.default_rng(0)
    return {
        "xs": rng.standard_normal((T, B, I)).astype(np.float32),
        "ys": rng.standard_normal((T, B, 1)).astype(np.float32),
        "h0": np.zeros((B, H), dtype=np.float32),
    }


def step(g: vg.VirtualGraph, loss: Any, data: dict[str, np.ndarray]) -> Any:
    cg = g.build(data, loss, cache=False)
    g.params.zero_grad()
    cg.backward(loss)
    return cg


def measure(schedule: Any, T: int, sizes: tuple[int, int, int], repeat: int) -> dict[str, Any]:
    g, loss = model(schedule, sizes)
    data = feed(T, sizes)
    cg = step(g, loss, data)  # warm-up: parameters, plans
    recomputed = cg._remat.recomputed if cg._remat is not None else 0
    grad = np.array(g.params["rnn.W_h"].grad)
    del cg
    g.latest_build = None
    gc.collect()
    tracemalloc.start()
    try:
        cg = step(g, loss, data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del cg
    g.latest_build = None
    gc.collect()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        cg = step(g, loss, data)
        times.append(time.perf_counter() - t0)
        del cg
        g.latest_build = None
        gc.collect()
    return {"peak": peak, "time": min(times), "recomputed": recomputed, "grad": grad}


def label(schedule: Any) -> str:
    if schedule is None:
        return "plain"
    if isinstance(schedule, tuple):
        return f"{schedule[0]}({schedule[1]})"
    return f"every {schedule}" if isinstance(schedule, int) else str(schedule)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=10_000, help="loop length (default 10,000)")
    parser.add_argument("--sizes", type=int, nargs=3, default=(32, 128, 32), metavar=("I", "H", "B"))
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per schedule (best is kept)")
    parser.add_argument("--every", type=int, nargs="*", default=[10, 1000], help="checkpoint=k values")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="T = 200, sizes (8, 16, 4): a smoke run")
    args = parser.parse_args(argv)
    T, sizes = args.T, tuple(args.sizes)
    if args.quick:
        T, sizes = 200, (8, 16, 4)
    schedules: list[Any] = [None, *args.every, "sqrt", ("binomial", 10)]
    print(f"Elman RNN, (I, H, B) = {sizes}, T = {T}, float32; build + backward")
    print(f"{'schedule':>14} {'peak MB':>9} {'% plain':>8} {'time s':>8} {'x plain':>8} {'recomputed':>11}")
    results: dict[str, dict[str, float]] = {}
    base = None
    for schedule in schedules:
        r = measure(schedule, T, sizes, args.repeat)
        if base is None:
            base = r
        else:  # float32 sums in another grouping: equal to rounding
            diff = np.linalg.norm(r["grad"] - base["grad"]) / np.linalg.norm(base["grad"])
            if diff > 1e-4:
                raise SystemExit(
                    f"{label(schedule)}: the gradient differs from the plain unroll's ({diff:.2g})"
                )
        name = label(schedule)
        results[name] = {
            "peak_mb": r["peak"] / 1e6,
            "peak_vs_plain": r["peak"] / base["peak"],
            "time_s": r["time"],
            "time_vs_plain": r["time"] / base["time"],
            "recomputed": r["recomputed"],
        }
        x = results[name]
        print(
            f"{name:>14} {x['peak_mb']:9.1f} {100 * x['peak_vs_plain']:7.1f}% {x['time_s']:8.2f} "
            f"{x['time_vs_plain']:7.2f}x {x['recomputed']:11d}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"T": T, "sizes": sizes, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
