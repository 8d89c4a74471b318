"""Autobatching: write the model for one sentence, train on many at once.

A sentence classifier over variable-length sequences: an LSTM reads each sentence's embedded
tokens and a linear layer classifies its last state. The model is written for ONE sentence (no
padding, no masks); ``g.build_batch(sentences, loss)`` builds a minibatch of sentences of different
lengths at once, and runs the copies of each declared node that the sentences need at the same time
as one numpy operation. The task: is the first token of the sentence among the "positive" half of
the vocabulary (the LSTM must carry it to the end).

The script first checks that a batched step gives the same loss and gradients as building the
sentences one at a time, then trains with batches and reports words per second both ways.

    python examples/autobatch.py --steps 150 --batch 16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress


def build_model(vocab: int, embed: int, hidden: int, seed: int) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """One sentence: ``tokens`` (length,) integers and ``label`` (1,) integer -> cross-entropy."""
    g = vg.VirtualGraph(seed=seed, name="sentence classifier")
    tokens = g.input("tokens", shape=(None,))
    label = g.input("label", shape=(1,))
    emb = nn.Embedding(g, vocab, embed, "emb")
    cell = nn.LSTMCell(g, embed, hidden, "lstm")
    out = nn.Linear(g, hidden, 2, "out")
    words = emb(tokens)  # (length, embed)
    with g.loop(name="read") as loop:
        h = loop.carry(np.zeros((1, hidden)), name="h")
        c = loop.carry(np.zeros((1, hidden)), name="c")
        h_new, c_new = cell(loop.step(words).reshape(1, embed), (h, c))
        loop.update(h, h_new)
        loop.update(c, c_new)
    loss = losses.cross_entropy(out(loop.final(h)), label)
    return g, loss


def sentences(rng: np.random.Generator, n: int, vocab: int, min_len: int, max_len: int) -> list[dict]:
    feeds = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, rng.integers(min_len, max_len + 1))
        feeds.append({"tokens": tokens, "label": np.array([int(tokens[0] < vocab // 2)])})
    return feeds


def step_batched(
    g: vg.VirtualGraph, loss: vg.VirtualNode, feeds: list[dict], reduction: str = "sum"
) -> float:
    """The sum (or mean) of the sentences' losses, and its gradient, from one batched build."""
    return g.build_batch(feeds, loss).backward(reduction)


def step_alone(g: vg.VirtualGraph, loss: vg.VirtualNode, feeds: list[dict]) -> float:
    """The same, building the sentences one at a time (gradients accumulate)."""
    return sum(g.build(feed, loss).backward(loss) for feed in feeds)


def largest_difference(
    make: Callable[[], tuple[vg.VirtualGraph, vg.VirtualNode]],
    feeds: list[dict],
    batched: Callable[[vg.VirtualGraph, vg.VirtualNode, list[dict]], float] = step_batched,
) -> float:
    """Largest difference between a ``batched`` step and a one-at-a-time step (the loss, every
    gradient), each on a fresh model from ``make()`` built in float64."""
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        grads = []
        for step in (batched, step_alone):
            g, loss = make()
            value = step(g, loss, feeds)
            grads.append((value, {k: np.array(p.grad) for k, p in g.params.items()}))
        (v1, g1), (v2, g2) = grads
        return max([abs(v1 - v2)] + [float(np.abs(g1[k] - g2[k]).max()) for k in g1])
    finally:
        vg.set_default_dtype(previous)


def check_identical(args: argparse.Namespace) -> float:
    """Largest difference between a batched and a one-at-a-time step, in float64."""
    feeds = sentences(np.random.default_rng(args.seed + 1), 8, args.vocab, args.min_len, args.max_len)
    return largest_difference(lambda: build_model(args.vocab, args.embed, args.hidden, args.seed), feeds)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=150, help="training steps (minibatches)")
    p.add_argument("--batch", type=int, default=16, help="sentences per minibatch")
    p.add_argument("--vocab", type=int, default=40, help="vocabulary size")
    p.add_argument("--embed", type=int, default=16, help="embedding size")
    p.add_argument("--hidden", type=int, default=24, help="LSTM hidden size")
    p.add_argument("--min-len", type=int, default=3, help="shortest sentence")
    p.add_argument("--max-len", type=int, default=12, help="longest sentence")
    p.add_argument("--lr", type=float, default=0.02, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the data")
    Progress.add_option(p)
    p.add_argument(
        "--draw",
        metavar="PATH",
        help="draw the held-out batched build to PATH (one node per group; .dot needs no Graphviz) "
        "and sentence 0 of it, marked with the group of each node, to PATH with suffix -input0",
    )
    args = p.parse_args(argv)

    difference = check_identical(args)
    print(f"batched vs one at a time: largest difference {difference:.1e} (float64)")

    g, loss = build_model(args.vocab, args.embed, args.hidden, args.seed)
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    words = 0
    start = time.perf_counter()
    history: list[float] = []
    with Progress(args.steps, desc="train", mode=args.progress, every=max(1, args.steps // 5)) as progress:
        for _ in range(args.steps):
            feeds = sentences(rng, args.batch, args.vocab, args.min_len, args.max_len)
            opt.zero_grad()
            history.append(step_batched(g, loss, feeds, "mean"))
            opt.step()
            words += sum(len(f["tokens"]) for f in feeds)
            progress.update(loss=float(np.mean(history[-20:])))
    batched_rate = words / (time.perf_counter() - start)

    # The same kind of step, one sentence at a time, for the speed comparison (a few steps).
    probe = [sentences(rng, args.batch, args.vocab, args.min_len, args.max_len) for _ in range(5)]
    start = time.perf_counter()
    for feeds in probe:
        opt.zero_grad()
        step_alone(g, loss, feeds)
    alone_rate = sum(len(f["tokens"]) for feeds in probe for f in feeds) / (time.perf_counter() - start)

    test = sentences(np.random.default_rng(args.seed + 2), 200, args.vocab, args.min_len, args.max_len)
    g.eval()
    batch = g.build_batch(test, loss)
    g.train()
    accuracy = float(np.mean([np.exp(-v) > 0.5 for v in batch.outputs()]))
    if args.draw:
        from pathlib import Path

        from vgraph import render

        small = g.build_batch(test[:4], loss)  # four sentences: a drawing one can read
        path = Path(args.draw)
        render.render(small, path, title="4 sentences, batched: one node per group")
        one = path.with_name(f"{path.stem}-input0{path.suffix}")
        render.render(small.unrolled(0), one, batch_groups=True, fold=None)
        print(f"drew {path} and {one}")
    print(f"held-out accuracy {accuracy:.3f} (chance 0.5)")
    print(
        f"words/s: batched {batched_rate:,.0f}, one at a time {alone_rate:,.0f} ({batched_rate / alone_rate:.1f}x)"
    )
    return {
        "difference": difference,
        "accuracy": accuracy,
        "final_loss": float(np.mean(history[-20:])),
        "speedup": batched_rate / alone_rate,
    }


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
