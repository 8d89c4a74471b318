"""Checking gradients: finite differences against VJPs, and full Jacobians for debugging."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .compute import ComputeNode
from .errors import GradcheckError, GraphStateError, VGraphError


class GradcheckFailure(NamedTuple):
    """One gradient element on which the VJP and finite differences disagree.

    Attributes:
        leaf: the leaf, as ``<type:id@idx> 'name'``.
        index: the element's index in the leaf's value.
        analytic: the gradient element from the VJPs (backward).
        numeric: the central finite difference.
        abs_error: ``|analytic - numeric|``.
        rel_error: ``abs_error / max(|numeric|, atol)``.
    """

    leaf: str
    index: tuple[int, ...]
    analytic: float
    numeric: float
    abs_error: float
    rel_error: float

    def __str__(self) -> str:
        return (
            f"{self.leaf} at element {self.index}: analytic {self.analytic:.8g}, numeric "
            f"{self.numeric:.8g} (abs error {self.abs_error:.3g}, rel error {self.rel_error:.3g})"
        )


@dataclass
class GradcheckResult:
    """The outcome of :func:`gradcheck`.

    Attributes:
        max_abs_error: the largest ``|analytic - numeric|`` over all checked elements.
        max_rel_error: the largest ``|analytic - numeric| / max(|numeric|, atol)``.
        checked: the number of elements compared.
        failures: the elements that failed the tolerance, worst first (at most 10).
    """

    max_abs_error: float
    max_rel_error: float
    checked: int
    failures: list[GradcheckFailure]

    @property
    def ok(self) -> bool:
        return not self.failures


def _objective(output: ComputeNode, projection: np.ndarray | None) -> float:
    value = output.graph.forward(output)
    if projection is None:  # a size-1 output, possibly of shape (1,) or (1, 1): not float()-able
        return float(np.reshape(value, ()))
    return float(np.sum(value * projection))


def _gradient_reaches(output: ComputeNode) -> set[ComputeNode]:
    """The nodes a backward from ``output`` sends a gradient to (iteratively, no recursion).

    The engine follows an edge only when the child requires a gradient, the op has a VJP for that
    input and the parent requires a gradient; a leaf reached otherwise (through ``detach``, say)
    gets no gradient, so its analytic gradient is zero.
    """
    seen = {output} if output.requires_grad else set()
    stack = list(seen)
    while stack:
        n = stack.pop()
        for p, vjp in zip(n.parents, n.vjps):
            if vjp is not None and p.requires_grad and p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _check_tolerances(eps: float, atol: float, rtol: float) -> None:
    for name, v, positive in (("eps", eps, True), ("atol", atol, False), ("rtol", rtol, False)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        if not np.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(
                f"{name} must be {'positive' if positive else 'non-negative'} and finite, got {v}"
            )


def gradcheck(
    output: ComputeNode,
    wrt: Sequence[ComputeNode],
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    raise_on_failure: bool = True,
    seed: int = 0,
) -> GradcheckResult:
    """Compare the VJP gradients of ``output`` with central finite differences.

    Each element of each leaf in ``wrt`` is moved by ``±eps`` and the graph is re-run forward
    (only the affected nodes recompute). A non-scalar output is reduced to
    ``sum(output * r)`` with a fixed random ``r``, which checks the VJP in a random direction.
    Run it in float64: float32 finite differences are too noisy to mean anything. Leaves are
    restored and ``.grad`` is untouched afterwards.

    This answers "is the gradient of this graph right?". When it is not, :func:`check_vjps`
    answers "which node's VJP is wrong?" (each op checked on its own).

    Args:
        output: the node to differentiate.
        wrt: leaf nodes (inputs with ``requires_grad=True`` or parameters). A leaf the output's
            gradient does not reach (unused, or only through ``detach``) has analytic gradient 0.
        eps: the finite-difference step.
        atol, rtol: an element passes if ``|analytic - numeric| <= atol + rtol * |numeric|``.
        raise_on_failure: raise :class:`GradcheckError` instead of returning a failing result.
        seed: seeds the random projection for non-scalar outputs.

    Returns:
        A :class:`GradcheckResult`.

    Raises:
        GradcheckError: gradients disagree. The message names, for the worst elements, the leaf
            ``<type:id@idx>``, the element index, the analytic and numeric values and the
            absolute and relative errors.
        VGraphError: the graph is not float64, or a ``wrt`` node is not a leaf.
        TypeError, ValueError: ``output``/``wrt`` are not compute nodes, or a tolerance is not a
            non-negative number (``eps`` positive).
    """
    if not isinstance(output, ComputeNode):
        raise TypeError(f"gradcheck: output must be a ComputeNode, got {type(output).__name__}")
    if isinstance(wrt, ComputeNode):
        wrt = [wrt]
    wrt = list(wrt)
    for i, x in enumerate(wrt):
        if not isinstance(x, ComputeNode):
            raise TypeError(f"gradcheck: wrt[{i}] must be a ComputeNode, got {type(x).__name__}")
    _check_tolerances(eps, atol, rtol)
    graph = output.graph
    if graph is None:
        raise VGraphError(f"{output.describe()} belongs to no ComputeGraph")
    for x in (output, *wrt):
        if x.dtype != np.float64:
            raise VGraphError(
                f"gradcheck needs float64 values, {x.describe()} is {x.dtype}: build the graph "
                "with dtype=np.float64 (finite differences in float32 are mostly rounding noise)"
            )
    for x in wrt:
        if not x.is_leaf:
            raise VGraphError(f"gradcheck perturbs leaves; {x.describe()} is computed by {x.op.name}")
    projection = None
    if np.size(output.value) != 1:
        projection = np.random.default_rng(seed).standard_normal(np.shape(output.value))
    graph.forward(output)
    reached = _gradient_reaches(output)
    used = [x for x in wrt if x in reached]
    analytic = dict(zip(used, graph.grad(output, used, seeds=projection, retain_graph=True) if used else ()))

    failures = []
    max_abs = max_rel = 0.0
    checked = 0
    for x in wrt:
        a = analytic.get(x)
        if a is None:
            a = np.zeros(np.shape(x.value))
        original = np.array(x.value, copy=True)
        try:
            for i in np.ndindex(original.shape):
                bumped = original.copy()
                bumped[i] += eps
                x.value = bumped
                f_plus = _objective(output, projection)
                bumped[i] = original[i] - eps
                x.value = bumped
                f_minus = _objective(output, projection)
                numeric = (f_plus - f_minus) / (2 * eps)
                err = abs(a[i] - numeric)
                rel = err / max(abs(numeric), atol)
                max_abs = max(max_abs, err)
                max_rel = max(max_rel, rel)
                checked += 1
                if err > atol + rtol * abs(numeric):
                    failures.append(GradcheckFailure(x.describe(), i, float(a[i]), numeric, err, rel))
        finally:
            x.value = original
            graph.forward(output)
    failures.sort(key=lambda f: -f.abs_error)
    result = GradcheckResult(max_abs, max_rel, checked, failures[:10])
    if failures and raise_on_failure:
        more = f"\n  … and {len(failures) - 10} more" if len(failures) > 10 else ""
        raise GradcheckError(
            f"{len(failures)} of {checked} gradient elements of {output.describe()} disagree "
            f"(atol={atol}, rtol={rtol}), worst first:\n  "
            + "\n  ".join(str(f) for f in result.failures)
            + more
            + "\nTo find the op whose VJP is wrong, run vgraph.check_vjps on the output."
        )
    return result


def jacobian(output: ComputeNode, input: ComputeNode) -> np.ndarray:
    """The full Jacobian ``d output / d input``, shape ``output.shape + input.shape``.

    A debugging tool (seed 000 §8): it runs one backward pass per output element, so it costs
    O(output size) backward passes. Training never needs it; vgraph never builds Jacobians.

    Raises:
        GraphStateError: ``input`` does not require a gradient.
    """
    graph = output.graph
    if not input.requires_grad:
        raise GraphStateError(f"{input.describe()} does not require a gradient")
    out_shape = np.shape(output.value)
    rows = np.zeros((int(np.prod(out_shape, dtype=int)), *np.shape(input.value)), dtype=graph.dtype)
    for k in range(rows.shape[0]):
        seed = np.zeros(out_shape, dtype=graph.dtype)
        seed.flat[k] = 1
        (rows[k],) = graph.grad(output, [input], seeds=seed, retain_graph=True)
    return rows.reshape(*out_shape, *np.shape(input.value))


__all__ = ["GradcheckFailure", "GradcheckResult", "gradcheck", "jacobian"]
