"""Untied depth: one loop over layers, with per-layer weights (untied) or one weight set (tied).

A deep residual MLP is a loop over layers. A parameter declared inside a loop body is *untied* by
default: every iteration gets its own copy (``"layer.W@0"``, ``"layer.W@1"`` …), i.e. a stack of
distinct layers. With ``share=True`` the one declaration is *tied*: every iteration uses the same
weights (a weight-shared, "recurrent" depth). The two models below differ only in that flag::

    h = tanh(x @ W_in + b_in)
    for l in range(layers):                            # g.loop(times=layers)
        W, b = (W_l, b_l) if untied else (W_0, b_0)    # g.parameter(..., share=tied), in the body
        h = h + tanh(h @ W + b)                        # residual block
    y_hat = h @ W_out + b_out
    loss = mean((y_hat - y) ** 2)

Both are trained identically (Adam, full batch) on the same regression task: a smooth but wiggly
function of two inputs, ``y = sin(3 x1) cos(2 x2) + 0.5 x1 x2``, sampled at random points.
The untied model has ``layers`` times the loop's parameters, read back from ``g.params``, and
fits the function better.

Run: ``python examples/untied_depth.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress


def target(x: np.ndarray) -> np.ndarray:
    return (np.sin(3 * x[:, 0]) * np.cos(2 * x[:, 1]) + 0.5 * x[:, 0] * x[:, 1])[:, None]


def build_model(tied: bool, layers: int, hidden: int, seed: int) -> tuple[vg.VirtualGraph, dict]:
    """Inputs ``x`` (batch, 2) and ``y`` (batch, 1)."""
    g = vg.VirtualGraph(seed=seed, name="tied" if tied else "untied")
    x = g.input("x", shape=(None, 2))
    y = g.input("y", shape=(None, 1))
    embed = nn.Linear(g, 2, hidden, "in")
    readout = nn.Linear(g, hidden, 1, "out")
    h_in = vg.tanh(embed(x))
    with g.loop(times=layers, name="depth") as loop:
        h = loop.carry(h_in, name="h")
        block = nn.Linear(g, hidden, hidden, "layer", share=tied)  # in the body: untied unless share=True
        loop.update(h, h + vg.tanh(block(h)))
    pred = readout(loop.final(h))
    return g, {"loss": losses.mse_loss(pred, y), "loop": loop}


def count(g: vg.VirtualGraph, prefix: str = "") -> int:
    """Number of parameter values in ``g.params`` whose name starts with ``prefix``."""
    return sum(g.params[name].value.size for name in g.params if name.startswith(prefix))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6, help="depth of the loop")
    parser.add_argument("--hidden", type=int, default=16, help="width")
    parser.add_argument("--points", type=int, default=256, help="training points")
    parser.add_argument("--steps", type=int, default=600, help="full-batch training steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    Progress.add_option(parser)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    x_train = rng.uniform(-1.5, 1.5, size=(args.points, 2))
    x_test = rng.uniform(-1.5, 1.5, size=(1024, 2))
    train = {"x": x_train, "y": target(x_train)}
    test = {"x": x_test, "y": target(x_test)}
    baseline = float(np.var(test["y"]))  # MSE of predicting the mean

    models = {}
    for kind in ("untied", "tied"):
        g, outs = build_model(kind == "tied", args.layers, args.hidden, args.seed)
        cg = g.build(train, outs["loss"])  # the first build creates the untied per-layer copies
        models[kind] = {"g": g, "outs": outs, "opt": optim.Adam(g.params, lr=args.lr), "cg": cg}

    print(
        f"Residual MLP, a loop of {args.layers} layers of width {args.hidden}, fitting "
        f"y = sin(3 x1) cos(2 x2) + 0.5 x1 x2 on {args.points} points; "
        f"baseline (predict the mean) MSE {baseline:.3f}"
    )
    counts = {}
    for kind, m in models.items():
        g = m["g"]
        counts[kind] = {"total": count(g), "loop": count(g, "layer.")}
        names = [n for n in g.params if n.startswith("layer.")]
        shown = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:4])}, … ({len(names)} entries)"
        c = counts[kind]
        print(f"  {kind:>6}: {c['total']:5d} parameters, {c['loop']:5d} of them in the loop: {shown}")
    ratio = counts["untied"]["loop"] / counts["tied"]["loop"]
    print(f"  the untied loop has {ratio:g}x the tied loop's parameters (layers = {args.layers})")

    def evaluate(m: dict) -> float:
        m["g"].eval()
        try:
            return float(m["g"].build(test, m["outs"]["loss"]).forward())
        finally:
            m["g"].train()

    history = {kind: [(0, evaluate(m))] for kind, m in models.items()}
    print(
        f"  step {0:4d}/{args.steps}  held-out MSE  untied {history['untied'][0][1]:.4f}  "
        f"tied {history['tied'][0][1]:.4f}"
    )
    report_every = max(1, args.steps // 10)
    with Progress(args.steps, desc="train", mode=args.progress, every=report_every) as progress:
        for step in range(1, args.steps + 1):
            for m in models.values():
                cg = m["cg"] if step == 1 else m["g"].build(train, m["outs"]["loss"])
                cg.backward(m["outs"]["loss"])
                m["opt"].step()
                m["opt"].zero_grad()
            if step % report_every == 0 or step == args.steps:
                for kind, m in models.items():
                    history[kind].append((step, evaluate(m)))
                progress.update(log=True, **{f"held-out MSE {kind}": h[-1][1] for kind, h in history.items()})
            else:
                progress.update()

    final = {kind: h[-1][1] for kind, h in history.items()}
    print(
        f"\nFinal held-out MSE: untied {final['untied']:.4f} ({counts['untied']['total']} parameters), "
        f"tied {final['tied']:.4f} ({counts['tied']['total']} parameters), baseline {baseline:.3f}; "
        f"untied/tied = {final['untied'] / final['tied']:.2f}"
    )
    return {
        "counts": counts,
        "final": final,
        "first": {k: h[0][1] for k, h in history.items()},
        "baseline": baseline,
        "history": history,
    }


if __name__ == "__main__":
    main()
