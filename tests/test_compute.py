"""ComputeGraph and ComputeNode: keys, dirty-checked forward, VJP backward, grad(), no_grad,
detach, retain_grad, pruning, dtypes, deep graphs, errors and structure guards.

Expected values are computed independently with numpy (hand-written gradients) or closed forms.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import vgraph
from vgraph import ComputeGraph, NodeKey
from vgraph.ops import Op


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


# ---------------------------------------------------------------------------- NodeKey
def test_nodekey_str_and_defaults():
    assert str(NodeKey("MatMul", 1, (2, 5))) == "MatMul:1@2.5"
    assert str(NodeKey("Tanh", 3)) == "Tanh:3"
    assert NodeKey("Tanh", 3).idx == ()
    assert str(NodeKey("Add", 12, (0,))) == "Add:12@0"


def test_nodekey_is_hashable_by_value():
    a = NodeKey("MatMul", 1, (2, 5))
    b = NodeKey("MatMul", 1, (2, 5))
    assert a == b and hash(a) == hash(b)
    table = {a: "x"}
    assert table[b] == "x"
    others = {NodeKey("MatMul", 1, (5, 2)), NodeKey("MatMul", 2, (2, 5)), NodeKey("Add", 1, (2, 5))}
    assert len({a, b} | others) == 4


@pytest.mark.parametrize(
    "key",
    [
        NodeKey("MatMul", 1, (2, 5)),
        NodeKey("Tanh", 7),
        NodeKey("Check", 2, (0,)),
        NodeKey("Add", 10, (3, 0, 11)),
    ],
    ids=str,
)
def test_nodekey_parse_round_trip(key):
    parsed = NodeKey.parse(str(key))
    assert parsed == key
    assert isinstance(parsed, NodeKey)
    assert isinstance(parsed.idx, tuple)


def test_nodekey_parse_values():
    assert NodeKey.parse("MatMul:1@2.5") == NodeKey("MatMul", 1, (2, 5))
    assert NodeKey.parse("Input:3") == NodeKey("Input", 3, ())


@pytest.mark.parametrize("text", ["MatMul", "MatMul:x", "MatMul:1@a.b", ":"])
def test_nodekey_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError):
        NodeKey.parse(text)


def test_lookup_by_key_and_by_text():
    cg = ComputeGraph()
    a = cg.input(np.ones((2, 3)))
    b = cg.parameter(np.ones((3, 4)))
    m = a @ b
    t = vgraph.tanh(m)
    m2 = cg.apply("MatMul", [t, cg.input(np.ones((4, 2)))], key=NodeKey("MatMul", 1, (2, 5)))
    assert m.key == NodeKey("MatMul", 1, ())
    assert cg["MatMul:1"] is m
    assert cg.node(NodeKey("MatMul", 1, ())) is m
    assert cg.node("Tanh:1") is t
    assert cg["Input:1"] is a and cg["Parameter:1"] is b
    assert cg["MatMul:1@2.5"] is m2
    assert cg[NodeKey("MatMul", 1, (2, 5))] is m2
    assert "MatMul:1@2.5" in cg and NodeKey("Tanh", 1) in cg and "Tanh:2" not in cg


@pytest.mark.parametrize(
    "key", ["MatMul:2", "Tanh:1@0", NodeKey("Sigmoid", 1), NodeKey("MatMul", 1, (1,))], ids=str
)
def test_unknown_key_raises_vgraph_error(key):
    cg = ComputeGraph()
    vgraph.tanh(cg.input(np.ones(2)) @ cg.input(np.ones(2)))
    with pytest.raises(vgraph.VGraphError, match="no node"):
        cg[key]
    with pytest.raises(vgraph.VGraphError):
        cg.node(key)


def test_malformed_key_lookup_raises_vgraph_error():
    cg = ComputeGraph()
    cg.input(np.ones(2))
    with pytest.raises(vgraph.VGraphError):
        cg["not a key"]


# ---------------------------------------------------------------------------- dirty checking
N_BRANCHES = 10


def _branches(cg: ComputeGraph):
    """N inputs, each -> tanh -> *2, summed left to right by a chain of Adds, then Sum."""
    r = rng()
    values = [r.standard_normal(3) for _ in range(N_BRANCHES)]
    xs = [cg.input(v) for v in values]
    tanhs = [vgraph.tanh(x) for x in xs]
    muls = [t * 2.0 for t in tanhs]
    adds = []
    s = muls[0]
    for m in muls[1:]:
        s = s + m
        adds.append(s)
    loss = s.sum()
    return values, xs, tanhs, muls, adds, loss


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_forward_recomputes_exactly_the_dependent_path(k):
    cg = ComputeGraph(dtype=np.float64)
    values, xs, tanhs, muls, adds, loss = _branches(cg)
    assert len(adds) == N_BRANCHES - 1
    cg.forward(loss)
    assert cg.last_forward.recomputed == 0  # values were computed when the nodes were added

    new = np.array([0.3, -1.2, 2.5])
    xs[k].set_value(new)
    values[k] = new
    value = cg.forward(loss, explain=True)

    # Branch k's Tanh and Mul; Add j (0-based) joins branch j + 1, so branch k feeds
    # adds[max(k, 1) - 1] and every Add after it; then the final Sum.
    first_add = max(k, 1) - 1
    downstream_adds = adds[first_add:]
    expected = 2 + len(downstream_adds) + 1
    assert expected == 2 + (N_BRANCHES - max(k, 1)) + 1
    report = cg.last_forward
    assert report.recomputed == expected
    assert report.visited == 2 * N_BRANCHES + (N_BRANCHES - 1) + 1

    # explain: which parents had changed, in the order the nodes were recomputed.
    expected_explanation = [(tanhs[k].key, (xs[k].key,)), (muls[k].key, (tanhs[k].key,))]
    first = adds[first_add]
    expected_explanation.append((first.key, (muls[k].key,)))
    for prev, add in itertools.pairwise(downstream_adds):
        expected_explanation.append((add.key, (prev.key,)))
    expected_explanation.append((loss.key, (downstream_adds[-1].key,)))
    assert report.explanation == expected_explanation
    assert f"recomputed {expected} of" in str(report)

    np.testing.assert_allclose(value, sum(2.0 * np.tanh(v) for v in values).sum(), rtol=1e-13)
    np.testing.assert_allclose(muls[k].value, 2 * np.tanh(new), rtol=1e-15)

    cg.forward(loss)
    assert cg.last_forward.recomputed == 0
    assert cg.last_forward.explanation is None  # explain was not asked for


def test_forward_of_an_unrelated_target_recomputes_nothing():
    cg = ComputeGraph(dtype=np.float64)
    values, xs, tanhs, muls, adds, loss = _branches(cg)
    xs[5].value = np.zeros(3)
    cg.forward(muls[0])
    assert cg.last_forward.recomputed == 0
    assert cg.last_forward.visited == 2
    np.testing.assert_array_equal(muls[5].value, 2 * np.tanh(values[5]))  # not yet recomputed
    cg.forward([muls[0], muls[5]])
    assert cg.last_forward.recomputed == 2
    np.testing.assert_array_equal(muls[5].value, np.zeros(3))


def test_leaf_values_are_read_only_and_set_values_bump_the_version():
    cg = ComputeGraph(dtype=np.float64)
    p0 = np.array([0.5, -1.0, 2.0])
    p = cg.parameter(p0)
    y = vgraph.tanh(p).sum()
    v0 = p.version
    with pytest.raises(ValueError, match="read-only"):  # in place would bypass dirty checking
        p.value -= 0.1
    assert p.version == v0
    np.testing.assert_array_equal(p.value, p0)
    p.value = p.value - 0.1  # the way: a new value through the setter
    assert p.version > v0
    np.testing.assert_allclose(p.value, p0 - 0.1, rtol=1e-15)
    out = cg.forward(y)
    assert cg.last_forward.recomputed == 2
    np.testing.assert_allclose(out, np.tanh(p0 - 0.1).sum(), rtol=1e-14)


def test_parameter_copies_its_initial_value():
    cg = ComputeGraph(dtype=np.float64)
    init = np.array([1.0, 2.0])
    p = cg.parameter(init)
    init[0] = 100.0
    assert p.value[0] == 1.0


# ---------------------------------------------------------------------------- backward
class Model:
    """Y = tanh(X @ W.T + b); loss = mean((Y - T)^2), in float64, with hand-written gradients."""

    def __init__(self, dtype=np.float64):
        r = rng()
        self.W0 = r.standard_normal((3, 4))
        self.b0 = r.standard_normal(3)
        self.X0 = r.standard_normal((5, 4))
        self.T0 = r.standard_normal((5, 3))
        cg = self.cg = ComputeGraph(dtype=dtype)
        self.W = cg.parameter(self.W0, name="W")
        self.b = cg.parameter(self.b0, name="b")
        self.X = cg.input(self.X0, name="X")
        self.T = cg.input(self.T0, name="T")
        self.Z = self.X @ self.W.T + self.b
        self.Y = vgraph.tanh(self.Z)
        diff = self.Y - self.T
        self.loss = (diff * diff).mean()

    def numpy_forward(self):
        Y = np.tanh(self.X0 @ self.W0.T + self.b0)
        return Y, np.mean((Y - self.T0) ** 2)

    def numpy_grads(self, dY=None):
        """dL/dW, dL/db (and dL/dY) for loss; or for the objective whose dL/dY is given."""
        Y, _ = self.numpy_forward()
        if dY is None:
            dY = 2.0 * (Y - self.T0) / Y.size
        dZ = dY * (1.0 - Y**2)
        return dZ.T @ self.X0, dZ.sum(axis=0), dY


def test_backward_returns_loss_and_matches_hand_gradients():
    m = Model()
    _, loss_ref = m.numpy_forward()
    out = m.cg.backward(m.loss)
    assert isinstance(out, float)
    assert out == pytest.approx(loss_ref, rel=1e-13)
    dW, db, _ = m.numpy_grads()
    np.testing.assert_allclose(m.W.grad, dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m.b.grad, db, rtol=1e-12, atol=1e-15)
    assert m.X.grad is None  # the input does not require a gradient


def test_gradients_accumulate_and_zero_grad_clears():
    m = Model()
    dW, db, _ = m.numpy_grads()
    m.cg.backward(m.loss)
    m.cg.forward(m.loss)
    m.cg.backward(m.loss)
    np.testing.assert_allclose(m.W.grad, 2 * dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m.b.grad, 2 * db, rtol=1e-12, atol=1e-15)
    m.cg.zero_grad()
    assert m.W.grad is None and m.b.grad is None
    m.cg.forward(m.loss)
    m.cg.backward(m.loss)
    np.testing.assert_allclose(m.W.grad, dW, rtol=1e-12, atol=1e-15)


def test_second_backward_without_forward_is_refused():
    m = Model()
    m.cg.backward(m.loss)
    g = m.W.grad.copy()
    with pytest.raises(vgraph.GraphStateError, match="retain_graph"):
        m.cg.backward(m.loss)
    np.testing.assert_array_equal(m.W.grad, g)  # the refused call changed nothing
    m.cg.forward(m.loss)
    m.cg.backward(m.loss)  # allowed again after a forward


def test_retain_graph_allows_two_backwards_which_accumulate():
    m = Model()
    dW, db, _ = m.numpy_grads()
    assert m.cg.backward_ex(m.loss, retain_graph=True) == pytest.approx(m.numpy_forward()[1], rel=1e-13)
    m.cg.backward_ex(m.loss, retain_graph=True)
    np.testing.assert_allclose(m.W.grad, 2 * dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m.b.grad, 2 * db, rtol=1e-12, atol=1e-15)


def test_multi_task_losses_sharing_parameters_sum_their_gradients():
    m = Model()
    loss2 = (m.Y * m.W.sum()).sum()  # depends on W directly and through Y
    Y, _ = m.numpy_forward()
    dW1, db1, _ = m.numpy_grads()
    # loss2 = s * sum(Y) with s = sum(W): d/dY = s, plus d/dW sum(Y) directly.
    s = m.W0.sum()
    dW2, db2, _ = m.numpy_grads(dY=np.full(Y.shape, s))
    dW2 = dW2 + Y.sum()
    m.cg.backward_ex(m.loss, retain_graph=True)
    m.cg.backward(loss2)
    np.testing.assert_allclose(m.W.grad, dW1 + dW2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m.b.grad, db1 + db2, rtol=1e-12, atol=1e-14)
    with pytest.raises(vgraph.GraphStateError):  # the second backward did not retain the graph
        m.cg.backward(m.loss)


def test_grad_without_retain_graph_releases_the_graph():
    m = Model()
    m.cg.grad(m.loss, [m.W])
    with pytest.raises(vgraph.GraphStateError, match="retain_graph"):
        m.cg.grad(m.loss, [m.W])
    m.cg.forward(m.loss)
    m.cg.grad(m.loss, [m.W], retain_graph=True)
    m.cg.grad(m.loss, [m.W])


def test_non_scalar_backward_needs_a_seed_of_the_right_shape():
    m = Model()
    with pytest.raises(vgraph.ShapeError, match=r"\(5, 3\)"):
        m.cg.backward(m.Y)
    assert m.W.grad is None
    seed = np.random.default_rng(1).standard_normal((5, 3))
    with pytest.raises(vgraph.ShapeError):
        m.cg.backward(m.Y, seed=np.ones((3, 5)))
    with pytest.raises(vgraph.ShapeError):
        m.cg.backward(m.Y, seed=np.ones(15))
    assert m.cg.backward(m.Y, seed=seed) is None
    dW, db, _ = m.numpy_grads(dY=seed)
    np.testing.assert_allclose(m.W.grad, dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m.b.grad, db, rtol=1e-12, atol=1e-15)


def test_backward_of_a_size_one_non_scalar_loss_returns_a_float():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.parameter([1.0, 2.0])
    loss = (x * x).sum(keepdims=True)  # shape (1,)
    assert cg.backward(loss) == 5.0
    np.testing.assert_array_equal(x.grad, [2.0, 4.0])


# ---------------------------------------------------------------------------- detach and no_grad
def test_detach_stops_the_gradient():
    cg = ComputeGraph(dtype=np.float64)
    a0 = np.array([0.5, -1.5, 2.0])
    a = cg.parameter(a0)
    d = vgraph.detach(a * a)
    assert d.key.type == "Detach" and not d.requires_grad
    loss = (d * a).sum()  # gradient a*a (through the direct path only), not 3 a^2
    cg.backward(loss)
    np.testing.assert_allclose(a.grad, a0 * a0, rtol=1e-15)
    d_sum = d.sum()
    cg.forward(d_sum)
    with pytest.raises(vgraph.GraphStateError, match="does not depend"):
        cg.backward(d_sum)  # nothing below the detach requires a gradient


def test_no_grad_nodes_do_not_require_grad():
    cg = ComputeGraph(dtype=np.float64)
    p = cg.parameter([1.0, 2.0])
    assert vgraph.is_grad_enabled()
    with vgraph.no_grad():
        assert not vgraph.is_grad_enabled()
        y = vgraph.tanh(p)
        loss = y.sum()
    assert not y.requires_grad and not loss.requires_grad
    np.testing.assert_allclose(loss.value, np.tanh([1.0, 2.0]).sum(), rtol=1e-15)
    with pytest.raises(vgraph.GraphStateError, match="does not depend"):
        cg.backward(loss)
    assert vgraph.is_grad_enabled()
    assert vgraph.tanh(p).requires_grad


def test_no_grad_mode_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"), vgraph.no_grad():
        assert not vgraph.is_grad_enabled()
        raise RuntimeError("boom")
    assert vgraph.is_grad_enabled()
    with vgraph.no_grad():
        with vgraph.no_grad():
            pass
        assert not vgraph.is_grad_enabled()  # the inner block restores the outer mode
    assert vgraph.is_grad_enabled()
    cg = ComputeGraph()
    assert vgraph.tanh(cg.parameter([1.0])).requires_grad


# ---------------------------------------------------------------------------- retain_grad
def test_retain_grad_keeps_only_the_marked_intermediate():
    m = Model()
    assert m.Y.retain_grad() is m.Y
    m.cg.backward(m.loss)
    _, _, dY = m.numpy_grads()
    np.testing.assert_allclose(m.Y.grad, dY, rtol=1e-13, atol=1e-16)
    assert m.Z.grad is None
    assert m.loss.grad is None
    assert all(n.grad is None for n in m.cg.nodes() if n.op is not None and n is not m.Y)
    assert m.W.grad is not None and m.b.grad is not None


# ---------------------------------------------------------------------------- grad()
def test_grad_returns_gradients_without_touching_dot_grad():
    m = Model()
    dW, db, _ = m.numpy_grads()
    gW, gb = m.cg.grad(m.loss, [m.W, m.b], retain_graph=True)
    np.testing.assert_allclose(gW, dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gb, db, rtol=1e-12, atol=1e-15)
    assert m.W.grad is None and m.b.grad is None
    # Asking again gives the same (nothing accumulated anywhere).
    gW, gb = m.cg.grad(m.loss, [m.W, m.b])
    np.testing.assert_allclose(gW, dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gb, db, rtol=1e-12, atol=1e-15)
    assert m.W.grad is None and m.b.grad is None


def test_grad_works_for_intermediate_nodes():
    m = Model()
    dW, db, dY = m.numpy_grads()
    gY, gW, gb = m.cg.grad(m.loss, [m.Y, m.W, m.b])
    np.testing.assert_allclose(gY, dY, rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(gW, dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gb, db, rtol=1e-12, atol=1e-15)
    assert m.Y.grad is None and m.W.grad is None


def test_grad_of_a_non_scalar_output_with_a_seed():
    m = Model()
    seed = np.random.default_rng(2).standard_normal((5, 3))
    (gb,) = m.cg.grad(m.Y, m.b, seeds=seed)  # single nodes, not lists
    np.testing.assert_allclose(gb, m.numpy_grads(dY=seed)[1], rtol=1e-12, atol=1e-15)
    m.cg.forward(m.Y)
    with pytest.raises(vgraph.ShapeError):
        m.cg.grad(m.Y, m.b)


def test_grad_leaves_no_pending_gradient_on_pruned_parents():
    m = Model()
    dW, db, _ = m.numpy_grads()
    m.cg.grad(m.loss, [m.W])  # Add(MatMul, b) also sends a gradient to b, which is pruned
    m.cg.forward(m.loss)
    m.cg.backward(m.loss)
    np.testing.assert_allclose(m.W.grad, dW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m.b.grad, db, rtol=1e-12, atol=1e-15)


def test_grad_refuses_an_unconnected_input_unless_allow_unused():
    # As torch.autograd.grad: an input the outputs do not use is an error by default (it is
    # usually a mistake), None with allow_unused=True.
    m = Model()
    other = m.cg.parameter(np.ones((2, 2)))
    with pytest.raises(vgraph.GraphStateError, match=r"Parameter:\d+.*allow_unused=True"):
        m.cg.grad(m.loss, [m.W, other])
    gW, g_other = m.cg.grad(m.loss, [m.W, other], allow_unused=True)
    assert g_other is None
    np.testing.assert_allclose(gW, m.numpy_grads()[0], rtol=1e-12, atol=1e-15)


def test_grad_refuses_an_input_without_requires_grad():
    m = Model()
    with pytest.raises(vgraph.GraphStateError, match="Input:1"):
        m.cg.grad(m.loss, [m.X])
    x = m.cg.input(np.ones(4), requires_grad=True)
    (g,) = m.cg.grad((x * x).sum(), [x])
    np.testing.assert_array_equal(g, 2 * np.ones(4))


def test_grad_with_only_unconnected_inputs_leaves_no_stale_gradient():
    m = Model()
    other = m.cg.parameter(np.ones(2))
    (g,) = m.cg.grad(m.loss, [other], allow_unused=True)
    assert g is None
    m.cg.forward(m.loss)
    m.cg.backward(m.loss)
    np.testing.assert_allclose(m.W.grad, m.numpy_grads()[0], rtol=1e-12, atol=1e-15)


def test_grad_does_not_touch_retained_gradients():
    m = Model()
    m.Y.retain_grad()
    m.cg.grad(m.loss, [m.W])
    assert m.Y.grad is None


# ---------------------------------------------------------------------------- pruning
def test_backward_prunes_branches_without_trainable_leaves():
    cg = ComputeGraph(dtype=np.float64)
    calls = []

    def exploding_vjp(g, ans, x):
        calls.append(1)
        raise AssertionError("VJP of a pruned node was called")

    boom = Op("Boom", np.tanh, (exploding_vjp,), arity=1)
    c = cg.input(np.linspace(-1, 1, 4))  # no gradient wanted
    branch = [c]
    for _ in range(20):
        branch.append(cg.apply(boom, [branch[-1] * 1.5]))
    big = branch[-1]
    p = cg.parameter(np.array([0.1, 0.2, 0.3, 0.4]))
    prod = p * big
    loss = prod.sum()

    branch_nodes = cg._ancestors([big])
    assert len(branch_nodes) > 40
    assert not any(n.requires_grad for n in branch_nodes)
    plan = cg._backward_plan()
    assert set(plan) == {loss, prod, p}
    assert plan[0] is loss and plan[-1] is p  # reverse topological order

    cg.backward(loss)
    assert calls == []
    np.testing.assert_allclose(p.grad, big.value, rtol=1e-15)

    # Control: the same op on the parameter's path is differentiated (and the VJP is called).
    cg2 = ComputeGraph(dtype=np.float64)
    q = cg2.parameter(np.ones(2))
    with pytest.raises(vgraph.BackwardError, match="pruned") as info:
        cg2.backward(cg2.apply(boom, [q]).sum())
    assert isinstance(info.value.__cause__, AssertionError)
    assert calls == [1]


# ---------------------------------------------------------------------------- dtypes
def test_default_dtype_is_float32():
    assert vgraph.get_default_dtype() == np.float32
    m = Model(dtype=None)
    assert m.cg.dtype == np.float32
    for node in (m.W, m.b, m.X, m.Z, m.Y, m.loss):
        assert node.dtype == np.float32, node
    cg = ComputeGraph()
    assert cg.input(1.5).dtype == np.float32
    assert cg.constant(2).dtype == np.float32  # a Python int is a float constant
    m.cg.backward(m.loss)
    assert m.W.grad.dtype == np.float32 and m.b.grad.dtype == np.float32
    dW, _, _ = m.numpy_grads()
    np.testing.assert_allclose(m.W.grad, dW, rtol=1e-4, atol=1e-6)


def test_float64_per_graph():
    cg = ComputeGraph(dtype=np.float64)
    assert cg.dtype == np.float64
    x = cg.input(np.ones(3, dtype=np.float32))
    assert x.dtype == np.float64
    assert (vgraph.tanh(x) * 2).dtype == np.float64
    assert ComputeGraph().dtype == np.float32  # other graphs unaffected
    with pytest.raises(TypeError):
        ComputeGraph(dtype=np.int64)


@pytest.fixture
def restore_default_dtype():
    old = vgraph.get_default_dtype()
    try:
        yield
    finally:
        vgraph.set_default_dtype(old)


def test_set_default_dtype_globally(restore_default_dtype):
    vgraph.set_default_dtype(np.float64)
    assert vgraph.get_default_dtype() == np.float64
    cg = ComputeGraph()
    assert cg.dtype == np.float64
    assert cg.parameter([1, 2]).dtype == np.float64
    assert ComputeGraph(dtype=np.float32).dtype == np.float32
    with pytest.raises(TypeError):
        vgraph.set_default_dtype(np.int32)
    assert vgraph.get_default_dtype() == np.float64


def test_integer_and_bool_values_stay_integer():
    cg = ComputeGraph(dtype=np.float64)
    idx = cg.input(np.array([0, 2, 2]))
    assert idx.dtype.kind == "i"
    assert cg.input([1, 0]).dtype.kind == "i"
    assert cg.input(np.array([True, False])).dtype == np.bool_
    assert cg.input(np.arange(3, dtype=np.uint8)).dtype == np.uint8
    idx.value = np.array([1, 1])
    assert idx.dtype.kind == "i"
    # A bool mask as a Where condition keeps selecting.
    w = vgraph.where(cg.input(np.array([True, False, True])), cg.input(np.ones(3)), cg.input(np.zeros(3)))
    np.testing.assert_array_equal(w.value, [1.0, 0.0, 1.0])


def test_integer_input_set_to_floats_takes_the_graph_dtype():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([0, 1]))
    x.value = np.array([0.5, 1.5])
    assert x.dtype == np.float64


def test_float_parameter_set_from_integers_stays_float():
    cg = ComputeGraph(dtype=np.float64)
    p = cg.parameter([1.0, 2.0])
    p.value = [3, 4]
    assert p.dtype == np.float64


# ---------------------------------------------------------------------------- deep graphs
def test_100k_node_chain_without_recursion():
    n = 100_000
    cg = ComputeGraph(dtype=np.float64)
    p = cg.parameter(1.0)
    c = cg.constant(1.0001)
    x = p
    for _ in range(n):
        x = x * c
    assert len(cg) == n + 2
    p.value = 2.0
    out = cg.forward(x)
    assert cg.last_forward.recomputed == n
    assert out == pytest.approx(2.0 * 1.0001**n, rel=1e-9)
    assert cg.backward(x) == pytest.approx(2.0 * 1.0001**n, rel=1e-9)
    assert float(p.grad) == pytest.approx(1.0001**n, rel=1e-9)


# ---------------------------------------------------------------------------- errors
def test_matmul_shape_error_names_the_node_and_shapes():
    cg = ComputeGraph()
    a = cg.input(np.ones((2, 3)))
    b = cg.input(np.ones((4, 5)))
    n_before = len(cg)
    with pytest.raises(vgraph.ShapeError) as info:
        a @ b
    msg = str(info.value)
    assert "MatMul:1" in msg and "(2, 3)" in msg and "(4, 5)" in msg
    assert isinstance(info.value, ValueError)
    # The failed apply left the graph unchanged: no node, and the id was not used up.
    assert len(cg) == n_before
    assert "MatMul:1" not in cg
    good = a @ cg.input(np.ones((3, 5)))
    assert good.key == NodeKey("MatMul", 1, ())


def test_failed_apply_with_an_array_operand_leaves_the_graph_unchanged():
    cg = ComputeGraph()
    a = cg.input(np.ones((2, 3)))
    n_before = len(cg)
    with pytest.raises(vgraph.ShapeError):
        a @ np.ones((4, 5))
    assert len(cg) == n_before


def test_elementwise_broadcast_error_is_a_shape_error():
    cg = ComputeGraph()
    with pytest.raises(vgraph.ShapeError, match=r"Add:1.*\(3,\).*\(4,\)"):
        cg.input(np.ones(3)) + cg.input(np.ones(4))


def test_setting_a_parameter_to_another_shape_is_refused():
    cg = ComputeGraph()
    p = cg.parameter(np.ones((2, 3)), name="w")
    v0 = p.version
    with pytest.raises(vgraph.ShapeError, match="Parameter:1"):
        p.value = np.ones((3, 2))
    assert p.shape == (2, 3) and p.version == v0
    x = cg.input(np.ones(3))
    x.value = np.ones(5)  # inputs may change shape (a new batch size, say)
    assert x.shape == (5,)


def test_setting_an_op_node_is_refused():
    cg = ComputeGraph()
    y = vgraph.tanh(cg.input(np.ones(2)))
    with pytest.raises(vgraph.GraphStateError, match="Tanh:1"):
        y.value = np.zeros(2)
    with pytest.raises(vgraph.GraphStateError):
        y.set_value(np.zeros(2))
    np.testing.assert_allclose(y.value, np.tanh(np.ones(2)), rtol=1e-6)


def test_augmented_assignment_on_an_op_node_leaves_its_value_alone():
    cg = ComputeGraph(dtype=np.float64)
    y = vgraph.tanh(cg.input(np.ones(2)))
    with pytest.raises((vgraph.GraphStateError, ValueError)):
        y.value -= 1.0
    np.testing.assert_allclose(y.value, np.tanh(np.ones(2)), rtol=1e-15)


def test_power_with_a_node_exponent_is_refused():
    cg = ComputeGraph()
    x = cg.input(np.ones(2))
    with pytest.raises(vgraph.VGraphError):
        x ** cg.input(2.0)
    with pytest.raises(vgraph.VGraphError):
        x ** np.array([2.0, 3.0])


def test_unknown_op_and_wrong_arity_are_vgraph_errors():
    cg = ComputeGraph()
    x = cg.input(np.ones(2))
    with pytest.raises(vgraph.VGraphError, match="unknown op"):
        cg.apply("NoSuchOp", [x])
    with pytest.raises(vgraph.VGraphError, match="takes 2 inputs"):
        cg.apply("Add", [x])


def test_numpy_operands_mixed_with_nodes_give_nodes():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([0.5, 2.0, -1.0])
    x = cg.input(x0)
    M = np.arange(6.0).reshape(2, 3)
    cases = [
        (np.ones(3) + x, np.ones(3) + x0),
        (x + np.ones(3), x0 + 1.0),
        (np.full(3, 2.0) - x, 2.0 - x0),
        (2.0 - x, 2.0 - x0),
        (np.full(3, 3.0) * x, 3.0 * x0),
        (1.0 / x, 1.0 / x0),
        (np.ones(3) / x, 1.0 / x0),
        (M @ x, M @ x0),
        (x @ M.T, x0 @ M.T),
        (np.float64(2.0) * x, 2.0 * x0),
    ]
    for node, expected in cases:
        assert isinstance(node, vgraph.ComputeNode)
        assert node.graph is cg
        np.testing.assert_allclose(node.value, expected, rtol=1e-15)


# ---------------------------------------------------------------------------- guards
def _sum_is_nonnegative(v):
    if v.sum() < 0:
        raise vgraph.StructureChangedError(f"the sum of x became negative ({v.sum():g})")
    return True


def test_guard_refuses_forward_and_backward_until_the_structure_holds_again():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([1.0, 2.0, 0.5])
    x = cg.input(x0, requires_grad=True)
    w = cg.parameter(np.array([0.5, -1.0, 2.0]))
    guard = cg.guard([x], _sum_is_nonnegative, key=NodeKey("Check", 1, ()))
    assert cg["Check:1"] is guard
    assert not guard.requires_grad
    loss = (w * x).sum()
    assert cg.backward(loss) == pytest.approx(0.5 - 2.0 + 1.0)

    x.value = np.array([-5.0, 1.0, 1.0])
    with pytest.raises(vgraph.StructureChangedError, match="negative"):
        cg.forward(loss)
    with pytest.raises(vgraph.StructureChangedError):
        cg.backward(loss)
    with pytest.raises(vgraph.StructureChangedError):
        cg.grad(loss, [w])
    # Every forward runs the guards, also one of a target that does not depend on x.
    with pytest.raises(vgraph.StructureChangedError):
        cg.forward(w * 2.0)

    x.value = x0
    cg.zero_grad()
    assert cg.forward(loss) == pytest.approx(0.5 - 2.0 + 1.0)
    cg.backward(loss)
    np.testing.assert_array_equal(w.grad, x0)
    np.testing.assert_array_equal(x.grad, [0.5, -1.0, 2.0])

    # A new value that keeps the structure is fine.
    x.value = np.array([3.0, -1.0, 0.0])
    assert cg.forward(loss) == pytest.approx(1.5 + 1.0)
    cg.backward(loss)


def test_an_input_never_shares_memory_with_what_the_caller_holds():
    """cg.input copies the caller's array, a view of it, or the buffer an object exposes through
    __array__ (the same rule as a build's feed): a later in-place change does not reach the graph."""

    class Holder:
        def __init__(self):
            self.buf = np.arange(3.0)

        def __array__(self, dtype=None, copy=None):
            return self.buf

    base = np.arange(6.0)
    holder = Holder()
    cg = ComputeGraph(np.float64)
    nodes = [cg.input(base), cg.input(base[1:4]), cg.input(holder)]
    before = [n.value.copy() for n in nodes]
    base += 100.0
    holder.buf += 100.0
    for n, b in zip(nodes, before):
        np.testing.assert_array_equal(n.value, b)
