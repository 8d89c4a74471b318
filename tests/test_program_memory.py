"""What a body program's backward keeps alive: one buffer per hoisted node for the gradient rows
its iterations give, not a list of the steps' arrays plus a stack of them.

The backward step of an iteration gives the gradient of each hoisted node's row (in an LSTM, the
gate gradient ``dz`` of ``x_t @ W_x``, which is also the gradient of ``h @ W_h`` and of the bias).
The driver collects those rows into one buffer shaped as the hoisted value, row ``t`` as
iteration ``t``'s step gives it; a row that one place of the step gives is copied into the buffer
by the step itself, which then hands the row (not the VJP's array) to the gradient's other readers
(the tied ``W_h``'s stacked product, the bias's sum). Results are those of the per-node unroll
(float64, 1e-12) and, bit for bit, those of the same steps without rows written in place.
"""

from __future__ import annotations

import sys
import tracemalloc
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from test_programs import assert_identical

import vgraph as vg
from vgraph import ops, workspace
from vgraph.ops import RowsProductGrad
from vgraph.virtual import program

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from bench_dynamic import LMConfig, make_lstm_lm

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def lstm_lm(V=50, E=16, H=32):
    """The benchmark's language model (tools/bench_dynamic.py, ``lstm_lm``) at a small size: an
    embedded ``(T, B)`` token array stepped through a fused LSTM cell (``x_t @ W_x`` hoisted), the
    stacked states through a linear layer, a masked cross-entropy."""
    return make_lstm_lm(LMConfig(vocab=V, embed=E, hidden=H, dtype=np.float64, seed=1))


def lm_feed(T, B, V=50, H=32, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, V, (T, B)),
        "targets": rng.integers(0, V, T * B),
        "weights": rng.uniform(0.0, 1.0, T * B) / (T * B),
        "zeros": np.zeros((B, H)),
    }


def gradients(g, loss, feed):
    """A default build's (body programs) loss and parameter gradients after one backward."""
    cg = g.build(feed, loss, cache=False)
    assert cg.programs, cg.interpreted
    g.params.zero_grad()
    value = cg.backward(cg.outputs[0])
    return value, {k: np.array(p.grad) for k, p in g.params.items()}


# ---------------------------------------------------------------------------- memory


def loop_backward_peak(monkeypatch, cg) -> int:
    """The traced peak (bytes) of the loop node's backward in ``cg.backward``, deterministic:
    tracemalloc counts bytes allocated, and with recycling off every buffer is allocated anew."""
    assert cg.programs, cg.interpreted
    peaks = []
    backward = program.ProgramInstance.backward

    def traced(self, *args):
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = backward(self, *args)
        peaks.append(tracemalloc.get_traced_memory()[1] - start)
        return out

    limit = workspace.limit()
    workspace.set_limit(0)  # (every temporary allocated anew, where tracemalloc sees it)
    try:
        with monkeypatch.context() as m:
            m.setattr(program.ProgramInstance, "backward", traced)
            tracemalloc.start()
            try:
                cg.backward(cg.outputs[0])
            finally:
                tracemalloc.stop()
    finally:
        workspace.set_limit(limit)
    (peak,) = peaks
    return peak


def test_the_loop_backward_holds_one_copy_of_the_gate_gradient_rows(monkeypatch):
    """The traced peak of the loop node's backward on an LSTM LM step is one set of ``T``
    gate-gradient rows ``(B, 4H)`` and a little per-step work. Collecting the rows as the
    steps' arrays in a list and stacking them after the sweep holds two sets at once (the list
    stays alive: the tied ``W_h`` and the bias read the same arrays), over 2x the rows' bytes."""
    T, B, H = 40, 32, 32
    rows_bytes = T * B * 4 * H * 8
    g, loss = lstm_lm(H=H)
    monkeypatch.setattr(program._Parts, "BLOCK_BYTES", 1)  # (one iteration's part at a time)
    peak = loop_backward_peak(monkeypatch, g.build(lm_feed(T, B, H=H), loss, cache=False))
    assert rows_bytes <= peak < 1.6 * rows_bytes, (peak, rows_bytes)


def test_the_generated_sweep_holds_no_more_than_a_step_at_a_time(monkeypatch):
    """The backward steps inlined in one loop (``make_sweep``) let go of an iteration's gradients
    before the next iteration's work, as a step returning does: the traced peak of the loop
    node's backward is no higher than the step-by-step driver's (which runs where a body node
    retains its gradient). Holding them while the next block of split-VJP parts is computed
    cost half a MiB on the LSTM LM at 64 sentences a batch."""
    T, B, H = 12, 16, 32
    g, loss = lstm_lm(H=H)
    feed = lm_feed(T, B, H=H)
    monkeypatch.setattr(program._Parts, "BLOCK_BYTES", 4 * B * 4 * H * 8)  # (a new block every 4 iterations)
    swept = loop_backward_peak(monkeypatch, g.build(feed, loss, cache=False))
    cg = g.build(feed, loss, cache=False)
    monkeypatch.setattr(next(iter(cg.programs.values())).variant, "_make_sweep", None)
    stepped = loop_backward_peak(monkeypatch, cg)
    row = B * 4 * H * 8  # (one iteration's gate gradient: what holding an iteration's costs at least)
    assert swept < stepped + row // 4, (swept, stepped)  # (the sweep's few Python objects aside)


def test_a_fused_cells_joint_gradient_is_read_from_the_buffer_row_by_its_other_readers():
    """The step copies the cell's ``dz`` into its row of the hoisted ``x_t @ W_x``'s buffer before
    routing it, so the tied ``W_h`` and the bias collect the row (a view of the buffer) instead of
    keeping the VJP's array: after the sweep, the rows ``W_h``'s stacked product holds are the
    consecutive rows of the one buffer the hoisted node's gradient is."""
    T, B, H = 5, 3, 4
    g, loss = lstm_lm(H=H)
    cg = g.build(lm_feed(T, B, H=H), loss, cache=False)
    instance = next(iter(cg.programs.values()))
    assert "J = INTO_J(J, 0, o0)" in instance.variant.backward_source
    seen = {}
    hoisted = program.ProgramInstance._backward_hoisted

    def spy(self, run, collected, seqs, caps, seq_grad, accs, keep):
        (h,) = self.variant.rowed
        seen["buffer"] = collected[h].buf
        seen["W_h"] = accs[[v.name for v in self.variant.captured].index("lstm.W_h")].g
        return hoisted(self, run, collected, seqs, caps, seq_grad, accs, keep)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(program.ProgramInstance, "_backward_hoisted", spy)
        cg.backward(cg.outputs[0])
    buffer, w_h = seen["buffer"], seen["W_h"]
    assert isinstance(w_h, RowsProductGrad)
    rows = w_h.g[::-1]  # (collected last iteration first)
    assert len(rows) == T
    start = buffer.__array_interface__["data"][0]
    for t, row in enumerate(rows):
        assert row.shape == (B, 4 * H) and row.base is not None
        assert row.__array_interface__["data"][0] == start + t * row.nbytes


# ---------------------------------------------------------------------------- the same results


def test_the_lm_as_a_program_equals_the_per_node_unroll():
    g, loss = lstm_lm(H=6)
    assert_identical(g, lm_feed(7, 3, H=6), loss)


def test_an_elman_rnn_as_a_program_equals_the_per_node_unroll():
    g, loss = elman()
    assert_identical(g, elman_feed(8), loss)


def elman(I=3, H=5):
    """``h = tanh(x_t @ W_x + h @ W_h + b)`` (``x_t @ W_x`` hoisted), no fused cell: the gradient
    of the hoisted row passes unchanged through the two additions from the ``tanh``'s VJP."""
    g = vg.VirtualGraph(seed=2)
    xs = g.input("xs", (None, 2, I))
    W_x = g.parameter("W_x", (I, H))
    W_h = g.parameter("W_h", (H, H), init="orthogonal")
    b = g.parameter("b", (H,), init="normal")
    with g.loop() as L:
        h = L.carry(np.zeros((2, H)), name="h")
        h_new = vg.tanh(L.step(xs) @ W_x + h @ W_h + b)
        L.update(h, h_new)
    return g, vg.sum(L.stack(h_new) ** 2)


def elman_feed(T, I=3, seed=0):
    return {"xs": np.random.default_rng(seed).normal(size=(T, 2, I))}


def test_an_elman_steps_rows_are_read_by_the_bias_and_the_tied_weight_from_the_buffer():
    """The step copies the ``tanh``'s gradient into its row of ``x_t @ W_x``'s buffer as soon as
    it is complete, and hands the row on through the additions: the bias and ``W_h`` collect the
    rows of the one buffer (which ``W_h``'s product then reads as its stack, no copy), with one
    collector each for all the iterations (no lazy gradient made and merged per iteration)."""
    T = 6
    g, loss = elman()
    cg = g.build(elman_feed(T), loss, cache=False)
    (instance,) = cg.programs.values()
    seen = {}
    hoisted = program.ProgramInstance._backward_hoisted

    def spy(self, run, collected, seqs, caps, seq_grad, accs, keep):
        (h,) = self.variant.rowed
        names = [v.name for v in self.variant.captured]
        seen["buffer"] = buffer = collected[h].buf
        seen["rows"] = collected[h].rows  # (the buffer's rows, as the steps were handed them)
        seen["W_h"] = w_h = accs[names.index("W_h")].g
        seen["b"] = accs[names.index("b")].g
        seen["stack"] = ops._rows_stack(w_h.g[::-1], buffer.dtype, own=False)  # (within the sweep)
        return hoisted(self, run, collected, seqs, caps, seq_grad, accs, keep)

    made = {"products": 0, "sums": 0}
    product_init, sum_init = ops.RowsProductGrad.__init__, ops.LeadingSumGrad.__init__

    def count(kind, init):
        def counted(self, *args):
            made[kind] += 1
            init(self, *args)

        return counted

    with pytest.MonkeyPatch.context() as m:
        m.setattr(program.ProgramInstance, "_backward_hoisted", spy)
        m.setattr(ops.RowsProductGrad, "__init__", count("products", product_init))
        m.setattr(ops.LeadingSumGrad, "__init__", count("sums", sum_init))
        cg.backward(cg.outputs[0])
    buffer, w_h, bias = seen["buffer"], seen["W_h"], seen["b"]
    assert isinstance(w_h, RowsProductGrad) and isinstance(bias, ops.LeadingSumGrad)
    rows = seen["rows"]
    assert all(r.base is buffer for r in rows)
    assert all(a is r for a, r in zip(w_h.g[::-1], rows, strict=True))  # (collected last first)
    assert all(a is r for a, r in zip(bias.parts[::-1], rows, strict=True))
    assert seen["stack"] is buffer
    # one collector per weight for the loop (W_x's product over all iterations, made after it, too)
    assert made == {"products": 2, "sums": 1}, made


def test_a_tanh_gradient_passed_on_to_a_row_is_computed_in_it(monkeypatch):
    """``ops.VJPS_INTO``: the ``tanh``'s VJP writes the gradient that becomes the hoisted node's
    row straight into the row — nothing is copied into the buffer (with the same bits: see
    test_rows_written_in_place_change_no_bit)."""
    copies = []
    into_row = program._into_row

    def counted(row, g):
        out = into_row(row, g)
        if out is row and g is not row:
            copies.append(g.shape)
        return out

    monkeypatch.setattr(program, "_into_row", counted)
    g, loss = elman()
    cg = g.build(elman_feed(6), loss, cache=False)  # (its steps compiled with the counting copy)
    cg.backward(cg.outputs[0])
    assert copies == []
    monkeypatch.setattr(program, "VJPS_INTO", {})  # without: each iteration's gradient copied in
    g, loss = elman()
    g.build(elman_feed(6), loss, cache=False).backward(loss)
    assert len(copies) == 6


@pytest.mark.parametrize(("model", "feed"), [(lstm_lm, lm_feed(9, 4, H=5)), (elman, elman_feed(7))])
def test_rows_written_in_place_change_no_bit(monkeypatch, model, feed):
    """The steps' copies into the buffer and the readers' reading the copy: the same loss and
    gradients, bit for bit, as the steps that return their VJP's arrays (copied after the step)."""
    make = partial(model, H=5)
    value, grads = gradients(*make(), feed)
    monkeypatch.setattr(program, "_into_row", lambda row, g: g)
    monkeypatch.setattr(program, "_into_row_joint", lambda J, p, row: J)
    value_off, grads_off = gradients(*make(), feed)  # (a new graph: its steps compiled anew)
    assert np.asarray(value).tobytes() == np.asarray(value_off).tobytes()
    assert grads.keys() == grads_off.keys()
    for k in grads:
        assert grads[k].tobytes() == grads_off[k].tobytes(), k


def branchy_model(threshold: float):
    """A hoisted ``y = tanh(x_t @ W)`` read by a branch's key and by one of its options only: the
    iterations that choose the other option give ``y`` no gradient (zero rows)."""
    g = vg.VirtualGraph(seed=3)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4), init="orthogonal")
    U = g.parameter("U", (4, 4), init="orthogonal")
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 4)), name="h")
        y = vg.tanh(x @ W)
        a = y + h @ U
        b = vg.sigmoid(h @ U)
        chosen = g.branch(lambda v: int(float(v.sum()) > threshold), [a, b], keys=[y], name="pick")
        L.update(h, chosen)
    return g, vg.sum(L.final(h) ** 2)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 100.0])
def test_iterations_that_give_a_hoisted_node_no_gradient_give_zero_rows(threshold):
    g, loss = branchy_model(threshold)
    feed = {"xs": np.random.default_rng(0).standard_normal((6, 2, 3))}
    _, prog = assert_identical(g, feed, loss)
    instance = next(iter(prog.programs.values()))
    assert [v.op.name for v in instance.variant.hoisted] == ["MatMul", "Tanh"]
    assert instance.variant.rowed == [1]  # (MatMul's gradient comes from Tanh's VJP, after the sweep)
    chosen = {d.value for d in prog.decisions if d.kind == "option"}
    assert chosen == ({0} if threshold == 100.0 else {0, 1})


def test_hoisted_nodes_whose_rows_the_step_cannot_write_collect_them_after_the_step():
    """Two places of the step add to ``y``'s gradient, so no row is handed in (their sum is not the
    first one's row, which that one's other readers may hold): the driver copies each iteration's
    sum into the buffer. ``z[0]`` is hoisted with ``z``: its VJP, after the sweep, gives ``z`` a
    lazy gradient (a view's), made dense before ``z``'s VJP reads it, as the engine does."""
    g = vg.VirtualGraph(seed=4)
    xs = g.input("xs", (None, 2, 3), requires_grad=True)
    W = g.parameter("W", (3, 3), init="orthogonal")
    with g.loop() as L:
        x = L.step(xs)
        h = L.carry(np.zeros((2, 3)), name="h")
        y = vg.tanh(x @ W)
        z = vg.exp(x)
        L.update(h, vg.tanh(y * h + y) + z[0])
    loss = vg.sum(L.final(h) ** 2)
    feed = {"xs": np.random.default_rng(1).standard_normal((5, 2, 3))}
    _, prog = assert_identical(g, feed, loss)
    variant = next(iter(prog.programs.values())).variant
    assert [v.op.name for v in variant.hoisted] == ["MatMul", "Tanh", "Exp", "GetItem"]
    assert variant.stepped_grads == [False, True, False, True]  # (the others' come from VJPs after)
    assert variant.rowed == [3]  # z[0]'s: one place; y's: two
