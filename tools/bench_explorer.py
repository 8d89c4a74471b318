"""Explorer page size, generation time and load time in headless Chromium (docs/explorer.md).

Two models: the Elman RNN of examples/models at 1,000 steps, and a 3-deep loop nest
(10 x 10 x 10 iterations, 1,000 innermost). For each: page size, time to generate it (Python,
including backward), time from navigation to the page's ready flag in headless Chromium, and
the time the page takes to lay out and draw after unfolding everything.

    PYTHONPATH=$PWD python tools/bench_explorer.py            # prints a table and JSON
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "models"))

import vgraph as vg  # noqa: E402
from vgraph.render import explore_script_result  # noqa: E402


def nest3(n: int = 10):
    """Three nested loops of ``n`` iterations each, a tied weight used in the innermost one."""
    g = vg.VirtualGraph(dtype=np.float64, seed=5, name=f"3-deep nest ({n}x{n}x{n})")
    W = g.parameter("W", (3, 3), init="orthogonal")
    h0 = g.constant(np.full((1, 3), 0.5), name="h0")
    with g.loop(times=n, name="outer") as outer:
        a = outer.carry(h0, name="a")
        with g.loop(times=n, name="middle") as middle:
            b = middle.carry(a, name="b")
            with g.loop(times=n, name="inner") as inner:
                c = inner.carry(b, name="c")
                c_new = vg.tanh(c @ W)
                c_new.name = "c_t"
                inner.update(c, c_new)
            middle.update(b, inner.final(c))
        outer.update(a, middle.final(b))
    loss = (outer.final(a) ** 2).mean()
    loss.name = "loss"
    return g, {}, [loss]


def measure(name: str, build, driver) -> dict:
    g, feed, outs = build()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "page.html"
        t0 = time.perf_counter()
        explore_script_result(g, feed, outs, path)
        gen = time.perf_counter() - t0
        size = path.stat().st_size
        driver.get(path.as_uri())
        load = driver.execute_script(
            "const t = performance.getEntriesByType('navigation')[0];"
            "return [t.domContentLoadedEventEnd, t.loadEventEnd, window.vgraphExplorer.unrolled.stats.lastDrawMs,"
            " window.vgraphExplorer.unrolled.stats.elements];"
        )
        unfold = driver.execute_script(
            "const U = window.vgraphExplorer.unrolled; U.shown.forEach(s => s.fill(1)); U.draw();"
            "return [U.stats.lastDrawMs, U.stats.elements];"
        )
    nodes = len(g.build(feed, outs))
    return {"model": name, "nodes": nodes, "bytes": size, "generate_s": round(gen, 3),
            "load_ms": round(load[1]), "first_draw_ms": round(load[2]), "drawn_elements": load[3],
            "unfold_all_ms": round(unfold[0]), "unfolded_elements": unfold[1]}  # fmt: skip


def main() -> None:
    import elman_rnn
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        rows = [
            measure("Elman RNN, 1,000 steps", lambda: elman_rnn.build(steps=1000), driver),
            measure("3-deep nest, 10x10x10", nest3, driver),
        ]
    finally:
        driver.quit()
    for r in rows:
        print(f"{r['model']:26s} {r['nodes']:6d} nodes  {r['bytes'] / 1e6:5.2f} MB  generate {r['generate_s']:.2f} s  "
              f"load {r['load_ms']} ms (first draw {r['first_draw_ms']} ms)  unfold all {r['unfold_all_ms']} ms "
              f"({r['unfolded_elements']} elements)")  # fmt: skip
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
