"""User-defined primitives: vgraph.defop / undefop, on compute and virtual nodes, checked by
finite differences (gradcheck, check_vjps) in float64."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import vgraph as vg
from vgraph import NodeKey, tape
from vgraph.functions import OpFunction
from vgraph.ops import OPS, CheckedForward, CheckedVJP

F64 = np.float64


def softsign(x):
    return x / (1 + np.abs(x))


def softsign_vjp(g, ans, x):
    return g / (1 + np.abs(x)) ** 2


def hypot_vjp_a(g, ans, a, b):
    return g * a / ans


def hypot_vjp_b(g, ans, a, b):
    return g * b / ans  # broadcast shape: the engine sums it back to b's shape


def wrong_hypot_vjp_b(g, ans, a, b):
    return g * b  # forgot to divide by ans


# ---------------------------------------------------------------------------- on compute nodes
def test_a_custom_op_computes_and_differentiates_on_compute_nodes(defop):
    soft = defop("Softsign", softsign, softsign_vjp)
    assert isinstance(soft, OpFunction) and repr(soft) == "<vgraph op Softsign: 1 input>"
    cg = vg.ComputeGraph(dtype=F64)
    x0 = np.array([[-2.0, 0.5, 3.0], [1.0, -0.1, 4.0]])
    x = cg.input(x0, name="x", requires_grad=True)
    y = soft(x)
    assert y.key == NodeKey("Softsign", 1) and y.op is OPS["Softsign"]
    np.testing.assert_allclose(y.value, x0 / (1 + np.abs(x0)), rtol=1e-15)
    z = cg.apply("Softsign", [y])  # by name, like any op of the table
    assert z.key == NodeKey("Softsign", 2)
    loss = (z * z).sum()
    cg.backward(loss)
    d1 = 1 / (1 + np.abs(x0)) ** 2
    y0 = x0 / (1 + np.abs(x0))
    z0 = y0 / (1 + np.abs(y0))
    np.testing.assert_allclose(x.grad, 2 * z0 / (1 + np.abs(y0)) ** 2 * d1, rtol=1e-12)
    assert vg.gradcheck(loss, [x]).ok
    assert vg.check_vjps(loss).ok


def test_broadcast_inputs_get_their_gradient_unbroadcast(defop):
    hypot = defop("Hypot", np.hypot, hypot_vjp_a, hypot_vjp_b)
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.input(np.array([[-2.0, 0.5, 3.0], [1.0, -0.1, 0.0]]), requires_grad=True)
    w = cg.parameter(np.array([0.3, -1.2, 2.0]))
    loss = hypot(x, w).sum()
    cg.backward(loss)
    assert w.grad.shape == (3,)
    expected = (w.value / np.hypot(x.value, w.value)).sum(axis=0)
    np.testing.assert_allclose(w.grad, expected, rtol=1e-14)
    vg.gradcheck(loss, [x, w])
    result = vg.check_vjps(loss)
    (node,) = (n for n in result.nodes if n.op == "Hypot")
    assert [i.checked for i in node.inputs] == [6, 3]


def test_static_attributes_reach_forward_and_vjps(defop):
    def scaled_vjp(g, ans, x, factor=1.0, power=1):
        return g * factor * power * x ** (power - 1)

    scaled = defop("ScaledPower", lambda x, factor=1.0, power=1: factor * x**power, scaled_vjp)
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.parameter(np.array([1.5, -0.5]))
    y = scaled(x, factor=3.0, power=3)
    assert y.attrs == {"factor": 3.0, "power": 3}
    np.testing.assert_allclose(y.value, 3.0 * np.array([1.5, -0.5]) ** 3)
    vg.gradcheck(y.sum(), [x])
    assert vg.check_vjps(y).ok
    with pytest.raises(
        TypeError, match=r"ScaledPower: forward\(x, factor=1.0, power=1\) cannot be called .*'axis'"
    ):
        scaled(x, axis=0)  # refused when declared, not in the middle of a backward


def test_a_vjp_that_cannot_take_an_attribute_is_refused_at_the_call(defop):
    op = defop("Shift", lambda x, by=0.0: x + by, lambda g, ans, x: g)  # the VJP forgot **attrs
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.parameter(np.ones(2))
    op(x)  # no attrs: fine
    n = len(cg)
    with pytest.raises(
        TypeError, match=r"Shift: VJP 0\(g, ans, x\) cannot be called with 1 input\(s\) and attrs"
    ):
        op(x, by=1.0)
    assert len(cg) == n  # nothing was added


def test_a_variadic_custom_op(defop):
    def weighted(*xs):
        return sum((i + 1) * x for i, x in enumerate(xs))

    def weighted_vjp(i, g, ans, *xs):
        return (i + 1) * g

    f = defop("Weighted", weighted, weighted_vjp, variadic=True)
    assert repr(f) == "<vgraph op Weighted: any number of inputs>"
    cg = vg.ComputeGraph(dtype=F64)
    a, b, c = (cg.parameter(np.full(2, v)) for v in (1.0, 2.0, 3.0))
    y = f(a, b, c)
    np.testing.assert_array_equal(y.value, [14.0, 14.0])
    cg.backward(y.sum())
    assert [float(p.grad[0]) for p in (a, b, c)] == [1.0, 2.0, 3.0]
    result = vg.check_vjps(y)
    assert result.ok and len(result.nodes[0].inputs) == 3


def test_an_input_without_a_vjp_gets_no_gradient(defop):
    clip = defop("ClipTo", lambda x, hi: np.minimum(x, hi), lambda g, ans, x, hi: g * (x < hi), None)
    cg = vg.ComputeGraph(dtype=F64)
    x, hi = cg.parameter(np.array([0.5, 2.0])), cg.parameter(np.array([1.0, 1.0]))
    y = clip(x, hi)
    cg.backward(y.sum())
    np.testing.assert_array_equal(x.grad, [1.0, 0.0])
    assert hi.grad is None
    (node,) = vg.check_vjps(y).nodes
    assert node.inputs[1].skipped == "no VJP"


# ---------------------------------------------------------------------------- in virtual graphs
def _rnn(hypot, soft, steps=5):
    I, H = 3, 4
    g = vg.VirtualGraph(dtype=F64, seed=0)
    xs = g.input("xs", shape=(None, 2, I))
    Wx, Wh = g.parameter("Wx", (I, H)), g.parameter("Wh", (H, H))
    scale = g.parameter("scale", (H,), init=np.ones(H))
    with g.loop(name="time") as L:
        h = L.carry(g.constant(np.zeros((2, H))), name="h")
        h_new = soft(hypot(L.step(xs) @ Wx + h @ Wh, scale))
        L.update(h, h_new)
    loss = (L.final(h) ** 2).mean()
    feed = {"xs": np.random.default_rng(0).standard_normal((steps, 2, I))}
    return g, g.build(feed, loss), loss, h_new, feed


def test_custom_ops_in_an_unrolled_loop_match_numpy_and_pass_both_checks(defop):
    soft = defop("Softsign", softsign, softsign_vjp)
    hypot = defop("Hypot", np.hypot, hypot_vjp_a, hypot_vjp_b)
    g, cg, loss, h_new, feed = _rnn(hypot, soft)
    P = {k: g.params[k].value for k in ("Wx", "Wh", "scale")}
    h = np.zeros((2, 4))
    for x_t in feed["xs"]:
        h = softsign(np.hypot(x_t @ P["Wx"] + h @ P["Wh"], P["scale"]))
    assert cg.forward(cg.node(loss)) == pytest.approx(np.mean(h**2), rel=1e-13)
    vg.gradcheck(cg.node(loss), g.params.parameters())
    result = vg.check_vjps(cg)
    assert result.ok
    assert sum(n.op == "Hypot" for n in result.nodes) == sum(n.op == "Softsign" for n in result.nodes) == 5
    assert cg.node(h_new, (4,)).key == NodeKey("Softsign", h_new.id, (4,))
    assert "Softsign" in vg.render.to_dot(cg)


def test_check_vjps_pinpoints_a_wrong_custom_vjp_in_every_iteration(defop):
    soft = defop("Softsign", softsign, softsign_vjp)
    bad_hypot = defop("BadHypot", np.hypot, hypot_vjp_a, wrong_hypot_vjp_b)
    g, cg, loss, h_new, _ = _rnn(bad_hypot, soft)
    failures = vg.gradcheck(cg.node(loss), g.params.parameters(), raise_on_failure=False).failures
    assert {f.leaf for f in failures} == {"<Parameter:3> 'scale'"}  # gradcheck: which leaf …

    with pytest.raises(vg.GradcheckError) as info:  # … check_vjps: which node, op and input
        vg.check_vjps(cg)
    hypot_id = h_new.inputs[0].id
    assert str(info.value).startswith(
        f"wrong VJP at <BadHypot:{hypot_id}@0> (op BadHypot), input 1 <Parameter:3> 'scale'"
    )
    result = vg.check_vjps(cg, raise_on_failure=False)
    assert [n.key for n in result.failures] == [NodeKey("BadHypot", hypot_id, (t,)) for t in range(5)]
    first = result.first_failure
    assert first.inputs[0].ok and not first.inputs[1].ok and first.inputs[1].failed == 4
    assert first.inputs[1].analytic != pytest.approx(first.inputs[1].numeric, rel=1e-3)
    assert cg.per_node().node(first.key).parents[1] is g.params["scale"]  # (the graph checked)
    assert all(n.ok for n in result.nodes if n.op != "BadHypot")


# ---------------------------------------------------------------------------- the registry
@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((3, np.sin, None), {}, TypeError, "an op name must be a str, got int"),
        (("My Op", np.sin, None), {}, ValueError, "'My Op' is not an identifier"),
        (("Sq:2", np.sin, None), {}, ValueError, "cannot contain ':'"),
        (("Loop", np.sin, None), {}, ValueError, "'Loop' is reserved"),
        (("Input", np.sin, None), {}, ValueError, "'Input' is reserved"),
        (("Tanh", np.sin, None), {}, ValueError, "'Tanh' is a built-in op"),
        (("Tanh", np.sin, None), {"replace": True}, ValueError, "'Tanh' is a built-in op"),
        (("Custom", 3, None), {}, TypeError, "forward must be callable, got int"),
        (("Custom", np.sin, "g"), {}, TypeError, "VJP 0 must be callable or None"),
        (("Custom", np.sin), {}, ValueError, "give one VJP"),
        (("Custom", lambda x: x, lambda g, x: g), {}, TypeError, r"VJP 0 must take \(g, ans, x0\)"),
        (
            ("Custom", lambda x: x, None, None),
            {},
            TypeError,
            r"2 VJPs say the op has 2 inputs, but forward\(x\)",
        ),
        (("Custom", lambda x: x, lambda i, g, ans, *xs: g), {"variadic": True}, TypeError, "must take \\*xs"),
        (
            ("Custom", lambda *xs: xs[0], None),
            {"variadic": True},
            ValueError,
            "exactly one VJP function.*got None",
        ),
        (
            ("Custom", lambda *xs: xs[0], lambda g, ans: g),
            {"variadic": True},
            TypeError,
            r"\(i, g, ans, \*xs\)",
        ),
        (("Custom", np.sin, None), {"variadic": 1}, TypeError, "variadic must be a bool"),
        (("Custom", np.sin, None), {"replace": "yes"}, TypeError, "replace must be a bool"),
        # a VJP written for more inputs than the op has: its extra input could only be an
        # attribute, which forward (and so every call) cannot take
        (
            ("Custom", lambda x: 2 * x, lambda g, ans, x, y: g),
            {},
            ValueError,
            r"Custom: VJP 0\(g, ans, x, y\) needs 'y' besides \(g, ans, x0\), .*but forward\(x\) "
            r"cannot take it .*: the op has 1 input, one per VJP given to defop",
        ),
        (
            ("Custom", lambda x: 2 * x, lambda g, ans, x, y, /: g),
            {},
            ValueError,
            r"VJP 0\(g, ans, x, y, /\) needs 'y' besides \(g, ans, x0\), and nothing passes it",
        ),
        (
            ("Custom", lambda x, k: k * x, lambda g, ans, x: g),
            {},
            ValueError,
            r"forward\(x, k\) needs 'k' besides \(x0\), .*but VJP 0\(g, ans, x\) cannot take it",
        ),
        (  # one VJP for numpy's two-input hypot
            ("Custom", np.hypot, lambda g, ans, a, b: g * a / ans),
            {},
            ValueError,
            r"1 VJP says the op has 1 input, but forward is numpy's hypot, which takes 2",
        ),
        (
            ("Custom", lambda *xs: xs[0], lambda i, g, ans, x: g),
            {"variadic": True},
            ValueError,
            r"variadic op's VJP must take \(i, g, ans, \*xs\).*got vjp\(i, g, ans, x\)",
        ),
        (
            ("Custom", np.add, lambda i, g, ans, *xs: g),
            {"variadic": True},
            ValueError,
            r"forward must take \*xs, got numpy's add, which takes 2 inputs",
        ),
        (
            ("Custom", lambda *xs, k: k * xs[0], lambda i, g, ans, *xs: g),
            {"variadic": True},
            ValueError,
            r"forward\(\*xs, k\) needs 'k' besides \*xs, .*the VJP\(i, g, ans, \*xs\) cannot take it",
        ),
    ],
)
def test_defop_refuses_bad_definitions_and_registers_nothing(args, kwargs, error, match):
    before = dict(OPS)
    try:
        with pytest.raises(error, match=match) as info:
            vg.defop(*args, **kwargs)
    finally:  # (not to leave an op accepted by mistake in the table for later tests)
        if "Custom" in OPS and "Custom" not in before:
            vg.undefop("Custom")
    assert isinstance(info.value, vg.OpDefinitionError)  # typed, and both a ValueError and a TypeError
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    assert before == OPS


def test_defop_accepts_what_a_call_can_satisfy(defop):
    """Attributes that forward and every VJP take (required ones too), ``**attrs``, ``*xs``."""
    scale = defop("Scale", lambda x, *, k: k * x, lambda g, ans, x, *, k: k * g)
    times = defop(
        "Times",
        lambda a, b, by=1.0: by * a * b,
        lambda g, ans, *xs, **attrs: attrs.get("by", 1.0) * g * xs[1],
        None,
    )
    sum_k = defop(
        "SumK", lambda *xs, k: k * sum(xs), lambda i, g, ans, *xs, **attrs: attrs["k"] * g, variadic=True
    )
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.parameter(np.array([1.0, -2.0]), name="x")
    cg.backward(vg.sum(scale(x, k=3.0) + times(x, 2.0) + sum_k(x, x, k=0.5)))
    np.testing.assert_array_equal(x.grad, [3.0 + 2.0 + 1.0, 3.0 + 2.0 + 1.0])


def test_redefining_needs_replace_and_old_nodes_keep_the_old_definition(defop):
    f = defop("Twice", lambda x: 2 * x, lambda g, ans, x: 2 * g)
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.parameter(np.array([1.0, 2.0]))
    old = f(x)
    with pytest.raises(ValueError, match=r"already defined by an earlier vgraph\.defop; pass replace=True"):
        vg.defop("Twice", lambda x: 3 * x, lambda g, ans, x: 3 * g)
    assert OPS["Twice"] is old.op  # the failed call changed nothing
    g2 = defop("Twice", lambda x: 3 * x, lambda g, ans, x: 3 * g, replace=True)
    np.testing.assert_array_equal(f(x).value, [3.0, 6.0])  # the name now means the new op
    np.testing.assert_array_equal(g2(x).value, [3.0, 6.0])
    x.value = np.array([10.0, 20.0])
    np.testing.assert_array_equal(cg.forward(old), [20.0, 40.0])  # built before: old definition


def test_undefop_removes_only_user_ops(defop):
    f = defop("Gone", lambda x: x + 1, lambda g, ans, x: g)
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.parameter(np.ones(2))
    y = f(x)
    g = vg.VirtualGraph(dtype=F64)
    v = f(g.input("v", shape=(2,)))
    vg.undefop("Gone")
    assert "Gone" not in OPS
    with pytest.raises(vg.VGraphError, match="'Gone' is no longer defined"):
        f(x)
    assert repr(f) == "<vgraph op Gone (removed)>"
    cg.backward(y.sum())  # nodes already made keep working
    np.testing.assert_array_equal(x.grad, [1.0, 1.0])
    np.testing.assert_array_equal(g.build({"v": np.zeros(2)}, v).node(v).value, [1.0, 1.0])
    with pytest.raises(ValueError, match="'Tanh' is a built-in op of vgraph and cannot be removed"):
        vg.undefop("Tanh")
    with pytest.raises(ValueError, match="no op named 'Gone' was added"):
        vg.undefop("Gone")
    with pytest.raises(TypeError, match="name must be a str"):
        vg.undefop(None)


def test_calling_with_the_wrong_inputs(defop):
    hypot = defop("Hypot", np.hypot, hypot_vjp_a, hypot_vjp_b)
    cg = vg.ComputeGraph(dtype=F64)
    x = cg.parameter(np.ones(2))
    with pytest.raises(vg.ArgumentError, match=r"Hypot takes 2 inputs \(one per VJP given to defop\), got 1"):
        hypot(x)  # (an ArgumentError is a TypeError)
    with pytest.raises(vg.VGraphError, match="needs at least one graph node"):
        hypot(np.ones(2), 3.0)
    np.testing.assert_allclose(hypot(x, 3.0).value, np.hypot(1.0, 3.0))  # numbers become constants


# ---------------------------------------------------------------------------- what a custom op returns
def _three():
    cg = vg.ComputeGraph(dtype=F64)
    return cg, cg.parameter(np.array([0.5, -1.0, 2.0]), name="x")


@pytest.mark.parametrize(
    "wrong",
    [
        lambda g, ans, x: np.ones(5),  # another input's gradient, say: .grad would be (5,)
        lambda g, ans, x: (2 * g).sum(keepdims=True),  # (1,): numpy would spread it over all three
        lambda g, ans, x: 2 * g[None],  # (1, 3): unbroadcast would sum it to (3,), but x was not broadcast
    ],
    ids=["(5,)", "(1,)", "(1, 3)"],
)
def test_a_vjp_of_another_shape_than_its_inputs_is_refused_naming_node_input_and_shapes(defop, wrong):
    double = defop("Double", lambda x: 2 * x, wrong)
    cg, x = _three()
    y = double(x)
    got = np.shape(wrong(np.ones(3), None, None))
    with pytest.raises(
        vg.VJPShapeError,
        match=rf"^<Double:1>: the VJP of Double for input 0 <Parameter:1> 'x' returned a gradient of "
        rf"shape {re.escape(str(got))}; expected the input's shape \(3,\)$",
    ) as info:
        cg.backward(vg.sum(y))
    assert isinstance(info.value, vg.ShapeError) and isinstance(info.value, vg.BackwardError)
    assert x.grad is None  # the failed backward changed nothing
    result = vg.check_vjps(y, raise_on_failure=False)  # and check_vjps says the same
    assert result.first_failure.inputs[0].error == (
        f"the VJP returned a gradient of shape {got}; expected the input's shape (3,)"
    )


def test_a_broadcast_input_may_get_the_outputs_shape_and_nothing_else(defop):
    """``w`` of shape (3,) is broadcast against ``x`` (2, 3): its VJP may return (3,) or the output's
    (2, 3); a (1, 3), which numpy would also sum to (3,), is refused."""

    def scale_vjp_w(g, ans, x, w):
        return g * x  # the output's shape

    scale = defop("ScaleBy", np.multiply, lambda g, ans, x, w: g * w, scale_vjp_w)
    cg = vg.ComputeGraph(dtype=F64)
    x0 = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]])
    x = cg.input(x0, name="x", requires_grad=True)
    w = cg.parameter(np.array([0.5, -2.0, 1.5]), name="w")
    loss = vg.sum(scale(x, w) ** 2)
    cg.backward(loss)
    w_value = np.array([0.5, -2.0, 1.5])
    np.testing.assert_allclose(w.grad, (2 * x0**2 * w_value).sum(axis=0), rtol=1e-14)
    assert vg.gradcheck(loss, [x, w]).ok

    def rows_summed_vjp_w(g, ans, x, w):
        return (g * x).sum(axis=0, keepdims=True)  # (1, 3): neither w's shape nor the output's

    defop("ScaleBy", np.multiply, lambda g, ans, x, w: g * w, rows_summed_vjp_w, replace=True)
    cg.zero_grad()
    loss = vg.sum(scale(x, w) ** 2)
    with pytest.raises(
        vg.VJPShapeError,
        match=r"<ScaleBy:2>: the VJP of ScaleBy for input 1 <Parameter:1> 'w' returned a gradient of "
        r"shape \(1, 3\); expected the input's shape \(3,\) or, as the op broadcast the input, the "
        r"output's shape \(2, 3\)",
    ):
        cg.backward(loss)


def test_an_input_broadcast_along_a_middle_axis_gets_its_gradient_summed_back(defop):
    """A (2, 1) input against a (1, 3) one: each VJP returns the (2, 3) output's shape."""
    plus = defop("Plus", np.add, lambda g, ans, a, b: g, lambda g, ans, a, b: g)
    cg = vg.ComputeGraph(dtype=F64)
    a = cg.parameter(np.array([[1.0], [2.0]]), name="a")
    b = cg.parameter(np.array([[0.1, 0.2, 0.3]]), name="b")
    loss = vg.sum(plus(a, b) ** 2)
    cg.backward(loss)
    total = a.value + b.value
    np.testing.assert_allclose(a.grad, 2 * total.sum(axis=1, keepdims=True), rtol=1e-14)
    np.testing.assert_allclose(b.grad, 2 * total.sum(axis=0, keepdims=True), rtol=1e-14)
    assert vg.gradcheck(loss, [a, b]).ok and vg.check_vjps(loss).ok


@pytest.mark.parametrize(
    "vjp, what",
    [
        (
            lambda g, ans, x: (2 * g).astype(complex),
            "returned complex128 values; a gradient in vgraph is real",
        ),
        (lambda g, ans, x: np.array([object()] * 3), "returned object values"),
        (lambda g, ans, x: None, "returned None; to say 'no gradient', pass None in place of the VJP"),
        (lambda g, ans, x: [2.0, 2.0, 2.0], "returned a list, not a numpy array"),
    ],
    ids=["complex", "object", "None", "list"],
)
def test_a_vjp_that_returns_no_real_gradient_is_refused_naming_the_node(defop, vjp, what):
    double = defop("Double", lambda x: 2 * x, vjp)
    cg, x = _three()
    with pytest.raises(
        vg.BackwardError, match=rf"^<Double:1>: the VJP of Double for input 0 <Parameter:1> 'x' {what}"
    ):
        cg.backward(vg.sum(double(x)))
    assert x.grad is None


def test_a_variadic_vjp_is_checked_for_each_input(defop):
    def vjp(i, g, ans, *xs):
        return g if i == 0 else g[:1]  # wrong for input 1 only

    total = defop("Total", lambda *xs: sum(xs), vjp, variadic=True)
    cg, x = _three()
    y = cg.parameter(np.zeros(3), name="y")
    with pytest.raises(
        vg.VJPShapeError,
        match=r"<Total:1>: the VJP of Total for input 1 <Parameter:2> 'y' returned a gradient of shape \(1,\)",
    ):
        cg.backward(vg.sum(total(x, y)))


@pytest.mark.parametrize("result", [np.complex128, object])
def test_a_forward_that_returns_no_real_numbers_is_refused_naming_the_node_and_dtype(defop, result):
    as_ = defop("AsOther", lambda x: x.astype(result), lambda g, ans, x: g)
    cg, x = _three()
    n = len(cg)
    dtype = np.dtype(result)
    with pytest.raises(vg.DTypeError, match=rf"^<AsOther:1>: the forward of AsOther returned {dtype} values"):
        as_(x)
    assert len(cg) == n  # nothing was added
    g = vg.VirtualGraph(dtype=F64)
    xs = g.input("xs", shape=(None, 3))
    with g.loop(name="time") as L:
        h = L.carry(g.constant(np.zeros(3)), name="h")
        L.update(h, h + vg.abs(as_(L.step(xs))))
    with pytest.raises(vg.DTypeError, match=rf"<AsOther:1@0>: the forward of AsOther returned {dtype}"):
        g.build({"xs": np.ones((2, 3))}, L.final(h))


def test_only_ops_of_defop_are_checked(defop):
    """Built-in ops run their own functions, with no check in between: no cost per node."""
    soft = defop("Softsign", softsign, softsign_vjp)
    assert all(not op.user for name, op in OPS.items() if name != "Softsign")
    assert OPS["Tanh"].forward is np.tanh and OPS["Add"].vjps == (vg.ops.pass_through, vg.ops.pass_through)
    op = soft.op
    assert op.user and isinstance(op.forward, CheckedForward) and isinstance(op.vjps[0], CheckedVJP)
    assert op.forward.__wrapped__ is softsign and op.vjps[0].__wrapped__ is softsign_vjp


# ---------------------------------------------------------------------------- ... in a loop body
def _loop_with(op, steps=5):
    """``h <- tanh(op(x_t @ Wx) + h @ Wh)``: ``op`` reads the loop's hoisted ``x_t @ Wx``."""
    B, I, H = 2, 3, 4
    g = vg.VirtualGraph(dtype=F64, seed=0)
    xs = g.input("xs", shape=(None, B, I))
    Wx, Wh = g.parameter("Wx", (I, H)), g.parameter("Wh", (H, H))
    with g.loop(name="time") as L:
        h = L.carry(g.constant(np.zeros((B, H))), name="h")
        xw = L.step(xs) @ Wx
        u = op(xw)
        L.update(h, vg.tanh(u + h @ Wh))
    return g, (L.final(h) ** 2).mean(), xw, u


def _feed(steps, seed=0):
    return {"xs": np.random.default_rng(seed).standard_normal((steps, 2, 3))}


@pytest.mark.usefixtures("per_node")  # hoisting, compiled sweeps, resizing: the per-node path
@pytest.mark.parametrize("hoist", [True, False])
@pytest.mark.parametrize("taped", [True, False])
def test_a_custom_vjp_in_a_loop_body_is_checked_in_the_interpreted_and_the_compiled_sweep(
    defop, hoist, taped
):
    state = {"bad": False, "calls": 0}

    def vjp(g, ans, x):
        state["calls"] += 1
        d = g / (1 + np.abs(x)) ** 2
        return d[:1] if state["bad"] else d  # bad: one row, (1, 4), for a (2, 4) input

    g, loss, xw, u = _loop_with(defop("Softsign", softsign, vjp))
    previous = tape.tapes_enabled()
    tape.set_tapes(taped)
    try:
        cg = g.build(_feed(5), loss, hoist=hoist, cache=False)
        assert (cg.node(xw, (0,)).op is OPS["Hoisted"]) == hoist  # x_t @ Wx: a row of one product
        for _ in range(2):  # the first sweep is interpreted; with tapes, the second compiles one
            cg.forward()
            cg.backward(loss)
        compiled = cg._backward_tape is not None and isinstance(cg._backward_tape[1], tape.BackwardTape)
        assert compiled == taped
        assert vg.gradcheck(cg.node(loss), g.params.parameters()).ok
        grads = {k: np.array(p.grad) for k, p in g.params.items()}
        state.update(bad=True, calls=0)
        cg.forward()
        with pytest.raises(
            vg.VJPShapeError,
            match=rf"^<Softsign:{u.id}@4>: the VJP of Softsign for input 0 <MatMul:{xw.id}@4> returned "
            r"a gradient of shape \(1, 4\); expected the input's shape \(2, 4\)$",
        ):
            cg.backward(loss)
    finally:
        tape.set_tapes(previous)
    # the compiled sweep refused it too (then the interpreted one ran, to name the node)
    assert state["calls"] == (2 if taped else 1)
    assert all(np.array_equal(p.grad, grads[k]) for k, p in g.params.items())  # nothing half-added


@pytest.mark.usefixtures("per_node")  # hoisting, compiled sweeps, resizing: the per-node path
def test_a_custom_vjp_in_a_loop_resized_from_a_cached_build_is_checked(defop):
    """A cached graph resized to a shorter sequence sweeps with the tapes it keeps per part."""
    g, loss, xw, u = _loop_with(
        defop("Softsign", softsign, lambda g, ans, x: (g / (1 + np.abs(x)) ** 2).sum(0, keepdims=True))
    )
    g.build(_feed(5), loss)  # the first sighting of the structure: not kept
    node = g.build(_feed(6), loss).node(u, (1,))  # kept
    cg = g.build(_feed(4, seed=1), loss)
    assert cg.node(u, (1,)) is node  # resized, not unrolled again
    with pytest.raises(
        vg.VJPShapeError, match=rf"^<Softsign:{u.id}@3>: .* returned a gradient of shape \(1, 4\)"
    ):
        cg.backward(loss)


# ---------------------------------------------------------------------------- declared elementwise
# vgraph.defop(..., elementwise=True): the op takes part in hoisting, autobatching (rows of
# different lengths concatenated too) and declared shapes, like the built-in elementwise ops.


def _elementwise_rnn():
    """An RNN whose body applies Softsign to carry-independent work (hoistable: ``soft(x_t * s)``)
    and to the carried state (per iteration); Hypot mixes the two."""
    g = vg.VirtualGraph(seed=3)
    xs = g.input("xs", (None, 2, 3))
    s = g.parameter("s", (3,), init=vg.nn.init.normal(1.0))
    W = g.parameter("W", (3, 3), init="orthogonal")
    soft, hypot = vg.functions.OpFunction("Softsign"), vg.functions.OpFunction("Hypot")
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 3)), name="h")
        a = soft(x * s)  # depends on no carry: hoisted when Softsign is declared elementwise
        b = hypot(a, s)  # idem, broadcasting s
        h_new = soft(b @ W + h)
        L.update(h, h_new)
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(a))
    return g, loss, a, b


def _built(g, feed, loss, hoist):
    cg = g.build(feed, loss, hoist=hoist, cache=False)
    for n in cg.nodes():
        if n.requires_grad:
            n.retain_grad()
    g.params.zero_grad()
    value = cg.backward(loss)
    return cg, value, {k: np.array(p.grad) for k, p in g.params.items()}


@pytest.mark.usefixtures("per_node")  # hoisting, compiled sweeps, resizing: the per-node path
@pytest.mark.parametrize("declared", [True, False])
def test_a_custom_elementwise_op_is_hoisted_and_equals_the_plain_unroll(defop, float64, declared):
    defop("Softsign", softsign, softsign_vjp, elementwise=declared)
    defop("Hypot", np.hypot, hypot_vjp_a, hypot_vjp_b, elementwise=declared)
    g, loss, a, b = _elementwise_rnn()
    feed = {"xs": np.random.default_rng(1).standard_normal((5, 2, 3))}
    plain, v_plain, g_plain = _built(g, feed, loss, hoist=False)
    hoisted, v_hoisted, g_hoisted = _built(g, feed, loss, hoist=True)
    groups = {k for k in hoisted._nodes if k.type.endswith("*")}
    custom = {"Softsign*", "Hypot*", "MatMul*"}  # (b @ W is hoisted once Hypot is)
    assert {k.type for k in groups} == {"Item*", "Mul*"} | (custom if declared else set())
    assert set(hoisted._nodes) - groups == set(plain._nodes)  # every key, and no other
    assert v_hoisted == pytest.approx(v_plain, rel=1e-12, abs=0)
    for k in g_plain:
        np.testing.assert_allclose(g_hoisted[k], g_plain[k], rtol=1e-12, atol=1e-12, err_msg=k)
    for key, p in plain._nodes.items():
        h = hoisted.node(key)
        if key.type in ("Softsign", "Mul"):  # correctly rounded arithmetic on the same numbers: bitwise
            assert np.array_equal(h.value, p.value), key
        np.testing.assert_allclose(h.value, p.value, rtol=1e-12, atol=1e-12, err_msg=str(key))
        if p.grad is not None and p.op is not None:
            np.testing.assert_allclose(h.grad, p.grad, rtol=1e-12, atol=1e-12, err_msg=str(key))
    if declared:  # the copies are rows of the group, computed by the checked wrappers
        group = next(n for k, n in hoisted._nodes.items() if k.type == "Softsign*")
        assert isinstance(group.op.forward, CheckedForward)
        assert all(isinstance(f, CheckedVJP) for f in group.vjps)
        assert np.array_equal(hoisted.node(a, (3,)).value, group.value[3])


@pytest.mark.parametrize("lengths", [(4, 4, 4), (5, 2, 7, 3)])
@pytest.mark.parametrize("declared", [True, False])
def test_a_custom_elementwise_op_is_batched_and_equals_one_input_at_a_time(defop, float64, lengths, declared):
    defop("Softsign", softsign, softsign_vjp, elementwise=declared)
    defop("Hypot", np.hypot, hypot_vjp_a, hypot_vjp_b, elementwise=declared)
    rng = np.random.default_rng(4)
    feeds = [{"xs": rng.standard_normal((n, 2, 3))} for n in lengths]
    g1, loss1, _, _ = _elementwise_rnn()
    total = 0.0
    for feed in feeds:
        total += g1.build(feed, loss1, cache=False).backward(loss1)
    for hoist, programs in itertools.product((True, False), (True, False)):
        g2, loss2, _, _ = _elementwise_rnn()
        batch = g2.build_batch(feeds, loss2, hoist=hoist, programs=programs)
        assert batch.backward("sum") == pytest.approx(total, rel=1e-12, abs=0)
        for k, p in g1.params.items():
            np.testing.assert_allclose(g2.params[k].grad, p.grad, rtol=1e-12, atol=1e-12, err_msg=k)
        # a declared op lets the loop run as one program over every input's rows
        assert bool(batch.rows_programs) == (programs and declared)
        if not batch.rows_programs:
            sizes = [n for k, n in batch.groups if k.split(":")[0].rstrip("*") == "Softsign"]
            # grouped across inputs (the carried Softsign in lockstep; the hoisted one concatenated)
            assert (max(sizes) == len(lengths)) if declared else (max(sizes) == 1), batch.groups


def test_a_custom_elementwise_op_has_a_declared_shape(defop):
    soft = defop("Softsign", softsign, softsign_vjp, elementwise=True)
    hypot = defop("Hypot", np.hypot, hypot_vjp_a, hypot_vjp_b, elementwise=True)
    opaque = defop("Opaque", softsign, softsign_vjp)
    g = vg.VirtualGraph()
    x = g.input("x", (None, 3))
    b = g.parameter("b", (3,))
    assert soft(x).shape == (None, 3)
    assert hypot(b, soft(x)).shape == (None, 3)  # broadcast, as numpy
    assert opaque(x).shape is None  # nothing promised: unknown


def test_elementwise_must_be_a_bool(defop):
    with pytest.raises(vg.OpDefinitionError, match="elementwise must be a bool, got str"):
        defop("Softsign", softsign, softsign_vjp, elementwise="yes")
    assert "Softsign" not in OPS


def _centre(x):  # NOT elementwise: subtracts the mean over axis 0
    return x - x.mean(axis=0)


def _centre_vjp(g, ans, x):
    return g - g.mean(axis=0)


def test_an_op_falsely_declared_elementwise_computes_wrong_values_and_anomaly_mode_says_so(defop, float64):
    """The promise is the user's: vgraph does not check it on the normal path, and a grouped call
    computes something else (the mean over the iterations, not over the batch). Under anomaly
    detection the first group compares one copy with the op run alone and refuses the op."""
    centre = defop("Centre", _centre, _centre_vjp, elementwise=True)
    g = vg.VirtualGraph(seed=0)
    xs = g.input("xs", (None, 2, 3))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 3)), name="h")
        c = centre(L.step(xs))
        L.update(h, h + c)
    loss = vg.sum(L.final(h) ** 2)
    feed = {"xs": np.random.default_rng(0).standard_normal((4, 2, 3))}
    plain = g.build(feed, loss, hoist=False)
    hoisted = g.build(feed, loss, hoist=True)
    assert not np.allclose(hoisted.node(c, (0,)).value, plain.node(c, (0,)).value)  # what goes wrong
    with pytest.raises(
        vg.OpDefinitionError,
        match=rf"^<Centre:{c.id}@0>: Centre was declared elementwise \(vgraph\.defop\(\.\.\., elementwise=True\)\)",
    ):
        g.build(feed, loss, hoist=True, detect_anomaly=True)
    assert g.build(feed, loss, hoist=False, detect_anomaly=True).node(c, (0,)).value.shape == (2, 3)
    feeds = [feed, {"xs": np.random.default_rng(1).standard_normal((4, 2, 3))}]
    for hoist in (True, False):
        with (
            vg.detect_anomaly(),
            pytest.raises(vg.OpDefinitionError, match=r"Centre was declared elementwise"),
        ):
            g.build_batch(feeds, loss, hoist=hoist)


_ATTRS = {"Pow": {"p": 3.0}, "Clip": {"lo": 0.2, "hi": 0.9}}


@pytest.mark.parametrize(
    "name", sorted(n for n, op in OPS.items() if op.kind in ("elementwise", "along_axis", "reduction"))
)
def test_every_builtin_op_honours_its_declared_kind(name):
    """Run on copies stacked along a new leading axis, with the attributes batched_attrs gives,
    an op declared elementwise, along an axis or a reduction gives each copy's own value."""
    from vgraph.virtual.hoist import batched_attrs

    op = OPS[name]
    rng = np.random.default_rng(0)
    copies = [[rng.uniform(0.1, 2.0, size=(2, 3)) for _ in range(op.arity)] for _ in range(4)]
    if name == "Where":  # a mask first
        for xs in copies:
            xs[0] = xs[0] > 1.0
    attr_sets = [_ATTRS.get(name, {})]
    if op.kind != "elementwise":
        attr_sets = [{}, {"axis": 0}, {"axis": -1}, {"axis": 1, "keepdims": True}]
        if op.kind == "reduction" and name not in ("ArgMax", "ArgMin"):
            attr_sets.append({"axis": (0, 1)})
        if op.kind == "along_axis":
            attr_sets = [a for a in attr_sets if "keepdims" not in a]
    for attrs in attr_sets:
        grouped = batched_attrs(op, attrs, [(2, 3)] * op.arity, [True] * op.arity, 4)
        if name in ("ArgMax", "ArgMin") and attrs.get("axis") is None:
            assert grouped is None  # a flat index over several axes: numpy's argmax takes one axis
            continue
        assert grouped is not None, attrs
        stacked = [np.stack([xs[i] for xs in copies]) for i in range(op.arity)]
        together = op.forward(*stacked, **grouped)
        for r, xs in enumerate(copies):
            np.testing.assert_array_equal(together[r], op.forward(*xs, **attrs), err_msg=f"{name} {attrs}")


def test_the_table_refuses_an_unknown_kind():
    with pytest.raises(vg.OpDefinitionError, match=r"Bogus: kind must be None or one of 'elementwise'"):
        vg.ops.defop("Bogus", np.negative, lambda g, ans, x: -g, kind="rowwise")
    with pytest.raises(vg.OpDefinitionError, match=r"Bogus: a variadic op can only be elementwise"):
        vg.ops.defop("Bogus", lambda *xs: xs[0], lambda i, g, ans, *xs: g, variadic=True, kind="reduction")
    assert "Bogus" not in OPS
