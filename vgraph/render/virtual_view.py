"""The virtual view: a VirtualGraph drawn as declared, loops as clusters with carried state as
back edges, branches with their options and keys; optionally greyed by what one build used."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ..virtual import BranchNode, LoopNode, UnrolledGraph, VirtualGraph, VirtualNode
from .frames import _carry_name
from .scene import (
    _CARRY_EDGE,
    _GREY,
    _KEY_EDGE,
    _base_scene,
    _Cluster,
    _cluster_name,
    _kind_style,
    _label,
    _shape_text,
)

_DEFAULT_MAX_ITERS = inspect.signature(VirtualGraph.loop).parameters["max_iters"].default
_DEFAULT_MAX_NODES = inspect.signature(VirtualGraph.recurse).parameters["max_nodes"].default


def _callable_name(f: Any, anonymous: str) -> str:
    """The name a drawing shows for a user's function (``anonymous`` for a lambda)."""
    name = getattr(f, "__name__", None)
    return name if isinstance(name, str) and name and name != "<lambda>" else anonymous


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
        # Keyed by Decision.node: the loop (trip counts) or the branch (how often each option).
        self.trips: dict[VirtualNode, list[int]] = {}
        self.choices: dict[VirtualNode, dict[int, int]] = {}
        self.capped: dict[VirtualNode, int] = {}  # loop -> runs that stopped at max_iters
        if build is not None:
            self.built = set()
            for (scope, _idx), env in build._envs.items():
                self.built.update(env)
                if scope is not None:
                    self.built.add(scope)
            for d in build.decisions:
                if d.kind == "iterations":
                    self.trips.setdefault(d.node, []).append(d.value)
                elif d.kind == "capped":
                    self.capped[d.node] = self.capped.get(d.node, 0) + 1
                else:
                    counts = self.choices.setdefault(d.node, {})
                    counts[d.value] = counts.get(d.value, 0) + 1
        hidden = set() if constants else {v for v in g.nodes if v.kind == "constant"}
        self.hidden = hidden
        # Clusters for loops, nested by scope. All clusters exist before any is placed: a loop
        # takes its place in `g.nodes` when its `with` block closes, so an inner loop comes before
        # the outer loop that contains it.
        loops = [v for v in g.nodes if isinstance(v, LoopNode)]
        clusters: dict[LoopNode | None, _Cluster] = {None: scene.root}
        for loop in loops:
            clusters[loop] = _Cluster(_cluster_name("loop", loop.id), self._loop_attrs(loop))
        for loop in loops:
            clusters[loop.scope].items.append(clusters[loop])
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

    def _loop_rule(self, loop: LoopNode) -> list[str]:
        """How ``loop`` decides its iterations, in words: one line per rule it was declared with."""
        rule: list[str] = []
        if loop.structure is not None:
            rule.append(
                f"over the nodes of {loop.structure.name or self.nid(loop.structure)}, children first"
            )
        if loop.times is not None:
            rule.append(f"times={loop.times}")
        if loop.sequences:
            rule.append(
                "steps through "
                + ", ".join(
                    (s.name or self.nid(s)) + (" (reversed)" if (item.attrs or {}).get("reverse") else "")
                    for s, item in zip(loop.sequences, loop.items)
                )
            )
        if loop.cond is not None:
            rule.append(f"while {_callable_name(loop.cond, 'cond(t, state)')}")
        if loop.until is not None:
            rule.append(
                f"until {_callable_name(loop.until, 'cond(t, state)')} (checked after each iteration)"
            )
        bound, default = "max_iters", _DEFAULT_MAX_ITERS
        if loop.structure is not None:
            bound, default = "max_nodes", _DEFAULT_MAX_NODES
        if loop.on_limit == "stop":
            rule.append(f"stops at {bound}={loop.max_iters}")
        elif loop.max_iters != default:  # the default guard is noise; a chosen one is part of the rule
            rule.append(f"more than {bound}={loop.max_iters} is an error")
        return rule

    def _loop_attrs(self, loop: LoopNode) -> dict[str, Any]:
        lines = [("b", f"<{self.nid(loop)}>" + (f" {loop.name}" if loop.name else ""))]
        # Never an empty line: `dot` rejects an empty <FONT></FONT> (and a loop drawn from inside
        # its `with` block may have no rule yet).
        lines += [("s", text) for text in self._loop_rule(loop)]
        if loop.carries:
            what = "state at each node" if loop.structure is not None else "carries"
            lines.append(("s", f"{what} " + ", ".join(_carry_name(c) for c in loop.carries)))
        attrs: dict[str, Any] = {"style": "rounded,filled", "fillcolor": "#f3f6fb", "color": "#6b7fa3"}
        if self.build is not None:
            trips = self.trips.get(loop)
            if trips:
                if len(trips) == 1:
                    ran = f"{trips[0]} iterations"
                elif min(trips) == max(trips):
                    ran = f"{trips[0]} iterations in each of {len(trips)} runs"
                else:
                    ran = f"{min(trips)}–{max(trips)} iterations (in {len(trips)} runs)"
                capped = self.capped.get(loop, 0)
                if capped:
                    ran += ", stopped at max_iters" + (f" in {capped} of them" if len(trips) > 1 else "")
                lines.append(("s", f"this build: {ran}"))
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
            lines.append(("", v.name or ""))  # inputs and parameters always have names
            if self.shapes:
                lines.append(("s", _shape_text(v.attrs.get("shape"))))
        elif kind == "parameter":
            lines.append(("", v.name or ""))
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
        elif isinstance(v, BranchNode):
            if v.name:
                lines.append(("", v.name))
            sel = _callable_name(v.selector, "selector")
            lines.append(("s", f"selector {sel}, {len(v.options)} options"))
            counts = self.choices.get(v)
            if counts:
                lines.append(
                    ("s", "took " + ", ".join(f"option {k} ×{n}" for k, n in sorted(counts.items())))
                )
        else:
            if v.name:
                lines.append(("", v.name))
        scope = v.scope
        updates = (
            [_carry_name(c) for c in scope.carries if scope.updates.get(c) is v] if scope is not None else []
        )
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
        if isinstance(v, LoopNode):
            for c in v.carries:
                upd = v.updates.get(c)
                if upd is not None:  # loop-carried state: a back edge, update value -> carry
                    self._edge(upd, c, label=_carry_name(c), constraint=False, style="bold", **_CARRY_EDGE)
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
        elif isinstance(v, BranchNode):
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
