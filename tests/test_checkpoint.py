"""Checkpointing (issue 15): ``g.loop(..., checkpoint=k | "sqrt" | ("binomial", s))``.

Identity tests: each model is built by one factory with ``checkpoint=None`` (the plain unroll,
the reference) and with each schedule; losses, every parameter gradient, every decision and
every node's value (read on demand where it was dropped) must agree (float64, 1e-12). Memory
bounds are relative to the plain unroll measured in the same test (tracemalloc), never timings.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg
from vgraph import nn
from vgraph.render import to_dot
from vgraph.tbptt import chunk_feeds, truncated_bptt
from vgraph.virtual.checkpoint import binomial_positions, binomial_split

pytestmark = pytest.mark.usefixtures("per_node")  # (conftest) checkpointed loops run node by node

ROOT = Path(__file__).resolve().parent.parent
TOL = {"rtol": 1e-12, "atol": 1e-12}
SCHEDULES = [1, 2, 3, 7, 1000, "sqrt", ("binomial", 1), ("binomial", 2), ("binomial", 5)]
I, H, B = 3, 4, 2


# ---------------------------------------------------------------------------- models


def elman(ck, T=None):
    """An Elman RNN over a stepped sequence; per-step squared readout summed in a carry, and
    the hidden states stacked (0.1 * their sum joins the loss)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    xs, h0 = g.input("xs"), g.input("h0")
    cell = nn.RNNCell(g, I, H, "rnn", share=True)
    V = g.parameter("V", (H, 1))
    with g.loop(checkpoint=ck, name="rnn") as loop:
        x = loop.step(xs)
        h = loop.carry(h0, name="h")
        acc = loop.carry(g.constant(0.0), name="acc")
        hn = cell(x, h)
        y = hn @ V
        loop.update(h, hn)
        loop.update(acc, acc + vg.mean(y * y))
    loss = loop.final(acc) + 0.1 * vg.sum(loop.stack(hn))
    return g, loss, loop


def lstm(ck):
    g = vg.VirtualGraph(dtype=np.float64, seed=2)
    xs, h0 = g.input("xs"), g.input("h0")
    cell = nn.LSTMCell(g, I, H, "lstm", share=True)
    with g.loop(checkpoint=ck, name="lstm") as loop:
        x = loop.step(xs)
        h = loop.carry(h0, name="h")
        c = loop.carry(h0, name="c")
        hn, cn = cell(x, (h, c))
        loop.update(h, hn)
        loop.update(c, cn)
    loss = vg.sum(loop.final(h) ** 2) + vg.mean(loop.final(c))
    return g, loss, loop


def nested(ck_outer, ck_inner):
    """Three passes (untied weights per pass) over the sequence: a loop over layers around a
    loop over time."""
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    xs, h0 = g.input("xs"), g.input("h0")
    with g.loop(times=3, checkpoint=ck_outer, name="layers") as outer:
        s = outer.carry(h0, name="s")
        U = g.parameter("U", (H, H), share=False)
        W = g.parameter("W", (I, H), share=True)
        with g.loop(checkpoint=ck_inner, name="time") as inner:
            x = inner.step(xs)
            h = inner.carry(s, name="h")
            inner.update(h, vg.tanh(x @ W + h @ U))
        outer.update(s, inner.final(h))
    loss = vg.sum(outer.final(s) ** 2)
    return g, loss, outer


def branchy(ck):
    """A while_ loop whose trip count depends on the data, with a branch per iteration chosen by
    the stepped input."""
    g = vg.VirtualGraph(dtype=np.float64, seed=4)
    x0, xs = g.input("x0"), g.input("xs")
    W = g.parameter("W", (H, H), init=vg.nn.init.normal(0.6))
    Wx = g.parameter("Wx", (I, H))
    b = g.parameter("b", (H,))
    cond = lambda t, s: float(np.sum(s["acc"])) < 6.0  # noqa: E731
    with g.loop(while_=cond, checkpoint=ck, name="walk") as loop:
        x = loop.step(xs)
        h = loop.carry(x0, name="h")
        acc = loop.carry(g.constant(0.0), name="acc")
        z = h @ W + x @ Wx + b
        hn = g.branch(lambda v: int(np.sum(v) > 0), [vg.tanh(z), vg.sigmoid(z)], keys=[x])
        loop.update(h, hn)
        loop.update(acc, acc + vg.mean(hn * hn) + 0.05)
    loss = loop.final(acc) + vg.sum(loop.final(h))
    return g, loss, loop


def walk_feed(seed=0):
    rng = np.random.default_rng(seed)
    return {"x0": rng.uniform(-0.5, 0.5, (B, H)), "xs": rng.standard_normal((200, B, I))}


def with_dropout(ck):
    g = vg.VirtualGraph(dtype=np.float64, seed=5)
    xs, h0 = g.input("xs"), g.input("h0")
    cell = nn.RNNCell(g, I, H, "rnn", share=True)
    drop = nn.Dropout(g, 0.4)
    with g.loop(checkpoint=ck) as loop:
        x = loop.step(xs)
        h = loop.carry(h0, name="h")
        loop.update(h, drop(cell(x, h)))
    return g, vg.sum(loop.final(h) ** 2), loop


def tree(ck):
    g = vg.VirtualGraph(dtype=np.float64, seed=6)
    children, xs = g.input("children"), g.input("xs")
    with g.recurse(children, checkpoint=ck, name="tree") as r:
        W = g.parameter("W", (I, H))
        U = g.parameter("U", (H, H))
        x = r.step(xs)
        h = r.state(np.zeros(H), name="h")
        hn = vg.tanh(x @ W + (r.child(h, 0) + r.child(h, 1)) @ U)
        r.update(h, hn)
    loss = vg.sum(r.final(h) ** 2) + 0.1 * vg.sum(r.stack(hn))
    return g, loss, r


def seq_feed(T, seed=0):
    rng = np.random.default_rng(seed)
    return {"xs": rng.standard_normal((T, B, I)), "h0": 0.1 * rng.standard_normal((B, H))}


def random_tree(rng, leaves):
    children = [[-1, -1] for _ in range(leaves)]
    pool = list(range(leaves))
    while len(pool) > 1:
        i, j = sorted(rng.choice(len(pool), 2, replace=False))
        children.append([pool[i], pool[j]])
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [len(children) - 1]
    return np.array(children)


# ---------------------------------------------------------------------------- identity


def run(make, ck, feed, **build):
    g, loss, loop = make(ck)
    cg = g.build(feed, loss, **build)
    value = cg.backward(loss)
    grads = {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}
    return g, cg, loss, value, grads


def assert_identical(make, feed, schedules=SCHEDULES, values=True, expect_drops=True):
    """Loss, every parameter gradient, decisions, keys and (``values``) every node's value of
    each checkpointed build equal the plain unroll's."""
    _, plain, _, v0, g0 = run(make, None, feed)
    assert plain._remat is None
    for ck in schedules:
        _, cg, _, v, grads = run(make, ck, feed)
        np.testing.assert_allclose(v, v0, **TOL, err_msg=str(ck))
        assert grads.keys() == g0.keys()
        for k in g0:
            np.testing.assert_allclose(grads[k], g0[k], **TOL, err_msg=f"{ck} {k}")
        assert [(d.idx, d.kind, d.value) for d in cg.decisions] == [
            (d.idx, d.kind, d.value) for d in plain.decisions
        ]
        plain_keys = {k for k in plain._nodes if not k.type.endswith("*")}  # hoisting groups
        assert {k for k in cg._nodes if not k.type.endswith("*")} == plain_keys
        dropped = [n for n in cg._nodes.values() if n._value is None]
        if expect_drops and ck != 1000:
            assert dropped, ck  # the schedule really dropped values
        if values:
            for key in sorted(plain_keys, key=str):
                np.testing.assert_allclose(cg.node(key).value, plain.node(key).value, **TOL, err_msg=str(key))
    return plain


def test_elman_every_schedule_is_the_plain_unroll():
    assert_identical(elman, seq_feed(23))


def test_lstm_every_schedule_is_the_plain_unroll():
    assert_identical(lstm, seq_feed(17))


@pytest.mark.parametrize("outer, inner", [(None, 3), (1, None), (2, "sqrt"), (1, ("binomial", 2))])
def test_nested_loops(outer, inner):
    feed = seq_feed(9)
    _, plain, _, v0, g0 = run(lambda ck: nested(None, None), None, feed)
    _, cg, _, v, grads = run(lambda ck: nested(outer, inner), None, feed)
    np.testing.assert_allclose(v, v0, **TOL)
    assert grads.keys() == g0.keys() and len(g0) == 4  # W and U@0..2
    for k in g0:
        np.testing.assert_allclose(grads[k], g0[k], **TOL, err_msg=k)
    assert any(n._value is None for n in cg._nodes.values())
    for key, n in plain._nodes.items():
        if not key.type.endswith("*"):  # hoisting groups: none in a checkpointed loop
            np.testing.assert_allclose(cg.node(key).value, n.value, **TOL, err_msg=str(key))
    new = seq_feed(9, 1)
    cg.feed(new)
    plain.feed(new)
    np.testing.assert_allclose(cg.forward(), plain.forward(), **TOL)


def test_while_loop_with_branches_and_data_dependent_trip_count():
    plain = assert_identical(branchy, walk_feed())
    trips = plain.decisions[-1]
    assert trips.kind == "iterations" and 10 < trips.value < 200
    choices = {d.value for d in plain.decisions if d.kind == "option"}
    assert choices == {0, 1}  # both options were taken


def test_dropout_masks_are_the_same_on_recomputation():
    feed = seq_feed(15)
    plain = assert_identical(with_dropout, feed)  # every node's value, masks included
    masks = [n for k, n in plain._nodes.items() if k.type == "Sample"]
    assert len(masks) == 15 and all((n.value == 0).any() for n in masks)
    for ck in [4, ("binomial", 2)]:
        _, cg, *_ = run(with_dropout, ck, feed)
        dropped = [n for k, n in cg._nodes.items() if k.type == "Sample" and n._value is None]
        assert len(dropped) >= 10  # masks are dropped too, and drawn again when recomputed
        cg.forward()  # nothing changed
        cg.feed({"h0": feed["h0"] + 1.0})
        _, plain2, *_ = run(with_dropout, None, feed)
        plain2.feed({"h0": feed["h0"] + 1.0})
        np.testing.assert_allclose(cg.forward(), plain2.forward(), **TOL)


def stacked_masks(ck):
    """A mask collected by loop.stack (kept) drawn before another (dropped) in each iteration."""
    g = vg.VirtualGraph(dtype=np.float64, seed=8)
    xs, h0 = g.input("xs"), g.input("h0")
    cell = nn.RNNCell(g, I, H, "rnn", share=True)
    drop = nn.Dropout(g, 0.5)
    with g.loop(checkpoint=ck) as loop:
        h = loop.carry(h0, name="h")
        first = drop.mask(h)
        hn = drop(cell(loop.step(xs), h * first))
        loop.update(h, hn)
    return g, vg.sum(loop.final(h) ** 2) + vg.sum(loop.stack(first)), loop


def test_kept_masks_are_drawn_again_too_so_the_next_ones_stay_the_same():
    assert_identical(stacked_masks, seq_feed(11), schedules=[1, 3, "sqrt", ("binomial", 2)])


def test_recursion_over_a_tree():
    rng = np.random.default_rng(7)
    children = random_tree(rng, 9)
    feed = {"children": children, "xs": rng.standard_normal((len(children), I))}
    assert_identical(tree, feed, schedules=[1, 2, 3, "sqrt"])
    new = {"xs": rng.standard_normal((len(children), I))}
    for ck in [2, "sqrt"]:
        _, cg, *_ = run(tree, ck, feed)
        _, plain, *_ = run(tree, None, feed)
        cg.feed(new)
        plain.feed(new)
        np.testing.assert_allclose(cg.forward(), plain.forward(), **TOL)


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 40),
    schedule=st.one_of(
        st.integers(1, 45), st.just("sqrt"), st.tuples(st.just("binomial"), st.integers(1, 12))
    ),
    model=st.sampled_from(["elman", "lstm", "branchy", "dropout"]),
    seed=st.integers(0, 100),
)
def test_random_lengths_and_schedules(T, schedule, model, seed):
    if model == "branchy":
        feed = walk_feed(seed)
    else:
        feed = seq_feed(T, seed)
    make = {"elman": elman, "lstm": lstm, "branchy": branchy, "dropout": with_dropout}[model]
    assert_identical(make, feed, schedules=[schedule], values=False, expect_drops=False)


schedules = st.one_of(
    st.none(), st.integers(1, 12), st.just("sqrt"), st.tuples(st.just("binomial"), st.integers(1, 5))
)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 14), outer=schedules, inner=schedules, seed=st.integers(0, 50))
def test_random_nested_schedules(T, outer, inner, seed):
    feed = seq_feed(T, seed)
    _, _, _, v0, g0 = run(lambda ck: nested(None, None), None, feed)
    _, cg, _, v, grads = run(lambda ck: nested(outer, inner), None, feed)
    np.testing.assert_allclose(v, v0, **TOL)
    for k in g0:
        np.testing.assert_allclose(grads[k], g0[k], **TOL, err_msg=k)
    cg.forward()  # nothing changed: recomputes nothing, allows another backward
    cg.backward(cg.outputs[0])  # again, from what the first one left kept
    for k in g0:
        np.testing.assert_allclose(cg.virtual.params[k].grad, 2 * g0[k], **TOL, err_msg=k)


# ---------------------------------------------------------------------------- the engine


def test_backward_twice_and_grad():
    feed = seq_feed(20)
    _, plain, loss0, _, g0 = run(elman, None, feed)
    for ck in ["sqrt", ("binomial", 3)]:
        g, loss = elman(ck)[:2]
        cg = g.build(feed, loss)
        cg.backward_ex(loss, retain_graph=True)
        cg.backward(loss)  # the second backward recomputes again, from what is kept
        for k, p in g.params.items():
            np.testing.assert_allclose(p.grad, 2 * g0[k], **TOL, err_msg=k)
        g.params.zero_grad()
        cg.forward()
        params = [g.params[k] for k in sorted(g0)]
        got = cg.grad(loss, params)
        for k, arr in zip(sorted(g0), got):
            np.testing.assert_allclose(arr, g0[k], **TOL, err_msg=k)
            assert g.params[k].grad is None


def test_values_are_dropped_and_recomputed_on_demand():
    g, loss, loop = elman(4)
    cg = g.build(seq_feed(12), loss)
    tanh = next(v for v in loop.body if v.type == "Mul")  # y * y: not kept
    node = cg.node(tanh, (5,))
    assert node._value is None  # dropped while unrolling
    value = node.value  # recomputes iterations 4..7 (its unit)
    _, plain, *_ = run(elman, None, seq_feed(12))
    np.testing.assert_allclose(value, plain.node(node.key).value, **TOL)
    assert not value.flags.writeable
    assert cg.node(tanh, (6,))._value is not None  # its unit stays until another is read
    assert cg.node(tanh, (9,)).value.shape == (B, 1)
    assert cg.node(tanh, (6,))._value is None and cg.node(tanh, (9,)).shape == (B, 1)
    acc = next(c for c in loop.carries if c.name == "acc")
    assert cg.node(acc, (4,))._value is not None  # the checkpoint: the state entering unit 1
    assert cg.node(acc, (5,))._value is None


def test_forward_after_feed_is_dirty_checked_and_correct():
    feed, new = seq_feed(16, 0), seq_feed(16, 1)
    for ck in [3, "sqrt", ("binomial", 2)]:
        g, loss = elman(ck)[:2]
        cg = g.build(feed, loss)
        gp, lossp = elman(None)[:2]
        plain = gp.build(feed, lossp, hoist=False)  # (a checkpointed loop hoists nothing)
        cg.feed({"h0": new["h0"]})  # changes every iteration (through the carry)
        plain.feed({"h0": new["h0"]})
        np.testing.assert_allclose(cg.forward(), plain.forward(), **TOL)
        assert cg.last_forward.recomputed == plain.last_forward.recomputed
        cg.backward(loss)
        plain.backward(lossp)
        for k, p in gp.params.items():
            np.testing.assert_allclose(g.params[k].grad, p.grad, **TOL, err_msg=f"{ck} {k}")
        assert sum(n._value is None for n in cg._nodes.values()) > 50  # dropped again
        cg.forward()
        assert cg.last_forward.recomputed == 0  # nothing changed: nothing recomputed


def test_a_changed_trip_count_is_refused_and_a_failed_backward_changes_nothing():
    feed = walk_feed(2)
    g, loss = branchy(3)[:2]
    cg = g.build(feed, loss)
    cg.feed({"x0": feed["x0"] + 5.0})  # a larger state: the while_ condition stops earlier
    with pytest.raises(vg.StructureChangedError, match="condition"):
        cg.forward()
    with pytest.raises(vg.StructureChangedError):
        cg.backward(loss)
    assert sum(n._value is not None for n in cg._nodes.values() if n.key.idx) < len(cg._nodes) / 2

    g, loss, loop = elman(4)
    cg = g.build(seq_feed(12), loss)
    mul = next(v for v in loop.body if v.type == "Mul")
    node = cg.node(mul, (2,))  # in a dropped unit: backward recomputes it before its VJP runs
    assert node._value is None

    def broken(*args, **attrs):
        raise RuntimeError("boom")

    node.vjps = (broken, broken)
    with pytest.raises(vg.BackwardError, match="boom"):
        cg.backward(loss)
    assert all(p.grad is None for p in g.params.values())
    assert cg._remat.live == [] and node._value is None  # its unit was dropped again


def test_gradcheck_and_check_vjps_on_a_checkpointed_graph():
    for ck in ["sqrt", ("binomial", 2)]:
        g, loss = elman(ck)[:2]
        cg = g.build(seq_feed(9), loss)
        assert vg.check.gradcheck(cg.node(loss), list(g.params.values())).ok
        result = vg.check.check_vjps(cg)
        assert result.ok and len(result.nodes) > 80


def test_stale_values_still_refuse_backward():
    g, loss = elman("sqrt")[:2]
    cg = g.build(seq_feed(10), loss)
    cg.feed(seq_feed(10, 3))
    with pytest.raises(vg.GraphStateError, match="out-of-date"):
        cg.backward(loss)


def test_while_loops_sqrt_grows_its_units_and_binomial_keeps_half_its_budget():
    feed = walk_feed(1)
    g, loss = branchy("sqrt")[:2]
    cg = g.build(feed, loss)
    (rec,) = cg._remat.records
    T = cg.decisions[-1].value
    lengths = [u.last - u.first + 1 for u in rec.units]
    assert sum(lengths) == T > 10 and lengths[:-1] == list(range(1, len(lengths)))
    g, loss = branchy(("binomial", 4))[:2]
    cg = g.build(feed, loss)
    (rec,) = cg._remat.records
    assert 1 <= len(rec.stored) <= 2  # s // 2 while unrolling: the rest is for backward
    kept = [n for n in cg._nodes.values() if n.key.idx and n.op is not None and n._value is not None]
    assert len(kept) < 3 * 12  # a few states and the last iteration, of T * ~12 nodes


def test_a_loop_that_runs_no_iteration_and_a_loss_inside_the_loop():
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x")
    W = g.parameter("W", (H, H))
    with g.loop(times=0, checkpoint=2) as loop:
        h = loop.carry(x, name="h")
        loop.update(h, vg.tanh(h @ W))
    loss = vg.sum(loop.final(h) @ W)
    cg = g.build({"x": np.ones((B, H))}, loss)
    assert cg.backward(loss) == pytest.approx(float(np.sum(np.ones((B, H)) @ W.compute_nodes[()].value)))
    g, _, loop = elman(3)
    mean = next(v for v in loop.body if v.type == "Mean")
    cg = g.build(seq_feed(10), [loop.final(next(c for c in loop.carries if c.name == "acc"))])
    inner = cg.node(mean, (4,))
    assert inner._value is None
    _, plain, *_ = run(elman, None, seq_feed(10))
    assert cg.backward(inner) == pytest.approx(float(plain.node(inner.key).value), rel=1e-12)


def test_binomial_schedule_numbers():
    # 2 stored states for 10 steps: C(3 + r, 3) >= 10 at r = 2
    assert binomial_split(10, 2) in range(1, 10)
    pos = binomial_positions(10_000, 10)
    assert len(pos) == 10 and max(pos) < 10_000
    # every split keeps both parts within their binomial bounds
    for n in range(2, 200):
        for free in range(1, 6):
            assert 1 <= binomial_split(n, free) <= n - 1


def test_binomial_backward_holds_at_most_s_states_besides_the_unit_in_use(monkeypatch):
    import vgraph.virtual.checkpoint as checkpoint

    T = 40
    for slots in [1, 3]:
        g, loss = elman(("binomial", slots))[:2]
        cg = g.build(seq_feed(T), loss)
        (rec,) = cg._remat.records
        most = []
        bring = checkpoint.Rematerializer._bring

        def counting(self, unit, upto=None, sweeping=False, bring=bring, rec=rec, most=most):
            bring(self, unit, upto, sweeping)
            present = [u for u in rec.units[:-1] if all(n._value is not None for n in u.bound)]
            most.append(len(present))

        monkeypatch.setattr(checkpoint.Rematerializer, "_bring", counting)
        cg.backward(loss)
        monkeypatch.undo()
        # s stored states, the state entering the unit in use and the unit's own end state
        assert most and max(most) <= slots + 2, (slots, max(most))


def test_a_second_binomial_backward_reverses_from_the_start_with_every_slot():
    for slots in [1, 3]:
        g, loss = elman(("binomial", slots))[:2]
        cg = g.build(seq_feed(30), loss)
        cg.backward_ex(loss, retain_graph=True)
        first = cg._remat.recomputed
        cg.backward(loss)
        second = cg._remat.recomputed - first
        assert second <= 2 * first, (slots, first, second)  # not a slot-less quadratic reversal


def test_reading_every_value_of_a_binomial_loop_costs_about_two_forwards():
    T = 50
    g, loss, loop = elman(("binomial", 2))
    cg = g.build(seq_feed(T), loss)
    (rec,) = cg._remat.records
    ops = [n for n in cg.nodes() if n.op is not None and n.key.idx]
    before = cg._remat.recomputed
    most = 0
    for n in ops:  # in creation order, as the explorer and the renderer read them
        assert n.value is not None
        most = max(most, sum(all(m._value is not None for m in u.bound) for u in rec.units[:-1]))
    assert cg._remat.recomputed - before <= 2.5 * len(ops)  # not one advance per unit
    assert most <= 2 + 2  # s states, the one entering the unit read, and the unit's own


def test_recomputation_counts_match_the_schedule():
    T = 60
    feed = seq_feed(T)
    counts = {}
    for ck in [1, "sqrt", ("binomial", 3), ("binomial", 1)]:
        g, loss = elman(ck)[:2]
        cg = g.build(feed, loss)
        cg.backward(loss)
        counts[str(ck)] = cg._remat.recomputed
    ops = sum(1 for n in cg._nodes.values() if n.op is not None)
    assert counts["1"] < counts["sqrt"] <= ops  # at most one extra forward
    # 4 snapshots (3 stored + the initial state): C(4 + r, 4) >= 60 at r = 3
    assert ops < counts["('binomial', 3)"] <= 3 * ops
    assert counts["('binomial', 1)"] > counts["('binomial', 3)"]


# ---------------------------------------------------------------------------- memory


def peak(make, ck, feed):
    g, loss = make(ck)[:2]
    g.build(feed, loss, cache=False)  # parameters exist before measuring
    g.latest_build = None
    tracemalloc.start()
    try:
        cg = g.build(feed, loss, cache=False)
        cg.backward(loss)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dropout", [False, True])
def test_peak_memory_is_bounded_relative_to_the_plain_unroll(dropout):
    def big(ck):
        g = vg.VirtualGraph(dtype=np.float64, seed=1)
        xs, h0 = g.input("xs"), g.input("h0")
        cell = nn.RNNCell(g, 4, 64, "rnn", share=True)
        drop = nn.Dropout(g, 0.3)
        with g.loop(checkpoint=ck) as loop:
            h = loop.carry(h0, name="h")
            hn = cell(loop.step(xs), h)
            loop.update(h, drop(hn) if dropout else hn)  # masks are dropped and drawn again
        return g, vg.sum(loop.final(h) ** 2)

    rng = np.random.default_rng(0)
    feed = {"xs": rng.standard_normal((400, 16, 4)), "h0": np.zeros((16, 64))}
    plain = peak(big, None, feed)
    sqrt = peak(big, "sqrt", feed)  # 20 states + 20 iterations of 400 (measured: 10% of plain)
    binomial = peak(big, ("binomial", 4), feed)  # measured: 6%
    whole = peak(big, 400, feed)  # one unit of every iteration: what the plain unroll holds
    assert sqrt < 0.2 * plain, (sqrt, plain)
    assert binomial < 0.15 * plain, (binomial, plain)
    assert whole > 0.6 * plain, (whole, plain)


def test_nested_checkpointed_loops_recompute_an_outer_unit_inner_unit_by_inner_unit():
    def stacked(cks):
        outer_ck, inner_ck = cks
        g = vg.VirtualGraph(dtype=np.float64, seed=3)
        xs, h0 = g.input("xs"), g.input("h0")
        with g.loop(times=2, checkpoint=outer_ck) as outer:
            s = outer.carry(h0, name="s")
            U = g.parameter("U", (64, 64), share=False)
            W = g.parameter("W", (4, 64), share=True)
            with g.loop(checkpoint=inner_ck) as inner:
                h = inner.carry(s, name="h")
                inner.update(h, vg.tanh(inner.step(xs) @ W + h @ U))
            outer.update(s, inner.final(h))
        return g, vg.sum(outer.final(s) ** 2)

    rng = np.random.default_rng(0)
    feed = {"xs": rng.standard_normal((300, 16, 4)), "h0": np.zeros((16, 64))}
    plain = peak(stacked, (None, None), feed)
    outer_only = peak(stacked, (1, None), feed)  # one layer's 300 steps at a time (measured 72%)
    both = peak(stacked, (1, "sqrt"), feed)  # and within it, units of 18 steps (measured 10%)
    assert outer_only > 0.5 * plain and both < 0.2 * plain, (plain, outer_only, both)


# ---------------------------------------------------------------------------- combinations


def test_hoisting_is_off_in_checkpointed_loops_only():
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    xs = g.input("xs")
    W = g.parameter("W", (I, H))
    with g.loop(checkpoint=2) as a:
        h = a.carry(np.zeros((B, H)), name="h")
        a.update(h, vg.tanh(a.step(xs) @ W + h))
    with g.loop() as b:
        k = b.carry(a.final(h), name="k")
        b.update(k, vg.tanh(b.step(xs) @ W + k))
    loss = vg.sum(b.final(k))
    feed = {"xs": seq_feed(8)["xs"]}
    cg = g.build(feed, loss)
    groups = [key for key in cg._nodes if key.type.endswith("*")]
    assert groups and all(cg._nodes[key].key.type == "MatMul*" or key.type == "Item*" for key in groups)
    matmul = next(v for v in a.body if v.type == "MatMul")
    assert cg.node(matmul, (3,)).parents[0].key.type == "Item"  # per iteration, not a Hoisted view
    cg.backward(loss)
    got = np.array(W.compute_nodes[()].grad)
    g.params.zero_grad()
    plain = g.build(feed, loss, hoist=False)
    plain.backward(loss)
    np.testing.assert_allclose(got, W.compute_nodes[()].grad, **TOL)


def test_checkpointed_graphs_are_not_cached():
    g, loss = elman(3)[:2]
    first = g.build(seq_feed(6), loss)
    second = g.build(seq_feed(6, 1), loss)
    assert len(g._cache) == 0
    assert first.forward() != second.forward()  # the first graph is still its own


def test_truncated_bptt_with_checkpointing():
    results = []
    for ck in [None, "sqrt"]:
        g, loss, loop = elman(ck)
        h = next(c for c in loop.carries if c.name == "h")
        feed = seq_feed(24)
        res = truncated_bptt(
            g,
            chunk_feeds({"xs": feed["xs"]}, 8, ["xs"]),
            loss,
            {"h0": loop.final(h)},
            {"h0": feed["h0"]},
            optimizer=vg.optim.SGD(g.params, lr=0.1),
        )
        results.append((res.losses, {k: np.array(p.value) for k, p in g.params.items()}))
    np.testing.assert_allclose(results[0][0], results[1][0], **TOL)
    for k in results[0][1]:
        np.testing.assert_allclose(results[0][1][k], results[1][1][k], **TOL)


def test_eval_builds_keep_every_value():
    g, loss = elman("sqrt")[:2]
    g.eval()
    cg = g.build(seq_feed(9), loss)
    assert cg._remat is None and all(n._value is not None for n in cg._nodes.values())


# ---------------------------------------------------------------------------- rendering


def test_rendering_marks_kept_and_recomputed_iterations():
    g, loss = elman(3)[:2]
    cg = g.build(seq_feed(7), loss)
    cg.backward(loss)
    dot = to_dot(cg, gradients=True, fold=None)
    assert "checkpoint every 3" in dot
    assert dot.count("state kept") == 3  # iterations 2, 5 and 6 (the last, partial unit)
    assert dot.count("recomputed") == 4
    assert "|grad|" in dot  # the gradient overlay


def test_gradient_through_time_and_the_explorer_on_a_checkpointed_graph():
    from vgraph.render import explore, gradient_through_time, retain_all_grads

    rows = {}
    for ck in [None, ("binomial", 3)]:
        g, loss = elman(ck)[:2]
        cg = g.build(seq_feed(30), loss)
        retain_all_grads(cg)
        cg.backward(loss)
        rows[ck] = gradient_through_time(cg, "rnn.W_h")
        assert "Loop:1" in explore(cg)._repr_html_()
    assert rows[None].shape == (30, H, H)
    np.testing.assert_allclose(rows[("binomial", 3)], rows[None], **TOL)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "bad, error, text",
    [
        (0, ValueError, "checkpoint=0 cannot work"),
        (-3, ValueError, "checkpoint=-3 cannot work"),
        (("binomial", 0), ValueError, "budget of at least one"),
        (("binomial", -1), ValueError, "budget of at least one"),
        ("log", ValueError, "unknown checkpoint schedule 'log'"),
        (("revolve", 3), ValueError, "is not a schedule"),
        (("binomial", 2.5), TypeError, "needs an int s"),
        (2.0, TypeError, "is not a schedule"),
        (True, TypeError, "is not a schedule"),
        ([3], TypeError, "is not a schedule"),
    ],
)
def test_bad_schedules_are_typed_errors_naming_the_loop(bad, error, text):
    g = vg.VirtualGraph()
    before = len(g.nodes)
    with pytest.raises(error, match=text) as info:
        g.loop(times=3, checkpoint=bad, name="rnn")
    assert "<Loop:1> 'rnn'" in str(info.value)
    assert len(g.nodes) == before  # a failed call changes nothing


def test_binomial_recursion_is_refused():
    g = vg.VirtualGraph()
    children = g.input("children")
    with pytest.raises(ValueError, match="needs a chain"):
        g.recurse(children, checkpoint=("binomial", 3))
    with pytest.raises(ValueError, match="cannot work"):
        g.recurse(children, checkpoint=0)


# ---------------------------------------------------------------------------- benchmark smoke


def test_benchmark_quick_mode_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_checkpoint.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "sqrt" in out.stdout and "binomial(10)" in out.stdout
    assert "loss = step" in out.stdout and "loss = final" in out.stdout and "sqrt floor" in out.stdout


# ---------------------------------------------------------------------------- the build's copy of a feed


def _sum_model(dtype):
    g = vg.VirtualGraph(dtype=dtype)
    x = g.input("x")
    return g, vg.sum(x)


def _build_peak(g, loss, feed):
    tracemalloc.start()
    try:
        cg = g.build(feed, loss, cache=False)
        return cg, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_build_holds_one_copy_of_a_fed_array():
    """A fed array is copied once (so the graph does not see later changes), not once while
    checking the feed and again by the input leaf: a 40 MB feed costs the build 40 MB, not 80."""
    g, loss = _sum_model(np.float64)
    x = np.random.default_rng(0).standard_normal((5_000, 1_000))  # 40 MB, float64
    g.build({"x": x[:2]}, loss, cache=False)  # warm-up: plans, caches
    g.latest_build = None
    cg, peak = _build_peak(g, loss, {"x": x})
    assert peak < 1.3 * x.nbytes, f"peak {peak / x.nbytes:.2f}x the fed array"
    assert not np.shares_memory(cg.inputs["x"].value, x)


def test_a_cast_feed_is_its_own_copy():
    """A float64 array fed to a float32 graph: the cast is the graph's copy (half the size), no
    second one."""
    g, loss = _sum_model(np.float32)
    x = np.random.default_rng(0).standard_normal((5_000, 1_000))
    g.build({"x": x[:2]}, loss, cache=False)
    g.latest_build = None
    cg, peak = _build_peak(g, loss, {"x": x})
    assert peak < 1.3 * x.nbytes / 2, f"peak {peak / x.nbytes:.2f}x the fed float64 array"
    assert cg.inputs["x"].value.dtype == np.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a,  # the caller's own array
        lambda a: a[:],  # a view of it
        lambda a: np.asarray(a).view(np.ndarray),  # another view, through asarray
    ],
    ids=["array", "view", "asarray-view"],
)
def test_changing_a_fed_array_later_does_not_change_the_graph(make):
    g, loss = _sum_model(np.float64)
    x = np.arange(6.0).reshape(2, 3)
    fed = make(x)
    cg = g.build({"x": fed}, loss, cache=False)
    x[...] = 100.0  # the caller reuses their buffer
    assert cg.inputs["x"].value.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert float(cg.forward()) == 15.0
    y = np.ones((2, 3))
    cg.feed({"x": y})  # the same guarantee for a graph fed again
    y[...] = 7.0
    assert float(cg.forward()) == 6.0


def test_an_object_exposing_its_buffer_is_copied():
    """An object whose ``__array__`` hands out its own buffer: that buffer is not adopted."""

    class Holder:
        def __init__(self):
            self.buf = np.arange(3.0)

        def __array__(self, dtype=None, copy=None):
            return self.buf

    g, loss = _sum_model(np.float64)
    h = Holder()
    cg = g.build({"x": h}, loss, cache=False)
    h.buf[:] = -1.0
    assert cg.inputs["x"].value.tolist() == [0.0, 1.0, 2.0]


def test_a_list_feed_is_adopted_after_its_conversion():
    g, loss = _sum_model(np.float64)
    rows = [[1.0, 2.0], [3.0, 4.0]]
    cg = g.build({"x": rows}, loss, cache=False)
    rows[0][0] = 50.0
    assert float(cg.forward()) == 10.0
