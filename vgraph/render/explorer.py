"""An interactive explorer page: one self-contained HTML file for a model and its unrolled build.

:func:`explore` writes a single HTML file (no network access when it is viewed: the SVG, the
script and the style are inline) with

* the **virtual view** (the model as declared, drawn by Graphviz at generation time) and the
  **unrolled view** (one build, laid out in the browser) as tabs;
* the unrolled view **as declared** (the plain unroll's nodes and edges, the default) or **as
  executed** (hoisted groups, their per-iteration rows and fused sums; see :func:`_declared_view`);
* **folding**: long loops show their first and last iterations and one "… N iterations" node;
  clicking it unfolds (in pages of iterations for long loops), the loop's header folds it back;
* node details on hover and click: key ``<type:id@idx>``, name, op, shape, dtype, value
  statistics (min, max, mean, norm) and gradient norm;
* a search box that finds a node by key (``Tanh:1@37``), unfolds its iteration and scrolls to it;
* the gradient-through-time chart of each tied parameter (:func:`vgraph.render.gradient_through_time`),
  whose hovered iteration is highlighted in the graph.

Why the unrolled view is laid out in the browser: unfolding changes the layout, and the browser
has no Graphviz. The page embeds a compact JSON description of every node (key, name, op, shape,
dtype, statistics, parents, iteration) and lays out only what is unfolded — each iteration box
as a small layered graph, iteration boxes stacked in order — so a 1,000-step loop costs one JSON
record per node, not one drawing per fold state. The virtual view does not change and is drawn by
``dot`` once.

In Jupyter the page returned by :func:`explore` displays itself inline (``_repr_html_``, an
``iframe`` with the page as ``srcdoc``).
"""

from __future__ import annotations

import html
import json
import math
import numbers
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..compute import ComputeGraph, ComputeNode
from ..errors import ArgumentError, GraphStateError, RenderError, VGraphError
from ..virtual import LoopNode, UnrolledGraph, VirtualGraph, VirtualNode
from ..virtual.nodes import _depth
from .frames import _Frames
from .gradients import _use_sites, gradient_through_time, retain_all_grads
from .output import dot_available, to_svg
from .unrolled_view import DEFAULT_FOLD

__all__ = ["ExplorerPage", "explore", "explore_script_result"]

#: Significant digits kept for values and statistics in the page's JSON.
DIGITS = 6


class ExplorerPage(str):
    """The HTML text of an explorer page; displays itself inline in Jupyter.

    It is a ``str`` (the whole self-contained page), so it can be written anywhere; in a notebook
    the last expression ``vgraph.render.explore(g, build=cg)`` shows the page in an ``iframe``.
    """

    #: Height of the inline frame in Jupyter, in CSS pixels.
    frame_height = 760

    def _repr_html_(self) -> str:
        doc = html.escape(str(self), quote=True)
        return (
            f'<iframe srcdoc="{doc}" style="width:100%;height:{self.frame_height}px;border:1px solid #d0d7de;'
            'border-radius:6px" sandbox="allow-scripts"></iframe>'
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the page to ``path`` (UTF-8) and return the path."""
        path = Path(path)
        path.write_text(str(self), encoding="utf-8")
        return path


# ============================================================================ public entry points


def explore(
    graph: VirtualGraph | ComputeGraph,
    path: str | os.PathLike[str] | None = None,
    *,
    build: ComputeGraph | None = None,
    title: str | None = None,
    fold: tuple[int, int] = DEFAULT_FOLD,
    virtual_view: bool = True,
) -> ExplorerPage:
    """An interactive, self-contained HTML page exploring a model and/or one unrolled build.

    Args:
        graph: a :class:`VirtualGraph` (its virtual view; pass ``build=`` for the unrolled view
            too), or a :class:`ComputeGraph` / :class:`UnrolledGraph` (the unrolled view; for an
            UnrolledGraph the virtual view of ``cg.virtual`` is added).
        path: a file to write the page to (UTF-8); ``None`` writes nothing.
        build: with a VirtualGraph: an unrolled build of it (``g.build(...)``). For gradient
            norms and the gradient-through-time chart, call
            :func:`vgraph.render.retain_all_grads` before ``backward``.
        title: the page title (default: the model's name).
        fold: ``(first, last)``: iterations of each loop shown before the page is touched; loops
            with more than ``first + last + 1`` iterations fold the rest into one node.
        virtual_view: include the virtual view (drawn with Graphviz's ``dot``; when ``dot`` is
            missing the tab says so and the rest of the page still works).

    Returns:
        The page's HTML as an :class:`ExplorerPage` (a ``str`` that displays inline in Jupyter).

    Raises:
        ArgumentError: an argument of the wrong type: ``graph`` or ``build`` not a graph of the
            expected kind, ``path`` not a path, ``title`` not a string, ``fold`` not a pair of
            ints, ``virtual_view`` not a bool (a ``TypeError`` too). Nothing is written.
        ValueError: ``build`` is not a build of ``graph``, or ``fold`` has a negative count.
        RenderError: Graphviz's ``dot`` failed on the virtual view.
    """
    virtual, cg = _resolve(graph, build)
    first, last = _check_fold(fold)
    _check_path(path)
    _check_type("title", title, str, "a str or None", optional=True)
    _check_type("virtual_view", virtual_view, bool, "True or False")
    data: dict[str, Any] = {"title": title or _default_title(virtual, cg), "fold": [first, last]}
    if cg is not None:
        data["unrolled"] = _unrolled_data(cg)
    if virtual is not None and virtual_view:
        data["virtual"] = _virtual_data(virtual, cg if isinstance(cg, UnrolledGraph) else None)
    page = ExplorerPage(_page(data))
    if path is not None:
        page.save(path)
    return page


def explore_script_result(
    graph: VirtualGraph,
    feed: dict[str, Any],
    outputs: VirtualNode | Sequence[VirtualNode],
    path: str | os.PathLike[str] | None,
    *,
    gradients: bool = True,
    title: str | None = None,
) -> ExplorerPage:
    """The explorer page of a model script's ``build()`` result (what ``--html`` writes).

    Builds ``graph`` on ``feed`` for ``outputs``; when ``gradients`` and the first output is a
    scalar (the loss), keeps every intermediate gradient and runs backward from it, so the page
    shows gradient norms and the gradient-through-time chart.

    Args:
        graph: the model script's VirtualGraph.
        feed: input values by name.
        outputs: the output node(s) to build; the first is the loss.
        path: where to write the page (``None``: nowhere).
        gradients: run backward from the first output when it is a scalar.
        title: the page title.

    Returns:
        The page (see :func:`explore`).

    Raises:
        ArgumentError: ``graph`` is not a VirtualGraph, ``path`` not a path, ``gradients`` not a
            bool or ``title`` not a string (a ``TypeError`` too). Nothing is built or written.
        VGraphError: the build or backward failed (the model's own error).
    """
    if not isinstance(graph, VirtualGraph):
        raise ArgumentError(
            f"explore_script_result: graph must be a VirtualGraph, got {type(graph).__name__}"
        )
    _check_path(path)
    _check_type("gradients", gradients, bool, "True or False")
    _check_type("title", title, str, "a str or None", optional=True)
    outs = [outputs] if isinstance(outputs, VirtualNode) else list(outputs)
    cg = graph.build(feed, outs)
    if gradients and cg.outputs and np.size(cg.outputs[0].value) == 1:
        retain_all_grads(cg)
        cg.backward(cg.outputs[0])
    return explore(graph, path, build=cg, title=title)


# ============================================================================ validation


def _resolve(graph: Any, build: Any) -> tuple[VirtualGraph | None, ComputeGraph | None]:
    if isinstance(graph, UnrolledGraph):  # loops run as body programs: explored node by node
        graph = graph.per_node()
    if isinstance(build, UnrolledGraph):
        build = build.per_node()
    if isinstance(graph, VirtualGraph):
        if build is None:
            return graph, None
        if not isinstance(build, UnrolledGraph):
            raise ArgumentError(
                f"explore: build= must be an UnrolledGraph (the result of g.build(...)), got {type(build).__name__}"
            )
        if build.virtual is not graph:
            raise ValueError(
                "build= must be an unrolled build of this VirtualGraph (the result of g.build(...))"
            )
        return graph, build
    if isinstance(graph, ComputeGraph):
        if build is not None:
            raise ValueError("build= applies to a VirtualGraph; pass the unrolled graph itself as graph")
        return (graph.virtual if isinstance(graph, UnrolledGraph) else None), graph
    raise ArgumentError(f"cannot explore {type(graph).__name__}: pass a VirtualGraph or a ComputeGraph")


def _check_fold(fold: Any) -> tuple[int, int]:
    if (
        not isinstance(fold, (tuple, list))
        or len(fold) != 2
        or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in fold)
    ):
        raise ArgumentError(f"explore: fold must be a pair (first, last) of ints; got {fold!r}")
    first, last = int(fold[0]), int(fold[1])
    if first < 0 or last < 0:
        raise ValueError(f"explore: fold must be (first, last) with non-negative ints; got {fold!r}")
    return first, last


def _check_type(name: str, value: Any, kind: type, expected: str, *, optional: bool = False) -> None:
    if not (isinstance(value, kind) or (optional and value is None)):
        raise ArgumentError(f"explore: {name}= must be {expected}, got {type(value).__name__} {value!r}")


def _check_path(path: Any) -> None:
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(
            f"explore: path must be a str, a path or None, got {type(path).__name__} {path!r}"
        )


def _default_title(virtual: VirtualGraph | None, cg: ComputeGraph | None) -> str:
    if virtual is not None and virtual.name:
        return virtual.name
    return "compute graph" if cg is not None else "model"


# ============================================================================ data extraction


class _Strings:
    """A string table: repeated names, ops, shapes and dtypes are stored once."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, text: str | None) -> int:
        if text is None:
            return -1
        i = self.index.get(text)
        if i is None:
            i = self.index[text] = len(self.items)
            self.items.append(text)
        return i


def _num(x: float) -> float | str:
    """A float for JSON: ``DIGITS`` significant digits; NaN and infinities as strings."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Inf" if x > 0 else "-Inf"
    return float(f"{x:.{DIGITS}g}")


def _stats(value: Any) -> list[float | str] | None:
    """``[min, max, mean, norm]`` of a numeric value in float64, or ``None`` (empty, not numeric)."""
    arr = np.asarray(value)
    if arr.size == 0 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        return None
    if np.iscomplexobj(arr):
        return None
    a = arr.astype(np.float64, copy=False).ravel()
    with np.errstate(all="ignore"):
        return [
            _num(float(a.min())),
            _num(float(a.max())),
            _num(float(a.mean())),
            _num(float(np.linalg.norm(a))),
        ]


def _shape_text(shape: tuple[Any, ...]) -> str:
    if shape == ():
        return "scalar"
    return "(" + ", ".join(map(str, shape)) + (",)" if len(shape) == 1 else ")")


def _loop_id(loop: Any) -> str:
    return f"{loop.type}:{loop.id}" if isinstance(loop, LoopNode) else f"depth{loop}"


def _unrolled_data(cg: ComputeGraph) -> dict[str, Any]:
    frames_view = _Frames(cg)  # which loop iteration each node belongs to (shared with to_dot)
    nodes = frames_view.nodes
    strings = _Strings()

    # Runs (one loop's iterations in one iteration path of the enclosing loops), parents first.
    runs = sorted(
        frames_view.runs.values(),
        key=lambda r: (len(r.outer), frames_view._loop_order(r.loop), r.outer),
    )
    frame_index: dict[Any, int] = {}
    frames_out: list[list[Any]] = []
    runs_out: list[dict[str, Any]] = []
    for ri, run in enumerate(runs):
        loop = run.loop
        if isinstance(loop, LoopNode):
            label = f"<{loop.type}:{loop.id}>" + (f" {loop.name}" if loop.name else "")
        else:
            label = "idx " + ".".join([*map(str, run.outer), "*"])
        parent = frame_index.get(run.parent, -1) if run.parent is not None else -1
        ids = []
        for t in sorted(run.frames):
            f = run.frames[t]
            frame_index[f] = len(frames_out)
            ids.append(len(frames_out))
            frames_out.append([ri, t, ".".join(map(str, f.idx))])
        runs_out.append(
            {"label": label, "outer": ".".join(map(str, run.outer)), "parent": parent,
             "trips": run.trips, "loop": _loop_id(loop), "frames": ids}
        )  # fmt: skip

    index = {n: i for i, n in enumerate(nodes)}
    norms = {
        n: float(np.linalg.norm(np.asarray(n.grad, dtype=np.float64))) for n in nodes if n.grad is not None
    }
    cols: dict[str, list[Any]] = {k: [] for k in ("key", "name", "op", "shape", "dtype", "frame", "parents",
                                                  "stats", "grad", "note")}  # fmt: skip
    for n in nodes:
        k = n.key
        cols["key"].append(str(k))
        cols["name"].append(strings(n.name))
        cols["op"].append(strings(n.op.name if n.op is not None else None))
        cols["shape"].append(strings(_shape_text(tuple(n.shape))))
        cols["dtype"].append(strings(str(n.dtype)))
        owner = frames_view.owner.get(n)
        cols["frame"].append(frame_index.get(owner, -1) if owner is not None else -1)
        cols["parents"].append([index[p] for p in n.parents if p in index])
        notes = []
        try:
            cols["stats"].append(_stats(n.value))
        except GraphStateError:  # computed when read, from values changed since the last forward
            cols["stats"].append(None)
            notes.append("computed when read: inputs changed since the last forward")
        g = norms.get(n)
        cols["grad"].append(None if g is None else _num(g))
        nexts = frames_view.next_names.get(n)
        if nexts:
            notes.append("→ next " + ", ".join(nexts))
        if k in frames_view.choice and n.op is not None:
            notes.append(f"option {frames_view.choice[k]}")
        if k.type == "Parameter" and k.idx:
            notes.append("untied")
        if n.op is None and k.type == "Constant" and np.size(n.value) == 1:
            notes.append(f"= {np.asarray(n.value).reshape(()).item():g}")
        cols["note"].append(strings("; ".join(notes) if notes else None))
    # Names of loop-carried edges (parent, frame of the child) -> "h", "h (final)".
    edge_names = [
        [index[p], frame_index.get(f, -1) if f is not None else -1, strings(name)]
        for (p, f), name in frames_view.edge_names.items()
        if p in index
    ]
    return {
        "strings": strings.items,
        "nodes": cols,
        "runs": runs_out,
        "frames": frames_out,
        "edgeNames": edge_names,
        "series": _series(cg, frames_view),
        "hasGrad": bool(norms),
        "declared": _declared_view(cg, index, strings),
    }


def _declared_view(
    cg: ComputeGraph, index: dict[ComputeNode, int], strings: _Strings
) -> dict[str, Any] | None:
    """How the build looks *as declared* where the build computes it otherwise, or ``None`` where
    it does not.

    A build that hoists loop-body work (:mod:`vgraph.virtual.hoist`) keeps every declared node's
    key, value and gradient, but computes some of them otherwise: group nodes ``<MatMul*:1>`` do
    the work of every iteration at once, a copy ``<MatMul:1@t>`` is row ``t`` of its group, a sum
    reads the rows of a group (``AddRow``) or computes a product too (``MatMulAddRow``). The
    declared view is the plain unroll's graph on the same nodes: groups hidden (``hide``) and each
    node whose op is not its declared node's op drawn with that op and the declared inputs of its
    iteration (``nodes``: ``[node, op, [parents]]``), as ``build(..., hoist=False)`` builds it.
    """
    if not isinstance(cg, UnrolledGraph):
        return None
    declared = {(v.type, v.id): v for v in cg.virtual.nodes}
    hide: list[int] = []
    rewritten: list[list[Any]] = []
    for n, i in index.items():
        k = n.key
        if k.type.endswith("*"):
            hide.append(i)
            continue
        v = declared.get((k.type, k.id))
        if v is None or n.op is None:
            continue
        op = v.op.name if v.op is not None else "GetItem" if v.kind == "item" else None
        if op is None or n.op.name == op:
            continue
        try:
            parents = [index[cg.node(u, k.idx[: _depth(u.scope)])] for u in v.inputs]
        except (VGraphError, KeyError):  # not built as the plain unroll would: keep what it is
            continue
        rewritten.append([i, strings(op), parents])
    if not hide and not rewritten:
        return None
    return {"hide": hide, "nodes": rewritten}


def _series(cg: ComputeGraph, frames_view: Any) -> list[dict[str, Any]]:
    """Gradient-through-time norms of every parameter used inside a loop whose uses kept their
    gradients (see :func:`vgraph.render.gradient_through_time`)."""
    out: list[dict[str, Any]] = []
    for p in cg.parameters():
        if p.key.idx or p.grad is None:
            continue
        loops = []
        for _, site, _ in _use_sites(cg, p):
            f = frames_view.owner.get(site)
            while f is not None and f.parent is not None:
                f = f.parent
            if f is not None and f.loop not in loops:
                loops.append(f.loop)
        for loop in loops:
            try:
                contrib = gradient_through_time(
                    cg, p, loop=loop if isinstance(loop, LoopNode) and len(loops) > 1 else None
                )
            except VGraphError:  # uses without retained gradients, untied, …: no chart for it
                continue
            rows = np.linalg.norm(contrib.reshape(len(contrib), -1).astype(np.float64), axis=1)
            name = p.name or str(p.key)
            loop_label = (
                (f"<{loop.type}:{loop.id}>" + (f" {loop.name}" if loop.name else ""))
                if isinstance(loop, LoopNode)
                else "loop"
            )
            out.append(
                {"param": name, "key": str(p.key), "loop": _loop_id(loop), "loopLabel": loop_label,
                 "norms": [_num(float(v)) for v in rows], "total": _num(float(np.linalg.norm(p.grad)))}
            )  # fmt: skip
    return out


def _virtual_data(g: VirtualGraph, build: UnrolledGraph | None) -> dict[str, Any]:
    info: dict[str, Any] = {}
    copies: dict[VirtualNode, list[str]] = {}
    if build is not None:
        for (scope, _idx), env in build._envs.items():
            for v, n in env.items():
                if n is not None and v.scope is scope:
                    copies.setdefault(v, []).append(str(n.key))
    for v in g.nodes:
        entry: dict[str, Any] = {"key": f"{v.type}:{v.id}", "name": v.name, "kind": v.kind}
        shape = v.attrs.get("shape") if isinstance(v.attrs, dict) else None
        if shape is not None:
            entry["shape"] = _shape_text(tuple("?" if s is None else s for s in shape))
        if v.kind == "parameter":
            entry["share"] = bool(v.attrs.get("share", True))
        if v.scope is not None:
            entry["scope"] = f"{v.scope.type}:{v.scope.id}" + (f" {v.scope.name}" if v.scope.name else "")
        if build is not None:
            keys = sorted(set(copies.get(v, [])), key=_key_order)
            entry["copies"] = len(keys)
            entry["first"] = keys[:3]
        info[f"{v.type}:{v.id}"] = entry
    svg = None
    error = None
    if dot_available():
        try:
            svg = _strip_prolog(to_svg(g, build=build))
        except Exception as e:  # the renderer's bug must not cost the user the rest of the page
            error = f"The virtual view could not be drawn ({type(e).__name__}: {e}); the unrolled view is unaffected."
    else:
        error = "Graphviz's dot program was not found when this page was generated, so the virtual view is missing."
    return {"svg": svg, "error": error, "nodes": info}


def _key_order(text: str) -> tuple[Any, ...]:
    head, _, idx = text.partition("@")
    return (tuple(int(i) for i in idx.split(".")) if idx else (), head)


def _strip_prolog(svg: str) -> str:
    """The ``<svg>`` element alone: no XML declaration, DOCTYPE (a DTD URL) or comments."""
    start = svg.find("<svg")
    if start < 0:
        raise RenderError("dot did not produce SVG")
    svg = svg[start:]
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S)


# ============================================================================ the page


# Characters escaped in the page's JSON: with no "<", ">" or "&" the text cannot close the script
# element or open a comment ("<!--", "</script>"), whatever the strings in it; U+2028 and U+2029
# end a line in older JavaScript. Each becomes its \uXXXX escape, which JSON.parse reads back.
_SCRIPT_UNSAFE = re.compile("[<>&\u2028\u2029]")


def _json_for_script(data: Any) -> str:
    """``data`` as JSON that is safe inside an HTML ``<script>`` element (and still valid JSON)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return _SCRIPT_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_MARKER = re.compile(r"%%(TITLE|STYLE|SCRIPT|DATA)%%")


def _page(data: dict[str, Any]) -> str:
    # One pass over the template: a marker inside substituted text (a title "%%DATA%%") stays text.
    parts = {
        "TITLE": html.escape(data["title"]),
        "STYLE": _STYLE,
        "SCRIPT": _SCRIPT,
        "DATA": _json_for_script(data),
    }
    return _MARKER.sub(lambda m: parts[m.group(1)], _TEMPLATE)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="vgraph explorer">
<title>%%TITLE%% — vgraph explorer</title>
<style>%%STYLE%%</style>
</head>
<body>
<header id="vg-top">
  <div class="brand"><span class="logo">vgraph</span><span id="vg-title"></span></div>
  <nav id="vg-tabs" role="tablist"></nav>
  <form id="vg-search" autocomplete="off">
    <input id="vg-search-input" type="search" placeholder="Find a key, e.g. Tanh:1@37" spellcheck="false">
    <button type="submit">Find</button>
  </form>
  <span id="vg-status" role="status"></span>
</header>
<main id="vg-main">
  <section id="vg-views">
    <div id="vg-toolbar">
      <button type="button" data-act="zoom-out" title="Zoom out">&minus;</button>
      <span id="vg-zoom">100%</span>
      <button type="button" data-act="zoom-in" title="Zoom in">+</button>
      <button type="button" data-act="fit" title="Fit to window">Fit</button>
      <span class="sep"></span>
      <button type="button" data-act="fold-all" class="u-only" title="Fold every loop to its default">Fold all</button>
      <label class="u-only"><input type="checkbox" id="vg-gradcolor" checked> colour by |grad|</label>
      <label class="u-only"><input type="checkbox" id="vg-guards"> guards</label>
      <span id="vg-mode" class="u-only" role="group" aria-label="Show the build" hidden><button type="button" data-mode="declared" aria-pressed="true" title="The model's own ops: one node per declared node per iteration, as the plain unroll builds them">as declared</button><button type="button" data-mode="executed" aria-pressed="false" title="What the build runs: hoisted groups (MatMul*), their per-iteration rows and fused sums">as executed</button></span>
      <span id="vg-legend" class="u-only"></span>
    </div>
    <div id="vg-pane-unrolled" class="pane"><div class="empty">No unrolled build: pass build=g.build(...) to explore().</div></div>
    <div id="vg-pane-virtual" class="pane" hidden><div class="empty">No virtual graph.</div></div>
  </section>
  <aside id="vg-side">
    <section class="card"><h2>Node</h2><div id="vg-info"><p class="hint">Hover or click a node.</p></div></section>
    <section class="card" id="vg-chart-card"><h2>Gradient through time</h2>
      <select id="vg-series"></select>
      <div id="vg-chart"></div>
      <p class="hint" id="vg-chart-hint"></p>
    </section>
    <section class="card"><h2>Keys</h2><p class="hint"><code>&lt;type:id@idx&gt;</code>: idx is the iteration path,
      e.g. <code>Tanh:1@37</code> is iteration 37, <code>MatMul:2@1.3</code> iteration 3 of an inner loop in
      iteration 1 of the outer one. Click a folded "… N iterations" node to unfold it; a loop's
      <b>fold</b> button folds it back. A parameter or input used in every iteration is drawn as a short
      labelled stub in each iteration; hover either end to see the edges.</p></section>
  </aside>
</main>
<script type="application/json" id="vg-data">%%DATA%%</script>
<script>%%SCRIPT%%</script>
</body>
</html>
"""

_STYLE = r"""
:root{--fg:#1f2328;--muted:#59636e;--line:#d0d7de;--bg:#f6f8fa;--accent:#0b5cad;--hl:#e8590c;
  font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;font-size:14px;color:var(--fg)}
*{box-sizing:border-box}
html,body{margin:0;height:100%}
body{display:flex;flex-direction:column;background:#fff}
#vg-top{display:flex;align-items:center;gap:18px;padding:8px 16px;border-bottom:1px solid var(--line);background:var(--bg)}
.brand{display:flex;align-items:baseline;gap:10px;min-width:0}
.logo{font-weight:700;color:var(--accent);letter-spacing:.02em}
#vg-title{font-weight:600;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:28vw}
#vg-tabs{display:flex;gap:2px}
#vg-tabs button{border:1px solid transparent;background:none;padding:5px 12px;border-radius:6px;cursor:pointer;font:inherit;color:var(--muted)}
#vg-tabs button[aria-selected=true]{background:#fff;border-color:var(--line);color:var(--fg);font-weight:600}
#vg-search{display:flex;gap:4px;margin-left:auto}
#vg-search input{width:260px;padding:5px 8px;border:1px solid var(--line);border-radius:6px;font:13px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
button{font:inherit;font-size:13px;padding:4px 10px;border:1px solid var(--line);border-radius:6px;background:#fff;cursor:pointer;color:var(--fg)}
button:hover{background:#eef1f4}
#vg-status{font-size:12px;color:var(--muted);min-width:150px}
#vg-status.err{color:#b42318}
#vg-main{flex:1;display:flex;min-height:0}
#vg-views{flex:1;display:flex;flex-direction:column;min-width:0}
#vg-toolbar{display:flex;align-items:center;gap:8px;padding:6px 12px;border-bottom:1px solid var(--line);font-size:13px;color:var(--muted);flex-wrap:wrap}
#vg-toolbar .sep{width:1px;height:18px;background:var(--line)}
#vg-toolbar label{display:flex;align-items:center;gap:4px}
#vg-zoom{min-width:42px;text-align:center}
#vg-legend{display:flex;flex-wrap:wrap;align-items:center;row-gap:2px;margin-left:auto;max-width:100%;padding-right:1px;font-size:11px}
#vg-legend .cell{flex:none;min-width:34px;padding:0 3px;white-space:nowrap;height:16px;display:flex;align-items:center;justify-content:center;border:1px solid #c9d1d9;margin-right:-1px}
#vg-legend .cap{margin-right:6px}
#vg-mode{display:flex}
#vg-mode[hidden]{display:none}
#vg-mode button{border-radius:0;padding:2px 8px;font-size:12px;color:var(--muted)}
#vg-mode button:first-child{border-radius:6px 0 0 6px}
#vg-mode button:last-child{border-radius:0 6px 6px 0;margin-left:-1px}
#vg-mode button[aria-pressed=true]{background:#ddeafb;color:var(--fg);font-weight:600}
.pane{flex:1;overflow:auto;background:#fff;position:relative}
.pane[hidden]{display:none}
.pane svg{display:block;margin:0 auto}
.empty{padding:40px;color:var(--muted)}
#vg-side{width:340px;border-left:1px solid var(--line);overflow:auto;background:var(--bg);padding:10px}
.card{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 12px;margin-bottom:10px}
.card h2{font-size:12px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted);margin:0 0 8px}
.hint{color:var(--muted);font-size:12px;line-height:1.45;margin:4px 0}
#vg-info table{border-collapse:collapse;width:100%;font-size:13px}
#vg-info th{text-align:left;font-weight:500;color:var(--muted);padding:2px 8px 2px 0;white-space:nowrap;vertical-align:top}
#vg-info td{padding:2px 0;font-variant-numeric:tabular-nums;word-break:break-all}
#vg-info .key{font:600 14px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;margin-bottom:6px;color:var(--accent)}
#vg-info a{color:var(--accent);cursor:pointer;text-decoration:none;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
#vg-info a:hover{text-decoration:underline}
code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#eef1f4;padding:0 3px;border-radius:3px}
#vg-series{width:100%;margin-bottom:6px;font:inherit;font-size:13px;padding:3px}
#vg-chart svg{display:block;width:100%;height:auto}
/* graph */
.vg-g text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;pointer-events:none}
.vg-n{cursor:pointer}
.vg-n rect{stroke:#57606a;stroke-width:1}
.vg-n:hover rect{stroke:var(--accent);stroke-width:2}
.vg-n.sel rect{stroke:var(--accent);stroke-width:2.5}
.vg-n.hit rect{stroke:var(--hl);stroke-width:3.5}
.vg-n.dim{opacity:.25}
.vg-fold{cursor:pointer}
.vg-fold rect{fill:#fafbfc;stroke:#8c959f;stroke-dasharray:4 3}
.vg-fold:hover rect{fill:#eef4fb;stroke:var(--accent)}
.vg-fold.hit rect,.vg-fold.hl rect{stroke:var(--hl);stroke-width:3;fill:#fff4e6}
.vg-run>rect{fill:none;stroke:#6b7fa3;stroke-width:1.2}
.vg-frame>rect{stroke:#9aa7b8;stroke-width:1}
.vg-frame.hl>rect{stroke:var(--hl);stroke-width:3;fill:#fff4e6 !important}
.vg-btn{cursor:pointer}
.vg-btn rect{fill:#fff;stroke:#b6c0cc}
.vg-btn:hover rect{fill:#eef4fb;stroke:var(--accent)}
.vg-e{fill:none;stroke:#6e7781;stroke-width:1}
.vg-e.leaf{stroke:#0b5cad;stroke-width:1}
.vg-e.stub{stroke:#aab3bd;stroke-width:1}
.vg-e.carry{stroke:#b03a2e;stroke-width:1.5}
.vg-e.fold{stroke-dasharray:4 3}
.vg-e.on{stroke:var(--accent);stroke-width:2}
#vg-pane-virtual svg .node{cursor:pointer}
#vg-pane-virtual svg .node.sel polygon,#vg-pane-virtual svg .node.sel path{stroke:var(--accent);stroke-width:3}
"""

_SCRIPT = r"""
(function(){
'use strict';
const D = JSON.parse(document.getElementById('vg-data').textContent);
const $ = id => document.getElementById(id);
const NS = 'http://www.w3.org/2000/svg';
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
const num = v => v === null || v === undefined ? null : (typeof v === 'string' ? (v === 'NaN' ? NaN : v === 'Inf' ? Infinity : -Infinity) : v);
const fmt = v => { v = num(v); if (v === null) return '—'; if (!isFinite(v)) return String(v);
  if (v === 0) return '0'; const a = Math.abs(v); return (a >= 1e-3 && a < 1e5) ? String(+v.toPrecision(5)) : v.toExponential(4); };
$('vg-title').textContent = D.title;
const status = (msg, err) => { const s = $('vg-status'); s.textContent = msg || ''; s.className = err ? 'err' : ''; };

// ------------------------------------------------------------------ colour scale (log10 of |grad|)
const CMAP = [[0,[0xEA,0xF1,0xFA]],[0.25,[0x9E,0xCA,0xE1]],[0.5,[0xFF,0xF1,0xA8]],[0.75,[0xFD,0xAE,0x61]],[1,[0xD7,0x30,0x27]]];
function cmap(p){ p = Math.min(1, Math.max(0, p));
  for (let i = 1; i < CMAP.length; i++) { const [p1, c1] = CMAP[i], [p0, c0] = CMAP[i-1];
    if (p <= p1) { const w = (p - p0) / (p1 - p0); return '#' + c0.map((a, j) => Math.round(a + (c1[j] - a) * w).toString(16).padStart(2, '0')).join(''); } }
  return '#d73027'; }
const lum = c => { const r = parseInt(c.slice(1,3),16)/255, g = parseInt(c.slice(3,5),16)/255, b = parseInt(c.slice(5,7),16)/255; return 0.2126*r + 0.7152*g + 0.0722*b; };
const NONFINITE = '#8e44ad', DECADES = 10;

// ------------------------------------------------------------------ tabs
const views = [];
if (D.unrolled) views.push(['unrolled', 'Unrolled build']);
if (D.virtual) views.push(['virtual', 'Virtual graph']);
let current = views.length ? views[0][0] : null;
for (const [id, label] of views) {
  const b = document.createElement('button'); b.type = 'button'; b.textContent = label; b.dataset.view = id;
  b.setAttribute('role', 'tab'); b.id = 'vg-tab-' + id; b.onclick = () => showView(id); $('vg-tabs').appendChild(b);
}
function showView(id){
  current = id;
  for (const b of $('vg-tabs').children) b.setAttribute('aria-selected', b.dataset.view === id ? 'true' : 'false');
  $('vg-pane-unrolled').hidden = id !== 'unrolled'; $('vg-pane-virtual').hidden = id !== 'virtual';
  for (const el of document.querySelectorAll('.u-only')) el.style.display = id === 'unrolled' ? '' : 'none';
  applyZoom();
}

// ------------------------------------------------------------------ zoom (per view)
const zoom = {unrolled: 1, virtual: 1};
const natural = {unrolled: [0, 0], virtual: [0, 0]};
function applyZoom(){
  if (!current) return;
  const svg = $('vg-pane-' + current).querySelector('svg'); if (!svg) return;
  const [w, h] = natural[current], z = zoom[current];
  svg.setAttribute('width', Math.max(1, w * z)); svg.setAttribute('height', Math.max(1, h * z));
  $('vg-zoom').textContent = Math.round(z * 100) + '%';
}
function setZoom(z, keepCenter){
  const pane = $('vg-pane-' + current), old = zoom[current];
  const cx = (pane.scrollLeft + pane.clientWidth / 2) / old, cy = (pane.scrollTop + pane.clientHeight / 2) / old;
  zoom[current] = Math.min(4, Math.max(0.05, z)); applyZoom();
  if (keepCenter) { pane.scrollLeft = cx * zoom[current] - pane.clientWidth / 2; pane.scrollTop = cy * zoom[current] - pane.clientHeight / 2; }
}
const READABLE = 0.7;  // the smallest scale Fit goes to: node labels of 12px stay about 8px tall
function fitScale(w, h, pane){
  const fw = (pane.clientWidth - 16) / w, fh = (pane.clientHeight - 16) / h, whole = Math.min(1.5, fw, fh);
  return whole >= READABLE ? whole : Math.max(READABLE, Math.min(1, fw));  // a tall drawing: its width (at most 100%), then scroll
}
function fit(){
  const pane = $('vg-pane-' + current), [w, h] = natural[current]; if (!w) return;
  setZoom(fitScale(w, h, pane), false);
  pane.scrollLeft = Math.max(0, (pane.scrollWidth - pane.clientWidth) / 2); pane.scrollTop = 0;
}
// After a search the found node stays in the details panel until the pointer really moves (the
// browser sends mouse events without a move when the drawing scrolls under a still pointer).
let pointer = [NaN, NaN], hoverHold = null;
document.addEventListener('mousemove', e => { pointer = [e.clientX, e.clientY];
  if (hoverHold && (e.clientX !== hoverHold[0] || e.clientY !== hoverHold[1])) hoverHold = null; }, true);
$('vg-toolbar').addEventListener('click', e => {
  const b = e.target.closest('button'); if (!b) return;
  const act = b.dataset.act;
  if (act === 'zoom-in') setZoom(zoom[current] * 1.25, true);
  else if (act === 'zoom-out') setZoom(zoom[current] / 1.25, true);
  else if (act === 'fit') fit();
  else if (act === 'fold-all' && U) { U.foldAll(); }
});
for (const id of ['unrolled', 'virtual']) $('vg-pane-' + id).addEventListener('wheel', e => {
  if (!e.ctrlKey) return; e.preventDefault(); setZoom(zoom[current] * (e.deltaY < 0 ? 1.1 : 1 / 1.1), true); }, {passive: false});

// ------------------------------------------------------------------ node details
function row(k, v){ return '<tr><th>' + esc(k) + '</th><td>' + v + '</td></tr>'; }
function link(key){ return '<a data-key="' + esc(key) + '">' + esc(key) + '</a>'; }
$('vg-info').addEventListener('click', e => { const a = e.target.closest('a[data-key]'); if (a) findKey(a.dataset.key); });

// ------------------------------------------------------------------ the unrolled view
let U = null;
if (D.unrolled) U = unrolledView(D.unrolled);

function unrolledView(X){
  const S = X.strings, C = X.nodes, N = C.key.length, runs = X.runs, frames = X.frames;
  const str = i => i < 0 ? null : S[i];
  const keyIndex = new Map(); for (let i = 0; i < N; i++) keyIndex.set(C.key[i], i);
  const typeOf = i => C.key[i].slice(0, C.key[i].indexOf(':'));
  const GUARD = new Set(['LoopCheck', 'LengthCheck']);
  // the build as declared (the plain unroll's nodes and edges, the default) or as executed (hoisted
  // groups, their rows, fused sums): X.declared lists what differs (see _declared_view)
  const DV = X.declared, dParents = new Map(), dOp = new Map(), dHide = new Set(DV ? DV.hide : []);
  if (DV) for (const [i, o, ps] of DV.nodes) { dParents.set(i, ps); dOp.set(i, o); }
  let asDeclared = !!DV, children;
  const parentsOf = i => asDeclared && dParents.has(i) ? dParents.get(i) : C.parents[i];
  const opOf = i => asDeclared && dOp.has(i) ? dOp.get(i) : C.op[i];
  function linkChildren(){ children = Array.from({length: N}, () => []);
    for (let i = 0; i < N; i++) if (!(asDeclared && dHide.has(i))) for (const p of parentsOf(i)) children[p].push(i); }
  linkChildren();
  const modeEl = $('vg-mode'); modeEl.hidden = !DV;
  function setDeclared(on){ asDeclared = !!DV && on; linkChildren();
    for (const b of modeEl.children) b.setAttribute('aria-pressed', (b.dataset.mode === 'declared') === asDeclared ? 'true' : 'false');
    if (selected >= 0 && asDeclared && dHide.has(selected)) selected = -1; }
  modeEl.addEventListener('click', e => { const b = e.target.closest('button[data-mode]'); if (!b) return;
    setDeclared(b.dataset.mode === 'declared'); draw(); if (selected >= 0) showInfo(selected);
    status(asDeclared ? 'as declared: the model\'s own ops' : 'as executed: hoisted groups and fused sums'); });
  // node and run membership
  const frameNodes = frames.map(() => []), frameRuns = frames.map(() => []), rootNodes = [], rootRuns = [];
  for (let i = 0; i < N; i++) (C.frame[i] < 0 ? rootNodes : frameNodes[C.frame[i]]).push(i);
  runs.forEach((r, ri) => (r.parent < 0 ? rootRuns : frameRuns[r.parent]).push(ri));
  const edgeName = new Map(); for (const [p, f, s] of X.edgeNames) edgeName.set(p + ',' + f, S[s]);
  // fold state: shown[ri][t]
  const [F0, F1] = D.fold;
  const shown = runs.map(r => new Uint8Array(r.trips));
  function defaultFold(ri){ const n = runs[ri].trips, s = shown[ri]; s.fill(0);
    if (n <= F0 + F1 + 1) s.fill(1); else { for (let t = 0; t < F0; t++) s[t] = 1; for (let t = n - F1; t < n; t++) s[t] = 1; } }
  runs.forEach((_, ri) => defaultFold(ri));
  let showGuards = false, gradColor = X.hasGrad;
  $('vg-gradcolor').checked = gradColor; $('vg-gradcolor').disabled = !X.hasGrad;
  $('vg-gradcolor').onchange = e => { gradColor = e.target.checked; draw(); };
  $('vg-guards').onchange = e => { showGuards = e.target.checked; draw(); };
  document.querySelector('[data-act="fold-all"]').hidden = !runs.some(r => r.trips > F0 + F1 + 1);  // nothing to fold

  // gradient scale: the top DECADES decades below the largest finite norm
  let lo = -1, hi = 0;
  { let mx = 0, mn = Infinity; for (let i = 0; i < N; i++) { const g = num(C.grad[i]); if (g > 0 && isFinite(g)) { mx = Math.max(mx, g); mn = Math.min(mn, g); } }
    if (mx > 0) { hi = Math.ceil(Math.log10(mx)); lo = Math.max(Math.floor(Math.log10(mn)), hi - DECADES); if (lo >= hi) lo = hi - 1; } }
  const clipped = (() => { for (let i = 0; i < N; i++) { const g = num(C.grad[i]); if (g > 0 && Math.log10(g) < lo) return true; } return false; })();
  function gradFill(g){ g = num(g); if (g === null) return null; if (!isFinite(g)) return NONFINITE; if (g === 0) return '#ffffff';
    return cmap((Math.log10(g) - lo) / (hi - lo)); }
  function legend(){
    const el = $('vg-legend'); if (!X.hasGrad || !gradColor) { el.innerHTML = ''; return; }
    const step = Math.max(1, Math.ceil((hi - lo) / 8)); let h = '<span class="cap">|grad|</span>';
    for (let e = lo; e <= hi; e += step) { const c = cmap((e - lo) / (hi - lo));
      h += '<span class="cell" style="background:' + c + ';color:' + (lum(c) < .45 ? '#fff' : '#222') + '">' + (e === lo && clipped ? '≤' : '') + '1e' + e + '</span>'; }
    h += '<span class="cell" style="background:#fff">0</span><span class="cell" style="background:' + NONFINITE + ';color:#fff">NaN/Inf</span>';
    el.innerHTML = h; el.title = 'fill: log10 of the norm of node.grad' + (clipped ? '; norms below 1e' + lo + ' (more than ' + DECADES + ' decades under the largest) share the lowest colour' : '') + '; white outline: no gradient kept';
  }

  const STYLE = {Parameter:['#ffe4b5',1], Input:['#d9f0d3',1], Constant:['#eeeeee',1], Sample:['#eeeeee',1], Item:['#ecf6e8',1],
    Stack:['#dfe9f5',0], Final:['#fbe3e0',1], Branch:['#e8dcf5',0], LoopCheck:['#ffffff',0], LengthCheck:['#ffffff',0]};
  const visible = i => { if (asDeclared && dHide.has(i)) return false; const t = typeOf(i); return showGuards || !GUARD.has(t); };

  // text measurement
  const ctx = document.createElement('canvas').getContext('2d');
  const FONT = 'system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif';
  const wcache = new Map();
  function tw(text, font){ const k = font + '|' + text; let w = wcache.get(k); if (w === undefined) { ctx.font = font; w = ctx.measureText(text).width; wcache.set(k, w); } return w; }
  // a stub's label: the leaf's name, cut to STUBCHARS characters (the leaf itself shows it whole)
  const STUBCHARS = 18, stubLabel = p => { const s = Array.from(str(C.name[p]) || C.key[p]); return s.length > STUBCHARS ? s.slice(0, STUBCHARS - 1).join('') + '…' : s.join(''); };
  function nodeLines(i){
    const l1 = '<' + C.key[i] + '>'; const name = str(C.name[i]), op = str(opOf(i)), note = str(C.note[i]);
    const parts = []; if (name) parts.push(name); if (op && op !== typeOf(i) && op !== 'GetItem') parts.push(op);
    const l2 = parts.join(' · '); let l3 = str(C.shape[i]);
    if (note) l3 += ' · ' + note;
    if (gradColor && C.grad[i] !== null) l3 += ' · |g| ' + fmt(C.grad[i]);
    return [l1, l2, l3];
  }

  // ---------------------------------------------------------------- build the element tree
  // element: {kind:'node'|'fold'|'run'|'frame'|'root', items:[], w, h, x, y, parent}
  let elById, nodeEl, frameEl, root;
  function build(){
    elById = new Map(); nodeEl = new Int32Array(N).fill(-1); frameEl = new Map();
    const els = [];
    const mk = o => { o.id = els.length; els.push(o); return o; };
    root = mk({kind: 'root', items: [], parent: null});
    const rep = new Array(frames.length); // frame -> element id standing for it (frame or fold), or -1
    const stack = [];
    const addNodes = (list, cont) => { for (const i of list) if (visible(i)) { const e = mk({kind: 'node', i, items: [], parent: cont}); cont.items.push(e); nodeEl[i] = e.id; } };
    const addRun = (ri, cont) => {
      const r = runs[ri], e = mk({kind: 'run', ri, items: [], parent: cont}); cont.items.push(e);
      const s = shown[ri]; let t = 0;
      while (t < r.trips) {
        if (s[t]) { const fi = r.frames[t]; const fe = mk({kind: 'frame', f: fi, items: [], parent: e}); e.items.push(fe); rep[fi] = fe.id; frameEl.set(fi, fe);
          stack.push(fe); t++; continue; }
        let b = t; while (b + 1 < r.trips && !s[b + 1]) b++;
        const fe = mk({kind: 'fold', ri, a: t, b, items: [], parent: e}); e.items.push(fe);
        for (let u = t; u <= b; u++) hide(r.frames[u], fe.id);
        t = b + 1;
      }
    };
    function hide(fi, id){ // a hidden frame and every frame inside it are represented by the fold
      const todo = [fi]; while (todo.length) { const f = todo.pop(); rep[f] = id; for (const ri of frameRuns[f]) for (const g of runs[ri].frames) todo.push(g); } }
    addNodes(rootNodes, root); for (const ri of rootRuns) addRun(ri, root);
    while (stack.length) { const fe = stack.shift(); addNodes(frameNodes[fe.f], fe); for (const ri of frameRuns[fe.f]) addRun(ri, fe); }
    // representatives of nodes
    const nrep = new Int32Array(N);
    for (let i = 0; i < N; i++) { const f = C.frame[i]; nrep[i] = !visible(i) ? -1 : (f < 0 ? nodeEl[i] : (els[rep[f]].kind === 'fold' ? rep[f] : nodeEl[i])); }
    // edges between representatives
    const edges = [], seen = new Set();
    for (let i = 0; i < N; i++) { const b = nrep[i]; if (b < 0) continue;
      for (const p of parentsOf(i)) { const a = nrep[p]; if (a < 0 || a === b) continue; const k = a + '>' + b; if (seen.has(k)) continue; seen.add(k);
        const ea = els[a], eb = els[b]; let cls = '', label = null;
        const nm = edgeName.get(p + ',' + C.frame[i]);
        if (nm !== undefined && !GUARD.has(typeOf(i))) { cls = 'carry'; label = nm; }
        else if ((C.op[p] < 0 || typeOf(p).endsWith('*')) && C.frame[i] >= 0 && C.frame[p] !== C.frame[i]) cls = 'leaf';  // shared leaves and hoisted groups: stubs
        if (ea.kind === 'fold' || eb.kind === 'fold') cls += ' fold';
        edges.push({a, b, cls, label, p, i});
        if (cls === 'leaf') { const w = tw(stubLabel(p), STUBFONT); eb.stubw = Math.max(eb.stubw || 0, w); } } }
    for (const ed of edges) els[ed.b].nin = (els[ed.b].nin || 0) + 1;
    return {els, edges};
  }

  // ---------------------------------------------------------------- layout
  const PADX = 12, HEAD = 24, GAPX = 16, GAPY = 26, RUNGAP = 10, DUMMYW = 6, MAXDUMMIES = 3000;
  const LINEFONTS = ['600 12px ' + FONT, '12px ' + FONT, '11px ' + FONT], STUBFONT = '10px ' + FONT;
  const metrics = LINEFONTS.map(f => { ctx.font = f; const m = ctx.measureText('Hg_|(');
    const size = parseFloat(f.match(/(\d+)px/)[1]); return [m.fontBoundingBoxAscent || 0.95 * size, m.fontBoundingBoxDescent || 0.25 * size]; });
  // baselines of [key, name · op, shape] and of [key, shape], and the node heights: 3px above and below, 1px between lines
  function baselines(fonts){ const ys = []; let y = 3; fonts.forEach((f, j) => { y += (j ? metrics[fonts[j - 1]][1] + 1 : 0) + metrics[f][0]; ys.push(Math.ceil(y)); });
    return [ys, Math.ceil(ys[ys.length - 1] + metrics[fonts[fonts.length - 1]][1] + 3)]; }
  const [YS3, NODEH] = baselines([0, 1, 2]), [YS2, NODEH2] = baselines([0, 2]);
  function sizeLeaf(e){
    if (e.kind === 'node') { const [a, b, c] = nodeLines(e.i); e.lines = [a, b, c];
      e.w = Math.ceil(Math.max(tw(a, LINEFONTS[0]), tw(b, LINEFONTS[1]), tw(c, LINEFONTS[2])) + 18); e.h = b ? NODEH : NODEH2; if (!b) e.lines = [a, c];
      // room for the labels of the stubs above it: incoming edges meet the top at w·(j+1)/(n+1), one label width apart at least
      if (e.stubw) e.w = Math.max(e.w, Math.ceil((e.nin + 1) * (e.stubw + 6))); }
    else { const n = e.b - e.a + 1; e.lines = ['… ' + n + ' iteration' + (n > 1 ? 's' : '') + ' …', (e.a === e.b ? 't=' + e.a : 't=' + e.a + ' … ' + e.b) + ' folded · click to unfold'];
      e.w = Math.ceil(Math.max(tw(e.lines[0], '600 12px ' + FONT), tw(e.lines[1], '11px ' + FONT)) + 24); e.h = 40; }
  }
  function layout(T){
    const {els, edges} = T;
    // container-level edges: between the two children of the lowest common container
    const depth = new Int32Array(els.length);
    for (const e of els) depth[e.id] = e.parent ? depth[e.parent.id] + 1 : 0;
    const cedges = new Map();
    for (const ed of edges) { let a = els[ed.a], b = els[ed.b];
      while (depth[a.id] > depth[b.id]) a = a.parent; while (depth[b.id] > depth[a.id]) b = b.parent;
      while (a.parent !== b.parent) { a = a.parent; b = b.parent; }
      if (a === b) continue; const c = a.parent; if (c.kind === 'run') continue;
      ed.via = [c, a.id + '>' + b.id];
      let l = cedges.get(c.id); if (!l) cedges.set(c.id, l = []); l.push([a, b]); }
    // bottom-up sizes: deepest first
    const order = els.slice().sort((x, y) => depth[y.id] - depth[x.id]);
    for (const e of order) {
      if (e.kind === 'node' || e.kind === 'fold') { sizeLeaf(e); continue; }
      if (e.kind === 'run') { let w = 0, y = HEAD + 4; for (const c of e.items) { c.x = 0; c.y = y; y += c.h + RUNGAP; w = Math.max(w, c.w); }
        const label = runs[e.ri].label + (runs[e.ri].outer ? ' @' + runs[e.ri].outer : '') + ' · ' + runs[e.ri].trips + ' iteration' + (runs[e.ri].trips === 1 ? '' : 's');
        e.label = label; e.foldable = runs[e.ri].trips > F0 + F1 + 1; w = Math.max(w, tw(label, '600 12px ' + FONT) + (e.foldable ? 150 : 20));
        if (!e.items.length) y += 18;  // room for "no iterations"
        for (const c of e.items) c.x = PADX + (w - c.w) / 2; e.w = w + 2 * PADX; e.h = y - RUNGAP + PADX; continue; }
      dag(e, cedges.get(e.id) || []);
    }
    // absolute positions, top-down
    root.x = 0; root.y = 0;
    const stack = [root];
    while (stack.length) { const e = stack.pop(); for (const c of e.items) { c.ax = (e.ax || 0) + c.x; c.ay = (e.ay || 0) + c.y; stack.push(c); } }
    root.ax = 0; root.ay = 0;
  }
  function dag(cont, cedges){
    const items = cont.items, n = items.length; if (!n) { cont.w = 120; cont.h = HEAD + 10; return; }
    const pos = new Map(items.map((c, k) => [c.id, k]));
    const par = items.map(() => []), chi = items.map(() => []);
    const seen = new Set();
    for (const [a, b] of cedges) { const ka = pos.get(a.id), kb = pos.get(b.id), s = ka + ',' + kb; if (seen.has(s)) continue; seen.add(s); par[kb].push(ka); chi[ka].push(kb); }
    // topological order (Kahn); what remains in a cycle follows in item order
    const indeg = par.map(p => p.length), topo = [], q = []; for (let k = 0; k < n; k++) if (!indeg[k]) q.push(k);
    const done = new Uint8Array(n);
    while (topo.length < n) { if (!q.length) { for (let k = 0; k < n; k++) if (!done[k]) { q.push(k); break; } }
      const k = q.shift(); if (done[k]) continue; done[k] = 1; topo.push(k); for (const c of chi[k]) if (--indeg[c] === 0) q.push(c); }
    const rank = new Int32Array(n), tpos = new Int32Array(n); topo.forEach((k, j) => tpos[k] = j);
    for (const k of topo) for (const p of par[k]) if (tpos[p] < tpos[k]) rank[k] = Math.max(rank[k], rank[p] + 1);
    for (let j = n - 1; j >= 0; j--) { const k = topo[j]; if (par[k].length || !chi[k].length) continue;  // sources sit just above their first consumer
      let m = Infinity; for (const c of chi[k]) if (tpos[c] > j) m = Math.min(m, rank[c]); if (m !== Infinity) rank[k] = Math.max(rank[k], m - 1); }
    // an edge spanning several layers runs through one dummy per layer, so it is routed around nodes
    const w = items.map(c => c.w), rk = Array.from(rank), P = par.map(x => x.slice()), Q = chi.map(x => x.slice());
    const routes = [];
    let budget = MAXDUMMIES;  // a big flat graph keeps its long edges direct rather than growing quadratically
    for (let ka = 0; ka < n; ka++) for (const kb of chi[ka]) { const span = rk[kb] - rk[ka]; if (span <= 1 || span > budget) continue; budget -= span - 1;
      P[kb].splice(P[kb].indexOf(ka), 1); Q[ka].splice(Q[ka].indexOf(kb), 1);
      let prev = ka; const ds = [];
      for (let r = rk[ka] + 1; r < rk[kb]; r++) { const d = w.length; w.push(DUMMYW); rk.push(r); P.push([prev]); Q.push([]); Q[prev].push(d); ds.push(d); prev = d; }
      Q[prev].push(kb); P[kb].push(prev); routes.push([items[ka].id + '>' + items[kb].id, ds]); }
    const M = w.length, R = Math.max(...rk) + 1, layers = Array.from({length: R}, () => []);
    for (let k = 0; k < M; k++) layers[rk[k]].push(k);
    const ord = new Float64Array(M); layers.forEach(L => L.forEach((k, j) => ord[k] = j));
    const bary = (k, nb) => { let s = 0, c = 0; for (const o of nb[k]) { s += ord[o]; c++; } return c ? s / c : ord[k]; };
    for (let sweep = 0; sweep < 6; sweep++) { const down = sweep % 2 === 0;
      for (let li = down ? 1 : R - 2; down ? li < R : li >= 0; li += down ? 1 : -1) { const L = layers[li]; const b = new Map(L.map(k => [k, bary(k, down ? P : Q)]));
        L.sort((x, y) => b.get(x) - b.get(y) || ord[x] - ord[y]); L.forEach((k, j) => ord[k] = j); } }
    // coordinates
    const cx = new Float64Array(M), gap = (a, b) => (a >= n || b >= n) ? GAPX / 2 : GAPX;
    layers.forEach(L => { let x = 0; for (const k of L) { cx[k] = x + w[k] / 2; x += w[k] + GAPX; } const off = x / 2; for (const k of L) cx[k] -= off; });
    const place = (L, want) => { // keep order, no overlap, as close to want as possible
      const m = L.length, l = new Float64Array(m), r = new Float64Array(m);
      for (let j = 0; j < m; j++) { const k = L[j]; l[j] = j ? Math.max(want[j], l[j-1] + w[L[j-1]] / 2 + gap(L[j-1], k) + w[k] / 2) : want[j]; }
      for (let j = m - 1; j >= 0; j--) { const k = L[j]; r[j] = j < m - 1 ? Math.min(want[j], r[j+1] - w[L[j+1]] / 2 - gap(k, L[j+1]) - w[k] / 2) : want[j]; }
      for (let j = 0; j < m; j++) { const k = L[j]; let x = (l[j] + r[j]) / 2; if (j) x = Math.max(x, cx[L[j-1]] + w[L[j-1]] / 2 + gap(L[j-1], k) + w[k] / 2); cx[k] = x; } };
    for (let sweep = 0; sweep < 8; sweep++) { const down = sweep % 2 === 0, nb = down ? P : Q;
      for (let li = down ? 0 : R - 1; down ? li < R : li >= 0; li += down ? 1 : -1) { const L = layers[li];
        const want = L.map(k => { let s = 0, c = 0; for (const o of nb[k]) { s += cx[o]; c++; } return c ? s / c : cx[k]; }); place(L, want); } }
    let minx = Infinity, maxx = -Infinity; for (let k = 0; k < M; k++) { minx = Math.min(minx, cx[k] - w[k] / 2); maxx = Math.max(maxx, cx[k] + w[k] / 2); }
    const top = cont.kind === 'root' ? PADX : HEAD + 2; let y = top;
    const band = new Array(R);
    layers.forEach((L, li) => { let h = 0; for (const k of L) if (k < n) h = Math.max(h, items[k].h);
      for (const k of L) if (k < n) { const c = items[k]; c.x = PADX + cx[k] - w[k] / 2 - minx;
        // next to a tall loop box, a node sits by its producers (top) or, without any, by its consumers (bottom)
        c.y = h <= 2 * NODEH || c.kind === 'run' || c.kind === 'frame' ? y + (h - c.h) / 2 : par[k].length ? y : y + h - c.h; }
      band[li] = [y, y + h]; y += h + GAPY; });
    cont.routes = new Map(routes.map(([key, ds]) => [key, ds.map(d => [PADX + cx[d] - minx, band[rk[d]][0], band[rk[d]][1]])]));
    cont.w = Math.max(maxx - minx + 2 * PADX, cont.kind === 'frame' ? 70 : 0); cont.h = y - GAPY + PADX;
  }

  // ---------------------------------------------------------------- drawing
  const pane = $('vg-pane-unrolled');
  let T = null, selected = -1, leafPaths = new Map();
  function draw(){
    const t0 = performance.now();
    T = build(); const t1 = performance.now(); layout(T); const t2 = performance.now();
    const out = [], edgesOut = [], nodesOut = [];
    const W = Math.ceil(root.w + 20), H = Math.ceil(root.h + 20);
    out.push('<svg xmlns="' + NS + '" class="vg-g" viewBox="0 0 ' + W + ' ' + H + '" width="' + W + '" height="' + H + '">');
    out.push('<defs>' + [['a', '#6e7781'], ['al', '#c2c9d1'], ['ac', '#b03a2e'], ['ao', '#0b5cad']].map(([id, c]) =>
      '<marker id="vg-' + id + '" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,1L10,5L0,9z" fill="' + c + '"/></marker>').join('') + '</defs>');
    for (const e of T.els) {
      if (e.kind === 'run') { const r = runs[e.ri];
        out.push('<g class="vg-run" data-run="' + e.ri + '"><rect x="' + e.ax + '" y="' + e.ay + '" width="' + e.w + '" height="' + e.h + '" rx="8"/>' +
          '<text x="' + (e.ax + 10) + '" y="' + (e.ay + 16) + '" font-size="12" font-weight="600" fill="#2c3e50">' + esc(e.label) + '</text>');
        if (!r.trips) out.push('<text x="' + (e.ax + e.w / 2) + '" y="' + (e.ay + HEAD + 14) + '" text-anchor="middle" font-size="11" font-style="italic" fill="#57606a">no iterations</text>');
        const bx = e.ax + e.w - 8; let x = bx;
        if (e.foldable) for (const [act, label] of [['fold', 'fold'], ['unfold', 'unfold all']]) { const bw = tw(label, '11px ' + FONT) + 12; x -= bw;
          out.push('<g class="vg-btn" data-act="' + act + '" data-run="' + e.ri + '"><rect x="' + x + '" y="' + (e.ay + 4) + '" width="' + bw + '" height="17" rx="4"/><text x="' + (x + 6) + '" y="' + (e.ay + 16) + '" font-size="11" fill="#0b5cad">' + label + '</text></g>'); x -= 6; }
        out.push('</g>'); }
      else if (e.kind === 'frame') { const fr = frames[e.f], r = runs[fr[0]];
        const fill = fr[2].split('.').length % 2 ? '#f4f6f9' : '#e9edf3';
        out.push('<g class="vg-frame" data-frame="' + e.f + '" data-loop="' + r.loop + '" data-t="' + fr[1] + '"><rect x="' + e.ax + '" y="' + e.ay + '" width="' + e.w + '" height="' + e.h + '" rx="6" fill="' + fill + '"/>' +
          '<text x="' + (e.ax + 8) + '" y="' + (e.ay + 15) + '" font-size="12" font-weight="600" fill="#3d4b5c">t=' + fr[2] + '</text></g>'); }
    }
    const center = e => [e.ax + e.w / 2, e.ay + e.h / 2];
    // incoming edges spread over the top of their head, ordered by where they come from
    const port = new Map(), byHead = new Map();
    for (const ed of T.edges) { let l = byHead.get(ed.b); if (!l) byHead.set(ed.b, l = []); l.push(ed); }
    for (const [b, l] of byHead) { const e = T.els[b]; l.sort((p, q) => (T.els[p.a].ax + T.els[p.a].w / 2) - (T.els[q.a].ax + T.els[q.a].w / 2));
      l.forEach((ed, j) => port.set(ed, e.ax + e.w * (j + 1) / (l.length + 1))); }
    leafPaths = new Map();
    for (const ed of T.edges) { const a = T.els[ed.a], b = T.els[ed.b];
      let [x1, y1] = center(a), [x2, y2] = center(b); let d; x2 = port.get(ed);
      if (ed.cls === 'leaf' && b.ay > a.ay + a.h) { // a shared leaf used in an iteration: a short labelled stub; the full edge shows on hover
        edgesOut.push('<path class="vg-e stub" d="M' + x2 + ',' + (b.ay - 13) + 'L' + x2 + ',' + b.ay + '" marker-end="url(#vg-al)"/><text class="vg-stub" data-key="' + esc(C.key[ed.p]) + '" x="' + x2 + '" y="' + (b.ay - 15) + '" font-size="10" text-anchor="middle" fill="#8c959f">' + esc(stubLabel(ed.p)) + '</text>'); }
      if (b.ay >= a.ay + a.h - 1 && a.ay + a.h < b.ay + b.h) { y1 = a.ay + a.h; y2 = b.ay;
        const via = ed.via && ed.via[0].routes ? ed.via[0].routes.get(ed.via[1]) : null, c = ed.via ? ed.via[0] : null;
        const pts = [[x1, y1]]; if (via) for (const [dx, t, u] of via) { pts.push([c.ax + dx, c.ay + t]); pts.push([c.ax + dx, c.ay + u]); } pts.push([x2, y2]);
        d = 'M' + x1 + ',' + y1;
        for (let j = 0; j + 1 < pts.length; j += 2) { const [p, q] = [pts[j], pts[j + 1]], m = Math.max(12, (q[1] - p[1]) / 2);
          if (j) d += 'L' + p[0] + ',' + p[1];
          d += 'C' + p[0] + ',' + (p[1] + m) + ' ' + q[0] + ',' + (q[1] - m) + ' ' + q[0] + ',' + q[1]; }
        if (ed.label) { const mid = pts[Math.floor(pts.length / 2) - 1], mid2 = pts[Math.floor(pts.length / 2)]; x1 = mid[0]; y1 = mid[1]; x2 = mid2[0]; y2 = mid2[1]; } }
      else { const side = Math.max(a.ax + a.w, b.ax + b.w) + 30; y1 = a.ay + a.h / 2; y2 = b.ay + b.h / 2; x1 = a.ax + a.w; x2 = b.ax + b.w;
        d = 'M' + x1 + ',' + y1 + 'C' + side + ',' + y1 + ' ' + side + ',' + y2 + ' ' + x2 + ',' + y2; }
      const mk = ed.cls.includes('carry') ? 'ac' : ed.cls.includes('leaf') ? 'al' : 'a';
      const path = '<path class="vg-e ' + ed.cls + '" data-a="' + ed.a + '" data-b="' + ed.b + '" d="' + d + '" marker-end="url(#vg-' + mk + ')"/>';
      if (ed.cls.includes('leaf')) { for (const k of [ed.a, ed.b]) { let l = leafPaths.get(k); if (!l) leafPaths.set(k, l = []); l.push(path); } continue; }  // drawn on hover only
      edgesOut.push(path);
      if (ed.label) edgesOut.push('<text x="' + ((x1 + x2) / 2 + 5) + '" y="' + ((y1 + y2) / 2 + 4) + '" font-size="11" fill="#b03a2e">' + esc(ed.label) + '</text>');
    }
    for (const e of T.els) {
      if (e.kind === 'node') { const i = e.i, t = typeOf(i), st = STYLE[t] || ['#ffffff', 0];
        let fill = st[0], color = '#1f2328'; const g = C.grad[i];
        if (gradColor && X.hasGrad) { const f = gradFill(g); if (f) { fill = f; if (lum(f) < .45) color = '#fff'; } else fill = '#ffffff'; }
        const rx = st[1] ? 9 : 3; const cx = e.ax + e.w / 2; const ys = e.lines.length === 3 ? YS3 : YS2;
        nodesOut.push('<g class="vg-n' + (i === selected ? ' sel' : '') + '" data-i="' + i + '" data-key="' + esc(C.key[i]) + '"><rect x="' + e.ax + '" y="' + e.ay + '" width="' + e.w + '" height="' + e.h + '" rx="' + rx + '" fill="' + fill + '"' +
          (GUARD.has(t) ? ' stroke-dasharray="2 2"' : '') + (gradColor && X.hasGrad && g === null ? ' stroke="#c8ced6"' : '') + '/>' +
          e.lines.map((l, j) => '<text x="' + cx + '" y="' + (e.ay + ys[j]) + '" text-anchor="middle" font-size="' + (j === 0 ? 12 : j === 1 ? 12 : 11) + '"' + (j === 0 ? ' font-weight="600"' : '') + ' fill="' + (j === 2 && color !== '#fff' ? '#57606a' : color) + '">' + esc(l) + '</text>').join('') + '</g>'); }
      else if (e.kind === 'fold') { const cx = e.ax + e.w / 2;
        nodesOut.push('<g class="vg-fold" data-fold="' + e.id + '" data-run="' + e.ri + '" data-a="' + e.a + '" data-b="' + e.b + '"><rect x="' + e.ax + '" y="' + e.ay + '" width="' + e.w + '" height="' + e.h + '" rx="9"/>' +
          '<text x="' + cx + '" y="' + (e.ay + 17) + '" text-anchor="middle" font-size="12" font-weight="600" fill="#333">' + esc(e.lines[0]) + '</text>' +
          '<text x="' + cx + '" y="' + (e.ay + 31) + '" text-anchor="middle" font-size="11" fill="#57606a">' + esc(e.lines[1]) + '</text></g>'); }
    }
    out.push('<g class="edges">' + edgesOut.join('') + '</g><g class="vg-hover"></g><g class="nodes">' + nodesOut.join('') + '</g></svg>');
    const t3 = performance.now(); pane.innerHTML = out.join(''); U_stats.phases = [t1 - t0, t2 - t1, t3 - t2, performance.now() - t3].map(Math.round);
    natural.unrolled = [W, H];
    if (current === 'unrolled') applyZoom(); else { const s = pane.querySelector('svg'); s.setAttribute('width', W * zoom.unrolled); s.setAttribute('height', H * zoom.unrolled); }
    legend();
    U_stats.lastDrawMs = performance.now() - t0; U_stats.elements = T.els.length; U_stats.edges = T.edges.length;
    if (chartHover) highlightIteration(chartHover[0], chartHover[1]);
  }
  const U_stats = {};

  // ---------------------------------------------------------------- interaction
  function unfold(ri, a, b){ const s = shown[ri], n = b - a + 1;
    if (n <= 24) s.fill(1, a, b + 1); else { s.fill(1, a, a + 10); s.fill(1, b - 9, b + 1); }
    draw(); }
  pane.addEventListener('click', e => {
    const btn = e.target.closest('.vg-btn'); if (btn) { const ri = +btn.dataset.run;
      if (btn.dataset.act === 'fold') defaultFold(ri); else shown[ri].fill(1); draw(); return; }
    const f = e.target.closest('.vg-fold'); if (f) { unfold(+f.dataset.run, +f.dataset.a, +f.dataset.b); status('unfolded t=' + f.dataset.a + '…' + f.dataset.b); return; }
    const nd = e.target.closest('.vg-n'); if (nd) { select(+nd.dataset.i); }
  });
  pane.addEventListener('mouseover', e => {
    if (hoverHold) return;  // a search just put its node in the panel, and the pointer has not moved
    const nd = e.target.closest('.vg-n'); if (nd) { hover(+nd.dataset.i); return; }
    const f = e.target.closest('.vg-fold'); if (f) { const r = runs[+f.dataset.run];
      $('vg-info').innerHTML = '<div class="key">' + esc(r.label) + '</div><table>' + row('folded', 'iterations ' + f.dataset.a + ' … ' + f.dataset.b) +
        row('loop', esc(r.label) + (r.outer ? ' @' + r.outer : '')) + row('iterations', r.trips) + '</table><p class="hint">Click to unfold.</p>'; }
  });
  let hovered = -1;
  function hover(i){ hovered = i; showInfo(i); hoverEdges(i); }
  // the first real move after a search shows the node under the pointer, though it entered no new node
  pane.addEventListener('mousemove', e => { if (hoverHold) return; const nd = e.target.closest('.vg-n'); if (nd && +nd.dataset.i !== hovered) hover(+nd.dataset.i); });
  pane.addEventListener('mouseout', e => { if (!hoverHold && e.target.closest('.vg-n')) { hovered = -1; hoverEdges(-1); if (selected >= 0) showInfo(selected); } });
  function hoverEdges(i){ for (const p of pane.querySelectorAll('.vg-e.on')) p.classList.remove('on');
    const layer = pane.querySelector('.vg-hover'); layer.innerHTML = ''; if (i < 0 || nodeEl[i] < 0) return;
    layer.innerHTML = (leafPaths.get(nodeEl[i]) || []).join('').replace(/class="vg-e /g, 'class="vg-e on ');
    for (const p of pane.querySelectorAll('.edges .vg-e[data-a="' + nodeEl[i] + '"],.edges .vg-e[data-b="' + nodeEl[i] + '"]')) p.classList.add('on'); }
  function select(i){ selected = i; for (const el of pane.querySelectorAll('.vg-n.sel')) el.classList.remove('sel');
    const el = pane.querySelector('.vg-n[data-i="' + i + '"]'); if (el) el.classList.add('sel'); showInfo(i);
    if (onSelect) onSelect(i); }
  let onSelect = null;
  function showInfo(i){
    const st = C.stats[i], fr = C.frame[i];
    let h = '<div class="key" id="vg-info-key">&lt;' + esc(C.key[i]) + '&gt;</div><table>';
    h += row('name', esc(str(C.name[i]) || '—')) + row('op', esc(str(opOf(i)) || 'leaf')) + row('shape', esc(str(C.shape[i]))) + row('dtype', esc(str(C.dtype[i])));
    if (fr >= 0) { const r = runs[frames[fr][0]]; h += row('iteration', 't=' + esc(frames[fr][2]) + ' of ' + esc(r.label)); }
    if (st) h += row('min', '<span data-stat="min">' + fmt(st[0]) + '</span>') + row('max', '<span data-stat="max">' + fmt(st[1]) + '</span>') +
      row('mean', '<span data-stat="mean">' + fmt(st[2]) + '</span>') + row('norm', '<span data-stat="norm">' + fmt(st[3]) + '</span>');
    h += row('|grad|', '<span data-stat="grad">' + (C.grad[i] === null ? (X.hasGrad ? 'not kept' : 'no backward') : fmt(C.grad[i])) + '</span>');
    const note = str(C.note[i]); if (note) h += row('note', esc(note));
    if (asDeclared && dOp.has(i)) h += row('executed as', esc(str(C.op[i])) + ' <span class="hint">(see <i>as executed</i>)</span>');
    const ps = parentsOf(i); if (ps.length) h += row('inputs', ps.map(p => link(C.key[p])).join(' '));
    const cs = children[i]; if (cs.length) h += row('used by', cs.slice(0, 8).map(c => link(C.key[c])).join(' ') + (cs.length > 8 ? ' … +' + (cs.length - 8) : ''));
    $('vg-info').innerHTML = h + '</table>';
  }
  function reveal(i){ // unfold every iteration on the node's path
    let f = C.frame[i], changed = false;
    while (f >= 0) { const [ri, t] = frames[f]; if (!shown[ri][t]) { shown[ri][t] = 1; changed = true; } f = runs[ri].parent; }
    if (asDeclared && dHide.has(i)) { setDeclared(false); changed = true; }  // a group exists as executed only
    if (!visible(i)) { showGuards = true; $('vg-guards').checked = true; changed = true; }
    if (changed) draw();
  }
  function scrollToEl(el){
    const z = zoom.unrolled, pr = pane.getBoundingClientRect(), r = el.getBoundingClientRect();
    pane.scrollLeft += r.left + r.width / 2 - pr.left - pane.clientWidth / 2; pane.scrollTop += r.top + r.height / 2 - pr.top - pane.clientHeight / 2; return z; }
  const FOCUS = 1;  // the scale a found node is shown at (when zoomed out further)
  function focusNode(i){
    reveal(i); select(i);
    const el = pane.querySelector('.vg-n[data-i="' + i + '"]'); if (!el) return false;
    for (const h of pane.querySelectorAll('.hit')) h.classList.remove('hit'); el.classList.add('hit');
    if (zoom.unrolled < FOCUS) { zoom.unrolled = FOCUS; applyZoom(); }
    scrollToEl(el); hoverHold = pointer.slice(); hovered = -1; return true; }
  function foldAll(){ runs.forEach((_, ri) => defaultFold(ri)); draw(); }
  // chart <-> graph
  let chartHover = null;
  function highlightIteration(loop, t){
    chartHover = loop === null ? null : [loop, t];
    for (const el of pane.querySelectorAll('.hl')) el.classList.remove('hl'); if (loop === null) return null;
    let first = null;
    for (const el of pane.querySelectorAll('.vg-frame[data-loop="' + loop + '"][data-t="' + t + '"]')) { el.classList.add('hl'); first = first || el; }
    for (const el of pane.querySelectorAll('.vg-fold')) { const r = runs[+el.dataset.run]; if (r.loop === loop && +el.dataset.a <= t && t <= +el.dataset.b) { el.classList.add('hl'); first = first || el; } }
    return first; }
  function revealIteration(loop, t){
    runs.forEach((r, ri) => { if (r.loop === loop && t < r.trips) { shown[ri][t] = 1; let f = r.parent; while (f >= 0) { const [rj, u] = frames[f]; shown[rj][u] = 1; f = runs[rj].parent; } } });
    draw(); const el = highlightIteration(loop, t); if (el) scrollToEl(el); }
  draw();
  // |grad| of every copy of a node in the iterations of its loop run: the chart of a chosen node
  function nodeSeries(i){
    const f = C.frame[i]; if (f < 0 || C.grad[i] === null) return null;
    const ri = frames[f][0], r = runs[ri], key = C.key[i], base = key.slice(0, key.indexOf('@') < 0 ? key.length : key.indexOf('@'));
    const norms = new Array(r.trips).fill(null);
    for (const g of r.frames) for (const j of frameNodes[g]) if (C.key[j].startsWith(base + '@')) norms[frames[g][1]] = C.grad[j];
    return {param: base, key: base, loop: r.loop, loopLabel: r.label + (r.outer ? ' @' + r.outer : ''), norms, node: true};
  }
  return {draw, focusNode, foldAll, setDeclared, get declared(){ return asDeclared; }, highlightIteration, revealIteration, keyIndex, stats: U_stats, shown, keys: C.key,
          findKey: k => keyIndex.has(k) ? keyIndex.get(k) : -1, series: X.series, nodeSeries, set onSelect(f){ onSelect = f; }};
}

// ------------------------------------------------------------------ the virtual view
if (D.virtual) {
  const pane = $('vg-pane-virtual'), V = D.virtual;
  if (V.svg) { pane.innerHTML = V.svg; const svg = pane.querySelector('svg');
    const vb = (svg.getAttribute('viewBox') || '').split(/\s+/).map(Number);
    natural.virtual = vb.length === 4 ? [vb[2], vb[3]] : [parseFloat(svg.getAttribute('width')), parseFloat(svg.getAttribute('height'))];
    svg.removeAttribute('style');
    for (const g of svg.querySelectorAll('g.node')) { const t = g.querySelector('title'); if (t) g.dataset.vkey = t.textContent; }
    const info = k => { const v = V.nodes[k]; if (!v) return;
      let h = '<div class="key" id="vg-info-key">&lt;' + esc(v.key) + '&gt;</div><table>' + row('name', esc(v.name || '—')) + row('kind', esc(v.kind));
      if (v.shape) h += row('declared shape', esc(v.shape)); if (v.share !== undefined) h += row('shared', v.share ? 'yes (tied)' : 'no (one per iteration)');
      if (v.scope) h += row('in loop', esc(v.scope));
      if (v.copies !== undefined) h += row('unrolled copies', v.copies + (v.first.length ? ': ' + v.first.map(link).join(' ') + (v.copies > v.first.length ? ' …' : '') : ''));
      $('vg-info').innerHTML = h + '</table>'; };
    pane.addEventListener('mouseover', e => { const g = e.target.closest('g.node'); if (g) info(g.dataset.vkey); });
    pane.addEventListener('click', e => { const g = e.target.closest('g.node'); if (!g) return;
      for (const s of pane.querySelectorAll('g.node.sel')) s.classList.remove('sel'); g.classList.add('sel'); info(g.dataset.vkey); });
  } else { pane.innerHTML = '<div class="empty">' + esc(V.error || 'No virtual view.') + '</div>'; }
}

// ------------------------------------------------------------------ search
function findKey(text){
  text = text.trim().replace(/^</, '').replace(/>$/, '');
  if (!text) return false;
  if (U) { let i = U.findKey(text);
    if (i < 0) { const low = text.toLowerCase(); i = U.keys.findIndex(k => k.toLowerCase() === low); }
    if (i >= 0) { showView('unrolled'); U.focusNode(i); status('found <' + U.keys[i] + '>'); return true; } }
  if (D.virtual && D.virtual.nodes[text]) { showView('virtual'); const g = $('vg-pane-virtual').querySelector('g.node[data-vkey="' + CSS.escape(text) + '"]');
    if (g) { g.dispatchEvent(new MouseEvent('click', {bubbles: true})); g.scrollIntoView({block: 'center', inline: 'center'}); } status('found <' + text + '> (virtual)'); return true; }
  status('no node <' + text + '>', true); return false;
}
$('vg-search').addEventListener('submit', e => { e.preventDefault(); findKey($('vg-search-input').value); });

// ------------------------------------------------------------------ gradient-through-time chart
const series = U ? U.series.slice() : [], nParams = series.length;
if (U) U.onSelect = i => { // a selected node inside a loop gets its own chart: |grad| of its copies by iteration
  const s = U.nodeSeries(i); if (!s) return;
  const sel = $('vg-series'); sel.style.display = ''; series[nParams] = s;
  let o = sel.querySelector('option[value="' + nParams + '"]'); if (!o) { o = document.createElement('option'); o.value = nParams; sel.appendChild(o); }
  o.textContent = 'node <' + s.key + '@t> |grad| over ' + s.loopLabel; sel.value = nParams; chart(nParams); };
if (!series.length) { $('vg-chart-hint').textContent = D.unrolled ? (D.unrolled.hasGrad ? 'No tied parameter used in a loop kept per-iteration gradients (untied parameters have their own .grad per iteration; for tied ones call vgraph.render.retain_all_grads(cg) before backward).' : 'No gradients: run backward (after vgraph.render.retain_all_grads(cg)) before explore().') : 'Needs an unrolled build.';
  $('vg-series').style.display = 'none'; }
series.forEach((s, k) => { const o = document.createElement('option'); o.value = k; o.textContent = s.param + ' <' + s.key + '> over ' + s.loopLabel; $('vg-series').appendChild(o); });
$('vg-series').onchange = () => chart(+$('vg-series').value);
function niceStep(span, count){ const raw = span / count, p = Math.pow(10, Math.floor(Math.log10(raw))); for (const m of [1, 2, 5, 10]) if (m * p >= raw) return Math.max(1, m * p); return 10 * p; }
function chart(k){
  const s = series[k], el = $('vg-chart'); if (!s) { el.innerHTML = ''; return; }
  const v = s.norms.map(num), n = v.length, W = 320, H = 190, L = 52, R = 10, T = 10, B = 34;
  const pos = v.filter(x => x > 0 && isFinite(x)); const mx = pos.length ? Math.max(...pos) : 1, mn = pos.length ? Math.min(...pos) : 1;
  const log = pos.length >= 2 && mx / mn > 50;
  let y0, y1; if (log) { y1 = Math.ceil(Math.log10(mx)); y0 = Math.floor(Math.log10(mn)); if (y0 === y1) y0 -= 1; } else { y0 = 0; y1 = pos.length ? mx * 1.05 : 1; }
  const X = t => L + (n > 1 ? t / (n - 1) : 0.5) * (W - L - R);
  const Y = x => { const bottom = H - B; if (log) { if (!(x > 0)) return bottom; return T + (1 - (Math.log10(x) - y0) / (y1 - y0)) * (bottom - T); } return T + (1 - x / y1) * (bottom - T); };
  let h = '<svg xmlns="' + NS + '" viewBox="0 0 ' + W + ' ' + H + '" id="vg-chart-svg" data-param="' + esc(s.param) + '" data-log="' + log + '">';
  h += '<rect x="' + L + '" y="' + T + '" width="' + (W - L - R) + '" height="' + (H - B - T) + '" fill="#fff" stroke="#d0d7de"/>';
  const xstep = niceStep(Math.max(1, n - 1), 6);
  for (let t = 0; t < n; t += xstep) h += '<line x1="' + X(t) + '" x2="' + X(t) + '" y1="' + (H - B) + '" y2="' + (H - B + 4) + '" stroke="#8c959f"/><text class="xt" x="' + X(t) + '" y="' + (H - B + 15) + '" font-size="10" text-anchor="middle" fill="#57606a">' + t + '</text>';
  if (log) { const ystep = niceStep(y1 - y0, 5); for (let e = Math.ceil(y0 / ystep) * ystep; e <= y1; e += ystep) h += '<line x1="' + L + '" x2="' + (W - R) + '" y1="' + Y(Math.pow(10, e)) + '" y2="' + Y(Math.pow(10, e)) + '" stroke="#eef1f4"/><text x="' + (L - 4) + '" y="' + (Y(Math.pow(10, e)) + 3) + '" font-size="10" text-anchor="end" fill="#57606a">1e' + e + '</text>'; }
  else { for (let j = 0; j <= 4; j++) { const val = y1 * j / 4; h += '<line x1="' + L + '" x2="' + (W - R) + '" y1="' + Y(val) + '" y2="' + Y(val) + '" stroke="#eef1f4"/><text x="' + (L - 4) + '" y="' + (Y(val) + 3) + '" font-size="10" text-anchor="end" fill="#57606a">' + (val === 0 ? '0' : Math.abs(val) >= 1e-3 && Math.abs(val) < 1e4 ? String(+val.toPrecision(2)) : val.toExponential(1)) + '</text>'; } }
  h += '<text x="' + ((L + W - R) / 2) + '" y="' + (H - 3) + '" font-size="10.5" text-anchor="middle" fill="#57606a">iteration t</text>';
  h += '<text transform="translate(10 ' + ((T + H - B) / 2) + ') rotate(-90)" font-size="10.5" text-anchor="middle" fill="#57606a">' + (s.node ? '|grad|' : '|contribution to grad|') + '</text>';
  let d = ''; v.forEach((x, t) => { if (x === null || !isFinite(x)) { d += ' '; return; } d += (d && !d.endsWith(' ') ? 'L' : 'M') + X(t).toFixed(1) + ',' + Y(x).toFixed(1); });
  h += '<path d="' + d + '" fill="none" stroke="#d73027" stroke-width="1.5"/>';
  if (n <= 80) v.forEach((x, t) => { if (x === null) return; h += '<circle cx="' + X(t) + '" cy="' + Y(x) + '" r="2.6" fill="' + (log && !(x > 0) ? '#fff' : '#d73027') + '" stroke="#d73027"/>'; });
  h += '<line id="vg-chart-guide" y1="' + T + '" y2="' + (H - B) + '" stroke="#0b5cad" stroke-dasharray="3 2" visibility="hidden"/><circle id="vg-chart-dot" r="4" fill="#0b5cad" visibility="hidden"/>';
  h += '<rect id="vg-chart-hit" x="' + L + '" y="' + T + '" width="' + (W - L - R) + '" height="' + (H - B - T) + '" fill="transparent" style="cursor:crosshair"/></svg>';
  h += '<div class="hint" id="vg-chart-read">Hover the chart to highlight an iteration; click to unfold it.</div>';
  el.innerHTML = h;
  const zeros = log ? v.filter(x => x === 0).length : 0;
  const tail = (log ? '; log scale' : '') + (zeros ? '; ' + zeros + ' zeros drawn on the axis (hollow)' : '') + '.';
  $('vg-chart-hint').textContent = s.node ? 'Norm of .grad of the copies of <' + s.key + '> in each iteration t of ' + s.loopLabel + tail
    : 'Row t of vgraph.render.gradient_through_time: the part of ' + s.param + '.grad (|total| ' + fmt(s.total) + ') coming from iteration t' + tail;
  const svg = $('vg-chart-svg'), hit = $('vg-chart-hit');
  const tAt = ev => { const r = svg.getBoundingClientRect(), x = (ev.clientX - r.left) / r.width * W; return Math.max(0, Math.min(n - 1, Math.round(n > 1 ? (x - L) / (W - L - R) * (n - 1) : 0))); };
  hit.addEventListener('mousemove', ev => { const t = tAt(ev); chartAt(s, t, X, Y, v); });
  hit.addEventListener('mouseleave', () => { $('vg-chart-guide').setAttribute('visibility', 'hidden'); $('vg-chart-dot').setAttribute('visibility', 'hidden'); if (U) U.highlightIteration(null); });
  hit.addEventListener('click', ev => { const t = tAt(ev); if (U) { showView('unrolled'); U.revealIteration(s.loop, t); } });
  chartState = {s, X, Y, v};
}
let chartState = null;
function chartAt(s, t, X, Y, v){
  const g = $('vg-chart-guide'), dot = $('vg-chart-dot'); g.setAttribute('x1', X(t)); g.setAttribute('x2', X(t)); g.setAttribute('visibility', 'visible');
  dot.setAttribute('cx', X(t)); dot.setAttribute('cy', Y(v[t])); dot.setAttribute('visibility', 'visible');
  $('vg-chart-read').innerHTML = '<b>t=' + t + '</b> · ' + (s.node ? '|grad|' : '|contribution|') + ' <span id="vg-chart-value">' + fmt(v[t]) + '</span>';
  if (U) U.highlightIteration(s.loop, t);
}
if (series.length) chart(0);

// ------------------------------------------------------------------ start
if (views.length) showView(current);
window.vgraphExplorer = {data: D, findKey, showView, unrolled: U, zoom: () => zoom[current], chartAt: t => chartState && chartAt(chartState.s, t, chartState.X, chartState.Y, chartState.v), ready: true};
document.documentElement.dataset.ready = '1';
})();
"""
