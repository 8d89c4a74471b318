"""vgraph: dynamic networks declared once, unrolled per input, differentiated exactly."""

from __future__ import annotations

# Imported last: it draws both graph kinds and gives them Jupyter display (_repr_svg_).
from . import (
    init,
    io,
    losses,
    nn,
    ops,
    optim,
    render,
    tbptt,
)
from .check import check_vjps, gradcheck, jacobian
from .compute import (
    ComputeGraph,
    ComputeNode,
    ForwardReport,
    NodeKey,
    detect_anomaly,
    get_default_dtype,
    is_anomaly_enabled,
    is_grad_enabled,
    no_grad,
    set_default_dtype,
)
from .errors import (
    BackwardError,
    BuildError,
    CheckpointError,
    FeedError,
    GradcheckError,
    GraphStateError,
    LoopLimitError,
    NonFiniteError,
    RenderError,
    SelectorError,
    ShapeError,
    StructureChangedError,
    StructureError,
    VGraphError,
)
from .functions import (
    abs,
    concat,
    defop,
    detach,
    exp,
    log,
    log_softmax,
    matmul,
    max,
    mean,
    relu,
    reshape,
    sigmoid,
    sign,
    softmax,
    softplus,
    stack,
    step,
    sum,
    take,
    take_along_axis,
    tanh,
    transpose,
    undefop,
    where,
)
from .virtual import (
    BranchNode,
    Decision,
    LoopNode,
    ParameterStore,
    UnrolledGraph,
    VirtualGraph,
    VirtualNode,
    build_compute_graph,
)

__version__ = "0.1.0"
