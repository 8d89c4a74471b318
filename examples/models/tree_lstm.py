"""A binary Tree-LSTM over one expression tree, with a cross-entropy loss on every node's value.

The model of ``examples/tree_lstm.py`` (Tai, Socher and Manning's N-ary Tree-LSTM with N = 2,
declared with ``g.recurse``) at drawing size, over one random expression such as
``(3 x 4) + 2``. A model script for ``python -m vgraph render``: ``build()`` returns
``(virtual_graph, feed, outputs)``; the first output is the loss. The unrolled drawing has one
cluster per tree node, children before parents.

    python -m vgraph render examples/models/tree_lstm.py -o tree.svg                  # the model
    python -m vgraph render examples/models/tree_lstm.py -o tree.svg --unrolled       # one tree
    python -m vgraph render examples/models/tree_lstm.py -o tree.png --gradients
    python -m vgraph render examples/models/tree_lstm.py -o tree.svg --unrolled --set leaves=5
"""

import numpy as np

import vgraph as vg
from vgraph import losses, nn

OPS = ("+", "-", "x")
DIGITS = 10
VOCAB = DIGITS + len(OPS)  # tokens: 0-9 the digits, 10 + k the operator OPS[k]
LEAVES, DIM, HIDDEN, MODULUS = 3, 3, 4, 10


def model(dim: int = DIM, hidden: int = HIDDEN) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The Tree-LSTM: at each node ``[i, f_L, f_R, o, u] = x W + [h_L, h_R] U + b``,
    ``c = σ(i) tanh(u) + σ(f_L) c_L + σ(f_R) c_R``, ``h = σ(o) tanh(c)``; zeros for a leaf's
    missing children."""
    H = hidden
    g = vg.VirtualGraph(dtype=np.float64, seed=3, name="binary Tree-LSTM")
    children = g.input("children", (None, 2))
    tokens = g.input("tokens", (None,))
    labels = g.input("labels", (None,))
    emb = nn.Embedding(g, VOCAB, dim, "emb")
    W = g.parameter("W", (dim, 5 * H))
    U = g.parameter("U", (2 * H, 5 * H))
    b = g.parameter("b", (5 * H,))
    head = nn.Linear(g, H, MODULUS, "head")
    zeros = np.zeros(H)
    with g.recurse(children, name="tree") as r:
        x = emb(r.step(tokens, name="token"))
        x.name = "x"
        h, c = r.state(zeros, name="h"), r.state(zeros, name="c")
        z = x @ W + b + vg.concat([r.child(h, 0), r.child(h, 1)], axis=0) @ U
        z.name = "gates (pre)"
        gates = vg.sigmoid(z[: 4 * H])
        gates.name = "σ(i, f_L, f_R, o)"
        i, f_left, f_right, o = (gates[k * H : (k + 1) * H] for k in range(4))
        for node, label in ((i, "i"), (f_left, "f_L"), (f_right, "f_R"), (o, "o")):
            node.name = label
        u = vg.tanh(z[4 * H :])
        u.name = "tanh(u)"
        c_new = i * u + f_left * r.child(c, 0) + f_right * r.child(c, 1)
        c_new.name = "c"
        h_new = o * vg.tanh(c_new)
        h_new.name = "h"
        r.update(h, h_new)
        r.update(c, c_new)
    loss = losses.cross_entropy(head(r.stack(h_new, name="every h")), labels)
    loss.name = "loss"
    return g, loss


def expression_tree(rng: np.random.Generator, n_leaves: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random expression over ``n_leaves`` digits in post-order: (children, tokens, values
    mod 10). Neighbours are merged under a random operator until one tree is left."""
    children = [[-1, -1] for _ in range(n_leaves)]
    tokens = [int(d) for d in rng.integers(0, DIGITS, n_leaves)]
    values = list(tokens)
    row = list(range(n_leaves))
    while len(row) > 1:
        k = int(rng.integers(0, len(row) - 1))
        a, b = row[k], row[k + 1]
        op = int(rng.integers(0, len(OPS)))
        children.append([a, b])
        tokens.append(DIGITS + op)
        values.append((values[a] + values[b], values[a] - values[b], values[a] * values[b])[op] % MODULUS)
        row[k : k + 2] = [len(tokens) - 1]
    kids, toks, vals = postorder(children, tokens, values)
    return np.array(kids), np.array(toks), np.array(vals)


def postorder(children: list[list[int]], tokens: list[int], values: list[int]) -> tuple[list, list, list]:
    """The same tree renumbered in post-order (left subtree, right subtree, node: the order the
    expression is written in, operators after their operands), without recursion."""
    order: list[int] = []
    stack = [(len(tokens) - 1, False)]
    while stack:
        t, expanded = stack.pop()
        a, b = children[t]
        if expanded or a < 0:
            order.append(t)
        else:
            stack.extend([(t, True), (b, False), (a, False)])
    new = {old: i for i, old in enumerate(order)}
    kids = [[new[a], new[b]] if a >= 0 else [-1, -1] for a, b in (children[t] for t in order)]
    return kids, [tokens[t] for t in order], [values[t] for t in order]


def build(leaves: int = LEAVES, dim: int = DIM, hidden: int = HIDDEN, seed: int = 0):
    """The model and one feed: a random expression tree over ``leaves`` digits (``2 * leaves - 1``
    tree nodes). The CLI passes these with ``--set``, e.g. ``--set leaves=6``."""
    g, loss = model(dim, hidden)
    kids, toks, vals = expression_tree(np.random.default_rng(seed), max(1, int(leaves)))
    return g, {"children": kids, "tokens": toks, "labels": vals}, [loss]
