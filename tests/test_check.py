"""vgraph.check: gradcheck (finite differences against the VJPs), check_vjps (localised) and jacobian."""

from __future__ import annotations

import re

import numpy as np
import pytest

import vgraph
from vgraph import ComputeGraph, NodeKey
from vgraph.check import GradcheckResult, NodeCheck, VjpCheckResult, check_vjps, gradcheck, jacobian
from vgraph.ops import OPS, Op


def _model(dtype=np.float64):
    r = np.random.default_rng(0)
    cg = ComputeGraph(dtype=dtype)
    W = cg.parameter(r.standard_normal((3, 4)), name="W")
    b = cg.parameter(r.standard_normal(3), name="b")
    x = cg.input(r.standard_normal(4), name="x", requires_grad=True)
    y = vgraph.tanh(W @ x + b)
    loss = (y * y).sum()
    return cg, W, b, x, y, loss


# ---------------------------------------------------------------------------- gradcheck
def test_gradcheck_passes_on_a_correct_model():
    cg, W, b, x, y, loss = _model()
    result = gradcheck(loss, [W, b, x])
    assert isinstance(result, GradcheckResult)
    assert result.ok and result.failures == [] and result.localized is None
    assert result.checked == 12 + 3 + 4
    assert 0 <= result.max_abs_error < 1e-8
    assert 0 <= result.max_rel_error < 1e-6


def test_gradcheck_non_scalar_output_is_checked_in_a_random_direction():
    cg, W, b, x, y, loss = _model()
    result = gradcheck(y, [W, x], seed=3)
    assert result.ok and result.checked == 12 + 4


def test_gradcheck_size_one_non_scalar_output():
    cg, W, b, x, y, loss = _model()
    out = (y * y).sum(keepdims=True)  # shape (1,)
    assert out.shape == (1,)
    assert gradcheck(out, [b]).checked == 3


def _square_with_wrong_vjp(bad_index: int) -> Op:
    """x -> x**2 whose VJP is right (2 x g) except at one element, where it is 3 times too large."""

    def vjp(g, ans, x):
        out = 2.0 * x * g
        out[bad_index] *= 3.0
        return out

    return Op("BadSquare", lambda x: x * x, (vjp,), arity=1)


def test_gradcheck_detects_a_wrong_vjp_and_names_input_and_element():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([0.5, -1.0, 1.5, 2.0])
    x = cg.input(x0, name="xin", requires_grad=True)
    y = cg.apply(_square_with_wrong_vjp(2), [x])
    loss = y.sum()
    with pytest.raises(vgraph.GradcheckError) as info:
        gradcheck(loss, [x])
    msg = str(info.value)
    assert "Input:1" in msg and "'xin'" in msg
    assert "(2,)" in msg
    assert "(0,)" not in msg and "(1,)" not in msg and "(3,)" not in msg
    assert "1 of 4" in msg
    assert "<Input:1> 'xin' at element (2,): analytic 9, numeric 3" in msg
    assert "abs error 6, rel error 2" in msg
    # … and then which op node's VJP is wrong (the localised check, run on failure).
    assert (
        "Checked op by op (vgraph.check_vjps): wrong VJP at <BadSquare:1> (op BadSquare), input 0 <Input:1> 'xin'"
        in msg
    )
    assert isinstance(info.value, AssertionError)

    result = gradcheck(loss, [x], raise_on_failure=False)
    assert not result.ok
    assert result.checked == 4
    assert [n.key for n in result.localized.failures] == [vgraph.NodeKey("BadSquare", 1)]
    assert gradcheck(loss, [x], raise_on_failure=False, localize=False).localized is None
    with pytest.raises(
        vgraph.GradcheckError, match=r"disagree[\s\S]*run vgraph\.check_vjps on the output\.$"
    ):
        gradcheck(loss, [x], localize=False)
    assert len(result.failures) == 1
    f = result.failures[0]
    assert f.leaf == "<Input:1> 'xin'" and f.element == (2,)
    assert f.analytic == pytest.approx(3 * 2 * 1.5, rel=1e-12)
    assert f.numeric == pytest.approx(2 * 1.5, rel=1e-6)
    assert f.abs_error == pytest.approx(6.0, rel=1e-6)  # 9 vs 3
    assert f.rel_error == pytest.approx(2.0, rel=1e-6)  # 6 / 3
    assert result.max_abs_error == pytest.approx(6.0, rel=1e-6)
    assert result.max_rel_error == pytest.approx(2.0, rel=1e-6)
    assert "BadSquare" not in OPS  # the broken op was never registered globally


FLOAT = r"-?\d+\.\d+(?:e[+-]\d+)?"  # a plain float's repr: 6.000000000838, 1.4e-11


@pytest.mark.parametrize("tolerances", ["python floats", "numpy scalars"])
def test_gradcheck_results_print_plain_numbers(tolerances):
    """numpy 2 prints a numpy scalar as np.float64(6.0): the results hold Python floats."""
    to = float if tolerances == "python floats" else np.float64
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([0.5, -1.0, 1.5, 2.0]), name="xin", requires_grad=True)
    loss = cg.apply(_square_with_wrong_vjp(2), [x]).sum()
    result = gradcheck(loss, [x], eps=to(1e-6), atol=to(1e-6), rtol=to(1e-5), raise_on_failure=False)
    text = repr(result)
    assert "np." not in text and "float64" not in text, text
    failure = (
        rf"GradcheckFailure\(leaf=\"<Input:1> 'xin'\", element=\(2,\), analytic=9\.0, "
        rf"numeric={FLOAT}, abs_error={FLOAT}, rel_error={FLOAT}\)"
    )
    assert re.fullmatch(
        rf"GradcheckResult\(max_abs_error={FLOAT}, max_rel_error={FLOAT}, checked=4, "
        rf"failures=\[{failure}\], localized=VjpCheckResult\(.*\)\)",
        text,
    ), text
    assert {type(v) for v in (result.max_abs_error, result.max_rel_error, *result.failures[0][2:])} == {float}
    passing = gradcheck((x * x).sum(), [x], eps=to(1e-6), atol=to(1e-6), rtol=to(1e-5))
    assert re.fullmatch(
        rf"GradcheckResult\(max_abs_error={FLOAT}, max_rel_error={FLOAT}, checked=4, failures=\[\], "
        r"localized=None\)",
        repr(passing),
    ), repr(passing)


def test_gradcheck_detects_a_wrong_vjp_through_a_non_scalar_output():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.parameter(np.array([[0.5, -1.0], [1.5, 2.0]]))
    y = vgraph.tanh(cg.apply(_square_with_wrong_vjp(1), [x]))
    with pytest.raises(vgraph.GradcheckError) as info:
        gradcheck(y, [x])
    msg = str(info.value)
    assert msg.startswith("2 of 4")  # row 1 of the VJP is wrong
    assert "<Parameter:1> at element (1, 0)" in msg and "<Parameter:1> at element (1, 1)" in msg
    assert "(0, 0)" not in msg and "(0, 1)" not in msg


def test_gradcheck_of_an_unused_leaf_is_zero_on_both_sides():
    cg, W, b, x, y, loss = _model()
    unused = cg.parameter(np.ones(2), name="unused")
    result = gradcheck(loss, [b, unused])
    assert result.ok and result.checked == 3 + 2


def test_gradcheck_reports_a_leaf_reached_only_through_detach():
    # detach is a deliberate lie about the gradient: gradcheck must show it, not hide it.
    cg = ComputeGraph(dtype=np.float64)
    x = cg.parameter(np.array([1.0, 2.0]), name="x")
    out = (vgraph.detach(x) * x).sum()  # true derivative 2x, backward sees only x
    result = gradcheck(out, [x], raise_on_failure=False)
    assert [f.element for f in result.failures] == [(1,), (0,)]
    assert result.localized.ok  # every VJP is right: the graph itself differs from the function
    with pytest.raises(
        vgraph.GradcheckError, match="Every VJP agrees with its op, so the difference comes from the graph"
    ):
        gradcheck(out, [x])
    assert result.failures[0].analytic == pytest.approx(2.0)
    assert result.failures[0].numeric == pytest.approx(4.0, rel=1e-6)
    only_detached = vgraph.detach(x).sum() + (x * 0.0).sum()
    f = gradcheck(only_detached, [x], raise_on_failure=False).failures
    assert {(g.element, g.analytic) for g in f} == {((0,), 0.0), ((1,), 0.0)}


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("loss", ["W"]), {}, TypeError, r"wrt\[0\] must be a ComputeNode, got str"),
        ((None, []), {}, TypeError, "output must be a ComputeNode, got NoneType"),
        (("loss", []), {"eps": 0.0}, ValueError, "eps must be positive"),
        (("loss", []), {"atol": "1e-6"}, TypeError, "atol must be a number"),
        (("loss", []), {"rtol": -1.0}, ValueError, "rtol must be non-negative"),
    ],
)
def test_gradcheck_argument_errors(args, kwargs, error, match):
    cg, W, b, x, y, loss = _model()
    args = tuple(loss if a == "loss" else a for a in args)
    with pytest.raises(error, match=match):
        gradcheck(*args, **kwargs)


def test_gradcheck_refuses_float32_graphs():
    cg, W, b, x, y, loss = _model(dtype=np.float32)
    with pytest.raises(vgraph.VGraphError, match="float64") as info:
        gradcheck(loss, [W])
    assert not isinstance(info.value, vgraph.GradcheckError)


def test_gradcheck_refuses_non_leaf_inputs():
    cg, W, b, x, y, loss = _model()
    with pytest.raises(vgraph.VGraphError, match="Tanh:1"):
        gradcheck(loss, [y])


def test_gradcheck_leaves_grads_and_values_unchanged():
    cg, W, b, x, y, loss = _model()
    cg.backward(loss)
    grads = {n: n.grad.copy() for n in (W, b, x)}
    grad_objects = {n: n.grad for n in (W, b, x)}
    values = {n: n.value.copy() for n in (W, b, x)}
    loss_before = float(loss.value)
    y_before = y.value.copy()

    gradcheck(loss, [W, b, x])

    for n in (W, b, x):
        assert n.grad is grad_objects[n]
        np.testing.assert_array_equal(n.grad, grads[n])
        np.testing.assert_array_equal(n.value, values[n])
        assert n.value.dtype == np.float64
    assert float(loss.value) == loss_before  # the graph was brought back to the original values
    np.testing.assert_array_equal(y.value, y_before)


def test_gradcheck_leaves_leaves_without_grad_untouched():
    cg, W, b, x, y, loss = _model()
    gradcheck(loss, [W])
    assert W.grad is None and b.grad is None and x.grad is None


def test_backward_after_gradcheck_on_some_parameters_is_correct():
    cg, W, b, x, y, loss = _model()
    cg.backward(loss)
    expected = b.grad.copy()
    cg.zero_grad()
    gradcheck(loss, [W])
    cg.forward(loss)
    cg.backward(loss)
    np.testing.assert_allclose(b.grad, expected, rtol=1e-14)


def test_gradcheck_leaves_retained_intermediate_grads_unchanged():
    cg, W, b, x, y, loss = _model()
    y.retain_grad()
    cg.backward(loss)
    before = y.grad.copy()
    gradcheck(loss, [W, b, x])
    np.testing.assert_array_equal(y.grad, before)


# ---------------------------------------------------------------------------- check_vjps (localised)
def _every_kind_of_op(dtype=np.float64):
    """A graph using broadcasting, reductions, indexing, variadic ops and no-gradient inputs."""
    r = np.random.default_rng(1)
    cg = ComputeGraph(dtype=dtype)
    W = cg.parameter(r.standard_normal((3, 4)), name="W")
    b = cg.parameter(r.standard_normal(3), name="b")
    x = cg.input(r.standard_normal((2, 4)), name="x")
    col = cg.parameter(r.standard_normal((2, 1)), name="col")
    h = vgraph.tanh(x @ W.T + b) * col  # (2, 3) + (3,), then (2, 3) * (2, 1)
    p = vgraph.softmax(h, axis=1)
    lp = vgraph.log_softmax(h, axis=0)
    cat = vgraph.concat([h, p, lp], axis=1)  # (2, 9)
    st = vgraph.stack([h, p], axis=0)  # (2, 2, 3)
    idx = cg.input(np.array([1, 0, 1]))  # integer input: skipped
    picked = vgraph.take(cat, idx)  # (3, 9)
    labels = cg.input(np.array([[2], [0]]))
    along = vgraph.take_along_axis(h, labels, axis=1)
    mask = cg.input(np.array([[True, False, True], [False, True, True]]))
    w = vgraph.where(mask, h, vgraph.exp(h))
    out = (
        picked.sum()
        + st.max(axis=(0, 2)).mean()
        + along.sum()
        + (w / (1.0 + vgraph.sigmoid(h))).sum()
        + vgraph.softplus(cat[:, ::2]).sum()
        + (vgraph.abs(h) ** 3).sum()
        + vgraph.log(p).mean()
        + vgraph.detach(h).sum()
        + vgraph.reshape(st, (4, 3)).transpose()[1, [0, 2]].sum()
    )
    return cg, out


def test_check_vjps_passes_on_every_builtin_op_with_broadcasting_and_variadics():
    cg, out = _every_kind_of_op()
    result = check_vjps(cg)
    assert isinstance(result, VjpCheckResult) and result.ok and result.failures == []
    assert result.first_failure is None
    ops = {n.op for n in result.nodes}
    assert {"MatMul", "Add", "Mul", "Concat", "Stack", "Take", "TakeAlongAxis", "Where", "Max"} <= ops
    assert {"Softmax", "LogSoftmax", "Div", "Pow", "Abs", "Log", "Exp", "GetItem", "Transpose"} <= ops
    assert result.skipped == 1  # Detach: no VJP for its one input
    assert result.max_abs_error < 1e-7 and result.max_rel_error < 1e-5
    # Variadic ops: one entry per input, each compared element by element.
    concat = next(n for n in result.nodes if n.op == "Concat")
    assert [i.position for i in concat.inputs] == [0, 1, 2]
    assert all(i.checked == 6 for i in concat.inputs)
    # Broadcast inputs are compared in their own shape (the VJP's result is unbroadcast).
    add = next(n for n in result.nodes if n.op == "Add" and "'b'" in n.inputs[1].parent)
    assert (add.inputs[0].checked, add.inputs[1].checked) == (6, 3)
    # Inputs without a VJP or with integer values are listed as skipped, with the reason.
    take = next(n for n in result.nodes if n.op == "Take")
    assert take.inputs[1].skipped == "no VJP"
    where = next(n for n in result.nodes if n.op == "Where")
    assert where.inputs[0].skipped == "no VJP" and where.inputs[1].skipped is None
    assert "all VJPs agree" in str(result)


def test_check_vjps_on_a_node_checks_only_what_it_depends_on():
    cg, W, b, x, y, loss = _model()
    other = vgraph.exp(b).sum()
    result = check_vjps(y)
    assert [n.op for n in result.nodes] == ["MatMul", "Add", "Tanh"]
    assert [n.key for n in result.nodes] == [NodeKey("MatMul", 1), NodeKey("Add", 1), NodeKey("Tanh", 1)]
    assert len(check_vjps(cg).nodes) == 3 + 2 + 2  # y, loss = sum(y*y), other
    assert other.op.name == "Sum"


def _wrong_square_vjp(g, ans, x):
    out = 2.0 * x * g
    out[..., 1] *= 3.0  # wrong in column 1 only
    return out


def test_check_vjps_pinpoints_a_wrong_vjp_deep_inside_a_graph():
    cg, W, b, x, y, loss = _model()
    bad = cg.apply(Op("BadSquare", lambda v: v * v, (_wrong_square_vjp,), arity=1), [y])
    out = vgraph.tanh(bad * 0.5 + y).sum()
    assert not gradcheck(out, [W], raise_on_failure=False).ok  # the whole gradient is wrong …
    with pytest.raises(vgraph.GradcheckError) as info:
        check_vjps(out)  # … and this says where
    msg = str(info.value)
    assert msg.startswith("wrong VJP at <BadSquare:1> (op BadSquare), input 0 <Tanh:1>:")
    assert "3 elements; 1 wrong, the worst at element (1,)" in msg
    result = check_vjps(out, raise_on_failure=False)
    assert [n.key for n in result.failures] == [NodeKey("BadSquare", 1)]
    first = result.first_failure
    assert isinstance(first, NodeCheck) and first.op == "BadSquare" and not first.ok
    (inp,) = first.inputs
    y0 = y.value[1]
    # The worst element: analytic 3 * 2 y u, numeric 2 y u for the random cotangent u.
    assert inp.worst_index == (1,) and inp.failed == 1 and inp.checked == 3
    assert inp.analytic == pytest.approx(3 * inp.numeric, rel=1e-6)
    assert abs(inp.numeric) > 0 and y0 != 0
    assert inp.max_rel_error == pytest.approx(2.0, rel=1e-5)
    assert inp.max_abs_error == pytest.approx(2 * abs(inp.numeric), rel=1e-5)
    # Every other node is checked and right.
    assert all(n.ok for n in result.nodes if n.key != first.key)


def test_check_vjps_pinpoints_the_wrong_input_of_a_variadic_op():
    def vjp(i, g, ans, *xs, axis=0):
        start = sum(x.shape[axis] for x in xs[:i])
        part = np.take(g, range(start, start + xs[i].shape[axis]), axis=axis)
        return 2 * part if i == 1 else part  # input 1 gets twice its gradient

    bad_concat = Op("BadConcat", lambda *xs, axis=0: np.concatenate(xs, axis=axis), vjp, variadic=True)
    cg = ComputeGraph(dtype=np.float64)
    a, b, c = (cg.input(np.arange(n, dtype=float) + 1, requires_grad=True) for n in (2, 3, 1))
    out = cg.apply(bad_concat, [a, b, c], {"axis": 0})
    result = check_vjps(out, raise_on_failure=False)
    (node,) = result.nodes
    assert [i.ok for i in node.inputs] == [True, False, True]
    assert node.inputs[1].failed == 3 and "<Input:2>" in node.inputs[1].parent


@pytest.mark.parametrize("programs", [True, False])
def test_check_vjps_finds_the_first_wrong_iteration_of_an_unrolled_loop(monkeypatch, programs):
    def wrong_tanh_vjp(g, ans, x):
        return g * (1 - ans)  # forgot to square

    monkeypatch.setitem(OPS, "Tanh", Op("Tanh", np.tanh, (wrong_tanh_vjp,), arity=1))
    g = vgraph.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", shape=(None, 3))
    Wx = g.parameter("Wx", (3, 2))
    Wh = g.parameter("Wh", (2, 2))
    h0 = g.constant(np.zeros(2))
    with g.loop() as L:
        h = L.carry(h0, name="h")
        h_new = vgraph.tanh(L.step(xs) @ Wx + h @ Wh)
        L.update(h, h_new)
    loss = (L.final(h) ** 2).sum()
    cg = g.build({"xs": np.random.default_rng(0).standard_normal((4, 3))}, loss, programs=programs)

    result = check_vjps(cg, raise_on_failure=False)
    assert result.first_failure.key == NodeKey("Tanh", h_new.id, (0,))
    assert [n.key for n in result.failures] == [NodeKey("Tanh", h_new.id, (t,)) for t in range(4)]
    ops_checked = {n.op for n in result.nodes}
    # loop items too; a program graph is checked node by node as the plain unroll (no hoisting)
    assert {"GetItem", "MatMul", "Add" if programs else "MatMulAddRow", "Tanh", "Pow", "Sum"} <= ops_checked
    assert len(result.nodes) > 4 * 4
    with pytest.raises(vgraph.GradcheckError, match=rf"wrong VJP at <Tanh:{h_new.id}@0> \(op Tanh\)"):
        check_vjps(cg.node(loss))


def test_check_vjps_with_the_builtin_ops_passes_on_an_unrolled_rnn():
    g = vgraph.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", shape=(None, 2, 3))
    Wx, Wh, b = g.parameter("Wx", (3, 4)), g.parameter("Wh", (4, 4)), g.parameter("b", (4,))
    with g.loop() as L:
        h = L.carry(g.constant(np.zeros((2, 4))), name="h")
        h_new = vgraph.tanh(L.step(xs) @ Wx + h @ Wh + b)
        L.update(h, h_new)
    loss = vgraph.log_softmax(L.stack(h_new), axis=-1).mean()
    cg = g.build({"xs": np.random.default_rng(2).standard_normal((5, 2, 3))}, loss)
    result = check_vjps(cg)
    assert result.ok and sum(n.op == "Tanh" for n in result.nodes) == 5
    stack = next(n for n in result.nodes if n.op == "Stack")
    assert len(stack.inputs) == 5  # one VJP per iteration's input


def test_check_vjps_reports_vjps_that_raise_return_none_or_a_wrong_shape():
    def raising(g, ans, x):
        return g[:, 7]

    def in_place(g, ans, x):
        g *= 2
        return g

    cases = {
        "Raises": (raising, "the VJP raised IndexError"),
        "InPlace": (in_place, "must not modify g, ans or the inputs in place"),
        "ReturnsNone": (lambda g, ans, x: None, "returned None"),
        "WrongShape": (lambda g, ans, x: np.ones((2, 5)), "returned shape (2, 5), which does not reduce"),
    }
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones((2, 3)), requires_grad=True)
    nodes = {name: cg.apply(Op(name, np.sin, (vjp,), arity=1), [x]) for name, (vjp, _) in cases.items()}
    result = check_vjps(cg, raise_on_failure=False)
    assert [n.op for n in result.failures] == list(cases)
    for node_check in result.failures:
        assert cases[node_check.op][1] in node_check.inputs[0].error
    assert set(nodes) == {n.op for n in result.nodes}


def test_check_vjps_skips_kinks_instead_of_reporting_them():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([-1.0, 0.0, 2.0]), requires_grad=True)  # relu and abs at exactly 0
    ties = cg.input(np.array([[1.0, 1.0, 1.0, 0.5]]), requires_grad=True)  # a 3-way tie
    result = check_vjps(vgraph.relu(x).sum() + vgraph.abs(x).sum() + ties.max(axis=1).sum())
    assert result.ok
    by_op = {n.op: n.inputs[0] for n in result.nodes}
    assert by_op["Relu"].nondifferentiable == 1 and by_op["Relu"].checked == 2
    assert by_op["Abs"].nondifferentiable == 1
    assert by_op["Max"].nondifferentiable == 3 and by_op["Max"].checked == 1


def test_check_vjps_upcasts_float32_graphs_but_refuses_ops_that_compute_in_float32():
    cg, out = _every_kind_of_op(dtype=np.float32)
    assert check_vjps(cg).ok  # the ops' arithmetic, checked in float64 at the float32 values
    x = cg.input(np.ones(3, dtype=np.float32), requires_grad=True)
    f32 = Op(
        "Float32Sin", lambda v: np.sin(v).astype(np.float32), (lambda g, ans, v: g * np.cos(v),), arity=1
    )
    cg.apply(f32, [x])
    with pytest.raises(vgraph.VGraphError, match=r"<Float32Sin:1> \(op Float32Sin\) returned float32"):
        check_vjps(cg)


def test_check_vjps_filters_by_op_and_samples_elements():
    cg, W, b, x, y, loss = _model()
    result = check_vjps(cg, ops="Tanh")
    assert [n.op for n in result.nodes] == ["Tanh"]
    result = check_vjps(cg, ops=["MatMul", "Sum"], max_elements=5, seed=1)
    assert [n.op for n in result.nodes] == ["MatMul", "Sum"]
    matmul = result.nodes[0]
    assert [i.checked for i in matmul.inputs] == [5, 4]  # W has 12 elements, x 4
    with pytest.raises(vgraph.VGraphError, match="no node to check computes 'Tanhh'"):
        check_vjps(cg, ops=["Tanh", "Tanhh"])


def test_check_vjps_changes_nothing():
    cg, W, b, x, y, loss = _model()
    cg.backward_ex(loss, retain_graph=True)
    before = {
        n: (n.version, np.array(n.value), None if n.grad is None else n.grad.copy()) for n in cg.nodes()
    }
    check_vjps(cg)
    for n, (version, value, grad) in before.items():
        assert n.version == version
        np.testing.assert_array_equal(n.value, value)
        if grad is not None:
            np.testing.assert_array_equal(n.grad, grad)
    cg.backward(loss)  # the graph is still usable (retained)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"target": "Tanh:1"}, TypeError, "target must be a ComputeGraph or a ComputeNode, got str"),
        ({"ops": [1]}, TypeError, "ops must be op names"),
        ({"eps": -1.0}, ValueError, "eps must be positive"),
        ({"max_elements": 0}, ValueError, "max_elements must be a positive integer"),
        ({"seed": "abc"}, ValueError, "seed 'abc' is not a valid numpy seed"),
    ],
)
def test_check_vjps_argument_errors(kwargs, error, match):
    cg, *_ = _model()
    kwargs = {"target": cg, **kwargs}
    with pytest.raises(error, match=match):
        check_vjps(**kwargs)


# ---------------------------------------------------------------------------- jacobian
def test_jacobian_of_a_linear_map_is_the_matrix():
    cg = ComputeGraph(dtype=np.float64)
    r = np.random.default_rng(0)
    W0 = r.standard_normal((3, 4))
    x = cg.input(r.standard_normal(4), requires_grad=True)
    y = cg.constant(W0) @ x
    J = jacobian(y, x)
    assert J.shape == (3, 4)
    np.testing.assert_array_equal(J, W0)


def test_jacobian_with_respect_to_the_matrix():
    cg = ComputeGraph(dtype=np.float64)
    r = np.random.default_rng(0)
    x0 = r.standard_normal(4)
    W = cg.parameter(r.standard_normal((3, 4)))
    y = W @ cg.input(x0)
    J = jacobian(y, W)
    assert J.shape == (3, 3, 4)
    expected = np.zeros((3, 3, 4))
    for i in range(3):
        expected[i, i, :] = x0  # d y_i / d W_jk = [i == j] x_k
    np.testing.assert_array_equal(J, expected)


def test_jacobian_of_tanh_is_diagonal():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([-2.0, -0.3, 0.0, 0.7, 1.5])
    x = cg.input(x0, requires_grad=True)
    J = jacobian(vgraph.tanh(x), x)
    np.testing.assert_allclose(J, np.diag(1.0 - np.tanh(x0) ** 2), rtol=1e-15, atol=0)


def test_jacobian_of_a_matrix_output_has_the_combined_shape():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([[1.0, 2.0], [3.0, 4.0]])
    x = cg.input(x0, requires_grad=True)
    J = jacobian(x * x, x)
    assert J.shape == (2, 2, 2, 2)
    expected = np.zeros((2, 2, 2, 2))
    for i, j in np.ndindex(2, 2):
        expected[i, j, i, j] = 2 * x0[i, j]
    np.testing.assert_array_equal(J, expected)


def test_jacobian_refuses_an_input_without_requires_grad():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones(3))
    with pytest.raises(vgraph.GraphStateError):
        jacobian(vgraph.tanh(x), x)


def test_jacobian_refuses_a_node_of_no_graph():
    free = vgraph.ComputeNode(NodeKey("Parameter", 0, ()), np.ones(3), requires_grad=True)
    with pytest.raises(vgraph.VGraphError, match="belongs to no ComputeGraph"):
        jacobian(free, free)
