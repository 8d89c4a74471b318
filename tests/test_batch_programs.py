"""Lockstep loops of a batched build run as ONE body program over the inputs' rows
(``g.build_batch(feeds, outputs, programs=True)``): the same per-input losses, every parameter
gradient, every decision and the values and gradients of body nodes as the same batch built op by
op (``programs=False``) and as each input built alone node by node — float64, 1e-12 — on the
example models and on random lengths (0 and 1 included) and batch sizes."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch import example, model_script_inputs
from test_hoist import loop_bodies, loop_body_model

import vgraph as vg
from vgraph.virtual.batch import Row

ROOT = Path(__file__).resolve().parent.parent
TOL = {"rtol": 1e-12, "atol": 1e-13}

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def decisions_of(decisions):
    return [(d.node.key, d.idx, d.kind, d.value) for d in decisions]


def alone(make, feeds, output=0):
    """Each input built alone, node by node, on a fresh copy of the model: losses, summed
    parameter gradients, decisions and the unrolled graphs (retaining every gradient)."""
    g, outputs = make()
    losses, decisions, graphs = [], [], []
    for feed in feeds:
        cg = g.build(feed, outputs, cache=False, programs=False)
        vg.render.retain_all_grads(cg)
        losses.append(cg.backward(outputs[output]))
        decisions.append(decisions_of(cg.decisions))
        graphs.append(cg)
    grads = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
    return losses, grads, decisions, (g, graphs)


def batched(make, feeds, programs, output=0, hoist=True):
    g, outputs = make()
    batch = g.build_batch(feeds, outputs, programs=programs, hoist=hoist)
    vg.render.retain_all_grads(batch.graph)
    batch.backward("sum", output)
    losses = [float(x) for x in batch.outputs(output)]
    grads = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
    return losses, grads, [decisions_of(v.decisions) for v in batch.inputs], batch, g


def body_nodes(g):
    """Every op node declared in a loop body, with its loop."""
    return [v for v in g.nodes if v.scope is not None and v.kind == "op"]


def own_row(view, v, idx):
    """Whether the batch holds ``v`` at ``idx`` for this input as a row of its own (of a group,
    or of a program's record): its gradient is then this input's, not the sum over the inputs
    that share one node (a first step from a shared initial state)."""
    found = view._in_program(v, idx)
    if found is not None:
        instance, _ = view._rows[(v.scope, idx[:-1])]
        shared = instance.layout.get(v, 0) is None  # (computed once for a step's rows)
        return not shared and not isinstance(found[0], vg.ComputeNode)
    return isinstance(view._find(v, idx), Row)


def assert_identical(make, feeds, expect_rows=True, hoist=True):
    """programs=True equals programs=False and each input alone: losses, gradients, decisions,
    and every body node's value and retained gradient in every iteration of top-level loops."""
    l0, g0, d0, (g_alone, graphs) = alone(make, feeds)
    declared = {(u.type, u.id): u for u in g_alone.nodes}  # (the batches' models are copies)
    compared = tried = 0
    l1, g1, d1, plain, _ = batched(make, feeds, programs=False, hoist=hoist)
    l2, g2, d2, rows, g = batched(make, feeds, programs=True, hoist=hoist)
    assert not plain.rows_programs
    if expect_rows is not None:
        assert bool(rows.rows_programs) == expect_rows, [v.interpreted for v in rows.inputs]
    for ref in ((l0, g0, d0), (l1, g1, d1)):
        np.testing.assert_allclose(l2, ref[0], **TOL)
        assert g2.keys() == ref[1].keys()
        for k in g2:
            np.testing.assert_allclose(g2[k], ref[1][k], **TOL, err_msg=k)
        assert d2 == ref[2]
    for i, cg in enumerate(graphs):
        view = rows.inputs[i]
        for v in body_nodes(g):
            if v.scope.scope is not None:  # (nested loops: their iteration paths vary)
                continue
            for t in range(view.trip_count(v.scope)):
                tried += 1
                try:
                    node = cg.node(declared[(v.type, v.id)], (t,))
                except vg.BuildError:
                    continue  # not built alone (a guard, or not needed): nor in the batch
                np.testing.assert_allclose(view.value(v, (t,)), node.value, **TOL, err_msg=f"{v} @{t}")
                compared += 1
                if node.grad is not None and own_row(view, v, (t,)):
                    grad = view.gradient(v, (t,))
                    assert grad is not None, (v, t)
                    np.testing.assert_allclose(grad, node.grad, **TOL, err_msg=f"grad {v} @{t}")
    assert compared or not tried  # (a body node built alone is looked up in the batch)
    return rows


# ---------------------------------------------------------------------------- the example models


MODELS = sorted((ROOT / "examples" / "models").glob("*.py"))
#: the example models with a lockstep loop a program over rows runs (the others: branches, a
#: recursion, a nested loop whose outer loop runs per input)
ROWS = {"elman_rnn": True, "stacked_rnn": True, "branching": True, "tree_lstm": True}


@pytest.mark.parametrize("script", MODELS, ids=lambda p: p.stem)
def test_example_models(script):
    assert_identical(*model_script_inputs(script), expect_rows=ROWS[script.stem])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("hoist", [True, False])
def test_fused_cells(cell, hoist):
    m = example("lstm_sequence")
    rng = np.random.default_rng(1)
    feeds = []
    for T in (3, 6, 2, 4, 6):
        x, y = m.adding_batch(rng, 2, T)
        feeds.append({"x": x, "y": y, "h0": rng.normal(size=(2, 4))})

    def make():
        g, outs = m.build_model(cell, hidden=4, seed=0)
        return g, [outs["loss"]]

    batch = assert_identical(make, feeds, hoist=hoist)
    assert [k for k, _ in batch.groups].count("Loop:" + str(batch.rows_programs[0].loop.id)) == 1
    hoisted = [k for k, n in batch.groups if k.startswith("MatMul*") and n == len(feeds)]
    assert bool(hoisted) == hoist, batch.groups  # x_t @ W_x over every input's every step, once


def bilstm(H=3, E=4, V=20, tags=5):
    """A BiLSTM tagger as tools/bench_dynamic.py declares it (the backward half reversed outside
    the loop), plus a second one stepping with ``reverse=True``."""
    g = vg.VirtualGraph(seed=4)
    tokens = g.input("tokens", (None, 1))
    labels = g.input("tags", (None,))
    emb = vg.nn.Embedding(g, V, E, "emb")
    cells = [vg.nn.LSTMCell(g, E, H, f"cell{k}") for k in range(3)]
    out = vg.nn.Linear(g, 3 * H, tags, "out")
    zeros = g.constant(np.zeros((1, H)), name="zeros")
    x = emb(tokens)

    def run(seq, cell, reverse=False):
        with g.loop() as L:
            x_t = L.step(seq, reverse=reverse)
            h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
            h_new, c_new = cell(x_t, (h, c))
            L.update(h, h_new)
            L.update(c, c_new)
        return L.stack(h_new)

    fwd = run(x, cells[0])
    bwd = run(x[::-1], cells[1])[::-1]
    rev = run(x, cells[2], reverse=True)[::-1]
    features = vg.concat([fwd, bwd, rev], axis=-1).reshape(-1, 3 * H)
    return g, [vg.losses.cross_entropy(out(vg.tanh(features)), labels)]


def tagger_feeds(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 20, (n, 1)), "tags": rng.integers(0, 5, n)} for n in lengths]


def test_a_bilstm_tagger_with_reversed_steps():
    batch = assert_identical(bilstm, tagger_feeds([4, 1, 7, 4, 2]))
    assert len(batch.rows_programs) == 3
    assert not any(v.interpreted for v in batch.inputs)


def bidirectional_tagger(kind="lstm", H=3, E=4, V=20, tags=5):
    """The tagger with both directions as one loop (nn.Bidirectional: stacked weights)."""
    g = vg.VirtualGraph(seed=4)
    tokens = g.input("tokens", (None, 1))
    labels = g.input("tags", (None,))
    emb = vg.nn.Embedding(g, V, E, "emb")
    make = {"lstm": vg.nn.LSTMCell, "gru": vg.nn.GRUCell}[kind]
    both = vg.nn.Bidirectional(make(g, E, H, "fwd"), make(g, E, H, "bwd"))
    features = both(emb(tokens)).reshape(-1, 2 * H)
    return g, [vg.losses.cross_entropy(vg.nn.Linear(g, 2 * H, tags, "out")(vg.tanh(features)), labels)]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_bidirectional_tagger_runs_over_rows(kind):
    """Sentences of different lengths, each with its own pair of directions: one program over
    the rows of every sentence's pair, equal to op by op and to each sentence alone."""
    batch = assert_identical(partial(bidirectional_tagger, kind), tagger_feeds([4, 1, 7, 4, 2]))
    assert len(batch.rows_programs) == 1
    assert not any(v.interpreted for v in batch.inputs)
    # the stacks of the two cells' parameters are the same for every sentence: computed once,
    # read by the program as shared weights (not one copy a row), the input product hoisted
    # over every sentence's every step
    assert batch.rows_programs[0].own_at == []
    stacks = sum(k.startswith("Stack:") and n == 5 for k, n in batch.groups)
    assert stacks == {"lstm": 3, "gru": 4}[kind]  # (W_x, W_h and the bias, or the GRU's two)
    assert any(k.startswith("MatMul*") and n == 5 for k, n in batch.groups), batch.groups


# ---------------------------------------------------------------------------- random lengths


def rnn(stack=True, shared_h0=False):
    """A final and (``stack``) a stacked output, a hoisted product, an elementwise body; the
    initial state fed per input, or (``shared_h0``) a parameter: one node for every input."""
    g = vg.VirtualGraph(seed=7)
    xs = g.input("xs", (None, 2))
    h0 = g.parameter("h0", (3,)) if shared_h0 else g.input("h0", (3,))
    W = g.parameter("W", (2, 3))
    U = g.parameter("U", (3, 3), init="orthogonal")
    b = g.parameter("b", (3,))
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(h0, name="h")
        a = vg.sigmoid(x @ W + b)
        h_new = vg.tanh(h @ U + a) * a + 0.5 * h
        L.update(h, h_new)
        squared = h_new * h_new
    loss = vg.sum(L.final(h)) + 0.1 * vg.sum(W * W)
    if stack:
        loss = loss + vg.sum(L.stack(squared)) * 0.25
    return g, [loss]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.one_of(
        st.lists(st.integers(0, 6), min_size=1, max_size=8),
        st.tuples(st.integers(0, 6), st.integers(1, 8)).map(lambda tn: [tn[0]] * tn[1]),  # all equal
    ),
    st.integers(0, 1000),
    st.booleans(),
    st.booleans(),
)
def test_random_lengths_and_batch_sizes(lengths, seed, hoist, shared_h0):
    rng = np.random.default_rng(seed)
    feeds = [
        {"xs": rng.normal(size=(n, 2))} | ({} if shared_h0 else {"h0": rng.normal(size=3)}) for n in lengths
    ]
    # (stacking no iteration is an error: the final alone when an input runs none)
    make = partial(rnn, stack=min(lengths) > 0, shared_h0=shared_h0)
    assert_identical(make, feeds, expect_rows=max(lengths) > 0, hoist=hoist)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(0, 1000))
def test_random_tagger_lengths(lengths, seed):
    assert_identical(bilstm, tagger_feeds(lengths, seed))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=8),
    st.integers(0, 1000),
    st.sampled_from(["lstm", "gru"]),
)
def test_random_bidirectional_tagger_lengths(lengths, seed, kind):
    assert_identical(partial(bidirectional_tagger, kind), tagger_feeds(lengths, seed))


# ---------------------------------------------------------------------------- gradients, modes


def test_gradients_of_a_program_over_rows_agree_with_finite_differences():
    feeds = [{"xs": np.random.default_rng(i).normal(size=(n, 2)), "h0": np.full(3, 0.1 * i)} for i, n in
             enumerate((4, 1, 3, 4))]  # fmt: skip
    g, (loss,) = rnn()
    batch = g.build_batch(feeds, loss, programs=True)
    assert batch.rows_programs
    assert_finite_differences(g, loss, feeds, batch)


def assert_finite_differences(g, loss, feeds, batch, every=1):
    """``batch``'s parameter gradients (summed over the inputs) equal central differences of the
    summed losses of batched builds with programs (every ``every``-th element of each)."""
    batch.backward("sum")
    grads = {k: np.array(p.grad) for k, p in g.params.items()}
    eps = 1e-6
    for name, grad in grads.items():
        value = g.params.value(name).copy()
        for at in list(np.ndindex(value.shape))[::every]:
            moved = []
            for sign in (1, -1):
                changed = value.copy()
                changed[at] += sign * eps
                g.params.set_value(name, changed)
                moved.append(sum(g.build_batch(feeds, loss, programs=True).outputs()).item())
            g.params.set_value(name, value)
            np.testing.assert_allclose(grad[at], (moved[0] - moved[1]) / (2 * eps), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", [True, False])
def test_programs_none_follows_the_threads_mode(mode):
    g, (loss,) = rnn()
    feeds = [{"xs": np.ones((n, 2)), "h0": np.zeros(3)} for n in (2, 3)]
    with vg.body_programs(mode):
        batch = g.build_batch(feeds, loss)
    assert bool(batch.rows_programs) == mode
    assert bool(g.build_batch(feeds, loss, programs=mode).rows_programs) == mode
    with vg.body_programs(not mode):
        assert bool(g.build_batch(feeds, loss, programs=mode).rows_programs) == mode


def test_without_gradients_a_program_over_rows_computes_the_same_outputs():
    g, (loss,) = rnn()
    feeds = [{"xs": np.random.default_rng(n).normal(size=(n, 2)), "h0": np.zeros(3)} for n in (2, 5, 1)]
    expect = g.build_batch(feeds, loss, programs=False).outputs()
    with vg.no_grad():
        batch = g.build_batch(feeds, loss, programs=True)
    assert batch.rows_programs
    np.testing.assert_allclose(batch.outputs(), expect, **TOL)
    g.eval()
    np.testing.assert_allclose(g.build_batch(feeds, loss, programs=True).outputs(), expect, **TOL)


# ---------------------------------------------------------------------------- fallbacks, errors


def per_input_capture():
    g = vg.VirtualGraph(seed=0)
    xs, bias = g.input("xs", (None, 3)), g.input("bias", (3,))
    w = g.parameter("w", (3,))
    with g.loop() as L:
        h = L.carry(np.zeros(3), name="h")
        L.update(h, vg.tanh(L.step(xs) * w + h + bias))
    return g, [vg.sum(L.final(h))], [{"xs": np.ones((n, 3)), "bias": np.full(3, n / 10)} for n in (2, 3)]


def square_capture():
    """A loop reading each input's own ``(n, n)`` matrix: lengths that differ along two axes."""
    g = vg.VirtualGraph(seed=0)
    xs, m = g.input("xs", (None, 3)), g.input("m", (None, None))
    w = g.parameter("w", (3,))
    with g.loop() as L:
        h = L.carry(np.zeros(3), name="h")
        L.update(h, vg.tanh(L.step(xs) * w + h + vg.sum(m)))
    feeds = [{"xs": np.ones((n, 3)), "m": np.full((n, n), n / 10)} for n in (2, 3)]
    return g, [vg.sum(L.final(h))], feeds


def while_loop():
    g = vg.VirtualGraph(seed=0)
    x0 = g.input("x0", (2,))
    w = g.parameter("w", (2,), init=vg.nn.init.constant(0.1))
    with g.loop(while_=lambda t, s: float(s["h"].sum()) < 3.0, max_iters=20) as L:
        h = L.carry(x0, name="h")
        L.update(h, h * 1.5 + w)
    return g, [vg.sum(L.final(h))], [{"x0": np.full(2, v)} for v in (0.2, 0.7, 1.4)]


def branch_loop():
    """A loop with a branch that reads a value of each input's own: no program over rows, and
    no op-by-op lockstep (which has no branches): each input's builder runs it."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2))
    bias = g.input("bias", (2,))
    w = g.parameter("w", (2,))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        x = L.step(xs)
        L.update(
            h,
            g.branch(
                lambda v: int(v.sum() > 0), [vg.tanh(h + x * w), vg.sigmoid(x * w - h + bias)], keys=[x]
            ),
        )
    feeds = [{"xs": np.full((n, 2), (-1) ** n), "bias": np.full(2, 0.1 * n)} for n in (2, 3)]
    return g, [vg.sum(L.final(h))], feeds


def branching_rnn(nested=False):
    """An RNN whose step chooses by its input (so the rows of one iteration choose differently),
    the options slices and products of the carried state; ``nested``: a branch in an option."""
    g = vg.VirtualGraph(seed=6)
    xs = g.input("xs", (None, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (4, 4))
    with g.loop() as L:
        h = L.carry(np.zeros(4), name="h")
        x = L.step(xs, name="x")
        z = x @ W + h @ U
        calm = vg.tanh(z) * 0.5 + h * 0.5
        hot = vg.concat([vg.sigmoid(z[:2]), vg.tanh(z[2:])], axis=0)
        if nested:
            hot = g.branch(lambda v: int(v[1] > 0), [hot, hot * h], keys=[x], name="inner")
        h_new = g.branch(lambda v: int(v[0] > 0), [calm, hot], keys=[x], name="outer")
        L.update(h, h_new)
    s = L.stack(h_new)
    return g, [vg.sum(L.final(h) ** 2) + vg.sum(s * s * 0.5)]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(0, 1000), st.booleans(), st.booleans()
)
def test_random_branches_in_loops_over_rows(lengths, seed, nested, hoist):
    """A loop whose iterations choose per input: one program over rows, an iteration's rows split
    by choice where they differ; equal to op by op and to each input alone (values, gradients,
    decisions)."""
    rng = np.random.default_rng(seed)
    feeds = [{"xs": rng.normal(size=(n, 3))} for n in lengths]
    batch = assert_identical(partial(branching_rnn, nested), feeds, hoist=hoist)
    (instance,) = batch.rows_programs
    groups = set()
    for (ids, _), made in zip(instance.steps, instance.choices):  # a step: rows that chose alike
        for r, t in zip(instance.owner[ids].tolist(), instance.tpos[ids].tolist()):
            view = batch.inputs[instance.rows[r].inp]
            assert [(b, view.choice(b, (t,))) for b, _ in made] == made
            groups.add((t, tuple((b.id, c) for b, c in made)))
    assert len(instance.steps) == len(groups)  # (as few steps as the choices allow)


def test_a_loop_whose_rows_choose_differently_splits_and_names_options_not_chosen():
    feeds = [
        {"xs": np.array([[1.0, 1, 0], [-1, 1, 0], [1, -1, 0]])},
        {"xs": np.array([[-1.0, 1, 0], [1, 1, 0]])},
    ]
    batch = assert_identical(branching_rnn, feeds)
    (instance,) = batch.rows_programs
    assert len(instance.steps) == 5  # (iterations 0 and 1 split in two, iteration 2 one input)
    g = instance.loop.graph
    hot = next(v for v in g.nodes if v.type == "Concat")
    np.testing.assert_array_equal(batch.inputs[0].value(hot, (0,)).shape, (4,))
    with pytest.raises(vg.BuildError, match=r"<Concat:1@1> was not built for input 0"):
        batch.inputs[0].value(hot, (1,))  # (input 0 chose the other option there)
    assert [batch.inputs[0].choice(v, (t,)) for v in g.nodes if v.kind == "branch" for t in range(3)] == [
        1,
        0,
        1,
    ]


def reshaping_loop(shape=-1):
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 2))
    w = g.parameter("w", (4,))
    with g.loop() as L:
        h = L.carry(np.zeros(4), name="h")
        L.update(h, vg.tanh(L.step(xs).reshape(shape) * w + h))
    return g, [vg.sum(L.final(h))], [{"xs": np.ones((n, 2, 2)) / n} for n in (2, 3)]


def test_ops_whose_axes_move_on_rows_run_over_rows():
    """A slice, a concatenation along axis 0 and a reshape of each row run on rows with their
    attributes moved by one axis (hoist.batched_attrs), compiled into the program's steps."""
    rng = np.random.default_rng(4)

    def make():
        g = vg.VirtualGraph(seed=0)
        xs = g.input("xs", (None, 2, 2))
        W = g.parameter("W", (8, 6))
        with g.loop() as L:
            h = L.carry(np.zeros(3), name="h")
            z = vg.concat([L.step(xs).reshape(4), h[:2], h[1:]], axis=0) @ W
            h_new = vg.tanh(z[:3]) * vg.sigmoid(z[3:])
            L.update(h, h_new)
        s = L.stack(h_new)
        return g, [vg.sum(s * s)]

    feeds = [{"xs": rng.normal(size=(n, 2, 2))} for n in (3, 1, 4)]
    batch = assert_identical(make, feeds)
    assert {v.op.name for v in batch.rows_programs[0].variant._attrs} >= {"Reshape", "Concat", "GetItem"}


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (square_capture, r"the inputs' values of <Input:2> 'm' differ in length along more than one axis"),
        (while_loop, r"its trip count is decided per iteration \(while_/until\)"),
        (reshaping_loop, r"<Reshape:1> \(Reshape\) does not compute each row alone"),
    ],
)
def test_loops_a_program_over_rows_cannot_run_fall_back_and_say_why(model, reason):
    g, outputs, feeds = model()
    l0, g0, d0, _ = alone(lambda: model()[:2], feeds)
    l2, g2, d2, batch, _ = batched(lambda: model()[:2], feeds, programs=True)
    assert not batch.rows_programs
    for view in batch.inputs:
        ((loop, idx, why),) = view.interpreted
        assert loop.kind == "loop" and idx == ()
        assert re.match(reason, why), why
    np.testing.assert_allclose(l2, l0, **TOL)
    for k in g0:
        np.testing.assert_allclose(g2[k], g0[k], **TOL)
    assert d2 == d0


def test_show_program_prints_a_program_over_rows_for_the_batch_and_each_input():
    g, outputs = rnn()
    rng = np.random.default_rng(0)
    feeds = [{"xs": rng.normal(size=(n, 2)), "h0": rng.normal(size=3)} for n in (3, 1, 4)]
    (loop,) = [v for v in g.nodes if isinstance(v, vg.LoopNode)]
    batch = g.build_batch(feeds, outputs, programs=True)
    text = vg.show_program(batch, loop)
    assert text.startswith(f"# body program of {loop.describe(())}, over the rows of 3 inputs' instances\n")
    assert "def make_step(" in text and "def make_back(" in text
    assert all(vg.show_program(view, loop) == text for view in batch.inputs)
    assert batch.inputs[1].programs == {(loop, ()): batch.rows_programs[0]}
    with pytest.raises(
        vg.BuildError, match=r"<Loop:1> did not run as a body program \(built with programs=False"
    ):
        vg.show_program(g.build_batch(feeds, outputs, programs=False), loop)
    with pytest.raises(vg.BuildError, match=r"pass the build or one of its inputs, not its \.graph\)$"):
        vg.show_program(batch.graph, loop)  # (the graph of the ops: it knows no programs)
    g, outputs, feeds = while_loop()  # declined: the reason, as for one input
    (loop,) = [v for v in g.nodes if isinstance(v, vg.LoopNode)]
    batch = g.build_batch(feeds, outputs, programs=True)
    assert not batch.inputs[0].programs
    for cg in (batch, batch.inputs[2]):
        with pytest.raises(vg.BuildError, match=r"did not run as a body program: its trip count is decided"):
            vg.show_program(cg, loop)


@pytest.mark.parametrize("model", [per_input_capture, branch_loop])
def test_values_of_each_inputs_own_are_rows(model):
    """A body reading a value from outside its loop that differs per input (of one shape) runs
    over rows: each row reads its input's value."""
    g, outputs, feeds = model()
    batch = assert_identical(lambda: model()[:2], feeds)
    assert all(not view.interpreted for view in batch.inputs)


def picky_op(defop):
    """An elementwise op whose forward refuses values above 2.5."""

    def forward(x):
        if (x > 2.5).any():
            raise ValueError("too large")
        return x * 1.0

    return defop("Picky", forward, lambda g, ans, x: g, elementwise=True)


def test_an_error_in_a_step_over_rows_names_the_node_and_the_input(defop):
    picky = picky_op(defop)
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, picky(h + L.step(xs)))
    loss = vg.sum(L.final(h))
    feeds = [{"xs": np.full((n, 2), 0.1 + 0.4 * k)} for k, n in enumerate((5, 5, 5))]  # input 2 at step 2
    with pytest.raises(vg.ShapeError) as plain:
        g.build_batch(feeds, loss, programs=False)
    with pytest.raises(vg.ShapeError) as program:
        g.build_batch(feeds, loss, programs=True)
    assert str(program.value) == str(plain.value)
    assert str(program.value).startswith(
        "input 2: <Picky:1@2>: cannot compute Picky of <Add:1@2> (2,): too large"
    ), str(program.value)
    assert len(g.params) == 0


@pytest.mark.parametrize("index", [slice(None, None, -1), slice(1, None), slice(None, -1), slice(None, None, 2),
                                   (slice(None, None, -1), 0), (slice(1, None), slice(0, 1))])  # fmt: skip
def test_slices_of_sentences_of_different_lengths_run_as_one_op(index):
    """``x[::-1]``, ``x[1:]``, … of inputs of different lengths: one ``GetItem`` of their rows
    concatenated (with and without programs), equal to each input alone."""

    def make():
        g = vg.VirtualGraph(seed=1)
        xs = g.input("xs", (None, 2))
        W = g.parameter("W", (2, 2))
        return g, [vg.sum(vg.tanh(xs @ W)[index] ** 2)]

    feeds = [{"xs": np.random.default_rng(n).normal(size=(n, 2))} for n in (3, 5, 2, 5, 4)]
    for programs in (False, True):
        l0, g0, _, _ = alone(make, feeds)
        l1, g1, _, batch, _ = batched(make, feeds, programs=programs)
        np.testing.assert_allclose(l1, l0, **TOL)
        np.testing.assert_allclose(g1["W"], g0["W"], **TOL)
        assert ("GetItem:1", len(feeds)) in batch.groups, batch.groups


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("mean", [True, False])
def test_the_segment_reduction_vjp_agrees_with_finite_differences(whole, mean):
    """Sums and means over sentences of different lengths run as one reduction per sentence of
    their concatenation (``batch._SEGMENT_SUM``): its VJP against central differences."""
    from vgraph.virtual.batch import _segment_sum, _segment_sum_vjp

    rng = np.random.default_rng(0)
    sizes = np.array([3, 1, 4], dtype=np.intp)
    starts = np.array([0, 3, 4], dtype=np.intp)
    x = rng.normal(size=(8, 2))
    attrs = {"starts": starts, "sizes": sizes, "whole": whole, "mean": mean}
    ans = _segment_sum(x, **attrs)
    parts = np.split(x, starts[1:])
    expect = [(p.mean() if whole else p.mean(0)) if mean else (p.sum() if whole else p.sum(0)) for p in parts]
    np.testing.assert_allclose(ans, np.array(expect), **TOL)
    g = rng.normal(size=ans.shape)
    got = _segment_sum_vjp(g, ans, x, **attrs)
    eps, numeric = 1e-6, np.zeros_like(x)
    for at in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[at] = eps
        numeric[at] = np.sum(g * (_segment_sum(x + d, **attrs) - _segment_sum(x - d, **attrs))) / (2 * eps)
    np.testing.assert_allclose(got, numeric, rtol=1e-7, atol=1e-9)


def test_a_vjp_error_in_a_backward_step_over_rows_names_the_inputs_the_node_and_its_input(defop):
    def vjp(g, ans, x):
        raise ValueError("broken")

    fragile = defop("Fragile", lambda x: x * 1.0, vjp, elementwise=True)
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2))
    W = g.parameter("W", (2,))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, fragile(h + L.step(xs) * W))
    loss = vg.sum(L.final(h))
    batch = g.build_batch([{"xs": np.ones((n, 2))} for n in (5, 3, 5)], loss, programs=True)
    assert batch.rows_programs
    with pytest.raises(vg.BackwardError) as e:
        batch.backward()
    assert str(e.value) == (
        "inputs 0, 2 (computed together): <Fragile:1@4>: the VJP of Fragile with respect to its input "
        "<Add:1@4> failed: ValueError: broken"
    )
    assert g.params["W"].grad is None


def counted_loop(times):
    """A loop of ``times`` iterations over a longer sequence, and one with no stepped sequence."""
    g = vg.VirtualGraph(seed=3)
    xs = g.input("xs", (None, 2))
    W = g.parameter("W", (2, 2))
    with g.loop(times=times) as L:
        h = L.carry(np.full(2, 0.5), name="h")
        x = L.step(xs)
        L.update(h, vg.tanh(h @ W + x))
        xh = x * h
    with g.loop(times=3) as M:
        k = M.carry(L.final(h), name="k")
        M.update(k, vg.sigmoid(k @ W) * k)
    return g, [vg.sum(M.final(k)) + vg.sum(L.stack(xh))]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.integers(2, 6), min_size=1, max_size=6), st.integers(1, 2), st.integers(0, 1000))
def test_loops_of_a_given_number_of_iterations(lengths, times, seed):
    rng = np.random.default_rng(seed)
    feeds = [{"xs": rng.normal(size=(n, 2))} for n in lengths]
    batch = assert_identical(partial(counted_loop, times), feeds)
    assert len(batch.rows_programs) == 2


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    loop_bodies(),
    st.lists(st.integers(1, 6), min_size=1, max_size=5),
    st.booleans(),
    st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(0, 100))),
)
def test_random_loop_bodies_over_rows(body, lengths, hoist, branch):
    """tests/test_hoist.py's random bodies (elementwise ops, products, hoistable sums) over rows
    of inputs of random lengths; with ``branch``, the carry's update chosen per input and
    iteration between two of the body's values (an iteration's rows split by choice)."""
    steps, times = body[0], body[1]
    if times == 0:
        return  # (no iteration: nothing to run over rows)
    rng = np.random.default_rng(steps)
    feeds = [{"xs": rng.normal(size=(n, 2, 3))} for n in lengths]

    def make():
        g, loss, _ = loop_body_model((max(lengths), *body[1:]), branch)
        return g, [loss]

    assert_identical(make, feeds, expect_rows=True, hoist=hoist)


# ---------------------------------------------------------------------------- recursions over tree nodes


def mixed_tree_model(nested=False, learned_init=False):
    """A recursion whose branch chooses by each tree node's own word (so the tree nodes of one
    level choose differently), an inner node from its children by slices and a concatenation
    (ops whose axes move on rows); ``nested``: a second branch inside an option;
    ``learned_init``: what a missing child reads is a parameter."""
    g = vg.VirtualGraph(seed=5)
    children = g.input("children", (None, 2))
    words = g.input("words", (None, 3))
    W, U, b = g.parameter("W", (3, 6)), g.parameter("U", (6, 6)), g.parameter("b", (6,))
    h0 = g.parameter("h0", (3,)) if learned_init else np.zeros(3)
    with g.recurse(children) as r:
        h = r.state(h0, name="h")
        c = r.state(np.zeros(3), name="c")
        x = r.step(words, name="word")
        z = vg.concat([r.child(h, 0), r.child(c, 1)], axis=0) @ U + b
        z = z + x @ W
        hot = vg.tanh(z[:3]) * vg.sigmoid(z[3:])
        cold = vg.sigmoid(z[3:]) + r.child(h, 1)
        if nested:
            cold = g.branch(lambda w: int(w[2] > 0), [cold, cold * 2.0], keys=[x], name="twice")
        h_new = g.branch(lambda w: int(w[0] > 0), [cold, hot], keys=[x], name="by_word")
        r.update(h, h_new)
        r.update(c, vg.tanh(z[:3]))
    s = r.stack(h_new)
    return g, [vg.sum(r.final(h) ** 2) + vg.sum(s * s * 0.5)]


def tree_inputs(leaf_counts, seed):
    from test_batch import random_tree

    rng = np.random.default_rng(seed)
    return [
        {"children": (k := random_tree(rng, n)), "words": rng.normal(size=(len(k), 3))} for n in leaf_counts
    ]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=6),
    st.integers(0, 1000),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_random_trees_and_branches_over_tree_nodes(leaf_counts, seed, nested, hoist, learned_init):
    """Random forests (one tree of 1..7 leaves per input), a branch that chooses by each tree
    node's own value (nested or not): the recursion runs as ONE program over tree nodes, the
    steps of a level split by choice, and everything equals op by op and each input alone."""
    make = partial(mixed_tree_model, nested, learned_init)
    batch = assert_identical(make, tree_inputs(leaf_counts, seed), hoist=hoist)
    (instance,) = batch.rows_programs
    assert len(instance.levels) == 1 + max(
        int(np.max(level_of(f["children"]))) for f in tree_inputs(leaf_counts, seed)
    )


def level_of(children):
    level = np.zeros(len(children), dtype=int)
    for t, row in enumerate(children):
        kids = [c for c in row if c >= 0]
        level[t] = 1 + max(level[c] for c in kids) if kids else 0
    return level


def test_a_level_whose_tree_nodes_choose_differently_splits_by_choice():
    feeds = tree_inputs([4, 3, 5], 7)
    batch = assert_identical(partial(mixed_tree_model, True), feeds)
    (instance,) = batch.rows_programs
    steps = len(instance.steps)
    assert steps > len(instance.levels)  # (some level's rows chose differently)
    levels = level_of_forest(feeds)
    by_level = {}
    for (ids, _), choices in zip(instance.steps, instance.choices):
        assert len(set(levels[ids].tolist())) == 1  # (a step runs tree nodes of one level)
        by_level.setdefault(int(levels[ids[0]]), []).append(tuple((b.id, c) for b, c in choices))
    for parts in by_level.values():  # a level's rows in as few steps as their choices allow
        assert len(set(parts)) == len(parts)
    assert sorted(np.concatenate([ids for ids, _ in instance.steps]).tolist()) == list(range(len(levels)))


def level_of_forest(feeds):
    return np.concatenate([level_of(f["children"]) for f in feeds])


def test_structures_that_share_a_child_run_over_tree_nodes():
    """Children arrays that are not trees (a node read by two parents, or twice by one, and
    missing children read from a learned initial state): the children's gradients add up."""
    feeds = [
        {"children": np.array([[-1, -1], [-1, -1], [0, 1], [0, 2], [2, 2]]), "words": np.ones((5, 3)) * 0.3},
        {"children": np.array([[-1, -1], [0, -1], [0, 1]]), "words": -np.ones((3, 3)) * 0.2},
    ]
    batch = assert_identical(partial(mixed_tree_model, True, True), feeds)
    assert not batch.rows_programs[0].tree


def test_gradients_over_tree_nodes_agree_with_finite_differences():
    g, (loss,) = mixed_tree_model(nested=True, learned_init=True)
    feeds = tree_inputs([3, 1, 4], 3)
    batch = g.build_batch(feeds, loss, programs=True)
    assert batch.rows_programs and len(batch.rows_programs[0].steps) > len(batch.rows_programs[0].levels)
    assert_finite_differences(g, loss, feeds, batch, every=5)


def test_a_recursion_inside_a_loop_runs_over_every_inputs_tree_nodes():
    """A forest per input, one tree per iteration of an outer loop: each iteration's recursion
    of every input runs as one program (inner iteration paths (t, node))."""

    def make():
        g = vg.VirtualGraph(seed=2)
        children = g.input("children", (None, None, 2))
        words = g.input("words", (None, None, 3))
        W = g.parameter("W", (3, 3))
        U = g.parameter("U", (6, 3))
        with g.loop() as outer:
            kids, ws = outer.step(children), outer.step(words)
            total = outer.carry(np.zeros(3), name="total")
            with g.recurse(kids) as r:
                h = r.state(np.zeros(3), name="h")
                x = r.step(ws)
                h_new = vg.tanh(x @ W + vg.concat([r.child(h, 0), r.child(h, 1)], axis=0) @ U)
                r.update(h, h_new)
            outer.update(total, total + r.final(h))
        return g, [vg.sum(outer.final(total) ** 2)]

    rng = np.random.default_rng(0)
    from test_batch import random_tree

    feeds = []
    for trees in (2, 3):
        kids = [random_tree(rng, 3) for _ in range(trees)]  # (3 leaves: 5 nodes each)
        feeds.append({"children": np.stack(kids), "words": rng.normal(size=(trees, 5, 3))})
    batch = assert_identical(make, feeds)
    assert len(batch.rows_programs) >= 2


@pytest.mark.parametrize("own", ["bias", "memory"])
def test_a_recursion_reading_each_inputs_own_value_runs_over_tree_nodes(own):
    """A recursion reading a value of each input's own — of one shape (a bias), or of the
    input's own length (attention over its words) — runs as one program over tree nodes, each
    reading its input's value, and gives the same results."""

    def make():
        g = vg.VirtualGraph(seed=1)
        children = g.input("children", (None, 2))
        words = g.input("words", (None, 3))
        W = g.parameter("W", (3, 3))
        bias = g.input("bias", (3,)) if own == "bias" else None
        with g.recurse(children) as r:
            h = r.state(np.zeros(3), name="h")
            x = r.step(words)
            if bias is not None:
                extra = bias
            else:  # attention over every word of the input (its own length)
                extra = (vg.softmax(x.reshape(1, 3) @ words.T, axis=-1) @ words).reshape(3)
            r.update(h, vg.tanh(x @ W + r.child(h, 0) + r.child(h, 1) + extra))
        return g, [vg.sum(r.final(h) ** 2)]

    feeds = tree_inputs([2, 3, 5], 1)
    for k, f in enumerate(feeds):
        if own == "bias":
            f["bias"] = np.full(3, 0.1 * k)
    batch = assert_identical(make, feeds, expect_rows=True)
    assert all(not view.interpreted for view in batch.inputs)


def test_an_error_in_a_step_over_tree_nodes_names_the_node_and_the_input(defop):
    picky = picky_op(defop)
    g = vg.VirtualGraph(seed=0)
    children = g.input("children", (None, 2))
    words = g.input("words", (None, 2))
    with g.recurse(children) as r:
        h = r.state(np.zeros(2), name="h")
        r.update(h, picky(r.step(words) + r.child(h, 0) + r.child(h, 1)))
    loss = vg.sum(r.final(h))
    feeds = tree_inputs([2, 3, 2], 0)
    for k, f in enumerate(feeds):
        f["words"] = np.full((len(f["children"]), 2), 0.4 + k)  # input 2's leaves: too large
    with pytest.raises(vg.ShapeError) as plain:
        g.build_batch(feeds, loss, programs=False)
    with pytest.raises(vg.ShapeError) as program:
        g.build_batch(feeds, loss, programs=True)
    assert str(program.value) == str(plain.value)
    assert re.match(
        r"input \d: <Picky:1@\d+>: cannot compute Picky of <Add:2@\d+> \(2,\): too large", str(program.value)
    )


def test_a_vjp_error_in_a_backward_step_over_tree_nodes_names_the_inputs_and_the_node(defop):
    def vjp(g, ans, x):
        if (np.abs(g) > 5).any():
            raise ValueError("gradient too large")
        return g

    touchy = defop("Touchy", lambda x: x * 1.0, vjp, elementwise=True)
    g = vg.VirtualGraph(seed=0)
    children = g.input("children", (None, 2))
    words = g.input("words", (None, 3))
    w = g.parameter("w", init=np.ones(3))
    with g.recurse(children) as r:
        h = r.state(np.zeros(3), name="h")
        r.update(h, touchy(r.step(words) * w + r.child(h, 0) + r.child(h, 1)))
    loss = vg.sum(r.final(h) ** 2) * 100.0
    feeds = tree_inputs([2, 3, 2], 0)
    batch = g.build_batch(feeds, loss, programs=True)
    assert batch.rows_programs
    with pytest.raises(vg.BackwardError, match=r"^inputs? [0-9, ]+.*<Touchy:1@[0-9]+>: the VJP of Touchy"):
        batch.backward("sum")


def test_a_tree_lstm_with_a_sparse_embedding_over_tree_nodes():
    """The benchmark's Tree-LSTM (tools/bench_dynamic.py: leaf and inner node as branch options,
    slices of fused gates, a row-sparse embedding): every gradient equals the plain unroll's,
    the embedding's kept row-sparse; without gradients and in anomaly mode the same outputs."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from bench_dynamic import TreeConfig, make_tree_lstm, random_tree, tree_feed

    rng = np.random.default_rng(2)
    trees = [random_tree(rng, rng.integers(0, 30, size=n)) for n in (4, 1, 6, 3)]
    feeds = [tree_feed(t) for t in trees]
    cfg = TreeConfig(vocab=30, embed=4, hidden=3, dtype=np.float64, sparse=True)

    def make():
        g, loss = make_tree_lstm(cfg)
        return g, [loss]

    batch = assert_identical(make, feeds)
    assert batch.rows_programs
    g, loss = make_tree_lstm(cfg)
    program = g.build_batch(feeds, loss)
    program.backward("mean")
    assert isinstance(g.params["emb.W"].grad, vg.ops.RowSparseGrad)
    expect = program.outputs()
    with vg.no_grad():
        assert g.build_batch(feeds, loss).rows_programs
        np.testing.assert_allclose(g.build_batch(feeds, loss).outputs(), expect, **TOL)
    with vg.detect_anomaly():  # (checks every node as it is made: op by op, and says so)
        checked = g.build_batch(feeds, loss)
    assert not checked.rows_programs
    assert {why for v in checked.inputs for _, _, why in v.interpreted} == {
        "anomaly mode checks every node as it is made"
    }
    np.testing.assert_allclose(checked.outputs(), expect, **TOL)


def test_a_body_node_the_same_for_every_row_has_the_steps_summed_gradient():
    """A body node reading only values the same for every row (``W.T`` of a shared ``W``) is
    computed once per step of a program over rows; each input's view of its gradient is the sum
    over the inputs that ran that step, as the docstring of ``InputView.gradient`` says."""

    def make():
        g = vg.VirtualGraph(seed=3)
        xs = g.input("xs", (None, 3))
        W = g.parameter("W", (2, 3))
        with g.loop() as L:
            h = L.carry(np.zeros((1, 2)), name="h")
            Wt = W.T
            L.update(h, vg.tanh(L.step(xs).reshape(1, 3) @ Wt + h))
        return g, [vg.sum(L.final(h) ** 2)], Wt

    rng = np.random.default_rng(0)
    feeds = [{"xs": rng.standard_normal((n, 3))} for n in (3, 1, 2)]
    g, outputs, Wt = make()
    batch = g.build_batch(feeds, outputs, programs=True)
    assert batch.rows_programs
    vg.render.retain_all_grads(batch.graph)
    batch.backward("sum")
    for t in range(3):
        want = 0
        for f in feeds:
            if len(f["xs"]) <= t:
                continue
            cg = g.build(f, outputs, programs=False, cache=False)
            vg.render.retain_all_grads(cg)
            cg.backward(cg.outputs[0])
            want = want + cg.node(Wt, (t,)).grad
        np.testing.assert_allclose(batch.inputs[0].gradient(Wt, (t,)), want, **TOL)


def test_products_with_each_rows_vector_run_over_rows():
    """Per-row vectors multiplied with each other (``h @ x_t``, a scalar per row) and a stepped
    matrix times a shared vector: no attribute batches them, ``hoist.rows_op`` does."""

    def make():
        g = vg.VirtualGraph(seed=5)
        xs, ms = g.input("xs", (None, 3)), g.input("ms", (None, 2, 3))
        W, v = g.parameter("W", (3, 3)), g.parameter("v", (3,))
        with g.loop() as L:
            h = L.carry(np.full(3, 0.1), name="h")
            x, m = L.step(xs), L.step(ms)
            score = (h @ x).reshape(1)  # (a scalar per row, kept as (1,) to broadcast over rows)
            L.update(h, vg.tanh(x * score + h @ W + vg.sum(m @ v, keepdims=True)))
        return g, [vg.sum(L.final(h) ** 2)]

    rng = np.random.default_rng(2)
    feeds = [{"xs": rng.standard_normal((n, 3)), "ms": rng.standard_normal((n, 2, 3))} for n in (3, 1, 4)]
    batch = assert_identical(make, feeds)
    assert all(not view.interpreted for view in batch.inputs)
