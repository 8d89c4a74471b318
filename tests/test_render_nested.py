"""Drawing nested loops (both views, every example model, a 3-deep nest), Jupyter display that
never raises, and typed errors for wrong argument types at render's public entry points."""

from __future__ import annotations

import numpy as np
import pytest
from test_render import MODELS, Dot, backward_all, load_model, require_dot

import vgraph as vg
from vgraph import render as R
from vgraph.cli import main
from vgraph.errors import VGraphError

pytestmark = pytest.mark.usefixtures("per_node")  # (conftest) per-node drawings; of programs: test_programs

MODEL_NAMES = sorted(p.stem for p in MODELS.glob("*.py"))


def three_deep(a: int = 2, b: int = 2, c: int = 3):
    """Loops nested three deep: outer (a) > middle (b) > inner (c), each carrying a state."""
    g = vg.VirtualGraph(dtype=np.float64, name="three deep")
    x = g.input("x", shape=(2,))
    W = g.parameter("W", (2, 2), init="orthogonal")
    with g.loop(times=a, name="outer") as outer:
        u = outer.carry(x, name="u")
        with g.loop(times=b, name="middle") as middle:
            v = middle.carry(u, name="v")
            with g.loop(times=c, name="inner") as inner:
                w = inner.carry(v, name="w")
                inner.update(w, vg.tanh(w @ W))
            middle.update(v, inner.final(w))
        outer.update(u, middle.final(v))
    loss = (outer.final(u) ** 2).sum()
    return g, loss, {"x": np.array([0.3, -0.2])}


@pytest.fixture
def needs_dot() -> str:
    return require_dot()


# ---------------------------------------------------------------------------- nested loops


def test_cli_draws_the_virtual_view_of_the_stacked_rnn(tmp_path, capsys):
    out = tmp_path / "s.dot"
    assert main(["render", str(MODELS / "stacked_rnn.py"), "-o", str(out)]) == 0, capsys.readouterr().err
    d = Dot(out.read_text())
    # the time loop (declared inside the layers loop) is drawn inside it
    assert d.clusters["cluster_loop_2"] == ["cluster_loop_1"]
    assert d.where["Tanh:1"] == ["cluster_loop_1", "cluster_loop_2"]
    assert d.where["Parameter:3"] == ["cluster_loop_1"]  # a layer's Wh: in the layer, not in time
    assert main(["render", str(MODELS / "stacked_rnn.py"), "-o", str(out), "--taken"]) == 0
    assert "this build: 4 iterations in each of 2 runs" in out.read_text()


def test_three_deep_nest_virtual_view():
    g, loss, feed = three_deep()
    d = Dot(R.to_dot(g))
    assert d.clusters == {
        "cluster_loop_1": [],
        "cluster_loop_2": ["cluster_loop_1"],
        "cluster_loop_3": ["cluster_loop_1", "cluster_loop_2"],
    }
    assert d.where["Tanh:1"] == ["cluster_loop_1", "cluster_loop_2", "cluster_loop_3"]
    assert d.where["Carry:2"] == ["cluster_loop_1", "cluster_loop_2"]
    back = {(a, b) for a, b, attrs in d.edges if "constraint=false" in attrs}
    assert back == {("Final:2", "Carry:1"), ("Final:1", "Carry:2"), ("Tanh:1", "Carry:3")}
    cg = g.build(feed, loss)
    d = Dot(R.to_dot(g, build=cg))
    assert "this build: 3 iterations in each of 4 runs" in d.cluster_attrs["cluster_loop_3"]


def test_three_deep_nest_unrolled_view():
    a, b, c = 2, 2, 3
    g, loss, feed = three_deep(a, b, c)
    cg = g.build(feed, loss)
    d = Dot(R.to_dot(cg))
    assert len(d.iteration_clusters()) == a + a * b + a * b * c
    for i in range(a):
        for j in range(b):
            for k in range(c):
                key = f"Tanh:1@{i}.{j}.{k}"
                assert d.where[key][-1] == f"cluster_iter_Loop_3_{i}_{j}_{k}"
                assert f"cluster_iter_Loop_2_{i}_{j}" in d.where[key]
                assert f"cluster_iter_Loop_1_{i}" in d.where[key]
    backward_all(cg, loss)
    contrib = R.gradient_through_time(cg, "W")
    assert contrib.shape == (a, 2, 2)  # split over the outermost loop by default
    np.testing.assert_allclose(contrib.sum(0), g.params["W"].grad, rtol=1e-12)
    inner = R.gradient_through_time(cg, "W", loop="inner")
    assert inner.shape == (c, 2, 2)
    np.testing.assert_allclose(inner.sum(0), g.params["W"].grad, rtol=1e-12)
    # a long inner loop folds inside every drawn outer iteration
    g, loss, feed = three_deep(2, 1, 20)
    d = Dot(R.to_dot(g.build(feed, loss)))
    assert len(d.fold_nodes()) == 2 and all("14 iterations" in d.nodes[f] for f in d.fold_nodes())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_both_views_of_every_example_model(name, tmp_path):
    m = load_model(name)
    g, feed, outputs = m.build()
    virtual = Dot(R.to_dot(g))
    assert {f"{v.type}:{v.id}" for v in g.nodes if v.kind != "loop"} == set(virtual.nodes)
    cg = g.build(feed, outputs)
    assert "not built" not in Dot(R.to_dot(g, build=cg)).text or name == "branching"
    unrolled = Dot(R.to_dot(cg, fold=None))
    drawn = {nid for nid in unrolled.nodes if not nid.startswith("ref:") and nid != "legend"}
    assert {str(n.key) for n in cg.nodes() if n.key.type not in R.GUARD_TYPES} == drawn
    backward_all(cg, cg.outputs[0])
    assert "legend" in Dot(R.to_dot(cg, gradients=True)).nodes
    for argv in ([], ["--taken"], ["--unrolled"], ["--gradients"], ["--all"]):
        out = tmp_path / "out.dot"
        assert main(["render", str(MODELS / f"{name}.py"), "-o", str(out), *argv]) == 0, argv
        assert out.read_text().startswith("digraph")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_example_model_renders_svg(needs_dot, name, tmp_path):
    m = load_model(name)
    g, feed, outputs = m.build()
    assert "<svg" in R.to_svg(g)
    cg = g.build(feed, outputs)
    assert "<svg" in R.to_svg(cg)
    assert "image/svg+xml" in g._repr_mimebundle_() and "image/svg+xml" in cg._repr_mimebundle_()


# ---------------------------------------------------------------------------- display never raises


def test_display_falls_back_to_text_with_the_reason(monkeypatch):
    g, loss, feed = three_deep()
    cg = g.build(feed, loss)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("vgraph.render.output._scene", broken)
    for obj in (g, cg):
        bundle = obj._repr_mimebundle_()
        assert set(bundle) == {"text/plain"}
        assert bundle["text/plain"].startswith(repr(obj))
        assert "drawing failed: RuntimeError: boom" in bundle["text/plain"]
        assert obj._repr_svg_() is None
    monkeypatch.undo()
    monkeypatch.setattr("vgraph.render.output.REPR_MAX_NODES", 3)
    bundle = cg._repr_mimebundle_()
    assert set(bundle) == {"text/plain"} and "REPR_MAX_NODES (3)" in bundle["text/plain"]


def test_display_survives_a_failing_repr(monkeypatch):
    g = three_deep()[0]
    monkeypatch.setattr(vg.VirtualGraph, "__repr__", lambda self: 1 / 0)
    monkeypatch.setattr("vgraph.render.output.REPR_MAX_NODES", 0)
    text = g._repr_mimebundle_()["text/plain"]
    assert "repr failed: ZeroDivisionError" in text and "REPR_MAX_NODES" in text


# ---------------------------------------------------------------------------- typed errors


def test_wrong_argument_types_raise_type_errors_naming_the_argument(tmp_path):
    g, loss, feed = three_deep()
    cg = g.build(feed, loss)
    cases = [
        (lambda: R.retain_all_grads(5), "cg must be a ComputeGraph"),
        (lambda: R.retain_all_grads(g), "cg must be a ComputeGraph.*VirtualGraph"),
        (lambda: R.gradient_norms("x"), "cg must be a ComputeGraph"),
        (lambda: R.gradient_through_time(None, "W"), "cg must be a ComputeGraph"),
        (lambda: R.gradient_through_time(cg, 3.5), "param must be"),
        (lambda: R.gradient_through_time(cg, "W", loop=3), "loop must be"),
        (lambda: R.gradient_through_time(cg, "W", plot=3), "plot must be"),
        (lambda: R.to_dot(5), "graph must be a VirtualGraph or a ComputeGraph"),
        (lambda: R.to_dot(cg, dpi="abc"), "dpi must be a positive number"),
        (lambda: R.to_dot(cg, gradients="yes"), "gradients must be True or False"),
        (lambda: R.to_dot(cg, shapes=None), "shapes must be True or False"),
        (lambda: R.to_dot(cg, fold=5), "fold must be"),
        (lambda: R.to_dot(cg, iterations=5), "iterations must be"),
        (lambda: R.to_dot(cg, iterations=[1.5]), "iterations must be"),
        (lambda: R.to_dot(cg, title=3), "title must be"),
        (lambda: R.to_dot(cg, rankdir=None), "rankdir must be"),
        (lambda: R.to_dot(g, build=5), "build must be an unrolled build"),
        (lambda: R.render(cg, 5), "path must be a file path"),
        (lambda: R.render(cg, tmp_path / "x.dot", format=5), "format must be"),
        (lambda: R.to_svg(cg, dpi=[1]), "dpi must be"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
    for bad in (0, -3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="dpi must be a positive number"):
            R.to_dot(cg, dpi=bad)
    assert "dpi=144.0" in R.to_dot(cg, dpi=144)
    assert not any(n.retains_grad for n in cg.nodes())  # the failed calls changed nothing
    other = three_deep()[0]
    with pytest.raises(VGraphError, match="another VirtualGraph"):
        R.gradient_through_time(cg, "W", loop=next(v for v in other.nodes if v.kind == "loop"))
