"""The unrolled view: a ComputeGraph drawn with one cluster per loop iteration, long loops
folded, optionally coloured by gradient norm."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..compute import ComputeGraph, ComputeNode
from ..ops import ROW_SUMS
from ..virtual import LoopNode, UnrolledGraph
from ..virtual.checkpoint import Rematerializer
from .frames import _Frame, _Frames
from .gradients import INF_COLOR, NAN_COLOR, ZERO_COLOR, GradientScale, _luminance, gradient_color
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
    _esc,
    _kind_style,
    _label,
    _LabelLine,
    _shape_text,
)

#: Iterations shown at the start and at the end of a folded loop.
DEFAULT_FOLD: tuple[int, int] = (3, 3)
#: Node types that are structural guards (re-checked loop conditions and sequence lengths).
GUARD_TYPES = ("LoopCheck", "LengthCheck")
#: With ``references=None`` (automatic), a node feeding more iterations than this (other than its
#: own) is drawn once and referred to in each of them by a small reference node, not by edges.
REFERENCE_THRESHOLD = 6


def _checkpoint_marks(cg: ComputeGraph) -> dict[tuple[Any, tuple[int, ...]], tuple[str, set[int]]]:
    """For each checkpointed loop run: its schedule and the iterations whose end state is kept
    (the others' values are recomputed by backward; see vgraph.virtual.checkpoint)."""
    remat = cg.dropped_values
    if not isinstance(remat, Rematerializer):
        return {}
    return {(rec.loop, rec.idx): (str(rec.schedule), rec.kept_iterations()) for rec in remat.records}


class _UnrolledView(_Frames):
    def __init__(self, cg: ComputeGraph, fold: tuple[int, int] | None, iterations: range | frozenset[int] | None,
                 gradients: bool, guards: bool, constants: bool, shapes: bool, rankdir: str,
                 title: str | None, references: bool | None = None) -> None:  # fmt: skip
        super().__init__(cg)
        self.refs: set[str] = set()  # drawn nodes that have references in iterations
        self.as_itself: set[ComputeNode] = set()  # nodes drawn as themselves (not folded or hidden)
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
        self.scale = GradientScale.of(self.norms.values())

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
                finite = [v for v in values if math.isfinite(v)]
                text = f"|grad| {min(finite):.1e} … {max(finite):.1e}" if finite else "|grad|"
                if len(finite) < len(values):
                    text += f", {len(values) - len(finite)} NaN/Inf"
                attrs["label"] = _HTML(f"{attrs['label']}<BR/>{_label([('s', text)])}")
        for n in nodes:
            nid = self.drawn[n]
            if nid is None or n not in self.as_itself:
                continue
            frame = self.owner.get(n)
            if frame is None:
                container = scene.root
            else:
                assert frame.cluster is not None  # a node is drawn as itself only in a drawn iteration
                container = frame.cluster
            scene.add_node(container, nid, self._node_attrs(n))
        self._edges(references)
        for c in self._all_clusters():
            c.items.sort(key=lambda item: isinstance(item, _Cluster) and item.name.startswith("cluster_loop"))
        self._order_iterations()
        if gradients or self.refs:
            self._legend()

    def _edges(self, references: bool | None) -> None:
        """Draw every parent -> child edge between drawn nodes.

        A node feeding many iterations other than its own (a shared parameter, the stepped
        sequence, a value of an outer iteration used by every inner one) gets a small reference
        node in each of those iterations instead of an edge from its one drawn copy; likewise a
        node outside a loop gathering a value from many of its iterations (``loop.stack``) gets
        a reference in each of them. Edges from one node into every iteration cross the whole
        drawing and make Graphviz's layout time explode (20 unfolded steps of an RNN took 14 s,
        30 steps more than 90 s); with references 100 steps take under a second.
        """
        scene = self.scene
        edges: list[tuple[ComputeNode, int, ComputeNode, str, str, _Frame | None, _Frame | None, bool]] = []
        # (referable node id, outward) -> the iterations it would be referred to in
        frames_of: dict[tuple[str, bool], set[int]] = {}
        for n in self.nodes:
            head = self.drawn[n]
            if head is None:
                continue
            frame = self.owner.get(n)
            for i, p in enumerate(n.parents):
                tail = self.drawn.get(p)
                if tail is None or tail == head:
                    continue
                ref_frame, outward = None, False
                if p in self.as_itself and n in self.as_itself:
                    tail_frame = self.owner.get(p)
                    if frame is not None and frame.cluster is not None and not _encloses(frame, tail_frame):
                        ref_frame = frame  # p feeds this iteration from outside it
                    elif (
                        tail_frame is not None and tail_frame.cluster is not None and tail_frame is not frame
                    ):
                        ref_frame, outward = tail_frame, True  # n, around the iteration, gathers from it
                edges.append((n, i, p, tail, head, frame, ref_frame, outward))
                if ref_frame is not None:
                    frames_of.setdefault((head if outward else tail, outward), set()).add(id(ref_frame))
        least = REFERENCE_THRESHOLD + 1 if references is None else 2
        referenced = {key for key, fs in frames_of.items() if references is not False and len(fs) >= least}
        for n, i, p, tail, head, frame, ref_frame, outward in edges:
            attrs: dict[str, Any] = {}
            if n.key in self.choice and n.op is not None and self.virtual is not None:  # a branch
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
            if ref_frame is not None:
                if outward and (head, True) in referenced:
                    head = self._reference(n, head, ref_frame, outward=True)
                elif not outward and (tail, False) in referenced:
                    tail = self._reference(p, tail, ref_frame, outward=False)
            if tail.startswith("fold:") or head.startswith("fold:"):
                attrs["style"] = "dashed"
            scene.add_edge(tail, head, attrs)

    def _reference(self, n: ComputeNode, nid: str, frame: _Frame, outward: bool) -> str:
        """The id of the reference to ``n`` (drawn as ``nid``) in ``frame``'s cluster, created on
        first use. ``outward``: ``n`` takes a value from the iteration (drawn ``→ name``)."""
        ref = f"ref:{nid} in t={'.'.join(map(str, frame.idx))}"
        if ref not in self.scene.nodes:
            assert frame.cluster is not None
            text = n.name or str(n.key)
            attrs = {**_kind_style("Reference"), "label": _label([("i", f"→ {text}" if outward else text)]),
                     "tooltip": f"{n.key}: drawn once, outside this iteration"}  # fmt: skip
            self.scene.add_node(frame.cluster, ref, attrs)
            self.refs.add(nid)
        return ref

    def _fold(self, fold: tuple[int, int] | None, iterations: range | frozenset[int] | None) -> None:
        """Create the clusters of visible iterations and the fold nodes of hidden ones."""
        scene = self.scene
        runs = sorted(self.runs.values(), key=lambda r: (len(r.outer), self._loop_order(r.loop), r.outer))
        if iterations is not None and runs and not any(t in iterations for r in runs for t in r.frames):
            trips = sorted({r.trips for r in runs})
            raise ValueError(
                f"iterations={iterations!r} selects no iteration of any loop (the loops run "
                f"{', '.join(map(str, trips))} iterations, t = 0 … {max(trips) - 1})"
                if max(trips) > 0
                else f"iterations={iterations!r}: no loop of this graph ran any iteration"
            )
        marks = _checkpoint_marks(self.cg)
        for run in runs:
            parent = run.parent
            if parent is None:
                container = scene.root
            elif parent.hidden_as is None and parent.cluster is not None:
                container = parent.cluster
            else:  # inside a hidden iteration
                for f in run.frames.values():
                    f.hidden_as = parent.hidden_as
                continue
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
            ckpt = marks.get((loop, run.outer))  # (schedule, kept iterations)
            if ckpt is not None:
                sub += f", {ckpt[0]}"
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
                parts = [("b", tlabel)]
                if ckpt is not None:  # whose state is kept, and which are recomputed in backward
                    parts.append(("sg", "state kept" if t in ckpt[1] else "recomputed"))
                f.cluster = _Cluster(
                    _cluster_name("iter", lkey, *f.idx),
                    {"label": _label(parts), "labeljust": "l", "fontsize": 13, "style": "rounded,filled",
                     "fillcolor": "#f4f6f9" if len(f.idx) % 2 else "#e9edf3", "color": "#9aa7b8"},
                )  # fmt: skip
                run.cluster.items.append(f.cluster)

    def _order_iterations(self) -> None:
        """Keep the iterations of each loop run in order: every node drawn for iteration t+1
        is ranked below every node of iteration t (through an invisible point between them),
        so Graphviz stacks them t=0, t=1, … along the layout direction. Not for a recursion
        (``g.recurse``): its iterations are structure nodes, and its child edges lay it out as a
        tree, leaves first."""
        children: dict[str, list[str]] = {}
        for tail, head, _attrs in self.scene.edges:
            children.setdefault(tail, []).append(head)
        parents: dict[str, list[str]] = {}
        for tail, head, _attrs in self.scene.edges:
            parents.setdefault(head, []).append(tail)
        for run in sorted(
            self.runs.values(), key=lambda r: (len(r.outer), self._loop_order(r.loop), r.outer)
        ):
            if run.cluster is None or getattr(run.loop, "structure", None) is not None:
                continue  # a recursion is laid out by its child edges: drawn as the tree it is
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
        self.as_itself.add(n)
        return str(n.key)

    # -- node look
    def _node_attrs(self, n: ComputeNode) -> dict[str, Any]:
        k = n.key
        lines: list[_LabelLine] = [("b", f"<{k}>")]
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
        deferred = self.cg._deferred
        if n.op is not None and n.op.name == "Hoisted":  # row t of a group (vgraph.virtual.hoist)
            small.append(("sg", f"hoisted: row {n.attrs['index']} of <{n.parents[0].key}>"))
        elif n.op is not None and n.op.name == "AddRow":  # a reassociated sum (vgraph.virtual.hoist)
            small.append(("sg", f"row {n.attrs['index']} of <{n.parents[0].key}> + <{n.parents[1].key}>"))
        elif n.op is not None and n.op.name == "MatMulAddRow":  # the same, its product fused
            small.append(("sg", f"product + row {n.attrs['index']} of <{n.parents[2].key}>"))
        elif k.type.endswith("*") and n.op is not None:
            rows = self.cg._groups.get(n, ()) if isinstance(self.cg, UnrolledGraph) else ()
            if rows and rows[0].op is not None and rows[0].op.forward in ROW_SUMS:  # (a reassociated sum)
                small.append(
                    ("sg", f"{n.op.name} for every iteration: the hoisted part of <{k.type[:-1]}:{k.id}@t>")
                )
            else:
                small.append(("sg", f"{n.op.name} for every iteration (hoisted)"))
        elif n.op is not None and n.op.name not in (k.type, "GetItem"):
            small.append(("sg", n.op.name))
        if n in deferred:  # (ComputeGraph.computed_when_read)
            proxy = deferred[n]
            small.append(("sg", "computed when read" + (f", in <{proxy.key}>" if proxy is not None else "")))
        if n.op is not None and "gates" in n.attrs:  # a fused cell
            small.append(("sg", "gates " + " ".join(n.attrs["gates"])))
        if k.type == "Parameter" and k.idx:
            small.append(("sg", "untied"))
        if k.type == "Constant" and n.op is None and np.size(n.value) == 1:
            small.append(("s", f"{np.asarray(n.value).reshape(()).item():g}"))
        elif self.shapes:
            small.append(("s", _shape_text(n.shape)))
        kind = k.type if k.type in _KIND_STYLE else "op"
        attrs = _kind_style(kind)
        if n in deferred:  # a dashed outline: no value kept
            attrs["style"] = attrs.get("style", "filled") + ",dashed"
        if self.gradients:
            norm = self.norms.get(n)
            if norm is None:
                attrs.update(fillcolor="white", color="#bbbbbb")
            else:
                small.append(("s", f"|grad| {norm:.2e}"))
                _, color = gradient_color(norm, self.scale)
                attrs["fillcolor"] = color
                if _luminance(color) < 0.45:
                    attrs["fontcolor"] = "white"
                attrs["tooltip"] = f"{k}: |grad| = {norm:.6g}"
            if "filled" not in attrs.get("style", "filled"):
                attrs["style"] = attrs["style"] + ",filled"
        if small:
            lines.append(small)
        attrs["label"] = _label(lines)
        return attrs

    def _gradient_root(self) -> ComputeNode | None:
        """The node backward started from, if the retained gradients tell: the one op node
        with a gradient that no node with a gradient depends on."""
        has_child_grad: set[ComputeNode] = set()
        for n in self.nodes:
            if n.grad is not None:
                has_child_grad.update(n.parents)
        deferred = self.cg._deferred  # computed when read: no node reads them, none is the root
        roots = [
            n
            for n in self.nodes
            if n.grad is not None and n.op is not None and n not in has_child_grad and n not in deferred
        ]
        return roots[0] if len(roots) == 1 else None

    def _legend(self) -> None:
        """The legend: what the gradient colours mean and what reference nodes are."""

        def note(text: str, color: str = "#555555", size: int = 10) -> str:
            return (f'<TR><TD BORDER="0" ALIGN="LEFT"><FONT POINT-SIZE="{size}" '
                    f'COLOR="{color}">{_esc(text)}</FONT></TD></TR>')  # fmt: skip

        def cell(color: str, text: str, width: int = 56, border: str = "") -> str:
            font = ' COLOR="white"' if _luminance(color) < 0.45 else ""
            return (f'<TD BGCOLOR="{color}" WIDTH="{width}" HEIGHT="24"{border}><FONT POINT-SIZE="11"{font}>'
                    f"{_esc(text)}</FONT></TD>")  # fmt: skip

        rows: list[str] = []
        if self.gradients:
            scale = self.scale
            root = self._gradient_root()
            of = f"L = {root.describe()}" if root is not None else "L = the node backward() started from"
            cells = []
            values = scale.cells()
            for i, v in enumerate(values):
                _, color = gradient_color(v, scale)
                text = f"{v:.1e}"
                if i == 0 and scale.clipped:
                    text = "≤ " + text
                elif i == len(values) - 1:
                    text += " max"
                cells.append(cell(color, text, 64))
            cells += [cell(ZERO_COLOR, "0", 30), cell(NAN_COLOR, "NaN", 36), cell(INF_COLOR, "Inf", 36),
                      cell("#ffffff", "no .grad", 56, ' COLOR="#bbbbbb"')]  # fmt: skip
            rows.append(
                '<TR><TD BORDER="0"><B><FONT POINT-SIZE="13">gradient norm |dL/dv| '
                f"of each node's value v, {_esc(of)}</FONT></B></TD></TR>"
            )
            rows.append(
                '<TR><TD BORDER="0" ALIGN="LEFT"><TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" '
                f'CELLPADDING="4"><TR>{"".join(cells)}</TR></TABLE></TD></TR>'
            )
            top = 10.0**scale.hi
            if scale.clipped:
                rows.append(note(
                    f"log10 colour scale from the largest norm ({top:.2e}) down {scale.hi - scale.lo:.0f} decades; "
                    f"{scale.clipped} smaller norm{'s are' if scale.clipped != 1 else ' is'} clipped to the palest colour"
                ))  # fmt: skip
            else:
                rows.append(note(
                    f"log10 colour scale from the smallest positive norm ({10.0**scale.lo:.2e}) "
                    f"to the largest ({top:.2e}); |dL/dv| = np.linalg.norm(node.grad)"
                ))  # fmt: skip
            rows.append(note(
                "in a loop, a node's gradient sums every path from L back to it: for a loss on the "
                "last step it fades going back in time; for a loss summed over all steps it grows"
            ))  # fmt: skip
            op_nodes = [n for n in self.nodes if n.op is not None and n.requires_grad]
            if op_nodes and not any(n in self.norms for n in op_nodes):
                rows.append(note(
                    "no intermediate node kept its gradient: call vgraph.render.retain_all_grads(cg) before backward",
                    "#b03a2e", 11,
                ))  # fmt: skip
        if self.refs:
            rows.append(note(
                "dashed italic boxes: references to a node drawn once outside the iteration (Wh: a shared "
                "parameter or sequence it reads; → stacked: a node that collects its value); the edges "
                "between that node and every iteration are left out so that the iterations stay a chain",
                "#333333", 10,
            ))  # fmt: skip
        table = _HTML(
            '<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2" CELLPADDING="2">' + "".join(rows) + "</TABLE>"
        )
        legend = _Cluster("cluster_legend", {"label": "", "style": "rounded", "color": "#999999"})
        self.scene.root.items.append(legend)
        self.scene.add_node(
            legend, "legend", {"shape": "plaintext", "style": "", "label": table, "margin": 0}
        )


def _encloses(outer: _Frame | None, inner: _Frame | None) -> bool:
    """Whether iteration ``outer`` is ``inner`` or encloses it (``None``, the top level, encloses all)."""
    f = inner
    while f is not None:
        if f is outer:
            return True
        f = f.parent
    return outer is None
