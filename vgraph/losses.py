"""Loss functions on graph nodes.

Every loss is written with node operators and :mod:`vgraph.functions` only, so it works on
virtual nodes (declaring the ops in the model, inside a loop body too) and on compute nodes
(computing them at once) alike. Targets may be nodes or plain arrays (which become constants).

``reduction``: ``"mean"`` (default) averages over every element (for classification losses:
over every label), ``"sum"`` adds them, ``"none"`` returns the per-element losses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import functions as F
from .compute import ComputeNode
from .errors import ShapeError
from .functions import Operand

__all__ = ["bce_with_logits", "cross_entropy", "mse_loss", "nll_loss"]

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, _REDUCTIONS))}; got {reduction!r}")


def _reduce(x: Any, reduction: str) -> Any:
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    return x


def mse_loss(pred: Any, target: Any, reduction: str = "mean") -> Any:
    """Mean squared error: ``(pred - target) ** 2``, reduced.

    Args:
        pred: a node. target: a node or an array broadcastable against it.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Returns:
        A scalar node (``"mean"``/``"sum"``) or the elementwise losses (``"none"``).

    Raises:
        ValueError: an unknown reduction.
    """
    _check_reduction(reduction)
    d = pred - target
    return _reduce(d * d, reduction)


def bce_with_logits(logits: Any, targets: Any, reduction: str = "mean") -> Any:
    """Binary cross-entropy of ``sigmoid(logits)`` against ``targets`` in ``[0, 1]``, stably.

    Per element ``-(y log σ(x) + (1 - y) log(1 - σ(x))) = softplus(x) - x y``, where
    ``softplus(x) = log(1 + e^x)`` is computed as ``max(x, 0) + log1p(e^{-|x|})``: no overflow for
    any ``x`` (``x = ±1000`` is fine). Written this way (rather than as
    ``relu(x) - x y + softplus(-|x|)``) the gradient is ``σ(x) - y`` everywhere, also at
    ``x = 0``, where the kinks of ``relu`` and ``|x|`` would otherwise give a wrong subgradient.

    Args:
        logits: a node of real scores. targets: a node or array of the same shape (probabilities).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Returns:
        A scalar node, or the elementwise losses for ``"none"``.

    Raises:
        ValueError: an unknown reduction.
    """
    _check_reduction(reduction)
    return _reduce(F.softplus(logits) - logits * targets, reduction)


def nll_loss(log_probs: Any, labels: Any, reduction: str = "mean", num_classes: int | None = None) -> Any:
    """Negative log-likelihood: ``-log_probs[..., labels]`` for each label, reduced.

    ``log_probs`` has shape ``S + (C,)`` (e.g. ``(batch, classes)``) and ``labels`` holds integer
    class indices of shape ``S``. Labels may be given two ways:

    * an integer **array** (or list): the log-probabilities are picked with ``GetItem`` and an
      integer-array index, ``log_probs[arange(B), labels]``;
    * an integer **node** (e.g. ``g.input("labels")`` fed at build time, since a virtual graph's
      labels change with every build): ``(log_probs * one_hot(labels)).sum(-1)``, the one-hot
      built from graph ops (see :func:`vgraph.nn.one_hot`). The class count C comes from
      ``num_classes``, else from ``log_probs`` (its shape for a compute node; for a virtual node,
      a tiny build-time constant ``arange(C)`` is derived from its value).

    Both give the same values and gradients. Labels outside ``[0, C)`` are an error for arrays
    (checked when ``log_probs``'s shape is known) and contribute zero loss for nodes.

    Args:
        log_probs: a node of log-probabilities (last axis: classes).
        labels: integer class indices (array or node).
        reduction: ``"mean"`` over labels, ``"sum"``, or ``"none"`` (shape ``S``).
        num_classes: C, optional (only used for node labels).

    Returns:
        A scalar node, or the per-label losses for ``"none"``.

    Raises:
        ValueError: an unknown reduction, or array labels that are not integers or out of range.
        ShapeError: array labels whose shape is not ``log_probs.shape[:-1]`` (compute nodes).
    """
    _check_reduction(reduction)
    if isinstance(labels, Operand):
        picked = (log_probs * _one_hot_like(log_probs, labels, num_classes)).sum(axis=-1)
    else:
        idx = np.asarray(labels)
        if idx.dtype.kind not in "iu":
            raise ValueError(f"labels must be integer class indices, got dtype {idx.dtype}")
        if isinstance(log_probs, ComputeNode):
            shape = log_probs.shape
            if idx.shape != shape[:-1]:
                raise ShapeError(
                    f"labels have shape {idx.shape}; expected {shape[:-1]} for log-probabilities {shape}"
                )
            if idx.size and (idx.min() < 0 or idx.max() >= shape[-1]):
                raise ValueError(f"labels must be in [0, {shape[-1]}), got {idx.min()}..{idx.max()}")
        elif idx.size and idx.min() < 0:
            raise ValueError(f"labels must be non-negative class indices, got {idx.min()}")
        picked = log_probs[(*np.indices(idx.shape, sparse=True), idx)]
    return _reduce(-picked, reduction)


def cross_entropy(logits: Any, labels: Any, reduction: str = "mean", num_classes: int | None = None) -> Any:
    """Softmax cross-entropy: ``-log_softmax(logits)[..., labels]``, reduced.

    Computed through ``log_softmax`` (log-sum-exp shifted by the maximum), so logits of
    ``±1000`` give finite losses and gradients. ``labels`` are integer class indices, as an array
    or as a node; see :func:`nll_loss` for how each is handled.

    Args:
        logits: a node of shape ``S + (C,)``, e.g. ``(batch, classes)``.
        labels: integer class indices of shape ``S`` (array or node).
        reduction: ``"mean"`` (over labels), ``"sum"`` or ``"none"``.
        num_classes: C, optional (only used for node labels).

    Returns:
        A scalar node, or the per-label losses for ``"none"``.

    Raises:
        ValueError: an unknown reduction; array labels that are not integers or out of range.
        ShapeError: array labels of the wrong shape (compute nodes).
    """
    _check_reduction(reduction)
    return nll_loss(F.log_softmax(logits, axis=-1), labels, reduction, num_classes)


def _one_hot_like(scores: Any, labels: Any, num_classes: int | None) -> Any:
    """One-hot rows for node ``labels``, with as many classes as ``scores``'s last axis."""
    if num_classes is not None:
        classes: Any = np.arange(int(num_classes))
    elif isinstance(scores, ComputeNode):
        classes = np.arange(scores.shape[-1])
    elif hasattr(scores, "graph") and hasattr(scores.graph, "sample"):
        # A virtual node has no shape until it is built: derive arange(C) from its value then.
        classes = scores.graph.sample(_class_range, like=scores, name="classes")
    else:  # pragma: no cover - every node is a compute or a virtual node
        raise TypeError(f"cannot tell the number of classes of {scores!r}; pass num_classes=")
    return F.where(labels[..., None] - classes, 0.0, 1.0)


def _class_range(rng: np.random.Generator, like: np.ndarray, training: bool) -> np.ndarray:
    return np.arange(np.shape(like)[-1])
