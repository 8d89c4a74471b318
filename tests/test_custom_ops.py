"""User-defined primitives: vgraph.defop / undefop, on compute and virtual nodes, checked by
finite differences (gradcheck, check_vjps) in float64."""

from __future__ import annotations

import numpy as np
import pytest

import vgraph as vg
from vgraph import NodeKey
from vgraph.functions import OpFunction
from vgraph.ops import OPS

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
    assert cg.node(first.key).parents[1] is g.params["scale"]
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
    ],
)
def test_defop_refuses_bad_definitions_and_registers_nothing(args, kwargs, error, match):
    before = dict(OPS)
    with pytest.raises(error, match=match):
        vg.defop(*args, **kwargs)
    assert before == OPS


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
    with pytest.raises(TypeError, match=r"Hypot takes 2 inputs \(one per VJP given to defop\), got 1"):
        hypot(x)
    with pytest.raises(vg.VGraphError, match="needs at least one graph node"):
        hypot(np.ones(2), 3.0)
    np.testing.assert_allclose(hypot(x, 3.0).value, np.hypot(1.0, 3.0))  # numbers become constants
