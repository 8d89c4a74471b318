"""Drawing at scale and honestly (issue 13): reference nodes instead of edges into every
iteration, the clipped gradient colour scale and its legend, NaN/Inf colours, refused empty
iteration ranges, the gradient-through-time plot's axes, and the CLI's --set and --taken checks."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
from test_render import MODELS, Dot, backward_all, rnn, unrolled_rnn

import vgraph as vg
from vgraph import render as R
from vgraph.cli import main

pytestmark = pytest.mark.usefixtures("per_node")  # (conftest) per-node drawings; of programs: test_programs

NAN_COLOR, INF_COLOR = "#7b3294", "#000000"  # the documented colours, written out


def fill_of(attrs: str) -> str:
    return re.search(r'fillcolor="(#[0-9a-f]{6})"', attrs)[1]


def legend_cells(legend: str) -> list[tuple[str, str]]:
    """(colour, label) of each cell of the legend's colour row."""
    return re.findall(r'<TD BGCOLOR="(#[0-9a-f]{6})"[^>]*><FONT[^>]*>([^<]*)</FONT>', legend)


def iteration_of(d: Dot, node: str) -> str | None:
    return next((c for c in reversed(d.where[node]) if c.startswith("cluster_iter_")), None)


# ---------------------------------------------------------------------------- reference nodes


def test_shared_leaves_feed_iterations_through_references():
    T = 20
    g, _, cg = unrolled_rnn(T=T)
    d = Dot(R.to_dot(cg, fold=None))
    wh = str(g.params["Wh"].key)
    assert not any(a == wh for a, _, _ in d.edges)  # no edge from the one Wh into the iterations
    for t in range(T):
        ref = f"ref:{wh} in t={t}"
        assert d.where[ref][-1] == f"cluster_iter_Loop_1_{t}"
        assert (ref, f"MatMul:2@{t}") in {(a, b) for a, b, _ in d.edges}
        assert "Wh" in d.nodes[ref] and 'style="rounded,dashed"' in d.nodes[ref]
    # every edge into an iteration comes from the same iteration, the previous one (the carry),
    # or, once, from the initial state h0 outside the loop
    crossing = []
    for a, b, _ in d.edges:
        ib, ia = iteration_of(d, b), iteration_of(d, a)
        if ib is not None and ia != ib:
            crossing.append((a, b))
    # (the state enters h @ Wh, computed when read, and the sum that computes it: see
    # vgraph.virtual.hoist.RowSum)
    carried = [(a, b) for a, b in crossing if a.startswith("Tanh:1@")]
    assert sorted(carried) == sorted(
        (f"Tanh:1@{t - 1}", f"{k}@{t}") for t in range(1, T) for k in ("MatMul:2", "Add:2")
    )
    assert sorted(e for e in crossing if e not in carried) == [
        ("Constant:1", "Add:2@0"),
        ("Constant:1", "MatMul:2@0"),
    ]
    assert "references to a node drawn once outside the iteration" in d.nodes["legend"]
    # the same graph with edges, on request
    direct = Dot(R.to_dot(cg, fold=None, references=False))
    assert sum(1 for a, _, _ in direct.edges if a == wh) == 2 * T  # into h @ Wh and the sum
    assert not [n for n in direct.nodes if n.startswith("ref:")] and "legend" not in direct.nodes


def test_references_only_when_many_iterations_are_drawn():
    g, _, cg = unrolled_rnn(T=50)
    d = Dot(R.to_dot(cg))  # the default fold draws 3 + 3 iterations: plain edges
    assert not [n for n in d.nodes if n.startswith("ref:")]
    wh = str(g.params["Wh"].key)
    assert sum(1 for a, _, _ in d.edges if a == wh) == 2 * 6 + 1  # two nodes of six iterations, the fold
    small = Dot(R.to_dot(unrolled_rnn(T=3)[2], references=True))
    assert len([n for n in small.nodes if n.startswith(f"ref:{wh} ")]) == 3
    with pytest.raises(ValueError, match="references"):
        R.to_dot(g, references=True)


def test_a_value_gathered_from_every_iteration_gets_references():
    g = vg.VirtualGraph(dtype=np.float64, name="stacked states")
    x = g.input("x", shape=(None, 2))
    W = g.parameter("W", (2, 2))
    with g.loop(name="time") as loop:
        xt = loop.step(x)
        h = loop.carry(np.zeros(2), name="h")
        h_new = vg.tanh(h @ W + xt)
        loop.update(h, h_new)
    loss = (loop.stack(h_new) ** 2).sum()
    T = 10
    cg = g.build({"x": np.ones((T, 2))}, loss)
    d = Dot(R.to_dot(cg, fold=None))
    stack = "Stack:1"
    assert not [a for a, b, _ in d.edges if b == stack]  # nothing crosses the loop into it
    for t in range(T):
        ref = f"ref:{stack} in t={t}"
        assert d.where[ref][-1] == f"cluster_iter_Loop_1_{t}" and "→" in d.nodes[ref]
        assert (f"Tanh:1@{t}", ref) in {(a, b) for a, b, _ in d.edges}


# ---------------------------------------------------------------------------- gradient colours


def test_a_nan_gradient_gets_the_nan_colour_and_inf_its_own():
    g, loss, cg = unrolled_rnn(T=4)
    backward_all(cg, loss)
    nan_node, inf_node = cg.node("Tanh:1@1"), cg.node("Tanh:1@2")
    nan_node.grad = np.full(nan_node.shape, np.nan)
    inf_node.grad = np.full(inf_node.shape, np.inf)
    d = Dot(R.to_dot(cg, gradients=True))
    assert fill_of(d.nodes["Tanh:1@1"]) == NAN_COLOR and "|grad| nan" in d.nodes["Tanh:1@1"]
    assert fill_of(d.nodes["Tanh:1@2"]) == INF_COLOR
    assert fill_of(d.nodes["Tanh:1@3"]) not in (NAN_COLOR, INF_COLOR, "#ffffff")
    cells = dict((label, colour) for colour, label in legend_cells(d.nodes["legend"]))
    assert cells["NaN"] == NAN_COLOR and cells["Inf"] == INF_COLOR and cells["0"] == "#ffffff"
    assert R.gradient_color(float("nan"), (-3, 0))[1] == NAN_COLOR
    assert R.gradient_color(float("inf"), (-3, 0)) == (1.0, INF_COLOR)


def test_nan_from_the_data_is_not_drawn_as_zero():
    g, loss, feed = rnn(T=5)
    feed["x"][3] = np.nan
    cg = g.build(feed, loss)
    backward_all(cg, loss)
    d = Dot(R.to_dot(cg, gradients=True))
    assert fill_of(d.nodes["Tanh:1@4"]) == NAN_COLOR
    assert fill_of(d.nodes[str(g.params["Wh"].key)]) == NAN_COLOR


def long_vanishing_rnn(T: int):
    """An RNN whose gradient fades by about 10x per step: its norms span many decades."""
    g, loss, feed = rnn(T=T, H=2, B=1, I=1)
    g.params["Wh"].value = np.eye(2) * 0.1
    cg = g.build(feed, loss)
    backward_all(cg, loss)
    return g, cg


def test_a_long_overlay_is_clipped_and_every_legend_cell_is_labelled_with_its_norm():
    g, cg = long_vanishing_rnn(60)
    norms = [v for v in R.gradient_norms(cg).values() if v > 0]
    largest = max(norms)
    assert min(norms) < largest * 1e-20  # far beyond the scale's 8 decades
    d = Dot(R.to_dot(cg, gradients=True, fold=None))
    legend = d.nodes["legend"]
    cells = legend_cells(legend)[:-4]  # the colour scale, without 0, NaN, Inf and "no .grad"
    assert cells[-1] == ("#d73027", f"{largest:.1e} max")  # the top cell is the largest norm
    assert cells[0][1] == f"≤ {largest * 1e-8:.1e}" and cells[0][0] == "#eaf1fa"
    assert len(cells) == 9
    for k, (colour, label) in enumerate(reversed(cells)):  # one cell per decade below the max
        value = float(label.replace("≤ ", "").replace(" max", ""))
        assert value == pytest.approx(largest * 10.0**-k, rel=0.06)
        assert R.gradient_color(largest * 10.0**-k, (np.log10(largest) - 8, np.log10(largest)))[1] == colour
    clipped = sum(1 for v in norms if v < largest * 1e-8)
    assert f"{clipped} smaller norms are clipped" in legend and "8 decades" in legend
    # the last iterations (largest gradients) are told apart: not all the same colour
    assert len({fill_of(d.nodes[f"Tanh:1@{t}"]) for t in range(55, 60)}) == 5


def test_the_legend_says_whose_gradient_with_respect_to_what():
    _, loss, cg = unrolled_rnn(T=4)
    backward_all(cg, loss)
    legend = html.unescape(Dot(R.to_dot(cg, gradients=True)).nodes["legend"])
    assert "gradient norm |dL/dv| of each node's value v" in legend
    assert f"L = {loss.describe()}" in legend and "Mean:1" in legend
    assert "summed over all steps" in legend


def test_gradient_scale_and_colour_arguments():
    scale = R.gradients.GradientScale.of([1e-200, 1e-3, 1.0, 0.0, float("nan")])
    assert (scale.lo, scale.hi, scale.clipped) == (-8.0, 0.0, 1)
    assert scale.cells() == pytest.approx([10.0**e for e in range(-8, 1)])
    one = R.gradients.GradientScale.of([0.5, 0.5])
    assert one.hi == pytest.approx(np.log10(0.5)) and one.hi - one.lo == pytest.approx(1)
    assert R.gradient_color(0.5, one)[1] == "#d73027"
    with pytest.raises(TypeError, match="norm"):
        R.gradient_color("1", (0, 1))
    with pytest.raises(TypeError, match="scale"):
        R.gradient_color(1.0, 3)
    with pytest.raises(ValueError, match="lo < hi"):
        R.gradient_color(1.0, (1, 1))


# ---------------------------------------------------------------------------- iteration ranges


def test_empty_or_missing_iteration_ranges_are_refused():
    _, _, cg = unrolled_rnn(T=10)
    with pytest.raises(ValueError, match="empty"):
        R.to_dot(cg, iterations=range(5, 2))
    with pytest.raises(ValueError, match="empty"):
        R.to_dot(cg, iterations=[])
    with pytest.raises(ValueError, match=r"selects no iteration.*10 iterations"):
        R.to_dot(cg, iterations=range(100, 200))
    assert len(Dot(R.to_dot(cg, iterations=range(8, 200))).iteration_clusters()) == 2


def test_cli_refuses_empty_iterations_and_taken_with_the_unrolled_view(tmp_path, capsys):
    script, out = str(MODELS / "elman_rnn.py"), str(tmp_path / "x.dot")
    assert main(["render", script, "-o", out, "--iterations", "5", "2"]) == 2
    assert "--iterations 5 2 selects no iteration" in capsys.readouterr().err
    assert main(["render", script, "-o", out, "--iterations", "50", "60"]) == 2
    assert "selects no iteration" in capsys.readouterr().err
    for flags in (["--unrolled"], ["--gradients"], ["--all"], ["--fold", "1", "1"]):
        assert main(["render", script, "-o", out, "--taken", *flags]) == 2
        err = capsys.readouterr().err
        assert "--taken applies to the virtual view" in err and flags[0] in err
    assert not (tmp_path / "x.dot").exists()


# ---------------------------------------------------------------------------- --set


def test_cli_set_passes_values_to_build(tmp_path, capsys):
    out = tmp_path / "x.dot"
    script = str(MODELS / "elman_rnn.py")
    assert main(["render", script, "-o", str(out), "--all", "--set", "steps=20", "--set", "hidden=5"]) == 0
    d = Dot(out.read_text())
    assert len(d.iteration_clusters()) == 20 and "(2, 5)" in d.nodes["Tanh:1@19"]
    assert (
        main(["render", str(MODELS / "stacked_rnn.py"), "-o", str(out), "--unrolled", "--set", "layers=3"])
        == 0
    )
    assert "cluster_iter_Loop_1_2" in Dot(out.read_text()).clusters
    assert main(["render", script, "-o", str(out), "--set", "nope=1"]) == 2
    err = capsys.readouterr().err
    assert "build() takes no parameter 'nope'" in err and "steps" in err
    assert main(["render", script, "-o", str(out), "--set", "steps"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["render", script, "-o", str(out), "--set", "steps=1", "--set", "steps=2"]) == 2
    custom = tmp_path / "kw.py"
    custom.write_text(
        "import vgraph as vg\n"
        "SEEN = {}\n"
        "def build(**kw):\n"
        "    SEEN.update(kw)\n"
        "    g = vg.VirtualGraph()\n"
        "    x = g.input('x', shape=(2,))\n"
        "    assert kw == {'label': 'a b', 'size': (2, 3), 'rate': 0.5}, kw\n"
        "    return g, {'x': [1.0, 2.0]}, [x.sum()]\n"
    )
    argv = ["--set", "label=a b", "--set", "size=(2, 3)", "--set", "rate=0.5"]
    assert main(["render", str(custom), "-o", str(out), *argv]) == 0, capsys.readouterr().err


# ---------------------------------------------------------------------------- gradient through time plot


def test_gradient_through_time_plot_has_integer_ticks_and_shows_t0(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))
    )
    g, cg = long_vanishing_rnn(12)
    contrib = R.gradient_through_time(cg, "Wh", plot=tmp_path / "p.png")
    assert np.linalg.norm(contrib[0]) == 0  # h_0 = 0: iteration 0 adds nothing to Wh's gradient
    (fig,) = figures
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert lo < 0 < hi
    xs = np.concatenate([line.get_xdata() for line in ax.get_lines()])
    assert 0 in xs  # t = 0 is drawn although its norm is 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
