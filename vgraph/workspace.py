"""Recycled memory for large arrays that the engine allocates again at every step.

A training step allocates the same large temporaries step after step: the stacked rows of a tied
weight's gradient product, the buffer that collects a hoisted group's per-iteration gradients.
Arrays this large (above glibc's ``mmap`` threshold) can come fresh from the operating system each
time, every page faulted in and zeroed on first touch: at (I, H, B, T) = (64, 256, 64, 100) that
was about 1,600 page faults and a tenth of a training step (docs/performance.md). A hand-written
loop avoids it by allocating its buffers once.

Only temporaries — arrays that die within the sweep that made them — go through it, not node
values: a value lives as long as its graph, so recycling one needs a second buffer while the
first is still read, and values of varying sizes (a language model's logits) would fill the pool
with memory the application's own allocations could otherwise reuse.

This module gives the engine the same thing without giving up fresh arrays: :func:`empty` and
:func:`zeros` hand out a view of a buffer kept from an earlier step **only if nothing refers to
that buffer any more** — no node value, no gradient, no view a user kept (CPython counts every
reference, and a numpy view refers to its base), so recycling never changes an array someone can
still read. Otherwise, or for arrays smaller than :data:`MIN_BYTES`, they allocate as numpy does.

The buffers are per thread. At most :func:`limit` bytes (64 MiB by default) in at most
:data:`MAX_BUFFERS` buffers are kept; the least recently used beyond that are forgotten (freed once
the last view of them goes), and an array over a quarter of the limit is allocated as usual.
``set_limit(0)`` turns recycling off.

**Transparent huge pages.** On Linux numpy asks the kernel to back every new array of 4 MiB or
more with 2 MiB "transparent huge pages" (``madvise(MADV_HUGEPAGE)``). A huge page is zeroed as a
whole when first touched, and on a virtual machine or a host short of free huge pages that fault can
cost far more than the small pages it replaces; numpy issue #31590 describes the same. A training
step of vgraph allocates its large values afresh (a language model's ``(T*B, vocabulary)`` logits
several times per step), a hand-written loop allocates them once: on the benchmark machine the
huge-page faults alone made the LSTM language model's step 1.3x slower at 64 sentences per batch
and 1.15x at 16 (docs/performance.md). So, like PyTorch's CPU allocator (no huge-page advice
unless its ``THP_MEM_ALLOC_ENABLE`` switch is set), vgraph's own work — building a virtual
graph (``build``, ``build_batch``), ``forward``, ``backward``, ``grad``, an optimiser's step —
runs with numpy's huge-page advice off, and restores numpy's setting when it returns (also on
errors, also when calls nest or run in several threads). Code outside vgraph is not affected, nor
are ops applied one at a time to compute nodes (``cg.apply``, ``x * y`` on nodes): a scope per op
would cost more than a small op.
:func:`set_huge_pages` ``(True)`` leaves numpy's setting alone; so does setting
``NUMPY_MADVISE_HUGEPAGE`` in the environment (numpy's own switch: you chose).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import numpy as np

from .modes import int_arg

#: Arrays smaller than this are allocated as usual: malloc serves them from its free lists cheaply.
MIN_BYTES = 1 << 17
#: At most this many buffers are kept per thread (each request looks through them).
MAX_BUFFERS = 64

_getrefcount = sys.getrefcount
_np_empty = np.empty
#: ``sys.getrefcount(buf)`` in the loop of :func:`_take` for a buffer nothing else refers to: the
#: pool's list, the loop variable and the call's argument.
_FREE = 3


class _Pool(threading.local):
    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []  # flat uint8 buffers, least recently used first
        self.bytes = 0


_pool = _Pool()
_limit = [64 << 20]


def limit() -> int:
    """The most bytes of buffers kept for reuse per thread (0: recycling is off)."""
    return _limit[0]


def set_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of buffers for reuse per thread; ``0`` turns recycling off.

    Buffers over the new limit are forgotten at once (an array still using one keeps it alive).

    Raises:
        ArgumentError: ``nbytes`` is not an int (a TypeError).
        ArgumentValueError: ``nbytes`` is negative (a ValueError).
    """
    nbytes = int_arg(nbytes, "workspace.set_limit: nbytes", 0)
    _limit[0] = nbytes
    _shrink(_pool, nbytes)


def kept_bytes() -> int:
    """Bytes of buffers this thread's pool holds (in use or free)."""
    return _pool.bytes


def clear() -> None:
    """Forget every buffer kept for reuse in this thread."""
    _shrink(_pool, 0)


def _shrink(pool: _Pool, nbytes: int) -> None:
    bufs = pool.buffers
    while bufs and pool.bytes > nbytes:
        pool.bytes -= bufs.pop(0).nbytes


def _take(nbytes: int) -> np.ndarray:
    """A free kept buffer of at least ``nbytes`` and at most twice that (the most recently used
    such), moved to the end of the list; or a new one, kept within the limit."""
    pool = _pool
    bufs = pool.buffers
    for i in range(len(bufs) - 1, -1, -1):
        buf = bufs[i]
        if _getrefcount(buf) == _FREE and nbytes <= buf.nbytes <= 2 * nbytes:
            if i != len(bufs) - 1:
                del bufs[i]
                bufs.append(buf)
            return buf
    cap = _limit[0]
    buf = _np_empty(nbytes, dtype=np.uint8)
    bufs.append(buf)
    pool.bytes += nbytes
    if pool.bytes > cap or len(bufs) > MAX_BUFFERS:
        _shrink(pool, cap)
        del bufs[: max(0, len(bufs) - MAX_BUFFERS)]
        pool.bytes = sum(b.nbytes for b in bufs)
    return buf


def _recycled(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
    """A view of ``shape`` and ``dtype`` into a kept buffer (see :func:`_take`), or None: the
    array is under :data:`MIN_BYTES` or over a quarter of the limit (0 when recycling is off)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    if n < MIN_BYTES or n > _limit[0] >> 2:
        return None
    out: np.ndarray = _take(n)[:n].view(dtype).reshape(shape)
    return out


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype``, from a recycled buffer if
    it is large and one is free (see the module docstring), else new."""
    dt = np.dtype(dtype)
    out = _recycled(shape, dt)
    return _np_empty(shape, dtype=dt) if out is None else out


def zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """:func:`empty`, filled with zeros: a recycled buffer by one ``fill``; a new array as
    :func:`numpy.zeros` makes it (large ones from pages the OS zeroes when first touched)."""
    dt = np.dtype(dtype)
    out = _recycled(shape, dt)
    if out is None:
        return np.zeros(shape, dtype=dt)
    out.fill(0)
    return out


# ---------------------------------------------------------------------------- huge pages


def _advice_switch() -> Callable[[bool], bool] | None:
    """numpy's switch for its huge-page advice (``switch(on)`` returns the previous setting; not
    in numpy's stubs), or None in a numpy without it: then there is nothing to turn off."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)  # numpy 2 / numpy 1
    switch: Callable[[bool], bool] | None = getattr(
        getattr(core, "multiarray", None), "_set_madvise_hugepage", None
    )
    return switch


_set_madvise_hugepage = _advice_switch()

_huge = ["NUMPY_MADVISE_HUGEPAGE" in os.environ]
_huge_lock = threading.Lock()
_huge_depth = [0]
_huge_saved: list[bool | None] = [None]


def huge_pages() -> bool:
    """Whether vgraph's own work lets numpy ask for transparent huge pages (numpy's setting then
    applies unchanged). ``False`` by default; ``True`` if ``NUMPY_MADVISE_HUGEPAGE`` was set in
    the environment when vgraph was imported. See the module docstring."""
    return _huge[0]


def set_huge_pages(allow: bool) -> None:
    """``True``: vgraph's work leaves numpy's huge-page advice as numpy has it (on Linux, on for
    arrays of 4 MiB or more unless ``NUMPY_MADVISE_HUGEPAGE=0``). ``False`` (the default): builds,
    forward and backward sweeps and optimiser steps run with it off. Takes effect at the next
    call into vgraph.

    Raises:
        TypeError: ``allow`` is not a bool.
    """
    if not isinstance(allow, bool):
        raise TypeError(f"workspace.set_huge_pages: allow must be a bool, got {type(allow).__name__}")
    _huge[0] = allow


class _NoHugePages(contextlib.AbstractContextManager["_NoHugePages"]):
    """The scope of vgraph's own work: numpy's huge-page advice off inside (unless
    :func:`huge_pages`), numpy's setting restored when the outermost scope in the process exits."""

    __slots__ = ()

    def __enter__(self) -> _NoHugePages:
        with _huge_lock:
            if _huge_depth[0] == 0 and not _huge[0] and _set_madvise_hugepage is not None:
                _huge_saved[0] = _set_madvise_hugepage(False)
            _huge_depth[0] += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with _huge_lock:
            _huge_depth[0] -= 1
            saved, switch = _huge_saved[0], _set_madvise_hugepage
            if _huge_depth[0] == 0 and saved is not None and switch is not None:
                _huge_saved[0] = None
                switch(saved)


#: ``with compute_scope:`` around every entry point that computes (see the module docstring).
compute_scope = _NoHugePages()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def computing(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate an entry point of vgraph's work: ``fn`` runs inside :data:`compute_scope`."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with compute_scope:
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a build or a recording sweep adds nodes.

    They allocate many long-lived objects, which would trigger repeated collections that traverse
    the whole growing graph and find nothing: compute graphs hold no reference cycles (nodes refer
    to their graph weakly). Restored on exit, also on errors.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
