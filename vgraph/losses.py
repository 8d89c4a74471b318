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


def _checked_labels(x: Any, labels: Any, what: str) -> Any:
    """``labels`` as given if a node, else as an array checked now: integer, non-negative, and of
    ``x``'s shape without its class axis when ``x`` is a compute node (a virtual node's shape is
    known at build time; the op checks it then, naming its node)."""
    if isinstance(labels, Operand):
        return labels
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if labels.size and labels.min() < 0:
        raise ValueError(f"labels must be non-negative class indices, got {labels.min()}")
    if isinstance(x, ComputeNode) and labels.shape != x.shape[:-1]:
        raise ShapeError(
            f"labels have shape {labels.shape}; expected {x.shape[:-1]} for {what} of shape {x.shape}"
        )
    return labels


def nll_loss(log_probs: Any, labels: Any, reduction: str = "mean") -> Any:
    """Negative log-likelihood: ``-log_probs[..., labels]`` for each label, reduced.

    ``log_probs`` has shape ``S + (C,)`` (e.g. ``(batch, classes)``) and ``labels`` holds integer
    class indices in ``[0, C)`` of shape ``S``: a numpy array, or a node (e.g. ``g.input("labels")``
    fed at each build). Each row's log-probability is picked with
    :func:`vgraph.take_along_axis`, so the cost does not grow with the number of classes.

    Args:
        log_probs: a node of log-probabilities (last axis: classes).
        labels: integer class indices (array or node).
        reduction: ``"mean"`` over labels, ``"sum"``, or ``"none"`` (shape ``S``).

    Returns:
        A scalar node, or the per-label losses for ``"none"``.

    Raises:
        ValueError: an unknown reduction, or array labels that are not integers or are negative.
        ShapeError: labels of the wrong shape, or a label ``>= C`` (when the loss is computed; it
            names the node). Negative labels in a node count from the end, as numpy indices do.
    """
    _check_reduction(reduction)
    labels = _checked_labels(log_probs, labels, "log-probabilities")
    picked = F.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return _reduce(-picked, reduction)


def cross_entropy(logits: Any, labels: Any, reduction: str = "mean") -> Any:
    """Softmax cross-entropy: ``-log_softmax(logits)[..., labels]``, reduced.

    The per-label losses are one fused ``SoftmaxCrossEntropy`` node
    (:func:`vgraph.functions.softmax_cross_entropy`): each row's log-sum-exp, shifted by the row
    maximum (logits of ``±1000`` give finite losses and gradients), minus its label's logit. Its
    backward writes ``softmax - onehot`` (times the incoming gradient) into one array the size of
    the logits. The values equal ``nll_loss(log_softmax(logits), labels)``, which stays available
    unfused. ``labels`` are integer class indices, as an array or as a node (see :func:`nll_loss`).

    Args:
        logits: a node of shape ``S + (C,)``, e.g. ``(batch, classes)``.
        labels: integer class indices of shape ``S`` (array or node).
        reduction: ``"mean"`` (over labels), ``"sum"`` or ``"none"``.

    Returns:
        A scalar node, or the per-label losses for ``"none"``.

    Raises:
        ValueError, ShapeError: as :func:`nll_loss`.
    """
    _check_reduction(reduction)
    labels = _checked_labels(logits, labels, "logits")
    return _reduce(F.softmax_cross_entropy(logits, labels), reduction)
