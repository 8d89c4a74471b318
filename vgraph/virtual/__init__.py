"""Virtual graphs: declare a dynamic model once, unroll it into a ComputeGraph per input.

A :class:`VirtualGraph` holds :class:`VirtualNode` s (inputs, parameters, constants, ops),
:class:`LoopNode` s and :class:`BranchNode` s. :func:`build_compute_graph` unrolls it for one
feed: every loop iteration becomes real compute nodes keyed ``<type, id, idx>`` (``idx`` = the
iteration path), every branch keeps only the option it selects, and forward values are computed
while unrolling so that loop conditions and branch selectors see real data.

The whole package builds ComputeGraphs through the public API of :mod:`vgraph.compute` only.
It is split by concern: :mod:`.nodes` and :mod:`.graph` declare, :mod:`.store` keeps
parameters, :mod:`.plan` holds the static facts of a declared structure, :mod:`.unroll` builds
compute graphs (with :mod:`.hoist` and :mod:`.checkpoint`), :mod:`.cache` and :mod:`.elastic`
re-use earlier builds, :mod:`.batch` builds many inputs at once.
"""

from __future__ import annotations

from .graph import VirtualGraph
from .nodes import BranchNode, LoopNode, VirtualNode
from .store import ParameterStore
from .unroll import build_compute_graph
from .unrolled import Decision, UnrolledGraph

__all__ = [
    "BranchNode",
    "Decision",
    "LoopNode",
    "ParameterStore",
    "UnrolledGraph",
    "VirtualGraph",
    "VirtualNode",
    "build_compute_graph",
]
