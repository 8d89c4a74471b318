"""Checking gradients: finite differences against VJPs, and full Jacobians for debugging."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from .compute import ComputeGraph, ComputeNode, NodeKey
from .errors import GradcheckError, GraphStateError, VGraphError
from .higher import rule_mismatches
from .ops import VJP, LazyGrad, Op, OpResultError, unbroadcast
from .virtual import UnrolledGraph


class GradcheckFailure(NamedTuple):
    """One gradient element on which the VJP and finite differences disagree.

    Attributes:
        leaf: the leaf, as ``<type:id@idx> 'name'``.
        element: the element's index in the leaf's value.
        analytic: the gradient element from the VJPs (backward).
        numeric: the central finite difference.
        abs_error: ``|analytic - numeric|``.
        rel_error: ``abs_error / max(|numeric|, atol)``.
    """

    leaf: str
    element: tuple[int, ...]
    analytic: float
    numeric: float
    abs_error: float
    rel_error: float

    def __str__(self) -> str:
        return (
            f"{self.leaf} at element {self.element}: analytic {self.analytic:.8g}, numeric "
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
        localized: when the check failed (with ``localize=True``), :func:`check_vjps` of the
            output: which op node's VJP is wrong, if any; ``None`` otherwise.
    """

    max_abs_error: float
    max_rel_error: float
    checked: int
    failures: list[GradcheckFailure]
    localized: VjpCheckResult | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


def _objective(graph: ComputeGraph, output: ComputeNode, projection: np.ndarray | None) -> float:
    value = graph.forward(output)
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
        for p, vjp in zip(n.parents, _vjps(n)):
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
    localize: bool = True,
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
        localize: when gradients disagree, also run :func:`check_vjps` on the op nodes the output
            depends on (costs about as much again, only on failure), so the error names the first
            node whose VJP is wrong, or says that every VJP is right and the difference comes
            from the graph itself (a ``detach``, a non-differentiable point).

    Returns:
        A :class:`GradcheckResult`.

    Raises:
        GradcheckError: gradients disagree. The message names, for the worst elements, the leaf
            ``<type:id@idx>``, the element index, the analytic and numeric values and the
            absolute and relative errors; with ``localize``, then the first wrong VJP.
        VGraphError: the graph is not float64, or a ``wrt`` node is not a leaf.
        TypeError, ValueError: ``output``/``wrt`` are not compute nodes, or a tolerance is not a
            non-negative number (``eps`` positive).
    """
    wrt, graph = _checked_leaves("gradcheck", output, wrt, eps, atol, rtol)
    # Plain floats in, plain floats out: the result's repr shows 1e-11, not np.float64(1e-11).
    eps, atol, rtol = float(eps), float(atol), float(rtol)
    projection = None
    if np.size(output.value) != 1:
        projection = np.random.default_rng(seed).standard_normal(np.shape(output.value))
    graph.forward(output)
    reached = _gradient_reaches(output)
    used = [x for x in wrt if x in reached]
    found = graph.grad(output, used, seeds=projection, retain_graph=True, allow_unused=True) if used else []
    analytic = {x: np.zeros(x.shape, graph.dtype) if a is None else a for x, a in zip(used, found)}

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
                f_plus = _objective(graph, output, projection)
                bumped[i] = original[i] - eps
                x.value = bumped
                f_minus = _objective(graph, output, projection)
                numeric = (f_plus - f_minus) / (2 * eps)
                err = abs(float(a[i]) - numeric)
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
    if not failures:
        return result
    where = "To find the op whose VJP is wrong, run vgraph.check_vjps on the output."
    if localize:
        try:
            result.localized = check_vjps(
                output, eps=eps, atol=atol, rtol=rtol, raise_on_failure=False, seed=seed
            )
        except VGraphError as e:
            where = f"Could not check the VJPs op by op: {e}"
        else:
            where = "Checked op by op (vgraph.check_vjps): " + result.localized.summary()
            if result.localized.ok:
                where += (
                    "\nEvery VJP agrees with its op, so the difference comes from the graph: a "
                    "detach, a non-differentiable point, or an eps that changes the graph's structure."
                )
    if raise_on_failure:
        more = f"\n  … and {len(failures) - 10} more" if len(failures) > 10 else ""
        raise GradcheckError(
            f"{len(failures)} of {checked} gradient elements of {output.describe()} disagree "
            f"(atol={atol}, rtol={rtol}), worst first:\n  "
            + "\n  ".join(str(f) for f in result.failures)
            + more
            + "\n"
            + where
        )
    return result


def _checked_leaves(
    what: str, output: Any, wrt: Any, eps: Any, atol: Any, rtol: Any
) -> tuple[list[ComputeNode], ComputeGraph]:
    """The arguments of a finite-difference check, checked: ``wrt`` as a list of leaves, with
    ``output``, of one float64 graph (returned), and the tolerances.

    Raises:
        TypeError, ValueError: ``output``/``wrt`` are not compute nodes; a bad tolerance.
        VGraphError: no graph, not float64, or a ``wrt`` node computed by an op.
    """
    if not isinstance(output, ComputeNode):
        raise TypeError(f"{what}: output must be a ComputeNode, got {type(output).__name__}")
    wrt = [wrt] if isinstance(wrt, ComputeNode) else list(wrt)
    for i, x in enumerate(wrt):
        if not isinstance(x, ComputeNode):
            raise TypeError(f"{what}: wrt[{i}] must be a ComputeNode, got {type(x).__name__}")
    _check_tolerances(eps, atol, rtol)
    graph = output.graph
    if graph is None:
        raise VGraphError(f"{output.describe()} belongs to no ComputeGraph")
    for x in (output, *wrt):
        if x.dtype != np.float64:
            raise VGraphError(
                f"{what} needs float64 values, {x.describe()} is {x.dtype}: build the graph "
                "with dtype=np.float64 (finite differences in float32 are mostly rounding noise)"
            )
    for x in wrt:
        if x.op is not None:
            raise VGraphError(f"{what} perturbs leaves; {x.describe()} is computed by {x.op.name}")
    return wrt, graph


def gradgradcheck(
    output: ComputeNode,
    wrt: Sequence[ComputeNode],
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    raise_on_failure: bool = True,
    seed: int = 0,
) -> GradcheckResult:
    """Compare second derivatives recorded as nodes (``create_graph=True``) with central finite
    differences of first-order gradients.

    With ``f = sum(output * r)`` (``r`` a fixed random projection; ``f = output`` for a scalar)
    and a fixed random direction ``u`` over ``wrt``, the Hessian-vector product ``H u`` is
    computed by reverse over reverse — the gradient of ``f`` recorded as nodes, its inner product
    with ``u`` differentiated by an ordinary backward — and compared element by element with
    ``(grad f(x + eps e_j) - grad f(x - eps e_j)) . u / (2 eps)``, the gradients from the
    ordinary (numpy) backward. Run it in float64. Leaves are restored and ``.grad`` untouched;
    the recorded gradient's nodes stay in the graph.

    When they disagree, every op node the output depends on has its differentiable VJP compared
    with its numpy VJP (:func:`vgraph.higher.rule_mismatches`), and the error names the first that
    disagrees.

    Args:
        output: the node to differentiate twice.
        wrt: leaf nodes (inputs with ``requires_grad=True`` or parameters).
        eps: the finite-difference step.
        atol, rtol: an element passes if ``|analytic - numeric| <= atol + rtol * |numeric|``.
        raise_on_failure: raise :class:`GradcheckError` instead of returning a failing result.
        seed: seeds ``r`` and ``u``.

    Returns:
        A :class:`GradcheckResult` (its ``failures`` name the leaf and element of ``H u``).

    Raises:
        GradcheckError: second derivatives disagree (names the worst elements and, where it can,
            the node whose differentiable VJP is wrong).
        SecondOrderError: a node whose gradient cannot be recorded (names it).
        VGraphError: the graph is not float64, or a ``wrt`` node is not a leaf.
        TypeError, ValueError: as :func:`gradcheck`.
    """
    wrt, graph = _checked_leaves("gradgradcheck", output, wrt, eps, atol, rtol)
    eps, atol, rtol = float(eps), float(atol), float(rtol)
    rng = np.random.default_rng(seed)
    projection = None if np.size(output.value) == 1 else rng.standard_normal(np.shape(output.value))
    directions = [rng.standard_normal(x.shape) for x in wrt]
    graph.forward(output)
    grads = graph.grad(output, wrt, seeds=projection, retain_graph=True, allow_unused=True, create_graph=True)
    dot = None
    for g, u in zip(grads, directions):
        if g is not None:
            term = (g * u).sum()
            dot = term if dot is None else dot + term
    if dot is not None and dot.requires_grad:
        found = graph.grad(dot, wrt, retain_graph=True, allow_unused=True)
    else:
        found = [None] * len(wrt)
    analytic = [np.zeros(x.shape) if a is None else a for a, x in zip(found, wrt)]

    def directional() -> float:
        graph.forward(output)
        gs = graph.grad(output, wrt, seeds=projection, retain_graph=True, allow_unused=True)
        return float(sum(np.sum(g * u) for g, u in zip(gs, directions) if g is not None))

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
                f_plus = directional()
                bumped[i] = original[i] - eps
                x.value = bumped
                f_minus = directional()
                numeric = (f_plus - f_minus) / (2 * eps)
                err = abs(float(a[i]) - numeric)
                rel = err / max(abs(numeric), atol)
                max_abs, max_rel = max(max_abs, err), max(max_rel, rel)
                checked += 1
                if err > atol + rtol * abs(numeric):
                    failures.append(GradcheckFailure(x.describe(), i, float(a[i]), numeric, err, rel))
        finally:
            x.value = original
            graph.forward(output)
    failures.sort(key=lambda f: -f.abs_error)
    result = GradcheckResult(max_abs, max_rel, checked, failures[:10])
    if not failures or not raise_on_failure:
        return result
    wrong = rule_mismatches(output, seed=seed)
    if wrong:
        node, position, err = wrong[0]
        where = (
            f"The differentiable VJP of {node.describe()} (op {node.op.name if node.op else '?'}) for "
            f"input {position} {node.parents[position].describe()} disagrees with its numpy VJP "
            f"(max abs difference {err:.3g})"
        )
    else:
        where = (
            "Every differentiable VJP agrees with its numpy VJP here; the difference comes from "
            "the graph (a non-differentiable point, or an eps that changes its structure)"
        )
    raise GradcheckError(
        f"{len(failures)} of {checked} second-derivative elements (H u) of {output.describe()} "
        f"disagree (atol={atol}, rtol={rtol}), worst first:\n  "
        + "\n  ".join(str(f) for f in result.failures)
        + "\n"
        + where
    )


# ---------------------------------------------------------------------------- localised check


@dataclass(frozen=True)
class InputCheck:
    """How one input of one node fared in :func:`check_vjps`.

    Attributes:
        position: the input's position among the node's parents (the op's argument order).
        parent: the parent node, as ``<type:id@idx> 'name'``.
        skipped: why the input was not checked (``"no VJP"``, ``"non-float input (int64)"``),
            or ``None`` if it was.
        checked: the number of elements compared.
        nondifferentiable: elements skipped because the op is not differentiable there (the
            one-sided differences disagree, e.g. ``relu`` at 0 or ``max`` with ties, or the op's
            value is not finite nearby).
        max_abs_error: the largest ``|analytic - numeric|`` over the compared elements.
        max_rel_error: the largest ``|analytic - numeric| / max(|numeric|, atol)``.
        failed: the number of elements outside the tolerance.
        worst_index: the element with the largest absolute error (``None`` if none compared).
        analytic, numeric: the VJP's and the finite difference's value at ``worst_index``.
        error: what went wrong when the VJP could not be compared element by element (it
            raised, returned ``None`` or an array that does not reduce to the input's shape).
    """

    position: int
    parent: str
    skipped: str | None = None
    checked: int = 0
    nondifferentiable: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    failed: int = 0
    worst_index: tuple[int, ...] | None = None
    analytic: float = float("nan")
    numeric: float = float("nan")
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the input was skipped or every compared element is within the tolerance."""
        return self.error is None and self.failed == 0

    def __str__(self) -> str:
        head = f"input {self.position} {self.parent}"
        if self.skipped is not None:
            return f"{head}: skipped ({self.skipped})"
        if self.error is not None:
            return f"{head}: {self.error}"
        text = (
            f"{head}: max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}"
            f" over {_count(self.checked, 'element')}"
        )
        if self.failed:
            text += (
                f"; {self.failed} wrong, the worst at element {self.worst_index}: analytic "
                f"{self.analytic:.8g}, numeric {self.numeric:.8g}"
            )
        if self.nondifferentiable:
            text += f" ({self.nondifferentiable} non-differentiable elements skipped)"
        return text


@dataclass(frozen=True)
class NodeCheck:
    """The check of one op node's VJPs in :func:`check_vjps`.

    Attributes:
        key: the node's ``<type, id, idx>`` (``cg.node(check.key)`` gives the node back).
        node: the node, as ``<type:id@idx> 'name'``.
        op: the name of the primitive computing it (for nodes that an unrolled graph keys by
            role, e.g. a loop's ``Item`` nodes, the op is ``GetItem``).
        inputs: one :class:`InputCheck` per parent, in the op's argument order.
    """

    key: NodeKey
    node: str
    op: str
    inputs: tuple[InputCheck, ...]

    @property
    def ok(self) -> bool:
        """Whether every checked input's VJP agrees with finite differences."""
        return all(i.ok for i in self.inputs)

    @property
    def max_abs_error(self) -> float:
        return max((i.max_abs_error for i in self.inputs), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((i.max_rel_error for i in self.inputs), default=0.0)

    def __str__(self) -> str:
        status = "ok" if self.ok else "WRONG"
        lines = [f"{self.node} (op {self.op}): {status}"]
        lines += [f"    {i}" for i in self.inputs]
        return "\n".join(lines)


@dataclass
class VjpCheckResult:
    """The outcome of :func:`check_vjps`.

    Attributes:
        nodes: every op node that had at least one input to check, in topological order.
        skipped: the number of op nodes with nothing to check (no VJP for any input, e.g.
            ``Detach``, ``Step`` and structure checks, or only integer inputs).
        atol, rtol: the tolerance used.
    """

    nodes: list[NodeCheck] = field(default_factory=list)
    skipped: int = 0
    atol: float = 1e-6
    rtol: float = 1e-5

    @property
    def ok(self) -> bool:
        """Whether every checked VJP agrees with finite differences."""
        return all(n.ok for n in self.nodes)

    @property
    def failures(self) -> list[NodeCheck]:
        """The nodes with a wrong VJP, in topological order."""
        return [n for n in self.nodes if not n.ok]

    @property
    def first_failure(self) -> NodeCheck | None:
        """The first node (in topological order) with a wrong VJP, or ``None``."""
        return next((n for n in self.nodes if not n.ok), None)

    @property
    def max_abs_error(self) -> float:
        return max((n.max_abs_error for n in self.nodes), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((n.max_rel_error for n in self.nodes), default=0.0)

    def summary(self) -> str:
        """A short report: the first wrong VJP (node, op, input, errors), or that all agree."""
        inputs = sum(1 for n in self.nodes for i in n.inputs if i.skipped is None)
        checked = (
            f"{_count(len(self.nodes), 'op node')} ({_count(inputs, 'input')}) checked against "
            f"central finite differences, atol={self.atol}, rtol={self.rtol}; "
            f"{_count(self.skipped, 'op node')} with nothing to check"
        )
        failures = self.failures
        if not failures:
            return (
                f"all VJPs agree with finite differences (max abs error {self.max_abs_error:.3g}, "
                f"max rel error {self.max_rel_error:.3g}); {checked}"
            )
        first = failures[0]
        bad = next(i for i in first.inputs if not i.ok)
        text = f"wrong VJP at {first.node} (op {first.op}), {bad}\n"
        if len(failures) > 1:
            others = ", ".join(f"<{n.key}>" for n in failures[1:6]) + (" …" if len(failures) > 6 else "")
            text += f"{len(failures) - 1} later nodes are wrong too: {others}\n"
        return text + checked

    def __str__(self) -> str:
        return self.summary()


_by_serial = attrgetter("serial")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _op_nodes(target: ComputeGraph | ComputeNode) -> list[tuple[ComputeNode, Op]]:
    """The op nodes of a graph, or those ``target`` depends on, in topological order, each with
    its op."""
    if isinstance(target, ComputeGraph):
        nodes = target.nodes()
    else:
        seen = {target}
        stack = [target]
        while stack:
            for p in stack.pop().parents:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        nodes = sorted(seen, key=_by_serial)
    return [(n, n.op) for n in nodes if n.op is not None]


def _vjps(node: ComputeNode) -> tuple[VJP | None, ...]:
    """``node.vjps``: one VJP (or ``None``) per input; a variadic op's single VJP was split per
    input when the node was made."""
    return node.vjps


def _readonly(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        a = a.view()
        a.flags.writeable = False
    return a


def _describe_exception(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _check_node(
    node: ComputeNode,
    op: Op,
    rng: np.random.Generator,
    eps: float,
    atol: float,
    rtol: float,
    max_elements: int | None,
) -> NodeCheck | None:
    """Check every input's VJP of one op node; ``None`` if it has nothing to check."""
    parents = node.parents
    # .value recomputes a value a checkpointed loop dropped
    values = [np.asarray(p._value if p._value is not None else p.value) for p in parents]
    reasons: list[str | None] = []
    vjps = _vjps(node)
    for vjp, v in zip(vjps, values):
        if vjp is None:
            reasons.append("no VJP")
        elif v.dtype.kind != "f":
            reasons.append(f"non-float input ({v.dtype})")
        else:
            reasons.append(None)
    if all(r is not None for r in reasons):
        return None
    # The check is of the op's arithmetic at this node's input point, so it runs in float64 even
    # on a float32 graph (float32 values are exact in float64). Float inputs are private copies,
    # perturbed in place and restored.
    xs = [np.array(v, dtype=np.float64) if v.dtype.kind == "f" else v for v in values]
    attrs = node.attrs
    forward = op.forward

    try:
        ans = np.array(forward(*xs, **attrs))  # a copy: it may be a view of an input we perturb
    except Exception as e:
        raise VGraphError(
            f"check_vjps: {node.describe()} (op {op.name}) cannot be recomputed from its inputs' "
            f"current values: {_describe_exception(e)}"
        ) from e
    if ans.dtype.kind != "f":
        return None  # an integer or boolean result (an index, a decision) has no gradient
    if ans.dtype != np.float64:
        raise VGraphError(
            f"check_vjps: {node.describe()} (op {op.name}) returned {ans.dtype} from float64 inputs; "
            "finite differences need the op to compute in float64 (do not hard-code a dtype in "
            "its forward: follow the inputs' dtype)"
        )
    u = rng.standard_normal(ans.shape)

    def objective() -> float:
        return float(np.sum(u * forward(*xs, **attrs)))

    f0 = float(np.sum(u * ans))
    checks = []
    for k, (p, vjp, reason) in enumerate(zip(parents, vjps, reasons)):
        if reason is not None:
            checks.append(InputCheck(k, p.describe(), skipped=reason))
            continue
        assert vjp is not None  # a missing VJP has a reason
        x = xs[k]
        error = None
        try:
            a = vjp(_readonly(u), _readonly(ans), *(_readonly(v) for v in xs), **attrs)
            if isinstance(a, LazyGrad):  # a gradient the engine accumulates lazily
                a = a.dense()
        except Exception as e:
            error = f"the VJP raised {_describe_exception(e)}"
            if isinstance(e, OpResultError):  # a vgraph.defop op's checks refused its result
                error = f"the VJP {e}"
            if isinstance(e, ValueError) and "read-only" in str(e):
                error += " (a VJP must not modify g, ans or the inputs in place)"
        else:
            if a is None:
                error = "the VJP returned None (to say 'no gradient', put None in place of the VJP)"
            else:
                a = np.asarray(a, dtype=np.float64)
                if a.shape != x.shape:
                    try:
                        reduced = unbroadcast(a, x.shape)
                    except Exception:
                        reduced = None
                    if reduced is None or reduced.shape != x.shape:
                        error = (
                            f"the VJP returned shape {a.shape}, which does not reduce to the "
                            f"input's shape {x.shape} (nor broadcasts to it)"
                        )
                    a = reduced
        if error is not None:
            checks.append(InputCheck(k, p.describe(), error=error))
            continue

        flat: Iterable[int]
        if max_elements is None or x.size <= max_elements:
            flat = range(x.size)
        else:
            flat = np.sort(rng.choice(x.size, size=max_elements, replace=False)).tolist()
        checked = kinks = failed = 0
        max_abs = max_rel = -1.0
        worst: tuple[Any, float, float] = (None, float("nan"), float("nan"))
        for j in flat:
            i = np.unravel_index(int(j), x.shape)
            original = x[i]
            x[i] = original + eps
            f_plus = objective()
            x[i] = original - eps
            f_minus = objective()
            x[i] = original
            # At a kink (relu at 0, ties of max) the one-sided slopes differ by O(1) instead of
            # O(eps * curvature): the derivative is not defined there, so nothing to compare.
            right, left = (f_plus - f0) / eps, (f0 - f_minus) / eps
            if (
                not np.isfinite(right - left)
                or abs(right - left) > 0.1 * (abs(right) + abs(left)) + 1000 * eps
            ):
                kinks += 1
                continue
            numeric = (f_plus - f_minus) / (2 * eps)
            analytic = float(a[i])
            err = abs(analytic - numeric)
            if not np.isfinite(err):
                err = float("inf")
            rel = err / max(abs(numeric), atol)
            checked += 1
            if not err <= atol + rtol * abs(numeric):
                failed += 1
            if err > max_abs:
                worst = (tuple(int(t) for t in i), analytic, numeric)
            max_abs, max_rel = max(max_abs, err), max(max_rel, rel)
        checks.append(
            InputCheck(
                k,
                p.describe(),
                checked=checked,
                nondifferentiable=kinks,
                max_abs_error=max(max_abs, 0.0),
                max_rel_error=max(max_rel, 0.0),
                failed=failed,
                worst_index=worst[0],
                analytic=worst[1],
                numeric=worst[2],
            )
        )
    return NodeCheck(node.key, node.describe(), op.name, tuple(checks))


def _per_node(target: ComputeGraph | ComputeNode) -> ComputeGraph | ComputeNode:
    """``target`` in its graph as the per-node unroll makes it, if loops of that graph ran as body
    programs (their nodes checked one by one, see :meth:`UnrolledGraph.per_node`)."""
    graph = target if isinstance(target, ComputeGraph) else target.graph
    if not isinstance(graph, UnrolledGraph) or not graph.programs:
        return target
    plain = graph.per_node()
    return plain if isinstance(target, ComputeGraph) else plain.node(target.key)


def check_vjps(
    target: ComputeGraph | ComputeNode,
    ops: str | Iterable[str] | None = None,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    max_elements: int | None = None,
    raise_on_failure: bool = True,
    seed: int = 0,
) -> VjpCheckResult:
    """Check each op node's VJPs on its own against central finite differences of that node.

    The localised gradient check. For every op node, in topological order, and every input of
    the node that has a VJP and a float value: draw a random cotangent ``u`` of the node's output
    shape, and compare, element by element, the VJP ``vjp(u, ans, *inputs)`` (reduced to the
    input's shape like the engine does for broadcast inputs) with the central difference of
    ``sum(u * op(*inputs))`` in that element. Only the node's own op is re-run, on its inputs'
    current values, so a wrong VJP is pinned to the node (``<type,id,idx>``), the op and the
    input, however deep in an unrolled graph it is. Nothing in the graph changes.

    Use :func:`gradcheck` to ask whether a whole gradient is right, and this to find out which
    node is wrong. It is a separate function, not a ``gradcheck`` flag, because it asks another
    question with other arguments (no leaves to pick: it checks nodes, of a graph or below an
    output) and another answer (per node and input, not per leaf element).

    Skipped: inputs with no VJP (``None`` in the op table: ``Detach``, ``Step``, indices,
    structure checks) and integer or boolean inputs; elements where the op is not
    differentiable (the one-sided differences disagree: ``relu`` at 0, ties of ``max``), counted
    in :attr:`InputCheck.nondifferentiable`. Float inputs are converted to float64 for the check
    (exact for float32 values), so float32 graphs can be checked too; the op must then compute in
    float64.

    Args:
        target: a ComputeGraph (every op node; unrolled graphs from ``VirtualGraph.build`` too),
            or a node (the op nodes it depends on, itself included).
        ops: check only nodes of these op names (e.g. the one you are adding); default all.
        eps: the finite-difference step.
        atol, rtol: an element passes if ``|analytic - numeric| <= atol + rtol * |numeric|``.
        max_elements: compare at most this many elements per input (chosen at random), for large
            graphs; default all.
        raise_on_failure: raise :class:`GradcheckError` if a VJP is wrong, instead of returning
            a failing result.
        seed: seeds the random cotangents (and the sampled elements).

    Returns:
        A :class:`VjpCheckResult` listing every checked node with its per-input errors;
        ``result.first_failure`` is the first node whose VJP is wrong.

    Raises:
        GradcheckError: a VJP is wrong (raises, returns the wrong shape, or disagrees with finite
            differences). The message names the first such node ``<type,id,idx>``, its op, the
            input, the max abs and rel errors and the worst element, then the other wrong nodes.
        VGraphError: a node's op cannot be recomputed from its inputs, or computes in a dtype
            other than float64 from float64 inputs; ``ops`` names an op no checked node uses.
        TypeError, ValueError: an argument of the wrong type or value.
    """
    if not isinstance(target, (ComputeGraph, ComputeNode)):
        raise TypeError(
            f"check_vjps: target must be a ComputeGraph or a ComputeNode, got {type(target).__name__}"
        )
    _check_tolerances(eps, atol, rtol)
    wanted: set[str] | None = None
    if ops is not None:
        wanted = {ops} if isinstance(ops, str) else set(ops)
        for name in wanted:
            if not isinstance(name, str):
                raise TypeError(f"check_vjps: ops must be op names (str), got {type(name).__name__}")
    if max_elements is not None and (
        isinstance(max_elements, bool) or not isinstance(max_elements, (int, np.integer)) or max_elements < 1
    ):
        raise ValueError(f"check_vjps: max_elements must be a positive integer or None, got {max_elements!r}")
    try:
        rng = np.random.default_rng(seed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"check_vjps: seed {seed!r} is not a valid numpy seed ({e})") from None

    target = _per_node(target)
    nodes = _op_nodes(target)
    if wanted is not None:
        present = {op.name for _, op in nodes}
        missing = sorted(wanted - present)
        if missing:
            raise VGraphError(
                f"check_vjps: no node to check computes {', '.join(map(repr, missing))}; "
                f"the ops present are {', '.join(sorted(present)) or 'none'}"
            )
        nodes = [(n, op) for n, op in nodes if op.name in wanted]
    result = VjpCheckResult(atol=float(atol), rtol=float(rtol))
    for n, op in nodes:
        check = _check_node(n, op, rng, float(eps), float(atol), float(rtol), max_elements)
        if check is None:
            result.skipped += 1
        else:
            result.nodes.append(check)
    if raise_on_failure and not result.ok:
        raise GradcheckError(result.summary())
    return result


def jacobian(output: ComputeNode, input: ComputeNode) -> np.ndarray:
    """The full Jacobian ``d output / d input``, shape ``output.shape + input.shape``.

    A debugging tool (seed 000 §8): it runs one backward pass per output element, so it costs
    O(output size) backward passes. Training never needs it; vgraph never builds Jacobians.

    Raises:
        GraphStateError: ``input`` does not require a gradient.
        VGraphError: ``output`` belongs to no ComputeGraph.
    """
    graph = output.graph
    if graph is None:
        raise VGraphError(f"{output.describe()} belongs to no ComputeGraph")
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


__all__ = [
    "GradcheckFailure",
    "GradcheckResult",
    "InputCheck",
    "NodeCheck",
    "VjpCheckResult",
    "check_vjps",
    "gradcheck",
    "jacobian",
]
