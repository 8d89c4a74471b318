"""Grad mode and anomaly mode: the two switches every layer reads, kept per thread.

Both are set only by context managers that restore the previous setting on exit
(:func:`no_grad`, :func:`detect_anomaly`), and both belong to the thread that set them, as
PyTorch's grad mode does: ``with vg.no_grad():`` in one thread changes nothing for a build or a
backward running in another. A new thread starts with gradients on and anomaly detection off,
whatever the thread that started it is inside (enter ``no_grad()`` in the new thread's own code to
build without gradients there).

This module sits below every other layer (it imports nothing of vgraph but its errors), so
``ops`` and ``compute`` read the switches without importing anything above them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal, overload

import numpy as np

from .errors import ArgumentError, ArgumentValueError


def flag_arg(flag: Any, what: str) -> bool:
    """``flag`` checked as a True/False option (``what``: how the message names it, e.g.
    ``"build(hoist=...)"``); numpy's bools are accepted.

    Raises:
        ArgumentError: ``flag`` is not a bool (``"yes"``, ``1``, ``None`` are refused rather than
            read by their truth value).
    """
    if flag is True or flag is False:
        return flag
    if isinstance(flag, np.bool_):
        return bool(flag)
    raise ArgumentError(f"{what} must be True or False, got {type(flag).__name__} {flag!r:.80}")


@overload
def int_arg(
    value: Any, what: str, minimum: int | None = None, *, optional: Literal[False] = False
) -> int: ...
@overload
def int_arg(value: Any, what: str, minimum: int | None = None, *, optional: bool) -> int | None: ...
def int_arg(value: Any, what: str, minimum: int | None = None, *, optional: bool = False) -> int | None:
    """``value`` checked as an integer option and returned as a Python ``int`` (``what``: how the
    message names it, e.g. ``"count"``); numpy's integers are accepted.

    Args:
        value: the argument.
        what: its name in the message.
        minimum: the smallest value allowed (``None``: any int).
        optional: ``None`` is allowed too (and returned).

    Raises:
        ArgumentError: ``value`` is not an int (a bool, ``2.0`` or ``"3"`` are refused rather than
            converted).
        ArgumentValueError: ``value`` is less than ``minimum``.
    """
    if value is None and optional:
        return None
    bound = "" if minimum is None else f" >= {minimum}"
    alternative = " or None" if optional else ""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(
            f"{what} must be an int{bound}{alternative}, got {type(value).__name__} {value!r:.80}"
        )
    if minimum is not None and value < minimum:
        raise ArgumentValueError(f"{what} must be an int{bound}{alternative}, got {value}")
    return int(value)


class _Modes(threading.local):
    """Per thread: the switches. The class attributes are every new thread's starting values
    (a ``threading.local`` instance starts empty in each thread and falls back to them)."""

    grad: bool = True
    anomaly: bool = False
    programs: bool | None = None


#: The calling thread's switches; read directly (``modes.state.grad``) where a function call per
#: node would show (ComputeGraph's node creation), else through the functions below.
state = _Modes()


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Nodes created inside this block record nothing for backward (``requires_grad=False``).

    Use it for evaluation and for updates that must not be differentiated. The previous mode is
    restored on exit, also when the block raises. The mode is the calling thread's: other threads
    keep building with gradients, and a thread started inside the block starts with gradients on.
    """
    modes = state
    previous = modes.grad
    modes.grad = False
    try:
        yield
    finally:
        modes.grad = previous


def is_grad_enabled() -> bool:
    """Whether nodes created now, in this thread, record what backward needs (``False`` inside
    ``no_grad()``)."""
    return state.grad


@contextlib.contextmanager
def detect_anomaly(enabled: bool = True) -> Iterator[None]:
    """Inside this block, the first NaN or Inf raises :class:`~vgraph.errors.NonFiniteError`.

    Forward (including the values computed while unrolling) checks every value an op produces;
    backward checks every gradient a VJP produces. The error names the unrolled node
    ``<type,id,idx>`` where the non-finite value first appears, its op, the finite status, range
    and shape of each input, and for backward the node whose VJP produced it — e.g.
    ``NaN first appears at <Log:1@37>: log of a negative input (min -0.02)``.

    Off by default; when off it costs one flag test per node. When on, each value is scanned
    once (see docs/performance.md). ``build``, ``forward`` and ``backward`` also take
    ``detect_anomaly=True`` for a single call. The mode is the calling thread's, like
    :func:`no_grad`: work running in other threads is not checked, and a new thread starts with
    detection off.

    Args:
        enabled: ``False`` turns detection off inside the block (e.g. around a part known to
            produce infinities on purpose).

    Raises:
        ArgumentError: ``enabled`` is not a bool (a TypeError).
    """
    enabled = flag_arg(enabled, "detect_anomaly(enabled=...)")
    modes = state
    previous = modes.anomaly
    modes.anomaly = enabled
    try:
        if enabled:  # the error says it all: no numpy warning before it (np.errstate is per thread)
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                yield
        else:
            yield
    finally:
        modes.anomaly = previous


def is_anomaly_enabled() -> bool:
    """Whether NaN/Inf detection is on in this thread (inside :func:`detect_anomaly`)."""
    return state.anomaly


#: A scope that does nothing (one for every use: ``nullcontext`` keeps no state).
_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def anomaly_scope(on: bool) -> contextlib.AbstractContextManager[None]:
    """``detect_anomaly()`` for a call that asked for it, else nothing (the thread's setting holds)."""
    return detect_anomaly() if on else _NOTHING


@contextlib.contextmanager
def body_programs(enabled: bool | None = True) -> Iterator[None]:
    """Inside this block, builds that do not say (``build(programs=...)``) run loops as body
    programs where they can (``True``), node by node (``False``: the reference path, whose graph
    has a node per body node per iteration), or choose per loop (``None``, the default outside any
    block: as a program, except in a cached build a loop whose structure the feed's shapes fix
    and whose body has no fused cell;
    see :func:`vgraph.build_compute_graph`). The mode is the calling thread's, like
    :func:`no_grad`: a new thread starts with ``None``.

    Args:
        enabled: ``True``, ``False`` or ``None`` as above.

    Raises:
        ArgumentError: ``enabled`` is not a bool or None (a TypeError).
    """
    if enabled is not None:
        enabled = flag_arg(enabled, "body_programs(enabled=...)")
    modes = state
    previous = modes.programs
    modes.programs = enabled
    try:
        yield
    finally:
        modes.programs = previous


def programs_mode() -> bool | None:
    """How builds in this thread run loops unless told otherwise: ``True`` (as body programs),
    ``False`` (node by node) or ``None`` (chosen per loop, the default); see :func:`body_programs`."""
    return state.programs
