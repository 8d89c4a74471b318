"""Data-dependent routing: each input goes through one of three expert networks, chosen by its value.

The target is a piecewise function of ``x`` in [-3, 3] with jumps at -1 and 1::

    f(x) = sin(2 x)          for x < -1       (piece 0)
           1 - 2 x^2         for -1 <= x < 1  (piece 1)
           0.5 x - 1.5       for x >= 1       (piece 2)

The model has three small MLP "experts" (1 -> hidden -> 1, tanh). A branch with a selector on
the real value of ``x`` routes every input through exactly one of them, so each expert only ever
sees (and learns) its own piece. One build handles a whole mini-batch: a loop steps through the
examples and the branch decides anew in every iteration. In plain Python::

    predictions = []
    for x_t in xs:                                   # loop.step(xs): one iteration per example
        k = 0 if x_t < -1 else (1 if x_t < 1 else 2) # the selector, run on the real value
        predictions.append(experts[k](x_t))          # only expert k is built for this example
    loss = mean((stack(predictions) - ys) ** 2)

Only the chosen expert is built, so only it receives a gradient: an expert that no example in a
batch chose has ``.grad is None`` after backward, and the optimiser leaves it untouched.
``cg.choice(branch, (t,))`` tells which expert example ``t`` used.

Run: ``python examples/routing_branch.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress

BOUNDS = (-1.0, 1.0)  # the pieces' boundaries
LOW, HIGH = -3.0, 3.0
PIECES = ("sin(2x)", "1 - 2x^2", "0.5x - 1.5")


def target(x: np.ndarray) -> np.ndarray:
    """The piecewise function to fit."""
    return np.select([x < BOUNDS[0], x < BOUNDS[1]], [np.sin(2 * x), 1 - 2 * x**2], 0.5 * x - 1.5)


def region(x_value: np.ndarray) -> int:
    """The selector: which piece (and expert) ``x`` belongs to, from its real value."""
    return int(np.searchsorted(BOUNDS, x_value.item(), side="right"))


def build_model(hidden: int, seed: int) -> tuple[vg.VirtualGraph, dict]:
    """Input ``x`` (N, 1, 1), one example per loop iteration; ``y`` (N, 1, 1), the targets."""
    g = vg.VirtualGraph(seed=seed, name="routing")
    xs = g.input("x", shape=(None, 1, 1))
    ys = g.input("y", shape=(None, 1, 1))
    experts = [(nn.Linear(g, 1, hidden, f"expert{k}.in"), nn.Linear(g, hidden, 1, f"expert{k}.out"))
               for k in range(len(PIECES))]  # fmt: skip
    with g.loop(name="examples") as loop:
        x_t = loop.step(xs, name="x_t")
        options = [out(vg.tanh(inp(x_t))) for inp, out in experts]  # declared, built only if chosen
        pred = g.branch(region, options=options, keys=[x_t], name="route")
    preds = loop.stack(pred, name="preds")
    loss = losses.mse_loss(preds, ys)
    return g, {"loop": loop, "branch": pred, "loss": loss, "preds": preds, "experts": experts}


def expert_params(g: vg.VirtualGraph, k: int) -> list[str]:
    return [name for name in g.params if name.startswith(f"expert{k}.")]


def batch(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"x": x.reshape(-1, 1, 1), "y": target(x).reshape(-1, 1, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--batch", type=int, default=24, help="examples per step")
    parser.add_argument("--hidden", type=int, default=12, help="hidden units per expert")
    parser.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    Progress.add_option(parser)
    args = parser.parse_args(argv)

    g, outs = build_model(args.hidden, args.seed)
    loop, branch = outs["loop"], outs["branch"]
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    x_test = np.linspace(LOW, HIGH, 61)
    baseline = float(np.var(target(x_test)))  # MSE of predicting the mean

    def evaluate() -> tuple[float, vg.UnrolledGraph]:
        g.eval()
        try:
            cg = g.build(batch(x_test), outs["loss"])
            return float(cg.forward()), cg
        finally:
            g.train()

    print(
        f"Piecewise target on [{LOW:g}, {HIGH:g}]: {', '.join(PIECES)} "
        f"(boundaries {BOUNDS[0]:g}, {BOUNDS[1]:g})"
    )
    print(
        f"{len(PIECES)} experts with {args.hidden} hidden units each; baseline (predict the mean): "
        f"MSE {baseline:.3f}"
    )
    first, _ = evaluate()
    print(f"  step {0:4d}/{args.steps}  held-out MSE {first:.4f}")
    history = [(0, first)]
    report_every = max(1, args.steps // 10)
    with Progress(args.steps, desc="train", mode=args.progress, every=report_every) as progress:
        for step in range(1, args.steps + 1):
            # One build per mini-batch; the branch decides anew for every example (loop iteration).
            cg = g.build(batch(rng.uniform(LOW, HIGH, args.batch)), outs["loss"])
            cg.backward(outs["loss"])
            chosen = {cg.choice(branch, (t,)) for t in range(cg.trip_count(loop))}
            for k in set(range(len(PIECES))) - chosen:  # (rare with a full batch) no example chose expert k:
                assert all(
                    g.params[name].grad is None for name in expert_params(g, k)
                )  # no gradient, no update
            opt.step()
            opt.zero_grad()
            if step % report_every == 0 or step == args.steps:
                mse, _ = evaluate()
                history.append((step, mse))
                progress.update(log=True, **{"held-out MSE": mse})
            else:
                progress.update()

    final, cg = evaluate()
    choices = np.array([cg.choice(branch, (t,)) for t in range(len(x_test))])
    preds = cg.forward(outs["preds"]).reshape(-1)
    print("\nRouting of the held-out inputs (cg.choice(branch, (t,))):")
    usage = {}
    for k, piece in enumerate(PIECES):
        mask = choices == k
        usage[k] = int(mask.sum())
        xs = x_test[mask]
        err = float(np.mean((preds[mask] - target(xs)) ** 2)) if mask.any() else float("nan")
        print(
            f"  expert {k} ({piece:>10}): {usage[k]:2d} inputs, x in [{xs.min():5.2f}, {xs.max():5.2f}], "
            f"MSE {err:.4f}"
        )
    print(
        f"  sample keys: {', '.join(str(cg.node(branch, (t,)).key) for t in (0, 30, 60))} "
        f"(Branch:id@example), options {', '.join(str(choices[t]) for t in (0, 30, 60))}"
    )

    # Gradients reach only the chosen expert: a batch from piece 0 alone.
    cg = g.build(batch(np.array([-2.5, -2.0, -1.5])), outs["loss"])
    cg.backward(outs["loss"])
    grads = {k: [g.params[name].grad is not None for name in expert_params(g, k)] for k in range(len(PIECES))}
    print(
        "\nBackward on three inputs from piece 0 only: parameters with a gradient per expert: "
        + ", ".join(f"expert {k}: {sum(v)}/{len(v)}" for k, v in grads.items())
    )
    g.params.zero_grad()
    verdict = "each expert fitted its own piece" if final < 0.1 * baseline else "NOT fitted"
    print(f"\nHeld-out MSE {final:.4f} vs baseline {baseline:.3f} (first {first:.3f}): {verdict}")
    only_chosen = all(grads[0]) and not any(grads[1]) and not any(grads[2])
    return {
        "first_loss": first,
        "final_loss": final,
        "baseline": baseline,
        "history": history,
        "usage": usage,
        "grads_only_chosen": only_chosen,
    }


if __name__ == "__main__":
    main()
