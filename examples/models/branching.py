"""A recurrent cell that picks one of two updates per time step from the data (a BranchNode).

At step t the selector looks at the input slice ``x_t``: if its mean is positive the state is
updated by a tanh cell (option 0), otherwise by a gated leak (option 1). Only the chosen option is
built in each iteration; the unrolled drawing shows which one ("option k") and draws the key edge
(``x_t`` -> Branch) dashed. A model script for ``python -m vgraph render``.
"""

import numpy as np

import vgraph as vg

T, B, I, H = 6, 2, 3, 4


def positive_mean(x_t: np.ndarray) -> int:
    """Option 0 when the slice's mean is positive, else option 1."""
    return 0 if float(np.mean(x_t)) > 0 else 1


def model(batch: int = B, hidden: int = H) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    B, H = batch, hidden
    g = vg.VirtualGraph(dtype=np.float64, seed=2, name="branching RNN")
    x = g.input("x", shape=(None, None, I))
    Wx = g.parameter("Wx", (I, H))
    Wh = g.parameter("Wh", (H, H), init="orthogonal")
    Wg = g.parameter("Wg", (I, H))
    h0 = g.constant(np.zeros((B, H)), name="h0")
    with g.loop(name="time") as loop:
        xt = loop.step(x, name="x_t")
        h = loop.carry(h0, name="h")
        cell = vg.tanh(xt @ Wx + h @ Wh)
        cell.name = "tanh cell"
        leak = h * vg.sigmoid(xt @ Wg)
        leak.name = "gated leak"
        h_new = g.branch(positive_mean, [cell, leak], keys=[xt], name="pick update")
        loop.update(h, h_new)
    h_T = loop.final(h)
    loss = (h_T**2).mean()
    loss.name = "loss"
    return g, loss


def build(steps: int = T, batch: int = B, hidden: int = H, seed: int = 3):
    """The model and one feed of ``steps`` time steps (``--set steps=50`` on the command line)."""
    g, loss = model(batch, hidden)
    rng = np.random.default_rng(seed)
    return g, {"x": rng.standard_normal((steps, batch, I))}, [loss]
