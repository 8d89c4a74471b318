"""The primitive table: every op's forward (numpy) and its VJP for each input, side by side.

One convention for every op:

* ``forward(*xs, **attrs) -> ans``
* ``vjp(g, ans, *xs, **attrs) -> gradient for one input``, one function per input, where ``g`` is
  the gradient of the final output with respect to ``ans``. ``None`` in place of a function spells
  "no gradient flows to this input" (it is treated as zero).
* Variadic ops (``Concat``, ``Stack``) have one VJP ``vjp(i, g, ans, *xs, **attrs)`` that takes the
  input's position first.

A VJP may return a gradient with the *broadcast* shape; the engine reduces it back to the input's
shape in one place (:func:`unbroadcast`), so no op repeats that logic.

Adding an op is adding one ``defop`` entry below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

VJP = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Op:
    """A primitive: its node type name, forward function and per-input VJPs."""

    name: str
    forward: Callable[..., Any]
    vjps: tuple[VJP | None, ...] | VJP
    variadic: bool = False
    #: Number of inputs (``None`` for variadic ops).
    arity: int | None = None


OPS: dict[str, Op] = {}


def defop(name: str, forward: Callable[..., Any], *vjps: VJP | None, variadic: bool = False) -> Op:
    """Register a primitive. Fixed-arity ops pass one VJP (or ``None``) per input; variadic ops
    pass a single ``vjp(i, g, ans, *xs, **attrs)``."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already defined")
    if variadic:
        (vjp,) = vjps
        op = Op(name, forward, vjp, variadic=True, arity=None)
    else:
        op = Op(name, forward, tuple(vjps), variadic=False, arity=len(vjps))
    OPS[name] = op
    return op


class LazyGrad:
    """A gradient contribution kept in a cheaper form than a dense array until it is needed.

    A VJP may return one instead of an array. The engine adds it into a gradient buffer it owns
    (:meth:`add_into`), merges two of them (:meth:`merge`), and turns what reached a node into an
    array only when that node's turn comes in the backward sweep (:meth:`dense`). This is what
    keeps stepping through a sequence O(T): each step's gradient lands in one shared buffer.

    Attributes:
        shape: the shape of the input the gradient is for.
        dtype: its dtype.
    """

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape = shape
        self.dtype = dtype

    def add_into(self, acc: np.ndarray) -> None:
        """Add this contribution into ``acc`` (shape :attr:`shape`) in place."""
        raise NotImplementedError

    def dense(self) -> np.ndarray:
        """This contribution as a new array."""
        out = np.zeros(self.shape, dtype=self.dtype)
        self.add_into(out)
        return out

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        """The sum of two contributions; the default is a new dense array."""
        out = self.dense()
        other.add_into(out)
        return out


class IndexedGrad(LazyGrad):
    """``g`` placed at ``index`` of a zero array of ``shape`` (the VJP of an indexing op)."""

    __slots__ = ("basic", "g", "index")

    def __init__(self, shape: tuple[int, ...], dtype: Any, index: Any, g: np.ndarray, basic: bool) -> None:
        super().__init__(shape, dtype)
        self.index = index
        self.g = g
        self.basic = basic  # a basic index selects each element at most once

    def add_into(self, acc: np.ndarray) -> None:
        if self.basic:
            acc[self.index] += self.g
        else:
            np.add.at(acc, self.index, self.g)  # integer arrays may repeat rows: accumulate


class RowsProductGrad(LazyGrad):
    """``sum_k a_k.T @ g_k`` over 2-D ``a_k`` (rows, I) and ``g_k`` (rows, H): the gradient of a
    weight ``W`` in ``x @ W``, collected over every use of ``W`` (every iteration of a loop) and
    computed as one stacked product when all uses are in — one ``(I, T*rows) @ (T*rows, H)`` call
    instead of T small products and T additions."""

    __slots__ = ("a", "g")

    def __init__(self, a: np.ndarray, g: np.ndarray) -> None:
        super().__init__((a.shape[1], g.shape[1]), np.result_type(a, g))
        self.a = [a]
        self.g = [g]

    def dense(self) -> np.ndarray:
        if len(self.a) == 1:
            return self.a[0].T @ self.g[0]
        return np.concatenate(self.a).T @ np.concatenate(self.g)

    def add_into(self, acc: np.ndarray) -> None:
        acc += self.dense()

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if isinstance(other, RowsProductGrad):  # self is one node's pending gradient: extend it
            self.a.extend(other.a)
            self.g.extend(other.g)
            return self
        return super().merge(other)


def as_array(g: Any) -> np.ndarray:
    """A VJP's result as an array (a :class:`LazyGrad` is made dense), for callers of VJPs other
    than the engine's backward sweep."""
    return g.dense() if isinstance(g, LazyGrad) else np.asarray(g)


def add_grads(acc: Any, g: Any) -> Any:
    """``acc + g`` as a new value, for gradients that may be :class:`LazyGrad` s."""
    if isinstance(acc, LazyGrad):
        if isinstance(g, LazyGrad):
            return acc.merge(g)
        out = np.array(g, dtype=acc.dtype)
        acc.add_into(out)
        return out
    if isinstance(g, LazyGrad):
        out = np.array(acc, dtype=g.dtype)
        g.add_into(out)
        return out
    return acc + g


def unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` over the axes numpy broadcasting added or stretched, giving an array of ``shape``."""
    g = np.asarray(g)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)
    return g


# ---------------------------------------------------------------------------- elementwise
defop("Add", np.add, lambda g, ans, a, b: g, lambda g, ans, a, b: g)
defop("Sub", np.subtract, lambda g, ans, a, b: g, lambda g, ans, a, b: -g)
defop("Mul", np.multiply, lambda g, ans, a, b: g * b, lambda g, ans, a, b: g * a)
defop("Div", np.divide, lambda g, ans, a, b: g / b, lambda g, ans, a, b: -g * ans / b)
defop("Neg", np.negative, lambda g, ans, x: -g)
defop(
    "Pow",
    lambda x, p: np.power(x, p),
    lambda g, ans, x, p: g * (p * np.power(x, p - 1)),
)
defop("Exp", np.exp, lambda g, ans, x: g * ans)
defop("Log", np.log, lambda g, ans, x: g / x)
defop("Tanh", np.tanh, lambda g, ans, x: g * (1 - ans * ans))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warning for large |x|, unlike 1 / (1 + exp(-x)).
    return 0.5 * (np.tanh(0.5 * x) + 1)


defop("Sigmoid", _sigmoid, lambda g, ans, x: g * ans * (1 - ans))
defop("Relu", lambda x: np.maximum(x, 0), lambda g, ans, x: g * (x > 0))
defop("Softplus", lambda x: np.logaddexp(0, x), lambda g, ans, x: g * _sigmoid(x))
# Step and Sign are flat almost everywhere: their gradient is zero (seed 000).
defop("Step", lambda x: (x > 0).astype(x.dtype), None)
defop("Sign", np.sign, None)
defop("Abs", np.abs, lambda g, ans, x: g * np.sign(x))
defop(
    "Where",
    lambda cond, a, b: np.where(cond, a, b),
    None,
    lambda g, ans, cond, a, b: np.where(cond, g, 0),
    lambda g, ans, cond, a, b: np.where(cond, 0, g),
)


# ---------------------------------------------------------------------------- linear algebra
def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.ndim > 2 and b.ndim == 2:  # (..., I) @ (I, H) as one 2-D product: numpy's stacked
        rows = a.reshape(-1, a.shape[-1])  # matmul loops over the leading axes, ~10x slower
        return (rows @ b).reshape(*a.shape[:-1], b.shape[-1])
    return np.matmul(a, b)


def _matmul_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, wrt: int) -> Any:
    if b.ndim == 2 and a.ndim >= 2:
        if wrt == 0:  # g (..., H) @ b.T, as one 2-D product
            return (g.reshape(-1, g.shape[-1]) @ b.T).reshape(a.shape)
        # Every use of a weight in a loop contributes a_t^T g_t: collect them and compute one
        # (T*rows)-row product when the weight's turn comes (see RowsProductGrad).
        return RowsProductGrad(a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1]))
    # General case: promote 1-D operands to matrices as np.matmul does, then undo it.
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g
    if b.ndim == 1:  # first: for 1-D @ 1-D, g is 0-d and has no axis -2 yet
        g2 = np.expand_dims(g2, -1)
    if a.ndim == 1:
        g2 = np.expand_dims(g2, -2)
    if wrt == 0:
        ga = g2 @ np.swapaxes(b2, -1, -2)
        return ga[..., 0, :] if a.ndim == 1 else ga
    gb = np.swapaxes(a2, -1, -2) @ g2
    return gb[..., 0] if b.ndim == 1 else gb


defop(
    "MatMul",
    _matmul,
    lambda g, ans, a, b: _matmul_vjp(g, a, b, 0),
    lambda g, ans, a, b: _matmul_vjp(g, a, b, 1),
)


# ---------------------------------------------------------------------------- reductions
def _expand_reduced(g: np.ndarray, x: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
    """Give a reduced gradient back the reduced axes (size 1), so it broadcasts against ``x``."""
    if keepdims:
        return g
    if axis is None:
        return np.reshape(g, (1,) * x.ndim)
    return np.expand_dims(g, axis)


def _count(x: np.ndarray, axis: Any) -> int:
    if axis is None:
        return x.size
    axes = (axis,) if isinstance(axis, int) else axis
    return int(np.prod([x.shape[a] for a in axes]))


defop(
    "Sum",
    lambda x, axis=None, keepdims=False: np.sum(x, axis=axis, keepdims=keepdims),
    lambda g, ans, x, axis=None, keepdims=False: np.broadcast_to(
        _expand_reduced(g, x, axis, keepdims), x.shape
    ),
)
defop(
    "Mean",
    lambda x, axis=None, keepdims=False: np.mean(x, axis=axis, keepdims=keepdims),
    lambda g, ans, x, axis=None, keepdims=False: np.broadcast_to(
        _expand_reduced(g, x, axis, keepdims) / _count(x, axis), x.shape
    ),
)


def _max_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, axis: Any = None, keepdims: bool = False):
    ans_k = _expand_reduced(ans, x, axis, keepdims)
    g_k = _expand_reduced(g, x, axis, keepdims)
    hit = x == ans_k
    # Ties share the gradient equally, so the VJP is the average of the one-sided derivatives.
    return g_k * hit / hit.sum(axis=axis, keepdims=True)


defop(
    "Max",
    lambda x, axis=None, keepdims=False: np.max(x, axis=axis, keepdims=keepdims),
    _max_vjp,
)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


defop(
    "Softmax",
    _softmax,
    lambda g, ans, x, axis=-1: ans * (g - (g * ans).sum(axis=axis, keepdims=True)),
)
defop(
    "LogSoftmax",
    _log_softmax,
    lambda g, ans, x, axis=-1: g - np.exp(ans) * g.sum(axis=axis, keepdims=True),
)


# ---------------------------------------------------------------------------- shape and indexing
defop("Reshape", lambda x, shape: np.reshape(x, shape), lambda g, ans, x, shape: np.reshape(g, x.shape))


def _inverse_axes(axes: Any, ndim: int) -> Any:
    return None if axes is None else tuple(np.argsort([a % ndim for a in axes]))


defop(
    "Transpose",
    lambda x, axes=None: np.transpose(x, axes),
    lambda g, ans, x, axes=None: np.transpose(g, _inverse_axes(axes, x.ndim)),
)


def _is_basic_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in items)


def _getitem_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, index: Any) -> IndexedGrad:
    # Lazy: stepping through a (T, B, H) sequence gives T of these, which the engine adds into one
    # buffer (O(T) in all) instead of zero-filling a (T, B, H) array per step (O(T^2)).
    return IndexedGrad(x.shape, g.dtype, index, g, _is_basic_index(index))


defop("GetItem", lambda x, index: x[index], _getitem_vjp)


def _take_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, indices: np.ndarray) -> IndexedGrad:
    return IndexedGrad(x.shape, g.dtype, indices, g, False)  # repeated rows accumulate


def _take_along_axis_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, indices: np.ndarray, axis: int = -1):
    out = np.zeros(x.shape, dtype=g.dtype)
    where = list(np.indices(g.shape, sparse=True))
    where[axis] = np.broadcast_to(indices, g.shape)
    np.add.at(out, tuple(where), g)
    return out


# Look-ups whose indices are a node (e.g. tokens or labels fed at build time); GetItem's index is
# static. The indices get no gradient.
defop("Take", lambda x, indices: x[indices], _take_vjp, None)
defop(
    "TakeAlongAxis",
    lambda x, indices, axis=-1: np.take_along_axis(x, indices, axis),
    _take_along_axis_vjp,
    None,
)


def _concat_vjp(i: int, g: np.ndarray, ans: np.ndarray, *xs: np.ndarray, axis: int = 0) -> np.ndarray:
    axis = axis % ans.ndim
    start = sum(x.shape[axis] for x in xs[:i])
    sl = [slice(None)] * ans.ndim
    sl[axis] = slice(start, start + xs[i].shape[axis])
    return g[tuple(sl)]


def _stack_vjp(i: int, g: np.ndarray, ans: np.ndarray, *xs: np.ndarray, axis: int = 0) -> np.ndarray:
    return np.take(g, i, axis=axis)


defop("Concat", lambda *xs, axis=0: np.concatenate(xs, axis=axis), _concat_vjp, variadic=True)
defop("Stack", lambda *xs, axis=0: np.stack(xs, axis=axis), _stack_vjp, variadic=True)


# ---------------------------------------------------------------------------- structural
# Identity ops that exist for what they mean in the graph, not for their arithmetic.
defop("Detach", lambda x: x, None)  # stops the gradient
defop("Branch", lambda x: x, lambda g, ans, x: g)  # the option a BranchNode selected
defop("Identity", lambda x: x, lambda g, ans, x: g)
# One iteration's copy of a hoisted loop-body node: row ``index`` of the node computed for every
# iteration at once (see vgraph.virtual.hoist). A view; its gradient lands in the group's buffer.
defop("Hoisted", lambda x, index: x[index], _getitem_vjp)
