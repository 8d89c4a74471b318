"""A two-layer RNN written as nested loops: an outer loop over layers with untied (per-layer)
weights, an inner loop over time steps. In the unrolled drawing each layer is a cluster ("t=0",
"t=1") holding that layer's time steps ("t=0.0", "t=0.1" …); the per-layer weights sit inside
their layer, the shared read-out weight outside. A model script for ``python -m vgraph render``.
"""

import numpy as np

import vgraph as vg

T, B, H, LAYERS = 4, 2, 3, 2


def model(layers: int = LAYERS, batch: int = B, hidden: int = H) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    B, H, LAYERS = batch, hidden, layers
    g = vg.VirtualGraph(dtype=np.float64, seed=3, name="stacked RNN")
    x = g.input("x", shape=(None, None, H))
    Wo = g.parameter("Wo", (H, 1))
    h0 = g.constant(np.zeros((B, H)), name="h0")
    with g.loop(times=LAYERS, name="layers") as layers:
        seq = layers.carry(x, name="seq")
        Wx = g.parameter("Wx", (H, H))  # untied: one per layer
        Wh = g.parameter("Wh", (H, H), init="orthogonal")
        with g.loop(name="time") as time:
            xt = time.step(seq, name="x_t")
            h = time.carry(h0, name="h")
            h_new = vg.tanh(xt @ Wx + h @ Wh)
            h_new.name = "h_t"
            time.update(h, h_new)
        layers.update(seq, time.stack(h_new, name="layer output"))
    top = layers.final(seq)
    loss = (top[-1] @ Wo).mean()
    loss.name = "loss"
    return g, loss


def build(steps: int = T, layers: int = LAYERS, batch: int = B, hidden: int = H, seed: int = 4):
    """The model and one feed of ``steps`` time steps through ``layers`` layers
    (``--set steps=20 --set layers=3`` on the command line)."""
    g, loss = model(layers, batch, hidden)
    rng = np.random.default_rng(seed)
    return g, {"x": rng.standard_normal((steps, batch, hidden))}, [loss]
