#!/usr/bin/env python3
"""Dynamic-task benchmark: training throughput of vgraph on tasks shaped like DyNet's suite.

Three tasks on generated data (nothing is downloaded), float32, Adam (lr 1e-3), BLAS
single-threaded unless ``--blas-threads N`` says otherwise:

* ``lstm_lm`` — an LSTM language model. Vocabulary 10,000 with Zipf-distributed tokens (rank r
  drawn with probability proportional to 1/r; id 0 is the sentence boundary), sentence lengths
  like the Penn Treebank's (gamma-distributed, mean 22, sd 10, clipped to 1..80). Embedding 128,
  one LSTM layer of 256, a softmax over the vocabulary. Each sentence predicts its words and the
  end symbol from the start symbol and its words (length + 1 predictions, the "words" counted).
  Minibatches of 1, 16 and 64 sentences: sentences are sorted by length and cut into batches
  (batch order shuffled), shorter sentences padded, the loss masked: the mean cross-entropy over
  the batch's real words. The vgraph model embeds the ``(T, B)`` token array once, steps an
  ``nn.LSTMCell`` through it, stacks the hidden states and applies ``nn.Linear`` to them reshaped
  to ``(T*B, 256)``, as docs/training.md recommends.
  Column ``numpy``: the floor, a hand-written numpy training step of the same model at MB 16 and
  64, written tightly (the input projection of all steps as one matmul, preallocated state, gate
  and gradient buffers reused across steps, in-place element-wise work, the weight gradients each
  as one ``(T*B)``-row product after the sweep, an in-place Adam). Before timing its loss,
  gradients and one Adam step are checked against vgraph's on a small float64 instance.
* ``bilstm_tagger`` — a BiLSTM tagger, one sentence per build (variable length). Vocabulary
  20,000 (Zipf), embedding 128, a forward and a backward ``nn.LSTMCell`` of 50, their states
  concatenated per word, an MLP ``tanh(Linear(100, 32))``, ``Linear(32, 5)``, cross-entropy over
  5 tags (a deterministic function of the word, so there is something to learn). Before timing
  the model's gradients are checked by finite differences (``vg.gradcheck``) in float64.
* ``tree_lstm`` — Tree-LSTM sentiment on trees shaped like the Stanford Sentiment Treebank, one
  tree per build. Sentences of 1-50 words (gamma-distributed lengths, mean 19, sd 9), words from a
  vocabulary of 18,000 (Zipf; id 0 marks inner nodes), each with a random binary tree
  (neighbouring constituents merged at random until one is left) numbered in post-order; 5 labels
  at every node (a word's polarity in {-1, 0, +1} is a fixed function of its id, a node's score
  the sum over its words, the label ``clip(score, -2, 2) + 2``). The model is Tai, Socher and
  Manning's constituency Tree-LSTM declared with ``g.recurse``: a leaf computes
  ``[i, o, u] = x W_leaf + b_leaf``, ``c = σ(i) tanh(u)``, ``h = σ(o) tanh(c)``; an inner node
  ``[i, f_L, f_R, o, u] = [h_L, h_R] U + b``, ``c = σ(i) tanh(u) + σ(f_L) c_L + σ(f_R) c_R``,
  ``h = σ(o) tanh(c)`` (a two-output branch on the node's kind); embedding 128, hidden 128, a
  linear layer to 5 logits at every node, the mean cross-entropy over the nodes. Before timing the
  gradients are checked by finite differences (float64) and the sparse model's against the dense
  model's (bit for bit).

Column ``sparse`` (tagger and tree tasks): the same model with ``nn.Embedding(..., sparse=True)``
and ``Adam(lazy=True)`` — a row-sparse embedding gradient and PyTorch's ``SparseAdam`` update of
the rows looked up only (docs/training.md, "Sparse embedding gradients"); "sparse x" is the dense
column's time per batch over the sparse one's.

Columns ``vgraph`` and ``sparse`` unroll node by node (``programs=False``, the reference); column
``programs`` is ``sparse`` with every loop run as a body program (``programs=True``). A default
build (``programs=None``) runs these models' loops as programs (a tree's recursion, and the
tagger's and the LM's loops over a fused LSTM cell): the ``programs`` column.

Columns ``batch32`` and ``batch32_programs``: the same model trained on groups of 32 sentences
or trees with ``g.build_batch`` — op by op across the group (``programs=False``), or each loop as
one body program over the group's sentences, the recursion as one over the group's tree nodes
level by level (``programs=True``). Their PyTorch counterparts pack the same 32 sentences through
one ``nn.LSTM`` and run the trees level by level; the correctness check compares both with them.

Columns ``torch`` and ``torch_batch32`` (when PyTorch is installed; ``--no-torch`` leaves them
out): the same models in PyTorch eager mode on one thread (``torch.set_num_threads(1)``), written
as a careful PyTorch user writes them — the LM with ``nn.Embedding``, ``nn.LSTM`` over the padded
minibatch and ``nn.Linear`` (MB >= 4); the tagger with one ``nn.LSTM(bidirectional=True)``, one
sentence at a time, or 32 sentences packed (``pack_sequence``) through it at once; the Tree-LSTM
with the leaves' input projection as one product and a Python cell per inner node in post-order,
or 32 trees level by level (all inner nodes of one height across the group in one cell call).
Tagger and tree use ``nn.Embedding(sparse=True)`` with ``SparseAdam`` for it and ``Adam`` for the
rest, the update of vgraph's ``Adam(lazy=True)``; ``--dense-embeddings`` makes both sides dense
(and vgraph's ``batch32`` column too). Before timing, each is checked against vgraph on a float64
instance from the same weights: loss, every gradient and the parameters after two Adam updates
(the second on other inputs: rows not looked up stay), to 1e-10 relative. "vs torch" is a vgraph
column's time per batch over its PyTorch counterpart's: ``sparse`` (or ``vgraph`` with
``--dense-embeddings``; the LM's ``vgraph``) over ``torch``, ``batch32`` and
``batch32_programs`` over ``torch_batch32``.
PyTorch allocates outside tracemalloc's view, so its columns print no peak memory.

Reported per task and minibatch size: sentences/s and words/s (medians over rounds; a round trains
on every batch once), the time per batch split into build, forward, backward and update (which
includes freeing the step's graph: a training loop pays for it too), and the peak traced
memory (tracemalloc) of one training step on a batch of median length. In vgraph a build computes
the forward while it unrolls, so "build+forward" is what the step pays; "forward" is measured in
one extra pass after the timed rounds, by re-running ``cg.forward()`` on the same graph after each
update (every node recomputes: the parameters changed), and "build" is the difference. The timed
rounds are plain training steps: a re-run forward in them would change the next step's memory
(see :func:`run_config`). The numpy floor has no build. vgraph and the floor alternate batch by
batch in one process, on the same initial weights; the autobatched columns alternate with a fresh
runner of their one-at-a-time column in a second pass. "vs floor" is vgraph's time per batch over
the floor's (medians); "cpu" the same ratio in thread CPU time, which moves less when other
processes load the machine.

Adding a task or a column: a task is a :class:`Task` in :data:`TASKS` (its data, its configurations,
its columns and an optional correctness check); a column is a function ``(config, data) -> Runner``
whose ``step(batch)`` trains on one batch and returns the loss and the phase times. An
"autobatched" column plugs in there.

Usage::

    PYTHONPATH=. python3 tools/bench_dynamic.py [--quick] [--json out.json] [--tasks lstm_lm ...]
                                                [--rounds N] [--blas-threads N] [--no-torch]
                                                [--dense-embeddings] [--schedule interleaved|blocked]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchcommon import TORCH_MISSING, load_torch, pin_blas_threads

if __name__ == "__main__":
    pin_blas_threads()

import numpy as np

try:
    import vgraph as vg
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vgraph as vg

from vgraph import losses, nn, optim
from vgraph.ops import RowSparseGrad

DTYPE = np.float32
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
BOUNDARY = 0  # token id of the sentence start/end symbol
PHASES = ("build", "forward", "backward", "update")


class BenchmarkMismatch(AssertionError):
    """An implementation computes something else than vgraph: its timings would be meaningless."""


# ---------------------------------------------------------------------------- generated data


def zipf_tokens(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    """``n`` token ids in ``[1, vocab)`` with P(rank r) proportional to 1/r (id 0 is reserved)."""
    p = 1.0 / np.arange(1, vocab)
    return rng.choice(np.arange(1, vocab), size=n, p=p / p.sum())


def ptb_lengths(rng: np.random.Generator, n: int, mean: float = 22.0, sd: float = 10.0) -> np.ndarray:
    """``n`` sentence lengths shaped like the Penn Treebank's: gamma(mean, sd), rounded, 1..80."""
    shape = (mean / sd) ** 2
    return np.clip(np.rint(rng.gamma(shape, sd * sd / mean, size=n)), 1, 80).astype(int)


def make_sentences(n: int, vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = ptb_lengths(rng, n)
    tokens = zipf_tokens(rng, vocab, int(lengths.sum()))
    return np.split(tokens, np.cumsum(lengths)[:-1])


@dataclass
class LMBatch:
    """A padded, time-major minibatch of the language model."""

    tokens: np.ndarray  # (T, B) int: start symbol + words, padded with the boundary id
    targets: np.ndarray  # (T*B,) int: words + end symbol, time-major (index t*B + b)
    weights: np.ndarray  # (T*B,) DTYPE: 1/words at real positions, 0 at padding
    words: int  # real predictions in the batch


def lm_batches(sentences: list[np.ndarray], mb: int, seed: int) -> list[LMBatch]:
    """Sort by length, cut into minibatches of ``mb`` (the last may be smaller), shuffle them."""
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    batches = []
    for start in range(0, len(order), mb):
        group = [sentences[i] for i in order[start : start + mb]]
        B, T = len(group), max(len(s) for s in group) + 1
        tokens = np.full((T, B), BOUNDARY, dtype=np.int64)
        targets = np.full((T, B), BOUNDARY, dtype=np.int64)
        mask = np.zeros((T, B), dtype=bool)
        for b, s in enumerate(group):
            n = len(s)
            tokens[1 : n + 1, b] = s
            targets[:n, b] = s
            mask[: n + 1, b] = True
        words = int(mask.sum())
        weights = np.where(mask, 1.0 / words, 0.0).astype(DTYPE).reshape(-1)
        batches.append(LMBatch(tokens, targets.reshape(-1), weights, words))
    np.random.default_rng(seed).shuffle(batches)  # type: ignore[arg-type]
    return batches


@dataclass
class TagBatch:
    """One sentence of the tagger."""

    tokens: np.ndarray  # (T, 1) int
    tags: np.ndarray  # (T,) int
    words: int


def tagger_batches(n: int, vocab: int, tags: int, seed: int) -> list[TagBatch]:
    out = []
    for s in make_sentences(n, vocab, seed):
        out.append(TagBatch(s.reshape(-1, 1).astype(np.int64), (s * 7919 % tags).astype(np.int64), len(s)))
    return out


# ---------------------------------------------------------------------------- runners


class _Clock:
    """Wall time and this thread's CPU time (which excludes time other processes ran)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def lap(self) -> tuple[float, float]:
        """Seconds (wall, CPU) since the previous lap (or the start)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


Phases = dict[str, tuple[float, float]]  # phase -> (wall s, CPU s)


class Runner(Protocol):
    """One implementation of a task: trains on one batch per :meth:`step`."""

    def step(self, batch: Any) -> tuple[float, Phases]:
        """Train on ``batch``; return the loss and the (wall, CPU) seconds of each of ``PHASES``."""
        ...

    def params(self) -> dict[str, np.ndarray]:
        """The current parameter values by name."""
        ...

    def held_bytes(self) -> int:
        """Bytes of the arrays the runner keeps between steps (parameters, optimiser state,
        reusable buffers)."""
        ...


class VgraphRunner:
    """A vgraph model trained by ``g.build`` + ``cg.backward`` + ``Adam.step`` per batch.

    ``feed(batch)`` maps a batch to the model's inputs. With ``measure_forward`` (set by
    :func:`run_config` for its split round only), ``cg.forward()`` re-runs the whole graph after
    the update (the parameters changed) to measure the forward alone; that time is reported as
    "forward" and subtracted from the build, and is not part of the step. ``lazy``: Adam's lazy
    update of row-sparse gradients (the ``sparse`` columns).
    """

    #: Whether the build can be split from the forward by re-running it (see the class docstring).
    splits_forward = True
    #: Re-run the forward after this step's update (only in :func:`run_config`'s split round).
    measure_forward = False

    def __init__(
        self,
        g: vg.VirtualGraph,
        loss: vg.VirtualNode,
        feed: Callable[[Any], dict[str, Any]],
        lazy: bool = False,
        programs: bool = False,
    ):
        self.g, self.loss, self.feed = g, loss, feed
        self.programs = programs  # loops run as body programs (g.build(..., programs=True))
        self.opt = optim.Adam(g.params, lr=LR, betas=BETAS, eps=EPS, lazy=lazy)
        self.nodes: list[int] = []

    def step(self, batch: Any) -> tuple[float, Phases]:
        feed = self.feed(batch)
        clock = _Clock()
        cg = self.g.build(feed, self.loss, programs=self.programs)
        build = clock.lap()
        self.opt.zero_grad()
        value = cg.backward(cg.outputs[0])
        backward = clock.lap()
        self.opt.step()
        self.nodes.append(len(cg))
        forward = (0.0, 0.0)
        if self.measure_forward:
            update = clock.lap()
            cg.forward(cg.outputs[0])  # every node recomputes: measures the forward alone
            forward = clock.lap()
            build = (max(build[0] - forward[0], 0.0), max(build[1] - forward[1], 0.0))
        else:
            del cg  # freeing the graph is part of a training step: timed with the update
            update = clock.lap()
        return float(value), {"build": build, "forward": forward, "backward": backward, "update": update}

    def params(self) -> dict[str, np.ndarray]:
        return {k: self.g.params.value(k) for k in self.g.params}

    def held_bytes(self) -> int:
        n = sum(p.value.nbytes for p in self.g.params.parameters())
        for st in self.opt.state.values():
            n += sum(v.nbytes for v in st.values() if isinstance(v, np.ndarray))
        return n


class AutobatchRunner(VgraphRunner):
    """The same model, trained on groups of ``group`` inputs with ``g.build_batch`` (autobatching):
    one batched build, one backward of the mean loss, one update per group.

    Every column trains on the same one-input batches in the same order, so this runner keeps
    them until it has a group (or the round's last batch) and reports the group's time at that
    step, zero at the others: totals per round compare with the one-at-a-time columns.
    """

    def __init__(self, g: vg.VirtualGraph, loss: vg.VirtualNode, feed: Callable[[Any], dict[str, Any]],
                 per_round: int, group: int = 32, lazy: bool = False, programs: bool = False):  # fmt: skip
        super().__init__(g, loss, feed, lazy, programs)
        self.per_round, self.group = per_round, group
        self.pending: list[dict[str, Any]] = []
        self.seen = 0
        self.last = 0.0

    def step(self, batch: Any) -> tuple[float, Phases]:
        self.pending.append(self.feed(batch))
        self.seen += 1
        if len(self.pending) < self.group and self.seen % self.per_round:
            zero = (0.0, 0.0)
            return self.last, {"build": zero, "forward": zero, "backward": zero, "update": zero}
        clock = _Clock()
        batched = self.g.build_batch(self.pending, self.loss, programs=self.programs)
        build = clock.lap()
        self.opt.zero_grad()
        self.last = batched.backward("mean")
        backward = clock.lap()
        self.opt.step()
        self.nodes.append(len(batched.graph))
        del batched  # freeing the graph is part of a training step: timed with the update
        update = clock.lap()
        self.pending = []
        return self.last, {"build": build, "forward": (0.0, 0.0), "backward": backward, "update": update}


def vgraph_grads(
    g: vg.VirtualGraph, loss: vg.VirtualNode, feed: dict[str, Any]
) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients of one build (parameters untouched)."""
    g.params.zero_grad()
    cg = g.build(feed, loss)
    value = cg.backward(cg.outputs[0])
    grads = {k: np.array(g.params[k].grad) for k in g.params}
    g.params.zero_grad()
    return float(value), grads


# ---------------------------------------------------------------------------- task (a): LSTM LM


@dataclass
class LMConfig:
    vocab: int = 10_000
    embed: int = 128
    hidden: int = 256
    mb: int = 16
    dtype: Any = DTYPE
    seed: int = 0


def make_lstm_lm(cfg: LMConfig) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The language model as a VirtualGraph; returns ``(g, loss)``. The batch size is free."""
    V, E, H = cfg.vocab, cfg.embed, cfg.hidden
    g = vg.VirtualGraph(dtype=cfg.dtype, seed=cfg.seed, name="lstm_lm")
    tokens = g.input("tokens", shape=(None, None))
    targets = g.input("targets", shape=(None,))
    weights = g.input("weights", shape=(None,))
    zeros = g.input("zeros", shape=(None, H))
    emb = nn.Embedding(g, V, E, "emb")
    cell = nn.LSTMCell(g, E, H, "lstm")
    out = nn.Linear(g, H, V, "out")
    embedded = emb(tokens)  # (T, B, E), once, before the loop
    with g.loop(name="time") as L:
        x_t = L.step(embedded)
        h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
        h_new, c_new = cell(x_t, (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    hs = L.stack(h_new).reshape(-1, H)  # (T*B, H)
    loss = (losses.cross_entropy(out(hs), targets, reduction="none") * weights).sum()
    return g, loss


def lm_feed(cfg: LMConfig) -> Callable[[LMBatch], dict[str, Any]]:
    zeros: dict[int, np.ndarray] = {}

    def feed(b: LMBatch) -> dict[str, Any]:
        B = b.tokens.shape[1]
        if B not in zeros:
            zeros[B] = np.zeros((B, cfg.hidden), dtype=cfg.dtype)
        return {"tokens": b.tokens, "targets": b.targets, "weights": b.weights, "zeros": zeros[B]}

    return feed


LM_PARAMS = ("emb.W", "lstm.W_x", "lstm.W_h", "lstm.b", "out.W", "out.b")


class NumpyLM:
    """The floor: a hand-written numpy training step of the LSTM LM (forward, BPTT, Adam).

    Buffers (embedded inputs, gate activations, states, logits, gradients) live in a workspace
    that grows to the largest batch seen and is reused, as do the weight gradients (the arrays
    :meth:`grads` returns are overwritten by the next call); element-wise work is in place. Gates are
    PyTorch's order (i, f, g, o) as ``nn.LSTMCell``; sigmoid is ``0.5 * tanh(0.5 x) + 0.5``.
    """

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        self.P = {k: np.array(params[k]) for k in LM_PARAMS}
        self.dtype = self.P["lstm.W_h"].dtype
        self.m = {k: np.zeros_like(v) for k, v in self.P.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.P.items()}
        self.tmp = {k: np.empty_like(v) for k, v in self.P.items()}
        self.g = {k: np.empty_like(v) for k, v in self.P.items()}  # gradients, overwritten each step
        self.t = 0
        self.ws: dict[str, np.ndarray] = {}
        self.cap = (0, 0)

    def _workspace(self, T: int, B: int) -> dict[str, np.ndarray]:
        cap_T, cap_B = self.cap
        if cap_T < T or cap_B < B:
            T, B = max(T, cap_T), max(B, cap_B)
            E, H = self.P["lstm.W_x"].shape[0], self.P["lstm.W_h"].shape[0]
            V, dt = self.P["out.W"].shape[1], self.dtype
            self.ws = {
                "X": np.empty(T * B * E, dt), "Z": np.empty(T * B * 4 * H, dt),
                "HS": np.empty((T + 1) * B * H, dt), "CS": np.empty((T + 1) * B * H, dt),
                "TC": np.empty(T * B * H, dt), "LOG": np.empty(T * B * V, dt),
                "DH": np.empty(T * B * H, dt), "DZ": np.empty(T * B * 4 * H, dt),
                "tmp4": np.empty(B * 4 * H, dt), "tmp": np.empty(B * H, dt), "dc": np.empty(B * H, dt),
                "dhn": np.empty(B * H, dt), "DX": np.empty(T * B * E, dt), "ones": np.ones(T * B, dt),
            }  # fmt: skip
            self.cap = (T, B)
        return self.ws

    def grads(self, b: LMBatch) -> tuple[float, dict[str, np.ndarray], Phases]:
        """Loss, gradients and the (wall, CPU) seconds of the forward and the backward."""
        P = self.P
        Wemb, Wx, Wh, bias, Wo, bo = (P[k] for k in LM_PARAMS)
        T, B = b.tokens.shape
        E, H, V = Wx.shape[0], Wh.shape[0], Wo.shape[1]
        N = T * B
        ws = self._workspace(T, B)

        def view(name: str, *shape: int) -> np.ndarray:
            return ws[name][: math.prod(shape)].reshape(shape)

        X, Z = view("X", T, B, E), view("Z", T, B, 4 * H)
        HS, CS, TC = view("HS", T + 1, B, H), view("CS", T + 1, B, H), view("TC", T, B, H)
        LOG, DH, DZ = view("LOG", N, V), view("DH", T, B, H), view("DZ", T, B, 4 * H)
        tmp4, tmp, dc, dhn = view("tmp4", B, 4 * H), view("tmp", B, H), view("dc", B, H), view("dhn", B, H)
        clock = _Clock()
        # forward
        np.take(Wemb, b.tokens, axis=0, out=X)
        X2, Z2 = X.reshape(N, E), Z.reshape(N, 4 * H)
        np.matmul(X2, Wx, out=Z2)
        Z2 += bias
        HS[0] = 0
        CS[0] = 0
        for t in range(T):
            z = Z[t]
            np.matmul(HS[t], Wh, out=tmp4)
            z += tmp4
            ifg, gg, o = z[:, : 2 * H], z[:, 2 * H : 3 * H], z[:, 3 * H :]
            for s in (ifg, o):  # sigmoid, in place
                s *= 0.5
                np.tanh(s, out=s)
                s *= 0.5
                s += 0.5
            np.tanh(gg, out=gg)
            c = CS[t + 1]
            np.multiply(z[:, H : 2 * H], CS[t], out=c)
            np.multiply(z[:, :H], gg, out=tmp)
            c += tmp
            np.tanh(c, out=TC[t])
            np.multiply(o, TC[t], out=HS[t + 1])
        H2 = HS[1:].reshape(N, H)
        np.matmul(H2, Wo, out=LOG)
        LOG += bo
        LOG -= LOG.max(axis=1, keepdims=True)
        rows = np.arange(N)
        picked = LOG[rows, b.targets]  # shifted logit of each target (a copy)
        np.exp(LOG, out=LOG)
        s = LOG.sum(axis=1)
        loss = float(np.dot(b.weights, np.log(s) - picked))
        forward = clock.lap()
        # backward: dloss/dlogits = w * (softmax - onehot), in place of the exponentials
        LOG *= (b.weights / s)[:, None]
        LOG[rows, b.targets] -= b.weights
        D = LOG
        G = self.g
        np.matmul(H2.T, D, out=G["out.W"])
        ones = ws["ones"][:N]  # column sums as a product with ones: BLAS beats np.sum over rows
        np.matmul(ones, D, out=G["out.b"])
        np.matmul(D, Wo.T, out=DH.reshape(N, H))
        WhT = np.ascontiguousarray(Wh.T)  # BLAS is slower with a transposed operand (docs/performance.md)
        dc[...] = 0
        for t in range(T - 1, -1, -1):
            z, dz, tc = Z[t], DZ[t], TC[t]
            i, f, gg, o = z[:, :H], z[:, H : 2 * H], z[:, 2 * H : 3 * H], z[:, 3 * H :]
            di, df, dg, do = dz[:, :H], dz[:, H : 2 * H], dz[:, 2 * H : 3 * H], dz[:, 3 * H :]
            dh = DH[t]
            if t < T - 1:
                dh += dhn
            np.multiply(dh, tc, out=do)  # do = dh * tanh(c) * o (1 - o)
            np.subtract(1, o, out=tmp)
            tmp *= o
            do *= tmp
            np.multiply(tc, tc, out=tmp)  # dc += dh * o * (1 - tanh(c)^2)
            np.subtract(1, tmp, out=tmp)
            tmp *= o
            tmp *= dh
            dc += tmp
            np.subtract(1, i, out=tmp)  # di = dc * g * i (1 - i)
            tmp *= i
            tmp *= gg
            np.multiply(dc, tmp, out=di)
            np.subtract(1, f, out=tmp)  # df = dc * c_prev * f (1 - f)
            tmp *= f
            tmp *= CS[t]
            np.multiply(dc, tmp, out=df)
            np.multiply(gg, gg, out=tmp)  # dg = dc * i * (1 - g^2)
            np.subtract(1, tmp, out=tmp)
            tmp *= i
            np.multiply(dc, tmp, out=dg)
            if t:  # h_0 and c_0 are constants
                dc *= f
                np.matmul(dz, WhT, out=dhn)
        DZ2 = DZ.reshape(N, 4 * H)
        np.matmul(X2.T, DZ2, out=G["lstm.W_x"])
        np.matmul(HS[:T].reshape(N, H).T, DZ2, out=G["lstm.W_h"])
        np.matmul(ones, DZ2, out=G["lstm.b"])
        DX = view("DX", N, E)
        np.matmul(DZ2, Wx.T, out=DX)
        gEmb = G["emb.W"]
        gEmb.fill(0)
        np.add.at(gEmb, b.tokens.reshape(-1), DX)
        backward = clock.lap()
        return loss, G, {"forward": forward, "backward": backward}

    def update(self, grads: dict[str, np.ndarray]) -> None:
        """Adam in place, the formula of ``vgraph.optim.Adam``."""
        b1, b2 = BETAS
        self.t += 1
        bias1, bias2 = 1.0 - b1**self.t, 1.0 - b2**self.t
        for k, p in self.P.items():
            g, m, v, tmp = grads[k], self.m[k], self.v[k], self.tmp[k]
            m *= b1
            np.multiply(g, 1.0 - b1, out=tmp)
            m += tmp
            v *= b2
            np.multiply(g, g, out=tmp)
            tmp *= 1.0 - b2
            v += tmp
            np.sqrt(v, out=tmp)
            tmp /= math.sqrt(bias2)
            tmp += EPS
            np.divide(m, tmp, out=tmp)
            tmp *= LR / bias1
            p -= tmp

    def step(self, batch: LMBatch) -> tuple[float, Phases]:
        loss, grads, phases = self.grads(batch)
        clock = _Clock()
        self.update(grads)
        return loss, {"build": (0.0, 0.0), **phases, "update": clock.lap()}

    def params(self) -> dict[str, np.ndarray]:
        return self.P

    def held_bytes(self) -> int:
        arrays = [*self.P.values(), *self.m.values(), *self.v.values(), *self.tmp.values(), *self.g.values()]
        arrays += self.ws.values()
        return sum(a.nbytes for a in arrays)


def _max_rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(got - ref))) / scale


def check_lstm_lm(seed: int = 0, tol: float = 1e-9) -> dict[str, Any]:
    """The floor's loss, gradients and one Adam step equal vgraph's on a small float64 instance
    with padding (else :class:`BenchmarkMismatch`); returns the largest relative errors."""
    cfg = LMConfig(vocab=40, embed=6, hidden=5, dtype=np.float64, seed=seed)
    g, loss = make_lstm_lm(cfg)
    sentences = make_sentences(7, cfg.vocab, seed + 5)
    batch = lm_batches(sentences, 4, seed)[0]
    feed = lm_feed(cfg)(batch)
    vg_loss, vg_g = vgraph_grads(g, loss, feed)
    floor = NumpyLM({k: g.params.value(k) for k in LM_PARAMS})
    np_loss, np_g, _ = floor.grads(batch)
    errs = {"loss": abs(np_loss - vg_loss) / max(abs(vg_loss), 1e-30)}
    for k in LM_PARAMS:
        errs[k] = _max_rel_err(np_g[k], vg_g[k])
    # one Adam step each: same new parameters
    runner = VgraphRunner(g, loss, lm_feed(cfg))
    runner.step(batch)
    floor.step(batch)
    for k in LM_PARAMS:
        errs[f"{k} after Adam"] = _max_rel_err(floor.P[k], g.params.value(k))
    bad = {k: e for k, e in errs.items() if not e <= tol}
    if bad:
        raise BenchmarkMismatch(
            f"lstm_lm: the numpy floor differs from vgraph (relative errors {bad}, tol {tol})"
        )
    return {"max_rel_err": errs, "tol": tol, "words": batch.words, "shape": list(batch.tokens.shape)}


def lm_vgraph(cfg: LMConfig, data: Any) -> VgraphRunner:
    g, loss = make_lstm_lm(cfg)
    return VgraphRunner(g, loss, lm_feed(cfg))


def lm_programs(cfg: LMConfig, data: Any) -> VgraphRunner:
    """The ``vgraph`` column with its loop run as a body program."""
    g, loss = make_lstm_lm(cfg)
    return VgraphRunner(g, loss, lm_feed(cfg), programs=True)


def lm_numpy(cfg: LMConfig, data: Any) -> NumpyLM:
    g, _ = make_lstm_lm(cfg)  # the same initial weights as the vgraph column (same seed)
    return NumpyLM({k: g.params.value(k) for k in LM_PARAMS})


# ---------------------------------------------------------------------------- task (b): BiLSTM tagger


@dataclass
class TaggerConfig:
    vocab: int = 20_000
    embed: int = 128
    hidden: int = 50
    mlp: int = 32
    tags: int = 5
    mb: int = 1
    sparse: bool = False
    #: the batch32 and torch columns: sparse embedding gradients and lazy Adam / SparseAdam (True,
    #: the default) or dense embedding gradients and Adam (``--dense-embeddings``)
    sparse_updates: bool = True
    #: the ``bidirectional`` column: both directions as one loop (``nn.Bidirectional``) instead
    #: of two loops, as DyNet's benchmark writes them
    bidirectional: bool = False
    dtype: Any = DTYPE
    seed: int = 0


def make_bilstm_tagger(cfg: TaggerConfig) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The tagger as a VirtualGraph (one sentence per build); returns ``(g, loss)``."""
    H = cfg.hidden
    g = vg.VirtualGraph(dtype=cfg.dtype, seed=cfg.seed, name="bilstm_tagger")
    tokens = g.input("tokens", shape=(None, 1))
    tags = g.input("tags", shape=(None,))
    emb = nn.Embedding(g, cfg.vocab, cfg.embed, "emb", sparse=cfg.sparse)
    cells = {"fwd": nn.LSTMCell(g, cfg.embed, H, "fwd"), "bwd": nn.LSTMCell(g, cfg.embed, H, "bwd")}
    mlp = nn.Linear(g, 2 * H, cfg.mlp, "mlp")
    out = nn.Linear(g, cfg.mlp, cfg.tags, "out")
    zeros = g.constant(np.zeros((1, H), dtype=cfg.dtype), name="zeros")
    embedded = emb(tokens)  # (T, 1, E)

    def run(sequence: Any, cell: nn.LSTMCell, name: str) -> Any:
        with g.loop(name=name) as L:
            x_t = L.step(sequence)
            h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
            h_new, c_new = cell(x_t, (h, c))
            L.update(h, h_new)
            L.update(c, c_new)
        return L.stack(h_new)  # (T, 1, H)

    if cfg.bidirectional:
        both = nn.Bidirectional(cells["fwd"], cells["bwd"])(embedded)  # (T, 1, 2H)
    else:
        forward = run(embedded, cells["fwd"], "forward")
        backward = run(embedded[::-1], cells["bwd"], "backward")[::-1]
        both = vg.concat([forward, backward], axis=-1)
    features = both.reshape(-1, 2 * H)  # (T, 2H)
    loss = losses.cross_entropy(out(vg.tanh(mlp(features))), tags)
    return g, loss


def tagger_feed(b: TagBatch) -> dict[str, Any]:
    return {"tokens": b.tokens, "tags": b.tags}


def check_bilstm_tagger(seed: int = 0) -> dict[str, Any]:
    """Finite differences (``vg.gradcheck``, float64) agree with the tagger's gradients on a small
    instance (else :class:`BenchmarkMismatch`)."""
    cfg = TaggerConfig(vocab=30, embed=4, hidden=3, mlp=4, tags=5, dtype=np.float64, seed=seed)
    g, loss = make_bilstm_tagger(cfg)
    batch = tagger_batches(1, cfg.vocab, cfg.tags, seed + 3)[0]
    cg = g.build(tagger_feed(batch), loss)
    try:
        res = vg.gradcheck(cg.outputs[0], cg.parameters(), atol=1e-6, rtol=1e-5)
    except vg.GradcheckError as e:
        raise BenchmarkMismatch(f"bilstm_tagger: gradcheck failed: {e}") from None
    return {
        "gradcheck": "passed",
        "parameters": len(cg.parameters()),
        "words": batch.words,
        "result": str(res)[:200],
    }


def tagger_vgraph(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    g, loss = make_bilstm_tagger(cfg)
    return VgraphRunner(g, loss, tagger_feed)


def tagger_sparse(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    g, loss = make_bilstm_tagger(TaggerConfig(**{**vars(cfg), "sparse": True}))
    return VgraphRunner(g, loss, tagger_feed, lazy=True)


def tagger_programs(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    """The ``sparse`` column with its loops run as body programs."""
    g, loss = make_bilstm_tagger(TaggerConfig(**{**vars(cfg), "sparse": True}))
    return VgraphRunner(g, loss, tagger_feed, lazy=True, programs=True)


def tagger_bidirectional(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    """The ``programs`` column with both directions as one loop (``nn.Bidirectional``)."""
    g, loss = make_bilstm_tagger(TaggerConfig(**{**vars(cfg), "sparse": True, "bidirectional": True}))
    return VgraphRunner(g, loss, tagger_feed, lazy=True, programs=True)


# ---------------------------------------------------------------------------- task (c): Tree-LSTM


@dataclass
class TreeBatch:
    """One sentence and its binary tree, nodes in post-order (children first, the root last)."""

    children: np.ndarray  # (N, 2) int: child indices, -1 for a leaf
    tokens: np.ndarray  # (N,) int: the word at a leaf, TREE_INNER at an inner node
    is_leaf: np.ndarray  # (N,) int: 1 at a leaf
    labels: np.ndarray  # (N,) int in 0..4
    words: int  # leaves = the sentence's length


TREE_INNER = 0  # the token id of inner nodes (they have no word)


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
    numbered in post-order (without recursion); labels by the polarity rule (module docstring)."""
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
    tokens = np.array([int(words[t]) if t < n else TREE_INNER for t in order], dtype=np.int64)
    labels = np.clip(np.array([score[t] for t in order]), -2, 2) + 2
    return TreeBatch(children.reshape(-1, 2), tokens, (tokens != TREE_INNER).astype(np.int64), labels, n)


def tree_batches(n: int, vocab: int, seed: int) -> list[TreeBatch]:
    """``n`` sentences with Zipf-distributed words in ``[1, vocab)`` and random trees."""
    rng = np.random.default_rng(seed)
    lengths = sst_lengths(rng, n)
    tokens = zipf_tokens(rng, vocab, int(lengths.sum()))
    return [random_tree(rng, s) for s in np.split(tokens, np.cumsum(lengths)[:-1])]


@dataclass
class TreeConfig:
    vocab: int = 18_000
    embed: int = 128
    hidden: int = 128
    labels: int = 5
    sparse: bool = False
    sparse_updates: bool = True  # as TaggerConfig.sparse_updates
    dtype: Any = DTYPE
    seed: int = 0


def _leaf_or_inner(is_leaf: np.ndarray) -> int:
    return 0 if int(is_leaf) else 1


def make_tree_lstm(cfg: TreeConfig) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The Tree-LSTM classifier of every node as a VirtualGraph (one tree per build); returns
    ``(g, loss)``."""
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
        # a leaf, from its word (x W_leaf does not read the children: hoisted over all nodes)
        z = emb(r.step(tokens, name="token")) @ W_leaf + b_leaf
        gl = vg.sigmoid(z[: 2 * H])
        c_leaf = gl[:H] * vg.tanh(z[2 * H :])
        h_leaf = gl[H:] * vg.tanh(c_leaf)
        # an inner node, from its children
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


def check_tree_lstm(seed: int = 0) -> dict[str, Any]:
    """Finite differences agree with the Tree-LSTM's gradients (float64, a small tree with a
    repeated word), and the sparse model's gradients equal the dense model's bit for bit (else
    :class:`BenchmarkMismatch`)."""
    cfg = TreeConfig(vocab=30, embed=4, hidden=3, dtype=np.float64, seed=seed)
    batch = random_tree(np.random.default_rng(seed + 3), np.array([5, 7, 5, 2, 9]))
    g, loss = make_tree_lstm(cfg)
    cg = g.build(tree_feed(batch), loss)
    try:
        res = vg.gradcheck(cg.outputs[0], cg.parameters(), atol=1e-6, rtol=1e-5)
    except vg.GradcheckError as e:
        raise BenchmarkMismatch(f"tree_lstm: gradcheck failed: {e}") from None
    grads = {}
    for sparse in (False, True):
        gs, ls = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": sparse}))
        gs.build(tree_feed(batch), ls).backward(ls)
        grads[sparse] = {k: p.grad for k, p in gs.params.items()}
    if not isinstance(grads[True]["emb.W"], RowSparseGrad) or not all(
        np.array_equal(np.asarray(grads[True][k]), grads[False][k]) for k in grads[False]
    ):
        raise BenchmarkMismatch("tree_lstm: the sparse model's gradients differ from the dense model's")
    return {
        "gradcheck": "passed",
        "parameters": len(cg.parameters()),
        "words": batch.words,
        "nodes": len(batch.tokens),
        "sparse_equals_dense": True,
        "result": str(res)[:200],
    }


def tree_vgraph(cfg: TreeConfig, data: Any) -> VgraphRunner:
    g, loss = make_tree_lstm(cfg)
    return VgraphRunner(g, loss, tree_feed)


def tree_batched(cfg: TreeConfig, data: Any) -> VgraphRunner:
    g, loss = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": cfg.sparse_updates}))
    return AutobatchRunner(g, loss, tree_feed, len(data), lazy=cfg.sparse_updates)


def tagger_batched(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    g, loss = make_bilstm_tagger(TaggerConfig(**{**vars(cfg), "sparse": cfg.sparse_updates}))
    return AutobatchRunner(g, loss, tagger_feed, len(data), lazy=cfg.sparse_updates)


def tagger_batched_programs(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    """The ``batch32`` column with its loops run as one body program over the group's sentences
    (``build_batch(..., programs=True)``)."""
    g, loss = make_bilstm_tagger(TaggerConfig(**{**vars(cfg), "sparse": cfg.sparse_updates}))
    return AutobatchRunner(g, loss, tagger_feed, len(data), lazy=cfg.sparse_updates, programs=True)


def tagger_batched_bidirectional(cfg: TaggerConfig, data: Any) -> VgraphRunner:
    """The ``batch32_programs`` column with both directions as one loop (``nn.Bidirectional``)."""
    g, loss = make_bilstm_tagger(
        TaggerConfig(**{**vars(cfg), "sparse": cfg.sparse_updates, "bidirectional": True})
    )
    return AutobatchRunner(g, loss, tagger_feed, len(data), lazy=cfg.sparse_updates, programs=True)


def tree_batched_programs(cfg: TreeConfig, data: Any) -> VgraphRunner:
    """The ``batch32`` column with the recursion run as one body program over the group's tree
    nodes, level by level (``build_batch(..., programs=True)``)."""
    g, loss = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": cfg.sparse_updates}))
    return AutobatchRunner(g, loss, tree_feed, len(data), lazy=cfg.sparse_updates, programs=True)


def tree_programs(cfg: TreeConfig, data: Any) -> VgraphRunner:
    """The ``sparse`` column with its recursion run as a body program."""
    g, loss = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": True}))
    return VgraphRunner(g, loss, tree_feed, lazy=True, programs=True)


def tree_sparse(cfg: TreeConfig, data: Any) -> VgraphRunner:
    g, loss = make_tree_lstm(TreeConfig(**{**vars(cfg), "sparse": True}))
    return VgraphRunner(g, loss, tree_feed, lazy=True)


# ---------------------------------------------------------------------------- autobatching: LM and adaptive loop


class AutobatchLM(VgraphRunner):
    """The language model autobatched (column ``batch`` of ``lstm_lm``): the round's sentences
    unsorted and unpadded — shuffled, cut into groups of ``mb`` in that order — each a one-sentence
    build, ``g.build_batch`` per group, the loss the group's mean over its words (each sentence's
    weights ``1/words of the group``, summed), as in the padded column. The same sentences and
    words per round as the other columns (which train on the length-sorted, padded minibatches);
    ``step`` ignores the padded batch it is given and takes the next group."""

    def __init__(self, cfg: LMConfig, data: list[LMBatch]) -> None:
        g, loss = make_lstm_lm(cfg)
        super().__init__(g, loss, lambda b: {})
        sentences = []
        for b in data:  # unpad: the real positions of each column
            T, B = b.tokens.shape
            mask = b.weights.reshape(T, B) > 0
            targets = b.targets.reshape(T, B)
            for j in range(B):
                n = int(mask[:, j].sum())
                sentences.append((b.tokens[:n, j : j + 1].copy(), targets[:n, j].copy()))
        order = np.random.default_rng(cfg.mb + 1000).permutation(len(sentences))
        self.groups = [[sentences[i] for i in order[k : k + cfg.mb]] for k in range(0, len(order), cfg.mb)]
        self.zeros = np.zeros((1, cfg.hidden), dtype=cfg.dtype)
        self.dtype = cfg.dtype
        self.k = 0

    def step(self, batch: Any) -> tuple[float, Phases]:
        group = self.groups[self.k % len(self.groups)]
        self.k += 1
        words = sum(len(t) for t, _ in group)
        feeds = [
            {
                "tokens": t,
                "targets": y,
                "weights": np.full(len(y), 1.0 / words, dtype=self.dtype),
                "zeros": self.zeros,
            }
            for t, y in group
        ]
        clock = _Clock()
        batched = self.g.build_batch(feeds, self.loss)
        build = clock.lap()
        self.opt.zero_grad()
        value = batched.backward("sum")
        backward = clock.lap()
        self.opt.step()
        self.nodes.append(len(batched.graph))
        del batched  # freeing the graph is part of a training step: timed with the update
        update = clock.lap()
        return value, {"build": build, "forward": (0.0, 0.0), "backward": backward, "update": update}


def lm_batched(cfg: LMConfig, data: Any) -> VgraphRunner:
    return AutobatchLM(cfg, data)


def _example(name: str) -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class AdaptiveConfig:
    hidden: int = 16
    tol: float = 1e-2
    max_steps: int = 30
    seed: int = 0


@dataclass
class AdaptiveBatch:
    """One input of the adaptive while-loop (``examples/adaptive_loop.py``): ``a``, whose square
    root the model refines until its update is below ``tol``."""

    a: float
    tokens: np.ndarray  # (1,): one input (for the sentence count)
    words: int = 1


def _adaptive_data(cfg: AdaptiveConfig, quick: bool) -> list[AdaptiveBatch]:
    roots = np.random.default_rng(17).uniform(0.5, 4.0, 8 if quick else 128)
    return [AdaptiveBatch(float(r * r), np.zeros(1)) for r in roots]


def _adaptive_model(cfg: AdaptiveConfig) -> tuple[vg.VirtualGraph, vg.VirtualNode, Any]:
    m = _example("adaptive_loop")
    g, outs = m.build_model(cfg.hidden, cfg.tol, cfg.max_steps, cfg.seed)
    return g, outs["loss"], outs["loop"]


def _adaptive_feed(b: AdaptiveBatch) -> dict[str, Any]:
    return {"a": np.array([[b.a]]), "target": np.array([[np.sqrt(b.a)]]), "z0": np.array([[1.0]])}


class DataDependentRunner(VgraphRunner):
    """One input at a time, for a model whose structure depends on values: build, backward,
    update (no re-run of the forward after the update, which would meet another trip count and
    rightly refuse: the forward is part of the build here)."""

    splits_forward = False


def adaptive_vgraph(cfg: AdaptiveConfig, data: Any) -> VgraphRunner:
    g, loss, _ = _adaptive_model(cfg)
    return DataDependentRunner(g, loss, _adaptive_feed)


def adaptive_batched(cfg: AdaptiveConfig, data: Any) -> VgraphRunner:
    g, loss, _ = _adaptive_model(cfg)
    return AutobatchRunner(g, loss, _adaptive_feed, len(data))


def check_adaptive() -> dict[str, Any]:
    """Autobatched = one at a time on the adaptive loop: every trip count (decided per input from
    its own values), the losses and every parameter gradient (float64, 1e-12)."""
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        return _check_adaptive()
    finally:
        vg.set_default_dtype(previous)


def _check_adaptive() -> dict[str, Any]:
    cfg = AdaptiveConfig()
    data = _adaptive_data(cfg, quick=True) + [AdaptiveBatch(a, np.zeros(1)) for a in (0.3, 9.0, 16.0)]
    feeds = [_adaptive_feed(b) for b in data]
    g1, loss1, loop1 = _adaptive_model(cfg)
    total, trips = 0.0, []
    for f in feeds:
        cg = g1.build(f, loss1, cache=False)
        total += float(cg.backward(loss1))
        trips.append(cg.trip_count(loop1))
    g2, loss2, loop2 = _adaptive_model(cfg)
    batch = g2.build_batch(feeds, loss2)
    value = batch.backward("sum")
    batched_trips = [view.trip_count(loop2) for view in batch.inputs]
    if batched_trips != trips:
        raise BenchmarkMismatch(f"adaptive_loop: trip counts differ: {batched_trips} batched, {trips} alone")
    errs = [abs(value - total) / max(abs(total), 1e-300)]
    for k, p in g1.params.items():
        errs.append(_max_rel_err(np.asarray(g2.params[k].grad), np.asarray(p.grad)))
    if max(errs) > 1e-12:
        raise BenchmarkMismatch(
            f"adaptive_loop: autobatched differs from one at a time (max relative error {max(errs):.1e})"
        )
    return {
        "decisions_equal": True,
        "trip_counts": sorted(set(trips)),
        "max_rel_err_batch": max(errs),
        "inputs": len(feeds),
    }


# ---------------------------------------------------------------------------- PyTorch eager columns
#
# The same models in PyTorch eager mode, written as a careful PyTorch user writes them (nn.LSTM,
# packed sequences, level-by-level tree batching, SparseAdam for sparse embeddings), on one CPU
# thread. Each model holds its PyTorch modules and a map from vgraph's parameter names to its
# tensors (transposed where PyTorch stores ``(out, in)``), so that both sides start from the same
# weights and their gradients and updated parameters can be compared name by name. PyTorch's
# LSTM has two biases (``b_ih + b_hh``); vgraph's one is ``bias_ih``, and ``bias_hh`` is held at
# zero without a gradient, so both train the same model.


def _torch() -> Any:
    torch = load_torch()
    if torch is None:
        raise RuntimeError(TORCH_MISSING)
    return torch


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    return torch.float64 if np.dtype(dtype) == np.float64 else torch.float32


class TorchModel:
    """A PyTorch model of a task; subclasses set :attr:`tensors` and define :meth:`loss`."""

    #: vgraph parameter name -> (PyTorch tensor, stored transposed)
    tensors: dict[str, tuple[Any, bool]]
    #: the tensor updated by SparseAdam in the sparse configuration (its module has sparse=True)
    sparse_tensor: Any = None

    def _lstm(self, lstm: Any, prefix: str, suffix: str = "") -> None:
        self.tensors[f"{prefix}.W_x"] = (getattr(lstm, f"weight_ih_l0{suffix}"), True)
        self.tensors[f"{prefix}.W_h"] = (getattr(lstm, f"weight_hh_l0{suffix}"), True)
        self.tensors[f"{prefix}.b"] = (getattr(lstm, f"bias_ih_l0{suffix}"), False)
        fixed = getattr(lstm, f"bias_hh_l0{suffix}")
        fixed.requires_grad_(False)
        with _torch().no_grad():
            fixed.zero_()

    def load(self, params: dict[str, np.ndarray]) -> None:
        """Copy vgraph's parameter values in."""
        torch = _torch()
        with torch.no_grad():
            for k, (t, transposed) in self.tensors.items():
                value = np.asarray(params[k])
                t.copy_(torch.from_numpy(np.ascontiguousarray(value.T if transposed else value)))

    def export(self, grads: bool = False) -> dict[str, np.ndarray]:
        """The parameter values (or gradients) by vgraph name, in vgraph's layout."""
        out = {}
        for k, (t, transposed) in self.tensors.items():
            v = t.grad if grads else t
            if v is not None and v.is_sparse:
                v = v.coalesce().to_dense()
            a = np.zeros(tuple(t.shape)) if v is None else v.detach().numpy()
            out[k] = a.T if transposed else a
        return out

    def loss(self, items: list[Any]) -> Any:
        """The loss of one update on ``items`` (a list of one batch, or of a group's inputs)."""
        raise NotImplementedError


class TorchLM(TorchModel):
    """The LSTM LM: ``nn.Embedding``, ``nn.LSTM`` over the padded ``(T, B)`` batch, ``nn.Linear``,
    the masked mean cross-entropy (per-word weights, as the vgraph model)."""

    def __init__(self, cfg: LMConfig) -> None:
        torch = _torch()
        dt = _torch_dtype(torch, cfg.dtype)
        self.emb = torch.nn.Embedding(cfg.vocab, cfg.embed, dtype=dt)
        self.lstm = torch.nn.LSTM(cfg.embed, cfg.hidden, dtype=dt)
        self.out = torch.nn.Linear(cfg.hidden, cfg.vocab, dtype=dt)
        self.tensors = {"emb.W": (self.emb.weight, False)}
        self._lstm(self.lstm, "lstm")
        self.tensors.update({"out.W": (self.out.weight, True), "out.b": (self.out.bias, False)})
        self.H = cfg.hidden

    def loss(self, items: list[LMBatch]) -> Any:
        torch = _torch()
        (b,) = items
        hs, _ = self.lstm(self.emb(torch.from_numpy(b.tokens)))  # (T, B, H)
        logits = self.out(hs.reshape(-1, self.H))
        ce = torch.nn.functional.cross_entropy(logits, torch.from_numpy(b.targets), reduction="none")
        return (ce * torch.from_numpy(b.weights)).sum()


class TorchTagger(TorchModel):
    """The BiLSTM tagger: one ``nn.LSTM(bidirectional=True)``. One sentence: the ``(T, 1, E)``
    embedded sentence through it. A group: the sentences' embeddings (only their real words)
    packed with ``pack_sequence`` through it once; the loss on the packed outputs against the
    tags packed the same way, each word weighted ``1 / (its sentence's length * sentences)``:
    the mean over sentences of each sentence's mean, as vgraph's ``build_batch`` ``"mean"``."""

    def __init__(self, cfg: TaggerConfig, sparse: bool) -> None:
        torch = _torch()
        dt = _torch_dtype(torch, cfg.dtype)
        self.emb = torch.nn.Embedding(cfg.vocab, cfg.embed, sparse=sparse, dtype=dt)
        self.lstm = torch.nn.LSTM(cfg.embed, cfg.hidden, bidirectional=True, dtype=dt)
        self.mlp = torch.nn.Linear(2 * cfg.hidden, cfg.mlp, dtype=dt)
        self.out = torch.nn.Linear(cfg.mlp, cfg.tags, dtype=dt)
        self.tensors = {"emb.W": (self.emb.weight, False)}
        self._lstm(self.lstm, "fwd")
        self._lstm(self.lstm, "bwd", "_reverse")
        for name, lin in (("mlp", self.mlp), ("out", self.out)):
            self.tensors.update({f"{name}.W": (lin.weight, True), f"{name}.b": (lin.bias, False)})
        self.sparse_tensor = self.emb.weight if sparse else None
        self.dtype = dt

    def loss(self, items: list[TagBatch]) -> Any:
        torch = _torch()
        F = torch.nn.functional
        if len(items) == 1:
            b = items[0]
            feats, _ = self.lstm(self.emb(torch.from_numpy(b.tokens)))  # (T, 1, 2H)
            logits = self.out(torch.tanh(self.mlp(feats.reshape(b.words, -1))))
            return F.cross_entropy(logits, torch.from_numpy(b.tags))
        rnn = torch.nn.utils.rnn
        lengths = [b.words for b in items]
        tokens = torch.from_numpy(np.concatenate([b.tokens.reshape(-1) for b in items]))
        embedded = self.emb(tokens).split(lengths)
        packed, _ = self.lstm(rnn.pack_sequence(embedded, enforce_sorted=False))
        tags = rnn.pack_sequence([torch.from_numpy(b.tags) for b in items], enforce_sorted=False)
        weights = [torch.full((n,), 1.0 / (n * len(items)), dtype=self.dtype) for n in lengths]
        w = rnn.pack_sequence(weights, enforce_sorted=False)
        logits = self.out(torch.tanh(self.mlp(packed.data)))
        return (F.cross_entropy(logits, tags.data, reduction="none") * w.data).sum()


class TorchTree(TorchModel):
    """The Tree-LSTM. One tree: the leaves' ``x W_leaf + b_leaf`` as one product (vgraph hoists
    it too), then a Python cell per inner node in post-order (children first). A group: the trees'
    nodes concatenated, every node's height (leaves 0, else one more than its higher child), the
    leaves of all trees in one call, then the inner nodes of each height across the group in one
    cell call, gathering their children's states by index; the loss each node weighted
    ``1 / (its tree's nodes * trees)``, as vgraph's ``build_batch`` ``"mean"``."""

    def __init__(self, cfg: TreeConfig, sparse: bool) -> None:
        torch = _torch()
        dt = _torch_dtype(torch, cfg.dtype)
        E, H = cfg.embed, cfg.hidden

        def param(*shape: int) -> Any:
            return torch.nn.Parameter(torch.zeros(shape, dtype=dt))

        self.emb = torch.nn.Embedding(cfg.vocab, E, sparse=sparse, dtype=dt)
        self.W_leaf, self.b_leaf, self.U, self.b = (
            param(E, 3 * H),
            param(3 * H),
            param(2 * H, 5 * H),
            param(5 * H),
        )
        self.head = torch.nn.Linear(H, cfg.labels, dtype=dt)
        self.tensors = {
            "emb.W": (self.emb.weight, False), "leaf.W": (self.W_leaf, False), "leaf.b": (self.b_leaf, False),
            "inner.U": (self.U, False), "inner.b": (self.b, False),
            "head.W": (self.head.weight, True), "head.b": (self.head.bias, False),
        }  # fmt: skip
        self.sparse_tensor = self.emb.weight if sparse else None
        self.H, self.dtype = H, dt

    def _leaves(self, tokens: Any) -> tuple[Any, Any]:
        torch, H = _torch(), self.H
        z = self.emb(tokens) @ self.W_leaf + self.b_leaf
        g = torch.sigmoid(z[:, : 2 * H])
        c = g[:, :H] * torch.tanh(z[:, 2 * H :])
        return g[:, H:] * torch.tanh(c), c

    def _inner(self, hl: Any, hr: Any, cl: Any, cr: Any) -> tuple[Any, Any]:
        torch, H = _torch(), self.H
        z = torch.cat([hl, hr], dim=-1) @ self.U + self.b
        g = torch.sigmoid(z[..., : 4 * H])
        c = g[..., :H] * torch.tanh(z[..., 4 * H :]) + g[..., H : 2 * H] * cl + g[..., 2 * H : 3 * H] * cr
        return g[..., 3 * H :] * torch.tanh(c), c

    def loss(self, items: list[TreeBatch]) -> Any:
        torch = _torch()
        F = torch.nn.functional
        if len(items) == 1:
            t = items[0]
            leaves = np.flatnonzero(t.is_leaf)
            hl, cl = self._leaves(torch.from_numpy(t.tokens[leaves]))
            h: list[Any] = [None] * len(t.tokens)
            c: list[Any] = [None] * len(t.tokens)
            for k, (hk, ck) in zip(leaves.tolist(), zip(hl.unbind(0), cl.unbind(0))):
                h[k], c[k] = hk, ck
            for k, (a, b) in enumerate(t.children.tolist()):
                if a >= 0:
                    h[k], c[k] = self._inner(h[a], h[b], c[a], c[b])
            return F.cross_entropy(self.head(torch.stack(h)), torch.from_numpy(t.labels))
        offsets = np.cumsum([0] + [len(t.tokens) for t in items])
        children = np.concatenate(
            [np.where(t.children >= 0, t.children + o, -1) for t, o in zip(items, offsets)]
        )
        tokens = np.concatenate([t.tokens for t in items])
        labels = np.concatenate([t.labels for t in items])
        weights = np.concatenate([np.full(len(t.tokens), 1.0 / (len(t.tokens) * len(items))) for t in items])
        height = np.zeros(len(tokens), dtype=np.int64)
        for k, (a, b) in enumerate(children.tolist()):  # post-order: children come first
            if a >= 0:
                height[k] = 1 + max(height[a], height[b])
        leaves = np.flatnonzero(children[:, 0] < 0)
        hl, cl = self._leaves(torch.from_numpy(tokens[leaves]))
        idx = torch.from_numpy(leaves)
        h = torch.zeros((len(tokens), self.H), dtype=self.dtype).index_copy(0, idx, hl)
        c = torch.zeros((len(tokens), self.H), dtype=self.dtype).index_copy(0, idx, cl)
        for level in range(1, int(height.max()) + 1):
            nodes = np.flatnonzero(height == level)
            a, b = torch.from_numpy(children[nodes, 0]), torch.from_numpy(children[nodes, 1])
            hn, cn = self._inner(h[a], h[b], c[a], c[b])
            idx = torch.from_numpy(nodes)
            h, c = h.index_copy(0, idx, hn), c.index_copy(0, idx, cn)
        ce = F.cross_entropy(self.head(h), torch.from_numpy(labels), reduction="none")
        return (ce * torch.from_numpy(weights).to(self.dtype)).sum()


class TorchRunner:
    """A PyTorch model trained by ``loss.backward()`` and Adam (``SparseAdam`` for a sparse
    embedding, Adam for the rest: the same update as vgraph's ``Adam(lazy=True)`` up to where ε
    is added, see :class:`vgraph.optim.Adam`). ``group > 1``: as :class:`AutobatchRunner`, the
    one-input batches are kept until a group (or the round's last) is complete, and that step
    reports the group's time."""

    splits_forward = False

    def __init__(self, model: TorchModel, per_round: int = 0, group: int = 1, eps: float = EPS) -> None:
        torch = _torch()
        self.model, self.per_round, self.group = model, per_round, group
        sparse = model.sparse_tensor
        dense = [t for t, _ in model.tensors.values() if t is not sparse]
        self.opts = [torch.optim.Adam(dense, lr=LR, betas=BETAS, eps=eps)]
        if sparse is not None:
            self.opts.append(torch.optim.SparseAdam([sparse], lr=LR, betas=BETAS, eps=eps))
        self.pending: list[Any] = []
        self.seen = 0
        self.last = 0.0

    def train(self, items: list[Any]) -> tuple[float, Phases]:
        """One update on ``items``; the loss and the phase times."""
        clock = _Clock()
        loss = self.model.loss(items)
        forward = clock.lap()
        loss.backward()
        value = loss.item()
        backward = clock.lap()
        for opt in self.opts:
            opt.step()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        del loss  # the autograd graph is freed here, as vgraph's columns free theirs
        update = clock.lap()
        self.last = value
        return value, {"build": (0.0, 0.0), "forward": forward, "backward": backward, "update": update}

    def step(self, batch: Any) -> tuple[float, Phases]:
        self.pending.append(batch)
        self.seen += 1
        if self.group > 1 and len(self.pending) < self.group and self.seen % self.per_round:
            zero = (0.0, 0.0)
            return self.last, {"build": zero, "forward": zero, "backward": zero, "update": zero}
        items, self.pending = self.pending, []
        return self.train(items)

    def params(self) -> dict[str, np.ndarray]:
        return self.model.export()

    def held_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t, _ in self.model.tensors.values())
        for opt in self.opts:
            for st in opt.state.values():
                n += sum(v.numel() * v.element_size() for v in st.values() if hasattr(v, "numel") and v.dim())
        return n


def _torch_runner(model: TorchModel, g: vg.VirtualGraph, per_round: int = 0, group: int = 1) -> TorchRunner:
    model.load({k: g.params.value(k) for k in g.params})  # the vgraph columns' initial weights
    return TorchRunner(model, per_round, group)


def lm_torch(cfg: LMConfig, data: Any) -> TorchRunner:
    return _torch_runner(TorchLM(cfg), make_lstm_lm(cfg)[0])


def tagger_torch(cfg: TaggerConfig, data: Any) -> TorchRunner:
    return _torch_runner(TorchTagger(cfg, cfg.sparse_updates), make_bilstm_tagger(cfg)[0])


def tagger_torch_batched(cfg: TaggerConfig, data: Any) -> TorchRunner:
    return _torch_runner(TorchTagger(cfg, cfg.sparse_updates), make_bilstm_tagger(cfg)[0], len(data), 32)


def tree_torch(cfg: TreeConfig, data: Any) -> TorchRunner:
    return _torch_runner(TorchTree(cfg, cfg.sparse_updates), make_tree_lstm(cfg)[0])


def tree_torch_batched(cfg: TreeConfig, data: Any) -> TorchRunner:
    return _torch_runner(TorchTree(cfg, cfg.sparse_updates), make_tree_lstm(cfg)[0], len(data), 32)


def _vgraph_update(
    g: vg.VirtualGraph, loss: vg.VirtualNode, feeds: list[dict[str, Any]], programs: bool = False
) -> float:
    """Loss of one build (one input) or of ``build_batch`` (the mean over the inputs; its loops
    as body programs over rows with ``programs``), after which the gradients are in ``g.params``."""
    g.params.zero_grad()
    if len(feeds) == 1:
        cg = g.build(feeds[0], loss)
        return float(cg.backward(cg.outputs[0]))
    return float(g.build_batch(feeds, loss, programs=programs).backward("mean"))


def torch_agrees(
    what: str,
    g: vg.VirtualGraph,
    loss: vg.VirtualNode,
    feed: Callable[[Any], dict[str, Any]],
    model: TorchModel,
    updates: list[list[Any]],
    lazy: bool,
    tol: float = 1e-10,
    programs: bool = False,
) -> dict[str, float]:
    """The PyTorch model computes what the vgraph model computes (else :class:`BenchmarkMismatch`):
    from the same weights, the loss and every gradient on ``updates[0]`` and the parameters after
    one Adam update per entry of ``updates`` (each a list of inputs: one, or a group for
    ``build_batch``), to ``tol`` relative. ``lazy``: row-sparse embedding gradients with
    ``Adam(lazy=True)`` against ``SparseAdam``, with ε = 1e-300 on both sides, since ``SparseAdam``
    adds ε to √v before the bias correction (a difference in ε only, :class:`vgraph.optim.Adam`).
    ``programs``: groups are built with ``build_batch(..., programs=True)``. Returns the largest
    relative errors."""
    model.load({k: g.params.value(k) for k in g.params})
    vg_loss = _vgraph_update(g, loss, [feed(b) for b in updates[0]], programs)
    vg_grads = {k: np.array(g.params[k].grad) for k in g.params}
    g.params.zero_grad()
    t_loss = model.loss(updates[0])
    t_loss.backward()
    errs = {"loss": abs(t_loss.item() - vg_loss) / max(abs(vg_loss), 1e-30)}
    t_grads = model.export(grads=True)
    for k in model.tensors:
        errs[k] = _max_rel_err(t_grads[k], vg_grads[k])
    eps = 1e-300 if lazy else EPS  # SparseAdam refuses ε = 0; this one is below float64's rounding
    runner = TorchRunner(model, eps=eps)
    for opt in runner.opts:
        opt.zero_grad(set_to_none=True)
    opt = optim.Adam(g.params, lr=LR, betas=BETAS, eps=eps, lazy=lazy)
    for items in updates:
        _vgraph_update(g, loss, [feed(b) for b in items], programs)
        opt.step()
        runner.train(items)
    g.params.zero_grad()
    after = model.export()
    for k in model.tensors:
        errs[f"{k} after {len(updates)} Adam steps"] = _max_rel_err(after[k], g.params.value(k))
    bad = {k: e for k, e in errs.items() if not e <= tol}
    if bad:
        raise BenchmarkMismatch(f"{what}: PyTorch differs from vgraph (relative errors {bad}, tol {tol})")
    return errs


def check_torch_lm() -> dict[str, Any]:
    """PyTorch's LSTM LM = vgraph's (float64, a padded batch; gradients and two Adam steps)."""
    cfg = LMConfig(vocab=40, embed=6, hidden=5, dtype=np.float64, seed=0)
    g, loss = make_lstm_lm(cfg)
    batches = lm_batches(make_sentences(9, cfg.vocab, 5), 4, 0)
    errs = torch_agrees(
        "lstm_lm torch", g, loss, lm_feed(cfg), TorchLM(cfg), [[batches[0]], [batches[1]]], False
    )
    return {"dense_1": max(errs.values())}


def check_torch_tagger() -> dict[str, Any]:
    """PyTorch's tagger = vgraph's, one sentence and a packed group of three, sparse and dense
    embedding updates (float64)."""
    out = {}
    items = [b for b in tagger_batches(12, 30, 5, seed=3) if b.words >= 2][:6]
    for sparse in (True, False):
        cfg = TaggerConfig(vocab=30, embed=4, hidden=3, mlp=4, tags=5, sparse=sparse, dtype=np.float64)
        # (batch32, batch32_programs; the bidirectional column: one loop for both directions)
        for n, programs, bi in (
            (1, False, False),
            (3, False, False),
            (3, True, False),
            (1, True, True),
            (3, True, True),
        ):
            g, loss = make_bilstm_tagger(TaggerConfig(**{**vars(cfg), "bidirectional": bi}))
            updates = [items[:n], items[n : 2 * n]]
            kind = "sparse" if sparse else "dense"
            how = f"{', programs' if programs else ''}{', nn.Bidirectional' if bi else ''}"
            what = f"bilstm_tagger torch ({kind}, {n} sentence(s){how})"
            model = TorchTagger(cfg, sparse)
            errs = torch_agrees(what, g, loss, tagger_feed, model, updates, sparse, programs=programs)
            name = f"{kind}_{n}{'_programs' if programs else ''}{'_bidirectional' if bi else ''}"
            out[name] = max(errs.values())
    return out


def check_torch_tree() -> dict[str, Any]:
    """PyTorch's Tree-LSTM = vgraph's, one tree and a level-by-level group of three, sparse and
    dense embedding updates (float64)."""
    out = {}
    rng = np.random.default_rng(3)
    items = [random_tree(rng, rng.integers(1, 30, size=n)) for n in (5, 1, 7, 4, 2, 6)]
    for sparse in (True, False):
        cfg = TreeConfig(vocab=30, embed=4, hidden=3, sparse=sparse, dtype=np.float64)
        for n, programs in ((1, False), (3, False), (3, True)):  # (batch32, batch32_programs)
            g, loss = make_tree_lstm(cfg)
            updates = [items[:n], items[n : 2 * n]]
            kind = "sparse" if sparse else "dense"
            what = f"tree_lstm torch ({kind}, {n} tree(s){', programs' if programs else ''})"
            model = TorchTree(cfg, sparse)
            errs = torch_agrees(what, g, loss, tree_feed, model, updates, sparse, programs=programs)
            out[f"{kind}_{n}{'_programs' if programs else ''}"] = max(errs.values())
    return out


TORCH_CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "lstm_lm": check_torch_lm,
    "bilstm_tagger": check_torch_tagger,
    "tree_lstm": check_torch_tree,
}


# ---------------------------------------------------------------------------- the registry


@dataclass
class Task:
    """A benchmark task: its configurations (one table row each), data, columns and check.

    ``configs(quick)`` gives the configurations; ``data(config, quick)`` the batches of one round
    (every column trains on the same batches, in the same order); ``columns`` maps a column name to
    ``(make, applies)``: ``make(config, data) -> Runner`` and ``applies(config) -> bool``;
    ``check()`` verifies correctness before any timing (raises :class:`BenchmarkMismatch`).
    """

    name: str
    description: str
    configs: Callable[[bool], list[Any]]
    data: Callable[[Any, bool], list[Any]]
    columns: dict[str, tuple[Callable[[Any, Any], Runner], Callable[[Any], bool]]]
    check: Callable[[], dict[str, Any]] | None = None
    label: Callable[[Any], str] = field(default=lambda cfg: "")


def _lm_configs(quick: bool) -> list[LMConfig]:
    if quick:  # tiny: a smoke run of the code paths, not of the speed
        return [LMConfig(vocab=200, embed=8, hidden=12, mb=mb) for mb in (1, 4)]
    return [LMConfig(mb=mb) for mb in (1, 16, 64)]


def _lm_data(cfg: LMConfig, quick: bool) -> list[LMBatch]:
    n = {1: 40, 16: 12 * 16, 64: 6 * 64}.get(cfg.mb, 4 * cfg.mb) if not quick else 3 * cfg.mb
    return lm_batches(make_sentences(n, cfg.vocab, seed=100 + cfg.mb), cfg.mb, seed=cfg.mb)


def _tagger_configs(quick: bool) -> list[TaggerConfig]:
    return [TaggerConfig(vocab=300, embed=8, hidden=6, mlp=5)] if quick else [TaggerConfig()]


def _tagger_data(cfg: TaggerConfig, quick: bool) -> list[TagBatch]:
    return tagger_batches(3 if quick else 60, cfg.vocab, cfg.tags, seed=7)


def _tree_configs(quick: bool) -> list[TreeConfig]:
    return [TreeConfig(vocab=300, embed=8, hidden=8)] if quick else [TreeConfig()]


def _tree_data(cfg: TreeConfig, quick: bool) -> list[TreeBatch]:
    return tree_batches(3 if quick else 60, cfg.vocab, seed=11)


def _always(cfg: Any) -> bool:
    return True


TASKS: dict[str, Task] = {
    "lstm_lm": Task(
        "lstm_lm",
        "LSTM language model, vocab 10k Zipf, PTB-like lengths, embed 128, hidden 256, Adam",
        _lm_configs,
        _lm_data,
        {
            "vgraph": (lm_vgraph, _always),
            "programs": (lm_programs, _always),
            "numpy": (lm_numpy, lambda cfg: cfg.mb >= 4),
            "batch": (lm_batched, lambda cfg: cfg.mb >= 4),
            "torch": (lm_torch, lambda cfg: cfg.mb >= 4),
        },
        check_lstm_lm,
        label=lambda cfg: f"MB={cfg.mb}",
    ),
    "bilstm_tagger": Task(
        "bilstm_tagger",
        "BiLSTM tagger, one sentence per build, vocab 20k, embed 128, hidden 50, MLP 32, 5 tags, Adam",
        _tagger_configs,
        _tagger_data,
        {
            "vgraph": (tagger_vgraph, _always),
            "sparse": (tagger_sparse, _always),
            "programs": (tagger_programs, _always),
            "bidirectional": (tagger_bidirectional, _always),
            "batch32": (tagger_batched, _always),
            "batch32_programs": (tagger_batched_programs, _always),
            "batch32_bidirectional": (tagger_batched_bidirectional, _always),
            "torch": (tagger_torch, _always),
            "torch_batch32": (tagger_torch_batched, _always),
        },
        check_bilstm_tagger,
        label=lambda cfg: "1 sentence",
    ),
    "tree_lstm": Task(
        "tree_lstm",
        "Tree-LSTM sentiment, SST-shaped trees (1-50 words, mean 19), one tree per build, vocab 18k, "
        "embed 128, hidden 128, 5 labels at every node, Adam",
        _tree_configs,
        _tree_data,
        {
            "vgraph": (tree_vgraph, _always),
            "sparse": (tree_sparse, _always),
            "programs": (tree_programs, _always),
            "batch32": (tree_batched, _always),
            "batch32_programs": (tree_batched_programs, _always),
            "torch": (tree_torch, _always),
            "torch_batch32": (tree_torch_batched, _always),
        },
        check_tree_lstm,
        label=lambda cfg: "1 tree",
    ),
    "adaptive_loop": Task(
        "adaptive_loop",
        "adaptive while-loop (examples/adaptive_loop.py): refine sqrt(a) until the update is below tol; "
        "trip counts decided per input from its values; one input per build, Adam",
        lambda quick: [AdaptiveConfig()],
        _adaptive_data,
        {"vgraph": (adaptive_vgraph, _always), "batch32": (adaptive_batched, _always)},
        check_adaptive,
        label=lambda cfg: "1 input",
    ),
}


def _sentences(batch: Any) -> int:
    """Sentences in a batch: the columns of a ``(T, B)`` token array, else one."""
    return int(batch.tokens.shape[1]) if batch.tokens.ndim == 2 else 1


# ---------------------------------------------------------------------------- measuring


def peak_step_memory(make: Callable[[], Runner], batch: Any) -> float:
    """Peak memory of the first training step of a fresh runner: what it held before the step
    (parameters, optimiser state, buffers) plus the step's peak traced allocation (tracemalloc),
    which includes whatever the first step creates (optimiser state, a workspace, the graph).
    A throw-away runner takes one step first, so that one-time caches are warm."""
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


#: How a pass orders its columns' steps: ``"interleaved"`` alternates the columns batch by batch
#: (order reversed every batch), ``"blocked"`` runs each column through a whole round's batches
#: in turn (order reversed every round), as training one model does — see docs/performance.md,
#: "Known measurement traps": a column's step right after another column's runs colder caches.
SCHEDULES = ("interleaved", "blocked")


def _timed_pass(
    cols: dict[str, Callable[[Any, Any], Runner]],
    cfg: Any,
    data: list[Any],
    rounds: int,
    warmup: int,
    schedule: str = "interleaved",
) -> dict[str, dict[str, Any]]:
    """Time the columns ``cols`` together: ``rounds`` passes over the batches, each step a plain
    training step, ordered as ``schedule`` says (:data:`SCHEDULES`); then one more pass splits a
    vgraph column's build from its forward (see :func:`run_config`). Returns per column its
    per-round phase sums (wall and CPU seconds), the losses seen and, for a vgraph runner, its
    graphs' node counts. The runners are dropped on return."""
    runners = {name: make(cfg, data) for name, make in cols.items()}
    names = list(runners)
    for i in range(warmup):
        for name in names:
            runners[name].step(data[i % len(data)])
    out: dict[str, dict[str, Any]] = {n: {"wall": [], "cpu": [], "losses": []} for n in names}
    for r in range(rounds):
        sums = {n: dict.fromkeys(PHASES, 0.0) for n in names}
        cpus = {n: dict.fromkeys(PHASES, 0.0) for n in names}
        if schedule == "blocked":
            steps = [(n, b) for n in (names if r % 2 == 0 else names[::-1]) for b in data]
        else:
            steps = [(n, b) for j, b in enumerate(data) for n in (names if j % 2 == 0 else names[::-1])]
        for name, batch in steps:
            loss, phases = runners[name].step(batch)
            out[name]["losses"].append(loss)
            for k in PHASES:
                sums[name][k] += phases[k][0]
                cpus[name][k] += phases[k][1]
        for n in names:
            out[n]["wall"].append(sums[n])
            out[n]["cpu"].append(cpus[n])
    split = {n: [0.0, 0.0] for n in names if getattr(runners[n], "splits_forward", False)}
    for n in split:
        runners[n].measure_forward = True  # type: ignore[attr-defined]
    for batch in data:
        for name in split:
            _, phases = runners[name].step(batch)
            split[name][0] += phases["forward"][0]
            split[name][1] += phases["forward"][1]
    for name, spent in split.items():
        for kind, s in zip(("wall", "cpu"), spent):
            for r in out[name][kind]:
                r["forward"] = s
                r["build"] = max(r["build"] - s, 0.0)
    for n, runner in runners.items():
        out[n]["nodes"] = runner.nodes if isinstance(runner, VgraphRunner) else None
    return out


#: (vgraph column, PyTorch column) compared in "vs torch": the one-at-a-time columns with the same
#: embedding updates (``sparse`` or, with ``--dense-embeddings``, ``vgraph``), autobatched with
#: PyTorch's batched version, the LM's padded minibatches with PyTorch's.
TORCH_PAIRS = (
    ("vgraph", "torch"),
    ("sparse", "torch"),
    ("batch32", "torch_batch32"),
    ("batch32_programs", "torch_batch32"),
    ("programs", "torch"),
    ("bidirectional", "torch"),
    ("batch32_bidirectional", "torch_batch32"),
)


def run_config(
    task: Task,
    cfg: Any,
    rounds: int,
    warmup: int,
    quick: bool,
    torch_columns: bool = True,
    schedule: str = "interleaved",
) -> dict[str, Any]:
    """Time every applicable column of ``task`` on ``cfg``, in one or two passes of
    :func:`_timed_pass` (the columns of a pass alternate batch by batch, so load changes hit them
    alike).

    The autobatched columns (``batch*``) run in a second pass, with a fresh runner of their
    one-at-a-time reference column (``sparse`` if the task has it, else ``vgraph``), whose times
    there give "batch x"; the first pass has every other column. Runners share the process's
    memory allocator, and an autobatched runner's allocations slowed the padded LSTM language
    model's build at 64 sentences by about 100 ms when they alternated (its ratio to the floor
    1.24-1.30 alone with the floor, 1.53-1.67 with the batch runner in the same rounds; paired
    runs, docs/performance.md): each ratio is measured between the two columns it compares.

    The timed rounds are plain training steps; a vgraph column's build is split from its forward
    in one more pass, where each step re-runs the forward after its update (:class:`VgraphRunner`),
    timed apart: the reported "forward" is that pass's, and "build" the timed rounds' build minus
    it. The timed rounds do not re-run the forward because doing so changes what the *next* step's
    allocations find: the re-run replaces every value while the old ones are still alive, and the
    next build of the LSTM language model at 64 sentences then took 60-90 ms more (its ratio to the
    floor 1.22-1.24 without, 1.48-1.53 with, paired runs). No training loop does that.

    The PyTorch columns (``torch*``, left out if not ``torch_columns``) run in the pass of the
    vgraph column they are compared with: ``torch`` in the first, ``torch_batch32`` in the second;
    "vs torch" is the vgraph column's time per batch over the PyTorch one's (:data:`TORCH_PAIRS`)."""
    data = task.data(cfg, quick)
    cols = {
        name: make
        for name, (make, applies) in task.columns.items()
        if applies(cfg) and (torch_columns or not name.startswith("torch"))
    }
    batched = [n for n in cols if n.startswith("batch")]
    second_pass = batched + [n for n in cols if n.startswith("torch_batch")]
    ref = "sparse" if "sparse" in cols else "vgraph"
    timed = _timed_pass(
        {n: m for n, m in cols.items() if n not in second_pass}, cfg, data, rounds, warmup, schedule
    )
    ref_times = timed.get(ref)
    if batched:
        gc.collect()  # the first pass's models are gone
        second = _timed_pass(
            {n: cols[n] for n in [ref, *second_pass] if n in cols}, cfg, data, rounds, warmup, schedule
        )
        ref_times = second.pop(ref, None)
        timed.update(second)
    names = list(cols)
    per_round = {n: timed[n]["wall"] for n in names}  # wall s per phase
    cpu_round = {n: timed[n]["cpu"] for n in names}  # CPU s per phase
    losses_seen = {n: timed[n]["losses"] for n in names}
    words = sum(b.words for b in data)
    sentences = sum(_sentences(b) for b in data)
    for name, seen in losses_seen.items():
        if not all(math.isfinite(v) for v in seen):
            raise BenchmarkMismatch(f"{task.name} {task.label(cfg)} {name}: a non-finite loss")
    median_batch = sorted(data, key=lambda b: b.words)[len(data) // 2]
    result: dict[str, Any] = {
        "task": task.name, "config": task.label(cfg), "settings": {k: v for k, v in vars(cfg).items() if k != "dtype"},
        "batches": len(data), "words_per_round": words, "sentences_per_round": sentences, "rounds": rounds,
        "warmup": warmup, "columns": {},
    }  # fmt: skip
    for name in names:
        totals = [sum(r.values()) for r in per_round[name]]
        med = {k: statistics.median(r[k] for r in per_round[name]) * 1e3 / len(data) for k in PHASES}
        col = {
            "sentences_per_s": statistics.median(sentences / t for t in totals),
            "words_per_s": statistics.median(words / t for t in totals),
            "words_per_s_all": [words / t for t in totals],
            "ms_per_batch": statistics.median(totals) * 1e3 / len(data),
            "phase_ms_per_batch": med,
            "cpu_ms_per_batch": statistics.median(sum(r.values()) for r in cpu_round[name]) * 1e3 / len(data),
            "phase_cpu_ms_per_batch": {
                k: statistics.median(r[k] for r in cpu_round[name]) * 1e3 / len(data) for k in PHASES
            },
            # PyTorch allocates its tensors outside tracemalloc's view: its peak is a lower bound
            "peak_bytes": peak_step_memory(lambda name=name: cols[name](cfg, data), median_batch),
            "peak_traced_only": name.startswith("torch"),
            "first_loss": losses_seen[name][0],
            "last_loss": losses_seen[name][-1],
        }
        if timed[name]["nodes"]:
            col["nodes_per_batch"] = statistics.median(timed[name]["nodes"])
        result["columns"][name] = col
    if "numpy" in result["columns"] and "vgraph" in result["columns"]:
        vgc, npc = result["columns"]["vgraph"], result["columns"]["numpy"]
        result["ratio_vs_numpy"] = vgc["ms_per_batch"] / npc["ms_per_batch"]
        result["ratio_vs_numpy_cpu"] = vgc["cpu_ms_per_batch"] / npc["cpu_ms_per_batch"]
    if "sparse" in result["columns"] and "vgraph" in result["columns"]:
        dense, sparse = result["columns"]["vgraph"], result["columns"]["sparse"]
        result["sparse_speedup"] = dense["ms_per_batch"] / sparse["ms_per_batch"]
        result["sparse_speedup_cpu"] = dense["cpu_ms_per_batch"] / sparse["cpu_ms_per_batch"]
    for vg_name, torch_name in TORCH_PAIRS:
        vg_col, torch_col = result["columns"].get(vg_name), result["columns"].get(torch_name)
        if vg_name == "vgraph" and "sparse" in result["columns"] and getattr(cfg, "sparse_updates", False):
            vg_col = None  # the sparse column is the one with the same embedding updates
        sparse_only = (
            ("sparse", "programs", "bidirectional") if isinstance(cfg, (TaggerConfig, TreeConfig)) else ()
        )
        if vg_name in sparse_only and not getattr(cfg, "sparse_updates", True):
            vg_col = None  # (these columns' embedding updates are sparse, PyTorch's dense)
        if vg_col is not None and torch_col is not None:
            result.setdefault("ratio_vs_torch", {})[vg_name] = {
                "torch": torch_name,
                "wall": vg_col["ms_per_batch"] / torch_col["ms_per_batch"],
                "cpu": vg_col["cpu_ms_per_batch"] / torch_col["cpu_ms_per_batch"],
            }
    if ref_times is not None:  # autobatching over one at a time, both from the second pass
        one_wall = statistics.median(sum(r.values()) for r in ref_times["wall"])
        one_cpu = statistics.median(sum(r.values()) for r in ref_times["cpu"])
        for name in batched:
            many = result["columns"][name]
            result.setdefault("batch_speedup", {})[name] = {
                "over": ref,
                "wall": one_wall * 1e3 / len(data) / many["ms_per_batch"],
                "cpu": one_cpu * 1e3 / len(data) / many["cpu_ms_per_batch"],
            }
    return result


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'task':<14} {'config':<11} {'column':<13} {'sent/s':>8} {'words/s':>9} {'ms/batch':>9} {'build':>8} "
        f"{'forward':>8} {'backward':>9} {'update':>8} {'peak MiB':>9} {'vs floor':>8} {'cpu':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        for name, c in r["columns"].items():
            p = c["phase_ms_per_batch"]
            ratio = cpu = ""
            # PyTorch's tensors are allocated outside tracemalloc's view: no comparable peak
            peak = "-" if c.get("peak_traced_only") else f"{c['peak_bytes'] / 2**20:.1f}"
            if name == "vgraph" and "ratio_vs_numpy" in r:
                ratio, cpu = f"{r['ratio_vs_numpy']:.2f}", f"{r['ratio_vs_numpy_cpu']:.2f}"
            print(
                f"{r['task']:<14} {r['config']:<11} {name:<13} {c['sentences_per_s']:>8,.1f} {c['words_per_s']:>9,.0f} "
                f"{c['ms_per_batch']:>9.2f} {p['build']:>8.2f} {p['forward']:>8.2f} {p['backward']:>9.2f} "
                f"{p['update']:>8.2f} {peak:>9} {ratio:>8} {cpu:>5}"
            )
        if "sparse_speedup" in r:
            print(
                f"{'':<14} {'':<11} sparse x {r['sparse_speedup']:.2f} (cpu {r['sparse_speedup_cpu']:.2f}): the dense "
                "column's time per batch over the sparse one's"
            )
        for name, vt in r.get("ratio_vs_torch", {}).items():
            print(
                f"{'':<14} {'':<11} vs torch {vt['wall']:.2f} (cpu {vt['cpu']:.2f}): {name}'s time per batch over "
                f"{vt['torch']}'s (PyTorch eager, 1 thread)"
            )
        for name, sp in r.get("batch_speedup", {}).items():
            print(
                f"{'':<14} {'':<11} {name} x {sp['wall']:.2f} (cpu {sp['cpu']:.2f}): the {sp['over']} column's "
                f"time per input over {name}'s (autobatching)"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny models and data, checks included")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    ap.add_argument("--rounds", type=int, help="passes over the batches (default 5, quick 1)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps per column (default 2, quick 1)")
    ap.add_argument(
        "--blas-threads", metavar="N", help="BLAS threads (default 1); read before numpy is imported"
    )
    ap.add_argument("--no-torch", action="store_true", help="leave out the PyTorch columns")
    ap.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="interleaved",
        help="columns alternate batch by batch (default) or round by round (each column's steps "
        "back to back, as one model trains)",
    )
    ap.add_argument(
        "--dense-embeddings",
        action="store_true",
        help="tagger and tree: the batch32 and torch columns with dense embedding gradients and Adam "
        "(default: sparse gradients, lazy Adam / SparseAdam)",
    )
    args = ap.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if rounds < 1 or warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    started = _dt.datetime.now(_dt.timezone.utc)
    loadavg_start = list(os.getloadavg())
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(
        f"vgraph dynamic-task benchmark  {started:%Y-%m-%d %H:%M UTC}  numpy {np.__version__}  "
        f"{os.cpu_count()} CPUs  BLAS threads {threads}  rounds {rounds} (+{warmup} warm-up steps), {args.schedule}\n"
    )
    torch = load_torch(not args.no_torch)
    if torch is None:
        print(TORCH_MISSING if not args.no_torch else "PyTorch columns skipped: --no-torch")
    else:
        print(f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} thread(s)")
    checks: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    try:
        for name in args.tasks:
            task = TASKS[name]
            if task.check is not None:
                checks[name] = task.check()
                print(f"correctness: {name}: {_describe_check(checks[name])}")
            if torch is not None and name in TORCH_CHECKS:
                checks[name]["torch"] = TORCH_CHECKS[name]()
                worst = max(checks[name]["torch"].values())
                print(
                    f"correctness: {name}: PyTorch = vgraph (float64; loss, gradients, two Adam steps; "
                    f"{', '.join(checks[name]['torch'])}; max relative error {worst:.1e})"
                )
        print()
        for name in args.tasks:
            task = TASKS[name]
            for cfg in task.configs(args.quick):
                if args.dense_embeddings and hasattr(cfg, "sparse_updates"):
                    cfg.sparse_updates = False
                rows.append(
                    run_config(task, cfg, rounds, warmup, args.quick, torch is not None, args.schedule)
                )
                print(f"  measured {name} {task.label(cfg)}", file=sys.stderr)
    except BenchmarkMismatch as e:
        print(f"\nBENCHMARK ABORTED: {e}", file=sys.stderr)
        return 2
    print()
    print_rows(rows)
    results = {
        "benchmark": "vgraph dynamic tasks (LSTM LM, BiLSTM tagger, Tree-LSTM), training throughput",
        "date": started.isoformat(timespec="seconds"),
        "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
        "machine": {
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__,
            "blas_threads": threads, "vgraph": getattr(vg, "__version__", None),
            "torch": None if torch is None else torch.__version__,
            "torch_threads": None if torch is None else torch.get_num_threads(),
            "loadavg_at_start": loadavg_start,
        },
        "config": {"quick": args.quick, "dense_embeddings": args.dense_embeddings, "rounds": rounds, "warmup": warmup, "lr": LR, "dtype": np.dtype(DTYPE).name, "schedule": args.schedule,
                   "statistic": "median over rounds; phases per batch"},
        "correctness": checks,
        "rows": rows,
    }  # fmt: skip
    results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"\nwrote {args.json}")
    return 0


def _describe_check(report: dict[str, Any]) -> str:
    if report.get("decisions_equal"):
        return (
            f"autobatched = one at a time ({report['inputs']} inputs: trip counts {report['trip_counts']} equal, "
            f"losses and gradients to {report['max_rel_err_batch']:.1e} in float64)"
        )
    if "max_rel_err" in report:
        worst = max(report["max_rel_err"].values())
        return (
            f"numpy floor = vgraph (float64; loss, gradients, one Adam step; max relative error {worst:.1e})"
        )
    text = f"gradients = finite differences (float64 gradcheck, {report['parameters']} parameters)"
    if report.get("sparse_equals_dense"):
        text += "; sparse-embedding gradients = dense ones (bit for bit)"
    return text


if __name__ == "__main__":
    sys.exit(main())
