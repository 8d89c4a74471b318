"""Body programs (vgraph.virtual.program): a loop or recursion run as one compiled body over its
iterations gives what the per-node unroll gives.

Identity tests: example models and random bodies, trees, branch choices and trip counts, built
with ``programs=True`` and with the reference ``programs=False`` — the same loss, every parameter
gradient, every unrolled node's value (views made on demand), every retained gradient and every
decision (float64, 1e-12).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hoist import load, loop_bodies, loop_body_model

import vgraph as vg
from vgraph import nn

ROOT = Path(__file__).resolve().parent.parent
TOL = {"rtol": 1e-12, "atol": 1e-12}

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def decisions(cg):
    return [(d.node, d.idx, d.kind, d.value) for d in cg.decisions]


def unrolled_nodes(cg):
    """``(virtual node, idx, compute node)`` of every node a per-node build made for a declared
    node (not loops, not the group nodes of hoisting)."""
    return [
        (v, idx, n)
        for (scope, idx), env in cg._envs.items()
        for v, n in env.items()
        if n is not None and v.scope is scope  # (a body's env also holds what it captures)
    ]


def run(g, feed, loss, programs, hoist=True, retain=None):
    """Build, retain the gradients of ``retain`` (``(v, idx)`` pairs; ``None``: every node of the
    build that needs one), backward; returns ``(cg, loss value, parameter gradients)``."""
    cg = g.build(feed, loss, programs=programs, hoist=hoist, cache=False)
    if retain is None:
        retain = [(v, idx) for v, idx, n in unrolled_nodes(cg) if n.requires_grad]
    for v, idx in retain:
        node = cg.node(v, idx)
        if node.requires_grad:
            node.retain_grad()
    g.params.zero_grad()
    value = cg.backward(cg.outputs[0])
    return cg, value, param_grads(g)


def param_grads(g):
    """Every parameter's gradient (dense, a copy) by name, of those that have one."""
    return {
        k: np.array(p.grad.dense() if hasattr(p.grad, "dense") else p.grad)
        for k, p in g.params.items()
        if p.grad is not None
    }


def assert_identical(g, feed, loss, hoist=True, expect_programs=True):
    """The program build equals the per-node build (see the module docstring); returns both."""
    plain, v_plain, g_plain = run(g, feed, loss, programs=False, hoist=hoist)
    pairs = [(v, idx) for v, idx, n in unrolled_nodes(plain) if n.requires_grad]
    prog, v_prog, g_prog = run(g, feed, loss, programs=True, hoist=hoist, retain=pairs)
    assert bool(prog.programs) == expect_programs, prog.interpreted
    np.testing.assert_allclose(v_prog, v_plain, **TOL)
    assert g_prog.keys() == g_plain.keys()
    for k in g_plain:
        np.testing.assert_allclose(g_prog[k], g_plain[k], **TOL, err_msg=k)
    assert decisions(prog) == decisions(plain)
    # retaining every body node's gradient runs the backward steps one by one; without, a loop's
    # run as one generated sweep (make_sweep): the same loss and parameter gradients
    _, v_swept, g_swept = run(g, feed, loss, programs=True, hoist=hoist, retain=[])
    np.testing.assert_allclose(v_swept, v_plain, **TOL)
    assert g_swept.keys() == g_plain.keys()
    for k in g_plain:
        np.testing.assert_allclose(g_swept[k], g_plain[k], **TOL, err_msg=f"{k} (swept)")
    for v, idx, n in unrolled_nodes(plain):
        if v.kind == "final" and prog.trip_count(v.inputs[0], idx):
            # node by node, the final IS the last update's node: compare with that (in a program
            # graph the loop output is a node of its own, <Final:k>, whose gradient is the loss's
            # through the final alone, not the update's other uses, e.g. a stack)
            loop, u = v.inputs[0], v.inputs[0].updates[v.inputs[1]]
            v, idx = u, ((*idx, prog.trip_count(loop, idx) - 1) if u.scope is loop else idx)
        view = prog.node(v, idx)
        if v.kind != "final":  # (no iteration: the final is the initial value, a <Final:k> node)
            assert view.key == n.key
        np.testing.assert_allclose(view.value, n.value, **TOL, err_msg=str(n.key))
        if n.grad is not None and n.op is not None:
            np.testing.assert_allclose(view.grad, n.grad, **TOL, err_msg=str(n.key))
    return plain, prog


# ---------------------------------------------------------------------------- the example models


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
@pytest.mark.parametrize("hoist", [True, False])
def test_example_models_as_programs_equal_the_per_node_unroll(script, hoist):
    g, feed, outputs = load(script).build()
    assert_identical(g, feed, outputs[0], hoist=hoist)


def test_the_flagship_rnn_as_a_program_equals_the_per_node_unroll():
    g, outs = load(ROOT / "examples" / "rnn_bptt.py").build_model(vocab=5, hidden=4, seed=0)
    rng = np.random.default_rng(0)
    feed = {
        "x": np.eye(5)[rng.integers(0, 5, (6, 3))],
        "y": rng.integers(0, 5, (6, 3)),
        "h0": np.zeros((3, 4)),
    }
    plain, prog = assert_identical(g, feed, outs["loss"])
    assert len(prog) < len(plain) / 3  # one node per loop instance, not one per body node per step


# ---------------------------------------------------------------------------- random bodies


@settings(max_examples=40, deadline=None, derandomize=True)
@given(loop_bodies(), st.booleans())
def test_random_loop_bodies_as_programs_equal_the_per_node_unroll(body, hoist):
    g, loss, feed = loop_body_model(body)
    assert_identical(g, feed, loss, hoist=hoist)


def branching_model(threshold: float):
    """A loop whose body picks one of two options per iteration from its own values, with a
    while_ condition on the carry: decisions per iteration, read between steps."""
    g = vg.VirtualGraph(seed=2)
    W = g.parameter("W", (3, 3), init="orthogonal")
    U = g.parameter("U", (3, 3), init="orthogonal")
    with g.loop(while_=lambda t, s: float(np.abs(s["h"]).sum()) < 50.0, max_iters=40) as L:
        h = L.carry(np.full(3, 0.1), name="h")
        c = L.carry(np.zeros(()), name="count")
        a = vg.tanh(h @ W) + 0.5
        b = vg.sigmoid(h @ U) * 2.0
        chosen = g.branch(lambda v: int(float(v.sum()) > threshold), [a, b], keys=[h], name="pick")
        L.update(h, chosen + h)
        L.update(c, c + 1.0)
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(chosen))
    return g, loss


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.floats(-2.0, 6.0))
def test_branches_and_while_conditions_decide_per_iteration_as_in_the_per_node_unroll(threshold):
    g, loss = branching_model(threshold)
    _, prog = assert_identical(g, {}, loss)
    assert any(d[2] == "option" for d in decisions(prog))


@st.composite
def trees(draw):
    """A random binary tree in children-first order: ``(children, tokens, is_leaf)``."""
    leaves = draw(st.integers(1, 7))
    nodes: list[list[int]] = [[-1, -1] for _ in range(leaves)]
    pool = list(range(leaves))
    while len(pool) > 1:
        i = draw(st.integers(0, len(pool) - 2))
        left, right = pool[i], pool[i + 1]
        nodes.append([left, right])
        pool[i : i + 2] = [len(nodes) - 1]
    tokens = [draw(st.integers(0, 9)) if k < leaves else 0 for k in range(len(nodes))]
    return (
        np.array(nodes),
        np.array(tokens),
        np.array([1.0 if k < leaves else 0.0 for k in range(len(nodes))]),
    )


def tree_model():
    """A Tree-LSTM-like recursion: a leaf reads its word, an inner node its two children; the
    branch between them is chosen per tree node."""
    H = 3
    g = vg.VirtualGraph(seed=4)
    children = g.input("children", shape=(None, 2))
    tokens = g.input("tokens", shape=(None,))
    is_leaf = g.input("is_leaf", shape=(None,))
    emb = nn.Embedding(g, 10, 4, "emb")
    W = g.parameter("W", (4, H))
    U = g.parameter("U", (2 * H, 2 * H))
    with g.recurse(children, name="tree") as r:
        leaf = r.step(is_leaf)
        h = r.state(np.zeros(H), name="h")
        c = r.state(np.zeros(H), name="c")
        h_leaf = vg.tanh(emb(r.step(tokens)) @ W)
        z = vg.concat([r.child(h, 0), r.child(h, 1)], axis=0) @ U
        c_inner = vg.sigmoid(z[:H]) * r.child(c, 0) + vg.tanh(z[H:]) * r.child(c, 1)
        h_inner = vg.tanh(c_inner)
        h_new, c_new = g.branch(
            lambda v: 0 if float(v) else 1,
            [(h_leaf, h_leaf * 0.5), (h_inner, c_inner)],
            keys=[leaf],
            name="kind",
        )
        r.update(h, h_new)
        r.update(c, c_new)
    loss = vg.sum(r.stack(h_new) ** 2) + vg.sum(r.final(c))
    return g, loss


@settings(max_examples=25, deadline=None, derandomize=True)
@given(trees())
def test_random_trees_as_programs_equal_the_per_node_unroll(tree):
    children, tokens, is_leaf = tree
    g, loss = tree_model()
    assert_identical(g, {"children": children, "tokens": tokens, "is_leaf": is_leaf}, loss)


# ---------------------------------------------------------------------------- a program's graph


def rnn(T=5):
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4), init="orthogonal")
    with g.loop(name="rnn") as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 4)), name="h")
        h_new = vg.tanh(x @ W + h @ U)
        L.update(h, h_new)
    loss = vg.sum(L.stack(h_new) ** 2)
    feed = {"xs": np.random.default_rng(T).normal(size=(T, 2, 3))}
    return g, loss, feed, h_new, L


def test_a_loop_run_as_a_program_is_one_node_and_its_outputs():
    g, loss, feed, h_new, L = rnn()
    cg = g.build(feed, loss, programs=True)
    assert "1 loop instance(s) ran as body programs" in repr(cg)
    keys = {str(k) for k in cg._nodes}
    assert "Loop:1" in keys and "Stack:1" in keys
    assert not any(k.startswith("Tanh:1@") for k in keys)  # no node per iteration ...
    view = cg.node(h_new, (3,))  # ... but each is there when asked for
    assert str(view.key) == "Tanh:1@3"
    assert cg.trip_count(L) == 5
    with pytest.raises(vg.BuildError, match=r"<Tanh:1@5>.*not built"):
        cg.node(h_new, (5,))


def test_a_forward_after_feed_reruns_the_program_and_equals_a_fresh_build():
    g, loss, feed, h_new, L = rnn()
    cg = g.build(feed, loss, programs=True)
    view = cg.node(h_new, (2,))
    new = {"xs": np.random.default_rng(9).normal(size=(5, 2, 3))}
    cg.feed(new)
    value = cg.forward()
    fresh = g.build(new, loss, programs=False, cache=False)
    np.testing.assert_allclose(value, fresh.outputs[0].value, **TOL)
    np.testing.assert_allclose(view.value, fresh.node(h_new, (2,)).value, **TOL)  # the view follows


@pytest.mark.parametrize("programs", [False, True])
def test_a_rerun_that_would_change_a_decision_raises_structure_changed(programs):
    g, loss = branching_model(1.0)
    cg = g.build({}, loss, programs=programs)
    U = g.params["U"]
    U.value = -U.value * 10.0  # other values: another trip count
    expected = (
        r"<Loop:1> would now run \d+ iterations, not 12 \(its while_ condition changed at iteration 12\)"
        if programs
        else r"<Loop:1>: at iteration 12 the condition is now True \(was False\)"
    )
    with pytest.raises(vg.StructureChangedError, match=expected):
        cg.forward()


def test_cached_structures_replay_programs_identically():
    g, loss, feed, h_new, L = rnn()
    for _ in range(3):  # the second build caches, the third replays
        cg = g.build(feed, loss, programs=True)
    value = cg.backward(cg.outputs[0])
    grads = {k: np.array(p.grad) for k, p in g.params.items()}
    g.params.zero_grad()
    ref = g.build(feed, loss, programs=False, cache=False)
    np.testing.assert_allclose(value, ref.backward(ref.outputs[0]), **TOL)
    for k, p in g.params.items():
        np.testing.assert_allclose(grads[k], p.grad, **TOL)


def test_grad_of_a_program_equals_the_per_node_unroll():
    g, loss, feed, h_new, L = rnn()
    prog = g.build(feed, loss, programs=True, cache=False)
    plain = g.build(feed, loss, programs=False, cache=False)
    W, U = g.params["W"], g.params["U"]
    for a, b in zip(prog.grad(prog.outputs[0], [W, U]), plain.grad(plain.outputs[0], [W, U])):
        np.testing.assert_allclose(a, b, **TOL)


def test_a_program_gradient_agrees_with_finite_differences():
    g, loss, feed, h_new, L = rnn(T=4)
    cg = g.build(feed, loss, programs=True)
    vg.gradcheck(cg.outputs[0], cg.parameters())


@pytest.mark.parametrize(
    "what, reason",
    [
        ("checkpoint", "checkpointed"),
        ("nested", "nested loop"),
        ("dropout", "sampled"),
        ("untied", "untied parameter"),
    ],
)
def test_loops_a_program_cannot_run_fall_back_and_say_why(what, reason):
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 3))
    W = g.parameter("W", (3, 3))
    with g.loop(checkpoint=2 if what == "checkpoint" else None) as L:
        x = L.step(xs)
        h = L.carry(np.zeros(3), name="h")
        z = x @ W + h
        if what == "nested":
            with g.loop(times=2) as inner:
                k = inner.carry(z, name="k")
                inner.update(k, vg.tanh(k))
            z = inner.final(k)
        elif what == "dropout":
            z = nn.Dropout(g, 0.5)(z)
        elif what == "untied":
            z = z @ g.parameter("V", (3, 3), share=False)
        L.update(h, vg.tanh(z))
    loss = vg.sum(L.final(h) ** 2)
    feed = {"xs": np.random.default_rng(0).normal(size=(4, 3))}
    g.eval()  # (dropout's masks: the same in both builds)
    cg = g.build(feed, loss, programs=True)
    assert [r for loop, idx, r in cg.interpreted if loop is L and reason in r], cg.interpreted
    assert f"{L.describe()} ran node by node: " in repr(cg) and reason in repr(cg)
    ref = g.build(feed, loss, programs=False, cache=False)
    np.testing.assert_allclose(cg.outputs[0].value, ref.outputs[0].value, **TOL)


def test_a_program_step_error_names_the_node_and_iteration():
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 3))
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros(3), name="h")
        L.update(h, vg.concat([h, x], axis=0))
    with pytest.raises(
        vg.ShapeError,
        match=r"carry 'h' enters iteration 0 as float64\[3\] but is updated to float64\[6\] by <Concat:1@0>",
    ):
        g.build({"xs": np.ones((3, 3))}, vg.sum(L.final(h)), programs=True)


def test_a_wrong_custom_vjp_in_a_program_is_named_by_its_node_iteration_and_input(defop):
    """As in the per-node sweep (tests/test_custom_ops.py): the node, the op and the input, in
    the iteration where it happened; no gradient half-added."""
    from test_custom_ops import _feed, _loop_with, softsign

    state = {"bad": False}

    def vjp(g, ans, x):
        d = g / (1 + np.abs(x)) ** 2
        return d[:1] if state["bad"] else d

    g, loss, xw, u = _loop_with(defop("Softsign", softsign, vjp))
    cg = g.build(_feed(5), loss, programs=True, cache=False)
    assert cg.programs
    cg.backward(loss)
    grads = {k: np.array(p.grad) for k, p in g.params.items()}
    state["bad"] = True
    cg.forward()
    with pytest.raises(
        vg.VJPShapeError,
        match=rf"^<Softsign:{u.id}@4>: the VJP of Softsign for input 0 <MatMul:{xw.id}@4> returned "
        r"a gradient of shape \(1, 4\); expected the input's shape \(2, 4\)$",
    ):
        cg.backward(loss)
    assert all(np.array_equal(p.grad, grads[k]) for k, p in g.params.items())


def test_a_vjp_raising_in_the_generated_sweep_is_named_by_its_node_and_iteration(defop):
    """The backward steps run as one generated sweep (``make_sweep``) where nothing retains a body
    node's gradient: an exception a VJP raises there names the node, its iteration and the input,
    as the per-node sweep's does, and no gradient is half-added."""
    from test_custom_ops import softsign

    state = {"bad": False}

    def vjp(g, ans, x):
        if state["bad"]:
            raise FloatingPointError("overflow in the gradient")
        return g / (1 + np.abs(x)) ** 2

    op = defop("Softsign", softsign, vjp)
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    Wx, Wh = g.parameter("Wx", (3, 4)), g.parameter("Wh", (4, 4))
    with g.loop(name="time") as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        xw = L.step(xs) @ Wx + h @ Wh  # (reads the carry: in every step)
        u = op(xw)
        L.update(h, u)
    loss = (L.final(h) ** 2).mean()
    cg = g.build({"xs": np.random.default_rng(0).normal(size=(5, 2, 3))}, loss, programs=True, cache=False)
    (instance,) = cg.programs.values()
    assert instance.variant._make_sweep is not None
    swept = []
    make = instance.variant._make_sweep
    with pytest.MonkeyPatch.context() as m:
        m.setattr(instance.variant, "_make_sweep", lambda *a: swept.append(1) or make(*a))
        cg.backward(loss)
    assert swept == [1]
    grads = {k: np.array(p.grad) for k, p in g.params.items()}
    cg.forward()
    state["bad"] = True
    with pytest.raises(  # (in the last iteration: the sweep's first)
        vg.BackwardError,
        match=rf"^<Softsign:{u.id}@4>: the VJP of Softsign with respect to its input <Add:{xw.id}@4> failed: "
        r"FloatingPointError: overflow in the gradient$",
    ):
        cg.backward(loss)
    assert all(np.array_equal(p.grad, grads[k]) for k, p in g.params.items())


def test_an_error_in_a_program_step_is_the_per_node_unrolls_error():
    """A failing step unrolls the loop node by node, which raises the error naming the node."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 3))
    W = g.parameter("W", (4, 3))
    with g.loop() as L:
        h = L.carry(np.zeros(3), name="h")
        L.update(h, vg.tanh(L.step(xs) @ W + h))  # (3,) @ (4, 3): not aligned
    loss = vg.sum(L.final(h))
    feed = {"xs": np.ones((2, 3))}
    with pytest.raises(vg.ShapeError) as per_node:
        g.build(feed, loss, programs=False)
    with pytest.raises(vg.ShapeError) as program:
        g.build(feed, loss, programs=True)
    assert str(program.value) == str(per_node.value)
    assert str(program.value).startswith("<MatMul:1@0> ")


def test_a_program_graph_draws_and_checks_as_the_per_node_graph():
    """Drawing, gradient norms and check_vjps read the per-node form of a program graph (the
    same keys, values, decisions and retained gradients)."""
    from vgraph import render

    g, loss, feed, h_new, L = rnn(T=4)
    graphs = {}
    for programs in (False, True):  # (drawn as the plain unroll draws: hoisting left out)
        cg = g.build(feed, loss, programs=programs, cache=False, hoist=False)
        render.retain_all_grads(cg)
        g.params.zero_grad()
        cg.backward(cg.outputs[0])
        graphs[programs] = cg
    plain, prog = graphs[False], graphs[True]
    assert render.to_dot(prog, gradients=True) == render.to_dot(plain, gradients=True)
    norms, ref = render.gradient_norms(prog), render.gradient_norms(plain)
    assert norms.keys() == ref.keys()
    for k in ref:
        assert norms[k] == pytest.approx(ref[k], rel=1e-12)
    assert vg.check_vjps(prog).ok


def test_by_default_a_loop_runs_as_a_program_unless_a_cached_build_knows_its_structure_by_shapes():
    """``programs=None`` (the default mode): a cached build runs node by node a loop whose
    structure the feed's shapes fix, and everything else as programs; the mode is per thread."""
    g, loss, feed, h_new, L = rnn()
    assert vg.programs_mode() is None  # the default
    assert not g.build(feed, loss).programs  # a sequence loop, cached: node by node
    assert g.build(feed, loss, cache=False).programs  # not cached: as a program
    gw = vg.VirtualGraph(seed=0, dtype=np.float64)  # a while_ loop: its trip count is the data's
    x = gw.input("x", (3,))
    with gw.loop(while_=lambda t, st: float(np.abs(st["s"]).max()) > 1.0, max_iters=50) as W:
        s = W.carry(x, name="s")
        W.update(s, s * 0.5)
    assert gw.build({"x": np.full(3, 9.0)}, vg.sum(W.final(s))).programs
    for fused in (True, False):  # a fused cell's loop runs as a program even when cached
        gl = vg.VirtualGraph(seed=0, dtype=np.float64)
        xs = gl.input("xs", (None, 2, 3))
        cell = vg.nn.LSTMCell(gl, 3, 4, "lstm", fused=fused)
        with gl.loop() as C:
            h, c = C.carry(np.zeros((2, 4)), name="h"), C.carry(np.zeros((2, 4)), name="c")
            h_new, c_new = cell(C.step(xs), (h, c))
            C.update(h, h_new)
            C.update(c, c_new)
        cached = gl.build({"xs": np.ones((5, 2, 3))}, vg.sum(C.final(h)))
        assert bool(cached.programs) == fused
    with vg.body_programs(False):
        assert vg.programs_mode() is False
        assert not g.build(feed, loss, cache=False).programs
        assert g.build(feed, loss, cache=False, programs=True).programs
        with vg.body_programs():
            assert g.build(feed, loss).programs  # True: cached builds too
        seen = []
        thread = threading.Thread(target=lambda: seen.append(vg.programs_mode()))
        thread.start()
        thread.join()
        assert seen == [None]  # another thread keeps its own (the default)
    assert vg.programs_mode() is None
    with pytest.raises(vg.ArgumentError):
        with vg.body_programs("yes"):
            pass


@pytest.mark.parametrize(
    "script, as_programs",
    [("elman_rnn", False), ("stacked_rnn", False), ("branching", True), ("tree_lstm", True)],
)
def test_by_default_each_example_model_runs_the_way_its_loops_call_for(script, as_programs):
    """The default build of each example model: sequence loops (the shapes fix their structure)
    node by node in a cached build; a loop with a branch in its body or a recursion as programs;
    every model as programs with ``cache=False`` — each equal to its per-node build."""
    g, feed, outputs = load(ROOT / "examples" / "models" / f"{script}.py").build()
    cached = g.build(feed, outputs[0])
    assert bool(cached.programs) == as_programs, cached
    fresh = g.build(feed, outputs[0], cache=False)
    assert fresh.programs
    # (only the stacked RNN's loop over layers, whose weights are untied, runs node by node)
    assert all("untied" in why for _, _, why in fresh.interpreted)
    plain = g.build(feed, outputs[0], cache=False, programs=False, hoist=False)
    for cg in (cached, fresh):
        np.testing.assert_allclose(cg.forward(), plain.forward(), **TOL)
        assert decisions(cg) == decisions(plain)


def test_a_no_grad_build_runs_the_program_without_gradients():
    g, loss, feed, h_new, L = rnn()
    with vg.no_grad():
        cg = g.build(feed, loss, programs=True, cache=False)
    ref = g.build(feed, loss, programs=False, cache=False)
    np.testing.assert_allclose(cg.outputs[0].value, ref.outputs[0].value, **TOL)
    assert not cg.outputs[0].requires_grad


def test_show_program_prints_the_generated_steps_that_tracebacks_show():
    g, loss, feed, h_new, L = rnn()
    cg = g.build(feed, loss, programs=True)
    text = vg.show_program(cg, L)
    assert "def step(t" in text and "def back(KEEP" in text
    assert "<Tanh:1>" in text and "<Parameter:2> 'U'" in text  # the legend: slots and captured values
    plain = g.build(feed, loss, programs=False)
    with pytest.raises(vg.BuildError, match=r"<Loop:1> 'rnn' did not run as a body program"):
        vg.show_program(plain, L)


def test_a_body_node_of_a_program_is_found_by_its_key_too():
    g, loss, feed, h_new, L = rnn()
    cg = g.build(feed, loss, programs=True)
    view = cg.node("Tanh:1@3")
    assert view is cg.node(h_new, (3,)) and view is cg[vg.NodeKey("Tanh", 1, (3,))]
    assert "Tanh:1@3" in cg and "Tanh:1@5" not in cg and "Tanh:9@3" not in cg
    with pytest.raises(vg.VGraphError, match=r"the graph has no node <Tanh:1@5>"):
        cg.node("Tanh:1@5")


def test_a_rerun_of_an_until_loop_says_its_condition_changed():
    g = vg.VirtualGraph(seed=0)
    a = g.input("a", ())
    with g.loop(until=lambda t, s: float(s["x"]) < 1.5, max_iters=100) as L:
        x = L.carry(a, name="x")
        L.update(x, x * 0.5)
    cg = g.build({"a": np.array(10.0)}, vg.sum(L.final(x)), programs=True)
    assert cg.trip_count(L) == 3
    cg.feed({"a": np.array(100.0)})
    with pytest.raises(
        vg.StructureChangedError,
        match=r"<Loop:1> would now run 7 iterations, not 3 \(its until condition changed at iteration 2\)",
    ):
        cg.forward()


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
@pytest.mark.parametrize("hoist", [True, False])
def test_every_example_model_is_drawn_and_explored_as_its_per_node_graph(script, hoist):
    """A program graph (hoisting on or off) is drawn, explored and coloured by gradient exactly
    as the plain per-node unroll of the same feed, every iteration's gradient retained —
    hoisted body nodes' included (their gradient is their row of one product's)."""
    from test_explorer import page_data

    from vgraph import render

    g, feed, outputs = load(script).build()
    graphs = {}
    for programs in (False, True):
        cg = g.build(feed, outputs[0], programs=programs, cache=False, hoist=hoist and programs)
        render.retain_all_grads(cg)
        g.params.zero_grad()
        cg.backward(cg.outputs[0])
        graphs[programs] = cg
    plain, prog = graphs[False], graphs[True]
    assert prog.programs
    norms, ref = render.gradient_norms(prog), render.gradient_norms(plain)
    assert norms.keys() == ref.keys()
    for k in ref:
        assert norms[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-300), k
    # (the drawings' numbers are printed to 3 digits: equal to them)
    assert render.to_dot(prog, gradients=True) == render.to_dot(plain, gradients=True)
    pages = [page_data(render.explore(g, build=cg))["unrolled"]["nodes"] for cg in (prog, plain)]
    assert sorted(pages[0]["key"]) == sorted(pages[1]["key"])


def test_the_explorer_shows_a_program_graph_node_by_node():
    """The explorer's page of a program graph has every node key of the per-node graph, with the
    values and retained gradients of the program's views."""
    from test_explorer import number, page_data

    from vgraph import render

    g, loss, feed, h_new, L = rnn(T=6)
    cg = g.build(feed, loss, programs=True, hoist=False)
    render.retain_all_grads(cg)
    cg.backward(loss)
    cols = page_data(render.explore(g, build=cg))["unrolled"]["nodes"]
    assert sorted(cols["key"]) == sorted(str(n.key) for n in cg.per_node().nodes())
    i = cols["key"].index("Tanh:1@4")
    view = cg.node("Tanh:1@4")
    assert number(cols["grad"][i]) == pytest.approx(float(np.linalg.norm(view.grad)), rel=1e-5)
    assert number(cols["stats"][i][1]) == pytest.approx(float(view.value.max()), rel=1e-5)


@pytest.mark.parametrize("case", ["captured update", "reversed step", "no iteration", "one tree node"])
def test_corner_cases_of_loops_as_programs_equal_the_per_node_unroll(case):
    """A carry updated from outside the body or by itself, a stacked item, a reversed step, a
    loop that runs no iteration (its finals are its initial values), a tree of one node."""
    g = vg.VirtualGraph(seed=0)
    W = g.parameter("W", (3, 3), init="orthogonal")
    b = g.parameter("b", (3,), init=vg.nn.init.normal(0.5))
    feed: dict = {"xs": np.random.default_rng(3).normal(size=(4, 3))}
    xs = g.input("xs", (None, 3))
    if case == "one tree node":
        children = g.input("children", (None, 2))
        feed = {"children": np.array([[-1, -1]])}
        with g.recurse(children) as r:
            h = r.state(np.full(3, 0.2), name="h")
            r.update(h, vg.tanh((r.child(h, 0) + r.child(h, 1)) @ W + b))
        loss = vg.sum(r.final(h) ** 2) + vg.sum(r.stack(h))
    else:
        outside = b * 2.0
        first = b * 1.0
        with g.loop(times=0 if case == "no iteration" else None) as L:
            x = L.step(xs, reverse=case == "reversed step")
            h = L.carry(first, name="h")
            k = L.carry(np.zeros(3), name="k")
            c = L.carry(np.ones(3), name="c")
            L.update(h, vg.tanh(x @ W + h))
            L.update(k, outside)
            L.update(c, c)
            seen = h * 1.0
        loss = vg.sum(L.final(h) ** 2) + vg.sum(L.final(k) * L.final(c))
        if case != "no iteration":
            loss = loss + vg.sum(L.stack(x) * L.stack(seen))
    assert_identical(g, feed, loss)


def test_anomaly_mode_names_the_body_node_and_iteration_of_a_program():
    """Built as a program (no anomaly at build), a re-run forward and a backward under anomaly
    mode name the first body node, and its iteration, whose value or gradient is not finite."""
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 3))
    with g.loop() as L:
        h = L.carry(np.ones(3), name="h")
        h_new = vg.log(h + L.step(xs))
        L.update(h, h_new)
    loss = vg.sum(L.final(h))
    fine = np.full((4, 3), 2.0)
    cg = g.build({"xs": fine}, loss, programs=True)
    bad = fine.copy()
    bad[2, 1] = -50.0  # log of a negative number in iteration 2
    cg.feed({"xs": bad})
    with pytest.raises(vg.NonFiniteError, match=r"NaN first appears at <Log:1@2>"):
        cg.forward(detect_anomaly=True)

    g2 = vg.VirtualGraph(seed=0)
    xs2 = g2.input("xs", (None, 3), requires_grad=True)
    with g2.loop() as L2:
        c = L2.carry(np.ones(3), name="c")
        r = vg.sqrt(L2.step(xs2) * 1.0)  # sqrt at 0: an infinite gradient
        L2.update(c, c + r)
    zeros_at_1 = np.ones((3, 3))
    zeros_at_1[1] = 0.0
    cg2 = g2.build({"xs": zeros_at_1}, vg.sum(L2.final(c)), programs=True, hoist=False)
    with pytest.raises(vg.NonFiniteError, match=r"Inf first appears in the gradient of <Mul:1@1>"):
        cg2.backward(cg2.outputs[0], detect_anomaly=True)


# ---------------------------------------------------------------------------- recurrent cells


def cell_model(kind: str, reverse: bool, extra: str | None, sizes: tuple[int, int, int]):
    """A tagger-shaped body: a cell over a stepped sequence (reversed with ``reverse``), a
    per-step scoring of its output, the mean of a cross-entropy over the steps. ``kind``: a fused
    LSTM cell (``h'`` and ``c'`` basic-index views of its value), the unfused one (gates as column
    slices), a fused GRU cell. ``extra``: the cell's value is also read by another view that
    overlaps ``h'`` (``"view"``) or by a node that is not a view of it (``"value"``)."""
    B, I, H = sizes
    g = vg.VirtualGraph(seed=B * 100 + I * 10 + H)
    xs = g.input("xs", (None, B, I))
    ys = g.input("ys", (None,))
    zeros = g.constant(np.zeros((B, H)), name="zeros")
    out = nn.Linear(g, H, 3, "out")
    if kind == "gru":
        gru = nn.GRUCell(g, I, H, "cell")
    else:
        lstm = nn.LSTMCell(g, I, H, "cell", fused=kind == "lstm")
    with g.loop() as L:
        x_t = L.step(xs, reverse=reverse)
        h = L.carry(zeros, name="h")
        if kind == "gru":
            h_new = raw = gru(x_t, h)
        else:
            c = L.carry(zeros, name="c")
            if kind == "lstm":
                raw = vg.functions.lstm_cell(x_t @ lstm.W_x, h @ lstm.W_h, lstm.b, c)
                h_new, c_new = raw[0], raw[1]
            else:
                h_new, c_new = lstm(x_t, (h, c))
                raw = h_new
            L.update(c, c_new)
        L.update(h, h_new)
        feature = vg.tanh(h_new)
        if extra == "view":
            feature = feature + vg.sum(raw[0:2] * raw[0:2]) * 0.1
        elif extra == "value":
            feature = feature + vg.sum(raw * raw) * 0.1
    scores = out(L.stack(feature)).reshape(-1, 3)  # (T * B, 3)
    loss = vg.losses.cross_entropy(scores, ys)
    return g, loss


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    st.sampled_from(["lstm", "lstm-unfused", "gru"]),
    st.booleans(),
    st.sampled_from([None, "view", "value"]),
    st.integers(1, 6),
    st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)),
    st.integers(0, 1000),
)
def test_random_recurrent_cells_as_programs_equal_the_per_node_unroll(kind, reverse, extra, T, sizes, seed):
    """The backward step adds a cell's view gradients into one buffer and calls a fused cell's
    joint VJP once: the same loss, gradients, values and retained gradients as node by node."""
    g, loss = cell_model(kind, reverse, extra, sizes)
    B, I, _ = sizes
    rng = np.random.default_rng(seed)
    feed = {"xs": rng.standard_normal((T, B, I)) * 2.0, "ys": rng.integers(0, 3, T * B)}
    assert_identical(g, feed, loss)
    assert_identical(g, feed, loss, hoist=False)


@pytest.mark.parametrize("extra", [None, "view", "value"])
def test_a_fused_cells_backward_step_buffers_its_views_and_calls_its_joint_vjp_once(extra):
    g, loss = cell_model("lstm", False, extra, (1, 2, 3))
    feed = {"xs": np.ones((3, 1, 2)), "ys": np.zeros(3, dtype=int)}
    cg = g.build(feed, loss, programs=True)
    source = vg.show_program(cg, next(iter(cg.programs))[0])
    source = source.split("def make_sweep(")[0]  # (the backward step; the sweep repeats its lines)
    # the cell's four input gradients from one call: given h' and c''s gradients as they are
    # where nothing else reads its value (ops.slab_vjp), else its value's whole gradient
    assert source.count("J = v" if extra is None else "J = j") == 1
    assert source.count("J = ") == 1 + source.count("J = INTO_J")
    assert "d = b" in source  # (the other ops' VJPs, one call per input)
    # h', c' (and the two reads of raw[0:2]) are views of the cell's value: their gradients go into one buffer, unless
    # the value is also read otherwise (then the views' gradients stay lazy, as node by node) — or
    # they are h' and c' alone, whose gradients the cell's VJP takes apart
    assert source.count("] += g") == {None: 0, "view": 4, "value": 0}[extra]
    assert source.count("g5_0 = ") == {None: 2, "view": 0, "value": 0}[extra]  # (and the clearing)


@pytest.mark.parametrize("block_bytes", [1, 1000, 1 << 22])
def test_a_split_vjps_record_part_is_computed_by_blocks_of_iterations(block_bytes, monkeypatch):
    """The LSTM cell's VJP reads its output alone for the activations' slopes: a program computes
    that part over blocks of iterations (one iteration, a few, all) and gets the per-node
    gradients."""
    from vgraph.virtual import program

    monkeypatch.setattr(program._Parts, "BLOCK_BYTES", block_bytes)
    g, loss = cell_model("lstm", True, "view", (2, 3, 4))
    rng = np.random.default_rng(5)
    feed = {"xs": rng.standard_normal((7, 2, 3)), "ys": rng.integers(0, 3, 14)}
    _, prog = assert_identical(g, feed, loss)
    source = vg.show_program(prog, next(iter(prog.programs))[0])
    assert "if p0 is None else w" in source  # the step takes its iteration's part


def test_a_value_no_gradient_reached_in_the_run_gets_none_as_node_by_node():
    """A weight read only where no gradient flows in this run — by an option never chosen, or by
    a carry whose final the loss does not use — has no gradient (``None``, not zeros), as node by
    node: an optimiser then leaves it alone (Adam's moments of zeros would still move it)."""

    def make(threshold):
        g = vg.VirtualGraph(seed=3)
        xs = g.input("xs", (None, 2, 3))
        W = g.parameter("W", (3, 4), init="orthogonal")
        U = g.parameter("U", (4, 4), init="orthogonal")
        V = g.parameter("V", (4, 4), init="orthogonal")
        with g.loop() as L:
            x = L.step(xs)
            h = L.carry(np.zeros((2, 4)), name="h")
            side = L.carry(np.zeros((2, 4)), name="side")
            y = vg.tanh(x @ W)
            chosen = g.branch(
                lambda v: int(float(v.sum()) > threshold),
                [y + h @ U, vg.sigmoid(h @ U)],
                keys=[y],
                name="pick",
            )
            L.update(h, chosen)
            L.update(side, vg.tanh(side @ V + h))
        return g, vg.sum(L.final(h) ** 2)

    feed = {"xs": np.random.default_rng(0).standard_normal((6, 2, 3))}
    for threshold, reached in ((-100.0, {"U"}), (100.0, {"U", "W"})):
        for programs in (False, True):
            g, loss = make(threshold)
            cg = g.build(feed, loss, programs=programs, cache=False)
            assert bool(cg.programs) == programs
            cg.backward(loss)
            assert {k for k, p in g.params.items() if p.grad is not None} == reached, (threshold, programs)
        batch = g.build_batch([feed, {"xs": feed["xs"][:3]}], loss)
        g.params.zero_grad()
        batch.backward("sum")
        assert batch.rows_programs
        assert {k for k, p in g.params.items() if p.grad is not None} == reached, (threshold, "batch")


@pytest.mark.parametrize("threshold", [-100.0, 0.0, 100.0])
def test_a_last_update_also_stacked_keeps_both_gradients(threshold):
    """The last iteration's update, read by the loop's final and by a stack: its view's gradient
    has both contributions, as the per-node node has (and the final's <Final> node only its own)."""
    g = vg.VirtualGraph(seed=3)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4), init="orthogonal")
    U = g.parameter("U", (4, 4), init="orthogonal")
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        y = vg.tanh(L.step(xs) @ W)
        chosen = g.branch(
            lambda v: int(float(v.sum()) > threshold), [y + h @ U, vg.sigmoid(h @ U)], keys=[y], name="pick"
        )
        L.update(h, chosen)
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(chosen) * 0.5)
    feed = {"xs": np.random.default_rng(0).standard_normal((6, 2, 3))}
    plain, prog = assert_identical(g, feed, loss)
    final = prog.node(next(v for v in g.nodes if v.kind == "final"))
    np.testing.assert_allclose(final.grad + 0.5, plain.node(chosen, (5,)).grad, **TOL)


def stacked_cell_model(kind: str, reverse: bool):
    """A loop whose fused cell's ``h'`` is stacked as it is (a tagger's direction)."""
    g = vg.VirtualGraph(seed=7)
    xs = g.input("xs", (None, 2, 3))
    zeros = g.constant(np.zeros((2, 4)), name="zeros")
    cell = nn.GRUCell(g, 3, 4, "cell") if kind == "gru" else nn.LSTMCell(g, 3, 4, "cell")
    with g.loop() as L:
        x_t = L.step(xs, reverse=reverse)
        h = L.carry(zeros, name="h")
        if kind == "gru":
            h_new = cell(x_t, h)
        else:
            c = L.carry(zeros, name="c")
            h_new, c_new = cell(x_t, (h, c))
            L.update(c, c_new)
        L.update(h, h_new)
    return g, vg.sum(vg.tanh(L.stack(h_new)) * 0.5)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_loop_computes_a_fused_cell_into_one_buffer_its_backward_and_stacks_read(kind, reverse):
    """A whole loop's run computes a fused cell's values into one buffer, a row per iteration
    (``ops.forward_into``): the backward's record part reads the rows as one block, a stack of
    ``h'`` is a read-only view of them — not copies — and every value and gradient is the per-node
    unroll's."""
    from vgraph.virtual import program

    g, loss = stacked_cell_model(kind, reverse)
    feed = {"xs": np.random.default_rng(4).standard_normal((5, 2, 3))}
    _, prog = assert_identical(g, feed, loss)
    (instance,) = prog.programs.values()
    run = instance.run
    (slot,) = run.buffers  # the cell's
    buf = run.buffers[slot]
    assert buf.shape[0] == 5 and all(r[slot].base is buf for r in run.records)  # (values: above)
    (stacked,) = [n for n in prog.nodes() if n.key.type == "Stack"]
    assert np.shares_memory(stacked.value, buf) and np.array_equal(stacked.value, buf[:, 0])
    # (what ops are handed, not .value's read-only view: an op writing into its input would
    # change the records the backward reads)
    with pytest.raises(ValueError, match="read-only"):
        stacked._value[...] = 0.0
    # a row that is not the buffer's (an op that could not write into it): the values are stacked
    assert program._rows_of(run, slot, 1, 4) is not None
    records = list(run.records)
    run.records[2] = (*run.records[2][:slot], run.records[2][slot].copy(), *run.records[2][slot + 1 :])
    assert program._rows_of(run, slot, 0, 5) is None and program._rows_of(run, slot, 3, 5) is not None
    run.records[:] = records


def test_a_loop_no_length_bounds_runs_its_cell_without_a_buffer():
    """A ``while_`` loop over no sequence has no bound on its iterations: its cell's values are
    arrays of their own, as the per-node unroll's, with the same values and gradients."""
    g = vg.VirtualGraph(seed=2)
    x = g.input("x", (1, 3))
    cell = nn.LSTMCell(g, 3, 3, "cell")
    zeros = g.constant(np.zeros((1, 3)), name="zeros")
    with g.loop(while_=lambda t, state: t < 4, max_iters=10) as L:
        h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
        h_new, c_new = cell(x, (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    loss = vg.sum(L.stack(h_new) ** 2)
    _, prog = assert_identical(g, {"x": np.ones((1, 3))}, loss)
    (instance,) = prog.programs.values()
    assert instance.run.buffers == {} and instance.run.trips == 4


def test_a_loop_capped_by_max_iters_has_a_buffer_of_as_many_rows():
    """``max_iters`` bounds the buffer too: a loop over 9 steps capped at 4 computes its cell into
    4 rows, with the per-node unroll's values, gradients and cap decision."""
    g = vg.VirtualGraph(seed=5)
    xs = g.input("xs", (None, 1, 3))
    cell = nn.LSTMCell(g, 3, 2, "cell")
    zeros = g.constant(np.zeros((1, 2)), name="zeros")
    with g.loop(max_iters=4, on_limit="stop") as L:
        x_t = L.step(xs)
        h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
        h_new, c_new = cell(x_t, (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    loss = vg.sum(L.stack(h_new) ** 2)
    _, prog = assert_identical(g, {"xs": np.random.default_rng(1).standard_normal((9, 1, 3))}, loss)
    (instance,) = prog.programs.values()
    assert instance.run.trips == 4 and [b.shape[0] for b in instance.run.buffers.values()] == [4]


@pytest.mark.parametrize("B", [1, 3])
def test_a_carry_its_first_update_widens_runs_as_a_program(B):
    """A learnable ``(1, H)`` initial state becomes ``(B, H)`` in the first iteration (allowed,
    rules.widens): the loop still runs as a program, equal to node by node. (The check that
    allows it once built its error message eagerly, which failed in a first run and sent such
    loops node by node.)"""
    g = vg.VirtualGraph(seed=1)
    xs = g.input("xs", (None, B, 3))
    h0 = g.parameter("h0", (1, 4), init=vg.nn.init.normal(0.5))
    cell = nn.RNNCell(g, 3, 4, "cell")
    with g.loop() as L:
        h = L.carry(h0, name="h")
        h_new = cell(L.step(xs), h)
        L.update(h, h_new)
    loss = vg.sum(L.stack(h_new) ** 2)
    _, prog = assert_identical(g, {"xs": np.random.default_rng(B).normal(size=(5, B, 3))}, loss)
    assert prog.interpreted == []
    assert [n.shape for n in (prog.node(h, (0,)), prog.node(h, (1,)))] == [(1, 4), (B, 4)]


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    st.sampled_from(["rnn", "lstm", "lstm-unfused", "gru", "gru-unfused"]),
    st.integers(1, 6),
    st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)),
    st.integers(0, 1000),
)
def test_random_bidirectional_cells_as_programs_equal_the_per_node_unroll(kind, T, sizes, seed):
    """nn.Bidirectional's one loop over both directions (stacked weights: their products hoisted
    and their gradients collected as one batched product): the same loss, gradients, values,
    retained gradients and decisions as node by node, hoisted or not."""
    B, I, H = sizes
    g = vg.VirtualGraph(seed=seed)
    xs = g.input("xs", (None, B, I))
    name, _, unfused = kind.partition("-")
    make = {"rnn": nn.RNNCell, "lstm": nn.LSTMCell, "gru": nn.GRUCell}[name]
    extra = {} if name == "rnn" else {"fused": not unfused}
    out = nn.Bidirectional(make(g, I, H, "fwd", **extra), make(g, I, H, "bwd", **extra))(xs)
    loss = vg.sum(vg.tanh(out) * np.linspace(-1.0, 1.0, 2 * H))
    feed = {"xs": np.random.default_rng(seed).standard_normal((T, B, I)) * 2.0}
    for hoist in (True, False):
        _, prog = assert_identical(g, feed, loss, hoist=hoist)
        assert prog.interpreted == []
