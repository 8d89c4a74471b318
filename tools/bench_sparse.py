#!/usr/bin/env python3
"""Benchmark: row-sparse embedding gradients (``nn.Embedding(..., sparse=True)``) vs dense ones.

Two measurements, float32, vocabulary 20,000 x 128 by default:

* ``update``: one optimiser step on the embedding table alone, given the gradient of one batch of
  tokens (32 sentences x 20 tokens drawn from a Zipf-like distribution over the vocabulary, so
  frequent words repeat): dense gradient + dense step vs row-sparse gradient + row-wise step, for
  SGD, Adagrad and Adam (``lazy=True`` for the sparse one; ``lazy=False`` is also timed: the
  gradient made dense, then dense Adam).
* ``train``: one whole training step of a tagger — embedding, LSTM (hidden 128) over the
  sentence, a linear tag layer (10 tags) at every step, cross-entropy — built anew for each batch:
  build (unroll + forward), backward, optimiser step. Reported: ms per step and the split.

Dense and sparse run in the same process, interleaved (the order alternates every repeat), from
the same initial weights and batches. Before timing, the gradients of the two models on one batch
are checked equal (the sparse one made dense, bit for bit) and, for SGD, the parameters after
three steps; a mismatch aborts with exit status 2. Medians over the repeats.

BLAS runs single-threaded (OPENBLAS_NUM_THREADS=1 unless set), as in tools/bench_rnn.py.

Usage::

    PYTHONPATH=. python3 tools/bench_sparse.py [--quick] [--repeats N] [--vocab V] [--dim D]
                                               [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np

try:
    import vgraph as vg
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.ops import RowSparseGrad

TAGS = 10


def batch_tokens(rng: np.random.Generator, vocab: int, T: int, B: int) -> np.ndarray:
    """A (T, B) batch of token ids, Zipf-like (rank r drawn with probability ~ 1/r)."""
    ranks = np.arange(1, vocab + 1)
    p = 1.0 / ranks
    return rng.choice(vocab, size=(T, B), p=p / p.sum())


# ---------------------------------------------------------------------------- update only

OPTIMISERS = {
    "sgd": lambda p, lazy: optim.SGD(p, lr=0.1),
    "adagrad": lambda p, lazy: optim.Adagrad(p, lr=0.1),
    "adam": lambda p, lazy: optim.Adam(p, lr=1e-3, lazy=lazy),
}


def time_update(vocab: int, dim: int, T: int, B: int, repeats: int) -> list[dict[str, Any]]:
    """ms of one optimiser step on the table, dense vs row-sparse gradient."""
    rng = np.random.default_rng(0)
    tokens = batch_tokens(rng, vocab, T, B).ravel()
    g_rows = rng.standard_normal((tokens.size, dim)).astype(np.float32)
    sparse_grad = RowSparseGrad(tokens, g_rows, (vocab, dim))
    dense_grad = sparse_grad.dense()
    rows = []
    for name, make in OPTIMISERS.items():
        variants = {"dense": (dense_grad, False), "sparse": (sparse_grad, True)}
        if name == "adam":
            variants["sparse, lazy=False"] = (sparse_grad, False)
        cases = {}
        for label, (grad, lazy) in variants.items():
            cg = vg.ComputeGraph(np.float32)
            W = cg.parameter(rng.standard_normal((vocab, dim)), name="W", sparse_grad=True)
            cases[label] = (W, make([W], lazy), grad)
        times: dict[str, list[float]] = {k: [] for k in cases}
        labels = list(cases)
        for rep in range(repeats + 2):
            for label in labels if rep % 2 == 0 else labels[::-1]:
                W, opt, grad = cases[label]
                W.grad = grad
                t0 = time.perf_counter()
                opt.step()
                if rep >= 2:
                    times[label].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"optimizer": name, "distinct_rows": int(sparse_grad.indices.size)}
        row.update({f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- whole training step


def make_tagger(sparse: bool, vocab: int, dim: int, hidden: int, seed: int = 0):
    g = vg.VirtualGraph(dtype=np.float32, seed=seed)
    tok = g.input("tok", (None, None))
    tags = g.input("tags", (None, None))
    h0 = g.input("h0", (None, hidden))
    emb = nn.Embedding(g, vocab, dim, "emb", sparse=sparse, init=nn.normal(0.1))
    cell = nn.LSTMCell(g, dim, hidden, "lstm")
    head = nn.Linear(g, hidden, TAGS, "head")
    x = emb(tok)  # (T, B, dim): one look-up for the whole batch, before the loop
    with g.loop() as L:
        x_t = L.step(x)
        h, c = L.carry(h0, name="h"), L.carry(h0, name="c")
        h_new, c_new = cell(x_t, (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    loss = losses.cross_entropy(head(L.stack(h_new)), tags)
    return g, loss


class Trainer:
    def __init__(self, sparse: bool, opt_name: str, vocab: int, dim: int, hidden: int) -> None:
        self.g, self.loss = make_tagger(sparse, vocab, dim, hidden)
        self.opt = OPTIMISERS[opt_name](self.g.params, sparse)
        self.split: dict[str, list[float]] = {"build": [], "backward": [], "update": []}

    def step(self, fd: dict[str, np.ndarray], record: bool) -> None:
        t0 = time.perf_counter()
        cg = self.g.build(fd, self.loss)
        t1 = time.perf_counter()
        self.opt.zero_grad()
        cg.backward(self.loss)
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        if record:
            for k, dt in zip(self.split, (t1 - t0, t2 - t1, t3 - t2)):
                self.split[k].append(dt)


def batches(vocab: int, T: int, B: int, hidden: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        {
            "tok": batch_tokens(rng, vocab, T, B),
            "tags": rng.integers(0, TAGS, (T, B)),
            "h0": np.zeros((B, hidden), dtype=np.float32),
        }
        for _ in range(n)
    ]


def check_equal(vocab: int, dim: int, hidden: int, T: int, B: int) -> None:
    """The sparse model's gradient (made dense) equals the dense model's, and SGD training of the
    two stays bit for bit equal; exit 2 otherwise."""
    fds = batches(vocab, T, B, hidden, 3)
    runs = {s: Trainer(s, "sgd", vocab, dim, hidden) for s in (False, True)}
    grads = {}
    for s, r in runs.items():
        cg = r.g.build(fds[0], r.loss)
        cg.backward(r.loss)
        grads[s] = {k: np.asarray(p.grad) for k, p in r.g.params.items()}
        kind = type(r.g.params["emb.W"].grad)
        r.g.params.zero_grad()
    ok = kind is RowSparseGrad  # the sparse model's, the last one run
    ok = ok and all(np.array_equal(grads[False][k], grads[True][k]) for k in grads[False])
    for r in runs.values():
        for fd in fds:
            r.step(fd, record=False)
    ok = ok and all(
        np.array_equal(runs[False].g.params[k].value, runs[True].g.params[k].value) for k in grads[False]
    )
    if not ok:
        print("MISMATCH between the dense and the sparse model", file=sys.stderr)
        sys.exit(2)


def time_train(
    opt_name: str, vocab: int, dim: int, hidden: int, T: int, B: int, repeats: int
) -> dict[str, Any]:
    runs = {s: Trainer(s, opt_name, vocab, dim, hidden) for s in (False, True)}
    fds = batches(vocab, T, B, hidden, repeats + 2)
    for rep, fd in enumerate(fds):
        for s in (False, True) if rep % 2 == 0 else (True, False):
            runs[s].step(fd, record=rep >= 2)
    row: dict[str, Any] = {"optimizer": opt_name + (" (lazy for sparse)" if opt_name == "adam" else "")}
    for s, r in runs.items():
        tag = "sparse" if s else "dense"
        med = {k: statistics.median(v) * 1e3 for k, v in r.split.items()}
        row[f"{tag}_ms"] = statistics.median(sum(parts) for parts in zip(*r.split.values())) * 1e3
        row.update({f"{tag}_{k}_ms": v for k, v in med.items()})
    row["speedup"] = row["dense_ms"] / row["sparse_ms"]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 15, 3 with --quick)")
    ap.add_argument("--vocab", type=int, default=20_000, help="vocabulary size (rows of the table)")
    ap.add_argument("--dim", type=int, default=128, help="embedding size")
    ap.add_argument("--hidden", type=int, default=128, help="LSTM hidden size of the training task")
    ap.add_argument("--tokens", default="20,32", help="T,B: sentence length and batch size")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    vocab, dim, hidden = args.vocab, args.dim, args.hidden
    if args.quick:
        vocab, dim, hidden = min(vocab, 2000), min(dim, 32), min(hidden, 32)
    T, B = (int(v) for v in args.tokens.split(","))
    repeats = args.repeats or (3 if args.quick else 15)
    check_equal(vocab, dim, hidden, 5, 4)
    out: dict[str, Any] = {"vocab": vocab, "dim": dim, "hidden": hidden, "T": T, "B": B}

    out["update"] = time_update(vocab, dim, T, B, repeats)
    print(f"optimiser step on the {vocab} x {dim} table, gradient of {T}x{B} tokens")
    print(f"{'optimiser':10} {'rows':>5} {'dense ms':>9} {'sparse ms':>10} {'speed-up':>8}  other")
    for r in out["update"]:
        other = f"sparse, lazy=False: {r['sparse, lazy=False_ms']:.2f} ms" if r["optimizer"] == "adam" else ""
        print(
            f"{r['optimizer']:10} {r['distinct_rows']:5d} {r['dense_ms']:9.2f} {r['sparse_ms']:10.2f} "
            f"{r['dense_ms'] / r['sparse_ms']:7.1f}x  {other}"
        )

    out["train"] = [time_train(o, vocab, dim, hidden, T, B, repeats) for o in ("adam", "sgd")]
    print(f"\nwhole training step (tagger: embedding {dim}, LSTM {hidden}, {TAGS} tags, T={T}, B={B})")
    print(f"{'optimiser':26} {'':6} {'total ms':>9} {'build':>7} {'backward':>9} {'update':>7}")
    for r in out["train"]:
        for tag in ("dense", "sparse"):
            print(
                f"{r['optimizer'] if tag == 'dense' else '':26} {tag:6} {r[f'{tag}_ms']:9.2f} "
                f"{r[f'{tag}_build_ms']:7.2f} {r[f'{tag}_backward_ms']:9.2f} {r[f'{tag}_update_ms']:7.2f}"
            )
        print(f"{'':26} speed-up {r['speedup']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
