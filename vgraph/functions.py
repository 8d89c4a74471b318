"""Python operators and functions over graph nodes, shared by compute and virtual nodes.

``a + b``, ``a @ b``, ``x[1:3]``, ``vgraph.tanh(x)`` … all reduce to one call,
``node._apply(op_name, inputs, attrs)``, which each node kind implements: a
:class:`~vgraph.compute.ComputeNode` computes the op at once in its ComputeGraph, a
:class:`~vgraph.virtual.VirtualNode` declares it in its VirtualGraph. Operands that are not nodes
(Python numbers, numpy arrays) become constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import VGraphError
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

    def reshape(self, *shape: int | tuple[int, ...]) -> Any:
        """The same values in a new shape (``-1`` infers one dimension)."""
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        return self._apply("Reshape", (self,), {"shape": tuple(shape)})

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
