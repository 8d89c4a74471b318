"""Autobatching: build many inputs at once, running copies of the same declared node together.

``g.build_batch([feed_1, …, feed_n], outputs)`` unrolls every input with the ordinary builder —
each in its own greenlet, so loop conditions, branch selectors and recursion structures are
evaluated on that input's own values, when they are ready — but no input computes an op by itself:
each op it asks for is handed to a scheduler, which waits until every live input has asked for its
next op, picks the declared node ``<type,id>`` that comes first in declaration order among those
asked for, and runs the requests for it with compatible shapes as **one** numpy operation on their
stacked inputs (the rules of :func:`.hoist.batched_attrs`). Inputs with different trip counts,
branch choices and trees thus proceed independently and still meet wherever the same declared
node is computed: that identity — every unrolled node is a copy of a declared node — is what
DyNet's and TensorFlow Fold's autobatching lack.

An input's value of a batched node is a row of the group's result, never a node of its own; its
gradient is that row of the group's gradient. So the batched graph has one node per group (plus
the gathers that stack rows which do not come in order), and one backward sweep serves every input.
Decisions are per input; results equal building the inputs one at a time (tested to 1e-12).

Where the structure is known when a loop or recursion starts, the scheduler skips the per-op
round trip: loops of known trip count with ops-only bodies run in lockstep across inputs
(:meth:`BatchedBuild._run_jobs`), recursions in depth order — the ready tree nodes of every input
together (:meth:`BatchedBuild._run_tree_jobs`) — and copies whose inputs differ in length only run
on their inputs concatenated along axis 0 when the op acts on each row alone (:func:`_ragged`).
docs/decisions.md says why.

By default (``programs=None`` or ``True``; ``False`` or ``vg.body_programs(False)`` turn it off)
such a lockstep loop runs as ONE body program over rows (:meth:`BatchedBuild._run_rows`): the
step that ``g.build`` compiles for the loop's body (:mod:`.program`), with its ops' axis
attributes moved by one (:func:`.hoist.batched_attrs`), runs once per iteration on the rows of
every input still running — rows ordered longest run first, so those are a prefix — and its
backward step once per iteration in backward; the loop is one node of the batched graph. A
recursion in depth order likewise runs as one program over tree nodes
(:meth:`BatchedBuild._run_tree_rows`): once per level on every input's tree nodes of that level,
children gathered by index. A branch chooses per row (a level's rows split by choice where they
differ). Where the body's ops cannot run on rows, or a loop's trip count is not known when it
starts, the loop runs op by op as without programs (a loop with branches: in each input's
builder), and ``batch.inputs[i].interpreted`` says why.

Scope: hoisting applies inside each input as in ``g.build`` (``hoist=True``); a batched build is
one-shot (no ``feed``/re-run forward: build again) and never uses ``g.build``'s cache of
structures; checkpointed loops are a typed error. ``batch.unrolled(i)`` gives input ``i`` built
alone, for inspection and drawing (``vgraph.render``).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NoReturn, cast

import numpy as np

from ..compute import _ALL, ComputeGraph, ComputeNode, NodeKey, flag_arg
from ..errors import (
    ArgumentError,
    BackwardError,
    BuildError,
    GraphStateError,
    NonFiniteError,
    VGraphError,
)
from ..modes import detect_anomaly as detect_anomaly_mode
from ..modes import is_anomaly_enabled, is_grad_enabled, no_grad, programs_mode
from ..ops import ALONG_AXIS, CELL, ELEMENTWISE, OPS, Op, OpResultError, add_at, densified, row_at
from ..workspace import computing, gc_paused
from .builder import _Builder, _check_structure, _Frame, _iteration_views, _read_children, _stepped_sequences
from .graph import one_build_at_a_time
from .hoist import batched_attrs, check_rows, checks_rows, hoist_loop, rows_op
from .nodes import BranchNode, LoopNode, VirtualNode
from .padded import NO_MASKS, Masking, MaskKey, Padded, ScaleKey, rule, step_input
from .program import (
    BodyProgram,
    ProgramRun,
    RunGrad,
    SweptOnce,
    _Acc,
    _grad_dtype,
    _seed_vjp,
    program_for,
    vjp_of,
)
from .rules import at_limit, check_carry, run_cond, select_option
from .unroll import _check_outputs, _checked_feed
from .unrolled import Decision, UnrolledGraph, find_decision

_GATHER, _GETITEM, _STACK, _SUM, _MEAN = (
    OPS["GatherRows"],
    OPS["GetItem"],
    OPS["Stack"],
    OPS["Sum"],
    OPS["Mean"],
)
_HOISTED, _CONCAT, _PAD_STACK = OPS["Hoisted"], OPS["Concat"], OPS["PadStack"]
_PASS = ("Branch", "Identity")  # ops that pass their first input on unchanged
_ASK = object()  # InputView._direct: this op must be computed
_SPECIAL = frozenset((*_PASS, "Stack", "GetItem", "Hoisted"))  # ops InputView._add_op looks at


class Row:
    """One input's value inside a batched group: the row of node ``src`` that the basic indices
    ``path`` lead to (a view; see :func:`vgraph.ops.row_at`).

    It stands, in the builder of that input, where an unrolled compute node would; the batched
    graph has no node for it.
    """

    __slots__ = ("_key", "_step", "_v", "_value", "name", "path", "src")
    _key: NodeKey | None  # None: made from _v and _step when read
    _v: VirtualNode
    _step: tuple[int, ...]

    def __init__(self, src: ComputeNode, path: tuple[Any, ...], key: NodeKey, name: str | None) -> None:
        self.src, self.path, self._key, self.name = src, path, key, name
        self._value = row_at(src._value, path)  # a one-shot build: the group's value never changes

    @property
    def key(self) -> NodeKey:
        """The key the unrolled node would have (``<type,id,idx>``)."""
        key = self._key
        if key is None:  # a lockstep loop's row: its key is made when first read (see _lazy_key)
            v = self._v
            key = self._key = NodeKey(v.type, v.id, self._step)
        return key

    @property
    def value(self) -> Any:
        return self._value

    @property
    def shape(self) -> tuple[int, ...]:
        return np.shape(self._value)

    def describe(self) -> str:
        return f"<{self.key}>" + (f" '{self.name}'" if self.name else "")

    def __repr__(self) -> str:
        return f"Row({self.describe()} = <{self.src.key}>{''.join(f'[{i}]' for i in self.path)})"


def _row_at(src: Any, index: int, key: NodeKey | None, name: str | None) -> Row:
    """Row ``index`` of ``src`` (a node, or a row of one: then a row of that row). ``key`` None:
    the caller sets the row's ``_v`` and ``_step`` (see :func:`_lazy_key`)."""
    row = _new_row(Row)
    row._key, row.name, row._value = key, name, src._value[index]
    if type(src) is Row:
        row.src, row.path = src.src, (*src.path, index)
    else:
        row.src, row.path = src, (index,)
    return row


def _row(src: ComputeNode, r: int, req: _Request) -> Row:
    """Row ``r`` of ``src`` for request ``req`` (``Row(src, (r,), …)`` without the generic path walk)."""
    row = _new_row(Row)
    row.src, row.path, row._key, row.name, row._value = src, (r,), req.key, req.name, src._value[r]
    return row


def _lazy_key(row: Row, v: VirtualNode, step: tuple[int, ...]) -> Row:
    """Give ``row`` the key of ``v`` at ``step``, made only when read. A lockstep loop makes a row
    per input, iteration and body node, and their keys are read only for messages, drawings and
    look-ups: making them eagerly cost a NodeKey object each (a third of a batched build's
    objects, all traversed by the garbage collector)."""
    row._key, row._v, row._step = None, v, step
    return row


_new_row = object.__new__


class _Request:
    __slots__ = ("agent", "attrs", "inp", "key", "name", "op", "parents")

    def __init__(
        self, inp: int, op: Op, parents: tuple[Any, ...], attrs: Any, key: NodeKey, name: str | None
    ):
        self.inp, self.op, self.parents, self.attrs, self.key, self.name = inp, op, parents, attrs, key, name
        self.agent: Any = None  # the greenlet that waits for the result


class _Spawn:
    """What a greenlet of a tree-node-wise recursion hands the scheduler instead of a request:
    greenlets to start (tree nodes whose children are built), then one to resume (the input's
    own greenlet, when the last tree node is built), if any."""

    __slots__ = ("resume", "start")

    def __init__(self, start: list[Any], resume: Any = None) -> None:
        self.start, self.resume = start, resume


class _LoopJob:
    """One input's run of a loop that the scheduler runs in lockstep with the other inputs' runs
    of the same declared loop (see :meth:`_BatchBuilder._run_lockstep`): what the input's builder
    prepared, and what the scheduler hands back (the final state and the stacked values)."""

    __slots__ = ("agent", "capped", "captured", "collected", "count", "decisions", "declined", "groups", "idx",
                 "inp", "key", "length", "loop", "seqs", "stacks", "state", "trips", "view")  # fmt: skip

    def __init__(self, view: InputView, loop: LoopNode, idx: tuple[int, ...], state: list[Any],
                 seqs: list[Any], length: int | None, trips: int | None, captured: dict[VirtualNode, Any],
                 groups: dict[VirtualNode, Any]) -> None:  # fmt: skip
        self.view, self.inp, self.loop, self.idx = view, view.index, loop, idx
        self.state, self.seqs, self.length, self.trips = state, seqs, length, trips
        self.captured, self.groups = captured, groups
        self.collected: list[list[Any]] = []
        self.key = NodeKey(loop.type, loop.id, idx)
        self.agent: Any = None
        self.count = 0  # iterations run
        self.capped: int | None = None  # the iteration at which max_iters stopped it (on_limit="stop")
        self.stacks: list[Any] | None = None  # the stacked values, when a program over rows ran it
        self.decisions: list[list[Any]] = []  # per iteration, its branches' (when a program ran it)
        # a loop with branches that no program over rows ran: the input's builder runs it itself
        self.declined = False


class _TreeJob(_LoopJob):
    """One input's run of a recursion that the scheduler builds tree node by tree node in depth
    order together with the other inputs' runs of it (:meth:`BatchedBuild._run_tree_jobs`)."""

    __slots__ = ("chosen", "history", "parents", "reads", "remaining", "rows")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        n = cast(int, self.trips)  # a recursion's node count: always known
        self.decisions = [[] for _ in range(n)]
        self.reads: list[tuple[VirtualNode, int, int]] = []
        self.rows: list[list[int]] = []
        self.parents: list[list[int]] = []
        self.remaining: list[int] = []
        self.history: list[Any] = []
        self.chosen: dict[Any, int] = {}


class _Member:
    """One tree node of one input in a joint run: its iteration environment."""

    __slots__ = ("env", "idx", "job", "path", "t")

    def __init__(self, job: _TreeJob, t: int, env: dict[VirtualNode, Any]) -> None:
        self.job, self.t, self.env = job, t, env
        self.idx = (*job.idx, t)
        self.path: tuple[Any, ...] = ()  # the branch choices made so far in this iteration


def _rows_of(paths: list[tuple[Any, ...]]) -> Any:
    """One index that picks the rows ``paths`` lead to (in order) from their common source, when
    there is one: integers along axis 0 — ``(r,)`` is row ``r``, ``(slice(a, b), t)`` row ``a + t``
    (step ``t`` of a sentence concatenated with others) — or ``(k, rows)`` for ``((slice(None), r),
    k)`` (one slab of a fused cell's rows); else ``None``."""
    p0 = paths[0]
    if len(p0) == 2 and type(p0[1]) is int and isinstance(p0[0], tuple):
        k = p0[1]
        rows = []
        for p in paths:
            if (
                len(p) != 2
                or p[1] != k
                or not isinstance(p[0], tuple)
                or len(p[0]) != 2
                or p[0][0] != slice(None)
            ):
                return None
            rows.append(p[0][1])
        return (k, np.asarray(rows, dtype=np.intp))
    rows = []
    for p in paths:
        if len(p) == 1 and type(p[0]) is int:
            rows.append(p[0])
        elif (
            len(p) == 2
            and type(p[0]) is slice
            and type(p[1]) is int
            and p[0].step is None
            and p[0].start is not None
            and 0 <= p[1] < p[0].stop - p[0].start
        ):
            rows.append(p[0].start + p[1])
        else:
            return None
    return np.asarray(rows, dtype=np.intp)


def _dependents(rows: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Per tree node of a children array (as lists), how many distinct children it has, and
    which nodes have it as a child."""
    remaining = [len({c for c in row if c >= 0}) for row in rows]
    parents: list[list[int]] = [[] for _ in rows]
    for t, row in enumerate(rows):
        for c in set(row):
            if c >= 0:
                parents[c].append(t)
    return remaining, parents


def _by_input(r: Any) -> int:
    """Sort key of requests and jobs: their input's index."""
    inp: int = r.inp
    return inp


def _same_signature(requests: list[_Request]) -> tuple[list[_Request], list[bool] | None]:
    """The requests (in order) with the most common signature (the first such, on a tie) — or all
    of them when their rows differ in length only and the op acts on each row alone
    (:func:`_ragged`: which inputs to concatenate; ``None`` for requests of one signature)."""
    sig = _signature(requests[0])
    sigs = [_signature(r) for r in requests]
    if all(x == sig for x in sigs):
        return requests, None
    ragged = _ragged(requests)
    if ragged is not None:
        return requests, ragged
    by_sig: dict[Any, list[_Request]] = {}
    for r, x in zip(requests, sigs):
        by_sig.setdefault(x, []).append(r)
    return max(by_sig.values(), key=len), None


# Ops that compute each row (along axis 0) of their inputs on its own, given the rules _ragged
# checks: copies whose inputs differ in length (sentences of different lengths) run as one op on
# the inputs concatenated along axis 0, and each copy's value is its rows of the result. Besides
# these, every op declared elementwise or along an axis (Op.kind; a vgraph.defop op's too).
_RAGGED_OWN = frozenset(
    ["MatMul", "Linear", "Take", "Concat", "TakeAlongAxis", "Reshape", "GetItem", "SoftmaxCrossEntropy"]
)
_RAGGED_KINDS = (ELEMENTWISE, ALONG_AXIS)


def _segment_sum(x: np.ndarray, starts: np.ndarray, sizes: np.ndarray, whole: bool, mean: bool) -> np.ndarray:
    """Per segment of rows of ``x`` (segment ``k`` starts at row ``starts[k]`` and has
    ``sizes[k]`` rows, at least one): the sum (``mean``: the mean) of its rows — of all its
    elements if ``whole``."""
    out = np.add.reduceat(x, starts, axis=0)
    if whole:
        out = out.reshape(len(starts), -1).sum(axis=1)
    if mean:
        out = out / _counts(sizes, x, whole, out.ndim)
    return out


def _counts(sizes: np.ndarray, x: np.ndarray, whole: bool, ndim: int) -> np.ndarray:
    """The number of elements each segment's mean divides by, in ``x``'s dtype (an integer array
    would make a float32 mean float64), shaped to broadcast against an array of ``ndim`` axes."""
    counts = (sizes * (x[0].size if whole else 1)).astype(x.dtype if x.dtype.kind == "f" else np.float64)
    return counts.reshape((-1,) + (1,) * (ndim - 1))


def _segment_sum_vjp(
    g: np.ndarray,
    ans: np.ndarray,
    x: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    whole: bool,
    mean: bool,
) -> np.ndarray:
    if mean:
        g = g / _counts(sizes, x, whole, g.ndim)
    if whole:
        g = g.reshape((-1,) + (1,) * (x.ndim - 1))
    out: np.ndarray = np.broadcast_to(np.repeat(g, sizes, axis=0), x.shape)
    return out


#: Copies of ``Sum`` or ``Mean`` over axis 0 (or every axis) of inputs of different lengths, run as
#: one reduction of each input's rows of their concatenation (see :func:`_ragged`).
_SEGMENT_SUM = Op("SegmentSum", _segment_sum, (_segment_sum_vjp,), arity=1)


def _ragged(requests: list[_Request]) -> list[bool] | None:
    """Whether the requests can run as one op on their inputs concatenated along axis 0: which
    inputs are concatenated (``True``; the others are one node shared by every request) — or
    ``None`` if they cannot. Concatenated inputs must agree on every axis but the first, and
    have as many rows as each other within a request; a shared input must not reach axis 0
    (fewer axes), and the op must not act along axis 0."""
    first = requests[0]
    name, kind = first.op.name, first.op.kind
    if name in ("Sum", "Mean") and len(requests) > 1:  # a sum or mean of each input's rows
        attrs = first.attrs or {}
        column = [r.parents[0] for r in requests]
        v0 = column[0]._value
        ok = (
            attrs.get("axis") in (None, 0)
            and not attrs.get("keepdims")
            and v0.ndim >= 1
            and v0.dtype.kind == "f"
            and all((r.attrs or {}) == attrs for r in requests)
            and all(p._value.shape[1:] == v0.shape[1:] and p._value.dtype == v0.dtype for p in column)
            and all(len(p._value) > 0 for p in column)
        )
        return [True] if ok else None
    if (
        not (kind in _RAGGED_KINDS or name in _RAGGED_OWN)
        or len(requests) < 2
        or any(len(r.parents) != len(first.parents) for r in requests)
    ):
        return None
    ragged: list[bool] = []
    ndim = None
    for j, p0 in enumerate(first.parents):
        column = [r.parents[j] for r in requests]
        if isinstance(p0, ComputeNode) and all(p is p0 for p in column):
            ragged.append(False)
            continue
        v0 = p0._value
        if v0.ndim < 1 or any(
            p._value.shape[1:] != v0.shape[1:] or p._value.dtype != v0.dtype for p in column
        ):
            return None
        if ndim is not None and v0.ndim != ndim and name not in ("Take", "SoftmaxCrossEntropy"):
            return None
        ndim = v0.ndim if ndim is None else ndim  # the first concatenated input's
        ragged.append(True)
    if not any(ragged):
        return None
    for r in requests:  # within a request, the concatenated inputs have as many rows
        lengths = {p._value.shape[0] for p, rg in zip(r.parents, ragged) if rg}
        if len(lengths) != 1:
            return None
    attrs = first.attrs or {}
    if name == "Take":  # a shared table looked up with indices
        return ragged if ragged == [False, True] else None
    if name == "SoftmaxCrossEntropy":  # (T, …, V) logits with (T, …) labels: a loss per row
        logits, labels = first.parents
        ok = ragged == [True, True] and labels._value.ndim == logits._value.ndim - 1 >= 1
        return ragged if ok else None
    if name in ("MatMul", "Linear"):  # (T, …, K) @ (K, M) [+ (M,)]: rows of the left operand one by one
        ok = ragged[0] and not any(ragged[1:]) and cast(int, ndim) >= 2 and first.parents[1]._value.ndim == 2
        return ragged if ok else None
    for p, rg in zip(first.parents, ragged):
        if not rg and np.ndim(p._value) >= cast(int, ndim):
            return None  # a shared input would meet axis 0
    if name == "Reshape":  # (T, a, b) -> (-1, c) with a*b == c: the rows stay rows
        shape = tuple(attrs.get("shape", ()))
        rest = first.parents[0]._value.shape[1:]
        if not shape or shape[0] != -1 or any(d < 0 for d in shape[1:]):
            return None
        return ragged if int(np.prod(shape[1:])) == int(np.prod(rest)) else None
    if name == "GetItem":  # an index that leaves axis 0 alone: x[:, k], x[..., None]
        index = attrs.get("index")
        items = index if isinstance(index, tuple) else (index,)
        if not all(type(i) in (int, slice) or i is None or i is Ellipsis for i in items):
            return None  # (arrays, booleans: not a basic index that leaves axis 0 alone)
        if items and type(items[0]) is slice and items[0] != slice(None):  # x[::-1], x[1:]: each
            rest = items[1:]  # input's rows sliced — one index of their concatenation (_sliced_rows)
            ok = (
                ragged == [True]
                and all(type(i) in (int, slice) for i in rest)
                and len(rest) < cast(int, ndim)
                and all((r.attrs or {}).get("index") == index for r in requests)  # (hoisted items' differ)
            )
            return ragged if ok else None
        if not items or not (items[0] is Ellipsis or items[0] == slice(None)):
            return None
        if any(isinstance(i, slice) and i != slice(None) for i in items) and items[0] is Ellipsis:
            return None  # a slice after ... may reach axis 0
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        return ragged if used - (items[0] == slice(None)) <= cast(int, ndim) - 1 else None
    if kind == ALONG_AXIS or name in ("Concat", "TakeAlongAxis"):
        axis = attrs.get("axis", 0 if name == "Concat" else -1)
        if cast(int, ndim) < 2 or axis % cast(int, ndim) == 0:
            return None
        if name in ("Concat", "TakeAlongAxis") and not all(ragged):
            return None
    return ragged


def _sliced_rows(index: Any, lengths: list[int]) -> tuple[dict[str, Any], list[int]]:
    """For inputs of ``lengths`` rows concatenated along axis 0, each indexed by ``index`` (a
    basic index, see :func:`_ragged`): the attributes of one ``GetItem`` of the concatenation
    that gives their results one after another, and each result's rows."""
    items = index if isinstance(index, tuple) else (index,)
    lead = items[0]
    if type(lead) is not slice or lead == slice(None):
        return {"index": index}, lengths  # axis 0 left alone
    rows, out, a = [], [], 0
    for n in lengths:
        picked = np.arange(a, a + n)[lead]
        rows.append(picked)
        out.append(len(picked))
        a += n
    picked = np.concatenate(rows)  # (alone, not in a tuple: a gradient added by one `+=`, ops._distinct_rows)
    return {"index": (picked, *items[1:]) if len(items) > 1 else picked}, out


def _naming(where: str, e: Exception) -> VGraphError:
    """The error to raise for ``e``, raised while building ``where`` (``"input 3"``): a vgraph
    error of ``e``'s type whose message starts with ``where``; anything else a BuildError saying
    what it was."""
    if isinstance(e, VGraphError):
        return type(e)(f"{where}: {e}")
    return BuildError(f"{where}: the build failed: {type(e).__name__}: {e}")


def _as_declared(p: Any) -> Any:
    """``p`` as a message names it: a node of one input's own (its fed inputs, its samples, keyed
    ``<Input#3:1>`` in the batched graph) under the key of its input's unrolled graph."""
    if type(p) is Row or "#" not in p.key.type:
        return p
    key = p.key
    return Row(p, (), NodeKey(key.type.partition("#")[0], key.id, key.idx), p.name)


def _signature(r: _Request) -> tuple[Any, ...]:
    """What copies of one declared node must share to run as one op: each input's row shape."""
    return tuple([(p._value.shape, p._value.dtype) for p in r.parents])


class InputView:
    """What one input's builder sees as its compute graph in a batched build: it creates leaves in
    the shared graph, turns ops into requests for the scheduler, and keeps the input's own
    decisions, iteration environments and outputs (``trip_count``, ``choice``, ``value``)."""

    def __init__(self, batch: BatchedBuild, index: int) -> None:
        # Weakly, as nodes refer to their graph: the batch holds its views, and a cycle would leave
        # every build (tens of thousands of objects) to the cyclic garbage collector.
        self._batch = weakref.ref(batch)
        self.index = index
        self.decisions: list[Any] = []
        self.inputs: dict[str, ComputeNode] = {}
        self.outputs: list[Any] = []
        self._envs: dict[tuple[Any, tuple[int, ...]], dict[VirtualNode, Any]] = {}
        self._samples: dict[Any, Any] = {}
        self._getcurrent: Any = None  # greenlet.getcurrent and the scheduler's switch (bound in _run)
        self._switch: Any = None
        self._groups: dict[Any, Any] = {}
        # loop instances run as one body program over rows (BatchedBuild._run_rows): this input's row
        self._rows: dict[tuple[LoopNode, tuple[int, ...]], tuple[_RowsProgram, int]] = {}
        #: loop instances that ran op by op although programs were asked for: (loop, idx, why)
        self.interpreted: list[tuple[LoopNode, tuple[int, ...], str]] = []

    @property
    def batch(self) -> BatchedBuild:
        """The batched build this input belongs to.

        Raises:
            GraphStateError: nothing holds the batched build any more (keep a reference to it).
        """
        batch = self._batch()
        if batch is None:
            raise GraphStateError(
                f"input {self.index}'s batched build is gone: keep a reference to what build_batch returned"
            )
        return batch

    # -- what the builder calls
    def _key(self, key: NodeKey) -> NodeKey:
        return NodeKey(f"{key.type}#{self.index}", key.id, key.idx)

    def input(
        self, value: Any, name: str | None, key: NodeKey, requires_grad: bool = False, *, copy: bool = True
    ) -> ComputeNode:
        node = self.batch.graph.input(value, name, self._key(key), requires_grad, copy=copy)
        self.inputs[name or str(key)] = node
        return node

    def constant(self, value: Any, name: str | None, key: NodeKey) -> ComputeNode:
        if key.type == "Constant":  # a declared constant: one node for every input (broadcast)
            shared = self.batch._constants.get(key)
            if shared is None:
                shared = self.batch._constants[key] = self.batch.graph.constant(value, name, key)
            return shared
        return self.batch.graph.constant(value, name, self._key(key))  # a sample: this input's own

    def add_leaf(self, node: ComputeNode) -> ComputeNode:
        return self.batch.graph.add_leaf(node)

    def _add_copy(self, group: Any, copy: Any) -> Any:
        return copy  # an iteration's copy of a hoisted node is a row of its group: nothing to register

    def guard(self, *args: Any, **kwargs: Any) -> None:
        return None  # a batched build is one-shot: nothing re-checks decisions later

    def apply(
        self, op: Any, inputs: Sequence[Any], attrs: Any = None, key: Any = None, name: Any = None
    ) -> Any:
        return inputs[0]  # only a branch's lead node comes here: it passes its option on

    def _add_op(self, op: Op, parents: tuple[Any, ...], attrs: Any, key: NodeKey, name: str | None) -> Any:
        if op.name in _SPECIAL:
            result = self._direct(op, parents, attrs, key, name)
            if result is not _ASK:
                return result
        request = _Request(self.index, op, parents, attrs, key, name)
        request.agent = self._getcurrent()
        return self._switch(request)

    def _direct(self, op: Op, parents: tuple[Any, ...], attrs: Any, key: NodeKey, name: str | None) -> Any:
        """The result of an op that needs no computing (a pass-through, a row of a group, this
        input's rows stacked), or ``_ASK``."""
        if op is _GETITEM or op is _HOISTED:
            index = attrs["index"]
            if type(index) is int or isinstance(index, np.integer):
                return _row_at(parents[0], int(index), key, name)  # a stepped item: no node
            return _ASK
        if op.name in _PASS:
            return parents[0]
        if op is _STACK and attrs == {"axis": 0} and any(type(p) is Row for p in parents):
            return self.batch._stack(list(parents), key)  # loop.stack: this input's rows, gathered once
        return _ASK  # (a stack of whole nodes — parameters, say — is asked: the same for every input, once)

    # -- what users read
    @property
    def programs(self) -> dict[tuple[LoopNode, tuple[int, ...]], _RowsProgram]:
        """This input's loop instances that ran as one body program over the rows of the batch's
        inputs, by ``(loop, iteration path)`` (as :attr:`UnrolledGraph.programs`; shared with the
        other inputs whose instances ran in the same program); print one with
        ``vg.show_program(view, loop, idx)``."""
        return {key: program for key, (program, _) in self._rows.items()}

    def trip_count(self, loop: LoopNode, idx: tuple[int, ...] = ()) -> int:
        """How many iterations ``loop`` ran for this input in iteration path ``idx``."""
        return self._decision(loop, idx, "iterations")

    def choice(self, branch: VirtualNode, idx: tuple[int, ...] = ()) -> int:
        """Which option ``branch`` chose for this input in iteration path ``idx``."""
        return self._decision(branch, idx, "option")

    def _decision(self, node: VirtualNode, idx: tuple[int, ...], kind: str) -> int:
        found = find_decision(self.decisions, node, idx, kind)
        if found is None:
            raise BuildError(f"{node.describe(tuple(idx))} was not built for input {self.index}")
        return found

    def value(self, v: VirtualNode, idx: tuple[int, ...] = ()) -> np.ndarray:
        """This input's value of virtual node ``v`` in iteration path ``idx``."""
        in_program = self._in_program(v, tuple(idx))
        if in_program is None:
            return np.array(self._find(v, idx)._value)
        found = in_program[0]
        return np.array(found._value if isinstance(found, (ComputeNode, Row)) else found)

    def gradient(self, v: VirtualNode, idx: tuple[int, ...] = ()) -> np.ndarray | None:
        """This input's gradient at ``v`` in iteration path ``idx`` after backward, when the node
        (or its group) kept it (``vgraph.render.retain_all_grads(batch)`` before backward). A
        node whose inputs were the same for every input (the first step from a shared constant
        state) is computed once for all of them: its gradient is then the sum over the inputs.
        A body node of a loop run as a program over rows keeps its gradient when the loop's
        outputs do (``retain_all_grads(batch.graph)`` marks them); one that reads only values
        the same for every row is computed once per step, and its gradient is the sum over
        that step's rows (every input's iteration, or tree node, computed in it)."""
        in_program = self._in_program(v, tuple(idx))
        if in_program is not None and not isinstance(in_program[0], (ComputeNode, Row)):
            return cast("np.ndarray | None", in_program[1])
        found = self._find(v, idx) if in_program is None else in_program[0]
        if isinstance(found, Row):
            grad = found.src.grad
            return None if grad is None else np.array(row_at(grad, found.path))
        return None if found.grad is None else np.array(found.grad)

    def _in_program(self, v: VirtualNode, idx: tuple[int, ...]) -> tuple[Any, Any] | None:
        """Body node ``v`` in iteration path ``idx`` when its loop ran as a program over rows:
        ``(value, gradient)`` (see :meth:`_RowsProgram.value_of`); ``None`` otherwise."""
        if not self._rows or not idx or not isinstance(v.scope, LoopNode):
            return None
        found = self._rows.get((v.scope, idx[:-1]))
        if found is None:
            return None
        instance, r = found
        try:
            return instance.value_of(v, r, idx[-1])
        except KeyError:
            raise BuildError(f"{v.describe(idx)} was not built for input {self.index}") from None

    def _find(self, v: VirtualNode, idx: tuple[int, ...]) -> Any:
        env = self._envs.get((v.scope, tuple(idx)))
        if env is None or v not in env:
            raise BuildError(f"{v.describe(tuple(idx))} was not built for input {self.index}")
        return env[v]


class BatchedBuild:
    """The result of :meth:`VirtualGraph.build_batch`: one compute graph for many inputs.

    Attributes:
        graph: the :class:`~vgraph.compute.ComputeGraph` holding every group node; backward runs
            on it.
        inputs: one :class:`InputView` per input: its decisions, values and gradients by virtual
            node and iteration path.
        groups: ``(declared node key, number of copies)`` for every group, in the order the
            groups ran — what ran together (copies: inputs, or tree nodes of inputs; 1 for an op
            that ran for one input alone).
        rows_programs: the loops that ran as one body program over their inputs' rows (unless
            built with ``programs=False``); ``batch.inputs[i].interpreted`` lists those that
            could not, and why.
    """

    def __init__(self, virtual: Any, n: int) -> None:
        self.virtual = virtual
        self.graph = ComputeGraph(virtual.dtype)
        self.inputs = [InputView(self, i) for i in range(n)]
        self.groups: list[tuple[str, int]] = []
        self._waiting: dict[tuple[int, str], list[Any]] = {}  # (declared node's rank, type) -> its requests
        self._greenlets: dict[int, Any] = {}
        self._order: dict[tuple[str, int], int] = {(v.type, v.id): k for k, v in enumerate(virtual.nodes)}
        self._by_key: dict[tuple[str, int], VirtualNode] = {(v.type, v.id): v for v in virtual.nodes}
        self._serial = 0
        self._depth_ok: dict[LoopNode, bool] = {}
        self._depth = True
        self._lockstep: dict[LoopNode, bool] = {}
        self._joint: dict[LoopNode, bool] = {}
        self._lockstep_enabled = True  # loops and recursions run by the scheduler (no greenlet per op)
        self._closures: dict[Any, list[VirtualNode]] = {}
        self._ragged_members: list[bool] | None = None
        self._constants: dict[NodeKey, ComputeNode] = {}
        # every node that computed copies of a declared node: (one copy's key, copies, inputs)
        self._copies: dict[ComputeNode, tuple[NodeKey, int, int]] = {}
        self._values: list[dict[str, np.ndarray]] = []  # the checked feeds (for unrolled)
        self._outs: list[VirtualNode] = []
        self._builds = 0  # the build counter of input 0 (seeds its sampled nodes)
        self._hoist = True
        self.virtual_plan: Any = None
        self._programs = False  # lockstep loops run as body programs over rows where they can
        self._rows_static: dict[LoopNode, BodyProgram | str] = {}
        #: the loops that ran as one body program over the rows of their inputs
        self.rows_programs: list[_RowsProgram] = []

    def _by_depth(self, loop: LoopNode) -> bool:
        """Whether ``loop`` is a recursion whose tree nodes can be built in depth order: its body
        reads the carried state only through children (not the previous node's, which a carry
        holds at the start of an iteration; nor does ``stack`` of a carry), draws no random
        samples, holds no loop and no untied parameter (whose order of creation would change)."""
        known = self._depth_ok.get(loop)
        if known is None and not self._depth:
            known = self._depth_ok[loop] = False
        if known is None:
            known = (
                loop.structure is not None
                and loop.cond is None
                and loop.until is None
                and loop.times is None
                and loop.checkpoint is None
                and all(loop.updates.get(c) not in (None, c) for c in loop.carries)
            )
            carries = set(loop.carries)
            plan = self.virtual_plan
            if any(s.inputs[1] in carries for s in plan.stacked.get(loop, ())):
                known = False  # loop.stack(carry): each node's value at the start of its iteration
            for v in self.virtual.nodes:
                if not known:
                    break
                if v.scope is loop and (
                    v.kind in ("sample", "loop")
                    or (v.kind == "parameter" and not v.attrs["share"])
                    or (v.kind != "child" and any(u in carries for u in v.inputs))
                ):
                    known = False
            self._depth_ok[loop] = known
        return known

    def _joint_ok(self, loop: LoopNode) -> bool:
        """Whether the scheduler can build ``loop`` (a recursion in depth order, see
        :meth:`_by_depth`) for every input itself (:meth:`_run_tree_jobs`): its body holds ops and
        branches only (besides its items, children and carries)."""
        known = self._joint.get(loop)
        if known is None:
            known = self._lockstep_enabled and not any(
                v.scope is loop and v.kind not in ("op", "branch", "item", "child", "carry")
                for v in self.virtual.nodes
            )
            self._joint[loop] = known
        return known

    def _rows_only(self, loop: LoopNode) -> bool:
        """Whether ``loop``, which cannot run in lockstep op by op (its body has branches), may
        run as one body program over rows (:meth:`_run_rows`): handed to the scheduler, which
        either runs it so or hands it back to each input's builder."""
        return (
            self._programs
            and self._lockstep_enabled
            and loop.structure is None
            and isinstance(self._rows_program(loop), BodyProgram)
        )

    def _lockstep_ok(self, loop: LoopNode) -> bool:
        """Whether ``loop`` can run in lockstep across inputs (:meth:`_run_jobs`): a loop (not a
        recursion, not checkpointed) whose body is ops only — no branch, inner loop, random
        sample or parameter declared in it."""
        known = self._lockstep.get(loop)
        if known is None:
            known = (
                self._lockstep_enabled
                and loop.structure is None
                and loop.checkpoint is None
                and all(v.op is not None for v in self.virtual_plan.eager.get(loop, ()))
                and not any(
                    v.scope is loop and v.kind not in ("op", "item", "carry") for v in self.virtual.nodes
                )
            )
            self._lockstep[loop] = known
        return known

    def __len__(self) -> int:
        return len(self.inputs)

    def __repr__(self) -> str:
        sizes = [k for _, k in self.groups]
        mean = sum(sizes) / len(sizes) if sizes else 0.0
        return (
            f"BatchedBuild({len(self.inputs)} inputs, {len(self.graph)} nodes, {len(self.groups)} groups "
            f"of {mean:.1f} inputs on average)"
        )

    @computing
    def unrolled(self, i: int) -> UnrolledGraph:
        """Input ``i`` built alone: the unrolled graph a one-at-a-time build of its feed gives
        (same values; its sampled nodes drawn with the seed they had in this batch), to inspect
        or draw as usual (``render.to_dot(batch.unrolled(i))``; ``batch_groups=True`` also says
        which group computed each node). The parameter store and the build cache are not touched.

        Raises:
            IndexError: ``i`` is not an input of this batch.
        """
        if not -len(self.inputs) <= i < len(self.inputs):
            raise IndexError(f"input {i} out of range: this batch has {len(self.inputs)} inputs")
        i %= len(self.inputs)
        graph = self.virtual
        builder = _Builder(graph, self._values[i], self.virtual_plan, self._hoist, builds=self._builds + i)
        top = _Frame(None, (), {}, None)
        with contextlib.nullcontext() if graph.training else no_grad(), gc_paused():
            builder.run_scope(top)
        cg = builder.cg
        cg._envs[(None, ())] = top.env
        cg.outputs = [top.env[o] for o in self._outs]
        cg._mark_fresh([_ALL])
        cg._batch_input = (self, i)  # type: ignore[union-attr]  # for render.to_dot(cg, batch_groups=True)
        return cg

    def ran_with(self, i: int, key: NodeKey) -> tuple[ComputeNode, int, int] | None:
        """Where input ``i``'s node ``key`` (a key of ``batch.unrolled(i)``) was computed: the node
        of the batched graph, how many copies of the declared node it computed at once, and for
        how many inputs. ``None`` if no op computed it (a leaf, a row of a fed sequence, a node a
        batched build does not need such as a guard). A body node of a loop run as one program
        over rows was computed by the loop's node, with the other inputs running that iteration
        (of a recursion: with the tree nodes of its step, those of its level that chose alike).
        """
        decl = self._by_key.get((key.type, key.id))
        if decl is None:
            return None
        scope = decl.scope
        rows = self.inputs[i]._rows.get((scope, tuple(key.idx[:-1]))) if scope and key.idx else None
        if rows is not None and 0 <= key.idx[-1] < rows[0].trips[rows[1]]:
            copies, inputs = rows[0].computed_with(rows[1], key.idx[-1])
            return self.graph.node(cast(NodeKey, rows[0].node_key)), copies, inputs
        env = self.inputs[i]._envs.get((decl.scope, tuple(key.idx)))
        found = None if env is None else env.get(decl)
        if isinstance(found, Row):
            found = found.src
        info = self._copies.get(found) if found is not None else None
        return None if info is None else (cast(ComputeNode, found), info[1], info[2])

    def group_info(self, node: ComputeNode) -> tuple[NodeKey, int, int] | None:
        """For a node of ``batch.graph`` that computed copies of a declared node: one copy's key
        (``<type,id,idx>`` of the first input's copy), how many copies it computed and for how many
        inputs; ``None`` for other nodes (leaves, gathers, the combined loss)."""
        return self._copies.get(node)

    def outputs(self, k: int = 0) -> list[Any]:
        """Every input's value of output ``k`` (in input order)."""
        return [np.array(view.outputs[k]._value) for view in self.inputs]

    def loss(self, reduction: str = "mean", output: int = 0) -> ComputeNode:
        """One node combining every input's (scalar) output ``output``: their mean or sum.

        Raises:
            ArgumentError: ``reduction`` is not a str (a TypeError).
            ValueError: ``reduction`` is neither ``"mean"`` nor ``"sum"``, or an output is not a scalar.
        """
        if not isinstance(reduction, str):
            raise ArgumentError(
                f"loss(reduction=...) must be 'mean' or 'sum', got {type(reduction).__name__} {reduction!r:.80}"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        parts = [view.outputs[output] for view in self.inputs]
        for i, p in enumerate(parts):
            if np.size(p._value) != 1:
                raise ValueError(f"input {i}: output {output} has shape {np.shape(p._value)}, not a scalar")
        key = NodeKey("BatchLoss", output + 1, (0 if reduction == "mean" else 1,))
        if key in self.graph:  # made by an earlier call: the same node (a second one would replace
            return self.graph.node(key)  # it under its key, unseen by the cached backward plan)
        stacked = self._stack(parts, NodeKey("Outputs", output + 1, ()))
        op = _MEAN if reduction == "mean" else _SUM
        return self.graph._add_op(op, (stacked,), {"axis": None, "keepdims": False}, key, None)

    @computing
    def backward(self, reduction: str = "mean", output: int = 0, *, detect_anomaly: bool = False) -> float:
        """Backpropagate the combined loss (:meth:`loss`) once for every input; returns its value.

        Args:
            reduction: ``"mean"`` or ``"sum"`` of the inputs' outputs.
            output: which output of the build.
            detect_anomaly: raise at the first NaN/Inf gradient (see :func:`vgraph.detect_anomaly`,
                which also applies).

        Raises:
            NonFiniteError: with anomaly detection, naming the input and its unrolled node where
                the first NaN/Inf gradient appears (``input 1: Inf first appears in backward at
                <Pow:1@6> ...``), as a backward of that input alone would; no ``.grad`` changed.
            ArgumentError, ValueError: as :meth:`loss`; ``detect_anomaly`` is not a bool.
        """
        detect_anomaly = flag_arg(detect_anomaly, "backward(detect_anomaly=...)")
        loss = self.loss(reduction, output)
        try:
            value = self.graph.backward(loss, detect_anomaly=detect_anomaly)
        except NonFiniteError as e:
            # The batched graph's nodes are groups of copies: find the input whose own backward
            # meets the anomaly, to name its unrolled node (on this error path only).
            raise self._anomaly_by_input(reduction, output, e) from e
        return float(value) if value is not None else float("nan")

    def _anomaly_by_input(self, reduction: str, output: int, e: NonFiniteError) -> NonFiniteError:
        """The error a backward of each input alone (``batch.unrolled(i)``, seeded as the combined
        loss seeds it) raises first, naming the input; ``e`` if none does."""
        scale = 1.0 / len(self.inputs) if reduction == "mean" else 1.0
        for i in range(len(self.inputs)):
            try:
                with detect_anomaly_mode(False):  # (its forward values are the batch's)
                    cg = self.unrolled(i)
                out = cg.outputs[output]
                wrt = [n for n in cg.nodes() if n.is_leaf and n.requires_grad]
                if not wrt:
                    continue
                seed = np.full(np.shape(out.value), scale, dtype=np.asarray(out.value).dtype)
                cg.grad(out, wrt, seed, allow_unused=True, detect_anomaly=True)
            except NonFiniteError as alone:
                return cast(NonFiniteError, _naming(f"input {i}", alone))
            except VGraphError:
                continue  # (nothing of this input requires a gradient)
        return e

    # -- scheduling
    def _ask(self, request: _Request) -> Any:
        """Called in an input's greenlet: hand the request to the scheduler, wait for the result."""
        request.agent = self._getcurrent()
        return self._scheduler.switch(request)

    def _run(self, builders: list[Any], frames: list[Any], greenlet_type: Any) -> None:
        self._scheduler = greenlet_type.getcurrent()
        self._getcurrent = greenlet_type.getcurrent
        self._greenlet = greenlet_type
        for view in self.inputs:
            view._getcurrent, view._switch = greenlet_type.getcurrent, self._scheduler.switch
        waiting = self._waiting
        for i, (builder, top) in enumerate(zip(builders, frames)):
            g = greenlet_type(lambda b=builder, f=top: b.run_scope(f))
            self._greenlets[i] = g
            self._wait(i, self._resume(i, g, None))
        while waiting:
            members = self._next_group()
            if type(members[0]) is _TreeJob:
                self._run_tree_jobs(members)
                for job in members:
                    self._wait(job.inp, self._resume(job.inp, job.agent, None))
                continue
            if type(members[0]) is _LoopJob:
                self._run_jobs(members)
                for job in members:
                    self._wait(job.inp, self._resume(job.inp, job.agent, None))
                continue
            try:
                results = self._execute(members, self._ragged_members if len(members) > 1 else None)
            except Exception as e:
                self._blame(members, e)
            for req, result in zip(members, results):
                self._wait(req.inp, self._resume(req.inp, req.agent, result))

    def _column_op(
        self,
        v: VirtualNode,
        alive: list[_LoopJob],
        envs: list[dict[VirtualNode, Any]],
        steps: list[tuple[int, ...]],
        cols: dict[VirtualNode, ComputeNode],
        cap_cols: dict[VirtualNode, ComputeNode],
        cells: dict[VirtualNode, ComputeNode],
    ) -> bool:
        """Op node ``v`` for every running input of a lockstep loop as one op, without a request
        per input, when its inputs are whole columns: the group of an earlier body node (row ``r``
        = input ``alive[r]``), one node for everyone, or equally shaped values stacked once.
        Returns ``False`` (nothing done) when that does not apply; the general path then runs."""
        op = cast(Op, v.op)
        name = op.name
        if len(alive) < 2:
            return False
        if any(v in env for env in envs):
            return False  # hoisted (for some input): its rows are in place
        if name in _SPECIAL:  # a slab of a fused cell's group (h' or c'): one view for all
            index = (v.attrs or {}).get("index")
            group = cells.get(v.inputs[0]) if op is _GETITEM and type(index) is int else None
            if group is None:
                return False
            view = self._view(group, index)
            rows = view._value
            for r, (env, step) in enumerate(zip(envs, steps)):
                row = _new_row(Row)
                row.src, row.path, row.name = group, ((slice(None), r), index), v.name
                row._value = rows[r]
                env[v] = _lazy_key(row, v, step)
            cols[v] = view
            return True
        cell = op.kind == CELL  # gates lead the value: rows along axis 1
        inputs: list[ComputeNode] = []
        shapes: list[tuple[int, ...]] = []
        stacked: list[bool] = []
        for u in v.inputs:
            node = cols.get(u)
            if node is None:
                node = cap_cols.get(u)
            if node is not None:
                inputs.append(node)
                shapes.append(node._value.shape[1:])
                stacked.append(True)
                continue
            column = [env.get(u) for env in envs]
            p0 = column[0]
            if p0 is None:
                return False  # hoisted for some input
            if isinstance(p0, ComputeNode) and all(p is p0 for p in column):
                inputs.append(p0)
                shapes.append(p0._value.shape)
                stacked.append(False)
                continue
            v0 = p0._value
            if any(p is None or p._value.shape != v0.shape or p._value.dtype != v0.dtype for p in column):
                return False
            node = self._stack(column, NodeKey(v.type, v.id, steps[0]))
            if u.scope is not v.scope:  # a value from outside the loop: the same every step
                cap_cols[u] = node
            inputs.append(node)
            shapes.append(v0.shape)
            stacked.append(True)
        if not any(stacked):
            return False
        attrs = batched_attrs(op, v.attrs or {}, shapes, stacked, len(alive))
        if attrs is None:
            return False
        self._serial += 1
        first = NodeKey(v.type, v.id, steps[0])
        try:
            group = self.graph._add_op(
                op, tuple(inputs), attrs or None, NodeKey(f"{v.type}*", v.id, (self._serial,)), v.name
            )
        except Exception as e:
            copies = [
                _Request(
                    j.inp, op, tuple([env[u] for u in v.inputs]), v.attrs, NodeKey(v.type, v.id, step), v.name
                )
                for j, env, step in zip(alive, envs, steps)
            ]
            self._blame(copies, e)
        self.groups.append((f"{v.type}:{v.id}", len(alive)))
        self._copies[group] = (first, len(alive), len(alive))
        value = group._value
        if checks_rows(op):  # its promise to act elementwise
            check_rows(op, first, value[0], [envs[0][u]._value for u in v.inputs], v.attrs)
        vname = v.name
        for r, (env, step) in enumerate(zip(envs, steps)):
            row = _new_row(Row)
            row.src, row.name = group, vname
            _lazy_key(row, v, step)
            if cell:
                row.path, row._value = ((slice(None), r),), value[:, r]
            else:
                row.path, row._value = (r,), value[r]
            env[v] = row
        if cell:
            cells[v] = group
        else:
            cols[v] = group
        return True

    def _run_tree_jobs(self, jobs: list[_TreeJob]) -> None:
        """Build the recursion of ``jobs`` (one per input; the same declared recursion) in depth
        order: every tree node of every input whose children are built, body node by body node,
        each node's copies as one op; a branch chooses per tree node and each option is built for
        the tree nodes that chose it. The inputs' greenlets are not involved. With programs,
        first tries to run it as one body program over tree nodes (:meth:`_run_tree_rows`); the
        reason it could not is recorded per input (``InputView.interpreted``)."""
        loop = jobs[0].loop
        if self._ran_as_program(jobs, self._run_tree_rows):
            return
        for j in jobs:
            j.remaining, j.parents = _dependents(j.rows)
        updates = [loop.updates[c] for c in loop.carries]
        stacked = self.virtual_plan.stacked.get(loop, [])
        level = [
            (j, t)
            for j in sorted(jobs, key=_by_input)
            for t in range(cast(int, j.trips))
            if j.remaining[t] == 0
        ]
        while level:
            members = []
            for j, t in level:
                env = dict(j.captured)
                m = _Member(j, t, env)
                view, inner = j.view, m.idx
                for c, init in zip(loop.carries, j.state):
                    env[c] = init  # (never read: see _by_depth)
                _read_children(env, j.reads, j.rows[t], j.history, j.state)
                for item, seq in zip(loop.items, j.seqs):
                    if item not in j.groups:
                        at = cast(int, j.length) - 1 - t if item.attrs.get("reverse") else t
                        env[item] = view._direct(
                            _GETITEM, (seq,), {"index": at}, NodeKey("Item", item.id, inner), item.name
                        )
                for v, group in j.groups.items():
                    env[v] = view._direct(
                        _HOISTED, (group,), {"index": t}, NodeKey(v.type, v.id, inner), v.name
                    )
                members.append(m)
            for v in self.virtual_plan.eager.get(loop, ()):
                if v.op is not None:
                    self._joint_op(v, [m for m in members if v not in m.env])
                else:  # a branch (see _joint_ok)
                    self._joint_branch(cast(BranchNode, v), [m for m in members if v not in m.env])
            level = []
            for m in members:
                j, t, env = m.job, m.t, m.env
                j.view._envs[(loop, m.idx)] = env
                j.history[t] = [env[u] for u in updates]
                j.collected[t] = [env[s.inputs[1]] for s in stacked]
                for p in j.parents[t]:
                    j.remaining[p] -= 1
                    if j.remaining[p] == 0:
                        level.append((j, p))
            level.sort(key=lambda jt: jt[0].inp)

    def _joint_op(self, v: VirtualNode, members: list[_Member]) -> None:
        """Compute op node ``v`` for every member (whose environments hold its inputs)."""
        requests = []
        op = cast(Op, v.op)
        special = op.name in _SPECIAL
        for m in members:
            env = m.env
            parents = tuple([env[u] for u in v.inputs])
            key = NodeKey(v.type, v.id, m.idx)
            if special:
                result = m.job.view._direct(op, parents, v.attrs, key, v.name)
                if result is not _ASK:
                    env[v] = result
                    continue
            r = _Request(m.job.inp, op, parents, v.attrs, key, v.name)
            r.agent = env
            requests.append(r)
        self._run_requests(v, requests)

    def _joint_demand(self, target: VirtualNode, members: list[_Member], at: VirtualNode) -> None:
        """Build ``target`` and what it needs that is not built yet, for every member (``at``:
        the branch being built, which with a member's choices so far fixes what is built)."""
        by_path: dict[tuple[Any, ...], list[_Member]] = {}
        for m in members:
            if target not in m.env:
                by_path.setdefault(m.path, []).append(m)
        for path, ms in by_path.items():
            key = (at, target, path)
            order = self._closures.get(key)
            if order is None:
                order = self._closures[key] = self._closure(target, ms[0].env)
            for v in order:
                if v.op is not None:
                    self._joint_op(v, [m for m in ms if v not in m.env])
                else:
                    self._joint_branch(cast(BranchNode, v), [m for m in ms if v not in m.env])

    def _closure(self, target: VirtualNode, env: dict[VirtualNode, Any]) -> list[VirtualNode]:
        """``target`` and its dependencies missing from ``env``, dependencies first."""
        order: list[VirtualNode] = []
        seen: set[VirtualNode] = set()
        stack: list[tuple[VirtualNode, bool]] = [(target, False)]
        plan = self.virtual_plan
        while stack:
            v, expanded = stack.pop()
            if expanded:
                order.append(v)
                continue
            if v in seen or v in env:
                continue
            seen.add(v)
            stack.append((v, True))
            stack.extend((d, False) for d in reversed(plan.deps(v)) if d not in env and d not in seen)
        return order

    def _joint_branch(self, branch: BranchNode, members: list[_Member]) -> None:
        """Choose per member, then build each chosen option for the members that chose it."""
        for d in self.virtual_plan.deps(branch):
            self._joint_demand(d, members, branch)
        by_choice: dict[int, list[_Member]] = {}
        for m in members:
            if branch.lead is None:
                try:
                    choice = select_option(branch, m.idx, [m.env[k].value for k in branch.keys])
                except VGraphError as e:
                    raise type(e)(f"input {m.job.inp}: {e}") from e
            else:
                choice = m.job.chosen[(branch.lead, m.idx)]
            m.path = (*m.path, (branch, choice))
            by_choice.setdefault(choice, []).append(m)
        for choice, ms in sorted(by_choice.items()):
            option = branch.options[choice]
            self._joint_demand(option, ms, branch)
            for m in ms:
                m.env[branch] = m.env[option]
                if branch.lead is None:
                    m.job.chosen[(branch, m.idx)] = choice
                    m.job.decisions[m.t].append(Decision(branch, m.idx, "option", choice))

    def _ran_as_program(self, jobs: Sequence[_LoopJob], run: Callable[[Any], str | None]) -> bool:
        """Whether ``run`` (:meth:`_run_rows` or :meth:`_run_tree_rows`) ran the loop of ``jobs``
        as one program over rows (never with programs off); if it could not, each input records
        why (``InputView.interpreted``)."""
        if not self._programs:
            return False
        why = run(jobs)
        if why is None:
            return True
        for j in jobs:
            j.view.interpreted.append((j.loop, j.idx, why))
        return False

    def _run_jobs(self, jobs: list[_LoopJob]) -> None:
        """Run the loop of ``jobs`` (one per input; the same declared loop) in lockstep: iteration
        ``t`` of every input that has one, body node by body node, each node's copies as one op
        (:meth:`_execute`); the inputs' greenlets are not involved. With programs, first tries
        to run it as one body program over rows (:meth:`_run_rows`); the reason it could not is
        recorded per input (``InputView.interpreted``)."""
        loop = jobs[0].loop
        if self._ran_as_program(jobs, self._run_rows):
            return
        if self._programs and not self._lockstep_ok(loop):  # (branches: each input runs it itself)
            for j in jobs:
                j.declined = True
            return
        body = self.virtual_plan.eager.get(loop, ())
        stacked = self.virtual_plan.stacked.get(loop, [])
        updates = [loop.updates[c] for c in loop.carries]
        names = [c.name for c in loop.carries]
        # longest first: the inputs still running at step t are the first rows of step t-1's
        # groups, which the next groups read as one view (no gather). With a condition, the
        # lengths are not known: input order.
        conditional = loop.cond is not None or loop.until is not None
        if conditional or any(j.trips is None for j in jobs):
            alive = sorted(jobs, key=_by_input)
        else:
            alive = sorted(jobs, key=lambda j: (-cast(int, j.trips), j.inp))
        t = 0
        previous: list[_LoopJob] = []
        prev_cols: dict[VirtualNode, ComputeNode] = {}  # body node -> the group of last step (all alive)
        cap_cols: dict[VirtualNode, ComputeNode] = {}  # captured per-input values, stacked once
        while True:
            running = []
            for j in alive:  # who runs iteration t: the checks of the sequential loop, per input
                if j.trips is not None and t >= j.trips:
                    j.count = t
                    continue
                try:
                    if loop.cond is not None and not run_cond(
                        loop, j.idx, t, names, [s._value for s in j.state]
                    ):
                        j.count = t
                        continue
                    if at_limit(loop, j.idx, t):
                        j.capped = j.count = t
                        continue
                except VGraphError as e:
                    raise type(e)(f"input {j.inp}: {e}") from e
                running.append(j)
            alive = running
            if not alive:
                break
            envs = []
            for j in alive:
                ienv = dict(j.captured)
                inner = (*j.idx, t)
                for c, node in zip(loop.carries, j.state):
                    ienv[c] = node
                for item, node in zip(loop.items, j.seqs):
                    if item not in j.groups:
                        at = cast(int, j.length) - 1 - t if item.attrs.get("reverse") else t
                        ienv[item] = _lazy_key(_row_at(node, at, None, item.name), item, inner)
                for v, group in j.groups.items():
                    ienv[v] = _lazy_key(_row_at(group, t, None, v.name), v, inner)
                envs.append(ienv)
            steps = [(*j.idx, t) for j in alive]
            if len(alive) != len(previous):  # someone finished: the columns of last step are longer
                prev_cols, cap_cols = {}, {}
            previous = alive
            cols: dict[VirtualNode, ComputeNode] = {}
            cells: dict[VirtualNode, ComputeNode] = {}  # fused cells' groups (rows along axis 1)
            for c, u in zip(loop.carries, updates):
                if u in prev_cols:
                    cols[c] = prev_cols[u]
            for v in body:
                if self._column_op(v, alive, envs, steps, cols, cap_cols, cells):
                    continue
                requests = []
                op, inputs, attrs, vtype, vid, vname = cast(Op, v.op), v.inputs, v.attrs, v.type, v.id, v.name
                special = op.name in _SPECIAL
                for j, ienv, step in zip(alive, envs, steps):
                    if v in ienv:  # hoisted for this input
                        continue
                    parents = tuple([ienv[u] for u in inputs])
                    key = NodeKey(vtype, vid, step)
                    if special:
                        result = j.view._direct(op, parents, attrs, key, vname)
                        if result is not _ASK:
                            ienv[v] = result
                            continue
                    r = _Request(j.inp, op, parents, attrs, key, vname)
                    r.agent = ienv
                    requests.append(r)
                self._run_requests(v, requests)
            prev_cols = cols
            for j, ienv in zip(alive, envs):
                j.view._envs[(loop, (*j.idx, t))] = ienv
                new_state = [ienv[u] for u in updates]
                for name, old, new in zip(names, j.state, new_state):
                    try:
                        check_carry(loop, j.idx, t, name, old._value, new._value, new)
                    except VGraphError as e:
                        raise type(e)(f"input {j.inp}: {e}") from e
                j.state = new_state
                j.collected.append([ienv[s.inputs[1]] for s in stacked])
            t += 1
            if loop.until is not None:  # do-while: checked on the updated state
                still = []
                for j in alive:
                    try:
                        done = run_cond(loop, j.idx, t - 1, names, [s._value for s in j.state], until=True)
                    except VGraphError as e:
                        raise type(e)(f"input {j.inp}: {e}") from e
                    if done:
                        j.count = t
                    else:
                        still.append(j)
                alive = still

    # -- loops run as body programs over rows
    def _rows_program(self, loop: LoopNode) -> BodyProgram | str:
        """What can be said before a lockstep loop or a recursion starts about running it as one
        body program over rows (:meth:`_run_rows`, :meth:`_run_tree_rows`): its program, or why it
        runs op by op instead."""
        if is_anomaly_enabled():
            return "anomaly mode checks every node as it is made"
        found = self._rows_static.get(loop)
        if found is None:
            program = program_for(loop, self.virtual_plan)
            if isinstance(program, str) or loop.structure is not None:
                found = program  # (branches are chosen per row: _RowsSelect)
            elif loop.cond is not None or loop.until is not None:
                found = (
                    "its trip count is decided per iteration (while_/until): it runs op by op across inputs"
                )
            else:
                found = program
            self._rows_static[loop] = found
        return found

    def _rows_inputs(self, program: BodyProgram, rows: Sequence[_LoopJob]) -> _RowsInputs | str:
        """The values a program over ``rows`` reads — the captured values' nodes where they are
        the same for every input, each input's own otherwise (rows of one buffer, padded where
        their lengths differ along one axis: :mod:`.padded`) — or why the inputs' values cannot
        be rows of one buffer."""
        loop, first = program.loop, rows[0]
        for k, c in enumerate(loop.carries):
            v0 = first.state[k]._value
            if any(j.state[k]._value.shape != v0.shape or j.state[k]._value.dtype != v0.dtype for j in rows):
                return f"the inputs' initial values of {c.describe()} differ in shape or dtype"
        for i, item in enumerate(loop.items):
            s0 = first.seqs[i]._value
            if any(
                j.seqs[i]._value.shape[1:] != s0.shape[1:] or j.seqs[i]._value.dtype != s0.dtype for j in rows
            ):
                return f"the inputs' rows of {item.describe()} differ in shape or dtype"
        out = _RowsInputs()
        for v in program.captured:
            node = first.captured[v]
            if isinstance(node, ComputeNode) and all(j.captured[v] is node for j in rows):
                out.caps.append(node)
                continue
            column = [j.captured[v] for j in rows]
            if not all(isinstance(x, (ComputeNode, Row)) for x in column):
                return f"it reads {v.describe()}, a value of each input's own that is not a node"
            values = [np.asarray(x._value) for x in column]
            if len({(x.ndim, x.dtype) for x in values}) != 1:
                return f"the inputs' values of {v.describe()} differ in rank or dtype"
            shapes = [x.shape for x in values]
            widest = tuple(max(d) for d in zip(*shapes))
            differ = [a for a, n in enumerate(widest) if any(s[a] != n for s in shapes)]
            if len(differ) > 1:
                return f"the inputs' values of {v.describe()} differ in length along more than one axis"
            if differ:
                lengths = np.asarray([s[differ[0]] for s in shapes], dtype=np.intp)
                if not lengths.all():
                    return f"an input's value of {v.describe()} is empty along its axis {differ[0]}"
                ext = next((e for e, x in enumerate(out.extents) if np.array_equal(x, lengths)), None)
                if ext is None:
                    ext = len(out.extents)
                    out.extents.append(lengths)
                out.padded[v] = (differ[0], ext)
                out.values[v] = cast(np.ndarray, _PAD_STACK.forward(*values, shape=widest))
            else:
                out.values[v] = np.stack(values)
            out.own[v] = column
            out.caps.append(None)
        return out

    def _rows_plan(
        self, program: BodyProgram, first: _LoopJob, inputs: _RowsInputs, rows_in_source: int
    ) -> _RowsPlan | str:
        """How ``program``'s body runs on rows, or why it cannot: where each body node's rows lie,
        which nodes are hoisted over every input's rows at once, and the attributes with which the
        ops act on rows. It follows from the ops' declared batching rules
        (:func:`.hoist.batched_attrs`): every op must compute each row alone, a fused cell's value
        (rows along axis 1) read by one slab; a branch's options must lie alike."""
        loop = program.loop
        own = inputs.own
        shape = _probe_shapes(
            program,
            first,
            [
                n._value if n is not None else inputs.values[v][0]
                for v, n in zip(program.captured, inputs.caps)
            ],
        )
        if isinstance(shape, str):
            return shape
        plan = _RowsPlan()
        layout = plan.layout
        layout.update((v, 0) for v in (*loop.carries, *loop.items, *loop.children))
        layout.update((v, 0 if v in own else None) for v in program.captured)
        plan.own = [v for v in program.captured if v in own]
        padded: dict[VirtualNode, Padded] = dict(inputs.padded)
        pre: dict[VirtualNode, tuple[MaskKey, float, bool]] = {}
        post: dict[VirtualNode, MaskKey] = {}
        grad: dict[VirtualNode, MaskKey] = {}
        scale: dict[VirtualNode, tuple[ScaleKey, ScaleKey]] = {}
        # A hoisted node runs once on its items' rows as the inputs' sequences give them (concatenated
        # in input order): it acts on each row alone, so its rows are then packed as the items' are —
        # by one index, if every item it reads steps the same way (forwards or reversed).
        direction = plan.direction
        direction.update((v, bool(v.attrs.get("reverse"))) for v in loop.items)
        if self._hoist:
            for v in program.hoistable:
                op = cast(Op, v.op)
                ways = {direction[u] for u in v.inputs if u in direction}
                if (
                    op.kind == CELL
                    or len(ways) != 1
                    or any(layout.get(u, 1) not in (0, None) or u in own for u in v.inputs)
                ):
                    continue
                attrs = batched_attrs(
                    op,
                    v.attrs or {},
                    [shape[u] for u in v.inputs],
                    [layout[u] == 0 for u in v.inputs],
                    rows_in_source,
                )
                if attrs is not None:
                    plan.hoisted.append(v)
                    plan.hoisted_attrs.append(attrs)
                    layout[v] = 0
                    direction[v] = ways.pop()
        for v in program.computed:
            if v in layout:
                continue
            if isinstance(v, BranchNode):
                ways = {layout[o] for o in v.options}
                if any(u in padded for u in (*v.keys, *v.options)):
                    return f"{v.describe()} chooses between or on values whose length differs per input"
                if len(ways) != 1:
                    return f"the options of {v.describe()} differ in whether each input has its own value"
                if v.lead is None and any(layout[k] == 1 for k in v.keys):
                    return f"{v.describe()} selects on a fused cell's value"
                layout[v] = ways.pop()
                continue
            op = cast(Op, v.op)
            attrs = v.attrs or {}
            ins = [layout[u] for u in v.inputs]
            if all(x is None for x in ins):
                layout[v] = None  # the same for every row: computed once per iteration
                continue
            if op is _GETITEM and ins == [1] and type(attrs.get("index")) is int:
                layout[v] = 0  # one slab of a fused cell's value: rows along axis 0
                continue
            if 1 in ins:
                return f"{v.describe()} reads a fused cell's value other than by one slab"
            if v not in shape:
                return f"{v.describe()} was not computed in any choice of options"
            # (-1: the number of rows differs from one iteration to the next)
            shapes, stacked = [shape[u] for u in v.inputs], [x == 0 for x in ins]
            grouped = batched_attrs(op, attrs, shapes, stacked, -1)
            if grouped is None and (over_rows := rows_op(op, shapes, stacked)) is not None:
                plan.ops[v], grouped = over_rows, attrs
            if grouped is None or (op.name == "Reshape" and -1 in tuple(attrs["shape"])):
                return f"{v.describe()} ({op.name}) does not compute each row alone"
            if not _same_attrs(grouped, attrs):
                plan.attrs[v] = grouped
            layout[v] = 1 if op.kind == CELL else 0
            if padded:
                found = rule(op, attrs, shapes, [padded.get(u) for u in v.inputs], shape[v])
                if isinstance(found, str):
                    return f"{v.describe()} {found}"
                if found.scale is not None:
                    scale[v] = (
                        ScaleKey(found.scale, len(shape[v])),
                        ScaleKey(found.scale, len(shape[v.inputs[0]])),
                    )
                if found.pre is not None:
                    r0 = padded[v.inputs[0]]
                    pre[v] = (MaskKey(r0[1], len(shape[v.inputs[0]]), r0[0]), found.pre, found.pre_vjp)
                if found.out is not None:
                    padded[v] = found.out
                    key = grad[v] = MaskKey(found.out[1], len(shape[v]), found.out[0])
                    if found.post:
                        post[v] = key
        for c in loop.carries:
            if layout[loop.updates[c]] != 0:
                return f"the update of {c.describe()} is the same for every input"
            if loop.updates[c] in padded:
                return f"the update of {c.describe()} has a length that differs per input"
        for st in program.stacked:
            if layout[st.inputs[1]] != 0:
                return f"{st.describe()} stacks a value that is the same for every input"
            if st.inputs[1] in padded:
                return f"{st.describe()} stacks a value whose length differs per input"
        plan.padded = padded
        every: list[MaskKey | ScaleKey] = [k for k, _, _ in pre.values()]
        every += [*post.values(), *grad.values()]
        every += [k for pair in scale.values() for k in pair]
        keys = tuple(dict.fromkeys(every))
        plan.masking = Masking(
            keys,
            tuple((v, *p) for v, p in pre.items()),
            tuple(post.items()),
            tuple(grad.items()),
            tuple((v, *k) for v, k in scale.items()),
        )
        return plan

    def _rows_variant(
        self, program: BodyProgram, rows: Sequence[_LoopJob], inputs: _RowsInputs, plan: _RowsPlan
    ) -> Any:
        """The steps of ``program`` for a run over ``rows`` laid out by ``plan``: those computing
        the gradients some input needs (none outside grad mode)."""
        loop = program.loop
        needs: set[VirtualNode] = set()
        if is_grad_enabled():
            needs.update(
                c for k, c in enumerate(loop.carries) if any(_base(j.state[k]).requires_grad for j in rows)
            )
            needs.update(
                v for i, v in enumerate(loop.items) if any(_base(j.seqs[i]).requires_grad for j in rows)
            )
            needs.update(
                v
                for v, n in zip(program.captured, inputs.caps)
                if (n.requires_grad if n is not None else any(_base(x).requires_grad for x in inputs.own[v]))
            )
            for v in plan.hoisted:
                if any(vjp_of(cast(Op, v.op), p) is not None and u in needs for p, u in enumerate(v.inputs)):
                    needs.add(v)
        return program.variant(
            tuple(plan.hoisted), frozenset(needs), plan.attrs, tuple(plan.own), plan.masking, plan.ops
        )

    def _start_rows(self, instance: _RowsProgram, plan: _RowsPlan, inputs: _RowsInputs) -> str | None:
        """Run ``instance`` on its inputs' values — numpy first: nothing joins the graph unless
        the run succeeds — then add its nodes (:meth:`_add_rows_program`); or say why it failed."""
        loop, rows = instance.loop, instance.rows
        by_input = sorted(rows, key=_by_input)
        init_values = []
        for k in range(len(loop.carries)):
            column = [j.state[k] for j in rows]
            if isinstance(column[0], ComputeNode) and all(p is column[0] for p in column):  # one node for all
                instance.shared_init[k] = True
                init_values.append(column[0]._value)
            else:
                init_values.append(np.stack([p._value for p in column]))
        group_of: dict[VirtualNode, Any] = {
            item: np.concatenate([j.seqs[i]._value for j in by_input]) for i, item in enumerate(loop.items)
        }
        item_values = list(group_of.values())
        captured = instance.program.captured
        cap_values = [n._value if n is not None else inputs.values[v] for v, n in zip(captured, inputs.caps)]
        group_of.update(zip(captured, cap_values))
        instance.own_at = [captured.index(v) for v in plan.own]
        instance.padded, instance.extents = plan.padded, inputs.extents
        instance.masks = [step_input(key, inputs.extents[key.extent]) for key in plan.masking.keys]
        try:
            for v, attrs in zip(plan.hoisted, plan.hoisted_attrs):
                group_of[v] = cast(Op, v.op).forward(*[group_of[u] for u in v.inputs], **attrs)
            run = instance.forward(
                *init_values, *item_values, *[group_of[v] for v in plan.hoisted], *cap_values
            )
        except Exception as e:
            return f"its program raised {type(e).__name__}: {e}"
        instance.run = run
        self._add_rows_program(instance, plan.hoisted_attrs, group_of, inputs, is_grad_enabled())
        instance.ran()
        # what the instance reads later, not the jobs (which reach the inputs' views, which reach it)
        instance.rows = [_Ran(j.inp, j.idx, j.captured) for j in rows]
        return None

    def _run_rows(self, jobs: list[_LoopJob]) -> str | None:
        """Run the loop of ``jobs`` (one per input, as :meth:`_run_jobs`) as one body program over
        rows (:class:`_RowsProgram`), or say why not (``None``: it ran; nothing was added to the
        graph otherwise; see :meth:`_rows_plan`)."""
        loop = jobs[0].loop
        program = self._rows_program(loop)
        if isinstance(program, str):
            return program
        if any(j.trips is None for j in jobs):
            return "its trip count is not known when it starts: it runs op by op across inputs"
        rows = sorted(jobs, key=lambda j: (-cast(int, j.trips), j.inp))
        first = rows[0]
        longest = cast(int, first.trips)
        if longest == 0:
            return "no input runs an iteration"
        if longest > loop.max_iters:
            return f"an input would run more than max_iters={loop.max_iters} iterations"
        inputs = self._rows_inputs(program, rows)
        if isinstance(inputs, str):
            return inputs
        by_input = sorted(rows, key=_by_input)
        rows_in_source = sum(len(j.seqs[0]._value) for j in by_input) if loop.items else 0
        plan = self._rows_plan(program, first, inputs, rows_in_source)
        if isinstance(plan, str):
            return plan
        variant = self._rows_variant(program, rows, inputs, plan)
        lengths = [len(j.seqs[0]._value) if loop.items else cast(int, j.trips) for j in rows]
        instance = _RowsProgram(program, variant, rows, plan.layout, inputs.sparse(), lengths)
        instance.index = [instance.order_of[plan.direction[v]] for v in (*loop.items, *plan.hoisted)]
        return self._start_rows(instance, plan, inputs)

    def _run_tree_rows(self, jobs: list[_TreeJob]) -> str | None:
        """Run the recursion of ``jobs`` (one per input, as :meth:`_run_tree_jobs`) as one body
        program over tree nodes (:class:`_RowsProgram`): level by level, every input's tree
        nodes whose children are done in one step, children gathered by index, a branch chosen
        per tree node (the rows split by choice where they differ). Returns why not (``None``:
        it ran; nothing was added to the graph otherwise)."""
        loop = jobs[0].loop
        program = self._rows_program(loop)
        if isinstance(program, str):
            return program
        rows = sorted(jobs, key=_by_input)
        inputs = self._rows_inputs(program, rows)
        if isinstance(inputs, str):
            return inputs
        plan = self._rows_plan(program, rows[0], inputs, sum(cast(int, j.trips) for j in rows))
        if isinstance(plan, str):
            return plan
        variant = self._rows_variant(program, rows, inputs, plan)
        trips = [cast(int, j.trips) for j in rows]
        kids = [np.asarray(j.rows, dtype=np.intp) for j in rows]
        instance = _RowsProgram(program, variant, rows, plan.layout, inputs.sparse(), trips, kids)
        instance.index = [instance.order_of[plan.direction[v]] for v in (*loop.items, *plan.hoisted)]
        return self._start_rows(instance, plan, inputs)

    def _add_rows_program(
        self,
        instance: _RowsProgram,
        hoisted_attrs: list[dict[str, Any]],
        group_of: dict[VirtualNode, Any],
        inputs: _RowsInputs,
        grad: bool,
    ) -> None:
        """Add a run's nodes to the graph — the carries' initial rows, the packed items, the
        hoisted groups, the loop node and its outputs — and give every input its outputs."""
        g, loop, program, variant, rows = (
            self.graph,
            instance.loop,
            instance.program,
            instance.variant,
            instance.rows,
        )
        by_input = sorted(rows, key=_by_input)
        parents: list[ComputeNode] = []
        for k, c in enumerate(loop.carries):
            column = [j.state[k] for j in rows]
            shared = instance.shared_init[k]  # (its rows are its value broadcast: see forward)
            parents.append(column[0] if shared else self._stack(column, NodeKey(c.type, c.id, rows[0].idx)))
        sources: dict[VirtualNode, ComputeNode] = {}  # items and hoisted nodes, rows in input order
        for i, item in enumerate(loop.items):
            sources[item] = self._concat([j.seqs[i] for j in by_input])
            parents.append(sources[item])
        caps = [
            n if n is not None else self._own_rows(v, inputs, rows)
            for v, n in zip(program.captured, inputs.caps)
        ]
        cap_of = dict(zip(program.captured, caps))
        for v, attrs in zip(variant.hoisted, hoisted_attrs):
            self._serial += 1
            node = g._add_op(
                cast(Op, v.op),
                tuple([sources[u] if u in sources else cap_of[u] for u in v.inputs]),
                attrs or None,
                NodeKey(f"{v.type}*", v.id, (self._serial,)),
                v.name,
                value=group_of[v],
            )
            self.groups.append((f"{v.type}*:{v.id}", len(rows)))  # (hoisted, as hoist_loop names them)
            self._copies[node] = (NodeKey(v.type, v.id, (*rows[0].idx, 0)), len(rows), len(rows))
            sources[v] = node
            instance.hoisted_nodes[v] = node
            parents.append(node)
        first_cap = len(parents)
        parents.extend(caps)
        call = instance.vjp
        vjps: list[Any] = [partial(call, i) if grad else None for i in range(first_cap)]
        vjps += [
            partial(call, first_cap + j)
            # (a value only hoisted nodes read gets its gradient from their nodes, not the loop's)
            if grad and v in variant.needs and (v in variant.stepped_captured or v in variant.own)
            else None
            for j, v in enumerate(program.captured)
        ]
        self._serial += 1
        run = cast(ProgramRun, instance.run)
        node = g._add_op(
            Op("Loop", instance.forward, tuple(vjps), arity=len(parents), partial_grads=True),
            tuple(parents),
            None,
            NodeKey("Loop", loop.id, (self._serial,)),
            loop.name,
            value=run,
        )
        instance.graph, instance.node_key = weakref.ref(g), node.key
        self.groups.append((f"Loop:{loop.id}", len(rows)))
        self._copies[node] = (NodeKey(loop.type, loop.id, rows[0].idx), len(rows), len(rows))
        self.rows_programs.append(instance)
        for r, j in enumerate(rows):
            j.count = cast(int, j.trips)
            j.stacks = [None] * len(program.stacked)
            j.view._rows[(loop, j.idx)] = (instance, r)
        done: set[int] = set()
        for k, v in enumerate(program.finals):
            carry = loop.carries.index(v.inputs[1])
            if carry in done:
                continue
            done.add(carry)
            self._serial += 1
            out = g._add_op(
                Op("LoopFinal", partial(instance.final, carry), (partial(_seed_vjp, k),), arity=1),
                (node,),
                None,
                NodeKey("Final*", v.id, (self._serial,)),
                v.name,
                value=instance.final(carry, run),
            )
            instance.output_keys.append(out.key)
            for r, j in enumerate(rows):
                j.state[carry] = Row(out, (r,), NodeKey("Final", v.id, j.idx), v.name)
        nf = len(program.finals)
        for k, s in enumerate(program.stacked):
            self._serial += 1
            out = g._add_op(
                Op("LoopStack", partial(instance.stacked, k), (partial(_seed_vjp, nf + k),), arity=1),
                (node,),
                None,
                NodeKey("Stack*", s.id, (self._serial,)),
                s.name,
                value=instance.stacked(k, run),
            )
            instance.output_keys.append(out.key)
            a = 0
            for j in by_input:
                trips = cast(int, j.trips)
                if trips:  # (no iteration: nothing to stack, an error only if the stack is used)
                    cast("list[Any]", j.stacks)[k] = Row(
                        out, (slice(a, a + trips),), NodeKey("Stack", s.id, j.idx), s.name
                    )
                a += trips

    def _resume(self, i: int, agent: Any, result: Any) -> Any:
        """Give input ``i``'s greenlet ``agent`` the result it waits for; returns its next request
        (``None``: done; a :class:`_Spawn`: greenlets to start). An error in its build names the
        input."""
        try:
            return agent.switch(result) if result is not None else agent.switch()
        except Exception as e:
            raise _naming(f"input {i}", e) from e

    def _wait(self, i: int, answer: Any) -> None:
        """File input ``i``'s next request under its declared node's rank (``None``: that greenlet
        is done; a :class:`_Spawn`: start greenlets and file their requests)."""
        if type(answer) is _Request or type(answer) is _LoopJob or type(answer) is _TreeJob:
            key = answer.key
            # a hoisted group <MatMul*:k> waits with (but apart from) the copies of <MatMul:k>
            rank = (self._order.get((key.type.rstrip("*"), key.id), -1), key.type)
            bucket = self._waiting.get(rank)
            if bucket is None:
                self._waiting[rank] = [answer]
            else:
                bucket.append(answer)
        elif answer is not None:
            for agent in answer.start:
                self._wait(i, self._resume(i, agent, None))
            if answer.resume is not None:
                self._wait(i, self._resume(i, answer.resume, None))

    def _next_group(self) -> list[Any]:  # requests, or jobs
        """The requests to run together: those for the declared node first in declaration order
        among the asked-for ones, with the most common signature (per-row shapes and dtypes), in
        input order (or the inputs' runs of a loop run in lockstep, :class:`_LoopJob`)."""
        waiting = self._waiting
        rank = min(waiting)
        bucket = waiting.pop(rank)
        if len(bucket) == 1 or type(bucket[0]) in (_LoopJob, _TreeJob):
            self._ragged_members = None
            return bucket
        bucket.sort(key=_by_input)
        members, self._ragged_members = _same_signature(bucket)
        if len(members) < len(bucket):
            chosen = {id(r) for r in members}
            waiting[rank] = [r for r in bucket if id(r) not in chosen]
        return members

    def _run_requests(self, v: VirtualNode, requests: list[_Request]) -> None:
        """Run every request for copies of ``v``, as few ops as their shapes allow, and put each
        result into the environment the request names (``r.agent``). Errors name the input."""
        while requests:
            group, ragged = _same_signature(requests)
            try:
                results = self._execute(group, ragged)
            except Exception as e:
                self._blame(group, e)
            for r, result in zip(group, results):
                r.agent[v] = result
            if len(group) == len(requests):
                return
            chosen = {id(r) for r in group}
            requests = [r for r in requests if id(r) not in chosen]

    def _blame(self, requests: list[_Request], e: Exception) -> NoReturn:
        """Raise for ``e``, raised while running ``requests`` (copies of one declared node) as one
        op: which input caused it is found by running each copy alone, in order (on this error
        path only); the first that fails raises what a build of its input alone would (naming
        the unrolled node, e.g. ``<Take:1@3>``, or under anomaly detection the first non-finite
        copy), prefixed with its input. If no copy fails alone, ``e`` names every input."""
        for r in requests:
            parents = tuple([_as_declared(p) for p in r.parents])
            copy = ComputeNode(
                r.key, None, r.op, cast("tuple[ComputeNode, ...]", parents), r.attrs, False, r.name
            )
            try:
                self.graph._run(copy)  # (a Row stands for a parent: it has the value and the key)
            except Exception as alone:
                raise _naming(f"input {r.inp}", alone) from e
        inputs = sorted({r.inp for r in requests})
        if len(inputs) == 1:
            raise _naming(f"input {inputs[0]}", e) from e
        raise _naming(f"inputs {', '.join(map(str, inputs))} (computed together)", e) from e

    def _execute(self, members: list[_Request], ragged: list[bool] | None = None) -> list[Any]:
        """Run ``members`` (copies of one declared node) as one op; ``ragged``: their inputs
        differ in length and these are concatenated (see :func:`_same_signature`)."""
        g = self.graph
        first = members[0]
        if ragged is not None:
            return self._execute_ragged(members, ragged)
        if len(members) > 1:  # (a variadic op's members have equally many inputs: same signature)
            inputs: list[ComputeNode] = []
            shapes: list[tuple[int, ...]] = []
            stacked: list[bool] = []
            for j in range(len(first.parents)):
                column = [r.parents[j] for r in members]
                p0 = column[0]
                if isinstance(p0, ComputeNode) and all(p is p0 for p in column):
                    inputs.append(p0)  # the same node for everyone (a parameter): broadcast
                    shapes.append(np.shape(p0._value))
                    stacked.append(False)
                else:
                    inputs.append(self._stack(column, first.key))
                    shapes.append(np.shape(p0._value))
                    stacked.append(True)
            if not any(stacked):  # the same inputs for every copy (a shared constant state): the
                node = self._single(first)  # same value — computed once, the node for everyone
                self._copies[node] = (first.key, len(members), len({r.inp for r in members}))
                self.groups[-1] = (self.groups[-1][0], len(members))
                return [node] * len(members)
            attrs = batched_attrs(first.op, first.attrs or {}, shapes, stacked, len(members))
            if attrs is not None:
                self._serial += 1
                key = NodeKey(f"{first.key.type}*", first.key.id, (self._serial,))
                group = g._add_op(first.op, tuple(inputs), attrs or None, key, first.name)
                if checks_rows(first.op):  # its promise to act elementwise
                    check_rows(
                        first.op, first.key, group._value[0], [p._value for p in first.parents], first.attrs
                    )
                self.groups.append((f"{first.key.type}:{first.key.id}", len(members)))
                self._copies[group] = (first.key, len(members), len({r.inp for r in members}))
                if first.op.kind == CELL:  # gates lead those values
                    return [
                        Row(group, ((slice(None), r),), req.key, req.name) for r, req in enumerate(members)
                    ]
                return [_row(group, r, req) for r, req in enumerate(members)]
        return [self._single(r) for r in members]

    def _execute_ragged(self, members: list[_Request], ragged: list[bool]) -> list[Any]:
        """Run ``members`` (whose inputs differ in length along axis 0 only, see :func:`_ragged`)
        as one op on their inputs concatenated along axis 0; each gets its rows of the result."""
        first = members[0]
        inputs = []
        for j, rg in enumerate(ragged):
            column = [r.parents[j] for r in members]
            inputs.append(self._concat(column) if rg else column[0])
        op, attrs = first.op, first.attrs
        lengths = [len(r.parents[ragged.index(True)]._value) for r in members]
        if op is _GETITEM:
            attrs, lengths = _sliced_rows(first.attrs["index"], lengths)
        elif op.name in ("Sum", "Mean"):  # one value per input: its row of the segments' reduction
            sizes = np.asarray(lengths, dtype=np.intp)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.intp)
            attrs = {"starts": starts, "sizes": sizes, "whole": first.attrs.get("axis") is None,
                     "mean": op.name == "Mean"}  # fmt: skip
            op = _SEGMENT_SUM
        self._serial += 1
        key = NodeKey(f"{first.key.type}*", first.key.id, (self._serial,))
        group = self.graph._add_op(op, tuple(inputs), attrs, key, first.name)
        if op is _SEGMENT_SUM:
            self.groups.append((f"{first.key.type}:{first.key.id}", len(members)))
            self._copies[group] = (first.key, len(members), len({r.inp for r in members}))
            return [_row(group, r, req) for r, req in enumerate(members)]
        self.groups.append((f"{first.key.type}:{first.key.id}", len(members)))
        self._copies[group] = (first.key, len(members), len({r.inp for r in members}))
        j = ragged.index(True)
        out, a = [], 0
        value = group._value
        if checks_rows(first.op):  # its promise to act elementwise
            rows = value[: len(first.parents[j]._value)]
            check_rows(first.op, first.key, rows, [p._value for p in first.parents], first.attrs)
        for req, n in zip(members, lengths):
            b = a + n
            row = _new_row(Row)
            row.src, row.path, row._key, row.name, row._value = (
                group,
                (slice(a, b),),
                req.key,
                req.name,
                value[a:b],
            )
            out.append(row)
            a = b
        return out

    def _own_rows(self, v: VirtualNode, inputs: _RowsInputs, rows: Sequence[Any]) -> ComputeNode:
        """One node whose rows are each input's own value of captured ``v`` (in the order of
        ``rows``), padded with zeros where their lengths differ (``PadStack``)."""
        column = inputs.own[v]
        if v not in inputs.padded:
            return self._stack(column, NodeKey(v.type, v.id, rows[0].idx))
        self._serial += 1
        values = inputs.values[v]
        return self.graph._add_op(
            _PAD_STACK,
            tuple(p if isinstance(p, ComputeNode) else self._unwrap(p) for p in column),
            {"shape": values.shape[1:]},
            NodeKey("PadStack", self._serial, ()),
            v.name,
            value=values,
        )

    def _concat(self, column: list[Any]) -> ComputeNode:
        """One node: the given values concatenated along axis 0 (the source itself when they are
        its consecutive row ranges, in order)."""
        p0 = column[0]
        if type(p0) is Row and len(p0.path) == 1 and isinstance(p0.path[0], slice):
            src, a = p0.src, 0
            for p in column:
                if type(p) is not Row or p.src is not src or p.path != (slice(a, a + len(p._value)),):
                    break
                a += len(p._value)
            else:
                if a == len(src._value):
                    return src
        nodes = tuple(p if isinstance(p, ComputeNode) else self._unwrap(p) for p in column)
        self._serial += 1
        return self.graph._add_op(_CONCAT, nodes, {"axis": 0}, NodeKey("Concat", self._serial, ()), None)

    def _single(self, r: _Request) -> ComputeNode:
        """An op run for one input alone (nothing to batch it with, or an op that cannot be)."""
        parents = tuple(p if isinstance(p, ComputeNode) else self._unwrap(p) for p in r.parents)
        self.groups.append((f"{r.key.type}:{r.key.id}", 1))
        node = self.graph._add_op(
            r.op, parents, r.attrs, NodeKey(f"{r.key.type}#{r.inp}", r.key.id, r.key.idx), r.name
        )
        self._copies[node] = (r.key, 1, 1)
        return node

    def _unwrap(self, row: Row) -> ComputeNode:
        """A node whose value is the row itself: one ``GetItem`` of its group when one basic index
        reaches it, else a gather of the one row."""
        if len(row.path) == 1:
            self._serial += 1
            return self.graph._add_op(
                _GETITEM, (row.src,), {"index": row.path[0]}, NodeKey("Row", self._serial, ()), None
            )
        return self._stack([row], row.key, single=True)

    def _view(self, src: ComputeNode, index: Any) -> ComputeNode:
        """``src[index]`` for a basic index: a view, whose gradient is one slice of src's."""
        self._serial += 1
        return self.graph._add_op(_GETITEM, (src,), {"index": index}, NodeKey("Rows", self._serial, ()), None)

    def _stack(self, column: Sequence[Any], key: NodeKey, single: bool = False) -> ComputeNode:
        """One node whose rows are the given values (rows of groups, or whole nodes), in order;
        ``single``: the value of one row itself (no new axis).

        Rows that are a group's rows in order need no copy: the group itself, or — for a value
        taken from each row (``h'`` of a fused cell's ``(gates, n, …)`` value) — one view of it.
        """
        first = column[0]
        if not single and isinstance(first, Row):
            src, n = first.src, len(column)
            if all(type(p) is Row and p.src is src for p in column):
                paths = [p.path for p in column]
                if paths == [(r,) for r in range(n)]:  # the group's first n rows, in order
                    if n == len(src._value):
                        return src  # already a group in this order
                    return self._view(src, slice(0, n))
                tail = first.path[1:]
                lead = first.path[0]
                if (
                    isinstance(lead, tuple)
                    and len(tail) == 1
                    and paths == [((slice(None), r), *tail) for r in range(n)]
                ):  # src[:, r][k] for the first n r, in order: src[k] (or src[k, :n])
                    return self._view(
                        src, tail[0] if n == np.shape(src._value)[1] else (tail[0], slice(0, n))
                    )
                rows = _rows_of(paths)
                if rows is not None:  # rows of src picked by one integer-array index: no Python loop
                    return self._view(src, rows)  # in backward (np.add.at once)
        sources: list[ComputeNode] = []
        position: dict[int, int] = {}
        where: list[tuple[int, Any]] = []
        for p in column:
            src, row = (p.src, p.path) if type(p) is Row else (p, ())
            k = position.get(id(src))
            if k is None:
                k = position[id(src)] = len(sources)
                sources.append(src)
            where.append((k, row))
        self._serial += 1
        node = self.graph._add_op(
            _GATHER, tuple(sources), {"rows": tuple(where)}, NodeKey("Gather", self._serial, ()), None
        )
        if single:
            self._serial += 1
            return self.graph._add_op(_GETITEM, (node,), {"index": 0}, NodeKey("Row", self._serial, ()), None)
        return node


def _same_attrs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two attribute dicts are equal (arrays compared by value)."""
    if a is b:
        return True
    if a.keys() != b.keys():
        return False
    try:
        return all(bool(np.all(a[k] == b[k])) for k in a)
    except Exception:  # (values numpy cannot compare: not the same)
        return False


def _base(p: Any) -> ComputeNode:
    """The node a value is (a row's group node for a :class:`Row`)."""
    return cast(ComputeNode, p.src if type(p) is Row else p)


class _Ran:
    """What a program over rows keeps of one input's job once it ran."""

    __slots__ = ("captured", "idx", "inp")

    def __init__(self, inp: int, idx: tuple[int, ...], captured: dict[VirtualNode, Any]) -> None:
        self.inp, self.idx, self.captured = inp, idx, captured


class _RowsProgram(SweptOnce):
    """A loop or recursion of a batched build run as ONE body program over rows (see
    :meth:`BatchedBuild._run_rows`, :meth:`BatchedBuild._run_tree_rows`).

    Every iteration of every input — a loop's step, a recursion's tree node — is one *row*,
    numbered ``0 .. N-1``; each carry's updates are the rows of one buffer whose last ``B`` rows
    are the inputs' initial values. The generated forward step runs once per *level* on that
    level's rows, reading its carries from each row's predecessor (the previous iteration, or the
    initial value) and a recursion's children from their rows, gathered by index:

    - a loop's level ``t`` is iteration ``t`` of every input that has one; the rows are numbered
      iteration by iteration with the inputs longest run first, so a level and its predecessors
      are contiguous (views, no gather: PyTorch's packed-sequence layout);
    - a recursion's level is every tree node whose children are done (leaves first); its rows are
      numbered input by input, tree node by tree node, and its carries read the initial value
      (a recursion in depth order reads its state only through its children).

    Where a branch chooses differently for a level's rows, the step runs once per choice on those
    rows (:class:`_RowsSelect`). The backward step runs once per step, last first, adding each
    row's carry and children's gradients into its predecessor's and children's rows. Stepped
    items and hoisted nodes come as the inputs' sequences give them (concatenated in input order)
    and are read through one index per direction.

    In the batched graph it is one node ``<Loop:id@…>`` (value: a :class:`.program.ProgramRun`,
    one record per step), a node per final carry (rows in the order of :attr:`rows`) and per
    stacked value (every input's iterations in order, inputs concatenated in input order)."""

    def __init__(
        self,
        program: BodyProgram,
        variant: Any,
        rows: list[Any],
        layout: dict[VirtualNode, Any],
        sparse: list[bool],
        lengths: list[int],
        kids: list[np.ndarray] | None = None,
    ) -> None:
        """``rows``: the inputs' jobs (a loop's longest run first, a recursion's in input
        order); ``lengths``: their stepped sequences' lengths; ``kids``: a recursion's children
        arrays (``None``: a loop)."""
        self.program, self.variant, self.loop = program, variant, program.loop
        self.sparse = sparse  # per captured value: whether its gradient is kept row-sparse
        self.rows = rows  # the inputs' jobs; after the run, what _Ran keeps of them
        self.init_nodes = [list(j.state) for j in rows]  # (a job's state becomes its finals)
        self.layout = layout  # body node -> 0 (rows along axis 0), 1 (a fused cell's: axis 1), None (shared)
        self.trips = trips = [cast(int, j.trips) for j in rows]
        B, N = len(rows), sum(trips)
        loop = self.loop
        self.chain = kids is None
        self.reads = [(loop.carries.index(read.inputs[0]), read.attrs["slot"]) for read in loop.children]
        if kids is None:  # row of (r, t): first[t] + r
            T = max(trips, default=0)
            ended = np.bincount(trips, minlength=T + 1)
            live = (B - np.cumsum(ended)[:T]).tolist()  # rows running iteration t
            first = [0, *itertools.accumulate(live)]
            self.owner = np.concatenate([np.arange(n, dtype=np.intp) for n in live] or [np.empty(0, np.intp)])
            self.tpos = np.repeat(np.arange(T, dtype=np.intp), live)
            self.levels: list[Any] = [slice(first[t], first[t] + n) for t, n in enumerate(live)]
            self.preds: list[Any] = [
                slice(first[t - 1], first[t - 1] + n) if t else slice(N, N + n) for t, n in enumerate(live)
            ]
            self.first = first
            self.kids = np.empty((N, 0), dtype=np.intp)
        else:  # row of (r, t): offs[r] + t
            offs = [0, *itertools.accumulate(trips)]
            self.owner = np.repeat(np.arange(B, dtype=np.intp), trips)
            self.tpos = np.arange(N, dtype=np.intp) - np.asarray(offs[:-1], dtype=np.intp)[self.owner]
            width = max(k.shape[1] for k in kids)  # (narrower arrays: no such child)
            at = np.full((N, width), -1, dtype=np.intp)
            for r, k in enumerate(kids):
                at[offs[r] : offs[r + 1], : k.shape[1]] = np.where(k >= 0, k + offs[r], -1)
            at[at < 0] = N + self.owner[np.nonzero(at < 0)[0]]  # a missing child: the initial value
            self.kids = at
            level = np.zeros(N + B, dtype=np.intp)  # (a fixed point: a level is one more than its children's)
            level[N:] = -1
            if width:
                while True:
                    new = level[at].max(axis=1) + 1
                    if np.array_equal(new, level[:N]):
                        break
                    level[:N] = new
            order = np.argsort(level[:N], kind="stable")  # (rows in input order within a level)
            self.levels = np.split(order, np.cumsum(np.bincount(level[:N]))[:-1])
            self.preds = [N + self.owner[ids] for ids in self.levels]  # (never read: see _by_depth)
            self.offs = offs
        # each input's rows in input order (the stacked values' order), and its last row
        by_input = sorted(range(B), key=lambda r: rows[r].inp)
        self.in_input_order = np.concatenate(
            [self.row(r, np.arange(trips[r], dtype=np.intp)) for r in by_input] or [np.empty(0, np.intp)]
        )
        self.roots = np.asarray(
            [self.row(r, trips[r] - 1) if trips[r] else N + r for r in range(B)], dtype=np.intp
        )
        # a forest (no tree node the child of two nodes, nor twice of one): children's gradients
        # go back by plain indexing
        self.tree = bool(np.bincount(self.kids[self.kids < N], minlength=1).max(initial=0) <= 1)
        self.init_needs = [c in variant.needs for c in loop.carries]  # (their initial rows need gradients)
        # per direction (forwards / reversed): each row's row in the inputs' sequences,
        # concatenated in input order
        start = np.zeros(B, dtype=np.intp)
        start[by_input] = np.cumsum([0, *(lengths[r] for r in by_input)])[:-1]
        begin, length = start[self.owner], np.asarray(lengths, dtype=np.intp)[self.owner]
        self.order_of = {False: begin + self.tpos, True: begin + length - 1 - self.tpos}
        self.index: list[np.ndarray] = []  # per stepped value (items, hoisted nodes): order_of's
        self.update_slots = [variant.slot[loop.updates[c]] for c in loop.carries]
        self.stack_slots = [variant.slot[st.inputs[1]] for st in program.stacked]
        self.shared_init = [False] * len(loop.carries)  # per carry: one node for every input
        self.steps: list[Any] = []  # per record: its rows and their predecessors' (slices or indices)
        self.choices: list[list[tuple[BranchNode, int]]] = []  # per record: the choices it made
        self.step_of = np.zeros(N, dtype=np.intp)  # per row: its record and its row in it
        self.pos_of = np.zeros(N, dtype=np.intp)
        self.run: ProgramRun | None = None
        self.kept: list[Any] | None = None  # per record, every slot's gradient (when retained)
        self.hoisted_nodes: dict[VirtualNode, ComputeNode] = {}  # (see _add_rows_program)
        # captured values each row has its own of (their positions among the captured values),
        # the body nodes padded along an axis, the inputs' lengths there and the steps' masks
        # (.padded; set by BatchedBuild._start_rows)
        self.own_at: list[int] = []
        self.padded: dict[VirtualNode, Padded] = {}
        self.extents: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        # The loop node and its outputs are named by key in a graph held weakly (they hold this
        # instance: their ops are its methods).
        self.graph: Callable[[], ComputeGraph | None] = lambda: None
        self.node_key: NodeKey | None = None
        self.output_keys: list[NodeKey] = []  # when one retains its gradient, so do the body nodes

    def row(self, r: int, t: Any) -> Any:
        """The row (or rows) of input row ``r``'s iteration(s) ``t`` (an int or an index array)."""
        if not self.chain:
            return self.offs[r] + t
        first = np.asarray(self.first, dtype=np.intp)[t] if isinstance(t, np.ndarray) else self.first[t]
        return first + r

    def _who(self, ids: Any) -> Any:
        """The input rows (positions in :attr:`rows`) that rows ``ids`` belong to: a slice for a
        loop's level (its rows are the first inputs, in order), else an index array."""
        if self.chain and type(ids) is slice:
            return slice(0, ids.stop - ids.start)
        return self.owner[ids]

    def idx_of(self, g: int) -> tuple[int, ...]:
        """The iteration path of row ``g``."""
        return (*self.rows[int(self.owner[g])].idx, int(self.tpos[g]))

    def _retained(self) -> bool:
        """Whether an output of the loop node retains its gradient (then the body nodes do)."""
        graph = self.graph()
        return graph is not None and any(graph.node(k).retains_grad for k in self.output_keys)

    def _padding(self) -> Any:
        """The numpy error state of this program's steps: where values are padded, the padding's
        arithmetic (``log(0)``, ``0 / 0`` in a VJP, masked afterwards) raises no warning — about
        values no input has. (Anomaly mode, which checks every value, runs node by node.)"""
        return np.errstate(divide="ignore", invalid="ignore") if self.masks else contextlib.nullcontext()

    # -- forward
    def forward(self, *values: Any) -> ProgramRun:
        """Run the steps level by level on the loop node's parents' values: the carries' initial
        rows, the items and hoisted nodes (rows in input order), the captured values."""
        with self._padding():
            return self._forward(values)

    def _forward(self, values: Sequence[Any]) -> ProgramRun:
        loop, variant = self.loop, self.variant
        nc, ni, ns = len(loop.carries), len(loop.items), len(self.index)
        N, B = len(self.owner), len(self.rows)
        init = [
            np.broadcast_to(x, (B, *np.shape(x))) if shared else x
            for x, shared in zip(values[:nc], self.shared_init)
        ]
        hist = [np.empty((N + B, *x.shape[1:]), dtype=x.dtype) for x in init]
        for h, x in zip(hist, init):
            h[N:] = x
        stepped = [x[at] for x, at in zip(values[nc : nc + ns], self.index)]  # in row order
        own = [values[nc + ns + j] for j in self.own_at]  # (per input row; then the masks)
        own += self.masks
        select = _RowsSelect(self, self.layout)
        step = variant._make_step(select, *values[nc + ns :])
        run = ProgramRun()
        self.steps, self.choices = [], []
        records, kids, reads, slots = run.records, self.kids, self.reads, self.update_slots
        chain, no_carries = self.chain, [None] * nc
        for level, pred in zip(self.levels, self.preds):
            pending: list[tuple[Any, Any, dict[BranchNode, int]]] = [(level, pred, {})]
            while pending:
                ids, pred, fixed = pending.pop()
                select.ids, select.fixed, select.chosen = ids, fixed, {}
                at = [x[ids] for x in stepped]
                if own:
                    who = self._who(ids)
                    at += [x[who] for x in own]
                try:
                    record = step(
                        len(records),
                        # (a recursion reads its carries only through its children: _by_depth)
                        *([h[pred] for h in hist] if chain else no_carries),
                        *at[:ni],
                        *[hist[k][kids[ids, slot]] for k, slot in reads],
                        *at[ni:],
                    )
                except _Split as split:
                    ids, pred = _indices(ids), _indices(pred)
                    known = {**select.chosen, split.branch: 0}
                    for c in sorted(set(split.choices.tolist()), reverse=True):
                        known[split.branch] = c
                        part = split.choices == c
                        pending.append((ids[part], pred[part], dict(known)))
                    continue
                for st, slot in zip(self.program.stacked, self.stack_slots):
                    if record[slot] is None:
                        raise BuildError(f"{st.describe()} stacks a value not computed in every iteration")
                self.step_of[ids] = len(records)
                self.pos_of[ids] = np.arange(len(self.owner[ids]))
                records.append(record)
                self.steps.append((ids, pred))
                chosen = select.chosen  # (recorded in declaration order, as a program alone records them)
                self.choices.append([(b, chosen[b]) for b in variant.choice if b in chosen])
                for h, slot in zip(hist, slots):
                    h[ids] = record[slot]
        run.history = hist
        run.trips = len(records)
        return run

    def ran(self) -> None:
        """Give each input's job the decisions of its iterations (the branches' choices), as a
        build node by node records them."""
        owner, tpos, rows = self.owner, self.tpos, self.rows
        if any(self.choices):
            for job, trips in zip(rows, self.trips):
                if len(job.decisions) < trips:
                    job.decisions = [[] for _ in range(trips)]
        for (ids, _), choices in zip(self.steps, self.choices):
            if not choices:
                continue
            for r, t in zip(owner[ids].tolist(), tpos[ids].tolist()):
                job = rows[r]
                idx, made = (*job.idx, t), job.decisions[t]
                for branch, c in choices:
                    made.append(Decision(branch, idx, "option", c))

    def final(self, k: int, run: ProgramRun) -> Any:
        """Carry ``k``'s final value of every input (in the order of :attr:`rows`): its update
        in the input's last iteration, its initial value for an input that ran none."""
        return run.history[k][self.roots]

    def stacked(self, j: int, run: ProgramRun) -> Any:
        """Stacked value ``j`` of every input after ``run``: its iterations' values in order,
        inputs concatenated in input order."""
        slot = self.stack_slots[j]
        first = run.records[0][slot]
        out = np.empty((len(self.owner), *np.shape(first)[1:]), dtype=np.asarray(first).dtype)
        for (ids, _), record in zip(self.steps, run.records):
            out[ids] = record[slot]
        return out if not self.chain else out[self.in_input_order]

    # -- backward
    def backward(self, g: RunGrad, run: ProgramRun, values: Sequence[Any]) -> list[Any]:
        with self._padding():
            return self._backward(g, run, values)

    def _backward(self, g: RunGrad, run: ProgramRun, values: Sequence[Any]) -> list[Any]:
        loop, variant, program = self.loop, self.variant, self.program
        nc, ni, ns = len(loop.carries), len(loop.items), len(self.index)
        nr = len(self.reads)
        caps = values[nc + ns :]
        accs = [_Acc(sp) for sp in self.sparse]
        back = variant._make_back(*caps, *accs)
        N = len(self.owner)
        # per carry: the gradient of every row's update, and of the inputs' initial rows
        grads = [np.zeros(h.shape, dtype=_grad_dtype(h)) for h in run.history]
        reached = [False] * nc  # per carry: whether any gradient reached its rows (else: None)
        nf = len(program.finals)
        for k, f in enumerate(program.finals):
            s = g.seeds.get(k)
            if s is not None:
                c = loop.carries.index(f.inputs[1])
                grads[c][self.roots] += densified(s)
                reached[c] = True
        stack_seed: list[Any] = []
        for j in range(len(program.stacked)):
            s = g.seeds.get(nf + j)
            if s is not None:
                s = densified(s)
                if self.chain:  # (input order -> row order)
                    rows = np.empty_like(s)
                    rows[self.in_input_order] = s
                    s = rows
            stack_seed.append(s)
        step_grad: list[Any] = [None] * ns  # in row order
        own_grad: list[Any] = [None] * len(self.own_at)  # per own captured value, per input row
        keep = self._retained()
        kept: list[Any] = [None] * len(self.steps)
        kids, chain = self.kids, self.chain
        for t in range(len(self.steps) - 1, -1, -1):
            ids, pred = self.steps[t]
            u = [gr[ids] if hit else None for gr, hit in zip(grads, reached)]
            q = [None if s is None else s[ids] for s in stack_seed]
            try:
                if keep:
                    res, kept[t] = back(True, run.records[t], *u, *q)
                else:
                    res = back(False, run.records[t], *u, *q)
            except VGraphError:
                raise
            except Exception as e:
                first = int(_indices(ids)[0])
                raise _step_error(
                    variant, e, [self.rows[r].inp for r in self.owner[ids].tolist()], self.idx_of(first)
                ) from e
            for k in range(nc):
                d = res[k]
                if d is not None:  # (a loop's: each row one predecessor; a recursion's carries are not read)
                    d = densified(d)
                    reached[k] = True
                    if chain:
                        grads[k][pred] += d
                    else:
                        add_at(grads[k], pred, d)
            for r, (k, slot) in enumerate(self.reads):
                d = res[nc + ni + r]
                if d is None:
                    continue
                d = densified(d)
                reached[k] = True
                at = kids[ids, slot]
                if self.tree:  # each tree node is one row's child: indexing adds each row once
                    real = at < N
                    grads[k][at[real]] += d[real]
                    if self.init_needs[k] and not real.all():  # (an initial row is many rows' child)
                        add_at(grads[k], at[~real], d[~real])
                else:
                    add_at(grads[k], at, d)
            for i in range(ns):
                d = res[nc + (i if i < ni else nr + i)]
                if d is None:
                    continue
                if step_grad[i] is None:
                    x = values[nc + i]
                    step_grad[i] = np.zeros((N, *np.shape(x)[1:]), dtype=_grad_dtype(x))
                step_grad[i][ids] += densified(d)
            for o, j in enumerate(self.own_at):
                d = res[nc + nr + ns + o]
                if d is None:
                    continue
                if own_grad[o] is None:
                    x = values[nc + ns + j]
                    own_grad[o] = np.zeros(np.shape(x), dtype=_grad_dtype(x))
                who = self._who(ids)
                if type(who) is slice:
                    own_grad[o][who] += densified(d)
                else:  # (a recursion's level: many rows of one input)
                    add_at(own_grad[o], who, densified(d))
        self.kept = kept if keep else None
        for i, rows in enumerate(step_grad):  # back to the sources' rows (each read at most once)
            if rows is not None:
                x = values[nc + i]
                step_grad[i] = np.zeros(np.shape(x), dtype=rows.dtype)
                step_grad[i][self.index[i]] = rows
        init_grad: list[Any] = []
        for k, gr in enumerate(grads):
            d = gr[N:] if reached[k] else None
            init_grad.append(d.sum(axis=0) if d is not None and self.shared_init[k] else d)
        cap_grad = [a.g for a in accs]
        for o, j in enumerate(self.own_at):
            cap_grad[j] = own_grad[o]
        return [*init_grad, *step_grad, *cap_grad]

    # -- one input's view
    def computed_with(self, r: int, t: int) -> tuple[int, int]:
        """How many rows row ``r``'s iteration ``t`` was computed with (itself included), and of
        how many inputs."""
        ids = self.steps[int(self.step_of[self.row(r, t)])][0]
        return len(self.owner[ids]), len(np.unique(self.owner[ids]))

    def value_of(self, v: VirtualNode, r: int, t: int) -> tuple[Any, Any]:
        """Body node ``v`` of input row ``r`` in iteration ``t``: ``(value, gradient or None)``,
        or ``(node, None)`` for what is a node of the batched graph (a captured value, an initial
        value); raises KeyError if the input has no such iteration or did not compute ``v`` there."""
        if not 0 <= t < self.trips[r]:
            raise KeyError(t)
        loop, variant = self.loop, self.variant
        if v.kind == "carry":  # a loop's: the previous iteration's update; a recursion's: the initial value
            if t == 0 or not self.chain:
                return self.init_nodes[r][loop.carries.index(v)], None
            v, t = loop.updates[v], t - 1
        if v in variant.captured:
            return self.rows[r].captured[v], None
        g = self.row(r, t)
        s, p = int(self.step_of[g]), int(self.pos_of[g])
        slot = variant.slot[v]
        value = cast(ProgramRun, self.run).records[s][slot]
        if value is None:  # (an option not chosen)
            raise KeyError(v)
        lay = self.layout.get(v, 0)
        at: Any = (slice(None), p) if lay == 1 else p
        grad = None
        kept = self.kept[s] if self.kept is not None else None
        if v in self.hoisted_nodes:  # its row of the hoisted group's gradient (the steps give only
            node = self.hoisted_nodes[v]  # part of it: other hoisted nodes read the group too)
            if node.grad is not None:
                source = self.index[len(loop.items) + variant.hoisted.index(v)][g]
                grad = np.array(np.asarray(node.grad)[source])
        elif kept is not None and kept[slot] is not None:
            gv = densified(kept[slot])  # (a node the same for every row: computed once, one gradient)
            grad = np.array(gv if lay is None else gv[at])
        value = value if lay is None else value[at]
        padded = self.padded.get(v)
        if padded is not None:  # without the padding
            cut = (*(slice(None),) * padded[0], slice(0, int(self.extents[padded[1]][r])))
            value, grad = value[cut], (None if grad is None else grad[cut])
        return value, grad


def _indices(ids: Any) -> np.ndarray:
    """Rows given as a slice or an index array, as an index array."""
    return np.arange(ids.start, ids.stop, dtype=np.intp) if isinstance(ids, slice) else ids


def _step_error(variant: Any, e: Exception, inputs: list[int], idx: tuple[int, ...]) -> Exception:
    """The error for exception ``e`` raised in a backward step over rows of ``inputs`` (body
    nodes named at iteration path ``idx``): naming the inputs computed together, the body node,
    its op and the input, as the per-node sweep and :meth:`.program.ProgramInstance._vjp_error`
    word it."""
    where = variant.failed_vjp(e)
    inputs = sorted(set(inputs))
    n = len(inputs)
    who = f"input {inputs[0]}" if n == 1 else f"inputs {', '.join(map(str, inputs))} (computed together)"
    loop = variant.program.loop
    if where is None:  # not in a VJP: the program itself
        return BackwardError(
            f"{who}: {loop.describe(idx)}: the backward step failed: {type(e).__name__}: {e}"
        )
    v, p = where
    op = cast(Op, v.op)
    node, parent = v.describe(idx), v.inputs[p].describe(idx)
    if isinstance(e, OpResultError):  # refused by a vgraph.defop op's CheckedVJP
        return e.error(f"{who}: {node}: the VJP of {op.name} for input {e.position} {parent} {e}")
    return BackwardError(
        f"{who}: {node}: the VJP of {op.name} with respect to its input {parent} failed: {type(e).__name__}: {e}"
    )


class _RowsPlan:
    """How a body runs on rows (:meth:`BatchedBuild._rows_plan`)."""

    __slots__ = (
        "attrs",
        "direction",
        "hoisted",
        "hoisted_attrs",
        "layout",
        "masking",
        "ops",
        "own",
        "padded",
    )

    def __init__(self) -> None:
        #: body node -> 0 (rows along axis 0), 1 (a fused cell's: axis 1), None (shared by all rows)
        self.layout: dict[VirtualNode, Any] = {}
        #: items and hoisted nodes -> whether they step through their sequences reversed
        self.direction: dict[VirtualNode, bool] = {}
        self.hoisted: list[VirtualNode] = []  # run once over every input's rows
        self.hoisted_attrs: list[dict[str, Any]] = []
        self.attrs: dict[VirtualNode, dict[str, Any]] = {}  # ops whose attributes change on rows
        self.ops: dict[VirtualNode, Op] = {}  # ops run as another op on rows (hoist.rows_op)
        self.own: list[VirtualNode] = []  # captured values each input has its own of (step inputs)
        self.padded: dict[VirtualNode, Padded] = {}  # body nodes padded along an axis (.padded)
        self.masking = NO_MASKS


class _RowsInputs:
    """The captured values a program over rows reads (:meth:`BatchedBuild._rows_inputs`)."""

    __slots__ = ("caps", "extents", "own", "padded", "values")

    def __init__(self) -> None:
        self.caps: list[ComputeNode | None] = []  # per captured value: its node (None: each input's own)
        self.own: dict[VirtualNode, list[Any]] = {}  # each input's own value, in the order of the rows
        self.values: dict[VirtualNode, np.ndarray] = {}  # ... as rows of one array, padded with zeros
        self.padded: dict[VirtualNode, Padded] = {}  # those whose lengths differ: (axis, extent)
        self.extents: list[np.ndarray] = []  # per extent, the inputs' lengths

    def sparse(self) -> list[bool]:
        """Per captured value, whether its gradient is kept row-sparse."""
        return [n is not None and n.sparse_grad for n in self.caps]


def _probe_shapes(
    program: BodyProgram, job: _LoopJob, cap_values: list[Any]
) -> dict[VirtualNode, tuple[int, ...]] | str:
    """Every body node's shape for one input, from ``job``'s first iteration run alone with each
    combination of its branches' options (children read the carries' initial values); or why the
    body cannot run on rows."""
    loop = program.loop
    plain = program.variant((), frozenset())
    leads = [v for v in program.computed if isinstance(v, BranchNode) and v.lead is None]
    combos = list(itertools.islice(itertools.product(*(range(len(b.options)) for b in leads)), 65))
    if len(combos) > 64:
        return "its branches have more than 64 combinations of options"
    state = [s._value for s in job.state]
    at0 = [s._value[len(s._value) - 1 if i.attrs.get("reverse") else 0] for i, s in zip(loop.items, job.seqs)]
    kids = [state[loop.carries.index(r.inputs[0])] for r in loop.children]
    shape: dict[VirtualNode, tuple[int, ...]] = {}
    for combo in combos:
        forced = dict(zip(leads, combo))
        step = plain._make_step(lambda b, t, values, forced=forced: forced[b], *cap_values)
        try:
            with np.errstate(all="ignore"):  # (options forced on values that would not choose them)
                record = step(0, *state, *at0, *kids)
        except Exception as e:
            return f"its program raised {type(e).__name__}: {e}"
        for v, i in plain.slot.items():
            if record[i] is not None:
                shape.setdefault(v, np.shape(record[i]))
        for k, c in enumerate(loop.carries):
            new, old = record[plain.slot[loop.updates[c]]], state[k]
            if new is not None and (np.shape(new) != old.shape or np.asarray(new).dtype != old.dtype):
                return f"the update of {c.describe()} changes its shape or dtype"
    for v, x in zip(program.captured, cap_values):
        shape[v] = np.shape(x)
    return shape


class _Split(Exception):
    """A branch's selector chose differently for the rows of one step (:class:`_RowsSelect`)."""

    def __init__(self, branch: BranchNode, choices: np.ndarray) -> None:
        super().__init__(branch.describe())
        self.branch, self.choices = branch, choices


class _RowsSelect:
    """The ``SELECT`` of a program over rows: a branch's selector run on each row's own key
    values (a row's iteration named in errors); the one choice if all rows agree, else
    :class:`_Split`. Branches in ``fixed`` are already chosen for these rows."""

    __slots__ = ("chosen", "fixed", "ids", "instance", "rowwise")

    def __init__(self, instance: _RowsProgram, layout: dict[VirtualNode, Any]) -> None:
        self.instance = instance
        # per lead branch, per key: whether each row has its own value
        self.rowwise = {
            v: [layout[k] == 0 for k in v.keys]
            for v in instance.program.computed
            if isinstance(v, BranchNode) and v.lead is None
        }
        self.ids: Any = np.empty(0, dtype=np.intp)  # the rows of the step (a slice or an index array)
        self.fixed: dict[BranchNode, int] = {}
        self.chosen: dict[BranchNode, int] = {}

    def __call__(self, branch: BranchNode, t: int, values: tuple[Any, ...]) -> int:
        choice = self.fixed.get(branch)
        if choice is None:
            rowwise, where, ids = self.rowwise[branch], self.instance.idx_of, _indices(self.ids)
            if not any(rowwise):  # the same keys for every row
                choice = select_option(branch, where(int(ids[0])), values)
            else:
                keys = [x if own else itertools.repeat(x) for x, own in zip(values, rowwise)]
                selector, n = branch.selector, len(branch.options)
                try:  # (iterating an array gives the rows x[r] gives)
                    choices = [selector(*row) for row in zip(*keys)]
                except Exception:
                    choices = []
                if len(choices) != len(ids) or not all(type(c) is int and 0 <= c < n for c in choices):
                    # select_option's checks, conversions and errors, naming the tree node
                    choices = [
                        select_option(
                            branch, where(g), [x[r] if own else x for x, own in zip(values, rowwise)]
                        )
                        for r, g in enumerate(ids.tolist())
                    ]
                choice = choices[0]
                if choices.count(choice) != len(choices):
                    raise _Split(branch, np.asarray(choices))
        self.chosen[branch] = choice
        return choice


class _BatchBuilder(_Builder):
    """One input's builder in a batched build. A recursion (``g.recurse``) runs tree node by tree
    node in depth order instead of one node after another: each tree node is built in a greenlet
    of its own, started as soon as its children are built, so that every input's ready tree nodes
    ask for their ops together — all leaves of all inputs in one group per op, then the nodes
    whose children are leaves, and so on (TensorFlow Fold's depth batching, on structures that
    arrive as data). Values, gradients and decisions (reordered as one node after another would
    have made them) are those of the sequential build."""

    batch: BatchedBuild
    index: int

    def run_loop(self, loop: LoopNode, frame: _Frame) -> None:
        if loop.checkpoint is not None:
            raise BuildError(
                f"{loop.describe(frame.idx)} is checkpointed (checkpoint={loop.checkpoint!r}), which "
                "g.build_batch does not support: build these inputs one at a time with g.build"
            )
        batch = self.batch
        if batch._by_depth(loop):
            if batch._programs and not batch._joint_ok(loop):
                self.cg.interpreted.append(
                    (loop, frame.idx, "its body is not ops and branches only: its tree nodes run op by op")
                )
            return self._run_tree(loop, frame)
        if batch._lockstep_ok(loop) or batch._rows_only(loop):
            return self._run_lockstep(loop, frame)
        if batch._programs:
            why = batch._rows_program(loop)
            if not isinstance(why, str):
                why = "its body is not ops only: each input runs it op by op"
            self.cg.interpreted.append((loop, frame.idx, why))
        return super().run_loop(loop, frame)

    def _run_lockstep(self, loop: LoopNode, frame: _Frame) -> None:
        """A loop whose body is ops only, or one a program over rows may run: prepared here
        (checks, hoisting), then handed to the scheduler, which runs every input's iteration
        ``t`` of it together — as one program, or one body node at a time — without switching to
        the inputs; a ``while_``/``until`` condition is evaluated per input on its own state
        (:meth:`BatchedBuild._run_jobs`). A loop with branches no program ran comes back
        declined, and runs here as in any build."""
        cg, env, idx = self.cg, frame.env, frame.idx
        state = [frame.owner(c.inputs[0]).env[c.inputs[0]] for c in loop.carries]
        seqs, length = _stepped_sequences(loop, frame)
        known = [m for m in (loop.times, length) if m is not None]
        trips = min(known) if known else None  # at most (a condition may stop it earlier)
        captured = {c: frame.owner(c).env[c] for c in self.plan.captures[loop]}
        groups: dict[VirtualNode, Any] = {}
        if (
            self.hoist
            and not (self.batch._programs and isinstance(self.batch._rows_program(loop), BodyProgram))
            and loop.cond is None
            and loop.until is None
            and self.plan.hoistable[loop]
            and trips is not None
            and 1 < trips <= loop.max_iters
        ):
            groups = hoist_loop(self, loop, frame, captured, seqs, trips)
        job = _LoopJob(cast(InputView, cg), loop, idx, state, seqs, length, trips, captured, groups)
        job.agent = self.batch._getcurrent()
        self.batch._scheduler.switch(job)  # back when every input's run of the loop is done
        if job.declined:  # (nothing was added for it)
            return super().run_loop(loop, frame)
        for made in job.decisions:  # (its iterations' branches, in iteration order)
            cg.decisions.extend(made)
        if job.capped is not None:
            cg.decisions.append(Decision(loop, idx, "capped", job.capped))
        cg.decisions.append(Decision(loop, idx, "iterations", job.count))
        env[loop] = None
        for v in self.plan.finals.get(loop, ()):
            env[v] = job.state[loop.carries.index(v.inputs[1])]
        for j, s in enumerate(self.plan.stacked.get(loop, [])):
            if job.stacks is not None:  # run as a program over rows (hoisted there, over every input)
                if job.stacks[j] is not None:
                    env[s] = job.stacks[j]
                continue
            bucket = [collected[j] for collected in job.collected]
            if bucket:  # an error only if the stack is used: see build_node
                env[s] = cg._add_op(_STACK, tuple(bucket), {"axis": 0}, NodeKey("Stack", s.id, idx), s.name)

    def _run_tree(self, loop: LoopNode, frame: _Frame) -> None:
        cg, env, idx = self.cg, frame.env, frame.idx
        defaults = [frame.owner(c.inputs[0]).env[c.inputs[0]] for c in loop.carries]
        seqs, length = _stepped_sequences(loop, frame)
        structure = cast(VirtualNode, loop.structure)
        kids = _check_structure(loop, idx, frame.owner(structure).env[structure].value, length)
        n = len(kids)  # (at most max_nodes: see _check_structure)
        rows = kids.tolist()
        reads = [(read, loop.carries.index(read.inputs[0]), read.attrs["slot"]) for read in loop.children]
        captured = {c: frame.owner(c).env[c] for c in self.plan.captures[loop]}
        groups: dict[VirtualNode, Any] = {}
        joint = self.batch._joint_ok(loop)
        if (
            self.hoist
            and not (
                joint and self.batch._programs and isinstance(self.batch._rows_program(loop), BodyProgram)
            )
            and self.plan.hoistable[loop]
            and n > 1
        ):  # (a program over tree nodes hoists over every input's tree nodes at once)
            groups = hoist_loop(self, loop, frame, captured, seqs, n)
        order = [v for v in self.plan.eager.get(loop, ()) if v not in groups] if groups else None
        stacked = self.plan.stacked.get(loop, [])
        history: list[Any] = [None] * n
        collected: list[Any] = [None] * n
        remaining: list[int] = []  # (what the depth order without a program needs: see else below)
        parents: list[list[int]] = []
        me = self.batch._getcurrent()
        scheduler, make = self.batch._scheduler, self.batch._greenlet
        done = [0]
        # tree_node spawns itself for the parents it completes. Reached through this list, emptied
        # at the end, not by its own name: a closure naming itself is a reference cycle, which
        # would leave the whole build to the cyclic garbage collector.
        spawn: list[Callable[[int], _Spawn]] = []

        def tree_node(t: int) -> _Spawn:
            inner = _Frame(loop, (*idx, t), dict(captured), frame)
            ienv = inner.env
            for c, init in zip(loop.carries, defaults):
                ienv[c] = init  # (never read: the body reads children's state only; see _by_depth)
            _read_children(ienv, reads, rows[t], history, defaults)
            _iteration_views(cg, loop, inner, seqs, groups, length, t)
            self.run_scope(inner, order)
            cg._envs[(loop, inner.idx)] = ienv
            history[t] = [ienv[loop.updates[c]] for c in loop.carries]
            collected[t] = [ienv[s.inputs[1]] for s in stacked]
            done[0] += 1
            ready = []
            for p in parents[t]:
                remaining[p] -= 1
                if remaining[p] == 0:
                    ready.append(make(lambda p=p: spawn[0](p), parent=scheduler))
            return _Spawn(ready, me if done[0] == n else None)

        spawn.append(tree_node)
        start = len(cg.decisions)
        if joint:  # the scheduler builds every input's tree nodes itself
            job = _TreeJob(cast(InputView, cg), loop, idx, defaults, seqs, length, n, captured, groups)
            job.reads, job.rows = reads, rows
            job.history, job.collected, job.chosen = history, collected, self.chosen
            job.agent = me
            scheduler.switch(job)  # back when every tree node is built
            for t in range(n):  # (in node order: as one node after another makes them)
                cg.decisions.extend(job.decisions[t])
        else:  # each tree node in a greenlet of its own
            remaining, parents = _dependents(rows)
            leaves = [make(lambda t=t: tree_node(t), parent=scheduler) for t in range(n) if remaining[t] == 0]
            scheduler.switch(_Spawn(leaves))  # back when every tree node is built
        spawn.clear()
        if not joint:  # as one node after another: each node's decisions together, in node order
            cg.decisions[start:] = sorted(cg.decisions[start:], key=lambda d: d.idx[len(idx)])
        cg.decisions.append(Decision(loop, idx, "iterations", n))
        env[loop] = None
        if joint and job.stacks is not None:  # run as a program over tree nodes (its shapes checked)
            for v in self.plan.finals.get(loop, ()):
                env[v] = job.state[loop.carries.index(v.inputs[1])]
            for s, row in zip(stacked, job.stacks):
                env[s] = row
            return
        names = [c.name for c in loop.carries]
        previous = defaults
        for t in range(n):
            for name, old, new in zip(names, previous, history[t]):
                check_carry(loop, idx, t, name, old._value, new._value, new)
            previous = history[t]
        final = history[n - 1]
        for v in self.plan.finals.get(loop, ()):
            env[v] = final[loop.carries.index(v.inputs[1])]
        for j, s in enumerate(stacked):
            bucket = tuple(collected[t][j] for t in range(n))
            env[s] = cg._add_op(_STACK, bucket, {"axis": 0}, NodeKey("Stack", s.id, idx), s.name)


@computing
@one_build_at_a_time
def build_batch(
    graph: Any,
    feeds: Sequence[Mapping[str, Any]],
    outputs: Any,
    hoist: bool = True,
    depth: bool = True,
    programs: bool | None = None,
) -> BatchedBuild:
    """Build ``feeds`` (one feed per input) at once; see :meth:`VirtualGraph.build_batch`."""
    try:
        import greenlet
    except ImportError:  # pragma: no cover - greenlet is in the batch and test extras
        raise ImportError("autobatching needs the greenlet package: pip install 'vgraph[batch]'") from None

    hoist = flag_arg(hoist, "build_batch(hoist=...)")
    depth = flag_arg(depth, "build_batch(depth=...)")
    programs = programs_mode() if programs is None else flag_arg(programs, "build_batch(programs=...)")
    if programs is None:  # chosen per loop: a batched build is never cached, so as programs
        programs = True
    if isinstance(feeds, Mapping) or not isinstance(feeds, Sequence) or isinstance(feeds, str):
        raise TypeError("build_batch takes a list of feeds (one mapping name -> value per input)")
    if not feeds:
        raise ValueError("build_batch needs at least one feed")
    outs, plan = _check_outputs(graph, outputs)
    values = []
    for i, feed in enumerate(feeds):
        try:
            values.append(_checked_feed(graph, plan, feed))
        except VGraphError as e:
            raise type(e)(f"input {i}: {e}") from None
    batch = BatchedBuild(graph, len(feeds))
    batch._depth = depth
    batch._values, batch._outs, batch._builds = values, outs, graph._builds
    batch._hoist = hoist
    batch._programs = programs
    batch.virtual_plan = plan
    new_params: dict[str, ComputeNode] = {}
    builders, tops = [], []
    for i, v in enumerate(values):
        b = _BatchBuilder(graph, v, plan, hoist=hoist, cg=batch.inputs[i], builds=graph._builds + i)
        b.batch, b.index = batch, i
        b.new_params = new_params  # an untied copy two inputs reach is created once
        builders.append(b)
        tops.append(_Frame(None, (), {}, None))
    with contextlib.nullcontext() if graph.training else no_grad(), gc_paused():
        batch._run(builders, tops, greenlet.greenlet)
    for view, top in zip(batch.inputs, tops):
        view._envs[(None, ())] = top.env
        view.outputs = [top.env[o] for o in outs]
    for name, node in new_params.items():  # commit only after success
        graph.params._add(name, node)
    graph._builds += len(feeds)
    del batch._greenlets, batch._waiting
    return batch


__all__ = ["BatchedBuild", "InputView", "Row", "build_batch"]
