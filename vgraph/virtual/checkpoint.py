"""Checkpointing: long loops in bounded memory, by recomputing in backward what was not kept.

A loop declared with ``checkpoint=`` (``g.loop(..., checkpoint=k | "sqrt" | ("binomial", s))``,
also ``g.recurse``) is unrolled as usual — every iteration gets its nodes and keys — but the
values of its iterations are dropped while unrolling, unit by unit (a *unit* is a run of
consecutive iterations), except what later code needs:

* the *boundary* of a unit: the values later units read (the carried state at its end; in a
  recursion, the values read by parents in later units). With ``k`` and ``"sqrt"`` every
  boundary is kept (the checkpoints); with ``("binomial", s)`` at most ``s`` are;
* what the code after the loop reads (final carries, values collected by ``loop.stack``);
* leaves other than sampled ones (inputs, parameters) and structure guards.

Sampled leaves made in the loop (dropout masks) are dropped too: a unit remembers the state of
the build's random generator when it started, and its recomputation draws every sample of the
unit again, in creation order, from that state — exactly the values the build drew.

Backward meets the dropped units in reverse order. When the sweep reaches a node without a
value, its whole unit is recomputed in creation order from the kept boundary before it (with
``binomial``, first advanced to from the nearest kept state, placing new checkpoints on the way
as the binomial schedule says), the sweep goes on, and the unit is dropped again once the sweep
has left it. Peak memory: the checkpoints plus one unit. Values and gradients are those of the
plain unroll: the same ops run on the same inputs.

Nested checkpointed loops: a unit of the outer loop covers the inner loops' units. Recomputing it
drops the inner units again as it passes their ends, as the build did; the sweep then brings back
one inner unit at a time (its lookup descends into a unit whose values are present).

Schedules (``T`` iterations):

* ``k``: units of ``k`` iterations: ``T/k`` checkpoints + ``k`` iterations; one extra forward.
* ``"sqrt"``: ``k = ceil(sqrt(T))`` when ``T`` is known when the loop starts (``times=``,
  stepped sequences, recursions); for a ``while_`` loop, units of 1, 2, 3 … iterations
  (about ``sqrt(2T)`` checkpoints, the largest unit about ``sqrt(2T)`` iterations: within a
  factor 1.5 of the known-``T`` optimum, with no estimate needed). One extra forward.
* ``("binomial", s)``: units of one iteration and at most ``s`` stored states (plus the one in
  use), placed by Griewank's binomial rule (revolve; the loop's initial state, outside the loop,
  is one more snapshot): with ``r`` the smallest integer such that ``C(s + 1 + r, s + 1) >= T``,
  every iteration is recomputed at most about ``r`` times. For a ``while_`` loop
  (``T`` unknown while unrolling), unrolling keeps at most ``s // 2`` evenly spaced states,
  doubling their spacing when full (online); backward then reverses each interval with the
  binomial rule and the slots left. Chains only (not ``g.recurse``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compute import ComputeNode, _as_value
from ..errors import GraphStateError
from ..ops import LazyGrad

if TYPE_CHECKING:
    from .unrolled import UnrolledGraph

#: Node types whose values are never dropped (structure guards: tiny, and re-running them would
#: call the user's condition again).
KEPT_TYPES = frozenset(("LoopCheck", "LengthCheck", "StructureCheck"))

_SCHEDULES = (
    'an int k >= 1 (keep the state every k iterations), "sqrt", or ("binomial", s) with s >= 1 stored states'
)


@dataclass(frozen=True)
class Schedule:
    """A checkpointing schedule, as declared (see the module docstring).

    Attributes:
        kind: ``"every"``, ``"sqrt"`` or ``"binomial"``.
        k: iterations per unit for ``"every"``.
        slots: stored states for ``"binomial"``.
    """

    kind: str
    k: int = 0
    slots: int = 0

    def __str__(self) -> str:
        if self.kind == "every":
            return f"checkpoint every {self.k}"
        if self.kind == "sqrt":
            return "checkpoint sqrt"
        return f"checkpoint binomial({self.slots})"


def schedule_arg(value: Any, where: str, recursion: bool = False) -> Schedule | None:
    """Check a ``checkpoint=`` argument and return its :class:`Schedule` (``None``: keep all).

    Args:
        value: ``None``, an int ``k >= 1``, ``"sqrt"`` or ``("binomial", s)`` with ``s >= 1``.
        where: names the loop in error messages (e.g. ``"g.loop() <Loop:2> 'rnn'"``).
        recursion: whether the loop is a recursion (``binomial`` needs a chain).

    Raises:
        TypeError: ``value`` is of none of those types (e.g. a float or a bool).
        ValueError: ``k <= 0``, ``s <= 0`` (a budget of 0), an unknown string or tuple, or
            ``binomial`` on a recursion.
    """
    if value is None:
        return None
    if isinstance(value, (bool, float, np.bool_, np.floating)):
        raise TypeError(f"{where}: checkpoint={value!r} is not a schedule; expected {_SCHEDULES}")
    if isinstance(value, (int, np.integer)):
        k = int(value)
        if k <= 0:
            raise ValueError(
                f"{where}: checkpoint={k} cannot work: a unit must hold at least one iteration "
                "(checkpoint=1 keeps the state after every iteration)"
            )
        return Schedule("every", k=k)
    if isinstance(value, str):
        if value == "sqrt":
            return Schedule("sqrt")
        raise ValueError(f"{where}: unknown checkpoint schedule {value!r}; expected {_SCHEDULES}")
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "binomial":
        s = value[1]
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"{where}: checkpoint=('binomial', s) needs an int s, got {s!r}")
        if s <= 0:
            raise ValueError(
                f"{where}: checkpoint=('binomial', {s}) cannot work: it needs a budget of at least "
                "one stored state (s >= 1)"
            )
        if recursion:
            raise ValueError(
                f"{where}: checkpoint=('binomial', {s}) needs a chain (each iteration reads only the "
                "previous one); a recursion reads any earlier node: use an int k or 'sqrt'"
            )
        return Schedule("binomial", slots=int(s))
    raise (TypeError if not isinstance(value, tuple) else ValueError)(
        f"{where}: checkpoint={value!r} is not a schedule; expected {_SCHEDULES}"
    )


# ---------------------------------------------------------------------------- binomial rule


def _beta(s: int, r: int) -> int:
    """How many steps ``s`` stored states reverse with at most ``r`` recomputations each."""
    return math.comb(s + r, s)


def binomial_split(n: int, free: int) -> int:
    """Where to place the next checkpoint when reversing ``n >= 2`` steps from a stored state
    with ``free >= 1`` more slots: the number of steps to advance first.

    Griewank's rule (revolve) counts the starting state among the ``c = free + 1`` snapshots.
    With ``r`` the smallest number of repetitions such that ``C(c + r, c) >= n``, a split ``m``
    keeps both parts within their binomial bounds when the right part (``n - m`` steps, ``c - 1``
    snapshots, ``r`` repetitions) and the left part (``m`` steps, reversed later with ``c``
    snapshots and ``r - 1`` repetitions) fit: ``n - C(c - 1 + r, c - 1) <= m <= C(c + r - 1, c)``.
    We take the middle of that range: within 3% of the optimal total number of steps
    (dynamic programming) for the cases in tests/test_checkpoint.py.
    """
    c = free + 1
    r = 1
    while _beta(c, r) < n:
        r += 1
    lo = max(1, n - _beta(c - 1, r))
    hi = min(n - 1, _beta(c, r - 1))
    return max(1, (lo + hi) // 2)


def binomial_positions(trips: int, slots: int) -> set[int]:
    """The states a first forward of ``trips`` steps keeps with ``slots`` stored states (position
    ``p``: the state entering step ``p``; position 0, the loop's initial state, is free)."""
    kept: set[int] = set()
    a, n, free = 0, trips, slots
    while free > 0 and n > 1:
        m = binomial_split(n, free)
        a, n, free = a + m, n - m, free - 1
        kept.add(a)
    return kept


# ---------------------------------------------------------------------------- book-keeping


class _Unit:
    """Consecutive iterations ``first..last`` of one loop instance whose values are dropped
    together. ``nodes``: its droppable nodes (op nodes and sampled leaves) in creation order;
    ``bound``: those of them later units read (binomial only: with other schedules boundaries are
    never dropped and not listed); ``inner``: ``nodes`` minus ``bound``; ``order``: every op node
    and sampled leaf of the unit, kept ones too, in creation order — what a recomputation walks
    (every sample must be drawn again, in order, for the generator to stay in step)."""

    __slots__ = (
        "rec", "index", "first", "last", "lo", "hi", "nodes", "inner", "bound", "order", "rng_state",
        "parent", "children", "child_los", "ends",
    )  # fmt: skip

    def __init__(self, rec: LoopRecord, index: int, first: int, last: int, lo: int, hi: int) -> None:
        self.rec, self.index, self.first, self.last, self.lo, self.hi = rec, index, first, last, lo, hi
        self.nodes: list[ComputeNode] = []
        self.inner: list[ComputeNode] = []
        self.bound: list[ComputeNode] = []
        self.order: list[ComputeNode] = []
        self.rng_state: Mapping[str, Any] | None = None  # the generator's state when it started
        # Units of checkpointed loops inside this one (an outer unit covers them), by first
        # serial; ``ends``: every unit inside, at any depth, by last serial.
        self.parent: _Unit | None = None
        self.children: list[_Unit] = []
        self.child_los: list[int] = []
        self.ends: list[_Unit] = []


class LoopRecord:
    """The checkpointing of one loop instance (a loop in one iteration path): its units, which
    states are stored, and how to bring a unit's values back.

    Created by :meth:`Rematerializer.start_loop` when unrolling reaches a checkpointed loop; the
    unroller calls :meth:`end_iteration` after every iteration and :meth:`finish` at the end.
    """

    def __init__(
        self,
        manager: Rematerializer,
        loop: Any,
        idx: tuple[int, ...],
        schedule: Schedule,
        trips: int | None,
        kids: Any = None,
        rng: np.random.Generator | None = None,
        training: bool = True,
    ) -> None:
        self.manager = manager
        self.rng, self.training = rng, training
        self.loop, self.idx, self.schedule, self.trips = loop, idx, schedule, trips
        self.units: list[_Unit] = []
        self.binomial = schedule.kind == "binomial"
        # Positions p whose state (the boundary of unit p - 1) is stored; 0 (the loop's initial
        # state, outside the loop) is always available and not listed.
        self.stored: set[int] = set()
        self.forward_positions: set[int] | None = None
        if self.binomial and trips is not None:
            self.forward_positions = binomial_positions(trips, schedule.slots)
        self.spacing = 1  # online binomial: stored positions are the multiples of this
        self._cursor: int | None = None  # a stored position beyond the budget, see materialize
        self.swept = False  # a backward sweep is using (and freeing) the stored states
        self.last_reader = None
        if kids is not None:  # a recursion: which later node reads each node's state
            n = len(kids)
            last = np.full(n, -1)
            rows = np.arange(n)
            for j in range(kids.shape[1]):
                col = kids[:, j]
                has = col >= 0
                np.maximum.at(last, col[has], rows[has])
            self.last_reader = last
        cg = manager.cg
        self._start = len(cg._nodes)
        self._first = 0
        self._lo = manager.clock()
        self._rng_state = rng.bit_generator.state if rng is not None else None
        self._states: list[Sequence[ComputeNode]] = []  # per iteration of the open unit
        self._collected: list[ComputeNode] = []
        # Never dropped: what the code after the loop reads (final state, stacked values) and
        # carries passed through a unit unchanged.
        self.pinned: set[ComputeNode] = set()

    # -- while unrolling
    def unit_length(self, u: int) -> int:
        """How many iterations unit ``u`` holds."""
        kind = self.schedule.kind
        if kind == "every":
            return self.schedule.k
        if kind == "sqrt":
            return max(1, math.ceil(math.sqrt(self.trips))) if self.trips is not None else u + 1
        return 1

    def end_iteration(self, t: int, state: Sequence[ComputeNode], collected: Iterable[ComputeNode]) -> None:
        """Iteration ``t`` is built: close the open unit if it is complete."""
        self._states.append(state)
        self._collected.extend(collected)
        if t + 1 - self._first >= self.unit_length(len(self.units)):
            # the last unit keeps its values: backward starts there
            self._close(t, drop=self.trips is None or t + 1 < self.trips)

    def finish(self, t_end: int, state: Sequence[ComputeNode]) -> None:
        """The loop ran ``t_end`` iterations and ended with ``state``: close the last unit; the
        final state is read after the loop and never dropped."""
        self.pinned.update(state)
        if t_end > self._first:  # the last unit keeps its values: backward starts there
            self._close(t_end - 1, drop=False)
        for unit in self.units[-1:]:  # the final state may have been listed as a boundary
            pinned = self.pinned
            unit.nodes = [n for n in unit.nodes if n not in pinned]
            unit.inner = [n for n in unit.inner if n not in pinned]
            unit.bound = [n for n in unit.bound if n not in pinned]

    def _close(self, last: int, drop: bool = True) -> None:
        manager, cg = self.manager, self.manager.cg
        count = len(cg._nodes) - self._start
        new = list(itertools.islice(reversed(cg._nodes.values()), count))
        new.reverse()
        self._start = len(cg._nodes)
        lo, hi = self._lo, manager.clock()
        self._lo = hi
        unit = _Unit(self, len(self.units), self._first, last, lo, hi)
        # What later units read: the state at the end, and in a recursion the states read by
        # parents beyond this unit.
        bound: dict[ComputeNode, None] = dict.fromkeys(self._states[-1])
        if self.last_reader is not None:
            for t, st in zip(range(self._first, last + 1), self._states):
                if self.last_reader[t] > last:
                    bound.update(dict.fromkeys(st))
        pinned = self.pinned
        pinned.update(self._collected)  # loop.stack reads them after the loop
        samples = cg._samples  # sampled leaves: dropped too, drawn again when recomputed
        for n in list(bound):
            if n.serial < lo:  # a carry passed through unchanged: created by an earlier unit
                pinned.add(n)
                del bound[n]
        keep_bound = not self.binomial
        unit.order = [n for n in new if (n.op is not None or n in samples) and n.key.type not in KEPT_TYPES]
        unit.nodes = [n for n in unit.order if n not in pinned and not (keep_bound and n in bound)]
        if self.binomial:
            unit.bound = [n for n in unit.nodes if n in bound]
            unit.inner = [n for n in unit.nodes if n not in bound]
        else:
            unit.inner = unit.nodes
        if self.rng is not None:
            if any(n.op is None for n in unit.order):
                unit.rng_state = self._rng_state
            self._rng_state = self.rng.bit_generator.state
        self.units.append(unit)
        self._first = last + 1
        self._states, self._collected = [], []
        manager.add_unit(unit)
        # Drop what nobody needs any more.
        if drop:
            _drop(unit.inner)
        else:
            manager.live.append(unit)
        if self.binomial:
            p = unit.index + 1  # the state this unit produced
            prev = self.units[unit.index - 1] if unit.index > 0 else None
            if self.forward_positions is not None:
                if p in self.forward_positions:
                    self.stored.add(p)
            elif p % self.spacing == 0:  # online: evenly spaced, thinned when full
                self.stored.add(p)
                if len(self.stored) > max(1, self.schedule.slots // 2):
                    self.spacing *= 2
                    for q in [q for q in self.stored if q % self.spacing]:
                        self.stored.discard(q)
                        if q != p:
                            _drop(self.units[q - 1].bound)
            if prev is not None and unit.index not in self.stored and drop:
                # the state entering this unit: kept while it was built (and while it stays live)
                _drop(prev.bound)

    # -- bringing values back
    def _position_ready(self, p: int) -> bool:
        return p == 0 or all(n._value is not None for n in self.units[p - 1].bound)

    def materialize(self, unit: _Unit, upto: ComputeNode | None = None, sweeping: bool = False) -> None:
        """Give every dropped node of ``unit`` its value again (up to ``upto`` only, if given),
        computed from the stored state before it; binomial: advance from the nearest stored
        state, storing new states as the binomial rule says. ``sweeping``: called by backward,
        which will not need the states after this unit again (their slots are freed)."""
        if self.binomial:
            i = unit.index
            old, self._cursor = self._cursor, None
            if sweeping:
                self.swept = True
                for q in [q for q in self.stored if q > i + 1]:  # states the sweep has passed
                    self.stored.discard(q)
                    _drop(self.units[q - 1].bound)
            a = max([q for q in self.stored if q <= i and self._position_ready(q)], default=0)
            if not self._position_ready(i):
                # backward frees the states after unit i as it goes; other callers keep them
                used = sum(1 for q in self.stored if q <= i) if sweeping else len(self.stored)
                free = self.schedule.slots - used
                while a < i:
                    n = i - a + 1
                    m = i - a if free <= 0 else min(binomial_split(n, free), i - a)
                    for j in range(a, a + m):  # advance: run unit j, keep only its boundary
                        u = self.units[j]
                        self._recompute(u)
                        _drop(u.inner)
                        if j > a and j not in self.stored:
                            _drop(self.units[j - 1].bound)
                    a += m
                    if a == i and a not in self.stored and free <= 0:
                        self._cursor = i  # over the budget: only until the next unit is asked for
                    self.stored.add(a)
                    free -= 1
            elif old == i:
                self._cursor = old
            if old is not None and old != self._cursor and old in self.stored:
                # The previous over-budget state: reading units one after another advances from
                # it (one unit each), and it never adds up to more than one state.
                self.stored.discard(old)
                _drop(self.units[old - 1].bound)
        self._recompute(unit, upto)

    def _recompute(self, unit: _Unit, upto: ComputeNode | None = None) -> None:
        """Run ``unit``'s dropped nodes in creation order (up to ``upto``). Sampled leaves
        (dropout masks) are drawn again from the generator state the unit started with, every one
        in order, so each gets exactly the value the build drew."""
        run = self.manager.run
        rng = None
        if unit.rng_state is not None:
            rng = np.random.default_rng()
            rng.bit_generator.state = unit.rng_state
            samples, dtype = self.manager.cg._samples, self.manager.cg.dtype
        # Inner checkpointed loops drop their units again as the recomputation passes their
        # ends, as the build did (not for a partial recomputation, which forward asks for).
        ends = unit.ends if upto is None else []
        j = 0
        for node in unit.order:
            while j < len(ends) and node.serial > ends[j].hi:
                ends[j].rec.rebuilt(ends[j])
                j += 1
            if node.op is None:  # a sampled leaf: draw (also when present, to stay in step)
                fn, like = samples[node]
                value = fn(rng, like._value if like._value is not None else like.value, self.training)
                if node._value is None:
                    node._value = _as_value(value, dtype)
            elif node._value is None:
                node._value = run(node)
            if node is upto:
                break
        else:
            for inner in ends[j:]:
                inner.rec.rebuilt(inner)

    def rebuilt(self, unit: _Unit) -> None:
        """``unit`` was just recomputed as part of an enclosing unit: drop what the build dropped
        when it closed it."""
        _drop(unit.inner)
        if self.binomial and unit.index > 0 and unit.index not in self.stored:
            _drop(self.units[unit.index - 1].bound)

    def end_sweep(self) -> None:
        """A backward sweep through this loop is over: what it left stored are the states near
        the loop's start, useless to the next backward, which would find no free slot. Free them
        all: the next backward reverses the loop from its initial state with all ``s`` slots."""
        if self.swept:
            for q in self.stored:
                _drop(self.units[q - 1].bound)
            self.stored.clear()
            self._cursor = None
            self.swept = False

    def release(self, unit: _Unit) -> None:
        """Drop ``unit``'s values again (what a fresh unroll would have dropped), and with
        binomial the states entering and leaving it unless they are stored."""
        _drop(unit.inner)
        if self.binomial:
            if (unit.index + 1) not in self.stored:
                _drop(unit.bound)
            if unit.index > 0 and unit.index not in self.stored:
                _drop(self.units[unit.index - 1].bound)

    def share_stack(self, stack: ComputeNode, collected: Sequence[ComputeNode]) -> None:
        """The values ``loop.stack`` collected become views of the rows of the ``Stack`` node's
        value (equal by construction), so that they are not held twice."""
        if not self.units:
            return
        value, lo = stack._value, self.units[0].lo
        for t, n in enumerate(collected):
            if n.op is not None and n.serial > lo and n._value is not None:
                n._value = value[t]

    def kept_iterations(self) -> set[int]:
        """Iterations whose end state is stored (the checkpoints), for rendering."""
        if not self.binomial:
            return {u.last for u in self.units}
        return {self.units[p - 1].last for p in self.stored if 0 < p <= len(self.units)}


_MAX_DEPTH = 64  # nesting of checkpointed loops a recomputation descends through


def _drop(nodes: Iterable[ComputeNode]) -> None:
    for n in nodes:
        n._value = None  # recomputed when needed


class Rematerializer:
    """The checkpointing of one unrolled graph: every checkpointed loop instance, and the units
    whose values are currently present (being swept by backward, or read on demand).

    Attached with ``cg.attach_dropped_values``: it is the graph's
    :class:`~vgraph.compute.DroppedValues`, whose methods the engine calls.
    """

    def __init__(self, cg: UnrolledGraph, clock: Any) -> None:
        self.cg = cg
        self.clock = clock
        self.records: list[LoopRecord] = []
        # Outermost units by their first serial (an outer unit covers the inner loops' units).
        self._los: list[int] = []
        self._units: list[_Unit] = []
        self.live: list[_Unit] = []  # units whose values are present now
        self._grad_leaves: list[ComputeNode] | None = None  # during a backward sweep
        self.recomputed = 0  # node values recomputed (for benchmarks and tests)

    def run(self, node: ComputeNode) -> Any:
        self.recomputed += 1
        return self.cg._run(node)

    def start_loop(
        self,
        loop: Any,
        idx: tuple[int, ...],
        schedule: Schedule,
        trips: int | None,
        kids: Any = None,
        rng: np.random.Generator | None = None,
        training: bool = True,
    ) -> LoopRecord:
        rec = LoopRecord(self, loop, idx, schedule, trips, kids, rng, training)
        self.records.append(rec)
        return rec

    def add_unit(self, unit: _Unit) -> None:
        covered: list[_Unit] = []
        while self._los and self._los[-1] >= unit.lo:  # inner units this one covers
            self._los.pop()
            covered.append(self._units.pop())
        if covered:  # their nodes are this unit's too now
            self.live = [u for u in self.live if u.lo < unit.lo]
            covered.reverse()
            for c in covered:
                c.parent = unit
            unit.children = covered
            unit.child_los = [c.lo for c in covered]
            unit.ends = sorted([*covered, *(e for c in covered for e in c.ends)], key=lambda u: u.hi)
        self._los.append(unit.lo)
        self._units.append(unit)

    def _find(self, serial: int) -> _Unit | None:
        """The unit to recompute for a dropped node: the outermost unit holding it, or, while
        that unit's values are present, the inner loop's unit holding it (at any depth)."""
        i = bisect.bisect_right(self._los, serial) - 1
        unit = self._units[i] if i >= 0 and serial <= self._units[i].hi else None
        while unit is not None and unit.children and unit in self.live:
            i = bisect.bisect_right(unit.child_los, serial) - 1
            if i < 0 or serial > unit.children[i].hi:
                break
            unit = unit.children[i]
        return unit

    def unit_of(self, node: ComputeNode) -> _Unit:
        unit = self._find(node.serial)
        if unit is None:
            raise GraphStateError(f"{node.describe()} has no value and belongs to no checkpointed unit")
        return unit

    def _release_live(self, keep: _Unit | None = None, above: int | None = None) -> None:
        kept = set()
        while keep is not None:  # the unit and the units enclosing it
            kept.add(keep)
            keep = keep.parent
        still = []
        for u in self.live:
            if u in kept or (above is not None and u.lo < above):
                still.append(u)
            else:
                u.rec.release(u)
        self.live = still

    def _bring(self, unit: _Unit, upto: ComputeNode | None = None, sweeping: bool = False) -> None:
        unit.rec.materialize(unit, upto, sweeping)
        if unit not in self.live:
            self.live.append(unit)

    # -- backward
    def backward_value(self, node: ComputeNode) -> Any:
        """The value of ``node`` for the backward sweep, with its parents' values present.

        If one of them was dropped, its unit is recomputed (units the sweep has left, created
        after ``node``, are dropped again first).
        """
        for attempt in range(_MAX_DEPTH):
            v = node._value
            missing = None if v is not None else node
            for p in node.parents:
                if missing is not None:
                    break
                if p._value is None:
                    missing = p
            if missing is None:
                return v
            # First the node's own unit (a kept boundary or stacked value reads its unit's nodes;
            # binomial: bringing a unit back restores the state it starts from), then the unit of
            # what is still missing: a recomputed outer unit drops its inner loops' units again,
            # and the next round brings back the inner unit needed.
            unit = (self._find(node.serial) if attempt == 0 else None) or self.unit_of(missing)
            if self._grad_leaves is None:
                self._grad_leaves = [leaf for leaf in self.cg._leaves if leaf.requires_grad]
            if self.live:
                self._compact()
            self._release_live(unit, above=node.serial + 1)
            self._bring(unit, sweeping=True)
        raise GraphStateError(f"{node.describe()}: could not recompute the values its VJP reads")

    def _compact(self) -> None:
        """Sum the weight and bias gradients collected so far (the engine collects a tied
        weight's per-iteration products to compute them as one, ``ops.RowsProductGrad``, and a
        bias's per-iteration contributions to reduce them at once, ``ops.LeadingSumGrad``, which
        keeps them alive until the sweep ends): unit by unit here, so that memory stays bounded.
        Same sum, grouped per unit."""
        for leaf in self._grad_leaves or ():
            g = leaf._g
            if isinstance(g, LazyGrad):
                g.compact()

    def end_backward(self) -> None:
        """The sweep is over (or failed): drop every unit it brought back."""
        self._grad_leaves = None
        self._release_live()
        for rec in self.records:
            if rec.binomial:
                rec.end_sweep()

    # -- on demand
    def value(self, node: ComputeNode) -> Any:
        """``node.value`` of a dropped node: recompute its unit (from the stored state before it)
        and keep that one unit present until another unit is asked for."""
        for _ in range(_MAX_DEPTH):  # an outer unit, then the inner loop's unit holding it
            if node._value is not None:
                return node._value
            unit = self.unit_of(node)
            self._release_live(unit)
            self._bring(unit)
        raise GraphStateError(f"{node.describe()}: could not recompute its value")

    # -- forward
    def forward(self, plan: Sequence[ComputeNode], on_dirty: Any) -> None:
        """A dirty-checked forward over ``plan`` in which values may be dropped.

        ``on_dirty(node)`` recomputes a node whose parents changed. A dropped parent of such a
        node is brought back first (its unit up to it, from current values: every node before it
        has been brought up to date by then); each unit is dropped again when the walk leaves it,
        so memory stays bounded.
        """
        self._release_live()
        held: list[_Unit] = []  # the units being recomputed: the current one and the one before
        try:
            self._forward(plan, on_dirty, held)
        finally:
            for u in held:
                u.rec.release(u)
            self._release_live()

    def _forward(self, plan: Sequence[ComputeNode], on_dirty: Any, held: list[_Unit]) -> None:
        los, units = self._los, self._units
        for n in plan:
            version = n.version
            for p in n.parents:
                if p.version > version:
                    break
            else:
                continue
            i = bisect.bisect_right(los, n.serial) - 1
            u = units[i] if i >= 0 and n.serial <= units[i].hi else None
            if u is not None and (not held or held[-1] is not u):
                held.append(u)
                if len(held) > 2:  # the next unit reads the previous one's boundary only
                    old = held.pop(0)
                    old.rec.release(old)
            for p in n.parents:
                if p._value is None:
                    pu = self.unit_of(p)
                    pu.rec.materialize(pu, upto=p)
                    if pu not in held and pu not in self.live:
                        self.live.append(pu)
            on_dirty(n)
