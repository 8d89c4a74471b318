"""Autobatching (issue 12): ``g.build_batch(feeds, outputs)`` equals building the inputs one at a
time — losses, every parameter gradient, every decision (float64, 1e-12) — on every example model
and on random lengths, branch choices and trees; and it batches."""

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
TOL = {"rtol": 1e-12, "atol": 1e-13}


pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def load(path):
    spec = importlib.util.spec_from_file_location(f"batch_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def one_at_a_time(make, feeds, output=0):
    """Build and backpropagate each input alone on a fresh copy of the model; sum the losses."""
    g, outputs = make()
    loss = outputs[output]
    total, decisions = 0.0, []
    for feed in feeds:
        cg = g.build(feed, outputs, cache=False)
        total += cg.backward(loss)
        decisions.append([(d.node.key, d.idx, d.kind, d.value) for d in cg.decisions])
    return total, {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}, decisions


def batched(make, feeds, output=0):
    g, outputs = make()
    batch = g.build_batch(feeds, outputs)
    total = batch.backward("sum", output)
    decisions = [[(d.node.key, d.idx, d.kind, d.value) for d in view.decisions] for view in batch.inputs]
    return total, {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None}, decisions, batch


def assert_identical(make, feeds, expect_batching=True):
    v1, g1, d1 = one_at_a_time(make, feeds)
    v2, g2, d2, batch = batched(make, feeds)
    np.testing.assert_allclose(v2, v1, **TOL)
    assert g1.keys() == g2.keys()
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], **TOL, err_msg=k)
    assert d1 == d2
    if expect_batching:
        assert max(n for _, n in batch.groups) > 1, batch.groups
    return batch


# ---------------------------------------------------------------------------- the example models


def model_script_inputs(script):
    """``(make, feeds)`` for an example model: four inputs of different sizes, and a function
    making the model (``(graph, outputs)``) anew."""
    module = load(script)
    sizes = [
        {"steps": 3, "seed": 0},
        {"steps": 5, "seed": 1},
        {"steps": 4, "seed": 2},
        {"steps": 5, "seed": 3},
    ]
    if script.stem == "branching":
        sizes = [{"seed": s} for s in range(4)]
    if script.stem == "tree_lstm":  # sized by the tree's digits, not by time steps
        sizes = [{"leaves": n, "seed": s} for s, n in enumerate((3, 5, 4, 5))]
    feeds = [module.build(**kw)[1] for kw in sizes]

    def make():
        g, _, outputs = module.build(**sizes[0])
        return g, outputs

    return make, feeds


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_model_scripts(script):
    assert_identical(*model_script_inputs(script))


def example(name):
    return load(ROOT / "examples" / f"{name}.py")


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lstm_sequence_with_fused_cells(cell):
    m = example("lstm_sequence")
    rng = np.random.default_rng(1)
    feeds = []
    for T in (3, 6, 4):
        x, y = m.adding_batch(rng, 2, T)
        feeds.append({"x": x, "y": y, "h0": np.zeros((2, 4))})

    def make():
        g, outs = m.build_model(cell, hidden=4, seed=0)
        return g, [outs["loss"]]

    assert_identical(make, feeds)


@pytest.mark.parametrize("hoist", [True, False])
def test_hoisting_inside_batched_builds(hoist):
    """Carry-independent loop-body work (``x_t @ W_x``) is one op per loop and input when hoisting
    (the default, as in ``g.build``), one per iteration without; both equal one at a time."""
    m = example("lstm_sequence")
    rng = np.random.default_rng(2)
    feeds = []
    for T in (5, 2, 7, 5):
        x, y = m.adding_batch(rng, 2, T)
        feeds.append({"x": x, "y": y, "h0": np.zeros((2, 4))})
    g1, outs1 = m.build_model("lstm", hidden=4, seed=0)
    total = 0.0
    for feed in feeds:
        cg = g1.build(feed, outs1["loss"], cache=False)
        total += cg.backward(outs1["loss"])
    g2, outs2 = m.build_model("lstm", hidden=4, seed=0)
    batch = g2.build_batch(feeds, outs2["loss"], hoist=hoist)
    np.testing.assert_allclose(batch.backward("sum"), total, **TOL)
    for k, p in g1.params.items():
        np.testing.assert_allclose(g2.params[k].grad, p.grad, **TOL, err_msg=k)
    assert list(batch._lockstep.values()) == [True]  # the inputs' loops ran in lockstep
    hoisted = [k for k, _ in batch.groups if k.split(":")[0].endswith("*")]
    assert bool(hoisted) == hoist, batch.groups
    if hoist:  # the four inputs' hoisted products: one product of their inputs concatenated in time
        assert any(k.startswith("MatMul*") and n == 4 for k, n in batch.groups), batch.groups


def test_adaptive_loop_different_trip_counts():
    m = example("adaptive_loop")
    feeds = [m.feed(a) for a in (0.3, 0.9, 2.5, 5.0)]

    def make():
        g, outs = m.build_model(hidden=4, tol=1e-2, max_steps=30, seed=0)
        return g, [outs["loss"]]

    batch = assert_identical(make, feeds, expect_batching=True)
    loop = next(v for v in batch.virtual.nodes if v.kind == "loop")
    counts = [view.trip_count(loop) for view in batch.inputs]
    assert len(set(counts)) > 1  # inputs ran different numbers of iterations, in one batch


def test_routing_branch_different_choices():
    m = example("routing_branch")
    feeds = [m.batch(np.array(xs)) for xs in ([-2.5, 0.1], [2.9], [0.4, -2.0, 2.2], [-0.3])]

    def make():
        g, outs = m.build_model(hidden=4, seed=0)
        return g, [outs["loss"]]

    batch = assert_identical(make, feeds)
    choices = {d.value for view in batch.inputs for d in view.decisions if d.kind == "option"}
    assert len(choices) > 1  # inputs took different branches, in one batch


def test_untied_parameters_and_dropout():
    def make():
        g = vg.VirtualGraph(seed=4)
        x = g.input("x", (None, 3))
        with g.loop(times=3) as L:
            h = L.carry(x, name="h")
            layer = vg.nn.Linear(g, 3, 3, "layer")  # untied per iteration
            L.update(h, vg.nn.Dropout(g, 0.3)(vg.tanh(layer(h))))
        return g, [vg.sum(L.final(h) ** 2)]

    rng = np.random.default_rng(0)
    assert_identical(make, [{"x": rng.normal(size=(n, 3))} for n in (2, 2, 5, 2)])


# ---------------------------------------------------------------------------- random structures


def tree_model():
    g = vg.VirtualGraph(seed=9)
    children = g.input("children", (None, 2))
    words = g.input("words", (None, 3))
    W, U = g.parameter("W", (3, 4)), g.parameter("U", (8, 4))
    with g.recurse(children) as r:
        h = r.state(np.zeros(4), name="h")
        both = vg.concat([r.child(h, 0), r.child(h, 1)], axis=-1)
        r.update(h, vg.tanh(r.step(words) @ W + both @ U))
    return g, [vg.sum(r.final(h) ** 2)]


def random_tree(rng, leaves):
    children = [[-1, -1] for _ in range(leaves)]
    pool = list(range(leaves))
    while len(pool) > 1:
        i, j = sorted(rng.choice(len(pool), 2, replace=False))
        children.append([pool[i], pool[j]])
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [len(children) - 1]
    return np.array(children)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=5), st.integers(0, 1000))
def test_random_trees(leaf_counts, seed):
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        rng = np.random.default_rng(seed)
        feeds = []
        for n in leaf_counts:
            kids = random_tree(rng, n)
            feeds.append({"children": kids, "words": rng.normal(size=(len(kids), 3))})
        assert_identical(tree_model, feeds, expect_batching=len(feeds) > 1)
    finally:
        vg.set_default_dtype(previous)


def branchy():
    g = vg.VirtualGraph(seed=2)
    xs = g.input("xs", (None, 2))
    W = g.parameter("W", (2, 2))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        x = L.step(xs)
        h_new = g.branch(lambda v: int(v.sum() > 0), [vg.tanh(h @ W + x), vg.sigmoid(x @ W - h)], keys=[x])
        L.update(h, h_new)
    return g, [vg.sum(L.final(h) ** 2) + vg.sum(W * W)]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(0, 1000))
def test_random_lengths_and_branch_choices(lengths, seed):
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        rng = np.random.default_rng(seed)
        feeds = [{"xs": rng.normal(size=(T, 2))} for T in lengths]
        assert_identical(branchy, feeds, expect_batching=False)
    finally:
        vg.set_default_dtype(previous)


# ---------------------------------------------------------------------------- per input, errors


def test_per_input_values_gradients_and_decisions():
    g, (loss,) = branchy()
    rng = np.random.default_rng(3)
    feeds = [{"xs": rng.normal(size=(T, 2))} for T in (2, 4, 3)]
    batch = g.build_batch(feeds, loss)
    vg.render.retain_all_grads(batch.graph)
    batch.backward("sum")
    loop = next(v for v in g.nodes if v.kind == "loop")
    h = loop.carries[0]
    for i, feed in enumerate(feeds):
        cg = g.build(feed, loss, cache=False)  # the same model alone (param .grad is not compared)
        vg.render.retain_all_grads(cg)
        cg.backward(loss)
        view = batch.inputs[i]
        assert view.trip_count(loop) == len(feed["xs"])
        h_new = loop.updates[h]
        for t in range(len(feed["xs"])):
            np.testing.assert_allclose(view.value(h_new, (t,)), cg.node(h_new, (t,)).value, **TOL)
            grad = view.gradient(h_new, (t,))
            np.testing.assert_allclose(grad, cg.node(h_new, (t,)).grad, **TOL)
        np.testing.assert_allclose(batch.outputs()[i], cg.outputs[0].value, **TOL)


@pytest.mark.usefixtures("per_node")  # (the op-by-op depth order; test_batch_programs: as a program)
def test_it_batches():
    g, (loss,) = tree_model()
    rng = np.random.default_rng(0)
    feeds = [
        {"children": (k := random_tree(rng, n)), "words": rng.normal(size=(len(k), 3))}
        for n in (5, 6, 5, 7, 4, 6)
    ]
    batch = g.build_batch(feeds, loss)
    alone = sum(len(g.build(f, loss, cache=False, programs=False)) for f in feeds)
    assert len(batch.graph) < alone / 2  # one node per group, not one per input and op
    sizes = [n for _, n in batch.groups]
    assert max(sizes) >= len(feeds) and sum(sizes) / len(sizes) > 2
    # depth order: every leaf of every tree in one group per leaf op (33 leaves in all)
    leaves = sum(int((f["children"][:, 0] < 0).sum()) for f in feeds)
    assert leaves in sizes, batch.groups
    unbatched = g.build_batch(feeds, loss, depth=False)  # one tree node after another per input
    assert leaves not in [n for _, n in unbatched.groups]
    assert len(unbatched.groups) > len(batch.groups)


def test_bad_batches_are_typed_errors_and_change_nothing():
    g, (loss,) = branchy()
    with pytest.raises(ValueError, match="at least one feed"):
        g.build_batch([], loss)
    with pytest.raises(TypeError, match="list of feeds"):
        g.build_batch({"xs": np.ones((2, 2))}, loss)
    with pytest.raises(vg.FeedError, match=r"input 1: input 'xs'"):
        g.build_batch([{"xs": np.ones((2, 2))}, {"xs": np.ones((2, 3))}], loss)

    # one input's build fails half-way: named, and no untied copy is left in the store
    h = vg.VirtualGraph(seed=0)
    xs = h.input("xs", (None, 2))
    c0 = xs[0]
    with h.loop(while_=lambda t, s: 1 / (int(s["c"].sum()) - 3) > -1, max_iters=5, on_limit="stop") as L:
        c = L.carry(c0, name="c")
        V = h.parameter("V", (2, 2))  # untied: V@0, V@1, …
        L.update(c, c + 1.0 + 0 * (c @ V))
    out = vg.sum(L.final(c))
    with pytest.raises(vg.BuildError, match=r"input 1: .*while_ condition raised ZeroDivisionError"):
        h.build_batch([{"xs": np.zeros((1, 2))}, {"xs": np.array([[0.5, 1.0]])}], out)
    assert len(h.params) == 0


def test_eval_mode_records_nothing_for_backward():
    g, (loss,) = branchy()
    g.eval()
    batch = g.build_batch([{"xs": np.ones((2, 2))}, {"xs": -np.ones((3, 2))}], loss)
    assert not batch.loss().requires_grad
    g.train()


def branchy_tree_model(stack_carry=False):
    """A Tree-LSTM-like recursion: leaves and inner nodes computed by different branch options
    (what the depth order must keep apart and still batch). ``stack_carry``: also stack the
    carry itself — each node's value at the start of its iteration, the previous node's state,
    which a depth order cannot give: such a recursion runs node after node."""
    g = vg.VirtualGraph(seed=4)
    children = g.input("children", (None, 2))
    words = g.input("words", (None, 3))
    is_leaf = g.input("is_leaf", (None,))
    W, U, b = g.parameter("W", (3, 4)), g.parameter("U", (8, 4)), g.parameter("b", (4,))
    with g.recurse(children) as r:
        h = r.state(np.zeros(4), name="h")
        leaf = vg.tanh(r.step(words) @ W)
        inner = vg.sigmoid(vg.concat([r.child(h, 0), r.child(h, 1)], axis=-1) @ U + b)
        kind = r.step(is_leaf, name="kind")
        h_new = g.branch(lambda k: 0 if int(k) else 1, [leaf, inner], keys=[kind], name="leaf_or_inner")
        r.update(h, h_new)
    loss = vg.sum(r.final(h) ** 2) + vg.sum(r.stack(h_new) * 0.5)
    if stack_carry:
        loss = loss + vg.sum(r.stack(h))
    return g, [loss]


def tree_feeds(leaf_counts, seed):
    rng = np.random.default_rng(seed)
    feeds = []
    for n in leaf_counts:
        k = random_tree(rng, n)
        feeds.append(
            {"children": k, "words": rng.normal(size=(len(k), 3)), "is_leaf": (k[:, 0] < 0).astype(np.int64)}
        )
    return feeds


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=6), st.integers(0, 1000))
def test_random_trees_with_branches_in_depth_order(leaf_counts, seed):
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        feeds = tree_feeds(leaf_counts, seed)
        with vg.body_programs(False):  # (the op-by-op depth order; test_batch_programs: as a program)
            batch = assert_identical(branchy_tree_model, feeds, expect_batching=sum(leaf_counts) > 1)
        assert list(batch._depth_ok.values()) == [True] and list(batch._joint.values()) == [True]
        if sum(leaf_counts) > 1:  # every leaf of every tree in one group (the leaf option's ops)
            assert ("MatMul:1", sum(leaf_counts)) in batch.groups, batch.groups
    finally:
        vg.set_default_dtype(previous)


def test_a_recursion_that_stacks_its_carry_runs_node_after_node():
    feeds = tree_feeds([2, 3, 1], 5)
    batch = assert_identical(lambda: branchy_tree_model(stack_carry=True), feeds)
    assert list(batch._depth_ok.values()) == [False]


def test_depth_order_with_a_greenlet_per_tree_node(monkeypatch):
    """The depth order without the scheduler's joint run (used when a recursion's body holds
    more than ops and branches): each tree node in a greenlet of its own; same results."""
    from vgraph.virtual.batch import BatchedBuild

    monkeypatch.setattr(BatchedBuild, "_joint_ok", lambda self, loop: False)
    batch = assert_identical(branchy_tree_model, tree_feeds([3, 1, 4, 2], 8))
    assert list(batch._depth_ok.values()) == [True] and ("MatMul:1", 10) in batch.groups


@pytest.mark.usefixtures("per_node")  # (the op-by-op paths of a batched build)
def test_loops_without_lockstep(monkeypatch):
    """Loops run by each input's greenlet, op by op (the scheduler's agenda keeps them in step):
    the same results and groups as in lockstep."""
    from vgraph.virtual.batch import BatchedBuild

    m = example("lstm_sequence")
    rng = np.random.default_rng(3)
    feeds = []
    for T in (4, 2, 4):
        x, y = m.adding_batch(rng, 2, T)
        feeds.append({"x": x, "y": y, "h0": np.zeros((2, 4))})

    def make():
        g, outs = m.build_model("gru", hidden=4, seed=0)
        return g, [outs["loss"]]

    lockstep = assert_identical(make, feeds)
    monkeypatch.setattr(BatchedBuild, "_lockstep_ok", lambda self, loop: False)
    plain = assert_identical(make, feeds)
    assert sorted(lockstep.groups) == sorted(plain.groups)


def tagger_model():
    """A small sequence tagger: embedding, a tanh RNN, a per-word output layer and cross-entropy
    over the sentence — its ops outside the loop see whole sentences of different lengths."""
    g = vg.VirtualGraph(seed=6)
    tokens = g.input("tokens", (None,))
    tags = g.input("tags", (None,))
    emb = vg.nn.Embedding(g, 20, 3, "emb")
    out = vg.nn.Linear(g, 4, 5, "out")
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4))
    embedded = emb(tokens)  # (T, 3)
    with g.loop() as L:
        h = L.carry(np.zeros((1, 4)), name="h")
        h_new = vg.tanh(L.step(embedded) @ W + h @ U)  # (1, 4)
        L.update(h, h_new)
    logits = out(vg.tanh(L.stack(h_new).reshape(-1, 4)))  # (T, 5)
    return g, [vg.losses.cross_entropy(logits, tags) + vg.mean(logits) * 0.1]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=6), st.integers(0, 1000))
def test_whole_sentences_of_different_lengths_run_as_one_op(lengths, seed):
    """Ops that act on each word alone (the output layer, tanh, log-softmax, the embedding
    lookup) run once on every sentence's words concatenated, and so do reductions over the
    sentence (``mean``: one sum per sentence's rows). Identical to one at a time."""
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        rng = np.random.default_rng(seed)
        feeds = [{"tokens": rng.integers(0, 20, n), "tags": rng.integers(0, 5, n)} for n in lengths]
        batch = assert_identical(tagger_model, feeds)
        sizes = dict(batch.groups)
        # one group, whatever the lengths (cross_entropy is one fused op)
        assert sizes.get("SoftmaxCrossEntropy:1") == len(feeds), batch.groups
        assert sizes.get("Take:1") == len(feeds), batch.groups
        assert sizes.get("Linear:1") == len(feeds), batch.groups  # nn.Linear's fused node, too
        assert sizes.get("Reshape:1") == len(feeds), batch.groups  # (T, 1, 4) -> (T, 4): rows stay rows
        # a reduction over each sentence: one reduction of each sentence's rows of the concatenation
        assert [n for k, n in batch.groups if k == "Mean:2"] == [len(feeds)], batch.groups
    finally:
        vg.set_default_dtype(previous)


def test_a_checkpointed_loop_is_a_typed_error():
    g = vg.VirtualGraph(seed=1)
    xs = g.input("xs", (None, 2))
    W = g.parameter("W", (2, 2))
    with g.loop(checkpoint=2) as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, vg.tanh(h @ W + L.step(xs)))
    with pytest.raises(vg.BuildError, match=r"input 0: <Loop:1> is checkpointed .* one at a time"):
        g.build_batch([{"xs": np.ones((3, 2))}, {"xs": np.ones((4, 2))}], vg.sum(L.final(h)))
    assert len(g.params) == 1


def conditional_model(kind):
    """A loop whose trip count each input's values decide: ``while_`` (checked before each
    iteration), ``until`` (after it), or a ``while_`` capped by ``max_iters`` (on_limit="stop")."""
    g = vg.VirtualGraph(seed=3)
    a = g.input("a", (1, 2))
    W = g.parameter("W", (2, 2))
    cond = (lambda t, s: float(np.abs(s["z"]).sum()) < 3.0) if kind != "until" else None
    until = (lambda t, s: float(np.abs(s["z"]).sum()) >= 3.0) if kind == "until" else None
    limit = {"max_iters": 4, "on_limit": "stop"} if kind == "capped" else {"max_iters": 50}
    with g.loop(while_=cond, until=until, name="grow", **limit) as L:
        z = L.carry(a, name="z")
        L.update(z, z + 0.3 * vg.tanh(z @ W) ** 2 + 0.1)  # grows: every input stops
    return g, [vg.sum(L.final(z) ** 2)]


@settings(max_examples=10, deadline=None, derandomize=True)
@given(st.sampled_from(["while", "until", "capped"]), st.lists(st.floats(-1.5, 1.5), min_size=2, max_size=6))
def test_conditional_loops_in_lockstep(kind, starts):
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        feeds = [{"a": np.array([[s, -0.5 * s]])} for s in starts]
        batch = assert_identical(lambda: conditional_model(kind), feeds, expect_batching=False)
        assert list(batch._lockstep.values()) == [True]
    finally:
        vg.set_default_dtype(previous)


def test_indexes_on_sentences_of_different_lengths():
    """``x[:, k]`` and ``x[..., None]`` leave axis 0 alone: one op for every sentence; an
    integer-array index (``x[[0, 0]]``) picks rows of each sentence: per sentence. Identical."""

    def make():
        g = vg.VirtualGraph(seed=0)
        x = g.input("x", (None, 3))
        W = g.parameter("W", (3, 3))
        h = x @ W
        y = h[:, 1] * 2 + vg.sum(h[..., None]) + vg.sum(h[np.array([0, 0])])
        return g, [vg.sum(y**2)]

    rng = np.random.default_rng(0)
    batch = assert_identical(make, [{"x": rng.normal(size=(n, 3))} for n in (2, 5, 3)])
    sizes = {}
    for k, n in batch.groups:
        sizes.setdefault(k, []).append(n)
    assert sizes["GetItem:1"] == [3] and sizes["GetItem:2"] == [3] and sizes["GetItem:3"] == [1, 1, 1]


def test_every_op_declared_elementwise_runs_on_sentences_of_different_lengths():
    """What runs as one op follows the ops' declared kinds (vgraph.ops.KINDS): every elementwise
    op (maximum, clip, sqrt, where, …), and reductions over another axis than the sentence's
    (min, var, argmax) batch across sentences; identical to one at a time."""

    def make():
        g = vg.VirtualGraph(seed=0)
        x = g.input("x", (None, 3))
        W = g.parameter("W", (3, 3))
        h = x @ W
        e = vg.sqrt(vg.clip(vg.maximum(h, -h * 0.5), 0.1, 3.0)) + vg.minimum(h, 0.2)
        e = vg.where(vg.step(h), e, vg.abs(h)) * vg.sign(h) * vg.step(h + 1)
        m = vg.min(e, axis=1) + vg.var(e, axis=1) + vg.argmax(e, axis=1)
        return g, [vg.sum(m**2) + vg.sum(e)]

    rng = np.random.default_rng(0)
    batch = assert_identical(make, [{"x": rng.normal(size=(n, 3))} for n in (2, 5, 3)])
    sizes = {}
    for k, n in batch.groups:
        sizes.setdefault(k.split(":")[0], []).append(n)
    for op in ("Maximum", "Minimum", "Clip", "Sqrt", "Where", "Sign", "Step", "Abs"):  # rows concatenated
        assert sizes[op] == [3] * len(sizes[op]), (op, batch.groups)


@pytest.mark.parametrize("reduction", ["min", "var", "argmax", "max"])
def test_reductions_of_equally_shaped_inputs_run_as_one_op(reduction):
    """A reduction's axis moves by one on inputs stacked along a new axis (its declared kind)."""

    def make():
        g = vg.VirtualGraph(seed=0)
        x = g.input("x", (2, 3))
        W = g.parameter("W", (3, 3))
        h = x @ W
        f = {"min": vg.min, "var": vg.var, "argmax": vg.argmax, "max": vg.max}[reduction]
        rows = f(h, axis=1)  # one axis: moved by one
        whole = (
            f(h) if reduction != "argmax" else vg.sum(h) + f(h)
        )  # every axis: a tuple (argmax: flat, per input)
        return g, [vg.sum(h * h) + vg.sum(rows) + whole]

    rng = np.random.default_rng(1)
    batch = assert_identical(make, [{"x": rng.normal(size=(2, 3))} for _ in range(3)])
    name = {"min": "Min", "var": "Var", "argmax": "ArgMax", "max": "Max"}[reduction]
    assert [n for k, n in batch.groups if k == name + ":1"] == [3], batch.groups
    whole = [n for k, n in batch.groups if k == name + ":2"]
    assert whole == ([1, 1, 1] if reduction == "argmax" else [3]), batch.groups  # argmax: one axis only


# ---------------------------------------------------------------------------- memory


def cyclic_garbage(run):
    """The objects that ``run()`` leaves for the cyclic garbage collector (reference cycles)."""
    import gc

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return garbage


def _tagger_run():
    rng = np.random.default_rng(0)
    g, outs = tagger_model()
    feeds = [{"tokens": rng.integers(0, 20, n), "tags": rng.integers(0, 5, n)} for n in (3, 5, 2)]
    return g, outs, feeds


@pytest.mark.parametrize("joint", [True, False], ids=["joint-trees", "greenlet-per-tree-node"])
def test_batched_builds_leave_no_reference_cycles(joint, monkeypatch):
    """A batched build, its backward and an update are freed by reference counting: tens of
    thousands of objects per build would otherwise wait for (and slow down) the cyclic collector."""
    from vgraph.virtual.batch import BatchedBuild

    if not joint:
        monkeypatch.setattr(BatchedBuild, "_joint_ok", lambda self, loop: False)
    models = [_tagger_run(), (*branchy_tree_model(), tree_feeds([3, 1, 4], 2))]
    for g, outs, feeds in models:
        opt = vg.optim.Adam(g.params)

        def step(g=g, outs=outs, feeds=feeds, opt=opt):
            batch = g.build_batch(feeds, outs)
            opt.zero_grad()
            batch.backward("mean")
            opt.step()

        step()  # optimiser state, caches
        garbage = cyclic_garbage(step)
        assert not garbage, sorted({type(o).__name__ for o in garbage})


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_builds_of_the_example_models_leave_no_reference_cycles(script):
    module = load(script)
    g, feed, outputs = module.build(seed=0)

    def step():
        cg = g.build(feed, outputs, cache=False)
        cg.backward(outputs[0])

    step()
    garbage = cyclic_garbage(step)
    assert not garbage, sorted({type(o).__name__ for o in garbage})


def test_an_input_view_needs_its_batch():
    g, outs, feeds = _tagger_run()
    batch = g.build_batch(feeds, outs)
    view = batch.inputs[1]
    assert view.batch is batch and view.trip_count(_loop_of(g)) == 5
    del batch
    with pytest.raises(vg.GraphStateError, match="input 1's batched build is gone"):
        view.batch  # noqa: B018
    assert view.trip_count(_loop_of(g)) == 5  # what the view keeps of its own still reads


def _loop_of(g):
    return next(v for v in g.nodes if isinstance(v, vg.LoopNode))


def test_rows_of_lockstep_loops_have_the_keys_of_the_unrolled_nodes():
    """A lockstep loop's rows make their keys only when read; each is the key the input's own
    unrolled graph gives that node in that iteration."""
    from vgraph.virtual.batch import Row

    g, outs, feeds = _tagger_run()
    batch = g.build_batch(feeds, outs)
    checked = 0
    for i, view in enumerate(batch.inputs):
        alone = batch.unrolled(i)
        for (scope, idx), env in view._envs.items():
            if scope is None:
                continue
            for v, row in env.items():
                if type(row) is Row and row._key is None:
                    assert row.key == alone.node(v, idx).key == (v.type, v.id, idx)
                    assert row._key is row.key  # made once
                    checked += 1
    assert checked > 20


@pytest.mark.parametrize("axis", [None, 0])
def test_a_float32_mean_over_inputs_of_different_lengths_stays_float32(axis):
    """A mean over sentences of different lengths runs as one segment reduction of their
    concatenation; its values and gradients keep the model's float32 (dividing by the integer
    lengths once made them float64, and every gradient upstream with them)."""
    g = vg.VirtualGraph(dtype=np.float32, seed=0)
    xs = g.input("xs", (None, 3))
    W = g.parameter("W", (3, 2))
    loss = vg.sum(vg.mean(vg.tanh(xs @ W), axis=axis))
    rng = np.random.default_rng(0)
    feeds = [{"xs": rng.standard_normal((n, 3)).astype(np.float32)} for n in (2, 3, 5)]
    batch = g.build_batch(feeds, [loss])
    assert any(n.op is not None and n.op.name == "SegmentSum" for n in batch.graph.nodes())
    assert all(np.asarray(batch.inputs[i].outputs[0].value).dtype == np.float32 for i in range(3))
    vg.render.retain_all_grads(batch.graph)
    batch.backward("mean")
    assert g.params["W"].grad.dtype == np.float32
    for n in batch.graph.nodes():  # every value and gradient of the batched graph
        for x in (n.value, n.grad):
            assert not isinstance(x, np.ndarray) or x.dtype == np.float32, n
    alone = []
    for f in feeds:
        cg = g.build(f, [loss])
        alone.append(cg.outputs[0].value)
    np.testing.assert_allclose(batch.outputs(0), alone, rtol=1e-6)
