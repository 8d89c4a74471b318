"""Lazy gradient contributions (issue 10 §2 and §4): stepping through a sequence and the weight
gradients of a tied parameter cost O(T), not O(T^2) — checked by counting the full-size
gradient arrays the backward sweep creates, not by timing."""

from __future__ import annotations

import numpy as np
import pytest

import vgraph as vg
from vgraph import ops


def stepped_rnn(T, project_outside):
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2, 3))
    Wx = g.parameter("Wx", (3, 4))
    Wh = g.parameter("Wh", (4, 4))
    seq = xs @ Wx if project_outside else xs  # loop.step(x @ W_x): the sequence needs a gradient
    with g.loop() as L:
        x = L.step(seq)
        h = L.carry(np.zeros((2, 4)), name="h")
        pre = x + h @ Wh if project_outside else x @ Wx + h @ Wh
        L.update(h, vg.tanh(pre))
    loss = vg.sum(L.final(h) ** 2)
    return g, loss, {"xs": np.random.default_rng(T).normal(size=(T, 2, 3))}


@pytest.fixture
def counts(monkeypatch):
    seen = {"indexed_full": 0, "rows_products": []}
    dense, rows_dense = ops.IndexedGrad.dense, ops.RowsProductGrad.dense

    def counting_dense(self):  # every full-size array an IndexedGrad makes (merge uses it too)
        seen["indexed_full"] += 1
        return dense(self)

    def counting_rows(self):
        seen["rows_products"].append(len(self.a))
        return rows_dense(self)

    monkeypatch.setattr(ops.IndexedGrad, "dense", counting_dense)
    monkeypatch.setattr(ops.RowsProductGrad, "dense", counting_rows)
    return seen


@pytest.mark.parametrize("T", [10, 80])
def test_stepping_through_a_sequence_fills_one_gradient_buffer(counts, T):
    g, loss, feed = stepped_rnn(T, project_outside=True)
    cg = g.build(feed, loss, hoist=False)
    cg.backward(loss)
    # T per-step contributions land in one buffer: one full-size array, whatever T is.
    assert counts["indexed_full"] == 1
    # ... and the gradient is right (finite differences, float64).
    vg.gradcheck(cg.outputs[0], [g.params["Wx"], g.params["Wh"]])


@pytest.mark.parametrize("hoist", [False, True])
def test_a_tied_weight_gets_one_stacked_product(counts, hoist):
    T = 12
    g, loss, feed = stepped_rnn(T, project_outside=False)
    cg = g.build(feed, loss, hoist=hoist)
    cg.backward(loss)
    # W_h: T uses, one (4, T*2) @ (T*2, 4) product. W_x: T uses plain, one (T*2)-row use hoisted.
    assert sorted(counts["rows_products"]) == sorted([T, 1 if hoist else T])
    reference = g.build(feed, loss, hoist=hoist)
    for p in g.params.values():
        p.grad = None
    vg.gradcheck(reference.outputs[0], [g.params["Wx"], g.params["Wh"]])


def test_lazy_gradients_add_into_and_merge_like_dense_arrays():
    rng = np.random.default_rng(0)
    a1, g1, a2, g2 = (rng.normal(size=s) for s in [(5, 3), (5, 4), (2, 3), (2, 4)])
    rows = ops.RowsProductGrad(a1, g1).merge(ops.RowsProductGrad(a2, g2))
    np.testing.assert_allclose(rows.dense(), a1.T @ g1 + a2.T @ g2, rtol=1e-13)
    acc = np.ones((3, 4))
    rows.add_into(acc)
    np.testing.assert_allclose(acc, 1 + a1.T @ g1 + a2.T @ g2, rtol=1e-13)
    i1 = ops.IndexedGrad((4, 2), np.float64, 1, np.array([1.0, 2.0]), True)
    i2 = ops.IndexedGrad((4, 2), np.float64, np.array([1, 1, 3]), np.ones((3, 2)), False)
    expected = np.zeros((4, 2))
    expected[1] += [1.0, 2.0]
    expected[1] += 2
    expected[3] += 1
    np.testing.assert_array_equal(i1.merge(i2), expected)
    np.testing.assert_array_equal(ops.add_grads(np.ones((4, 2)), i1), 1 + i1.dense())
    np.testing.assert_array_equal(ops.add_grads(i1, np.ones((4, 2))), 1 + i1.dense())


@pytest.mark.parametrize("block_rows", [1, 4, 5, 9, 10_000])
def test_a_long_stack_of_weight_gradient_products_is_summed_in_blocks(monkeypatch, block_rows):
    """Many uses of a weight (a long loop): the stacked product is computed block by block, so
    its copies stay small; the sum is the same whatever the block (an independent reference)."""
    monkeypatch.setattr(ops.RowsProductGrad, "BLOCK_ROWS", block_rows)
    rng = np.random.default_rng(1)
    parts = [(rng.normal(size=(2, 3)), rng.normal(size=(2, 4))) for _ in range(7)]
    rows = ops.RowsProductGrad(*parts[0])
    for a, g in parts[1:]:
        rows = rows.merge(ops.RowsProductGrad(a, g))
    expected = sum(a.T @ g for a, g in parts)
    np.testing.assert_allclose(rows.dense(), expected, rtol=1e-12)


def test_a_bias_gradient_is_reduced_once_and_never_writes_into_a_contribution():
    """A leaf's gradient over leading (batch, iteration) axes is kept at full shape, added in
    place into a buffer of its own, and reduced when asked; the first contribution, which may be
    another node's gradient too, is copied rather than added into."""
    rng = np.random.default_rng(2)
    parts = [rng.normal(size=(3, 4)) for _ in range(5)]
    first = parts[0].copy()
    acc = ops.reduce_grad(parts[0], (4,), leaf=True)
    assert isinstance(acc, ops.LeadingSumGrad)
    for p in parts[1:]:
        acc = ops.add_grads(acc, ops.reduce_grad(p, (4,), leaf=True))
    np.testing.assert_allclose(acc.dense(), sum(p.sum(axis=0) for p in parts), rtol=1e-12)
    np.testing.assert_array_equal(parts[0], first)
    # not a leaf, a stretched axis, or another dtype: reduced at once / merged densely
    assert type(ops.reduce_grad(parts[0], (4,), leaf=False)) is np.ndarray
    assert type(ops.reduce_grad(parts[0], (1, 4), leaf=True)) is np.ndarray
    mixed = ops.reduce_grad(parts[1], (4,), leaf=True).merge(
        ops.reduce_grad(parts[2].astype(np.float32), (4,), leaf=True)
    )
    np.testing.assert_allclose(mixed, parts[1].sum(0) + parts[2].astype(np.float32).sum(0), rtol=1e-6)
