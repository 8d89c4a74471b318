"""Planning: the static facts of a declared structure that every build of it uses — what each
scope builds eagerly, in which order, and what each loop captures from outside its body."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from .hoist import hoistable
from .nodes import BranchNode, LoopNode, _inside

if TYPE_CHECKING:
    from ..ops import Op
    from .graph import VirtualGraph
    from .nodes import VirtualNode


def _captures(loop: LoopNode) -> list[VirtualNode]:
    """Nodes outside ``loop`` that its body (including nested bodies) uses."""
    seen: dict[VirtualNode, None] = {}
    for u in loop.updates.values():  # loop.update(carry, x) with x from outside the body
        if not _inside(u.scope, loop):
            seen[u] = None
    for v in loop.graph.nodes:
        if _inside(v.scope, loop):
            deps = v.inputs if not isinstance(v, LoopNode) else _loop_inputs(v)
            if v.kind == "carry":
                deps = ()
            for d in (*deps, *(v.updates.values() if isinstance(v, LoopNode) else ())):
                if not _inside(d.scope, loop) and d is not loop:
                    seen[d] = None
    return list(seen)


# Body nodes a loop sets at the start of each iteration (not built from their inputs).
_SET_PER_ITERATION = ("carry", "item", "child")


def _loop_inputs(loop: LoopNode) -> list[VirtualNode]:
    """What a loop reads from outside its body when it starts: carries' initial values, stepped
    sequences, a recursion's children array."""
    inputs = [*(c.inputs[0] for c in loop.carries), *loop.sequences]
    if loop.structure is not None:
        inputs.append(loop.structure)
    return inputs


def _loop_of(output: VirtualNode) -> LoopNode:
    """The loop a ``final`` or ``stacked`` node is an output of."""
    return cast(LoopNode, output.inputs[0])  # LoopNode.final and .stack make it the first input


def _hoistable(loop: LoopNode, eager: Sequence[VirtualNode]) -> list[VirtualNode]:
    """The body ops of ``loop`` that depend on no carried state, decision or per-iteration sample:
    only on stepped items, values from outside the body, tied parameters and each other.

    Their copies for all iterations can be computed as one op over the stepped sequence
    (hoisting). In declaration order, so a hoistable node's hoistable inputs come first.
    """
    found: dict[VirtualNode, None] = {}
    for v in eager:
        if v.kind != "op" or not hoistable(cast("Op", v.op)):
            continue
        if all(u in found or (u.kind == "item" and u.scope is loop) or _invariant(u, loop) for u in v.inputs):
            found[v] = None
    return list(found)


def _invariant(u: VirtualNode, loop: LoopNode) -> bool:
    """Whether ``u`` has the same value in every iteration of ``loop``: declared outside its body,
    or a tied parameter declared in it."""
    return not _inside(u.scope, loop) or (u.kind == "parameter" and u.scope is loop and u.attrs["share"])


def _readers(
    graph: VirtualGraph, outputs: Sequence[VirtualNode]
) -> dict[VirtualNode, list[VirtualNode | None]]:
    """Who reads each node, once per read: a node of which it is an input, a loop of which it is
    an update, sequence or structure, a branch of which it is a key or option; ``None`` for an
    output of the build."""
    readers: dict[VirtualNode, list[VirtualNode | None]] = {}
    for v in graph.nodes:
        read: list[VirtualNode] = list(v.inputs)
        if isinstance(v, LoopNode):
            read += [*v.updates.values(), *v.sequences]
            if v.structure is not None:
                read.append(v.structure)
        elif isinstance(v, BranchNode):
            read += [*v.keys, *v.options]
        for u in read:
            readers.setdefault(u, []).append(v)
    for u in outputs:
        readers.setdefault(u, []).append(None)
    return readers


def _row_sums(
    loop: LoopNode,
    eager: Sequence[VirtualNode],
    hoistable: Sequence[VirtualNode],
    readers: dict[VirtualNode, list[VirtualNode | None]],
) -> dict[VirtualNode, tuple[VirtualNode | None, VirtualNode, VirtualNode, VirtualNode | None, bool]]:
    """The sums of ``loop``'s body a build may compute from a hoisted group's rows (see
    :class:`.hoist.RowSum`), keyed by the sum ``s``: ``(a + c, a, c, k, fuse)``.

    - ``s = (a + c) + k`` with ``a`` hoistable, ``c`` not, ``k`` the same in every iteration and
      ``a + c`` read by ``s`` only (``x_t @ W_x + h @ W_h + b``), in either operand order of both
      sums: ``(a + k) + c``, ``a + k`` hoisted with ``a``, one addition per iteration instead of
      two.
    - Any other ``s = a + c`` with ``a`` hoistable and ``c`` not (``(x_t @ W_x + b) + h @ W_h``):
      ``rows[t] + c``; ``a + c`` and ``k`` are then None.

    ``fuse``: ``c`` is a product of the body that only ``a + c`` reads (``h @ W_h``), which the
    build computes with the addition, in one node. Whether the shapes allow it is checked by the
    build (:meth:`.hoist.RowSum.build`).
    """
    grouped = set(hoistable)
    body = set(eager)

    def body_sum(s: VirtualNode) -> bool:
        """Whether ``s`` is a sum computed in every iteration of the body (not hoisted)."""
        return s in body and s.type == "Add" and s.kind == "op" and s not in grouped

    def split(s: VirtualNode) -> tuple[VirtualNode, VirtualNode] | None:
        """``(a, c)`` if ``s`` is a sum of the body with one hoistable input, else None."""
        if not body_sum(s):
            return None
        x, y = s.inputs
        if (x in grouped) == (y in grouped):
            return None
        return (x, y) if x in grouped else (y, x)

    def fuse(c: VirtualNode, s: VirtualNode) -> bool:
        return c in body and c.kind == "op" and c.type == "MatMul" and readers.get(c, ()) == [s]

    found: dict[
        VirtualNode, tuple[VirtualNode | None, VirtualNode, VirtualNode, VirtualNode | None, bool]
    ] = {}
    parts: set[VirtualNode] = set()
    for s in eager:
        if not body_sum(s):
            continue
        for part, k in (s.inputs, s.inputs[::-1]):
            terms = split(part)
            if terms is not None and len(readers.get(part, ())) == 1 and _invariant(k, loop):
                a, c = terms
                found[s] = (part, a, c, k, fuse(c, part))  # (part has one reader, s: no other sum takes it)
                parts.add(part)
                break
    for s in eager:
        terms = split(s)
        if terms is not None and s not in found and s not in parts:
            a, c = terms
            found[s] = (None, a, c, None, fuse(c, s))
    return found


class _Plan:
    """Static per-build facts about a VirtualGraph: what each scope builds eagerly and in what order."""

    def __init__(self, graph: VirtualGraph, outputs: Sequence[VirtualNode]) -> None:
        self.captures: dict[LoopNode, list[VirtualNode]] = {}
        self.stacked: dict[LoopNode, list[VirtualNode]] = {}
        self.finals: dict[LoopNode, list[VirtualNode]] = {}
        self.eager: dict[LoopNode | None, list[VirtualNode]] = {}
        # Each loop's body program, or why it runs node by node (.program; made on first use).
        self.programs: dict[LoopNode, Any] = {}
        # Whether a loop's structure follows from the feed's shapes alone (.program.fixed_by_shapes).
        self.fixed: dict[LoopNode, bool] = {}
        needed: set[VirtualNode] = set()
        # Everything reachable from the outputs, through all branch options (for feed checks).
        stack = list(outputs)
        while stack:
            v = stack.pop()
            if v in needed:
                continue
            needed.add(v)
            if isinstance(v, LoopNode):
                caps = self.captures.setdefault(v, _captures(v))
                stack.extend((*caps, *_loop_inputs(v), *v.updates.values()))
            elif v.kind == "stacked":
                self.stacked.setdefault(_loop_of(v), []).append(v)
                stack.extend(v.inputs)
            elif v.kind == "final":
                self.finals.setdefault(_loop_of(v), []).append(v)
                stack.extend(v.inputs)
            else:
                stack.extend(v.inputs)
        self.needed = needed
        # Per scope, the nodes built eagerly (not only through a branch option), in declaration order.
        # A body marks only nodes of its own scope: what it uses from enclosing scopes is a
        # dependency of the loop node, built on demand when the loop runs (so a loop reached only
        # through an unchosen option builds nothing outside it either).
        eager: set[VirtualNode] = set()
        roots: list[VirtualNode] = list(outputs)
        for loop in self.captures:
            roots.extend(u for u in loop.updates.values() if u.scope is loop)
            roots.extend(s.inputs[1] for s in self.stacked.get(loop, ()))
        stack = roots
        while stack:
            v = stack.pop()
            if v in eager:
                continue
            eager.add(v)
            if v.kind not in _SET_PER_ITERATION:
                stack.extend(d for d in self.deps(v) if d.scope is v.scope)
        for v in graph.nodes:
            if v in eager and v.kind not in _SET_PER_ITERATION:
                self.eager.setdefault(v.scope, []).append(v)
        self.hoistable = {loop: _hoistable(loop, self.eager.get(loop, ())) for loop in self.captures}
        self.readers = _readers(graph, outputs)
        self.row_sums = {
            loop: _row_sums(loop, self.eager.get(loop, ()), self.hoistable[loop], self.readers)
            for loop in self.captures
        }

    def deps(self, v: VirtualNode) -> Sequence[VirtualNode]:
        """What must be built before ``v`` (branch options excluded: they are built on demand)."""
        if isinstance(v, BranchNode):
            return v.keys if v.lead is None else (v.lead, *v.keys)
        if isinstance(v, LoopNode):
            return [*_loop_inputs(v), *self.captures[v]]
        if v.kind in ("final", "stacked"):
            return (v.inputs[0],)
        return v.inputs
