"""The builder: how a VirtualGraph's declared nodes become compute nodes for one feed.

:class:`_Builder` walks a plan (:class:`.plan._Plan`) scope by scope, in declaration order: each
op is added to its graph at once (so its value is there for the loop conditions and branch
selectors that follow), a loop runs its iterations (:meth:`_Builder.run_loop`: node by node, or as
a body program, :mod:`.program`), a branch builds the option its selector picks, a recursion is a
loop over its children array's nodes. A :class:`_Frame` holds one scope's compute nodes in one
iteration path.

Three callers share it, through what it asks of the graph it builds into: the plain unroll
(:func:`.unroll.build_compute_graph`, into an :class:`~.unrolled.UnrolledGraph`), the per-input
builders of a batched build (:mod:`.batch`, into an ``InputView`` whose ``_add_op`` hands each op
to the scheduler) and the recomputation of a checkpointed loop's segments (:mod:`.checkpoint`).
That graph side is: ``_add_op(op, parents, attrs, key, name)``, ``input``, ``parameter`` leaves
through ``add_leaf``, ``constant``, ``guard(nodes, check, key)``, ``_add_copy`` (hoisted rows),
and the records ``decisions``, ``programs``, ``interpreted``, ``_envs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast

import numpy as np

from ..compute import (
    ComputeNode,
    NodeKey,
    next_version,
)
from ..errors import (
    BuildError,
    LoopLimitError,
    ShapeError,
    StructureChangedError,
    StructureError,
)
from ..modes import is_anomaly_enabled, is_grad_enabled
from ..ops import OPS, Op
from .checkpoint import LoopRecord, Rematerializer
from .elastic import Trace
from .graph import VirtualGraph
from .hoist import RowSum, batched_attrs, defer_unread, hoist_loop, row_sums
from .nodes import BranchNode, LoopNode, VirtualNode
from .plan import _Plan
from .program import (
    BodyProgram,
    ProgramInstance,
    ProgramRun,
    _seed_vjp,
    program_for,
    replayed_node_by_node,
    vjp_of,
)
from .rules import at_limit, check_carry, reached_end, run_cond, select_option
from .store import _store_name
from .unrolled import Decision, UnrolledGraph, program_decisions

_GETITEM, _STACK, _HOISTED, _BRANCH = OPS["GetItem"], OPS["Stack"], OPS["Hoisted"], OPS["Branch"]


def _key(fields: tuple[str, int, tuple[int, ...]]) -> NodeKey:
    """``NodeKey(*fields)`` without the named tuple's Python-level ``__new__`` (the hot path of
    unrolling: one key per node)."""
    return tuple.__new__(NodeKey, fields)


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
            programs = not (self.cached and replayed_node_by_node(loop, self.plan))
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
                _read_children(ienv, reads, rows[t], history, defaults)
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
        graded = variant.graded(run)
        least = self._resizable(loop, program, hoisted, run) if seqs or structure else 0
        if least:
            instance.make_resizable(least, values, graded)
        if seqs:
            check = (
                _resizable_length_check(instance) if least else _length_check(loop, idx, cast(int, length))
            )
            cg.guard(seqs, check, NodeKey("LengthCheck", loop.id, idx))
        if structure:
            check = _resizable_structure_check(instance) if least else _structure_check(loop, idx, kids)
            cg.guard(structure, check, NodeKey("StructureCheck", loop.id, idx))
        start = len(cg.decisions)
        cg.decisions += program_decisions(instance, run)
        instance.decisions = (start, len(cg.decisions))
        call = instance.vjp
        vjps = [partial(call, i) if grad else None for i in range(len(init) + len(seqs))]
        vjps += [None] * len(structure)
        vjps += [
            partial(call, len(vjps) + j) if v in needs and graded[j] else None
            for j, v in enumerate(program.captured)
        ]
        op = Op("Loop", instance.rerun, tuple(vjps), arity=len(parents), partial_grads=True)
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

    def _resizable(
        self, loop: LoopNode, program: BodyProgram, hoisted: Sequence[VirtualNode], run: ProgramRun
    ) -> int:
        """The fewest iterations at which a replay may re-run this program instance at another
        length of its sequences or on another tree (0: it may not): its trip count follows from
        them (no ``while_``/``until``; not capped), its hoisted work does not depend on it (no
        hoisted reshape), and a fresh build would hoist the same nodes — which it does at any
        trip count in ``2..max_iters`` if it hoists at all (:meth:`_program_hoists`). Branches
        in the body choose again per iteration, and the replay records their choices anew."""
        if loop.cond is not None or loop.until is not None or run.capped:
            return 0
        if any(cast(Op, v.op).name == "Reshape" for v in hoisted):
            return 0
        least = 2 if self.hoist and program.hoistable else 1
        return least if least <= run.trips <= loop.max_iters else 0

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

    def where() -> str:  # (only a recursion, loop.structure set, has a children array)
        return f"{loop.describe(idx)}: the children array {cast(VirtualNode, loop.structure).describe()}"

    kids = np.asarray(value)
    if kids.ndim != 2 or kids.dtype.kind not in "iu":
        raise StructureError(f"{where()} must be an (N, k) integer array, got {kids.dtype} {kids.shape}")
    if len(kids) == 0:
        raise StructureError(f"{where()} is empty: a structure needs at least one node")
    if len(kids) > loop.max_iters:  # (a recursion's max_iters is its max_nodes)
        raise LoopLimitError(
            f"{where()} has {len(kids)} nodes, more than max_nodes={loop.max_iters}; raise g.recurse's "
            "max_nodes if a structure that large is intended"
        )
    for read in loop.children:
        if read.attrs["slot"] >= kids.shape[1]:
            width = kids.shape[1]
            slots = f"child slots 0..{width - 1}" if width else "no child slot"
            raise StructureError(
                f"{where()} has width {width} ({slots}), but {read.describe()} reads "
                f"slot {read.attrs['slot']} (r.child(..., {read.attrs['slot']})); give every node a "
                "column for each slot read, -1 where it has no such child"
            )
    if length is not None and length != len(kids):
        raise StructureError(f"{where()} has {len(kids)} nodes, but the stepped sequences have {length}")
    bad = (kids < -1) | (kids >= len(kids))
    if bad.any():
        t, j = map(int, np.argwhere(bad)[0])
        raise StructureError(
            f"{where()}: structure node {t} has child {int(kids[t, j])} (slot {j}), out of range "
            f"(valid: -1 for none, or 0..{len(kids) - 1})"
        )
    late = kids >= np.arange(len(kids))[:, None]
    if late.any():
        t, j = map(int, np.argwhere(late)[0])
        c = int(kids[t, j])
        raise StructureError(
            f"{where()}: structure node {t} has child {c} (slot {j}), which does not come before it; "
            "order the nodes children first (a topological order; a structure with a cycle has none)"
        )
    return kids.copy()


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
        return _check_length(loop, idx, length, values)

    return check


def _check_length(loop: LoopNode, idx: tuple[int, ...], length: int, values: Sequence[np.ndarray]) -> int:
    """``length``, if every sequence ``loop`` steps through (``values``) has it.

    Raises:
        StructureChangedError: one has not (the graph's structure no longer fits its inputs).
    """
    for seq, value in zip(loop.sequences, values):
        if np.ndim(value) == 0 or value.shape[0] != length:
            raise StructureChangedError(
                f"{loop.describe(idx)} steps through {seq.describe()}, whose length is now "
                f"{np.shape(value)[:1]} (was {length}); rebuild the compute graph for the new inputs"
            )
    return length


def _resizable_length_check(instance: ProgramInstance) -> Callable[..., int]:
    """The length check of a program instance that a cached build's replay may re-run at
    another length (:meth:`.program.ProgramInstance.takes_length`)."""
    loop, idx = instance.loop, instance.idx

    def check(*values: np.ndarray) -> int:
        if instance.resizing and instance.takes_length(values):
            return cast(int, instance.length)
        return _check_length(loop, idx, cast(int, instance.length), values)

    return check


def _resizable_structure_check(instance: ProgramInstance) -> Callable[..., int]:
    """The structure check of a recursion run as a program that a cached build's replay may
    re-run on another tree (:meth:`.program.ProgramInstance.takes_count`, once
    :func:`_check_structure` has found it well formed); otherwise the tree must be the one its
    run last ran (the build's, or the last replay's)."""
    loop, idx = instance.loop, instance.idx

    def check(value: np.ndarray) -> int:
        if instance.resizing:
            length = instance.length if instance.n_seqs else None  # (its length check's, run first)
            n = len(_check_structure(loop, idx, value, length))
            if instance.takes_count(n):
                return n
        return _structure_check(loop, idx, np.array(cast(ProgramRun, instance.run).kids))(value)

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


def _read_children(
    env: dict[VirtualNode, Any],
    reads: Sequence[tuple[VirtualNode, int, int]],
    row: Sequence[int],
    history: Sequence[Sequence[Any]],
    defaults: Sequence[Any],
) -> None:
    """Put in a tree node's environment what each child read reads: ``(read, carry k, slot)``
    per read, the node's children ``row``, every built node's carries' updates ``history``, and
    the carries' initial values ``defaults`` (what a missing child, ``-1``, reads). Every slot is
    a column of the children array (see :func:`_check_structure`)."""
    for read, k, slot in reads:
        c = row[slot]
        env[read] = history[c][k] if c >= 0 else defaults[k]


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
