"""The primitive table (vgraph.ops): each op's forward against plain numpy and its VJPs against
central finite differences (vgraph.check.gradcheck), in float64, over several shapes including
broadcasting and scalars.

The table ``CASES`` below has one row per (op, input shapes, attributes). Each row gives

* ``build``: how a user writes it with vgraph (operators or ``vgraph.*`` functions),
* ``ref``: the same computation in plain numpy (the expected forward value),
* ``inputs``: generators of the input values (domains chosen so that the op is smooth there:
  positive for Log and fractional powers, away from 0 for Relu/Abs/division, distinct values
  for Max).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import vgraph
from vgraph import ComputeGraph, ops
from vgraph.check import gradcheck
from vgraph.ops import OPS, as_array, unbroadcast

STRUCTURAL = {"Detach", "Branch", "Identity"}
ZERO_GRADIENT = {"Step", "Sign"}
NO_GRADIENT = {"ArgMax", "ArgMin", "OneHot"}  # integer outputs, or integer inputs only


# ---------------------------------------------------------------------------- input domains
def normal(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda r: np.asarray(r.standard_normal(shape))


def positive(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda r: np.asarray(r.uniform(0.5, 2.0, shape))


def away(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    """|x| in [0.2, 2] with a random sign: far from the kink at 0 (relative to eps = 1e-6)."""
    return lambda r: np.asarray(r.uniform(0.2, 2.0, shape) * r.choice([-1.0, 1.0], shape))


def distinct(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    """Pairwise distinct values at least 0.24 apart: no ties for Max."""
    n = int(np.prod(shape, dtype=int))
    return lambda r: np.asarray((r.permutation(n) * 0.25 - 1.0 + r.uniform(0, 0.01, n)).reshape(shape))


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Case:
    id: str
    op: str
    build: Callable[..., Any]
    ref: Callable[..., np.ndarray]
    inputs: tuple[Callable[[np.random.Generator], np.ndarray], ...]

    def __str__(self) -> str:
        return self.id


CASES: list[Case] = []


def case(id_: str, op: str, build, ref, *inputs) -> None:
    CASES.append(Case(f"{op}-{id_}", op, build, ref, inputs))


def shape_id(*shapes: tuple[int, ...]) -> str:
    return ",".join("x".join(map(str, s)) or "scalar" for s in shapes)


# Binary elementwise ops with broadcasting (second operand of Div kept away from 0).
BROADCAST_PAIRS = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((4,), (3, 4)),
    ((2, 1, 3), (4, 1)),
    ((4, 1), (1, 5)),
    ((), (3,)),
    ((3, 4), ()),
    ((), ()),
]
for sa, sb in BROADCAST_PAIRS:
    sid = shape_id(sa, sb)
    case(sid, "Add", lambda a, b: a + b, np.add, normal(*sa), normal(*sb))
    case(sid, "Sub", lambda a, b: a - b, np.subtract, normal(*sa), normal(*sb))
    case(sid, "Mul", lambda a, b: a * b, np.multiply, normal(*sa), normal(*sb))
    case(sid, "Div", lambda a, b: a / b, np.divide, normal(*sa), away(*sb))

UNARY = [
    ("Neg", lambda x: -x, np.negative, normal),
    ("Exp", vgraph.exp, np.exp, normal),
    ("Log", vgraph.log, np.log, positive),
    ("Tanh", vgraph.tanh, np.tanh, normal),
    ("Sigmoid", vgraph.sigmoid, lambda x: 1.0 / (1.0 + np.exp(-x)), normal),
    ("Relu", vgraph.relu, lambda x: np.where(x > 0, x, 0.0), away),
    ("Softplus", vgraph.softplus, lambda x: np.log1p(np.exp(x)), normal),
    ("Abs", lambda x: abs(x), np.abs, away),  # the Python builtin goes through __abs__
    ("Abs", vgraph.abs, np.abs, away),
    ("Sqrt", vgraph.sqrt, np.sqrt, positive),
]
for op, build, ref, domain in UNARY:
    for shape in [(), (5,), (3, 4), (2, 3, 4)]:
        case(shape_id(shape) + ("-fn" if build is vgraph.abs else ""), op, build, ref, domain(*shape))

# Maximum and Minimum: broadcasting, operands apart (ties are tested separately below).
for sa, sb in BROADCAST_PAIRS:
    sid = shape_id(sa, sb)
    case(sid, "Maximum", vgraph.maximum, np.maximum, distinct(*sa), away(*sb))
    case(sid, "Minimum", vgraph.minimum, np.minimum, distinct(*sa), away(*sb))
case("number", "Maximum", lambda x: vgraph.maximum(x, 0.1), lambda x: np.maximum(x, 0.1), away(3, 4))

# Clip: values away from the bounds (the kinks), one bound or both.
for lo, hi in [(-0.5, 0.5), (None, 0.3), (-0.3, None)]:
    case(
        f"lo{lo}-hi{hi}", "Clip",
        lambda x, lo=lo, hi=hi: vgraph.clip(x, lo, hi), lambda x, lo=lo, hi=hi: np.clip(x, lo, hi),
        lambda r: np.asarray(r.choice([-1.7, -0.9, -0.1, 0.05, 0.2, 1.3], (3, 4)) + r.uniform(0, 0.01, (3, 4))),
    )  # fmt: skip

# Pow: a scalar exponent (an attribute, not an input).
for p, domain in [(3.0, normal), (2, normal), (0.5, positive), (1.7, positive), (-1.5, positive)]:
    for shape in [(), (3, 4)]:
        case(
            f"p{p}-{shape_id(shape)}", "Pow",
            lambda x, p=p: x**p, lambda x, p=p: np.power(x, p), domain(*shape),
        )  # fmt: skip

# MatMul: 2-D, 1-D on either side, batched with broadcast batch dimensions.
MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((1, 3, 4), (5, 4, 2)),
    ((5, 3, 4), (1, 4, 2)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((4,), (2, 4, 3)),
    ((2, 3, 4), (4,)),
    ((2, 5, 3, 4), (4, 2)),  # weight gradient summed over two batch axes in one product
    ((2, 1, 3, 4), (1, 5, 4, 2)),  # both operands broadcast over different axes
    ((2, 5, 3, 4), (5, 4, 2)),
    ((3, 8), (2, 8, 2)),  # a matrix on the left summed over the batch (m*k > n*(m+k))
    ((4,), (2, 3, 4, 5)),
]
for sa, sb in MATMUL_SHAPES:
    case(shape_id(sa, sb), "MatMul", lambda a, b: a @ b, np.matmul, normal(*sa), normal(*sb))
case("fn", "MatMul", vgraph.matmul, np.matmul, normal(2, 3), normal(3, 2))

# Linear: x @ w + b, the bias the shape of the product's last axes.
LINEAR_SHAPES = [
    ((3, 4), (4, 5), (5,)),
    ((4,), (4, 5), (5,)),
    ((2, 3, 4), (4, 5), (5,)),
    ((2, 3, 4), (2, 4, 5), (5,)),
    ((2, 3, 4), (2, 4, 5), (3, 5)),
    ((2, 3, 4), (4, 5), (2, 3, 5)),  # a bias as large as the product
    ((4,), (4,), ()),  # a scalar product
]
for sx, sw, sb in LINEAR_SHAPES:
    case(
        shape_id(sx, sw, sb), "Linear", vgraph.functions.linear, lambda x, w, b: x @ w + b,
        normal(*sx), normal(*sw), normal(*sb),
    )  # fmt: skip

# Sum and Mean: axis None / int / negative int / tuple, keepdims both ways.
for axis in [None, 0, 1, -1, (0, 2), (-1, 0), (0, 1, 2)]:
    for keepdims in [False, True]:
        sid = f"axis{axis}-keep{keepdims}"
        case(
            sid, "Sum",
            lambda x, a=axis, k=keepdims: x.sum(axis=a, keepdims=k),
            lambda x, a=axis, k=keepdims: np.sum(x, axis=a, keepdims=k),
            normal(2, 3, 4),
        )  # fmt: skip
        case(
            sid, "Mean",
            lambda x, a=axis, k=keepdims: vgraph.mean(x, axis=a, keepdims=k),
            lambda x, a=axis, k=keepdims: np.mean(x, axis=a, keepdims=k),
            normal(2, 3, 4),
        )  # fmt: skip
case("vector", "Sum", vgraph.sum, np.sum, normal(5))
case("scalar", "Mean", lambda x: x.mean(), np.mean, normal())

# Max: no ties in these inputs (ties are tested separately below).
for axis in [None, 0, 1, -1, (0, 2)]:
    for keepdims in [False, True]:
        case(
            f"axis{axis}-keep{keepdims}", "Max",
            lambda x, a=axis, k=keepdims: x.max(axis=a, keepdims=k),
            lambda x, a=axis, k=keepdims: np.max(x, axis=a, keepdims=k),
            distinct(2, 3, 4),
        )  # fmt: skip
case("fn-vector", "Max", vgraph.max, np.max, distinct(6))
for axis in [None, 0, -1, (0, 2)]:
    for keepdims in [False, True]:
        case(
            f"axis{axis}-keep{keepdims}", "Min",
            lambda x, a=axis, k=keepdims: vgraph.min(x, axis=a, keepdims=k),
            lambda x, a=axis, k=keepdims: np.min(x, axis=a, keepdims=k),
            distinct(2, 3, 4),
        )  # fmt: skip
        case(
            f"axis{axis}-keep{keepdims}", "Var",
            lambda x, a=axis, k=keepdims: vgraph.var(x, axis=a, keepdims=k),
            lambda x, a=axis, k=keepdims: np.var(x, axis=a, keepdims=k),
            normal(2, 3, 4),
        )  # fmt: skip
case("method", "Min", lambda x: x.min(), np.min, distinct(5))
case(
    "ddof1", "Var", lambda x: vgraph.var(x, axis=1, ddof=1), lambda x: np.var(x, axis=1, ddof=1), normal(3, 4)
)
for axis in [None, 0, 1, -1]:
    case(
        f"axis{axis}", "CumSum",
        lambda x, a=axis: vgraph.cumsum(x, axis=a), lambda x, a=axis: np.cumsum(x, axis=a), normal(2, 3, 4),
    )  # fmt: skip

# Reshape and Transpose.
for new_shape in [(6, 4), (-1,), (4, 3, 2), (1, 24), (2, 12, 1)]:
    case(
        shape_id(new_shape), "Reshape",
        lambda x, s=new_shape: x.reshape(s), lambda x, s=new_shape: np.reshape(x, s), normal(2, 3, 4),
    )  # fmt: skip
case("varargs", "Reshape", lambda x: x.reshape(3, 8), lambda x: x.reshape(3, 8), normal(2, 3, 4))
case("fn", "Reshape", lambda x: vgraph.reshape(x, (12,)), lambda x: x.reshape(12), normal(3, 4))
case("scalar", "Reshape", lambda x: x.reshape(1, 1), lambda x: x.reshape(1, 1), normal())
case("T", "Transpose", lambda x: x.T, np.transpose, normal(3, 4))
case("default-3d", "Transpose", lambda x: x.transpose(), np.transpose, normal(2, 3, 4))
for axes in [(1, 0, 2), (2, 0, 1), (1, 2, 0), (-1, 0, 1)]:
    case(
        "axes" + shape_id(tuple(a % 3 for a in axes)) + ("neg" if min(axes) < 0 else ""), "Transpose",
        lambda x, a=axes: vgraph.transpose(x, a), lambda x, a=axes: np.transpose(x, a), normal(2, 3, 4),
    )  # fmt: skip
case(
    "method-axes", "Transpose",
    lambda x: x.transpose(1, 0, 2), lambda x: x.transpose(1, 0, 2), normal(2, 3, 4),
)  # fmt: skip

# GetItem: basic (slices, ints, negative steps, None, Ellipsis) and integer-array indexing with
# repeated indices (the gradient must accumulate: numpy's np.add.at path).
REPEATED_ROWS = np.array([0, 2, 0, 0, 3])
GETITEM = [
    ("slice", lambda x: x[1:3]),
    ("int", lambda x: x[1]),
    ("neg-int", lambda x: x[-1, 2]),
    ("neg-step", lambda x: x[::-1]),
    ("neg-step-2d", lambda x: x[::-2, 3:0:-1]),
    ("newaxis-ellipsis", lambda x: x[None, ..., 1]),
    ("int-array-repeated", lambda x: x[REPEATED_ROWS]),
    ("list-repeated", lambda x: x[[1, 1, 1]]),
    ("cols-repeated", lambda x: x[:, np.array([2, 2, 0])]),
    ("pairs-repeated", lambda x: x[np.array([0, 0, 3]), np.array([1, 1, 2])]),
    ("bool-mask", lambda x: x[np.array([True, False, True, True])]),
]
for sid, index_of in GETITEM:
    case(sid, "GetItem", index_of, index_of, normal(4, 5))
# GatherRows: rows of several inputs stacked (autobatching); a repeated row accumulates.
GATHER_ROWS = ((0, (1,)), (1, (0,)), (0, (1,)))
case(
    "two-sources", "GatherRows",
    lambda a, b: a.graph.apply("GatherRows", [a, b[:, :, 0]], {"rows": GATHER_ROWS}),
    lambda a, b: np.stack([a[1], b[0, :, 0], a[1]]), normal(3, 4), normal(2, 4, 3),
)  # fmt: skip
case(
    "tuple-row", "GatherRows",
    lambda a, b: a.graph.apply("GatherRows", [a, b], {"rows": ((1, ((slice(None), 1), 0)), (0, (2,)))}),
    lambda a, b: np.stack([b[:, 1][0], a[2]]), normal(3, 4), normal(2, 3, 4),
)  # fmt: skip
# Hoisted: one iteration's row of a hoisted loop-body node (GetItem with an int index).
case("row", "Hoisted", lambda x: x.graph.apply("Hoisted", [x], {"index": 2}), lambda x: x[2], normal(4, 3, 5))
# AddRow: a reassociated loop sum, row t of a hoisted group plus a per-iteration term.
case(
    "row_plus",
    "AddRow",
    lambda rows, x: rows.graph.apply("AddRow", [rows, x], {"index": 1}),
    lambda rows, x: rows[1] + x,
    normal(4, 3, 5),
    normal(3, 5),
)
# MatMulAddRow: the same sum with its per-iteration term a product, computed in one node.
case(
    "product_plus_row",
    "MatMulAddRow",
    lambda a, b, rows: a.graph.apply("MatMulAddRow", [a, b, rows], {"index": 2}),
    lambda a, b, rows: a @ b + rows[2],
    normal(3, 4),
    normal(4, 5),
    normal(4, 3, 5),
)

# Concat and Stack: several inputs, different axes.
for shapes, axis in [
    (((2, 3), (4, 3), (1, 3)), 0),
    (((2, 3), (2, 1), (2, 2)), 1),
    (((2, 3, 1), (2, 3, 2)), -1),
    (((5,), (2,)), 0),
]:
    case(
        f"{shape_id(*shapes)}-axis{axis}", "Concat",
        lambda *xs, a=axis: vgraph.concat(xs, axis=a),
        lambda *xs, a=axis: np.concatenate(xs, axis=a),
        *(normal(*s) for s in shapes),
    )  # fmt: skip
for n, shape, axis in [(3, (2, 3), 0), (3, (2, 3), 1), (4, (2, 3), -1), (2, (4,), 0), (3, (), 0)]:
    case(
        f"{n}x{shape_id(shape)}-axis{axis}", "Stack",
        lambda *xs, a=axis: vgraph.stack(xs, axis=a),
        lambda *xs, a=axis: np.stack(xs, axis=a),
        *(normal(*shape) for _ in range(n)),
    )  # fmt: skip


def _pad_stack_ref(*xs, shape):
    out = np.zeros((len(xs), *shape))
    for r, x in enumerate(xs):
        out[r, : x.shape[0], : x.shape[1]] = x
    return out


# PadStack (rows of different lengths padded with zeros: a program over rows' per-input values)
for shapes in [((2, 3), (4, 3), (1, 3)), ((3, 1), (3, 4))]:
    widest = tuple(max(d) for d in zip(*shapes))
    case(
        shape_id(*shapes), "PadStack",
        lambda *xs, w=widest: vgraph.functions._dispatch("PadStack", xs, {"shape": w}),
        lambda *xs, w=widest: _pad_stack_ref(*xs, shape=w),
        *(normal(*s) for s in shapes),
    )  # fmt: skip

# Where with a constant mask (which gets no gradient); broadcasting among mask and branches.
MASK_34 = np.arange(12).reshape(3, 4) % 3 == 0
MASK_31 = np.array([[True], [False], [True]])
for sid, mask, sa, sb in [
    ("same", MASK_34, (3, 4), (3, 4)),
    ("bcast-branches", MASK_34, (4,), ()),
    ("bcast-mask", MASK_31, (1, 4), (3, 4)),
]:
    case(
        sid, "Where",
        lambda a, b, m=mask: vgraph.where(m, a, b), lambda a, b, m=mask: np.where(m, a, b),
        normal(*sa), normal(*sb),
    )  # fmt: skip

# Look-ups with data indices (a constant here; a fed input node in models). Repeated indices
# check that gradients accumulate.
ROWS = np.array([[0, 2], [2, 4]])
case("rows-repeated", "Take", lambda x: vgraph.take(x, ROWS), lambda x: x[ROWS], normal(5, 3))
case("vector", "Take", lambda x: vgraph.take(x, ROWS[0]), lambda x: x[ROWS[0]], normal(5))
for sid, shape, idx, axis in [
    ("labels", (3, 4), np.array([[1], [3], [0]]), -1),
    ("repeated-axis0", (3, 4), np.array([[0, 2, 2, 1], [0, 0, 1, 2]]), 0),
]:
    case(
        sid, "TakeAlongAxis",
        lambda x, i=idx, a=axis: vgraph.take_along_axis(x, i, axis=a),
        lambda x, i=idx, a=axis: np.take_along_axis(x, i, axis=a),
        normal(*shape),
    )  # fmt: skip


def np_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


for shape, axis in [((5,), -1), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1)]:
    sid = f"{shape_id(shape)}-axis{axis}"
    case(
        sid, "Softmax",
        lambda x, a=axis: vgraph.softmax(x, axis=a), lambda x, a=axis: np_softmax(x, a), normal(*shape),
    )  # fmt: skip
    case(
        sid, "LogSoftmax",
        lambda x, a=axis: vgraph.log_softmax(x, axis=a),
        lambda x, a=axis: np.log(np_softmax(x, a)),
        normal(*shape),
    )  # fmt: skip


# Fused recurrent cells: the value stacks the new state and the gate activations on a new axis 0.
def np_sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def np_lstm_cell(xw, hw, b, c):
    H = c.shape[-1]
    z = xw + hw + b
    i, f = np_sigmoid(z[..., :H]), np_sigmoid(z[..., H : 2 * H])
    g, o = np.tanh(z[..., 2 * H : 3 * H]), np_sigmoid(z[..., 3 * H :])
    c2 = f * c + i * g
    return np.stack(np.broadcast_arrays(o * np.tanh(c2), c2, i, f, g, o))


def np_gru_cell(xw, hw, bx, bh, h):
    H = h.shape[-1]
    gx, gh = xw + bx, hw + bh
    r = np_sigmoid(gx[..., :H] + gh[..., :H])
    z = np_sigmoid(gx[..., H : 2 * H] + gh[..., H : 2 * H])
    n = np.tanh(gx[..., 2 * H :] + r * gh[..., 2 * H :])
    return np.stack(np.broadcast_arrays((1 - z) * n + z * h, r, z, n))


# (batch shape of xw, of hw, of the state): plain, no batch, broadcast batch dimensions.
for bx, bh, bs in [((3,), (3,), (3,)), ((), (), ()), ((2, 3), (3,), (1, 3)), ((3,), (3,), (2, 1))]:
    case(
        shape_id(bx, bh, bs), "LSTMCell", vgraph.functions.lstm_cell, np_lstm_cell,
        normal(*bx, 8), normal(*bh, 8), normal(8), normal(*bs, 2),
    )  # fmt: skip
    case(
        shape_id(bx, bh, bs), "GRUCell", vgraph.functions.gru_cell, np_gru_cell,
        normal(*bx, 6), normal(*bh, 6), normal(6), normal(6), normal(*bs, 2),
    )  # fmt: skip
# A bias with batch axes of its own (wider than the projections').
case(
    "batched-bias", "LSTMCell", vgraph.functions.lstm_cell, np_lstm_cell,
    normal(1, 8), normal(8), normal(3, 8), normal(2),
)  # fmt: skip
case(
    "batched-bias", "GRUCell", vgraph.functions.gru_cell, np_gru_cell,
    normal(1, 6), normal(6), normal(3, 6), normal(6), normal(2),
)  # fmt: skip


# Fused softmax cross-entropy: per-row loss; the labels are a constant (no gradient), negative
# ones counting from the end.
def np_softmax_cross_entropy(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    logp = np.log(np_softmax(x, -1))
    return -np.take_along_axis(logp, labels[..., None] % x.shape[-1], -1)[..., 0]


for sid, shape, labels in [
    ("rows", (4, 5), np.array([0, 4, 2, 2])),
    ("vector", (6,), np.array(3)),
    ("batch-axes", (2, 3, 4), np.array([[0, 3, 1], [2, 2, -1]])),
    ("one-class", (3, 1), np.array([0, 0, 0])),
]:
    case(
        sid, "SoftmaxCrossEntropy",
        lambda x, i=labels: vgraph.functions.softmax_cross_entropy(x, i),
        lambda x, i=labels: np_softmax_cross_entropy(x, i),
        normal(*shape),
    )  # fmt: skip


# ---------------------------------------------------------------------------- table-driven tests
def test_every_primitive_is_covered():
    """Every op of the table has gradcheck cases, or is one of the ops with their own tests."""
    covered = {c.op for c in CASES}
    assert not covered & (STRUCTURAL | ZERO_GRADIENT | NO_GRADIENT)
    assert covered | STRUCTURAL | ZERO_GRADIENT | NO_GRADIENT == set(OPS)


def _make_inputs(cg: ComputeGraph, c: Case) -> tuple[list[np.ndarray], list[vgraph.ComputeNode]]:
    r = np.random.default_rng(0)
    arrays = [gen(r) for gen in c.inputs]
    # Alternate the two kinds of differentiable leaves.
    nodes = [cg.input(a, requires_grad=True) if i % 2 == 0 else cg.parameter(a) for i, a in enumerate(arrays)]
    return arrays, nodes


@pytest.mark.parametrize("c", CASES, ids=str)
def test_forward_matches_numpy(c: Case):
    cg = ComputeGraph(dtype=np.float64)
    arrays, nodes = _make_inputs(cg, c)
    out = c.build(*nodes)
    assert out.key.type == c.op  # the op under test is what the user code produced
    expected = np.asarray(c.ref(*[a.copy() for a in arrays]))
    assert out.shape == expected.shape
    assert out.value.dtype == np.float64
    np.testing.assert_allclose(out.value, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("c", CASES, ids=str)
def test_gradcheck(c: Case):
    cg = ComputeGraph(dtype=np.float64)
    arrays, nodes = _make_inputs(cg, c)
    out = c.build(*nodes)
    result = gradcheck(out, nodes)
    assert result.ok
    assert result.checked == sum(a.size for a in arrays)


# ---------------------------------------------------------------------------- special cases
@pytest.mark.parametrize(
    "build, ref",
    [
        (vgraph.step, lambda x: (x > 0).astype(np.float64)),
        (vgraph.sign, np.sign),
    ],
    ids=["Step", "Sign"],
)
def test_zero_gradient_ops(build, ref):
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([[-1.5, 0.0, 2.0], [0.3, -0.2, 0.0]])
    x = cg.input(x0, requires_grad=True)
    y = build(x)
    assert y.key.type == build.__name__.capitalize()
    np.testing.assert_array_equal(y.value, ref(x0))
    assert not y.requires_grad  # nothing to backpropagate through

    with pytest.raises(vgraph.GraphStateError, match="do not depend"):
        cg.grad(y, [x], seeds=np.ones(x0.shape), retain_graph=True)
    assert cg.grad(y, [x], seeds=np.ones(x0.shape), retain_graph=True, allow_unused=True) == [None]

    # Alongside a real path, the op contributes exactly nothing: d/dx sum(op(x) * 5 + x) == 1.
    loss = (y * 5.0 + x).sum()
    (g,) = cg.grad(loss, [x])
    np.testing.assert_array_equal(g, np.ones_like(x0))


def test_max_ties_share_the_gradient_equally():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, -1.0, 4.0, 5.0]])
    x = cg.input(x0, requires_grad=True)
    seed = np.array([1.0, 4.0, -6.0])
    (g,) = cg.grad(x.max(axis=1), [x], seeds=seed, retain_graph=True)
    expected = np.array([[0.0, 0.5, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0], [-3.0, 0.0, 0.0, -3.0]])
    np.testing.assert_allclose(g, expected, rtol=0, atol=1e-15)

    # Over all axes: the maximum 5 appears twice in the whole array.
    (g,) = cg.grad(vgraph.max(x), [x], retain_graph=True)
    expected = np.zeros_like(x0)
    expected[2, 0] = expected[2, 3] = 0.5
    np.testing.assert_allclose(g, expected, rtol=0, atol=1e-15)

    # keepdims, over axis 0: column 0 has a single max (5), column 3 a single max too.
    (g,) = cg.grad(x.max(axis=0, keepdims=True), [x], seeds=np.ones((1, 4)))
    expected = np.array([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    np.testing.assert_allclose(g, expected, rtol=0, atol=1e-15)


def test_getitem_repeated_indices_accumulate():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.arange(12.0).reshape(4, 3)
    x = cg.input(x0, requires_grad=True)
    y = x[np.array([0, 2, 0, 0])]
    np.testing.assert_array_equal(y.value, x0[[0, 2, 0, 0]])
    seed = np.array([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [100.0, 200.0, 300.0], [1000.0, 2000.0, 3000.0]])
    (g,) = cg.grad(y, [x], seeds=seed)
    expected = np.zeros((4, 3))
    expected[0] = seed[0] + seed[2] + seed[3]  # row 0 was picked three times
    expected[2] = seed[1]
    np.testing.assert_array_equal(g, expected)


def test_getitem_repeated_scalar_elements_accumulate():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.arange(5.0), requires_grad=True)
    loss = x[[4, 4, 4, 1]].sum()
    assert float(loss.value) == 3 * 4.0 + 1.0
    (g,) = cg.grad(loss, [x])
    np.testing.assert_array_equal(g, [0.0, 1.0, 0.0, 0.0, 3.0])


def test_softmax_extreme_logits_do_not_overflow():
    cg = ComputeGraph(dtype=np.float64)
    logits = np.array(
        [
            [1000.0, -1000.0, 0.0],
            [-1000.0, -1000.0, -1000.0],
            [1000.0, 999.0, 998.0],
            [-1000.0, 1000.0, 1000.0],
        ]
    )
    x = cg.input(logits, requires_grad=True)
    # Reference from closed forms: shifting each row by its maximum by hand.
    shifted = np.array([[0.0, -2000.0, -1000.0], [0.0, 0.0, 0.0], [0.0, -1.0, -2.0], [-2000.0, 0.0, 0.0]])
    ref_log = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    ref_soft = np.exp(ref_log)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s = vgraph.softmax(x)
        ls = vgraph.log_softmax(x)
        w = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0], [1.0, 0.0, -1.0], [2.0, 2.0, -2.0]])
        g_soft, g_log = (cg.grad(node, [x], seeds=w, retain_graph=True)[0] for node in (s, ls))
    assert np.all(np.isfinite(s.value)) and np.all(np.isfinite(ls.value))
    np.testing.assert_allclose(s.value, ref_soft, rtol=1e-14, atol=0)
    np.testing.assert_allclose(ls.value, ref_log, rtol=1e-14, atol=0)
    np.testing.assert_allclose(s.value.sum(axis=1), 1.0, rtol=1e-15)
    np.testing.assert_allclose(ls.value[0], [0.0, -2000.0, -1000.0], rtol=1e-15)
    np.testing.assert_allclose(ls.value[1], -np.log(3.0), rtol=1e-15)
    # Gradients in closed form: J^T w for softmax and log-softmax.
    np.testing.assert_allclose(
        g_soft, ref_soft * (w - (w * ref_soft).sum(axis=1, keepdims=True)), rtol=1e-12, atol=1e-300
    )
    np.testing.assert_allclose(g_log, w - ref_soft * w.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------- structural ops
@pytest.mark.parametrize("name", ["Branch", "Identity"])
def test_identity_like_ops_pass_value_and_gradient(name):
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.random.default_rng(0).standard_normal((3, 4))
    x = cg.input(x0, requires_grad=True)
    y = cg.apply(name, [x])
    assert y.key == vgraph.NodeKey(name, 1, ())
    assert y.requires_grad
    np.testing.assert_array_equal(y.value, x0)
    seed = np.random.default_rng(1).standard_normal((3, 4))
    (g,) = cg.grad(y, [x], seeds=seed)
    np.testing.assert_array_equal(g, seed)
    assert gradcheck(vgraph.tanh(y), [x]).ok


def test_detach_op_stops_the_gradient():
    cg = ComputeGraph(dtype=np.float64)
    x0 = np.array([0.5, -2.0, 3.0])
    x = cg.input(x0, requires_grad=True)
    d = cg.apply("Detach", [x])
    assert d.key.type == "Detach"
    np.testing.assert_array_equal(d.value, x0)
    assert not d.requires_grad
    # d/dx sum(stop(x) * x) = stop(x) = x0, not 2 * x0.
    (g,) = cg.grad((d * x).sum(), [x], retain_graph=True)
    np.testing.assert_array_equal(g, x0)
    assert cg.grad(d, [x], seeds=np.ones(3), allow_unused=True) == [None]


# ---------------------------------------------------------------------------- unbroadcast
G = np.arange(24.0).reshape(2, 3, 4)


def _explicit_sum(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce by looping over every element of g and adding it to the cell it broadcast from."""
    out = np.zeros(shape)
    offset = g.ndim - len(shape)
    for idx in np.ndindex(g.shape):
        target = tuple(0 if n == 1 else i for i, n in zip(idx[offset:], shape))
        out[target] += g[idx]
    return out


@pytest.mark.parametrize(
    "shape",
    [(2, 3, 4), (3, 4), (4,), (), (1, 4), (3, 1), (1, 1), (2, 1, 4), (1, 3, 1), (2, 1, 1), (1, 1, 1)],
    ids=lambda s: shape_id(s),
)
def test_unbroadcast(shape):
    out = unbroadcast(G, shape)
    assert np.shape(out) == shape
    np.testing.assert_array_equal(out, _explicit_sum(G, shape))


def test_unbroadcast_known_values():
    g = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_array_equal(unbroadcast(g, (2,)), [9.0, 12.0])
    np.testing.assert_array_equal(unbroadcast(g, (3, 1)), [[3.0], [7.0], [11.0]])
    assert unbroadcast(g, ()) == 21.0
    np.testing.assert_array_equal(unbroadcast(g, (3, 2)), g)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "empty"])
def test_unbroadcast_over_leading_axes_by_a_product_with_ones(dtype, layout, monkeypatch):
    """A float32/float64 C-contiguous gradient is summed over its leading axes as ``ones @ g``
    (one BLAS call, see ops._sum_leading), anything else by numpy's reduction: the same sums as an
    element-by-element reference, a new array each time (writing into one changes no later one)."""
    rng = np.random.default_rng(11)
    g = (rng.normal(size=(7, 5, 6)) * 10).astype(dtype)
    if layout == "strided":
        g = g[:, :, ::2]
    elif layout == "empty":
        g = g[:0]
    used = []
    ones = ops._ones
    monkeypatch.setattr(ops, "_ones", lambda n, dt: used.append(n) or ones(n, dt))
    for shape in [g.shape[1:], g.shape[2:], (1, g.shape[2]), ()]:
        want = _explicit_sum(g.astype(np.float64), shape)
        got = unbroadcast(g, shape)
        assert got.shape == shape and got.dtype == g.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-9)
        if isinstance(got, np.ndarray) and got.size:  # (numpy's reduction to () gives a scalar)
            got[...] = 0  # the caller's own array: the next sum is unchanged
            np.testing.assert_allclose(unbroadcast(g, shape), want, rtol=1e-6, atol=1e-9)
    assert bool(used) == (layout == "contiguous" and dtype != np.int64)
    assert not ops._ones(3, np.dtype(np.float64)).flags.writeable


def test_the_vector_of_ones_for_sums_stays_bounded(monkeypatch):
    """More rows than ONES_MAX_ROWS are summed by numpy's reduction, so the kept vector of ones
    never grows past the bound (the same sums either way)."""
    monkeypatch.setattr(ops, "ONES_MAX_ROWS", 5000)
    monkeypatch.setattr(ops._ones_cache, "vectors", {})
    g = np.random.default_rng(12).normal(size=(6000, 3))
    np.testing.assert_allclose(unbroadcast(g, (3,)), g.sum(axis=0), rtol=1e-12)
    assert ops._ones_cache.vectors == {}  # numpy's reduction: no vector made
    np.testing.assert_allclose(unbroadcast(g[:4000], (3,)), g[:4000].sum(axis=0), rtol=1e-12)
    assert ops._ones_cache.vectors[np.dtype(np.float64)].shape[0] <= 5000


# ---------------------------------------------------------------------------- allocations of VJPs
# A VJP must not allocate more than its result needs (issue 10 §2): a trap that grows with the
# length of a sequence turns training on long sequences quadratic. Peak allocations are measured
# with tracemalloc (numpy reports its buffers to it); bounds, not timings.


def _peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the peak number of bytes traced while it ran."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return result, peak


def test_matmul_weight_gradient_of_a_stack_is_one_product():
    """``(T, B, H) @ (H, V)`` (nn.Linear on a stacked sequence): the weight's VJP sums over T and B
    inside one product; it allocates about its (H, V) result, not a (T, H, V) stack."""
    T, B, H, V = 256, 2, 8, 64
    r = np.random.default_rng(0)
    a, b, g = r.standard_normal((T, B, H)), r.standard_normal((H, V)), r.standard_normal((T, B, V))
    expected = sum(a[t].T @ g[t] for t in range(T))
    got, peak = _peak_bytes(lambda: as_array(OPS["MatMul"].vjps[1](g, None, a, b)))
    assert got.shape == (H, V)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert peak <= 2 * expected.nbytes + 4096, peak  # a (T, H, V) stack would be T / 2 times more


def test_matmul_gradient_of_a_vector_weight_over_a_stack():
    T, B, H = 512, 2, 16
    r = np.random.default_rng(1)
    a, b, g = r.standard_normal((T, B, H)), r.standard_normal(H), r.standard_normal((T, B))
    got, peak = _peak_bytes(lambda: OPS["MatMul"].vjps[1](g, None, a, b))
    np.testing.assert_allclose(got, np.einsum("tbh,tb->h", a, g), rtol=1e-12)
    assert got.shape == (H,)
    assert peak <= 2 * got.nbytes + 4096, peak


def test_matmul_left_matrix_gradient_over_a_stack_allocates_inputs_not_a_stack():
    """``(M, K) @ (T, K, N)`` with M*K > N*(M+K): the left operand's VJP copies g and b once
    rather than building a (T, M, K) stack."""
    T, M, K, N = 256, 32, 32, 2
    r = np.random.default_rng(2)
    a, b, g = r.standard_normal((M, K)), r.standard_normal((T, K, N)), r.standard_normal((T, M, N))
    expected = sum(g[t] @ b[t].T for t in range(T))
    got, peak = _peak_bytes(lambda: OPS["MatMul"].vjps[0](g, None, a, b))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert peak <= g.nbytes + b.nbytes + 2 * got.nbytes + 4096, peak
    assert peak < T * M * K * 8 / 2, peak


def test_linear_on_a_stack_backward_allocates_no_stack():
    """Through the engine: backward of ``x @ W`` for a (T, B, H) input that needs no gradient
    allocates about the size of W's gradient (plus its copy into W.grad)."""
    T, B, H, V = 256, 2, 8, 64
    r = np.random.default_rng(3)
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(r.standard_normal((T, B, H)))
    W = cg.parameter(r.standard_normal((H, V)))
    y = x @ W
    seed = r.standard_normal((T, B, V))
    _, peak = _peak_bytes(lambda: cg.backward(y, seed=seed))
    np.testing.assert_allclose(W.grad, x.value.reshape(-1, H).T @ seed.reshape(-1, V), rtol=1e-12)
    assert peak <= 3 * W.value.nbytes + 8192, peak


def test_stack_gradient_is_a_view_of_the_incoming_gradient():
    g = np.arange(24.0).reshape(2, 3, 4)
    xs = [np.zeros((2, 4))] * 3
    for i in range(3):
        got = OPS["Stack"].vjps(i, g, g, *xs, axis=1)
        np.testing.assert_array_equal(got, g[:, i])
        assert np.shares_memory(got, g)
    got = OPS["Stack"].vjps(1, g, g, *xs, axis=-2)
    np.testing.assert_array_equal(got, g[:, 1])


@pytest.mark.parametrize(
    "parts",
    [
        [np.arange(6.0).reshape(2, 3), np.ones((2, 3), np.float32), np.full((2, 3), 7)],  # promoted
        [np.float32(1.5), np.float32(2.5)],  # 0-d: np.stack itself
        [1.0, 2.0, 3.0],  # Python numbers
        [np.arange(4.0)],  # one part
        [np.arange(3.0)[::2], np.arange(2.0)],  # a strided part
    ],
    ids=["promoted", "0-d", "numbers", "single", "strided"],
)
def test_stack_forward_is_np_stack(parts):
    """Stack's forward concatenates same-shaped parts as rows (faster than np.stack): the same
    values and dtype as np.stack, whatever the parts."""
    got, want = OPS["Stack"].forward(*parts), np.stack(parts)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(OPS["Stack"].forward(*parts, axis=-1), np.stack(parts, axis=-1))


@pytest.mark.parametrize("shapes", [[(1, 3), (3, 3), (2, 3)], [(2, 3), (2, 4)], [(2,), ()]])
def test_stack_forward_refuses_parts_of_different_shapes(shapes):
    """As np.stack does — also parts whose rows would fill the stack exactly ((1, 3) + (3, 3) +
    (2, 3) rows: 6 = 3 x 2), which a concatenation alone would take."""
    parts = [np.zeros(s) for s in shapes]
    with pytest.raises(ValueError, match="same shape"):
        np.stack(parts)
    with pytest.raises(ValueError, match="same shape"):
        OPS["Stack"].forward(*parts)


@pytest.mark.parametrize("shape", [(2, 3), (4,), ()], ids=["rows", "vectors", "scalars"])
def test_a_stack_of_gradient_rows_is_np_stack(shape):
    """ops._rows_stack (a loop's gradient rows for its collectors) concatenates parts of two or
    more axes as rows: the values of np.stack, converted to the dtype asked for."""
    rng = np.random.default_rng(3)
    parts = [np.asarray(rng.normal(size=shape)) for _ in range(5)]
    for dtype in (np.float64, np.float32):
        got = ops._rows_stack(parts, dtype, own=True)
        assert got.dtype == dtype and got.shape == (5, *shape)
        np.testing.assert_array_equal(got, np.stack(parts).astype(dtype))


@pytest.mark.parametrize("at", [[3, 0, 5, 1], [2, 2, 0, 2]], ids=["unique-rows", "repeated-rows"])
def test_rows_grad_adds_whole_rows_as_one_indexed_addition_bit_for_bit(at):
    """RowsGrad adds first-axis rows with one indexed addition (np.add.at when rows repeat): the
    same additions, in the same order, as one in-place addition per row."""
    from vgraph.ops import RowsGrad

    rng = np.random.default_rng(0)
    g = rng.standard_normal((6, 3))
    pairs = [((r,), p) for r, p in zip(at, [4, 0, 2, 5])]
    acc = rng.standard_normal((7, 3))
    expected = acc.copy()
    for (r,), p in pairs:
        expected[r] += g[p]
    RowsGrad(acc.shape, acc.dtype, g, pairs).add_into(acc)
    np.testing.assert_array_equal(acc, expected)


def test_gather_rows_vjps_of_interleaved_nodes_pick_their_own_rows():
    """The grouping of a GatherRows node's rows by input is computed once per node and kept for
    the next input's VJP: another node's VJP in between must not get the first node's rows."""
    from vgraph.ops import _gather_rows_vjp

    a, b = np.arange(12.0).reshape(4, 3), np.arange(6.0).reshape(2, 3)
    rows1 = ((0, (1,)), (1, (0,)), (0, (3,)))
    rows2 = ((1, (1,)), (0, (2,)))
    g1, g2 = np.ones((3, 3)), np.full((2, 3), 2.0)
    first = _gather_rows_vjp(0, g1, None, a, b, rows=rows1)
    other = _gather_rows_vjp(0, g2, None, a, b, rows=rows2)
    second = _gather_rows_vjp(1, g1, None, a, b, rows=rows1)
    assert first.pairs == [((1,), 0), ((3,), 2)]
    assert other.pairs == [((2,), 1)]
    assert second.pairs == [((0,), 1)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_vjp_written_into_an_array_gives_the_vjps_bits_or_declines(dtype):
    """``ops.VJPS_INTO``: ``into(out, g, ans, x)`` writes the VJP's result into ``out`` with the
    same bits, or returns ``None`` and writes nothing where the arrays do not match."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(dtype)
    ans, g = np.tanh(x), rng.standard_normal((3, 5)).astype(dtype)
    for vjp, into in ops.VJPS_INTO.items():
        want = vjp(g, ans, x)
        out = np.empty_like(ans)
        assert into(out, g, ans, x) is out and out.tobytes() == want.tobytes()
        other = np.full((3, 5), 7.0, dtype=np.float32 if dtype == np.float64 else np.float64)
        for bad in (
            (None, g),  # no array to write into
            (other, g),  # another dtype
            (np.full((1, 5), 7.0, dtype), g),  # another shape
            (np.full((3, 5), 7.0, dtype), g[:1]),  # a gradient broadcast over the rows
            (np.full((3, 5), 7.0, dtype), g.astype(other.dtype)),
        ):
            out, grad = bad
            assert into(out, grad, ans, x) is None
            assert out is None or (out == 7.0).all()


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("given", ["both", "h", "c"])
def test_a_cells_vjp_from_its_slabs_gradients_equals_its_vjp_of_them_laid_into_zeros(batch, given):
    """``ops.slab_vjp``: the LSTM cell's joint VJP given the gradients of h' and c' alone (with
    its split part or without) equals the joint VJP of the output gradient that holds them and
    zeros elsewhere."""
    rng = np.random.default_rng(len(batch))
    H = 4
    xw, hw = rng.standard_normal((2, *batch, 4 * H))
    b, c = rng.standard_normal(4 * H), rng.standard_normal((*batch, H))
    op = ops.OPS["LSTMCell"]
    indices, with_slabs = ops.slab_vjp(op)
    assert indices == (0, 1)
    ans = op.forward(xw, hw, b, c)
    dh = rng.standard_normal(ans.shape[1:]) if given != "c" else None
    dc = rng.standard_normal(ans.shape[1:]) if given != "h" else None
    g = np.zeros_like(ans)
    for index, d in zip(indices, (dh, dc)):
        if d is not None:
            g[index] += d
    want = ops.joint_vjp(op)(g, ans, xw, hw, b, c)
    prep = ops.split_vjp(op)[0]
    part = tuple(x[0] for x in prep(ans[None]))
    for p in (None, part):
        got = with_slabs(p, (dh, dc), ans, xw, hw, b, c)
        assert len(got) == len(want)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
    # given an array, input 0's gradient is written into it (where it fits), with the same bits
    plain = with_slabs(part, (dh, dc), ans, xw, hw, b, c)[0]
    out = np.full_like(xw, 7.0)
    got = with_slabs(part, (dh, dc), ans, xw, hw, b, c, out=out)
    assert got[0] is out and out.tobytes() == plain.tobytes()
    wrong = np.full((*xw.shape[:-1], 1), 7.0)
    got = with_slabs(part, (dh, dc), ans, xw, hw, b, c, out=wrong)
    assert got[0] is not wrong and (wrong == 7.0).all() and got[0].tobytes() == plain.tobytes()
    assert ops.slab_vjp(ops.OPS["GRUCell"]) is None and ops.slab_vjp(ops.OPS["Tanh"]) is None


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell"])
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_a_cells_forward_writes_into_an_out_array_that_fits_with_the_same_bits(name, batch):
    """``ops.forward_into``: the fused cells take ``out=``, write their value there and return it
    where its shape and dtype fit, and ignore it otherwise; the same bits either way."""
    rng = np.random.default_rng(len(batch))
    H = 3
    op = ops.OPS[name]
    gates = 4 if name == "LSTMCell" else 3
    xw, hw = rng.standard_normal((2, *batch, gates * H))
    state = rng.standard_normal((*batch, H))
    biases = [rng.standard_normal(gates * H) for _ in range(1 if name == "LSTMCell" else 2)]
    xs = (xw, hw, *biases, state)
    plain = op.forward(*xs)
    out = np.full_like(plain, 7.0)
    assert op.forward(*xs, out=out) is out and out.tobytes() == plain.tobytes()
    frozen = np.full_like(plain, 7.0)
    frozen.flags.writeable = False
    for wrong in (np.full((1, *plain.shape), 7.0), np.full(plain.shape, 7, dtype=np.float32), frozen):
        got = op.forward(*xs, out=wrong)
        assert got is not wrong and (wrong == 7.0).all() and got.tobytes() == plain.tobytes()
    assert ops.forward_into(op)
    assert not ops.forward_into(ops.OPS["MatMul"]) and not ops.forward_into(ops.OPS["Tanh"])
