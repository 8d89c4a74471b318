"""Choosing the view for a graph and validating the drawing options: :func:`to_dot` (DOT text)
and :func:`to_digraph` (a graphviz.Digraph)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..compute import ComputeGraph
from ..errors import RenderError
from ..virtual import UnrolledGraph, VirtualGraph
from .scene import _Scene
from .unrolled_view import DEFAULT_FOLD, _UnrolledView
from .virtual_view import _VirtualView


def to_dot(
    graph: VirtualGraph | ComputeGraph,
    *,
    build: UnrolledGraph | None = None,
    fold: tuple[int, int] | None = DEFAULT_FOLD,
    show_all: bool = False,
    iterations: range | Iterable[int] | None = None,
    gradients: bool = False,
    guards: bool = False,
    constants: bool = True,
    shapes: bool = True,
    rankdir: str = "TB",
    title: str | None = None,
    dpi: float | None = None,
) -> str:
    """The DOT text drawing ``graph`` (no Graphviz program needed).

    Args:
        graph: a :class:`VirtualGraph` (virtual view) or a :class:`ComputeGraph` /
            :class:`UnrolledGraph` (unrolled view).
        build: virtual view only: an unrolled build of ``graph``; nodes it did not build and
            branch options it never took are greyed out, loops show their trip counts.
        fold: unrolled view: ``(first, last)`` — of each loop with more than ``first + last + 1``
            iterations show only the first ``first`` and last ``last`` and one "… N iterations …"
            node for the rest (edges into and out of the hidden iterations go to that node).
            ``None`` shows every iteration.
        show_all: same as ``fold=None``.
        iterations: unrolled view: show only these iteration indices (e.g. ``range(10, 20)``) of
            every loop; hidden stretches become fold nodes. Overrides ``fold``.
        gradients: unrolled view: colour nodes by the norm of their ``.grad`` on a log10 scale,
            with a legend. Intermediate nodes only have ``.grad`` if they retained it: call
            :func:`retain_all_grads` (or ``node.retain_grad()``) before ``backward``.
        guards: draw the structural guard nodes (``LoopCheck``, ``LengthCheck``); hidden by default.
        constants: draw constant leaves (``True``) or leave them out.
        shapes: show value shapes (declared shapes in the virtual view).
        rankdir: Graphviz layout direction, ``"TB"`` (top to bottom) or ``"LR"``.
        title: a title drawn above the graph (default: a short description).
        dpi: resolution of bitmap output (Graphviz's default is 96); e.g. 144 for a sharper PNG.

    Returns:
        DOT source text; identical for identical graphs and options.

    Raises:
        TypeError: ``graph`` is neither kind of graph.
        ValueError: invalid options (``fold`` not a pair of non-negative ints, ``build`` not a
            build of ``graph``, ``gradients`` or ``fold`` options for the virtual view…).
    """
    return _scene(graph, build=build, fold=fold, show_all=show_all, iterations=iterations, gradients=gradients,
                  guards=guards, constants=constants, shapes=shapes, rankdir=rankdir, title=title,
                  dpi=dpi).source()  # fmt: skip


def to_digraph(graph: VirtualGraph | ComputeGraph, **options: Any) -> Any:
    """The drawing as a :class:`graphviz.Digraph` (needs the ``graphviz`` Python package).

    Takes the options of :func:`to_dot`; ``to_digraph(g).source == to_dot(g)``. Use it to render
    with the ``graphviz`` package's own tools, or to add to the drawing.

    Raises:
        RenderError: the ``graphviz`` Python package is not installed.
    """
    try:
        import graphviz
    except ImportError:
        raise RenderError("to_digraph needs the graphviz Python package: pip install graphviz") from None
    scene = _scene(graph, **options)
    dg = graphviz.Digraph(name="vgraph")
    dg.body = scene.body()
    return dg


def _scene(
    graph: Any,
    *,
    build: UnrolledGraph | None = None,
    fold: tuple[int, int] | None = DEFAULT_FOLD,
    show_all: bool = False,
    iterations: range | Iterable[int] | None = None,
    gradients: bool = False,
    guards: bool = False,
    constants: bool = True,
    shapes: bool = True,
    rankdir: str = "TB",
    title: str | None = None,
    dpi: float | None = None,
) -> _Scene:
    """The scene for :func:`to_dot`'s options, validated (one place for every entry point)."""
    if dpi is not None and not float(dpi) > 0:
        raise ValueError(f"dpi must be positive, got {dpi!r}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"rankdir must be 'TB', 'LR', 'BT' or 'RL', got {rankdir!r}")
    if isinstance(graph, VirtualGraph):
        if gradients:
            raise ValueError(
                "gradients=True draws gradient norms of compute nodes: pass the unrolled graph "
                "(the result of g.build(...)) after backward, not the VirtualGraph"
            )
        if iterations is not None or show_all or (fold is not None and tuple(fold) != DEFAULT_FOLD):
            raise ValueError(
                "fold=, show_all= and iterations= apply to the unrolled view (pass a ComputeGraph)"
            )
        if build is not None and (not isinstance(build, UnrolledGraph) or build.virtual is not graph):
            raise ValueError(
                "build= must be an unrolled build of this VirtualGraph (the result of g.build(...))"
            )
        scene = _VirtualView(graph, build, guards, constants, shapes, rankdir, title).scene
    elif isinstance(graph, ComputeGraph):
        if build is not None:
            raise ValueError("build= applies to the virtual view (pass the VirtualGraph and build=cg)")
        if show_all:
            fold = None
        if fold is not None:
            try:
                first, last = (int(v) for v in fold)
                ok = first >= 0 and last >= 0 and (first, last) == tuple(fold)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"fold must be (first, last) with non-negative ints, or None; got {fold!r}")
            fold = (first, last)
        if iterations is not None:
            try:
                if not isinstance(iterations, range):  # a range answers `t in` without expanding
                    iterations = frozenset(int(t) for t in iterations)
            except (TypeError, ValueError):
                raise ValueError(
                    f"iterations must be a range or a collection of ints, got {iterations!r}"
                ) from None
        scene = _UnrolledView(
            graph, fold, iterations, gradients, guards, constants, shapes, rankdir, title
        ).scene
    else:
        raise TypeError(f"cannot draw {type(graph).__name__}: pass a VirtualGraph or a ComputeGraph")
    if dpi is not None:
        scene.graph_attrs["dpi"] = float(dpi)
    return scene
