"""The virtual-graph layer (vgraph/virtual.py): declare once, unroll per input, differentiate exactly.

Every test compares vgraph against something that does not go through the code under test:
hand-written numpy forward/backward-through-time, the same model written as a flat imperative
``vg.ComputeGraph``, finite differences (``vg.gradcheck``), closed forms, or a plain Python loop
deciding trip counts and branch choices. All in float64.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import vgraph as vg
from vgraph import NodeKey

F64 = np.float64


# ---------------------------------------------------------------------------- helpers


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (absolute when expected is all zeros)."""
    actual, expected = np.asarray(actual, F64), np.asarray(expected, F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    return float(np.max(np.abs(actual - expected)) / (scale if scale > 0 else 1.0)) if actual.size else 0.0


def assert_rel(actual, expected, tol, what=""):
    err = rel_err(actual, expected)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g}"


def rotation(degrees: float, scale: float) -> np.ndarray:
    th = np.deg2rad(degrees)
    return scale * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])


def snapshot(g: vg.VirtualGraph):
    """What a failed build or declaration must leave alone."""
    return len(g.params), list(g.params), {k: g.params.value(k) for k in g.params}, g.latest_build


def assert_unchanged(g: vg.VirtualGraph, snap) -> None:
    n, names, values, latest = snap
    assert len(g.params) == n
    assert list(g.params) == names
    for k, v in values.items():
        np.testing.assert_array_equal(g.params[k].value, v)
    assert g.latest_build is latest


# ---------------------------------------------------------------------------- 1. Elman RNN vs numpy BPTT

T, B, I, H, O = 7, 3, 4, 5, 2


def elman(stacked: bool, seed: int = 0):
    """Elman RNN (h0 is a learnable (1, H) row, broadcast over the batch):

    h0 ──► [h_1] ──► ... ──► [h_T]      h_t = tanh(x_t Wx + h_{t-1} Wh + b)
             │                 │
    stacked: └── Wo ── ... ────┴──► loss = mean over t, batch, out of (h_t Wo - y_t)^2
    final:                     └──► loss = mean((h_T Wo - y)^2)
    """
    g = vg.VirtualGraph(dtype=F64, seed=seed)
    x = g.input("x", shape=(None, None, I))
    y = g.input("y", shape=(None, None, O) if stacked else (None, O))
    Wx = g.parameter("Wx", (I, H))
    Wh = g.parameter("Wh", (H, H), init="orthogonal")
    b = g.parameter("b", (H,))
    Wo = g.parameter("Wo", (H, O))
    h0 = g.parameter("h0", (1, H))
    with g.loop() as L:
        xt = L.step(x)
        h = L.carry(h0, name="h")
        hn = vg.tanh(xt @ Wx + h @ Wh + b)
        L.update(h, hn)
    out = (L.stack(hn) if stacked else L.final(h)) @ Wo
    loss = ((out - y) ** 2).mean()
    # Values drawn here, independently of vgraph's initialisers.
    rng = np.random.default_rng(100 + seed)
    for name in g.params:
        g.params.set_value(name, rng.normal(0, 0.6, g.params[name].shape))
    return g, dict(x=x, y=y, L=L, h=h, hn=hn, loss=loss)


def elman_reference(P, xs, ys, stacked: bool):
    """Hand-written forward and backward-through-time in numpy."""
    hs = [np.broadcast_to(P["h0"], (xs.shape[1], P["h0"].shape[1]))]
    for t in range(len(xs)):
        hs.append(np.tanh(xs[t] @ P["Wx"] + hs[-1] @ P["Wh"] + P["b"]))
    Ts = len(xs)
    if stacked:
        outs = [hs[t + 1] @ P["Wo"] for t in range(Ts)]
        loss = np.mean((np.stack(outs) - ys) ** 2)
        n = ys.size
        gouts = [2 * (outs[t] - ys[t]) / n for t in range(Ts)]
    else:
        o = hs[-1] @ P["Wo"]
        loss = np.mean((o - ys) ** 2)
        gouts = [None] * (Ts - 1) + [2 * (o - ys) / o.size]
    G = {k: np.zeros_like(v) for k, v in P.items()}
    dh = np.zeros_like(hs[-1])  # gradient flowing back into h_t from step t+1
    for t in reversed(range(Ts)):
        h_t = hs[t + 1]
        if gouts[t] is not None:  # per-step loss injection
            G["Wo"] += h_t.T @ gouts[t]
            dh = dh + gouts[t] @ P["Wo"].T
        ga = dh * (1 - h_t**2)
        G["Wx"] += xs[t].T @ ga
        G["Wh"] += hs[t].T @ ga
        G["b"] += ga.sum(0)
        dh = ga @ P["Wh"].T
    G["h0"] = dh.sum(0, keepdims=True)  # h0 was broadcast over the batch
    return loss, G


@pytest.mark.parametrize("stacked", [False, True], ids=["final", "stacked"])
def test_elman_rnn_matches_numpy_bptt(stacked):
    g, n = elman(stacked)
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((T, B, I))
    ys = rng.standard_normal((T, B, O) if stacked else (B, O))
    cg = g.build({"x": xs, "y": ys}, n["loss"])
    P = g.params.state_dict()
    ref_loss, ref_grads = elman_reference(P, xs, ys, stacked)

    loss = cg.backward(n["loss"])
    assert_rel(loss, ref_loss, 1e-10, "loss")
    assert set(ref_grads) == set(g.params)
    for name, ref in ref_grads.items():
        assert_rel(g.params[name].grad, ref, 1e-10, f"d loss / d {name}")
    # One copy of the body per time step, keyed by the iteration.
    assert cg.trip_count(n["L"]) == T
    assert sorted(n["hn"].compute_nodes) == [(t,) for t in range(T)]
    assert cg.node(n["hn"], (3,)).key == NodeKey("Tanh", n["hn"].id, (3,))


# ---------------------------------------------------------------- 2. nested loops vs a flat ComputeGraph

NL, NT, NB, NH = 3, 4, 2, 3


def stacked_layers():
    """Three recurrent layers, each a loop over time, stacked by an outer loop:

    outer l = 0..2 (W@l untied, declared in the outer body)
      seq ──► inner t = 0..3:  h_t = tanh(seq_t @ W@l + h_{t-1} @ R + u@l.t)
              (R shared, top level;  u@l.t untied, declared in the inner body: 12 copies)
      seq := stack(h_0..h_3)                                            (the next layer's input)
    loss = sum(seq_final * c)
    """
    g = vg.VirtualGraph(dtype=F64, seed=11)
    x = g.input("x", shape=(None, NB, NH))
    c = g.input("c", shape=(None, NB, NH))
    R = g.parameter("R", (NH, NH))
    with g.loop(times=NL) as outer:
        W = g.parameter("W", (NH, NH))  # untied: one per layer
        seq = outer.carry(x, name="seq")
        with g.loop() as inner:
            st = inner.step(seq)
            h = inner.carry(np.zeros((NB, NH)), name="h")  # a constant made inside the bodies
            u = g.parameter("u", (NH,), init="normal")
            hn = vg.tanh(st @ W + h @ R + u)
            inner.update(h, hn)
        outer.update(seq, inner.stack(hn))
    loss = (outer.final(seq) * c).sum()
    return g, dict(W=W, u=u, hn=hn, inner=inner, outer=outer, loss=loss)


def test_nested_loops_match_flat_compute_graph():
    g, n = stacked_layers()
    rng = np.random.default_rng(3)
    xs, cs = rng.standard_normal((NT, NB, NH)), rng.standard_normal((NT, NB, NH))
    cg = g.build({"x": xs, "c": cs}, n["loss"])
    loss = cg.backward(n["loss"])
    us = [f"u@{layer}.{t}" for layer in range(NL) for t in range(NT)]
    assert sorted(g.params) == sorted(["R", "W@0", "W@1", "W@2", *us])

    # The same model, written out by hand as one flat imperative graph.
    flat = vg.ComputeGraph(F64)
    X, C = flat.input(xs), flat.input(cs)
    R = flat.parameter(g.params.value("R"))
    Ws = [flat.parameter(g.params.value(f"W@{layer}")) for layer in range(NL)]
    Us = {
        (layer, t): flat.parameter(g.params.value(f"u@{layer}.{t}")) for layer in range(NL) for t in range(NT)
    }
    seq = [X[t] for t in range(NT)]
    for layer in range(NL):
        h = flat.constant(np.zeros((NB, NH)))
        outs = []
        for t in range(NT):
            h = vg.tanh(seq[t] @ Ws[layer] + h @ R + Us[layer, t])
            outs.append(h)
        seq = outs
    flat_loss = (vg.stack(seq) * C).sum()
    assert_rel(loss, flat.backward(flat_loss), 1e-12, "loss")
    assert_rel(g.params["R"].grad, R.grad, 1e-12, "dR")
    for layer in range(NL):
        assert_rel(g.params[f"W@{layer}"].grad, Ws[layer].grad, 1e-12, f"dW@{layer}")
    for (layer, t), u in Us.items():
        assert_rel(g.params[f"u@{layer}.{t}"].grad, u.grad, 1e-12, f"du@{layer}.{t}")

    # Inner nodes are keyed by the 2-level iteration path (layer, time).
    assert cg.node(n["hn"], (1, 2)).key == NodeKey("Tanh", n["hn"].id, (1, 2))
    assert sorted(n["hn"].compute_nodes) == [(layer, t) for layer in range(NL) for t in range(NT)]
    w1 = cg.node(n["W"], (1,))
    assert w1.key.idx == (1,) and w1 is g.params["W@1"]
    assert [cg.trip_count(n["inner"], (layer,)) for layer in range(NL)] == [NT] * NL
    assert cg.trip_count(n["outer"]) == NL
    u12 = cg.node(n["u"], (1, 2))
    assert u12 is g.params["u@1.2"] and u12.key == NodeKey("Parameter", n["u"].id, (1, 2))
    with pytest.raises(vg.BuildError, match=r"Tanh:\d+@1\.9"):
        cg.node(n["hn"], (1, 9))

    # Checkpoint names of a 2-level untied parameter have 2-level paths.
    state = g.params.state_dict()
    g.load_state_dict({**state, "u@5.0": np.ones(NH)})
    assert g.params["u@5.0"].key == NodeKey("Parameter", n["u"].id, (5, 0))
    for bad, shape in [("u@5", (NH,)), ("u@1.2.3", (NH,)), ("W@1.2", (NH, NH))]:
        with pytest.raises(KeyError, match="not a parameter"):
            g.load_state_dict({**state, bad: np.ones(shape)})


# ---------------------------------------------------------------- 3. data-dependent loops and branches

M_GROW = np.array([[0.8, -0.3, 0.2], [0.4, 0.9, -0.1], [-0.2, 0.3, 0.7]])
V0 = np.array([0.3, -0.2, 0.25])
THRESHOLD = 3.0


def growing_vector():
    """A while loop whose trip count depends on values:

    v = v0 (fed);  while ||v|| < 3:  v = v + tanh(v @ M)
    loss = sum(v * (1, -2, 0.5))
    """
    g = vg.VirtualGraph(dtype=F64)
    v0 = g.input("v0", shape=(3,))
    M = g.parameter("M", (3, 3), init=M_GROW)
    with g.loop(while_=lambda t, s: np.linalg.norm(s["v"]) < THRESHOLD, max_iters=50) as L:
        v = L.carry(v0, name="v")
        L.update(v, v + vg.tanh(v @ M))
    loss = (L.final(v) * np.array([1.0, -2.0, 0.5])).sum()
    return g, dict(L=L, loss=loss)


def python_trip_count(v0, M):
    """The same while loop in plain Python; also the closest any norm comes to the threshold."""
    v, t, margin = np.array(v0), 0, np.inf
    while True:
        margin = min(margin, abs(np.linalg.norm(v) - THRESHOLD))
        if not np.linalg.norm(v) < THRESHOLD:
            return t, margin
        v = v + np.tanh(v @ M)
        t += 1


def test_while_loop_trip_count_and_gradcheck():
    g, n = growing_vector()
    expected, margin = python_trip_count(V0, M_GROW)
    assert margin > 1e-3  # far from a boundary: finite differences cannot flip the decision
    cg = g.build({"v0": V0}, n["loss"])
    assert cg.trip_count(n["L"]) == expected == 4
    vg.gradcheck(cg.node(n["loss"]), g.params.parameters())
    # Another start needs more iterations.
    small = V0 / 10
    more = g.build({"v0": small}, n["loss"]).trip_count(n["L"])
    assert more == python_trip_count(small, M_GROW)[0] > expected


A_ROT = rotation(110, 1.3)
B_ROT = rotation(-50, 0.9)
H0 = np.array([1.0, 0.3])
STEPS = 6


def sign_switch():
    """A branch inside a loop, chosen per iteration by the sign of the carried h[0]:

    h = h0 (fed);  for t in 0..5:
        h = tanh(h @ A)  if h[0] >= 0        option 0
            h @ B        if -100 < h[0] < 0  option 1
            h @ C        if h[0] <= -100     option 2: never chosen here, C gets no gradient
    loss = sum(h * (0.7, -1.2))
    """
    g = vg.VirtualGraph(dtype=F64)
    h0 = g.input("h0", shape=(2,))
    A = g.parameter("A", (2, 2), init=A_ROT)
    Bp = g.parameter("B", (2, 2), init=B_ROT)
    C = g.parameter("C", (2, 2), init=np.eye(2))
    with g.loop(times=STEPS) as L:
        h = L.carry(h0, name="h")
        o0, o1, o2 = vg.tanh(h @ A), h @ Bp, h @ C
        z = g.branch(lambda v: 0 if v[0] >= 0 else (1 if v[0] > -100 else 2), [o0, o1, o2], keys=[h])
        L.update(h, z)
    loss = (L.final(h) * np.array([0.7, -1.2])).sum()
    return g, dict(L=L, options=(o0, o1, o2), z=z, loss=loss)


def python_choices(h0):
    h, choices, margin = np.array(h0), [], np.inf
    for _ in range(STEPS):
        margin = min(margin, abs(h[0]))
        c = 0 if h[0] >= 0 else 1
        choices.append(c)
        h = np.tanh(h @ A_ROT) if c == 0 else h @ B_ROT
    return choices, margin


def test_branch_in_loop_builds_only_the_chosen_option():
    g, n = sign_switch()
    expected, margin = python_choices(H0)
    assert set(expected) == {0, 1} and margin > 1e-2
    cg = g.build({"h0": H0}, n["loss"])
    assert [cg.choice(n["z"], (t,)) for t in range(STEPS)] == expected

    for t, c in enumerate(expected):
        for k, opt in enumerate(n["options"]):
            if k == c:
                assert cg.node(opt, (t,)).key == NodeKey(opt.type, opt.id, (t,))
            else:
                assert (t,) not in opt.compute_nodes
                with pytest.raises(vg.BuildError, match=f"{opt.type}:{opt.id}@{t}"):
                    cg.node(opt, (t,))
    assert n["options"][2].compute_nodes == {}

    cg.backward(n["loss"])
    assert g.params["A"].grad is not None and g.params["B"].grad is not None
    assert g.params["C"].grad is None  # only the never-chosen option uses C
    vg.gradcheck(cg.node(n["loss"]), g.params.parameters())


def test_unchosen_option_loop_builds_nothing():
    """A top-level branch between the outputs of two loops; only the chosen loop is unrolled, and
    nothing that only the other loop uses is built (not even top-level nodes it captures):

        s > 0 ?  L2: k = 1; twice: k = k * B          (option 1)
              :  L1: h = 1; 3 times: h = h * (2A) + sum(reshape(x, (2, 2)))   (option 0)
    """
    g = vg.VirtualGraph(dtype=F64)
    s = g.input("s", shape=())
    x = g.input("x", shape=None)
    A = g.parameter("A", (), init=np.array(2.0))
    Bp = g.parameter("B", (), init=np.array(3.0))
    A2 = A * 2.0
    xr = x.reshape(2, 2)  # only valid for 4 values: must not run when L1 is not chosen
    with g.loop(times=3) as L1:
        h = L1.carry(1.0, name="h")
        L1.update(h, h * A2 + xr.sum())
    with g.loop(times=2) as L2:
        k = L2.carry(1.0, name="k")
        L2.update(k, k * Bp)
    out = g.branch(lambda s: int(s > 0), [L1.final(h), L2.final(k)], keys=[s])

    cg = g.build({"s": 1.0, "x": np.ones(3)}, out)  # x is ill-shaped for L1, which is not chosen
    assert cg.forward() == 9.0
    assert A2.compute_nodes == {} and xr.compute_nodes == {}
    assert [(d.node, d.value) for d in cg.decisions] == [(L2, 2), (out, 1)]
    with pytest.raises(vg.BuildError):
        cg.trip_count(L1)
    cg.backward(out)
    assert g.params["A"].grad is None and g.params["B"].grad == 6.0

    cg = g.build({"s": -1.0, "x": np.arange(4.0)}, out)  # h: 1 -> 10 -> 46 -> 190
    assert cg.forward() == 190.0 and cg.trip_count(L1) == 3
    assert k.compute_nodes == {}


# ---------------------------------------------------------------------------- 4. shared and untied parameters


def per_step_weight(share: bool, seed: int = 0):
    """A loop whose body declares its weight, tied (share=True) or one per step (W@t):

    h = 0;  for each x_t:  h = tanh(h @ W + x_t)
    loss = sum(h * (1, -1))
    """
    g = vg.VirtualGraph(dtype=F64, seed=seed)
    x = g.input("x", shape=(None, 2))
    with g.loop() as L:
        xt = L.step(x)
        W = g.parameter("W", (2, 2), init="normal" if share else None, share=share)
        h = L.carry(np.zeros(2), name="h")
        L.update(h, vg.tanh(h @ W + xt))
    loss = (L.final(h) * np.array([1.0, -1.0])).sum()
    return g, dict(W=W, loss=loss)


def per_step_forward(Ws, xs):
    """The same model in numpy, one weight per step."""
    h = np.zeros(2)
    for W, x in zip(Ws, xs):
        h = np.tanh(h @ W + x)
    return float(np.sum(h * np.array([1.0, -1.0])))


XS4 = np.random.default_rng(4).standard_normal((4, 2))


def test_shared_parameter_gradient_is_sum_of_per_iteration_contributions():
    g, n = per_step_weight(share=True)
    assert list(g.params) == ["W"]  # one entry, created at declaration
    g.params.set_value("W", np.array([[0.5, -0.7], [0.9, 0.2]]))
    cg = g.build({"x": XS4}, n["loss"])
    assert len(g.params) == 1
    assert all(cg.node(n["W"], (t,)) is g.params["W"] for t in range(4))
    cg.backward(n["loss"])

    # Per-iteration contributions: an untied copy of the model whose W@t all hold the same value.
    u, un = per_step_weight(share=False)
    ucg = u.build({"x": XS4}, un["loss"])
    for t in range(4):
        u.params.set_value(f"W@{t}", g.params.value("W"))
    assert_rel(ucg.forward(), cg.forward(), 1e-14, "same function")
    ucg.backward(un["loss"])
    contributions = [u.params[f"W@{t}"].grad for t in range(4)]
    assert_rel(g.params["W"].grad, np.sum(contributions, axis=0), 1e-12, "dW = sum_t dW@t")
    assert not np.allclose(contributions[0], contributions[3])


def test_untied_parameters_are_per_iteration_and_reproducible():
    g, n = per_step_weight(share=False, seed=9)
    assert len(g.params) == 0  # created the first time a build reaches an iteration
    g.build({"x": XS4[:2]}, n["loss"])
    assert list(g.params) == ["W@0", "W@1"]
    first = {k: g.params[k] for k in g.params}
    cg = g.build({"x": XS4}, n["loss"])
    assert list(g.params) == ["W@0", "W@1", "W@2", "W@3"]
    assert all(g.params[k] is node for k, node in first.items())  # the store persists across builds
    values = [g.params.value(f"W@{t}") for t in range(4)]
    for s in range(4):
        for t in range(s + 1, 4):
            assert not np.allclose(values[s], values[t])
        assert cg.node(n["W"], (s,)).key == NodeKey("Parameter", n["W"].id, (s,))

    # Same seed, built for 4 steps at once in a fresh graph: the same values (order-independent).
    fresh, fn = per_step_weight(share=False, seed=9)
    fresh.build({"x": XS4}, fn["loss"])
    for t in range(4):
        np.testing.assert_array_equal(fresh.params.value(f"W@{t}"), values[t])
    other, on = per_step_weight(share=False, seed=10)
    other.build({"x": XS4}, on["loss"])
    assert not np.allclose(other.params.value("W@0"), values[0])

    # The forward value is the numpy model on the store's values; set_value changes the next build.
    assert_rel(cg.forward(), per_step_forward(values, XS4), 1e-14, "forward")
    new_w1 = np.array([[0.1, 0.2], [-0.3, 0.4]])
    g.params.set_value("W@1", new_w1)
    values[1] = new_w1
    rebuilt = g.build({"x": XS4}, n["loss"], cache=False)  # keep cg alive beside it
    assert_rel(rebuilt.forward(), per_step_forward(values, XS4), 1e-14, "after set_value")
    assert_rel(cg.forward(), per_step_forward(values, XS4), 1e-14, "old graph sees it too")


# ---------------------------------------------------------------- 5. re-running forward on new feeds


def grads_of(g, cg, loss):
    g.params.zero_grad()
    cg.backward(loss)
    return {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}


def refuses_until_restored(g, cg, loss, good_feed, bad_feed, who):
    """A structure-changing feed: forward and backward refuse, until the old values are back."""
    before = cg.forward()
    cg.feed(bad_feed)
    with pytest.raises(vg.StructureChangedError, match="rebuild") as e:
        cg.forward()
    assert who in str(e.value)
    with pytest.raises(vg.StructureChangedError):
        cg.backward(loss)
    with pytest.raises(vg.StructureChangedError):  # still refused: no forward succeeded yet
        cg.backward(loss)
    cg.feed(good_feed)
    assert cg.forward() == before
    fresh = g.build(good_feed, loss, cache=False)  # beside cg, not re-using its nodes
    expected = grads_of(g, fresh, loss)
    got = grads_of(g, cg, loss)
    assert set(got) == set(expected)
    for k in expected:
        assert_rel(got[k], expected[k], 1e-13, k)


@pytest.mark.parametrize("programs", [False, True])
def test_reforward_same_structure_equals_fresh_build(programs):
    """A re-forward after a feed gives a fresh build's value bit for bit, where both run the loop
    the same way (node by node, or as a program)."""
    g, n = elman(stacked=False)
    rng = np.random.default_rng(1)
    xs, ys = rng.standard_normal((T, B, I)), rng.standard_normal((B, O))
    cg = g.build({"x": xs, "y": ys}, n["loss"], programs=programs)
    xs2, ys2 = rng.standard_normal((T, B, I)), rng.standard_normal((B, O))
    cg.feed({"x": xs2, "y": ys2})
    value = cg.forward()
    assert cg.last_forward.recomputed > 0
    fresh = g.build({"x": xs2, "y": ys2}, n["loss"], cache=False, programs=programs)
    assert bool(cg.programs) == bool(fresh.programs) == programs
    assert value == fresh.forward()
    assert value == pytest.approx(elman_reference(g.params.state_dict(), xs2, ys2, False)[0], rel=1e-12)
    g1 = grads_of(g, cg, n["loss"])
    g2 = grads_of(g, fresh, n["loss"])
    for k in g1:
        assert_rel(g1[k], g2[k], 1e-13, k)


def test_structure_change_sequence_length():
    g, n = elman(stacked=False)
    rng = np.random.default_rng(2)
    good = {"x": rng.standard_normal((T, B, I)), "y": rng.standard_normal((B, O))}
    cg = g.build(good, n["loss"])
    bad = {"x": rng.standard_normal((T - 2, B, I))}
    refuses_until_restored(g, cg, n["loss"], good, bad, "<Loop:1>")


def test_structure_change_while_loop_trip_count():
    g, n = growing_vector()
    cg = g.build({"v0": V0}, n["loss"])
    assert python_trip_count(V0 * 3, M_GROW)[0] != cg.trip_count(n["L"])
    refuses_until_restored(g, cg, n["loss"], {"v0": V0}, {"v0": V0 * 3}, "<Loop:1>")


def test_structure_change_branch_choice():
    g, n = sign_switch()
    cg = g.build({"h0": H0}, n["loss"])
    # Same first choice, a different one later: h0 = (1, -0.3).
    flipped = np.array([1.0, -0.3])
    assert python_choices(flipped)[0] != python_choices(H0)[0]
    refuses_until_restored(g, cg, n["loss"], {"h0": H0}, {"h0": flipped}, "<Branch:1@")


# ---------------------------------------------------------------- 6. bad input: typed errors, nothing changed


def small_rnn():
    """x (None, 2), y (2,) fed;  h = y;  for each x_t:  h = tanh(x_t + h @ W);  loss = sum(h)."""
    g = vg.VirtualGraph(dtype=F64)
    x = g.input("x", shape=(None, 2))
    y = g.input("y", shape=(2,))
    W = g.parameter("W", (2, 2))
    with g.loop() as L:
        xt = L.step(x)
        h = L.carry(y, name="h")
        hn = vg.tanh(xt + h @ W)
        L.update(h, hn)
    loss = L.final(h).sum()
    good = {"x": np.ones((3, 2)), "y": np.ones(2)}
    g.build(good, loss)  # a successful build: latest_build must survive what follows
    return g, dict(x=x, L=L, hn=hn, loss=loss, good=good)


@pytest.mark.parametrize(
    "feed, patterns",
    [
        ({}, ["'x'", "'y'", "<Input:1>", "<Input:2>"]),
        ({"x": np.ones((3, 3)), "y": np.ones(2)}, ["<Input:1>", r"\(3, 3\)", r"\(None, 2\)"]),
        ({"x": np.ones((3, 2)), "y": np.ones((1, 2))}, ["<Input:2>", r"\(1, 2\)", r"\(2\)"]),
        ({"x": np.ones((3, 2)), "y": np.ones(2), "z": 1.0}, ["'z'"]),
    ],
    ids=["two-missing", "shape-x", "shape-y", "unknown-name"],
)
def test_bad_feed(feed, patterns):
    g, n = small_rnn()
    snap = snapshot(g)
    with pytest.raises(vg.FeedError) as e:
        g.build(feed, n["loss"])
    assert isinstance(e.value, ValueError)
    for p in patterns:
        assert re.search(p, str(e.value)), (p, str(e.value))
    assert_unchanged(g, snap)


def test_body_node_used_outside_its_loop():
    g, n = small_rnn()
    snap = snapshot(g)
    with pytest.raises(vg.BuildError, match=r"<Tanh:1>.*<Loop:1>"):
        n["hn"] + 1.0
    with pytest.raises(vg.BuildError, match=r"<Tanh:1>.*<Loop:1>"):
        vg.tanh(n["hn"])
    with pytest.raises(vg.BuildError, match=r"output <Tanh:1> is inside the body of <Loop:1>"):
        g.build(n["good"], n["hn"])
    assert_unchanged(g, snap)
    assert g.build(n["good"], n["loss"], cache=False).forward() == snap[3].forward()


@pytest.mark.parametrize(
    "returned, pattern",
    [(1.0, "returned 1.0"), (None, "returned None"), (2, "returned 2"), (-1, "returned -1")],
    ids=["float", "None", "too-big", "negative"],
)
def test_bad_selector(returned, pattern):
    """for t in 0..2:  h = 2h if selector(t) == 0 else 3h;  the selector misbehaves at t = 2."""
    g, _ = small_rnn()
    with g.loop(times=3) as L:
        h = L.carry(1.0, name="h")
        c = L.carry(0.0, name="t")
        z = g.branch(lambda t: returned if t >= 2 else 0, [h * 2.0, h * 3.0], keys=[c])
        L.update(h, z)
        L.update(c, c + 1.0)
    snap = snapshot(g)
    with pytest.raises(vg.SelectorError, match=f"<Branch:{z.id}@2>.*{pattern}"):
        g.build({}, L.final(h))
    assert_unchanged(g, snap)


def test_loop_over_max_iters():
    g, _ = small_rnn()
    with g.loop(times=10, max_iters=5) as L:
        h = L.carry(1.0, name="h")
        L.update(h, h * 2.0)
    snap = snapshot(g)
    with pytest.raises(vg.LoopLimitError, match=f"<Loop:{L.id}>.*max_iters=5"):
        g.build({}, L.final(h))
    assert_unchanged(g, snap)
    with g.loop(times=5, max_iters=5) as L5:  # exactly max_iters is fine
        k = L5.carry(1.0, name="k")
        L5.update(k, k * 2.0)
    assert g.build({}, L5.final(k)).forward() == 32.0


def test_shape_error_in_iteration_3_names_node_and_shapes_and_keeps_store():
    """for t in 0..4 (U@t untied):  z = h if t < 3 else concat(h, h);  h = tanh((z @ W) @ U@t)

    At t = 3, z is (1, 4) and W is (2, 2): MatMul@3 fails after U@0..U@2 were initialised.
    """
    g = vg.VirtualGraph(dtype=F64)
    W = g.parameter("W", (2, 2))
    with g.loop(times=5) as L:
        h = L.carry(np.ones((1, 2)), name="h")
        t = L.carry(0.0, name="t")
        U = g.parameter("U", (2, 2))
        z = g.branch(lambda t: int(t >= 3), [h, vg.concat([h, h], axis=1)], keys=[t])
        zw = z @ W
        L.update(h, vg.tanh(zw @ U))
        L.update(t, t + 1.0)
    snap = snapshot(g)
    assert snap[1] == ["W"]
    with pytest.raises(vg.ShapeError) as e:
        g.build({}, L.final(h).sum())
    msg = str(e.value)
    assert f"MatMul:{zw.id}@3" in msg and "(1, 4)" in msg and "(2, 2)" in msg, msg
    assert_unchanged(g, snap)  # no U@0..U@2 left behind
    assert U.compute_nodes == {}


def test_declaration_errors():
    g, n = small_rnn()
    snap = snapshot(g)
    with pytest.raises(vg.BuildError, match=r"<Loop:2>: carried state <Carry:\d+> 'h2' never updated"):
        with g.loop(times=3) as L:
            L.carry(1.0, name="h2")
    with pytest.raises(vg.BuildError, match=r"<Loop:3> has no stopping rule"), g.loop() as L:
        h = L.carry(1.0, name="h")
        L.update(h, h * 2.0)
    with pytest.raises(vg.BuildError, match=r"<Loop:4>: use final\(\) after"), g.loop(times=2) as L:
        h = L.carry(1.0, name="h")
        L.update(h, h * 2.0)
        L.final(h)
    assert g._scopes == []  # every failed `with` block was closed
    assert_unchanged(g, snap)
    assert g.build(n["good"], n["loss"], cache=False).forward() == snap[3].forward()


def test_loop_shape_and_scope_errors():
    g, n = small_rnn()
    snap = snapshot(g)
    # h = 0;  for each x_t: h = h + x_t;  outputs final(h) and stack(h + x_t)
    with g.loop() as L:
        xt = L.step(n["x"])
        h = L.carry(np.zeros(2), name="acc")
        hn = h + xt
        L.update(h, hn)
    with pytest.raises(vg.BuildError, match=rf"<Stack:\d+>: <Loop:{L.id}> ran no iteration"):
        g.build({"x": np.zeros((0, 2)), "y": np.ones(2)}, [L.final(h), L.stack(hn)])
    assert_unchanged(g, snap)
    # Zero iterations: final is the initial value.
    np.testing.assert_array_equal(g.build({"x": np.zeros((0, 2))}, L.final(h)).forward(), np.zeros(2))
    snap = snapshot(g)

    u, v = g.input("u"), g.input("v")
    with g.loop() as L2:
        c = L2.carry(0.0, name="c")
        L2.update(c, c + L2.step(u) + L2.step(v))
    with pytest.raises(vg.ShapeError, match=f"<Loop:{L2.id}>.*different lengths 3 and 4"):
        g.build({"u": np.ones(3), "v": np.ones(4)}, L2.final(c))
    scalar = f"<Loop:{L2.id}>: cannot step through <Input:{u.id}> 'u', a scalar"
    with pytest.raises(vg.ShapeError, match=scalar):
        g.build({"u": 1.0, "v": np.ones(4)}, L2.final(c))
    with pytest.raises(vg.BuildError, match=rf"<Loop:{L2.id}>: call carry\(\) inside"):
        L2.carry(1.0)
    with pytest.raises(vg.BuildError, match=rf"loop.stack\(\) takes a node of the body of <Loop:{L2.id}>"):
        L2.stack(hn)
    with g.loop(times=2) as L3:
        with pytest.raises(vg.BuildError, match=f"<Loop:{L3.id}>: its `with` block is still open"):
            g.build(n["good"], n["loss"])
        d = L3.carry(1.0, name="d")
        L3.update(d, d * 2.0)
    assert_unchanged(g, snap)


def test_zero_iteration_stack_is_an_error_only_when_used():
    """n > 0 ?  mean(stack(h + x_t))  :  sum(final(h))      (h = 0; for each x_t: h = h + x_t)"""
    g = vg.VirtualGraph(dtype=F64)
    x = g.input("x", shape=(None, 2))
    n = g.input("n", shape=())
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        hn = h + L.step(x)
        L.update(h, hn)
    out = g.branch(lambda n: int(n > 0), [L.final(h).sum(), L.stack(hn).mean()], keys=[n])
    assert g.build({"x": np.ones((3, 2)), "n": 3.0}, out).forward() == 2.0  # mean of 1, 2, 3
    assert g.build({"x": np.ones((0, 2)), "n": 0.0}, out).forward() == 0.0  # the stack is not used
    with pytest.raises(vg.BuildError, match=r"<Stack:1>: <Loop:1> ran no iteration"):
        g.build({"x": np.ones((0, 2)), "n": 1.0}, out)


def test_a_loop_node_has_no_value():
    g, _ = small_rnn()
    with g.loop(times=2) as L:
        h = L.carry(1.0, name="h")
        L.update(h, h * 2.0)
    snap = snapshot(g)
    with pytest.raises(vg.BuildError, match=rf"output <Loop:{L.id}> is a loop, which has no value"):
        g.build({}, L)
    with pytest.raises(vg.BuildError, match=rf"<Loop:{L.id}> is a loop, which has no value"):
        L + 1.0
    assert_unchanged(g, snap)


def test_while_condition_returning_an_array():
    g, _ = small_rnn()
    with g.loop(while_=lambda t, s: s["k"] < 5.0) as L:  # s["k"] has 2 elements
        k = L.carry(np.ones(2), name="k")
        L.update(k, k * 2.0)
    snap = snapshot(g)
    pattern = r"<Loop:\d+>: the while_ condition returned an array of shape \(2,\) at iteration 0; it must"
    with pytest.raises(vg.BuildError, match=pattern):
        g.build({}, L.final(k))
    assert_unchanged(g, snap)


# ---------------------------------------------------------------------------- 7. a 10,000-iteration loop


def test_ten_thousand_iterations_no_recursion_and_closed_form_gradient():
    """h_0 = 1;  h_{t+1} = a * h_t + 1  (10,000 times, elementwise on a (1, 2) row; loss = sum(h_T)).

    h_T = a^T + (1 - a^T) / (1 - a)
    dh_T/da = T a^(T-1) + ((1 - a^T) - T a^(T-1) (1 - a)) / (1 - a)^2
    """
    steps, a = 10_000, 0.9995
    g = vg.VirtualGraph(dtype=F64)
    ap = g.parameter("a", (1, 2), init=np.full((1, 2), a))
    with g.loop(times=steps) as L:
        h = L.carry(np.ones((1, 2)), name="h")
        L.update(h, h * ap + 1.0)
    out = L.final(h).sum()
    cg = g.build({}, out)
    value = cg.backward(out)
    aT = a**steps
    expect_h = aT + (1 - aT) / (1 - a)
    expect_d = steps * a ** (steps - 1) + ((1 - aT) - steps * a ** (steps - 1) * (1 - a)) / (1 - a) ** 2
    assert value == pytest.approx(2 * expect_h, rel=1e-9)
    assert_rel(g.params["a"].grad, np.full((1, 2), expect_d), 1e-8, "d h_T / d a")
    assert cg.trip_count(L) == steps


# ---------------------------------------------------------------------------- 8. eval mode and sampled nodes


def dropout_model():
    """mask ~ Bernoulli(0.5) / 0.5 when training, ones in eval;  loss = sum((x * mask) @ W)."""
    g = vg.VirtualGraph(dtype=F64, seed=2)
    x = g.input("x", shape=(None, 3))
    W = g.parameter("W", (3, 3))

    def mask(rng, like, training):
        return (rng.random(like.shape) < 0.5) / 0.5 if training else np.ones(like.shape)

    m = g.sample(mask, x)
    loss = ((x * m) @ W).sum()
    return g, dict(m=m, loss=loss)


def test_eval_mode_records_nothing_and_samples_take_eval_value():
    g, n = dropout_model()
    xs = np.random.default_rng(0).standard_normal((8, 3))
    m1 = g.build({"x": xs}, n["loss"]).node(n["m"]).value
    m2 = g.build({"x": xs}, n["loss"]).node(n["m"]).value
    assert not np.array_equal(m1, m2)  # drawn anew at each training build
    assert set(np.unique(m1)) <= {0.0, 2.0}

    g.eval()
    cg = g.build({"x": xs}, n["loss"])
    np.testing.assert_array_equal(cg.node(n["m"]).value, np.ones((8, 3)))
    assert cg.forward() == pytest.approx(float(np.sum(xs @ g.params.value("W"))), rel=1e-13)
    assert not any(node.requires_grad for node in cg.nodes() if not node.is_leaf)
    with pytest.raises(vg.GraphStateError):
        cg.backward(n["loss"])
    assert g.params["W"].grad is None
    assert vg.is_grad_enabled()  # the eval build did not leak no_grad

    g.train()
    cg = g.build({"x": xs}, n["loss"])
    cg.backward(n["loss"])
    mask = cg.node(n["m"]).value
    np.testing.assert_allclose(g.params["W"].grad, np.tile((xs * mask).sum(0)[:, None], (1, 3)), rtol=1e-13)


# ---------------------------------------------------------------------------- 9. checkpoints


def two_layer_loop():
    """A (shared) and W@t (untied):  h = 1;  for t in 0..T-1:  h = h @ W@t @ A;  loss = sum(h)."""
    g = vg.VirtualGraph(dtype=F64, seed=4)
    steps = g.input("steps", shape=(None,))
    A = g.parameter("A", (2, 2))
    with g.loop() as L:
        L.step(steps)
        h = L.carry(np.ones(2), name="h")
        W = g.parameter("W", (2, 2))
        L.update(h, h @ W @ A)
    loss = L.final(h).sum()
    return g, dict(W=W, loss=loss)


def test_load_state_dict():
    g, n = two_layer_loop()
    cg = g.build({"steps": np.zeros(2)}, n["loss"])
    before = cg.forward()
    state = g.params.state_dict()
    assert list(state) == ["A", "W@0", "W@1"]

    # Round trip after scrambling the values.
    for k in g.params:
        g.params.set_value(k, np.full((2, 2), 7.0))
    assert cg.forward() != before
    g.load_state_dict(state)
    assert cg.forward() == before
    for k in state:
        np.testing.assert_array_equal(g.params.value(k), state[k])

    # Failures change nothing, even when the rest of the checkpoint is fine.
    changed = {k: v + 1.0 for k, v in state.items()}
    snap = snapshot(g)
    with pytest.raises(vg.ShapeError, match=r"'A'.*\(3, 3\).*\(2, 2\)"):
        g.load_state_dict({**changed, "A": np.ones((3, 3))})
    assert_unchanged(g, snap)
    for bad_key in ["Q", "A@1", "W", "W@x", "W@1.2", "W@01", "W@-1"]:
        with pytest.raises(KeyError, match="not a parameter"):
            g.load_state_dict({**changed, bad_key: np.ones((2, 2))})
        assert_unchanged(g, snap)
    with pytest.raises(KeyError, match="lacks"):  # strict: every parameter must be there
        g.load_state_dict({"A": state["A"]})
    assert_unchanged(g, snap)

    # An untied copy not built yet is created, and a later build uses it.
    w7 = np.array([[0.0, 1.0], [1.0, 0.0]])
    g.load_state_dict({**state, "W@7": w7})
    assert list(g.params) == ["A", "W@0", "W@1", "W@7"]
    np.testing.assert_array_equal(g.params.value("W@7"), w7)
    cg8 = g.build({"steps": np.zeros(8)}, n["loss"])
    assert cg8.node(n["W"], (7,)) is g.params["W@7"]
    assert len(g.params) == 9
    h = np.ones(2)
    for t in range(8):
        h = h @ g.params.value(f"W@{t}") @ g.params.value("A")
    assert cg8.forward() == pytest.approx(h.sum(), rel=1e-13)


def test_feeds_are_copied():
    """loss = sum(x @ W): changing the fed array in place afterwards must not reach the graph,
    whose forward and backward would otherwise disagree (no version bump, no recompute)."""
    g = vg.VirtualGraph(dtype=F64)
    W = g.parameter("W", (2, 2), init=np.array([[0.5, 0.1], [0.2, 0.3]]))
    x = g.input("x", shape=(None, 2))
    loss = (x @ W).sum()
    xs = np.ones((3, 2))
    cg = g.build({"x": xs}, loss)
    xs *= 10.0
    assert cg.forward() == pytest.approx(3.3, rel=1e-14)
    cg.backward(loss)
    np.testing.assert_allclose(g.params["W"].grad, np.full((2, 2), 3.0), rtol=1e-14)
    cg.feed({"x": xs})
    xs[:] = 0.0
    assert cg.forward() == pytest.approx(33.0, rel=1e-14)


# ---------------------------------------------------------------------------- declaration order (regressions)


def test_constants_and_captures_declared_after_the_loop_node():
    """Numbers inside a body become top-level constants registered after the loop node; a loop
    object may be created before what its body captures; a carry may be updated to an outside node.

        L1: h = 0;  for each x_t:  h = h * 0.5 + x_t + 1      (0.5 and 1 become constants)
        L2: k = 0;  3 times:  k = a                          (a: a parameter outside the body)
        L3: j = 1;  3 times:  j = j + p                      (L3 created before p is declared)
    """
    g = vg.VirtualGraph(dtype=F64)
    x = g.input("x", shape=(None, 2))
    with g.loop() as L1:
        xt = L1.step(x)
        h = L1.carry(np.zeros(2), name="h")
        L1.update(h, h * 0.5 + xt + 1.0)
    a = g.parameter("a", (2,), init=np.array([2.0, -1.0]))
    with g.loop(times=3) as L2:
        k = L2.carry(np.zeros(2), name="k")
        L2.update(k, a)
    L3 = g.loop(times=3)
    p = g.parameter("p", (2,), init=np.array([0.5, 0.25]))
    with L3:
        j = L3.carry(np.ones(2), name="j")
        L3.update(j, j + p)
    outs = [L1.final(h).sum(), L2.final(k).sum(), L3.final(j).sum()]
    xs = np.arange(6.0).reshape(3, 2)
    ref = np.zeros(2)
    for t in range(3):
        ref = ref * 0.5 + xs[t] + 1.0
    cg = g.build({"x": xs}, outs)
    assert cg.forward() == pytest.approx([ref.sum(), 1.0, 2.0 + 3 * 0.75], rel=1e-14)
    cg.backward(outs[1])
    np.testing.assert_array_equal(g.params["a"].grad, np.ones(2))
    cg.forward()
    cg.backward(outs[2])
    np.testing.assert_array_equal(g.params["p"].grad, np.full(2, 3.0))


def test_the_unrolling_plan_is_reused_and_follows_new_declarations():
    # x -> loop{h = tanh(h + x_t)} -> sum ; later: extra = sum * 2
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x")
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, vg.tanh(h + L.step(x)))
    total = L.final(h).sum()
    feed = {"x": np.ones((3, 2))}
    g.build(feed, total)
    plan = g._plan([total])
    g.build(feed, total)
    assert g._plan([total]) is plan  # not recomputed per build
    extra = total * 2.0  # a new declaration: plans are recomputed for the new structure
    assert g._plan([total]) is not plan
    expected = 2 * np.tanh(np.tanh(np.tanh(1.0) + 1) + 1) * 2
    assert g.build(feed, extra).forward() == pytest.approx(expected, rel=1e-12)
