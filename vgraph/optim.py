"""Optimisers, gradient clipping and learning-rate schedules for parameter nodes.

Every optimiser follows PyTorch's update formula for the same name and defaults (``torch.optim``),
written out in each class's docstring, with per-parameter state (step counts, moment estimates)
created the first time a parameter has a gradient.

What an optimiser updates (``params``):

* a :class:`~vgraph.virtual.ParameterStore` (``g.params``) or a :class:`~vgraph.virtual.VirtualGraph`
  — **re-read at every step**, so untied parameters (``"W@3"``) that a later build adds to the
  store are picked up without rebuilding the optimiser;
* an object with a ``parameters()`` method (a :mod:`vgraph.nn` module) — also re-read every step;
* an iterable of leaf :class:`~vgraph.compute.ComputeNode` s (e.g. ``[g.params["W"]]``) or
  virtual parameter nodes (resolved to their store entries, untied copies included, every step).

Parameters whose ``.grad`` is ``None`` are skipped (their state does not advance); parameters the
optimiser is not bound to are never touched. Updates assign a *new* array through the value
setter (``p.value = p.value - step``), which bumps the version so compute graphs recompute; an
array read from ``p.value`` earlier is never modified. (An update that changes only some rows of
a row-sparse gradient writes them into the parameter's array in place when no array read from
``p.value`` is alive any more, which nothing can then observe: it saves copying a whole
embedding table per step.)

**A step is all or nothing.** :meth:`Optimizer.step` first checks every gradient (shape, dtype,
and with ``check_finite=True`` that it holds no NaN or infinity); only when all pass does it touch
any step count, moment or value. A refused step raises an error naming the parameter and leaves
parameters and optimiser state bit for bit as they were.

**Row-sparse gradients.** A parameter declared with ``sparse_grad=True`` (``nn.Embedding(...,
sparse=True)``) has a :class:`~vgraph.ops.RowSparseGrad` as ``.grad``: only the rows looked up.
Every optimiser accepts it. :class:`SGD` (without momentum and weight decay) and :class:`Adagrad`
(without weight decay) update only those rows and give bit for bit the dense result (the other
rows would not move). :class:`Adam` / :class:`AdamW` with ``lazy=True`` give the lazy update of
PyTorch's ``SparseAdam``: moments and values change only in the rows present. Everywhere else the
gradient is made dense and the dense formula applies, so a result never depends on whether the
gradient was sparse unless ``lazy=True`` was asked for. See docs/training.md, "Sparse embedding
gradients".

**Resuming.** :meth:`Optimizer.state_dict` / :meth:`Optimizer.load_state_dict` (and the same pair
on every schedule) give the complete state by parameter name; :func:`vgraph.io.save_training_state`
writes it, with the parameters, to one checkpoint.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, ClassVar, NamedTuple

import numpy as np

from . import workspace
from .compute import ComputeNode
from .errors import ShapeError, VGraphError
from .ops import RowSparseGrad
from .workspace import computing

_getrefcount = sys.getrefcount

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "CosineAnnealingLR",
    "LRScheduler",
    "NonFiniteGradientError",
    "Optimizer",
    "RMSprop",
    "StepLR",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value",
    "clip_grad_value_",
]


class NonFiniteGradientError(VGraphError, ValueError):
    """A gradient holds NaN or infinite values where the caller asked for a check
    (``Optimizer(..., check_finite=True)``, ``clip_grad_norm_(..., error_if_nonfinite=True)``).
    Nothing was changed."""


# ---------------------------------------------------------------------------- checking arguments


def _real(
    name: str,
    value: Any,
    lo: float = 0.0,
    hi: float = math.inf,
    lo_open: bool = False,
    hi_open: bool = True,
    allow_inf: bool = False,
) -> float:
    """``value`` as a float after checking it is a real number in the interval (lo, hi).

    Raises:
        TypeError: not a real number (a string, a bool, None, an array …).
        ValueError: NaN, infinite (unless ``allow_inf``), or outside the interval.
    """
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu":
        value = value.item()  # a 0-d array, e.g. a computed learning rate
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    bad = math.isnan(v) or (math.isinf(v) and not allow_inf)
    bad = bad or v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi and not allow_inf)
    if bad:
        raise ValueError(f"invalid {name}: {value!r} (expected a number in {interval})")
    return v


def _int(name: str, value: Any, lo: int) -> int:
    """``value`` as an int >= ``lo``; integral floats (``50.0``) are accepted, ``2.5`` is not.

    Raises:
        TypeError: not a number. ValueError: not integral, or below ``lo``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Integral):
        v = int(value)
    elif math.isfinite(float(value)) and float(value).is_integer():
        v = int(float(value))
    else:
        raise ValueError(f"invalid {name}: {value!r} (expected an int >= {lo})")
    if v < lo:
        raise ValueError(f"invalid {name}: {value!r} (expected an int >= {lo})")
    return v


def _flag(name: str, value: Any) -> bool:
    """``value`` as a bool, accepting only ``True``/``False``.

    Raises:
        TypeError: anything else (``"yes"``, ``1``, ``None``).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _betas(value: Any) -> tuple[float, float]:
    """Adam's ``betas``: a pair of numbers, each in [0, 1).

    Raises:
        TypeError: not a sequence of two numbers. ValueError: a wrong length or a value outside [0, 1).
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, np.ndarray)):
        raise TypeError(f"betas must be a pair (beta1, beta2), got {type(value).__name__} {value!r}")
    if len(value) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {len(value)} value(s): {value!r}")
    b1 = _real("betas[0]", value[0], 0.0, 1.0)
    b2 = _real("betas[1]", value[1], 0.0, 1.0)
    return (b1, b2)


# ---------------------------------------------------------------------------- resolving params


#: The shape and dtype a parameter not created yet will have, by name (``None``: not one of ours).
_Declared = Callable[[str], "tuple[tuple[int, ...], np.dtype] | None"]


def _param_source(params: Any) -> Callable[[], list[ComputeNode]]:
    """A function returning the current parameter nodes of ``params`` (see the module docstring)."""
    return _sources(params)[0]


def _sources(params: Any) -> tuple[Callable[[], list[ComputeNode]], _Declared]:
    """Two functions for ``params``: the current parameter nodes, and the declared (shape, dtype)
    of a parameter it will include once a build creates it (an untied copy ``"W@7"``), or ``None``
    for a name it will never include.

    Raises:
        TypeError: something that is neither a store, a module, nor an iterable of parameter nodes.
        ValueError: an empty list.
    """
    from .virtual import ParameterStore, VirtualGraph, VirtualNode

    if isinstance(params, VirtualGraph):
        params = params.params
    if isinstance(params, ParameterStore):
        return params.parameters, params.declared
    if isinstance(params, (ComputeNode, VirtualNode)):
        params = [params]
    elif callable(getattr(params, "parameters", None)):
        module = params
        return (lambda: list(module.parameters())), partial(_module_declared, module)
    if isinstance(params, (str, bytes, Mapping)):
        items: list[Any] | None = None
    else:
        try:
            items = list(params)
        except TypeError:
            items = None
    if items is None:
        raise TypeError(
            f"params must be a ParameterStore, a VirtualGraph, a module with parameters(), or an "
            f"iterable of parameter nodes; got {type(params).__name__}"
        )
    if not items:
        raise ValueError("the optimiser got an empty parameter list")
    sources: list[tuple[Callable[[], list[ComputeNode]], _Declared]] = []
    for item in items:
        if isinstance(item, ComputeNode):
            if item.op is not None:
                raise TypeError(f"{item.describe()} is computed by {item.op.name}; optimisers update leaves")
            sources.append((partial(_single, item), _nothing_declared))
        elif isinstance(item, VirtualNode):
            if item.kind != "parameter":
                raise TypeError(f"{item.describe()} is not a parameter")
            sources.append((partial(_store_entries, item), partial(_entry_declared, item)))
        elif isinstance(item, (ParameterStore, VirtualGraph)) or callable(getattr(item, "parameters", None)):
            sources.append(_sources(item))
        else:
            raise TypeError(f"not a parameter node: {item!r} ({type(item).__name__})")
    if all(isinstance(i, ComputeNode) for i in items):
        fixed = _unique(items)  # the common case: a fixed list, resolved once
        return (lambda: fixed), _nothing_declared
    lookups = [declared for _, declared in sources]
    return (lambda: _unique(p for src, _ in sources for p in src())), partial(_first_declared, lookups)


def _single(node: ComputeNode) -> list[ComputeNode]:
    return [node]


def _nothing_declared(name: str) -> None:
    return None


def _first_declared(lookups: list[_Declared], name: str) -> tuple[tuple[int, ...], np.dtype] | None:
    for lookup in lookups:
        spec = lookup(name)
        if spec is not None:
            return spec
    return None


def _is_entry_of(name: str, base: str) -> bool:
    """Whether store name ``name`` is parameter ``base`` or one of its untied copies."""
    return name == base or name.startswith(base + "@")


def _store_entries(decl: Any) -> list[ComputeNode]:
    """The store entries of a virtual parameter: itself if shared, else all its untied copies."""
    store = decl.graph.params
    return [store[k] for k in store if _is_entry_of(k, decl.name)]


def _entry_declared(decl: Any, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
    return decl.graph.params.declared(name) if _is_entry_of(name, decl.name) else None


def _module_declared(module: Any, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
    """For a :mod:`vgraph.nn` module (its ``graph`` and ``parameter_names()``): the declared spec
    of ``name`` if it is one of the module's parameters or their untied copies."""
    names = getattr(module, "parameter_names", None)
    declared = getattr(getattr(getattr(module, "graph", None), "params", None), "declared", None)
    if not callable(names) or not callable(declared):
        return None
    if not any(_is_entry_of(name, base) for base in names()):
        return None
    return declared(name)  # type: ignore[no-any-return]


def _unique(nodes: Iterable[ComputeNode]) -> list[ComputeNode]:
    seen: dict[int, ComputeNode] = {}
    for n in nodes:
        seen.setdefault(id(n), n)
    return list(seen.values())


def _names(params: list[ComputeNode]) -> list[str]:
    """The names under which state is saved: the parameters' names (their keys in ``g.params``)
    when all are distinct, otherwise positions ``"0"``, ``"1"`` … as PyTorch does."""
    names = [p.name for p in params]
    if all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names):
        return names  # type: ignore[return-value]
    return [str(i) for i in range(len(params))]


def _label(p: ComputeNode) -> str:
    return f"parameter {p.name!r}" if p.name else f"parameter {p.describe()}"


# ---------------------------------------------------------------------------- base class


class _Rows(NamedTuple):
    """A row-sparse update's result: the new values of the rows present (the others keep theirs)."""

    indices: np.ndarray
    values: np.ndarray


def _set_rows(p: ComputeNode, update: _Rows) -> None:
    """Give parameter ``p`` its updated rows. Its array is written in place when nothing but the
    node refers to it (no array read from ``p.value`` earlier is alive: such views refer to it),
    else a copy with the rows replaced becomes the value; either way the version is bumped.
    Copying a large embedding table to change a sentence's rows would cost more than the update."""
    arr = p._value
    # references: the node's attribute, this name and getrefcount's argument
    if type(arr) is np.ndarray and arr.base is None and arr.flags.writeable and _getrefcount(arr) == 3:
        arr[update.indices] = update.values
        p._set(arr, copy=False)
        return
    new = np.array(arr)  # a new array, as every update gives (see the module docstring)
    new[update.indices] = update.values
    p._set(new, copy=False)


class Optimizer:
    """Base class: holds the parameter source, the hyper-parameters and per-parameter state.

    Subclasses list their hyper-parameters in ``_hyper``, check them in :meth:`_check_hyper`
    (shared by the constructor and :meth:`load_state_dict`), name their per-parameter arrays in
    :meth:`_state_arrays`, and implement :meth:`_update` for one parameter. ``lr`` may be changed
    between steps (schedules do); it is checked when set.

    Args:
        params: what to update (see the module docstring).
        lr: the learning rate (a finite number >= 0).
        check_finite: refuse a step whose gradients hold NaN or infinity
            (:class:`NonFiniteGradientError`, nothing changed). Off by default: it costs one
            pass over every gradient per step.
        **hyper: the subclass's other hyper-parameters.

    Raises:
        TypeError: ``params`` holds something that is not a parameter, or a hyper-parameter is not
            a number (``lr="0.1"``) / a flag is not a bool.
        ValueError: an empty parameter list, or a hyper-parameter out of its range.
    """

    _hyper: tuple[str, ...] = ("lr",)
    #: Hyper-parameters added after state dicts were first written, with the value a state dict
    #: that lacks them means (so that older training-state files still load).
    _hyper_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: Any, lr: float, *, check_finite: bool = False, **hyper: Any) -> None:
        checked = self._check_hyper({"lr": lr, **hyper})
        finite = _flag("check_finite", check_finite)
        self._source, self._declared = _sources(params)
        for k, v in checked.items():
            setattr(self, k, v)
        self.check_finite = finite
        self.state: dict[int, dict[str, Any]] = {}  # keyed by id(node); nodes are kept alive in "node"
        # Loaded state for parameters that do not exist yet (untied copies a later build creates),
        # by name: adopted the first time such a parameter is stepped.
        self._pending: dict[str, dict[str, Any]] = {}

    @property
    def lr(self) -> float:
        """The learning rate; setting it checks it (a finite number >= 0)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = _real("lr", value)

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        """The hyper-parameters checked and normalised (floats, bools, tuples).

        Raises:
            TypeError / ValueError: naming the first bad one.
        """
        return {"lr": _real("lr", hp["lr"])}

    def _state_arrays(self, hp: Mapping[str, Any]) -> set[str]:
        """Names of the per-parameter state arrays under hyper-parameters ``hp``."""
        return set()

    def parameters(self) -> list[ComputeNode]:
        """The parameter nodes this optimiser updates, as of now."""
        return self._source()

    def zero_grad(self) -> None:
        """Clear ``.grad`` (set it to ``None``) of every parameter this optimiser updates."""
        for p in self._source():
            p.grad = None

    # -- stepping
    def _checked_grads(self) -> list[tuple[ComputeNode, np.ndarray | RowSparseGrad, str | None]]:
        """Every (parameter, gradient in the parameter's dtype, name of pending state to adopt) to
        update, after
        checking all of them. Changes nothing.

        Raises:
            ShapeError: a gradient whose shape is not its parameter's.
            TypeError: a gradient that is not real numbers (complex, bool, object …).
            NonFiniteGradientError: with ``check_finite``, a NaN or infinite gradient element.
        """
        params = self._source()
        names = _names(params) if self._pending else None
        work: list[tuple[ComputeNode, np.ndarray | RowSparseGrad, str | None]] = []
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            value = p.value
            if isinstance(g, RowSparseGrad):
                work.append((p, self._checked_rows(p, g, value), self._adopt(names, i, p, value)))
                continue
            try:
                arr = g if isinstance(g, np.ndarray) else np.asarray(g)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{_label(p)}: .grad is not an array ({e}); step refused, nothing changed"
                ) from e
            if arr.dtype.kind not in "fiu":
                raise TypeError(
                    f"{_label(p)}: .grad has dtype {arr.dtype}, expected real numbers; "
                    "step refused, nothing changed"
                )
            if arr.shape != value.shape:
                raise ShapeError(
                    f"{_label(p)}: .grad has shape {arr.shape} but the parameter has shape "
                    f"{value.shape}; step refused, nothing changed"
                )
            if arr.dtype == value.dtype:
                grad = arr
            else:
                with np.errstate(over="ignore"):  # an overflow is an inf that check_finite reports
                    grad = arr.astype(value.dtype)
            if self.check_finite and not np.isfinite(grad).all():
                n_nan = int(np.isnan(grad).sum())
                n_inf = int(np.isinf(grad).sum())
                raise NonFiniteGradientError(
                    f"{_label(p)}: .grad has {n_nan} NaN and {n_inf} infinite element(s) of "
                    f"{grad.size} (check_finite=True); step refused, nothing changed"
                )
            work.append((p, grad, self._adopt(names, i, p, value)))
        return work

    def _adopt(self, names: list[str] | None, i: int, p: ComputeNode, value: np.ndarray) -> str | None:
        """The name of loaded state that parameter ``p`` (position ``i``) takes up at this step, if
        any (checked against the parameter)."""
        st = self.state.get(id(p))
        if names is not None and (st is None or st["node"] is not p) and names[i] in self._pending:
            _check_arrays(names[i], self._pending[names[i]], value.shape, value.dtype)
            return names[i]
        return None

    def _checked_rows(self, p: ComputeNode, g: RowSparseGrad, value: np.ndarray) -> RowSparseGrad:
        """A row-sparse gradient checked as :meth:`_checked_grads` checks a dense one (on its rows),
        its values in the parameter's dtype."""
        if g.shape != value.shape:
            raise ShapeError(
                f"{_label(p)}: .grad has shape {g.shape} but the parameter has shape "
                f"{value.shape}; step refused, nothing changed"
            )
        vals = g.values
        if vals.dtype != value.dtype:
            with np.errstate(over="ignore"):
                g = g.with_values(vals.astype(value.dtype))
        if self.check_finite and not np.isfinite(g.values).all():
            n_nan = int(np.isnan(g.values).sum())
            n_inf = int(np.isinf(g.values).sum())
            raise NonFiniteGradientError(
                f"{_label(p)}: .grad has {n_nan} NaN and {n_inf} infinite element(s) in its "
                f"{g.indices.size} rows (check_finite=True); step refused, nothing changed"
            )
        return g

    @computing
    def step(self) -> None:
        """Update every bound parameter that has a gradient, by the optimiser's formula.

        All gradients are checked first; a refused step changes nothing (see the module docstring).

        Raises:
            ShapeError: a ``.grad`` whose shape differs from its parameter's (the message names
                the parameter and both shapes).
            TypeError: a ``.grad`` that is not real numbers.
            NonFiniteGradientError: with ``check_finite=True``, a gradient with NaN or infinity.
        """
        work = self._checked_grads()
        for p, grad, adopt in work:
            st = self.state.get(id(p))
            if st is None or st["node"] is not p:
                st = self.state[id(p)] = {"node": p, "step": 0}
                if adopt is not None:
                    st.update(self._pending.pop(adopt))
            st["step"] += 1
            if isinstance(grad, RowSparseGrad):
                rows = self._update_rows(p.value, grad, st)
                if isinstance(rows, _Rows):
                    _set_rows(p, rows)
                    continue
                new = rows
            else:
                new = self._update(p.value, grad, st)
            # A new array nothing else refers to (this name and getrefcount's argument) becomes the
            # value as it is; anything else is copied, as the value setter does.
            owned = type(new) is np.ndarray and new.base is None and _getrefcount(new) == 2
            p._set(new, copy=not owned)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        raise NotImplementedError

    def _update_rows(
        self, value: np.ndarray, grad: RowSparseGrad, state: dict[str, Any]
    ) -> np.ndarray | _Rows:
        """The update for a row-sparse gradient; by default the dense update of its dense form.
        Subclasses override it where touching only the rows present is exact (or asked for), and
        then return the new values of those rows alone (:class:`_Rows`)."""
        return self._update(value, grad.dense(), state)

    # -- saving and loading
    def state_dict(self) -> dict[str, Any]:
        """The optimiser's complete state, as copies: what :meth:`load_state_dict` takes.

        ``{"optimizer": class name, "hyperparameters": {name: value}, "state": {parameter name:
        {"step": int, <array name>: ndarray, ...}}}``. Parameters are named by their names (keys
        in ``g.params``, untied copies included); if the bound nodes have no distinct names, by
        position. Parameters that were never stepped have no entry.
        """
        params = self._source()
        state: dict[str, dict[str, Any]] = {}
        for name, p in zip(_names(params), params):
            st = self.state.get(id(p))
            if st is not None and st["node"] is p:
                state[name] = {
                    k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in st.items() if k != "node"
                }
        for name, st in self._pending.items():
            state.setdefault(
                name, {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in st.items()}
            )
        return {
            "optimizer": type(self).__name__,
            "hyperparameters": {k: getattr(self, k) for k in self._hyper},
            "state": state,
        }

    def _prepare_load(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
        """Check ``state_dict`` completely and stage what :meth:`load_state_dict` would set:
        hyper-parameters, state of bound parameters, state kept for untied copies not created yet,
        and the names ignored (only without ``strict``). Changes nothing.

        Raises:
            as :meth:`load_state_dict`.
        """
        strict = _flag("strict", strict)
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping (from Optimizer.state_dict()), got {type(state_dict).__name__}"
            )
        expected_keys = {"optimizer", "hyperparameters", "state"}
        if set(state_dict) != expected_keys:
            raise ValueError(
                f"not an optimiser state dict: keys {sorted(map(str, state_dict))}, expected {sorted(expected_keys)}"
            )
        kind = state_dict["optimizer"]
        if kind != type(self).__name__:
            raise ValueError(f"the state dict is of a {kind} optimiser; this one is {type(self).__name__}")
        hp = state_dict["hyperparameters"]
        if isinstance(hp, Mapping):
            hp = {**self._hyper_defaults, **hp}
        if not isinstance(hp, Mapping) or set(hp) != set(self._hyper):
            got = sorted(map(str, hp)) if isinstance(hp, Mapping) else type(hp).__name__
            raise ValueError(f"{kind} hyper-parameters must be {sorted(self._hyper)}, got {got}")
        hyper = self._check_hyper(hp)
        arrays = self._state_arrays(hyper)
        entries = state_dict["state"]
        if not isinstance(entries, Mapping):
            raise TypeError(f"state_dict['state'] must be a mapping, got {type(entries).__name__}")
        params = self._source()
        bound = dict(zip(_names(params), params))
        staged: dict[int, dict[str, Any]] = {}
        pending: dict[str, dict[str, Any]] = {}
        unknown: list[str] = []
        for name, entry in entries.items():
            if not isinstance(entry, Mapping):
                raise TypeError(
                    f"optimiser state of parameter {name!r} must be a mapping, got {type(entry).__name__}"
                )
            if set(entry) != {"step", *arrays}:
                raise ValueError(
                    f"optimiser state of parameter {name!r} has {sorted(map(str, entry))}, "
                    f"expected {sorted({'step', *arrays})} for {kind} with these hyper-parameters"
                )
            new: dict[str, Any] = {"step": _int(f"step of parameter {name!r}", entry["step"], 1)}
            for k in sorted(arrays):  # (a set: sorted, so the first error named is always the same)
                arr = entry[k]
                if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
                    raise TypeError(
                        f"optimiser state {k!r} of parameter {name!r} must be a float array, got {arr!r}"
                    )
                new[k] = np.array(arr)
            node = bound.get(name)
            if node is not None:
                _check_arrays(name, new, node.value.shape, node.value.dtype)
                staged[id(node)] = {"node": node, **new}
                continue
            # An untied copy no build has created yet: checked against its declaration now, kept
            # until a build creates it and it is first stepped.
            spec = self._declared(name) if isinstance(name, str) else None
            if spec is None:
                unknown.append(name)
                continue
            _check_arrays(name, new, *spec, declared=True)
            pending[name] = new
        if unknown and strict:
            raise ValueError(
                f"the state dict has state for parameter(s) {', '.join(map(repr, unknown))}, which this "
                f"optimiser does not update (it updates {', '.join(map(repr, bound)) or 'nothing'}, "
                "and the untied copies its model declares); pass strict=False to ignore them"
            )
        return hyper, staged, pending, unknown

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> list[str]:
        """Replace hyper-parameters and per-parameter state with ``state_dict``'s, checked first.

        State is matched to the bound parameters by name. State for an untied copy (``"W@7"``)
        that no build has created yet is checked against the copy's declared shape and dtype, kept,
        and taken up when that parameter is first stepped. Bound parameters without an entry start
        fresh.

        Args:
            state_dict: from :meth:`state_dict`.
            strict: state for a name this optimiser will never update (not a bound parameter,
                nor an untied copy its model declares) is an error, as PyTorch's
                ``load_state_dict(strict=True)``; with ``False`` it is ignored and its name returned.

        Returns:
            The names whose state was ignored (always empty with ``strict``).

        Raises:
            TypeError / ValueError: not a state dict of this optimiser class, a bad hyper-parameter,
                missing or extra arrays, a step count < 1, or (``strict``) names this optimiser
                does not update — all of them named.
            ShapeError: an array whose shape differs from its parameter's (or, for an untied copy
                not created yet, from its declaration). Nothing is changed when any error is raised.
        """
        hyper, staged, pending, unknown = self._prepare_load(state_dict, strict)
        for k, v in hyper.items():
            setattr(self, k, v)
        self.state = staged
        self._pending = pending
        return unknown

    def __repr__(self) -> str:
        params = self._source()
        size = sum(int(np.size(p.value)) for p in params)
        lines = [f"{type(self).__name__} (", f"    parameters: {len(params)} ({size:,} values)"]
        lines += [f"    {k}: {getattr(self, k)!r}" for k in self._hyper]
        lines += [f"    check_finite: {self.check_finite}", ")"]
        return "\n".join(lines)


def _check_arrays(
    name: str, entry: Mapping[str, Any], shape: tuple[int, ...], dtype: np.dtype, declared: bool = False
) -> None:
    """Every array of one parameter's state has the parameter's shape and dtype (``declared``: the
    parameter is an untied copy not created yet; shape and dtype are its declaration's)."""
    whose = "its declaration gives the parameter (not created yet)" if declared else "the parameter has"
    for k, v in entry.items():
        if isinstance(v, np.ndarray):
            if v.shape != shape:
                raise ShapeError(
                    f"optimiser state {k!r} of parameter {name!r} has shape {v.shape}, {whose} shape {shape}"
                )
            if v.dtype != dtype:
                raise TypeError(
                    f"optimiser state {k!r} of parameter {name!r} has dtype {v.dtype}, {whose} dtype {dtype}"
                )


class SGD(Optimizer):
    """Stochastic gradient descent, with optional (Nesterov) momentum and weight decay.

    Per parameter θ with gradient g, at step t::

        g ← g + λθ                                  (weight_decay λ)
        if μ ≠ 0:                                   (momentum μ)
            b ← g                    at t = 1
            b ← μ b + (1 − τ) g      after           (dampening τ)
            g ← g + μ b  if nesterov  else  b
        θ ← θ − lr · g

    Args:
        params: what to update (see the module docstring).
        lr: learning rate.
        momentum: momentum factor μ in [0, 1) (default 0: plain SGD).
        dampening: dampening τ in [0, 1] of the momentum (default 0).
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty λ >= 0 added to the gradient.
        check_finite: refuse steps with non-finite gradients (see :class:`Optimizer`).

    Raises:
        TypeError: a hyper-parameter that is not a number (or a bool for ``nesterov``).
        ValueError: hyper-parameters out of range, or Nesterov without momentum / with dampening.
    """

    _hyper = ("lr", "momentum", "dampening", "nesterov", "weight_decay")
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        *,
        check_finite: bool = False,
    ) -> None:
        super().__init__(params, lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                         weight_decay=weight_decay, check_finite=check_finite)  # fmt: skip

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        out = {
            "lr": _real("lr", hp["lr"]),
            "momentum": _real("momentum", hp["momentum"], 0.0, 1.0),
            "dampening": _real("dampening", hp["dampening"], 0.0, 1.0, hi_open=False),
            "nesterov": _flag("nesterov", hp["nesterov"]),
            "weight_decay": _real("weight_decay", hp["weight_decay"]),
        }
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")
        return out

    def _state_arrays(self, hp: Mapping[str, Any]) -> set[str]:
        return {"momentum_buffer"} if hp["momentum"] else set()

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        if self.weight_decay:
            grad = grad + self.weight_decay * value
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = np.array(grad)
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * grad
            grad = grad + self.momentum * buf if self.nesterov else buf
        return value - self.lr * grad

    def _update_rows(
        self, value: np.ndarray, grad: RowSparseGrad, state: dict[str, Any]
    ) -> np.ndarray | _Rows:
        if self.momentum or self.weight_decay:  # every row moves: the dense update
            return self._update(value, grad.dense(), state)
        rows = grad.indices
        return _Rows(rows, value[rows] - self.lr * grad.values)


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction; ``weight_decay`` is an L2 penalty.

    Per parameter θ with gradient g, at step t (m, v start at 0)::

        g ← g + λθ
        m ← β1 m + (1 − β1) g
        v ← β2 v + (1 − β2) g²
        m̂ = m / (1 − β1^t),   v̂ = v / (1 − β2^t)
        θ ← θ − lr · m̂ / (√v̂ + ε)

    **Lazy updates** (``lazy=True``), for row-sparse gradients (``nn.Embedding(..., sparse=True)``;
    PyTorch's ``SparseAdam``): when ``.grad`` is a :class:`~vgraph.ops.RowSparseGrad`, the formulas
    above run on the rows present only — m, v and θ of every other row stay as they are, weight
    decay included — with t the parameter's step count (as ``SparseAdam``). This is *not* dense
    Adam: there, a row not looked up still moves (m decays but is not zero), and its m and v decay;
    here it waits until it is looked up again, and then its moments resume from their old values.
    When every row is present at every step the two agree bit for bit. ε is added as above, to
    √v̂ (``SparseAdam`` adds it to √v before the bias correction, a difference in ε only).
    Dense gradients (other parameters) get dense Adam either way.

    Args:
        params: what to update. lr: learning rate (default 1e-3).
        betas: (β1, β2), each in [0, 1). eps: ε >= 0 added to the denominator.
        weight_decay: λ >= 0, added to the gradient (see :class:`AdamW` for decoupled decay).
        lazy: update only the rows present in a row-sparse gradient (see above). Default
            ``False``: a row-sparse gradient is made dense and updated by the formula above.
        check_finite: refuse steps with non-finite gradients (see :class:`Optimizer`).

    Raises:
        TypeError: a hyper-parameter that is not a number, or ``betas`` that is not a pair.
        ValueError: hyper-parameters out of range, ``betas`` of another length than 2.
    """

    _decoupled = False
    _hyper = ("lr", "betas", "eps", "weight_decay", "lazy")
    _hyper_defaults: ClassVar[dict[str, Any]] = {"lazy": False}
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    lazy: bool

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        lazy: bool = False,
        check_finite: bool = False,
    ) -> None:
        super().__init__(
            params, lr, betas=betas, eps=eps, weight_decay=weight_decay, lazy=lazy, check_finite=check_finite
        )

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "lr": _real("lr", hp["lr"]),
            "betas": _betas(hp["betas"]),
            "eps": _real("eps", hp["eps"]),
            "weight_decay": _real("weight_decay", hp["weight_decay"]),
            "lazy": _flag("lazy", hp["lazy"]),
        }

    def _state_arrays(self, hp: Mapping[str, Any]) -> set[str]:
        return {"exp_avg", "exp_avg_sq"}

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        b1, b2 = self.betas
        t = state["step"]
        if self.weight_decay:
            if self._decoupled:
                value = value * (1.0 - self.lr * self.weight_decay)
            else:
                grad = grad + self.weight_decay * value
        m = state.get("exp_avg")
        if m is None:
            m = state["exp_avg"] = np.zeros_like(value)
            state["exp_avg_sq"] = np.zeros_like(value)
        v = state["exp_avg_sq"]
        # The formula in place, through one scratch array (recycled when large): the same
        # operations in the same order as m += (1 - b1) * g; v += (1 - b2) * g * g;
        # value - (lr / bias1) * (m / (sqrt(v) / sqrt(bias2) + eps)), without their temporaries.
        tmp = workspace.empty(value.shape, m.dtype)
        m *= b1
        np.multiply(grad, 1.0 - b1, out=tmp)
        m += tmp
        v *= b2
        np.multiply(grad, 1.0 - b2, out=tmp)
        tmp *= grad
        v += tmp
        bias1 = 1.0 - b1**t
        bias2 = 1.0 - b2**t
        np.sqrt(v, out=tmp)
        tmp /= math.sqrt(bias2)
        tmp += self.eps
        np.divide(m, tmp, out=tmp)
        tmp *= self.lr / bias1
        new: np.ndarray = value - tmp  # a new array (see the module docstring)
        return new

    def _update_rows(
        self, value: np.ndarray, grad: RowSparseGrad, state: dict[str, Any]
    ) -> np.ndarray | _Rows:
        if not self.lazy:
            return self._update(value, grad.dense(), state)
        # The dense formula on the rows present, with the rows' state gathered and scattered back.
        if "exp_avg" not in state:
            state["exp_avg"] = np.zeros_like(value)
            state["exp_avg_sq"] = np.zeros_like(value)
        rows = grad.indices
        sub = {
            "step": state["step"],
            "exp_avg": state["exp_avg"][rows],
            "exp_avg_sq": state["exp_avg_sq"][rows],
        }
        new_rows = self._update(value[rows], grad.values, sub)
        state["exp_avg"][rows] = sub["exp_avg"]
        state["exp_avg_sq"][rows] = sub["exp_avg_sq"]
        return _Rows(rows, new_rows)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019).

    As :class:`Adam`, except that weight decay is not added to the gradient: it shrinks the
    parameter directly, before the Adam step::

        θ ← θ (1 − lr · λ)
        θ ← θ − lr · m̂ / (√v̂ + ε)          (m, v from the raw gradient)

    With ``lazy=True`` a row-sparse gradient updates (and decays) only the rows present, as for
    :class:`Adam`.

    Args:
        weight_decay: λ (default 1e-2, as in PyTorch); other arguments as :class:`Adam`.

    Raises:
        TypeError / ValueError: as :class:`Adam`.
    """

    _decoupled = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        lazy: bool = False,
        check_finite: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, lazy=lazy, check_finite=check_finite)


class RMSprop(Optimizer):
    """RMSprop (Hinton), optionally centred and with momentum.

    Per parameter θ with gradient g (v, b, ḡ start at 0)::

        g ← g + λθ
        v ← α v + (1 − α) g²
        ṽ = v;   if centered: ḡ ← α ḡ + (1 − α) g,  ṽ = v − ḡ²
        if μ > 0:  b ← μ b + g / (√ṽ + ε);   θ ← θ − lr · b
        else:      θ ← θ − lr · g / (√ṽ + ε)

    Args:
        params: what to update. lr: learning rate (default 1e-2). alpha: smoothing α in [0, 1]
        (0.99). eps: ε >= 0 (1e-8). weight_decay: λ >= 0. momentum: μ in [0, 1).
        centered: normalise by the variance estimate.
        check_finite: refuse steps with non-finite gradients (see :class:`Optimizer`).

    Raises:
        TypeError: a hyper-parameter that is not a number (or a bool for ``centered``).
        ValueError: hyper-parameters out of range.
    """

    _hyper = ("lr", "alpha", "eps", "weight_decay", "momentum", "centered")
    alpha: float
    eps: float
    weight_decay: float
    momentum: float
    centered: bool

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        check_finite: bool = False,
    ) -> None:
        super().__init__(params, lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                         centered=centered, check_finite=check_finite)  # fmt: skip

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "lr": _real("lr", hp["lr"]),
            "alpha": _real("alpha", hp["alpha"], 0.0, 1.0, hi_open=False),
            "eps": _real("eps", hp["eps"]),
            "weight_decay": _real("weight_decay", hp["weight_decay"]),
            "momentum": _real("momentum", hp["momentum"], 0.0, 1.0),
            "centered": _flag("centered", hp["centered"]),
        }

    def _state_arrays(self, hp: Mapping[str, Any]) -> set[str]:
        out = {"square_avg"}
        if hp["centered"]:
            out.add("grad_avg")
        if hp["momentum"] > 0:
            out.add("momentum_buffer")
        return out

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        a = self.alpha
        if self.weight_decay:
            grad = grad + self.weight_decay * value
        v = state.get("square_avg")
        if v is None:
            v = state["square_avg"] = np.zeros_like(value)
        v *= a
        v += (1.0 - a) * grad * grad
        if self.centered:
            gavg = state.setdefault("grad_avg", np.zeros_like(value))
            gavg *= a
            gavg += (1.0 - a) * grad
            avg = np.sqrt(v - gavg * gavg) + self.eps
        else:
            avg = np.sqrt(v) + self.eps
        if self.momentum > 0:
            buf = state.setdefault("momentum_buffer", np.zeros_like(value))
            buf *= self.momentum
            buf += grad / avg
            step: np.ndarray = self.lr * buf
        else:
            step = self.lr * (grad / avg)
        new: np.ndarray = value - step
        return new


class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011).

    Per parameter θ with gradient g at step t (the sum starts at ``initial_accumulator_value``)::

        lr_t = lr / (1 + (t − 1) η)                 (lr_decay η)
        g ← g + λθ
        sum ← sum + g²
        θ ← θ − lr_t · g / (√sum + ε)

    A row-sparse gradient (``nn.Embedding(..., sparse=True)``) updates only the rows present,
    without weight decay: the other rows would not change anyway (their sum gains 0 and their step
    is 0), so the result is the dense one bit for bit — PyTorch's sparse Adagrad. (The one
    exception: with ``eps = 0`` and a zero sum, dense Adagrad turns a row never looked up into NaN
    (0/0), the sparse update leaves it alone.) With weight decay every row moves: the gradient is
    made dense.

    Args:
        params: what to update. lr: learning rate (default 1e-2). lr_decay: η >= 0.
        weight_decay: λ >= 0. initial_accumulator_value: the sum's start (>= 0). eps: ε >= 0 (1e-10).
        check_finite: refuse steps with non-finite gradients (see :class:`Optimizer`).

    Raises:
        TypeError: a hyper-parameter that is not a number.
        ValueError: negative hyper-parameters.
    """

    _hyper = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    lr_decay: float
    weight_decay: float
    initial_accumulator_value: float
    eps: float

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        check_finite: bool = False,
    ) -> None:
        super().__init__(params, lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps,
                         check_finite=check_finite)  # fmt: skip

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "lr": _real("lr", hp["lr"]),
            "lr_decay": _real("lr_decay", hp["lr_decay"]),
            "weight_decay": _real("weight_decay", hp["weight_decay"]),
            "initial_accumulator_value": _real("initial_accumulator_value", hp["initial_accumulator_value"]),
            "eps": _real("eps", hp["eps"]),
        }

    def _state_arrays(self, hp: Mapping[str, Any]) -> set[str]:
        return {"sum"}

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        t = state["step"]
        if self.weight_decay:
            grad = grad + self.weight_decay * value
        s = state.get("sum")
        if s is None:
            s = state["sum"] = np.full_like(value, self.initial_accumulator_value)
        s += grad * grad
        clr = self.lr / (1.0 + (t - 1) * self.lr_decay)
        new: np.ndarray = value - clr * (grad / (np.sqrt(s) + self.eps))
        return new

    def _update_rows(
        self, value: np.ndarray, grad: RowSparseGrad, state: dict[str, Any]
    ) -> np.ndarray | _Rows:
        if self.weight_decay:  # every row moves: the dense update
            return self._update(value, grad.dense(), state)
        if "sum" not in state:
            state["sum"] = np.full_like(value, self.initial_accumulator_value)
        rows = grad.indices
        sub = {"step": state["step"], "sum": state["sum"][rows]}
        new_rows = self._update(value[rows], grad.values, sub)
        state["sum"][rows] = sub["sum"]
        return _Rows(rows, new_rows)


# ---------------------------------------------------------------------------- clipping


def _with_grads(params: Any) -> Iterator[tuple[ComputeNode, Any]]:
    for p in _param_source(params)():
        if p.grad is not None:
            yield p, p.grad


def _elements(g: Any) -> np.ndarray:
    """The elements of a gradient that can be non-zero: a row-sparse gradient's rows, or the array."""
    return g.values if isinstance(g, RowSparseGrad) else g


def _scaled(g: Any, coef: float) -> Any:
    if isinstance(g, RowSparseGrad):
        return g.with_values(g.values * np.asarray(coef, dtype=g.values.dtype))
    return g * np.asarray(coef, dtype=g.dtype)


def clip_grad_norm_(
    params: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> float:
    """Scale all gradients together, in place, so that their joint norm is at most ``max_norm``.

    PyTorch's ``torch.nn.utils.clip_grad_norm_``, same name and rule: the norm is taken over all
    gradients as if concatenated into one vector; if it exceeds ``max_norm``, every gradient is
    multiplied by ``max_norm / (norm + 1e-6)``. Parameters without a gradient are ignored. A
    row-sparse gradient (:class:`~vgraph.ops.RowSparseGrad`) counts its rows (the others are zero)
    and stays row-sparse.
    ``clip_grad_norm`` (no underscore) is the same function under its vgraph 0.1 name.

    Args:
        params: the parameters (same forms an optimiser takes, e.g. ``g.params``).
        max_norm: the largest allowed norm (> 0; ``inf`` never clips).
        norm_type: the p of the p-norm (> 0: ``2.0``; ``float("inf")`` for the largest magnitude).
        error_if_nonfinite: raise instead of scaling when the total norm is NaN or infinite.

    Returns:
        The total norm *before* clipping (0.0 if no parameter has a gradient).

    Raises:
        TypeError: a non-numeric ``max_norm`` or ``norm_type``.
        ValueError: ``max_norm`` or ``norm_type`` not positive.
        NonFiniteGradientError: with ``error_if_nonfinite``, a NaN or infinite total norm (the
            gradients are left unchanged).
    """
    max_norm = _real("max_norm", max_norm, lo_open=True, allow_inf=True)
    norm_type = _real("norm_type", norm_type, lo_open=True, allow_inf=True)
    error_if_nonfinite = _flag("error_if_nonfinite", error_if_nonfinite)
    pairs = list(_with_grads(params))
    if not pairs:
        return 0.0
    if math.isinf(norm_type):
        total = max(float(np.max(np.abs(_elements(g)))) if np.size(_elements(g)) else 0.0 for _, g in pairs)
    else:
        acc = sum(
            float(np.sum(np.abs(np.asarray(_elements(g), dtype=np.float64)) ** norm_type)) for _, g in pairs
        )
        total = acc ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        bad = [
            repr(p.name) if p.name else p.describe() for p, g in pairs if not np.isfinite(_elements(g)).all()
        ]
        raise NonFiniteGradientError(
            f"the total {norm_type:g}-norm of the gradients is {total}; non-finite gradients in "
            f"{', '.join(bad)}; nothing was clipped"
        )
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p, g in pairs:
            p.grad = _scaled(g, coef)
    return total


def clip_grad_value_(params: Any, clip_value: float) -> None:
    """Clamp every gradient element into ``[-clip_value, clip_value]``, in place.

    PyTorch's ``torch.nn.utils.clip_grad_value_``. ``clip_grad_value`` is the same function under
    its vgraph 0.1 name. A row-sparse gradient has its rows clamped and stays row-sparse.

    Args:
        params: the parameters (same forms an optimiser takes).
        clip_value: the bound (>= 0).

    Raises:
        TypeError: a non-numeric ``clip_value``. ValueError: a negative one.
    """
    clip_value = _real("clip_value", clip_value)
    for p, g in _with_grads(params):
        if isinstance(g, RowSparseGrad):
            p.grad = g.with_values(np.clip(g.values, -clip_value, clip_value))
        else:
            p.grad = np.clip(g, -clip_value, clip_value)


clip_grad_norm = clip_grad_norm_  # the vgraph 0.1 name, kept so existing training scripts run
clip_grad_value = clip_grad_value_  # likewise


# ---------------------------------------------------------------------------- schedules


class LRScheduler:
    """Base class of learning-rate schedules: sets ``optimizer.lr`` from an epoch counter.

    Creating a schedule sets ``last_epoch = 0`` and the optimiser's lr to the schedule's value at
    epoch 0 (the optimiser's lr at that moment, ``base_lr``); each :meth:`step` advances one epoch.

    Raises:
        TypeError: ``optimizer`` is not a vgraph optimiser.
    """

    _hyper: tuple[str, ...] = ()

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"a schedule takes a vgraph optimiser, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.last_epoch = 0
        optimizer.lr = self.lr_at(0)

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def lr_at(self, epoch: int) -> float:
        """The learning rate at ``epoch``."""
        raise NotImplementedError

    def step(self) -> float:
        """Advance one epoch and set the optimiser's lr; returns the new lr."""
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)
        return self.optimizer.lr

    def get_last_lr(self) -> float:
        """The lr set by the latest step (or at creation)."""
        return self.optimizer.lr

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (plain numbers): ``{"scheduler": class name, "last_epoch",
        "base_lr", and its hyper-parameters}``. The optimiser's lr is in the optimiser's state."""
        return {
            "scheduler": type(self).__name__,
            "last_epoch": self.last_epoch,
            "base_lr": self.base_lr,
            **{k: getattr(self, k) for k in self._hyper},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values, checked first. As in PyTorch, the optimiser's lr
        is not changed (load the optimiser's state for it); the next :meth:`step` sets it.

        Raises:
            TypeError / ValueError: a state dict of another schedule class, missing or extra
                keys, or bad values. Nothing is changed when raised.
        """
        epoch, base, hyper = self._prepare_load(state_dict)
        self.last_epoch = epoch
        self.base_lr = base
        for k, v in hyper.items():
            setattr(self, k, v)

    def _prepare_load(self, state_dict: Any) -> tuple[int, float, dict[str, Any]]:
        """``state_dict`` checked and normalised; changes nothing."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        keys = {"scheduler", "last_epoch", "base_lr", *self._hyper}
        if set(state_dict) != keys:
            raise ValueError(
                f"a {type(self).__name__} state dict has keys {sorted(keys)}, got {sorted(state_dict)}"
            )
        if state_dict["scheduler"] != type(self).__name__:
            raise ValueError(
                f"the state dict is of a {state_dict['scheduler']} schedule; this one is {type(self).__name__}"
            )
        epoch = _int("last_epoch", state_dict["last_epoch"], 0)
        base = _real("base_lr", state_dict["base_lr"])
        return epoch, base, self._check_hyper(state_dict)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._hyper)
        return (
            f"{type(self).__name__}({hp}{', ' if hp else ''}base_lr={self.base_lr!r}, "
            f"last_epoch={self.last_epoch}, lr={self.optimizer.lr!r})"
        )


class StepLR(LRScheduler):
    """Multiply the learning rate by ``gamma`` every ``step_size`` epochs:
    ``lr = base_lr * gamma ** (epoch // step_size)``.

    Args:
        optimizer: the optimiser whose ``lr`` to set.
        step_size: epochs between decays (an int >= 1).
        gamma: the factor (a number > 0).

    Raises:
        TypeError: non-numeric arguments. ValueError: ``step_size < 1`` or ``gamma <= 0``.
    """

    _hyper = ("step_size", "gamma")

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1) -> None:
        hp = self._check_hyper({"step_size": step_size, "gamma": gamma})
        self.step_size: int = hp["step_size"]
        self.gamma: float = hp["gamma"]
        super().__init__(optimizer)

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "step_size": _int("step_size", hp["step_size"], 1),
            "gamma": _real("gamma", hp["gamma"], lo_open=True),
        }

    def lr_at(self, epoch: int) -> float:
        return self.base_lr * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from ``base_lr`` to ``eta_min`` over ``T_max`` epochs (SGDR without
    restarts): ``lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2``.

    Past ``T_max`` the cosine continues (the lr rises again), as PyTorch's closed form does.

    Args:
        optimizer: the optimiser whose ``lr`` to set.
        T_max: the half period in epochs (an int >= 1).
        eta_min: the smallest lr (>= 0).

    Raises:
        TypeError: non-numeric arguments. ValueError: ``T_max < 1`` or a negative ``eta_min``.
    """

    _hyper = ("T_max", "eta_min")

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0) -> None:
        hp = self._check_hyper({"T_max": T_max, "eta_min": eta_min})
        self.T_max: int = hp["T_max"]
        self.eta_min: float = hp["eta_min"]
        super().__init__(optimizer)

    @classmethod
    def _check_hyper(cls, hp: Mapping[str, Any]) -> dict[str, Any]:
        return {"T_max": _int("T_max", hp["T_max"], 1), "eta_min": _real("eta_min", hp["eta_min"])}

    def lr_at(self, epoch: int) -> float:
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max)) / 2
