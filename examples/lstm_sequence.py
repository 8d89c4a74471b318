"""An LSTM (or GRU) learns the adding problem by backpropagation through time.

The adding problem (Hochreiter & Schmidhuber, 1997) is a classic memory test. Each input is a
sequence of ``(value, marker)`` pairs: values are uniform in [0, 1], exactly two markers are 1
(one in the first half of the sequence, one in the second). The target is the sum of the two
marked values. Predicting the constant 1.0 (the mean target) gives an MSE of 1/6 ~ 0.167; to do
better the network has to notice the markers, remember the first marked value for many steps and
add the second. Data is generated with numpy (nothing is downloaded).

The model, in plain Python (``cell`` is ``nn.LSTMCell`` or ``nn.GRUCell``, declared once
outside the loop, so every time step uses the same weights)::

    h, c = zeros, zeros
    for x_t in x:                      # x: (time, batch, 2); one iteration per time step
        h, c = cell(x_t, (h, c))       # GRU: h = cell(x_t, h)
    prediction = h @ W_out + b_out     # (batch, 1)
    loss = mean((prediction - target) ** 2)

Each training step unrolls this for a fresh batch (``g.build``), backpropagates through every
time step (``cg.backward``) and updates with Adam. Held-out MSE is reported against the 0.167
baseline.

Run: ``python examples/lstm_sequence.py`` (``--cell gru``; ``--help`` for options).
"""

from __future__ import annotations

import argparse

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress

BASELINE = 1.0 / 6.0  # MSE of always predicting 1.0: the variance of the sum of two U(0, 1)


def adding_batch(rng: np.random.Generator, batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` adding-problem sequences: inputs (steps, batch, 2) and targets (batch, 1)."""
    values = rng.random((steps, batch))
    markers = np.zeros((steps, batch))
    half = steps // 2
    first = rng.integers(0, half, size=batch)
    second = rng.integers(half, steps, size=batch)
    cols = np.arange(batch)
    markers[first, cols] = 1.0
    markers[second, cols] = 1.0
    x = np.stack([values, markers], axis=-1)
    y = (values[first, cols] + values[second, cols])[:, None]
    return x, y


def build_model(cell_type: str, hidden: int, seed: int) -> tuple[vg.VirtualGraph, dict[str, vg.VirtualNode]]:
    """The recurrent regressor as a virtual graph. Inputs: ``x`` (time, batch, 2), ``y`` (batch, 1),
    ``h0`` (batch, hidden) — zeros, also used as the LSTM's initial cell state."""
    g = vg.VirtualGraph(seed=seed, name=f"{cell_type}-adding")
    x = g.input("x", shape=(None, None, 2))
    y = g.input("y", shape=(None, 1))
    h0 = g.input("h0", shape=(None, hidden))
    if cell_type == "lstm":
        cell = nn.LSTMCell(g, 2, hidden, name="lstm")
    else:
        cell = nn.GRUCell(g, 2, hidden, name="gru")
    readout = nn.Linear(g, hidden, 1, name="out")
    with g.loop(name="time") as loop:
        x_t = loop.step(x, name="x_t")
        h = loop.carry(h0, name="h")
        if cell_type == "lstm":
            c = loop.carry(h0, name="c")
            h_new, c_new = cell(x_t, (h, c))
            loop.update(c, c_new)
        else:
            h_new = cell(x_t, h)
        loop.update(h, h_new)
    pred = readout(loop.final(h, name="h_T"))
    return g, {"loss": losses.mse_loss(pred, y), "pred": pred}


def evaluate(g: vg.VirtualGraph, outs: dict, x: np.ndarray, y: np.ndarray, hidden: int) -> float:
    """MSE on a held-out set (eval mode: nothing is recorded for backward)."""
    g.eval()
    try:
        cg = g.build({"x": x, "y": y, "h0": np.zeros((x.shape[1], hidden))}, outs["loss"])
        return float(cg.forward())
    finally:
        g.train()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--cell", choices=("lstm", "gru"), default="lstm", help="the cell")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seq", type=int, default=12, help="sequence length")
    parser.add_argument("--hidden", type=int, default=24, help="hidden units")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    Progress.add_option(parser)
    args = parser.parse_args(argv)

    g, outs = build_model(args.cell, args.hidden, args.seed)
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    x_test, y_test = adding_batch(np.random.default_rng(args.seed + 1000), 512, args.seq)
    h0 = np.zeros((args.batch, args.hidden))
    n_params = sum(p.value.size for p in g.params.parameters())
    print(
        f"Adding problem, sequences of {args.seq}: {args.cell.upper()} with {args.hidden} hidden units, "
        f"{n_params} parameters"
    )
    print(f"Baseline (always predict 1.0): MSE {BASELINE:.3f}")
    first = evaluate(g, outs, x_test, y_test, args.hidden)
    print(f"  step {0:5d}/{args.steps}  held-out MSE {first:.4f}")

    history = [(0, first)]
    running = None
    report_every = max(1, args.steps // 10)
    with Progress(args.steps, desc="train", mode=args.progress, every=report_every) as progress:
        for step in range(1, args.steps + 1):
            x, y = adding_batch(rng, args.batch, args.seq)
            cg = g.build({"x": x, "y": y, "h0": h0}, outs["loss"])  # unroll over args.seq steps
            loss = cg.backward(outs["loss"])  # BPTT
            optim.clip_grad_norm_(g.params, 1.0)
            opt.step()
            opt.zero_grad()
            running = loss if running is None else 0.9 * running + 0.1 * loss
            report = step % report_every == 0 or step == args.steps
            if report:
                test = evaluate(g, outs, x_test, y_test, args.hidden)
                history.append((step, test))
            progress.update(
                log=report, **{"train MSE": running, **({"held-out MSE": history[-1][1]} if report else {})}
            )

    final = history[-1][1]
    ratio = final / BASELINE
    verdict = "learned to add the marked values" if ratio < 0.5 else "did NOT clearly beat the baseline"
    print(
        f"\nHeld-out MSE {final:.4f} vs baseline {BASELINE:.3f} ({ratio:.1%} of the baseline): the "
        f"{args.cell.upper()} {verdict}"
    )
    return {"first_loss": first, "final_loss": final, "baseline": BASELINE, "history": history}


if __name__ == "__main__":
    main()
