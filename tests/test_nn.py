"""nn building blocks against hand-written numpy, gradchecks over unrolled loops, and TBPTT."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import chunk_feeds, chunks, truncated_bptt

I, H, B = 3, 4, 2


def sig(z):
    return 1.0 / (1.0 + np.exp(-z))


def P(g, name):
    return g.params[name].value


# --- hand-written numpy cells -----------------------------------------------------------------


def np_lstm(x, h, c, Wx, Wh, b):
    z = x @ Wx + h @ Wh + b
    i, f, gg, o = sig(z[:, :H]), sig(z[:, H : 2 * H]), np.tanh(z[:, 2 * H : 3 * H]), sig(z[:, 3 * H :])
    c2 = f * c + i * gg
    return o * np.tanh(c2), c2


def np_gru(x, h, Wx, Wh, bx, bh):
    gx, gh = x @ Wx + bx, h @ Wh + bh
    r = sig(gx[:, :H] + gh[:, :H])
    z = sig(gx[:, H : 2 * H] + gh[:, H : 2 * H])
    n = np.tanh(gx[:, 2 * H :] + r * gh[:, 2 * H :])
    return (1 - z) * n + z * h


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# --- Linear, RNNCell --------------------------------------------------------------------------


def test_linear_matches_numpy_and_names():
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    x = g.input("x", (None, I))
    fc = nn.Linear(g, I, 5, "fc", bias_init=nn.constant(0.5))
    nobias = nn.Linear(g, I, 2, "nb", bias=False)
    xv = rand(B, I)
    cg = g.build({"x": xv}, [fc(x), nobias(x)])
    y, z = cg.forward()
    np.testing.assert_allclose(y, xv @ P(g, "fc.W") + 0.5)
    np.testing.assert_allclose(z, xv @ P(g, "nb.W"))
    assert list(g.params) == ["fc.W", "fc.b", "nb.W"]
    assert fc.parameter_names() == ["fc.W", "fc.b"]
    assert [p.name for p in fc.parameters()] == ["fc.W", "fc.b"]


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_cell_one_step(nonlinearity):
    g = vg.VirtualGraph(dtype=np.float64, seed=4)
    x, h = g.input("x", (None, I)), g.input("h", (None, H))
    cell = nn.RNNCell(g, I, H, "rnn", nonlinearity=nonlinearity)
    xv, hv = rand(B, I, seed=1), rand(B, H, seed=2)
    out = g.build({"x": xv, "h": hv}, cell(x, h)).forward()
    z = xv @ P(g, "rnn.W_x") + hv @ P(g, "rnn.W_h") + P(g, "rnn.b")
    np.testing.assert_allclose(out, np.tanh(z) if nonlinearity == "tanh" else np.maximum(z, 0))
    Wh = P(g, "rnn.W_h")
    np.testing.assert_allclose(Wh @ Wh.T, np.eye(H), atol=1e-12)  # orthogonal recurrent weight
    with pytest.raises(ValueError):
        nn.RNNCell(g, I, H, "bad", nonlinearity="sigmoid")


# --- LSTM, GRU --------------------------------------------------------------------------------


def test_lstm_one_step_matches_numpy_and_forget_bias():
    g = vg.VirtualGraph(dtype=np.float64, seed=5)
    x, h, c = g.input("x", (None, I)), g.input("h", (None, H)), g.input("c", (None, H))
    cell = nn.LSTMCell(g, I, H, "lstm")
    b = P(g, "lstm.b")
    np.testing.assert_array_equal(b[H : 2 * H], 1.0)
    np.testing.assert_array_equal(np.delete(b, np.s_[H : 2 * H]), 0.0)
    # use a random bias so every gate's slice is exercised
    g.params.set_value("lstm.b", rand(4 * H, seed=9))
    xv, hv, cv = rand(B, I, seed=1), rand(B, H, seed=2), rand(B, H, seed=3)
    hn, cn = cell(x, (h, c))
    got_h, got_c = g.build({"x": xv, "h": hv, "c": cv}, [hn, cn]).forward()
    ref_h, ref_c = np_lstm(xv, hv, cv, P(g, "lstm.W_x"), P(g, "lstm.W_h"), P(g, "lstm.b"))
    np.testing.assert_allclose(got_h, ref_h, rtol=1e-12)
    np.testing.assert_allclose(got_c, ref_c, rtol=1e-12)
    Wh = P(g, "lstm.W_h")
    for k in range(4):  # one orthogonal block per gate
        blk = Wh[:, k * H : (k + 1) * H]
        np.testing.assert_allclose(blk.T @ blk, np.eye(H), atol=1e-12)


def test_gru_one_step_matches_numpy():
    g = vg.VirtualGraph(dtype=np.float64, seed=6)
    x, h = g.input("x", (None, I)), g.input("h", (None, H))
    cell = nn.GRUCell(g, I, H, "gru")
    g.params.set_value("gru.b_x", rand(3 * H, seed=7))
    g.params.set_value("gru.b_h", rand(3 * H, seed=8))
    xv, hv = rand(B, I, seed=1), rand(B, H, seed=2)
    got = g.build({"x": xv, "h": hv}, cell(x, h)).forward()
    ref = np_gru(xv, hv, P(g, "gru.W_x"), P(g, "gru.W_h"), P(g, "gru.b_x"), P(g, "gru.b_h"))
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def _unrolled(kind, T=3, seed=0):
    """A float64 model running ``kind`` over T steps; returns (graph, compute graph, loss node)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=seed)
    xs, h0 = g.input("xs", (None, None, I)), g.input("h0", (None, H))
    c0 = g.input("c0", (None, H))
    cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}[kind](g, I, H, kind)
    with g.loop() as L:
        x_t = L.step(xs)
        h = L.carry(h0, name="h")
        if kind == "lstm":
            c = L.carry(c0, name="c")
            hn, cn = cell(x_t, (h, c))
            L.update(c, cn)
        else:
            hn = cell(x_t, h)
        L.update(h, hn)
    hs = L.stack(hn)
    loss = (hs * rand(T, B, H, seed=11)).sum()
    if kind == "lstm":
        loss = loss + (L.final(c) * rand(B, H, seed=12)).sum()
    feed = {"xs": rand(T, B, I, seed=13), "h0": rand(B, H, seed=14) * 0.5}
    if kind == "lstm":
        feed["c0"] = rand(B, H, seed=15) * 0.5
    for name in list(g.params):  # random biases: exercise every gate
        if ".b" in name:
            g.params.set_value(name, rand(*g.params[name].shape, seed=16) * 0.5)
    return g, g.build(feed, loss), loss, feed


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_cell_gradients_over_three_step_loop(kind):
    g, cg, loss, _ = _unrolled(kind)
    assert cg.trip_count(next(v for v in g.nodes if v.kind == "loop")) == 3
    assert len(g.params) == len(g.params.parameters())
    vg.gradcheck(cg.node(loss), g.params.parameters())


def test_lstm_three_step_forward_matches_numpy():
    g, cg, loss, feed = _unrolled("lstm")
    h, c = feed["h0"], feed["c0"]
    R = rand(3, B, H, seed=11)
    total = 0.0
    for t in range(3):
        h, c = np_lstm(feed["xs"][t], h, c, P(g, "lstm.W_x"), P(g, "lstm.W_h"), P(g, "lstm.b"))
        total += np.sum(h * R[t])
    total += np.sum(c * rand(B, H, seed=12))
    assert cg.forward() == pytest.approx(total, rel=1e-12)


def _cell_model(kind, fused, T=5, Bn=3, seed=0):
    """A float64 model running ``kind`` (fused or not) over T steps, with a loss reading every
    step's h and the final c; random parameters so every gate matters.

    Returns (graph, compute graph, loss node, the virtual node of the new h)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=seed)
    xs, h0, c0 = g.input("xs", (None, None, I)), g.input("h0", (None, H)), g.input("c0", (None, H))
    cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}[kind](g, I, H, kind, fused=fused)
    with g.loop() as L:
        x_t = L.step(xs)
        h = L.carry(h0, name="h")
        if kind == "lstm":
            c = L.carry(c0, name="c")
            hn, cn = cell(x_t, (h, c))
            L.update(c, cn)
        else:
            hn = cell(x_t, h)
        L.update(h, hn)
    loss = (L.stack(hn) * rand(T, Bn, H, seed=21)).sum()
    if kind == "lstm":
        loss = loss + (L.final(c) * rand(Bn, H, seed=22)).sum()
    for k, name in enumerate(g.params):
        g.params.set_value(name, rand(*g.params[name].shape, seed=30 + k) * 0.7)
    feed = {"xs": rand(T, Bn, I, seed=23), "h0": rand(Bn, H, seed=24), "c0": rand(Bn, H, seed=25)}
    return g, g.build(feed, loss), loss, hn


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_cell_equals_unfused_values_and_gradients(kind):
    """The fused cell computes what the gate-by-gate graph computes (float64, to 1e-12): the loss
    over a 5-step loop, every step's h, and every parameter's gradient."""
    gf, cgf, lf, hf = _cell_model(kind, fused=True)
    gu, cgu, lu, hu = _cell_model(kind, fused=False)
    assert list(gf.params) == list(gu.params)
    for name in gf.params:
        np.testing.assert_array_equal(P(gf, name), P(gu, name))
    assert cgf.backward(lf) == pytest.approx(cgu.backward(lu), rel=1e-12)
    for name in gf.params:
        np.testing.assert_allclose(gf.params[name].grad, gu.params[name].grad, rtol=1e-12, atol=1e-14)
        assert np.abs(gf.params[name].grad).max() > 1e-3  # every parameter is exercised
    for t in range(5):
        np.testing.assert_allclose(cgf.node(hf, (t,)).value, cgu.node(hu, (t,)).value, rtol=1e-12, atol=1e-14)


def _cell_step_graph(kind, fused, arrays):
    """One cell step on a ComputeGraph (fused op or gate by gate) with a loss reading every
    output; returns (graph, loss, leaves)."""
    cg = vg.ComputeGraph(dtype=np.float64)
    x, h, c, Wx, Wh, b, R = arrays
    x, h, c = (cg.input(v, requires_grad=True) for v in (x, h, c))
    Wx, Wh, b = (cg.parameter(v) for v in (Wx, Wh, b))
    Hn = h.shape[-1]
    if kind == "lstm":
        if fused:
            s = vg.functions.lstm_cell(x @ Wx, h @ Wh, b, c)
            hn, cn = s[0], s[1]
        else:
            z = x @ Wx + h @ Wh + b
            i, f = vg.sigmoid(z[..., :Hn]), vg.sigmoid(z[..., Hn : 2 * Hn])
            gg, o = vg.tanh(z[..., 2 * Hn : 3 * Hn]), vg.sigmoid(z[..., 3 * Hn :])
            cn = f * c + i * gg
            hn = o * vg.tanh(cn)
        loss = (hn * R).sum() + (cn * R * R).sum()
        return cg, loss, [x, h, c, Wx, Wh, b]
    bx, bh = b[: 3 * Hn], b[3 * Hn :]
    if fused:
        hn = vg.functions.gru_cell(x @ Wx, h @ Wh, bx, bh, h)[0]
    else:
        gx, gh = x @ Wx + bx, h @ Wh + bh
        r = vg.sigmoid(gx[..., :Hn] + gh[..., :Hn])
        zz = vg.sigmoid(gx[..., Hn : 2 * Hn] + gh[..., Hn : 2 * Hn])
        n = vg.tanh(gx[..., 2 * Hn :] + r * gh[..., 2 * Hn :])
        hn = n + zz * (h - n)
    return cg, (hn * R).sum(), [x, h, Wx, Wh, b]


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(["lstm", "gru"]),
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 5)),
    seed=st.integers(0, 2**16),
)
def test_fused_cell_step_equals_gate_by_gate(kind, batch, sizes, seed):
    """Random batch shapes (none, one or two axes), sizes and values: the fused op's h', c' and
    every input's gradient equal the gate-by-gate graph's (float64, 1e-12)."""
    In, Hn = sizes
    r = np.random.default_rng(seed)
    n = 4 if kind == "lstm" else 3
    arrays = (
        r.standard_normal((*batch, In)), r.standard_normal((*batch, Hn)), r.standard_normal((*batch, Hn)),
        r.standard_normal((In, n * Hn)), r.standard_normal((Hn, n * Hn)),
        r.standard_normal(4 * Hn if kind == "lstm" else 6 * Hn), r.standard_normal((*batch, Hn)),
    )  # fmt: skip
    (cgf, lf, xf), (cgu, lu, xu) = (_cell_step_graph(kind, fused, arrays) for fused in (True, False))
    assert any(nd.key.type in ("LSTMCell", "GRUCell") for nd in cgf.nodes())
    assert cgf.forward(lf) == pytest.approx(cgu.forward(lu), rel=1e-12, abs=1e-12)
    for a, b in zip(cgf.grad(lf, xf), cgu.grad(lu, xu)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind, fused_nodes", [("lstm", 5), ("gru", 4)])
def test_fused_cell_is_one_node_per_step(kind, fused_nodes):
    _, cgf, _, _ = _cell_model(kind, fused=True)
    _, cgu, _, _ = _cell_model(kind, fused=False)
    cgf, cgu = cgf.per_node(), cgu.per_node()  # (node by node, as a loop run as a program reads)
    cell_type = {"lstm": "LSTMCell", "gru": "GRUCell"}[kind]

    def per_step(cg):
        return sum(1 for n in cg.nodes() if n.key.idx == (2,)) - 1  # minus the x_t item

    cells = [n for n in cgf.nodes() if n.key.type == cell_type]
    assert [n.key.idx for n in cells] == [(t,) for t in range(5)]
    assert cells[0].attrs["gates"] == {"lstm": ("i", "f", "g", "o"), "gru": ("r", "z", "n")}[kind]
    assert not any(n.key.type in ("Sigmoid", "Tanh") for n in cgf.nodes())
    assert per_step(cgf) == fused_nodes
    assert per_step(cgu) >= 15
    assert sum(1 for n in cgu.nodes() if n.key.type == "Sigmoid") == 5 * (3 if kind == "lstm" else 2)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_cell_gradcheck_over_loop(kind):
    g, cg, loss, _ = _cell_model(kind, fused=True, T=3, Bn=2)
    vg.gradcheck(cg.node(loss), g.params.parameters())


def test_fused_lstm_value_holds_state_and_gates():
    g = vg.VirtualGraph(dtype=np.float64, seed=5)
    x, h, c = g.input("x", (None, I)), g.input("h", (None, H)), g.input("c", (None, H))
    cell = nn.LSTMCell(g, I, H, "lstm")
    g.params.set_value("lstm.b", rand(4 * H, seed=9))
    xv, hv, cv = rand(B, I, seed=1), rand(B, H, seed=2), rand(B, H, seed=3)
    hn, cn = cell(x, (h, c))
    cg = g.build({"x": xv, "h": hv, "c": cv}, [hn, cn])
    state = next(n for n in cg.nodes() if n.key.type == "LSTMCell").value
    assert state.shape == (6, B, H)
    z = xv @ P(g, "lstm.W_x") + hv @ P(g, "lstm.W_h") + P(g, "lstm.b")
    np.testing.assert_allclose(state[2], sig(z[:, :H]), rtol=1e-12)  # i
    np.testing.assert_allclose(state[3], sig(z[:, H : 2 * H]), rtol=1e-12)  # f
    np.testing.assert_allclose(state[4], np.tanh(z[:, 2 * H : 3 * H]), rtol=1e-12)  # g
    np.testing.assert_allclose(state[5], sig(z[:, 3 * H :]), rtol=1e-12)  # o
    np.testing.assert_array_equal(cg.node(hn).value, state[0])
    np.testing.assert_array_equal(cg.node(cn).value, state[1])


def test_fused_cell_partial_and_repeated_gradients():
    """The inputs of a fused cell share one joint gradient computation: asking for a subset of
    them, or backpropagating twice with different seeds, must give the unfused answers."""
    cgs = {}
    for fused in (True, False):
        cg = vg.ComputeGraph(dtype=np.float64)
        x = cg.input(rand(B, I, seed=1), requires_grad=True)
        h = cg.input(rand(B, H, seed=2), requires_grad=True)
        c = cg.input(rand(B, H, seed=3))  # no gradient wanted
        Wx, Wh, b = (
            cg.parameter(rand(I, 4 * H, seed=4)),
            cg.parameter(rand(H, 4 * H, seed=5)),
            cg.parameter(rand(4 * H, seed=6)),
        )
        if fused:
            s = vg.functions.lstm_cell(x @ Wx, h @ Wh, b, c)
            hn, cn = s[0], s[1]
        else:
            z = x @ Wx + h @ Wh + b
            i, f = vg.sigmoid(z[..., :H]), vg.sigmoid(z[..., H : 2 * H])
            gg, o = vg.tanh(z[..., 2 * H : 3 * H]), vg.sigmoid(z[..., 3 * H :])
            cn = f * c + i * gg
            hn = o * vg.tanh(cn)
        cgs[fused] = (cg, hn, cn, x, h, b)
    for seed in (7, 8):
        got = {}
        for fused, (cg, hn, cn, x, h, b) in cgs.items():
            out = (hn * rand(B, H, seed=seed)).sum() + (cn * rand(B, H, seed=seed + 10)).sum()
            got[fused] = cg.grad(out, [b, h], retain_graph=True) + cg.grad(out, [x], retain_graph=True)
        for a, r in zip(got[True], got[False]):
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fn, shapes", [
    (vg.functions.lstm_cell, [(B, 4 * H), (B, 4 * H), (4 * H,), (B, H + 1)]),
    (vg.functions.lstm_cell, [(B, 4 * H), (B, 4 * H), (4 * H,), ()]),
    (vg.functions.gru_cell, [(B, 3 * H), (B, 3 * H), (3 * H,), (3 * H,), (B, H - 1)]),
])  # fmt: skip
def test_fused_cell_bad_shapes_name_the_node(fn, shapes):
    cg = vg.ComputeGraph(dtype=np.float64)
    nodes = [cg.input(np.ones(s)) for s in shapes]
    n_before = len(cg)
    with pytest.raises(vg.ShapeError, match=r"<(LSTM|GRU)Cell:1>.*columns|<(LSTM|GRU)Cell:1>.*scalar"):
        fn(*nodes)
    assert len(cg) == n_before


# --- tying ------------------------------------------------------------------------------------


def _loop_with_cell(where, share=False, T=3):
    g = vg.VirtualGraph(dtype=np.float64)
    xs, h0 = g.input("xs", (None, None, I)), g.input("h0", (None, H))
    outside = nn.GRUCell(g, I, H, "cell") if where == "outside" else None
    with g.loop() as L:
        x_t = L.step(xs)
        h = L.carry(h0, name="h")
        cell = outside or nn.GRUCell(g, I, H, "cell", share=share)
        L.update(h, cell(x_t, h))
    out = L.final(h).sum()
    g.build({"xs": rand(T, B, I), "h0": np.zeros((B, H))}, out)
    return g, cell


def test_cell_constructed_outside_the_loop_is_one_parameter_set():
    g, cell = _loop_with_cell("outside")
    assert list(g.params) == ["cell.W_x", "cell.W_h", "cell.b_x", "cell.b_h"]


def test_cell_inside_the_loop_share_true_is_tied():
    g, cell = _loop_with_cell("inside", share=True)
    assert list(g.params) == ["cell.W_x", "cell.W_h", "cell.b_x", "cell.b_h"]


def test_cell_inside_the_loop_untied_by_default():
    g, cell = _loop_with_cell("inside", share=False)
    assert sorted(g.params) == sorted(f"cell.{n}@{t}" for n in ("W_x", "W_h", "b_x", "b_h") for t in range(3))
    assert len(cell.parameters()) == 12


def test_module_name_validation():
    g = vg.VirtualGraph()
    with pytest.raises(ValueError):
        nn.Linear(g, 2, 2, "a@b")
    with pytest.raises(TypeError):
        nn.Linear(vg.ComputeGraph(), 2, 2, "fc")


# --- Embedding --------------------------------------------------------------------------------


def _embedding_grad_reference(idx, R, shape):
    expected = np.zeros(shape)
    for j, row in enumerate(idx):  # every occurrence adds its own gradient row
        expected[row] += R[j]
    return expected


@pytest.mark.parametrize("as_node", [False, True], ids=["array-indices", "node-indices"])
def test_embedding_lookup_and_gradient_with_repeated_indices(as_node):
    g = vg.VirtualGraph(dtype=np.float64, seed=7)
    emb = nn.Embedding(g, 5, 2, "emb")
    idx = np.array([1, 3, 1, 1, 0])
    R = rand(5, 2, seed=3)
    if as_node:
        tok = g.input("tok", (None,))
        out = emb(tok)
        feed = {"tok": idx}
    else:
        out = emb(idx)
        feed = {}
    loss = (out * R).sum()
    cg = g.build(feed, [out, loss])
    np.testing.assert_allclose(cg.node(out).value, P(g, "emb.W")[idx])
    cg.backward(loss)
    np.testing.assert_allclose(g.params["emb.W"].grad, _embedding_grad_reference(idx, R, (5, 2)))
    vg.gradcheck(cg.node(loss), [g.params["emb.W"]])


def test_embedding_whole_sequence_then_step():
    g = vg.VirtualGraph(dtype=np.float32, seed=8)
    emb = nn.Embedding(g, 6, 3, "emb")
    tokens = g.input("tokens", (None, None))
    embedded = emb(tokens)  # (time, batch, dim), declared before the loop
    zeros = g.constant(np.zeros((2, 3)))
    with g.loop() as L:
        e_t = L.step(embedded)
        acc = L.carry(zeros, name="acc")
        L.update(acc, acc + e_t)
    total = L.final(acc)
    idx = np.array([[0, 5], [2, 2], [5, 1]])
    out = g.build({"tokens": idx}, total).forward()
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, P(g, "emb.W")[idx].sum(axis=0), rtol=1e-6)


def test_embedding_bad_indices():
    g = vg.VirtualGraph()
    emb = nn.Embedding(g, 4, 2, "emb")
    with pytest.raises(ValueError):
        emb(np.array([0, 4]))
    with pytest.raises(ValueError):
        emb(np.array([0.5]))


def test_one_hot():
    np.testing.assert_array_equal(nn.one_hot(np.array([2, 0]), 3), [[0, 0, 1], [1, 0, 0]])
    cg = vg.ComputeGraph(np.float32)
    node = nn.one_hot(cg.input(np.array([[1], [3]])), 4)
    assert node.value.dtype == np.float32
    np.testing.assert_array_equal(node.value, [[[0, 1, 0, 0]], [[0, 0, 0, 1]]])


# --- Dropout ----------------------------------------------------------------------------------


def test_dropout_train_and_eval():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, None))
    drop = nn.Dropout(g, p=0.25)
    y = drop(x)
    xv = np.ones((200, 100))
    a = g.build({"x": xv}, y).forward()
    assert set(np.unique(a)) <= {0.0, 1 / 0.75}
    assert abs(np.mean(a == 0) - 0.25) < 0.02
    b = g.build({"x": xv}, y).forward()
    assert not np.array_equal(a, b)  # a fresh mask every build
    g.eval()
    np.testing.assert_array_equal(g.build({"x": xv}, y).forward(), xv)
    g.train()
    assert np.any(g.build({"x": xv}, y).forward() == 0)


def test_dropout_masks_per_iteration_and_reproducible():
    def run(seed):
        g = vg.VirtualGraph(dtype=np.float64, seed=seed)
        xs = g.input("xs", (None, 50))
        drop = nn.Dropout(g, 0.5)
        with g.loop() as L:
            y_t = drop(L.step(xs))
        ys = L.stack(y_t)
        return g.build({"xs": np.ones((3, 50))}, ys).forward()

    a = run(1)
    assert not np.array_equal(a[0], a[1])
    np.testing.assert_array_equal(a, run(1))


def test_dropout_gradient_follows_the_mask_and_edge_probabilities():
    g = vg.VirtualGraph(dtype=np.float64, seed=2)
    w = g.parameter("w", init=np.ones(1000))
    drop = nn.Dropout(g, 0.5)
    y = drop(w)
    loss = y.sum()
    cg = g.build({}, [y, loss])
    cg.backward(loss)
    np.testing.assert_array_equal(g.params["w"].grad, cg.node(y).value)  # mask * 1
    for p, expected in [(0.0, 1.0), (1.0, 0.0)]:
        g2 = vg.VirtualGraph(dtype=np.float64)
        x = g2.input("x")
        assert np.all(g2.build({"x": np.ones(5)}, nn.Dropout(g2, p)(x)).forward() == expected)
    with pytest.raises(ValueError):
        nn.Dropout(g, 1.5)


def test_initialisers_are_reexported():
    assert nn.init is vg.init
    assert nn.orthogonal is vg.init.orthogonal
    rng = np.random.default_rng(0)
    assert nn.xavier_uniform()((3, 4), rng, np.float32).dtype == np.float32


# --- truncated BPTT ---------------------------------------------------------------------------

O = 2


def _rnn_model():
    g = vg.VirtualGraph(dtype=np.float64, seed=21)
    xs, ys = g.input("x", (None, None, I)), g.input("y", (None, None, O))
    h0 = g.input("h0", (None, H))
    cell = nn.RNNCell(g, I, H, "rnn")
    head = nn.Linear(g, H, O, "out")
    with g.loop() as L:
        h = L.carry(h0, name="h")
        hn = cell(L.step(xs), h)
        L.update(h, hn)
    loss = losses.mse_loss(head(L.stack(hn)), ys)
    return g, loss, L.final(h)


def np_chunk_bptt(p, xs, ys, h):
    """Loss, gradients and final state of one chunk: BPTT over its steps only, from state h."""
    hs = [h]
    for x in xs:
        hs.append(np.tanh(x @ p["rnn.W_x"] + hs[-1] @ p["rnn.W_h"] + p["rnn.b"]))
    out = np.stack(hs[1:]) @ p["out.W"] + p["out.b"]
    loss = np.mean((out - ys) ** 2)
    go = 2 * (out - ys) / out.size
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    grads["out.W"] = sum(hs[t + 1].T @ go[t] for t in range(len(xs)))
    grads["out.b"] = go.sum(axis=(0, 1))
    gh = np.zeros_like(h)
    for t in reversed(range(len(xs))):
        gh = gh + go[t] @ p["out.W"].T
        ga = gh * (1 - hs[t + 1] ** 2)
        grads["rnn.W_x"] += xs[t].T @ ga
        grads["rnn.W_h"] += hs[t].T @ ga
        grads["rnn.b"] += ga.sum(axis=0)
        gh = ga @ p["rnn.W_h"].T
    return loss, grads, hs[-1]


def test_chunks():
    xs = np.arange(7)
    assert [c.tolist() for c in chunks(xs, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [c.tolist() for c in chunks(xs, 3, drop_last=True)] == [[0, 1, 2], [3, 4, 5]]
    m = np.arange(10).reshape(2, 5)
    assert [c.shape for c in chunks(m, 2, axis=1)] == [(2, 2), (2, 2), (2, 1)]
    feeds = list(chunk_feeds({"x": np.zeros((7, 2)), "y": np.ones((7, 1)), "c": 5}, 4, ["x", "y"]))
    assert [f["x"].shape[0] for f in feeds] == [4, 3] and all(f["c"] == 5 for f in feeds)
    with pytest.raises(ValueError):
        next(chunks(xs, 0))
    with pytest.raises(ValueError):
        list(chunk_feeds({"x": np.zeros(3), "y": np.zeros(4)}, 2, ["x", "y"]))


def test_truncated_bptt_chunk_gradients_equal_bptt_over_the_chunk():
    g, loss, h_final = _rnn_model()
    T, k = 8, 3
    xs, ys = rand(T, B, I, seed=31), rand(T, B, O, seed=32)
    h_init = rand(B, H, seed=33) * 0.3
    p = {k_: np.array(v.value) for k_, v in g.params.items()}  # reference copy, updated by hand
    lr = 0.1
    seen = []

    def record(i, cg, value):
        seen.append((value, {name: np.array(n.grad) for name, n in g.params.items()}))

    opt = optim.SGD(g.params, lr=lr)
    feeds = chunk_feeds({"x": xs, "y": ys}, k, ["x", "y"])
    result = truncated_bptt(g, feeds, loss, {"h0": h_final}, {"h0": h_init}, optimizer=opt, callback=record)

    h = h_init
    assert len(seen) == len(result.losses) == 3
    for i, start in enumerate(range(0, T, k)):
        ref_loss, ref_grads, h_next = np_chunk_bptt(p, xs[start : start + k], ys[start : start + k], h)
        value, grads = seen[i]
        assert value == pytest.approx(ref_loss, rel=1e-12)
        for name in p:
            np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-10, atol=1e-14)
        p = {name: p[name] - lr * ref_grads[name] for name in p}  # SGD after each chunk
        h = h_next  # the state computed with the pre-update parameters, carried as a constant
    np.testing.assert_allclose(result.state["h0"], h, rtol=1e-12)
    for name in p:
        np.testing.assert_allclose(g.params[name].value, p[name], rtol=1e-12)


def test_truncation_cuts_the_gradient_to_the_previous_chunk():
    """The second chunk's gradient does not depend on how the first chunk computed its state."""
    g, loss, h_final = _rnn_model()
    xs, ys = rand(6, B, I, seed=41), rand(6, B, O, seed=42)
    grads = []
    truncated_bptt(g, chunk_feeds({"x": xs, "y": ys}, 3, ["x", "y"]), loss, {"h0": h_final},
                   {"h0": np.zeros((B, H))},
                   callback=lambda i, cg, v: grads.append(np.array(g.params["rnn.W_x"].grad)))  # fmt: skip
    # the same second chunk built by hand from the carried state
    p = {k: np.array(v.value) for k, v in g.params.items()}
    _, _, h3 = np_chunk_bptt(p, xs[:3], ys[:3], np.zeros((B, H)))
    _, ref, _ = np_chunk_bptt(p, xs[3:], ys[3:], h3)
    assert len(grads) == 2
    np.testing.assert_allclose(grads[1], ref["rnn.W_x"], rtol=1e-10)


def test_truncated_bptt_eval_mode_only_evaluates():
    g, loss, h_final = _rnn_model()
    xs, ys = rand(5, B, I, seed=51), rand(5, B, O, seed=52)
    before = g.params.state_dict()
    g.eval()
    res = truncated_bptt(g, chunk_feeds({"x": xs, "y": ys}, 2, ["x", "y"]), loss, {"h0": h_final},
                         {"h0": np.zeros((B, H))}, optimizer=optim.SGD(g.params, lr=1.0))  # fmt: skip
    p = {k: np.array(v.value) for k, v in g.params.items()}
    h = np.zeros((B, H))
    for i, s in enumerate(range(0, 5, 2)):
        ref_loss, _, h = np_chunk_bptt(p, xs[s : s + 2], ys[s : s + 2], h)
        assert res.losses[i] == pytest.approx(ref_loss, rel=1e-12)
    for k, v in before.items():
        np.testing.assert_array_equal(g.params[k].value, v)
    with pytest.raises(ValueError):
        truncated_bptt(g, [], loss, {"h0": h_final}, {"c0": np.zeros(1)})


# --- Bidirectional ------------------------------------------------------------------------------

CELLS = {"rnn": nn.RNNCell, "lstm": nn.LSTMCell, "gru": nn.GRUCell}


def _bidirectional(kind, fused=True, bi=True, batch=B, seed=0):
    """A float64 model reading a cell's states in both directions, with nn.Bidirectional (``bi``)
    or as two loops written out; random biases. Returns ``(graph, loss)``."""
    g = vg.VirtualGraph(dtype=np.float64, seed=seed)
    xs = g.input("xs", (None, batch, I))
    extra = {} if kind == "rnn" else {"fused": fused}
    fwd, bwd = CELLS[kind](g, I, H, "fwd", **extra), CELLS[kind](g, I, H, "bwd", **extra)
    if bi:
        out = nn.Bidirectional(fwd, bwd)(xs)
    else:
        zeros = g.constant(np.zeros((1, H)))

        def run(seq, cell):
            with g.loop() as L:
                x_t, h = L.step(seq), L.carry(zeros, name="h")
                if kind == "lstm":
                    c = L.carry(zeros, name="c")
                    hn, cn = cell(x_t, (h, c))
                    L.update(c, cn)
                else:
                    hn = cell(x_t, h)
                L.update(h, hn)
            return L.stack(hn)

        out = vg.concat([run(xs, fwd), run(xs[::-1], bwd)[::-1]], axis=-1)
    for name in list(g.params):
        if ".b" in name:
            g.params.set_value(name, rand(*g.params[name].shape, seed=16 + len(name)) * 0.5)
    loss = vg.sum(vg.tanh(out) * rand(1, batch, 2 * H, seed=3))
    return g, loss


def _grads(g):
    return {k: np.array(p.grad) for k, p in g.params.items()}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    ("kind", "fused"), [("rnn", True), ("lstm", True), ("lstm", False), ("gru", True), ("gru", False)]
)
def test_bidirectional_equals_two_loops(kind, fused, batch):
    """One loop over both directions (the cells' weights stacked) gives the two loops' loss and
    every parameter's gradient (float64, 1e-12)."""
    feed = {"xs": rand(6, batch, I, seed=1)}
    got = []
    for bi in (True, False):
        g, loss = _bidirectional(kind, fused, bi, batch)
        cg = g.build(feed, loss)
        got.append((cg.backward(cg.outputs[0]), _grads(g)))
        assert sum(v.kind == "loop" for v in g.nodes) == (1 if bi else 2)
    (v_bi, g_bi), (v_two, g_two) = got
    assert v_bi == pytest.approx(v_two, rel=1e-12)
    assert g_bi.keys() == g_two.keys() == {f"{d}.{p}" for d in ("fwd", "bwd") for p in _param_names(kind)}
    for k in g_two:
        np.testing.assert_allclose(g_bi[k], g_two[k], rtol=1e-12, atol=1e-12, err_msg=k)


def _param_names(kind):
    return ("W_x", "W_h", "b_x", "b_h") if kind == "gru" else ("W_x", "W_h", "b")


def test_bidirectional_lstm_matches_numpy():
    """The result against hand-written numpy: row t is the forward cell after xs[0..t] next to the
    backward cell after xs[T-1..t]."""
    g, loss = _bidirectional("lstm")
    out = next(v for v in g.nodes if v.op is not None and v.op.name == "Concat")
    x = rand(5, B, I, seed=2)
    got = g.build({"xs": x}, out).forward()
    assert got.shape == (5, B, 2 * H)
    for d, order in (("fwd", range(5)), ("bwd", range(4, -1, -1))):
        h = c = np.zeros((B, H))
        for t in order:
            h, c = np_lstm(x[t], h, c, P(g, f"{d}.W_x"), P(g, f"{d}.W_h"), P(g, f"{d}.b"))
            np.testing.assert_allclose(got[t][:, :H] if d == "fwd" else got[t][:, H:], h, rtol=1e-12)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_bidirectional_gradients_agree_with_finite_differences(kind):
    g, loss = _bidirectional(kind)
    cg = g.build({"xs": rand(4, B, I, seed=5)}, loss)
    vg.gradcheck(cg.outputs[0], g.params.parameters())


def test_bidirectional_refuses_what_it_cannot_run():
    g = vg.VirtualGraph(dtype=np.float64)
    lstm, lstm2 = nn.LSTMCell(g, I, H, "a"), nn.LSTMCell(g, I, H, "b")
    with pytest.raises(TypeError, match="must be an RNNCell, LSTMCell or GRUCell, got Linear"):
        nn.Bidirectional(nn.Linear(g, I, H, "lin"), lstm)
    with pytest.raises(TypeError, match="of one kind, got LSTMCell and GRUCell"):
        nn.Bidirectional(lstm, nn.GRUCell(g, I, H, "gru"))
    with pytest.raises(ValueError, match="hidden_size differ \\(4 and 5\\)"):
        nn.Bidirectional(lstm, nn.LSTMCell(g, I, 5, "c"))
    with pytest.raises(ValueError, match="fused differ"):
        nn.Bidirectional(lstm, nn.LSTMCell(g, I, H, "d", fused=False))
    with pytest.raises(ValueError, match="different graphs"):
        nn.Bidirectional(lstm, nn.LSTMCell(vg.VirtualGraph(), I, H, "e"))
    xs = g.input("xs", (None, B, I))
    with g.loop() as L:
        inner = nn.LSTMCell(g, I, H, "inner", share=True)
        h = L.carry(np.zeros((B, H)), name="h")
        L.update(h, inner(L.step(xs), (h, h))[0])
    with pytest.raises(ValueError, match=r"inner\.W_x.* is declared in a loop body"):
        nn.Bidirectional(inner, lstm)
    bi = nn.Bidirectional(lstm, lstm2)
    declared = len(g.nodes)
    with pytest.raises(TypeError, match="a node of the cells' graph, got ndarray"):
        bi(np.zeros((2, B, I)))
    with pytest.raises(TypeError, match="a node of the cells' graph, got <Input:1> 'x'"):
        bi(vg.VirtualGraph().input("x", (None, B, I)))
    assert len(g.nodes) == declared  # a refused call declares nothing
    for x, what in (
        (g.input("flat", (None, I)), r"must be \(T, B, input_size\), got .*flat.* of shape \(None, 3\)"),
        (g.input("free"), r"got .*free.* of shape unknown"),
        (g.input("wide", (None, B, I + 1)), "xs has 4 features, the cells take 3"),
    ):
        with pytest.raises(ValueError, match=what):
            bi(x)
