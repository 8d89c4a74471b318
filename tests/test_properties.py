"""Property-based tests (issue 9 §8), with hypothesis.

1. Random small op graphs (random shapes, numpy broadcasting, a mix of the primitives of
   :mod:`vgraph.ops`) built imperatively in float64: VJP gradients equal finite differences.
2. Random sequences of feed / set_value / forward / backward / backward_ex / grad / optimiser
   step / zero_grad on an unrolled RNN: incremental forward equals a fresh recomputation, a
   backward that would read stale values is always refused, an accepted one gives the gradients
   of a fresh graph, and a refused call changes no ``.grad``.
3. Random API misuse: every error is a ``VGraphError``, ``TypeError`` or ``ValueError``, and a
   failed call changes nothing (parameter values, store, declarations, a built graph's numbers).

Profiles (tests/conftest.py): ``fast`` by default (derandomized, what CI runs); ``slow`` with
``HYPOTHESIS_PROFILE=slow``. Defects these properties found have a minimal regression test at the
end of the file.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import vgraph as vg
from vgraph import ComputeGraph

# ============================================================================ 1. random op graphs
#
# A graph is drawn as a recipe: leaf shapes derived from one base shape (so that they broadcast),
# then a list of steps (op name, two pool positions, a small integer for the op's options). The
# recipe is interpreted deterministically; the values come from a generator seeded by the recipe.
# Ops are applied only where they are differentiable on the values at hand: Log, Pow and Div see
# inputs kept positive and away from 0, Relu/Abs/Step/Sign inputs away from their kink, Max slices
# without near-ties; otherwise the step falls back to Tanh. Detach is left out: finite differences
# see through it, by design.

MAX_SIZE = 48  # elements per node: keeps finite differences cheap

UNARY = ["tanh", "sigmoid", "softplus", "neg", "exp", "log", "pow_int", "pow_real", "relu", "abs",
         "step", "sign", "sum", "mean", "max", "softmax", "log_softmax", "reshape", "transpose",
         "getitem", "getitem_repeat", "take", "take_along_axis", "matmul", "rmatmul"]  # fmt: skip
BINARY = ["add", "sub", "mul", "div", "concat", "stack", "where"]


def _leaf_shape(base: tuple[int, ...], keep: int, ones: list[bool]) -> tuple[int, ...]:
    """A shape that broadcasts against ``base``: its last ``keep`` axes, some set to 1."""
    tail = base[len(base) - keep :] if keep else ()
    return tuple(1 if one else d for d, one in zip(tail, ones))


@st.composite
def recipes(draw, forced: str | None = None):
    """A graph recipe; ``forced`` puts that op among the steps (at a drawn position)."""
    ndim = draw(st.integers(0, 3))
    base = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    leaves = []
    for _ in range(draw(st.integers(1, 3))):
        keep = draw(st.integers(0, ndim))
        ones = draw(st.lists(st.booleans(), min_size=keep, max_size=keep))
        leaves.append(_leaf_shape(base, keep, ones))
    op = st.sampled_from(UNARY + BINARY)
    steps = draw(st.lists(st.tuples(op, st.integers(0, 20), st.integers(0, 20), st.integers(0, 11)),
                          min_size=2, max_size=8))  # fmt: skip
    if forced is not None:
        at = draw(st.integers(0, len(steps)))
        steps.insert(
            at, (forced, *draw(st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 11))))
        )
    seed = draw(st.integers(0, 2**32 - 1))
    return base, leaves, steps, seed


def _broadcastable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        return int(np.prod(np.broadcast_shapes(a, b))) <= MAX_SIZE
    except ValueError:
        return False


def _away_from_kink(x: np.ndarray) -> bool:
    return bool(np.all(np.abs(x) > 1e-3))


def _no_near_ties(x: np.ndarray, axis: int | None) -> bool:
    """Whether the largest value of every slice is ahead of the second by a clear margin."""
    flat = x.reshape(-1) if axis is None else np.moveaxis(x, axis, -1)
    if flat.shape[-1] < 2:
        return True
    top = np.sort(flat, axis=-1)
    return bool(np.all(top[..., -1] - top[..., -2] > 1e-4))


def _axis(x: np.ndarray, k: int) -> int | None:
    """None (all axes) or one axis of ``x``, possibly negative, chosen by ``k``."""
    if x.ndim == 0 or k % 3 == 0:
        return None
    a = k % x.ndim
    return a - x.ndim if k % 2 else a


def _apply(cg, rng, name, a, b, k):
    """Apply op ``name`` to pool nodes ``a`` (and ``b``), or return None where it does not fit."""
    x = a.value
    if name in BINARY:
        other = b if _broadcastable(a.shape, b.shape) else a
        if name == "add":
            return a + other
        if name == "sub":
            return other - a
        if name == "mul":
            return a * other
        if name == "div":  # denominator in [0.25, inf): away from 0
            return a / (vg.softplus(other) + 0.25)
        if name == "where":
            cond = cg.constant(rng.random(np.broadcast_shapes(a.shape, other.shape)) < 0.5)
            return vg.where(cond, a, other)
        if x.ndim == 0 or 2 * x.size > MAX_SIZE:
            return None
        same = b if b.shape == a.shape else a  # the same node twice: gradients must add up
        if name == "concat":
            return vg.concat([a, same], axis=k % x.ndim)
        return vg.stack([a, same], axis=k % (x.ndim + 1))
    if name == "tanh":
        return vg.tanh(a)
    if name == "sigmoid":
        return vg.sigmoid(a)
    if name == "softplus":
        return vg.softplus(a)
    if name == "neg":
        return -a
    if name == "exp":
        return vg.exp(a) if np.all(np.abs(x) < 4) else None
    if name == "log":
        return vg.log(a * a + 0.5)
    if name == "pow_int":
        return a ** (1 + k % 3)
    if name == "pow_real":
        return (vg.softplus(a) + 0.5) ** [-1.5, -0.5, 0.5, 1.5, 2.5][k % 5]
    if name in ("relu", "abs", "step", "sign"):
        if not _away_from_kink(x):
            return None
        return {"relu": vg.relu, "abs": vg.abs, "step": vg.step, "sign": vg.sign}[name](a)
    if name in ("sum", "mean", "max"):
        axis = _axis(x, k)
        if name == "max" and not _no_near_ties(x, axis):
            return None
        return getattr(vg, name)(a, axis=axis, keepdims=bool(k & 4))
    if x.ndim == 0:
        return None
    if name == "softmax":
        return vg.softmax(a, axis=-1 if k % 2 else 0)
    if name == "log_softmax":
        return vg.log_softmax(a, axis=-1 if k % 2 else 0)
    if name == "reshape":
        return vg.reshape(a, (-1,) if k % 2 else x.shape[::-1])
    if name == "transpose":
        return vg.transpose(a, None if k % 2 else tuple(int(i) for i in rng.permutation(x.ndim)))
    if name == "getitem":
        return [lambda: a[0], lambda: a[..., ::2], lambda: a[-1:], lambda: a[..., None, 0]][k % 4]()
    if name == "getitem_repeat":  # an integer array with a repeated row: np.add.at in the VJP
        return a[np.array([0, x.shape[0] - 1, 0])]
    if name == "take":
        return vg.take(a, cg.input(rng.integers(0, x.shape[0], size=1 + k % 4), name="rows"))
    if name == "take_along_axis":
        idx = rng.integers(0, x.shape[-1], size=(*x.shape[:-1], 1 + k % 3))
        return vg.take_along_axis(a, cg.input(idx, name="idx"), axis=-1)
    if name in ("matmul", "rmatmul"):
        m = 1 + k % 3
        if name == "matmul":
            W = cg.parameter(rng.uniform(-1, 1, (x.shape[-1], m) if k % 4 else (x.shape[-1],)), name="Wm")
            return a @ W
        rows = x.shape[-2] if x.ndim >= 2 else x.shape[-1]
        W = cg.parameter(rng.uniform(-1, 1, (m, rows) if k % 4 else (rows,)), name="Wr")
        return W @ a
    raise AssertionError(name)


def build_random_graph(recipe):
    """Interpret a recipe: (graph, output node, parameters, op nodes)."""
    base, leaves, steps, seed = recipe
    rng = np.random.default_rng(seed)
    cg = ComputeGraph(dtype=np.float64)
    pool = [cg.parameter(rng.uniform(-2, 2, shape), name=f"p{i}") for i, shape in enumerate(leaves)]
    ops = []
    for name, i, j, k in steps:
        a, b = pool[i % len(pool)], pool[j % len(pool)]
        out = _apply(cg, rng, name, a, b, k)
        if out is None or np.size(out.value) > MAX_SIZE:
            out = vg.tanh(a)
        note(f"{name}: {out.describe()} {out.shape}")
        pool.append(out)
        ops.append(out)
    # Every node counts, each in a random direction; the last one is left non-scalar, so
    # gradcheck projects it too (and it checks the seeded, non-scalar backward).
    output = ops[-1]
    for n in ops[:-1]:
        output = output + vg.sum(n * rng.standard_normal(n.shape))
    return cg, output, cg.parameters()


def examples(n: int) -> settings:
    """``n`` examples in the default profile, scaled with the active profile's max_examples."""
    return settings(max_examples=max(1, n * settings().max_examples // FAST_EXAMPLES))


FAST_EXAMPLES = 40  # max_examples of the fast profile (tests/conftest.py)


def check_gradients(recipe):
    cg, output, params = build_random_graph(recipe)
    assert np.all(np.isfinite(output.value))
    vg.gradcheck(output, params)  # raises GradcheckError naming leaf and element
    # gradcheck restores every leaf and leaves .grad alone
    assert all(p.grad is None for p in params)


@examples(60)
@given(recipes())
def test_random_op_graphs_match_finite_differences(recipe):
    check_gradients(recipe)


@pytest.mark.parametrize("op", UNARY + BINARY)
@examples(6)
@given(data=st.data())
def test_each_op_in_random_graphs_matches_finite_differences(op, data):
    # hypothesis favours some ops over others; this makes sure every op is drawn in every run
    check_gradients(data.draw(recipes(forced=op), label="recipe"))
