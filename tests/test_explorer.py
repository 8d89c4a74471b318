"""The explorer page (vgraph.render.explore): the generated HTML and its embedded JSON, then the page
itself in a real browser.

Unit tests read the page's JSON and check it against numpy computed here. Browser tests drive
Debian's ``chromium`` with ``chromedriver`` through selenium (headless): unfold a folded loop,
hover a node, search a key, hover the gradient-through-time chart. They are skipped when
chromium, chromedriver or selenium is missing, unless ``VGRAPH_REQUIRE_BROWSER=1`` is set (as in
CI), in which case they fail.
"""

from __future__ import annotations

import html
import importlib.util
import itertools
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import vgraph as vg
from vgraph import render as R
from vgraph.compute import ComputeGraph
from vgraph.render import ExplorerPage, explore, explore_script_result

pytestmark = pytest.mark.usefixtures("per_node")  # (conftest) per-node pages; of programs: test_programs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"


# ---------------------------------------------------------------------------- helpers


def load_model(name: str):
    spec = importlib.util.spec_from_file_location(f"explorer_model_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def elman(steps: int):
    """The example Elman RNN built for ``steps`` steps, backward run with every gradient kept."""
    g, feed, outs = load_model("elman_rnn").build(steps=steps)
    cg = g.build(feed, outs)
    R.retain_all_grads(cg)
    cg.backward(cg.outputs[0])
    return g, cg


def page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="vg-data">(.*?)</script>', page, re.S)
    assert m is not None, "no embedded data"
    return json.loads(m.group(1))


def number(v) -> float:
    return {"NaN": np.nan, "Inf": np.inf, "-Inf": -np.inf}.get(v, v) if isinstance(v, str) else float(v)


# ---------------------------------------------------------------------------- the page and its data


def test_page_is_self_contained():
    g, cg = elman(5)
    page = explore(g, build=cg)
    assert page.startswith("<!DOCTYPE html>")
    # nothing fetched at view time: no src/href pointing anywhere, no external stylesheet or script
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:|//)""", page, re.I)
    assert "<link" not in page.lower()
    assert not re.search(r"<script[^>]*\bsrc=", page, re.I)
    assert "@import" not in page
    virtual = page_data(page)["virtual"]
    if shutil.which("dot") is not None:
        assert "<svg" in virtual["svg"][:10] and virtual["error"] is None
    else:  # without dot the page still works and says why the virtual view is missing
        assert virtual["svg"] is None and "dot program was not found" in virtual["error"]


def test_every_node_key_and_virtual_node_is_in_the_page():
    g, cg = elman(12)
    data = page_data(explore(g, build=cg))
    keys = data["unrolled"]["nodes"]["key"]
    assert sorted(keys) == sorted(str(n.key) for n in cg.nodes())
    assert set(data["virtual"]["nodes"]) == {f"{v.type}:{v.id}" for v in g.nodes}
    assert "Tanh:1@11" in keys


def test_statistics_and_gradient_norms_match_numpy():
    g, cg = elman(7)
    cols = page_data(explore(cg))["unrolled"]["nodes"]
    checked = 0
    for i, key in enumerate(cols["key"]):
        n = cg.node(key)
        v = np.asarray(n.value, dtype=np.float64)
        expected = [v.min(), v.max(), v.sum() / v.size, np.sqrt((v * v).sum())]
        np.testing.assert_allclose([number(s) for s in cols["stats"][i]], expected, rtol=1e-5, atol=1e-12)
        if n.grad is None:
            assert cols["grad"][i] is None
        else:
            gr = np.asarray(n.grad, dtype=np.float64)
            np.testing.assert_allclose(number(cols["grad"][i]), np.sqrt((gr * gr).sum()), rtol=1e-5)
            checked += 1
    assert checked > 30  # intermediate nodes kept their gradients


def test_node_details_columns():
    g, cg = elman(3)
    X = page_data(explore(cg))["unrolled"]
    S, cols = X["strings"], X["nodes"]
    i = cols["key"].index("Tanh:1@2")
    assert S[cols["name"][i]] == "h_t"
    assert S[cols["op"][i]] == "Tanh"
    assert S[cols["shape"][i]] == "(2, 4)"
    assert S[cols["dtype"][i]] == "float64"
    run, t, idx = X["frames"][cols["frame"][i]]
    assert (t, idx) == (2, "2") and X["runs"][run]["trips"] == 3
    assert sorted(cols["key"][p] for p in cols["parents"][i]) == ["Add:2@2"]
    j = cols["key"].index("Parameter:1")
    assert cols["op"][j] == -1 and cols["frame"][j] == -1


def test_gradient_through_time_series_matches_hand_computed_rows():
    g, cg = elman(6)
    series = {s["param"]: s for s in page_data(explore(cg))["unrolled"]["series"]}
    assert set(series) == {"Wx", "Wh", "b"}  # Wo is used after the loop only
    s = series["Wx"]
    assert s["loop"] == "Loop:1" and len(s["norms"]) == 6
    for t in range(6):  # d loss / d Wx from iteration t = x_t^T @ grad(x_t @ Wx)
        x_t = np.asarray(cg.node(f"Item:1@{t}").value)
        g_t = np.asarray(cg.node(f"MatMul:1@{t}").grad)
        np.testing.assert_allclose(s["norms"][t], np.linalg.norm(x_t.T @ g_t), rtol=1e-5)


def test_no_series_without_retained_gradients():
    g, feed, outs = load_model("elman_rnn").build(steps=4)
    cg = g.build(feed, outs)
    cg.backward(cg.outputs[0])  # leaves only
    X = page_data(explore(cg))["unrolled"]
    assert X["series"] == [] and X["hasGrad"] is True


def test_names_cannot_break_out_of_the_script_element():
    g = vg.VirtualGraph(dtype=np.float64, name="</script><b>x</b>")
    x = g.input("x", shape=(2,))
    y = vg.tanh(x)
    y.name = "</script><script>alert(1)</script>"
    cg = g.build({"x": np.array([0.5, -1.0])}, y)
    page = explore(cg)
    assert "</script><script>alert(1)" not in page
    data = page_data(page)
    assert y.name in [data["unrolled"]["strings"][i] for i in data["unrolled"]["nodes"]["name"] if i >= 0]
    assert "<title>&lt;/script&gt;" in page


# Strings that broke (or could break) the page: an HTML comment opener or closer, the end of the
# script element, quotes, a backslash, a JavaScript line separator, the page's template markers.
NASTY = "a<!--b</script>c-->d\"e'f\\g\u2028h\u2029i%%DATA%%j%%TITLE%%k%%SCRIPT%%&amp;"


def nasty_model(mark: str = NASTY):
    """An RNN whose every user string (title, input, parameter, loop, carry and node names)
    contains ``mark``; built, backward run with every gradient kept."""
    g = vg.VirtualGraph(dtype=np.float64, name=mark + "title")
    x = g.input(mark + "x", shape=(None, 2))
    W = g.parameter(mark + "W", (2, 2))
    h0 = g.constant(np.zeros(2), name=mark + "h0")
    with g.loop(name=mark + "loop") as loop:
        xt = loop.step(x, name=mark + "xt")
        h = loop.carry(h0, name=mark + "h")
        hn = vg.tanh(xt @ W + h)
        hn.name = mark + "hn"
        loop.update(h, hn)
    loss = (loop.final(h) ** 2).mean()
    cg = g.build({mark + "x": np.ones((3, 2))}, loss)
    R.retain_all_grads(cg)
    cg.backward(cg.outputs[0])
    return g, cg


def test_user_strings_are_embedded_as_valid_json_that_cannot_leave_the_script():
    g, cg = nasty_model()
    page = explore(g, build=cg)
    m = re.search(r'<script type="application/json" id="vg-data">(.*?)</script>', page, re.S)
    text = m.group(1)
    for bad in ("<", ">", "&", "\u2028", "\u2029"):  # written as \u003c … inside the JSON
        assert bad not in text
    data = json.loads(text)
    assert data["title"] == NASTY + "title"
    names = {data["unrolled"]["strings"][i] for i in data["unrolled"]["nodes"]["name"] if i >= 0}
    assert {NASTY + "x", NASTY + "W", NASTY + "hn", NASTY + "xt"} <= names
    assert any(r["label"] == f"<Loop:1> {NASTY}loop" for r in data["unrolled"]["runs"])
    assert data["unrolled"]["series"][0]["param"] == NASTY + "W"
    # one data script, one program script: nothing substituted inside substituted text
    assert page.count('id="vg-data"') == 1 and page.count("<script>") == 1
    assert f"<title>{html.escape(NASTY + 'title')} — vgraph explorer</title>" in page


@pytest.mark.parametrize("marker", ["%%DATA%%", "%%SCRIPT%%", "%%STYLE%%", "%%TITLE%%"])
def test_template_markers_in_a_title_stay_text(marker):
    cg = ComputeGraph(dtype=np.float64)
    cg.input(np.ones(2), name=marker)
    page = explore(cg, title=marker)
    assert page_data(page)["title"] == marker
    assert f"<title>{marker} — vgraph explorer</title>" in page
    assert page.count('id="vg-data"') == 1 and page.count("<style>") == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"title": 5}, "title"),
        ({"fold": 3}, "fold"),
        ({"fold": (1, "2")}, "fold"),
        ({"fold": (1, 2.0)}, "fold"),
        ({"fold": (1, 2, 3)}, "fold"),
        ({"virtual_view": "no"}, "virtual_view"),
    ],
)
def test_wrong_argument_types_are_typed_errors_and_write_nothing(kwargs, name, tmp_path):
    g, cg = elman(2)
    out = tmp_path / "page.html"
    with pytest.raises(vg.errors.ArgumentError, match=name) as info:
        explore(g, out, build=cg, **kwargs)
    assert isinstance(info.value, TypeError)
    assert not out.exists()
    with pytest.raises(vg.errors.ArgumentError, match="path"):
        explore(g, 3, build=cg)
    m_g, feed, outs = load_model("elman_rnn").build(steps=2)
    with pytest.raises(vg.errors.ArgumentError, match="title"):
        explore_script_result(m_g, feed, outs, out, title=5)
    with pytest.raises(vg.errors.ArgumentError, match="gradients"):
        explore_script_result(m_g, feed, outs, out, gradients="yes")
    assert not out.exists()


def test_declared_view_is_the_plain_unroll():
    g, feed, outs = load_model("elman_rnn").build(steps=4)
    cg = g.build(feed, outs)  # hoisting on (the default)
    X = page_data(explore(cg))["unrolled"]
    keys, S = X["nodes"]["key"], X["strings"]
    plain = g.build(feed, outs, hoist=False)
    assert {keys[i] for i in X["declared"]["hide"]} == {"Item*:1", "MatMul*:1", "Add*:2"}
    rewritten = {keys[i]: (S[op], [keys[p] for p in ps]) for i, op, ps in X["declared"]["nodes"]}
    assert set(rewritten) == {f"{k}@{t}" for k in ("Item:1", "MatMul:1", "Add:2") for t in range(4)}
    for key, (op, parents) in rewritten.items():  # GetItem of x, x_t @ W_x, (…) + b
        n = plain.node(key)
        assert op == n.op.name and parents == [str(p.key) for p in n.parents], key
    assert page_data(explore(plain))["unrolled"]["declared"] is None  # nothing differs


@pytest.mark.parametrize("name", sorted(p.stem for p in MODELS.glob("*.py")))
def test_declared_view_of_every_example_model_has_the_plain_unrolls_nodes_and_edges(name):
    g, feed, outs = load_model(name).build()
    X = page_data(explore(g.build(feed, outs)))["unrolled"]
    keys = X["nodes"]["key"]
    declared = X["declared"] or {"hide": [], "nodes": []}
    hidden = {keys[i] for i in declared["hide"]}
    parents = {
        keys[i]: [keys[p] for p in ps] for i, ps in enumerate(X["nodes"]["parents"]) if keys[i] not in hidden
    }
    parents.update({keys[i]: [keys[p] for p in ps] for i, _, ps in declared["nodes"]})
    plain = g.build(feed, outs, hoist=False)
    assert parents == {str(n.key): [str(p.key) for p in n.parents] for n in plain.nodes()}


def test_nan_and_infinite_values_are_encoded():
    cg = ComputeGraph(dtype=np.float64)
    a = cg.input(np.array([1.0, np.inf, -np.inf]), name="a")
    cg.constant(np.array([np.nan, 1.0]), name="c")
    cols = page_data(explore(cg))["unrolled"]["nodes"]
    stats = dict(zip(cols["key"], cols["stats"]))
    assert stats[str(a.key)][:2] == ["-Inf", "Inf"] and stats[str(a.key)][3] == "Inf"
    assert all(v == "NaN" for v in stats["Constant:1"])


def ragged_nest():
    """Two nested loops; the inner one runs 0 iterations in the outer iteration 0, then 1."""
    g = vg.VirtualGraph(dtype=np.float64, name="ragged")
    x = g.input("x", shape=(3,))
    W = g.parameter("W", (3, 3))
    with g.loop(times=3, name="outer") as outer:
        a = outer.carry(x, name="a")
        with g.loop(while_=lambda t, s: t < 1 and float(s["b"].sum()) > 3.5, name="inner") as inner:
            b = inner.carry(a, name="b")
            inner.update(b, vg.tanh(b @ W))
        outer.update(a, inner.final(b) + 1.0)
    loss = (outer.final(a) ** 2).mean()
    cg = g.build({"x": np.ones(3)}, loss)
    R.retain_all_grads(cg)
    cg.backward(cg.outputs[0])
    return g, cg


def test_loop_runs_without_iterations():
    g, cg = ragged_nest()
    X = page_data(explore(cg))["unrolled"]
    trips = {(r["label"], r["outer"]): r["trips"] for r in X["runs"]}
    assert trips == {("<Loop:1> outer", ""): 3, ("<Loop:2> inner", "0"): 0, ("<Loop:2> inner", "1"): 1,
                     ("<Loop:2> inner", "2"): 1}  # fmt: skip
    assert sorted(X["nodes"]["key"]) == sorted(str(n.key) for n in cg.nodes())
    (inner,) = (r for r in X["runs"] if r["outer"] == "1")
    assert [X["frames"][f] for f in inner["frames"]] == [[X["runs"].index(inner), 0, "1.0"]]
    S, cols = X["strings"], X["nodes"]
    note = cols["note"][cols["key"].index("Constant:1")]
    assert S[note] == "= 1"


def test_plain_compute_graph_has_no_virtual_view():
    cg = ComputeGraph(dtype=np.float64)
    x = cg.input(np.ones(3), name="x")
    w = cg.parameter(np.ones(3), name="w")
    (x * w).sum()
    data = page_data(explore(cg))
    assert "virtual" not in data and len(data["unrolled"]["nodes"]["key"]) == 4


def test_virtual_graph_alone_and_path_written(tmp_path):
    g, _ = elman(2)
    out = tmp_path / "model.html"
    page = explore(g, out, title="my model")
    assert out.read_text(encoding="utf-8") == page
    data = page_data(page)
    assert (
        data["title"] == "my model"
        and "unrolled" not in data
        and "copies" not in data["virtual"]["nodes"]["Tanh:1"]
    )


def test_virtual_nodes_know_their_unrolled_copies():
    g, cg = elman(5)
    info = page_data(explore(g, build=cg))["virtual"]["nodes"]
    assert info["Tanh:1"]["copies"] == 5 and info["Tanh:1"]["first"] == ["Tanh:1@0", "Tanh:1@1", "Tanh:1@2"]
    assert info["Parameter:2"]["share"] is True and info["Parameter:2"]["copies"] == 1


def test_bad_arguments_are_refused(tmp_path):
    g, cg = elman(2)
    other, _ = elman(2)
    with pytest.raises(vg.errors.ArgumentError, match="VirtualGraph or a ComputeGraph"):
        explore("graph")
    with pytest.raises(ValueError, match="build of this VirtualGraph"):
        explore(other, build=cg)
    with pytest.raises(vg.errors.ArgumentError, match="UnrolledGraph"):
        explore(g, build=ComputeGraph())
    with pytest.raises(ValueError, match="applies to a VirtualGraph"):
        explore(cg, build=cg)
    with pytest.raises(ValueError, match="fold must be"):
        explore(cg, fold=(3, -1))
    with pytest.raises(vg.errors.ArgumentError, match="VirtualGraph"):
        explore_script_result(cg, {}, [], tmp_path / "x.html")
    assert not (tmp_path / "x.html").exists()


def test_jupyter_display_is_the_page_in_an_iframe():
    g, cg = elman(2)
    page = explore(g, build=cg)
    assert isinstance(page, ExplorerPage) and isinstance(page, str)
    frame = page._repr_html_()
    assert frame.startswith("<iframe srcdoc=")
    doc = re.match(r'<iframe srcdoc="([^"]*)"', frame).group(1)
    assert html.unescape(doc) == page


@pytest.mark.parametrize("name", sorted(p.stem for p in MODELS.glob("*.py")))
def test_every_example_model(name, tmp_path):
    module = load_model(name)
    g, feed, outs = module.build()
    page = explore_script_result(g, feed, outs, tmp_path / f"{name}.html")
    data = page_data(page)
    assert len(data["unrolled"]["nodes"]["key"]) == len(g.build(feed, outs))
    assert data["unrolled"]["hasGrad"]


# ---------------------------------------------------------------------------- in a real browser

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through selenium: skipped when missing, unless VGRAPH_REQUIRE_BROWSER=1."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium")
    if missing:
        message = "browser tests need " + ", ".join(missing)
        if os.environ.get("VGRAPH_REQUIRE_BROWSER") == "1":
            pytest.fail(message + " (VGRAPH_REQUIRE_BROWSER=1)")
        pytest.skip(message)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def rnn50_page(browser, tmp_path_factory):
    """The 50-step Elman RNN's page, loaded; returns (driver, cg)."""
    with vg.body_programs(False):  # (a module's fixture: made before the tests' per_node)
        g, cg = elman(50)
    path = tmp_path_factory.mktemp("explorer") / "rnn50.html"
    explore(g, path, build=cg)
    return browser, cg, path.as_uri()


def _load(driver, uri):
    driver.get(uri)
    assert driver.execute_script("return window.vgraphExplorer && window.vgraphExplorer.ready") is True
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def test_browser_unfold_and_fold_back(rnn50_page):
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)

    def frames() -> list[int]:
        return sorted(
            int(e.get_attribute("data-t")) for e in driver.find_elements(By.CSS_SELECTOR, ".vg-frame")
        )

    assert frames() == [0, 1, 2, 47, 48, 49]
    fold = driver.find_element(By.CSS_SELECTOR, ".vg-fold")
    assert "44 iterations" in fold.text
    fold.click()  # a long stretch unfolds 10 iterations at each end; the middle stays folded
    assert frames() == [*range(13), *range(37, 50)]
    driver.find_element(By.CSS_SELECTOR, ".vg-fold").click()  # 24 left: all of them
    assert frames() == list(range(50))
    assert driver.find_elements(By.CSS_SELECTOR, ".vg-fold") == []
    driver.find_element(By.CSS_SELECTOR, '.vg-btn[data-act="fold"]').click()
    assert frames() == [0, 1, 2, 47, 48, 49]


def test_browser_hover_shows_key_and_statistics(rnn50_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    node = driver.find_element(By.CSS_SELECTOR, '.vg-n[data-key="Tanh:1@1"]')
    ActionChains(driver).move_to_element(node).perform()
    assert driver.find_element(By.ID, "vg-info-key").text == "<Tanh:1@1>"
    v = np.asarray(cg.node("Tanh:1@1").value, dtype=np.float64)
    gr = np.asarray(cg.node("Tanh:1@1").grad, dtype=np.float64)
    shown = {
        e.get_attribute("data-stat"): float(e.text)
        for e in driver.find_elements(By.CSS_SELECTOR, "#vg-info [data-stat]")
    }
    expected = {"min": v.min(), "max": v.max(), "mean": v.mean(), "norm": np.sqrt((v * v).sum()),
                "grad": np.sqrt((gr * gr).sum())}  # fmt: skip
    assert set(shown) == set(expected)
    for k, want in expected.items():
        assert shown[k] == pytest.approx(want, rel=1e-4), k
    info = driver.find_element(By.ID, "vg-info").text
    assert "h_t" in info and "Tanh" in info and "(2, 4)" in info and "float64" in info


def test_browser_search_unfolds_and_scrolls_to_the_node(rnn50_page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    assert driver.find_elements(By.CSS_SELECTOR, '.vg-n[data-key="Tanh:1@37"]') == []  # folded away
    box = driver.find_element(By.ID, "vg-search-input")
    box.send_keys("Tanh:1@37", Keys.ENTER)
    node = driver.find_element(By.CSS_SELECTOR, '.vg-n[data-key="Tanh:1@37"]')
    assert "hit" in node.get_attribute("class").split()
    inside = driver.execute_script(
        "const n = arguments[0].getBoundingClientRect(), p = document.getElementById('vg-pane-unrolled').getBoundingClientRect();"
        "return n.top >= p.top && n.bottom <= p.bottom && n.left >= p.left && n.right <= p.right;",
        node,
    )
    assert inside
    assert driver.find_element(By.ID, "vg-info-key").text == "<Tanh:1@37>"
    box.clear()
    box.send_keys("Nope:9@9", Keys.ENTER)
    assert "no node" in driver.find_element(By.ID, "vg-status").text


def test_browser_gradient_chart_highlights_the_hovered_iteration(rnn50_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    hit = driver.find_element(By.ID, "vg-chart-hit")
    assert driver.find_element(By.ID, "vg-chart-svg").get_attribute("data-param") == "Wx"
    w = hit.rect["width"]
    # iteration 1 of 50 sits at 1/49 of the plot width; offsets are from the element's centre
    ActionChains(driver).move_to_element_with_offset(hit, int(-w / 2 + w * 1 / 49), 0).perform()
    assert driver.find_element(By.ID, "vg-chart-read").text.startswith("t=1 ")
    highlighted = driver.find_elements(By.CSS_SELECTOR, ".vg-frame.hl")
    assert [e.get_attribute("data-t") for e in highlighted] == ["1"]
    x_t, g_t = cg.node("Item:1@1").value, cg.node("MatMul:1@1").grad
    assert float(driver.find_element(By.ID, "vg-chart-value").text) == pytest.approx(
        np.linalg.norm(np.asarray(x_t).T @ np.asarray(g_t)), rel=1e-4
    )
    # a folded iteration highlights its fold node
    ActionChains(driver).move_to_element_with_offset(hit, int(-w / 2 + w * 20 / 49), 0).perform()
    assert [e.get_attribute("class") for e in driver.find_elements(By.CSS_SELECTOR, ".hl")] == ["vg-fold hl"]


def test_browser_chart_of_a_clicked_node(rnn50_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    driver.find_element(By.CSS_SELECTOR, '.vg-n[data-key="Tanh:1@1"]').click()
    assert driver.find_element(By.ID, "vg-chart-svg").get_attribute("data-param") == "Tanh:1"
    hit = driver.find_element(By.ID, "vg-chart-hit")
    w = hit.rect["width"]
    ActionChains(driver).move_to_element_with_offset(hit, int(-w / 2 + w * 30 / 49), 0).perform()
    assert driver.find_element(By.ID, "vg-chart-read").text.startswith("t=30 ")
    g = np.asarray(cg.node("Tanh:1@30").grad, dtype=np.float64)
    assert float(driver.find_element(By.ID, "vg-chart-value").text) == pytest.approx(
        np.sqrt((g * g).sum()), rel=1e-4
    )


def test_browser_pages_of_other_models_draw_without_errors(browser, tmp_path):
    from selenium.webdriver.common.by import By

    g, cg = ragged_nest()
    pages = {"ragged": explore(g, tmp_path / "ragged.html", build=cg)}
    for name in ("stacked_rnn", "branching"):
        m_g, feed, outs = load_model(name).build()
        pages[name] = explore_script_result(m_g, feed, outs, tmp_path / f"{name}.html")
    for name in pages:
        _load(browser, (tmp_path / f"{name}.html").as_uri())
        drawn = {e.get_attribute("data-key") for e in browser.find_elements(By.CSS_SELECTOR, ".vg-n")}
        keys = set(page_data(pages[name])["unrolled"]["nodes"]["key"])
        assert drawn and drawn <= keys, name
        if name == "ragged":
            assert "no iterations" in browser.find_element(By.ID, "vg-pane-unrolled").text


def test_browser_virtual_tab(rnn50_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    driver.find_element(By.ID, "vg-tab-virtual").click()
    assert driver.find_element(By.ID, "vg-pane-unrolled").get_attribute("hidden") is not None
    node = driver.find_element(By.CSS_SELECTOR, '#vg-pane-virtual g.node[data-vkey="Tanh:1"]')
    ActionChains(driver).move_to_element(node).perform()
    assert driver.find_element(By.ID, "vg-info-key").text == "<Tanh:1>"
    assert "50" in driver.find_element(By.ID, "vg-info").text  # unrolled copies


def _severe(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_browser_shows_every_user_string_exactly(browser, tmp_path):
    g, cg = nasty_model()
    page = explore(g, tmp_path / "nasty.html", build=cg)
    _load(browser, (tmp_path / "nasty.html").as_uri())  # rendered: the script ran, no error logged
    js = browser.execute_script
    assert js("return window.vgraphExplorer.data") == page_data(page)  # the JSON reads back exactly
    assert browser.title == NASTY + "title — vgraph explorer"
    assert js("return document.getElementById('vg-title').textContent") == NASTY + "title"
    assert js("return window.vgraphExplorer.findKey('Tanh:1@1')") is True
    rows = js(
        "return Object.fromEntries([...document.querySelectorAll('#vg-info tr')].map(r => [r.cells[0].textContent, r.cells[1].textContent]))"
    )
    assert rows["name"] == NASTY + "hn"
    assert rows["iteration"] == f"t=1 of <Loop:1> {NASTY}loop"
    texts = js("return [...document.querySelectorAll('#vg-pane-unrolled svg text')].map(t => t.textContent)")
    assert f"<Loop:1> {NASTY}loop · 3 iterations" in texts  # the loop's box
    stubs = js("return [...document.querySelectorAll('.vg-stub')].map(t => [t.dataset.key, t.textContent])")
    cut = NASTY[:17] + "…"  # a stub shows the first characters of a long name: the parameter …
    assert ["Parameter:1", cut] in stubs
    assert ["Input:1", cut] in stubs  # … and the input read in each iteration
    assert f"{NASTY}hn" in texts and f"{NASTY}xt" in texts  # node labels
    option = js("return document.querySelector('#vg-series option').textContent")
    assert option == f"{NASTY}W <Parameter:1> over <Loop:1> {NASTY}loop"  # the chart of the parameter
    js("window.vgraphExplorer.findKey('Input:1')")
    assert js("return document.querySelector('#vg-info td').textContent") == NASTY + "x"
    if shutil.which("dot") is not None:  # the virtual view: the declared node's details
        assert js("return window.vgraphExplorer.findKey('Tanh:1')") is True
        assert js("return document.querySelector('#vg-info td').textContent") == NASTY + "hn"
        assert js("return document.getElementById('vg-pane-virtual').querySelector('svg') !== null")
    assert _severe(browser) == []


def test_browser_fit_keeps_a_tall_graph_readable(rnn50_page):
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    driver.find_element(By.CSS_SELECTOR, '.vg-btn[data-act="unfold"]').click()  # 50 iterations: very tall
    driver.find_element(By.CSS_SELECTOR, '#vg-toolbar [data-act="fit"]').click()
    zoom = int(driver.find_element(By.ID, "vg-zoom").text.rstrip("%")) / 100
    assert zoom >= 0.7  # not the 10% that would show it whole
    width, pane, scrollable = driver.execute_script(
        "const p = document.getElementById('vg-pane-unrolled'), s = p.querySelector('svg');"
        "return [s.getBoundingClientRect().width, p.clientWidth, p.scrollHeight > p.clientHeight];"
    )
    assert width <= pane and scrollable  # its width fits; the user scrolls down


def test_browser_search_zooms_to_a_readable_scale_and_centres_the_node(rnn50_page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    for _ in range(6):
        driver.find_element(By.CSS_SELECTOR, '#vg-toolbar [data-act="zoom-out"]').click()
    assert int(driver.find_element(By.ID, "vg-zoom").text.rstrip("%")) < 30
    driver.find_element(By.ID, "vg-search-input").send_keys("Tanh:1@25", Keys.ENTER)
    assert int(driver.find_element(By.ID, "vg-zoom").text.rstrip("%")) >= 100
    dx, dy, wide = driver.execute_script(
        "const n = document.querySelector('.vg-n[data-key=\"Tanh:1@25\"]').getBoundingClientRect(),"
        " p = document.getElementById('vg-pane-unrolled'), r = p.getBoundingClientRect();"
        "return [n.left + n.width / 2 - (r.left + p.clientWidth / 2), n.top + n.height / 2 - (r.top + p.clientHeight / 2),"
        " p.scrollWidth > p.clientWidth];"
    )
    assert abs(dy) <= 2 and (abs(dx) <= 2 or not wide)  # (a drawing narrower than the pane is centred in it)


def test_browser_found_node_stays_in_the_panel_until_the_pointer_moves(rnn50_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.action_builder import ActionBuilder
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver, cg, uri = rnn50_page
    where = "const r = document.querySelector('.vg-n[data-key=\"MatMul:2@37\"]').getBoundingClientRect(); return [Math.round(r.left + 8), Math.round(r.top + 8)];"
    _load(driver, uri)
    driver.find_element(By.ID, "vg-search-input").send_keys("Tanh:1@37", Keys.ENTER)
    x, y = driver.execute_script(where)  # where another node sits once the search has scrolled
    _load(driver, uri)
    pointer = ActionBuilder(driver)
    pointer.pointer_action.move_to_location(x, y)
    pointer.perform()  # the pointer rests there, over something else, and does not move again
    driver.find_element(By.ID, "vg-search-input").send_keys("Tanh:1@37", Keys.ENTER)
    assert driver.execute_script(where) == [x, y]  # the other node is now under the still pointer
    driver.execute_script(  # what the browser does when the drawing moves under a still pointer
        "const el = document.elementFromPoint(arguments[0], arguments[1]);"
        "el.dispatchEvent(new MouseEvent('mouseover', {bubbles: true, clientX: arguments[0], clientY: arguments[1]}));",
        x,
        y,
    )
    driver.execute_script("return new Promise(r => setTimeout(r, 300))")
    assert driver.find_element(By.ID, "vg-info-key").text == "<Tanh:1@37>"
    ActionChains(driver).move_by_offset(3, 2).perform()  # a real move: hovering works again
    assert driver.find_element(By.ID, "vg-info-key").text == "<MatMul:2@37>"


def _stub_boxes(driver) -> list:
    return driver.execute_script(
        "return [...document.querySelectorAll('#vg-pane-unrolled .vg-stub')].map(t => { const b = t.getBBox();"
        " return [t.textContent, b.x, b.y, b.x + b.width, b.y + b.height]; })"
    )


def _overlapping(boxes) -> list:
    return [
        (a[0], b[0])
        for k, a in enumerate(boxes)
        for b in boxes[k + 1 :]
        if a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5 and a[2] < b[4] - 0.5 and b[2] < a[4] - 0.5
    ]


def test_browser_stub_labels_do_not_overlap(browser, tmp_path):
    from selenium.webdriver.common.by import By

    # W_hidden and the hoisted group <Add*:2> meet the top of the same narrow sum (as executed)
    g = vg.VirtualGraph(dtype=np.float64, name="stubs")
    x = g.input("x", shape=(None, 1, 2))
    W_x, W_h, b = g.parameter("W_x", (2, 3)), g.parameter("W_hidden", (3, 3)), g.parameter("b", (3,))
    with g.loop(name="time") as loop:
        h = loop.carry(g.constant(np.zeros((1, 3)), name="h0"), name="h")
        loop.update(h, vg.tanh(loop.step(x) @ W_x + h @ W_h + b))
    cg = g.build({"x": np.ones((4, 1, 2))}, loop.final(h))
    explore(cg, tmp_path / "stubs.html")
    _load(browser, (tmp_path / "stubs.html").as_uri())
    for mode, labels in (("executed", {"W_hidden", "Add*:2"}), ("declared", {"W_hidden", "W_x", "b"})):
        buttons = browser.find_elements(By.CSS_SELECTOR, f'#vg-mode [data-mode="{mode}"]')
        if buttons and buttons[0].is_displayed():
            buttons[0].click()
        boxes = _stub_boxes(browser)
        assert _overlapping(boxes) == [], mode
        assert labels <= {b[0] for b in boxes}, mode
    assert _severe(browser) == []


def test_browser_node_text_lines_do_not_overlap(rnn50_page):
    driver, cg, uri = rnn50_page
    _load(driver, uri)
    nodes = driver.execute_script(
        "return [...document.querySelectorAll('#vg-pane-unrolled .vg-n')].map(g => { const r = g.querySelector('rect').getBBox();"
        " return [g.dataset.key, [r.y, r.y + r.height], [...g.querySelectorAll('text')].map(t => { const b = t.getBBox();"
        " return [t.textContent, b.y, b.y + b.height]; })]; })"
    )
    assert any("h_t" in line[0] for _, _, lines in nodes for line in lines)  # an underscore in a name
    for key, (top, bottom), lines in nodes:
        for (_, _, low), (text, high, _) in itertools.pairwise(lines):
            assert low <= high + 0.01, (key, text)  # each line ends above the next one's top
        assert top <= lines[0][1] and lines[-1][2] <= bottom + 0.01, key


def test_browser_legend_fits_its_box(rnn50_page):
    driver, cg, uri = rnn50_page
    try:
        for width in (1400, 560):
            driver.set_window_size(width, 900)
            _load(driver, uri)
            legend, cells = driver.execute_script(
                "const L = document.getElementById('vg-legend'), T = document.getElementById('vg-toolbar'),"
                " l = L.getBoundingClientRect(), t = T.getBoundingClientRect();"
                "return [[l.left, l.right, t.left, t.right, L.scrollWidth, L.clientWidth],"
                " [...L.querySelectorAll('.cell')].map(c => [c.textContent, c.scrollWidth, c.clientWidth, c.getBoundingClientRect().right])];"
            )
            left, right, tleft, tright, scroll, client = legend
            assert len(cells) >= 4 and tleft <= left and right <= tright and scroll <= client, width
            for text, sw, cw, cright in cells:
                assert sw <= cw and cright <= tright, (width, text)
    finally:
        driver.set_window_size(1400, 900)


def test_browser_as_declared_by_default_as_executed_on_request(rnn50_page):
    from selenium.webdriver.common.by import By

    driver, cg, uri = rnn50_page
    _load(driver, uri)
    executed_only = ("Hoisted", "AddRow", "MatMulAddRow")

    def drawn() -> dict:
        return driver.execute_script(
            "return Object.fromEntries([...document.querySelectorAll('#vg-pane-unrolled .vg-n')].map(g => [g.dataset.key, g.textContent]))"
        )

    assert any(n.key.type.endswith("*") for n in cg.nodes())  # built with hoisting
    nodes = drawn()
    assert "Add:2@1" in nodes and not any("*" in k for k in nodes)
    assert not any(op in text for text in nodes.values() for op in executed_only)
    assert (
        driver.find_element(By.CSS_SELECTOR, '#vg-mode [data-mode="declared"]').get_attribute("aria-pressed")
        == "true"
    )
    driver.execute_script("window.vgraphExplorer.findKey('Add:2@1')")
    inputs = driver.execute_script(
        "return [...document.querySelectorAll('#vg-info tr')].find(r => r.cells[0].textContent === 'inputs').cells[1].textContent"
    )
    assert inputs.split() == ["Add:1@1", "Parameter:3"]  # x_t @ W_x + h @ W_h, then + b: as declared
    driver.find_element(By.CSS_SELECTOR, '#vg-mode [data-mode="executed"]').click()
    nodes = drawn()
    assert {"Item*:1", "MatMul*:1", "Add*:2"} <= set(nodes)
    assert "MatMulAddRow" in nodes["Add:2@1"] and "Hoisted" in nodes["MatMul:1@1"]
    driver.find_element(By.CSS_SELECTOR, '#vg-mode [data-mode="declared"]').click()
    assert not any("*" in k for k in drawn())
    assert _severe(driver) == []


def test_browser_no_view_toggle_without_hoisting(browser, tmp_path):
    from selenium.webdriver.common.by import By

    g, feed, outs = load_model("elman_rnn").build(steps=4)
    explore(g.build(feed, outs, hoist=False), tmp_path / "plain.html")
    _load(browser, (tmp_path / "plain.html").as_uri())
    assert not browser.find_element(By.ID, "vg-mode").is_displayed()


def test_cli_writes_the_explorer_page(tmp_path):
    from vgraph.cli import main

    out = tmp_path / "page.html"
    assert main(["render", str(MODELS / "stacked_rnn.py"), "--html", str(out), "--set", "steps=3"]) == 0
    X = page_data(out.read_text())["unrolled"]
    assert X is not None and X["hasGrad"] is True
    assert main(["render", str(MODELS / "stacked_rnn.py")]) == 2  # neither -o nor --html
