"""The functions users reach for beyond the op table's gradchecks (tests/test_ops.py): integer
outputs (argmax, argmin, one_hot) in models, tie and bound rules, argument errors; a virtual
node's declared ``.shape``; and the errors that stop Python control flow on a virtual node."""

from __future__ import annotations

import numpy as np
import pytest

import vgraph as vg
from vgraph import ComputeGraph


# ---------------------------------------------------------------------------- integer outputs
@pytest.mark.parametrize(
    "build, ref",
    [
        (lambda x: vg.argmax(x, axis=-1), lambda a: np.argmax(a, axis=-1)),
        (lambda x: vg.argmax(x), np.argmax),
        (lambda x: vg.argmin(x, axis=0, keepdims=True), lambda a: np.argmin(a, axis=0, keepdims=True)),
        (lambda x: x.argmax(axis=1), lambda a: a.argmax(axis=1)),
        (lambda x: x.argmin(), lambda a: a.argmin()),
    ],
    ids=["argmax-last", "argmax-flat", "argmin-keepdims", "method-argmax", "method-argmin"],
)
def test_argmax_argmin_are_numpy_integers_without_gradient(build, ref):
    cg = ComputeGraph(dtype=np.float64)
    a = np.array([[0.5, -1.0, 2.0, 2.0], [3.0, 0.0, -2.0, 1.0], [0.1, 0.2, 0.3, -0.4]])
    x = cg.input(a, requires_grad=True)
    y = build(x)
    np.testing.assert_array_equal(y.value, ref(a))
    assert y.value.dtype.kind == "i"
    assert not y.requires_grad  # pruned from backward, as Step and Sign (docs/decisions.md)
    with pytest.raises(vg.GraphStateError, match="do not depend"):
        cg.grad(y.sum() * 1.0, [x])


def test_argmax_used_as_indices_contributes_no_gradient():
    # d/dx sum(take(x, argmax(x)) ...) flows through take's table only, as with constant indices.
    cg = ComputeGraph(dtype=np.float64)
    a = np.array([[1.0, 3.0], [4.0, 2.0], [0.0, 5.0]])
    x = cg.input(a, requires_grad=True)
    rows = vg.argmax(x[:, 0])  # row 1
    (g,) = cg.grad(vg.take(x, rows).sum() * 2.0, [x])
    np.testing.assert_array_equal(g, [[0, 0], [2, 2], [0, 0]])


def test_one_hot_matches_numpy_and_has_no_gradient():
    cg = ComputeGraph(dtype=np.float32)
    idx = cg.input(np.array([[2, 0], [1, 1]]))
    y = vg.one_hot(idx, 3)
    np.testing.assert_array_equal(y.value, np.eye(3)[[[2, 0], [1, 1]]])
    assert y.value.dtype == np.float32  # the graph's dtype
    assert not y.requires_grad


def test_one_hot_refuses_bad_arguments_and_bad_indices():
    cg = ComputeGraph(dtype=np.float64)
    idx = cg.input(np.array([0, 3]))
    with pytest.raises(TypeError, match="depth must be a positive int"):
        vg.one_hot(idx, 0)
    with pytest.raises(TypeError, match="must be a graph node"):
        vg.one_hot(np.array([0, 1]), 3)
    with pytest.raises(vg.ShapeError, match=r"OneHot:1.*must be in \[0, 3\)"):
        vg.one_hot(idx, 3)
    with pytest.raises(vg.ShapeError, match="integer indices"):
        vg.one_hot(cg.input(np.array([0.5])), 3)


def test_greedy_decoding_carries_argmax_tokens_until_eos():
    """A decoder feeds back its own argmax token (an integer carry), looked up with take, and
    stops when every row emitted EOS (``until``): the tokens equal a numpy greedy decode."""
    V, H, EOS = 5, 8, 0
    g = vg.VirtualGraph(seed=3, dtype=np.float64)
    E, W, O = g.parameter("E", (V, H)), g.parameter("W", (H, H)), g.parameter("O", (H, V))
    start = g.input("start", shape=(None,))
    with g.loop(until=lambda t, s: bool((s["tok"] == EOS).all()), max_iters=12, on_limit="stop") as loop:
        tok = loop.carry(start, name="tok")
        h = loop.carry(np.zeros((2, H)), name="h")
        h_new = vg.tanh(vg.take(E, tok) + h @ W)
        logits = h_new @ O
        nxt = vg.argmax(logits, axis=-1)
        logp = vg.log_softmax(logits)
        loop.update(h, h_new)
        loop.update(tok, nxt)
    tokens = loop.stack(nxt)
    score = vg.sum(vg.take_along_axis(loop.stack(logp), tokens[..., None], axis=-1))
    cg = g.build({"start": np.array([3, 1])}, [tokens, score])

    e, w, o = (g.params[k].value for k in "EWO")
    t, hh, want = np.array([3, 1]), np.zeros((2, H)), []
    for _ in range(12):
        hh = np.tanh(e[t] + hh @ w)
        t = np.argmax(hh @ o, axis=-1)
        want.append(t)
        if (t == EOS).all():
            break
    np.testing.assert_array_equal(cg.node(tokens).value, np.stack(want))
    assert cg.trip_count(loop) == len(want)
    assert cg.node(tokens).value.dtype.kind == "i"
    # The score's gradient through the decoded tokens (fixed by argmax) against finite differences.
    assert vg.gradcheck(cg.node(score), [g.params[k] for k in "EWO"]).max_rel_error < 1e-5


def test_a_while_condition_reads_an_integer_argmax_carry():
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", shape=(None, 4))
    with g.loop(while_=lambda t, s: int(s["best"]) != 3, max_iters=10) as loop:
        best = loop.carry(np.array(0), name="best")
        row = loop.step(x)
        loop.update(best, vg.argmax(row))
    final = loop.final(best)
    rows = np.array([[1.0, 0, 0, 0], [0, 5, 0, 0], [0, 0, 0, 9], [9, 0, 0, 0]])
    cg = g.build({"x": rows}, final)
    assert cg.trip_count(loop) == 3  # stops after the row whose maximum is at index 3
    assert cg.node(final).value == 3


# ---------------------------------------------------------------------------- ties, bounds, args
def test_maximum_and_minimum_ties_share_the_gradient_equally():
    cg = ComputeGraph(dtype=np.float64)
    a = cg.input(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    b = cg.input(np.array([1.0, 5.0, 0.0]), requires_grad=True)
    ga, gb = cg.grad(vg.maximum(a, b).sum(), [a, b], retain_graph=True)
    np.testing.assert_array_equal(ga, [0.5, 0, 1])
    np.testing.assert_array_equal(gb, [0.5, 1, 0])
    ga, gb = cg.grad(vg.minimum(a, b).sum(), [a, b])
    np.testing.assert_array_equal(ga, [0.5, 1, 0])
    np.testing.assert_array_equal(gb, [0.5, 0, 1])


def test_clip_passes_the_gradient_inside_its_bounds_included():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.array([-2.0, -1.0, 0.0, 1.0, 2.0]), requires_grad=True)
    y = vg.clip(x, -1, 1)
    np.testing.assert_array_equal(y.value, [-1, -1, 0, 1, 1])
    (g,) = cg.grad(y.sum(), [x])
    np.testing.assert_array_equal(g, [0, 1, 1, 1, 0])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: vg.clip(x, 1.0, -1.0), ValueError, "above"),
        (lambda x: vg.clip(x, "0"), TypeError, "number or None"),
        (lambda x: vg.clip(x, None, x), TypeError, "maximum"),
        (lambda x: vg.var(x, ddof=0.5), TypeError, "ddof"),
        (lambda x: vg.split(x, 4), ValueError, "equal parts"),
        (lambda x: vg.split(x, "ab"), TypeError, "sequence of ints"),
    ],
)
def test_argument_errors_declare_nothing(call, error, match):
    g = vg.VirtualGraph()
    x = g.input("x", shape=(6, 2))
    before = len(g.nodes)
    with pytest.raises(error, match=match):
        call(x)
    assert len(g.nodes) == before


def test_split_parts_are_slices_whose_gradients_meet():
    cg = ComputeGraph(dtype=np.float64)
    a = np.arange(12.0).reshape(2, 6)
    x = cg.input(a, requires_grad=True)
    parts = vg.split(x, 3, axis=1)
    for got, want in zip(parts, np.split(a, 3, axis=1)):
        np.testing.assert_array_equal(got.value, want)
    first, rest = vg.split(x, [2], axis=-1)
    np.testing.assert_array_equal(rest.value, a[:, 2:])
    (g,) = cg.grad((first * 2.0).sum() + rest.sum(), [x])
    np.testing.assert_array_equal(g, np.where(np.arange(6) < 2, 2.0, 1.0)[None].repeat(2, 0))


def test_split_of_a_virtual_node_of_unknown_size_needs_positions():
    g = vg.VirtualGraph()
    x = g.input("x", shape=(None, 6))
    with pytest.raises(ValueError, match="unknown size"):
        vg.split(x, 2)
    a, b = vg.split(x, 2, axis=1)
    assert a.shape == b.shape == (None, 3)


# ---------------------------------------------------------------------------- declared shapes
def test_shape_of_inputs_parameters_and_constants():
    g = vg.VirtualGraph()
    assert g.input("x", shape=(None, 3)).shape == (None, 3)
    assert g.input("any").shape is None
    assert g.parameter("W", (3, 4)).shape == (3, 4)
    assert g.constant(np.zeros((2, 5))).shape == (2, 5)
    assert g.constant(1.5).shape == ()


def test_shape_follows_the_op_rules():
    g = vg.VirtualGraph()
    x = g.input("x", shape=(None, None, 3))  # (time, batch, features)
    W = g.parameter("W", (3, 4))
    b = g.parameter("b", (4,))
    y = vg.tanh(x @ W + b)
    assert y.shape == (None, None, 4)
    assert (W @ g.parameter("v", (4,))).shape == (3,)
    assert y.sum(axis=-1).shape == (None, None)
    assert y.mean(axis=(0, 2), keepdims=True).shape == (1, None, 1)
    assert vg.max(y).shape == ()
    assert vg.argmax(y, axis=-1).shape == (None, None)
    assert y.T.shape == (4, None, None)
    assert vg.transpose(y, (1, 0, 2)).shape == (None, None, 4)
    assert y[0].shape == (None, 4)
    assert y[:, :, 1:3].shape == (None, None, 2)
    assert y[2:5].shape is None  # a part of an axis of unknown length
    assert W.reshape(-1).shape == (12,)
    assert W.reshape(2, 6).shape == (2, 6)
    tokens = g.input("tokens", shape=(None,))
    E = g.parameter("E", (10, 4))
    assert vg.take(E, tokens).shape == (None, 4)
    assert vg.one_hot(tokens, 10).shape == (None, 10)
    assert vg.concat([W, W], axis=1).shape == (3, 8)
    assert vg.stack([W, W]).shape == (2, 3, 4)
    assert vg.where(g.input("m", shape=(1, 4)), W, 0.0).shape == (3, 4)
    assert (W + g.input("z", shape=(None, 1, 4))).shape == (None, 3, 4)
    assert (x * g.input("u")).shape is None  # an operand of unknown rank
    assert vg.functions.lstm_cell(y, y, b, b).shape is None  # no simple rule: unknown


def test_shape_in_loops_and_branches():
    g = vg.VirtualGraph()
    x = g.input("x", shape=(None, 2, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (4, 4))
    with g.loop() as loop:
        x_t = loop.step(x)
        h = loop.carry(np.zeros((2, 4)), name="h")
        c = loop.carry(np.zeros((2, 4)), name="c")  # h and c read each other (as in an LSTM)
        s = loop.carry(np.zeros((1, 4)), name="s")  # broadcast to (2, 4) by its first update
        h_new = vg.tanh(x_t @ W + c @ U)
        loop.update(h, h_new)
        loop.update(c, h * 0.5)
        loop.update(s, s + h)
    assert x_t.shape == (2, 3)
    assert h.shape == c.shape == h_new.shape == (2, 4)
    assert s.shape is None
    assert loop.final(h).shape == (2, 4)
    assert loop.stack(h_new).shape == (None, 2, 4)
    out = g.branch(lambda v: int(v.sum() > 0), [loop.final(h), loop.final(c)], keys=[x])
    assert out.shape == (2, 4)
    mixed = g.branch(lambda v: 0, [loop.final(h), W], keys=[x])
    assert mixed.shape is None


def test_every_known_dimension_matches_the_built_values():
    """A declared shape is a promise: every copy of every node built has it, where known."""
    g = vg.VirtualGraph(seed=0)
    x = g.input("x", shape=(None, None, 3))
    W_x, W_h = g.parameter("W_x", (3, 8)), g.parameter("W_h", (8, 8))
    with g.loop() as loop:
        x_t = loop.step(x)
        h = loop.carry(np.zeros((4, 8)), name="h")
        h_new = vg.tanh(x_t @ W_x + h @ W_h)
        loop.update(h, h_new)
        with g.loop(times=2) as inner:
            z = inner.carry(h_new, name="z")
            inner.update(z, vg.relu(z @ W_h))
        best = vg.argmax(inner.final(z), axis=-1)
    hs = loop.stack(h_new)
    picks = loop.stack(best)
    loss = vg.mean(vg.log_softmax(hs, axis=-1)) + vg.var(hs[:, :, :2]) + vg.sum(vg.one_hot(picks, 8))
    g.build({"x": np.random.default_rng(0).normal(size=(5, 4, 3))}, loss)
    checked = 0
    for v in g.nodes:
        declared = v.shape
        for node in v.compute_nodes.values():
            if declared is None or node is None:  # (a loop has no value)
                continue
            actual = np.shape(node.value)
            assert len(declared) == len(actual), v.describe()
            assert all(d is None or d == a for d, a in zip(declared, actual)), (
                v.describe(),
                declared,
                actual,
            )
            checked += 1
    assert checked > 50


# ---------------------------------------------------------------------------- Python control flow
@pytest.fixture
def declared():
    g = vg.VirtualGraph()
    x = g.input("x", shape=(None, 3))
    return g, x, vg.tanh(x)


@pytest.mark.parametrize(
    "misuse, hint",
    [
        (lambda x: bool(x), "g.branch"),
        (lambda x: 1 if x else 0, "while_= / until="),
        (lambda x: x and 1, "vgraph.where"),
        (lambda x: not x, "g.branch"),
        (lambda x: x < 0, "g.branch"),
        (lambda x: x >= 0.5, "vgraph.where"),
        (lambda x: 0 > x, "until="),  # noqa: SIM300 (the reflected comparison is the point)
        (lambda x: [1, 2, 3][x], "vgraph.take"),
        (lambda x: np.arange(3)[x], "vgraph.take"),
        (lambda x: range(x), "vgraph.take"),
        (lambda x: x[x], "vgraph.take"),
        (lambda x: x[0, x], "vgraph.take"),
        (lambda x: x[[x, 0]], "vgraph.take"),
        (lambda x: len(x), "loop.step"),
        (lambda x: [r for r in x], "loop.step"),
        (lambda x: tuple(x), "vgraph.split"),
        (lambda x: int(x), "cg.node"),
        (lambda x: float(x), "cg.node"),
    ],
    ids=[
        "bool", "if", "and", "not", "lt", "ge", "reflected-gt", "list-index", "array-index", "range",
        "node-index", "node-in-tuple-index", "node-in-list-index", "len", "for", "unpack", "int", "float",
    ],
)  # fmt: skip
def test_python_control_flow_on_a_node_teaches_the_vgraph_way(declared, misuse, hint):
    g, _, y = declared
    before = len(g.nodes)
    with pytest.raises(vg.ArgumentError) as info:
        misuse(y)
    assert isinstance(info.value, TypeError)  # generic handlers keep working
    assert "<Tanh:1>" in str(info.value)  # names the node
    assert hint in str(info.value)
    assert len(g.nodes) == before  # nothing declared


def test_len_names_the_declared_length_when_known():
    g = vg.VirtualGraph()
    with pytest.raises(vg.ArgumentError, match=r"declared length is 4"):
        len(g.input("x", shape=(4, 3)))


def test_nodes_stay_usable_as_keys_and_loops_as_scopes(declared):
    g, x, y = declared
    assert {x: 1, y: 2}[y] == 2 and y in [x, y] and y != x  # identity equality, hashing
    with g.loop(times=2) as loop:
        c = loop.carry(np.zeros((1, 3)))
        loop.update(c, c + 1.0)
    assert c.scope and loop  # a loop is a declaration, not a value: truthy


def test_new_ops_in_loops_agree_across_cached_hoisted_and_batched_builds():
    """The functions above, in an encoder loop and a greedy decoder: builds from the cache (and
    compiled sweeps), with hoisting, and batched across inputs of different lengths all give the
    plain unroll's values and gradients."""
    V, H, EOS = 6, 8, 0
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    E, W, O = g.parameter("E", (V, H)), g.parameter("W", (H, H)), g.parameter("O", (H, V))
    first = g.input("first", shape=(None,))
    xs = g.input("xs", shape=(None, 2, H))
    with g.loop() as enc:
        x_t = enc.step(xs)
        s = enc.carry(np.zeros((2, H)), name="s")
        s_new = vg.clip(vg.maximum(x_t @ W, s) + vg.sqrt(vg.abs(x_t) + 1.0), -2.0, 2.0)
        enc.update(s, vg.minimum(s_new, 1.5))
    enc_out = vg.cumsum(enc.stack(s_new), axis=0)
    with g.loop(until=lambda t, st: bool((st["tok"] == EOS).all()), max_iters=20, on_limit="stop") as dec:
        tok = dec.carry(first, name="tok")
        h = dec.carry(enc.final(s), name="h")
        h_new = vg.tanh(vg.take(E, tok) + h @ W)
        logits = h_new @ O
        nxt = vg.argmax(logits, axis=-1)
        dec.update(h, h_new)
        dec.update(tok, nxt)
        lp = vg.log_softmax(logits) * (1.0 + vg.one_hot(nxt, V))
    tokens = dec.stack(nxt)
    picked = vg.take_along_axis(dec.stack(lp), tokens[..., None], axis=-1)
    score = vg.sum(picked) + vg.var(enc_out) + vg.min(enc_out) + vg.sum(vg.argmin(enc_out, axis=0) * 0.1)
    rng = np.random.default_rng(0)
    feeds = [{"first": np.array([3, 1]), "xs": rng.normal(size=(n, 2, H))} for n in (3, 5, 4)]

    def run(feed, **build):
        g.params.zero_grad()
        cg = g.build(feed, [tokens, score], **build)
        return cg.backward(score), {k: np.array(p.grad) for k, p in g.params.items()}

    plain = []
    for feed in feeds:
        value, grads = run(feed, hoist=False, cache=False)
        plain.append((value, grads))
        for _ in range(3):  # a fresh build, then cached ones (replayed by compiled sweeps)
            again, again_grads = run(feed)
            assert np.isclose(again, value)
            for k in grads:
                np.testing.assert_allclose(again_grads[k], grads[k], rtol=1e-12, atol=1e-12)
    g.params.zero_grad()
    total = g.build_batch(feeds, score).backward()
    assert np.isclose(total, np.mean([v for v, _ in plain]))
    for k in plain[0][1]:
        want = np.mean([grads[k] for _, grads in plain], axis=0)
        np.testing.assert_allclose(g.params[k].grad, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fn", ["maximum", "minimum", "min", "max", "clip"])
def test_float32_gradients_stay_float32(fn):
    """Tie shares and counts are made in the gradient's dtype: a float32 model gets float32 .grad
    (``0.5 * bool_array`` and a division by an integer count would make them float64)."""
    from vgraph.compute import ComputeGraph

    cg = ComputeGraph(np.float32)
    a = cg.input(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
    b = cg.input(np.array([2.0, 2.0, 1.0], np.float32), requires_grad=True)
    out = {
        "maximum": lambda: vg.maximum(a, b),
        "minimum": lambda: vg.minimum(a, b),
        "min": lambda: vg.min(a * b),
        "max": lambda: vg.max(a * b),
        "clip": lambda: vg.clip(a, 1.5, 2.5),
    }[fn]()
    cg.backward(vg.sum(out))
    assert a.grad.dtype == np.float32
