"""API friction met while writing models (issue 14): inputs with gradients, untied copies set
before the first build, do-while loops, capped loops, reversed stepping, ``node.detach()``."""

from __future__ import annotations

import numpy as np
import pytest

import vgraph as vg


def test_gradient_with_respect_to_an_input():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (3,), requires_grad=True)
    W = g.parameter("W", (3, 2))
    loss = vg.sum(vg.tanh(x @ W) ** 2)
    xv = np.array([0.3, -0.2, 0.5])
    cg = g.build({"x": xv}, loss)
    cg.backward(loss)
    Wv = g.params["W"].value
    a = np.tanh(xv @ Wv)
    np.testing.assert_allclose(cg.inputs["x"].grad, Wv @ (2 * a * (1 - a**2)), rtol=1e-12)
    vg.gradcheck(cg.outputs[0], [cg.inputs["x"]])
    # without requires_grad, an input gets no gradient (and grad() says so)
    h = vg.VirtualGraph(dtype=np.float64)
    y = h.input("y", (3,))
    cg2 = h.build({"y": xv}, vg.sum(y * h.parameter("p", (3,))))
    with pytest.raises(vg.GraphStateError, match="does not require a gradient"):
        cg2.grad(cg2.outputs[0], [cg2.inputs["y"]])


def untied_depth():
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    x = g.input("x", (2,))
    with g.loop(times=3) as L:
        h = L.carry(x, name="h")
        W = g.parameter("W", (2, 2))  # untied: W@0, W@1, W@2
        L.update(h, vg.tanh(h @ W))
    return g, vg.sum(L.final(h))


def test_untied_copies_can_be_set_before_the_first_build():
    g, out = untied_depth()
    assert len(g.params) == 0
    eye = np.eye(2)
    for t in range(3):
        g.params.set_value(f"W@{t}", eye * (t + 1))
    cg = g.build({"x": np.array([0.1, 0.2])}, out)
    assert cg.node(g.nodes[[v.name for v in g.nodes].index("W")], (2,)).value[0, 0] == 3.0
    expected = np.array([0.1, 0.2])
    for t in range(3):
        expected = np.tanh(expected @ (eye * (t + 1)))
    np.testing.assert_allclose(cg.forward(), expected.sum(), rtol=1e-12)
    with pytest.raises(KeyError, match=r"'W@1\.2', which is not a parameter"):
        g.params.set_value("W@1.2", eye)  # one loop level, not two
    with pytest.raises(KeyError):
        g.params.set_value("V@0", eye)
    with pytest.raises(vg.ShapeError):
        g.params.set_value("W@5", np.ones(3))
    assert "W@5" not in g.params  # a refused value creates nothing


def halving(until=None, on_limit="raise", max_iters=100):
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    v = g.input("v", (2,))
    w = g.parameter("w", (2,), init=np.array([0.5, 0.8]))
    with g.loop(
        until=until, on_limit=on_limit, max_iters=max_iters, while_=None if until else (lambda t, s: True)
    ) as L:
        x = L.carry(v, name="x")
        L.update(x, x * w)
    return g, L, vg.sum(L.final(x))


def python_do_while(v, w, tol):
    x, n = np.array(v), 0
    while True:  # the body runs at least once
        x = x * w
        n += 1
        if np.abs(x).max() < tol:
            return x, n


def test_until_is_a_do_while_on_the_updated_state():
    g, L, out = halving(until=lambda t, s: np.abs(s["x"]).max() < 0.01)
    v = np.array([1.0, 2.0])
    cg = g.build({"v": v}, out)
    x, n = python_do_while(v, np.array([0.5, 0.8]), 0.01)
    assert cg.trip_count(L) == n
    np.testing.assert_allclose(cg.forward(), x.sum(), rtol=1e-12)
    # already below the tolerance: still one iteration (do-while), where while_ would run none
    tiny = np.array([1e-4, 1e-4])
    assert g.build({"v": tiny}, out).trip_count(L) == 1
    vg.gradcheck(g.build({"v": v}, out, cache=False).outputs[0], [g.params["w"]])


def test_until_decisions_are_rechecked_on_forward():
    g, L, out = halving(until=lambda t, s: np.abs(s["x"]).max() < 0.01)
    cg = g.build({"v": np.array([1.0, 2.0])}, out, cache=False)
    cg.feed({"v": np.array([100.0, 200.0])})
    with pytest.raises(vg.StructureChangedError, match=r"until|condition"):
        cg.forward()


def test_on_limit_stop_caps_the_loop_and_records_it():
    g, L, out = halving(on_limit="stop", max_iters=7)
    cg = g.build({"v": np.array([1.0, 1.0])}, out)
    assert cg.trip_count(L) == 7 and cg.capped(L)
    np.testing.assert_allclose(cg.forward(), (np.array([0.5, 0.8]) ** 7).sum(), rtol=1e-12)
    g2, L2, out2 = halving(max_iters=7)
    with pytest.raises(vg.LoopLimitError, match="max_iters=7"):
        g2.build({"v": np.array([1.0, 1.0])}, out2)
    with pytest.raises(ValueError, match="on_limit"):
        vg.VirtualGraph().loop(times=2, on_limit="ignore")
    with pytest.raises(TypeError, match="until"):
        vg.VirtualGraph().loop(until=3)


@pytest.mark.parametrize("hoist", [True, False])
def test_step_reverse_equals_stepping_through_the_reversed_sequence(hoist):
    def model(reverse):
        g = vg.VirtualGraph(dtype=np.float64, seed=2)
        xs = g.input("xs", (None, 2, 3))
        W = g.parameter("W", (3, 4))
        U = g.parameter("U", (4, 4))
        seq = xs if reverse else xs[::-1]
        with g.loop() as L:
            h = L.carry(np.zeros((2, 4)), name="h")
            h_new = vg.tanh(L.step(seq, reverse=reverse) @ W + h @ U)
            L.update(h, h_new)
        return g, vg.sum(L.stack(h_new) ** 2)

    xs = np.random.default_rng(0).normal(size=(5, 2, 3))
    results = []
    for reverse in (True, False):
        g, loss = model(reverse)
        cg = g.build({"xs": xs}, loss, hoist=hoist)
        value = cg.backward(loss)
        results.append((value, {k: np.array(p.grad) for k, p in g.params.items()}))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-12)
    for k in results[0][1]:
        np.testing.assert_allclose(results[0][1][k], results[1][1][k], rtol=1e-12)


def test_stepping_a_sequence_made_in_the_body_says_how_to_fix_it():
    g = vg.VirtualGraph()
    xs = g.input("xs", (None, 3))
    with g.loop(times=2) as L:
        h = L.carry(np.zeros(3))
        with pytest.raises(vg.BuildError, match=r"compute it before the loop's `with` block.*reverse=True"):
            L.step(xs[::-1])
        L.update(h, h)


def test_detach_method_on_virtual_and_compute_nodes():
    g = vg.VirtualGraph(dtype=np.float64)
    p = g.parameter("p", (2,), init=np.array([1.0, 2.0]))
    loss = vg.sum(p.detach() * p)  # d/dp = p (the detached factor is a constant)
    cg = g.build({}, loss)
    cg.backward(loss)
    np.testing.assert_allclose(g.params["p"].grad, [1.0, 2.0])
    c = vg.ComputeGraph(dtype=np.float64)
    q = c.parameter(np.array([3.0]))
    (grad,) = c.grad(vg.sum(q.detach() * q), [q])
    np.testing.assert_allclose(grad, [3.0])


def test_readable_reprs():
    g = vg.VirtualGraph(dtype=np.float64, seed=3, name="demo")
    xs = g.input("xs", (None, 2), requires_grad=True)
    W = g.parameter("W", (2, 2))
    with g.loop(name="time") as L:
        h = L.carry(np.zeros(2), name="h")
        V = g.parameter("V", (2, 2))  # untied
        L.update(h, vg.tanh(L.step(xs) @ W + h @ V))
    out = g.branch(lambda s: int(s > 0), [L.final(h), -L.final(h)], keys=[vg.sum(L.final(h))])
    text = repr(g)
    for part in ["VirtualGraph 'demo' (float64, seed 3, training", "xs: (None, 2), requires_grad",
                 "W: (2, 2)", "V: (2, 2), untied in <Loop:1> 'time' (0 copies so far)",
                 "<Loop:1> 'time': steps through <Input:1> 'xs'; carries h", "<Branch:1>: 2 options"]:  # fmt: skip
        assert part in text, (part, text)
    cg = g.build({"xs": np.ones((3, 2))}, vg.sum(out))
    text = repr(cg)
    assert f"UnrolledGraph of 'demo': {len(cg)} nodes" in text
    assert "<Loop:1> 'time' ran 3 iterations" in text and "<Branch:1> chose option" in text
    assert repr(g.params).startswith("ParameterStore(4 parameters, 16 values: W (2, 2), V@0 (2, 2)")
    assert repr(vg.ComputeGraph()) == "ComputeGraph(0 nodes: 0 leaves, 0 ops; float32)"
