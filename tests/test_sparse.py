"""Row-sparse embedding gradients: the engine, the optimisers, clipping and checkpoints.

Every sparse result is compared with the same model declared with a dense table (the default),
bit for bit where the arithmetic is the same, and with plain numpy references otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg
from vgraph import functions as F
from vgraph import io, nn, optim
from vgraph.errors import ShapeError
from vgraph.ops import RowSparseGrad

V, D, H = 12, 4, 3


def tagger(sparse, dtype=np.float64, seed=0, twice=False, tied=False):
    """Tokens (T, B) -> embedding -> tanh RNN over time -> per-step linear scores -> a scalar.

    ``twice``: the table is also looked up a second time (a shifted copy of the tokens) outside
    the loop. ``tied``: the scores use the table's transpose too (the gradient is then dense).
    """
    g = vg.VirtualGraph(dtype=dtype, seed=seed)
    tok = g.input("tok", (None, None))
    h0 = g.input("h0", (None, H))
    emb = nn.Embedding(g, V, D, "emb", sparse=sparse)
    cell = nn.RNNCell(g, D, H, "rnn")
    head = nn.Linear(g, H, D if tied else 5, "head")
    with g.loop() as L:
        x_t = emb(L.step(tok))  # one look-up per iteration
        h = L.carry(h0, name="h")
        h_new = cell(x_t, h)
        L.update(h, h_new)
        score = head(h_new)
        if tied:
            score = score @ F.transpose(emb.W)
    loss = (L.stack(score) ** 2).mean()
    if twice:
        loss = loss + (emb(tok) * 0.5).sum() * (emb(tok[::-1]) ** 2).mean()
    return g, loss


def feed(seed=0, T=5, B=3):
    rng = np.random.default_rng(seed)
    return {"tok": rng.integers(0, V // 2, (T, B)), "h0": np.zeros((B, H))}  # repeats, half unused


def grads_of(g, loss, fd, hoist=True, times=1, programs=None):
    cg = g.build(fd, loss, hoist=hoist, programs=programs)
    for _ in range(times):
        cg.backward_ex(loss, retain_graph=True)
    return {k: p.grad for k, p in g.params.items()}


# --- the gradient ----------------------------------------------------------------------------


@pytest.mark.parametrize("programs", [True, False])
@pytest.mark.parametrize("hoist", [True, False])
@pytest.mark.parametrize("twice", [False, True])
def test_sparse_gradient_equals_dense_bit_for_bit(hoist, twice, programs):
    fd = feed()
    dense = grads_of(*tagger(False, twice=twice), fd, hoist=hoist, programs=programs)
    sparse = grads_of(*tagger(True, twice=twice), fd, hoist=hoist, programs=programs)
    gs = sparse["emb.W"]
    assert isinstance(gs, RowSparseGrad)
    used = np.unique(np.concatenate([fd["tok"].ravel()]))
    np.testing.assert_array_equal(gs.indices, used)  # sorted, once each, only the rows looked up
    assert gs.values.shape == (used.size, D)
    np.testing.assert_array_equal(gs.dense(), dense["emb.W"])
    np.testing.assert_array_equal(np.asarray(gs), dense["emb.W"])
    assert not np.any(dense["emb.W"][np.setdiff1d(np.arange(V), used)])
    for k in dense:
        if k != "emb.W":
            np.testing.assert_array_equal(sparse[k], dense[k])


def test_sparse_gradient_against_finite_differences():
    g, loss = tagger(True, twice=True)
    cg = g.build(feed(1), loss)
    vg.gradcheck(cg.node(loss), [g.params["emb.W"], g.params["rnn.W_h"]])


def test_repeated_rows_are_summed():
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.arange(12.0).reshape(4, 3), sparse_grad=True)
    idx = cg.input(np.array([[2, 0], [2, 2]]))
    R = np.arange(12.0).reshape(2, 2, 3) + 1
    cg.backward(F.sum(F.take(W, idx) * R))
    assert isinstance(W.grad, RowSparseGrad)
    np.testing.assert_array_equal(W.grad.indices, [0, 2])
    np.testing.assert_array_equal(W.grad.values, [R[0, 1], R[0, 0] + R[1, 0] + R[1, 1]])


def test_integer_getitem_and_array_lookups_are_rows():
    """``emb(array)`` (GetItem with an integer array), ``W[3]`` (an integer index) and ``W[a:b]``
    (a slice of rows) are row look-ups too; a negative index names the row counted from the end."""
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.ones((7, 2)), sparse_grad=True)
    loss = F.sum(W[np.array([1, -1, 1])] * 2.0) + F.sum(W[3] * 3.0) + F.sum(W[1:6:4] * 5.0)
    cg.backward(loss)
    assert isinstance(W.grad, RowSparseGrad)
    np.testing.assert_array_equal(W.grad.indices, [1, 3, 5, 6])
    np.testing.assert_array_equal(W.grad.values, [[9.0, 9.0], [3.0, 3.0], [5.0, 5.0], [2.0, 2.0]])
    dense = vg.ComputeGraph(np.float64)
    Wd = dense.parameter(np.ones((7, 2)))
    dense.backward(F.sum(Wd[np.array([1, -1, 1])] * 2.0) + F.sum(Wd[3] * 3.0) + F.sum(Wd[1:6:4] * 5.0))
    np.testing.assert_array_equal(W.grad.dense(), Wd.grad)


def test_a_column_slice_is_not_a_row_lookup():
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.ones((4, 3)), sparse_grad=True)
    cg.backward(F.sum(W[:, 1] * 2.0) + F.sum(F.take(W, cg.input(np.array([2])))))
    assert type(W.grad) is np.ndarray
    np.testing.assert_array_equal(W.grad, [[0, 2, 0], [0, 2, 0], [1, 3, 1], [0, 2, 0]])


def test_gradient_accumulates_across_backward_calls_and_builds():
    fd1, fd2 = feed(1), feed(2, T=3)
    g_d, loss_d = tagger(False)
    g_s, loss_s = tagger(True)
    for g, loss in ((g_d, loss_d), (g_s, loss_s)):
        grads_of(g, loss, fd1, times=2)  # two backward calls through one graph
        grads_of(g, loss, fd2)  # and another build
    gs, gd = g_s.params["emb.W"].grad, g_d.params["emb.W"].grad
    assert isinstance(gs, RowSparseGrad)
    used = np.unique(np.concatenate([fd1["tok"].ravel(), fd2["tok"].ravel()]))
    np.testing.assert_array_equal(gs.indices, used)
    np.testing.assert_array_equal(gs.dense(), gd)


def test_a_use_that_is_not_a_row_lookup_makes_the_gradient_dense():
    """A table also used as the output layer's weight (tied) gets a dense gradient, the dense
    model's exactly."""
    fd = feed()
    dense = grads_of(*tagger(False, tied=True), fd)["emb.W"]
    sparse = grads_of(*tagger(True, tied=True), fd)["emb.W"]
    assert type(sparse) is np.ndarray
    np.testing.assert_allclose(sparse, dense, rtol=1e-13, atol=1e-15)


def test_grad_and_retain_grad_stay_dense():
    fd = feed()
    g, loss = tagger(True, twice=True)
    g_dense, loss_dense = tagger(False, twice=True)
    cg = g.build(fd, loss)
    (gw,) = cg.grad(loss, [g.params["emb.W"]], retain_graph=True)
    assert type(gw) is np.ndarray
    assert g.params["emb.W"].grad is None  # grad() accumulates nothing
    (ref,) = g_dense.build(fd, loss_dense).grad(loss_dense, [g_dense.params["emb.W"]])
    np.testing.assert_array_equal(gw, ref)
    # A retained intermediate (the looked-up rows of the last lookup) has a dense .grad.
    look = next(n for n in reversed(cg.nodes()) if n.key.type == "Take")
    look.retain_grad()
    cg.backward(loss)
    assert type(look.grad) is np.ndarray and look.grad.shape == look.shape
    assert isinstance(g.params["emb.W"].grad, RowSparseGrad)


def test_dense_grad_plus_sparse_contribution():
    """A dense ``.grad`` (e.g. set by the user) takes a later row-sparse contribution densely."""
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.ones((4, 2)), sparse_grad=True)
    W.grad = np.full((4, 2), 0.5)
    cg.backward(F.sum(F.take(W, cg.input(np.array([3, 3])))))
    assert type(W.grad) is np.ndarray
    np.testing.assert_array_equal(W.grad, [[0.5, 0.5]] * 3 + [[2.5, 2.5]])


def test_untied_sparse_parameter_in_a_loop():
    g = vg.VirtualGraph(dtype=np.float64)
    tok = g.input("tok", (None,))
    acc0 = g.constant(np.zeros(2))
    with g.loop(times=2) as L:
        table = g.parameter("table", (6, 2), init="normal", sparse_grad=True)  # untied: one per step
        acc = L.carry(acc0, name="acc")
        L.update(acc, acc + F.take(table, tok).sum(axis=0))
    loss = (L.final(acc) ** 2).sum()
    g.build({"tok": np.array([1, 4, 1])}, loss).backward(loss)
    for name in ("table@0", "table@1"):
        grad = g.params[name].grad
        assert isinstance(grad, RowSparseGrad)
        np.testing.assert_array_equal(grad.indices, [1, 4])


@pytest.mark.parametrize("programs", [True, False])
def test_autobatched_builds_keep_the_gradient_row_sparse(programs):
    """``g.build_batch`` runs the look-ups of several inputs together (with programs, the loop
    over every input's rows, the look-ups hoisted out of it); the table's gradient is still the
    rows looked up, and equals the dense model's."""
    feeds = [feed(3, T=4, B=2), feed(4, T=2, B=2), feed(5, T=5, B=2)]
    grads = {}
    for sparse in (False, True):
        g, loss = tagger(sparse)
        g.build_batch(feeds, loss, programs=programs).backward()
        grads[sparse] = g.params["emb.W"].grad
    assert isinstance(grads[True], RowSparseGrad)
    used = np.unique(np.concatenate([f["tok"].ravel() for f in feeds]))
    np.testing.assert_array_equal(grads[True].indices, used)
    np.testing.assert_allclose(grads[True].dense(), grads[False], rtol=1e-13, atol=1e-15)


# --- declaring ------------------------------------------------------------------------------


def test_sparse_grad_on_a_non_table_is_a_typed_error_and_changes_nothing():
    g = vg.VirtualGraph()
    with pytest.raises(ShapeError, match=r"'b'.*2-D.*\(5,\)"):
        g.parameter("b", (5,), sparse_grad=True)
    with pytest.raises(ShapeError, match="2-D"):
        g.parameter("c", (2, 3, 4), sparse_grad=True)
    with pytest.raises(TypeError, match="sparse_grad must be True or False"):
        g.parameter("d", (2, 3), sparse_grad="yes")
    assert len(g.params) == 0 and not g.nodes
    g.parameter("b", (5,))  # the name was not taken by the failed call
    with pytest.raises(TypeError, match="sparse must be True or False"):
        nn.Embedding(g, 4, 2, "emb", sparse=1)
    cg = vg.ComputeGraph()
    with pytest.raises(ShapeError, match="2-D"):
        cg.parameter(np.zeros(3), name="v", sparse_grad=True)
    assert len(cg) == 0


def test_dense_is_the_default():
    g = vg.VirtualGraph()
    emb = nn.Embedding(g, 4, 2, "emb")
    assert not emb.sparse and not g.params["emb.W"].sparse_grad
    assert nn.Embedding(g, 4, 2, "emb2", sparse=True).sparse and g.params["emb2.W"].sparse_grad


# --- RowSparseGrad on its own ----------------------------------------------------------------


def test_row_sparse_grad_coalesces_and_densifies():
    r = RowSparseGrad(np.array([3, -1, 3, 0]), np.arange(8.0).reshape(4, 2), (5, 2))
    np.testing.assert_array_equal(r.indices, [0, 3, 4])
    np.testing.assert_array_equal(r.values, [[6, 7], [0 + 4, 1 + 5], [2, 3]])
    expected = np.zeros((5, 2))
    np.add.at(expected, np.array([3, 4, 3, 0]), np.arange(8.0).reshape(4, 2))
    np.testing.assert_array_equal(r.dense(), expected)
    np.testing.assert_array_equal(np.asarray(r, dtype=np.float32), expected.astype(np.float32))
    total = r + RowSparseGrad(np.array([1]), np.ones((1, 2)), (5, 2))
    assert isinstance(total, RowSparseGrad)
    np.testing.assert_array_equal(total.indices, [0, 1, 3, 4])
    np.testing.assert_array_equal(
        total.dense(), expected + np.array([[0, 0], [1, 1], [0, 0], [0, 0], [0, 0]])
    )
    dense_sum = r + np.ones((5, 2))
    assert type(dense_sum) is np.ndarray
    np.testing.assert_array_equal(dense_sum, expected + 1)
    np.testing.assert_array_equal(r.with_values(r.values * 2).dense(), 2 * expected)
    assert "rows=3" in repr(r)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((np.array([0.5]), np.ones((1, 2)), (3, 2)), TypeError, "integers"),
        ((np.array([[0]]), np.ones((1, 2)), (3, 2)), ValueError, "1-D"),
        ((np.array([0]), np.ones((1, 3)), (3, 2)), ValueError, "shape"),
        ((np.array([3]), np.ones((1, 2)), (3, 2)), ValueError, "range"),
        ((np.array([0]), np.ones((1, 2), dtype=int), (3, 2)), TypeError, "floating"),
        ((np.array([0]), np.ones((1, 2)), ()), ValueError, "axis"),
    ],
)
def test_row_sparse_grad_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        RowSparseGrad(*args)


# --- optimisers ------------------------------------------------------------------------------


def train(sparse, make_opt, steps=4, clip=None, dtype=np.float64):
    """A few training steps of the tagger, on a different batch each step (different rows)."""
    g, loss = tagger(sparse, dtype=dtype)
    opt = make_opt(g.params)
    for s in range(steps):
        cg = g.build(feed(10 + s, T=3 + s % 2), loss)
        opt.zero_grad()
        cg.backward(loss)
        if clip is not None:
            clip(g.params)
        opt.step()
    return g, opt, loss


def values(g):
    return {k: np.array(p.value) for k, p in g.params.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: optim.SGD(p, lr=0.1),
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
        lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01),
        lambda p: optim.Adagrad(p, lr=0.1, weight_decay=0.01),
        lambda p: optim.Adam(p, lr=0.01),  # not lazy: dense Adam on the densified gradient
        lambda p: optim.RMSprop(p, lr=0.01),
    ],
    ids=["sgd", "sgd-momentum-wd", "adagrad", "adagrad-wd", "adam", "rmsprop"],
)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_exact_optimisers_give_the_dense_result_bit_for_bit(make_opt, dtype):
    g_dense = train(False, make_opt, dtype=dtype)[0]
    g_sparse = train(True, make_opt, dtype=dtype)[0]
    assert_same(values(g_sparse), values(g_dense))


def test_sparse_sgd_touches_only_the_rows_looked_up():
    g, loss = tagger(True)
    before = g.params.value("emb.W")
    fd = feed()
    g.build(fd, loss).backward(loss)
    optim.SGD(g.params, lr=0.5).step()
    after = g.params["emb.W"].value
    unused = np.setdiff1d(np.arange(V), fd["tok"])
    np.testing.assert_array_equal(after[unused], before[unused])
    assert not np.allclose(after[fd["tok"].ravel()], before[fd["tok"].ravel()])


def ref_lazy_adam(theta, grads, lr, b1, b2, eps, wd=0.0, decoupled=False):
    """SparseAdam's lazy rule in numpy: per step, only the rows present move."""
    theta = theta.copy()
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    for t, (rows, g) in enumerate(grads, start=1):
        th = theta[rows]
        if decoupled:
            th = th - lr * wd * th
        else:
            g = g + wd * th
        m[rows] = b1 * m[rows] + (1 - b1) * g
        v[rows] = b2 * v[rows] + (1 - b2) * g**2
        m_hat = m[rows] / (1 - b1**t)
        v_hat = v[rows] / (1 - b2**t)
        theta[rows] = th - lr * m_hat / (np.sqrt(v_hat) + eps)
    return theta, m, v


@pytest.mark.parametrize(
    ("cls", "wd"),
    [(optim.Adam, 0.0), (optim.Adam, 0.1), (optim.AdamW, 0.1)],
    ids=["adam", "adam-l2", "adamw"],
)
def test_lazy_adam_against_numpy_reference(cls, wd):
    rng = np.random.default_rng(0)
    cg = vg.ComputeGraph(np.float64)
    theta0 = rng.standard_normal((8, 3))
    W = cg.parameter(theta0, name="W", sparse_grad=True)
    b = cg.parameter(rng.standard_normal(3), name="b")
    opt = cls([W, b], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=wd, lazy=True)
    steps = [np.array([1, 5, 1]), np.array([2]), np.array([5, 6, 7, 7]), np.array([1])]
    grads = []
    for rows in steps:
        vals = rng.standard_normal((rows.size, 3))
        W.grad = RowSparseGrad(rows, vals, (8, 3))
        grads.append((W.grad.indices, W.grad.values))
        b.grad = rng.standard_normal(3)
        opt.step()
    theta, m, v = ref_lazy_adam(theta0, grads, 0.05, 0.8, 0.9, 1e-6, wd, cls is optim.AdamW)
    np.testing.assert_allclose(W.value, theta, rtol=1e-13, atol=1e-15)
    st = opt.state_dict()["state"]["W"]
    np.testing.assert_allclose(st["exp_avg"], m, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(st["exp_avg_sq"], v, rtol=1e-13, atol=1e-15)
    assert st["step"] == 4
    never = [0, 3, 4]  # never looked up: untouched, weight decay included
    np.testing.assert_array_equal(W.value[never], theta0[never])


def test_lazy_adam_with_every_row_present_is_dense_adam_bit_for_bit():
    rng = np.random.default_rng(1)
    results = []
    for lazy in (False, True):
        cg = vg.ComputeGraph(np.float32)
        W = cg.parameter(np.ones((4, 2)), name="W", sparse_grad=True)
        opt = optim.Adam([W], lr=0.1, lazy=lazy)
        r = np.random.default_rng(1)
        for _ in range(3):
            W.grad = RowSparseGrad(r.permutation(4), r.standard_normal((4, 2)).astype(np.float32), (4, 2))
            opt.step()
        results.append(np.array(W.value))
    np.testing.assert_array_equal(results[0], results[1])
    del rng


def test_lazy_adam_differs_from_dense_adam_where_rows_are_missing():
    """The documented difference: dense Adam keeps moving a row whose gradient is now zero."""
    for lazy in (False, True):
        cg = vg.ComputeGraph(np.float64)
        W = cg.parameter(np.zeros((3, 1)), name="W", sparse_grad=True)
        opt = optim.Adam([W], lr=0.1, lazy=lazy)
        W.grad = RowSparseGrad(np.array([0, 1]), np.ones((2, 1)), (3, 1))
        opt.step()
        W.grad = RowSparseGrad(np.array([1]), np.ones((1, 1)), (3, 1))
        before = np.array(W.value[0])
        opt.step()
        moved = not np.array_equal(W.value[0], before)
        assert moved is (not lazy)


def test_lazy_flag_is_checked_and_saved():
    cg = vg.ComputeGraph()
    W = cg.parameter(np.ones((2, 2)), name="W")
    with pytest.raises(TypeError, match="lazy"):
        optim.Adam([W], lazy="yes")
    opt = optim.Adam([W], lazy=True)
    assert opt.state_dict()["hyperparameters"]["lazy"] is True
    # A state dict written before ``lazy`` existed loads, as not lazy.
    sd = optim.Adam([W]).state_dict()
    del sd["hyperparameters"]["lazy"]
    opt.load_state_dict(sd)
    assert opt.lazy is False


def test_sparse_gradient_checks_refuse_the_step_and_change_nothing():
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.ones((4, 2)), name="W", sparse_grad=True)
    opt = optim.Adam([W], lazy=True, check_finite=True)
    W.grad = RowSparseGrad(np.array([1]), np.array([[np.nan, 1.0]]), (4, 2))
    with pytest.raises(optim.NonFiniteGradientError, match="1 NaN"):
        opt.step()
    W.grad = RowSparseGrad(np.array([1]), np.ones((1, 2)), (5, 2))
    with pytest.raises(ShapeError, match=r"\(5, 2\)"):
        opt.step()
    assert opt.state == {}
    np.testing.assert_array_equal(W.value, np.ones((4, 2)))


def test_float32_parameter_takes_a_float64_row_sparse_gradient():
    cg = vg.ComputeGraph(np.float32)
    W = cg.parameter(np.ones((3, 2)), name="W", sparse_grad=True)
    W.grad = RowSparseGrad(np.array([2]), np.full((1, 2), 0.5), (3, 2))
    optim.SGD([W], lr=1.0).step()
    assert W.value.dtype == np.float32
    np.testing.assert_array_equal(W.value, [[1, 1], [1, 1], [0.5, 0.5]])


# --- clipping --------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_with_a_row_sparse_gradient(norm_type):
    fd = feed()
    dense = grads_of(*tagger(False), fd)
    g, loss = tagger(True)
    grads_of(g, loss, fd)
    total = optim.clip_grad_norm_(g.params, max_norm=0.01, norm_type=norm_type)
    flat = np.concatenate([np.ravel(v) for v in dense.values()])
    expected = np.linalg.norm(flat, ord=norm_type)
    assert total == pytest.approx(expected, rel=1e-12)
    coef = 0.01 / (expected + 1e-6)
    gs = g.params["emb.W"].grad
    assert isinstance(gs, RowSparseGrad)
    np.testing.assert_allclose(gs.dense(), dense["emb.W"] * coef, rtol=1e-12)
    np.testing.assert_allclose(g.params["rnn.W_h"].grad, dense["rnn.W_h"] * coef, rtol=1e-12)


def test_clip_grad_norm_nonfinite_sparse_gradient():
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.ones((3, 2)), name="W", sparse_grad=True)
    W.grad = RowSparseGrad(np.array([0]), np.array([[np.inf, 0.0]]), (3, 2))
    with pytest.raises(optim.NonFiniteGradientError, match="'W'"):
        optim.clip_grad_norm_([W], 1.0, error_if_nonfinite=True)
    assert np.isinf(W.grad.values[0, 0])


def test_clip_grad_value_with_a_row_sparse_gradient():
    cg = vg.ComputeGraph(np.float64)
    W = cg.parameter(np.ones((3, 2)), name="W", sparse_grad=True)
    W.grad = RowSparseGrad(np.array([2, 0]), np.array([[3.0, -0.5], [-7.0, 1.0]]), (3, 2))
    optim.clip_grad_value_([W], 1.0)
    assert isinstance(W.grad, RowSparseGrad)
    np.testing.assert_array_equal(W.grad.dense(), [[-1.0, 1.0], [0, 0], [1.0, -0.5]])


def test_training_with_clipping_sparse_equals_dense():
    def clip(p):
        return optim.clip_grad_value_(p, 0.05)

    g_dense = train(False, lambda p: optim.SGD(p, lr=0.1), clip=clip)[0]
    g_sparse = train(True, lambda p: optim.SGD(p, lr=0.1), clip=clip)[0]
    assert_same(values(g_sparse), values(g_dense))


# --- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt",
    [lambda p: optim.Adam(p, lr=0.01, lazy=True), lambda p: optim.Adagrad(p, lr=0.1)],
    ids=["lazy-adam", "adagrad"],
)
def test_training_state_round_trip_with_sparse_updates(tmp_path, make_opt):
    """Save after 3 lazy steps, load into a fresh model and optimiser, continue: the same run."""
    g, opt, loss = train(True, make_opt, steps=3)
    path = tmp_path / "state.npz"
    io.save_training_state(g, path, optimizer=opt, step=3)
    g2, loss2 = tagger(True, seed=99)  # other initial values: everything must come from the file
    opt2 = make_opt(g2.params)
    assert io.load_training_state(g2, path, optimizer=opt2) == 3
    assert opt2.state_dict()["hyperparameters"] == opt.state_dict()["hyperparameters"]
    for s in range(3, 5):  # continue both
        for graph, lo, o in ((g, loss, opt), (g2, loss2, opt2)):
            cg = graph.build(feed(10 + s, T=3 + s % 2), lo)
            o.zero_grad()
            cg.backward(lo)
            o.step()
    assert_same(values(g2), values(g))
    io.save(g2, tmp_path / "params.npz")  # a parameters-only checkpoint of a sparse model
    g3, _ = tagger(True, seed=5)
    io.load(g3, tmp_path / "params.npz")
    assert_same(values(g3), values(g2))
    assert g3.params["emb.W"].sparse_grad  # the flag comes from the declaration, not the file


# --- the benchmarks' own checks (no timing is asserted) ---------------------------------------


def _tool(name):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"vgraph_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while executing it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_bench_sparse_checks_dense_and_sparse_agree():
    bench = _tool("bench_sparse")
    bench.check_equal(vocab=50, dim=4, hidden=3, T=4, B=3)  # exits with status 2 on a mismatch
    rows = bench.time_update(vocab=50, dim=4, T=4, B=3, repeats=1)
    assert {r["optimizer"] for r in rows} == {"sgd", "adagrad", "adam"}
    assert all(r["distinct_rows"] <= 12 for r in rows)


def test_bench_dynamic_tree_task_check_and_data():
    bench = _tool("bench_dynamic")
    report = bench.check_tree_lstm()
    assert report["gradcheck"] == "passed" and report["sparse_equals_dense"]
    tree = bench.random_tree(np.random.default_rng(0), np.array([3, 1, 4, 1, 5]))
    n = len(tree.tokens)
    assert n == 9 and tree.words == 5 and tree.is_leaf.sum() == 5
    assert all(c < t for t in range(n) for c in tree.children[t] if c >= 0)  # children first
    assert set(tree.labels) <= set(range(5))
    lengths = bench.sst_lengths(np.random.default_rng(1), 4000)
    assert lengths.min() >= 1 and lengths.max() <= 50 and 17 <= lengths.mean() <= 21
    assert {"vgraph", "sparse"} <= set(bench.TASKS["tree_lstm"].columns)
    assert {"vgraph", "sparse"} <= set(bench.TASKS["bilstm_tagger"].columns)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: optim.SGD(p, lr=0.1),
        lambda p: optim.Adagrad(p, lr=0.1),
        lambda p: optim.Adam(p, lr=0.05, lazy=True),
    ],
    ids=["sgd", "adagrad", "lazy-adam"],
)
def test_row_updates_write_in_place_only_when_no_read_value_is_alive(make_opt):
    """A row-sparse update writes its rows into the table's array when nothing else refers to
    it (no copy of a large table per step), with the same result as the copying update; an
    array read from ``p.value`` before the step is never changed, and graphs see the new version."""
    results = []
    for hold in (False, True):
        cg = vg.ComputeGraph(np.float64)
        W = cg.parameter(np.arange(12.0).reshape(6, 2), name="W", sparse_grad=True)
        y = vg.functions.sum(W[np.array([1, 4])] * 2.0)
        opt = make_opt([W])
        r = np.random.default_rng(3)
        for rows in ([1, 4], [0, 4, 5], [4]):
            held = W.value if hold else None
            snapshot = np.array(held) if hold else None
            before, version = id(W._value), W.version  # (an id: a reference would be a reader)
            W.grad = RowSparseGrad(np.array(rows), r.standard_normal((len(rows), 2)), (6, 2))
            opt.step()
            assert W.version > version
            assert (id(W._value) == before) is (not hold)  # in place exactly when nothing held it
            if hold:
                np.testing.assert_array_equal(held, snapshot)
            del held
            np.testing.assert_array_equal(cg.forward(y), 2.0 * W.value[[1, 4]].sum())
        results.append(np.array(W.value))
    np.testing.assert_array_equal(results[0], results[1])


# -- add_at: np.add.at's additions, fast for wide rows -------------------------------------------


@given(
    n=st.integers(1, 40),
    width=st.sampled_from([(1,), (3,), (64,), (8, 16), (130,)]),
    k=st.integers(0, 300),
    dtype=st.sampled_from([np.float32, np.float64]),
    negative=st.booleans(),
    broadcast=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_add_at_makes_np_add_at_s_additions_bit_for_bit(n, width, k, dtype, negative, broadcast, seed):
    """Repeated rows (each summed in the order given), negative rows, values broadcast over the
    index: the same bits as ``np.add.at``, on both sides of the flat path's threshold."""
    from vgraph.ops import add_at

    rng = np.random.default_rng(seed)
    index = rng.integers(-n if negative else 0, n, size=k)
    shape = (1, *width) if broadcast else (k, *width)
    values = rng.standard_normal(shape).astype(dtype) * 10.0 ** rng.integers(-8, 8, size=shape)
    acc = rng.standard_normal((n, *width)).astype(dtype)
    want = acc.copy()
    np.add.at(want, index, values)
    add_at(acc, index, values)
    assert acc.dtype == want.dtype
    assert np.array_equal(acc.view(np.uint8), want.view(np.uint8))


def test_add_at_falls_back_to_np_add_at_for_what_its_flat_path_does_not_take():
    from vgraph.ops import add_at

    rng = np.random.default_rng(0)
    values = rng.standard_normal((600, 128))
    index = rng.integers(0, 50, size=600)
    # a non-contiguous accumulator (a flat view would be a copy): written in place all the same
    base = np.zeros((50, 256))
    acc = base[:, ::2]
    add_at(acc, index, values)
    want = np.zeros((50, 128))
    np.add.at(want, index, values)
    assert np.array_equal(base[:, ::2], want) and not base[:, 1::2].any()
    # a tuple index, a float32 accumulator receiving float64 values (numpy's casting)
    acc32, want32 = np.zeros((50, 128), np.float32), np.zeros((50, 128), np.float32)
    add_at(acc32, index, values)
    np.add.at(want32, index, values)
    assert np.array_equal(acc32, want32)
    where = (index, np.arange(600) % 128)
    got, want = np.zeros((50, 128)), np.zeros((50, 128))
    add_at(got, where, values[:, 0])
    np.add.at(want, where, values[:, 0])
    assert np.array_equal(got, want)
    # out of range, past either end: np.add.at's IndexError, and nothing added
    for bad in (50, -51):
        acc = np.zeros((50, 128))
        with pytest.raises(IndexError):
            add_at(acc, np.r_[index, bad], np.vstack([values, values[:1]]))
        assert not acc.any()
    # values that do not fit the index: np.add.at's ValueError
    with pytest.raises(ValueError):
        add_at(np.zeros((50, 128)), index, values[:, :64])
