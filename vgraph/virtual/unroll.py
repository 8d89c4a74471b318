"""Unrolling: :func:`build_compute_graph` turns a VirtualGraph and one feed into an
:class:`~.unrolled.UnrolledGraph` — checking the feed, re-running a cached graph of the same
structure (:mod:`.cache`, :mod:`.elastic`) or building one (:mod:`.builder`), computing values as
it goes so that loop conditions and branch selectors see real data."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from ..compute import (
    _ALL,
    flag_arg,
)
from ..errors import (
    BuildError,
    FeedError,
    StructureChangedError,
    VGraphError,
)
from ..modes import anomaly_scope as _anomaly_scope
from ..modes import is_grad_enabled, no_grad, programs_mode
from ..workspace import computing, gc_paused
from .builder import _Builder, _Frame
from .elastic import Elastic, elastic_key
from .graph import VirtualGraph, one_build_at_a_time
from .nodes import _NO_LOOP_VALUE, VirtualNode
from .plan import _Plan
from .unrolled import UnrolledGraph, _check_feed_value


def _check_outputs(graph: VirtualGraph, outputs: Any) -> tuple[list[VirtualNode], _Plan]:
    """The outputs as a list, checked, and the plan for them."""
    outs = [outputs] if isinstance(outputs, VirtualNode) else list(outputs)
    if not outs:
        raise BuildError("build_compute_graph needs at least one output")
    for o in outs:
        if not isinstance(o, VirtualNode) or o.graph is not graph:
            raise BuildError(f"output {o!r} is not a node of this VirtualGraph")
        if o.kind == "loop":
            raise BuildError(f"output {_NO_LOOP_VALUE.format(o.describe())}")
        if o.scope is not None:
            raise BuildError(
                f"output {o.describe()} is inside the body of {o.scope.describe()}; use the loop's "
                "outputs (loop.final(carry), loop.stack(value))"
            )
    if graph._scopes:
        raise BuildError(f"{graph._scopes[-1].describe()}: its `with` block is still open")
    return outs, graph._plan(outs)


def _checked_feed(graph: VirtualGraph, plan: _Plan, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The values of the inputs the plan needs, checked against their declarations (copies)."""
    if not isinstance(feed, Mapping):
        raise TypeError(f"a feed is a mapping input name -> value, got {type(feed).__name__}")
    needed_inputs = [v for v in graph.nodes if v.kind == "input" and v in plan.needed]
    unknown = sorted(set(feed) - set(graph._inputs))
    if unknown:
        raise FeedError(
            f"unknown input name(s) {', '.join(map(repr, unknown))}; inputs: {', '.join(graph._inputs)}"
        )
    missing = [v.describe() for v in needed_inputs if v.name not in feed]
    if missing:
        raise FeedError(f"missing feed for input(s) {', '.join(missing)}, needed by the requested outputs")
    # inputs are declared with a name
    return {
        cast(str, v.name): _check_feed_value(v, feed[cast(str, v.name)], graph.dtype) for v in needed_inputs
    }


@computing
@one_build_at_a_time
def build_compute_graph(
    graph: VirtualGraph,
    feed: Mapping[str, Any],
    outputs: VirtualNode | Sequence[VirtualNode],
    *,
    hoist: bool = True,
    cache: bool = True,
    detect_anomaly: bool = False,
    programs: bool | None = None,
) -> UnrolledGraph:
    """Unroll ``graph`` for the values in ``feed`` into a new :class:`UnrolledGraph`.

    Demand-driven from ``outputs``: only what they need is built, and a branch builds only the
    option it selects. Values are computed while unrolling. Untied parameters seen for the first
    time are initialised and added to ``graph.params`` — only if the whole build succeeds; on any
    error the virtual graph and its parameter store are left unchanged.

    ``graph.latest_build`` (what ``vnode.compute_nodes`` reads) is released when a build starts,
    so a previous graph nobody else holds is freed before the new values are allocated. In a
    training loop, drop your own reference too (``del cg`` at the end of a step) to get the same
    benefit; peak memory is then one graph, not two.

    Args:
        graph: the model.
        feed: a value for each input the outputs need, by input name.
        outputs: top-level virtual nodes to build.
        cache: re-run the graph of an earlier build of the same structure instead of unrolling
            again (see :mod:`vgraph.virtual.cache`: the earlier graph object is then superseded),
            or of a build whose stepped sequences were longer, cut to this feed's lengths (see
            :mod:`vgraph.virtual.elastic`), or of any lengths and trees where every loop that
            steps through a sequence and every recursion ran as a body program (see
            ``programs``);
            ``False`` always unrolls and leaves the cache alone. A graph with checkpointed loops
            (``checkpoint=``) is never cached: a replay would need the values it dropped.
        hoist: compute loop-body nodes that depend on no carried state for all iterations at
            once (see :mod:`vgraph.virtual.hoist`); ``False`` gives the plain node-by-node unroll,
            for comparison and debugging. Same keys, values and gradients either way.
        detect_anomaly: raise :class:`~vgraph.errors.NonFiniteError` at the first NaN/Inf value
            (see :func:`vgraph.detect_anomaly`).
        programs: ``True`` runs each loop whose body can be compiled as a body program (see
            :mod:`vgraph.virtual.program`): one ``<Loop:id@idx>`` node per loop instance, its
            body's unrolled nodes made on demand (``cg.node(v, idx)``, ``cg.per_node()``); loops
            that cannot run so are listed with the reason in ``cg.interpreted``. ``False`` is the
            per-node unroll, the reference. ``None`` (the default; ``vg.body_programs`` sets
            another for a block): as ``True``, except that a cached build (``cache=True``) runs
            node by node a loop whose structure the feed's shapes fix (no ``while_``/``until``,
            recursion or branch inside) and whose body has no fused cell
            (:func:`~.program.replayed_node_by_node`) — that structure comes back, and the
            cache re-runs the per-node unroll of a known structure faster.

    Returns:
        The unrolled graph; ``cg.outputs`` holds the outputs' compute nodes.

    Raises:
        FeedError: missing inputs (all listed), unknown names, shapes that differ from the declared.
        BuildError: an output inside a loop body, a body not closed, a loop that ran zero iterations
            but must stack values.
        LoopLimitError, SelectorError, ShapeError: while unrolling, naming ``<type,id,idx>``.
        ArgumentError: ``hoist``, ``cache`` or ``detect_anomaly`` is not a bool (a TypeError).
    """
    hoist = flag_arg(hoist, "build(hoist=...)")
    cache = flag_arg(cache, "build(cache=...)")
    detect_anomaly = flag_arg(detect_anomaly, "build(detect_anomaly=...)")
    programs = programs_mode() if programs is None else flag_arg(programs, "build(programs=...)")
    outs, plan = _check_outputs(graph, outputs)
    values = _checked_feed(graph, plan, feed)

    # Let go of the previous build before computing this one's values: if nothing else holds it,
    # it is freed now and its memory is reused warm, instead of this build faulting in fresh pages
    # while both are alive. A weak reference restores it if this build fails (and it still exists).
    previous = weakref.ref(graph.latest_build) if graph.latest_build is not None else None
    graph.latest_build = None
    base = (*outs, len(graph.nodes), graph.training, is_grad_enabled(), hoist, programs)
    key = (*base, *((n, a.shape, a.dtype.str) for n, a in values.items()))
    ekey = elastic_key(base, values)  # the key of a graph that resizes (vgraph.virtual.elastic)
    cached = (graph._cache.take(key) or graph._cache.take(ekey)) if cache else None
    if cached is not None:
        cg: UnrolledGraph | None
        cg = cached._succeed()
        try:
            if cg._elastic is not None and not cg._elastic.resize(cg, values):
                raise StructureChangedError("a longer sequence than the cached graph's")
            resize = cg._elastic is None and cg._resizes_by_programs()
            with _anomaly_scope(detect_anomaly):
                cg._replay(values, [graph.seed, graph._builds], resize=resize)
        except VGraphError:  # another structure (or an error a fresh build reports in context)
            cg = None
        if cg is not None:
            cg._build_number = graph._builds
            graph._cache.put(ekey if cg._elastic is not None or resize else key, cg, replayed=True)
            graph.latest_build = cg
            graph._builds += 1
            return cg
    try:
        builder = _Builder(graph, values, plan, hoist, programs=programs, cached=cache)
        if cache:
            builder.traces = []
        top = _Frame(None, (), {}, None)
        with (
            contextlib.nullcontext() if graph.training else no_grad(),
            _anomaly_scope(detect_anomaly),
            gc_paused(),
        ):
            builder.run_scope(top)
    except BaseException:
        graph.latest_build = previous() if previous is not None else None
        raise
    cg = builder.cg
    cg._envs[(None, ())] = top.env
    cg.outputs = [top.env[o] for o in outs]
    cg._declared_outputs, cg._build_number = outs, builder._seed[1]
    cg._grad = graph.training and is_grad_enabled()
    cg._mark_fresh([_ALL])  # every node was computed from its parents' current values
    for name, node in builder.new_params.items():  # commit only after success
        graph.params._add(name, node)
    if cache and cg.dropped_values is None:  # a replay would read dropped values: checkpointed graphs unroll
        known = cached is not None  # this structure was built before: keep the graph
        if builder.traces:  # kept by the elastic key if it can resize (analysed once it is kept)
            cg._elastic = Elastic(builder.traces, cg)
            if known or graph._cache.admits(ekey):
                known = True
                if not cg._elastic.analyse(cg):
                    cg._elastic = None
        # kept for any leading lengths if it resizes (elastic, or by its programs), else for these
        elastic = cg._elastic is not None or cg._resizes_by_programs()
        graph._cache.put(ekey if elastic else key, cg, replayed=known)
    graph.latest_build = cg
    graph._builds += 1
    return cg
