"""The fused ``Linear`` op (``nn.Linear``'s default, :func:`vgraph.functions.linear`): one node
whose value is the product with the bias added into it — one array the size of the output where
``x @ W + b`` keeps two — with the same values and gradients as ``MatMul`` then ``Add`` to the last
bit; loops hoist it and ``build_batch`` groups it as they do ``x @ W``. (Gradients against finite
differences: tests/test_ops.py, the ``Linear`` cases.)"""

from __future__ import annotations

import numpy as np
import pytest

import vgraph as vg
from vgraph import nn

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def types(cg):
    return {n.key.type for n in cg.nodes()}


def run(cg, g):
    g.params.zero_grad()
    value = cg.backward(cg.outputs[0])
    return value, {k: np.array(p.grad) for k, p in g.params.items()}


def layer_model(shape, fused):
    g = vg.VirtualGraph(seed=4)
    x = g.input("x", shape)
    lin = nn.Linear(g, shape[-1], 6, "lin", fused=fused)
    return g, vg.sum(vg.tanh(lin(x)) ** 2)


@pytest.mark.parametrize("shape", [(5, 3), (4, 5, 3), (3,)], ids=str)
def test_fused_and_unfused_layers_agree_bit_for_bit(shape):
    x = np.random.default_rng(0).normal(size=shape)
    results = {}
    for fused in (True, False):
        g, loss = layer_model(shape, fused)
        cg = g.build({"x": x}, loss)
        assert ("Linear" in types(cg)) == fused and ("Add" in types(cg)) != fused
        results[fused] = (np.array(cg.outputs[0].value), *run(cg, g))
    (v1, l1, g1), (v2, l2, g2) = results[True], results[False]
    np.testing.assert_array_equal(v1, v2)
    assert l1 == l2
    for k in g1:
        np.testing.assert_array_equal(g1[k], g2[k], err_msg=k)


def test_the_fused_layer_keeps_one_value_the_size_of_its_output():
    x = np.random.default_rng(1).normal(size=(50, 3))
    kept = {}
    for fused in (True, False):
        g, loss = layer_model(x.shape, fused)
        cg = g.build({"x": x}, loss)
        kept[fused] = sum(1 for n in cg.nodes() if n.op is not None and n.shape == (50, 6))
    # fused: the layer, its tanh and their square; unfused: the product and the sum in its place
    assert (kept[True], kept[False]) == (3, 4)


def test_a_layer_without_bias_is_a_plain_product():
    g = vg.VirtualGraph(seed=0)
    x = g.input("x", (2, 3))
    lin = nn.Linear(g, 3, 4, "lin", bias=False)
    cg = g.build({"x": np.ones((2, 3))}, vg.sum(lin(x)))
    assert "MatMul" in types(cg) and "Linear" not in types(cg)


def loop_model(fused):
    g = vg.VirtualGraph(seed=2)
    xs = g.input("xs", (None, 2, 3))
    lin = nn.Linear(g, 3, 4, "lin", fused=fused)
    U = g.parameter("U", (4, 4))
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 4)), name="h")
        L.update(h, vg.tanh(lin(x) + h @ U))
    return g, vg.sum(L.final(h) ** 2)


@pytest.mark.usefixtures("per_node")  # hoisting: the per-node path
@pytest.mark.parametrize("tapes", [True, False])
def test_in_a_loop_it_is_hoisted_and_equals_the_plain_unroll(tapes):
    xs = np.random.default_rng(3).normal(size=(7, 2, 3))
    previous = vg.tape.tapes_enabled()
    vg.tape.set_tapes(tapes)
    try:
        results = {}
        for hoist in (True, False):
            g, loss = loop_model(fused=True)
            cg = g.build({"xs": xs}, loss, hoist=hoist, cache=False)
            assert ("Linear*:1" in cg) == hoist  # one group for every iteration's x_t @ W + b
            assert cg.node("Linear:1@4").value.shape == (2, 4)  # each iteration keeps its node
            for _ in range(2):  # a second sweep runs compiled when tapes are on
                cg.feed({"xs": xs})
                cg.forward(cg.outputs[0])
                results[hoist] = run(cg, g)
        g_unfused, loss_unfused = loop_model(fused=False)
        reference = run(g_unfused.build({"xs": xs}, loss_unfused, hoist=False, cache=False), g_unfused)
        for got in (results[True], results[False]):
            np.testing.assert_allclose(got[0], reference[0], rtol=1e-12)
            for k in reference[1]:
                np.testing.assert_allclose(got[1][k], reference[1][k], rtol=1e-12, atol=1e-14, err_msg=k)
    finally:
        vg.tape.set_tapes(previous)


def test_a_bias_of_another_shape_is_a_shape_error_that_names_the_node():
    cg = vg.ComputeGraph()
    x, w = cg.input(np.ones((2, 3))), cg.parameter(np.ones((3, 4)))
    b = cg.parameter(np.ones(3))
    with pytest.raises(vg.ShapeError, match=r"Linear:1.*bias has shape \(3,\)"):
        vg.functions.linear(x, w, b)
    assert len(cg) == 3  # the failed op added nothing


def test_a_loop_with_a_layer_resizes_and_checkpoints_as_the_plain_unroll():
    # A layer in the loop body (hoisted): cached builds at new lengths (elastic resizes) and a
    # checkpointed loop (values dropped and recomputed) give the plain unroll's results.
    rng = np.random.default_rng(5)
    feeds = [{"xs": rng.normal(size=(T, 2, 3))} for T in (6, 6, 4, 7, 3, 6)]

    def results(**build):
        g, loss = loop_model(fused=True)
        out = []
        for f in feeds:
            cg = g.build(f, loss, **build)
            out.append(run(cg, g))
        return out

    reference = results(cache=False, hoist=False)
    g_ck = vg.VirtualGraph(seed=2)
    xs = g_ck.input("xs", (None, 2, 3))
    lin = nn.Linear(g_ck, 3, 4, "lin")
    U = g_ck.parameter("U", (4, 4))
    with g_ck.loop(checkpoint=2) as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 4)), name="h")
        L.update(h, vg.tanh(lin(x) + h @ U))
    loss_ck = vg.sum(L.final(h) ** 2)
    checkpointed = [run(g_ck.build(f, loss_ck), g_ck) for f in feeds]
    for got in (results(), checkpointed):
        for (v1, g1), (v2, g2) in zip(got, reference):
            np.testing.assert_allclose(v1, v2, rtol=1e-12)
            for k in g2:
                np.testing.assert_allclose(g1[k], g2[k], rtol=1e-12, atol=1e-14, err_msg=k)


@pytest.mark.parametrize(
    "shapes, stacked",
    [
        ([(2, 3), (3, 4), (4,)], [True, False, False]),  # rows of the input (hoisting x_t @ W + b)
        ([(3,), (3, 4), (4,)], [True, False, False]),
        ([(2, 3), (3, 4), (4,)], [False, True, False]),  # a weight per copy, the input shared
        ([(2, 3), (3, 4), (2, 4)], [True, True, False]),
        ([(2, 3), (3, 4), (4,)], [True, False, True]),  # a bias per copy: not grouped
    ],
    ids=["rows", "vector-rows", "weights", "both", "bias-per-copy"],
)
def test_grouped_layers_give_each_copys_value_exactly(shapes, stacked):
    # hoist.batched_attrs groups Linear as it groups the product, the bias shared: the grouped op's
    # value along the new axis is every copy's own value (to rounding: one product over the rows
    # may run another BLAS kernel than each copy's, as for MatMul).
    from vgraph.ops import OPS
    from vgraph.virtual.hoist import batched_attrs

    count = 3
    attrs = batched_attrs(OPS["Linear"], {}, shapes, stacked, count)
    assert (attrs is None) == stacked[2]
    if attrs is None:
        return
    rng = np.random.default_rng(0)
    copies = [[rng.normal(size=s) for s in shapes] for _ in range(count)]
    grouped = [np.stack([c[k] for c in copies]) if st else copies[0][k] for k, st in enumerate(stacked)]
    value = OPS["Linear"].forward(*grouped, **attrs)
    for i, c in enumerate(copies):
        own = [c[k] if st else copies[0][k] for k, st in enumerate(stacked)]
        np.testing.assert_allclose(value[i], own[0] @ own[1] + own[2], rtol=1e-12, atol=1e-15)
