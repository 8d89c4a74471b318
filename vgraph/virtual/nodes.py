"""Declaring: the nodes of a virtual graph — :class:`VirtualNode`, :class:`LoopNode` (a ``with``
block holding a loop body) and :class:`BranchNode` — and the scope helpers they share."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..compute import ComputeNode, NodeKey
from ..errors import ArgumentError, BuildError
from ..functions import Operand
from ..modes import int_arg
from ..ops import ALONG_AXIS, ELEMENTWISE, OPS, REDUCTION, Op

if TYPE_CHECKING:
    from .graph import VirtualGraph

# ---------------------------------------------------------------------------- nodes

_NO_LOOP_VALUE = "{} is a loop, which has no value; use its outputs (loop.final(carry), loop.stack(value))"


class VirtualNode(Operand):
    """A node of a :class:`VirtualGraph`, identified by ``<type, id>``.

    Python operators and ``vgraph`` functions on virtual nodes declare new op nodes in the same
    graph (inside the loop body being declared, if any).

    Attributes:
        graph: the VirtualGraph it belongs to.
        type: its kind (``Input``, ``Parameter``, ``MatMul``, ``Loop`` …).
        id: a per-type counter within its graph.
        name: the user's display name, or ``None``.
        inputs: the virtual nodes it is computed from.
        scope: the :class:`LoopNode` whose body holds it (``None`` at top level).
    """

    __slots__ = ("graph", "type", "id", "name", "inputs", "attrs", "scope", "kind", "op")

    def __init__(
        self,
        graph: VirtualGraph,
        type_: str,
        kind: str,
        inputs: tuple[VirtualNode, ...] = (),
        attrs: dict[str, Any] | None = None,
        name: str | None = None,
        scope: LoopNode | None = None,
    ) -> None:
        self.graph = graph
        self.type = type_
        self.kind = kind  # input parameter constant sample op carry item final stacked loop branch
        self.inputs = inputs
        self.attrs = attrs or {}
        self.name = name
        self.scope = scope
        self.op: Op | None = OPS[type_] if kind == "op" else None  # resolved once, used every build
        self.id = graph._register(self)

    @property
    def key(self) -> tuple[str, int]:
        """``(type, id)``."""
        return (self.type, self.id)

    def describe(self, idx: tuple[int, ...] | None = None) -> str:
        """``<type:id>`` (or ``<type:id@idx>``) and the display name, as in error messages."""
        key = NodeKey(self.type, self.id, idx or ())
        return f"<{key}>" + (f" '{self.name}'" if self.name else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    @property
    def compute_nodes(self) -> dict[tuple[int, ...], ComputeNode]:
        """The compute nodes built from this node in the latest build, keyed by ``idx``."""
        latest = self.graph.latest_build
        return {} if latest is None else latest._copies_of(self)

    def _apply(self, op: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> VirtualNode:
        return self.graph._op(op, inputs, attrs)

    @property
    def shape(self) -> tuple[int | None, ...] | None:
        """The shape of this node's values as far as the declaration tells, before any build.

        A tuple with ``None`` for each dimension known only at build (``g.input("x", shape=(None,
        3))`` has shape ``(None, 3)``), or ``None`` when not even the number of dimensions is known
        (an input declared without a shape, an op whose result depends on values). Derived nodes
        follow their op's shape rule: elementwise ops broadcast, ``@`` multiplies, reductions drop
        (or keep) their axes, ``transpose``, ``reshape``, ``take``, ``concat``, ``stack``; a loop's
        per-iteration item drops the sequence's leading axis, a carry has its initial value's
        shape when its update keeps it, ``loop.stack`` adds an axis of unknown length, a branch has
        its options' shape when they agree. Every build's value has this shape where it is known;
        a mistake (shapes that do not combine) is reported by the build, naming the node.
        """
        return _shape_of(self)

    # -- Python protocols that would silently do the wrong thing on a node without a value
    def __bool__(self) -> bool:
        raise ArgumentError(
            f"{self.describe()} has no value while the graph is declared, so `if node:`, `and`, "
            "`or` and `not` cannot decide on it. Decide on values in the graph instead: "
            "g.branch(selector, options, keys=[node]) picks an option from the real value at build "
            "time, vgraph.where(cond, a, b) selects elementwise, and a loop's while_= / until= "
            "condition stops it on the carried values"
        )

    def _compare(self, op: str) -> ArgumentError:
        return ArgumentError(
            f"`{self.describe()} {op} ...` compares a node that has no value yet: vgraph does not "
            "build comparisons into the graph. To choose by value, use g.branch(selector, options, "
            "keys=[node]) (the selector gets real values), a loop condition while_= / until= "
            "(it gets the carried values), or vgraph.where(mask, a, b) with the mask computed by "
            "vgraph.step(x - y) (1 where x > y)"
        )

    def __lt__(self, other: Any) -> bool:
        raise self._compare("<")

    def __le__(self, other: Any) -> bool:
        raise self._compare("<=")

    def __gt__(self, other: Any) -> bool:
        raise self._compare(">")

    def __ge__(self, other: Any) -> bool:
        raise self._compare(">=")

    def __index__(self) -> int:
        raise ArgumentError(
            f"{self.describe()} was used as an index (a list, tuple or array indexed by a node, or "
            "range(node)), but a node has no value while the graph is declared. To pick rows by "
            "indices computed in the graph, use vgraph.take(table, indices) (with table a node or "
            "an array); to pick an option, g.branch"
        )

    def __int__(self) -> int:
        raise ArgumentError(
            f"int({self.describe()}): a node has no value while the graph is declared; read "
            "cg.node(node).value after a build, or use the value in a loop condition or a selector"
        )

    def __float__(self) -> float:
        raise ArgumentError(
            f"float({self.describe()}): a node has no value while the graph is declared; read "
            "cg.node(node).value after a build (or cg.forward(node))"
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise ArgumentError(
            f"numpy was given {self.describe()}, which has no value while the graph is declared. "
            "Write the computation with the node (x @ W, vgraph.tanh(x)); to pick rows of an array "
            "by indices computed in the graph, use vgraph.take(table, indices); read values with "
            "cg.node(node).value after a build"
        )

    def __len__(self) -> int:
        shape = self.shape
        known = "" if not shape or shape[0] is None else f" (its declared length is {shape[0]}: see .shape)"
        raise ArgumentError(
            f"len({self.describe()}): a node's length is known only when it is built{known}; to "
            "run over a sequence, step through it in a loop (with g.loop() as loop: x_t = "
            "loop.step(x)), and use node.shape for what the declaration tells"
        )

    def __iter__(self) -> Any:
        raise ArgumentError(
            f"{self.describe()} is not iterable while the graph is declared (its length is known "
            "only at build): step through a sequence in a loop (with g.loop() as loop: x_t = "
            "loop.step(x)), index it (x[0]), or split it (vgraph.split(x, n))"
        )

    def __getitem__(self, index: Any) -> Any:
        parts = index if isinstance(index, tuple) else (index,)
        if any(
            isinstance(i, Operand) or (isinstance(i, list) and any(isinstance(j, Operand) for j in i))
            for i in parts
        ):
            raise ArgumentError(
                f"{self.describe()}[node]: an index in [] is fixed when declaring; for indices "
                "computed in the graph or fed as data, use vgraph.take(x, indices) (rows of x) or "
                "vgraph.take_along_axis(x, indices, axis)"
            )
        return super().__getitem__(index)


class LoopNode(VirtualNode):
    """A loop whose body is a virtual sub-graph, unrolled iteration by iteration.

    Declare it with ``VirtualGraph.loop`` as a ``with`` block. The loop::

        with g.loop(times=n, while_=cond, max_iters=m) as loop:
            x_t = loop.step(xs)              # per-iteration slice of xs (leading axis)
            h = loop.carry(h0, name="h")     # loop-carried state
            h_new = body(h, x_t)
            loop.update(h, h_new)
        h_final = loop.final(h)
        hs = loop.stack(h_new)

    means, in plain Python::

        h, t, collected = h0, 0, []
        while (t < n) and (t < len(xs)) and cond(t, {"h": h}):   # each part only if given
            if t == m: raise LoopLimitError
            x_t = xs[t]
            h_new = body(h, x_t)
            collected.append(h_new)
            h = h_new
            t += 1
        h_final, hs = h, np.stack(collected)

    Every iteration's nodes get ``idx = outer_idx + (t,)``. Both outputs are differentiable.

    A carry keeps its shape and dtype from iteration to iteration (a :class:`ShapeError` at
    build time names the loop, the carry and the iteration otherwise); only the first update may
    broadcast the initial value (a learnable ``(1, H)`` state becomes ``(B, H)``) or cast it
    safely (int to float). To collect values of growing size, use :meth:`stack`.

    ``checkpoint`` (``g.loop(..., checkpoint=...)``) changes only memory: the values of some
    iterations are dropped while unrolling and recomputed in backward (see
    :mod:`vgraph.virtual.checkpoint`); values and gradients are those of the plain unroll.
    """

    __slots__ = (
        "times", "cond", "max_iters", "carries", "updates", "sequences", "items", "closed", "body",
        "structure", "children", "until", "on_limit", "checkpoint",
    )  # fmt: skip

    def __init__(
        self,
        graph: VirtualGraph,
        times: int | None,
        cond: Any,
        max_iters: int,
        name: str | None,
        structure: VirtualNode | None = None,
        checkpoint: Any = None,
    ):
        super().__init__(graph, "Loop", "loop", (), None, name, graph._scope())
        self.checkpoint = checkpoint  # a checkpoint.Schedule, or None: keep every value
        self.times = times
        self.cond = cond
        self.max_iters = max_iters
        self.structure = structure  # a recursion's children array (see VirtualGraph.recurse)
        self.until: Any = None  # a do-while condition, checked after each iteration
        self.on_limit = "raise"  # or "stop": max_iters caps the loop
        self.children: list[VirtualNode] = []  # its child reads
        self.carries: list[VirtualNode] = []
        self.updates: dict[VirtualNode, VirtualNode] = {}
        self.sequences: list[VirtualNode] = []
        self.items: list[VirtualNode] = []
        self.body: list[VirtualNode] = []
        self.closed = False

    def __bool__(self) -> bool:
        # A loop is a declaration with no value of its own (``if node.scope:`` asks whether
        # there is one), not a value to decide on.
        return True

    # -- declaring the body
    def __enter__(self) -> LoopNode:
        if self.closed:
            raise BuildError(f"{self.describe()}: its body is already declared")
        self.graph._scopes.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.graph._scopes.pop()
        self.closed = True
        # The loop depends on everything its body used, including top-level nodes created while
        # the body was declared (constants made from numbers): move it to where it is complete,
        # so that declaration order stays a topological order.
        for nodes in (self.graph.nodes, self.scope.body if self.scope is not None else None):
            if nodes is not None:
                nodes.remove(self)
                nodes.append(self)
        if exc_type is not None:
            return
        missing = [c for c in self.carries if c not in self.updates]
        if missing:
            names = ", ".join(c.describe() for c in missing)
            raise BuildError(
                f"{self.describe()}: carried state {names} never updated; call loop.update(carry, new_value)"
            )
        if (
            self.times is None
            and self.cond is None
            and self.until is None
            and not self.sequences
            and self.structure is None
        ):
            raise BuildError(
                f"{self.describe()} has no stopping rule: give times=, while_=, until=, or step "
                "through a sequence with loop.step(xs)"
            )

    def _check_open(self, what: str) -> None:
        if self.closed or not self.graph._scopes or self.graph._scopes[-1] is not self:
            raise BuildError(f"{self.describe()}: call {what} inside the loop's `with` block")

    def _outside(self, x: Any, what: str, hint: str = "") -> VirtualNode:
        node = self.graph._as_node(x)
        if _inside(node.scope, self):
            raise BuildError(
                f"{what} of {self.describe()} must come from outside its body, got {node.describe()}{hint}"
            )
        return node

    def carry(self, init: Any, name: str | None = None) -> VirtualNode:
        """Declare loop-carried state starting at ``init``; returns its value at the start of each
        iteration. Set its next value with :meth:`update`."""
        self._check_open("carry()")
        if self.structure is not None:
            raise BuildError(
                f"{self.describe()} recurses over a structure: declare per-node state with "
                "state(default) and read it at the children with child(state, j)"
            )
        return self._carry(init, name)

    def _carry(self, init: Any, name: str | None) -> VirtualNode:
        init_node = self._outside(init, "a carry's initial value")
        name = name or f"carry{len(self.carries)}"
        if any(c.name == name for c in self.carries):
            raise BuildError(f"{self.describe()} already has a carry named {name!r}")
        c = VirtualNode(self.graph, "Carry", "carry", (init_node,), None, name, self)
        self.carries.append(c)
        return c

    # -- recursion over a structure (see VirtualGraph.recurse)
    def state(self, default: Any, name: str | None = None) -> VirtualNode:
        """Declare a value computed at every structure node; ``default`` stands for a missing child.

        Read it at the current node's children with :meth:`child`, set it with :meth:`update`;
        after the block, :meth:`final` is its value at the last node (the root) and
        :meth:`stack` gives every node's.
        """
        self._check_open("state()")
        if self.structure is None:
            raise BuildError(f"{self.describe()} is not a recursion: use carry() for loop-carried state")
        return self._carry(default, name)

    def child(self, state: VirtualNode, j: int, name: str | None = None) -> VirtualNode:
        """``state``'s value at the current node's ``j``-th child (its default if there is none).

        It *is* the node computed at that child (as a carry is the node of the previous
        iteration): reading it costs nothing, whatever the size of the structure.
        """
        self._check_open("child()")
        if self.structure is None:
            raise BuildError(f"{self.describe()} is not a recursion: child() reads a structure's children")
        if state.kind != "carry" or state.scope is not self:
            raise BuildError(f"{state.describe()} is not a state of {self.describe()}")
        j = int_arg(j, "child(): j (a column of the children array)", 0)
        node = VirtualNode(
            self.graph, "Child", "child", (state,), {"slot": j}, name or f"{state.name}[{j}]", self
        )
        self.children.append(node)
        return node

    def update(self, carry: VirtualNode, value: Any) -> None:
        """Declare the value ``carry`` takes at the start of the next iteration (in a recursion:
        the state's value at the current node)."""
        self._check_open("update()")
        if not isinstance(carry, VirtualNode) or carry.kind != "carry" or carry.scope is not self:
            what = carry.describe() if isinstance(carry, VirtualNode) else repr(carry)
            raise BuildError(f"{what} is not a carry of {self.describe()}")
        if carry in self.updates:
            raise BuildError(f"{carry.describe()} is already updated in {self.describe()}")
        self.updates[carry] = self.graph._as_node(value)

    def step(self, sequence: Any, name: str | None = None, reverse: bool = False) -> VirtualNode:
        """Step through ``sequence`` along its leading axis: returns ``sequence[t]`` in iteration t
        (``sequence[len - 1 - t]`` with ``reverse=True``: the backward half of a bidirectional RNN).

        The loop runs at most ``len(sequence)`` iterations; stepped sequences must have equal lengths.
        A sequence must come from outside the loop's body: compute a transformed sequence before
        the ``with`` block.
        """
        self._check_open("step()")
        hint = (
            ": compute it before the loop's `with` block (e.g. `xr = x[::-1]` above it), or for a "
            "reversed sequence use loop.step(x, reverse=True)"
        )
        seq = self._outside(sequence, "a stepped sequence", hint)
        attrs = {"reverse": True} if reverse else None
        item = VirtualNode(self.graph, "Item", "item", (seq,), attrs, name, self)
        self.sequences.append(seq)
        self.items.append(item)
        return item

    # -- outputs
    def _check_closed(self, what: str) -> None:
        if not self.closed:
            raise BuildError(f"{self.describe()}: use {what} after the loop's `with` block")

    def final(self, carry: VirtualNode, name: str | None = None) -> VirtualNode:
        """The value of ``carry`` after the last iteration (its initial value if none ran)."""
        self._check_closed("final()")
        if not isinstance(carry, VirtualNode) or carry.kind != "carry" or carry.scope is not self:
            what = carry.describe() if isinstance(carry, VirtualNode) else repr(carry)
            raise BuildError(f"{what} is not a carry of {self.describe()}")
        return VirtualNode(self.graph, "Final", "final", (self, carry), None, name or carry.name, self.scope)

    def stack(self, value: VirtualNode, name: str | None = None) -> VirtualNode:
        """The per-iteration values of body node ``value`` stacked along a new leading axis."""
        self._check_closed("stack()")
        if not isinstance(value, VirtualNode) or value.scope is not self:
            raise BuildError(f"loop.stack() takes a node of the body of {self.describe()}")
        return VirtualNode(self.graph, "Stack", "stacked", (self, value), None, name, self.scope)


class BranchNode(VirtualNode):
    """A many-to-one switch: ``selector(*key_values)`` picks which option flows on.

    In plain Python: ``out = options[selector(*[k.value for k in keys])]``. Only the selected
    option is built (per iteration, inside a loop) and only it receives a gradient. The selector
    returns an ``int`` (or ``bool``) in ``range(len(options))``.

    A branch with several outputs (options given as tuples, see ``VirtualGraph.branch``) is one
    BranchNode per output; the first, the *lead*, runs the selector and records the decision, the
    others follow its choice (``lead`` is set on them).
    """

    __slots__ = ("selector", "keys", "options", "lead")

    def __init__(
        self,
        graph: VirtualGraph,
        selector: Callable[..., Any],
        keys: tuple[VirtualNode, ...],
        options: tuple[VirtualNode, ...],
        name: str | None,
        lead: BranchNode | None = None,
    ):
        inputs = (*keys, *options) if lead is None else (lead, *keys, *options)
        super().__init__(graph, "Branch", "branch", inputs, None, name, graph._scope())
        self.selector = selector
        self.keys = keys
        self.options = options
        self.lead = lead


def _depth(scope: LoopNode | None) -> int:
    """How many loops enclose a node of ``scope``."""
    n = 0
    while scope is not None:
        n, scope = n + 1, scope.scope
    return n


def _declared_name(node: VirtualNode) -> str:
    """An input's or a parameter's name (``VirtualGraph.input`` and ``.parameter`` require a str)."""
    return cast(str, node.name)  # checked by _name_arg when the input or parameter was declared


def _inside(scope: LoopNode | None, loop: LoopNode) -> bool:
    while scope is not None:
        if scope is loop:
            return True
        scope = scope.scope
    return False


# ---------------------------------------------------------------------------- declared shapes
Shape = tuple[int | None, ...] | None


def _shape_of(node: VirtualNode, carries: dict[VirtualNode, Shape] | None = None) -> Shape:
    """``node.shape``: the declared shape, computed over the node's ancestors without recursion
    (a declared chain can be long). ``carries`` gives every carry's shape (default: worked out
    for the whole graph, :func:`_carry_shapes`)."""
    known: dict[VirtualNode, Shape] = dict(_carry_shapes(node.graph) if carries is None else carries)
    stack = [node]
    while stack:
        v = stack[-1]
        if v in known:
            stack.pop()
            continue
        if v.kind == "carry":  # not among the given shapes: unknown
            known[stack.pop()] = None
            continue
        deps = _shape_deps(v)
        missing = [u for u in deps if u not in known]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        try:
            known[v] = _shape_rule(v, [known[u] for u in deps])
        except Exception:  # a declaration the build will refuse (and name): no shape to give
            known[v] = None
    return known[node]


_CARRY_SHAPES: weakref.WeakKeyDictionary[VirtualGraph, tuple[Any, dict[VirtualNode, Shape]]] = (
    weakref.WeakKeyDictionary()
)


def _carry_shapes(graph: VirtualGraph) -> dict[VirtualNode, Shape]:
    """Every carry's declared shape: its initial value's shape where the update keeps it, else
    ``None``. Carries read each other (an LSTM's ``h`` and ``c``), so this is a fixed point over
    all of them: start from the initial shapes, drop each carry whose update does not keep its
    shape under the current assumptions, until every remaining carry keeps it. Then every carry
    enters every iteration with its shape (by induction over the iterations)."""
    loops = [v for v in graph.nodes if isinstance(v, LoopNode)]
    key = (len(graph.nodes), sum(len(loop.updates) for loop in loops))
    cached = _CARRY_SHAPES.get(graph)
    if cached is not None and cached[0] == key:
        return cached[1]
    carries = [c for loop in loops for c in loop.carries]
    dropped: set[VirtualNode] = set()  # carries found not to keep a shape: None from then on
    while True:
        # Assume each other carry enters with its initial value's shape. An initial value may
        # read an enclosing loop's carries: one pass per level of nesting settles them.
        shapes: dict[VirtualNode, Shape] = dict.fromkeys(carries)
        for _ in range(len(carries) + 1):
            new = {c: None if c in dropped else _shape_of(c.inputs[0], shapes) for c in carries}
            if new == shapes:
                break
            shapes = new
        failed = {
            c
            for c in carries
            if c not in dropped
            and (
                shapes[c] is None
                or (update := cast(LoopNode, c.scope).updates.get(c)) is None
                or _shape_of(update, shapes) != shapes[c]
            )
        }
        if not failed:
            break
        dropped |= failed  # grows every round: this ends
    _CARRY_SHAPES[graph] = (key, shapes)
    return shapes


def _shape_deps(v: VirtualNode) -> tuple[VirtualNode, ...]:
    """The nodes whose declared shapes give ``v``'s."""
    if v.kind in ("op", "item", "sample", "child"):
        return v.inputs
    if v.kind == "branch":
        return cast(BranchNode, v).options
    if v.kind in ("final", "stacked"):
        return (v.inputs[1],)
    return ()  # leaves; carries are given (see _carry_shapes)


def _shape_rule(v: VirtualNode, shapes: list[Shape]) -> Shape:
    kind = v.kind
    if kind == "input":
        return cast("tuple[int | None, ...] | None", v.attrs["shape"])
    if kind == "parameter":
        return tuple(v.attrs["shape"])
    if kind == "constant":
        return tuple(np.shape(v.attrs["value"]))
    if kind in ("sample", "final", "child"):
        return shapes[0]
    if kind == "item":
        return None if shapes[0] is None or not shapes[0] else shapes[0][1:]
    if kind == "stacked":
        return None if shapes[0] is None else (None, *shapes[0])
    if kind == "branch":
        return shapes[0] if all(s == shapes[0] for s in shapes) else None
    if kind != "op":
        return None
    return _op_shape(cast(Op, v.op), shapes, v.attrs)


def _broadcast(*shapes: Shape) -> Shape:
    if any(s is None for s in shapes):
        return None
    full = cast("list[tuple[int | None, ...]]", list(shapes))
    n = max(len(s) for s in full)
    out: list[int | None] = []
    for dims in zip(*[(1,) * (n - len(s)) + tuple(s) for s in full]):
        sizes = {d for d in dims if d != 1}
        fixed = {d for d in sizes if d is not None}
        if len(fixed) > 1:
            raise ValueError("shapes do not broadcast")
        if fixed:
            out.append(fixed.pop())
        elif None in sizes:
            out.append(None)  # an unknown size against 1s: it may itself be 1
        else:
            out.append(1)
    return tuple(out)


def _axes(axis: Any, ndim: int) -> set[int]:
    if axis is None:
        return set(range(ndim))
    items = axis if isinstance(axis, tuple) else (axis,)
    return {int(a) % ndim for a in items}


def _op_shape(spec: Op, shapes: list[Shape], attrs: dict[str, Any]) -> Shape:
    """The declared shape of a node of ``spec`` whose inputs have ``shapes``: by the op's declared
    kind (:data:`vgraph.ops.KINDS`), or by a rule of its own (``None``: unknown)."""
    op, kind = spec.name, spec.kind
    if kind == ALONG_AXIS:
        return shapes[0]
    if kind == ELEMENTWISE:
        return _broadcast(*shapes)
    if any(s is None for s in shapes):
        return None
    full = cast("list[tuple[int | None, ...]]", shapes)
    x = full[0]
    if kind == REDUCTION:
        axes = _axes(attrs.get("axis"), len(x))
        if attrs.get("keepdims"):
            return tuple(1 if k in axes else d for k, d in enumerate(x))
        return tuple(d for k, d in enumerate(x) if k not in axes)
    if op in ("MatMul", "Linear"):
        a, b = full[0], full[1]
        if not a or not b:
            return None
        a2 = (1, *a) if len(a) == 1 else a
        b2 = (*b, 1) if len(b) == 1 else b
        batch = _broadcast(a2[:-2], b2[:-2])
        out = (*cast("tuple[int | None, ...]", batch), a2[-2], b2[-1])
        if len(b) == 1:
            out = out[:-1]
        if len(a) == 1:
            out = (*out[:-2], out[-1]) if len(b) > 1 else out[:-1]
        return out
    if op == "Transpose":
        order = attrs.get("axes")
        return x[::-1] if order is None else tuple(x[int(a) % len(x)] for a in order)
    if op == "Reshape":
        new = tuple(int(d) for d in attrs["shape"])
        if -1 not in new:
            return new
        if None in x:
            return tuple(None if d == -1 else d for d in new)
        rest = int(np.prod([d for d in new if d != -1]))
        size = int(np.prod(cast("tuple[int, ...]", x)))
        return tuple(size // rest if d == -1 else d for d in new)
    if op == "Take":
        return (*full[1], *x[1:])
    if op == "OneHot":
        return (*x, int(attrs["depth"]))
    if op == "CumSum":
        if attrs.get("axis") is not None:
            return x
        return (None,) if None in x else (int(np.prod(cast("tuple[int, ...]", x))),)
    if op == "SoftmaxCrossEntropy":
        return x[:-1]
    if op in ("Concat", "Stack"):
        n = len(x)
        if any(len(s) != n for s in full):
            return None
        if op == "Stack":
            axis = int(attrs.get("axis", 0)) % (n + 1)
            merged = _broadcast(*full)  # the parts have one shape: unknown sizes take known ones
            if merged is None or len(merged) != n:
                return None
            return (*merged[:axis], len(full), *merged[axis:])
        axis = int(attrs.get("axis", 0)) % n
        along = [s[axis] for s in full]
        others = _broadcast(*[(*s[:axis], 1, *s[axis + 1 :]) for s in full])
        if others is None:
            return None
        total = None if None in along else sum(cast("list[int]", along))
        return (*others[:axis], total, *others[axis + 1 :])
    if op == "GetItem":
        return _index_shape(x, attrs["index"])
    return None


def _index_shape(x: tuple[int | None, ...], index: Any) -> Shape:
    """The shape of ``value[index]`` for a value of shape ``x``."""
    if None not in x:  # numpy says, on a view that allocates nothing
        return tuple(np.broadcast_to(np.empty((), np.int8), cast("tuple[int, ...]", x))[index].shape)
    parts = list(index) if isinstance(index, tuple) else [index]
    if not all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in parts):
        return None  # an array index on a value of unknown size
    if parts.count(Ellipsis) > 1:
        return None
    taking = sum(1 for i in parts if i is not None and i is not Ellipsis)
    if Ellipsis in parts:
        k = parts.index(Ellipsis)
        parts[k : k + 1] = [slice(None)] * (len(x) - taking)
    parts += [slice(None)] * (len(x) - sum(1 for i in parts if i is not None))
    out: list[int | None] = []
    dims = iter(x)
    for i in parts:
        if i is None:
            out.append(1)
            continue
        d = next(dims)
        if isinstance(i, slice):
            if d is not None:
                out.append(len(range(*i.indices(d))))
            elif i == slice(None) or i == slice(None, None, -1):
                out.append(None)
            else:
                return None  # a part of a dimension of unknown size: unknown
    return tuple(out)
