"""Elastic structures (vgraph.virtual.elastic): a cached graph resized to another sequence length.

Identity: a sequence of builds of varying lengths with the cache gives the same losses, gradients,
decisions, node keys (in creation order), iteration look-ups and outputs as the same builds without
it (float64, 1e-12), with tapes on and off, on hand-made models covering what resizing rewires
(stacks, reversed steps, a loop reading another's final, a loop stepping through another's stack,
loops of independent lengths, loops nested in a loop of fixed trip count, hoisting on and off), on
the example models and the dynamic benchmark's language model, and on random ones (hypothesis); a
graph is resized, not unrolled again, whenever the length is one it has the blocks for, and a
resized graph renders as a fresh build does.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hoist import load, loop_bodies, loop_body_model

import vgraph as vg
from vgraph.tape import set_tapes
from vgraph.virtual import UnrolledGraph
from vgraph.virtual.elastic import Elastic

pytestmark = pytest.mark.usefixtures("per_node")  # tests/conftest.py: of the per-node path

ROOT = Path(__file__).resolve().parent.parent


def model(reverse=False, stack=False, second=None, out_final=False):
    """An RNN over ``xs``; ``stack``: the loss reads every step's state against per-step targets
    ``ys``; ``second``: a second top-level loop, ``"reads"`` (steps ``xs`` again, capturing the
    first loop's final and starting from it) or ``"layer"`` (steps through the first's stack)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4))
    V = g.parameter("V", (4, 4))
    with g.loop(name="first") as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        x = L.step(xs, reverse=reverse)
        h_new = vg.tanh(x @ W + h @ U)
        L.update(h, h_new)
    hs = L.stack(h_new) if stack or second == "layer" else None
    final = L.final(h)
    loss = vg.sum(final**2)
    if stack:
        ys = g.input("ys", (None, 2, 4))
        loss = loss + vg.sum((hs - ys) ** 2)
    if second == "reads":
        with g.loop(name="second") as M:
            c = M.carry(final, name="c")
            x2 = M.step(xs, reverse=not reverse)
            M.update(c, vg.tanh(x2 @ W + c @ V + final))
        loss = loss + vg.sum(M.final(c) ** 3)
    elif second == "other":  # another sequence, of its own length
        zs = g.input("zs", (None, 2, 3))
        with g.loop(name="other") as M:
            c = M.carry(np.zeros((2, 4)), name="c")
            M.update(c, vg.tanh(M.step(zs) @ W + c @ V))
        loss = loss + vg.sum(M.final(c) * final)
    elif second == "layer":
        with g.loop(name="layer2") as M:
            c = M.carry(final, name="c")
            M.update(c, vg.tanh(M.step(hs) @ V + c @ U))
        loss = loss + vg.sum(M.final(c) ** 2)
    return g, ([loss, final] if out_final else loss)


def feed(T, rng, stack, other=None):
    """A feed of length ``T`` (and ``other`` for the second sequence of ``second="other"``)."""
    f = {"xs": rng.normal(size=(T, 2, 3))}
    if other is not None:
        f["zs"] = rng.normal(size=(other, 2, 3))
    if stack:
        f["ys"] = rng.normal(size=(T, 2, 4))
    return f


def run(g, outputs, f, cache, hoist=True):
    cg = g.build(f, outputs, cache=cache, hoist=hoist)
    steps = {str(k): np.array(n.value) for k, n in cg._nodes.items() if n.key.idx}
    g.params.zero_grad()
    value = cg.backward(cg.outputs[0])
    return cg, {
        "value": value,
        "outputs": [np.array(o.value) for o in cg.outputs],
        "grads": {k: np.array(p.grad) for k, p in g.params.items() if p.grad is not None},
        "decisions": [(d.node.describe(), d.idx, d.kind, d.value) for d in cg.decisions],
        "keys": [str(k) for k in cg._nodes],
        "steps": steps,
        # what cg.node(vnode, idx) finds, in the order the build made it; the hoisted groups
        "envs": [
            (scope and scope.describe(), idx, sorted((v.describe(), str(n.key)) for v, n in env.items() if n))
            for (scope, idx), env in cg._envs.items()
        ],
        "groups": {str(g.key): [str(c.key) for c in cs] for g, cs in cg._groups.items()},
    }


def same(a, b):
    assert a["decisions"] == b["decisions"]
    assert a["keys"] == b["keys"]
    assert a["envs"] == b["envs"]
    assert a["groups"] == b["groups"]
    np.testing.assert_allclose(a["value"], b["value"], rtol=1e-12)
    for x, y in zip(a["outputs"], b["outputs"]):
        np.testing.assert_allclose(x, y, rtol=1e-12)
    assert a["grads"].keys() == b["grads"].keys()
    for k in a["grads"]:
        np.testing.assert_allclose(a["grads"][k], b["grads"][k], rtol=1e-12, atol=1e-14)
    assert a["steps"].keys() == b["steps"].keys()
    for k in a["steps"]:
        np.testing.assert_allclose(a["steps"][k], b["steps"][k], rtol=1e-12, atol=1e-14)


LENGTHS = [5, 3, 6, 2, 4, 6, 3, 5]
CASES = {
    "plain": {},
    "reversed": {"reverse": True},
    "stack": {"stack": True},
    "reads": {"second": "reads"},
    "reversed reads": {"second": "reads", "reverse": True, "stack": True},
    "layer": {"second": "layer"},
    "final output": {"out_final": True, "stack": True},
}


@pytest.fixture
def resizes(monkeypatch):
    """The lengths every resize of a cached graph went to whose replay then succeeded (a resize
    followed by a failed replay falls back to a fresh build, which the identity tests alone would
    not notice)."""
    done, pending = [], []
    resize, replay = Elastic.resize, UnrolledGraph._replay

    def counted(self, cg, values):
        before = list(self.lengths)
        ok = resize(self, cg, values)
        if ok and self.lengths != before:
            pending.append(list(self.lengths))
        return ok

    def replayed(self, values, seed, **options):
        lengths = list(pending)
        pending.clear()
        replay(self, values, seed, **options)  # if it raises, the resize does not count
        done.extend(lengths)

    monkeypatch.setattr(Elastic, "resize", counted)
    monkeypatch.setattr(UnrolledGraph, "_replay", replayed)
    return done


@pytest.mark.parametrize("tapes", [True, False], ids=["tapes", "no-tapes"])
@pytest.mark.parametrize("hoist", [True, False], ids=["hoist", "plain"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_resized_builds_equal_fresh_builds(case, hoist, tapes, resizes):
    kw = CASES[case]
    results = []
    set_tapes(tapes)
    try:
        for cache in (True, False):
            g, outputs = model(**kw)
            rng = np.random.default_rng(1)
            results.append([run(g, outputs, feed(T, rng, kw.get("stack")), cache, hoist)[1] for T in LENGTHS])
    finally:
        set_tapes(True)
    for a, b in zip(*results):
        same(a, b)
    # 5, 3 unroll (the second is cached), 6 unrolls (longer), then every build is a resize
    assert [r[0] for r in resizes] == LENGTHS[3:]


def test_a_new_length_resizes_the_cached_graph_and_only_a_longer_one_unrolls():
    g, loss = model(stack=True)
    rng = np.random.default_rng(0)
    g.build(feed(5, rng, True), loss)  # first sighting: not kept
    cg = g.build(feed(6, rng, True), loss)  # the structure (any length) seen before: kept
    node = cg.node("Tanh:1@1")
    for T in (3, 6, 2, 4):
        cg = g.build(feed(T, rng, True), loss)
        assert cg.node("Tanh:1@1") is node  # resized: the same node objects
        assert cg.trip_count(cg.decisions[0].node) == T
        assert len(cg.node("Stack:1").parents) == T
        with pytest.raises(vg.VGraphError, match="no node"):
            cg.node(f"Tanh:1@{T}")
    longer = g.build(feed(8, rng, True), loss)  # more steps than any before: unrolled
    assert longer.node("Tanh:1@1") is not node
    node = longer.node("Tanh:1@1")
    shorter = g.build(feed(4, rng, True), loss)  # and from then on resized from the longer one
    assert shorter.node("Tanh:1@1") is node


def test_a_node_past_the_new_length_is_not_a_node_of_the_resized_graph():
    g, loss = model()
    rng = np.random.default_rng(0)
    for T in (6, 6):
        cg = g.build(feed(T, rng, False), loss)
    late = cg.node("Tanh:1@5")
    cg = g.build(feed(3, rng, False), loss)
    with pytest.raises(vg.VGraphError, match="no node <Tanh:1@5>"):
        cg.node("Tanh:1@5")
    with pytest.raises(vg.GraphStateError, match="not a node of this graph"):
        cg.backward(late)
    assert "Tanh:1@5" not in cg and "Tanh:1@2" in cg


def test_a_loop_whose_body_branches_is_unrolled_afresh_for_a_new_length():
    def branchy():
        g = vg.VirtualGraph(dtype=np.float64, seed=2)
        xs = g.input("xs", (None, 2))
        W = g.parameter("W", (2, 2))
        with g.loop() as L:
            h = L.carry(np.zeros(2), name="h")
            x = L.step(xs)
            y = g.branch(lambda v: int(v.sum() > 0), [vg.tanh(x @ W + h), (x @ W) * h], keys=[x])
            L.update(h, y)
        return g, vg.sum(L.final(h) ** 2)

    results = []
    for cache in (True, False):
        g, loss = branchy()
        rng = np.random.default_rng(4)
        results.append([run(g, loss, {"xs": rng.normal(size=(T, 2))}, cache) for T in LENGTHS])
    for (cg, a), (_, b) in zip(*results):
        same(a, b)
        assert cg._elastic is None  # its body decides: cached by exact shapes only


def test_nodes_added_to_a_built_graph_stop_it_resizing():
    g, loss = model()
    rng = np.random.default_rng(0)
    for T in (6, 6):
        cg = g.build(feed(T, rng, False), loss)
    extra = vg.tanh(cg.outputs[0])  # an op on a built graph's node joins that graph
    assert extra.graph is cg
    node = cg.node("Tanh:1@1")
    cg = g.build(feed(3, rng, False), loss)
    assert cg.node("Tanh:1@1") is not node  # unrolled afresh
    g2, loss2 = model()
    fresh = g2.build(feed(3, np.random.default_rng(0), False), loss2, cache=False)
    assert [str(k) for k in cg._nodes] == [str(k) for k in fresh._nodes]


def test_inconsistent_lengths_fail_as_an_uncached_build_does_and_change_nothing():
    def two_inputs():
        g = vg.VirtualGraph(dtype=np.float64, seed=2)
        a = g.input("a", (None, 2))
        b = g.input("b", (None, 2))
        ab = a + b
        with g.loop() as L:
            h = L.carry(np.zeros(2), name="h")
            L.update(h, vg.tanh(L.step(ab) + h))
        return g, vg.sum(L.final(h))

    g, loss = two_inputs()
    ok = {"a": np.ones((4, 2)), "b": np.ones((4, 2))}
    for _ in range(2):
        g.build(ok, loss)
    bad = {"a": np.ones((3, 2)), "b": np.ones((4, 2))}
    g_ref, loss_ref = two_inputs()
    with pytest.raises(vg.VGraphError) as expected:
        g_ref.build(bad, loss_ref, cache=False)
    with pytest.raises(type(expected.value)):
        g.build(bad, loss)
    again = g.build({"a": np.full((3, 2), 0.5), "b": np.full((3, 2), 0.5)}, loss)
    ref = g_ref.build({"a": np.full((3, 2), 0.5), "b": np.full((3, 2), 0.5)}, loss_ref, cache=False)
    np.testing.assert_allclose(again.forward(), ref.forward(), rtol=1e-12)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 7), min_size=2, max_size=8),
    st.sampled_from(list(CASES)),
    st.booleans(),
)
def test_random_lengths_resized_equal_fresh(lengths, case, hoist):
    kw = CASES[case]
    results = []
    for cache in (True, False):
        g, outputs = model(**kw)
        rng = np.random.default_rng(len(lengths))
        results.append([run(g, outputs, feed(T, rng, kw.get("stack")), cache, hoist)[1] for T in lengths])
    for a, b in zip(*results):
        same(a, b)


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_model_scripts_at_varying_lengths_cached_equal_uncached(script):
    module = load(script)
    size = "steps" if "steps" in inspect.signature(module.build).parameters else "leaves"
    results = []
    for cache in (True, False):
        g, _, outputs = module.build(seed=0)
        feeds = [module.build(**{size: n, "seed": k})[1] for k, n in enumerate([5, 3, 6, 2, 4, 6])]
        results.append([run(g, outputs[0], f, cache)[1] for f in feeds])
    for a, b in zip(*results):
        same(a, b)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_a_language_model_over_sentences_of_many_lengths_cached_equal_uncached(fused, resizes):
    """The dynamic benchmark's LSTM language model, small: an embedded token sequence stepped
    through (the length guessed from the tokens), per-step targets of length T·B, the stack
    flattened with reshape(-1, H) after the loop, cross-entropy."""
    V, E, H, B = 11, 3, 4, 2

    def lm():
        g = vg.VirtualGraph(dtype=np.float64, seed=5)
        tokens = g.input("tokens", (None, None))
        targets = g.input("targets", (None,))
        emb = vg.nn.Embedding(g, V, E, "emb")
        cell = vg.nn.LSTMCell(g, E, H, "lstm", fused=fused)
        out = vg.nn.Linear(g, H, V, "out")
        embedded = emb(tokens)
        with g.loop(name="time") as L:
            h, c = L.carry(np.zeros((B, H)), name="h"), L.carry(np.zeros((B, H)), name="c")
            h_new, c_new = cell(L.step(embedded), (h, c))
            L.update(h, h_new)
            L.update(c, c_new)
        hs = L.stack(h_new).reshape(-1, H)
        return g, vg.losses.cross_entropy(out(hs), targets)

    results = []
    for cache in (True, False):
        g, loss = lm()
        rng = np.random.default_rng(9)
        feeds = [
            {"tokens": rng.integers(0, V, size=(T, B)), "targets": rng.integers(0, V, size=T * B)}
            for T in LENGTHS
        ]
        results.append([run(g, loss, f, cache)[1] for f in feeds])
    for a, b in zip(*results):
        same(a, b)
    assert [r[0] for r in resizes] == LENGTHS[3:]


def test_a_resized_graph_renders_as_a_fresh_build_of_its_length():
    from vgraph.render import to_dot

    g, loss = model(stack=True, second="reads")
    rng = np.random.default_rng(0)
    for T in (6, 6, 3):
        cg = g.build(feed(T, rng, True), loss)
    g_ref, loss_ref = model(stack=True, second="reads")
    fresh = g_ref.build(feed(3, rng, True), loss_ref, cache=False)
    assert cg.trip_count(cg.decisions[0].node) == 3
    assert to_dot(cg) == to_dot(fresh)


def test_loops_inside_a_loop_of_fixed_trip_count_are_resized(resizes):
    """The example stacked RNN: a ``times=2`` loop over layers, each stepping through the previous
    layer's stack (the first through the input); both inner loops are resized together."""
    module = load(ROOT / "examples" / "models" / "stacked_rnn.py")
    results = []
    for cache in (True, False):
        g, _, outputs = module.build(seed=0)
        feeds = [module.build(steps=n, seed=k)[1] for k, n in enumerate(LENGTHS)]
        results.append([run(g, outputs[0], f, cache)[1] for f in feeds])
    for a, b in zip(*results):
        same(a, b)
    assert resizes == [[n, n] for n in LENGTHS[3:]]


def test_loops_of_independent_lengths_resize_each_way(resizes):
    """Two loops over two sequences: from one build to the next the first gets longer while the
    second gets shorter, and the other way round (the node list is changed in place)."""
    pairs = [(6, 6), (6, 6), (3, 5), (5, 2), (2, 6), (6, 2), (4, 4), (2, 3)]
    results = []
    for cache in (True, False):
        g, loss = model(second="other", stack=True)
        rng = np.random.default_rng(3)
        results.append([run(g, loss, feed(a, rng, True, b), cache)[1] for a, b in pairs])
    for a, b in zip(*results):
        same(a, b)
    assert resizes == [list(p) for p in pairs[2:]]


def test_a_stepping_loop_that_cannot_resize_is_cached_from_its_second_build_as_before():
    """Its length comes from no input (it steps through a parameter): the analysis says no, and
    the graph is kept by its exact shapes from the second build on."""
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    x = g.input("x", (2, 3))
    P = g.parameter("P", (4, 2, 3))
    with g.loop() as L:
        h = L.carry(np.zeros((2, 3)), name="h")
        L.update(h, vg.tanh(L.step(P) + h * x))
    loss = vg.sum(L.final(h))
    first = g.build({"x": np.ones((2, 3))}, loss)
    second = g.build({"x": np.ones((2, 3))}, loss)
    assert second._elastic is None and first.node("Tanh:1@2") is not second.node("Tanh:1@2")
    node = second.node("Tanh:1@2")
    assert g.build({"x": np.zeros((2, 3))}, loss).node("Tanh:1@2") is node  # replayed


@settings(max_examples=40, deadline=None, derandomize=True)
@given(loop_bodies(), st.lists(st.integers(1, 7), min_size=4, max_size=8, unique=True), st.booleans())
def test_random_loop_bodies_at_random_lengths_cached_equal_uncached(body, lengths, hoist):
    """test_hoist's random loop bodies (stepped input, carry, captured weights, random unary and
    binary ops, a stack and a final; without its ``times=``, which is not elastic) built at a
    random sequence of different lengths with the cache and without."""
    body = (body[0], None, *body[2:])
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    try:
        results = []
        for cache in (True, False):
            g, loss, _ = loop_body_model(body)
            rng = np.random.default_rng(len(lengths))
            results.append(
                [run(g, loss, {"xs": rng.normal(size=(T, 2, 3))}, cache, hoist)[1] for T in lengths]
            )
        for a, b in zip(*results):
            same(a, b)
    finally:
        vg.set_default_dtype(previous)


def test_blocks_left_out_keep_no_values():
    """A resized graph holds the values of its own length, not of the longest feed seen: the blocks
    left out drop theirs (and with them any view of an old hoisted group's value); taken back by
    a longer feed, they are computed again (the identity tests above check the values)."""
    g, loss = model(stack=True)
    rng = np.random.default_rng(0)
    for T in (40, 40, 5):
        cg = g.build(feed(T, rng, True), loss)
    blocks = cg._elastic.traces[0].blocks
    assert all(n._value is None for block in blocks[5:] for n in block)
    assert all(n._value is not None or cg.computed_when_read(n) for block in blocks[:5] for n in block)
    again = g.build(feed(7, rng, True), loss)
    g_ref, loss_ref = model(stack=True)
    ref = g_ref.build(feed(7, np.random.default_rng(99), True), loss_ref, cache=False)
    assert [str(k) for k in again._nodes] == [str(k) for k in ref._nodes]
    assert all(n.value is not None for n in again._nodes.values())


def test_a_block_taken_back_is_computed_again_even_where_its_inputs_did_not_change():
    """A body node that reads only a parameter (``hoist=False`` keeps it in the loop) has no input
    newer than its old value when its block is taken back: it must be computed all the same."""

    def scaled():
        g = vg.VirtualGraph(dtype=np.float64, seed=4)
        xs = g.input("xs", (None, 2))
        W = g.parameter("W", (2,))
        with g.loop() as L:
            h = L.carry(np.zeros(2), name="h")
            L.update(h, vg.tanh(L.step(xs) + h * (W * 2.0)))
        return g, vg.sum(L.final(h) ** 2)

    results, kept = [], []
    for cache in (True, False):
        g, loss = scaled()
        rng = np.random.default_rng(6)
        seen, nodes = [], []
        for T in (6, 6, 3, 6):
            cg, result = run(g, loss, {"xs": rng.normal(size=(T, 2))}, cache, False)
            seen.append(result)
            nodes.append(cg.node("Mul:1@1"))
        results.append(seen)
        kept.append(nodes)
    for a, b in zip(*results):
        same(a, b)
    assert kept[0][1] is kept[0][2] is kept[0][3]  # resized and replayed, not unrolled afresh


def test_a_layer_starting_from_the_previous_layers_final_state_resizes(resizes):
    """Stacked layers where each starts from the previous layer's final state: the environments of
    one instance of the inner loop hold another instance's final carry (re-pointed too)."""

    def layered():
        g = vg.VirtualGraph(dtype=np.float64, seed=8)
        xs = g.input("xs", (None, 2, 3))
        W = g.parameter("W", (3, 3))
        U = g.parameter("U", (3, 3))
        with g.loop(times=2, name="layers") as layers:
            seq = layers.carry(xs, name="seq")
            start = layers.carry(np.zeros((2, 3)), name="start")
            with g.loop(name="time") as time:
                h = time.carry(start, name="h")
                h_new = vg.tanh(time.step(seq) @ W + h @ U)
                time.update(h, h_new)
            layers.update(seq, time.stack(h_new))
            layers.update(start, time.final(h))
        return g, vg.sum(layers.final(seq) ** 2) + vg.sum(layers.final(start))

    results = []
    for cache in (True, False):
        g, loss = layered()
        rng = np.random.default_rng(2)
        results.append([run(g, loss, {"xs": rng.normal(size=(T, 2, 3))}, cache)[1] for T in LENGTHS])
    for a, b in zip(*results):
        same(a, b)
    assert resizes == [[n, n] for n in LENGTHS[3:]]


@pytest.mark.parametrize("kept", [32, 2])
def test_lengths_resized_to_again_reuse_their_tapes(monkeypatch, resizes, kept):
    """A resize to a length seen before takes that length's joined tapes (and its length check and
    decision) as made then, instead of joining them again; only the last ``RETAPED`` lengths are
    kept (least recently used dropped first), and a length dropped is joined again. Every build
    equals an uncached one."""
    monkeypatch.setattr(Elastic, "RETAPED", kept)
    lengths = [5, 3, 6, 3, 5, 3, 2, 5, 3, 4, 3]  # 5, 3 and 6 unroll; every later build resizes
    results, tapes = [], []
    for cache in (True, False):
        g, outputs = model(second="reads", stack=True)
        rng = np.random.default_rng(4)
        results.append([])
        for T in lengths:
            cg, res = run(g, outputs, feed(T, rng, True), cache)
            results[-1].append(res)
            if cache and len(resizes) > len(tapes):
                tapes.append((T, cg._replay_tape))
                assert cg.decisions[cg._elastic.traces[0].decision].value == T
    for a, b in zip(*results):
        same(a, b)
    assert [T for T, _ in tapes] == lengths[3:]
    # which resizes found their length's tapes: least recently used dropped beyond ``kept``
    recent: list[int] = []
    last: dict[int, object] = {}
    for T, tape in tapes:
        assert (tape is last.get(T)) == (T in recent), (T, recent)
        recent = [*(t for t in recent if t != T), T][-kept:]
        last[T] = tape
