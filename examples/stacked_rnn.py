"""Nested loops: a stacked (multi-layer) RNN as a loop over layers around a loop over time.

Each layer is an Elman RNN that reads the whole output sequence of the layer below. The outer
loop runs over layers and carries the current sequence; the inner loop runs over time inside each
layer. The layer's weights are declared in the *outer* body, so they are untied across layers
(one set per layer, ``"layer.W_h@0"``, ``"layer.W_h@1"`` …) but shared by every time step of
that layer. In plain Python::

    seq = xs @ W_in + b_in                   # (time, batch, hidden)
    for l in range(layers):                  # outer loop: g.loop(times=layers)
        W_x[l], W_h[l], b[l] = new weights   # declared in the outer body: untied per layer
        h, outs = h0, []
        for x_t in seq:                      # inner loop: steps through the carried sequence
            h = tanh(x_t @ W_x[l] + h @ W_h[l] + b[l])
            outs.append(h)
        seq = stack(outs)                    # the next layer's input
    logits = seq @ W_out + b_out             # a prediction at every time step

Every unrolled node has a two-level iteration path ``idx = (layer, time)``: ``Tanh:1@1.5`` is the
tanh of layer 1 at time step 5.

The task: a stream of random bits; at every step, output the parity of the last ``--window`` bits
(default 5: ``x[t] XOR x[t-1] XOR ... XOR x[t-4]``, bits before the start counting as 0). That
needs memory of several steps and a non-linear combination (parity is the classic task a linear
model cannot do); guessing gives 50% accuracy.

Run: ``python examples/stacked_rnn.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress


def parity_batch(rng: np.random.Generator, batch: int, steps: int, window: int) -> tuple[np.ndarray, ...]:
    """Bits (steps, batch, 1) and labels (steps, batch): the parity of ``x[t-window+1 .. t]``."""
    bits = rng.integers(0, 2, size=(steps, batch))
    counts = np.cumsum(bits, axis=0)
    counts[window:] -= counts[:-window]  # bits set in the window ending at t (earlier bits are 0)
    labels = counts % 2
    return bits[..., None].astype(np.float64), labels


def build_model(layers: int, hidden: int, seed: int) -> tuple[vg.VirtualGraph, dict]:
    """Inputs: ``x`` (time, batch, 1), ``y`` (time, batch) integer labels, ``h0`` (batch, hidden)."""
    g = vg.VirtualGraph(seed=seed, name="stacked-rnn")
    xs = g.input("x", shape=(None, None, 1))
    ys = g.input("y", shape=(None, None))
    h0 = g.input("h0", shape=(None, hidden))
    embed = nn.Linear(g, 1, hidden, "in")
    readout = nn.Linear(g, hidden, 2, "out")
    projected = embed(xs)  # (time, batch, hidden); a carry's initial value comes from outside the body
    with g.loop(times=layers, name="layers") as layer_loop:
        seq = layer_loop.carry(projected, name="seq")
        cell = nn.RNNCell(g, hidden, hidden, "layer")  # declared in the outer body: untied per layer
        with g.loop(name="time") as time_loop:
            x_t = time_loop.step(seq, name="x_t")
            h = time_loop.carry(h0, name="h")
            h_new = cell(x_t, h)  # shared by every time step of this layer
            time_loop.update(h, h_new)
        layer_loop.update(seq, time_loop.stack(h_new, name="hs"))
    top = layer_loop.final(seq, name="top")  # (time, batch, hidden)
    logits = readout(top)  # (time, batch, 2)
    loss = losses.cross_entropy(logits, ys)
    return g, {
        "loss": loss,
        "logits": logits,
        "h_new": h_new,
        "layer_loop": layer_loop,
        "time_loop": time_loop,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2, help="stacked layers")
    parser.add_argument("--hidden", type=int, default=16, help="hidden units per layer")
    parser.add_argument("--window", type=int, default=5, help="parity of this many last bits")
    parser.add_argument("--seq", type=int, default=12, help="sequence length")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    Progress.add_option(parser)
    args = parser.parse_args(argv)

    g, outs = build_model(args.layers, args.hidden, args.seed)
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    x_test, y_test = parity_batch(np.random.default_rng(args.seed + 1000), 256, args.seq, args.window)

    def evaluate() -> tuple[float, float]:
        g.eval()
        try:
            test_feed = {"x": x_test, "y": y_test, "h0": np.zeros((256, args.hidden))}
            cg = g.build(test_feed, [outs["loss"], outs["logits"]])
            loss, logits = cg.forward()
            return float(loss), float(np.mean(logits.argmax(-1) == y_test))
        finally:
            g.train()

    h0 = np.zeros((args.batch, args.hidden))
    x, y = parity_batch(rng, args.batch, args.seq, args.window)
    cg = g.build({"x": x, "y": y, "h0": h0}, outs["loss"])  # the first build creates the untied copies
    print(
        f"Stacked RNN: {args.layers} layers x {args.hidden} hidden units, sequences of {args.seq} bits, "
        f"task: parity of the last {args.window} bits"
    )
    print(f"Parameters ({sum(p.value.size for p in g.params.parameters())} values): {', '.join(g.params)}")
    times = sorted({0, min(5, args.seq - 1)})
    tanh_keys = [str(cg.node(outs["h_new"], (layer, t)).key) for layer in range(args.layers) for t in times]
    print(
        f"Two-level keys <type:id@layer.time>: {', '.join(tanh_keys)}; "
        f"trip counts: layers {cg.trip_count(outs['layer_loop'])}, "
        f"time in layer 1 {cg.trip_count(outs['time_loop'], (min(1, args.layers - 1),))}; {len(cg)} nodes"
    )
    first_loss, first_acc = evaluate()
    print(f"  step {0:4d}/{args.steps}  held-out loss {first_loss:.3f}  accuracy {first_acc:.1%}")
    history = [(0, first_loss, first_acc)]
    report_every = max(1, args.steps // 10)
    with Progress(args.steps, desc="train", mode=args.progress, every=report_every) as progress:
        for step in range(1, args.steps + 1):
            if step > 1:
                x, y = parity_batch(rng, args.batch, args.seq, args.window)
                cg = g.build({"x": x, "y": y, "h0": h0}, outs["loss"])  # unroll layers x time
            cg.backward(outs["loss"])
            optim.clip_grad_norm_(g.params, 5.0)
            opt.step()
            opt.zero_grad()
            if step % report_every == 0 or step == args.steps:
                loss, acc = evaluate()
                history.append((step, loss, acc))
                progress.update(log=True, **{"held-out loss": loss, "accuracy": f"{acc:.1%}"})
            else:
                progress.update()

    final_loss, final_acc = history[-1][1:]
    print(
        f"\nHeld-out accuracy {final_acc:.1%} (chance 50%), cross-entropy {final_loss:.3f} "
        f"(chance {np.log(2):.3f}): {'learned' if final_acc > 0.9 else 'NOT learned'}"
    )
    return {
        "first_loss": first_loss,
        "final_loss": final_loss,
        "first_accuracy": first_acc,
        "final_accuracy": final_acc,
        "history": history,
        "keys": tanh_keys,
    }


if __name__ == "__main__":
    main()
