"""Benchmark: checkpointing a long loop — peak memory and time of build + backward.

An Elman RNN (``nn.RNNCell``, tied weights) over ``T`` steps of ``(B, I)`` float32 inputs, with
two losses:

* ``step``: a per-step readout ``h_t @ V`` against a target ``y_t``, the squared errors summed in
  a carry (sequence regression; the targets are fed too);
* ``final``: the squared readout of the final state only.

For each loss and each schedule — the plain unroll, ``checkpoint=k``, ``"sqrt"``,
``("binomial", s)`` — it measures, as a user would from outside:

* **peak memory** (tracemalloc) from creating the fed arrays to the end of backward: the fed
  sequence counts (it is the user's memory too), then ``g.build`` and ``cg.backward``. The
  parameters exist before (a short warm-up build), the workspace's scratch buffers do not (they
  count). Median of ``--peak-repeat`` runs;
* **time** of build + backward, without tracemalloc (which slows Python down), median of
  ``--repeat`` runs, the schedules interleaved within each repeat; one BLAS thread; wall time
  and this process's CPU time (less sensitive to other processes on a shared machine);
* how many node values backward recomputed;
* that the gradients equal the plain unroll's (float32: to rounding).

It also prints what the fed arrays weigh and the floor of sqrt checkpointing: the fed arrays, the
graph's own copy of them (so that later changes to the caller's arrays do not reach it),
``ceil(T/k)`` stored states + one unit of ``k`` iterations' values (``k = ceil(sqrt(T))``), the
memory any scheme that keeps ``O(sqrt T)`` states and recomputes one unit at a time must hold —
before the unrolled graph's per-node objects, which vgraph keeps for every iteration (every key
stays addressable).

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
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import vgraph as vg  # noqa: E402
from vgraph import nn  # noqa: E402

LOSSES = ("step", "final")


def model(schedule: Any, sizes: tuple[int, int, int], loss: str = "step") -> tuple[vg.VirtualGraph, Any]:
    """The Elman RNN with a per-step (``"step"``) or final-state (``"final"``) loss."""
    I, H, _ = sizes
    g = vg.VirtualGraph(dtype=np.float32, seed=0)
    xs, h0 = g.input("xs"), g.input("h0")
    cell = nn.RNNCell(g, I, H, "rnn", share=True)
    V = g.parameter("V", (H, 1))
    with g.loop(checkpoint=schedule, name="rnn") as loop:
        x = loop.step(xs)
        h = loop.carry(h0, name="h")
        hn = cell(x, h)
        loop.update(h, hn)
        if loss == "step":
            ys = g.input("ys")
            err = loop.carry(g.constant(0.0), name="err")
            d = hn @ V - loop.step(ys)
            loop.update(err, err + vg.mean(d * d))
    if loss == "step":
        return g, loop.final(err)
    out = loop.final(h) @ V
    return g, vg.mean(out * out)


def feed(T: int, sizes: tuple[int, int, int], loss: str = "step") -> dict[str, np.ndarray]:
    """The fed arrays, made directly in float32 (no float64 temporary inflates a traced peak)."""
    I, H, B = sizes
    rng = np.random.default_rng(0)
    data = {
        "xs": rng.standard_normal((T, B, I), dtype=np.float32),
        "h0": np.zeros((B, H), dtype=np.float32),
    }
    if loss == "step":
        data["ys"] = rng.standard_normal((T, B, 1), dtype=np.float32)
    return data


def step(g: vg.VirtualGraph, loss: Any, data: dict[str, np.ndarray]) -> Any:
    """One build + backward, as a training step does it."""
    cg = g.build(data, loss, cache=False)
    g.params.zero_grad()
    cg.backward(loss)
    return cg


def _release(g: vg.VirtualGraph) -> None:
    g.latest_build = None
    gc.collect()


def traced_peak(
    g: vg.VirtualGraph, loss: Any, T: int, sizes: tuple[int, int, int], kind: str
) -> dict[str, Any]:
    """Peak traced memory of: making the fed arrays, build, backward (and of each phase).

    The workspace's scratch buffers are cleared first, so that each run counts those it uses (as
    a first training step does; later steps reuse them, but the process holds them all along)."""
    _release(g)
    vg.workspace.clear()
    tracemalloc.start()
    try:
        data = feed(T, sizes, kind)
        fed = tracemalloc.get_traced_memory()[0]
        cg = g.build(data, loss, cache=False)
        built, build_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        g.params.zero_grad()
        cg.backward(loss)
        backward_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    recomputed = getattr(cg.dropped_values, "recomputed", 0)  # a Rematerializer's count, if any
    grad = np.array(g.params["rnn.W_h"].grad)
    del cg, data
    _release(g)
    return {
        "peak": max(build_peak, backward_peak),
        "fed": fed,
        "built": built,
        "build_peak": build_peak,
        "backward_peak": backward_peak,
        "recomputed": recomputed,
        "grad": grad,
    }


def timed(g: vg.VirtualGraph, loss: Any, data: dict[str, np.ndarray]) -> tuple[float, float]:
    """Wall time and CPU time of this process (less sensitive to other processes on a shared
    machine) of one build + backward."""
    _release(g)
    t0, c0 = time.perf_counter(), time.process_time()
    cg = step(g, loss, data)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    del cg
    _release(g)
    return elapsed, cpu


def iteration_bytes(sizes: tuple[int, int, int], kind: str) -> int:
    """Bytes of the values one iteration of the plain unroll computes (arrays owning their data;
    the steps of the fed sequence are views)."""
    g, loss = model(None, sizes, kind)
    cg = g.build(feed(3, sizes, kind), loss, cache=False)
    total = 0
    for node in cg._nodes.values():
        v = node._value
        if node.key.idx == (1,) and isinstance(v, np.ndarray) and v.base is None:
            total += v.nbytes
    return total


def label(schedule: Any) -> str:
    if schedule is None:
        return "plain"
    if isinstance(schedule, tuple):
        return f"{schedule[0]}({schedule[1]})"
    return f"every {schedule}" if isinstance(schedule, int) else str(schedule)


def run(
    kind: str, T: int, sizes: tuple[int, int, int], schedules: list[Any], repeat: int, peak_repeat: int
) -> dict[str, dict[str, float]]:
    """Measure every schedule for one loss; print a table; return the figures by schedule."""
    graphs = {}
    for schedule in schedules:
        g, loss = model(schedule, sizes, kind)
        step(g, loss, feed(min(T, 4), sizes, kind))  # warm-up: parameters exist, plans are made
        graphs[label(schedule)] = (g, loss)
    peaks: dict[str, list[dict[str, Any]]] = {name: [] for name in graphs}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    cpus: dict[str, list[float]] = {name: [] for name in graphs}
    data = feed(T, sizes, kind)
    for r in range(max(repeat, peak_repeat)):
        if r < peak_repeat:
            for name, (g, loss) in graphs.items():
                peaks[name].append(traced_peak(g, loss, T, sizes, kind))
        if r >= repeat:
            continue
        for name, (g, loss) in graphs.items():
            wall, cpu = timed(g, loss, data)
            times[name].append(wall)
            cpus[name].append(cpu)
    del data
    gc.collect()

    fed = peaks["plain"][0]["fed"]
    H, B = sizes[1], sizes[2]
    k = max(1, math.ceil(math.sqrt(T)))
    # the user's fed arrays and the graph's own copy of them (so that the user's later changes do
    # not reach it), the stored states, one unit's values
    floor = 2 * fed + math.ceil(T / k) * B * H * 4 + k * iteration_bytes(sizes, kind)
    results: dict[str, dict[str, float]] = {}
    base_peak = statistics.median(p["peak"] for p in peaks["plain"])
    base_time = statistics.median(times["plain"])
    base_cpu = statistics.median(cpus["plain"])
    base_grad = peaks["plain"][0]["grad"]
    print(
        f"\nloss = {kind}: fed arrays {fed / 1e6:.1f} MB ({100 * fed / base_peak:.1f}% of plain); sqrt floor "
        f"(fed + the graph's copy + {math.ceil(T / k)} states + {k} iterations' values) {floor / 1e6:.1f} MB "
        f"= {100 * floor / base_peak:.1f}% of plain"
    )
    print(f"{'schedule':>14} {'peak MB':>9} {'% plain':>8} {'build MB':>9} {'bwd MB':>8} "
          f"{'time s':>8} {'x plain':>8} {'cpu s':>7} {'x plain':>8} {'recomputed':>11}")  # fmt: skip
    for name in graphs:
        diff = float(np.linalg.norm(peaks[name][0]["grad"] - base_grad) / np.linalg.norm(base_grad))
        if diff > 1e-4:  # float32 sums in another grouping: equal to rounding
            raise SystemExit(f"{kind}, {name}: the gradient differs from the plain unroll's ({diff:.2g})")
        peak = statistics.median(p["peak"] for p in peaks[name])
        t, c = statistics.median(times[name]), statistics.median(cpus[name])
        x = results[name] = {
            "peak_mb": peak / 1e6,
            "peak_vs_plain": peak / base_peak,
            "build_peak_mb": statistics.median(p["build_peak"] for p in peaks[name]) / 1e6,
            "backward_peak_mb": statistics.median(p["backward_peak"] for p in peaks[name]) / 1e6,
            "after_build_mb": statistics.median(p["built"] for p in peaks[name]) / 1e6,
            "time_s": t,
            "time_vs_plain": t / base_time,
            "times_s": times[name],
            "cpu_s": c,
            "cpu_vs_plain": c / base_cpu,
            "recomputed": peaks[name][0]["recomputed"],
            "grad_rel_diff": diff,
        }
        print(
            f"{name:>14} {x['peak_mb']:9.1f} {100 * x['peak_vs_plain']:7.1f}% {x['build_peak_mb']:9.1f} "
            f"{x['backward_peak_mb']:8.1f} {t:8.2f} {x['time_vs_plain']:7.2f}x "
            f"{c:7.2f} {x['cpu_vs_plain']:7.2f}x {x['recomputed']:11d}"
        )
    results["_"] = {
        "fed_mb": fed / 1e6,
        "sqrt_floor_mb": floor / 1e6,
        "sqrt_floor_vs_plain": floor / base_peak,
    }
    return results


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--T", type=int, default=10_000, help="loop length (default 10,000)")
    parser.add_argument("--sizes", type=int, nargs=3, default=(32, 128, 32), metavar=("I", "H", "B"))
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed runs per schedule (the median is reported)"
    )
    parser.add_argument(
        "--peak-repeat", type=int, default=2, help="traced runs per schedule (the median peak is reported)"
    )
    parser.add_argument("--every", type=int, nargs="*", default=[10], help="checkpoint=k values")
    parser.add_argument("--binomial", type=int, nargs="*", default=[10], help="('binomial', s) budgets")
    parser.add_argument("--loss", choices=[*LOSSES, "both"], default="both")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--quick", action="store_true", help="T = 200, sizes (8, 16, 4), 1 repeat: a smoke run"
    )
    args = parser.parse_args(argv)
    T, sizes, repeat, peak_repeat = args.T, tuple(args.sizes), args.repeat, args.peak_repeat
    if args.quick:
        T, sizes, repeat, peak_repeat = 200, (8, 16, 4), 1, 1
    schedules: list[Any] = [None, *args.every, "sqrt", *(("binomial", s) for s in args.binomial)]
    print(
        f"Elman RNN, (I, H, B) = {sizes}, T = {T}, float32; build + backward; peak by tracemalloc "
        f"including the fed arrays (median of {peak_repeat} run(s)); time: median of {repeat} run(s)"
    )
    results = {
        kind: run(kind, T, sizes, schedules, repeat, peak_repeat)
        for kind in (LOSSES if args.loss == "both" else [args.loss])
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"T": T, "sizes": sizes, "repeat": repeat, "peak_repeat": peak_repeat, "results": results},
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    main()
