"""Checking gradients: finite differences against VJPs, and full Jacobians for debugging."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .compute import ComputeNode
from .errors import GradcheckError, GraphStateError, VGraphError


@dataclass
class GradcheckResult:
    """The outcome of :func:`gradcheck`.

    Attributes:
        max_abs_error: the largest ``|analytic - numeric|`` over all checked elements.
        max_rel_error: the largest ``|analytic - numeric| / max(|numeric|, atol)``.
        checked: the number of elements compared.
        failures: ``(node description, element index, analytic, numeric)`` of the elements that
            failed the tolerance, worst first (at most 10).
    """

    max_abs_error: float
    max_rel_error: float
    checked: int
    failures: list[tuple[str, tuple[int, ...], float, float]]

    @property
    def ok(self) -> bool:
        return not self.failures


def _objective(output: ComputeNode, projection: np.ndarray | None) -> float:
    value = output.graph.forward(output)
    if projection is None:  # a size-1 output, possibly of shape (1,) or (1, 1): not float()-able
        return float(np.reshape(value, ()))
    return float(np.sum(value * projection))


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

    Args:
        output: the node to differentiate.
        wrt: leaf nodes (inputs with ``requires_grad=True`` or parameters).
        eps: the finite-difference step.
        atol, rtol: an element passes if ``|analytic - numeric| <= atol + rtol * |numeric|``.
        raise_on_failure: raise :class:`GradcheckError` instead of returning a failing result.
        seed: seeds the random projection for non-scalar outputs.

    Returns:
        A :class:`GradcheckResult`.

    Raises:
        GradcheckError: gradients disagree (names the input, the element, both values).
        VGraphError: the graph is not float64, or a ``wrt`` node is not a leaf.
    """
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
    analytic = graph.grad(output, list(wrt), seeds=projection, retain_graph=True, allow_unused=True)
    analytic = [np.zeros(x.shape, graph.dtype) if a is None else a for x, a in zip(wrt, analytic)]

    failures = []
    max_abs = max_rel = 0.0
    checked = 0
    for x, a in zip(wrt, analytic):
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
                max_abs = max(max_abs, err)
                max_rel = max(max_rel, err / max(abs(numeric), atol))
                checked += 1
                if err > atol + rtol * abs(numeric):
                    failures.append((x.describe(), i, float(a[i]), numeric))
        finally:
            x.value = original
            graph.forward(output)
    failures.sort(key=lambda f: -abs(f[2] - f[3]))
    result = GradcheckResult(max_abs, max_rel, checked, failures[:10])
    if failures and raise_on_failure:
        lines = [
            f"gradient of {output.describe()} w.r.t. {name} at element {idx}: "
            f"analytic {an:.8g}, numeric {num:.8g}"
            for name, idx, an, num in result.failures
        ]
        raise GradcheckError(
            f"{len(failures)} of {checked} gradient elements disagree (atol={atol}, rtol={rtol}):\n  "
            + "\n  ".join(lines)
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
        (g,) = graph.grad(output, [input], seeds=seed, retain_graph=True, allow_unused=True)
        rows[k] = 0 if g is None else g
    return rows.reshape(*out_shape, *np.shape(input.value))


__all__ = ["GradcheckResult", "gradcheck", "jacobian"]
