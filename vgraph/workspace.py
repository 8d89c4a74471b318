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
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

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
        TypeError: ``nbytes`` is not an int.
        ValueError: ``nbytes`` is negative.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"workspace.set_limit: nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"workspace.set_limit: nbytes must be >= 0, got {nbytes}")
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
