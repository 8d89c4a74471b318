"""Progress reporting of training loops (vgraph.tbptt.Progress, truncated_bptt(progress=...))."""

from __future__ import annotations

import io
import re
import sys

import numpy as np
import pytest

import vgraph as vg
from vgraph import nn, optim
from vgraph.tbptt import Progress, chunk_feeds, truncated_bptt


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_mode_prints_periodically_with_rate_and_eta():
    out = io.StringIO()
    with Progress(10, desc="train", mode="lines", every=3, file=out) as p:
        for i in range(10):
            p.update(loss=1.0 / (i + 1))
    lines = out.getvalue().splitlines()
    assert [re.search(r" (\d+)/10 ", ln).group(1) for ln in lines] == ["3", "6", "9", "10"]
    assert all(ln.startswith("train") and "step/s" in ln and "elapsed" in ln and "ETA" in ln for ln in lines)
    assert "loss 0.1 " in lines[-1]  # the latest metrics, 4 significant digits


def test_log_keeps_a_line_at_once_and_zero_steps_only_record():
    out = io.StringIO()
    p = Progress(100, mode="lines", file=out)
    p.update(5)
    assert out.getvalue() == ""  # every defaults to total // 10
    p.update(0, log=True, **{"held-out MSE": 0.25})
    assert (
        out.getvalue().count("\n") == 1
        and "5/100" in out.getvalue()
        and "held-out MSE 0.25" in out.getvalue()
    )


def test_auto_is_lines_when_not_a_terminal_and_a_bar_on_one():
    assert Progress(5, mode="auto", file=io.StringIO()).mode == "lines"  # logs, CI
    pytest.importorskip("tqdm")
    tty = FakeTTY()
    with Progress(5, desc="train", mode="auto", file=tty) as p:
        assert p.mode == "bar"
        for _ in range(5):
            p.update(loss=0.5)
    text = tty.getvalue()
    assert "5/5" in text and "step/s" in text and "loss 0.5" in text
    assert re.search(r"<\d\d:\d\d", text)  # tqdm's ETA


def test_without_tqdm_a_bar_falls_back_to_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    out = FakeTTY()
    p = Progress(2, mode="bar", file=out, every=1)
    assert p.mode == "lines"
    p.update(loss=1.0)
    assert "1/2" in out.getvalue() and "ETA" in out.getvalue()


def test_off_prints_nothing():
    out = io.StringIO()
    p = Progress(3, mode="off", file=out)
    p.update(3, log=True, loss=1.0)
    p.write("hello")
    assert out.getvalue() == "" and p.count == 3


@pytest.mark.parametrize(
    "kwargs,error",
    [({"mode": "fancy"}, ValueError), ({"total": "10"}, TypeError), ({"total": -1}, ValueError),
     ({"every": 0}, ValueError), ({"every": 2.5}, TypeError)],
)  # fmt: skip
def test_bad_arguments(kwargs, error):
    args = {"total": 10, **kwargs}
    with pytest.raises(error):
        Progress(**args)


def rnn():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, 2, 3))
    y = g.input("y", (None, 2, 1))
    h0 = g.input("h0", (2, 4))
    cell = nn.RNNCell(g, 3, 4, "rnn")
    head = nn.Linear(g, 4, 1, "head")
    with g.loop() as L:
        h = L.carry(h0, name="h")
        h_new = cell(L.step(x), h)
        L.update(h, h_new)
    loss = vg.losses.mse_loss(head(L.stack(h_new)), y)
    return g, loss, L.final(h)


def test_truncated_bptt_reports_each_chunk_with_its_loss(capsys):
    g, loss, h_final = rnn()
    rng = np.random.default_rng(0)
    feeds = chunk_feeds({"x": rng.standard_normal((20, 2, 3)), "y": rng.standard_normal((20, 2, 1))},
                        6, sequences=["x", "y"])  # fmt: skip
    assert len(feeds) == 4  # 6 + 6 + 6 + 2
    out = io.StringIO()
    progress = Progress(len(feeds), desc="TBPTT", mode="lines", every=1, file=out, unit="chunk")
    result = truncated_bptt(g, feeds, loss, {"h0": h_final}, {"h0": np.zeros((2, 4))},
                            optimizer=optim.SGD(g.params, lr=0.1), progress=progress)  # fmt: skip
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and all("chunk/s" in ln for ln in lines)
    for ln, value in zip(lines, result.losses):
        assert f"loss {value:.4g}" in ln
    # progress="lines" makes its own, with the total from len(feeds)
    feeds = chunk_feeds({"x": np.zeros((12, 2, 3)), "y": np.zeros((12, 2, 1))}, 6, sequences=["x", "y"])
    truncated_bptt(g, feeds, loss, {"h0": h_final}, {"h0": np.zeros((2, 4))}, progress="lines")
    assert "TBPTT  2/2" in capsys.readouterr().out
    with pytest.raises(TypeError, match="progress"):
        truncated_bptt(g, [], loss, {"h0": h_final}, {"h0": np.zeros((2, 4))}, progress=3)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: list(vg.tbptt.chunks(np.zeros(5), "5")), TypeError, "k must be an int"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 2.5)), TypeError, "k must be an int"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 0)), ValueError, ">= 1"),
        (lambda: list(vg.tbptt.chunks(5.0, 2)), ValueError, "scalar"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 2, axis=1)), ValueError, "axis 1"),
        (lambda: chunk_feeds({"xs": np.zeros(4)}, 2, sequences="xs"), TypeError, r"\['xs'\]"),
        (lambda: chunk_feeds([1, 2], 2, sequences=["x"]), TypeError, "feed must be a mapping"),
        (lambda: chunk_feeds({"x": np.zeros(4)}, 2, sequences=["y"]), ValueError, "not in the feed"),
    ],
)
def test_chunking_misuse_is_a_typed_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_truncated_bptt_misuse_is_refused_before_any_change():
    g, loss, h_final = rnn()
    before = g.state_dict()
    feeds = [{"x": np.zeros((3, 2, 3)), "y": np.zeros((3, 2, 1))}]
    init = {"h0": np.zeros((2, 4))}
    for kwargs, error, match in [
        ({"graph": "g"}, TypeError, "graph must be a VirtualGraph"),
        ({"optimizer": "adam"}, TypeError, "optimizer must have a step"),
        ({"state": [h_final]}, TypeError, "state must be a mapping"),
        ({"callback": 3}, TypeError, "callback must be callable"),
        ({"initial": {"c0": np.zeros((2, 4))}}, ValueError, "differ"),
    ]:
        args = {"graph": g, "feeds": feeds, "loss": loss, "state": {"h0": h_final}, "initial": init, **kwargs}
        with pytest.raises(error, match=match):
            truncated_bptt(**args)
    after = g.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in g.params.values())
