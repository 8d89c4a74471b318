"""Drawing graphs (vgraph.render, vgraph.cli): DOT structure on tiny graphs, folding of long loops,
determinism, the gradient overlay, gradient_through_time, the CLI, and real rendering with
Graphviz's ``dot``.

Tests that run ``dot`` are skipped when it is not installed, unless ``VGRAPH_REQUIRE_DOT=1`` is
set (as in CI), in which case they fail. Missing-``dot`` behaviour is tested by emptying PATH.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import vgraph as vg
from vgraph import render as R
from vgraph.cli import main
from vgraph.compute import ComputeGraph, NodeKey
from vgraph.errors import GraphStateError, RenderError, VGraphError

pytestmark = pytest.mark.usefixtures("per_node")  # (conftest) per-node drawings; of programs: test_programs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"


# ---------------------------------------------------------------------------- helpers


def require_dot() -> str:
    """Graphviz's ``dot``: skip without it, or fail when VGRAPH_REQUIRE_DOT=1 (CI)."""
    exe = shutil.which("dot")
    if exe is None:
        if os.environ.get("VGRAPH_REQUIRE_DOT") == "1":
            pytest.fail("Graphviz's `dot` is not installed but VGRAPH_REQUIRE_DOT=1 requires it")
        pytest.skip("Graphviz's `dot` is not installed (set VGRAPH_REQUIRE_DOT=1 to make this a failure)")
    return exe


@pytest.fixture
def needs_dot() -> str:
    """Graphviz's ``dot`` (see :func:`require_dot`)."""
    return require_dot()


@pytest.fixture
def no_dot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a machine without Graphviz: PATH holds only an empty directory."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("dot") is None


class Dot:
    """The parts of to_dot's output the tests look at (its one-statement-per-line format)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.nodes: dict[str, str] = {}  # id -> attribute text
        self.where: dict[str, list[str]] = {}  # id -> enclosing cluster names, outermost first
        self.clusters: dict[str, list[str]] = {}  # cluster -> enclosing clusters
        self.cluster_attrs: dict[str, str] = {}
        self.edges: list[tuple[str, str, str]] = []
        stack: list[str] = []
        pending: str | None = None
        for line in text.splitlines():
            s = line.strip()
            m = re.match(r"subgraph (\S+) \{$", s)
            if m:
                self.clusters[m[1]] = list(stack)
                stack.append(m[1])
                pending = m[1]
                continue
            if s == "}":
                if stack:
                    stack.pop()
                continue
            if pending and s.startswith("graph ["):
                self.cluster_attrs[pending] = s
                pending = None
                continue
            m = re.match(r'"((?:[^"\\]|\\.)*)" -> "((?:[^"\\]|\\.)*)"(.*)$', s)
            if m:
                if 'style="invis"' not in m[3]:  # layout-only ordering edges
                    self.edges.append((m[1], m[2], m[3]))
                continue
            m = re.match(r'"((?:[^"\\]|\\.)*)" \[(.*)\]$', s)
            if m and not m[1].startswith("order:"):
                assert m[1] not in self.nodes, f"node {m[1]} emitted twice"
                self.nodes[m[1]] = m[2]
                self.where[m[1]] = list(stack)

    def iteration_clusters(self) -> list[str]:
        return [c for c in self.clusters if c.startswith("cluster_iter_")]

    def fold_nodes(self) -> list[str]:
        return [n for n in self.nodes if n.startswith("fold:")]

    def in_iteration(self, node_id: str) -> bool:
        return any(c.startswith("cluster_iter_") for c in self.where[node_id])


def rnn(T: int = 4, H: int = 3, B: int = 2, I: int = 2, seed: int = 0):
    """A tiny Elman RNN: (virtual graph, loss node, feed)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=1, name="rnn")
    x = g.input("x", shape=(None, None, I))
    Wx = g.parameter("Wx", (I, H))
    Wh = g.parameter("Wh", (H, H))
    b = g.parameter("b", (H,), init="normal")
    h0 = g.constant(np.zeros((B, H)), name="h0")
    with g.loop(name="time") as loop:
        xt = loop.step(x)
        h = loop.carry(h0, name="h")
        h_new = vg.tanh(xt @ Wx + h @ Wh + b)
        h_new.name = "h_t"
        loop.update(h, h_new)
    loss = (loop.final(h) ** 2).mean()
    feed = {"x": np.random.default_rng(seed).standard_normal((T, B, I))}
    return g, loss, feed


def unrolled_rnn(T: int = 4, **kw):
    g, loss, feed = rnn(T, **kw)
    return g, loss, g.build(feed, loss)


def load_model(name: str):
    spec = importlib.util.spec_from_file_location(f"model_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def backward_all(cg, loss) -> None:
    R.retain_all_grads(cg)
    cg.backward(loss)


# ---------------------------------------------------------------------------- unrolled structure


def test_unrolled_structure_counts_labels_and_clusters():
    _, _, cg = unrolled_rnn(T=4)
    d = Dot(R.to_dot(cg))
    guards = [n for n in cg.nodes() if n.key.type in R.GUARD_TYPES]
    assert len(guards) == 1  # the LengthCheck of the stepped sequence: hidden by default
    assert set(d.nodes) == {str(n.key) for n in cg.nodes() if n not in guards}
    expected_edges = {(str(p.key), str(n.key)) for n in cg.nodes() if n not in guards for p in n.parents}
    assert {(a, b) for a, b, _ in d.edges} == expected_edges
    assert len(d.edges) == len(expected_edges)
    assert len(d.iteration_clusters()) == 4
    assert [c for c in d.clusters if c.startswith("cluster_loop_")] == ["cluster_loop_Loop_1"]
    for t in range(4):
        cluster = f"cluster_iter_Loop_1_{t}"
        assert f"<B>t={t}</B>" in d.cluster_attrs[cluster]
        assert d.where[f"Tanh:1@{t}"][-1] == cluster
    label = d.nodes["Tanh:1@2"]
    assert "&lt;Tanh:1@2&gt;" in label and "h_t" in label and "(2, 3)" in label
    assert "→ next h" in label
    # loop-carried state: labelled with the carry's name
    carried = [e for e in d.edges if e[:2] == ("Tanh:1@1", "MatMul:2@2")]
    assert len(carried) == 1 and 'label="h"' in carried[0][2]


def test_shared_parameter_once_outside_iterations_untied_inside():
    g, _, cg = unrolled_rnn(T=3)
    d = Dot(R.to_dot(cg))
    wh = g.params["Wh"]
    assert d.text.count(f'\t"{wh.key}" [') == 1
    assert not d.in_iteration(str(wh.key))
    into = {b for a, b, _ in d.edges if a == str(wh.key)}
    # into every iteration: h @ Wh (computed when read) and the sum that computes it with the row
    # of x @ Wx + b (vgraph.virtual.hoist.RowSum)
    assert into == {f"{k}@{t}" for t in range(3) for k in ("MatMul:2", "Add:2")}
    assert [cg.node(f"Add:2@{t}").op.name for t in range(3)] == ["MatMulAddRow"] * 3

    u = vg.VirtualGraph(dtype=np.float64, name="layers")
    x = u.input("x", shape=(2, 3))
    with u.loop(times=3) as layers:
        z = layers.carry(x, name="z")
        W = u.parameter("W", (3, 3))  # untied: one per iteration
        layers.update(z, vg.tanh(z @ W))
    out = layers.final(z).sum()
    ucg = u.build({"x": np.ones((2, 3))}, out)
    ud = Dot(R.to_dot(ucg))
    for t in range(3):
        key = f"Parameter:1@{t}"
        assert ud.in_iteration(key) and ud.where[key][-1] == f"cluster_iter_Loop_1_{t}"
        assert "untied" in ud.nodes[key]


def test_nested_loops_nest_clusters():
    m = load_model("stacked_rnn")
    g, feed, outs = m.build()
    cg = g.build(feed, outs)
    d = Dot(R.to_dot(cg))
    assert len(d.iteration_clusters()) == m.LAYERS * (1 + m.T)
    inner = "cluster_iter_Loop_2_1_2"
    assert d.clusters[inner][-2:] == ["cluster_iter_Loop_1_1", "cluster_loop_Loop_2_1"]
    assert d.where["Tanh:1@1.2"][-1] == inner and "<B>t=1.2</B>" in d.cluster_attrs[inner]
    assert d.where["Parameter:3@1"][-1] == "cluster_iter_Loop_1_1"  # this layer's own Wh
    assert not d.in_iteration("Parameter:1")  # the shared read-out weight


def test_plain_compute_graph_clusters_by_idx():
    cg = ComputeGraph(dtype=np.float64)
    w = cg.parameter(np.ones((2, 2)), name="w")
    h = cg.input(np.ones((1, 2)), name="h0")
    for t in range(3):
        h = cg.apply("MatMul", [h, w], key=NodeKey("MatMul", 1, (t,)))
        h = cg.apply("Tanh", [h], key=NodeKey("Tanh", 1, (t,)))
    d = Dot(R.to_dot(cg))
    assert len(d.iteration_clusters()) == 3
    assert d.where["Tanh:1@2"][-1] == "cluster_iter_depth1_2"
    assert not d.in_iteration("Parameter:1")
    assert len(d.edges) == 1 + 3 + 3 + 2  # h0->M@0, w->M@t, M@t->T@t, T@t->M@t+1


def test_guards_hidden_by_default_and_drawn_on_request():
    _, _, cg = unrolled_rnn(T=3)
    assert "LengthCheck" not in R.to_dot(cg)
    d = Dot(R.to_dot(cg, guards=True))
    assert "LengthCheck:1" in d.nodes and 'style="dotted"' in d.nodes["LengthCheck:1"]
    assert ("Input:1", "LengthCheck:1") in {(a, b) for a, b, _ in d.edges}


# ---------------------------------------------------------------------------- folding


def test_fold_50_steps_to_3_plus_3():
    _, _, cg = unrolled_rnn(T=50)
    d = Dot(R.to_dot(cg))  # default fold (3, 3)
    shown = sorted(int(c.rsplit("_", 1)[1]) for c in d.iteration_clusters())
    assert shown == [0, 1, 2, 47, 48, 49]
    (fold,) = d.fold_nodes()
    assert "44 iterations" in d.nodes[fold] and "t=3 … 46" in d.nodes[fold]
    assert not any(k.startswith(("Tanh:1@3", "Tanh:1@46", "Tanh:1@10")) for k in d.nodes)
    pairs = [(a, b) for a, b, _ in d.edges]
    assert len(pairs) == len(set(pairs))  # deduplicated
    assert pairs.count(("Parameter:2", fold)) == 1  # one edge for 44 uses
    # x_t @ Wx is hoisted: Wx and the sequence feed the one op computed for every iteration, and
    # so does b (the sum is reassociated: x_t @ Wx + b for every iteration, then + h @ Wh)
    assert ("Parameter:1", "MatMul*:1") in pairs and ("Input:1", "Item*:1") in pairs
    assert ("MatMul*:1", "Add*:2") in pairs and ("Parameter:3", "Add*:2") in pairs
    assert not any(a == "Parameter:3" and b != "Add*:2" for a, b in pairs)
    assert ("MatMul*:1", fold) in pairs and ("Add*:2", fold) in pairs
    assert ("Tanh:1@2", fold) in pairs and (fold, "MatMul:2@47") in pairs
    assert all(a != b for a, b in pairs)
    assert all(a in d.nodes and b in d.nodes for a, b in pairs)


def test_fold_options_show_all_and_iteration_range():
    _, _, cg = unrolled_rnn(T=50)
    d = Dot(R.to_dot(cg, fold=(2, 1)))
    assert len(d.iteration_clusters()) == 3 and "47 iterations" in d.nodes[d.fold_nodes()[0]]
    for kw in ({"fold": None}, {"show_all": True}):
        d = Dot(R.to_dot(cg, **kw))
        assert len(d.iteration_clusters()) == 50 and not d.fold_nodes()
    d = Dot(R.to_dot(cg, iterations=range(10, 20)))
    assert sorted(int(c.rsplit("_", 1)[1]) for c in d.iteration_clusters()) == list(range(10, 20))
    labels = sorted(d.nodes[f] for f in d.fold_nodes())
    assert len(labels) == 2
    assert any("10 iterations" in s for s in labels) and any("30 iterations" in s for s in labels)
    # a loop just longer than first + last is shown whole (a fold node would hide a single step)
    _, _, cg7 = unrolled_rnn(T=7)
    assert len(Dot(R.to_dot(cg7)).iteration_clusters()) == 7
    with pytest.raises(ValueError, match="fold"):
        R.to_dot(cg, fold=(3,))
    with pytest.raises(ValueError, match="fold"):
        R.to_dot(cg, fold=(-1, 2))


def test_thousand_step_rnn_folds_to_a_small_drawing():
    _, _, cg = unrolled_rnn(T=1000, H=2, B=1, I=1)
    d = Dot(R.to_dot(cg))
    assert len(d.iteration_clusters()) == 6 and len(d.nodes) < 60
    assert "994 iterations" in d.nodes[d.fold_nodes()[0]]


# ---------------------------------------------------------------------------- determinism


def test_same_model_gives_identical_dot():
    a = R.to_dot(unrolled_rnn(T=9)[2])
    b = R.to_dot(unrolled_rnn(T=9)[2])  # a second, independently declared and built model
    assert a == b
    g, loss, feed = rnn(T=5)
    assert R.to_dot(g.build(feed, loss)) == R.to_dot(g.build(feed, loss))
    assert R.to_dot(g) == R.to_dot(rnn(T=5)[0])
    m = load_model("branching")
    g1, f1, o1 = m.build()
    g2, f2, o2 = m.build()
    c1, c2 = g1.build(f1, o1), g2.build(f2, o2)
    backward_all(c1, c1.outputs[0])
    backward_all(c2, c2.outputs[0])
    assert R.to_dot(c1, gradients=True) == R.to_dot(c2, gradients=True)
    assert "0x" not in a  # no object ids


# ---------------------------------------------------------------------------- virtual view


def test_virtual_view_loop_cluster_and_back_edge():
    g = rnn()[0]
    d = Dot(R.to_dot(g))
    assert list(d.clusters) == ["cluster_loop_1"]
    body = {n for n, w in d.where.items() if w == ["cluster_loop_1"]}
    assert body == {"Item:1", "Carry:1", "MatMul:1", "MatMul:2", "Add:1", "Add:2", "Tanh:1"}
    assert {"Parameter:1", "Parameter:2", "Input:1", "Final:1"} <= set(d.nodes) - body
    (back,) = [e for e in d.edges if e[:2] == ("Tanh:1", "Carry:1")]
    assert 'label="h"' in back[2] and "constraint=false" in back[2]
    assert "&lt;Tanh:1&gt;" in d.nodes["Tanh:1"] and "h_t" in d.nodes["Tanh:1"]
    with pytest.raises(ValueError, match="unrolled"):
        R.to_dot(g, gradients=True)


def never_one(x_t: np.ndarray) -> int:
    return 0


def branch_model():
    g = vg.VirtualGraph(dtype=np.float64, name="branchy")
    x = g.input("x", shape=(None, 2))
    W = g.parameter("W", (2, 2))
    with g.loop() as loop:
        xt = loop.step(x)
        h = loop.carry(np.zeros(2), name="h")
        a = vg.tanh(h @ W + xt)
        c = vg.relu(h + xt)
        h_new = g.branch(lambda v: int(v.sum() > 0), [a, c], keys=[xt], name="pick")
        loop.update(h, h_new)
    loss = loop.final(h).sum()
    return g, loss


def test_virtual_view_branch_options_keys_and_greying():
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", shape=(2,))
    a, c = vg.tanh(x), vg.relu(x)
    y = g.branch(never_one, [a, c], keys=[x])
    out = y.sum()
    d = Dot(R.to_dot(g))
    opts = {a: b for a, b, _ in d.edges if b == "Branch:1"}
    assert {("Tanh:1", "Branch:1"), ("Relu:1", "Branch:1"), ("Input:1", "Branch:1")} <= {
        (k, v) for k, v in opts.items()
    }
    (key_edge,) = [e for e in d.edges if e[:2] == ("Input:1", "Branch:1")]
    assert 'style="dashed"' in key_edge[2] and 'label="key"' in key_edge[2]
    assert "not built" not in d.text
    cg = g.build({"x": np.ones(2)}, out)
    d = Dot(R.to_dot(g, build=cg))
    assert "not built" in d.nodes["Relu:1"] and "not built" not in d.nodes["Tanh:1"]
    (unused,) = [e for e in d.edges if e[:2] == ("Relu:1", "Branch:1")]
    assert 'color="#cccccc"' in unused[2] and 'label="option 1"' in unused[2]
    assert "option 0 ×1" in d.nodes["Branch:1"]
    with pytest.raises(ValueError, match="build"):
        R.to_dot(g, build=unrolled_rnn()[2])


def still_large(t: int, state: dict) -> bool:
    return float(np.abs(state["z"]).max()) > 0.1


def converged(t: int, state: dict) -> bool:
    return float(np.abs(state["z"]).max()) < 0.1


def never(t: int, state: dict) -> bool:
    return False


def halving_loop(**loop_args):
    """z <- z / 2 in a loop declared with ``loop_args``: (graph, feed, output)."""
    g = vg.VirtualGraph(dtype=np.float64, name="halving")
    x = g.input("x", shape=(3,))
    with g.loop(**loop_args) as loop:
        z = loop.carry(x, name="z")
        loop.update(z, z * 0.5)
    return g, {"x": np.ones(3)}, loop.final(z).sum()


def stepping_loop():
    g = vg.VirtualGraph(dtype=np.float64, name="stepping")
    xs, ys = g.input("xs", shape=(None, 2)), g.input("ys", shape=(None, 2))
    with g.loop() as loop:
        z = loop.carry(np.zeros(2), name="z")
        loop.update(z, z + loop.step(xs) * loop.step(ys, reverse=True))
    return g, {"xs": np.ones((3, 2)), "ys": np.ones((3, 2))}, loop.final(z).sum()


def recursion_without_step():
    g = vg.VirtualGraph(dtype=np.float64, name="tree")
    children = g.input("children", shape=(None, 2))
    with g.recurse(children) as r:
        h = r.state(np.ones(2), name="h")
        r.update(h, r.child(h, 0) + r.child(h, 1))
    feed = {"children": np.array([[-1, -1], [-1, -1], [0, 1]])}
    return g, feed, r.final(h).sum()


# Each way of declaring a loop: the lines its cluster says after the loop's key (how it stops,
# then its carried state) and what one build on x = ones did. Written by hand from the
# declarations (z halves from 1: 0.5, 0.25, 0.125, 0.0625).
LOOP_FORMS = {
    "times": (lambda: halving_loop(times=3), ["times=3", "carries z"], "3 iterations"),
    "steps": (stepping_loop, ["steps through xs, ys (reversed)", "carries z"], "3 iterations"),
    "while": (lambda: halving_loop(while_=still_large), ["while still_large", "carries z"], "4 iterations"),
    "while lambda": (
        lambda: halving_loop(while_=lambda t, s: t < 2),
        ["while cond(t, state)", "carries z"],
        "2 iterations",
    ),
    "times and while": (
        lambda: halving_loop(times=3, while_=still_large),
        ["times=3", "while still_large", "carries z"],
        "3 iterations",
    ),
    "until": (
        lambda: halving_loop(until=converged),
        ["until converged (checked after each iteration)", "carries z"],
        "4 iterations",
    ),
    "until, max_iters raises": (
        lambda: halving_loop(until=converged, max_iters=50),
        ["until converged (checked after each iteration)", "more than max_iters=50 is an error", "carries z"],
        "4 iterations",
    ),
    "until, max_iters stops": (
        lambda: halving_loop(until=never, max_iters=6, on_limit="stop"),
        ["until never (checked after each iteration)", "stops at max_iters=6", "carries z"],
        "6 iterations, stopped at max_iters",
    ),
    "while, max_iters stops": (
        lambda: halving_loop(while_=lambda t, s: True, max_iters=2, on_limit="stop"),
        ["while cond(t, state)", "stops at max_iters=2", "carries z"],
        "2 iterations, stopped at max_iters",
    ),
    "recursion": (
        recursion_without_step,
        ["over the nodes of children, children first", "state at each node h"],
        "3 iterations",
    ),
}


def svg_lines(svg_text: str) -> list[str]:
    """The text lines of an SVG drawing, in order."""
    root = ET.fromstring(svg_text)
    return [t.text for t in root.iter() if t.tag.endswith("text") and t.text]


@pytest.mark.parametrize("form", list(LOOP_FORMS))
def test_every_loop_form_says_how_it_stops_and_draws_with_dot(form, needs_dot, tmp_path):
    make, rule, ran = LOOP_FORMS[form]
    g, feed, out = make()
    label = Dot(R.to_dot(g)).cluster_attrs["cluster_loop_1"]
    assert re.findall(r'<FONT POINT-SIZE="9">(.*?)</FONT>', label) == rule
    # Graphviz's dot draws it: into a file, with one build's trip count, and in Jupyter.
    lines = svg_lines(R.render(g, tmp_path / "model.svg").read_text())
    assert all(line in lines for line in rule), (rule, lines)
    lines = svg_lines(R.to_svg(g, build=g.build(feed, out)))
    assert f"this build: {ran}" in lines, lines
    assert "<svg" in g._repr_svg_()


def test_unrolled_branches_show_the_option_taken():
    g, loss = branch_model()
    xs = np.array([[1.0, 1.0], [-2.0, 0.5], [0.3, 0.3]])
    cg = g.build({"x": xs}, loss)
    d = Dot(R.to_dot(cg))
    branch = g.nodes[[v.type for v in g.nodes].index("Branch")]
    for t in range(3):
        k = cg.choice(branch, (t,))
        assert k == int(xs[t].sum() > 0)
        key = f"Branch:1@{t}"
        assert f"option {k}" in d.nodes[key] and d.where[key][-1] == f"cluster_iter_Loop_1_{t}"
        key_edges = [e for e in d.edges if e[1] == key and 'label="key"' in e[2]]
        assert len(key_edges) == 1 and 'style="dashed"' in key_edges[0][2]
        assert any(e[1] == key and f'label="option {k}"' in e[2] for e in d.edges)
    # only the chosen option was built: relu at t=0 and t=2, tanh at t=1
    assert {"Relu:1@0", "Tanh:1@1", "Relu:1@2"} <= set(d.nodes)
    assert not {"Tanh:1@0", "Relu:1@1", "Tanh:1@2"} & set(d.nodes)


# ---------------------------------------------------------------------------- gradients


def test_gradient_overlay_norms_and_monotone_colours():
    _, loss, cg = unrolled_rnn(T=5)
    backward_all(cg, loss)
    text = R.to_dot(cg, gradients=True)
    d = Dot(text)
    norms = R.gradient_norms(cg)
    drawn = {n for n in cg.nodes() if str(n.key) in d.nodes}
    with_grad = [n for n in drawn if n.grad is not None]
    assert len(with_grad) >= 5 * 5  # every op node of every iteration kept its gradient
    scale = None
    positions = []
    for n in with_grad:
        norm = float(np.linalg.norm(n.grad))
        assert norms[n.key] == pytest.approx(norm, rel=0, abs=0)
        attrs = d.nodes[str(n.key)]
        assert f"|grad| {norm:.2e}" in attrs
        fill = re.search(r'fillcolor="(#[0-9a-f]{6})"', attrs)[1]
        positions.append((norm, fill))
    positions.sort()
    smallest, largest = positions[0], positions[-1]
    assert smallest[0] > 0 and largest[0] / smallest[0] < 1e8  # no clipping in this graph
    # the scale runs from the smallest norm (pale blue) to the largest (red)
    assert smallest[1] == "#eaf1fa" and largest[1] == "#d73027"
    scale = (np.log10(smallest[0]), np.log10(largest[0]))
    last = -1.0
    for norm, fill in positions:
        pos, colour = R.gradient_color(norm, scale)
        assert colour == fill
        assert pos >= last
        last = pos
    assert R.gradient_color(10.0**-3, (-3, 0)) == (0.0, "#eaf1fa")  # pale blue end
    assert R.gradient_color(1.0, (-3, 0)) == (1.0, "#d73027")  # red end
    assert R.gradient_color(0.0, (-3, 0))[1] == "#ffffff"

    def warmth(colour: str) -> int:  # red minus blue
        return int(colour[1:3], 16) - int(colour[5:7], 16)

    assert warmth(R.gradient_color(1e2, (-4, 2))[1]) > 150
    assert warmth(R.gradient_color(1e-4, (-4, 2))[1]) < 0
    assert "cluster_legend" in d.clusters and "gradient norm" in d.nodes["legend"]
    cells = re.findall(r'<TD BGCOLOR="(#[0-9a-f]{6})"[^>]*><FONT[^>]*>([^<]*)</FONT>', d.nodes["legend"])
    assert cells[0] == ("#eaf1fa", f"{smallest[0]:.1e}")
    assert cells[len(cells) - 5] == ("#d73027", f"{largest[0]:.1e} max")


def test_gradient_overlay_without_retained_grads_says_so():
    g, loss, cg = unrolled_rnn(T=3)
    cg.backward(loss)  # leaves only
    d = Dot(R.to_dot(cg, gradients=True))
    assert "retain_all_grads" in d.nodes["legend"]
    assert "|grad|" in d.nodes[str(g.params["Wh"].key)]
    assert "|grad|" not in d.nodes["Tanh:1@1"]


@pytest.mark.parametrize("name", ["Wh", "Wx", "b"])
def test_gradient_through_time_sums_to_the_parameter_grad(name):
    g, loss, cg = unrolled_rnn(T=6)
    backward_all(cg, loss)
    contrib = R.gradient_through_time(cg, name)
    param = g.params[name]
    assert contrib.shape == (6, *param.shape)
    np.testing.assert_allclose(contrib.sum(axis=0), param.grad, rtol=1e-12, atol=1e-14)
    # the last iteration's contribution of Wh is h_{T-1}^T (dL/dpre_T): check it by hand
    if name == "Wh":
        pre_grad = cg.node("Add:2@5").grad
        h_prev = cg.node("Tanh:1@4").value
        np.testing.assert_allclose(contrib[5], h_prev.T @ pre_grad)
    same = R.gradient_through_time(cg, next(v for v in g.nodes if v.name == name))
    np.testing.assert_array_equal(same, contrib)


def test_gradient_through_time_errors_and_plot(tmp_path):
    _, loss, cg = unrolled_rnn(T=4)
    cg.backward(loss)
    with pytest.raises(GraphStateError, match="retain_all_grads"):
        R.gradient_through_time(cg, "Wh")
    with pytest.raises(VGraphError, match="no parameter"):
        R.gradient_through_time(cg, "nope")
    _, loss, cg = unrolled_rnn(T=4)
    backward_all(cg, loss)
    pytest.importorskip("matplotlib")
    out = tmp_path / "gtt.png"
    R.gradient_through_time(cg, "Wh", plot=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_retain_all_grads_marks_op_nodes_only():
    _, _, cg = unrolled_rnn(T=2)
    count = R.retain_all_grads(cg)
    ops = [n for n in cg.nodes() if n.op is not None and n.requires_grad]
    assert count == len(ops) and all(n.retains_grad for n in ops)
    assert not any(n.retains_grad for n in cg.nodes() if n.op is None)


# ---------------------------------------------------------------------------- Graphviz objects and rendering


def test_to_digraph_has_the_same_source():
    graphviz = pytest.importorskip("graphviz")
    g, _, cg = unrolled_rnn(T=3)
    dg = R.to_digraph(cg, fold=(1, 1))
    assert isinstance(dg, graphviz.Digraph)
    assert dg.source == R.to_dot(cg, fold=(1, 1))
    assert R.to_digraph(g).source == R.to_dot(g)


def test_render_svg_png_pdf(needs_dot, tmp_path):
    g, loss, cg = unrolled_rnn(T=8)
    backward_all(cg, loss)
    svg = R.render(cg, tmp_path / "rnn.svg", gradients=True)
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for key in ("Tanh:1@0", "Tanh:1@2", "Tanh:1@7", "Parameter:2", "t=0", "2 iterations"):
        assert key in text
    assert "Tanh:1@4" not in text  # folded
    png = R.render(g, tmp_path / "model.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    pdf = R.render(cg, tmp_path / "rnn.out", format="pdf")
    assert pdf.read_bytes()[:4] == b"%PDF"
    assert R.to_svg(g).lstrip().startswith("<?xml")
    with pytest.raises(RenderError, match="unknown output format"):
        R.render(cg, tmp_path / "rnn.bmp")


def test_render_writes_dot_without_graphviz(tmp_path):
    _, _, cg = unrolled_rnn(T=3)
    out = R.render(cg, tmp_path / "rnn.dot")
    assert out.read_text() == R.to_dot(cg)


def test_render_into_a_missing_folder_is_a_render_error(tmp_path):
    _, _, cg = unrolled_rnn(T=3)
    for name in ("rnn.dot", "rnn.gv"):
        with pytest.raises(
            RenderError, match=r"cannot write .*rnn\.(dot|gv)'.*No such directory to save the drawing in"
        ):
            R.render(cg, tmp_path / "missing" / name)
    assert list(tmp_path.iterdir()) == []
    out = R.render(cg, tmp_path / "rnn.dot")
    assert [p.name for p in tmp_path.iterdir()] == ["rnn.dot"]  # no temporary file left behind
    assert out.read_text() == R.to_dot(cg)


def test_missing_dot_raises_with_install_hint_and_keeps_dot_text(no_dot, tmp_path):
    g, _, cg = unrolled_rnn(T=3)
    assert not R.dot_available()
    with pytest.raises(RenderError) as info:
        R.render(cg, tmp_path / "rnn.svg")
    message = str(info.value)
    assert "apt-get install graphviz" in message and "brew install graphviz" in message
    dot_file = tmp_path / "rnn.dot"
    assert dot_file.read_text() == R.to_dot(cg) and str(dot_file) in message
    assert not (tmp_path / "rnn.svg").exists()
    bundle = cg._repr_mimebundle_()
    assert set(bundle) == {"text/plain"} and bundle["text/plain"].startswith(repr(cg))
    assert "`dot` program was not found" in bundle["text/plain"]
    assert g._repr_svg_() is None


def test_jupyter_display(needs_dot):
    g, _, cg = unrolled_rnn(T=3)
    bundle = cg._repr_mimebundle_()
    assert bundle["text/plain"] == repr(cg) and "<svg" in bundle["image/svg+xml"]
    assert "<svg" in g._repr_svg_()


# ---------------------------------------------------------------------------- CLI


def test_cli_renders_model_scripts(tmp_path, capsys):
    out = tmp_path / "model.dot"
    assert main(["render", str(MODELS / "elman_rnn.py"), "-o", str(out)]) == 0
    assert "cluster_loop_1" in out.read_text() and "wrote" in capsys.readouterr().out
    out = tmp_path / "unrolled.dot"
    assert (
        main(["render", str(MODELS / "elman_rnn.py"), "-o", str(out), "--unrolled", "--fold", "2", "2"]) == 0
    )
    d = Dot(out.read_text())
    assert len(d.iteration_clusters()) == 4 and "8 iterations" in d.nodes[d.fold_nodes()[0]]
    out = tmp_path / "all.dot"
    assert main(["render", str(MODELS / "elman_rnn.py"), "-o", str(out), "--all"]) == 0
    assert len(Dot(out.read_text()).iteration_clusters()) == load_model("elman_rnn").T
    out = tmp_path / "grads.dot"
    assert main(["render", str(MODELS / "branching.py"), "-o", str(out), "--gradients"]) == 0
    d = Dot(out.read_text())
    assert "|grad|" in d.nodes["Branch:1@3"] and "legend" in d.nodes
    out = tmp_path / "taken.dot"
    assert main(["render", str(MODELS / "branching.py"), "-o", str(out), "--taken"]) == 0
    assert "this build: 6 iterations" in out.read_text()


def test_cli_errors(tmp_path, capsys):
    assert main(["render", str(tmp_path / "missing.py"), "-o", str(tmp_path / "x.svg")]) == 2
    assert "not found" in capsys.readouterr().err
    script = tmp_path / "no_build.py"
    script.write_text("x = 1\n")
    assert main(["render", str(script), "-o", str(tmp_path / "x.svg")]) == 2
    assert "build()" in capsys.readouterr().err
    script.write_text("def build():\n    return 1, 2\n")
    assert main(["render", str(script), "-o", str(tmp_path / "x.svg")]) == 2
    assert "(virtual_graph, feed, outputs)" in capsys.readouterr().err
    script.write_text(
        "import vgraph as vg\n"
        "def build():\n"
        "    g = vg.VirtualGraph()\n"
        "    return g, {'nope': 1}, [g.input('x')]\n"
    )
    assert main(["render", str(script), "-o", str(tmp_path / "x.dot"), "--unrolled"]) == 1
    assert "FeedError" in capsys.readouterr().err
    assert main(["render", str(MODELS / "elman_rnn.py"), "-o", str(tmp_path / "x.bmp")]) == 2
    assert "unknown output format" in capsys.readouterr().err
    assert main(["render", str(MODELS / "elman_rnn.py")]) == 2  # no -o
    assert main([]) == 2
    assert main(["render", str(MODELS / "elman_rnn.py"), "-o", "x.svg", "--fold", "3", "3", "--all"]) == 2


def test_cli_missing_dot_exit_code_and_dot_file(no_dot, tmp_path, capsys):
    out = tmp_path / "rnn.svg"
    assert main(["render", str(MODELS / "elman_rnn.py"), "-o", str(out), "--unrolled"]) == 1
    err = capsys.readouterr().err
    assert "apt-get install graphviz" in err
    assert (tmp_path / "rnn.dot").read_text().startswith("digraph")


def test_cli_renders_png(needs_dot, tmp_path):
    out = tmp_path / "rnn.png"
    assert main(["render", str(MODELS / "elman_rnn.py"), "-o", str(out), "--gradients"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_python_dash_m_entry_point():
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["vgraph", "--help"]
    try:
        with pytest.raises(SystemExit) as info:
            runpy.run_module("vgraph", run_name="__main__")
    finally:
        sys.argv = argv
    assert info.value.code == 0


def test_two_loops_one_after_the_other_and_choosing_the_loop():
    g = vg.VirtualGraph(dtype=np.float64, name="two loops")
    x = g.input("x", shape=(None, 2))
    W = g.parameter("W", (2, 2))
    with g.loop(name="encode") as enc:
        xt = enc.step(x)
        h = enc.carry(np.zeros(2), name="h")
        enc.update(h, vg.tanh(h @ W + xt))
    with g.loop(times=3, name="decode") as dec:
        s = dec.carry(enc.final(h), name="s")
        dec.update(s, vg.tanh(s @ W))
    loss = dec.final(s).sum()
    cg = g.build({"x": np.ones((4, 2)) * 0.1}, loss)
    backward_all(cg, loss)
    d = Dot(R.to_dot(cg))
    assert {c for c in d.clusters if c.startswith("cluster_loop_")} == {
        "cluster_loop_Loop_1",
        "cluster_loop_Loop_2",
    }
    assert len(d.iteration_clusters()) == 4 + 3
    # both loops have iteration 0; their nodes go to their own loop's cluster
    assert d.where["Tanh:1@0"][-2:] == ["cluster_loop_Loop_1", "cluster_iter_Loop_1_0"]
    assert d.where["Tanh:2@0"][-2:] == ["cluster_loop_Loop_2", "cluster_iter_Loop_2_0"]
    with pytest.raises(VGraphError, match="several loops"):
        R.gradient_through_time(cg, "W")
    enc_part = R.gradient_through_time(cg, "W", loop="encode")
    dec_part = R.gradient_through_time(cg, "W", loop=dec)
    assert enc_part.shape == (4, 2, 2) and dec_part.shape == (3, 2, 2)
    np.testing.assert_allclose(enc_part.sum(0) + dec_part.sum(0), g.params["W"].grad, rtol=1e-12)


def test_gradient_through_time_on_a_plain_compute_graph():
    cg = ComputeGraph(dtype=np.float64)
    w = cg.parameter(np.full((2, 2), 0.3), name="w")
    h = cg.input(np.ones((1, 2)), name="h0")
    for t in range(4):
        h = cg.apply(
            "Tanh", [cg.apply("MatMul", [h, w], key=NodeKey("MatMul", 1, (t,)))], key=NodeKey("Tanh", 1, (t,))
        )
    loss = cg.apply("Sum", [h], {"axis": None, "keepdims": False})
    backward_all(cg, loss)
    contrib = R.gradient_through_time(cg, w)
    assert contrib.shape == (4, 2, 2)
    np.testing.assert_allclose(contrib.sum(0), w.grad, rtol=1e-12)


def test_while_loop_guards_and_a_loop_that_ran_no_iteration():
    g = vg.VirtualGraph(dtype=np.float64, name="while")
    x = g.input("x", shape=(3,))
    with g.loop(while_=lambda t, s: float(np.abs(s["z"]).sum()) > 0.5, name="shrink") as loop:
        z = loop.carry(x, name="z")
        loop.update(z, z * 0.5)
    out = loop.final(z).sum()
    cg = g.build({"x": np.ones(3)}, out)
    assert cg.trip_count(loop) == 3
    d = Dot(R.to_dot(cg, guards=True))
    for t in range(3):  # the check made before iteration t sits in iteration t
        assert d.where[f"LoopCheck:1@{t}"][-1] == f"cluster_iter_Loop_1_{t}"
    assert not d.in_iteration("LoopCheck:1@3")  # the check that ended the loop
    assert all("label" not in attrs for a, b, attrs in d.edges if b.startswith("LoopCheck"))
    assert "0.5" in d.nodes["Constant:1"]  # scalar constants show their value
    cg0 = g.build({"x": np.zeros(3)}, out)
    d0 = Dot(R.to_dot(cg0))
    assert not d0.iteration_clusters() and "no iterations" in d0.nodes["fold:Loop:1:none"]
    assert ("Input:1", "Sum:1") in {(a, b) for a, b, _ in d0.edges}


def test_hoisted_copies_and_fused_cells_say_what_they_are():
    _, _, cg = unrolled_rnn(T=4)
    d = Dot(R.to_dot(cg))
    assert "hoisted: row 2 of &lt;MatMul*:1&gt;" in d.nodes["MatMul:1@2"]
    assert "MatMul for every iteration (hoisted)" in d.nodes["MatMul*:1"]
    g = vg.VirtualGraph(dtype=np.float64)
    xs = g.input("xs", (None, 1, 2))
    cell = vg.nn.LSTMCell(g, 2, 3, "lstm")
    with g.loop() as L:
        h = L.carry(np.zeros((1, 3)), name="h")
        c = L.carry(np.zeros((1, 3)), name="c")
        h_new, c_new = cell(L.step(xs), (h, c))
        L.update(h, h_new)
        L.update(c, c_new)
    d = Dot(R.to_dot(g.build({"xs": np.ones((2, 1, 2))}, vg.sum(L.final(h)))))
    assert "gates i f g o" in d.nodes["LSTMCell:1@1"]
