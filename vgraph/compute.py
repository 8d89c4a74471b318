"""The concrete graph: :class:`ComputeGraph` and :class:`ComputeNode`.

A ComputeGraph is an append-only DAG. Each node is a leaf (``Input``, ``Parameter``,
``Constant``) or the result of a primitive from :mod:`vgraph.ops` applied to earlier nodes; its
value is computed when it is added. Because parents always exist before their children, creation
order is a topological order: every traversal here sorts by a creation serial and never recurses,
so a 100,000-node chain is as easy as a 10-node one.

Forward (seed 001): every node keeps ``value`` and ``version``, a reading of one process-wide
clock taken each time the value is set or recomputed. A node is out of date exactly when a parent's
version is newer than its own (its parents' versions at its last computation were all older, and
versions only grow), so ``forward(target)`` recomputes only nodes whose parents changed, without
storing a list of parent versions per node.

Backward (seed 000): vector-Jacobian products in reverse creation order over the nodes between the
loss and the leaves that require gradients; everything else is pruned. Leaf gradients accumulate
into ``.grad`` until ``zero_grad()``; intermediate gradients are freed as soon as they are passed on.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Reversible, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Any, Literal, NamedTuple, NoReturn, Protocol, cast, overload

import numpy as np

from . import tape as _tape
from .errors import (
    ArgumentError,
    BackwardError,
    GraphStateError,
    NonFiniteError,
    ShapeError,
    StructureChangedError,
    VGraphError,
)
from .functions import Operand
from .modes import _NOTHING
from .modes import anomaly_scope as _anomaly_scope
from .modes import detect_anomaly as detect_anomaly  # (re-exported: compute held the modes before)
from .modes import flag_arg as flag_arg  # (re-exported: the layers above check their options with it)
from .modes import is_anomaly_enabled as is_anomaly_enabled
from .modes import is_grad_enabled as is_grad_enabled
from .modes import no_grad as no_grad
from .modes import state as _modes
from .ops import (
    OPS,
    VJP,
    LazyGrad,
    Op,
    OpResultError,
    RowSparseGrad,
    add_grads,
    add_grads_sparse,
    as_row_sparse,
    reduce_grad,
    sweep_scope,
)
from .workspace import computing


class DroppedValues(Protocol):
    """What a graph whose op values may be dropped gives the engine back: checkpointed loops
    (``vgraph.virtual.checkpoint.Rematerializer``) drop values while unrolling and recompute
    them when a sweep or a reader reaches them. Attached with
    :meth:`ComputeGraph.attach_dropped_values`; the engine calls these and nothing else.
    """

    def value(self, node: ComputeNode) -> Any:
        """``node.value`` of a dropped node (recomputed, kept until another unit is read)."""

    def backward_value(self, node: ComputeNode) -> Any:
        """The value of ``node`` for the backward sweep, its parents' values present."""

    def end_backward(self) -> None:
        """The sweep is over (or failed): release what it brought back."""

    def forward(self, plan: Sequence[ComputeNode], on_dirty: Callable[[ComputeNode], None]) -> None:
        """A dirty-checked forward over ``plan`` that brings dropped parents back first."""


# ---------------------------------------------------------------------------- settings

_default_dtype = np.dtype(np.float32)


def set_default_dtype(dtype: Any) -> None:
    """Set the float dtype new graphs use when none is given (float32 unless changed).

    Raises:
        TypeError: if ``dtype`` is not a floating-point dtype.
    """
    global _default_dtype
    _default_dtype = float_dtype(dtype, "set_default_dtype(dtype)")


def float_dtype(dtype: Any, what: str) -> np.dtype:
    """``dtype`` as a numpy float dtype, or a TypeError naming ``what``."""
    try:
        dt: np.dtype = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: not a dtype ({type(dtype).__name__} {dtype!r}: {e})") from None
    if dt.kind != "f":
        raise TypeError(f"{what} must be a float dtype, got {dt}")
    return dt


def get_default_dtype() -> np.dtype:
    """The float dtype new graphs use when none is given."""
    return _default_dtype


def _finite(x: Any) -> bool:
    """Whether every element of a float array is finite (integer and bool arrays always are)."""
    arr = x.dense() if isinstance(x, LazyGrad) else np.asarray(x)
    return arr.dtype.kind not in "fc" or bool(np.isfinite(arr).all())


def value_summary(x: Any) -> str:
    """Shape, finite status and range of an array, for anomaly messages."""
    arr = np.asarray(x)
    text = f"shape {arr.shape}"
    if arr.dtype.kind not in "fciub" or arr.size == 0:
        return text
    finite = arr[np.isfinite(arr)] if arr.dtype.kind in "fc" else arr
    status = "finite" if finite.size == arr.size else _nonfinite_kind(arr)
    if finite.size:
        text += f", {status}, min {finite.min():.4g}, max {finite.max():.4g}"
    else:
        text += f", {status}"
    return text


def _nonfinite_kind(arr: np.ndarray) -> str:
    kinds = []
    if np.isnan(arr).any():
        kinds.append("NaN")
    if np.isinf(arr).any():
        kinds.append("Inf")
    return "has " + " and ".join(kinds)


def _first_kind(arr: Any) -> str:
    return "NaN" if np.isnan(np.asarray(arr)).any() else "Inf"


# Why an op produced a non-finite value from finite inputs, where the op makes that common.
_ANOMALY_HINTS: dict[str, Callable[..., str | None]] = {
    "Log": lambda x: (
        f"log of a negative input (min {np.min(x):.4g})"
        if np.min(x) < 0
        else "log of zero"
        if np.min(x) == 0
        else None
    ),
    "Div": lambda a, b: "division by zero" if np.any(np.asarray(b) == 0) else None,
    "Exp": lambda x: f"exp overflowed (max input {np.max(x):.4g})",
    "Pow": lambda x, p: "a power of a negative or zero base" if np.min(x) <= 0 else None,
}


# ---------------------------------------------------------------------------- keys and nodes


class NodeKey(NamedTuple):
    """The identity ``<type, id, idx>`` of a compute node.

    ``type`` is the node's kind (``MatMul``, ``Parameter`` …), ``id`` tells apart nodes of one type,
    ``idx`` is the loop iteration path: ``()`` outside loops, ``(2, 5)`` in iteration 5 of an inner
    loop during iteration 2 of the outer one. Printed compactly: ``MatMul:1@2.5``.
    """

    type: str
    id: int
    idx: tuple[int, ...] = ()

    def __str__(self) -> str:
        base = f"{self.type}:{self.id}"
        return f"{base}@{'.'.join(map(str, self.idx))}" if self.idx else base

    @classmethod
    def parse(cls, text: str) -> NodeKey:
        """Read a key printed by ``str(key)``, e.g. ``"MatMul:1@2.5"``.

        Raises:
            ValueError: if ``text`` is not of that form.
        """
        try:
            head, _, idx = text.partition("@")
            type_, id_ = head.rsplit(":", 1)
            return cls(type_, int(id_), tuple(int(i) for i in idx.split(".")) if idx else ())
        except ValueError:
            raise ValueError(f"not a node key: {text!r} (expected e.g. 'MatMul:1' or 'Tanh:2@3')") from None


LEAF_TYPES = ("Input", "Parameter", "Constant")
_clock = itertools.count(1)  # process-wide: leaves are shared by graphs
next_version = _clock.__next__  # a new reading of the clock (a version, or a creation serial)
# Held by every backward sweep (backward, grad), in whatever thread: a sweep stages gradients in
# its nodes' ``_g``, leaves included, and leaves (a VirtualGraph's parameters) are shared by
# graphs, so two sweeps at once would mix their gradients. It also makes each accumulation into a
# shared ``.grad`` whole. Re-entrant: a VJP may run a sweep of its own.
_sweep_lock = threading.RLock()


def _as_value(value: Any, float_dtype: np.dtype) -> np.ndarray:
    """A node value: floats in the graph's dtype; integer and bool arrays (indices, masks) kept."""
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value)
    if isinstance(value, (int, float)):
        return np.asarray(value, dtype=float_dtype)
    try:
        arr = np.asarray(value)
    except ValueError as e:  # numpy refuses ragged nested sequences
        raise ValueError(f"not a rectangular array (nested sequences of different lengths?): {e}") from None
    if arr.dtype.kind == "f" and arr.dtype != float_dtype:
        arr = arr.astype(float_dtype)
    elif arr.dtype.kind not in "fiub":
        raise TypeError(f"a node value must be numeric, got dtype {arr.dtype}")
    return arr


def owned_value(value: Any, arr: np.ndarray) -> np.ndarray:
    """``arr`` (``value`` as :func:`_as_value` made it) as an array no caller can change: a copy
    unless the conversion already made a new array (from a list or a number, or a cast to the
    graph's dtype). The caller's array, a view of it, or the buffer an object exposes through
    ``__array__`` is copied, so a later in-place change of theirs does not reach the graph."""
    if (
        arr is value
        or not arr.flags.owndata
        or not isinstance(value, (np.ndarray, np.generic, list, tuple, int, float))
    ):
        copied: np.ndarray = arr.copy()
        return copied
    return arr


class _GraphRef:
    """How a graph's nodes refer to it: weakly (graph -> node -> graph would make every graph a
    reference cycle that only the cyclic garbage collector frees), through one object the graph
    shares with all its nodes. Calling it gives the graph, or ``None`` once it is gone. A cached
    build handed on to a new graph object (:mod:`vgraph.virtual.cache`) re-points every node by
    re-pointing this one reference."""

    __slots__ = ("ref",)

    def __init__(self, graph: ComputeGraph) -> None:
        self.ref = weakref.ref(graph)

    def __call__(self) -> ComputeGraph | None:
        return self.ref()


class ComputeNode(Operand):
    """One node of a :class:`ComputeGraph`: a leaf or one primitive applied to parent nodes.

    Attributes:
        key: the node's ``<type, id, idx>`` identity.
        name: the user's display name, or ``None``.
        op: the primitive computing it (``None`` for leaves).
        parents: the input nodes, in the op's argument order.
        version: the clock reading of the node's last value change (set or recomputed);
            only ever grows.
        requires_grad: whether backward computes a gradient for this node.
        grad: the accumulated gradient (leaves, and nodes that called ``retain_grad()``).
        sparse_grad: for a 2-D parameter (an embedding table): backward gives ``.grad`` as a
            :class:`~vgraph.ops.RowSparseGrad` holding only the rows that were looked up, when
            every use of the parameter is a row look-up (``take``, ``W[rows]``, ``W[a:b]``); see
            docs/training.md, "Sparse embedding gradients". Set it through
            ``parameter(..., sparse_grad=True)``.
        grad_node: after ``backward(loss, create_graph=True)``: the gradient of that backward
            as a node of the graph (differentiable again, see docs/second_order.md); ``.grad``
            holds its value, added as usual. ``None`` until such a backward reaches the node.
    """

    __slots__ = (
        "key", "name", "op", "parents", "attrs", "vjps", "_value", "version",
        "requires_grad", "grad", "retains_grad", "_graph", "serial", "_g", "_gown", "sparse_grad",
        "grad_node",
    )  # fmt: skip

    def __init__(
        self,
        key: NodeKey,
        value: np.ndarray | None,
        op: Op | None = None,
        parents: tuple[ComputeNode, ...] = (),
        attrs: dict[str, Any] | None = None,
        requires_grad: bool = False,
        name: str | None = None,
        graph: ComputeGraph | None = None,
    ) -> None:
        self.key = key
        self.name = name
        self.op = op
        self.parents = parents
        self.attrs = attrs if attrs else _NO_ATTRS
        # One VJP (or None) per parent. Op.vjps is that tuple for a non-variadic op and the one
        # shared vjp(i, g, ans, *xs) of a variadic op (vgraph.ops._validated_op makes it so).
        self.vjps: tuple[VJP | None, ...]
        if op is None or not op.variadic:
            # (not typing.cast: a function call, and this runs once per node)
            self.vjps = op.vjps if op is not None else ()  # type: ignore[assignment]
        else:
            self.vjps = tuple(partial(cast("VJP", op.vjps), i) for i in range(len(parents)))
        # A leaf's array, or what the op's forward returned (an array, a numpy scalar, a guard's
        # decision); None only while ComputeGraph._add_op has not computed it yet.
        self._value: Any = value
        # One clock for creation order (a topological order) and for value versions.
        self.serial = self.version = next(_clock)
        self.requires_grad = requires_grad
        self.grad: np.ndarray | RowSparseGrad | None = None
        self.retains_grad = False
        # Weakly, through the graph's _GraphRef (see there).
        self._graph = graph._weak_self if graph is not None else None
        self._g: Any = None  # gradient being accumulated during one backward pass
        self._gown = False  # whether _g is an array this pass allocated (safe to add into)
        self.sparse_grad = False
        self.grad_node: ComputeNode | None = None

    @property
    def graph(self) -> ComputeGraph | None:
        """The ComputeGraph this node was created in (``None`` for a free leaf)."""
        return self._graph() if self._graph is not None else None

    # -- value
    @property
    def value(self) -> np.ndarray:
        """The node's current value (as of its last computation), as a read-only view.

        Changing it in place would bypass dirty checking and silently desynchronise the graph
        (and, for a leaf, the values computed from it): set a leaf's value instead
        (``node.value = new``, ``p.value = p.value - lr * p.grad``, or :meth:`set_value`).

        In a checkpointed loop (``g.loop(..., checkpoint=...)``) a value that was not kept is
        recomputed on demand: its unit of iterations is recomputed from the stored state before
        it (about ``k`` iterations' work for ``checkpoint=k``) and stays until another unit is
        read. A node *computed when read* (see :meth:`ComputeGraph.computed_when_read`) computes
        its value from its parents' at every read and keeps none.

        Raises:
            GraphStateError: the value was dropped and the node's graph is gone.
        """
        v = self._value
        if v is None:  # computed when read, or dropped by a checkpointed loop
            v = self._rematerialize()
        return cast(np.ndarray, _readonly(v))  # an op may also give a numpy scalar or a decision

    @value.setter
    def value(self, value: Any) -> None:
        self.set_value(value)

    def _rematerialize(self) -> Any:
        graph = self.graph
        if graph is not None and self in graph._deferred:
            return graph._read_deferred(self)
        remat = graph._remat if graph is not None else None
        if remat is None:
            raise GraphStateError(
                f"{self.describe()} has no value: it was dropped by a checkpointed loop and its graph "
                "is gone (keep a reference to the graph to recompute it)"
            )
        return remat.value(self)

    def set_value(self, value: Any) -> None:
        """Give a leaf a new value and bump its version, so dependent nodes recompute.

        The value is copied: later changes to the caller's array do not reach the graph.

        Raises:
            GraphStateError: if the node is computed by an op (set its inputs instead).
            ShapeError: if a parameter's new value has a different shape.
        """
        self._set(value, copy=True)

    def _set(self, value: Any, copy: bool) -> None:
        """:meth:`set_value`; ``copy=False`` adopts an array nobody else refers to as it is (an
        optimiser's fresh result)."""
        if self.op is not None:
            raise GraphStateError(
                f"{self.describe()} is computed by {self.op.name}; only inputs, parameters and "
                "constants can be set (set the inputs it depends on, then call forward)"
            )
        if self.graph is not None:
            dtype = self.graph.dtype
        else:
            dtype = self._value.dtype if self._value.dtype.kind == "f" else _default_dtype
        arr = _as_value(value, dtype)
        if copy and arr is value:  # the caller's array: a later in-place change must not reach the graph
            arr = arr.copy()
        if self.key.type == "Parameter":
            arr = arr.astype(dtype, copy=False)  # parameters are always floats
        if self.key.type == "Parameter" and arr.shape != self._value.shape:
            raise ShapeError(
                f"{self.describe()}: new value has shape {arr.shape}, the parameter has "
                f"shape {self._value.shape}"
            )
        self._value = arr
        self.version = next(_clock)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the value."""
        v = self._value
        if type(v) is np.ndarray:  # (the common case, without np.shape's dispatch)
            shape: tuple[int, ...] = v.shape
            return shape
        return np.shape(self._described())

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the value."""
        return np.asarray(self._described()).dtype

    def _described(self) -> Any:
        """The value, or for a node computed when read whose work another node computes (a
        partial sum, a fused product: of its sum's shape and dtype) that node's value."""
        v = self._value
        if v is None:
            graph = self.graph
            proxy = graph._deferred.get(self) if graph is not None else None
            return proxy._described() if proxy is not None else self.value
        return v

    @property
    def is_leaf(self) -> bool:
        """Whether the node is an input, parameter or constant (not computed by an op)."""
        return self.op is None

    def retain_grad(self) -> ComputeNode:
        """Keep this intermediate node's gradient in ``.grad`` after backward (for inspection)."""
        self.retains_grad = True
        graph = self.graph
        if graph is not None:
            graph._graded.add(self)
        return self

    def describe(self) -> str:
        """``<key>`` and the display name, as used in error messages."""
        return f"<{self.key}>" + (f" '{self.name}'" if self.name else "")

    def __repr__(self) -> str:
        return f"ComputeNode({self.describe()}, shape={self.shape}, version={self.version})"

    def _apply(self, op: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> ComputeNode:
        graph = self.graph
        if graph is None:  # a free leaf (e.g. from a parameter store): use another input's graph
            graph = next((x.graph for x in inputs if isinstance(x, ComputeNode) and x.graph), None)
            if graph is None:
                raise GraphStateError(
                    f"{self.describe()} belongs to no live ComputeGraph (a free leaf, or its graph "
                    "was discarded): keep a reference to the graph, or add the leaf with add_leaf"
                )
        return graph.apply(op, inputs, attrs)


_NO_ATTRS: dict[str, Any] = {}


def sparse_grad_arg(flag: Any, shape: tuple[int, ...], what: str) -> bool:
    """``flag`` checked as the ``sparse_grad`` setting of a parameter of ``shape``.

    Raises:
        TypeError: ``flag`` is not a bool.
        ShapeError: ``flag`` is true and the parameter is not 2-D (a table of rows).
    """
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{what}: sparse_grad must be True or False, got {type(flag).__name__} {flag!r}")
    if flag and len(shape) != 2:
        raise ShapeError(
            f"{what}: sparse_grad=True needs a 2-D parameter (a table whose rows are looked up, "
            f"e.g. an embedding (num_embeddings, dim)), got shape {tuple(shape)}"
        )
    return bool(flag)


def _readonly(value: Any) -> Any:
    if type(value) is np.ndarray:
        value = value.view()
        value.flags.writeable = False
    return value


_Explanation = list[tuple[NodeKey, tuple[NodeKey, ...]]]  # ForwardReport.explanation, when kept


@dataclass
class ForwardReport:
    """What the last :meth:`ComputeGraph.forward` did.

    Attributes:
        visited: op nodes checked (the target's ancestors, plus structure checks).
        recomputed: op nodes whose parents had changed and were computed again.
        explanation: with ``explain=True``, one ``(node key, changed parent keys)`` per
            recomputed node, in the order they were computed.
    """

    visited: int = 0
    recomputed: int = 0
    explanation: _Explanation | None = field(default=None)

    def __str__(self) -> str:
        lines = [f"recomputed {self.recomputed} of {self.visited} nodes"]
        for key, changed in self.explanation or ():
            lines.append(f"  {key}  <- changed: {', '.join(map(str, changed))}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- the graph


class ComputeGraph:
    """A concrete DAG of compute nodes with dirty-checked forward and VJP backward.

    Build it imperatively (``cg.input``, ``cg.parameter``, Python operators and ``vgraph``
    functions on its nodes) or get one from ``build_compute_graph``.

    Args:
        dtype: the float dtype of values (default: :func:`get_default_dtype`, float32).
    """

    def __init__(self, dtype: Any = None) -> None:
        self.dtype = float_dtype(dtype, "ComputeGraph(dtype=...)") if dtype is not None else _default_dtype
        self._nodes: dict[NodeKey, ComputeNode] = {}
        self._weak_self = _GraphRef(self)
        self._counters: dict[str, int] = {}
        self._guards: list[ComputeNode] = []
        self._forward_plans: dict[tuple[Any, ...], list[ComputeNode]] = {}
        self._backward_plans: dict[int, list[ComputeNode]] = {}
        # Compiled sweeps (vgraph.tape), made on a plan's second sweep: None marks a plan swept once.
        self._forward_tapes: dict[tuple[Any, ...], _tape.ForwardTape | None] = {}
        self._backward_tape: tuple[list[ComputeNode], _tape.BackwardTape | None] | None = None
        self._released = False  # a backward without retain_graph ran since the last forward
        self._stale: str | None = None  # set when a structure check failed
        self._leaves: list[ComputeNode] = []
        # This graph's own nodes (not shared leaves such as parameters) that retain their gradient
        # or were given one by a backward: a cached structure's replay resets them (see
        # vgraph.virtual.cache), as a fresh build starts without.
        self._graded: set[ComputeNode] = set()
        # Nodes whose ancestors were all consistent (no parent newer than its child) when the clock
        # read the value given; ``_ALL`` stands for every node. See _check_values_fresh.
        self._fresh: dict[Any, int] = {}
        self._failed_forward: str | None = None  # what the last forward raised, if it failed
        self.last_forward: ForwardReport | None = None
        # Checkpointed loops' book-keeping (see attach_dropped_values), if any: op nodes of
        # dropped iterations have the value None until it recomputes them.
        self._remat: DroppedValues | None = None
        # Op nodes computed when read (see computed_when_read): no sweep computes them and their
        # value is None. Each with the node whose gradient is its own, or None (a hoisted copy's
        # is a row of its group's, see vgraph.virtual.unrolled).
        self._deferred: dict[ComputeNode, ComputeNode | None] = {}

    @property
    def dropped_values(self) -> DroppedValues | None:
        """The book-keeping of values this graph drops and recomputes (checkpointed loops), or
        ``None`` when it keeps every value."""
        return self._remat

    def attach_dropped_values(self, source: DroppedValues) -> None:
        """Let ``source`` drop and recompute this graph's op values (see :class:`DroppedValues`).

        Raises:
            GraphStateError: the graph has one already.
        """
        if self._remat is not None:
            raise GraphStateError(f"{self!r} already has its dropped values' book-keeping")
        self._remat = source

    def __repr__(self) -> str:
        leaves = len(self._leaves)
        return (
            f"{type(self).__name__}({len(self._nodes)} nodes: {leaves} leaves, "
            f"{len(self._nodes) - leaves} ops; {self.dtype})"
        )

    # -- building
    def _next_key(self, type_: str) -> NodeKey:
        return NodeKey(type_, self._counters.get(type_, 0) + 1, ())

    def _register(self, node: ComputeNode, check_unique: bool = True) -> ComputeNode:
        key = node.key
        if check_unique and key in self._nodes:
            raise GraphStateError(f"the graph already has a node <{key}>")
        self._nodes[key] = node
        if node.op is None:
            self._leaves.append(node)
        if not key.idx and key.id > self._counters.get(key.type, 0):
            self._counters[key.type] = key.id  # ids are taken only by nodes actually added
        return node

    def _leaf(
        self,
        type_: str,
        value: Any,
        name: str | None,
        key: NodeKey | None,
        requires_grad: bool,
        copy: bool = True,
    ) -> ComputeNode:
        key = key if key is not None else self._next_key(type_)
        arr = _as_value(value, self.dtype)
        if copy:
            arr = owned_value(value, arr)
        node = ComputeNode(key, arr, None, (), None, requires_grad, name, self)
        return self._register(node)

    def input(
        self,
        value: Any,
        name: str | None = None,
        key: NodeKey | None = None,
        requires_grad: bool = False,
        *,
        copy: bool = True,
    ) -> ComputeNode:
        """Add an input leaf. Floats are stored in the graph's dtype; integer arrays are kept.

        Args:
            value: the input's value; change it later with ``node.value = ...``.
            name: a display name.
            key: the node's key (default ``<Input, n, ()>``).
            requires_grad: compute a gradient for this input too (e.g. for saliency).
            copy: copy ``value`` if it is already an array of the graph's dtype (the default: the
                caller's later in-place changes do not reach the graph). ``False`` adopts it as it
                is, for an array nobody else refers to (a build's checked copy of a feed): no
                second copy of a large input.
        """
        return self._leaf("Input", value, name, key, requires_grad, copy)

    def parameter(
        self, value: Any, name: str | None = None, key: NodeKey | None = None, sparse_grad: bool = False
    ) -> ComputeNode:
        """Add a trainable leaf (``requires_grad=True``) holding a copy of ``value``.

        Args:
            value: the initial value.
            name: a display name.
            key: the node's key (default ``<Parameter, n, ()>``).
            sparse_grad: keep its gradient row-sparse (a 2-D table; see
                :attr:`ComputeNode.sparse_grad`).

        Raises:
            TypeError: ``sparse_grad`` is not a bool.
            ShapeError: ``sparse_grad=True`` for a value that is not 2-D.
        """
        arr = np.array(value, dtype=self.dtype)
        sparse = sparse_grad_arg(sparse_grad, arr.shape, f"parameter {name or key or ''!s}".rstrip())
        node = self._leaf("Parameter", arr, name, key, True)
        node.sparse_grad = sparse
        return node

    def constant(self, value: Any, name: str | None = None, key: NodeKey | None = None) -> ComputeNode:
        """Add a leaf that never needs a gradient."""
        return self._leaf("Constant", value, name, key, False)

    def add_leaf(self, node: ComputeNode) -> ComputeNode:
        """Make an existing graph-less leaf (e.g. a parameter from a store) usable in this graph.

        Leaves may be shared by several graphs; op nodes belong to one.

        Raises:
            GraphStateError: if ``node`` is not a leaf or its key is taken.
        """
        if node.op is not None:
            raise GraphStateError(f"{node.describe()} is not a leaf; only leaves can be shared")
        if self._nodes.get(node.key) is node:
            return node
        return self._register(node)

    def apply(
        self,
        op: str | Op,
        inputs: Sequence[Any],
        attrs: dict[str, Any] | None = None,
        key: NodeKey | None = None,
        name: str | None = None,
    ) -> ComputeNode:
        """Add a node computing primitive ``op`` on ``inputs`` and compute its value now.

        Args:
            op: a primitive name from :data:`vgraph.ops.OPS` (e.g. ``"MatMul"``) or an ``Op``.
            inputs: parent nodes; numbers and arrays become constants.
            attrs: the op's static arguments (``axis``, ``index`` …).
            key: the node's key (default ``<op, n, ()>``).
            name: a display name.

        Raises:
            ShapeError: numpy cannot apply the op to the inputs' shapes; names the node and shapes.
            GraphStateError: an input is an op node of another graph.
        """
        if isinstance(op, str):
            try:
                op = OPS[op]
            except KeyError:
                raise VGraphError(f"unknown op {op!r}; known ops: {', '.join(sorted(OPS))}") from None
        if op.arity is not None and op.arity != len(inputs):
            raise VGraphError(f"{op.name} takes {op.arity} inputs, got {len(inputs)}")
        if key is None:
            key = self._next_key(op.name)
        elif key in self._nodes:
            raise GraphStateError(f"the graph already has a node <{key}>")
        parents = []
        added = []  # constants made from operands, and shared leaves seen for the first time
        computed = []  # nodes computed when read, computed from now on (a node reads them)
        try:
            for x in inputs:
                if not isinstance(x, ComputeNode):
                    x = self.constant(x)
                    added.append(x)
                elif x.op is None:
                    if self._nodes.get(x.key) is not x:
                        added.append(self.add_leaf(x))
                elif x._graph is not self._weak_self:
                    raise GraphStateError(f"{x.describe()} belongs to another ComputeGraph")
                elif x in self._deferred:
                    proxy = self._deferred[x]
                    if proxy is not None:
                        raise GraphStateError(
                            f"{x.describe()} is computed when read: the build computes {proxy.describe()} "
                            "without it (see ComputeGraph.computed_when_read); compute from "
                            f"{x.describe()}.value, or build with hoist=False"
                        )
                    computed.append(x)
                parents.append(x)
            for x in computed:
                x._value = self._read_deferred(x)
                x.version = next(_clock)
                del self._deferred[x]
            if computed:
                self._forget_plans()
            return self._add_op(op, tuple(parents), attrs, key, name)
        except Exception:
            for x in computed:
                self._defer(x)
            for x in added:  # leave the graph as it was
                del self._nodes[x.key]
                self._leaves.remove(x)
            self._counters["Constant"] = min([self._counters.get("Constant", 0)] + [
                x.key.id - 1 for x in added if x.key.type == "Constant"])  # fmt: skip
            raise

    def _add_op(
        self,
        op: Op,
        parents: tuple[ComputeNode, ...],
        attrs: dict[str, Any] | None,
        key: NodeKey,
        name: str | None,
        value: Any = None,
    ) -> ComputeNode:
        """Add an op node whose parents are known to be usable here and whose key is free.

        The hot path of unrolling: :meth:`apply` validates, then calls this. ``value``: the node's
        value, already computed by the caller exactly as ``op`` computes it (not computed again,
        except under anomaly detection, which checks what an op computes).
        """
        requires_grad = False
        if _modes.grad:
            if op.variadic:
                for p in parents:
                    if p.requires_grad:
                        requires_grad = True
                        break
            else:  # a non-variadic op's vjps: one VJP or None per input (see ComputeNode)
                for p, f in zip(parents, op.vjps):  # type: ignore[arg-type]  # (no cast call per node)
                    if f is not None and p.requires_grad:
                        requires_grad = True
                        break
        node = ComputeNode(key, None, op, parents, attrs, requires_grad, name, self)
        if _modes.anomaly:  # (computed again, and checked)
            node._value = self._run(node)
        elif value is not None:
            node._value = value
        else:
            try:  # the op called directly (what _run does, without its checks)
                node._value = (
                    op.forward(*map(_get_value, parents), **attrs)
                    if attrs
                    else op.forward(*map(_get_value, parents))
                )
            except Exception as e:
                self._raise_op_error(node, e)
        return self._register(node, check_unique=False)

    def _defer(self, node: ComputeNode, proxy: ComputeNode | None = None) -> None:
        """Make op node ``node``, which nothing in the graph reads, computed when read (see
        :meth:`computed_when_read`). ``proxy``: a sum that a build computes without ``node`` (its
        partial sum, or a product it computes itself); ``node``'s gradient is then ``proxy``'s
        (same shape and dtype)."""
        node._value = None
        self._deferred[node] = proxy

    def _read_deferred(self, node: ComputeNode) -> Any:
        """The value of a node computed when read: from its parents' values (computed when read in
        turn if they are so), kept nowhere.

        A node whose work another node computes (a partial sum, a fused product: its *proxy*, see
        :meth:`_defer`) gets the value that node's last computation used, if nothing it is
        computed from changed since; otherwise, if all that it is computed from is up to date, the
        value a forward would compute now (after a forward *to* it, say).

        Raises:
            GraphStateError: neither: what it is computed from changed since its proxy was
                computed and some of it is out of date (a parameter changed by an optimiser step
                without a forward since), so its value would mix old and new values — one no
                forward computed.
        """
        op = cast(Op, node.op)  # only op nodes are computed when read
        proxy = self._deferred.get(node)
        if proxy is not None and self._changed_since(node, proxy.version):
            self._refuse_mixed(node)
        try:
            return op.forward(*[p.value for p in node.parents], **node.attrs)
        except Exception as e:
            self._raise_op_error(node, e)

    def _changed_since(self, node: ComputeNode, version: int) -> bool:
        """Whether a value that ``node``, computed when read, is computed from (through nodes
        computed when read) changed after clock reading ``version``."""
        deferred, stack = self._deferred, [node]
        while stack:
            for p in stack.pop().parents:
                if p in deferred:
                    stack.append(p)
                elif p.version > version:
                    return True
        return False

    def _refuse_mixed(self, node: ComputeNode) -> None:
        """Raise if some value that node computed when read is computed from is out of date (see
        :meth:`_read_deferred`)."""
        stale = self._stale_ancestor(node)
        if stale is not None:
            raise GraphStateError(
                f"{node.describe()} keeps no value (it is computed when read, see "
                "ComputeGraph.computed_when_read), and computing it now would mix old and new "
                f"values: {stale.describe()} is stale, {self._staleness(stale)} Run forward first "
                f"(cg.forward({node.key!s}) or, for a build, cg.forward()); build with hoist=False "
                "to keep every value as the last forward computed it"
            )

    def computed_when_read(self, node: ComputeNode) -> bool:
        """Whether ``node`` is *computed when read*: it keeps no value, ``.value`` computes it from
        its parents' values at every read, and no forward computes it.

        A build makes such nodes where nothing in the graph reads an unrolled node (see
        :mod:`vgraph.virtual.hoist`): the copy ``<MatMul:1@t>`` of a loop's hoisted ``x_t @ W_x``
        when only hoisted work reads it (row ``t`` of the group ``<MatMul*:1>``, which every
        forward keeps up to date), and the partial sum ``x_t @ W_x + h @ W_h`` of ``x_t @ W_x + h
        @ W_h + b``, which the build computes as ``(x_t @ W_x + b) + h @ W_h``, the bias added once
        for all steps, with ``h @ W_h`` too when nothing else reads it (then also computed when
        read). Each keeps its key and parents; a forward *to* it computes its parents; its
        gradient (``retain_grad``, :meth:`grad`) is what the plain unroll gives it (its group's
        row; the whole sum's gradient), and a backward from it works as from any node. A node that
        :meth:`apply` reads becomes an ordinary node, except a partial sum or a product (it
        raises).
        ``build(..., hoist=False)`` makes none.

        A partial sum's (or product's) value is the one its sum used, as long as what it is
        computed from has not changed since the sum was computed; after a forward *to* it, the new
        one. Where a forward left part of what it is computed from out of date and recomputed the
        rest (a forward to outputs that do not read the sum; a parameter changed since), reading
        it raises a GraphStateError rather than mix old and new values.

        Raises:
            ArgumentError: ``node`` is not a ComputeNode (a TypeError).
            GraphStateError: ``node`` is not a node of this graph.
        """
        return self._node_arg(node, "node", "computed_when_read") in self._deferred

    def guard(
        self,
        inputs: Sequence[ComputeNode],
        check: Callable[..., Any],
        key: NodeKey,
        name: str | None = None,
    ) -> ComputeNode:
        """Record a data-dependent structural decision so that forward re-checks it.

        ``check(*input_values)`` runs now and on every forward in which an input changed; it
        returns the decision (kept as the node's value) or raises
        :class:`~vgraph.errors.StructureChangedError` if new values would change it. Every forward
        runs the graph's guards, so a stale structure is never silently computed.
        """
        op = Op(key.type, check, (None,) * len(inputs), arity=len(inputs))
        node = self.apply(op, inputs, None, key, name)
        self._guards.append(node)
        return node

    def _run(self, node: ComputeNode) -> Any:
        """Compute ``node``'s value from its parents' current values."""
        values = [p._value for p in node.parents]
        op = cast(Op, node.op)  # only op nodes are computed
        try:
            result = op.forward(*values, **node.attrs)
        except Exception as e:
            self._raise_op_error(node, e)
        if _modes.anomaly and not _finite(result):
            raise _forward_anomaly(node, values, result)
        return result

    def _raise_op_error(self, node: ComputeNode, e: Exception) -> NoReturn:
        """Raise for ``e``, raised by ``node``'s op on its parents' current values: a vgraph error
        as it is (a structure check's also marks the graph stale), a numpy error as a ShapeError
        naming the node and its inputs' shapes, anything else as it is."""
        if isinstance(e, StructureChangedError):
            self._stale = str(e)
        if isinstance(e, OpResultError):  # a vgraph.defop op's forward returned complex values, say
            raise e.error(f"{node.describe()}: {e}") from None
        if isinstance(e, VGraphError) or not isinstance(e, (ValueError, IndexError, TypeError)):
            raise e
        hoisted = _hoisted_op_error(node, e)  # a hoisted group: which iteration's copy fails
        if hoisted is not None:
            raise hoisted from e
        op = cast(Op, node.op)  # only op nodes are computed
        shapes = ", ".join(f"{p.describe()} {np.shape(p._value)}" for p in node.parents)
        raise ShapeError(f"{node.describe()}: cannot compute {op.name} of {shapes}: {e}") from e

    # -- look-up
    def node(self, key: NodeKey | str) -> ComputeNode:
        """The node with ``key`` (a :class:`NodeKey` or its printed form, e.g. ``"Tanh:1@3"``).

        Raises:
            VGraphError: if the graph has no such node.
        """
        try:
            k = NodeKey.parse(key) if isinstance(key, str) else key
        except ValueError as e:
            raise VGraphError(str(e)) from None
        try:
            return self._nodes[k]
        except KeyError:
            raise VGraphError(f"the graph has no node <{k}>") from None

    def __getitem__(self, key: NodeKey | str) -> ComputeNode:
        return self.node(key)

    def __contains__(self, key: object) -> bool:
        """Whether the graph has a node with this key (a :class:`NodeKey` or its printed form);
        ``False`` for anything that is not a key."""
        if isinstance(key, str):
            try:
                key = NodeKey.parse(key)
            except ValueError:
                return False
        return isinstance(key, tuple) and key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def per_node(self) -> ComputeGraph:
        """This graph with a node of its own for every unrolled node: the graph itself (an
        UnrolledGraph whose loops ran as body programs returns its per-node form)."""
        return self

    def _counterpart(self, graph: ComputeGraph, node: ComputeNode) -> ComputeNode:
        """``node`` of this graph in ``graph``, its :meth:`per_node` form (the node itself here)."""
        return node

    def nodes(self) -> list[ComputeNode]:
        """All nodes, in creation (topological) order."""
        return sorted(self._nodes.values(), key=_by_serial)

    def parameters(self) -> list[ComputeNode]:
        """The leaves that require gradients, in creation order."""
        return [n for n in self.nodes() if n.op is None and n.requires_grad]

    # -- traversal
    @staticmethod
    def _ancestors(targets: Iterable[ComputeNode]) -> list[ComputeNode]:
        """``targets`` and everything they depend on, in topological (creation) order."""
        seen: set[ComputeNode] = set()
        stack = list(targets)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(n.parents)
        return sorted(seen, key=_by_serial)

    def _forward_plan(self, targets: tuple[ComputeNode, ...]) -> list[ComputeNode]:
        cache_key = (*targets, len(self._guards))
        plan = self._forward_plans.get(cache_key)
        if plan is None:
            plan = computed_ops(self._ancestors((*targets, *self._guards)), self._deferred)
            self._forward_plans[cache_key] = plan
        return plan

    def _forward_tape(self, targets: tuple[ComputeNode, ...]) -> _tape.ForwardTape | None:
        """The compiled forward of ``targets``' plan, from its second forward on (else ``None``)."""
        key = (*targets, len(self._guards))
        if key not in self._forward_tapes:
            self._forward_tapes[key] = None  # swept once: the next forward compiles it
            return None
        tape = self._forward_tapes[key]
        if tape is None:
            tape = self._forward_tapes[key] = _tape.ForwardTape(self._forward_plan(targets))
        return tape

    def _backward_plan(self) -> list[ComputeNode]:
        """Every node that requires a gradient, in reverse topological order.

        Nodes are registered after their parents, so the reverse of insertion order is a reverse
        topological order, with no graph walk. Nodes off the loss's paths are skipped cheaply
        during the sweep (no gradient reaches them).
        """
        plan = self._backward_plans.get(len(self._nodes))
        if plan is None:
            plan = backward_order(self._nodes.values(), self._deferred)
            self._backward_plans = {len(self._nodes): plan}
        return plan

    def _sweep_plan(self, roots: Iterable[ComputeNode]) -> list[ComputeNode]:
        """The backward plan of a sweep from ``roots``: :meth:`_backward_plan`, or where a root is
        computed when read, every node that requires a gradient (its gradient reaches nodes
        computed when read that it reads; such a sweep is rare and runs interpreted)."""
        if self._deferred_roots(roots):
            return backward_order(self._nodes.values(), {})
        return self._backward_plan()

    def _deferred_roots(self, roots: Iterable[ComputeNode]) -> list[ComputeNode]:
        """The nodes among ``roots`` that are computed when read (usually none)."""
        deferred = self._deferred
        return [r for r in roots if r in deferred] if deferred else []

    def _use_backward_plan(self, plan: list[ComputeNode], tape: _tape.BackwardTape | None) -> None:
        """Make ``plan`` the backward plan of the current node list, with its compiled sweep
        ``tape`` from the first backward on (a caller that built both from parts it keeps:
        vgraph.virtual.elastic)."""
        self._backward_plans = {len(self._nodes): plan}
        self._backward_tape = (plan, tape)

    def _forget_plans(self) -> None:
        """Drop every plan and compiled sweep made so far. Plans are keyed by the targets and the
        node count, which nodes being added keeps apart; a node list changed any other way
        (vgraph.virtual.elastic) must call this."""
        self._forward_plans.clear()
        self._forward_tapes.clear()
        self._backward_plans.clear()
        self._backward_tape = None

    # -- arguments
    _NODE_ARG = "a ComputeNode of this graph"

    def _resolve(self, x: Any) -> Any:
        """Map what a caller may pass for a node to the node (a hook for UnrolledGraph)."""
        return x

    def _node_arg(self, x: Any, arg: str, fn: str) -> ComputeNode:
        """``x`` as a node of this graph, or an ArgumentError (a TypeError) / GraphStateError naming
        the argument."""
        node = self._resolve(x)
        if not isinstance(node, ComputeNode):
            hint = f" (look a node up by its key with cg.node({x!r}))" if isinstance(x, str) else ""
            raise ArgumentError(
                f"{fn}(): {arg} must be {self._NODE_ARG}, got {type(x).__name__} {x!r:.80}{hint}"
            )
        if self._nodes.get(node.key) is not node:
            raise GraphStateError(f"{fn}(): {node.describe()} is not a node of this graph")
        return node

    def _nodes_arg(self, x: Any, arg: str, fn: str) -> tuple[ComputeNode, ...]:
        """One node or a list/tuple of nodes, each checked by :meth:`_node_arg`."""
        if isinstance(x, (list, tuple)) and not isinstance(x, NodeKey):
            if not x:
                raise ValueError(f"{fn}(): {arg} is empty")
            return tuple(self._node_arg(y, arg, fn) for y in x)
        return (self._node_arg(x, arg, fn),)

    # -- forward
    @computing
    def forward(
        self,
        target: ComputeNode | Sequence[ComputeNode],
        explain: bool = False,
        detect_anomaly: bool = False,
    ) -> np.ndarray | list[np.ndarray]:
        """Bring ``target`` up to date, recomputing only nodes whose parents changed.

        Also re-checks the graph's recorded structural decisions (see :meth:`guard`). What was
        done is in :attr:`last_forward`.

        Args:
            target: a node or a list of nodes.
            explain: record, for each recomputed node, which parents had changed.
            detect_anomaly: raise at the first NaN/Inf value (see :func:`detect_anomaly`).

        Returns:
            The target's value (a list of values for a list of targets).

        Raises:
            TypeError: ``target`` is not a node (or list of nodes).
            StructureChangedError: new values would change a loop's trip count or a branch choice;
                the graph must be rebuilt for them. Backward is refused until a forward succeeds
                again (e.g. after the old values are restored).
            ShapeError: an op cannot be computed on the new values (names the node). Nodes computed
                before it keep their new values; backward is refused until a forward succeeds.
            NonFiniteError: with anomaly detection, the first node whose value is NaN/Inf.
        """
        targets = self._nodes_arg(target, "target", "forward")
        explain = flag_arg(explain, "forward(explain=...)")
        detect_anomaly = flag_arg(detect_anomaly, "forward(detect_anomaly=...)")
        plan = self._forward_plan(targets)
        report = ForwardReport(visited=len(plan), explanation=[] if explain else None)
        recomputed = 0
        run = self._run
        try:
            with _anomaly_scope(detect_anomaly):
                if self._remat is not None:
                    recomputed = self._forward_dropped(plan, report)
                    plan = []
                elif not explain and not _modes.anomaly and _tape.tapes_enabled():
                    tape = self._forward_tape(targets)
                    if tape is not None:
                        try:
                            recomputed = tape(next_version)
                        except Exception as e:
                            self._raise_tape_error(plan, e)
                        plan = []
                for n in plan:
                    version = n.version
                    for p in n.parents:
                        if p.version > version:
                            break  # a parent changed after n was computed
                    else:
                        continue
                    if explain:
                        changed = tuple(p.key for p in n.parents if p.version > version)
                        cast("_Explanation", report.explanation).append((n.key, changed))  # a list: explain
                    n._value = run(n)
                    n.version = next(_clock)
                    recomputed += 1
        except BaseException as e:
            self._failed_forward = f"{type(e).__name__}: {e}"
            raise
        report.recomputed = recomputed
        self.last_forward = report
        self._released = False
        self._stale = None  # every structure check passed: values and structure agree again
        self._failed_forward = None
        self._mark_fresh(targets)
        if isinstance(target, (list, tuple)):
            return [t.value for t in targets]
        return targets[0].value

    def _raise_tape_error(self, plan: Sequence[ComputeNode], e: Exception) -> NoReturn:
        """Raise for ``e``, raised inside a compiled forward over ``plan``: the node that raised is
        the first one still out of date (the sweep recomputed every earlier one)."""
        for n in plan:
            version = n.version
            for p in n.parents:
                if p.version > version:
                    self._raise_op_error(n, e)
        raise e  # not an op's error (cannot happen: every line of a forward tape computes a node)

    def _forward_dropped(self, plan: list[ComputeNode], report: ForwardReport) -> int:
        """The forward loop for a graph with checkpointed loops: dropped values that a
        recomputed node reads are brought back first, and dropped again unit by unit."""
        explanation = report.explanation
        run = self._run
        count = 0

        def recompute(n: ComputeNode) -> None:
            nonlocal count
            if explanation is not None:
                changed = tuple(p.key for p in n.parents if p.version > n.version)
                explanation.append((n.key, changed))
            n._value = run(n)
            n.version = next(_clock)
            count += 1

        cast(DroppedValues, self._remat).forward(plan, recompute)  # forward calls this only when set
        return count

    def _mark_fresh(self, targets: Iterable[Any]) -> None:
        """Record that the ancestors of ``targets`` (``[_ALL]``: every node) are consistent now."""
        if len(self._fresh) > 64:
            self._fresh.clear()
        now = next(_clock)
        for t in targets:
            self._fresh[t] = now

    def _check_values_fresh(self, roots: Sequence[ComputeNode], action: str) -> None:
        """Refuse a backward that would read a value older than the values it was computed from.

        A node is up to date when no parent's version is newer than its own (versions are clock
        readings, see the module docstring). Checking that for every ancestor of the roots costs
        what a forward with nothing to recompute costs, so a cheaper test comes first: if the
        roots were known consistent at some clock reading (after a build, a forward of them, or
        an earlier check) and no leaf of the graph changed since, nothing can have gone stale —
        op nodes change only by a forward, which recomputes only below a changed leaf.

        Raises:
            GraphStateError: naming the first stale node, the change that made it stale, and what
                to do.
        """
        stale = self._first_stale(roots)
        if stale is not None:
            raise self._stale_error(stale, roots[0], action)

    def _known_fresh(self, roots: Sequence[ComputeNode]) -> bool:
        """Whether ``roots`` were known consistent at some clock reading (a build, a forward of
        them, an earlier check) with no leaf changed since (see :meth:`_check_values_fresh`)."""
        newest = max([leaf.version for leaf in self._leaves], default=0)
        fresh = self._fresh
        return newest <= fresh.get(_ALL, 0) or all(newest <= fresh.get(r, 0) for r in roots)

    def _first_stale(self, roots: Sequence[ComputeNode]) -> ComputeNode | None:
        """The first out-of-date node a forward to ``roots`` would compute, or None (see
        :meth:`_check_values_fresh`)."""
        if self._known_fresh(roots):
            return None
        for n in self._forward_plan(tuple(roots)):
            version = n.version
            for p in n.parents:
                if p.version > version:
                    return n
        self._mark_fresh(roots)
        return None

    def _stale_ancestor(self, node: ComputeNode) -> ComputeNode | None:
        """An out-of-date op node among ``node``'s ancestors, or None: :meth:`_first_stale` for a
        value read, which walks only as far as the first stale node it meets and makes and keeps
        no plan (a reader going through every node computed when read, the explorer after an
        optimiser step, would otherwise make one plan of a loop's whole past per node)."""
        if self._known_fresh([node]):
            return None
        deferred, seen = self._deferred, set()
        stack = list(node.parents)
        while stack:
            n = stack.pop()
            if n.op is None or n in seen:
                continue
            seen.add(n)
            if n not in deferred:  # (a node computed when read is as current as what it reads)
                version = n.version
                for p in n.parents:
                    if p.version > version:
                        return n
            stack.extend(n.parents)
        self._mark_fresh([node])
        return None

    def _stale_error(self, node: ComputeNode, root: ComputeNode, action: str) -> GraphStateError:
        return GraphStateError(
            f"{action} from {root.describe()} would read out-of-date values: {node.describe()} is "
            f"stale, {self._staleness(node)} Run forward first (cg.forward({root.key!s}) or, for a "
            f"build, cg.forward()), then {action}."
        )

    def _staleness(self, node: ComputeNode) -> str:
        """Why out-of-date ``node`` is: the change that made it so (a sentence): a changed leaf it
        reads, else a changed leaf among its ancestors (a walk of them: only when an op parent was
        recomputed, not on the common path of a value read after an optimiser step)."""
        changed = sorted(
            (p for p in node.parents if p.op is None and p.version > node.version), key=attrgetter("version")
        ) or sorted(
            (a for a in self._ancestors([node]) if a.op is None and a.version > node.version),
            key=attrgetter("version"),
        )
        if changed:
            leaf = changed[-1]
            verb = {"Input": "was fed", "Parameter": "was changed (e.g. by an optimiser step)"}
            what = f"{leaf.describe()} {verb.get(leaf.key.type, 'was set')} after {node.describe()} was last computed"
            if len(changed) > 1:
                what += f" (and {len(changed) - 1} other leaf value(s) changed)"
        else:  # an op parent recomputed by a forward that did not reach this node
            parent = next(p for p in node.parents if p.version > node.version)
            what = f"{parent.describe()} was recomputed by a later forward that did not reach it"
        failed = (
            f" The last forward failed part-way ({self._failed_forward}), so some nodes have new "
            "values and others old ones."
            if self._failed_forward
            else ""
        )
        return f"{what}.{failed}"

    def _check_fresh(self) -> None:
        if self._stale is not None:
            raise StructureChangedError(
                f"this compute graph's values are from a forward that failed ({self._stale}); "
                "rebuild the graph for the new inputs, or restore them and run forward"
            )

    # -- backward
    def backward(
        self, loss: ComputeNode, seed: Any = None, *, detect_anomaly: bool = False, create_graph: bool = False
    ) -> float | None:
        """Backpropagate from ``loss`` and accumulate gradients into the leaves' ``.grad``.

        Shorthand for ``backward_ex(loss, seed, retain_graph=False)``. Gradients accumulate across
        calls: call :meth:`zero_grad` (or the optimiser's) between steps.

        Backward never runs a forward by itself and never reads a stale value: if an input was
        fed, a parameter changed, or a forward failed part-way since the values were computed, it
        raises and says so (see docs/decisions.md, "Stale values").

        Args:
            loss: a scalar node; or any node together with ``seed``.
            seed: the gradient of the final objective with respect to ``loss`` (shape of ``loss``);
                required when ``loss`` is not a scalar.
            detect_anomaly: raise at the first NaN/Inf gradient (see :func:`detect_anomaly`).
            create_graph: record the gradient computation as nodes of this graph (see
                docs/second_order.md): each leaf's gradient is then also a node, in its
                ``.grad_node``, that can be used in a further loss and differentiated again;
                ``.grad`` gets its value, as usual. ``seed`` may then be a node. The graph is not
                released (as with ``retain_graph=True``).

        Returns:
            The loss value as a float (``None`` for a non-scalar ``loss``).

        Raises:
            TypeError: ``loss`` is not a node.
            ShapeError: ``loss`` is not a scalar and no seed was given, or the seed's shape differs.
            GraphStateError: a second backward without a forward in between; ``loss`` does not
                depend on anything that requires a gradient; or a value backward would read is
                out of date (names the node and what changed).
            BackwardError: a VJP raised (names the node); no ``.grad`` was changed.
            NonFiniteError: with anomaly detection, the first NaN/Inf gradient.
            SecondOrderError: with ``create_graph``, a node whose gradient cannot be recorded
                (an op without a differentiable VJP; names the node); nothing was changed.
        """
        detect_anomaly = flag_arg(detect_anomaly, "backward(detect_anomaly=...)")
        return self.backward_ex(
            loss, seed, retain_graph=False, detect_anomaly=detect_anomaly, create_graph=create_graph
        )

    @computing
    def backward_ex(
        self,
        loss: ComputeNode,
        seed: Any = None,
        retain_graph: bool = False,
        *,
        detect_anomaly: bool = False,
        create_graph: bool = False,
    ) -> float | None:
        """Like :meth:`backward`; with ``retain_graph=True`` the graph can be backpropagated again
        without a new forward (e.g. to accumulate the gradients of several losses)."""
        loss = self._node_arg(loss, "loss", "backward")
        retain_graph = flag_arg(retain_graph, "backward_ex(retain_graph=...)")
        detect_anomaly = flag_arg(detect_anomaly, "backward_ex(detect_anomaly=...)")
        if create_graph is not False and flag_arg(create_graph, "backward(create_graph=...)"):
            self._backward_recorded(loss, seed, detect_anomaly)
        else:
            self._check_can_backward(loss)
            g = self._seed(loss, seed)
            self._check_values_fresh((loss,), "backward")
            with _sweep_lock, _anomaly_scope(detect_anomaly), sweep_scope(), self._values_for_sweep([loss]):
                self._backprop(self._sweep_plan([loss]), [(loss, g)], accumulate=True)
            self._released = not retain_graph
        value = loss._value if loss._value is not None else loss.value  # checkpointed: recomputed
        if type(value) is np.ndarray:  # (the common case, without numpy's Python-level wrappers)
            return float(value.reshape(())) if value.size == 1 else None
        return float(np.reshape(value, ())) if np.size(value) == 1 else None

    @overload
    def grad(
        self,
        outputs: ComputeNode | Sequence[ComputeNode],
        inputs: ComputeNode | Sequence[ComputeNode],
        seeds: Any = None,
        retain_graph: bool = False,
        allow_unused: bool = False,
        *,
        detect_anomaly: bool = False,
        create_graph: Literal[False] = False,
    ) -> list[np.ndarray | None]: ...

    @overload
    def grad(
        self,
        outputs: ComputeNode | Sequence[ComputeNode],
        inputs: ComputeNode | Sequence[ComputeNode],
        seeds: Any = None,
        retain_graph: bool = False,
        allow_unused: bool = False,
        *,
        detect_anomaly: bool = False,
        create_graph: Literal[True],
    ) -> list[ComputeNode | None]: ...

    @overload
    def grad(
        self,
        outputs: ComputeNode | Sequence[ComputeNode],
        inputs: ComputeNode | Sequence[ComputeNode],
        seeds: Any = None,
        retain_graph: bool = False,
        allow_unused: bool = False,
        *,
        detect_anomaly: bool = False,
        create_graph: bool,
    ) -> list[np.ndarray | None] | list[ComputeNode | None]: ...

    @computing
    def grad(
        self,
        outputs: ComputeNode | Sequence[ComputeNode],
        inputs: ComputeNode | Sequence[ComputeNode],
        seeds: Any = None,
        retain_graph: bool = False,
        allow_unused: bool = False,
        *,
        detect_anomaly: bool = False,
        create_graph: bool = False,
    ) -> list[np.ndarray | None] | list[ComputeNode | None]:
        """Gradients of ``outputs`` with respect to ``inputs``, returned and not accumulated.

        Like ``torch.autograd.grad``: no ``.grad`` is touched. Inputs may be leaves or
        intermediate nodes.

        Args:
            outputs: a node or nodes (scalars, or with ``seeds``).
            inputs: nodes that require gradients.
            seeds: one seed per output (``None`` for scalar outputs).
            retain_graph: allow another backward without a new forward.
            allow_unused: give ``None`` for an input the outputs do not depend on (differentiably)
                instead of raising.
            detect_anomaly: raise at the first NaN/Inf gradient (see :func:`detect_anomaly`).
            create_graph: record the gradient computation as nodes of this graph and return the
                gradients as nodes, which can be used in a further loss and differentiated again
                (see docs/second_order.md). Seeds may then be nodes too. The graph is not released.

        Returns:
            One array per input, shaped like the input's value (``None`` for an unused input with
            ``allow_unused=True``); with ``create_graph``, one node per input instead.

        Raises:
            TypeError: an output or input is not a node.
            GraphStateError: an input does not require gradients, is not used by the outputs
                (without ``allow_unused``), the graph was released, or a value is out of date.
            BackwardError, NonFiniteError, SecondOrderError: as for :meth:`backward`.
        """
        outs = self._nodes_arg(outputs, "outputs", "grad")
        ins = self._nodes_arg(inputs, "inputs", "grad")
        retain_graph = flag_arg(retain_graph, "grad(retain_graph=...)")
        allow_unused = flag_arg(allow_unused, "grad(allow_unused=...)")
        detect_anomaly = flag_arg(detect_anomaly, "grad(detect_anomaly=...)")
        if seeds is None:
            seeds = [None] * len(outs)
        elif len(outs) == 1 and not isinstance(seeds, (list, tuple)):
            seeds = [seeds]
        if len(seeds) != len(outs):
            raise ValueError(f"grad(): {len(seeds)} seeds for {len(outs)} outputs")
        for x in ins:
            if not x.requires_grad:
                raise GraphStateError(
                    f"{x.describe()} does not require a gradient; create it with requires_grad=True "
                    "(inputs) or outside no_grad()"
                )
        self._check_fresh()
        if self._released:
            self._raise_released(outs[0])
        if create_graph is not False and flag_arg(create_graph, "grad(create_graph=...)"):
            from . import higher  # (the same layer; higher builds on this module)

            with _sweep_lock, _anomaly_scope(detect_anomaly):
                return higher.grad(self, outs, ins, seeds, allow_unused)
        roots = [(o, self._seed(o, s)) for o, s in zip(outs, seeds) if o.requires_grad]
        if roots:
            self._check_values_fresh([o for o, _ in roots], "grad")
        wanted = set(ins)
        plan = self._sweep_plan([o for o, _ in roots]) if roots else []
        # Prune to the nodes on a path to a wanted input, or to a node a wanted gradient is taken from.
        reach = wanted | self._gradient_sources(wanted).keys()
        for n in reversed(plan):
            if n not in reach and any(p in reach for p in n.parents):
                reach.add(n)
        plan = [n for n in plan if n in reach]
        with _sweep_lock, _anomaly_scope(detect_anomaly), sweep_scope(), self._values_for_sweep(outs):
            found = self._backprop(
                plan, [r for r in roots if r[0] in reach], accumulate=False, wanted=wanted, reach=reach
            )
        unused = [x for x in ins if x not in found]
        if unused and not allow_unused:
            raise not_reached(unused)
        self._released = not retain_graph
        return [found.get(x) for x in ins]

    def _backward_recorded(self, loss: ComputeNode, seed: Any, detect_anomaly: bool) -> None:
        """``backward(loss, seed, create_graph=True)`` (see :mod:`vgraph.higher`)."""
        from . import higher  # (the same layer; higher builds on this module)

        self._check_can_backward(loss)
        if not isinstance(seed, ComputeNode):
            self._seed(loss, seed)
        self._check_values_fresh((loss,), "backward")
        with _sweep_lock, _anomaly_scope(detect_anomaly):
            higher.backward(self, loss, seed)

    def _values_for_sweep(self, roots: Sequence[ComputeNode]) -> contextlib.AbstractContextManager[None]:
        """While a backward sweep runs from nodes computed when read, they and the nodes computed
        when read that they read hold their values (VJPs and the sweep read values and shapes)."""
        stack = self._deferred_roots(roots)
        return self._holding_values(stack) if stack else _NOTHING  # (no generator when none)

    @contextlib.contextmanager
    def _holding_values(self, stack: list[ComputeNode]) -> Iterator[None]:
        """:meth:`_values_for_sweep` from the roots computed when read, ``stack``."""
        deferred = self._deferred
        given: set[ComputeNode] = set()
        while stack:
            n = stack.pop()
            if n._value is None and n in deferred and n not in given:
                given.add(n)
                stack.extend(n.parents)
        for n in sorted(given, key=_by_serial):  # parents first: each is computed once
            n._value = self._read_deferred(n)
        try:
            yield
        finally:
            for n in given:
                n._value = None

    def _gradient_sources(
        self, nodes: Iterable[ComputeNode]
    ) -> dict[ComputeNode, list[tuple[ComputeNode, int | None]]]:
        """The nodes whose gradients give those of some of ``nodes``, which the sweep does not
        compute (see vgraph.virtual.unrolled): none in a graph that was not built from a virtual one."""
        return {}

    def _check_can_backward(self, loss: ComputeNode) -> None:
        self._check_fresh()
        if self._released:
            self._raise_released(loss)
        if not loss.requires_grad:
            raise GraphStateError(
                f"{loss.describe()} does not depend on any node that requires a gradient "
                "(all detached, frozen, or built under no_grad)"
            )

    def _raise_released(self, loss: ComputeNode) -> None:
        raise GraphStateError(
            f"backward from {loss.describe()} again: the previous backward released the graph. "
            "Run forward first, or pass retain_graph=True to backward_ex to backpropagate twice."
        )

    def _seed(self, out: ComputeNode, seed: Any) -> np.ndarray:
        value = out._value if out._value is not None else out.value  # computed when read, or dropped
        if seed is None and type(value) is np.ndarray and value.size == 1:  # a scalar loss
            return np.ones(value.shape, dtype=value.dtype)
        shape = np.shape(value)
        if seed is None:
            if np.size(value) != 1:
                raise ShapeError(
                    f"{out.describe()} has shape {shape}, not a scalar: pass seed= (the gradient "
                    "with respect to it, same shape), or reduce it with sum()/mean() first"
                )
            return np.ones(shape, dtype=np.asarray(value).dtype)
        try:
            g = np.asarray(seed, dtype=np.asarray(value).dtype)
        except (TypeError, ValueError) as e:
            raise TypeError(f"seed for {out.describe()} is not a numeric array: {e}") from None
        if g.shape != shape:
            raise ShapeError(f"seed for {out.describe()} has shape {g.shape}, the node has shape {shape}")
        return g

    def _backprop(
        self,
        plan: list[ComputeNode],
        roots: list[tuple[ComputeNode, np.ndarray]],
        accumulate: bool,
        wanted: set[ComputeNode] | None = None,
        reach: set[ComputeNode] | None = None,
    ) -> dict[ComputeNode, np.ndarray]:
        """One reverse sweep over ``plan`` (nodes in reverse topological order).

        With ``accumulate``, leaf gradients are added to ``.grad`` (``backward``); otherwise only
        the ``wanted`` nodes' gradients are returned and no ``.grad`` changes (``grad``). ``reach``
        restricts propagation to the nodes in it (the pruned plan of ``grad``).

        ``.grad`` is written only once the whole sweep has succeeded: until then the gradients
        for it are staged, so a VJP that raises leaves every ``.grad`` as it was.
        """
        found: dict[ComputeNode, np.ndarray] = {}
        staged: list[tuple[ComputeNode, Any, bool]] = []  # (node, gradient, owned)
        g: Any
        check = _modes.anomaly
        remat = self._remat  # checkpointed loops: dropped values are recomputed when reached
        if accumulate and wanted is None and reach is None and remat is None and not check:
            tape = self._backward_tape_for(plan)
            if tape is not None and self._run_backward_tape(tape, plan, roots, staged):
                self._commit(staged)
                return found
            staged.clear()
        try:
            for r, g in roots:
                if check and not _finite(g):
                    raise NonFiniteError(f"the seed gradient of {r.describe()} has {_first_kind(g)}")
                r._g = g if r._g is None else add_grads(r._g, g)
            for n in plan:
                g = n._g
                if g is None:
                    continue  # no gradient reached this node
                n._g = None
                own = n._gown
                n._gown = False
                if type(g) is not np.ndarray and isinstance(g, LazyGrad):  # all are in: an array
                    # (a sparse_grad leaf's .grad keeps only the rows looked up)
                    g = as_row_sparse(g) if n.sparse_grad and accumulate else g.dense()
                    own = True
                if wanted is not None and n in wanted:
                    found[n] = g if own else np.array(g)
                if n.op is None:
                    if accumulate:
                        staged.append((n, g, own))
                    continue
                if accumulate and n.retains_grad:
                    staged.append((n, g, False))
                parents = n.parents
                ans = n._value if remat is None else remat.backward_value(n)
                values = tuple(map(_get_value, parents))
                attrs = n.attrs
                for p, vjp in zip(parents, n.vjps):
                    if vjp is None or not p.requires_grad or (reach is not None and p not in reach):
                        continue
                    try:
                        pg = vjp(g, ans, *values, **attrs) if attrs else vjp(g, ans, *values)
                        if pg is None:  # (no gradient reached p: see Op.partial_grads)
                            continue
                        pshape = p._value.shape
                        if pg.shape != pshape:
                            pg = reduce_grad(pg, pshape, p.op is None and not p.sparse_grad)
                    except VGraphError:
                        raise
                    except OpResultError as e:  # refused by a vgraph.defop op's CheckedVJP
                        raise e.error(
                            f"{n.describe()}: the VJP of {n.op.name} for input {e.position} "
                            f"{p.describe()} {e}"
                        ) from None
                    except Exception as e:
                        raise BackwardError(
                            f"{n.describe()}: the VJP of {n.op.name} with respect to its input "
                            f"{p.describe()} failed: {type(e).__name__}: {e}"
                        ) from e
                    if check and not _finite(pg):
                        raise _backward_anomaly(n, p, vjp, g, ans, pg, values)
                    # (the accumulation rule, inlined here; vgraph.virtual.program._Acc repeats it)
                    acc = p._g
                    if acc is None:
                        p._g = pg
                    elif p._gown and type(acc) is np.ndarray:
                        if isinstance(pg, LazyGrad):
                            pg.add_into(acc)
                        else:
                            np.add(acc, pg, out=acc)
                    else:
                        p._g = add_grads_sparse(acc, pg) if p.sparse_grad else add_grads(acc, pg)
                        p._gown = True
        except BaseException:
            self._clear_pending(plan, roots)
            raise
        finally:
            if remat is not None:
                remat.end_backward()
        self._commit(staged)
        return found

    def _commit(self, staged: list[tuple[ComputeNode, Any, bool]]) -> None:
        """Write the gradients a successful sweep staged into ``.grad`` (noting this graph's own
        nodes among them in ``_graded``)."""
        mine, graded = self._weak_self, self._graded
        for n, g, own in staged:
            if n.grad is None:
                n.grad = g if own else np.array(g)
            elif n.op is None:
                n.grad += g
            else:
                n.grad = n.grad + g
            if n._graph is mine:
                graded.add(n)

    def _backward_tape_for(self, plan: list[ComputeNode]) -> _tape.BackwardTape | None:
        """The compiled sweep of ``plan``, from its second backward on (else ``None``)."""
        if not _tape.tapes_enabled():
            return None
        cached = self._backward_tape
        if cached is None or cached[0] is not plan:
            self._backward_tape = (plan, None)  # swept once: the next backward compiles it
            return None
        tape = cached[1]
        if tape is None:
            tape = _tape.BackwardTape(plan)
            self._backward_tape = (plan, tape)
        return tape

    @staticmethod
    def _run_backward_tape(
        tape: _tape.BackwardTape,
        plan: list[ComputeNode],
        roots: list[tuple[ComputeNode, np.ndarray]],
        staged: list[tuple[ComputeNode, Any, bool]],
    ) -> bool:
        """Run a compiled sweep; ``False`` (with every pending gradient cleared) if it raised, so
        that the interpreted sweep runs instead and raises the error that names the node."""
        try:
            for r, g in roots:
                r._g = g if r._g is None else add_grads(r._g, g)
            tape(staged)
            return True
        except Exception:
            ComputeGraph._clear_pending(plan, roots)
            return False
        except BaseException:
            ComputeGraph._clear_pending(plan, roots)
            raise

    @staticmethod
    def _clear_pending(plan: list[ComputeNode], roots: list[tuple[ComputeNode, np.ndarray]]) -> None:
        """Drop every half-propagated gradient of a sweep that raised."""
        for n in plan:
            n._g = None
            n._gown = False
        for r, _ in roots:
            r._g = None
            r._gown = False

    def zero_grad(self) -> None:
        """Clear ``.grad`` of every node of this graph (sets it to ``None``)."""
        for n in self._nodes.values():
            n.grad = None


def not_reached(inputs: Sequence[ComputeNode]) -> GraphStateError:
    """The error of ``grad()`` for inputs the outputs do not depend on (without ``allow_unused``)."""
    names = ", ".join(x.describe() for x in inputs)
    return GraphStateError(
        f"grad(): the outputs do not depend (differentiably) on {names}; pass allow_unused=True "
        "to get None for such inputs"
    )


def backward_order(nodes: Reversible[ComputeNode], deferred: Mapping[ComputeNode, Any]) -> list[ComputeNode]:
    """The nodes of ``nodes`` (in creation order) that require a gradient, in the order a backward
    sweep visits them: the reverse of creation order, a reverse topological order. Nodes computed
    when read (``deferred``, see :func:`computed_ops`) are left out: nothing reads them, so no
    sweep gives them a gradient unless one is a root (see :meth:`ComputeGraph._sweep_plan`)."""
    return [n for n in reversed(nodes) if n.requires_grad and n not in deferred]


_by_serial = attrgetter("serial")


def computed_ops(nodes: Iterable[ComputeNode], deferred: Mapping[ComputeNode, Any]) -> list[ComputeNode]:
    """The op nodes among ``nodes`` that a forward or replay computes: all but those computed when
    read (``deferred``: a graph's ``_deferred``, see :meth:`ComputeGraph.computed_when_read`)."""
    return [n for n in nodes if n.op is not None and n not in deferred]


_get_value = attrgetter("_value")
_ALL = "*"  # key of ComputeGraph._fresh meaning every node of the graph


def _stepped(node: Any) -> list[bool] | None:
    """For a hoisted group — a loop-body node computed for every iteration at once, keyed
    ``<type*:id@idx>`` with ``idx`` the loop's iteration path (see :mod:`vgraph.virtual.hoist`) —
    which of its parents are stepped (one row per iteration: the loop's other groups, keyed
    ``*`` with the same ``idx``); ``None`` for any other node (a batched build's groups of copies
    are keyed ``*`` too, but each with a serial number of its own as ``idx``)."""
    key = node.key
    if not key.type.endswith("*"):
        return None
    stepped = [p.key.type.endswith("*") and p.key.idx == key.idx for p in node.parents]
    return stepped if any(stepped) else None


def _copy(node: Any, t: int) -> str:
    """How messages name iteration ``t``'s copy of the hoisted group (or stepped parent) ``node``."""
    key = NodeKey(node.key.type[:-1], node.key.id, (*node.key.idx, t))
    return f"<{key}>" + (f" '{node.name}'" if node.name else "")


def _first_row(
    stepped: Sequence[bool], values: Sequence[Any], fails: Callable[[int, list[Any]], bool]
) -> int | None:
    """The first iteration ``t`` for which ``fails(t, inputs)`` holds, ``inputs`` being the
    hoisted group's inputs cut to that iteration (stepped inputs: rows ``t:t+1``, keeping the
    iteration axis the group's attributes expect; the others whole), or ``None``. Only on an
    error path: one call per row."""
    trips = min(len(v) for v, s in zip(values, stepped) if s)
    for t in range(trips):
        if fails(t, [v[t : t + 1] if s else v for v, s in zip(values, stepped)]):
            return t
    return None


def _hoisted_op_error(node: ComputeNode, e: Exception) -> ShapeError | None:
    """For a hoisted group whose op raised: the error naming the first iteration whose copy
    raises alone (its index values and bounds, in numpy's words), or ``None`` if none does."""
    stepped = _stepped(node)
    if stepped is None:
        return None
    op = cast(Op, node.op)  # only op nodes are computed
    values = [p._value for p in node.parents]
    errors: list[Exception] = []

    def fails(t: int, rows: list[Any]) -> bool:
        try:
            op.forward(*rows, **node.attrs)
        except (ValueError, IndexError, TypeError) as row_error:
            errors.append(row_error)
            return True
        return False

    t = _first_row(stepped, values, fails)
    if t is None:
        return None
    shapes = ", ".join(
        f"{_copy(p, t)} {np.shape(v[t])}" if s else f"{p.describe()} {np.shape(v)}"
        for p, v, s in zip(node.parents, values, stepped)
    )
    return ShapeError(
        f"{_copy(node, t)} (hoisted: computed for every iteration by {node.describe()}): cannot "
        f"compute {op.name} of {shapes}: {errors[0]}"
    )


def _forward_anomaly(node: ComputeNode, values: Sequence[Any], result: Any) -> NonFiniteError:
    """The error for the first non-finite value, computed by ``node`` from ``values``."""
    op = cast(Op, node.op)  # only op nodes compute values
    where = node.describe()
    names = [p.describe() for p in node.parents]
    stepped = _stepped(node)
    if stepped is not None and np.ndim(result) > 0:
        # A hoisted loop-body node computed for every iteration at once (vgraph.virtual.hoist):
        # name the first non-finite iteration's copy, and its copies of the stepped inputs.
        rows = np.isfinite(np.reshape(result, (len(result), -1))).all(axis=1)
        t = int(np.argmin(rows))
        where = f"{_copy(node, t)} (hoisted: computed for every iteration by {node.describe()})"
        names = [_copy(p, t) if s else n for p, n, s in zip(node.parents, names, stepped)]
        values = [v[t] if s else v for v, s in zip(values, stepped)]
        result = result[t]
    kind = _first_kind(result)
    bad = [n for n, v in zip(names, values) if not _finite(v)]
    if bad:  # only a leaf can be non-finite already: every op value was checked when computed
        head = f"{kind} enters at {where} ({op.name}) from {bad[0]}, which is already non-finite"
    else:
        reason = None
        hint = _ANOMALY_HINTS.get(op.name)
        if hint is not None:
            with contextlib.suppress(Exception):
                reason = hint(*values)
        head = f"{kind} first appears at {where}: " + (reason or f"{op.name} of finite inputs gave {kind}")
    lines = [head, *(f"  input {n}: {value_summary(v)}" for n, v in zip(names, values))]
    lines.append(f"  output: {value_summary(result)}")
    return NonFiniteError("\n".join(lines))


def _backward_anomaly(
    node: ComputeNode, parent: ComputeNode, vjp: VJP, g: Any, ans: Any, pg: Any, values: Sequence[Any]
) -> NonFiniteError:
    """The error for the first non-finite gradient, produced by ``node``'s VJP ``vjp`` for
    ``parent`` from the incoming gradient ``g`` (``ans``: the node's value)."""
    op = cast(Op, node.op)  # only op nodes have VJPs
    if isinstance(pg, LazyGrad):  # (a weight's gradient kept as its factors, e.g. x^T g)
        pg = pg.dense()
    where, about = node.describe(), parent.describe()
    names = [p.describe() for p in node.parents]
    stepped = _stepped(node)
    if stepped is not None and np.ndim(ans) > 0:
        # A hoisted group: name the first iteration whose copy's VJP gives a non-finite gradient,
        # and show that iteration's rows. A stepped parent's gradient has the iteration rows; a
        # parent shared by every iteration (a weight) gets their sum: each iteration's VJP is
        # computed alone (on this error path only).
        attrs = node.attrs
        if stepped[node.parents.index(parent)] and np.shape(pg)[:1] == np.shape(ans)[:1]:
            rows = np.isfinite(np.reshape(pg, (len(pg), -1))).all(axis=1)
            t: int | None = int(np.argmin(rows))
        else:

            def fails(i: int, cut: list[Any]) -> bool:
                try:
                    return not _finite(vjp(g[i : i + 1], ans[i : i + 1], *cut, **attrs))
                except Exception:  # (a VJP that needs the whole group: no row to name)
                    return False

            t = _first_row(stepped, values, fails)
        if t is not None:
            where = f"{_copy(node, t)} (hoisted: computed for every iteration by {node.describe()})"
            if stepped[node.parents.index(parent)]:
                about = _copy(parent, t)
            names = [_copy(p, t) if s else n for p, n, s in zip(node.parents, names, stepped)]
            values = [v[t] if s else v for v, s in zip(values, stepped)]
            g, ans = g[t], ans[t]
    lines = [
        f"{_first_kind(pg)} first appears in backward at {where}: the VJP of {op.name} "
        f"gave a non-finite gradient for its input {about} from a finite incoming gradient",
        f"  incoming gradient: {value_summary(g)}",
        *(f"  input {n}: {value_summary(v)}" for n, v in zip(names, values)),
        f"  output: {value_summary(ans)}",
    ]
    return NonFiniteError("\n".join(lines))
