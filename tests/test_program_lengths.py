"""A cached build whose loops ran as body programs serves every length of its sequences, and
every tree of its recursions.

A program runs its body over any number of iterations, so once every loop of a graph whose trip
count its sequences or its tree decide ran as a program, the graph's structure no longer depends
on them: a cached build re-runs it for a feed of other lengths or another tree instead of building
anew (``UnrolledGraph._resizes_by_programs``). Identity tests: every such replay gives, bit for
bit, what a fresh program build of that feed gives, and what the per-node unroll gives (float64,
1e-12): loss, every parameter gradient, every decision — on recurrent cells, the example models,
random loop bodies with and without a branch over random sequences of lengths, and a recursion
over random trees; and the replays did happen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch import model_script_inputs
from test_hoist import load, loop_bodies, loop_body_model
from test_programs import cell_model, decisions, param_grads, stacked_cell_model, tree_model, trees

import vgraph as vg
from vgraph.virtual.unrolled import UnrolledGraph

ROOT = Path(__file__).resolve().parent.parent
TOL = {"rtol": 1e-12, "atol": 1e-12}

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


@pytest.fixture
def replays(monkeypatch):
    """The successful replays of cached builds, as ``(resized, lengths)``: whether the replay let
    programs take another length, and the trip counts it recorded."""
    done = []
    replay = UnrolledGraph._replay

    def recorded(self, values, seed, resize=False):
        replay(self, values, seed, resize=resize)  # if it raises, the build unrolls anew
        done.append((resize, [d.value for d in self.decisions if d.kind == "iterations"]))

    monkeypatch.setattr(UnrolledGraph, "_replay", recorded)
    return done


def step(g, feed, loss, **build):
    """One training step's build and backward: ``(graph, loss value, parameter gradients)``."""
    cg = g.build(feed, loss, **build)
    g.params.zero_grad()
    value = cg.backward(cg.outputs[0])
    return cg, value, param_grads(g)


def assert_each_length_as_fresh(g, loss, feeds, hoist=True):
    """Build ``feeds`` one after another with the cache and programs; each equals a fresh program
    build bit for bit and the per-node unroll within TOL. Returns the cached builds' graphs."""
    graphs = []
    for feed in feeds:
        cg, value, grads = step(g, feed, loss, programs=True, hoist=hoist)
        graphs.append(cg)
        got = (value, grads, decisions(cg))
        _, fresh, fresh_grads = step(g, feed, loss, programs=True, cache=False, hoist=hoist)
        plain, plain_value, plain_grads = step(g, feed, loss, programs=False, cache=False, hoist=hoist)
        assert got[0] == fresh  # bit for bit
        assert grads.keys() == fresh_grads.keys() == plain_grads.keys()
        for k in grads:
            np.testing.assert_array_equal(grads[k], fresh_grads[k], err_msg=k)
            np.testing.assert_allclose(grads[k], plain_grads[k], **TOL, err_msg=k)
        np.testing.assert_allclose(value, plain_value, **TOL)
        assert got[2] == decisions(plain)
    return graphs


def sequences(lengths, B=2, I=3, seed=0):
    rng = np.random.default_rng(seed)
    return [{"xs": rng.standard_normal((T, B, I)) * 2.0, "ys": rng.integers(0, 3, T * B)} for T in lengths]


@pytest.mark.parametrize("kind", ["lstm", "lstm-unfused", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("hoist", [True, False])
def test_a_cached_program_build_replays_at_other_lengths_as_fresh_builds(kind, reverse, hoist, replays):
    g, loss = cell_model(kind, reverse, None, (2, 3, 4))
    lengths = [4, 4, 2, 6, 3, 1, 6, 5, 3]  # (1: a hoisting program does not run one iteration)
    graphs = assert_each_length_as_fresh(g, loss, sequences(lengths), hoist=hoist)
    # From the third build on (a structure is kept on its second), every length re-ran the
    # cached graph — but with hoisting, not the one-step build: it unrolled anew, its graph
    # kept for its own shapes, and the builds after it keep a graph for every length again
    # from the second one on.
    resized = [2, 6, 3, 3] if hoist else [2, 6, 3, 1, 6, 5, 3]
    assert replays == [(True, [n]) for n in resized]
    loop = next(iter(graphs[-1].programs))[0]
    assert graphs[-1].trip_count(loop) == 3


def test_a_resized_graph_views_its_iterations_and_refuses_another_length_on_a_rerun(replays):
    g, loss = cell_model("lstm", False, None, (1, 2, 3))
    feeds = sequences([5, 5, 3], B=1, I=2)
    g.build(feeds[0], loss, programs=True)
    cached = g.build(feeds[1], loss, programs=True)
    loop = next(iter(cached.programs))[0]
    body = [v for v in loop.body if v.kind == "op"][-1]
    old = {t: cached.node(body, (t,)) for t in (1, 4)}  # views made before the replay
    cg = g.build(feeds[2], loss, programs=True)
    assert replays == [(True, [3])]
    assert cg.trip_count(loop) == 3
    assert [d.value for d in cg.decisions if d.kind == "iterations"] == [3]
    fresh = g.build(feeds[2], loss, programs=True, cache=False)
    np.testing.assert_array_equal(cg.node(body, (2,)).value, fresh.node(body, (2,)).value)
    with pytest.raises(vg.BuildError, match="not built in this graph"):
        cg.node(body, (4,))  # the five-step build's iteration, not this one's
    view = cg.node(body, (1,))
    assert view is old[1]  # (a node of the re-used graph belongs to the new build, with its value)
    np.testing.assert_array_equal(view.value, fresh.node(body, (1,)).value)
    view.retain_grad()
    cg.backward(cg.outputs[0])
    fresh.node(body, (1,)).retain_grad()
    fresh.backward(fresh.outputs[0])
    np.testing.assert_array_equal(view.grad, fresh.node(body, (1,)).grad)
    # a re-run of the graph itself still checks its decisions: another length is another graph
    cg.feed(sequences([4], B=1, I=2)[0])
    with pytest.raises(vg.StructureChangedError, match="whose length is now"):
        cg.forward()


def test_the_flagship_rnn_replays_for_other_lengths_of_each_batch_size(replays):
    g, outs = load(ROOT / "examples" / "rnn_bptt.py").build_model(vocab=5, hidden=4, seed=0)
    rng = np.random.default_rng(0)
    feeds = [
        {"x": np.eye(5)[rng.integers(0, 5, (T, B))], "y": rng.integers(0, 5, (T, B)), "h0": np.zeros((B, 4))}
        for T, B in [(6, 3), (6, 3), (4, 3), (7, 2), (7, 2), (2, 2), (5, 3)]
    ]
    assert_each_length_as_fresh(g, outs["loss"], feeds)
    # (a batch of another size is another structure: its rows' shape is part of the key)
    assert replays == [(True, [4]), (True, [2]), (True, [5])]


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_example_models_replayed_at_other_sizes_equal_fresh_builds(script, replays):
    make, feeds = model_script_inputs(script)
    g, outputs = make()
    assert_each_length_as_fresh(g, outputs[0], [feeds[0], *feeds])
    # every build after the second re-ran the cached graph: sequence loops (the stacked RNN's
    # layers: each layer's) at each length, a body's branch choosing anew, a recursion on each tree
    assert [ok for ok, _ in replays] == [True] * 3, replays


@settings(max_examples=30, deadline=None, derandomize=True)
@given(loop_bodies(), st.lists(st.integers(1, 7), min_size=3, max_size=6))
def test_random_loop_bodies_replayed_at_random_lengths_equal_fresh_builds(body, lengths):
    g, loss, _ = loop_body_model(body)
    rng = np.random.default_rng(len(lengths))
    assert_each_length_as_fresh(g, loss, [{"xs": rng.normal(size=(T, 2, 3))} for T in lengths])


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    loop_bodies(),
    st.tuples(st.integers(0, 9), st.integers(0, 100)),
    st.lists(st.integers(1, 7), min_size=3, max_size=5),
)
def test_random_bodies_with_a_branch_replayed_at_random_lengths_equal_fresh_builds(body, branch, lengths):
    """A branch chooses per iteration from the iteration's values: a replay at another length
    chooses anew and records its choices where the build recorded them."""
    g, loss, _ = loop_body_model(body, branch=branch)
    rng = np.random.default_rng(sum(lengths))
    assert_each_length_as_fresh(g, loss, [{"xs": rng.normal(size=(T, 2, 3))} for T in lengths])


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(trees(), min_size=3, max_size=5))
def test_a_recursion_replayed_on_random_trees_equals_fresh_builds(forest):
    """A recursion run as a program runs any tree: a cached build re-runs the graph on each new
    tree (a one-node tree is built afresh: a hoisting program runs at least two nodes)."""
    g, loss = tree_model()
    feeds = [{"children": c, "tokens": t, "is_leaf": leaf} for c, t, leaf in forest]
    assert_each_length_as_fresh(g, loss, feeds)


def test_a_graph_whose_loop_lengths_decide_more_keeps_to_its_shapes():
    """A loop that steps through a sequence node by node checks its length, and a program whose
    trip count a condition decides checks it: such a graph is kept by its exact shapes (or
    resized by .elastic), never re-run for another length."""
    g, loss = cell_model("lstm-unfused", False, None, (1, 2, 3))
    feed = sequences([4], B=1, I=2)[0]
    assert g.build(feed, loss, programs=True)._resizes_by_programs()
    cg = g.build(feed, loss)  # the default: a loop of no fused cell, cached, runs node by node
    assert not cg.programs and not cg._resizes_by_programs()
    g = vg.VirtualGraph(seed=1)
    xs = g.input("xs", (None, 2))
    with g.loop(until=lambda t, s: float(s["h"].sum()) > 3.0) as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + vg.tanh(L.step(xs)))
    cg = g.build({"xs": np.ones((9, 2))}, vg.sum(L.final(h)), programs=True)
    assert cg.programs and not cg._resizes_by_programs()


def capped_model(on_limit):
    """An LSTM over a stepped sequence, at most four steps (``max_iters=4``)."""
    g = vg.VirtualGraph(seed=3)
    xs = g.input("xs", (None, 1, 2))
    cell = vg.nn.LSTMCell(g, 2, 3, "cell")
    zeros = g.constant(np.zeros((1, 3)), name="zeros")
    with g.loop(max_iters=4, on_limit=on_limit) as L:
        h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
        h_new, c_new = cell(L.step(xs), (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    return g, vg.sum(L.stack(h_new))


@pytest.mark.parametrize("on_limit", ["raise", "stop"])
def test_a_length_past_max_iters_is_not_replayed_but_built_as_fresh(on_limit, replays):
    """A replay takes another length only where a fresh build would run the same rules: a
    sequence longer than ``max_iters`` raises, or is capped, exactly as a fresh build does."""
    g, loss = capped_model(on_limit)
    feeds = [{"xs": np.full((T, 1, 2), 0.1 * T)} for T in (3, 3, 2, 6, 4)]
    for feed in feeds:
        if feed["xs"].shape[0] > 4 and on_limit == "raise":
            for cache in (True, False):
                with pytest.raises(vg.LoopLimitError):
                    g.build(feed, loss, programs=True, cache=cache)
            continue
        cg = g.build(feed, loss, programs=True)
        fresh = g.build(feed, loss, programs=True, cache=False)
        assert cg.outputs[0].value == fresh.outputs[0].value
        assert decisions(cg) == decisions(fresh)
    # the two-step build re-ran the cached graph; the six-step one did not (the capped build
    # is not resizable: the four-step one after it was built afresh, as its first sighting)
    assert replays == [(True, [2])]


def dropout_tagger():
    """An LSTM over embedded tokens with dropout on the embeddings (a mask drawn per build,
    outside the loop, shaped by the sentence's length)."""
    g = vg.VirtualGraph(seed=11)
    tokens = g.input("tokens", (None, 1))
    emb = vg.nn.Embedding(g, 12, 3, "emb")
    cell = vg.nn.LSTMCell(g, 3, 4, "cell")
    zeros = g.constant(np.zeros((1, 4)), name="zeros")
    x = vg.nn.Dropout(g, 0.3)(emb(tokens))
    with g.loop() as L:
        h, c = L.carry(zeros, name="h"), L.carry(zeros, name="c")
        h_new, c_new = cell(L.step(x), (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    return g, vg.sum(L.stack(h_new) ** 2)


def test_a_replay_at_another_length_draws_the_masks_a_fresh_build_draws(replays):
    """Sampled values outside the loop (dropout) are drawn again at the new length, from the
    build's own generator: the same masks, losses and gradients as a graph built afresh every
    time with the same sequence of builds."""
    (g, loss), (fresh_g, fresh_loss) = dropout_tagger(), dropout_tagger()
    rng = np.random.default_rng(0)
    for T in (5, 5, 3, 8, 2):
        feed = {"tokens": rng.integers(0, 12, (T, 1))}
        _, value, grads = step(g, feed, loss, programs=True)
        _, want, want_grads = step(fresh_g, feed, fresh_loss, programs=True, cache=False)
        assert value == want
        for k in want_grads:
            np.testing.assert_array_equal(grads[k], want_grads[k], err_msg=k)
    assert replays == [(True, [3]), (True, [8]), (True, [2])]


def test_a_graph_replayed_on_another_tree_reruns_on_that_tree_and_refuses_others(replays):
    """After a replay on a new tree, the graph describes that tree: a forward after feeding it
    again recomputes it (equal to a fresh build), another tree raises."""
    g, loss = tree_model()
    chain = {  # ((0, 1), 2), 3: a left-leaning tree of three leaves
        "children": np.array([[-1, -1], [-1, -1], [-1, -1], [0, 1], [3, 2]]),
        "tokens": np.array([1, 2, 3, 0, 0]),
        "is_leaf": np.array([1.0, 1.0, 1.0, 0.0, 0.0]),
    }
    pair = {"children": np.array([[-1, -1], [-1, -1], [0, 1]]), "tokens": np.array([4, 5, 0]),
            "is_leaf": np.array([1.0, 1.0, 0.0])}  # fmt: skip
    for feed in (chain, chain, pair):
        cg = g.build(feed, loss, programs=True)
    assert replays == [(True, [3])]
    want = g.build(pair, loss, programs=True, cache=False).outputs[0].value
    cg.feed({k: v.copy() for k, v in pair.items()})
    assert cg.forward() == want
    cg.feed(chain)
    with pytest.raises(vg.StructureChangedError):
        cg.forward()


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_replay_at_another_length_computes_the_cell_into_a_buffer_of_that_length(kind, replays):
    """A resized replay runs the program anew: its cell's values go into a buffer of the new
    length, and the stack of ``h'`` read from it is the fresh build's, bit for bit."""
    g, loss = stacked_cell_model(kind, False)
    rng = np.random.default_rng(3)
    feeds = [{"xs": rng.standard_normal((T, 2, 3))} for T in (5, 5, 7, 3)]
    cg = assert_each_length_as_fresh(g, loss, feeds)[-1]  # (the others superseded by it)
    assert replays == [(True, [7]), (True, [3])]
    (instance,) = cg.programs.values()
    (buf,) = instance.run.buffers.values()
    (stacked,) = [n for n in cg.nodes() if n.key.type == "Stack"]
    fresh = g.build(feeds[-1], loss, programs=True, cache=False)
    (fresh_stacked,) = [n for n in fresh.nodes() if n.key.type == "Stack"]
    assert buf.shape[0] == 3 and np.shares_memory(stacked.value, buf)
    np.testing.assert_array_equal(stacked.value, fresh_stacked.value)
