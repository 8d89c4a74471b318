"""Unrolling: :func:`build_compute_graph` turns a VirtualGraph and one feed into an
:class:`UnrolledGraph`, iteration by iteration, computing values as it goes so that loop conditions
and branch selectors see real data."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import numpy as np

from ..compute import (
    _ALL,
    ComputeGraph,
    ComputeNode,
    NodeKey,
    _as_value,
    _by_serial,
    computed_ops,
    flag_arg,
    next_version,
    owned_value,
)
from ..errors import (
    BuildError,
    FeedError,
    LoopLimitError,
    ShapeError,
    StructureChangedError,
    StructureError,
    VGraphError,
)
from ..modes import anomaly_scope as _anomaly_scope
from ..modes import is_anomaly_enabled, is_grad_enabled, no_grad, programs_mode
from ..ops import OPS, Op
from ..tape import ForwardTape, tapes_enabled
from ..workspace import computing, gc_paused
from .cache import SupersededGraph
from .checkpoint import LoopRecord, Rematerializer
from .elastic import Elastic, Trace, elastic_key
from .graph import VirtualGraph, one_build_at_a_time
from .hoist import RowSum, batched_attrs, defer_unread, hoist_loop, row_sums
from .nodes import _NO_LOOP_VALUE, BranchNode, LoopNode, VirtualNode
from .plan import _Plan
from .program import BodyProgram, ProgramInstance, _seed_vjp, fixed_by_shapes, program_for, vjp_of
from .rules import at_limit, check_carry, reached_end, run_cond, select_option
from .store import _store_name

_GETITEM, _STACK, _HOISTED, _BRANCH = OPS["GetItem"], OPS["Stack"], OPS["Hoisted"], OPS["Branch"]


def _key(fields: tuple[str, int, tuple[int, ...]]) -> NodeKey:
    """``NodeKey(*fields)`` without the named tuple's Python-level ``__new__`` (the hot path of
    unrolling: one key per node)."""
    return tuple.__new__(NodeKey, fields)


# ---------------------------------------------------------------------------- unrolling


@dataclass(frozen=True)
class Decision:
    """A data-dependent structural decision made while unrolling.

    Attributes:
        node: the loop or branch.
        idx: the iteration path it was made in.
        kind: ``"iterations"`` (a loop's trip count) or ``"option"`` (a branch's choice).
        value: the trip count or the chosen option index.
    """

    node: VirtualNode
    idx: tuple[int, ...]
    kind: str
    value: int


class UnrolledGraph(ComputeGraph):
    """The ComputeGraph of one unrolled VirtualGraph, with its outputs and decisions.

    Everything of :class:`ComputeGraph` works on it; in addition, methods that take nodes also
    accept the virtual nodes they were built from, ``node(vnode, idx)`` finds any copy, and
    ``feed`` sets new input values by name for a re-run forward (dirty-checked, with every
    recorded decision re-checked).
    """

    def __init__(self, virtual: VirtualGraph) -> None:
        super().__init__(virtual.dtype)
        self.virtual = virtual
        self.outputs: list[ComputeNode] = []
        self.decisions: list[Decision] = []
        self.inputs: dict[str, ComputeNode] = {}
        self._envs: dict[tuple[LoopNode | None, tuple[int, ...]], dict[VirtualNode, ComputeNode]] = {}
        # Hoisted groups and the nodes that read one row of them per iteration: their copies (row t
        # of the group is copy t, a Hoisted node), and for a reassociated sum's group <Add*:s> the
        # sum's nodes (.hoist.RowSum).
        self._groups: dict[ComputeNode, list[ComputeNode]] = {}
        # Sampled leaves (dropout masks): how to draw them again when the graph is replayed.
        self._samples: dict[ComputeNode, tuple[Any, ComputeNode]] = {}
        # The compiled replay (vgraph.tape) of a graph without sampled leaves, made on first replay.
        self._replay_tape: ForwardTape | None = None
        # How to resize it for other lengths of its stepped sequences (vgraph.virtual.elastic).
        self._elastic: Elastic | None = None
        # Loop instances run as body programs, by (loop, iteration path); loop instances that ran
        # node by node although programs were asked for, with the reason (see .program).
        self.programs: dict[tuple[LoopNode, tuple[int, ...]], ProgramInstance] = {}
        self.interpreted: list[tuple[LoopNode, tuple[int, ...], str]] = []
        # How it was built (for per_node): the declared outputs, options and build number.
        self._declared_outputs: list[VirtualNode] = []
        self._grad = True
        self._build_number = 0

    def per_node(self) -> UnrolledGraph:
        """This graph as the plain per-node unroll makes it (``programs=False, hoist=False``): a
        node per body node per iteration, with the same keys, values and decisions — what drawing, the explorer and
        :func:`vgraph.check_vjps` read. Gradients are carried over: a leaf is the same object, and
        another node gets the gradient its counterpart here retains (a view's included, see
        :func:`vgraph.render.retain_all_grads`). Returns ``self`` if no loop ran as a program.

        It is a new build of the current input values (parameters shared, the same sampled values),
        kept by nobody: nothing of this graph changes.
        """
        if not self.programs:
            return self
        graph, plan = self.virtual, self.virtual._plan(self._declared_outputs)
        values = {name: node.value for name, node in self.inputs.items()}
        builder = _Builder(graph, values, plan, False, builds=self._build_number, programs=False)
        top = _Frame(None, (), {}, None)
        with (
            contextlib.nullcontext() if self._grad else no_grad(),
            gc_paused(),
        ):
            builder.run_scope(top)
        cg = builder.cg
        cg._envs[(None, ())] = top.env
        cg.outputs = [top.env[o] for o in self._declared_outputs]
        cg._mark_fresh([_ALL])
        views: dict[NodeKey, ComputeNode] = {}
        for instance in self.programs.values():
            for view in instance._views.values():
                views[view.key] = view
        for key, node in cg._nodes.items():
            mine = self._nodes.get(key) or views.get(key)
            if node.op is not None and node.requires_grad and mine is not None and mine.grad is not None:
                node.grad = np.array(mine.grad)
                node.retains_grad = True
        return cg

    def _counterpart(self, graph: ComputeGraph, node: ComputeNode) -> ComputeNode:
        """``node`` in ``graph``, this graph's :meth:`per_node` form: the node with its key, or
        for a loop's output ``<Final:k@idx>`` the node it stands for there (the last update)."""
        if graph is self or node.key in graph:
            return graph.node(node.key)
        k = node.key
        v = next((v for v in self.virtual.nodes if v.type == k.type and v.id == k.id), None)
        if v is None or not isinstance(graph, UnrolledGraph):
            raise BuildError(f"{node.describe()} has no counterpart in the per-node form of its graph")
        return graph.node(v, k.idx)

    def _copies_of(self, v: VirtualNode) -> dict[tuple[int, ...], ComputeNode]:
        found = {idx: env[v] for (scope, idx), env in self._envs.items() if scope is v.scope and v in env}
        for (loop, idx), instance in self.programs.items():
            if loop is v.scope:
                run = cast(Any, instance.run)
                for t in range(run.trips):
                    if instance.built(v, t):
                        at = (*idx, t)
                        found[at] = instance.view(v, t, self)
        return found

    def node(self, what: Any, idx: tuple[int, ...] = ()) -> ComputeNode:
        """The compute node for a key (as in ComputeGraph), or for virtual node ``what`` in
        iteration path ``idx``.

        Raises:
            BuildError: ``what`` was not built at ``idx`` in this graph.
        """
        if not isinstance(what, VirtualNode):
            if self.programs:  # a key of a body node of a loop run as a program: its view
                view = self._view_by_key(what)
                if view is not None:
                    return view
            return super().node(what)
        idx = tuple(idx)
        env = self._envs.get((what.scope, idx))
        if (env is None or what not in env) and idx and what.scope is not None:
            instance = self.programs.get((what.scope, idx[:-1]))
            if instance is not None:  # a body node of a loop run as a program: its view
                return instance.view(what, idx[-1], self)
        if env is None or what not in env:
            raise BuildError(
                f"{what.describe(idx)} was not built in this graph (not needed, or no such iteration)"
            )
        return env[what]

    _NODE_ARG = "a ComputeNode of this graph or a VirtualNode it was built from"

    def _view_by_key(self, key: Any) -> ComputeNode | None:
        """The view of the body node a key (or its printed form) names, if a loop run as a
        program computed it (``None`` otherwise: the key is looked up among the graph's nodes)."""
        try:
            k = NodeKey.parse(key) if isinstance(key, str) else key
        except ValueError:
            return None
        if not isinstance(k, NodeKey) or not k.idx or k in self._nodes:
            return None
        for (_loop, idx), instance in self.programs.items():
            if idx == k.idx[:-1]:
                v = instance.body_node(k.type, k.id)
                if v is not None and instance.built(v, k.idx[-1]):
                    return instance.view(v, k.idx[-1], self)
        return None

    def _succeed(self) -> UnrolledGraph:
        """A new graph object that owns this one's nodes; this one becomes a
        :class:`~.cache.SupersededGraph` (see :mod:`vgraph.virtual.cache`)."""
        new = object.__new__(UnrolledGraph)
        new.__dict__.update(self.__dict__)
        new._weak_self.ref = weakref.ref(new)  # what every node of the graph refers to it by
        self.__dict__.clear()
        self.__class__ = SupersededGraph  # type: ignore[assignment]
        return new

    def _replay(self, values: Mapping[str, np.ndarray], seed: list[int]) -> None:
        """Recompute every node for new input values, as a fresh build of this structure would:
        in creation order, sampled leaves drawn again (from a generator seeded with ``seed``, made
        only if the graph has any: making one costs about 10 µs) when their turn comes, guards
        re-checking every recorded decision.

        Raises:
            StructureChangedError: the new values lead to another structure.
        """
        for n in self._graded:  # a fresh build's nodes have no gradient and retain none
            n.grad = None
            n.retains_grad = False
        self._graded.clear()
        for name, arr in values.items():  # checked copies (_checked_feed): adopted, not copied again
            self.inputs[name]._set(arr, copy=False)
        try:
            if not self._replayed_by_tape():
                self._replay_interpreted(np.random.default_rng(seed) if self._samples else None)
        except BaseException as e:
            self._failed_forward = f"{type(e).__name__}: {e}"
            raise
        self._released = False
        self._stale = self._failed_forward = None
        self._mark_fresh([_ALL])

    def _forget_plans(self) -> None:
        """:meth:`ComputeGraph._forget_plans`, and the compiled replay."""
        super()._forget_plans()
        self._replay_tape = None

    def _replayed_by_tape(self) -> bool:
        """Replay with the compiled sweep (vgraph.tape) where one applies (``False`` where not)."""
        if self._samples or not tapes_enabled() or is_anomaly_enabled():
            return False
        if self._replay_tape is None:
            self._replay_tape = ForwardTape(computed_ops(self._nodes.values(), self._deferred))
        try:
            self._replay_tape(next_version)
        except Exception as e:
            self._raise_tape_error(computed_ops(self._nodes.values(), self._deferred), e)
        return True

    def _replay_interpreted(self, rng: np.random.Generator | None) -> None:
        samples, training, deferred = self._samples, self.virtual.training, self._deferred
        run = self._run
        for n in sorted(self._nodes.values(), key=_by_serial) if samples else self._nodes.values():
            if n.op is None:
                sample = samples.get(n)
                if sample is not None:
                    n.set_value(sample[0](rng, sample[1]._value, training))
                continue
            if n in deferred:
                continue
            version = n.version
            for p in n.parents:
                if p.version > version:
                    n._value = run(n)
                    n.version = next_version()
                    break

    def _add_copy(self, group: ComputeNode, copy: ComputeNode) -> ComputeNode:
        self._groups.setdefault(group, []).append(copy)
        return copy

    def _gradient_sources(
        self, nodes: Iterable[ComputeNode]
    ) -> dict[ComputeNode, list[tuple[ComputeNode, int | None]]]:
        """Each node the gradients of some of ``nodes`` are taken from (see :meth:`_backprop`), with
        those nodes and how: row ``t`` of a hoisted group's gradient for its copy ``t``, the whole
        gradient (``None``) of a sum for its partial sum or its product computed when read."""
        groups, deferred = self._groups, self._deferred
        found: dict[ComputeNode, list[tuple[ComputeNode, int | None]]] = {}
        for n in nodes:
            proxy = deferred.get(n)
            if proxy is not None:
                found.setdefault(proxy, []).append((n, None))
            elif n.op is _HOISTED and n.parents[0] in groups:
                found.setdefault(n.parents[0], []).append((n, n.attrs["index"]))
        return found

    def _backprop(
        self,
        plan: list[ComputeNode],
        roots: list[tuple[ComputeNode, Any]],
        accumulate: bool,
        wanted: set[ComputeNode] | None = None,
        reach: set[ComputeNode] | None = None,
    ) -> dict[ComputeNode, np.ndarray]:
        """:meth:`ComputeGraph._backprop`, plus the gradients of hoisted copies and of nodes
        computed when read.

        Hoisted groups read each other directly, so a copy's own gradient lacks what hoisted
        readers contributed; the plain unroll's gradient of copy ``t`` is row ``t`` of its group's
        gradient (a group's only readers are its copies and other groups). A partial sum computed
        when read has no reader: its gradient is that of the sum that computes it another way
        (see ``computed_when_read``). Such nodes that retain their gradient (``backward``) or are
        asked for (``grad``) get that row, or that gradient.
        """
        if accumulate:  # the nodes that retain their gradient are among those _graded holds
            watched = self._gradient_sources([n for n in self._graded if n.retains_grad])
        else:  # grad() (accumulate=False) passes the set
            watched = self._gradient_sources(cast("set[ComputeNode]", wanted))
        if not watched:
            return super()._backprop(plan, roots, accumulate, wanted, reach)
        if not accumulate:
            found = super()._backprop(
                plan, roots, accumulate, {*cast("set[ComputeNode]", wanted), *watched}, reach
            )
            for g, taken in watched.items():
                for c, row in taken:
                    if g in found:
                        found[c] = np.array(found[g] if row is None else found[g][row])
            return found
        saved = {g: (g.retains_grad, g.grad) for g in watched}
        before = {c: c.grad for taken in watched.values() for c, _ in taken}
        for g in watched:
            g.retains_grad, g.grad = True, None
        try:
            found = super()._backprop(plan, roots, accumulate, wanted, reach)
            for g, taken in watched.items():
                for c, row in taken:
                    if g.grad is not None:
                        part = cast(np.ndarray, g.grad)  # an op node's: dense
                        part = part if row is None else part[row]
                        c.grad = np.array(part) if before[c] is None else before[c] + part
                        self._graded.add(c)
        finally:
            for g, (retains, grad) in saved.items():  # the group's own .grad as the user left it
                if retains and g.grad is not None:
                    g.grad = g.grad if grad is None else grad + g.grad
                else:
                    g.grad = grad
                g.retains_grad = retains
        return found

    def _resolve(self, x: Any) -> Any:
        return self.node(x) if isinstance(x, VirtualNode) else x

    def __contains__(self, what: object) -> bool:
        """Whether a key names a node of this graph, or a virtual node has a copy in it."""
        if isinstance(what, VirtualNode):
            return bool(self._copies_of(what))
        return super().__contains__(what) or (bool(self.programs) and self._view_by_key(what) is not None)

    def forward(self, target: Any = None, explain: bool = False, detect_anomaly: bool = False) -> Any:
        """:meth:`ComputeGraph.forward`; ``target`` defaults to the build's outputs (one value for a
        single output, else a list) and may be given as virtual nodes."""
        if target is None:
            target = self.outputs[0] if len(self.outputs) == 1 else self.outputs
        return super().forward(target, explain, detect_anomaly)

    def feed(self, values: Mapping[str, Any]) -> None:
        """Give inputs new values by name (checked like a build's feed); then call ``forward``.

        Raises:
            TypeError: ``values`` is not a mapping.
            FeedError: unknown names, names this graph did not use, or shapes that do not match.
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"feed() takes a mapping input name -> value, got {type(values).__name__}")
        staged = {}
        for name, value in values.items():
            decl = self.virtual._inputs.get(name)
            if decl is None or name not in self.inputs:
                raise FeedError(f"this graph has no input {name!r}; its inputs: {', '.join(self.inputs)}")
            staged[name] = _check_feed_value(decl, value, self.dtype)
        for name, arr in staged.items():  # the checked copies: adopted, not copied again
            self.inputs[name]._set(arr, copy=False)

    def __repr__(self) -> str:
        """Node count, outputs, the data-dependent decisions (trip counts, branch choices), and
        (built with ``programs=True``) how many loops ran as body programs and which did not, why."""
        name = f" of {self.virtual.name!r}" if self.virtual.name else ""
        outputs = ", ".join(o.describe() for o in self.outputs) or "none"
        lines = [f"UnrolledGraph{name}: {len(self._nodes)} nodes ({self.dtype}), outputs {outputs}"]
        shown = 8
        for d in self.decisions[:shown]:
            where = d.node.describe(d.idx)
            what = {"iterations": f"ran {d.value} iterations", "option": f"chose option {d.value}"}
            lines.append(f"  {where} {what.get(d.kind, f'{d.kind} at {d.value}')}")
        if len(self.decisions) > shown:
            lines.append(f"  … {len(self.decisions) - shown} more decisions (cg.decisions)")
        if self.programs:
            lines.append(f"  {len(self.programs)} loop instance(s) ran as body programs (vg.show_program)")
        for loop, idx, reason in self.interpreted[:shown]:
            lines.append(f"  {loop.describe(idx)} ran node by node: {reason}")
        if len(self.interpreted) > shown:
            lines.append(f"  … {len(self.interpreted) - shown} more ran node by node (cg.interpreted)")
        return "\n".join(lines)

    def capped(self, loop: LoopNode, idx: tuple[int, ...] = ()) -> bool:
        """Whether ``loop`` (declared with ``on_limit="stop"``) stopped at its ``max_iters`` cap."""
        return any(d.node is loop and d.idx == tuple(idx) and d.kind == "capped" for d in self.decisions)

    def trip_count(self, loop: LoopNode, idx: tuple[int, ...] = ()) -> int:
        """How many iterations ``loop`` ran in iteration path ``idx``."""
        return self._decision(loop, idx, "iterations")

    def choice(self, branch: BranchNode, idx: tuple[int, ...] = ()) -> int:
        """Which option ``branch`` selected in iteration path ``idx``."""
        return self._decision(branch, idx, "option")

    def _decision(self, node: VirtualNode, idx: tuple[int, ...], kind: str) -> int:
        for d in self.decisions:
            if d.node is node and d.idx == tuple(idx) and d.kind == kind:
                return d.value
        raise BuildError(f"{node.describe(tuple(idx))} was not built in this graph")


def _check_feed_value(decl: VirtualNode, value: Any, dtype: np.dtype) -> np.ndarray:
    try:
        arr = _as_value(value, dtype)
    except (TypeError, ValueError) as e:
        raise FeedError(f"input {decl.name!r}: {e}") from None
    shape = decl.attrs["shape"]
    if shape is not None and (
        arr.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, arr.shape))
    ):
        declared = "(" + ", ".join("None" if s is None else str(s) for s in shape) + ")"
        raise FeedError(f"input {decl.name!r} {decl.describe()}: fed shape {arr.shape}, declared {declared}")
    return owned_value(value, arr)  # exactly one copy, which the input leaf adopts (copy=False)


class _Frame:
    """The compute nodes of one scope in one iteration path."""

    __slots__ = ("scope", "idx", "env", "parent")

    def __init__(
        self, scope: LoopNode | None, idx: tuple[int, ...], env: dict[VirtualNode, Any], parent: _Frame | None
    ) -> None:
        self.scope = scope
        self.idx = idx
        self.env = env  # virtual node -> its compute node (None for a loop, which has no value)
        self.parent = parent

    def owner(self, v: VirtualNode) -> _Frame:
        f = self
        while f.scope is not v.scope:
            f = cast(_Frame, f.parent)  # v's scope encloses this frame's: an ancestor owns it
        return f


class _Builder:
    def __init__(
        self,
        graph: VirtualGraph,
        feed: Mapping[str, np.ndarray],
        plan: _Plan,
        hoist: bool = True,
        cg: Any = None,
        builds: int | None = None,
        programs: bool | None = False,
        cached: bool = False,
    ):
        """``cg``: where nodes go (an :class:`UnrolledGraph` by default; an input's view of a
        batched build in :mod:`.batch`); ``builds``: the build counter seeding sampled nodes;
        ``programs``: as :func:`build_compute_graph`'s, ``cached`` saying whether the build is."""
        self.graph = graph
        self.hoist = hoist
        # Whether loops run as body programs where they can (.program), None: chosen per loop: a
        # plain build's own graph only (a batched build's scheduler groups its inputs' nodes itself).
        self.programs = programs if cg is None else False
        self.cached = cached
        # Whether the build may change how its own graph computes hoisted loops (see .hoist:
        # sums built row by row, copies computed when read): not an input's view of a batched build,
        # whose ops the scheduler groups as declared.
        self.rewrite = hoist and cg is None
        self.feed = feed
        self.plan = plan
        self.cg = UnrolledGraph(graph) if cg is None else cg
        self.new_params: dict[str, ComputeNode] = {}
        self.chosen: dict[tuple[BranchNode, tuple[int, ...]], int] = {}  # for multi-output branches
        self._seed = [graph.seed, graph._builds if builds is None else builds]
        self._rng: np.random.Generator | None = None
        # Records of stepping loops for resizing a cached graph (vgraph.virtual.elastic); None:
        # do not record (a build that is not cached, an input of a batched build).
        self.traces: list[Trace] | None = None

    @property
    def rng(self) -> np.random.Generator:
        """The generator of this build's sampled nodes, seeded by the graph's seed and the build
        counter; made when first needed (making one costs about 10 µs, and most builds sample
        nothing)."""
        if self._rng is None:
            self._rng = np.random.default_rng(self._seed)
        return self._rng

    # -- building one node whose dependencies are built
    def build_node(self, v: VirtualNode, frame: _Frame) -> None:
        env = frame.env
        kind = v.kind
        cg = self.cg
        if kind == "op":
            env[v] = cg._add_op(
                cast(Op, v.op),
                tuple([env[i] for i in v.inputs]),
                v.attrs,
                NodeKey(v.type, v.id, frame.idx),
                v.name,
            )
        elif kind == "parameter":
            env[v] = cg.add_leaf(self.parameter(v, frame.idx))
        elif kind == "input":
            name = cast(str, v.name)  # inputs are declared with a name
            node = cg.input(  # the feed holds the build's own checked copy: adopted, not copied again
                self.feed[name], name, NodeKey("Input", v.id, ()), v.attrs["requires_grad"], copy=False
            )
            cg.inputs[name] = node
            env[v] = node
        elif kind == "constant":
            env[v] = cg.constant(v.attrs["value"], v.name, NodeKey("Constant", v.id, ()))
        elif kind == "sample":
            like = env[v.inputs[0]]
            value = v.attrs["fn"](self.rng, like.value, self.graph.training)
            env[v] = cg.constant(value, v.name, NodeKey("Sample", v.id, frame.idx))
            cg._samples[env[v]] = (v.attrs["fn"], like)
        elif kind == "loop":
            assert isinstance(v, LoopNode)
            self.run_loop(v, frame)
        elif kind == "row sum":  # a sum of a loop body, reading a hoisted group's rows (see .hoist)
            cast(RowSum, v).build(cg, env, frame.idx)
        elif kind == "branch":
            self.demand(v, frame)
        elif kind == "stacked":  # a loop sets its outputs when it runs, a stack only if it iterated
            loop, idx = v.inputs[0], frame.idx
            raise BuildError(f"{v.describe(idx)}: {loop.describe(idx)} ran no iteration, nothing to stack")
        elif kind == "final":
            raise AssertionError(f"{v.describe(frame.idx)}: a loop sets its outputs when it runs")
        else:  # carry, item and child nodes are set at the start of each iteration
            raise AssertionError(f"unexpected {v.kind} node {v.describe()}")

    def parameter(self, v: VirtualNode, idx: tuple[int, ...]) -> ComputeNode:
        if v.attrs["share"]:
            return self.graph.params[cast(str, v.name)]  # parameters are declared with a name
        name = _store_name(v, idx)
        node = self.graph.params._nodes.get(name) or self.new_params.get(name)
        if node is None:  # first time this iteration path is reached: initialise now
            node = self.new_params[name] = self.graph._new_parameter(v, idx)
        return node

    def demand(self, target: VirtualNode, frame: _Frame) -> ComputeNode:
        """Build ``target`` and whatever it needs that is not built yet.

        Iterative, branches included: a branch whose keys are built chooses, then waits on the
        stack for its option, so a chain of 10,000 branches needs no recursion.
        """
        stack = [target]
        choices: dict[VirtualNode, int] = {}
        while stack:
            v = stack[-1]
            f = frame.owner(v)
            if v in f.env:
                stack.pop()
                continue
            missing = [d for d in self.plan.deps(v) if d not in frame.owner(d).env]
            if missing:
                stack.extend(missing)
                continue
            if v.kind == "branch":
                assert isinstance(v, BranchNode)
                choice = choices.get(v)
                if choice is None:
                    lead = v.lead
                    choice = choices[v] = self.choose(v, f) if lead is None else self.chosen[(lead, f.idx)]
                option = v.options[choice]
                if option not in frame.owner(option).env:
                    stack.append(option)
                    continue
                self.finish_branch(v, f, choice)
            else:
                self.build_node(v, f)
            stack.pop()
        return cast(ComputeNode, frame.owner(target).env[target])  # not a loop: it has a value

    def run_scope(self, frame: _Frame, order: Sequence[Any] | None = None) -> None:
        # Declaration order is topological (see LoopNode.__exit__), and a body's env starts with
        # its captures, so every dependency is built by the time a node's turn comes. ``order``
        # replaces the plan's eager list when some of it is hoisted (already in the env) or built
        # row by row (a .hoist.RowSum stands where the sum was).
        env, idx, add_op = frame.env, frame.idx, self.cg._add_op
        for v in self.plan.eager.get(frame.scope, ()) if order is None else order:
            op = v.op
            if op is not None:  # the hot path: most nodes are ops
                env[v] = add_op(
                    op, tuple([env[i] for i in v.inputs]), v.attrs, _key((v.type, v.id, idx)), v.name
                )
            elif v not in env:  # loop outputs are already set by their loop
                self.build_node(v, frame)

    # -- control flow
    def run_loop(self, loop: LoopNode, frame: _Frame) -> None:
        programs = self.programs
        if programs is None:  # chosen per loop: see build_compute_graph
            programs = not (self.cached and fixed_by_shapes(loop, self.plan))
        if programs:
            program = (
                "anomaly mode checks every node as it is made"
                if is_anomaly_enabled()
                else program_for(loop, self.plan)
            )
            if isinstance(program, BodyProgram):
                failed = self.run_program(loop, frame, program)
                if failed is None:
                    return
                # the per-node unroll raises the error naming the node (or, if it does not, runs)
                program = f"its program raised {type(failed).__name__}: {failed}"
            self.cg.interpreted.append((loop, frame.idx, program))
        cg = self.cg
        env = frame.env
        idx = frame.idx
        state = [frame.owner(c.inputs[0]).env[c.inputs[0]] for c in loop.carries]
        seqs, length = _stepped_sequences(loop, frame)
        if seqs:
            guard = cg.guard(
                seqs, _length_check(loop, idx, cast(int, length)), NodeKey("LengthCheck", loop.id, idx)
            )
        kids = None  # a recursion's children array: row t lists node t's children
        if loop.structure is not None:
            node = frame.owner(loop.structure).env[loop.structure]
            kids = _check_structure(loop, idx, node.value, length)
            length = len(kids)
            cg.guard([node], _structure_check(loop, idx, kids), NodeKey("StructureCheck", loop.id, idx))
            history: list[list[ComputeNode]]
            defaults, history = state, []  # every node's state, read by its parents
            rows = kids.tolist()  # plain ints: reading them per node costs less than numpy scalars
            reads = [(read, loop.carries.index(read.inputs[0]), read.attrs["slot"]) for read in loop.children]
        captured = {c: frame.owner(c).env[c] for c in self.plan.captures[loop]}
        groups: dict[VirtualNode, ComputeNode] = {}
        trips = 0
        if (
            self.hoist
            and loop.cond is None
            and loop.until is None
            and loop.checkpoint is None
            and self.plan.hoistable[loop]
        ):
            trips = min(n for n in (loop.times, length) if n is not None)  # known before it starts
            if 1 < trips <= loop.max_iters:
                groups = hoist_loop(self, loop, frame, captured, seqs, trips)
        sums = row_sums(self, loop, frame, captured, groups, trips) if groups and self.rewrite else {}
        order: list[Any] | None = None
        if groups:  # hoisted nodes are in the environment already; a sum built row by row is built whole
            parts = {r.part for r in sums.values() if r.part is not None} | {
                r.c for r in sums.values() if r.fuse
            }
            order = [
                sums.get(v, v) for v in self.plan.eager.get(loop, ()) if v not in groups and v not in parts
            ]
        stacked = self.plan.stacked.get(loop, [])
        collected: list[list[ComputeNode]] = [[] for _ in stacked]
        names = [c.name for c in loop.carries]
        ckpt = self.checkpointing(loop, idx, length, kids)  # None unless checkpoint= was given
        trace = None
        if (
            self.traces is not None
            and seqs
            and kids is None
            and ckpt is None
            and loop.times is None
            and loop.cond is None
            and loop.until is None
        ):  # maybe elastic (vgraph.virtual.elastic)
            check = partial(_length_check, loop, idx)
            made = [r.group for r in sums.values() if r.part is not None]  # (the others: a's groups)
            trace = Trace(loop, cg, guard, check, [*groups.values(), *made], seqs)
        c: Any  # a carry, or in a recursion a child's index
        t = 0
        start = len(cg._nodes) if groups and self.rewrite else 0  # (defer_unread below)
        while True:
            if reached_end(loop, t, length):
                break
            if loop.cond is not None:
                go = run_cond(loop, idx, t, names, [s.value for s in state])
                cg.guard(
                    state, _cond_check(loop, idx, t, names, go), NodeKey("LoopCheck", loop.id, (*idx, t))
                )
                if not go:
                    break
            if at_limit(loop, idx, t):  # a cap, not an error: recorded with the trip count
                cg.decisions.append(Decision(loop, idx, "capped", t))
                break
            inner = _Frame(loop, (*idx, t), dict(captured), frame)
            ienv = inner.env
            for c, node in zip(loop.carries, state):
                ienv[c] = node
            if kids is not None:  # each child read *is* the node computed at that child
                row = rows[t]
                for read, k, slot in reads:  # (every slot is a column: see _check_structure)
                    c = row[slot]
                    ienv[read] = history[c][k] if c >= 0 else defaults[k]
            _iteration_views(cg, loop, inner, seqs, groups, length, t)
            self.run_scope(inner, order)
            cg._envs[(loop, inner.idx)] = ienv
            new_state = [ienv[loop.updates[c]] for c in loop.carries]
            for c, old, new in zip(loop.carries, state, new_state):
                check_carry(loop, idx, t, c.name, old._value, new._value, new)
            state = new_state
            if trace is not None:
                trace.ends.append(len(cg._nodes))
                trace.envs.append(ienv)
            if kids is not None:
                history.append(new_state)
            for bucket, s in zip(collected, stacked):
                bucket.append(ienv[s.inputs[1]])
            if ckpt is not None:
                ckpt.end_iteration(t, new_state, [ienv[s.inputs[1]] for s in stacked])
            t += 1
            if loop.until is not None:  # do-while: checked on the updated state
                done = run_cond(loop, idx, t - 1, names, [s.value for s in state], until=True)
                cg.guard(
                    state,
                    _cond_check(loop, idx, t - 1, names, done, until=True),
                    NodeKey("UntilCheck", loop.id, (*idx, t - 1)),
                )
                if done:
                    break
        cg.decisions.append(Decision(loop, idx, "iterations", t))
        if ckpt is not None:
            ckpt.finish(t, state)
        env[loop] = None  # the loop itself has no value; its outputs do
        for v in self.plan.finals.get(loop, ()):
            env[v] = state[loop.carries.index(v.inputs[1])]
        for s, bucket in zip(stacked, collected):
            if not bucket:  # an error only if the stack is used: see build_node
                continue
            env[s] = cg._add_op(_STACK, tuple(bucket), {"axis": 0}, NodeKey("Stack", s.id, idx), s.name)
            if ckpt is not None:
                ckpt.share_stack(env[s], bucket)
        if groups and self.rewrite:
            defer_unread(self, loop, groups, sums, len(cg._nodes) - start)
        if trace is not None and trace.close(cg, [env[s] for s in stacked if s in env]):
            cast("list[Trace]", self.traces).append(trace)  # (a trace is made only when recording)

    def run_program(self, loop: LoopNode, frame: _Frame, program: BodyProgram) -> Exception | None:
        """Run ``loop`` in ``frame`` as its body program: one ``<Loop:id@idx>`` node whose value
        is the run, and a node per output (see :mod:`.program`). Returns the exception the
        program raised, having added no node, if it did (the caller then unrolls the loop)."""
        cg, env, idx = self.cg, frame.env, frame.idx
        init = [frame.owner(c.inputs[0]).env[c.inputs[0]] for c in loop.carries]
        seqs, length = _stepped_sequences(loop, frame)
        structure: list[ComputeNode] = []
        if loop.structure is not None:
            node = frame.owner(loop.structure).env[loop.structure]
            kids = _check_structure(loop, idx, node.value, length)
            length = len(kids)
            structure = [node]
        captured: list[ComputeNode] = []
        for v in program.captured:
            if v.scope is not loop:
                captured.append(frame.owner(v).env[v])
            elif v.kind == "parameter":
                captured.append(cg.add_leaf(self.parameter(v, idx)))
            else:
                captured.append(cg.constant(v.attrs["value"], v.name, NodeKey("Constant", v.id, ())))
        grad = is_grad_enabled()
        needs: set[VirtualNode] = set()
        if grad:
            needs.update(c for c, n in zip(loop.carries, init) if n.requires_grad)
            needs.update(i for i, n in zip(loop.items, seqs) if n.requires_grad)
            needs.update(v for v, n in zip(program.captured, captured) if n.requires_grad)
        try:
            hoisted, hoisted_attrs, groups = self._program_hoists(
                loop, program, seqs, length, captured, needs
            )
        except Exception as e:
            return e
        variant = program.variant(tuple(hoisted), frozenset(needs))
        instance = ProgramInstance(program, variant, idx, hoisted_attrs, [n.sparse_grad for n in captured])
        instance.captured_nodes, instance.init_nodes = captured, init
        parents = (*init, *seqs, *structure, *captured)
        values = [n.value for n in parents]
        try:
            run = instance.forward(*values, groups=groups)
        except Exception as e:
            return e
        instance.run = run
        if seqs:
            cg.guard(seqs, _length_check(loop, idx, cast(int, length)), NodeKey("LengthCheck", loop.id, idx))
        if structure:
            cg.guard(structure, _structure_check(loop, idx, kids), NodeKey("StructureCheck", loop.id, idx))
        for t, record in enumerate(run.records):
            for branch, pos in variant.choice.items():
                if record[pos] >= 0:
                    cg.decisions.append(Decision(branch, (*idx, t), "option", record[pos]))
        if run.capped:
            cg.decisions.append(Decision(loop, idx, "capped", run.trips))
        cg.decisions.append(Decision(loop, idx, "iterations", run.trips))
        call = instance.vjp
        vjps = [partial(call, i) if grad else None for i in range(len(init) + len(seqs))]
        vjps += [None] * len(structure)
        graded = variant.graded(run)
        vjps += [
            partial(call, len(vjps) + j) if v in needs and graded[j] else None
            for j, v in enumerate(program.captured)
        ]
        op = Op("Loop", instance.rerun, tuple(vjps), arity=len(parents))
        node = cg._add_op(op, parents, None, NodeKey("Loop", loop.id, idx), loop.name, value=run)
        cg.programs[(loop, idx)] = instance
        env[loop] = None  # the loop itself has no value; its outputs do
        seed = _seed_vjp
        for k, v in enumerate(program.finals):
            c = loop.carries.index(v.inputs[1])
            out = Op("LoopFinal", instance.final(c), (partial(seed, k),), arity=1)
            env[v] = cg._add_op(out, (node,), None, NodeKey("Final", v.id, idx), v.name, value=run.finals[c])
        caps = [n.value for n in captured]
        for j, s in enumerate(program.stacked):
            if not run.trips:  # an error only if the stack is used: see build_node
                continue
            out = Op(
                "LoopStack", instance.stacked(j, caps), (partial(seed, len(program.finals) + j),), arity=1
            )
            env[s] = cg._add_op(out, (node,), None, NodeKey("Stack", s.id, idx), s.name)
        return None

    def _program_hoists(
        self,
        loop: LoopNode,
        program: BodyProgram,
        seqs: Sequence[ComputeNode],
        length: int | None,
        captured: Sequence[ComputeNode],
        needs: set[VirtualNode],
    ) -> tuple[list[VirtualNode], list[dict[str, Any]], list[Any]]:
        """The body nodes a run of ``program`` computes once over all iterations (with their
        grouped attributes and values): hoistable ones whose shapes allow it, when the trip
        count is known before the loop starts. Adds those that need a gradient to ``needs``."""
        if not self.hoist or loop.cond is not None or loop.until is not None or not program.hoistable:
            return [], [], []
        trips = min(n for n in (loop.times, length) if n is not None)
        if not 1 < trips <= loop.max_iters:
            return [], [], []
        cap_of = dict(zip(program.captured, captured))
        group_of: dict[VirtualNode, Any] = {}
        for item, seq in zip(loop.items, seqs):
            value = seq.value
            group_of[item] = value[::-1][:trips] if item.attrs.get("reverse") else value[:trips]
        hoisted, attrs_list, values = [], [], []
        for v in program.hoistable:
            xs, shapes, stacked = [], [], []
            for u in v.inputs:
                if u in group_of:
                    xs.append(group_of[u])
                    shapes.append(np.shape(group_of[u])[1:])
                    stacked.append(True)
                elif u in cap_of:
                    xs.append(cap_of[u].value)
                    shapes.append(cap_of[u].shape)
                    stacked.append(False)
                else:
                    break
            else:
                op = cast(Op, v.op)
                attrs = batched_attrs(op, v.attrs, shapes, stacked, trips)
                if attrs is None:
                    continue
                group_of[v] = value = op.forward(*xs, **attrs)
                hoisted.append(v)
                attrs_list.append(attrs)
                values.append(value)
                if any(vjp_of(op, p) is not None and u in needs for p, u in enumerate(v.inputs)):
                    needs.add(v)
        return hoisted, attrs_list, values

    def checkpointing(
        self, loop: LoopNode, idx: tuple[int, ...], length: int | None, kids: Any
    ) -> LoopRecord | None:
        """The book-keeping of a checkpointed loop instance (``None`` if the loop keeps every
        value): see :mod:`vgraph.virtual.checkpoint`."""
        if loop.checkpoint is None or not is_grad_enabled():
            return None
        cg = self.cg
        remat = cg.dropped_values
        if not isinstance(remat, Rematerializer):  # the graph's first checkpointed loop
            remat = Rematerializer(cg, next_version)
            cg.attach_dropped_values(remat)
        known = [n for n in (loop.times, length) if n is not None] if loop.cond is None else []
        trips = min(known) if known else None
        return remat.start_loop(loop, idx, loop.checkpoint, trips, kids, self.rng, self.graph.training)

    def choose(self, branch: BranchNode, frame: _Frame) -> int:
        """Run ``branch``'s selector on its keys' values (built by now)."""
        return select_option(branch, frame.idx, [frame.owner(k).env[k].value for k in branch.keys])

    def finish_branch(self, branch: BranchNode, frame: _Frame, choice: int) -> None:
        """Add the branch node once its chosen option is built: it passes the option on and
        re-checks the choice on every forward. A follower (another output of a branch with
        several) only passes its option on: the lead's node checks the choice."""
        idx = frame.idx
        option = frame.owner(branch.options[choice]).env[branch.options[choice]]
        if branch.lead is not None:
            frame.env[branch] = self.cg._add_op(
                _BRANCH, (option,), None, NodeKey("Branch", branch.id, idx), branch.name
            )
            return
        self.chosen[(branch, idx)] = choice
        keys = [frame.owner(k).env[k] for k in branch.keys]
        self.cg.decisions.append(Decision(branch, idx, "option", choice))

        def forward(x: np.ndarray, *key_values: np.ndarray) -> np.ndarray:
            now = select_option(branch, idx, key_values)
            if now != choice:
                raise StructureChangedError(
                    f"{branch.describe(idx)} would now select option {now}, but this graph was built "
                    f"with option {choice}; rebuild the compute graph for the new inputs"
                )
            return x

        op = Op("Branch", forward, (lambda g, ans, x, *k: g, *([None] * len(keys))), arity=1 + len(keys))
        frame.env[branch] = self.cg.apply(
            op, [option, *keys], None, NodeKey("Branch", branch.id, idx), branch.name
        )


def _check_structure(loop: LoopNode, idx: tuple[int, ...], value: Any, length: int | None) -> np.ndarray:
    """A recursion's children array, checked: ``(N, k)`` integers, ``0 < N <= max_nodes``, a
    column for every slot ``r.child`` reads, every child index in ``[-1, t)`` for node ``t``
    (children first; a cycle cannot be ordered so)."""
    # only a recursion (loop.structure set) has a children array
    where = f"{loop.describe(idx)}: the children array {cast(VirtualNode, loop.structure).describe()}"
    kids = np.asarray(value)
    if kids.ndim != 2 or kids.dtype.kind not in "iu":
        raise StructureError(f"{where} must be an (N, k) integer array, got {kids.dtype} {kids.shape}")
    if len(kids) == 0:
        raise StructureError(f"{where} is empty: a structure needs at least one node")
    if len(kids) > loop.max_iters:  # (a recursion's max_iters is its max_nodes)
        raise LoopLimitError(
            f"{where} has {len(kids)} nodes, more than max_nodes={loop.max_iters}; raise g.recurse's "
            "max_nodes if a structure that large is intended"
        )
    for read in loop.children:
        if read.attrs["slot"] >= kids.shape[1]:
            width = kids.shape[1]
            slots = f"child slots 0..{width - 1}" if width else "no child slot"
            raise StructureError(
                f"{where} has width {width} ({slots}), but {read.describe()} reads "
                f"slot {read.attrs['slot']} (r.child(..., {read.attrs['slot']})); give every node a "
                "column for each slot read, -1 where it has no such child"
            )
    if length is not None and length != len(kids):
        raise StructureError(f"{where} has {len(kids)} nodes, but the stepped sequences have {length}")
    bad = (kids < -1) | (kids >= len(kids))
    if bad.any():
        t, j = map(int, np.argwhere(bad)[0])
        raise StructureError(
            f"{where}: structure node {t} has child {int(kids[t, j])} (slot {j}), out of range "
            f"(valid: -1 for none, or 0..{len(kids) - 1})"
        )
    late = kids >= np.arange(len(kids))[:, None]
    if late.any():
        t, j = map(int, np.argwhere(late)[0])
        c = int(kids[t, j])
        raise StructureError(
            f"{where}: structure node {t} has child {c} (slot {j}), which does not come before it; "
            "order the nodes children first (a topological order; a structure with a cycle has none)"
        )
    return kids.copy()  # type: ignore[no-any-return]  # numpy's stubs: Self is Any for py3.10


def _structure_check(loop: LoopNode, idx: tuple[int, ...], kids: np.ndarray) -> Callable[[np.ndarray], int]:
    def check(value: np.ndarray) -> int:
        if np.shape(value) != kids.shape or not np.array_equal(value, kids):
            raise StructureChangedError(
                f"{loop.describe(idx)} recurses over {cast(VirtualNode, loop.structure).describe()}, "
                "whose children array changed; rebuild the compute graph for the new structure"
            )
        return len(kids)

    return check


def _cond_check(
    loop: LoopNode, idx: tuple[int, ...], t: int, names: list[str | None], expected: bool, until: bool = False
) -> Callable[..., bool]:
    def check(*values: np.ndarray) -> bool:
        now = run_cond(loop, idx, t, names, list(values), until)
        if now != expected:
            raise StructureChangedError(
                f"{loop.describe(idx)}: at iteration {t} the condition is now {now} (was {expected}), so the "
                "loop would run a different number of iterations; rebuild the compute graph for the new inputs"
            )
        return now

    return check


def _length_check(loop: LoopNode, idx: tuple[int, ...], length: int) -> Callable[..., int]:
    def check(*values: np.ndarray) -> int:
        for seq, value in zip(loop.sequences, values):
            if np.ndim(value) == 0 or value.shape[0] != length:
                raise StructureChangedError(
                    f"{loop.describe(idx)} steps through {seq.describe()}, whose length is now "
                    f"{np.shape(value)[:1]} (was {length}); rebuild the compute graph for the new inputs"
                )
        return length

    return check


def _iteration_views(
    cg: Any,
    loop: LoopNode,
    inner: _Frame,
    seqs: Sequence[ComputeNode],
    groups: Mapping[VirtualNode, ComputeNode],
    length: int | None,
    t: int,
) -> None:
    """Put into iteration ``t``'s environment its step of each stepped sequence that is not hoisted
    (``x[t]``, or ``x[length - 1 - t]`` for a reversed step) and its copy of each hoisted node
    (row ``t`` of the group, registered with ``cg._add_copy``)."""
    env, idx = inner.env, inner.idx
    for item, node in zip(loop.items, seqs):
        if item not in groups:
            at = cast(int, length) - 1 - t if item.attrs.get("reverse") else t
            env[item] = cg._add_op(_GETITEM, (node,), {"index": at}, _key(("Item", item.id, idx)), item.name)
    for v, group in groups.items():
        env[v] = cg._add_copy(
            group, cg._add_op(_HOISTED, (group,), {"index": t}, _key((v.type, v.id, idx)), v.name)
        )


def _stepped_sequences(loop: LoopNode, frame: _Frame) -> tuple[list[ComputeNode], int | None]:
    """The sequences ``loop`` steps through, as built in ``frame``, and their common length
    (``None`` if it steps through none).

    Raises:
        ShapeError: a scalar sequence, or sequences of different lengths (names the loop).
    """
    seqs = [frame.owner(s).env[s] for s in loop.sequences]
    length = None
    for s, node in zip(loop.sequences, seqs):
        if node.value.ndim == 0:
            raise ShapeError(f"{loop.describe(frame.idx)}: cannot step through {s.describe()}, a scalar")
        n = node.value.shape[0]
        if length is not None and n != length:
            raise ShapeError(
                f"{loop.describe(frame.idx)}: stepped sequences have different lengths {length} and {n}"
            )
        length = n
    return seqs, length


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
            :mod:`vgraph.virtual.elastic`);
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
            recursion or branch inside: :func:`~.program.fixed_by_shapes`) — that structure
            comes back, and the cache re-runs the per-node unroll of a known structure faster.

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
            with _anomaly_scope(detect_anomaly):
                cg._replay(values, [graph.seed, graph._builds])
        except VGraphError:  # another structure (or an error a fresh build reports in context)
            cg = None
        if cg is not None:
            cg._build_number = graph._builds
            graph._cache.put(ekey if cg._elastic is not None else key, cg, replayed=True)
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
        graph._cache.put(key if cg._elastic is None else ekey, cg, replayed=known)
    graph.latest_build = cg
    graph._builds += 1
    return cg
