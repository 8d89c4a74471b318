"""Second-order derivatives: gradients recorded as nodes of the graph (``create_graph=True``).

The ordinary backward sweep computes gradients with the numpy VJPs of :mod:`vgraph.ops`: fast,
and final — an array cannot be differentiated again. With ``create_graph=True``
(:meth:`ComputeGraph.backward <vgraph.compute.ComputeGraph.backward>`,
:meth:`ComputeGraph.grad <vgraph.compute.ComputeGraph.grad>`) the sweep here runs instead: the
same reverse order over the same nodes, but each VJP is *applied as graph operations*
(:data:`RULES`, HIPS autograd's design: the VJP of ``a * b`` is ``g * b`` and ``g * a``, two
``Mul`` nodes; a few VJPs are helper primitives of their own, :data:`HELPERS`), so every
gradient is a :class:`~vgraph.compute.ComputeNode` of the same graph. It can enter a further
loss (a gradient penalty) and be differentiated again — by the fast first-order sweep (a
Hessian-vector product is one recorded gradient and one ordinary backward, :func:`hvp`) or by
another recorded one (third order).

The nodes a sweep adds are ordinary nodes: they have keys (``Mul:12``) and values, forward
recomputes them when a leaf changes, anomaly mode checks them, the renderer draws them. Each is
named after the node whose VJP it computes: ``'vjp of <Tanh:1@7>'``, and the total gradient of a
node ``'gradient of <Tanh:1@7>'``.

An op without a differentiable VJP (a :func:`vgraph.defop` op defined without ``node_vjps``, a
loop run as one body program) raises :class:`~vgraph.errors.SecondOrderError` naming the node
before anything is added. Not supported yet, with the same error: checkpointed loops (their
values are dropped), rows gathered from nodes that take a gradient in a batched build
(``GatherRows``), and gradients taken with respect to, or from, nodes computed when read (hoisted
copies: build with ``hoist=False``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from .compute import ComputeGraph, ComputeNode, next_version, not_reached
from .errors import ArgumentError, GraphStateError, SecondOrderError, ShapeError, VGraphError
from .ops import (
    LSTM_GATES,
    OPS,
    Op,
    RowsProductGrad,
    _broadcasts_to,
    _matmul,
    _tanh_vjp,
    _tie_share,
    _validated_op,
    add_at,
    unbroadcast,
)
from .workspace import gc_paused

# ---------------------------------------------------------------------------- helper primitives
# The differentiable VJPs need a few operations the table lacks — the adjoints of indexing and of
# broadcasting, and masks (derivatives of piecewise-linear ops) recomputed from the values so that
# a forward after a leaf changed keeps them right. They are ordinary primitives: numpy forward and
# VJP, and a rule in RULES below (their own gradients are recorded too: third order works).


def _scatter(g: np.ndarray, shape: tuple[int, ...], index: Any) -> np.ndarray:
    """``g`` added at ``index`` of a zero array of ``shape`` (repeated indices accumulate)."""
    out = np.zeros(shape, dtype=g.dtype)
    add_at(out, index, g)
    return out


def _scatter_take(g: np.ndarray, indices: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return _scatter(g, shape, indices)


def _scatter_along_axis(
    g: np.ndarray, indices: np.ndarray, shape: tuple[int, ...], axis: int = -1
) -> np.ndarray:
    out = np.zeros(shape, dtype=g.dtype)
    where: list[Any] = list(np.indices(g.shape, sparse=True))
    where[axis] = np.broadcast_to(indices, g.shape)
    np.add.at(out, tuple(where), g)
    return out


def _broadcast_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(x, shape)


def _sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(unbroadcast(x, shape))


def _inside(x: np.ndarray, lo: Any = None, hi: Any = None) -> np.ndarray:
    inside = (True if lo is None else x >= lo) & (True if hi is None else x <= hi)
    return np.asarray(inside, dtype=x.dtype)


def _extreme_share(x: np.ndarray, ans: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    """The share of a reduced maximum's (or minimum's) gradient each element of ``x`` gets: 1 /
    the number of ties where it equals the extreme, else 0 (as ``Max``'s VJP)."""
    shape = _kept_shape(x.shape, axis)
    hit = x == np.reshape(ans, shape)
    out: np.ndarray = hit / hit.sum(axis=axis, keepdims=True).astype(x.dtype)
    return out


def _tanh_grad(g: np.ndarray, ans: np.ndarray) -> np.ndarray:
    """``g * (1 - ans^2)``: the VJP of ``tanh`` as one node (the arithmetic of the Tanh op's VJP,
    so the recorded gradient has the first-order one's values)."""
    return _tanh_vjp(g, ans, ans)


def _sigmoid_grad(g: np.ndarray, ans: np.ndarray) -> np.ndarray:
    """``g * ans * (1 - ans)``: the VJP of ``sigmoid`` as one node (the Sigmoid op's arithmetic)."""
    out: np.ndarray = g * ans * (1 - ans)
    return out


def _matmul_t(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b.T`` (``b`` a matrix, ``a`` rows of any batch shape): the gradient of ``a @ b``
    with respect to ``a`` as one node. With a ``Transpose`` node of ``b`` instead, the gradient
    of ``b`` through the recorded gradient would come back as one dense array, and the
    products of rows that ``b``'s other uses (every iteration of a loop) send could no longer
    be stacked into one product; this op sends its own such product (its second VJP)."""
    return _matmul(a, b.T)


def _matmul_t_vjp_b(g: np.ndarray, ans: np.ndarray, a: np.ndarray, b: np.ndarray) -> RowsProductGrad:
    """``g^T a`` over the rows of ``g`` and ``a``, collected with the other uses of ``b``."""
    return RowsProductGrad(g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]))


def _label_one_hot(labels: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """One-hot rows of ``labels`` (negative labels count from the end) shaped and typed as
    ``logits``."""
    out = np.zeros(logits.shape, dtype=logits.dtype)
    np.put_along_axis(out, np.asarray(labels)[..., None] % logits.shape[-1], 1, axis=-1)
    return out


#: The helper primitives, by name: kept out of the table of :mod:`vgraph.ops` (nothing but a
#: recorded gradient makes them), each checked as :func:`vgraph.ops.defop` checks an op.
HELPERS: dict[str, Op] = {
    op.name: op
    for op in (
        _validated_op("ScatterAdd", _scatter, (lambda g, ans, x, shape, index: g[index],), False),
        _validated_op(
            "ScatterTake", _scatter_take, (lambda g, ans, x, indices, shape: g[indices], None), False
        ),
        _validated_op(
            "ScatterAlongAxis",
            _scatter_along_axis,
            (lambda g, ans, x, indices, shape, axis=-1: np.take_along_axis(g, indices, axis), None),
            False,
        ),
        _validated_op(
            "BroadcastTo", _broadcast_to, (lambda g, ans, x, shape: unbroadcast(g, x.shape),), False
        ),
        _validated_op("SumTo", _sum_to, (lambda g, ans, x, shape: np.broadcast_to(g, x.shape),), False),
        # Masks: flat almost everywhere, so no gradient (as Step).
        _validated_op("TieShare", _tie_share, (None, None), False),
        _validated_op("InsideMask", _inside, (None,), False),
        _validated_op("ExtremeShare", _extreme_share, (None, None), False),
        _validated_op("LabelOneHot", _label_one_hot, (None, None), False),
        _validated_op("MatMulT", _matmul_t, (lambda g, ans, a, b: _matmul(g, b), _matmul_t_vjp_b), False),
        # The VJPs of tanh and sigmoid as one node each instead of three or four: a recurrent
        # loop has one per step, and the second differentiation goes through every node.
        _validated_op(
            "TanhGrad",
            _tanh_grad,
            (lambda G, ans, g, y: _tanh_vjp(G, y, y), lambda G, ans, g, y: -2.0 * G * g * y),
            False,
        ),
        _validated_op(
            "SigmoidGrad",
            _sigmoid_grad,
            (lambda G, ans, g, y: G * y * (1 - y), lambda G, ans, g, y: G * g * (1 - 2 * y)),
            False,
        ),
    )
}


# ---------------------------------------------------------------------------- building nodes


class _Sweep(threading.local):
    """Per thread: the graph the running recorded sweep adds its nodes to, the transposes it
    made (a weight used in every iteration of a loop is transposed once per sweep, not once per
    use; values do not change during a sweep), and the rows it stacked (see :func:`_gathered`)."""

    graph: ComputeGraph | None = None
    swapped: dict[ComputeNode, ComputeNode] | None = None
    stacks: dict[tuple[ComputeNode, ...], ComputeNode] | None = None


_current = _Sweep()


def _ap(op: str, *xs: Any, **attrs: Any) -> ComputeNode:
    """Add a node computing ``op`` (a name of the table or of :data:`HELPERS`) on ``xs`` to the
    graph of the running sweep."""
    return cast(ComputeGraph, _current.graph).apply(HELPERS.get(op) or op, xs, attrs or None)


def _add(a: Any, b: Any) -> ComputeNode:
    return _ap("Add", a, b)


def _sub(a: Any, b: Any) -> ComputeNode:
    return _ap("Sub", a, b)


def _mul(a: Any, b: Any) -> ComputeNode:
    return _ap("Mul", a, b)


def _div(a: Any, b: Any) -> ComputeNode:
    return _ap("Div", a, b)


def _neg(a: Any) -> ComputeNode:
    return _ap("Neg", a)


def _reshape(x: ComputeNode, shape: tuple[int, ...]) -> ComputeNode:
    shape = tuple(shape)
    if -1 in shape:  # resolved, so that a reshape that changes nothing adds no node
        known = math.prod(d for d in shape if d != -1)
        if known:
            shape = tuple(math.prod(x.shape) // known if d == -1 else d for d in shape)
    return x if x.shape == shape else _ap("Reshape", x, shape=shape)


def _item(x: ComputeNode, index: Any) -> ComputeNode:
    return _ap("GetItem", x, index=index)


def _swap(x: ComputeNode) -> ComputeNode:
    """``x`` with its last two axes swapped (one node per sweep for a leaf)."""
    memo = _current.swapped if x.op is None else None
    if memo is not None and x in memo:
        return memo[x]
    n = len(x.shape)
    out = _ap("Transpose", x, axes=(*range(n - 2), n - 1, n - 2))
    if memo is not None:
        memo[x] = out
    return out


def sum_to(x: ComputeNode, shape: tuple[int, ...]) -> ComputeNode:
    """``x`` summed over the axes broadcasting added or stretched, to ``shape`` (``x`` itself if it
    has that shape): the recorded counterpart of :func:`vgraph.ops.unbroadcast`."""
    return x if x.shape == tuple(shape) else _ap("SumTo", x, shape=tuple(shape))


def _kept_shape(shape: tuple[int, ...], axis: Any) -> tuple[int, ...]:
    """``shape`` with the reduced axes ``axis`` (``None``: all) kept with size 1."""
    if axis is None:
        return (1,) * len(shape)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    kept = list(shape)
    for a in axes:
        kept[int(a) % len(shape)] = 1
    return tuple(kept)


def _spread(g: ComputeNode, x: ComputeNode, axis: Any) -> ComputeNode:
    """The gradient ``g`` of a reduction of ``x`` over ``axis``, broadcast back to ``x``'s shape."""
    return _ap("BroadcastTo", _reshape(g, _kept_shape(x.shape, axis)), shape=x.shape)


def _count(x: ComputeNode, axis: Any) -> int:
    shape = x.shape
    if axis is None:
        return int(np.prod(shape))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    return int(np.prod([shape[int(a)] for a in axes]))


# ---------------------------------------------------------------------------- the rules
# One joint rule per op: rule(need, g, ans, *xs, **attrs) -> one gradient node (or None) per
# input, computed only where need[i] (the input takes a gradient). ``g``, ``ans`` and ``xs`` are
# nodes: ``ans`` is the node itself, so a rule that reads it (exp: g * ans) is differentiated
# through it. A gradient may have the broadcast shape; the sweep sums it back (sum_to).

Grads = list[ComputeNode | None]
Rule = Callable[..., Grads]


def _each(need: Sequence[bool], *make: Callable[[], ComputeNode]) -> Grads:
    return [f() if n else None for n, f in zip(need, make)]


def _matmul_grads(need: Sequence[bool], g: ComputeNode, a: ComputeNode, b: ComputeNode) -> Grads:
    """The gradients of ``a`` and ``b`` in ``g = a @ b`` (numpy's rules for 1-D operands)."""
    sa, sb = a.shape, b.shape
    if len(sa) == 1 and len(sb) == 1:
        return _each(need, lambda: _mul(g, b), lambda: _mul(g, a))
    a2 = _reshape(a, (1, *sa)) if len(sa) == 1 else a
    b2 = _reshape(b, (*sb, 1)) if len(sb) == 1 else b
    gs = g.shape
    if len(sb) == 1:
        gs = (*gs, 1)
    if len(sa) == 1:
        gs = (*gs[:-1], 1, gs[-1])
    g2 = _reshape(g, gs)

    def da() -> ComputeNode:
        prod = _ap("MatMulT", g2, b2) if len(b2.shape) == 2 else _ap("MatMul", g2, _swap(b2))
        return _reshape(sum_to(prod, a2.shape), sa)

    def db() -> Any:
        if len(b2.shape) == 2 and len(a2.shape) >= 2 and b.op is None and len(sb) == 2:
            # a leaf weight: one product over all its uses, at its turn (see _Pending)
            k, n = a2.shape[-1], g2.shape[-1]
            return _Product(_reshape(a2, (-1, k)), _reshape(g2, (-1, n)))
        if len(b2.shape) == 2 and len(a2.shape) > 2:  # rows of any batch shape times a matrix
            k, n = a2.shape[-1], g2.shape[-1]
            prod = _ap("MatMul", _swap(_reshape(a2, (-1, k))), _reshape(g2, (-1, n)))
        else:
            prod = sum_to(_ap("MatMul", _swap(a2), g2), b2.shape)
        return _reshape(prod, sb)

    return _each(need, da, db)


def _matmul_t_grads(need: Sequence[bool], g: ComputeNode, a: ComputeNode, b: ComputeNode) -> Grads:
    """The gradients of ``a`` and ``b`` in ``g = a @ b.T`` (``b`` a matrix)."""
    k, n = b.shape

    def db() -> Any:
        rows_g, rows_a = _reshape(g, (-1, k)), _reshape(a, (-1, n))
        if b.op is None:  # a leaf weight: one product over all its uses, at its turn (_Pending)
            return _Product(rows_g, rows_a)
        return _ap("MatMul", _swap(rows_g), rows_a)

    return _each(need, lambda: _ap("MatMul", g, b), db)


def _concat_rule(
    need: Sequence[bool], g: ComputeNode, ans: ComputeNode, *xs: ComputeNode, axis: int = 0
) -> Grads:
    ax = axis % len(ans.shape)
    out: Grads = []
    start = 0
    for x, n in zip(xs, need):
        size = x.shape[ax]
        index = (slice(None),) * ax + (slice(start, start + size),)
        out.append(_item(g, index) if n else None)
        start += size
    return out


def _stack_rule(
    need: Sequence[bool], g: ComputeNode, ans: ComputeNode, *xs: ComputeNode, axis: int = 0
) -> Grads:
    ax = axis % len(ans.shape)
    return [_item(g, (slice(None),) * ax + (i,)) if n else None for i, n in enumerate(need)]


def _pad_stack_rule(
    need: Sequence[bool], g: ComputeNode, ans: ComputeNode, *xs: ComputeNode, shape: tuple[int, ...]
) -> Grads:
    return [_item(g, (i, *(slice(0, n) for n in xs[i].shape))) if n else None for i, n in enumerate(need)]


def _cumsum_rule(
    need: Sequence[bool], g: ComputeNode, ans: ComputeNode, x: ComputeNode, axis: Any = None
) -> Grads:
    # Input i feeds every output from i on: the reversed cumulative sum of g, reversed.
    if axis is None:
        rev = (slice(None, None, -1),)
        return [_reshape(_item(_ap("CumSum", _item(g, rev)), rev), x.shape)]
    ax = int(axis) % len(x.shape)
    rev = (slice(None),) * ax + (slice(None, None, -1),)
    return [_item(_ap("CumSum", _item(g, rev), axis=ax), rev)]


def _lstm_rule(
    need: Sequence[bool], gs: ComputeNode, s: ComputeNode, xw: ComputeNode, hw: ComputeNode,
    b: ComputeNode, c: ComputeNode, gates: tuple[str, ...] = LSTM_GATES,
) -> Grads:  # fmt: skip
    # The value stacks [h', c', i, f, g, o]; as ops._lstm_cell_grads, with nodes.
    dh, dc_in = _item(gs, 0), _item(gs, 1)
    c_new, i, f, gg, o = (_item(s, k) for k in range(1, 6))
    tc = _ap("Tanh", c_new)
    dc = _add(_mul(_mul(dh, o), _sub(1, _mul(tc, tc))), dc_in)
    da_i = _add(_mul(dc, gg), _item(gs, 2))
    da_f = _add(_mul(dc, c), _item(gs, 3))
    da_g = _add(_mul(dc, i), _item(gs, 4))
    da_o = _add(_mul(dh, tc), _item(gs, 5))
    dz: ComputeNode | None = None
    if any(need[:3]):
        parts = [
            _mul(da_i, _mul(i, _sub(1, i))),
            _mul(da_f, _mul(f, _sub(1, f))),
            _mul(da_g, _sub(1, _mul(gg, gg))),
            _mul(da_o, _mul(o, _sub(1, o))),
        ]
        dz = _ap("Concat", *parts, axis=-1)
    return [dz if need[0] else None, dz if need[1] else None, dz if need[2] else None,
            _mul(dc, f) if need[3] else None]  # fmt: skip


def _gru_rule(
    need: Sequence[bool], gs: ComputeNode, s: ComputeNode, xw: ComputeNode, hw: ComputeNode,
    b_x: ComputeNode, b_h: ComputeNode, h: ComputeNode, gates: tuple[str, ...] = ("r", "z", "n"),
) -> Grads:  # fmt: skip
    # The value stacks [h', r, z, n]; as ops._gru_cell_grads, with nodes.
    H = s.shape[-1]
    dh = _item(gs, 0)
    r, z, n = (_item(s, k) for k in range(1, 4))
    last = (Ellipsis, slice(2 * H, 3 * H))
    gh_n = _add(_item(hw, last), _item(b_h, last))
    dn = _mul(_add(_mul(_sub(1, z), dh), _item(gs, 3)), _sub(1, _mul(n, n)))
    dr = _mul(_add(_mul(dn, gh_n), _item(gs, 1)), _mul(r, _sub(1, r)))
    dzz = _mul(_add(_mul(_sub(h, n), dh), _item(gs, 2)), _mul(z, _sub(1, z)))
    dgx = _ap("Concat", dr, dzz, dn, axis=-1) if need[0] or need[2] else None
    dgh = _ap("Concat", dr, dzz, _mul(dn, r), axis=-1) if need[1] or need[3] else None
    return [
        dgx if need[0] else None, dgh if need[1] else None, dgx if need[2] else None,
        dgh if need[3] else None, _mul(dh, z) if need[4] else None,
    ]  # fmt: skip


def _var_rule(
    need: Sequence[bool], g: ComputeNode, ans: ComputeNode, x: ComputeNode, axis: Any = None,
    keepdims: bool = False, ddof: int = 0,
) -> Grads:  # fmt: skip
    centred = _sub(x, _ap("Mean", x, axis=axis, keepdims=True))
    scale = 2.0 / (_count(x, axis) - ddof)
    return [_mul(_mul(_reshape(g, _kept_shape(x.shape, axis)), scale), centred)]


def _inverse(axes: Any, ndim: int) -> Any:
    return None if axes is None else tuple(int(i) for i in np.argsort([a % ndim for a in axes]))


#: The differentiable VJP of each built-in op, by op name: ``rule(need, g, ans, *xs, **attrs)``
#: gives one gradient node per input (``None`` where not ``need[i]`` or no gradient flows).
RULES: dict[str, Rule] = {
    "Add": lambda need, g, ans, a, b: _each(need, lambda: g, lambda: g),
    "Sub": lambda need, g, ans, a, b: _each(need, lambda: g, lambda: _neg(g)),
    "Mul": lambda need, g, ans, a, b: _each(need, lambda: _mul(g, b), lambda: _mul(g, a)),
    "Div": lambda need, g, ans, a, b: _each(need, lambda: _div(g, b), lambda: _neg(_div(_mul(g, ans), b))),
    "Neg": lambda need, g, ans, x: [_neg(g)],
    "Pow": lambda need, g, ans, x, p: [_mul(g, _mul(p, _ap("Pow", x, p=p - 1)))],
    "Exp": lambda need, g, ans, x: [_mul(g, ans)],
    "Log": lambda need, g, ans, x: [_div(g, x)],
    "Tanh": lambda need, g, ans, x: [_ap("TanhGrad", g, ans)],
    "Sigmoid": lambda need, g, ans, x: [_ap("SigmoidGrad", g, ans)],
    "Relu": lambda need, g, ans, x: [_mul(g, _ap("Step", x))],
    "Softplus": lambda need, g, ans, x: [_mul(g, _ap("Sigmoid", x))],
    "Abs": lambda need, g, ans, x: [_mul(g, _ap("Sign", x))],
    "Sqrt": lambda need, g, ans, x: [_div(_mul(g, 0.5), ans)],
    "Maximum": lambda need, g, ans, a, b: _each(
        need, lambda: _mul(g, _ap("TieShare", a, b)), lambda: _mul(g, _ap("TieShare", b, a))
    ),
    "Minimum": lambda need, g, ans, a, b: _each(
        need, lambda: _mul(g, _ap("TieShare", b, a)), lambda: _mul(g, _ap("TieShare", a, b))
    ),
    "Clip": lambda need, g, ans, x, lo=None, hi=None: [_mul(g, _ap("InsideMask", x, lo=lo, hi=hi))],
    "Where": lambda need, g, ans, cond, a, b: _each(
        need, lambda: g, lambda: _ap("Where", cond, g, 0.0), lambda: _ap("Where", cond, 0.0, g)
    ),
    "MatMul": lambda need, g, ans, a, b: _matmul_grads(need, g, a, b),
    "Linear": lambda need, g, ans, x, w, b: [*_matmul_grads(need[:2], g, x, w), g if need[2] else None],
    "Sum": lambda need, g, ans, x, axis=None, keepdims=False: [_spread(g, x, axis)],
    "Mean": lambda need, g, ans, x, axis=None, keepdims=False: [
        _mul(_spread(g, x, axis), 1.0 / _count(x, axis))
    ],
    "Max": lambda need, g, ans, x, axis=None, keepdims=False: [
        _mul(_spread(g, x, axis), _ap("ExtremeShare", x, ans, axis=axis, keepdims=keepdims))
    ],
    "Var": _var_rule,
    "CumSum": _cumsum_rule,
    "Softmax": lambda need, g, ans, x, axis=-1: [
        _mul(ans, _sub(g, _ap("Sum", _mul(g, ans), axis=axis, keepdims=True)))
    ],
    "LogSoftmax": lambda need, g, ans, x, axis=-1: [
        _sub(g, _mul(_ap("Exp", ans), _ap("Sum", g, axis=axis, keepdims=True)))
    ],
    "Reshape": lambda need, g, ans, x, shape: [_reshape(g, x.shape)],
    "Transpose": lambda need, g, ans, x, axes=None: [_ap("Transpose", g, axes=_inverse(axes, len(x.shape)))],
    "GetItem": lambda need, g, ans, x, index: [_ap("ScatterAdd", g, shape=x.shape, index=index)],
    "Take": lambda need, g, ans, x, indices: [_ap("ScatterTake", g, indices, shape=x.shape), None],
    "TakeAlongAxis": lambda need, g, ans, x, indices, axis=-1: [
        _ap("ScatterAlongAxis", g, indices, shape=x.shape, axis=axis),
        None,
    ],
    "Concat": _concat_rule,
    "Stack": _stack_rule,
    "PadStack": _pad_stack_rule,
    "Identity": lambda need, g, ans, x: [g],
    "Branch": lambda need, g, ans, x, *keys: [g, *(None for _ in keys)],
    "Hoisted": lambda need, g, ans, x, index: [_ap("ScatterAdd", g, shape=x.shape, index=index)],
    "AddRow": lambda need, g, ans, rows, x, index: _each(
        need, lambda: _ap("ScatterAdd", g, shape=rows.shape, index=index), lambda: g
    ),
    "MatMulAddRow": lambda need, g, ans, a, b, rows, index: [
        *_matmul_grads(need[:2], g, a, b),
        _ap("ScatterAdd", g, shape=rows.shape, index=index) if need[2] else None,
    ],
    "LSTMCell": _lstm_rule,
    "GRUCell": _gru_rule,
    "SoftmaxCrossEntropy": lambda need, g, ans, logits, labels: [
        _mul(
            _reshape(g, (*g.shape, 1)),
            _sub(_ap("Softmax", logits, axis=-1), _ap("LabelOneHot", labels, logits)),
        ),
        None,
    ],
    # the helper primitives above
    "ScatterAdd": lambda need, g, ans, x, shape, index: [_item(g, index)],
    "ScatterTake": lambda need, g, ans, x, indices, shape: [_ap("Take", g, indices), None],
    "ScatterAlongAxis": lambda need, g, ans, x, indices, shape, axis=-1: [
        _ap("TakeAlongAxis", g, indices, axis=axis),
        None,
    ],
    "BroadcastTo": lambda need, g, ans, x, shape: [sum_to(g, x.shape)],
    "MatMulT": lambda need, g, ans, a, b: _matmul_t_grads(need, g, a, b),
    "TanhGrad": lambda need, G, ans, g, y: _each(
        need, lambda: _ap("TanhGrad", G, y), lambda: _mul(_mul(_mul(G, g), y), -2.0)
    ),
    "SigmoidGrad": lambda need, G, ans, g, y: _each(
        need, lambda: _ap("SigmoidGrad", G, y), lambda: _mul(_mul(G, g), _sub(1.0, _mul(y, 2.0)))
    ),
    "SumTo": lambda need, g, ans, x, shape: [_ap("BroadcastTo", g, shape=x.shape)],
}
RULES["Min"] = RULES["Max"]  # (ExtremeShare finds the elements equal to the result either way)

#: The ops of a loop instance run as one body program (vgraph.virtual.program) and its outputs.
_PROGRAM_OPS = frozenset({"Program", "Loop", "LoopFinal", "LoopStack"})
#: Ops of the table that no rule covers, and why (the error says what to do instead).
_NOT_SUPPORTED = {
    "GatherRows": "rows of a batched build are not supported yet: build each input on its own "
    "(vgraph's build without batch=)",
}


def _rule_of(node: ComputeNode) -> Rule:
    """The differentiable VJP of ``node``'s op, or a SecondOrderError naming the node."""
    op = cast(Op, node.op)
    name = op.name
    if op.node_vjps is not None:
        return _user_rule(op)
    if name == "Branch" and op.arity is not None:  # a BranchNode's op: the option, then its keys
        return RULES["Branch"]
    if (OPS.get(name) is op or HELPERS.get(name) is op) and name in RULES:
        return RULES[name]
    if name in _PROGRAM_OPS and OPS.get(name) is not op:
        why = (
            "it belongs to a loop instance run as one body program, whose VJP is plain numpy; "
            "build with programs=False (g.build(..., programs=False), or inside "
            "vg.body_programs(False)) to unroll the loop node by node for second order "
            "(vg.hvp, vg.hvp_operator and vg.gnvp do so themselves)"
        )
    elif name in _NOT_SUPPORTED:
        why = _NOT_SUPPORTED[name]
    elif op.user:
        why = (
            "its VJPs are plain numpy: define it with vgraph.defop(..., node_vjps=...) to give "
            "differentiable ones (see docs/custom_ops.md)"
        )
    else:
        why = "it has no differentiable VJP"
    raise SecondOrderError(
        f"{node.describe()}: cannot record the gradient of op {name} as graph nodes "
        f"(create_graph=True): {why}"
    )


def _user_rule(op: Op) -> Rule:
    """The rule of a :func:`vgraph.defop` op from its ``node_vjps``."""
    fs = cast("tuple[Any, ...]", op.node_vjps)

    def rule(need: Sequence[bool], g: ComputeNode, ans: ComputeNode, *xs: ComputeNode, **attrs: Any) -> Grads:
        if op.variadic:
            return [fs[0](i, g, ans, *xs, **attrs) if n else None for i, n in enumerate(need)]
        return [f(g, ans, *xs, **attrs) if n and f is not None else None for f, n in zip(fs, need)]

    return rule


# ---------------------------------------------------------------------------- the recorded sweep


class _Pending:
    """A gradient reaching a node in parts kept apart until the node's turn, then summed in a few
    nodes instead of one node per part:

    - ``rows``: whole rows (``x[t]``: a stepped sequence's items, a hoisted group's copies),
      stacked in one ``Stack`` node — the ``ScatterAdd`` of each row into an array of the node's
      size would cost O(T) each, O(T^2) over a loop;
    - ``products``: ``a_t^T g_t`` (the gradient of a weight ``W`` in ``a_t @ W``, once per
      iteration of a loop), one product of the rows stacked — as the first-order sweep does for a
      tied weight (docs/decisions.md), instead of a product and a sum per iteration;
    - ``other``: every other contribution, summed as it comes.
    """

    __slots__ = ("other", "products", "rows")

    def __init__(self, other: ComputeNode | None) -> None:
        self.rows: dict[int, ComputeNode] = {}
        self.products: list[tuple[ComputeNode, ComputeNode]] = []
        self.other = other


class _Product:
    """What a rule returns for ``a^T @ g`` (2-D, the gradient of a leaf weight) instead of a node:
    the sweep collects these per weight (:class:`_Pending`)."""

    __slots__ = ("a", "g", "shape")

    def __init__(self, a: ComputeNode, g: ComputeNode) -> None:
        self.a, self.g = a, g
        self.shape = (a.shape[1], g.shape[1])


_ROW_OPS = {"GetItem": 0, "Hoisted": 0, "AddRow": 0, "MatMulAddRow": 2}  # op -> the input read by row


def _row_of(node: ComputeNode, i: int) -> int | None:
    """The row ``t`` of input ``i`` that ``node`` reads whole (``x[t]``), or ``None``."""
    op = cast(Op, node.op)
    if _ROW_OPS.get(op.name) != i or OPS.get(op.name) is not op:
        return None
    index = node.attrs.get("index")
    if type(index) is not int:
        return None
    p = node.parents[i]
    return index % p.shape[0] if len(p.shape) >= 1 and -p.shape[0] <= index < p.shape[0] else None


def _name_new(results: Sequence[ComputeNode | None], since: int, name: str) -> None:
    """Name the nodes made after clock reading ``since`` that ``results`` are computed from."""
    stack = [r for r in results if r is not None]
    while stack:
        n = stack.pop()
        if n.serial > since and n.name is None:
            n.name = name
            stack.extend(n.parents)


def _check_supported(cg: ComputeGraph, plan: list[ComputeNode], reach: set[ComputeNode]) -> None:
    """Raise, before any node is added, for a node of ``plan`` a recorded sweep cannot go through."""
    for n in plan:
        if n.op is None or n not in reach:
            continue
        if any(p in reach and v is not None and p.requires_grad for p, v in zip(n.parents, n.vjps)):
            _rule_of(n)


def _sweep(
    cg: ComputeGraph,
    roots: list[tuple[ComputeNode, Any]],
    wanted: Sequence[ComputeNode],
    allow_unused: bool = True,
) -> dict[ComputeNode, ComputeNode]:
    """The recorded reverse sweep: the gradient node of each of ``wanted`` that a gradient reaches
    from ``roots`` (``(output, seed)`` pairs: a seed is a node or what ``cg._seed`` takes). Adds
    the nodes to ``cg``; raises before adding any if it cannot go through or (without
    ``allow_unused``) a wanted node gets no gradient."""
    if cg.dropped_values is not None:
        raise SecondOrderError(
            f"{roots[0][0].describe()}: a graph with checkpointed loops drops values, which recorded "
            "gradients (create_graph=True) would read; build without checkpoint= for second order"
        )
    deferred = cg._deferred
    for x in (*wanted, *(r for r, _ in roots)):
        if x in deferred or cg._gradient_sources([x]):
            raise SecondOrderError(
                f"{x.describe()} is computed when read, or its gradient is a row of a hoisted "
                "group's: recorded gradients (create_graph=True) cannot be taken from or to it; "
                "build with hoist=False"
            )
    plan = list(cg._sweep_plan([r for r, _ in roots]))
    # Only the nodes on a path from a root to a wanted node take part.
    reach = set(wanted)
    for n in reversed(plan):
        if n not in reach and any(p in reach for p in n.parents):
            reach.add(n)
    below = {r for r, _ in roots if r in reach}
    for n in plan:
        if n in below:
            below.update(
                p for p, v in zip(n.parents, n.vjps) if v is not None and p.requires_grad and p in reach
            )
    reach &= below
    unused = [x for x in wanted if x not in reach]
    if unused and not allow_unused:
        raise not_reached(unused)
    _check_supported(cg, plan, reach)
    wanted_set = set(wanted)
    found: dict[ComputeNode, ComputeNode] = {}
    pending: dict[ComputeNode, Any] = {}
    start = next_version()
    outer = (_current.graph, _current.swapped, _current.stacks)
    _current.graph, _current.swapped, _current.stacks = cg, {}, {}
    try:
        for r, s in roots:
            if r in reach:
                s = _seed_node(cg, r, s)
                pending[r] = s if r not in pending else _add(pending[r], s)
        for n in plan:
            if n not in pending:
                continue
            g = _gathered(n, pending.pop(n))
            if g.serial > start and (g.name is None or g.name.startswith("vjp of")):
                g.name = f"gradient of <{n.key}>"
            if n in wanted_set:
                found[n] = g
            if n.op is None:
                continue
            parents = n.parents
            need = [v is not None and p.requires_grad and p in reach for p, v in zip(parents, n.vjps)]
            if not any(need):
                continue
            since = next_version()
            rows = {}  # inputs read by whole rows: their gradient is g itself, as that row
            for i, p in enumerate(parents):
                t = _row_of(n, i) if need[i] else None
                if t is not None and g.shape == p.shape[1:]:
                    rows[i] = t
                    need[i] = False
            try:
                grads = _rule_of(n)(need, g, n, *parents, **n.attrs) if any(need) else []
            except VGraphError as e:  # (a non-finite value under anomaly mode, say): say where
                raise type(e)(f"{e}\n  (recording the VJP of {n.describe()}, create_graph=True)") from e
            for i, t in rows.items():
                _add_row(pending, parents[i], t, g)
            for i, (p, pg) in enumerate(zip(parents, grads)):
                if pg is None or not need[i]:
                    continue
                part = _checked(n, p, i, pg)
                if isinstance(part, ComputeNode):
                    _name_new([part], since, f"vjp of <{n.key}>")
                _accumulate(pending, p, part)
    except BaseException:
        _rollback(cg, start)
        raise
    finally:
        _current.graph, _current.swapped, _current.stacks = outer
    return found


def _rollback(cg: ComputeGraph, since: int) -> None:
    """Take the nodes made after clock reading ``since`` out of ``cg`` again (a sweep that raised
    part-way: a failed call changes nothing). They are the last ones added: the graph is
    append-only, and a sweep adds no leaf that was made before it."""
    nodes, removed = cg._nodes, []
    while nodes:
        key = next(reversed(nodes))
        if nodes[key].serial <= since:
            break
        removed.append(nodes.pop(key))
    leaves = cg._leaves
    while leaves and leaves[-1].serial > since:
        leaves.pop()
    for n in removed:  # their ids are free again, as apply() frees a failed call's constants'
        if not n.key.idx:
            cg._counters[n.key.type] = min(cg._counters.get(n.key.type, 0), n.key.id - 1)


def _checked(node: ComputeNode, p: ComputeNode, i: int, pg: Any) -> ComputeNode | _Product:
    """A rule's gradient for input ``i`` (``p``) of ``node``, summed to ``p``'s shape; a
    SecondOrderError for a result that is not a node of the graph of that shape or the output's."""
    if isinstance(pg, _Product):  # (made by a built-in rule, of the input's shape)
        return pg
    if not isinstance(pg, ComputeNode):
        raise SecondOrderError(
            f"{node.describe()}: the differentiable VJP of {cast(Op, node.op).name} for input {i} "
            f"{p.describe()} returned a {type(pg).__name__}, not a graph node (build it with vgraph "
            "operations on the nodes it gets)"
        )
    if pg.shape != p.shape:
        if not _broadcasts_to(p.shape, pg.shape):
            expected = f"the input's {p.shape}"
            if _broadcasts_to(p.shape, node.shape):
                expected += f" or the output's {node.shape}"
            raise SecondOrderError(
                f"{node.describe()}: the differentiable VJP of {cast(Op, node.op).name} for input "
                f"{i} {p.describe()} returned shape {pg.shape}; expected {expected}"
            )
        return sum_to(pg, p.shape)
    return pg


def _accumulate(pending: dict[ComputeNode, Any], p: ComputeNode, pg: ComputeNode | _Product) -> None:
    """Add ``pg``, a gradient sent to ``p``, to ``p``'s pending gradient."""
    acc = pending.get(p)
    if isinstance(pg, _Product):
        if not isinstance(acc, _Pending):
            acc = pending[p] = _Pending(acc)
        acc.products.append((pg.a, pg.g))
    elif acc is None:
        pending[p] = pg
    elif isinstance(acc, _Pending):
        acc.other = pg if acc.other is None else _add(acc.other, pg)
    else:
        total = _add(acc, pg)
        total.name = f"gradient of <{p.key}>"
        pending[p] = total


def _add_row(pending: dict[ComputeNode, Any], p: ComputeNode, t: int, g: ComputeNode) -> None:
    """Add ``g`` to row ``t`` of ``p``'s pending gradient."""
    acc = pending.get(p)
    if not isinstance(acc, _Pending):
        acc = pending[p] = _Pending(acc)
    old = acc.rows.get(t)
    acc.rows[t] = g if old is None else _add(old, g)


def _joined(parts: list[ComputeNode], stack: bool) -> ComputeNode:
    """``parts`` stacked along a new first axis (``stack``) or concatenated along the first axis.
    The same parts are joined once per sweep, the other way being a reshape of that node: a
    loop's step gradients are often both the rows of a hoisted group's gradient and the rows of
    a tied weight's product (as the first-order sweep shares their stack, ops._rows_stack)."""
    memo = cast("dict[tuple[ComputeNode, ...], ComputeNode]", _current.stacks)
    key = tuple(parts)
    made = memo.get(key)
    if made is None:
        made = memo[key] = _ap("Stack" if stack else "Concat", *parts, axis=0)
        return made
    return _reshape(made, (len(parts), *parts[0].shape) if stack else (-1, *parts[0].shape[1:]))


def _gathered(n: ComputeNode, acc: Any) -> ComputeNode:
    """The pending gradient of ``n`` as one node (rows stacked, products of stacked rows)."""
    if not isinstance(acc, _Pending):
        return cast(ComputeNode, acc)
    total = acc.other
    if acc.rows:
        graph = cast(ComputeGraph, _current.graph)
        zero: ComputeNode | None = None
        parts = []
        for t in range(n.shape[0]):
            row = acc.rows.get(t)
            if row is None:
                if zero is None:
                    zero = graph.constant(np.zeros(n.shape[1:], dtype=n.dtype))
                row = zero
            parts.append(row)
        stacked = _joined(parts, stack=True)
        total = stacked if total is None else _add(total, stacked)
    if acc.products:
        pairs = acc.products[::-1]  # first use first
        a = pairs[0][0] if len(pairs) == 1 else _joined([a for a, _ in pairs], stack=False)
        g = pairs[0][1] if len(pairs) == 1 else _joined([g for _, g in pairs], stack=False)
        product = _ap("MatMul", _swap(a), g)
        total = product if total is None else _add(total, product)
    total = cast(ComputeNode, total)
    total.name = f"gradient of <{n.key}>"
    return total


# ---------------------------------------------------------------------------- entry points


def _seed_node(cg: ComputeGraph, out: ComputeNode, seed: Any) -> ComputeNode:
    """The seed of a recorded sweep from ``out`` as a node: ``seed`` itself if it is a node of
    ``out``'s shape, else a constant (``cg._seed``'s checks)."""
    if isinstance(seed, ComputeNode):
        if seed.shape != out.shape:
            raise ShapeError(
                f"seed for {out.describe()} has shape {seed.shape}, the node has shape {out.shape}"
            )
        return seed
    return cg.constant(cg._seed(out, seed), name=f"seed of <{out.key}>")


def backward(cg: ComputeGraph, loss: ComputeNode, seed: Any) -> None:
    """``cg.backward(loss, seed, create_graph=True)`` after its checks: the gradient of every leaf
    that requires one (and of every node that retains its gradient) recorded as a node, set as
    its ``.grad_node``, and its value added to its ``.grad``."""
    wanted = [n for n in cg._sweep_plan([loss]) if (n.op is None or n.retains_grad) and n not in cg._deferred]
    with gc_paused():
        found = _sweep(cg, [(loss, seed)], wanted)
    cg._commit([(n, np.array(g.value), True) for n, g in found.items()])
    for n, g in found.items():
        n.grad_node = g


def grad(
    cg: ComputeGraph,
    outs: Sequence[ComputeNode],
    ins: Sequence[ComputeNode],
    seeds: Sequence[Any],
    allow_unused: bool,
) -> list[ComputeNode | None]:
    """``cg.grad(outs, ins, seeds, create_graph=True)`` after its checks: the gradients of ``ins``
    as nodes of ``cg`` (``None`` for an unused input, with ``allow_unused``)."""
    for o, s in zip(outs, seeds):  # (the seeds' checks, before any node is added)
        _seed_node(cg, o, s) if isinstance(s, ComputeNode) else cg._seed(o, s)
    live = [(o, s) for o, s in zip(outs, seeds) if o.requires_grad]
    if live:
        cg._check_values_fresh([o for o, _ in live], "grad")
    with gc_paused():
        found = _sweep(cg, live, ins, allow_unused) if live else {}
    if found and all(not isinstance(s, ComputeNode) or s.op is None for _, s in live):
        # The outputs' values were checked up to date above, and every node recorded was computed
        # from them (or from leaves) just now: a backward from the gradients (a Hessian-vector
        # product) needs no check of the whole graph.
        cg._mark_fresh(found.values())
    if not live and not allow_unused:
        raise not_reached(ins)
    return [found.get(x) for x in ins]


# ---------------------------------------------------------------------------- products with curvature


def _graph_of(loss: Any, params: Any, fn: str) -> tuple[ComputeGraph, list[ComputeNode]]:
    """The graph of ``loss`` and ``params`` as a list of nodes, checked."""
    if not isinstance(loss, ComputeNode):
        raise ArgumentError(f"{fn}(): loss must be a ComputeNode, got {type(loss).__name__}")
    cg = loss.graph
    if cg is None:
        raise GraphStateError(f"{fn}(): {loss.describe()} belongs to no live ComputeGraph")
    params = list(cg._nodes_arg(params, "params", fn))
    return cg, params


def _per_node(cg: ComputeGraph, nodes: Sequence[ComputeNode]) -> tuple[ComputeGraph, list[ComputeNode]]:
    """``cg``'s per-node form and ``nodes`` in it: the products below record gradients as nodes,
    which a loop run as a body program cannot (its VJP is numpy), so they work on the loop
    unrolled node by node — a build of the same values and parameters (the leaves are shared)."""
    graph = cg.per_node()
    return graph, [cg._counterpart(graph, n) for n in nodes]


def _vector(v: Any, params: Sequence[ComputeNode], fn: str) -> list[Any]:
    """``v`` checked: one array per parameter, of its shape."""
    if isinstance(v, np.ndarray) and len(params) == 1:
        v = [v]
    if not isinstance(v, (list, tuple)) or len(v) != len(params):
        raise ArgumentError(
            f"{fn}: v must be a list of {len(params)} array(s), one per parameter, got "
            f"{type(v).__name__}{'' if not isinstance(v, (list, tuple)) else f' of {len(v)}'}"
        )
    for part, p in zip(v, params):
        if np.shape(part) != p.shape:
            raise ShapeError(
                f"{fn}: the part of v for {p.describe()} has shape {np.shape(part)}, expected {p.shape}"
            )
    return list(v)


def _vjp(
    cg: ComputeGraph, outs: Sequence[ComputeNode | None], seeds: Sequence[Any], wrt: Sequence[ComputeNode]
) -> list[np.ndarray]:
    """``sum_i seeds_i . d outs_i / d wrt`` by one ordinary backward from ``outs`` (brought up to
    date first if a leaf changed) seeded with ``seeds``: zeros for a node of ``wrt`` that no
    output depends on, and no output where ``outs`` has ``None``."""
    live = [(o, s) for o, s in zip(outs, seeds) if o is not None and o.requires_grad]
    found: list[np.ndarray | None] = [None] * len(wrt)
    if live:
        roots = [o for o, _ in live]
        if not cg._known_fresh(roots):
            cg.forward(roots)
        found = cg.grad(roots, list(wrt), seeds=[s for _, s in live], retain_graph=True, allow_unused=True)
    return [np.zeros(p.shape, dtype=p.dtype) if g is None else g for g, p in zip(found, wrt)]


class HessianVectorProduct:
    """``v -> H v``, ``H`` the Hessian of a scalar ``loss`` with respect to ``params``, by
    reverse-over-reverse: the gradient ``g`` is recorded once as nodes (``create_graph=True``);
    each product, the gradient of ``<g, v>``, is one ordinary (first-order) backward from those
    nodes seeded with ``v`` (after a forward of what changed, if a leaf changed) — about 3-4
    gradients' work. Build one per graph and call it many times (conjugate gradient).

    Args:
        loss: a scalar node.
        params: the nodes (leaves, usually parameters) to take the Hessian with respect to.

    Raises:
        ArgumentError: ``loss`` is not a node, or a parameter is not a node of its graph.
        SecondOrderError: the gradient cannot be recorded (see :func:`vgraph.higher.grad`).
    """

    def __init__(self, loss: ComputeNode, params: Sequence[ComputeNode]) -> None:
        cg, params = _graph_of(loss, params, "hvp")
        cg, (loss, *self.params) = _per_node(cg, [loss, *params])
        self.graph = cg
        self.loss = loss
        self._grads = cg.grad(loss, self.params, create_graph=True, allow_unused=True)

    def __call__(self, v: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``H v``: one array per parameter.

        Args:
            v: one array per parameter, of its shape.

        Raises:
            ArgumentError, ShapeError: ``v`` is not one array of each parameter's shape.
        """
        return _vjp(self.graph, self._grads, _vector(v, self.params, "hvp"), self.params)


def hvp(loss: ComputeNode, params: Sequence[ComputeNode], v: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The Hessian-vector product ``H v`` of a scalar ``loss`` with respect to ``params``.

    Reverse over reverse: the gradient is recorded as nodes of the loss's graph, then
    differentiated once more by an ordinary backward. It works through everything the recorded
    gradient does: loops (second-order backpropagation through time), branches, ``while_`` loops
    and recursions. Each call adds the recorded gradient to the graph again: for many products on
    one graph, make a :class:`HessianVectorProduct` once (:func:`hvp_operator`) and call it.

    Args:
        loss: a scalar node (e.g. a build's loss).
        params: the nodes to differentiate with respect to.
        v: one array per parameter, of its shape.

    Returns:
        ``H v``, one array per parameter.

    Raises:
        ArgumentError, ShapeError: bad ``loss``, ``params`` or ``v``.
        SecondOrderError: a node whose gradient cannot be recorded (names it).
    """
    params = _graph_of(loss, params, "hvp")[1]
    parts = _vector(v, params, "hvp")  # (checked before anything is recorded)
    return HessianVectorProduct(loss, params)(parts)


def hvp_operator(loss: ComputeNode, params: Sequence[ComputeNode]) -> HessianVectorProduct:
    """``v -> H v`` for repeated products on one graph (see :class:`HessianVectorProduct`)."""
    return HessianVectorProduct(loss, params)


class GaussNewtonVectorProduct:
    """``v -> J^T H_L J v``: the Gauss-Newton matrix of ``loss = L(output)`` with respect to
    ``params`` (``J`` the Jacobian of ``output``, ``H_L`` the Hessian of the loss with respect to
    ``output``) times ``v``: positive semi-definite for a convex ``L`` (squared error,
    cross-entropy), what Hessian-free optimisation (Martens, 2010) multiplies by.

    ``J v`` comes from reverse over reverse (the gradient ``J^T u`` recorded as nodes for an input
    ``u``, differentiated with respect to ``u`` by a backward seeded with ``v``), ``H_L (J v)``
    from the loss's recorded gradient (a backward seeded with ``J v``), and ``J^T (H_L J v)`` from
    an ordinary backward from ``output``.

    Args:
        loss: a scalar node computed from ``output``.
        output: the model's output node.
        params: the nodes to differentiate with respect to.

    Raises:
        ArgumentError: bad arguments. SecondOrderError: as :class:`HessianVectorProduct`.
    """

    def __init__(self, loss: ComputeNode, output: ComputeNode, params: Sequence[ComputeNode]) -> None:
        cg, params = _graph_of(loss, params, "gnvp")
        output = cg._node_arg(output, "output", "gnvp")
        cg, (loss, output, *self.params) = _per_node(cg, [loss, output, *params])
        self.graph, self.loss, self.output = cg, loss, output
        u = cg.input(np.zeros(self.output.shape, dtype=self.output.dtype), name="u", requires_grad=True)
        self._u = u
        self._jt_u = cg.grad(self.output, self.params, seeds=u, create_graph=True, allow_unused=True)
        self._gz = cg.grad(loss, self.output, create_graph=True)[0]

    def __call__(self, v: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``J^T H_L J v``: one array per parameter (``v``: one array per parameter)."""
        cg = self.graph
        parts = _vector(v, self.params, "gnvp")
        (jv,) = _vjp(cg, self._jt_u, parts, [self._u])
        (hjv,) = _vjp(cg, [self._gz], [jv], [self.output])
        return _vjp(cg, [self.output], [hjv], self.params)


def gnvp(
    loss: ComputeNode, output: ComputeNode, params: Sequence[ComputeNode], v: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """The Gauss-Newton-vector product ``J^T H_L J v`` (see :class:`GaussNewtonVectorProduct`;
    make one of those for many products on one graph).

    Args:
        loss: a scalar node computed from ``output``.
        output: the model's output node.
        params: the nodes to differentiate with respect to.
        v: one array per parameter, of its shape.

    Returns:
        One array per parameter.
    """
    return GaussNewtonVectorProduct(loss, output, params)(v)


# ---------------------------------------------------------------------------- checking the rules


def rule_mismatches(
    output: ComputeNode, seed: int = 0, atol: float = 1e-8, rtol: float = 1e-6
) -> list[tuple[ComputeNode, int, float]]:
    """The op nodes ``output`` depends on whose differentiable VJP (the rule a recorded gradient
    uses) disagrees with the op's numpy VJP, for a random incoming gradient at the nodes' current
    values: ``(node, input position, max abs difference)``, in topological order.

    Each rule is evaluated on a scratch graph holding copies of the node's input values, so
    ``output``'s graph is not changed. A rule that agrees in value everywhere has the right
    derivatives too, being built from differentiable ops; this finds a rule that is wrong.

    Raises:
        SecondOrderError: a node has no differentiable VJP.
    """
    from .ops import as_array

    rng = np.random.default_rng(seed)
    seen, stack = {output}, [output]
    while stack:
        for p in stack.pop().parents:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    wrong = []
    for n in sorted(seen, key=lambda x: x.serial):
        if n.op is None or not n.requires_grad:
            continue
        need = [v is not None and p.requires_grad for p, v in zip(n.parents, n.vjps)]
        if not any(need):
            continue
        rule = _rule_of(n)
        values = [np.asarray(p.value) for p in n.parents]
        ans_value = n.value
        g = rng.standard_normal(np.shape(ans_value)).astype(np.asarray(ans_value).dtype)
        scratch = ComputeGraph(dtype=n.graph.dtype if n.graph is not None else None)
        outer = _current.graph
        _current.graph = scratch
        try:
            xs = [scratch.input(v, requires_grad=v.dtype.kind == "f") for v in values]
            ans = scratch.apply(n.op, xs, dict(n.attrs) or None)
            grads = rule(need, scratch.input(g), ans, *xs, **n.attrs)
            for i, (vjp, pg) in enumerate(zip(n.vjps, grads)):
                if not need[i] or vjp is None or pg is None:
                    continue
                expected = as_array(vjp(g, ans_value, *values, **n.attrs))
                expected = np.asarray(unbroadcast(expected, values[i].shape))
                if isinstance(pg, _Product):
                    pg = _ap("MatMul", _swap(pg.a), pg.g)
                got = np.asarray(sum_to(pg, values[i].shape).value)
                err = float(np.max(np.abs(got - expected), initial=0.0))
                if got.shape != expected.shape or not np.allclose(got, expected, atol=atol, rtol=rtol):
                    wrong.append((n, i, err))
        finally:
            _current.graph = outer
    return wrong


__all__ = [
    "RULES",
    "GaussNewtonVectorProduct",
    "HessianVectorProduct",
    "backward",
    "gnvp",
    "grad",
    "hvp",
    "hvp_operator",
    "rule_mismatches",
    "sum_to",
]
