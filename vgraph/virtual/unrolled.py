"""The unrolled graph: :class:`UnrolledGraph`, the ComputeGraph of one build of a VirtualGraph —
its outputs, inputs and recorded decisions, the loops that ran as body programs and their nodes'
views, its per-node form, and re-running it (``feed``, the cache's replay). Built by
:mod:`.builder`; :func:`.unroll.build_compute_graph` is the entry point."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np

from ..compute import (
    _ALL,
    ComputeGraph,
    ComputeNode,
    NodeKey,
    _as_value,
    _by_serial,
    computed_ops,
    next_version,
    owned_value,
)
from ..errors import (
    BuildError,
    FeedError,
)
from ..modes import is_anomaly_enabled, no_grad
from ..ops import OPS
from ..tape import ForwardTape, tapes_enabled
from ..workspace import gc_paused
from .cache import SupersededGraph
from .elastic import Elastic
from .graph import VirtualGraph
from .nodes import BranchNode, LoopNode, VirtualNode
from .program import ProgramInstance, ProgramRun

_HOISTED = OPS["Hoisted"]


class Decision(NamedTuple):
    """A data-dependent structural decision made while unrolling (immutable).

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


def find_decision(
    decisions: Sequence[Decision], node: VirtualNode, idx: Sequence[int], kind: str
) -> int | None:
    """The value of the decision of ``kind`` that ``node`` made in iteration path ``idx`` (a
    trip count, an option), or ``None`` if it made none there."""
    idx = tuple(idx)
    for d in decisions:
        if d.node is node and d.idx == idx and d.kind == kind:
            return int(d.value)
    return None


def program_decisions(instance: ProgramInstance, run: ProgramRun) -> list[Decision]:
    """The decisions of a loop instance run as a program, as a build node by node records them:
    its branches' choices iteration by iteration, a cap, its trip count."""
    loop, idx = instance.loop, instance.idx
    choice = instance.variant.choice.items()
    made = [
        Decision(branch, (*idx, t), "option", record[pos])
        for t, record in enumerate(run.records)
        for branch, pos in choice
        if record[pos] >= 0
    ]
    if run.capped:
        made.append(Decision(loop, idx, "capped", run.trips))
    made.append(Decision(loop, idx, "iterations", run.trips))
    return made


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
        from .builder import _Builder, _Frame  # (the builder makes UnrolledGraphs: it sits above)

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

    def _replay(self, values: Mapping[str, np.ndarray], seed: list[int], resize: bool = False) -> None:
        """Recompute every node for new input values, as a fresh build of this structure would:
        in creation order, sampled leaves drawn again (from a generator seeded with ``seed``, made
        only if the graph has any: making one costs about 10 µs) when their turn comes, guards
        re-checking every recorded decision. ``resize``: loops run as programs may take other
        lengths of their sequences or other trees (:meth:`_resizes_by_programs`), and their
        decisions (choices, trip counts) are then recorded anew.

        Raises:
            StructureChangedError: the new values lead to another structure.
        """
        resizing = [p for p in self.programs.values() if p.least] if resize else []
        for instance in resizing:
            instance.resizing = True
        try:
            self._rerun(values, seed)
        finally:
            for instance in resizing:
                instance.resizing = False
        shift = 0  # (their decisions as this replay ran them, in the place the build made them)
        for instance in sorted(resizing, key=lambda p: p.decisions[0]):
            start, stop = instance.decisions[0] + shift, instance.decisions[1] + shift
            made = program_decisions(instance, cast(ProgramRun, instance.run))
            self.decisions[start:stop] = made
            instance.decisions = (start, start + len(made))
            shift += len(made) - (stop - start)

    def _resizes_by_programs(self) -> bool:
        """Whether a replay may run this graph for inputs of other leading lengths: it has loops
        run as programs that may take other lengths of their sequences or other trees
        (:meth:`.program.ProgramInstance.takes_length`, ``takes_count``), and no other loop whose
        length or tree its guards check (a loop run node by node). A cached build keeps it by its
        feed's shapes without their leading axis, as it keeps an elastic graph (:mod:`.elastic`)."""
        resizable = {(loop.id, idx) for (loop, idx), p in self.programs.items() if p.least}
        return bool(resizable) and all(
            g.key.type not in ("LengthCheck", "StructureCheck") or (g.key.id, g.key.idx) in resizable
            for g in self._guards
        )

    def _rerun(self, values: Mapping[str, np.ndarray], seed: list[int]) -> None:
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
        how many loops ran as body programs, and which could not and why."""
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
        return find_decision(self.decisions, loop, idx, "capped") is not None

    def trip_count(self, loop: LoopNode, idx: tuple[int, ...] = ()) -> int:
        """How many iterations ``loop`` ran in iteration path ``idx``."""
        return self._decision(loop, idx, "iterations")

    def choice(self, branch: BranchNode, idx: tuple[int, ...] = ()) -> int:
        """Which option ``branch`` selected in iteration path ``idx``."""
        return self._decision(branch, idx, "option")

    def _decision(self, node: VirtualNode, idx: tuple[int, ...], kind: str) -> int:
        found = find_decision(self.decisions, node, idx, kind)
        if found is None:
            raise BuildError(f"{node.describe(tuple(idx))} was not built in this graph")
        return found


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
