"""Straight-line code for the forward and backward sweeps of a graph that is run again.

The engine's sweeps (:meth:`ComputeGraph.forward`, :meth:`ComputeGraph._backprop`) interpret the
graph: for every node they loop over its parents, look up its VJPs, test which inputs need a
gradient, unpack attributes. On small values (an RNN step on a batch of one) that bookkeeping costs
several times the numpy call it dispatches. A graph that is swept again (a re-used graph, a cached
structure, a second backward) has the same structure every time, so this module writes that
bookkeeping out once, as Python source with every decision taken: a *tape*.

A tape is a list of *segments*: runs of consecutive plan nodes with the same iteration path
(``key.idx``), at most :data:`SEGMENT` nodes each. A segment's code depends only on its *shape* —
how many nodes, which of their parents are inside the segment, which inputs get a gradient, which
nodes have attributes, and whether a forward or VJP is one of the few the code writes out inline
(``ops.INLINE_FORWARDS``, ``ops.INLINE_VJPS``: ``g`` passed through an addition, a hoisted
iteration's row) — never on the values, or on any other op, which the code calls through the node
when it runs. The iterations of an unrolled loop all have the same shape, so a loop of any length
needs one compiled function per distinct iteration shape, and compiled functions are shared by
every graph in the process (a bounded cache keyed by shape).

The generated code does exactly what the interpreted sweep does for the same node, in the same
order — the same VJP calls, the same accumulation into ``_g`` (in place into a buffer the sweep
owns, or a new array), the same staging of ``.grad`` — so results are bitwise identical; it only
leaves out the decisions and, for what a loop does once per iteration (a pass-through VJP, a
hoisted row and its gradient, a weight's next :class:`~vgraph.ops.RowsProductGrad`, a bias's next
in-place addition), the function calls. It is used for the plain cases (no anomaly detection, no
``explain``, no checkpointed loop, ``backward`` rather than ``grad``), and from a plan's second
sweep on (a graph swept once never pays for making a tape). When a compiled forward raises, the
node that raised is the first one still out of date, and the error names it as the interpreted
sweep's would; when a compiled backward raises, the caller clears every pending gradient and runs
the interpreted sweep, which raises the error that names the node (VJPs are pure functions of their
arguments).

``set_tapes(False)`` turns tapes off for the whole process (comparison and debugging); tests run
the same models both ways. The generated source is registered with :mod:`linecache` under a name
``<vgraph tape N>``, so tracebacks and :func:`inspect.getsource` show it, and :func:`show` prints
the compiled code a graph's sweeps run.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import numpy as np

from .ops import (
    INLINE_FORWARDS,
    INLINE_VJPS,
    ROW_SUMS,
    ROW_VJP_MIN,
    LazyGrad,
    LeadingSumGrad,
    RowsProductGrad,
    StepRowsGrad,
    _matmul,
    _matmul_vjp_a,
    _tanh_vjp_row,
    add_grads,
    add_grads_sparse,
    as_row_sparse,
    reduce_grad,
)

#: The most nodes one compiled segment covers (a bound on the size of the generated functions).
SEGMENT = 48
#: How many compiled segment shapes the process keeps (least recently used dropped first).
CACHE_SIZE = 512


class _Settings:
    enabled = True


def set_tapes(enabled: bool) -> None:
    """Turn compiled sweeps on (the default) or off for the whole process.

    With tapes off, every forward and backward interprets the graph node by node, as on a graph's
    first sweep. Results are the same either way (bitwise); only the time differs.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_tapes(enabled) takes True or False, got {type(enabled).__name__} {enabled!r}")
    _Settings.enabled = enabled


def tapes_enabled() -> bool:
    """Whether compiled sweeps are on (see :func:`set_tapes`)."""
    return _Settings.enabled


_compiled: OrderedDict[Any, Callable[..., Any]] = OrderedDict()

# What generated code refers to by name.
_NAMESPACE: dict[str, Any] = {
    "ndarray": np.ndarray,
    "matmul": _matmul,
    "matmul_vjp_a": _matmul_vjp_a,
    "tanh_vjp_row": _tanh_vjp_row,
    "np_add": np.add,
    "LazyGrad": LazyGrad,
    "LeadingSumGrad": LeadingSumGrad,
    "RowsProductGrad": RowsProductGrad,
    "StepRowsGrad": StepRowsGrad,
    "add_grads": add_grads,
    "add_grads_sparse": add_grads_sparse,
    "as_row_sparse": as_row_sparse,
    "reduce_grad": reduce_grad,
}


def _function(shape: Any, source: Callable[[], list[str]]) -> Callable[..., Any]:
    """The compiled function for a segment ``shape`` (made by ``source`` on first use)."""
    fn = _compiled.get(shape)
    if fn is not None:
        with contextlib.suppress(KeyError):  # another thread may have dropped it since the get
            _compiled.move_to_end(shape)
        return fn
    namespace = dict(_NAMESPACE)
    text = "\n".join(source()) + "\n"
    filename = f"<vgraph tape {next(_serials)}>"
    # Registered so that tracebacks and inspect.getsource show the generated lines (an entry
    # without a modification time is never checked against a file, only dropped with its function).
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(compile(text, filename, "exec"), namespace)
    fn = cast("Callable[..., Any]", namespace["segment"])  # what the source defines
    _compiled[shape] = fn
    if len(_compiled) > CACHE_SIZE:
        _, dropped = _compiled.popitem(last=False)
        linecache.cache.pop(dropped.__code__.co_filename, None)
    return fn


_serials = itertools.count(1)


def source(fn: Callable[..., Any]) -> str:
    """The generated source of a compiled segment function (as made by this module)."""
    return "".join(linecache.getlines(fn.__code__.co_filename))


def show(graph: Any) -> str:
    """The compiled code ``graph``'s sweeps run now: each segment's function with the keys of the
    nodes it covers, the backward tape first, then each forward tape. Empty when nothing is
    compiled yet (a plan is compiled on its second sweep) or tapes are off.

    Args:
        graph: a :class:`~vgraph.compute.ComputeGraph`.

    Returns:
        The text, ready to print.
    """
    parts: list[str] = []

    def add(title: str, tape: _Tape | None) -> None:
        if tape is None:
            return
        parts.append(f"# {title}")
        for fn, nodes in tape._calls:
            keys = [str(getattr(n, "key", n)) for n in nodes]
            parts.append(f"# nodes {keys[0]} … {keys[-1]} ({len(keys)})" if keys else "# no nodes")
            parts.append(source(fn))

    backward = graph._backward_tape
    add("backward", backward[1] if backward is not None else None)
    for i, tape in enumerate(graph._forward_tapes.values()):
        add(f"forward {i}", tape)
    return "\n".join(parts)


def _segments(plan: Sequence[Any]) -> list[list[Any]]:
    """``plan`` cut into runs of consecutive nodes with one iteration path, at most SEGMENT long."""
    runs: list[list[Any]] = []
    run: list[Any] = []
    idx: Any = None
    for n in plan:
        i = n.key.idx
        if run and (i != idx or len(run) == SEGMENT):
            runs.append(run)
            run = []
        run.append(n)
        idx = i
    if run:
        runs.append(run)
    return runs


def _slots(run: list[Any]) -> tuple[list[Any], dict[Any, int]]:
    """The nodes a segment's code touches (its own, then the outside parents), and their slots."""
    slot: dict[Any, int] = {n: i for i, n in enumerate(run)}
    nodes = list(run)
    for n in run:
        for p in n.parents:
            if p not in slot:
                slot[p] = len(nodes)
                nodes.append(p)
    return nodes, slot


#: One compiled segment: its function and the nodes it is called with.
Call = tuple[Callable[..., Any], tuple[Any, ...]]


class _Tape:
    """A plan's compiled segments, called in turn (see :class:`BackwardTape`, :class:`ForwardTape`)."""

    __slots__ = ("_calls",)
    _calls: list[Call]

    @classmethod
    def joined(cls: type[_T], calls: list[Call]) -> _T:
        """The tape that makes ``calls`` in turn: the calls of consecutive parts of a plan, each
        made by :func:`backward_calls` or :func:`forward_calls`, sweep the whole plan as the
        plan's own tape does."""
        tape = cls.__new__(cls)
        tape._calls = calls
        return tape


_T = TypeVar("_T", bound=_Tape)


# ---------------------------------------------------------------------------- backward


class BackwardTape(_Tape):
    """The compiled reverse sweep of one backward plan (see the module docstring).

    Call it with the list the sweep stages ``.grad`` commits into; roots' gradients must already be
    in their ``_g`` (as for the interpreted sweep).
    """

    __slots__ = ()

    def __init__(self, plan: Sequence[Any]) -> None:
        self._calls = backward_calls(plan)

    def __call__(self, staged: list[Any]) -> None:
        for fn, nodes in self._calls:
            fn(nodes, staged)


def backward_calls(plan: Sequence[Any]) -> list[Call]:
    """The compiled segments of a backward ``plan`` (any part of one: a plan's parts' calls, one
    after the other, sweep it as its own calls do)."""
    calls = []
    for run in _segments(plan):
        nodes, slot = _slots(run)
        shape = tuple(_backward_shape(n, slot) for n in run)
        calls.append((_function(("b", shape), partial(_backward_source, shape)), tuple(nodes)))
    return calls


def _backward_shape(n: Any, slot: dict[Any, int]) -> Any:
    if n.op is None:
        return ("leaf", bool(n.sparse_grad))
    edges = tuple(
        (
            slot[p],
            vjp is not None and p.requires_grad,
            bool(p.sparse_grad),
            p.op is None,
            _inline_kind(INLINE_VJPS, vjp),
            p.op is not None and p.op.forward in ROW_SUMS,
        )
        for p, vjp in zip(n.parents, n.vjps)
    )
    return ("op", bool(n.attrs), edges, n.op.partial_grads)


def _inline_kind(table: dict[Any, str], fn: Any) -> str | None:
    """How the code writes ``fn`` out inline (see ``ops.INLINE_VJPS``), or None: call it."""
    for f, kind in table.items():  # by identity: a user's function need not be hashable
        if fn is f:
            return kind
    return None


def _backward_source(shape: Any) -> list[str]:
    width = 1 + max((max((e[0] for e in s[2]), default=0) for s in shape if s[0] == "op"), default=0)
    width = max(width, len(shape))
    out = ["def segment(N, staged):", f"    {', '.join(f'n{i}' for i in range(width))}, = N"]
    for i, s in enumerate(shape):
        n = f"n{i}"
        out += [f"    g = {n}._g", "    if g is not None:", f"        {n}._g = None"]
        if s[0] == "leaf":
            dense = "as_row_sparse(g)" if s[1] else "g.dense()"
            out += [
                f"        own = {n}._gown",
                f"        {n}._gown = False",
                "        if type(g) is not ndarray and isinstance(g, LazyGrad):",
                f"            g = {dense}",
                "            own = True",
                f"        staged.append(({n}, g, own))",
            ]
            continue
        _, has_attrs, edges, partial_grads = s
        out += [
            f"        {n}._gown = False",
            "        if type(g) is not ndarray and isinstance(g, LazyGrad):",
            "            g = g.dense()",
            f"        if {n}.retains_grad:",
            f"            staged.append(({n}, g, False))",
        ]
        if not any(edge[1] for edge in edges):
            continue
        values = [f"x{j}" for j in range(len(edges))]
        out.append(f"        ans = {n}._value")
        out += [f"        x{j} = n{p}._value" for j, (p, *_) in enumerate(edges)]
        if len(edges) > 1:
            out.append(f"        vjps = {n}.vjps")
        kwargs = f", **{n}.attrs" if has_attrs else ""
        for j, (p, active, sparse, leaf, inline, row_sum) in enumerate(edges):
            if not active:
                continue
            vjp = f"vjps[{j}]" if len(edges) > 1 else f"{n}.vjps[0]"
            add = "add_grads_sparse" if sparse else "add_grads"
            call = f"{vjp}(g, ans, {', '.join(values)}{kwargs})"
            if inline == "pass":
                call = "g"
            elif inline == "product a":  # (without the fused op's own arguments: see ops.INLINE_VJPS)
                call = "matmul_vjp_a(g, ans, x0, x1)"
            accumulate = [
                "if c.shape != s:",
                f"    c = reduce_grad(c, s, {leaf and not sparse})",
                "if acc is None:",
                f"    n{p}._g = c",
                f"elif n{p}._gown and type(acc) is ndarray:",
                "    if isinstance(c, LazyGrad):",
                "        c.add_into(acc)",
                "    else:",
                "        np_add(acc, c, out=acc)",
                "else:",
                f"    n{p}._g = {add}(acc, c)",
                f"    n{p}._gown = True",
            ]
            indent = "        "
            if inline == "row":  # as IndexedGrad.add_into / StepRowsGrad.merge would
                out += [
                    f"        acc = n{p}._g",
                    "        if type(acc) is StepRowsGrad and type(g) is ndarray and g.dtype == acc.dtype and "
                    "g.shape == acc.shape[1:]:",  # the common case first: StepRowsGrad.merge, written out
                    f"            acc.rows.append({n}.attrs['index'])",
                    "            acc.gs.append(g)",
                    f"        elif n{p}._gown and type(acc) is ndarray:",
                    f"            acc[{n}.attrs['index']] += g",
                    "        else:",
                ]
                indent += "    "
            elif inline == "rows product" and leaf and not sparse:  # a weight's next use in a loop:
                out += [  # _matmul_vjp_b's hot path and RowsProductGrad.merge, written out
                    f"        acc = n{p}._g",
                    "        if type(acc) is RowsProductGrad and x0.ndim == 2 and x1.ndim == 2:",
                    "            acc.a.append(x0)",
                    "            acc.g.append(g)",
                    "        else:",
                ]
                indent += "    "
            if inline == "tanh" and row_sum:  # the sum's first gradient, into its row of a buffer
                out += [
                    f"{indent}c = None",
                    f"{indent}if n{p}._g is None and ans.size >= {ROW_VJP_MIN}:",
                    f"{indent}    c = tanh_vjp_row(g, ans, n{p})",
                    f"{indent}if c is None:",
                    f"{indent}    c = {call}",
                ]
            else:
                out.append(f"{indent}c = {call}")
            if partial_grads:  # (no gradient reached this input: nothing to add)
                out.append(f"{indent}if c is not None:")
                indent += "    "
            out += [
                f"{indent}s = x{j}.shape",
                f"{indent}acc = n{p}._g",
            ]
            if leaf and not sparse:  # a weight's or a bias's next use, merged directly
                out += [
                    f"{indent}if type(c) is RowsProductGrad and type(acc) is RowsProductGrad:",
                    f"{indent}    acc.a += c.a  # RowsProductGrad.merge, written out",
                    f"{indent}    acc.g += c.g",
                    f"{indent}elif not (c.shape != s and type(acc) is LeadingSumGrad and acc.absorb(c)):",
                ]
                indent += "    "
            out += [indent + line for line in accumulate]
    return out


# ---------------------------------------------------------------------------- forward


class ForwardTape(_Tape):
    """The compiled dirty-checked forward over one plan (op nodes in topological order): each node
    whose parents changed since it was computed is computed again and stamped with a new version.

    One reading of the clock stamps every node the sweep recomputes: a node is out of date when a
    parent's version is *newer* than its own, so a parent and a child recomputed in one sweep are
    consistent with the same version, and any later change reads the clock anew (as the
    interpreted sweep's reading per node would, with one call instead of one per node).

    Calling it returns how many nodes were recomputed.
    """

    __slots__ = ()

    def __init__(self, plan: Sequence[Any]) -> None:
        self._calls = forward_calls(plan)

    def __call__(self, clock: Callable[[], int]) -> int:
        count = 0
        stamp = clock()
        for fn, nodes in self._calls:
            count += fn(nodes, stamp)
        return count


def forward_calls(plan: Sequence[Any]) -> list[Call]:
    """The compiled segments of a forward ``plan`` (or of any part of one, as for
    :func:`backward_calls`)."""
    calls = []
    for run in _segments(plan):
        nodes, slot = _slots(run)
        shape = tuple(
            (bool(n.attrs), tuple(slot[p] for p in n.parents), _inline_kind(INLINE_FORWARDS, n.op.forward))
            for n in run
        )
        calls.append((_function(("f", shape), partial(_forward_source, shape)), tuple(nodes)))
    return calls


def _forward_source(shape: Any) -> list[str]:
    width = max(len(shape), 1 + max((max(ps, default=0) for _, ps, _ in shape), default=0))
    out = [
        "def segment(N, stamp):",
        f"    {', '.join(f'n{i}' for i in range(width))}, = N",
        "    count = 0",
    ]
    for i, (has_attrs, parents, inline) in enumerate(shape):
        if not parents:
            continue  # an op of no inputs never goes out of date (as in the interpreted sweep)
        n = f"n{i}"
        out.append(f"    v = {n}.version")
        changed = " or ".join(f"n{p}.version > v" for p in parents)
        args = ", ".join(f"n{p}._value" for p in parents)
        kwargs = f", **{n}.attrs" if has_attrs else ""
        value = f"{n}.op.forward({args}{kwargs})"
        if inline == "row":
            value = f"n{parents[0]}._value[{n}.attrs['index']]"
        elif inline == "row + product":
            a, b, rows = parents
            value = f"n{rows}._value[{n}.attrs['index']] + matmul(n{a}._value, n{b}._value)"
        out += [
            f"    if {changed}:",
            f"        {n}._value = {value}",
            f"        {n}.version = stamp",
            "        count += 1",
        ]
    out.append("    return count")
    return out
