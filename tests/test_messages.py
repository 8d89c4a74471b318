"""Error messages that name the right thing: the node, the iteration, the input of a batch, the
argument to change — and typed errors for arguments of the wrong type."""

from __future__ import annotations

import re

import numpy as np
import pytest

import vgraph as vg
from vgraph import ComputeGraph

# ---------------------------------------------------------------------------- recursions


def _tree_reading_slot(slot: int) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """A recursion whose body reads child slots 0 and ``slot``."""
    g = vg.VirtualGraph(dtype=np.float64)
    kids = g.input("children", (None, None))
    with g.recurse(kids) as r:
        h = r.state(np.zeros(2), name="h")
        r.update(h, vg.tanh(r.child(h, 0) + r.child(h, slot) + 1.0))
    return g, vg.sum(r.final(h))


#   2
#  / \
# 0   1
TREE = np.array([[-1, -1], [-1, -1], [0, 1]])
WIDTH_ERROR = (
    r"<Loop:1>: the children array <Input:1> 'children' has width 2 \(child slots 0\.\.1\), "
    r"but <Child:2> 'h\[2\]' reads slot 2"
)


def test_a_child_slot_beyond_the_children_arrays_width_is_a_structure_error():
    g, out = _tree_reading_slot(2)
    with pytest.raises(vg.StructureError, match=WIDTH_ERROR):
        g.build({"children": TREE}, out)
    assert len(g.params) == 0 and g.latest_build is None


@pytest.mark.parametrize("depth", [True, False])
def test_a_child_slot_beyond_the_width_in_a_batched_build(depth):
    g, out = _tree_reading_slot(2)
    wide = np.array([[-1, -1, -1], [-1, -1, -1], [0, -1, 1]])
    with pytest.raises(vg.StructureError, match="input 1: " + WIDTH_ERROR):
        g.build_batch([{"children": wide}, {"children": TREE}], out, depth=depth)


def test_a_zero_width_children_array_names_no_slot():
    g, out = _tree_reading_slot(1)
    with pytest.raises(vg.StructureError, match=r"has width 0 \(no child slot\), but <Child:1> 'h\[0\]'"):
        g.build({"children": np.zeros((3, 0), dtype=np.int64)}, out)


def test_a_wide_enough_array_still_builds_as_before():
    g, out = _tree_reading_slot(2)
    wide = np.array([[-1, -1, -1], [-1, -1, -1], [0, -1, 1]])  # node 2: children 0 (slot 0), 1 (slot 2)
    leaf = np.tanh(1.0)
    assert g.build({"children": wide}, out).forward() == pytest.approx(2 * np.tanh(2 * leaf + 1.0))


def test_the_recursion_limit_names_max_nodes_the_argument_of_recurse():
    g = vg.VirtualGraph(dtype=np.float64)
    kids = g.input("children", (None, 2))
    with g.recurse(kids, max_nodes=2) as r:
        h = r.state(np.zeros(2), name="h")
        r.update(h, vg.tanh(r.child(h, 0) + r.child(h, 1) + 1.0))
    out = vg.sum(r.final(h))
    message = r"<Loop:1>: the children array <Input:1> 'children' has 3 nodes, more than max_nodes=2; raise g.recurse's max_nodes"
    with pytest.raises(vg.LoopLimitError, match=message) as info:
        g.build({"children": TREE}, out)
    assert "max_iters" not in str(info.value)  # g.recurse has no such argument
    with pytest.raises(vg.LoopLimitError, match="input 0: " + message) as info:
        g.build_batch([{"children": TREE}], out)
    assert "max_iters" not in str(info.value)
    assert g.build({"children": TREE[:2]}, out).forward() == pytest.approx(2 * np.tanh(1.0))


def test_the_loop_limit_names_max_iters_the_argument_of_loop():
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", ())
    with g.loop(while_=lambda t, state: True, max_iters=3) as L:
        h = L.carry(x, name="h")
        L.update(h, h + 1.0)
    out = L.final(h)
    with pytest.raises(vg.LoopLimitError, match=r"reached max_iters=3 and would go on; raise max_iters"):
        g.build({"x": np.array(0.0)}, out)
    with pytest.raises(vg.LoopLimitError, match=r"input 0: .*reached max_iters=3 .*raise max_iters"):
        g.build_batch([{"x": np.array(0.0)}], out)


# ---------------------------------------------------------------------------- batched groups


def _lookup_loop() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    ids = g.input("ids", (None,))
    E = g.parameter("E", (5, 3))
    with g.loop() as L:
        h = L.carry(np.zeros(3), name="h")
        L.update(h, vg.tanh(h + vg.take(E, L.step(ids))))
    return g, vg.sum(L.final(h))


TAKE_AT_3 = r"cannot compute Take of <Parameter:1> 'E' \(5, 3\), <Item:1@3> \(\): index 9 is out of bounds for axis 0 with size 5"


def test_a_failing_group_names_the_input_that_caused_it():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    i = g.input("i", ())
    E = g.parameter("E", (5, 3))
    out = vg.sum(vg.take(E, i))
    feeds = [{"i": np.array(1)}, {"i": np.array(7)}, {"i": np.array(2)}]
    # as a build of input 1 alone says it, prefixed with the input
    alone = r"<Take:1>: cannot compute Take of <Parameter:1> 'E' \(5, 3\), <Input:1> 'i' \(\): index 7 is out of bounds for axis 0 with size 5"
    with pytest.raises(vg.ShapeError, match="^" + alone):
        g.build(feeds[1], out)
    with pytest.raises(vg.ShapeError, match="^input 1: " + alone):
        g.build_batch(feeds, out)


@pytest.mark.parametrize("programs", [True, False])
@pytest.mark.parametrize("hoist", [True, False])
def test_a_failing_group_in_a_loop_names_the_input_and_the_iteration(hoist, programs):
    g, out = _lookup_loop()
    good, bad = np.array([0, 1, 2, 3, 4]), np.array([0, 1, 2, 9, 4])
    # (a program over rows that fails runs the loop op by op, which raises without hoisting)
    hoisted = r" \(hoisted: computed for every iteration by <Take\*:1>\)" if hoist and not programs else ""
    with pytest.raises(vg.ShapeError, match=rf"^input 1: <Take:1@3>{hoisted}: {TAKE_AT_3}"):
        g.build_batch([{"ids": good}, {"ids": bad}, {"ids": good}], out, hoist=hoist, programs=programs)


@pytest.mark.parametrize("depth", [True, False])
@pytest.mark.parametrize("hoist", [True, False])
def test_a_failing_group_in_a_recursion_names_the_input_and_the_tree_node(depth, hoist):
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    kids = g.input("children", (None, 2))
    ids = g.input("ids", (None,))
    E = g.parameter("E", (5, 2))
    with g.recurse(kids) as r:
        h = r.state(np.zeros(2), name="h")
        r.update(h, vg.tanh(r.child(h, 0) + r.child(h, 1) + vg.take(E, r.step(ids))))
    out = vg.sum(r.final(h))
    feeds = [{"children": TREE, "ids": np.array([0, 1, 2])}, {"children": TREE, "ids": np.array([0, 6, 2])}]
    with pytest.raises(
        vg.ShapeError,
        match=r"^input 1: <Take:1@1>.*: cannot compute Take of .*<Item:1@1> \(\): index 6 is out of bounds",
    ):
        g.build_batch(feeds, out, depth=depth, hoist=hoist)


# ---------------------------------------------------------------------------- hoisted bodies


def test_an_out_of_range_take_in_a_hoisted_body_names_the_iteration_the_index_and_the_bound():
    g, out = _lookup_loop()
    with pytest.raises(
        vg.ShapeError,
        match=rf"^<Take:1@3> \(hoisted: computed for every iteration by <Take\*:1>\): {TAKE_AT_3}",
    ):
        g.build({"ids": np.array([0, 1, 2, 9, 3])}, out)
    # the plain unroll says the same of its node
    with pytest.raises(vg.ShapeError, match=rf"^<Take:1@3>: {TAKE_AT_3}"):
        g.build({"ids": np.array([0, 1, 2, 9, 3])}, out, hoist=False)


def _sqrt_loop() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    """sqrt(x_t * w): finite at x_t = 0, with an infinite derivative there."""
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2))
    w = g.parameter("w", (2,), init=np.ones(2))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + (L.step(xs) * w) ** 0.5)
    return g, vg.sum(L.final(h))


# How the two paths say a node is computed for every iteration at once (see vgraph.virtual.hoist
# and vgraph.virtual.program): both name the iteration's node.
HOISTED = {
    False: r" \(hoisted: computed for every iteration by <{}\*:1>\)",
    True: r" \(computed for every iteration at once in the body program of <Loop:1>\)",
}
SQRT_AT_6 = (
    r"Inf first appears in backward at <Pow:1@6>{}: "
    r"the VJP of Pow gave a non-finite gradient for its input <Mul:1@6> from a finite incoming gradient\n"
    r"  incoming gradient: shape \(2,\), finite"
)


@pytest.mark.parametrize("programs", [False, True])
def test_an_anomaly_in_hoisted_backward_names_the_iteration(programs):
    g, loss = _sqrt_loop()
    xs = np.ones((9, 2))
    xs[6, 1] = 0.0
    cg = g.build({"xs": xs}, loss, programs=programs)
    assert programs or any(k.type == "Pow*" for k in cg._nodes)  # hoisted
    with pytest.raises(vg.NonFiniteError, match="^" + SQRT_AT_6.format(HOISTED[programs].format("Pow"))):
        cg.backward(cg.outputs[0], detect_anomaly=True)
    assert g.params["w"].grad is None


@pytest.mark.parametrize("programs", [False, True])
def test_an_anomaly_for_a_weight_of_a_hoisted_group_names_the_iteration(programs):
    # x_t @ W overflows in backward at t = 4 only: W's gradient is the sum over iterations, so
    # the iteration is found by each row's VJP alone.
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs, ss = g.input("xs", (None, 2)), g.input("ss", (None, 2))
    W = g.parameter("W", (2, 2), init=np.full((2, 2), 1e-200))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + (L.step(xs) @ W) * L.step(ss))
    loss = vg.sum(L.final(h))
    big = np.ones((9, 2))
    big[4] = 1e200
    expected = (
        r"^Inf first appears in backward at <MatMul:1@4>{}: the VJP of MatMul gave a non-finite "
        r"gradient for its input <Parameter:1> 'W' from a finite incoming gradient\n"
        r"  incoming gradient: shape \(2,\), finite, min 1e\+200, max 1e\+200\n"
        r"  input <Item:1@4>: shape \(2,\), finite, min 1e\+200"
    )
    for hoist, note in [(True, HOISTED[programs].format("MatMul")), (False, "")]:
        if programs and not hoist:  # (a program without hoisting: the body's own backward step)
            continue
        cg = g.build({"xs": big, "ss": big}, loss, hoist=hoist, programs=programs)
        with pytest.raises(vg.NonFiniteError, match=expected.format(note)):
            cg.backward(cg.outputs[0], detect_anomaly=True)


def test_an_anomaly_in_a_hoisted_forward_names_the_iterations_inputs():
    g, loss = _sqrt_loop()
    xs = np.ones((9, 2))
    xs[6, 1] = -1.0
    with pytest.raises(
        vg.NonFiniteError,
        match=r"^NaN first appears at <Pow:1@6> \(hoisted: computed for every iteration by <Pow\*:1>\): "
        r".*\n  input <Mul:1@6>: shape \(2,\), finite, min -1, max 1\n  output: shape \(2,\), has NaN",
    ):
        g.build({"xs": xs}, loss, detect_anomaly=True)


# ---------------------------------------------------------------------------- anomalies in batches


def test_an_anomaly_in_a_batched_forward_names_the_input_and_its_unrolled_node():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + vg.log(L.step(xs) + h))
    loss = vg.sum(L.final(h))
    good, bad = np.ones((9, 2)), np.ones((9, 2))
    bad[6, 1] = -50.0
    for hoist in (True, False):
        with (
            vg.detect_anomaly(),
            pytest.raises(
                vg.NonFiniteError, match=r"^input 1: NaN first appears at <Log:1@6>: log of a negative input"
            ),
        ):
            g.build_batch([{"xs": good}, {"xs": bad}, {"xs": good}], loss, hoist=hoist)


def test_a_non_finite_input_in_a_batch_is_named_as_in_a_build_of_that_input_alone():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (2,))
    w = g.parameter("w", (2,), init=np.ones(2))
    out = vg.sum(x * w)
    bad = np.array([1.0, np.nan])
    alone = r"NaN enters at <Mul:1> \(Mul\) from <Input:1> 'x', which is already non-finite\n  input <Input:1> 'x': shape \(2,\), has NaN"
    with vg.detect_anomaly():
        with pytest.raises(vg.NonFiniteError, match="^" + alone):
            g.build({"x": bad}, out)
        with pytest.raises(vg.NonFiniteError, match="^input 1: " + alone):
            g.build_batch([{"x": np.ones(2)}, {"x": bad}, {"x": np.ones(2)}], out)


def test_an_anomaly_in_a_batched_hoisted_group_names_the_input_and_the_iteration():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    xs = g.input("xs", (None, 2))
    with g.loop() as L:
        h = L.carry(np.zeros(2), name="h")
        L.update(h, h + vg.log(L.step(xs)))
    loss = vg.sum(L.final(h))
    good, bad = np.ones((9, 2)), np.ones((9, 2))
    bad[6, 1] = -1.0
    with (
        vg.detect_anomaly(),
        pytest.raises(
            vg.NonFiniteError,
            match=r"^input 1: NaN first appears at <Log:1@6> \(hoisted: computed for every iteration by <Log\*:1>\)",
        ),
    ):
        g.build_batch([{"xs": good}, {"xs": bad}], loss)


@pytest.mark.parametrize("hoist", [True, False])
def test_an_anomaly_in_a_batched_backward_names_the_input_and_its_unrolled_node(hoist):
    g, loss = _sqrt_loop()
    good, bad = np.ones((9, 2)), np.ones((9, 2))
    bad[6, 1] = 0.0
    batch = g.build_batch([{"xs": good}, {"xs": good}, {"xs": bad}], loss, hoist=hoist)
    at = SQRT_AT_6.format(HOISTED[False].format("Pow") if hoist else "")  # (batched: node by node)
    with vg.detect_anomaly(), pytest.raises(vg.NonFiniteError, match="^input 2: " + at):
        batch.backward()
    with pytest.raises(vg.NonFiniteError, match="^input 2: " + at):
        batch.backward(detect_anomaly=True)
    assert g.params["w"].grad is None
    # The failed calls left the graph as it was: a backward without detection runs (into numpy's
    # NaN), on the one combined loss node.
    assert batch.loss() is batch.loss()
    with np.errstate(divide="ignore", invalid="ignore"):
        batch.backward()
    assert g.params["w"].grad is not None and not np.isfinite(g.params["w"].grad).all()


# ---------------------------------------------------------------------------- argument types


def _model() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", (2,), requires_grad=True)
    return g, vg.sum(x * x)


@pytest.mark.parametrize(
    ("option", "call"),
    [
        ("build(hoist=...)", lambda g, y: g.build({"x": np.ones(2)}, y, hoist="yes")),
        ("build(cache=...)", lambda g, y: g.build({"x": np.ones(2)}, y, cache=1)),
        ("build(detect_anomaly=...)", lambda g, y: g.build({"x": np.ones(2)}, y, detect_anomaly="no")),
        ("build(hoist=...)", lambda g, y: vg.build_compute_graph(g, {"x": np.ones(2)}, y, hoist=None)),
        ("build_batch(hoist=...)", lambda g, y: g.build_batch([{"x": np.ones(2)}], y, hoist="yes")),
        ("build_batch(depth=...)", lambda g, y: g.build_batch([{"x": np.ones(2)}], y, depth=0)),
    ],
)
def test_build_options_of_the_wrong_type_are_typed_errors(option, call):
    g, y = _model()
    with pytest.raises(vg.ArgumentError, match=rf"^{re.escape(option)} must be True or False, got "):
        call(g, y)
    assert g.latest_build is None and g._builds == 0  # nothing was built


@pytest.mark.parametrize(
    ("option", "call"),
    [
        ("forward(explain=...)", lambda cg, y: cg.forward(y, explain="yes")),
        ("forward(detect_anomaly=...)", lambda cg, y: cg.forward(y, detect_anomaly=1)),
        ("backward(detect_anomaly=...)", lambda cg, y: cg.backward(y, detect_anomaly="yes")),
        ("backward_ex(retain_graph=...)", lambda cg, y: cg.backward_ex(y, retain_graph="yes")),
        ("backward_ex(detect_anomaly=...)", lambda cg, y: cg.backward_ex(y, detect_anomaly=[])),
        ("grad(retain_graph=...)", lambda cg, y: cg.grad(y, cg.inputs["x"], retain_graph="no")),
        ("grad(allow_unused=...)", lambda cg, y: cg.grad(y, cg.inputs["x"], allow_unused=0)),
        ("grad(detect_anomaly=...)", lambda cg, y: cg.grad(y, cg.inputs["x"], detect_anomaly="on")),
    ],
)
def test_sweep_options_of_the_wrong_type_are_typed_errors(option, call):
    g, y = _model()
    cg = g.build({"x": np.ones(2)}, y)
    out = cg.outputs[0]
    with pytest.raises(vg.ArgumentError, match=rf"^{re.escape(option)} must be True or False, got "):
        call(cg, out)
    assert cg.inputs["x"].grad is None
    cg.backward(out)  # the failed call changed nothing: the graph was not released
    np.testing.assert_array_equal(cg.inputs["x"].grad, [2.0, 2.0])


def test_numpy_bools_are_accepted_as_options():
    g, y = _model()
    cg = g.build({"x": np.ones(2)}, y, hoist=np.True_, cache=np.False_)
    assert cg.backward(cg.outputs[0], detect_anomaly=np.False_) == 2.0


def test_the_batch_loss_reduction_of_the_wrong_type_is_a_typed_error():
    g, y = _model()
    batch = g.build_batch([{"x": np.ones(2)}], y)
    with pytest.raises(
        vg.ArgumentError, match=r"^loss\(reduction=\.\.\.\) must be 'mean' or 'sum', got int 1"
    ):
        batch.backward(1)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'max'"):
        batch.backward("max")
    with pytest.raises(vg.ArgumentError, match=r"^backward\(detect_anomaly=\.\.\.\) must be True or False"):
        batch.backward(detect_anomaly="yes")


def test_computed_when_read_of_something_not_a_node_is_a_typed_error():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones(2), name="x")
    with pytest.raises(
        vg.ArgumentError,
        match=r"^computed_when_read\(\): node must be a ComputeNode of this graph, got str 'x' "
        r"\(look a node up by its key with cg.node\('x'\)\)",
    ):
        cg.computed_when_read("x")
    assert cg.computed_when_read(x) is False
    other = ComputeGraph(dtype=np.float64).input(np.ones(2))
    with pytest.raises(vg.GraphStateError, match=r"<Input:1> is not a node of this graph"):
        cg.computed_when_read(other)


def test_argument_errors_are_type_errors_and_vgraph_errors():
    assert issubclass(vg.ArgumentError, TypeError) and issubclass(vg.ArgumentError, vg.VGraphError)
