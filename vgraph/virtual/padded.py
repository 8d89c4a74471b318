"""Values whose length differs per input, run as padded rows of one body program.

A program over rows (:class:`.batch._RowsProgram`) may read, from outside its loop, a value of
each input's own: attention's memory ``enc`` ``(S_i, H)``, whose length ``S_i`` differs per input.
Such a value is stacked as rows padded with zeros to the longest (``PadStack``); a body node
computed from it is *padded*: along one axis of its per-row value, its rows have a known length
per input (an *extent*) and padding after it. The rules here say, per op, where its result is
padded and how the padding is kept from reaching a real entry:

- every padded value is *clean*, zero in its padding: an op whose result may not be (``x + b``,
  ``exp``, a :func:`vgraph.defop` op) has its result's padding zeroed after it (``post``);
- a softmax along a padded axis sees ``-inf`` in the padding (``pre``): the padding gets weight
  zero, the real entries the softmax over the input's own length; so does a maximum along it
  (``+inf`` a minimum), its VJP too, which finds the entries equal to the result;
- a product or a sum that contracts a padded axis then adds zeros for the padding; a mean along
  it divides by the longest length, so its result, and the gradient its VJP gives its input,
  are scaled by the longest over the row's own length (``scale``);
- in backward, every padded node's gradient has its padding zeroed before its VJPs run, so that
  nothing a VJP computes from the padding (``0 / 0``) reaches a real entry.

Anything else on a padded value — a variance or an arg-max along its padded axis, a reshape, a
concatenation, a fused cell, a branch, a carry's update, a stacked value — has no rule: the
program is declined with the reason, and the loop runs op by op across the inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..ops import ALONG_AXIS, ELEMENTWISE, REDUCTION, Op

if TYPE_CHECKING:
    from .nodes import VirtualNode

#: Where a per-row value is padded: ``(axis of the per-row value, extent)``; an extent numbers one
#: vector of per-input lengths.
Padded = tuple[int, int]

# Elementwise ops that keep a zero zero (with finite other operands), so their result needs no mask.
_ZERO_KEEPING = frozenset({"Mul", "Neg", "Tanh", "Relu", "Identity", "Branch", "Detach", "Abs"})


class Rule(NamedTuple):
    """How one op node acts on padded inputs."""

    out: Padded | None  #: where its result is padded (``None``: it is not)
    pre: float | None = None  #: what its first input's padding is set to first (a softmax's ``-inf``)
    pre_vjp: bool = False  #: … for its VJP too (a maximum's, which looks for the result's entries)
    post: bool = False  #: its result's padding is zeroed after it
    scale: int | None = None  #: its result is scaled by longest / length of this extent (a mean's)


class MaskKey(NamedTuple):
    """A mask over rows: ``True`` at the real entries of per-row values of rank ``rank`` padded
    along ``axis`` with extent ``extent`` (``(rows, 1, …, longest, …, 1)``, broadcasting)."""

    extent: int
    rank: int
    axis: int


class ScaleKey(NamedTuple):
    """Per row, the longest length of extent ``extent`` over the row's own, shaped
    ``(rows, 1, …, 1)`` to broadcast against per-row values of rank ``rank`` (a mean's factor)."""

    extent: int
    rank: int


def rule(
    op: Op,
    attrs: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    padded: Sequence[Padded | None],
    out_shape: tuple[int, ...],
) -> Rule | str:
    """How ``op`` (with its declared ``attrs``) acts on inputs whose per-row ``shapes`` (padded)
    are padded as ``padded`` says, giving per-row values of ``out_shape``; or why it has no rule
    (a phrase completing "it …")."""
    name, kind = op.name, op.kind
    if all(r is None for r in padded):
        return Rule(None)
    rank = len(out_shape)
    if name == "MatMul":
        (sa, sb), (ra, rb) = shapes, padded
        # A vector operand acts as numpy makes it: a one-row matrix on the left, a one-column one
        # on the right (its axis 0 the matrix's axis 1, resp. 0), the new axis dropped after.
        if len(sa) == 1:
            sa, ra = (1, *sa), (None if ra is None else (1, ra[1]))
        if len(sb) == 1:
            sb, rb = (*sb, 1), rb
        ca = ra is not None and ra[0] == len(sa) - 1
        cb = rb is not None and rb[0] == len(sb) - 2
        if ca or cb:  # the contracted axis: both operands padded alike, their padding zeros
            if not (ca and cb) or (ra or (0, -1))[1] != (rb or (0, -2))[1]:
                return "contracts an axis whose length differs per input with one whose length does not"
            return Rule(None)
        if ra is not None and rb is not None:
            return "multiplies two values whose lengths differ per input along different axes"
        if ra is not None:  # along the rows of a: the result's second-to-last axis (last if b is a vector)
            if ra[0] != len(sa) - 2:
                return "batches over a padded axis"
            return Rule((rank - 2 if len(shapes[1]) > 1 else rank - 1, ra[1]))
        assert rb is not None  # along the columns of b: the result's last axis
        return Rule((rank - 1, rb[1])) if rb[0] == len(sb) - 1 else "batches over a padded axis"
    if name == "Linear":  # x @ w (+ b): x padded along an axis the product keeps
        rx = padded[0]
        if rx is None or any(r is not None for r in padded[1:]) or rx[0] >= len(shapes[0]) - 1:
            return "applies a weight to a value whose length differs per input along its last axis"
        return Rule((rx[0] + rank - len(shapes[0]), rx[1]), post=len(shapes) > 2)
    if name == "Transpose":
        (r,), n = padded, len(shapes[0])
        assert r is not None
        axes = attrs.get("axes")
        order = list(reversed(range(n))) if axes is None else [a % n for a in axes]
        return Rule((order.index(r[0]), r[1]))
    if kind == ELEMENTWISE:
        outs = {(r[0] + rank - len(s), r[1]) for s, r in zip(shapes, padded) if r is not None}
        if len(outs) != 1:
            return "combines values whose lengths differ per input along different axes or lengths"
        out = outs.pop()
        for s, r in zip(shapes, padded):  # a plain operand may only broadcast along the padded axis
            at = out[0] - (rank - len(s))
            if r is None and 0 <= at < len(s) and s[at] != 1:
                return "combines a value whose length differs per input with one of a fixed length"
        every = all(r is not None for r in padded)
        clean = (
            name in _ZERO_KEEPING
            or (name in ("Add", "Sub") and every)
            or (name == "Div" and padded[0] is not None and padded[1] is None)
        )
        return Rule(out, post=not clean)
    if kind == ALONG_AXIS:
        (r, *rest), n = padded, len(shapes[0])
        if r is None or any(x is not None for x in rest):
            return f"computes {name} with a value whose length differs per input as an attribute"
        if attrs.get("axis", -1) % n != r[0]:
            return Rule(r, post=True)
        if name == "Softmax":
            return Rule(r, pre=-np.inf)
        if name == "LogSoftmax":
            return Rule(r, pre=-np.inf, post=True)
        return f"computes {name} along an axis whose length differs per input"
    if kind == REDUCTION:
        (r,), n = padded, len(shapes[0])
        assert r is not None
        axis = attrs.get("axis")
        axes = (
            set(range(n)) if axis is None else {a % n for a in (axis if isinstance(axis, tuple) else (axis,))}
        )
        if r[0] in axes:
            if name == "Sum":
                return Rule(None)
            if name == "Mean":
                return Rule(None, scale=r[1])
            if name in ("Max", "Min"):  # (the padding never the extreme)
                return Rule(None, pre=-np.inf if name == "Max" else np.inf, pre_vjp=True)
            return f"computes {name} along an axis whose length differs per input (it depends on the length)"
        at = r[0] if attrs.get("keepdims") else r[0] - sum(a < r[0] for a in axes)
        return Rule((at, r[1]))
    if name == "GetItem":
        (r,) = padded
        assert r is not None
        index = attrs["index"]
        items = index if isinstance(index, tuple) else (index,)
        at_in = at_out = 0
        for item in items:
            if isinstance(item, (int, np.integer)):
                if at_in == r[0]:
                    break
                at_in += 1
            elif isinstance(item, slice):
                if at_in == r[0]:
                    if item != slice(None):
                        break
                    return Rule((at_out, r[1]))
                at_in, at_out = at_in + 1, at_out + 1
            else:
                break
        else:
            return Rule((at_out + r[0] - at_in, r[1]))
        return "indexes along an axis whose length differs per input"
    return f"computes {name}, which has no rule for a value whose length differs per input"


def step_input(key: MaskKey | ScaleKey, lengths: np.ndarray) -> np.ndarray:
    """The array ``key`` names, over rows whose lengths (along the padded axis) are ``lengths``:
    a mask, or a mean's factor (float64: :func:`scaled` casts it to the values' dtype)."""
    longest = int(lengths.max())
    if isinstance(key, ScaleKey):
        return (longest / lengths).reshape(-1, *([1] * key.rank))
    shape = [len(lengths)] + [1] * key.rank
    shape[1 + key.axis] = longest
    return np.arange(longest).reshape(shape[1:])[None] < lengths.reshape(-1, *([1] * key.rank))


def filled(x: Any, m: np.ndarray, value: float) -> Any:
    """``x`` with its padding (where ``m`` is false) set to ``value`` (``-inf`` for a softmax)."""
    return np.where(m, x, value)


def zeroed(x: Any, m: np.ndarray) -> Any:
    """``x`` with its padding (where ``m`` is false) set to zero."""
    return np.where(m, x, 0)


def scaled(x: Any, factor: np.ndarray) -> Any:
    """``x`` times a mean's per-row factor (see :class:`ScaleKey`), in ``x``'s dtype."""
    return x * factor.astype(np.result_type(x), copy=False)


class Masking(NamedTuple):
    """The masks a program over rows applies (see the module docstring): the masks and factors its
    steps read (step inputs after the per-input values), and per body node the mask of its
    ``pre``, ``post`` and gradient masking and the factor of its scaling."""

    keys: tuple[MaskKey | ScaleKey, ...] = ()
    pre: tuple[tuple[VirtualNode, MaskKey, float, bool], ...] = ()  # (node, mask, value, for its VJP too)
    post: tuple[tuple[VirtualNode, MaskKey], ...] = ()
    grad: tuple[tuple[VirtualNode, MaskKey], ...] = ()
    scale: tuple[tuple[VirtualNode, ScaleKey, ScaleKey], ...] = ()  # (node, for its value, its input's)


NO_MASKS = Masking()
