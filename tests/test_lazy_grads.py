"""Lazy gradient contributions (issue 10 §2 and §4): stepping through a sequence and the weight
gradients of a tied parameter cost O(T), not O(T^2) — checked by counting the full-size
gradient arrays the backward sweep creates, not by timing."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg
from vgraph import ops

pytestmark = pytest.mark.usefixtures("per_node")  # tests/conftest.py: of the per-node path


def as_dense(g):
    return g.dense() if isinstance(g, ops.LazyGrad) else g


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
    dense, steps_dense, rows_dense = ops.IndexedGrad.dense, ops.StepRowsGrad.dense, ops.RowsProductGrad.dense

    def counting_dense(self):  # every full-size array an IndexedGrad makes (merge uses it too)
        seen["indexed_full"] += 1
        return dense(self)

    def counting_steps(self):  # ... or the rows of several steps, collected (StepRowsGrad)
        seen["indexed_full"] += 1
        return steps_dense(self)

    def counting_rows(self):
        seen["rows_products"].append(len(self.a))
        return rows_dense(self)

    monkeypatch.setattr(ops.IndexedGrad, "dense", counting_dense)
    monkeypatch.setattr(ops.StepRowsGrad, "dense", counting_steps)
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


@pytest.mark.parametrize("n", [1, 2, 5, 100])
def test_a_bias_gradient_is_reduced_once_and_never_writes_into_a_contribution(n):
    """A leaf's gradient over leading (batch, iteration) axes is kept at full shape and reduced
    when asked; no contribution, which may be another node's gradient too, is written into;
    ``dense`` gives a new array each time, and asking for it changes nothing."""
    rng = np.random.default_rng(2)
    parts = [rng.normal(size=(3, 4)) for _ in range(n)]
    originals = [p.copy() for p in parts]
    acc = ops.reduce_grad(parts[0], (4,), leaf=True)
    assert isinstance(acc, ops.LeadingSumGrad)
    for p in parts[1:]:
        acc = ops.add_grads(acc, ops.reduce_grad(p, (4,), leaf=True))
    expected = sum(p.sum(axis=0) for p in parts)
    first = acc.dense()
    np.testing.assert_allclose(first, expected, rtol=1e-12)
    for p, o in zip(parts, originals):
        np.testing.assert_array_equal(p, o)
    first += 1.0  # the caller owns what dense gave
    np.testing.assert_allclose(acc.dense(), expected, rtol=1e-12)
    # a contribution already asked for its dense value (anomaly mode checks each) merges as well
    other = ops.reduce_grad(parts[0], (4,), leaf=True)
    other.dense()
    np.testing.assert_allclose(acc.merge(other).dense(), expected + parts[0].sum(0), rtol=1e-12)
    # not a leaf, a stretched axis, or another dtype: reduced at once / merged densely
    assert type(ops.reduce_grad(parts[0], (4,), leaf=False)) is np.ndarray
    assert type(ops.reduce_grad(parts[0], (1, 4), leaf=True)) is np.ndarray
    a, b = rng.normal(size=(2, 3, 4))
    mixed = ops.reduce_grad(a, (4,), leaf=True).merge(ops.reduce_grad(b.astype(np.float32), (4,), leaf=True))
    np.testing.assert_allclose(mixed, a.sum(0) + b.astype(np.float32).sum(0), rtol=1e-6)


def test_a_bias_gradient_from_contributions_of_several_shapes():
    rng = np.random.default_rng(4)
    parts = [rng.normal(size=s) for s in [(3, 4), (3, 4), (2, 5, 4), (3, 4), (7, 4)]]
    acc = ops.reduce_grad(parts[0], (4,), leaf=True)
    for p in parts[1:]:
        acc = ops.add_grads(acc, ops.reduce_grad(p, (4,), leaf=True))
    np.testing.assert_allclose(as_dense(acc), sum(p.reshape(-1, 4).sum(0) for p in parts), rtol=1e-12)


@pytest.mark.parametrize("order", ["reverse", "forward", "shuffled", "missing", "repeated"])
def test_the_rows_of_a_hoisted_group_gradient(order):
    """A hoisted group's per-iteration gradients, in whatever order, with rows missing or repeated,
    add up like an independent dense reference."""
    rng = np.random.default_rng(3)
    T = 6
    rows = {t: rng.normal(size=(2, 3)) for t in range(T)}
    index = {
        "reverse": list(range(T - 1, -1, -1)),
        "forward": list(range(T)),
        "shuffled": [3, 0, 5, 1, 4, 2],
        "missing": [5, 4, 2, 0],
        "repeated": [5, 4, 4, 3, 2, 1, 0],
    }[order]
    acc = ops._hoisted_vjp(rows[index[0]], None, np.zeros((T, 2, 3)), index[0])
    for t in index[1:]:
        acc = ops.add_grads(acc, ops._hoisted_vjp(rows[t], None, np.zeros((T, 2, 3)), t))
    expected = np.zeros((T, 2, 3))
    for t in index:
        expected[t] += rows[t]
    np.testing.assert_array_equal(as_dense(acc), expected)
    into, expected_into = np.ones((T, 2, 3)), np.ones((T, 2, 3))
    into = ops.add_grads(into, acc)
    for t in index:
        expected_into[t] += rows[t]
    np.testing.assert_allclose(into, expected_into, rtol=1e-12)  # sums in another order


# ---------------------------------------------------------------------------- transposed weights
# In a backward sweep, the gradient product g @ W.T of a weight used again and again (W_h in every
# iteration) multiplies by a C-contiguous copy of W.T made once (BLAS is markedly slower with a
# transposed operand at a recurrent step's sizes); ops._transposed keeps it for one sweep only.


def test_a_weights_transpose_is_copied_once_from_its_second_use_in_a_sweep():
    W = np.arange(12.0).reshape(3, 4).copy()
    assert ops._transposed(W).base is W  # outside a sweep: the plain view
    assert ops.TRANSPOSED_MIN_WORK > 16 * 32 * 32  # small products keep the plain view: no look-up
    with ops.sweep_scope():
        first = ops._transposed(W)
        second = ops._transposed(W)
        third = ops._transposed(W)
        assert first.base is W and not first.flags.c_contiguous  # used once: no copy
        assert second.base is None and second.flags.c_contiguous  # a copy ...
        assert third is second  # ... made once
        np.testing.assert_array_equal(second, W.T)
        with ops.sweep_scope():  # a nested sweep shares the outer one's copies
            assert ops._transposed(W) is second
        assert ops._sweep.transposes is not None
    assert ops._sweep.transposes is None  # dropped with the sweep: W may change before the next


def tied_weight_reference(Wh, Wx, xs):
    """Hand-written BPTT of sum(h_T ** 2), h_t = tanh(x_t Wx + h_{t-1} Wh), h_0 = 0 (float64)."""
    T, B, _ = xs.shape
    hs = [np.zeros((B, Wh.shape[0]))]
    for t in range(T):
        hs.append(np.tanh(xs[t] @ Wx + hs[-1] @ Wh))
    gh = 2 * hs[-1]
    gWh, gWx = np.zeros_like(Wh), np.zeros_like(Wx)
    for t in range(T - 1, -1, -1):
        ga = gh * (1 - hs[t + 1] ** 2)
        gWh += hs[t].T @ ga
        gWx += xs[t].T @ ga
        gh = ga @ Wh.T
    return gWh, gWx


@pytest.mark.parametrize("tapes", [False, True])
def test_gradients_through_transposed_weights_follow_each_new_value(tapes, monkeypatch):
    # Three backward sweeps of one graph (the second and third compiled when tapes are on), W_h
    # given a new value before each: every sweep must multiply by the transpose of the value it
    # sees, and leave no copy behind, also when a sweep fails.
    monkeypatch.setattr(ops, "TRANSPOSED_MIN_WORK", 0)  # this model's products are tiny
    copies = []
    transposed = ops._transposed

    def spy(b):
        t = transposed(b)
        copies.append(t.base is None)
        return t

    monkeypatch.setattr(ops, "_transposed", spy)
    g, loss, feed = stepped_rnn(6, project_outside=False)
    cg = g.build(feed, loss)
    rng = np.random.default_rng(3)
    previous = vg.tape.tapes_enabled()
    vg.tape.set_tapes(tapes)
    try:
        for _ in range(3):
            g.params["Wh"].value = rng.normal(size=(4, 4)) * 0.5
            cg.forward(cg.outputs[0])
            g.params.zero_grad()
            cg.backward(cg.outputs[0])
            want_h, want_x = tied_weight_reference(g.params.value("Wh"), g.params.value("Wx"), feed["xs"])
            np.testing.assert_allclose(g.params["Wh"].grad, want_h, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(g.params["Wx"].grad, want_x, rtol=1e-12, atol=1e-12)
            assert ops._sweep.transposes is None
            # g @ W_h.T in iterations 5..1 (h_0 is a constant): the first plain, the copy made once
            assert copies == [False, True, True, True, True]
            copies.clear()
        with pytest.raises(vg.GraphStateError):
            cg.backward(cg.outputs[0])  # released by the last backward
        assert ops._sweep.transposes is None
    finally:
        vg.tape.set_tapes(previous)


# ---------------------------------------------------------------------------- rows of steps
# The gradient of a hoisted group or of a stepped sequence arrives one whole row per iteration,
# last first: the rows are collected (ops.StepRowsGrad) and laid into one array at the end, equal
# to adding each into a zero-filled buffer.


def zero_buffer(shape, parts, start=0.0):
    out = np.full(shape, start)
    for r, g in parts:
        out[r] += g
    return out


@pytest.mark.parametrize(
    "rows",
    [[4, 3, 2, 1, 0], [0, 1, 2, 3, 4], [4, 2, 0], [3, 3, 1, 0, 2, 4], [-1, 3, 2, 1, 0], [4, 3, 2, 1, 0, 0]],
    ids=["last-first", "first-last", "some-missing", "one-twice", "negative", "all-and-one-again"],
)
def test_rows_of_steps_equal_a_zero_filled_buffer(rows):
    rng = np.random.default_rng(len(rows))
    shape = (5, 2, 3)
    parts = [(r, rng.normal(size=shape[1:])) for r in rows]
    merged = ops.IndexedGrad(shape, np.float64, parts[0][0], parts[0][1], True)
    for r, g in parts[1:]:
        merged = ops.add_grads(merged, ops.IndexedGrad(shape, np.float64, r, g, True))
    assert type(merged) is ops.StepRowsGrad  # whole rows: collected, not added up yet
    np.testing.assert_array_equal(merged.dense(), zero_buffer(shape, parts))
    acc = np.ones(shape)
    merged.add_into(acc)
    np.testing.assert_array_equal(acc, zero_buffer(shape, parts, start=1.0))


def test_anything_but_a_whole_row_of_the_same_dtype_is_added_up_as_before():
    shape = (3, 2)
    row = ops.IndexedGrad(shape, np.float64, 0, np.ones(2), True)
    for other in [
        ops.IndexedGrad(shape, np.float64, (1, 0), np.float64(2.0), True),  # one element
        ops.IndexedGrad(shape, np.float64, slice(1, 3), np.ones((2, 2)), True),  # two rows
        ops.IndexedGrad(shape, np.float32, 1, np.ones(2, np.float32), True),  # another dtype
    ]:
        got = ops.add_grads(row, other)
        assert type(got) is np.ndarray
        want = np.zeros(shape)
        row.add_into(want)
        other.add_into(want)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tapes", [False, True])
def test_a_stepped_sequences_gradient_is_collected_row_by_row(tapes, monkeypatch):
    collected = []
    dense = ops.StepRowsGrad.dense

    def spy(self):
        collected.append(len(self.rows))
        return dense(self)

    monkeypatch.setattr(ops.StepRowsGrad, "dense", spy)
    previous = vg.tape.tapes_enabled()
    vg.tape.set_tapes(tapes)
    try:
        for project_outside in (True, False):  # loop.step(x @ W_x) / a hoisted x_t @ W_x
            g, loss, feed = stepped_rnn(9, project_outside)
            cg = g.build(feed, loss, cache=False)
            for _ in range(2):  # the second sweep compiled when tapes are on
                cg.feed(feed)
                cg.forward(cg.outputs[0])
                g.params.zero_grad()
                cg.backward(cg.outputs[0])
            assert collected == [9, 9]
            collected.clear()
            want_h, want_x = tied_weight_reference(g.params.value("Wh"), g.params.value("Wx"), feed["xs"])
            np.testing.assert_allclose(g.params["Wh"].grad, want_h, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(g.params["Wx"].grad, want_x, rtol=1e-12, atol=1e-12)
    finally:
        vg.tape.set_tapes(previous)


@pytest.mark.parametrize(
    "index, distinct",
    [
        (np.array([2, 0, 3]), True),
        (np.array([2, 0, 2]), False),
        (np.array([3, 0, -1]), False),  # -1 is row 3 of 4
        (np.array([-4, 1]), True),
        ((1, np.array([0, 2])), True),  # slab 1, rows 0 and 2 (a fused cell's rows)
        ((1, np.array([2, -1])), False),  # -1 is row 2 of 3 along axis 1
        (np.array([1]), True),
    ],
    ids=["distinct", "repeated", "negative-repeat", "negative", "slab", "slab-repeat", "one"],
)
def test_an_integer_array_index_without_repeats_is_added_in_one_indexed_addition(index, distinct):
    shape = (4, 3, 2) if type(index) is not tuple else (6, 3, 2)
    assert ops._distinct_rows(index, shape) is distinct
    x = np.random.default_rng(0).normal(size=shape)
    g = np.random.default_rng(1).normal(size=x[index].shape)
    lazy = ops.OPS["GetItem"].vjps[0](g, x[index], x, index=index)
    assert lazy.basic is distinct
    want = np.zeros(shape)
    np.add.at(want, index, g)  # every repeat accumulates
    np.testing.assert_array_equal(lazy.dense(), want)


# A loop's gradient rows reach several collectors (a hoisted group or a stepped sequence, a tied
# weight, a bias); within one sweep the first to stack them makes the stack and the others read it
# (ops._rows_stack), as the floor computes all three weight gradients from one buffer.


@pytest.fixture
def stacks_made(monkeypatch):
    """Every look for a shared stack (``("read", found)``) and every stack asked to be made
    (``("own" or "make", found)``: for a collector's result, or to read), in order."""
    made = []
    shared_stack, rows_stack = ops._shared_stack, ops._rows_stack

    def reading(parts, dtype):
        found = shared_stack(parts, dtype)
        made.append(("read", found is not None))
        return found

    def making(parts, dtype, *, own):
        made.append(("own" if own else "make", ops._stack_entry(parts) is not None))
        return rows_stack(parts, dtype, own=own)

    monkeypatch.setattr(ops, "_shared_stack", reading)
    monkeypatch.setattr(ops, "_rows_stack", making)
    return made


def test_a_stack_of_gradient_rows_is_made_once_per_sweep_and_handed_out_once():
    rng = np.random.default_rng(5)
    parts = [rng.normal(size=(2, 3)) for _ in range(4)]
    outside = ops._rows_stack(list(parts), np.float64, own=False)
    assert ops._stack_entry(parts) is None  # outside a sweep nothing is kept
    with ops.sweep_scope():
        first = ops._rows_stack(list(parts), np.float64, own=False)
        assert ops._rows_stack(list(parts), np.float64, own=False) is first  # read again: shared
        assert ops._rows_stack(list(parts), np.float64, own=True) is first  # handed out once ...
        again = ops._rows_stack(list(parts), np.float64, own=True)
        assert again is not first  # ... a second owner gets its own
        # the same values in other arrays, another order, another dtype: not the same stack
        assert ops._rows_stack([*parts[:3], parts[3].copy()], np.float64, own=False) is not first
        assert ops._rows_stack([parts[0], parts[2], parts[1], parts[3]], np.float64, own=False) is not first
        single = ops._rows_stack(list(parts), np.float32, own=False)
        assert single is not first and single.dtype == np.float32
        assert ops._shared_stack(list(parts), np.float64) is first  # what readers read
        assert ops._shared_stack(list(parts), np.float32) is None  # not one of another dtype
        assert ops._shared_stack([*parts[:3], parts[3].copy()], np.float64) is None
        with ops.sweep_scope():  # a nested sweep keeps its own stacks, and the outer's stay
            assert ops._stack_entry(parts) is None
            assert ops._rows_stack(list(parts), np.float64, own=False) is not first
        assert ops._stack_entry(parts)[1] is first
    with ops.sweep_scope(), pytest.MonkeyPatch.context() as m:
        m.setattr(ops, "SHARED_STACK_BYTES", first.nbytes - 1)  # too large to keep for the sweep
        ops._rows_stack(list(parts), np.float64, own=True)
        assert ops._stack_entry(parts) is None
    assert ops._sweep.stacks is None and ops._sweep.transposes is None
    for s in (outside, first, again):
        np.testing.assert_array_equal(s, np.stack(parts))
    np.testing.assert_allclose(single, np.stack(parts), rtol=1e-6)


@pytest.mark.parametrize("block_rows", [1, 4, 6, 10_000])
def test_a_tied_weights_product_reads_the_shared_stack_of_its_gradient_rows(
    monkeypatch, stacks_made, block_rows
):
    """The rows stacked first to last by another collector (StepRowsGrad), read by a weight whose
    uses were collected last to first, in blocks of any size: the same sum (independent reference)."""
    monkeypatch.setattr(ops.RowsProductGrad, "BLOCK_ROWS", block_rows)
    rng = np.random.default_rng(6)
    T = 7
    a = [rng.normal(size=(2, 3)) for _ in range(T)]
    g = [rng.normal(size=(2, 4)) for _ in range(T)]
    with ops.sweep_scope():
        rows = ops.StepRowsGrad((T, 2, 4), np.float64, [T - 1], [g[T - 1]])
        product = ops.RowsProductGrad(a[T - 1], g[T - 1])
        for t in range(T - 2, -1, -1):  # a backward sweep's order
            rows = rows.merge(ops.IndexedGrad((T, 2, 4), np.float64, t, g[t], True))
            product = product.merge(ops.RowsProductGrad(a[t], g[t]))
        stacked = rows.dense()
        stacks_made.clear()
        got = product.dense()
    np.testing.assert_array_equal(stacked, np.stack(g))
    np.testing.assert_allclose(got, sum(x.T @ y for x, y in zip(a, g)), rtol=1e-12)
    assert stacks_made == [("read", True)]  # read from the stack, however many blocks: none made


def test_a_bias_gradient_keeps_bounded_memory(monkeypatch):
    """Past HELD_BYTES of contributions, a bias gradient adds them up into one array of its own
    (in the order they came, as one addition per use would); none is written into."""
    rng = np.random.default_rng(7)
    parts = [rng.normal(size=(3, 4)) for _ in range(10)]
    originals = [p.copy() for p in parts]
    monkeypatch.setattr(ops.LeadingSumGrad, "HELD_BYTES", 3 * parts[0].nbytes)
    acc = ops.reduce_grad(parts[0], (4,), leaf=True)
    for p in parts[1:]:
        assert acc.absorb(p)
        assert len(acc.parts) <= 3
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    np.testing.assert_allclose(acc.dense(), total.sum(0), rtol=1e-12)
    acc.compact()
    np.testing.assert_array_equal(acc.parts[0], total)  # the same additions, in the same order
    for p, o in zip(parts, originals):
        np.testing.assert_array_equal(p, o)


def elman(T, stepped_parameter, bias_last=True):
    """sum(h_T ** 2), h_t = tanh(x_t W_x + h_{t-1} W_h + b) (the benchmark's cell, float64); with
    ``stepped_parameter``, x_t W_x is a parameter stepped through (its gradient is a leaf's);
    ``bias_last=False`` writes the sum x_t W_x + (h_{t-1} W_h + b), which a build does not
    reassociate (b's gradient is then collected row by row)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2, 3))
    # declared first, so its turn in a backward sweep comes after W_h's and b's
    ps = g.parameter("ps", (T, 2, 4), init="normal") if stepped_parameter else None
    Wx = g.parameter("Wx", (3, 4))
    Wh = g.parameter("Wh", (4, 4))
    b = g.parameter("b", (4,), init="normal")
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        x = L.step(ps) if stepped_parameter else L.step(xs) @ Wx
        L.update(h, vg.tanh(x + h @ Wh + b if bias_last else x + (h @ Wh + b)))
    loss = vg.sum(L.final(h) ** 2)
    return g, loss, {} if stepped_parameter else {"xs": np.random.default_rng(T).normal(size=(T, 2, 3))}


def elman_reference(P, xs, stepped_parameter):
    """Hand-written BPTT of :func:`elman`: the gradients of its parameters."""
    pre = P["ps"] if stepped_parameter else xs @ P["Wx"]
    T = pre.shape[0]
    hs = [np.zeros((2, 4))]
    for t in range(T):
        hs.append(np.tanh(pre[t] + hs[-1] @ P["Wh"] + P["b"]))
    gh, gas = 2 * hs[-1], np.zeros((T, 2, 4))
    for t in range(T - 1, -1, -1):
        gas[t] = gh * (1 - hs[t + 1] ** 2)
        gh = gas[t] @ P["Wh"].T
    grads = {"Wh": sum(hs[t].T @ gas[t] for t in range(T)), "b": gas.sum((0, 1))}
    if stepped_parameter:
        grads["ps"] = gas
    else:
        grads["Wx"] = xs.reshape(-1, 3).T @ gas.reshape(-1, 4)
    return grads


@pytest.mark.parametrize("stepped_parameter, bias_last", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("tapes", [False, True])
def test_a_loops_weight_bias_and_sequence_gradients_share_one_stack(
    tapes, stepped_parameter, bias_last, monkeypatch, stacks_made
):
    """The gradient rows of x_t + h W_h + b are stacked once per sweep for all who need them —
    the hoisted group of x_t W_x + b (or a stepped parameter: a leaf, whose .grad then *is* the
    stack), W_h, and b when it comes after the stack was made — and the gradients equal a hand-written
    BPTT; a second backward accumulates into the stack a leaf adopted (after the sweep that shared
    it), changing no other gradient."""
    made = stacks_made
    compact = ops.LeadingSumGrad.compact

    def adding_up(self):  # the bias found no stack of its rows: it adds them up
        made.append("b added up")
        compact(self)

    monkeypatch.setattr(ops.LeadingSumGrad, "compact", adding_up)
    previous = vg.tape.tapes_enabled()
    vg.tape.set_tapes(tapes)
    try:
        g, loss, feed = elman(8, stepped_parameter, bias_last)
        cg = g.build(feed, loss)
        for sweep in range(3):  # the second and third compiled when tapes are on
            if feed:
                cg.feed(feed)
            cg.forward(cg.outputs[0])
            if sweep < 2:
                g.params.zero_grad()
            cg.backward(cg.outputs[0])
            # one stack made, read by the others: by the hoisted group's gradient, read by b and
            # W_h (with b last the sum is reassociated: b's gradient is that of the hoisted group
            # of x_t W_x + b, summed, and only W_h reads the stack); or (a stepped parameter's
            # turn comes last, and it is no hoisted work to reassociate with) made by W_h after b
            # added its rows up, then handed to the parameter as its gradient
            shared = (
                [("own", False), ("read", True)]
                if bias_last
                else [("own", False), ("read", True), ("read", True)]
            )
            late = [("read", False), "b added up", ("read", False), ("make", False), ("own", True)]
            assert made == (late if stepped_parameter else shared)
            made.clear()
            P = {name: g.params.value(name) for name in g.params}
            scale = 2 if sweep == 2 else 1  # the third sweep adds to the second's gradients
            for name, grad in elman_reference(P, feed.get("xs"), stepped_parameter).items():
                np.testing.assert_allclose(g.params[name].grad, scale * grad, rtol=1e-12, atol=1e-12)
    finally:
        vg.tape.set_tapes(previous)


def test_a_long_stack_of_weight_gradient_products_reuses_its_block_buffers(monkeypatch):
    """Block after block, the stacked rows of the last block are let go before the next block is
    stacked, so the workspace hands the same buffers out again: the copies stay one block's size
    however long the loop (a block's rows kept alive while the next is stacked took a second
    buffer per block: +4 MiB of peak at (32, 128, 32, 1000) in the benchmark)."""
    monkeypatch.setattr(vg.workspace, "MIN_BYTES", 0)
    monkeypatch.setattr(ops.RowsProductGrad, "BLOCK_ROWS", 4)
    rng = np.random.default_rng(8)
    parts = [(rng.normal(size=(2, 4)), rng.normal(size=(2, 4))) for _ in range(8)]
    rows = ops.RowsProductGrad(*parts[0])
    for a, g in parts[1:]:
        rows = rows.merge(ops.RowsProductGrad(a, g))
    vg.workspace.clear()
    bases = []
    stacked = ops._stacked

    def spy(blocks):
        out = stacked(blocks)
        bases.append(out.ctypes.data)
        return out

    monkeypatch.setattr(ops, "_stacked", spy)
    np.testing.assert_allclose(rows.dense(), sum(a.T @ g for a, g in parts), rtol=1e-12)
    assert len(bases) == 2 * 4  # four blocks of two uses, a and g stacked in each
    assert len(set(bases)) == 2  # ... into the same two buffers


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 6),  # iterations
    st.permutations(["rows", "rows again", "product", "bias", "bias 3-D"]),  # whose turn comes first
    st.booleans(),  # inside a sweep's scope
)
def test_collectors_of_the_same_rows_agree_in_any_order(T, order, in_sweep):
    """The collectors of one loop's gradient rows — a hoisted group's (twice: a second owner), a
    tied weight's product, a bias over the batch, a bias over a 3-D batch — made dense in any
    order, inside a sweep (sharing one stack) or outside: each equals its own reference, and no
    two results handed to callers share memory."""
    rng = np.random.default_rng(T)
    g = [rng.normal(size=(2, 3)) for _ in range(T)]
    a = [rng.normal(size=(2, 4)) for _ in range(T)]
    originals = [x.copy() for x in g]

    def collectors():
        rows = [ops.StepRowsGrad((T, 2, 3), np.float64, [T - 1], [g[T - 1]]) for _ in range(2)]
        product = ops.RowsProductGrad(a[T - 1], g[T - 1])
        bias = ops.reduce_grad(g[T - 1], (3,), leaf=True)
        bias3 = ops.reduce_grad(g[T - 1][None], (3,), leaf=True)
        for t in range(T - 2, -1, -1):  # a backward sweep's order
            rows = [r.merge(ops.IndexedGrad((T, 2, 3), np.float64, t, g[t], True)) for r in rows]
            product = product.merge(ops.RowsProductGrad(a[t], g[t]))
            bias = ops.add_grads(bias, ops.reduce_grad(g[t], (3,), leaf=True))
            bias3 = ops.add_grads(bias3, ops.reduce_grad(g[t][None], (3,), leaf=True))
        return {"rows": rows[0], "rows again": rows[1], "product": product, "bias": bias, "bias 3-D": bias3}

    want = {
        "rows": np.stack(g),
        "rows again": np.stack(g),
        "product": sum(x.T @ y for x, y in zip(a, g)),
        "bias": sum(x.sum(0) for x in g),
        "bias 3-D": sum(x.sum(0) for x in g),
    }
    made = collectors()
    got = {}
    with ops.sweep_scope() if in_sweep else contextlib.nullcontext():
        for name in order:
            c = made[name]
            got[name] = c.dense() if isinstance(c, ops.LazyGrad) else c
    for name in order:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12)
    for i, x in enumerate(order):
        for y in order[i + 1 :]:
            assert not np.shares_memory(got[x], got[y]), (x, y)
    for x, o in zip(g, originals):
        np.testing.assert_array_equal(x, o)  # no contribution written into


def test_a_weights_products_compacted_unit_by_unit_keep_the_same_sum():
    """RowsProductGrad.compact (a checkpointed loop calls it after each unit): the products so far
    become a kept total and their inputs are let go; later uses add to it; the gradient equals
    the sum of every use's product, computed by hand. Compacting makes no stack for the sweep's
    other collectors (a unit's rows are no one else's), and a result handed out after the last
    compaction is the caller's own array."""
    rng = np.random.default_rng(3)
    uses = [(rng.normal(size=(4, 3)), rng.normal(size=(4, 5))) for _ in range(7)]
    want = sum(a.T @ g for a, g in uses)
    with ops.sweep_scope():
        grad = ops.RowsProductGrad(*uses[0])
        for k, (a, g) in enumerate(uses[1:], start=1):
            grad.merge(ops.RowsProductGrad(a, g))
            if k in (2, 3, 6):  # units of 3, 1 and 3 uses: the last leaves nothing pending
                grad.compact()
                assert grad.a == [] and grad.g == []
        assert ops._sweep.stacks == {}
        got = grad.dense()
        np.testing.assert_allclose(got, want, rtol=1e-12)
        got[...] = 0
        np.testing.assert_allclose(grad.dense(), want, rtol=1e-12)
    # merged after compaction: the totals add
    first, second = ops.RowsProductGrad(*uses[0]), ops.RowsProductGrad(*uses[1])
    first.compact()
    second.merge(ops.RowsProductGrad(*uses[2]))
    second.compact()
    np.testing.assert_allclose(first.merge(second).dense(), sum(a.T @ g for a, g in uses[:3]), rtol=1e-12)


@pytest.mark.parametrize("block_rows", [1, 3, 10_000])
def test_a_stack_of_weights_gets_one_batched_product_of_its_uses(monkeypatch, block_rows):
    """``x @ W`` with ``W`` a stack of matrices ``(2, I, H)``, each multiplying its own rows
    ``(2, rows, I)`` (the two directions of nn.Bidirectional): the VJP for ``W`` collects the uses
    (StackedProductGrad) and sums them as one batched product per block of uses — the sum of every
    use's product, computed by einsum; added into, merged after compaction, handed out as the
    caller's own array."""
    monkeypatch.setattr(ops.RowsProductGrad, "BLOCK_ROWS", block_rows)
    rng = np.random.default_rng(4)
    W = rng.normal(size=(2, 3, 4))
    uses = [(rng.normal(size=(2, 2, 3)), rng.normal(size=(2, 2, 4))) for _ in range(7)]
    want = sum(np.einsum("dri,drh->dih", a, g) for a, g in uses)
    vjp = ops.OPS["MatMul"].vjps[1]
    grads = [vjp(g, a @ W, a, W) for a, g in uses]
    assert all(type(x) is ops.StackedProductGrad and x.shape == W.shape for x in grads)
    total = grads[0]
    for x in grads[1:]:
        total = ops.add_grads(total, x)
    got = total.dense()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    got[...] = 0
    acc = np.ones(W.shape)
    total.add_into(acc)
    np.testing.assert_allclose(acc, 1 + want, rtol=1e-12)
    # compacted unit by unit (a checkpointed loop): the same sum, the inputs let go
    first, second = ops.StackedProductGrad(*uses[0]), ops.StackedProductGrad(*uses[1])
    first.compact()
    assert first.a == [] and first.g == []
    second.merge(ops.StackedProductGrad(*uses[2]))
    second.compact()
    merged = first.merge(second)
    np.testing.assert_allclose(merged.dense(), sum(np.einsum("dri,drh->dih", a, g) for a, g in uses[:3]))
    out = merged.dense()
    out[...] = 0
    assert np.abs(merged.dense()).max() > 0
    # a weight shared by every copy's rows (no stack axis of its own) is not this case
    assert type(vjp(uses[0][1], None, uses[0][0], W[0])) is not ops.StackedProductGrad


def stacked_weight_rnn(T):
    """An RNN computing two copies at once, each with its own weights: ``W`` ``(2, 3, 4)``."""
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2, 1, 3))
    Wx = g.parameter("Wx", (2, 3, 4))
    Wh = g.parameter("Wh", (2, 4, 4), init=vg.nn.init.normal(0.4))
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 1, 4)), name="h")
        L.update(h, vg.tanh(x @ Wx + h @ Wh))
    loss = vg.sum(L.final(h) ** 2) + vg.sum(L.stack(h))
    return g, loss, {"xs": np.random.default_rng(T).normal(size=(T, 2, 1, 3))}


@pytest.mark.parametrize("hoist", [False, True])
def test_a_stacked_weight_in_a_loop_gets_one_batched_product(monkeypatch, hoist):
    """A stack of weights used in every iteration: node by node, one batched product for all
    its uses (not a dense gradient per iteration); the gradients agree with finite differences."""
    T = 9
    made = []
    dense = ops.StackedProductGrad.dense

    def counting(self):
        made.append(len(self.a))
        return dense(self)

    monkeypatch.setattr(ops.StackedProductGrad, "dense", counting)
    g, loss, feed = stacked_weight_rnn(T)
    cg = g.build(feed, loss, hoist=hoist)
    cg.backward(cg.outputs[0])
    # Wh: T uses in one product; Wx: the same plain, and hoisted one (T, 2, 1, 3) product whose
    # gradient the general VJP sums over the iterations' axis
    assert sorted(made) == ([T] if hoist else [T, T])
    vg.gradcheck(g.build(feed, loss, hoist=hoist).outputs[0], [g.params["Wx"], g.params["Wh"]])
