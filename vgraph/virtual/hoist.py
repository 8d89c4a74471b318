"""Hoisting: the body nodes of a loop that depend on no carried state run once for all iterations.

A loop whose trip count is known when it starts (``times=``, stepped sequences; not ``while_``)
computes each hoistable body node (see :func:`.plan._hoistable`) as one op over the stepped
sequence — ``x_t @ W_x`` becomes ``xs[:T] @ W_x``, one ``(T·B, I) @ (I, H)`` product — in a group
node keyed ``<MatMul*:1@idx>`` (``*``: every iteration of ``<MatMul:1>``). Each iteration still has
its own ``<MatMul:1@idx.t>``: a ``Hoisted`` node whose value is a view of row ``t`` of the group's
value and whose gradient lands in the group's gradient buffer in place. Keys, values, retained
gradients, dirty checking and guards are those of the plain unroll; only the arithmetic is grouped.

Two more rewrites follow from the groups (a plain build's own graph only, not a batched build's):

- A sum ``a + c`` of hoisted work ``a`` and per-iteration work ``c`` reads ``a``'s rows from its
  group (:class:`RowSum`): one node per iteration, which also computes ``c`` when ``c`` is a
  product only the sum reads (``h @ W_h``). A sum ``(a + c) + k`` with ``k`` loop-invariant
  (``x_t @ W_x + h @ W_h + b``) is computed as ``(a + k) + c``: ``a + k`` is one more group
  (``<Add*:s>``, the bias added once for all steps), and each iteration makes one addition
  instead of two. Values differ from the plain unroll's in the last bits (floating-point addition
  is not associative), as grouped products' already do.
- A copy that no unrolled node reads (only groups or such sums read ``x_t @ W_x`` above), the
  partial sum ``a + c`` of a reassociated sum, and a product ``c`` a sum computes, are *computed
  when read*
  (:meth:`~vgraph.compute.ComputeGraph.computed_when_read`): no forward to the build's outputs
  would recompute them, so their values are computed from their parents' at every read, never
  kept, never stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..compute import ComputeNode, NodeKey
from ..errors import OpDefinitionError
from ..modes import is_anomaly_enabled
from ..ops import ALONG_AXIS, CELL, ELEMENTWISE, OPS, REDUCTION, Op, densified

if TYPE_CHECKING:
    from .builder import _Builder, _Frame
    from .nodes import LoopNode, VirtualNode

_HOISTED, _GETITEM, _ADD_ROW, _MATMUL_ADD_ROW, _MATMUL = (
    OPS["Hoisted"],
    OPS["GetItem"],
    OPS["AddRow"],
    OPS["MatMulAddRow"],
    OPS["MatMul"],
)

# Ops whose rule in batched_attrs is their own rather than their kind's (Op.kind), and which a
# loop body may hoist.
_HOISTABLE_OWN = frozenset({"MatMul", "Linear", "SoftmaxCrossEntropy", "Take", "GetItem"})
# The kinds whose ops a loop body may hoist (reductions are grouped only when batching).
_HOISTABLE_KINDS = (ELEMENTWISE, ALONG_AXIS, CELL)


def hoistable(op: Op) -> bool:
    """Whether a loop body may hoist nodes of ``op`` (see :func:`.plan._hoistable`): an op that
    :func:`batched_attrs` can group whatever the shapes turn out to be, given the rules it checks
    at build time — every op declared elementwise (a :func:`vgraph.defop` op's too), along an
    axis or a fused cell, and the products, look-ups and indexing it has rules for."""
    return op.kind in _HOISTABLE_KINDS or op.name in _HOISTABLE_OWN


def batched_attrs(
    op: Op,
    attrs: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    stacked: Sequence[bool],
    count: int,
) -> dict[str, Any] | None:
    """The attributes with which ``op`` computes many copies at once, or ``None`` if it cannot.

    ``shapes`` are the per-copy shapes of the op's
    inputs; ``stacked[i]`` says whether input ``i`` gets a new leading axis (one row per copy:
    iterations when hoisting, inputs when batching) or is the same for every copy. The grouped op
    must give, along that axis, exactly each copy's value: so a stacked input must have the
    largest rank (numpy aligns shapes on the right, and the new axis must not meet another
    input's axis), and axis attributes move by one. What an op allows follows from its declared
    kind (:data:`vgraph.ops.KINDS`), or from a rule of its own. ``count`` is the number of copies
    (the length of the new axis).
    """
    name, kind = op.name, op.kind
    if not any(stacked):
        return None  # the same value for every copy: nothing to group
    rank = max(len(s) for s in shapes)
    if name == "MatMul":
        (a, b), (sa, sb) = shapes, stacked
        if sb:  # batched right operand, a matrix or a stack of them; a stacked too (its new axis
            # meets b's: the same rank) or shared (its axes must not meet b's new one)
            return attrs if len(b) >= 2 and (len(a) == len(b) if sa else len(a) <= len(b)) else None
        if len(b) == 2:
            return attrs if len(a) >= 1 else None  # (T, ..., I) @ (I, H)
        # a stack of matrices (..., I, H), each multiplying its own rows (..., rows, I): the new
        # axis must not meet the stack's axes
        return attrs if len(b) > 2 and len(a) >= len(b) else None
    if name == "Linear":  # x @ w + b: as the product, with the bias (the product's last axes) shared
        return None if stacked[2] else batched_attrs(_MATMUL, attrs, shapes[:2], stacked[:2], count)
    if name == "Take":  # a shared table looked up with stepped indices
        return attrs if not stacked[0] and stacked[1] else None
    if name == "SoftmaxCrossEntropy":  # rows of (..., V) logits with their (...) labels: both stacked
        return attrs if all(stacked) else None
    if any(st and len(s) != rank for s, st in zip(shapes, stacked)):
        return None
    if kind in (ELEMENTWISE, CELL):  # each element alone: the new axis is one more to broadcast
        return attrs
    if name == "Concat":  # numpy does not broadcast a concatenation: every input needs its rows
        if not all(stacked):
            return None
        axis = attrs.get("axis", 0)
        return attrs if axis < 0 else {**attrs, "axis": axis + 1}
    if kind == ALONG_AXIS or name == "TakeAlongAxis":
        axis = attrs.get("axis", -1)
        return attrs if axis < 0 else {**attrs, "axis": axis + 1}
    if kind == REDUCTION:
        axis = attrs.get("axis")
        if axis is None:
            axis = tuple(range(rank))
        moved = tuple(a if a < 0 else a + 1 for a in (axis if isinstance(axis, tuple) else (axis,)))
        if len(moved) == 1:
            return {**attrs, "axis": moved[0]}
        if name in ("ArgMax", "ArgMin"):  # numpy's argmax takes one axis (None: the flat index)
            return None
        return {**attrs, "axis": moved}
    if name == "GetItem":  # a basic index (ints, slices): the same index after the new axis
        index = attrs["index"]
        items = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(i, (int, np.integer, slice)) for i in items):
            return None
        return {**attrs, "index": (slice(None), *items)}
    if name == "Reshape":
        return {**attrs, "shape": (count, *attrs["shape"])}
    if name == "Transpose":
        axes = attrs.get("axes")
        axes = tuple(reversed(range(rank))) if axes is None else tuple(a % rank for a in axes)
        return {**attrs, "axes": (0, *(a + 1 for a in axes))}
    return None


def rows_op(op: Op, shapes: Sequence[tuple[int, ...]], stacked: Sequence[bool]) -> Op | None:
    """An op computing many copies of ``op`` at once (inputs ``stacked`` along a new axis 0, as
    :func:`batched_attrs` says) where no attributes can: a product with a vector, each copy its
    own (``(K,) @ (K, N)``, ``(M, K) @ (K,)``, ``(K,) @ (K,)``), where numpy would pair every
    copy's vector with every copy's matrix. It runs the copies' vectors as one-row (or one-column)
    matrices, as ``np.matmul`` does for one copy. ``None`` for anything else."""
    if op.name != "MatMul" or op.user or not any(stacked):
        return None
    (a, b), (sa, sb) = shapes, stacked
    if len(a) + len(b) > 3:  # (a matrix times a matrix: batched_attrs's)
        return None
    row, column = sa and len(a) == 1, sb and len(b) == 1
    if not (row or column):  # a stacked matrix times a shared vector: numpy pairs them right
        return op
    return _vector_products[(row, column)]


def _vector_product(row: bool, column: bool) -> Op:
    """``MatMul`` over copies whose left operand is a vector (``row``: read as ``(n, 1, K)``)
    and/or whose right one is (``column``: read as ``(n, K, 1)``)."""

    def widen(a: Any, b: Any) -> tuple[Any, Any]:
        return (a[:, None, :] if row else a), (b[:, :, None] if column else b)

    def narrow(x: Any) -> Any:
        if row and column:
            return x[:, 0, 0]
        return x[:, 0] if row else x[..., 0]

    def unnarrow(x: Any) -> Any:  # (the product's shape, from its value or gradient)
        if row and column:
            return x[:, None, None]
        return x[:, None] if row else x[..., None]

    def forward(a: Any, b: Any) -> Any:
        return narrow(_MATMUL.forward(*widen(a, b)))

    def vjp(p: int) -> Any:
        inner = cast(tuple[Any, ...], _MATMUL.vjps)[p]
        widened = row if p == 0 else column

        def grad(g: Any, ans: Any, a: Any, b: Any) -> Any:
            wa, wb = widen(a, b)
            d = densified(inner(unnarrow(g), unnarrow(ans), wa, wb))
            if not widened:
                return d
            return d[:, 0] if p == 0 else d[..., 0]

        return grad

    return Op("MatMulRows", forward, (vjp(0), vjp(1)), arity=2)


_vector_products = {(r, c): _vector_product(r, c) for r, c in ((True, False), (False, True), (True, True))}


def checks_rows(op: Op) -> bool:
    """Whether a group of ``op`` is checked against its first copy run alone (:func:`check_rows`):
    a user's op declared elementwise, under anomaly detection (built-in ops are trusted)."""
    return op.user and is_anomaly_enabled()


def check_rows(op: Op, key: NodeKey, ans: Any, xs: Sequence[Any], attrs: dict[str, Any] | None) -> None:
    """Check a :func:`vgraph.defop` op's promise to act elementwise on one group of its copies:
    ``ans``, the part of the group's value that is copy ``key``'s, must be what the op computes
    from that copy's input values ``xs`` alone. Called where :func:`checks_rows` says so (under
    anomaly detection), so that the normal path neither checks nor gathers ``xs``.

    Raises:
        OpDefinitionError: the values differ (the op's forward mixes elements, e.g. sums along
            an axis): the grouped paths would compute wrong values.
    """
    alone = np.asarray(op.forward(*xs, **(attrs or {})))
    if alone.shape == np.shape(ans) and np.allclose(alone, ans, equal_nan=True):
        return
    raise OpDefinitionError(
        f"<{key}>: {op.name} was declared elementwise (vgraph.defop(..., elementwise=True)), but "
        f"computed as one call with other copies it gives <{key}> a value (shape {np.shape(ans)}) "
        f"that differs from the op run on <{key}>'s inputs alone (shape {alone.shape}): its forward "
        "does not act on each element alone (does it reduce, or mix values along an axis?). Define "
        "it without elementwise=True"
    )


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
            op = cast("Op", v.op)  # plan._hoistable lists only op nodes
            attrs = batched_attrs(op, v.attrs, shapes, stacked, trips)
            if attrs is not None:
                group = groups[v] = cg._add_op(
                    op, tuple(inputs), attrs, NodeKey(v.type + "*", v.id, idx), v.name
                )
                if checks_rows(op):  # its promise to act elementwise
                    xs = [n._value[0] if st else n._value for n, st in zip(inputs, stacked)]
                    check_rows(op, NodeKey(v.type, v.id, (*idx, 0)), group._value[0], xs, v.attrs)
    return groups


class RowSum:
    """A loop body's sum of hoisted work ``a`` and per-iteration work ``c``, built to read ``a``'s
    rows straight from a group (see :func:`.plan._row_sums`). Stands in a body's build order where
    the sum was.

    - ``s = a + c`` (``x_t @ W_x + h @ W_h``; ``nn.RNNCell``'s ``(x_t @ W_x + b) + h @ W_h``, its
      first term hoisted whole): ``<Add:s@t>`` is an ``AddRow`` node, ``rows[t] + c``, reading the
      group of ``a`` directly, where a ``Hoisted`` copy and an ``Add`` would be two nodes.
    - ``s = (a + c) + k`` with ``k`` the same in every iteration (``x_t @ W_x + h @ W_h + b``) is
      reassociated as ``(a + k) + c``: ``a + k`` for every iteration is one more hoisted group
      ``<Add*:s>`` (``group``), whose rows ``<Add:s@t>`` adds to ``c``; the partial sum
      ``<Add:a+c@t>`` keeps its key, computed when read, its gradient ``<Add:s@t>``'s (see
      :meth:`~vgraph.compute.ComputeGraph.computed_when_read`).

    Where ``c`` is a product that only the sum reads (``h @ W_h``: ``fuse``), the sum is a
    ``MatMulAddRow`` node (``rows[t] + h @ W_h``, reading ``h``, ``W_h`` and the group) and
    ``<MatMul:c@t>`` keeps its key, computed when read, its gradient the sum's: one node and one
    kept array fewer per iteration. All of it needs ``a``, ``c`` and the sum of one shape and dtype
    (``k`` neither broadcasts nor promotes the partial sum, and the sum broadcasts neither term):
    an iteration where they are not is built as declared.
    """

    op = None  # (read by _Builder.run_scope: not an op of the body)
    kind = "row sum"

    def __init__(
        self,
        total: VirtualNode,
        part: VirtualNode | None,
        a: VirtualNode,
        c: VirtualNode,
        group: ComputeNode,
        fuse: bool,
    ) -> None:
        self.total, self.part, self.a, self.c, self.group = total, part, a, c, group
        self.fuse = fuse  # c is a product only the sum reads, built here (see .plan._row_sums)
        self.declared = False  # whether some iteration built the sum as declared (see build)

    @property
    def reader(self) -> VirtualNode:
        """The node of the body that reads ``a``: the partial sum, or the sum itself."""
        return self.total if self.part is None else self.part

    def build(self, cg: Any, env: dict[Any, Any], idx: tuple[int, ...]) -> None:
        """Add iteration ``idx``'s nodes of the sum to ``cg`` and ``env``."""
        total = self.total
        product = _declared(cg, env, self.c, idx) if self.fuse else env[self.c]  # (only the sum reads it)
        a, c, rows = env[self.a]._value, product._value, self.group._value
        partial = _declared(cg, env, self.part, idx) if self.part is not None else None
        if not (a.shape == c.shape == rows.shape[1:] and a.dtype == c.dtype == rows.dtype):
            # the partial sum's gradient would not be the whole sum's (k broadcasts or promotes it),
            # or the sum broadcasts its terms: built as declared
            self.declared = True
            _declared(cg, env, total, idx)
            return
        key, index = NodeKey(total.type, total.id, idx), {"index": idx[-1]}
        if self.fuse:  # the sum computes the product too; the product's value is the one above
            value = rows[idx[-1]] + c
            node = cg._add_op(_MATMUL_ADD_ROW, (*product.parents, self.group), index, key, total.name, value)
            cg._defer(product, node)
        else:
            node = cg._add_op(_ADD_ROW, (self.group, product), index, key, total.name)
        env[total] = node
        if partial is not None:  # the group <Add*:s> has no other row readers (copies)
            cg._add_copy(self.group, node)
            cg._defer(partial, node)  # (computed once above: no forward computes it again)


def _declared(cg: Any, env: dict[Any, Any], v: VirtualNode, idx: tuple[int, ...]) -> ComputeNode:
    """Add op node ``v`` of a body's iteration ``idx`` as the body declares it, to ``cg`` and
    ``env``."""
    node: ComputeNode = cg._add_op(
        cast("Op", v.op), tuple([env[u] for u in v.inputs]), v.attrs, NodeKey(v.type, v.id, idx), v.name
    )
    env[v] = node
    return node


def row_sums(
    builder: _Builder,
    loop: LoopNode,
    frame: _Frame,
    captured: dict[VirtualNode, ComputeNode],
    groups: dict[VirtualNode, ComputeNode],
    trips: int,
) -> dict[VirtualNode, RowSum]:
    """What stands in the body's build order for each sum of ``loop`` that the plan may build row
    by row (:func:`.plan._row_sums`) and whose ``a`` is grouped, by sum; builds the hoisted group
    ``a + k`` of those it reassociates."""
    cg, idx = builder.cg, frame.idx
    made: dict[VirtualNode, RowSum] = {}
    for total, (part, a, c, k, fuse) in builder.plan.row_sums[loop].items():
        group = groups.get(a)
        if group is None:
            continue
        if k is None:  # a + c (no partial sum): the rows of a's own group
            made[total] = RowSum(total, None, a, c, group, fuse)
            continue
        if k.kind == "parameter" and k.scope is loop:  # a tied parameter declared in the body
            invariant = cg.add_leaf(builder.parameter(k, idx))
        else:
            invariant = captured[k]
        pair = (group, invariant) if total.inputs[0] is part else (invariant, group)
        shapes = [p._value.shape[1:] if p is group else p._value.shape for p in pair]
        attrs = batched_attrs(cast("Op", total.op), total.attrs, shapes, [p is group for p in pair], trips)
        if attrs is None:
            continue
        node = cg._add_op(cast("Op", total.op), pair, attrs, NodeKey("Add*", total.id, idx), None)
        made[total] = RowSum(total, part, a, c, node, fuse)
    return made


def defer_unread(
    builder: _Builder,
    loop: LoopNode,
    groups: dict[VirtualNode, ComputeNode],
    sums: dict[VirtualNode, RowSum],
    made: int,
) -> None:
    """Make every copy of a hoisted node that nothing built reads computed when read (see
    :meth:`~vgraph.compute.ComputeGraph.computed_when_read`).

    Where only hoisted work reads ``x_t @ W_x`` (its group ``<MatMul*:1>``, or a sum built row by
    row), no forward to the build's outputs would recompute the copies ``<MatMul:1@t>``: their
    values, views of an earlier group value, would go stale. Computed when read, each is row ``t``
    of the group's current value. Decided from the plan where it can be: copies whose readers are
    all groups or sums built row by row are read by no node, copies that an ungrouped op of the body,
    a stack or the loop's update reads are read in every iteration; only for readers that may not
    be built in every iteration (a branch option, an inner loop, an output) are the loop's nodes
    looked at. ``made``: how many nodes the loop added after its groups (its iterations and stacks,
    the last nodes of the graph).
    """
    cg, readers = builder.cg, builder.plan.readers
    body = set(builder.plan.eager.get(loop, ()))
    by_reader = {r.reader: r for r in sums.values()}
    updates = set(loop.updates.values())
    unsure: list[ComputeNode] = []
    for v, group in groups.items():
        if v in updates:  # read by the loop's final state
            continue
        read = readers.get(v, ())
        if all(
            r is not None and (r in groups or (r in by_reader and not by_reader[r].declared)) for r in read
        ):
            for copy in cg._groups.get(group, ()):
                cg._defer(copy)
        elif not any(
            r is not None and (r.kind == "stacked" or (r in body and r.kind == "op" and r not in groups))
            for r in read
        ):
            unsure.append(group)
    if unsure:
        deferred = cg._deferred
        seen: set[ComputeNode] = set()
        nodes = reversed(cg._nodes.values())
        for _ in range(made):
            n = next(nodes)
            if n not in deferred:  # (a node computed when read reads its parents only then)
                seen.update(n.parents)
        for group in unsure:
            for copy in cg._groups.get(group, ()):
                if copy not in seen:
                    cg._defer(copy)
