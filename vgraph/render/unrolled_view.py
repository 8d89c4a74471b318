"""The unrolled view: a ComputeGraph drawn with one cluster per loop iteration, long loops
folded, optionally coloured by gradient norm."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..compute import ComputeGraph, ComputeNode
from ..virtual import LoopNode
from .frames import _Frames
from .gradients import _luminance, gradient_color
from .scene import (
    _CARRY_EDGE,
    _HTML,
    _KEY_EDGE,
    _KIND_STYLE,
    _LEAF_EDGE,
    _base_scene,
    _Cluster,
    _cluster_name,
    _cluster_nodes,
    _kind_style,
    _label,
    _shape_text,
)

#: Iterations shown at the start and at the end of a folded loop.
DEFAULT_FOLD: tuple[int, int] = (3, 3)
#: Node types that are structural guards (re-checked loop conditions and sequence lengths).
GUARD_TYPES = ("LoopCheck", "LengthCheck")


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
