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

Adding a built-in op is adding one ``defop`` entry below. Users add their own primitives with
:func:`vgraph.defop` (the same arguments, validated the same way by :func:`defop` here), which
also returns the function to call on nodes; see docs/custom_ops.md.
"""

from __future__ import annotations

import inspect
import re
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

#: Node types that are not ops of the table (leaves, loop parts, structure checks): an op may not
#: take these names, or its nodes would be confused with them in keys, renders and look-ups.
RESERVED_TYPES = frozenset(
    {"Input", "Parameter", "Constant", "Sample", "Loop", "Carry", "Item", "Final", "LengthCheck", "LoopCheck"}
)
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _signature(f: Callable[..., Any]) -> inspect.Signature | None:
    """``f``'s signature, or ``None`` where Python cannot tell (numpy ufuncs, some builtins)."""
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):
        return None


def _takes_positionals(f: Callable[..., Any], n: int) -> bool:
    """Whether ``f`` can be called with ``n`` positional arguments (``True`` if unknowable)."""
    sig = _signature(f)
    if sig is None:
        return True
    try:
        sig.bind_partial(*range(n))
    except TypeError:
        return False
    return True


def _validated_op(name: Any, forward: Any, vjps: tuple[Any, ...], variadic: bool) -> Op:
    """Build an :class:`Op` after checking every argument; raises before anything is registered."""
    if not isinstance(name, str):
        raise TypeError(f"an op name must be a str, got {type(name).__name__}")
    if not _OP_NAME.fullmatch(name):
        raise ValueError(
            f"op name {name!r} is not an identifier (letters, digits, '_'): it is the node type in "
            "keys such as 'MatMul:1@2.5', so it cannot contain ':', '@', '.' or spaces"
        )
    if name in RESERVED_TYPES:
        raise ValueError(f"op name {name!r} is reserved for vgraph's own {name} nodes; choose another name")
    if not isinstance(variadic, bool):
        raise TypeError(f"{name}: variadic must be a bool, got {type(variadic).__name__}")
    if not callable(forward):
        raise TypeError(f"{name}: forward must be callable, got {type(forward).__name__}")
    for i, vjp in enumerate(vjps):
        if vjp is not None and not callable(vjp):
            raise TypeError(
                f"{name}: VJP {i} must be callable or None (no gradient), got {type(vjp).__name__}"
            )
    if variadic:
        if len(vjps) != 1 or vjps[0] is None:
            got = "None" if len(vjps) == 1 else f"{len(vjps)} arguments after forward"
            raise ValueError(
                f"{name}: a variadic op takes exactly one VJP function, vjp(i, g, ans, *xs, **attrs), "
                f"got {got}"
            )
        sig = _signature(forward)
        if sig is not None and not any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
            raise TypeError(f"{name}: a variadic op's forward must take *xs, got forward{sig}")
        if not _takes_positionals(vjps[0], 4):
            raise TypeError(
                f"{name}: a variadic op's VJP must take (i, g, ans, *xs), got vjp{_signature(vjps[0])}"
            )
        return Op(name, forward, vjps[0], variadic=True, arity=None)
    arity = len(vjps)
    if arity == 0:
        raise ValueError(
            f"{name}: give one VJP (or None) per input after forward; with none, the op has no inputs"
        )
    if not _takes_positionals(forward, arity):
        raise TypeError(
            f"{name}: {arity} VJPs say the op has {arity} inputs, but forward{_signature(forward)} "
            f"cannot take {arity} positional arguments"
        )
    args = ", ".join(f"x{k}" for k in range(arity))
    for i, vjp in enumerate(vjps):
        if vjp is not None and not _takes_positionals(vjp, 2 + arity):
            raise TypeError(
                f"{name}: VJP {i} must take (g, ans, {args}) — the incoming gradient, the op's "
                f"output and every input — but its signature is {_signature(vjp)}"
            )
    return Op(name, forward, tuple(vjps), variadic=False, arity=arity)


def defop(
    name: str, forward: Callable[..., Any], *vjps: VJP | None, variadic: bool = False, replace: bool = False
) -> Op:
    """Register a primitive in the table and return it.

    Fixed-arity ops pass one VJP (or ``None``) per input; variadic ops pass a single
    ``vjp(i, g, ans, *xs, **attrs)``. This is the table's own registration; users call
    :func:`vgraph.defop`, which validates the same way and also gives a function to call on nodes.

    Args:
        name: the node type of the op's nodes (an identifier, not a reserved node type).
        forward: ``forward(*xs, **attrs) -> ans`` in numpy.
        vjps: one ``vjp(g, ans, *xs, **attrs)`` or ``None`` per input (one function for a variadic op).
        variadic: the op takes any number of inputs.
        replace: overwrite an op already registered under ``name``.

    Returns:
        The registered :class:`Op`.

    Raises:
        ValueError: ``name`` is taken (and not ``replace``), not an identifier or reserved; no VJP
            given, or not exactly one for a variadic op.
        TypeError: ``name`` is not a str; ``forward`` or a VJP is not callable, or cannot take
            the number of inputs the VJPs imply.
    """
    op = _validated_op(name, forward, vjps, variadic)
    if name in OPS and not replace:
        raise ValueError(f"op {name!r} is already defined")
    OPS[name] = op
    return op


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
def _matmul_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, wrt: int) -> np.ndarray:
    if a.ndim == 2 and b.ndim == 2:
        return g @ b.T if wrt == 0 else a.T @ g
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
    np.matmul,
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


def _getitem_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, index: Any) -> np.ndarray:
    out = np.zeros(x.shape, dtype=g.dtype)
    if _is_basic_index(index):
        out[index] = g  # a basic index selects each element at most once
    else:
        np.add.at(out, index, g)  # integer arrays may repeat rows: accumulate
    return out


defop("GetItem", lambda x, index: x[index], _getitem_vjp)


def _take_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape, dtype=g.dtype)
    np.add.at(out, indices, g)  # repeated rows accumulate
    return out


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
