"""Declaring: the nodes of a virtual graph — :class:`VirtualNode`, :class:`LoopNode` (a ``with``
block holding a loop body) and :class:`BranchNode` — and the scope helpers they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..compute import ComputeNode, NodeKey
from ..errors import BuildError
from ..functions import Operand
from ..ops import OPS, Op

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
        if isinstance(j, bool) or not isinstance(j, (int, np.integer)) or j < 0:
            raise TypeError(
                f"child(): j must be a non-negative int (a column of the children array), got {j!r}"
            )
        node = VirtualNode(
            self.graph, "Child", "child", (state,), {"slot": int(j)}, name or f"{state.name}[{j}]", self
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
