"""The rules of a loop that every way of running one obeys — the per-node unroll
(:mod:`.builder`) and body programs (:mod:`.program`): when it stops (``times=``, the stepped
sequences' length, ``while_``, ``until``, ``max_iters`` with ``on_limit``) and what a carry may
become (its shape and dtype kept, a first update that only widens it allowed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BuildError, LoopLimitError, SelectorError, ShapeError
from .nodes import BranchNode, LoopNode


def reached_end(loop: LoopNode, t: int, length: int | None) -> bool:
    """Whether ``loop`` has run all its iterations before iteration ``t`` by count: ``times=``
    or the length of what it steps through."""
    return (loop.times is not None and t >= loop.times) or (length is not None and t >= length)


def first_count_stop(loop: LoopNode, length: int | None) -> int:
    """The first iteration before which ``loop`` may stop by count — ``times=``, the length of
    what it steps through (:func:`reached_end`) or ``max_iters`` (:func:`at_limit`): a runner of
    a loop without ``while_`` asks those rules there, and need not before."""
    return min(n for n in (loop.times, length, loop.max_iters) if n is not None)


def at_limit(loop: LoopNode, idx: tuple[int, ...], t: int) -> bool:
    """Whether iteration ``t`` would pass ``loop``'s ``max_iters``: ``True`` if the loop stops
    there (``on_limit="stop"``: a cap, recorded as a decision by the caller).

    Raises:
        LoopLimitError: the loop would go on past ``max_iters`` (``on_limit="raise"``).
    """
    if t < loop.max_iters:
        return False
    if loop.on_limit == "stop":
        return True
    raise LoopLimitError(
        f"{loop.describe(idx)} reached max_iters={loop.max_iters} and would go on; raise "
        "max_iters if that many iterations are intended, or check the loop's condition"
    )


def run_cond(
    loop: LoopNode,
    idx: tuple[int, ...],
    t: int,
    names: Sequence[str | None],
    values: Sequence[np.ndarray],
    until: bool = False,
) -> bool:
    """Run the loop's ``while_`` condition before iteration ``t`` (or ``until`` after it).

    Raises:
        BuildError: the condition raised, or returned something that is not one bool.
    """
    what = "until" if until else "while_"
    try:
        result = (loop.until if until else loop.cond)(t, dict(zip(names, values)))
    except Exception as e:
        raise BuildError(
            f"{loop.describe(idx)}: the {what} condition raised {type(e).__name__}: {e} at iteration {t}"
        ) from e
    if not isinstance(result, (bool, int, np.bool_, np.integer, np.ndarray)):
        raise BuildError(
            f"{loop.describe(idx)}: the {what} condition returned {result!r} ({type(result).__name__}) at "
            f"iteration {t}; it must return a bool (did it forget a return statement?)"
        )
    try:
        return bool(result)
    except ValueError:
        raise BuildError(
            f"{loop.describe(idx)}: the {what} condition returned an array of shape {np.shape(result)} at "
            f"iteration {t}; it must return one bool (use .all() or .any())"
        ) from None


def check_carry(
    loop: LoopNode, idx: tuple[int, ...], t: int, name: str | None, old: np.ndarray, new: np.ndarray, by: Any
) -> None:
    """Check that carry ``name``'s update in iteration ``t`` keeps its shape and dtype (the first
    update may widen the initial value: :func:`widens`). ``by``: the update's node (its
    ``describe()`` is called only for the error).

    Raises:
        ShapeError: it does not.
    """
    if (old.shape != new.shape or old.dtype != new.dtype) and not (t == 0 and widens(old, new)):
        raise ShapeError(
            f"{loop.describe(idx)}: carry {name!r} enters iteration {t} as {old.dtype}{list(old.shape)} "
            f"but is updated to {new.dtype}{list(new.shape)} by {by.describe()}; a carry must keep "
            "its shape and dtype (to collect values of growing size, use loop.stack)"
        )


def widens(init: np.ndarray, first: np.ndarray) -> bool:
    """Whether a carry's first update only broadcasts and safely casts its initial value (a
    learnable ``(1, H)`` initial state becomes ``(B, H)`` after the first step)."""
    try:
        shape_ok = np.broadcast_shapes(init.shape, first.shape) == first.shape
    except ValueError:
        return False
    return shape_ok and np.can_cast(init.dtype, first.dtype)


def select_option(branch: BranchNode, idx: tuple[int, ...], values: Sequence[np.ndarray]) -> int:
    """Run ``branch``'s selector on its keys' values: the option chosen in iteration path ``idx``.

    Raises:
        SelectorError: the selector raised, or returned something other than an option index.
    """
    try:
        choice = branch.selector(*values)
    except Exception as e:
        raise SelectorError(f"{branch.describe(idx)}: the selector raised {type(e).__name__}: {e}") from e
    if isinstance(choice, (bool, np.bool_)):
        choice = int(choice)
    if not isinstance(choice, (int, np.integer)):
        raise SelectorError(
            f"{branch.describe(idx)}: the selector returned {choice!r} ({type(choice).__name__}); "
            f"it must return an int in range({len(branch.options)})"
        )
    if not 0 <= choice < len(branch.options):
        raise SelectorError(
            f"{branch.describe(idx)}: the selector returned {choice}, but there are only "
            f"{len(branch.options)} options (valid: 0..{len(branch.options) - 1})"
        )
    return int(choice)
