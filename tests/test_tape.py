"""Compiled sweeps (vgraph.tape, issue 10 §7): a graph swept again runs straight-line code made
for its structure — and nothing else changes.

Identity tests: every example model, random op graphs and random loop bodies, trained for a few
steps with tapes on and with tapes off (the interpreted sweeps), give bitwise the same losses,
parameter gradients, retained gradients and values at every key. Error paths: a VJP or an op that
fails inside compiled code gives the same typed error, naming the node, and changes no ``.grad``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hoist import example, load, loop_bodies, loop_body_model, rnn_bptt_case, row_sum_model
from test_properties import build_random_graph, recipes
from test_sparse import feed as sparse_feed
from test_sparse import tagger as sparse_tagger

import vgraph as vg
from vgraph import ops, tape
from vgraph.compute import ComputeGraph
from vgraph.errors import BackwardError, ShapeError

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4  # sweeps per run: the first is interpreted, the later ones run the tape


pytestmark = pytest.mark.usefixtures("float64", "per_node")  # tests/conftest.py: of the per-node path


@contextlib.contextmanager
def tapes(enabled: bool):
    previous = tape.tapes_enabled()
    tape.set_tapes(enabled)
    try:
        yield
    finally:
        tape.set_tapes(previous)


def value_of(n):
    """``n``'s value; "stale" for a node computed when read from values that a forward to the
    outputs left out of date (its value refuses to be computed: vgraph.compute, _read_deferred)."""
    try:
        return np.array(n.value)
    except vg.GraphStateError:
        assert n.graph.computed_when_read(n)
        return "stale"


def train(g, feeds, loss, outputs=None, *, cache=True):
    """``len(feeds)`` steps: build once, then feed + forward (reuse); retain every gradient;
    backward; an SGD step. Returns everything the identity compares, step by step."""
    record = []
    cg = g.build(feeds[0], outputs or [loss], cache=cache)
    for step, feed in enumerate(feeds):
        if step:
            cg.feed(feed)
            cg.forward()
        vg.render.retain_all_grads(cg)  # (and of the body nodes of loops run as programs: views)
        views = [view for instance in cg.programs.values() for view in instance._views.values()]
        for n in [*(n for n in cg.nodes() if n.op is not None), *views]:
            n.grad = None
        g.params.zero_grad()
        value = cg.backward(cg.node(loss) if not isinstance(loss, vg.VirtualNode) else loss)
        params = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
        nodes = {
            n.key: (value_of(n), None if n.grad is None else np.array(n.grad))
            for n in [*cg._nodes.values(), *views]
            if n.key.type != "Loop"  # (its value is the run: the views hold its values)
        }
        record.append((value, params, nodes))
        for _, p in g.params.items():
            if p.grad is not None:
                p.value = p.value - 0.05 * np.asarray(p.grad)
    return record


def assert_same(run):
    """``run()`` with tapes off and on (from fresh state each time) gives bitwise equal records,
    and with tapes on, backward ran compiled code (it did not fall back to the interpreted sweep)."""
    with tapes(False):
        plain = run()
    outcomes = []
    original = ComputeGraph._run_backward_tape

    def watched(*args):
        outcomes.append(original(*args))
        return outcomes[-1]

    with pytest.MonkeyPatch.context() as m, tapes(True):
        m.setattr(ComputeGraph, "_run_backward_tape", staticmethod(watched))
        taped = run()
    assert all(outcomes), "a compiled backward raised and the interpreted sweep ran instead"
    if len(plain) > 1 and any(p for _, p, _ in plain):
        assert outcomes, "no backward ran compiled code"
    assert_records_equal(plain, taped)


def assert_records_equal(plain, other):
    """Two :func:`train` records are bitwise equal: losses, parameter gradients, and every node's
    value and retained gradient at every step."""
    assert len(plain) == len(other)
    for (v0, p0, n0), (v1, p1, n1) in zip(plain, other):
        assert v0 == v1 or (np.isnan(v0) and np.isnan(v1))
        assert p0.keys() == p1.keys()
        for k in p0:
            assert np.array_equal(p0[k], p1[k], equal_nan=True), k
        assert n0.keys() == n1.keys()
        for k, (value, grad) in n0.items():
            if isinstance(value, str):  # "stale" (see value_of)
                assert n1[k][0] == value, k
            else:
                assert np.array_equal(value, n1[k][0], equal_nan=True), k
            assert (grad is None) == (n1[k][1] is None), k
            if grad is not None:
                assert np.array_equal(grad, n1[k][1], equal_nan=True), k


def feeds_like(feed, n, seed=0):
    """``n`` feeds shaped like ``feed``: float inputs perturbed, integer ones (tokens, labels) kept."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        f = {}
        for k, v in feed.items():
            v = np.asarray(v)
            f[k] = v + 0.1 * rng.standard_normal(v.shape) if v.dtype.kind == "f" else v
        out.append(f)
    return out


# ---------------------------------------------------------------------------- the example models


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_model_scripts_taped_equal_interpreted(script):
    def run():
        g, feed, outputs = load(script).build()
        return train(g, feeds_like(feed, STEPS), outputs[0], outputs)

    assert_same(run)


def test_rnn_bptt_example():
    def run():
        g, loss, feed = rnn_bptt_case()
        return train(g, feeds_like(feed, STEPS), loss)

    assert_same(run)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lstm_sequence_example(cell):
    def run():
        m = example("lstm_sequence")
        g, outs = m.build_model(cell, hidden=4, seed=0)
        x, y = m.adding_batch(np.random.default_rng(1), 3, 5)
        return train(g, feeds_like({"x": x, "y": y, "h0": np.zeros((3, 4))}, STEPS), outs["loss"])

    assert_same(run)


@pytest.mark.parametrize("cell", [vg.nn.LSTMCell, vg.nn.GRUCell])
def test_unfused_cells(cell):
    def run():
        g = vg.VirtualGraph(seed=1)
        xs = g.input("xs", (None, 2, 3))
        c = cell(g, 3, 4, "cell", fused=False)
        with g.loop() as L:
            h = L.carry(np.zeros((2, 4)), name="h")
            if cell is vg.nn.LSTMCell:
                s = L.carry(np.zeros((2, 4)), name="c")
                h_new, s_new = c(L.step(xs), (h, s))
                L.update(s, s_new)
            else:
                h_new = c(L.step(xs), h)
            L.update(h, h_new)
        loss = vg.sum(L.final(h) ** 2)
        return train(g, feeds_like({"xs": np.random.default_rng(2).normal(size=(5, 2, 3))}, STEPS), loss)

    assert_same(run)


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_sparse_embedding_gradients(twice, tied):
    """Row-sparse table gradients (leaves with sparse_grad) and their accumulation."""

    def run():
        g, loss = sparse_tagger(True, twice=twice, tied=tied)
        return train(g, feeds_like(sparse_feed(), STEPS), loss)

    assert_same(run)


def test_data_dependent_examples():
    def adaptive():
        m = example("adaptive_loop")
        g, outs = m.build_model(hidden=4, tol=1e-3, max_steps=8, seed=0)
        return [r for x in (0.7, 0.7, 0.7) for r in train(g, [m.feed(x)] * 2, outs["loss"])]

    def routing():
        r = example("routing_branch")
        g, outs = r.build_model(hidden=4, seed=0)
        return train(g, [r.batch(np.array([-0.8, 0.1, 0.9]))] * STEPS, outs["loss"])

    assert_same(adaptive)
    assert_same(routing)


def test_rebuilds_of_a_cached_structure():
    """Cached structures replay the graph (vgraph.virtual.cache): its forward and backward run the
    tapes from the third build on."""

    def run():
        g, feed, outputs = load(ROOT / "examples" / "models" / "elman_rnn.py").build()
        record = []
        for f in feeds_like(feed, 5):
            record += train(g, [f], outputs[0], outputs)
        return record

    assert_same(run)


# ---------------------------------------------------------------------------- random structures


@settings(max_examples=40, deadline=None, derandomize=True)
@given(recipes())
def test_random_op_graphs(recipe):
    def run():
        cg, output, params = build_random_graph(recipe)
        seed = np.random.default_rng(0).standard_normal(output.shape)
        record = []
        for step in range(STEPS):
            for p in params:
                p.value = p.value * (1 + 0.01 * step)
                p.grad = None
            cg.forward(output)
            if output.requires_grad:  # e.g. not when everything passes through Step
                cg.backward(output, seed=seed)
            record.append((0.0, {str(p.key): np.array(p.grad) for p in params if p.grad is not None},
                           {k: (value_of(n), None) for k, n in cg._nodes.items()}))  # fmt: skip
        return record

    assert_same(run)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(loop_bodies())
def test_random_loop_bodies(body):
    def run():
        g, loss, feed = loop_body_model(body)
        return train(g, feeds_like(feed, STEPS), loss)

    assert_same(run)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.integers(2, 6),
    st.sampled_from(["x W", "tanh(x W)", "x W + b"]),
    st.sampled_from(["h U", "h", "tanh(h) * h"]),
    st.booleans(),
    st.booleans(),
)
def test_random_row_sums_with_gradient_rows_in_buffers(T, hoisted, carried, bias_last, stack_sum):
    """tanh(a + c [+ b]) in random forms, trained with tapes on and off: bitwise the same losses,
    gradients and values, with every tanh gradient into a row-reading sum written into a row
    buffer however small (ops.ROW_VJP_MIN lowered to 1 for the compiled code)."""

    def run():
        g, loss, feed, *_ = row_sum_model(T, hoisted, carried, bias_last=bias_last, stack_sum=stack_sum)
        return train(g, feeds_like(feed, STEPS), loss)

    written = []
    into_row = ops._tanh_vjp_row
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tape, "ROW_VJP_MIN", 1)
        m.setattr(
            tape,
            "_NAMESPACE",
            {**tape._NAMESPACE, "tanh_vjp_row": lambda *a: written.append(into_row(*a)) or written[-1]},
        )
        tape._compiled.clear()
        try:
            assert_same(run)
        finally:
            tape._compiled.clear()
    if not stack_sum:  # (a stacked sum's first gradient comes from the stack: the tanh's is added)
        assert any(r is not None for r in written)  # the compiled sweeps wrote rows into a buffer


# ---------------------------------------------------------------------------- what tapes share, and when


def elman(T, B=2):
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, B, 3))
    W, U, b = g.parameter("W", (3, 4)), g.parameter("U", (4, 4)), g.parameter("b", (4,))
    with g.loop() as L:
        h = L.carry(np.zeros((B, 4)), name="h")
        L.update(h, vg.tanh(L.step(xs) @ W + h @ U + b))
    return g, vg.sum(L.final(h))


def test_loops_of_any_length_share_the_compiled_iterations():
    """Every iteration of a loop has the same shape, so a loop of 200 steps compiles no more code
    than one of 20: the compiled functions are per shape, and shared by graphs."""
    with tapes(True):
        made = []
        for T in (20, 200, 37):
            g, loss = elman(T)
            cg = g.build({"xs": np.ones((T, 2, 3))}, loss, cache=False)
            before = len(tape._compiled)
            for _ in range(2):  # the second sweep compiles
                cg.forward()
                cg.backward(loss)
            made.append(len(tape._compiled) - before)
        assert made[1] <= made[0] and made[2] <= made[0]
        assert made[1] <= 1  # at most the loop's last, shorter run or the part after it is new


def test_a_graph_swept_once_makes_no_tape():
    with tapes(True):
        g, loss = elman(5)
        cg = g.build({"xs": np.ones((5, 2, 3))}, loss, cache=False)
        cg.backward(loss)
        assert cg._backward_tape is not None and cg._backward_tape[1] is None
        cg.forward()
        cg.backward(loss)
        assert isinstance(cg._backward_tape[1], tape.BackwardTape)


def test_retain_grad_after_the_tape_was_made():
    with tapes(True):
        g, loss = elman(6)
        cg = g.build({"xs": np.ones((6, 2, 3))}, loss, cache=False)
        for _ in range(2):
            cg.forward()
            cg.backward(loss)
        node = cg.node("Tanh:1@2")
        node.retain_grad()
        cg.forward()
        cg.backward(loss)
        got = np.array(node.grad)
    with tapes(False):
        cg.forward()
        node.grad = None
        cg.backward(loss)
        assert np.array_equal(got, node.grad)


def test_set_tapes_takes_a_bool():
    with pytest.raises(TypeError, match="True or False"):
        tape.set_tapes(1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- failures inside compiled code


def test_a_vjp_failing_in_a_tape_names_the_node_and_changes_no_grad(defop):
    calls = {"n": 0}

    def flaky_vjp(g, ans, x):
        calls["n"] += 1
        if calls["n"] > 2:  # the first two backwards (interpreted, then taped) pass
            raise ValueError("boom")
        return g * np.cos(x)

    sin = defop("TapeSin", np.sin, flaky_vjp)
    cg = ComputeGraph(dtype=np.float64)
    p = cg.parameter(np.array([0.3, -0.2]), name="p")
    out = vg.sum(sin(p * 2.0))
    with tapes(True):
        for _ in range(2):
            cg.forward(out)
            cg.backward(out)
        before = np.array(p.grad)
        cg.forward(out)
        with pytest.raises(BackwardError, match=r"<TapeSin:1>.*boom"):
            cg.backward(out)
    assert np.array_equal(p.grad, before)  # nothing half-added
    assert all(n._g is None for n in cg.nodes())


def test_an_op_that_raises_is_called_once_and_named(defop):
    """In a build and in a compiled forward alike, the error names the node; the op is not run a
    second time to find out which node it was."""
    calls = {"n": 0, "fail": False}

    def forward(x):
        calls["n"] += 1
        if calls["fail"]:
            raise ValueError("no")
        return x * 2.0

    double = defop("TapeDouble", forward, lambda g, ans, x: 2.0 * g)
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones(3), name="x")
    out = vg.sum(double(x))
    with tapes(True):
        for _ in range(3):  # interpreted, then taped
            x.value = np.ones(3)
            cg.forward(out)
        calls.update(n=0, fail=True)
        x.value = np.zeros(3)
        with pytest.raises(
            ShapeError, match=r"<TapeDouble:1>: cannot compute TapeDouble of <Input:1> 'x' \(3,\): no"
        ):
            cg.forward(out)
        assert calls["n"] == 1
        calls["n"] = 0
        with pytest.raises(ShapeError, match=r"<TapeDouble:2>"):
            double(x)
        assert calls["n"] == 1


def test_an_op_failing_in_a_forward_tape_names_the_node():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones((2, 3)), name="x")
    W = cg.parameter(np.ones((3, 4)), name="W")
    out = vg.sum(vg.tanh(x @ W))
    with tapes(True):
        for _ in range(3):
            x.value = np.ones((2, 3))
            cg.forward(out)  # the second and third run the tape
        x.value = np.ones((2, 5))
        with pytest.raises(ShapeError, match=r"<MatMul:1>"):
            cg.forward(out)


def test_anomaly_mode_after_tapes_were_made_still_names_the_node():
    """Anomaly mode sweeps node by node even where a tape exists (its checks are per node)."""
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones(3), name="x", requires_grad=True)
    out = vg.sum(vg.log(x * 2.0))
    with tapes(True):
        for _ in range(3):
            x.value = np.ones(3)
            cg.forward(out)
            cg.backward(out)
        x.value = np.array([1.0, -1.0, 2.0])
        with pytest.raises(vg.NonFiniteError, match=r"<Log:1>: log of a negative input"):
            cg.forward(out, detect_anomaly=True)


def two_carries(T, layer=False):
    """A loop with a tied weight times a matrix (h @ V, or with ``layer`` a fused ``Linear``
    h @ V + v) and one times an N-D carry (c @ U)."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 5, 3))
    W, U, V = g.parameter("W", (3, 4)), g.parameter("U", (4, 4)), g.parameter("V", (4, 4))
    v = g.parameter("v", (4,), init="normal")
    with g.loop() as L:
        c = L.carry(np.zeros((2, 5, 4)), name="c")
        h = L.carry(np.zeros((2, 4)), name="h")
        c_new = vg.tanh(L.step(xs) @ W + c @ U)
        L.update(c, c_new)
        hv = vg.functions.linear(h, V, v) if layer else h @ V + v
        L.update(h, vg.tanh(hv + vg.sum(c_new, axis=1)))
    loss = vg.sum(L.final(h)) + vg.sum(L.final(c) ** 2)
    rng = np.random.default_rng(T)
    return g, loss, {"xs": rng.standard_normal((T, 2, 5, 3))}


@pytest.mark.parametrize("layer", [False, True], ids=["product", "layer"])
def test_a_tied_weights_uses_are_appended_to_its_product_in_compiled_code(monkeypatch, layer):
    """Compiled sweeps write out the weight-gradient VJP of a matrix times a tied weight (a
    product, or a fused layer's weight): each iteration's ``(a, g)`` is appended to the weight's
    pending RowsProductGrad — no object made, no call — with bitwise the interpreted sweep's
    gradients; an N-D operand takes the call."""
    T = 6
    made = []
    init = ops.RowsProductGrad.__init__

    def counting(self, a, g):
        made.append(a.shape)
        init(self, a, g)

    monkeypatch.setattr(ops.RowsProductGrad, "__init__", counting)
    with tapes(True):
        g, loss, feed = two_carries(T, layer)
        cg = g.build(feed, loss, cache=False)
        counts = []
        for _ in range(3):  # interpreted, then compiled twice
            cg.forward()
            cg.backward(loss)
            counts.append(len(made))
            made.clear()
    # interpreted: one per use (T of V, T of U, the hoisted group's W); compiled: V's first use only
    assert counts == [2 * T + 1, T + 2, T + 2]

    def run():
        g, loss, feed = two_carries(T, layer)
        return train(g, feeds_like(feed, STEPS), loss)

    assert_same(run)


@pytest.mark.parametrize("taped", [True, False], ids=["tapes", "no-tapes"])
def test_a_compiled_forward_recomputes_exactly_what_changed(taped):
    """Dirty checking through compiled forwards, which stamp every node one sweep recomputes with
    one clock reading: after each change, exactly the nodes downstream of it are recomputed (also
    a node with one changed and one unchanged parent), a forward with nothing changed recomputes
    nothing, and the values equal a fresh computation — as with tapes off."""
    cg = ComputeGraph(dtype=np.float64)
    a = cg.input(np.ones((2, 3)), name="a")
    b = cg.input(np.full((2, 3), 2.0), name="b")
    left = vg.tanh(a * 2.0)  # Mul, Tanh: a's side
    right = vg.exp(b - 1.0)  # Sub, Exp: b's side
    both = left + right  # Add: both sides
    out = vg.sum(both * both)  # Mul, Sum
    rng = np.random.default_rng(0)

    def recomputed():
        cg.forward(out)
        return cg.last_forward.recomputed

    with tapes(taped):
        for _ in range(2):  # the second forward compiles when tapes are on
            a.value = rng.normal(size=(2, 3))
            recomputed()
        assert any(isinstance(t, tape.ForwardTape) for t in cg._forward_tapes.values()) == taped
        counts = []
        for changed in ("a", "none", "b", "both", "none"):
            if changed in ("a", "both"):
                a.value = rng.normal(size=(2, 3))
            if changed in ("b", "both"):
                b.value = rng.normal(size=(2, 3))
            before = {n: n.version for n in (left, right, both)}
            counts.append(recomputed())
            newer = {n for n in before if n.version > before[n]}
            want_newer = {"a": {left, both}, "b": {right, both}, "both": {left, right, both}, "none": set()}
            assert newer == want_newer[changed], changed  # stamped exactly when recomputed
            assert all(n.version == before[n] for n in before if n not in newer)
            av, bv = a.value, b.value
            want = np.sum((np.tanh(av * 2.0) + np.exp(bv - 1.0)) ** 2)
            assert float(out.value) == pytest.approx(want, rel=1e-12)
    # a's side (Mul, Tanh) or b's (Sub, Exp), then Add, Mul, Sum; all 7 for both; none for none
    assert counts == [5, 0, 5, 7, 0]


# ---------------------------------------------------------------------------- gradient rows in one buffer


def wide_rnn(T=6, B=16, H=64, bias=True):
    """An RNN whose per-step values have at least ops.ROW_VJP_MIN elements (B * H = 1024)."""
    g = vg.VirtualGraph(seed=2)
    xs = g.input("xs", (None, B, 3))
    W, U = g.parameter("W", (3, H)), g.parameter("U", (H, H), init="orthogonal")
    b = g.parameter("b", (H,), init="normal")
    with g.loop() as L:
        h = L.carry(np.zeros((B, H)), name="h")
        s = L.step(xs) @ W + h @ U + (b if bias else 0.0)
        L.update(h, vg.tanh(s))
    loss = vg.sum(L.final(h) ** 2) + vg.mean(L.stack(h))
    return g, loss, s, {"xs": np.random.default_rng(T).standard_normal((T, B, 3))}


@pytest.mark.parametrize("bias", [True, False], ids=["reassociated", "row sum"])
def test_compiled_sweeps_write_a_loops_gradient_rows_into_one_buffer(monkeypatch, bias):
    """A tanh's gradient into a sum that reads a group's row goes into that row of one buffer per
    sweep (ops._tanh_vjp_row), which the group's gradient and W's stacked product then read with no
    copy: the parameter gradients are bitwise those of the interpreted sweeps and of a graph
    whose sums do not read rows (hoist=False), over several steps."""
    written, stacks = [], []
    into_row, rows_buffer = ops._tanh_vjp_row, ops._rows_buffer
    monkeypatch.setattr(
        tape, "_NAMESPACE", {**tape._NAMESPACE, "tanh_vjp_row": lambda *a: written.append(1) or into_row(*a)}
    )
    monkeypatch.setattr(ops, "_rows_buffer", lambda *a: stacks.append(rows_buffer(*a)) or stacks[-1])
    tape._compiled.clear()
    T = 6
    runs = {}
    for hoist, taped in [(True, True), (True, False), (False, True)]:
        g, loss, s, feed = wide_rnn(T, bias=bias)
        with tapes(taped):
            cg = g.build(feed, loss, hoist=hoist, cache=False)
            record = []
            for step in range(3):
                if step:
                    cg.feed({"xs": feed["xs"] * (1 + step)})
                    cg.forward()
                g.params.zero_grad()
                value = cg.backward(loss)
                record.append(
                    (value, {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None})
                )
        runs[hoist, taped] = record
    tape._compiled.clear()
    assert len(written) == 2 * T  # compiled sweeps 2 and 3 of the hoisted graph, one row a step
    assert sum(x is not None for x in stacks) >= 2  # the rows were read as their buffer
    for (v0, g0), (v1, g1), (v2, g2) in zip(runs[True, False], runs[True, True], runs[False, True]):
        assert v1 == v0 and g1.keys() == g0.keys() == g2.keys() and {"W", "U"} <= g0.keys()
        np.testing.assert_allclose(v1, v2, rtol=1e-12)
        for k in g0:
            assert np.array_equal(g1[k], g0[k]), k  # bitwise: the same operations, into a buffer
            np.testing.assert_allclose(g1[k], g2[k], rtol=1e-12, atol=1e-14, err_msg=k)


def test_gradients_kept_from_a_sweep_that_wrote_rows_into_a_buffer_stay_as_they_were():
    """A group's retained gradient (read from the rows' buffer) and a sum's (one of its rows) are
    the user's: later sweeps write into other memory. Each step's retained sum gradient is the plain
    unroll's (hoist=False, whose sums read no rows)."""
    g, loss, s, feed = wide_rnn()
    kept, plain_rows = [], []
    with tapes(True):
        cg = g.build(feed, loss, cache=False)
        plain = g.build(feed, loss, hoist=False, cache=False)
        group = next(n for k, n in cg._nodes.items() if k.type.endswith("*") and k.type.startswith("Add"))
        row, plain_row = cg.node(s, (3,)), plain.node(s, (3,))
        for n in (group, row, plain_row):
            n.retain_grad()
        for step in range(4):
            group.grad = row.grad = plain_row.grad = None
            for graph in (cg, plain):
                graph.feed({"xs": feed["xs"] * (1 + step)})
                graph.forward()
                g.params.zero_grad()
                graph.backward(loss)
            kept.append((group.grad, np.array(group.grad), row.grad, np.array(row.grad)))
            plain_rows.append(plain_row.grad)
    for (held, copy, row_held, row_copy), want in zip(kept, plain_rows):
        assert np.array_equal(held, copy) and np.array_equal(row_held, row_copy)  # unchanged since
        np.testing.assert_allclose(row_held, want, rtol=1e-12, atol=1e-14)


def test_two_sums_reading_one_groups_rows_get_a_buffer_each():
    """h1 = tanh(x W + h1 U1) and h2 = tanh(x W + h2 U2) read the rows of one group x W: each sum's
    gradient rows go into a buffer of their own (one would overwrite the other's)."""
    B, H, T = 16, 64, 5
    runs = []
    for taped in (False, True):
        g = vg.VirtualGraph(seed=5)
        xs = g.input("xs", (None, B, 3))
        W = g.parameter("W", (3, H))
        U1, U2 = g.parameter("U1", (H, H), init="orthogonal"), g.parameter("U2", (H, H), init="orthogonal")
        with g.loop() as L:
            h1, h2 = L.carry(np.zeros((B, H)), name="h1"), L.carry(np.zeros((B, H)), name="h2")
            xw = L.step(xs) @ W
            L.update(h1, vg.tanh(xw + h1 @ U1))
            L.update(h2, vg.tanh(xw + h2 @ U2))
        loss = vg.sum(L.final(h1) ** 2) + vg.sum(L.final(h2))
        feed = {"xs": np.random.default_rng(0).standard_normal((T, B, 3))}
        with tapes(taped):
            cg = g.build(feed, loss, cache=False)
            for _ in range(3):
                cg.forward()
                g.params.zero_grad()
                cg.backward(loss)
        runs.append({k: np.array(p.grad) for k, p in g.params.items()})
    for k in runs[0]:
        assert np.array_equal(runs[1][k], runs[0][k]), k


# ---------------------------------------------------------------------------- generated source


def _small_rnn() -> tuple[vg.VirtualGraph, object, object]:
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, 2, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (4, 4))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        L.update(h, vg.tanh(L.step(x) @ W + h @ U))
    return g, x, vg.sum(L.final(h))


def test_show_prints_the_compiled_code_a_graph_runs():
    g, _, loss = _small_rnn()
    cg = g.build({"x": np.ones((5, 2, 3))}, loss)
    assert tape.show(cg) == ""  # one sweep so far (the build's forward): nothing compiled
    cg.backward_ex(loss, retain_graph=True)
    assert tape.show(cg) == ""  # a plan is compiled on its second sweep
    cg.backward_ex(loss, retain_graph=True)
    text = tape.show(cg)
    assert text.startswith("# backward\n# nodes Sum:1")
    assert "def segment(N, staged):" in text and "Tanh:1@4" in text
    fn = cg._backward_tape[1]._calls[0][0]
    assert tape.source(fn) in text


def test_generated_code_shows_in_tracebacks_and_getsource():
    import inspect
    import traceback

    g, _, loss = _small_rnn()
    cg = g.build({"x": np.ones((3, 2, 3))}, loss)
    for _ in range(2):
        cg.backward_ex(loss, retain_graph=True)
    fn = cg._backward_tape[1]._calls[0][0]
    assert fn.__code__.co_filename.startswith("<vgraph tape ")
    assert inspect.getsource(fn) == tape.source(fn)
    with pytest.raises(ValueError) as info:
        fn([], [])  # unpacking its nodes fails on the function's second line
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert frame.filename == fn.__code__.co_filename and frame.line.startswith("n0, ")


def test_a_dropped_function_takes_its_source_with_it(monkeypatch):
    import linecache

    monkeypatch.setattr(tape, "CACHE_SIZE", 1)
    monkeypatch.setattr(tape, "_compiled", type(tape._compiled)())
    first = tape._function(("shape", 1), lambda: ["def segment(N, staged):", "    return 1"])
    name = first.__code__.co_filename
    assert linecache.getlines(name) == ["def segment(N, staged):\n", "    return 1\n"]
    tape._function(("shape", 2), lambda: ["def segment(N, staged):", "    return 2"])
    assert name not in linecache.cache
