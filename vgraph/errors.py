"""The one exception hierarchy of vgraph.

Every error a user can cause is a :class:`VGraphError`. Errors about a node name it by its
``<type,id,idx>`` key (and the user's display name, when there is one). Where a standard exception
type fits too, the error also derives from it (``ShapeError``, ``FeedError`` and
``ArgumentValueError`` are ``ValueError``s, ``ArgumentError`` a ``TypeError``, ``GraphStateError``
a ``RuntimeError``), so generic handlers keep working.
"""

from __future__ import annotations


class VGraphError(Exception):
    """Base class of every error vgraph raises for a user mistake."""


class ArgumentError(VGraphError, TypeError):
    """An argument of the wrong type (``hoist="yes"`` where a bool is expected, a name where a
    node is expected); a ``TypeError`` too."""


class ArgumentValueError(VGraphError, ValueError):
    """An argument of the right type but a value it cannot take (``count=-1`` where an int >= 0
    is expected); a ``ValueError`` too."""


class ShapeError(VGraphError, ValueError):
    """Shapes that cannot be combined, or a value whose shape is not the declared one."""


class BuildError(VGraphError):
    """A virtual graph that cannot be declared or unrolled as written."""


class FeedError(BuildError, ValueError):
    """Missing, unknown or ill-shaped values fed to a graph's inputs."""


class LoopLimitError(BuildError):
    """A loop ran past its ``max_iters`` guard, or a recursion's structure has more nodes than its
    ``max_nodes`` guard."""


class StructureError(BuildError, ValueError):
    """A recursion's structure (its children array) that cannot be recursed over: not ``(N, k)``
    integers, empty, a child index out of range or not before its parent (a cycle)."""


class SelectorError(BuildError):
    """A branch selector returned something that is not a valid option index."""


class GraphStateError(VGraphError, RuntimeError):
    """An operation that the graph's current state does not allow (e.g. a second backward, or a
    backward that would read values older than the inputs they were computed from)."""


class StructureChangedError(GraphStateError):
    """New values would change a data-dependent decision (a trip count, a branch choice).

    The compute graph was unrolled for the old values; rebuild it for the new ones.
    """


class GradcheckError(VGraphError, AssertionError):
    """Analytic (VJP) and numeric (finite-difference) gradients disagree."""


class CheckpointError(VGraphError):
    """A checkpoint file that is corrupt or does not match the model."""


class RenderError(VGraphError):
    """A graph that cannot be drawn, e.g. because Graphviz's ``dot`` program is missing."""


class BackwardError(VGraphError, RuntimeError):
    """A vector-Jacobian product failed during backward; names the node whose VJP raised, or
    whose VJP returned what is not a gradient (``None``, complex or object values: the checks of
    :func:`vgraph.defop` ops).

    When the VJP raised, the original exception is the ``__cause__``. No ``.grad`` was changed by
    the failed backward.
    """


class VJPShapeError(BackwardError, ShapeError):
    """A VJP of a :func:`vgraph.defop` op returned a gradient whose shape is neither its input's
    nor (for an input the op broadcast) the op's output's; names the node, the input and both
    shapes. A :class:`BackwardError` and a :class:`ShapeError`."""


class DTypeError(VGraphError, TypeError):
    """An op of :func:`vgraph.defop` whose forward returned values that are not real numbers
    (complex, object, strings); names the node and the dtype."""


class OpDefinitionError(VGraphError, TypeError, ValueError):
    """:func:`vgraph.defop` refused a definition (a name that is taken or not an identifier, a
    forward or VJP that is not callable or cannot take the op's inputs); names the op. Both a
    ``TypeError`` and a ``ValueError``, as the refusals are of both kinds."""


class NonFiniteError(VGraphError, FloatingPointError):
    """Anomaly detection found the first NaN or Inf: names the unrolled node that produced it."""


class SecondOrderError(VGraphError):
    """A gradient recorded as graph nodes (``create_graph=True``) met a node it cannot
    differentiate that way: an op with no differentiable VJP (a :func:`vgraph.defop` op defined
    without ``node_vjps``, a loop run as one body program), or a structure the recorded gradient
    does not support yet (checkpointed loops, nodes computed when read). Names the node and says
    what to do instead. Nothing was added to the graph's gradients (``.grad`` is unchanged)."""
