"""Python operators and functions over graph nodes, shared by compute and virtual nodes.

``a + b``, ``a @ b``, ``x[1:3]``, ``vgraph.tanh(x)`` … all reduce to one call,
``node._apply(op_name, inputs, attrs)``, which each node kind implements: a
:class:`~vgraph.compute.ComputeNode` computes the op at once in its ComputeGraph, a
:class:`~vgraph.virtual.VirtualNode` declares it in its VirtualGraph. Operands that are not nodes
(Python numbers, numpy arrays) become constants.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import ops as _ops
from .errors import ArgumentError, OpDefinitionError, VGraphError
from .ops import GRU_GATES, LSTM_GATES


class Operand:
    """Mixin giving a node class numpy-like operators. Subclasses implement ``_apply``."""

    __slots__ = ()
    # Make numpy defer to our reflected operators: ``ndarray + node`` calls ``node.__radd__``.
    __array_ufunc__ = None

    def _apply(self, op: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def __add__(self, other: Any) -> Any:
        return self._apply("Add", (self, other), {})

    def __radd__(self, other: Any) -> Any:
        return self._apply("Add", (other, self), {})

    def __sub__(self, other: Any) -> Any:
        return self._apply("Sub", (self, other), {})

    def __rsub__(self, other: Any) -> Any:
        return self._apply("Sub", (other, self), {})

    def __mul__(self, other: Any) -> Any:
        return self._apply("Mul", (self, other), {})

    def __rmul__(self, other: Any) -> Any:
        return self._apply("Mul", (other, self), {})

    def __truediv__(self, other: Any) -> Any:
        return self._apply("Div", (self, other), {})

    def __rtruediv__(self, other: Any) -> Any:
        return self._apply("Div", (other, self), {})

    def __matmul__(self, other: Any) -> Any:
        return self._apply("MatMul", (self, other), {})

    def __rmatmul__(self, other: Any) -> Any:
        return self._apply("MatMul", (other, self), {})

    def __neg__(self) -> Any:
        return self._apply("Neg", (self,), {})

    def __abs__(self) -> Any:
        return self._apply("Abs", (self,), {})

    def __pow__(self, exponent: float) -> Any:
        if isinstance(exponent, Operand) or not isinstance(exponent, (int, float)):
            raise VGraphError(
                f"x ** p needs a Python number p (got {type(exponent).__name__}); "
                "for a node exponent write exp(p * log(x))"
            )
        return self._apply("Pow", (self,), {"p": float(exponent)})

    def __iter__(self) -> Any:
        # Without this, Python would iterate a node by indexing it 0, 1, 2, … forever.
        raise TypeError(f"{type(self).__name__} is not iterable: index it (x[0], x[1]) or use its value")

    def __getitem__(self, index: Any) -> Any:
        return self._apply("GetItem", (self,), {"index": index})

    @property
    def T(self) -> Any:
        """The transpose (all axes reversed)."""
        return self._apply("Transpose", (self,), {"axes": None})

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        """Sum over ``axis`` (all axes when ``None``)."""
        return self._apply("Sum", (self,), {"axis": axis, "keepdims": keepdims})

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        """Mean over ``axis`` (all axes when ``None``)."""
        return self._apply("Mean", (self,), {"axis": axis, "keepdims": keepdims})

    def max(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        """Maximum over ``axis``; ties share the gradient equally."""
        return self._apply("Max", (self,), {"axis": axis, "keepdims": keepdims})

    def min(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        """Minimum over ``axis``; ties share the gradient equally."""
        return self._apply("Min", (self,), {"axis": axis, "keepdims": keepdims})

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Any:
        """Index of the maximum along ``axis`` (``vgraph.argmax``): integers, no gradient."""
        return self._apply("ArgMax", (self,), {"axis": axis, "keepdims": keepdims})

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Any:
        """Index of the minimum along ``axis`` (``vgraph.argmin``): integers, no gradient."""
        return self._apply("ArgMin", (self,), {"axis": axis, "keepdims": keepdims})

    def reshape(self, *shape: int | tuple[int, ...]) -> Any:
        """The same values in a new shape (``-1`` infers one dimension)."""
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        return self._apply("Reshape", (self,), {"shape": tuple(shape)})

    def detach(self) -> Any:
        """The same value with the gradient stopped (``vgraph.detach(x)``, as ``tensor.detach()``)."""
        return self._apply("Detach", (self,), {})

    def transpose(self, *axes: int) -> Any:
        """Permute the axes (reverse them when none are given)."""
        if len(axes) == 1 and isinstance(axes[0], tuple):
            axes = axes[0]
        return self._apply("Transpose", (self,), {"axes": tuple(axes) if axes else None})


def _dispatch(op: str, inputs: tuple[Any, ...], attrs: dict[str, Any] | None = None) -> Any:
    for x in inputs:
        if isinstance(x, Operand):
            return x._apply(op, inputs, attrs or {})
    raise VGraphError(
        f"{op} needs at least one graph node among its inputs "
        f"(got {', '.join(type(x).__name__ for x in inputs)}); use numpy for plain arrays"
    )


def matmul(a: Any, b: Any) -> Any:
    """Matrix product ``a @ b`` (numpy semantics: 1-D operands, batched leading axes)."""
    return _dispatch("MatMul", (a, b))


def linear(x: Any, w: Any, b: Any) -> Any:
    """``x @ w + b`` as one ``Linear`` node (what :class:`vgraph.nn.Linear` declares).

    The bias is added into the product's own array, so the node keeps one value the size of the
    result where ``x @ w + b`` keeps two (the product and the sum); values and gradients are the
    same to the last bit. Loops hoist it and ``build_batch`` groups it as it does ``x @ w``.

    Args:
        x: the input, shape ``(..., in)`` (numpy's matmul rules).
        w: the weight, shape ``(in, out)``.
        b: the bias, the shape of the last axes of ``x @ w`` (``(out,)`` for a 2-D weight).

    Returns:
        A node of the shape of ``x @ w``.

    Raises:
        ShapeError: (when computed) the operands do not multiply, or the bias does not have the
            shape of the product's last axes; it names the node.
    """
    return _dispatch("Linear", (x, w, b))


def exp(x: Any) -> Any:
    """Elementwise ``e ** x``."""
    return _dispatch("Exp", (x,))


def log(x: Any) -> Any:
    """Elementwise natural logarithm."""
    return _dispatch("Log", (x,))


def tanh(x: Any) -> Any:
    """Elementwise hyperbolic tangent."""
    return _dispatch("Tanh", (x,))


def sigmoid(x: Any) -> Any:
    """Elementwise logistic function ``1 / (1 + exp(-x))``, computed without overflow."""
    return _dispatch("Sigmoid", (x,))


def relu(x: Any) -> Any:
    """Elementwise ``max(x, 0)``; the gradient at 0 is 0."""
    return _dispatch("Relu", (x,))


def softplus(x: Any) -> Any:
    """Elementwise ``log(1 + exp(x))``, computed without overflow."""
    return _dispatch("Softplus", (x,))


def step(x: Any) -> Any:
    """Elementwise ``1 if x > 0 else 0``. Its gradient is zero."""
    return _dispatch("Step", (x,))


def sign(x: Any) -> Any:
    """Elementwise sign (-1, 0 or 1). Its gradient is zero."""
    return _dispatch("Sign", (x,))


def abs(x: Any) -> Any:
    """Elementwise absolute value; the gradient at 0 is 0."""
    return _dispatch("Abs", (x,))


def sum(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
    """Sum over ``axis`` (all axes when ``None``)."""
    return _dispatch("Sum", (x,), {"axis": axis, "keepdims": keepdims})


def mean(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
    """Mean over ``axis`` (all axes when ``None``)."""
    return _dispatch("Mean", (x,), {"axis": axis, "keepdims": keepdims})


def max(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
    """Maximum over ``axis``; ties share the gradient equally."""
    return _dispatch("Max", (x,), {"axis": axis, "keepdims": keepdims})


def min(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
    """Minimum over ``axis`` (all axes when ``None``); ties share the gradient equally.

    ``numpy.min`` / ``torch.amin``.
    """
    return _dispatch("Min", (x,), {"axis": axis, "keepdims": keepdims})


def var(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False, ddof: int = 0) -> Any:
    """Variance over ``axis`` (all axes when ``None``), ``mean((x - mean(x)) ** 2)``.

    As ``numpy.var``: ``ddof=0`` divides by the count, ``ddof=1`` by the count minus one
    (``torch.var``'s default, ``unbiased=True``).

    Raises:
        TypeError: ``ddof`` is not an int.
    """
    if isinstance(ddof, bool) or not isinstance(ddof, int):
        raise TypeError(f"var: ddof must be an int, got {type(ddof).__name__} {ddof!r}")
    return _dispatch("Var", (x,), {"axis": axis, "keepdims": keepdims, "ddof": ddof})


def argmax(x: Any, axis: int | None = None, keepdims: bool = False) -> Any:
    """Index of the maximum along ``axis`` (of the flattened array when ``None``), as ``numpy.argmax``.

    The result holds integers and has no gradient (nothing flows back through it, as for
    :func:`step`). Use it where a decision is an index: the next token of greedy decoding, fed
    to :func:`take` or :func:`one_hot`, carried by a loop (``loop.carry(np.zeros(B, int))``) or
    read by a ``while_`` / ``until`` condition. On ties, the first index wins.

    Args:
        x: a node.
        axis: the axis to search along, e.g. ``-1`` for the classes of ``(batch, classes)``.
        keepdims: keep the reduced axis with size 1.

    Returns:
        A node of integers (numpy's ``intp``), of ``x``'s shape without ``axis``.
    """
    return _dispatch("ArgMax", (x,), {"axis": axis, "keepdims": keepdims})


def argmin(x: Any, axis: int | None = None, keepdims: bool = False) -> Any:
    """Index of the minimum along ``axis``, as ``numpy.argmin``; integers, no gradient (see
    :func:`argmax`)."""
    return _dispatch("ArgMin", (x,), {"axis": axis, "keepdims": keepdims})


def maximum(a: Any, b: Any) -> Any:
    """Elementwise maximum of two operands (numpy broadcasting); where they are equal, each gets
    half the gradient (as ``torch.maximum``)."""
    return _dispatch("Maximum", (a, b))


def minimum(a: Any, b: Any) -> Any:
    """Elementwise minimum of two operands (numpy broadcasting); ties share the gradient equally."""
    return _dispatch("Minimum", (a, b))


def clip(x: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """Elementwise ``min(max(x, lo), hi)`` with numbers ``lo`` and ``hi`` (``None``: no bound),
    as ``numpy.clip`` / ``torch.clamp``. The gradient passes where ``lo <= x <= hi``.

    Raises:
        TypeError: a bound that is not a number or ``None``.
        ValueError: both bounds, and ``lo > hi``.
    """
    for name, bound in (("lo", lo), ("hi", hi)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
            raise TypeError(
                f"clip: {name} must be a number or None, got {type(bound).__name__}; for a node bound "
                "use vgraph.maximum / vgraph.minimum"
            )
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clip: lo={lo} is above hi={hi}")
    return _dispatch("Clip", (x,), {"lo": lo, "hi": hi})


def sqrt(x: Any) -> Any:
    """Elementwise square root (``x ** 0.5``)."""
    return _dispatch("Sqrt", (x,))


def cumsum(x: Any, axis: int | None = None) -> Any:
    """Cumulative sum along ``axis`` (of the flattened array when ``None``), as ``numpy.cumsum``."""
    return _dispatch("CumSum", (x,), {"axis": axis})


def one_hot(indices: Any, depth: int) -> Any:
    """Rows of the ``depth x depth`` identity picked by integer ``indices``: ``eye(depth)[indices]``
    (``torch.nn.functional.one_hot``, in the graph's float dtype).

    Args:
        indices: a node of integers in ``[0, depth)`` (e.g. :func:`argmax`'s result).
        depth: the number of classes.

    Returns:
        A node of shape ``indices.shape + (depth,)``, with no gradient.

    Raises:
        TypeError: ``depth`` is not a positive int, or ``indices`` is not a node.
        ShapeError: (when computed) indices that are not integers or out of range; it names the node.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise TypeError(f"one_hot: depth must be a positive int, got {depth!r}")
    if not isinstance(indices, Operand):
        raise TypeError(
            f"one_hot: indices must be a graph node, got {type(indices).__name__}; "
            "for a fixed array use numpy.eye(depth)[indices]"
        )
    graph = indices.graph  # type: ignore[attr-defined]  # both node kinds have one (None: a dead graph's)
    dtype = np.float64 if graph is None else graph.dtype
    return _dispatch("OneHot", (indices,), {"depth": depth, "dtype": np.dtype(dtype).name})


def split(x: Any, indices_or_sections: int | Sequence[int], axis: int = 0) -> list[Any]:
    """Split ``x`` along ``axis`` into parts, as ``numpy.split``: an int ``n`` gives ``n`` equal
    parts, a list of positions ``[i, j]`` gives ``x[:i], x[i:j], x[j:]``. Each part is a slice
    of ``x`` (a ``GetItem`` node), so the gradients of the parts meet in ``x``.

    An int needs the size of ``axis`` to be known when declaring (see ``VirtualNode.shape``);
    otherwise give the positions.

    Returns:
        A list of nodes.

    Raises:
        TypeError: ``indices_or_sections`` is neither an int nor a sequence of ints.
        ValueError: ``n`` parts of a size that ``n`` does not divide, or of an unknown size.
    """
    if isinstance(indices_or_sections, bool):
        raise TypeError("split: indices_or_sections must be an int or a sequence of ints, got a bool")
    if isinstance(indices_or_sections, int):
        n = indices_or_sections
        shape = getattr(x, "shape", None)
        size = None
        if shape is not None and -len(shape) <= axis < len(shape):
            size = shape[axis]
        if n < 1 or size is None or size % n:
            what = "an unknown size" if size is None else f"size {size}"
            raise ValueError(
                f"split: cannot cut axis {axis} of {what} into {n} equal parts; give the split positions"
            )
        positions: list[int] = [size // n * k for k in range(1, n)]
    else:
        try:
            positions = [int(i) for i in indices_or_sections]
        except (TypeError, ValueError):
            raise TypeError(
                f"split: indices_or_sections must be an int or a sequence of ints, got {indices_or_sections!r}"
            ) from None
    bounds = [None, *positions, None]
    lead = (slice(None),) * axis if axis >= 0 else (Ellipsis,)
    tail = (slice(None),) * (-axis - 1) if axis < 0 else ()
    indices = [(*lead, slice(a, b), *tail) for a, b in itertools.pairwise(bounds)]
    return [x[index] for index in indices]


def reshape(x: Any, shape: tuple[int, ...]) -> Any:
    """The same values in a new shape."""
    return _dispatch("Reshape", (x,), {"shape": tuple(shape)})


def transpose(x: Any, axes: tuple[int, ...] | None = None) -> Any:
    """Permute the axes (reverse them when ``axes`` is ``None``)."""
    return _dispatch("Transpose", (x,), {"axes": None if axes is None else tuple(axes)})


def concat(xs: Sequence[Any], axis: int = 0) -> Any:
    """Join nodes along an existing axis (``numpy.concatenate``)."""
    return _dispatch("Concat", tuple(xs), {"axis": axis})


def stack(xs: Sequence[Any], axis: int = 0) -> Any:
    """Join nodes along a new axis (``numpy.stack``)."""
    return _dispatch("Stack", tuple(xs), {"axis": axis})


def take(x: Any, indices: Any) -> Any:
    """Rows of ``x`` picked by integer ``indices`` (a node or an array): ``x[indices]``.

    The result has shape ``indices.shape + x.shape[1:]``; repeated indices accumulate their
    gradients (``np.add.at``). Use it when the indices are data, e.g. tokens fed to an embedding.
    """
    return _dispatch("Take", (x, indices))


def take_along_axis(x: Any, indices: Any, axis: int = -1) -> Any:
    """``numpy.take_along_axis``: for each position, the element of ``x`` along ``axis`` that
    ``indices`` names (e.g. each row's log-probability of its label, with ``indices`` of shape
    ``(batch, 1)``)."""
    return _dispatch("TakeAlongAxis", (x, indices), {"axis": axis})


def where(cond: Any, a: Any, b: Any) -> Any:
    """Elementwise ``a if cond else b``; ``cond`` gets no gradient."""
    return _dispatch("Where", (cond, a, b))


def softmax(x: Any, axis: int = -1) -> Any:
    """Softmax along ``axis``, shifted by the maximum for numerical stability."""
    return _dispatch("Softmax", (x,), {"axis": axis})


def log_softmax(x: Any, axis: int = -1) -> Any:
    """Log of the softmax along ``axis``, computed stably (log-sum-exp)."""
    return _dispatch("LogSoftmax", (x,), {"axis": axis})


def softmax_cross_entropy(logits: Any, labels: Any) -> Any:
    """Per-row softmax cross-entropy, ``-log_softmax(logits)[..., label]``, as one fused node.

    Each row's loss is its log-sum-exp (shifted by the row maximum: logits of ``±1000`` are fine)
    minus the label's logit. The node's type is ``SoftmaxCrossEntropy``; its VJP writes
    ``g * (softmax(logits) - onehot(labels))`` into the one array it returns, instead of the
    several arrays of the logits' size that ``log_softmax`` then ``take_along_axis`` cost.
    :func:`vgraph.losses.cross_entropy` uses it.

    Args:
        logits: a node of shape ``S + (C,)`` (last axis: classes).
        labels: integer class indices of shape ``S`` in ``[-C, C)`` (a node or an array; negative
            labels count from the end, as numpy indices do). They get no gradient.

    Returns:
        A node of shape ``S``: the loss of each row.

    Raises:
        ShapeError: (when computed) labels that are not integers, not of shape ``S``, or out of
            range; it names the node and the input shapes.
    """
    return _dispatch("SoftmaxCrossEntropy", (logits, labels))


def detach(x: Any) -> Any:
    """The same value, with the gradient stopped: nothing flows back through the result."""
    return _dispatch("Detach", (x,))


def lstm_cell(xw: Any, hw: Any, b: Any, c: Any) -> Any:
    """One fused LSTM step from its projections: a single ``LSTMCell`` node.

    With ``z = xw + hw + b`` split into four blocks of H columns (gates in PyTorch's order)::

        i, f, g, o = sigmoid(z_i), sigmoid(z_f), tanh(z_g), sigmoid(z_o)
        c' = f * c + i * g
        h' = o * tanh(c')

    The node's value stacks the new state and the gate activations on a new leading axis:
    ``value[k]`` is ``h', c', i, f, g, o`` for ``k = 0 … 5``; take ``h'`` and ``c'`` as
    ``value[0]`` and ``value[1]`` (what :class:`vgraph.nn.LSTMCell` does). Its
    VJP is hand-written: every input gets its gradient from one pass over the stored gates.

    Args:
        xw: ``x @ W_x``, shape ``(..., 4H)``.
        hw: ``h @ W_h``, shape ``(..., 4H)``.
        b: the bias, shape ``(4H,)`` (anything broadcastable against ``xw``).
        c: the cell state, shape ``(..., H)``.

    Returns:
        A node of shape ``(6, ..., H)``, ``...`` the broadcast batch shape of the inputs.

    Raises:
        ShapeError: (when computed) the projections do not have ``4 * c.shape[-1]`` columns, or
            the shapes do not broadcast; it names the node and the input shapes.
    """
    return _dispatch("LSTMCell", (xw, hw, b, c), {"gates": LSTM_GATES})


def gru_cell(xw: Any, hw: Any, b_x: Any, b_h: Any, h: Any) -> Any:
    """One fused GRU step from its projections: a single ``GRUCell`` node.

    With ``gx = xw + b_x`` and ``gh = hw + b_h`` split into three blocks of H columns (PyTorch's
    equations and gate order)::

        r = sigmoid(gx_r + gh_r)
        z = sigmoid(gx_z + gh_z)
        n = tanh(gx_n + r * gh_n)
        h' = (1 - z) * n + z * h

    The node's value stacks ``h'`` and the gate activations on a new leading axis:
    ``value[k]`` is ``h', r, z, n`` for ``k = 0 … 3``; take ``h'`` as ``value[0]`` (what
    :class:`vgraph.nn.GRUCell` does).

    Args:
        xw: ``x @ W_x``, shape ``(..., 3H)``.
        hw: ``h @ W_h``, shape ``(..., 3H)``.
        b_x, b_h: the input and hidden biases, shape ``(3H,)``.
        h: the hidden state, shape ``(..., H)``.

    Returns:
        A node of shape ``(4, ..., H)``, ``...`` the broadcast batch shape of the inputs.

    Raises:
        ShapeError: (when computed) the projections do not have ``3 * h.shape[-1]`` columns, or
            the shapes do not broadcast; it names the node and the input shapes.
    """
    return _dispatch("GRUCell", (xw, hw, b_x, b_h, h), {"gates": GRU_GATES})


# ---------------------------------------------------------------------------- user-defined ops
_USER_OPS: set[str] = set()  # names registered by defop below (built-ins are never replaced or removed)


class OpFunction:
    """The function :func:`defop` returns: applies a user-defined op to graph nodes.

    ``f(*inputs, **attrs)`` works on compute nodes (computes now) and on virtual nodes (declares a
    node that every build computes), like the built-in functions (``vgraph.tanh``). Numbers and
    arrays among the inputs become constants; keyword arguments are the op's static attributes,
    passed to its forward and VJPs. It applies the op registered under its name at call time, so
    after ``defop(..., replace=True)`` it uses the new definition.
    """

    __slots__ = ("name", "_signatures")

    def __init__(self, name: str) -> None:
        self.name = name
        # Inspecting signatures costs more than applying most ops: once per definition of the op
        # and per form of call (number of inputs, attribute names) that passed.
        self._signatures: (
            tuple[_ops.Op, list[tuple[str, inspect.Signature, int]], set[tuple[Any, ...]]] | None
        ) = None

    @property
    def op(self) -> _ops.Op:
        """The registered op.

        Raises:
            VGraphError: the op was removed with :func:`undefop`.
        """
        op = _ops.OPS.get(self.name)
        if op is None or self.name not in _USER_OPS:
            raise VGraphError(f"op {self.name!r} is no longer defined (removed with vgraph.undefop)")
        return op

    def __call__(self, *inputs: Any, **attrs: Any) -> Any:
        op = self.op
        if op.arity is not None and len(inputs) != op.arity:
            raise ArgumentError(
                f"{op.name} takes {op.arity} input{'s' if op.arity != 1 else ''} (one per VJP given to "
                f"defop), got {len(inputs)}"
            )
        if not inputs:
            raise ArgumentError(f"{op.name} needs at least one input")
        cache = self._signatures
        if cache is None or cache[0] is not op:
            cache = self._signatures = (op, _signatures(op), set())
        # Whether a call binds depends only on the number of inputs and the attribute names.
        form = (len(inputs), *attrs)
        if form not in cache[2]:
            _check_call(op, cache[1], inputs, attrs)
            cache[2].add(form)
        return _dispatch(op.name, inputs, attrs)

    def __repr__(self) -> str:
        op = _ops.OPS.get(self.name)
        if op is None or self.name not in _USER_OPS:
            return f"<vgraph op {self.name} (removed)>"
        inputs = "any number of inputs" if op.variadic else f"{op.arity} input{'s' if op.arity != 1 else ''}"
        return f"<vgraph op {self.name}: {inputs}>"


def _signatures(op: _ops.Op) -> list[tuple[str, inspect.Signature, int]]:
    """``(what, signature, extra positionals)`` for forward and each VJP whose signature Python
    can tell (not numpy ufuncs); extra positionals are ``g, ans`` (and ``i`` for a variadic VJP)."""
    funcs: list[tuple[str, Any, int]] = [("forward", op.forward, 0)]
    if op.variadic:
        funcs.append(("the VJP", op.vjps, 3))
    else:
        vjps: tuple[Any, ...] = op.vjps  # type: ignore[assignment]
        funcs += [(f"VJP {i}", f, 2) for i, f in enumerate(vjps) if f is not None]
    out = []
    for what, f, extra in funcs:
        with contextlib.suppress(TypeError, ValueError):  # numpy ufuncs and some builtins do not say
            out.append((what, inspect.signature(f), extra))
    return out


def _check_call(
    op: _ops.Op,
    sigs: list[tuple[str, inspect.Signature, int]],
    inputs: tuple[Any, ...],
    attrs: dict[str, Any],
) -> None:
    """Refuse, when the node is declared, a call that forward or a VJP could not accept later."""
    n = len(inputs)
    for what, sig, extra in sigs:
        try:
            sig.bind(*range(n + extra), **attrs)
        except TypeError as e:
            given = f" and attrs {attrs}" if attrs else " and no attrs"
            raise ArgumentError(
                f"{op.name}: {what}{sig} cannot be called with {n} input(s){given}: {e}"
            ) from None


def defop(
    name: str,
    forward: Callable[..., Any],
    *vjps: Callable[..., Any] | None,
    variadic: bool = False,
    replace: bool = False,
    elementwise: bool = False,
    node_vjps: Sequence[Callable[..., Any] | None] | None = None,
) -> OpFunction:
    """Add a primitive with its own VJPs, and get the function that applies it to nodes.

    The op joins the same table as the built-in ones, with the same convention (see
    :mod:`vgraph.ops`)::

        forward(*xs, **attrs) -> ans                     # numpy arrays in, numpy array out
        vjp(g, ans, *xs, **attrs) -> gradient for x_i    # one per input, or None: no gradient

    A VJP returns the gradient in the input's shape or, for an input the op broadcast, in the
    output's shape (the engine sums it back to the input's shape); backward refuses any other
    shape, and gradients that are not real numbers, naming the node. A forward must return real
    numbers (float arrays; integer or bool ones for indices and masks). A variadic op
    (``variadic=True``) takes one ``vjp(i, g, ans, *xs, **attrs)`` that gets the input's position
    first. Check the VJPs with :func:`vgraph.check_vjps` (in float64).

    Example::

        square = vgraph.defop("Square", lambda x: x * x, lambda g, ans, x: 2 * x * g)
        y = square(x)                       # x a compute node or a virtual node
        y = cg.apply("Square", [x])         # the same, on a ComputeGraph

    Args:
        name: the op's name, also the node type in keys (``Square:1@3``): an identifier, not a
            built-in op or a reserved node type (``Input``, ``Loop``, …).
        forward: computes the op's value from its inputs' values.
        vjps: one VJP (or ``None``) per input; exactly one VJP for a variadic op.
        variadic: the op takes any number of inputs (like ``concat``).
        replace: redefine an op that an earlier ``defop`` added (e.g. when re-running a notebook
            cell). Nodes declared or built before keep the old definition.
        elementwise: promise that the op acts on each element alone, its inputs broadcasting
            like numpy: each output element is computed from the inputs' elements at the same
            (broadcast) position only, by forward and VJPs alike (``softsign``, ``gelu``; not a
            sum, a softmax or a product of matrices). Then running it once on inputs stacked
            along a new leading axis, or on rows concatenated along axis 0, gives every copy's
            value, so its nodes are hoisted out of loops and batched across inputs like the
            built-in elementwise ops (``tanh``, ``+``), and a declared node has a shape (the
            broadcast of its inputs'). vgraph does not check the promise on the normal path; an op
            that breaks it computes wrong values on those paths, and under
            :func:`vgraph.detect_anomaly` the build compares one row with the op run alone and
            raises (see docs/custom_ops.md).
        node_vjps: the VJPs again, written with vgraph operations on nodes so that they can be
            differentiated (second order, ``create_graph=True``; see docs/second_order.md): one
            ``vjp(g, ans, *xs, **attrs)`` (or ``None`` where ``vjps`` has ``None``) per VJP, that
            gets ``g``, ``ans`` and the inputs as compute nodes and returns the gradient as a node.
            Without them the op is first-order only: differentiating its gradient raises
            :class:`~vgraph.errors.SecondOrderError`.

    Returns:
        An :class:`OpFunction`: call it on nodes, ``f(*inputs, **attrs)``.

    Raises:
        OpDefinitionError: (a ``ValueError`` and a ``TypeError``; nothing is registered) ``name``
            is not a str, is a built-in op, was defined already (without ``replace``), is not an
            identifier or is reserved; ``forward`` or a VJP is not callable; no VJP given, or not
            exactly one for a variadic op; ``forward`` or a VJP cannot take the inputs the VJPs
            imply (a VJP takes ``g, ans`` and every input; a variadic op's forward takes ``*xs``
            and its VJP ``i, g, ans, *xs``), or needs a parameter no call can give (one forward
            or another VJP cannot take as an attribute); ``elementwise`` is not a bool;
            ``node_vjps`` is not one callable per VJP (``None`` exactly where the VJP is).

    The op's nodes then raise, naming the node: :class:`~vgraph.errors.DTypeError` when the
    forward returns complex or object values; in backward, :class:`~vgraph.errors.VJPShapeError`
    (a ``BackwardError`` and a ``ShapeError``) for a gradient of another shape, and
    :class:`~vgraph.errors.BackwardError` for ``None`` or a gradient that is not real numbers.
    """
    if not isinstance(replace, bool):
        raise OpDefinitionError(f"defop: replace must be a bool, got {type(replace).__name__}")
    if isinstance(name, str) and name in _ops.OPS:
        if name not in _USER_OPS:
            raise OpDefinitionError(f"{name!r} is a built-in op of vgraph; give your op another name")
        if not replace:
            raise OpDefinitionError(
                f"op {name!r} is already defined by an earlier vgraph.defop; pass replace=True to "
                "redefine it (e.g. when re-running a notebook cell), or choose another name"
            )
    if not isinstance(elementwise, bool):
        raise OpDefinitionError(f"defop: elementwise must be a bool, got {type(elementwise).__name__}")
    kind = _ops.ELEMENTWISE if elementwise else None
    op = _ops.defop(
        name, forward, *vjps, variadic=variadic, replace=replace, user=True, kind=kind,
        node_vjps=node_vjps,
    )  # fmt: skip
    _USER_OPS.add(op.name)
    return OpFunction(op.name)


def undefop(name: str) -> None:
    """Remove an op added with :func:`defop` (in tests, or before defining it differently).

    Nodes already declared or built keep working; new declarations of ``name`` are refused, and
    the function ``defop`` returned raises.

    Raises:
        OpDefinitionError: (a ``ValueError`` and a ``TypeError``) ``name`` is not a str, is a
            built-in op, or no op of that name was added with ``defop``.
    """
    if not isinstance(name, str):
        raise OpDefinitionError(f"undefop: name must be a str, got {type(name).__name__}")
    if name not in _USER_OPS:
        if name in _ops.OPS:
            raise OpDefinitionError(f"{name!r} is a built-in op of vgraph and cannot be removed")
        raise OpDefinitionError(f"no op named {name!r} was added with vgraph.defop")
    del _ops.OPS[name]
    _USER_OPS.discard(name)
