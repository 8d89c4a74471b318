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
array read from ``p.value`` earlier is never modified.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .compute import ComputeNode

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "CosineAnnealingLR",
    "LRScheduler",
    "Optimizer",
    "RMSprop",
    "StepLR",
    "clip_grad_norm",
    "clip_grad_value",
]

# ---------------------------------------------------------------------------- resolving params


def _param_source(params: Any) -> Callable[[], list[ComputeNode]]:
    """A function returning the current parameter nodes of ``params`` (see the module docstring).

    Raises:
        TypeError: something that is neither a store, a module, nor an iterable of parameter nodes.
    """
    from .virtual import ParameterStore, VirtualGraph, VirtualNode

    if isinstance(params, VirtualGraph):
        store = params.params
        return store.parameters
    if isinstance(params, ParameterStore):
        return params.parameters
    if isinstance(params, (ComputeNode, VirtualNode)):
        params = [params]
    elif callable(getattr(params, "parameters", None)):
        return lambda: list(params.parameters())
    try:
        items = list(params)
    except TypeError:
        raise TypeError(
            f"params must be a ParameterStore, a VirtualGraph, a module with parameters(), or an "
            f"iterable of parameter nodes; got {type(params).__name__}"
        ) from None
    if not items:
        raise ValueError("the optimiser got an empty parameter list")
    sources: list[Callable[[], list[ComputeNode]]] = []
    for item in items:
        if isinstance(item, ComputeNode):
            if item.op is not None:
                raise TypeError(f"{item.describe()} is computed by {item.op.name}; optimisers update leaves")
            sources.append(lambda item=item: [item])
        elif isinstance(item, VirtualNode):
            if item.kind != "parameter":
                raise TypeError(f"{item.describe()} is not a parameter")
            sources.append(lambda item=item: _store_entries(item))
        elif isinstance(item, (ParameterStore, VirtualGraph)) or callable(getattr(item, "parameters", None)):
            sources.append(_param_source(item))
        else:
            raise TypeError(f"not a parameter node: {item!r} ({type(item).__name__})")
    if all(isinstance(i, ComputeNode) for i in items):
        fixed = _unique(items)  # the common case: a fixed list, resolved once
        return lambda: fixed
    return lambda: _unique(p for src in sources for p in src())


def _store_entries(decl: Any) -> list[ComputeNode]:
    """The store entries of a virtual parameter: itself if shared, else all its untied copies."""
    store = decl.graph.params
    name = decl.name
    return [store[k] for k in store if k == name or k.startswith(name + "@")]


def _unique(nodes: Iterable[ComputeNode]) -> list[ComputeNode]:
    seen: dict[int, ComputeNode] = {}
    for n in nodes:
        seen.setdefault(id(n), n)
    return list(seen.values())


def _check_nonneg(**values: float) -> None:
    for name, v in values.items():
        if not v >= 0.0:  # also rejects NaN
            raise ValueError(f"invalid {name}: {v} (must be >= 0)")


# ---------------------------------------------------------------------------- base class


class Optimizer:
    """Base class: holds the parameter source, the learning rate ``lr`` and per-parameter state.

    Subclasses implement :meth:`_update` for one parameter. ``lr`` is a plain attribute that
    schedules (and users) may change between steps.

    Args:
        params: what to update (see the module docstring).
        lr: the learning rate (>= 0).

    Raises:
        TypeError: ``params`` holds something that is not a parameter.
        ValueError: an empty parameter list, or a negative learning rate.
    """

    def __init__(self, params: Any, lr: float) -> None:
        _check_nonneg(lr=lr)
        self._source = _param_source(params)
        self.lr = float(lr)
        self.state: dict[int, dict[str, Any]] = {}  # keyed by id(node); nodes are kept alive in "node"

    def parameters(self) -> list[ComputeNode]:
        """The parameter nodes this optimiser updates, as of now."""
        return self._source()

    def zero_grad(self) -> None:
        """Clear ``.grad`` (set it to ``None``) of every parameter this optimiser updates."""
        for p in self._source():
            p.grad = None

    def step(self) -> None:
        """Update every bound parameter that has a gradient, by the optimiser's formula."""
        for p in self._source():
            if p.grad is None:
                continue
            st = self.state.get(id(p))
            if st is None or st["node"] is not p:
                st = self.state[id(p)] = {"node": p, "step": 0}
            st["step"] += 1
            grad = np.asarray(p.grad, dtype=p.value.dtype)
            p.value = self._update(p.value, grad, st)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        raise NotImplementedError


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
        momentum: momentum factor μ (default 0: plain SGD).
        dampening: dampening τ of the momentum (default 0).
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty λ added to the gradient.

    Raises:
        ValueError: negative hyper-parameters, or Nesterov without momentum / with dampening.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        _check_nonneg(momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")
        super().__init__(params, lr)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)

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


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction; ``weight_decay`` is an L2 penalty.

    Per parameter θ with gradient g, at step t (m, v start at 0)::

        g ← g + λθ
        m ← β1 m + (1 − β1) g
        v ← β2 v + (1 − β2) g²
        m̂ = m / (1 − β1^t),   v̂ = v / (1 − β2^t)
        θ ← θ − lr · m̂ / (√v̂ + ε)

    Args:
        params: what to update. lr: learning rate (default 1e-3).
        betas: (β1, β2), each in [0, 1). eps: ε added to the denominator.
        weight_decay: λ, added to the gradient (see :class:`AdamW` for decoupled decay).

    Raises:
        ValueError: hyper-parameters out of range.
    """

    _decoupled = False

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        _check_nonneg(eps=eps, weight_decay=weight_decay)
        super().__init__(params, lr)
        self.betas = (float(b1), float(b2))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

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
        m *= b1
        m += (1.0 - b1) * grad
        v *= b2
        v += (1.0 - b2) * grad * grad
        bias1 = 1.0 - b1**t
        bias2 = 1.0 - b2**t
        denom = np.sqrt(v) / math.sqrt(bias2) + self.eps
        return value - (self.lr / bias1) * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019).

    As :class:`Adam`, except that weight decay is not added to the gradient: it shrinks the
    parameter directly, before the Adam step::

        θ ← θ (1 − lr · λ)
        θ ← θ − lr · m̂ / (√v̂ + ε)          (m, v from the raw gradient)

    Args:
        weight_decay: λ (default 1e-2, as in PyTorch); other arguments as :class:`Adam`.
    """

    _decoupled = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


class RMSprop(Optimizer):
    """RMSprop (Hinton), optionally centred and with momentum.

    Per parameter θ with gradient g (v, b, ḡ start at 0)::

        g ← g + λθ
        v ← α v + (1 − α) g²
        ṽ = v;   if centered: ḡ ← α ḡ + (1 − α) g,  ṽ = v − ḡ²
        if μ > 0:  b ← μ b + g / (√ṽ + ε);   θ ← θ − lr · b
        else:      θ ← θ − lr · g / (√ṽ + ε)

    Args:
        params: what to update. lr: learning rate (default 1e-2). alpha: smoothing α (0.99).
        eps: ε (1e-8). weight_decay: λ. momentum: μ. centered: normalise by the variance estimate.

    Raises:
        ValueError: negative hyper-parameters.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
    ) -> None:
        _check_nonneg(alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
        super().__init__(params, lr)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.centered = bool(centered)

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
            return value - self.lr * buf
        return value - self.lr * (grad / avg)


class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011).

    Per parameter θ with gradient g at step t (the sum starts at ``initial_accumulator_value``)::

        lr_t = lr / (1 + (t − 1) η)                 (lr_decay η)
        g ← g + λθ
        sum ← sum + g²
        θ ← θ − lr_t · g / (√sum + ε)

    Args:
        params: what to update. lr: learning rate (default 1e-2). lr_decay: η.
        weight_decay: λ. initial_accumulator_value: the sum's start. eps: ε (1e-10).

    Raises:
        ValueError: negative hyper-parameters.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        _check_nonneg(lr_decay=lr_decay, weight_decay=weight_decay,
                      initial_accumulator_value=initial_accumulator_value, eps=eps)  # fmt: skip
        super().__init__(params, lr)
        self.lr_decay = float(lr_decay)
        self.weight_decay = float(weight_decay)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.eps = float(eps)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        t = state["step"]
        if self.weight_decay:
            grad = grad + self.weight_decay * value
        s = state.get("sum")
        if s is None:
            s = state["sum"] = np.full_like(value, self.initial_accumulator_value)
        s += grad * grad
        clr = self.lr / (1.0 + (t - 1) * self.lr_decay)
        return value - clr * (grad / (np.sqrt(s) + self.eps))


# ---------------------------------------------------------------------------- clipping


def _with_grads(params: Any) -> Iterator[ComputeNode]:
    for p in _param_source(params)():
        if p.grad is not None:
            yield p


def clip_grad_norm(params: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale all gradients together so that their joint norm is at most ``max_norm``.

    The norm is taken over all gradients as if concatenated into one vector. If it exceeds
    ``max_norm``, every gradient is multiplied by ``max_norm / (norm + 1e-6)`` (PyTorch's rule).
    Parameters without a gradient are ignored.

    Args:
        params: the parameters (same forms an optimiser takes, e.g. ``g.params``).
        max_norm: the largest allowed norm (> 0).
        norm_type: the p of the p-norm (``2.0``; ``float("inf")`` for the largest magnitude).

    Returns:
        The total norm *before* clipping (0.0 if no parameter has a gradient).

    Raises:
        ValueError: ``max_norm`` is not positive or ``norm_type`` is not positive.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0, got {norm_type}")
    nodes = list(_with_grads(params))
    if not nodes:
        return 0.0
    if math.isinf(norm_type):
        total = max(float(np.max(np.abs(p.grad))) if np.size(p.grad) else 0.0 for p in nodes)
    else:
        acc = sum(float(np.sum(np.abs(np.asarray(p.grad, dtype=np.float64)) ** norm_type)) for p in nodes)
        total = acc ** (1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in nodes:
            p.grad = p.grad * np.asarray(coef, dtype=p.grad.dtype)
    return total


def clip_grad_value(params: Any, clip_value: float) -> None:
    """Clamp every gradient element into ``[-clip_value, clip_value]``.

    Args:
        params: the parameters (same forms an optimiser takes).
        clip_value: the bound (>= 0).

    Raises:
        ValueError: a negative ``clip_value``.
    """
    _check_nonneg(clip_value=clip_value)
    for p in _with_grads(params):
        p.grad = np.clip(p.grad, -clip_value, clip_value)


# ---------------------------------------------------------------------------- schedules


class LRScheduler:
    """Base class of learning-rate schedules: sets ``optimizer.lr`` from an epoch counter.

    Creating a schedule sets ``last_epoch = 0`` and the optimiser's lr to the schedule's value at
    epoch 0 (the optimiser's lr at that moment, ``base_lr``); each :meth:`step` advances one epoch.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"a schedule takes a vgraph optimiser, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.last_epoch = 0
        optimizer.lr = self.lr_at(0)

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


class StepLR(LRScheduler):
    """Multiply the learning rate by ``gamma`` every ``step_size`` epochs:
    ``lr = base_lr * gamma ** (epoch // step_size)``.

    Raises:
        ValueError: ``step_size < 1``.
    """

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1) -> None:
        if int(step_size) != step_size or step_size < 1:
            raise ValueError(f"step_size must be a positive int, got {step_size}")
        self.step_size = int(step_size)
        self.gamma = float(gamma)
        super().__init__(optimizer)

    def lr_at(self, epoch: int) -> float:
        return self.base_lr * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from ``base_lr`` to ``eta_min`` over ``T_max`` epochs (SGDR without
    restarts): ``lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2``.

    Past ``T_max`` the cosine continues (the lr rises again), as PyTorch's closed form does.

    Raises:
        ValueError: ``T_max < 1``.
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0) -> None:
        if int(T_max) != T_max or T_max < 1:
            raise ValueError(f"T_max must be a positive int, got {T_max}")
        self.T_max = int(T_max)
        self.eta_min = float(eta_min)
        super().__init__(optimizer)

    def lr_at(self, epoch: int) -> float:
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max)) / 2
