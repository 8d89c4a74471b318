"""Virtual graphs: declare a dynamic model once, unroll it into a ComputeGraph per input.

A :class:`VirtualGraph` holds :class:`VirtualNode` s (inputs, parameters, constants, ops),
:class:`LoopNode` s and :class:`BranchNode` s. :func:`build_compute_graph` unrolls it for one
feed: every loop iteration becomes real compute nodes keyed ``<type, id, idx>`` (``idx`` = the
iteration path), every branch keeps only the option it selects, and forward values are computed
while unrolling so that loop conditions and branch selectors see real data.

The whole module builds ComputeGraphs through the public API of :mod:`vgraph.compute` only.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import init as initializers
from .compute import ComputeGraph, ComputeNode, NodeKey, _as_value, get_default_dtype, no_grad
from .errors import (
    BuildError,
    FeedError,
    LoopLimitError,
    SelectorError,
    ShapeError,
    StructureChangedError,
)
from .functions import Operand
from .ops import OPS, Op

# ---------------------------------------------------------------------------- nodes

_GETITEM, _STACK = OPS["GetItem"], OPS["Stack"]
_NO_LOOP_VALUE = "{} is a loop, which has no value; use its outputs (loop.final(carry), loop.stack(value))"


class VirtualNode(Operand):
    """A node of a :class:`VirtualGraph`, identified by ``<type, id>``.

    Python operators and ``vgraph`` functions on virtual nodes declare new op nodes in the same
    graph (inside the loop body being declared, if any).

    Attributes:
        graph: the VirtualGraph it belongs to.
        type: its kind (``Input``, ``Parameter``, ``MatMul``, ``Loop`` …).
        id: a per-type counter within its graph.
        name: the user's display name, or ``None``.
        inputs: the virtual nodes it is computed from.
        scope: the :class:`LoopNode` whose body holds it (``None`` at top level).
    """

    __slots__ = ("graph", "type", "id", "name", "inputs", "attrs", "scope", "kind", "op")

    def __init__(
        self,
        graph: VirtualGraph,
        type_: str,
        kind: str,
        inputs: tuple[VirtualNode, ...] = (),
        attrs: dict[str, Any] | None = None,
        name: str | None = None,
        scope: LoopNode | None = None,
    ) -> None:
        self.graph = graph
        self.type = type_
        self.kind = kind  # input parameter constant sample op carry item final stacked loop branch
        self.inputs = inputs
        self.attrs = attrs or {}
        self.name = name
        self.scope = scope
        self.op: Op | None = OPS[type_] if kind == "op" else None  # resolved once, used every build
        self.id = graph._register(self)

    @property
    def key(self) -> tuple[str, int]:
        """``(type, id)``."""
        return (self.type, self.id)

    def describe(self, idx: tuple[int, ...] | None = None) -> str:
        """``<type:id>`` (or ``<type:id@idx>``) and the display name, as in error messages."""
        key = NodeKey(self.type, self.id, idx or ())
        return f"<{key}>" + (f" '{self.name}'" if self.name else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    @property
    def compute_nodes(self) -> dict[tuple[int, ...], ComputeNode]:
        """The compute nodes built from this node in the latest build, keyed by ``idx``."""
        latest = self.graph.latest_build
        return {} if latest is None else latest._copies_of(self)

    def _apply(self, op: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> VirtualNode:
        return self.graph._op(op, inputs, attrs)


class LoopNode(VirtualNode):
    """A loop whose body is a virtual sub-graph, unrolled iteration by iteration.

    Declare it with ``VirtualGraph.loop`` as a ``with`` block. The loop::

        with g.loop(times=n, while_=cond, max_iters=m) as loop:
            x_t = loop.step(xs)              # per-iteration slice of xs (leading axis)
            h = loop.carry(h0, name="h")     # loop-carried state
            h_new = body(h, x_t)
            loop.update(h, h_new)
        h_final = loop.final(h)
        hs = loop.stack(h_new)

    means, in plain Python::

        h, t, collected = h0, 0, []
        while (t < n) and (t < len(xs)) and cond(t, {"h": h}):   # each part only if given
            if t == m: raise LoopLimitError
            x_t = xs[t]
            h_new = body(h, x_t)
            collected.append(h_new)
            h = h_new
            t += 1
        h_final, hs = h, np.stack(collected)

    Every iteration's nodes get ``idx = outer_idx + (t,)``. Both outputs are differentiable.
    """

    __slots__ = ("times", "cond", "max_iters", "carries", "updates", "sequences", "items", "closed", "body")

    def __init__(self, graph: VirtualGraph, times: int | None, cond: Any, max_iters: int, name: str | None):
        super().__init__(graph, "Loop", "loop", (), None, name, graph._scope())
        self.times = times
        self.cond = cond
        self.max_iters = max_iters
        self.carries: list[VirtualNode] = []
        self.updates: dict[VirtualNode, VirtualNode] = {}
        self.sequences: list[VirtualNode] = []
        self.items: list[VirtualNode] = []
        self.body: list[VirtualNode] = []
        self.closed = False

    # -- declaring the body
    def __enter__(self) -> LoopNode:
        if self.closed:
            raise BuildError(f"{self.describe()}: its body is already declared")
        self.graph._scopes.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.graph._scopes.pop()
        self.closed = True
        # The loop depends on everything its body used, including top-level nodes created while
        # the body was declared (constants made from numbers): move it to where it is complete,
        # so that declaration order stays a topological order.
        for nodes in (self.graph.nodes, self.scope.body if self.scope is not None else None):
            if nodes is not None:
                nodes.remove(self)
                nodes.append(self)
        if exc_type is not None:
            return
        missing = [c for c in self.carries if c not in self.updates]
        if missing:
            names = ", ".join(c.describe() for c in missing)
            raise BuildError(
                f"{self.describe()}: carried state {names} never updated; call loop.update(carry, new_value)"
            )
        if self.times is None and self.cond is None and not self.sequences:
            raise BuildError(
                f"{self.describe()} has no stopping rule: give times=, while_=, or step through a "
                "sequence with loop.step(xs)"
            )

    def _check_open(self, what: str) -> None:
        if self.closed or not self.graph._scopes or self.graph._scopes[-1] is not self:
            raise BuildError(f"{self.describe()}: call {what} inside the loop's `with` block")

    def _outside(self, x: Any, what: str) -> VirtualNode:
        node = self.graph._as_node(x)
        if _inside(node.scope, self):
            raise BuildError(
                f"{what} of {self.describe()} must come from outside its body, got {node.describe()}"
            )
        return node

    def carry(self, init: Any, name: str | None = None) -> VirtualNode:
        """Declare loop-carried state starting at ``init``; returns its value at the start of each
        iteration. Set its next value with :meth:`update`."""
        self._check_open("carry()")
        init_node = self._outside(init, "a carry's initial value")
        name = name or f"carry{len(self.carries)}"
        if any(c.name == name for c in self.carries):
            raise BuildError(f"{self.describe()} already has a carry named {name!r}")
        c = VirtualNode(self.graph, "Carry", "carry", (init_node,), None, name, self)
        self.carries.append(c)
        return c

    def update(self, carry: VirtualNode, value: Any) -> None:
        """Declare the value ``carry`` takes at the start of the next iteration."""
        self._check_open("update()")
        if carry.kind != "carry" or carry.scope is not self:
            raise BuildError(f"{carry.describe()} is not a carry of {self.describe()}")
        if carry in self.updates:
            raise BuildError(f"{carry.describe()} is already updated in {self.describe()}")
        self.updates[carry] = self.graph._as_node(value)

    def step(self, sequence: Any, name: str | None = None) -> VirtualNode:
        """Step through ``sequence`` along its leading axis: returns ``sequence[t]`` in iteration t.

        The loop runs at most ``len(sequence)`` iterations; stepped sequences must have equal lengths.
        """
        self._check_open("step()")
        seq = self._outside(sequence, "a stepped sequence")
        item = VirtualNode(self.graph, "Item", "item", (seq,), None, name, self)
        self.sequences.append(seq)
        self.items.append(item)
        return item

    # -- outputs
    def _check_closed(self, what: str) -> None:
        if not self.closed:
            raise BuildError(f"{self.describe()}: use {what} after the loop's `with` block")

    def final(self, carry: VirtualNode, name: str | None = None) -> VirtualNode:
        """The value of ``carry`` after the last iteration (its initial value if none ran)."""
        self._check_closed("final()")
        if carry.kind != "carry" or carry.scope is not self:
            raise BuildError(f"{carry.describe()} is not a carry of {self.describe()}")
        return VirtualNode(self.graph, "Final", "final", (self, carry), None, name or carry.name, self.scope)

    def stack(self, value: VirtualNode, name: str | None = None) -> VirtualNode:
        """The per-iteration values of body node ``value`` stacked along a new leading axis."""
        self._check_closed("stack()")
        if not isinstance(value, VirtualNode) or value.scope is not self:
            raise BuildError(f"loop.stack() takes a node of the body of {self.describe()}")
        return VirtualNode(self.graph, "Stack", "stacked", (self, value), None, name, self.scope)


class BranchNode(VirtualNode):
    """A many-to-one switch: ``selector(*key_values)`` picks which option flows on.

    In plain Python: ``out = options[selector(*[k.value for k in keys])]``. Only the selected
    option is built (per iteration, inside a loop) and only it receives a gradient. The selector
    returns an ``int`` (or ``bool``) in ``range(len(options))``.
    """

    __slots__ = ("selector", "keys", "options")

    def __init__(
        self,
        graph: VirtualGraph,
        selector: Callable[..., Any],
        keys: tuple[VirtualNode, ...],
        options: tuple[VirtualNode, ...],
        name: str | None,
    ):
        super().__init__(graph, "Branch", "branch", (*keys, *options), None, name, graph._scope())
        self.selector = selector
        self.keys = keys
        self.options = options


# ---------------------------------------------------------------------------- parameter store


class ParameterStore(Mapping[str, ComputeNode]):
    """Every parameter of a VirtualGraph by name, as leaf compute nodes shared by all builds.

    A parameter declared outside loops, or with ``share=True``, is one entry (its name). An untied
    parameter declared in a loop body has one entry per iteration path, ``"name@2"`` or
    ``"name@1.3"``, created (and initialised) the first time a build reaches that iteration.
    Optimisers update the nodes' values in place; compute graphs see the new values.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, ComputeNode] = {}

    def __getitem__(self, name: str) -> ComputeNode:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r}; known: {', '.join(self._nodes) or 'none'}") from None

    def __iter__(self):
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def parameters(self) -> list[ComputeNode]:
        """The parameter nodes, in creation order (what optimisers take)."""
        return list(self._nodes.values())

    def value(self, name: str) -> np.ndarray:
        """A copy of a parameter's value."""
        return np.array(self[name].value)

    def set_value(self, name: str, value: Any) -> None:
        """Set one parameter's value (same shape; cast to its dtype).

        Raises:
            KeyError: unknown name. ShapeError: a different shape.
        """
        self[name].set_value(np.array(value))

    def zero_grad(self) -> None:
        """Clear every parameter's ``.grad``."""
        for p in self._nodes.values():
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of all values by name (what a checkpoint holds)."""
        return {k: np.array(p.value) for k, p in self._nodes.items()}

    def _add(self, name: str, node: ComputeNode) -> None:
        self._nodes[name] = node


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
        return build_compute_graph(self, feed, outputs)

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


# ---------------------------------------------------------------------------- unrolling


@dataclass(frozen=True)
class Decision:
    """A data-dependent structural decision made while unrolling.

    Attributes:
        node: the loop or branch.
        idx: the iteration path it was made in.
        kind: ``"iterations"`` (a loop's trip count) or ``"option"`` (a branch's choice).
        value: the trip count or the chosen option index.
    """

    node: VirtualNode
    idx: tuple[int, ...]
    kind: str
    value: int


class UnrolledGraph(ComputeGraph):
    """The ComputeGraph of one unrolled VirtualGraph, with its outputs and decisions.

    Everything of :class:`ComputeGraph` works on it; in addition, methods that take nodes also
    accept the virtual nodes they were built from, ``node(vnode, idx)`` finds any copy, and
    ``feed`` sets new input values by name for a re-run forward (dirty-checked, with every
    recorded decision re-checked).
    """

    def __init__(self, virtual: VirtualGraph) -> None:
        super().__init__(virtual.dtype)
        self.virtual = virtual
        self.outputs: list[ComputeNode] = []
        self.decisions: list[Decision] = []
        self.inputs: dict[str, ComputeNode] = {}
        self._envs: dict[tuple[LoopNode | None, tuple[int, ...]], dict[VirtualNode, ComputeNode]] = {}

    def _copies_of(self, v: VirtualNode) -> dict[tuple[int, ...], ComputeNode]:
        return {idx: env[v] for (scope, idx), env in self._envs.items() if scope is v.scope and v in env}

    def node(self, what: Any, idx: tuple[int, ...] = ()) -> ComputeNode:
        """The compute node for a key (as in ComputeGraph), or for virtual node ``what`` in
        iteration path ``idx``.

        Raises:
            BuildError: ``what`` was not built at ``idx`` in this graph.
        """
        if not isinstance(what, VirtualNode):
            return super().node(what)
        idx = tuple(idx)
        env = self._envs.get((what.scope, idx))
        if env is None or what not in env:
            raise BuildError(
                f"{what.describe(idx)} was not built in this graph (not needed, or no such iteration)"
            )
        return env[what]

    def _resolve(self, x: Any) -> Any:
        if isinstance(x, VirtualNode):
            return self.node(x)
        if isinstance(x, (list, tuple)):
            return [self._resolve(y) for y in x]
        return x

    def forward(self, target: Any = None, explain: bool = False) -> Any:
        """:meth:`ComputeGraph.forward`; ``target`` defaults to the build's outputs (one value for a
        single output, else a list) and may be given as virtual nodes."""
        if target is None:
            target = self.outputs[0] if len(self.outputs) == 1 else self.outputs
        return super().forward(self._resolve(target), explain)

    def backward_ex(self, loss: Any, seed: Any = None, retain_graph: bool = False) -> float | None:
        return super().backward_ex(self._resolve(loss), seed, retain_graph)

    def grad(
        self, outputs: Any, inputs: Any, seeds: Any = None, retain_graph: bool = False
    ) -> list[np.ndarray]:
        return super().grad(self._resolve(outputs), self._resolve(inputs), seeds, retain_graph)

    def feed(self, values: Mapping[str, Any]) -> None:
        """Give inputs new values by name (checked like a build's feed); then call ``forward``.

        Raises:
            FeedError: unknown names, names this graph did not use, or shapes that do not match.
        """
        staged = {}
        for name, value in values.items():
            decl = self.virtual._inputs.get(name)
            if decl is None or name not in self.inputs:
                raise FeedError(f"this graph has no input {name!r}; its inputs: {', '.join(self.inputs)}")
            staged[name] = _check_feed_value(decl, value, self.dtype)
        for name, arr in staged.items():
            self.inputs[name].set_value(arr)

    def trip_count(self, loop: LoopNode, idx: tuple[int, ...] = ()) -> int:
        """How many iterations ``loop`` ran in iteration path ``idx``."""
        return self._decision(loop, idx, "iterations")

    def choice(self, branch: BranchNode, idx: tuple[int, ...] = ()) -> int:
        """Which option ``branch`` selected in iteration path ``idx``."""
        return self._decision(branch, idx, "option")

    def _decision(self, node: VirtualNode, idx: tuple[int, ...], kind: str) -> int:
        for d in self.decisions:
            if d.node is node and d.idx == tuple(idx) and d.kind == kind:
                return d.value
        raise BuildError(f"{node.describe(tuple(idx))} was not built in this graph")


def _store_name(decl: VirtualNode, idx: tuple[int, ...]) -> str:
    """A parameter's name in the store: its declared name, plus ``@idx`` for an untied copy."""
    return decl.name if decl.attrs["share"] else f"{decl.name}@{'.'.join(map(str, idx))}"


def _check_feed_value(decl: VirtualNode, value: Any, dtype: np.dtype) -> np.ndarray:
    try:
        # a copy: the graph must not see the caller's later in-place changes (no version bump)
        arr = np.array(_as_value(value, dtype))
    except TypeError as e:
        raise FeedError(f"input {decl.name!r}: {e}") from None
    shape = decl.attrs["shape"]
    if shape is not None and (
        arr.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, arr.shape))
    ):
        declared = "(" + ", ".join("None" if s is None else str(s) for s in shape) + ")"
        raise FeedError(f"input {decl.name!r} {decl.describe()}: fed shape {arr.shape}, declared {declared}")
    return arr


def _depth(scope: LoopNode | None) -> int:
    """How many loops enclose a node of ``scope``."""
    n = 0
    while scope is not None:
        n, scope = n + 1, scope.scope
    return n


def _is_iteration_path(text: str, depth: int) -> bool:
    """Whether ``text`` is an iteration path as untied parameter names print it (``"3"``, ``"1.2"``)
    with ``depth`` levels."""
    parts = text.split(".")
    return len(parts) == depth and all(p.isdigit() and str(int(p)) == p for p in parts)


def _inside(scope: LoopNode | None, loop: LoopNode) -> bool:
    while scope is not None:
        if scope is loop:
            return True
        scope = scope.scope
    return False


def _captures(loop: LoopNode) -> list[VirtualNode]:
    """Nodes outside ``loop`` that its body (including nested bodies) uses."""
    seen: dict[VirtualNode, None] = {}
    for u in loop.updates.values():  # loop.update(carry, x) with x from outside the body
        if not _inside(u.scope, loop):
            seen[u] = None
    for v in loop.graph.nodes:
        if _inside(v.scope, loop):
            deps = v.inputs if v.kind != "loop" else [*(c.inputs[0] for c in v.carries), *v.sequences]
            if v.kind == "carry":
                deps = ()
            for d in (*deps, *(v.updates.values() if v.kind == "loop" else ())):
                if not _inside(d.scope, loop) and d is not loop:
                    seen[d] = None
    return list(seen)


class _Plan:
    """Static per-build facts about a VirtualGraph: what each scope builds eagerly and in what order."""

    def __init__(self, graph: VirtualGraph, outputs: Sequence[VirtualNode]) -> None:
        self.captures: dict[LoopNode, list[VirtualNode]] = {}
        self.stacked: dict[LoopNode, list[VirtualNode]] = {}
        self.finals: dict[LoopNode, list[VirtualNode]] = {}
        self.eager: dict[LoopNode | None, list[VirtualNode]] = {}
        needed: set[VirtualNode] = set()
        # Everything reachable from the outputs, through all branch options (for feed checks).
        stack = list(outputs)
        while stack:
            v = stack.pop()
            if v in needed:
                continue
            needed.add(v)
            if v.kind == "loop":
                caps = self.captures.setdefault(v, _captures(v))
                stack.extend((*caps, *(c.inputs[0] for c in v.carries), *v.sequences, *v.updates.values()))
            elif v.kind == "stacked":
                self.stacked.setdefault(v.inputs[0], []).append(v)
                stack.extend(v.inputs)
            elif v.kind == "final":
                self.finals.setdefault(v.inputs[0], []).append(v)
                stack.extend(v.inputs)
            else:
                stack.extend(v.inputs)
        self.needed = needed
        # Per scope, the nodes built eagerly (not only through a branch option), in declaration order.
        # A body marks only nodes of its own scope: what it uses from enclosing scopes is a
        # dependency of the loop node, built on demand when the loop runs (so a loop reached only
        # through an unchosen option builds nothing outside it either).
        eager: set[VirtualNode] = set()
        roots: list[VirtualNode] = list(outputs)
        for loop in self.captures:
            roots.extend(u for u in loop.updates.values() if u.scope is loop)
            roots.extend(s.inputs[1] for s in self.stacked.get(loop, ()))
        stack = roots
        while stack:
            v = stack.pop()
            if v in eager:
                continue
            eager.add(v)
            if v.kind not in ("carry", "item"):
                stack.extend(d for d in self.deps(v) if d.scope is v.scope)
        for v in graph.nodes:
            if v in eager and v.kind not in ("carry", "item"):
                self.eager.setdefault(v.scope, []).append(v)

    def deps(self, v: VirtualNode) -> Sequence[VirtualNode]:
        """What must be built before ``v`` (branch options excluded: they are built on demand)."""
        kind = v.kind
        if kind == "branch":
            return v.keys
        if kind == "loop":
            return [*(c.inputs[0] for c in v.carries), *v.sequences, *self.captures[v]]
        if kind in ("final", "stacked"):
            return (v.inputs[0],)
        return v.inputs


class _Frame:
    """The compute nodes of one scope in one iteration path."""

    __slots__ = ("scope", "idx", "env", "parent")

    def __init__(self, scope: LoopNode | None, idx: tuple[int, ...], env: dict, parent: _Frame | None):
        self.scope = scope
        self.idx = idx
        self.env = env
        self.parent = parent

    def owner(self, v: VirtualNode) -> _Frame:
        f = self
        while f.scope is not v.scope:
            f = f.parent
        return f


class _Builder:
    def __init__(self, graph: VirtualGraph, feed: Mapping[str, np.ndarray], plan: _Plan):
        self.graph = graph
        self.feed = feed
        self.plan = plan
        self.cg = UnrolledGraph(graph)
        self.new_params: dict[str, ComputeNode] = {}
        self.rng = np.random.default_rng([graph.seed, graph._builds])

    # -- building one node whose dependencies are built
    def build_node(self, v: VirtualNode, frame: _Frame) -> None:
        env = frame.env
        kind = v.kind
        cg = self.cg
        if kind == "op":
            env[v] = cg._add_op(
                v.op, tuple([env[i] for i in v.inputs]), v.attrs, NodeKey(v.type, v.id, frame.idx), v.name
            )
        elif kind == "parameter":
            env[v] = cg.add_leaf(self.parameter(v, frame.idx))
        elif kind == "input":
            node = cg.input(self.feed[v.name], v.name, NodeKey("Input", v.id, ()))
            cg.inputs[v.name] = node
            env[v] = node
        elif kind == "constant":
            env[v] = cg.constant(v.attrs["value"], v.name, NodeKey("Constant", v.id, ()))
        elif kind == "sample":
            value = v.attrs["fn"](self.rng, env[v.inputs[0]].value, self.graph.training)
            env[v] = cg.constant(value, v.name, NodeKey("Sample", v.id, frame.idx))
        elif kind == "loop":
            self.run_loop(v, frame)
        elif kind == "branch":
            self.run_branch(v, frame)
        elif kind == "stacked":  # a loop sets its outputs when it runs, a stack only if it iterated
            loop, idx = v.inputs[0], frame.idx
            raise BuildError(f"{v.describe(idx)}: {loop.describe(idx)} ran no iteration, nothing to stack")
        elif kind == "final":
            raise AssertionError(f"{v.describe(frame.idx)}: a loop sets its outputs when it runs")
        else:  # carry and item nodes are set at the start of each iteration
            raise AssertionError(f"unexpected {v.kind} node {v.describe()}")

    def parameter(self, v: VirtualNode, idx: tuple[int, ...]) -> ComputeNode:
        if v.attrs["share"]:
            return self.graph.params[v.name]
        name = _store_name(v, idx)
        node = self.graph.params._nodes.get(name) or self.new_params.get(name)
        if node is None:  # first time this iteration path is reached: initialise now
            node = self.new_params[name] = self.graph._new_parameter(v, idx)
        return node

    def demand(self, target: VirtualNode, frame: _Frame) -> ComputeNode:
        """Build ``target`` and whatever it needs that is not built yet (iteratively)."""
        stack = [target]
        while stack:
            v = stack[-1]
            f = frame.owner(v)
            if v in f.env:
                stack.pop()
                continue
            missing = [d for d in self.plan.deps(v) if d not in frame.owner(d).env]
            if missing:
                stack.extend(missing)
                continue
            self.build_node(v, f)
            stack.pop()
        return frame.owner(target).env[target]

    def run_scope(self, frame: _Frame) -> None:
        # Declaration order is topological (see LoopNode.__exit__), and a body's env starts with
        # its captures, so every dependency is built by the time a node's turn comes.
        env, idx, add_op = frame.env, frame.idx, self.cg._add_op
        for v in self.plan.eager.get(frame.scope, ()):
            op = v.op
            if op is not None:  # the hot path: most nodes are ops
                env[v] = add_op(
                    op, tuple([env[i] for i in v.inputs]), v.attrs, NodeKey(v.type, v.id, idx), v.name
                )
            elif v not in env:  # loop outputs are already set by their loop
                self.build_node(v, frame)

    # -- control flow
    def run_loop(self, loop: LoopNode, frame: _Frame) -> None:
        cg = self.cg
        env = frame.env
        idx = frame.idx
        state = [frame.owner(c.inputs[0]).env[c.inputs[0]] for c in loop.carries]
        seqs = [frame.owner(s).env[s] for s in loop.sequences]
        length = None
        for s, node in zip(loop.sequences, seqs):
            if node.value.ndim == 0:
                raise ShapeError(f"{loop.describe(idx)}: cannot step through {s.describe()}, a scalar")
            n = node.value.shape[0]
            if length is not None and n != length:
                raise ShapeError(
                    f"{loop.describe(idx)}: stepped sequences have different lengths {length} and {n}"
                )
            length = n
        if seqs:
            cg.guard(seqs, _length_check(loop, idx, length), NodeKey("LengthCheck", loop.id, idx))
        captured = {c: frame.owner(c).env[c] for c in self.plan.captures[loop]}
        stacked = self.plan.stacked.get(loop, [])
        collected: list[list[ComputeNode]] = [[] for _ in stacked]
        names = [c.name for c in loop.carries]
        t = 0
        while True:
            if loop.times is not None and t >= loop.times:
                break
            if length is not None and t >= length:
                break
            if loop.cond is not None:
                go = _run_cond(loop, idx, t, names, [s.value for s in state])
                cg.guard(
                    state, _cond_check(loop, idx, t, names, go), NodeKey("LoopCheck", loop.id, (*idx, t))
                )
                if not go:
                    break
            if t >= loop.max_iters:
                raise LoopLimitError(
                    f"{loop.describe(idx)} reached max_iters={loop.max_iters} and would go on; raise "
                    "max_iters if that many iterations are intended, or check the loop's condition"
                )
            inner = _Frame(loop, (*idx, t), dict(captured), frame)
            ienv = inner.env
            for c, node in zip(loop.carries, state):
                ienv[c] = node
            for item, node in zip(loop.items, seqs):
                ienv[item] = cg._add_op(
                    _GETITEM, (node,), {"index": t}, NodeKey("Item", item.id, inner.idx), item.name
                )
            self.run_scope(inner)
            cg._envs[(loop, inner.idx)] = ienv
            state = [ienv[loop.updates[c]] for c in loop.carries]
            for bucket, s in zip(collected, stacked):
                bucket.append(ienv[s.inputs[1]])
            t += 1
        cg.decisions.append(Decision(loop, idx, "iterations", t))
        env[loop] = None  # the loop itself has no value; its outputs do
        for v in self.plan.finals.get(loop, ()):
            env[v] = state[loop.carries.index(v.inputs[1])]
        for s, bucket in zip(stacked, collected):
            if not bucket:  # an error only if the stack is used: see build_node
                continue
            env[s] = cg._add_op(_STACK, tuple(bucket), {"axis": 0}, NodeKey("Stack", s.id, idx), s.name)

    def run_branch(self, branch: BranchNode, frame: _Frame) -> None:
        idx = frame.idx
        keys = [frame.owner(k).env[k] for k in branch.keys]
        choice = _select(branch, idx, [k.value for k in keys])
        option = self.demand(branch.options[choice], frame)
        self.cg.decisions.append(Decision(branch, idx, "option", choice))

        def forward(x: np.ndarray, *key_values: np.ndarray) -> np.ndarray:
            now = _select(branch, idx, key_values)
            if now != choice:
                raise StructureChangedError(
                    f"{branch.describe(idx)} would now select option {now}, but this graph was built "
                    f"with option {choice}; rebuild the compute graph for the new inputs"
                )
            return x

        op = Op("Branch", forward, (lambda g, ans, x, *k: g, *([None] * len(keys))), arity=1 + len(keys))
        frame.env[branch] = self.cg.apply(
            op, [option, *keys], None, NodeKey("Branch", branch.id, idx), branch.name
        )


def _select(branch: BranchNode, idx: tuple[int, ...], values: Sequence[np.ndarray]) -> int:
    choice = branch.selector(*values)
    if isinstance(choice, (bool, np.bool_)):
        choice = int(choice)
    if not isinstance(choice, (int, np.integer)):
        raise SelectorError(
            f"{branch.describe(idx)}: the selector returned {choice!r} ({type(choice).__name__}); "
            f"it must return an int in range({len(branch.options)})"
        )
    if not 0 <= choice < len(branch.options):
        raise SelectorError(
            f"{branch.describe(idx)}: the selector returned {choice}, but there are only "
            f"{len(branch.options)} options (valid: 0..{len(branch.options) - 1})"
        )
    return int(choice)


def _run_cond(
    loop: LoopNode, idx: tuple[int, ...], t: int, names: list[str], values: list[np.ndarray]
) -> bool:
    result = loop.cond(t, dict(zip(names, values)))
    try:
        return bool(result)
    except ValueError:
        raise BuildError(
            f"{loop.describe(idx)}: the while_ condition returned an array of shape {np.shape(result)} at "
            f"iteration {t}; it must return one bool (use .all() or .any())"
        ) from None


def _cond_check(loop: LoopNode, idx: tuple[int, ...], t: int, names: list[str], expected: bool):
    def check(*values: np.ndarray) -> bool:
        now = _run_cond(loop, idx, t, names, list(values))
        if now != expected:
            raise StructureChangedError(
                f"{loop.describe(idx)}: at iteration {t} the condition is now {now} (was {expected}), so the "
                "loop would run a different number of iterations; rebuild the compute graph for the new inputs"
            )
        return now

    return check


def _length_check(loop: LoopNode, idx: tuple[int, ...], length: int):
    def check(*values: np.ndarray) -> int:
        for seq, value in zip(loop.sequences, values):
            if np.ndim(value) == 0 or value.shape[0] != length:
                raise StructureChangedError(
                    f"{loop.describe(idx)} steps through {seq.describe()}, whose length is now "
                    f"{np.shape(value)[:1]} (was {length}); rebuild the compute graph for the new inputs"
                )
        return length

    return check


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector while unrolling.

    A build allocates many long-lived objects, which would trigger repeated collections that
    traverse the whole growing graph and find nothing: compute graphs hold no reference cycles
    (nodes refer to their graph weakly). Restored on exit, also on errors.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_compute_graph(
    graph: VirtualGraph, feed: Mapping[str, Any], outputs: VirtualNode | Sequence[VirtualNode]
) -> UnrolledGraph:
    """Unroll ``graph`` for the values in ``feed`` into a new :class:`UnrolledGraph`.

    Demand-driven from ``outputs``: only what they need is built, and a branch builds only the
    option it selects. Values are computed while unrolling. Untied parameters seen for the first
    time are initialised and added to ``graph.params`` — only if the whole build succeeds; on any
    error the virtual graph and its parameter store are left unchanged.

    ``graph.latest_build`` (what ``vnode.compute_nodes`` reads) is released when a build starts,
    so a previous graph nobody else holds is freed before the new values are allocated. In a
    training loop, drop your own reference too (``del cg`` at the end of a step) to get the same
    benefit; peak memory is then one graph, not two.

    Args:
        graph: the model.
        feed: a value for each input the outputs need, by input name.
        outputs: top-level virtual nodes to build.

    Returns:
        The unrolled graph; ``cg.outputs`` holds the outputs' compute nodes.

    Raises:
        FeedError: missing inputs (all listed), unknown names, shapes that differ from the declared.
        BuildError: an output inside a loop body, a body not closed, a loop that ran zero iterations
            but must stack values.
        LoopLimitError, SelectorError, ShapeError: while unrolling, naming ``<type,id,idx>``.
    """
    outs = [outputs] if isinstance(outputs, VirtualNode) else list(outputs)
    if not outs:
        raise BuildError("build_compute_graph needs at least one output")
    for o in outs:
        if not isinstance(o, VirtualNode) or o.graph is not graph:
            raise BuildError(f"output {o!r} is not a node of this VirtualGraph")
        if o.kind == "loop":
            raise BuildError(f"output {_NO_LOOP_VALUE.format(o.describe())}")
        if o.scope is not None:
            raise BuildError(
                f"output {o.describe()} is inside the body of {o.scope.describe()}; use the loop's "
                "outputs (loop.final(carry), loop.stack(value))"
            )
    if graph._scopes:
        raise BuildError(f"{graph._scopes[-1].describe()}: its `with` block is still open")
    plan = graph._plan(outs)

    needed_inputs = [v for v in graph.nodes if v.kind == "input" and v in plan.needed]
    unknown = sorted(set(feed) - set(graph._inputs))
    if unknown:
        raise FeedError(
            f"unknown input name(s) {', '.join(map(repr, unknown))}; inputs: {', '.join(graph._inputs)}"
        )
    missing = [v.describe() for v in needed_inputs if v.name not in feed]
    if missing:
        raise FeedError(f"missing feed for input(s) {', '.join(missing)}, needed by the requested outputs")
    values = {v.name: _check_feed_value(v, feed[v.name], graph.dtype) for v in needed_inputs}

    # Let go of the previous build before computing this one's values: if nothing else holds it,
    # it is freed now and its memory is reused warm, instead of this build faulting in fresh pages
    # while both are alive. A weak reference restores it if this build fails (and it still exists).
    previous = weakref.ref(graph.latest_build) if graph.latest_build is not None else None
    graph.latest_build = None
    try:
        builder = _Builder(graph, values, plan)
        top = _Frame(None, (), {}, None)
        with contextlib.nullcontext() if graph.training else no_grad(), _gc_paused():
            builder.run_scope(top)
    except BaseException:
        graph.latest_build = previous() if previous is not None else None
        raise
    cg = builder.cg
    cg._envs[(None, ())] = top.env
    cg.outputs = [top.env[o] for o in outs]
    for name, node in builder.new_params.items():  # commit only after success
        graph.params._add(name, node)
    graph.latest_build = cg
    graph._builds += 1
    return cg
