"""Building blocks for models declared as virtual graphs: layers, recurrent cells, dropout.

A module declares its parameters once, in the :class:`~vgraph.virtual.VirtualGraph` it is given,
when it is constructed; calling it on virtual nodes declares the ops that use them. Parameter
names are prefixed by the module's ``name``: ``RNNCell(g, 3, 5, "rnn")`` declares ``"rnn.W_x"``,
``"rnn.W_h"`` and ``"rnn.b"``.

The recommended pattern for recurrent models is to **construct cells outside the loop** — one
parameter set — and call them inside the body, where every iteration uses the same parameters::

    cell = nn.LSTMCell(g, 8, 16, "lstm")            # declares lstm.W_x, lstm.W_h, lstm.b
    with g.loop() as L:
        x_t = L.step(xs)
        h, c = L.carry(h0, name="h"), L.carry(c0, name="c")
        h_new, c_new = cell(x_t, (h, c))
        L.update(h, h_new); L.update(c, c_new)

A module constructed *inside* a loop body declares parameters scoped to that body. As with
:meth:`VirtualGraph.parameter`, they are then untied by default (``"lstm.W_x@0"``,
``"lstm.W_x@1"`` …, one set per iteration, e.g. a stack of distinct layers); pass ``share=True``
to tie them across iterations. Such a module can only be called inside that body.

The initialisers of :mod:`vgraph.init` are re-exported here (``nn.init.orthogonal()`` or
``nn.orthogonal()``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, cast, get_args

import numpy as np

from . import functions as F
from . import init
from .compute import ComputeNode
from .functions import Operand
from .init import (
    Initializer,
    constant,
    kaiming_normal,
    kaiming_uniform,
    normal,
    orthogonal,
    uniform,
    xavier_normal,
    xavier_uniform,
    zeros,
)
from .modes import int_arg
from .virtual import VirtualGraph, VirtualNode

__all__ = [
    "Bidirectional",
    "Dropout",
    "Embedding",
    "GRUCell",
    "Initializer",
    "LSTMCell",
    "Linear",
    "Module",
    "RNNCell",
    "constant",
    "init",
    "kaiming_normal",
    "kaiming_uniform",
    "normal",
    "one_hot",
    "orthogonal",
    "uniform",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
]

# ---------------------------------------------------------------------------- helpers


def one_hot(indices: Any, num_classes: int) -> Any:
    """One-hot encode integer class indices: ``out[..., k] = 1.0 if indices[...] == k else 0.0``.

    Works on virtual nodes, compute nodes and plain arrays. For a node (e.g. an integer graph
    input fed at build time) it is built from graph ops as
    ``where(indices[..., None] - arange(num_classes), 0.0, 1.0)``: the difference is non-zero
    (true) except at the index's own class. The result has the graph's float dtype and no
    gradient flows to ``indices``. An index outside ``[0, num_classes)`` gives an all-zero row.

    Args:
        indices: integer class indices of any shape (a node or an array).
        num_classes: the number of classes C (the new last axis).

    Returns:
        A node (for a node ``indices``) or a float64 array of shape ``indices.shape + (C,)``.

    Raises:
        ValueError: ``num_classes < 1``, or an array ``indices`` that is not integral.
    """
    if int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes}")
    classes = np.arange(int(num_classes))
    if isinstance(indices, Operand):
        return F.where(indices[..., None] - classes, 0.0, 1.0)
    idx = _int_array(indices, "indices")
    return (idx[..., None] == classes).astype(np.float64)


def _size(n: Any, what: str) -> int:
    """A module size: a positive int (not a float, bool or str, which int() would accept)."""
    return int_arg(n, what, 1)


def _int_array(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            return arr.astype(np.int64)
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr


def _blocks(make: Callable[[], Initializer], n: int) -> Initializer:
    """An initialiser for a ``(rows, n * cols)`` weight: ``n`` independent ``(rows, cols)`` blocks
    side by side (e.g. one orthogonal block per gate)."""

    def initialise(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any) -> np.ndarray:
        rows, cols = shape
        block = make()
        return np.concatenate([block((rows, cols // n), rng, dtype) for _ in range(n)], axis=1)

    return initialise


def _fill(value: np.ndarray) -> Initializer:
    """An initialiser returning a copy of ``value`` (in the graph's dtype)."""
    return lambda shape, rng, dtype: np.array(value, dtype=dtype)


# ---------------------------------------------------------------------------- modules


class Module:
    """Base class: a named group of parameters declared in one VirtualGraph.

    Args:
        graph: the VirtualGraph to declare parameters in.
        name: the prefix of the parameter names (non-empty, without ``"@"``).
        share: passed to every :meth:`VirtualGraph.parameter` call; matters only when the module is
            constructed inside a loop body (``True``: one parameter set tied across iterations;
            ``False``: one set per iteration path, ``"name.W@3"``). The default, ``None``, is the
            graph's: untied in a loop body, tied in a recursion body.

    Raises:
        TypeError: ``graph`` is not a VirtualGraph. ValueError: an invalid name.
    """

    def __init__(self, graph: VirtualGraph, name: str, share: bool | None = None) -> None:
        if not isinstance(graph, VirtualGraph):
            raise TypeError(f"a module is declared in a VirtualGraph, got {type(graph).__name__}")
        if not isinstance(name, str) or not name or "@" in name:
            raise ValueError(f"module name must be a non-empty string without '@', got {name!r}")
        self.graph = graph
        self.name = name
        self.share = None if share is None else bool(share)
        self.declared: dict[str, VirtualNode] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A module's constructor declares all its parameters or none: if it fails half-way (a bad
        initialiser for the second parameter, say), the ones it declared are taken back."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_atomic", False):
            return

        @functools.wraps(init)
        def atomic_init(self: Module, *args: Any, **kw: Any) -> None:
            try:
                init(self, *args, **kw)
            except BaseException:
                declared = list(getattr(self, "declared", {}).values())
                if declared:
                    self.graph._take_back(declared)
                    self.declared.clear()
                raise

        atomic_init._atomic = True  # type: ignore[attr-defined]
        cls.__init__ = atomic_init  # type: ignore[method-assign]

    def _param(
        self, local: str, shape: tuple[int, ...], init_: Any, sparse_grad: bool = False
    ) -> VirtualNode:
        node = self.graph.parameter(
            f"{self.name}.{local}", shape, init=init_, share=self.share, sparse_grad=sparse_grad
        )
        self.declared[local] = node
        return node

    def parameter_names(self) -> list[str]:
        """The declared parameter names (``"rnn.W_x"`` …); untied copies add ``"@idx"`` to them."""
        return [cast(str, v.name) for v in self.declared.values()]  # parameters always have a name

    def parameters(self) -> list[ComputeNode]:
        """The module's entries in ``graph.params`` now: the shared parameters, or every untied
        copy created so far. Optimisers given the module re-read this at every step."""
        store = self.graph.params
        out: list[ComputeNode] = []
        for base in self.parameter_names():
            out.extend(store[k] for k in store if k == base or k.startswith(base + "@"))
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, params={self.parameter_names()})"


class Linear(Module):
    """An affine map ``y = x @ W + b`` (vgraph's ``x @ W`` convention, ``W`` is ``(in, out)``).

    Parameters: ``{name}.W`` ``(in_features, out_features)``, ``{name}.b`` ``(out_features,)``.

    Args:
        graph, name, share: see :class:`Module`.
        in_features, out_features: the sizes of the last axis of x and y.
        bias: add ``b`` (default True).
        init: the weight's initialiser (default ``xavier_uniform``).
        bias_init: the bias's initialiser (default zeros).
        fused: with a bias, one ``Linear`` node per call (default;
            :func:`vgraph.functions.linear`: the bias added into the product's own array, one
            value fewer the size of the output), or ``False``: a ``MatMul`` and an ``Add`` node.
            The same values and gradients either way.
    """

    def __init__(
        self,
        graph: VirtualGraph,
        in_features: int,
        out_features: int,
        name: str,
        bias: bool = True,
        init: Any = None,
        bias_init: Any = None,
        share: bool | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__(graph, name, share)
        self.in_features, self.out_features = (
            _size(in_features, "in_features"),
            _size(out_features, "out_features"),
        )
        self.fused = bool(fused)
        self.W = self._param("W", (self.in_features, self.out_features), init)
        self.b = self._param("b", (self.out_features,), bias_init) if bias else None

    def __call__(self, x: Any) -> Any:
        """``x @ W + b`` for x of shape ``(..., in_features)``."""
        if self.b is None:
            return x @ self.W
        if self.fused:
            return F.linear(x, self.W, self.b)
        return x @ self.W + self.b


class RNNCell(Module):
    """An Elman cell: ``h' = act(x @ W_x + h @ W_h + b)`` with ``act`` tanh or relu.

    Parameters: ``{name}.W_x`` ``(input_size, hidden_size)`` (xavier_uniform), ``{name}.W_h``
    ``(hidden_size, hidden_size)`` (orthogonal), ``{name}.b`` ``(hidden_size,)`` (zeros).

    Raises:
        ValueError: an unknown nonlinearity.
    """

    def __init__(
        self,
        graph: VirtualGraph,
        input_size: int,
        hidden_size: int,
        name: str,
        nonlinearity: str = "tanh",
        share: bool | None = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(graph, name, share)
        self.input_size, self.hidden_size = _size(input_size, "input_size"), _size(hidden_size, "hidden_size")
        self.nonlinearity = nonlinearity
        H = self.hidden_size
        self.W_x = self._param("W_x", (self.input_size, H), xavier_uniform())
        self.W_h = self._param("W_h", (H, H), orthogonal())
        self.b = self._param("b", (H,), zeros())

    def __call__(self, x_t: Any, h: Any) -> Any:
        """One step: ``x_t`` ``(batch, input_size)``, ``h`` ``(batch, hidden_size)`` -> new h."""
        # The bias joins the input projection first (PyTorch's order too): in a loop stepping
        # through x, hoisting then computes x_t @ W_x + b for every step at once.
        z = x_t @ self.W_x + self.b + h @ self.W_h
        return F.tanh(z) if self.nonlinearity == "tanh" else F.relu(z)


class LSTMCell(Module):
    """A long short-term memory cell (Hochreiter & Schmidhuber, 1997), gates in PyTorch's order.

    With ``z = x @ W_x + h @ W_h + b`` split into four blocks of ``hidden_size`` columns::

        i = sigmoid(z_i)     input gate
        f = sigmoid(z_f)     forget gate
        g = tanh(z_g)        candidate
        o = sigmoid(z_o)     output gate
        c' = f * c + i * g
        h' = o * tanh(c')

    Parameters: ``{name}.W_x`` ``(input_size, 4H)`` (xavier_uniform), ``{name}.W_h`` ``(H, 4H)``
    (one orthogonal ``(H, H)`` block per gate), ``{name}.b`` ``(4H,)``: zeros, except the
    forget-gate block ``b[H:2H]``, which starts at ``forget_bias`` (default 1.0) so that the cell
    keeps its memory early in training (Jozefowicz et al., 2015). PyTorch's two biases
    ``b_ih + b_hh`` are one bias here (they only ever appear summed).

    Fused by default: each call declares ``x @ W_x`` and ``h @ W_h`` (MatMul nodes) and one
    ``LSTMCell`` node (:func:`vgraph.functions.lstm_cell`) that computes the bias, the gates and the
    new state and has a hand-written VJP; ``h'`` and ``c'`` are GetItem views of its value
    ``(6, ..., H)`` = ``[h', c', i, f, g, o]``. ``fused=False`` declares every gate as its own node
    (about 17 nodes per step instead of 5), the same values and gradients: for looking at or
    changing individual gates.

    Args:
        graph, name, share: see :class:`Module`.
        input_size, hidden_size: the sizes of x and of h (and c).
        forget_bias: the initial value of the forget gate's bias block.
        fused: one fused node per step (default) or one node per gate operation.
    """

    def __init__(
        self,
        graph: VirtualGraph,
        input_size: int,
        hidden_size: int,
        name: str,
        forget_bias: float = 1.0,
        share: bool | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__(graph, name, share)
        self.input_size, self.hidden_size = _size(input_size, "input_size"), _size(hidden_size, "hidden_size")
        self.fused = bool(fused)
        H = self.hidden_size
        bias = np.zeros(4 * H)
        bias[H : 2 * H] = forget_bias
        self.W_x = self._param("W_x", (self.input_size, 4 * H), xavier_uniform())
        self.W_h = self._param("W_h", (H, 4 * H), _blocks(orthogonal, 4))
        self.b = self._param("b", (4 * H,), _fill(bias))

    def __call__(self, x_t: Any, state: tuple[Any, Any]) -> tuple[Any, Any]:
        """One step: ``x_t`` ``(batch, input_size)``, ``state = (h, c)`` each ``(batch, H)``.

        Returns:
            ``(h_new, c_new)``.
        """
        h, c = state
        if self.fused:
            cell = F.lstm_cell(x_t @ self.W_x, h @ self.W_h, self.b, c)
            return cell[0], cell[1]
        H = self.hidden_size
        z = x_t @ self.W_x + self.b + h @ self.W_h  # the bias hoistable with x_t @ W_x (see RNNCell)
        i = F.sigmoid(z[..., 0:H])
        f = F.sigmoid(z[..., H : 2 * H])
        g = F.tanh(z[..., 2 * H : 3 * H])
        o = F.sigmoid(z[..., 3 * H : 4 * H])
        c_new = f * c + i * g
        h_new = o * F.tanh(c_new)
        return h_new, c_new


class GRUCell(Module):
    """A gated recurrent unit (Cho et al., 2014) with PyTorch's equations and gate order (r, z, n)::

        r = sigmoid(x @ W_xr + b_xr + h @ W_hr + b_hr)          reset gate
        z = sigmoid(x @ W_xz + b_xz + h @ W_hz + b_hz)          update gate
        n = tanh(x @ W_xn + b_xn + r * (h @ W_hn + b_hn))       candidate
        h' = (1 - z) * n + z * h

    The reset gate multiplies ``h @ W_hn + b_hn`` (bias included), which is why the input and
    hidden biases are separate. Parameters: ``{name}.W_x`` ``(input_size, 3H)`` (xavier_uniform),
    ``{name}.W_h`` ``(H, 3H)`` (one orthogonal block per gate), ``{name}.b_x`` and ``{name}.b_h``
    ``(3H,)`` (zeros); columns ``[0:H]`` are r, ``[H:2H]`` z, ``[2H:3H]`` n.

    Fused by default: each call declares ``x @ W_x`` and ``h @ W_h`` (MatMul nodes) and one
    ``GRUCell`` node (:func:`vgraph.functions.gru_cell`) that computes the biases, the gates and the
    new state and has a hand-written VJP; ``h'`` is a GetItem view of its value ``(4, ..., H)`` =
    ``[h', r, z, n]``. ``fused=False`` declares every gate as its own node (about 20 nodes per
    step instead of 4), the same values and gradients.

    Args:
        graph, name, share: see :class:`Module`.
        input_size, hidden_size: the sizes of x and of h.
        fused: one fused node per step (default) or one node per gate operation.
    """

    def __init__(
        self,
        graph: VirtualGraph,
        input_size: int,
        hidden_size: int,
        name: str,
        share: bool | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__(graph, name, share)
        self.input_size, self.hidden_size = _size(input_size, "input_size"), _size(hidden_size, "hidden_size")
        self.fused = bool(fused)
        H = self.hidden_size
        self.W_x = self._param("W_x", (self.input_size, 3 * H), xavier_uniform())
        self.W_h = self._param("W_h", (H, 3 * H), _blocks(orthogonal, 3))
        self.b_x = self._param("b_x", (3 * H,), zeros())
        self.b_h = self._param("b_h", (3 * H,), zeros())

    def __call__(self, x_t: Any, h: Any) -> Any:
        """One step: ``x_t`` ``(batch, input_size)``, ``h`` ``(batch, H)`` -> new h."""
        if self.fused:
            return F.gru_cell(x_t @ self.W_x, h @ self.W_h, self.b_x, self.b_h, h)[0]
        H = self.hidden_size
        gx = x_t @ self.W_x + self.b_x
        gh = h @ self.W_h + self.b_h
        r = F.sigmoid(gx[..., 0:H] + gh[..., 0:H])
        z = F.sigmoid(gx[..., H : 2 * H] + gh[..., H : 2 * H])
        n = F.tanh(gx[..., 2 * H : 3 * H] + r * gh[..., 2 * H : 3 * H])
        return n + z * (h - n)  # = (1 - z) * n + z * h, without a constant


#: The recurrent cells :class:`Bidirectional` runs.
_Cell = RNNCell | LSTMCell | GRUCell


class Bidirectional:
    """A recurrent cell run over a sequence in both directions, as one loop: the encoder of a
    tagger or of a translation model (PyTorch's ``nn.LSTM(bidirectional=True)``, DyNet's
    ``BiRNNBuilder``).

    ::

        bi = nn.Bidirectional(nn.LSTMCell(g, 128, 50, "fwd"), nn.LSTMCell(g, 128, 50, "bwd"))
        out = bi(xs)      # xs (T, B, 128) -> (T, B, 100)

    Row ``t`` of the result is the forward cell's ``h`` after reading ``xs[0] … xs[t]`` next to
    the backward cell's after reading ``xs[T-1] … xs[t]``: the same values as two loops, one
    stepping through ``xs`` with ``forward`` and one through ``xs[::-1]`` with ``backward``, whose
    stacked states are reversed and concatenated (to rounding: the products are grouped
    differently). It is faster: the two cells' parameters are stacked on a new leading axis
    (``(2, ...)``; biases ``(2, 1, n)``), and each iteration computes both directions' products
    and cell in one numpy call each, where two loops make two (the BiLSTM tagger of
    ``tools/bench_dynamic.py`` takes 0.77–0.89 of the two loops' time a sentence). In the unrolled graph the loop is one
    ``<Loop:…>`` whose body nodes hold both directions along their leading axis (``[0]``
    forward, ``[1]`` backward); the parameters stay the cells' own (``fwd.W_x`` …), and their
    gradients reach them through the stacks.

    Args:
        forward, backward: two cells of the same kind (:class:`RNNCell`, :class:`LSTMCell` or
            :class:`GRUCell`) and sizes, declared in the same graph outside any loop body.
        name: the loop's name (default ``"bidirectional"``).

    Raises:
        TypeError: a cell that is not one of those kinds, or two of different kinds.
        ValueError: cells of different sizes or settings, from different graphs, or with
            parameters declared in a loop body.
    """

    def __init__(self, forward: _Cell, backward: _Cell, name: str = "bidirectional") -> None:
        for what, cell in (("forward", forward), ("backward", backward)):
            if type(cell) not in get_args(_Cell):
                raise TypeError(
                    f"Bidirectional: {what} must be an RNNCell, LSTMCell or GRUCell, got {type(cell).__name__}"
                )
        if type(forward) is not type(backward):
            raise TypeError(
                f"Bidirectional: the cells must be of one kind, got {type(forward).__name__} and "
                f"{type(backward).__name__}"
            )
        if forward.graph is not backward.graph:
            raise ValueError("Bidirectional: the two cells are declared in different graphs")
        settings = ("input_size", "hidden_size", "fused", "nonlinearity")
        for k in settings:
            a, b = getattr(forward, k, None), getattr(backward, k, None)
            if a != b:
                raise ValueError(f"Bidirectional: the cells' {k} differ ({a!r} and {b!r})")
        for cell in (forward, backward):
            inner = [v for v in cell.declared.values() if v.scope is not None]
            if inner:
                raise ValueError(
                    f"Bidirectional: {inner[0].describe()} is declared in a loop body; construct "
                    "the cells outside any loop"
                )
        if not isinstance(name, str) or not name:
            raise ValueError(f"Bidirectional: name must be a non-empty string, got {name!r}")
        self.forward, self.backward, self.name = forward, backward, name

    def __call__(self, xs: Any) -> Any:
        """Run both directions over ``xs`` ``(T, B, input_size)``; returns ``(T, B, 2 *
        hidden_size)``, the forward states in the first ``hidden_size`` columns. The states start
        at zero.

        Raises:
            TypeError: ``xs`` is not a node of the cells' graph.
            ValueError: ``xs`` is declared with another number of axes than three (or none
                known), or with another last axis than ``input_size``.
        """
        fwd, bwd = self.forward, self.backward
        g = fwd.graph
        if not isinstance(xs, VirtualNode) or xs.graph is not g:
            what = xs.describe() if isinstance(xs, VirtualNode) else type(xs).__name__
            raise TypeError(f"Bidirectional: xs must be a node of the cells' graph, got {what}")
        shape = xs.shape
        if shape is None or len(shape) != 3:
            raise ValueError(
                f"Bidirectional: xs must be (T, B, input_size), got {xs.describe()} of shape "
                f"{'unknown' if shape is None else shape}: declare the input with its shape"
            )
        if shape[2] is not None and shape[2] != fwd.input_size:
            raise ValueError(f"Bidirectional: xs has {shape[2]} features, the cells take {fwd.input_size}")
        # Both cells as one: a copy of the forward cell whose parameters are the two cells' stacked
        # (a bias (2, 1, n): it broadcasts against the (2, B, n) rows).
        both = copy.copy(fwd)
        for local, p in fwd.declared.items():
            stacked = F.stack([p, bwd.declared[local]])
            setattr(both, local, stacked if len(p.shape or ()) > 1 else stacked.reshape(2, 1, -1))
        H = fwd.hidden_size
        zeros = g.constant(np.zeros((2, 1, H), dtype=g.dtype), name=f"{self.name}.h0")
        pairs = F.stack([xs, xs[::-1]], axis=1)  # (T, 2, B, I): row t is xs[t] and xs[T-1-t]
        with g.loop(name=self.name) as L:
            x_t = L.step(pairs)
            if isinstance(both, LSTMCell):
                h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
                h_new, c_new = both(x_t, (h, c))
                L.update(c, c_new)
            else:
                h = L.carry(zeros, name="h")
                h_new = both(x_t, h)
            L.update(h, h_new)
        states = L.stack(h_new)  # (T, 2, B, H)
        return F.concat([states[:, 0], states[:, 1][::-1]], axis=-1)


class Embedding(Module):
    """A look-up table: row ``indices[...]`` of ``W`` for each index.

    Parameter: ``{name}.W`` ``(num_embeddings, dim)``, standard normal by default (as PyTorch).

    Two ways to give the indices:

    * an integer **numpy array** (fixed when the model is declared): ``W[indices]`` through
      ``GetItem`` with an integer-array index; its gradient is ``np.add.at`` into a zero array,
      so repeated indices accumulate.
    * an integer **node** (e.g. ``g.input("tokens")`` fed at build time): ``take(W, indices)``,
      the same row look-up with data-dependent indices.

    By default the gradient of ``W`` is a dense ``(num_embeddings, dim)`` array filled by
    ``np.add.at`` over the looked-up rows, and an optimiser updates the whole table at every step.
    With ``sparse=True``, ``W.grad`` after backward is a :class:`~vgraph.ops.RowSparseGrad`:
    only the rows looked up (repeated rows summed), equal to the dense gradient's rows bit for
    bit. SGD and Adagrad then touch only those rows and give exactly the dense result;
    ``optim.Adam(..., lazy=True)`` gives the lazy update of PyTorch's ``SparseAdam`` (see
    docs/training.md, "Sparse embedding gradients"). If the table is also used other than by row
    look-ups (e.g. tied as the output layer's weight), that backward's gradient is dense.

    Inside a loop, each call is one look-up per iteration; for long sequences embed the whole
    ``(time, batch)`` index array once, before the loop, and step through the result::

        embedded = emb(tokens)          # (time, batch, dim), declared outside the loop
        with g.loop() as L:
            e_t = L.step(embedded)

    Args:
        graph, name, share: see :class:`Module`.
        num_embeddings: the number of rows (the vocabulary size).
        dim: the size of each embedding.
        init: the table's initialiser (default standard normal).
        sparse: give ``W`` a row-sparse gradient (default ``False``: dense).

    Raises:
        TypeError: ``sparse`` is not a bool.
    """

    def __init__(
        self,
        graph: VirtualGraph,
        num_embeddings: int,
        dim: int,
        name: str,
        init: Any = None,
        share: bool | None = None,
        sparse: bool = False,
    ) -> None:
        super().__init__(graph, name, share)
        self.num_embeddings, self.dim = _size(num_embeddings, "num_embeddings"), _size(dim, "dim")
        if not isinstance(sparse, (bool, np.bool_)):
            raise TypeError(f"{name}: sparse must be True or False, got {type(sparse).__name__} {sparse!r}")
        self.sparse = bool(sparse)
        self.W = self._param(
            "W",
            (self.num_embeddings, self.dim),
            normal(1.0) if init is None else init,
            sparse_grad=self.sparse,
        )

    def __call__(self, indices: Any) -> Any:
        """The embeddings of ``indices`` (any shape S): a node of shape ``S + (dim,)``.

        Raises:
            ValueError: an array of indices that is not integral or out of range.
        """
        if isinstance(indices, Operand):
            return F.take(self.W, indices)
        idx = _int_array(indices, "embedding indices")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise ValueError(
                f"{self.name}: indices must be in [0, {self.num_embeddings}), got {idx.min()}..{idx.max()}"
            )
        return self.W[idx]


class Dropout:
    """Inverted dropout: in training, zero each element with probability ``p`` and scale the
    survivors by ``1 / (1 - p)``; in evaluation (``g.eval()``), pass values through.

    Each call declares a sampled mask (:meth:`VirtualGraph.sample`), drawn anew at every build and,
    inside a loop body, in every iteration (so every time step gets its own mask). Masks come from
    the graph's seeded generator, so a sequence of builds is reproducible. For one mask shared by
    all time steps ("variational" dropout), call :meth:`mask` outside the loop and multiply inside.

    Args:
        graph: the VirtualGraph. p: the drop probability, in ``[0, 1]`` (``p = 1`` zeros everything).

    Raises:
        ValueError: ``p`` outside ``[0, 1]``.
    """

    def __init__(self, graph: VirtualGraph, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.graph = graph
        self.p = float(p)

    def _draw(self, rng: np.random.Generator, like: np.ndarray, training: bool) -> np.ndarray:
        dtype = like.dtype if like.dtype.kind == "f" else self.graph.dtype
        if not training or self.p == 0.0:
            return np.ones(like.shape, dtype=dtype)
        if self.p == 1.0:
            return np.zeros(like.shape, dtype=dtype)
        keep = rng.random(like.shape) >= self.p
        return (keep / (1.0 - self.p)).astype(dtype)

    def mask(self, like: Any) -> VirtualNode:
        """A sampled mask node shaped like ``like`` (``1/(1-p)`` or 0 in training, ones in eval)."""
        return self.graph.sample(self._draw, like=like, name="dropout_mask")

    def __call__(self, x: Any) -> Any:
        """``x * mask`` with a fresh mask (see the class docstring)."""
        return x * self.mask(x)

    def __repr__(self) -> str:
        return f"Dropout(p={self.p})"
