"""vgraph.check: gradcheck (finite differences against the VJPs) and jacobian."""

from __future__ import annotations

import numpy as np
import pytest

import vgraph
from vgraph import ComputeGraph
from vgraph.check import GradcheckResult, gradcheck, jacobian
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
    assert result.ok and result.failures == []
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
    assert "check_vjps" in msg  # points to the localised check
    assert isinstance(info.value, AssertionError)

    result = gradcheck(loss, [x], raise_on_failure=False)
    assert not result.ok
    assert result.checked == 4
    assert len(result.failures) == 1
    f = result.failures[0]
    assert f.leaf == "<Input:1> 'xin'" and f.index == (2,)
    assert f.analytic == pytest.approx(3 * 2 * 1.5, rel=1e-12)
    assert f.numeric == pytest.approx(2 * 1.5, rel=1e-6)
    assert f.abs_error == pytest.approx(6.0, rel=1e-6)  # 9 vs 3
    assert f.rel_error == pytest.approx(2.0, rel=1e-6)  # 6 / 3
    assert result.max_abs_error == pytest.approx(6.0, rel=1e-6)
    assert result.max_rel_error == pytest.approx(2.0, rel=1e-6)
    assert "BadSquare" not in OPS  # the broken op was never registered globally


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
    assert [f.index for f in result.failures] == [(1,), (0,)]
    assert result.failures[0].analytic == pytest.approx(2.0)
    assert result.failures[0].numeric == pytest.approx(4.0, rel=1e-6)
    only_detached = vgraph.detach(x).sum() + (x * 0.0).sum()
    f = gradcheck(only_detached, [x], raise_on_failure=False).failures
    assert {(g.index, g.analytic) for g in f} == {((0,), 0.0), ((1,), 0.0)}


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
