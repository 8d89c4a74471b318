"""Hoisting (issue 10 §3): loop-body nodes that depend on no carried state run once for all
iterations — and nothing else changes.

Identity tests: every example model and random loop bodies, built with ``hoist=True`` and
``hoist=False``, give the same node keys, the same value at every key, the same retained gradient
at every node, the same parameter gradients and the same decisions (float64, 1e-12).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import test_custom_ops as custom_ops  # the custom ops' functions and VJPs
from hypothesis import example as explicit_example
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg
from vgraph import nn
from vgraph.ops import OPS
from vgraph.virtual.hoist import batched_attrs

ROOT = Path(__file__).resolve().parent.parent
TOL = {"rtol": 1e-12, "atol": 1e-12}


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"hoist_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


pytestmark = pytest.mark.usefixtures("float64", "per_node")  # tests/conftest.py: of the per-node path


def run(g, feed, outputs, loss, hoist):
    """Build, retain every gradient, backward; what the identity compares."""
    cg = g.build(feed, outputs, hoist=hoist)
    for n in cg.nodes():
        if n.requires_grad:
            n.retain_grad()
    g.params.zero_grad()
    value = cg.backward(loss)
    grads = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
    return cg, value, grads


def assert_identical(g, feed, outputs, loss, expect_hoisting=True):
    plain, v_plain, g_plain = run(g, feed, outputs, loss, hoist=False)
    hoisted, v_hoisted, g_hoisted = run(g, feed, outputs, loss, hoist=True)
    np.testing.assert_allclose(v_hoisted, v_plain, **TOL)
    assert g_hoisted.keys() == g_plain.keys()
    for k in g_plain:
        np.testing.assert_allclose(g_hoisted[k], g_plain[k], **TOL, err_msg=k)
    groups = [k for k in hoisted._nodes if k.type.endswith("*")]
    assert bool(groups) == expect_hoisting, groups
    assert set(hoisted._nodes) - set(groups) == set(plain._nodes)  # every key, and no other
    assert [(d.node, d.idx, d.kind, d.value) for d in hoisted.decisions] == [
        (d.node, d.idx, d.kind, d.value) for d in plain.decisions
    ]
    for key, p in plain._nodes.items():
        h = hoisted.node(key)
        np.testing.assert_allclose(h.value, p.value, **TOL, err_msg=str(key))
        if p.grad is None:
            assert h.grad is None or not h.requires_grad, key
        elif p.op is not None:
            np.testing.assert_allclose(h.grad, p.grad, **TOL, err_msg=str(key))
    return plain, hoisted


# ---------------------------------------------------------------------------- the example models


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_model_scripts_hoisted_equal_plain(script):
    g, feed, outputs = load(script).build()
    assert_identical(g, feed, outputs, outputs[0], expect_hoisting=script.stem != "branching")


def example(name):
    return load(ROOT / "examples" / f"{name}.py")


def rnn_bptt_case():
    """The flagship's model at a small size, and a feed for it: ``(graph, loss, feed)``."""
    g, outs = example("rnn_bptt").build_model(vocab=5, hidden=4, seed=0)
    rng = np.random.default_rng(0)
    feed = {
        "x": np.eye(5)[rng.integers(0, 5, (6, 3))],
        "y": rng.integers(0, 5, (6, 3)),
        "h0": np.zeros((3, 4)),
    }
    return g, outs["loss"], feed


def test_rnn_bptt_example():
    g, loss, feed = rnn_bptt_case()
    assert_identical(g, feed, [loss], loss)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lstm_sequence_example(cell):
    m = example("lstm_sequence")
    g, outs = m.build_model(cell, hidden=4, seed=0)
    x, y = m.adding_batch(np.random.default_rng(1), 3, 5)
    assert_identical(g, {"x": x, "y": y, "h0": np.zeros((3, 4))}, [outs["loss"]], outs["loss"])


def test_stacked_rnn_example():
    g, outs = example("stacked_rnn").build_model(layers=2, hidden=3, seed=0)
    rng = np.random.default_rng(2)
    feed = {"x": rng.normal(size=(5, 2, 1)), "y": rng.integers(0, 2, (5, 2)), "h0": np.zeros((2, 3))}
    assert_identical(g, feed, [outs["loss"]], outs["loss"])


def test_data_dependent_examples_do_not_hoist_and_stay_identical():
    # adaptive_loop: a while_ loop (trip count unknown before it runs); routing: branches.
    m = example("adaptive_loop")
    g, outs = m.build_model(hidden=4, tol=1e-3, max_steps=8, seed=0)
    assert_identical(g, m.feed(0.7), [outs["loss"]], outs["loss"], expect_hoisting=False)
    r = example("routing_branch")
    g, outs = r.build_model(hidden=4, seed=0)
    feed = r.batch(np.array([-0.8, 0.1, 0.9]))
    plain, hoisted = assert_identical(g, feed, [outs["loss"]], outs["loss"], expect_hoisting=False)
    assert len(plain.decisions) > 1


@pytest.mark.parametrize("tied", [True, False])
def test_untied_depth_example(tied):
    g, outs = example("untied_depth").build_model(tied=tied, layers=3, hidden=4, seed=0)
    rng = np.random.default_rng(3)
    feed = {"x": rng.normal(size=(5, 2)), "y": rng.normal(size=(5, 1))}
    # no stepped sequence and every body node reads the carry: nothing to hoist
    assert_identical(g, feed, [outs["loss"]], outs["loss"], expect_hoisting=False)


# ---------------------------------------------------------------------------- what is hoisted


def elman(times=None):
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    Wx = g.parameter("Wx", (3, 4))
    Wh = g.parameter("Wh", (4, 4))
    b = g.parameter("b", (4,))
    with g.loop(times=times) as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 4)), name="h")
        h_new = vg.tanh(x @ Wx + b + h @ Wh)
        L.update(h, h_new)
    return g, vg.sum(L.stack(h_new) ** 2), x, Wx


def test_carry_independent_nodes_become_one_group_each():
    g, loss, x, _ = elman()
    xs = np.random.default_rng(0).normal(size=(7, 2, 3))
    cg = g.build({"xs": xs}, loss)
    groups = sorted(str(k) for k in cg._nodes if k.type.endswith("*"))
    assert groups == ["Add*:1", "Item*:1", "MatMul*:1"]  # x_t, x_t @ Wx, + b; not the h @ Wh side
    group = cg.node("MatMul*:1")
    assert group.shape == (7, 2, 4)
    copy = cg.node("MatMul:1@3")
    assert copy.op.name == "Hoisted"
    assert np.shares_memory(copy.value, group.value)  # a view of the group's row
    np.testing.assert_allclose(copy.value, xs[3] @ g.params["Wx"].value, rtol=1e-12)


@pytest.mark.parametrize("cell", ["rnn", "lstm"])
def test_the_library_cells_add_their_bias_in_the_hoisted_group(cell):
    """nn.RNNCell and the unfused nn.LSTMCell write ``x_t @ W_x + b + h @ W_h``: the bias joins the
    input projection, so hoisting adds it once for every step instead of once per iteration."""
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", shape=(None, 2, 3))
    h0 = g.constant(np.zeros((2, 4)))
    module = nn.RNNCell(g, 3, 4, "cell") if cell == "rnn" else nn.LSTMCell(g, 3, 4, "cell", fused=False)
    with g.loop(name="t") as L:
        h = L.carry(h0, name="h")
        if cell == "rnn":
            L.update(h, module(L.step(x), h))
        else:
            c = L.carry(h0, name="c")
            h_new, c_new = module(L.step(x), (h, c))
            L.update(h, h_new)
            L.update(c, c_new)
    loss = vg.sum(L.final(h) ** 2)
    feed = {"x": np.random.default_rng(0).normal(size=(5, 2, 3))}
    _, hoisted = assert_identical(g, feed, [loss], loss)
    groups = sorted(k.type for k in hoisted._nodes if k.type.endswith("*"))
    assert groups == ["Add*", "Item*", "MatMul*"]


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_a_stack_of_weights_times_stepped_rows_is_hoisted(cell):
    """nn.Bidirectional's body: each direction's rows ``x_t`` ``(2, B, I)`` times its own weight of
    a stack ``(2, I, n)`` — hoisted as one ``(T, 2, B, I) @ (2, I, n)`` product (the iterations'
    axis does not meet the stack's), with the same values and gradients as plain; rows of a lower
    rank than the stack (which numpy would pair with every weight) are not hoisted."""
    assert batched_attrs(OPS["MatMul"], {}, [(2, 1, 3), (2, 3, 4)], [True, False], 5) == {}
    assert batched_attrs(OPS["MatMul"], {}, [(1, 3), (2, 3, 4)], [True, False], 5) is None
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", shape=(None, 2, 3))
    make = {"rnn": nn.RNNCell, "lstm": nn.LSTMCell, "gru": nn.GRUCell}[cell]
    out = nn.Bidirectional(make(g, 3, 4, "fwd"), make(g, 3, 4, "bwd"))(x)
    loss = vg.sum(vg.tanh(out) * np.arange(8.0))
    feed = {"x": np.random.default_rng(0).normal(size=(5, 2, 3))}
    _, hoisted = assert_identical(g, feed, [loss], loss)
    group = [n for k, n in hoisted._nodes.items() if k.type == "MatMul*"]
    assert [n.shape for n in group] == [(5, 2, 2, {"rnn": 4, "lstm": 16, "gru": 12}[cell])]


@pytest.mark.parametrize(
    ("a", "b", "sa", "sb", "groups"),
    [
        ((2, 1, 3), (2, 3, 4), True, False, True),  # rows of each copy times their weight of a stack
        ((1, 3), (2, 3, 4), True, False, False),  # numpy would pair every row with every weight
        ((3,), (3, 4), True, False, True),
        ((5, 3), (3, 4), False, True, True),  # a shared matrix times each copy's weight
        ((2, 5, 3), (3, 4), False, True, False),  # ... of a higher rank: its axes meet the copies'
        ((5, 3), (3, 4), True, True, True),  # both stacked, the same rank: their new axes meet
        ((2, 5, 3), (3, 4), True, True, False),  # of different ranks: they would not
        ((2, 5, 3), (2, 3, 4), True, True, True),
    ],
)
def test_a_product_is_computed_for_many_copies_only_where_numpy_pairs_them_right(a, b, sa, sb, groups):
    """batched_attrs for MatMul: where it groups copies, the grouped product is each copy's
    product (checked with numpy); where numpy would pair them otherwise, it refuses."""
    n = 3
    attrs = batched_attrs(OPS["MatMul"], {}, [a, b], [sa, sb], n)
    assert (attrs is not None) == groups
    if groups:
        rng = np.random.default_rng(0)
        xa = rng.normal(size=(n, *a) if sa else a)
        xb = rng.normal(size=(n, *b) if sb else b)
        each = np.stack([(xa[k] if sa else xa) @ (xb[k] if sb else xb) for k in range(n)])
        np.testing.assert_allclose(xa @ xb, each, rtol=1e-12)


def test_times_shorter_than_the_sequence_hoists_only_the_steps_that_run():
    g, loss, _, _ = elman(times=3)
    cg = g.build({"xs": np.ones((7, 2, 3))}, loss)
    assert cg.node("MatMul*:1").shape == (3, 2, 4)
    assert cg.trip_count(g.nodes[[v.type for v in g.nodes].index("Loop")]) == 3


def test_reforward_after_feed_recomputes_the_group_and_matches_a_fresh_build():
    g, loss, _, _ = elman()
    rng = np.random.default_rng(1)
    cg = g.build({"xs": rng.normal(size=(5, 2, 3))}, loss)
    new = rng.normal(size=(5, 2, 3))
    cg.feed({"xs": new})
    value = cg.forward(explain=True)
    assert any(k.type == "MatMul*" for k, _ in cg.last_forward.explanation)
    fresh = g.build({"xs": new}, loss, hoist=False)
    np.testing.assert_allclose(value, fresh.forward(), rtol=1e-12)


def test_a_while_loop_is_not_hoisted():
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 3))
    W = g.parameter("W", (3, 3))
    with g.loop(while_=lambda t, s: t < 4) as L:
        h = L.carry(np.zeros(3), name="h")
        L.update(h, vg.tanh(L.step(xs) @ W + h))
    cg = g.build({"xs": np.ones((6, 3))}, vg.sum(L.final(h)))
    assert not any(k.type.endswith("*") for k in cg._nodes)


def test_anomaly_in_a_hoisted_group_names_the_iteration():
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + vg.log(L.step(xs)))
    values = np.ones((9, 2))
    values[6, 1] = -1.0
    with pytest.raises(
        vg.NonFiniteError,
        match=r"NaN first appears at <Log:1@6> \(hoisted: computed for every iteration by <Log\*:1>\): log of a negative input \(min -1\)",
    ):
        g.build({"xs": values}, vg.sum(L.final(h)), detect_anomaly=True)


# ---------------------------------------------------------------------------- random loop bodies

UNARY = ["tanh", "sigmoid", "exp_small", "neg", "square"]
BINARY = ["add", "sub", "mul", "matmul"]


def apply_unary(name, a):
    return {
        "tanh": vg.tanh,
        "sigmoid": vg.sigmoid,
        "exp_small": lambda v: vg.exp(vg.tanh(v)),
        "neg": lambda v: -v,
        "square": lambda v: v * v,
    }[name](a)


@st.composite
def loop_bodies(draw):
    """A random body over x_t (stepped), h (carried), W and b (captured), and earlier body nodes."""
    steps = draw(st.integers(1, 6))
    times = draw(st.one_of(st.none(), st.integers(0, steps)))
    program = []
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["unary", "binary", "invariant"]))
        if kind == "unary":
            program.append(("unary", draw(st.sampled_from(UNARY)), draw(st.integers(0, 100))))
        elif kind == "invariant":  # (p_i + p_j) + b, or b + (...): a sum a build may reassociate
            # (often b * x_t and h: hoisted work plus carried state, the case it reassociates)
            i, j = draw(
                st.one_of(
                    st.sampled_from([(2, 1), (1, 2)]), st.tuples(st.integers(0, 100), st.integers(0, 100))
                )
            )
            program.append(("invariant", draw(st.booleans()), i, j))
        else:
            program.append(
                (
                    "binary",
                    draw(st.sampled_from(BINARY)),
                    draw(st.integers(0, 100)),
                    draw(st.integers(0, 100)),
                )
            )
    update_from = draw(st.integers(0, 100))
    stack_from = draw(st.integers(0, 100))
    return steps, times, program, update_from, stack_from


def loop_body_model(body, branch=None):
    """The model a :func:`loop_bodies` example describes: ``(graph, loss, feed)``. ``branch``:
    ``(i, j)``, the carry's update chosen per iteration by the sign of ``x_t[0, 0]`` between the
    usual one and one from pool entry ``j`` (``i``: which option the usual one is)."""
    steps, times, program, update_from, stack_from = body
    g = vg.VirtualGraph(seed=5)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 3), init="orthogonal")
    b = g.parameter("b", (3,), init=vg.nn.init.normal(0.5))
    with g.loop(times=times) as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 3)), name="h")
        pool = [x, h, b * x]
        for instr in program:
            if instr[0] == "unary":
                pool.append(apply_unary(instr[1], pool[instr[2] % len(pool)]))
            elif instr[0] == "invariant":
                part = pool[instr[2] % len(pool)] + pool[instr[3] % len(pool)]
                pool.append(part + b if instr[1] else b + part)
            else:
                a, c = pool[instr[2] % len(pool)], pool[instr[3] % len(pool)]
                pool.append(
                    vg.tanh(a) @ W
                    if instr[1] == "matmul"
                    else {"add": a + c, "sub": a - c, "mul": a * c}[instr[1]]
                )
        update = vg.tanh(pool[update_from % len(pool)] + h)
        if branch is not None:
            other = vg.sigmoid(pool[branch[1] % len(pool)]) * h
            options = [update, other] if branch[0] % 2 == 0 else [other, update]
            update = g.branch(lambda v: int(v[0, 0] > 0), options, keys=[x], name="sign")
        L.update(h, update)
        out = pool[stack_from % len(pool)]
    loss = vg.sum(L.final(h) ** 2) + vg.sum(W * W) + (vg.sum(L.stack(out)) if steps and times != 0 else 0.0)
    return g, loss, {"xs": np.random.default_rng(steps).normal(size=(steps, 2, 3))}


def hoisted_equals_plain(g, feed, loss):
    """Build and differentiate ``loss`` plain and hoisted; the loss, every parameter gradient,
    every node's value and every retained gradient agree (``TOL``). Returns both runs."""
    plain, hoisted = run(g, feed, [loss], loss, False), run(g, feed, [loss], loss, True)
    np.testing.assert_allclose(hoisted[1], plain[1], **TOL)
    for k in plain[2]:
        np.testing.assert_allclose(hoisted[2][k], plain[2][k], **TOL)
    for key, p in plain[0]._nodes.items():
        h = hoisted[0].node(key)
        np.testing.assert_allclose(h.value, p.value, **TOL)
        if p.grad is not None and p.op is not None:  # retained gradients (run retains all)
            np.testing.assert_allclose(h.grad, p.grad, **TOL, err_msg=str(key))
    return plain, hoisted


@settings(max_examples=40, deadline=None, derandomize=True)
@given(loop_bodies())
@explicit_example((4, None, [("invariant", True, 2, 1)], 3, 3))  # (b x_t + h) + b: reassociated
@explicit_example(
    (3, None, [("binary", "matmul", 2, 0), ("invariant", False, 1, 3), ("unary", "tanh", 4)], 5, 4)
)
def test_random_loop_bodies_hoisted_equal_plain(body):
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        g, loss, feed = loop_body_model(body)
        hoisted_equals_plain(g, feed, loss)
    finally:
        vg.set_default_dtype(previous)


def test_grad_with_respect_to_hoisted_copies_equals_plain():
    g, loss, _, _ = elman()
    feed = {"xs": np.random.default_rng(4).normal(size=(5, 2, 3))}
    results = []
    for hoist in (False, True):
        cg = g.build(feed, loss, hoist=hoist)
        wanted = [cg.node("MatMul:1@2"), cg.node("Tanh:1@4"), cg.node("Add:1@0"), g.params["Wx"]]
        results.append(cg.grad(loss, wanted))
    for plain, hoisted in zip(*results):
        np.testing.assert_allclose(hoisted, plain, **TOL)


# ---------------------------------------------------------------------------- the fused loss


def test_a_per_step_cross_entropy_of_stepped_logits_is_hoisted_and_batched():
    """SoftmaxCrossEntropy groups like the LogSoftmax and TakeAlongAxis it replaced: across the
    iterations of a loop (hoisting) and across inputs (autobatching), when both its logits and its
    labels differ per copy."""
    g = vg.VirtualGraph(seed=0)
    x = g.input("x", (None, 2, 3))
    labels = g.input("labels", (None, 2))
    W = g.parameter("W", (3, 5))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 5)), name="h")
        logits = L.step(x) @ W  # depends on no carried state
        step_loss = vg.losses.cross_entropy(logits, L.step(labels), reduction="sum")
        L.update(h, vg.tanh(logits + h))
    loss = vg.sum(L.stack(step_loss)) + vg.sum(L.final(h) ** 2)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.normal(size=(T, 2, 3)), "labels": rng.integers(0, 5, (T, 2))} for T in (4, 6, 4)]
    plain, hoisted = assert_identical(g, feeds[0], [loss], loss)
    assert any(k.type == "SoftmaxCrossEntropy*" for k in hoisted._nodes)

    g.params.zero_grad()
    batch = g.build_batch(feeds, loss)
    total = batch.backward("sum")
    # one op for the three inputs (hoisted inside the batched build too: every iteration at once)
    assert ("SoftmaxCrossEntropy*:1", 3) in batch.groups
    grads = {k: np.array(p.grad) for k, p in g.params.items()}
    g.params.zero_grad()
    alone = 0.0
    for feed in feeds:
        alone += g.build(feed, loss, cache=False).backward(loss)
    np.testing.assert_allclose(total, alone, **TOL)
    for k, p in g.params.items():
        np.testing.assert_allclose(grads[k], p.grad, **TOL, err_msg=k)


# ---------------------------------------------------------------------------- computed when read


def two_hoisted_steps():
    """h_t = tanh(tanh(x_t @ W) + h_{t-1} @ U): x_t @ W is read only by hoisted work (tanh's group)."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        u = L.step(xs) @ W
        L.update(h, vg.tanh(vg.tanh(u) + h @ U))
    return g, vg.sum(L.final(h) ** 2), u


def test_copies_only_hoisted_work_reads_stay_current_after_a_feed():
    """A copy of a hoisted node that no unrolled node reads is on no forward's plan: kept as a view
    of an old group value it went stale after feed + forward (a silently wrong .value). Computed
    when read, it is row t of the group's current value."""
    g, loss, u = two_hoisted_steps()
    rng = np.random.default_rng(0)
    cg = g.build({"xs": rng.normal(size=(3, 2, 3))}, loss)
    copy = cg.node(u, (1,))
    assert cg.computed_when_read(copy) and copy._value is None
    new = rng.normal(size=(3, 2, 3))
    cg.feed({"xs": new})
    cg.forward()
    W = g.params["W"].value
    np.testing.assert_allclose(copy.value, new[1] @ W, **TOL)  # by hand, not by the graph
    np.testing.assert_allclose(cg.node("Item:1@2").value, new[2], **TOL)  # the stepped item's copy too
    assert copy.shape == (2, 4) and copy._value is None  # read, not kept
    plain, hoisted = assert_identical(g, {"xs": new}, [loss], loss)
    assert hoisted.computed_when_read(hoisted.node(u, (0,))) and not plain.computed_when_read(
        plain.node(u, (0,))
    )
    # grad() with respect to such copies: their groups are on the path (they have no reader)
    plain.forward(), hoisted.forward()  # (assert_identical ran a backward: released)
    ref = plain.grad(loss, [plain.node(u, (t,)) for t in range(3)])
    for got, want in zip(hoisted.grad(loss, [hoisted.node(u, (t,)) for t in range(3)]), ref):
        np.testing.assert_allclose(got, want, **TOL)


def test_a_node_computed_when_read_becomes_computed_when_a_node_reads_it():
    g, loss, u = two_hoisted_steps()
    rng = np.random.default_rng(1)
    cg = g.build({"xs": rng.normal(size=(3, 2, 3))}, loss)
    copy = cg.node(u, (2,))
    count = len(cg)
    with pytest.raises(vg.ShapeError):  # a failed apply changes nothing
        cg.apply("MatMul", [copy, np.ones((3, 3))])
    assert len(cg) == count and cg.computed_when_read(copy) and copy._value is None
    doubled = cg.apply("Mul", [copy, 2.0])
    assert not cg.computed_when_read(copy)
    new = rng.normal(size=(3, 2, 3))
    cg.feed({"xs": new})
    np.testing.assert_allclose(cg.forward(doubled), 2 * new[2] @ g.params["W"].value, **TOL)
    np.testing.assert_allclose(copy._value, new[2] @ g.params["W"].value, **TOL)  # kept and current
    with pytest.raises(vg.GraphStateError, match="not a node of this graph"):
        cg.computed_when_read(g.build({"xs": new}, loss, cache=False).node(u, (0,)))


# ---------------------------------------------------------------------------- reassociated sums


def rnn(order="x W + h U + b", T=5, bias=(4,)):
    """A loop whose update sums x_t @ W (hoistable), h @ U (carried) and a bias, in ``order``."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4))
    b = g.parameter("b", bias, init="normal") if bias != "tied" else None
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        xw, hu = L.step(xs) @ W, h @ U
        if bias == "tied":  # a tied parameter declared in the body, after the partial sum
            part = xw + hu
            b = g.parameter("b", (4,), init="normal", share=True)
            total = part + b
        else:
            part, total = {
                "x W + h U + b": lambda: (p := xw + hu, p + b),
                "h U + x W + b": lambda: (p := hu + xw, p + b),
                "b + (x W + h U)": lambda: (p := xw + hu, b + p),
            }[order]()
        h_new = vg.tanh(total)
        L.update(h, h_new)
    loss = vg.sum(L.stack(h_new) ** 2)
    feed = {"xs": np.random.default_rng(T).normal(size=(T, 2, 3))}
    return g, loss, feed, part, total


def per_iteration_sums(cg, ops=("Add", "AddRow", "MatMulAddRow")):
    """The additions (or other ``ops``) a forward to the outputs computes in each iteration."""
    plan = cg._forward_plan(tuple(cg.outputs))
    iterations = {n.key.idx for n in plan if len(n.key.idx) == 1}
    return sorted({sum(1 for n in plan if n.op.name in ops and n.key.idx == t) for t in iterations})


def carried_product(part):
    """``h @ U`` of the partial sum ``part`` of :func:`rnn`."""
    return next(u for u in part.inputs if u.type == "MatMul" and u.inputs[1].name == "U")


@pytest.mark.parametrize("order", ["x W + h U + b", "h U + x W + b", "b + (x W + h U)"])
def test_a_sum_with_a_loop_invariant_addend_is_reassociated(order):
    """(x_t W + h U) + b is computed as (x_t W + b) + h U: the bias added once for every iteration
    in a hoisted group, one addition per iteration, which also computes h U (read by nothing
    else); the partial sum and the product keep their keys, and their values and gradients are
    the plain unroll's."""
    g, loss, feed, part, total = rnn(order)
    hu = carried_product(part)
    plain, hoisted = assert_identical(g, feed, [loss], loss)
    assert per_iteration_sums(plain) == [2] and per_iteration_sums(hoisted) == [1]
    assert per_iteration_sums(plain, ("MatMul",)) == [2] and per_iteration_sums(hoisted, ("MatMul",)) == [0]
    group = hoisted.node(f"Add*:{total.id}")
    assert group.shape == (5, 2, 4) and g.params["b"] in group.parents
    for t in range(5):
        d, p, m = hoisted.node(part, (t,)), hoisted.node(total, (t,)), hoisted.node(hu, (t,))
        assert hoisted.computed_when_read(d) and hoisted.computed_when_read(m)
        assert not hoisted.computed_when_read(p) and hoisted._deferred[m] is p
        assert p.op.name == "MatMulAddRow" and p.parents == (*m.parents, group) and p.attrs["index"] == t
    assert len(hoisted) == len(plain) + 3  # x_t, x_t W and x_t W + b for every step: no node per step
    # by hand: the products h_{t-1} U and the partial sums x_t W + h_{t-1} U
    P = {k: g.params[k].value for k in ("W", "U", "b")}
    h = np.zeros((2, 4))
    for t, x in enumerate(feed["xs"]):
        np.testing.assert_allclose(hoisted.node(hu, (t,)).value, h @ P["U"], **TOL)
        np.testing.assert_allclose(hoisted.node(part, (t,)).value, x @ P["W"] + h @ P["U"], **TOL)
        h = np.tanh(x @ P["W"] + h @ P["U"] + P["b"])


def test_a_tied_parameter_declared_in_the_body_is_an_invariant_addend():
    g, loss, feed, part, total = rnn(bias="tied")
    plain, hoisted = assert_identical(g, feed, [loss], loss)
    assert per_iteration_sums(hoisted) == [1] and hoisted.computed_when_read(hoisted.node(part, (2,)))


def test_a_sum_whose_partial_gradient_would_differ_is_built_as_declared():
    """Reassociated, the partial sum's gradient is the whole sum's; so an addend that broadcasts the
    partial sum to a larger shape keeps the declared order. (A dtype it would promote keeps it too;
    a graph's parameters and constants all have its dtype.)"""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (4, 4))
    k = g.parameter("k", (2, 4), init="normal")  # (4,) + (2, 4): a larger sum
    with g.loop() as L:
        h = L.carry(np.zeros(4), name="h")
        part = L.step(xs) @ W + h @ U
        L.update(h, vg.sum(vg.tanh(part + k), axis=0))
    loss = vg.sum(L.final(h) ** 2)
    plain, hoisted = assert_identical(g, {"xs": np.random.default_rng(0).normal(size=(4, 3))}, [loss], loss)
    assert not any(p is not None for p in hoisted._deferred.values())
    assert per_iteration_sums(hoisted) == [2]


def test_a_partial_sum_read_elsewhere_is_not_reassociated():
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    W, U, b = g.parameter("W", (3, 4)), g.parameter("U", (4, 4)), g.parameter("b", (4,))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        part = L.step(xs) @ W + h @ U
        L.update(h, vg.tanh(part + b))
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(part))
    plain, hoisted = assert_identical(g, {"xs": np.ones((4, 2, 3))}, [loss], loss)
    assert per_iteration_sums(plain) == per_iteration_sums(hoisted) == [2]
    assert not [k for k in hoisted._nodes if k.type == "Add*"]  # no group x_t W + b
    d = hoisted.node(part, (2,))  # kept (a stack reads it), built row by row: rows[2] + h U
    assert not hoisted.computed_when_read(d) and d.op.name == "MatMulAddRow"


def test_a_partial_sum_never_mixes_old_and_new_values():
    """A partial sum computed when read is computed from what the last forward left: if that is
    what its sum used, its value is the plain unroll's; if a forward to the outputs left part of it
    out of date (a carry the loss does not read) while it recomputed the rest, reading it raises
    instead of adding a new term to an old one, and a forward to it gives the plain unroll's."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    W, U, b = g.parameter("W", (3, 4)), g.parameter("U", (4, 4)), g.parameter("b", (4,), init="normal")
    with g.loop() as L:
        h, k = L.carry(np.zeros((2, 4)), name="h"), L.carry(np.full((2, 4), 0.5), name="k")
        xw = L.step(xs) @ W
        L.update(h, vg.tanh(xw + h @ U))
        part = xw + vg.tanh(k) * k
        L.update(k, vg.tanh(part + b))  # (the loss reads h only: forward() leaves k's chain alone)
    loss = vg.sum(L.final(h) ** 2)
    rng = np.random.default_rng(5)
    feed, new = ({"xs": rng.normal(size=(4, 2, 3))} for _ in range(2))
    cg, plain = g.build(feed, loss, cache=False), g.build(feed, loss, hoist=False, cache=False)
    d, d_plain = cg.node(part, (2,)), plain.node(part, (2,))
    assert cg.computed_when_read(d)
    np.testing.assert_allclose(d.value, d_plain.value, **TOL)
    for graph in (cg, plain):  # a parameter changed: the values d is computed from did not
        graph.backward(loss)
    g.params["W"].value = g.params["W"].value + 1.0
    np.testing.assert_allclose(d.value, d_plain.value, **TOL)  # both: as the last forward left it
    for graph in (cg, plain):
        graph.feed(new)
        graph.forward()
    with pytest.raises(
        vg.GraphStateError,
        match=r"<Add:\d+@2> keeps no value.*mix old and new values: <\S+> is stale, <Input:1> 'xs' was fed",
    ):
        d.value  # noqa: B018
    assert "computed when read: inputs changed since the last forward" in vg.render.explore(cg)
    np.testing.assert_allclose(cg.forward(d), plain.forward(d_plain), **TOL)
    np.testing.assert_allclose(d.value, d_plain.value, **TOL)


@pytest.mark.parametrize("which", ["partial sum", "product"])
def test_gradients_values_and_forward_of_a_node_computed_when_read_equal_the_plain_unroll(which):
    """The partial sum x W + h U, and h U, whose work the sum does (MatMulAddRow): retain_grad,
    grad() with respect to it and from it, backward from it and forward to it as in the plain
    unroll, though no sweep computes it; apply() refuses to read it and changes nothing."""
    g, loss, feed, part, total = rnn()
    v = part if which == "partial sum" else carried_product(part)
    results = []
    for hoist in (False, True):
        cg = g.build(feed, loss, hoist=hoist, cache=False)
        d = cg.node(v, (2,))
        d.retain_grad()
        g.params.zero_grad()
        cg.backward(loss)
        retained = np.array(d.grad)
        cg.forward()
        (wrt_d,) = cg.grad(loss, [d])
        cg.forward()
        g.params.zero_grad()
        cg.backward(d, seed=np.ones((2, 4)))  # a backward from it, as from any node
        from_d = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
        cg.forward()
        (from_d["grad W"],) = cg.grad(d, [g.params["W"]], seeds=[np.ones((2, 4))])  # grad() from it
        cg.feed({"xs": np.random.default_rng(9).normal(size=(5, 2, 3))})
        forwarded = np.array(cg.forward(d))
        results.append((retained, wrt_d, from_d, forwarded))
        if hoist:
            assert cg.computed_when_read(d) and d._value is None
            assert not any(cg.computed_when_read(n) for n in cg._backward_plan())  # (no sweep reaches them)
            count = len(cg)
            with pytest.raises(
                vg.GraphStateError, match=rf"<{v.type}:\d+@2> is computed when read.*hoist=False"
            ):
                cg.apply("Mul", [d, 2.0])
            assert len(cg) == count and cg.computed_when_read(d)
    (r0, w0, g0, f0), (r1, w1, g1, f1) = results
    for got, want in ((r1, r0), (w1, w0), (f1, f0)):
        np.testing.assert_allclose(got, want, **TOL)
    assert g1.keys() == g0.keys() == {"W", "U", "b", "grad W"}
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], **TOL, err_msg=k)


def test_a_value_computed_when_read_is_never_computed_from_out_of_date_values():
    """After an optimiser step, h_2 U would be computed from the step's U and the h_2 the old U
    gave: a value no forward computes. Reading it (or the partial sum that reads it) raises and says
    what changed; shape and dtype stay known; after a forward the value is the new parameters'."""
    g, loss, feed, part, total = rnn()
    hu = carried_product(part)
    cg = g.build(feed, loss)
    m, d = cg.node(hu, (3,)), cg.node(part, (3,))
    cg.backward(loss)
    U = g.params["U"]
    U.value = U.value - 0.1 * U.grad
    for node in (m, d):
        with pytest.raises(
            vg.GraphStateError,
            match=r"keeps no value.*<Add:\d+@\d> is stale, <Parameter:\d+> 'U' was changed",
        ):
            node.value  # noqa: B018
        assert node.shape == (2, 4) and node.dtype == np.float64
    plans = len(cg._forward_plans)
    page = vg.render.explore(cg)  # the explorer opens all the same, saying why it shows no values
    assert len(cg._forward_plans) == plans  # (a read walks to the first stale node: no plan kept)
    assert "computed when read: inputs changed since the last forward" in page
    cg.forward()
    P = {k: g.params[k].value for k in ("W", "U", "b")}
    h = np.zeros((2, 4))
    for x in feed["xs"][:3]:
        h = np.tanh(x @ P["W"] + h @ P["U"] + P["b"])
    np.testing.assert_allclose(m.value, h @ P["U"], **TOL)
    np.testing.assert_allclose(d.value, feed["xs"][3] @ P["W"] + h @ P["U"], **TOL)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the overflow it is about)
def test_anomaly_detection_names_the_sum_that_computes_its_product():
    """Under detect_anomaly, a sum x_t W + h U that overflows though its terms are finite is named,
    as the plain unroll names its addition (the build's value of the fused node is checked)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4), init=np.full((3, 4), 5e307))  # x_t W = 1.5e308
    U = g.parameter("U", (4, 4), init=np.full((4, 4), 4e307))  # h U = 1.6e308 (h = 1)
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        total = L.step(xs) @ W + h @ U
        L.update(h, vg.tanh(total))
    loss = vg.sum(L.final(h))
    for hoist in (False, True):
        with (
            vg.detect_anomaly(),
            pytest.raises(vg.NonFiniteError, match=rf"Inf first appears at <Add:{total.id}@1>"),
        ):
            g.build({"xs": np.ones((3, 2, 3))}, loss, hoist=hoist, cache=False)
    assert g.build({"xs": np.ones((3, 2, 3))}, loss, cache=False).node(total, (1,)).op.name == "MatMulAddRow"


def test_a_product_read_elsewhere_or_not_a_product_is_not_fused():
    """h U read by another node too keeps its value (an AddRow adds it); so does a carried term
    that is no product."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    W, U, b = g.parameter("W", (3, 4)), g.parameter("U", (4, 4)), g.parameter("b", (4,))
    with g.loop() as L:
        h, k = L.carry(np.zeros((2, 4)), name="h"), L.carry(np.zeros((2, 4)), name="k")
        hu = h @ U
        L.update(h, vg.tanh(L.step(xs) @ W + hu + b))
        L.update(k, vg.tanh(L.step(xs) @ W + vg.tanh(k) * k + b) + hu)
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.final(k) ** 2)
    plain, hoisted = assert_identical(g, {"xs": np.ones((4, 2, 3))}, [loss], loss)
    assert per_iteration_sums(hoisted, ("AddRow",)) == [2] and per_iteration_sums(
        hoisted, ("MatMulAddRow",)
    ) == [0]
    assert not hoisted.computed_when_read(hoisted.node(hu, (2,)))


def test_the_renderer_marks_nodes_computed_when_read():
    g, loss, feed, part, total = rnn()
    cg = g.build(feed, loss)
    dot = vg.render.to_dot(cg, fold=None)
    # each partial sum and each product h U, naming the sum that computes its work
    assert dot.count(f"computed when read, in &lt;Add:{total.id}@") == 10
    assert "the hoisted part of &lt;Add:" in dot
    lines = {m[1]: m[0] for m in re.finditer(r'^\s*"([^"]+)" \[.*$', dot, re.M)}  # node statements
    for drawn in (f"Add:{part.id}@2", f"MatMul:{carried_product(part).id}@2"):
        assert "dashed" in lines[drawn]  # drawn with a dashed outline: no value kept
    assert f"product + row 2 of &lt;Add*:{total.id}&gt;" in lines[f"Add:{total.id}@2"]
    assert "dashed" not in lines[f"Add:{total.id}@2"]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.integers(2, 6),
    st.sampled_from(["x W", "tanh(x W)", "x W / 2"]),
    st.sampled_from(["h U", "h", "tanh(h) * h"]),
    st.sampled_from(["parameter", "tied", "constant"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_random_reassociated_sums_equal_plain(T, hoisted, carried, addend, a_first, k_last, stack_sum):
    """(a + c) + k in every operand order, with a hoisted work of several forms, c carried state,
    k a captured parameter, a tied parameter declared in the body or a constant, the sum stacked
    or not: reassociated, and every key's value and retained gradient equal the plain unroll's."""
    g = vg.VirtualGraph(seed=3)
    xs = g.input("xs", (None, 2, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (4, 4), init="orthogonal")
    k = {
        "parameter": lambda: g.parameter("k", (4,), init="normal"),
        "constant": lambda: g.constant(np.linspace(-1, 1, 4)),
        "tied": lambda: None,
    }[addend]()  # captured from outside the loop, or (tied) declared in its body below
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        x = L.step(xs)
        a = {"x W": lambda: x @ W, "tanh(x W)": lambda: vg.tanh(x @ W), "x W / 2": lambda: x @ W * 0.5}[
            hoisted
        ]()
        c = {"h U": lambda: h @ U, "h": lambda: h, "tanh(h) * h": lambda: vg.tanh(h) * h}[carried]()
        part = a + c if a_first else c + a
        kk = g.parameter("k", (4,), init="normal", share=True) if addend == "tied" else k
        total = part + kk if k_last else kk + part
        h_new = vg.tanh(total)
        L.update(h, h_new)
    loss = vg.sum(L.final(h) ** 2) + (vg.sum(L.stack(total)) if stack_sum else 0.0)
    feed = {"xs": np.random.default_rng(T).normal(size=(T, 2, 3))}
    plain, hoisted_cg = assert_identical(g, feed, [loss], loss)
    assert hoisted_cg.computed_when_read(hoisted_cg.node(part, (T - 1,)))
    assert per_iteration_sums(plain) == [2] and per_iteration_sums(hoisted_cg) == [1]


def row_sum_model(T, hoisted, carried, a_first=True, bias_last=False, stack_sum=False):
    """tanh(a + c), or tanh((a + c) + b): ``a`` hoisted work of the form ``hoisted`` ("x W",
    "tanh(x W)", "x W + b"), ``c`` per-iteration work of the form ``carried`` ("h U", "h",
    "tanh(h) * h", "h U, read twice"); returns ``(g, loss, feed, a, c, total)``."""
    g = vg.VirtualGraph(seed=4)
    xs = g.input("xs", (None, 2, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (4, 4), init="orthogonal")
    b = g.parameter("b", (4,), init="normal")
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        x = L.step(xs)
        a = {"x W": lambda: x @ W, "tanh(x W)": lambda: vg.tanh(x @ W), "x W + b": lambda: x @ W + b}[
            hoisted
        ]()
        c = {
            "h U": lambda: h @ U,
            "h": lambda: h,
            "tanh(h) * h": lambda: vg.tanh(h) * h,
            "h U, read twice": lambda: h @ U,
        }[carried]()
        total = a + c if a_first else c + a
        if bias_last:
            total = total + b
        L.update(h, vg.tanh(total) * (c if carried == "h U, read twice" else 1.0))
    loss = vg.sum(L.final(h) ** 2) + (vg.sum(L.stack(total)) if stack_sum else 0.0)
    return g, loss, {"xs": np.random.default_rng(T).normal(size=(T, 2, 3))}, a, c, total


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.integers(2, 6),
    st.sampled_from(["x W", "tanh(x W)", "x W + b"]),
    st.sampled_from(["h U", "h", "tanh(h) * h", "h U, read twice"]),
    st.booleans(),
    st.booleans(),
)
def test_random_row_sums_equal_plain(T, hoisted, carried, a_first, stack_sum):
    """a + c with a hoisted work of several forms (nn.RNNCell's x W + b among them) and c
    per-iteration work, in either order, the sum stacked or not: built from a's rows (one node per
    iteration; c's product too when only the sum reads it), and every key's value and retained
    gradient equal the plain unroll's."""
    g, loss, feed, a, c, total = row_sum_model(T, hoisted, carried, a_first, stack_sum=stack_sum)
    plain, hoisted_cg = assert_identical(g, feed, [loss], loss)
    s = hoisted_cg.node(total, (T - 1,))
    fused = carried == "h U"
    assert s.op.name == ("MatMulAddRow" if fused else "AddRow")
    assert hoisted_cg.computed_when_read(hoisted_cg.node(c, (T - 1,))) == fused
    assert hoisted_cg.computed_when_read(hoisted_cg.node(a, (T - 1,)))  # only the sum reads it


def test_the_library_rnn_cell_reads_its_projection_rows():
    """nn.RNNCell writes x_t W_x + b + h W_h: x_t W_x + b is hoisted whole, and each step is one
    MatMulAddRow node and a tanh, as for the model written with the bias last; by hand."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    cell = nn.RNNCell(g, 3, 4, name="rnn")
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        h_new = cell(L.step(xs), h)
        L.update(h, h_new)
    loss = vg.sum(L.final(h) ** 2)
    feed = {"xs": np.random.default_rng(1).normal(size=(5, 2, 3))}
    plain, hoisted = assert_identical(g, feed, [loss], loss)
    z = h_new.inputs[0]  # the sum tanh reads
    assert per_iteration_sums(hoisted, ("MatMulAddRow", "Tanh")) == [2] and len(
        hoisted._forward_plan(tuple(hoisted.outputs))
    ) < len(plain._forward_plan(tuple(plain.outputs)))
    P = {k: g.params[k].value for k in ("rnn.W_x", "rnn.W_h", "rnn.b")}
    h = np.zeros((2, 4))
    for t, x in enumerate(feed["xs"]):
        np.testing.assert_allclose(
            hoisted.node(z, (t,)).value, x @ P["rnn.W_x"] + P["rnn.b"] + h @ P["rnn.W_h"], **TOL
        )
        h = np.tanh(x @ P["rnn.W_x"] + P["rnn.b"] + h @ P["rnn.W_h"])


def test_a_recursion_over_a_tree_reassociates_its_sum():
    """In a recursion, x_t W + (left U_l + right U_r) + b: the same rewrite over tree nodes (row t of
    the group is tree node t), against the plain unroll at every key, and by hand."""
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    children = g.input("children", (None, 2))
    words = g.input("words", (None, 3))
    W, U_l, U_r = g.parameter("W", (3, 4)), g.parameter("U_l", (4, 4)), g.parameter("U_r", (4, 4))
    b = g.parameter("b", (4,), init="normal")
    with g.recurse(children, name="tree") as r:
        x = r.step(words)
        h = r.state(np.zeros(4), name="h")
        part = x @ W + (r.child(h, 0) @ U_l + r.child(h, 1) @ U_r)
        h_new = vg.tanh(part + b)
        r.update(h, h_new)
    score = vg.sum(r.final(h) ** 2)
    kids = np.array([[-1, -1], [-1, -1], [0, 1], [-1, -1], [2, 3]])
    feed = {"children": kids, "words": np.random.default_rng(1).normal(size=(5, 3))}
    plain, hoisted = assert_identical(g, feed, [score], score)
    assert all(hoisted.computed_when_read(hoisted.node(part, (t,))) for t in range(5))
    P = {k: g.params[k].value for k in ("W", "U_l", "U_r", "b")}
    value = []
    for t, (left, right) in enumerate(kids):
        kid = [value[j] if j >= 0 else np.zeros(4) for j in (left, right)]
        s = feed["words"][t] @ P["W"] + (kid[0] @ P["U_l"] + kid[1] @ P["U_r"])
        np.testing.assert_allclose(hoisted.node(part, (t,)).value, s, **TOL)
        value.append(np.tanh(s + P["b"]))
    np.testing.assert_allclose(hoisted.forward(), np.sum(value[-1] ** 2), **TOL)


# ---------------------------------------------------------------------------- custom elementwise ops
# Ops of vgraph.defop declared elementwise are hoisted (and batched) like the built-in ones.


# (name, arity): built-in elementwise ops and two custom ones (CSoftsign, CHypot).
CHAIN_OPS = [("tanh", 1), ("sigmoid", 1), ("neg", 1), ("softsign", 1), ("add", 2), ("mul", 2), ("hypot", 2)]


@st.composite
def elementwise_chains(draw):
    """A random loop body of elementwise ops over x_t (stepped), h (carried) and b (captured)."""
    steps = draw(st.integers(1, 5))
    program = [
        (draw(st.sampled_from(CHAIN_OPS)), draw(st.integers(0, 100)), draw(st.integers(0, 100)))
        for _ in range(draw(st.integers(1, 8)))
    ]
    return steps, program, draw(st.integers(0, 100)), draw(st.integers(0, 100))


def _chain_model(body, softsign, hypot):
    """The model of an :func:`elementwise_chains` example: ``(graph, loss, feed, custom)`` with
    ``custom`` the custom nodes and whether each depends on no carried state."""
    steps, program, update_from, stack_from = body
    g = vg.VirtualGraph(seed=5)
    xs = g.input("xs", (None, 2, 3))
    b = g.parameter("b", (3,), init=vg.nn.init.normal(0.5))
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 3)), name="h")
        pool, free = [x, h, b * x], [True, False, True]  # free: depends on no carried state
        custom = []
        for (name, arity), i, j in program:
            a, c = pool[i % len(pool)], pool[j % len(pool)]
            unary = {"tanh": vg.tanh, "sigmoid": vg.sigmoid, "neg": lambda v: -v, "softsign": softsign}
            binary = {"add": lambda p, q: p + q, "mul": lambda p, q: p * q, "hypot": hypot}
            out = unary[name](a) if arity == 1 else binary[name](a, c)
            ok = free[i % len(free)] and (arity == 1 or free[j % len(free)])
            if name in ("softsign", "hypot"):
                custom.append((out, ok))
            pool.append(out)
            free.append(ok)
        L.update(h, vg.tanh(pool[update_from % len(pool)] + h))
        out = pool[stack_from % len(pool)]
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(out)) + vg.sum(b * b)
    return g, loss, {"xs": np.random.default_rng(steps).normal(size=(steps, 2, 3))}, custom


@settings(max_examples=30, deadline=None, derandomize=True)
@given(elementwise_chains())
# softsign(x_t), then hypot(softsign(x_t), b x_t): both hoisted; the loss reads them stacked
@explicit_example((4, [(("softsign", 1), 0, 0), (("hypot", 2), 3, 2)], 1, 4))
# a built-in tanh between custom ops, and a custom op of the carried state (not hoisted)
@explicit_example((3, [(("tanh", 1), 2, 0), (("softsign", 1), 3, 0), (("hypot", 2), 4, 1)], 5, 4))
def test_random_elementwise_chains_with_custom_ops_hoisted_equal_plain(body):
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    softsign = vg.defop("CSoftsign", custom_ops.softsign, custom_ops.softsign_vjp, elementwise=True)
    hypot = vg.defop("CHypot", np.hypot, custom_ops.hypot_vjp_a, custom_ops.hypot_vjp_b, elementwise=True)
    try:
        g, loss, feed, custom = _chain_model(body, softsign, hypot)
        plain, hoisted = hoisted_equals_plain(g, feed, loss)
        groups = {(k.type, k.id) for k in hoisted[0]._nodes if k.type.endswith("*")}
        built = {(k.type, k.id) for k in plain[0]._nodes}
        for v, free in custom:  # every carry-independent custom node built was hoisted, no other
            if (v.type, v.id) in built:  # (a loop of one iteration hoists nothing)
                assert ((v.type + "*", v.id) in groups) == (free and body[0] > 1), (v, groups)
        # and autobatched: two inputs as one batch equal them one at a time
        feeds = [feed, {"xs": np.random.default_rng(9).normal(size=feed["xs"].shape)}]
        g.params.zero_grad()
        total = sum(g.build(f, loss, cache=False).backward(loss) for f in feeds)
        grads = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
        g.params.zero_grad()
        batch = g.build_batch(feeds, loss)
        np.testing.assert_allclose(batch.backward("sum"), total, **TOL)
        for k in grads:
            np.testing.assert_allclose(g.params[k].grad, grads[k], **TOL, err_msg=k)
    finally:
        vg.undefop("CSoftsign")
        vg.undefop("CHypot")
        vg.set_default_dtype(previous)


def test_every_builtin_op_declared_elementwise_is_hoisted():
    """Hoisting reads the ops' declared kinds: maximum, minimum, clip and sqrt too."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    s = g.parameter("s", (3,), init=vg.nn.init.normal(1.0))
    with g.loop() as L:
        x = L.step(xs) * s
        h = L.carry(np.zeros((2, 3)), name="h")
        e = vg.sqrt(vg.clip(vg.maximum(x, -x * 0.5), 0.1, 2.0)) + vg.minimum(x, 0.3)
        L.update(h, vg.tanh(e + h))
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(e))
    feed = {"xs": np.random.default_rng(0).normal(size=(5, 2, 3))}
    _, hoisted = assert_identical(g, feed, [loss], loss)
    groups = {k.type for k in hoisted._nodes if k.type.endswith("*")}
    assert {"Maximum*", "Minimum*", "Clip*", "Sqrt*", "Add*"} <= groups, groups


@pytest.mark.parametrize(
    ("a", "b", "sa", "sb"),
    [
        ((3,), (3, 4), True, True),  # a vector times a matrix, each copy its own
        ((4, 3), (3,), True, True),
        ((3,), (3,), True, True),
        ((4, 3), (3,), False, True),  # a shared matrix times each copy's vector
        ((3,), (3,), False, True),
        ((4, 3), (3,), True, False),  # each copy's matrix times a shared vector
        ((3,), (3,), True, False),
    ],
)
def test_rows_op_multiplies_each_copys_vector(a, b, sa, sb):
    """hoist.rows_op: copies of a product with a vector run as one op give each copy's product,
    and its VJPs each copy's gradients (summed over the copies for a shared operand)."""
    from vgraph.ops import OPS, densified
    from vgraph.virtual.hoist import batched_attrs, rows_op

    mm = OPS["MatMul"]
    assert batched_attrs(mm, {}, [a, b], [sa, sb], 5) is None  # (numpy alone would pair them wrong)
    op = rows_op(mm, [a, b], [sa, sb])
    assert op is not None
    rng = np.random.default_rng(0)
    n = 5
    A = rng.standard_normal((n, *a) if sa else a)
    B = rng.standard_normal((n, *b) if sb else b)
    out = op.forward(A, B)
    want = np.stack([np.matmul(A[k] if sa else A, B[k] if sb else B) for k in range(n)])
    np.testing.assert_allclose(out, want, rtol=1e-13)
    g = rng.standard_normal(out.shape)
    for p, (x, stacked) in enumerate(((A, sa), (B, sb))):
        got = densified(op.vjps[p](g, out, A, B))
        if not stacked and got.shape != x.shape:  # (a shared operand's: the engine sums the copies)
            got = got.reshape(-1, *x.shape).sum(axis=0)
        parts = [densified(mm.vjps[p](g[k], want[k], A[k] if sa else A, B[k] if sb else B)) for k in range(n)]
        np.testing.assert_allclose(got, np.stack(parts) if stacked else np.sum(parts, axis=0), rtol=1e-12)
