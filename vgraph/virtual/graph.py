"""Declaring: :class:`VirtualGraph`, the model declared once, to be unrolled per input."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import init as initializers
from ..compute import ComputeNode, NodeKey, _as_value, get_default_dtype
from ..errors import BuildError, ShapeError
from ..functions import Operand
from ..ops import OPS
from .nodes import _NO_LOOP_VALUE, BranchNode, LoopNode, VirtualNode, _depth
from .plan import _Plan
from .store import ParameterStore, _is_iteration_path, _store_name

if TYPE_CHECKING:
    from .unroll import UnrolledGraph

# ---------------------------------------------------------------------------- the virtual graph


class VirtualGraph:
    """A model declared once, with loops and branches, to be unrolled per input.

    Args:
        dtype: the float dtype of parameters and values (default :func:`get_default_dtype`).
        seed: seeds every parameter's initialiser; each parameter (and each untied copy) draws from
            its own generator derived from ``(seed, parameter id, idx)``, so initial values do not
            depend on build order.
        name: a display name.
    """

    def __init__(self, dtype: Any = None, seed: int = 0, name: str | None = None) -> None:
        self.dtype = np.dtype(dtype) if dtype is not None else get_default_dtype()
        self.seed = seed
        self.name = name
        self.nodes: list[VirtualNode] = []  # in a topological order (declaration order)
        self.params = ParameterStore()
        self.latest_build: UnrolledGraph | None = None
        self._counters: dict[str, int] = {}
        self._scopes: list[LoopNode] = []
        self._inputs: dict[str, VirtualNode] = {}
        self._param_decls: dict[str, VirtualNode] = {}
        self._builds = 0  # seeds the generator of sampled nodes, build after build
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self.training = True

    def train(self, mode: bool = True) -> VirtualGraph:
        """Training mode (the default): builds record what backward needs; sampled nodes
        (e.g. dropout masks) are drawn."""
        self.training = mode
        return self

    def eval(self) -> VirtualGraph:
        """Evaluation mode: builds record nothing for backward (as under ``no_grad``) and sampled
        nodes take their evaluation value (dropout passes values through)."""
        return self.train(False)

    # -- declaration helpers
    def _register(self, node: VirtualNode) -> int:
        n = self._counters.get(node.type, 0) + 1
        self._counters[node.type] = n
        self.nodes.append(node)
        if node.scope is not None:
            node.scope.body.append(node)
        return n

    def _scope(self) -> LoopNode | None:
        return self._scopes[-1] if self._scopes else None

    def _as_node(self, x: Any) -> VirtualNode:
        """``x`` as a node visible in the current scope; numbers and arrays become constants."""
        if not isinstance(x, VirtualNode):
            if isinstance(x, Operand):
                raise BuildError(f"{x!r} is a compute node; a virtual graph takes virtual nodes")
            return self.constant(x)
        if x.graph is not self:
            raise BuildError(f"{x.describe()} belongs to another VirtualGraph")
        if x.kind == "loop":
            raise BuildError(_NO_LOOP_VALUE.format(x.describe()))
        self._check_visible(x)
        return x

    def _check_visible(self, x: VirtualNode) -> None:
        if x.scope is not None and x.scope not in self._scopes:
            raise BuildError(
                f"{x.describe()} belongs to the body of {x.scope.describe()} and cannot be used "
                "outside it; use the loop's outputs (loop.final(carry), loop.stack(value))"
            )
        if x.kind in ("final", "stacked") and x.inputs[0] in self._scopes:
            raise BuildError(
                f"{x.describe()} is an output of {x.inputs[0].describe()}, used inside its own body"
            )

    def _op(self, op: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> VirtualNode:
        if op not in OPS:
            raise BuildError(f"unknown op {op!r}")
        nodes = tuple(self._as_node(x) for x in inputs)
        arity = OPS[op].arity
        if arity is not None and arity != len(nodes):
            raise BuildError(f"{op} takes {arity} inputs, got {len(nodes)}")
        return VirtualNode(self, op, "op", nodes, attrs, None, self._scope())

    # -- declaring
    def input(self, name: str, shape: Sequence[int | None] | None = None) -> VirtualNode:
        """Declare an input fed by name at build time.

        Args:
            name: the feed key (unique in the graph).
            shape: the expected shape, ``None`` for any size on an axis (e.g. ``(None, None, 8)``
                for ``(time, batch, features)``); ``None`` for any shape.
        """
        if name in self._inputs:
            raise BuildError(f"the graph already has an input named {name!r}")
        shape = None if shape is None else tuple(shape)
        node = VirtualNode(self, "Input", "input", (), {"shape": shape}, name, None)
        self._inputs[name] = node
        return node

    def constant(self, value: Any, name: str | None = None) -> VirtualNode:
        """Declare a constant (no gradient). Always top-level: one compute node per build."""
        return VirtualNode(
            self, "Constant", "constant", (), {"value": _as_value(value, self.dtype)}, name, None
        )

    def sample(
        self, fn: Callable[[np.random.Generator, np.ndarray, bool], Any], like: Any, name: str | None = None
    ) -> VirtualNode:
        """Declare a constant drawn anew at each build (and in each iteration), e.g. a dropout mask.

        At build time ``fn(rng, like_value, training)`` gives the value; ``rng`` is derived from the
        graph's seed and a build counter, so a sequence of builds is reproducible.
        """
        node = self._as_node(like)
        return VirtualNode(self, "Sample", "sample", (node,), {"fn": fn}, name, self._scope())

    def parameter(
        self,
        name: str,
        shape: Sequence[int] | None = None,
        init: str | initializers.Initializer | np.ndarray | None = None,
        share: bool = False,
        seed: int | None = None,
    ) -> VirtualNode:
        """Declare a trainable parameter.

        Outside loops it is one parameter. Inside a loop body it is, by default, *untied*: each
        iteration path gets its own (e.g. a loop over layers); ``share=True`` ties it, so every
        iteration uses the one parameter (an RNN).

        Args:
            name: unique name, also its key in :attr:`params` and in checkpoints.
            shape: the shape (taken from ``init`` when that is an array).
            init: an initialiser, its name (``"orthogonal"``), or an array to start from. Default:
                ``xavier_uniform`` for 2+ dimensions, zeros otherwise.
            share: tie the parameter across iterations of enclosing loops.
            seed: overrides the graph's seed for this parameter.

        Raises:
            BuildError: a duplicate name, or neither shape nor an array ``init``.
            ShapeError: an array ``init`` whose shape differs from ``shape``.
        """
        if name in self._param_decls:
            raise BuildError(f"the graph already has a parameter named {name!r}")
        if isinstance(init, (np.ndarray, list)) or (np.isscalar(init) and not isinstance(init, str)):
            value = np.array(init, dtype=self.dtype)
            if shape is not None and tuple(shape) != value.shape:
                raise ShapeError(
                    f"parameter {name!r}: init array has shape {value.shape}, declared {tuple(shape)}"
                )
            shape = value.shape
            init_fn: Any = value
        else:
            if shape is None:
                raise BuildError(f"parameter {name!r} needs a shape (or an array as init)")
            shape = tuple(int(s) for s in shape)
            init_fn = initializers.get(init, shape)
        scope = self._scope()
        attrs = {"shape": shape, "init": init_fn, "share": share or scope is None, "seed": seed}
        node = VirtualNode(self, "Parameter", "parameter", (), attrs, name, scope)
        self._param_decls[name] = node
        if attrs["share"]:
            self.params._add(name, self._new_parameter(node, ()))
        return node

    def _new_parameter(self, decl: VirtualNode, idx: tuple[int, ...]) -> ComputeNode:
        attrs = decl.attrs
        init = attrs["init"]
        if isinstance(init, np.ndarray):
            value = init.copy()
        else:
            seed = self.seed if attrs["seed"] is None else attrs["seed"]
            rng = np.random.default_rng([seed, decl.id, *idx])
            value = np.asarray(init(attrs["shape"], rng, self.dtype), dtype=self.dtype)
            if value.shape != attrs["shape"]:
                raise ShapeError(
                    f"{decl.describe(idx)}: initialiser returned shape {value.shape}, expected {attrs['shape']}"
                )
        key = NodeKey("Parameter", decl.id, () if attrs["share"] else idx)
        return ComputeNode(key, value, requires_grad=True, name=_store_name(decl, idx))

    def loop(
        self,
        times: int | None = None,
        while_: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
        max_iters: int = 100_000,
        name: str | None = None,
    ) -> LoopNode:
        """Declare a loop; use it as a ``with`` block holding the body (see :class:`LoopNode`).

        Args:
            times: a fixed number of iterations.
            while_: ``cond(t, state) -> bool`` checked before each iteration on real values
                (``state`` maps carry names to arrays); the loop stops when it is false.
            max_iters: a guard: more iterations than this is a :class:`LoopLimitError`.
            name: a display name.
        """
        if times is not None and (not isinstance(times, (int, np.integer)) or times < 0):
            raise BuildError(f"loop times= must be a non-negative int, got {times!r}")
        return LoopNode(self, None if times is None else int(times), while_, max_iters, name)

    def branch(
        self,
        selector: Callable[..., Any],
        options: Sequence[Any],
        keys: Sequence[Any] = (),
        name: str | None = None,
    ) -> BranchNode:
        """Declare a switch: ``options[selector(*key_values)]`` (see :class:`BranchNode`)."""
        if len(options) < 1:
            raise BuildError("a branch needs at least one option")
        opts = tuple(self._as_node(o) for o in options)
        ks = tuple(self._as_node(k) for k in keys)
        return BranchNode(self, selector, ks, opts, name)

    # -- building
    def _plan(self, outputs: list[VirtualNode]) -> _Plan:
        """The static unrolling plan for ``outputs``, computed once per declared structure.

        Declarations only ever add nodes (and none can be added while a build runs), so the node
        count identifies the structure the plan was made for.
        """
        key = (*outputs, len(self.nodes))
        plan = self._plans.get(key)
        if plan is None:
            if any(k[-1] != len(self.nodes) for k in self._plans):
                self._plans.clear()
            plan = self._plans[key] = _Plan(self, outputs)
        return plan

    def build(self, feed: Mapping[str, Any], outputs: VirtualNode | Sequence[VirtualNode]) -> UnrolledGraph:
        """Unroll for ``feed``; see :func:`build_compute_graph`."""
        from .unroll import build_compute_graph  # unrolling sits above declaring

        return build_compute_graph(self, feed, outputs)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of all parameter values by name, untied copies included (``g.params.state_dict()``)."""
        return self.params.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Set parameter values from ``state`` (name -> array), checking all of it first.

        Names of untied copies (``"W@3"``) not yet in the store are created from ``state``. With
        ``strict``, every parameter in the store must be in ``state``.

        Raises:
            KeyError: unknown or (strict) missing names. ShapeError: a mismatching shape.
        """
        staged: dict[str, np.ndarray] = {}
        new: dict[str, ComputeNode] = {}
        for key, value in state.items():
            base, _, idx_text = key.partition("@")
            decl = self._param_decls.get(base)
            if (
                decl is None
                or (bool(idx_text) == decl.attrs["share"])
                or (idx_text and not _is_iteration_path(idx_text, _depth(decl.scope)))
            ):
                raise KeyError(f"checkpoint has {key!r}, which is not a parameter of this graph")
            arr = np.asarray(value)
            if arr.shape != decl.attrs["shape"]:
                raise ShapeError(
                    f"parameter {key!r}: checkpoint shape {arr.shape}, model shape {decl.attrs['shape']}"
                )
            if arr.dtype.kind != "f":
                raise ShapeError(f"parameter {key!r}: checkpoint dtype {arr.dtype} is not a float dtype")
            staged[key] = arr
            if key not in self.params:
                idx = tuple(int(i) for i in idx_text.split("."))
                new[key] = self._new_parameter(decl, idx)
        missing = [k for k in self.params if k not in staged]
        if strict and missing:
            raise KeyError(f"checkpoint lacks parameters {', '.join(missing)}")
        for key, node in new.items():
            self.params._add(key, node)
        for key, arr in staged.items():
            self.params[key].set_value(arr)
