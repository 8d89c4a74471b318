"""Drawing autobatching: the batched graph with one node per group (:class:`_BatchView`), and the
marks that say, on one input's unrolled graph, which group computed each node
(:func:`_mark_groups`). See docs/rendering.md, "Batched builds"."""

from __future__ import annotations

import math
from typing import Any

from ..compute import ComputeNode
from .scene import (
    _HTML,
    _KIND_STYLE,
    _LEAF_EDGE,
    _base_scene,
    _Cluster,
    _kind_style,
    _label,
    _Scene,
    _shape_text,
)

_ALONE = "#ffffff"  # a copy computed for one input alone
_LOW, _HIGH = (0xDB, 0xE9, 0xF6), (0x2B, 0x6C, 0xB0)  # group colours, few to many copies
_PLUMBING = {"shape": "box", "style": "rounded,filled", "fillcolor": "#f2f2f2", "color": "#aaaaaa",
             "fontsize": 9, "fontcolor": "#555555", "height": 0.2, "margin": "0.05,0.02"}  # fmt: skip


def group_color(copies: int, most: int) -> str:
    """The fill colour of a group of ``copies`` copies when the largest has ``most``: white for
    one, then light to dark blue on a log scale."""
    if copies <= 1:
        return _ALONE
    f = math.log(copies) / math.log(most) if most > 1 else 1.0
    r, g, b = (round(lo + (hi - lo) * f) for lo, hi in zip(_LOW, _HIGH))
    return f"#{r:02x}{g:02x}{b:02x}"


def _dark(color: str) -> bool:
    r, g, b = (int(color[k : k + 2], 16) / 255 for k in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.45


def _group_text(copies: int, inputs: int) -> str:
    if copies == 1:
        return "alone"
    if copies == inputs:
        return f"×{copies} inputs"
    return f"×{copies} copies, {inputs} inputs"


class _BatchView:
    """The batched graph of a :class:`~vgraph.virtual.batch.BatchedBuild`: every node of
    ``batch.graph``; a group — one op for the copies of a declared node that ran together — is
    one node labelled with the declared node ``<type:id>``, how many copies and inputs it
    served, and coloured by that number."""

    def __init__(self, batch: Any, constants: bool, shapes: bool, rankdir: str, title: str | None) -> None:
        nodes: list[ComputeNode] = batch.graph.nodes()
        if title is None:
            name = batch.virtual.name or "model"
            title = (
                f"{name} — batched build of {len(batch)} inputs: {len(batch.groups)} groups, "
                f"{len(nodes)} nodes"
            )
        self.scene = scene = _base_scene(title, rankdir)
        most = max((batch.group_info(n)[1] for n in nodes if batch.group_info(n) is not None), default=1)
        ids: dict[ComputeNode, str] = {}
        for k, n in enumerate(nodes):
            kind = n.key.type.split("#")[0]
            if n.op is None and kind == "Constant" and not constants:
                continue
            ids[n] = nid = f"n{k}"
            scene.add_node(scene.root, nid, self._attrs(batch, n, kind, most, shapes))
        for n in nodes:
            if n not in ids:
                continue
            for p in n.parents:
                if p in ids:
                    scene.add_edge(ids[p], ids[n], dict(_LEAF_EDGE) if p.op is None else None)
        self._legend(most)

    @staticmethod
    def _attrs(batch: Any, n: ComputeNode, kind: str, most: int, shapes: bool) -> dict[str, Any]:
        info = batch.group_info(n)
        small: list[tuple[str, str]] = []
        if info is not None:
            first, copies, inputs = info
            lines: list[Any] = [("b", f"<{first.type}:{first.id}>")]
            if n.name:
                lines.append(("", n.name))
            alone = f"input {n.key.type.partition('#')[2]} alone"
            small.append(("s", _group_text(copies, inputs) if copies > 1 else alone))
            if first.type.endswith("*"):
                small.append(("sg", "hoisted: every iteration"))
            attrs: dict[str, Any] = {"fillcolor": group_color(copies, most), "style": "filled"}
            if _dark(attrs["fillcolor"]):
                attrs["fontcolor"] = "white"
            attrs["tooltip"] = f"<{n.key}>: {copies} copies of <{first.type}:{first.id}> for {inputs} inputs"
        elif n.op is None:
            attrs = _kind_style(kind if kind in _KIND_STYLE else "Constant")
            lines = [("b", n.name or f"<{n.key}>")]
            inp = n.key.type.partition("#")[2]
            if inp:
                small.append(("sg", f"input {inp}"))
        else:  # plumbing: gathers of rows, a row alone, the combined loss
            attrs = dict(_PLUMBING)
            lines = [("", {"GatherRows": "gather", "GetItem": "rows"}.get(n.op.name, n.op.name))]
            if n.key.type in ("Outputs", "BatchLoss"):
                attrs = {"shape": "box", "style": "filled,bold", "fillcolor": "#fdf2d0"}
                lines = [("b", "combined loss" if n.key.type == "BatchLoss" else "every input's output")]
        if shapes:
            small.append(("s", _shape_text(n.shape)))
        if small:
            lines.append(small)
        attrs["label"] = _label(lines)
        return attrs

    def _legend(self, most: int) -> None:
        rows = [
            ("white", _ALONE, "one input alone"),
            ("light", group_color(2, max(most, 2)), "a group: 2 copies"),
            (
                "dark",
                group_color(most, most) if most > 1 else _ALONE,
                f"a group: {most} copies (the largest)",
            ),
        ]
        cells = "".join(
            f'<TR><TD BGCOLOR="{color}" WIDTH="18"> </TD><TD ALIGN="LEFT">{text}</TD></TR>'
            for _, color, text in rows
        )
        table = _HTML(
            '<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">'
            '<TR><TD COLSPAN="2"><B>batch groups</B></TD></TR>'
            f"{cells}"
            '<TR><TD COLSPAN="2" ALIGN="LEFT">one node per group: the copies of a declared node<BR ALIGN="LEFT"/>'
            "that ran as one op (grey: gathers of rows)</TD></TR></TABLE>"
        )
        legend = _Cluster("cluster_legend", {"label": "", "style": "rounded", "color": "#999999"})
        self.scene.root.items.append(legend)
        self.scene.add_node(
            legend, "legend", {"shape": "plaintext", "style": "", "label": table, "margin": 0}
        )


def _mark_groups(scene: _Scene, view: Any, batch: Any, i: int, gradients: bool) -> None:
    """On the unrolled view of ``batch.unrolled(i)``: say under each node which group of the
    batched build computed it (and, without the gradient overlay, colour it by the group's size)."""
    marks = {n: batch.ran_with(i, n.key) for n in view.as_itself}
    most = max((m[1] for m in marks.values() if m is not None), default=1)
    for n, mark in marks.items():
        nid = view.drawn.get(n)
        if mark is None or nid is None or nid not in scene.nodes:
            continue
        node, copies, inputs = mark
        attrs = scene.nodes[nid]
        text = f"batched {_group_text(copies, inputs)} in <{node.key}>" if copies > 1 else "batched: alone"
        attrs["label"] = _HTML(f"{attrs['label']}<BR/>{_label([('sg', text)])}")
        if not gradients:
            attrs["fillcolor"] = group_color(copies, most)
            if "filled" not in attrs.get("style", "filled"):
                attrs["style"] = attrs["style"] + ",filled"
            if _dark(attrs["fillcolor"]):
                attrs["fontcolor"] = "white"


__all__ = ["group_color"]
