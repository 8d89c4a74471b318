"""Adaptive computation: a learned iterative solver that runs as many steps as each input needs.

The model learns to compute ``sqrt(a)`` by refinement. It starts from the guess ``z = 1`` and
repeatedly applies a small learned update network; each update may move the estimate by at most
``0.5`` (a tanh-bounded step), so inputs whose root is far from 1 *need* more iterations. The
loop is a ``while_`` loop whose condition looks at the real value of the last update: it stops
as soon as the update is smaller than a tolerance (or after ``--max-steps`` iterations). The
number of iterations is therefore decided per input, at build time, from data.

In plain Python, for one input ``a``::

    z, step, t = 1.0, inf, 0
    while t < max_steps and abs(step) > tol:          # the while_ condition, on real values
        hidden = tanh(z * W_z + (a / 4) * W_a + b_1)  # (a / 4) * W_a + b_1 is computed once, outside
        step = 0.5 * tanh(hidden @ W_2 + b_2)
        z = z + step
        t += 1
    estimate = z
    loss = (estimate - sqrt(a)) ** 2 + 0.1 * step ** 2

The second loss term asks the last update to be small, which teaches the update to vanish at the
answer (so the loop halts there). Gradients flow through every iteration that ran (BPTT through
a loop whose length differs per input); the halting decision itself is not differentiated.

Because one build is one structure, every training example is built on its own (batch of 1); the
gradients of a mini-batch accumulate in the parameters' ``.grad`` (``cg.backward(loss, seed=1/B)``
averages them). ``cg.trip_count(loop)`` reports how many iterations each input took.

Run: ``python examples/adaptive_loop.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse

import numpy as np

import vgraph as vg
from vgraph import losses, optim
from vgraph.tbptt import Progress

MAX_STEP = 0.5  # the largest move of one refinement step
START = 1.0  # the initial guess
ROOT_RANGE = (0.5, 4.0)  # sqrt(a) is uniform in this range, so a is in [0.25, 16]
SHOW = (0.3, 1.0, 2.25, 4.0, 6.25, 9.0, 12.25, 16.0)  # inputs whose trip counts are printed


def build_model(hidden: int, tol: float, max_steps: int, seed: int) -> tuple[vg.VirtualGraph, dict]:
    """The iterative solver as a virtual graph. Inputs ``a``, ``target`` and ``z0``, each (1, 1)."""
    g = vg.VirtualGraph(seed=seed, name="adaptive-sqrt")
    a = g.input("a", shape=(1, 1))
    target = g.input("target", shape=(1, 1))
    z0 = g.input("z0", shape=(1, 1))
    W_a = g.parameter("W_a", (1, hidden))
    W_z = g.parameter("W_z", (1, hidden))
    b_1 = g.parameter("b_1", (hidden,))
    W_2 = g.parameter("W_2", (hidden, 1))
    b_2 = g.parameter("b_2", (1,))
    a_proj = (a / 4.0) @ W_a + b_1  # loop-invariant: computed once per build, outside the loop

    def keep_going(t: int, state: dict[str, np.ndarray]) -> bool:
        return t < max_steps and abs(state["step"].item()) > tol

    with g.loop(while_=keep_going, max_iters=max_steps + 1, name="refine") as loop:
        z = loop.carry(z0, name="z")
        last = loop.carry(np.full((1, 1), np.inf), name="step")
        step = MAX_STEP * vg.tanh(vg.tanh(z @ W_z + a_proj) @ W_2 + b_2)
        loop.update(z, z + step)
        loop.update(last, step)
    estimate = loop.final(z, name="estimate")
    final_step = loop.final(last, name="final_step")
    loss = losses.mse_loss(estimate, target) + 0.1 * losses.mse_loss(final_step, 0.0)
    return g, {"loop": loop, "estimate": estimate, "loss": loss}


def feed(a: float) -> dict[str, np.ndarray]:
    return {"a": np.array([[a]]), "target": np.array([[np.sqrt(a)]]), "z0": np.array([[START]])}


def evaluate(g: vg.VirtualGraph, outs: dict, inputs: np.ndarray) -> tuple[float, list[int], list[float]]:
    """MSE of the estimates over ``inputs``, each input's trip count and estimate (eval mode)."""
    g.eval()
    try:
        trips, estimates = [], []
        for a in inputs:
            cg = g.build(feed(a), outs["estimate"])
            trips.append(cg.trip_count(outs["loop"]))
            estimates.append(float(cg.forward().item()))
        mse = float(np.mean((np.array(estimates) - np.sqrt(inputs)) ** 2))
        return mse, trips, estimates
    finally:
        g.train()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="inputs per step, one build each")
    parser.add_argument("--hidden", type=int, default=16, help="hidden units of the update step")
    parser.add_argument("--tol", type=float, default=0.05, help="halt when |update| <= tol")
    parser.add_argument("--max-steps", type=int, default=16, help="at most this many iterations")
    parser.add_argument("--lr", type=float, default=2e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    Progress.add_option(parser)
    args = parser.parse_args(argv)

    g, outs = build_model(args.hidden, args.tol, args.max_steps, args.seed)
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    test_inputs = np.linspace(*ROOT_RANGE, 16) ** 2
    # Baseline: predict the mean root (2.25) for every input, MSE = variance of U(0.5, 4).
    baseline = (ROOT_RANGE[1] - ROOT_RANGE[0]) ** 2 / 12.0
    low, high = ROOT_RANGE[0] ** 2, ROOT_RANGE[1] ** 2
    print(
        f"Learning sqrt(a) for a in [{low:g}, {high:g}] by iterative refinement "
        f"from z = {START:g}: update network with {args.hidden} hidden units, "
        f"{sum(p.value.size for p in g.params.parameters())} parameters"
    )
    print(
        f"Halting: stop when |update| <= {args.tol:g} (at most {args.max_steps} iterations); "
        f"baseline (always answer 2.25): MSE {baseline:.3f}"
    )

    first, trips, _ = evaluate(g, outs, test_inputs)
    print(f"  step {0:4d}/{args.steps}  held-out MSE {first:.4f}  mean iterations {np.mean(trips):4.1f}")
    history = [(0, first)]
    report_every = max(1, args.steps // 10)
    seed = np.array(1.0 / args.batch)
    train_loss = train_trips = 0.0
    with Progress(args.steps, desc="train", mode=args.progress, every=report_every) as progress:
        for step in range(1, args.steps + 1):
            for a in rng.uniform(*ROOT_RANGE, size=args.batch) ** 2:
                cg = g.build(feed(a), outs["loss"])  # unrolled for as many iterations as this input needs
                train_loss += cg.backward(outs["loss"], seed=seed)  # accumulates mean-of-batch gradients
                train_trips += cg.trip_count(outs["loop"])
            opt.step()
            opt.zero_grad()
            if step % report_every == 0 or step == args.steps:
                mse, trips, _ = evaluate(g, outs, test_inputs)
                history.append((step, mse))
                n = args.batch * (report_every if step % report_every == 0 else step % report_every)
                metrics = {
                    "train loss": train_loss / n,
                    "held-out MSE": mse,
                    "mean iterations": train_trips / n,
                }
                train_loss = train_trips = 0.0
                progress.update(log=True, **metrics)
            else:
                progress.update()

    final, _, _ = evaluate(g, outs, test_inputs)
    _, show_trips, show_est = evaluate(g, outs, np.array(SHOW))
    print("\nIterations per input (cg.trip_count(loop)) after training:")
    print("       a   sqrt(a)  estimate  iterations")
    for a, n_it, est in zip(SHOW, show_trips, show_est):
        print(f"  {a:6.2f}  {np.sqrt(a):8.3f}  {est:8.3f}  {n_it:4d} {'#' * n_it}")
    print(
        f"\nHeld-out MSE {final:.4f} (first {first:.3f}, baseline {baseline:.3f}); iterations range from "
        f"{min(show_trips)} to {max(show_trips)}: inputs far from the start guess take more steps"
    )
    return {
        "first_loss": first,
        "final_loss": final,
        "baseline": baseline,
        "history": history,
        "trip_counts": dict(zip(SHOW, show_trips)),
    }


if __name__ == "__main__":
    main()
