"""Hoisting: the body nodes of a loop that depend on no carried state run once for all iterations.

A loop whose trip count is known when it starts (``times=``, stepped sequences; not ``while_``)
computes each hoistable body node (see :func:`.plan._hoistable`) as one op over the stepped
sequence — ``x_t @ W_x`` becomes ``xs[:T] @ W_x``, one ``(T·B, I) @ (I, H)`` product — in a group
node keyed ``<MatMul*:1@idx>`` (``*``: every iteration of ``<MatMul:1>``). Each iteration still has
its own ``<MatMul:1@idx.t>``: a ``Hoisted`` node whose value is a view of row ``t`` of the group's
value and whose gradient lands in the group's gradient buffer in place. Keys, values, retained
gradients, dirty checking and guards are those of the plain unroll; only the arithmetic is grouped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..compute import ComputeNode, NodeKey
from ..ops import OPS

if TYPE_CHECKING:
    from .nodes import LoopNode, VirtualNode
    from .unroll import _Builder, _Frame

_HOISTED, _GETITEM = OPS["Hoisted"], OPS["GetItem"]
_SOFTMAXES = ("Softmax", "LogSoftmax")


def batched_attrs(
    op: str, attrs: dict[str, Any], shapes: Sequence[tuple[int, ...]], stacked: Sequence[bool]
) -> dict[str, Any] | None:
    """The attributes with which ``op`` computes every iteration at once, or ``None`` if it cannot.

    ``shapes`` are the per-iteration shapes of the op's inputs; ``stacked[i]`` says whether input
    ``i`` gets a leading iteration axis (a stepped item or another hoisted node) or is the same in
    every iteration. The grouped op must give, along its leading axis, exactly each iteration's
    value: so a stacked input must have the largest rank (numpy aligns shapes on the right, and the
    iteration axis must not meet another input's axis).
    """
    if not any(stacked):
        return None  # the same value every iteration: nothing to group
    rank = max(len(s) for s in shapes)
    if op == "MatMul":
        (a, b), (sa, sb) = shapes, stacked
        if sb:  # batched right operand: both must be matrices (a may be shared)
            return attrs if len(b) >= 2 and (len(a) >= 2 or not sa) else None
        return attrs if len(b) == 2 and len(a) >= 1 else None  # (T, ..., I) @ (I, H)
    if op == "Take":  # a shared table looked up with stepped indices
        return attrs if not stacked[0] and stacked[1] else None
    if any(st and len(s) != rank for s, st in zip(shapes, stacked)):
        return None
    if op in _SOFTMAXES:
        axis = attrs.get("axis", -1)
        return attrs if axis < 0 else {**attrs, "axis": axis + 1}
    return attrs  # elementwise (the plan admits only HOISTABLE_OPS)


def hoist_loop(
    builder: _Builder,
    loop: LoopNode,
    frame: _Frame,
    captured: dict[VirtualNode, ComputeNode],
    seqs: Sequence[ComputeNode],
    trips: int,
) -> dict[VirtualNode, ComputeNode]:
    """Build the group node of every stepped item and of every hoistable body node of ``loop``
    that can be grouped.

    A stepped item's group ``<Item*:k>`` is the sequence's first ``trips`` rows (a view), so that
    its copies, like every other copy, are rows of a group whose only readers are its copies and
    other groups: a copy's gradient is then exactly its row of the group's gradient.

    Returns:
        Group nodes by virtual node, in a topological order; the caller adds each iteration's ``Hoisted``
        copy and registers it with ``UnrolledGraph._add_copy``.
    """
    cg, idx = builder.cg, frame.idx
    groups: dict[VirtualNode, ComputeNode] = {}
    sequences = dict(zip(loop.items, seqs))
    for v in builder.plan.hoistable[loop]:
        inputs: list[ComputeNode] = []
        shapes: list[tuple[int, ...]] = []
        stacked: list[bool] = []
        for u in v.inputs:
            node = groups.get(u)
            if node is None and u in sequences:  # a stepped item, grouped on first use
                rows = slice(0, trips)
                if u.attrs.get("reverse"):  # rows len-1, len-2, ... (a view with a negative stride)
                    last = len(sequences[u]._value) - 1
                    rows = slice(last, last - trips if last - trips >= 0 else None, -1)
                node = groups[u] = cg._add_op(
                    _GETITEM, (sequences[u],), {"index": rows}, NodeKey("Item*", u.id, idx), u.name
                )
            if node is not None:
                inputs.append(node)
                shapes.append(node._value.shape[1:])
                stacked.append(True)
                continue
            if u.kind == "parameter" and u.scope is loop:  # a tied parameter declared in the body
                node = cg.add_leaf(builder.parameter(u, idx))
            else:
                node = captured.get(u)
            if node is None:  # an input that is itself not grouped: v runs per iteration
                break
            inputs.append(node)
            shapes.append(node._value.shape)
            stacked.append(False)
        else:
            attrs = batched_attrs(v.type, v.attrs, shapes, stacked)
            if attrs is not None:
                groups[v] = cg._add_op(v.op, tuple(inputs), attrs, NodeKey(v.type + "*", v.id, idx), v.name)
    return groups
