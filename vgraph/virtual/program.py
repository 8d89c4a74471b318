"""Body programs: a loop's or recursion's body compiled once, run over its iterations.

The body of a loop is declared once and its unrolled copies differ only in their data. So instead
of creating a compute node per body node per iteration, a build may compile the body — once per
declared loop and plan — into two Python functions, generated as source and printable with
:func:`vgraph.show_program`:

- a **forward step** ``step(t, carries…, items…, children…, hoisted rows…)`` that computes one
  iteration's body nodes (each op's forward called directly, a branch's selector run on this
  iteration's values and only the chosen option computed) and returns them as one tuple, the
  iteration's *record*;
- a **backward step** that takes a record and the gradients reaching the iteration's outputs
  (its carries' updates, its stacked values) and returns the gradients of its inputs, adding
  those of values from outside the body (weights) into accumulators — lazily, so that a tied
  weight's gradient over all iterations is one stacked product (``ops.RowsProductGrad``).

A run (:class:`ProgramRun`) calls the forward step once per iteration under the loop's rules
(:mod:`.rules`: the same code as the per-node unroll's) and keeps the records; body nodes that
depend on no carried state run once over all iterations first (hoisting, with the rules of
:func:`.hoist.batched_attrs`). In the compute graph the loop instance is one node
``<Loop:id@idx>`` whose value is the run and whose VJP runs the backward steps, plus one node per
loop output (``<Final:…>``, ``<Stack:…>``). A new length, tree or set of choices is a new run of
the same program: no compilation, no per-iteration Python objects beyond the records.

Every unrolled node stays reachable: ``cg.node(v, idx)`` (or its key) makes a view node on demand
whose value is the record's entry (:meth:`ProgramInstance.view`); a view asked to retain its
gradient gets it from the next backward; drawings, the explorer and ``check_vjps`` read
``cg.per_node()``, the same build node by node. Decisions (trip counts, branch choices) are
recorded as a plain unroll records them, and a re-run (``cg.feed`` + ``cg.forward``, a cached
structure's replay) checks that they did not change. A step that raises makes the loop unroll node
by node (which raises the per-node error); a VJP that raises is named from the generated line.

What a program does not cover runs node by node, and says why (``cg.interpreted``, ``repr(cg)``):
checkpointed loops and loops inside them, bodies with nested loops, samples (dropout) or untied
parameters, and builds in anomaly mode (which checks every value as it is made). A batched build
runs the same steps over every input's rows — a loop's once per iteration, a recursion's once per
tree level, with the ops' axis attributes moved by one (``attrs`` of :meth:`BodyProgram.variant`)
— in :mod:`.batch`.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import workspace
from ..compute import ComputeNode, NodeKey, value_summary
from ..errors import BackwardError, BuildError, NonFiniteError, StructureChangedError, VGraphError
from ..modes import is_anomaly_enabled
from ..ops import (
    CELL,
    INLINE_VJPS,
    VJP,
    VJPS_INTO,
    LazyGrad,
    LeadingSumGrad,
    Op,
    OpResultError,
    RowsProductGrad,
    add_grads,
    add_grads_sparse,
    basic_view_index,
    densified,
    forward_into,
    joint_vjp,
    reduce_grad,
    share_rows,
    slab_vjp,
    split_vjp,
)
from .nodes import BranchNode, LoopNode, VirtualNode
from .padded import NO_MASKS, Masking, filled, scaled, zeroed
from .rules import at_limit, check_carry, first_count_stop, reached_end, run_cond, select_option

if TYPE_CHECKING:
    from .plan import _Plan

#: The body node kinds a program computes or takes as inputs; any other kind in a body (a nested
#: loop and its outputs, a sample, an untied parameter) makes the loop run node by node.
_INPUT_KINDS = ("carry", "item", "child")
_COMPUTED_KINDS = ("op", "branch")
_CAPTURED_KINDS = ("parameter", "constant")


def why_not(loop: LoopNode, plan: _Plan) -> str | None:
    """Why ``loop`` cannot run as a body program (``None``: it can)."""
    if loop.checkpoint is not None:
        return "checkpointed (checkpoint=): its values are recomputed by segment, node by node"
    outer = loop.scope
    while outer is not None:
        if outer.checkpoint is not None:
            return f"inside checkpointed {outer.describe()}, whose segments are recomputed node by node"
        outer = outer.scope
    for v in _body(loop, plan):
        if v.kind in _INPUT_KINDS or v.kind in _COMPUTED_KINDS:
            continue
        if v.kind == "parameter" and not v.attrs["share"]:
            return f"{v.describe()} is an untied parameter (one copy per iteration)"
        if v.kind in _CAPTURED_KINDS:
            continue
        if v.kind == "sample":
            return f"{v.describe()} is sampled in every iteration"
        if v.kind in ("loop", "final", "stacked"):
            return f"its body holds a nested loop ({v.describe()})"
        return f"{v.describe()} is a {v.kind} node"
    return None


def fixed_by_shapes(loop: LoopNode, plan: _Plan) -> bool:
    """Whether ``loop``'s structure — its trip count and what each iteration computes — follows
    from the shapes it steps through alone: no ``while_``/``until`` condition, no recursion, no
    branch in its body or in a nested loop's. Found once per plan."""
    found = plan.fixed.get(loop)
    if found is None:
        found = loop.cond is None and loop.until is None and loop.structure is None
        for v in loop.body:
            if not found:
                break
            if isinstance(v, BranchNode):
                found = False
            elif isinstance(v, LoopNode):
                found = fixed_by_shapes(v, plan)
        plan.fixed[loop] = found
    return found


def replayed_node_by_node(loop: LoopNode, plan: _Plan) -> bool:
    """Whether a cached build left to choose (``programs=None``) runs ``loop`` node by node: its
    structure follows from its shapes (:func:`fixed_by_shapes`), so it comes back, and the cache's
    per-node replay repeats it faster than a program (a product fused with the row it is added
    to, a tied weight's uses summed as one product, compiled sweeps) — unless its body computes a
    fused cell (an op of kind ``CELL``: LSTM, GRU), one op per step either way, where a program's
    joint and split VJPs are faster. docs/decisions.md, "Body programs", has the figures."""
    return fixed_by_shapes(loop, plan) and not any(v.op is not None and v.op.kind == CELL for v in loop.body)


def program_for(loop: LoopNode, plan: _Plan) -> BodyProgram | str:
    """``loop``'s body program for ``plan`` (compiled steps are made per run's needs), or why it
    runs node by node; found once per plan."""
    found = plan.programs.get(loop)
    if found is None:
        reason = why_not(loop, plan)
        found = plan.programs[loop] = reason if reason is not None else BodyProgram(loop, plan)
    return cast("BodyProgram | str", found)


def _body(loop: LoopNode, plan: _Plan) -> list[VirtualNode]:
    """The nodes declared directly in ``loop``'s body that a build of ``plan`` may reach, in
    declaration order (a topological order)."""
    return [v for v in loop.graph.nodes if v.scope is loop and v in plan.needed]


class BodyProgram:
    """The compiled body of one declared loop (for one plan): its inputs, the nodes it computes
    and, per set of hoisted nodes and of inputs that need a gradient, its generated steps."""

    def __init__(self, loop: LoopNode, plan: _Plan) -> None:
        self.loop = loop
        body = _body(loop, plan)
        self.eager = set(plan.eager.get(loop, ()))
        # What a body reads from outside: the loop's captures, then tied parameters and constants
        # declared in the body (the same value in every iteration).
        self.computed = [v for v in body if v.kind in _COMPUTED_KINDS]
        self.stacked = plan.stacked.get(loop, [])
        read: set[VirtualNode] = {*loop.updates.values(), *(s.inputs[1] for s in self.stacked)}
        for v in self.computed:
            read.update((*v.keys, *v.options) if isinstance(v, BranchNode) else v.inputs)
        self.captured: list[VirtualNode] = [
            v for v in (*plan.captures[loop], *(v for v in body if v.kind in _CAPTURED_KINDS)) if v in read
        ]
        self.hoistable = [v for v in plan.hoistable.get(loop, ()) if v in self.eager]
        self.finals = plan.finals.get(loop, [])
        self._variants: dict[tuple[Any, ...], _Variant] = {}

    def variant(
        self,
        hoisted: tuple[VirtualNode, ...],
        needs: frozenset[VirtualNode],
        attrs: dict[VirtualNode, dict[str, Any]] | None = None,
        own: tuple[VirtualNode, ...] = (),
        masking: Masking = NO_MASKS,
        ops: dict[VirtualNode, Op] | None = None,
    ) -> _Variant:
        """The steps for a run that hoists ``hoisted`` and needs gradients for the inputs and
        captured values in ``needs`` (compiled on first use). ``attrs``: the attributes body
        nodes' ops run with instead of their declared ones (a program over rows, where an op's
        axes move by one: :func:`.hoist.batched_attrs`). ``own``: captured values each row has
        its own of, read as step inputs after the hoisted nodes, then ``masking``'s masks
        (:mod:`.padded`). ``ops``: the ops body nodes run instead of their declared ones (on
        rows, where no attributes can say it: :func:`.hoist.rows_op`)."""
        key = (
            hoisted,
            needs,
            tuple(sorted((v.id, v.type, repr(a)) for v, a in attrs.items())) if attrs else (),
            own,
            masking,
            tuple(sorted((v.id, v.type, op.name) for v, op in ops.items())) if ops else (),
        )
        found = self._variants.get(key)
        if found is None:
            found = self._variants[key] = _Variant(self, hoisted, needs, attrs or {}, own, masking, ops or {})
        return found


_counter = itertools.count()


class _Variant:
    """One compilation of a body: slot numbers, the generated source and the two steps."""

    def __init__(
        self,
        program: BodyProgram,
        hoisted: tuple[VirtualNode, ...],
        needs: frozenset[VirtualNode],
        attrs: dict[VirtualNode, dict[str, Any]],
        own: tuple[VirtualNode, ...] = (),
        masking: Masking = NO_MASKS,
        ops: dict[VirtualNode, Op] | None = None,
    ):
        loop = program.loop
        self._ops = ops or {}  # (see BodyProgram.variant)
        self.program = program
        self.hoisted = hoisted
        self._attrs = attrs  # (see BodyProgram.variant)
        self.own = own
        self._pre = {v: (key, value, vjp) for v, key, value, vjp in masking.pre}
        self._post, self._gmask = dict(masking.post), dict(masking.grad)
        self._scale = {v: (out, into) for v, out, into in masking.scale}
        # Slots: the record's entries. Inputs first (carries, items, child reads, hoisted rows,
        # per-row captured values, masks), then every computed node, then each lead branch's choice.
        inputs: list[Any] = [*loop.carries, *loop.items, *loop.children, *hoisted, *own, *masking.keys]
        hoisted_set = set(hoisted)
        computed = [v for v in program.computed if v not in hoisted_set]
        self.slot: dict[Any, int] = {}
        for v in (*inputs, *computed):
            self.slot[v] = len(self.slot)
        self.choice: dict[BranchNode, int] = {}
        for v in computed:
            if isinstance(v, BranchNode) and v.lead is None:
                self.choice[v] = len(self.slot) + len(self.choice)
        self.size = len(self.slot) + len(self.choice)
        self.inputs = inputs
        self.computed = computed
        self.captured = {v: j for j, v in enumerate(program.captured)}
        # Per captured value, the slots that read it with a VJP; ``None``: read so in every
        # iteration (an unconditional node, a carry's update, a stacked value, a hoisted node).
        self.grad_readers: list[list[int] | None] = [[] for _ in program.captured]
        # The captured values whose gradient the backward steps give (not only hoisted nodes).
        self.stepped_captured: set[VirtualNode] = set()
        sources = {*loop.updates.values(), *(s.inputs[1] for s in program.stacked)}
        for u in sources:
            if u in self.captured and u not in self.slot:
                self.grad_readers[self.captured[u]] = None
                self.stepped_captured.add(u)
        for v in (*hoisted, *computed):
            if isinstance(v, BranchNode):
                reads = [(u, True) for u in v.options]
            else:
                op = cast(Op, v.op)
                reads = [(u, vjp_of(op, p) is not None) for p, u in enumerate(v.inputs)]
            for u, differentiable in reads:
                j = self.captured.get(u) if u not in self.slot else None
                readers = self.grad_readers[j] if j is not None else None
                if differentiable and j is not None and v not in hoisted_set:
                    self.stepped_captured.add(u)
                if not differentiable or readers is None:
                    continue
                if v in hoisted_set or v in program.eager:
                    self.grad_readers[cast(int, j)] = None
                else:
                    readers.append(self.slot[v])
        self.needs = needs
        self.grad_slots = self._grad_slots(needs)
        # The slots a whole loop's run writes into one buffer per run, a row per iteration (ops
        # whose forward takes out=: ops.forward_into), and the slots that are basic views of
        # another's value (slot -> (its input's slot, the index of the iterations' stack of
        # the views in the stack of that input's values)).
        self.into: set[VirtualNode] = set()
        self.view_of: dict[int, tuple[int, tuple[Any, ...]]] = {}
        for v in computed:
            if isinstance(v, BranchNode):
                continue
            index = basic_view_index(self.op(v), self.attrs(v))
            if index is not None and v.inputs[0] in self.slot:
                items = index if isinstance(index, tuple) else (index,)
                self.view_of[self.slot[v]] = (self.slot[v.inputs[0]], (slice(None), *items))
            elif self._runs_whole() and forward_into(self.op(v)) and not self._masked(v):
                self.into.add(v)
        self.forward_source, fwd_env = self._forward_source()
        self.back_lines: dict[int, tuple[VirtualNode, int]] = {}
        self.backward_source, bwd_env = self._backward_source()
        forward = _compile(self.forward_source, fwd_env, loop)
        self._make_step = forward["make_step"]
        self._make_run: Callable[..., Any] | None = forward.get("make_run")
        backward = _compile(self.backward_source, bwd_env, loop)
        self._make_back = backward["make_back"]
        self._make_sweep: Callable[..., Any] | None = backward.get("make_sweep")
        self.back_file = self._make_back.__code__.co_filename

    # -- analysis
    def _grad_slots(self, needs: frozenset[VirtualNode]) -> set[VirtualNode]:
        """The slots a gradient can reach an input that needs one through: those that depend on
        a needing input or captured value along inputs with a VJP (carries, read in the next
        iteration, to a fixed point)."""
        loop = self.program.loop
        grad: set[VirtualNode] = {v for v in self.inputs if v in needs}
        changed = True
        while changed:
            changed = False
            for v in self.computed:
                if v in grad:
                    continue
                if self._reads_grad(v, grad, needs):
                    grad.add(v)
                    changed = True
            for c in loop.carries:  # a carry needs one if its update does (the next iteration reads it)
                u = loop.updates[c]
                if c not in grad and (u in grad or u in needs):
                    grad.add(c)
                    changed = True
            for r in loop.children:
                if r not in grad and r.inputs[0] in grad:
                    grad.add(r)
                    changed = True
        return grad

    def _reads_grad(self, v: VirtualNode, grad: set[VirtualNode], needs: frozenset[VirtualNode]) -> bool:
        if isinstance(v, BranchNode):
            return any(o in grad or o in needs for o in v.options)
        op = cast(Op, v.op)
        return any(vjp_of(op, p) is not None and (u in grad or u in needs) for p, u in enumerate(v.inputs))

    def failed_vjp(self, e: Exception) -> tuple[VirtualNode, int] | None:
        """The body node and input whose VJP raised ``e`` in a backward step (found from the
        generated line its traceback passes through), or ``None`` if no VJP raised it."""
        where = None
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.back_file:
                where = self.back_lines.get(tb.tb_lineno)
            tb = tb.tb_next
        return where

    def graded(self, run: ProgramRun) -> list[bool]:
        """Per captured value, whether ``run`` reads it where a gradient can flow back (an option
        not chosen in any iteration does not read it, as in the per-node unroll)."""
        out = []
        for readers in self.grad_readers:
            if readers is None:
                out.append(run.trips > 0)
            else:
                out.append(any(r[i] is not None for i in readers for r in run.records))
        return out

    def attrs(self, v: VirtualNode) -> dict[str, Any]:
        """The attributes body node ``v``'s op runs with in these steps."""
        return self._attrs.get(v, v.attrs)

    def op(self, v: VirtualNode) -> Op:
        """The op body node ``v`` runs in these steps (its declared one, or one over rows)."""
        return self._ops.get(v) or cast(Op, v.op)

    def _masked(self, v: VirtualNode) -> bool:
        """Whether ``v``'s input or value is filled, zeroed or scaled around its op (:mod:`.padded`)."""
        return v in self._pre or v in self._post or v in self._scale

    def _name(self, u: VirtualNode) -> str:
        if u in self.slot:
            return f"s{self.slot[u]}"
        if u in self.captured:
            return f"k{self.captured[u]}"
        raise AssertionError(f"{u.describe()} is neither a slot nor captured")

    # -- the forward step
    def _forward_source(self) -> tuple[str, dict[str, Any]]:
        """``make_step`` (one iteration: ``step(t, inputs…)`` returns its record) and, for a loop
        (not a recursion) whose every input is a carry or an iteration's row, ``make_run``: the
        iterations themselves, the step's lines inlined in the loop (see :meth:`_run_lines`)."""
        env: dict[str, Any] = {}
        args = ", ".join(f"s{self.slot[v]}" for v in self.inputs)
        caps = ", ".join(f"k{j}" for j in range(len(self.captured)))
        body: list[str] = []
        eager = self.program.eager
        later = [v for v in self.computed if v not in eager]
        if later:
            body.append(" = ".join(f"s{self.slot[v]}" for v in later) + " = None")
        for ch in self.choice.values():
            body.append(f"s{ch} = -1")
        run_body = list(body)
        built: set[VirtualNode] = set(self.inputs)
        for v in self.computed:
            if v in eager:
                self._emit(v, body, env, "", built, guard=False)
                self._emit(v, run_body, env, "", built, guard=False, into=self.into)
                built.add(v)
        record = f"({', '.join(f's{i}' for i in range(self.size))},)"
        lines = [f"def make_step(SELECT, {caps}):" if caps else "def make_step(SELECT):"]
        lines.append(f"    def step(t{', ' + args if args else ''}):")
        lines += [f"        {line}" for line in body]
        lines.append(f"        return {record}")
        lines.append("    return step")
        lines += self._run_lines(run_body, record, caps)
        return "\n".join(lines) + "\n", env

    def _run_lines(self, body: list[str], record: str, caps: str) -> list[str]:
        """``make_run(SELECT, CHECK, INTO, k…)`` → ``run(t, check_at, RECORDS, STOP, UNTIL,
        carries…, SEQ<slot>…)``: from iteration ``t`` on, each iteration's record appended to
        ``RECORDS`` and its carries updated, until ``STOP(t, carries…)`` (asked from iteration ``check_at``
        on: the loop rules before an iteration) or ``UNTIL(t, carries…)`` (after one, if given)
        says so; returns the iterations run and the carries. ``SEQ<slot>``: the rows of a
        stepped item or hoisted node, by iteration. A carry whose update changes its shape or
        dtype goes to ``CHECK(t, k, old, new)`` (which raises, or allows a first update that
        widens it). A slot of :attr:`into` is computed into row ``t`` of its buffer ``O<slot>``,
        which ``INTO(slot, t, value)`` makes from the first value (``(buffer, buffer[t])``, or a
        stand-in whose rows are ``None``). The same lines as the step's, without a call and a
        record per iteration handed back and forth: what the driver runs where it can (none for
        a recursion, whose children's rows the driver gathers, nor on rows of a batch)."""
        loop = self.program.loop
        if not self._runs_whole():
            return []
        carries = [f"s{self.slot[c]}" for c in loop.carries]
        stepped = [self.slot[v] for v in (*loop.items, *self.hoisted)]
        state = ", ".join(carries) + ("," if len(carries) == 1 else "")
        params = ["t", "check_at", "RECORDS", "STOP", "UNTIL", *carries, *(f"SEQ{i}" for i in stepped)]
        lines = ["", f"def make_run(SELECT, CHECK, INTO{', ' + caps if caps else ''}):"]
        lines.append(f"    def run({', '.join(params)}):")
        if self.into:
            lines.append("        " + " = ".join(f"O{self.slot[v]}" for v in self.into) + " = None")
        lines.append("        while True:")
        lines.append(f"            if t >= check_at and STOP(t, {state}):")
        lines.append("                break")
        lines += [f"            s{i} = SEQ{i}[t]" for i in stepped]
        lines += [f"            {line}" for line in body]
        lines.append(f"            RECORDS.append({record})")
        news = [self._name(loop.updates[c]) for c in loop.carries]
        for k, (old, new) in enumerate(zip(carries, news)):
            lines.append(f"            if {new}.shape != {old}.shape or {new}.dtype != {old}.dtype:")
            lines.append(f"                CHECK(t, {k}, {old}, {new})")
        if carries:  # (all at once: an update may read another carry's old value)
            lines.append(f"            {', '.join(carries)} = {', '.join(news)}")
        lines.append("            t += 1")
        lines.append(f"            if UNTIL is not None and UNTIL(t - 1, {state}):")
        lines.append("                break")
        lines.append(f"        return t, ({state})")
        lines.append("    return run")
        return lines

    def _emit(
        self,
        v: VirtualNode,
        lines: list[str],
        env: dict[str, Any],
        pad: str,
        built: set[VirtualNode],
        guard: bool,
        into: set[VirtualNode] | frozenset[VirtualNode] = frozenset(),
    ) -> None:
        """Emit the computation of ``v`` (a guard ``if sN is None`` where it may be built already
        in this iteration, by an option chosen before); a node of ``into`` into its buffer's row
        (see :meth:`_run_lines`)."""
        i = self.slot[v]
        if guard:
            lines.append(f"{pad}if s{i} is None:")
            pad += "    "
        if isinstance(v, BranchNode):
            lead = v if v.lead is None else v.lead
            ch = self.choice[lead]
            if v.lead is None:
                keys = ", ".join(self._name(k) for k in v.keys)
                env[f"sel{i}"] = v
                lines.append(f"{pad}s{ch} = SELECT(sel{i}, t, ({keys}{',' if v.keys else ''}))")
            for k, option in enumerate(v.options):
                lines.append(f"{pad}{'if' if k == 0 else 'elif'} s{ch} == {k}:")
                for u in self._demand(option, built):
                    self._emit(u, lines, env, pad + "    ", built, guard=True, into=into)
                lines.append(f"{pad}    s{i} = {self._name(option)}")
            return
        op, attrs = self.op(v), self.attrs(v)
        index = basic_view_index(op, attrs)
        if index is not None:  # a view (what GetItem's forward does, without the call)
            env[f"x{i}"] = index
            lines.append(f"{pad}s{i} = {self._name(v.inputs[0])}[x{i}]")
            return
        env[f"f{i}"] = partial(op.forward, **attrs) if attrs else op.forward
        names = [self._name(u) for u in v.inputs]
        if v in self._pre:  # (a softmax along a padded axis: its padding -inf)
            names[0] = self._filled(v, names[0], env)
        if v in into:
            lines.append(f"{pad}if O{i} is None:")
            lines.append(f"{pad}    O{i}, s{i} = INTO({i}, t, f{i}({', '.join(names)}))")
            lines.append(f"{pad}else:")
            lines.append(f"{pad}    s{i} = f{i}({', '.join(names)}, out=O{i}[t])")
            return
        lines.append(f"{pad}s{i} = f{i}({', '.join(names)})")
        if v in self._post:  # (a padded result's padding zeroed)
            env["ZEROED"] = zeroed
            lines.append(f"{pad}s{i} = ZEROED(s{i}, s{self.slot[self._post[v]]})")
        if v in self._scale:  # (a mean along a padded axis: over each row's own length)
            env["SCALED"] = scaled
            lines.append(f"{pad}s{i} = SCALED(s{i}, s{self.slot[self._scale[v][0]]})")

    def _filled(self, v: VirtualNode, name: str, env: dict[str, Any]) -> str:
        """The expression of ``v``'s first input ``name`` with its padding filled (:mod:`.padded`)."""
        key, value, _ = self._pre[v]
        env["FILLED"], env[f"fill{self.slot[v]}"] = filled, value
        return f"FILLED({name}, s{self.slot[key]}, fill{self.slot[v]})"

    def _demand(self, target: VirtualNode, built: set[VirtualNode]) -> list[VirtualNode]:
        """The computed nodes ``target`` needs that are not built unconditionally, in
        declaration order (the order of ``self.computed``)."""
        need: set[VirtualNode] = set()
        stack = [target]
        while stack:
            u = stack.pop()
            if u in need or u in built or u not in self.slot or u in self.inputs:
                continue
            need.add(u)
            if isinstance(u, BranchNode):
                stack.extend(u.keys)
                if u.lead is not None:
                    stack.append(u.lead)
                # options are demanded by the branch's own arms
            else:
                stack.extend(u.inputs)
        return [v for v in self.computed if v in need]

    # -- the backward step
    def _backward_source(self) -> tuple[str, dict[str, Any]]:
        """``back(KEEP, record, g_updates…, g_stacked…, parts…, rows…)`` returns the gradients of
        the inputs' slots (``None`` where none reached); captured values' gradients go to their
        collectors ``A<j>`` (:class:`_Acc`). ``parts``: per slot of :attr:`prepped`, this
        iteration's records-only part of its split VJP (``None`` or left out: the joint VJP is called whole). ``rows``: per hoisted
        node of :attr:`rowed`, this iteration's row of the buffer its gradient is collected in
        (``None`` or left out: none); the step copies the gradient into it and returns the row."""
        loop = self.program.loop
        env: dict[str, Any] = {
            "LazyGrad": LazyGrad,
            "ndarray": np.ndarray,
            "ADD": add_grads,
            "RED": _reduce,
            "REDLEAF": _reduce_leaf,
            "ZEROS": np.zeros,
            "INTO": _into_row,
            "INTO_J": _into_row_joint,
            "SLABS": SLABS,
            "RowsProductGrad": RowsProductGrad,
            "LeadingSumGrad": LeadingSumGrad,
        }
        grad = self.grad_slots
        caps = ", ".join(
            [*(f"k{j}" for j in range(len(self.captured))), *(f"A{j}" for j in range(len(self.captured)))]
        )
        seeds = [f"u{k}" for k in range(len(loop.carries))] + [
            f"q{k}" for k in range(len(self.program.stacked))
        ]
        # Per slot whose op's joint VJP splits (ops.split_vjp), the part read from the records
        # alone, computed once over the iterations (ProgramInstance.backward) and handed in as an
        # argument p<n> (None: not computed; the step then calls the joint VJP whole).
        self.prepped: list[tuple[int, Callable[..., tuple[np.ndarray, ...]]]] = []
        prep_arg: dict[VirtualNode, str] = {}
        for v in self.computed:
            split = split_vjp(cast(Op, v.op)) if v in grad and not isinstance(v, BranchNode) else None
            if split is not None and len(self._wanted(v)) > 1:
                prep_arg[v] = f"p{len(self.prepped)}"
                self.prepped.append((self.slot[v], split[0]))
        seeds += [f"{name}=None" for name in prep_arg.values()]  # (a caller may leave them out)
        routes = self._route_counts()
        # Per hoisted node, whether the steps give it a gradient (else it gets one, if any, from
        # another hoisted node's VJP after the sweep).
        self.stepped_grads = [v in grad and routes[v] > 0 for v in self.hoisted]
        # The hoisted nodes whose gradient one place of the step gives: the step writes it into
        # the row it is handed. (Where several add up, their sum is not the first one's row, which
        # that one's other readers may hold: the driver copies the sum in.)
        self.rowed = [h for h, v in enumerate(self.hoisted) if v in grad and routes[v] == 1]
        self._row_arg = {self.hoisted[h]: f"o{k}" for k, h in enumerate(self.rowed)}
        seeds += [f"{name}=None" for name in self._row_arg.values()]
        early = self._early_rows(routes)
        lines = [f"def make_back({caps}):" if caps else "def make_back():"]
        lines.append(f"    def back(KEEP, r{', ' + ', '.join(seeds) if seeds else ''}):")
        record = ", ".join(f"s{i}" for i in range(self.size))
        lines.append(f"        ({record},) = r")
        # seeds: the gradient of each carry's update and of each stacked value
        outs = [(loop.updates[c], f"u{k}") for k, c in enumerate(loop.carries)]
        outs += [(s.inputs[1], f"q{k}") for k, s in enumerate(self.program.stacked)]
        buffered = self._buffered(outs)
        slabbed = self._slabbed(buffered, early)
        slots = [v for v in (*self.inputs, *self.computed) if v in grad]
        # (every slot's gradient, and a slabbed slot's per slab)
        slabs = [f"g{self.slot[u]}_{j}" for u, (indices, _) in slabbed.items() for j in range(len(indices))]
        cleared = "".join(f"{name} = " for name in [*(f"g{self.slot[v]}" for v in slots), *slabs]) + "None"
        if slots:
            lines.append(f"        {cleared}")
        for u, g in outs:
            self._route(u, g, lines, "        ", env)
        for v in reversed(self.computed):
            if v not in grad:
                continue
            i = self.slot[v]
            lines.append(f"        if g{i} is not None:")
            pad = "            "
            if isinstance(v, BranchNode):
                lead = v if v.lead is None else v.lead
                ch = self.choice[lead]
                for k, option in enumerate(v.options):
                    lines.append(f"{pad}{'if' if k == 0 else 'elif'} s{ch} == {k}:")
                    self._route(option, f"g{i}", lines, pad + "    ", env)
                continue
            if v not in slabbed:  # (a slabbed slot's gradient is SLABS: its slabs' are g<i>_<j>)
                lines.append(f"{pad}if type(g{i}) is not ndarray and isinstance(g{i}, LazyGrad):")
                lines.append(f"{pad}    g{i} = g{i}.dense()")
            if v in early:  # (the row its gradient becomes, read from here on: see _early_rows)
                lines.append(f"{pad}g{i} = INTO({early[v]}, g{i})")
            if v in self._gmask:  # (a padded node's: nothing from its padding reaches a real entry)
                env["ZEROED"] = zeroed
                lines.append(f"{pad}g{i} = ZEROED(g{i}, s{self.slot[self._gmask[v]]})")
            op, attrs = self.op(v), self.attrs(v)
            index = basic_view_index(op, attrs)
            if index is not None and v.inputs[0] in slabbed:  # its gradient is its slab's
                k, j = self.slot[v.inputs[0]], slabbed[v.inputs[0]][0].index(index)
                lines.append(f"{pad}g{k}_{j} = g{i} if g{k}_{j} is None else ADD(g{k}_{j}, g{i})")
                lines.append(f"{pad}g{k} = SLABS")
                for n in range(2):
                    self.back_lines[len(lines) - n] = (v, 0)
                continue
            if index is not None and v.inputs[0] in buffered:  # its gradient added into the buffer
                k = self.slot[v.inputs[0]]
                env[f"x{i}"] = index
                lines.append(f"{pad}if g{k} is None:")
                lines.append(f"{pad}    g{k} = ZEROS(s{k}.shape, g{i}.dtype)")
                lines.append(f"{pad}g{k}[x{i}] += g{i}")
                for n in range(3):
                    self.back_lines[len(lines) - n] = (v, 0)
                continue
            names = [self._name(u) for u in v.inputs]
            if v in self._pre and self._pre[v][2]:  # (a maximum's VJP reads its filled input)
                names[0] = self._filled(v, names[0], env)
            args = ", ".join(names)
            wanted = self._wanted(v)
            joint = joint_vjp(op) if len(wanted) > 1 else None
            if v in slabbed:  # one call for all the inputs' gradients, from its slabs'
                with_slabs = slabbed[v][1]
                env[f"v{i}"] = partial(with_slabs, **attrs) if attrs else with_slabs
                given = ", ".join(f"g{i}_{j}" for j in range(len(slabbed[v][0])))
                row = self._row_arg.get(v.inputs[0])  # (input 0's gradient written into its row)
                out_arg = f", out={row}" if row is not None else ""
                lines.append(f"{pad}J = v{i}({prep_arg.get(v, 'None')}, ({given},), s{i}, {args}{out_arg})")
                self.back_lines[len(lines)] = (v, wanted[0])
                for p in wanted:
                    if v.inputs[p] in self._row_arg:
                        lines.append(f"{pad}J = INTO_J(J, {p}, {self._row_arg[v.inputs[p]]})")
            elif joint is not None:  # one call for all the inputs' gradients
                env[f"j{i}"] = partial(joint, **attrs) if attrs else joint
                if v in prep_arg:
                    with_part = cast(tuple[Any, Callable[..., Any]], split_vjp(op))[1]
                    env[f"w{i}"] = partial(with_part, **attrs) if attrs else with_part
                    part = prep_arg[v]
                    lines.append(
                        f"{pad}J = j{i}(g{i}, s{i}, {args}) if {part} is None else w{i}({part}, g{i}, s{i}, {args})"
                    )
                else:
                    lines.append(f"{pad}J = j{i}(g{i}, s{i}, {args})")
                self.back_lines[len(lines)] = (v, wanted[0])
                for p in wanted:  # (before any input's gradient is routed: all read the row)
                    if v.inputs[p] in self._row_arg:
                        lines.append(f"{pad}J = INTO_J(J, {p}, {self._row_arg[v.inputs[p]]})")
            for p in wanted:
                u = v.inputs[p]
                f = cast(VJP, vjp_of(op, p))
                # a weight's or a bias's next use in the loop: collected as the engine's sweeps
                # collect it (ops.INLINE_VJPS), without making a lazy gradient to merge
                leaf = u.kind == "parameter" and not u.attrs.get("sparse_grad") and u not in self.slot
                inline = INLINE_VJPS.get(f) if joint is None and v not in self._scale else None
                at, first = pad, len(lines)
                if inline == "rows product" and leaf and u in self.needs and p == 1:
                    # (_matmul_vjp_b's hot path and RowsProductGrad.merge, written out)
                    acc, a, b = f"A{self.captured[u]}.g", names[0], names[1]
                    lines.append(
                        f"{pad}if type({acc}) is RowsProductGrad and {a}.ndim == 2 and {b}.ndim == 2:"
                    )
                    lines.append(f"{pad}    {acc}.a.append({a})")
                    lines.append(f"{pad}    {acc}.g.append(g{i})")
                    lines.append(f"{pad}else:")
                    at = pad + "    "
                into = VJPS_INTO.get(f) if joint is None and routes[u] == 1 else None
                if joint is not None:
                    lines.append(f"{at}d = J[{p}]")
                elif inline == "pass":
                    lines.append(f"{at}d = g{i}")
                elif into is not None and u in early:  # (u's only gradient, the row's: _early_rows)
                    env[f"b{i}_{p}"] = partial(f, **attrs) if attrs else f
                    env[f"i{i}_{p}"] = partial(into, **attrs) if attrs else into
                    lines.append(f"{at}d = i{i}_{p}({early[u]}, g{i}, s{i}, {args})")
                    lines.append(f"{at}if d is None:")
                    lines.append(f"{at}    d = b{i}_{p}(g{i}, s{i}, {args})")
                else:
                    env[f"b{i}_{p}"] = partial(f, **attrs) if attrs else f
                    lines.append(f"{at}d = b{i}_{p}(g{i}, s{i}, {args})")
                lines.append(f"{at}if d.shape != {self._name(u)}.shape:")
                # a parameter's broadcast contributions are summed once, when all are in (as the
                # per-node sweep sums a leaf's: ops.LeadingSumGrad)
                if leaf and u in self.needs:  # (LeadingSumGrad.merge, written out)
                    acc = f"A{self.captured[u]}"
                    lines.append(f"{at}    if not (type({acc}.g) is LeadingSumGrad and {acc}.g.absorb(d)):")
                    lines.append(f"{at}        {acc}.add(REDLEAF(d, {self._name(u)}.shape))")
                    lines.append(f"{at}else:")
                    lines.append(f"{at}    {acc}.add(d)")
                    for n in range(first, len(lines)):  # (1-based: naming the node in an error)
                        self.back_lines[n + 1] = (v, p)
                    continue
                red = "REDLEAF" if leaf else "RED"
                lines.append(f"{at}    d = {red}(d, {self._name(u)}.shape)")
                if v in self._scale:  # (a mean along a padded axis: its input's rows by their own length)
                    env["SCALED"] = scaled
                    lines.append(f"{at}d = SCALED(d, s{self.slot[self._scale[v][1]]})")
                for n in range(first, len(lines)):  # (1-based: naming the node in an error)
                    self.back_lines[n + 1] = (v, p)
                self._route(u, "d", lines, at, env)
        body_at = 3 if slots else 2  # (the step's lines after the record's unpacking)
        body = lines[body_at:]
        back = ", ".join(f"g{self.slot[v]}" if v in grad else "None" for v in self.inputs)
        every = ", ".join(self._kept(v, slabbed, env) for v in (*self.inputs, *self.computed))
        lines.append("        if KEEP:  # every slot's gradient too (views that retain theirs)")
        lines.append(f"            return ({back}{',' if self.inputs else ''}), ({every},)")
        lines.append(f"        return ({back}{',' if self.inputs else ''})")
        lines.append("    return back")
        self._sweep_lines(lines, body, body_at, caps, record, cleared, env)
        return "\n".join(lines) + "\n", env

    def _sweep_lines(
        self,
        lines: list[str],
        body: list[str],
        body_at: int,
        caps: str,
        record: str,
        cleared: str,
        env: dict[str, Any],
    ) -> None:
        """Append ``make_sweep(k…, A…, VJPERR)`` → ``sweep(T, RECORDS, u…, Q…, P…, O…, H…, ITEM)``
        to ``lines``: the backward steps of iterations ``T - 1`` down to ``0`` of a loop (not a
        recursion), the step's lines inlined, each iteration's carry gradients the next one's
        seeds ``u``; returns what reaches iteration 0's carries. ``Q<k>``: a stacked value's
        gradient rows (or ``None``); ``P<n>``: a split VJP's parts (:class:`_Parts`); ``O<k>``:
        a hoisted node's buffer rows; ``H<h>``: the collector of each hoisted node whose
        gradient the steps give (:class:`_HoistedGrad`); ``ITEM(i, t, g)`` takes a stepped
        item's gradient. An exception from a VJP becomes ``VJPERR(e, t)`` (:meth:`failed_vjp`
        finds the node by these lines too). What the driver runs where nothing retains a body
        node's gradient (no ``KEEP``) and anomaly mode is off."""
        loop = self.program.loop
        if not self._runs_whole():
            return
        grad = self.grad_slots
        carries = [f"u{k}" for k in range(len(loop.carries))]
        stacked = range(len(self.program.stacked))
        parts = range(len(self.prepped))
        rowed = range(len(self.rowed))
        collected = [h for h, stepped in enumerate(self.stepped_grads) if stepped]
        env["VGraphError"] = VGraphError
        params = ["T", "RECORDS", *carries, *(f"Q{k}" for k in stacked), *(f"P{n}" for n in parts)]
        params += [*(f"O{k}" for k in rowed), *(f"H{h}" for h in collected), "ITEM"]
        lines.append("")
        lines.append(f"def make_sweep({caps + ', ' if caps else ''}VJPERR):")
        lines.append(f"    def sweep({', '.join(params)}):")
        lines.append("        for t in range(T - 1, -1, -1):")
        # (the previous iteration's gradients let go first, as a step's are when it returns: before
        # a new block of parts is computed)
        lines.append(f"            d = J = {cleared}")
        lines.append(f"            ({record},) = RECORDS[t]")
        lines += [f"            q{k} = None if Q{k} is None else Q{k}[t]" for k in stacked]
        for n in parts:  # (the previous part let go before the next is asked for: see _Parts.at)
            lines += [f"            p{n} = None", f"            p{n} = P{n}.at(t)"]
        lines += [f"            o{k} = O{k}[t]" for k in rowed]
        lines.append("            try:")
        start = len(lines)
        lines += [f"        {line}" for line in body]
        for n in range(len(body)):  # (1-based line numbers of the same VJP calls, moved)
            where = self.back_lines.get(body_at + n + 1)
            if where is not None:
                self.back_lines[start + n + 1] = where
        lines.append("            except VGraphError:")
        lines.append("                raise")
        lines.append("            except Exception as e:")
        lines.append("                raise VJPERR(e, t) from e")
        for k, c in enumerate(loop.carries):
            lines.append(f"            u{k} = {f'g{self.slot[c]}' if c in grad else 'None'}")
        for i, item in enumerate(loop.items):
            if item in grad:
                g = f"g{self.slot[item]}"
                lines.append(f"            if {g} is not None:")
                lines.append(f"                ITEM({i}, t, {g})")
        for h in collected:
            v = self.hoisted[h]
            lines.append(f"            H{h}.put(t, {f'g{self.slot[v]}' if v in grad else 'None'})")
        lines.append(f"        return ({', '.join(carries)}{',' if carries else ''})")
        lines.append("    return sweep")

    def _runs_whole(self) -> bool:
        """Whether the driver can hand the iterations to generated code (``make_run``,
        ``make_sweep``): a loop whose every step input is a carry, a stepped item or a hoisted
        node's row — not a recursion (children gathered per tree node) nor rows of a batch."""
        loop = self.program.loop  # (no child reads, per-row values or masks among the inputs)
        return len(self.inputs) == len(loop.carries) + len(loop.items) + len(self.hoisted)

    def _early_rows(self, routes: Counter[VirtualNode]) -> dict[VirtualNode, str]:
        """Per computed node whose gradient passes unchanged to a hoisted node's row (``h`` in
        ``tanh(h + s @ W + b)``: through additions, each the only place its input's gradient comes
        from), the argument naming that row: the step copies the node's gradient into the row as
        soon as it is complete, and what reads it from there on (the bias's and the tied weight's
        collectors, the hoisted node) reads the row. So the collectors' rows are the rows of one
        buffer, which they read as their stack without stacking them (``ops.share_rows``)."""
        readers: dict[VirtualNode, list[tuple[VirtualNode, int]]] = {}
        for v in self.computed:
            if v in self.grad_slots and not isinstance(v, BranchNode):
                for p in self._wanted(v):
                    readers.setdefault(v.inputs[p], []).append((v, p))
        early: dict[VirtualNode, str] = {}
        for h, row in self._row_arg.items():
            top = h
            while routes[top] == 1 and len(readers.get(top, ())) == 1:
                ((v, p),) = readers[top]
                f = vjp_of(self.op(v), p)
                if (
                    INLINE_VJPS.get(f) != "pass"
                    or (len(self._wanted(v)) > 1 and joint_vjp(self.op(v)) is not None)
                    or v in self._scale
                    or v in self._gmask
                    or v in self._pre
                ):
                    break
                top = v
            if top is not h:
                early[top] = row
        return early

    def _wanted(self, v: VirtualNode) -> list[int]:
        """The inputs of op node ``v`` whose gradient the backward step computes."""
        op = cast(Op, v.op)
        return [
            p
            for p, u in enumerate(v.inputs)
            if vjp_of(op, p) is not None and (u in self.grad_slots or u in self.needs)
        ]

    def _route_counts(self) -> Counter[VirtualNode]:
        """Per slot, at how many places the backward step adds a gradient to it (each runs at
        most once per iteration): a carry's update or a stacked value, a branch's option, an op's
        input."""
        loop, grad = self.program.loop, self.grad_slots
        counts: Counter[VirtualNode] = Counter(loop.updates[c] for c in loop.carries)
        counts.update(s.inputs[1] for s in self.program.stacked)
        for v in self.computed:
            if v not in grad:
                continue
            if isinstance(v, BranchNode):
                counts.update(v.options)
            else:
                counts.update(v.inputs[p] for p in self._wanted(v))
        return counts

    def _buffered(self, seeds: list[tuple[VirtualNode, str]]) -> dict[VirtualNode, list[Any]]:
        """The computed slots whose gradient comes only from basic-index views of them
        (``ops.basic_view_index``: the outputs of a fused cell, ``h'`` and ``c'``), with the
        indices of those views: the backward step adds those views' gradients into one zero
        buffer it allocates, instead of collecting lazy indexed gradients and laying them into
        zeros when the slot's turn comes (the same additions, in the same order)."""
        grad = self.grad_slots
        views: dict[VirtualNode, list[Any]] = {}
        other = {u for u, _ in seeds}
        for v in self.computed:
            if v not in grad:
                continue
            if isinstance(v, BranchNode):
                other.update(v.options)
                continue
            op = cast(Op, v.op)
            index = basic_view_index(op, self.attrs(v))
            for p, u in enumerate(v.inputs):
                if vjp_of(op, p) is not None and u in grad:
                    if index is None:
                        other.add(u)
                    else:
                        views.setdefault(u, []).append(index)
        computed = set(self.computed)
        return {u: read for u, read in views.items() if u not in other and u in computed}

    def _slabbed(
        self, buffered: dict[VirtualNode, list[Any]], early: dict[VirtualNode, str]
    ) -> dict[VirtualNode, tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]]]:
        """The buffered slots (:meth:`_buffered`) whose op's joint VJP takes their views'
        gradients as they are (``ops.slab_vjp``: a fused LSTM cell's ``h'`` and ``c'``), with the
        slabs it takes: every view of them is an integer index of one of those slabs, and more
        than one input wants a gradient. The backward step keeps each slab's gradient (the sum of
        its views', in the same order) and passes them to that VJP, where the buffer would be
        zeros with the views' gradients added in (which the VJP then reads whole)."""
        found = {}
        for u, read in buffered.items():
            slabs = slab_vjp(self.op(u))
            if slabs is None or u in early or u in self._gmask or len(self._wanted(u)) < 2:
                continue
            if all(type(x) is int and x in slabs[0] for x in read):
                found[u] = slabs
        return found

    def _kept(
        self,
        v: VirtualNode,
        slabbed: dict[VirtualNode, tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]]],
        env: dict[str, Any],
    ) -> str:
        """The expression of slot ``v``'s gradient that a step returns to views that retain
        theirs (``KEEP``): a slabbed slot's laid into zeros, as the buffer would hold it."""
        if v not in self.grad_slots:
            return "None"
        i = self.slot[v]
        if v not in slabbed:
            return f"g{i}"
        env["SLAB_G"], env[f"X{i}"] = _slab_grad, slabbed[v][0]
        given = ", ".join(f"g{i}_{j}" for j in range(len(slabbed[v][0])))
        return f"(SLAB_G(s{i}, X{i}, ({given},)) if g{i} is SLABS else g{i})"

    def _route(self, u: VirtualNode, g: str, lines: list[str], pad: str, env: dict[str, Any]) -> None:
        """Add gradient ``g`` (a name; may be ``None`` at run time for a seed) to ``u``'s."""
        if u in self.slot:
            if u not in self.grad_slots:
                return
            i = self.slot[u]
            row = self._row_arg.get(u)
            add = f"INTO({row}, {g})" if row is not None else f"{g} if g{i} is None else ADD(g{i}, {g})"
            if g.startswith(("u", "q")):  # a seed: may be None
                lines.append(f"{pad}if {g} is not None:")
                lines.append(f"{pad}    g{i} = {add}")
            else:
                lines.append(f"{pad}g{i} = {add}")
        elif u in self.captured and u in self.needs:
            j = self.captured[u]
            if g.startswith(("u", "q")):
                lines.append(f"{pad}if {g} is not None:")
                lines.append(f"{pad}    A{j}.add({g})")
            else:
                lines.append(f"{pad}A{j}.add({g})")


def vjp_of(op: Op, p: int) -> VJP | None:
    """``op``'s VJP for input ``p`` as ``vjp(g, ans, *xs, **attrs)`` (a variadic op's shared VJP
    bound to ``p``), or ``None`` if no gradient flows to that input."""
    if op.variadic:
        return partial(cast(VJP, op.vjps), p)
    return cast("tuple[VJP | None, ...]", op.vjps)[p]


def _reduce(g: Any, shape: tuple[int, ...]) -> Any:
    return reduce_grad(g, shape, False)


def _reduce_leaf(g: Any, shape: tuple[int, ...]) -> Any:
    return reduce_grad(g, shape, True)


def _into_row(row: np.ndarray | None, g: Any) -> Any:
    """``g``, an iteration's gradient of a hoisted node, copied into ``row`` (that iteration's
    row of the buffer the node's gradient is collected in) and the row returned; ``g`` itself
    where it cannot be: no row given, a lazy gradient, another shape or dtype."""
    if row is None or g is row or type(g) is not np.ndarray or g.shape != row.shape or g.dtype != row.dtype:
        return g
    np.copyto(row, g)
    return row


#: What a backward step holds as the gradient of a slot whose slabs' gradients it keeps apart
#: (:meth:`_Variant._slabbed`): the slot has one.
SLABS = object()


def _slab_grad(ans: np.ndarray, indices: tuple[int, ...], grads: tuple[Any, ...]) -> np.ndarray | None:
    """The gradient of ``ans`` that is ``grads`` at slabs ``indices`` (axis 0) and zero elsewhere
    (``None`` if none reached any)."""
    out = None
    for index, g in zip(indices, grads):
        if g is not None:
            if out is None:
                out = np.zeros(ans.shape, dtype=g.dtype)
            out[index] += g
    return out


def _into_row_joint(J: tuple[Any, ...], p: int, row: np.ndarray | None) -> tuple[Any, ...]:
    """A joint VJP's gradients ``J`` with ``J[p]`` copied into ``row`` (:func:`_into_row`) and
    every entry that is that same array replaced by the row (a fused cell gives one array as the
    gradient of ``x @ W_x``, ``h @ W_h`` and the bias): what reads them reads the row, and the
    VJP's array is not kept beside the buffer."""
    d = J[p]
    out = _into_row(row, d)
    if out is d:
        return J
    return tuple([out if x is d else x for x in J])


def _compile(source: str, env: dict[str, Any], loop: LoopNode) -> dict[str, Any]:
    """Compile generated ``source`` (registered with :mod:`linecache`, so tracebacks show it);
    returns the names it defines."""
    filename = f"<vgraph program {next(_counter)}: {loop.describe()}>"
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    scope = dict(env)
    exec(compile(source, filename, "exec"), scope)
    return scope


class _Acc:
    """The gradient of one captured value collected over a run's iterations, as the engine
    collects a node's (lazy contributions kept lazy; an owned array added into in place). The
    rule is written out here and in ``ComputeGraph._backprop``, whose hot loop inlines it: keep
    them alike."""

    __slots__ = ("g", "own", "sparse")

    def __init__(self, sparse: bool) -> None:
        self.g: Any = None
        self.own = False
        self.sparse = sparse

    def add(self, pg: Any) -> None:
        acc = self.g
        if acc is None:
            self.g = pg
        elif self.own and type(acc) is np.ndarray:
            if isinstance(pg, LazyGrad):
                pg.add_into(acc)
            else:
                np.add(acc, pg, out=acc)
        else:
            self.g = add_grads_sparse(acc, pg) if self.sparse else add_grads(acc, pg)
            self.own = True


class _HoistedGrad:
    """The gradient of a hoisted node over a run's iterations, collected in one buffer shaped as
    its value while the backward steps give it row by row, last iteration first: a row that the
    step wrote itself (:attr:`rows`, handed to the steps of :attr:`_Variant.rowed`) stays, any
    other gradient is copied in, and a row no gradient reached is zero. The result is what adding
    every row into zeros gives, with no list of the steps' arrays and no stack of them after the
    sweep (both alive at once, with whatever else reads the same arrays: a tied weight's
    stacked product, a bias's sum)."""

    __slots__ = ("buf", "rows", "reached", "exact")

    def __init__(self, value: Any) -> None:
        self.buf = workspace.empty(np.shape(value), _grad_dtype(value))  # (a temporary of the sweep)
        self.rows: list[np.ndarray] = list(self.buf)
        self.reached = False  # some iteration gave a gradient
        self.exact = True  # every row so far is a copy of an array of its shape and dtype
        # The rows are the gradient rows other collectors get too, where the steps pass them on
        # (a bias's, a tied weight's: see _Variant._early_rows): they read them as one buffer.
        share_rows(self.buf, self.rows)

    def put(self, t: int, g: Any) -> None:
        """Iteration ``t``'s gradient (``None``: none reached it)."""
        row = self.rows[t]
        if g is row:  # written by the step
            self.reached = True
            return
        if g is None:
            row.fill(0)
            self.exact = False
            return
        self.reached = True
        if type(g) is np.ndarray and g.shape == row.shape and g.dtype == row.dtype:
            np.copyto(row, g)
            return
        row.fill(0)
        if isinstance(g, LazyGrad):
            g.add_into(row)
        else:
            row += g
        self.exact = False

    def result(self, trips: int) -> np.ndarray | None:
        """The gradient after a sweep over ``trips`` iterations (``None``: none reached any)."""
        if not self.reached:
            return None
        buf = self.buf
        if trips < len(buf):
            buf[trips:] = 0
        elif self.exact:
            return buf
        # Rows copied as they came, where others are not: adding zero makes a -0.0 in them +0.0,
        # as adding every row into zeros does (the same bits as a sweep that collects them so).
        out: np.ndarray = np.add(buf, 0, dtype=buf.dtype)
        return out


class _Parts:
    """For one slot whose op's joint VJP splits (``ops.split_vjp``), the part its backward reads
    from the records alone, computed by ``prep`` over a block of iterations at a time as the
    backward sweep reaches them (last first; the rows of the run's buffer where the values are
    those, else the values stacked): one call per block instead of one per iteration,
    and at most a block held. ``None`` for the iterations of a block whose values cannot be
    stacked (an option not chosen): their steps call the joint VJP whole."""

    __slots__ = ("run", "records", "slot", "prep", "lo", "rows")

    #: The most bytes of one slot's values stacked for one ``prep`` call.
    BLOCK_BYTES = 1 << 22

    def __init__(self, run: ProgramRun, slot: int, prep: Callable[..., tuple[np.ndarray, ...]]):
        self.run, self.records, self.slot, self.prep = run, run.records, slot, prep
        self.lo = len(self.records)  # rows holds iterations lo, lo + 1, ... of the current block
        self.rows: list[Any] = []

    def at(self, t: int) -> Any:
        """Iteration ``t``'s part; a new block lets the previous one go first (the caller has let
        go of the part it was given before asking for the next)."""
        if t < self.lo:
            self.rows = []
            first = self.records[t][self.slot]
            size = first.nbytes if type(first) is np.ndarray else 1
            lo = max(0, t + 1 - max(1, self.BLOCK_BYTES // max(1, size)))
            self.lo = lo
            block = _rows_of(self.run, self.slot, lo, t + 1)  # (rows of the run's buffer: no stack)
            if block is None:
                values = [r[self.slot] for r in self.records[lo : t + 1]]
                if type(first) is not np.ndarray or not all(
                    type(x) is np.ndarray and x.shape == first.shape and x.dtype == first.dtype
                    for x in values
                ):
                    self.rows = [None] * len(values)
                    return None
                block = np.stack(values)
            self.rows = list(zip(*self.prep(block)))
        return self.rows[t - self.lo]


class _NoRows:
    """The buffer of a slot whose run could not have one (see :func:`_into`): every row ``None``,
    so the op makes its own arrays."""

    __slots__ = ()

    def __getitem__(self, t: int) -> None:
        return None


_NO_ROWS = _NoRows()


def _into(run: ProgramRun, cap: int) -> Callable[[int, int, Any], tuple[Any, Any]]:
    """``INTO`` of a whole loop's generated run (see :meth:`_Variant._run_lines`): a slot's buffer
    of ``cap`` rows (the most iterations the run can have: its sequences, ``times`` and
    ``max_iters`` bound them), made from its first value (at iteration ``t``), kept in
    ``run.buffers``; a stand-in if the value is no array or no bound is known (a loop that no
    sequence or ``times`` bounds: ``max_iters`` alone could be far more than it runs)."""

    def into(slot: int, t: int, value: Any) -> tuple[Any, Any]:
        if type(value) is not np.ndarray or t >= cap:
            return _NO_ROWS, value
        buf = np.empty((cap, *value.shape), dtype=value.dtype)
        buf[t] = value
        run.buffers[slot] = buf
        return buf, buf[t]

    return into


def _rows_of(run: ProgramRun, slot: int, lo: int, hi: int) -> np.ndarray | None:
    """The values of ``slot`` in iterations ``lo .. hi - 1`` as one block of its buffer's rows,
    if each is its row (an op writes into its row only where the value fits it), else ``None``."""
    buf = run.buffers.get(slot)
    if buf is None or not all(type(x := r[slot]) is np.ndarray and x.base is buf for r in run.records[lo:hi]):
        return None
    return buf[lo:hi]


def _select_step(idx: tuple[int, ...]) -> Callable[[BranchNode, int, tuple[Any, ...]], int]:
    def select(branch: BranchNode, t: int, values: tuple[Any, ...]) -> int:
        return select_option(branch, (*idx, t), values)

    return select


class RunGrad(LazyGrad):
    """The gradients reaching a program's loop node from its outputs in one backward sweep, by
    output index; the loop node's VJP runs the backward steps once for all of them."""

    __slots__ = ("seeds", "result")

    def __init__(self, seeds: dict[int, Any]) -> None:
        self.shape = ()
        self.dtype = np.dtype(object)
        self.seeds = seeds
        self.result: list[Any] | None = None

    def merge(self, other: LazyGrad) -> LazyGrad:
        seeds = dict(self.seeds)
        for k, g in cast(RunGrad, other).seeds.items():
            seeds[k] = g if k not in seeds else add_grads(seeds[k], g)
        return RunGrad(seeds)

    def dense(self) -> Any:  # (what reaches the loop node stays a RunGrad: its VJP reads it)
        return self

    def add_into(self, acc: np.ndarray) -> None:
        raise AssertionError("a loop node's gradient is never added into an array")


class ProgramRun:
    """One forward run of a loop instance's program: the records of its iterations and its
    outputs. The value of the loop's compute node."""

    __slots__ = (
        "records", "finals", "hoisted", "trips", "capped", "history", "kids", "buffers", "shape", "dtype"
    )  # fmt: skip

    def __init__(self) -> None:
        self.records: list[tuple[Any, ...]] = []
        # per slot the run computed into one buffer (_Variant.into): the buffer, a row per
        # iteration (an iteration's value is its row where it fitted: see _rows_of)
        self.buffers: dict[int, np.ndarray] = {}
        self.finals: list[Any] = []
        self.hoisted: list[Any] = []  # each hoisted node's value for all iterations
        self.trips = 0
        self.capped = False
        self.kids: list[list[int]] | None = None
        self.history: list[Any] = []  # (a batched recursion's: per carry, every tree node's update)
        self.shape = ()  # (read by the engine, which takes the loop node for an array)
        self.dtype = np.dtype(object)

    def __repr__(self) -> str:
        return f"ProgramRun({self.trips} iterations{', capped' if self.capped else ''})"


class SweptOnce:
    """The VJPs of a loop node run as a program: :meth:`backward` (the backward steps) runs once
    per sweep, on the first parent asked for, and gives every parent's gradient."""

    def backward(self, g: RunGrad, run: ProgramRun, values: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def vjp(self, i: int, g: RunGrad, run: ProgramRun, *values: Any) -> Any:
        """The gradient of the loop node's parent ``i`` (``None`` where none flowed: the loop's
        op declares ``Op.partial_grads``)."""
        if g.result is None:
            g.result = self.backward(g, run, values)
        return g.result[i]


class ProgramInstance(SweptOnce):
    """A loop instance of one build run as a program: the op of its ``<Loop:id@idx>`` node.

    Parents of that node, in order: the carries' initial values, the stepped sequences, the
    children array (a recursion), the captured values (see :class:`BodyProgram`)."""

    def __init__(
        self,
        program: BodyProgram,
        variant: _Variant,
        idx: tuple[int, ...],
        hoisted_attrs: list[dict[str, Any]],
        sparse: list[bool],
    ) -> None:
        self.program = program
        self.variant = variant
        self.loop = program.loop
        self.idx = idx
        self.hoisted_attrs = hoisted_attrs
        self.sparse = sparse  # per captured value: whether its gradient is kept row-sparse
        self.run: ProgramRun | None = None
        self.captured_nodes: list[ComputeNode] = []  # the loop node's captured parents
        self.init_nodes: list[ComputeNode] = []  # and its carries' initial values
        self._views: dict[tuple[int, int], ComputeNode] = {}
        self._select = _select_step(idx)
        loop = self.loop
        self.n_carries = len(loop.carries)
        self.n_seqs = len(loop.sequences)
        self.has_kids = loop.structure is not None
        self.names = [c.name for c in loop.carries]
        # where each carry's update comes from: a slot of the record, or a captured value
        self.update_src = [self._source(loop.updates[c]) for c in loop.carries]
        self.stack_src = [self._source(s.inputs[1]) for s in program.stacked]
        self.item_reverse = [bool(i.attrs.get("reverse")) for i in loop.items]
        self.reads = [(loop.carries.index(r.inputs[0]), r.attrs["slot"]) for r in loop.children]
        # A loop whose trip count its sequences or its tree decide may be re-run on others by a
        # cached build's replay (see :meth:`make_resizable`): the length its guards expect, what its
        # parents' values were like (ranks and dtypes, and the sequences' rows' shapes), which
        # captured values its run read where a gradient flows, whether a replay lets the length
        # change now, and where its decisions are in ``cg.decisions`` (start, stop).
        self.length: int | None = None
        self.signature: tuple[Any, ...] | None = None
        self.graded: list[bool] = []
        self.resizing = False
        self.least = 0  # (0: not resizable)
        self.decisions = (0, 0)

    def _source(self, u: VirtualNode) -> tuple[bool, int]:
        v = self.variant
        return (True, v.slot[u]) if u in v.slot else (False, v.captured[u])

    # -- forward
    def forward(self, *values: Any, groups: list[Any] | None = None) -> ProgramRun:
        """Run the program on the loop node's parents' values (at build time, and again when a
        forward finds a parent changed): the loop rules between steps, the records kept.
        ``groups``: the hoisted nodes' values, when the build has computed them already."""
        loop, nc, ns = self.loop, self.n_carries, self.n_seqs
        init = list(values[:nc])
        seqs = values[nc : nc + ns]
        kids_value = values[nc + ns] if self.has_kids else None
        caps = values[nc + ns + (1 if self.has_kids else 0) :]
        length = len(seqs[0]) if seqs else None
        run = ProgramRun()
        rows: list[list[int]] | None = None
        if kids_value is not None:
            rows = np.asarray(kids_value).tolist()
            length = len(rows)
            run.kids = rows
        # hoisted nodes: once over all iterations
        group_of: dict[VirtualNode, Any] = {}
        if groups is not None:
            run.hoisted = groups
        elif self.variant.hoisted:
            trips = min(n for n in (loop.times, length) if n is not None)
            for item, seq, rev in zip(loop.items, seqs, self.item_reverse):
                group_of[item] = seq[::-1][:trips] if rev else seq[:trips]
            for v, attrs in zip(self.variant.hoisted, self.hoisted_attrs):
                xs = [group_of[u] if u in group_of else caps[self.variant.captured[u]] for u in v.inputs]
                group_of[v] = cast(Op, v.op).forward(*xs, **attrs)
                run.hoisted.append(group_of[v])
        hoisted_groups = run.hoisted
        step = self.variant._make_step(self._select, *caps)
        records = run.records
        update_src = self.update_src
        state = init
        history: list[list[Any]] = []
        reads = self.reads
        # Each iteration's rows of the stepped sequences (in step order) and hoisted values, split
        # once (a C loop) rather than indexed per iteration.
        items = [list(seq[::-1] if rev else seq) for seq, rev in zip(seqs, self.item_reverse)]
        stepped = [*items, *(list(group) for group in hoisted_groups)]
        n_items = len(items)
        # The loop rules between iterations: asked before every iteration where a while_ decides,
        # else only from the first iteration at which a count could stop the loop.
        stop, until, check = self._rules(run, length)
        check_at = 0 if loop.cond is not None else first_count_stop(loop, length)
        if rows is None and self.variant._make_run is not None:  # the iterations in generated code
            bounded = loop.times is not None or length is not None  # (max_iters alone: see _into)
            into = _into(run, first_count_stop(loop, length) if bounded else 0)
            run_steps = self.variant._make_run(self._select, check, into, *caps)
            until_ = None if loop.until is None else until
            run.trips, finals = run_steps(0, check_at, records, stop, until_, *init, *stepped)
            run.finals = list(finals)
            return run
        t = 0
        while True:
            if t >= check_at and stop(t, *state):
                break
            if rows is None:
                record = step(t, *state, *[s[t] for s in stepped])
            else:
                row = rows[t]
                kids = [history[c][k] if (c := row[slot]) >= 0 else init[k] for k, slot in reads]
                at = [s[t] for s in stepped]
                record = step(t, *state, *at[:n_items], *kids, *at[n_items:])
            records.append(record)
            new_state = [record[i] if in_record else caps[i] for in_record, i in update_src]
            for k in range(nc):
                old, new = state[k], new_state[k]
                if old.shape != new.shape or old.dtype != new.dtype:
                    check(t, k, old, new)
            state = new_state
            if rows is not None:
                history.append(new_state)
            t += 1
            if loop.until is not None and until(t - 1, *state):
                break
        run.trips = t
        run.finals = state
        return run

    def _rules(
        self, run: ProgramRun, length: int | None
    ) -> tuple[Callable[..., bool], Callable[..., bool], Callable[[int, int, Any, Any], None]]:
        """The loop rules (:mod:`.rules`) between the iterations of ``run``, as
        ``(stop(t, *carries), until(t, *carries), check(t, k, old, new))``: whether the loop stops
        before iteration ``t`` (by count, ``while_`` or ``max_iters``: a cap is recorded in
        ``run``), whether ``until`` stops it after iteration ``t``, and carry ``k``'s update
        checked where its shape or dtype changed (raises ``ShapeError``)."""
        loop, idx, names = self.loop, self.idx, self.names

        def stop(t: int, *state: Any) -> bool:
            if reached_end(loop, t, length):
                return True
            if loop.cond is not None and not run_cond(loop, idx, t, names, state):
                return True
            if at_limit(loop, idx, t):
                run.capped = True
                return True
            return False

        def until(t: int, *state: Any) -> bool:
            return run_cond(loop, idx, t, names, state, until=True)

        def check(t: int, k: int, old: Any, new: Any) -> None:
            by = _Described(self, loop.updates[loop.carries[k]], t)
            check_carry(loop, idx, t, names[k], old, new, by)

        return stop, until, check

    def make_resizable(self, least: int, values: Sequence[Any], graded: list[bool]) -> None:
        """Let a cached build's replay re-run this instance at another length of its sequences or
        on another tree (see :meth:`takes_length`, :meth:`takes_count`), built on parents'
        ``values`` with ``graded`` (:meth:`_Variant.graded` of its run): its trip count must then
        lie in ``least..loop.max_iters``, as the build's does."""
        self.least, self.signature, self.graded = least, self._signature(values), graded
        self.length = len(values[self.n_carries])  # (the first sequence's, or the children array's)

    def _signature(self, values: Sequence[Any]) -> tuple[Any, ...]:
        """What a resized run must find as at the build: each parent's rank and dtype, and the
        shape of the sequences' rows (what the program's variant and hoisting follow from)."""
        nc, ns = self.n_carries, self.n_seqs
        return tuple(
            (np.shape(v)[1:] if nc <= i < nc + ns else np.ndim(v), getattr(v, "dtype", None))
            for i, v in enumerate(values)
        )

    def takes_length(self, values: Sequence[Any]) -> bool:
        """Whether the replay under way may re-run this instance on sequences ``values`` of
        their length, the build's or another (and, if so, expect it from now on): the replay is
        a cached build's (:attr:`resizing`), the sequences share a length, their rows have the
        shape they had, and a fresh build of that length would run the same program with the
        same hoisting (its trip count in ``least..max_iters``, so no other rule applies)."""
        lengths = {np.shape(v)[0] if np.ndim(v) else -1 for v in values}
        n = lengths.pop()
        signature = cast(tuple[Any, ...], self.signature)[self.n_carries : self.n_carries + self.n_seqs]
        if lengths or any(
            np.shape(v)[1:] != s or getattr(v, "dtype", None) != d for v, (s, d) in zip(values, signature)
        ):
            return False
        return self.takes_count(n)

    def takes_count(self, n: int) -> bool:
        """Whether the replay under way may re-run this instance over ``n`` sequence steps or
        tree nodes (and, if so, expect them from now on): :meth:`takes_length`'s rule on the
        trip count alone."""
        loop = self.loop
        trips = n if loop.times is None else min(loop.times, n)
        if not (self.resizing and self.least and self.least <= trips <= loop.max_iters):
            return False
        self.length = n
        return True

    def rerun(self, *values: Any) -> ProgramRun:
        """:meth:`forward` for a forward of the graph: the decisions must be those of the build
        (else the graph no longer describes the inputs: :class:`StructureChangedError`) — but for
        the trip count and choices of a cached build's replay on other lengths or another tree
        (:meth:`takes_length`, :meth:`takes_count`)."""
        old = cast(ProgramRun, self.run)
        if self.resizing and self._signature(values) != self.signature:
            raise StructureChangedError(
                f"{self.loop.describe(self.idx)}: its inputs' ranks or dtypes changed"
            )
        new = self.forward(*values)
        if is_anomaly_enabled():
            self._check_values(new)
        where = self.loop.describe(self.idx)
        if self.resizing:  # (its guards took the length or tree): another run, its choices its own
            if new.capped or self.variant.graded(new) != self.graded:
                raise StructureChangedError(f"{where}: its run reads other values than the build's")
            records = new.records
            for key in [(s, t) for s, t in self._views if t >= new.trips or records[t][s] is None]:
                del self._views[key]  # (not part of the new build, as a resized graph's left-out blocks)
            old = new
        if new.trips != old.trips or new.capped != old.capped:
            loop = self.loop
            which = "until" if loop.until is not None else "while_" if loop.cond is not None else None
            # the first check that answered otherwise: before iteration t (while_), after it (until)
            t = min(new.trips, old.trips) - (1 if which == "until" else 0)
            why = f" (its {which} condition changed at iteration {t})" if which else ""
            raise StructureChangedError(
                f"{where} would now run {new.trips} iterations, not {old.trips}{why}; rebuild the "
                "compute graph for the new inputs"
            )
        for pos in self.variant.choice.values():
            for t, (a, b) in enumerate(zip(old.records, new.records)):
                if a[pos] != b[pos]:
                    branch = next(v for v, p in self.variant.choice.items() if p == pos)
                    raise StructureChangedError(
                        f"{branch.describe((*self.idx, t))} would now select option {b[pos]}, but this "
                        f"graph was built with option {a[pos]}; rebuild the compute graph for the new inputs"
                    )
        self.run = new
        for (slot, t), view in self._views.items():
            view._value = new.records[t][slot]
        return new

    # -- outputs
    def final(self, k: int) -> Callable[[ProgramRun], Any]:
        def value(run: ProgramRun) -> Any:
            return run.finals[k]

        return value

    def stacked(self, j: int, caps: Sequence[Any]) -> Callable[[ProgramRun], Any]:
        in_record, i = self.stack_src[j]
        # (a stacked slot read from a buffer: its own, or the one it is a view of)
        source, index = self.variant.view_of.get(i, (i, ())) if in_record else (None, ())

        def value(run: ProgramRun) -> Any:
            if not run.records:
                raise BuildError(f"{self.loop.describe(self.idx)} ran no iteration, nothing to stack")
            block = None if source is None else _rows_of(run, source, 0, run.trips)
            if block is not None:  # the iterations' rows of a buffer (or views of them): a view
                out: np.ndarray = block[index]
                out.flags.writeable = False  # (the records' values: the backward reads them)
                return out
            return np.stack([r[i] for r in run.records] if in_record else [caps[i]] * run.trips)

        return value

    # -- backward
    def backward(self, g: RunGrad, run: ProgramRun, values: Sequence[Any]) -> list[Any]:
        loop, variant, nc, ns = self.loop, self.variant, self.n_carries, self.n_seqs
        program = self.program
        ncap = len(variant.captured)
        first_cap = nc + ns + (1 if self.has_kids else 0)
        caps = values[first_cap:]
        seqs = values[nc : nc + ns]
        accs = [_Acc(self.sparse[j]) for j in range(ncap)]
        back = variant._make_back(*caps, *accs)
        T = run.trips
        nf = len(program.finals)
        # seeds: finals by carry, stacked values by row
        final_seed: list[Any] = [None] * nc
        for k, f in enumerate(program.finals):
            s = g.seeds.get(k)
            if s is not None:
                c = loop.carries.index(f.inputs[1])
                final_seed[c] = s if final_seed[c] is None else add_grads(final_seed[c], s)
        stack_seed = [g.seeds.get(nf + j) for j in range(len(program.stacked))]
        stack_seed = [densified(s) for s in stack_seed]  # (rows read)
        seq_grad: list[Any] = [None] * ns
        items = loop.items
        ni, nr, nh = len(items), len(loop.children), len(variant.hoisted)
        hoisted_grads = [
            _HoistedGrad(value) if stepped else None
            for stepped, value in zip(variant.stepped_grads, run.hoisted)
        ]
        # Per hoisted node the step writes into: the rows of its buffer, handed in by iteration.
        step_rows = [cast(_HoistedGrad, hoisted_grads[h]).rows for h in variant.rowed]
        rows = run.kids
        init_grad: list[Any] = [None] * nc
        pending: list[list[Any]] | None = None
        if rows is not None:
            pending = [[None] * nc for _ in range(T)]
            if T:
                pending[T - 1] = list(final_seed)
            carry_in: list[Any] = [None] * nc
        else:
            carry_in = list(final_seed)
        length = len(seqs[0]) if seqs else T
        keep = self._retaining()
        check = is_anomaly_enabled()
        if check and keep is None:
            keep = {}  # (every slot's gradient, to check)
        late = {variant.slot[v] for v in (*items, *variant.hoisted)}
        parts = [_Parts(run, slot, prep) for slot, prep in variant.prepped]

        def item(i: int, t: int, d: Any) -> None:  # a stepped item's gradient, into its sequence's
            if seq_grad[i] is None:
                seq_grad[i] = np.zeros(np.shape(seqs[i]), dtype=_grad_dtype(seqs[i]))
            _add_row(seq_grad[i], length - 1 - t if self.item_reverse[i] else t, d)

        if rows is None and keep is None and variant._make_sweep is not None:  # (generated: see _sweep_lines)
            sweep = variant._make_sweep(*caps, *accs, self._vjp_error)
            stepped = [hg for hg in hoisted_grads if hg is not None]
            carry_in = list(sweep(T, run.records, *carry_in, *stack_seed, *parts, *step_rows, *stepped, item))
        else:  # (the driver runs the steps: a recursion, retained gradients, anomaly mode)
            p: list[Any] = []  # this iteration's parts
            for t in range(T - 1, -1, -1):
                if pending is not None:
                    u = pending[t]
                    for k in range(nc):  # the carry reads of iteration t + 1 read iteration t's update
                        if carry_in[k] is not None:
                            u[k] = carry_in[k] if u[k] is None else add_grads(u[k], carry_in[k])
                else:
                    u = carry_in
                q = [None if s is None else s[t] for s in stack_seed]
                p.clear()  # (a new block of parts is made with the last one let go: see _Parts.at)
                p.extend([part.at(t) for part in parts])
                o = [rows_h[t] for rows_h in step_rows]
                try:
                    if keep is None:
                        res = back(False, run.records[t], *u, *q, *p, *o)
                    else:
                        res, every = back(True, run.records[t], *u, *q, *p, *o)
                except VGraphError:
                    raise
                except Exception as e:
                    raise self._vjp_error(e, t) from e
                if keep is not None:
                    for slot, view in keep.get(t, ()):
                        if slot not in late:  # (items' and hoisted nodes' are complete only later)
                            _retain(view, every[slot])
                    if check:
                        self._check_grads(every, t)
                carry_in = list(res[:nc])
                for i in range(ni):
                    if res[nc + i] is not None:
                        item(i, t, res[nc + i])
                if rows is not None:
                    row = rows[t]
                    for r, (k, slot) in enumerate(self.reads):
                        d = res[nc + ni + r]
                        if d is None:
                            continue
                        c = row[slot]
                        target = cast(list[list[Any]], pending)[c] if c >= 0 else init_grad
                        target[k] = d if target[k] is None else add_grads(target[k], d)
                for h, hg in enumerate(hoisted_grads):
                    if hg is not None:
                        hg.put(t, res[nc + ni + nr + h])
        for k in range(nc):  # what reaches iteration 0's carry reads: the initial values
            if carry_in[k] is not None:
                init_grad[k] = carry_in[k] if init_grad[k] is None else add_grads(init_grad[k], carry_in[k])
        if nh:
            self._backward_hoisted(run, hoisted_grads, seqs, caps, seq_grad, accs, keep)
        if keep is not None:  # a stepped item's gradient is its row of the sequence's
            for t, views in keep.items():
                for slot, view in views:
                    v = variant.inputs[slot] if slot < len(variant.inputs) else None
                    if v in items:
                        i = items.index(v)
                        at = length - 1 - t if self.item_reverse[i] else t
                        if seq_grad[i] is not None:
                            _retain(view, seq_grad[i][at])
        out: list[Any] = [*init_grad, *seq_grad]
        if self.has_kids:
            out.append(None)
        out.extend(a.g for a in accs)
        return out

    def _check_values(self, run: ProgramRun) -> None:
        """Anomaly mode on a re-run: the first NaN or Inf a body node computed, by iteration and
        declaration order (as the per-node forward would meet it).

        Raises:
            NonFiniteError: naming the body node, its iteration and its op.
        """
        for t, record in enumerate(run.records):
            for v in self.variant.computed:
                value = record[self.variant.slot[v]]
                if value is not None and not _finite(value):
                    op = "a branch" if isinstance(v, BranchNode) else cast(Op, v.op).name
                    raise NonFiniteError(
                        f"{_kind(value)} first appears at {self.describe(v, t)} ({op}), in the body "
                        f"program of {self.loop.describe(self.idx)}; for its inputs' ranges, build "
                        "with programs=False and detect_anomaly=True"
                    )

    def _check_grads(self, grads: Sequence[Any], t: int) -> None:
        """Anomaly mode in backward: the first NaN or Inf gradient of iteration ``t``, in the order
        the backward step computed them (last body node first).

        Raises:
            NonFiniteError: naming the body node whose gradient it is.
        """
        variant = self.variant
        for v in (*reversed(variant.computed), *reversed(variant.inputs)):
            g = grads[variant.slot[v]]
            if g is not None and not _finite(g):
                raise NonFiniteError(
                    f"{_kind(g)} first appears in the gradient of {self.describe(v, t)}, in the "
                    f"backward step of the body program of {self.loop.describe(self.idx)}; for "
                    "the VJP that produced it, build with programs=False and detect_anomaly=True"
                )

    def _vjp_error(self, e: Exception, t: int) -> Exception:
        """The error for exception ``e`` raised by a VJP in iteration ``t``'s backward step, as
        the per-node sweep words it: naming the node, its op and the input."""
        where = self.variant.failed_vjp(e)
        if where is None:  # not in a VJP: the program itself
            return BackwardError(
                f"{self.loop.describe((*self.idx, t))}: the backward step failed: {type(e).__name__}: {e}"
            )
        v, p = where
        op = cast(Op, v.op)
        node, parent = self.describe(v, t), self.describe(v.inputs[p], t)
        if isinstance(e, OpResultError):  # refused by a vgraph.defop op's CheckedVJP
            return e.error(f"{node}: the VJP of {op.name} for input {e.position} {parent} {e}")
        return BackwardError(
            f"{node}: the VJP of {op.name} with respect to its input {parent} failed: {type(e).__name__}: {e}"
        )

    def _hoisted_anomaly(
        self,
        v: VirtualNode,
        p: int,
        vjp: VJP,
        g: Any,
        ans: Any,
        xs: Sequence[Any],
        stepped: Sequence[bool],
        d: Any,
    ) -> NonFiniteError:
        """Anomaly mode: the error for the non-finite gradient ``d`` that the VJP of hoisted node
        ``v`` (run once over every iteration) gave its input ``p`` from a finite ``g``, naming the
        first iteration whose row alone gives one, with that row's values, as the per-node sweep
        names its node. Each row's VJP is computed alone, on this error path only."""
        attrs = self.hoisted_attrs[self.variant.hoisted.index(v)]
        where = f"{v.describe(self.idx)}, summed over every iteration (no iteration alone gives it)"
        rows = [
            (self.describe(u, 0) if not s else f"{u.describe(self.idx)}", x)
            for u, x, s in zip(v.inputs, xs, stepped)
        ]
        for t in range(len(ans)):
            cut = [x[t : t + 1] if s else x for x, s in zip(xs, stepped)]
            with contextlib.suppress(Exception):  # (a VJP that needs every row: none to name)
                row = vjp(g[t : t + 1], ans[t : t + 1], *cut, **attrs)
                if not _finite(row):
                    where, d, g, ans = self.describe(v, t), row, g[t], ans[t]
                    rows = [(self.describe(u, t), x[t] if s else x) for u, x, s in zip(v.inputs, xs, stepped)]
                    break
        lines = [
            f"{_kind(d)} first appears in backward at {where} (computed for every iteration at once "
            f"in the body program of {self.loop.describe(self.idx)}): the VJP of {cast(Op, v.op).name} "
            f"gave a non-finite gradient for its input {rows[p][0]} from a finite incoming gradient",
            f"  incoming gradient: {value_summary(g)}",
            *(f"  input {name}: {value_summary(x)}" for name, x in rows),
            f"  output: {value_summary(ans)}",
        ]
        return NonFiniteError("\n".join(lines))

    def _retaining(self) -> dict[int, list[tuple[int, ComputeNode]]] | None:
        """The views that retain their gradient, by iteration (``None``: none do)."""
        found: dict[int, list[tuple[int, ComputeNode]]] = {}
        for (slot, t), view in self._views.items():
            if view.retains_grad:
                found.setdefault(t, []).append((slot, view))
        return found or None

    def _backward_hoisted(
        self,
        run: ProgramRun,
        collected: list[_HoistedGrad | None],
        seqs: Sequence[Any],
        caps: Sequence[Any],
        seq_grad: list[Any],
        accs: list[_Acc],
        keep: dict[int, list[tuple[int, ComputeNode]]] | None,
    ) -> None:
        """The hoisted nodes' VJPs, each once over all iterations, last hoisted first."""
        variant, loop = self.variant, self.loop
        check = is_anomaly_enabled()
        hoisted = list(variant.hoisted)
        trips = run.trips
        grads: dict[VirtualNode, Any] = {}
        for v, hg in zip(hoisted, collected):
            gv = None if hg is None else hg.result(trips)
            if gv is not None:
                grads[v] = gv
        group_of: dict[VirtualNode, Any] = {}
        for item, seq, rev in zip(loop.items, seqs, self.item_reverse):
            group_of[item] = seq[::-1][:trips] if rev else seq[:trips]
        for v, value in zip(hoisted, run.hoisted):
            group_of[v] = value
        for v, attrs, value in reversed(list(zip(hoisted, self.hoisted_attrs, run.hoisted))):
            gv = grads.pop(v, None)
            if gv is None:
                continue
            if isinstance(gv, LazyGrad):  # (from a hoisted view of it: all are in, as the engine's turn)
                gv = gv.dense()
            if keep is not None:  # a hoisted node's gradient is its row of the group's
                slot = variant.slot[v]
                for t, views in keep.items():
                    for s, view in views:
                        if s == slot:
                            _retain(view, gv[t])
            op = cast(Op, v.op)
            xs = [group_of[u] if u in group_of else caps[variant.captured[u]] for u in v.inputs]
            for p, u in enumerate(v.inputs):
                f = vjp_of(op, p)
                if f is None or not (u in variant.grad_slots or u in variant.needs):
                    continue
                d = f(gv, value, *xs, **attrs)
                shape = np.shape(xs[p])
                if d.shape != shape:
                    d = reduce_grad(d, shape, False)
                if check and not _finite(d) and _finite(gv):
                    raise self._hoisted_anomaly(v, p, f, gv, value, xs, [u in group_of for u in v.inputs], d)
                if u in loop.items:
                    i = loop.items.index(u)
                    if seq_grad[i] is None:
                        seq_grad[i] = np.zeros(np.shape(seqs[i]), dtype=_grad_dtype(seqs[i]))
                    rows_of = seq_grad[i][::-1][:trips] if self.item_reverse[i] else seq_grad[i][:trips]
                    if isinstance(d, LazyGrad):
                        d.add_into(rows_of)
                    else:
                        rows_of += d
                elif u in grads or u in variant.hoisted:
                    grads[u] = d if u not in grads else add_grads(grads[u], d)
                elif u in variant.captured:
                    accs[variant.captured[u]].add(d)

    # -- views: the unrolled nodes, made when asked for
    def _resolve(self, v: VirtualNode, t: int) -> ComputeNode | tuple[VirtualNode, int]:
        """What body node ``v`` is in iteration ``t``: the node a carry or child read reads (an
        initial value, a captured value), or the computed node and iteration it comes from."""
        run = self.run
        trips, kids = (0, None) if run is None else (run.trips, run.kids)  # (None: its first run, running)
        variant, loop = self.variant, self.loop
        while 0 <= t < trips:
            if v in variant.captured:  # a tied parameter or a constant of the body, or from outside
                return self.captured_nodes[variant.captured[v]]
            if v.kind == "child":
                k = loop.carries.index(v.inputs[0])
                c = cast(list[list[int]], kids)[t][v.attrs["slot"]]
                if c < 0:
                    return self.init_nodes[k]
                v, t = loop.updates[v.inputs[0]], c
            elif v.kind == "carry":
                if t == 0:
                    return self.init_nodes[loop.carries.index(v)]
                v, t = loop.updates[v], t - 1
            else:
                break
        return v, t

    def describe(self, v: VirtualNode, t: int) -> str:
        """How an error names body node ``v`` in iteration ``t`` (no view is made)."""
        found = self._resolve(v, t)
        if isinstance(found, ComputeNode):
            return found.describe()
        u, s = found
        return u.describe((*self.idx, s))

    def view(self, v: VirtualNode, t: int, graph: Any) -> ComputeNode:
        """The compute node of body node ``v`` in iteration ``t`` of ``graph`` (the loop node's
        graph): a view of the record's entry, made on first request.

        Raises:
            BuildError: no such iteration, or ``v`` was not computed in it (an option not chosen).
        """
        run = cast(ProgramRun, self.run)
        variant = self.variant
        where = v.describe((*self.idx, t))
        found = self._resolve(v, t)
        if isinstance(found, ComputeNode):
            return found
        v, t = found
        if v not in variant.slot or not 0 <= t < run.trips:
            raise BuildError(f"{where} was not built in this graph (not needed, or no such iteration)")
        slot = variant.slot[v]
        view = self._views.get((slot, t))
        if view is not None:
            return view
        value = run.records[t][slot]
        if value is None:
            raise BuildError(f"{where} was not built in this graph (its branch option was not chosen)")
        view = ComputeNode(
            NodeKey(v.type, v.id, (*self.idx, t)),
            value,
            None,
            (),
            None,
            v in variant.grad_slots,
            v.name,
            graph,
        )
        self._views[(slot, t)] = view
        return view

    def retain_all(self, graph: Any) -> int:
        """Make and retain the gradient of every body node of every iteration that needs one
        (what :func:`vgraph.render.retain_all_grads` does to a per-node graph) in ``graph`` (the
        loop node's); returns how many."""
        run = cast(ProgramRun, self.run)
        count = 0
        for v in (*self.loop.items, *self.variant.hoisted, *self.variant.computed):
            if v not in self.variant.grad_slots:
                continue
            for t in range(run.trips):
                if run.records[t][self.variant.slot[v]] is not None:
                    self.view(v, t, graph).retain_grad()
                    count += 1
        return count

    def body_node(self, type_: str, id_: int) -> VirtualNode | None:
        """The node of this loop's body (computed, or read per iteration) with that type and id."""
        for v in self.variant.slot:
            if v.type == type_ and v.id == id_:
                return v
        return None

    def built(self, v: VirtualNode, t: int) -> bool:
        """Whether body node ``v`` has a value in iteration ``t``."""
        run = self.run
        if v in self.variant.captured and v.scope is self.loop:
            return run is not None and 0 <= t < run.trips
        return (
            run is not None
            and v in self.variant.slot
            and 0 <= t < run.trips
            and run.records[t][self.variant.slot[v]] is not None
        )


class _Described:
    """Describes a body node in an iteration for an error message, without making its view —
    when the message is made: a carry's first update that widens it is checked, and allowed, in
    every run."""

    __slots__ = ("instance", "t", "v")

    def __init__(self, instance: ProgramInstance, v: VirtualNode, t: int) -> None:
        self.instance, self.v, self.t = instance, v, t

    def describe(self) -> str:
        return self.instance.describe(self.v, self.t)


def _finite(x: Any) -> bool:
    arr = x.dense() if isinstance(x, LazyGrad) else np.asarray(x)
    return arr.dtype.kind not in "fc" or bool(np.isfinite(arr).all())


def _kind(x: Any) -> str:
    arr = x.dense() if isinstance(x, LazyGrad) else np.asarray(x)
    return "NaN" if np.isnan(arr).any() else "Inf"


def _retain(view: ComputeNode, g: Any) -> None:
    """Add ``g`` (``None``: nothing reached it) to the gradient a view retains."""
    if g is None:
        return
    g = g.dense() if isinstance(g, LazyGrad) else np.array(g)
    view.grad = g if view.grad is None else view.grad + g  # (retain_grad() noted it in its graph)


def _grad_dtype(x: Any) -> Any:
    dtype = np.asarray(x).dtype
    return dtype if dtype.kind in "fc" else np.float64


def _add_row(buf: np.ndarray, t: int, d: Any) -> None:
    if isinstance(d, LazyGrad):
        d.add_into(buf[t])
    else:
        buf[t] += d


def _seed_vjp(k: int, g: Any, ans: Any, run: ProgramRun) -> RunGrad:
    """The VJP of a program's output ``k``: its gradient, handed to the loop node."""
    return RunGrad({k: g})


def show_program(cg: Any, loop: LoopNode, idx: tuple[int, ...] = ()) -> str:
    """The generated source of the body program that ran ``loop`` in iteration path ``idx`` of
    build ``cg``: its forward step and its backward step (tracebacks through them show the same
    lines), with what its slots ``sN`` and captured values ``kN`` are.

    In a batched build (``g.build_batch``) one program runs the instances of many inputs at once,
    over rows: pass the input whose instance it is (``batch.inputs[i]``), or the whole build for
    the first input whose instance ran as a program.

    Args:
        cg: an unrolled graph (``g.build``), a batched build or one of its inputs, in which
            ``loop`` ran as a body program.
        loop: the loop (or recursion) node.
        idx: the iteration path of the loop instance (``()`` for a top-level loop).

    Returns:
        The source, as text (``print(vg.show_program(cg, loop))``).

    Raises:
        BuildError: that loop instance did not run as a program (``cg.interpreted``, or a batched
            input's, says why).
    """
    idx = tuple(idx)
    views = getattr(cg, "inputs", None)  # a batched build: its inputs, first to last
    views = views if isinstance(views, list) else [cg]
    instance = next((p for v in views if (p := getattr(v, "programs", {}).get((loop, idx)))), None)
    if instance is None:
        why = [r for v in views for lp, i, r in getattr(v, "interpreted", ()) if lp is loop and i == idx]
        reason = (
            f": {why[0]}"
            if why
            else " (built with programs=False, or not built; of a batched build, pass the build or "
            "one of its inputs, not its .graph)"
        )
        raise BuildError(f"{loop.describe(idx)} did not run as a body program{reason}")
    variant = instance.variant
    legend = [f"#   s{i} = {v.describe()}" for v, i in variant.slot.items()]
    legend += [f"#   s{i} = the option {b.describe()} chose" for b, i in variant.choice.items()]
    legend += [f"#   k{j} = {v.describe()}" for v, j in variant.captured.items()]
    if variant.hoisted:
        legend.append(
            "# computed once over all iterations: " + ", ".join(v.describe() for v in variant.hoisted)
        )
    rows = getattr(instance, "rows", None)  # a program over the rows of a batch's inputs
    over = "" if rows is None else f", over the rows of {len(rows)} inputs' instances"
    return "\n".join(
        [
            f"# body program of {loop.describe(idx)}{over}",
            *legend,
            "",
            variant.forward_source,
            variant.backward_source,
        ]
    )
