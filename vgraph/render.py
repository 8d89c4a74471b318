"""Drawing graphs with Graphviz: the virtual model, the unrolled compute graph, gradient flow.

Two steps, kept apart:

* **extraction** — :func:`to_dot` turns a graph into DOT text (pure Python, no Graphviz program
  needed); :func:`to_digraph` wraps the same text in a :class:`graphviz.Digraph`;
* **drawing** — :func:`render` runs Graphviz's ``dot`` program to write SVG, PNG or PDF.

What is drawn depends on what you pass:

* a :class:`~vgraph.virtual.VirtualGraph` gives the **virtual view**: the model as declared, each
  loop a cluster holding its body with loop-carried state drawn as a back edge (update value ->
  carry, labelled with the carry's name), each branch with its options and its key inputs (dashed).
  With ``build=cg`` the parts a particular build did not use are greyed out.
* a :class:`~vgraph.compute.ComputeGraph` (an :class:`~vgraph.virtual.UnrolledGraph` from
  ``g.build``) gives the **unrolled view**: one cluster per loop iteration (nested for nested
  loops), nodes labelled with their ``<type:id@idx>`` key, name and value shape. Long loops are
  folded (first 3 and last 3 iterations and one "… N iterations …" node). ``gradients=True``
  colours nodes by gradient norm after a backward pass.

Output is deterministic: node ids come from node keys and everything is emitted in a fixed order,
so the same graph always gives the same DOT text.

Importing this module also gives ``ComputeGraph`` and ``VirtualGraph`` rich display in Jupyter
(``_repr_mimebundle_`` / ``_repr_svg_``).
"""

from __future__ import annotations

import html
import itertools
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .compute import ComputeGraph, ComputeNode, NodeKey
from .errors import GraphStateError, RenderError, VGraphError
from .ops import as_array, unbroadcast
from .virtual import BranchNode, LoopNode, UnrolledGraph, VirtualGraph, VirtualNode

__all__ = [
    "DEFAULT_FOLD",
    "FORMATS",
    "GUARD_TYPES",
    "dot_available",
    "gradient_color",
    "gradient_norms",
    "gradient_through_time",
    "render",
    "retain_all_grads",
    "to_digraph",
    "to_dot",
    "to_svg",
]

#: Iterations shown at the start and at the end of a folded loop.
DEFAULT_FOLD: tuple[int, int] = (3, 3)
#: Node types that are structural guards (re-checked loop conditions and sequence lengths).
GUARD_TYPES = ("LoopCheck", "LengthCheck")
#: Output formats :func:`render` accepts (``dot``/``gv`` write the DOT text and need no Graphviz).
FORMATS = ("svg", "png", "pdf", "jpg", "jpeg", "gif", "ps", "eps", "json", "dot", "gv")
#: Jupyter display is skipped (text only) for drawings with more nodes than this.
REPR_MAX_NODES = 1500

_FONT = "Helvetica,Arial,sans-serif"

_INSTALL_HINT = (
    "Install Graphviz: Debian/Ubuntu `sudo apt-get install graphviz`, macOS `brew install graphviz`, "
    "conda `conda install -c conda-forge graphviz`, Windows https://graphviz.org/download/ "
    "(the `dot` program must be on PATH)."
)


# ============================================================================ DOT scene model


class _HTML(str):
    """An attribute value emitted as an HTML-like label ``<...>``."""


@dataclass
class _Cluster:
    name: str
    attrs: dict[str, Any]
    items: list[Any] = field(default_factory=list)  # node ids (str) and _Cluster, emitted in order


@dataclass
class _Scene:
    graph_attrs: dict[str, Any]
    node_attrs: dict[str, Any]
    edge_attrs: dict[str, Any]
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    root: _Cluster = field(default_factory=lambda: _Cluster("", {}))
    edges: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    _edge_seen: set[tuple[str, str]] = field(default_factory=set)

    def add_node(self, container: _Cluster, node_id: str, attrs: dict[str, Any]) -> None:
        self.nodes[node_id] = attrs
        container.items.append(node_id)

    def add_edge(self, tail: str, head: str, attrs: dict[str, Any] | None = None) -> None:
        if (tail, head) in self._edge_seen:  # one edge per pair: folded and repeated inputs collapse
            return
        self._edge_seen.add((tail, head))
        self.edges.append((tail, head, attrs or {}))

    def body(self) -> list[str]:
        lines = [f"\tgraph{_attr_list(self.graph_attrs)}\n"]
        if self.node_attrs:
            lines.append(f"\tnode{_attr_list(self.node_attrs)}\n")
        if self.edge_attrs:
            lines.append(f"\tedge{_attr_list(self.edge_attrs)}\n")
        self._emit_items(self.root, lines, 1)
        for tail, head, attrs in self.edges:
            lines.append(f"\t{_quote(tail)} -> {_quote(head)}{_attr_list(attrs)}\n")
        return lines

    def _emit_items(self, cluster: _Cluster, lines: list[str], depth: int) -> None:
        pad = "\t" * depth
        for item in cluster.items:
            if isinstance(item, _Cluster):
                lines.append(f"{pad}subgraph {item.name} {{\n")
                lines.append(f"{pad}\tgraph{_attr_list(item.attrs)}\n")
                self._emit_items(item, lines, depth + 1)
                lines.append(f"{pad}}}\n")
            else:
                lines.append(f"{pad}{_quote(item)}{_attr_list(self.nodes[item])}\n")

    def source(self) -> str:
        return "digraph vgraph {\n" + "".join(self.body()) + "}\n"


def _quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _attr_list(attrs: Mapping[str, Any]) -> str:
    parts = []
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, _HTML):
            parts.append(f"{k}=<{v}>")
        elif isinstance(v, bool):
            parts.append(f"{k}={'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            parts.append(f"{k}={v}")
        else:
            parts.append(f"{k}={_quote(v)}")
    return " [" + " ".join(parts) + "]" if parts else ""


def _cluster_name(*parts: Any) -> str:
    return "cluster_" + "_".join(re.sub(r"[^A-Za-z0-9]", "_", str(p)) for p in parts if p != "")


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _label(lines: Iterable[Any]) -> _HTML:
    """An HTML label. Each line is ``(style, text)`` or a list of them (segments of one line);
    style is ``b`` (bold), ``i`` (italic), ``s`` (small), ``sg`` (small grey) or ``""``."""
    out = []
    for line in lines:
        segments = line if isinstance(line, list) else [line]
        parts = []
        for style, text in segments:
            t = _esc(text)
            if style == "b":
                t = f"<B>{t}</B>"
            elif style == "i":
                t = f"<I>{t}</I>"
            elif style == "s":
                t = f'<FONT POINT-SIZE="9">{t}</FONT>'
            elif style == "sg":
                t = f'<FONT POINT-SIZE="9" COLOR="#555555">{t}</FONT>'
            parts.append(t)
        out.append(" ".join(parts))
    return _HTML("<BR/>".join(out))


def _shape_text(shape: Any) -> str:
    if shape is None:
        return "any shape"
    shape = tuple(shape)
    if shape == ():
        return "scalar"
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def _base_scene(title: str | None, rankdir: str) -> _Scene:
    graph_attrs: dict[str, Any] = {
        "rankdir": rankdir,
        "fontname": _FONT,
        "fontsize": 12,
        "nodesep": 0.2,
        "ranksep": 0.28,
        "newrank": True,
        "compound": True,
    }
    if title:
        graph_attrs.update(label=_label([("b", title)]), labelloc="t", fontsize=14)
    return _Scene(
        graph_attrs,
        {"fontname": _FONT, "fontsize": 11, "shape": "box", "style": "filled", "fillcolor": "white",
         "color": "#444444", "margin": "0.08,0.04", "height": 0.3},
        {"fontname": _FONT, "fontsize": 9, "color": "#555555", "arrowsize": 0.7},
    )  # fmt: skip


# Fill colours by node kind (outside the gradient overlay).
_KIND_STYLE: dict[str, dict[str, Any]] = {
    "Parameter": {"shape": "box", "style": "rounded,filled", "fillcolor": "#ffe4b5"},
    "Input": {"shape": "box", "style": "rounded,filled", "fillcolor": "#d9f0d3"},
    "Constant": {"shape": "box", "style": "rounded,filled", "fillcolor": "#eeeeee", "fontsize": 9, "color": "#999999"},
    "Sample": {"shape": "box", "style": "rounded,filled,dashed", "fillcolor": "#eeeeee", "fontsize": 10},
    "Item": {"shape": "box", "style": "rounded,filled", "fillcolor": "#ecf6e8"},
    "Carry": {"shape": "box", "style": "rounded,filled,bold", "fillcolor": "#fbe3e0", "color": "#b03a2e"},
    "Final": {"shape": "box", "style": "rounded,filled", "fillcolor": "#fbe3e0"},
    "Stack": {"shape": "box", "style": "filled", "fillcolor": "#dfe9f5"},
    "Branch": {"shape": "box", "style": "filled,diagonals,bold", "fillcolor": "#e8dcf5", "color": "#6c3483"},
    "Guard": {"shape": "octagon", "style": "dotted", "fontsize": 8, "color": "#aaaaaa", "fontcolor": "#888888",
              "height": 0.2, "margin": "0.04,0.02"},
    "Fold": {"shape": "box", "style": "rounded,dashed,filled", "fillcolor": "#fafafa", "color": "#888888",
             "fontcolor": "#333333"},
}  # fmt: skip
_CARRY_EDGE = {"color": "#b03a2e", "fontcolor": "#b03a2e", "penwidth": 1.4}
_KEY_EDGE = {"style": "dashed", "color": "#6c3483", "fontcolor": "#6c3483"}
_LEAF_EDGE = {"color": "#a9b0b8"}
_GREY = {"color": "#c8c8c8", "fontcolor": "#a8a8a8", "fillcolor": "#f7f7f7"}


def _kind_style(kind: str) -> dict[str, Any]:
    return dict(_KIND_STYLE.get(kind, {}))


# ============================================================================ public entry points


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


def dot_available() -> bool:
    """Whether Graphviz's ``dot`` program is on ``PATH``."""
    return shutil.which("dot") is not None


def _dot_program() -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise RenderError("Graphviz's `dot` program was not found on PATH. " + _INSTALL_HINT)
    return exe


def _run_dot(dot_text: str, fmt: str, out: Path | None = None) -> bytes:
    exe = _dot_program()
    args = [exe, f"-T{fmt}"]
    if out is not None:
        args += ["-o", str(out)]
    try:
        proc = subprocess.run(
            args, check=False, input=dot_text.encode("utf-8"), capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        raise RenderError(
            f"`dot -T{fmt}` did not finish within 300 s; draw fewer iterations (fold=)"
        ) from None
    if proc.returncode != 0:
        raise RenderError(
            f"`dot -T{fmt}` failed (exit code {proc.returncode}): {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout


def render(
    graph: VirtualGraph | ComputeGraph, path: str | os.PathLike, format: str | None = None, **options: Any
) -> Path:
    """Draw ``graph`` into the file ``path`` with Graphviz's ``dot`` program.

    Args:
        graph: what to draw (see :func:`to_dot`).
        path: the output file.
        format: ``svg``, ``png``, ``pdf`` … (default: from ``path``'s suffix). ``dot`` (or a
            ``.dot``/``.gv`` file) writes the DOT text and needs no Graphviz.
        **options: the options of :func:`to_dot` (``fold``, ``gradients`` …).

    Returns:
        The path written.

    Raises:
        RenderError: ``dot`` is not installed (the DOT text is then written next to ``path``, as
            ``path`` with suffix ``.dot``, so it can be rendered elsewhere), ``dot`` failed, or the
            format is unknown.
    """
    path = Path(path)
    fmt = (format or path.suffix.lstrip(".")).lower()
    if not fmt:
        raise RenderError(
            f"cannot tell the output format of {str(path)!r}: give it a suffix (.svg, .png, .pdf) or format="
        )
    if fmt not in FORMATS:
        raise RenderError(f"unknown output format {fmt!r}; use one of {', '.join(FORMATS)}")
    text = to_dot(graph, **options)
    if fmt in ("dot", "gv"):
        path.write_text(text, encoding="utf-8")
        return path
    if shutil.which("dot") is None:
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(text, encoding="utf-8")
        raise RenderError(
            f"cannot draw {str(path)!r}: Graphviz's `dot` program was not found on PATH. {_INSTALL_HINT} "
            f"The DOT text was written to {str(dot_path)!r}; draw it later with "
            f"`dot -T{fmt} {dot_path.name} -o {path.name}`."
        )
    _run_dot(text, fmt, path)
    return path


def to_svg(graph: VirtualGraph | ComputeGraph, **options: Any) -> str:
    """The drawing as SVG text (runs ``dot``; raises :class:`RenderError` if it is missing)."""
    return _run_dot(to_dot(graph, **options), "svg").decode("utf-8")


# ============================================================================ scene dispatch


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


# ============================================================================ virtual view


class _VirtualView:
    def __init__(self, g: VirtualGraph, build: UnrolledGraph | None, guards: bool, constants: bool,
                 shapes: bool, rankdir: str, title: str | None) -> None:  # fmt: skip
        if title is None:
            title = f"{g.name or 'model'} — virtual graph" + (
                " (greyed: not used by this build)" if build else ""
            )
        self.scene = scene = _base_scene(title, rankdir)
        self.g = g
        self.build = build
        self.shapes = shapes
        self.built: set[VirtualNode] | None = None
        self.trips: dict[LoopNode, list[int]] = {}
        self.choices: dict[BranchNode, dict[int, int]] = {}
        if build is not None:
            self.built = set()
            for (scope, _idx), env in build._envs.items():
                self.built.update(env)
                if scope is not None:
                    self.built.add(scope)
            for d in build.decisions:
                if d.kind == "iterations":
                    self.trips.setdefault(d.node, []).append(d.value)
                else:
                    counts = self.choices.setdefault(d.node, {})
                    counts[d.value] = counts.get(d.value, 0) + 1
        hidden = set() if constants else {v for v in g.nodes if v.kind == "constant"}
        self.hidden = hidden
        # Clusters for loops, nested by scope.
        clusters: dict[LoopNode | None, _Cluster] = {None: scene.root}
        for v in g.nodes:
            if v.kind == "loop":
                c = _Cluster(_cluster_name("loop", v.id), self._loop_attrs(v))
                clusters[v] = c
                clusters[v.scope].items.append(c)
        for v in g.nodes:
            if v.kind == "loop" or v in hidden:
                continue
            scene.add_node(clusters[v.scope], self.nid(v), self._node_attrs(v))
        # Clusters go after the nodes of their parent (stable, readable order).
        for c in clusters.values():
            c.items.sort(key=lambda item: isinstance(item, _Cluster))
        for v in g.nodes:
            self._edges(v)

    @staticmethod
    def nid(v: VirtualNode) -> str:
        return f"{v.type}:{v.id}"

    def _unused(self, v: VirtualNode) -> bool:
        return self.built is not None and v not in self.built

    def _loop_attrs(self, loop: LoopNode) -> dict[str, Any]:
        rule = []
        if loop.times is not None:
            rule.append(f"times={loop.times}")
        if loop.sequences:
            rule.append("steps through " + ", ".join(s.name or self.nid(s) for s in loop.sequences))
        if loop.cond is not None:
            rule.append(f"while {getattr(loop.cond, '__name__', 'cond')}")
        lines = [
            ("b", f"<{self.nid(loop)}>" + (f" {loop.name}" if loop.name else "")),
            ("s", "; ".join(rule)),
        ]
        if loop.carries:
            lines.append(("s", "carries " + ", ".join(c.name for c in loop.carries)))
        attrs: dict[str, Any] = {"style": "rounded,filled", "fillcolor": "#f3f6fb", "color": "#6b7fa3"}
        if self.build is not None:
            trips = self.trips.get(loop)
            if trips:
                ran = (
                    str(trips[0]) if len(trips) == 1 else f"{min(trips)}–{max(trips)} (in {len(trips)} runs)"
                )
                lines.append(("s", f"this build: {ran} iterations"))
            else:
                lines.append(("s", "not run by this build"))
                attrs.update(color="#c8c8c8", fontcolor="#a8a8a8", fillcolor="#fafafa")
        attrs.update(label=_label(lines), labeljust="l")
        return attrs

    def _node_attrs(self, v: VirtualNode) -> dict[str, Any]:
        head = ("b", f"<{self.nid(v)}>")
        lines: list[tuple[str, str]] = [head]
        kind = v.kind
        style_kind = v.type
        if kind == "input":
            lines.append(("", v.name))
            if self.shapes:
                lines.append(("s", _shape_text(v.attrs.get("shape"))))
        elif kind == "parameter":
            lines.append(("", v.name))
            info = _shape_text(v.attrs["shape"]) if self.shapes else ""
            if v.scope is not None:
                info = (info + " " if info else "") + (
                    "shared" if v.attrs["share"] else "untied (one per iteration)"
                )
            if info:
                lines.append(("s", info))
        elif kind == "constant":
            value = v.attrs["value"]
            if v.name:
                lines.append(("", v.name))
            if np.size(value) == 1:
                lines.append(("s", f"{np.asarray(value).reshape(()).item():g}"))
            elif self.shapes:
                lines.append(("s", _shape_text(np.shape(value))))
        elif kind == "carry":
            lines.append(("", f"carry {v.name}"))
        elif kind == "item":
            seq = v.inputs[0]
            lines.append(("", v.name or f"{seq.name or self.nid(seq)}[t]"))
        elif kind == "final":
            lines.append(("", f"final {v.name}" if v.name else "final"))
        elif kind == "stacked":
            lines.append(("", v.name or "stacked over iterations"))
        elif kind == "branch":
            if v.name:
                lines.append(("", v.name))
            sel = getattr(v.selector, "__name__", "selector")
            lines.append(("s", f"selector {sel}, {len(v.options)} options"))
            counts = self.choices.get(v)
            if counts:
                lines.append(
                    ("s", "took " + ", ".join(f"option {k} ×{n}" for k, n in sorted(counts.items())))
                )
        else:
            if v.name:
                lines.append(("", v.name))
        updates = [
            c.name for c in (v.scope.carries if v.scope is not None else ()) if v.scope.updates.get(c) is v
        ]
        if updates:
            lines.append(("i", "→ next " + ", ".join(updates)))
        attrs = _kind_style(style_kind)
        if self._unused(v):
            attrs.update(_GREY)
            attrs["style"] = attrs.get("style", "filled") + ",dashed"
            lines.append(("s", "not built"))
        attrs["label"] = _label(lines)
        return attrs

    def _edge(self, tail: VirtualNode, head: VirtualNode, **attrs: Any) -> None:
        if tail in self.hidden or head in self.hidden or tail.kind == "loop":
            return
        if self._unused(tail) or self._unused(head):
            attrs.update(color="#cccccc", fontcolor="#aaaaaa")
        self.scene.add_edge(self.nid(tail), self.nid(head), attrs)

    def _edges(self, v: VirtualNode) -> None:
        kind = v.kind
        if kind == "loop":
            for c in v.carries:
                upd = v.updates.get(c)
                if upd is not None:  # loop-carried state: a back edge, update value -> carry
                    self._edge(upd, c, label=c.name, constraint=False, style="bold", **_CARRY_EDGE)
        elif kind == "carry":
            self._edge(v.inputs[0], v, label="init")
        elif kind == "item":
            self._edge(v.inputs[0], v, label="step")
        elif kind == "final":
            self._edge(v.inputs[1], v, label="after loop", **_CARRY_EDGE)
        elif kind == "stacked":
            self._edge(v.inputs[1], v, label="stack")
        elif kind == "sample":
            self._edge(v.inputs[0], v, style="dotted", label="like")
        elif kind == "branch":
            counts = self.choices.get(v)
            for k, opt in enumerate(v.options):
                attrs: dict[str, Any] = {"label": f"option {k}"}
                if self.build is not None and not (counts and k in counts):
                    attrs.update(style="dashed", color="#cccccc", fontcolor="#aaaaaa")
                self._edge(opt, v, **attrs)
            for key in v.keys:
                self._edge(key, v, label="key", **_KEY_EDGE)
        else:
            for x in v.inputs:
                self._edge(x, v)


# ============================================================================ unrolled view


@dataclass(eq=False)
class _Frame:
    """One iteration of one loop run: ``loop`` is a LoopNode (or an int for a plain ComputeGraph)."""

    loop: Any
    idx: tuple[int, ...]
    parent: _Frame | None
    run: _Run | None = None
    cluster: _Cluster | None = None
    hidden_as: str | None = None  # the fold node standing for it, if hidden


@dataclass(eq=False)
class _Run:
    """All iterations of one loop in one iteration path of the enclosing loops."""

    loop: Any
    outer: tuple[int, ...]
    parent: _Frame | None
    trips: int
    frames: dict[int, _Frame] = field(default_factory=dict)
    cluster: _Cluster | None = None


class _Frames:
    """Which loop iteration every compute node of ``cg`` belongs to.

    For an UnrolledGraph this comes from the build's environments and decisions (so two loops
    one after the other are told apart); for a plain ComputeGraph, from the keys' ``idx``.
    """

    def __init__(self, cg: ComputeGraph) -> None:
        self.cg = cg
        self.virtual = cg.virtual if isinstance(cg, UnrolledGraph) else None
        self.nodes = cg.nodes()
        self.frames: dict[tuple[Any, tuple[int, ...]], _Frame] = {}
        self.runs: dict[tuple[Any, tuple[int, ...]], _Run] = {}
        self.owner: dict[ComputeNode, _Frame | None] = {}
        self.edge_names: dict[tuple[ComputeNode, _Frame | None], str] = {}
        self.next_names: dict[ComputeNode, list[str]] = {}
        self.choice: dict[NodeKey, int] = {}
        if self.virtual is not None:
            self._frames_from_virtual(cg)
        else:
            self._frames_from_keys(self.nodes)

    # -- frames
    def _frames_from_virtual(self, cg: UnrolledGraph) -> None:
        top_loops = []
        for d in cg.decisions:
            if d.kind == "iterations":
                top_loops.append(d)
            else:
                self.choice[NodeKey("Branch", d.node.id, d.idx)] = d.value
        # Runs in a stable order: by depth, then loop id, then path.
        for d in sorted(top_loops, key=lambda d: (len(d.idx), d.node.id, d.idx)):
            loop = d.node
            parent = self.frames.get((loop.scope, d.idx)) if loop.scope is not None else None
            run = _Run(loop, d.idx, parent, d.value)
            self.runs[(loop, d.idx)] = run
            for t in range(d.value):
                f = _Frame(loop, (*d.idx, t), parent, run)
                run.frames[t] = f
                self.frames[(loop, f.idx)] = f
        for (scope, idx), env in cg._envs.items():
            frame = self.frames.get((scope, idx)) if scope is not None else None
            if scope is not None and frame is None:
                continue
            for v, n in env.items():
                if n is None:
                    continue
                if scope is not None and v.scope is scope and v.kind != "carry" and n.key.idx == idx:
                    self.owner[n] = frame
                if v.kind == "final":
                    self.edge_names.setdefault((n, frame), f"{v.name} (final)" if v.name else "final")
            if scope is not None:
                for c in scope.carries:
                    src = env.get(c)
                    if src is not None:
                        self.edge_names[(src, frame)] = c.name
                    upd = env.get(scope.updates[c])
                    if upd is not None and self.owner.get(upd) is frame:
                        self.next_names.setdefault(upd, []).append(c.name)
        loops_by_id = {f.loop.id: f.loop for f in self.frames.values()}
        loops_by_id.update({r.loop.id: r.loop for r in self.runs.values()})
        by_idx: dict[tuple[int, ...], _Frame] | None = None
        for n in self.nodes:
            if n in self.owner:
                continue
            k = n.key
            if k.type == "LoopCheck" and k.id in loops_by_id:
                loop = loops_by_id[k.id]
                f = self.frames.get((loop, k.idx))
                self.owner[n] = f if f is not None else self._frame_of(loop.scope, k.idx[:-1])
            elif k.type == "LengthCheck" and k.id in loops_by_id:
                self.owner[n] = self._frame_of(loops_by_id[k.id].scope, k.idx)
            elif k.idx:
                if by_idx is None:
                    by_idx = {}
                    for f in sorted(self.frames.values(), key=lambda f: -f.loop.id):
                        by_idx[f.idx] = f  # the frame of the first-declared loop wins
                self.owner[n] = by_idx.get(k.idx)
            else:
                self.owner[n] = None

    def _frame_of(self, scope: LoopNode | None, idx: tuple[int, ...]) -> _Frame | None:
        return None if scope is None else self.frames.get((scope, idx))

    def _frames_from_keys(self, nodes: list[ComputeNode]) -> None:
        """A plain ComputeGraph: one frame per distinct idx prefix; depth stands for the loop."""
        paths = sorted(
            {n.key.idx[:d] for n in nodes for d in range(1, len(n.key.idx) + 1)}, key=lambda p: (len(p), p)
        )
        for p in paths:
            depth = len(p)
            parent = self.frames.get((depth - 1, p[:-1])) if depth > 1 else None
            run = self.runs.get((depth, p[:-1]))
            if run is None:
                run = self.runs[(depth, p[:-1])] = _Run(depth, p[:-1], parent, 0)
            f = _Frame(depth, p, parent, run)
            run.frames[p[-1]] = f
            run.trips = max(run.trips, p[-1] + 1)
            self.frames[(depth, p)] = f
        for n in nodes:
            idx = n.key.idx
            self.owner[n] = self.frames[(len(idx), idx)] if idx else None

    def _loop_order(self, loop: Any) -> int:
        return loop.id if isinstance(loop, LoopNode) else loop


class _UnrolledView(_Frames):
    def __init__(self, cg: ComputeGraph, fold: tuple[int, int] | None, iterations: range | frozenset[int] | None,
                 gradients: bool, guards: bool, constants: bool, shapes: bool, rankdir: str,
                 title: str | None) -> None:  # fmt: skip
        super().__init__(cg)
        nodes = self.nodes
        self.show_guards = guards
        self.shapes = shapes
        self.gradients = gradients
        if title is None:
            name = self.virtual.name if self.virtual is not None and self.virtual.name else "compute graph"
            title = f"{name} — unrolled, {len(nodes)} nodes"
        self.scene = scene = _base_scene(title, rankdir)
        self._fold(fold, iterations)

        # Gradient colouring: scale over every node with a gradient (hidden ones too, so the
        # colours do not depend on folding).
        self.norms = {
            n: float(np.linalg.norm(np.asarray(n.grad, dtype=np.float64)))
            for n in nodes
            if n.grad is not None
        }
        positive = [v for v in self.norms.values() if v > 0 and math.isfinite(v)]
        if positive:
            lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
            self.scale = (lo, hi if hi > lo else lo + 1)
        else:
            self.scale = (-1, 0)

        # Nodes.
        self.drawn: dict[ComputeNode, str | None] = {}
        for n in nodes:
            self.drawn[n] = self._drawn_id(n, constants)
        if gradients:  # a fold node tells the range of gradient norms it hides
            hidden: dict[str, list[float]] = {}
            for n, nid in self.drawn.items():
                if nid is not None and nid.startswith("fold:") and n in self.norms:
                    hidden.setdefault(nid, []).append(self.norms[n])
            for nid, values in hidden.items():
                attrs = scene.nodes[nid]
                extra = _label([("s", f"|grad| {min(values):.1e} … {max(values):.1e}")])
                attrs["label"] = _HTML(f"{attrs['label']}<BR/>{extra}")
        for n in nodes:
            nid = self.drawn[n]
            if nid != str(n.key):
                continue
            frame = self.owner.get(n)
            container = frame.cluster if frame is not None else scene.root
            scene.add_node(container, nid, self._node_attrs(n))
        for c in self._all_clusters():
            c.items.sort(key=lambda item: isinstance(item, _Cluster) and item.name.startswith("cluster_loop"))
        # Edges.
        for n in nodes:
            head = self.drawn[n]
            if head is None:
                continue
            frame = self.owner.get(n)
            is_branch = self.virtual is not None and n.key in self.choice and n.op is not None
            for i, p in enumerate(n.parents):
                tail = self.drawn.get(p)
                if tail is None or tail == head:
                    continue
                attrs: dict[str, Any] = {}
                if is_branch:
                    if i == 0:
                        attrs["label"] = f"option {self.choice[n.key]}"
                    else:
                        attrs.update(label="key", **_KEY_EDGE)
                elif n.key.type in GUARD_TYPES:
                    attrs.update(style="dotted", color="#bbbbbb", arrowsize=0.5)
                name = self.edge_names.get((p, frame))
                if name is not None and "label" not in attrs and n.key.type not in GUARD_TYPES:
                    attrs.update(label=name, **_CARRY_EDGE)
                elif p.op is None and not p.key.idx and frame is not None and not attrs:
                    attrs.update(_LEAF_EDGE)  # a leaf used in every iteration: keep it in the background
                if tail.startswith("fold:") or head.startswith("fold:"):
                    attrs["style"] = "dashed"
                scene.add_edge(tail, head, attrs)
        self._order_iterations()
        if gradients:
            self._legend()

    def _fold(self, fold: tuple[int, int] | None, iterations: frozenset[int] | None) -> None:
        """Create the clusters of visible iterations and the fold nodes of hidden ones."""
        scene = self.scene
        runs = sorted(self.runs.values(), key=lambda r: (len(r.outer), self._loop_order(r.loop), r.outer))
        for run in runs:
            parent = run.parent
            if parent is not None and (parent.hidden_as is not None or parent.cluster is None):
                for f in run.frames.values():
                    f.hidden_as = parent.hidden_as
                continue
            container = parent.cluster if parent is not None else scene.root
            ts = sorted(run.frames)
            if iterations is not None:
                visible = {t for t in ts if t in iterations}
            elif fold is not None and len(ts) > fold[0] + fold[1] + 1:
                visible = set(ts[: fold[0]]) | set(ts[len(ts) - fold[1] :])
            else:
                visible = set(ts)
            loop = run.loop
            lkey = f"{loop.type}:{loop.id}" if isinstance(loop, LoopNode) else f"depth{loop}"
            if isinstance(loop, LoopNode):
                head = f"<{lkey}>" + (f" {loop.name}" if loop.name else "")
                if run.outer:
                    head += f" @{'.'.join(map(str, run.outer))}"
            else:
                head = "idx " + ".".join([*map(str, run.outer), "*"])
            shown = f"{len(visible)} shown" if len(visible) < len(ts) else ""
            sub = f"{run.trips} iteration{'s' if run.trips != 1 else ''}" + (f", {shown}" if shown else "")
            run.cluster = _Cluster(
                _cluster_name("loop", lkey, *run.outer),
                {"label": _label([("b", head), ("s", sub)]), "labeljust": "l", "style": "rounded",
                 "color": "#6b7fa3", "fontcolor": "#2c3e50", "penwidth": 1.2},
            )  # fmt: skip
            container.items.append(run.cluster)
            if not ts:
                nid = f"fold:{lkey}" + (f"@{'.'.join(map(str, run.outer))}" if run.outer else "") + ":none"
                scene.add_node(
                    run.cluster, nid, {**_kind_style("Fold"), "label": _label([("i", "no iterations")])}
                )
            hidden_group: list[int] = []
            for i, t in enumerate(ts):
                f = run.frames[t]
                if t not in visible:
                    hidden_group.append(t)
                    if i + 1 < len(ts) and ts[i + 1] not in visible:
                        continue
                    a, b = hidden_group[0], hidden_group[-1]
                    nid = f"fold:{lkey}@{'.'.join(map(str, (*run.outer, a)))}-{b}"
                    n_hidden = len(hidden_group)
                    label = _label([("b", f"… {n_hidden} iteration{'s' if n_hidden != 1 else ''} …"),
                                    ("sg", f"t={a} … {b} folded" if a != b else f"t={a} folded")])  # fmt: skip
                    scene.add_node(run.cluster, nid, {**_kind_style("Fold"), "label": label})
                    for h in hidden_group:
                        run.frames[h].hidden_as = nid
                    hidden_group = []
                    continue
                tlabel = "t=" + ".".join(map(str, f.idx))
                f.cluster = _Cluster(
                    _cluster_name("iter", lkey, *f.idx),
                    {"label": _label([("b", tlabel)]), "labeljust": "l", "fontsize": 13, "style": "rounded,filled",
                     "fillcolor": "#f4f6f9" if len(f.idx) % 2 else "#e9edf3", "color": "#9aa7b8"},
                )  # fmt: skip
                run.cluster.items.append(f.cluster)

    def _order_iterations(self) -> None:
        """Keep the iterations of each loop run in order: every node drawn for iteration t+1
        is ranked below every node of iteration t (through an invisible point between them),
        so Graphviz stacks them t=0, t=1, … along the layout direction."""
        children: dict[str, list[str]] = {}
        for tail, head, _attrs in self.scene.edges:
            children.setdefault(tail, []).append(head)
        parents: dict[str, list[str]] = {}
        for tail, head, _attrs in self.scene.edges:
            parents.setdefault(head, []).append(tail)
        for run in sorted(
            self.runs.values(), key=lambda r: (len(r.outer), self._loop_order(r.loop), r.outer)
        ):
            if run.cluster is None:
                continue
            groups = []
            for item in run.cluster.items:
                members = _cluster_nodes(item) if isinstance(item, _Cluster) else [item]
                if members:
                    groups.append(members)
            for k, (before, after) in enumerate(itertools.pairwise(groups)):
                inside_before, inside_after = set(before), set(after)
                sinks = [n for n in before if not any(c in inside_before for c in children.get(n, ()))]
                sources = [n for n in after if not any(p in inside_after for p in parents.get(n, ()))]
                hub = f"order:{run.cluster.name[len('cluster_') :]}:{k}"
                self.scene.add_node(run.cluster, hub, {"shape": "point", "style": "invis", "width": 0, "height": 0,
                                                        "label": ""})  # fmt: skip
                for n in sinks:
                    self.scene.add_edge(n, hub, {"style": "invis"})
                for n in sources:
                    self.scene.add_edge(hub, n, {"style": "invis", "minlen": 0})

    def _all_clusters(self) -> list[_Cluster]:
        out = [self.scene.root]
        out.extend(r.cluster for r in self.runs.values() if r.cluster is not None)
        out.extend(f.cluster for f in self.frames.values() if f.cluster is not None)
        return out

    def _drawn_id(self, n: ComputeNode, constants: bool) -> str | None:
        if n.key.type in GUARD_TYPES and not self.show_guards:
            return None
        if n.key.type == "Constant" and n.op is None and not constants:
            return None
        f = self.owner.get(n)
        if f is not None:
            if f.hidden_as is not None:
                return f.hidden_as
            if f.cluster is None:  # an iteration not drawn at all (should not happen)
                return None
        return str(n.key)

    # -- node look
    def _node_attrs(self, n: ComputeNode) -> dict[str, Any]:
        k = n.key
        lines: list[tuple[str, str]] = [("b", f"<{k}>")]
        if k.type in GUARD_TYPES:
            attrs = _kind_style("Guard")
            attrs["label"] = _label([("", str(k))])
            return attrs
        first: list[tuple[str, str]] = []
        if n.name:
            first.append(("", n.name))
        elif k.type == "Item" and k.idx and n.parents:
            src = n.parents[0]
            first.append(("", f"{src.name or src.key}[{k.idx[-1]}]"))
        nexts = self.next_names.get(n)
        if nexts:
            first.append(("i", "→ next " + ", ".join(nexts)))
        if first:
            lines.append(first)
        if k in self.choice and n.op is not None:
            lines.append(("", f"option {self.choice[k]}"))
        small: list[tuple[str, str]] = []
        if n.op is not None and n.op.name not in (k.type, "GetItem"):
            small.append(("sg", n.op.name))
        if k.type == "Parameter" and k.idx:
            small.append(("sg", "untied"))
        if k.type == "Constant" and n.op is None and np.size(n.value) == 1:
            small.append(("s", f"{np.asarray(n.value).reshape(()).item():g}"))
        elif self.shapes:
            small.append(("s", _shape_text(n.shape)))
        kind = k.type if k.type in _KIND_STYLE else "op"
        attrs = _kind_style(kind)
        if self.gradients:
            norm = self.norms.get(n)
            if norm is None:
                attrs.update(fillcolor="white", color="#bbbbbb")
            else:
                small.append(("s", f"|grad| {norm:.2e}"))
                _, color = gradient_color(norm, self.scale)
                attrs["fillcolor"] = color
                if norm > 0 and _luminance(color) < 0.45:
                    attrs["fontcolor"] = "white"
                attrs["tooltip"] = f"{k}: |grad| = {norm:.6g}"
            if "filled" not in attrs.get("style", "filled"):
                attrs["style"] = attrs["style"] + ",filled"
        if small:
            lines.append(small)
        attrs["label"] = _label(lines)
        return attrs

    def _legend(self) -> None:
        lo, hi = self.scale
        span = hi - lo
        step = 1 if span <= 10 else math.ceil(span / 10)
        cells = []
        for e in range(lo, hi + 1, step):
            _, color = gradient_color(10.0**e, self.scale)
            font = ' COLOR="white"' if _luminance(color) < 0.45 else ""
            cells.append(
                f'<TD BGCOLOR="{color}" WIDTH="56" HEIGHT="24"><FONT POINT-SIZE="12"{font}>1e{e}</FONT></TD>'
            )
        extra = (
            '<TD BGCOLOR="#ffffff" WIDTH="30"><FONT POINT-SIZE="12">0</FONT></TD>'
            '<TD BGCOLOR="#ffffff" COLOR="#bbbbbb"><FONT POINT-SIZE="11" COLOR="#777777">no .grad</FONT></TD>'
        )
        ncols = len(cells) + 2
        rows = [
            (
                f'<TR><TD COLSPAN="{ncols}" BORDER="0"><B><FONT POINT-SIZE="13">gradient norm |grad| '
                "(log10 scale)</FONT></B></TD></TR>"
            ),
            "<TR>" + "".join(cells) + extra + "</TR>",
            (
                f'<TR><TD COLSPAN="{ncols}" BORDER="0"><FONT POINT-SIZE="10" COLOR="#555555">|grad| = '
                "np.linalg.norm(node.grad); small: pale blue, large: red</FONT></TD></TR>"
            ),
        ]
        op_nodes = [n for n in self.nodes if n.op is not None and n.requires_grad]
        if op_nodes and not any(n in self.norms for n in op_nodes):
            rows.append(
                f'<TR><TD COLSPAN="{ncols}" BORDER="0"><FONT POINT-SIZE="11" COLOR="#b03a2e">no intermediate node kept its '
                "gradient: call vgraph.render.retain_all_grads(cg) before backward</FONT></TD></TR>"
            )
        table = _HTML(
            '<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="4">' + "".join(rows) + "</TABLE>"
        )
        legend = _Cluster("cluster_legend", {"label": "", "style": "rounded", "color": "#999999"})
        self.scene.root.items.append(legend)
        self.scene.add_node(
            legend, "legend", {"shape": "plaintext", "style": "", "label": table, "margin": 0}
        )


def _cluster_nodes(cluster: _Cluster) -> list[str]:
    out: list[str] = []
    for item in cluster.items:
        if isinstance(item, _Cluster):
            out.extend(_cluster_nodes(item))
        elif not item.startswith("order:"):
            out.append(item)
    return out


# ============================================================================ gradient overlay

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


def gradient_color(norm: float, scale: tuple[int, int]) -> tuple[float, str]:
    """Where ``norm`` falls on the log10 colour scale ``scale = (lo, hi)`` (powers of ten) and
    its colour: ``(position in [0, 1], "#rrggbb")``. Zero norms get position 0 and white.

    The position is ``(log10(norm) - lo) / (hi - lo)``, clipped; colours run from pale blue (0)
    through yellow to red (1).
    """
    lo, hi = scale
    if not norm > 0:
        return 0.0, "#ffffff"
    if not math.isfinite(norm):
        return 1.0, _cmap(1.0)
    pos = (math.log10(norm) - lo) / (hi - lo)
    pos = min(1.0, max(0.0, pos))
    return pos, _cmap(pos)


def retain_all_grads(cg: ComputeGraph) -> int:
    """Call ``retain_grad()`` on every op node that requires a gradient, before ``backward``.

    Then, after ``backward``, every intermediate node keeps its gradient in ``.grad`` — what the
    gradient overlay (``gradients=True``) and :func:`gradient_through_time` read.

    Returns:
        The number of nodes marked.
    """
    count = 0
    for n in cg.nodes():
        if n.op is not None and n.requires_grad:
            n.retain_grad()
            count += 1
    return count


def gradient_norms(cg: ComputeGraph) -> dict[NodeKey, float]:
    """``np.linalg.norm(node.grad)`` for every node of ``cg`` that has a ``.grad``, by key, in
    creation order — the numbers the gradient overlay shows and colours by."""
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
    plot: str | os.PathLike | None = None,
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
    """
    P = _resolve_param(cg, param)
    uses = [n for n in cg.nodes() if n.op is not None and any(p is P for p in n.parents)]
    view: _Frames | None = None
    if isinstance(cg, UnrolledGraph):
        view = _Frames(cg)
        if isinstance(loop, str):
            named = [v for v in cg.virtual.nodes if v.kind == "loop" and v.name == loop]
            if len(named) != 1:
                raise VGraphError(f"no single loop named {loop!r} in this graph")
            loop = named[0]
        if loop is None:
            tops = set()
            for n in uses:
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
        T = max((n.key.idx[0] + 1 for n in uses if n.key.idx), default=0)
    out = np.zeros((T, *np.shape(P.value)), dtype=np.result_type(P.value, np.float64))
    for n in uses:
        if view is not None:
            f = view.owner.get(n)
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
        for i, p in enumerate(n.parents):
            vjp = n.vjps[i] if i < len(n.vjps) else None
            if p is not P or vjp is None:
                continue
            pg = as_array(vjp(g, n.value, *values, **n.attrs))
            if pg.shape != np.shape(P.value):
                pg = unbroadcast(pg, np.shape(P.value))
            out[t] += pg
    if plot is not None:
        _plot_through_time(out, P, Path(plot))
    return out


def _plot_through_time(contrib: np.ndarray, P: ComputeNode, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise RenderError("plot= needs matplotlib: pip install matplotlib") from None
    norms = np.linalg.norm(contrib.reshape(len(contrib), -1), axis=1)
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    steps = np.arange(len(norms))
    positive = norms > 0
    if positive.sum() >= 2 and norms[positive].max() / norms[positive].min() > 50:
        ax.plot(
            steps[positive], norms[positive], marker="o", color="#d73027"
        )  # zeros cannot show on a log axis
        ax.set_yscale("log")
    else:
        ax.plot(steps, norms, marker="o", color="#d73027")
    ax.set_xlabel("iteration t")
    ax.set_ylabel("|contribution to grad|")
    ax.set_title(f"gradient of {P.name or P.key} by iteration (BPTT)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ============================================================================ Jupyter display


def _repr_svg_(self: Any) -> str | None:
    """SVG for Jupyter; ``None`` (plain text shown) if ``dot`` is missing or the drawing is huge."""
    try:
        scene = _scene(self)
        if len(scene.nodes) > REPR_MAX_NODES or not dot_available():
            return None
        return _run_dot(scene.source(), "svg").decode("utf-8")
    except (VGraphError, ValueError, OSError):  # display must never raise: fall back to the text repr
        return None


def _repr_mimebundle_(self: Any, include: Any = None, exclude: Any = None) -> dict[str, str]:
    """Jupyter's rich display: the drawing as SVG (default options) plus the plain repr."""
    bundle = {"text/plain": repr(self)}
    svg = _repr_svg_(self)
    if svg is not None:
        bundle["image/svg+xml"] = svg
    return bundle


for _cls in (ComputeGraph, VirtualGraph):
    _cls._repr_svg_ = _repr_svg_  # type: ignore[attr-defined]
    _cls._repr_mimebundle_ = _repr_mimebundle_  # type: ignore[attr-defined]
del _cls
