"""Batched loops and recursions whose body reads a value of each input's own from outside the
loop — attention over each input's own encoder states ``enc`` ``(S_i, H)``, ``S_i`` differing per
input, or a per-input vector of one shape — run as ONE body program over rows and give what the
plain per-node unroll gives: losses, every gradient, decisions, every body node's value and
retained gradient, float64, 1e-12 (``test_batch_programs.assert_identical``). Bodies whose result
would depend on the padding with no rule for it (a max over the memory, a stacked value of the
input's length) decline the program, say why, and still compute the same."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch import random_tree
from test_batch_programs import TOL, assert_finite_differences, assert_identical

import vgraph as vg

ROOT = Path(__file__).resolve().parent.parent
# float64: tests/conftest.py; a numpy warning is an error (the padding's arithmetic must raise none)
pytestmark = [pytest.mark.usefixtures("float64"), pytest.mark.filterwarnings("error::RuntimeWarning")]

E, H = 3, 4
SCORES = ("dot", "general", "additive", "log_softmax", "sum", "mean", "max")
DECLINED = ("stacked_weights",)
#: reductions over the memory of values that are not zero where a shorter memory is padded, and
#: extremes the zero padding would win (every real value below zero for the maximum)
PADDING_TRAPS = ("sum_sigmoid", "mean_sigmoid", "entropy", "log_weights", "max_negative", "min_positive")


def seq2seq(score="dot", captured=False, seed=3):
    """An encoder loop over ``src`` (its stacked states: the memory ``enc`` ``(S, H)``) and a
    decoder loop over ``tgt`` that reads ``enc`` (and ``enc.T``) in every step, the attention
    chosen by ``score``:

    - ``dot``: ``softmax(h @ enc.T) @ enc`` (Luong); ``general``: ``softmax((h @ W) @ enc.T) @ enc``;
    - ``additive``: ``keys = enc @ W1`` outside the loop, ``softmax((tanh(keys + h @ W2) @ v).T)``;
    - ``log_softmax``: ``exp(log_softmax(h @ enc.T)) @ enc``; ``sum``: ``sum(h * enc, axis=0)``;
      ``mean``: ``mean(h * enc, axis=0)`` (divided by the input's own length); ``max``:
      ``max(h * enc, axis=0)``; ``max_negative`` / ``min_positive``: the maximum of values all
      below zero, the minimum of values all above it (the zero padding would win either);
    - ``sum_sigmoid`` / ``mean_sigmoid``: ``sum`` / ``mean(sigmoid(h * enc), axis=0)``; ``entropy``: the ``dot`` attention and the
      entropy ``-sum(w * log_softmax(h @ enc.T))`` stacked into the loss (zero padding is not neutral for
      either: 0.5 and ``0 * -inf``); ``log_weights``: the same entropy as ``-sum(w * log(w))``
      with ``w = softmax(h @ enc.T)`` (the log's VJP is ``0 / 0`` in the padding: its gradient
      there must be zeroed before the softmax's VJP sums over the memory);
    - ``None``: no memory read; declined: ``stacked_weights`` (the weights ``(1, S)`` stacked: a
      value of the input's length).

    ``captured``: a per-input vector ``c`` ``(1, H)`` (of the source's mean state) added in every
    step. Returns ``(g, [loss])``; the loops are named ``encoder`` and ``decoder``."""
    g = vg.VirtualGraph(seed=seed)
    src, tgt = g.input("src", (None, 1, E)), g.input("tgt", (None, 1, E))
    We, Ue = g.parameter("We", (E, H)), g.parameter("Ue", (H, H), init="orthogonal")
    Wd, Ud = g.parameter("Wd", (E + H, H)), g.parameter("Ud", (H, H), init="orthogonal")
    attn = vg.nn.Linear(g, 2 * H, H, "attn")
    zeros = g.constant(np.zeros((1, H)), name="zeros")
    with g.loop(name="encoder") as L:
        s = L.carry(zeros, name="s")
        s_new = vg.tanh(L.step(src) @ We + s @ Ue)
        L.update(s, s_new)
    enc = L.stack(s_new).reshape(-1, H)  # (S, H)
    enc_t = enc.T
    if score == "general":
        W = g.parameter("W", (H, H))
    if score == "additive":
        keys = enc @ g.parameter("W1", (H, H))  # (S, H), once per input
        W2, v = g.parameter("W2", (H, H)), g.parameter("v", (H, 1))
    c = vg.tanh(vg.mean(enc, axis=0, keepdims=True) @ g.parameter("Wc", (H, H))) if captured else None
    with g.loop(name="decoder") as D:
        h = D.carry(L.final(s), name="h")
        feed = D.carry(zeros, name="feed")
        z = vg.concat([D.step(tgt), feed], axis=-1) @ Wd + h @ Ud
        h_new = vg.tanh(z if c is None else z + c)
        weights = None
        if score in ("dot", "log_softmax", "stacked_weights", "entropy", "log_weights"):
            scores = h_new @ enc_t  # (1, S)
        elif score == "general":
            scores = (h_new @ W) @ enc_t
        elif score == "additive":
            scores = (vg.tanh(keys + h_new @ W2) @ v).T  # (S, H) -> (S, 1) -> (1, S)
        if score in ("log_softmax", "entropy"):
            log_weights = vg.log_softmax(scores, axis=-1)
            weights = vg.exp(log_weights)
            entropy = -vg.sum(weights * log_weights, axis=-1, keepdims=True)  # (1, 1)
        elif score == "log_weights":
            weights = vg.softmax(scores, axis=-1)
            entropy = -vg.sum(weights * vg.log(weights), axis=-1, keepdims=True)
        elif score in ("dot", "general", "additive", "stacked_weights"):
            weights = vg.softmax(scores, axis=-1)
        if weights is not None:
            context = weights @ enc  # (1, H)
        elif score == "sum":
            context = vg.sum(h_new * enc, axis=0, keepdims=True)
        elif score == "sum_sigmoid":
            context = vg.sum(vg.sigmoid(h_new * enc), axis=0, keepdims=True)
        elif score == "mean_sigmoid":
            context = vg.mean(vg.sigmoid(h_new * enc), axis=0, keepdims=True)
        elif score == "mean":
            context = vg.mean(h_new * enc, axis=0, keepdims=True)
        elif score == "max":
            context = vg.max(h_new * enc, axis=0, keepdims=True)
        elif score == "max_negative":
            context = vg.max(-vg.exp(h_new * enc), axis=0, keepdims=True)
        elif score == "min_positive":
            context = vg.min(vg.exp(h_new * enc), axis=0, keepdims=True)
        else:
            context = h_new
        out = vg.tanh(attn(vg.concat([context, h_new], axis=-1)))
        D.update(h, h_new)
        D.update(feed, out)
    outs = D.stack(out)  # (T, 1, H)
    loss = vg.sum(outs * outs) * 0.5 + vg.mean(outs)
    if score == "stacked_weights":
        loss = loss + vg.sum(D.stack(weights) ** 2)  # (T, 1, S): S is the input's own
    if score in ("entropy", "log_weights"):
        loss = loss + vg.mean(D.stack(entropy))
    return g, [loss]


def pairs(lengths, seed=0):
    """One feed per ``(S, T)``: a source of S and a target of T steps."""
    rng = np.random.default_rng(seed)
    return [{"src": rng.normal(size=(S, 1, E)), "tgt": rng.normal(size=(T, 1, E))} for S, T in lengths]


#: sources and targets of different lengths, length 1 among both, and one pair twice
LENGTHS = [(3, 2), (1, 4), (5, 1), (2, 3), (5, 1), (7, 5)]


def loop_named(batch, name):
    return [p for p in batch.rows_programs if p.loop.name == name]


def interpreted(batch, name):
    """Every input's (idx, reason) for loop ``name`` run op by op."""
    return [(i, idx, why) for i, v in enumerate(batch.inputs) for loop, idx, why in v.interpreted
            if loop.name == name]  # fmt: skip


def assert_rows(batch, name):
    """Loop ``name`` ran as one program over rows, for no input op by op."""
    assert interpreted(batch, name) == [], interpreted(batch, name)
    assert loop_named(batch, name), [p.loop.name for p in batch.rows_programs]


def assert_declined(batch, name):
    """Loop ``name`` ran op by op for every input, each saying why (a node named)."""
    assert not loop_named(batch, name)
    found = interpreted(batch, name)
    assert sorted({i for i, _, _ in found}) == list(range(len(batch.inputs))), found
    for _, idx, why in found:
        assert idx == () and why and "<" in why and ">" in why, why


# ---------------------------------------------------------------------------- attention over rows


@pytest.mark.parametrize("score", SCORES)
def test_attention_over_each_inputs_own_memory_runs_over_rows(score):
    """The decoder reads ``enc`` ``(S_i, H)`` of its input in every step (products with it and
    its transpose, softmax / log_softmax / sum over its rows): one program over rows."""
    batch = assert_identical(partial(seq2seq, score), pairs(LENGTHS), expect_rows=None)
    assert_rows(batch, "encoder")
    assert_rows(batch, "decoder")


@pytest.mark.parametrize("score", [None, "dot"])
def test_a_per_input_vector_of_one_shape_read_in_every_step_runs_over_rows(score):
    """A vector ``c`` ``(1, H)`` computed outside the loop from each input's own data: the same
    shape for every input, different values."""
    batch = assert_identical(partial(seq2seq, score, True), pairs(LENGTHS, 1), expect_rows=None)
    assert_rows(batch, "decoder")


def test_every_input_with_a_memory_of_one_row():
    batch = assert_identical(seq2seq, pairs([(1, 3), (1, 1), (1, 2)], 2), expect_rows=None)
    assert_rows(batch, "decoder")


def test_memories_of_one_length_for_every_input():
    batch = assert_identical(partial(seq2seq, "additive"), pairs([(4, 3), (4, 1), (4, 5)], 3),
                             expect_rows=None)  # fmt: skip
    assert_rows(batch, "decoder")


@pytest.mark.parametrize("score", DECLINED)
def test_bodies_that_depend_on_the_memorys_length_decline_and_compute_the_same(score):
    """Stacked weights (a value of the input's own length): op by op, each input saying why, the
    same results."""
    batch = assert_identical(partial(seq2seq, score), pairs(LENGTHS, 4), expect_rows=None)
    assert_rows(batch, "encoder")
    assert_declined(batch, "decoder")


@pytest.mark.parametrize("score", PADDING_TRAPS)
def test_reductions_over_the_memory_of_values_not_zero_at_the_padding_are_exact(score):
    """A sigmoid is 0.5 at a zero row and a log-softmax -inf at a masked one: their results' padding
    is zeroed before a sum or a mean over the memory (a mean divides by the input's own length),
    and the loop still runs over rows."""
    batch = assert_identical(partial(seq2seq, score), pairs(LENGTHS, 7), expect_rows=None)
    assert_rows(batch, "decoder")


@pytest.mark.parametrize("pad_to", [None, 7])
def test_the_benchmarks_seq2seq_model(pad_to):
    """tools/bench_seq2seq.py's model (a bidirectional LSTM encoder, an LSTMCell decoder with
    input feeding, a row-sparse embedding) at a tiny size: attention over each pair's own
    ``enc``, or (``pad_to``) over ``enc`` padded to one length with a mask fed per pair (values
    of each input's own of one shape)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_seq2seq import PairBatch, Seq2seqConfig, _tiny_pairs, make_seq2seq, masked_feed, seq2seq_feed

    cfg = Seq2seqConfig(vocab=12, embed=3, hidden=4, dtype=np.float64, seed=2)
    one = PairBatch(np.array([[5]]), np.array([[0]]), np.array([0]), 1)  # (one source word, one prediction)
    feed = seq2seq_feed if pad_to is None else masked_feed(pad_to, cfg)
    feeds = [feed(b) for b in [*_tiny_pairs(4, cfg.vocab, 1), one]]

    def make():
        g, loss = make_seq2seq(cfg, pad_to)
        return g, [loss]

    batch = assert_identical(make, feeds, expect_rows=None)
    assert_rows(batch, "decoder")


# ---------------------------------------------------------------------------- a recursion


def attending_tree(seed=5, form="row"):
    """A tree RNN whose node function attends over its input's sentence (the leaves' word
    vectors ``(S_i, 3)`` mapped by a parameter outside the recursion): ``S_i`` differs per input.
    ``form``: the state a row ``(1, 3)`` (``"row"``), or a vector ``(3,)`` scored as
    ``pre @ memory.T`` (``"vector"``) or ``memory @ pre`` (``"matvec"``)."""
    row = form == "row"
    g = vg.VirtualGraph(seed=seed)
    children, words = g.input("children", (None, 2)), g.input("words", (None, 3))
    sentence = g.input("sentence", (None, 3))
    W, U = g.parameter("W", (3, 3)), g.parameter("U", (6, 3), init="orthogonal")
    memory = vg.tanh(sentence @ g.parameter("M", (3, 3)))  # (S, 3)
    with g.recurse(children, name="tree") as r:
        h = r.state(np.zeros((1, 3) if row else 3), name="h")
        x = r.step(words)
        if row:
            x = x.reshape(1, 3)
        pre = x @ W + vg.concat([r.child(h, 0), r.child(h, 1)], axis=-1) @ U  # (1, 3) or (3,)
        scores = memory @ pre if form == "matvec" else pre @ memory.T  # (1, S) or (S,)
        weights = vg.softmax(scores, axis=-1)
        h_new = vg.tanh(pre + weights @ memory)
        r.update(h, h_new)
    s = r.stack(h_new)
    return g, [vg.sum(r.final(h) ** 2) + vg.sum(s * s) * 0.25]


def tree_feeds(leaf_counts, seed=0):
    rng = np.random.default_rng(seed)
    feeds = []
    for n in leaf_counts:
        kids = random_tree(rng, n)
        words = rng.normal(size=(len(kids), 3))
        feeds.append({"children": kids, "words": words, "sentence": words[:n]})  # (the leaves come first)
    return feeds


@pytest.mark.parametrize("hoist", [True, False])
def test_a_recursion_attending_over_each_inputs_sentence_runs_over_tree_nodes(hoist):
    batch = assert_identical(attending_tree, tree_feeds([4, 1, 6, 3, 2]), expect_rows=None, hoist=hoist)
    assert_rows(batch, "tree")


@pytest.mark.parametrize("hoist", [True, False])
@pytest.mark.parametrize("form", ["vector", "matvec"])
def test_a_vector_state_attending_runs_over_tree_nodes(form, hoist):
    """A vector times each row's own matrix (``(3,) @ (3, S)``, ``(S,) @ (S, 3)``): numpy would
    pair every row's vector with every row's matrix, so it runs as one-row matrices
    (``hoist.rows_op``) — over rows, the same results."""
    batch = assert_identical(
        partial(attending_tree, form=form), tree_feeds([4, 1, 3, 6]), expect_rows=None, hoist=hoist
    )
    assert_rows(batch, "tree")


# ---------------------------------------------------------------------------- random structures


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=6),
    st.sampled_from(["dot", "general", "additive"]),
    st.booleans(),
    st.booleans(),
    st.integers(0, 1000),
)
def test_random_lengths_batch_sizes_and_attentions(lengths, score, captured, hoist, seed):
    make = partial(seq2seq, score, captured)
    batch = assert_identical(make, pairs(lengths, seed), expect_rows=None, hoist=hoist)
    assert_rows(batch, "decoder")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=6),
    st.sampled_from(["row", "vector", "matvec"]),
    st.booleans(),
    st.integers(0, 1000),
)
def test_random_forests_attending_over_their_sentences(leaf_counts, form, hoist, seed):
    """Random trees (1-8 leaves) and batch compositions, each tree node attending over its own
    input's sentence: one program over every tree node, the same results as alone."""
    batch = assert_identical(
        partial(attending_tree, seed, form), tree_feeds(leaf_counts, seed), expect_rows=None, hoist=hoist
    )
    assert_rows(batch, "tree")


# ---------------------------------------------------------------------------- gradients, modes


def test_gradients_of_attention_over_rows_agree_with_finite_differences():
    g, (loss,) = seq2seq("dot")
    feeds = pairs([(3, 2), (1, 3), (4, 1)], 5)
    batch = g.build_batch(feeds, loss, programs=True)
    assert_finite_differences(g, loss, feeds, batch, every=3)
    assert_rows(batch, "decoder")


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_without_gradients_attention_over_rows_computes_the_outputs_alone(score):
    g, (loss,) = seq2seq(score)
    feeds = pairs(LENGTHS, 6)
    expect = [g.build(f, loss, cache=False, programs=False).node(loss).value for f in feeds]
    with vg.no_grad():
        batch = g.build_batch(feeds, loss, programs=True)
    np.testing.assert_allclose(batch.outputs(), expect, **TOL)
    assert_rows(batch, "decoder")


# ---------------------------------------------------------------------------- the rules themselves


def test_the_rules_say_where_a_result_is_padded_and_what_is_masked():
    from vgraph.ops import OPS
    from vgraph.virtual.padded import MaskKey, Rule, ScaleKey, rule, step_input

    R = (1, 0)  # padded along axis 1 of the per-row value, extent 0
    mm = OPS["MatMul"]
    assert rule(mm, {}, [(1, 4), (4, 7)], [None, R], (1, 7)) == Rule((1, 0))  # h @ enc.T
    assert rule(mm, {}, [(1, 7), (7, 4)], [R, (0, 0)], (1, 4)) == Rule(None)  # weights @ enc
    assert "contracts" in rule(mm, {}, [(1, 7), (7, 4)], [R, None], (1, 4))
    assert "contracts" in rule(mm, {}, [(1, 7), (7, 4)], [R, (0, 1)], (1, 4))  # another length
    assert rule(mm, {}, [(4,), (4, 7)], [None, R], (7,)) == Rule((0, 0))  # a vector times enc.T
    assert rule(mm, {}, [(7, 4), (4,)], [(0, 0), None], (7,)) == Rule((0, 0))  # enc @ a vector
    assert rule(mm, {}, [(7,), (7, 4)], [(0, 0), (0, 0)], (4,)) == Rule(None)  # weights @ enc
    assert rule(OPS["Softmax"], {"axis": -1}, [(1, 7)], [R], (1, 7)) == Rule(R, pre=-np.inf)
    assert rule(OPS["LogSoftmax"], {"axis": -1}, [(1, 7)], [R], (1, 7)) == Rule(R, pre=-np.inf, post=True)
    assert rule(OPS["Softmax"], {"axis": 0}, [(1, 7)], [R], (1, 7)) == Rule(R, post=True)
    assert rule(OPS["Mul"], {}, [(1, 7), ()], [R, None], (1, 7)) == Rule(R)  # zero stays zero
    assert rule(OPS["Add"], {}, [(1, 7), (1, 1)], [R, None], (1, 7)) == Rule(R, post=True)
    assert rule(OPS["Add"], {}, [(1, 7), (1, 7)], [R, R], (1, 7)) == Rule(R)
    assert "fixed length" in rule(OPS["Add"], {}, [(1, 7), (1, 7)], [R, None], (1, 7))
    assert rule(OPS["Sigmoid"], {}, [(1, 7)], [R], (1, 7)) == Rule(R, post=True)
    assert rule(OPS["Transpose"], {}, [(1, 7)], [R], (7, 1)) == Rule((0, 0))
    assert rule(OPS["Sum"], {"axis": -1}, [(1, 7)], [R], (1,)) == Rule(None)
    assert rule(OPS["Sum"], {"axis": 0}, [(1, 7)], [R], (7,)) == Rule((0, 0))
    assert rule(OPS["Mean"], {"axis": 1}, [(1, 7)], [R], (1,)) == Rule(None, scale=0)  # over its own length
    assert rule(OPS["Mean"], {"axis": 0}, [(1, 7)], [R], (7,)) == Rule((0, 0))
    assert rule(OPS["Max"], {"axis": None}, [(1, 7)], [R], ()) == Rule(None, pre=-np.inf, pre_vjp=True)
    assert rule(OPS["Min"], {"axis": 1}, [(1, 7)], [R], (1,)) == Rule(None, pre=np.inf, pre_vjp=True)
    assert "depends on the length" in rule(OPS["Var"], {"axis": 1}, [(1, 7)], [R], (1,))
    assert rule(OPS["GetItem"], {"index": 0}, [(1, 7)], [R], (7,)) == Rule((0, 0))
    assert "indexes" in rule(OPS["GetItem"], {"index": (0, slice(2))}, [(1, 7)], [R], (2,))
    assert "no rule" in rule(OPS["Reshape"], {"shape": (7,)}, [(1, 7)], [R], (7,))
    assert rule(OPS["Reshape"], {"shape": (7,)}, [(1, 7)], [None], (7,)) == Rule(None)
    m = step_input(MaskKey(0, 2, 1), np.array([3, 1, 4]))
    np.testing.assert_array_equal(m, [[[1, 1, 1, 0]], [[1, 0, 0, 0]], [[1, 1, 1, 1]]])
    np.testing.assert_array_equal(step_input(ScaleKey(0, 1), np.array([3, 1, 4])), [[4 / 3], [4], [1]])


def branching_decoder():
    """Dot attention whose step then chooses, per pair and step, between two updates by the
    sign of its target word's first entry: a level's rows split by choice around padded rows."""
    g = vg.VirtualGraph(seed=4)
    src, tgt = g.input("src", (None, 1, E)), g.input("tgt", (None, 1, E))
    We, Wd = g.parameter("We", (E, H)), g.parameter("Wd", (E, H))
    Ud = g.parameter("Ud", (H, H), init="orthogonal")
    with g.loop(name="encoder") as L:
        s = L.carry(np.zeros((1, H)), name="s")
        s_new = vg.tanh(L.step(src) @ We + s)
        L.update(s, s_new)
    enc = L.stack(s_new).reshape(-1, H)
    with g.loop(name="decoder") as D:
        h = D.carry(L.final(s), name="h")
        y = D.step(tgt)
        context = vg.softmax(h @ enc.T, axis=-1) @ enc
        z = y @ Wd + h @ Ud
        h_new = g.branch(
            lambda y: int(y[0, 0] > 0), [vg.tanh(z + context), vg.sigmoid(z - context) * 0.5], keys=[y]
        )
        D.update(h, h_new)
    return g, [vg.sum(D.final(h) ** 2) + vg.sum(D.stack(h_new))]


def test_attention_in_a_body_whose_rows_choose_differently():
    batch = assert_identical(branching_decoder, pairs(LENGTHS, 3), expect_rows=None)
    assert_rows(batch, "decoder")
    (program,) = loop_named(batch, "decoder")
    assert len(program.steps) > len(program.levels)  # some steps' rows split by their choice


def test_a_maximum_whose_ties_are_at_zero_splits_its_gradient_among_real_entries_only():
    """``max(m + c)`` over each input's memory, whose maximum is exactly 0 at several of its
    rows: the maximum's VJP shares the gradient among the entries equal to it, and the zero
    padding must not be among them (its VJP reads the input with the padding at -inf too)."""

    def make():
        g = vg.VirtualGraph(seed=0)
        xs, m = g.input("xs", (None, 3)), g.input("m", (None, 3))
        c = g.parameter("c", (3,), init=vg.nn.init.constant(0.5))
        with g.loop(name="decoder") as L:
            h = L.carry(np.zeros(3), name="h")
            L.update(h, vg.tanh(L.step(xs) + h + vg.max(m + c, axis=0)))
        return g, [vg.sum(L.final(h))]

    feeds = []
    for n, ties in ((4, 2), (2, 1), (6, 3)):
        memory = np.full((n, 3), -1.0)
        memory[:ties] = -0.5  # (m + c = 0 exactly there)
        feeds.append({"xs": np.full((2, 3), 0.1), "m": memory})
    batch = assert_identical(make, feeds, expect_rows=None)
    assert_rows(batch, "decoder")
