"""Declaring: :class:`VirtualGraph`, the model declared once, to be unrolled per input."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

import numpy as np

from .. import init as initializers
from ..compute import (
    ComputeNode,
    NodeKey,
    _as_value,
    flag_arg,
    float_dtype,
    get_default_dtype,
    sparse_grad_arg,
)
from ..errors import BuildError, ShapeError
from ..functions import Operand
from ..modes import int_arg
from ..ops import OPS
from .cache import BuildCache
from .checkpoint import schedule_arg
from .nodes import _NO_LOOP_VALUE, BranchNode, LoopNode, VirtualNode, _declared_name, _depth
from .plan import _Plan
from .store import ParameterStore, _is_iteration_path, _store_name

if TYPE_CHECKING:
    from .unrolled import UnrolledGraph

_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_build_at_a_time(
    fn: Callable[Concatenate[VirtualGraph, _P], _R],
) -> Callable[Concatenate[VirtualGraph, _P], _R]:
    """Decorate a build function whose first argument is the VirtualGraph it builds: builds of one
    graph then run one at a time, whatever thread calls them (a later one waits for the running
    one; builds of different graphs run side by side).

    A build reads and updates what every build of the graph shares: the parameter store (untied
    copies are created by the first build that reaches them), the build counter that seeds sampled
    nodes, the plans, :attr:`VirtualGraph.latest_build`. The lock is re-entrant: a build started
    from a loop condition or a selector of the same graph in the same thread proceeds.
    """

    @functools.wraps(fn)
    def run(graph: VirtualGraph, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        lock = getattr(graph, "_build_lock", None)
        if lock is None:  # not a VirtualGraph: the build reports it
            return fn(graph, *args, **kwargs)
        with lock:
            return fn(graph, *args, **kwargs)

    return run


# ---------------------------------------------------------------------------- the virtual graph


class VirtualGraph:
    """A model declared once, with loops and branches, to be unrolled per input.

    Args:
        dtype: the float dtype of parameters and values (default :func:`get_default_dtype`).
        seed: seeds every parameter's initialiser; each parameter (and each untied copy) draws from
            its own generator derived from ``(seed, parameter id, idx)``, so initial values do not
            depend on build order.
        name: a display name.

    Raises:
        TypeError: ``seed`` is not an int, or ``dtype`` is not a float dtype.
        ValueError: ``seed`` is negative.
    """

    def __init__(self, dtype: Any = None, seed: int = 0, name: str | None = None) -> None:
        self.dtype = (
            float_dtype(dtype, "VirtualGraph(dtype=...)") if dtype is not None else get_default_dtype()
        )
        self.seed = int_arg(seed, "VirtualGraph(seed=...)", 0)
        self.name = name
        self.nodes: list[VirtualNode] = []  # in a topological order (declaration order)
        self.params = ParameterStore(self._untied_copy, self._declared_spec)
        self.latest_build: UnrolledGraph | None = None
        self._counters: dict[str, int] = {}
        self._scopes: list[LoopNode] = []
        self._inputs: dict[str, VirtualNode] = {}
        self._param_decls: dict[str, VirtualNode] = {}
        self._builds = 0  # seeds the generator of sampled nodes, build after build
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._cache = BuildCache()
        self._build_lock = threading.RLock()  # see one_build_at_a_time
        self.training = True

    def __repr__(self) -> str:
        """A summary like PyTorch's module print: inputs, parameters (shape, tied or untied),
        loops (carries, stepped sequences, stopping rule), branches."""
        head = f"VirtualGraph{' ' + repr(self.name) if self.name else ''}"
        lines = [
            f"{head} ({self.dtype}, seed {self.seed}, {'training' if self.training else 'eval'}, {len(self.nodes)} nodes)"
        ]
        if self._inputs:
            lines.append("  inputs:")
            for name, v in self._inputs.items():
                shape = v.attrs["shape"]
                text = (
                    "any shape"
                    if shape is None
                    else "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"
                )
                lines.append(
                    f"    {name}: {text}" + (", requires_grad" if v.attrs.get("requires_grad") else "")
                )
        if self._param_decls:
            lines.append("  parameters:")
            for name, v in self._param_decls.items():
                shape = v.attrs["shape"]
                if v.attrs["share"]:
                    where = f", tied across {v.scope.describe()}" if v.scope is not None else ""
                    lines.append(f"    {name}: {shape}{where}")
                else:
                    copies = sum(1 for k in self.params if k.partition("@")[0] == name)
                    scope = cast(LoopNode, v.scope)  # untied: in a loop (share is forced at top level)
                    lines.append(
                        f"    {name}: {shape}, untied in {scope.describe()} ({copies} copies so far)"
                    )
        for v in self.nodes:
            if isinstance(v, LoopNode):
                rule = []
                if v.structure is not None:
                    rule.append(f"recurses over {v.structure.describe()}")
                if v.times is not None:
                    rule.append(f"times={v.times}")
                rule += [f"steps through {s.describe()}" for s in v.sequences]
                if v.cond is not None:
                    rule.append("while_")
                if v.until is not None:
                    rule.append("until")
                carries = ", ".join(c.name or c.describe() for c in v.carries) or "none"
                lines.append(
                    f"  {v.describe()}: {'; '.join(rule)}; carries {carries}; {len(v.body)} body nodes"
                )
            elif isinstance(v, BranchNode) and v.lead is None:
                keys = ", ".join(k.describe() for k in v.keys) or "no keys"
                lines.append(f"  {v.describe()}: {len(v.options)} options, selector on {keys}")
        return "\n".join(lines)

    @property
    def build_count(self) -> int:
        """How many builds of this graph have completed. It seeds the random generator of sampled
        nodes (dropout masks) build after build, so a training state saves it and resuming
        restores it (``vgraph.io``), and data-parallel training offsets it per rank
        (``vgraph.distributed``)."""
        return self._builds

    @build_count.setter
    def build_count(self, count: int) -> None:
        self._builds = int_arg(count, "build_count", 0)

    @property
    def cache_size(self) -> int:
        """How many unrolled graphs the build cache keeps (see :mod:`vgraph.virtual.cache`);
        ``0`` turns caching off. Default 4."""
        return self._cache.size

    @cache_size.setter
    def cache_size(self, size: int) -> None:
        size = int_arg(size, "cache_size", 0)
        with self._build_lock:  # (every thread's cache, none of them in use)
            self._cache.resize(size)

    def train(self, mode: bool = True) -> None:
        """Switch to training mode (the default), or to evaluation mode with ``mode=False``.

        In training mode builds record what backward needs and sampled nodes (e.g. dropout masks)
        are drawn. The mode applies to later builds; :attr:`training` tells the current one.

        Unlike PyTorch's ``Module.train``, this returns ``None``, as Python's in-place methods do
        (``list.sort``): a graph returned here would be drawn whole by Jupyter when the call ends
        a notebook cell.

        Args:
            mode: ``True`` for training, ``False`` for evaluation.

        Raises:
            ArgumentError: ``mode`` is not a bool (a TypeError).
        """
        self.training = flag_arg(mode, "train(mode=...)")

    def eval(self) -> None:
        """Switch to evaluation mode (``train(False)``): later builds record nothing for backward
        (as under ``no_grad``) and sampled nodes take their evaluation value (dropout passes
        values through). Returns ``None``, like :meth:`train`."""
        self.train(False)

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
        if (
            x.kind == "carry"
            and cast(LoopNode, x.scope).structure is not None  # a carry is declared in its loop's body
            and self._scopes
            and self._scopes[-1] is x.scope
        ):
            raise BuildError(
                f"{x.describe()} is a recursion's state: read it at the children with child({x.name!r} "
                "state, j); set it at the current node with update()"
            )
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
    def input(
        self, name: str, shape: Sequence[int | None] | None = None, requires_grad: bool = False
    ) -> VirtualNode:
        """Declare an input fed by name at build time.

        Args:
            name: the feed key (unique in the graph).
            shape: the expected shape, ``None`` for any size on an axis (e.g. ``(None, None, 8)``
                for ``(time, batch, features)``); ``None`` for any shape.
            requires_grad: backward computes the gradient with respect to this input too (in
                ``cg.inputs[name].grad``, or ``cg.grad(loss, [cg.inputs[name]])``), e.g. for
                saliency maps or adversarial examples.

        Raises:
            TypeError: a name that is not a non-empty str, or a shape that is not ints or None.
            BuildError: the name is taken.
        """
        _name_arg(name, "input")
        if name in self._inputs:
            raise BuildError(f"the graph already has an input named {name!r}")
        if shape is not None:
            shape = _shape_arg(shape, f"input {name!r}", allow_none=True)
        attrs = {"shape": shape, "requires_grad": bool(requires_grad)}
        node = VirtualNode(self, "Input", "input", (), attrs, name, None)
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
        if not callable(fn):
            raise TypeError(f"sample(): fn must be callable as fn(rng, like_value, training), got {fn!r}")
        node = self._as_node(like)
        return VirtualNode(self, "Sample", "sample", (node,), {"fn": fn}, name, self._scope())

    def parameter(
        self,
        name: str,
        shape: Sequence[int] | None = None,
        init: str | initializers.Initializer | np.ndarray | None = None,
        share: bool | None = None,
        seed: int | None = None,
        sparse_grad: bool = False,
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
            share: tie the parameter across iterations of enclosing loops. Default: untied in a
                loop body (a loop over layers), tied in a recursion body (see :meth:`recurse`).
            seed: overrides the graph's seed for this parameter.
            sparse_grad: for a 2-D table whose rows are looked up (an embedding): backward gives
                its ``.grad`` as a :class:`~vgraph.ops.RowSparseGrad` with only the rows looked
                up (see docs/training.md, "Sparse embedding gradients"). Default: dense.

        Raises:
            BuildError: a duplicate name, a name containing ``@`` (reserved for untied copies,
                ``W@3``), neither shape nor an array ``init``, or an initialiser that fails.
            ShapeError: an array ``init`` whose shape differs from ``shape``, or an initialiser
                that returns another shape, or ``sparse_grad=True`` for a shape that is not 2-D.
            TypeError: a shape that is not a sequence of ints, a ``sparse_grad`` that is not a bool, an ``init`` that is not an
                initialiser, a name, or an array, or a ``seed`` that is not an int.
            ValueError: a negative dimension or seed, or an unknown initialiser name.

        The declaration is checked completely (including one call of the initialiser) before
        anything is registered: a failed call leaves the graph as it was.
        """
        _name_arg(name, "parameter")
        if "@" in name:
            raise BuildError(
                f"parameter name {name!r} contains '@', which names untied copies in the store and in "
                "checkpoints (W@3 is the copy of W for iteration 3): choose another name"
            )
        if name in self._param_decls:
            raise BuildError(f"the graph already has a parameter named {name!r}")
        if seed is not None:
            seed = int_arg(seed, f"parameter {name!r}: seed", 0)
        if isinstance(init, (np.ndarray, list, tuple)) or (np.isscalar(init) and not isinstance(init, str)):
            try:
                value = np.array(_as_value(init, self.dtype), dtype=self.dtype)
            except (TypeError, ValueError) as e:
                raise TypeError(f"parameter {name!r}: init= is not a numeric array: {e}") from None
            if shape is not None and _shape_arg(shape, f"parameter {name!r}") != value.shape:
                raise ShapeError(
                    f"parameter {name!r}: init array has shape {value.shape}, declared {tuple(shape)}"
                )
            shape = value.shape
            init_fn: Any = value
        else:
            if shape is None:
                raise BuildError(f"parameter {name!r} needs a shape (or an array as init)")
            shape = _shape_arg(shape, f"parameter {name!r}")
            if init is not None and not isinstance(init, str) and not callable(init):
                raise TypeError(
                    f"parameter {name!r}: init= must be an initialiser (callable as init(shape, rng, "
                    f"dtype)), an initialiser's name, or an array; got {type(init).__name__}"
                )
            init_fn = initializers.get(init, shape)
        sparse = sparse_grad_arg(sparse_grad, shape, f"parameter {name!r}")
        scope = self._scope()
        if share is None:
            share = scope is not None and scope.structure is not None
        attrs = {"shape": shape, "init": init_fn, "share": bool(share) or scope is None, "seed": seed}
        if sparse:
            attrs["sparse_grad"] = True
        pid = self._counters.get("Parameter", 0) + 1  # the id the node will get
        # Run the initialiser once now (for an untied parameter, as its first copy would), so
        # that a failing one is reported here and not half-way through a build.
        first = self._initial_value(name, attrs, pid, () if attrs["share"] else (0,) * _depth(scope))
        node = VirtualNode(self, "Parameter", "parameter", (), attrs, name, scope)
        self._param_decls[name] = node
        if attrs["share"]:
            leaf = ComputeNode(NodeKey("Parameter", pid, ()), first, requires_grad=True, name=name)
            leaf.sparse_grad = sparse
            self.params._add(name, leaf)
        return node

    def _initial_value(self, name: str, attrs: dict[str, Any], pid: int, idx: tuple[int, ...]) -> np.ndarray:
        """A parameter's initial value for iteration path ``idx``, from ``(seed, pid, idx)``."""
        init = attrs["init"]
        if isinstance(init, np.ndarray):
            return init.copy()  # type: ignore[no-any-return]  # numpy's stubs: Self is Any for py3.10
        seed = self.seed if attrs["seed"] is None else attrs["seed"]
        what = f"<Parameter:{pid}{'@' + '.'.join(map(str, idx)) if idx else ''}> {name!r}"
        try:
            value = np.asarray(init(attrs["shape"], np.random.default_rng([seed, pid, *idx]), self.dtype))
        except Exception as e:
            raise BuildError(f"{what}: the initialiser raised {type(e).__name__}: {e}") from e
        if value.shape != attrs["shape"]:
            raise ShapeError(f"{what}: initialiser returned shape {value.shape}, expected {attrs['shape']}")
        if value.dtype.kind not in "fiub":
            raise TypeError(f"{what}: initialiser returned a non-numeric array (dtype {value.dtype})")
        return value.astype(self.dtype, copy=False)

    def _new_parameter(self, decl: VirtualNode, idx: tuple[int, ...]) -> ComputeNode:
        attrs = decl.attrs
        value = self._initial_value(_declared_name(decl), attrs, decl.id, idx)
        key = NodeKey("Parameter", decl.id, () if attrs["share"] else idx)
        leaf = ComputeNode(key, value, requires_grad=True, name=_store_name(decl, idx))
        leaf.sparse_grad = attrs.get("sparse_grad", False)
        return leaf

    def loop(
        self,
        times: int | None = None,
        while_: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
        max_iters: int = 100_000,
        name: str | None = None,
        *,
        until: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
        on_limit: str = "raise",
        checkpoint: int | str | tuple[str, int] | None = None,
    ) -> LoopNode:
        """Declare a loop; use it as a ``with`` block holding the body (see :class:`LoopNode`).

        Args:
            times: a fixed number of iterations.
            while_: ``cond(t, state) -> bool`` checked before each iteration on real values
                (``state`` maps carry names to arrays); the loop stops when it is false.
            max_iters: a guard: more iterations than this is a :class:`LoopLimitError` (or, with
                ``on_limit="stop"``, a cap).
            name: a display name.
            until: ``cond(t, state) -> bool`` checked *after* each iteration on the updated state
                (a do-while: the body runs at least once); the loop stops when it is true, e.g.
                "compute the next state, stop when it barely moved" with no extra carry.
            on_limit: ``"raise"`` (default) makes running into ``max_iters`` an error;
                ``"stop"`` caps the loop there, recorded as a decision (``cg.capped(loop)``).

            checkpoint: keep only some iterations' values and recompute the others in backward
                (see :mod:`vgraph.virtual.checkpoint` and docs/training.md): ``k`` keeps the
                state every ``k`` iterations, ``"sqrt"`` about every ``sqrt(T)``,
                ``("binomial", s)`` at most ``s`` states (Griewank's binomial schedule).
                Gradients are those of the plain unroll; ``None`` (default) keeps every value.

        Raises:
            TypeError: ``while_`` or ``until`` is not callable, ``times`` or ``max_iters`` is not
                an int (:class:`~vgraph.errors.ArgumentError`), or ``checkpoint`` is not a schedule.
            ValueError: ``times`` or ``max_iters`` is negative
                (:class:`~vgraph.errors.ArgumentValueError`), ``on_limit`` is neither ``"raise"`` nor
                ``"stop"``, or a schedule cannot work (``k <= 0``, ``s <= 0``, an unknown name).
        """
        times = int_arg(times, "loop times=", 0, optional=True)
        if while_ is not None and not callable(while_):
            raise TypeError(f"loop while_= must be callable as while_(t, state) -> bool, got {while_!r}")
        if until is not None and not callable(until):
            raise TypeError(f"loop until= must be callable as until(t, state) -> bool, got {until!r}")
        if on_limit not in ("raise", "stop"):
            raise ValueError(f"loop on_limit= must be 'raise' or 'stop', got {on_limit!r}")
        max_iters = int_arg(max_iters, "loop max_iters=", 0)
        schedule = schedule_arg(checkpoint, f"g.loop() {self._next_loop(name)}")
        loop = LoopNode(self, times, while_, max_iters, name, checkpoint=schedule)
        loop.until, loop.on_limit = until, on_limit
        return loop

    def branch(
        self,
        selector: Callable[..., Any],
        options: Sequence[Any],
        keys: Sequence[Any] = (),
        name: str | None = None,
    ) -> Any:
        """Declare a switch: ``options[selector(*key_values)]`` (see :class:`BranchNode`).

        With options given as tuples of equal length (``[(h_leaf, c_leaf), (h_node, c_node)]``)
        the branch has one output per position and returns them as a tuple: one decision, taken
        once, selects every output (no need to repeat the branch per output).

        Returns:
            A :class:`BranchNode`, or a tuple of them for tuple options.

        Raises:
            TypeError: ``selector`` is not callable.
            BuildError: no options, options of different lengths, or an option or key that is not
                visible here.
        """
        if not callable(selector):
            raise TypeError(
                f"branch selector must be callable as selector(*key_values) -> int, got {selector!r}"
            )
        if len(options) < 1:
            raise BuildError("a branch needs at least one option")
        # Check every operand before declaring any constant: a failed call declares nothing.
        operands = [y for o in options for y in (o if isinstance(o, (tuple, list)) else (o,))]
        for y in (*operands, *keys):  # (keys are values: a list key is an array)
            if not isinstance(y, VirtualNode):
                try:
                    _as_value(y, self.dtype)
                except (TypeError, ValueError) as e:
                    raise TypeError(f"branch option or key {y!r} is not a node or a number: {e}") from None
        tuples = [isinstance(o, (tuple, list)) for o in options]
        if any(tuples) and not all(tuples):
            raise BuildError("branch options must be all nodes or all tuples of nodes (one per output)")
        ks = tuple(self._as_node(k) for k in keys)
        if not any(tuples):
            return BranchNode(self, selector, ks, tuple(self._as_node(o) for o in options), name)
        widths = {len(o) for o in options}
        if len(widths) != 1 or 0 in widths:
            raise BuildError(
                f"tuple branch options must have one equal, non-zero length; got lengths {sorted(widths)}"
            )
        columns = [tuple(self._as_node(o[i]) for o in options) for i in range(widths.pop())]
        lead = BranchNode(self, selector, ks, columns[0], name)
        followers = [BranchNode(self, selector, ks, col, name, lead=lead) for col in columns[1:]]
        return (lead, *followers)

    def recurse(
        self,
        children: Any,
        max_nodes: int = 100_000,
        name: str | None = None,
        checkpoint: int | str | None = None,
    ) -> LoopNode:
        """Declare a recursion over a tree or DAG given as data; use it as a ``with`` block.

        ``children`` is an integer array of shape ``(N, k)`` fed at build time: row ``t`` lists
        the children of structure node ``t`` (``-1``: no child in that slot), nodes ordered
        children before parents, so node ``N - 1`` is the root. The block declares what is
        computed at one node from the values at its children::

            with g.recurse(children) as r:
                x = r.step(features)              # features[t]: node t's own input
                h = r.state(h0, name="h")         # a value at every node; h0 for a missing child
                h_new = cell(x, r.child(h, 0), r.child(h, 1))
                r.update(h, h_new)
            root = r.final(h)                     # the value at node N - 1
            every = r.stack(h_new)                # every node's value, (N, ...)

        means, in plain Python::

            value = [None] * N
            for t in range(N):                    # children come first
                kid = lambda j: value[children[t, j]] if children[t, j] >= 0 else h0
                value[t] = cell(features[t], kid(0), kid(1))
            root, every = value[N - 1], np.stack(value)

        It is a loop over the structure's nodes (a :class:`LoopNode`), so everything loops have
        applies: keys ``<Tanh:3@17>`` name the tanh at structure node 17 (``cg.node(v, (17,))``),
        nesting inside loops grows the iteration path, work that does not read the children is
        hoisted, guards re-check the structure on a re-run forward. Reading a child's value is
        free: ``r.child(h, j)`` at node ``t`` *is* the node computed at that child. A node read by
        two parents (a DAG) passes its gradient back from both. Leaves and inner nodes that need
        different computations use a branch (with tuple options for several outputs).

        Parameters declared in the body are tied across structure nodes by default (one cell for
        the whole tree, as in a Tree-LSTM; the structure differs per input, so untied per-node
        weights would not be the same parameters from one input to the next); ``share=False``
        unties them.

        Args:
            children: a node whose value is the ``(N, k)`` children array (usually an input).
            max_nodes: a guard: a structure of more nodes is (at build) a
                :class:`~vgraph.errors.LoopLimitError`.
            name: a display name.
            checkpoint: ``k`` or ``"sqrt"``, as for :meth:`loop` (structure nodes in units of
                ``k``; a value read by a parent in a later unit is kept). Not ``binomial``.

        Raises:
            TypeError: ``max_nodes`` is not an int, or ``checkpoint`` is not a schedule.
            ValueError: a schedule that cannot work, or ``("binomial", s)``.
            BuildError: ``children`` is not a node visible here.
            StructureError: (at build) the array is not ``(N, k)`` integers, is empty, has fewer
                columns than a slot ``r.child(state, j)`` reads (the error names the child node
                and the width), or a child index is out of range or does not come before its
                parent (which includes cycles); the error names the structure node and the index.
        """
        structure = self._as_node(children)
        max_nodes = int_arg(max_nodes, "recurse max_nodes=", 0)
        schedule = schedule_arg(checkpoint, f"g.recurse() {self._next_loop(name)}", recursion=True)
        return LoopNode(self, None, None, max_nodes, name, structure=structure, checkpoint=schedule)

    def _next_loop(self, name: str | None) -> str:
        """How the loop being declared will be named in messages (``<Loop:3> 'rnn'``)."""
        key = f"<Loop:{self._counters.get('Loop', 0) + 1}>"
        return key + (f" {name!r}" if name else "")

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
                self._cache.clear()  # graphs of the old declarations: they cannot be hit again
            plan = self._plans[key] = _Plan(self, outputs)
        return plan

    def build(
        self,
        feed: Mapping[str, Any],
        outputs: VirtualNode | Sequence[VirtualNode],
        *,
        hoist: bool = True,
        cache: bool = True,
        detect_anomaly: bool = False,
        programs: bool | None = None,
    ) -> UnrolledGraph:
        """Unroll for ``feed``; see :func:`build_compute_graph`."""
        from .unroll import build_compute_graph  # unrolling sits above declaring

        return build_compute_graph(
            self, feed, outputs, hoist=hoist, cache=cache, detect_anomaly=detect_anomaly, programs=programs
        )

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of all parameter values by name, untied copies included (``g.params.state_dict()``)."""
        return self.params.state_dict()

    def _take_back(self, nodes: Sequence[VirtualNode]) -> None:
        """Undo the declaration of ``nodes``, the last ones declared (a module whose constructor
        failed half-way): the graph is as before them."""
        for v in reversed(nodes):
            self.nodes.remove(v)
            if v.scope is not None:
                v.scope.body.remove(v)
            self._counters[v.type] -= 1
            if v.kind == "parameter":
                del self._param_decls[_declared_name(v)]
                self.params._nodes.pop(_declared_name(v), None)
            elif v.kind == "input":
                del self._inputs[_declared_name(v)]

    def _declaration_of(self, key: str, what: str) -> tuple[VirtualNode, tuple[int, ...]]:
        """The parameter declaration and iteration path a store name stands for (``"W"``,
        ``"W@3"``), or a KeyError starting with ``what``."""
        base, _, idx_text = key.partition("@") if isinstance(key, str) else ("", "", "")
        decl = self._param_decls.get(base)
        if (
            decl is None
            or (bool(idx_text) == decl.attrs["share"])
            or (idx_text and not _is_iteration_path(idx_text, _depth(decl.scope)))
        ):
            raise KeyError(f"{what} {key!r}, which is not a parameter of this graph")
        return decl, tuple(int(i) for i in idx_text.split(".")) if idx_text else ()

    def _declared_spec(self, key: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """The (shape, dtype) parameter ``key`` (``"W"``, ``"W@3"``) has by its declaration, or ``None``."""
        try:
            decl, _ = self._declaration_of(key, "no parameter")
        except KeyError:
            return None
        return decl.attrs["shape"], np.dtype(self.dtype)

    def _untied_copy(self, key: str) -> ComputeNode:
        """Create (initialised, and added to the store) the untied copy ``key`` no build has made yet."""
        decl, idx = self._declaration_of(key, "no parameter")
        node = self._new_parameter(decl, idx)
        self.params._add(key, node)
        return node

    def build_batch(
        self,
        feeds: Sequence[Mapping[str, Any]],
        outputs: VirtualNode | Sequence[VirtualNode],
        hoist: bool = True,
        depth: bool = True,
        programs: bool | None = None,
    ) -> Any:
        """Build many inputs at once, running copies of the same declared node together
        (autobatching; see :mod:`vgraph.virtual.batch`).

        Each input's loop conditions, branch selectors and recursion structures are evaluated on
        its own values; inputs with different lengths, choices and trees still batch wherever they
        compute the same declared node. The result equals building the inputs one at a time.

        Args:
            feeds: one feed (input name -> value) per input.
            outputs: top-level virtual nodes to build for every input.
            hoist: hoist carry-independent loop-body work out of each input's loops, as
                :meth:`build` does (one op per loop and input instead of one per iteration; the
                groups can batch across inputs too); ``False`` runs every iteration's copy.
            depth: build a recursion's tree nodes in depth order (a tree node as soon as its
                children are built: the leaves of every input together, and so on up); ``False``
                builds each input's tree nodes one after another, as :meth:`build` does. Results
                are the same either way.
            programs: run each loop of known trip count whose body can run on rows as ONE body
                program over every input's rows (see :class:`vgraph.virtual.batch.BatchedBuild`);
                ``False``: op by op across inputs; ``None`` (the default): the thread's mode
                (``vg.body_programs``), which when left to choose runs them as programs (a
                batched build is never cached). Results are the same either way.

        Returns:
            A :class:`~vgraph.virtual.batch.BatchedBuild`: ``batch.backward()`` backpropagates the
            mean (or sum) of every input's scalar output once; ``batch.inputs[i]`` gives input
            ``i``'s values, gradients and decisions by virtual node and iteration path.

        Raises:
            TypeError, ValueError: ``feeds`` is not a non-empty list of mappings.
            ArgumentError: ``hoist`` or ``depth`` is not a bool (a TypeError).
            FeedError, BuildError, ...: as :meth:`build`, prefixed with the input's index; nothing
                is created in the parameter store then.
        """
        from .batch import build_batch  # batching sits above declaring

        return build_batch(self, feeds, outputs, hoist=hoist, depth=depth, programs=programs)

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
            decl, idx = self._declaration_of(key, "checkpoint has")
            arr = np.asarray(value)
            if arr.shape != decl.attrs["shape"]:
                raise ShapeError(
                    f"parameter {key!r}: checkpoint shape {arr.shape}, model shape {decl.attrs['shape']}"
                )
            if arr.dtype.kind != "f":
                raise ShapeError(f"parameter {key!r}: checkpoint dtype {arr.dtype} is not a float dtype")
            staged[key] = arr
            if key not in self.params:
                new[key] = self._new_parameter(decl, idx)
        missing = [k for k in self.params if k not in staged]
        if strict and missing:
            raise KeyError(f"checkpoint lacks parameters {', '.join(missing)}")
        for key, node in new.items():
            self.params._add(key, node)
        for key, arr in staged.items():
            self.params[key].set_value(arr)


# ---------------------------------------------------------------------------- argument checks


def _name_arg(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} name must be a non-empty str, got {name!r}")
    if "\x00" in name:  # a checkpoint's member names stop there: it would never load back
        raise ValueError(f"{what} name {name!r} contains a NUL character")


def _int_like(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _shape_arg(shape: Any, what: str, allow_none: bool = False) -> tuple[Any, ...]:
    """A shape as a tuple of non-negative ints (and ``None`` where allowed); no silent truncation."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(
            f"{what}: shape must be a tuple or list of ints, got {type(shape).__name__} {shape!r}"
        )
    dims = tuple(shape)
    for d in dims:
        if d is None and allow_none:
            continue
        if not _int_like(d):
            raise TypeError(f"{what}: shape {shape!r} has {d!r}, not an int")
        if d < 0:
            raise ValueError(f"{what}: shape {shape!r} has a negative dimension")
    return tuple(d if d is None else int(d) for d in dims)
