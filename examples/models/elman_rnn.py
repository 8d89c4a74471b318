"""An Elman RNN over a sequence, with a squared-error loss on the last state's readout.

A model script for ``python -m vgraph render`` (see docs/rendering.md): ``build()`` returns
``(virtual_graph, feed, outputs)``; the first output is the loss.

    python -m vgraph render examples/models/elman_rnn.py -o rnn.svg                 # the model
    python -m vgraph render examples/models/elman_rnn.py -o rnn.svg --unrolled      # one build
    python -m vgraph render examples/models/elman_rnn.py -o rnn.png --gradients     # + BPTT
    python -m vgraph render examples/models/elman_rnn.py -o rnn.svg --all --set steps=50 --set hidden=8
"""

import numpy as np

import vgraph as vg

T, B, I, H, O = 12, 2, 3, 4, 2  # time steps, batch, input, hidden and output sizes


def model(batch: int = B, hidden: int = H) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    B, H = batch, hidden
    g = vg.VirtualGraph(dtype=np.float64, seed=1, name="Elman RNN")
    x = g.input("x", shape=(None, None, I))  # (time, batch, features)
    y = g.input("y", shape=(None, O))
    Wx = g.parameter("Wx", (I, H))
    Wh = g.parameter("Wh", (H, H), init="orthogonal")
    b = g.parameter("b", (H,))
    Wo = g.parameter("Wo", (H, O))
    h0 = g.constant(np.zeros((B, H)), name="h0")
    with g.loop(name="time") as loop:
        xt = loop.step(x, name="x_t")
        h = loop.carry(h0, name="h")
        pre = xt @ Wx + h @ Wh + b
        pre.name = "pre-activation"
        h_new = vg.tanh(pre)
        h_new.name = "h_t"
        loop.update(h, h_new)
    h_T = loop.final(h)
    out = h_T @ Wo
    out.name = "readout"
    loss = ((out - y) ** 2).mean()
    loss.name = "loss"
    return g, loss


def build(steps: int = T, batch: int = B, hidden: int = H, seed: int = 0):
    """The model and one feed: ``steps`` time steps of a batch of ``batch`` sequences; ``hidden``
    units. The CLI passes these with ``--set``, e.g. ``--set steps=50``."""
    g, loss = model(batch, hidden)
    rng = np.random.default_rng(seed)
    feed = {"x": rng.standard_normal((steps, batch, I)), "y": rng.standard_normal((batch, O))}
    return g, feed, [loss]
