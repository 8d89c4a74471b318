"""Regenerate the drawings in docs/images/ (needs Graphviz's `dot`; matplotlib for the plot).

    python3 tools/make_readme_images.py

Writes, from the model scripts in examples/models/:

* rnn_unrolled_gradients.svg / .png — an Elman RNN (T=12, H=4) unrolled, folded to the first 3
  and last 3 steps, coloured by gradient norm after one backward pass (BPTT);
* rnn_virtual.svg / .png — the same model as declared (the virtual view);
* branching_unrolled.svg — a recurrent cell choosing one of two updates per step;
* rnn_gradient_through_time.png — the per-step contributions to the recurrent weight's gradient
  (only if matplotlib is installed).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vgraph import render as R  # noqa: E402  (after the sys.path line above)

OUT = ROOT / "docs" / "images"
PNG_DPI = 110


def load_model(name: str):
    spec = importlib.util.spec_from_file_location(
        f"model_{name}", ROOT / "examples" / "models" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def draw(graph, stem: str, png: bool = True, **options) -> None:
    svg = R.render(graph, OUT / f"{stem}.svg", **options)
    print("wrote", svg.relative_to(ROOT))
    if png:
        path = R.render(graph, OUT / f"{stem}.png", dpi=PNG_DPI, **options)
        print("wrote", path.relative_to(ROOT))


def tree_rnn():
    """The Tree-RNN of docs/recursion.md over a 5-node tree, after backward (drawn unhoisted:
    every node in its structure node's cluster)."""
    import numpy as np

    import vgraph as vg

    D, H = 3, 4
    g = vg.VirtualGraph(seed=0, name="tree RNN")
    children = g.input("children", (None, 2))
    words = g.input("words", (None, D))
    W = g.parameter("W", (D, H))
    U_left, U_right = g.parameter("U_left", (H, H)), g.parameter("U_right", (H, H))
    with g.recurse(children, name="tree") as r:
        h = r.state(np.zeros(H), name="h")
        h_new = vg.tanh(r.step(words, name="word") @ W + r.child(h, 0) @ U_left + r.child(h, 1) @ U_right)
        h_new.name = "h"
        r.update(h, h_new)
    score = vg.sum(r.final(h))
    score.name = "score"
    kids = np.array([[-1, -1], [-1, -1], [0, 1], [-1, -1], [2, 3]])  # ((a b) c)
    feed = {"children": kids, "words": np.random.default_rng(0).normal(size=(5, D))}
    cg = g.build(feed, score, hoist=False)
    R.retain_all_grads(cg)
    cg.backward(score)
    return cg


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)

    rnn = load_model("elman_rnn")
    g, feed, outputs = rnn.build(steps=12)
    cg = g.build(feed, outputs)
    R.retain_all_grads(cg)
    cg.backward(cg.outputs[0])
    title = f"Elman RNN unrolled (T=12, H={rnn.H}), gradient norms after BPTT"
    draw(cg, "rnn_unrolled_gradients", gradients=True, fold=(3, 3), title=title)
    draw(g, "rnn_virtual", title="Elman RNN — virtual graph (as declared)")

    branching = load_model("branching")
    bg, bfeed, bout = branching.build()
    bcg = bg.build(bfeed, bout)
    draw(bcg, "branching_unrolled", png=False, title="branching RNN unrolled: the option each step took")

    draw(
        tree_rnn(),
        "tree_unrolled",
        gradients=True,
        fold=None,
        title="a tree RNN unrolled over ((a b) c) · gradient norms",
    )

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: skipped rnn_gradient_through_time.png")
    else:
        path = OUT / "rnn_gradient_through_time.png"
        R.gradient_through_time(cg, "Wh", plot=path)
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
