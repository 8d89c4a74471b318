"""Drawing autobatching (issue 12): ``render.to_dot(batch)`` draws one node per batch group,
labelled with its declared node and how many copies and inputs it served;
``render.to_dot(batch.unrolled(i))`` draws input ``i`` exactly as a one-at-a-time build does,
and ``batch_groups=True`` says under each of its nodes which group computed it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_batch import branchy_tree_model, tree_feeds

from vgraph import render

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


@pytest.fixture
def built():
    """A batch built op by op (each level's copies of a body node as one group)."""
    g, (loss,) = branchy_tree_model()
    feeds = tree_feeds([3, 2, 4], 1)
    return g, loss, feeds, g.build_batch(feeds, loss, programs=False)


def tooltips(dot):
    return re.findall(r'tooltip="<([^>"]*)>: (\d+) copies of <([^>"]*)> for (\d+) inputs"', dot)


def test_batch_view_draws_one_node_per_group(built):
    g, loss, feeds, batch = built
    dot = render.to_dot(batch)
    groups = tooltips(dot)
    assert len(groups) == len(batch.groups)  # every group (and every input alone) one node
    drawn = sorted((decl.replace("*", ""), int(n)) for _, n, decl, _ in groups)
    assert drawn == sorted((k.replace("*", ""), n) for k, n in batch.groups)
    # the leaf option's product ran once for all 9 leaves of the 3 trees
    assert ("MatMul:1", 9, 3) in {(decl, int(n), int(k)) for _, n, decl, k in groups}
    assert "×9 copies, 3 inputs" in dot and "batched build of 3 inputs" in dot
    assert re.search(r"input \d alone", dot) or all(int(n) > 1 for _, n, _, _ in groups)
    assert len(re.findall(r'fillcolor="#2b6cb0"', dot)) >= 1  # the largest group in the darkest blue
    assert render.to_dot(batch) == dot  # deterministic


def test_one_input_drawn_as_a_one_at_a_time_build(built):
    g, loss, feeds, batch = built
    for i, feed in enumerate(feeds):
        alone = g.build(feed, loss, cache=False)
        assert render.to_dot(batch.unrolled(i)) == render.to_dot(alone)
        np.testing.assert_allclose(batch.unrolled(i).outputs[0].value, batch.outputs()[i], rtol=1e-12)


def test_batch_groups_marks_which_group_computed_each_node(built):
    g, loss, feeds, batch = built
    cg = batch.unrolled(2)
    dot = render.to_dot(cg, batch_groups=True, fold=None)
    plain = render.to_dot(cg, fold=None)
    assert "batched" not in plain
    marks = re.findall(r"batched ×(\d+) copies, (\d+) inputs in &lt;([^&]*)&gt;", dot)
    assert marks and all(int(k) <= 3 for _, k, _ in marks)
    # every leaf of input 2 (4 leaves) ran in the group of all 9 leaves
    leaf_marks = [m for m in marks if m[2].startswith("MatMul*:1@")]
    assert len(leaf_marks) == 4 and {m[0] for m in leaf_marks} == {"9"}
    group = {str(n.key) for n in batch.graph.nodes()}
    assert all(m[2] in group for m in marks)  # the marks name nodes of the batched graph
    node, copies, inputs = batch.ran_with(
        2, next(n.key for n in cg.nodes() if n.key.type == "MatMul" and n.key.id == 1)
    )
    assert (copies, inputs) == (9, 3) and batch.group_info(node)[1:] == (9, 3)


def test_batch_groups_of_a_recursion_run_as_a_program_over_tree_nodes():
    """Run as one program over tree nodes, a body node was computed by the loop node, with the
    tree nodes of its level (all 9 leaves of the 3 trees at once)."""
    g, (loss,) = branchy_tree_model()
    feeds = tree_feeds([3, 2, 4], 1)
    batch = g.build_batch(feeds, loss)
    (instance,) = batch.rows_programs
    cg = batch.unrolled(2)
    dot = render.to_dot(cg, batch_groups=True, fold=None)
    marks = re.findall(r"batched ×(\d+) copies, (\d+) inputs in &lt;([^&]*)&gt;", dot)
    loop = str(batch.graph.node(instance.node_key).key)
    tanh = [n.key for n in cg.nodes() if n.key.type == "Tanh" and n.key.id == 1]  # the leaves'
    assert len(tanh) == 4
    for key in tanh:
        node, copies, inputs = batch.ran_with(2, key)
        assert (str(node.key), copies, inputs) == (loop, 9, 3)
    assert ("9", "3", loop) in marks


def test_bad_batch_drawing_options_are_typed_errors(built):
    g, loss, feeds, batch = built
    with pytest.raises(ValueError, match=r"batch\.unrolled"):
        render.to_dot(g.build(feeds[0], loss, cache=False), batch_groups=True)
    with pytest.raises(ValueError, match="batch view"):
        render.to_dot(batch, gradients=True)
    with pytest.raises(TypeError, match="batch_groups"):
        render.to_dot(batch.unrolled(0), batch_groups="yes")
    with pytest.raises(IndexError, match="3 inputs"):
        batch.unrolled(3)


def test_the_example_draws_its_batch(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "autobatch.py"
    spec = importlib.util.spec_from_file_location("autobatch_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "batch.dot"
    module.main(["--steps", "2", "--batch", "4", "--draw", str(out), "--progress", "off"])
    text = out.read_text()
    assert "4 sentences, batched" in text and "×4 inputs" in text
    assert "batched ×4 inputs in" in (tmp_path / "batch-input0.dot").read_text()
