"""Which loop iteration each compute node belongs to: the frames (one per iteration of one loop
run) and runs (all iterations of a loop in one path of the enclosing loops) of a ComputeGraph.

Shared by the unrolled view (one cluster per frame) and :func:`gradient_through_time` (one row
per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..compute import ComputeGraph, ComputeNode, NodeKey
from ..virtual import LoopNode, UnrolledGraph, VirtualNode
from .scene import _Cluster


def _carry_name(carry: VirtualNode) -> str:
    """A carry's name (``LoopNode.carry`` always gives one; the key if it somehow has none)."""
    return carry.name or f"{carry.type}:{carry.id}"


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
        if isinstance(cg, UnrolledGraph):
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
                        self.edge_names[(src, frame)] = _carry_name(c)
                    upd = env.get(scope.updates[c])
                    if upd is not None and self.owner.get(upd) is frame:
                        self.next_names.setdefault(upd, []).append(_carry_name(c))
        loops_by_id = {f.loop.id: f.loop for f in self.frames.values()}
        loops_by_id.update({r.loop.id: r.loop for r in self.runs.values()})
        by_idx: dict[tuple[int, ...], _Frame] | None = None
        for n in self.nodes:
            if n in self.owner:
                continue
            k = n.key
            if k.type == "LoopCheck" and k.id in loops_by_id:
                loop = loops_by_id[k.id]
                check_frame = self.frames.get((loop, k.idx))
                self.owner[n] = (
                    check_frame if check_frame is not None else self._frame_of(loop.scope, k.idx[:-1])
                )
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
