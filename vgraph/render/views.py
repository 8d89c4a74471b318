"""Choosing the view for a graph and validating the drawing options: :func:`to_dot` (DOT text)
and :func:`to_digraph` (a graphviz.Digraph)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..compute import ComputeGraph
from ..errors import RenderError
from ..modes import int_arg
from ..virtual import UnrolledGraph, VirtualGraph
from ..virtual.batch import BatchedBuild
from .batch_view import _BatchView, _mark_groups
from .scene import _Scene
from .unrolled_view import DEFAULT_FOLD, _UnrolledView
from .virtual_view import _VirtualView


def to_dot(
    graph: VirtualGraph | ComputeGraph | BatchedBuild,
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
    references: bool | None = None,
    batch_groups: bool = False,
) -> str:
    """The DOT text drawing ``graph`` (no Graphviz program needed).

    Args:
        graph: a :class:`VirtualGraph` (virtual view), a :class:`ComputeGraph` /
            :class:`UnrolledGraph` (unrolled view), or a :class:`~vgraph.virtual.batch.BatchedBuild`
            (batch view: one node per group of copies that ran together, labelled with its
            declared node and how many copies and inputs it served, coloured by that number).
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
        references: unrolled view: how a node used by many iterations other than its own (a
            shared parameter, the stepped sequence) is connected to them. ``True``: it is drawn
            once and each iteration using it holds a small dashed reference node to it (no long
            edges, so the layout stays a chain of iterations and fast); ``False``: an edge from it
            into every iteration; ``None`` (default): references when it feeds more than
            ``REFERENCE_THRESHOLD`` (6) drawn iterations. The legend says when references are used.
        batch_groups: unrolled view of one input of a batched build (``batch.unrolled(i)``):
            say under each node which group of the batched build computed it and with how many
            copies, and colour it by that number (unless ``gradients``).

    Returns:
        DOT source text; identical for identical graphs and options.

    Raises:
        TypeError: ``graph`` is neither kind of graph, or an option has the wrong type
            (``dpi="abc"``, ``gradients="yes"``, ``build=5`` …); the message names the option.
        ValueError: invalid options (``fold`` not a pair of non-negative ints, ``build`` not a
            build of ``graph``, ``gradients`` or ``fold`` options for the virtual or batch view,
            ``batch_groups`` for a graph that is not one input of a batched build…).
    """
    return _scene(graph, build=build, fold=fold, show_all=show_all, iterations=iterations, gradients=gradients,
                  guards=guards, constants=constants, shapes=shapes, rankdir=rankdir, title=title,
                  dpi=dpi, references=references, batch_groups=batch_groups).source()  # fmt: skip


def to_digraph(graph: VirtualGraph | ComputeGraph | BatchedBuild, **options: Any) -> Any:
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
    references: bool | None = None,
    batch_groups: bool = False,
) -> _Scene:
    """The scene for :func:`to_dot`'s options, validated (one place for every entry point)."""
    if isinstance(graph, UnrolledGraph):  # loops run as body programs: drawn node by node
        graph = graph.per_node()
    if isinstance(build, UnrolledGraph):
        build = build.per_node()
    if not isinstance(graph, (VirtualGraph, ComputeGraph, BatchedBuild)):
        raise TypeError(
            f"graph must be a VirtualGraph or a ComputeGraph (the result of g.build(...)), or a "
            f"BatchedBuild (the result of g.build_batch(...)); got {type(graph).__name__}"
        )
    for name, flag in (("show_all", show_all), ("gradients", gradients), ("guards", guards),
                       ("constants", constants), ("shapes", shapes), ("batch_groups", batch_groups)):  # fmt: skip
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {type(flag).__name__} {flag!r}")
    if dpi is not None:
        if isinstance(dpi, bool) or not isinstance(dpi, (int, float, np.integer, np.floating)):
            raise TypeError(
                f"dpi must be a positive number (e.g. 144) or None, got {type(dpi).__name__} {dpi!r}"
            )
        if not (math.isfinite(dpi) and dpi > 0):
            raise ValueError(f"dpi must be a positive number, got {dpi!r}")
    if references is not None and not isinstance(references, (bool, np.bool_)):
        raise TypeError(f"references must be True, False or None, got {type(references).__name__}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a string or None, got {type(title).__name__}")
    if not isinstance(rankdir, str):
        raise TypeError(f"rankdir must be 'TB', 'LR', 'BT' or 'RL', got {type(rankdir).__name__}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"rankdir must be 'TB', 'LR', 'BT' or 'RL', got {rankdir!r}")
    fold = _check_fold(fold)
    fold_given = fold is not None and fold != DEFAULT_FOLD
    if iterations is not None:
        if isinstance(iterations, (str, bytes)) or not isinstance(iterations, Iterable):
            raise TypeError(
                f"iterations must be a range or a collection of ints, got {type(iterations).__name__}"
            )
        try:
            if not isinstance(iterations, range):  # a range answers `t in` without expanding
                iterations = frozenset(int_arg(t, "iterations") for t in iterations)
        except (TypeError, ValueError):
            raise TypeError(
                f"iterations must be a range or a collection of ints, got {iterations!r}"
            ) from None
    if build is not None and not isinstance(build, UnrolledGraph):
        raise TypeError(
            f"build must be an unrolled build of the VirtualGraph (the result of g.build(...)) or None, "
            f"got {type(build).__name__}"
        )
    if batch_groups and getattr(graph, "_batch_input", None) is None:
        raise ValueError(
            "batch_groups=True marks one input of a batched build: pass batch.unrolled(i) (to draw "
            "the batched graph itself, pass the BatchedBuild)"
        )
    if isinstance(graph, BatchedBuild):
        if (
            gradients
            or build is not None
            or iterations is not None
            or show_all
            or fold_given
            or references is not None
        ):
            raise ValueError(
                "gradients=, build=, fold=, show_all=, iterations= and references= do not apply to "
                "the batch view; draw one input with render.to_dot(batch.unrolled(i), ...)"
            )
        scene = _BatchView(graph, constants, shapes, rankdir, title).scene
    elif isinstance(graph, VirtualGraph):
        if gradients:
            raise ValueError(
                "gradients=True draws gradient norms of compute nodes: pass the unrolled graph "
                "(the result of g.build(...)) after backward, not the VirtualGraph"
            )
        if iterations is not None or show_all or fold_given or references is not None:
            raise ValueError(
                "fold=, show_all=, iterations= and references= apply to the unrolled view (pass a ComputeGraph)"
            )
        if build is not None and build.virtual is not graph:
            raise ValueError(
                "build= must be an unrolled build of this VirtualGraph (the result of g.build(...))"
            )
        scene = _VirtualView(graph, build, guards, constants, shapes, rankdir, title).scene
    else:
        if build is not None:
            raise ValueError("build= applies to the virtual view (pass the VirtualGraph and build=cg)")
        if show_all:
            fold = None
        if isinstance(iterations, range) and len(iterations) == 0:
            raise ValueError(
                f"iterations={iterations!r} is empty: it would draw no iteration; give start < stop, "
                "e.g. range(2, 5)"
            )
        if isinstance(iterations, frozenset) and not iterations:
            raise ValueError("iterations is empty: it would draw no iteration")
        view = _UnrolledView(
            graph, fold, iterations, gradients, guards, constants, shapes, rankdir, title, references
        )
        scene = view.scene
        if batch_groups:
            batch, i = graph._batch_input  # type: ignore[attr-defined]
            _mark_groups(scene, view, batch, i, gradients)
    if dpi is not None:
        scene.graph_attrs["dpi"] = float(dpi)
    return scene


def _check_fold(fold: Any) -> tuple[int, int] | None:
    """``fold`` as ``(first, last)`` or None; a TypeError or ValueError naming ``fold`` otherwise."""
    if fold is None:
        return None
    if not isinstance(fold, (tuple, list)):
        raise TypeError(
            f"fold must be (first, last) with non-negative ints, or None; got {type(fold).__name__}"
        )
    try:
        first, last = (int_arg(v, "fold") for v in fold)
    except (TypeError, ValueError):
        raise ValueError(
            f"fold must be (first, last) with non-negative ints, or None; got {fold!r}"
        ) from None
    if first < 0 or last < 0:
        raise ValueError(f"fold must be (first, last) with non-negative ints, or None; got {fold!r}")
    return first, last
