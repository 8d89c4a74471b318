"""Data-parallel training on P ranks against one process on the whole minibatch.

Run: ``mpiexec -n P python tests/mpi_scripts/equivalence.py MODEL [STEPS]`` with MODEL one of
``tbptt`` (truncated BPTT, each rank carrying its share of the streams), ``rnn`` (one build per sequence, dropout, an untied per-iteration bias), ``batched`` (the same
model, each rank autobatching its shard with ``g.build_batch``) or ``tree`` (a Tree-LSTM with a
row-sparse embedding gradient and lazy Adam, the minibatches split by node count). Rank 0 then trains the same model in one process on
the whole minibatches (plain vgraph, no vgraph.distributed) and prints one line
``RESULT {"max_rel_err": ..., "params": ..., "untied": ...}``; the exit status is 1 if a parameter
differs by more than 1e-12 (relative) or the parameter names differ.

``--save PATH``: write the training state after STEPS steps (rank 0) and stop; ``--resume PATH``:
start from it (on any number of ranks) and train to STEPS, then compare with one process that
trained STEPS steps uninterrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import vgraph as vg
from vgraph import distributed as dist
from vgraph import losses, nn, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "models"))
from tree_lstm import VOCAB, expression_tree

H, D, CLASSES = 4, 3, 3
BATCH = 7  # global minibatch: uneven shards on 2 and 3 ranks


def rnn_model() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """An Elman RNN over a (T, D) sequence with a tied W, U, an untied bias per time step
    (``b@t``, created at the first sequence that long), dropout on the state, a linear head."""
    g = vg.VirtualGraph(dtype=np.float64, seed=5)
    xs = g.input("xs", (None, D))
    label = g.input("label", ())
    W = g.parameter("W", (D, H))
    U = g.parameter("U", (H, H))
    drop = nn.Dropout(g, 0.3)
    with g.loop(name="rnn") as L:
        x = L.step(xs)
        h = L.carry(np.zeros(H), name="h")
        b = g.parameter("b", (H,), share=False, init=nn.normal(0.1))
        h_new = vg.tanh(x @ W + h @ U + b)
        L.update(h, drop(h_new))
    head = nn.Linear(g, H, CLASSES, "head")
    loss = losses.cross_entropy(head(L.final(h)).reshape(1, CLASSES), label.reshape(1))
    return g, loss


def rnn_data(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, 9))
        out.append({"xs": rng.normal(size=(t, D)), "label": np.array(rng.integers(0, CLASSES))})
    return out


def tree_model() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The binary Tree-LSTM of examples/models/tree_lstm.py with a sparse embedding."""
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    children = g.input("children", (None, 2))
    tokens = g.input("tokens", (None,))
    labels = g.input("labels", (None,))
    emb = nn.Embedding(g, VOCAB, D, "emb", sparse=True)
    W = g.parameter("W", (D, 5 * H))
    U = g.parameter("U", (2 * H, 5 * H))
    b = g.parameter("b", (5 * H,))
    head = nn.Linear(g, H, 10, "head")
    zeros = np.zeros(H)
    with g.recurse(children, name="tree") as r:
        x = emb(r.step(tokens))
        h, c = r.state(zeros, name="h"), r.state(zeros, name="c")
        z = x @ W + b + vg.concat([r.child(h, 0), r.child(h, 1)], axis=0) @ U
        gates = vg.sigmoid(z[: 4 * H])
        c_new = (
            gates[:H] * vg.tanh(z[4 * H :])
            + gates[H : 2 * H] * r.child(c, 0)
            + gates[2 * H : 3 * H] * r.child(c, 1)
        )
        r.update(h, gates[3 * H :] * vg.tanh(c_new))
        r.update(c, c_new)
    return g, losses.cross_entropy(head(r.stack(h)), labels)


def tree_data(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(12)
    out = []
    for _ in range(n):
        kids, toks, vals = expression_tree(rng, int(rng.integers(1, 5)))
        out.append({"children": kids, "tokens": toks, "labels": vals})
    return out


def backward_each(g: vg.VirtualGraph, loss: vg.VirtualNode, feeds: list, n: int) -> None:
    """Accumulate the gradient of the mean loss over ``n`` examples, one build per example."""
    for feed in feeds:
        g.build(feed, loss).backward(loss, seed=np.array(1.0 / n))


def train(
    model: str, steps: int, comm: dist.Communicator | None, save: str | None = None, resume: str | None = None
) -> vg.VirtualGraph:
    """``steps`` steps; with ``comm`` data-parallel, else one process on the whole minibatch.
    ``save``: write the training state there after ``steps`` steps; ``resume``: start from it."""
    g, loss = tree_model() if model == "tree" else rnn_model()
    data = tree_data(40) if model == "tree" else rnn_data(40)
    inner = optim.Adam(g.params, lr=0.05, lazy=True) if model == "tree" else optim.Adam(g.params, lr=0.05)
    one = dist.Communicator()  # the data order is the same on any number of ranks
    # the tree model (no dropout) balances the ranks' node counts: uneven counts, same gradient
    cost = (lambda f: len(f["tokens"])) if model == "tree" else None
    order = dist.ShardedData(data, comm or one, batch_size=BATCH, seed=1, cost=cost)
    opt: optim.Optimizer | dist.DistributedOptimizer = (
        dist.DistributedOptimizer(inner, g, comm) if comm is not None else inner
    )
    done = 0
    if resume is not None:
        assert comm is not None
        done = dist.load_training_state(comm, g, resume, opt) or 0
    epoch, start = divmod(done, len(order))
    while done < steps:
        for shard in order.batches(epoch, start):
            if done == steps:
                break
            if comm is None:
                feeds = shard.items
                if model == "batched":
                    g.build_batch(feeds, loss).backward()
                else:
                    backward_each(g, loss, feeds, len(feeds))
                opt.step()
            else:
                with dist.sampling(g, shard):
                    if shard.count and model == "batched":
                        g.build_batch(shard.items, loss).backward()
                    elif shard.count:
                        backward_each(g, loss, shard.items, shard.count)
                assert isinstance(opt, dist.DistributedOptimizer)
                opt.step(count=shard.count)
            opt.zero_grad()
            done += 1
        epoch, start = epoch + 1, 0
    if save is not None:
        assert comm is not None
        dist.save_training_state(comm, g, save, opt, step=done)
    return g


def train_tbptt(comm: dist.Communicator | None) -> vg.VirtualGraph:
    """Truncated BPTT over 5 streams of 40 steps in chunks of 5: with ``comm`` each rank carries
    its contiguous share of the streams (``shard_range``) and steps with ``count=`` its number of
    streams; else one process carries all 5."""
    from vgraph.tbptt import chunk_feeds, truncated_bptt

    streams, steps, k, inputs = 5, 40, 5, 2
    g = vg.VirtualGraph(dtype=np.float64, seed=9)
    x = g.input("x", (None, None, inputs))
    y = g.input("y", (None, None, 1))
    h0 = g.input("h0", (None, H))
    cell = nn.RNNCell(g, inputs, H, "rnn")
    head = nn.Linear(g, H, 1, "head")
    with g.loop() as L:
        h = L.carry(h0, name="h")
        h_new = cell(L.step(x), h)
        L.update(h, h_new)
    loss = losses.mse_loss(head(L.stack(h_new)), y)
    rng = np.random.default_rng(21)
    xs = rng.standard_normal((steps, streams, inputs))
    ys = 0.5 * np.roll(xs[..., :1], 1, axis=0)
    lo, hi = (0, streams) if comm is None else dist.shard_range(streams, comm.rank, comm.size)
    inner = optim.Adam(g.params, lr=0.02)
    opt = inner if comm is None else dist.DistributedOptimizer(inner, g, comm, count=hi - lo)
    feeds = chunk_feeds({"x": xs[:, lo:hi], "y": ys[:, lo:hi]}, k, sequences=["x", "y"])
    truncated_bptt(g, feeds, loss, {"h0": L.final(h)}, {"h0": np.zeros((hi - lo, H))}, optimizer=opt)
    return g


def main() -> int:
    model = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else None
    resume = sys.argv[sys.argv.index("--resume") + 1] if "--resume" in sys.argv else None
    comm = dist.init(timeout=60)
    g = train_tbptt(comm) if model == "tbptt" else train(model, steps, comm, save, resume)
    if comm.rank != 0 or save is not None:
        return 0
    ref = train_tbptt(None) if model == "tbptt" else train(model, steps, None)
    names = sorted(g.params)
    if names != sorted(ref.params):
        print(f"RESULT names differ: {names} vs {sorted(ref.params)}")
        return 1
    err = 0.0
    for k in names:
        a, b = g.params[k].value, ref.params[k].value
        err = max(err, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))) if a.size else 0.0)
    untied = sum("@" in k for k in names)
    print(
        "RESULT "
        + json.dumps({"max_rel_err": err, "params": len(names), "untied": untied, "ranks": comm.size})
    )
    return 0 if err <= 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
