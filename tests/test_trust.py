"""Trust (issue 9): no silent stale gradient, no half-done failure, every mistake a typed and named
error, no recursion over branch chains, and the first NaN/Inf named at its unrolled node.

Each test here reproduces a defect found by trying the public API as a new user would; each
fails on the code before the fix.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import vgraph as vg
from vgraph import ComputeGraph

# ---------------------------------------------------------------------------- helpers


def small_model(dtype=np.float64):
    """loss = sum(tanh(x) @ W); x an input (no gradient), W a parameter."""
    cg = ComputeGraph(dtype=dtype)
    x = cg.input(np.array([[0.5, -1.0, 2.0]]), name="x")
    W = cg.parameter(np.arange(6.0).reshape(3, 2) / 10, name="W")
    u = vg.tanh(x)  # no gradient flows here: a stale value off the gradient's path
    loss = vg.sum(u @ W)
    return cg, x, W, u, loss


def fresh_grad(x_value, W_value):
    """The gradient of sum(tanh(x) @ W) w.r.t. W, by hand: tanh(x).T @ ones."""
    return np.tanh(x_value).T @ np.ones((1, 2))


def elman(T=6):
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    xs = g.input("xs", (None, 1, 2))
    W = g.parameter("W", (2, 3), share=True)
    U = g.parameter("U", (3, 3), share=True)
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((1, 3)), name="h")
        h_new = vg.tanh(x @ W + h @ U)
        L.update(h, h_new)
    loss = vg.sum(L.final(h) ** 2)
    feed = {"xs": np.random.default_rng(0).normal(size=(T, 1, 2))}
    return g, feed, loss


# ---------------------------------------------------------------------------- 1. stale values


def test_backward_after_feed_without_forward_is_refused_and_names_the_input():
    g, feed, loss = elman()
    cg = g.build(feed, loss)
    cg.feed({"xs": feed["xs"] * 2})
    with pytest.raises(vg.GraphStateError, match=r"<Input:1> 'xs' was fed.*Run forward first") as e:
        cg.backward(loss)
    assert "stale" in str(e.value)
    assert g.params["W"].grad is None  # nothing accumulated
    cg.forward()
    cg.backward(loss)  # fine once values are fresh
    # ... and equals the gradient of a fresh build on the new values.
    g2, _, loss2 = elman()
    cg2 = g2.build({"xs": feed["xs"] * 2}, loss2)
    cg2.backward(loss2)
    np.testing.assert_allclose(g.params["W"].grad, g2.params["W"].grad, rtol=1e-12, atol=0)


def test_set_value_then_backward_is_refused_even_off_the_gradient_path():
    # u = tanh(x) needs no gradient, so a check over the backward plan alone would miss it.
    cg, x, W, u, loss = small_model()
    x.set_value(np.array([[1.0, 1.0, 1.0]]))
    with pytest.raises(vg.GraphStateError, match=r"<Tanh:1> is stale, <Input:1> 'x' was fed"):
        cg.backward(loss)
    with pytest.raises(vg.GraphStateError, match="stale"):
        cg.grad(loss, [W])
    cg.forward(loss)
    cg.backward(loss)
    np.testing.assert_allclose(W.grad, fresh_grad(x.value, W.value), rtol=1e-12)


def test_backward_after_a_forward_that_failed_part_way_is_refused():
    cg = ComputeGraph(dtype=np.float64)
    table = cg.parameter(np.arange(8.0).reshape(4, 2), name="E")
    idx = cg.input(np.array([0, 3]), name="idx")
    y = vg.take(table, idx)
    scale = cg.input(np.array(2.0), name="s")
    loss = vg.sum(vg.tanh(table * scale)) + vg.sum(y)
    # tanh(table * scale) is recomputed first, then Take fails: some nodes new, some old.
    scale.set_value(3.0)
    idx.set_value(np.array([0, 9]))
    with pytest.raises(vg.ShapeError):
        cg.forward(loss)
    with pytest.raises(vg.GraphStateError, match=r"last forward failed part-way \(ShapeError"):
        cg.backward(loss)
    assert table.grad is None


def test_retained_graph_after_an_optimiser_step_is_refused():
    g, feed, loss = elman()
    cg = g.build(feed, loss)
    cg.backward_ex(loss, retain_graph=True)
    vg.optim.SGD(g.params, lr=0.1).step()
    with pytest.raises(
        vg.GraphStateError, match=r"<Parameter:\d+> '[WU]' was changed \(e.g. by an optimiser step\)"
    ):
        cg.backward_ex(loss, retain_graph=True)


def test_the_fast_path_does_not_hide_a_stale_value_after_a_partial_forward():
    # forward(target) for one output must not make a backward from another output look fresh.
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([1.0, 2.0]), name="x")
    W = cg.parameter(np.array([0.5, -0.5]), name="W")
    a = vg.sum(x * W)
    b = vg.sum(vg.tanh(x) * W)
    cg.backward_ex(b, retain_graph=True)  # checked fresh, recorded
    x.set_value(np.array([3.0, 4.0]))
    cg.forward(a)
    with pytest.raises(vg.GraphStateError, match="stale"):
        cg.backward(b)
    cg.backward(a)  # a's ancestors were brought up to date


# ---------------------------------------------------------------------------- 2. failures change nothing


def test_a_failing_vjp_changes_no_grad_and_is_named():
    def bad_vjp(g, ans, x):
        raise IndexError("index 7 is out of bounds")

    op = vg.ops.Op("Flaky", np.sin, (bad_vjp,), arity=1)
    cg = ComputeGraph(dtype=np.float64)
    p = cg.parameter(np.array([1.0, 2.0]), name="p")
    q = cg.parameter(np.array([3.0, 4.0]), name="q")
    loss = vg.sum(p * q) + vg.sum(cg.apply(op, [p]))
    p.grad = np.array([10.0, 10.0])
    before_q = q.grad
    with pytest.raises(
        vg.BackwardError, match=r"<Flaky:1>: the VJP of Flaky with respect to its input <Parameter:1> 'p'"
    ) as e:
        cg.backward(loss)
    assert isinstance(e.value.__cause__, IndexError)
    np.testing.assert_array_equal(p.grad, [10.0, 10.0])  # q's contribution to p was not committed
    assert q.grad is before_q is None
    # The graph is still usable: no gradient left pending in a node.
    assert all(n._g is None for n in cg.nodes())


def test_failed_parameter_declarations_leave_the_graph_unchanged():
    g = vg.VirtualGraph(seed=0)

    def broken(shape, rng, dtype):
        raise RuntimeError("no")

    bad_calls = [
        (lambda: g.parameter("W", (2, 2), init=broken), vg.BuildError, "initialiser raised RuntimeError"),
        (lambda: g.parameter("W", (2, 2), init=lambda s, r, d: np.zeros(3)), vg.ShapeError, "returned shape"),
        (lambda: g.parameter("W", (2, 2), init=5j), TypeError, "init="),
        (lambda: g.parameter("W", (2, 2), init=object()), TypeError, "init= must be an initialiser"),
        (lambda: g.parameter("W", (2, -1)), ValueError, "negative"),
        (lambda: g.parameter("W", (2, 2.5)), TypeError, "2.5"),
        (lambda: g.parameter("W", (2, 2), seed=-3), vg.ArgumentValueError, "seed must be an int >= 0"),
        (lambda: g.parameter("W", (2, 2), seed="abc"), TypeError, "seed"),
        (lambda: g.parameter("W", (2, 2), init="nope"), ValueError, "unknown initialiser"),
        (lambda: g.parameter("W@3", (2, 2)), vg.BuildError, "contains '@'"),
        (lambda: vg.nn.Linear(g, -1, 3, "fc"), vg.ArgumentValueError, "in_features must be an int >= 1"),
    ]
    for call, error, message in bad_calls:
        with pytest.raises(error, match=message):
            call()
        assert g.nodes == [] and len(g.params) == 0 and g._counters == {}, message
    W = g.parameter("W", (2, 2))  # the name is still free
    assert W.id == 1 and list(g.params) == ["W"]


def test_untied_parameter_with_a_failing_initialiser_fails_at_declaration():
    g = vg.VirtualGraph()
    with g.loop(times=3) as L:
        h = L.carry(np.zeros(2))
        with pytest.raises(vg.BuildError, match=r"<Parameter:1@0> 'W': the initialiser raised"):
            g.parameter("W", (2, 2), init=lambda s, r, d: 1 / 0)
        L.update(h, h)
    assert "W" not in g._param_decls


def test_a_carry_that_changes_shape_is_refused_at_build():
    g = vg.VirtualGraph(dtype=np.float64)
    with g.loop(times=4) as L:
        acc = L.carry(np.zeros((1, 2)), name="acc")
        L.update(acc, vg.concat([acc, acc], axis=0))
    out = vg.sum(L.final(acc))
    with pytest.raises(
        vg.ShapeError,
        match=r"<Loop:1>: carry 'acc' enters iteration 1 as float64\[2, 2\] but is updated to float64\[4, 2\]",
    ):
        g.build({}, out)
    assert g.latest_build is None


def test_a_carry_may_broadcast_its_initial_value_once():
    g = vg.VirtualGraph(dtype=np.float64)
    xs = g.input("xs", (None, 3, 2))
    h0 = g.parameter("h0", (1, 2))
    with g.loop() as L:
        h = L.carry(h0, name="h")
        L.update(h, vg.tanh(h + L.step(xs)))
    cg = g.build({"xs": np.ones((4, 3, 2))}, vg.sum(L.final(h)))
    assert cg.outputs[0].shape == ()


# ---------------------------------------------------------------------------- 3. typed, named errors


def test_wrong_argument_types_are_type_errors_naming_the_argument():
    cg, x, W, u, loss = small_model()
    with pytest.raises(TypeError, match=r"backward\(\): loss must be a ComputeNode.*cg.node\('Sum:1'\)"):
        cg.backward("Sum:1")
    with pytest.raises(TypeError, match="loss must be"):
        cg.backward(None)
    with pytest.raises(TypeError, match=r"grad\(\): inputs must be"):
        cg.grad(loss, ["W"])
    with pytest.raises(TypeError, match="target must be"):
        cg.forward(3)
    other = ComputeGraph(dtype=np.float64)
    foreign = vg.sum(other.parameter(np.ones(2)) * 2)
    with pytest.raises(vg.GraphStateError, match="not a node of this graph"):
        cg.backward(foreign)


def test_contains_answers_false_for_anything_that_is_not_a_key():
    cg, x, W, u, loss = small_model()
    assert "Tanh:1" in cg and vg.NodeKey("Input", 1) in cg
    assert "x" not in cg and 5 not in cg and None not in cg and "Tanh:9" not in cg


def test_unrolled_graph_contains_virtual_nodes_it_built():
    g, feed, loss = elman()
    cg = g.build(feed, loss)
    assert loss in cg
    g2 = vg.VirtualGraph()
    assert g2.input("q") not in cg


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: vg.VirtualGraph(seed="abc"), TypeError, r"seed.*str"),
        (lambda: vg.VirtualGraph(seed=-1), vg.ArgumentValueError, "must be an int >= 0, got -1"),
        (lambda: vg.VirtualGraph(dtype=np.int32), TypeError, "float dtype"),
        (lambda: vg.VirtualGraph().loop(max_iters="10"), TypeError, "max_iters"),
        (lambda: vg.VirtualGraph().loop(max_iters=-1), ValueError, "max_iters"),
        (lambda: vg.VirtualGraph().loop(while_=3), TypeError, "while_"),
        (lambda: vg.VirtualGraph().branch(3, [1.0, 2.0]), TypeError, "selector must be callable"),
        (lambda: vg.VirtualGraph().input("x", (2.5, 3)), TypeError, "2.5"),
        (lambda: vg.VirtualGraph().input(7), TypeError, "name must be"),
        (lambda: vg.VirtualGraph().constant([[1.0], [1.0, 2.0]]), ValueError, "not a rectangular array"),
        (lambda: vg.VirtualGraph().sample("mask", 1.0), TypeError, "callable"),
    ],
)
def test_bad_declarations_are_typed_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_ragged_feed_is_a_feed_error_naming_the_input():
    g, feed, loss = elman()
    with pytest.raises(vg.FeedError, match=r"input 'xs'.*rectangular"):
        g.build({"xs": [[[1.0, 2.0]], [[1.0]]]}, loss)


def loop_with_condition(cond):
    g = vg.VirtualGraph(dtype=np.float64)
    with g.loop(while_=cond, max_iters=20) as L:
        h = L.carry(np.ones(2), name="h")
        L.update(h, h * 0.5)
    return g, vg.sum(L.final(h))


def test_a_condition_returning_none_is_an_error_not_zero_iterations():
    def forgot_return(t, state):
        state["h"].sum() > 0.1  # noqa: B015  (the mistake under test)

    g, out = loop_with_condition(forgot_return)
    with pytest.raises(
        vg.BuildError, match=r"<Loop:1>: the while_ condition returned None.*iteration 0.*return"
    ):
        g.build({}, out)


def test_a_condition_that_raises_is_wrapped_with_loop_and_iteration():
    def cond(t, state):
        return state["missing"] > 0

    g, out = loop_with_condition(cond)
    with pytest.raises(
        vg.BuildError, match=r"<Loop:1>: the while_ condition raised KeyError.*iteration 0"
    ) as e:
        g.build({}, out)
    assert isinstance(e.value.__cause__, KeyError)


def test_a_selector_that_raises_is_wrapped_with_the_branch():
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", (2,))
    out = g.branch(lambda v: {0: 0}[int(v.sum())], [x * 2, x * 3], keys=[x])
    with pytest.raises(vg.SelectorError, match=r"<Branch:1>: the selector raised KeyError") as e:
        g.build({"x": np.ones(2)}, vg.sum(out))
    assert isinstance(e.value.__cause__, KeyError)


# ---------------------------------------------------------------------------- 4. no recursion


def test_ten_thousand_chained_branches_build_at_a_low_recursion_limit():
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", (2,))
    w = g.parameter("w", (2,), init=np.array([1.0, 2.0]))
    node = x * w
    n = 10_000
    for _ in range(n):
        # option 0 continues the chain; option 1 would too, differently: only one is built
        node = g.branch(lambda v: 0, [node + 0.0001, node * 0.5], keys=[x])
    loss = vg.sum(node)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        cg = g.build({"x": np.ones(2)}, loss)
        value = cg.backward(loss)
    finally:
        sys.setrecursionlimit(limit)
    assert len(cg.decisions) == n and all(d.value == 0 for d in cg.decisions)
    np.testing.assert_allclose(value, 3.0 + 2 * n * 0.0001, rtol=1e-12)
    np.testing.assert_allclose(g.params["w"].grad, [1.0, 1.0])


# ---------------------------------------------------------------------------- 6. anomaly mode


def test_anomaly_names_the_first_nan_at_its_unrolled_node():
    g = vg.VirtualGraph(dtype=np.float64)
    xs = g.input("xs", (None, 2))
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + vg.log(x))
    loss = vg.sum(L.final(h))
    values = np.ones((40, 2))
    values[37] = [0.5, -0.02]
    with (
        vg.detect_anomaly(),
        pytest.raises(
            vg.NonFiniteError,
            match=r"NaN first appears at <Log:1@37> \(hoisted.*\): log of a negative input \(min -0.02\)",
        ),
    ):
        g.build({"xs": values}, loss)
    # The same build outside the block just computes NaN (numpy's behaviour).
    with np.errstate(invalid="ignore"):
        cg = g.build({"xs": values}, loss)
    assert np.isnan(cg.forward())
    # ... and the option on build does the same as the block.
    with pytest.raises(vg.NonFiniteError, match=r"<Log:1@37>"), np.errstate(invalid="ignore"):
        g.build({"xs": values}, loss, detect_anomaly=True)


def test_anomaly_on_forward_names_the_node_and_the_inputs():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([1.0, 2.0]), name="x")
    d = cg.input(np.array([1.0, 1.0]), name="d")
    y = vg.sum(x / d)
    d.set_value(np.array([1.0, 0.0]))
    with (
        pytest.raises(
            vg.NonFiniteError,
            match=r"Inf first appears at <Div:1>: division by zero\n  input <Input:1> 'x': shape \(2,\), finite",
        ),
        np.errstate(divide="ignore"),
    ):
        cg.forward(y, detect_anomaly=True)


def test_anomaly_in_backward_names_the_node_whose_vjp_produced_it():
    cg = ComputeGraph(dtype=np.float64)
    p = cg.parameter(np.array([0.0, 4.0]), name="p")
    loss = vg.sum(p**0.5)  # finite forward (sqrt(0) = 0), infinite derivative at 0
    with (
        pytest.raises(
            vg.NonFiniteError,
            match=r"Inf first appears in backward at <Pow:1>: the VJP of Pow gave a non-finite gradient for its input <Parameter:1> 'p'",
        ),
        np.errstate(divide="ignore"),
    ):
        cg.backward(loss, detect_anomaly=True)
    assert p.grad is None


def test_anomaly_names_a_non_finite_leaf_where_it_enters():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([1.0, np.nan]), name="x")
    with (
        vg.detect_anomaly(),
        pytest.raises(vg.NonFiniteError, match=r"NaN enters at <Tanh:1> \(Tanh\) from <Input:1> 'x'"),
    ):
        vg.tanh(x)


def test_anomaly_mode_is_off_by_default_and_restored_after_the_block():
    assert not vg.is_anomaly_enabled()
    with pytest.raises(RuntimeError), vg.detect_anomaly():
        assert vg.is_anomaly_enabled()
        raise RuntimeError
    assert not vg.is_anomaly_enabled()
