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

Modules: ``scene`` (the DOT scene model and writing), ``frames`` (which iteration each compute node
belongs to), ``virtual_view`` and ``unrolled_view`` (the two views), ``gradients`` (colour scale,
gradient norms, gradient through time), ``views`` (option checking, :func:`to_dot`), ``output``
(the ``dot`` program, :func:`render`, Jupyter display), ``explorer`` (:func:`explore`: one
self-contained interactive HTML page).
"""

from __future__ import annotations

# The public names are __all__; the internals (``_scene``, ``_Frames`` …) stay reachable as
# ``vgraph.render._name``, as they were before the module became a package.
from .explorer import ExplorerPage, explore, explore_script_result
from .frames import _Frame, _Frames, _Run  # noqa: F401
from .gradients import (  # noqa: F401
    GRADIENT_DECADES,
    INF_COLOR,
    NAN_COLOR,
    GradientScale,
    _cmap,
    _luminance,
    _plot_through_time,
    _resolve_param,
    gradient_color,
    gradient_norms,
    gradient_through_time,
    retain_all_grads,
)
from .output import (  # noqa: F401
    _INSTALL_HINT,
    FORMATS,
    REPR_MAX_NODES,
    _dot_program,
    _repr_mimebundle_,
    _repr_svg_,
    _run_dot,
    dot_available,
    render,
    to_svg,
)
from .scene import _HTML, _Cluster, _esc, _label, _quote, _Scene, _shape_text  # noqa: F401
from .unrolled_view import (
    DEFAULT_FOLD,
    GUARD_TYPES,
    REFERENCE_THRESHOLD,
    _UnrolledView,  # noqa: F401
)
from .views import (
    _scene,  # noqa: F401
    to_digraph,
    to_dot,
)
from .virtual_view import _VirtualView  # noqa: F401

__all__ = [
    "DEFAULT_FOLD",
    "FORMATS",
    "GRADIENT_DECADES",
    "GUARD_TYPES",
    "INF_COLOR",
    "NAN_COLOR",
    "REFERENCE_THRESHOLD",
    "ExplorerPage",
    "GradientScale",
    "dot_available",
    "explore",
    "explore_script_result",
    "gradient_color",
    "gradient_norms",
    "gradient_through_time",
    "render",
    "retain_all_grads",
    "to_digraph",
    "to_dot",
    "to_svg",
]
