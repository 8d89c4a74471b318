"""Cached structures (issue 10 §5): a build of a structure seen before re-runs the cached graph.

Identity: a sequence of builds with the cache gives the same losses, gradients, decisions and
dropout masks as the same sequence without it (float64, 1e-12), on the example models and on
random sequences of feeds; a structure that turns out different is unrolled afresh, silently; an
earlier graph object is superseded and says so when used.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg

ROOT = Path(__file__).resolve().parent.parent


def rnn(dropout=0.0):
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        x = L.step(xs)
        if dropout:
            x = vg.nn.Dropout(g, dropout)(x)
        L.update(h, vg.tanh(x @ W + h @ U))
    return g, vg.sum(L.final(h) ** 2)


def run(g, feed, loss, cache):
    cg = g.build(feed, loss, cache=cache)
    g.params.zero_grad()
    value = cg.backward(loss)
    grads = {k: np.array(p.grad) for k, p in g.params.items()}
    decisions = [(d.node.describe(), d.idx, d.value) for d in cg.decisions]
    return cg, value, grads, decisions


def test_a_structure_built_again_reuses_the_nodes_from_its_second_build_on():
    g, loss = rnn()
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(5, 2, 3)) for _ in range(2))
    first = g.build({"xs": a}, loss)  # a first sighting: unrolled, its graph not kept
    cg1 = g.build({"xs": a}, loss)  # seen before: unrolled again, and kept
    assert len(first) == len(cg1) and first.node("Tanh:1@3") is not cg1.node("Tanh:1@3")
    node = cg1.node("Tanh:1@3")
    cg2 = g.build({"xs": b}, loss)
    assert cg2.node("Tanh:1@3") is node  # not unrolled again: the same node, new value
    for xs in (a, b, a):  # and so on for every later build (a replayed graph stays cached)
        assert g.build({"xs": xs}, loss).node("Tanh:1@3") is node
    cg2 = g.build({"xs": b}, loss)
    fresh = g.build({"xs": b}, loss, cache=False)
    np.testing.assert_allclose(cg2.forward(), fresh.forward(), rtol=1e-12)
    np.testing.assert_allclose(node.value, fresh.node("Tanh:1@3").value, rtol=1e-12)
    assert node.graph is cg2


def test_the_superseded_graph_says_so_when_used():
    g, loss = rnn()
    g.build({"xs": np.ones((4, 2, 3))}, loss)
    cg1 = g.build({"xs": np.ones((4, 2, 3))}, loss)
    g.build({"xs": np.zeros((4, 2, 3))}, loss)
    for use in (
        lambda: cg1.forward(),
        lambda: cg1.backward(loss),
        lambda: cg1.node("Tanh:1@0"),
        lambda: len(cg1),
    ):
        with pytest.raises(vg.GraphStateError, match="superseded: a later build of the same structure"):
            use()
    assert "superseded" in repr(cg1)


@pytest.mark.usefixtures("per_node")  # (resizing a kept graph: the per-node path's)
def test_another_shape_is_another_entry_and_cache_false_keeps_graphs_apart():
    g, loss = rnn()
    short = g.build({"xs": np.ones((3, 2, 3))}, loss)  # seen once: not kept
    long = g.build({"xs": np.ones((6, 2, 3))}, loss)  # another length of one elastic structure
    assert len(short) < len(long)  # both alive (vgraph.virtual.elastic: long is kept)
    kept = g.build({"xs": np.ones((6, 2, 3))}, loss, cache=False)
    assert len(long) == len(kept)  # cache=False took nothing over


def test_the_cache_is_bounded_and_can_be_turned_off():
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    w = g.parameter("w", (1,))
    loss = vg.sum(vg.tanh(g.input("v", (None,)) * w))  # no loop: each length another structure
    g.cache_size = 2
    for n in (2, 3, 4, 5):
        g.build({"v": np.ones(n)}, loss)
    assert len(g._cache) == 0  # each structure seen once: nothing kept
    for n in (2, 3, 4, 5):
        g.build({"v": np.ones(n)}, loss)
    assert len(g._cache) == 2
    g.cache_size = 0
    assert len(g._cache) == 0
    cg = g.build({"v": np.ones(2)}, loss)
    g.build({"v": np.ones(2)}, loss)
    assert len(cg) > 0  # not superseded: nothing was cached
    with pytest.raises(ValueError):
        g.cache_size = -1


def test_declaring_more_nodes_empties_the_cache():
    g, loss = rnn()
    for _ in range(2):
        g.build({"xs": np.ones((2, 2, 3))}, loss)
    assert len(g._cache) == 1
    loss2 = loss * 2.0
    g.build({"xs": np.ones((2, 2, 3))}, loss2)
    assert len(g._cache) == 0  # the old declarations' graph is gone; the new key seen once


def adaptive():
    """A while loop whose trip count depends on the input's value."""
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    v = g.input("v", (2,))
    w = g.parameter("w", (2,), init=np.array([0.5, 0.25]))
    with g.loop(while_=lambda t, s: np.abs(s["x"]).sum() > 0.1, max_iters=50) as L:
        x = L.carry(v, name="x")
        L.update(x, x * w)
    return g, vg.sum(L.final(x) ** 2)


def test_a_different_structure_is_unrolled_afresh_without_leaking_errors():
    g, loss = adaptive()
    cg1, v1, _, d1 = run(g, {"v": np.array([1.0, 1.0])}, loss, True)
    cg2, v2, gr2, d2 = run(g, {"v": np.array([9.0, 9.0])}, loss, True)  # more iterations
    assert d1 != d2
    g_ref, loss_ref = adaptive()
    _, v_ref, gr_ref, d_ref = run(g_ref, {"v": np.array([9.0, 9.0])}, loss_ref, False)
    assert d2 == d_ref
    np.testing.assert_allclose(v2, v_ref, rtol=1e-12)
    np.testing.assert_allclose(gr2["w"], gr_ref["w"], rtol=1e-12)


def test_dropout_masks_are_drawn_as_a_fresh_build_would():
    rng = np.random.default_rng(5)
    feeds = [{"xs": rng.normal(size=(4, 2, 3))} for _ in range(4)]
    results = []
    for cache in (True, False):
        g, loss = rnn(dropout=0.5)
        results.append([run(g, f, loss, cache)[1:3] for f in feeds])
    for (v1, g1), (v2, g2) in zip(*results):
        np.testing.assert_allclose(v1, v2, rtol=1e-12)
        for k in g1:
            np.testing.assert_allclose(g1[k], g2[k], rtol=1e-12)


def test_train_and_eval_builds_are_cached_apart():
    g, loss = rnn(dropout=0.5)
    feed = {"xs": np.ones((3, 2, 3))}
    train = g.build(feed, loss)
    g.eval()
    ev = g.build(feed, loss)
    assert not ev.outputs[0].requires_grad and train.outputs[0].requires_grad
    g.train()


def load(path):
    spec = importlib.util.spec_from_file_location(f"cache_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_model_scripts_cached_equal_uncached(script):
    module = load(script)
    sequences = []
    for cache in (True, False):
        g, _, outputs = module.build(seed=0)
        feeds = [module.build(seed=seed)[1] for seed in range(3)]  # same shapes, new values
        sequences.append([run(g, feed, outputs[0], cache)[1:] for feed in feeds])
    for (v1, g1, d1), (v2, g2, d2) in zip(*sequences):
        np.testing.assert_allclose(v1, v2, rtol=1e-12)
        assert d1 == d2
        for k in g1:
            np.testing.assert_allclose(g1[k], g2[k], rtol=1e-12, atol=1e-14)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from([2, 3]), st.floats(0.2, 3.0)), min_size=1, max_size=6))
def test_random_sequences_of_builds_cached_equal_uncached(steps):
    """Lengths from a small set (hits and misses mixed), scales that change the while loop's trip
    count (structures that differ under one key)."""
    outs = []
    for cache in (True, False):
        g = vg.VirtualGraph(dtype=np.float64, seed=7)
        xs = g.input("xs", (None, 2))
        W = g.parameter("W", (2, 2))
        with g.loop() as L:
            h = L.carry(np.zeros(2), name="h")
            L.update(h, vg.tanh(L.step(xs) @ W + h))
        with g.loop(while_=lambda t, s: np.abs(s["z"]).sum() > 0.05, max_iters=60) as M:
            z = M.carry(L.final(h), name="z")
            M.update(z, z * 0.5)
        loss = vg.sum(M.final(z)) + vg.sum(L.final(h))
        outs.append([run(g, {"xs": np.full((T, 2), s)}, loss, cache)[1:] for T, s in steps])
    for (v1, g1, d1), (v2, g2, d2) in zip(*outs):
        np.testing.assert_allclose(v1, v2, rtol=1e-12)
        assert d1 == d2
        np.testing.assert_allclose(g1["W"], g2["W"], rtol=1e-12)


@pytest.mark.parametrize("lengths", [[4, 4, 4, 4], [5, 5, 3, 4, 2]], ids=["same length", "resized"])
def test_a_replayed_build_starts_without_gradients_like_a_fresh_one(lengths):
    """Retained gradients of intermediate nodes and gradients of inputs belong to one build: a
    replayed graph must not add the next backward onto the last one's (a fresh build has none)."""

    def saliency():
        g = vg.VirtualGraph(dtype=np.float64, seed=3)
        xs = g.input("xs", (None, 2, 3), requires_grad=True)
        W = g.parameter("W", (3, 4))
        U = g.parameter("U", (4, 4))
        with g.loop() as L:
            h = L.carry(np.zeros((2, 4)), name="h")
            L.update(h, vg.tanh(L.step(xs) @ W + h @ U))
        return g, vg.sum(L.final(h) ** 2)

    seen = []
    for cache in (True, False):
        g, loss = saliency()
        rng = np.random.default_rng(2)
        grads = []
        for T in lengths:
            cg = g.build({"xs": rng.normal(size=(T, 2, 3))}, loss, cache=cache)
            node = cg.node("Tanh:1@1")
            assert node.grad is None and not node.retains_grad and cg.inputs["xs"].grad is None
            node.retain_grad()
            cg.backward(loss)
            grads.append((np.array(node.grad), np.array(cg.inputs["xs"].grad)))
        seen.append(grads)
    for (a, xa), (b, xb) in zip(*seen):
        np.testing.assert_allclose(a, b, rtol=1e-12)
        np.testing.assert_allclose(xa, xb, rtol=1e-12)


@pytest.mark.parametrize("how", ["replayed build", "resized build", "feed"])
def test_a_fed_array_changed_by_the_caller_afterwards_does_not_reach_the_graph(how):
    # The feed is copied once when it is checked, and that copy is the input's value (not copied
    # again): the caller's array stays the caller's, on every path a value enters a cached graph.
    g, loss = rnn()
    rng = np.random.default_rng(5)
    with vg.body_programs(how != "resized build"):  # (resizing a kept graph: the per-node path)
        for _ in range(2):  # the second build is kept: the next one replays (or resizes) it
            cg = g.build({"xs": rng.normal(size=(6, 2, 3))}, loss)
        xs = rng.normal(size=(4 if how == "resized build" else 6, 2, 3))
        if how == "feed":
            cg.feed({"xs": xs})
            cg.forward(cg.outputs[0])
        else:
            kept = cg.node("Tanh:1@0")
            cg = g.build({"xs": xs}, loss)
            assert cg.node("Tanh:1@0") is kept  # the cached graph, not a fresh unroll
            assert ("Tanh:1@5" in cg) == (how != "resized build")
        want = np.array(cg.outputs[0].value)
        fed = cg.inputs["xs"]
        assert not np.shares_memory(fed.value, xs)
        xs[...] = 0.0  # the caller re-uses its buffer
        assert np.all(fed.value != 0.0)
        cg.inputs["xs"].set_value(np.array(fed.value))  # a forward that must recompute from the graph's copy
        np.testing.assert_allclose(cg.forward(cg.outputs[0]), want, rtol=1e-15)
