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

Adding a built-in op is adding one ``defop`` entry below, with its ``kind`` where one applies
(:data:`KINDS`: elementwise, along an axis, a reduction, a fused cell): the declared-shape rules,
hoisting and autobatching read it there, so the op takes part in them without a list elsewhere.
Users add their own primitives with :func:`vgraph.defop` (the same arguments, validated the same
way by :func:`defop` here; ``elementwise=True`` declares that kind), which also returns the
function to call on nodes; see docs/custom_ops.md. A user's op runs wrapped in
checks of what it returns (:class:`CheckedForward`, :class:`CheckedVJP`): its VJP must return the
input's shape, or the output's for an input the op broadcast. Built-in ops run unwrapped.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np

from . import workspace
from .errors import BackwardError, DTypeError, OpDefinitionError, VGraphError, VJPShapeError
from .modes import is_grad_enabled

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
    #: Defined by :func:`vgraph.defop`: forward and VJPs run wrapped in checks of their results.
    user: bool = False
    #: How the op treats its inputs' elements and axes (one of :data:`KINDS`, or ``None``: none
    #: of them). Declared with the op, read by the declared-shape rules (``VirtualNode.shape``)
    #: and by the optimisations that run many copies of a node as one call (hoisting,
    #: autobatching, rows of different lengths concatenated).
    kind: str | None = None
    #: Differentiable VJPs (``defop(..., node_vjps=...)``): the VJPs written with vgraph
    #: operations on nodes, which gradients recorded as nodes (``create_graph=True``, see
    #: :mod:`vgraph.higher`) use; ``None``: the op is first-order only. One per input (or
    #: ``None``), or one ``vjp(i, g, ans, *xs, **attrs)`` for a variadic op.
    node_vjps: tuple[VJP | None, ...] | VJP | None = None
    #: Its VJPs may return ``None`` for an input no gradient reached (a loop run as a body program
    #: whose run read a value only where no gradient flowed): the sweep then adds nothing to that
    #: input, as a per-node sweep that never reaches it.
    partial_grads: bool = False


#: The kinds an op may declare (``Op.kind``), each a promise about its forward and VJPs:
#:
#: - ``"elementwise"``: each output element depends on the inputs' elements at the same position
#:   only, the inputs broadcasting like numpy (``Add``, ``Tanh``, a ``Pow`` with its exponent an
#:   attribute). Its output has the broadcast shape; run on inputs with a new leading axis (or
#:   rows concatenated along axis 0) it gives each copy's value along that axis, attributes
#:   unchanged.
#: - ``"along_axis"``: the output has the input's shape, and each slice along the axis that the
#:   ``axis`` attribute names (default -1) is computed from the same slice of the input alone
#:   (``Softmax``); a new leading axis moves that axis by one.
#: - ``"reduction"``: reduces the axes the ``axis`` attribute names (``None``: all; an int or a
#:   tuple, but one axis for ``ArgMax`` and ``ArgMin``) — ``keepdims`` keeps them with size 1 —
#:   each result from its own slice alone (``Sum``); a new leading axis moves them by one.
#: - ``"cell"``: a fused recurrent cell: its gates act elementwise on their projections, and its
#:   output stacks its states first, so copies run with a new leading axis of the inputs have
#:   their rows along axis 1 of the output (``LSTMCell``).
KINDS = ("elementwise", "along_axis", "reduction", "cell")
ELEMENTWISE, ALONG_AXIS, REDUCTION, CELL = KINDS


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


def _still_required(sig: inspect.Signature, given: int) -> tuple[list[str], list[str]]:
    """The parameters without a default that a call with ``given`` positional arguments leaves
    unfilled: ``(positional-only ones, which nothing can fill; the others, which only attributes
    passed by keyword can)``."""
    stuck: list[str] = []
    attrs: list[str] = []
    positional = 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
            if positional > given and p.default is p.empty:
                (stuck if p.kind is p.POSITIONAL_ONLY else attrs).append(p.name)
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            attrs.append(p.name)
    return stuck, attrs


def _takes_keyword(sig: inspect.Signature, name: str, given: int) -> bool:
    """Whether a call with ``given`` positional arguments can also pass ``name`` by keyword."""
    positional = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
            if p.name == name and p.kind is p.POSITIONAL_OR_KEYWORD:
                return positional > given  # else filled positionally already
        elif p.kind is p.KEYWORD_ONLY and p.name == name:
            return True
    return False


def _check_attributes(name: str, funcs: list[tuple[str, inspect.Signature, int, str]], inputs: str) -> None:
    """Refuse functions that no call could satisfy together: ``funcs`` are ``(what, signature,
    positional arguments it gets, how they are spelled)`` for forward and each VJP. A parameter
    left without a value by the positional arguments must be an attribute, which is passed by
    keyword to forward and to every VJP, so all of them must take it."""
    for k, (what, sig, given, spelled) in enumerate(funcs):
        stuck, attrs = _still_required(sig, given)
        if stuck:
            raise OpDefinitionError(
                f"{name}: {what}{sig} needs {', '.join(map(repr, stuck))} besides {spelled}, and "
                f"nothing passes it: {inputs}"
            )
        for attr in attrs:
            for j, (other, other_sig, other_given, _) in enumerate(funcs):
                if j != k and not _takes_keyword(other_sig, attr, other_given):
                    raise OpDefinitionError(
                        f"{name}: {what}{sig} needs {attr!r} besides {spelled}, so {attr!r} would "
                        f"be an attribute given at every call, but {other}{other_sig} cannot take "
                        f"it (forward and every VJP get every attribute): {inputs}"
                    )


def _validated_op(name: Any, forward: Any, vjps: tuple[Any, ...], variadic: bool, kind: Any = None) -> Op:
    """Build an :class:`Op` after checking every argument; raises before anything is registered.

    Raises:
        OpDefinitionError: see :func:`defop`.
    """
    if not isinstance(name, str):
        raise OpDefinitionError(f"an op name must be a str, got {type(name).__name__}")
    if not _OP_NAME.fullmatch(name):
        raise OpDefinitionError(
            f"op name {name!r} is not an identifier (letters, digits, '_'): it is the node type in "
            "keys such as 'MatMul:1@2.5', so it cannot contain ':', '@', '.' or spaces"
        )
    if name in RESERVED_TYPES:
        raise OpDefinitionError(
            f"op name {name!r} is reserved for vgraph's own {name} nodes; choose another name"
        )
    if not isinstance(variadic, bool):
        raise OpDefinitionError(f"{name}: variadic must be a bool, got {type(variadic).__name__}")
    if kind is not None and kind not in KINDS:
        raise OpDefinitionError(
            f"{name}: kind must be None or one of {', '.join(map(repr, KINDS))}, got {kind!r}"
        )
    if not callable(forward):
        raise OpDefinitionError(f"{name}: forward must be callable, got {type(forward).__name__}")
    for i, vjp in enumerate(vjps):
        if vjp is not None and not callable(vjp):
            raise OpDefinitionError(
                f"{name}: VJP {i} must be callable or None (no gradient), got {type(vjp).__name__}"
            )
    forward_sig = _signature(forward)
    if variadic:
        if len(vjps) != 1 or vjps[0] is None:
            got = "None" if len(vjps) == 1 else f"{len(vjps)} arguments after forward"
            raise OpDefinitionError(
                f"{name}: a variadic op takes exactly one VJP function, vjp(i, g, ans, *xs, **attrs), "
                f"got {got}"
            )
        if isinstance(forward, np.ufunc):
            raise OpDefinitionError(
                f"{name}: a variadic op's forward must take *xs, got numpy's {forward.__name__}, "
                f"which takes {forward.nin} inputs"
            )
        if forward_sig is not None and not _var_positional(forward_sig):
            raise OpDefinitionError(
                f"{name}: a variadic op's forward must take *xs, got forward{forward_sig}"
            )
        vjp_sig = _signature(vjps[0])
        if vjp_sig is not None and not (_var_positional(vjp_sig) and _takes_positionals(vjps[0], 3)):
            raise OpDefinitionError(
                f"{name}: a variadic op's VJP must take (i, g, ans, *xs) — the input's position, the "
                f"incoming gradient, the op's output and every input — got vjp{vjp_sig}"
            )
        if forward_sig is not None and vjp_sig is not None:  # every positional is filled by inputs
            _check_attributes(
                name,
                [
                    ("forward", forward_sig, len(forward_sig.parameters), "*xs"),
                    ("the VJP", vjp_sig, len(vjp_sig.parameters), "(i, g, ans, *xs)"),
                ],
                "a variadic op's inputs fill *xs",
            )
        if kind not in (None, ELEMENTWISE):
            raise OpDefinitionError(f"{name}: a variadic op can only be elementwise, not {kind!r}")
        return Op(name, forward, vjps[0], variadic=True, arity=None, kind=kind)
    arity = len(vjps)
    if arity == 0:
        raise OpDefinitionError(
            f"{name}: give one VJP (or None) per input after forward; with none, the op has no inputs"
        )
    s = "s" if arity != 1 else ""
    inputs = f"the op has {arity} input{s}, one per VJP given to defop"
    said = f"{name}: {arity} VJP{s} say{'' if s else 's'} the op has {arity} input{s}, but forward"
    if isinstance(forward, np.ufunc) and forward.nin != arity:
        raise OpDefinitionError(
            f"{said} is numpy's {forward.__name__}, which takes {forward.nin}: give one VJP (or "
            "None) per input"
        )
    if not _takes_positionals(forward, arity):
        raise OpDefinitionError(f"{said}{forward_sig} cannot take {arity} positional argument{s}")
    args = ", ".join(f"x{k}" for k in range(arity))
    funcs = [] if forward_sig is None else [("forward", forward_sig, arity, f"({args})")]
    for i, vjp in enumerate(vjps):
        if vjp is None:
            continue
        if not _takes_positionals(vjp, 2 + arity):
            raise OpDefinitionError(
                f"{name}: VJP {i} must take (g, ans, {args}) — the incoming gradient, the op's "
                f"output and every input — but its signature is {_signature(vjp)}"
            )
        vjp_sig = _signature(vjp)
        if vjp_sig is not None:
            funcs.append((f"VJP {i}", vjp_sig, 2 + arity, f"(g, ans, {args})"))
    _check_attributes(name, funcs, inputs)
    return Op(name, forward, tuple(vjps), variadic=False, arity=arity, kind=kind)


def _var_positional(sig: inspect.Signature) -> bool:
    return any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())


def defop(
    name: str,
    forward: Callable[..., Any],
    *vjps: VJP | None,
    variadic: bool = False,
    replace: bool = False,
    user: bool = False,
    kind: str | None = None,
    node_vjps: Sequence[VJP | None] | None = None,
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
        user: an op of :func:`vgraph.defop`: its forward and VJPs are wrapped in the checks of
            what they return (:class:`CheckedForward`, :class:`CheckedVJP`). Built-in ops are
            trusted (and tested): they run unwrapped, at no cost.
        kind: what the op promises about its elements and axes (:data:`KINDS`), or ``None``.
        node_vjps: differentiable VJPs, for gradients recorded as nodes (``create_graph=True``):
            one ``vjp(g, ans, *xs, **attrs)`` (or ``None``) per input, as ``vjps``, that gets
            ``g``, ``ans`` and the inputs as graph nodes and returns the gradient as a node built
            with vgraph operations (one function for a variadic op). ``None``: first-order only.

    Returns:
        The registered :class:`Op`.

    Raises:
        OpDefinitionError: (a ``ValueError`` and a ``TypeError``) ``name`` is not a str, is taken
            (and not ``replace``), not an identifier or reserved; ``forward`` or a VJP is not
            callable; no VJP given, or not exactly one for a variadic op; ``forward`` or a VJP
            cannot take the inputs the VJPs imply (a VJP takes ``g, ans`` and every input; a
            variadic op's forward ``*xs`` and its VJP ``i, g, ans, *xs``), or needs a parameter
            that no call can give; ``kind`` is not one of :data:`KINDS` (or ``None``);
            ``node_vjps`` is not a tuple of one callable (or ``None``) per VJP.
    """
    op = _validated_op(name, forward, vjps, variadic, kind)
    if node_vjps is not None:
        node_vjps = _validated_node_vjps(name, vjps, node_vjps)
        op = Op(op.name, op.forward, op.vjps, op.variadic, op.arity, op.user, op.kind, node_vjps)
    if name in OPS and not replace:
        raise OpDefinitionError(f"op {name!r} is already defined")
    if user:  # wrapped in the checks of their results (built-in ops run unwrapped)
        if variadic:
            checked: Any = CheckedVJP(name, cast(VJP, vjps[0]), None)
        else:
            checked = tuple(None if f is None else CheckedVJP(name, f, i) for i, f in enumerate(vjps))
        op = Op(
            name, CheckedForward(name, forward), checked, variadic, op.arity, user=True, kind=kind,
            node_vjps=op.node_vjps,
        )  # fmt: skip
    OPS[name] = op
    return op


def _validated_node_vjps(name: str, vjps: tuple[Any, ...], node_vjps: Any) -> tuple[VJP | None, ...]:
    """``node_vjps`` of :func:`defop` checked against ``vjps``: a tuple (or list) with one callable
    or ``None`` per VJP, ``None`` exactly where the VJP is ``None`` (no gradient either way)."""
    if not isinstance(node_vjps, (tuple, list)):
        raise OpDefinitionError(
            f"{name}: node_vjps must be a tuple with one differentiable VJP (or None) per VJP, got "
            f"{type(node_vjps).__name__}"
        )
    if len(node_vjps) != len(vjps):
        raise OpDefinitionError(f"{name}: {len(node_vjps)} node_vjps for {len(vjps)} VJPs; give one per VJP")
    for i, (f, vjp) in enumerate(zip(node_vjps, vjps)):
        if f is not None and not callable(f):
            raise OpDefinitionError(
                f"{name}: node_vjps[{i}] must be callable or None, got {type(f).__name__}"
            )
        if (f is None) != (vjp is None):
            raise OpDefinitionError(
                f"{name}: node_vjps[{i}] is {'None' if f is None else 'a function'} but VJP {i} is "
                f"{'None' if vjp is None else 'a function'}: both say whether a gradient flows"
            )
    return tuple(node_vjps)


# ---------------------------------------------------------------------------- checks of defop's ops
# Built-in ops are trusted: their results go straight to the engine. A user's op runs wrapped in
# checks of what it returns — at the cost of one Python call per use of the op, nothing per use of
# a built-in one. The wrappers do not know the node they run for; they raise OpResultError, which
# the engine re-raises as the typed error naming the node (ComputeGraph._raise_op_error for a
# forward, the backward sweep for a VJP; a compiled sweep that raises falls back to that one).


class OpResultError(Exception):
    """What a :func:`vgraph.defop` op's forward or VJP returned, refused by its checks. The engine
    raises :attr:`error` instead, with a message that names the node (and, for a VJP, the input).

    Attributes:
        error: the :class:`~vgraph.errors.VGraphError` to raise (``DTypeError`` for a forward;
            ``VJPShapeError`` or ``BackwardError`` for a VJP).
        position: the input a VJP was for (``None`` for a forward).
    """

    def __init__(self, error: type[VGraphError], message: str, position: int | None = None) -> None:
        super().__init__(message)
        self.error = error
        self.position = position


#: The dtype kinds of node values (as for leaves: floats, and integer and bool indices and masks)
#: and of gradients (real numbers).
VALUE_KINDS = "fiub"
GRADIENT_KINDS = "fiu"


class CheckedForward:
    """A :func:`vgraph.defop` op's forward, refusing a result that is not real numbers (complex,
    object or string values): vgraph's values and gradients are real."""

    __slots__ = ("__wrapped__", "name")

    def __init__(self, name: str, forward: Callable[..., Any]) -> None:
        self.__wrapped__ = forward  # (inspect.signature reads the forward's own signature)
        self.name = name

    def __call__(self, *xs: Any, **attrs: Any) -> Any:
        ans = self.__wrapped__(*xs, **attrs)
        if type(ans) is np.ndarray and ans.dtype.kind in VALUE_KINDS:  # the common case, first
            return ans
        dtype = ans.dtype if isinstance(ans, (np.ndarray, np.generic)) else np.asarray(ans).dtype
        if dtype.kind not in VALUE_KINDS:
            raise OpResultError(
                DTypeError,
                f"the forward of {self.name} returned {dtype} values; vgraph's values and gradients "
                "are real numbers: return a float array (or an integer or bool one for indices "
                "and masks)",
            )
        return ans

    def __repr__(self) -> str:
        return f"<checked forward of {self.name}: {self.__wrapped__!r}>"


class CheckedVJP:
    """A :func:`vgraph.defop` op's VJP for input ``position`` (``None``: a variadic op's, which
    gets the position first), refusing a result that is not a gradient of that input.

    A gradient is a numpy array of real numbers whose shape is the input's — or, for an input
    that the op broadcast, the output's (``ans``'s): :func:`unbroadcast` sums that back to the
    input's shape, as for a built-in op. Any other shape is refused, even one that numpy could
    broadcast to the input's (a ``(1,)`` for a ``(3,)``): it would spread one number over the
    whole gradient.
    """

    __slots__ = ("__wrapped__", "name", "position")

    def __init__(self, name: str, vjp: VJP, position: int | None) -> None:
        self.__wrapped__ = vjp
        self.name = name
        self.position = position

    def __call__(self, *args: Any, **attrs: Any) -> Any:
        grad = self.__wrapped__(*args, **attrs)
        i = self.position
        if i is None:  # (i, g, ans, *xs)
            i = args[0]
            ans, x = args[2], args[3 + i]
        else:  # (g, ans, *xs)
            ans, x = args[1], args[2 + i]
        if (
            type(grad) is np.ndarray
            and type(x) is np.ndarray
            and grad.shape == x.shape
            and grad.dtype.kind in GRADIENT_KINDS
        ):
            return grad  # the common case, first
        problem = _gradient_problem(grad, np.shape(x), np.shape(ans))
        if problem is not None:
            raise OpResultError(problem[0], problem[1], i)
        return grad

    def __repr__(self) -> str:
        which = "" if self.position is None else f" (input {self.position})"
        return f"<checked VJP of {self.name}{which}: {self.__wrapped__!r}>"


def _gradient_problem(
    grad: Any, shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> tuple[type[VGraphError], str] | None:
    """Why ``grad``, returned by a VJP for an input of ``shape`` of an op whose output has
    ``out_shape``, is not a gradient of that input (see :class:`CheckedVJP`): ``(the error to
    raise, what is wrong)``, or ``None`` if it is one."""
    if grad is None:
        return BackwardError, "returned None; to say 'no gradient', pass None in place of the VJP to defop"
    if not isinstance(grad, (np.ndarray, np.generic, LazyGrad)):
        return BackwardError, f"returned a {type(grad).__name__}, not a numpy array"
    if np.dtype(grad.dtype).kind not in GRADIENT_KINDS:
        return BackwardError, f"returned {grad.dtype} values; a gradient in vgraph is real numbers"
    got = grad.shape
    if got == shape:
        return None
    if got == out_shape and _broadcasts_to(shape, out_shape):
        return None  # the engine sums it back to shape
    expected = f"the input's shape {shape}"
    if shape != out_shape and _broadcasts_to(shape, out_shape):
        expected += f" or, as the op broadcast the input, the output's shape {out_shape}"
    return VJPShapeError, f"returned a gradient of shape {got}; expected {expected}"


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether numpy broadcasting stretches ``shape`` to ``target`` (so :func:`unbroadcast` sums
    a gradient of ``target``'s shape back to ``shape``)."""
    extra = len(target) - len(shape)
    return extra >= 0 and all(n == 1 or n == m for n, m in zip(shape, target[extra:]))


# ---------------------------------------------------------------------------- one backward sweep
# What the work of one backward sweep shares, because no value changes during a sweep: the
# contiguous transposes of weights (_transposed) and the stacks of gradient rows that several
# collectors of the same rows need (_rows_stack).


class _Sweep(threading.local):
    """Per thread: what the backward sweep running in it shares (``None``: no sweep runs).

    ``transposes``: by ``id`` of a matrix, ``[matrix, its C-contiguous transpose or None]``.
    ``stacks``: by ``(count, id of the first part, id of the last)``, ``[parts, np.stack(parts),
    given]`` (``given``: the stack was handed out as a collector's result, which its caller owns).
    ``rows``: by ``(group, declared sum)``, ``(buffer, rows written)``: the buffer gradient rows
    are written into (:func:`_tanh_vjp_row`) and each row written, by index; ``row_starts``: the
    same entries by ``id`` of their row 0. Each entry holds the arrays its key's ids are of, so
    the ids name them for the whole sweep.
    """

    transposes: dict[int, list[Any]] | None = None
    stacks: dict[tuple[int, int, int], list[Any]] | None = None
    rows: dict[Any, tuple[np.ndarray, list[Any]]] | None = None
    row_starts: dict[int, tuple[np.ndarray, list[Any]]] | None = None


_sweep = _Sweep()


class sweep_scope:
    """``with sweep_scope():`` around one backward sweep: inside it, :func:`_transposed` keeps the
    contiguous transposes it makes and :func:`_rows_stack` the stacks of gradient rows it makes,
    for the sweep's other uses; both are dropped when the scope exits (values may change between
    sweeps). A nested sweep (a VJP that runs one) shares the outer sweep's transposes — the same
    values — but not its stacks, which hold gradients of the outer sweep only."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = (_sweep.transposes, _sweep.stacks, _sweep.rows, _sweep.row_starts)
        if _sweep.transposes is None:
            _sweep.transposes = {}
        _sweep.stacks, _sweep.rows, _sweep.row_starts = {}, {}, {}

    def __exit__(self, *exc: object) -> None:
        _sweep.transposes, _sweep.stacks, _sweep.rows, _sweep.row_starts = self._outer


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
        out = workspace.zeros(self.shape, self.dtype)
        self.add_into(out)
        return out

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        """The sum of two contributions; the default is a new dense array."""
        out = self.dense()
        other.add_into(out)
        return out

    def compact(self) -> None:
        """Keep what was collected so far in bounded memory, the same sum (a checkpointed loop
        calls this after each unit of iterations); by default there is nothing to do."""


class IndexedGrad(LazyGrad):
    """``g`` placed at ``index`` of a zero array of ``shape`` (the VJP of an indexing op)."""

    __slots__ = ("basic", "g", "index")

    def __init__(self, shape: tuple[int, ...], dtype: Any, index: Any, g: np.ndarray, basic: bool) -> None:
        super().__init__(shape, dtype)
        self.index = index
        self.g = g
        self.basic = basic  # the index selects each element at most once (a basic index, or
        # an integer array without repeats): one indexed addition adds it in

    def add_into(self, acc: np.ndarray) -> None:
        if self.basic:
            acc[self.index] += self.g
        else:
            add_at(acc, self.index, self.g)  # integer arrays may repeat rows: accumulate

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if _whole_row(self):  # the first of an iteration's rows: collect the rows (StepRowsGrad)
            return StepRowsGrad(self.shape, self.dtype, [self.index], [self.g]).merge(other)
        return super().merge(other)


def _whole_row(g: IndexedGrad) -> bool:
    """Whether ``g`` is one whole row of its input (``g`` at an integer index of axis 0)."""
    return type(g.index) is int and type(g.g) is np.ndarray and g.g.shape == g.shape[1:]


class StepRowsGrad(LazyGrad):
    """Whole rows of an input, one gradient per row, as they come: the iterations of a hoisted
    group or of a stepped sequence, last iteration first. They are laid into one array when the
    input's turn comes — a copy of each row, where adding each into a zero-filled buffer would
    fill it first and read every row back. A row not given is zero; a row given twice is summed
    (in the order given, as the buffer would). Compiled sweeps append to :attr:`rows` and
    :attr:`gs` directly (vgraph.tape)."""

    __slots__ = ("gs", "rows")

    def __init__(self, shape: tuple[int, ...], dtype: Any, rows: list[int], gs: list[np.ndarray]) -> None:
        super().__init__(shape, dtype)
        self.rows = rows
        self.gs = gs

    def dense(self) -> np.ndarray:
        rows, n = self.rows, self.shape[0]
        if len(rows) == n and rows == list(range(n - 1, -1, -1)):  # every row once, last first
            return _rows_stack(self.gs[::-1], self.dtype, own=True)
        return super().dense()  # zeros, and every row added in

    def add_into(self, acc: np.ndarray) -> None:
        for r, g in zip(self.rows, self.gs):
            acc[r] += g

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if type(other) is IndexedGrad and _whole_row(other) and other.dtype == self.dtype:
            self.rows.append(other.index)
            self.gs.append(other.g)
            return self
        return super().merge(other)


class RowSparseGrad(LazyGrad):
    """The gradient of a table (e.g. an embedding matrix) that is non-zero only in some rows.

    Row ``indices[k]`` of the full gradient is ``values[k]``; every other row is zero. This is
    what ``.grad`` of a parameter declared with ``sparse_grad=True`` (``nn.Embedding(...,
    sparse=True)``) holds after backward: only the rows looked up, instead of a dense array the
    size of the table. Optimisers, clipping and :func:`numpy.asarray` accept it (see
    docs/training.md, "Sparse embedding gradients").

    The rows are always *coalesced*: ``indices`` is sorted and holds each row once (the
    contributions of a row looked up several times are summed, in the order backward produced
    them, with the same floating-point additions as the dense gradient's ``np.add.at``, so
    :meth:`dense` equals the dense gradient bit for bit).

    ``np.asarray(grad)`` (``__array__``) gives the dense array, at the cost of allocating the
    whole table: convenient for inspection and tests, not for a training loop. ``a + b`` of two
    row-sparse gradients is row-sparse; adding a dense array gives a dense array.

    Args:
        indices: the row indices, a 1-D integer array (negative indices count from the end);
            repeated rows are summed.
        values: one row of values per index, shape ``(len(indices),) + shape[1:]``.
        shape: the shape of the full gradient (the parameter's shape), at least 1-D.

    Attributes:
        indices: the sorted, distinct row indices (int64).
        values: their rows, shape ``(len(indices),) + shape[1:]``.
        shape: the full shape. dtype: the values' dtype.

    Raises:
        TypeError: ``indices`` not integers, or ``values`` not floating point.
        ValueError: a shape that is not a tuple of non-negative ints with at least one axis,
            ``indices`` not 1-D, ``values`` of the wrong shape, or an index out of range.
    """

    __slots__ = ("indices", "values")
    indices: np.ndarray
    values: np.ndarray

    def __init__(self, indices: Any, values: Any, shape: tuple[int, ...]) -> None:
        try:
            shape = tuple(int(n) for n in shape)
        except (TypeError, ValueError):
            raise ValueError(f"RowSparseGrad: shape must be a tuple of ints, got {shape!r}") from None
        if not shape or min(shape) < 0:
            raise ValueError(
                f"RowSparseGrad: shape must have at least one axis and no negative size, got {shape}"
            )
        idx = np.asarray(indices)
        vals = np.asarray(values)
        if idx.dtype.kind not in "iu" and not (idx.size == 0 and idx.dtype.kind == "f"):
            raise TypeError(f"RowSparseGrad: indices must be integers, got dtype {idx.dtype}")
        if idx.ndim != 1:
            raise ValueError(f"RowSparseGrad: indices must be 1-D, got shape {idx.shape}")
        if vals.dtype.kind != "f":
            raise TypeError(f"RowSparseGrad: values must be floating point, got dtype {vals.dtype}")
        if vals.shape != (idx.size, *shape[1:]):
            raise ValueError(
                f"RowSparseGrad: values must have shape {(idx.size, *shape[1:])} (one row per index), "
                f"got {vals.shape}"
            )
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < -shape[0] or idx.max() >= shape[0]):
            raise ValueError(
                f"RowSparseGrad: row index out of range: must be in [-{shape[0]}, {shape[0]}), got {idx.min()}..{idx.max()}"
            )
        super().__init__(shape, vals.dtype)
        self.indices, self.values = _coalesce(shape[0], [idx], [vals], vals.dtype)

    @classmethod
    def _of(cls, shape: tuple[int, ...], indices: np.ndarray, values: np.ndarray) -> RowSparseGrad:
        """One from rows known to be coalesced and values the caller gives away (no checks)."""
        out = cls.__new__(cls)
        LazyGrad.__init__(out, shape, values.dtype)
        out.indices, out.values = indices, values
        return out

    def with_values(self, values: np.ndarray) -> RowSparseGrad:
        """The same rows with other values (e.g. scaled by gradient clipping).

        Raises:
            ValueError: ``values`` has another shape than :attr:`values`.
        """
        values = np.asarray(values)
        if values.shape != self.values.shape:
            raise ValueError(f"RowSparseGrad.with_values: shape {values.shape}, expected {self.values.shape}")
        return RowSparseGrad._of(self.shape, self.indices, values)

    def add_into(self, acc: np.ndarray) -> None:
        acc[self.indices] += self.values  # distinct rows: a buffered add is exact

    def dense(self) -> np.ndarray:
        out = np.zeros(self.shape, dtype=self.dtype)
        out[self.indices] = self.values
        return out

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if isinstance(other, RowSparseGrad) and other.shape == self.shape:
            dtype = np.result_type(self.dtype, other.dtype)
            rows, vals = _coalesce(
                self.shape[0], [self.indices, other.indices], [self.values, other.values], dtype
            )
            return RowSparseGrad._of(self.shape, rows, vals)
        return super().merge(other)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a RowSparseGrad cannot be viewed as a dense array without a copy")
        out = self.dense()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __add__(self, other: Any) -> Any:
        if isinstance(other, LazyGrad):
            return self.merge(other)
        return add_grads(self, other)  # a dense array: the sum is dense

    __radd__ = __add__

    def __repr__(self) -> str:
        return (
            f"RowSparseGrad(shape={self.shape}, rows={self.indices.size}, dtype={self.dtype}, "
            f"indices={np.array2string(self.indices, threshold=8)})"
        )


def add_at(acc: np.ndarray, index: Any, values: Any) -> None:
    """``np.add.at(acc, index, values)``: the same additions in the same order, hence the same bits,
    and faster where ``index`` is an integer array of rows of ``acc`` and the rows are wide.

    numpy's fast path for ``ufunc.at`` is one-dimensional: rows added through the general path
    cost about 14 ns an element against 2.5 through the fast one (an embedding's gradient of 600
    words of width 128: 0.95 ms against 0.21). So such rows are added as one flat index over
    ``acc``'s elements, each element still receiving its additions in the order of ``index``.
    Below about a thousand elements the general path's lower fixed cost wins; any other index
    (a tuple, basic indexing, a non-contiguous ``acc``) goes to ``np.add.at`` as is, as does an
    index out of range (which it reports).
    """
    if (
        type(index) is np.ndarray
        and index.dtype.kind in "iu"
        and acc.ndim > 1
        and acc.flags.c_contiguous
        and index.size * (width := acc.size // max(acc.shape[0], 1)) >= _FLAT_ADD_AT_MIN
    ):
        n = acc.shape[0]
        lo, hi = int(index.min()), int(index.max())
        if -n <= lo and hi < n:
            rows = index.reshape(-1, 1)
            if lo < 0:
                rows = np.where(rows < 0, rows + n, rows)
            try:
                vals = np.broadcast_to(values, (*index.shape, *acc.shape[1:]))
            except ValueError:
                pass  # (np.add.at says what does not fit)
            else:
                flat = (rows * width + np.arange(width)).reshape(-1)
                np.add.at(acc.reshape(-1), flat, vals.reshape(-1))
                return
    np.add.at(acc, index, values)


#: Elements (index size x row width) from which :func:`add_at` adds rows as one flat index.
_FLAT_ADD_AT_MIN = 1024


def _coalesce(
    n_rows: int, indices: list[np.ndarray], values: list[np.ndarray], dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct rows and their summed values from (possibly repeated) ``indices``.

    Repeated rows are summed with ``np.add.at`` (:func:`add_at`) into zeros, in the order given:
    the same additions in the same order as the dense gradient's (``IndexedGrad.add_into``), hence
    the same bits.
    (Sorting and ``np.add.reduceat`` is faster but sums in another order.)
    """
    idx = indices[0] if len(indices) == 1 else np.concatenate(indices)
    vals = values[0] if len(values) == 1 else np.concatenate(values)
    idx = np.where(idx < 0, idx + n_rows, idx) if idx.size and idx.min() < 0 else idx
    rows, inverse = np.unique(idx, return_inverse=True)
    out = np.zeros((rows.size, *vals.shape[1:]), dtype=dtype)
    if rows.size == idx.size:  # no repeats: a buffered add (0 + v, as the dense gradient's)
        out[inverse] += vals
    else:
        add_at(out, inverse, vals)
    return rows, out


def _row_parts(g: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(row indices, row values)`` of a gradient contribution that is a gather of whole rows
    of an array of ``shape`` (a ``Take``, or a ``GetItem`` with an integer, an integer array or a
    slice), else ``None``."""
    if type(g) is not IndexedGrad:
        return None
    index = g.index
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return np.array([index], dtype=np.int64), np.reshape(g.g, (1, *shape[1:]))
    if isinstance(index, np.ndarray) and index.dtype.kind in "iu":
        vals = np.broadcast_to(g.g, (*index.shape, *shape[1:]))
        return index.reshape(-1), vals.reshape(-1, *shape[1:])
    if isinstance(index, slice):  # a range of whole rows
        rows = np.arange(*index.indices(shape[0]))
        return rows, np.reshape(g.g, (rows.size, *shape[1:]))
    return None


class _RowChunks(LazyGrad):
    """The row-gather contributions reaching a ``sparse_grad`` leaf during one backward sweep,
    kept as a list and coalesced once, when the leaf's turn comes."""

    __slots__ = ("indices", "values")

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        super().__init__(shape, dtype)
        self.indices: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def rows(self) -> RowSparseGrad:
        dtype = np.result_type(*self.values)
        return RowSparseGrad._of(self.shape, *_coalesce(self.shape[0], self.indices, self.values, dtype))

    def add_into(self, acc: np.ndarray) -> None:
        for idx, vals in zip(self.indices, self.values):
            add_at(acc, idx, vals)


def add_grads_sparse(acc: Any, g: Any) -> Any:
    """``acc + g`` for a leaf that keeps a row-sparse gradient (``sparse_grad=True``): row-gather
    contributions are collected (nothing the size of the table is allocated); any other
    contribution (the leaf used by a matmul, a slice …) makes the sum dense, as :func:`add_grads`."""
    if type(acc) is not _RowChunks:
        first = _row_parts(acc, acc.shape) if isinstance(acc, LazyGrad) else None
        if first is None:
            return add_grads(acc, g)
        chunks = _RowChunks(acc.shape, acc.dtype)
        chunks.indices.append(first[0])
        chunks.values.append(first[1])
        acc = chunks
    if type(g) is _RowChunks:  # collected elsewhere (a loop run as a body program): summed
        rows = g.rows()  # first, as a dense gradient adds that sum (the same bits)
        acc.indices.append(rows.indices)
        acc.values.append(rows.values)
        return acc
    parts = _row_parts(g, acc.shape)
    if parts is None:
        return add_grads(acc, g)
    acc.indices.append(parts[0])
    acc.values.append(parts[1])
    return acc


def as_row_sparse(g: LazyGrad) -> RowSparseGrad | np.ndarray:
    """All that reached a ``sparse_grad`` leaf in one sweep as a :class:`RowSparseGrad` — or, if
    some of it is not a gather of whole rows, as a dense array."""
    if type(g) is _RowChunks:
        return g.rows()
    if type(g) is RowSparseGrad:
        return g
    parts = _row_parts(g, g.shape)
    if parts is None:
        return g.dense()
    idx, vals = parts
    return RowSparseGrad._of(g.shape, *_coalesce(g.shape[0], [idx], [vals], vals.dtype))


class RowsProductGrad(LazyGrad):
    """``sum_k a_k.T @ g_k`` over 2-D ``a_k`` (rows, I) and ``g_k`` (rows, H): the gradient of a
    weight ``W`` in ``x @ W``, collected over every use of ``W`` (every iteration of a loop) and
    computed as one stacked product when all uses are in — one ``(I, T*rows) @ (T*rows, H)`` call
    instead of T small products and T additions."""

    __slots__ = ("a", "g", "total")

    def __init__(self, a: np.ndarray, g: np.ndarray) -> None:
        self.shape = (a.shape[1], g.shape[1])  # LazyGrad's fields, set here on the hot path
        self.dtype = a.dtype if a.dtype == g.dtype else np.result_type(a, g)
        self.a = [a]
        self.g = [g]
        self.total: np.ndarray | None = None  # the products of uses let go by compact(), summed

    #: Rows stacked for one product: longer stacks are summed in blocks of about this many rows,
    #: so the copies the stacking makes stay small (a few MiB) however long the loop was.
    BLOCK_ROWS = 8192

    def dense(self) -> np.ndarray:
        return self._sum(share=True)

    def _sum(self, share: bool) -> np.ndarray:
        """The gradient: the products of the uses collected, plus the total of those compacted.
        ``share``: the rows of ``g`` may be stacked for (and read from) the sweep's other
        collectors of the same rows (see :func:`_rows_stack`) — not for a part of them."""
        # The annotated locals here and below: numpy's stubs type arithmetic on arrays of unknown
        # dtype as Any.
        out: np.ndarray
        total = self.total
        if not self.a and total is not None:  # every use compacted
            out = total.copy()
            return out
        if len(self.a) == 1:
            out = self.a[0].T @ self.g[0]
        else:
            out = self._products(share)
        if total is not None:
            out += total
        return out

    def _products(self, share: bool) -> np.ndarray:
        """The sum of the products of two or more uses, stacked in blocks."""
        out: np.ndarray
        # Uses first to last (a loop's iterations in order): the order in which the other
        # collectors of the same gradient rows stack them (StepRowsGrad, LeadingSumGrad).
        a, g = self.a[::-1], self.g[::-1]
        per = max(1, self.BLOCK_ROWS // max(1, a[0].shape[0]))
        # The rows of g as one (n, rows, H) stack: the one another collector made in this sweep,
        # or made here (and kept for the sweep's later collectors) if it is one block.
        shape, dtype = g[0].shape, g[0].dtype
        whole = _shared_stack(g, dtype) if share else None
        if (
            share
            and whole is None
            and len(g) <= per
            and all(x.shape == shape and x.dtype == dtype for x in g)
        ):
            whole = _rows_stack(g, dtype, own=False)
        if whole is not None:
            whole = whole.reshape(-1, whole.shape[-1])
        row = 0
        for i in range(0, len(a), per):
            rows = _stacked(a[i : i + per])
            n = rows.shape[0]
            product = rows.T @ (_stacked(g[i : i + per]) if whole is None else whole[row : row + n])
            del rows  # a temporary: the workspace gives its buffer to the next block
            row += n
            if i == 0:
                out = product
            else:
                out += product
        return out

    def add_into(self, acc: np.ndarray) -> None:
        acc += self.dense()

    def compact(self) -> None:
        """Compute the products collected so far now, add them to the total kept, and let the
        inputs of every use so far go (the same sum, grouped by when this was called)."""
        if self.a:
            self.total = self._sum(share=False)  # (a unit's rows: no other collector stacks these)
            self.a.clear()
            self.g.clear()

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if isinstance(other, RowsProductGrad):  # self is one node's pending gradient: extend it
            return _take_uses(self, other)
        return super().merge(other)


class StackedProductGrad(LazyGrad):
    """``sum_k swapaxes(a_k) @ g_k`` over ``a_k`` ``(..., rows, I)`` and ``g_k`` ``(..., rows, H)``
    with the same leading axes as the weight: the gradient of a stack of weights ``W`` ``(..., I,
    H)`` in ``x @ W``, each weight multiplying its own rows (several cells computed as one, e.g.
    the two directions of a bidirectional RNN), collected over every use and computed as one
    batched product of the uses' rows when the weight's turn comes — as :class:`RowsProductGrad`
    does for one weight, instead of a dense ``(..., I, H)`` array per use."""

    __slots__ = ("a", "g", "total")

    def __init__(self, a: np.ndarray, g: np.ndarray) -> None:
        super().__init__((*a.shape[:-2], a.shape[-1], g.shape[-1]), np.result_type(a, g))
        self.a = [a]
        self.g = [g]
        self.total: np.ndarray | None = None  # the products of uses let go by compact(), summed

    def dense(self) -> np.ndarray:
        a, g = self.a, self.g
        out: np.ndarray
        if not a:
            assert self.total is not None  # (made with a use; emptied only by compact)
            out = self.total.copy()
            return out
        per = max(1, RowsProductGrad.BLOCK_ROWS // max(1, a[0].shape[-2]))  # uses a block
        for i in range(0, len(a), per):  # uses first to last, a block's rows as one product
            rows, grads = a[i : i + per], g[i : i + per]
            product = np.swapaxes(_joined(rows), -1, -2) @ _joined(grads)
            if i == 0:
                out = product
            else:
                out += product
        if self.total is not None:
            out += self.total
        return out

    def add_into(self, acc: np.ndarray) -> None:
        acc += self.dense()

    def compact(self) -> None:
        """As :meth:`RowsProductGrad.compact`: the uses so far become one total."""
        if self.a:
            self.total = self.dense()
            self.a.clear()
            self.g.clear()

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if type(other) is StackedProductGrad and other.shape == self.shape:
            return _take_uses(self, other)
        return super().merge(other)


def _take_uses(
    acc: RowsProductGrad | StackedProductGrad, other: RowsProductGrad | StackedProductGrad
) -> LazyGrad:
    """``acc`` (a :class:`RowsProductGrad` or :class:`StackedProductGrad`) extended by the uses
    and compacted total of ``other``, of the same kind: their sum."""
    acc.a.extend(other.a)
    acc.g.extend(other.g)
    if other.total is not None:
        acc.total = other.total if acc.total is None else acc.total + other.total
    return acc


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` (``(..., rows, n)``, the same leading axes) as one array of all their rows."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-2)


def _stacked(parts: list[np.ndarray]) -> np.ndarray:
    """The rows of 2-D ``parts`` concatenated, into a recycled buffer (a temporary: see
    :mod:`vgraph.workspace`)."""
    rows = 0
    dtype = parts[0].dtype
    for p in parts:
        rows += p.shape[0]
        if p.dtype != dtype:
            dtype = np.result_type(dtype, p.dtype)
    out = workspace.empty((rows, parts[0].shape[1]), dtype)
    return np.concatenate(parts, out=out)


def _stack_entry(parts: list[np.ndarray]) -> list[Any] | None:
    """The entry of this backward sweep's stacks made of exactly ``parts`` (the same arrays, in
    order), or None."""
    stacks = _sweep.stacks
    entry = None if stacks is None else stacks.get((len(parts), id(parts[0]), id(parts[-1])))
    if entry is None or not all(map(operator.is_, entry[0], parts)):  # (the same arrays, in order)
        return None
    return entry


def _shared_stack(parts: list[np.ndarray], dtype: Any) -> np.ndarray | None:
    """The stack of exactly ``parts`` as ``dtype`` that a collector made earlier in this backward
    sweep (see :func:`_rows_stack`), to read and not to write into; or None."""
    entry = _stack_entry(parts)
    if entry is None or entry[1].dtype != dtype:
        return None
    out: np.ndarray = entry[1]
    return out


def _rows_stack(parts: list[np.ndarray], dtype: Any, *, own: bool) -> np.ndarray:
    """``np.stack(parts)`` as ``dtype`` — made once per backward sweep for the same parts.

    A loop's gradient rows (the gradient of ``x_t @ W_x + h @ W_h + b`` in every iteration) reach
    several collectors: the hoisted group of ``x_t @ W_x`` (:class:`StepRowsGrad`), the tied
    weight ``W_h`` (:class:`RowsProductGrad`), the bias (:class:`LeadingSumGrad`). Each needs them
    as one stack, which the first makes and the others read, within one sweep (see
    :class:`sweep_scope`): the floor's single gradient buffer, with no copy per collector.

    ``parts`` (same shape, kept by the sweep: the caller must not change the list) are matched by
    identity; stacks over :data:`SHARED_STACK_BYTES` are not kept. ``own``: the caller returns the
    stack as its result, which its caller then owns and may write into once the sweep is over; a
    stack is handed out so at most once (a second owner gets a new one), and readers
    (``own=False``) must not write into it.
    """
    entry = _stack_entry(parts)
    if entry is not None and entry[1].dtype == dtype and not (own and entry[2]):
        if own:
            entry[2] = True  # handed out: no other owner gets it
        out: np.ndarray = entry[1]
        return out
    stacks = _sweep.stacks
    buffer = _rows_buffer(parts, dtype) if entry is None else None
    if buffer is not None and stacks is not None:  # the rows were written into one buffer, in order
        stacks[(len(parts), id(parts[0]), id(parts[-1]))] = [parts, buffer, own]  # (their stack)
        return buffer
    out = workspace.empty((len(parts), *parts[0].shape), dtype)
    if out.ndim > 1:  # np.stack, as one concatenation of the parts (see _stack)
        np.concatenate(parts, out=out.reshape(-1, *out.shape[2:]))
    else:
        np.stack(parts, out=out)
    if stacks is not None and entry is None and out.nbytes <= SHARED_STACK_BYTES:
        stacks.setdefault((len(parts), id(parts[0]), id(parts[-1])), [parts, out, own])
    return out


def _rows_buffer(parts: list[np.ndarray], dtype: Any) -> np.ndarray | None:
    """The buffer whose rows ``0, 1, ...`` are exactly ``parts`` (written by
    :func:`_tanh_vjp_row` in this sweep), if there is one and it has ``dtype`` and no other row."""
    starts = _sweep.row_starts
    entry = starts.get(id(parts[0])) if starts else None
    if entry is None:
        return None
    buffer, written = entry
    if buffer.dtype != dtype or len(written) != len(parts) or not all(map(operator.is_, written, parts)):
        return None
    return buffer


def share_rows(buffer: np.ndarray, rows: list[np.ndarray]) -> None:
    """Within this backward sweep, let the collectors whose parts are exactly ``rows`` (the rows
    of ``buffer``, in order: a loop's gradient rows, written into one buffer by its backward
    steps) read ``buffer`` as their stack (:func:`_rows_stack`) instead of stacking them.
    Nothing outside a sweep."""
    starts = _sweep.row_starts
    if starts is not None and rows:
        starts[id(rows[0])] = (buffer, rows)


#: The largest stack of gradient rows :func:`_rows_stack` keeps for the rest of its sweep. Keeping
#: one alive until the sweep's last reader costs one more gradient-sized array at the end of the
#: sweep; beyond this size (a long loop's rows), the copies it saves are not worth that memory.
SHARED_STACK_BYTES = 1 << 23


def as_array(g: Any) -> np.ndarray:
    """A VJP's result as an array (a :class:`LazyGrad` is made dense), for callers of VJPs other
    than the engine's backward sweep."""
    return g.dense() if isinstance(g, LazyGrad) else np.asarray(g)


def densified(g: Any) -> Any:
    """``g`` as an array where it is a :class:`LazyGrad` (made dense); anything else as it is."""
    return g.dense() if isinstance(g, LazyGrad) else g


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


class LeadingSumGrad(LazyGrad):
    """A gradient for a leaf of ``shape`` that reached it broadcast over leading axes (a bias added
    to every row of a batch, in every iteration of a loop): the contributions are kept as they come
    and reduced to ``shape`` once, when the leaf's turn comes. If another collector of the same
    rows made their stack in this sweep (see :func:`_rows_stack`: a loop's hoisted input, its bias
    and its tied weight get the same rows), that is one reduction of the stack instead of one
    addition per use; otherwise the contributions are added up then, in the order they came, as
    each use would have added its own. Nothing is written into a contribution (it may be another
    node's gradient too). Past :attr:`HELD_BYTES` of contributions — more than a stack is kept
    for — they are added up into one array (:meth:`compact`), so the memory held stays bounded
    however long the loop."""

    __slots__ = ("own", "parts")

    #: The most bytes of contributions kept as they came (beyond it, they are added up into one).
    HELD_BYTES = SHARED_STACK_BYTES

    def __init__(self, shape: tuple[int, ...], full: np.ndarray) -> None:
        self.shape = shape
        self.dtype = full.dtype
        self.parts = [full]
        self.own = False  # parts[0] is an array this gradient made (and may add into)

    def dense(self) -> np.ndarray:
        if len(self.parts) > 1:
            stack = _shared_stack(self.parts[::-1], self.dtype)  # first use first (RowsProductGrad.dense)
            if stack is not None:
                return unbroadcast(stack, self.shape)
            self.compact()  # no stack of these rows: add them up (no copy of them all)
        return unbroadcast(self.parts[0], self.shape)

    def add_into(self, acc: np.ndarray) -> None:
        acc += self.dense()

    def absorb(self, full: Any) -> bool:
        """Add ``full``, another use's gradient at the same full shape and dtype, to this one and
        return True; False (nothing done) for anything else."""
        parts = self.parts
        if type(full) is not np.ndarray or full.shape != parts[0].shape or full.dtype != self.dtype:
            return False
        parts.append(full)
        if len(parts) * full.nbytes > self.HELD_BYTES:
            self.compact()
        return True

    def compact(self) -> None:
        """Add the contributions kept so far up into one array (at their full shape), in the
        order they came."""
        parts = self.parts
        if len(parts) > 1:
            total = parts[0] if self.own else parts[0].copy()
            for p in parts[1:]:
                np.add(total, p, out=total)
            self.parts = [total]
            self.own = True

    def merge(self, other: LazyGrad) -> LazyGrad | np.ndarray:
        if type(other) is LeadingSumGrad and self.absorb(other.parts[0]):
            for p in other.parts[1:]:
                self.absorb(p)
            return self
        return super().merge(other)


def reduce_grad(g: Any, shape: tuple[int, ...], leaf: bool) -> Any:
    """``g`` (whose shape differs from ``shape``) reduced to ``shape`` for an input: for a leaf and
    only leading axes added, lazily (:class:`LeadingSumGrad`: a leaf collects one contribution
    per use); otherwise now (:func:`unbroadcast`)."""
    if leaf and type(g) is np.ndarray and g.ndim > len(shape) and g.shape[g.ndim - len(shape) :] == shape:
        return LeadingSumGrad(shape, g)
    return unbroadcast(g, shape)


def unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` over the axes numpy broadcasting added or stretched, giving an array of ``shape``."""
    g = np.asarray(g)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = _sum_leading(g, extra)
        if g.shape == shape:  # only leading axes were added (a bias over a batch): done
            return g
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)
    return g


_add_reduce = np.add.reduce  # ndarray.sum without its Python-level wrapper


def _sum_leading(g: np.ndarray, extra: int) -> np.ndarray:
    """``g`` summed over its first ``extra`` axes: a new array (or, summed to ``()`` by numpy's
    reduction, a numpy scalar).

    For a C-contiguous float32/float64 array that is one BLAS product of a vector of ones with
    ``g`` as a ``(rows, rest)`` matrix: numpy reduces over leading axes row by row, 3-8x slower at
    a loop's sizes (a bias's gradient over ``(50, 32, 128)`` rows: 42 µs against 11; ``(100, 64,
    256)``: 359 against 234). The same sum of the same terms; only the rounding order differs.
    """
    if g.dtype in _BLAS_FLOATS and g.size and g.flags.c_contiguous:
        rows = g.size // max(1, math.prod(g.shape[extra:]))
        if rows <= ONES_MAX_ROWS:
            out: np.ndarray = (_ones(rows, g.dtype) @ g.reshape(rows, -1)).reshape(g.shape[extra:])
            return out
    summed: np.ndarray = _add_reduce(g, axis=0 if extra == 1 else tuple(range(extra)))
    return summed


_BLAS_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
#: The most rows :func:`_sum_leading` sums by a product with ones: the vector of ones is kept (per
#: thread and dtype) at the longest length asked for, so it is bounded (8 MiB in float64); past it
#: the reduction is memory-bound either way.
ONES_MAX_ROWS = 1 << 20


class _Ones(threading.local):
    """Per thread and dtype, a read-only vector of ones at least as long as any asked for."""

    def __init__(self) -> None:
        self.vectors: dict[np.dtype[Any], np.ndarray] = {}


_ones_cache = _Ones()


def _ones(n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """A read-only vector of ``n`` ones of ``dtype`` (a view of one kept per thread)."""
    v = _ones_cache.vectors.get(dtype)
    if v is None or v.shape[0] < n:
        v = np.ones(max(n, 1024), dtype)
        v.flags.writeable = False
        _ones_cache.vectors[dtype] = v
    return v[:n]


def pass_through(g: Any, ans: Any, *xs: Any, **attrs: Any) -> Any:
    """The VJP of an input whose gradient is the output's (``a`` in ``a + b``): ``g`` itself."""
    return g


# ---------------------------------------------------------------------------- elementwise
defop("Add", np.add, pass_through, pass_through, kind=ELEMENTWISE)
defop("Sub", np.subtract, pass_through, lambda g, ans, a, b: -g, kind=ELEMENTWISE)
defop("Mul", np.multiply, lambda g, ans, a, b: g * b, lambda g, ans, a, b: g * a, kind=ELEMENTWISE)
defop("Div", np.divide, lambda g, ans, a, b: g / b, lambda g, ans, a, b: -g * ans / b, kind=ELEMENTWISE)
defop("Neg", np.negative, lambda g, ans, x: -g, kind=ELEMENTWISE)
defop(
    "Pow",
    lambda x, p: np.power(x, p),
    lambda g, ans, x, p: g * (p * np.power(x, p - 1)),
    kind=ELEMENTWISE,
)
defop("Exp", np.exp, lambda g, ans, x: g * ans, kind=ELEMENTWISE)
defop("Log", np.log, lambda g, ans, x: g / x, kind=ELEMENTWISE)


def _tanh_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray) -> np.ndarray:
    out: np.ndarray = g * (1 - ans * ans)
    return out


def _tanh_vjp_into(out: np.ndarray | None, g: Any, ans: np.ndarray, x: Any) -> np.ndarray | None:
    """:func:`_tanh_vjp`'s result written into ``out`` — the same operations in place, so the
    same bits — or ``None`` (nothing written) where ``g``, ``ans`` and ``out`` are not arrays of
    one shape and dtype (or no ``out`` is given)."""
    if (
        out is None
        or type(g) is not np.ndarray
        or g.dtype != ans.dtype
        or g.shape != ans.shape
        or out.dtype != ans.dtype
        or out.shape != ans.shape
    ):
        return None
    np.multiply(ans, ans, out=out)
    np.subtract(1, out, out=out)
    np.multiply(out, g, out=out)
    return out


defop("Tanh", np.tanh, _tanh_vjp, kind=ELEMENTWISE)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warning for large |x|, unlike 1 / (1 + exp(-x)).
    return 0.5 * (np.tanh(0.5 * x) + 1)


defop("Sigmoid", _sigmoid, lambda g, ans, x: g * ans * (1 - ans), kind=ELEMENTWISE)
defop("Relu", lambda x: np.maximum(x, 0), lambda g, ans, x: g * (x > 0), kind=ELEMENTWISE)
defop("Softplus", lambda x: np.logaddexp(0, x), lambda g, ans, x: g * _sigmoid(x), kind=ELEMENTWISE)
# Step and Sign are flat almost everywhere: their gradient is zero (seed 000).
defop("Step", lambda x: (x > 0).astype(x.dtype), None, kind=ELEMENTWISE)
defop("Sign", np.sign, None, kind=ELEMENTWISE)
defop("Abs", np.abs, lambda g, ans, x: g * np.sign(x), kind=ELEMENTWISE)
defop("Sqrt", np.sqrt, lambda g, ans, x: g * 0.5 / ans, kind=ELEMENTWISE)


def _tie_share(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Where ``first`` wins the comparison 1, where it ties 0.5: the share of the gradient of
    ``maximum(first, second)`` that goes to ``first`` (ties share it equally, as ``Max`` does)."""
    dtype = np.result_type(first, second, np.float32)  # the gradient keeps the inputs' float dtype
    out: np.ndarray = (first > second).astype(dtype) + dtype.type(0.5) * (first == second)
    return out


defop(
    "Maximum",
    np.maximum,
    lambda g, ans, a, b: g * _tie_share(a, b),
    lambda g, ans, a, b: g * _tie_share(b, a),
    kind=ELEMENTWISE,
)
defop(
    "Minimum",
    np.minimum,
    lambda g, ans, a, b: g * _tie_share(b, a),
    lambda g, ans, a, b: g * _tie_share(a, b),
    kind=ELEMENTWISE,
)


def _clip_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, lo: Any = None, hi: Any = None) -> np.ndarray:
    # Inside the bounds, bounds included, the gradient passes (as torch.clamp's).
    inside = (True if lo is None else x >= lo) & (True if hi is None else x <= hi)
    out: np.ndarray = g * inside
    return out


# The bounds are numbers or None.
defop("Clip", lambda x, lo=None, hi=None: np.clip(x, lo, hi), _clip_vjp, kind=ELEMENTWISE)
defop(
    "Where",
    lambda cond, a, b: np.where(cond, a, b),
    None,
    lambda g, ans, cond, a, b: np.where(cond, g, 0),
    lambda g, ans, cond, a, b: np.where(cond, 0, g),
    kind=ELEMENTWISE,
)


# ---------------------------------------------------------------------------- linear algebra
def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b``; an N-D ``a`` times a matrix is one 2-D product over all its rows (numpy would
    run one product per leading index: 6-14x slower for a (T, B, I) stack)."""
    if b.ndim == 2 and a.ndim > 2:
        return np.reshape(a.reshape(-1, a.shape[-1]) @ b, (*a.shape[:-1], b.shape[-1]))
    out: np.ndarray = a @ b  # (np.matmul itself, without the 0.5 µs of parsing a ufunc call's arguments)
    return out


def _matmul_vjp_a(g: np.ndarray, ans: np.ndarray, a: np.ndarray, b: np.ndarray) -> Any:
    if a.ndim == 2 and b.ndim == 2:  # the hot path: a matrix times a matrix
        if g.shape[0] * b.size < TRANSPOSED_MIN_WORK:
            return g @ b.T  # too small for the transposed operand to cost more than the look-up
        return g @ _transposed(b)
    return _matmul_vjp(g, a, b, 0)


#: The smallest gradient product ``g @ b.T`` (rows x size of ``b``, multiply-adds) for which a
#: backward sweep multiplies by a contiguous copy of ``b.T`` (see :func:`_transposed`): below it,
#: looking the copy up costs more than the transposed operand (on the benchmark machine: a
#: (16, 32) @ (32, 32) product gains 0.4 µs, and a (1, 32) one 0.1 µs; (32, 128) @ (128, 128) 7 µs).
TRANSPOSED_MIN_WORK = 1 << 16


def _transposed(b: np.ndarray) -> np.ndarray:
    """``b.T`` for the gradient product ``g @ b.T``: from ``b``'s second use in one backward
    sweep on (a weight used in every iteration of a loop), a C-contiguous copy made once.

    BLAS multiplies by a transposed (Fortran-ordered) operand markedly slower at the sizes of a
    recurrent step — single-threaded OpenBLAS on this project's benchmark machine: ``(32, 128) @
    (128, 128).T`` 17.2 µs against 10.2 µs with the transpose contiguous, ``(64, 256) @ (256,
    256).T`` 89 against 70 — while the copy costs about one such product (docs/decisions.md,
    "A weight's transpose"). A matrix used once keeps the plain ``b.T``: no copy.
    """
    plain: np.ndarray = b.T
    cache = _sweep.transposes
    if cache is None:
        return plain
    entry = cache.get(id(b))
    if entry is None:
        cache[id(b)] = [b, None]
        return plain
    t: np.ndarray | None = entry[1]
    if t is None:
        t = entry[1] = np.ascontiguousarray(plain)
    return t


def _matmul_vjp_b(g: np.ndarray, ans: np.ndarray, a: np.ndarray, b: np.ndarray) -> Any:
    if a.ndim == 2 and b.ndim == 2:  # the hot path (see RowsProductGrad)
        return RowsProductGrad(a, g)
    if a.ndim == 1 and b.ndim == 2:  # a vector times a weight (a tree node's state): one row
        return RowsProductGrad(a[None, :], g[None, :])
    return _matmul_vjp(g, a, b, 1)


def _matmul_vjp(g: np.ndarray, a: np.ndarray, b: np.ndarray, wrt: int) -> Any:
    if b.ndim == 2 and a.ndim >= 2:  # the common case: rows (of any batch shape) times a matrix
        if wrt == 0:  # g (..., H) @ b.T as one 2-D product
            return np.reshape(g.reshape(-1, g.shape[-1]) @ _transposed(b), a.shape)
        # Every use of a weight in a loop contributes a_t^T g_t: collect them and compute one
        # (T*rows)-row product when the weight's turn comes (see RowsProductGrad).
        return RowsProductGrad(a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1]))
    if wrt == 1 and b.ndim > 2 and a.shape[:-2] == b.shape[:-2]:  # a stack of weights, each its rows
        return StackedProductGrad(a, g)
    # General case: promote 1-D operands to matrices as np.matmul does, then undo it.
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g
    if b.ndim == 1:  # first: for 1-D @ 1-D, g is 0-d and has no axis -2 yet
        g2 = np.expand_dims(g2, -1)
    if a.ndim == 1:
        g2 = np.expand_dims(g2, -2)
    x2 = a2 if wrt == 0 else b2
    nb = g2.ndim - 2  # batch axes of the product
    x_batch = (1,) * (nb - (x2.ndim - 2)) + x2.shape[:-2]
    summed = [k for k in range(nb) if x_batch[k] == 1 and g2.shape[k] != 1]
    # Summing inside one product allocates nothing for a weight on the right (rows of a and g are
    # reshaped views); on the left it needs copies of g and b, worth it only when they are
    # smaller than the stack of per-batch products it avoids.
    m, k, n = a2.shape[-2], a2.shape[-1], g2.shape[-1]
    if summed and (wrt == 1 or m * k > n * (m + k)):
        grad = _matmul_vjp_summed(g2, a2, b2, wrt, summed).reshape(x2.shape)
    elif wrt == 0:
        grad = _matmul(g2, np.swapaxes(b2, -1, -2))
    else:
        grad = np.swapaxes(a2, -1, -2) @ g2
    if wrt == 0:
        return grad[..., 0, :] if a.ndim == 1 else grad
    return grad[..., 0] if b.ndim == 1 else grad


def _matmul_vjp_summed(
    g: np.ndarray, a: np.ndarray, b: np.ndarray, wrt: int, summed: list[int]
) -> np.ndarray:
    """The gradient of an operand that was broadcast over the batch axes ``summed`` of
    ``g = a @ b`` (all operands at least 2-D), with those axes summed *inside* one product.

    E.g. ``(T, B, H) @ (H, V)`` (a Linear layer on a stack): the gradient of the weight is one
    ``(H, T·B) @ (T·B, V)`` product, instead of a ``(T, H, V)`` stack of products summed
    afterwards. Returns an array with the operand's number of elements (kept batch axes first).
    """
    nb = g.ndim - 2
    kept = [k for k in range(nb) if k not in summed]
    kept_shape = tuple(g.shape[k] for k in kept)
    if wrt == 1:  # db[kept] = sum over summed axes and rows m of a[..., m, :]^T g[..., m, :]
        a_full = np.broadcast_to(a, g.shape[:-2] + a.shape[-2:])
        order = (*kept, *summed, nb, nb + 1)
        rows_a = a_full.transpose(order).reshape((*kept_shape, -1, a.shape[-1]))
        rows_g = g.transpose(order).reshape((*kept_shape, -1, g.shape[-1]))
        db: np.ndarray = np.swapaxes(rows_a, -1, -2) @ rows_g
        return db
    # da[kept] = sum over summed axes and columns n of g[..., :, n] b[..., :, n]^T
    b_full = np.broadcast_to(b, g.shape[:-2] + b.shape[-2:])
    cols_g = g.transpose((*kept, nb, *summed, nb + 1)).reshape((*kept_shape, g.shape[-2], -1))
    cols_b = b_full.transpose((*kept, *summed, nb + 1, nb)).reshape((*kept_shape, -1, b.shape[-2]))
    da: np.ndarray = cols_g @ cols_b
    return da


defop("MatMul", _matmul, _matmul_vjp_a, _matmul_vjp_b)


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x @ w + b`` with the bias added into the product's own array: one array the size of the
    result instead of two (a language model's ``(T*B, vocabulary)`` logits), and the same
    operations as ``MatMul`` then ``Add``, so the same values to the last bit."""
    out = _matmul(x, w)
    shape, bs = np.shape(out), np.shape(b)
    if len(bs) > len(shape) or shape[len(shape) - len(bs) :] != bs:
        raise ValueError(f"the bias has shape {bs}; Linear needs the last axes of x @ w, shape {shape}")
    if type(out) is np.ndarray and np.result_type(out, b) == out.dtype:
        np.add(out, b, out=out)
        return out
    result: np.ndarray = out + b  # a scalar product (1-D @ 1-D), or a bias that promotes the dtype
    return result


def _linear_vjp_x(g: np.ndarray, ans: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> Any:
    return _matmul_vjp_a(g, ans, x, w)


def _linear_vjp_w(g: np.ndarray, ans: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> Any:
    return _matmul_vjp_b(g, ans, x, w)


defop("Linear", _linear, _linear_vjp_x, _linear_vjp_w, pass_through)


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
    kind=REDUCTION,
)
defop(
    "Mean",
    lambda x, axis=None, keepdims=False: np.mean(x, axis=axis, keepdims=keepdims),
    lambda g, ans, x, axis=None, keepdims=False: np.broadcast_to(
        _expand_reduced(g, x, axis, keepdims) / _count(x, axis), x.shape
    ),
    kind=REDUCTION,
)


def _max_vjp(
    g: np.ndarray, ans: np.ndarray, x: np.ndarray, axis: Any = None, keepdims: bool = False
) -> np.ndarray:
    ans_k = _expand_reduced(ans, x, axis, keepdims)
    g_k = _expand_reduced(g, x, axis, keepdims)
    hit = x == ans_k
    # Ties share the gradient equally, so the VJP is the average of the one-sided derivatives.
    out: np.ndarray = g_k * hit / hit.sum(axis=axis, keepdims=True).astype(g_k.dtype)
    return out


defop(
    "Max",
    lambda x, axis=None, keepdims=False: np.max(x, axis=axis, keepdims=keepdims),
    _max_vjp,
    kind=REDUCTION,
)
defop(  # _max_vjp finds the elements equal to the result: it serves the minimum too
    "Min",
    lambda x, axis=None, keepdims=False: np.min(x, axis=axis, keepdims=keepdims),
    _max_vjp,
    kind=REDUCTION,
)


def _var_vjp(
    g: np.ndarray, ans: np.ndarray, x: np.ndarray, axis: Any = None, keepdims: bool = False, ddof: int = 0
) -> np.ndarray:
    centred = x - np.mean(x, axis=axis, keepdims=True)
    out: np.ndarray = _expand_reduced(g, x, axis, keepdims) * (2.0 / (_count(x, axis) - ddof)) * centred
    return out


defop(
    "Var",
    lambda x, axis=None, keepdims=False, ddof=0: np.var(x, axis=axis, keepdims=keepdims, ddof=ddof),
    _var_vjp,
    kind=REDUCTION,
)
# Indices of the extremes: integer outputs, flat almost everywhere, so no gradient (as Step).
defop(
    "ArgMax",
    lambda x, axis=None, keepdims=False: np.argmax(x, axis=axis, keepdims=keepdims),
    None,
    kind=REDUCTION,
)
defop(
    "ArgMin",
    lambda x, axis=None, keepdims=False: np.argmin(x, axis=axis, keepdims=keepdims),
    None,
    kind=REDUCTION,
)


def _cumsum_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, axis: int | None = None) -> np.ndarray:
    # Input i feeds every output from i on: its gradient is the sum of g from i to the end.
    if axis is None:
        return np.cumsum(g[::-1])[::-1].reshape(x.shape)
    return np.flip(np.cumsum(np.flip(g, axis), axis), axis)


defop("CumSum", lambda x, axis=None: np.cumsum(x, axis=axis), _cumsum_vjp)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    out: np.ndarray = e / e.sum(axis=axis, keepdims=True)
    return out


def _log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    return out


defop(
    "Softmax",
    _softmax,
    lambda g, ans, x, axis=-1: ans * (g - (g * ans).sum(axis=axis, keepdims=True)),
    kind=ALONG_AXIS,
)
defop(
    "LogSoftmax",
    _log_softmax,
    lambda g, ans, x, axis=-1: g - np.exp(ans) * g.sum(axis=axis, keepdims=True),
    kind=ALONG_AXIS,
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
    if type(index) is int:  # the hot path: one step of a sequence
        return True
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in items)


def _distinct_rows(index: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``index`` is an integer array along one axis — ``rows`` or ``(k, rows)``, what a
    batched build's views of other groups' rows use — that picks no element twice: then the
    gradient is added in with one indexed ``+=`` instead of ``np.add.at`` (about 5x slower), the
    same additions."""
    axis = 0
    if type(index) is tuple and len(index) == 2 and type(index[0]) is int:
        index, axis = index[1], 1
    if type(index) is not np.ndarray or index.ndim != 1 or index.dtype.kind not in "iu" or len(shape) <= axis:
        return False
    if index.size < 2:
        return True
    rows = np.where(index < 0, index + shape[axis], index) if index.dtype.kind == "i" else index
    return bool(np.unique(rows).size == index.size)


def _getitem_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, index: Any) -> IndexedGrad:
    # Lazy: stepping through a (T, B, H) sequence gives T of these, which the engine adds into one
    # buffer (O(T) in all) instead of zero-filling a (T, B, H) array per step (O(T^2)).
    return IndexedGrad(x.shape, g.dtype, index, g, _is_basic_index(index) or _distinct_rows(index, x.shape))


defop("GetItem", lambda x, index: x[index], _getitem_vjp)


def basic_view_index(op: Op, attrs: dict[str, Any]) -> Any:
    """The index of a node that is a basic-index view of its one input (``x[index]``, each element
    picked at most once), or ``None`` for any other node. Such a node's VJP places ``g`` at
    ``index`` of a zero array of the input's shape: a caller that owns a zero-initialised
    gradient buffer of the input may add ``g`` in there instead (``buf[index] += g``)."""
    if op.name != "GetItem" or op.user:
        return None
    index = attrs["index"]
    return index if _is_basic_index(index) else None


def _take_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, indices: np.ndarray) -> IndexedGrad:
    return IndexedGrad(x.shape, g.dtype, indices, g, False)  # repeated rows accumulate


def _take_along_axis_vjp(
    g: np.ndarray, ans: np.ndarray, x: np.ndarray, indices: np.ndarray, axis: int = -1
) -> np.ndarray:
    out = np.zeros(x.shape, dtype=g.dtype)
    where: list[np.ndarray] = list(np.indices(g.shape, sparse=True))
    where[axis] = np.broadcast_to(indices, g.shape)
    np.add.at(out, tuple(where), g)
    return out


def _one_hot(indices: np.ndarray, depth: int, dtype: str = "float64") -> np.ndarray:
    if indices.dtype.kind not in "iu":
        raise ValueError(f"one_hot needs integer indices, got dtype {indices.dtype}")
    if indices.size and (indices.min() < 0 or indices.max() >= depth):
        raise ValueError(f"one_hot indices must be in [0, {depth}), got {indices.min()}..{indices.max()}")
    out = np.zeros((*indices.shape, depth), dtype=dtype)
    np.put_along_axis(out, indices[..., None], 1, axis=-1)
    return out


# Integer indices in, floats out: nothing to differentiate.
defop("OneHot", _one_hot, None)
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
    # A view of g's slice, not a copy (np.take would copy every input's gradient).
    return g[(slice(None),) * (axis % ans.ndim) + (i,)]


defop("Concat", lambda *xs, axis=0: np.concatenate(xs, axis=axis), _concat_vjp, variadic=True)

_shape = operator.attrgetter("shape")


def _stack(*xs: Any, axis: int = 0) -> np.ndarray:
    """``np.stack(xs, axis)``. Along axis 0, arrays of one shape (``loop.stack``'s per-iteration
    values) are one ``np.concatenate`` of them, as rows: ``np.stack`` adds the new axis to each
    part in Python first, 2-3x slower for a loop's 50 to 1,000 parts. The same values."""
    if axis == 0 and len(set(map(type, xs))) == 1 and type(xs[0]) is np.ndarray and xs[0].ndim:
        shapes = set(map(_shape, xs))  # (map and set: the checks in C, a fraction of the saving)
        if len(shapes) == 1:
            out: np.ndarray = np.concatenate(xs).reshape(len(xs), *shapes.pop())
            return out
    return np.stack(xs, axis=axis)


defop("Stack", _stack, _stack_vjp, variadic=True)


def _pad_stack(*xs: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The arrays stacked along a new axis 0, each padded with zeros at the end of its axes to
    ``shape`` (rows of different lengths as one array)."""
    out = np.zeros((len(xs), *shape), dtype=np.result_type(*xs))
    for r, x in enumerate(xs):
        out[_part(r, x)] = x
    return out


def _part(r: int, x: Any) -> tuple[Any, ...]:
    """The index of row ``r``'s part of a ``PadStack`` whose input ``r`` is ``x``."""
    return (r, *(slice(0, n) for n in np.shape(x)))


def _pad_stack_vjp(i: int, g: np.ndarray, ans: np.ndarray, *xs: Any, shape: tuple[int, ...]) -> np.ndarray:
    out: np.ndarray = g[_part(i, xs[i])]  # (a view: input i's part, without the padding)
    return out


defop("PadStack", _pad_stack, _pad_stack_vjp, variadic=True)


# ---------------------------------------------------------------------------- structural
# Identity ops that exist for what they mean in the graph, not for their arithmetic.
defop("Detach", lambda x: x, None, kind=ELEMENTWISE)  # stops the gradient
defop("Branch", lambda x: x, pass_through, kind=ELEMENTWISE)  # the option a BranchNode selected
defop("Identity", lambda x: x, pass_through, kind=ELEMENTWISE)


# Rows of several arrays stacked into one (autobatching, see vgraph.virtual.batch): ``rows`` lists,
# for each output row, the input it comes from and the path to the row in it: basic indices
# applied one after another (``(3,)`` is ``x[3]``; ``((slice(None), 3), 0)`` is ``x[:, 3][0]``).
# The VJP scatters each input's rows of the gradient back into it (lazily).
def row_at(x: Any, path: tuple[Any, ...]) -> Any:
    """``x[path[0]][path[1]]…`` (a view: the indices are basic)."""
    for i in path:
        x = x[i]
    return x


def _gather_rows(*xs: np.ndarray, rows: tuple[tuple[int, tuple[Any, ...]], ...]) -> np.ndarray:
    return np.stack([row_at(xs[s], path) for s, path in rows])


class RowsGrad(LazyGrad):
    """``g[p]`` added at the row ``path`` leads to in a zero array, for each ``(path, p)`` (rows may
    repeat; see :func:`row_at`)."""

    __slots__ = ("g", "pairs")

    def __init__(
        self, shape: tuple[int, ...], dtype: Any, g: np.ndarray, pairs: list[tuple[Any, int]]
    ) -> None:
        super().__init__(shape, dtype)
        self.g = g
        self.pairs = pairs

    def add_into(self, acc: np.ndarray) -> None:
        g, pairs = self.g, self.pairs
        if len(pairs) > 1 and all(len(path) == 1 and type(path[0]) is int for path, _ in pairs):
            # rows of the first axis (the common case: one row per input of a group): one
            # indexed addition, the same additions per element as the loop below
            at = [path[0] for path, _ in pairs]
            rows = g[[p for _, p in pairs]]
            if len(set(at)) == len(at):
                acc[at] += rows
            else:
                add_at(acc, np.array(at), rows)  # a repeated row accumulates in order
            return
        for path, p in pairs:
            if path:
                row_at(acc, path[:-1])[path[-1]] += g[p]  # in place: a view of acc
            else:  # the whole input is the row
                np.add(acc, g[p], out=acc)


#: The latest GatherRows node's rows grouped by the input they come from, with the ``rows``
#: attribute they were computed from (one tuple, replaced in one step): the engine calls a node's
#: VJPs one input after another with the same attributes, so the grouping is done once per node
#: instead of once per input (which made a node of n inputs cost n² steps).
_rows_by_input: list[tuple[Any, dict[int, list[tuple[Any, int]]]]] = [((), {})]


def _gather_rows_vjp(i: int, g: np.ndarray, ans: np.ndarray, *xs: np.ndarray, rows: Any) -> RowsGrad:
    memo = _rows_by_input[0]
    if memo[0] is not rows:
        by: dict[int, list[tuple[Any, int]]] = {}
        for p, (s, r) in enumerate(rows):
            by.setdefault(s, []).append((r, p))
        memo = _rows_by_input[0] = (rows, by)
    return RowsGrad(xs[i].shape, g.dtype, g, memo[1].get(i, []))


defop("GatherRows", _gather_rows, _gather_rows_vjp, variadic=True)


# One iteration's copy of a hoisted loop-body node: row ``index`` of the node computed for every
# iteration at once (see vgraph.virtual.hoist). A view; its gradient lands in the group's buffer.
def _hoisted_vjp(g: np.ndarray, ans: np.ndarray, x: np.ndarray, index: int) -> IndexedGrad:
    return IndexedGrad(x.shape, g.dtype, index, g, True)  # an iteration's row: a basic index


def _hoisted(x: np.ndarray, index: int) -> np.ndarray:
    row: np.ndarray = x[index]
    return row


defop("Hoisted", _hoisted, _hoisted_vjp)


def _add_row(rows: np.ndarray, x: np.ndarray, index: int) -> np.ndarray:
    out: np.ndarray = rows[index] + x
    return out


def _add_row_vjp(g: np.ndarray, ans: np.ndarray, rows: np.ndarray, x: np.ndarray, index: int) -> IndexedGrad:
    return _hoisted_vjp(g, ans, rows, index)  # the row's gradient: rows[index] has g's shape (below)


# ``rows[index] + x``: a loop's sum whose hoisted part is row ``index`` of a group (see
# vgraph.virtual.hoist.RowSum), for a row, ``x`` and sum all of one shape and dtype.
defop("AddRow", _add_row, _add_row_vjp, pass_through)


def _matmul_add_row(a: np.ndarray, b: np.ndarray, rows: np.ndarray, index: int) -> np.ndarray:
    out: np.ndarray = rows[index] + _matmul(a, b)
    return out


def _matmul_add_row_vjp_a(
    g: np.ndarray, ans: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, index: int
) -> Any:
    return _matmul_vjp_a(g, ans, a, b)


def _matmul_add_row_vjp_b(
    g: np.ndarray, ans: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, index: int
) -> Any:
    return _matmul_vjp_b(g, ans, a, b)


def _matmul_add_row_vjp_rows(
    g: np.ndarray, ans: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, index: int
) -> IndexedGrad:
    return _hoisted_vjp(g, ans, rows, index)


# ``rows[index] + a @ b``: a loop sum whose per-iteration term is a product (``h @
# W_h``, see vgraph.virtual.hoist.RowSum) that nothing else reads, in one node: ``AddRow`` of
# the product, with the same operations (so the same values, bit for bit), one node fewer per step.
# For a product, row and sum all of one shape and dtype.
defop("MatMulAddRow", _matmul_add_row, _matmul_add_row_vjp_a, _matmul_add_row_vjp_b, _matmul_add_row_vjp_rows)

#: The sums that read row ``attrs["index"]`` of a hoisted group (vgraph.virtual.hoist.RowSum), by
#: forward: the position of the group among their inputs.
ROW_SUMS: dict[Any, int] = {_add_row: 0, _matmul_add_row: 2}
#: The fewest elements of a row for which a compiled sweep writes a ``tanh``'s gradient into its
#: row of the sweep's buffer (see :func:`_tanh_vjp_row`): on fewer, the call costs more than the
#: copy it saves.
ROW_VJP_MIN = 1024


def _tanh_vjp_row(g: np.ndarray, ans: np.ndarray, row_sum: Any) -> np.ndarray | None:
    """:func:`_tanh_vjp`'s result, written into its row of one buffer per sum and sweep: the
    gradient of ``tanh(rows[t] + c)`` with respect to the sum ``row_sum`` (an ``AddRow`` or
    ``MatMulAddRow`` node reading row ``t`` of a group), which every collector of the loop's
    gradient rows then reads as one stack, with no copy (:func:`_rows_stack`): the floor's
    ``(T, B, H)`` gradient buffer. The same operations in place (the same bits). ``None`` where it
    cannot: outside a sweep, or a gradient or group of another dtype or shape.

    Compiled sweeps call it for a sum's first gradient. (A retained gradient is committed as a
    copy, so no ``.grad`` shares the buffer's memory.)"""
    buffers, starts = _sweep.rows, _sweep.row_starts  # (set together by sweep_scope)
    if starts is None or type(g) is not np.ndarray or g.dtype != ans.dtype or g.shape != ans.shape:
        return None  # (checked before a buffer is looked up or made: _tanh_vjp_into then fits)
    assert buffers is not None
    group = row_sum.parents[ROW_SUMS[row_sum.op.forward]]
    which = (group, row_sum.key.type, row_sum.key.id)  # (two sums may read one group's rows)
    entry = buffers.get(which)
    if entry is None:
        value = group._value
        if value is None or value.dtype != ans.dtype or value.shape[1:] != ans.shape:
            return None
        entry = buffers[which] = (workspace.empty(value.shape, value.dtype), [None] * len(value))
    buffer, written = entry
    t = row_sum.attrs["index"]
    out = cast(np.ndarray, _tanh_vjp_into(buffer[t], g, ans, None))
    written[t] = out
    if t == 0:  # (what _rows_buffer finds the entry by: a stack's first part)
        starts[id(out)] = entry
    return out


#: VJPs that can write their result into a given array: ``into(out, g, ans, *xs, **attrs)`` returns
#: ``out`` (the VJP's result, the same bits) or ``None`` where it cannot (another shape or dtype,
#: or ``out`` is ``None``).
#: A body program's backward step has one write the gradient it passes on to a loop's row of a
#: hoisted node straight into that row (vgraph.virtual.program), instead of copying it there.
VJPS_INTO: dict[Any, Callable[..., np.ndarray | None]] = {_tanh_vjp: _tanh_vjp_into}

#: Forwards and VJPs whose effect compiled sweeps (vgraph.tape) write out inline instead of calling
#: them, by kind. Forward "row": ``x[attrs["index"]]``; "row + product": ``rows[attrs["index"]] +
#: a @ b`` (``MatMulAddRow``, inputs ``a, b, rows``). VJP "pass": ``g`` itself; "row": ``g`` at
#: basic index ``attrs["index"]`` of the input (an IndexedGrad), which the sweep adds straight into
#: a buffer it owns or appends to the rows it collects (StepRowsGrad); "rows product": the weight
#: gradient of a matrix times a weight matrix (``MatMul``, or ``Linear``'s weight), whose use
#: ``(a, g)`` the sweep appends to the weight's pending RowsProductGrad (what making one and
#: merging it would do); "product a": the gradient of ``x0`` in ``x0 @ x1`` (``_matmul_vjp_a``),
#: called without the other arguments of the op that computes the product with more; "tanh": a
#: ``tanh``'s gradient, written into a row buffer when it goes to a sum of :data:`ROW_SUMS`.
INLINE_FORWARDS: dict[Any, str] = {_hoisted: "row", _matmul_add_row: "row + product"}
INLINE_VJPS: dict[Any, str] = {
    pass_through: "pass",
    _hoisted_vjp: "row",
    _add_row_vjp: "row",  # (the row of ``rows[index] + x``: shaped as ``x`` and the sum)
    _matmul_add_row_vjp_rows: "row",  # (the row of ``rows[index] + a @ b``: likewise)
    _matmul_vjp_b: "rows product",
    _linear_vjp_w: "rows product",  # a layer's weight: the product's VJP (x0 @ x1 + bias)
    _matmul_add_row_vjp_b: "rows product",  # likewise (rows[index] + x0 @ x1)
    _linear_vjp_x: "product a",
    _matmul_add_row_vjp_a: "product a",
    _tanh_vjp: "tanh",  # into a sum's row (see _tanh_vjp_row), else called
}


# ---------------------------------------------------------------------------- fused recurrent cells
# One node per cell and step instead of about fifteen. The input and recurrent projections
# (x @ W_x, h @ W_h) stay MatMul nodes of their own, so that work on them (hoisting x @ W_x out of
# a loop, one stacked weight gradient for a tied W_h) sees them as usual; the cell fuses the bias,
# the gates and the state update.
#
# The node's value is the new state followed by the gate activations, stacked on a new leading
# axis: ``(6, ..., H)`` = [h', c', i, f, g, o] for the LSTM, ``(4, ..., H)`` = [h', r, z, n] for
# the GRU. Each slab is contiguous, so the elementwise passes run at full speed and h' and c' are
# contiguous views for the next step's matmul. The backward needs the activations: keeping them
# in the value costs no work in the forward (it computes them anyway), where recomputing them
# would add about one forward to every backward; it lets a user inspect the gates on the node;
# and the VJP stays exact for every part of the value (a gradient reaching a gate slab counts).
# The cells in vgraph.nn take h' (and c') as GetItem views of it.
#
# Both cells have several differentiable inputs whose gradients come from one joint computation
# (dz is the gradient of x @ W_x, of h @ W_h and of the bias). The engine calls an op's VJPs one
# after another with the same ``g`` and ``ans`` objects, so the first call computes them all and
# the following calls pick theirs up (:class:`_SharedVJP`), instead of each repeating the work.

LSTM_GATES = ("i", "f", "g", "o")
GRU_GATES = ("r", "z", "n")


class _SharedVJP:
    """Per-input VJPs served from one joint gradient computation of all inputs.

    ``joint(g, ans, *xs, **attrs)`` returns one gradient per input. The latest call's result is
    kept, with the ``g`` and ``ans`` it belongs to (held, so that comparing identities is safe),
    until a call with another ``g`` or ``ans`` replaces it: at most one node's gradients are
    held between backward passes. The three are one tuple, read and replaced in one step.
    ``split``: ``(prep, joint_with)`` when ``joint`` is ``joint_with`` of ``prep`` (see
    :func:`split_vjp`), so that a loop can run ``prep`` over many outputs at once. ``slabs``:
    ``(indices, joint_slabs)``, the joint VJP from the gradients of some slabs of the output
    alone (see :func:`slab_vjp`).
    """

    __slots__ = ("joint", "memo", "split", "slabs")

    def __init__(
        self,
        joint: Callable[..., tuple[Any, ...]],
        split: tuple[Callable[..., tuple[np.ndarray, ...]], Callable[..., tuple[Any, ...]]] | None = None,
        slabs: tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]] | None = None,
    ) -> None:
        self.joint = joint
        self.memo: tuple[Any, Any, tuple[Any, ...]] = (None, None, ())
        self.split = split  # (prep, joint_with): see split_vjp
        self.slabs = slabs  # (indices, joint_slabs): see slab_vjp

    def vjp(self, i: int, g: Any, ans: Any, *xs: Any, **attrs: Any) -> Any:
        memo = self.memo
        if memo[0] is not g or memo[1] is not ans:
            memo = self.memo = (g, ans, self.joint(g, ans, *xs, **attrs))
        return memo[2][i]

    def vjps(self, n: int) -> tuple[VJP, ...]:
        """``n`` per-input VJPs in the table's convention ``vjp(g, ans, *xs, **attrs)``."""
        return tuple(_Nth(self, i) for i in range(n))


def joint_vjp(op: Op) -> Callable[..., tuple[Any, ...]] | None:
    """``joint(g, ans, *xs, **attrs)`` giving every input's gradient in one call, for an op whose
    per-input VJPs are served from one joint computation (the fused cells), else ``None``. A caller
    that needs several inputs' gradients calls it once instead of each VJP in turn."""
    vjps = op.vjps
    if op.variadic or op.user or not isinstance(vjps, tuple) or not vjps:
        return None
    first = vjps[0]
    if type(first) is not _Nth or any(type(f) is not _Nth or f.shared is not first.shared for f in vjps):
        return None
    return first.shared.joint


def split_vjp(op: Op) -> tuple[Callable[..., tuple[np.ndarray, ...]], Callable[..., tuple[Any, ...]]] | None:
    """``(prep, joint_with)`` for an op whose joint VJP splits into a part that reads only its
    output and a part that reads the gradient (the LSTM cell: the activations' slopes, and their
    products with ``g``), else ``None``. ``prep(answers)`` takes the outputs of several calls
    stacked on a new axis 0 and returns arrays whose rows (axis 0) are each call's part;
    ``joint_with(part, g, ans, *xs, **attrs)`` is the joint VJP given that call's rows. A loop
    runs ``prep`` once over its iterations' outputs instead of once per iteration; the joint VJP
    is ``joint_with`` of ``prep`` of one output, so both give the same gradients."""
    vjps = op.vjps
    if joint_vjp(op) is None:
        return None
    return cast(_Nth, cast(tuple[Any, ...], vjps)[0]).shared.split


def slab_vjp(op: Op) -> tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]] | None:
    """``(indices, joint_slabs)`` for an op whose output stacks slabs on axis 0 and whose joint
    VJP can be given the gradients of the slabs at ``indices`` alone (the LSTM cell: ``h'`` at
    0 and ``c'`` at 1), else ``None``. ``joint_slabs(part, grads, ans, *xs, **attrs)`` takes one
    gradient per index (``None``: none reached that slab; not all ``None``) and, where the op's
    joint VJP splits (:func:`split_vjp`), this output's part (``None``: computed) and returns
    the joint VJP's gradients for the output gradient that is those slabs' and zero elsewhere;
    given ``out=``, an array, it writes input 0's gradient into it where it fits (the same bits).
    A caller whose gradient of the op's value comes only from views of those slabs (a loop body
    reading ``h'`` and ``c'``) passes them as they are, instead of laying them into zeros."""
    vjps = op.vjps
    if joint_vjp(op) is None:
        return None
    return cast(_Nth, cast(tuple[Any, ...], vjps)[0]).shared.slabs


#: The built-in forwards that take ``out=`` (see :func:`forward_into`).
_FORWARD_INTO: set[Callable[..., Any]] = set()


def forward_into(op: Op) -> bool:
    """Whether ``op``'s forward takes ``out=``: an array sharing no memory with its inputs, into
    which it writes its value and which it returns, where the value's shape and dtype are the
    array's (else it ignores it) — the same bits either way. A loop run as a body program passes
    each iteration's row of one buffer, so that the iterations' values are one array, which its
    backward reads as a block (the fused cells' :func:`split_vjp` parts) and its stacked values
    are views of, not copies stacked anew."""
    return not op.user and op.forward in _FORWARD_INTO


class _Nth:
    """The VJP for input ``i`` of a :class:`_SharedVJP` (a partial that says what it is)."""

    __slots__ = ("shared", "i")

    def __init__(self, shared: _SharedVJP, i: int) -> None:
        self.shared, self.i = shared, i

    def __call__(self, g: Any, ans: Any, *xs: Any, **attrs: Any) -> Any:
        return self.shared.vjp(self.i, g, ans, *xs, **attrs)


def _cell_shapes(op: str, n_gates: int, state: np.ndarray, **pre: np.ndarray) -> tuple[tuple[int, ...], int]:
    """The batch shape and hidden size H of a cell: every ``pre`` array (projections, biases) has
    ``n_gates * H`` columns, the state ``(..., H)``; the batch shape is their broadcast."""
    if state.ndim < 1:
        raise ValueError(f"{op}: the state must have a hidden axis, got a scalar")
    H = state.shape[-1]
    batch = state.shape[:-1]
    same = True
    for what, x in pre.items():
        if x.ndim < 1 or x.shape[-1] != n_gates * H:
            raise ValueError(
                f"{op}: {what} must have {n_gates} * H = {n_gates * H} columns for a state of size "
                f"H = {H}, got shape {x.shape}"
            )
        same = same and (x.ndim == 1 or x.shape[:-1] == batch)
    if same:  # the usual case, without np.broadcast_shapes' cost
        return batch, H
    return np.broadcast_shapes(batch, *(x.shape[:-1] for x in pre.values())), H


def _gate_major(x: np.ndarray, n_gates: int, H: int, batch_ndim: int) -> np.ndarray:
    """``(..., n * H)`` columns [gate 0 | gate 1 | …] seen as ``(n, ..., H)`` (a view), with
    ``...`` left-padded to ``batch_ndim`` axes so that it broadcasts against the state."""
    if x.ndim == 2 and batch_ndim == 1:  # the hot path: (B, n * H) rows
        rows: np.ndarray = x.reshape(x.shape[0], n_gates, H).transpose(1, 0, 2)
        return rows
    shape = (1,) * (batch_ndim - x.ndim + 1) + x.shape[:-1]
    nb = len(shape)
    view: np.ndarray = x.reshape((*shape, n_gates, H)).transpose((nb, *range(nb), nb + 1))
    return view


def _sigmoid_into(out: np.ndarray, x: np.ndarray | None = None) -> None:
    """``out = sigmoid(x)`` (``x`` defaults to ``out``), with the same arithmetic as the Sigmoid
    op, in place in ``out``."""
    np.multiply(out if x is None else x, 0.5, out=out)
    np.tanh(out, out=out)
    out += 1
    out *= 0.5


#: Per (dtype, batch axes, H): the LSTM gates' ``(scale, shift)`` as ``(4, 1, …, 1, H)`` arrays, so
#: that one pass over the four activation slabs computes sigmoid for i, f, o and tanh for g:
#: ``(tanh(scale * z) + shift) * scale`` is ``(tanh(z / 2) + 1) / 2`` (the Sigmoid op's arithmetic)
#: where scale = 1/2, shift = 1, and ``tanh(z)`` exactly where scale = 1, shift = 0. (Full rows of
#: ``H``, not ``(4, 1, …, 1)``: numpy broadcasts a length-1 last axis slowly, and on a batch of
#: one row — a sentence at a time — the three passes then broadcast nothing: 4-5 µs of a step's
#: 16 at H = 50.)
_LSTM_AFFINE: dict[tuple[np.dtype[Any], int, int], tuple[np.ndarray, np.ndarray]] = {}


def _lstm_affine(dtype: np.dtype[Any], batch_ndim: int, H: int) -> tuple[np.ndarray, np.ndarray]:
    key = (dtype, batch_ndim, H)
    found = _LSTM_AFFINE.get(key)
    if found is None:
        shape = (4,) + (1,) * batch_ndim + (H,)
        scale = np.repeat(np.array([0.5, 0.5, 1.0, 0.5], dtype=dtype), H).reshape(shape)
        shift = np.repeat(np.array([1.0, 1.0, 0.0, 1.0], dtype=dtype), H).reshape(shape)
        scale.flags.writeable = shift.flags.writeable = False
        found = _LSTM_AFFINE[key] = (scale, shift)
    return found


def _lstm_cell(
    xw: np.ndarray, hw: np.ndarray, b: np.ndarray, c: np.ndarray, gates: tuple[str, ...] = LSTM_GATES,
    out: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    if c.ndim == 2 and xw.shape == hw.shape == (c.shape[0], 4 * c.shape[1]) and b.shape == xw.shape[1:]:
        batch, H = c.shape[:1], c.shape[1]  # the hot path: (B, H) rows and a bias vector
    else:
        batch, H = _cell_shapes("LSTMCell", 4, c, xw=xw, hw=hw, b=b)
    s = _out_or_new(out, (6, *batch, H), np.result_type(xw, hw, b, c))
    z = xw + hw
    if b.ndim == 1 and z.ndim == 2:  # (a bias as one row: numpy adds a vector to rows slowly)
        np.add(z, b[None], out=z)
    else:
        z = np.add(z, b, out=z) if b.ndim == 1 or b.shape[:-1] == z.shape[:-1] else z + b
    # The activations go gate-major into their slabs, all four in each pass (see _LSTM_AFFINE).
    act = s[2:]
    scale, shift = _lstm_affine(s.dtype, len(batch), H)
    np.multiply(_gate_major(z, 4, H, len(batch)), scale, out=act)
    np.tanh(act, out=act)
    act += shift
    act *= scale
    i, f, g, o = s[2], s[3], s[4], s[5]
    np.multiply(f, c, out=s[1])
    np.multiply(i, g, out=s[0])  # (h's slab as scratch)
    s[1] += s[0]
    np.tanh(s[1], out=s[0])
    s[0] *= o
    return s


def _out_or_new(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """The array a cell's forward or VJP writes its result into: ``out`` where it is a writable
    array of that shape and dtype (see :func:`forward_into`, :func:`slab_vjp`), else a new one."""
    if type(out) is np.ndarray and out.shape == shape and out.dtype == dtype and out.flags.writeable:
        return out
    return np.empty(shape, dtype=dtype)


def _lstm_cell_prep(states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the LSTM cell's VJP reads of its outputs alone, for outputs stacked on axis 0
    (``(T, 6, *batch, H)``): ``tanh(c')``, ``1 - tanh(c')^2`` and the activations' slopes
    ``(T, 4, *batch, H)``: a (1 - a) for the sigmoids, 1 - g^2 = (1 - g)(1 + g) for the tanh."""
    tc = np.tanh(states[:, 1])
    dtc = 1 - tc * tc
    act = states[:, 2:]
    slope = np.subtract(1, act)
    other = act.copy()
    other[:, 2] += 1
    slope *= other
    return tc, dtc, slope


def _lstm_cell_grads_with(
    part: tuple[np.ndarray, np.ndarray, np.ndarray], gs: np.ndarray, s: np.ndarray, xw: np.ndarray,
    hw: np.ndarray, b: np.ndarray, c: np.ndarray, gates: tuple[str, ...] = LSTM_GATES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    return _lstm_grads(part, gs[0], gs[1], gs[2:], s, c)


def _lstm_grads(
    part: tuple[np.ndarray, np.ndarray, np.ndarray], dh: np.ndarray, dc_out: np.ndarray | None,
    d_act: np.ndarray | None, s: np.ndarray, c: np.ndarray, out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The LSTM cell's input gradients from those of h' (``dh``), c' (``dc_out``) and the
    activations' slabs (``d_act``); ``None``: none reached them. The pre-activations' gradient
    (that of ``xw``, ``hw`` and ``b``) is written into ``out`` where its shape and dtype fit."""
    tc, dtc, slope = part
    H = s.shape[-1]
    dc = dh * s[5]
    dc *= dtc
    if dc_out is not None:
        dc += dc_out  # the total gradient of c'
    # Gradients of the activations i, f, g, o (plus any that reached their slabs) …
    da = np.empty(s[2:].shape, dtype=s.dtype)
    np.multiply(dc, s[4:1:-2], out=da[0:3:2])  # di = dc g, dg = dc i
    np.multiply(dc, c, out=da[1])
    np.multiply(dh, tc, out=da[3])
    if d_act is not None:
        da += d_act
    # … times their slopes, written in z's column layout.
    dz = _out_or_new(out, (*s.shape[1:-1], 4 * H), s.dtype)
    np.multiply(da, slope, out=_gate_major(dz, 4, H, dz.ndim - 1))
    return dz, dz, dz, dc * s[3]


def _lstm_cell_grads_slabs(
    part: tuple[np.ndarray, np.ndarray, np.ndarray] | None, grads: tuple[np.ndarray | None, ...],
    s: np.ndarray, xw: np.ndarray, hw: np.ndarray, b: np.ndarray, c: np.ndarray,
    gates: tuple[str, ...] = LSTM_GATES, out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The joint VJP given the gradients of h' and c' alone (see :func:`slab_vjp`)."""
    dh, dc_out = grads
    if part is None:
        part = _lstm_part(s)
    if dh is None:
        dh = np.zeros(s.shape[1:], dtype=cast(np.ndarray, dc_out).dtype)
    return _lstm_grads(part, dh, dc_out, None, s, c, out)


def _lstm_cell_grads(
    gs: np.ndarray, s: np.ndarray, xw: np.ndarray, hw: np.ndarray, b: np.ndarray, c: np.ndarray,
    gates: tuple[str, ...] = LSTM_GATES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    return _lstm_cell_grads_with(_lstm_part(s), gs, s, xw, hw, b, c)


def _lstm_part(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_lstm_cell_prep`'s part of one output ``s``."""
    tc, dtc, slope = _lstm_cell_prep(s[None])
    return tc[0], dtc[0], slope[0]


def _gru_cell(
    xw: np.ndarray, hw: np.ndarray, b_x: np.ndarray, b_h: np.ndarray, h: np.ndarray,
    gates: tuple[str, ...] = GRU_GATES, out: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    batch, H = _cell_shapes("GRUCell", 3, h, xw=xw, hw=hw, b_x=b_x, b_h=b_h)
    s = _out_or_new(out, (4, *batch, H), np.result_type(xw, hw, b_x, b_h, h))
    if xw.ndim == hw.ndim == 2 and b_x.ndim == b_h.ndim == 1:  # (biases as rows: see _lstm_cell)
        gx, gh = xw + b_x[None], hw + b_h[None]
    else:
        gx, gh = xw + b_x, hw + b_h
    gxg, ghg = _gate_major(gx, 3, H, len(batch)), _gate_major(gh, 3, H, len(batch))
    r, z, n = s[1], s[2], s[3]
    np.add(gxg[0:2], ghg[0:2], out=s[1:3])  # r, z = sigmoid(gx + gh)
    _sigmoid_into(s[1:3])
    np.multiply(r, ghg[2], out=n)  # n = tanh(gx_n + r gh_n)
    n += gxg[2]
    np.tanh(n, out=n)
    np.subtract(h, n, out=s[0])  # h' = n + z (h - n) = (1 - z) n + z h
    s[0] *= z
    s[0] += n
    return s


def _gru_cell_grads(
    gs: np.ndarray, s: np.ndarray, xw: np.ndarray, hw: np.ndarray, b_x: np.ndarray, b_h: np.ndarray,
    h: np.ndarray, gates: tuple[str, ...] = GRU_GATES,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    H = s.shape[-1]
    r, z, n = s[1], s[2], s[3]
    dh = gs[0]
    nb = s.ndim - 2
    gh_n = _gate_major(hw, 3, H, nb)[2] + _gate_major(b_h, 3, H, nb)[2]  # recomputed: one add
    d = np.empty(s[1:].shape, dtype=s.dtype)  # gradients of the pre-activations of r, z, n
    dn = d[2]
    np.subtract(1, z, out=dn)
    dn *= dh
    dn += gs[3]
    dn *= 1 - n * n
    np.multiply(dn, gh_n, out=d[0])
    np.subtract(h, n, out=d[1])
    d[1] *= dh
    d[:2] += gs[1:3]
    d[:2] *= s[1:3] * (1 - s[1:3])
    shape = (*s.shape[1:-1], 3 * H)
    dgx = np.empty(shape, dtype=s.dtype)
    dgh = np.empty(shape, dtype=s.dtype)
    dxg, dhg = _gate_major(dgx, 3, H, nb), _gate_major(dgh, 3, H, nb)
    dxg[...] = d
    dhg[:2] = d[:2]
    np.multiply(d[2], r, out=dhg[2])
    return dgx, dgh, dgx, dgh, dh * z


defop(
    "LSTMCell",
    _lstm_cell,
    *_SharedVJP(
        _lstm_cell_grads, (_lstm_cell_prep, _lstm_cell_grads_with), ((0, 1), _lstm_cell_grads_slabs)
    ).vjps(4),
    kind=CELL,
)
defop("GRUCell", _gru_cell, *_SharedVJP(_gru_cell_grads).vjps(5), kind=CELL)
_FORWARD_INTO.update((_lstm_cell, _gru_cell))


# ---------------------------------------------------------------------------- fused losses
# Softmax cross-entropy in one node: per row, the log-sum-exp of the logits (shifted by the row
# maximum) minus the label's logit; the VJP is g * (softmax - onehot), written straight into the
# one array it returns. Unfused (nll_loss of log_softmax) the backward of a (N, V) output layer
# costs a dense (N, V) TakeAlongAxis gradient that is zero but one entry per row, then a
# LogSoftmax VJP that recomputes exp of the whole array and allocates several arrays of its size.
#
# The forward goes over the rows in blocks of about _XENT_BLOCK elements, so that a block's
# shift, exp and sum run while it is in cache. With gradients on it writes exp(x - max) into an
# array the size of the logits that the VJP of its value turns into its result in place (one pass
# in backward, see _XentExp); otherwise one block's scratch is all it allocates. Without kept
# exponentials the VJP recomputes them, blockwise, into the one array it returns, without redoing
# the maximum: the log-sum-exp of a row is its loss plus its label's logit.
_XENT_BLOCK = 1 << 16


def _xent_rows(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``logits`` as ``(N, V)`` rows and ``labels`` as ``N`` non-negative indices, after checking
    the labels (raises TypeError, ValueError or IndexError, which the engine reports as a
    ShapeError naming the node)."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if logits.ndim < 1:
        raise ValueError("logits must have a class axis (the last), got a scalar")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels have shape {labels.shape}; expected {logits.shape[:-1]} for logits of shape {logits.shape}"
        )
    V = logits.shape[-1]
    lab = labels.reshape(-1)
    if lab.size:
        lo, hi = int(lab.min()), int(lab.max())
        if lo < -V or hi >= V:
            bad = lo if lo < -V else hi
            raise IndexError(f"label {bad} is out of range for {V} classes")
        if lo < 0:  # negative labels count from the end, as numpy indices (and TakeAlongAxis) do
            lab = np.where(lab < 0, lab + V, lab)
    x = logits.reshape(-1, V)
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    return x, lab


class _XentExp:
    """The exponentials a forward computed, kept for the VJP of the same value.

    While gradients are on (not under ``no_grad``), the forward writes ``exp(x - max)`` of every
    row into an array the size of the logits and keeps it here with the row sums, keyed by the
    identity of the value it returned (checked with a weak reference, so a recycled ``id`` never
    matches; the entry goes when the value does). The VJP of that value takes the array and turns
    it in place into ``g * softmax - g * onehot``, its result: backward then costs one pass and
    allocates nothing the size of the logits (the buffer is the same size the VJP would otherwise
    allocate, only earlier). Without an entry (a second backward with ``retain_graph``, a forward
    under ``no_grad``, a direct call) the VJP recomputes the softmax from ``ans``.
    """

    entries: ClassVar[dict[int, tuple[weakref.ref[np.ndarray], np.ndarray, np.ndarray]]] = {}

    @classmethod
    def keep(cls, ans: np.ndarray, e: np.ndarray, sums: np.ndarray) -> None:
        key = id(ans)

        def forget(_: object) -> None:
            cls.entries.pop(key, None)

        cls.entries[key] = (weakref.ref(ans, forget), e, sums)

    @classmethod
    def take(cls, ans: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        entry = cls.entries.get(id(ans))
        if entry is None or entry[0]() is not ans:
            return None
        del cls.entries[id(ans)]
        return entry[1], entry[2]


def _softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    x, lab = _xent_rows(logits, labels)
    n, V = x.shape
    out = np.empty(n, dtype=x.dtype)
    step = max(1, _XENT_BLOCK // max(V, 1))
    keep = is_grad_enabled() and n > 0
    # Kept for the VJP, or one block's scratch (rewritten block after block).
    e = np.empty((n, V) if keep else (min(step, n), V), dtype=x.dtype)
    sums = np.empty(n, dtype=x.dtype)
    rows = np.arange(min(step, n))
    for s in range(0, n, step):
        xb = x[s : s + step]
        k = xb.shape[0]
        b = e[s : s + k] if keep else e[:k]
        m = xb.max(axis=1)
        np.subtract(xb, m[:, None], out=b)
        np.exp(b, out=b)
        np.sum(b, axis=1, out=sums[s : s + k])
        # log(sum) - (x_label - max): the same operations, in the same order, as the unfused
        # -log_softmax(x)[label], so the values agree to the last bit; 0 exactly for a label
        # whose logit dominates the row.
        np.log(sums[s : s + k], out=out[s : s + k])
        out[s : s + k] -= xb[rows[:k], lab[s : s + k]] - m
    ans = out.reshape(logits.shape[:-1])
    if keep:
        _XentExp.keep(ans, e, sums)
    return ans


def _softmax_cross_entropy_vjp(
    g: np.ndarray, ans: np.ndarray, logits: np.ndarray, labels: np.ndarray
) -> np.ndarray:
    x, lab = _xent_rows(logits, labels)
    n, V = x.shape
    gr = np.broadcast_to(g, ans.shape).reshape(-1)
    dtype = np.result_type(x.dtype, gr.dtype)
    rows = np.arange(n)
    kept = _XentExp.take(ans)
    if kept is not None and kept[0].dtype == dtype:
        out, sums = kept
        np.multiply(out, (gr / sums)[:, None], out=out)  # g * exp(x - max) / sum = g * softmax
    else:
        out = np.empty((n, V), dtype=dtype)
        lse = ans.reshape(-1) + x[rows, lab]  # log-sum-exp of each row: its loss plus the label's logit
        step = max(1, _XENT_BLOCK // max(V, 1))
        for s in range(0, n, step):
            ob = out[s : s + step]
            np.subtract(x[s : s + step], lse[s : s + step, None], out=ob)
            np.exp(ob, out=ob)  # softmax
            ob *= gr[s : s + step, None]
    out[rows, lab] -= gr
    return out.reshape(logits.shape)


defop("SoftmaxCrossEntropy", _softmax_cross_entropy, _softmax_cross_entropy_vjp, None)
