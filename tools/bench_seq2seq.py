#!/usr/bin/env python3
"""Seq2seq-with-attention benchmark: training throughput of vgraph against PyTorch eager, one
sentence pair at a time and 32 pairs per step, where every pair has its own source and target
lengths.

The model (float32, Adam lr 1e-3, generated data, nothing downloaded) is Luong et al.'s global
dot-product attention with input feeding (OpenNMT's default RNN model):

* a joint source/target vocabulary of 4,000 (``--vocab``; the scale of PyTorch's seq2seq
  translation tutorial, 4,345 French and 2,803 English words; Zipf-distributed tokens; id 0 is
  the sentence boundary: start symbol, end symbol and padding) and one embedding table of 128
  for both sides (as a joint BPE vocabulary);
* an encoder: a bidirectional LSTM of 64 per direction over the source, its states
  ``enc`` ``(S, 128)`` the two directions concatenated per word;
* a decoder: an ``LSTMCell`` of 128 started from the encoder's final states (both directions'
  final ``h`` and ``c`` concatenated), fed at step t the embedding of the previous target word
  concatenated with the previous attentional state ``h~`` (zeros at the first step)::

      h_t, c_t = LSTMCell([emb(y_{t-1}), h~_{t-1}], (h_{t-1}, c_{t-1}))
      a_t = softmax(enc h_t)                 over the pair's own S source words
      ctx_t = a_t enc
      h~_t = tanh([ctx_t, h_t] W_c)          (W_c: 256 x 128, no bias)
      logits_t = h~_t W_o + b_o              (over the 4,000 words)

* the loss: the mean cross-entropy over the pair's target words and its end symbol, teacher
  forcing (the decoder reads the reference, not its own guesses).

Source lengths are gamma-distributed (mean 18, sd 8) and clipped to 5..40; a target has about as
many words (the source length times a log-normal factor of sd 0.15, clipped to 4..39) plus the end
symbol; the target words are a fixed function of the source (its words reversed, re-mapped and
resampled to the target length), so there is something to learn. "Words" are target predictions
(words + end symbol); a round is 64 pairs.

Columns, two configurations (sparse embedding gradients with vgraph's ``Adam(lazy=True)`` and
PyTorch's ``SparseAdam``; dense embedding gradients with ``Adam`` on both sides):

* ``vgraph``: one pair per ``g.build`` + backward + update (the model written for one input:
  the decoder a ``g.loop`` stepping through the embedded target, attention over ``enc``, declared
  outside the loop);
* ``batch32``: the same model, 32 pairs per ``g.build_batch`` (autobatching) op by op across the
  pairs (``programs=False``), backward of the mean of the pairs' losses, one update;
* ``batch32_programs``: the same, as ``build_batch`` runs it by default (``programs=True``): each
  loop one body program over the pairs' rows, the decoder's attention over each pair's own
  encoder states padded to the longest source with its padding masked (``vgraph/virtual/padded.py``);
* ``batch32_masked``: what a vgraph user can do today to make ``build_batch`` group the
  attention of pairs with different source lengths: the same model with the encoder states
  padded by zero rows to 40 (the longest source) and -inf added to the padding's scores before
  the softmax (inputs fed per pair): the same values and gradients, and one shape for every
  pair's attention. ``batch32`` over it is what grouping across lengths is worth;
* ``torch``: PyTorch eager on one thread, one pair at a time, as a careful PyTorch user writes it
  (``nn.LSTM(bidirectional=True)`` for the encoder, an ``nn.LSTMCell`` loop for the decoder,
  the output layer once over all steps);
* ``torch_batch32``: 32 pairs per step, padded: the encoder through ``pack_padded_sequence``,
  the decoder over the longest target with the scores of padded source positions masked to
  -inf before the softmax and the losses of padded target positions weighted 0 (each real word
  ``1 / (its pair's target length * pairs)``: the mean over pairs of each pair's mean, as
  ``build_batch``'s ``"mean"``).

Before any timing (:func:`check_seq2seq`, :func:`check_torch_seq2seq`): vgraph's gradients
agree with finite differences (``vg.gradcheck``, float64, a tiny instance), the sparse model's
gradients with the dense model's, ``build_batch`` of pairs of different lengths (plain and masked)
equals one pair at a time (the loss and every gradient, float64, 1e-12), and each PyTorch model
(one pair; a padded group) equals vgraph from the same weights (loss, every gradient, and the
parameters after two Adam updates, float64, 1e-10 relative). The timing
itself is :func:`bench_dynamic.run_config`'s: the columns alternate pair by pair in one process,
medians over rounds, the autobatched columns in a second pass with a fresh one-at-a-time vgraph
runner (their "batch x" is measured against it in that pass).

Ratios reported: each batched column over ``vgraph`` ("batch x", the one-at-a-time time per
pair over the batched one: the target is at least 3x for ``batch32_programs``, the default build),
``vgraph`` over ``torch`` and each batched column over ``torch_batch32`` ("vs torch", time per
pair: above 1 PyTorch is faster), and, for reference, PyTorch's own batching gain (``torch`` over
``torch_batch32``; the two ran in different passes).

Usage::

    PYTHONPATH=. python3 tools/bench_seq2seq.py [--quick] [--json out.json] [--rounds N]
                                                [--embeddings sparse|dense|both] [--vocab N]
                                                [--blas-threads N] [--no-torch]
                                                [--schedule interleaved|blocked]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

import bench_dynamic as bd

from vgraph import losses, nn
from vgraph.ops import RowSparseGrad

DTYPE = bd.DTYPE
BOUNDARY = bd.BOUNDARY  # start symbol, end symbol and padding
GROUP = 32  # pairs per batched step
PAD_TO = 40  # the longest source: column batch32_masked pads every pair's states to it
#: the target for autobatching: 32 pairs per step at least this many times faster per pair than one at a time
BATCH_TARGET = 3.0


# ---------------------------------------------------------------------------- generated data


@dataclass
class PairBatch:
    """One sentence pair: a source of ``S`` words and a target of ``T`` predictions."""

    tokens: np.ndarray  # (S, 1) int: the source words
    tgt_in: np.ndarray  # (T, 1) int: the start symbol and the target words (teacher forcing)
    tgt_out: np.ndarray  # (T,) int: the target words and the end symbol
    words: int  # T, the predictions


def pair_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` source lengths (gamma, mean 18, sd 8, clipped to 5..40) and as many target
    prediction counts (source length times a log-normal factor of sd 0.15, rounded and clipped to
    4..39 words, plus the end symbol: 5..40)."""
    mean, sd = 18.0, 8.0
    src = np.clip(np.rint(rng.gamma((mean / sd) ** 2, sd * sd / mean, size=n)), 5, 40).astype(int)
    words = np.clip(np.rint(src * rng.lognormal(0.0, 0.15, size=n)), 4, 39).astype(int)
    return src, words + 1


def make_pairs(n: int, vocab: int, seed: int) -> list[PairBatch]:
    """``n`` sentence pairs with Zipf-distributed source words in ``[1, vocab)``; a target word is
    a fixed function of the source (reversed, re-mapped by a permutation of the vocabulary,
    resampled to the target's length)."""
    rng = np.random.default_rng(seed)
    src_len, tgt_len = pair_lengths(rng, n)
    tokens = bd.zipf_tokens(rng, vocab, int(src_len.sum()))
    perm = np.concatenate([[BOUNDARY], 1 + np.random.default_rng(12345).permutation(vocab - 1)])
    out = []
    for s, T in zip(np.split(tokens, np.cumsum(src_len)[:-1]), tgt_len):
        S, m = len(s), int(T) - 1
        words = perm[s[::-1][(np.arange(m) * S) // m]]
        tgt_in = np.concatenate([[BOUNDARY], words]).astype(np.int64)
        tgt_out = np.concatenate([words, [BOUNDARY]]).astype(np.int64)
        out.append(PairBatch(s.reshape(-1, 1).astype(np.int64), tgt_in.reshape(-1, 1), tgt_out, int(T)))
    return out


# ---------------------------------------------------------------------------- the vgraph model


@dataclass
class Seq2seqConfig:
    vocab: int = 4_000
    embed: int = 128
    hidden: int = 128  # the decoder's; the encoder has hidden // 2 per direction
    #: sparse embedding gradients with lazy Adam / SparseAdam (True) or dense ones with Adam
    sparse_updates: bool = True
    dtype: Any = DTYPE
    seed: int = 0


def make_seq2seq(cfg: Seq2seqConfig, pad_to: int | None = None) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """The attention model of the module docstring as a VirtualGraph (one pair per build);
    returns ``(g, loss)``.

    ``pad_to``: the encoder states padded with zero rows (input ``src_padding``) to ``pad_to``
    and an additive mask (input ``src_mask``, -inf at the padding) added to the scores before the
    softmax: the same values and gradients, and every pair's attention the same shape (see
    :func:`masked_feed`)."""
    E, H = cfg.embed, cfg.hidden
    if H % 2:
        raise ValueError(f"hidden must be even (two encoder directions of hidden // 2), got {H}")
    He = H // 2
    g = vg.VirtualGraph(dtype=cfg.dtype, seed=cfg.seed, name="seq2seq")
    src = g.input("src", shape=(None, 1))
    tgt_in = g.input("tgt_in", shape=(None, 1))
    tgt_out = g.input("tgt_out", shape=(None,))
    emb = nn.Embedding(g, cfg.vocab, E, "emb", sparse=cfg.sparse_updates)
    enc_cells = {"fwd": nn.LSTMCell(g, E, He, "enc_fwd"), "bwd": nn.LSTMCell(g, E, He, "enc_bwd")}
    dec = nn.LSTMCell(g, E + H, H, "dec")
    attn = nn.Linear(g, 2 * H, H, "attn", bias=False)
    out = nn.Linear(g, H, cfg.vocab, "out")
    zeros_e = g.constant(np.zeros((1, He), dtype=cfg.dtype), name="zeros_e")
    zeros_h = g.constant(np.zeros((1, H), dtype=cfg.dtype), name="zeros_h")

    def encode(sequence: Any, cell: nn.LSTMCell, name: str) -> tuple[Any, Any, Any]:
        with g.loop(name=name) as L:
            x_t = L.step(sequence)
            h, c = L.carry(zeros_e, name="h"), L.carry(zeros_e, name="c")
            h_new, c_new = cell(x_t, (h, c))
            L.update(h, h_new)
            L.update(c, c_new)
        return L.stack(h_new), L.final(h), L.final(c)  # (S, 1, He), (1, He), (1, He)

    embedded = emb(src)  # (S, 1, E)
    fwd, h_f, c_f = encode(embedded, enc_cells["fwd"], "enc_forward")
    bwd, h_b, c_b = encode(embedded[::-1], enc_cells["bwd"], "enc_backward")
    enc = vg.concat([fwd, bwd[::-1]], axis=-1).reshape(-1, H)  # (S, H)
    mask = None
    if pad_to is not None:
        enc = vg.concat([enc, g.input("src_padding", shape=(None, H))], axis=0)  # (pad_to, H)
        mask = g.input("src_mask", shape=(1, pad_to))
    enc_t = enc.T  # (H, S)
    h0, c0 = vg.concat([h_f, h_b], axis=-1), vg.concat([c_f, c_b], axis=-1)  # (1, H)
    targets = emb(tgt_in)  # (T, 1, E)
    with g.loop(name="decoder") as L:
        y_t = L.step(targets)  # (1, E)
        h, c = L.carry(h0, name="h"), L.carry(c0, name="c")
        feed = L.carry(zeros_h, name="feed")  # h~ of the previous step
        h_new, c_new = dec(vg.concat([y_t, feed], axis=-1), (h, c))
        scores = h_new @ enc_t if mask is None else h_new @ enc_t + mask
        weights = vg.softmax(scores, axis=-1)  # (1, S): over this pair's source words
        context = weights @ enc  # (1, H)
        attentional = vg.tanh(attn(vg.concat([context, h_new], axis=-1)))
        L.update(h, h_new)
        L.update(c, c_new)
        L.update(feed, attentional)
    logits = out(L.stack(attentional).reshape(-1, H))  # (T, V)
    return g, losses.cross_entropy(logits, tgt_out)


def seq2seq_feed(b: PairBatch) -> dict[str, Any]:
    return {"src": b.tokens, "tgt_in": b.tgt_in, "tgt_out": b.tgt_out}


def masked_feed(pad_to: int, cfg: Seq2seqConfig) -> Callable[[PairBatch], dict[str, Any]]:
    """The feed of ``make_seq2seq(cfg, pad_to)``: a pair's inputs, ``pad_to - S`` zero rows and
    the mask (0 at the ``S`` source words, -inf after them)."""
    masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def feed(b: PairBatch) -> dict[str, Any]:
        S = len(b.tokens)
        if pad_to < S:
            raise ValueError(f"a source of {S} words is longer than pad_to={pad_to}")
        if S not in masks:
            mask = np.zeros((1, pad_to), dtype=cfg.dtype)
            mask[0, S:] = -np.inf
            masks[S] = (np.zeros((pad_to - S, cfg.hidden), dtype=cfg.dtype), mask)
        padding, mask = masks[S]
        return {**seq2seq_feed(b), "src_padding": padding, "src_mask": mask}

    return feed


def _tiny(sparse: bool, seed: int = 0) -> Seq2seqConfig:
    return Seq2seqConfig(vocab=30, embed=4, hidden=4, sparse_updates=sparse, dtype=np.float64, seed=seed)


def _tiny_pairs(n: int, vocab: int, seed: int) -> list[PairBatch]:
    """``n`` short pairs of random lengths (2..7 source words, 2..6 predictions: small, so that
    finite differences stay cheap) and random words in ``[1, vocab)``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        S, T = int(rng.integers(2, 8)), int(rng.integers(2, 7))
        src = rng.integers(1, vocab, size=S)
        words = rng.integers(1, vocab, size=T - 1)
        out.append(
            PairBatch(
                src.reshape(-1, 1).astype(np.int64),
                np.concatenate([[BOUNDARY], words]).astype(np.int64).reshape(-1, 1),
                np.concatenate([words, [BOUNDARY]]).astype(np.int64),
                T,
            )
        )
    return out


def check_seq2seq(seed: int = 0) -> dict[str, Any]:
    """Before timing (else :class:`bench_dynamic.BenchmarkMismatch`): finite differences
    (``vg.gradcheck``, float64) agree with the model's gradients on a tiny pair; the sparse
    model's gradients equal the dense model's (1e-13); ``build_batch`` of pairs of different
    lengths equals building them one at a time (the mean loss and every gradient, 1e-12), op by op
    and as programs over rows (which must run the decoder), and so does ``build_batch`` of the
    masked model (every pair padded, so the mask is used). Returns the errors found."""
    pairs = _tiny_pairs(5, 30, seed + 3)
    g, loss = make_seq2seq(_tiny(False, seed))
    cg = g.build(seq2seq_feed(pairs[0]), loss)
    try:
        res = vg.gradcheck(cg.outputs[0], cg.parameters(), atol=1e-6, rtol=1e-5)
    except vg.GradcheckError as e:
        raise bd.BenchmarkMismatch(f"seq2seq: gradcheck failed: {e}") from None
    grads = {}
    for sparse in (False, True):
        gs, ls = make_seq2seq(_tiny(sparse, seed))
        cs = gs.build(seq2seq_feed(pairs[1]), ls)
        cs.backward(cs.outputs[0])
        grads[sparse] = {k: p.grad for k, p in gs.params.items()}
    if not isinstance(grads[True]["emb.W"], RowSparseGrad):
        raise bd.BenchmarkMismatch("seq2seq: the sparse model's embedding gradient is not row-sparse")
    sparse_err = max(
        bd._max_rel_err(np.asarray(grads[True][k]), np.asarray(grads[False][k])) for k in grads[False]
    )
    if not sparse_err <= 1e-13:
        raise bd.BenchmarkMismatch(f"seq2seq: sparse gradients differ from dense ones ({sparse_err:.1e})")
    # autobatched = one at a time, on pairs of different source and target lengths
    feeds = [seq2seq_feed(p) for p in pairs]
    g1, loss1 = make_seq2seq(_tiny(True, seed))
    total, one = 0.0, {k: np.zeros(p.value.shape) for k, p in g1.params.items()}
    for f in feeds:
        value, grads1 = bd.vgraph_grads(g1, loss1, f)
        total += value / len(feeds)
        for k, gk in grads1.items():
            one[k] += gk / len(feeds)
    batch_errs = {}
    for programs in (False, True):
        g2, loss2 = make_seq2seq(_tiny(True, seed))
        batch = g2.build_batch(feeds, loss2, programs=programs)
        if programs and "decoder" not in [p.loop.name for p in batch.rows_programs]:
            raise bd.BenchmarkMismatch(
                f"seq2seq: the decoder did not run over rows: {batch.inputs[0].interpreted}"
            )
        value = batch.backward("mean")
        errs = [abs(value - total) / max(abs(total), 1e-300)]
        errs += [bd._max_rel_err(np.asarray(g2.params[k].grad), one[k]) for k in one]
        if not max(errs) <= 1e-12:
            raise bd.BenchmarkMismatch(
                f"seq2seq: build_batch (programs={programs}) differs from one pair at a time "
                f"(max relative error {max(errs):.1e})"
            )
        batch_errs[programs] = max(errs)
    # the masked model (column batch32_masked) computes the same, batched
    pad_to = max(len(p.tokens) for p in pairs) + 1
    g3, loss3 = make_seq2seq(_tiny(True, seed), pad_to)
    value = g3.build_batch([masked_feed(pad_to, _tiny(True, seed))(p) for p in pairs], loss3).backward("mean")
    masked = [abs(value - total) / max(abs(total), 1e-300)]
    masked += [bd._max_rel_err(np.asarray(g3.params[k].grad), one[k]) for k in one]
    if not max(masked) <= 1e-12:
        raise bd.BenchmarkMismatch(
            f"seq2seq: the masked model differs from the plain one (max relative error {max(masked):.1e})"
        )
    return {
        "gradcheck": "passed",
        "parameters": len(cg.parameters()),
        "words": pairs[0].words,
        "sparse_equals_dense": sparse_err,
        "max_rel_err_batch": batch_errs[False],
        "max_rel_err_batch_programs": batch_errs[True],
        "max_rel_err_masked": max(masked),
        "inputs": len(feeds),
        "lengths": [[len(p.tokens), p.words] for p in pairs],
        "result": str(res)[:200],
    }


def seq2seq_vgraph(cfg: Seq2seqConfig, data: Any) -> bd.VgraphRunner:
    g, loss = make_seq2seq(cfg)
    return bd.VgraphRunner(g, loss, seq2seq_feed, lazy=cfg.sparse_updates)


def seq2seq_programs(cfg: Seq2seqConfig, data: Any) -> bd.VgraphRunner:
    """One pair per build, its loops run as body programs (``programs=True``)."""
    g, loss = make_seq2seq(cfg)
    return bd.VgraphRunner(g, loss, seq2seq_feed, lazy=cfg.sparse_updates, programs=True)


def seq2seq_batched(cfg: Seq2seqConfig, data: Any) -> bd.VgraphRunner:
    g, loss = make_seq2seq(cfg)
    return bd.AutobatchRunner(g, loss, seq2seq_feed, len(data), GROUP, lazy=cfg.sparse_updates)


def seq2seq_batched_programs(cfg: Seq2seqConfig, data: Any) -> bd.VgraphRunner:
    g, loss = make_seq2seq(cfg)
    return bd.AutobatchRunner(g, loss, seq2seq_feed, len(data), GROUP, lazy=cfg.sparse_updates, programs=True)


def seq2seq_masked(cfg: Seq2seqConfig, data: Any) -> bd.VgraphRunner:
    g, loss = make_seq2seq(cfg, PAD_TO)
    return bd.AutobatchRunner(g, loss, masked_feed(PAD_TO, cfg), len(data), GROUP, lazy=cfg.sparse_updates)


# ---------------------------------------------------------------------------- the PyTorch model


class TorchSeq2seq(bd.TorchModel):
    """The same model in PyTorch eager (see the module docstring): ``nn.Embedding``,
    ``nn.LSTM(bidirectional=True)``, ``nn.LSTMCell``, ``nn.Linear``. One pair: the ``(S, 1, E)``
    source through the encoder, a Python loop over the target steps, attention as two products
    with the ``(S, H)`` states. A group: sources padded and packed (``pack_padded_sequence``),
    states padded back to ``(B, S_max, H)``, attention by ``bmm`` with the padded positions'
    scores set to -inf, the decoder over the longest target, each loss weighted (zero at
    padding)."""

    def __init__(self, cfg: Seq2seqConfig) -> None:
        torch = bd._torch()
        dt = bd._torch_dtype(torch, cfg.dtype)
        E, H = cfg.embed, cfg.hidden
        self.emb = torch.nn.Embedding(cfg.vocab, E, sparse=cfg.sparse_updates, dtype=dt)
        self.enc = torch.nn.LSTM(E, H // 2, bidirectional=True, dtype=dt)
        self.dec = torch.nn.LSTMCell(E + H, H, dtype=dt)
        self.attn = torch.nn.Linear(2 * H, H, bias=False, dtype=dt)
        self.out = torch.nn.Linear(H, cfg.vocab, dtype=dt)
        self.tensors = {"emb.W": (self.emb.weight, False)}
        self._lstm(self.enc, "enc_fwd")
        self._lstm(self.enc, "enc_bwd", "_reverse")
        self.tensors.update(
            {
                "dec.W_x": (self.dec.weight_ih, True),
                "dec.W_h": (self.dec.weight_hh, True),
                "dec.b": (self.dec.bias_ih, False),
                "attn.W": (self.attn.weight, True),
                "out.W": (self.out.weight, True),
                "out.b": (self.out.bias, False),
            }
        )
        self.dec.bias_hh.requires_grad_(False)  # vgraph's one bias is b_ih + b_hh: b_hh held at 0
        with torch.no_grad():
            self.dec.bias_hh.zero_()
        self.sparse_tensor = self.emb.weight if cfg.sparse_updates else None
        self.H, self.dtype = H, dt

    def loss(self, items: list[PairBatch]) -> Any:
        torch = bd._torch()
        F = torch.nn.functional
        H = self.H
        if len(items) == 1:
            b = items[0]
            S = len(b.tokens)
            states, (hn, cn) = self.enc(self.emb(torch.from_numpy(b.tokens)))  # (S, 1, H), (2, 1, H/2)
            enc = states.reshape(S, H)
            enc_t = enc.t()
            h, c = torch.cat([hn[0], hn[1]], dim=-1), torch.cat([cn[0], cn[1]], dim=-1)  # (1, H)
            feed = torch.zeros((1, H), dtype=self.dtype)
            outs = []
            for y in self.emb(torch.from_numpy(b.tgt_in)).unbind(0):  # (1, E) each
                h, c = self.dec(torch.cat([y, feed], dim=-1), (h, c))
                context = torch.softmax(h @ enc_t, dim=-1) @ enc
                feed = torch.tanh(self.attn(torch.cat([context, h], dim=-1)))
                outs.append(feed)
            return F.cross_entropy(self.out(torch.cat(outs)), torch.from_numpy(b.tgt_out))
        rnn = torch.nn.utils.rnn
        B = len(items)
        src_len = [len(b.tokens) for b in items]
        tgt_len = [b.words for b in items]
        S, T = max(src_len), max(tgt_len)
        src = np.full((S, B), BOUNDARY, dtype=np.int64)
        tgt_in = np.full((T, B), BOUNDARY, dtype=np.int64)
        tgt_out = np.full((T, B), BOUNDARY, dtype=np.int64)
        weights = np.zeros((T, B))
        for j, b in enumerate(items):
            src[: src_len[j], j] = b.tokens[:, 0]
            tgt_in[: b.words, j] = b.tgt_in[:, 0]
            tgt_out[: b.words, j] = b.tgt_out
            weights[: b.words, j] = 1.0 / (b.words * B)
        packed = rnn.pack_padded_sequence(self.emb(torch.from_numpy(src)), src_len, enforce_sorted=False)
        states, (hn, cn) = self.enc(packed)  # hn, cn (2, B, H/2) in the items' order
        enc = rnn.pad_packed_sequence(states, total_length=S)[0].transpose(0, 1)  # (B, S, H)
        enc_t = enc.transpose(1, 2)  # (B, H, S)
        padding = torch.from_numpy(np.arange(S)[None, :] >= np.array(src_len)[:, None])  # (B, S)
        h, c = torch.cat([hn[0], hn[1]], dim=-1), torch.cat([cn[0], cn[1]], dim=-1)  # (B, H)
        feed = torch.zeros((B, H), dtype=self.dtype)
        outs = []
        for y in self.emb(torch.from_numpy(tgt_in)).unbind(0):  # (B, E) each
            h, c = self.dec(torch.cat([y, feed], dim=-1), (h, c))
            scores = torch.bmm(h.unsqueeze(1), enc_t).squeeze(1).masked_fill(padding, float("-inf"))
            context = torch.bmm(torch.softmax(scores, dim=-1).unsqueeze(1), enc).squeeze(1)
            feed = torch.tanh(self.attn(torch.cat([context, h], dim=-1)))
            outs.append(feed)
        logits = self.out(torch.stack(outs).reshape(-1, H))  # (T * B, V)
        ce = F.cross_entropy(logits, torch.from_numpy(tgt_out.reshape(-1)), reduction="none")
        return (ce * torch.from_numpy(weights.reshape(-1)).to(self.dtype)).sum()


def seq2seq_torch(cfg: Seq2seqConfig, data: Any) -> bd.TorchRunner:
    return bd._torch_runner(TorchSeq2seq(cfg), make_seq2seq(cfg)[0])


def seq2seq_torch_batched(cfg: Seq2seqConfig, data: Any) -> bd.TorchRunner:
    return bd._torch_runner(TorchSeq2seq(cfg), make_seq2seq(cfg)[0], len(data), GROUP)


def check_torch_seq2seq() -> dict[str, Any]:
    """PyTorch's model = vgraph's (float64), one pair and a padded group of three pairs of
    different lengths, sparse and dense embedding updates: loss, every gradient, and the
    parameters after two Adam updates (the second on other pairs)."""
    out = {}
    pairs = _tiny_pairs(6, 30, seed=7)
    for sparse in (True, False):
        cfg = _tiny(sparse)
        for n in (1, 3):
            g, loss = make_seq2seq(cfg)
            what = f"seq2seq torch ({'sparse' if sparse else 'dense'}, {n} pair(s))"
            updates = [pairs[:n], pairs[n : 2 * n]]
            errs = bd.torch_agrees(what, g, loss, seq2seq_feed, TorchSeq2seq(cfg), updates, sparse)
            out[f"{'sparse' if sparse else 'dense'}_{n}"] = max(errs.values())
    return out


# ---------------------------------------------------------------------------- the task


def _configs(quick: bool, embeddings: str = "both", vocab: int | None = None) -> list[Seq2seqConfig]:
    kinds = {"sparse": [True], "dense": [False], "both": [True, False]}[embeddings]
    if quick:  # tiny: a smoke run of the code paths, not of the speed
        return [Seq2seqConfig(vocab=vocab or 300, embed=8, hidden=8, sparse_updates=s) for s in kinds]
    return [Seq2seqConfig(vocab=vocab or Seq2seqConfig.vocab, sparse_updates=s) for s in kinds]


def _data(cfg: Seq2seqConfig, quick: bool) -> list[PairBatch]:
    return make_pairs(5 if quick else 2 * GROUP, cfg.vocab, seed=23)


def _always(cfg: Any) -> bool:
    return True


def task(embeddings: str = "both", vocab: int | None = None) -> bd.Task:
    """The benchmark as a :class:`bench_dynamic.Task`: ``embeddings`` (``"sparse"``, ``"dense"``
    or ``"both"``) says which configurations, ``vocab`` overrides the vocabulary's size."""
    return bd.Task(
        "seq2seq",
        "seq2seq with dot-product attention and input feeding, joint vocab 4k, embed 128, BiLSTM "
        "encoder 2x64, LSTM decoder 128, source 5-40 words, Adam",
        lambda quick: _configs(quick, embeddings, vocab),
        _data,
        {
            "vgraph": (seq2seq_vgraph, _always),
            "programs": (seq2seq_programs, _always),
            "batch32": (seq2seq_batched, _always),
            "batch32_programs": (seq2seq_batched_programs, _always),
            "batch32_masked": (seq2seq_masked, _always),
            "torch": (seq2seq_torch, _always),
            "torch_batch32": (seq2seq_torch_batched, _always),
        },
        check_seq2seq,
        label=lambda cfg: "sparse" if cfg.sparse_updates else "dense",
    )


def add_ratios(row: dict[str, Any]) -> None:
    """Add to a :func:`bench_dynamic.run_config` row ``batch32_masked`` over ``torch_batch32``,
    PyTorch's own batching gain (``torch`` over ``torch_batch32``, time per pair; the two ran in
    different passes) and whether ``batch32_programs`` (the default build) meets
    :data:`BATCH_TARGET`."""
    cols = row["columns"]
    if "batch32_masked" in cols and "torch_batch32" in cols:
        masked, torch_col = cols["batch32_masked"], cols["torch_batch32"]
        row.setdefault("ratio_vs_torch", {})["batch32_masked"] = {
            "torch": "torch_batch32",
            "wall": masked["ms_per_batch"] / torch_col["ms_per_batch"],
            "cpu": masked["cpu_ms_per_batch"] / torch_col["cpu_ms_per_batch"],
        }
    if "torch" in cols and "torch_batch32" in cols:
        row["torch_batch_speedup"] = {
            "wall": cols["torch"]["ms_per_batch"] / cols["torch_batch32"]["ms_per_batch"],
            "cpu": cols["torch"]["cpu_ms_per_batch"] / cols["torch_batch32"]["cpu_ms_per_batch"],
        }
    speedup = row.get("batch_speedup", {}).get("batch32_programs")
    if speedup is not None:
        row["batch_target"] = BATCH_TARGET
        row["batch_target_met"] = speedup["wall"] >= BATCH_TARGET


def source_version() -> dict[str, Any] | None:
    """The git commit of the checkout this file is in, and whether ``vgraph/`` or ``tools/``
    differ from it (``None`` outside a git checkout, e.g. an exported tree)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "vgraph", "tools"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode or status.returncode:
        return None
    return {"commit": commit.stdout.strip(), "modified": bool(status.stdout.strip())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model and data, checks included")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    ap.add_argument("--rounds", type=int, help="passes over the pairs (default 5, quick 1)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps per column (default 2, quick 1)")
    ap.add_argument(
        "--embeddings",
        choices=("sparse", "dense", "both"),
        default="both",
        help="embedding updates: sparse gradients with lazy Adam / SparseAdam, dense with Adam, or both "
        "configurations (default)",
    )
    ap.add_argument("--vocab", type=int, help="joint vocabulary size (default 4000, quick 300)")
    ap.add_argument(
        "--blas-threads", metavar="N", help="BLAS threads (default 1); read before numpy is imported"
    )
    ap.add_argument("--no-torch", action="store_true", help="leave out the PyTorch columns")
    ap.add_argument(
        "--schedule",
        choices=bd.SCHEDULES,
        default="interleaved",
        help="columns alternate pair by pair (default) or round by round (bench_dynamic.py's --schedule)",
    )
    args = ap.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if rounds < 1 or warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    if args.vocab is not None and args.vocab < 2:
        ap.error("--vocab must be >= 2 (id 0 is the sentence boundary)")
    started = _dt.datetime.now(_dt.timezone.utc)
    loadavg_start = list(os.getloadavg())
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(
        f"vgraph seq2seq-with-attention benchmark  {started:%Y-%m-%d %H:%M UTC}  numpy {np.__version__}  "
        f"{os.cpu_count()} CPUs  BLAS threads {threads}  rounds {rounds} (+{warmup} warm-up steps)\n"
    )
    torch = load_torch(not args.no_torch)
    if torch is None:
        print(TORCH_MISSING if not args.no_torch else "PyTorch columns skipped: --no-torch")
    else:
        print(f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} thread(s)")
    the_task = task(args.embeddings, args.vocab)
    rows: list[dict[str, Any]] = []
    try:
        checks: dict[str, Any] = {"seq2seq": check_seq2seq()}
        report = checks["seq2seq"]
        print(
            f"correctness: seq2seq: gradients = finite differences (float64 gradcheck, {report['parameters']} "
            f"parameters); sparse = dense ({report['sparse_equals_dense']:.1e}); build_batch = one at a time "
            f"({report['inputs']} pairs of different lengths, {report['max_rel_err_batch']:.1e}; "
            f"masked: {report['max_rel_err_masked']:.1e})"
        )
        if torch is not None:
            report["torch"] = check_torch_seq2seq()
            print(
                "correctness: seq2seq: PyTorch = vgraph (float64; loss, gradients, two Adam steps; "
                f"{', '.join(report['torch'])}; max relative error {max(report['torch'].values()):.1e})"
            )
        print()
        for cfg in the_task.configs(args.quick):
            row = bd.run_config(the_task, cfg, rounds, warmup, args.quick, torch is not None, args.schedule)
            add_ratios(row)
            rows.append(row)
            print(f"  measured seq2seq {the_task.label(cfg)}", file=sys.stderr)
    except bd.BenchmarkMismatch as e:
        print(f"\nBENCHMARK ABORTED: {e}", file=sys.stderr)
        return 2
    print()
    bd.print_rows(rows)
    for row in rows:
        if "torch_batch_speedup" in row:
            tb = row["torch_batch_speedup"]
            print(
                f"{'seq2seq':<14} {row['config']:<11} torch_batch32 x {tb['wall']:.2f} (cpu {tb['cpu']:.2f}): torch's time per pair "
                "over torch_batch32's (PyTorch's own batching gain; different passes)"
            )
    print()
    for row in rows:
        if "batch_target_met" in row:
            sp = row["batch_speedup"]["batch32_programs"]
            verdict = "PASS" if row["batch_target_met"] else "FAIL"
            others = [(n, row["batch_speedup"].get(n)) for n in ("batch32", "batch32_masked")]
            note = "".join(f" ({n}: {o['wall']:.2f}x)" for n, o in others if o)
            print(
                f"target ({row['config']}): batched >= {BATCH_TARGET:g}x one at a time: {sp['wall']:.2f}x  "
                f"{verdict}{note}"
            )
    results = {
        "benchmark": "vgraph seq2seq with attention over encoder states of different lengths, training throughput",
        "date": started.isoformat(timespec="seconds"),
        "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "blas_threads": threads,
            "vgraph": getattr(vg, "__version__", None),
            "torch": None if torch is None else torch.__version__,
            "torch_threads": None if torch is None else torch.get_num_threads(),
            "loadavg_at_start": loadavg_start,
            "loadavg_at_end": list(os.getloadavg()),
            "source": source_version(),
        },
        "config": {
            "quick": args.quick,
            "schedule": args.schedule,
            "embeddings": args.embeddings,
            "vocab": rows[0]["settings"]["vocab"] if rows else args.vocab,
            "rounds": rounds,
            "warmup": warmup,
            "group": GROUP,
            "lr": bd.LR,
            "dtype": np.dtype(DTYPE).name,
            "statistic": "median over rounds; phases per pair (a batched step's time is reported at its last pair)",
        },
        "correctness": checks,
        "rows": rows,
        "summary": {
            row["config"]: {
                "words_per_s": {n: c["words_per_s"] for n, c in row["columns"].items()},
                "batch_speedup": {n: r["wall"] for n, r in row.get("batch_speedup", {}).items()},
                "vs_torch": {n: r["wall"] for n, r in row.get("ratio_vs_torch", {}).items()},
                "torch_batch_speedup": row.get("torch_batch_speedup", {}).get("wall"),
                "words_per_s_range": {
                    n: [min(c["words_per_s_all"]), max(c["words_per_s_all"])]
                    for n, c in row["columns"].items()
                },
            }
            for row in rows
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
