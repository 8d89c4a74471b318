"""The DOT scene model: nodes, nested clusters and edges, written as deterministic DOT text.

A view (virtual or unrolled) fills a :class:`_Scene`; :meth:`_Scene.source` writes it. Also the
helpers every view shares: quoting, HTML-like labels, shape text and the look of each node kind.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

#: One line of an HTML label: ``(style, text)``, or a list of them (segments of one line).
_LabelLine: TypeAlias = "tuple[str, str] | list[tuple[str, str]]"

_FONT = "Helvetica,Arial,sans-serif"


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


def _label(lines: Iterable[_LabelLine]) -> _HTML:
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
    "Reference": {"shape": "box", "style": "rounded,dashed", "fontsize": 9, "color": "#8a8a8a",
                  "fontcolor": "#444444", "height": 0.2, "margin": "0.05,0.02"},
    "Fold": {"shape": "box", "style": "rounded,dashed,filled", "fillcolor": "#fafafa", "color": "#888888",
             "fontcolor": "#333333"},
}  # fmt: skip
_CARRY_EDGE = {"color": "#b03a2e", "fontcolor": "#b03a2e", "penwidth": 1.4}
_KEY_EDGE = {"style": "dashed", "color": "#6c3483", "fontcolor": "#6c3483"}
_LEAF_EDGE = {"color": "#a9b0b8"}
_GREY = {"color": "#c8c8c8", "fontcolor": "#a8a8a8", "fillcolor": "#f7f7f7"}


def _kind_style(kind: str) -> dict[str, Any]:
    return dict(_KIND_STYLE.get(kind, {}))


def _cluster_nodes(cluster: _Cluster) -> list[str]:
    out: list[str] = []
    for item in cluster.items:
        if isinstance(item, _Cluster):
            out.extend(_cluster_nodes(item))
        elif not item.startswith("order:"):
            out.append(item)
    return out
