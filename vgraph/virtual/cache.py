"""Cached structures: a build whose structure was seen before re-runs the graph it built then.

Unrolling costs Python work per node; a training loop over inputs of a few shapes unrolls the same
structure again and again. The cache keeps the last few unrolled graphs, keyed by what decides a
structure before any value is looked at — the outputs, the declarations, train/eval and grad mode,
hoisting, and the names, shapes and dtypes of the feed — from the structure's second build on
(see :class:`BuildCache`). A build with a known key hands the cached
graph's nodes to a new :class:`UnrolledGraph`, feeds the new values, redraws sampled nodes (dropout
masks) exactly as a fresh build would, and re-runs every node in creation order; the recorded
decisions (trip counts, branch choices, recursion structures) are guards, re-checked on the way.
If one says the structure differs, the build unrolls afresh — callers never see the difference.
A graph whose loops step through sequences is kept by its feed's shapes *without* their leading
axis, and serves every length up to its own (see :mod:`.elastic`) — or every length and every
tree, where each of those loops and recursions ran as a body program, which runs any number of
iterations (:meth:`~.program.ProgramInstance.takes_length`).

What an earlier graph means afterwards: the graph object a build returned is *superseded* when a
later build of the same key takes its nodes over (whether or not the structure turned out the
same). Using it raises a :class:`~vgraph.errors.GraphStateError` that says so — it never shows
the later build's values silently. Node objects taken from it belong to the new build. Build with
``cache=False`` to keep several graphs of one structure side by side.

Threads: each thread has its own cache (up to ``size`` graphs each). A build re-runs only a graph
that its own thread built, so a graph returned to one thread is never re-used, nor superseded,
by a build in another: the rule above holds per thread. (Builds of one VirtualGraph also run one
at a time, see :func:`~vgraph.virtual.graph.one_build_at_a_time`; that is what serialises every
use of this object.)
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..errors import GraphStateError

if TYPE_CHECKING:
    from .unrolled import UnrolledGraph

DEFAULT_CACHE_SIZE = 4


class _Table:
    """One thread's cached graphs and the structure keys it has seen (see :class:`BuildCache`)."""

    __slots__ = ("__weakref__", "entries", "seen")

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[Any, ...], UnrolledGraph] = OrderedDict()
        self.seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()


class BuildCache:
    """A small LRU of unrolled graphs by structure key (see the module docstring).

    A graph is admitted on its structure's *second* build: a structure seen once may never come
    back (a new sentence length every step), and keeping its graph alive would only hold memory
    that the next build could have reused warm. So a structure that repeats is unrolled twice,
    then re-run; one that does not costs nothing but its key in a bounded list.

    Memory: each entry keeps one unrolled graph with its values alive, so the cache holds at most
    ``size`` graphs (the one a training step is using among them) per thread that builds; a
    thread's graphs are freed when the thread ends.

    Each thread sees only its own entries (a graph is re-run only in the thread that built it);
    :meth:`resize` and :meth:`clear` apply to every thread's. The caller serialises the calls
    (builds of one VirtualGraph hold its build lock).
    """

    SEEN = 256  # structure keys remembered for admission

    def __init__(self, size: int = DEFAULT_CACHE_SIZE) -> None:
        self.size = size
        self._local = threading.local()  # .table: the calling thread's _Table
        self._tables: weakref.WeakSet[_Table] = weakref.WeakSet()  # every live thread's

    def _mine(self) -> _Table:
        """The calling thread's table (made on its first use)."""
        table: _Table | None = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = _Table()
            self._tables.add(table)
        return table

    def __len__(self) -> int:
        """How many graphs the calling thread has cached."""
        return len(self._mine().entries)

    def resize(self, size: int) -> None:
        """Keep at most ``size`` graphs per thread from now on (the least recently used go first)."""
        self.size = size
        for table in list(self._tables):
            self._trim(table.entries)

    def _trim(self, entries: OrderedDict[tuple[Any, ...], UnrolledGraph]) -> None:
        """Drop the least recently used graphs beyond :attr:`size`."""
        while len(entries) > max(self.size, 0):
            entries.popitem(last=False)

    def take(self, key: tuple[Any, ...]) -> UnrolledGraph | None:
        """Remove and return the graph the calling thread cached under ``key`` (the caller puts
        back what it returns)."""
        return self._mine().entries.pop(key, None)

    def admits(self, key: tuple[Any, ...]) -> bool:
        """Whether :meth:`put` would keep a graph under ``key`` (its structure was built before,
        in the calling thread)."""
        table = self._mine()
        return self.size > 0 and (key in table.entries or key in table.seen)

    def put(self, key: tuple[Any, ...], cg: UnrolledGraph, replayed: bool = False) -> None:
        """Keep ``cg`` under ``key`` if this structure was built before (see the class docstring);
        ``replayed``: :meth:`take` gave a graph for this structure (re-run, or replaced by ``cg``
        because the structure turned out different) — keep it."""
        if self.size <= 0:
            return
        table = self._mine()
        entries, seen = table.entries, table.seen
        if not replayed and key not in entries and key not in seen:
            seen[key] = None  # first sighting: remember the key, not the graph
            if len(seen) > self.SEEN:
                seen.popitem(last=False)
            return
        seen.pop(key, None)
        entries[key] = cg
        entries.move_to_end(key)
        self._trim(entries)

    def clear(self) -> None:
        """Forget every thread's graphs and seen keys."""
        for table in list(self._tables):
            table.entries.clear()
            table.seen.clear()


class SupersededGraph:
    """What an :class:`UnrolledGraph` turns into when a later build of the same structure takes
    its nodes over: every use raises a :class:`~vgraph.errors.GraphStateError` saying so."""

    def __getattr__(self, name: str) -> Any:
        raise GraphStateError(
            "this unrolled graph was superseded: a later build of the same structure re-used its "
            "nodes for new values (see vgraph.virtual.cache). Use the graph that build returned, or "
            "build with cache=False to keep several graphs of one structure side by side"
        )

    def __repr__(self) -> str:
        return "<UnrolledGraph superseded by a later build of the same structure>"

    # Special methods are looked up on the type, not through __getattr__.
    def __len__(self) -> int:
        return self.nodes  # raises

    def __contains__(self, key: object) -> bool:
        return self.nodes  # raises

    def __getitem__(self, key: object) -> Any:
        return self.nodes  # raises

    def __iter__(self) -> Any:
        return self.nodes  # raises
