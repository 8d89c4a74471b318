"""Gradients: the colour scale of the overlay, retaining and reading gradient norms, and a tied
parameter's gradient split by loop iteration (gradient through time)."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..compute import ComputeGraph, ComputeNode, NodeKey
from ..errors import GraphStateError, RenderError, VGraphError
from ..ops import as_array, unbroadcast
from ..virtual import LoopNode, UnrolledGraph, VirtualNode
from .frames import _Frames

# The fixed colormap: pale blue (small gradient norm) → yellow → red (large), interpolated in RGB.
_CMAP = ((0.0, (0xEA, 0xF1, 0xFA)), (0.25, (0x9E, 0xCA, 0xE1)), (0.5, (0xFF, 0xF1, 0xA8)),
         (0.75, (0xFD, 0xAE, 0x61)), (1.0, (0xD7, 0x30, 0x27)))  # fmt: skip


def _cmap(pos: float) -> str:
    pos = min(1.0, max(0.0, pos))
    for (p0, c0), (p1, c1) in itertools.pairwise(_CMAP):
        if pos <= p1:
            w = (pos - p0) / (p1 - p0)
            return "#" + "".join(f"{round(a + (b - a) * w):02x}" for a, b in zip(c0, c1))
    return "#" + "".join(f"{c:02x}" for c in _CMAP[-1][1])


def _luminance(color: str) -> float:
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


#: Decades of gradient norm the colour scale spans below the largest norm; smaller norms are
#: clipped to the scale's pale end (the legend says so).
GRADIENT_DECADES = 8
#: Colours of a NaN gradient norm and of an infinite one (outside the colour scale).
NAN_COLOR = "#7b3294"
INF_COLOR = "#000000"
ZERO_COLOR = "#ffffff"


@dataclass(frozen=True)
class GradientScale:
    """The log10 colour scale of the gradient overlay: ``lo`` and ``hi`` are log10 norms (pale
    blue at ``lo``, red at ``hi``); ``clipped`` counts the norms below ``10**lo`` (drawn as ``lo``).
    """

    lo: float
    hi: float
    clipped: int = 0

    @classmethod
    def of(cls, norms: Iterable[float], decades: float = GRADIENT_DECADES) -> GradientScale:
        """The scale for these norms: from the largest finite one down ``decades`` decades at
        most (to the smallest positive one if that is closer). Zero, NaN and Inf are ignored."""
        positive = [v for v in norms if v > 0 and math.isfinite(v)]
        if not positive:
            return cls(-1.0, 0.0)
        hi = math.log10(max(positive))
        lo = max(math.log10(min(positive)), hi - decades)
        if hi - lo < 1:  # a scale of at least one decade, its top at the largest norm
            lo = hi - 1
        clipped = sum(1 for v in positive if math.log10(v) < lo)
        return cls(lo, hi, clipped)

    def cells(self) -> list[float]:
        """The norms the legend shows, from the scale's low end to the largest norm: one per
        decade below the maximum, the lowest at the scale's end."""
        steps = math.floor(self.hi - self.lo + 1e-9)
        values = [10.0 ** (self.hi - k) for k in range(steps + 1)]
        if self.hi - steps - self.lo > 1e-9:
            values.append(10.0**self.lo)
        return values[::-1]


def gradient_color(norm: float, scale: tuple[float, float] | GradientScale) -> tuple[float, str]:
    """Where ``norm`` falls on the log10 colour scale and its colour: ``(position, "#rrggbb")``.

    ``scale`` is ``(lo, hi)`` in log10 units (e.g. ``(-3, 0)`` for 1e-3 … 1) or a
    :class:`GradientScale`. The position is ``(log10(norm) - lo) / (hi - lo)`` clipped to
    ``[0, 1]``; colours run from pale blue (0) through yellow to red (1). Outside the scale: a
    zero norm is white (position 0), NaN is purple (:data:`NAN_COLOR`, position NaN) and an
    infinite norm black (:data:`INF_COLOR`, position 1).

    Raises:
        TypeError: ``norm`` is not a real number or ``scale`` not a pair of numbers.
        ValueError: ``scale`` is empty (``hi <= lo``).
    """
    if isinstance(norm, bool) or not isinstance(norm, (int, float, np.integer, np.floating)):
        raise TypeError(f"norm must be a real number, got {type(norm).__name__}")
    if isinstance(scale, GradientScale):
        lo, hi = scale.lo, scale.hi
    else:
        try:
            lo, hi = (float(v) for v in scale)
        except (TypeError, ValueError):
            raise TypeError(f"scale must be (lo, hi) in log10 units, got {scale!r}") from None
    if not hi > lo:
        raise ValueError(f"scale must have lo < hi (log10 units), got {(lo, hi)!r}")
    norm = float(norm)
    if math.isnan(norm):
        return math.nan, NAN_COLOR
    if math.isinf(norm):
        return 1.0, INF_COLOR
    if not norm > 0:
        return 0.0, ZERO_COLOR
    pos = (math.log10(norm) - lo) / (hi - lo)
    pos = min(1.0, max(0.0, pos))
    return pos, _cmap(pos)


def _check_graph(cg: Any, name: str = "cg") -> None:
    """A TypeError naming the argument unless ``cg`` is a ComputeGraph."""
    if not isinstance(cg, ComputeGraph):
        raise TypeError(
            f"{name} must be a ComputeGraph (e.g. the result of g.build(...)), got {type(cg).__name__}"
        )


def retain_all_grads(cg: ComputeGraph) -> int:
    """Call ``retain_grad()`` on every op node that requires a gradient, before ``backward``.

    Then, after ``backward``, every intermediate node keeps its gradient in ``.grad`` — what the
    gradient overlay (``gradients=True``) and :func:`gradient_through_time` read.

    Returns:
        The number of nodes marked.

    Raises:
        TypeError: ``cg`` is not a ComputeGraph.
    """
    _check_graph(cg)
    count = 0
    for n in cg.nodes():
        if n.op is not None and n.requires_grad and n.key.type != "Loop":  # (a program's run: no array)
            n.retain_grad()
            count += 1
    if isinstance(cg, UnrolledGraph):  # loops run as body programs: every iteration's body nodes
        for instance in cg.programs.values():
            count += instance.retain_all(cg)
    return count


def gradient_norms(cg: ComputeGraph) -> dict[NodeKey, float]:
    """``np.linalg.norm(node.grad)`` for every node of ``cg`` that has a ``.grad``, by key, in
    creation order — the numbers the gradient overlay shows and colours by.

    Raises:
        TypeError: ``cg`` is not a ComputeGraph.
    """
    _check_graph(cg)
    if isinstance(cg, UnrolledGraph):
        cg = cg.per_node()  # (loops run as body programs: their nodes one by one)
    return {
        n.key: float(np.linalg.norm(np.asarray(n.grad, dtype=np.float64)))
        for n in cg.nodes()
        if n.grad is not None
    }


def _resolve_param(cg: ComputeGraph, param: Any) -> ComputeNode:
    node: ComputeNode | None = None
    if isinstance(param, ComputeNode):
        node = param
    elif isinstance(param, VirtualNode):
        if param.kind != "parameter":
            raise VGraphError(f"{param.describe()} is not a parameter")
        if not param.attrs["share"]:
            raise VGraphError(
                f"{param.describe()} is untied: each iteration has its own parameter, whose .grad is "
                "already that iteration's gradient (see g.params)"
            )
        assert param.name is not None  # g.param() always names a parameter
        node = param.graph.params[param.name]
    elif isinstance(param, str):
        virtual = cg.virtual if isinstance(cg, UnrolledGraph) else None
        if virtual is not None and param in virtual.params:
            node = virtual.params[param]
        else:
            try:
                node = cg.node(param)
            except (VGraphError, ValueError):
                known = (
                    ", ".join(virtual.params)
                    if virtual is not None
                    else ", ".join(str(p.key) for p in cg.parameters())
                )
                raise VGraphError(f"no parameter {param!r} in this graph; known: {known or 'none'}") from None
    else:
        raise TypeError(
            f"param must be a parameter's name, virtual node or compute node, got {type(param).__name__}"
        )
    if cg._nodes.get(node.key) is not node:
        raise VGraphError(f"{node.describe()} is not used by this compute graph")
    return node


def gradient_through_time(
    cg: ComputeGraph,
    param: Any,
    *,
    loop: LoopNode | str | None = None,
    plot: str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """A tied parameter's gradient, split into the contribution of each loop iteration (BPTT).

    A shared parameter ``W`` is used in every iteration ``t`` by some node ``n_t = op(…, W, …)``;
    backward sums the VJPs of all those uses into ``W.grad``. This returns them one by one:
    row ``t`` is the sum, over the uses of ``W`` in iteration ``t``, of the VJP of the use with
    respect to ``W`` given the use's gradient. Needs the uses' gradients: call
    :func:`retain_all_grads` (or ``retain_grad()`` on them) before ``backward``.

    The rows sum to ``W.grad`` when every use of ``W`` is inside the loop (uses outside loops are
    not part of any row). For nested loops, row ``t`` is iteration ``t`` of ``loop``, summed
    over the iterations of the enclosing loops.

    Args:
        cg: the unrolled graph, after ``backward``.
        param: the parameter: its name (``"Wh"``), its virtual node, or its compute node.
        loop: the loop to split over (a LoopNode or its name); needed only when ``W`` is used in
            several top-level loops. For a plain ComputeGraph, iterations are ``key.idx[0]``.
        plot: a file to save a plot of the per-iteration gradient norms to (needs matplotlib).

    Returns:
        An array of shape ``(iterations, *W.shape)``.

    Raises:
        GraphStateError: a use of ``W`` has no retained gradient.
        VGraphError: unknown or untied parameter, or ambiguous ``loop``.
        RenderError: ``plot`` given but matplotlib is not installed.
        TypeError: ``cg``, ``param``, ``loop`` or ``plot`` of the wrong type.
    """
    _check_graph(cg)
    if isinstance(cg, UnrolledGraph):
        cg = cg.per_node()
    if loop is not None and not isinstance(loop, (LoopNode, str)):
        raise TypeError(f"loop must be a LoopNode, a loop's name or None, got {type(loop).__name__}")
    if plot is not None and not isinstance(plot, (str, os.PathLike)):
        raise TypeError(f"plot must be a file path (str or os.PathLike) or None, got {type(plot).__name__}")
    P = _resolve_param(cg, param)
    groups = cg._groups if isinstance(cg, UnrolledGraph) else {}
    sites = _use_sites(cg, P)
    view: _Frames | None = None
    if isinstance(cg, UnrolledGraph):
        view = _Frames(cg)
        if isinstance(loop, str):
            named = [v for v in cg.virtual.nodes if isinstance(v, LoopNode) and v.name == loop]
            if len(named) != 1:
                raise VGraphError(f"no single loop named {loop!r} in this graph")
            loop = named[0]
        elif isinstance(loop, LoopNode) and loop.graph is not cg.virtual:
            raise VGraphError(
                f"{loop.describe()} belongs to another VirtualGraph, not to the one {type(cg).__name__} was built from"
            )
        if loop is None:
            tops = set()
            for _, n, _ in sites:
                f = view.owner.get(n)
                while f is not None and f.parent is not None:
                    f = f.parent
                if f is not None:
                    tops.add(f.loop)
            if len(tops) > 1:
                names = ", ".join(sorted(t.describe() for t in tops))
                raise VGraphError(f"{P.describe()} is used in several loops ({names}); choose one with loop=")
            if not tops:
                raise VGraphError(f"{P.describe()} is not used inside any loop of this graph")
            loop = tops.pop()
        trips = [d.value for d in cg.decisions if d.kind == "iterations" and d.node is loop]
        T = max(trips) if trips else 0
    else:
        T = max((n.key.idx[0] + 1 for _, n, _ in sites if n.key.idx), default=0)
    out = np.zeros((T, *np.shape(P.value)), dtype=np.result_type(P.value, np.float64))
    for n, site, row in sites:
        if view is not None:
            f = view.owner.get(site)
            while f is not None and f.loop is not loop:
                f = f.parent
            if f is None:
                continue
            t = f.idx[-1]
        else:
            if not n.key.idx:
                continue
            t = n.key.idx[0]
        if not n.requires_grad:
            continue
        g = n.grad
        if g is None:
            raise GraphStateError(
                f"{n.describe()} (a use of {P.describe()}) has no gradient: call "
                "vgraph.render.retain_all_grads(cg) (or node.retain_grad()) before backward"
            )
        values = [p.value for p in n.parents]
        ans = n.value
        if row is not None:  # this iteration's row of a group: of its stepped inputs (groups) too
            values = [v[row] if p in groups else v for p, v in zip(n.parents, values)]
            # n is an op node: its gradient is an array (only sparse_grad leaves keep row-sparse ones)
            g, ans = cast(np.ndarray, g)[row], ans[row]
        vjps = n.vjps
        for i, p in enumerate(n.parents):
            vjp = vjps[i] if i < len(vjps) else None
            if p is not P or vjp is None:
                continue
            pg = as_array(vjp(g, ans, *values, **n.attrs))
            if pg.shape != np.shape(P.value):
                pg = unbroadcast(pg, np.shape(P.value))
            out[t] += pg
    if plot is not None:
        _plot_through_time(out, P, Path(plot))
    return out


def _use_sites(cg: ComputeGraph, P: ComputeNode) -> list[tuple[ComputeNode, ComputeNode, int | None]]:
    """The nodes that read ``P``, with where each sits: ``(use, site, row)``. A use sits where it
    is, ``row`` ``None``; a hoisted group (one op for every iteration, see
    :mod:`vgraph.virtual.hoist`) sits in each iteration at that iteration's copy, ``row`` its row.
    Nodes computed when read are no uses: their work is done by the nodes that are (a fused
    product's by the sum that reads ``P`` in its place)."""
    deferred = cg._deferred
    uses = [
        n for n in cg.nodes() if n.op is not None and n not in deferred and any(p is P for p in n.parents)
    ]
    groups = cg._groups if isinstance(cg, UnrolledGraph) else {}
    return [(n, c, c.attrs["index"]) for n in uses for c in groups.get(n, ())] + [
        (n, n, None) for n in uses if n not in groups
    ]


def _plot_through_time(contrib: np.ndarray, P: ComputeNode, path: Path) -> None:
    """Plot the norm of each iteration's contribution. Iterations are integers on the x axis;
    on a log y axis (norms spanning more than 50x) zero contributions, which a log axis cannot
    show, are drawn as hollow markers on the bottom edge and labelled "= 0"."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise RenderError("plot= needs matplotlib: pip install matplotlib") from None
    norms = np.linalg.norm(contrib.reshape(len(contrib), -1), axis=1)
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    steps = np.arange(len(norms))
    finite = np.isfinite(norms)
    positive = finite & (norms > 0)
    color = "#d73027"
    if positive.sum() >= 2 and norms[positive].max() / norms[positive].min() > 50:
        ax.set_yscale("log")
        ax.plot(steps[positive], norms[positive], marker="o", color=color, label="|contribution|")
        low = norms[positive].min() / 3
        ax.set_ylim(bottom=low / 3, top=norms[positive].max() * 3)
        zeros = finite & (norms == 0)
        if zeros.any():
            ax.plot(steps[zeros], np.full(zeros.sum(), low), linestyle="none", marker="o",
                    markerfacecolor="white", markeredgecolor=color, label="= 0 (not on a log axis)")  # fmt: skip
            ax.legend(loc="best", fontsize=8)
    else:
        ax.plot(steps[finite], norms[finite], marker="o", color=color)
    if not finite.all():
        for t in steps[~finite]:
            ax.axvline(t, color=NAN_COLOR, linestyle=":", linewidth=1)
        ax.set_title("dotted lines: NaN/Inf contributions", fontsize=8, loc="right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.5, max(len(norms) - 0.5, 0.5))
    ax.set_xlabel("iteration t")
    ax.set_ylabel("|contribution to grad|")
    ax.set_title(f"gradient of {P.name or P.key} by iteration (BPTT)", loc="left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
