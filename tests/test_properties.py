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
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

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


# ============================================================================ 2. stale values
#
# An Elman RNN unrolled over T steps, with three losses: two that read every leaf (one through
# tanh(y), a value no gradient flows through) and one that reads only the bias. The machine
# changes leaves in every way the API offers, runs forward on some targets, backward / backward_ex
# / grad from others, steps an optimiser and clears gradients, in random order. It models which
# target is stale (a leaf it depends on changed after its last successful forward), whether the
# graph was released (a backward without retain_graph since the last forward), and whether the
# last forward failed its structure check; and it keeps the gradients it expects in each .grad.
#
# References are independent of the graph under test: losses are recomputed with numpy from the
# current leaf values, gradients come from a fresh model and graph built on the current values.

T = 3
PARAMS = ("W", "U", "b")
TARGETS = ("loss1", "loss2", "loss3")
READS = {"loss1": {"xs", "y", *PARAMS}, "loss2": {"xs", "y", *PARAMS}, "loss3": {"b"}}
# Every forward also re-checks the graph's recorded decisions (here the loop's length, read from
# xs), and every backward refuses while one of them is out of date, even from loss3, which does
# not read xs: conservative, never wrong. Any successful forward brings them up to date.
GUARDS_READ = {"xs"}


def make_rnn(state=None):
    """The model: (graph, {target name: virtual node}); parameters from ``state`` if given."""
    g = vg.VirtualGraph(dtype=np.float64, seed=7)
    xs = g.input("xs", (None, 1, 2))
    y = g.input("y", (1, 3))
    W = g.parameter("W", (2, 3))
    U = g.parameter("U", (3, 3))
    b = g.parameter("b", (3,), init="normal")
    with g.loop() as L:
        h = L.carry(np.zeros((1, 3)), name="h")
        L.update(h, vg.tanh(L.step(xs) @ W + h @ U + b))
    hT = L.final(h)
    losses = {
        "loss1": vg.sum((hT - y) ** 2),
        "loss2": vg.sum(vg.tanh(hT) * vg.tanh(y)),
        "loss3": vg.mean(vg.tanh(b)),
    }
    if state is not None:
        g.load_state_dict(state)
    return g, losses


def numpy_losses(feed, p):
    """The three losses, by hand."""
    h = np.zeros((1, 3))
    for t in range(feed["xs"].shape[0]):
        h = np.tanh(feed["xs"][t] @ p["W"] + h @ p["U"] + p["b"])
    y = feed["y"]
    return {
        "loss1": np.sum((h - y) ** 2),
        "loss2": np.sum(np.tanh(h) * np.tanh(y)),
        "loss3": np.mean(np.tanh(p["b"])),
    }


def fresh_gradients(feed, state, target):
    """{parameter name: gradient or None} of ``target`` on a graph built anew for these values."""
    g, losses = make_rnn(state)
    cg = g.build(feed, list(losses.values()))
    grads = cg.grad(losses[target], [g.params[n] for n in PARAMS], allow_unused=True)
    return dict(zip(PARAMS, grads))


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-13)


def floats(shape):
    return hnp.arrays(np.float64, shape, elements=st.floats(-2, 2, allow_nan=False, allow_infinity=False))


class StaleValues(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.g, self.losses = make_rnn()
        rng = np.random.default_rng(0)
        self.feed = {"xs": rng.uniform(-1, 1, (T, 1, 2)), "y": rng.uniform(-1, 1, (1, 3))}
        self.cg = self.g.build(self.feed, list(self.losses.values()))
        self.opt = vg.optim.SGD(self.g.params, lr=0.1)
        self.stale: set[str] = set()  # targets a forward must refresh before a backward from them
        self.released = False  # a backward without retain_graph ran since the last forward
        self.broken = False  # the last forward failed its structure check
        self.guards_stale = False  # a leaf the recorded decisions read changed since the last forward
        self.expected = dict.fromkeys(PARAMS)  # what each .grad must hold

    # -- helpers
    def params(self):
        return {n: np.array(self.g.params[n].value) for n in PARAMS}

    def grads(self):
        return {n: None if self.g.params[n].grad is None else np.array(self.g.params[n].grad) for n in PARAMS}

    def changed(self, leaf):
        self.stale |= {t for t in TARGETS if leaf in READS[t]}
        self.guards_stale |= leaf in GUARDS_READ

    def refused(self, target):
        return self.broken or self.released or self.guards_stale or target in self.stale

    def assert_refused(self, call):
        before = self.grads()
        with pytest.raises(vg.GraphStateError):
            call()
        after = self.grads()
        for n in PARAMS:  # bit for bit, None stays None
            assert (before[n] is None) == (after[n] is None), n
            if before[n] is not None:
                assert np.array_equal(before[n], after[n]), n

    # -- changing leaves
    @rule(values=floats((T, 1, 2)), how=st.sampled_from(["feed", "set_value", "value=", "same"]))
    def change_xs(self, values, how):
        node = self.cg.inputs["xs"]
        if how == "feed":
            self.cg.feed({"xs": values})
        elif how == "set_value":
            node.set_value(values)
        elif how == "value=":
            node.value = values
        else:  # the same numbers: still a new version, still needs a forward
            values = np.array(node.value)
            node.set_value(values.copy())
        self.feed["xs"] = np.array(values)
        self.changed("xs")

    @rule(values=floats((1, 3)), how=st.sampled_from(["feed", "set_value"]))
    def change_y(self, values, how):
        if how == "feed":
            self.cg.feed({"y": values})
        else:
            self.cg.inputs["y"].set_value(values)
        self.feed["y"] = np.array(values)
        self.changed("y")

    @rule(length=st.sampled_from([1, 2, T + 1]), data=st.data())
    def feed_another_length(self, length, data):
        # The graph was unrolled for T steps: a forward must refuse until the length is T again.
        self.cg.feed({"xs": data.draw(floats((length, 1, 2)), label="xs")})
        self.feed["xs"] = np.array(self.cg.inputs["xs"].value)
        self.changed("xs")

    @rule(name=st.sampled_from(PARAMS), data=st.data(), how=st.sampled_from(["set_value", "store", "-="]))
    def change_parameter(self, name, data, how):
        p = self.g.params[name]
        values = data.draw(floats(p.shape), label=name)
        if how == "set_value":
            p.set_value(values)
        elif how == "store":
            self.g.params.set_value(name, values)
        else:
            values = p.value - values
            p.value -= p.value - values  # augmented assignment goes through the setter
        self.changed(name)

    @rule()
    def optimiser_step(self):
        before, grads = self.params(), self.grads()
        self.opt.step()
        after = self.params()
        for n in PARAMS:
            if grads[n] is None:
                assert np.array_equal(after[n], before[n])
            else:
                close(after[n], before[n] - 0.1 * grads[n])
                self.changed(n)

    @rule(how=st.sampled_from(["store", "optimiser", "graph"]))
    def zero_grad(self, how):
        {"store": self.g.params.zero_grad, "optimiser": self.opt.zero_grad, "graph": self.cg.zero_grad}[how]()
        self.expected = dict.fromkeys(PARAMS)

    # -- forward
    @rule(which=st.sampled_from([*TARGETS, "all"]))
    def forward(self, which):
        if self.feed["xs"].shape[0] != T:
            with pytest.raises(vg.StructureChangedError):
                self.cg.forward(None if which == "all" else self.losses[which])
            self.broken = True
            return
        reference = numpy_losses(self.feed, self.params())
        if which == "all":
            values = self.cg.forward()
            for t, v in zip(TARGETS, values):
                close(v, reference[t])
            self.stale.clear()
        else:
            close(self.cg.forward(self.losses[which]), reference[which])
            self.stale.discard(which)
        self.released = self.broken = self.guards_stale = False

    # -- backward
    @rule(which=st.sampled_from(TARGETS), retain=st.booleans(), ex=st.booleans())
    def backward(self, which, retain, ex):
        loss = self.losses[which]
        if ex:
            call = lambda: self.cg.backward_ex(loss, retain_graph=retain)  # noqa: E731
        else:
            call, retain = (lambda: self.cg.backward(loss)), False
        if self.refused(which):
            self.assert_refused(call)
            return
        value = call()
        close(value, numpy_losses(self.feed, self.params())[which])
        for n, g in fresh_gradients(self.feed, self.params(), which).items():
            if g is not None:
                self.expected[n] = g if self.expected[n] is None else self.expected[n] + g
        self.released = not retain

    @rule(
        which=st.sampled_from(TARGETS),
        wrt=st.lists(st.sampled_from(PARAMS), min_size=1, max_size=3, unique=True),
        retain=st.booleans(),
        allow_unused=st.booleans(),
    )
    def grad(self, which, wrt, retain, allow_unused):
        nodes = [self.g.params[n] for n in wrt]
        call = lambda: self.cg.grad(self.losses[which], nodes, retain_graph=retain, allow_unused=allow_unused)  # noqa: E731
        if self.refused(which):
            self.assert_refused(call)
            return
        fresh = fresh_gradients(self.feed, self.params(), which)
        if not allow_unused and any(fresh[n] is None for n in wrt):
            self.assert_refused(call)  # "the outputs do not depend on ...": nothing changes
            return
        before = self.grads()
        for n, g in zip(wrt, call()):
            if fresh[n] is None:
                assert g is None
            else:
                close(g, fresh[n])
        after = self.grads()
        assert all(np.array_equal(before[n], after[n]) for n in PARAMS if before[n] is not None)
        assert all(after[n] is None for n in PARAMS if before[n] is None)
        self.released = not retain

    @invariant()
    def grads_hold_what_accepted_backwards_accumulated(self):
        grads = self.grads()
        for n in PARAMS:
            if self.expected[n] is None:
                assert grads[n] is None, n
            else:
                close(grads[n], self.expected[n])


StaleValues.TestCase.settings = examples(60)
test_stale_values_are_never_used = StaleValues.TestCase


# ============================================================================ defects found
#
# Minimal regression tests for defects the properties above found. Each is marked
# xfail(strict=True) until the owner of the file fixes it: then it passes, strict xfail turns
# that into a failure, and the marker must be removed with the fix.


@pytest.mark.xfail(
    strict=True,
    reason="compute.py: a leaf's .value is the live array; writing into it bumps no version, so "
    "backward silently uses values the graph's values were not computed from",
)
def test_writing_into_a_leaf_value_in_place_is_never_silently_used():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([1.0, 2.0]), name="x")
    W = cg.parameter(np.array([0.5, -0.5]), name="W")
    loss = vg.sum(vg.tanh(x * W))
    try:
        x.value[0] = 5.0  # e.g. a user normalising an input in place
    except ValueError:
        return  # a read-only leaf value is one fix
    with pytest.raises(vg.GraphStateError):  # refusing the backward is the other
        cg.backward(loss)


@pytest.mark.xfail(
    strict=True,
    reason="compute.py: ComputeGraph.input and ComputeNode.set_value keep the caller's array "
    "(no copy, unlike feed), so the caller's later in-place change silently desynchronises the graph",
)
def test_a_leaf_does_not_alias_the_array_it_was_given():
    cg = ComputeGraph(dtype=np.float64)
    given_to_input = np.array([1.0, 2.0])
    x = cg.input(given_to_input, name="x")
    given_to_input[:] = 100.0
    np.testing.assert_array_equal(x.value, [1.0, 2.0])
    W = cg.parameter(np.array([0.5, -0.5]), name="W")
    loss = vg.sum(vg.tanh(x) * W)
    given_to_set = np.array([3.0, 4.0])
    x.set_value(given_to_set)
    cg.forward(loss)
    given_to_set[:] = 100.0  # the caller reuses its buffer
    np.testing.assert_array_equal(x.value, [3.0, 4.0])
