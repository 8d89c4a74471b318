#!/usr/bin/env python3
"""Tree-task benchmark: training throughput of a Tree-LSTM on sentiment trees shaped like SST.

The third task of the dynamic-task suite (``tools/bench_dynamic.py``, being written on another
branch: this file reports in its style, and its pieces have the shapes of that file's ``Task``
registry, so that the task can move there as one entry).

``tree_lstm`` — a binary Tree-LSTM sentiment classifier on trees shaped like the Stanford
Sentiment Treebank, generated (nothing is downloaded), float32, Adam (lr 1e-3), BLAS
single-threaded:

* sentences of 1-50 words (gamma-distributed lengths, mean 19, sd 9, clipped), words drawn from
  a vocabulary of 18,000 with Zipf frequencies (id 0 is reserved for inner nodes); each sentence
  gets a random binary tree (neighbouring constituents merged at random until one is left),
  numbered in post-order;
* 5 labels at every node, as SST: each word has a polarity in {-1, 0, +1} (a fixed function of
  its id, most words neutral), a node's score is the sum over its words, the label
  ``clip(score, -2, 2) + 2``;
* the model (Tai, Socher and Manning 2015, constituency Tree-LSTM): embedding 128, hidden 128;
  a leaf computes ``[i, o, u] = x W_leaf + b_leaf``, ``c = σ(i) tanh(u)``, ``h = σ(o) tanh(c)``;
  an inner node ``[i, f_L, f_R, o, u] = [h_L, h_R] U + b``,
  ``c = σ(i) tanh(u) + σ(f_L) c_L + σ(f_R) c_R``, ``h = σ(o) tanh(c)`` — declared once with
  ``g.recurse`` and a two-output branch on the node's kind; a linear layer gives 5 logits at
  every node, the loss is the mean cross-entropy over the nodes. One tree per build.

Columns: ``vgraph`` (a dense embedding gradient and Adam, the default) and ``sparse``
(``nn.Embedding(..., sparse=True)`` and ``Adam(lazy=True)``: PyTorch's SparseAdam semantics, see
docs/training.md). Before timing, the model's gradients are checked by finite differences
(``vg.gradcheck``, float64) and the sparse model's gradients against the dense one's (bit for
bit); a failed check aborts with exit status 2.

Reported as ``tools/bench_dynamic.py`` does: sentences/s (median over rounds; a round trains on
every sentence once) and words/s, the time per sentence split into build, forward, backward and
update, and the peak traced memory (tracemalloc) of one training step on a sentence of median
length. "forward" is measured by re-running ``cg.forward()`` after the update (outside the step)
and subtracted from the build, which computes the forward while it unrolls.

Usage::

    PYTHONPATH=. python3 tools/bench_tree.py [--quick] [--json out.json] [--rounds N]
                                             [--sentences N] [--blas-threads N]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _pin_blas_threads() -> None:
    """One BLAS thread unless ``--blas-threads N`` or the usual variables say otherwise."""
    n = None
    for i, a in enumerate(sys.argv):
        if a == "--blas-threads" and i + 1 < len(sys.argv):
            n = sys.argv[i + 1]
        elif a.startswith("--blas-threads="):
            n = a.split("=", 1)[1]
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if n is not None:
            os.environ[var] = n
        else:
            os.environ.setdefault(var, "1")


if __name__ == "__main__":
    _pin_blas_threads()

import numpy as np  # noqa: E402

try:
    import vgraph as vg
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vgraph as vg

from vgraph import losses, nn, optim  # noqa: E402
from vgraph.ops import RowSparseGrad  # noqa: E402

DTYPE = np.float32
LR = 1e-3
PHASES = ("build", "forward", "backward", "update")
INNER = 0  # the token id of inner nodes (they have no word)


class BenchmarkMismatch(AssertionError):
    """A column computes something else than it should: its timings would be meaningless."""


# ---------------------------------------------------------------------------- generated data


@dataclass
class TreeBatch:
    """One sentence and its binary tree, nodes in post-order (children first, the root last)."""

    children: np.ndarray  # (N, 2) int: child indices, -1 for a leaf
    tokens: np.ndarray  # (N,) int: the word at a leaf, INNER at an inner node
    is_leaf: np.ndarray  # (N,) int: 1 at a leaf
    labels: np.ndarray  # (N,) int in 0..4
    words: int  # leaves = the sentence's length


def sst_lengths(rng: np.random.Generator, n: int, mean: float = 19.0, sd: float = 9.0) -> np.ndarray:
    """``n`` sentence lengths shaped like SST's: gamma(mean, sd), rounded, clipped to 1..50."""
    shape = (mean / sd) ** 2
    return np.clip(np.rint(rng.gamma(shape, sd * sd / mean, size=n)), 1, 50).astype(int)


def polarity(tokens: np.ndarray) -> np.ndarray:
    """A word's polarity in {-1, 0, +1}: a fixed function of its id, about 70% neutral."""
    h = (tokens * 2654435761) % 1000
    return np.where(h < 150, -1, np.where(h >= 850, 1, 0))


def random_tree(rng: np.random.Generator, words: np.ndarray) -> TreeBatch:
    """A random binary tree over ``words``: neighbours merged at random until one is left, then
    numbered in post-order (without recursion). Labels by the polarity rule (module docstring)."""
    n = len(words)
    kids = [[-1, -1] for _ in range(n)]
    score = [int(p) for p in polarity(words)]
    row = list(range(n))
    while len(row) > 1:
        k = int(rng.integers(0, len(row) - 1))
        a, b = row[k], row[k + 1]
        kids.append([a, b])
        score.append(score[a] + score[b])
        row[k : k + 2] = [len(kids) - 1]
    order: list[int] = []
    stack = [(len(kids) - 1, False)]
    while stack:
        t, expanded = stack.pop()
        a, b = kids[t]
        if expanded or a < 0:
            order.append(t)
        else:
            stack.extend([(t, True), (b, False), (a, False)])
    new = {old: i for i, old in enumerate(order)}
    children = np.array([[new[kids[t][0]], new[kids[t][1]]] if kids[t][0] >= 0 else [-1, -1] for t in order])
    tokens = np.array([int(words[t]) if t < n else INNER for t in order], dtype=np.int64)
    labels = np.clip(np.array([score[t] for t in order]), -2, 2) + 2
    return TreeBatch(children.reshape(-1, 2), tokens, (tokens != INNER).astype(np.int64), labels, n)


def tree_batches(n: int, vocab: int, seed: int) -> list[TreeBatch]:
    """``n`` sentences with Zipf-distributed words in ``[1, vocab)`` and random trees."""
    rng = np.random.default_rng(seed)
    lengths = sst_lengths(rng, n)
    p = 1.0 / np.arange(1, vocab)
    tokens = rng.choice(np.arange(1, vocab), size=int(lengths.sum()), p=p / p.sum())
    return [random_tree(rng, s) for s in np.split(tokens, np.cumsum(lengths)[:-1])]


# ---------------------------------------------------------------------------- the model


@dataclass
class TreeConfig:
    vocab: int = 18_000
    embed: int = 128
    hidden: int = 128
    labels: int = 5
    sparse: bool = False
    dtype: Any = DTYPE
    seed: int = 0


def _leaf_or_inner(is_leaf: np.ndarray) -> int:
    return 0 if int(is_leaf) else 1


def make_tree_lstm(cfg: TreeConfig) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The Tree-LSTM classifier of every node as a VirtualGraph; returns ``(g, loss)``."""
    E, H = cfg.embed, cfg.hidden
    g = vg.VirtualGraph(dtype=cfg.dtype, seed=cfg.seed, name="tree_lstm")
    children = g.input("children", shape=(None, 2))
    tokens = g.input("tokens", shape=(None,))
    is_leaf = g.input("is_leaf", shape=(None,))
    labels = g.input("labels", shape=(None,))
    emb = nn.Embedding(g, cfg.vocab, E, "emb", sparse=cfg.sparse, init=nn.normal(0.1))
    W_leaf = g.parameter("leaf.W", (E, 3 * H))
    b_leaf = g.parameter("leaf.b", (3 * H,))
    U = g.parameter("inner.U", (2 * H, 5 * H))
    bias = np.zeros(5 * H)
    bias[H : 3 * H] = 1.0  # forget gates start open
    b = g.parameter("inner.b", init=bias)
    head = nn.Linear(g, H, cfg.labels, "head")
    zeros = np.zeros(H, dtype=cfg.dtype)
    with g.recurse(children, name="tree") as r:
        leaf = r.step(is_leaf, name="is_leaf")
        h, c = r.state(zeros, name="h"), r.state(zeros, name="c")
        # a leaf: from its word (x W_leaf does not read the children: hoisted over all nodes)
        z = emb(r.step(tokens, name="token")) @ W_leaf + b_leaf
        gl = vg.sigmoid(z[: 2 * H])
        c_leaf = gl[:H] * vg.tanh(z[2 * H :])
        h_leaf = gl[H:] * vg.tanh(c_leaf)
        # an inner node: from its children
        zi = vg.concat([r.child(h, 0), r.child(h, 1)], axis=0) @ U + b
        gi = vg.sigmoid(zi[: 4 * H])
        c_inner = (
            gi[:H] * vg.tanh(zi[4 * H :]) + gi[H : 2 * H] * r.child(c, 0) + gi[2 * H : 3 * H] * r.child(c, 1)
        )
        h_inner = gi[3 * H :] * vg.tanh(c_inner)
        h_new, c_new = g.branch(
            _leaf_or_inner, [(h_leaf, c_leaf), (h_inner, c_inner)], keys=[leaf], name="kind"
        )
        r.update(h, h_new)
        r.update(c, c_new)
    loss = losses.cross_entropy(head(r.stack(h_new)), labels)
    return g, loss


def tree_feed(b: TreeBatch) -> dict[str, Any]:
    return {"children": b.children, "tokens": b.tokens, "is_leaf": b.is_leaf, "labels": b.labels}


# ---------------------------------------------------------------------------- runners


class _Clock:
    """Wall time and this thread's CPU time (which excludes time other processes ran)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


Phases = dict[str, tuple[float, float]]  # phase -> (wall s, CPU s)


class VgraphRunner:
    """A vgraph model trained by ``g.build`` + ``cg.backward`` + ``Adam.step`` per batch (as in
    tools/bench_dynamic.py), with ``Adam(lazy=...)``."""

    def __init__(
        self, g: vg.VirtualGraph, loss: vg.VirtualNode, feed: Callable[[Any], dict[str, Any]], lazy: bool
    ):
        self.g, self.loss, self.feed = g, loss, feed
        self.opt = optim.Adam(g.params, lr=LR, lazy=lazy)
        self.nodes: list[int] = []

    def step(self, batch: Any) -> tuple[float, Phases]:
        feed = self.feed(batch)
        clock = _Clock()
        cg = self.g.build(feed, self.loss)
        build = clock.lap()
        self.opt.zero_grad()
        value = cg.backward(cg.outputs[0])
        backward = clock.lap()
        self.opt.step()
        update = clock.lap()
        cg.forward(cg.outputs[0])  # every node recomputes: measures the forward alone
        forward = clock.lap()
        self.nodes.append(len(cg))
        build = (max(build[0] - forward[0], 0.0), max(build[1] - forward[1], 0.0))
        return float(value), {"build": build, "forward": forward, "backward": backward, "update": update}

    def params(self) -> dict[str, np.ndarray]:
        return {k: self.g.params.value(k) for k in self.g.params}

    def held_bytes(self) -> int:
        n = sum(p.value.nbytes for p in self.g.params.parameters())
        for st in self.opt.state.values():
            n += sum(v.nbytes for v in st.values() if isinstance(v, np.ndarray))
        return n


def tree_vgraph(cfg: TreeConfig, data: Any) -> VgraphRunner:
    g, loss = make_tree_lstm(cfg)
    return VgraphRunner(g, loss, tree_feed, lazy=False)


def tree_sparse(cfg: TreeConfig, data: Any) -> VgraphRunner:
    g, loss = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": True}))
    return VgraphRunner(g, loss, tree_feed, lazy=True)


def check_tree_lstm(seed: int = 0) -> dict[str, Any]:
    """Finite differences agree with the model's gradients (float64, a small instance with a
    repeated word), and the sparse model's gradients equal the dense one's bit for bit (else
    :class:`BenchmarkMismatch`)."""
    cfg = TreeConfig(vocab=30, embed=4, hidden=3, dtype=np.float64, seed=seed)
    rng = np.random.default_rng(seed + 3)
    batch = random_tree(rng, np.array([5, 7, 5, 2, 9]))
    g, loss = make_tree_lstm(cfg)
    cg = g.build(tree_feed(batch), loss)
    try:
        vg.gradcheck(cg.outputs[0], cg.parameters(), atol=1e-6, rtol=1e-5)
    except vg.GradcheckError as e:
        raise BenchmarkMismatch(f"tree_lstm: gradcheck failed: {e}") from None
    grads = {}
    for sparse in (False, True):
        g, loss = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": sparse}))
        g.build(tree_feed(batch), loss).backward(loss)
        grads[sparse] = {k: p.grad for k, p in g.params.items()}
    if not isinstance(grads[True]["emb.W"], RowSparseGrad) or not all(
        np.array_equal(np.asarray(grads[True][k]), grads[False][k]) for k in grads[False]
    ):
        raise BenchmarkMismatch("tree_lstm: the sparse model's gradients differ from the dense model's")
    return {"gradcheck": "passed", "parameters": len(cg.parameters()), "nodes": len(batch.tokens),
            "sparse_equals_dense": True}  # fmt: skip


# ---------------------------------------------------------------------------- the task


def _tree_configs(quick: bool) -> list[TreeConfig]:
    return [TreeConfig(vocab=300, embed=8, hidden=8)] if quick else [TreeConfig()]


def _tree_data(cfg: TreeConfig, quick: bool, n: int | None = None) -> list[TreeBatch]:
    return tree_batches(n if n is not None else (4 if quick else 60), cfg.vocab, seed=11)


COLUMNS: dict[str, Callable[[TreeConfig, Any], VgraphRunner]] = {"vgraph": tree_vgraph, "sparse": tree_sparse}
DESCRIPTION = (
    "Tree-LSTM sentiment, SST-shaped trees (1-50 words, mean 19), vocab 18k, embed 128, hidden 128, "
    "5 labels at every node, one tree per build, Adam"
)


# ---------------------------------------------------------------------------- measuring


def peak_step_memory(make: Callable[[], VgraphRunner], batch: Any) -> float:
    """What a fresh runner holds (parameters, optimiser state) plus the peak traced allocation of
    its first training step (which creates the optimiser state), after a throw-away runner's step
    has warmed one-time caches (as tools/bench_dynamic.py measures it)."""
    make().step(batch)
    runner = make()
    held = runner.held_bytes()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        runner.step(batch)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return float(held + peak)


def run_config(cfg: TreeConfig, data: list[TreeBatch], rounds: int, warmup: int) -> dict[str, Any]:
    """Time every column on ``data``: ``rounds`` passes, columns alternating sentence by sentence
    (order reversed every sentence)."""
    runners = {name: make(cfg, data) for name, make in COLUMNS.items()}
    names = list(runners)
    for i in range(warmup):
        for name in names:
            runners[name].step(data[i % len(data)])
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    cpu_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    losses_seen: dict[str, list[float]] = {n: [] for n in names}
    words = sum(b.words for b in data)
    for _ in range(rounds):
        sums = {n: dict.fromkeys(PHASES, 0.0) for n in names}
        cpus = {n: dict.fromkeys(PHASES, 0.0) for n in names}
        for j, batch in enumerate(data):
            for name in names if j % 2 == 0 else names[::-1]:
                loss, phases = runners[name].step(batch)
                losses_seen[name].append(loss)
                for k in PHASES:
                    sums[name][k] += phases[k][0]
                    cpus[name][k] += phases[k][1]
        for n in names:
            per_round[n].append(sums[n])
            cpu_round[n].append(cpus[n])
    for name, seen in losses_seen.items():
        if not all(math.isfinite(v) for v in seen):
            raise BenchmarkMismatch(f"tree_lstm {name}: a non-finite loss")
    median_batch = sorted(data, key=lambda b: b.words)[len(data) // 2]
    result: dict[str, Any] = {
        "task": "tree_lstm", "config": "1 tree", "settings": {k: v for k, v in vars(cfg).items() if k != "dtype"},
        "batches": len(data), "words_per_round": words, "nodes_per_round": sum(len(b.tokens) for b in data),
        "rounds": rounds, "warmup": warmup, "columns": {},
    }  # fmt: skip
    for name in names:
        totals = [sum(r.values()) for r in per_round[name]]
        col = {
            "sentences_per_s": statistics.median(len(data) / t for t in totals),
            "words_per_s": statistics.median(words / t for t in totals),
            "ms_per_batch": statistics.median(totals) * 1e3 / len(data),
            "phase_ms_per_batch": {
                k: statistics.median(r[k] for r in per_round[name]) * 1e3 / len(data) for k in PHASES
            },
            "cpu_ms_per_batch": statistics.median(sum(r.values()) for r in cpu_round[name]) * 1e3 / len(data),
            "phase_cpu_ms_per_batch": {
                k: statistics.median(r[k] for r in cpu_round[name]) * 1e3 / len(data) for k in PHASES
            },
            "peak_bytes": peak_step_memory(lambda name=name: COLUMNS[name](cfg, data), median_batch),
            "first_loss": losses_seen[name][0],
            "last_loss": losses_seen[name][-1],
            "nodes_per_batch": statistics.median(runners[name].nodes),
        }
        result["columns"][name] = col
    dense, sparse = result["columns"]["vgraph"], result["columns"]["sparse"]
    result["sparse_speedup"] = dense["ms_per_batch"] / sparse["ms_per_batch"]
    result["sparse_speedup_cpu"] = dense["cpu_ms_per_batch"] / sparse["cpu_ms_per_batch"]
    return result


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'task':<10} {'config':<7} {'column':<7} {'sent/s':>7} {'words/s':>8} {'ms/sent':>8} {'build':>7} "
        f"{'forward':>8} {'backward':>9} {'update':>7} {'peak MiB':>9} {'cpu ms':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        for name, c in r["columns"].items():
            p = c["phase_ms_per_batch"]
            print(
                f"{r['task']:<10} {r['config']:<7} {name:<7} {c['sentences_per_s']:>7.1f} {c['words_per_s']:>8,.0f} "
                f"{c['ms_per_batch']:>8.2f} {p['build']:>7.2f} {p['forward']:>8.2f} {p['backward']:>9.2f} "
                f"{p['update']:>7.2f} {c['peak_bytes'] / 2**20:>9.1f} {c['cpu_ms_per_batch']:>7.2f}"
            )
        print(
            f"{'':<10} sparse embeddings: {r['sparse_speedup']:.2f}x the dense step "
            f"({r['sparse_speedup_cpu']:.2f}x in CPU time); {r['columns']['vgraph']['nodes_per_batch']:.0f} "
            f"compute nodes per tree of median size"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: a tiny model and data, checks included")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    ap.add_argument("--rounds", type=int, help="passes over the sentences (default 5, quick 1)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps per column (default 2, quick 1)")
    ap.add_argument("--sentences", type=int, help="sentences per round (default 60, quick 4)")
    ap.add_argument(
        "--blas-threads", metavar="N", help="BLAS threads (default 1); read before numpy is imported"
    )
    args = ap.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if rounds < 1 or warmup < 0 or (args.sentences is not None and args.sentences < 1):
        ap.error("--rounds and --sentences must be >= 1 and --warmup >= 0")
    started = _dt.datetime.now(_dt.timezone.utc)
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(
        f"vgraph tree-task benchmark  {started:%Y-%m-%d %H:%M UTC}  numpy {np.__version__}  "
        f"{os.cpu_count()} CPUs  BLAS threads {threads}  rounds {rounds} (+{warmup} warm-up steps)\n"
    )
    rows: list[dict[str, Any]] = []
    try:
        check = check_tree_lstm()
        print(
            f"correctness: tree_lstm: gradients = finite differences (float64 gradcheck, {check['parameters']} "
            "parameters); sparse gradients = dense gradients (bit for bit)\n"
        )
        for cfg in _tree_configs(args.quick):
            data = _tree_data(cfg, args.quick, args.sentences)
            rows.append(run_config(cfg, data, rounds, warmup))
    except BenchmarkMismatch as e:
        print(f"\nBENCHMARK ABORTED: {e}", file=sys.stderr)
        return 2
    print(DESCRIPTION + (" (--quick: vocab 300, embed 8, hidden 8)" if args.quick else ""))
    print_rows(rows)
    results = {
        "benchmark": "vgraph tree task (Tree-LSTM, SST-shaped), training throughput",
        "date": started.isoformat(timespec="seconds"),
        "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
        "machine": {
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__,
            "blas_threads": threads, "vgraph": getattr(vg, "__version__", None),
        },
        "config": {"quick": args.quick, "rounds": rounds, "warmup": warmup, "lr": LR, "dtype": np.dtype(DTYPE).name,
                   "statistic": "median over rounds; phases per sentence"},
        "correctness": check,
        "rows": rows,
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
