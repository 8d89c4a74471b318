"""Losses against numpy references, on compute and virtual nodes, with extreme inputs and gradchecks."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import vgraph as vg
from vgraph import losses


def ref_log_softmax(x):
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def ref_reduce(x, reduction):
    return {"mean": np.mean, "sum": np.sum, "none": lambda a: a}[reduction](x)


def ref_bce(x, y):
    return np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))


RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal((5, 4)) * 3
LABELS = np.array([0, 3, 3, 1, 2])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse(reduction):
    pred, target = RNG.standard_normal((3, 4)), RNG.standard_normal((3, 4))
    cg = vg.ComputeGraph(np.float64)
    p = cg.parameter(pred)
    out = losses.mse_loss(p, target, reduction=reduction)
    np.testing.assert_allclose(out.value, ref_reduce((pred - target) ** 2, reduction))
    obj = out if reduction != "none" else out.sum()
    vg.gradcheck(obj, [p])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("as_node", [False, True], ids=["array-labels", "node-labels"])
def test_cross_entropy_values(reduction, as_node):
    cg = vg.ComputeGraph(np.float64)
    x = cg.parameter(LOGITS)
    labels = cg.input(LABELS) if as_node else LABELS
    out = losses.cross_entropy(x, labels, reduction=reduction)
    per = -ref_log_softmax(LOGITS)[np.arange(5), LABELS]
    np.testing.assert_allclose(out.value, ref_reduce(per, reduction), rtol=1e-12)


@pytest.mark.parametrize("as_node", [False, True], ids=["array-labels", "node-labels"])
def test_cross_entropy_gradient(as_node):
    cg = vg.ComputeGraph(np.float64)
    x = cg.parameter(LOGITS)
    labels = cg.input(LABELS) if as_node else LABELS
    loss = losses.cross_entropy(x, labels)
    vg.gradcheck(loss, [x])
    (gx,) = cg.grad(loss, [x])
    p = np.exp(ref_log_softmax(LOGITS))
    onehot = np.zeros_like(LOGITS)
    onehot[np.arange(5), LABELS] = 1
    np.testing.assert_allclose(gx, (p - onehot) / 5, atol=1e-14)


@pytest.mark.parametrize("as_node", [False, True], ids=["array-labels", "node-labels"])
def test_cross_entropy_extreme_logits(as_node):
    logits = np.array([[1000.0, -1000.0, 0.0], [-1000.0, -1000.0, 1000.0], [1000.0, 1000.0, -1000.0]])
    labels = np.array([0, 0, 1])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no overflow, not even a warning
        cg = vg.ComputeGraph(np.float64)
        x = cg.parameter(logits)
        loss = losses.cross_entropy(x, cg.input(labels) if as_node else labels, reduction="none")
        (gx,) = cg.grad(loss, [x], seeds=np.ones(3))
    np.testing.assert_allclose(loss.value, [0.0, 2000.0, np.log(2)], atol=1e-12)
    assert np.all(np.isfinite(gx))
    np.testing.assert_allclose(gx, [[0, 0, 0], [-1, 0, 1], [0.5, -0.5, 0]], atol=1e-12)


def test_cross_entropy_in_a_virtual_graph_with_label_input():
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    x = g.input("x", (None, 3))
    y = g.input("y", (None,))
    w = g.parameter("w", (3, 4))
    loss = losses.cross_entropy(x @ w, y)
    xs = RNG.standard_normal((5, 3))
    cg = g.build({"x": xs, "y": LABELS}, loss)
    logits = xs @ g.params["w"].value
    expected = -ref_log_softmax(logits)[np.arange(5), LABELS].mean()
    assert cg.forward() == pytest.approx(expected, rel=1e-12)
    vg.gradcheck(cg.outputs[0], [g.params["w"]])
    # new labels through feed: the same graph recomputes
    other = np.array([1, 1, 0, 2, 3])
    cg.feed({"y": other})
    assert cg.forward() == pytest.approx(-ref_log_softmax(logits)[np.arange(5), other].mean(), rel=1e-12)


def test_cross_entropy_per_step_inside_a_loop():
    g = vg.VirtualGraph(dtype=np.float64, seed=2)
    xs = g.input("xs", (None, None, 3))
    ys = g.input("ys", (None, None))
    w = g.parameter("w", (3, 4))
    zero = g.constant(0.0)
    with g.loop() as L:
        x_t, y_t = L.step(xs), L.step(ys)
        step_loss = losses.cross_entropy(x_t @ w, y_t)
        acc = L.carry(zero, name="acc")
        L.update(acc, acc + step_loss)
    total = L.final(acc)
    xv = RNG.standard_normal((3, 2, 3))
    yv = np.array([[0, 1], [3, 3], [2, 0]])
    cg = g.build({"xs": xv, "ys": yv}, total)
    W = g.params["w"].value
    expected = sum(-ref_log_softmax(xv[t] @ W)[np.arange(2), yv[t]].mean() for t in range(3))
    assert cg.forward() == pytest.approx(expected, rel=1e-12)


def test_nll_and_label_checks():
    cg = vg.ComputeGraph(np.float64)
    x = cg.parameter(LOGITS)
    logp = vg.log_softmax(x)
    np.testing.assert_allclose(losses.nll_loss(logp, LABELS).value, losses.cross_entropy(x, LABELS).value)
    with pytest.raises(ValueError):
        losses.cross_entropy(x, np.array([0, 1, 2, 3, 4]))  # 4 is out of range for 4 classes
    with pytest.raises(vg.ShapeError):
        losses.cross_entropy(x, np.array([0, 1]))
    with pytest.raises(ValueError):
        losses.cross_entropy(x, np.array([0.5, 1, 2, 3, 0]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bce_with_logits_values(reduction):
    x = RNG.standard_normal((4, 3)) * 4
    y = RNG.uniform(size=(4, 3))
    cg = vg.ComputeGraph(np.float64)
    p = cg.parameter(x)
    out = losses.bce_with_logits(p, y, reduction=reduction)
    # the textbook definition, fine for moderate logits
    s = 1 / (1 + np.exp(-x))
    textbook = -(y * np.log(s) + (1 - y) * np.log(1 - s))
    np.testing.assert_allclose(out.value, ref_reduce(textbook, reduction), rtol=1e-10)
    np.testing.assert_allclose(out.value, ref_reduce(ref_bce(x, y), reduction), rtol=1e-12)


def test_bce_with_logits_extreme_and_gradient():
    x = np.array([1000.0, -1000.0, 1000.0, -1000.0, 0.0, 0.0, 3.0])
    y = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.3])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        cg = vg.ComputeGraph(np.float64)
        p = cg.parameter(x)
        loss = losses.bce_with_logits(p, y, reduction="sum")
        (gp,) = cg.grad(loss, [p], retain_graph=True)
    np.testing.assert_allclose(loss.value, np.sum(ref_bce(x, y)))
    assert loss.value == pytest.approx(2000 + 2 * np.log(2) + ref_bce(3.0, 0.3))
    sig = np.array([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 1 / (1 + np.exp(-3.0))])
    np.testing.assert_allclose(gp, sig - y, atol=1e-15)  # including x = 0 exactly
    vg.gradcheck(loss, [p])


def test_bce_target_node_gets_gradient():
    cg = vg.ComputeGraph(np.float64)
    x = cg.parameter(RNG.standard_normal(5))
    t = cg.parameter(RNG.uniform(size=5))
    vg.gradcheck(losses.bce_with_logits(x, t), [x, t])


def test_invalid_reduction():
    cg = vg.ComputeGraph(np.float64)
    x = cg.parameter(LOGITS)
    cases = [(losses.mse_loss, LOGITS), (losses.cross_entropy, LABELS), (losses.bce_with_logits, LOGITS)]
    for fn, target in cases:
        with pytest.raises(ValueError, match="reduction"):
            fn(x, target, reduction="avg")


def test_node_label_out_of_range_is_a_shape_error_naming_the_node():
    cg = vg.ComputeGraph(np.float64)
    logits = cg.input(np.zeros((2, 3)))
    labels = cg.input(np.array([0, 3]))  # 3 is out of range for 3 classes
    with pytest.raises(
        vg.ShapeError, match=r"<SoftmaxCrossEntropy:1>.*label 3 is out of range for 3 classes"
    ):
        losses.cross_entropy(logits, labels)
    with pytest.raises(vg.ShapeError, match=r"<TakeAlongAxis:1>"):  # nll_loss stays unfused
        losses.nll_loss(vg.log_softmax(logits), labels)


# ---------------------------------------------------------------------------- the fused op
# cross_entropy is one SoftmaxCrossEntropy node; nll_loss(log_softmax(.)) is the unfused
# composition of three ops. Both must agree, values and gradients, to rounding.


def _unfused_and_fused(logits, labels, reduction, seed=None):
    """Values and logit gradients of both paths (``seed`` for the per-row losses of "none")."""
    results = []
    for fused in (False, True):
        cg = vg.ComputeGraph(np.float64)
        x = cg.parameter(logits)
        lab = cg.input(labels)
        if fused:
            loss = losses.cross_entropy(x, lab, reduction=reduction)
            assert loss.key.type in ("SoftmaxCrossEntropy", "Mean", "Sum")
        else:
            loss = losses.nll_loss(vg.log_softmax(x), lab, reduction=reduction)
        (gx,) = cg.grad(loss, [x], seeds=seed if reduction == "none" else None)
        results.append((np.array(loss.value), gx))
    return results


SHAPES = [(7, 5), (5,), (2, 3, 4), (3, 1), (4, 257)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_agrees_with_the_unfused_path(shape, reduction):
    r = np.random.default_rng(sum(shape))
    logits = r.standard_normal(shape) * 4
    labels = r.integers(0, shape[-1], size=shape[:-1])
    seed = r.standard_normal(shape[:-1])  # any sign: the VJP must not assume g >= 0
    (v0, g0), (v1, g1) = _unfused_and_fused(logits, labels, reduction, seed)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g1, g0, rtol=1e-12, atol=1e-12)
    # and against the textbook formulas, independently of either path
    logp = ref_log_softmax(logits)
    onehot = np.eye(shape[-1])[labels]
    per = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(v1, ref_reduce(per, reduction), rtol=1e-12, atol=1e-12)
    w = {"mean": np.full(shape[:-1], 1 / max(per.size, 1)), "sum": np.ones(shape[:-1]), "none": seed}[
        reduction
    ]
    np.testing.assert_allclose(g1, w[..., None] * (np.exp(logp) - onehot), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_extreme_logits_agree_with_the_unfused_path(reduction):
    logits = np.array(
        [
            [1000.0, -1000.0, 0.0, 5.0],
            [-1000.0, -1000.0, 1000.0, 1000.0],
            [-1000.0] * 4,
            [1000.0, 999.0, -3.0, 0.0],
        ]
    )
    labels = np.array([0, 1, 3, 1])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        (v0, g0), (v1, g1) = _unfused_and_fused(logits, labels, reduction, np.array([1.0, -2.0, 0.5, 3.0]))
    assert np.all(np.isfinite(v1)) and np.all(np.isfinite(g1))
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g1, g0, rtol=1e-12, atol=1e-12)
    per = [0.0, 2000.0 + np.log(2), np.log(4), 1 + np.log1p(np.exp(-1) + np.exp(-1003) + np.exp(-1000))]
    cg = vg.ComputeGraph(np.float64)
    np.testing.assert_allclose(
        losses.cross_entropy(cg.input(logits), labels, reduction="none").value, per, rtol=1e-14, atol=1e-12
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_cross_entropy_keeps_the_dtype(dtype):
    logits = (RNG.standard_normal((6, 9)) * 3).astype(dtype)
    labels = RNG.integers(0, 9, size=6)
    cg = vg.ComputeGraph(dtype)
    x = cg.parameter(logits)
    loss = losses.cross_entropy(x, labels, reduction="sum")
    (gx,) = cg.grad(loss, [x])
    assert loss.value.dtype == dtype and gx.dtype == dtype
    l64 = logits.astype(np.float64)
    p = np.exp(ref_log_softmax(l64))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(loss.value, -ref_log_softmax(l64)[np.arange(6), labels].sum(), rtol=tol)
    np.testing.assert_allclose(gx, p - np.eye(9)[labels], atol=tol)


def test_fused_cross_entropy_over_many_row_blocks():
    """More rows than one block of the op's blocked loops (and a last, partial block)."""
    from vgraph import ops

    V = 50
    n = 3 * (ops._XENT_BLOCK // V) + 7
    r = np.random.default_rng(5)
    logits = r.standard_normal((n, V))
    labels = r.integers(-V, V, size=n)  # negative labels count from the end, as for nll_loss
    seed = r.standard_normal(n)
    (v0, g0), (v1, g1) = _unfused_and_fused(logits, labels, "none", seed)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g1, g0, rtol=1e-12, atol=1e-12)


def test_fused_cross_entropy_gradcheck_through_a_virtual_graph():
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    x = g.input("x", (None, None, 3))
    y = g.input("y", (None, None))
    w = g.parameter("w", (3, 6))
    loss = losses.cross_entropy(x @ w, y, reduction="sum")
    cg = g.build({"x": RNG.standard_normal((2, 4, 3)), "y": RNG.integers(0, 6, size=(2, 4))}, loss)
    assert any(n.key.type == "SoftmaxCrossEntropy" for n in cg.nodes())
    assert not any(n.key.type in ("LogSoftmax", "TakeAlongAxis") for n in cg.nodes())
    assert vg.gradcheck(cg.outputs[0], [g.params["w"]]).ok


@pytest.mark.parametrize(
    "labels, message",
    [
        (np.array([0.0, 1.0]), "integer class indices"),
        (np.array([0, 1, 2]), r"labels have shape \(3,\); expected \(2,\)"),
        (np.array([[0, 1]]), r"labels have shape \(1, 2\); expected \(2,\)"),
        (np.array([0, 3]), "label 3 is out of range for 3 classes"),
        (np.array([-4, 0]), "label -4 is out of range for 3 classes"),
    ],
    ids=["float", "too-long", "extra-axis", "too-large", "too-negative"],
)
def test_fused_op_rejects_bad_labels_naming_the_node(labels, message):
    cg = vg.ComputeGraph(np.float64)
    logits = cg.input(np.zeros((2, 3)))
    lab = cg.input(labels)
    with pytest.raises(vg.ShapeError, match=r"<SoftmaxCrossEntropy:1>: .*" + message):
        vg.functions.softmax_cross_entropy(logits, lab)


def test_fused_op_bad_labels_in_a_virtual_graph_name_the_node():
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    x = g.input("x", (None, 3))
    y = g.input("y", (None,))
    loss = losses.cross_entropy(x, y)
    with pytest.raises(
        vg.ShapeError, match=r"<SoftmaxCrossEntropy:1>: .*label 7 is out of range for 3 classes"
    ):
        g.build({"x": np.zeros((2, 3)), "y": np.array([0, 7])}, loss)


def test_fused_op_backward_reuses_the_forward_exponentials_and_falls_back_to_recomputing():
    """The forward keeps exp(x - max) for the VJP of its value (one pass in backward); a second
    backward (retain_graph), a direct VJP call and a forward under no_grad recompute instead, with
    the same result."""
    from vgraph import ops

    r = np.random.default_rng(7)
    logits, labels = r.standard_normal((6, 9)) * 3, r.integers(0, 9, size=6)
    expected = (np.exp(ref_log_softmax(logits)) - np.eye(9)[labels]) / 6
    gc.collect()  # (entries of earlier tests' graphs that are garbage)
    before = len(ops._XentExp.entries)
    cg = vg.ComputeGraph(np.float64)
    x = cg.parameter(logits)
    per_row = losses.cross_entropy(x, labels, reduction="none")
    loss = per_row.mean()
    assert len(ops._XentExp.entries) == before + 1  # kept by the forward ...
    (g1,) = cg.grad(loss, [x], retain_graph=True)
    assert len(ops._XentExp.entries) == before  # ... and taken by the backward
    (g2,) = cg.grad(loss, [x], retain_graph=True)  # recomputed from ans
    np.testing.assert_allclose(g1, expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g2, expected, rtol=1e-12, atol=1e-15)
    vjp = ops.OPS["SoftmaxCrossEntropy"].vjps[0]
    direct = vjp(np.full(6, 1 / 6), per_row.value, logits, labels)
    np.testing.assert_allclose(direct, expected, rtol=1e-12, atol=1e-15)
    with vg.no_grad():
        cg2 = vg.ComputeGraph(np.float64)
        out = losses.cross_entropy(cg2.input(logits), labels, reduction="none")
    assert len(ops._XentExp.entries) == before
    np.testing.assert_array_equal(out.value, per_row.value)


def test_fused_op_kept_exponentials_go_with_the_graph():
    """A forward without a backward keeps its exponentials only as long as its value lives."""
    from vgraph import ops

    gc.collect()
    before = len(ops._XentExp.entries)
    cg = vg.ComputeGraph(np.float64)
    losses.cross_entropy(cg.parameter(LOGITS), LABELS)
    assert len(ops._XentExp.entries) == before + 1
    del cg  # the graph holds the only reference to the value
    assert len(ops._XentExp.entries) == before
