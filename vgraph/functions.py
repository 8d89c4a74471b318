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
from collections.abc import Callable, Sequence
from typing import Any

from . import ops as _ops
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
            raise TypeError(
                f"{op.name} takes {op.arity} input{'s' if op.arity != 1 else ''} (one per VJP given to "
                f"defop), got {len(inputs)}"
            )
        if not inputs:
            raise TypeError(f"{op.name} needs at least one input")
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
            raise TypeError(
                f"{op.name}: {what}{sig} cannot be called with {n} input(s){given}: {e}"
            ) from None


def defop(
    name: str,
    forward: Callable[..., Any],
    *vjps: Callable[..., Any] | None,
    variadic: bool = False,
    replace: bool = False,
) -> OpFunction:
    """Add a primitive with its own VJPs, and get the function that applies it to nodes.

    The op joins the same table as the built-in ones, with the same convention (see
    :mod:`vgraph.ops`)::

        forward(*xs, **attrs) -> ans                     # numpy arrays in, numpy array out
        vjp(g, ans, *xs, **attrs) -> gradient for x_i    # one per input, or None: no gradient

    A VJP may return the gradient in the broadcast shape: the engine sums it back to the input's
    shape. A variadic op (``variadic=True``) takes one ``vjp(i, g, ans, *xs, **attrs)`` that gets
    the input's position first. Check the VJPs with :func:`vgraph.check_vjps` (in float64).

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

    Returns:
        An :class:`OpFunction`: call it on nodes, ``f(*inputs, **attrs)``.

    Raises:
        ValueError: ``name`` is a built-in op, was defined already (without ``replace``), is not
            an identifier or is reserved; no VJP given, or not exactly one for a variadic op.
        TypeError: ``name`` is not a str; ``forward`` or a VJP is not callable, or cannot take
            the inputs the VJPs imply (a VJP must take ``g, ans`` and every input).
    """
    if not isinstance(replace, bool):
        raise TypeError(f"defop: replace must be a bool, got {type(replace).__name__}")
    if isinstance(name, str) and name in _ops.OPS:
        if name not in _USER_OPS:
            raise ValueError(f"{name!r} is a built-in op of vgraph; give your op another name")
        if not replace:
            raise ValueError(
                f"op {name!r} is already defined by an earlier vgraph.defop; pass replace=True to "
                "redefine it (e.g. when re-running a notebook cell), or choose another name"
            )
    op = _ops.defop(name, forward, *vjps, variadic=variadic, replace=replace)
    _USER_OPS.add(op.name)
    return OpFunction(op.name)


def undefop(name: str) -> None:
    """Remove an op added with :func:`defop` (in tests, or before defining it differently).

    Nodes already declared or built keep working; new declarations of ``name`` are refused, and
    the function ``defop`` returned raises.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is a built-in op, or no op of that name was added with ``defop``.
    """
    if not isinstance(name, str):
        raise TypeError(f"undefop: name must be a str, got {type(name).__name__}")
    if name not in _USER_OPS:
        if name in _ops.OPS:
            raise ValueError(f"{name!r} is a built-in op of vgraph and cannot be removed")
        raise ValueError(f"no op named {name!r} was added with vgraph.defop")
    del _ops.OPS[name]
    _USER_OPS.discard(name)
